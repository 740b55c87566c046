//! Requests that arrive while the command line is still starting the VM wait for that
//! start instead of failing, as Cloud Hypervisor's and Firecracker's do (issue 26).
//!
//! `cloud-hypervisor --api-socket S --restore source_url=...` binds S before the restore
//! is through; a client that sends `vm.resume` (or `vm.info`) the moment S accepts must
//! find the VM restored (Paused, then Running), never "the VM is not created" (404). The
//! same for `firecracker --api-sock S --config-file F`: `GET /` the moment S accepts says
//! Running, never "Not started". Each race is run many times, from the moment the socket
//! file appears, with the connection retried only while it is refused; every answer must
//! come within [`LIMIT`] (a request left in the VMM thread's queue when the VM starts
//! running must still be served).

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::thread;
use std::time::{Duration, Instant};

use gpuvm_tests::cloud_hypervisor_support::{guest_image, spawn_ch};
use gpuvm_tests::{api_expect, firecracker_link, Scratch, SpawnedProcess};

const LIMIT: Duration = Duration::from_secs(30);
/// Races of Cloud Hypervisor's restore; the bug this guards against showed in about one
/// run in five.
const CH_REPETITIONS: usize = 20;
/// Races of Firecracker's config-file boot.
const FC_REPETITIONS: usize = 10;
/// The guest: a memory loop that never ends (the process ends when the test says so).
const GUEST_CMDLINE: &str = "memloop 4M 7 0";

/// Waits, without sleeping, until `socket`'s file exists; panics if `process` ends first.
fn wait_for_socket_file(process: &mut SpawnedProcess, socket: &Path) {
    let deadline = Instant::now() + LIMIT;
    while !socket.exists() {
        assert!(
            process.try_status().is_none() && Instant::now() < deadline,
            "no API socket at {}: {}",
            socket.display(),
            process.stderr()
        );
        thread::yield_now();
    }
}

/// An answer: its status and body.
struct Answer {
    status: u16,
    body: String,
}

/// `method path` (no body) on a connection of its own; None when the socket does not
/// accept connections (yet). Panics when no whole answer comes within [`LIMIT`].
fn ask(socket: &Path, method: &str, path: &str) -> Option<Answer> {
    let mut stream = UnixStream::connect(socket).ok()?;
    stream.set_read_timeout(Some(LIMIT)).unwrap();
    let request =
        format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).unwrap();
    let mut text = String::new();
    if let Err(error) = stream.read_to_string(&mut text) {
        panic!("{method} {path}: no answer within {LIMIT:?} ({error}); so far {text:?}");
    }
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("{method} {path}: no status in {text:?}"));
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b).into();
    Some(Answer { status, body })
}

/// Sends `method path` until the socket accepts it (a connection refused between the
/// socket's bind and listen is tried again at once); the first answer.
fn first_answer(socket: &Path, method: &str, path: &str) -> Answer {
    let deadline = Instant::now() + LIMIT;
    loop {
        if let Some(answer) = ask(socket, method, path) {
            return answer;
        }
        assert!(
            Instant::now() < deadline,
            "{method} {path}: {} accepts no connection",
            socket.display()
        );
        thread::yield_now();
    }
}

/// The VM's state as vm.info gives it.
fn vm_state(socket: &Path) -> String {
    let answer = ask(socket, "GET", "/api/v1/vm.info").expect("the API socket accepts");
    assert_eq!(answer.status, 200, "vm.info: {}", answer.body);
    let info: serde_json::Value = serde_json::from_str(&answer.body).unwrap();
    info["state"].as_str().unwrap_or_default().to_string()
}

/// The snapshot of a running VM made through Cloud Hypervisor's command line and API.
fn ch_snapshot(scratch: &Scratch) -> std::path::PathBuf {
    let kernel = guest_image(scratch);
    let api = scratch.path("boot.sock");
    let snapshot = scratch.path("snap");
    let mut vm = spawn_ch(
        scratch,
        &[
            "--api-socket",
            api.to_str().unwrap(),
            "--kernel",
            kernel.to_str().unwrap(),
            "--cmdline",
            GUEST_CMDLINE,
            "--memory",
            "size=64M",
        ],
    );
    vm.wait_for_stdout("memloop: iter 1 ok", LIMIT);
    let destination = format!(r#"{{"destination_url":"file://{}"}}"#, snapshot.display());
    api_expect(&api, 204, "PUT", "/api/v1/vm.snapshot", Some(&destination));
    api_expect(&api, 204, "PUT", "/api/v1/vmm.shutdown", None);
    vm.wait(LIMIT);
    snapshot
}

/// `cloud-hypervisor --api-socket ... --restore source_url=...`, then `vm.resume` and
/// `vm.info` at once from two clients, from the moment the socket file appears: vm.resume
/// is answered 204 and vm.info 200 (Paused or Running, whichever came first), never 404;
/// then the restored guest runs on.
#[test]
fn requests_during_a_command_line_restore_wait_for_it() {
    let started = Instant::now();
    let scratch = Scratch::new("ch_restore_wait", "restore");
    let snapshot = ch_snapshot(&scratch);
    let source = format!("source_url=file://{}", snapshot.display());
    for round in 0..CH_REPETITIONS {
        let api = scratch.path(&format!("restore-{round}.sock"));
        let mut vm = spawn_ch(
            &scratch,
            &["--api-socket", api.to_str().unwrap(), "--restore", &source],
        );
        wait_for_socket_file(&mut vm, &api);
        let (resumed, info) = thread::scope(|s| {
            let resume = s.spawn(|| first_answer(&api, "PUT", "/api/v1/vm.resume"));
            let info = s.spawn(|| first_answer(&api, "GET", "/api/v1/vm.info"));
            (resume.join().unwrap(), info.join().unwrap())
        });
        let describe = |what: &str, answer: &Answer| {
            format!(
                "round {round}: the first {what} answered {} {}\n--- stderr\n{}",
                answer.status,
                answer.body,
                vm.stderr()
            )
        };
        assert_eq!(resumed.status, 204, "{}", describe("vm.resume", &resumed));
        assert_eq!(info.status, 200, "{}", describe("vm.info", &info));
        let state: serde_json::Value = serde_json::from_str(&info.body).unwrap();
        assert!(
            matches!(state["state"].as_str(), Some("Paused" | "Running")),
            "{}",
            describe("vm.info", &info)
        );
        assert_eq!(vm_state(&api), "Running", "round {round}");
        // The guest goes on from the snapshot: its loop counts on, not from the start.
        vm.wait_for_stdout("memloop: iter ", LIMIT);
        let shutdown = ask(&api, "PUT", "/api/v1/vmm.shutdown").expect("the API socket accepts");
        assert_eq!(shutdown.status, 204, "round {round}: {}", shutdown.body);
        let out = vm.wait(LIMIT);
        assert!(
            !out.stdout.contains("memloop: cpus="),
            "round {round}: the guest booted again: {}",
            out.describe()
        );
        assert!(!out.stderr.contains("panicked"), "{}", out.describe());
    }
    eprintln!("{CH_REPETITIONS} restores raced in {:?}", started.elapsed());
}

/// `firecracker --api-sock ... --config-file ...` boots the VM from the file; `GET /` from
/// the moment the socket file appears says Running, as Firecracker, which builds the VM
/// before it serves the API's queue, answers it.
#[test]
fn requests_during_a_config_file_boot_wait_for_it() {
    let scratch = Scratch::new("ch_restore_wait", "fc-config");
    let kernel = guest_image(&scratch);
    let config = scratch.path("vm.json");
    std::fs::write(
        &config,
        format!(
            r#"{{"boot-source": {{"kernel_image_path": "{}", "boot_args": "{GUEST_CMDLINE}"}},
            "machine-config": {{"vcpu_count": 1, "mem_size_mib": 64, "smt": false}}}}"#,
            kernel.display(),
        ),
    )
    .unwrap();
    let link = firecracker_link(&scratch);
    for round in 0..FC_REPETITIONS {
        let api = scratch.path(&format!("fc-{round}.sock"));
        let mut vm = SpawnedProcess::spawn(
            &link,
            &[
                "--api-sock",
                api.to_str().unwrap(),
                "--config-file",
                config.to_str().unwrap(),
            ],
        );
        wait_for_socket_file(&mut vm, &api);
        let answer = first_answer(&api, "GET", "/");
        assert_eq!(answer.status, 200, "round {round}: {}", answer.body);
        let info: serde_json::Value = serde_json::from_str(&answer.body).unwrap();
        assert_eq!(
            info["state"],
            "Running",
            "round {round}: the first GET / answered {info}\n--- stderr\n{}",
            vm.stderr()
        );
        vm.wait_for_stdout("memloop: iter ", LIMIT);
    }
}
