# about: guest NUMA nodes as Kata's Cloud Hypervisor configuration gives them: gpuvm boots a Linux guest with two nodes (a vCPU and 256 MiB each, distance 25) and room for 1 GiB of hot-plugged RAM; Linux builds both nodes from the SRAT and SLIT with their CPUs, RAM and distances, and knows the hot-plug room as node 1's; PCI segment 1 is node 1's (numa[].pci_segments) and Linux puts the virtio disk and an edu device passed through with pci_segment 1 (kernel VFIO) there, on node 1. Then an edu device passed through (kernel VFIO) from host node 1 goes behind a root port (--pci-topology host) on node 1's PCI segment, beside a root port for hot-plug on segment 0: Linux enumerates the port through segment 1's ECAM window (which moved up past segment 0's two buses) and its sysfs shows the device on node 1. Last, edu hot-plugged by vm.add-device with pci_segment 1 into a running two-node VM arrives through segment 1's own ACPI hot-plug slots at 0001:00:01.0 on node 1 and is ejected there
# qemu: -device edu,addr=0x4
# The root port for hot-plug has a 512 GiB prefetchable window: above the 40 physical address bits QEMU's
# CPU has by default, so this machine's CPU (the runner's, repeated: the last -cpu wins) gets 48.
# qemu: -cpu qemu64,+svm,+npt,phys-bits=48
. /lib/real-kernel.sh
edu="$(pci_find 1234 11e8)" || fail "no edu device"
echo "edu at $edu ($(vfio_bind "$edu"))"
start_ch
dd if=/dev/zero of=/tmp/numa-disk.img bs=1M count=4 2>/dev/null
# The disk (virtio-blk, 1af4:1042) and edu (kernel VFIO, 1234:11e8, Cloud Hypervisor's `pci_segment` on a
# device) sit on PCI segment 1, which numa[1].pci_segments makes node 1's.
ch_checked PUT /api/v1/vm.create '{"payload": {"kernel": "/images/vmlinuz", "initramfs": "/images/initramfs.cpio",
    "cmdline": "console=ttyS0 quiet panic=-1 inner.checks=numa inner.numa_device=1af4:1042,1234:11e8 inner.end=poweroff"},
    "cpus": {"boot_vcpus": 2, "max_vcpus": 2},
    "memory": {"size": 536870912, "hotplug_size": 1073741824},
    "platform": {"num_pci_segments": 2},
    "disks": [{"path": "/tmp/numa-disk.img", "pci_segment": 1}],
    "devices": [{"path": "/sys/bus/pci/devices/'"$edu"'", "pci_segment": 1}],
    "numa": [{"guest_numa_id": 0, "cpus": [0], "distances": [{"destination": 1, "distance": 25}], "pci_segments": [0]},
             {"guest_numa_id": 1, "cpus": [1], "distances": [{"destination": 0, "distance": 25}], "pci_segments": [1]}],
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
# Linux reads each device's node from PC01's _PXM, which numa[1].pci_segments gave it (edu, plugged
# first, takes slot 1 and the disk slot 2).
expect_line /tmp/ch.log "inner: numa device 1234:11e8 at 0001:00:01.0 node 1"
expect_line /tmp/ch.log "inner: numa device 1af4:1042 at 0001:00:02.0 node 1"
# Each node holds most of its 256 MiB (the kernel's own reservations come off node 0).
for node in 0 1; do
    mib="$(sed -n "s/.*inner: node$node cpus [0-9-]* memory \([0-9]*\) MiB.*/\1/p" /tmp/ch.log)"
    [ "${mib:-0}" -ge 128 ] && [ "${mib:-0}" -le 256 ] || fail "node $node has ${mib:-no} MiB, not 128 to 256"
done
expect_line /tmp/ch.log "inner: checks passed"

# A passthrough device on host node 1. This machine has one node and edu none: a fake sysfs tree gives
# gpuvm two host nodes and edu on node 1 (the host facts only; edu itself is the real one, through
# kernel VFIO), and the test hook binds both guest nodes' RAM to the real node 0.
# The device under its root complex, as sysfs links it (the host topology is read from the chain).
complex="pci${edu%:*}"
mkdir -p /tmp/sys/devices/system/node/node0 /tmp/sys/devices/system/node/node1 "/tmp/sys/devices/$complex/$edu" \
    /tmp/sys/bus/pci/devices
echo 1 >"/tmp/sys/devices/$complex/$edu/numa_node"
ln -s "../../../devices/$complex/$edu" "/tmp/sys/bus/pci/devices/$edu"
export GPUVM_TEST_SYSFS_ROOT=/tmp/sys GPUVM_TEST_NUMA_BIND_NODE=0
run_gpuvm numa-gpu 240 run --log-level info --kernel /images/vmlinuz --initrd /images/initramfs.cpio \
    --vcpus 2 --memory 512M --gpu "$edu" --pci-topology host --pcie-root-ports 1 \
    --numa node=0,cpus=0,mem_mib=256,host_node=0 --numa node=1,cpus=1,mem_mib=256,host_node=1 \
    --cmdline "console=ttyS0 quiet panic=-1 inner.checks=numa inner.numa_device=1234:11e8 inner.end=poweroff" ||
    fail "gpuvm status $?"
unset GPUVM_TEST_SYSFS_ROOT GPUVM_TEST_NUMA_BIND_NODE
expect_line /tmp/numa-gpu.log "passthrough device $edu: PCI segment 1, whose host bridge is guest node 1's"
# Segment 0 numbers two buses (bus 0 and the hot-plug port's), so segment 1's ECAM window starts 2 MiB up.
expect_line /tmp/numa-gpu.log "ECAM 0xe0200000 (2 buses)"
expect_line /tmp/numa-gpu.log "PCI 0001:00:01.0: root port"
# Linux reads the node from PC01's _PXM: the device is behind the root port on segment 1, node 1.
expect_line /tmp/numa-gpu.log "inner: numa device 1234:11e8 at 0001:01:00.0 node 1"
expect_line /tmp/numa-gpu.log "inner: checks passed"

# A device hot-plugged onto node 1's segment (Cloud Hypervisor's vm.add-device with pci_segment 1): the
# GED's event runs PC01's PCNT over segment 1's own hot-plug registers, Linux's acpiphp finds the device in
# PC01's slot 1, on node 1; vm.remove-device asks the guest to eject it there.
start_ch
ch_checked PUT /api/v1/vm.create '{"payload": {"kernel": "/images/vmlinuz", "initramfs": "/images/initramfs.cpio",
    "cmdline": "console=ttyS0 quiet panic=-1 inner.checks=hotplug inner.hotplug=1234:11e8 inner.end=poweroff"},
    "cpus": {"boot_vcpus": 2, "max_vcpus": 2},
    "memory": {"size": 536870912},
    "platform": {"num_pci_segments": 2},
    "numa": [{"guest_numa_id": 0, "cpus": [0], "distances": [{"destination": 1, "distance": 25}], "pci_segments": [0]},
             {"guest_numa_id": 1, "cpus": [1], "distances": [{"destination": 0, "distance": 25}], "pci_segments": [1]}],
    "serial": {"mode": "Tty"}, "console": {"mode": "Off"}}'
ch_checked PUT /api/v1/vm.boot
wait_log ch "inner: waiting for hot-plug of 1234:11e8" 120
ch_checked PUT /api/v1/vm.add-device '{"path": "/sys/bus/pci/devices/'"$edu"'", "id": "edu1", "pci_segment": 1}'
cat /tmp/ch-call.out
grep -q '"bdf": *"0001:00:01.0"' /tmp/ch-call.out || abort_gpuvm ch "vm.add-device answered no 0001:00:01.0"
wait_log ch "inner: hot-plugged 1234:11e8 at 0001:00:01.0" 120
expect_line /tmp/ch.log "inner: hot-plugged 1234:11e8 at 0001:00:01.0"
ch_checked PUT /api/v1/vm.remove-device '{"id": "edu1"}'
wait_log ch "inner: 0001:00:01.0 ejected" 120
wait_gpuvm ch 120 || fail "gpuvm status $?"
expect_line /tmp/ch.log "inner: checks passed"
echo "two NUMA nodes with their CPUs, RAM, distances and hot-plug room in a Linux guest, a passthrough device behind a root port on node 1, one hot-plugged onto node 1's segment: ok"
