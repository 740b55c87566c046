# about: guest NUMA nodes as Kata's Cloud Hypervisor configuration gives them: gpuvm boots a Linux guest with two nodes (a vCPU and 256 MiB each, distance 25) and room for 1 GiB of hot-plugged RAM; Linux builds both nodes from the SRAT and SLIT with their CPUs, RAM and distances, and knows the hot-plug room as node 1's
. /lib/real-kernel.sh
start_ch
ch_checked PUT /api/v1/vm.create '{"payload": {"kernel": "/images/vmlinuz", "initramfs": "/images/initramfs.cpio",
    "cmdline": "console=ttyS0 quiet panic=-1 inner.checks=numa inner.end=poweroff"},
    "cpus": {"boot_vcpus": 2, "max_vcpus": 2},
    "memory": {"size": 536870912, "hotplug_size": 1073741824},
    "numa": [{"guest_numa_id": 0, "cpus": [0], "distances": [{"destination": 1, "distance": 25}]},
             {"guest_numa_id": 1, "cpus": [1], "distances": [{"destination": 0, "distance": 25}]}],
    "serial": {"mode": "Tty"}, "console": {"mode": "Off"}}'
ch_checked PUT /api/v1/vm.boot
wait_gpuvm ch 240 || fail "gpuvm status $?"
expect_line /tmp/ch.log "inner: numa ok (2 nodes)"
expect_line /tmp/ch.log "inner: node0 cpus 0 memory"
expect_line /tmp/ch.log "inner: node1 cpus 1 memory"
expect_line /tmp/ch.log "MiB distance 10 25"
expect_line /tmp/ch.log "MiB distance 25 10"
# Boot RAM: node 0 from 0, node 1 from 256 MiB; the hot-plug room right after boot RAM (at 4 GiB, the
# highest boot RAM being node 1's) is node 1's and flagged hot-pluggable.
expect_line /tmp/ch.log "SRAT: Node 0 PXM 0 [mem 0x00000000-0x0fffffff]"
expect_line /tmp/ch.log "SRAT: Node 1 PXM 1 [mem 0x10000000-0x1fffffff]"
expect_line /tmp/ch.log "SRAT: Node 1 PXM 1 [mem 0x100000000-0x13fffffff] hotplug"
# Each node holds most of its 256 MiB (the kernel's own reservations come off node 0).
for node in 0 1; do
    mib="$(sed -n "s/.*inner: node$node cpus [0-9-]* memory \([0-9]*\) MiB.*/\1/p" /tmp/ch.log)"
    [ "${mib:-0}" -ge 128 ] && [ "${mib:-0}" -le 256 ] || fail "node $node has ${mib:-no} MiB, not 128 to 256"
done
expect_line /tmp/ch.log "inner: checks passed"
echo "two NUMA nodes with their CPUs, RAM, distances and hot-plug room in a Linux guest: ok"
