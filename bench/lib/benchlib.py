"""Helpers shared by the scripts in bench/ (Python standard library only).

Each script puts its own directory's lib/ on sys.path and imports this module:

    sys.path.insert(0, str(Path(__file__).resolve().parent / "lib"))
    import benchlib

What is here: errors, statistics, finding gpuvm and naming a peer, facts about the host and its page
cache, processes (start, wait with a timeout, read their output, sample their threads and RSS), what gpuvm
prints about itself (--report-timing's boot stages, its log's timestamps), the HTTP API over a Unix socket
that gpuvm and Cloud Hypervisor serve, and the JSON report.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import shutil
import re
import select
import socket as sockets
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
MIB = 1 << 20
READY_MARKER = b"testguest: ready"
# Where `cargo build` puts binaries: .cargo/config.toml names the target triple (static-pie build), so the
# triple's directory comes first; plain target/ is the layout without it.
TARGET_DIRS = ("target/x86_64-unknown-linux-gnu", "target")
GPUVM_RELEASE = REPO_ROOT / TARGET_DIRS[0] / "release" / "gpuvm"


class BenchError(RuntimeError):
    """A failure that ends the benchmark with a message instead of a traceback (a RuntimeError, so the
    scripts that stop on RuntimeError stop on it too)."""


# --------------------------------------------------------------------------------------------
# statistics and formatting


def median(values):
    """The median of the values that are not None; None when there are none."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def percentile(values: list[float], fraction: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[rank - 1]


def p90(values: list[float]) -> float:
    """The 90th percentile as bench/gpu and bench/cloud-hypervisor print it: the value at the rounded
    index 0.9 * (n - 1) (with few runs it can differ from percentile(values, 0.9))."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]


def verdict(passed: bool) -> str:
    return "PASS" if passed else "MISS"


def fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def tail(data: bytes | str, lines: int = 15) -> str:
    """The last lines of a process's output, indented, for an error message."""
    if isinstance(data, bytes):
        data = data.decode(errors="replace")
    text = data.rstrip("\n").splitlines()
    return "\n".join("    " + line for line in text[-lines:]) or "    (nothing)"


def parse_size(text: str, units: str = "KMGT", bare: int | None = 1) -> int | None:
    """Bytes in a size such as 512M or 8G (suffixes from `units`, powers of 1024); a number without a
    suffix counts in units of `bare` bytes, or is refused when `bare` is None. None when refused."""
    match = re.fullmatch(rf"(\d+)([{units}]?)", text.strip().upper())
    if not match or (not match.group(2) and bare is None):
        return None
    if not match.group(2):
        return int(match.group(1)) * bare
    return int(match.group(1)) << (10 * (" KMGT".index(match.group(2))))


# --------------------------------------------------------------------------------------------
# binaries: gpuvm and the peers


def is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def build_outputs(name: str, profiles: tuple[str, ...] = ("release",)) -> list[Path]:
    """Where `cargo build` puts `name`, in the order to look (each profile in both layouts)."""
    return [REPO_ROOT / base / profile / name for profile in profiles for base in TARGET_DIRS]


def find_built(name: str, profiles: tuple[str, ...] = ("release",)) -> Path | None:
    return next((path for path in build_outputs(name, profiles) if is_executable(path)), None)


DEFAULT_GPUVM_PATHS = build_outputs("gpuvm")


def find_gpuvm(explicit: str | None) -> Path | None:
    """`explicit` (--gpuvm), else $GPUVM_BIN, else the release build; None when none is built. A
    relative path is taken from the current directory; a named one that is not executable is an error."""
    chosen = explicit or os.environ.get("GPUVM_BIN")
    if chosen:
        path = Path(chosen)
        if not path.is_absolute():
            path = (Path.cwd() / path).resolve()
        if not is_executable(path):
            raise BenchError(f"gpuvm binary {path} does not exist or is not executable")
        return path
    return find_built("gpuvm")


def installed_copy(binary: Path, directory: Path, name: str) -> Path:
    """`binary` copied to `directory/name` as a package manager installs one, and run from there.

    Peak RSS depends on how a binary's file came into the page cache: a file written by a copy is
    cached in large folios, which the kernel maps whole around a fault, while a linker's output
    (written through mmap) is cached in 4 KiB pages that fault-around maps 64 KiB at a time.
    Measured on this host: gpuvm 3.9 MiB run from target/ against 4.7 MiB as a copy, Firecracker
    5.1 against 5.4 MiB. The benches run both VMMs as copies: as hosts run them, and the same for
    both."""
    copy = directory / name
    shutil.copyfile(binary.resolve(), copy)
    copy.chmod(0o755)
    return copy


def write_guest_elf(gpuvm: Path, output: Path) -> Path:
    """`gpuvm guest-image --output`: the embedded test guest as an ELF that QEMU and Cloud Hypervisor
    boot (PVH)."""
    result = subprocess.run(
        [str(gpuvm), "guest-image", "--output", str(output)], capture_output=True, timeout=60
    )
    if result.returncode != 0 or not output.is_file():
        raise BenchError(
            f"'{gpuvm} guest-image --output {output}' failed (status {result.returncode}):\n"
            f"{tail(result.stderr)}"
        )
    return output


def peer_version(binary: str | Path, missing: str = "unknown") -> str:
    """The first line `binary --version` prints, which names the peer the figures were measured
    against; `missing` when it prints none or fails, with why when it does not run."""
    try:
        result = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"{missing} ({error})"
    lines = result.stdout.strip().splitlines()
    return lines[0] if result.returncode == 0 and lines else missing


def describe_peer(binary: str | Path) -> dict:
    """Which peer gave the figures: {"path", "version"}, for the report."""
    return {"path": str(binary), "version": peer_version(binary)}


# --------------------------------------------------------------------------------------------
# the host


def check_kvm(why: str = "") -> None:
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        raise BenchError(f"/dev/kvm is missing or not accessible to this user{why}")


def loadavg() -> str:
    """The 1-minute load average and the running/total tasks (other work on the machine skews figures)."""
    try:
        fields = Path("/proc/loadavg").read_text().split()
        return f"{fields[0]} ({fields[3]})"
    except (OSError, IndexError):
        return "n/a"


def host_tsc_hz(override_mhz: float | None) -> tuple[float, str]:
    """The TSC frequency guest cycles are converted with, and where it came from."""
    if override_mhz:
        return override_mhz * 1e6, "--tsc-mhz"
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError as error:
        raise BenchError(f"cannot read /proc/cpuinfo: {error}; pass --tsc-mhz") from error
    flags = re.search(r"^flags\s*:(.*)$", text, re.M)
    mhz = re.search(r"^cpu MHz\s*:\s*([\d.]+)", text, re.M)
    if not mhz:
        raise BenchError("no 'cpu MHz' in /proc/cpuinfo; pass --tsc-mhz")
    flag_set = set(flags.group(1).split()) if flags else set()
    if {"constant_tsc", "tsc_known_freq"} <= flag_set:
        return float(mhz.group(1)) * 1e6, "/proc/cpuinfo cpu MHz (constant_tsc, tsc_known_freq)"
    return float(mhz.group(1)) * 1e6, "/proc/cpuinfo cpu MHz (TSC frequency not known to be constant!)"


def meminfo(field: str) -> int:
    """A /proc/meminfo figure (kB for sizes, a count for HugePages_*); 0 when absent."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")


class HugePages:
    """Reserves `count` free 2 MiB pages (raising vm.nr_hugepages as needed; root only) and puts the old
    value back on close() or at the end of a `with` block."""

    def __init__(self, count: int):
        self.count = count
        self.previous: int | None = int(NR_HUGEPAGES.read_text())
        NR_HUGEPAGES.write_text(str(self.previous + max(count - meminfo("HugePages_Free"), 0)))
        if meminfo("HugePages_Free") < count:
            self.close()
            raise BenchError(f"cannot reserve {count} huge pages of 2 MiB")

    def close(self) -> None:
        if self.previous is not None:
            NR_HUGEPAGES.write_text(str(self.previous))
            self.previous = None

    def __enter__(self) -> "HugePages":
        return self

    def __exit__(self, *_exc) -> None:
        self.close()


def warm_host_memory(mib: int) -> None:
    """Touches and frees `mib` MiB (ENVIRONMENT.md: the host VM gives idle memory back to its host,
    so the first touch after a pause is slow; this makes every measured command start alike)."""
    if mib <= 0:
        return
    size = mib * MIB
    area = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        if hasattr(area, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
            area.madvise(mmap.MADV_HUGEPAGE)
        chunk = b"\x01" * MIB
        for _ in range(mib):
            area.write(chunk)
    finally:
        area.close()


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def evict_file(path: Path) -> None:
    """Drops the file's pages from the page cache (POSIX_FADV_DONTNEED; clean pages only)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cache_file(path: Path, cached: bool) -> None:
    """Reads the file into the page cache, or evicts it (after an fsync, so nothing is dirty)."""
    fsync_file(path)
    if not cached:
        evict_file(path)
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        while os.read(fd, 8 * MIB):
            pass
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------
# processes: RSS and thread times


def read_peak_rss_kib(pid: int) -> int | None:
    """The process's VmHWM (peak resident set) in KiB, or None once it has exited."""
    try:
        with open(f"/proc/{pid}/status", "rb") as status:
            for line in status:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def thread_times(pid: int) -> dict[str, tuple[int, int]]:
    """{thread name: (ns on CPU, ns waiting on a run queue)} from /proc/PID/task/*/schedstat;
    threads of the same name (io_uring workers, iou-wrk-*) are added up."""
    times: dict[str, tuple[int, int]] = {}
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return times
    for task in tasks:
        try:
            name = Path(f"/proc/{pid}/task/{task}/comm").read_text().strip()
            run_ns, wait_ns = (int(v) for v in Path(f"/proc/{pid}/task/{task}/schedstat").read_text().split()[:2])
        except (OSError, ValueError):
            continue
        if name.startswith("iou-wrk") or name.startswith("iou-sqp"):
            name = "io_uring workers"
        run0, wait0 = times.get(name, (0, 0))
        times[name] = (run0 + run_ns, wait0 + wait_ns)
    return times


def classify_thread(name: str) -> str:
    """The role of a gpuvm or QEMU thread: the vCPU, io_uring's workers, or the VMM's other threads
    (gpuvm: the device's I/O thread; QEMU: its main loop, which runs the device)."""
    if name.startswith("vcpu") or name.startswith("CPU "):
        return "vcpu"
    if name.endswith("io_uring workers"):
        return "workers"
    return "device"


def thread_roles(before: dict, after: dict) -> dict[str, list[float]]:
    """{role: [s on CPU, s waiting for one]} between two thread_times() samples (a "wall" entry, the
    sample's own clock, is left out)."""
    roles: dict[str, list[float]] = {"vcpu": [0.0, 0.0], "device": [0.0, 0.0], "workers": [0.0, 0.0]}
    for name, (run_ns, wait_ns) in after.items():
        if name == "wall":
            continue
        run0, wait0 = before.get(name, (0, 0))
        role = roles[classify_thread(name)]
        role[0] += (run_ns - run0) / 1e9
        role[1] += (wait_ns - wait0) / 1e9
    return roles


# --------------------------------------------------------------------------------------------
# processes: starting, waiting, reading output


def kill(process: subprocess.Popen) -> None:
    """Kills the process if it still runs, and reaps it."""
    if process.poll() is None:
        process.kill()
        process.wait()


def stop(process: subprocess.Popen, timeout: float = 30) -> None:
    """Waits up to `timeout` s for the process to exit on its own, then kills it."""
    if process.poll() is None:
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill(process)


class Process:
    """A child in a session of its own whose stdout and stderr are drained by threads (so a chatty
    child never blocks); `wait_for` waits for a line on stdout, `finish` for the exit (killing the
    process group after a timeout). `ready_at` is when `ready_marker` first showed on stdout."""

    def __init__(
        self,
        command: list[str],
        preexec=None,
        snapshot_on: re.Pattern | None = None,
        also_sample: int | None = None,
        ready_marker: bytes = READY_MARKER,
    ):
        self.command = command
        self.ready_marker = ready_marker
        # Another process whose threads count as this one's device threads (a vhost-user backend).
        self.also_sample = also_sample
        # (line, {thread name: (run ns, run-queue wait ns)}) taken when a line matching
        # `snapshot_on` arrives: where the process's CPU time went between two lines.
        self.snapshot_on = snapshot_on
        self.snapshots: list[tuple[str, dict]] = []
        self.scanned = 0
        self.started = time.monotonic()
        try:
            self.process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                preexec_fn=preexec,
            )
        except OSError as error:
            raise BenchError(f"cannot start {command[0]}: {error}") from error
        self.stdout = bytearray()
        self.stderr = bytearray()
        self.ready_at: float | None = None
        self.changed = threading.Condition()
        self.threads = [
            threading.Thread(target=self._drain, args=(self.process.stdout, self.stdout), daemon=True),
            threading.Thread(target=self._drain, args=(self.process.stderr, self.stderr), daemon=True),
        ]
        for thread in self.threads:
            thread.start()

    def _drain(self, stream, sink: bytearray):
        fd = stream.fileno()
        while True:
            chunk = os.read(fd, 65536)
            now = time.monotonic()
            with self.changed:
                if chunk:
                    sink.extend(chunk)
                    if sink is self.stdout and self.ready_at is None and self.ready_marker in sink:
                        self.ready_at = now
                    if sink is self.stdout and self.snapshot_on is not None:
                        self._snapshot_lines()
                self.changed.notify_all()
            if not chunk:
                return

    def _snapshot_lines(self):
        end = self.stdout.rfind(b"\n") + 1
        if end <= self.scanned:
            return
        lines = bytes(self.stdout[self.scanned : end]).decode(errors="replace").splitlines()
        self.scanned = end
        for line in lines:
            if self.snapshot_on.search(line):
                times = thread_times(self.process.pid)
                if self.also_sample:
                    for name, value in thread_times(self.also_sample).items():
                        times[f"backend {name}"] = value
                times["wall"] = (int(time.monotonic() * 1e9), 0)
                self.snapshots.append((line, times))

    def wait_for(self, marker: bytes, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self.changed:
            while marker not in self.stdout:
                if self.process.poll() is not None and not any(t.is_alive() for t in self.threads):
                    return marker in self.stdout
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self.changed.wait(min(remaining, 0.1))
            return True

    def finish(self, timeout: float) -> int | None:
        """Waits for the exit (kills the group after `timeout`); None when it had to be killed."""
        try:
            status = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            status = None
        for thread in self.threads:
            thread.join(timeout=5)
        return status

    def kill(self):
        try:
            os.killpg(self.process.pid, 9)
        except ProcessLookupError:
            pass
        self.process.wait()

    def describe(self, problem: str) -> BenchError:
        return BenchError(
            f"{problem}\n  command: {' '.join(self.command)}\n  stdout (last lines):\n{tail(bytes(self.stdout))}"
            f"\n  stderr (last lines):\n{tail(bytes(self.stderr))}"
        )


def wait_for_path(path: Path, process: subprocess.Popen, timeout: float = 10, poll: float = 0.01) -> bool:
    """Waits until the process makes `path` (a backend's socket); False when it exits or time runs out."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(poll)
    return True


class Output:
    """The stdout of a subprocess.Popen (stdout=PIPE), read in this thread as it comes (select on the
    pipe): `seen` holds when each marker waited for, or named in `watch`, first showed (monotonic)."""

    def __init__(self, process: subprocess.Popen, watch: tuple[bytes, ...] = (), who: str = "gpuvm"):
        self.process = process
        self.watch = tuple(watch)
        self.who = who
        self.data = b""
        self.seen: dict[bytes, float] = {}
        self.ended = False

    def text(self, chars: int = 4000) -> str:
        return self.data.decode(errors="replace")[-chars:]

    def _read(self, left: float, marker: bytes | None = None) -> None:
        """Waits up to `left` s (0.5 at most) for output and takes what there is."""
        ready, _, _ = select.select([self.process.stdout], [], [], min(left, 0.5))
        if not ready:
            return
        chunk = os.read(self.process.stdout.fileno(), 65536)
        now = time.monotonic()
        if not chunk:
            self.ended = True
            return
        self.data += chunk
        for known in self.watch + ((marker,) if marker else ()):
            if known not in self.seen and known in self.data:
                self.seen[known] = now

    def wait_for(self, marker: bytes, timeout: float, failure: bytes | None = None, start: int = 0) -> float:
        """Reads until `marker` shows at or after offset `start` of the output; the monotonic time it
        did. `failure` in the output ends the wait at once with an error, as the output ending does."""
        deadline = time.monotonic() + timeout
        while self.data.find(marker, start) < 0:
            if failure is not None and failure in self.data:
                raise RuntimeError(f"{failure!r} in the output:\n{self.text()}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"no {marker!r} within {timeout} s:\n{self.text()}")
            self._read(left, marker)
            if self.ended and self.data.find(marker, start) < 0:
                raise RuntimeError(f"{self.who} ended before {marker!r}:\n{self.text()}")
        if start:
            return time.monotonic()
        return self.seen.setdefault(marker, time.monotonic())

    def read_to_end(self, timeout: float, what: str) -> None:
        """Reads until the process closes its stdout; `what` names the awaited end in the error."""
        deadline = time.monotonic() + timeout
        while not self.ended:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"no {what} within {timeout} s:\n{self.text()}")
            self._read(left)


# --------------------------------------------------------------------------------------------
# what gpuvm prints about itself: --report-timing's stages, its log's timestamps

BOOT_STAGES_LINE = re.compile(r"^gpuvm: boot-stages (.*)$", re.MULTILINE)
# env_logger's text format as gpuvm writes it: `[2026-01-01T10:00:00.123456Z DEBUG target] message`.
LOG_RECORD = re.compile(r"^\[(\S+Z)\s+(\w+)\s+(\S+)\] (.*)$", re.MULTILINE)


def boot_stages_us(stderr: str) -> dict[str, int]:
    """{stage: microseconds} from `--report-timing`'s `gpuvm: boot-stages` line (names without the
    `_us`; `total` is their sum, process start to vCPUs running); empty without the line."""
    found = BOOT_STAGES_LINE.search(stderr)
    if not found:
        return {}
    stages = {}
    for pair in found.group(1).split():
        name, _, value = pair.partition("=")
        if name.endswith("_us") and value.lstrip("-").isdigit():
            stages[name[: -len("_us")]] = int(value)
    return stages


def log_records(stderr: str) -> list[tuple[float, str, str, str]]:
    """gpuvm's text log records as (seconds since the epoch, level, target, message), in order
    (timestamps in microseconds: `format_timestamp_micros`)."""
    records = []
    for stamp, level, target, message in LOG_RECORD.findall(stderr):
        try:
            when = datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
        except ValueError:
            continue
        records.append((when, level, target, message))
    return records


# --------------------------------------------------------------------------------------------
# the HTTP API on a Unix socket (gpuvm's, Cloud Hypervisor's)


def api(
    path: Path,
    method: str,
    route: str,
    body: dict | None = None,
    timeout: float = 60,
    headers: tuple[str, ...] = (),
) -> tuple[int, str]:
    """One HTTP/1.1 request on the API socket at `path`; (status, body). `headers` are added lines,
    such as "Connection: close"."""
    payload = json.dumps(body).encode() if body is not None else b""
    lines = [f"{method} {route} HTTP/1.1", "Host: localhost", *headers, "Content-Type: application/json",
             f"Content-Length: {len(payload)}"]  # fmt: skip
    request = ("\r\n".join(lines) + "\r\n\r\n").encode() + payload
    with sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM) as conn:
        conn.settimeout(timeout)
        conn.connect(str(path))
        conn.sendall(request)
        answer = b""
        while True:
            head, sep, rest = answer.partition(b"\r\n\r\n")
            if sep:
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value.strip())
                if len(rest) >= length:
                    return int(head.split()[1]), rest[:length].decode(errors="replace")
            chunk = conn.recv(65536)
            if not chunk:
                raise RuntimeError(f"{method} {route}: the API closed the connection: {answer!r}")
            answer += chunk


def wait_for_socket(
    path: Path, process: subprocess.Popen, timeout: float = 30, who: str = "gpuvm", poll: float = 0.001
) -> None:
    """Waits until the API socket at `path` takes a connection (polled every `poll` s)."""
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{who} exited {process.returncode} before its API socket was up")
        try:
            with sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM) as conn:
                conn.connect(str(path))
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no API socket at {path}")
            time.sleep(poll)


# --------------------------------------------------------------------------------------------
# the script and its report


def run_bench(name: str, run, args) -> int:
    """`run(args)`'s exit status; a BenchError is printed as `bench/NAME: error: ...` (status 1)."""
    try:
        return run(args)
    except BenchError as error:
        print(f"bench/{name}: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def write_json(path: str | Path, report, announce: bool = False) -> Path:
    """Writes the report (indented JSON); with `announce`, says where."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    if announce:
        print(f"results written to {path}")
    return path
