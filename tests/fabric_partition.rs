//! NVSwitch shared-mode fabric partitions with a fake fabric manager: `gpuvm run
//! --fabric-partition ID` asks the manager to activate the partition before the VM's GPU
//! (the emulated one, over vfio-user) is attached and to deactivate it after the VM
//! ends, through a command (a small shell script) or a socket (a small server in this
//! test). A refusal or a manager that hangs is a clear error with nothing attached. Seccomp
//! is on (the default): the deactivation happens after the VMM thread took its filter.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpuvm_tests::{run_gpuvm_with_env, RunOutput, Scratch, SpawnedProcess};

const LIMIT: Duration = Duration::from_secs(120);

fn emu_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_gpuvm-emu-gpu"))
}

/// The emulated GPU on `socket`, once it listens.
fn start_emu(socket: &Path) -> SpawnedProcess {
    gpuvm_tests::start_emu_gpu(&emu_bin(), socket, &[])
}

/// A fake manager command at `dir/manager`: appends "OP ID" to `dir/requests`, then
/// behaves as `body` says (shell, with $1 the operation).
fn manager_script(scratch: &Scratch, body: &str) -> PathBuf {
    let script = scratch.path("manager");
    let log = scratch.path("requests");
    std::fs::write(
        &script,
        format!("#!/bin/sh\necho \"$1 $2\" >> '{}'\n{body}\n", log.display()),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    script
}

fn requests(scratch: &Scratch) -> Vec<String> {
    std::fs::read_to_string(scratch.path("requests"))
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect()
}

/// The fake fabric manager a run talks to.
#[derive(Clone, Copy)]
enum Manager<'a> {
    Command(&'a Path),
    Socket(&'a Path),
}

/// `gpuvm run` with the emulated GPU on `socket`, partition 3 through `manager` (with
/// its timeout in seconds when given), logging at info.
fn run_vm(socket: &Path, manager: Manager, timeout_s: Option<&str>) -> RunOutput {
    let (flag, path) = match manager {
        Manager::Command(path) => ("--fabric-manager-command", path),
        Manager::Socket(path) => ("--fabric-manager-socket", path),
    };
    let mut args = vec![
        "run",
        "--vfio-user",
        socket.to_str().unwrap(),
        "--fabric-partition",
        "3",
        flag,
        path.to_str().unwrap(),
    ];
    if let Some(seconds) = timeout_s {
        args.extend(["--fabric-manager-timeout-s", seconds]);
    }
    run_gpuvm_with_env(&args, &[("GPUVM_LOG", "info")], LIMIT, None)
}

/// The start stopped before the GPU's device process was connected to.
fn assert_nothing_attached(out: &RunOutput) {
    assert!(
        !out.stderr.contains("vfio-user: connected"),
        "nothing attached:\n{}",
        out.stderr
    );
}

/// Where `needle` first appears in `text` (panics if it does not).
fn at(text: &str, needle: &str) -> usize {
    text.find(needle)
        .unwrap_or_else(|| panic!("no {needle:?} in:\n{text}"))
}

/// The partition is active before the GPU is attached (its reset is the attach's first
/// step) and deactivated after the VM ended (the device's last reset).
fn assert_wraps_the_vm(out: &RunOutput) {
    out.assert_code(0).assert_stdout_has("hello");
    let log = &out.stderr;
    let activated = at(log, "fabric partition 3 activated");
    let first_reset = at(log, "reset by VFIO_USER_DEVICE_RESET");
    let last_reset = log.rfind("reset by VFIO_USER_DEVICE_RESET").unwrap();
    let deactivated = at(log, "fabric partition 3 deactivated");
    assert!(
        activated < first_reset && last_reset < deactivated,
        "activate, attach, ..., detach, deactivate:\n{log}"
    );
}

#[test]
fn a_manager_command_activates_before_attach_and_deactivates_after_the_end() {
    let scratch = Scratch::new("fabric", "command");
    let manager = manager_script(&scratch, "exit 0");
    let socket = scratch.path("gpu.sock");
    let emu = start_emu(&socket);
    let out = run_vm(&socket, Manager::Command(&manager), None);
    assert_wraps_the_vm(&out);
    assert_eq!(requests(&scratch), ["activate 3", "deactivate 3"]);
    emu.wait(Duration::from_secs(10));
}

#[test]
fn a_manager_command_that_refuses_stops_the_start_with_nothing_attached() {
    let scratch = Scratch::new("fabric", "refuses");
    let manager = manager_script(
        &scratch,
        "echo 'partition 3: GPUs in use by another partition' >&2; exit 1",
    );
    let socket = scratch.path("gpu.sock");
    let emu = start_emu(&socket);
    let out = run_vm(&socket, Manager::Command(&manager), None);
    out.assert_clean_error("refused to activate it")
        .assert_clean_error("GPUs in use by another partition");
    assert_eq!(out.code(), Some(125));
    assert_nothing_attached(&out);
    // Never activated, so never deactivated.
    assert_eq!(requests(&scratch), ["activate 3"]);
    kill(emu);
}

#[test]
fn a_manager_command_that_hangs_times_out() {
    let scratch = Scratch::new("fabric", "hangs");
    let manager = manager_script(&scratch, "exec sleep 60");
    let socket = scratch.path("gpu.sock");
    let emu = start_emu(&socket);
    let started = Instant::now();
    let out = run_vm(&socket, Manager::Command(&manager), Some("1"));
    assert!(started.elapsed() < Duration::from_secs(20), "bounded");
    out.assert_clean_error("did not activate it within 1s");
    assert_nothing_attached(&out);
    kill(emu);
}

/// A start that fails after the activation (the GPU's socket has no server) still
/// deactivates; a deactivation the manager refuses at the end makes the run fail.
#[test]
fn a_failed_start_deactivates_and_a_refused_deactivation_is_an_error() {
    let scratch = Scratch::new("fabric", "failed-start");
    let manager = manager_script(&scratch, "exit 0");
    let out = run_vm(
        &scratch.path("nobody.sock"),
        Manager::Command(&manager),
        None,
    );
    out.assert_clean_error("vfio-user socket");
    assert_eq!(requests(&scratch), ["activate 3", "deactivate 3"]);

    let scratch = Scratch::new("fabric", "refused-end");
    let manager = manager_script(
        &scratch,
        "[ \"$1\" = deactivate ] && { echo 'partition 3 is busy' >&2; exit 2; }; exit 0",
    );
    let socket = scratch.path("gpu.sock");
    let emu = start_emu(&socket);
    let out = run_vm(&socket, Manager::Command(&manager), None);
    assert!(out.stdout.contains("hello"), "the VM ran: {}", out.stdout);
    out.assert_clean_error("refused to deactivate it")
        .assert_clean_error("partition 3 is busy");
    assert_eq!(requests(&scratch), ["activate 3", "deactivate 3"]);
    emu.wait(Duration::from_secs(10));
}

/// A manager that hangs on the deactivation at the VM's end: the run fails with the
/// timeout (the helper's watchdog ends the command) instead of hanging.
#[test]
fn a_manager_command_that_hangs_on_deactivation_times_out() {
    let scratch = Scratch::new("fabric", "hangs-at-end");
    let manager = manager_script(&scratch, "[ \"$1\" = deactivate ] && exec sleep 60; exit 0");
    let socket = scratch.path("gpu.sock");
    let emu = start_emu(&socket);
    let started = Instant::now();
    let out = run_vm(&socket, Manager::Command(&manager), Some("1"));
    assert!(started.elapsed() < Duration::from_secs(20), "bounded");
    assert!(out.stdout.contains("hello"), "the VM ran: {}", out.stdout);
    out.assert_clean_error("did not deactivate it within 1s");
    assert_eq!(requests(&scratch), ["activate 3", "deactivate 3"]);
    emu.wait(Duration::from_secs(10));
}

/// How the fake socket manager answers.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Behaviour {
    /// `{"ok":true}`, keeping the connection for further requests.
    Accept,
    /// `{"ok":true}`, then closing the connection after each answer.
    AcceptOnce,
    /// `{"ok":false,"error":"partition busy"}`.
    Refuse,
    /// Reads the request and never answers.
    Hang,
}

/// The fake manager on `socket`: records each request line, answers as told.
fn serve_manager(socket: &Path, behaviour: Behaviour) -> Arc<Mutex<Vec<String>>> {
    let _ = std::fs::remove_file(socket);
    let listener = UnixListener::bind(socket).expect("bind");
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = seen.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { return };
            let record = record.clone();
            std::thread::spawn(move || {
                let mut writer = stream.try_clone().unwrap();
                for line in BufReader::new(stream).lines() {
                    let Ok(line) = line else { return };
                    let request: serde_json::Value =
                        serde_json::from_str(&line).expect("a JSON request line");
                    record.lock().unwrap().push(format!(
                        "{} {}",
                        request["op"].as_str().unwrap(),
                        request["partition"]
                    ));
                    let answer = match behaviour {
                        Behaviour::Accept | Behaviour::AcceptOnce => r#"{"ok":true}"#,
                        Behaviour::Refuse => r#"{"ok":false,"error":"partition busy"}"#,
                        Behaviour::Hang => {
                            std::thread::sleep(Duration::from_secs(60));
                            return;
                        }
                    };
                    if writeln!(writer, "{answer}").is_err() || behaviour == Behaviour::AcceptOnce {
                        return;
                    }
                }
            });
        }
    });
    seen
}

#[test]
fn a_manager_socket_activates_and_deactivates_on_one_connection_or_a_new_one() {
    for (name, behaviour) in [
        ("kept", Behaviour::Accept),
        ("closed", Behaviour::AcceptOnce),
    ] {
        let scratch = Scratch::new("fabric", &format!("socket-{name}"));
        let manager = scratch.path("fm.sock");
        let seen = serve_manager(&manager, behaviour);
        let socket = scratch.path("gpu.sock");
        let emu = start_emu(&socket);
        let out = run_vm(&socket, Manager::Socket(&manager), None);
        assert_wraps_the_vm(&out);
        assert_eq!(
            *seen.lock().unwrap(),
            ["activate 3", "deactivate 3"],
            "{name}"
        );
        emu.wait(Duration::from_secs(10));
    }
}

#[test]
fn a_manager_socket_that_refuses_or_hangs_is_a_clear_error() {
    let scratch = Scratch::new("fabric", "socket-refuses");
    let manager = scratch.path("fm.sock");
    let seen = serve_manager(&manager, Behaviour::Refuse);
    let socket = scratch.path("gpu.sock");
    let emu = start_emu(&socket);
    let out = run_vm(&socket, Manager::Socket(&manager), None);
    out.assert_clean_error("refused to activate it: partition busy");
    assert_nothing_attached(&out);
    assert_eq!(*seen.lock().unwrap(), ["activate 3"]);

    let hanging = scratch.path("fm-hangs.sock");
    serve_manager(&hanging, Behaviour::Hang);
    let started = Instant::now();
    let out = run_vm(&socket, Manager::Socket(&hanging), Some("1"));
    assert!(started.elapsed() < Duration::from_secs(20), "bounded");
    out.assert_clean_error("did not activate it within 1s");
    assert_nothing_attached(&out);
    kill(emu);

    // No manager listening at all.
    let out = run_vm(&socket, Manager::Socket(&scratch.path("nobody.sock")), None);
    out.assert_clean_error("cannot be reached");
}

fn kill(mut emu: SpawnedProcess) {
    emu.signal(libc::SIGKILL);
    emu.wait(Duration::from_secs(10));
}
