# about: memory hot-plug as Kata's default configuration asks for it, in a VM with a virtio disk: gpuvm as Cloud Hypervisor boots a Linux guest with 512 MiB and room for 1 GiB more; vm.resize desired_ram adds 256 MiB that Linux finds through its ACPI memory devices, onlines and fills, and the disk keeps working
. /lib/real-kernel.sh
dd if=/dev/zero of=/tmp/disk.img bs=1M count=16 2>/dev/null
start_ch
ch_checked PUT /api/v1/vm.create '{"payload": {"kernel": "/images/vmlinuz", "initramfs": "/images/initramfs.cpio",
    "cmdline": "console=ttyS0 quiet panic=-1 inner.checks=blk,memplug inner.end=poweroff"},
    "cpus": {"boot_vcpus": 1, "max_vcpus": 1},
    "memory": {"size": 536870912, "hotplug_size": 1073741824},
    "disks": [{"path": "/tmp/disk.img", "id": "disk0"}],
    "serial": {"mode": "Tty"}, "console": {"mode": "Off"}}'
ch_checked PUT /api/v1/vm.boot
wait_log ch "inner: waiting for hot-plugged memory" 180
# What Kata's ResizeMemory sends for a container with a 200 MiB limit: 256 MiB more (whole 128 MiB blocks).
ch_checked PUT /api/v1/vm.resize '{"desired_ram": 805306368}'
wait_log ch "MiB held in tmpfs" 180
ch_checked GET /api/v1/vm.info
grep -q '"size": *805306368' /tmp/ch-call.out || abort_gpuvm ch "vm.info does not say 768 MiB: $(cat /tmp/ch-call.out)"
wait_gpuvm ch 180 || fail "gpuvm status $?"
expect_line /tmp/ch.log "inner: blk ok"
expect_line /tmp/ch.log "inner: checks passed"
echo "memory hot-plug through vm.resize with a Linux guest and a virtio disk: ok"
