//! Pause and resume of a VM with two vCPUs: redundant and concurrent `PATCH /vm`, after
//! `PUT /snapshot/load` with `resume_vm`, and with an external page-fault handler that
//! never answers (the API must stay answerable and the process able to end).
//!
//! The guest is `memloop` on both vCPUs: they meet at a barrier every iteration, so the
//! `iter N ok` lines go on only while both run, and stop when either is paused.

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpuvm_api::client;
use gpuvm_tests::{
    external_load_body, run_until_snapshot, start_uffd_handler, wait_for_api_socket, RunOutput,
    Scratch, SpawnedProcess,
};
use serde_json::Value;

const LIMIT: Duration = Duration::from_secs(60);
/// How long a pause or resume with nothing to wait for may take on a loaded host.
const AT_ONCE: Duration = Duration::from_secs(2);
/// How long a pause may take to fail when a vCPU cannot stop.
const PROMPT_FAILURE: Duration = Duration::from_secs(6);
/// How long the process may take to end once asked to.
const END_LIMIT: Duration = Duration::from_secs(15);
const HANDLER: &str = env!("CARGO_BIN_EXE_gpuvm-test-uffd-handler");
const WORKLOAD: &str = "memloop 16M 1 0";

/// A gpuvm process serving an API socket; killed on drop.
struct Vmm {
    process: SpawnedProcess,
    socket: PathBuf,
}

impl Vmm {
    /// Starts `gpuvm run --api-sock SOCKET` and waits for the socket.
    fn start(socket: &Path) -> Vmm {
        let mut process =
            SpawnedProcess::gpuvm(&["run", "--api-sock", socket.to_str().expect("utf-8 path")]);
        wait_for_api_socket(&mut process, socket);
        Vmm {
            process,
            socket: socket.to_path_buf(),
        }
    }

    fn describe(&self) -> String {
        format!(
            "--- stdout (last 2000 bytes)\n{}\n--- stderr\n{}",
            tail(&self.process.stdout(), 2000),
            self.process.stderr()
        )
    }

    /// One request: its status, body and how long it took to answer.
    fn call(&self, method: &str, path: &str, body: Option<&str>) -> (u16, String, Duration) {
        let started = Instant::now();
        let response = client::request(&self.socket, method, path, body)
            .unwrap_or_else(|e| panic!("{method} {path}: {e}\n{}", self.describe()));
        (response.status, response.body, started.elapsed())
    }

    /// A request that must answer `status`; returns the body.
    fn expect(&self, status: u16, method: &str, path: &str, body: Option<&str>) -> String {
        let (got, text, _) = self.call(method, path, body);
        assert_eq!(
            got,
            status,
            "{method} {path} -> {text}\n{}",
            self.describe()
        );
        text
    }

    /// `GET /`'s state, which must answer at once.
    fn state(&self) -> String {
        let (status, body, took) = self.call("GET", "/", None);
        assert_eq!(status, 200, "GET / -> {body}");
        assert!(took < AT_ONCE, "GET / took {took:?}\n{}", self.describe());
        let json: Value = serde_json::from_str(&body).expect("GET / JSON");
        json["state"].as_str().expect("state").to_string()
    }

    /// `PATCH /vm` to `state` ("Paused" or "Resumed"), which must succeed at once.
    fn patch_at_once(&self, state: &str) {
        let body = format!(r#"{{"state": "{state}"}}"#);
        let (status, text, took) = self.call("PATCH", "/vm", Some(&body));
        assert_eq!(
            status,
            204,
            "PATCH /vm {state} -> {text}\n{}",
            self.describe()
        );
        assert!(
            took < AT_ONCE,
            "PATCH /vm {state} took {took:?}\n{}",
            self.describe()
        );
    }

    fn iterations(&self) -> usize {
        self.process.stdout().matches(" ok checksum=").count()
    }

    /// The guest makes progress: both vCPUs run.
    fn assert_runs(&self) {
        let start = self.iterations();
        let deadline = Instant::now() + LIMIT;
        while self.iterations() < start + 3 {
            assert!(
                Instant::now() < deadline,
                "the guest made no progress while Running\n{}",
                self.describe()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The guest makes no progress: its console stays silent (an iteration takes tens of
    /// milliseconds here).
    fn assert_stopped(&self) {
        // Output already on its way through the pipe when the vCPUs stopped.
        std::thread::sleep(Duration::from_millis(100));
        let before = self.process.stdout().len();
        std::thread::sleep(Duration::from_millis(400));
        assert_eq!(
            self.process.stdout().len(),
            before,
            "the guest wrote output while Paused\n{}",
            self.describe()
        );
    }

    /// GET / names the state the guest is really in.
    fn assert_consistent(&self) {
        match self.state().as_str() {
            "Running" => self.assert_runs(),
            "Paused" => self.assert_stopped(),
            other => panic!("unexpected state {other}\n{}", self.describe()),
        }
    }

    /// Redundant and real pauses and resumes, each answered at once, with the state that
    /// GET / reports matching what the guest does.
    fn exercise_pause_and_resume(&self) {
        self.patch_at_once("Resumed");
        assert_eq!(self.state(), "Running");
        self.assert_runs();
        for _ in 0..2 {
            self.patch_at_once("Paused");
            assert_eq!(self.state(), "Paused");
            self.assert_stopped();
        }
        for _ in 0..2 {
            self.patch_at_once("Resumed");
            assert_eq!(self.state(), "Running");
            self.assert_runs();
        }
    }

    /// SendCtrlAltDel, after which gpuvm must end with status 0 within END_LIMIT.
    fn ctrl_alt_del_ends_gpuvm(self) -> RunOutput {
        self.expect(
            204,
            "PUT",
            "/actions",
            Some(r#"{"action_type": "SendCtrlAltDel"}"#),
        );
        let out = self.process.wait(END_LIMIT);
        assert_eq!(out.code(), Some(0), "{}", out.stderr);
        out
    }
}

fn tail(text: &str, bytes: usize) -> &str {
    let mut at = text.len().saturating_sub(bytes);
    while !text.is_char_boundary(at) {
        at += 1;
    }
    &text[at..]
}

/// A VM with two vCPUs running `memloop`, started over the API.
fn start_two_vcpu_memloop(socket: &Path) -> Vmm {
    let mut vmm = Vmm::start(socket);
    vmm.expect(
        204,
        "PUT",
        "/machine-config",
        Some(r#"{"vcpu_count": 2, "mem_size_mib": 128}"#),
    );
    vmm.expect(
        204,
        "PUT",
        "/boot-source",
        Some(&format!(r#"{{"boot_args": "{WORKLOAD}"}}"#)),
    );
    vmm.expect(
        204,
        "PUT",
        "/actions",
        Some(r#"{"action_type": "InstanceStart"}"#),
    );
    vmm.process.wait_until("memloop on two vCPUs", LIMIT, |p| {
        p.stdout().contains("memloop: cpus=2") && p.stdout().contains("iter 2 ok")
    });
    vmm
}

/// A snapshot of the two-vCPU `memloop` guest, taken while it runs.
fn two_vcpu_memloop_snapshot(scratch: &Scratch) -> PathBuf {
    let dir = scratch.path("snap");
    let args = ["run", "--vcpus", "2", "--cmdline", WORKLOAD];
    let out = run_until_snapshot(&args, &dir, 500, LIMIT);
    out.assert_stdout_has("memloop: cpus=2");
    assert!(dir.join("state").exists(), "no snapshot: {}", out.stderr);
    dir
}

/// A redundant Resume on a running VM (and a redundant Pause on a paused one) answers at
/// once without changing anything, whatever vCPU 1 is doing (it runs guest code that
/// never exits to the VMM by itself).
#[test]
fn redundant_resume_and_pause_answer_at_once_with_two_vcpus() {
    let scratch = Scratch::new("vm_control", "redundant");
    let vmm = start_two_vcpu_memloop(&scratch.path("api.sock"));
    assert_eq!(vmm.state(), "Running");
    vmm.exercise_pause_and_resume();
    vmm.ctrl_alt_del_ends_gpuvm();
}

/// The same on a VM that `PUT /snapshot/load` with `resume_vm: true` started.
#[test]
fn redundant_resume_after_a_snapshot_load_that_resumed() {
    let scratch = Scratch::new("vm_control", "load");
    let snap = two_vcpu_memloop_snapshot(&scratch);
    let vmm = Vmm::start(&scratch.path("api.sock"));
    vmm.expect(
        204,
        "PUT",
        "/snapshot/load",
        Some(&format!(
            r#"{{"snapshot_path": "{}", "resume_vm": true}}"#,
            snap.display()
        )),
    );
    assert_eq!(vmm.state(), "Running");
    vmm.exercise_pause_and_resume();
    vmm.ctrl_alt_del_ends_gpuvm();
}

/// 20 PATCH /vm at once, half Paused and half Resumed, in a few rounds: every request
/// is answered (204, or 503 beyond the connection limit), and afterwards GET / says what
/// the guest really does; pause and resume still work.
#[test]
fn concurrent_pause_and_resume_leave_a_consistent_state() {
    let scratch = Scratch::new("vm_control", "concurrent");
    let vmm = start_two_vcpu_memloop(&scratch.path("api.sock"));
    for round in 0..3 {
        let started = Instant::now();
        let statuses: Vec<(u16, String)> = std::thread::scope(|scope| {
            let requests: Vec<_> = (0..20)
                .map(|i| {
                    let state = if (i + round) % 2 == 0 {
                        "Paused"
                    } else {
                        "Resumed"
                    };
                    let socket = &vmm.socket;
                    scope.spawn(move || {
                        let body = format!(r#"{{"state": "{state}"}}"#);
                        let response = client::request(socket, "PATCH", "/vm", Some(&body))
                            .expect("PATCH /vm answered");
                        (response.status, response.body)
                    })
                })
                .collect();
            requests
                .into_iter()
                .map(|r| r.join().expect("request thread"))
                .collect()
        });
        let took = started.elapsed();
        assert!(
            statuses.iter().all(|(s, _)| *s == 204 || *s == 503),
            "round {round}: {statuses:?}\n{}",
            vmm.describe()
        );
        assert!(
            statuses.iter().any(|(s, _)| *s == 204),
            "round {round}: {statuses:?}"
        );
        // Twenty requests with nothing slow among them.
        assert!(took < 2 * AT_ONCE, "round {round} took {took:?}");
        vmm.assert_consistent();
    }
    vmm.exercise_pause_and_resume();
    vmm.ctrl_alt_del_ends_gpuvm();
}

/// A VM restored through an external page-fault handler that never serves a fault: its
/// vCPUs wait on their first guest memory access forever.
fn stalled_restore(scratch: &Scratch) -> (Vmm, SpawnedProcess) {
    let snap = two_vcpu_memloop_snapshot(scratch);
    let handler_socket = scratch.path("handler.sock");
    let mut handler = start_uffd_handler(Path::new(HANDLER), &handler_socket, &snap, &["--stall"]);
    let vmm = Vmm::start(&scratch.path("api.sock"));
    vmm.expect(
        204,
        "PUT",
        "/snapshot/load",
        Some(&external_load_body(&snap, &handler_socket)),
    );
    handler.wait_for_stdout("uffd-handler: stalling", LIMIT);
    (vmm, handler)
}

/// GET / answers at once; a Pause fails promptly (a second one at once), says the vCPU
/// waits on the page-fault handler, and leaves the VM Running (as it is: nothing was
/// paused).
fn assert_pause_fails_promptly(vmm: &Vmm) {
    assert_eq!(vmm.state(), "Running");
    let (status, body, took) = vmm.call("PATCH", "/vm", Some(r#"{"state": "Paused"}"#));
    assert_eq!(status, 400, "{body}\n{}", vmm.describe());
    assert!(
        body.contains("page-fault handler"),
        "the failure does not say why: {body}"
    );
    assert!(
        took < PROMPT_FAILURE,
        "the pause took {took:?} to fail: {body}"
    );
    assert_eq!(vmm.state(), "Running");
    // The vCPU is known to wait now: the next pause fails at once.
    let (status, body, took) = vmm.call("PATCH", "/vm", Some(r#"{"state": "Paused"}"#));
    assert_eq!(
        (status, body.contains("page-fault handler")),
        (400, true),
        "{body}"
    );
    assert!(took < AT_ONCE, "the second pause took {took:?} to fail");
    assert_eq!(vmm.state(), "Running");
    vmm.patch_at_once("Resumed");
    assert_eq!(vmm.state(), "Running");
}

/// With a handler that never answers, control requests stay answerable and
/// SendCtrlAltDel ends the process.
#[test]
fn a_stalled_page_fault_handler_leaves_the_api_answering_and_ctrl_alt_del_ends_gpuvm() {
    let scratch = Scratch::new("vm_control", "stall-cad");
    let (vmm, _handler) = stalled_restore(&scratch);
    assert_pause_fails_promptly(&vmm);
    let out = vmm.ctrl_alt_del_ends_gpuvm();
    assert!(
        out.stderr.contains("page-fault handler"),
        "gpuvm did not say why a vCPU was left behind:\n{}",
        out.stderr
    );
}

/// The same handler, and SIGTERM: gpuvm ends.
#[test]
fn a_stalled_page_fault_handler_does_not_keep_sigterm_from_ending_gpuvm() {
    let scratch = Scratch::new("vm_control", "stall-term");
    let (mut vmm, _handler) = stalled_restore(&scratch);
    assert_pause_fails_promptly(&vmm);
    vmm.process.signal(libc::SIGTERM);
    let out = vmm.process.wait(END_LIMIT);
    assert_eq!(out.status.signal(), Some(libc::SIGTERM), "{}", out.stderr);
}
