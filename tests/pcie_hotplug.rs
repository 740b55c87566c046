//! GPU hot-plug into PCIe root ports end to end: a VM started with `--pcie-root-ports N`
//! has N empty root ports with native hot-plug slots; PUT /gpus/{id} plugs the emulated
//! GPU (`gpuvm-emu-gpu`, vfio-user) into a free one, and the test guest's `pcie-hotplug`
//! workload drives the slot as Linux's pciehp does (presence detect, power on, link up;
//! attention button with the port's MSI, power off), runs the `pci` checks on the device
//! behind the port and checks its BARs lie in the port's windows. A snapshot keeps the
//! ports (their registers; the device in one saves its own state by VFIO migration) and a
//! restore rebuilds them in their slots with their windows.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpuvm_tests::{api_boot, api_expect, gpu_body, wait_for_api_socket, Scratch, SpawnedProcess};

const LIMIT: Duration = Duration::from_secs(120);

fn emu_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_gpuvm-emu-gpu"))
}

fn socket_path(name: &str) -> PathBuf {
    gpuvm_tests::socket_path("pcie-hp", name)
}

fn start_emu(socket: &Path) -> SpawnedProcess {
    gpuvm_tests::start_emu_gpu(&emu_bin(), socket, &[])
}

/// A running VM with `ports` hot-plug root ports, the API on a socket, and `workload`
/// as its command line; waits until the guest found the ports.
fn start_vm(
    name: &str,
    ports: u8,
    workload: &str,
    env: &[(&str, &str)],
) -> (SpawnedProcess, PathBuf) {
    let api = socket_path(&format!("{name}-api"));
    let ports = ports.to_string();
    let args = [
        "run",
        "--api-sock",
        api.to_str().expect("UTF-8 socket path"),
        "--pcie-root-ports",
        &ports,
    ];
    let mut vmm = SpawnedProcess::gpuvm_with_env(&args, env);
    wait_for_api_socket(&mut vmm, &api);
    api_boot(&api, workload);
    vmm.wait_for_stdout("hot-plug root port(s); waiting for", LIMIT);
    (vmm, api)
}

/// PUT /gpus/{id}: the answer's BDF, which must be device 0 of a bus behind bus 0.
fn hot_plug(api: &Path, id: &str, socket: &Path) -> String {
    let body = api_expect(
        api,
        200,
        "PUT",
        &format!("/gpus/{id}"),
        Some(&gpu_body(id, socket)),
    );
    let answer: serde_json::Value = serde_json::from_str(&body).expect("JSON answer");
    let bdf = answer["bdf"].as_str().expect("bdf").to_string();
    assert!(
        bdf.starts_with("0000:") && bdf.ends_with(":00.0") && !bdf.starts_with("0000:00:"),
        "{bdf:?} is device 0 behind a root port"
    );
    bdf
}

fn ctl(api: &Path, args: &[&str]) -> gpuvm_tests::RunOutput {
    gpuvm_tests::gpuvm_ctl(api, args, LIMIT)
}

/// One root port, two devices in turn: each lands behind the port (the BDF says so), the
/// guest powers the slot on, checks the device (MSI-X, DMA, BARs in the port's windows),
/// and powers it off on DELETE, which removes it; the second goes into the same port.
/// Around them: a plug with no free port left, DELETE of an unknown id, and a snapshot,
/// which is refused (the first device offers no VFIO migration) with the VM left running.
#[test]
fn two_gpus_in_turn_through_one_root_port() {
    let scratch = Scratch::new("pcie-hotplug", "turns");
    let (mut vmm, api) = start_vm("turns", 1, "pcie-hotplug 2", &[]);
    let out = vmm.stdout();
    assert!(
        out.contains("pcie-hotplug: 1 hot-plug root port(s)"),
        "{out}"
    );
    let missing = api_expect(&api, 404, "DELETE", "/gpus/nothing", None);
    assert!(missing.contains("nothing"), "{missing}");

    let first = socket_path("first");
    let emu_a = gpuvm_tests::start_emu_gpu(&emu_bin(), &first, &["--no-migration"]);
    let started = Instant::now();
    let bdf = hot_plug(&api, "gpu0", &first);
    vmm.wait_for_stdout("BARs inside the port's windows", LIMIT);
    let out = vmm.stdout();
    let bus = &bdf[5..7];
    assert!(
        out.contains(&format!(
            "pcie-hotplug: device 1 at {bus}:00.0 passed the pci checks, BARs inside the port's windows"
        )),
        "{out}"
    );
    assert!(out.contains("pci: dma verified 65536 bytes"), "{out}");
    eprintln!(
        "plugged into {bdf}, checked by the guest after {:?}",
        started.elapsed()
    );

    // The only port is taken: a second device is refused before anything is opened.
    let extra = socket_path("extra");
    let refused = api_expect(
        &api,
        409,
        "PUT",
        "/gpus/gpu1",
        Some(&gpu_body("gpu1", &extra)),
    );
    assert!(refused.contains("no free PCIe root port"), "{refused}");

    // A snapshot of a device that cannot save its state is refused cleanly, naming it; the
    // VM keeps running with its device.
    let snapshot = scratch.path("snap");
    let refused = ctl(
        &api,
        &["snapshot-create", "--dir", snapshot.to_str().unwrap()],
    );
    refused.assert_clean_error("gpu0");
    assert!(
        refused.stderr.contains("no VFIO migration"),
        "{}",
        refused.stderr
    );
    let info = api_expect(&api, 200, "GET", "/", None);
    assert!(info.contains(r#""state":"Running""#), "{info}");
    assert!(info.contains(r#""state":"attached""#), "{info}");

    api_expect(&api, 204, "DELETE", "/gpus/gpu0", None);
    vmm.wait_for_stdout("pcie-hotplug: device 1 removed", LIMIT);
    let out = vmm.stdout();
    assert!(
        out.contains("pcie-hotplug: attention button pressed"),
        "{out}"
    );
    assert!(out.contains("pcie-hotplug: MSI from 00:"), "{out}");
    let emu_out = emu_a.wait(Duration::from_secs(10));
    assert_eq!(emu_out.code(), Some(0), "{}", emu_out.stderr);
    api_expect(&api, 404, "DELETE", "/gpus/gpu0", None);

    let second = socket_path("second");
    let emu_b = start_emu(&second);
    let again = hot_plug(&api, "gpu1", &second);
    assert_eq!(again, bdf, "the freed port takes the next device");
    vmm.wait_for_stdout("pcie-hotplug: device 2 at", LIMIT);
    api_expect(&api, 204, "DELETE", "/gpus/gpu1", None);
    let out = vmm.wait(LIMIT);
    out.assert_code(0)
        .assert_stdout_has("pcie-hotplug: device 2 removed")
        .assert_stdout_has("pcie-hotplug: ok");
    emu_b.wait(Duration::from_secs(10));
}

/// Two root ports, a GPU hot-plugged into one, a snapshot, a restore into a fresh VMM: the
/// ports come back in their slots with their windows, bus numbers and slot registers (card
/// present, powered on, link up), the GPU behind its port with its state (the guest's
/// `pci` checks pass on it again), and a second GPU hot-plugged after the restore goes into
/// the other port. Both are removed through their slots at the end.
#[test]
fn root_ports_and_the_gpu_in_one_survive_a_snapshot_and_restore() {
    let scratch = Scratch::new("pcie-hotplug", "snapshot");
    let first = socket_path("snap-first");
    // It serves the snapshotted VM, then the restored one.
    let emu_a = gpuvm_tests::start_emu_gpu(&emu_bin(), &first, &["--clients", "2"]);
    let (mut vmm, api) = start_vm("snap", 2, "pcie-hotplug 2 snapshot", &[]);
    let bdf = hot_plug(&api, "gpu0", &first);
    vmm.wait_for_stdout("send a byte once the VM is restored", LIMIT);
    let out = vmm.stdout();
    assert!(
        out.contains("pcie-hotplug: 2 hot-plug root port(s)"),
        "{out}"
    );
    let ports: Vec<&str> = out
        .lines()
        .filter(|line| line.starts_with("pcie-hotplug: root port 00:"))
        .collect();
    assert_eq!(ports.len(), 2, "{out}");

    let dir = scratch.path("snap");
    gpuvm_tests::api_snapshot_create(&api, &dir);
    let state = std::fs::read(dir.join("state")).expect("state file");
    let state = String::from_utf8_lossy(&state);
    assert!(
        state.contains("\"pcie_root_ports\"") && state.contains("\"migrated_gpus\""),
        "the state holds the ports and the device"
    );
    vmm.signal(libc::SIGKILL);
    let _ = vmm.wait(Duration::from_secs(10));

    let api2 = socket_path("snap-api2");
    let mut restored =
        SpawnedProcess::gpuvm_with_input(&["run", "--api-sock", api2.to_str().unwrap()]);
    wait_for_api_socket(&mut restored, &api2);
    gpuvm_tests::api_load_lazy(&api2, &dir);
    let info = api_expect(&api2, 200, "GET", "/", None);
    assert!(info.contains("gpu0"), "{info}");
    restored.write_stdin(b"r");
    restored.wait_for_stdout("did one more DMA, verified", LIMIT);
    let out = restored.stdout();
    assert!(
        out.contains(&format!("{}:00.0 kept its state", &bdf[5..7])),
        "{out}"
    );

    // The second GPU goes into the other port.
    let second = socket_path("snap-second");
    let emu_b = start_emu(&second);
    let other = hot_plug(&api2, "gpu1", &second);
    assert_ne!(other, bdf, "the free port behind another bus");
    restored.wait_for_stdout("pcie-hotplug: device 2 at", LIMIT);
    api_expect(&api2, 204, "DELETE", "/gpus/gpu1", None);
    restored.wait_for_stdout("pcie-hotplug: device 2 removed", LIMIT);
    api_expect(&api2, 204, "DELETE", "/gpus/gpu0", None);
    let out = restored.wait(LIMIT);
    out.assert_code(0)
        .assert_stdout_has("pcie-hotplug: device 1 removed")
        .assert_stdout_has("pcie-hotplug: ok");
    for emu in [emu_a, emu_b] {
        let emu_out = emu.wait(Duration::from_secs(10));
        assert!(!emu_out.stderr.contains("panicked"), "{}", emu_out.stderr);
    }
}

/// A guest that never powers the slot off: DELETE answers 504 after the eject timeout,
/// the device stays attached (the same id is still taken) and the VM keeps running.
#[test]
fn a_guest_that_never_powers_the_slot_off_times_the_delete_out() {
    let socket = socket_path("keep");
    let emu = start_emu(&socket);
    let (mut vmm, api) = start_vm(
        "keep",
        2,
        "pcie-hotplug 1 keep",
        &[("GPUVM_HOTPLUG_EJECT_TIMEOUT_MS", "1500")],
    );
    hot_plug(&api, "gpu0", &socket);
    vmm.wait_for_stdout("pcie-hotplug: keeping the device", LIMIT);
    let started = Instant::now();
    let error = api_expect(&api, 504, "DELETE", "/gpus/gpu0", None);
    assert!(started.elapsed() >= Duration::from_millis(1400));
    assert!(error.contains("gpu0"), "{error}");
    let info = api_expect(&api, 200, "GET", "/", None);
    assert!(info.contains(r#""state":"Running""#), "{info}");
    assert!(info.contains(r#""state":"attached""#), "{info}");
    api_expect(
        &api,
        409,
        "PUT",
        "/gpus/gpu0",
        Some(&gpu_body("gpu0", &socket)),
    );
    ctl(&api, &["ctrl-alt-del"]).assert_code(0);
    let out = vmm.wait(LIMIT);
    assert_eq!(out.code(), Some(0), "{}", out.stderr);
    emu.wait(Duration::from_secs(10));
}

/// More root ports than gpuvm offers: refused before the VM starts, saying why.
#[test]
fn too_many_root_ports_are_refused() {
    let out = gpuvm_tests::run_gpuvm(&["run", "--pcie-root-ports", "9"], LIMIT);
    out.assert_clean_error("at most 8 root ports");
}

/// The root ports through gpuvm's API instead of `--pcie-root-ports`: PUT
/// /machine-config's `pcie_root_ports` (more than gpuvm offers is a 400 naming the limit),
/// shown by GET before and after start; the guest finds them and a GPU hot-plugged into
/// one passes its checks.
#[test]
fn root_ports_are_configured_through_the_api() {
    let api = socket_path("api-ports-api");
    let mut vmm = SpawnedProcess::gpuvm(&["run", "--api-sock", api.to_str().unwrap()]);
    wait_for_api_socket(&mut vmm, &api);
    let machine = |ports: u8| {
        serde_json::json!({"vcpu_count": 1, "mem_size_mib": 256, "pcie_root_ports": ports})
            .to_string()
    };
    let refused = api_expect(&api, 400, "PUT", "/machine-config", Some(&machine(9)));
    assert!(refused.contains("at most 8 root ports"), "{refused}");
    api_expect(&api, 204, "PUT", "/machine-config", Some(&machine(2)));
    let ports_shown = |api: &Path| {
        let body = api_expect(api, 200, "GET", "/machine-config", None);
        let config: serde_json::Value = serde_json::from_str(&body).unwrap();
        config["pcie_root_ports"].clone()
    };
    assert_eq!(ports_shown(&api), 2);
    api_boot(&api, "pcie-hotplug 1 keep");
    vmm.wait_for_stdout("pcie-hotplug: 2 hot-plug root port(s)", LIMIT);
    assert_eq!(ports_shown(&api), 2);
    let socket = socket_path("api-ports");
    let emu = start_emu(&socket);
    hot_plug(&api, "gpu0", &socket);
    vmm.wait_for_stdout("pcie-hotplug: keeping the device", LIMIT);
    assert!(
        vmm.stdout()
            .contains("passed the pci checks, BARs inside the port's windows"),
        "{}",
        vmm.stdout()
    );
    ctl(&api, &["ctrl-alt-del"]).assert_code(0);
    let out = vmm.wait(LIMIT);
    assert_eq!(out.code(), Some(0), "{}", out.stderr);
    emu.wait(Duration::from_secs(10));
}
