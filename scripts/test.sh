#!/usr/bin/env bash
# gpuvm's test command (what CI runs through .ci/run).
#
#   scripts/test.sh
#
# 1. installs the Debian packages the tests need (scripts/install-deps.sh; root on Debian 12),
# 2. builds the Linux guest images (guest-images/linux/build.sh) and the virtio kernel with its ext4 root
#    image (guest-images/linux/build-virtio-kernel.sh) into $GPUVM_LINUX_DIR, and the real-kernel tier's
#    outer kernel (guest-images/real-kernel/build.sh) into $GPUVM_REAL_KERNEL_DIR and its Linux 6.12
#    kernel with iommufd (guest-images/real-kernel/build-iommufd-kernel.sh) into $GPUVM_IOMMUFD_KERNEL_DIR,
# 3. cargo build --release --workspace (the gpuvm binary the tests drive), then the tests, built
#    apart and run with cargo test --profile release-tests --workspace (which includes the
#    real-kernel tier, tests/real_kernel.rs: gpuvm inside QEMU TCG with nested KVM and an emulated
#    IOMMU),
# 4. fuzzes the control API with schemathesis (scripts/api-fuzz.sh), and its Cloud Hypervisor front end
#    (scripts/api-fuzz-ch.sh).
# Tests find the VMM binary through GPUVM_BIN and the Linux images through GPUVM_LINUX_DIR.
# GPUVM_TEST_TIMEOUT (default 45m, a timeout(1) duration) bounds the test run (not their build) so a
# hung guest fails the run instead of stalling it.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.." && pwd)"
readonly REPO_ROOT
cd "$REPO_ROOT"

started_at=$SECONDS
step() {
    echo
    echo "=== test.sh [$((SECONDS - started_at))s]: $*"
}

step "installing dependencies"
scripts/install-deps.sh

step "building Linux guest images"
export GPUVM_LINUX_DIR="${GPUVM_LINUX_DIR:-$REPO_ROOT/guest-images/linux/out}"
guest-images/linux/build.sh "$GPUVM_LINUX_DIR"

step "building the virtio Linux kernel and ext4 root image"
guest-images/linux/build-virtio-kernel.sh "$GPUVM_LINUX_DIR"

step "getting the real-kernel tier's kernel (guest-images/real-kernel/build.sh)"
export GPUVM_REAL_KERNEL_DIR="${GPUVM_REAL_KERNEL_DIR:-$REPO_ROOT/guest-images/real-kernel/out}"
# Status 77: no kernel package can be had; tests/real_kernel.rs then skips and says why.
guest-images/real-kernel/build.sh "$GPUVM_REAL_KERNEL_DIR" || (($? == 77))

step "building the real-kernel tier's iommufd kernel (guest-images/real-kernel/build-iommufd-kernel.sh)"
export GPUVM_IOMMUFD_KERNEL_DIR="${GPUVM_IOMMUFD_KERNEL_DIR:-$GPUVM_REAL_KERNEL_DIR/iommufd}"
# Status 77: no linux-source-6.12 or build tools; the `# kernel: iommufd` scenarios then skip.
guest-images/real-kernel/build-iommufd-kernel.sh "$GPUVM_IOMMUFD_KERNEL_DIR" || (($? == 77))

if ! command -v cargo >/dev/null; then
    echo "test.sh: error: cargo not found; install Rust (https://rustup.rs) and retry" >&2
    exit 1
fi

step "cargo build --release --workspace"
# cargo's JSON messages say where it put the gpuvm binary (the target directory and triple come from
# .cargo/config.toml and CARGO_* variables); diagnostics still go to stderr as usual.
build_messages="$(mktemp)"
trap 'rm -f "$build_messages"' EXIT
cargo build --release --workspace --message-format=json-render-diagnostics >"$build_messages"
GPUVM_BIN="$(grep -o '"executable":"[^"]*/gpuvm"' "$build_messages" | tail -n1 | cut -d'"' -f4 || true)"
if [[ -z "$GPUVM_BIN" ]]; then
    target_dir="${CARGO_TARGET_DIR:-$REPO_ROOT/target}"
    [[ "$target_dir" == /* ]] || target_dir="$REPO_ROOT/$target_dir"
    GPUVM_BIN="$target_dir/x86_64-unknown-linux-gnu/release/gpuvm"
fi
export GPUVM_BIN
if [[ ! -x "$GPUVM_BIN" ]]; then
    echo "test.sh: error: the build produced no $GPUVM_BIN" >&2
    exit 1
fi

step "building the tests (cargo test --profile release-tests --workspace --no-run)"
# Built apart from the run, so the time limit below bounds the tests themselves, not the compiler.
cargo test --profile release-tests --workspace --no-run

step "cargo test --profile release-tests --workspace (GPUVM_BIN=$GPUVM_BIN GPUVM_LINUX_DIR=$GPUVM_LINUX_DIR)"
test_status=0
timeout --foreground --kill-after=30s "${GPUVM_TEST_TIMEOUT:-45m}" \
    cargo test --profile release-tests --workspace || test_status=$?
if ((test_status == 124 || test_status == 137)); then
    echo "test.sh: error: the tests ran longer than ${GPUVM_TEST_TIMEOUT:-45m} and were stopped" >&2
fi
((test_status == 0)) || exit "$test_status"

step "API fuzzing with schemathesis against live sockets (scripts/api-fuzz.sh)"
scripts/api-fuzz.sh "$GPUVM_BIN"

step "API fuzzing of the Cloud Hypervisor front end (scripts/api-fuzz-ch.sh)"
scripts/api-fuzz-ch.sh "$GPUVM_BIN"

step "all tests passed"
