//! vm.resize and vm.resize-zone against a fake VMM thread, and `cpus.max_vcpus` reaching
//! the machine configuration.

use gpuvm_vmm::action::VmmAction;
use serde_json::json;

use super::super::config::VmConfig;
use super::super::test_vmm::{call, controller, files, json_of, message, Booted, Files};
use super::super::{record, translate};
use crate::http::Method;

/// Kata's vm.create body for a VM of 2 vCPUs (up to 8) and 2 GiB.
fn kata_body(files: &Files) -> serde_json::Value {
    json!({
        "payload": {"kernel": files.kernel},
        "cpus": {"boot_vcpus": 2, "max_vcpus": 8},
        "memory": {"size": 2u64 << 30},
    })
}

/// A booted VM made from Kata's body.
fn booted(files: &Files) -> Booted {
    let config: VmConfig = serde_json::from_value(kata_body(files)).unwrap();
    Booted::new(record::of_config(&config))
}

#[test]
fn max_vcpus_reaches_the_machine_configuration() {
    let config: VmConfig = serde_json::from_value(json!({
        "payload": {"kernel": "/k"},
        "cpus": {"boot_vcpus": 2, "max_vcpus": 8},
    }))
    .unwrap();
    let actions = translate::vm_config(&config).unwrap();
    assert!(
        matches!(&actions[0], VmmAction::PutMachineConfig(m)
            if m.vcpu_count == 2 && m.max_vcpus == Some(8)),
        "{:?}",
        actions[0]
    );
    // No hot-plug asked for: no maximum of its own.
    let config: VmConfig = serde_json::from_value(json!({
        "payload": {"kernel": "/k"},
        "cpus": {"boot_vcpus": 2, "max_vcpus": 2},
    }))
    .unwrap();
    let actions = translate::vm_config(&config).unwrap();
    assert!(matches!(&actions[0], VmmAction::PutMachineConfig(m) if m.max_vcpus.is_none()));
}

/// Kata's call at sandbox start: vm.resize to the count the VM already has is 204, and
/// vm.info's configuration shows the count the VM has after a resize.
#[test]
fn kata_resize_at_sandbox_start_is_accepted() {
    let (vmm, files) = (controller(), files());
    let dispatch = &|action| vmm.dispatch(action);
    let early = call(
        dispatch,
        Method::Put,
        "/api/v1/vm.resize",
        r#"{"desired_vcpus":2}"#,
    );
    assert_eq!(early.status, 404, "{}", message(&early));
    let body = kata_body(&files).to_string();
    assert_eq!(
        call(dispatch, Method::Put, "/api/v1/vm.create", &body).status,
        204
    );
    let before_boot = call(
        dispatch,
        Method::Put,
        "/api/v1/vm.resize",
        r#"{"desired_vcpus":2}"#,
    );
    assert_eq!(before_boot.status, 204, "{}", message(&before_boot));

    let vm = booted(&files);
    let dispatch = &|action| vm.act(action);
    let resize = call(
        dispatch,
        Method::Put,
        "/api/v1/vm.resize",
        r#"{"desired_vcpus":2}"#,
    );
    assert_eq!(resize.status, 204, "{}", message(&resize));
    let grown = call(
        dispatch,
        Method::Put,
        "/api/v1/vm.resize",
        r#"{"desired_vcpus":4,"desired_ram":null,"desired_balloon":null}"#,
    );
    assert_eq!(grown.status, 204, "{}", message(&grown));
    let info = json_of(&call(dispatch, Method::Get, "/api/v1/vm.info", ""));
    assert_eq!(info["config"]["cpus"]["boot_vcpus"], 4);
    assert_eq!(info["config"]["cpus"]["max_vcpus"], 8);
    assert_eq!(*vm.resizes.borrow(), [(Some(2), None), (Some(4), None)]);
    assert_eq!(
        call(dispatch, Method::Get, "/api/v1/vm.resize", "").status,
        405
    );
}

/// Refusals keep the VM (and vm.info's configuration) as it was.
#[test]
fn bad_resizes_are_refused_with_the_vm_unchanged() {
    let files = files();
    let vm = booted(&files);
    let dispatch = &|action| vm.act(action);
    for (body, status, says) in [
        (r#"{"desired_vcpus":0}"#, 400, "desired_vcpus = 0"),
        (r#"{"desired_vcpus":9}"#, 400, "max_vcpus"),
        (r#"{"desired_vcpus":300}"#, 400, "1 to 255"),
        (r#"{"desired_vcpus":-1}"#, 400, "invalid JSON"),
        (
            r#"{"desired_ram":4294967296}"#,
            400,
            "static_sandbox_resource_mgmt",
        ),
        (r#"{"desired_balloon":1048576}"#, 400, "desired_balloon"),
        (r#"{}"#, 400, "desired_vcpus or desired_ram"),
        (r#"{"desired_vcpus":2,"cpus":1}"#, 400, "cpus"),
        ("", 400, "JSON body"),
    ] {
        let answer = call(dispatch, Method::Put, "/api/v1/vm.resize", body);
        assert_eq!(answer.status, status, "{body}: {}", message(&answer));
        assert!(
            message(&answer).contains(says),
            "{body}: {}",
            message(&answer)
        );
    }
    let info = json_of(&call(dispatch, Method::Get, "/api/v1/vm.info", ""));
    assert_eq!(info["config"]["cpus"]["boot_vcpus"], 2);
    // The same RAM is no change.
    let same = call(
        dispatch,
        Method::Put,
        "/api/v1/vm.resize",
        r#"{"desired_ram":2147483648}"#,
    );
    assert_eq!(same.status, 204, "{}", message(&same));
}

#[test]
fn resize_zone_is_refused_naming_the_kata_setting() {
    let files = files();
    let vm = booted(&files);
    let answer = call(
        &|action| vm.act(action),
        Method::Put,
        "/api/v1/vm.resize-zone",
        r#"{"id":"mem0","desired_ram":4294967296}"#,
    );
    assert_eq!(answer.status, 400);
    assert!(message(&answer).contains("static_sandbox_resource_mgmt"));
    assert!(vm.resizes.borrow().is_empty());
}

/// `memory.hotplug_size` (ACPI, Cloud Hypervisor's default method) is the room for
/// vm.resize's RAM, rounded up to whole memory blocks; virtio-mem is refused by name.
#[test]
fn hotplug_size_reaches_the_machine_configuration() {
    let machine = |memory: serde_json::Value| {
        let config: VmConfig = serde_json::from_value(json!({
            "payload": {"kernel": "/k"}, "memory": memory,
        }))
        .unwrap();
        translate::machine(None, config.memory.as_ref())
    };
    let hotplug_of = |memory| match machine(memory) {
        Ok(VmmAction::PutMachineConfig(body)) => body.ram_hotplug_size,
        other => panic!("{other:?}"),
    };
    let gib = 1u64 << 30;
    assert_eq!(
        hotplug_of(json!({"size": gib, "hotplug_size": 8 * gib, "hotplug_method": "Acpi"})),
        Some(8 * gib)
    );
    // Kata's default_maxmemory is the host's RAM in MiB: rounded up to 128 MiB blocks.
    assert_eq!(
        hotplug_of(json!({"size": gib, "hotplug_size": 24001u64 << 20})),
        Some(24064 << 20)
    );
    assert_eq!(hotplug_of(json!({"size": gib})), None);
    assert_eq!(hotplug_of(json!({"size": gib, "hotplug_size": 0})), None);
    let refused = machine(json!({"size": gib, "hotplug_size": gib, "hotplug_method": "VirtioMem"}))
        .unwrap_err();
    assert!(
        refused.contains("hotplug_method") && refused.contains("ACPI"),
        "{refused}"
    );
    assert!(machine(json!({"size": gib, "hotplug_method": "Dimm"})).is_err());
    assert!(machine(json!({"size": gib, "hotplug_size": u64::MAX})).is_err());
}
