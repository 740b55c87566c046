use super::*;

fn controller() -> ApiController {
    let (_, requests) = std::sync::mpsc::channel();
    let config = VmConfig {
        machine: MachineConfig::default(),
        boot: default_boot_source(),
    };
    let event = EventFd::new(0).unwrap();
    ApiController::new(
        requests,
        event,
        config,
        Box::new(|| Box::new(std::io::sink())),
    )
}

/// Tap descriptors (Cloud Hypervisor's vm.add-net): one per queue pair, each a tap;
/// anything else is refused at once and nothing is configured.
#[test]
fn passed_tap_descriptors_are_counted_and_checked() {
    let mut controller = controller();
    let net = gpuvm_virtio::net::NetConfig::new("net0", None);
    let (reader, writer) = std::io::pipe().unwrap();
    let fds = vec![reader.into(), writer.into()];
    let action = VmmAction::PutNetworkInterfaceFds {
        config: net.clone(),
        fds,
    };
    let error = controller.pre_boot(action).0.unwrap_err();
    assert_eq!(error.status, 400);
    assert!(error.message.contains("1 queue pair"), "{}", error.message);

    let (reader, _writer) = std::io::pipe().unwrap();
    let action = VmmAction::PutNetworkInterfaceFds {
        config: net,
        fds: vec![reader.into()],
    };
    let error = controller.pre_boot(action).0.unwrap_err();
    assert_eq!(error.status, 400);
    assert!(
        error.message.contains("net0") && error.message.contains("TUNGETIFF"),
        "{}",
        error.message
    );
    assert!(controller.pci.virtio.nets.is_empty());
    assert!(controller.pci.device_resources.ids().is_empty());
}

/// vm.resize before start: the count to boot with, between 1 and `max_vcpus`; memory
/// only at its size. Refusals leave the configuration as it was.
#[test]
fn resize_before_start_changes_the_boot_count_within_max_vcpus() {
    let mut controller = controller();
    let body: MachineConfigBody = serde_json::from_value(serde_json::json!({
        "vcpu_count": 2, "mem_size_mib": 256, "max_vcpus": 4,
    }))
    .unwrap();
    assert!(controller
        .pre_boot(VmmAction::PutMachineConfig(body))
        .0
        .is_ok());
    let shown = controller.pre_boot(VmmAction::GetMachineConfig).0.unwrap();
    assert_eq!(
        shown,
        VmmData::Json(serde_json::json!({
            "vcpu_count": 2, "mem_size_mib": 256, "track_dirty_pages": false,
            "backing": "memfd", "thp": true, "prefault": false, "cpuid_masks": [],
            "max_vcpus": 4,
        }))
    );
    let resize = |vcpus: Option<u8>, ram: Option<u64>| VmmAction::Resize {
        desired_vcpus: vcpus,
        desired_ram: ram,
    };
    // Kata's call at sandbox start: the count the VM has.
    assert_eq!(
        controller.pre_boot(resize(Some(2), None)).0,
        Ok(VmmData::Empty)
    );
    assert_eq!(
        controller.pre_boot(resize(None, Some(256 << 20))).0,
        Ok(VmmData::Empty)
    );
    for (action, says) in [
        (resize(Some(0), None), "at least 1 vCPU"),
        (resize(Some(5), None), "max_vcpus = 4"),
        (resize(Some(3), Some(0)), "desired_ram = 0"),
        (resize(Some(3), Some((512 << 20) + 1)), "not a multiple"),
    ] {
        let error = controller.pre_boot(action).0.unwrap_err();
        assert_eq!(error.status, 400);
        assert!(error.message.contains(says), "{}", error.message);
        assert_eq!(controller.machine_config.vcpus, 2);
    }
    assert_eq!(
        controller.pre_boot(resize(Some(4), None)).0,
        Ok(VmmData::Empty)
    );
    assert_eq!(controller.machine_config.vcpus, 4);
    assert_eq!(controller.pci_options().max_vcpus, 4);
    // Before boot, desired_ram is the RAM to boot with.
    assert_eq!(
        controller.pre_boot(resize(None, Some(512 << 20))).0,
        Ok(VmmData::Empty)
    );
    assert_eq!(controller.machine_config.memory_size, 512 << 20);

    // A maximum below the count is refused.
    let body: MachineConfigBody = serde_json::from_value(serde_json::json!({
        "vcpu_count": 2, "mem_size_mib": 256, "max_vcpus": 1,
    }))
    .unwrap();
    let error = controller
        .pre_boot(VmmAction::PutMachineConfig(body))
        .0
        .unwrap_err();
    assert!(error.message.contains("max_vcpus"), "{}", error.message);
    assert_eq!(controller.machine_config.vcpus, 4);
}

fn user_gpu(socket: &str) -> VmmAction {
    VmmAction::PutGpu(GpuBody::new("placeholder", None, Some(socket.into())))
}

fn add(action: VmmAction, client_id: Option<&str>, segment: u16) -> VmmAction {
    VmmAction::AddDevice(crate::action::AddDeviceRequest::ready(
        crate::action::AddDevice {
            action: Box::new(action),
            client_id: client_id.map(String::from),
            id_prefix: "_user_device".into(),
            named_by_client_id: true,
            segment,
            noun: "GPU".into(),
            section: "user_devices".into(),
            body: serde_json::json!({}),
        },
    ))
}

/// Cloud Hypervisor's lifecycle is the controller's: no device before vm.create, the
/// Created state after it, ids made up and checked here, a device whose PCI segment
/// cannot be had leaves nothing configured, and a created VM takes no restore.
#[test]
fn a_created_vm_takes_devices_by_the_clients_ids() {
    let mut controller = controller();
    let early = controller.pre_boot(add(user_gpu("/run/a.sock"), None, 0)).0;
    assert_eq!(early.unwrap_err().status, 404);
    assert_eq!(
        controller
            .pre_boot(VmmAction::BootCreated)
            .0
            .unwrap_err()
            .status,
        404
    );
    let create = VmmAction::CreateVm {
        actions: Vec::new(),
        record: Default::default(),
    };
    assert_eq!(controller.pre_boot(create).0, Ok(VmmData::Empty));
    let info = controller.pre_boot(VmmAction::GetInstanceInfo).0.unwrap();
    let VmmData::Json(info) = info else {
        panic!("{info:?}")
    };
    assert_eq!(info["state"], "Created");
    let again = VmmAction::CreateVm {
        actions: Vec::new(),
        record: Default::default(),
    };
    assert_eq!(controller.pre_boot(again).0.unwrap_err().status, 409);

    for _ in 0..2 {
        let added = controller.pre_boot(add(user_gpu("/run/a.sock"), None, 0)).0;
        assert_eq!(added, Ok(VmmData::Empty));
    }
    let ids: Vec<&str> = controller.gpus.iter().map(|g| g.gpu_id.as_str()).collect();
    assert_eq!(ids, ["_user_device0", "_user_device1"]);
    let taken = controller.pre_boot(add(user_gpu("/run/b.sock"), Some("_user_device1"), 0));
    assert_eq!(taken.0.unwrap_err().status, 400);
    // Segment 3 of a VM with one: refused, and the device is not left behind.
    let off = controller
        .pre_boot(add(user_gpu("/run/c.sock"), Some("c"), 3))
        .0;
    assert!(off.is_err());
    assert_eq!(controller.gpus.len(), 2);
    assert_eq!(
        controller
            .pre_boot(VmmAction::RemoveDevice("_user_device0".into()))
            .0,
        Ok(VmmData::Empty)
    );
    let VmmData::Json(info) = controller.pre_boot(VmmAction::GetInstanceInfo).0.unwrap() else {
        panic!()
    };
    let recorded: Vec<&str> = info["client_record"]["devices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["client_id"].as_str().unwrap())
        .collect();
    assert_eq!(recorded, ["_user_device1"]);
    let restore = VmmAction::RestoreWithTaps {
        load: serde_json::from_value(serde_json::json!({"snapshot_path": "/snap"})).unwrap(),
        taps: Vec::new(),
    };
    assert_eq!(controller.pre_boot(restore).0.unwrap_err().status, 409);
}

fn mmds_config(interfaces: &[&str]) -> VmmAction {
    VmmAction::PutMmdsConfig(gpuvm_mmds::MmdsConfig::new(
        gpuvm_mmds::MmdsVersion::V2,
        interfaces.iter().map(|id| id.to_string()).collect(),
    ))
}

/// MMDS is the controller's: its data store round trip, its size limit refused as too
/// large (413, the store as it was), its configuration before start naming configured
/// interfaces only and recorded for the client, refused once started; and the network
/// interfaces it builds get this VM's MMDS.
#[test]
fn mmds_actions_are_the_controllers() {
    let mut controller = controller();
    use serde_json::json;
    let put = VmmAction::PutMmds(json!({"latest": {"id": "i-1"}}));
    assert_eq!(controller.pre_boot(put).0, Ok(VmmData::Empty));
    let patch = VmmAction::PatchMmds(json!({"latest": {"host": "vm"}}));
    assert_eq!(controller.pre_boot(patch).0, Ok(VmmData::Empty));
    let stored = json!({"latest": {"id": "i-1", "host": "vm"}});
    assert_eq!(
        controller.pre_boot(VmmAction::GetMmds).0,
        Ok(VmmData::Json(stored.clone()))
    );
    let not_object = controller.pre_boot(VmmAction::PutMmds(json!([1]))).0;
    assert_eq!(not_object.unwrap_err().status, 400);

    // --mmds-size-limit: a change past it is refused as too large; nothing changes.
    assert_eq!(
        controller.pre_boot(VmmAction::SetMmdsSizeLimit(48)).0,
        Ok(VmmData::Empty)
    );
    let grown = VmmAction::PatchMmds(json!({"latest": {"more": "0123456789abcdef"}}));
    let error = controller.pre_boot(grown).0.unwrap_err();
    assert_eq!(error.status, mmds::TOO_LARGE);
    assert!(
        error.message.contains("limit of 48 bytes"),
        "{}",
        error.message
    );
    assert_eq!(
        controller.pre_boot(VmmAction::GetMmds).0,
        Ok(VmmData::Json(stored))
    );

    // The configuration names configured interfaces only, each unknown one named.
    let error = controller.pre_boot(mmds_config(&["eth0"])).0.unwrap_err();
    assert_eq!(error.status, 400);
    assert!(
        error
            .message
            .contains("no network interface [\"eth0\"] is configured"),
        "{}",
        error.message
    );
    assert!(controller.mmds.config().is_none());
    let net = gpuvm_virtio::net::NetConfig::new("eth0", Some("tap0"));
    let configured = controller.pre_boot(VmmAction::PutNetworkInterface(net)).0;
    assert_eq!(configured, Ok(VmmData::Empty));
    let error = controller
        .pre_boot(mmds_config(&["eth0", "eth1"]))
        .0
        .unwrap_err();
    assert!(error.message.contains("[\"eth1\"]"), "{}", error.message);
    let empty = controller.pre_boot(mmds_config(&[])).0.unwrap_err();
    assert!(
        empty.message.starts_with("mmds-config.network_interfaces:"),
        "{}",
        empty.message
    );
    let mut routable =
        gpuvm_mmds::MmdsConfig::new(gpuvm_mmds::MmdsVersion::V1, vec!["eth0".into()]);
    routable.ipv4_address = std::net::Ipv4Addr::new(10, 0, 0, 1);
    let error = controller
        .pre_boot(VmmAction::PutMmdsConfig(routable))
        .0
        .unwrap_err();
    assert_eq!(error.status, 400);
    assert!(
        error.message.starts_with("mmds-config.ipv4_address:"),
        "{}",
        error.message
    );
    assert!(controller.mmds.config().is_none());
    // Accepted, and its body recorded for GET /vm/config.
    let body = json!({"version": "V2", "network_interfaces": ["eth0"]});
    let recorded = VmmAction::Recorded {
        action: Box::new(mmds_config(&["eth0"])),
        entry: crate::action::ClientDevice {
            client_id: "mmds-config".into(),
            device_id: "mmds-config".into(),
            section: "mmds-config".into(),
            body: body.clone(),
        },
    };
    assert_eq!(controller.pre_boot(recorded).0, Ok(VmmData::Empty));
    let VmmData::Json(info) = controller.pre_boot(VmmAction::GetInstanceInfo).0.unwrap() else {
        panic!("no instance info")
    };
    assert_eq!(info["client_record"]["devices"][0]["body"], body);
    let config = controller.mmds.config().expect("configured");
    assert_eq!(config.version, gpuvm_mmds::MmdsVersion::V2);

    // The interfaces InstanceStart and a snapshot load build get this VM's MMDS, which
    // answers on eth0.
    let pci = controller.pci_options();
    let given = pci
        .device_resources
        .mmds()
        .expect("MMDS given to the interfaces");
    assert!(Arc::ptr_eq(given, &controller.mmds));
    assert!(given.stack_for("eth0").is_some());
    assert!(given.stack_for("eth1").is_none());

    // Once started (loaded, paused or running): Firecracker's refusal; the store stays
    // open.
    let error = mmds::act(
        &controller.mmds,
        mmds_config(&["eth0"]),
        mmds::Stage::Started,
    )
    .unwrap_err();
    assert_eq!(
        error.message,
        "The requested operation is not supported after starting the microVM."
    );
    let put = VmmAction::PutMmds(json!({"after": "start"}));
    assert_eq!(
        mmds::act(&controller.mmds, put, mmds::Stage::Started),
        Ok(VmmData::Empty)
    );
    // Another VM's controller has an MMDS of its own.
    assert_eq!(
        crate::controller::tests::controller()
            .pre_boot(VmmAction::GetMmds)
            .0,
        Ok(VmmData::Json(json!({})))
    );
}
