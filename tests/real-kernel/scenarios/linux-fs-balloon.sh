# about: a Linux guest mounts a virtio-fs share served by virtiofsd (vhost-user), and inflates its balloon when the API asks
. /lib/real-kernel.sh
command -v virtiofsd >/dev/null || fail "no virtiofsd in the machine (scripts/install-deps.sh builds it)"
mkdir -p /tmp/share
echo "hello from the outer machine" >/tmp/share/hello
virtiofsd --socket-path=/tmp/vfs.sock --shared-dir=/tmp/share --sandbox none >/tmp/virtiofsd.log 2>&1 &
wait_for /tmp/vfs.sock 30
start_gpuvm linux run --log-level info --api-sock /tmp/api.sock --kernel /images/vmlinuz \
    --initrd /images/initramfs.cpio --memory 512M --fs tag=share,socket=/tmp/vfs.sock \
    --cmdline "console=ttyS0 quiet panic=-1 inner.checks=fs,balloon inner.fs=share inner.end=hold"
wait_for /tmp/api.sock 30
api() {
    gpuvm ctl --api-sock /tmp/api.sock raw "$@"
}
api PUT /balloon '{"amount_mib": 0, "deflate_on_oom": false, "stats_polling_interval_s": 1}' ||
    abort_gpuvm linux "PUT /balloon failed"
gpuvm ctl --api-sock /tmp/api.sock start || abort_gpuvm linux "InstanceStart failed"
wait_log linux "inner: checks passed" 120
grep -q "written by the Linux guest" /tmp/share/reply || abort_gpuvm linux "the guest's file is not in the share"
api PATCH /balloon '{"amount_mib": 64}' || abort_gpuvm linux "PATCH /balloon failed"
n=0
until api GET /balloon/statistics 2>/dev/null | grep -q '"actual_mib": *64'; do
    n=$((n + 1))
    [ "$n" -gt 600 ] && abort_gpuvm linux "the balloon never reached 64 MiB: $(api GET /balloon/statistics)"
    sleep 0.1
done
echo "balloon inflated to 64 MiB: $(api GET /balloon/statistics)"
gpuvm ctl --api-sock /tmp/api.sock ctrl-alt-del || abort_gpuvm linux "SendCtrlAltDel failed"
wait_gpuvm linux 60 || fail "gpuvm status $?"
