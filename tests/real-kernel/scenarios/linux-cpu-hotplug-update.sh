# about: live update of a VM whose guest ejected a vCPU: gpuvm as Cloud Hypervisor boots Linux with 1 of 2 vCPUs; vm.resize to 2 adds one that Linux onlines, back to 1 has Linux eject it (the old process parks its thread); `gpuvm update` hands the VM over with vCPU 0 alone, the new process keeping a spare thread for vCPU 1; there vm.resize to 2 makes vCPU 1 afresh, Linux onlines it and runs a task on it, and back to 1 ejects it again
. /lib/real-kernel.sh
# What is checked below is logged at info (Cloud Hypervisor's command line sets no level).
export GPUVM_LOG=info
start_ch
first="$(cat /tmp/ch.pid)"
ch_checked PUT /api/v1/vm.create '{"payload": {"kernel": "/images/vmlinuz", "initramfs": "/images/initramfs.cpio",
    "cmdline": "console=ttyS0 quiet panic=-1 inner.checks=cpuplug inner.cpuplugs=2 inner.end=poweroff"},
    "cpus": {"boot_vcpus": 1, "max_vcpus": 2}, "memory": {"size": 536870912},
    "serial": {"mode": "Tty"}, "console": {"mode": "Off"}}'
ch_checked PUT /api/v1/vm.boot
wait_log ch "inner: waiting for a hot-plugged CPU" 120
ch_checked PUT /api/v1/vm.resize '{"desired_vcpus": 2}'
wait_log ch "inner: cpu1 online" 120
ch_checked PUT /api/v1/vm.resize '{"desired_vcpus": 1}'
wait_log ch "inner: cpuplug round 1 done" 120
wait_log ch "vCPU 1 ejected by the guest and parked" 30

live_update_logged ch 1
new="$(cat /tmp/ch.pid)"
wait "$first" || abort_gpuvm ch "the first gpuvm exited with status $? after handing its VM over"
grep -q "paused_to_run_us=" /tmp/after-1.log || abort_gpuvm ch "the new process printed no paused_to_run_us"
figure "live update of a VM whose guest ejected a vCPU: guest paused $(update_paused_ms 1) ms"
ch_checked GET /api/v1/vm.info
grep -q '"boot_vcpus": *1' /tmp/ch-call.out || abort_gpuvm ch "vm.info in the new process does not say 1 vCPU: $(cat /tmp/ch-call.out)"

# In the new process: vCPU 1 made on its spare thread, onlined, run, ejected again.
online_count() {
    guest_lines /tmp/ch.log | grep -c "^inner: cpu1 online"
}
ch_checked PUT /api/v1/vm.resize '{"desired_vcpus": 2}'
wait_past ch online_count 1 120 "after the update"
ch_checked GET /api/v1/vm.info
grep -q '"boot_vcpus": *2' /tmp/ch-call.out || abort_gpuvm ch "vm.info does not say 2 vCPUs: $(cat /tmp/ch-call.out)"
ch_checked PUT /api/v1/vm.resize '{"desired_vcpus": 1}'
wait_gpuvm_ended ch "$new" 180 "the second removal"
sed 's/^/  | /' /tmp/ch.log
expect_line /tmp/ch.log "inner: cpuplug round 2 done"
expect_line /tmp/ch.log "inner: checks passed"
echo "a vCPU the guest ejected before a live update, hot-plugged and ejected again after it: ok"
