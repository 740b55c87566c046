//! Bad input to the CLI: one clear line and a non-zero exit, never a panic or a hang.

use std::io::Write;
use std::time::Duration;

use gpuvm_tests::{run_gpuvm, SpawnedProcess};
use gpuvm_vmm::exit_status::GPUVM_ERROR as GPUVM_ERROR_STATUS;

/// gpuvm's own errors' exit status.
const GPUVM_ERROR: i32 = GPUVM_ERROR_STATUS as i32;

const LIMIT: Duration = Duration::from_secs(60);

#[test]
fn missing_kernel_file() {
    run_gpuvm(&["run", "--kernel", "/nonexistent/vmlinux"], LIMIT)
        .assert_clean_error("cannot open kernel image /nonexistent/vmlinux");
}

#[test]
fn kernel_that_is_not_elf_or_bzimage() {
    let mut file = tempfile("not-a-kernel");
    file.1
        .write_all(b"#!/bin/sh\necho this is not a kernel\n")
        .unwrap();
    run_gpuvm(&["run", "--kernel", file.0.to_str().unwrap()], LIMIT)
        .assert_clean_error("is not a kernel gpuvm can boot");
}

#[test]
fn truncated_elf_kernel() {
    let mut file = tempfile("truncated-elf");
    file.1
        .write_all(&gpuvm_guest_images::TEST_GUEST_ELF[..200])
        .unwrap();
    run_gpuvm(&["run", "--kernel", file.0.to_str().unwrap()], LIMIT)
        .assert_clean_error("failed to load kernel");
}

#[test]
fn missing_initrd() {
    run_gpuvm(&["run", "--initrd", "/nonexistent/initrd"], LIMIT)
        .assert_clean_error("cannot open initrd");
}

#[test]
fn memory_larger_than_the_host() {
    run_gpuvm(&["run", "--memory", "64T"], LIMIT).assert_clean_error("larger than this host");
}

/// Guest RAM too small for the kernel (1 MiB: the image does not even load; 2 MiB: it
/// loads, but its zero-filled data would lie beyond RAM) or for gpuvm's boot structures
/// below 1 MiB: said so, instead of a loader's "Unable to read kernel image", an ACPI
/// write error, or a guest that spins writing to memory that is not there.
#[test]
fn memory_too_small_for_the_kernel() {
    for size in ["1M", "2M"] {
        run_gpuvm(&["run", "--memory", size], LIMIT)
            .assert_clean_error("guest RAM is too small for the embedded test guest")
            .assert_code(GPUVM_ERROR);
    }
    run_gpuvm(&["run", "--memory", "4K"], LIMIT)
        .assert_clean_error("guest RAM (4 KiB) is too small")
        .assert_code(GPUVM_ERROR);
}

#[test]
fn memory_size_garbage() {
    run_gpuvm(&["run", "--memory", "lots"], LIMIT).assert_clean_error("not a size");
    run_gpuvm(&["run", "--memory", "0"], LIMIT).assert_clean_error("size is 0");
}

#[test]
fn zero_vcpus() {
    run_gpuvm(&["run", "--vcpus", "0"], LIMIT).assert_clean_error("invalid vCPU count 0");
}

#[test]
fn too_many_vcpus() {
    run_gpuvm(&["run", "--vcpus", "255"], LIMIT).assert_clean_error("invalid vCPU count 255");
    run_gpuvm(&["run", "--vcpus", "100000"], LIMIT).assert_clean_error("invalid value");
}

#[test]
fn unknown_memory_backing() {
    run_gpuvm(&["run", "--memory-backing", "floppy"], LIMIT)
        .assert_clean_error("unknown memory backing 'floppy'");
}

#[test]
fn unknown_cpuid_feature() {
    run_gpuvm(&["run", "--cpuid-mask", "warpdrive"], LIMIT)
        .assert_clean_error("unknown CPUID feature");
}

#[test]
fn hugetlb_without_enough_pages_says_how_to_reserve() {
    // 1 GiB pages are never reserved on these hosts by default; if some are, ask for more.
    run_gpuvm(
        &["run", "--memory", "16G", "--memory-backing", "hugetlb-1g"],
        LIMIT,
    )
    .assert_clean_error("nr_hugepages");
}

#[test]
fn no_access_to_dev_kvm() {
    // Drop to an unprivileged uid; /dev/kvm is root-only on these hosts.
    let bin = gpuvm_tests::gpuvm_bin();
    let output = std::process::Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(&bin)
        .arg("run")
        .output()
        .expect("run setpriv");
    let stderr = String::from_utf8_lossy(&output.stderr);
    if stderr.contains("setpriv:") {
        // The binary path itself is unreachable for that user (e.g. under /root).
        let copy = std::env::temp_dir().join(format!("gpuvm-noaccess-{}", std::process::id()));
        std::fs::copy(&bin, &copy).unwrap();
        let output = std::process::Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(&copy)
            .arg("run")
            .output()
            .expect("run setpriv");
        let _ = std::fs::remove_file(&copy);
        check_kvm_denied(&output);
    } else {
        check_kvm_denied(&output);
    }
}

fn check_kvm_denied(output: &std::process::Output) {
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(GPUVM_ERROR), "{stderr}");
    assert!(stderr.contains("/dev/kvm"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

fn tempfile(name: &str) -> (std::path::PathBuf, std::fs::File) {
    let path = std::env::temp_dir().join(format!("gpuvm-test-{}-{name}", std::process::id()));
    let file = std::fs::File::create(&path).unwrap();
    (path, file)
}

/// `gpuvm snapshot --pid P` for a process `pid`: its output.
fn snapshot_pid(pid: i32) -> gpuvm_tests::RunOutput {
    run_gpuvm(&["snapshot", "--pid", &pid.to_string()], LIMIT)
}

/// The number of "ok" lines a memloop guest printed.
fn ok_lines(process: &SpawnedProcess) -> usize {
    process
        .stdout()
        .lines()
        .filter(|l| l.contains(" ok"))
        .count()
}

/// A gpuvm started without --snapshot-dir has no SIGUSR1 handler, so the signal would
/// kill it: `gpuvm snapshot --pid` refuses, and the VM runs on.
#[test]
fn snapshot_pid_refuses_a_gpuvm_without_snapshot_dir() {
    let mut vmm = SpawnedProcess::gpuvm(&["run", "--memory", "64M", "--cmdline", "memloop 4M 1 0"]);
    vmm.wait_until("a memloop iteration", LIMIT, |p| ok_lines(p) >= 1);
    snapshot_pid(vmm.pid())
        .assert_clean_error("does not take snapshots on a signal")
        .assert_code(GPUVM_ERROR);
    let seen = ok_lines(&vmm);
    vmm.wait_until("the VM to run on", LIMIT, |p| ok_lines(p) > seen);
}

/// Any other process is refused, whether it would die of SIGUSR1 (`sleep`) or do
/// something of its own on it (a shell trap).
#[test]
fn snapshot_pid_refuses_processes_that_are_not_gpuvm() {
    let sleeper = SpawnedProcess::spawn(std::path::Path::new("/bin/sleep"), &["60"]);
    let trapper = SpawnedProcess::spawn(
        std::path::Path::new("/bin/sh"),
        &[
            "-c",
            "trap 'echo got USR1' USR1; while :; do sleep 0.05; done",
        ],
    );
    // Let the shell install its trap, so that the only difference is the binary.
    std::thread::sleep(Duration::from_millis(200));
    for mut process in [sleeper, trapper] {
        snapshot_pid(process.pid())
            .assert_clean_error("is not a gpuvm")
            .assert_code(GPUVM_ERROR);
        // Before the fix SIGUSR1 killed `sleep` at once and the trap printed within 50 ms.
        std::thread::sleep(Duration::from_millis(300));
        assert!(process.try_status().is_none(), "the process was signalled");
        assert!(
            !process.stdout().contains("got USR1"),
            "the process was signalled"
        );
    }
    snapshot_pid(i32::MAX)
        .assert_clean_error("no process")
        .assert_code(GPUVM_ERROR);
}

/// And a gpuvm started with --snapshot-dir still snapshots on request, also when it runs
/// another copy of the binary (an upgrade, or a rebuild, since it started).
#[test]
fn snapshot_pid_signals_a_gpuvm_with_snapshot_dir() {
    let scratch = gpuvm_tests::Scratch::new("cli-errors", "snapshot-pid");
    snapshot_by_pid(&gpuvm_tests::gpuvm_bin(), &scratch.path("snap"));
    let copy = scratch.path("gpuvm-copy");
    std::fs::copy(gpuvm_tests::gpuvm_bin(), &copy).expect("copy the binary");
    snapshot_by_pid(&copy, &scratch.path("snap-of-copy"));
}

/// Runs `binary` with a snapshot dir `dir`, has `gpuvm snapshot --pid` snapshot it, and
/// checks that it ran on.
fn snapshot_by_pid(binary: &std::path::Path, dir: &std::path::Path) {
    let mut vmm = SpawnedProcess::spawn(
        binary,
        &[
            "run",
            "--memory",
            "64M",
            "--cmdline",
            "memloop 4M 1 0",
            "--snapshot-dir",
            dir.to_str().unwrap(),
        ],
    );
    vmm.wait_until("a memloop iteration", LIMIT, |p| ok_lines(p) >= 1);
    snapshot_pid(vmm.pid()).assert_code(0);
    vmm.wait_until("the snapshot", LIMIT, |_| dir.join("state").exists());
    let seen = ok_lines(&vmm);
    vmm.wait_until("the VM to run on", LIMIT, |p| ok_lines(p) > seen);
}

/// PUT /machine-config checks the vCPU count against this host's limit, as the builder
/// does, instead of accepting it and failing only at InstanceStart.
#[test]
fn machine_config_with_too_many_vcpus_is_refused_when_put() {
    let scratch = gpuvm_tests::Scratch::new("cli-errors", "vcpus");
    let socket = scratch.path("api.sock");
    let socket_arg = socket.to_str().unwrap();
    let mut vmm = SpawnedProcess::gpuvm(&["run", "--api-sock", socket_arg]);
    gpuvm_tests::wait_for_api_socket(&mut vmm, &socket);
    let ctl = |args: &[&str]| {
        let mut all = vec!["ctl", "--api-sock", socket_arg];
        all.extend_from_slice(args);
        run_gpuvm(&all, LIMIT)
    };
    ctl(&["set-machine-config", "--vcpus", "255", "--memory", "64M"])
        .assert_clean_error("invalid vCPU count 255: this host allows 1 to")
        .assert_code(GPUVM_ERROR);
    // The refused value was not kept.
    let config = ctl(&["get-machine-config"]);
    config.assert_code(0);
    assert!(
        config.stdout.contains("\"vcpu_count\":1"),
        "{}",
        config.stdout
    );
    ctl(&["set-machine-config", "--vcpus", "2", "--memory", "64M"]).assert_code(0);
}

/// What one run with arguments of any bytes produced.
struct BytesRun {
    status: std::process::ExitStatus,
    stdout: String,
    stderr: String,
}

/// Runs `program ARGS` (any bytes) to its end, its output into files of `scratch` (no
/// pipe to fill); killed, and the test failed, after `LIMIT`.
fn run_with_bytes(
    scratch: &gpuvm_tests::Scratch,
    program: &std::path::Path,
    args: &[std::ffi::OsString],
) -> BytesRun {
    let (out, err) = (scratch.path("stdout"), scratch.path("stderr"));
    let mut child = std::process::Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + LIMIT;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{program:?} {args:?} did not finish within {LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    BytesRun {
        status,
        stdout: String::from_utf8_lossy(&std::fs::read(&out).unwrap()).into_owned(),
        stderr: String::from_utf8_lossy(&std::fs::read(&err).unwrap()).into_owned(),
    }
}

/// Arguments that are not UTF-8 (paths on Linux are bytes; a kernel command line may be)
/// in every mode: never a panic (it was status 134, a Rust backtrace line), but success
/// where the bytes are a path gpuvm only opens, else one clear line naming the argument
/// and gpuvm's error status (the jailer's: 1).
#[test]
fn arguments_that_are_not_utf8_never_panic() {
    use std::ffi::OsString;
    use std::os::unix::ffi::{OsStrExt, OsStringExt};
    let scratch = gpuvm_tests::Scratch::new("cli-errors", "not-utf8");
    let gpuvm = gpuvm_tests::gpuvm_bin();
    let link = |name: &str| {
        let link = scratch.path(name);
        std::os::unix::fs::symlink(&gpuvm, &link).unwrap();
        link
    };
    let (cloud_hypervisor, firecracker, jailer) = (
        link("cloud-hypervisor"),
        link("firecracker"),
        link("jailer"),
    );
    let bytes = |b: &[u8]| OsString::from_vec(b.to_vec());
    // A path with bytes that are not UTF-8, in the scratch directory.
    let bad_path = |name: &[u8]| {
        let mut path = scratch.path("x").into_os_string().into_vec();
        path.pop();
        path.extend_from_slice(name);
        std::path::PathBuf::from(OsString::from_vec(path))
    };
    let kernel = bad_path(b"guest-\xff\xfe.elf");
    std::fs::write(&kernel, gpuvm_guest_images::TEST_GUEST_ELF).unwrap();
    let image = bad_path(b"image-\xff.elf");
    let os = |s: &str| OsString::from(s);
    let missing_socket = scratch.path("no-such.sock");

    /// What the run must end in: success, or an error whose stderr holds the text.
    enum Expect {
        Success,
        Error(&'static str, i32),
    }
    let cases: Vec<(&std::path::Path, Vec<OsString>, Expect)> = vec![
        (
            &gpuvm,
            vec![os("run"), os("--cmdline"), bytes(b"hello \xff\xfe")],
            Expect::Error(
                "the value of --cmdline is not valid UTF-8 (\"hello \\xff\\xfe\")",
                GPUVM_ERROR,
            ),
        ),
        (
            &gpuvm,
            vec![os("run"), os("--kernel"), kernel.clone().into()],
            Expect::Success,
        ),
        (
            &gpuvm,
            vec![os("run"), os("--kernel"), bytes(b"/nonexistent/\xff")],
            Expect::Error("cannot open kernel image /nonexistent/", GPUVM_ERROR),
        ),
        (
            &gpuvm,
            vec![os("--log-level"), bytes(b"\xff"), os("run")],
            Expect::Error("the value of --log-level is not valid UTF-8", GPUVM_ERROR),
        ),
        (
            &gpuvm,
            vec![os("guest-image"), os("--output"), image.clone().into()],
            Expect::Success,
        ),
        (
            &gpuvm,
            vec![
                os("ctl"),
                os("--api-sock"),
                missing_socket.clone().into(),
                os("set-boot-source"),
                os("--kernel"),
                bytes(b"/k\xff"),
            ],
            Expect::Error("--kernel", GPUVM_ERROR),
        ),
        (
            &cloud_hypervisor,
            vec![os("--kernel"), bytes(b"/k\xff")],
            Expect::Error("the value of --kernel is not valid UTF-8", GPUVM_ERROR),
        ),
        // Under gpuvm's own name, the Cloud Hypervisor flags pick that front end.
        (
            &gpuvm,
            vec![
                os("--api-socket"),
                os("/s"),
                os("--kernel"),
                bytes(b"/k\xff"),
            ],
            Expect::Error("the value of --kernel is not valid UTF-8", GPUVM_ERROR),
        ),
        (
            &firecracker,
            vec![os("--config-file"), bytes(b"/c\xff.json")],
            Expect::Error("the value of --config-file is not valid UTF-8", GPUVM_ERROR),
        ),
        (
            &jailer,
            vec![os("--id"), os("a"), os("--exec-file"), bytes(b"/f\xff")],
            Expect::Error("the value of --exec-file is not valid UTF-8", 1),
        ),
    ];
    for (program, args, expect) in cases {
        let out = run_with_bytes(&scratch, program, &args);
        let what = format!(
            "{} {:?}: status {:?}\n--- stdout\n{}\n--- stderr\n{}",
            program.display(),
            args,
            out.status,
            out.stdout,
            out.stderr
        );
        let code = out.status.code();
        assert!(code.is_some(), "killed by a signal: {what}");
        assert!(!matches!(code, Some(134 | 101)), "{what}");
        assert!(!out.stderr.contains("panicked"), "{what}");
        match expect {
            Expect::Success => assert_eq!(code, Some(0), "{what}"),
            Expect::Error(needle, status) => {
                assert_eq!(code, Some(status), "{what}");
                assert!(out.stderr.contains(needle), "lacks {needle:?}: {what}");
                assert!(out.stderr.contains("error: "), "{what}");
                assert_eq!(out.stderr.trim_end().lines().count(), 1, "{what}");
            }
        }
    }
    assert_eq!(
        std::fs::read(&image).unwrap(),
        gpuvm_guest_images::TEST_GUEST_ELF,
        "guest-image --output {:?}",
        image.as_os_str().as_bytes()
    );
}

/// Under gpuvm's own name the command line picks the front end; flags of two front ends
/// are refused with what selects which, and gpuvm's own flags stay gpuvm's.
#[test]
fn mixed_front_end_flags_are_refused_naming_them() {
    let out = run_gpuvm(&["--api-socket", "/s", "--api-sock", "/t"], LIMIT);
    out.assert_clean_error("--api-socket selects Cloud Hypervisor's (cloud-hypervisor)")
        .assert_stderr_has("--api-sock selects Firecracker's (firecracker)")
        .assert_stderr_has("--exec-file")
        .assert_code(GPUVM_ERROR);
    run_gpuvm(&["--id", "vm1"], LIMIT)
        .assert_clean_error("--id is taken by firecracker and jailer")
        .assert_code(GPUVM_ERROR);
    run_gpuvm(&["--version"], LIMIT)
        .assert_code(0)
        .assert_stdout_has("gpuvm ");
    // Cloud Hypervisor's own refusal, reached through its flags.
    run_gpuvm(&["--api-socket", "/s", "--balloon", "size=1G"], LIMIT)
        .assert_clean_error("--balloon: not supported by gpuvm's Cloud Hypervisor mode")
        .assert_code(GPUVM_ERROR);
    // Firecracker's, through its flags.
    run_gpuvm(&["--no-api"], LIMIT)
        .assert_clean_error("--no-api needs --config-file")
        .assert_code(GPUVM_ERROR);
    // The jailer's, through its flags (its status: 1).
    run_gpuvm(
        &[
            "--exec-file",
            "/nonexistent/vmm",
            "--uid",
            "1",
            "--gid",
            "1",
        ],
        LIMIT,
    )
    .assert_clean_error("--id is required")
    .assert_code(1);
}

/// `gpuvm ctl` against a socket that takes the request and never answers (a stuck VMM):
/// with GPUVM_CTL_TIMEOUT_S it gives up after that long, saying so, instead of the 600 s
/// it waits for a snapshot of a large guest.
#[test]
fn ctl_gives_up_on_a_vmm_that_never_answers_after_its_timeout() {
    let dir = std::env::temp_dir().join(format!("gpuvm-ctl-silent-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let socket = dir.join("api.sock");
    let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    // Accepts and holds each connection, reading the request, answering nothing.
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming().flatten() {
            held.push(stream);
        }
    });
    let out = gpuvm_tests::run_gpuvm_with_env(
        &[
            "ctl",
            "--api-sock",
            socket.to_str().unwrap(),
            "raw",
            "GET",
            "/",
        ],
        &[("GPUVM_CTL_TIMEOUT_S", "1")],
        LIMIT,
        None,
    );
    out.assert_clean_error("gpuvm did not answer within 1 s");
    assert!(out.elapsed < Duration::from_secs(30), "{:?}", out.elapsed);
    let _ = std::fs::remove_dir_all(&dir);
}
