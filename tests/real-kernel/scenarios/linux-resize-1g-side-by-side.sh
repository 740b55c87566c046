# about: vm.resize adding 1 GiB as Kata sends it, timed: memfd RAM, RAM on hugetlb 2 MiB pages, and each again beside a passthrough device (edu on vfio-pci); gpuvm (as cloud-hypervisor) and, when bench/real-kernel --ch puts one in the machine, Cloud Hypervisor itself, each from the request to its answer and to Linux having every new memory block online
# qemu: -device edu,addr=0x4
# memory: 5G
. /lib/real-kernel.sh

readonly BOOT_RAM=536870912
readonly GROWN_RAM=1610612736
# Boot RAM and the 1 GiB added, in 2 MiB pages, and a few to spare.
readonly HUGEPAGES=800

bdf="$(pci_find 1234 11e8)" || fail "no edu device"
vfio_bind "$bdf" >/dev/null
# gpuvm logs at info level (the peer ignores GPUVM_LOG): its hot-plug and DMA mapping lines are shown.
export GPUVM_LOG=info

# hugepages COUNT: sets the 2 MiB pool of this machine and checks it got COUNT pages.
hugepages() {
    echo "$1" >/proc/sys/vm/nr_hugepages
    got="$(cat /proc/sys/vm/nr_hugepages)"
    [ "$got" = "$1" ] || fail "asked for $1 huge pages of 2 MiB, got $got"
}

# grow_1g LABEL VARIANT [BINARY]: one VMM boots a Linux guest with 512 MiB and room for 1 GiB more (on
# hugetlb 2 MiB pages for the *hugetlb variants, beside edu for the vfio* ones), then vm.resize adds 1 GiB;
# a `figure: resize` line gives the seconds from the request to its answer and to Linux having every new
# memory block online.
grow_1g() {
    label="$1"
    variant="$2"
    memory="\"size\": $BOOT_RAM, \"hotplug_size\": 1073741824"
    devices=""
    case "$variant" in
    *hugetlb*)
        hugepages "$HUGEPAGES"
        memory="$memory, \"hugepages\": true, \"hugepage_size\": 2097152"
        ;;
    esac
    case "$variant" in
    vfio*) devices="\"devices\": [{\"path\": \"/sys/bus/pci/devices/$bdf\", \"id\": \"edu0\"}]," ;;
    esac
    echo "resize 1 GiB: $label, $variant"
    start_ch "$3"
    ch_checked PUT /api/v1/vm.create "{\"payload\": {\"kernel\": \"/images/vmlinuz\",
        \"initramfs\": \"/images/initramfs.cpio\",
        \"cmdline\": \"console=ttyS0 quiet panic=-1 memhp_default_state=online inner.checks=memgrow inner.memgrow=1024 inner.end=poweroff\"},
        \"cpus\": {\"boot_vcpus\": 1, \"max_vcpus\": 1}, \"memory\": {$memory}, $devices
        \"serial\": {\"mode\": \"Tty\"}, \"console\": {\"mode\": \"Off\"}}"
    ch_checked PUT /api/v1/vm.boot
    wait_log ch "inner: waiting for 1024 MiB of hot-plugged memory" 240
    asked=$(uptime_s)
    ch_checked PUT /api/v1/vm.resize "{\"desired_ram\": $GROWN_RAM}"
    answered=$(uptime_s)
    wait_log ch "inner: memgrow online" 240
    online=$(uptime_s)
    figure "resize $label $variant answered $(seconds_between "$asked" "$answered") s, online $(seconds_between "$asked" "$online") s"
    wait_log ch "inner: checks " 240
    # The guest powers off; a VMM still running after that is ended through its API.
    sleep 2
    gpuvm ctl --api-sock /tmp/ch.sock raw PUT /api/v1/vmm.shutdown >/dev/null 2>&1 || true
    wait_gpuvm ch 30 || true
    expect_line /tmp/ch.log "inner: memgrow ok"
    expect_line /tmp/ch.log "inner: checks passed"
    case "$variant" in *hugetlb*) hugepages 0 ;; esac
}

# variants LABEL [BINARY]: every variant on one VMM. A variant the peer fails is said, with its log (the
# figures of the others stand); one gpuvm fails ends the scenario.
variants() {
    for variant in memfd hugetlb vfio-memfd vfio-hugetlb; do
        if [ "$1" = gpuvm ]; then
            grow_1g gpuvm "$variant"
            # gpuvm maps the new RAM for the device before it answers: its log says so before the
            # hot-plug line.
            grep -E "hot-plugged RAM at .*DMA-mapped|of RAM hot-plugged at" /tmp/ch.log | sed 's/^/  gpuvm: /'
        elif ! (grow_1g "$1" "$variant" "$2"); then
            echo "resize $1 $variant: failed (its log is above)"
            echo 0 >/proc/sys/vm/nr_hugepages
        fi
    done
}

variants gpuvm
if [ -x /bin/cloud-hypervisor-peer ]; then
    variants cloud-hypervisor /bin/cloud-hypervisor-peer
else
    echo "no Cloud Hypervisor in this machine (bench/real-kernel --ch PATH puts one here): gpuvm's figures only"
fi
echo "vm.resize 1 GiB side by side: ok"
