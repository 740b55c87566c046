# about: a Linux guest's reboot (Linux's default method, no reboot= argument) ends gpuvm with status 0
. /lib/real-kernel.sh
run_gpuvm linux 120 run --log-level info --kernel /images/vmlinuz --initrd /images/initramfs.cpio --memory 256M \
    --cmdline "console=ttyS0 quiet panic=-1 inner.checks= inner.end=reboot" ||
    fail "gpuvm status $? (a Linux guest's reboot must end gpuvm with status 0)"
expect_line /tmp/linux.log "inner: checks passed"
expect_line /tmp/linux.log "guest requested a reset"
