//! MMDS through gpuvm's Firecracker front end (the binary started as `firecracker`): the
//! data store routes (PUT, PATCH, GET /mmds, the 51200-byte limit) and PUT /mmds/config
//! (V1/V2, interfaces that must be configured, pre-boot only). The guest side (ARP, TCP,
//! HTTP, V2 tokens over hand-built frames) is tested in the gpuvm-mmds crate.

use std::path::Path;
use std::time::Duration;

use gpuvm_tests::{api_expect, run_gpuvm, start_firecracker, Scratch};

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
    refused(&api, "PUT", "/mmds", &big, "51200");

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
