#!/usr/bin/env bash
# Builds what the real-kernel test tier (tests/real-kernel/run.sh) boots under QEMU TCG: Debian's generic
# kernel and the modules gpuvm needs from it, both as the outer kernel (nested KVM, VFIO behind an emulated
# IOMMU) and as the kernel of the Linux guests gpuvm boots inside it.
#
#   guest-images/real-kernel/build.sh [OUTDIR]     (default: guest-images/real-kernel/out, gitignored)
#
# Outputs in OUTDIR:
#   vmlinuz           the kernel image, as Debian ships it (a bzImage: QEMU and gpuvm both boot it)
#   modules/          lib/modules/<release>/ with the modules below, their dependencies and modules.dep
#   kernel-version    one line: the kernel release (e.g. 6.1.0-56-amd64)
#   kernel-package    one line: "<debian package> <version>"
#
# The package is the one Debian's linux-image-amd64 depends on (its -unsigned build when there is one);
# GPUVM_OUTER_KERNEL_PKG picks another. The download is kept in OUTDIR/.work, so a rebuild is offline.
# Work is skipped when the outputs exist and are newer than this script.
# Exit status 77: no kernel package can be had (no apt, no network): the tier then skips.
set -euo pipefail

SCRIPT_PATH="$(readlink -f "${BASH_SOURCE[0]}")"
SCRIPT_DIR="$(dirname "$SCRIPT_PATH")"
readonly SCRIPT_PATH SCRIPT_DIR
OUTDIR="$(mkdir -p "${1:-$SCRIPT_DIR/out}" && cd "${1:-$SCRIPT_DIR/out}" && pwd)"
readonly OUTDIR
readonly WORKDIR="$OUTDIR/.work"

# Outer kernel: nested KVM (kvm_amd with nested paging), VFIO type1, taps for gpuvm's virtio-net.
# Inner Linux guests: the virtio drivers Debian builds as modules, checked from user space.
readonly MODULES=(
    kvm kvm-amd vfio vfio_iommu_type1 vfio-pci tun
    virtio_pci virtio_blk virtio_net virtio_rng virtio_balloon virtiofs
    vmw_vsock_virtio_transport vsock nvme
)

log() { echo "real-kernel/build.sh: $*"; }
die() {
    echo "real-kernel/build.sh: error: $1" >&2
    exit "${2:-1}"
}

up_to_date() {
    local file
    for file in vmlinuz kernel-version kernel-package modules; do
        [[ -e "$OUTDIR/$file" && "$OUTDIR/$file" -nt "$SCRIPT_PATH" ]] || return 1
    done
}

if up_to_date; then
    log "up to date in $OUTDIR ($(cat "$OUTDIR/kernel-package"))"
    exit 0
fi

for command in dpkg-deb busybox; do
    command -v "$command" >/dev/null || die "$command is missing (run scripts/install-deps.sh)"
done

choose_package() {
    if [[ -n "${GPUVM_OUTER_KERNEL_PKG:-}" ]]; then
        echo "$GPUVM_OUTER_KERNEL_PKG"
        return
    fi
    local versioned
    versioned="$(apt-cache depends linux-image-amd64 2>/dev/null |
        sed -n 's/^ *Depends: \(linux-image-[0-9].*-amd64\)$/\1/p' | head -n1)"
    [[ -n "$versioned" ]] || return 1
    # The unsigned build is the same kernel without the EFI signature.
    if apt-cache show "$versioned-unsigned" >/dev/null 2>&1; then
        echo "$versioned-unsigned"
    else
        echo "$versioned"
    fi
}

mkdir -p "$WORKDIR"
deb="$(find "$WORKDIR" -maxdepth 1 -name 'linux-image-*.deb' | head -n1)"
if [[ -z "$deb" ]]; then
    command -v apt-get >/dev/null || die "no apt-get to download a kernel package" 77
    package="$(choose_package)" || die "apt knows no linux-image-amd64 (apt-get update?)" 77
    log "downloading $package"
    apt_options=(-q)
    # As root apt drops to the _apt user to download, which cannot write to a root-owned 0700 directory.
    ((EUID == 0)) && apt_options+=(-o APT::Sandbox::User=root)
    (cd "$WORKDIR" && apt-get "${apt_options[@]}" download "$package") ||
        die "cannot download $package" 77
    deb="$(find "$WORKDIR" -maxdepth 1 -name 'linux-image-*.deb' | head -n1)"
fi

unpacked="$WORKDIR/unpacked"
rm -rf "$unpacked"
dpkg-deb -x "$deb" "$unpacked"
vmlinuz="$(find "$unpacked/boot" -name 'vmlinuz-*' | head -n1)"
[[ -n "$vmlinuz" ]] || die "$deb holds no /boot/vmlinuz-*"
release="${vmlinuz##*/vmlinuz-}"
source_tree="$unpacked/lib/modules/$release"

# Copies module $1 and, first, every module it depends on (the depends= line of its .modinfo).
declare -A copied=()
copy_module() {
    local name="$1" file depends dependency
    [[ -n "${copied[$name]:-}" ]] && return 0
    copied[$name]=1
    file="$(find "$source_tree/kernel" \( -name "$name.ko" -o -name "${name//_/-}.ko" -o -name "${name//-/_}.ko" \) | head -n1)"
    [[ -n "$file" ]] || die "module $name is not in $release"
    depends="$(grep -a -o 'depends=[^[:cntrl:]]*' "$file" | head -n1 | cut -d= -f2)"
    for dependency in ${depends//,/ }; do
        copy_module "$dependency"
    done
    mkdir -p "$staging/lib/modules/$release/$(dirname "${file#"$source_tree/"}")"
    cp "$file" "$staging/lib/modules/$release/${file#"$source_tree/"}"
}

staging="$WORKDIR/modules"
rm -rf "$staging"
mkdir -p "$staging/lib/modules/$release"
for module in "${MODULES[@]}"; do
    copy_module "$module"
done
cp "$source_tree"/modules.builtin* "$source_tree/modules.order" "$staging/lib/modules/$release/" 2>/dev/null || true
busybox depmod -b "$staging" "$release"

rm -rf "$OUTDIR/modules"
mv "$staging" "$OUTDIR/modules"
cp "$vmlinuz" "$OUTDIR/vmlinuz"
echo "$release" >"$OUTDIR/kernel-version"
dpkg-deb -f "$deb" Package Version | awk '{print $2}' | paste -sd' ' >"$OUTDIR/kernel-package"
rm -rf "$unpacked"
log "kernel $release ($(cat "$OUTDIR/kernel-package")), ${#copied[@]} modules in $OUTDIR"
