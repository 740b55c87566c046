# about: kernel VFIO through iommufd (Linux 6.12: /dev/iommu, the device cdev) on QEMU's edu: DMA, MSI and INTx
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

