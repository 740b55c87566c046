"""bench/virtio, block section: the test guest's `virtio-blk-bench` through gpuvm (each drive engine,
O_DIRECT on and off, vhost-user-blk on qemu-storage-daemon, 2 MiB pages), QEMU q35 (virtio-blk-pci and
vhost-user-blk-pci) and fio on the host, on the same image (see bench/virtio's docstring)."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from benchlib import (
    MIB, BenchError, HugePages, Process, cache_file, median, parse_size, tail, thread_roles, wait_for_path,
    warm_host_memory,
)
from virtio_common import QEMU_OK_STATUS, fio_job, make_image, qemu_q35_command, qemu_unavailable, require_fio

BLK_LINE = re.compile(
    r"virtio-blk-bench: (seq-read|seq-write|rand-read) bytes=(\d+) requests=(\d+) depth=(\d+) "
    r"cycles=(\d+) notifies=(\d+)(?: notify_cycles=(\d+))?"
)
PHASES = ("seq-read", "seq-write", "rand-read")
SNAPSHOT_LINES = re.compile(r"virtio-blk-bench: (capacity=|seq-read |seq-write |rand-read )")
SEQ_TARGET = 0.8


class BlkConfig:
    def __init__(self, name: str, kind: str, direct: bool, engine: str | None = None, huge: bool = False):
        self.name = name
        self.kind = kind  # fio, gpuvm, vhost-user, qemu, qemu-vhost-user
        self.direct = direct
        self.engine = engine
        # Guest RAM (gpuvm: --memory-backing hugetlb-2m) or fio's buffers (--iomem=shmhuge) in
        # 2 MiB pages; the peer of a huge-page guest is fio with huge-page buffers.
        self.huge = huge
        mode = "direct" if direct else "buffered"
        self.peer = f"host fio io_uring {mode}" + (" huge pages" if huge else "")


FIO_JOBS = {
    "seq-read": ["--rw=read", "--bs=1m"],
    "seq-write": ["--rw=write", "--bs=1m"],
    "rand-read": ["--rw=randread", "--bs=4k"],
}


def fio_command(args, image: Path, direct: bool, huge: bool = False, phase: str = "seq-read") -> list[str]:
    command = [
        "fio", "--output-format=json", f"--filename={image}", "--ioengine=io_uring",
        f"--iodepth={args.depth}", f"--direct={int(direct)}", "--invalidate=0",
        f"--size={args.size_mib}m", "--thread", "--randrepeat=0", f"--name={phase}",
    ] + FIO_JOBS[phase]  # fmt: skip
    if phase == "rand-read":
        command.append(f"--number_ios={args.random_count}")
    if huge:
        command.append("--iomem=shmhuge")
    return command


def run_fio(args, image: Path, direct: bool, huge: bool) -> dict:
    """The three phases as three fio runs, in the guest's order."""
    figures: dict = {"cpu_s": {}}
    for phase in PHASES:
        job = fio_job(fio_command(args, image, direct, huge, phase), args.timeout)
        if phase == "rand-read":
            figures[phase] = job["read"]["iops"]
        else:
            figures[phase] = job["read" if phase == "seq-read" else "write"]["bw_bytes"] / MIB
        # fio's job thread (io_uring's workers, which do buffered writes, are not in it).
        figures["cpu_s"][phase] = (job["usr_cpu"] + job["sys_cpu"]) / 100 * job["job_runtime"] / 1000
    return figures


def guest_cmdline(args) -> str:
    return f"virtio-blk-bench {args.size_mib} {args.depth} {args.random_count}"


def gpuvm_blk_command(args, image: Path, config: BlkConfig, socket_path: Path | None) -> list[str]:
    if config.kind == "vhost-user":
        drive = f"id=bench,vhost_user={socket_path}"
    else:
        drive = f"id=bench,path={image},engine={config.engine}" + (",direct" if config.direct else "")
    command = [str(args.gpuvm), "run", "--memory", args.memory, "--cmdline", guest_cmdline(args), "--drive", drive]
    if config.huge:
        command += ["--memory-backing", "hugetlb-2m"]
    return command


def qemu_blk_command(args, image: Path, direct: bool) -> list[str]:
    cache = "none" if direct else "writeback"
    device = [
        "-drive", f"file={image},if=none,id=d0,format=raw,cache={cache},aio=io_uring",
        "-device", "virtio-blk-pci,drive=d0,disable-legacy=on",
    ]  # fmt: skip
    return qemu_q35_command(args, guest_cmdline(args), device)


def qemu_vhost_user_blk_command(args, socket_path: Path) -> list[str]:
    """QEMU q35 + vhost-user-blk-pci on qemu-storage-daemon's export (one queue, as gpuvm's drive)."""
    device = [
        "-chardev", f"socket,id=vub0,path={socket_path}",
        "-device", "vhost-user-blk-pci,chardev=vub0,num-queues=1,disable-legacy=on",
    ]  # fmt: skip
    return qemu_q35_command(args, guest_cmdline(args), device, shared_memory=True)


def parse_guest_blk(process: Process, tsc_hz: float) -> dict:
    text = bytes(process.stdout).decode(errors="replace")
    figures: dict = {"notifies": {}}
    for match in BLK_LINE.finditer(text):
        phase, nbytes, requests, _depth, cycles, notifies, notify_cycles = match.groups()
        seconds = int(cycles) / tsc_hz
        if phase == "rand-read":
            figures[phase] = int(requests) / seconds
        else:
            figures[phase] = int(nbytes) / MIB / seconds
        figures["notifies"][phase] = int(notifies) / int(requests)
        if notify_cycles is not None and int(notifies):
            # What one notification (an MMIO write the VMM's ioeventfd takes) costs the guest.
            figures.setdefault("notify_us", {})[phase] = int(notify_cycles) / int(notifies) / tsc_hz * 1e6
    if "virtio-blk-bench: ok" not in text or not all(p in figures for p in PHASES):
        raise process.describe("the guest's virtio-blk-bench did not finish")
    # Where the VMM's threads spent each phase (the snapshot at a phase's line minus the one
    # before it: the phase plus the few ms of printing the line).
    figures["threads"] = {}
    for (_, before), (line, after) in zip(process.snapshots, process.snapshots[1:]):
        match = BLK_LINE.search(line)
        if not match:
            continue
        seconds = int(match.group(5)) / tsc_hz
        roles = thread_roles(before, after)
        # Seconds on CPU and waiting for one, the phase's length, and the wall time between the two
        # samples (the phase, its line and the guest's idle gap: what the always-busy vCPU is
        # measured against; the device and io_uring workers are idle outside the phase).
        window = (after["wall"][0] - before["wall"][0]) / 1e9
        figures["threads"][match.group(1)] = {"seconds": seconds, "window": window, **roles}
    return figures


def start_qsd(args, image: Path, socket_path: Path, direct: bool) -> Process:
    if socket_path.exists():
        socket_path.unlink()
    file = f"driver=file,node-name=file0,filename={image},aio=io_uring,cache.direct={'on' if direct else 'off'}"
    export = f"type=vhost-user-blk,id=exp0,node-name=disk0,addr.type=unix,addr.path={socket_path},writable=on"
    process = Process(
        [args.qsd, "--blockdev", file, "--blockdev", "driver=raw,node-name=disk0,file=file0", "--export", export]
    )
    if not wait_for_path(socket_path, process.process):
        process.kill()
        raise process.describe("qemu-storage-daemon did not create its socket")
    return process


def run_blk_config(args, image: Path, config: BlkConfig, work: Path) -> dict:
    cache_file(image, cached=not config.direct)
    warm_host_memory(args.warm_mib)
    if config.kind == "fio":
        return run_fio(args, image, config.direct, config.huge)
    if config.kind == "fio-spin":
        # A busy loop beside fio: the CPU the test guest's polling vCPU takes from the host.
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            return run_fio(args, image, config.direct, config.huge)
        finally:
            spinner.kill()
            spinner.wait()
    if config.kind == "qemu":
        process = Process(qemu_blk_command(args, image, config.direct), snapshot_on=SNAPSHOT_LINES)
        status = process.finish(args.timeout)
        if status != QEMU_OK_STATUS:
            raise process.describe(f"QEMU exited with status {status}")
        return parse_guest_blk(process, args.tsc_hz)
    backend = None
    socket_path = work / "vhost-user-blk.sock"
    if config.kind in ("vhost-user", "qemu-vhost-user"):
        backend = start_qsd(args, image, socket_path, config.direct)
    try:
        if config.kind == "qemu-vhost-user":
            command, vmm, ok_status = qemu_vhost_user_blk_command(args, socket_path), "QEMU", QEMU_OK_STATUS
        else:
            command, vmm, ok_status = gpuvm_blk_command(args, image, config, socket_path), "gpuvm", 0
        process = Process(
            command,
            snapshot_on=SNAPSHOT_LINES,
            also_sample=backend.process.pid if backend else None,
        )
        status = process.finish(args.timeout)
        if status != ok_status:
            raise process.describe(f"{vmm} exited with status {status}")
        return parse_guest_blk(process, args.tsc_hz)
    finally:
        if backend is not None:
            backend.process.terminate()
            backend.finish(10)


def qemu_usable(args, image: Path) -> str | None:
    """None when QEMU q35 runs the guest's block bench here, else why not."""
    unavailable = qemu_unavailable(args)
    if unavailable:
        return unavailable
    probe = argparse.Namespace(**vars(args))
    probe.size_mib, probe.random_count = 16, 100
    process = Process(qemu_blk_command(probe, image, False))
    status = process.finish(60)
    text = bytes(process.stdout).decode(errors="replace")
    if status == QEMU_OK_STATUS and "virtio-blk-bench: ok" in text:
        return None
    return f"QEMU q35 probe failed (status {status}): {tail(text, 3).strip()}"


def huge_pages_needed(args) -> int:
    size = parse_size(args.memory, units="MG", bare=None)
    if size is None:
        raise BenchError(f"--memory {args.memory!r}: expected a size such as 512M or 1G")
    mib = size // MIB
    # The guest's RAM, plus fio's buffers (DEPTH MiB) and slack.
    return mib // 2 + args.depth // 2 + 16


def bench_blk(args, work: Path, report: dict) -> list[tuple[str, bool]]:
    image_dir = Path(args.image_dir).resolve()
    image_dir.mkdir(parents=True, exist_ok=True)
    image = image_dir / f"virtio-bench-{args.size_mib}m.img"
    print(f"\n== block: {image} ({args.size_mib} MiB), depth {args.depth}, {args.random_count} random 4 KiB reads")
    make_image(image, args.size_mib)
    require_fio()

    qemu_reason = qemu_usable(args, image)
    qsd_reason = None
    if args.no_vhost_user:
        qsd_reason = "--no-vhost-user"
    elif shutil.which(args.qsd) is None:
        qsd_reason = f"{args.qsd} not found"
    huge_reason = None
    if args.no_huge:
        huge_reason = "--no-huge"
    elif os.geteuid() != 0:
        huge_reason = "not root (vm.nr_hugepages)"
    configs = []
    for direct in (False, True):
        mode = "direct" if direct else "buffered"
        configs.append(BlkConfig(f"host fio io_uring {mode}", "fio", direct))
        if not args.no_spinner:
            configs.append(BlkConfig(f"host fio io_uring {mode} + spinner", "fio-spin", direct))
        configs.append(BlkConfig(f"gpuvm Sync {mode}", "gpuvm", direct, "Sync"))
        configs.append(BlkConfig(f"gpuvm Async {mode}", "gpuvm", direct, "Async"))
        if qsd_reason is None:
            configs.append(BlkConfig(f"gpuvm vhost-user (qsd io_uring) {mode}", "vhost-user", direct))
        if qemu_reason is None:
            configs.append(BlkConfig(f"QEMU q35 io_uring {mode}", "qemu", direct))
        if qemu_reason is None and qsd_reason is None:
            configs.append(BlkConfig(f"QEMU q35 vhost-user (qsd) {mode}", "qemu-vhost-user", direct))
    if huge_reason is None:
        # O_DIRECT into 2 MiB pages: what the hardware sees changes with the page size (see docs/performance.md).
        configs.append(BlkConfig("host fio io_uring direct huge pages", "fio", True, huge=True))
        configs.append(BlkConfig("gpuvm Async direct hugetlb-2m", "gpuvm", True, "Async", huge=True))
    if qemu_reason:
        print(f"  QEMU skipped: {qemu_reason}")
    if qsd_reason:
        print(f"  vhost-user skipped: {qsd_reason}")
    if huge_reason:
        print(f"  huge-page variants skipped: {huge_reason}")
    if args.verbose:
        print("  fio: " + " ".join(fio_command(args, image, True)))
        print("  gpuvm: " + " ".join(gpuvm_blk_command(args, image, configs[2], None)))
        if qemu_reason is None:
            print("  qemu: " + " ".join(qemu_blk_command(args, image, True)))

    results: dict[str, list[dict]] = {config.name: [] for config in configs}
    huge_pages = None
    try:
        if huge_reason is None:
            try:
                huge_pages = HugePages(huge_pages_needed(args))
            except (BenchError, OSError) as error:
                huge_reason = str(error)
                print(f"  huge-page variants skipped: {huge_reason}")
                configs = [c for c in configs if not c.huge]
        for run in range(args.runs):
            # Rotated each run, within each O_DIRECT mode (the mode's configs stay together).
            for direct in (False, True):
                group = [c for c in configs if c.direct == direct]
                shift = run % len(group)
                for config in group[shift:] + group[:shift]:
                    figures = run_blk_config(args, image, config, work)
                    results[config.name].append(figures)
                    print(
                        f"  run {run + 1} {config.name:<40} seq-read {figures['seq-read']:7.0f} MiB/s"
                        f"  seq-write {figures['seq-write']:7.0f} MiB/s  rand-read {figures['rand-read']:8.0f} IOPS",
                        flush=True,
                    )
    finally:
        if huge_pages is not None:
            huge_pages.close()

    print(
        f"\nblock, medians of {args.runs} runs (MiB/s; IOPS for 4 KiB random reads; ratio = guest / host fio"
        " in the same O_DIRECT mode and page size)"
    )
    print(
        f"  {'':<40} {'seq-read':>9} {'ratio':>6} {'seq-write':>10} {'ratio':>6} {'rand-read':>10} {'ratio':>6}"
        "  notifies/request, us/notify (read write rand)"
    )
    checks = []
    summary = {}
    for config in configs:
        row = {phase: median([r[phase] for r in results[config.name]]) for phase in PHASES}
        ratios = {phase: row[phase] / median([r[phase] for r in results[config.peer]]) for phase in PHASES}
        notifies = ""
        if config.kind not in ("fio", "fio-spin"):
            per_request = {
                phase: median([r["notifies"][phase] for r in results[config.name]]) for phase in PHASES
            }
            notifies = " ".join(f"{per_request[phase]:.2f}" for phase in PHASES)
            costs = [
                median([r.get("notify_us", {}).get(phase) for r in results[config.name]]) for phase in PHASES
            ]
            if all(cost is not None for cost in costs):
                notifies += ", " + " ".join(f"{cost:.1f}" for cost in costs)
        print(
            f"  {config.name:<40} {row['seq-read']:9.0f} {ratios['seq-read']:6.2f} {row['seq-write']:10.0f}"
            f" {ratios['seq-write']:6.2f} {row['rand-read']:10.0f} {ratios['rand-read']:6.2f}  {notifies}"
        )
        summary[config.name] = {"median": row, "ratio": ratios, "peer": config.peer, "runs": results[config.name]}
        if config.kind == "gpuvm":
            for phase in ("seq-read", "seq-write"):
                checks.append(
                    (f"{config.name} {phase} >= {SEQ_TARGET}x host ({ratios[phase]:.2f}x)", ratios[phase] >= SEQ_TARGET)
                )

    peers = [
        (f"gpuvm vhost-user (qsd io_uring) {mode}", f"QEMU q35 vhost-user (qsd) {mode}")
        for mode in ("buffered", "direct")
    ]
    peers = [(ours, theirs) for ours, theirs in peers if ours in summary and theirs in summary]
    if peers:
        print("\n  vhost-user-blk on the same qemu-storage-daemon export, gpuvm / QEMU q35 (vhost-user-blk-pci):")
        for ours, theirs in peers:
            ratios = {phase: summary[ours]["median"][phase] / summary[theirs]["median"][phase] for phase in PHASES}
            summary[ours]["ratio_vs_qemu_vhost_user"] = ratios
            print(
                f"  {ours:<40} seq-read {ratios['seq-read']:5.2f}  seq-write {ratios['seq-write']:5.2f}"
                f"  rand-read {ratios['rand-read']:5.2f}"
            )

    if not args.no_spinner:
        print(
            "\n  the same guests against fio beside a busy loop (the CPU the polling vCPU takes from the host;"
            " informational):"
        )
        for config in configs:
            if config.kind == "fio-spin" or config.kind == "fio" or config.huge:
                continue
            peer = config.peer + " + spinner"
            ratios = {
                phase: summary[config.name]["median"][phase] / median([r[phase] for r in results[peer]])
                for phase in PHASES
            }
            summary[config.name]["ratio_vs_spinner"] = ratios
            print(
                f"  {config.name:<40} seq-read {ratios['seq-read']:5.2f}  seq-write {ratios['seq-write']:5.2f}"
                f"  rand-read {ratios['rand-read']:5.2f}"
            )

    print(
        "\nwhere the time went (medians): share of the time the VMM's vCPU thread (the polling guest), its"
        "\n  other threads (gpuvm: the device's I/O thread; QEMU: the main loop) and io_uring's workers spent"
        "\n  on a CPU / waiting for one (vCPU: of the sampling window; the others: of the phase); CPU = their"
        "\n  CPU seconds outside the vCPU per GiB moved, for random reads per 10,000 reads (vhost-user: the"
        "\n  backend's threads count as device and workers; fio: its job thread, as fio reports it)"
    )
    print(f"  {'':<40} {'phase':<10} {'vCPU':>9} {'device':>9} {'workers':>9} {'CPU':>7}")
    for config in configs:
        if config.kind == "fio-spin":
            continue
        for phase in PHASES:
            unit = args.random_count / 10000 if phase == "rand-read" else args.size_mib / 1024
            if config.kind == "fio":
                cpu = median([r["cpu_s"][phase] / unit for r in results[config.name]])
                print(f"  {config.name:<40} {phase:<10} {'':>9} {'':>9} {'':>9} {cpu:7.3f}")
                continue
            threads = [r["threads"][phase] for r in results[config.name] if phase in r["threads"]]
            if not threads:
                continue
            cells = []
            for role in ("vcpu", "device", "workers"):
                span = "window" if role == "vcpu" else "seconds"
                on = median([t[role][0] / t[span] for t in threads]) * 100
                waiting = median([t[role][1] / t[span] for t in threads]) * 100
                cells.append(f"{on:3.0f}/{waiting:3.0f}%")
            cpu = median([(t["device"][0] + t["workers"][0]) / unit for t in threads])
            print(f"  {config.name:<40} {phase:<10} {cells[0]:>9} {cells[1]:>9} {cells[2]:>9} {cpu:7.3f}")

    report["blk"] = {
        "image": str(image),
        "size_mib": args.size_mib,
        "depth": args.depth,
        "random_count": args.random_count,
        "qemu_skipped": qemu_reason,
        "vhost_user_skipped": qsd_reason,
        "huge_skipped": huge_reason,
        "fio_command_direct": fio_command(args, image, True),
        "configs": summary,
    }
    return checks

