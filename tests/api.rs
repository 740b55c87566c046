//! The control API end to end: a real gpuvm serving its Unix socket, driven from Rust,
//! with curl, and with `gpuvm ctl`; bad and random requests; the OpenAPI document
//! against the routes the server answers.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use gpuvm_api::client;
use gpuvm_tests::{gpuvm_bin, memloop_iterations, Scratch, SpawnedProcess};
use serde_json::{json, Value};

const LIMIT: Duration = Duration::from_secs(60);

/// A gpuvm process serving an API socket; killed on drop.
struct Vmm {
    process: SpawnedProcess,
    socket: PathBuf,
}

impl Vmm {
    /// Starts `gpuvm run --api-sock SOCKET EXTRA...` and waits for the socket.
    fn start(socket: &Path, extra: &[&str]) -> Vmm {
        let mut args = vec!["run", "--api-sock", socket.to_str().expect("utf-8 path")];
        args.extend_from_slice(extra);
        let vmm = Vmm {
            process: SpawnedProcess::gpuvm(&args),
            socket: socket.to_path_buf(),
        };
        vmm.wait_until("the API socket", |_| UnixStream::connect(socket).is_ok());
        vmm
    }

    /// Everything gpuvm wrote to stdout so far, byte for byte (a snapshot may cut a
    /// line, and tests join two processes' output).
    fn stdout(&self) -> String {
        self.process.stdout()
    }

    fn describe(&self) -> String {
        format!(
            "--- stdout\n{}\n--- stderr\n{}",
            self.stdout(),
            self.process.stderr()
        )
    }

    fn wait_until(&self, what: &str, mut ready: impl FnMut(&Vmm) -> bool) {
        let started = Instant::now();
        while !ready(self) {
            assert!(
                started.elapsed() < LIMIT,
                "timed out waiting for {what}\n{}",
                self.describe()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn wait_for_stdout(&self, needle: &str) {
        self.wait_until(needle, |vmm| vmm.stdout().contains(needle));
    }

    /// One request; the status and the body as JSON (Null when empty).
    fn call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        let body = body.map(|b| b.to_string());
        let response = client::request(&self.socket, method, path, body.as_deref())
            .unwrap_or_else(|e| panic!("{method} {path}: {e}\n{}", self.describe()));
        let value = if response.body.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&response.body).unwrap_or_else(|e| {
                panic!("{method} {path}: body is not JSON ({e}): {}", response.body)
            })
        };
        (response.status, value)
    }

    /// A request that must succeed with `status`.
    fn expect(&self, status: u16, method: &str, path: &str, body: Option<Value>) -> Value {
        let (got, value) = self.call(method, path, body);
        assert_eq!(
            got,
            status,
            "{method} {path} -> {value}\n{}",
            self.describe()
        );
        value
    }

    fn state(&self) -> String {
        self.expect(200, "GET", "/", None)["state"]
            .as_str()
            .expect("state")
            .to_string()
    }

    fn wait_exit(self) -> (ExitStatus, String) {
        let out = self.process.wait(LIMIT);
        (out.status, out.stdout)
    }
}

fn fault_message(value: &Value) -> &str {
    value["fault_message"]
        .as_str()
        .unwrap_or_else(|| panic!("no fault_message in {value}"))
}

/// Configure, start, pause (the guest stops making progress), snapshot while paused
/// (it stays paused), resume (progress again), metrics, and stop with SendCtrlAltDel.
#[test]
fn lifecycle_over_the_socket_from_rust() {
    let scratch = Scratch::new("api", "lifecycle");
    let vmm = Vmm::start(&scratch.path("api.sock"), &[]);
    assert_eq!(vmm.state(), "NotStarted");
    vmm.expect(
        204,
        "PUT",
        "/machine-config",
        Some(json!({"vcpu_count": 1, "mem_size_mib": 128, "track_dirty_pages": true})),
    );
    let config = vmm.expect(200, "GET", "/machine-config", None);
    assert_eq!(config["mem_size_mib"], 128);
    assert_eq!(config["track_dirty_pages"], true);
    vmm.expect(
        204,
        "PUT",
        "/boot-source",
        Some(json!({"boot_args": "memloop 32M 9 0"})),
    );
    assert!(
        !vmm.stdout().contains("testguest"),
        "guest ran before start"
    );
    vmm.expect(
        204,
        "PUT",
        "/actions",
        Some(json!({"action_type": "InstanceStart"})),
    );
    vmm.wait_for_stdout("memloop: iter 2 ok");
    assert_eq!(vmm.state(), "Running");

    vmm.expect(204, "PATCH", "/vm", Some(json!({"state": "Paused"})));
    assert_eq!(vmm.state(), "Paused");
    let paused_at = memloop_iterations(&vmm.stdout()).len();
    std::thread::sleep(Duration::from_millis(400));
    // A paused guest makes no progress (an iteration takes ~30 ms here).
    assert!(
        memloop_iterations(&vmm.stdout()).len() <= paused_at + 1,
        "{}",
        vmm.describe()
    );

    let snap = scratch.path("snap");
    let report = vmm.expect(
        200,
        "PUT",
        "/snapshot/create",
        Some(json!({"snapshot_path": snap, "snapshot_type": "Full"})),
    );
    assert_eq!(report["diff"], false);
    assert!(
        report["memory_bytes_written"].as_u64().unwrap() > 32 << 20,
        "{report}"
    );
    assert!(snap.join("state").exists());
    assert!(snap.join(report["memory_file"].as_str().unwrap()).exists());
    assert_eq!(vmm.state(), "Paused", "a snapshot keeps a paused VM paused");
    // A diff on top, still paused.
    let diff = vmm.expect(
        200,
        "PUT",
        "/snapshot/create",
        Some(json!({"snapshot_path": snap, "snapshot_type": "Diff"})),
    );
    assert_eq!(diff["diff"], true, "{diff}");

    vmm.expect(204, "PATCH", "/vm", Some(json!({"state": "Resumed"})));
    assert_eq!(vmm.state(), "Running");
    let resumed_at = memloop_iterations(&vmm.stdout()).len();
    vmm.wait_until("progress after resume", |v| {
        memloop_iterations(&v.stdout()).len() >= resumed_at + 3
    });

    // Configuration is closed once running.
    let (status, fault) = vmm.call(
        "PUT",
        "/machine-config",
        Some(json!({"vcpu_count": 2, "mem_size_mib": 64})),
    );
    assert_eq!(status, 409, "{fault}");
    assert!(fault_message(&fault).contains("already"));

    let metrics = vmm.expect(200, "GET", "/metrics", None);
    assert_eq!(metrics["snapshot"]["created"], 2, "{metrics}");
    assert_eq!(metrics["vm"]["state"], "Running");
    assert!(
        metrics["serial"]["bytes_out"].as_u64().unwrap() > 100,
        "{metrics}"
    );
    assert_eq!(metrics["api_requests"]["/vm"]["2xx"], 2, "{metrics}");
    // The serial console is one port write per byte.
    let io_out = metrics["vcpu_exits"]["io_out"].as_u64().unwrap();
    assert!(
        io_out >= metrics["serial"]["bytes_out"].as_u64().unwrap(),
        "{metrics}"
    );
    assert!(
        metrics["vcpu_exits"]["kicked"].as_u64().unwrap() >= 1,
        "pause kicks: {metrics}"
    );
    assert_eq!(
        metrics["api_requests"]["/machine-config"]["4xx"], 1,
        "{metrics}"
    );

    vmm.expect(
        204,
        "PUT",
        "/actions",
        Some(json!({"action_type": "SendCtrlAltDel"})),
    );
    let socket = vmm.socket.clone();
    let (status, _) = vmm.wait_exit();
    assert_eq!(status.code(), Some(0));
    assert!(!socket.exists(), "the socket file is removed at exit");
}

fn ctl(socket: &Path, args: &[&str]) -> (bool, String, String) {
    let output = Command::new(gpuvm_bin())
        .args(["ctl", "--api-sock"])
        .arg(socket)
        .args(args)
        .output()
        .expect("run gpuvm ctl");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

fn ctl_ok(socket: &Path, args: &[&str]) -> String {
    let (ok, stdout, stderr) = ctl(socket, args);
    assert!(ok, "gpuvm ctl {args:?} failed: {stderr}");
    stdout
}

/// A memloop guest snapshotted through `gpuvm ctl`, then restored through `gpuvm ctl`
/// in a new process: paused until resumed, and it finishes the loop where it left off.
#[test]
fn restore_via_the_api_in_a_new_process_with_ctl() {
    let scratch = Scratch::new("api", "restore");
    let snap = scratch.path("snap");
    let snap_arg = snap.to_str().unwrap();
    let iters = 60;
    let first = Vmm::start(&scratch.path("first.sock"), &[]);
    let socket = first.socket.clone();
    ctl_ok(
        &socket,
        &["set-machine-config", "--vcpus", "2", "--memory", "128M"],
    );
    ctl_ok(
        &socket,
        &[
            "set-boot-source",
            "--cmdline",
            &format!("memloop 32M 4 {iters}"),
        ],
    );
    let config: Value = serde_json::from_str(&ctl_ok(&socket, &["get-machine-config"])).unwrap();
    assert_eq!(config["vcpu_count"], 2);
    ctl_ok(&socket, &["start"]);
    first.wait_for_stdout("memloop: iter 1 ok");
    ctl_ok(&socket, &["pause"]);
    let info: Value = serde_json::from_str(&ctl_ok(&socket, &["info"])).unwrap();
    assert_eq!(info["state"], "Paused");
    ctl_ok(&socket, &["snapshot-create", "--dir", snap_arg]);
    let metrics: Value = serde_json::from_str(&ctl_ok(&socket, &["metrics"])).unwrap();
    assert_eq!(metrics["snapshot"]["created"], 1);
    ctl_ok(&socket, &["ctrl-alt-del"]);
    let (status, before) = first.wait_exit();
    assert_eq!(status.code(), Some(0));
    let last_before = *memloop_iterations(&before)
        .last()
        .expect("iterations before");
    assert!(
        last_before < iters,
        "finished before the snapshot: {before}"
    );

    let second = Vmm::start(&scratch.path("second.sock"), &[]);
    let socket = second.socket.clone();
    ctl_ok(
        &socket,
        &[
            "snapshot-load",
            "--dir",
            snap_arg,
            "--restore-mode",
            "lazy",
            "--record-working-set",
        ],
    );
    assert_eq!(second.state(), "Paused");
    let config: Value = serde_json::from_str(&ctl_ok(&socket, &["get-machine-config"])).unwrap();
    assert_eq!(config["vcpu_count"], 2, "the snapshot's configuration");
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        memloop_iterations(&second.stdout()).is_empty(),
        "ran before resume"
    );
    // Loading twice, or starting, is refused now.
    let (ok, _, stderr) = ctl(&socket, &["start"]);
    assert!(!ok && stderr.contains("409"), "{stderr}");
    ctl_ok(&socket, &["resume"]);
    second.wait_for_stdout("memloop: done");
    let (status, after) = second.wait_exit();
    assert_eq!(status.code(), Some(0), "{after}");
    let resumed = memloop_iterations(&after);
    assert!(
        !after.contains("testguest: ready"),
        "booted instead of restoring: {after}"
    );
    assert!(
        resumed.first().is_some_and(|&first| first > last_before),
        "{after}"
    );
    // The snapshot can split a serial line (the guest paused mid-print); the two runs'
    // output together is the whole, unbroken loop.
    let whole = memloop_iterations(&format!("{before}{after}"));
    assert_eq!(whole, (0..iters).collect::<Vec<_>>(), "{before}{after}");
}

/// The same lifecycle with curl, as an operator would type it.
#[test]
fn lifecycle_with_curl() {
    let scratch = Scratch::new("api", "curl");
    let socket = scratch.path("api.sock");
    let vmm = Vmm::start(&socket, &[]);
    let curl = |method: &str, path: &str, body: Option<&str>| -> (u16, String) {
        let mut command = Command::new("curl");
        command
            .args(["-sS", "--max-time", "30", "--unix-socket"])
            .arg(&socket)
            .args(["-X", method, "-w", "\n%{http_code}"])
            .arg(format!("http://localhost{path}"));
        if let Some(body) = body {
            command.args(["-H", "Content-Type: application/json", "-d", body]);
        }
        let output = command
            .output()
            .expect("curl is needed for this test (scripts/install-deps.sh installs it)");
        let text = String::from_utf8_lossy(&output.stdout).into_owned();
        let (body, code) = text.rsplit_once('\n').expect("curl output");
        (code.trim().parse().expect("status"), body.to_string())
    };
    let (code, _) = curl(
        "PUT",
        "/machine-config",
        Some(r#"{"vcpu_count": 1, "mem_size_mib": 64}"#),
    );
    assert_eq!(code, 204);
    let (code, _) = curl(
        "PUT",
        "/boot-source",
        Some(r#"{"boot_args": "memloop 16M 2 0"}"#),
    );
    assert_eq!(code, 204);
    let (code, _) = curl(
        "PUT",
        "/actions",
        Some(r#"{"action_type": "InstanceStart"}"#),
    );
    assert_eq!(code, 204);
    vmm.wait_for_stdout("memloop: iter 1 ok");
    assert_eq!(curl("PATCH", "/vm", Some(r#"{"state": "Paused"}"#)).0, 204);
    let (code, body) = curl("GET", "/", None);
    assert_eq!(code, 200);
    assert!(body.contains(r#""state":"Paused""#), "{body}");
    let snap = scratch.path("snap");
    let (code, body) = curl(
        "PUT",
        "/snapshot/create",
        Some(&json!({"snapshot_path": snap}).to_string()),
    );
    assert_eq!(code, 200, "{body}");
    assert!(snap.join("state").exists());
    assert_eq!(curl("PATCH", "/vm", Some(r#"{"state": "Resumed"}"#)).0, 204);
    let (code, body) = curl("GET", "/metrics", None);
    assert_eq!(code, 200);
    assert!(body.contains(r#""created":1"#), "{body}");
    let (code, body) = curl("PATCH", "/vm", Some(r#"{"state": "Sleeping"}"#));
    assert_eq!(code, 400);
    assert!(body.contains("fault_message"), "{body}");
    assert_eq!(
        curl(
            "PUT",
            "/actions",
            Some(r#"{"action_type": "SendCtrlAltDel"}"#)
        )
        .0,
        204
    );
    let (status, _) = vmm.wait_exit();
    assert_eq!(status.code(), Some(0));
}

/// Sends raw bytes on a fresh connection; returns the status and body of the answer
/// (None when the server closed without answering).
fn raw(socket: &Path, bytes: &[u8]) -> Option<(u16, String)> {
    let mut stream = UnixStream::connect(socket).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    // The server may answer and close before reading everything we send.
    let _ = stream.write_all(bytes);
    let _ = stream.shutdown(std::net::Shutdown::Write);
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    let text = String::from_utf8_lossy(&answer).into_owned();
    let status = text.split(' ').nth(1)?.parse().ok()?;
    let body = text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    Some((status, body))
}

fn request_bytes(method: &str, path: &str, body: &str) -> Vec<u8> {
    format!(
        "{method} {path} HTTP/1.1\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

#[test]
fn bad_requests_get_a_4xx_with_a_fault_message() {
    let scratch = Scratch::new("api", "bad");
    let socket = scratch.path("api.sock");
    let vmm = Vmm::start(&socket, &[]);
    let big = "x".repeat(100_000);
    let cases: Vec<(&str, Vec<u8>, u16)> = vec![
        (
            "malformed JSON",
            request_bytes("PUT", "/machine-config", "{\"vcpu_count\": "),
            400,
        ),
        (
            "unknown field",
            request_bytes(
                "PUT",
                "/machine-config",
                r#"{"vcpu_count":1,"mem_size_mib":64,"smt":true}"#,
            ),
            400,
        ),
        (
            "wrong type",
            request_bytes(
                "PUT",
                "/machine-config",
                r#"{"vcpu_count":"one","mem_size_mib":64}"#,
            ),
            400,
        ),
        (
            "out of range",
            request_bytes(
                "PUT",
                "/machine-config",
                r#"{"vcpu_count":1,"mem_size_mib":0}"#,
            ),
            400,
        ),
        (
            "missing body",
            request_bytes("PUT", "/boot-source", ""),
            400,
        ),
        (
            "missing kernel",
            request_bytes(
                "PUT",
                "/boot-source",
                r#"{"kernel_image_path":"/nonexistent/vmlinux"}"#,
            ),
            400,
        ),
        (
            "relative kernel path",
            request_bytes("PUT", "/boot-source", r#"{"kernel_image_path":"vmlinux"}"#),
            400,
        ),
        ("wrong method", request_bytes("DELETE", "/vm", ""), 405),
        (
            "wrong method on a route",
            request_bytes("GET", "/vm", ""),
            405,
        ),
        ("unknown route", request_bytes("GET", "/nope", ""), 404),
        (
            "gpus not supported yet",
            request_bytes("PUT", "/gpus/gpu0", "{}"),
            400,
        ),
        (
            "drives not supported yet",
            request_bytes("PUT", "/drives/rootfs", "{}"),
            400,
        ),
        (
            "oversized body",
            request_bytes("PUT", "/machine-config", &big),
            413,
        ),
        (
            "chunked body",
            b"PUT /vm HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
                .to_vec(),
            411,
        ),
        (
            "not HTTP",
            b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n".to_vec(),
            400,
        ),
        (
            "HTTP/2 preface",
            b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec(),
            405,
        ),
        (
            "pause before start",
            request_bytes("PATCH", "/vm", r#"{"state":"Paused"}"#),
            409,
        ),
        (
            "ctrl-alt-del before start",
            request_bytes("PUT", "/actions", r#"{"action_type":"SendCtrlAltDel"}"#),
            409,
        ),
        (
            "snapshot before start",
            request_bytes("PUT", "/snapshot/create", r#"{"snapshot_path":"/tmp/x"}"#),
            409,
        ),
        (
            "load a missing snapshot",
            request_bytes(
                "PUT",
                "/snapshot/load",
                r#"{"snapshot_path":"/nonexistent"}"#,
            ),
            400,
        ),
        (
            "load without handler socket",
            request_bytes(
                "PUT",
                "/snapshot/load",
                r#"{"snapshot_path":"/nonexistent","restore_mode":"External"}"#,
            ),
            400,
        ),
        (
            "unknown action",
            request_bytes("PUT", "/actions", r#"{"action_type":"FlushMetrics"}"#),
            400,
        ),
    ];
    for (what, bytes, status) in cases {
        let (got, body) = raw(&socket, &bytes).unwrap_or_else(|| panic!("{what}: no answer"));
        assert_eq!(got, status, "{what}: {body}");
        let body: Value =
            serde_json::from_str(&body).unwrap_or_else(|e| panic!("{what}: {e}: {body}"));
        assert!(!fault_message(&body).is_empty(), "{what}");
    }
    // Only a lazy restore's guest faults, so only it can record a working set.
    let (status, fault) = vmm.call(
        "PUT",
        "/snapshot/load",
        Some(json!({"snapshot_path": "/tmp", "restore_mode": "Eager", "record_working_set": true})),
    );
    assert_eq!(status, 400, "{fault}");
    assert!(
        fault_message(&fault).contains("record_working_set needs restore_mode Lazy"),
        "{fault}"
    );
    // More vCPUs than the host allows are refused at PUT, not only at start.
    let (status, fault) = vmm.call(
        "PUT",
        "/machine-config",
        Some(json!({"vcpu_count": 255, "mem_size_mib": 64})),
    );
    assert_eq!(status, 400, "{fault}");
    assert!(fault_message(&fault).contains("vCPU count 255"), "{fault}");
    // A start that cannot build the VM is a 400 and leaves the API usable: a regular
    // file passes PUT /boot-source, but it is no kernel image.
    let not_a_kernel = scratch.path("not-a-kernel");
    std::fs::write(&not_a_kernel, vec![0x5a; 8192]).unwrap();
    vmm.expect(
        204,
        "PUT",
        "/boot-source",
        Some(json!({"kernel_image_path": not_a_kernel})),
    );
    let (status, fault) = vmm.call(
        "PUT",
        "/actions",
        Some(json!({"action_type": "InstanceStart"})),
    );
    assert_eq!(status, 400, "{fault}");
    assert!(fault_message(&fault).contains("kernel"), "{fault}");

    // A client that stalls mid-request gets 408 after the read timeout, and does not
    // block other clients meanwhile.
    let mut stalled = UnixStream::connect(&socket).unwrap();
    stalled
        .write_all(b"PUT /vm HTTP/1.1\r\nContent-Length: 50\r\n\r\n{")
        .unwrap();
    let started = Instant::now();
    assert_eq!(vmm.state(), "NotStarted");
    assert!(started.elapsed() < Duration::from_secs(2));
    stalled
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut answer = String::new();
    let _ = stalled.read_to_string(&mut answer);
    assert!(answer.starts_with("HTTP/1.1 408 "), "{answer:?}");
    assert_eq!(vmm.state(), "NotStarted");
}

/// Property over the live socket: random bytes (fixed seed) never get a 5xx or kill the
/// server.
#[test]
fn random_bytes_never_get_5xx_or_kill_the_server() {
    let scratch = Scratch::new("api", "fuzz");
    let socket = scratch.path("api.sock");
    let vmm = Vmm::start(&socket, &[]);
    let mut seed: u64 = 0x5eed_1234_abcd_ef01;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let templates: [&[u8]; 3] = [
        b"PUT /machine-config HTTP/1.1\r\nContent-Length: 36\r\n\r\n{\"vcpu_count\": 1, \"mem_size_mib\": 64}",
        b"PATCH /vm HTTP/1.1\r\nContent-Length: 18\r\n\r\n{\"state\":\"Paused\"}",
        b"GET /metrics HTTP/1.1\r\n\r\n",
    ];
    let mut answered = 0;
    for case in 0..300 {
        let mut bytes = templates[case % templates.len()].to_vec();
        for _ in 0..1 + next() % 4 {
            let at = (next() as usize) % bytes.len();
            bytes[at] = next() as u8;
        }
        if case % 5 == 0 {
            bytes = (0..next() % 200).map(|_| next() as u8).collect();
            bytes.extend_from_slice(b"\r\n\r\n");
        }
        if let Some((status, body)) = raw(&socket, &bytes) {
            answered += 1;
            assert!(
                status < 500,
                "{status} for {:?}: {body}",
                String::from_utf8_lossy(&bytes)
            );
        }
    }
    assert!(answered > 250, "only {answered} of 300 got an answer");
    assert_eq!(vmm.state(), "NotStarted");
}

/// Every operation in api/openapi.json is served (no 404/405) and answers with a
/// status the document lists; every route the server counts is in the document.
#[test]
fn every_openapi_route_is_served() {
    let doc_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../api/openapi.json");
    let doc: Value =
        serde_json::from_str(&std::fs::read_to_string(&doc_path).expect("openapi.json"))
            .expect("openapi.json is JSON");
    let schemas = &doc["components"]["schemas"];
    let scratch = Scratch::new("api", "openapi");
    let vmm = Vmm::start(&scratch.path("api.sock"), &[]);
    let paths = doc["paths"].as_object().expect("paths");
    assert!(paths.len() >= 8);
    for route in gpuvm_vmm::metrics::API_ROUTES
        .iter()
        .filter(|r| **r != "other")
    {
        assert!(
            paths.contains_key(*route),
            "{route} is served but not documented"
        );
    }
    let mut operations = 0;
    for (path, item) in paths {
        for (method, operation) in item.as_object().unwrap() {
            operations += 1;
            let body = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
                .as_str()
                .map(|reference| {
                    let name = reference.rsplit('/').next().unwrap();
                    example(&schemas[name])
                });
            let (status, answer) = vmm.call(&method.to_uppercase(), path, body.clone());
            // A 404 the document lists is the route's own answer (no such device id),
            // not a missing route.
            let unrouted =
                status == 405 || (status == 404 && operation["responses"].get("404").is_none());
            assert!(
                !unrouted,
                "{method} {path} is documented but not served: {status} {answer}"
            );
            assert!(
                operation["responses"].get(status.to_string()).is_some(),
                "{method} {path} with {body:?} answered {status} ({answer}), not in the document"
            );
        }
    }
    assert!(operations >= 9);
    // Nothing in there started the VM.
    assert_eq!(vmm.state(), "NotStarted");
}

/// A body that satisfies `schema`'s required fields. Enums take their last value
/// (SendCtrlAltDel, Resumed, ...), which before start are harmless 409s.
fn example(schema: &Value) -> Value {
    let mut object = serde_json::Map::new();
    for name in schema["required"].as_array().into_iter().flatten() {
        let name = name.as_str().unwrap();
        let property = &schema["properties"][name];
        let value = if let Some(values) = property["enum"].as_array() {
            values.last().unwrap().clone()
        } else {
            match property["type"].as_str() {
                Some("integer") => property["minimum"].clone(),
                Some("boolean") => json!(false),
                _ => json!("/nonexistent"),
            }
        };
        object.insert(name.into(), value);
    }
    Value::Object(object)
}

#[test]
fn config_file_starts_at_once() {
    let scratch = Scratch::new("api", "config");
    let config = scratch.path("vm.json");
    std::fs::write(
        &config,
        json!({
            "machine-config": {"vcpu_count": 1, "mem_size_mib": 64},
            "boot-source": {"boot_args": "hello"}
        })
        .to_string(),
    )
    .unwrap();
    let output = Command::new(gpuvm_bin())
        .args(["run", "--config-file"])
        .arg(&config)
        .stdin(Stdio::null())
        .output()
        .expect("run gpuvm");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(0), "{stdout}");
    assert!(stdout.contains("testguest: hello from ring 3"), "{stdout}");

    // With the API too: running at once, and the API sees the file's configuration.
    std::fs::write(
        &config,
        json!({
            "machine-config": {"vcpu_count": 2, "mem_size_mib": 64},
            "boot-source": {"boot_args": "memloop 8M 1 0"}
        })
        .to_string(),
    )
    .unwrap();
    let vmm = Vmm::start(
        &scratch.path("api.sock"),
        &["--config-file", config.to_str().unwrap()],
    );
    vmm.wait_for_stdout("memloop: iter 1 ok");
    assert_eq!(vmm.state(), "Running");
    assert_eq!(
        vmm.expect(200, "GET", "/machine-config", None)["vcpu_count"],
        2
    );
    vmm.expect(
        204,
        "PUT",
        "/actions",
        Some(json!({"action_type": "SendCtrlAltDel"})),
    );
    assert_eq!(vmm.wait_exit().0.code(), Some(0));

    // A bad file is one clear error.
    std::fs::write(
        &config,
        r#"{"machine-config": {"vcpu_count": 1, "mem_size_mib": 64, "smt": true}}"#,
    )
    .unwrap();
    let output = Command::new(gpuvm_bin())
        .args(["run", "--config-file"])
        .arg(&config)
        .output()
        .expect("run gpuvm");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(
        output.status.code(),
        Some(gpuvm_vmm::exit_status::GPUVM_ERROR.into()),
        "{stderr}"
    );
    assert!(
        stderr.contains("smt") && !stderr.contains("panicked"),
        "{stderr}"
    );
}

fn status_field(pid: u64, field: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|line| line.strip_prefix(field))
        .unwrap_or_else(|| panic!("no {field} in {status}"))
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

/// `--chroot` and `--uid/--gid`: the running VMM is confined (root elsewhere, nobody's
/// ids, no groups) and still serves every action; a snapshot lands inside the new root.
/// Without root the drop must fail cleanly instead.
#[test]
fn jail_chroots_and_drops_privileges() {
    let scratch = Scratch::new("api", "jail");
    let root = scratch.path("root");
    std::fs::create_dir_all(&root).unwrap();
    let socket = root.join("api.sock");
    let jail = [
        "--chroot",
        root.to_str().unwrap(),
        "--uid",
        "65534",
        "--gid",
        "65534",
    ];
    // SAFETY: geteuid(2) has no side effects.
    if unsafe { libc::geteuid() } != 0 {
        let output = Command::new(gpuvm_bin())
            .args(["run", "--uid", "65534", "--gid", "65534"])
            .output()
            .expect("run gpuvm");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(
            output.status.code(),
            Some(gpuvm_vmm::exit_status::GPUVM_ERROR.into()),
            "{stderr}"
        );
        assert!(stderr.contains("cannot"), "{stderr}");
        return;
    }
    // nobody must be able to write the snapshot inside the new root.
    std::fs::set_permissions(&root, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let mut args = vec!["--memory", "64M", "--cmdline", "memloop 8M 3 0"];
    args.extend(jail);
    let vmm = Vmm::start(&socket, &args);
    vmm.expect(
        204,
        "PUT",
        "/actions",
        Some(json!({"action_type": "InstanceStart"})),
    );
    vmm.wait_for_stdout("memloop: iter 1 ok");
    let pid = vmm.expect(200, "GET", "/", None)["pid"].as_u64().unwrap();
    assert_eq!(status_field(pid, "Uid:"), "65534 65534 65534 65534");
    assert_eq!(status_field(pid, "Gid:"), "65534 65534 65534 65534");
    assert_eq!(status_field(pid, "Groups:"), "");
    assert_eq!(
        std::fs::read_link(format!("/proc/{pid}/root")).unwrap(),
        root.canonicalize().unwrap()
    );
    vmm.expect(204, "PATCH", "/vm", Some(json!({"state": "Paused"})));
    vmm.expect(
        200,
        "PUT",
        "/snapshot/create",
        Some(json!({"snapshot_path": "/snap"})),
    );
    assert!(
        root.join("snap/state").exists(),
        "snapshot not inside the new root"
    );
    vmm.expect(204, "PATCH", "/vm", Some(json!({"state": "Resumed"})));
    vmm.expect(
        204,
        "PUT",
        "/actions",
        Some(json!({"action_type": "SendCtrlAltDel"})),
    );
    assert_eq!(vmm.wait_exit().0.code(), Some(0));

    // The snapshot restores outside the jail, in a plain process.
    let snap = root.join("snap");
    let mut restored = SpawnedProcess::gpuvm(&[
        "restore",
        "--restore-mode",
        "eager",
        "--snapshot",
        snap.to_str().expect("utf-8 path"),
    ]);
    restored.wait_until("two iterations after restore", LIMIT, |p| {
        memloop_iterations(&p.stdout()).len() >= 2
    });
}

/// A SIGUSR1 snapshot (`gpuvm snapshot --pid`) of a VM the API paused leaves it paused.
#[test]
fn signal_snapshot_keeps_an_api_paused_vm_paused() {
    let scratch = Scratch::new("api", "signal");
    let snap = scratch.path("snap");
    let vmm = Vmm::start(
        &scratch.path("api.sock"),
        &[
            "--memory",
            "64M",
            "--cmdline",
            "memloop 8M 5 0",
            "--snapshot-dir",
            snap.to_str().unwrap(),
        ],
    );
    vmm.expect(
        204,
        "PUT",
        "/actions",
        Some(json!({"action_type": "InstanceStart"})),
    );
    vmm.wait_for_stdout("memloop: iter 1 ok");
    vmm.expect(204, "PATCH", "/vm", Some(json!({"state": "Paused"})));
    let paused_at = memloop_iterations(&vmm.stdout()).len();
    let pid = vmm.expect(200, "GET", "/", None)["pid"].to_string();
    let status = Command::new(gpuvm_bin())
        .args(["snapshot", "--pid", &pid])
        .status()
        .expect("gpuvm snapshot");
    assert!(status.success());
    vmm.wait_until("the signalled snapshot", |_| snap.join("state").exists());
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(vmm.state(), "Paused");
    assert!(
        memloop_iterations(&vmm.stdout()).len() <= paused_at + 1,
        "the guest ran on after the snapshot\n{}",
        vmm.describe()
    );
    vmm.expect(204, "PATCH", "/vm", Some(json!({"state": "Resumed"})));
    vmm.wait_until("progress after resume", |v| {
        memloop_iterations(&v.stdout()).len() >= paused_at + 3
    });
    vmm.expect(
        204,
        "PUT",
        "/actions",
        Some(json!({"action_type": "SendCtrlAltDel"})),
    );
    assert_eq!(vmm.wait_exit().0.code(), Some(0));
}

/// `gpuvm ctl raw` reaches any route; errors are one line and exit 1.
#[test]
fn ctl_raw_and_errors() {
    let scratch = Scratch::new("api", "ctl");
    let socket = scratch.path("api.sock");
    let (ok, _, stderr) = ctl(&socket, &["info"]);
    assert!(!ok && stderr.contains("cannot connect"), "{stderr}");
    let _vmm = Vmm::start(&socket, &[]);
    let config: Value =
        serde_json::from_str(&ctl_ok(&socket, &["raw", "GET", "/machine-config"])).unwrap();
    assert_eq!(config["vcpu_count"], 1);
    ctl_ok(
        &socket,
        &[
            "raw",
            "PUT",
            "/machine-config",
            r#"{"vcpu_count": 3, "mem_size_mib": 96}"#,
        ],
    );
    let config: Value = serde_json::from_str(&ctl_ok(&socket, &["get-machine-config"])).unwrap();
    assert_eq!(
        (
            config["vcpu_count"].as_u64(),
            config["mem_size_mib"].as_u64()
        ),
        (Some(3), Some(96))
    );
    let (ok, stdout, stderr) = ctl(&socket, &["raw", "PUT", "/gpus/gpu0", "{}"]);
    assert!(!ok && stdout.is_empty(), "{stdout}");
    assert!(stderr.contains("gpu_id"), "{stderr}");
    assert!(stderr.contains("(400)"), "{stderr}");
    let (ok, _, stderr) = ctl(&socket, &["raw", "PUT", "/drives/root", "{}"]);
    assert!(!ok && stderr.contains("drive_id"), "{stderr}");
    let (ok, _, stderr) = ctl(&socket, &["pause"]);
    assert!(!ok && stderr.contains("(409)"), "{stderr}");
}
