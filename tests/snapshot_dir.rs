//! What a snapshot does to its directory and to the VM when things go wrong there: stale
//! temp files, a full disk (tmpfs mounts with few inodes or little space), files that are
//! not gpuvm's, another gpuvm using the same directory, a missing parent directory. The
//! VM always runs on, the previous snapshot stays whole, and no dirty page is lost.

use std::fs::File;
use std::io::Write;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use gpuvm_api::client;
use gpuvm_tests::{
    assert_memloop_resumed_and_done, memloop_iterations, RunOutput, Scratch, SpawnedProcess,
};
use serde_json::{json, Value};

const LIMIT: Duration = Duration::from_secs(240);
/// A memloop guest: 32 MiB rewritten and checked every iteration (about 30 ms each here).
const MEMORY: &str = "128M";

fn arg(path: &Path) -> &str {
    path.to_str().expect("UTF-8 path")
}

fn memloop(iters: u32) -> String {
    format!("memloop 32M 7 {iters}")
}

/// File names in `dir`, sorted.
fn listing(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn memory_files(dir: &Path) -> Vec<String> {
    listing(dir)
        .into_iter()
        .filter(|n| n.starts_with("memory-"))
        .collect()
}

/// `gpuvm run` of a memloop guest snapshotting into `dir`, logging at info level (so
/// that snapshots, taken or failed, show on stderr).
fn run_snapshotting(dir: &Path, iters: u32, extra: &[&str]) -> SpawnedProcess {
    let cmdline = memloop(iters);
    let mut args = vec![
        "run",
        "--log-level",
        "info",
        "--memory",
        MEMORY,
        "--cmdline",
        &cmdline,
        "--snapshot-dir",
        arg(dir),
    ];
    args.extend_from_slice(extra);
    SpawnedProcess::gpuvm(&args)
}

/// A memloop guest of `iters` iterations that snapshots into `dir` after 200 ms and
/// exits; it must exit 0.
fn snapshot_then_exit(dir: &Path, iters: u32) -> RunOutput {
    let after = ["--snapshot-after-ms", "200", "--snapshot-then", "exit"];
    let out = run_snapshotting(dir, iters, &after).wait(LIMIT);
    assert_eq!(out.code(), Some(0), "{}", out.describe());
    out
}

/// As [`snapshot_then_exit`], for a snapshot that must fail: the run ends there with
/// gpuvm's error status and the reason (a caller of `--snapshot-then exit` must not take a
/// missing snapshot for a written one).
fn failed_snapshot_then_exit(dir: &Path, iters: u32) -> RunOutput {
    let after = ["--snapshot-after-ms", "200", "--snapshot-then", "exit"];
    let out = run_snapshotting(dir, iters, &after).wait(LIMIT);
    assert_eq!(out.code(), Some(125), "{}", out.describe());
    out.assert_stderr_has("gpuvm: error:");
    out
}

/// The guest ran to its end, every page checked.
fn assert_guest_completed(out: &RunOutput) {
    assert_eq!(out.code(), Some(0), "{}", out.describe());
    assert!(out.stdout.contains("memloop: done"), "{}", out.describe());
    assert!(!out.stdout.contains("FAIL"), "{}", out.describe());
    assert!(!out.stderr.contains("panicked"), "{}", out.describe());
}

/// Restores `dir` and requires the guest to go on from the snapshot and finish with
/// every page verified (memloop checks each page it wrote before the snapshot).
fn assert_restores(dir: &Path, mode: &str) {
    let out = SpawnedProcess::gpuvm(&["restore", "--snapshot", arg(dir), "--restore-mode", mode])
        .wait(LIMIT);
    assert_memloop_resumed_and_done(&out);
}

/// Sends SIGUSR1 (what `gpuvm snapshot --pid` sends) and waits until gpuvm logged the
/// `count`-th occurrence of `outcome`.
fn signal_snapshot(run: &mut SpawnedProcess, outcome: &str, count: usize) {
    // SAFETY: kill(2) on our own child's pid has no memory effects.
    unsafe { libc::kill(run.pid(), libc::SIGUSR1) };
    run.wait_until(&format!("{outcome:?} #{count}"), LIMIT, |p| {
        p.stderr().matches(outcome).count() >= count
    });
}

/// Waits until the guest has finished `more` iterations past what it printed so far.
fn wait_progress(run: &mut SpawnedProcess, more: usize) {
    let now = memloop_iterations(&run.stdout()).len();
    run.wait_until(&format!("{more} more iterations"), LIMIT, |p| {
        memloop_iterations(&p.stdout()).len() >= now + more
    });
}

const TAKEN: &str = "snapshot written to";
const FAILED: &str = "the VM keeps running and the previous snapshot there is kept";

/// A tmpfs mounted for one test (a disk that fills up on cue), unmounted on drop.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(dir: PathBuf, options: &str) -> Tmpfs {
        std::fs::create_dir_all(&dir).unwrap();
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", options, "tmpfs", arg(&dir)])
            .status()
            .expect("run mount");
        assert!(status.success(), "mount tmpfs on {} (root?)", dir.display());
        Tmpfs(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").args(["-l", arg(&self.0)]).status();
    }
}

/// Holds flock(2) on a directory, as a gpuvm writing a snapshot there does.
struct DirLockHolder {
    _held: File,
}

impl DirLockHolder {
    fn exclusive(dir: &Path) -> DirLockHolder {
        let file = File::open(dir).unwrap();
        // SAFETY: flock on a descriptor this test owns.
        let ret = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        assert_eq!(ret, 0, "lock {}", dir.display());
        DirLockHolder { _held: file }
    }
}

/// A `.state` temp file left by a gpuvm killed mid-snapshot (empty: killed right after
/// creating it; the memory one cut short after its header) names a process that is gone.
/// The next snapshot removes them, and the VM lives (the check used to be `kill(pid, 0)`,
/// which the VMM thread's seccomp filter kills the process for).
#[test]
fn stale_temp_files_do_not_stop_a_snapshot() {
    let scratch = Scratch::new("snapdir", "stale");
    let dir = scratch.path("snap");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join(".state.tmp.99999.0"), b"").unwrap();
    let mut cut = b"GPUVMMEM".to_vec();
    cut.resize(4096, 0);
    std::fs::write(dir.join(".memory-5.tmp.99999.0"), &cut).unwrap();
    snapshot_then_exit(&dir, 100_000);
    let files = listing(&dir);
    assert_eq!(files.len(), 2, "{files:?}");
    assert_eq!(files[1], "state", "{files:?}");
    assert_eq!(memory_files(&dir).len(), 1, "{files:?}");
}

/// A snapshot that fails (here: no inode left for its memory file, or for its state file)
/// when SIGUSR1 asks for it leaves the VM running and the previous snapshot whole, with
/// no half-written memory file beside it; that snapshot still restores.
#[test]
fn a_failed_snapshot_keeps_the_vm_running_and_the_previous_snapshot() {
    let scratch = Scratch::new("snapdir", "failed");
    // 3 inodes: the root, the first memory file and state; a 4th (the state's temp file
    // beside a second memory file) is one too many for 4.
    for (inodes, fails_at) in [(3, "the memory file"), (4, "the state file")] {
        let mount = Tmpfs::mount(
            scratch.path(&format!("snap-{inodes}")),
            &format!("size=512m,nr_inodes={inodes}"),
        );
        let dir = mount.path();
        let mut run = run_snapshotting(dir, 150, &["--snapshot-then", "resume"]);
        run.wait_for_stdout("memloop: iter 1 ok", LIMIT);
        signal_snapshot(&mut run, TAKEN, 1);
        let first = listing(dir);
        assert_eq!(first.len(), 2, "{first:?}");
        let first_state = std::fs::read(dir.join("state")).unwrap();

        signal_snapshot(&mut run, FAILED, 1);
        wait_progress(&mut run, 3);
        assert_eq!(
            listing(dir),
            first,
            "a snapshot that failed writing {fails_at} changed the directory"
        );
        assert_eq!(std::fs::read(dir.join("state")).unwrap(), first_state);
        let out = run.wait(LIMIT);
        assert_guest_completed(&out);
        out.assert_stderr_has("No space left on device");
        assert_restores(dir, "eager");
    }
}

/// The same when the timer asks, for the first snapshot into a directory, and the state
/// file is what cannot be written: the memory file written for it is removed.
#[test]
fn a_failed_timer_snapshot_leaves_no_memory_file() {
    let scratch = Scratch::new("snapdir", "timer");
    // The root and one file: the memory file fits, the state file's temp file does not.
    let mount = Tmpfs::mount(scratch.path("snap"), "size=512m,nr_inodes=2");
    let out = run_snapshotting(
        mount.path(),
        40,
        &["--snapshot-after-ms", "300", "--snapshot-then", "resume"],
    )
    .wait(LIMIT);
    assert_guest_completed(&out);
    out.assert_stderr_has(FAILED);
    assert_eq!(listing(mount.path()), Vec::<String>::new());
}

/// A gpuvm serving an API socket; killed on drop.
struct ApiVm {
    process: SpawnedProcess,
    socket: PathBuf,
}

impl ApiVm {
    /// Starts a memloop guest of `iters` iterations with dirty-page tracking.
    fn start(socket: PathBuf, iters: u32) -> ApiVm {
        let mut process = SpawnedProcess::gpuvm(&["run", "--api-sock", arg(&socket)]);
        gpuvm_tests::wait_for_api_socket(&mut process, &socket);
        let vm = ApiVm { process, socket };
        vm.expect(
            204,
            "PUT",
            "/machine-config",
            json!({"vcpu_count": 1, "mem_size_mib": 128, "track_dirty_pages": true}),
        );
        vm.expect(
            204,
            "PUT",
            "/boot-source",
            json!({ "boot_args": memloop(iters) }),
        );
        vm.expect(
            204,
            "PUT",
            "/actions",
            json!({"action_type": "InstanceStart"}),
        );
        vm
    }

    fn call(&self, method: &str, path: &str, body: Value) -> (u16, String) {
        let response = client::request(&self.socket, method, path, Some(&body.to_string()))
            .unwrap_or_else(|e| {
                panic!(
                    "{method} {path}: {e}\n--- stdout\n{}\n--- stderr\n{}",
                    self.process.stdout(),
                    self.process.stderr()
                )
            });
        (response.status, response.body)
    }

    fn expect(&self, status: u16, method: &str, path: &str, body: Value) -> String {
        let (got, answer) = self.call(method, path, body);
        assert_eq!(got, status, "{method} {path}: {answer}");
        answer
    }

    fn snapshot(&self, dir: &Path, kind: &str) -> (u16, String) {
        self.call(
            "PUT",
            "/snapshot/create",
            json!({"snapshot_path": dir, "snapshot_type": kind}),
        )
    }

    /// A snapshot into `dir` that must answer `status`; returns the answer.
    fn expect_snapshot(&self, dir: &Path, kind: &str, status: u16) -> String {
        let (got, answer) = self.snapshot(dir, kind);
        assert_eq!(got, status, "{kind} snapshot: {answer}");
        answer
    }
}

/// Fills the filesystem of `dir` with one file; returns its path.
fn fill_disk(dir: &Path) -> PathBuf {
    let path = dir.join("filler");
    let mut file = File::create(&path).unwrap();
    for chunk in [1 << 20, 4096, 1] {
        let bytes = vec![0x5a; chunk];
        while file.write_all(&bytes).is_ok() {}
    }
    path
}

/// A diff snapshot that fails (disk full) has read and cleared KVM's dirty log: those
/// pages must still go into the next snapshot, or the restored guest sees old memory.
/// Also: a snapshot that fails on a running VM leaves it running, on a paused one paused.
#[test]
fn a_failed_diff_snapshot_loses_no_dirty_page() {
    let scratch = Scratch::new("snapdir", "diff");
    let mount = Tmpfs::mount(scratch.path("snap"), "size=256m");
    let dir = mount.path();
    let mut vm = ApiVm::start(scratch.path("api.sock"), 80);
    vm.process.wait_for_stdout("memloop: iter 2 ok", LIMIT);
    vm.expect_snapshot(dir, "Full", 200);

    let filler = fill_disk(dir);
    let answer = vm.expect_snapshot(dir, "Diff", 400);
    assert!(answer.contains("No space left"), "{answer}");
    // The failed snapshot paused the vCPUs; they run again.
    wait_progress(&mut vm.process, 2);

    vm.expect(204, "PATCH", "/vm", json!({"state": "Paused"}));
    vm.expect_snapshot(dir, "Diff", 400);
    std::fs::remove_file(filler).unwrap();
    let answer = vm.expect_snapshot(dir, "Diff", 200);
    let report: Value = serde_json::from_str(&answer).unwrap();
    assert_eq!(report["diff"], true, "{report}");
    // The guest rewrote all of its 32 MiB (8192 pages) after the full snapshot.
    assert!(
        report["data_pages"].as_u64().unwrap() >= 8192,
        "dirty pages were lost: {report}"
    );
    drop(vm);
    assert_restores(dir, "eager");
    assert_restores(dir, "lazy");
}

/// Files in a snapshot directory that gpuvm did not write stay, whatever their names;
/// a directory whose `state` is not gpuvm's is refused, and the VM runs on.
#[test]
fn files_gpuvm_did_not_write_are_kept() {
    let scratch = Scratch::new("snapdir", "foreign");
    let dir = scratch.path("snap");
    std::fs::create_dir(&dir).unwrap();
    let users = [
        ("memory-notes.txt", &b"my notes"[..]),
        ("memory-12", b"not a memory file"),
        ("working-set", b"my list"),
    ];
    for (name, bytes) in users {
        std::fs::write(dir.join(name), bytes).unwrap();
    }
    // Twice: the second snapshot replaces the first and cleans up after it.
    for _ in 0..2 {
        snapshot_then_exit(&dir, 100_000);
        for (name, bytes) in users {
            assert_eq!(
                std::fs::read(dir.join(name)).ok().as_deref(),
                Some(bytes),
                "{name} changed: {:?}",
                listing(&dir)
            );
        }
        assert_eq!(listing(&dir).len(), users.len() + 2, "{:?}", listing(&dir));
    }

    let other = scratch.path("other");
    std::fs::create_dir(&other).unwrap();
    std::fs::write(other.join("state"), b"my state of mind").unwrap();
    let out = failed_snapshot_then_exit(&other, 40);
    out.assert_stderr_has("its state is not a file gpuvm wrote");
    assert_eq!(
        std::fs::read(other.join("state")).unwrap(),
        b"my state of mind"
    );
    assert_eq!(listing(&other), vec!["state".to_string()]);
}

/// While another process holds the snapshot directory (as a gpuvm writing a snapshot
/// there does), a snapshot into it is refused with a clear error (which ends a
/// `--snapshot-then exit` run with it), and
/// a restore from it is refused too; once it is free both work.
#[test]
fn a_snapshot_directory_in_use_is_refused() {
    let scratch = Scratch::new("snapdir", "locked");
    let dir = scratch.path("snap");
    snapshot_then_exit(&dir, 40);
    let before = listing(&dir);
    let state = std::fs::read(dir.join("state")).unwrap();

    let holder = DirLockHolder::exclusive(&dir);
    let out = failed_snapshot_then_exit(&dir, 40);
    out.assert_stderr_has("is in use by another gpuvm process");
    assert_eq!(listing(&dir), before);
    assert_eq!(std::fs::read(dir.join("state")).unwrap(), state);
    let restore = SpawnedProcess::gpuvm(&["restore", "--snapshot", arg(&dir)]).wait(LIMIT);
    restore.assert_clean_error("is being written by another gpuvm process");
    assert!(restore.stdout.is_empty(), "{}", restore.describe());

    drop(holder);
    assert_restores(&dir, "eager");
}

/// Two VMs snapshotting into one directory at the same time: every snapshot either
/// succeeds or is refused because the directory is in use; both VMs live on, and what the
/// directory holds at the end is one whole snapshot.
#[test]
fn two_vms_snapshotting_into_one_directory() {
    let scratch = Scratch::new("snapdir", "two");
    let dir = scratch.path("snap");
    let vms: Vec<ApiVm> = ["a", "b"]
        .iter()
        .map(|name| ApiVm::start(scratch.path(&format!("{name}.sock")), 100_000))
        .collect();
    let deadline = Instant::now() + LIMIT;
    while vms
        .iter()
        .any(|vm| memloop_iterations(&vm.process.stdout()).len() < 2)
    {
        assert!(Instant::now() < deadline, "the guests did not start");
        std::thread::sleep(Duration::from_millis(10));
    }
    let answers: Vec<Vec<(u16, String)>> = std::thread::scope(|scope| {
        let threads: Vec<_> = vms
            .iter()
            .map(|vm| scope.spawn(|| (0..10).map(|_| vm.snapshot(&dir, "Full")).collect()))
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    });
    let mut taken = 0;
    for (status, answer) in answers.iter().flatten() {
        match status {
            200 => taken += 1,
            400 if answer.contains("is in use by another gpuvm process") => {}
            _ => panic!("{status} {answer}\nall answers: {answers:?}"),
        }
    }
    assert!(taken >= 1, "{answers:?}");
    for mut vm in vms {
        assert!(vm.process.try_status().is_none(), "a VM died");
        let progressed = memloop_iterations(&vm.process.stdout()).len();
        vm.process.wait_until("progress", LIMIT, |p| {
            memloop_iterations(&p.stdout()).len() > progressed
        });
    }
    assert_eq!(memory_files(&dir).len(), 1, "{:?}", listing(&dir));
    // The guests run on for ever: a restore that verifies one whole iteration will do.
    let mut restored = SpawnedProcess::gpuvm(&["restore", "--snapshot", arg(&dir)]);
    restored.wait_until("two iterations after restore", LIMIT, |p| {
        memloop_iterations(&p.stdout()).len() >= 2
    });
    restored.signal(libc::SIGKILL);
    let out = restored.wait(LIMIT);
    assert!(!out.stdout.contains("FAIL"), "{}", out.describe());
    assert!(!out.stdout.contains("memloop: cpus="), "{}", out.describe());
}

/// A snapshot directory whose parent does not exist is an error (gpuvm creates only the
/// last component).
#[test]
fn a_missing_parent_directory_is_not_created() {
    let scratch = Scratch::new("snapdir", "parent");
    let parent = scratch.path("missing");
    let out = failed_snapshot_then_exit(&parent.join("snap"), 40);
    out.assert_stderr_has("its parent directory does not exist");
    assert!(!parent.exists(), "the parent directory was created");
}
