# about: kernel VFIO (type1) on QEMU's edu: cold-plug with --gpu, the test guest drives its DMA engine, MSI and INTx; snapshots refused
# qemu: -device edu,addr=0x4
. /lib/real-kernel.sh
bdf="$(pci_find 1234 11e8)" || fail "no edu device"
group="$(vfio_bind "$bdf")"
echo "edu at $bdf, $group"
run_gpuvm edu 120 run --log-level info --memory 256M --gpu "$bdf" --cmdline edu || fail "gpuvm status $?"
expect_line /tmp/edu.log "edu: PASS"
dma_map_figure /tmp/edu.log
# Boot while pinning: the guest runs while its RAM is DMA-mapped (its bus-master write waits for the
# mapping, not its boot), so it is up seconds before the mapping is done.
ready="$(grep -n "testguest: ready" /tmp/edu.log | head -n1 | cut -d: -f1)"
mapped="$(grep -n "DMA map .*: done" /tmp/edu.log | head -n1 | cut -d: -f1)"
[ -n "$ready" ] && [ -n "$mapped" ] && [ "$ready" -lt "$mapped" ] ||
    fail "the guest was not up before its RAM was DMA-mapped (ready at line $ready, mapped at line $mapped)"
echo "the guest booted while its RAM was being DMA-mapped"

# The same device under the API: a snapshot of a VM with a cold-plugged device is refused, clearly, and
# the VM runs on; Ctrl-Alt-Del then ends it.
start_gpuvm edu-api run --api-sock /tmp/api.sock --memory 256M --gpu "$bdf" --cmdline "edu hold"
wait_for /tmp/api.sock 30
gpuvm ctl --api-sock /tmp/api.sock start || abort_gpuvm edu-api "InstanceStart failed"
wait_log edu-api "edu: PASS" 60
if gpuvm ctl --api-sock /tmp/api.sock snapshot-create --dir /tmp/snap >/tmp/snapshot.out 2>&1; then
    abort_gpuvm edu-api "a snapshot of a VM with a cold-plugged VFIO device was taken"
fi
cat /tmp/snapshot.out
grep -q "cold-plugged passthrough" /tmp/snapshot.out || abort_gpuvm edu-api "the refusal does not say why"
gpuvm ctl --api-sock /tmp/api.sock info | grep -q Running || abort_gpuvm edu-api "the VM stopped after the refusal"
gpuvm ctl --api-sock /tmp/api.sock ctrl-alt-del || abort_gpuvm edu-api "SendCtrlAltDel failed"
wait_gpuvm edu-api 30 || fail "gpuvm status $? after Ctrl-Alt-Del"
echo "snapshot refused as it should be"
