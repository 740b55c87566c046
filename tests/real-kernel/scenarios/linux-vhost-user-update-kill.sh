# about: kill -9 at each step of a live update of a VM whose disk and share are vhost-user backends (qemu-storage-daemon's vhost-user-blk and virtiofsd's virtio-fs, as Kata's block volumes and rootfs sharing): a Linux guest writes and reads back both every quarter second while (1) the new gpuvm is killed (SIGKILL) holding the paused VM, before it is ready: the old one takes the VM back; (2) the new gpuvm is killed before the old one connects: nothing is touched; (3) the old gpuvm dies (abort) once the new one is ready, before it commits: the new one runs the VM; (4) a plain update; at every step the VM runs in exactly one process and both backends serve on, never seeing a second frontend
. /lib/real-kernel.sh
command -v virtiofsd >/dev/null || fail "no virtiofsd in the machine (scripts/install-deps.sh builds it)"
command -v qemu-storage-daemon >/dev/null || fail "no qemu-storage-daemon in the machine (scripts/install-deps.sh installs it)"
mkdir -p /tmp/share
echo "hello from the outer machine" >/tmp/share/hello
truncate -s 64M /tmp/disk.img
virtiofsd --socket-path=/tmp/vfs.sock --shared-dir=/tmp/share --sandbox none >/tmp/virtiofsd.log 2>&1 &
qemu-storage-daemon --blockdev driver=file,node-name=file0,filename=/tmp/disk.img \
    --blockdev driver=raw,node-name=disk0,file=file0 \
    --export type=vhost-user-blk,id=exp0,node-name=disk0,addr.type=unix,addr.path=/tmp/qsd.sock,writable=on \
    >/tmp/qsd.log 2>&1 &
wait_for /tmp/vfs.sock 30
wait_for /tmp/qsd.sock 30
# The first process dies in its third update once the new one is ready (the processes updates start have
# no such hook).
export GPUVM_TEST_UPDATE_OLD_DIES=1
start_gpuvm linux run --log-level info --api-sock /tmp/api.sock --kernel /images/vmlinuz \
    --initrd /images/initramfs.cpio --memory 512M --fs tag=share,socket=/tmp/vfs.sock \
    --drive id=data,vhost_user=/tmp/qsd.sock \
    --cmdline "console=ttyS0 quiet panic=-1 inner.checks=ioloop inner.fs=share inner.ioloop=120 inner.end=poweroff"
unset GPUVM_TEST_UPDATE_OLD_DIES
first="$(cat /tmp/linux.pid)"
wait_for /tmp/api.sock 30
gpuvm ctl --api-sock /tmp/api.sock start || abort_gpuvm linux "InstanceStart failed"

round_count() {
    count="$(sed -n 's/.*inner: io round \([0-9][0-9]*\) ok.*/\1/p' /tmp/linux.log | tail -n1)"
    echo "${count:-0}"
}

rounds_past() {
    wait_past linux round_count "$1" "$2" "$3"
}

# receiver_pid: the `gpuvm update-receive` process a running update started, if any.
receiver_pid() {
    for cmdline in /proc/[0-9]*/cmdline; do
        case "$( { tr '\0' ' ' <"$cmdline"; } 2>/dev/null)" in
        *" update-receive "*)
            pid="${cmdline#/proc/}"
            echo "${pid%/cmdline}"
            ;;
        esac
    done
}

# failed_update N WHAT: waits for the background `gpuvm update` (pid in /tmp/update.pid, output in
# /tmp/update-N.out), which must fail; the VM must still run in the same process, its guest going on.
failed_update() {
    status=0
    wait "$(cat /tmp/update.pid)" || status=$?
    sed 's/^/  update: /' "/tmp/update-$1.out"
    [ "$status" != 0 ] || abort_gpuvm linux "update $1 went through though $2"
    running "$(cat /tmp/linux.pid)" || fail "gpuvm $(cat /tmp/linux.pid) ended in update $1 ($2)"
    [ -z "$(receiver_pid)" ] || abort_gpuvm linux "a new gpuvm still runs after update $1 failed"
}

rounds_past 2 180 "before the updates"

# killed_update N HOOK WHEN EXPECTED: update N of the first gpuvm with the test hook HOOK (VAR=VALUE) in its
# environment; its new process is killed (SIGKILL) once the shell test WHEN holds (and a second later);
# the update must fail saying EXPECTED, and the guest go on in the first process.
killed_update() {
    before="$(round_count)"
    env "$2" gpuvm update --pid "$first" --timeout-ms 60000 >"/tmp/update-$1.out" 2>&1 &
    echo $! >/tmp/update.pid
    deadline=$(($(cut -d. -f1 /proc/uptime) + 60))
    receiver=""
    until [ -n "$receiver" ] && eval "$3"; do
        [ "$(cut -d. -f1 /proc/uptime)" -lt "$deadline" ] || abort_gpuvm linux "update $1: no new gpuvm to kill"
        receiver="$(receiver_pid)"
        sleep 0.1
    done
    sleep 1
    kill -9 "$receiver"
    failed_update "$1" "its new process was killed"
    expect_line "/tmp/update-$1.out" "$4"
    rounds_past $((before + 3)) 60 "after update $1's new process was killed"
}

# (1) The new process holds the paused VM and never says it is ready: killed.
echo "+ gpuvm update --pid $first (its new process is killed before it is ready)"
killed_update 1 GPUVM_TEST_UPDATE_FAIL=hang 'has_line /tmp/linux.log GPUVM_TEST_UPDATE_FAIL=hang' \
    "closed the hand-over socket"
echo "step 1: the new process $receiver killed before its Ready; the old one runs the VM"

# (2) The new process is killed once it listens, before the old one is asked to connect.
echo "+ gpuvm update --pid $first (its new process is killed before the old one connects)"
killed_update 2 GPUVM_TEST_UPDATE_DELAY_REQUEST_MS=5000 true "the VM was not touched"
echo "step 2: the new process $receiver killed before the hand-over; the VM untouched"

# (3) The old process dies after the new one is ready.
before="$(round_count)"
live_update_old_dies linux --api-sock /tmp/api.sock
rounds_past $((before + 3)) 60 "after the old process died in its update"
echo "step 3: the old process died after the new one's Ready; the new one runs the VM"

# (4) A plain update of the process that took the VM over.
before="$(round_count)"
live_update linux 4 --api-sock /tmp/api.sock
rounds_past $((before + 3)) 60 "after update 4"
echo "step 4: a plain update"

wait_gpuvm_ended linux "$(cat /tmp/linux.pid)" 240 "the guest's last round"
sed 's/^/  | /' /tmp/linux.log
expect_line /tmp/linux.log "inner: ioloop ok (120 rounds)"
expect_line /tmp/linux.log "inner: checks passed"
for n in 1 60 120; do
    grep -q "fs round $n from the Linux guest" "/tmp/share/round-$n" || fail "round $n's file is not in the share"
    dd if=/tmp/disk.img bs=64k skip="$n" count=1 2>/dev/null | grep -q "blk round $n from the Linux guest" ||
        fail "round $n's block is not on the disk"
done
grep -i "error\|panic" /tmp/virtiofsd.log && fail "virtiofsd reported an error"
grep -i "error" /tmp/qsd.log && fail "qemu-storage-daemon reported an error"
echo "vhost-user disk and share across kill -9 at each step of a live update: ok"
