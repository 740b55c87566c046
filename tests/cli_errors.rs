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
