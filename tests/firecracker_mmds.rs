//! MMDS through gpuvm's Firecracker front end (the binary started as `firecracker`): the
//! data store routes (PUT, PATCH, GET /mmds, the 51200-byte limit and `--mmds-size-limit`,
//! answered 413 as Firecracker does) and PUT /mmds/config (V1/V2, interfaces that must be
//! configured, pre-boot only), and a `--config-file`'s `mmds-config` section. The guest
//! side (ARP, TCP, HTTP, V2 tokens over hand-built frames) is tested in the gpuvm-mmds
//! crate, and with a Linux guest in the real-kernel tier.

use std::path::Path;
use std::time::Duration;

use gpuvm_tests::{
    api_expect, firecracker_link, run_gpuvm, start_firecracker, wait_for_api_socket, Scratch,
    SpawnedProcess,
};

const LIMIT: Duration = Duration::from_secs(60);

fn refused(api: &Path, method: &str, path: &str, body: &str, needle: &str) {
    let answer = api_expect(api, 400, method, path, Some(body));
    assert!(answer.contains(needle), "{method} {path}: {answer}");
}

#[test]
fn mmds_routes_and_config() {
    let scratch = Scratch::new("firecracker-mmds", "routes");
    let api = scratch.path("fc.sock");
    let mut vmm = start_firecracker(&scratch, &api, "fc-mmds", &[]);
    api_expect(
        &api,
        204,
        "PUT",
        "/mmds",
        Some(r#"{"latest": {"meta-data": {"ami-id": "ami-1"}}}"#),
    );
    api_expect(
        &api,
        204,
        "PATCH",
        "/mmds",
        Some(r#"{"latest": {"meta-data": {"hostname": "vm"}}}"#),
    );
    let got: serde_json::Value =
        serde_json::from_str(&api_expect(&api, 200, "GET", "/mmds", None)).unwrap();
    assert_eq!(
        got,
        serde_json::json!({"latest": {"meta-data": {"ami-id": "ami-1", "hostname": "vm"}}})
    );
    refused(&api, "PUT", "/mmds", "[]", "object");
    let big = format!(r#"{{"a": "{}"}}"#, "x".repeat(51200));
    too_large(&api, "PUT", &big, 51200);

    refused(
        &api,
        "PUT",
        "/mmds/config",
        r#"{"version": "V2", "network_interfaces": ["eth0"]}"#,
        "eth0",
    );
    refused(
        &api,
        "PUT",
        "/mmds/config",
        r#"{"network_interfaces": []}"#,
        "empty",
    );
    refused(
        &api,
        "PUT",
        "/mmds/config",
        r#"{"network_interfaces": ["eth0"], "version": "V3"}"#,
        "V3",
    );
    // An interface on a tap nobody opens until the start.
    api_expect(
        &api,
        204,
        "PUT",
        "/network-interfaces/eth0",
        Some(r#"{"iface_id": "eth0", "host_dev_name": "fcmmds0"}"#),
    );
    api_expect(
        &api,
        204,
        "PUT",
        "/mmds/config",
        Some(
            r#"{"version": "V2", "network_interfaces": ["eth0"], "ipv4_address": "169.254.170.2", "imds_compat": false}"#,
        ),
    );
    let config: serde_json::Value =
        serde_json::from_str(&api_expect(&api, 200, "GET", "/vm/config", None)).unwrap();
    assert_eq!(config["mmds-config"]["version"], "V2");
    vmm.signal(libc::SIGKILL);
    let _ = vmm.wait(LIMIT);
    let _ = run_gpuvm;
}

/// A store change over the limit: 413 with a `fault_message` naming the limit, as
/// Firecracker answers it.
fn too_large(api: &Path, method: &str, body: &str, limit: usize) {
    let answer = api_expect(api, 413, method, "/mmds", Some(body));
    let answer: serde_json::Value = serde_json::from_str(&answer).unwrap();
    let message = answer["fault_message"].as_str().unwrap_or_default();
    assert!(
        message.contains("limit exceeded") && message.contains(&format!("limit of {limit} bytes")),
        "{method} /mmds: {answer}"
    );
}

#[test]
fn mmds_size_limit_flag_bounds_the_store() {
    let scratch = Scratch::new("firecracker-mmds", "size-limit");
    let api = scratch.path("fc.sock");
    let mut vmm = start_firecracker(&scratch, &api, "fc-mmds", &["--mmds-size-limit", "64"]);
    // 55 bytes serialized: fits.
    let fits = r#"{"latest": {"meta-data": {"ami-id": "ami-12345678"}}}"#;
    api_expect(&api, 204, "PUT", "/mmds", Some(fits));
    // Each would take the store past 64 bytes: refused, the store unchanged.
    too_large(
        &api,
        "PUT",
        &format!(r#"{{"a": "{}"}}"#, "x".repeat(64)),
        64,
    );
    too_large(&api, "PATCH", r#"{"latest": {"hostname": "a-host"}}"#, 64);
    let got: serde_json::Value =
        serde_json::from_str(&api_expect(&api, 200, "GET", "/mmds", None)).unwrap();
    assert_eq!(
        got,
        serde_json::from_str::<serde_json::Value>(fits).unwrap()
    );
    vmm.signal(libc::SIGKILL);
    let _ = vmm.wait(LIMIT);

    // A limit that is not a number of bytes: Firecracker's command-line error, status 125.
    let out = SpawnedProcess::spawn(
        &firecracker_link(&scratch),
        &[
            "--api-sock",
            api.to_str().unwrap(),
            "--mmds-size-limit",
            "64k",
        ],
    )
    .wait(LIMIT);
    out.assert_code(125);
    out.assert_stderr_has("--mmds-size-limit");
}

/// A tap made for the test, deleted when dropped; `None` (the test skips, saying so) where
/// taps cannot be made.
struct HostTap(String);

impl HostTap {
    fn create(name: &str) -> Option<HostTap> {
        let ip = |args: &[&str]| std::process::Command::new("ip").args(args).output();
        let _ = ip(&["link", "del", name]);
        match ip(&["tuntap", "add", "dev", name, "mode", "tap"]) {
            Ok(out) if out.status.success() => Some(HostTap(name.into())),
            other => {
                eprintln!("skipped: cannot create tap {name}: {other:?}");
                None
            }
        }
    }
}

impl Drop for HostTap {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["link", "del", &self.0])
            .output();
    }
}

#[test]
fn config_file_mmds_config_applies_as_put_mmds_config() {
    let scratch = Scratch::new("firecracker-mmds", "config-file");
    let Some(tap) = HostTap::create("fcmmdscf0") else {
        return;
    };
    let kernel = scratch.path("vmlinux");
    run_gpuvm(
        &["guest-image", "--output", kernel.to_str().unwrap()],
        LIMIT,
    )
    .assert_code(0);
    let config = scratch.path("vm.json");
    let write_config = |mmds: &str| {
        std::fs::write(
            &config,
            format!(
                r#"{{"boot-source": {{"kernel_image_path": "{}", "boot_args": "memloop 32M 13 1000000"}},
                "machine-config": {{"vcpu_count": 1, "mem_size_mib": 64}},
                "network-interfaces": [{{"iface_id": "eth0", "host_dev_name": "{}"}}],
                "mmds-config": {mmds}}}"#,
                kernel.display(),
                tap.0
            ),
        )
        .unwrap();
    };
    let link = firecracker_link(&scratch);

    // The same checks as PUT /mmds/config, named by the section's field path.
    for (mmds, needle) in [
        (
            r#"{"network_interfaces": ["eth1"]}"#,
            "mmds-config.network_interfaces: no network interface [\"eth1\"]",
        ),
        (
            r#"{"network_interfaces": ["eth0"], "ipv4_address": "10.0.0.1"}"#,
            "mmds-config.ipv4_address",
        ),
        (
            r#"{"network_interfaces": ["eth0"], "version": "V3"}"#,
            "mmds-config.version = \"V3\"",
        ),
    ] {
        write_config(mmds);
        let out = SpawnedProcess::spawn(
            &link,
            &["--no-api", "--config-file", config.to_str().unwrap()],
        )
        .wait(LIMIT);
        out.assert_code(125);
        out.assert_stderr_has(needle);
    }

    // Accepted: the VM boots with MMDS V2 on eth0, as if PUT /mmds/config had said it (its
    // memloop runs until the VMM is killed).
    write_config(
        r#"{"version": "V2", "network_interfaces": ["eth0"], "ipv4_address": "169.254.170.2", "imds_compat": true}"#,
    );
    let api = scratch.path("fc.sock");
    let mut vmm = SpawnedProcess::spawn(
        &link,
        &[
            "--api-sock",
            api.to_str().unwrap(),
            "--config-file",
            config.to_str().unwrap(),
        ],
    );
    wait_for_api_socket(&mut vmm, &api);
    vmm.wait_for_stdout("memloop: iter 1 ok", LIMIT);
    let info: serde_json::Value =
        serde_json::from_str(&api_expect(&api, 200, "GET", "/", None)).unwrap();
    assert_eq!(info["state"], "Running");
    let config: serde_json::Value =
        serde_json::from_str(&api_expect(&api, 200, "GET", "/vm/config", None)).unwrap();
    assert_eq!(
        config["mmds-config"],
        serde_json::json!({"version": "V2", "network_interfaces": ["eth0"],
            "ipv4_address": "169.254.170.2", "imds_compat": true})
    );
    assert_eq!(config["network-interfaces"][0]["iface_id"], "eth0");
    // Configured once, before the start: a second configuration is refused now, as
    // Firecracker refuses it after the start; the data store stays open.
    refused(
        &api,
        "PUT",
        "/mmds/config",
        r#"{"network_interfaces": ["eth0"]}"#,
        "after starting",
    );
    api_expect(
        &api,
        204,
        "PUT",
        "/mmds",
        Some(r#"{"latest": {"id": "i-1"}}"#),
    );
    vmm.signal(libc::SIGKILL);
    let _ = vmm.wait(LIMIT);
}
