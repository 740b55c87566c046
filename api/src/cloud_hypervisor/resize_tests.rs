//! vm.resize and vm.resize-zone against a fake VMM thread, and `cpus.max_vcpus` reaching
//! the machine configuration.

use std::cell::RefCell;

use gpuvm_vmm::action::{ActionError, ActionResult, VmmAction, VmmData};
use serde_json::json;

use super::super::config::VmConfig;
use super::super::{translate, Session};
use super::handle;
use crate::http::{Method, Request, Response};

/// Answers as the controller would for a VM of 2 vCPUs (max 8) and 2 GiB; remembers
/// each resize.
struct Fake {
    state: RefCell<&'static str>,
    resizes: RefCell<Vec<(Option<u8>, Option<u64>)>>,
}

impl Fake {
    fn new() -> Self {
        Fake {
            state: RefCell::new("NotStarted"),
            resizes: RefCell::new(Vec::new()),
        }
    }

    fn act(&self, action: VmmAction) -> ActionResult {
        match action {
            VmmAction::GetInstanceInfo => Ok(VmmData::Json(json!({"state": *self.state.borrow()}))),
            VmmAction::StartInstance => {
                *self.state.borrow_mut() = "Running";
                Ok(VmmData::Empty)
            }
            VmmAction::Resize {
                desired_vcpus,
                desired_ram,
            } => {
                self.resizes.borrow_mut().push((desired_vcpus, desired_ram));
                match (desired_vcpus, desired_ram) {
                    (Some(0), _) => Err(ActionError::bad_request("desired_vcpus = 0")),
                    (Some(n), _) if n > 8 => Err(ActionError::bad_request("above max_vcpus")),
                    (_, Some(ram)) if ram != 2 << 30 => Err(ActionError::bad_request(
                        "no memory hot-plug (static_sandbox_resource_mgmt)",
                    )),
                    _ => Ok(VmmData::Empty),
                }
            }
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

fn kata_create(session: &Session, fake: &Fake) {
    let body = json!({
        "payload": {"kernel": "/opt/kata/vmlinux"},
        "cpus": {"boot_vcpus": 2, "max_vcpus": 8},
        "memory": {"size": 2u64 << 30},
    });
    let created = call(
        session,
        fake,
        Method::Put,
        "/api/v1/vm.create",
        &body.to_string(),
    );
    assert_eq!(created.status, 204);
}

fn info(session: &Session, fake: &Fake) -> serde_json::Value {
    let info = call(session, fake, Method::Get, "/api/v1/vm.info", "");
    serde_json::from_slice(&info.body).unwrap()
}

fn message(response: &Response) -> String {
    String::from_utf8_lossy(&response.body).into_owned()
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
/// vm.info's configuration shows the count asked for.
#[test]
fn kata_resize_at_sandbox_start_is_accepted() {
    let (session, fake) = (Session::default(), Fake::new());
    let early = call(
        &session,
        &fake,
        Method::Put,
        "/api/v1/vm.resize",
        r#"{"desired_vcpus":2}"#,
    );
    assert_eq!(early.status, 404, "{}", message(&early));
    kata_create(&session, &fake);
    assert_eq!(
        call(&session, &fake, Method::Put, "/api/v1/vm.boot", "").status,
        204
    );
    let resize = call(
        &session,
        &fake,
        Method::Put,
        "/api/v1/vm.resize",
        r#"{"desired_vcpus":2}"#,
    );
    assert_eq!(resize.status, 204, "{}", message(&resize));
    let grown = call(
        &session,
        &fake,
        Method::Put,
        "/api/v1/vm.resize",
        r#"{"desired_vcpus":4,"desired_ram":null,"desired_balloon":null}"#,
    );
    assert_eq!(grown.status, 204, "{}", message(&grown));
    assert_eq!(info(&session, &fake)["config"]["cpus"]["boot_vcpus"], 4);
    assert_eq!(info(&session, &fake)["config"]["cpus"]["max_vcpus"], 8);
    assert_eq!(*fake.resizes.borrow(), [(Some(2), None), (Some(4), None)]);
    assert_eq!(
        call(&session, &fake, Method::Get, "/api/v1/vm.resize", "").status,
        405
    );
}

/// Refusals keep the VM (and vm.info's configuration) as it was.
#[test]
fn bad_resizes_are_refused_with_the_vm_unchanged() {
    let (session, fake) = (Session::default(), Fake::new());
    kata_create(&session, &fake);
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
        let answer = call(&session, &fake, Method::Put, "/api/v1/vm.resize", body);
        assert_eq!(answer.status, status, "{body}: {}", message(&answer));
        assert!(
            message(&answer).contains(says),
            "{body}: {}",
            message(&answer)
        );
    }
    assert_eq!(info(&session, &fake)["config"]["cpus"]["boot_vcpus"], 2);
    // The same RAM is no change.
    let same = call(
        &session,
        &fake,
        Method::Put,
        "/api/v1/vm.resize",
        r#"{"desired_ram":2147483648}"#,
    );
    assert_eq!(same.status, 204, "{}", message(&same));
}

#[test]
fn resize_zone_is_refused_naming_the_kata_setting() {
    let (session, fake) = (Session::default(), Fake::new());
    kata_create(&session, &fake);
    let answer = call(
        &session,
        &fake,
        Method::Put,
        "/api/v1/vm.resize-zone",
        r#"{"id":"mem0","desired_ram":4294967296}"#,
    );
    assert_eq!(answer.status, 400);
    assert!(message(&answer).contains("static_sandbox_resource_mgmt"));
    assert!(fake.resizes.borrow().is_empty());
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
