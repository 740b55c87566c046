//! gpuvm's exit statuses: the guest's own status passes through; gpuvm's own errors, a
//! triple fault and a seccomp violation each have a status of their own (README, "Exit
//! status").

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use gpuvm_tests::{run_gpuvm, run_until_snapshot, Scratch};
use gpuvm_vmm::exit_status::{GPUVM_ERROR, TRIPLE_FAULT};

const LIMIT: Duration = Duration::from_secs(60);

/// Every way gpuvm itself fails exits with the same status, which no test guest status
/// uses: bad arguments, bad input, a refused API request, an unwritable output.
#[test]
fn gpuvm_errors_have_their_own_status() {
    let error = i32::from(GPUVM_ERROR);
    let scratch = Scratch::new("exit-status", "errors");
    let missing_socket = scratch.path("no.sock");
    let unwritable = scratch.path("no-such-dir/guest.elf");
    let cases: [&[&str]; 6] = [
        &["run", "--kernel", "/nonexistent/vmlinux"],
        &["run", "--no-such-flag"],
        &["--log-format", "yaml", "run"],
        &["run", "--vcpus", "0"],
        &[
            "ctl",
            "--api-sock",
            missing_socket.to_str().unwrap(),
            "info",
        ],
        &["guest-image", "--output", unwritable.to_str().unwrap()],
    ];
    for args in cases {
        let out = run_gpuvm(args, LIMIT);
        out.assert_clean_error("");
        out.assert_code(error);
    }
    // Help and version are answers, not errors.
    run_gpuvm(&["--help"], LIMIT).assert_code(0);
    run_gpuvm(&["--version"], LIMIT).assert_code(0);
}

/// The guest's status is gpuvm's status, unchanged: 0 for `hello`, the test guest's
/// setup-failure status 2 for a workload it does not know.
#[test]
fn the_guest_status_passes_through() {
    run_gpuvm(&["run"], LIMIT).assert_code(0);
    let out = run_gpuvm(&["run", "--cmdline", "nosuchworkload"], LIMIT);
    out.assert_code(2);
    assert!(!out.stderr.contains("gpuvm: error"), "{}", out.stderr);
}

/// A 64-bit ELF kernel whose code polls the serial port until a byte arrives, then runs
/// `ud2`: with gpuvm's empty boot IDT the #UD cannot be delivered, and the CPU triple
/// faults (KVM_EXIT_SHUTDOWN).
fn triple_fault_kernel(path: &Path) {
    const LOAD: u64 = 0x10_0000;
    const HEADERS: u64 = 64 + 56;
    let code: &[u8] = &[
        0x66, 0xba, 0xfd, 0x03, // mov dx, 0x3fd (COM1 line status)
        0xec, // in al, dx
        0xa8, 0x01, // test al, 1 (data ready)
        0x74, 0xf7, // jz back to the mov
        0x0f, 0x0b, // ud2
    ];
    let size = HEADERS + code.len() as u64;
    let mut elf = Vec::new();
    elf.extend_from_slice(b"\x7fELF\x02\x01\x01");
    elf.resize(16, 0);
    elf.extend_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    elf.extend_from_slice(&62u16.to_le_bytes()); // x86-64
    elf.extend_from_slice(&1u32.to_le_bytes());
    elf.extend_from_slice(&(LOAD + HEADERS).to_le_bytes()); // entry: the code
    elf.extend_from_slice(&64u64.to_le_bytes()); // program headers
    elf.extend_from_slice(&0u64.to_le_bytes()); // no sections
    elf.extend_from_slice(&0u32.to_le_bytes());
    for half in [64u16, 56, 1, 64, 0, 0] {
        elf.extend_from_slice(&half.to_le_bytes());
    }
    elf.extend_from_slice(&1u32.to_le_bytes()); // PT_LOAD
    elf.extend_from_slice(&5u32.to_le_bytes()); // R+X
    for word in [0, LOAD, LOAD, size, size, 0x1000] {
        elf.extend_from_slice(&word.to_le_bytes());
    }
    elf.extend_from_slice(code);
    std::fs::write(path, elf).expect("write the kernel");
}

/// Runs `gpuvm ARGS`, writes one byte to its stdin once `ready` holds for its stderr or
/// after `delay`, and returns (exit code, stderr). Killed after LIMIT.
fn run_then_poke(args: &[&str], scratch: &Scratch, delay: Duration) -> (Option<i32>, String) {
    let stderr_path = scratch.path("stderr");
    let mut child = Command::new(gpuvm_tests::gpuvm_bin())
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr_path).unwrap())
        .spawn()
        .expect("spawn gpuvm");
    let deadline = Instant::now() + LIMIT;
    let mut stdin = child.stdin.take();
    let poke_at = Instant::now() + delay;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if Instant::now() >= poke_at {
            if let Some(mut pipe) = stdin.take() {
                let _ = pipe.write_all(b"x");
                // Keep the pipe open: EOF is not input.
                std::mem::forget(pipe);
            }
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "gpuvm {args:?} did not end:\n{}",
                std::fs::read_to_string(&stderr_path).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let stderr = std::fs::read_to_string(&stderr_path).unwrap_or_default();
    (status.code(), stderr)
}

/// A fresh guest that triple-faults is not a clean end: its own status and a log line.
#[test]
fn a_triple_fault_has_its_own_status() {
    let scratch = Scratch::new("exit-status", "triple");
    let kernel = scratch.path("kernel.elf");
    triple_fault_kernel(&kernel);
    let (code, stderr) = run_then_poke(
        &[
            "run",
            "--kernel",
            kernel.to_str().unwrap(),
            "--memory",
            "64M",
        ],
        &scratch,
        Duration::from_millis(300),
    );
    assert_eq!(code, Some(i32::from(TRIPLE_FAULT)), "{stderr}");
    assert!(stderr.contains("triple-faulted"), "{stderr}");
    // Where it was: the ud2 (the code's tenth byte), in 64-bit mode with gpuvm's boot IDT.
    assert!(
        stderr.contains("vCPU 0 at the triple fault: rip 0x100081 "),
        "{stderr}"
    );
    assert!(stderr.contains(" efer 0x"), "{stderr}");
}

/// The same for a restored guest (eager and lazy): a damaged or hostile snapshot whose
/// guest triple-faults must not look like a guest that ended cleanly.
#[test]
fn a_restored_guest_that_triple_faults_is_reported() {
    let scratch = Scratch::new("exit-status", "restored-triple");
    let kernel = scratch.path("kernel.elf");
    triple_fault_kernel(&kernel);
    let dir = scratch.path("snap");
    let kernel_arg = kernel.to_str().unwrap();
    let dir_arg = dir.to_str().unwrap();
    // The guest polls until it gets input, which it never does here.
    let run = ["run", "--kernel", kernel_arg, "--memory", "64M"];
    run_until_snapshot(&run, &dir, 200, LIMIT);
    for mode in ["eager", "lazy"] {
        let (code, stderr) = run_then_poke(
            &["restore", "--snapshot", dir_arg, "--restore-mode", mode],
            &scratch,
            Duration::from_millis(300),
        );
        assert_eq!(code, Some(i32::from(TRIPLE_FAULT)), "{mode}: {stderr}");
        assert!(stderr.contains("triple-faulted"), "{mode}: {stderr}");
    }
}

/// Logging with stderr on a terminal: env_logger would ask isatty(2) (TCGETS) on every record,
/// from vCPU and device threads whose seccomp filters refuse it. Run under `script`, which
/// gives gpuvm a pseudo-terminal, at debug level, with 2 vCPUs and a virtio device's thread.
#[test]
fn logs_on_a_terminal_are_not_a_seccomp_kill() {
    if Command::new("script").arg("--version").output().is_err() {
        eprintln!("skipped: no `script` (util-linux) to give gpuvm a terminal");
        return;
    }
    let gpuvm = gpuvm_tests::gpuvm_bin();
    let command = format!(
        "{} --log-level debug run --vcpus 2 --rng --cmdline hello",
        gpuvm.display()
    );
    let started = Instant::now();
    let out = Command::new("script")
        .args(["-qefc", &command, "/dev/null"])
        .stdin(Stdio::null())
        .output()
        .expect("run script");
    assert!(started.elapsed() < LIMIT);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!text.contains("blocked system call"), "{text}");
    assert!(text.contains("testguest: hello from ring 3"), "{text}");
    assert!(
        text.contains("DEBUG"),
        "debug records reached the terminal: {text}"
    );
    assert_eq!(out.status.code(), Some(0), "{text}");
}
