//! The front end against Kata's bodies (as clh.go and its generated client build them:
//! every constructor default present) and a fake VMM thread.

use gpuvm_vmm::action::{
    AddDeviceRequest, BackingKind, ClientDevice, DriveBody, VmmAction, VmmData,
};
use serde_json::json;

use super::test_vmm::{call, controller, files, json_of, message, Booted, Files};
use super::{config::VmConfig, handle, translate};
use crate::http::{Method, Request};

/// What Kata's clh driver sends to vm.create for a VM with an image rootfs, virtio-fs,
/// vsock and a cold-plugged GPU (the Go client serializes every default it set).
fn kata_vm_config() -> serde_json::Value {
    json!({
        "payload": {"kernel": "/opt/kata/vmlinux", "cmdline": "console=hvc0 quiet"},
        "cpus": {"boot_vcpus": 2, "max_vcpus": 8, "kvm_hyperv": false, "nested": true,
                  "topology": {"threads_per_core": 1, "cores_per_die": 8, "dies_per_package": 1}},
        "memory": {"size": 2147483648u64, "mergeable": false, "hotplug_method": "Acpi",
                   "shared": true, "hugepages": false, "prefault": false, "thp": true,
                   "hotplug_size": 8589934592u64},
        "disks": [{"path": "/opt/kata/kata.img", "readonly": true, "direct": false, "iommu": false,
                   "num_queues": 1, "queue_size": 128, "vhost_user": false, "backing_files": false,
                   "sparse": true, "image_type": "Raw"}],
        "fs": [{"tag": "kataShared", "socket": "/run/vc/vm/x/vhost-fs.sock", "num_queues": 1,
                "queue_size": 1024, "pci_segment": 1}],
        "rng": {"src": "/dev/urandom", "iommu": false},
        "serial": {"mode": "Off", "iommu": false},
        "console": {"mode": "Off", "iommu": false},
        "vsock": {"cid": 3, "socket": "/run/vc/vm/x/clh.sock", "iommu": false},
        "devices": [{"path": "/sys/bus/pci/devices/0000:41:00.0", "iommu": false, "id": "gpu0"}],
        "platform": {"num_pci_segments": 2, "tdx": false, "sev_snp": false},
        "iommu": false, "watchdog": false, "pvpanic": false, "landlock_enable": false
    })
}

#[test]
fn kata_vm_config_translates_to_the_pre_boot_actions() {
    let config: VmConfig = serde_json::from_value(kata_vm_config()).unwrap();
    let actions = translate::vm_config(&config).unwrap();
    let names: Vec<String> = actions
        .iter()
        .map(|a| format!("{a:?}").split('(').next().unwrap().to_string())
        .collect();
    assert_eq!(
        names,
        [
            "PutMachineConfig",
            "PutBootSource",
            "PutDrive",
            "PutFs",
            "PutVsock",
            "PutEntropy",
            "PutGpu",
            "PutPciSegments"
        ]
    );
    // Kata's virtio-fs on segment 1 of 2; everything else on segment 0.
    assert!(matches!(&actions[7], VmmAction::PutPciSegments(s)
        if s.num_pci_segments == Some(2)
            && s.devices == [("kataShared".to_string(), 1)].into()));
    assert!(matches!(&actions[0], VmmAction::PutMachineConfig(m)
        if m.vcpu_count == 2 && m.mem_size_mib == 2048 && m.backing == BackingKind::Memfd && m.thp));
    assert!(matches!(&actions[1], VmmAction::PutBootSource(b)
        if b.boot_args.as_deref() == Some("console=hvc0 quiet")));
    assert!(
        matches!(&actions[2], VmmAction::PutDrive(DriveBody::Local(d)) if d.read_only && d.drive_id == "_disk0")
    );
    assert!(
        matches!(&actions[3], VmmAction::PutFs(f) if f.tag == "kataShared" && f.queue_size == 1024)
    );
    assert!(matches!(&actions[4], VmmAction::PutVsock(v) if v.guest_cid == 3));
    assert!(matches!(&actions[6], VmmAction::PutGpu(g)
        if g.host_bdf.as_deref() == Some("0000:41:00.0") && g.pci_segment.is_none()));
    // A GPU that names segment 1 goes there (its host bridge's node is the numa[] entry
    // that lists the segment).
    let mut body = kata_vm_config();
    body["devices"][0]["pci_segment"] = json!(1);
    let config: VmConfig = serde_json::from_value(body).unwrap();
    let actions = translate::vm_config(&config).unwrap();
    assert!(matches!(&actions[6], VmmAction::PutGpu(g) if g.pci_segment == Some(1)));
}

#[test]
fn fields_away_from_their_default_are_refused_by_name() {
    for (field, value, named) in [
        ("/iommu", json!(true), "iommu"),
        ("/watchdog", json!(true), "watchdog"),
        ("/platform/tdx", json!(true), "platform"),
        ("/memory/mergeable", json!(true), "memory.mergeable"),
        ("/cpus/kvm_hyperv", json!(true), "cpus.kvm_hyperv"),
        (
            "/balloon",
            json!({"size": 0, "free_page_reporting": true}),
            "balloon",
        ),
        ("/serial/mode", json!("Pty"), "serial.mode"),
        ("/disks/0/image_type", json!("Qcow2"), "disks[0].image_type"),
        ("/disks/0/pci_segment", json!(5), "disks[0].pci_segment = 5"),
        ("/disks/0/pci_segment", json!(-1), "disks[0].pci_segment"),
        ("/fs/0/pci_segment", json!(2), "fs[0].pci_segment = 2"),
        ("/rng/pci_segment", json!("1"), "rng.pci_segment"),
        (
            "/devices/0/pci_segment",
            json!(2),
            "devices[0].pci_segment = 2",
        ),
        (
            "/platform/num_pci_segments",
            json!(0),
            "platform.num_pci_segments = 0",
        ),
        (
            "/platform/num_pci_segments",
            json!(17),
            "platform.num_pci_segments = 17",
        ),
    ] {
        let mut body = kata_vm_config();
        let (parent, key) = field.rsplit_once('/').unwrap();
        let parent = if parent.is_empty() {
            &mut body
        } else {
            body.pointer_mut(parent).unwrap()
        };
        parent[key] = value;
        let config: VmConfig = serde_json::from_value(body).unwrap();
        let error = translate::vm_config(&config).unwrap_err();
        assert!(error.contains(named), "{field}: {error}");
    }
}

/// Kata's VmConfig with files that exist where the controller opens them.
fn kata_config_with(files: &Files) -> serde_json::Value {
    let mut config = kata_vm_config();
    config["payload"]["kernel"] = json!(files.kernel);
    config["disks"][0]["path"] = json!(files.image);
    config
}

#[test]
fn kata_sequence_before_boot_against_the_controller() {
    let (vmm, files) = (controller(), files());
    let dispatch = &|action| vmm.dispatch(action);
    let ping = call(dispatch, Method::Get, "/api/v1/vmm.ping", "");
    assert_eq!(ping.status, 200);
    assert!(json_of(&ping)["version"].is_string());
    assert_eq!(
        call(dispatch, Method::Get, "/api/v1/vm.info", "").status,
        404
    );
    assert_eq!(
        call(dispatch, Method::Put, "/api/v1/vm.boot", "").status,
        404
    );
    let body = kata_config_with(&files).to_string();
    let created = call(dispatch, Method::Put, "/api/v1/vm.create", &body);
    assert_eq!(created.status, 204, "{}", message(&created));
    assert_eq!(
        call(dispatch, Method::Put, "/api/v1/vm.create", &body).status,
        409
    );
    let info = json_of(&call(dispatch, Method::Get, "/api/v1/vm.info", ""));
    assert_eq!(info["state"], "Created");
    assert_eq!(info["config"]["payload"]["kernel"], json!(files.kernel));
    assert_eq!(info["memory_actual_size"], 2147483648u64);
    assert_eq!(info["config"]["cpus"]["boot_vcpus"], 2);
    assert_eq!(info["config"]["fs"][0]["tag"], "kataShared");
    assert_eq!(
        call(dispatch, Method::Put, "/api/v1/vm.pause", "").status,
        405
    );
    let disk = json!({"path": files.image, "readonly": false, "id": "data"}).to_string();
    let added = call(dispatch, Method::Put, "/api/v1/vm.add-disk", &disk);
    assert_eq!(added.status, 204, "{}", message(&added));
    // The same id again is refused (Cloud Hypervisor's rules and the controller agree).
    let again = call(dispatch, Method::Put, "/api/v1/vm.add-disk", &disk);
    assert_eq!(again.status, 400, "{}", message(&again));
    assert!(message(&again).contains("data"), "{}", message(&again));
    // Without an id: one no device has (the rootfs from vm.create is `_disk0`).
    let unnamed = json!({"path": files.image, "readonly": true}).to_string();
    assert_eq!(
        call(dispatch, Method::Put, "/api/v1/vm.add-disk", &unnamed).status,
        204
    );
    let info = json_of(&call(dispatch, Method::Get, "/api/v1/vm.info", ""));
    let ids: Vec<&str> = info["config"]["disks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["id"].as_str().unwrap_or("(none)"))
        .collect();
    assert_eq!(ids, ["(none)", "data", "_disk1"], "{info}");
    // Removed before boot: gone from the configuration, its id free again.
    let remove = call(
        dispatch,
        Method::Put,
        "/api/v1/vm.remove-device",
        r#"{"id":"data"}"#,
    );
    assert_eq!(remove.status, 204, "{}", message(&remove));
    let info = json_of(&call(dispatch, Method::Get, "/api/v1/vm.info", ""));
    assert_eq!(
        info["config"]["disks"].as_array().unwrap().len(),
        2,
        "{info}"
    );
    assert_eq!(
        call(dispatch, Method::Put, "/api/v1/vm.add-disk", &disk).status,
        204
    );
    // A share removed by its id (gpuvm names it by its tag).
    let share = json!({"tag": "more", "socket": "/run/more.sock", "id": "fs9"}).to_string();
    assert_eq!(
        call(dispatch, Method::Put, "/api/v1/vm.add-fs", &share).status,
        204
    );
    let remove = call(
        dispatch,
        Method::Put,
        "/api/v1/vm.remove-device",
        r#"{"id":"fs9"}"#,
    );
    assert_eq!(remove.status, 204, "{}", message(&remove));
    let info = json_of(&call(dispatch, Method::Get, "/api/v1/vm.info", ""));
    assert_eq!(info["config"]["fs"].as_array().unwrap().len(), 1, "{info}");
    // Kata's resize at sandbox start, before boot: the count to boot with.
    let resize = call(
        dispatch,
        Method::Put,
        "/api/v1/vm.resize",
        r#"{"desired_vcpus":4}"#,
    );
    assert_eq!(resize.status, 204, "{}", message(&resize));
    let info = json_of(&call(dispatch, Method::Get, "/api/v1/vm.info", ""));
    assert_eq!(info["config"]["cpus"]["boot_vcpus"], 4);
    let boot = call(dispatch, Method::Put, "/api/v1/vm.boot", "");
    assert_eq!(boot.status, 400);
    assert!(
        message(&boot).contains("cannot start the VM"),
        "{}",
        message(&boot)
    );
    assert_eq!(
        call(dispatch, Method::Put, "/api/v1/vm.nope", "").status,
        404
    );
    assert_eq!(
        call(dispatch, Method::Put, "/api/v1/vmm.shutdown", "").status,
        204
    );
}

/// After boot, a device added is hot-plugged: the answer is Cloud Hypervisor's
/// PciDeviceInfo, the controller's refusal a 400 naming the device kind.
#[test]
fn devices_added_after_boot_are_answered_with_their_address() {
    let files = files();
    let config: VmConfig = serde_json::from_value(kata_config_with(&files)).unwrap();
    let booted = Booted::new(super::record::of_config(&config));
    let dispatch = &|action| booted.act(action);
    let info = json_of(&call(dispatch, Method::Get, "/api/v1/vm.info", ""));
    assert_eq!(info["state"], "Running");
    assert_eq!(info["device_tree"]["_disk0"]["pci_bdf"], "0000:00:04.0");
    let gpu = r#"{"path":"/sys/bus/pci/devices/0000:42:00.0","iommu":false}"#;
    let added = call(dispatch, Method::Put, "/api/v1/vm.add-device", gpu);
    assert_eq!(added.status, 200, "{}", message(&added));
    assert_eq!(
        json_of(&added),
        json!({"id": "_vfio1", "bdf": "0000:00:06.0"})
    );
    let disk = r#"{"path":"/img3","queue_size":1024,"id":"hot"}"#;
    let added = call(dispatch, Method::Put, "/api/v1/vm.add-disk", disk);
    assert_eq!(json_of(&added), json!({"id": "hot", "bdf": "0000:00:06.0"}));
    let on_segment_1 = r#"{"path":"/img4","pci_segment":1}"#;
    let refused = call(dispatch, Method::Put, "/api/v1/vm.add-disk", on_segment_1);
    assert_eq!(refused.status, 400, "{}", message(&refused));
    assert!(
        message(&refused).contains("segment 0"),
        "{}",
        message(&refused)
    );
    assert_eq!(
        call(dispatch, Method::Get, "/api/v1/vm.pause", "").status,
        405
    );
    assert_eq!(
        call(dispatch, Method::Put, "/api/v1/vm.boot", "").status,
        409
    );
    assert!(booted.seen.borrow().contains(&"AddDevice".to_string()));
}

/// vm.info's device_tree has a node for each GPU plugged at boot, as for a virtio device:
/// its id and its address with the segment (on segment 1, behind a root port). A GPU the
/// client configured goes by the client's id for its backend also where gpuvm's process
/// lists it under another (a live update's new process makes ids up); one the record does
/// not name keeps gpuvm's.
#[test]
fn cold_plugged_gpus_are_device_tree_nodes_under_the_client_s_ids() {
    let files = files();
    let config: VmConfig = serde_json::from_value(kata_config_with(&files)).unwrap();
    let mut record = super::record::of_config(&config);
    record.devices.push(ClientDevice {
        client_id: "emu".into(),
        device_id: "emu".into(),
        section: "user_devices".into(),
        body: json!({"socket": "/run/emu.sock", "id": "emu", "pci_segment": 1}),
    });
    let booted = Booted::new(record);
    let pci_devices = json!([
        {"id": "_disk0", "bdf": "0000:00:04.0", "kind": "virtio-blk", "hot_plugged": false},
        {"id": "_vfio0", "bdf": "0000:01:00.0", "kind": "passthrough", "hot_plugged": false,
         "backend": "0000:41:00.0"},
        {"id": "_user_device0", "bdf": "0001:00:01.0", "kind": "passthrough",
         "hot_plugged": false, "backend": "/run/emu.sock"},
        {"id": "_user_device1", "bdf": "0000:00:05.0", "kind": "passthrough",
         "hot_plugged": false, "backend": "/run/unrecorded.sock"},
    ]);
    let dispatch = &|action| match action {
        VmmAction::GetInstanceInfo => {
            let mut info = booted.act(VmmAction::GetInstanceInfo)?;
            if let VmmData::Json(info) = &mut info {
                info["pci_devices"] = pci_devices.clone();
            }
            Ok(info)
        }
        other => booted.act(other),
    };
    let info = json_of(&call(dispatch, Method::Get, "/api/v1/vm.info", ""));
    let tree = &info["device_tree"];
    let node =
        |id: &str, bdf: &str| json!({"id": id, "resources": [], "children": [], "pci_bdf": bdf});
    assert_eq!(tree["_disk0"], node("_disk0", "0000:00:04.0"), "{info}");
    assert_eq!(tree["gpu0"], node("gpu0", "0000:01:00.0"), "{info}");
    assert_eq!(tree["emu"], node("emu", "0001:00:01.0"), "{info}");
    assert_eq!(
        tree["_user_device1"],
        node("_user_device1", "0000:00:05.0"),
        "{info}"
    );
    assert_eq!(tree.as_object().map(|nodes| nodes.len()), Some(4), "{info}");
}

#[test]
fn bad_bodies_are_400() {
    let (vmm, files) = (controller(), files());
    let dispatch = &|action| vmm.dispatch(action);
    for body in [
        "",
        "{",
        r#"{"cpus":{"boot_vcpus":1,"max_vcpus":1}}"#,
        r#"{"payload":{"kernel":"/k"},"frobnicate":1}"#,
    ] {
        assert_eq!(
            call(dispatch, Method::Put, "/api/v1/vm.create", body).status,
            400,
            "{body}"
        );
    }
    // Unknown fields at a default value are accepted (Cloud Hypervisor may add fields).
    let body = json!({"payload": {"kernel": files.kernel}, "frobnicate": false}).to_string();
    let created = call(dispatch, Method::Put, "/api/v1/vm.create", &body);
    assert_eq!(created.status, 204, "{}", message(&created));
    let bad = r#"{"destination_url":"http://x/"}"#;
    assert_eq!(
        call(dispatch, Method::Put, "/api/v1/vm.snapshot", bad).status,
        400
    );
}

/// vm.add-net with the taps passed as descriptors: they go to the controller with the
/// interface (which checks them: a pipe is no tap); a `tap` named as well is refused;
/// other routes close the descriptors they are given.
#[test]
fn add_net_hands_passed_descriptors_to_the_vmm() {
    let (vmm, files) = (controller(), files());
    let body = kata_config_with(&files).to_string();
    let dispatch = &|action| vmm.dispatch(action);
    assert_eq!(
        call(dispatch, Method::Put, "/api/v1/vm.create", &body).status,
        204
    );
    let put = |path: &str, body: &str, count: usize| {
        let request = Request {
            method: Method::Put,
            path: path.into(),
            body: body.as_bytes().to_vec(),
            close: false,
        };
        let fds = (0..count)
            .map(|_| std::os::fd::OwnedFd::from(std::io::pipe().unwrap().0))
            .collect();
        // What the translation hands the controller: the tap name and descriptor count.
        let passed = std::sync::Arc::new(std::sync::Mutex::new(None));
        let response = handle(&request, fds, &|action| match action {
            VmmAction::AddDevice(request) => {
                let seen = passed.clone();
                let watched = AddDeviceRequest::new(move |record| {
                    let add = request.translate(record)?;
                    if let VmmAction::PutNetworkInterfaceFds { config, fds } = add.action.as_ref() {
                        *seen.lock().unwrap() = Some((config.host_dev_name.clone(), fds.len()));
                    }
                    Ok(add)
                });
                vmm.dispatch(VmmAction::AddDevice(watched))
            }
            other => vmm.dispatch(other),
        });
        let passed = passed.lock().unwrap().take();
        (response.status, message(&response), passed)
    };
    let net = r#"{"mac":"06:00:0a:00:00:02","id":"net0","num_queues":2,"queue_size":256}"#;
    let (status, said, passed) = put("/api/v1/vm.add-net", net, 1);
    assert_eq!((status, passed), (400, Some((None, 1))));
    assert!(said.contains("TUNGETIFF"), "{said}");
    let named = r#"{"id":"net1","tap":"tap1"}"#;
    assert_eq!(put("/api/v1/vm.add-net", named, 1).0, 400);
    assert_eq!(put("/api/v1/vm.add-net", r#"{"id":"net2"}"#, 0).0, 400);
    // A disk takes no descriptors: they are closed, the disk is added.
    let disk = json!({"path": files.image, "id": "data"}).to_string();
    assert_eq!(put("/api/v1/vm.add-disk", &disk, 1).0, 204);
    let info = json_of(&call(dispatch, Method::Get, "/api/v1/vm.info", ""));
    assert!(
        info["config"]["net"].as_array().unwrap().is_empty(),
        "{info}"
    );
    assert_eq!(info["config"]["disks"][1]["id"], "data");
}

#[test]
fn a_balloon_becomes_its_target_in_mib() {
    let with = |balloon: serde_json::Value, devices: bool| {
        let mut body = kata_vm_config();
        body["balloon"] = balloon;
        if !devices {
            body["devices"] = json!([]);
        }
        let config: VmConfig = serde_json::from_value(body).unwrap();
        translate::vm_config(&config)
    };
    let actions = with(json!({"size": 64u64 << 20, "deflate_on_oom": true}), false).unwrap();
    let balloon = actions.iter().find_map(|a| match a {
        VmmAction::PutBalloon(config) => Some(config.clone()),
        _ => None,
    });
    let balloon = balloon.expect("a PutBalloon action");
    assert_eq!((balloon.amount_mib, balloon.deflate_on_oom), (64, true));
    assert_eq!(balloon.stats_polling_interval_s, 0);
    // Not whole MiB, free page reporting: refused by name.
    let error = with(json!({"size": 1000}), false).unwrap_err();
    assert!(error.contains("balloon.size"), "{error}");
    let error = with(json!({"size": 0, "free_page_reporting": true}), false).unwrap_err();
    assert!(error.contains("free_page_reporting"), "{error}");
    // An empty balloon beside a GPU is left out (the GPU's DMA pins guest RAM).
    let actions = with(json!({"size": 0, "deflate_on_oom": false}), true).unwrap();
    assert!(!actions
        .iter()
        .any(|a| matches!(a, VmmAction::PutBalloon(_))));
}

/// vm.restore as ch-remote sends it (`net_fds: null`) reaches the controller's load;
/// `net_fds` asking for taps that did not come with the request is refused before
/// anything is loaded.
#[test]
fn restore_takes_null_net_fds_and_counts_the_passed_taps() {
    let vmm = controller();
    let dispatch = &|action| vmm.dispatch(action);
    let asks_for_a_tap = r#"{"source_url":"file:///snap","net_fds":[{"id":"net0","num_fds":1}]}"#;
    let refused = call(dispatch, Method::Put, "/api/v1/vm.restore", asks_for_a_tap);
    assert_eq!(refused.status, 400);
    assert!(message(&refused).contains("net_fds"));
    let ch_remote = r#"{"source_url":"file:///nonexistent-snap","prefault":false,"net_fds":null,
                        "memory_restore_mode":"Copy","resume":false}"#;
    let loaded = call(dispatch, Method::Put, "/api/v1/vm.restore", ch_remote);
    assert_eq!(loaded.status, 400, "{}", message(&loaded));
    assert!(
        message(&loaded).contains("cannot load the snapshot"),
        "{}",
        message(&loaded)
    );
    // Nothing was created by the failed load.
    assert_eq!(
        call(dispatch, Method::Get, "/api/v1/vm.info", "").status,
        404
    );
}

/// Devices added without an id get ids no device of the VM has: two vfio-user devices
/// before boot are `_user_device0` and `_user_device1` (the second used to repeat the
/// first), and vm.info lists them.
#[test]
fn devices_added_without_an_id_get_distinct_ids() {
    let (vmm, files) = (controller(), files());
    let dispatch = &|action| vmm.dispatch(action);
    let body = kata_config_with(&files).to_string();
    let create = call(dispatch, Method::Put, "/api/v1/vm.create", &body);
    assert_eq!(create.status, 204);
    for socket in ["/run/gpu-a.sock", "/run/gpu-b.sock"] {
        let device = format!(r#"{{"socket":"{socket}"}}"#);
        let added = call(dispatch, Method::Put, "/api/v1/vm.add-user-device", &device);
        assert_eq!(added.status, 204, "{}", message(&added));
    }
    let info = json_of(&call(dispatch, Method::Get, "/api/v1/vm.info", ""));
    let ids: Vec<&str> = info["config"]["user_devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["_user_device0", "_user_device1"], "{info}");
    // The controller knows them by those ids: one is removed by its id.
    let remove = r#"{"id":"_user_device0"}"#;
    assert_eq!(
        call(dispatch, Method::Put, "/api/v1/vm.remove-device", remove).status,
        204
    );
    let info = json_of(&call(dispatch, Method::Get, "/api/v1/vm.info", ""));
    assert_eq!(info["config"]["user_devices"].as_array().unwrap().len(), 1);
}

/// Two clients add a disk with the same id, the second's request reaching the controller
/// just after the first's: Cloud Hypervisor's rules run against the record as the
/// controller holds it when it takes the action (one step), so the second is refused
/// by them ("Identifier is not unique"), not checked against a configuration read
/// before the first disk was in.
#[test]
fn a_device_added_is_checked_against_the_configuration_it_joins() {
    let (vmm, files) = (controller(), files());
    let dispatch = &|action| vmm.dispatch(action);
    let body = kata_config_with(&files).to_string();
    assert_eq!(
        call(dispatch, Method::Put, "/api/v1/vm.create", &body).status,
        204
    );
    let disk = json!({"path": files.image, "id": "data"}).to_string();
    // The first client's add arrives while the second's request is on its way.
    let racing = &|action| {
        if matches!(action, VmmAction::AddDevice(_)) {
            let first = call(dispatch, Method::Put, "/api/v1/vm.add-disk", &disk);
            assert_eq!(first.status, 204, "{}", message(&first));
        }
        vmm.dispatch(action)
    };
    let second = call(racing, Method::Put, "/api/v1/vm.add-disk", &disk);
    assert_eq!(second.status, 400);
    assert!(
        message(&second).contains("Identifier is not unique"),
        "{}",
        message(&second)
    );
    let info = json_of(&call(dispatch, Method::Get, "/api/v1/vm.info", ""));
    let disks = info["config"]["disks"].as_array().unwrap();
    assert_eq!(
        disks.iter().filter(|d| d["id"] == "data").count(),
        1,
        "{info}"
    );
}

/// `x_nv_gpudirect_clique` on a device becomes the GPU's clique; out of range, or not a
/// number, is refused naming the field; absent leaves it to the host's topology.
#[test]
fn device_gpudirect_clique_is_translated_and_checked() {
    let clique_of = |value: Option<serde_json::Value>| {
        let mut body = kata_vm_config();
        if let Some(value) = value {
            body["devices"][0]["x_nv_gpudirect_clique"] = value;
        }
        let config: VmConfig = serde_json::from_value(body).map_err(|e| e.to_string())?;
        let actions = translate::vm_config(&config)?;
        actions
            .iter()
            .find_map(|action| match action {
                VmmAction::PutGpu(gpu) => Some(gpu.gpudirect_clique),
                _ => None,
            })
            .ok_or_else(|| "no PutGpu".to_string())
    };
    assert_eq!(clique_of(None), Ok(None));
    assert_eq!(clique_of(Some(json!(0))), Ok(Some(0)));
    assert_eq!(clique_of(Some(json!(15))), Ok(Some(15)));
    for bad in [json!(16), json!(-1), json!(300)] {
        let error = clique_of(Some(bad.clone())).unwrap_err();
        assert!(
            error.contains("devices[0].x_nv_gpudirect_clique") && error.contains("0 to 15"),
            "{bad}: {error}"
        );
    }
    let error = clique_of(Some(json!("3"))).unwrap_err();
    assert!(error.contains("x_nv_gpudirect_clique"), "{error}");
}

/// `numa`: Kata's VmConfig with two guest nodes of one vCPU each.
fn two_node_config(nodes: serde_json::Value) -> Result<gpuvm_vmm::action::NumaBody, String> {
    let mut body = kata_vm_config();
    body["numa"] = nodes;
    let config: VmConfig = serde_json::from_value(body).map_err(|e| e.to_string())?;
    let actions = translate::vm_config(&config)?;
    match &actions[0] {
        VmmAction::PutMachineConfig(machine) => {
            machine.numa.clone().ok_or_else(|| "no numa".to_string())
        }
        other => Err(format!("{other:?}")),
    }
}

/// Each `numa[i]` becomes a guest node with its vCPUs and distances; the RAM (2 GiB) is
/// split evenly, as gpuvm has no memory zones; what gpuvm cannot do is refused by name.
#[test]
fn numa_nodes_are_translated_and_checked() {
    let numa = two_node_config(json!([
        {"guest_numa_id": 1, "cpus": [1], "distances": [{"destination": 0, "distance": 31}]},
        {"guest_numa_id": 0, "cpus": [0], "distances": [{"destination": 1, "distance": 21}],
         "memory_zones": [], "pci_segments": null}
    ]))
    .unwrap();
    let nodes: Vec<(u32, Vec<u8>, u64)> = numa
        .nodes
        .iter()
        .map(|n| (n.node, n.cpus.clone(), n.mem_mib))
        .collect();
    assert_eq!(nodes, [(1, vec![1], 1024), (0, vec![0], 1024)]);
    assert_eq!(numa.distances, Some(vec![vec![10, 21], vec![31, 10]]));
    assert!(!numa.auto);
    // Without distances, gpuvm's own.
    let plain = two_node_config(json!([
        {"guest_numa_id": 0, "cpus": [0]}, {"guest_numa_id": 1, "cpus": [1]}
    ]))
    .unwrap();
    assert_eq!(plain.distances, None);
    // A node's PCI segments (of the config's two): its host bridges.
    let placed = two_node_config(json!([
        {"guest_numa_id": 0, "cpus": [0], "pci_segments": [0]},
        {"guest_numa_id": 1, "cpus": [1], "pci_segments": [1]}
    ]))
    .unwrap();
    let segments: Vec<Vec<u16>> = placed
        .nodes
        .iter()
        .map(|n| n.pci_segments.clone())
        .collect();
    assert_eq!(segments, [vec![0], vec![1]]);
    // Three nodes over 2048 MiB: the remainder on the first node listed.
    let mut body = kata_vm_config();
    body["cpus"]["boot_vcpus"] = json!(3);
    body["numa"] = json!([
        {"guest_numa_id": 0, "cpus": [0]}, {"guest_numa_id": 1, "cpus": [1]},
        {"guest_numa_id": 2, "cpus": [2]}
    ]);
    let config: VmConfig = serde_json::from_value(body).unwrap();
    let actions = translate::vm_config(&config).unwrap();
    let VmmAction::PutMachineConfig(machine) = &actions[0] else {
        panic!("{:?}", actions[0]);
    };
    let sizes: Vec<u64> = machine
        .numa
        .as_ref()
        .unwrap()
        .nodes
        .iter()
        .map(|n| n.mem_mib)
        .collect();
    assert_eq!(sizes, [684, 682, 682]);

    for (nodes, named) in [
        (
            json!([{"guest_numa_id": 0, "cpus": [0, 1], "memory_zones": ["mem0"]}]),
            "numa[0].memory_zones",
        ),
        (
            json!([{"guest_numa_id": 0, "cpus": [0, 1], "pci_segments": [2]}]),
            "numa[0].pci_segments[0] = 2: the VM has 2 PCI segment(s)",
        ),
        (
            json!([{"guest_numa_id": 0, "cpus": [0, 1], "pci_segments": ["one"]}]),
            "numa[0].pci_segments[0]",
        ),
        (
            json!([{"guest_numa_id": 1, "cpus": [0, 1]}]),
            "numa[0].guest_numa_id",
        ),
        (
            json!([{"guest_numa_id": 0, "cpus": [0]}, {"guest_numa_id": 0, "cpus": [1]}]),
            "given to two nodes",
        ),
        (json!([{"guest_numa_id": 0}]), "numa[0].cpus"),
        (
            json!([{"guest_numa_id": 0, "cpus": [300]}]),
            "numa[0].cpus[0]",
        ),
        (
            json!([{"guest_numa_id": 0, "cpus": [0]},
                   {"guest_numa_id": 1, "cpus": [1],
                    "distances": [{"destination": 0, "distance": 5}]}]),
            "numa[1].distances[0].distance",
        ),
        (
            json!([{"guest_numa_id": 0, "cpus": [0],
                    "distances": [{"destination": 2, "distance": 20}]},
                   {"guest_numa_id": 1, "cpus": [1]}]),
            "numa[0].distances[0].destination",
        ),
        (
            json!([{"guest_numa_id": 0, "cpus": [0, 1], "sgx_epc_sections": ["epc0"]}]),
            "numa[0].sgx_epc_sections",
        ),
    ] {
        let error = two_node_config(nodes.clone()).unwrap_err();
        assert!(error.contains(named), "{nodes}: {error}");
    }
}

/// vm.create with `numa` hands the nodes to the controller, which keeps them for the
/// builder (GET /machine-config shows them); a refused node refuses the whole VmConfig.
#[test]
fn numa_nodes_reach_the_controller() {
    let (vmm, files) = (controller(), files());
    let dispatch = &|action| vmm.dispatch(action);
    let mut body = kata_config_with(&files);
    body["numa"] = json!([{"guest_numa_id": 0, "cpus": [0], "memory_zones": ["z0"]},
                          {"guest_numa_id": 1, "cpus": [1]}]);
    let refused = call(
        dispatch,
        Method::Put,
        "/api/v1/vm.create",
        &body.to_string(),
    );
    assert_eq!(refused.status, 400);
    assert!(
        message(&refused).contains("numa[0].memory_zones"),
        "{}",
        message(&refused)
    );

    body["numa"] = json!([{"guest_numa_id": 0, "cpus": [0]},
                          {"guest_numa_id": 1, "cpus": [1],
                           "distances": [{"destination": 0, "distance": 25}]}]);
    let created = call(
        dispatch,
        Method::Put,
        "/api/v1/vm.create",
        &body.to_string(),
    );
    assert_eq!(created.status, 204, "{}", message(&created));
    let machine = match vmm.dispatch(VmmAction::GetMachineConfig) {
        Ok(gpuvm_vmm::action::VmmData::Json(json)) => json,
        other => panic!("{other:?}"),
    };
    assert_eq!(
        machine["numa"],
        json!({"nodes": [{"node": 0, "cpus": [0], "mem_mib": 1024},
                         {"node": 1, "cpus": [1], "mem_mib": 1024}],
               "distances": [[10, 20], [25, 10]]})
    );
}
