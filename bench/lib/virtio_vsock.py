"""bench/virtio, vsock section: the test guest's `virtio-vsock-bench` through gpuvm's hybrid vsock, against
the same protocol over a host Unix socket (see bench/virtio's docstring)."""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path

from benchlib import MIB, BenchError, Process, median, percentile, thread_roles, thread_times, warm_host_memory
from virtio_common import GUEST_CID

VSOCK_PORT = 1234


def recv_exact(sock: socket.socket, count: int) -> bytes:
    data = bytearray()
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise BenchError(f"connection closed after {len(data)} of {count} bytes")
        data.extend(chunk)
    return bytes(data)


def command(letter: bytes, argument: int) -> bytes:
    return letter + struct.pack("<Q", argument)


def measure_socket(connect, total: int, rounds: int, pid: int | None = None) -> dict:
    """The protocol of `virtio-vsock-bench` over sockets `connect()` opens: sink, source, ping-pong.
    With `pid` (gpuvm's), the VMM's thread times are sampled around each of the three."""
    figures: dict = {"threads": {}}

    def sample():
        return (time.perf_counter(), thread_times(pid) if pid else {})

    def account(name: str, before, after):
        if not pid:
            return
        figures["threads"][name] = {"seconds": after[0] - before[0], **thread_roles(before[1], after[1])}

    chunk = b"\xa5" * MIB
    sock = connect()
    before = sample()
    sock.sendall(command(b"S", total))
    sent = 0
    while sent < total:
        piece = min(MIB, total - sent)
        sock.sendall(chunk[:piece] if piece < MIB else chunk)
        sent += piece
    reply = recv_exact(sock, 16)
    after = sample()
    figures["to_guest_mib_s"] = total / MIB / (after[0] - before[0])
    account("to-guest", before, after)
    count, figures["sink_guest_cycles"] = struct.unpack("<QQ", reply)
    if count != total:
        raise BenchError(f"sink answered {count} bytes, {total} were sent")
    sock.close()

    sock = connect()
    buffer = bytearray(MIB)
    view = memoryview(buffer)
    before = sample()
    sock.sendall(command(b"G", total))
    received = 0
    while received < total:
        got = sock.recv_into(view, min(MIB, total - received))
        if got == 0:
            raise BenchError(f"source closed after {received} of {total} bytes")
        received += got
    after = sample()
    figures["from_guest_mib_s"] = total / MIB / (after[0] - before[0])
    account("from-guest", before, after)
    sock.close()

    sock = connect()
    sock.sendall(command(b"E", 0))
    times = []
    before = sample()
    for _ in range(rounds):
        started = time.perf_counter()
        sock.sendall(b"p")
        if sock.recv(1) != b"p":
            raise BenchError("ping-pong: wrong or no byte back")
        times.append((time.perf_counter() - started) * 1e6)
    account("ping-pong", before, sample())
    sock.close()

    sock = connect()
    sock.sendall(command(b"Q", 0))
    recv_exact(sock, 1)
    sock.close()
    figures["rtt_p50_us"] = percentile(times, 0.5)
    figures["rtt_p99_us"] = percentile(times, 0.99)
    return figures


def vsock_connect(uds: Path):
    def connect() -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(60)
        sock.connect(str(uds))
        sock.sendall(f"CONNECT {VSOCK_PORT}\n".encode())
        line = b""
        while not line.endswith(b"\n"):
            byte = sock.recv(1)
            if not byte:
                raise BenchError(f"vsock: connection closed before OK (got {line!r})")
            line += byte
        if not line.startswith(b"OK "):
            raise BenchError(f"vsock: CONNECT answered {line!r}")
        return sock

    return connect


def loopback_server(listener: socket.socket) -> None:
    """The reference peer (in a child process): the guest workload's protocol over a Unix socket."""
    buffer = bytearray(MIB)
    view = memoryview(buffer)
    chunk = b"\x5a" * MIB
    while True:
        conn, _ = listener.accept()
        header = recv_exact(conn, 9)
        letter, argument = header[:1], struct.unpack("<Q", header[1:])[0]
        if letter == b"S":
            left = argument
            while left:
                got = conn.recv_into(view, min(MIB, left))
                if got == 0:
                    break
                left -= got
            conn.sendall(struct.pack("<QQ", argument, 0))
        elif letter == b"G":
            left = argument
            while left:
                piece = min(MIB, left)
                conn.sendall(chunk if piece == MIB else chunk[:piece])
                left -= piece
        elif letter == b"E":
            while True:
                data = conn.recv(4096)
                if not data:
                    break
                conn.sendall(data)
        elif letter == b"Q":
            conn.sendall(b"q")
            conn.close()
            return
        conn.close()


def measure_loopback(args, work: Path) -> dict:
    path = work / "loopback.sock"
    if path.exists():
        path.unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(4)
    pid = os.fork()
    if pid == 0:
        try:
            loopback_server(listener)
        finally:
            os._exit(0)
    listener.close()

    def connect() -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(60)
        sock.connect(str(path))
        return sock

    try:
        return measure_socket(connect, args.vsock_mib * MIB, args.rtt_rounds)
    finally:
        os.waitpid(pid, 0)


def measure_vsock(args, work: Path) -> dict:
    uds = work / "vsock.sock"
    for stale in work.glob("vsock.sock*"):
        stale.unlink()
    process = Process(
        [
            str(args.gpuvm), "run", "--memory", args.memory, "--cmdline", f"virtio-vsock-bench {VSOCK_PORT}",
            "--vsock", f"cid={GUEST_CID},uds={uds}",
        ]
    )  # fmt: skip
    try:
        if not process.wait_for(b"virtio-vsock-bench: listening", 30):
            raise process.describe("the guest's virtio-vsock-bench did not start listening")
        figures = measure_socket(vsock_connect(uds), args.vsock_mib * MIB, args.rtt_rounds, process.process.pid)
    except BaseException:
        process.kill()
        raise
    status = process.finish(30)
    if status != 0 or b"virtio-vsock-bench: ok" not in process.stdout:
        raise process.describe(f"gpuvm exited with status {status}")
    figures["guest_sink_mib_s"] = args.vsock_mib / (figures["sink_guest_cycles"] / args.tsc_hz)
    return figures


def bench_vsock(args, work: Path, report: dict) -> None:
    print(f"\n== vsock: {args.vsock_mib} MiB each way, {args.rtt_rounds} 1-byte round trips, guest cid {GUEST_CID}")
    series: dict[str, list[dict]] = {"gpuvm vsock": [], "host unix socket (reference)": []}
    for run in range(args.runs):
        order = list(series) if run % 2 == 0 else list(reversed(series))
        for name in order:
            warm_host_memory(args.warm_mib)
            figures = measure_vsock(args, work) if name == "gpuvm vsock" else measure_loopback(args, work)
            series[name].append(figures)
            print(
                f"  run {run + 1} {name:<30} host->guest {figures['to_guest_mib_s']:7.0f} MiB/s"
                f"  guest->host {figures['from_guest_mib_s']:7.0f} MiB/s"
                f"  rtt p50 {figures['rtt_p50_us']:6.1f} us p99 {figures['rtt_p99_us']:7.1f} us",
                flush=True,
            )
    print(f"\nvsock, medians of {args.runs} runs")
    print(f"{'':<32} {'host->guest MiB/s':>18} {'guest->host MiB/s':>18} {'RTT p50 us':>11} {'RTT p99 us':>11}")
    summary = {}
    for name, runs in series.items():
        row = {key: median([r[key] for r in runs]) for key in runs[0] if key not in ("sink_guest_cycles", "threads")}
        print(
            f"  {name:<30} {row['to_guest_mib_s']:18.0f} {row['from_guest_mib_s']:18.0f}"
            f" {row['rtt_p50_us']:11.1f} {row['rtt_p99_us']:11.1f}"
        )
        summary[name] = {"median": row, "runs": runs}
    guest_sink = summary["gpuvm vsock"]["median"].get("guest_sink_mib_s")
    if guest_sink:
        print(f"  (guest's own clock for host->guest: {guest_sink:.0f} MiB/s, first to last byte)")
    print(
        "  where gpuvm's time went (medians; share of each measurement's time on a CPU / waiting for one;"
        " CPU = the device thread's CPU seconds per GiB, per 10,000 round trips)"
    )
    print(f"  {'':<30} {'vCPU':>9} {'device':>9} {'CPU':>7}")
    for name in ("to-guest", "from-guest", "ping-pong"):
        threads = [r["threads"][name] for r in series["gpuvm vsock"]]
        unit = args.rtt_rounds / 10000 if name == "ping-pong" else args.vsock_mib / 1024
        cells = []
        for role in ("vcpu", "device"):
            on = median([t[role][0] / t["seconds"] for t in threads]) * 100
            waiting = median([t[role][1] / t["seconds"] for t in threads]) * 100
            cells.append(f"{on:3.0f}/{waiting:3.0f}%")
        cpu = median([t["device"][0] / unit for t in threads])
        print(f"  {name:<30} {cells[0]:>9} {cells[1]:>9} {cpu:7.3f}")
    report["vsock"] = {"mib": args.vsock_mib, "rtt_rounds": args.rtt_rounds, "series": summary}

