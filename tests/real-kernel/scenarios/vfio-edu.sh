# about: kernel VFIO (type1) on QEMU's edu: cold-plug with --gpu, the test guest drives its DMA engine, MSI and INTx
# qemu: -device edu,addr=0x4
. /lib/real-kernel.sh
bdf="$(pci_find 1234 11e8)" || fail "no edu device"
group="$(vfio_bind "$bdf")"
echo "edu at $bdf, $group"
run_gpuvm edu 120 run --log-level info --memory 256M --gpu "$bdf" --cmdline edu || fail "gpuvm status $?"
expect_line /tmp/edu.log "edu: PASS"
dma_map_figure /tmp/edu.log
