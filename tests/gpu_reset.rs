//! Reset hygiene for passthrough devices, end to end with the emulated GPU
//! (`gpuvm-emu-gpu`, vfio-user): a device is reset before it is attached and after it is
//! detached (hot-unplug, and the VM's end), the method is logged, and a device whose
//! reset fails (`--reset-fails`) or that does not come back from it
//! (`--dead-after-reset`: config space reads all ones) is refused with a clear error and
//! nothing attached, both at start and on hot-plug. Seccomp is on (the default).

use std::path::{Path, PathBuf};
use std::time::Duration;

use gpuvm_tests::{api_boot, api_expect, gpu_body, spawn_api_vmm, SpawnedProcess};

const LIMIT: Duration = Duration::from_secs(120);
/// What the vfio-user backend logs for each reset (the device is named before it).
const RESET_LINE: &str = "reset by VFIO_USER_DEVICE_RESET";

fn emu_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_gpuvm-emu-gpu"))
}

fn socket_path(name: &str) -> PathBuf {
    gpuvm_tests::socket_path("gpu-reset", name)
}

/// The emulated GPU on `socket`, logging at info (its "listening" lines count clients).
fn start_emu(socket: &Path, extra: &[&str]) -> SpawnedProcess {
    let mut args = vec!["--socket", socket.to_str().unwrap()];
    args.extend_from_slice(extra);
    let mut emu = SpawnedProcess::spawn_with_env(&emu_bin(), &args, &[("GPUVM_LOG", "info")]);
    wait_for_listeners(&mut emu, 1);
    emu
}

/// Until the emulator has started listening `count` times (one per client served).
fn wait_for_listeners(emu: &mut SpawnedProcess, count: usize) {
    emu.wait_until("the emulated GPU listening", LIMIT, |emu| {
        emu.stderr().matches("emu-gpu: listening on").count() >= count
    });
}

fn run_with(socket: &Path) -> gpuvm_tests::RunOutput {
    gpuvm_tests::run_gpuvm_with_env(
        &["run", "--vfio-user", socket.to_str().unwrap()],
        &[("GPUVM_LOG", "info")],
        LIMIT,
        None,
    )
}

/// The good device: reset before it is attached and again when the VM ends, each time
/// logged with the method.
#[test]
fn a_cold_plugged_device_is_reset_at_attach_and_at_the_vms_end() {
    let socket = socket_path("good");
    let emu = start_emu(&socket, &[]);
    let out = run_with(&socket);
    out.assert_code(0).assert_stdout_has("hello");
    let resets = out.stderr.matches(RESET_LINE).count();
    assert!(
        resets >= 2,
        "reset at attach and at the end ({resets} logged):\n{}",
        out.stderr
    );
    let emu_out = emu.wait(Duration::from_secs(10));
    assert_eq!(emu_out.code(), Some(0), "{}", emu_out.stderr);
}

/// A reset the device refuses: the VM does not start, the error names the device and
/// the method, and the device is left unattached (its server sees the client go).
#[test]
fn a_device_whose_reset_fails_is_refused_at_start() {
    let socket = socket_path("fails");
    let mut emu = start_emu(&socket, &["--reset-fails"]);
    let out = run_with(&socket);
    out.assert_clean_error("reset by VFIO_USER_DEVICE_RESET failed")
        .assert_clean_error(socket.to_str().unwrap())
        .assert_clean_error("not attached");
    assert_eq!(out.code(), Some(125), "{}", out.stderr);
    assert!(!out.stdout.contains("hello"), "the guest never ran");
    emu.wait_for_stderr("refusing the reset", LIMIT);
    let emu_out = emu.wait(Duration::from_secs(10));
    assert_eq!(emu_out.code(), Some(0), "{}", emu_out.stderr);
}

/// A device that reads all ones after its reset: refused the same way.
#[test]
fn a_device_that_does_not_come_back_from_reset_is_refused_at_start() {
    let socket = socket_path("dead");
    let emu = start_emu(&socket, &["--dead-after-reset"]);
    let out = run_with(&socket);
    out.assert_clean_error("did not come back after reset by VFIO_USER_DEVICE_RESET")
        .assert_clean_error("0xffffffff")
        .assert_clean_error(socket.to_str().unwrap());
    assert_eq!(out.code(), Some(125), "{}", out.stderr);
    assert!(!out.stdout.contains("hello"), "the guest never ran");
    let emu_out = emu.wait(Duration::from_secs(10));
    assert_eq!(emu_out.code(), Some(0), "{}", emu_out.stderr);
}

/// A running VM with the API on its socket, the guest waiting for hot-plugged devices.
fn start_vm(name: &str, workload: &str) -> (SpawnedProcess, PathBuf) {
    let api = socket_path(&format!("{name}-api"));
    let mut vmm = spawn_api_vmm(&api, None, &[("GPUVM_LOG", "info")]);
    api_boot(&api, workload);
    vmm.wait_for_stdout("hotplug: waiting for", LIMIT);
    (vmm, api)
}

/// Whether GET / lists a hot-plugged device `id`.
fn listed(api: &Path, id: &str) -> bool {
    let info: serde_json::Value =
        serde_json::from_str(&api_expect(api, 200, "GET", "/", None)).expect("JSON");
    info["hot_plugged_gpus"]
        .as_array()
        .is_some_and(|gpus| gpus.iter().any(|gpu| gpu["id"] == id))
}

/// Hot-plug of a device whose reset fails, then of one that stays dead: each PUT answers
/// an error that names the cause, nothing is listed, the guest never sees a device, and
/// the VM runs on.
#[test]
fn a_hot_plug_of_a_device_that_fails_its_reset_answers_an_error_and_attaches_nothing() {
    let (vmm, api) = start_vm("hot-refused", "pci-hotplug 1");
    for (name, flag, needle) in [
        (
            "hot-fails",
            "--reset-fails",
            "reset by VFIO_USER_DEVICE_RESET failed",
        ),
        (
            "hot-dead",
            "--dead-after-reset",
            "did not come back after reset by VFIO_USER_DEVICE_RESET",
        ),
    ] {
        let socket = socket_path(name);
        let emu = start_emu(&socket, &[flag]);
        let answer = api_expect(
            &api,
            400,
            "PUT",
            "/gpus/gpu0",
            Some(&gpu_body("gpu0", &socket)),
        );
        assert!(
            answer.contains(needle) && answer.contains("not attached"),
            "{answer}"
        );
        assert!(!listed(&api, "gpu0"), "nothing attached after {flag}");
        let emu_out = emu.wait(Duration::from_secs(10));
        assert_eq!(emu_out.code(), Some(0), "{}", emu_out.stderr);
    }
    let info = api_expect(&api, 200, "GET", "/", None);
    assert!(info.contains(r#""state":"Running""#), "{info}");
    api_expect(
        &api,
        204,
        "PUT",
        "/actions",
        Some(r#"{"action_type":"SendCtrlAltDel"}"#),
    );
    let out = vmm.wait(LIMIT);
    assert!(
        !out.stdout.contains("hotplug: device 1 arrived"),
        "the guest saw no device:\n{}",
        out.stdout
    );
}

/// The same device plugged, unplugged and plugged again, three times (Cloud
/// Hypervisor #7328's case): every attach works, and each attach and each detach
/// resets it.
#[test]
fn the_same_device_is_hot_plugged_and_unplugged_again_and_again() {
    const ROUNDS: usize = 3;
    let socket = socket_path("again");
    let mut emu = start_emu(&socket, &["--clients", &ROUNDS.to_string()]);
    let (mut vmm, api) = start_vm("again", &format!("pci-hotplug {ROUNDS}"));
    for round in 1..=ROUNDS {
        // The emulator serves one client after another: wait until it listens again.
        wait_for_listeners(&mut emu, round);
        let body = api_expect(
            &api,
            200,
            "PUT",
            "/gpus/gpu0",
            Some(&gpu_body("gpu0", &socket)),
        );
        assert!(body.contains("gpu0"), "{body}");
        vmm.wait_for_stdout(&format!("hotplug: device {round} at"), LIMIT);
        api_expect(&api, 204, "DELETE", "/gpus/gpu0", None);
        vmm.wait_for_stdout(&format!("hotplug: device {round} ejected"), LIMIT);
    }
    let out = vmm.wait(LIMIT);
    out.assert_code(0).assert_stdout_has("hotplug: ok");
    let resets = out.stderr.matches(RESET_LINE).count();
    assert!(
        resets >= 2 * ROUNDS,
        "a reset at each attach and each detach ({resets} logged):\n{}",
        out.stderr
    );
    let emu_out = emu.wait(Duration::from_secs(10));
    assert_eq!(emu_out.code(), Some(0), "{}", emu_out.stderr);
}
