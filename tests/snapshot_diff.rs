//! Snapshots that store less than all of guest memory, and what they restore to: diff
//! snapshots and chains of them (`--track-dirty-pages`), a full snapshot of a VM that is
//! still being restored lazily, recorded working sets, zero pages left out of memory
//! files, and full snapshots that do not allocate guest memory the guest never touched.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use gpuvm_tests::snapshot_support::{
    arg, assert_continues, assert_restored_memloop_completes, copy_dir, field, flip_byte,
    full_then_diff_with_pages, has, iterations, memory_files, memory_header, only_report, restore,
    signal_snapshot, snapshot_memloop_then_exit, u32_at, wait_for_chain, Memloop, GUEST_2_VCPUS,
    LIMIT, STATE_HEADER_LEN, STATE_MAGIC,
};
use gpuvm_tests::{guest_ram_ranges, Scratch, SpawnedProcess};

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

// ---- Diff chains ----

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
    // Pages must come from both files for the restore to prove the chain works (empty
    // diffs stay in the chain, which the restores below must then also read).
    let (base, diff, chain_len) = full_then_diff_with_pages(&mut run, &dir);
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

// ---- Working sets ----

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

// ---- Zero pages are not stored ----

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
