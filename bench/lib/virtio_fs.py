"""bench/virtio, virtio-fs section: the test guest's `virtio-fs-bench` over virtiofsd, in gpuvm and QEMU q35
(vhost-user-fs-pci), against fio on the host (see bench/virtio's docstring)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from benchlib import MIB, Process, cache_file, median, wait_for_path, warm_host_memory
from virtio_common import QEMU_OK_STATUS, fio_job, make_image, qemu_q35_command, qemu_unavailable, require_fio

FS_LINE = re.compile(
    r"virtio-fs-bench: seq-read bytes=(\d+) requests=(\d+) depth=(\d+) chunk=(\d+) cycles=(\d+) notifies=(\d+)"
)


def find_virtiofsd(explicit: str | None) -> tuple[str | None, str | None]:
    """(path, None) or (None, why virtiofsd is not used)."""
    for candidate in ([explicit] if explicit else []) + ["virtiofsd", str(Path.home() / ".cargo/bin/virtiofsd")]:
        found = shutil.which(candidate)
        if found:
            return found, None
    return None, "virtiofsd not found (cargo install virtiofsd, or pass --virtiofsd)"


def fs_host_read(args, big: Path) -> dict:
    """fio reading the file once, sequentially, 1 MiB reads, one at a time (psync, buffered):
    what virtiofsd's single request thread does with each READ."""
    command = [
        "fio", "--output-format=json", f"--filename={big}", "--ioengine=psync", "--rw=read", "--bs=1m",
        "--direct=0", "--invalidate=0", f"--size={args.fs_mib}m", "--thread", "--name=fs-seq-read",
    ]  # fmt: skip
    job = fio_job(command, args.timeout)
    return {"seq-read": job["read"]["bw_bytes"] / MIB}


def qemu_fs_command(args, sock: Path) -> list[str]:
    """QEMU q35 + vhost-user-fs-pci on virtiofsd (one request queue of 1024, as gpuvm's --fs)."""
    device = [
        "-chardev", f"socket,id=vufs0,path={sock}",
        "-device", "vhost-user-fs-pci,chardev=vufs0,tag=bench,queue-size=1024",
    ]  # fmt: skip
    return qemu_q35_command(args, f"virtio-fs-bench {args.fs_mib} {args.fs_depth}", device, shared_memory=True)


def fs_guest_read(args, share: Path, work: Path, qemu: bool = False) -> dict:
    """virtiofsd on `share` (it exits when the VM disconnects) and the guest's virtio-fs-bench, in gpuvm
    or (`qemu`) QEMU q35 with vhost-user-fs-pci."""
    sock = work / "virtiofsd.sock"
    for stale in work.glob("virtiofsd.sock*"):
        stale.unlink()
    backend = Process([args.virtiofsd, f"--socket-path={sock}", f"--shared-dir={share}", "--sandbox", "none"])
    try:
        if not wait_for_path(sock, backend.process):
            raise backend.describe("virtiofsd did not create its socket")
        command = [
            str(args.gpuvm), "run", "--memory", args.memory,
            "--cmdline", f"virtio-fs-bench {args.fs_mib} {args.fs_depth}", "--fs", f"tag=bench,socket={sock}",
        ]  # fmt: skip
        if qemu:
            command = qemu_fs_command(args, sock)
        guest = Process(command)
        status = guest.finish(args.timeout)
        text = bytes(guest.stdout).decode(errors="replace")
        match = FS_LINE.search(text)
        if status != (QEMU_OK_STATUS if qemu else 0) or match is None or "virtio-fs-bench: ok" not in text:
            raise guest.describe(f"the guest's virtio-fs-bench failed (status {status})")
    finally:
        backend.finish(10)
    nbytes, requests, depth, chunk, cycles, notifies = (int(v) for v in match.groups())
    return {
        "seq-read": nbytes / MIB / (cycles / args.tsc_hz),
        "requests": requests,
        "depth": depth,
        "chunk": chunk,
        "notifies": notifies,
    }


def bench_fs(args, work: Path, report: dict) -> None:
    args.virtiofsd, reason = find_virtiofsd(args.virtiofsd)
    if reason:
        print(f"\n== virtio-fs: skipped: {reason}")
        report["fs"] = {"skipped": reason}
        return
    require_fio()
    share = Path(args.image_dir).resolve() / "virtio-fs-share"
    share.mkdir(parents=True, exist_ok=True)
    big = share / "big.bin"
    make_image(big, args.fs_mib)
    print(
        f"\n== virtio-fs: {big} ({args.fs_mib} MiB) read whole by the guest over virtiofsd"
        f" ({args.virtiofsd}, --sandbox none), {args.fs_depth} READs in flight, vs host fio psync 1 MiB reads;"
        " host page cache warm (file read first) and cold (evicted first)"
    )
    guests = ["gpuvm virtio-fs"]
    qemu_reason = qemu_unavailable(args)
    if qemu_reason:
        print(f"  QEMU vhost-user-fs-pci skipped: {qemu_reason}")
    else:
        guests.append("QEMU virtio-fs")
    names = [f"{who} {cache}" for cache in ("warm", "cold") for who in ["host fio psync"] + guests]
    series: dict[str, list[dict]] = {name: [] for name in names}
    for run in range(args.runs):
        shift = run % len(names)
        for name in names[shift:] + names[:shift]:
            cache_file(big, name.endswith("warm"))
            warm_host_memory(args.warm_mib)
            if name.startswith("host"):
                figures = fs_host_read(args, big)
            else:
                figures = fs_guest_read(args, share, work, qemu=name.startswith("QEMU"))
            series[name].append(figures)
            extra = f"  ({figures['chunk'] >> 10} KiB READs)" if "chunk" in figures else ""
            print(f"  run {run + 1} {name:<24} seq-read {figures['seq-read']:7.0f} MiB/s{extra}", flush=True)
    print(f"\nvirtio-fs sequential read, medians of {args.runs} runs (MiB/s)")
    summary = {}
    for cache in ("warm", "cold"):
        host = median([r["seq-read"] for r in series[f"host fio psync {cache}"]])
        guest = median([r["seq-read"] for r in series[f"gpuvm virtio-fs {cache}"]])
        print(f"  {cache} cache: gpuvm virtio-fs {guest:7.0f}  host fio psync {host:7.0f}  ratio {guest / host:.2f}")
        summary[cache] = {"guest_mib_s": guest, "host_mib_s": host, "ratio": guest / host}
        if f"QEMU virtio-fs {cache}" in series:
            qemu = median([r["seq-read"] for r in series[f"QEMU virtio-fs {cache}"]])
            print(
                f"  {cache} cache: QEMU q35 vhost-user-fs-pci {qemu:7.0f}  ratio to host {qemu / host:.2f};"
                f"  gpuvm / QEMU {guest / qemu:.2f}"
            )
            summary[cache].update({"qemu_mib_s": qemu, "qemu_ratio": qemu / host, "gpuvm_vs_qemu": guest / qemu})
    report["fs"] = {"mib": args.fs_mib, "depth": args.fs_depth, "summary": summary, "runs": series}

