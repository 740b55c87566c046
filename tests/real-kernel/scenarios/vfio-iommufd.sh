# about: kernel VFIO through iommufd (Linux 6.12: /dev/iommu, the device cdev) on QEMU's edu: DMA, MSI and INTx; RAM mapped serially and in parallel
# qemu: -device edu,addr=0x4
# kernel: iommufd
. /lib/real-kernel.sh
[ -c /dev/iommu ] || fail "no /dev/iommu (is CONFIG_IOMMUFD on in the outer kernel?)"
bdf="$(pci_find 1234 11e8)" || fail "no edu device"
group="$(vfio_bind "$bdf")"
[ -d "/sys/bus/pci/devices/$bdf/vfio-dev" ] || fail "$bdf has no VFIO cdev (CONFIG_VFIO_DEVICE_CDEV)"
cdev="/dev/vfio/devices/$(ls "/sys/bus/pci/devices/$bdf/vfio-dev")"
[ -c "$cdev" ] || fail "no $cdev for $bdf"
echo "edu at $bdf, $group, $cdev, /dev/iommu"
run_gpuvm edu 120 run --log-level info --memory 256M --gpu "$bdf" --cmdline edu || fail "gpuvm status $?"
expect_line /tmp/edu.log "edu: PASS"
expect_line /tmp/edu.log "kernel VFIO: iommufd cdev API"
echo "gpuvm opened $bdf through the iommufd cdev API"
dma_map_figure /tmp/edu.log

# The parallel mapper (iommufd maps chunks on several threads; large guests have many 1 GiB chunks): the
# same guest's RAM in 32 MiB chunks, so 256 MiB takes all of this machine's CPUs, and the device still works.
GPUVM_TEST_DMA_CHUNK_MIB=32 run_gpuvm edu-parallel 120 run --log-level info --memory 256M --gpu "$bdf" \
    --cmdline edu || fail "gpuvm status $? (parallel DMA mapping)"
expect_line /tmp/edu-parallel.log "edu: PASS"
grep -q "DMA map .*: start, 256 MiB in 8 chunk(s), [2-9] at a time" /tmp/edu-parallel.log ||
    fail "the mapping did not run on several threads"
grep -q "DMA map .*: done, 256 MiB" /tmp/edu-parallel.log || fail "the parallel mapping did not finish"
echo "256 MiB DMA-mapped in 8 chunks on several threads; edu's DMA works"
dma_map_figure /tmp/edu-parallel.log
