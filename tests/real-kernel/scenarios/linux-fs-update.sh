# about: live update of a VM with a virtio-fs share (vhost-user, virtiofsd: Kata's default rootfs sharing): a Linux guest writes and reads files in the share every quarter second while `gpuvm update` hands the VM to a new process, twice; the vhost-user connection goes over (virtiofsd serves one frontend and never sees another), and every round's file is in the host directory
. /lib/real-kernel.sh
command -v virtiofsd >/dev/null || fail "no virtiofsd in the machine (scripts/install-deps.sh builds it)"
mkdir -p /tmp/share
echo "hello from the outer machine" >/tmp/share/hello
virtiofsd --socket-path=/tmp/vfs.sock --shared-dir=/tmp/share --sandbox none >/tmp/virtiofsd.log 2>&1 &
wait_for /tmp/vfs.sock 30
start_gpuvm linux run --log-level info --api-sock /tmp/api.sock --kernel /images/vmlinuz \
    --initrd /images/initramfs.cpio --memory 512M --fs tag=share,socket=/tmp/vfs.sock \
    --cmdline "console=ttyS0 quiet panic=-1 inner.checks=fsloop inner.fs=share inner.fsloop=60 inner.end=poweroff"
first="$(cat /tmp/linux.pid)"
wait_for /tmp/api.sock 30
gpuvm ctl --api-sock /tmp/api.sock start || abort_gpuvm linux "InstanceStart failed"

# The guest's latest round (0 before the first).
round_count() {
    count="$(sed -n 's/.*inner: fs round \([0-9][0-9]*\) ok.*/\1/p' /tmp/linux.log | tail -n1)"
    echo "${count:-0}"
}

# rounds_past COUNT SECONDS WHAT: until the guest reports more than COUNT rounds.
rounds_past() {
    wait_past linux round_count "$1" "$2" "$3"
}

rounds_past 2 180 "before the updates"
for n in 1 2; do
    before="$(round_count)"
    live_update linux "$n" --api-sock /tmp/api.sock
    rounds_past $((before + 3)) 60 "after update $n"
    echo "the guest's share went on from round $before to $(round_count)"
done
wait_ended "$(cat /tmp/linux.pid)" 180 || abort_gpuvm linux "gpuvm still runs 180 s after the guest's last round"
wait "$first" || fail "the first gpuvm exited with status $? after handing its VM over"
sed 's/^/  | /' /tmp/linux.log
expect_line /tmp/linux.log "took over the connection to the backend at /tmp/vfs.sock"
expect_line /tmp/linux.log "inner: fsloop ok (60 rounds)"
expect_line /tmp/linux.log "inner: checks passed"
for n in 1 30 60; do
    grep -q "round $n from the Linux guest" "/tmp/share/round-$n" || fail "round $n's file is not in the share"
done
grep -i "error\|panic" /tmp/virtiofsd.log && fail "virtiofsd reported an error"
echo "a virtio-fs share (virtiofsd over vhost-user) across two live updates: ok"
