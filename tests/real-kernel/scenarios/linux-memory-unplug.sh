# about: memory removal through vm.resize with a Linux guest: gpuvm as Cloud Hypervisor boots Linux (memhp_default_state=online_movable) with 512 MiB, room for 1 GiB more and a virtio disk; vm.resize adds 128 MiB that Linux onlines movable and puts data in, then vm.resize back to 512 MiB asks for the memory device's eject: Linux migrates the data out, offlines and removes the block and runs _EJ0, gpuvm frees the RAM and answers, vm.info says 512 MiB, and the guest's data and disk are fine
. /lib/real-kernel.sh
dd if=/dev/zero of=/tmp/disk.img bs=1M count=16 2>/dev/null
# Offlining migrates the block's pages under emulation: give the guest more than the default 30 s.
export GPUVM_MEMORY_EJECT_TIMEOUT_MS=240000
start_ch
ch_checked PUT /api/v1/vm.create '{"payload": {"kernel": "/images/vmlinuz", "initramfs": "/images/initramfs.cpio",
    "cmdline": "console=ttyS0 quiet panic=-1 memhp_default_state=online_movable inner.checks=blk,memunplug inner.end=poweroff"},
    "cpus": {"boot_vcpus": 1, "max_vcpus": 1},
    "memory": {"size": 536870912, "hotplug_size": 1073741824},
    "disks": [{"path": "/tmp/disk.img", "id": "disk0"}],
    "serial": {"mode": "Tty"}, "console": {"mode": "Off"}}'
ch_checked PUT /api/v1/vm.boot
wait_log ch "inner: memunplug waiting for hot-plugged memory" 180
ch_checked PUT /api/v1/vm.resize '{"desired_ram": 671088640}'
wait_log ch "inner: waiting for the memory removal" 180
ch_checked GET /api/v1/vm.info
grep -q '"size": *671088640' /tmp/ch-call.out || abort_gpuvm ch "vm.info does not say 640 MiB: $(cat /tmp/ch-call.out)"
started="$(uptime_s)"
# Answered once the guest ejected the memory device (or 504 after the eject timeout).
ch_checked PUT /api/v1/vm.resize '{"desired_ram": 536870912}'
figure "memory removal of 128 MiB through vm.resize, Linux guest under emulation: $(seconds_between "$started" "$(uptime_s)") s"
ch_checked GET /api/v1/vm.info
grep -q '"size": *536870912' /tmp/ch-call.out || abort_gpuvm ch "vm.info does not say 512 MiB: $(cat /tmp/ch-call.out)"
wait_gpuvm ch 300 || fail "gpuvm status $?"
expect_line /tmp/ch.log "inner: memunplug ok"
expect_line /tmp/ch.log "inner: checks passed"
echo "memory removal through vm.resize with a Linux guest and a virtio disk: ok"
