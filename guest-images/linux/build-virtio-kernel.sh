#!/usr/bin/env bash
# Builds a trimmed Linux kernel with the virtio-pci drivers built in, and a tiny ext4 root image, for
# gpuvm's tests of its virtio devices against Linux's own drivers (tests/linux_virtio.rs).
#
#   guest-images/linux/build-virtio-kernel.sh [OUTDIR]   (default: guest-images/linux/out, gitignored)
#
# Outputs in OUTDIR:
#   vmlinux-virtio        x86_64 ELF kernel (boots via its Xen PVH entry note): `make tinyconfig` on
#                         Debian's linux-source-6.1, merged with virtio.config (next to this script)
#   config-virtio         that kernel's .config
#   rootfs-virtio.ext4    8 MiB ext4 file system holding /hello (ROOTFS_HELLO below, one line) and an
#                         empty /dev
#
# Why a kernel of our own: Debian's cloud kernel builds virtio-pci/blk/net/vsock/rng as modules, and a
# host where guest ring 0 is emulated cannot run the user space that would load them.
# The kernel source is /usr/src/linux-source-6.1.tar.xz (package linux-source-6.1; GPUVM_LINUX_SOURCE
# names another tarball); it is unpacked and built under OUTDIR/.work-virtio, which is kept so that a
# rebuild after a change to virtio.config is incremental. Building takes about 6 minutes on 2 idle cores.
# Work is skipped when the outputs exist and are newer than this script and virtio.config.
# Needs: tar, xz, make, gcc, flex, bison, bc, libelf-dev, libssl-dev, readelf, mkfs.ext4 (e2fsprogs)
# (scripts/install-deps.sh installs them).
set -euo pipefail

SCRIPT_PATH="$(readlink -f "${BASH_SOURCE[0]}")"
SCRIPT_DIR="$(dirname "$SCRIPT_PATH")"
readonly SCRIPT_PATH SCRIPT_DIR
OUTDIR="$(mkdir -p "${1:-$SCRIPT_DIR/out}" && cd "${1:-$SCRIPT_DIR/out}" && pwd)"
readonly OUTDIR
readonly WORKDIR="$OUTDIR/.work-virtio"
readonly FRAGMENT="$SCRIPT_DIR/virtio.config"
readonly SOURCE_TARBALL="${GPUVM_LINUX_SOURCE:-/usr/src/linux-source-6.1.tar.xz}"
readonly ROOTFS_HELLO="gpuvm-virtio: hello from the ext4 root on virtio-blk"
readonly ROOTFS_SIZE=8M

log() { echo "build-virtio-kernel.sh: $*"; }
die() {
    echo "build-virtio-kernel.sh: error: $*" >&2
    exit 1
}

# True when every named output exists and is newer than this script and the config fragment.
up_to_date() {
    local file
    for file in "$@"; do
        [[ -s "$OUTDIR/$file" && "$OUTDIR/$file" -nt "$SCRIPT_PATH" && "$OUTDIR/$file" -nt "$FRAGMENT" ]] ||
            return 1
    done
}

require_commands() {
    local command missing=()
    for command in "$@"; do
        command -v "$command" >/dev/null || missing+=("$command")
    done
    ((${#missing[@]} == 0)) || die "missing commands: ${missing[*]} (run scripts/install-deps.sh)"
}

# Unpacks the kernel source tarball into $WORKDIR/src once; a stamp file records which tarball (path,
# size, mtime) it came from, so a new linux-source package version is unpacked afresh.
unpack_source() {
    local src="$WORKDIR/src"
    local stamp
    stamp="$(stat -c '%n %s %Y' "$SOURCE_TARBALL")"
    if [[ -f "$src/.gpuvm-unpacked" && "$(cat "$src/.gpuvm-unpacked")" == "$stamp" ]]; then
        log "kernel source already unpacked from $SOURCE_TARBALL"
        return
    fi
    log "unpacking $SOURCE_TARBALL"
    # A build directory made from another source tree would mix objects; start both afresh.
    rm -rf "$src" "$WORKDIR/build"
    mkdir -p "$src"
    tar -xf "$SOURCE_TARBALL" -C "$src" --strip-components=1 || die "cannot unpack $SOURCE_TARBALL"
    [[ -f "$src/Makefile" && -x "$src/scripts/kconfig/merge_config.sh" ]] ||
        die "$SOURCE_TARBALL does not hold a kernel source tree"
    echo "$stamp" >"$src/.gpuvm-unpacked"
}

# Fails listing every option of the fragment that the final .config does not have as the fragment says:
# `CONFIG_X=y` must be `CONFIG_X=y` (not =m, not missing), `# CONFIG_X is not set` must not be set.
check_config() {
    local config="$1"
    local line option missing=()
    while IFS= read -r line; do
        if [[ "$line" =~ ^(CONFIG_[A-Za-z0-9_]+)=y$ ]]; then
            grep -qx "${BASH_REMATCH[1]}=y" "$config" || missing+=("${BASH_REMATCH[1]}=y")
        elif [[ "$line" =~ ^#\ (CONFIG_[A-Za-z0-9_]+)\ is\ not\ set$ ]]; then
            option="${BASH_REMATCH[1]}"
            if grep -q "^$option=" "$config"; then
                missing+=("$option=n")
            fi
        fi
    done <"$FRAGMENT"
    if ((${#missing[@]} > 0)); then
        local wanted
        for wanted in "${missing[@]}"; do
            echo "build-virtio-kernel.sh:   wanted $wanted, the .config has:" \
                "$(grep -E "^(# )?${wanted%=*}[= ]" "$config" || echo "nothing (an unknown option, or a dependency is off)")" >&2
        done
        die "${#missing[@]} option(s) of $FRAGMENT did not take effect in $config: ${missing[*]}"
    fi
}

build_kernel() {
    if up_to_date vmlinux-virtio config-virtio; then
        log "virtio kernel up to date"
        return
    fi
    require_commands tar xz make gcc flex bison bc readelf
    [[ -f "$SOURCE_TARBALL" ]] ||
        die "no kernel source at $SOURCE_TARBALL (install linux-source-6.1: scripts/install-deps.sh)"
    [[ -f "$FRAGMENT" ]] || die "no config fragment at $FRAGMENT"
    [[ -f /usr/include/libelf.h ]] || die "libelf.h missing (install libelf-dev: scripts/install-deps.sh)"
    [[ -f /usr/include/openssl/ssl.h ]] || die "openssl headers missing (install libssl-dev)"
    mkdir -p "$WORKDIR"
    unpack_source

    local src="$WORKDIR/src" build="$WORKDIR/build"
    mkdir -p "$build"
    # ARCH=x86_64 makes 64BIT the default; KBUILD_BUILD_* keep the banner free of this machine's names.
    local make_args=(-C "$src" O="$build" ARCH=x86_64 KBUILD_BUILD_USER=gpuvm KBUILD_BUILD_HOST=gpuvm)
    # Kconfig's "override: ... changes choice state" warnings are expected here; they go to config.log.
    local config_log="$WORKDIR/config.log"
    log "make tinyconfig"
    make -s "${make_args[@]}" tinyconfig >"$config_log" 2>&1 || die "make tinyconfig failed (see $config_log)"
    log "merging $FRAGMENT"
    (cd "$build" && ARCH=x86_64 "$src/scripts/kconfig/merge_config.sh" -m -O "$build" "$build/.config" \
        "$FRAGMENT") >>"$config_log" 2>&1 || die "merge_config.sh failed (see $config_log)"
    make -s "${make_args[@]}" olddefconfig >>"$config_log" 2>&1 || die "make olddefconfig failed (see $config_log)"
    check_config "$build/.config"
    log "every option of virtio.config is in the .config"

    local jobs
    jobs="$(nproc)"
    log "make -j$jobs vmlinux (about 6 minutes on 2 idle cores)"
    make "${make_args[@]}" -j"$jobs" vmlinux >"$WORKDIR/make.log" 2>&1 || {
        tail -n 40 "$WORKDIR/make.log" >&2
        die "building vmlinux failed (whole log: $WORKDIR/make.log)"
    }
    [[ -s "$build/vmlinux" ]] || die "make left no $build/vmlinux"
    # gpuvm boots an ELF vmlinux through its XEN_ELFNOTE_PHYS32_ENTRY (type 0x12) note.
    # (Read whole before matching: grep -q stopping early would fail readelf under pipefail.)
    local notes
    notes="$(LC_ALL=C readelf -n "$build/vmlinux")" || die "readelf -n $build/vmlinux failed"
    grep -q 'Xen.*0x00000012' <<<"$notes" || die "$build/vmlinux has no Xen PVH entry note (is CONFIG_PVH on?)"

    cp "$build/.config" "$OUTDIR/config-virtio.tmp"
    mv "$OUTDIR/config-virtio.tmp" "$OUTDIR/config-virtio"
    cp "$build/vmlinux" "$OUTDIR/vmlinux-virtio.tmp"
    mv "$OUTDIR/vmlinux-virtio.tmp" "$OUTDIR/vmlinux-virtio"
    log "kernel release $(cat "$build/include/config/kernel.release")"
}

build_rootfs() {
    if up_to_date rootfs-virtio.ext4; then
        log "ext4 root image up to date"
        return
    fi
    require_commands mkfs.ext4 truncate
    local root="$WORKDIR/rootfs"
    rm -rf "$root"
    # /dev is where the kernel mounts devtmpfs once the root is mounted (CONFIG_DEVTMPFS_MOUNT).
    mkdir -p "$root/dev"
    echo "$ROOTFS_HELLO" >"$root/hello"
    chmod 644 "$root/hello"
    find "$root" -exec touch -h -d @0 {} +
    rm -f "$OUTDIR/rootfs-virtio.ext4.tmp"
    truncate -s "$ROOTFS_SIZE" "$OUTDIR/rootfs-virtio.ext4.tmp"
    # A fixed UUID and hash seed; root_owner makes the files root's whoever builds it.
    mkfs.ext4 -q -F -L gpuvm-root -U 6770756d-7669-4000-8000-7274696f6578 \
        -E root_owner=0:0,hash_seed=6770756d-7669-4000-8000-686173680000 \
        -d "$root" "$OUTDIR/rootfs-virtio.ext4.tmp" || die "mkfs.ext4 -d failed"
    mv "$OUTDIR/rootfs-virtio.ext4.tmp" "$OUTDIR/rootfs-virtio.ext4"
    rm -rf "$root"
}

build_kernel
build_rootfs

log "output directory: $OUTDIR"
for file in vmlinux-virtio rootfs-virtio.ext4; do
    log "$(printf '%-19s %10d bytes' "$file" "$(stat -c %s "$OUTDIR/$file")")"
done
