# about: four emulated GPUs (gpuvm-emu-gpu over vfio-user) take the places of four host GPUs behind two PCIe switches of a fake host sysfs tree; gpuvm (--pci-topology host) gives a Linux guest two virtual switches with two GPUs each, and after a pause, a snapshot and a restore in a new gpuvm process the guest finds the same tree again, round after round
# needs: gpuvm-emu-gpu
. /lib/real-kernel.sh
command -v gpuvm-emu-gpu >/dev/null || fail "no gpuvm-emu-gpu in the machine"

# The host's PCIe topology as gpuvm reads it from sysfs (GPUVM_TEST_SYSFS_ROOT): devices/pci0000:40/ROOT/
# UPSTREAM/DOWNSTREAM/GPU directories and bus/pci/devices/BDF links to each, as tests/pci_topology.rs
# builds it: switch A (41:00.0) under root port 40:01.0 holds GPUs 43:00.0 and 44:00.0, switch B (51:00.0)
# under root port 40:03.0 holds 53:00.0 and 54:00.0.
sys=/tmp/host-sys
mkdir -p "$sys/bus/pci/devices"
gpus=""
for chain in "0000:40:01.0 0000:41:00.0 0000:42:00.0 0000:43:00.0" \
    "0000:40:01.0 0000:41:00.0 0000:42:01.0 0000:44:00.0" \
    "0000:40:03.0 0000:51:00.0 0000:52:00.0 0000:53:00.0" \
    "0000:40:03.0 0000:51:00.0 0000:52:01.0 0000:54:00.0"; do
    dir="$sys/devices/pci0000:40"
    for bdf in $chain; do
        dir="$dir/$bdf"
        mkdir -p "$dir"
        [ -L "$sys/bus/pci/devices/$bdf" ] || ln -s "$dir" "$sys/bus/pci/devices/$bdf"
    done
    gpus="$gpus $bdf"
done
echo "fake host sysfs at $sys: GPUs$gpus behind switches 0000:41:00.0 and 0000:51:00.0"

# One emulated GPU per host GPU (BAR1 16 MiB), each serving two VMMs one after the other: the first gpuvm
# and the one that restores the snapshot.
args=""
n=0
for gpu in $gpus; do
    GPUVM_LOG=info gpuvm-emu-gpu --socket "/tmp/gpu$n.sock" --bar1-mib 16 --clients 2 >"/tmp/emu$n.log" 2>&1 &
    echo $! >"/tmp/emu$n.pid"
    args="$args --vfio-user /tmp/gpu$n.sock,topology_bdf=$gpu"
    n=$((n + 1))
done
for n in 0 1 2 3; do
    tries=0
    until grep -q "emu-gpu: listening on" "/tmp/emu$n.log"; do
        tries=$((tries + 1))
        [ "$tries" -le 300 ] || { cat "/tmp/emu$n.log"; fail "emulated GPU $n is not listening after 30 s"; }
        sleep 0.1
    done
done
echo "4 emulated GPUs (10de:2330) listening on /tmp/gpu[0-3].sock"

# abort_restored MESSAGE: the restored gpuvm failed: the emulated GPUs' logs (what each did with the first
# gpuvm's connection and the new one) are shown with its own.
abort_restored() {
    for n in 0 1 2 3; do
        sed "s/^/  emu$n: /" "/tmp/emu$n.log"
    done
    abort_gpuvm restored "$1"
}

# emu_ended N: waits for emulated GPU N to end (killing it past 30 s) and sets `status` to its exit status.
emu_ended() {
    pid="$(cat "/tmp/emu$1.pid")"
    wait_ended "$pid" 30 || { echo "emulated GPU $1 still runs 30 s later; killed"; kill -9 "$pid" 2>/dev/null; }
    status=0
    wait "$pid" || status=$?
}

# round_count NAME: the latest `inner: switches round N ok` in the log of gpuvm NAME (0 before the first).
round_count() {
    count="$(guest_lines "/tmp/$1.log" | sed -n 's/^inner: switches round \([0-9][0-9]*\) ok.*/\1/p' | tail -n1)"
    echo "${count:-0}"
}

export GPUVM_TEST_SYSFS_ROOT="$sys"
# shellcheck disable=SC2086 # the --vfio-user arguments are words
start_gpuvm topo run --log-level info --api-sock /tmp/api.sock --kernel /images/vmlinuz \
    --initrd /images/initramfs.cpio --memory 256M --pci-topology host $args \
    --cmdline "console=ttyS0 quiet panic=-1 inner.checks=switches inner.switches=10de:2330 inner.end=hold"
unset GPUVM_TEST_SYSFS_ROOT
wait_for /tmp/api.sock 30
started="$(uptime_s)"
gpuvm ctl --api-sock /tmp/api.sock start || abort_gpuvm topo "InstanceStart failed"
wait_log topo "inner: switches ok" 240
figure "vfio-user topology: InstanceStart to the guest's first walk of 2 switches and 4 GPUs $(seconds_between "$started" "$(uptime_s)") s"
for host_switch in 0000:41:00.0 0000:51:00.0; do
    expect_line /tmp/topo.log "switch upstream port (host switch $host_switch)"
done
wait_past topo "round_count topo" 0 120 "before the snapshot"
guest_lines /tmp/topo.log | grep -E "^inner: (GPU|switches)"

# Paused, snapshotted (each GPU's state through its migration region), and the first gpuvm ended.
gpuvm ctl --api-sock /tmp/api.sock pause || abort_gpuvm topo "pausing the VM failed"
# (Counted once paused: the guest prints no more rounds.)
before="$(round_count topo)"
from="$(uptime_s)"
gpuvm ctl --api-sock /tmp/api.sock snapshot-create --dir /tmp/snap >/tmp/snapshot.out 2>&1 ||
    abort_gpuvm topo "the snapshot failed: $(cat /tmp/snapshot.out)"
snapshot_s="$(seconds_between "$from" "$(uptime_s)")"
cat /tmp/snapshot.out
for key in pci_topology_ports migrated_gpus; do
    grep -aq "\"$key\"" /tmp/snap/state || abort_gpuvm topo "the snapshot's state has no $key"
done
echo "snapshot at topology round $before in $snapshot_s s: $(ls /tmp/snap | tr '\n' ' ')"
figure "vfio-user topology: snapshot of the paused VM (4 GPUs behind 2 switches, 256 MiB) $snapshot_s s"
pid="$(cat /tmp/topo.pid)"
kill -9 "$pid"
wait "$pid" 2>/dev/null
sed 's/^/  | /' /tmp/topo.log
rm -f /tmp/api.sock

# A new gpuvm restores it: the ports rebuilt in place from the snapshot, the GPUs restored behind them on
# the same device processes; resumed, the guest walks the same tree round after round.
start_gpuvm restored run --log-level info --api-sock /tmp/api.sock
wait_for /tmp/api.sock 30
from="$(uptime_s)"
gpuvm ctl --api-sock /tmp/api.sock snapshot-load --dir /tmp/snap || abort_restored "the restore failed"
gpuvm ctl --api-sock /tmp/api.sock resume || abort_restored "resuming the restored VM failed"
for what in "root port restored" "switch upstream port restored" "switch downstream port restored"; do
    expect_line /tmp/restored.log "$what"
done
wait_past restored "round_count restored" "$before" 120 "after the restore"
figure "vfio-user topology: restore and resume to the guest's next topology round $(seconds_between "$from" "$(uptime_s)") s"
after="$(round_count restored)"
wait_past restored "round_count restored" "$after" 60 "after the restore"
echo "after the restore the guest went on from topology round $before to $(round_count restored), the same tree each round"

# Ctrl-Alt-Del ends the restored VM; then each emulated GPU, having served both gpuvms, ends with status 0.
last="$(cat /tmp/restored.pid)"
gpuvm ctl --api-sock /tmp/api.sock ctrl-alt-del || abort_gpuvm restored "SendCtrlAltDel failed"
wait_gpuvm restored 60 || fail "the restored gpuvm ended with status $?"
running "$last" && fail "the restored gpuvm still runs"
has_line /tmp/restored.log "inner: FAIL" && fail "the restored guest reported a failure"
for n in 0 1 2 3; do
    emu_ended "$n"
    [ "$status" = 0 ] || { cat "/tmp/emu$n.log"; fail "emulated GPU $n exited with status $status"; }
    served="$(grep -c "emu-gpu: listening on" "/tmp/emu$n.log")"
    [ "$served" = 2 ] || { cat "/tmp/emu$n.log"; fail "emulated GPU $n listened $served times, not 2"; }
done
echo "emulated GPUs ended with status 0 (each served the first and the restored gpuvm)"
echo "a Linux guest's 2 switches and 4 GPUs mirrored from the host, kept across snapshot and restore in a new gpuvm: ok"
