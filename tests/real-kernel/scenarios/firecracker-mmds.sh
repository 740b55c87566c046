# about: MMDS V2 from Linux user space: gpuvm as `firecracker`, a Linux guest gets a token and its metadata from 169.254.169.254 over virtio-net
. /lib/real-kernel.sh
# Firecracker clients start the binary as `firecracker`; its API is configured the way they do it.
start_fc_mmds_vm mmds
# A Firecracker guest's reboot ends the VMM.
wait_gpuvm fc 180 || true
expect_line /tmp/fc.log "inner: mmds ok"
expect_line /tmp/fc.log "inner: checks passed"
echo "MMDS V2 answered a Linux guest: ok"
