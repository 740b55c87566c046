//! A hostile guest against gpuvm's virtio devices, with seccomp on (the default): the test
//! guest's `virtio-hostile` workload attacks the block, entropy and socket devices (and a
//! network device, where the test can make a tap) through their rings and registers —
//! descriptor loops, chains through every descriptor, indices and addresses out of range,
//! buffers outside RAM, straddling its end or in the device's own BAR, 4 GiB lengths, an
//! available index far ahead, indirect tables of 2^16 entries, rings outside RAM, garbage in
//! every register, block requests past the end, socket packets with wrong CIDs and lying
//! lengths, an RST flood — and after each attack checks that the device still serves a good
//! request (after a reset where the attack left it broken) and that the device wrote no
//! guest memory outside the buffers it was given.
//!
//! What the host checks: gpuvm ends with the guest's status 0 and the expected number of
//! attacks, never panics, and ends in bounded time; no device thread burns CPU (a device
//! spinning on a broken ring) and the log stays short (a spinning device logs in a loop);
//! the drive image is unchanged outside the one sector the good requests write; gpuvm's
//! peak RSS beyond guest memory stays within a margin of a run without the attacks (a
//! device that allocated per guest-given length would show there).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use gpuvm_tests::{gpuvm_bin, run_gpuvm, RunOutput, Scratch, SpawnedProcess};

/// The attacks per device, as the workload counts them (its `<device> survived N attacks`
/// lines): change them with the workload.
const BLK_ATTACKS: u32 = 45;
const RNG_ATTACKS: u32 = 33;
const VSOCK_ATTACKS: u32 = 45;
const NET_ATTACKS: u32 = 30;
/// The workload waits 1 s for each chain a device drops and about 1 s for the RST flood to
/// stall: about 20 s in all on the 2-core CI host. A device spinning on a ring hangs its
/// reset, and so the run.
const RUN_BOUND: Duration = Duration::from_secs(120);
const KILL_LIMIT: Duration = Duration::from_secs(180);
/// CPU time any one device I/O thread may use in the whole run, at least: each request costs
/// microseconds, while a thread spinning on a broken ring uses all of a core for as long as
/// it spins. The notification storm's 100000 kicks cost 2.5-3.7 s, depending on how many the
/// device finds coalesced (how fast the guest kicks), so the bound also grows with the run:
/// a fifth of its wall time ([`device_thread_cpu_bound`]).
const DEVICE_THREAD_CPU: Duration = Duration::from_secs(3);

/// The CPU time a device I/O thread may use in a run that took `elapsed`.
fn device_thread_cpu_bound(elapsed: Duration) -> Duration {
    DEVICE_THREAD_CPU.max(elapsed / 5)
}
/// Log lines the run may write: the devices rate-limit their warnings about the guest, so a
/// flood means a loop.
const MAX_LOG_LINES: usize = 3_000;
/// Log volume at which the run is stopped as a flood (the whole run logs about 30 KiB).
const FLOOD_BYTES: usize = 4 << 20;
/// What gpuvm's RSS beyond guest memory may exceed a run of `hello` with the same devices.
const RSS_MARGIN_KIB: u64 = 8 * 1024;
/// The drive: 1 MiB of pseudo-random bytes after the magic the workload checks; the good
/// requests write sector 1 (and only it), the attacks try sectors 0, 16, 20, 24 and the end.
const IMAGE_SIZE: usize = 1 << 20;
const SCRATCH_SECTOR: std::ops::Range<usize> = 512..1024;

fn arg(path: &Path) -> &str {
    path.to_str().expect("UTF-8 path")
}

fn disk_image(path: &Path) -> Vec<u8> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut bytes: Vec<u8> = (0..IMAGE_SIZE)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect();
    bytes[..8].copy_from_slice(b"GPUVMBLK");
    std::fs::write(path, &bytes).unwrap();
    bytes
}

/// FNV-1a of the image without the scratch sector.
fn hash_outside_scratch(bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .enumerate()
        .filter(|(at, _)| !SCRATCH_SECTOR.contains(at))
        .fold(0xcbf2_9ce4_8422_2325u64, |hash, (_, &byte)| {
            (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
        })
}

/// The `overhead_kib` of the `--report-memory` line.
fn overhead_kib(out: &RunOutput) -> u64 {
    out.stderr
        .lines()
        .find_map(|line| line.strip_prefix("gpuvm: memory "))
        .and_then(|line| {
            line.split_whitespace()
                .find_map(|kv| kv.strip_prefix("overhead_kib="))
        })
        .and_then(|value| value.parse().ok())
        .unwrap_or_else(|| panic!("no memory report\n{}", out.describe()))
}

/// CPU time (user + system) per thread of `pid`, with the thread's name.
fn thread_cpu(pid: i32) -> Vec<(u32, String, Duration)> {
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    let mut threads = Vec::new();
    for task in tasks.flatten() {
        let Ok(tid) = task.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
            continue;
        };
        // pid (comm) state ppid ... utime(14) stime(15): comm may hold spaces.
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let name = stat[open + 1..close].to_string();
        let fields: Vec<&str> = stat[close + 2..].split_whitespace().collect();
        let field = |n: usize| {
            fields
                .get(n)
                .and_then(|f| f.parse::<u64>().ok())
                .unwrap_or(0)
        };
        // fields[0] is the state (field 3), so utime (14) and stime (15) are 11 and 12.
        let cpu = Duration::from_millis((field(11) + field(12)) * 1000 / ticks);
        threads.push((tid, name, cpu));
    }
    threads
}

/// What one hostile run showed.
struct HostileRun {
    out: RunOutput,
    /// The most CPU any device I/O thread used, with its name.
    busiest_device_thread: (String, Duration),
    /// Seccomp mode of every device I/O thread seen while the guest ran.
    device_thread_seccomp: Vec<(String, u32)>,
}

/// Runs `program ARGS` (gpuvm, or `ip netns exec ... gpuvm`), sampling its threads' CPU
/// time until it ends; panics (killing it) after [`KILL_LIMIT`].
fn run_sampled(program: &Path, args: &[&str]) -> HostileRun {
    let mut vm = SpawnedProcess::spawn(program, args);
    let pid = vm.pid();
    let started = Instant::now();
    let mut cpu: HashMap<u32, (String, Duration)> = HashMap::new();
    let mut seccomp = Vec::new();
    while vm.try_status().is_none() {
        if started.elapsed() > KILL_LIMIT {
            vm.signal(libc::SIGKILL);
            let out = vm.wait(Duration::from_secs(10));
            panic!(
                "gpuvm hung: killed after {KILL_LIMIT:?} (a device spinning on a ring never lets its reset end); the last attack line is the one before the hang\n{}",
                tail(&out, 40)
            );
        }
        for (tid, name, used) in thread_cpu(pid) {
            if name.starts_with("virtio-") {
                let entry = cpu.entry(tid).or_insert((name.clone(), used));
                *entry = (name, used.max(entry.1));
            }
        }
        // A device that logs in a loop floods stderr: stop there (with the evidence) rather
        // than hold gigabytes until the kill limit.
        if started.elapsed().as_millis() % 1000 < 50 && vm.stderr().len() > FLOOD_BYTES {
            vm.signal(libc::SIGKILL);
            let out = vm.wait(Duration::from_secs(10));
            panic!(
                "gpuvm logs in a loop (more than {FLOOD_BYTES} bytes of log after {:?}; a device spinning on a ring); the last attack line is the one before it\n{}",
                started.elapsed(),
                tail(&out, 40)
            );
        }
        if seccomp.is_empty() && vm.stdout().contains("virtio-hostile: RAM ends") {
            seccomp = gpuvm_tests::thread_seccomp_modes(pid)
                .into_iter()
                .filter(|(name, _)| name.starts_with("virtio-"))
                .collect();
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = vm.wait(Duration::from_secs(10));
    let busiest_device_thread = cpu
        .into_values()
        .max_by_key(|(_, used)| *used)
        .unwrap_or_default();
    HostileRun {
        out,
        busiest_device_thread,
        device_thread_seccomp: seccomp,
    }
}

/// The status, the last `lines` of stdout and of stderr.
fn tail(out: &RunOutput, lines: usize) -> String {
    let last = |text: &str| {
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    };
    format!(
        "status {:?} after {:?}\n--- stdout (last {lines} lines)\n{}\n--- stderr (last {lines} lines of {})\n{}",
        out.status,
        out.elapsed,
        last(&out.stdout),
        out.stderr.lines().count(),
        last(&out.stderr)
    )
}

/// Everything a hostile run must show, whatever devices it had.
fn assert_survived(run: &HostileRun, devices: &[(&str, u32)]) {
    let out = &run.out;
    eprintln!(
        "virtio_hostile: status {:?} after {:?}, {} log lines, busiest device thread {} with {:?} of CPU",
        out.status,
        out.elapsed,
        out.stderr.lines().count(),
        run.busiest_device_thread.0,
        run.busiest_device_thread.1
    );
    assert!(
        !out.stderr.contains("panicked"),
        "gpuvm panicked\n{}",
        tail(out, 40)
    );
    assert!(
        !out.stdout.contains("FAIL"),
        "the guest found a device misbehaving\n{}",
        tail(out, 40)
    );
    assert_eq!(
        out.code(),
        Some(0),
        "gpuvm or the guest failed\n{}",
        tail(out, 40)
    );
    for (device, attacks) in devices {
        out.assert_stdout_has(&format!(
            "virtio-hostile: {device} survived {attacks} attacks"
        ));
    }
    let total: u32 = devices.iter().map(|(_, attacks)| attacks).sum();
    out.assert_stdout_has(&format!("virtio-hostile: ok attacks={total}"));
    // One line per attack, `virtio-hostile: <device> <attack>: <outcome>` (besides each
    // device's `at 00:NN.0` and `survived N attacks` lines).
    let attack_lines = out
        .stdout
        .lines()
        .filter(|line| {
            devices.iter().any(|(device, _)| {
                line.strip_prefix(&format!("virtio-hostile: {device} "))
                    .is_some_and(|rest| {
                        rest.contains(": ")
                            && !rest.starts_with("at 00:")
                            && !rest.starts_with("survived ")
                    })
            })
        })
        .count();
    assert_eq!(attack_lines, total as usize, "{}", out.stdout);
    assert!(
        out.elapsed < RUN_BOUND,
        "the run took {:?}, more than {RUN_BOUND:?}\n{}",
        out.elapsed,
        tail(out, 20)
    );
    let (thread, cpu) = &run.busiest_device_thread;
    assert!(
        *cpu < device_thread_cpu_bound(out.elapsed),
        "device thread {thread} used {cpu:?} of CPU (a device spinning on a ring)\n{}",
        tail(out, 20)
    );
    let log_lines = out.stderr.lines().count();
    assert!(
        log_lines < MAX_LOG_LINES,
        "{log_lines} log lines (a device logging in a loop)\n{}",
        tail(out, 20)
    );
    assert!(
        !run.device_thread_seccomp.is_empty()
            && run.device_thread_seccomp.iter().all(|(_, mode)| *mode == 2),
        "device threads not all filtered: {:?}",
        run.device_thread_seccomp
    );
}

#[test]
fn a_hostile_guest_gets_errors_never_a_crash_a_hang_or_memory_it_does_not_own() {
    attack_blk_rng_vsock("virtio-hostile", 0);
}

/// Each device also gets a ring whose available index is far ahead, notified 100000 times:
/// whatever the device logs about it must stay rate-limited.
#[test]
fn notifications_of_a_broken_ring_do_not_flood_the_log() {
    attack_blk_rng_vsock("virtio-hostile storm", 1);
}

/// Runs `cmdline` (the workload) against a drive, the entropy device and a socket device;
/// `extra` attacks per device beyond the default ones.
fn attack_blk_rng_vsock(cmdline: &str, extra: u32) {
    let scratch = Scratch::new("virtio_hostile", &cmdline.replace(' ', "-"));
    let image = scratch.path("disk.img");
    let before = disk_image(&image);
    let drive = format!("id=d0,path={}", arg(&image));
    let vsock = format!("cid=3,uds={}", arg(&scratch.path("v.sock")));
    let devices = ["--drive", &drive, "--rng", "--vsock", &vsock];

    // The same devices without the attacks: the RSS baseline (the image is only read).
    let mut baseline_args = vec!["run", "--cmdline", "hello", "--report-memory"];
    baseline_args.extend_from_slice(&devices);
    let baseline = run_gpuvm(&baseline_args, Duration::from_secs(60));
    baseline.assert_code(0);
    let baseline_overhead = overhead_kib(&baseline);

    let mut args = vec!["run", "--cmdline", cmdline, "--report-memory"];
    args.extend_from_slice(&devices);
    let run = run_sampled(&gpuvm_bin(), &args);
    assert_survived(
        &run,
        &[
            ("blk", BLK_ATTACKS + extra),
            ("rng", RNG_ATTACKS + extra),
            ("vsock", VSOCK_ATTACKS + extra),
        ],
    );

    let after = std::fs::read(&image).unwrap();
    assert_eq!(after.len(), before.len(), "the image changed size");
    if hash_outside_scratch(&after) != hash_outside_scratch(&before) {
        let sectors: Vec<usize> = (0..IMAGE_SIZE / 512)
            .filter(|s| after[s * 512..(s + 1) * 512] != before[s * 512..(s + 1) * 512])
            .collect();
        panic!(
            "the image changed outside sector 1: sectors {sectors:?}\n{}",
            tail(&run.out, 60)
        );
    }

    let overhead = overhead_kib(&run.out);
    eprintln!(
        "virtio_hostile: RSS overhead {overhead} KiB, {baseline_overhead} KiB without the attacks"
    );
    assert!(
        overhead <= baseline_overhead + RSS_MARGIN_KIB,
        "gpuvm's RSS beyond guest memory was {overhead} KiB after the attacks, {baseline_overhead} KiB without them"
    );
}

/// A network namespace with a tap `tap0` that is up; deleted on drop.
struct Netns(String);

impl Netns {
    fn create() -> Option<Netns> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: needs root (a network namespace and a tap)");
            return None;
        }
        let name = format!("gpuvm-hostile-{}", std::process::id());
        let ip = |args: &[&str]| {
            Command::new("ip")
                .args(args)
                .output()
                .is_ok_and(|out| out.status.success())
        };
        if !ip(&["netns", "add", &name]) {
            eprintln!("skipped: cannot create a network namespace with ip(8)");
            return None;
        }
        let netns = Netns(name);
        let n = netns.0.as_str();
        assert!(ip(&[
            "-n", n, "tuntap", "add", "dev", "tap0", "mode", "tap"
        ]));
        assert!(ip(&[
            "-n",
            n,
            "addr",
            "add",
            "10.0.251.1/24",
            "dev",
            "tap0"
        ]));
        assert!(ip(&["-n", n, "link", "set", "tap0", "up"]));
        Some(netns)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).output();
    }
}

/// The network device gets the same chain and register attacks, through a real tap.
#[test]
fn a_hostile_guest_against_the_network_device() {
    let Some(netns) = Netns::create() else {
        return;
    };
    let gpuvm: PathBuf = gpuvm_bin();
    let args = [
        "netns",
        "exec",
        &netns.0,
        arg(&gpuvm),
        "run",
        "--cmdline",
        "virtio-hostile",
        "--net",
        "id=eth0,tap=tap0",
    ];
    let run = run_sampled(Path::new("ip"), &args);
    assert_survived(&run, &[("net", NET_ATTACKS)]);
}
