//! Helpers the snapshot tests share (tests/snapshot.rs, snapshot_background.rs,
//! snapshot_diff.rs, snapshot_damage.rs): the state and memory file formats, the memloop
//! guest snapshotted by one gpuvm process and restored by another (or snapshotted twice
//! while it runs on), and gpuvm's report lines.
//!
//! The state and memory file formats are decoded here from their documentation
//! (vmm/src/persist.rs, memory/src/snapshot/format.rs), not with gpuvm's own code, so a
//! reader and writer that agree on a wrong format still fail.

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::{RunOutput, Scratch, SpawnedProcess};

/// How long one gpuvm run or wait in these tests may take.
pub const LIMIT: Duration = Duration::from_secs(240);
pub const STATE_MAGIC: &[u8; 8] = b"GPUVMSTA";
pub const STATE_HEADER_LEN: usize = 24;
/// The state format version gpuvm writes (vmm/src/persist.rs `STATE_FORMAT_VERSION`).
pub const STATE_FORMAT_VERSION: u32 = 2;
pub const MEMORY_MAGIC: &[u8; 8] = b"GPUVMMEM";
pub const MEMORY_HEADER_LEN: u64 = 128;
pub const FLAG_DIFF: u32 = 1;
pub const FLAG_PAGE_CRCS: u32 = 2;
pub const FLAG_PAGE_CRCS_CHECKED_ON_LOAD: u32 = 4;

/// `path` as a command-line argument.
pub fn arg(path: &Path) -> &str {
    path.to_str().expect("UTF-8 path")
}

// ---- The state file: "GPUVMSTA", u32 version, u32 CRC32 of the payload, u64 payload
// length, JSON payload. ----

/// The JSON payload of `dir/state`, after checking its framing.
pub fn read_state(dir: &Path) -> serde_json::Value {
    let bytes = std::fs::read(dir.join("state")).expect("read state");
    assert!(bytes.len() > STATE_HEADER_LEN, "state file too short");
    assert_eq!(&bytes[..8], STATE_MAGIC, "state magic");
    assert_eq!(
        u32_at(&bytes, 8),
        STATE_FORMAT_VERSION,
        "state format version"
    );
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
pub fn frame_state(payload: &[u8]) -> Vec<u8> {
    let mut bytes = STATE_MAGIC.to_vec();
    bytes.extend_from_slice(&STATE_FORMAT_VERSION.to_le_bytes());
    bytes.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
    bytes.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    bytes.extend_from_slice(payload);
    bytes
}

/// Writes `state` as `dir/state`, framed with a correct CRC and length.
pub fn write_state(dir: &Path, state: &serde_json::Value) {
    let payload = serde_json::to_vec(state).expect("encode state");
    std::fs::write(dir.join("state"), frame_state(&payload)).expect("write state");
}

/// The memory files the state in `dir` names, base first.
pub fn memory_files(dir: &Path) -> Vec<String> {
    read_state(dir)["memory_files"]
        .as_array()
        .expect("memory_files is a list")
        .iter()
        .map(|f| f.as_str().expect("file name").to_string())
        .collect()
}

/// The little-endian u32 at `at` in `b`.
pub fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

/// The little-endian u64 at `at` in `b`.
pub fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

// ---- Memory files: a 128-byte header (docs/memory-file-format.md), then the index,
// then page data from data_offset. ----

/// The fields of a memory file's header these tests look at.
#[derive(Debug)]
pub struct MemoryHeader {
    pub flags: u32,
    pub page_size: u64,
    pub ram_size: u64,
    pub snapshot_id: [u8; 16],
    pub base_id: [u8; 16],
    pub generation: u64,
    pub region_count: u32,
    pub extent_count: u64,
    pub data_pages: u64,
    pub data_offset: u64,
    pub file_len: u64,
}

impl MemoryHeader {
    /// Whether the file is a diff on top of another (FLAG_DIFF).
    pub fn is_diff(&self) -> bool {
        self.flags & FLAG_DIFF != 0
    }

    /// File offset of the CRC of stored page `index` (the table follows the 24-byte
    /// region and extent entries).
    pub fn page_crc_offset(&self, index: u64) -> u64 {
        assert_ne!(self.flags & FLAG_PAGE_CRCS, 0, "no page CRCs: {self:?}");
        MEMORY_HEADER_LEN + 24 * (u64::from(self.region_count) + self.extent_count) + 4 * index
    }
}

/// Reads and checks the header of the memory file at `path`.
pub fn memory_header(path: &Path) -> MemoryHeader {
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
pub fn iterations(stdout: &str) -> Vec<u64> {
    stdout
        .lines()
        .filter_map(|line| line.strip_prefix("memloop: iter "))
        .filter_map(|rest| rest.split_whitespace().next()?.parse().ok())
        .collect()
}

/// The `key=value` fields of each line of `text` that starts with `prefix`.
pub fn reports(text: &str, prefix: &str) -> Vec<Vec<(String, String)>> {
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

/// The numeric value of field `name` of a report line; panics if there is none.
pub fn field(report: &[(String, String)], name: &str) -> i64 {
    report
        .iter()
        .find(|(k, _)| k == name)
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or_else(|| panic!("no numeric {name} in {report:?}"))
}

/// Whether a report line has field `name` set to `value`.
pub fn has(report: &[(String, String)], name: &str, value: &str) -> bool {
    report.iter().any(|(k, v)| k == name && v == value)
}

/// The one report line of stderr starting with `prefix`, as fields.
pub fn only_report(out: &RunOutput, prefix: &str) -> Vec<(String, String)> {
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
pub fn assert_restored_memloop_completes(out: &RunOutput, iters: u64) {
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
pub fn assert_continues(before: &str, out: &RunOutput, iters: u64) {
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

/// Asks the gpuvm process `pid` for a snapshot (`gpuvm snapshot --pid`).
pub fn signal_snapshot(pid: i32) {
    let status = std::process::Command::new(crate::gpuvm_bin())
        .args(["snapshot", "--pid", &pid.to_string()])
        .status()
        .expect("run gpuvm snapshot");
    assert!(status.success(), "gpuvm snapshot --pid {pid}: {status}");
}

/// Waits until the state in `dir` names `count` memory files.
pub fn wait_for_chain(run: &mut SpawnedProcess, dir: &Path, count: usize) {
    run.wait_until(&format!("a state with {count} memory files"), LIMIT, |_| {
        dir.join("state").exists() && memory_files(dir).len() == count
    });
}

/// Snapshots the running `run` (whose `--snapshot-dir` is `dir`, `--snapshot-then
/// resume`, with dirty tracking) into a full snapshot, then into diffs until one holds
/// pages, at most 5: on a loaded host a request can pause the vCPUs before they ran again
/// since the last snapshot resumed them, and that diff is (rightly) empty. Each diff is
/// checked to follow the one before (base id, generation) and stays in the chain, which a
/// restore must then read too. Returns the full snapshot's header, the last diff's and
/// the chain's length.
pub fn full_then_diff_with_pages(
    run: &mut SpawnedProcess,
    dir: &Path,
) -> (MemoryHeader, MemoryHeader, usize) {
    signal_snapshot(run.pid());
    wait_for_chain(run, dir, 1);
    let base = memory_header(&dir.join(&memory_files(dir)[0]));
    let mut previous_id = base.snapshot_id;
    let mut chain_len = 1;
    loop {
        signal_snapshot(run.pid());
        chain_len += 1;
        wait_for_chain(run, dir, chain_len);
        let diff = memory_header(&dir.join(&memory_files(dir)[chain_len - 1]));
        assert!(
            diff.is_diff()
                && diff.base_id == previous_id
                && diff.generation as usize == chain_len - 1,
            "{diff:?}"
        );
        if diff.data_pages > 0 || chain_len == 6 {
            return (base, diff, chain_len);
        }
        previous_id = diff.snapshot_id;
    }
}

/// A memloop guest and its VM.
pub struct Memloop {
    pub memory: &'static str,
    pub size: &'static str,
    pub vcpus: u8,
    pub iters: u64,
    pub backing: &'static str,
    pub seed: u64,
}

impl Memloop {
    /// The `gpuvm run` arguments for this guest, with `--report-timing`.
    pub fn args<'a>(&self, cmdline: &'a str, vcpus: &'a str) -> Vec<&'a str> {
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

    /// The guest command line: `memloop SIZE SEED ITERS`.
    pub fn cmdline(&self) -> String {
        format!("memloop {} {} {}", self.size, self.seed, self.iters)
    }
}

/// Runs `guest`, snapshots it into `dir` after iteration 1 with `gpuvm snapshot --pid`
/// and `--snapshot-then exit`. Returns the run's stdout (everything the guest printed
/// before the snapshot).
pub fn snapshot_memloop_then_exit(dir: &Path, guest: &Memloop) -> String {
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

/// Starts `guest` snapshotting into `dir` without stopping (`--snapshot-then resume`, plus
/// `extra`) and asks for its first snapshot once iteration 0 is done.
pub fn start_memloop_and_snapshot(guest: &Memloop, dir: &Path, extra: &[&str]) -> SpawnedProcess {
    let (cmdline, vcpus) = (guest.cmdline(), guest.vcpus.to_string());
    let mut args = guest.args(&cmdline, &vcpus);
    args.extend(["--snapshot-dir", arg(dir), "--snapshot-then", "resume"]);
    args.extend_from_slice(extra);
    let mut run = SpawnedProcess::gpuvm(&args);
    run.wait_for_stdout("memloop: iter 0 ok", LIMIT);
    signal_snapshot(run.pid());
    run
}

/// What a committed snapshot left in its directory.
pub struct CommittedSnapshot {
    /// The state file's bytes.
    pub state: Vec<u8>,
    /// The memory files it names.
    pub memory_files: Vec<String>,
}

/// Waits until the first snapshot of `run` (from [`start_memloop_and_snapshot`]) has
/// committed into `dir`, lets the guest finish one more iteration and asks for a second
/// snapshot; returns what the first one left.
pub fn ask_for_a_second_snapshot(run: &mut SpawnedProcess, dir: &Path) -> CommittedSnapshot {
    run.wait_until("the first snapshot", LIMIT, |_| dir.join("state").exists());
    let first = CommittedSnapshot {
        state: std::fs::read(dir.join("state")).expect("state"),
        memory_files: memory_files(dir),
    };
    let seen = iterations(&run.stdout()).len();
    run.wait_until("an iteration after the first snapshot", LIMIT, |p| {
        iterations(&p.stdout()).len() > seen
    });
    signal_snapshot(run.pid());
    first
}

/// Waits until `dir` holds a memory file (temporary or final) not in `named`: the next
/// snapshot's, being written.
pub fn wait_for_a_new_memory_file(run: &mut SpawnedProcess, dir: &Path, named: &[String]) {
    run.wait_until("the second memory file", LIMIT, |_| {
        std::fs::read_dir(dir).is_ok_and(|entries| {
            entries.flatten().any(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                name.contains("memory-") && !named.contains(&name)
            })
        })
    });
}

/// Kills `run` with SIGKILL and reaps it; it must have died of that signal (`context` for the
/// assertion message).
pub fn kill_9(mut run: SpawnedProcess, context: &str) -> RunOutput {
    run.signal(libc::SIGKILL);
    let killed = run.wait(LIMIT);
    assert_eq!(
        killed.status.signal(),
        Some(libc::SIGKILL),
        "{context}: {}",
        killed.describe()
    );
    killed
}

/// Restores `dir` in `mode` (`--report-timing`, plus `extra`) and waits for the run to end.
pub fn restore(dir: &Path, mode: &str, extra: &[&str]) -> RunOutput {
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

/// The memloop guest most snapshot tests run: 2 vCPUs, 256 MiB checked in 512 MiB.
pub const GUEST_2_VCPUS: Memloop = Memloop {
    memory: "512M",
    size: "256M",
    vcpus: 2,
    iters: 40,
    backing: "memfd",
    seed: 5,
};

/// A small valid snapshot (128 MiB of RAM, 32 MiB of memloop data) in `scratch`'s
/// `good` directory, to corrupt copies of.
pub fn small_snapshot(scratch: &Scratch) -> PathBuf {
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

/// Copies the files of directory `from` into `to` (created if needed).
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for entry in std::fs::read_dir(from).expect("list").flatten() {
        std::fs::copy(entry.path(), to.join(entry.file_name())).expect("copy");
    }
}

/// Inverts the byte at offset `at` of the file at `path`.
pub fn flip_byte(path: &Path, at: u64) {
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
