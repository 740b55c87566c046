# about: live update of a VM with vsock (every Kata VM has one: its agent's channel): a host program keeps one connection to a Linux guest's vsock echo server and echoes 64 KiB through it every quarter second while `gpuvm update` hands the VM to a new process, twice, the first time with the old process dying (abort) after the new one is ready and before it commits; the connection, its data and the listening socket go along, and the guest sees no transport reset
. /lib/real-kernel.sh
# The first process dies (abort) in its update once the new one is ready, before it commits
# (GPUVM_TEST_UPDATE_OLD_DIES; the process that update starts has no such hook): the connection must
# go on in the new one all the same.
export GPUVM_TEST_UPDATE_OLD_DIES=1
start_gpuvm linux run --kernel /images/vmlinuz --initrd /images/initramfs.cpio --memory 512M \
    --cmdline "console=ttyS0 quiet panic=-1 inner.checks=vsockecho inner.end=poweroff" \
    --vsock cid=3,uds=/tmp/vsock.sock --api-sock /tmp/api.sock
unset GPUVM_TEST_UPDATE_OLD_DIES
wait_for /tmp/api.sock 30
gpuvm ctl --api-sock /tmp/api.sock start || abort_gpuvm linux "InstanceStart failed"
wait_log linux "vsock-tool: listening on vsock port 5001" 180
vsock-tool uds-echo-rounds /tmp/vsock.sock 5001 65536 60 250 >/tmp/rounds.log 2>&1 &
client=$!

# rounds_past COUNT SECONDS WHAT: until the host program has echoed more than COUNT rounds.
rounds_past() {
    deadline=$(($(cut -d. -f1 /proc/uptime) + $2))
    until [ "$(grep -c 'vsock-tool: round [0-9]* ok' /tmp/rounds.log)" -gt "$1" ]; do
        running "$client" || { cat /tmp/rounds.log; abort_gpuvm linux "the host program ended $3"; }
        [ "$(cut -d. -f1 /proc/uptime)" -lt "$deadline" ] || abort_gpuvm linux "no round past $1 $3"
        sleep 0.1
    done
}

rounds_past 2 60 "before the updates"
for n in 1 2; do
    before="$(grep -c 'vsock-tool: round [0-9]* ok' /tmp/rounds.log)"
    if [ "$n" = 1 ]; then
        live_update_old_dies linux --api-sock /tmp/api.sock
    else
        live_update linux "$n" --api-sock /tmp/api.sock
    fi
    [ -S /tmp/vsock.sock ] || abort_gpuvm linux "the vsock socket file went with the old process"
    rounds_past $((before + 3)) 60 "after update $n"
    echo "the host's connection went on from round $before"
done
wait "$client" || { cat /tmp/rounds.log; abort_gpuvm linux "the host program failed"; }
cat /tmp/rounds.log
expect_line /tmp/rounds.log "vsock-tool: all 60 rounds ok on one connection"
# The guest's echo server saw the host end the one connection, then the guest powers off.
wait_ended "$(cat /tmp/linux.pid)" 120 || abort_gpuvm linux "gpuvm still runs 120 s after the last round"
sed 's/^/  | /' /tmp/linux.log
expect_line /tmp/linux.log "vsock-tool: echoed 3932160 bytes"
expect_line /tmp/linux.log "inner: vsockecho ok"
expect_line /tmp/linux.log "inner: checks passed"
grep -q "transport reset\|TRANSPORT_RESET" /tmp/linux.log && fail "the guest saw a transport reset"
echo "a vsock connection to a Linux guest across two live updates: ok"
