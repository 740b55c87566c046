# about: live update of a VM with a hot-plugged kernel VFIO device: edu hot-plugged into a Linux guest (PUT /gpus, its own type1 container), Linux checks it through BAR0 every second while `gpuvm update` hands the VM over; the new process takes the device and its container over (no reset, no DMA map; the mappings' host addresses moved), keeps it a hot-plugged device, and DELETE /gpus/edu0 there has Linux eject it
# qemu: -device edu,addr=0x4
. /lib/real-kernel.sh
bdf="$(pci_find 1234 11e8)" || fail "no edu device"
vfio_bind "$bdf" >/dev/null
start_gpuvm linux run --log-level info --api-sock /tmp/api.sock --kernel /images/vmlinuz \
    --initrd /images/initramfs.cpio --memory 512M \
    --cmdline "console=ttyS0 quiet panic=-1 inner.checks=hotplug inner.hotplug=1234:11e8 inner.hotrounds=on inner.end=poweroff"
first="$(cat /tmp/linux.pid)"
wait_for /tmp/api.sock 30
gpuvm ctl --api-sock /tmp/api.sock start || abort_gpuvm linux "InstanceStart failed"
wait_log linux "inner: waiting for hot-plug" 120
gpuvm ctl --api-sock /tmp/api.sock add-gpu --id edu0 --host-bdf "$bdf" || abort_gpuvm linux "PUT /gpus/edu0 failed"
wait_log linux "inner: hot-plugged round 2 ok" 120
has_line /tmp/linux.log "kernel VFIO: container/group API" || abort_gpuvm linux "edu is not on the container/group API"

# The guest's latest round (0 before the first).
round_count() {
    count="$(guest_lines /tmp/linux.log | sed -n 's/^inner: hot-plugged round \([0-9][0-9]*\) ok.*/\1/p' | tail -n1)"
    echo "${count:-0}"
}

before="$(round_count)"
live_update_logged linux 1 --api-sock /tmp/api.sock
wait "$first" || abort_gpuvm linux "the first gpuvm exited with status $? after handing its VM over"
grep -q "live update: hot-plugged edu0 .* taken over from the old process (no reset, no DMA map" /tmp/after-1.log ||
    abort_gpuvm linux "the new process logged no 'hot-plugged edu0 ... taken over from the old process'"
grep -qF "DMA mappings now use this process's addresses (VFIO_DMA_MAP_FLAG_VADDR" /tmp/after-1.log ||
    abort_gpuvm linux "the new process logged no 'DMA mappings now use this process's addresses'"
grep -qE "DMA map kernel VFIO \(type1 container\): start" /tmp/after-1.log &&
    abort_gpuvm linux "the new process DMA-mapped guest RAM again"
grep -E "taken over from the old process|DMA mappings now use" /tmp/after-1.log | sed 's/^/update: /'
wait_past linux round_count $((before + 3)) 60 "after the update"
echo "after the update the guest's rounds on the hot-plugged edu went on from $before to $(round_count)"
figure "live update of a VM with a hot-plugged kernel VFIO device (edu, type1): guest paused $(update_paused_ms 1) ms"

# Still a hot-plugged device, in the new process: DELETE has the guest eject it.
last="$(cat /tmp/linux.pid)"
gpuvm ctl --api-sock /tmp/api.sock remove-gpu --id edu0 || abort_gpuvm linux "DELETE /gpus/edu0 in the new process failed"
wait_gpuvm_ended linux "$last" 120 "the removal"
sed 's/^/  | /' /tmp/linux.log
expect_line /tmp/linux.log "ejected"
expect_line /tmp/linux.log "inner: checks passed"
echo "a hot-plugged kernel VFIO device across a live update, removed afterwards: ok"
