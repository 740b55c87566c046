# about: gpuvm as Cloud Hypervisor: a Linux guest gets edu by vm.add-device (sysfs path) and a disk by vm.add-disk after boot, both removed
# qemu: -device edu,addr=0x4
. /lib/real-kernel.sh
bdf="$(pci_find 1234 11e8)" || fail "no edu device"
vfio_bind "$bdf" >/dev/null
start_ch
ch() {
    gpuvm ctl --api-sock /tmp/ch.sock raw "$@"
}
# The guest's kernel log stays on (no `quiet`): a boot that stalled once in CI (an empty console for
# 120 s) should say where, if it happens again.
ch PUT /api/v1/vm.create '{"payload": {"kernel": "/images/vmlinuz", "initramfs": "/images/initramfs.cpio",
    "cmdline": "console=ttyS0 panic=-1 inner.checks=hotplug,diskplug inner.hotplug=1234:11e8 inner.end=poweroff"},
    "cpus": {"boot_vcpus": 1, "max_vcpus": 1}, "memory": {"size": 536870912},
    "serial": {"mode": "Tty"}, "console": {"mode": "Off"}}' || abort_gpuvm ch "vm.create failed"
ch PUT /api/v1/vm.boot || abort_gpuvm ch "vm.boot failed"
wait_log ch "inner: waiting for hot-plug" 120
ch PUT /api/v1/vm.add-device "{\"path\": \"/sys/bus/pci/devices/$bdf\", \"id\": \"edu0\"}" >/tmp/add.out ||
    abort_gpuvm ch "vm.add-device failed: $(cat /tmp/add.out)"
cat /tmp/add.out
# Kata reads the guest address from the answer.
grep -q '"bdf": *"0000:00:' /tmp/add.out || abort_gpuvm ch "vm.add-device answered no bdf"
wait_log ch "inner: hot-plugged" 120
ch PUT /api/v1/vm.remove-device '{"id": "edu0"}' || abort_gpuvm ch "vm.remove-device failed"
# A block device after boot, as Kata adds a container's rootfs.
dd if=/dev/zero of=/tmp/disk.img bs=1M count=8 2>/dev/null
wait_log ch "inner: waiting for a hot-plugged disk" 120
ch PUT /api/v1/vm.add-disk '{"path": "/tmp/disk.img", "id": "disk0"}' || abort_gpuvm ch "vm.add-disk failed"
wait_log ch "inner: hot-plugged disk ok" 120
ch PUT /api/v1/vm.remove-device '{"id": "disk0"}' || abort_gpuvm ch "vm.remove-device disk0 failed"
wait_log ch "inner: checks passed" 120
wait_gpuvm ch 60 || fail "gpuvm as cloud-hypervisor: status $?"
