# about: MMDS V2 from Linux user space: gpuvm as `firecracker`, a Linux guest gets a token and its metadata from 169.254.169.254 over virtio-net
. /lib/real-kernel.sh
# Firecracker clients start the binary as `firecracker`; its API is configured the way they do it.
ln -sf /bin/gpuvm /tmp/firecracker
echo "+ firecracker --api-sock /tmp/fc.sock &"
/tmp/firecracker --api-sock /tmp/fc.sock >/tmp/fc.log 2>&1 &
echo $! >/tmp/fc.pid
wait_for /tmp/fc.sock 30
fc() {
    gpuvm ctl --api-sock /tmp/fc.sock raw "$@" >/tmp/fc-call.out 2>&1 ||
        abort_gpuvm fc "$1 $2 failed: $(cat /tmp/fc-call.out)"
}
fc PUT /boot-source '{"kernel_image_path": "/images/vmlinuz", "initrd_path": "/images/initramfs.cpio",
    "boot_args": "console=ttyS0 quiet panic=-1 inner.checks=mmds inner.mmds=169.254.169.254 inner.end=reboot"}'
fc PUT /machine-config '{"vcpu_count": 1, "mem_size_mib": 256}'
fc PUT /network-interfaces/eth0 '{"iface_id": "eth0", "host_dev_name": "tap0"}'
fc PUT /mmds/config '{"version": "V2", "network_interfaces": ["eth0"]}'
fc PUT /mmds '{"latest": {"meta-data": {"instance-id": "i-gpuvm-42", "ami-id": "ami-real-kernel"}}}'
fc PUT /actions '{"action_type": "InstanceStart"}'
# A Firecracker guest's reboot ends the VMM.
wait_gpuvm fc 180 || true
expect_line /tmp/fc.log "inner: mmds ok"
expect_line /tmp/fc.log "inner: checks passed"
echo "MMDS V2 answered a Linux guest: ok"
