# about: a Linux guest of gpuvm gets edu hot-plugged (PUT /gpus with host_bdf, ACPI PCI hot-plug), a snapshot is refused, edu is removed
# qemu: -device edu,addr=0x4
. /lib/real-kernel.sh
bdf="$(pci_find 1234 11e8)" || fail "no edu device"
vfio_bind "$bdf" >/dev/null
start_gpuvm linux run --log-level info --api-sock /tmp/api.sock --kernel /images/vmlinuz \
    --initrd /images/initramfs.cpio --memory 512M \
    --cmdline "console=ttyS0 quiet panic=-1 inner.checks=hotplug inner.hotplug=1234:11e8 inner.end=poweroff"
wait_for /tmp/api.sock 30
# With an API socket the flags are the initial configuration; the VM starts on InstanceStart.
gpuvm ctl --api-sock /tmp/api.sock start || abort_gpuvm linux "InstanceStart failed"
wait_log linux "inner: waiting for hot-plug" 120
gpuvm ctl --api-sock /tmp/api.sock add-gpu --id edu0 --host-bdf "$bdf" || abort_gpuvm linux "PUT /gpus/edu0 failed"
wait_log linux "inner: hot-plugged" 120
# edu offers no VFIO migration and the guest was not asked to release it: a snapshot is refused, naming it.
if gpuvm ctl --api-sock /tmp/api.sock snapshot-create --dir /tmp/snap >/tmp/snapshot.out 2>&1; then
    abort_gpuvm linux "a snapshot of a VM with a non-migratable VFIO device was taken"
fi
cat /tmp/snapshot.out
grep -q "edu0.*no VFIO migration" /tmp/snapshot.out || abort_gpuvm linux "the refusal does not name the device and why"
gpuvm ctl --api-sock /tmp/api.sock remove-gpu --id edu0 || abort_gpuvm linux "DELETE /gpus/edu0 failed"
wait_gpuvm linux 120 || fail "gpuvm status $?"
expect_line /tmp/linux.log "inner: checks passed"
dma_map_figure /tmp/linux.log
