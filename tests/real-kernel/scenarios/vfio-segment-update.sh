# about: live update of a two-node VM whose passthrough devices sit on PCI segment 1 (node 1's): gpuvm as Cloud Hypervisor boots Linux with edu passed through (kernel VFIO) with pci_segment 1 and a disk there too, then vm.add-device hot-plugs a second edu onto segment 1; Linux reads and writes every edu through its BAR every second (`inner.devrounds`) while `gpuvm update` hands the VM over; the new process builds segment 1 as the old one had it (its windows and allocations, which it does not plan again), plugs the cold-plugged edu back into its slot there and the hot-plugged one into segment 1's hot-plug slot, no reset and no DMA map; the rounds go on over both, and vm.remove-device in the new process has Linux eject the hot-plugged one from segment 1
# qemu: -device edu,addr=0x4 -device edu,addr=0x5
. /lib/real-kernel.sh
a="$(pci_find 1234 11e8 1)" || fail "no edu device"
b="$(pci_find 1234 11e8 2)" || fail "no second edu device"
echo "edu at $a ($(vfio_bind "$a")) and $b ($(vfio_bind "$b"))"
dd if=/dev/zero of=/tmp/segment-disk.img bs=1M count=4 2>/dev/null
# What is checked below is logged at info (Cloud Hypervisor's command line sets no level).
export GPUVM_LOG=info
start_ch
first="$(cat /tmp/ch.pid)"
ch_checked PUT /api/v1/vm.create '{"payload": {"kernel": "/images/vmlinuz", "initramfs": "/images/initramfs.cpio",
    "cmdline": "console=ttyS0 quiet panic=-1 inner.checks=devrounds inner.devrounds=1234:11e8 inner.end=poweroff"},
    "cpus": {"boot_vcpus": 2, "max_vcpus": 2},
    "memory": {"size": 536870912},
    "platform": {"num_pci_segments": 2},
    "disks": [{"path": "/tmp/segment-disk.img", "pci_segment": 1}],
    "devices": [{"path": "/sys/bus/pci/devices/'"$a"'", "id": "edu0", "pci_segment": 1}],
    "numa": [{"guest_numa_id": 0, "cpus": [0], "distances": [{"destination": 1, "distance": 25}], "pci_segments": [0]},
             {"guest_numa_id": 1, "cpus": [1], "distances": [{"destination": 0, "distance": 25}], "pci_segments": [1]}],
    "serial": {"mode": "Tty"}, "console": {"mode": "Off"}}'
ch_checked PUT /api/v1/vm.boot

# The guest's latest round (0 before the first), and the devices it checked in it.
round_count() {
    count="$(guest_lines /tmp/ch.log | sed -n 's/^inner: device round \([0-9][0-9]*\) ok.*/\1/p' | tail -n1)"
    echo "${count:-0}"
}
last_round_devices() {
    guest_lines /tmp/ch.log | tr -d '\r' | sed -n 's/^inner: device round [0-9][0-9]* ok: *//p' | tail -n1
}

wait_past ch round_count 1 240 "before the hot-plug"
[ "$(last_round_devices)" = 0001:00:01.0 ] ||
    abort_gpuvm ch "the guest checks '$(last_round_devices)', not the cold-plugged edu at 0001:00:01.0"
ch_checked PUT /api/v1/vm.add-device '{"path": "/sys/bus/pci/devices/'"$b"'", "id": "edu1", "pci_segment": 1}'
cat /tmp/ch-call.out
hot="$(sed -n 's/.*"bdf": *"\(0001:00:[0-9a-f][0-9a-f]\.0\)".*/\1/p' /tmp/ch-call.out)"
[ -n "$hot" ] || abort_gpuvm ch "vm.add-device answered no segment-1 address"
wait_log ch "ok: 0001:00:01.0 $hot" 120

before="$(round_count)"
live_update_logged ch 1
new="$(cat /tmp/ch.pid)"
wait "$first" || abort_gpuvm ch "the first gpuvm exited with status $? after handing its VM over"
grep -q "kernel VFIO $a at 0001:00:01.0 taken over from the old process (no reset, no DMA map" /tmp/after-1.log ||
    abort_gpuvm ch "the new process logged no 'kernel VFIO $a at 0001:00:01.0 taken over from the old process'"
grep -q "hot-plugged edu1 ($hot $b) taken over from the old process (no reset, no DMA map" /tmp/after-1.log ||
    abort_gpuvm ch "the new process logged no 'hot-plugged edu1 ($hot $b) taken over from the old process'"
grep -qE "DMA map kernel VFIO \((type1 container|iommufd)\): start" /tmp/after-1.log &&
    abort_gpuvm ch "the new process DMA-mapped guest RAM again"
grep "taken over from the old process" /tmp/after-1.log | sed 's/^/update: /'
wait_past ch round_count $((before + 3)) 60 "after the update"
[ "$(last_round_devices)" = "0001:00:01.0 $hot" ] ||
    abort_gpuvm ch "after the update the guest checks '$(last_round_devices)', not 0001:00:01.0 and $hot"
echo "after the update the guest's rounds over both edu devices on segment 1 went on from $before to $(round_count)"
figure "live update of a VM with 2 kernel VFIO devices on PCI segment 1 (one hot-plugged): guest paused $(update_paused_ms 1) ms"

# Still a hot-plugged device on segment 1, in the new process: vm.remove-device has the guest eject it, the
# cold-plugged one goes on alone, and the guest powers off after three more rounds.
ch_checked PUT /api/v1/vm.remove-device '{"id": "edu1"}'
wait_log ch "inner: device $hot gone" 120
wait_gpuvm_ended ch "$new" 120 "the removal"
sed 's/^/  | /' /tmp/ch.log
expect_line /tmp/ch.log "inner: devrounds ok"
expect_line /tmp/ch.log "inner: checks passed"
[ "$(last_round_devices)" = 0001:00:01.0 ] ||
    fail "after the removal the guest checked '$(last_round_devices)', not 0001:00:01.0 alone"
echo "two kernel VFIO devices on PCI segment 1, one hot-plugged, across a live update, the hot-plugged one removed afterwards: ok"
