# about: live update of a VM whose kernel VFIO devices sit behind the PCIe switch gpuvm mirrors from the host: two edu devices behind a root port, a switch upstream port and two downstream ports; Linux reads and writes both through their BARs every second while `gpuvm update` hands the VM over; the new process plugs each back at its path through the rebuilt ports, with no reset and no DMA map
# qemu: -device pcie-root-port,id=rp9,chassis=9,slot=9,addr=0x9 -device x3130-upstream,id=up9,bus=rp9
# qemu: -device xio3130-downstream,id=dn90,bus=up9,chassis=10,slot=0 -device xio3130-downstream,id=dn91,bus=up9,chassis=11,slot=1
# qemu: -device edu,bus=dn90 -device edu,bus=dn91
. /lib/real-kernel.sh
a="$(pci_find 1234 11e8 1)" || fail "no edu device"
b="$(pci_find 1234 11e8 2)" || fail "no second edu device"
echo "edu at $a ($(vfio_bind "$a")) and $b ($(vfio_bind "$b"))"
start_gpuvm linux run --log-level info --api-sock /tmp/api.sock --kernel /images/vmlinuz \
    --initrd /images/initramfs.cpio --memory 256M --gpu "$a" --gpu "$b" \
    --cmdline "console=ttyS0 quiet panic=-1 inner.checks=topology inner.topology=1234:11e8 inner.toporounds=600 inner.end=poweroff"
wait_for /tmp/api.sock 30
gpuvm ctl --api-sock /tmp/api.sock start || abort_gpuvm linux "InstanceStart failed"

# The guest's latest round (0 before the first).
round_count() {
    count="$(guest_lines /tmp/linux.log | sed -n 's/^inner: topology round \([0-9][0-9]*\) ok.*/\1/p' | tail -n1)"
    echo "${count:-0}"
}

# rounds_past COUNT SECONDS WHAT: until the guest reports more than COUNT rounds.
rounds_past() {
    wait_past linux round_count "$1" "$2" "$3"
}

rounds_past 1 240 "before the update"
has_line /tmp/linux.log "inner: $a under root port" || abort_gpuvm linux "the guest found $a under no root port"
guest_lines /tmp/linux.log | grep -E "^inner: (0000|topology)"
before="$(round_count)"
live_update_logged linux 1 --api-sock /tmp/api.sock
taken="$(grep -c "kernel VFIO .* taken over from the old process (no reset, no DMA map" /tmp/after-1.log)"
[ "$taken" = 2 ] || abort_gpuvm linux "the new process took $taken kernel VFIO devices over, not 2"
grep "taken over from the old process" /tmp/after-1.log | sed 's/^/update: /'
grep -F "switch downstream port restored" /tmp/after-1.log | sed 's/^/update: /'
rounds_past $((before + 3)) 60 "after the update"
echo "after the update the guest's rounds went on from $before to $(round_count), both devices answering behind the ports"
figure "live update of a VM with 2 kernel VFIO devices behind a mirrored switch: guest paused $(update_paused_ms 1) ms"
last="$(cat /tmp/linux.pid)"
gpuvm ctl --api-sock /tmp/api.sock ctrl-alt-del || abort_gpuvm linux "SendCtrlAltDel failed"
wait_ended "$last" 60 || abort_gpuvm linux "gpuvm $last still runs 60 s after Ctrl-Alt-Del"
sed 's/^/  | /' /tmp/linux.log
grep -q "inner: FAIL" /tmp/linux.log && fail "the guest failed"
echo "kernel VFIO devices behind a mirrored PCIe switch across a live update: ok"
