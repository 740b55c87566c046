# about: PCIe native hot-plug in a Linux guest of gpuvm: two root ports for hot-plug (--pcie-root-ports 2), no pcie_ports=native; the DSDT's _OSC grants native hot-plug, Linux's pciehp binds the ports, edu hot-plugged by PUT /gpus comes up behind a port and leaves on DELETE (attention button, Linux powers the slot off)
# qemu: -device edu,addr=0x4
# Each root port for hot-plug has a 512 GiB prefetchable window (an H200's BARs): above the 40 physical
# address bits QEMU's CPU has by default, so this machine's CPU (the runner's, repeated: the last -cpu wins)
# gets 48.
# qemu: -cpu qemu64,+svm,+npt,phys-bits=48
. /lib/real-kernel.sh
bdf="$(pci_find 1234 11e8)" || fail "no edu device"
vfio_bind "$bdf" >/dev/null
# pciehp waits 5 s after the attention button before it removes the device and powers the slot off; the
# emulated machine is slow: give the DELETE room.
export GPUVM_HOTPLUG_EJECT_TIMEOUT_MS=120000
# The guest's kernel log stays on (no `quiet`): pciehp's slot messages show what it did.
start_gpuvm linux run --log-level info --api-sock /tmp/api.sock --kernel /images/vmlinuz \
    --initrd /images/initramfs.cpio --memory 512M --pcie-root-ports 2 \
    --cmdline "console=ttyS0 panic=-1 inner.checks=pciehp inner.pciehp=1234:11e8 inner.end=poweroff"
wait_for /tmp/api.sock 30
gpuvm ctl --api-sock /tmp/api.sock start || abort_gpuvm linux "InstanceStart failed"
wait_log linux "inner: waiting for hot-plug of 1234:11e8 into a root port" 180
gpuvm ctl --api-sock /tmp/api.sock add-gpu --id edu0 --host-bdf "$bdf" >/tmp/add.out ||
    abort_gpuvm linux "PUT /gpus/edu0 failed: $(cat /tmp/add.out)"
cat /tmp/add.out
# Behind a root port: the answer's BDF is on a bus of its own, not bus 0.
grep -q '"bdf": *"0000:0[1-9a-f]:00.0"' /tmp/add.out || abort_gpuvm linux "PUT /gpus/edu0 answered no BDF behind a port"
wait_log linux "inner: hot-plugged 1234:11e8" 120
gpuvm ctl --api-sock /tmp/api.sock remove-gpu --id edu0 || abort_gpuvm linux "DELETE /gpus/edu0 failed"
wait_gpuvm linux 120 || fail "gpuvm status $?"
expect_line /tmp/linux.log "inner: pciehp ok"
expect_line /tmp/linux.log "inner: checks passed"
dma_map_figure /tmp/linux.log
echo "PCIe native hot-plug (Linux pciehp, granted by _OSC) into and out of a gpuvm root port: ok"
