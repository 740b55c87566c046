//! The front end against Kata's bodies (as clh.go and its generated client build them:
//! every constructor default present) and a fake VMM thread.

use std::cell::RefCell;

use gpuvm_vmm::action::{
    ActionError, ActionResult, BackingKind, DriveBody, VirtioHotplug, VmmAction, VmmData,
};
use serde_json::json;

use super::{config::VmConfig, handle, translate, Session};
use crate::http::{Method, Request, Response};

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
    assert!(
        matches!(&actions[6], VmmAction::PutGpu(g) if g.host_bdf.as_deref() == Some("0000:41:00.0"))
    );
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
            json!(1),
            "devices[0].pci_segment = 1",
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

/// A fake VMM thread: remembers the actions, answers as the controller would.
struct Fake {
    state: RefCell<&'static str>,
    seen: RefCell<Vec<String>>,
}

impl Fake {
    fn new() -> Self {
        Fake {
            state: RefCell::new("NotStarted"),
            seen: RefCell::new(Vec::new()),
        }
    }

    fn act(&self, action: VmmAction) -> ActionResult {
        self.seen
            .borrow_mut()
            .push(format!("{action:?}").split('(').next().unwrap().to_string());
        let state = *self.state.borrow();
        match action {
            VmmAction::GetInstanceInfo => Ok(VmmData::Json(json!({"state": state}))),
            VmmAction::StartInstance => {
                *self.state.borrow_mut() = "Running";
                Ok(VmmData::Empty)
            }
            VmmAction::Pause if state == "NotStarted" => {
                Err(ActionError::wrong_state("not running"))
            }
            VmmAction::PutGpu(gpu) if state == "Running" => Ok(VmmData::Json(
                json!({"id": gpu.gpu_id, "bdf": "0000:00:05.0"}),
            )),
            VmmAction::HotplugVirtio(VirtioHotplug::Drive(drive)) if state == "Running" => Ok(
                VmmData::Json(json!({"id": drive.drive_id(), "bdf": "0000:00:06.0"})),
            ),
            _ => Ok(VmmData::Empty),
        }
    }
}

fn call(session: &Session, fake: &Fake, method: Method, path: &str, body: &str) -> Response {
    let request = Request {
        method,
        path: path.into(),
        body: body.as_bytes().to_vec(),
        close: false,
    };
    handle(&request, Vec::new(), session, &|action| fake.act(action))
}

#[test]
fn kata_sequence_status_codes_and_states() {
    let (session, fake) = (Session::default(), Fake::new());
    let ping = call(&session, &fake, Method::Get, "/api/v1/vmm.ping", "");
    assert_eq!(ping.status, 200);
    let ping: serde_json::Value = serde_json::from_slice(&ping.body).unwrap();
    assert!(ping["version"].is_string());
    assert_eq!(
        call(&session, &fake, Method::Get, "/api/v1/vm.info", "").status,
        404
    );
    assert_eq!(
        call(&session, &fake, Method::Put, "/api/v1/vm.boot", "").status,
        404
    );
    let body = kata_vm_config().to_string();
    assert_eq!(
        call(&session, &fake, Method::Put, "/api/v1/vm.create", &body).status,
        204
    );
    assert_eq!(
        call(&session, &fake, Method::Put, "/api/v1/vm.create", &body).status,
        409
    );
    let info = call(&session, &fake, Method::Get, "/api/v1/vm.info", "");
    let info: serde_json::Value = serde_json::from_slice(&info.body).unwrap();
    assert_eq!(info["state"], "Created");
    assert_eq!(info["config"]["payload"]["kernel"], "/opt/kata/vmlinux");
    assert_eq!(info["memory_actual_size"], 2147483648u64);
    assert_eq!(
        call(&session, &fake, Method::Put, "/api/v1/vm.pause", "").status,
        405
    );
    let disk = r#"{"path":"/img2","readonly":false,"id":"data"}"#;
    assert_eq!(
        call(&session, &fake, Method::Put, "/api/v1/vm.add-disk", disk).status,
        204
    );
    assert_eq!(
        call(&session, &fake, Method::Put, "/api/v1/vm.boot", "").status,
        204
    );
    let info = call(&session, &fake, Method::Get, "/api/v1/vm.info", "");
    let info: serde_json::Value = serde_json::from_slice(&info.body).unwrap();
    assert_eq!(info["state"], "Running");
    assert_eq!(info["config"]["disks"][1]["id"], "data");
    let gpu = r#"{"path":"/sys/bus/pci/devices/0000:42:00.0","iommu":false}"#;
    let added = call(&session, &fake, Method::Put, "/api/v1/vm.add-device", gpu);
    assert_eq!(added.status, 200);
    let added: serde_json::Value = serde_json::from_slice(&added.body).unwrap();
    assert_eq!(added["bdf"], "0000:00:05.0");
    // A disk after boot is hot-plugged; one without an id gets one no disk has: the
    // rootfs from vm.create, which had none, is `_disk0`.
    let hot = call(
        &session,
        &fake,
        Method::Put,
        "/api/v1/vm.add-disk",
        r#"{"path":"/img3","queue_size":1024}"#,
    );
    assert_eq!(hot.status, 200);
    let hot: serde_json::Value = serde_json::from_slice(&hot.body).unwrap();
    assert_eq!(hot, json!({"id": "_disk1", "bdf": "0000:00:06.0"}));
    let info = call(&session, &fake, Method::Get, "/api/v1/vm.info", "");
    let info: serde_json::Value = serde_json::from_slice(&info.body).unwrap();
    assert_eq!(info["config"]["disks"][2]["id"], "_disk1");
    let on_segment_1 = r#"{"path":"/img4","pci_segment":1}"#;
    assert_eq!(
        call(
            &session,
            &fake,
            Method::Put,
            "/api/v1/vm.add-disk",
            on_segment_1
        )
        .status,
        400
    );
    let resize = call(
        &session,
        &fake,
        Method::Put,
        "/api/v1/vm.resize",
        r#"{"desired_vcpus":4}"#,
    );
    // vCPU hot-plug up to cpus.max_vcpus (8 here); resize_tests.rs has the refusals.
    assert_eq!(resize.status, 204);
    assert_eq!(
        call(&session, &fake, Method::Get, "/api/v1/vm.pause", "").status,
        405
    );
    assert_eq!(
        call(&session, &fake, Method::Put, "/api/v1/vm.nope", "").status,
        404
    );
    assert_eq!(
        call(&session, &fake, Method::Put, "/api/v1/vmm.shutdown", "").status,
        204
    );
    assert!(fake.seen.borrow().contains(&"Batch".to_string()));
}

#[test]
fn bad_bodies_are_400() {
    let (session, fake) = (Session::default(), Fake::new());
    for body in [
        "",
        "{",
        r#"{"cpus":{"boot_vcpus":1,"max_vcpus":1}}"#,
        r#"{"payload":{"kernel":"/k"},"frobnicate":1}"#,
    ] {
        assert_eq!(
            call(&session, &fake, Method::Put, "/api/v1/vm.create", body).status,
            400,
            "{body}"
        );
    }
    // Unknown fields at a default value are accepted (Cloud Hypervisor may add fields).
    let body = r#"{"payload":{"kernel":"/k"},"frobnicate":false}"#;
    assert_eq!(
        call(&session, &fake, Method::Put, "/api/v1/vm.create", body).status,
        204
    );
    let bad = r#"{"destination_url":"http://x/"}"#;
    assert_eq!(
        call(&session, &fake, Method::Put, "/api/v1/vm.snapshot", bad).status,
        400
    );
}

/// vm.add-net with the taps passed as descriptors: they go to the VMM thread with the
/// interface (which checks them); a `tap` named as well is refused; other routes close
/// the descriptors they are given.
#[test]
fn add_net_hands_passed_descriptors_to_the_vmm() {
    let (session, fake) = (Session::default(), Fake::new());
    let body = kata_vm_config().to_string();
    assert_eq!(
        call(&session, &fake, Method::Put, "/api/v1/vm.create", &body).status,
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
        let passed = std::cell::Cell::new(None);
        let response = handle(&request, fds, &session, &|action| {
            if let VmmAction::PutNetworkInterfaceFds { config, fds } = &action {
                passed.set(Some((config.host_dev_name.clone(), fds.len())));
            }
            fake.act(action)
        });
        (response.status, passed.take())
    };
    let net = r#"{"mac":"06:00:0a:00:00:02","id":"net0","num_queues":2,"queue_size":256}"#;
    assert_eq!(put("/api/v1/vm.add-net", net, 1), (204, Some((None, 1))));
    let named = r#"{"id":"net1","tap":"tap1"}"#;
    assert_eq!(put("/api/v1/vm.add-net", named, 1), (400, None));
    assert_eq!(
        put("/api/v1/vm.add-net", r#"{"id":"net2"}"#, 0),
        (400, None)
    );
    // A disk takes no descriptors: they are closed, the disk is added.
    let disk = r#"{"path":"/img2","id":"data"}"#;
    assert_eq!(put("/api/v1/vm.add-disk", disk, 1), (204, None));
    let info = call(&session, &fake, Method::Get, "/api/v1/vm.info", "");
    let info: serde_json::Value = serde_json::from_slice(&info.body).unwrap();
    assert_eq!(info["config"]["net"][0]["id"], "net0");
    assert_eq!(info["config"]["net"].as_array().unwrap().len(), 1);
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

/// vm.restore as ch-remote sends it (`net_fds: null`) loads; `net_fds` asking for taps that
/// did not come with the request is refused before anything is loaded.
#[test]
fn restore_takes_null_net_fds_and_counts_the_passed_taps() {
    let (session, fake) = (Session::default(), Fake::new());
    let asks_for_a_tap = r#"{"source_url":"file:///snap","net_fds":[{"id":"net0","num_fds":1}]}"#;
    let refused = call(
        &session,
        &fake,
        Method::Put,
        "/api/v1/vm.restore",
        asks_for_a_tap,
    );
    assert_eq!(refused.status, 400);
    assert!(String::from_utf8_lossy(&refused.body).contains("net_fds"));
    let ch_remote = r#"{"source_url":"file:///snap","prefault":false,"net_fds":null,
                        "memory_restore_mode":"Copy","resume":false}"#;
    let loaded = call(
        &session,
        &fake,
        Method::Put,
        "/api/v1/vm.restore",
        ch_remote,
    );
    assert_eq!(
        loaded.status,
        204,
        "{:?}",
        String::from_utf8_lossy(&loaded.body)
    );
}

/// Devices added without an id get ids no device of the VM has: two vfio-user devices
/// before boot are `_user_device0` and `_user_device1` (the second used to repeat the
/// first), and vm.info lists them.
#[test]
fn devices_added_without_an_id_get_distinct_ids() {
    let (session, fake) = (Session::default(), Fake::new());
    let body = kata_vm_config().to_string();
    let create = call(&session, &fake, Method::Put, "/api/v1/vm.create", &body);
    assert_eq!(create.status, 204);
    for socket in ["/run/gpu-a.sock", "/run/gpu-b.sock"] {
        let device = format!(r#"{{"socket":"{socket}"}}"#);
        let added = call(
            &session,
            &fake,
            Method::Put,
            "/api/v1/vm.add-user-device",
            &device,
        );
        assert_eq!(added.status, 204);
    }
    let info = call(&session, &fake, Method::Get, "/api/v1/vm.info", "");
    let info: serde_json::Value = serde_json::from_slice(&info.body).unwrap();
    let ids: Vec<&str> = info["config"]["user_devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["_user_device0", "_user_device1"], "{info}");
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
