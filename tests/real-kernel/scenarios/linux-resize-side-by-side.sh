# about: vm.resize as Kata sends it, timed: a Linux guest gets a vCPU and 256 MiB hot-added, gpuvm (as cloud-hypervisor) and, when bench/real-kernel --ch puts one in the machine, Cloud Hypervisor itself, each from the request to its answer and to Linux having the CPU online and the RAM onlined
. /lib/real-kernel.sh

# resize_figures LABEL [BINARY]: one VMM through the whole sequence, its figures on `figure: resize` lines.
resize_figures() {
    label="$1"
    start_ch "$2"
    ch_checked PUT /api/v1/vm.create '{"payload": {"kernel": "/images/vmlinuz", "initramfs": "/images/initramfs.cpio",
        "cmdline": "console=ttyS0 quiet panic=-1 inner.checks=blk,cpuplug,memplug inner.end=poweroff"},
        "cpus": {"boot_vcpus": 1, "max_vcpus": 2},
        "memory": {"size": 536870912, "hotplug_size": 1073741824},
        "disks": [{"path": "/tmp/disk.img", "id": "disk0"}],
        "serial": {"mode": "Tty"}, "console": {"mode": "Off"}}'
    ch_checked PUT /api/v1/vm.boot
    wait_log ch "inner: waiting for a hot-plugged CPU" 180
    asked=$(uptime_s)
    ch_checked PUT /api/v1/vm.resize '{"desired_vcpus": 2}'
    answered=$(uptime_s)
    wait_log ch "inner: cpu1 online" 180
    online=$(uptime_s)
    figure "resize $label vcpu answered $(seconds_between "$asked" "$answered") s, online $(seconds_between "$asked" "$online") s"
    ch_checked PUT /api/v1/vm.resize '{"desired_vcpus": 1}'
    wait_log ch "inner: waiting for hot-plugged memory" 180
    asked=$(uptime_s)
    ch_checked PUT /api/v1/vm.resize '{"desired_ram": 805306368}'
    answered=$(uptime_s)
    wait_log ch "memory blocks" 180
    online=$(uptime_s)
    figure "resize $label ram answered $(seconds_between "$asked" "$answered") s, online $(seconds_between "$asked" "$online") s"
    wait_log ch "inner: checks " 240
    # The guest powers off; a VMM still running after that is ended through its API.
    sleep 2
    gpuvm ctl --api-sock /tmp/ch.sock raw PUT /api/v1/vmm.shutdown >/dev/null 2>&1 || true
    wait_gpuvm ch 30 || true
    expect_line /tmp/ch.log "inner: checks passed"
}

dd if=/dev/zero of=/tmp/disk.img bs=1M count=16 2>/dev/null
resize_figures gpuvm
if [ -x /bin/cloud-hypervisor-peer ]; then
    resize_figures cloud-hypervisor /bin/cloud-hypervisor-peer
else
    echo "no Cloud Hypervisor in this machine (bench/real-kernel --ch PATH puts one here): gpuvm's figures only"
fi
echo "vm.resize side by side: ok"
