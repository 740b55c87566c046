"""What more than one section of bench/virtio uses: QEMU q35 as the peer VMM, the test image, network
namespaces."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
from pathlib import Path

from benchlib import MIB, BenchError, tail

GUEST_CID = 3
# QEMU's isa-debug-exit makes QEMU exit with (value << 1) | 1.
QEMU_OK_STATUS = 1
QEMU_CPU = "max,-arch-capabilities"
CLONE_NEWNET = 0x40000000


def qemu_q35_command(args, cmdline: str, device: list[str], shared_memory: bool = False) -> list[str]:
    """QEMU q35 running the test guest with `cmdline` and `device`; with `shared_memory`, guest RAM is
    a shared memfd, which a vhost-user backend maps (as gpuvm's memfd RAM)."""
    machine = ["-M", "q35,memory-backend=mem"] if shared_memory else ["-M", "q35"]
    memory = ["-m", args.memory]
    if shared_memory:
        memory += ["-object", f"memory-backend-memfd,id=mem,size={args.memory},share=on"]
    return [
        args.qemu, *machine, "-enable-kvm", "-cpu", QEMU_CPU, "-smp", "1", *memory,
        "-nodefaults", "-no-user-config", "-nographic", "-serial", "stdio", "-name", "bench,debug-threads=on",
        "-kernel", str(args.guest_elf), "-append", cmdline,
        "-device", "isa-debug-exit,iobase=0xf4,iosize=0x04",
    ] + device  # fmt: skip


def require_fio() -> None:
    if shutil.which("fio") is None:
        raise BenchError("fio not found: install it with scripts/install-deps.sh (Debian package fio)")


def fio_job(command: list[str], timeout: float) -> dict:
    """Runs fio (--output-format=json, one job) and returns the job's figures."""
    try:
        result = subprocess.run(command, capture_output=True, timeout=timeout)
    except OSError as error:
        raise BenchError(f"cannot start fio: {error}") from error
    except subprocess.TimeoutExpired as error:
        raise BenchError(f"fio did not finish within {timeout:g} s:\n  {' '.join(command)}") from error
    if result.returncode != 0:
        raise BenchError(f"fio failed (status {result.returncode}):\n  {' '.join(command)}\n{tail(result.stderr)}")
    text = result.stdout.decode(errors="replace")
    return json.loads(text[text.index("{") :])["jobs"][0]


def qemu_unavailable(args) -> str | None:
    """Why QEMU is not a peer in this run (--no-qemu, or not installed); None when it may be."""
    if args.no_qemu:
        return "--no-qemu"
    if shutil.which(args.qemu) is None:
        return f"{args.qemu} not found"
    return None


def make_image(path: Path, size_mib: int) -> None:
    """A raw image of non-zero, incompressible-looking data (a random MiB repeated)."""
    if path.exists() and path.stat().st_size == size_mib * MIB:
        return
    chunk = os.urandom(MIB)
    with open(path, "wb") as image:
        for index in range(size_mib):
            image.write(chunk[index % 64 :] + chunk[: index % 64])
        image.flush()
        os.fsync(image.fileno())


# --------------------------------------------------------------------------------------------
# network namespaces (root only)


def run_ip(command: list[str]) -> None:
    result = subprocess.run(command, capture_output=True, timeout=30)
    if result.returncode != 0:
        raise BenchError(f"{' '.join(command)} failed: {result.stderr.decode(errors='replace').strip()}")


def netns_add(name: str) -> str:
    """A new network namespace; its path."""
    run_ip(["ip", "netns", "add", name])
    return f"/run/netns/{name}"


def netns_del(name: str) -> None:
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def setns_net(path: str) -> None:
    """Moves the calling thread into the network namespace at `path`."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns")
    finally:
        os.close(fd)


def netns_enter(path: str):
    """A preexec function that moves the child into the namespace at `path` (status 126 if it cannot)."""

    def enter():
        try:
            setns_net(path)
        except OSError:
            os._exit(126)

    return enter


class Netns:
    """A network namespace with a tap (root only); a VMM is started inside it with preexec()."""

    def __init__(self):
        self.name = f"gpuvm-bench-{os.getpid()}"
        self.path = netns_add(self.name)
        try:
            run_ip(["ip", "-n", self.name, "tuntap", "add", "dev", "tap0", "mode", "tap"])
            run_ip(["ip", "-n", self.name, "link", "set", "tap0", "up"])
        except BenchError:
            self.close()
            raise

    def preexec(self):
        return netns_enter(self.path)

    def close(self):
        netns_del(self.name)
