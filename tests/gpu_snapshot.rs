//! Snapshots of a VM with a GPU through the guest (the path NVIDIA GPUs need): PUT
//! /snapshot/create with `passthrough: guest_release` asks the test guest's `gpu-agent`
//! (vsock port 1027) to release the hot-plugged emulated GPU, ejects it, snapshots, and
//! gives it back; a VM restored from that snapshot resumes on ANOTHER emulated GPU given
//! with PUT /gpus, and the state the guest kept in the first device's memory is in the
//! second one's. Bad input: no vsock, no agent in the guest, cold-plugged devices, a
//! plain snapshot of a VM with a GPU that cannot migrate.
//!
//! And through VFIO migration (the emulated GPU's migration region): a plain snapshot
//! saves the device's own state (registers, device memory, a DMA job it holds) beside
//! RAM; a restore onto a fresh device process brings all of it back, and the held job
//! runs there. Bad input: a missing device, another model, a damaged device file, a
//! snapshot while the device is being unplugged. The PCI root's slot and BAR allocations
//! (holes left by unplugged devices included) come back exactly as saved.

use std::path::{Path, PathBuf};
use std::time::Duration;

use gpuvm_tests::{
    api_boot_source, api_expect, api_load_lazy, api_snapshot_create, api_start_instance, gpu_body,
    spawn_api_vmm, wait_for_api_socket, Scratch, SpawnedProcess,
};
use serde_json::json;

const LIMIT: Duration = Duration::from_secs(120);

fn emu_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_gpuvm-emu-gpu"))
}

fn socket_path(name: &str) -> PathBuf {
    gpuvm_tests::socket_path("gpusnap", name)
}

/// A running VM with `workload`, and a vsock device on `vsock` when given.
fn start_vm(api: &Path, workload: &str, vsock: Option<&Path>) -> SpawnedProcess {
    start_vm_with_env(api, workload, vsock, &[])
}

/// As [`start_vm`], with extra environment variables for gpuvm.
fn start_vm_with_env(
    api: &Path,
    workload: &str,
    vsock: Option<&Path>,
    env: &[(&str, &str)],
) -> SpawnedProcess {
    let vmm = spawn_api_vmm(api, None, env);
    api_boot_source(api, workload);
    if let Some(vsock) = vsock {
        let body = serde_json::json!({ "guest_cid": 3, "uds_path": vsock }).to_string();
        api_expect(api, 204, "PUT", "/vsock", Some(&body));
    }
    api_start_instance(api);
    vmm
}

/// The complete lines of `stdout` (the last one may still be arriving).
fn complete_lines(stdout: &str) -> impl DoubleEndedIterator<Item = &str> {
    stdout
        .split_inclusive('\n')
        .filter_map(|line| line.strip_suffix('\n'))
}

/// Waits until a complete stdout line contains `marker`.
fn wait_for_line(vmm: &mut SpawnedProcess, marker: &str) {
    vmm.wait_until(marker, LIMIT, |p| {
        complete_lines(&p.stdout()).any(|line| line.contains(marker))
    });
}

/// The value after `key=` in the last complete stdout line that contains `marker`.
fn field_after(stdout: &str, marker: &str, key: &str) -> String {
    let line = complete_lines(stdout)
        .rfind(|line| line.contains(marker))
        .unwrap_or_else(|| panic!("no line with {marker:?}:\n{stdout}"));
    line.split(key)
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no {key} in {line:?}"))
        .to_string()
}

/// PUT /gpus/gpu0 with the device on `socket`, then waits until the guest's
/// `pci-hotplug` workload has run its pci checks on it.
fn plug_checked(vmm: &mut SpawnedProcess, api: &Path, socket: &Path) {
    api_expect(
        api,
        200,
        "PUT",
        "/gpus/gpu0",
        Some(&gpu_body("gpu0", socket)),
    );
    vmm.wait_for_stdout("passed the pci checks", LIMIT);
}

fn json(body: &str) -> serde_json::Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))
}

#[test]
fn a_gpu_vm_snapshots_through_the_guest_and_resumes_on_another_gpu() {
    let scratch = Scratch::new("gpusnap", "roundtrip");
    let (first, second) = (socket_path("first"), socket_path("second"));
    // Two clients: the VM that is snapshotted gets the device back after the release.
    // Without migration: the guest release is then the only way to snapshot it.
    let _emu_a =
        gpuvm_tests::start_emu_gpu(&emu_bin(), &first, &["--clients", "2", "--no-migration"]);
    let api = socket_path("api");
    let vsock = scratch.path("vsock.sock");
    let mut vmm = start_vm(&api, "gpu-agent", Some(&vsock));
    vmm.wait_for_stdout("gpu-agent: listening", LIMIT);

    let plugged = json(&api_expect(
        &api,
        200,
        "PUT",
        "/gpus/gpu0",
        Some(&gpu_body("gpu0", &first)),
    ));
    let bdf = plugged["bdf"].as_str().expect("bdf").to_string();
    wait_for_line(&mut vmm, "gpu-agent: holding");
    let held = field_after(&vmm.stdout(), "gpu-agent: holding", "checksum=");

    // Snapshot through the guest: released, ejected, snapshotted, given back, resumed.
    let dir = scratch.path("snap");
    let body = serde_json::json!({
        "snapshot_path": dir,
        "passthrough": "guest_release",
    })
    .to_string();
    let answer = json(&api_expect(
        &api,
        200,
        "PUT",
        "/snapshot/create",
        Some(&body),
    ));
    assert_eq!(
        answer["released_gpus"],
        serde_json::json!(["gpu0"]),
        "{answer}"
    );
    assert_eq!(answer["reattached_gpus"][0]["id"], "gpu0", "{answer}");
    wait_for_line(&mut vmm, "gpu-agent: resumed gpu0");
    let stdout = vmm.stdout();
    for line in [
        format!("gpu-agent: RELEASE gpu0 {bdf}"),
        "gpu-agent: released gpu0".to_string(),
        "gpu-agent: ejected".to_string(),
        "gpu-agent: resumed gpu0".to_string(),
    ] {
        assert!(stdout.contains(&line), "no {line:?}:\n{stdout}");
    }
    assert_eq!(
        field_after(&stdout, "gpu-agent: resumed gpu0", "checksum="),
        held,
        "the state in device memory after the release and give-back"
    );
    // The VM runs on with its GPU: a plain snapshot now is refused and says what to use.
    let plain = serde_json::json!({ "snapshot_path": scratch.path("plain") }).to_string();
    let refused = api_expect(&api, 400, "PUT", "/snapshot/create", Some(&plain));
    assert!(
        refused.contains("guest_release") && refused.contains("offers no VFIO migration"),
        "{refused}"
    );
    let state = std::fs::read(dir.join("state")).expect("state file");
    let state = String::from_utf8_lossy(&state);
    assert!(
        state.contains("\"released_gpus\"") && state.contains("\"gpu0\""),
        "the snapshot records the released GPU"
    );
    vmm.signal(libc::SIGKILL);
    let _ = vmm.wait(Duration::from_secs(10));
    let _ = std::fs::remove_file(&vsock);

    // Restore into a new VMM; the guest waits for its GPU; another device is given.
    let _emu_b = gpuvm_tests::start_emu_gpu(&emu_bin(), &second, &[]);
    let api2 = socket_path("api2");
    let mut restored = spawn_api_vmm(&api2, None, &[]);
    api_load_lazy(&api2, &dir);
    restored.wait_for_stdout("gpu-agent: transport reset", LIMIT);
    // Another model is refused before the guest hears of it; the id stays waiting.
    let other = socket_path("other-model");
    let _emu_other = gpuvm_tests::start_emu_gpu(&emu_bin(), &other, &["--device-id", "2331"]);
    let refused = api_expect(
        &api2,
        409,
        "PUT",
        "/gpus/gpu0",
        Some(&gpu_body("gpu0", &other)),
    );
    assert!(
        refused.contains("10de:2331") && refused.contains("10de:2330"),
        "{refused}"
    );
    // The released id: plugged, then the agent is told where its GPU is.
    let answer = json(&api_expect(
        &api2,
        200,
        "PUT",
        "/gpus/gpu0",
        Some(&gpu_body("gpu0", &second)),
    ));
    assert_eq!(answer["resumed"], true, "{answer}");
    let new_bdf = answer["bdf"].as_str().expect("bdf").to_string();
    wait_for_line(&mut restored, &format!("gpu-agent: ATTACH gpu0 {new_bdf}"));
    wait_for_line(&mut restored, "gpu-agent: resumed gpu0");
    let stdout = restored.stdout();
    assert_eq!(
        field_after(&stdout, "gpu-agent: resumed gpu0", "checksum="),
        held,
        "the state kept across the snapshot, in the new device's memory:\n{stdout}"
    );
    assert!(!stdout.contains("FAIL"), "{stdout}");
    // Given back once: the id is an ordinary hot-plugged device now.
    let again = api_expect(
        &api2,
        409,
        "PUT",
        "/gpus/gpu0",
        Some(&gpu_body("gpu0", &second)),
    );
    assert!(again.contains("already attached"), "{again}");
    restored.signal(libc::SIGKILL);
    let _ = restored.wait(Duration::from_secs(10));
}

#[test]
fn a_release_that_cannot_happen_leaves_the_vm_and_its_gpu_alone() {
    let scratch = Scratch::new("gpusnap", "refusals");
    let socket = socket_path("refusals-emu");
    let _emu = gpuvm_tests::start_emu_gpu(&emu_bin(), &socket, &[]);
    let release = |dir: &str| {
        serde_json::json!({
            "snapshot_path": scratch.path(dir),
            "passthrough": "guest_release",
        })
        .to_string()
    };

    // A guest without the agent (it holds the device, nothing listens on port 1027).
    let api = socket_path("noagent-api");
    let vsock = scratch.path("noagent.sock");
    let mut vmm = start_vm(&api, "pci-hotplug 1 keep", Some(&vsock));
    vmm.wait_for_stdout("hotplug: waiting for", LIMIT);
    plug_checked(&mut vmm, &api, &socket);
    let refused = api_expect(&api, 409, "PUT", "/snapshot/create", Some(&release("a")));
    assert!(refused.contains("not listening"), "{refused}");
    assert!(
        !scratch.path("a").join("state").exists(),
        "no snapshot written"
    );
    // Still attached: a plain DELETE is still the only way out (the guest keeps it).
    let busy = api_expect(
        &api,
        409,
        "PUT",
        "/gpus/gpu0",
        Some(&gpu_body("gpu0", &socket)),
    );
    assert!(busy.contains("already attached"), "{busy}");
    // Bad field values are refused by the body's schema.
    let bad = serde_json::json!({
        "snapshot_path": scratch.path("b"),
        "passthrough": "teleport",
    })
    .to_string();
    api_expect(&api, 400, "PUT", "/snapshot/create", Some(&bad));
    vmm.signal(libc::SIGKILL);
    let _ = vmm.wait(Duration::from_secs(10));

    // No vsock device: nothing to speak to the guest through.
    let api = socket_path("novsock-api");
    let mut vmm = start_vm(&api, "pci-hotplug 1 keep", None);
    vmm.wait_for_stdout("hotplug: waiting for", LIMIT);
    let socket2 = socket_path("novsock-emu");
    let _emu2 = gpuvm_tests::start_emu_gpu(&emu_bin(), &socket2, &[]);
    plug_checked(&mut vmm, &api, &socket2);
    let refused = api_expect(&api, 409, "PUT", "/snapshot/create", Some(&release("c")));
    assert!(refused.contains("no vsock device"), "{refused}");
    vmm.signal(libc::SIGKILL);
    let out = vmm.wait(Duration::from_secs(10));
    assert!(!out.stderr.contains("panicked"), "{}", out.stderr);
}

/// A VMM restoring `dir` (lazily) with its stdin piped to the guest's serial port, or
/// the load's error body when `expect` is not 204; `gpus`: the load's `gpus` (where the
/// saved devices are now).
fn load_into_new_vmm(
    dir: &Path,
    name: &str,
    expect: u16,
    gpus: serde_json::Value,
) -> (SpawnedProcess, PathBuf, String) {
    let api = socket_path(name);
    let mut vmm = SpawnedProcess::gpuvm_with_input(&["run", "--api-sock", api.to_str().unwrap()]);
    wait_for_api_socket(&mut vmm, &api);
    let load = serde_json::json!({
        "snapshot_path": dir,
        "restore_mode": "Lazy",
        "resume_vm": true,
        "gpus": gpus,
    })
    .to_string();
    let answer = api_expect(&api, expect, "PUT", "/snapshot/load", Some(&load));
    (vmm, api, answer)
}

/// The numbers N of the complete `gpu-migrate: iter N ok` lines.
fn iterations(stdout: &str) -> Vec<u64> {
    complete_lines(stdout)
        .filter_map(|line| line.strip_prefix("gpu-migrate: iter "))
        .filter_map(|rest| rest.strip_suffix(" ok")?.parse().ok())
        .collect()
}

fn device_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("snapshot dir")
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| {
            path.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("device-"))
        })
        .collect();
    files.sort();
    files
}

#[test]
fn a_gpu_vm_snapshots_with_the_device_state_and_restores_onto_a_fresh_device() {
    let scratch = Scratch::new("gpusnap", "migrate");
    let socket = socket_path("migrate-emu");
    let emu_a = gpuvm_tests::start_emu_gpu(&emu_bin(), &socket, &[]);
    let api = socket_path("migrate-api");
    let mut vmm = start_vm(&api, "gpu-migrate", None);
    vmm.wait_for_stdout("gpu-migrate: waiting for a device", LIMIT);
    api_expect(
        &api,
        200,
        "PUT",
        "/gpus/gpu0",
        Some(&gpu_body("gpu0", &socket)),
    );
    wait_for_line(&mut vmm, "gpu-migrate: iter 1 ok");

    // A plain snapshot: the device saves its own state beside RAM.
    let dir = scratch.path("snap");
    api_snapshot_create(&api, &dir);
    let state = std::fs::read(dir.join("state")).expect("state file");
    let state = String::from_utf8_lossy(&state);
    assert!(
        state.contains("\"migrated_gpus\"") && state.contains("\"gpu0\""),
        "the state records the device"
    );
    let files = device_files(&dir);
    assert_eq!(files.len(), 1, "one device state file: {files:?}");
    let size = std::fs::metadata(&files[0]).expect("device file").len();
    // 8 pages of device memory, the registers, configuration space, the held job.
    assert!(size > 8 * 4096, "device state of {size} bytes");
    // The source VM runs on with its device, state intact.
    let seen = *iterations(&vmm.stdout()).last().expect("an iteration");
    vmm.wait_until("an iteration after the snapshot", LIMIT, |p| {
        iterations(&p.stdout())
            .last()
            .is_some_and(|&n| n > seen + 1)
    });
    assert!(!vmm.stdout().contains("FAIL"), "{}", vmm.stdout());
    // A second snapshot into the same directory replaces the device file.
    api_snapshot_create(&api, &dir);
    let replaced = device_files(&dir);
    assert_eq!(replaced.len(), 1, "{replaced:?}");
    assert_ne!(replaced, files, "a new device file");
    vmm.signal(libc::SIGKILL);
    let _ = vmm.wait(Duration::from_secs(10));
    let emu_out = emu_a.wait(Duration::from_secs(10));
    assert!(!emu_out.stderr.contains("panicked"), "{}", emu_out.stderr);

    // No device behind the socket: the restore fails, naming the device.
    let (vmm, _, refused) = load_into_new_vmm(&dir, "migrate-api-missing", 400, json!([]));
    assert!(
        refused.contains("gpu0") && refused.contains("cannot open its device again"),
        "{refused}"
    );
    drop(vmm);

    // Another model behind the socket: refused, naming both.
    let emu_other = gpuvm_tests::start_emu_gpu(&emu_bin(), &socket, &["--device-id", "2331"]);
    let (vmm, _, refused) = load_into_new_vmm(&dir, "migrate-api-model", 400, json!([]));
    assert!(
        refused.contains("10de:2331") && refused.contains("10de:2330"),
        "{refused}"
    );
    drop(vmm);
    drop(emu_other);

    // A damaged device file: refused before the device sees it.
    let device_file = device_files(&dir).remove(0);
    let original = std::fs::read(&device_file).expect("device file");
    let mut damaged = original.clone();
    let middle = damaged.len() / 2;
    damaged[middle] ^= 0x40;
    std::fs::write(&device_file, &damaged).expect("damage");
    // The device is elsewhere now: the load says where (`gpus`).
    let moved = socket_path("migrate-emu-moved");
    let emu_b = gpuvm_tests::start_emu_gpu(&emu_bin(), &moved, &["--clients", "2"]);
    let there = json!([{ "gpu_id": "gpu0", "vfio_user_socket": moved }]);
    let (vmm, _, refused) = load_into_new_vmm(&dir, "migrate-api-damaged", 400, there.clone());
    assert!(refused.contains("damaged"), "{refused}");
    drop(vmm);
    std::fs::write(&device_file, &original).expect("repair");
    // A `gpus` entry for a GPU the snapshot does not hold.
    let stranger = json!([{ "gpu_id": "gpu9", "vfio_user_socket": moved }]);
    let (vmm, _, refused) = load_into_new_vmm(&dir, "migrate-api-stranger", 400, stranger);
    assert!(refused.contains("gpu9"), "{refused}");
    drop(vmm);

    // A fresh device process: the guest goes on with its state, and the held job runs.
    let (mut restored, api2, _) = load_into_new_vmm(&dir, "migrate-api-restored", 204, there);
    wait_for_line(&mut restored, "gpu-migrate: iter");
    let info = api_expect(&api2, 200, "GET", "/", None);
    assert!(info.contains("gpu0"), "{info}");
    restored.write_stdin(b"g");
    let out = restored.wait(LIMIT);
    out.assert_code(0)
        .assert_stdout_has("gpu-migrate: device state intact, releasing the queued job")
        .assert_stdout_has("gpu-migrate: queued job ran, msi-x received, dma verified")
        .assert_stdout_has("gpu-migrate: ok");
    let emu_out = emu_b.wait(Duration::from_secs(10));
    assert!(!emu_out.stderr.contains("panicked"), "{}", emu_out.stderr);
}

#[test]
fn a_device_being_unplugged_is_not_snapshotted() {
    let scratch = Scratch::new("gpusnap", "unplugging");
    let socket = socket_path("unplugging-emu");
    let _emu = gpuvm_tests::start_emu_gpu(&emu_bin(), &socket, &[]);
    let api = socket_path("unplugging-api");
    // The guest keeps the device: the eject stays in flight until the timeout.
    let mut vmm = start_vm_with_env(
        &api,
        "pci-hotplug 1 keep",
        None,
        &[("GPUVM_HOTPLUG_EJECT_TIMEOUT_MS", "4000")],
    );
    vmm.wait_for_stdout("hotplug: waiting for", LIMIT);
    plug_checked(&mut vmm, &api, &socket);
    let api_for_delete = api.clone();
    let delete = std::thread::spawn(move || {
        gpuvm_tests::api_expect(&api_for_delete, 504, "DELETE", "/gpus/gpu0", None)
    });
    std::thread::sleep(Duration::from_millis(500));
    let dir = scratch.path("snap");
    let body = serde_json::json!({ "snapshot_path": dir }).to_string();
    let refused = api_expect(&api, 400, "PUT", "/snapshot/create", Some(&body));
    assert!(refused.contains("being hot-unplugged"), "{refused}");
    assert!(!dir.join("state").exists(), "nothing written");
    let timed_out = delete.join().expect("DELETE thread");
    assert!(timed_out.contains("did not eject"), "{timed_out}");
    // The eject was withdrawn: the device is saved now.
    api_snapshot_create(&api, &dir);
    assert_eq!(device_files(&dir).len(), 1);
    vmm.signal(libc::SIGKILL);
    let out = vmm.wait(Duration::from_secs(10));
    assert!(!out.stderr.contains("panicked"), "{}", out.stderr);
}

/// The `pci: BARn ADDR size=...` lines of the `pci` checks in `stdout`, in order, each as
/// (BAR name, address).
fn bar_lines(stdout: &str) -> Vec<(String, String)> {
    complete_lines(stdout)
        .filter_map(|line| line.strip_prefix("pci: BAR"))
        .filter_map(|rest| {
            let mut words = rest.split_whitespace();
            let (bar, address) = (words.next()?, words.next()?);
            words
                .next()?
                .starts_with("size=")
                .then(|| (format!("BAR{bar}"), address.to_string()))
        })
        .collect()
}

/// The slot of the `hotplug: device N arrived at 00:SS.0` line for `round`.
fn arrival_slot(stdout: &str, round: u32) -> String {
    field_after(
        stdout,
        &format!("hotplug: device {round} arrived at"),
        "arrived at ",
    )
}

/// The PCI root's allocations are saved with the snapshot and restored exactly: gpu0 and
/// gpu1 are hot-plugged, gpu0 unplugged (a slot and BAR ranges free below gpu1's, which a
/// fresh build would not leave), the VM snapshotted with gpu1 (VFIO migration) and
/// restored: gpu1 is back in its slot with every BAR where the guest had it (the guest
/// releases and ejects it through that slot), and gpu2, hot-plugged into the restored VM,
/// lands in gpu0's old slot at gpu0's old BAR addresses, as in the saved VM.
#[test]
fn a_restored_vm_keeps_its_pci_slots_bars_and_holes() {
    let scratch = Scratch::new("gpusnap", "allocations");
    let sockets = ["alloc-emu0", "alloc-emu1", "alloc-emu2"].map(socket_path);
    let _emu0 = gpuvm_tests::start_emu_gpu(&emu_bin(), &sockets[0], &[]);
    // gpu1 serves the snapshotted VM and then the restored one.
    let _emu1 = gpuvm_tests::start_emu_gpu(&emu_bin(), &sockets[1], &["--clients", "2"]);
    let api = socket_path("alloc-api");
    let mut vmm = start_vm(&api, "pci-hotplug 3", None);
    vmm.wait_for_stdout("hotplug: waiting for", LIMIT);
    plug_checked(&mut vmm, &api, &sockets[0]);
    // gpu1 arrives while the guest still holds gpu0; it sees gpu1 once gpu0 is ejected.
    let body = gpu_body("gpu1", &sockets[1]);
    api_expect(&api, 200, "PUT", "/gpus/gpu1", Some(&body));
    api_expect(&api, 204, "DELETE", "/gpus/gpu0", None);
    wait_for_line(&mut vmm, "hotplug: device 2 at");
    let stdout = vmm.stdout();
    let bars = bar_lines(&stdout);
    assert_eq!(
        bars.len(),
        6,
        "BAR0, BAR1, BAR3 of gpu0 then gpu1:\n{stdout}"
    );
    let (gpu0_bars, gpu1_bars) = bars.split_at(3);
    let (gpu0_slot, gpu1_slot) = (arrival_slot(&stdout, 1), arrival_slot(&stdout, 2));
    assert_ne!(gpu0_slot, gpu1_slot);

    let dir = scratch.path("snap");
    api_snapshot_create(&api, &dir);
    let state = std::fs::read(dir.join("state")).expect("state file");
    assert!(
        String::from_utf8_lossy(&state).contains("\"pci_root\""),
        "the state holds the PCI root's allocations"
    );
    vmm.signal(libc::SIGKILL);
    let _ = vmm.wait(Duration::from_secs(10));

    let api2 = socket_path("alloc-api2");
    let mut restored = spawn_api_vmm(&api2, Some("info"), &[]);
    api_load_lazy(&api2, &dir);
    // gpu1 is back in its slot, each BAR where the guest had it.
    for (bar, address) in gpu1_bars {
        let placed = format!("PCI 0000:{gpu1_slot}: {bar} ");
        let at = format!("back at {address} ");
        restored.wait_until(&format!("{placed}... {at}on stderr"), LIMIT, |p| {
            p.stderr()
                .lines()
                .any(|l| l.contains(&placed) && l.contains(&at))
        });
    }
    // The guest releases and ejects gpu1 through its slot, then takes gpu2.
    api_expect(&api2, 204, "DELETE", "/gpus/gpu1", None);
    wait_for_line(&mut restored, "hotplug: device 2 ejected");
    let _emu2 = gpuvm_tests::start_emu_gpu(&emu_bin(), &sockets[2], &[]);
    let body = gpu_body("gpu2", &sockets[2]);
    api_expect(&api2, 200, "PUT", "/gpus/gpu2", Some(&body));
    wait_for_line(&mut restored, "hotplug: device 3 at");
    let stdout = restored.stdout();
    assert_eq!(
        arrival_slot(&stdout, 3),
        gpu0_slot,
        "gpu2 in the slot gpu0 left:\n{stdout}"
    );
    assert_eq!(
        bar_lines(&stdout),
        gpu0_bars,
        "gpu2's BARs in the ranges gpu0 left:\n{stdout}"
    );
    api_expect(&api2, 204, "DELETE", "/gpus/gpu2", None);
    let out = restored.wait(LIMIT);
    out.assert_code(0).assert_stdout_has("hotplug: ok");
}

/// A GPU brought back by a restore (its state through VFIO migration, not PUT /gpus in the
/// new process) can be released through the guest for a later snapshot: gpuvm plugs it
/// again from what the snapshot recorded of it.
#[test]
fn a_gpu_restored_through_migration_can_be_released_through_the_guest() {
    let scratch = Scratch::new("gpusnap", "restored-release");
    let socket = socket_path("restored-release-emu");
    // This VM, the restored one, and the restored one after the release.
    let _emu = gpuvm_tests::start_emu_gpu(&emu_bin(), &socket, &["--clients", "3"]);
    let api = socket_path("restored-release-api");
    let vsock = scratch.path("vsock.sock");
    let mut vmm = start_vm(&api, "gpu-agent", Some(&vsock));
    vmm.wait_for_stdout("gpu-agent: listening", LIMIT);
    api_expect(
        &api,
        200,
        "PUT",
        "/gpus/gpu0",
        Some(&gpu_body("gpu0", &socket)),
    );
    wait_for_line(&mut vmm, "gpu-agent: holding");
    let held = field_after(&vmm.stdout(), "gpu-agent: holding", "checksum=");
    let migrated = scratch.path("migrated");
    api_snapshot_create(&api, &migrated);
    vmm.signal(libc::SIGKILL);
    let _ = vmm.wait(Duration::from_secs(10));
    let _ = std::fs::remove_file(&vsock);

    let api2 = socket_path("restored-release-api2");
    let mut restored = spawn_api_vmm(&api2, None, &[]);
    api_load_lazy(&api2, &migrated);
    let released = scratch.path("released");
    let body = json!({ "snapshot_path": released, "passthrough": "guest_release" }).to_string();
    let answer = json(&api_expect(
        &api2,
        200,
        "PUT",
        "/snapshot/create",
        Some(&body),
    ));
    assert_eq!(answer["released_gpus"], json!(["gpu0"]), "{answer}");
    assert_eq!(answer["reattached_gpus"][0]["id"], "gpu0", "{answer}");
    wait_for_line(&mut restored, "gpu-agent: resumed gpu0");
    assert_eq!(
        field_after(&restored.stdout(), "gpu-agent: resumed gpu0", "checksum="),
        held,
        "the device memory the guest kept, across the migration and the release"
    );
    restored.signal(libc::SIGKILL);
    let _ = restored.wait(Duration::from_secs(10));
}
