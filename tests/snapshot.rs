//! End-to-end snapshot and restore: a guest that checks its own memory (`memloop`
//! verifies every page the previous iteration wrote) is snapshotted by one gpuvm process
//! and restored by another, in every restore mode (eager, lazy, an external page-fault
//! handler), on huge pages and with 1 to 4 vCPUs, after clean exits, `kill -9` and kills
//! in the middle of writing a snapshot. Diff snapshots, working sets and sparse memory
//! files are in snapshot_diff.rs; corrupt and unusable snapshots in snapshot_damage.rs;
//! the helpers they share in snapshot_support.rs.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use gpuvm_tests::snapshot_support::{
    arg, ask_for_a_second_snapshot, assert_continues, assert_restored_memloop_completes, field,
    has, iterations, kill_9, memory_files, memory_header, only_report, read_state, reports,
    restore, signal_snapshot, small_snapshot, snapshot_memloop_then_exit,
    start_memloop_and_snapshot, wait_for_a_new_memory_file, Memloop, GUEST_2_VCPUS, LIMIT,
};
use gpuvm_tests::{
    start_uffd_handler, HugePageReservation, RunOutput, Scratch, SpawnedProcess, HUGEPAGE_LOCK,
};

const HANDLER: &str = env!("CARGO_BIN_EXE_gpuvm-test-uffd-handler");

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

/// Restores `dir` (plus `extra`) through the test page-fault handler, which dies after
/// serving `die_after_faults` faults; gpuvm must end within a minute. Returns gpuvm's and
/// the handler's output, the handler's exit checked (3: it died as told).
fn restore_through_a_dying_handler(
    scratch: &Scratch,
    dir: &Path,
    die_after_faults: &str,
    extra: &[&str],
) -> (RunOutput, RunOutput) {
    let socket = scratch.path("uffd.sock");
    let handler = start_uffd_handler(
        Path::new(HANDLER),
        &socket,
        dir,
        &["--die-after-faults", die_after_faults],
    );
    let mut args = vec![
        "restore",
        "--snapshot",
        arg(dir),
        "--restore-mode",
        "external",
        "--uffd-socket",
        arg(&socket),
    ];
    args.extend_from_slice(extra);
    let out = SpawnedProcess::gpuvm(&args)
        .wait_timeout(Duration::from_secs(60))
        .unwrap_or_else(|| panic!("gpuvm {args:?} hung after the page-fault handler died"));
    let handler = handler.wait(Duration::from_secs(30));
    assert_eq!(handler.code(), Some(3), "handler: {}", handler.describe());
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

// ---- Snapshot mid-run, exit, restore in a new process ----

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
    let (out, handler) = restore_through_a_dying_handler(&scratch, &dir, "300", &[]);
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
    let second = scratch.path("second");
    let (out, _) = restore_through_a_dying_handler(
        &scratch,
        &dir,
        "20000",
        &["--snapshot-dir", arg(&second), "--snapshot-after-ms", "300"],
    );
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

// ---- kill -9 after a snapshot ----

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
    let killed = kill_9(run, "a kill after the snapshot");
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

// ---- kill -9 while a snapshot is being written ----

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
        let mut run = start_memloop_and_snapshot(&guest, &dir, &[]);
        let first = ask_for_a_second_snapshot(&mut run, &dir);
        match point {
            KillPoint::After(ms) => std::thread::sleep(Duration::from_millis(ms)),
            KillPoint::MemoryFileAppears => {
                wait_for_a_new_memory_file(&mut run, &dir, &first.memory_files)
            }
            KillPoint::AfterCommit => run.wait_until("the second snapshot", LIMIT, |_| {
                std::fs::read(dir.join("state")).is_ok_and(|now| now != first.state)
            }),
        }
        kill_9(run, &label);

        let state_now = std::fs::read(dir.join("state")).expect("a state file survives");
        let kept_previous = state_now == first.state;
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
            assert_eq!(memory_files(&dir), first.memory_files);
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
    let mut run = start_memloop_and_snapshot(&guest, &dir, &[]);
    run.wait_until("the first snapshot", LIMIT, |_| dir.join("state").exists());
    signal_snapshot(run.pid());
    // Kill as soon as the second memory file is being written.
    wait_for_a_new_memory_file(&mut run, &dir, &memory_files(&dir));
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
