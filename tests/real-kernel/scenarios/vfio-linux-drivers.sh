# about: NVMe (MSI-X) and ivshmem (1 GiB 64-bit prefetchable BAR) passed through together to a Linux guest, used by its drivers; the NVMe again after gpuvm's reset
# scratch: nvme.img 64M
# qemu: -drive file=@WORK@/nvme.img,if=none,id=nvme0,format=raw -device nvme,drive=nvme0,serial=gpuvm0,addr=0x5
# qemu: -object memory-backend-ram,id=shm0,size=1G -device ivshmem-plain,memdev=shm0,addr=0x6
# memory: 4G
. /lib/real-kernel.sh
nvme="$(pci_find 1b36 0010)" || fail "no NVMe controller"
ivshmem="$(pci_find 1af4 1110)" || fail "no ivshmem device"
vfio_bind "$nvme" >/dev/null
vfio_bind "$ivshmem" >/dev/null
run_gpuvm linux 240 run --log-level info --kernel /images/vmlinuz --initrd /images/initramfs.cpio --memory 512M \
    --gpu "$nvme" --gpu "$ivshmem" \
    --cmdline "console=ttyS0 quiet panic=-1 inner.checks=nvme,bigbar inner.bigbar=1024 inner.end=poweroff" ||
    fail "gpuvm status $?"
expect_line /tmp/linux.log "inner: checks passed"
dma_map_figure /tmp/linux.log

# gpuvm resets a device when it lets go of it (VFIO_DEVICE_RESET: a function-level reset for this NVMe
# controller); the next VM's driver must find it as new.
echo "reset methods of $nvme: $(cat "/sys/bus/pci/devices/$nvme/reset_method" 2>/dev/null)"
run_gpuvm again 240 run --kernel /images/vmlinuz --initrd /images/initramfs.cpio --memory 256M --gpu "$nvme" \
    --cmdline "console=ttyS0 quiet panic=-1 inner.checks=nvme inner.end=poweroff" || fail "gpuvm status $? (second VM)"
expect_line /tmp/again.log "inner: nvme ok"
echo "the NVMe controller served a second VM after its reset"
