#!/usr/bin/env bash
# Builds the Linux guest images for gpuvm's boot tests.
#
#   guest-images/linux/build.sh [OUTDIR]      (default: guest-images/linux/out, gitignored)
#
# Outputs in OUTDIR:
#   bzImage           the Debian cloud kernel's vmlinuz, as shipped
#   vmlinux           the uncompressed ELF kernel taken out of bzImage (boots via its Xen PVH entry note)
#   initramfs.cpio    UNCOMPRESSED newc cpio: static busybox and an /init that prints
#                     "gpuvm-linux: init reached" and powers off
#   config            the kernel's .config
#   kernel-version    one line: the kernel release (e.g. 6.1.0-56-cloud-amd64)
#   kernel-package    one line: "<debian package> <version>"
#   pvh-entry         one line: the PVH 32-bit entry address from the ELF note (hex)
#
# The kernel package is the current bookworm cloud kernel (what the linux-image-cloud-amd64 meta package
# depends on), preferring its -unsigned build; set GPUVM_KERNEL_PKG to pick another package.
# Work is skipped when the outputs exist and are newer than this script.
# Needs: apt-get, dpkg-deb, readelf (binutils), the payload's decompressor, busybox-static, cpio
# (scripts/install-deps.sh installs them).
set -euo pipefail

SCRIPT_PATH="$(readlink -f "${BASH_SOURCE[0]}")"
SCRIPT_DIR="$(dirname "$SCRIPT_PATH")"
readonly SCRIPT_PATH SCRIPT_DIR
OUTDIR="$(mkdir -p "${1:-$SCRIPT_DIR/out}" && cd "${1:-$SCRIPT_DIR/out}" && pwd)"
readonly OUTDIR
readonly WORKDIR="$OUTDIR/.work"
readonly INIT_MESSAGE="gpuvm-linux: init reached"

log() { echo "build.sh: $*"; }
die() {
    echo "build.sh: error: $*" >&2
    exit 1
}

# True when every named output exists and is newer than this script.
up_to_date() {
    local file
    for file in "$@"; do
        [[ -s "$OUTDIR/$file" && "$OUTDIR/$file" -nt "$SCRIPT_PATH" ]] || return 1
    done
}

require_commands() {
    local command missing=()
    for command in "$@"; do
        command -v "$command" >/dev/null || missing+=("$command")
    done
    ((${#missing[@]} == 0)) || die "missing commands: ${missing[*]} (run scripts/install-deps.sh)"
}

# Reads an unsigned little-endian integer of SIZE bytes (1, 2 or 4) at OFFSET of FILE.
read_le() {
    local file="$1" offset="$2" size="$3"
    od -An -t "u$size" -j "$offset" -N "$size" "$file" | tr -d ' \n'
}

apt_download() {
    local apt_options=(-q)
    # As root apt drops to the _apt user to download, which cannot write to a root-owned 0700 dir.
    ((EUID == 0)) && apt_options+=(-o APT::Sandbox::User=root)
    (cd "$WORKDIR" && apt-get "${apt_options[@]}" download "$1")
}

package_known() {
    apt-cache show "$1" >/dev/null 2>&1
}

choose_kernel_package() {
    if [[ -n "${GPUVM_KERNEL_PKG:-}" ]]; then
        echo "$GPUVM_KERNEL_PKG"
        return
    fi
    local signed
    signed="$(apt-cache depends linux-image-cloud-amd64 2>/dev/null |
        sed -n 's/^ *Depends: \(linux-image-[0-9].*-cloud-amd64\)$/\1/p' | head -n1)"
    [[ -n "$signed" ]] || return 1
    # The unsigned build carries the same kernel without the EFI signature; either works.
    if package_known "$signed-unsigned"; then
        echo "$signed-unsigned"
    else
        echo "$signed"
    fi
}

# Writes the uncompressed vmlinux ELF held in bzImage $1 to $2.
#
# A bzImage is the real-mode setup code followed by the compressed-kernel stub; boot protocol 2.08+ records
# where in the stub the compressed vmlinux (the "payload") lies. Its last 4 bytes are the uncompressed size
# (gzip's ISIZE trailer, or the size the kernel's build appends to the other formats), which verifies the
# result. Without a usable header, fall back to scanning for each format's magic, as the kernel's
# scripts/extract-vmlinux does.
extract_vmlinux() {
    local bzimage="$1" output="$2"
    local setup_sects protocol payload_offset payload_length
    if [[ "$(od -An -c -j 0x202 -N 4 "$bzimage" | tr -d ' ')" == "HdrS" ]]; then
        protocol="$(read_le "$bzimage" 0x206 2)"
        setup_sects="$(read_le "$bzimage" 0x1f1 1)"
        ((setup_sects == 0)) && setup_sects=4
        payload_offset="$(read_le "$bzimage" 0x248 4)"
        payload_length="$(read_le "$bzimage" 0x24c 4)"
        if ((protocol >= 0x208 && payload_length > 4)); then
            local start=$(((setup_sects + 1) * 512 + payload_offset))
            log "bzImage boot protocol $((protocol >> 8)).$(printf '%02x' $((protocol & 0xff))): payload at byte $start, $payload_length bytes"
            if decompress_payload "$bzimage" "$start" "$payload_length" "$output"; then
                return 0
            fi
            log "payload from the header did not decompress; scanning for compression magic"
        fi
    fi
    scan_for_payload "$bzimage" "$output"
}

# Names the compression format whose magic starts at byte OFFSET of FILE, or fails.
payload_format() {
    local head
    head="$(od -An -tx1 -j "$2" -N 6 "$1" | tr -d ' \n')"
    case "$head" in
    1f8b08*) echo gzip ;;
    fd377a585a00) echo xz ;;
    425a68*) echo bzip2 ;;
    5d0000*) echo lzma ;;
    894c5a*) echo lzop ;;
    02214c18*) echo lz4 ;;
    28b52ffd*) echo zstd ;;
    *) return 1 ;;
    esac
}

decompress_command() {
    case "$1" in
    gzip) echo "gzip -dc" ;;
    # --single-stream: stop at the end of the xz stream instead of parsing what follows it.
    xz) echo "xz -dc --single-stream" ;;
    bzip2) echo "bzip2 -dc" ;;
    lzma) echo "xz -dc --format=lzma" ;;
    lzop) echo "lzop -dc" ;;
    lz4) echo "lz4 -dc" ;;
    zstd) echo "zstd -dc" ;;
    esac
}

is_elf() {
    [[ "$(od -An -tx1 -N 4 "$1" 2>/dev/null | tr -d ' \n')" == "7f454c46" ]]
}

# Decompresses the payload of LENGTH bytes at START of FILE (the last 4 bytes being the uncompressed size)
# into OUTPUT and checks it is an ELF file of that size.
decompress_payload() {
    local file="$1" start="$2" length="$3" output="$4"
    local format command expected_size data_length actual_size
    format="$(payload_format "$file" "$start")" || {
        log "unknown compression magic at byte $start"
        return 1
    }
    command="$(decompress_command "$format")"
    require_commands "${command%% *}"
    expected_size="$(read_le "$file" $((start + length - 4)) 4)"
    # gzip's own trailer holds the size; the other formats had it appended after the stream.
    data_length="$length"
    [[ "$format" != gzip ]] && data_length=$((length - 4))
    log "payload is $format, $data_length bytes, uncompressing to $expected_size bytes"
    # dd reads exactly the payload (tail | head would trip pipefail when head stops reading early).
    dd if="$file" iflag=skip_bytes,count_bytes skip="$start" count="$data_length" bs=1M status=none |
        $command >"$output.tmp" ||
        {
            log "$format failed on the payload"
            return 1
        }
    actual_size="$(stat -c %s "$output.tmp")"
    if ! is_elf "$output.tmp" || ((actual_size % 4294967296 != expected_size)); then
        log "payload result is not the expected ELF ($actual_size bytes)"
        rm -f "$output.tmp"
        return 1
    fi
    mv "$output.tmp" "$output"
}

# Tries each compression magic at each offset it occurs at; keeps the first result that is an ELF file.
scan_for_payload() {
    local file="$1" output="$2"
    local format magic offset command
    local -A magics=(
        [gzip]='\x1f\x8b\x08' [xz]='\xfd7zXZ\x00' [bzip2]='BZh' [lzma]='\x5d\x00\x00\x00'
        [lzop]='\x89LZO' [lz4]='\x02\x21\x4c\x18' [zstd]='\x28\xb5\x2f\xfd'
    )
    for format in gzip xz zstd lz4 bzip2 lzma lzop; do
        command="$(decompress_command "$format")"
        command -v "${command%% *}" >/dev/null || continue
        magic="${magics[$format]}"
        while read -r offset; do
            # Decompressors complain about what follows their stream; the ELF check decides.
            tail -c +$((offset + 1)) "$file" | $command >"$output.tmp" 2>/dev/null || true
            if is_elf "$output.tmp"; then
                log "found a $format payload by magic at byte $offset"
                mv "$output.tmp" "$output"
                return 0
            fi
        done < <(LC_ALL=C grep -obUaP "$magic" "$file" | cut -d: -f1)
    done
    rm -f "$output.tmp"
    return 1
}

# Prints the PVH entry address from vmlinux's XEN_ELFNOTE_PHYS32_ENTRY (type 0x12) note, or fails.
pvh_entry() {
    local vmlinux="$1"
    # readelf -n shows Xen notes it cannot name as "Unknown note type: (0x00000012)" followed by a
    # "description data:" line holding the 4- or 8-byte little-endian entry address.
    readelf -n "$vmlinux" | awk '
        $1 == "Xen" && /0x00000012/ { want = 1; next }
        want && /description data:/ {
            sub(/.*description data: */, "")
            n = split($0, bytes, " ")
            value = ""
            for (i = n; i >= 1; i--) value = value bytes[i]
            print "0x" value
            exit
        }'
}

build_kernel() {
    if up_to_date bzImage vmlinux config kernel-version kernel-package pvh-entry; then
        log "kernel images up to date"
        return
    fi
    require_commands apt-get apt-cache dpkg-deb readelf od tar
    mkdir -p "$WORKDIR"

    local package
    if ! package="$(choose_kernel_package)" || ! package_known "$package"; then
        # A fresh machine may never have fetched the package lists.
        log "kernel package not in the apt lists; running apt-get update"
        apt-get -q -o DPkg::Lock::Timeout=300 update >/dev/null || die "apt-get update failed"
        package="$(choose_kernel_package)" || die "cannot resolve linux-image-cloud-amd64's kernel package"
        package_known "$package" || die "package $package not found by apt-cache"
    fi
    local version
    version="$(apt-cache show --no-all-versions "$package" | sed -n 's/^Version: //p' | head -n1)"
    log "kernel package: $package $version"

    local deb
    deb="$(find "$WORKDIR" -maxdepth 1 -name "${package}_*.deb" | head -n1)"
    if [[ -z "$deb" ]]; then
        apt_download "$package" || die "apt-get download $package failed"
        deb="$(find "$WORKDIR" -maxdepth 1 -name "${package}_*.deb" | head -n1)"
        [[ -n "$deb" ]] || die "apt-get download left no ${package}_*.deb in $WORKDIR"
    fi

    # Only ./boot is needed; the modules under ./lib would be most of the unpacked size.
    local unpacked="$WORKDIR/unpacked"
    rm -rf "$unpacked"
    mkdir -p "$unpacked"
    dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$unpacked" --wildcards './boot/*' ||
        die "cannot unpack ./boot from $deb"
    local vmlinuz
    vmlinuz="$(find "$unpacked/boot" -name 'vmlinuz-*' | head -n1)"
    [[ -n "$vmlinuz" ]] || die "$deb has no boot/vmlinuz-*"
    local release="${vmlinuz##*/vmlinuz-}"

    cp "$vmlinuz" "$OUTDIR/bzImage.tmp"
    mv "$OUTDIR/bzImage.tmp" "$OUTDIR/bzImage"
    cp "$unpacked/boot/config-$release" "$OUTDIR/config" 2>/dev/null || : >"$OUTDIR/config"
    extract_vmlinux "$OUTDIR/bzImage" "$OUTDIR/vmlinux" || die "no vmlinux ELF found inside $vmlinuz"

    local entry
    entry="$(pvh_entry "$OUTDIR/vmlinux")"
    [[ "$entry" =~ ^0x[0-9a-f]+$ ]] && entry="$(printf '%#x' "$entry")" || entry=""
    [[ -n "$entry" ]] || die "vmlinux has no Xen PVH entry note (XEN_ELFNOTE_PHYS32_ENTRY, type 0x12)"
    log "vmlinux has the Xen PVH entry note (XEN_ELFNOTE_PHYS32_ENTRY): entry $entry"

    echo "$entry" >"$OUTDIR/pvh-entry"
    echo "$package $version" >"$OUTDIR/kernel-package"
    echo "$release" >"$OUTDIR/kernel-version"
    rm -rf "$unpacked"
}

build_initramfs() {
    if up_to_date initramfs.cpio; then
        log "initramfs up to date"
        return
    fi
    require_commands cpio find sort
    local busybox=/bin/busybox
    [[ -x "$busybox" ]] || busybox="$(command -v busybox || true)"
    [[ -n "$busybox" ]] || die "busybox not found (apt-get install busybox-static)"
    # The initramfs has no libc, so only a static busybox runs in it.
    if LC_ALL=C readelf -l "$busybox" 2>/dev/null | grep -q 'Requesting program interpreter'; then
        die "$busybox is dynamically linked; install busybox-static"
    fi

    local root="$WORKDIR/initramfs"
    rm -rf "$root"
    mkdir -p "$root"/{bin,dev,proc,sys,tmp,root}
    ln -s bin "$root/sbin"
    cp "$busybox" "$root/bin/busybox"
    local applet
    for applet in $("$busybox" --list); do
        [[ "$applet" == busybox ]] || ln -sf busybox "$root/bin/$applet"
    done
    # The kernel opens /dev/console for init's stdio before anything could mount devtmpfs.
    if ((EUID == 0)); then
        mknod -m 600 "$root/dev/console" c 5 1
        mknod -m 666 "$root/dev/null" c 1 3
    else
        log "warning: not root, so no /dev/console in the initramfs (init's output may be lost)"
    fi
    cat >"$root/init" <<EOF
#!/bin/sh
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
echo "$INIT_MESSAGE"
poweroff -f
EOF
    chmod 755 "$root/init"

    # Fixed timestamps and inode numbers (--reproducible) make the archive byte-for-byte repeatable.
    find "$root" -exec touch -h -d @0 {} +
    (cd "$root" && find . -mindepth 1 | LC_ALL=C sort |
        cpio --quiet -o -H newc --owner=0:0 --reproducible) >"$OUTDIR/initramfs.cpio.tmp" ||
        die "cpio failed"
    mv "$OUTDIR/initramfs.cpio.tmp" "$OUTDIR/initramfs.cpio"
    rm -rf "$root"
}

build_kernel
build_initramfs

log "output directory: $OUTDIR"
log "kernel: $(cat "$OUTDIR/kernel-version") from $(cat "$OUTDIR/kernel-package")"
log "PVH entry: $(cat "$OUTDIR/pvh-entry")"
for file in bzImage vmlinux initramfs.cpio; do
    log "$(printf '%-15s %10d bytes' "$file" "$(stat -c %s "$OUTDIR/$file")")"
done
