//! A snapshot of a paused VM whose external page-fault handler stalls. The snapshot needs
//! every page of guest memory, and a handler that no longer answers would hold the VMM
//! thread forever (the API answering nothing, SendCtrlAltDel unable to end gpuvm): the
//! snapshot must fail promptly instead, leave the snapshot directory and the VM as they
//! were, and succeed later once the handler serves again.
//!
//! The handler runs with `--die-after-faults` set beyond reach: it serves faults only
//! (no background loading), so guest memory the guest did not touch since the restore is
//! still the handler's to serve when the snapshot starts. SIGSTOP stalls it without
//! closing anything (gpuvm's watch sees a live handler); SIGCONT lets it go on.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use gpuvm_api::client;
use gpuvm_tests::{
    external_load_body, run_gpuvm_until, run_until_snapshot, start_uffd_handler,
    wait_for_api_socket, Scratch, SpawnedProcess,
};

const LIMIT: Duration = Duration::from_secs(60);
/// How long a snapshot waiting on a stalled handler may take to fail (gpuvm gives up
/// after 10 s without progress) or, once the handler goes on, to succeed.
const ANSWER_LIMIT: Duration = Duration::from_secs(40);
/// How long an answer with nothing to wait for may take on a loaded host.
const AT_ONCE: Duration = Duration::from_secs(3);
/// How long the process may take to end once asked to.
const END_LIMIT: Duration = Duration::from_secs(15);
const HANDLER: &str = env!("CARGO_BIN_EXE_gpuvm-test-uffd-handler");
const WORKLOAD: &str = "memloop 16M 1 0";
/// Far more faults than a run here makes: the handler never dies, it only serves faults.
const FAULTS_ONLY: &[&str] = &["--die-after-faults", "1000000000"];

fn arg(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

/// A VM restored over the API through the test handler, paused, with the handler stopped.
struct Stalled {
    vmm: SpawnedProcess,
    socket: PathBuf,
    handler: SpawnedProcess,
    snap: PathBuf,
}

impl Stalled {
    fn start(scratch: &Scratch) -> Stalled {
        let snap = scratch.path("snap");
        run_until_snapshot(&["run", "--cmdline", WORKLOAD], &snap, 500, LIMIT)
            .assert_stdout_has(" ok checksum=");
        let handler_socket = scratch.path("handler.sock");
        let handler = start_uffd_handler(Path::new(HANDLER), &handler_socket, &snap, FAULTS_ONLY);
        let socket = scratch.path("api.sock");
        let mut vmm = SpawnedProcess::gpuvm(&["run", "--api-sock", arg(&socket)]);
        wait_for_api_socket(&mut vmm, &socket);
        let mut stalled = Stalled {
            vmm,
            socket,
            handler,
            snap,
        };
        let load = external_load_body(&stalled.snap, &handler_socket);
        stalled.expect(204, "PUT", "/snapshot/load", Some(&load), AT_ONCE * 10);
        // The guest runs on what the handler serves it; then it is paused (its vCPUs wait
        // on nothing) and the handler stops answering.
        stalled
            .vmm
            .wait_until("the restored guest's iterations", LIMIT, |p| {
                p.stdout().matches(" ok checksum=").count() >= 2
            });
        stalled.expect(204, "PATCH", "/vm", Some(r#"{"state": "Paused"}"#), AT_ONCE);
        stalled.handler.signal(libc::SIGSTOP);
        stalled
    }

    fn describe(&self) -> String {
        format!(
            "--- gpuvm stdout\n{}\n--- gpuvm stderr\n{}\n--- handler stdout\n{}\n--- handler stderr\n{}",
            self.vmm.stdout(),
            self.vmm.stderr(),
            self.handler.stdout(),
            self.handler.stderr()
        )
    }

    /// One request, answered within `limit` (else the test fails, gpuvm is killed on
    /// drop and the waiting client with it): its status, fault message or body, and how
    /// long it took.
    fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&str>,
        limit: Duration,
    ) -> (u16, String, Duration) {
        let (tx, rx) = std::sync::mpsc::channel();
        let (socket, method_, path_) = (self.socket.clone(), method.to_string(), path.to_string());
        let body_ = body.map(String::from);
        let started = Instant::now();
        std::thread::spawn(move || {
            let _ = tx.send(client::request(&socket, &method_, &path_, body_.as_deref()));
        });
        match rx.recv_timeout(limit) {
            Ok(Ok(response)) => (response.status, response.message(), started.elapsed()),
            Ok(Err(e)) => panic!("{method} {path}: {e}\n{}", self.describe()),
            Err(_) => panic!(
                "{method} {path} was not answered within {limit:?}\n{}",
                self.describe()
            ),
        }
    }

    fn expect(
        &self,
        status: u16,
        method: &str,
        path: &str,
        body: Option<&str>,
        limit: Duration,
    ) -> String {
        let (got, text, _) = self.call(method, path, body, limit);
        assert_eq!(
            got,
            status,
            "{method} {path} -> {text}\n{}",
            self.describe()
        );
        text
    }

    fn snapshot_into(&self, dir: &Path, limit: Duration) -> (u16, String, Duration) {
        let body = format!(
            r#"{{"snapshot_path": "{}", "snapshot_type": "Full"}}"#,
            arg(dir)
        );
        self.call("PUT", "/snapshot/create", Some(&body), limit)
    }

    /// A snapshot into `dir` fails within `limit`, saying why.
    fn assert_snapshot_fails(&self, dir: &Path, limit: Duration) {
        let (status, message, took) = self.snapshot_into(dir, limit);
        assert_eq!(status, 400, "{message}\n{}", self.describe());
        assert!(
            message.contains("external page-fault handler") && message.contains("made no progress"),
            "the failure does not say why: {message}"
        );
        assert!(took < limit, "took {took:?}");
    }

    fn state(&self) -> String {
        let text = self.expect(200, "GET", "/", None, AT_ONCE);
        let json: serde_json::Value = serde_json::from_str(&text).expect("GET / JSON");
        json["state"].as_str().expect("state").to_string()
    }

    fn ctrl_alt_del_ends_gpuvm(self) {
        self.expect(
            204,
            "PUT",
            "/actions",
            Some(r#"{"action_type": "SendCtrlAltDel"}"#),
            AT_ONCE,
        );
        let out = self.vmm.wait(END_LIMIT);
        assert_eq!(out.code(), Some(0), "{}", out.stderr);
    }
}

/// Each file of `dir`: its length and modification time, and the state file's bytes.
fn listing(dir: &Path) -> (BTreeMap<String, (u64, SystemTime)>, Vec<u8>) {
    let files = std::fs::read_dir(dir)
        .expect("list")
        .flatten()
        .map(|entry| {
            let meta = entry.metadata().expect("metadata");
            (
                entry.file_name().to_string_lossy().into_owned(),
                (meta.len(), meta.modified().expect("mtime")),
            )
        })
        .collect();
    (files, std::fs::read(dir.join("state")).expect("state"))
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for entry in std::fs::read_dir(from).expect("list").flatten() {
        std::fs::copy(entry.path(), to.join(entry.file_name())).expect("copy");
    }
}

/// With the handler stalled, the snapshot fails within bounds and changes nothing in the
/// directory (it held a previous snapshot); the API goes on answering, the VM stays
/// Paused, a second try fails the same way, and SendCtrlAltDel ends gpuvm.
#[test]
fn a_snapshot_waiting_on_a_stalled_handler_fails_and_gpuvm_stays_in_control() {
    let scratch = Scratch::new("stalled_handler", "fails");
    let stalled = Stalled::start(&scratch);
    let target = scratch.path("previous");
    copy_dir(&stalled.snap, &target);
    let before = listing(&target);

    stalled.assert_snapshot_fails(&target, ANSWER_LIMIT);
    assert!(listing(&target) == before, "the snapshot directory changed");
    assert_eq!(stalled.state(), "Paused");
    stalled.assert_snapshot_fails(&target, ANSWER_LIMIT);
    assert!(listing(&target) == before, "the snapshot directory changed");
    assert_eq!(stalled.state(), "Paused");
    stalled.ctrl_alt_del_ends_gpuvm();
}

/// Once the handler serves again, the next snapshot completes, holds the whole of guest
/// memory (a restore of it runs memloop on, whose checksums would FAIL on a page that
/// reads as zero) and the guest runs on.
#[test]
fn a_snapshot_after_the_handler_goes_on_completes() {
    let scratch = Scratch::new("stalled_handler", "goes-on");
    let mut stalled = Stalled::start(&scratch);
    let target = scratch.path("second");
    stalled.assert_snapshot_fails(&target, ANSWER_LIMIT);
    assert!(
        !target.join("state").exists(),
        "a snapshot was committed without the handler's pages"
    );
    stalled.handler.signal(libc::SIGCONT);
    let (status, message, _) = stalled.snapshot_into(&target, ANSWER_LIMIT);
    assert_eq!(status, 200, "{message}\n{}", stalled.describe());
    assert_eq!(stalled.state(), "Paused");
    let iterations = stalled.vmm.stdout().matches(" ok checksum=").count();
    stalled.expect(
        204,
        "PATCH",
        "/vm",
        Some(r#"{"state": "Resumed"}"#),
        AT_ONCE,
    );
    stalled.vmm.wait_until("the guest running on", LIMIT, |p| {
        p.stdout().matches(" ok checksum=").count() >= iterations + 2
    });
    assert!(
        !stalled.vmm.stdout().contains("FAIL"),
        "{}",
        stalled.describe()
    );
    stalled.ctrl_alt_del_ends_gpuvm();

    let restore = [
        "restore",
        "--snapshot",
        arg(&target),
        "--restore-mode",
        "eager",
    ];
    let out = run_gpuvm_until(&restore, LIMIT, Some(" ok checksum="));
    out.assert_stdout_has(" ok checksum=");
    assert!(!out.stdout.contains("FAIL"), "{}", out.stdout);
}
