//! Bad input to the CLI: one clear line and a non-zero exit, never a panic or a hang.

use std::io::Write;
use std::time::Duration;

use gpuvm_tests::run_gpuvm;

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
    assert_eq!(
        output.status.code(),
        Some(gpuvm_vmm::exit_status::GPUVM_ERROR.into()),
        "{stderr}"
    );
    assert!(stderr.contains("/dev/kvm"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

fn tempfile(name: &str) -> (std::path::PathBuf, std::fs::File) {
    let path = std::env::temp_dir().join(format!("gpuvm-test-{}-{name}", std::process::id()));
    let file = std::fs::File::create(&path).unwrap();
    (path, file)
}
