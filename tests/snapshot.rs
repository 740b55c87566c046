//! End-to-end snapshot and restore: a guest that checks its own memory (`memloop`
//! verifies every page the previous iteration wrote) is snapshotted by one gpuvm process
//! and restored by another, in every restore mode, after clean exits, `kill -9` and kills
//! in the middle of writing a snapshot; diff chains; sparse memory files; and every kind
//! of corrupt or unusable snapshot, which must fail with a clear error.
//!
//! The state and memory file formats are decoded here from their documentation
//! (vmm/src/persist.rs, memory/src/snapshot/format.rs), not with gpuvm's own code, so a
//! reader and writer that agree on a wrong format still fail.

use std::collections::BTreeSet;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpuvm_tests::{
    guest_ram_ranges, start_uffd_handler, HugePageReservation, RunOutput, Scratch, SpawnedProcess,
    HUGEPAGE_LOCK,
};

const LIMIT: Duration = Duration::from_secs(240);
const HANDLER: &str = env!("CARGO_BIN_EXE_gpuvm-test-uffd-handler");
const STATE_MAGIC: &[u8; 8] = b"GPUVMSTA";
const STATE_HEADER_LEN: usize = 24;
const MEMORY_MAGIC: &[u8; 8] = b"GPUVMMEM";
const MEMORY_HEADER_LEN: u64 = 128;
const FLAG_DIFF: u32 = 1;
const FLAG_PAGE_CRCS: u32 = 2;
const FLAG_PAGE_CRCS_CHECKED_ON_LOAD: u32 = 4;

fn arg(path: &Path) -> &str {
    path.to_str().expect("UTF-8 path")
}

// ---- The state file: "GPUVMSTA", u32 version, u32 CRC32 of the payload, u64 payload
// length, JSON payload. ----

fn read_state(dir: &Path) -> serde_json::Value {
    let bytes = std::fs::read(dir.join("state")).expect("read state");
    assert!(bytes.len() > STATE_HEADER_LEN, "state file too short");
    assert_eq!(&bytes[..8], STATE_MAGIC, "state magic");
    assert_eq!(u32_at(&bytes, 8), 1, "state format version");
    let payload = &bytes[STATE_HEADER_LEN..];
    assert_eq!(
        u64_at(&bytes, 16),
        payload.len() as u64,
        "state payload length"
    );
    assert_eq!(u32_at(&bytes, 12), crc32fast::hash(payload), "state CRC");
    serde_json::from_slice(payload).expect("state payload is JSON")
}

/// Frames `payload` as a valid state file (correct CRC and length).
fn frame_state(payload: &[u8]) -> Vec<u8> {
    let mut bytes = STATE_MAGIC.to_vec();
    bytes.extend_from_slice(&1u32.to_le_bytes());
    bytes.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
    bytes.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    bytes.extend_from_slice(payload);
    bytes
}

fn write_state(dir: &Path, state: &serde_json::Value) {
    let payload = serde_json::to_vec(state).expect("encode state");
    std::fs::write(dir.join("state"), frame_state(&payload)).expect("write state");
}

fn memory_files(dir: &Path) -> Vec<String> {
    read_state(dir)["memory_files"]
        .as_array()
        .expect("memory_files is a list")
        .iter()
        .map(|f| f.as_str().expect("file name").to_string())
        .collect()
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

// ---- Memory files: a 128-byte header (docs/memory-file-format.md), then the index,
// then page data from data_offset. ----

#[derive(Debug)]
struct MemoryHeader {
    flags: u32,
    page_size: u64,
    ram_size: u64,
    snapshot_id: [u8; 16],
    base_id: [u8; 16],
    generation: u64,
    region_count: u32,
    extent_count: u64,
    data_pages: u64,
    data_offset: u64,
    file_len: u64,
}

impl MemoryHeader {
    fn is_diff(&self) -> bool {
        self.flags & FLAG_DIFF != 0
    }

    /// File offset of the CRC of stored page `index` (the table follows the 24-byte
    /// region and extent entries).
    fn page_crc_offset(&self, index: u64) -> u64 {
        assert_ne!(self.flags & FLAG_PAGE_CRCS, 0, "no page CRCs: {self:?}");
        MEMORY_HEADER_LEN + 24 * (u64::from(self.region_count) + self.extent_count) + 4 * index
    }
}

fn memory_header(path: &Path) -> MemoryHeader {
    let bytes = std::fs::read(path).expect("read memory file");
    assert!(
        bytes.len() as u64 >= MEMORY_HEADER_LEN,
        "memory file too short"
    );
    assert_eq!(&bytes[..8], MEMORY_MAGIC, "memory file magic");
    assert_eq!(u32_at(&bytes, 8), 1, "memory format version");
    assert_eq!(
        u32_at(&bytes, 124),
        crc32fast::hash(&bytes[..124]),
        "memory header CRC"
    );
    MemoryHeader {
        flags: u32_at(&bytes, 16),
        page_size: u64_at(&bytes, 24),
        ram_size: u64_at(&bytes, 32),
        snapshot_id: bytes[40..56].try_into().unwrap(),
        base_id: bytes[56..72].try_into().unwrap(),
        generation: u64_at(&bytes, 72),
        region_count: u32_at(&bytes, 20),
        extent_count: u64_at(&bytes, 80),
        data_pages: u64_at(&bytes, 88),
        data_offset: u64_at(&bytes, 96),
        file_len: bytes.len() as u64,
    }
}

// ---- Guest and gpuvm output ----

/// Iteration numbers of the `memloop: iter N ok` lines, in order.
fn iterations(stdout: &str) -> Vec<u64> {
    stdout
        .lines()
        .filter_map(|line| line.strip_prefix("memloop: iter "))
        .filter_map(|rest| rest.split_whitespace().next()?.parse().ok())
        .collect()
}

/// The `key=value` fields of each line of `text` that starts with `prefix`.
fn reports(text: &str, prefix: &str) -> Vec<Vec<(String, String)>> {
    text.lines()
        .filter(|line| line.starts_with(prefix))
        .map(|line| {
            line.split_whitespace()
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        })
        .collect()
}

fn field(report: &[(String, String)], name: &str) -> i64 {
    report
        .iter()
        .find(|(k, _)| k == name)
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or_else(|| panic!("no numeric {name} in {report:?}"))
}

fn has(report: &[(String, String)], name: &str, value: &str) -> bool {
    report.iter().any(|(k, v)| k == name && v == value)
}

/// The one report line of stderr starting with `prefix`, as fields.
fn only_report(out: &RunOutput, prefix: &str) -> Vec<(String, String)> {
    let mut all = reports(&out.stderr, prefix);
    assert_eq!(
        all.len(),
        1,
        "expected one {prefix:?} line:\n{}",
        out.stderr
    );
    all.remove(0)
}

/// A restored guest really resumed (no reboot) and finished every iteration with every
/// page verified: at least two iterations ran after restore (the one cut by the snapshot
/// and a whole one, which checks every page), consecutively, up to the last.
fn assert_restored_memloop_completes(out: &RunOutput, iters: u64) {
    assert_eq!(
        out.code(),
        Some(0),
        "restored guest failed: {}",
        out.describe()
    );
    assert!(!out.stdout.contains("FAIL"), "{}", out.describe());
    assert!(
        !out.stdout.contains("testguest: ready") && !out.stdout.contains("memloop: cpus="),
        "the guest booted again instead of resuming: {}",
        out.describe()
    );
    assert!(out.stdout.contains("memloop: done"), "{}", out.describe());
    let after = iterations(&out.stdout);
    assert!(
        after.len() >= 2,
        "fewer than 2 iterations after restore: {}",
        out.describe()
    );
    let first = after[0];
    assert_eq!(
        after,
        (first..iters).collect::<Vec<_>>(),
        "iterations after restore are not consecutive up to {}: {}",
        iters - 1,
        out.describe()
    );
}

/// Like [`assert_restored_memloop_completes`], and the output of the snapshotted run
/// followed by the restored one's is exactly one uninterrupted run: nothing lost or
/// repeated across the snapshot, not even a character of a cut line.
fn assert_continues(before: &str, out: &RunOutput, iters: u64) {
    assert_restored_memloop_completes(out, iters);
    let joined = format!("{before}{}", out.stdout);
    assert_eq!(
        iterations(&joined),
        (0..iters).collect::<Vec<_>>(),
        "snapshotted + restored output is not one run:\n--- before\n{before}\n--- after\n{}",
        out.stdout
    );
    assert!(joined.ends_with("memloop: done\n"), "{joined}");
}

fn signal_snapshot(pid: i32) {
    let status = std::process::Command::new(gpuvm_tests::gpuvm_bin())
        .args(["snapshot", "--pid", &pid.to_string()])
        .status()
        .expect("run gpuvm snapshot");
    assert!(status.success(), "gpuvm snapshot --pid {pid}: {status}");
}

/// A memloop guest and its VM.
struct Memloop {
    memory: &'static str,
    size: &'static str,
    vcpus: u8,
    iters: u64,
    backing: &'static str,
    seed: u64,
}

impl Memloop {
    fn args<'a>(&self, cmdline: &'a str, vcpus: &'a str) -> Vec<&'a str> {
        vec![
            "run",
            "--memory",
            self.memory,
            "--vcpus",
            vcpus,
            "--memory-backing",
            self.backing,
            "--cmdline",
            cmdline,
            "--report-timing",
        ]
    }

    fn cmdline(&self) -> String {
        format!("memloop {} {} {}", self.size, self.seed, self.iters)
    }
}

/// Runs `guest`, snapshots it into `dir` after iteration 1 with `gpuvm snapshot --pid`
/// and `--snapshot-then exit`. Returns the run's stdout (everything the guest printed
/// before the snapshot).
fn snapshot_memloop_then_exit(dir: &Path, guest: &Memloop) -> String {
    let (cmdline, vcpus) = (guest.cmdline(), guest.vcpus.to_string());
    let mut args = guest.args(&cmdline, &vcpus);
    args.extend(["--snapshot-dir", arg(dir), "--snapshot-then", "exit"]);
    let mut run = SpawnedProcess::gpuvm(&args);
    run.wait_for_stdout("memloop: iter 1 ok", LIMIT);
    signal_snapshot(run.pid());
    let out = run.wait(LIMIT);
    assert_eq!(out.code(), Some(0), "snapshot run: {}", out.describe());
    assert!(
        !out.stdout.contains("memloop: done"),
        "the guest finished before the snapshot; give it more iterations: {}",
        out.describe()
    );
    let report = only_report(&out, "gpuvm: snapshot ");
    assert!(has(&report, "diff", "false"), "{report:?}");
    let files = memory_files(dir);
    assert_eq!(files.len(), 1, "{files:?}");
    let header = memory_header(&dir.join(&files[0]));
    assert!(!header.is_diff());
    assert_eq!(
        header.file_len,
        field(&report, "bytes") as u64,
        "{report:?}"
    );
    assert_eq!(header.data_pages, field(&report, "data_pages") as u64);
    out.stdout
}

/// Starts a lazy restore of `from` that snapshots into `to` after `after_ms` and exits.
fn restore_lazy_then_snapshot(
    from: &Path,
    to: &Path,
    after_ms: &str,
    extra: &[&str],
) -> SpawnedProcess {
    let mut args = vec![
        "restore",
        "--snapshot",
        arg(from),
        "--restore-mode",
        "lazy",
        "--snapshot-dir",
        arg(to),
        "--snapshot-after-ms",
        after_ms,
        "--snapshot-then",
        "exit",
    ];
    args.extend_from_slice(extra);
    SpawnedProcess::gpuvm(&args)
}

fn restore(dir: &Path, mode: &str, extra: &[&str]) -> RunOutput {
    let mut args = vec![
        "restore",
        "--snapshot",
        arg(dir),
        "--restore-mode",
        mode,
        "--report-timing",
    ];
    args.extend_from_slice(extra);
    SpawnedProcess::gpuvm(&args).wait(LIMIT)
}

/// Lazy restore loaded every data page of the (single, full) memory file exactly once,
/// part of it on demand.
fn assert_lazy_loaded_everything(out: &RunOutput, dir: &Path) {
    let lazy = only_report(out, "gpuvm: lazy ");
    let files = memory_files(dir);
    let header = memory_header(&dir.join(&files[0]));
    assert!(field(&lazy, "faults") > 0, "{lazy:?}");
    assert!(
        field(&lazy, "all_loaded_ms") >= 0,
        "never fully loaded: {lazy:?}"
    );
    assert_eq!(
        (field(&lazy, "bytes_by_faults") + field(&lazy, "bytes_background")) as u64,
        header.data_pages * header.page_size,
        "loaded bytes differ from the file's data: {lazy:?}"
    );
    assert!(field(&lazy, "fault_p50_us") >= 0 && field(&lazy, "fault_p99_us") >= 0);
}

/// `--report-timing`'s per-stage line of a restore: every stage from process start to
/// vCPUs running is there, in order, and they add up to the whole (`total_us`, which is
/// the `process_to_vcpus_running_us` the timing line reports).
fn assert_restore_stages(out: &RunOutput) {
    let stages = only_report(out, "gpuvm: restore-stages ");
    let names: Vec<&str> = stages
        .iter()
        .map(|(k, _)| k.as_str())
        .filter(|k| k.ends_with("_us") && *k != "total_us" && !k.starts_with("parallel_"))
        .collect();
    let expected_order = [
        "process_us",
        "open_kvm_us",
        "state_us",
        "guest_ram_us",
        "create_vm_us",
        "memslots_us",
        "irqchip_pit_us",
        "devices_us",
        "create_vcpus_us",
        "memory_file_wait_us",
        "memory_us",
        "vm_state_us",
        "vcpu_state_us",
        "start_vcpus_us",
    ];
    let positions: Vec<usize> = expected_order
        .iter()
        .map(|name| {
            names
                .iter()
                .position(|n| n == name)
                .unwrap_or_else(|| panic!("no {name} in {stages:?}"))
        })
        .collect();
    assert!(
        positions.windows(2).all(|w| w[0] < w[1]),
        "stages out of order: {stages:?}"
    );
    // Memory-file validation runs on another thread beside the KVM setup (or inline in
    // memory_file_wait when that thread had not started by then).
    if stages.iter().any(|(k, _)| k == "parallel_memory_file_us") {
        assert!(field(&stages, "parallel_memory_file_us") > 0, "{stages:?}");
    }
    let sum: i64 = names.iter().map(|n| field(&stages, n)).sum();
    let total = field(&stages, "total_us");
    assert!(
        (sum - total).abs() <= names.len() as i64,
        "stages add up to {sum} us, total says {total}: {stages:?}"
    );
    let running = field(
        &only_report(out, "gpuvm: timing "),
        "process_to_vcpus_running_us",
    );
    assert!(
        (total - running).abs() <= 2 + total / 100,
        "stages total {total} us, process to vCPUs running {running} us: {stages:?}"
    );
    assert!(
        total > 0
            && stages
                .iter()
                .all(|(k, v)| !k.ends_with("_us") || v.parse::<u64>().is_ok())
    );
}

/// Restores `dir` through the test page-fault handler; returns gpuvm's and the
/// handler's output.
fn restore_external(scratch: &Scratch, dir: &Path, extra: &[&str]) -> (RunOutput, RunOutput) {
    let socket = scratch.path("uffd.sock");
    let handler = start_uffd_handler(Path::new(HANDLER), &socket, dir, &[]);
    let mut args = vec!["--uffd-socket", arg(&socket)];
    args.extend_from_slice(extra);
    let out = restore(dir, "external", &args);
    let handler = handler.wait(Duration::from_secs(30));
    (out, handler)
}

fn assert_handler_served(handler: &RunOutput) {
    assert_eq!(handler.code(), Some(0), "handler: {}", handler.describe());
    assert!(handler.stdout.contains("uffd-handler: gpuvm connected"));
    let stats = reports(&handler.stdout, "uffd-handler: faults=");
    assert_eq!(stats.len(), 1, "{}", handler.describe());
    assert!(
        field(&stats[0], "faults") > 0,
        "the handler served no faults: {stats:?}"
    );
}

// ---- 1. Snapshot mid-run, exit, restore in a new process ----

const GUEST_2_VCPUS: Memloop = Memloop {
    memory: "512M",
    size: "256M",
    vcpus: 2,
    iters: 40,
    backing: "memfd",
    seed: 5,
};

#[test]
fn restore_eager_continues_memloop() {
    let scratch = Scratch::new("snapshot", "eager");
    let dir = scratch.path("snap");
    let before = snapshot_memloop_then_exit(&dir, &GUEST_2_VCPUS);
    let out = restore(&dir, "eager", &[]);
    assert_continues(&before, &out, GUEST_2_VCPUS.iters);
    assert_restore_stages(&out);
    let report = only_report(&out, "gpuvm: restore ");
    assert!(has(&report, "mode", "Eager"), "{report:?}");
    assert!(reports(&out.stderr, "gpuvm: lazy ").is_empty());
}

#[test]
fn restore_lazy_continues_memloop() {
    let scratch = Scratch::new("snapshot", "lazy");
    let dir = scratch.path("snap");
    let before = snapshot_memloop_then_exit(&dir, &GUEST_2_VCPUS);
    let out = restore(&dir, "lazy", &[]);
    assert_continues(&before, &out, GUEST_2_VCPUS.iters);
    assert_lazy_loaded_everything(&out, &dir);
    assert_restore_stages(&out);
}

#[test]
fn restore_external_handler_continues_memloop() {
    let scratch = Scratch::new("snapshot", "external");
    let dir = scratch.path("snap");
    let before = snapshot_memloop_then_exit(&dir, &GUEST_2_VCPUS);
    let (out, handler) = restore_external(&scratch, &dir, &[]);
    assert_continues(&before, &out, GUEST_2_VCPUS.iters);
    assert_handler_served(&handler);
    assert_restore_stages(&out);
}

/// An external handler that dies while the guest still needs pages from it: gpuvm must
/// end with a clear error, promptly. It must neither hang on the faults nobody serves
/// nor let the guest go on with unserved pages reading as zero (memloop would then print
/// FAIL, or even finish).
#[test]
fn external_handler_death_fails_the_restore_cleanly() {
    let scratch = Scratch::new("snapshot", "handler-death");
    let dir = scratch.path("snap");
    snapshot_memloop_then_exit(&dir, &GUEST_2_VCPUS);
    let socket = scratch.path("uffd.sock");
    let handler = start_uffd_handler(
        Path::new(HANDLER),
        &socket,
        &dir,
        &["--die-after-faults", "300"],
    );
    let run = SpawnedProcess::gpuvm(&[
        "restore",
        "--snapshot",
        arg(&dir),
        "--restore-mode",
        "external",
        "--uffd-socket",
        arg(&socket),
    ]);
    let out = run
        .wait_timeout(Duration::from_secs(60))
        .expect("gpuvm hung after the page-fault handler died");
    let handler = handler.wait(Duration::from_secs(30));
    assert_eq!(handler.code(), Some(3), "handler: {}", handler.describe());
    assert!(handler.stdout.contains("uffd-handler: dying after"));
    out.assert_clean_error("page-fault handler exited");
    assert!(!out.stdout.contains("FAIL"), "{}", out.describe());
    assert!(!out.stdout.contains("memloop: done"), "{}", out.describe());
}

/// The same during a snapshot of the restored VM, which faults in every page the handler
/// has not served yet: the snapshot fails with the handler's death as the reason, gpuvm
/// ends with an error (no SIGSEGV, no hang), and no snapshot is left half-written.
#[test]
fn external_handler_death_during_a_snapshot_fails_cleanly() {
    let scratch = Scratch::new("snapshot", "handler-death-snapshot");
    // 128 MiB of RAM, 32 MiB touched by the guest: the guest alone faults well under
    // 20,000 pages; the snapshot's fault-in of all 32,768 pages crosses that.
    let dir = small_snapshot(&scratch);
    let socket = scratch.path("uffd.sock");
    let handler = start_uffd_handler(
        Path::new(HANDLER),
        &socket,
        &dir,
        &["--die-after-faults", "20000"],
    );
    let second = scratch.path("second");
    let run = SpawnedProcess::gpuvm(&[
        "restore",
        "--snapshot",
        arg(&dir),
        "--restore-mode",
        "external",
        "--uffd-socket",
        arg(&socket),
        "--snapshot-dir",
        arg(&second),
        "--snapshot-after-ms",
        "300",
    ]);
    let out = run
        .wait_timeout(Duration::from_secs(60))
        .expect("gpuvm hung after the page-fault handler died during a snapshot");
    let handler = handler.wait(Duration::from_secs(30));
    assert_eq!(handler.code(), Some(3), "handler: {}", handler.describe());
    out.assert_clean_error("page-fault handler exited");
    out.assert_clean_error("while the snapshot was loading guest memory");
    assert!(!out.stdout.contains("FAIL"), "{}", out.describe());
    assert!(
        !second.join("state").exists(),
        "a snapshot was committed without the handler's pages"
    );
}

#[test]
fn restore_lazy_hugetlb_2m_continues_memloop() {
    let _serial = HUGEPAGE_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    // 512 MiB = 256 pages for the snapshotted run, then the same for the restore.
    let _pages = match HugePageReservation::reserve(260) {
        Ok(guard) => guard,
        Err(reason) => {
            eprintln!("SKIPPED restore_lazy_hugetlb_2m_continues_memloop: {reason}");
            return;
        }
    };
    let scratch = Scratch::new("snapshot", "hugetlb");
    let dir = scratch.path("snap");
    let guest = Memloop {
        backing: "hugetlb-2m",
        ..GUEST_2_VCPUS
    };
    let before = snapshot_memloop_then_exit(&dir, &guest);
    let header = memory_header(&dir.join(&memory_files(&dir)[0]));
    assert_eq!(header.page_size, 2 << 20, "{header:?}");
    assert_eq!(read_state(&dir)["config"]["backing"], "hugetlb-2m");
    let out = restore(&dir, "lazy", &[]);
    assert_continues(&before, &out, guest.iters);
    assert_lazy_loaded_everything(&out, &dir);
}

#[test]
fn restore_4_vcpus_in_every_mode() {
    let scratch = Scratch::new("snapshot", "4vcpus");
    let dir = scratch.path("snap");
    let guest = Memloop {
        vcpus: 4,
        ..GUEST_2_VCPUS
    };
    let before = snapshot_memloop_then_exit(&dir, &guest);
    assert_eq!(read_state(&dir)["vcpus"].as_array().map(Vec::len), Some(4));
    // The same snapshot restores any number of times.
    let out = restore(&dir, "eager", &[]);
    assert_continues(&before, &out, guest.iters);
    let out = restore(&dir, "lazy", &[]);
    assert_continues(&before, &out, guest.iters);
    assert_lazy_loaded_everything(&out, &dir);
    let (out, handler) = restore_external(&scratch, &dir, &[]);
    assert_continues(&before, &out, guest.iters);
    assert_handler_served(&handler);
}

#[test]
fn restore_1_vcpu_eager() {
    let scratch = Scratch::new("snapshot", "1vcpu");
    let dir = scratch.path("snap");
    let guest = Memloop {
        memory: "256M",
        size: "128M",
        vcpus: 1,
        ..GUEST_2_VCPUS
    };
    let before = snapshot_memloop_then_exit(&dir, &guest);
    let out = restore(&dir, "eager", &[]);
    assert_continues(&before, &out, guest.iters);
}

// ---- 2. kill -9 after a snapshot ----

#[test]
fn restore_after_kill_9() {
    let scratch = Scratch::new("snapshot", "kill9");
    let dir = scratch.path("snap");
    let guest = GUEST_2_VCPUS;
    let (cmdline, vcpus) = (guest.cmdline(), guest.vcpus.to_string());
    let mut args = guest.args(&cmdline, &vcpus);
    args.extend([
        "--snapshot-dir",
        arg(&dir),
        "--snapshot-after-ms",
        "700",
        "--snapshot-then",
        "resume",
    ]);
    let mut run = SpawnedProcess::gpuvm(&args);
    run.wait_until("the state file", LIMIT, |_| dir.join("state").exists());
    // Let the guest run on after the snapshot, then kill it mid-iteration.
    let seen = iterations(&run.stdout()).len();
    run.wait_until("an iteration after the snapshot", LIMIT, |p| {
        iterations(&p.stdout()).len() > seen
    });
    run.signal(libc::SIGKILL);
    let killed = run.wait(LIMIT);
    assert_eq!(
        killed.status.signal(),
        Some(libc::SIGKILL),
        "{}",
        killed.describe()
    );
    assert!(
        !killed.stdout.contains("memloop: done"),
        "{}",
        killed.describe()
    );

    let out = restore(&dir, "lazy", &[]);
    assert_restored_memloop_completes(&out, guest.iters);
    assert_lazy_loaded_everything(&out, &dir);
    let out = restore(&dir, "eager", &[]);
    assert_restored_memloop_completes(&out, guest.iters);
}

// ---- 3. kill -9 while a snapshot is being written ----

/// When a test kills gpuvm during its second snapshot.
#[derive(Clone, Copy)]
enum KillPoint {
    /// This many milliseconds after asking for the snapshot.
    After(u64),
    /// As soon as a memory file the first snapshot did not name exists (being written).
    MemoryFileAppears,
    /// Once the new state file is committed.
    AfterCommit,
}

/// Whether `dir` holds a memory file (temporary or final) not in `named`.
fn has_new_memory_file(dir: &Path, named: &BTreeSet<String>) -> bool {
    std::fs::read_dir(dir).is_ok_and(|entries| {
        entries.flatten().any(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.contains("memory-") && !named.contains(&name)
        })
    })
}

#[test]
fn kill_9_during_snapshot_keeps_the_previous_one() {
    let scratch = Scratch::new("snapshot", "kill-during");
    let guest = Memloop {
        memory: "768M",
        size: "640M",
        vcpus: 2,
        iters: 14,
        backing: "memfd",
        seed: 11,
    };
    let (cmdline, vcpus) = (guest.cmdline(), guest.vcpus.to_string());
    let mut mid_write = 0;
    let mut outcomes = Vec::new();
    // Kill after fixed delays into the second snapshot, as soon as its memory file
    // appears (always mid-write, however fast this host writes), and right after it
    // commits, so both outcomes are restored.
    let kill_points = [
        KillPoint::After(0),
        KillPoint::After(20),
        KillPoint::After(100),
        KillPoint::After(250),
        KillPoint::After(500),
        KillPoint::MemoryFileAppears,
        KillPoint::AfterCommit,
    ];
    for (n, point) in kill_points.into_iter().enumerate() {
        let label = match point {
            KillPoint::After(ms) => format!("kill {ms} ms into the snapshot"),
            KillPoint::MemoryFileAppears => "kill once the new memory file appears".into(),
            KillPoint::AfterCommit => "kill after the commit".into(),
        };
        let dir = scratch.path(&format!("snap-{n}"));
        let mut args = guest.args(&cmdline, &vcpus);
        args.extend(["--snapshot-dir", arg(&dir), "--snapshot-then", "resume"]);
        let mut run = SpawnedProcess::gpuvm(&args);
        run.wait_for_stdout("memloop: iter 0 ok", LIMIT);
        signal_snapshot(run.pid());
        run.wait_until("the first snapshot", LIMIT, |_| dir.join("state").exists());
        let first_state = std::fs::read(dir.join("state")).expect("state");
        let first_files = memory_files(&dir);
        let seen = iterations(&run.stdout()).len();
        run.wait_until("an iteration after the first snapshot", LIMIT, |p| {
            iterations(&p.stdout()).len() > seen
        });
        signal_snapshot(run.pid());
        match point {
            KillPoint::After(ms) => std::thread::sleep(Duration::from_millis(ms)),
            KillPoint::MemoryFileAppears => {
                let named: BTreeSet<String> = first_files.iter().cloned().collect();
                run.wait_until("the second memory file", LIMIT, |_| {
                    has_new_memory_file(&dir, &named)
                });
            }
            KillPoint::AfterCommit => run.wait_until("the second snapshot", LIMIT, |_| {
                std::fs::read(dir.join("state")).is_ok_and(|now| now != first_state)
            }),
        }
        run.signal(libc::SIGKILL);
        let killed = run.wait(LIMIT);
        assert_eq!(
            killed.status.signal(),
            Some(libc::SIGKILL),
            "{label}: {}",
            killed.describe()
        );

        let state_now = std::fs::read(dir.join("state")).expect("a state file survives");
        let kept_previous = state_now == first_state;
        let named: BTreeSet<String> = memory_files(&dir).into_iter().collect();
        for file in &named {
            assert!(dir.join(file).exists(), "{label}: {file} is gone");
        }
        let leftovers: Vec<String> = std::fs::read_dir(&dir)
            .expect("list dir")
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|name| name != "state" && !named.contains(name))
            .collect();
        if kept_previous {
            assert_eq!(memory_files(&dir), first_files);
            if !leftovers.is_empty() {
                mid_write += 1;
            }
        }
        outcomes.push(format!(
            "{label}: {} snapshot, leftovers {leftovers:?}",
            if kept_previous { "previous" } else { "new" }
        ));

        let out = restore(&dir, "lazy", &[]);
        assert_restored_memloop_completes(&out, guest.iters);
        let _ = std::fs::remove_dir_all(&dir);
    }
    eprintln!("{}", outcomes.join("\n"));
    assert!(
        mid_write >= 1,
        "no kill landed while a memory file was being written; the test proved nothing:\n{}",
        outcomes.join("\n")
    );
}

/// A snapshot killed while writing its memory file leaves a temporary file; the next
/// snapshot into the directory must clean it up, or every interrupted snapshot leaks
/// a guest-RAM-sized file.
#[test]
fn interrupted_snapshot_leaves_no_garbage_after_the_next_one() {
    let scratch = Scratch::new("snapshot", "stale-temp");
    let dir = scratch.path("snap");
    let guest = Memloop {
        memory: "768M",
        size: "640M",
        vcpus: 2,
        iters: 14,
        backing: "memfd",
        seed: 13,
    };
    let (cmdline, vcpus) = (guest.cmdline(), guest.vcpus.to_string());
    let mut args = guest.args(&cmdline, &vcpus);
    args.extend(["--snapshot-dir", arg(&dir), "--snapshot-then", "resume"]);
    let mut run = SpawnedProcess::gpuvm(&args);
    run.wait_for_stdout("memloop: iter 0 ok", LIMIT);
    signal_snapshot(run.pid());
    run.wait_until("the first snapshot", LIMIT, |_| dir.join("state").exists());
    signal_snapshot(run.pid());
    // Kill as soon as the second memory file is being written.
    let named: BTreeSet<String> = memory_files(&dir).into_iter().collect();
    run.wait_until("the second memory file", LIMIT, |_| {
        has_new_memory_file(&dir, &named)
    });
    run.signal(libc::SIGKILL);
    drop(run);

    // Restore and snapshot into the same directory: afterwards only the state and the
    // files it names may remain.
    let out = restore(
        &dir,
        "lazy",
        &[
            "--snapshot-dir",
            arg(&dir),
            "--snapshot-after-ms",
            "300",
            "--snapshot-then",
            "exit",
        ],
    );
    assert_eq!(out.code(), Some(0), "{}", out.describe());
    let named: BTreeSet<String> = memory_files(&dir).into_iter().collect();
    let garbage: Vec<String> = std::fs::read_dir(&dir)
        .expect("list")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name != "state" && !named.contains(name))
        .collect();
    assert!(garbage.is_empty(), "left behind: {garbage:?}");
}

// ---- 4. Diff chains ----

/// Waits until the state in `dir` names `count` memory files.
fn wait_for_chain(run: &mut SpawnedProcess, dir: &Path, count: usize) {
    run.wait_until(&format!("a state with {count} memory files"), LIMIT, |_| {
        dir.join("state").exists() && memory_files(dir).len() == count
    });
}

#[test]
fn diff_snapshot_of_an_idle_guest_is_small() {
    let scratch = Scratch::new("snapshot", "diff-idle");
    let dir = scratch.path("snap");
    let mut run = SpawnedProcess::gpuvm(&[
        "run",
        "--memory",
        "512M",
        "--cmdline",
        "zerofill 256M",
        "--track-dirty-pages",
        "--snapshot-dir",
        arg(&dir),
        "--snapshot-then",
        "resume",
    ]);
    // After zerofill the guest only spins: it writes nothing between the snapshots.
    run.wait_for_stdout("zerofill: done", LIMIT);
    signal_snapshot(run.pid());
    wait_for_chain(&mut run, &dir, 1);
    signal_snapshot(run.pid());
    wait_for_chain(&mut run, &dir, 2);
    run.signal(libc::SIGKILL);
    drop(run);

    let files = memory_files(&dir);
    let base = memory_header(&dir.join(&files[0]));
    let diff = memory_header(&dir.join(&files[1]));
    assert!(!base.is_diff() && diff.is_diff(), "{base:?}\n{diff:?}");
    assert_eq!(diff.base_id, base.snapshot_id);
    assert_eq!((base.generation, diff.generation), (0, 1));
    assert_eq!(diff.ram_size, base.ram_size);
    assert!(base.data_pages > 0, "{base:?}");
    assert!(
        diff.file_len * 8 <= base.file_len && diff.data_pages * 16 <= base.data_pages.max(16),
        "the diff of an idle guest is not much smaller than the full snapshot:\n{base:?}\n{diff:?}"
    );

    // Restore base + diff, take a third snapshot from the restored VM into the same
    // directory: it continues the chain as a diff.
    let mut restored = restore_lazy_then_snapshot(&dir, &dir, "500", &["--report-timing"]);
    wait_for_chain(&mut restored, &dir, 3);
    let out = restored.wait(LIMIT);
    assert_eq!(out.code(), Some(0), "{}", out.describe());
    let report = only_report(&out, "gpuvm: snapshot ");
    assert!(has(&report, "diff", "true"), "{report:?}");
    let chain = memory_files(&dir);
    assert_eq!(&chain[..2], &files[..]);
    let third = memory_header(&dir.join(&chain[2]));
    assert!(third.is_diff() && third.generation == 2 && third.base_id == diff.snapshot_id);

    // The three-file chain restores (eagerly this time) and runs until told to stop.
    let other = scratch.path("after-chain");
    let out = restore(
        &dir,
        "eager",
        &[
            "--snapshot-dir",
            arg(&other),
            "--snapshot-after-ms",
            "300",
            "--snapshot-then",
            "exit",
        ],
    );
    assert_eq!(out.code(), Some(0), "{}", out.describe());
    // A snapshot into another directory starts a new chain with a full file.
    assert_eq!(memory_files(&other).len(), 1);
    assert!(!memory_header(&other.join(&memory_files(&other)[0])).is_diff());
}

#[test]
fn diff_chain_restores_memory_contents() {
    let scratch = Scratch::new("snapshot", "diff-memloop");
    let dir = scratch.path("snap");
    // The diff holds what memloop rewrote between the snapshots (on this host, most of
    // its 768 MiB); the guest's image and page tables, written only at boot, stay in the
    // base, so the restores below read pages from every file of the chain.
    let guest = Memloop {
        memory: "1024M",
        size: "768M",
        vcpus: 1,
        iters: 12,
        backing: "memfd",
        seed: 3,
    };
    let (cmdline, vcpus) = (guest.cmdline(), guest.vcpus.to_string());
    let mut args = guest.args(&cmdline, &vcpus);
    args.extend([
        "--track-dirty-pages",
        "--snapshot-dir",
        arg(&dir),
        "--snapshot-then",
        "resume",
    ]);
    let mut run = SpawnedProcess::gpuvm(&args);
    run.wait_for_stdout("memloop: iter 0 ok", LIMIT);
    signal_snapshot(run.pid());
    wait_for_chain(&mut run, &dir, 1);
    // Pages must come from both files for the restore to prove the chain works. On a
    // loaded host the second request can pause the vCPU before it has run again since
    // the first snapshot resumed it, and that diff is (rightly) empty: take diffs until
    // one holds pages. Each empty one is checked to be a valid diff and stays in the
    // chain, which the restores below must then also read.
    let base = memory_header(&dir.join(&memory_files(&dir)[0]));
    let mut previous_id = base.snapshot_id;
    let mut chain_len = 1;
    let diff = loop {
        signal_snapshot(run.pid());
        chain_len += 1;
        wait_for_chain(&mut run, &dir, chain_len);
        let diff = memory_header(&dir.join(&memory_files(&dir)[chain_len - 1]));
        assert!(
            diff.is_diff()
                && diff.base_id == previous_id
                && diff.generation as usize == chain_len - 1,
            "{diff:?}"
        );
        if diff.data_pages > 0 || chain_len == 6 {
            break diff;
        }
        previous_id = diff.snapshot_id;
    };
    run.signal(libc::SIGKILL);
    let killed = run.wait(LIMIT);
    assert!(
        !killed.stdout.contains("memloop: done"),
        "{}",
        killed.describe()
    );
    assert!(
        diff.data_pages > 0 && diff.data_pages < base.data_pages,
        "the guest ran between snapshots, so a diff should hold some but not all pages:\n{base:?}\n{diff:?}"
    );

    // Restore base + diff and snapshot again into the chain mid-run (exit there)...
    let mut restored = SpawnedProcess::gpuvm(&[
        "restore",
        "--snapshot",
        arg(&dir),
        "--restore-mode",
        "lazy",
        "--snapshot-dir",
        arg(&dir),
        "--snapshot-then",
        "exit",
        "--report-timing",
    ]);
    restored.wait_until("an iteration after restore", LIMIT, |p| {
        iterations(&p.stdout()).len() >= 2
    });
    signal_snapshot(restored.pid());
    let middle = restored.wait(LIMIT);
    assert_eq!(middle.code(), Some(0), "{}", middle.describe());
    assert!(
        !middle.stdout.contains("memloop: done"),
        "{}",
        middle.describe()
    );
    assert!(!middle.stdout.contains("FAIL"), "{}", middle.describe());
    assert_eq!(memory_files(&dir).len(), chain_len + 1);

    // ...then restore the whole chain: the guest verifies every page once more.
    let out = restore(&dir, "eager", &[]);
    assert_restored_memloop_completes(&out, guest.iters);
    let joined = format!("{}{}", middle.stdout, out.stdout);
    let all = iterations(&joined);
    let first = all[0];
    assert_eq!(all, (first..guest.iters).collect::<Vec<_>>(), "{joined}");
}

#[test]
fn full_snapshot_of_a_lazily_restored_vm() {
    // A full snapshot reads all guest memory, including pages the lazy loader has not
    // brought in yet.
    let scratch = Scratch::new("snapshot", "resnapshot");
    let dir = scratch.path("first");
    let second = scratch.path("second");
    let before = snapshot_memloop_then_exit(&dir, &GUEST_2_VCPUS);
    let restored = restore_lazy_then_snapshot(&dir, &second, "1", &[]);
    let middle = restored
        .wait_timeout(LIMIT)
        .expect("restore + snapshot ended");
    assert_eq!(middle.code(), Some(0), "{}", middle.describe());
    let joined = format!("{before}{}", middle.stdout);
    let out = restore(&second, "lazy", &[]);
    assert_continues(&joined, &out, GUEST_2_VCPUS.iters);
}

/// The `working-set` file in `dir` (framed like the state file): the hex id of the memory
/// file it was recorded for, and its blocks.
fn read_working_set(dir: &Path) -> (String, Vec<u64>) {
    let bytes = std::fs::read(dir.join("working-set")).expect("read working-set");
    assert_eq!(&bytes[..8], STATE_MAGIC, "working-set magic");
    let payload = &bytes[STATE_HEADER_LEN..];
    assert_eq!(
        u32_at(&bytes, 12),
        crc32fast::hash(payload),
        "working-set CRC"
    );
    let file: serde_json::Value = serde_json::from_slice(payload).expect("JSON");
    assert_eq!(file["block_size"], 2 << 20, "{file}");
    let blocks = file["blocks"]
        .as_array()
        .expect("blocks")
        .iter()
        .map(|v| v.as_u64().expect("block addresses"))
        .collect();
    (
        file["memory_file_id"].as_str().expect("id").to_string(),
        blocks,
    )
}

fn hex(id: &[u8; 16]) -> String {
    id.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn a_recorded_working_set_loads_first_on_the_next_restore() {
    const BLOCK: u64 = 2 << 20;
    let scratch = Scratch::new("snapshot", "workingset");
    let dir = scratch.path("snap");
    let before = snapshot_memloop_then_exit(&dir, &GUEST_2_VCPUS);
    assert!(!dir.join("working-set").exists());

    // The first restore records what its guest faulted on.
    let first = restore(&dir, "lazy", &["--record-working-set"]);
    assert_continues(&before, &first, GUEST_2_VCPUS.iters);
    let (recorded_for, blocks) = read_working_set(&dir);
    let header = memory_header(&dir.join(&memory_files(&dir)[0]));
    assert_eq!(recorded_for, hex(&header.snapshot_id));
    assert!(!blocks.is_empty(), "no working set recorded");
    let ram = guest_ram_ranges(512 << 20);
    let mut seen = BTreeSet::new();
    for &block in &blocks {
        assert_eq!(block % BLOCK, 0, "{block:#x} is not a 2 MiB block");
        assert!(seen.insert(block), "{block:#x} recorded twice");
        assert!(
            ram.iter().any(|&(at, len)| block >= at && block < at + len),
            "{block:#x} is outside guest RAM {ram:x?}"
        );
    }

    // The next restore of the same snapshot loads those blocks first (the background
    // loader starts on them before the vCPUs run), and the guest is still right.
    let second = restore(
        &dir,
        "lazy",
        &["--log-level", "info", "--record-working-set"],
    );
    assert_continues(&before, &second, GUEST_2_VCPUS.iters);
    assert!(
        second.stderr.contains(&format!(
            "lazy restore: {} working-set blocks",
            blocks.len()
        )),
        "{}",
        second.describe()
    );
    let lazy = only_report(&second, "gpuvm: lazy ");
    assert!(field(&lazy, "bytes_working_set") > 0, "{lazy:?}");
    // Recording again keeps what was loaded first (the guest did not fault there), then
    // adds what it still faulted on.
    let (_, again) = read_working_set(&dir);
    assert_eq!(again[..blocks.len()], blocks[..]);

    // Advice only: a damaged file is ignored with a warning, the restore goes on.
    let damaged = scratch.path("damaged");
    copy_dir(&dir, &damaged);
    flip_byte(&damaged.join("working-set"), 40);
    let out = restore(&damaged, "lazy", &[]);
    assert_continues(&before, &out, GUEST_2_VCPUS.iters);
    assert!(
        out.stderr.contains("ignoring the working set"),
        "{}",
        out.describe()
    );
    assert_eq!(
        field(&only_report(&out, "gpuvm: lazy "), "bytes_working_set"),
        0
    );

    // A new snapshot into the directory replaces the one the working set was for: gone.
    let snapshotted = restore_lazy_then_snapshot(&dir, &dir, "20", &[])
        .wait_timeout(LIMIT)
        .expect("restore + snapshot ended");
    assert_eq!(snapshotted.code(), Some(0), "{}", snapshotted.describe());
    assert!(!dir.join("working-set").exists(), "stale working set kept");
}

// ---- 6. Zero pages are not stored ----

#[test]
fn zero_pages_are_not_stored() {
    let scratch = Scratch::new("snapshot", "zero");
    let dir = scratch.path("snap");
    let mut run = SpawnedProcess::gpuvm(&[
        "run",
        "--memory",
        "512M",
        "--cmdline",
        "zerofill 256M",
        "--snapshot-dir",
        arg(&dir),
        "--snapshot-then",
        "exit",
        "--report-timing",
    ]);
    run.wait_for_stdout("zerofill: done", LIMIT);
    signal_snapshot(run.pid());
    let out = run.wait(LIMIT);
    assert_eq!(out.code(), Some(0), "{}", out.describe());
    let report = only_report(&out, "gpuvm: snapshot ");
    let files = memory_files(&dir);
    let header = memory_header(&dir.join(&files[0]));
    // The guest wrote 256 MiB and zeroed it again: only its own pages hold data.
    assert!(
        header.file_len < 32 << 20,
        "memory file is {} bytes: {header:?}",
        header.file_len
    );
    assert_eq!(
        header.file_len,
        header.data_offset + header.data_pages * header.page_size
    );
    assert!(header.data_offset < 1 << 20, "{header:?}");
    assert_eq!(field(&report, "data_pages") as u64, header.data_pages);
    assert_eq!(field(&report, "bytes") as u64, header.file_len);

    // Restored, the zero pages stay holes in guest RAM (lazily loaded or not).
    for mode in ["eager", "lazy"] {
        let mut restored =
            SpawnedProcess::gpuvm(&["restore", "--snapshot", arg(&dir), "--restore-mode", mode]);
        std::thread::sleep(Duration::from_millis(1500));
        let resident_kib = shmem_resident_kib(restored.pid());
        assert!(
            restored.try_status().is_none(),
            "{mode}: the restored guest ended: {}",
            restored.stderr()
        );
        restored.signal(libc::SIGKILL);
        assert!(
            resident_kib < 32 * 1024,
            "{mode} restore allocated {resident_kib} KiB of guest RAM for {} data pages",
            header.data_pages
        );
    }
}

/// Guest RAM (a memfd, shared memory) resident in process `pid`.
fn shmem_resident_kib(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("RssShmem:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("RssShmem in /proc/PID/status")
}

/// Reading guest RAM for a full snapshot must not allocate the pages the guest never
/// touched (a read fault on a shared memfd hole allocates a page).
#[test]
fn full_snapshot_does_not_allocate_untouched_guest_memory() {
    let scratch = Scratch::new("snapshot", "scan-allocates");
    let dir = scratch.path("snap");
    let mut run = SpawnedProcess::gpuvm(&[
        "run",
        "--memory",
        "512M",
        "--cmdline",
        "zerofill 16M",
        "--snapshot-dir",
        arg(&dir),
        "--snapshot-then",
        "exit",
        "--report-memory",
    ]);
    run.wait_for_stdout("zerofill: done", LIMIT);
    signal_snapshot(run.pid());
    let out = run.wait(LIMIT);
    assert_eq!(out.code(), Some(0), "{}", out.describe());
    let memory = only_report(&out, "gpuvm: memory ");
    assert!(
        field(&memory, "guest_resident_kib") < 64 * 1024,
        "taking the snapshot allocated untouched guest RAM: {memory:?}"
    );
}

/// The test oracle itself: a page restored with the wrong content (but a consistent
/// file, all CRCs recomputed) is caught by the guest's own verification.
#[test]
fn guest_detects_a_wrong_page_after_restore() {
    let scratch = Scratch::new("snapshot", "oracle");
    let good = small_snapshot(&scratch);
    let path = good.join(&memory_files(&good)[0]);
    let header = memory_header(&path);
    let mut bytes = std::fs::read(&path).expect("read");
    // The middle data page: with 32 MiB of memloop data in the file, it is a memloop page.
    let page = header.data_pages / 2;
    let at = (header.data_offset + page * header.page_size) as usize;
    bytes[at + 8] ^= 1;
    let index_start = MEMORY_HEADER_LEN as usize;
    let crcs_start = header.page_crc_offset(0) as usize;
    let crc = crc32fast::hash(&bytes[at..at + header.page_size as usize]);
    let crc_at = crcs_start + page as usize * 4;
    bytes[crc_at..crc_at + 4].copy_from_slice(&crc.to_le_bytes());
    // The index CRC covers the page CRCs only in files without FLAG_PAGE_CRCS_CHECKED_ON_LOAD.
    let index_end = if header.flags & FLAG_PAGE_CRCS_CHECKED_ON_LOAD != 0 {
        crcs_start
    } else {
        crcs_start + header.data_pages as usize * 4
    };
    let index_crc = crc32fast::hash(&bytes[index_start..index_end]);
    bytes[120..124].copy_from_slice(&index_crc.to_le_bytes());
    let header_crc = crc32fast::hash(&bytes[..124]);
    bytes[124..128].copy_from_slice(&header_crc.to_le_bytes());
    std::fs::write(&path, bytes).expect("write");

    for mode in ["eager", "lazy"] {
        let out = restore(&good, mode, &[]);
        assert_eq!(out.code(), Some(1), "{mode}: {}", out.describe());
        assert!(
            out.stdout.contains("memloop: FAIL"),
            "{mode}: {}",
            out.describe()
        );
    }
}

// ---- 5. Corrupt and unusable snapshots ----

/// A small valid snapshot to corrupt copies of.
fn small_snapshot(scratch: &Scratch) -> PathBuf {
    let dir = scratch.path("good");
    let guest = Memloop {
        memory: "128M",
        size: "32M",
        vcpus: 1,
        iters: 150,
        backing: "memfd",
        seed: 1,
    };
    snapshot_memloop_then_exit(&dir, &guest);
    dir
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for entry in std::fs::read_dir(from).expect("list").flatten() {
        std::fs::copy(entry.path(), to.join(entry.file_name())).expect("copy");
    }
}

fn flip_byte(path: &Path, at: u64) {
    use std::os::unix::fs::FileExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .expect("open");
    let mut byte = [0u8];
    file.read_exact_at(&mut byte, at).expect("read");
    byte[0] ^= 0xff;
    file.write_all_at(&byte, at).expect("write");
}

/// Writes a valid, empty (all-zero) full memory file for a guest of `ram_size` bytes
/// with gpuvm's layout: to build states that are consistent but unusable on this host.
fn write_empty_memory_file(path: &Path, ram_size: u64) {
    let regions = gpuvm_arch::x86_64::layout::ram_regions(ram_size);
    let mut metadata = Vec::new();
    for r in &regions {
        metadata.extend_from_slice(&r.guest_addr.to_le_bytes());
        metadata.extend_from_slice(&r.size.to_le_bytes());
        metadata.extend_from_slice(&r.file_offset.to_le_bytes());
    }
    let data_offset = (MEMORY_HEADER_LEN + metadata.len() as u64).div_ceil(4096) * 4096;
    let mut header = vec![0u8; MEMORY_HEADER_LEN as usize];
    header[..8].copy_from_slice(MEMORY_MAGIC);
    header[8..12].copy_from_slice(&1u32.to_le_bytes()); // version
    header[12..16].copy_from_slice(&128u32.to_le_bytes()); // header length
    header[16..20].copy_from_slice(&0u32.to_le_bytes()); // flags: full, no page CRCs
    header[20..24].copy_from_slice(&(regions.len() as u32).to_le_bytes());
    header[24..32].copy_from_slice(&4096u64.to_le_bytes());
    header[32..40].copy_from_slice(&ram_size.to_le_bytes());
    header[40..56].copy_from_slice(&[0x5a; 16]); // snapshot id
                                                 // base id 0, generation 0, 0 extents, 0 data pages
    header[96..104].copy_from_slice(&data_offset.to_le_bytes());
    header[120..124].copy_from_slice(&crc32fast::hash(&metadata).to_le_bytes());
    let crc = crc32fast::hash(&header[..124]);
    header[124..128].copy_from_slice(&crc.to_le_bytes());
    let mut bytes = header;
    bytes.extend_from_slice(&metadata);
    bytes.resize(data_offset as usize, 0);
    std::fs::write(path, bytes).expect("write memory file");
}

/// One corruption: what to do to a copy of the good snapshot, which restore mode to
/// use, and a piece of the error gpuvm must print.
struct Corruption {
    name: &'static str,
    corrupt: Box<dyn Fn(&Path)>,
    mode: &'static str,
    error: &'static str,
}

fn edit_state(edit: impl Fn(&mut serde_json::Value) + 'static) -> Box<dyn Fn(&Path)> {
    Box::new(move |dir: &Path| {
        let mut state = read_state(dir);
        edit(&mut state);
        write_state(dir, &state);
    })
}

fn on_memory_file(action: impl Fn(&Path) + 'static) -> Box<dyn Fn(&Path)> {
    Box::new(move |dir: &Path| action(&dir.join(&memory_files(dir)[0])))
}

fn corruptions() -> Vec<Corruption> {
    let case = |name, mode, error, corrupt: Box<dyn Fn(&Path)>| Corruption {
        name,
        corrupt,
        mode,
        error,
    };
    let state_bytes = |edit: fn(&mut Vec<u8>)| -> Box<dyn Fn(&Path)> {
        Box::new(move |dir: &Path| {
            let path = dir.join("state");
            let mut bytes = std::fs::read(&path).expect("read state");
            edit(&mut bytes);
            std::fs::write(&path, bytes).expect("write state");
        })
    };
    vec![
        case(
            "state: wrong magic",
            "lazy",
            "not a gpuvm state file",
            state_bytes(|b| b[0..8].copy_from_slice(b"NOTSTATE")),
        ),
        case(
            "state: unknown version",
            "lazy",
            "version 7",
            state_bytes(|b| b[8..12].copy_from_slice(&7u32.to_le_bytes())),
        ),
        case(
            "state: payload byte flipped",
            "eager",
            "CRC mismatch",
            state_bytes(|b| {
                let at = b.len() / 2;
                b[at] ^= 0x20
            }),
        ),
        case(
            "state: truncated",
            "lazy",
            "truncated",
            state_bytes(|b| b.truncate(b.len() / 2)),
        ),
        case(
            "state: shorter than its header",
            "lazy",
            "not a gpuvm state file",
            state_bytes(|b| b.truncate(10)),
        ),
        case(
            "state: empty",
            "lazy",
            "not a gpuvm state file",
            state_bytes(|b| b.clear()),
        ),
        case(
            "state: trailing garbage",
            "lazy",
            "trailing data",
            state_bytes(|b| b.extend_from_slice(b"xx")),
        ),
        case(
            "state: missing",
            "lazy",
            "cannot read state file",
            Box::new(|dir: &Path| std::fs::remove_file(dir.join("state")).unwrap()),
        ),
        case(
            "state: valid CRC, not JSON",
            "lazy",
            "is corrupt",
            state_bytes(|b| {
                let framed = frame_state(b"{not json");
                *b = framed
            }),
        ),
        case(
            "state: valid CRC, a field missing",
            "lazy",
            "is corrupt",
            edit_state(|s| {
                s["config"].as_object_mut().unwrap().remove("vcpus");
            }),
        ),
        case(
            "memory: truncated",
            "lazy",
            "truncated",
            on_memory_file(|p| {
                let len = std::fs::metadata(p).unwrap().len();
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(p)
                    .unwrap()
                    .set_len(len - 4096 * 3)
                    .unwrap();
            }),
        ),
        case(
            "memory: truncated inside the index",
            "eager",
            "truncated",
            on_memory_file(|p| {
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(p)
                    .unwrap()
                    .set_len(MEMORY_HEADER_LEN + 10)
                    .unwrap();
            }),
        ),
        case(
            "memory: wrong magic",
            "lazy",
            "not a gpuvm memory file",
            on_memory_file(|p| flip_byte(p, 0)),
        ),
        case(
            "memory: header CRC",
            "lazy",
            "header CRC mismatch",
            on_memory_file(|p| flip_byte(p, 33)),
        ),
        case(
            "memory: index CRC",
            "eager",
            "index CRC mismatch",
            on_memory_file(|p| flip_byte(p, MEMORY_HEADER_LEN + 9)),
        ),
        case(
            "memory: data page CRC (eager)",
            "eager",
            "data CRC mismatch",
            on_memory_file(|p| {
                let header = memory_header(p);
                flip_byte(p, header.data_offset + header.page_size * 3 + 17)
            }),
        ),
        case(
            "memory: file missing",
            "lazy",
            "No such file",
            on_memory_file(|p| std::fs::remove_file(p).unwrap()),
        ),
        case(
            "memory: state names no file",
            "lazy",
            "names no memory file",
            edit_state(|s| s["memory_files"] = serde_json::json!([])),
        ),
        case(
            "memory: state names a file outside the directory",
            "lazy",
            "outside the snapshot directory",
            edit_state(|s| s["memory_files"] = serde_json::json!(["../../etc/passwd"])),
        ),
        case(
            "config: 0 vCPUs",
            "lazy",
            "0 configured vCPUs",
            edit_state(|s| s["config"]["vcpus"] = 0.into()),
        ),
        case(
            "config: more vCPUs than states",
            "lazy",
            "1 vCPU states for 2 configured",
            edit_state(|s| s["config"]["vcpus"] = 2.into()),
        ),
        case(
            "config: 255 vCPUs with 255 states (more than the host allows)",
            "lazy",
            "invalid vCPU count",
            edit_state(|s| {
                let one = s["vcpus"][0].clone();
                s["vcpus"] = (0..255)
                    .map(|id| {
                        let mut v = one.clone();
                        v["id"] = id.into();
                        v
                    })
                    .collect();
                s["config"]["vcpus"] = 255.into();
            }),
        ),
        case(
            "config: memory size differs from the memory file",
            "lazy",
            "size mismatch",
            edit_state(|s| s["config"]["memory_size"] = (256u64 << 20).into()),
        ),
        case(
            "config: 1 TiB of guest memory (more than the host has)",
            "lazy",
            "larger than this host",
            Box::new(|dir: &Path| {
                let tib = 1u64 << 40;
                write_empty_memory_file(&dir.join("memory-1"), tib);
                let mut state = read_state(dir);
                state["config"]["memory_size"] = tib.into();
                state["memory_files"] = serde_json::json!(["memory-1"]);
                state["memory_file_id"] = "5a".repeat(16).into();
                write_state(dir, &state);
            }),
        ),
        case(
            "config: huge pages the memory file was not taken with",
            "lazy",
            "page size mismatch",
            edit_state(|s| s["config"]["backing"] = "hugetlb-2m".into()),
        ),
        case(
            "config: unknown backing",
            "lazy",
            "unknown memory backing",
            edit_state(|s| s["config"]["backing"] = "tape".into()),
        ),
        case(
            "config: unknown CPUID mask",
            "lazy",
            "bogus",
            edit_state(|s| s["config"]["cpuid_masks"] = serde_json::json!(["bogus"])),
        ),
        case(
            "external: no handler at the socket",
            "external",
            "page-fault handler",
            Box::new(|_: &Path| {}),
        ),
    ]
}

#[test]
fn corrupt_snapshots_fail_cleanly() {
    let scratch = Scratch::new("snapshot", "corrupt");
    let good = small_snapshot(&scratch);
    let mut failures = Vec::new();
    for (index, case) in corruptions().into_iter().enumerate() {
        let dir = scratch.path(&format!("case-{index}"));
        copy_dir(&good, &dir);
        (case.corrupt)(&dir);
        let socket = scratch.path("no-such-handler.sock");
        let mut args = vec![
            "restore",
            "--snapshot",
            arg(&dir),
            "--restore-mode",
            case.mode,
        ];
        if case.mode == "external" {
            args.extend(["--uffd-socket", arg(&socket)]);
        }
        let started = Instant::now();
        let problem = match SpawnedProcess::gpuvm(&args).wait_timeout(Duration::from_secs(60)) {
            None => Some("hung (killed after 60 s)".to_string()),
            Some(out) => {
                let stderr = out.stderr.to_lowercase();
                if out.status.code().is_none() {
                    Some(format!("killed by a signal: {}", out.describe()))
                } else if out.code() == Some(0) {
                    Some(format!("succeeded: {}", out.describe()))
                } else if stderr.contains("panicked") {
                    Some(format!("panicked: {}", out.describe()))
                } else if !stderr.contains(&case.error.to_lowercase()) {
                    Some(format!("error lacks {:?}: {}", case.error, out.describe()))
                } else if !out.stdout.is_empty() {
                    Some(format!("the guest ran: {}", out.describe()))
                } else {
                    eprintln!(
                        "ok: {} -> {} ({:?})",
                        case.name,
                        out.stderr.trim(),
                        started.elapsed()
                    );
                    None
                }
            }
        };
        if let Some(problem) = problem {
            failures.push(format!("[{}] {problem}", case.name));
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
    // The good snapshot is still good (the corruptions hit copies only).
    let out = restore(&good, "eager", &[]);
    assert_restored_memloop_completes_or_runs(&out);
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

fn assert_restored_memloop_completes_or_runs(out: &RunOutput) {
    assert_eq!(out.code(), Some(0), "{}", out.describe());
    assert!(out.stdout.contains("memloop: done") && !out.stdout.contains("FAIL"));
}

#[test]
fn missing_snapshot_directory_fails_cleanly() {
    let scratch = Scratch::new("snapshot", "missing");
    for mode in ["eager", "lazy"] {
        let out = restore(&scratch.path("nothing-here"), mode, &[]);
        out.assert_clean_error("no such snapshot directory");
        assert!(out.stdout.is_empty(), "{}", out.describe());
    }
}

/// A data page whose CRC does not match, found only while the guest runs (lazy restore
/// checks pages as it loads them), must end gpuvm with an error, not leave the guest
/// waiting forever for a page that will never come.
#[test]
fn lazy_restore_of_a_corrupt_page_fails_cleanly() {
    let scratch = Scratch::new("snapshot", "corrupt-lazy");
    let good = small_snapshot(&scratch);
    // A byte of a page's data, or of its CRC (read only when the page loads, so the
    // restore has started before either is found).
    for damage in ["data", "crc"] {
        let dir = scratch.path(damage);
        copy_dir(&good, &dir);
        let file = dir.join(&memory_files(&dir)[0]);
        let header = memory_header(&file);
        let page = header.data_pages / 2;
        flip_byte(
            &file,
            match damage {
                "data" => header.data_offset + header.page_size * page + 5,
                _ => header.page_crc_offset(page) + 2,
            },
        );
        let run =
            SpawnedProcess::gpuvm(&["restore", "--snapshot", arg(&dir), "--restore-mode", "lazy"]);
        let out = run
            .wait_timeout(Duration::from_secs(60))
            .expect("gpuvm hung after the lazy loader found a corrupt page");
        out.assert_clean_error("data CRC mismatch");
    }
}

/// The memory file changes after restore validated it (the test hook holds gpuvm right
/// after validation): truncated, or a data byte flipped. Lazy restore finds out only
/// while the guest runs; gpuvm must then stop with the loader's error, promptly, and the
/// guest must never run on missing or wrong data (memloop would print FAIL). Eager
/// restore reads everything before the guest runs, so it fails before any vCPU starts.
#[test]
fn memory_file_changed_after_validation_fails_cleanly() {
    use std::os::unix::fs::FileExt;
    let scratch = Scratch::new("snapshot", "changed-after-validation");
    let good = small_snapshot(&scratch);
    let truncate = |file: &Path| {
        let header = memory_header(file);
        let keep = header.data_offset + header.page_size * (header.data_pages / 2);
        std::fs::OpenOptions::new()
            .write(true)
            .open(file)
            .and_then(|f| f.set_len(keep))
            .expect("truncate");
    };
    let flip = |file: &Path| {
        let header = memory_header(file);
        let at = header.data_offset + header.page_size * (header.data_pages / 2) + 9;
        flip_byte(file, at);
    };
    let garbage = |file: &Path| {
        // A whole page of different data.
        let header = memory_header(file);
        let at = header.data_offset + header.page_size * (header.data_pages * 3 / 4);
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(file)
            .expect("open");
        f.write_all_at(&vec![0x5au8; header.page_size as usize], at)
            .expect("write");
    };
    type Change = Box<dyn Fn(&Path)>;
    let cases: Vec<(&str, &str, Change, &str)> = vec![
        (
            "lazy-truncated",
            "lazy",
            Box::new(truncate),
            "read page data",
        ),
        ("lazy-flipped", "lazy", Box::new(flip), "data CRC mismatch"),
        (
            "lazy-rewritten",
            "lazy",
            Box::new(garbage),
            "data CRC mismatch",
        ),
        (
            "eager-truncated",
            "eager",
            Box::new(truncate),
            "read page data",
        ),
    ];
    for (name, mode, change, needle) in cases {
        let dir = scratch.path(name);
        copy_dir(&good, &dir);
        let file = dir.join(&memory_files(&dir)[0]);
        let mut run = SpawnedProcess::gpuvm_with_env(
            &["restore", "--snapshot", arg(&dir), "--restore-mode", mode],
            &[("GPUVM_TEST_HOLD_AFTER_VALIDATION", "1500")],
        );
        run.wait_for_stderr("holding", Duration::from_secs(30));
        change(&file);
        let out = run
            .wait_timeout(Duration::from_secs(60))
            .unwrap_or_else(|| panic!("{name}: gpuvm hung after the memory file changed"));
        assert!(
            out.stderr.contains("going on"),
            "{name}: changed too late: {}",
            out.describe()
        );
        out.assert_clean_error(needle);
        assert!(!out.stdout.contains("FAIL"), "{name}: {}", out.describe());
        assert!(
            !out.stdout.contains("memloop: done"),
            "{name}: {}",
            out.describe()
        );
        if mode == "eager" {
            assert!(
                !out.stdout.contains("memloop: iter"),
                "{name}: the guest ran: {}",
                out.describe()
            );
        }
    }
}
