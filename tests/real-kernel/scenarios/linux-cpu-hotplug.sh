# about: vCPU hot-plug as Kata's default configuration asks for it: gpuvm as Cloud Hypervisor boots a Linux guest with 1 of 2 vCPUs; vm.resize to 1 changes nothing, to 2 adds one that Linux finds through ACPI and onlines, back to 1 ejects it
. /lib/real-kernel.sh
start_ch
ch_checked PUT /api/v1/vm.create '{"payload": {"kernel": "/images/vmlinuz", "initramfs": "/images/initramfs.cpio",
    "cmdline": "console=ttyS0 quiet panic=-1 inner.checks=cpuplug inner.end=poweroff"},
    "cpus": {"boot_vcpus": 1, "max_vcpus": 2}, "memory": {"size": 536870912},
    "serial": {"mode": "Tty"}, "console": {"mode": "Off"}}'
ch_checked PUT /api/v1/vm.boot
wait_log ch "inner: waiting for a hot-plugged CPU" 120
# Kata calls this at sandbox start with the boot count: a no-op.
ch_checked PUT /api/v1/vm.resize '{"desired_vcpus": 1}'
ch_checked PUT /api/v1/vm.resize '{"desired_vcpus": 2}'
wait_log ch "inner: cpu1 online" 120
ch_checked GET /api/v1/vm.info
grep -q '"boot_vcpus": *2' /tmp/ch-call.out || abort_gpuvm ch "vm.info does not say 2 vCPUs: $(cat /tmp/ch-call.out)"
ch_checked PUT /api/v1/vm.resize '{"desired_vcpus": 1}'
wait_gpuvm ch 180 || fail "gpuvm status $?"
expect_line /tmp/ch.log "inner: cpu1 removed"
expect_line /tmp/ch.log "inner: checks passed"
echo "vCPU hot-plug through vm.resize with a Linux guest: ok"
