//! A GPU through Cloud Hypervisor's API, as Kata's clh driver hot-plugs one: gpuvm as
//! `cloud-hypervisor --api-socket S`, vm.create and vm.boot of the test guest's
//! `pci-hotplug 2` workload, then vm.add-user-device with the emulated GPU over vfio-user
//! (200 `{id, bdf}` with a `0000:00:XX.0` address, as Kata checks): the guest runs its pci
//! checks on it; vm.remove-device: the guest ejects it. A second GPU is added, and the VM
//! is paused and snapshotted with it (the device saves its state: VFIO migration); a new
//! process restores it (`--restore source_url=file://...`) onto a fresh device process,
//! vm.resume, and vm.remove-device of the restored GPU is answered by the restored guest's
//! eject. Bad input: an unknown id to remove, a socket nobody serves, the same id twice.
//! GPUs cold-plugged (vm.add-user-device before vm.boot, on PCI segments 0 and 1) are in
//! vm.info's `device_tree` at the addresses the guest finds, the same after a live update.

use std::path::{Path, PathBuf};
use std::time::Duration;

use gpuvm_tests::cloud_hypervisor_support::{
    guest_image, spawn_ch, vm_info, vm_state as state, wait_for_vm,
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

/// Where the test guest's `pci` workload found the emulated GPU on segment 0's bus 0
/// (its `pci: 00:XX.0 vendor=0x10de device=0x2330` line), as `0000:00:XX.0`.
fn gpu_found_by_guest(stdout: &str) -> String {
    let line = (stdout.lines())
        .find(|line| line.starts_with("pci: 00:") && line.contains("vendor=0x10de device=0x2330"))
        .unwrap_or_else(|| panic!("the guest found no GPU on bus 0:\n{stdout}"));
    let bdf = line["pci: ".len()..].split_whitespace().next().unwrap();
    format!("0000:{bdf}")
}

/// GPUs cold-plugged through Cloud Hypervisor's API are in vm.info's device_tree, as Kata
/// looks for a GPU it added before vm.boot: by vm.add-user-device, `gpu0` on segment 0
/// and one without an id on PCI segment 1 of 2 (its id is the one vm.info's config shows
/// for it). Each node has its id and its
/// address with the segment (`pci_bdf`), shaped as the virtio disk's node; gpu0's address
/// is where the guest found the GPU, the other's on segment 1 where gpuvm logged it.
#[test]
fn cold_plugged_gpus_are_in_the_device_tree_at_their_addresses() {
    let scratch = Scratch::new("cloud_hypervisor_gpu", "cold_device_tree");
    let kernel = guest_image(&scratch);
    let image = scratch.path("disk.img");
    std::fs::write(&image, vec![0u8; 1 << 20]).unwrap();
    let sockets = [scratch.path("gpu-a.sock"), scratch.path("gpu-b.sock")];
    let _emus: Vec<_> = (sockets.iter())
        .map(|socket| gpuvm_tests::start_emu_gpu(&emu_bin(), socket, &[]))
        .collect();
    let api = scratch.path("api.sock");
    let mut vmm = spawn_ch(&scratch, &["-v", "--api-socket", api.to_str().unwrap()]);
    wait_for_api_socket(&mut vmm, &api);
    let config = serde_json::json!({
        "payload": { "kernel": kernel, "cmdline": "pci hold" },
        "cpus": { "boot_vcpus": 1, "max_vcpus": 1 },
        "memory": { "size": 268435456u64, "shared": true },
        "serial": { "mode": "Tty" },
        "console": { "mode": "Off" },
        "platform": { "num_pci_segments": 2 },
        "disks": [{ "path": image, "id": "disk0" }],
    })
    .to_string();
    api_expect(&api, 204, "PUT", "/api/v1/vm.create", Some(&config));
    let body = serde_json::json!({ "socket": sockets[0], "id": "gpu0" }).to_string();
    api_expect(&api, 204, "PUT", "/api/v1/vm.add-user-device", Some(&body));
    let body = serde_json::json!({ "socket": sockets[1], "pci_segment": 1 }).to_string();
    api_expect(&api, 204, "PUT", "/api/v1/vm.add-user-device", Some(&body));
    api_expect(&api, 204, "PUT", "/api/v1/vm.boot", None);
    vmm.wait_for_stdout("pci: holding", LIMIT);

    let info = vm_info(&api);
    let tree = &info["device_tree"];
    let second_id = (info["config"]["user_devices"].as_array())
        .and_then(|devices| (devices.iter()).find(|d| d["socket"].as_str() == sockets[1].to_str()))
        .and_then(|device| device["id"].as_str())
        .unwrap_or_else(|| panic!("vm.info's config has no id for the second GPU: {info}"))
        .to_string();
    assert_ne!(second_id, "gpu0", "{info}");
    for id in ["gpu0", second_id.as_str()] {
        let node = &tree[id];
        assert_eq!(node["id"], id, "{info}");
        assert_eq!(node["resources"], serde_json::json!([]), "{info}");
        assert_eq!(node["children"], serde_json::json!([]), "{info}");
        // The fields of a virtio device's node, no more, no fewer.
        let keys = |node: &serde_json::Value| -> Vec<String> {
            node.as_object()
                .map(|o| o.keys().cloned().collect())
                .unwrap_or_default()
        };
        assert_eq!(keys(node), keys(&tree["disk0"]), "{info}");
        // Where gpuvm put it, as it logged it (segment 0's without the segment).
        let bdf = node["pci_bdf"].as_str().unwrap_or_default();
        let logged = bdf.strip_prefix("0000:").unwrap_or(bdf);
        assert!(
            vmm.stderr().contains(&format!("PCI {logged}: vfio-user")),
            "{id} at {bdf} is not where gpuvm plugged it:\n{}",
            vmm.stderr()
        );
    }
    assert_eq!(
        tree["gpu0"]["pci_bdf"].as_str().unwrap(),
        gpu_found_by_guest(&vmm.stdout()),
        "{info}"
    );
    let on_segment_1 = tree[&second_id]["pci_bdf"].as_str().unwrap();
    assert!(
        on_segment_1.starts_with("0001:00:") && on_segment_1.ends_with(".0"),
        "{info}"
    );
    assert!(
        (tree["disk0"]["pci_bdf"].as_str()).is_some_and(|bdf| bdf.starts_with("0000:00:")),
        "{info}"
    );
    assert!(!vmm.stdout().contains("FAIL"), "{}", vmm.stdout());
    api_expect(&api, 204, "PUT", "/api/v1/vmm.shutdown", None);
    let out = vmm.wait(LIMIT);
    assert!(!out.stderr.contains("panicked"), "{}", out.stderr);
}

/// Cold-plugged GPUs keep their nodes in vm.info's device_tree across a live update
/// (`gpuvm update`): `gpu0` and one added without an id (`_user_device0`), at the same
/// addresses, although the new process is not told the old one's ids.
#[test]
fn cold_plugged_gpus_keep_their_device_tree_nodes_across_a_live_update() {
    let scratch = Scratch::new("cloud_hypervisor_gpu", "cold_update");
    let kernel = guest_image(&scratch);
    let sockets = [scratch.path("gpu-a.sock"), scratch.path("gpu-b.sock")];
    let _emus: Vec<_> = (sockets.iter())
        .map(|socket| gpuvm_tests::start_emu_gpu(&emu_bin(), socket, &[]))
        .collect();
    let api = scratch.path("api.sock");
    let mut vmm = spawn_ch(&scratch, &["--api-socket", api.to_str().unwrap()]);
    wait_for_api_socket(&mut vmm, &api);
    let config = serde_json::json!({
        "payload": { "kernel": kernel, "cmdline": "pci hold" },
        "cpus": { "boot_vcpus": 1, "max_vcpus": 1 },
        "memory": { "size": 268435456u64, "shared": true },
        "serial": { "mode": "Tty" },
        "console": { "mode": "Off" },
    })
    .to_string();
    api_expect(&api, 204, "PUT", "/api/v1/vm.create", Some(&config));
    for body in [
        serde_json::json!({ "socket": sockets[0], "id": "gpu0" }),
        serde_json::json!({ "socket": sockets[1] }),
    ] {
        let body = body.to_string();
        api_expect(&api, 204, "PUT", "/api/v1/vm.add-user-device", Some(&body));
    }
    api_expect(&api, 204, "PUT", "/api/v1/vm.boot", None);
    vmm.wait_for_stdout("pci: holding", LIMIT);
    let before = vm_info(&api);
    let tree = &before["device_tree"];
    for id in ["gpu0", "_user_device0"] {
        let bdf = tree[id]["pci_bdf"].as_str().unwrap_or_default();
        assert!(bdf.starts_with("0000:00:"), "{id}: {before}");
    }

    let out = gpuvm_tests::gpuvm_update(vmm.pid(), &["--api-sock", api.to_str().unwrap()], &[]);
    let new = gpuvm_tests::updated_to(&out, &vmm.stderr());
    let deadline = std::time::Instant::now() + LIMIT;
    while !gpuvm_api::client::request(&api, "GET", "/api/v1/vm.info", None)
        .is_ok_and(|answer| answer.status == 200)
    {
        assert!(
            std::time::Instant::now() < deadline,
            "no vm.info from {new}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let after = vm_info(&api);
    assert_eq!(after["device_tree"], before["device_tree"], "{after}");
    assert_eq!(after["config"], before["config"], "{after}");
    // The new process knows them by the same ids as devices attached at start: gpuvm's
    // own API too (the ids came with the devices' state).
    let info = api_expect(&api, 200, "GET", "/", None);
    let listed = serde_json::from_str::<serde_json::Value>(&info).unwrap_or_default();
    let ids: Vec<&str> = (listed["pci_devices"].as_array().into_iter().flatten())
        .filter_map(|device| device["id"].as_str())
        .collect();
    assert!(
        ids.contains(&"gpu0") && ids.contains(&"_user_device0"),
        "{info}"
    );
    let refused = api_expect(
        &api,
        409,
        "PUT",
        "/api/v1/vm.remove-device",
        Some(r#"{"id": "gpu0"}"#),
    );
    assert!(refused.contains("attached at start"), "{refused}");
    api_expect(&api, 204, "PUT", "/api/v1/vmm.shutdown", None);
    while gpuvm_tests::process_running(new) {
        assert!(std::time::Instant::now() < deadline, "{new} did not end");
        std::thread::sleep(Duration::from_millis(10));
    }
}
