//! Background snapshots (the default where the host can write-protect guest RAM): the
//! vCPUs pause only while state is saved and RAM is write-protected, and a memloop guest
//! keeps rewriting every page while its memory file is written. The restored guest must
//! see RAM exactly as it was at the pause (memloop verifies every page it wrote the
//! iteration before, and prints a checksum per iteration), a kill -9 during the write must
//! leave the previous snapshot whole, and a writer that fails (a full disk) must leave the
//! VM running.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use gpuvm_tests::snapshot_support::{
    arg, ask_for_a_second_snapshot, assert_restored_memloop_completes, field, iterations, kill_9,
    memory_files, only_report, restore, start_memloop_and_snapshot, wait_for_a_new_memory_file,
    Memloop, LIMIT,
};
use gpuvm_tests::Scratch;

/// 384 MiB rewritten by 2 vCPUs: each iteration takes long enough that the memory file
/// is written while the guest is mid-iteration, writing pages ahead of the writer.
const GUEST: Memloop = Memloop {
    memory: "512M",
    size: "384M",
    vcpus: 2,
    iters: 12,
    backing: "memfd",
    seed: 29,
};

/// The `checksum=` of every `memloop: iter N ok` line, by iteration.
fn checksums(stdout: &str) -> BTreeMap<u64, String> {
    stdout
        .lines()
        .filter_map(|line| line.split_once(" ok checksum="))
        .filter_map(|(head, sum)| {
            let iter = head.split_whitespace().last()?.parse().ok()?;
            Some((iter, sum.trim().to_string()))
        })
        .collect()
}

/// Whether this host writes snapshots in the background (userfaultfd write protection of
/// shared memory); `None` if it does, else why not.
fn unsupported(stderr: &str) -> Option<&str> {
    stderr
        .lines()
        .find(|line| line.contains("cannot write-protect guest RAM"))
}

/// Runs GUEST with a snapshot into `dir` taken after iteration 0 (`extra` added to the
/// run), lets it finish, and returns the run's output and the snapshot's `memory_ms`
/// and `paused_ms`.
fn snapshot_while_running(dir: &Path, extra: &[&str]) -> (gpuvm_tests::RunOutput, i64, i64) {
    let out = start_memloop_and_snapshot(&GUEST, dir, extra).wait(LIMIT);
    assert_eq!(out.code(), Some(0), "{}", out.describe());
    assert!(!out.stdout.contains("FAIL"), "{}", out.describe());
    assert!(out.stdout.contains("memloop: done"), "{}", out.describe());
    let report = only_report(&out, "gpuvm: snapshot ");
    assert!(field(&report, "data_pages") > 0, "{report:?}");
    let times = (field(&report, "memory_ms"), field(&report, "paused_ms"));
    (out, times.0, times.1)
}

#[test]
fn restored_memory_is_ram_at_the_pause_while_the_guest_wrote_on() {
    let scratch = Scratch::new("snapshot-background", "consistent");
    let dir = scratch.path("snap");
    let (original, memory_ms, paused_ms) = snapshot_while_running(&dir, &[]);
    if let Some(reason) = unsupported(&original.stderr) {
        eprintln!("SKIPPED: {reason}");
        return;
    }
    // Written while the guest ran: the pause is shorter than the write (a paused write
    // keeps the vCPUs paused for all of it, see the test below).
    assert!(
        paused_ms < memory_ms,
        "paused {paused_ms} ms for a {memory_ms} ms write: not in the background\n{}",
        original.stderr
    );

    let restored = restore(&dir, "eager", &[]);
    assert_restored_memloop_completes(&restored, GUEST.iters);
    // The restored guest computes the same checksums as the one that ran on: every page
    // it verified held what memloop wrote before the pause, none what it wrote after.
    let before = checksums(&original.stdout);
    let after = checksums(&restored.stdout);
    assert!(after.len() >= 2, "{}", restored.describe());
    for (iter, sum) in &after {
        assert_eq!(
            before.get(iter),
            Some(sum),
            "iteration {iter}: the restored guest's checksum differs\n--- ran on\n{}\n--- restored\n{}",
            original.stdout,
            restored.stdout
        );
    }
}

#[test]
fn snapshot_pause_full_keeps_the_vcpus_paused_for_the_write() {
    let scratch = Scratch::new("snapshot-background", "full");
    let dir = scratch.path("snap");
    let (_, memory_ms, paused_ms) = snapshot_while_running(&dir, &["--snapshot-pause", "full"]);
    assert!(
        paused_ms >= memory_ms,
        "paused {paused_ms} ms, memory {memory_ms} ms"
    );
    let restored = restore(&dir, "lazy", &[]);
    assert_restored_memloop_completes(&restored, GUEST.iters);
}

#[test]
fn kill_9_during_a_background_write_keeps_the_previous_snapshot() {
    let scratch = Scratch::new("snapshot-background", "kill");
    let dir = scratch.path("snap");
    let mut run = start_memloop_and_snapshot(&GUEST, &dir, &[]);
    let first = ask_for_a_second_snapshot(&mut run, &dir);
    // The second memory file appears once the vCPUs run again: kill mid-write.
    wait_for_a_new_memory_file(&mut run, &dir, &first.memory_files);
    kill_9(run, "a kill during the background write");
    assert_eq!(
        std::fs::read(dir.join("state")).expect("a state file survives"),
        first.state,
        "the kill landed after the commit; the test proved nothing"
    );
    assert_eq!(memory_files(&dir), first.memory_files);
    let out = restore(&dir, "lazy", &[]);
    assert_restored_memloop_completes(&out, GUEST.iters);
}

/// A tmpfs mounted for a test, unmounted on drop.
struct SmallTmpfs<'a>(&'a Path);

impl<'a> SmallTmpfs<'a> {
    fn mount(at: &'a Path, size: &str) -> Result<SmallTmpfs<'a>, String> {
        std::fs::create_dir_all(at).map_err(|e| e.to_string())?;
        let status = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size}"),
                "tmpfs",
                arg(at),
            ])
            .status()
            .map_err(|e| e.to_string())?;
        if status.success() {
            Ok(SmallTmpfs(at))
        } else {
            Err(format!("mount -t tmpfs: {status}"))
        }
    }
}

impl Drop for SmallTmpfs<'_> {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.0).status();
    }
}

#[test]
fn a_full_disk_fails_the_snapshot_and_the_vm_runs_on() {
    let scratch = Scratch::new("snapshot-background", "full-disk");
    let mount = scratch.path("small");
    let _tmpfs = match SmallTmpfs::mount(&mount, "48m") {
        Ok(tmpfs) => tmpfs,
        Err(reason) => {
            eprintln!("SKIPPED: cannot mount a small tmpfs here: {reason}");
            return;
        }
    };
    let dir = mount.join("snap");
    let mut run = start_memloop_and_snapshot(&GUEST, &dir, &[]);
    run.wait_for_stderr("the VM keeps running", LIMIT);
    let failed_at = iterations(&run.stdout()).len();
    let out = run.wait(LIMIT);
    assert_eq!(out.code(), Some(0), "{}", out.describe());
    assert!(
        out.stderr.contains("No space left on device"),
        "{}",
        out.describe()
    );
    assert!(!out.stdout.contains("FAIL"), "{}", out.describe());
    assert!(out.stdout.contains("memloop: done"), "{}", out.describe());
    assert!(
        iterations(&out.stdout).len() > failed_at,
        "{}",
        out.describe()
    );
    assert!(!dir.join("state").exists(), "a failed snapshot committed");
    let left: Vec<_> = std::fs::read_dir(&dir)
        .map(|entries| entries.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(
        !left
            .iter()
            .any(|name| name.to_string_lossy().contains("memory-")),
        "the failed snapshot left {left:?}"
    );
}
