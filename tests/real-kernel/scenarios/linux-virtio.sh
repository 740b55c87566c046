# about: a Linux guest of gpuvm reaches user space, checks virtio blk, net (tap), rng and vsock (1 MiB each way from user space), and powers off
. /lib/real-kernel.sh
dd if=/dev/zero of=/tmp/disk.img bs=1M count=16 2>/dev/null
# The guest's connection to the host's port 5000 arrives on <uds>_5000 (hybrid vsock).
vsock-tool uds-echo-server /tmp/vsock.sock_5000 >/tmp/uds-echo.log 2>&1 &
started="$(uptime_s)"
# The guest's kernel log stays on (no `quiet`): twice a Linux guest of this tier printed nothing
# and hung early (here in CI, and vfio-ch-hotplug); the log should say where, if it happens again.
start_gpuvm linux run --kernel /images/vmlinuz --initrd /images/initramfs.cpio --memory 512M --vcpus 2 \
    --cmdline "console=ttyS0 panic=-1 inner.checks=blk,net,rng,vsock,vsockdata inner.ip=10.0.2.2 inner.peer=10.0.2.1 inner.end=poweroff" \
    --drive id=disk0,path=/tmp/disk.img --net id=net0,tap=tap0 --rng --vsock cid=3,uds=/tmp/vsock.sock
# gpuvm makes the tap (busybox has no `ip tuntap`); the host side gets its address while the guest boots.
wait_for /sys/class/net/tap0 30
ip addr add 10.0.2.1/24 dev tap0
ip link set tap0 up
wait_log linux "vsock-tool: listening on vsock port 5001" 180
vsock-tool uds-echo-client /tmp/vsock.sock 5001 1048576 || abort_gpuvm linux "host-to-guest vsock data"
wait_gpuvm linux 180 || fail "gpuvm status $? (a Linux guest's poweroff must end gpuvm with status 0)"
ended="$(uptime_s)"
expect_line /tmp/linux.log "inner: checks passed"
cat /tmp/uds-echo.log
expect_line /tmp/uds-echo.log "vsock-tool: echoed 1048576 bytes"
figure "linux-virtio inner boot to user space $(sed -n 's/.*inner: user space reached at \([0-9.]*\) s.*/\1/p' /tmp/linux.log) s (guest uptime)"
sed -n 's/.*vsock-tool: ok: \([0-9]*\) bytes sent and read back unchanged in \(.*\)/\1 \2/p' /tmp/linux.log |
    while read -r bytes rest; do figure "linux-virtio vsock guest to host echo of $bytes bytes: $rest"; done
figure "linux-virtio gpuvm start to power-off $(seconds_between "$started" "$ended") s"
