"""bench/virtio, net section (root only): UDP through a tap in a network namespace, gpuvm and QEMU q35
(virtio-net-pci) against two veth ends (see bench/virtio's docstring)."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchlib import BenchError, Process, kill, tail, warm_host_memory
from virtio_common import QEMU_OK_STATUS, netns_add, netns_del, netns_enter, qemu_q35_command, qemu_unavailable, run_ip, setns_net

NET_PAYLOAD = 1472
NET_GUEST_MAC = "06:00:0a:63:00:02"
NET_LINE = re.compile(r"virtio-net-bench: (tx|rx) frames=(\d+) bytes=(\d+) cycles=(\d+)")
# A UDP blaster run in a network namespace (a child, so it never shares the counting process's
# interpreter): sends NET_PAYLOAD-byte datagrams to HOST:PORT for SECONDS, prints how many.
NET_BLAST = r"""
import socket, sys, time
host, port, seconds, size = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
data, target, sent, failed = bytes(size), (host, port), 0, 0
end = time.monotonic() + seconds
while time.monotonic() < end:
    for _ in range(256):
        try:
            sock.sendto(data, target)
            sent += 1
        except OSError:
            failed += 1
print(sent, failed, flush=True)
"""


def net_socket_in(path: str, address: tuple[str, int]) -> socket.socket:
    """A UDP socket bound to `address` inside the namespace at `path` (made on a thread that
    entered it: setns moves only the calling thread; the socket stays in the namespace)."""
    made: list = []

    def make():
        try:
            setns_net(path)
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
            sock.bind(address)
            made.append(sock)
        except OSError as error:
            made.append(error)

    thread = threading.Thread(target=make)
    thread.start()
    thread.join()
    if isinstance(made[0], OSError):
        raise BenchError(f"cannot make a UDP socket in {path}: {made[0]}")
    return made[0]


def net_count(sock: socket.socket, seconds: float, wait: float) -> dict:
    """Counts datagrams for `seconds` after the first (which may take up to `wait`), or until
    none came for 1 s; the rate is over first to last datagram, host clock."""
    buffer = bytearray(65536)
    frames = nbytes = 0
    first = last = None
    sock.settimeout(wait)
    while True:
        try:
            size = sock.recv_into(buffer)
        except socket.timeout:
            break
        now = time.monotonic()
        if first is None:
            first = now
            sock.settimeout(1.0)
        last = now
        frames += 1
        nbytes += size
        if now - first >= seconds:
            break
    duration = (last - first) if first is not None and last > first else 0.0
    return {"frames": frames, "bytes": nbytes, "seconds": duration}


def net_rate(frames: int, nbytes: int, seconds: float) -> dict:
    if seconds <= 0 or frames < 2:
        return {"gbit_s": 0.0, "kpps": 0.0, "frames": frames, "bytes": nbytes, "seconds": seconds}
    return {
        "gbit_s": nbytes * 8 / seconds / 1e9,
        "kpps": frames / seconds / 1e3,
        "frames": frames,
        "bytes": nbytes,
        "seconds": seconds,
    }


def net_blaster(path: str, host: str, port: int, seconds: float) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", NET_BLAST, host, str(port), str(seconds), str(NET_PAYLOAD)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=netns_enter(path),
    )


def net_measure_veth(args, path_a: str, path_b: str) -> dict:
    """The ceiling: the same blast between two veth ends in two namespaces, kernel to kernel."""
    receiver = net_socket_in(path_b, ("10.99.0.2", 0))
    port = receiver.getsockname()[1]
    warm_host_memory(args.warm_mib)
    blaster = net_blaster(path_a, "10.99.0.2", port, args.net_seconds + 1)
    try:
        counted = net_count(receiver, args.net_seconds, wait=10)
    finally:
        out, _ = blaster.communicate(timeout=args.net_seconds + 30)
        receiver.close()
    figures = net_rate(counted["frames"], counted["bytes"], counted["seconds"])
    figures["sent"] = int(out.split()[0]) if out.split() else 0
    return figures


def net_guest_command(args, vmm: str, mode: str, port: int) -> list[str]:
    cmdline = f"virtio-net-bench 10.99.1.2 10.99.1.1 {port} {mode} {args.net_seconds}"
    if vmm == "gpuvm":
        return [
            str(args.gpuvm), "run", "--memory", args.memory, "--cmdline", cmdline,
            "--net", f"id=eth0,tap=tap0,mac={NET_GUEST_MAC}",
        ]  # fmt: skip
    device = [
        "-netdev", "tap,id=n0,ifname=tap0,script=no,downscript=no",
        "-device", f"virtio-net-pci,netdev=n0,disable-legacy=on,mac={NET_GUEST_MAC}",
    ]  # fmt: skip
    return qemu_q35_command(args, cmdline, device)


def net_guest_line(process: Process, mode: str) -> tuple[int, int, int]:
    text = bytes(process.stdout).decode(errors="replace")
    for match in NET_LINE.finditer(text):
        if match.group(1) == mode and "virtio-net-bench: ok" in text:
            return int(match.group(2)), int(match.group(3)), int(match.group(4))
    raise process.describe(f"the guest's virtio-net-bench {mode} did not finish")


def net_measure_guest(args, vmm: str, path: str, mode: str) -> dict:
    """`tx`: the guest blasts, a socket in the namespace counts (host clock); `rx`: a blaster in
    the namespace sends to the guest, which counts (guest TSC)."""
    ok_status = 0 if vmm == "gpuvm" else QEMU_OK_STATUS
    receiver = net_socket_in(path, ("10.99.1.1", 0))
    port = receiver.getsockname()[1]
    warm_host_memory(args.warm_mib)
    process = Process(net_guest_command(args, vmm, mode, port), preexec=netns_enter(path))
    blaster = None
    try:
        if mode == "tx":
            counted = net_count(receiver, args.net_seconds, wait=60)
            status = process.finish(args.timeout)
            if status != ok_status:
                raise process.describe(f"{vmm} exited with status {status}")
            frames, nbytes, cycles = net_guest_line(process, mode)
            figures = net_rate(counted["frames"], counted["bytes"], counted["seconds"])
            figures["guest_sent"] = net_rate(frames, nbytes, cycles / args.tsc_hz)
            return figures
        if not process.wait_for(b"virtio-net-bench: rx waiting", 60):
            process.kill()
            raise process.describe(f"{vmm}: the guest did not start receiving")
        blaster = net_blaster(path, "10.99.1.2", port, args.net_seconds + 3)
        status = process.finish(args.timeout)
        if status != ok_status:
            raise process.describe(f"{vmm} exited with status {status}")
        frames, nbytes, cycles = net_guest_line(process, mode)
        figures = net_rate(frames, nbytes, cycles / args.tsc_hz)
        out, _ = blaster.communicate(timeout=args.net_seconds + 30)
        figures["host_sent"] = int(out.split()[0]) if out.split() else 0
        return figures
    finally:
        if blaster is not None:
            kill(blaster)
        if process.process.poll() is None:
            process.kill()
        receiver.close()


def bench_net(args, work: Path, report: dict) -> None:
    if os.geteuid() != 0:
        print("\n== net: skipped: not root (needs network namespaces, a tap and veth)")
        report["net"] = {"skipped": "not root"}
        return
    if shutil.which("ip") is None:
        print("\n== net: skipped: ip (iproute2) not found")
        report["net"] = {"skipped": "no ip"}
        return
    tag = os.getpid()
    names = {"a": f"gpuvm-bnet-a-{tag}", "b": f"gpuvm-bnet-b-{tag}", "vm": f"gpuvm-bnet-vm-{tag}"}
    made: list[str] = []
    try:
        paths = {}
        for key, name in names.items():
            paths[key] = netns_add(name)
            made.append(name)
        a, b, vm = names["a"], names["b"], names["vm"]
        run_ip(["ip", "-n", a, "link", "add", "va", "type", "veth", "peer", "name", "vb", "netns", b])
        run_ip(["ip", "-n", a, "addr", "add", "10.99.0.1/24", "dev", "va"])
        run_ip(["ip", "-n", b, "addr", "add", "10.99.0.2/24", "dev", "vb"])
        run_ip(["ip", "-n", vm, "tuntap", "add", "dev", "tap0", "mode", "tap"])
        run_ip(["ip", "-n", vm, "addr", "add", "10.99.1.1/24", "dev", "tap0"])
        for ns, dev in ((a, "va"), (b, "vb"), (vm, "tap0")):
            run_ip(["ip", "-n", ns, "link", "set", dev, "up"])
        print(
            f"\n== net: UDP {NET_PAYLOAD}-byte datagrams for {args.net_seconds} s each way, {args.runs} runs; "
            "guest->host counted by a socket in the namespace (host clock), host->guest sent by a Python "
            "blaster and counted by the guest (TSC); one queue pair, the guest's ring-3 driver polls"
        )
        qemu_reason = qemu_unavailable(args)
        if qemu_reason is None:
            try:
                probe = argparse.Namespace(**vars(args))
                probe.net_seconds = 1
                net_measure_guest(probe, "qemu", paths["vm"], "tx")
            except BenchError as error:
                qemu_reason = f"QEMU q35 probe failed: {tail(str(error), 4).strip()}"
        if qemu_reason:
            print(f"  QEMU q35 + virtio-net-pci skipped: {qemu_reason}")
        peers = ["gpuvm", "veth"] + ([] if qemu_reason else ["qemu"])
        series: dict[str, list[dict]] = {f"{peer} {mode}": [] for peer in peers for mode in ("tx", "rx")}
        for run in range(args.runs):
            shift = run % len(peers)
            for peer in peers[shift:] + peers[:shift]:
                if peer == "veth":
                    figures = net_measure_veth(args, paths["a"], paths["b"])
                    series["veth tx"].append(figures)
                    series["veth rx"].append(figures)
                    continue
                for mode in ("tx", "rx"):
                    series[f"{peer} {mode}"].append(net_measure_guest(args, peer, paths["vm"], mode))
    finally:
        for name in made:
            netns_del(name)

    def med(key: str, field: str) -> float:
        return statistics.median(figures[field] for figures in series[key])

    print(f"\nnet: UDP payload throughput, medians of {args.runs}")
    print(f"  {'':<44} {'Gbit/s':>8} {'kpkt/s':>8} {'/ veth':>8} {'/ qemu':>8}")
    rows = [
        ("guest->host gpuvm (host received)", "gpuvm tx"),
        ("guest->host qemu (host received)", "qemu tx"),
        ("host->host veth (same blaster and counter)", "veth tx"),
        ("host->guest gpuvm (guest received)", "gpuvm rx"),
        ("host->guest qemu (guest received)", "qemu rx"),
    ]
    for label, key in rows:
        if key not in series:
            continue
        gbit, kpps = med(key, "gbit_s"), med(key, "kpps")
        veth = med("veth tx", "gbit_s")
        peer_key = "qemu " + key.split()[1]
        vs_qemu = f"{gbit / med(peer_key, 'gbit_s'):8.3f}" if peer_key in series and med(peer_key, "gbit_s") else f"{'-':>8}"
        print(f"  {label:<44} {gbit:8.3f} {kpps:8.1f} {gbit / veth if veth else 0:8.3f} {vs_qemu}")
    for peer in ("gpuvm", "qemu"):
        if f"{peer} tx" in series:
            sent = statistics.median(figures["guest_sent"]["kpps"] for figures in series[f"{peer} tx"])
            got = med(f"{peer} tx", "kpps")
            print(f"  {peer} guest->host: the guest's driver sent {sent:.1f} kpkt/s (its TSC), the host socket got {got:.1f}")
    print(
        "  veth: the blaster in one namespace, the counting socket in the other; both are Python, so this is\n"
        "  the ceiling of the measuring tools over the kernel on these CPUs, not of the kernel alone"
    )
    report["net"] = {"seconds": args.net_seconds, "payload": NET_PAYLOAD, "qemu_skipped": qemu_reason, "series": series}

