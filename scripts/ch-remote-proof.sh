#!/usr/bin/env bash
# Drives gpuvm with Cloud Hypervisor's own command-line client, ch-remote, unchanged.
#
#   scripts/ch-remote-proof.sh CH_REMOTE [GPUVM_BIN]
#
# CH_REMOTE is a ch-remote built from Cloud Hypervisor's source (cargo build --bin ch-remote in a
# cloud-hypervisor checkout; its micro_http dependency comes from GitHub, which CI cannot reach,
# so CI does not run this script: docs/cloud-hypervisor-compat.md records its last run).
#
# gpuvm runs as `cloud-hypervisor --api-socket S` (a symlink), the test guest's `pci-hotplug`
# workload waits for a GPU, and ch-remote does: create (a VmConfig file), boot, ping, info,
# counters, pause, info, resume, add-user-device (the emulated GPU over vfio-user: the guest
# runs its pci checks on it), remove-device (the guest ejects it), pause, snapshot, resume,
# shutdown-vmm; then a second gpuvm: restore, resume, info, shutdown-vmm. Every step's exit
# status and the answers it prints are checked; the script fails at the first difference.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.." && pwd)"
CH_REMOTE="$(readlink -f "${1:?usage: ch-remote-proof.sh CH_REMOTE [GPUVM_BIN]}")"
GPUVM_BIN="$(readlink -f "${2:-${GPUVM_BIN:-$REPO_ROOT/target/x86_64-unknown-linux-gnu/release/gpuvm}}")"
EMU_BIN="${GPUVM_EMU_BIN:-$(dirname "$GPUVM_BIN")/gpuvm-emu-gpu}"

work="$(mktemp -d /tmp/gpuvm-ch-remote.XXXXXX)"
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

step() { echo "ch-remote-proof: $*"; }
fail() {
    echo "ch-remote-proof: FAIL: $*" >&2
    for log in "$work"/*.out; do
        [[ -f "$log" ]] && { echo "--- $log" >&2; tail -n 20 "$log" >&2; }
    done
    exit 1
}
wait_for() { # FILE TEXT
    for _ in $(seq 1 1000); do
        grep -q -- "$2" "$1" 2>/dev/null && return 0
        sleep 0.02
    done
    fail "no '$2' in $1"
}
remote() { # SOCKET ARGS...: ch-remote's output, failing on a nonzero exit
    local socket="$1"
    shift
    "$CH_REMOTE" --api-socket "$socket" "$@" 2>&1 || fail "ch-remote $* exited $?"
}
expect_state() { # SOCKET STATE
    local info
    info="$(remote "$1" info)"
    grep -q "\"state\": *\"$2\"" <<<"$info" || fail "info: state is not $2: $info"
}

ln -s "$GPUVM_BIN" "$work/cloud-hypervisor"
"$GPUVM_BIN" guest-image --output "$work/guest.elf"
cat >"$work/vm.json" <<EOF
{"payload": {"kernel": "$work/guest.elf", "cmdline": "pci-hotplug 2"},
 "cpus": {"boot_vcpus": 1, "max_vcpus": 1},
 "memory": {"size": 268435456},
 "serial": {"mode": "Tty"}, "console": {"mode": "Off"}}
EOF

api="$work/api.sock"
"$work/cloud-hypervisor" --api-socket "$api" >"$work/vmm.out" 2>&1 &
pids+=($!)
wait_for_socket() { for _ in $(seq 1 500); do [[ -S "$1" ]] && return 0; sleep 0.01; done; fail "no socket $1"; }
wait_for_socket "$api"

step "$("$CH_REMOTE" --version 2>&1 | head -n1) against $("$GPUVM_BIN" --version 2>&1 | head -n1)"
remote "$api" ping | grep -q '"version"' || fail "ping: no version"
step "ping ok"
remote "$api" create "$work/vm.json" >/dev/null
expect_state "$api" Created
remote "$api" boot >/dev/null
expect_state "$api" Running
wait_for "$work/vmm.out" "hotplug: waiting for"
step "create, boot: Running"
remote "$api" counters | grep -q '{' || fail "counters: not JSON"
remote "$api" pause >/dev/null
expect_state "$api" Paused
remote "$api" resume >/dev/null
expect_state "$api" Running
step "counters, pause, resume ok"

"$EMU_BIN" --socket "$work/gpu.sock" >"$work/emu.out" 2>&1 &
pids+=($!)
wait_for_socket "$work/gpu.sock"
added="$(remote "$api" add-user-device "socket=$work/gpu.sock,id=gpu0")"
grep -q '"bdf": *"0000:00:' <<<"$added" || fail "add-user-device: $added"
wait_for "$work/vmm.out" "passed the pci checks"
step "add-user-device: $added; the guest checked the device"
remote "$api" remove-device gpu0 >/dev/null
wait_for "$work/vmm.out" "hotplug: device 1 ejected"
step "remove-device: the guest ejected it"

remote "$api" pause >/dev/null
mkdir "$work/snap"
remote "$api" snapshot "file://$work/snap" >/dev/null
[[ -f "$work/snap/state" ]] || fail "snapshot wrote no state"
remote "$api" resume >/dev/null
step "pause, snapshot, resume ok"
remote "$api" shutdown-vmm >/dev/null || true
wait "${pids[0]}" 2>/dev/null || true
step "shutdown-vmm: gpuvm ended"

api2="$work/api2.sock"
"$work/cloud-hypervisor" --api-socket "$api2" >"$work/vmm2.out" 2>&1 &
pids+=($!)
wait_for_socket "$api2"
remote "$api2" restore "source_url=file://$work/snap" >/dev/null
expect_state "$api2" Paused
remote "$api2" resume >/dev/null
expect_state "$api2" Running
step "restore, resume: Running"
remote "$api2" shutdown-vmm >/dev/null || true
step "all steps passed"
