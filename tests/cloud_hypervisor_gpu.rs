//! A GPU through Cloud Hypervisor's API, as Kata's clh driver hot-plugs one: gpuvm as
//! `cloud-hypervisor --api-socket S`, vm.create and vm.boot of the test guest's
//! `pci-hotplug 2` workload, then vm.add-user-device with the emulated GPU over vfio-user
//! (200 `{id, bdf}` with a `0000:00:XX.0` address, as Kata checks): the guest runs its pci
//! checks on it; vm.remove-device: the guest ejects it. A second GPU is added, and the VM
//! is paused and snapshotted with it (the device saves its state: VFIO migration); a new
//! process restores it (`--restore source_url=file://...`) onto a fresh device process,
//! vm.resume, and vm.remove-device of the restored GPU is answered by the restored guest's
//! eject. Bad input: an unknown id to remove, a socket nobody serves, the same id twice.

use std::path::{Path, PathBuf};
use std::time::Duration;

use gpuvm_tests::cloud_hypervisor_support::{
    guest_image, spawn_ch, vm_state as state, wait_for_vm,
};
use gpuvm_tests::{api_expect, wait_for_api_socket, Scratch};

const LIMIT: Duration = Duration::from_secs(60);

fn emu_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_gpuvm-emu-gpu"))
}

fn add_user_device(api: &Path, socket: &Path, id: &str) -> String {
    let body = serde_json::json!({ "socket": socket, "id": id }).to_string();
    let answer = api_expect(api, 200, "PUT", "/api/v1/vm.add-user-device", Some(&body));
    let answer: serde_json::Value = serde_json::from_str(&answer).unwrap();
    assert_eq!(answer["id"], id, "{answer}");
    let bdf = answer["bdf"].as_str().expect("bdf").to_string();
    assert!(
        bdf.starts_with("0000:00:") && bdf.ends_with(".0"),
        "Kata expects 0000:00:XX.0, got {bdf}"
    );
    bdf
}

fn remove_device(api: &Path, id: &str) {
    let body = serde_json::json!({ "id": id }).to_string();
    api_expect(api, 204, "PUT", "/api/v1/vm.remove-device", Some(&body));
}

#[test]
fn gpu_hot_plug_snapshot_and_restore_through_the_cloud_hypervisor_api() {
    let scratch = Scratch::new("cloud_hypervisor_gpu", "hotplug");
    let kernel = guest_image(&scratch);
    let api = scratch.path("api.sock");
    let mut vmm = spawn_ch(&scratch, &["--api-socket", api.to_str().unwrap()]);
    wait_for_api_socket(&mut vmm, &api);
    let config = serde_json::json!({
        "payload": { "kernel": kernel, "cmdline": "pci-hotplug 2" },
        "cpus": { "boot_vcpus": 1, "max_vcpus": 1 },
        "memory": { "size": 268435456u64, "shared": true },
        "serial": { "mode": "Tty" },
        "console": { "mode": "Off" },
    })
    .to_string();
    api_expect(&api, 204, "PUT", "/api/v1/vm.create", Some(&config));
    api_expect(&api, 204, "PUT", "/api/v1/vm.boot", None);
    assert_eq!(state(&api), "Running");
    vmm.wait_for_stdout("hotplug: waiting for 2 device(s)", LIMIT);

    // Bad input first: nothing attached, nothing served.
    let body = serde_json::json!({ "id": "nothing" }).to_string();
    let refused = api_expect(&api, 404, "PUT", "/api/v1/vm.remove-device", Some(&body));
    assert!(refused.contains("nothing"), "{refused}");
    let absent = scratch.path("absent.sock");
    let body = serde_json::json!({ "socket": absent, "id": "ghost" }).to_string();
    api_expect(&api, 400, "PUT", "/api/v1/vm.add-user-device", Some(&body));

    // The first GPU: checked by the guest, then removed (the guest ejects it).
    let first = scratch.path("gpu-a.sock");
    let emu_a = gpuvm_tests::start_emu_gpu(&emu_bin(), &first, &[]);
    let bdf = add_user_device(&api, &first, "gpu0");
    vmm.wait_for_stdout("hotplug: device 1 at", LIMIT);
    assert!(
        vmm.stdout()
            .contains(&format!("hotplug: device 1 arrived at {}", &bdf[5..])),
        "{}",
        vmm.stdout()
    );
    let body = serde_json::json!({ "socket": first, "id": "gpu0" }).to_string();
    let twice = api_expect(&api, 400, "PUT", "/api/v1/vm.add-user-device", Some(&body));
    assert!(
        twice.contains("gpu0") && twice.contains("already"),
        "{twice}"
    );
    remove_device(&api, "gpu0");
    vmm.wait_for_stdout("hotplug: device 1 ejected", LIMIT);
    let emu_out = emu_a.wait(Duration::from_secs(10));
    assert_eq!(emu_out.code(), Some(0), "{}", emu_out.stderr);

    // The second GPU, kept through a snapshot.
    let second = scratch.path("gpu-b.sock");
    let emu_b = gpuvm_tests::start_emu_gpu(&emu_bin(), &second, &[]);
    add_user_device(&api, &second, "gpu1");
    vmm.wait_for_stdout("hotplug: device 2 at", LIMIT);
    api_expect(&api, 204, "PUT", "/api/v1/vm.pause", None);
    let snapshot = scratch.path("snapshot");
    std::fs::create_dir(&snapshot).unwrap();
    let body = serde_json::json!({ "destination_url": format!("file://{}", snapshot.display()) })
        .to_string();
    api_expect(&api, 204, "PUT", "/api/v1/vm.snapshot", Some(&body));
    let device_files = std::fs::read_dir(&snapshot)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("device-"))
        .count();
    assert_eq!(device_files, 1, "the GPU's state beside RAM");
    api_expect(&api, 204, "PUT", "/api/v1/vmm.shutdown", None);
    let out = vmm.wait(LIMIT);
    assert!(!out.stderr.contains("panicked"), "{}", out.stderr);
    let _ = emu_b.wait(Duration::from_secs(10));

    // A new process restores it onto a fresh device process behind the same socket.
    let emu_c = gpuvm_tests::start_emu_gpu(&emu_bin(), &second, &[]);
    let api2 = scratch.path("api2.sock");
    let source = format!("source_url=file://{}", snapshot.display());
    let mut restored = spawn_ch(
        &scratch,
        &["--api-socket", api2.to_str().unwrap(), "--restore", &source],
    );
    wait_for_api_socket(&mut restored, &api2);
    wait_for_vm(&mut restored, &api2, LIMIT);
    assert_eq!(state(&api2), "Paused");
    api_expect(&api2, 204, "PUT", "/api/v1/vm.resume", None);
    assert_eq!(state(&api2), "Running");
    remove_device(&api2, "gpu1");
    let out = restored.wait(LIMIT);
    out.assert_code(0)
        .assert_stdout_has("hotplug: device 2 ejected")
        .assert_stdout_has("hotplug: ok");
    let emu_out = emu_c.wait(Duration::from_secs(10));
    assert_eq!(emu_out.code(), Some(0), "{}", emu_out.stderr);
}
