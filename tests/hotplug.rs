//! GPU hot-plug and hot-unplug end to end: PUT /gpus/{id} and DELETE /gpus/{id} on a
//! running VM, through gpuvm's ACPI PCI hot-plug controller, with the emulated GPU
//! (`gpuvm-emu-gpu`, vfio-user) and the test guest's `pci-hotplug` workload, which polls
//! the controller's registers as the DSDT's AML would, runs the `pci` checks on each new
//! device (DMA into guest RAM included) and ejects it when asked.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpuvm_tests::{api_expect, api_start_instance, wait_for_api_socket, SpawnedProcess};

const LIMIT: Duration = Duration::from_secs(120);

fn emu_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_gpuvm-emu-gpu"))
}

fn socket_path(name: &str) -> PathBuf {
    gpuvm_tests::socket_path("hotplug", name)
}

fn start_emu(socket: &Path) -> SpawnedProcess {
    gpuvm_tests::start_emu_gpu(&emu_bin(), socket, &[])
}

/// A running VM with the API on `api` and `workload` as its command line.
fn start_vm(name: &str, workload: &str, env: &[(&str, &str)]) -> (SpawnedProcess, PathBuf) {
    let api = socket_path(&format!("{name}-api"));
    let mut vmm =
        SpawnedProcess::gpuvm_with_env(&["run", "--api-sock", api.to_str().unwrap()], env);
    wait_for_api_socket(&mut vmm, &api);
    let boot = serde_json::json!({ "boot_args": workload }).to_string();
    api_expect(&api, 204, "PUT", "/boot-source", Some(&boot));
    api_start_instance(&api);
    vmm.wait_for_stdout("hotplug: waiting for", LIMIT);
    (vmm, api)
}

fn gpu_body(id: &str, socket: &Path) -> String {
    serde_json::json!({ "gpu_id": id, "vfio_user_socket": socket }).to_string()
}

/// PUT /gpus/{id} on the running VM; checks the answer and returns the guest BDF.
fn hot_plug(api: &Path, id: &str, socket: &Path) -> String {
    let body = api_expect(
        api,
        200,
        "PUT",
        &format!("/gpus/{id}"),
        Some(&gpu_body(id, socket)),
    );
    let answer: serde_json::Value = serde_json::from_str(&body).expect("JSON answer");
    assert_eq!(answer["id"], id, "{body}");
    let bdf = answer["bdf"].as_str().expect("bdf").to_string();
    assert!(
        bdf.len() == 12 && bdf.starts_with("0000:00:") && bdf.ends_with(".0"),
        "bdf {bdf:?} is 0000:00:XX.0"
    );
    bdf
}

fn ctl(api: &Path, args: &[&str]) -> gpuvm_tests::RunOutput {
    let mut all = vec!["ctl", "--api-sock", api.to_str().unwrap()];
    all.extend_from_slice(args);
    gpuvm_tests::run_gpuvm(&all, LIMIT)
}

/// Two devices, one after the other, into one running VM: each is hot-plugged at a
/// 0000:00:XX.0 address, passes the guest's `pci` checks (MSI-X and the DMA data), is
/// ejected by the guest on DELETE, and the VM ends cleanly. Around them: bad requests
/// that must leave the VM alone.
#[test]
fn two_gpus_hot_plugged_and_unplugged_in_turn() {
    let first = socket_path("first");
    let emu_a = start_emu(&first);
    let (mut vmm, api) = start_vm("turns", "pci-hotplug 2", &[]);

    // Bad requests before any device: unknown id, a socket nobody serves.
    let missing = api_expect(&api, 404, "DELETE", "/gpus/nothing", None);
    assert!(missing.contains("nothing"), "{missing}");
    let absent = socket_path("absent");
    let refused = api_expect(
        &api,
        400,
        "PUT",
        "/gpus/ghost",
        Some(&gpu_body("ghost", &absent)),
    );
    assert!(refused.contains("cannot hot-plug ghost"), "{refused}");

    let started = Instant::now();
    let bdf = hot_plug(&api, "gpu0", &first);
    let answered = started.elapsed();
    vmm.wait_for_stdout("hotplug: device 1 at", LIMIT);
    let out = vmm.stdout();
    assert!(
        out.contains(&format!("hotplug: device 1 arrived at {}", &bdf[5..])),
        "{out}"
    );
    assert!(out.contains("pci: msi-x interrupt received"), "{out}");
    assert!(out.contains("pci: dma verified 65536 bytes"), "{out}");
    eprintln!(
        "PUT /gpus answered in {answered:?}, first DMA verified after {:?}",
        started.elapsed()
    );

    // The same id again, while attached: 409. A snapshot: refused as before.
    let twice = api_expect(
        &api,
        409,
        "PUT",
        "/gpus/gpu0",
        Some(&gpu_body("gpu0", &first)),
    );
    assert!(twice.contains("already attached"), "{twice}");
    let snapshot = std::env::temp_dir().join(format!("gpuvm-hotplug-snap-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&snapshot);
    ctl(
        &api,
        &["snapshot-create", "--dir", snapshot.to_str().unwrap()],
    )
    .assert_clean_error("cannot snapshot a VM with passthrough devices");
    assert!(!snapshot.exists());

    // DELETE through the CLI client: answered once the guest ejected it.
    ctl(&api, &["remove-gpu", "--id", "gpu0"]).assert_code(0);
    // The guest prints after its eject write, which is what completed the DELETE: the
    // line may come a moment after the answer.
    vmm.wait_for_stdout("hotplug: device 1 ejected", LIMIT);
    // The device was reset and its connection closed: the server ends.
    let emu_out = emu_a.wait(Duration::from_secs(10));
    assert_eq!(emu_out.code(), Some(0), "{}", emu_out.stderr);
    api_expect(&api, 404, "DELETE", "/gpus/gpu0", None);

    // A second device (a new server) takes the freed place.
    let second = socket_path("second");
    let emu_b = start_emu(&second);
    let again = hot_plug(&api, "gpu0", &second);
    assert_eq!(again, bdf, "the freed slot is reused");
    vmm.wait_for_stdout("hotplug: device 2 at", LIMIT);
    api_expect(&api, 204, "DELETE", "/gpus/gpu0", None);
    let out = vmm.wait(LIMIT);
    out.assert_code(0)
        .assert_stdout_has("hotplug: device 2 ejected")
        .assert_stdout_has("hotplug: ok");
    emu_b.wait(Duration::from_secs(10));
}

/// A guest that never ejects: DELETE answers 504 after the eject timeout with a message
/// that says so, the device stays attached and the VM keeps running.
#[test]
fn a_guest_that_never_ejects_times_the_delete_out() {
    let socket = socket_path("keep");
    let emu = start_emu(&socket);
    let (mut vmm, api) = start_vm(
        "keep",
        "pci-hotplug 1 keep",
        &[("GPUVM_HOTPLUG_EJECT_TIMEOUT_MS", "1500")],
    );
    hot_plug(&api, "gpu0", &socket);
    vmm.wait_for_stdout("hotplug: keeping the device", LIMIT);
    let started = Instant::now();
    let error = api_expect(&api, 504, "DELETE", "/gpus/gpu0", None);
    assert!(started.elapsed() >= Duration::from_millis(1400));
    assert!(error.contains("did not eject gpu0"), "{error}");
    assert!(error.contains("stays attached"), "{error}");
    let info = api_expect(&api, 200, "GET", "/", None);
    assert!(info.contains(r#""state":"Running""#), "{info}");
    // Still attached: the same id is taken.
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
