# about: a Linux guest of gpuvm gets edu hot-plugged (PUT /gpus with host_bdf, ACPI PCI hot-plug) and removed
# qemu: -device edu,addr=0x4
. /lib/real-kernel.sh
bdf="$(pci_find 1234 11e8)" || fail "no edu device"
vfio_bind "$bdf" >/dev/null
start_gpuvm linux run --log-level info --api-sock /tmp/api.sock --kernel /images/vmlinuz \
    --initrd /images/initramfs.cpio --memory 512M \
    --cmdline "console=ttyS0 quiet panic=-1 inner.checks=hotplug inner.hotplug=1234:11e8 inner.end=poweroff"
wait_for /tmp/api.sock 30
n=0
until grep -q "inner: waiting for hot-plug" /tmp/linux.log; do
    n=$((n + 1))
    [ "$n" -gt 1200 ] && { wait_gpuvm linux 1; fail "the Linux guest did not reach its hot-plug check"; }
    sleep 0.1
done
gpuvm ctl --api-sock /tmp/api.sock add-gpu --id edu0 --host-bdf "$bdf" || fail "PUT /gpus/edu0 failed"
n=0
until grep -q "inner: hot-plugged" /tmp/linux.log; do
    n=$((n + 1))
    [ "$n" -gt 1200 ] && { wait_gpuvm linux 1; fail "the Linux guest never saw the hot-plugged edu"; }
    sleep 0.1
done
gpuvm ctl --api-sock /tmp/api.sock remove-gpu --id edu0 || fail "DELETE /gpus/edu0 failed"
wait_gpuvm linux 120 || fail "gpuvm status $?"
expect_line /tmp/linux.log "inner: checks passed"
dma_map_figure /tmp/linux.log
