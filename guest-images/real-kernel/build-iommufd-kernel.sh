#!/usr/bin/env bash
# Builds the real-kernel tier's second outer kernel: a small Linux 6.12 with everything the tier needs
# built in, among it the iommufd side of VFIO that Debian's 6.1 kernel lacks (CONFIG_IOMMUFD and the VFIO
# device cdev, /dev/iommu and /dev/vfio/devices/vfioN). Scenarios with the header `# kernel: iommufd`
# boot it (tests/real-kernel/run.sh).
#
#   guest-images/real-kernel/build-iommufd-kernel.sh [OUTDIR]
#                         (default: guest-images/real-kernel/out/iommufd, gitignored)
#
# Outputs in OUTDIR:
#   vmlinuz           the bzImage (QEMU boots it with -kernel); no modules: all drivers are built in
#   config            its .config
#   kernel-version    one line: the kernel release (e.g. 6.12.117)
#
# The kernel: `make tinyconfig` on Debian's linux-source-6.12 (/usr/src/linux-source-6.12.tar.xz;
# GPUVM_IOMMUFD_LINUX_SOURCE names another tarball), merged with the fragment below, then olddefconfig.
# Every `=y` line of the fragment must be `=y` in the final .config and every "is not set" line unset:
# Kconfig drops an option silently when a dependency is off, so the build fails saying which.
# Source and objects stay in OUTDIR/.work, so a rebuild after a change to the fragment is incremental.
# A clean build takes about 16 CPU minutes (9 minutes on 2 cores, a 2.7 MB bzImage); a rebuild with an
# unchanged configuration half a minute. Work is skipped when the outputs exist and are newer than this
# script.
# Exit status 77: the kernel cannot be had on this host (no linux-source-6.12, or no compiler, flex,
# bison, bc or libelf headers): the scenarios that need it then skip. scripts/install-deps.sh installs them.
set -euo pipefail

SCRIPT_PATH="$(readlink -f "${BASH_SOURCE[0]}")"
SCRIPT_DIR="$(dirname "$SCRIPT_PATH")"
readonly SCRIPT_PATH SCRIPT_DIR
OUTDIR="$(mkdir -p "${1:-$SCRIPT_DIR/out/iommufd}" && cd "${1:-$SCRIPT_DIR/out/iommufd}" && pwd)"
readonly OUTDIR
readonly WORKDIR="$OUTDIR/.work"
readonly SOURCE_TARBALL="${GPUVM_IOMMUFD_LINUX_SOURCE:-/usr/src/linux-source-6.12.tar.xz}"
readonly SKIP=77

# The Kconfig fragment merged onto tinyconfig. tinyconfig turns off everything it can, so even basics
# are here.
read -r -d '' FRAGMENT <<'EOF' || true
# The machine: 64-bit SMP x86 (the tier's QEMU runs -smp 2 on q35), AMD CPUs for kvm_amd.
CONFIG_64BIT=y
CONFIG_SMP=y
CONFIG_CPU_SUP_AMD=y
CONFIG_ACPI=y
CONFIG_PCI=y
CONFIG_PCI_MSI=y
CONFIG_HIGH_RES_TIMERS=y
CONFIG_NO_HZ_IDLE=y
# Memory types as a distribution kernel has them (VFIO maps BARs uncached, KVM honours the guest PAT).
CONFIG_MTRR=y
CONFIG_X86_PAT=y
# An oops rather than a silent hang when the kernel trips on its own checks.
CONFIG_BUG=y
# gzip rather than tinyconfig's xz: quicker to inflate, and the outer machine inflates it under emulation.
CONFIG_KERNEL_GZIP=y

# Console on the 16550 at ttyS0. The legacy BSD ptys register 512 tty devices, seconds of boot under
# emulation (see guest-images/linux/virtio.config).
CONFIG_PRINTK=y
CONFIG_TTY=y
CONFIG_SERIAL_8250=y
CONFIG_SERIAL_8250_CONSOLE=y
# CONFIG_LEGACY_PTYS is not set

# The busybox user space in an uncompressed initramfs.
CONFIG_BLK_DEV_INITRD=y
CONFIG_BINFMT_ELF=y
CONFIG_BINFMT_SCRIPT=y
CONFIG_DEVTMPFS=y
CONFIG_PROC_FS=y
CONFIG_SYSFS=y
CONFIG_SHMEM=y
CONFIG_TMPFS=y
CONFIG_MULTIUSER=y

# What gpuvm calls: its event loops, timers, memfd guest RAM, userfaultfd restores, io_uring disks,
# flock on disks and snapshot directories, seccomp filters, the API's Unix socket, taps; glibc's rseq.
CONFIG_FUTEX=y
CONFIG_RSEQ=y
CONFIG_FILE_LOCKING=y
CONFIG_POSIX_TIMERS=y
CONFIG_EPOLL=y
CONFIG_EVENTFD=y
CONFIG_TIMERFD=y
CONFIG_SIGNALFD=y
CONFIG_MEMFD_CREATE=y
CONFIG_ADVISE_SYSCALLS=y
CONFIG_TRANSPARENT_HUGEPAGE=y
CONFIG_USERFAULTFD=y
CONFIG_IO_URING=y
CONFIG_SECCOMP=y
CONFIG_SECCOMP_FILTER=y
CONFIG_NET=y
CONFIG_UNIX=y
CONFIG_INET=y
CONFIG_NETDEVICES=y
CONFIG_NET_CORE=y
CONFIG_TUN=y

# Off to keep the build short, nothing here uses them (on by default once NET, INET and PERF_EVENTS are).
# CONFIG_IPV6 is not set
# CONFIG_ETHTOOL_NETLINK is not set
# CONFIG_PERF_EVENTS_INTEL_UNCORE is not set
# CONFIG_PERF_EVENTS_INTEL_RAPL is not set
# CONFIG_PERF_EVENTS_INTEL_CSTATE is not set

# Nested KVM: kvm_amd with nested paging (QEMU's -cpu qemu64,+svm,+npt).
CONFIG_VIRTUALIZATION=y
CONFIG_KVM=y
CONFIG_KVM_AMD=y

# QEMU's intel-iommu with interrupt remapping (intremap=on); run.sh passes intel_iommu=on as well.
CONFIG_IOMMU_SUPPORT=y
CONFIG_INTEL_IOMMU=y
CONFIG_INTEL_IOMMU_DEFAULT_ON=y
CONFIG_IRQ_REMAP=y
CONFIG_X86_X2APIC=y

# VFIO both ways: the iommufd cdev API (/dev/iommu, /dev/vfio/devices/vfioN) and the group/container
# API with the real type1 backend (not iommufd's emulation of /dev/vfio/vfio), so type1 scenarios
# run on this kernel too.
CONFIG_IOMMUFD=y
CONFIG_VFIO=y
CONFIG_VFIO_DEVICE_CDEV=y
CONFIG_VFIO_GROUP=y
CONFIG_VFIO_CONTAINER=y
CONFIG_VFIO_IOMMU_TYPE1=y
# CONFIG_IOMMUFD_VFIO_CONTAINER is not set
CONFIG_VFIO_PCI=y
EOF
readonly FRAGMENT

# What this kernel is for; checked on their own too, so that no edit of the fragment loses them quietly.
readonly ESSENTIAL=(IOMMUFD VFIO_DEVICE_CDEV KVM_AMD INTEL_IOMMU VFIO_PCI)

log() { echo "build-iommufd-kernel.sh: $*"; }
die() {
    echo "build-iommufd-kernel.sh: error: $1" >&2
    exit "${2:-1}"
}

up_to_date() {
    local file
    for file in vmlinuz config kernel-version; do
        [[ -s "$OUTDIR/$file" && "$OUTDIR/$file" -nt "$SCRIPT_PATH" ]] || return 1
    done
}

if up_to_date; then
    log "up to date in $OUTDIR (Linux $(cat "$OUTDIR/kernel-version"))"
    exit 0
fi

[[ -f "$SOURCE_TARBALL" ]] ||
    die "no kernel source at $SOURCE_TARBALL (install linux-source-6.12: scripts/install-deps.sh)" "$SKIP"
missing=()
for command in tar xz make gcc flex bison bc perl; do
    command -v "$command" >/dev/null || missing+=("$command")
done
[[ -f /usr/include/libelf.h ]] || missing+=("libelf.h (libelf-dev)")
((${#missing[@]} == 0)) || die "cannot build a kernel here, missing: ${missing[*]} (scripts/install-deps.sh)" "$SKIP"

# Unpacks the tarball into $WORKDIR/src once; a stamp records which tarball (path, size, mtime) it came
# from, so a new linux-source-6.12 version is unpacked (and built) afresh.
unpack_source() {
    local src="$WORKDIR/src" stamp
    stamp="$(stat -c '%n %s %Y' "$SOURCE_TARBALL")"
    if [[ -f "$src/.gpuvm-unpacked" && "$(cat "$src/.gpuvm-unpacked")" == "$stamp" ]]; then
        return
    fi
    log "unpacking $SOURCE_TARBALL"
    rm -rf "$src" "$WORKDIR/build"
    mkdir -p "$src"
    tar -xf "$SOURCE_TARBALL" -C "$src" --strip-components=1 || die "cannot unpack $SOURCE_TARBALL"
    [[ -f "$src/Makefile" && -x "$src/scripts/kconfig/merge_config.sh" ]] ||
        die "$SOURCE_TARBALL does not hold a kernel source tree"
    echo "$stamp" >"$src/.gpuvm-unpacked"
}

# Fails naming every option of the fragment (and of ESSENTIAL) that the .config $1 lacks as wanted.
check_config() {
    local config="$1" line option wanted missing=()
    while IFS= read -r line; do
        if [[ "$line" =~ ^(CONFIG_[A-Za-z0-9_]+)=y$ ]]; then
            grep -qx "${BASH_REMATCH[1]}=y" "$config" || missing+=("${BASH_REMATCH[1]}=y")
        elif [[ "$line" =~ ^#\ (CONFIG_[A-Za-z0-9_]+)\ is\ not\ set$ ]]; then
            option="${BASH_REMATCH[1]}"
            grep -q "^$option=" "$config" && missing+=("$option=n")
        fi
    done <<<"$FRAGMENT"
    for option in "${ESSENTIAL[@]}"; do
        grep -qx "CONFIG_$option=y" "$config" || missing+=("CONFIG_$option=y")
    done
    ((${#missing[@]} == 0)) && return
    for wanted in "${missing[@]}"; do
        echo "build-iommufd-kernel.sh:   wanted $wanted, the .config has:" \
            "$(grep -E "^(# )?${wanted%=*}[= ]" "$config" || echo "nothing (an unknown option, or a dependency is off)")" >&2
    done
    die "${#missing[@]} option(s) did not take effect in $config: ${missing[*]}"
}

started=$SECONDS
mkdir -p "$WORKDIR"
unpack_source
src="$WORKDIR/src"
build="$WORKDIR/build"
mkdir -p "$build"
# ARCH=x86_64 makes 64BIT the default; KBUILD_BUILD_* keep the banner free of this machine's names.
make_args=(-C "$src" O="$build" ARCH=x86_64 KBUILD_BUILD_USER=gpuvm KBUILD_BUILD_HOST=gpuvm)
config_log="$WORKDIR/config.log"
printf '%s\n' "$FRAGMENT" >"$WORKDIR/iommufd.config"
log "make tinyconfig + iommufd.config"
make -s "${make_args[@]}" tinyconfig >"$config_log" 2>&1 || die "make tinyconfig failed (see $config_log)"
# Kconfig's "override: ... changes choice state" warnings are expected; they go to config.log.
(cd "$build" && ARCH=x86_64 "$src/scripts/kconfig/merge_config.sh" -m -O "$build" "$build/.config" \
    "$WORKDIR/iommufd.config") >>"$config_log" 2>&1 || die "merge_config.sh failed (see $config_log)"
make -s "${make_args[@]}" olddefconfig >>"$config_log" 2>&1 || die "make olddefconfig failed (see $config_log)"
check_config "$build/.config"
log "every option of the fragment is in the .config"

jobs="$(nproc)"
log "make -j$jobs bzImage (a clean build: about 16 CPU minutes)"
make "${make_args[@]}" -j"$jobs" bzImage >"$WORKDIR/make.log" 2>&1 || {
    tail -n 40 "$WORKDIR/make.log" >&2
    die "building bzImage failed (whole log: $WORKDIR/make.log)"
}
[[ -s "$build/arch/x86/boot/bzImage" ]] || die "make left no $build/arch/x86/boot/bzImage"

cp "$build/.config" "$OUTDIR/config.tmp"
mv "$OUTDIR/config.tmp" "$OUTDIR/config"
cp "$build/include/config/kernel.release" "$OUTDIR/kernel-version.tmp"
mv "$OUTDIR/kernel-version.tmp" "$OUTDIR/kernel-version"
cp "$build/arch/x86/boot/bzImage" "$OUTDIR/vmlinuz.tmp"
mv "$OUTDIR/vmlinuz.tmp" "$OUTDIR/vmlinuz"
log "Linux $(cat "$OUTDIR/kernel-version"), $(stat -c %s "$OUTDIR/vmlinuz") bytes in $OUTDIR/vmlinuz," \
    "built in $((SECONDS - started)) s"
