//! gpuvm as `cloud-hypervisor` (a symlink to the binary), driven the way Kata
//! Containers' clh driver drives Cloud Hypervisor: ping, vm.create with a Kata-shaped
//! VmConfig, vm.info until Created, vm.boot, vm.info until Running, pause/resume, the
//! agent's hybrid vsock (`CONNECT 1024`), vmm.shutdown; and the errors.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use gpuvm_tests::{api_expect, gpuvm_bin, wait_for_api_socket, Scratch, SpawnedProcess};

const LIMIT: Duration = Duration::from_secs(60);

fn state(api: &Path) -> String {
    let info = api_expect(api, 200, "GET", "/api/v1/vm.info", None);
    let info: serde_json::Value = serde_json::from_str(&info).unwrap();
    info["state"].as_str().unwrap().to_string()
}

/// Starts `cloud-hypervisor --api-socket <api> -v --seccomp true` (a symlink to gpuvm).
fn start(scratch: &Scratch) -> (SpawnedProcess, std::path::PathBuf) {
    let link = scratch.path("cloud-hypervisor");
    std::os::unix::fs::symlink(gpuvm_bin(), &link).unwrap();
    let api = scratch.path("clh-api.sock");
    let mut vmm = SpawnedProcess::spawn(
        &link,
        &[
            "--api-socket",
            api.to_str().unwrap(),
            "-v",
            "--seccomp",
            "true",
        ],
    );
    wait_for_api_socket(&mut vmm, &api);
    (vmm, api)
}

fn kata_config(kernel: &Path, vsock: &Path, extra: &str) -> String {
    format!(
        r#"{{"payload":{{"kernel":"{}","cmdline":"virtio-vsock 1"}},
            "cpus":{{"boot_vcpus":1,"max_vcpus":4,"kvm_hyperv":false,"nested":true}},
            "memory":{{"size":134217728,"mergeable":false,"hotplug_method":"Acpi","shared":true,
                       "hugepages":false,"prefault":false,"thp":true,"hotplug_size":536870912}},
            "rng":{{"src":"/dev/urandom","iommu":false}},
            "serial":{{"mode":"Tty","iommu":false}},"console":{{"mode":"Off","iommu":false}},
            "vsock":{{"cid":3,"socket":"{}","iommu":false}},
            "platform":{{"num_pci_segments":2,"tdx":false,"sev_snp":false}},
            "iommu":false,"watchdog":false,"pvpanic":false,"landlock_enable":false{extra}}}"#,
        kernel.display(),
        vsock.display()
    )
}

#[test]
fn kata_sequence_boots_and_talks_to_the_guest_over_hybrid_vsock() {
    let scratch = Scratch::new("cloud_hypervisor", "kata");
    let kernel = scratch.path("guest.elf");
    let written = std::process::Command::new(gpuvm_bin())
        .args(["guest-image", "--output", kernel.to_str().unwrap()])
        .status()
        .unwrap();
    assert!(written.success());
    let vsock = scratch.path("clh.sock");
    let (mut vmm, api) = start(&scratch);

    let ping = api_expect(&api, 200, "GET", "/api/v1/vmm.ping", None);
    assert!(ping.contains("\"version\""), "{ping}");
    api_expect(&api, 404, "GET", "/api/v1/vm.info", None);
    api_expect(&api, 404, "PUT", "/api/v1/vm.boot", None);
    // Bad JSON, an unknown field away from its default: 400, and nothing created.
    api_expect(&api, 400, "PUT", "/api/v1/vm.create", Some("{"));
    let unknown = kata_config(&kernel, &vsock, r#","frobnicate":true"#);
    let refused = api_expect(&api, 400, "PUT", "/api/v1/vm.create", Some(&unknown));
    assert!(refused.contains("frobnicate"), "{refused}");
    api_expect(&api, 404, "GET", "/api/v1/vm.info", None);

    let config = kata_config(&kernel, &vsock, "");
    api_expect(&api, 204, "PUT", "/api/v1/vm.create", Some(&config));
    api_expect(&api, 409, "PUT", "/api/v1/vm.create", Some(&config));
    assert_eq!(state(&api), "Created");
    api_expect(&api, 405, "PUT", "/api/v1/vm.pause", None);
    let started = Instant::now();
    api_expect(&api, 204, "PUT", "/api/v1/vm.boot", None);
    assert_eq!(state(&api), "Running");
    eprintln!("vm.boot answered in {:?}", started.elapsed());
    vmm.wait_for_stdout("virtio-vsock: listening", LIMIT);

    api_expect(&api, 204, "PUT", "/api/v1/vm.pause", None);
    assert_eq!(state(&api), "Paused");
    api_expect(&api, 204, "PUT", "/api/v1/vm.resume", None);
    assert_eq!(state(&api), "Running");
    let counters = api_expect(&api, 200, "GET", "/api/v1/vm.counters", None);
    assert!(counters.starts_with('{'), "{counters}");
    let resize = api_expect(
        &api,
        400,
        "PUT",
        "/api/v1/vm.resize",
        Some(r#"{"desired_vcpus":2}"#),
    );
    assert!(resize.contains("static_sandbox_resource_mgmt"), "{resize}");

    // The agent's hybrid vsock: CONNECT 1024 → OK <port>, then an echo.
    let mut stream = UnixStream::connect(&vsock).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    stream.write_all(b"CONNECT 1024\n").unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    assert!(line.starts_with("OK "), "{line:?}");
    stream.write_all(b"kata agent").unwrap();
    let mut echo = [0u8; 10];
    std::io::Read::read_exact(&mut reader, &mut echo).unwrap();
    assert_eq!(&echo, b"kata agent");
    stream.shutdown(std::net::Shutdown::Write).unwrap();
    drop(reader);

    api_expect(&api, 204, "PUT", "/api/v1/vmm.shutdown", None);
    let out = vmm.wait(LIMIT);
    assert!(out.code().is_some(), "{}", out.describe());
}

#[test]
fn vmm_shutdown_before_create_ends_the_process() {
    let scratch = Scratch::new("cloud_hypervisor", "shutdown");
    let (vmm, api) = start(&scratch);
    api_expect(&api, 404, "GET", "/api/v1/nope", None);
    api_expect(&api, 405, "GET", "/api/v1/vm.boot", None);
    api_expect(&api, 204, "PUT", "/api/v1/vmm.shutdown", None);
    vmm.wait(LIMIT).assert_code(0);
}

#[test]
fn gpuvm_routes_still_answer_beside_api_v1() {
    let scratch = Scratch::new("cloud_hypervisor", "both");
    let (vmm, api) = start(&scratch);
    let info = api_expect(&api, 200, "GET", "/", None);
    assert!(info.contains("gpuvm"), "{info}");
    api_expect(&api, 204, "PUT", "/api/v1/vmm.shutdown", None);
    vmm.wait(LIMIT).assert_code(0);
}
