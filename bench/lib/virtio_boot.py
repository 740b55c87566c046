"""bench/virtio, boot section: gpuvm's process start to "testguest: ready" without devices, with all of
them and with each alone (see bench/virtio's docstring)."""

from __future__ import annotations

import os
import shutil
import statistics
from pathlib import Path

from benchlib import MIB, BenchError, Process, percentile, warm_host_memory
from virtio_common import GUEST_CID, Netns

BOOT_TARGET = 1.2


def boot_once(command: list[str], preexec, timeout: float) -> float:
    process = Process(command, preexec)
    status = process.finish(timeout)
    if process.ready_at is None or status != 0 or b"testguest: hello from ring 3" not in process.stdout:
        raise process.describe(f"boot failed (status {status})")
    return (process.ready_at - process.started) * 1000


def bench_boot(args, work: Path, report: dict) -> list[tuple[str, bool]]:
    image = work / "boot.img"
    with open(image, "wb") as file:
        file.truncate(64 * MIB)
    netns = None
    net_reason = None
    if os.geteuid() != 0:
        net_reason = "not root: no tap in a network namespace"
    elif shutil.which("ip") is None:
        net_reason = "ip (iproute2) not found"
    else:
        try:
            netns = Netns()
        except BenchError as error:
            net_reason = str(error)
    try:
        preexec = netns.preexec() if netns else None
        uds = work / "boot-vsock.sock"
        base = [str(args.gpuvm), "run", "--memory", args.boot_memory, "--cmdline", "hello"]
        device_flags = {
            "block": ["--drive", f"id=boot,path={image},ro"],
            "vsock": ["--vsock", f"cid={GUEST_CID},uds={uds}"],
            "rng": ["--rng"],
        }
        if netns:
            device_flags["net"] = ["--net", "id=eth0,tap=tap0"]
        variants = {"no devices": base, "all devices": base + [f for flags in device_flags.values() for f in flags]}
        if not args.no_boot_breakdown:
            variants.update({f"{name} only": base + flags for name, flags in device_flags.items()})
        print(
            f"\n== boot: {args.boot_runs} boots of each variant, `hello`, {args.boot_memory}; devices: "
            + ", ".join(device_flags)
            + (
                " (net: a tap in a network namespace; every variant runs in it)"
                if netns
                else f"; net skipped: {net_reason}"
            )
        )
        if args.verbose:
            print("  " + " ".join(variants["all devices"]))
        # Warm-up boots (binary in the page cache), not counted.
        for command in variants.values():
            for stale in work.glob("boot-vsock.sock*"):
                stale.unlink()
            boot_once(command, preexec, args.timeout)
        series: dict[str, list[float]] = {name: [] for name in variants}
        names = list(variants)
        for run in range(args.boot_runs):
            shift = run % len(names)
            for name in names[shift:] + names[:shift]:
                for stale in work.glob("boot-vsock.sock*"):
                    stale.unlink()
                warm_host_memory(args.warm_mib)
                series[name].append(boot_once(variants[name], preexec, args.timeout))
    finally:
        if netns:
            netns.close()
    no_dev = statistics.median(series["no devices"])
    ratio = statistics.median(series["all devices"]) / no_dev
    print("\nboot: process start to 'testguest: ready' (ms)")
    print(f"  {'':<20} {'median':>8} {'p90':>8} {'min':>8} {'max':>8} {'+median':>8}")
    for name, values in series.items():
        print(
            f"  {name:<20} {statistics.median(values):8.2f} {percentile(values, 0.9):8.2f}"
            f" {min(values):8.2f} {max(values):8.2f} {statistics.median(values) - no_dev:8.2f}"
        )
    print(f"  ratio all devices / no devices: {ratio:.3f}")
    report["boot"] = {
        "runs": args.boot_runs,
        "memory": args.boot_memory,
        "net": net_reason is None,
        "net_skipped": net_reason,
        "ready_ms": series,
        "ratio": ratio,
        "devices_command": variants["all devices"],
    }
    label = " + ".join(device_flags)
    return [(f"boot with {label} <= {BOOT_TARGET}x without devices ({ratio:.3f}x)", ratio <= BOOT_TARGET)]

