//! gpuvm as `firecracker` (a symlink to the binary), driven the way Firecracker's
//! getting-started guide and snapshot docs drive Firecracker: logger, metrics,
//! machine-config, boot-source, drives, vsock, InstanceStart, GET / Running, pause,
//! snapshot/create into a state file and a memory file, kill, then a new process loads
//! them (mem_backend File) and the guest goes on (a vsock echo after the restore). Plus
//! the issue's table rows and the refusals of what gpuvm does not support.

use std::path::{Path, PathBuf};
use std::time::Duration;

use gpuvm_tests::virtio_support::{blk_image, vsock_echo};
use gpuvm_tests::{api_expect, gpuvm_bin, run_gpuvm, wait_for_api_socket, Scratch, SpawnedProcess};

const LIMIT: Duration = Duration::from_secs(60);

fn link(scratch: &Scratch) -> PathBuf {
    let link = scratch.path("firecracker");
    if !link.exists() {
        std::os::unix::fs::symlink(gpuvm_bin(), &link).unwrap();
    }
    link
}

fn start(scratch: &Scratch, api: &Path, id: &str) -> SpawnedProcess {
    let mut vmm = SpawnedProcess::spawn(
        &link(scratch),
        &[
            "--api-sock",
            api.to_str().unwrap(),
            "--id",
            id,
            "--level",
            "Info",
        ],
    );
    wait_for_api_socket(&mut vmm, api);
    vmm
}

fn info(api: &Path) -> serde_json::Value {
    serde_json::from_str(&api_expect(api, 200, "GET", "/", None)).unwrap()
}

fn refused(api: &Path, method: &str, path: &str, body: Option<&str>, needle: &str) {
    let answer = api_expect(api, 400, method, path, body);
    assert!(answer.contains(needle), "{method} {path}: {answer}");
}

fn kernel(scratch: &Scratch) -> PathBuf {
    let path = scratch.path("vmlinux");
    let out = run_gpuvm(&["guest-image", "--output", path.to_str().unwrap()], LIMIT);
    out.assert_code(0);
    path
}

#[test]
fn getting_started_then_snapshot_and_load() {
    let scratch = Scratch::new("firecracker", "getting-started");
    let api = scratch.path("fc.sock");
    let mut vmm = start(&scratch, &api, "fc-vm-1");
    let kernel = kernel(&scratch);

    // GET / before start, /version.
    let before = info(&api);
    assert_eq!(before["id"], "fc-vm-1");
    assert_eq!(before["state"], "Not started");
    assert!(before["vmm_version"].is_string() && before["app_name"].is_string());
    let version = api_expect(&api, 200, "GET", "/version", None);
    assert!(version.contains("firecracker_version"), "{version}");

    // Logger into a file, metrics into a FIFO nobody reads (must not block).
    let log = scratch.path("fc.log");
    api_expect(
        &api,
        204,
        "PUT",
        "/logger",
        Some(&format!(
            r#"{{"log_path": "{}", "level": "Info", "show_level": true, "show_log_origin": false}}"#,
            log.display()
        )),
    );
    let fifo = scratch.path("metrics.fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    api_expect(
        &api,
        204,
        "PUT",
        "/metrics",
        Some(&format!(r#"{{"metrics_path": "{}"}}"#, fifo.display())),
    );

    // machine-config with Firecracker's fields; PATCH; refusals name the field.
    api_expect(
        &api,
        204,
        "PUT",
        "/machine-config",
        Some(
            r#"{"vcpu_count": 1, "mem_size_mib": 64, "smt": false, "cpu_template": "None", "huge_pages": "None", "track_dirty_pages": false}"#,
        ),
    );
    refused(
        &api,
        "PUT",
        "/machine-config",
        Some(r#"{"vcpu_count": 1, "mem_size_mib": 64, "smt": true}"#),
        "smt",
    );
    refused(
        &api,
        "PUT",
        "/machine-config",
        Some(r#"{"vcpu_count": 1, "mem_size_mib": 64, "cpu_template": "T2"}"#),
        "T2",
    );
    refused(
        &api,
        "PUT",
        "/machine-config",
        Some(r#"{"vcpu_count": 1, "mem_size_mib": 64, "nosuch": 1}"#),
        "nosuch",
    );
    api_expect(
        &api,
        204,
        "PATCH",
        "/machine-config",
        Some(r#"{"mem_size_mib": 128}"#),
    );
    let machine: serde_json::Value =
        serde_json::from_str(&api_expect(&api, 200, "GET", "/machine-config", None)).unwrap();
    assert_eq!(machine["mem_size_mib"], 128);
    assert_eq!(machine["huge_pages"], "None");

    // boot-source: a relative path is resolved against gpuvm's working directory.
    let cwd = std::env::current_dir().unwrap();
    refused(
        &api,
        "PUT",
        "/boot-source",
        Some(r#"{"kernel_image_path": "no-such-vmlinux"}"#),
        &cwd.join("no-such-vmlinux").display().to_string(),
    );
    api_expect(
        &api,
        204,
        "PUT",
        "/boot-source",
        Some(&format!(
            r#"{{"kernel_image_path": "{}", "boot_args": "virtio-vsock 2"}}"#,
            kernel.display()
        )),
    );

    let image = blk_image(&scratch, 1 << 20);
    api_expect(
        &api,
        204,
        "PUT",
        "/drives/rootfs",
        Some(&format!(
            r#"{{"drive_id": "rootfs", "path_on_host": "{}", "is_root_device": true, "is_read_only": false, "cache_type": "Unsafe"}}"#,
            image.display()
        )),
    );
    refused(
        &api,
        "PUT",
        "/drives/other",
        Some(
            r#"{"drive_id": "other", "path_on_host": "/x", "is_root_device": false, "partuuid": "abc"}"#,
        ),
        "partuuid",
    );
    let uds = scratch.path("v.sock");
    api_expect(
        &api,
        204,
        "PUT",
        "/vsock",
        Some(&format!(
            r#"{{"guest_cid": 3, "uds_path": "{}"}}"#,
            uds.display()
        )),
    );

    // Routes gpuvm does not serve: 400 naming them.
    refused(&api, "PUT", "/mmds", Some("{}"), "MMDS");
    refused(
        &api,
        "PUT",
        "/mmds/config",
        Some(r#"{"network_interfaces": []}"#),
        "MMDS",
    );
    refused(
        &api,
        "PUT",
        "/balloon",
        Some(r#"{"amount_mib": 0, "deflate_on_oom": false}"#),
        "balloon",
    );
    refused(
        &api,
        "PUT",
        "/serial",
        Some(r#"{"serial_out_path": "/tmp/x"}"#),
        "serial",
    );
    refused(&api, "PUT", "/cpu-config", Some("{}"), "CPU templates");

    let vm_config: serde_json::Value =
        serde_json::from_str(&api_expect(&api, 200, "GET", "/vm/config", None)).unwrap();
    assert_eq!(vm_config["machine-config"]["vcpu_count"], 1);
    assert_eq!(vm_config["drives"][0]["drive_id"], "rootfs");
    assert!(vm_config["boot-source"]["kernel_image_path"].is_string());

    api_expect(
        &api,
        204,
        "PUT",
        "/actions",
        Some(r#"{"action_type": "InstanceStart"}"#),
    );
    vmm.wait_for_stdout("virtio-vsock: listening", LIMIT);
    assert_eq!(info(&api)["state"], "Running");
    vsock_echo(&uds, b"before the snapshot");
    for _ in 0..64 {
        api_expect(
            &api,
            204,
            "PUT",
            "/actions",
            Some(r#"{"action_type": "FlushMetrics"}"#),
        );
    }

    api_expect(&api, 204, "PATCH", "/vm", Some(r#"{"state": "Paused"}"#));
    assert_eq!(info(&api)["state"], "Paused");
    let state = scratch.path("snapshot.state");
    let mem = scratch.path("snapshot.mem");
    api_expect(
        &api,
        204,
        "PUT",
        "/snapshot/create",
        Some(&format!(
            r#"{{"snapshot_type": "Full", "snapshot_path": "{}", "mem_file_path": "{}"}}"#,
            state.display(),
            mem.display()
        )),
    );
    assert!(
        state.is_file() && mem.is_file(),
        "a state file and a memory file"
    );
    assert!(
        std::fs::read_to_string(&log).unwrap().contains("INFO"),
        "log lines in the log file"
    );
    vmm.signal(libc::SIGKILL);
    let _ = vmm.wait(LIMIT);

    // A new process loads the two files and the guest goes on.
    let api2 = scratch.path("fc2.sock");
    let restored = start(&scratch, &api2, "fc-vm-2");
    refused(
        &api2,
        "PUT",
        "/snapshot/load",
        Some(&format!(
            r#"{{"snapshot_path": "{}", "mem_backend": {{"backend_type": "File", "backend_path": "{}"}}, "clock_realtime": true}}"#,
            state.display(),
            mem.display()
        )),
        "clock_realtime",
    );
    api_expect(
        &api2,
        204,
        "PUT",
        "/snapshot/load",
        Some(&format!(
            r#"{{"snapshot_path": "{}", "mem_backend": {{"backend_type": "File", "backend_path": "{}"}}, "enable_diff_snapshots": false, "resume_vm": true}}"#,
            state.display(),
            mem.display()
        )),
    );
    assert_eq!(info(&api2)["state"], "Running");
    vsock_echo(&uds, b"after the restore");
    let out = restored.wait(LIMIT);
    out.assert_code(0);
    out.assert_stdout_has("virtio-vsock: ok");
}

#[test]
fn config_file_without_api_boots_at_once() {
    let scratch = Scratch::new("firecracker", "config-file");
    let kernel = kernel(&scratch);
    let config = scratch.path("vm.json");
    std::fs::write(
        &config,
        format!(
            r#"{{"boot-source": {{"kernel_image_path": "{}", "boot_args": "hello"}},
            "machine-config": {{"vcpu_count": 1, "mem_size_mib": 64, "smt": false}},
            "drives": [], "network-interfaces": [], "balloon": null,
            "logger": {{"log_path": "{}", "level": "Info"}}}}"#,
            kernel.display(),
            scratch.path("log").display()
        ),
    )
    .unwrap();
    let link = link(&scratch);
    let vmm = SpawnedProcess::spawn(
        &link,
        &[
            "--no-api",
            "--config-file",
            config.to_str().unwrap(),
            "--id",
            "x",
            "--boot-timer",
            "--show-level",
            "--show-log-origin",
            "--seccomp-level",
            "2",
        ],
    );
    let out = vmm.wait(LIMIT);
    out.assert_code(0);
    out.assert_stdout_has("hello from ring 3");

    std::fs::write(&config, r#"{"boot-source": {"kernel_image_path": "/k"}, "mmds-config": {"network_interfaces": ["eth0"]}}"#).unwrap();
    let out = SpawnedProcess::spawn(
        &link,
        &["--no-api", "--config-file", config.to_str().unwrap()],
    )
    .wait(LIMIT);
    out.assert_code(125);
    out.assert_stderr_has("mmds-config");

    let out = SpawnedProcess::spawn(
        &link,
        &["--api-sock", "/tmp/x.sock", "--mmds-size-limit", "10"],
    )
    .wait(LIMIT);
    out.assert_code(125);
    out.assert_stderr_has("--mmds-size-limit");
}

/// Metrics reach the output on their own, every period, as Firecracker's do (60 s there;
/// shortened here through GPUVM_METRICS_PERIOD_MS), from `--metrics-path` and from
/// `PUT /metrics` alike, with seccomp on and no FlushMetrics.
#[test]
fn metrics_are_written_every_period_without_flush_metrics() {
    let scratch = Scratch::new("firecracker", "periodic-metrics");
    let lines = |path: &Path| -> Vec<serde_json::Value> {
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .map(|line| serde_json::from_str(line).expect("a JSON line"))
            .collect()
    };
    let wait_for_lines = |path: &Path, vmm: &SpawnedProcess| {
        let deadline = std::time::Instant::now() + LIMIT;
        while lines(path).len() < 2 {
            assert!(
                std::time::Instant::now() < deadline,
                "fewer than 2 metrics lines in {}: {}",
                path.display(),
                vmm.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(lines(path).iter().all(|line| line.is_object()));
    };
    let env = [("GPUVM_METRICS_PERIOD_MS", "100")];

    let flagged = scratch.path("flag-metrics.json");
    let api = scratch.path("fc-flag.sock");
    let mut vmm = SpawnedProcess::spawn_with_env(
        &link(&scratch),
        &[
            "--api-sock",
            api.to_str().unwrap(),
            "--metrics-path",
            flagged.to_str().unwrap(),
        ],
        &env,
    );
    wait_for_api_socket(&mut vmm, &api);
    wait_for_lines(&flagged, &vmm);
    drop(vmm);

    let put = scratch.path("put-metrics.json");
    let api = scratch.path("fc-put.sock");
    let mut vmm = SpawnedProcess::spawn_with_env(
        &link(&scratch),
        &["--api-sock", api.to_str().unwrap()],
        &env,
    );
    wait_for_api_socket(&mut vmm, &api);
    assert!(lines(&put).is_empty());
    api_expect(
        &api,
        204,
        "PUT",
        "/metrics",
        Some(&format!(r#"{{"metrics_path": "{}"}}"#, put.display())),
    );
    wait_for_lines(&put, &vmm);
    assert!(
        !vmm.stderr().contains("blocked system call"),
        "{}",
        vmm.stderr()
    );
}
