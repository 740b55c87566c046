#!/usr/bin/env bash
# The real-kernel test tier's runner: boots Debian's kernel under QEMU in pure emulation (TCG) with nested
# KVM (`-cpu qemu64,+svm,+npt`), an emulated IOMMU and a scenario's PCI devices, runs one named scenario
# inside it with gpuvm, and hands back its result and console log.
#
#   tests/real-kernel/run.sh [--log FILE] [--timeout SECONDS] SCENARIO
#   tests/real-kernel/run.sh --list
#
# SCENARIO is tests/real-kernel/scenarios/SCENARIO.sh. Its header lines say what it needs:
#   # qemu: ARGS      QEMU arguments for its devices (e.g. -device edu,addr=0x4)
#   # memory: SIZE    the outer machine's RAM (default 3G)
#   # scratch: NAME SIZE   a sparse file made for it on the host (a disk image for an emulated device),
#                     named @WORK@/NAME in its QEMU arguments
#   # kernel: iommufd the outer machine boots guest-images/real-kernel/build-iommufd-kernel.sh's Linux 6.12
#                     (iommufd, the VFIO cdev; drivers built in, no modules) instead of Debian's kernel
#   # needs: gpuvm-emu-gpu   the emulated GPU (a vfio-user device process; GPUVM_EMU_BIN) in the machine as
#                     /bin/gpuvm-emu-gpu; the runner fails without it
# The scenario runs as a shell script in the outer machine's busybox user space, with the helpers of
# tests/real-kernel/lib.sh; its exit status is the runner's. Lines it prints starting `figure:` are the
# tier's figures (bench/real-kernel collects them).
#
# Environment:
#   GPUVM_BIN               the gpuvm binary to put in the machine (static; default: target/.../release/gpuvm)
#   GPUVM_EMU_BIN           the gpuvm-emu-gpu binary, for scenarios that need it (static; default: the one
#                           beside GPUVM_BIN; `cargo build --release --workspace` builds both)
#   GPUVM_REAL_KERNEL_DIR   guest-images/real-kernel/build.sh's output (built here when missing)
#   GPUVM_PEER_CLOUD_HYPERVISOR  a cloud-hypervisor binary, put in the machine as /bin/cloud-hypervisor-peer with
#                           its libraries (bench/real-kernel --ch; the linux-resize-*side-by-side scenarios run it)
#   GPUVM_IOMMUFD_KERNEL_DIR  build-iommufd-kernel.sh's output (default: GPUVM_REAL_KERNEL_DIR/iommufd;
#                           built here when missing), for `# kernel: iommufd`
#   QEMU                    the QEMU binary (default qemu-system-x86_64)
# Exit status: the scenario's; 77 when QEMU or the kernel cannot be had (the tier is skipped);
# 124 when the machine ran past --timeout; 125 when the machine ended without reporting a result; 126
# when the machine stopped answering (its heartbeat on the second serial port stopped for WEDGED_S
# seconds: both its vCPUs stuck, seen about once in 20 scenario runs with nested KVM under TCG): its
# vCPUs' registers are printed and it is sent an NMI, which its kernel answers with a panic and the
# stack of the CPU it interrupted (`unknown_nmi_panic`), before it is stopped.
set -euo pipefail

TIER_DIR="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")" && pwd)"
REPO_ROOT="$(cd "$TIER_DIR/../.." && pwd)"
readonly TIER_DIR REPO_ROOT
readonly SKIP=77

die() {
    echo "real-kernel: error: $1" >&2
    exit "${2:-1}"
}

log_file=""
timeout_s=600
while (($#)); do
    case "$1" in
    --log) log_file="$2"; shift 2 ;;
    --timeout) timeout_s="$2"; shift 2 ;;
    --list)
        for scenario in "$TIER_DIR"/scenarios/*.sh; do
            name="$(basename "$scenario" .sh)"
            printf '%-22s %s\n' "$name" "$(sed -n 's/^# about: //p' "$scenario")"
        done
        exit 0
        ;;
    -h | --help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d;s/^# \{0,1\}//'; exit 0 ;;
    -*) die "unknown option $1" 2 ;;
    *) break ;;
    esac
done
(($# == 1)) || die "usage: run.sh [--log FILE] [--timeout SECONDS] SCENARIO (--list names them)" 2
scenario="$1"
[[ "$scenario" =~ ^[a-z0-9-]+$ ]] || die "scenario names are lowercase words joined by '-': $scenario" 2
scenario_file="$TIER_DIR/scenarios/$scenario.sh"
[[ -f "$scenario_file" ]] || die "no scenario $scenario (tests/real-kernel/run.sh --list)" 2
[[ "$timeout_s" =~ ^[0-9]+$ ]] || die "--timeout takes whole seconds" 2

qemu="${QEMU:-qemu-system-x86_64}"
command -v "$qemu" >/dev/null || die "$qemu not found: the real-kernel tier needs Debian's qemu-system-x86" "$SKIP"
for command in busybox cpio; do
    command -v "$command" >/dev/null || die "$command not found (scripts/install-deps.sh)" "$SKIP"
done

gpuvm_bin="${GPUVM_BIN:-$REPO_ROOT/target/x86_64-unknown-linux-gnu/release/gpuvm}"
[[ -x "$gpuvm_bin" ]] || die "no gpuvm binary at $gpuvm_bin (cargo build --release, or set GPUVM_BIN)"
if file "$gpuvm_bin" 2>/dev/null | grep -q 'dynamically linked'; then
    die "$gpuvm_bin is dynamically linked; the machine has no C library (build with the workspace's .cargo/config.toml)"
fi

# The emulated GPU (tests/bin/emu_gpu.rs), put in the machine only for the scenarios that need it.
emu_bin=""
case "$(sed -n 's/^# needs: //p' "$scenario_file" | tr '\n' ' ')" in
"") ;;
"gpuvm-emu-gpu ")
    emu_bin="${GPUVM_EMU_BIN:-$(dirname "$gpuvm_bin")/gpuvm-emu-gpu}"
    [[ -x "$emu_bin" ]] ||
        die "$scenario needs gpuvm-emu-gpu: none at $emu_bin (cargo build --release --workspace, or set GPUVM_EMU_BIN)"
    if file "$emu_bin" 2>/dev/null | grep -q 'dynamically linked'; then
        die "$emu_bin is dynamically linked; the machine has no C library (build with the workspace's .cargo/config.toml)"
    fi
    ;;
*) die "$scenario needs something unknown (# needs: gpuvm-emu-gpu is what there is)" 2 ;;
esac

kernel_dir="${GPUVM_REAL_KERNEL_DIR:-$REPO_ROOT/guest-images/real-kernel/out}"
kernel_builder=build.sh
case "$(sed -n 's/^# kernel: //p' "$scenario_file" | head -n1)" in
"") ;;
iommufd)
    kernel_dir="${GPUVM_IOMMUFD_KERNEL_DIR:-$kernel_dir/iommufd}"
    kernel_builder=build-iommufd-kernel.sh
    ;;
*) die "$scenario names an unknown kernel (# kernel: iommufd is the one there is)" 2 ;;
esac
if [[ ! -s "$kernel_dir/vmlinuz" ]]; then
    build_status=0
    "$REPO_ROOT/guest-images/real-kernel/$kernel_builder" "$kernel_dir" >&2 || build_status=$?
    ((build_status == 0)) || die "the outer kernel cannot be had (guest-images/real-kernel/$kernel_builder: $build_status)" \
        "$([[ $build_status == "$SKIP" ]] && echo "$SKIP" || echo 1)"
fi
release="$(cat "$kernel_dir/kernel-version")"

work="$(mktemp -d "${TMPDIR:-/tmp}/gpuvm-real-kernel.XXXXXX")"
qemu_pid=""
cleanup() {
    [[ -n "$qemu_pid" ]] && kill -9 "$qemu_pid" 2>/dev/null
    rm -rf "$work"
}
trap cleanup EXIT
[[ -n "$log_file" ]] || log_file="$work/console.log"
: >"$log_file"

# Packs directory $1 into an uncompressed newc cpio $2 (uncompressed: nothing to inflate under emulation).
pack() {
    (cd "$1" && find . -print0 | LC_ALL=C sort -z | cpio --null -o -H newc --quiet) >"$2"
}

# A busybox root with the kernel's modules (if it has any), shared by the outer machine and gpuvm's Linux
# guests.
make_root() {
    local root="$1" applet
    mkdir -p "$root"/{bin,sbin,dev,proc,sys,tmp,run,mnt,lib}
    cp "$(command -v busybox)" "$root/bin/busybox"
    for applet in $(busybox --list); do
        [[ "$applet" == busybox ]] || ln -sf busybox "$root/bin/$applet"
    done
    [[ ! -d "$kernel_dir/modules/lib/modules" ]] || cp -a "$kernel_dir/modules/lib/modules" "$root/lib/"
    cp "$TIER_DIR/lib.sh" "$root/lib/real-kernel.sh"
    cp "$work/vsock-tool" "$root/bin/vsock-tool"
}

# vsock from user space (busybox has none), for both sides of gpuvm's hybrid vsock; static: neither machine
# has a C library.
cc="${CC:-cc}"
command -v "$cc" >/dev/null || die "no C compiler ($cc): the tier builds tests/real-kernel/vsock-tool.c" "$SKIP"
"$cc" -static -O2 -Wall -o "$work/vsock-tool" "$TIER_DIR/vsock-tool.c" ||
    die "cannot build tests/real-kernel/vsock-tool.c statically (Debian's libc6-dev has the static C library)"

# The initramfs of gpuvm's Linux guests.
inner="$work/inner"
make_root "$inner"
cp "$TIER_DIR/inner-init" "$inner/init"
cp "$TIER_DIR/gpu-hook" "$inner/lib/gpu-hook"
chmod +x "$inner/init"

outer="$work/outer"
make_root "$outer"
cp "$TIER_DIR/outer-init" "$outer/init"
chmod +x "$outer/init"
mkdir -p "$outer/scenarios" "$outer/images"
cp "$TIER_DIR"/scenarios/*.sh "$outer/scenarios/"
cp "$gpuvm_bin" "$outer/bin/gpuvm"
[[ -z "$emu_bin" ]] || cp "$emu_bin" "$outer/bin/gpuvm-emu-gpu"
# Backends gpuvm talks to over vhost-user, with the shared libraries they load (the outer machine has no
# C library of its own); a scenario that needs one it lacks fails saying so.
for backend in virtiofsd qemu-storage-daemon; do
    backend_path="$(command -v "$backend" || true)"
    [[ -n "$backend_path" ]] || continue
    cp "$backend_path" "$outer/bin/$backend"
    for library in $(ldd "$backend_path" | grep -o '/[^ ]*'); do
        mkdir -p "$outer$(dirname "$library")"
        cp -L "$library" "$outer$library"
    done
done
# A Cloud Hypervisor binary to compare with (bench/real-kernel --ch), with its shared libraries: scenarios
# that find /bin/cloud-hypervisor-peer run it beside gpuvm.
if [[ -n "${GPUVM_PEER_CLOUD_HYPERVISOR:-}" ]]; then
    cp "$GPUVM_PEER_CLOUD_HYPERVISOR" "$outer/bin/cloud-hypervisor-peer" ||
        die "cannot copy GPUVM_PEER_CLOUD_HYPERVISOR=$GPUVM_PEER_CLOUD_HYPERVISOR"
    for library in $(ldd "$GPUVM_PEER_CLOUD_HYPERVISOR" | grep -o '/[^ ]*'); do
        mkdir -p "$outer$(dirname "$library")"
        cp -L "$library" "$outer$library"
    done
fi
cp "$kernel_dir/vmlinuz" "$outer/images/vmlinuz"
pack "$inner" "$outer/images/initramfs.cpio"
pack "$outer" "$work/outer.cpio"

while read -r name size; do
    [[ "$name" =~ ^[a-z0-9.-]+$ ]] || die "bad scratch file name in $scenario: $name"
    truncate -s "$size" "$work/$name"
done < <(sed -n 's/^# scratch: //p' "$scenario_file")
qemu_devices="$(sed -n 's/^# qemu: //p' "$scenario_file" | tr '\n' ' ' | sed "s|@WORK@|$work|g")"
memory="$(sed -n 's/^# memory: //p' "$scenario_file" | head -n1)"
# unknown_nmi_panic: the NMI a wedged machine is sent (below) prints where its CPU was.
cmdline="console=ttyS0 quiet loglevel=3 panic=-1 intel_iommu=on unknown_nmi_panic real_kernel.scenario=$scenario"
heartbeat="$work/heartbeat"
monitor_socket="$work/monitor.sock"
readonly WEDGED_S=90

echo "real-kernel: scenario $scenario on $release under $("$qemu" --version | head -n1)" >&2
echo "real-kernel: console log $log_file" >&2
started=$SECONDS
# shellcheck disable=SC2086 # the scenario's QEMU arguments are words
"$qemu" -M q35,kernel-irqchip=split -accel tcg,thread=multi -smp 2 -m "${memory:-3G}" \
    -cpu qemu64,+svm,+npt -device intel-iommu,intremap=on \
    -nodefaults -no-reboot -display none -serial "file:$log_file" -serial "file:$heartbeat" \
    -monitor "unix:$monitor_socket,server=on,wait=off" \
    -kernel "$kernel_dir/vmlinuz" -initrd "$work/outer.cpio" -append "$cmdline" \
    $qemu_devices </dev/null >"$work/qemu.out" 2>&1 &
qemu_pid=$!

# Follows the console while the machine runs, so a person watching sees the scenario as it goes.
tail -n +1 -f "$log_file" --pid="$qemu_pid" 2>/dev/null | sed -u 's/\r$//' >&2 &
tail_pid=$!
# monitor COMMAND...: each command's answer from QEMU's human monitor.
monitor() {
    python3 - "$monitor_socket" "$@" <<'PYTHON' 2>&1 || true
import socket, sys, time
s = socket.socket(socket.AF_UNIX)
s.settimeout(3)
s.connect(sys.argv[1])
def answer():
    data = b""
    try:
        while not data.endswith(b"(qemu) "):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    except socket.timeout:
        pass
    return data.decode(errors="replace")
answer()
for command in sys.argv[2:]:
    s.sendall(command.encode() + b"\n")
    print(answer().replace("(qemu) ", "").strip())
PYTHON
}

# wedged: the machine stopped answering; what its vCPUs were doing, then an NMI (see the header).
wedged() {
    echo "real-kernel: the outer machine stopped answering (no heartbeat for ${WEDGED_S} s); its vCPUs:" >&2
    monitor "info cpus" "cpu 0" "info registers" "cpu 1" "info registers" | grep -E 'CPU|RIP|RSP|CR0|EFER|HLT|thread' >&2
    monitor "nmi" >/dev/null
    for _ in $(seq 1 150); do
        kill -0 "$qemu_pid" 2>/dev/null || break
        sleep 0.2
    done
    stop_machine
    echo "real-kernel: $scenario: the outer machine stopped answering; stopped" >&2
    exit 126
}

# stop_machine: ends QEMU (if it still runs) and the console's follower.
stop_machine() {
    kill -9 "$qemu_pid" 2>/dev/null || true
    wait "$qemu_pid" 2>/dev/null || true
    qemu_pid=""
    wait "$tail_pid" 2>/dev/null || true
}

deadline=$((SECONDS + timeout_s))
beat_size=0
beat_at=$SECONDS
while kill -0 "$qemu_pid" 2>/dev/null; do
    size="$(stat -c %s "$heartbeat" 2>/dev/null || echo 0)"
    if ((size != beat_size)); then
        beat_size=$size
        beat_at=$SECONDS
    elif ((beat_size > 0 && SECONDS - beat_at >= WEDGED_S)); then
        wedged
    fi
    if ((SECONDS >= deadline)); then
        stop_machine
        echo "real-kernel: $scenario ran past ${timeout_s}s; stopped" >&2
        exit 124
    fi
    sleep 0.2
done
qemu_status=0
wait "$qemu_pid" || qemu_status=$?
qemu_pid=""
wait "$tail_pid" 2>/dev/null || true
elapsed=$((SECONDS - started))

result="$(sed -n "s/^real-kernel: result $scenario \([0-9]*\)\r\{0,1\}$/\1/p" "$log_file" | tail -n1)"
if [[ -z "$result" ]]; then
    echo "real-kernel: $scenario ended without a result (QEMU status $qemu_status):" >&2
    cat "$work/qemu.out" >&2
    exit 125
fi
echo "figure: $scenario total ${elapsed} s (QEMU start to power-off)" >&2
echo "real-kernel: $scenario status $result in ${elapsed} s" >&2
exit "$result"
