#!/usr/bin/env bash
# Installs the Debian packages that gpuvm's tests and benchmarks need.
#
# Idempotent: when every package is already installed it returns without touching apt.
# Needs root (or passwordless sudo) on Debian 12 (bookworm).
#
#   qemu-system-x86  QEMU microvm, the side-by-side baseline for bench/boot
#   busybox-static   user space of the Linux test initramfs (guest-images/linux/build.sh)
#   cpio             packs that initramfs
#   binutils         readelf, to check the kernel's PVH ELF note
#   xz-utils zstd lz4 bzip2 gzip
#                    decompress the vmlinux payload inside a bzImage (whichever the kernel uses)
#   python3          bench/boot (standard library only)
#   python3-venv     scripts/api-fuzz.sh installs schemathesis (PyPI) into a virtual environment
#   curl             tests/api.rs drives the API socket with curl --unix-socket
#   ca-certificates  apt-get download over https mirrors
#   libclang-dev     bindgen, for the userfaultfd-sys crate (gpuvm-memory's lazy restore)
#   libseccomp-dev libcap-ng-dev
#                    build virtiofsd (cargo install --locked virtiofsd, below), the virtio-fs
#                    backend of the vhost-user tests; qemu-storage-daemon (vhost-user-blk)
#                    comes with qemu-system-x86
set -euo pipefail

readonly PACKAGES=(
    qemu-system-x86
    busybox-static
    cpio
    binutils
    xz-utils
    zstd
    lz4
    bzip2
    gzip
    python3
    python3-venv
    curl
    ca-certificates
    libclang-dev
    libseccomp-dev
    libcap-ng-dev
    linux-source-6.1
    linux-source-6.12
    flex
    bison
    bc
    libelf-dev
    libssl-dev
    e2fsprogs
    iputils-ping
    fio
)

is_installed() {
    # dpkg-query prints "install ok installed" only for fully configured packages.
    [[ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null)" == "install ok installed" ]]
}

# virtiofsd (vhost-user virtio-fs backend) is not packaged in Debian 12: built from crates.io
# with the packages above, unless one already runs.
install_virtiofsd() {
    if virtiofsd --version >/dev/null 2>&1; then
        return 0
    fi
    if ! command -v cargo >/dev/null; then
        echo "install-deps: error: cargo not found; it builds virtiofsd" >&2
        return 1
    fi
    echo "install-deps: building virtiofsd (cargo install --locked virtiofsd)"
    cargo install --locked virtiofsd
}

missing=()
for package in "${PACKAGES[@]}"; do
    is_installed "$package" || missing+=("$package")
done

if ((${#missing[@]} == 0)); then
    echo "install-deps: all packages present"
    install_virtiofsd
    exit 0
fi

if ! command -v apt-get >/dev/null; then
    echo "install-deps: error: apt-get not found; this script supports Debian 12 only" >&2
    exit 1
fi

as_root=()
if ((EUID != 0)); then
    if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
        as_root=(sudo -n)
    else
        echo "install-deps: error: must run as root to install: ${missing[*]}" >&2
        exit 1
    fi
fi

echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
# Another apt may hold the lock briefly (unattended upgrades, a parallel job); wait for it.
apt_options=(-o DPkg::Lock::Timeout=300 -q)
"${as_root[@]}" apt-get "${apt_options[@]}" update
"${as_root[@]}" apt-get "${apt_options[@]}" install -y --no-install-recommends "${missing[@]}"

for package in "${missing[@]}"; do
    if ! is_installed "$package"; then
        echo "install-deps: error: $package did not install" >&2
        exit 1
    fi
done
install_virtiofsd
echo "install-deps: done"
