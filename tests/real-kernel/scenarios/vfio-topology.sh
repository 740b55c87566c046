# about: two edu devices behind a PCIe switch of the outer machine, passed through to Linux: gpuvm mirrors the switch (root port, upstream port, two downstream ports) and Linux enumerates it as assigned
# qemu: -device pcie-root-port,id=rp9,chassis=9,slot=9,addr=0x9 -device x3130-upstream,id=up9,bus=rp9
# qemu: -device xio3130-downstream,id=dn90,bus=up9,chassis=10,slot=0 -device xio3130-downstream,id=dn91,bus=up9,chassis=11,slot=1
# qemu: -device edu,bus=dn90 -device edu,bus=dn91
. /lib/real-kernel.sh
a="$(pci_find 1234 11e8 1)" || fail "no edu device"
b="$(pci_find 1234 11e8 2)" || fail "no second edu device"
echo "edu at $a ($(vfio_bind "$a")) and $b ($(vfio_bind "$b"))"
run_gpuvm linux 240 run --log-level info --kernel /images/vmlinuz --initrd /images/initramfs.cpio --memory 256M \
    --gpu "$a" --gpu "$b" \
    --cmdline "console=ttyS0 quiet panic=-1 inner.checks=topology inner.topology=1234:11e8 inner.end=poweroff" ||
    fail "gpuvm status $?"
expect_line /tmp/linux.log "switch upstream port (host switch"
expect_line /tmp/linux.log "inner: topology ok"
expect_line /tmp/linux.log "inner: checks passed"
