//! Operations and isolation: the seccomp filters every gpuvm thread runs under (on by
//! default), what happens on a violation, the test hooks that show the filters are really
//! applied, `--no-seccomp`, JSON logs, and the jail combined with the filters.

use std::path::Path;
use std::time::Duration;

use gpuvm_tests::{
    api_expect, api_start_instance, run_gpuvm, run_gpuvm_with_env, run_until_snapshot,
    start_uffd_handler, thread_seccomp_modes, wait_for_api_socket, RunOutput, Scratch,
    SpawnedProcess,
};

const LIMIT: Duration = Duration::from_secs(120);
const VIOLATION_EXIT: i32 = 148;
const GPUVM_ERROR_EXIT: i32 = gpuvm_vmm::exit_status::GPUVM_ERROR as i32;
const HANDLER: &str = env!("CARGO_BIN_EXE_gpuvm-test-uffd-handler");
const EMU_GPU: &str = env!("CARGO_BIN_EXE_gpuvm-emu-gpu");

fn arg(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

/// No seccomp report in a run that should have passed.
fn assert_no_violation(out: &RunOutput) {
    assert!(
        !out.stderr.contains("gpuvm: seccomp:"),
        "a system call was blocked:\n{}",
        out.describe()
    );
}

fn assert_trapped(out: &RunOutput, line: &str) {
    assert_eq!(out.code(), Some(VIOLATION_EXIT), "{}", out.describe());
    assert!(
        out.stderr.contains(line),
        "no {line:?}:\n{}",
        out.describe()
    );
}

#[test]
fn workloads_pass_under_the_filters() {
    for args in [
        &["run"][..],
        &["run", "--vcpus", "2", "--cmdline", "smp"],
        &["run", "--memory", "256M", "--cmdline", "memtest 64M 7"],
        &[
            "run",
            "--vcpus",
            "2",
            "--memory",
            "128M",
            "--cmdline",
            "memloop 16M 3 5",
        ],
    ] {
        let out = run_gpuvm(args, LIMIT);
        assert_no_violation(&out);
        out.assert_code(0);
    }
}

/// Snapshot on a timer (a diff chain with dirty-page tracking), then every restore mode,
/// the external page-fault handler included: all under the filters.
#[test]
fn snapshot_and_every_restore_mode_under_the_filters() {
    let scratch = Scratch::new("ops", "snap");
    let dir = scratch.path("snap");
    let out = run_gpuvm(
        &[
            "run",
            "--vcpus",
            "2",
            "--memory",
            "256M",
            "--cmdline",
            "memloop 64M 5 400",
            "--track-dirty-pages",
            "--snapshot-dir",
            arg(&dir),
            "--snapshot-after-ms",
            "300",
            "--snapshot-then",
            "exit",
        ],
        LIMIT,
    );
    assert_no_violation(&out);
    out.assert_code(0);
    assert!(dir.join("state").exists(), "{}", out.describe());

    for mode in ["lazy", "eager"] {
        let out = run_gpuvm(
            &["restore", "--snapshot", arg(&dir), "--restore-mode", mode],
            LIMIT,
        );
        assert_no_violation(&out);
        out.assert_code(0).assert_stdout_has("memloop: done");
    }

    let socket = scratch.path("uffd.sock");
    let handler = start_uffd_handler(Path::new(HANDLER), &socket, &dir, &[]);
    let out = run_gpuvm(
        &[
            "restore",
            "--snapshot",
            arg(&dir),
            "--restore-mode",
            "external",
            "--uffd-socket",
            arg(&socket),
        ],
        LIMIT,
    );
    assert_no_violation(&out);
    out.assert_code(0).assert_stdout_has("memloop: done");
    let handler = handler.wait(Duration::from_secs(30));
    assert_eq!(handler.code(), Some(0), "{}", handler.describe());
}

/// A restored VM snapshotted again while its memory still loads lazily (the lazy
/// loader's threads and the snapshot writer under the vmm filter), then a diff on SIGUSR1.
#[test]
fn lazy_restore_then_snapshot_again_under_the_filters() {
    let scratch = Scratch::new("ops", "resnap");
    let first = scratch.path("first");
    let second = scratch.path("second");
    let run = [
        "run",
        "--memory",
        "256M",
        "--cmdline",
        "memloop 128M 9 100000",
    ];
    run_until_snapshot(&run, &first, 200, LIMIT);
    let mut restored = SpawnedProcess::gpuvm(&[
        "restore",
        "--snapshot",
        arg(&first),
        "--restore-mode",
        "lazy",
        "--snapshot-dir",
        arg(&second),
        "--snapshot-after-ms",
        "1",
        "--snapshot-then",
        "resume",
    ]);
    restored.wait_until("the snapshot", LIMIT, |_| second.join("state").exists());
    restored.wait_for_stdout("ok", LIMIT);
    restored.signal(libc::SIGUSR1);
    std::thread::sleep(Duration::from_millis(300));
    restored.signal(libc::SIGTERM);
    let out = restored.wait(LIMIT);
    assert_no_violation(&out);
}

/// Every thread of a running gpuvm is filtered: main (vmm), the vCPUs, the API threads;
/// the API lifecycle (configure, start, pause, snapshot, resume, metrics, stop) works.
#[test]
fn every_thread_is_filtered_and_the_api_lifecycle_works() {
    let scratch = Scratch::new("ops", "threads");
    let socket = scratch.path("api.sock");
    let snap = scratch.path("snap");
    let mut vmm = SpawnedProcess::gpuvm(&["run", "--api-sock", arg(&socket)]);
    wait_for_api_socket(&mut vmm, &socket);
    api_expect(
        &socket,
        204,
        "PUT",
        "/machine-config",
        Some(r#"{"vcpu_count": 2, "mem_size_mib": 128, "track_dirty_pages": true}"#),
    );
    api_expect(
        &socket,
        204,
        "PUT",
        "/boot-source",
        Some(r#"{"boot_args": "memloop 16M 4 0"}"#),
    );
    api_start_instance(&socket);
    vmm.wait_for_stdout("memloop: iter 1 ok", LIMIT);
    let threads = thread_seccomp_modes(vmm.pid());
    let names: Vec<&str> = threads.iter().map(|(name, _)| name.as_str()).collect();
    for expected in ["vcpu0", "vcpu1", "api", "gpuvm"] {
        assert!(names.contains(&expected), "no {expected} in {threads:?}");
    }
    assert!(
        threads.iter().all(|(_, mode)| *mode == 2),
        "unfiltered threads: {threads:?}"
    );
    api_expect(&socket, 204, "PATCH", "/vm", Some(r#"{"state": "Paused"}"#));
    let body = format!(r#"{{"snapshot_path": "{}"}}"#, arg(&snap));
    api_expect(&socket, 200, "PUT", "/snapshot/create", Some(&body));
    let body = format!(
        r#"{{"snapshot_path": "{}", "snapshot_type": "Diff"}}"#,
        arg(&snap)
    );
    api_expect(&socket, 200, "PUT", "/snapshot/create", Some(&body));
    api_expect(
        &socket,
        204,
        "PATCH",
        "/vm",
        Some(r#"{"state": "Resumed"}"#),
    );
    let metrics = api_expect(&socket, 200, "GET", "/metrics", None);
    assert!(metrics.contains("snapshot"), "{metrics}");
    api_expect(&socket, 404, "GET", "/nope", None);
    api_expect(
        &socket,
        204,
        "PUT",
        "/actions",
        Some(r#"{"action_type": "SendCtrlAltDel"}"#),
    );
    let out = vmm.wait(LIMIT);
    assert_no_violation(&out);
    out.assert_code(0);
    assert!(snap.join("state").exists());
}

#[test]
fn no_seccomp_leaves_threads_unfiltered_and_the_old_flag_is_accepted() {
    let scratch = Scratch::new("ops", "off");
    let socket = scratch.path("api.sock");
    let mut vmm = SpawnedProcess::gpuvm(&[
        "run",
        "--api-sock",
        arg(&socket),
        "--no-seccomp",
        "--cmdline",
        "memloop 8M 1 0",
    ]);
    wait_for_api_socket(&mut vmm, &socket);
    api_start_instance(&socket);
    vmm.wait_for_stdout("memloop: iter 1 ok", LIMIT);
    let threads = thread_seccomp_modes(vmm.pid());
    assert!(
        threads.iter().all(|(_, mode)| *mode == 0),
        "filtered threads: {threads:?}"
    );
    api_expect(
        &socket,
        204,
        "PUT",
        "/actions",
        Some(r#"{"action_type": "SendCtrlAltDel"}"#),
    );
    vmm.wait(LIMIT).assert_code(0);

    // The test hooks do nothing without filters; --seccomp is a no-op kept for scripts.
    let out = run_gpuvm_with_env(
        &["run", "--no-seccomp"],
        &[("GPUVM_TEST_SECCOMP_REMOVE", "vcpu:16")],
        LIMIT,
        None,
    );
    out.assert_code(0);
    run_gpuvm(&["run", "--seccomp"], LIMIT).assert_code(0);
    let out = run_gpuvm(&["run", "--seccomp", "--no-seccomp"], LIMIT);
    assert_eq!(out.code(), Some(GPUVM_ERROR_EXIT), "{}", out.describe());
}

/// `GPUVM_TEST_SECCOMP_VIOLATION=KIND`: a thread of that kind makes a forbidden call;
/// the SIGSYS handler names it and gpuvm exits 148.
#[test]
fn a_violation_on_each_thread_kind_traps() {
    let scratch = Scratch::new("ops", "violation");
    for kind in ["vmm", "vcpu", "api"] {
        let socket = scratch.path(&format!("{kind}.sock"));
        let config = scratch.path("config.json");
        std::fs::write(&config, r#"{"boot-source": {"boot_args": "hello"}}"#).unwrap();
        let out = run_gpuvm_with_env(
            &[
                "run",
                "--api-sock",
                arg(&socket),
                "--config-file",
                arg(&config),
            ],
            &[("GPUVM_TEST_SECCOMP_VIOLATION", kind)],
            LIMIT,
            None,
        );
        // getppid is 110 on x86_64.
        assert_trapped(
            &out,
            &format!("gpuvm: seccomp: blocked system call 110 on a {kind} thread"),
        );
    }
    // A virtio device's I/O thread runs the device filter (installed when the VM is
    // built, before the guest could activate the device).
    let out = run_gpuvm_with_env(
        &["run", "--rng"],
        &[("GPUVM_TEST_SECCOMP_VIOLATION", "device")],
        LIMIT,
        None,
    );
    assert_trapped(
        &out,
        "gpuvm: seccomp: blocked system call 110 on a device thread",
    );
    // Without it, epoll_wait: the first device the guest activates traps on its thread.
    let out = run_gpuvm_with_env(
        &["run", "--rng", "--cmdline", "virtio-rng"],
        &[("GPUVM_TEST_SECCOMP_REMOVE", "device:232")],
        LIMIT,
        None,
    );
    assert_trapped(
        &out,
        "gpuvm: seccomp: blocked system call 232 on a device thread",
    );
    // A lazy-restore thread runs the vmm filter.
    let dir = scratch.path("snap");
    run_gpuvm(
        &[
            "run",
            "--cmdline",
            "memloop 8M 1 100000",
            "--snapshot-dir",
            arg(&dir),
            "--snapshot-after-ms",
            "100",
            "--snapshot-then",
            "exit",
        ],
        LIMIT,
    )
    .assert_code(0);
    let out = run_gpuvm_with_env(
        &["restore", "--snapshot", arg(&dir), "--restore-mode", "lazy"],
        &[("GPUVM_TEST_SECCOMP_VIOLATION", "vmm")],
        LIMIT,
        None,
    );
    assert_trapped(
        &out,
        "gpuvm: seccomp: blocked system call 110 on a vmm thread",
    );
    // With GPUVM_SECCOMP_LOG_ONLY the kernel only logs it and the run goes on.
    let out = run_gpuvm_with_env(
        &["run"],
        &[
            ("GPUVM_TEST_SECCOMP_VIOLATION", "vcpu"),
            ("GPUVM_SECCOMP_LOG_ONLY", "1"),
        ],
        LIMIT,
        None,
    );
    assert_no_violation(&out);
    out.assert_code(0);
}

/// `GPUVM_TEST_SECCOMP_REMOVE=KIND:NR`: without ioctl in the vCPU filter the first
/// KVM_RUN traps; without accept4 in the API filter the first connection does; without
/// epoll_wait in the vmm filter the event loop does. Each proves that kind's filter is
/// the one on those threads.
#[test]
fn removing_a_call_from_a_filter_breaks_exactly_that_thread() {
    let out = run_gpuvm_with_env(
        &["run"],
        &[("GPUVM_TEST_SECCOMP_REMOVE", "vcpu:16")],
        LIMIT,
        None,
    );
    assert_trapped(
        &out,
        "gpuvm: seccomp: blocked system call 16 on a vcpu thread (ioctl request 0xae80)",
    );
    let out = run_gpuvm_with_env(
        &["run"],
        &[("GPUVM_TEST_SECCOMP_REMOVE", "vmm:232")],
        LIMIT,
        None,
    );
    assert_trapped(
        &out,
        "gpuvm: seccomp: blocked system call 232 on a vmm thread",
    );

    let scratch = Scratch::new("ops", "remove");
    let socket = scratch.path("api.sock");
    let mut vmm = SpawnedProcess::spawn_with_env(
        &gpuvm_tests::gpuvm_bin(),
        &["run", "--api-sock", arg(&socket)],
        &[("GPUVM_TEST_SECCOMP_REMOVE", "api:288")],
    );
    vmm.wait_until("the API socket", LIMIT, |_| socket.exists());
    // The connection is queued by the kernel; the accept traps.
    let _ = gpuvm_api::client::request(&socket, "GET", "/", None);
    let out = vmm.wait(LIMIT);
    assert_trapped(
        &out,
        "gpuvm: seccomp: blocked system call 288 on a api thread",
    );

    let out = run_gpuvm_with_env(
        &["run"],
        &[("GPUVM_TEST_SECCOMP_REMOVE", "gpu:1")],
        LIMIT,
        None,
    );
    out.assert_clean_error("GPUVM_TEST_SECCOMP_REMOVE");
}

/// The emulated GPU over vfio-user: BAR accesses, MSI-X and INTx setup from the vCPU
/// threads, the INTx unmask from the event loop, teardown, all filtered.
#[test]
fn pci_with_the_emulated_gpu_under_the_filters() {
    let scratch = Scratch::new("ops", "pci");
    let socket = scratch.path("gpu.sock");
    let mut emu = SpawnedProcess::spawn(Path::new(EMU_GPU), &["--socket", arg(&socket)]);
    emu.wait_until("the device socket", Duration::from_secs(10), |_| {
        socket.exists()
    });
    let out = run_gpuvm(
        &["run", "--cmdline", "pci", "--vfio-user", arg(&socket)],
        LIMIT,
    );
    assert_no_violation(&out);
    out.assert_code(0).assert_stdout_has("pci: ok");
    let emu = emu.wait(Duration::from_secs(10));
    assert_eq!(emu.code(), Some(0), "{}", emu.stderr);
}

/// `--log-format json`: every stderr line is one JSON object with ts, level, target and
/// message; `--log-level` overrides GPUVM_LOG.
#[test]
fn json_logs_are_one_object_per_line() {
    let out = run_gpuvm_with_env(
        &[
            "--log-format",
            "json",
            "run",
            "--vcpus",
            "2",
            "--cmdline",
            "smp",
            "--log-level",
            "debug",
        ],
        &[("GPUVM_LOG", "error")],
        LIMIT,
        None,
    );
    out.assert_code(0);
    let mut records = Vec::new();
    for line in out.stderr.lines() {
        let value: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {line}\n{}", out.describe()));
        for field in ["ts", "level", "target", "message"] {
            assert!(value[field].is_string(), "no {field}: {line}");
        }
        assert!(value["ts"].as_str().unwrap().ends_with('Z'), "{line}");
        records.push(value);
    }
    let has = |level: &str, target: &str, message: &str, thread: Option<&str>| {
        records.iter().any(|r| {
            r["level"] == level
                && r["target"] == target
                && r["message"].as_str().unwrap().contains(message)
                && match thread {
                    Some(t) => r["thread"] == t,
                    None => true,
                }
        })
    };
    assert!(
        has("INFO", "gpuvm", "guest ended", Some("main")),
        "{}",
        out.stderr
    );
    for thread in ["vcpu0", "vcpu1"] {
        assert!(
            has(
                "DEBUG",
                "gpuvm_vmm::seccomp",
                "vcpu filter installed",
                Some(thread)
            ),
            "{}",
            out.stderr
        );
    }
    assert!(has(
        "DEBUG",
        "gpuvm_vmm::seccomp",
        "vmm filter installed",
        Some("main")
    ));

    // Text stays the default, and --log-level off silences everything.
    let out = run_gpuvm(&["run", "--log-level", "off"], LIMIT);
    out.assert_code(0);
    assert_eq!(out.stderr, "");
    let out = run_gpuvm(&["--log-format", "yaml", "run"], LIMIT);
    assert_eq!(out.code(), Some(GPUVM_ERROR_EXIT), "{}", out.describe());
}

/// The jail and the filters together: the threads that exist before the uid drop (API,
/// lazy restore) follow glibc's set*id broadcast under their filters; the confined,
/// filtered VM snapshots into its new root and a lazy restore in a jail runs to the end.
#[test]
fn jail_and_seccomp_together() {
    // SAFETY: geteuid(2) has no side effects.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("jail_and_seccomp_together: needs root, skipped");
        return;
    }
    let scratch = Scratch::new("ops", "jail");
    let root = scratch.path("root");
    std::fs::create_dir_all(&root).unwrap();
    std::fs::set_permissions(&root, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let socket = root.join("api.sock");
    let jail = ["--chroot", arg(&root), "--uid", "65534", "--gid", "65534"];
    let mut args = vec![
        "run",
        "--api-sock",
        arg(&socket),
        "--memory",
        "64M",
        "--cmdline",
        "memloop 8M 3 1000000",
    ];
    args.extend(jail);
    let mut vmm = SpawnedProcess::gpuvm(&args);
    wait_for_api_socket(&mut vmm, &socket);
    api_start_instance(&socket);
    vmm.wait_for_stdout("memloop: iter 1 ok", LIMIT);
    let threads = thread_seccomp_modes(vmm.pid());
    assert!(threads.iter().all(|(_, mode)| *mode == 2), "{threads:?}");
    let status = std::fs::read_to_string(format!("/proc/{}/status", vmm.pid())).unwrap();
    assert!(
        status.contains("Uid:\t65534\t65534\t65534\t65534"),
        "{status}"
    );
    api_expect(&socket, 204, "PATCH", "/vm", Some(r#"{"state": "Paused"}"#));
    api_expect(
        &socket,
        200,
        "PUT",
        "/snapshot/create",
        Some(r#"{"snapshot_path": "/snap"}"#),
    );
    api_expect(
        &socket,
        204,
        "PUT",
        "/actions",
        Some(r#"{"action_type": "SendCtrlAltDel"}"#),
    );
    let out = vmm.wait(LIMIT);
    assert_no_violation(&out);
    out.assert_code(0);
    assert!(root.join("snap/state").exists());

    // Lazy restore in a jail: its loader threads start before the uid drop.
    let snap = root.join("snap");
    let mut args = vec![
        "restore",
        "--snapshot",
        arg(&snap),
        "--restore-mode",
        "lazy",
    ];
    args.extend(jail);
    let mut restored = SpawnedProcess::gpuvm(&args);
    restored.wait_until("two more iterations", LIMIT, |p| {
        p.stdout().matches(" ok").count() >= 2
    });
    let threads = thread_seccomp_modes(restored.pid());
    assert!(threads.iter().all(|(_, mode)| *mode == 2), "{threads:?}");
    restored.signal(libc::SIGTERM);
    let out = restored.wait(LIMIT);
    assert_no_violation(&out);
}

/// The threads a restore starts (the lazy fault thread and loaders, the external
/// handler's watcher) run under the vmm filter too: a restored VM has no unfiltered thread.
#[test]
fn restored_vms_have_no_unfiltered_thread() {
    let scratch = Scratch::new("ops", "restored-threads");
    let dir = scratch.path("snap");
    // Enough written memory that the lazy fault thread outlives the first samples.
    let run = [
        "run",
        "--memory",
        "1G",
        "--cmdline",
        "memloop 512M 9 100000",
    ];
    run_until_snapshot(&run, &dir, 1000, LIMIT);

    let socket = scratch.path("uffd.sock");
    for (mode, thread) in [("lazy", "uffd-faults"), ("external", "uffd-handler-wa")] {
        let handler = (mode == "external")
            .then(|| start_uffd_handler(Path::new(HANDLER), &socket, &dir, &[]));
        let mut args = vec!["restore", "--snapshot", arg(&dir), "--restore-mode", mode];
        if handler.is_some() {
            args.extend(["--uffd-socket", arg(&socket)]);
        }
        let mut restored = SpawnedProcess::gpuvm(&args);
        // Threads filter themselves as they start (main once the vCPUs run), so sample
        // until the restore's thread is there and every thread has its filter; a thread
        // left unfiltered keeps this from ever holding.
        let mut threads = Vec::new();
        let filtered = wait_for(Duration::from_secs(30), || {
            threads = thread_seccomp_modes(restored.pid());
            threads.iter().any(|(name, _)| name == thread)
                && threads.iter().all(|(_, mode)| *mode == 2)
        });
        assert!(
            filtered,
            "a {mode} restore still has unfiltered threads (or no {thread}): {threads:?}"
        );
        restored.signal(libc::SIGTERM);
        assert_no_violation(&restored.wait(LIMIT));
        if let Some(handler) = handler {
            let _ = handler.wait(Duration::from_secs(30));
        }
    }
}

/// Polls `ready` every few milliseconds until it holds (true) or `limit` passes (false).
fn wait_for(limit: Duration, mut ready: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + limit;
    while std::time::Instant::now() < deadline {
        if ready() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    false
}
