# about: live update of a VM with kernel VFIO and hot-plugged RAM: gpuvm as Cloud Hypervisor boots Linux with edu passed through (a type1 container) and room for more RAM; vm.resize adds 128 MiB, which gpuvm DMA-maps for edu and Linux onlines and fills; `gpuvm update` hands the VM over, the container's mappings of boot and hot-plugged RAM taking the new process's addresses (VFIO_DMA_MAP_FLAG_VADDR); then vm.resize back asks for the eject, and the new process takes the ejected RAM out of the container before it frees it
# qemu: -device edu,addr=0x4
. /lib/real-kernel.sh
bdf="$(pci_find 1234 11e8)" || fail "no edu device"
group="$(vfio_bind "$bdf")"
echo "edu at $bdf, $group"
dd if=/dev/zero of=/tmp/disk.img bs=1M count=16 2>/dev/null
# Offlining migrates the block's pages under emulation: give the guest more than the default 30 s.
export GPUVM_MEMORY_EJECT_TIMEOUT_MS=240000
# What is checked below is logged at info (the DMA mappings; Cloud Hypervisor's command line sets no level).
export GPUVM_LOG=info
start_ch
first="$(cat /tmp/ch.pid)"
ch_checked PUT /api/v1/vm.create '{"payload": {"kernel": "/images/vmlinuz", "initramfs": "/images/initramfs.cpio",
    "cmdline": "console=ttyS0 quiet panic=-1 memhp_default_state=online_movable inner.checks=blk,memunplug inner.end=poweroff"},
    "cpus": {"boot_vcpus": 1, "max_vcpus": 1},
    "memory": {"size": 536870912, "hotplug_size": 1073741824},
    "disks": [{"path": "/tmp/disk.img", "id": "disk0"}],
    "devices": [{"path": "/sys/bus/pci/devices/'"$bdf"'", "id": "edu0"}],
    "serial": {"mode": "Tty"}, "console": {"mode": "Off"}}'
ch_checked PUT /api/v1/vm.boot
wait_log ch "inner: memunplug waiting for hot-plugged memory" 180
has_line /tmp/ch.log "kernel VFIO: container/group API" || abort_gpuvm ch "edu is not on the container/group API"
mapper="kernel VFIO (type1 container)"
# The boot RAM's mappings: one DMA map call per chunk.
boot_chunks="$(sed -n "s/.*DMA map $mapper: start, .* in \([0-9][0-9]*\) chunk(s).*/\1/p" /tmp/ch.log | head -n1)"
[ -n "$boot_chunks" ] || abort_gpuvm ch "no 'DMA map $mapper: start, ... chunk(s)' line"

# 128 MiB more, DMA-mapped for edu before the answer.
ch_checked PUT /api/v1/vm.resize '{"desired_ram": 671088640}'
has_line /tmp/ch.log "DMA-mapped for $mapper" || abort_gpuvm ch "no 'hot-plugged RAM ...: DMA-mapped for $mapper' line"
wait_log ch "inner: waiting for the memory removal" 180

# The update: the container's mappings (boot RAM's chunks and the hot-plugged range) move to the new
# process's addresses, none unmapped or pinned again.
lines_before="$(wc -l </tmp/ch.log)"
live_update_logged ch 1
new="$(cat /tmp/ch.pid)"
wait "$first" || abort_gpuvm ch "the first gpuvm exited with status $? after handing its VM over"
grep -qF "DMA map $mapper: start" /tmp/after-1.log && abort_gpuvm ch "the new gpuvm DMA-mapped guest RAM again"
moved="$(sed -n "s/.*kernel VFIO (type1): \([0-9][0-9]*\) DMA mappings now use this process's addresses.*/\1/p" /tmp/after-1.log | tail -n1)"
[ -n "$moved" ] || abort_gpuvm ch "no 'N DMA mappings now use this process's addresses' line"
[ "$moved" = $((boot_chunks + 1)) ] ||
    abort_gpuvm ch "the new process moved $moved mappings: boot RAM's $boot_chunks and the hot-plugged range's 1 expected"
echo "update: $moved type1 mappings moved to process $new ($boot_chunks of boot RAM, 1 of hot-plugged RAM)"
figure "live update of a VM with kernel VFIO (edu, type1) and hot-plugged RAM: guest paused $(update_paused_ms 1) ms"

# The removal, in the new process: Linux ejects the range, gpuvm unmaps it from the container, then frees it.
started="$(uptime_s)"
ch_checked PUT /api/v1/vm.resize '{"desired_ram": 536870912}'
figure "memory removal of 128 MiB after a live update, with kernel VFIO: $(seconds_between "$started" "$(uptime_s)") s"
# (The new process names the context it took over "..., handed over".)
tail -n +"$((lines_before + 1))" /tmp/ch.log | grep -qF "DMA mapping removed for ${mapper%)}, handed over)" ||
    abort_gpuvm ch "the new process logged no 'ejected RAM ...: DMA mapping removed for ${mapper%)}, handed over)'"
ch_checked GET /api/v1/vm.info
grep -q '"size": *536870912' /tmp/ch-call.out || abort_gpuvm ch "vm.info does not say 512 MiB: $(cat /tmp/ch-call.out)"
wait_ended "$new" 300 || abort_gpuvm ch "gpuvm $new still runs 300 s after the removal"
sed 's/^/  | /' /tmp/ch.log
expect_line /tmp/ch.log "inner: memunplug ok"
expect_line /tmp/ch.log "inner: checks passed"
grep -F "DMA mapping removed for ${mapper%)}" /tmp/ch.log | sed 's/^/removal: /'
echo "kernel VFIO (type1) and hot-plugged RAM across a live update, the RAM ejected afterwards: ok"
