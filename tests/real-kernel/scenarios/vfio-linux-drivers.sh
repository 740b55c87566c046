# about: NVMe (MSI-X) and ivshmem (1 GiB 64-bit prefetchable BAR) passed through together to a Linux guest, used by its drivers
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
