//! Kata Containers' Firecracker driver (src/runtime/virtcontainers/fc.go in
//! kata-containers) replayed against gpuvm started as `firecracker`: the requests, files
//! and command line it produces, byte for byte as its go-swagger client and Go's
//! encoding/json write them, and each answer checked the way fc.go checks it.
//!
//! Kata's sequence (not jailed):
//! 1. `firecracker --version`: the first line's second field, `v` trimmed, must be a
//!    semantic version of at least 0.21.1.
//! 2. In the VM's directory: the FIFOs `logs.fifo` and `metrics.fifo`, opened for reading
//!    (non-blocking) before Firecracker starts; eight empty files `drive_0`..`drive_7`, the
//!    placeholder drives; `fcConfig.json`, `json.MarshalIndent(FcConfig, "", "\t")`:
//!    boot-source, machine-config (with `smt: false`), vsock (`vsock_id: "root"`), logger
//!    (`level: "Error"`), metrics, drives (the read-only rootfs, then the placeholders).
//! 3. `firecracker --api-sock <sock> --config-file fcConfig.json` (no InstanceStart: the
//!    file boots the VM), then `GET /` every 10 ms for at most 10 s until `state` is
//!    "Running"; then chmod 0640 of the hybrid vsock socket (it must exist).
//! 4. The agent connection: `CONNECT 1024\n` on the hybrid vsock socket, an answer holding
//!    "OK".
//! 5. Block hot-plug: `PATCH /drives/drive_N {"drive_id", "path_on_host"}` swaps a
//!    placeholder for an image (204, go-swagger's only success), and back to the empty
//!    placeholder on removal.
//! 6. Metrics lines read from the FIFO are JSON objects (Kata unmarshals each one).
//! 7. Stop: SIGTERM, then at most 15 s for the process to end.
//!
//! gpuvm is started through a `firecracker` symlink, through a hard link named so, and
//! through the symlink resolved, as Kata's configuration loader resolves the hypervisor
//! path (`filepath.EvalSymlinks`): gpuvm's own path, where the Firecracker flags pick the
//! front end. In that last case step 1 is not replayed: `gpuvm --version` is gpuvm's own
//! ("gpuvm 0.1.0"), which fc.go's check refuses (below 0.21.1).
//!
//! What differs from Kata's real runs: the kernel is gpuvm's embedded test guest (its
//! workload words lead the command line Kata builds), the rootfs is a test image, and
//! `GPUVM_METRICS_PERIOD_MS` makes gpuvm write metrics lines sooner than every 60 s.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpuvm_tests::virtio_support::{blk_image, disk_image, vsock_echo, BLK_MAGIC};
use gpuvm_tests::{run_gpuvm, PeerLaunch, Scratch, SpawnedProcess};

const LIMIT: Duration = Duration::from_secs(60);
/// fc.go's fcTimeout: seconds to wait for the VMM to be Running.
const FC_TIMEOUT: Duration = Duration::from_secs(10);
/// fc.go's fcStopSandboxTimeout.
const STOP_TIMEOUT: Duration = Duration::from_secs(15);
/// fc.go's fcDiskPoolSize.
const DISK_POOL_SIZE: usize = 8;
/// Kata's agent vsock port (the test guest echoes on the same port).
const AGENT_PORT: u32 = 1024;

/// One HTTP/1.1 connection to the API socket, writing requests as Go's net/http does for
/// go-swagger's client (Host "localhost", Go's User-Agent, `Accept: application/json`,
/// `Accept-Encoding: gzip`), reused while the server keeps it open, as Go's transport does.
struct GoSwaggerClient {
    socket: PathBuf,
    connection: Option<(UnixStream, BufReader<UnixStream>)>,
}

struct Answer {
    status: u16,
    body: String,
}

impl GoSwaggerClient {
    fn new(socket: &Path) -> GoSwaggerClient {
        GoSwaggerClient {
            socket: socket.to_path_buf(),
            connection: None,
        }
    }

    /// The request's bytes: Go writes Host, User-Agent, Content-Length, then the other
    /// headers sorted, then the transport's Accept-Encoding; a JSON body is
    /// json.Encoder's output, which ends in a newline.
    fn request_bytes(method: &str, path: &str, json: Option<&str>) -> Vec<u8> {
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: localhost\r\nUser-Agent: Go-http-client/1.1\r\n"
        );
        let body = json.map(|json| format!("{json}\n"));
        if let Some(body) = &body {
            head.push_str(&format!("Content-Length: {}\r\n", body.len()));
        }
        head.push_str("Accept: application/json\r\n");
        if body.is_some() {
            head.push_str("Content-Type: application/json\r\n");
        }
        head.push_str("Accept-Encoding: gzip\r\n\r\n");
        let mut bytes = head.into_bytes();
        bytes.extend_from_slice(body.unwrap_or_default().as_bytes());
        bytes
    }

    /// Sends one request; an error where Go's client would return one (no socket yet,
    /// the connection closed without an answer).
    fn send(&mut self, method: &str, path: &str, json: Option<&str>) -> std::io::Result<Answer> {
        if self.connection.is_none() {
            let stream = UnixStream::connect(&self.socket)?;
            stream.set_read_timeout(Some(LIMIT))?;
            let reader = BufReader::new(stream.try_clone()?);
            self.connection = Some((stream, reader));
        }
        let result = self.exchange(method, path, json);
        if !matches!(&result, Ok((_, keep_alive)) if *keep_alive) {
            self.connection = None;
        }
        result.map(|(answer, _)| answer)
    }

    fn exchange(
        &mut self,
        method: &str,
        path: &str,
        json: Option<&str>,
    ) -> std::io::Result<(Answer, bool)> {
        let (stream, reader) = self.connection.as_mut().expect("connected");
        stream.write_all(&Self::request_bytes(method, path, json))?;
        let mut status_line = String::new();
        if reader.read_line(&mut status_line)? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        let status: u16 = status_line
            .split_whitespace()
            .nth(1)
            .and_then(|code| code.parse().ok())
            .unwrap_or_else(|| panic!("{method} {path}: status line {status_line:?}"));
        let mut length = 0usize;
        let mut keep_alive = status_line.starts_with("HTTP/1.1");
        loop {
            let mut line = String::new();
            reader.read_line(&mut line)?;
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            let (name, value) = line.split_once(':').unwrap_or((line, ""));
            let value = value.trim();
            if name.eq_ignore_ascii_case("content-length") {
                length = value.parse().expect("a Content-Length number");
            } else if name.eq_ignore_ascii_case("connection") && value == "close" {
                keep_alive = false;
            }
        }
        let mut body = vec![0u8; length];
        reader.read_exact(&mut body)?;
        Ok((
            Answer {
                status,
                body: String::from_utf8(body).expect("a UTF-8 body"),
            },
            keep_alive,
        ))
    }

    /// go-swagger's DescribeInstance: 200 and an InstanceInfo whose `state` Kata reads.
    fn describe_instance_state(&mut self) -> Option<String> {
        let answer = self.send("GET", "/", None).ok()?;
        assert_eq!(answer.status, 200, "GET /: {}", answer.body);
        let info: serde_json::Value = serde_json::from_str(&answer.body).expect("InstanceInfo");
        for field in ["app_name", "id", "state", "vmm_version"] {
            assert!(info[field].is_string(), "InstanceInfo.{field}: {info}");
        }
        Some(info["state"].as_str().unwrap().to_string())
    }

    /// fc.go's fcUpdateBlockDrive: PatchGuestDriveByID with a PartialDrive; only 204 is
    /// success for go-swagger's generated reader.
    fn patch_guest_drive(&mut self, drive_id: &str, path_on_host: &Path) {
        let body = format!(
            r#"{{"drive_id":"{drive_id}","path_on_host":"{}"}}"#,
            path_on_host.display()
        );
        let answer = self
            .send("PATCH", &format!("/drives/{drive_id}"), Some(&body))
            .unwrap_or_else(|e| panic!("PATCH /drives/{drive_id}: {e}"));
        assert_eq!(
            answer.status, 204,
            "PATCH /drives/{drive_id}: {}",
            answer.body
        );
    }
}

/// fc.go's parseVersion + checkVersion on `firecracker --version`.
fn kata_version_check(link: &Path) {
    let out = std::process::Command::new(link)
        .arg("--version")
        .output()
        .expect("run firecracker --version");
    assert!(out.status.success(), "firecracker --version: {out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    let first_line = text.split('\n').next().unwrap_or_default();
    let fields: Vec<&str> = first_line.split(' ').collect();
    assert!(fields.len() > 1, "malformed --version output: {text:?}");
    let version = fields[1].trim().trim_start_matches('v');
    let parts: Vec<u64> = version
        .split('.')
        .map(|part| {
            part.parse()
                .unwrap_or_else(|_| panic!("semver {version:?}"))
        })
        .collect();
    assert_eq!(parts.len(), 3, "semver {version:?}");
    assert!(
        (parts[0], parts[1], parts[2]) >= (0, 21, 1),
        "{version} is below Kata's minimum 0.21.1"
    );
}

/// A FIFO created and opened for reading, non-blocking, before the VMM starts (as Kata's
/// fcListenToFifo does, so the VMM's non-blocking open for writing succeeds), with a
/// thread collecting its lines.
fn listen_to_fifo(path: &Path) -> Arc<Mutex<Vec<String>>> {
    let name = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo(3) with a NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0, "mkfifo");
    let fifo = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .expect("open the FIFO for reading");
    let lines = Arc::new(Mutex::new(Vec::new()));
    let sink = lines.clone();
    std::thread::spawn(move || {
        let mut fifo = fifo;
        let mut pending = Vec::new();
        let mut buffer = [0u8; 4096];
        let deadline = Instant::now() + Duration::from_secs(120);
        while Instant::now() < deadline {
            match fifo.read(&mut buffer) {
                Ok(count) if count > 0 => {
                    pending.extend_from_slice(&buffer[..count]);
                    while let Some(end) = pending.iter().position(|&b| b == b'\n') {
                        let line: Vec<u8> = pending.drain(..=end).collect();
                        sink.lock()
                            .unwrap()
                            .push(String::from_utf8_lossy(&line).trim_end().to_string());
                    }
                }
                // No writer yet, or nothing written: look again shortly.
                _ => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    });
    lines
}

/// `json.MarshalIndent(value, "", "\t")` for the objects Kata writes (strings, numbers,
/// booleans, objects and arrays; Go keeps the models' field order, given here).
fn go_marshal_indent(value: &serde_json::Value, depth: usize, out: &mut String) {
    let indent = |n: usize| "\t".repeat(n);
    match value {
        serde_json::Value::Object(map) => {
            out.push_str("{\n");
            for (i, (key, item)) in map.iter().enumerate() {
                out.push_str(&format!(
                    "{}{}: ",
                    indent(depth + 1),
                    serde_json::json!(key)
                ));
                go_marshal_indent(item, depth + 1, out);
                out.push_str(if i + 1 < map.len() { ",\n" } else { "\n" });
            }
            out.push_str(&format!("{}}}", indent(depth)));
        }
        serde_json::Value::Array(items) => {
            out.push_str("[\n");
            for (i, item) in items.iter().enumerate() {
                out.push_str(&indent(depth + 1));
                go_marshal_indent(item, depth + 1, out);
                out.push_str(if i + 1 < items.len() { ",\n" } else { "\n" });
            }
            out.push_str(&format!("{}]", indent(depth)));
        }
        other => out.push_str(&other.to_string()),
    }
}

/// A JSON object with its keys in the given order (serde_json's map sorts otherwise).
fn object(fields: &[(&str, serde_json::Value)]) -> serde_json::Value {
    let mut map = serde_json::Map::new();
    for (key, value) in fields {
        map.insert((*key).to_string(), value.clone());
    }
    serde_json::Value::Object(map)
}

/// The command line fc.go builds (not jailed, not debug), after the test guest's words.
fn kata_boot_args(workload: &str) -> String {
    let root = "root=/dev/vda1 rootflags=data=ordered,errors=remount-ro ro rootfstype=ext4";
    let firecracker =
        "pci=off reboot=k panic=1 iommu=off net.ifnames=0 random.trust_cpu=on acpi=off";
    format!("{workload} {root} {firecracker} 8250.nr_uarts=0 agent.log_vport=1025")
}

/// The threads Kata's GetThreadIDs finds: those named `fc_vcpu <n>` under the VMM's pid.
fn kata_vcpu_threads(pid: i32) -> Vec<(u32, i32)> {
    let mut vcpus = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).expect("/proc/<pid>/task") {
        let task = task.unwrap();
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if let Some(id) = comm.trim_end().strip_prefix("fc_vcpu") {
            let id = id.trim().parse().unwrap_or_else(|_| {
                panic!("Kata refuses thread name {comm:?} (Invalid fc thread info)")
            });
            vcpus.push((id, task.file_name().to_str().unwrap().parse().unwrap()));
        }
    }
    vcpus
}

#[test]
fn kata_fc_go_sequence() {
    fc_go_sequence(PeerLaunch::Symlink);
}

/// What Kata really starts: the configured `firecracker` symlink resolved, so gpuvm runs
/// as `.../gpuvm --api-sock ... --config-file ...` and takes the front end from the flags.
#[test]
fn kata_fc_go_sequence_through_the_resolved_symlink() {
    fc_go_sequence(PeerLaunch::Resolved);
}

#[test]
fn kata_fc_go_sequence_through_a_hard_link() {
    fc_go_sequence(PeerLaunch::HardLink);
}

fn fc_go_sequence(program: PeerLaunch) {
    let scratch = Scratch::new("kata", &format!("fc-go-{program:?}"));
    let link = program.path(&scratch, "firecracker");
    if program != PeerLaunch::Resolved {
        kata_version_check(&link);
    } else {
        // fc.go runs `<resolved path> --version` too, and gpuvm's own name answers with
        // gpuvm's version ("gpuvm 0.1.0"), below Kata's minimum 0.21.1: that check is
        // Firecracker's name's alone (see the module's notes).
        let out = std::process::Command::new(&link)
            .arg("--version")
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        assert!(String::from_utf8_lossy(&out.stdout).starts_with("gpuvm "));
    }

    // The VM's directory (Kata's vmPath, with jailerRoot = vmPath/root when not jailed).
    let vm_path = scratch.path("vm");
    let jailer_root = vm_path.join("root");
    std::fs::create_dir_all(jailer_root.join("run")).unwrap();
    let socket = jailer_root.join("run/firecracker.socket");
    let hybrid_vsock = jailer_root.join("kata.hvsock");
    let kernel = jailer_root.join("vmlinux");
    run_gpuvm(
        &["guest-image", "--output", kernel.to_str().unwrap()],
        LIMIT,
    )
    .assert_code(0);
    let rootfs = jailer_root.join("rootfs");
    std::fs::rename(blk_image(&scratch, 1 << 20), &rootfs).unwrap();
    let placeholders: Vec<PathBuf> = (0..DISK_POOL_SIZE)
        .map(|i| {
            let path = jailer_root.join(format!("drive_{i}"));
            std::fs::File::create(&path).unwrap();
            path
        })
        .collect();
    let log_lines = listen_to_fifo(&vm_path.join("logs.fifo"));
    let metrics_lines = listen_to_fifo(&vm_path.join("metrics.fifo"));

    let s = |text: &str| serde_json::Value::String(text.to_string());
    let drive = |id: &str, read_only: bool, path: &Path| {
        object(&[
            ("drive_id", s(id)),
            ("is_read_only", read_only.into()),
            ("is_root_device", false.into()),
            ("path_on_host", s(path.to_str().unwrap())),
        ])
    };
    let mut drives = vec![drive("rootfs", true, &rootfs)];
    for (i, placeholder) in placeholders.iter().enumerate() {
        drives.push(drive(&format!("drive_{i}"), false, placeholder));
    }
    let fc_config = object(&[
        (
            "boot-source",
            object(&[
                ("boot_args", s(&kata_boot_args("virtio-vsock 3"))),
                ("kernel_image_path", s(kernel.to_str().unwrap())),
            ]),
        ),
        (
            "machine-config",
            object(&[
                ("mem_size_mib", 256.into()),
                ("smt", false.into()),
                ("vcpu_count", 1.into()),
            ]),
        ),
        (
            "vsock",
            object(&[
                ("guest_cid", 3.into()),
                ("uds_path", s(hybrid_vsock.to_str().unwrap())),
                ("vsock_id", s("root")),
            ]),
        ),
        (
            "logger",
            object(&[
                ("level", s("Error")),
                ("log_path", s(vm_path.join("logs.fifo").to_str().unwrap())),
            ]),
        ),
        (
            "metrics",
            object(&[(
                "metrics_path",
                s(vm_path.join("metrics.fifo").to_str().unwrap()),
            )]),
        ),
        ("drives", serde_json::Value::Array(drives)),
    ]);
    let mut config_text = String::new();
    go_marshal_indent(&fc_config, 0, &mut config_text);
    assert!(config_text.starts_with("{\n\t\"boot-source\": {\n\t\t\"boot_args\": "));
    let config_path = jailer_root.join("fcConfig.json");
    std::fs::write(&config_path, &config_text).unwrap();

    let mut vmm = SpawnedProcess::spawn_with_env(
        &link,
        &[
            "--api-sock",
            socket.to_str().unwrap(),
            "--config-file",
            config_path.to_str().unwrap(),
        ],
        &[("GPUVM_METRICS_PERIOD_MS", "100")],
    );

    // waitVMMRunning: GET / every 10 ms until Running, at most fcTimeout.
    let mut client = GoSwaggerClient::new(&socket);
    let started = Instant::now();
    loop {
        if client.describe_instance_state().as_deref() == Some("Running") {
            break;
        }
        assert!(
            started.elapsed() <= FC_TIMEOUT,
            "not Running within Kata's {FC_TIMEOUT:?}: {}\n{}",
            vmm.stdout(),
            vmm.stderr()
        );
        assert!(vmm.try_status().is_none(), "gpuvm ended: {}", vmm.stderr());
        std::thread::sleep(Duration::from_millis(10));
    }
    std::fs::set_permissions(&hybrid_vsock, std::fs::Permissions::from_mode(0o640))
        .expect("chmod 0640 the hybrid vsock socket, as StartVM does");

    // The agent's dialer: CONNECT 1024, an answer containing "OK", then its traffic.
    vmm.wait_for_stdout("virtio-vsock: listening", LIMIT);
    {
        let mut conn = UnixStream::connect(&hybrid_vsock).expect("dial the hybrid vsock");
        conn.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        // Go's fmt.Fprintf(conn, "CONNECT %d\n", port): the same bytes.
        writeln!(conn, "CONNECT {AGENT_PORT}").unwrap();
        let mut response = String::new();
        BufReader::new(&conn).read_line(&mut response).unwrap();
        assert!(response.contains("OK"), "handshake answer {response:?}");
        conn.write_all(b"agent").unwrap();
        let mut echo = [0u8; 5];
        conn.read_exact(&mut echo).unwrap();
        assert_eq!(&echo, b"agent");
    }

    // Block hot-plug: a placeholder swapped for an image, then back (hot removal).
    let image = jailer_root.join("container-image");
    disk_image(&image, BLK_MAGIC, 4 << 20);
    client.patch_guest_drive("drive_0", &image);
    client.patch_guest_drive("drive_0", &placeholders[0]);
    assert_eq!(client.describe_instance_state().as_deref(), Some("Running"));
    vsock_echo(&hybrid_vsock, b"the guest runs on after the drive swaps");

    // GetThreadIDs: every vCPU thread is found by Firecracker's name, `fc_vcpu <n>`, and
    // each name parses (Kata places them in the sandbox's vCPU cgroup).
    let vcpu_threads = kata_vcpu_threads(vmm.pid());
    let ids: Vec<u32> = vcpu_threads.iter().map(|&(id, _)| id).collect();
    assert_eq!(
        ids,
        vec![0],
        "Kata's view of the vCPU threads: {vcpu_threads:?}"
    );

    // The metrics lines Kata unmarshals.
    let deadline = Instant::now() + LIMIT;
    while metrics_lines.lock().unwrap().is_empty() {
        assert!(
            Instant::now() < deadline,
            "no metrics line through the FIFO"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    for line in metrics_lines.lock().unwrap().iter() {
        let value: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("metrics line {line:?}: {e}"));
        assert!(value.is_object(), "{line}");
    }

    // fcEnd: SIGTERM, then fcStopSandboxTimeout.
    vmm.signal(libc::SIGTERM);
    let ended = vmm.wait_timeout(STOP_TIMEOUT);
    assert!(
        ended.is_some(),
        "gpuvm did not end within {STOP_TIMEOUT:?} of SIGTERM"
    );
    let errors: Vec<String> = log_lines.lock().unwrap().clone();
    assert!(
        errors.iter().all(|line| !line.contains("panicked")),
        "{errors:?}"
    );
}
