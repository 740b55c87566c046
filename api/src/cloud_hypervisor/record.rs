//! The VmConfig as the client gave it, kept by gpuvm's controller as a
//! [`ClientRecord`]: the document without its devices, and each device under its
//! section with the id the client knows it by. vm.create makes it; vm.add-* and
//! vm.remove-device change it; vm.info puts the document back together from it. A
//! snapshot keeps it, so a VM restored by vm.restore shows the same configuration and its
//! devices keep their ids, as Cloud Hypervisor's restore of its config.json does.

use serde_json::{json, Value};

use gpuvm_vmm::action::{ClientDevice, ClientRecord};

use super::config::VmConfig;

/// The sections of a VmConfig that hold devices, and whether each holds one (an
/// object) or several (an array).
pub const DEVICE_SECTIONS: &[(&str, bool)] = &[
    ("disks", false),
    ("net", false),
    ("fs", false),
    ("vsock", true),
    ("devices", false),
    ("user_devices", false),
];

/// The record of a VmConfig: each device with the id the translation gives it (the
/// client's, or Cloud Hypervisor's `_disk0`-style one) and the id gpuvm's actions name
/// it by.
pub fn of_config(config: &VmConfig) -> ClientRecord {
    let mut document = serde_json::to_value(config).unwrap_or(Value::Null);
    let mut devices = Vec::new();
    if let Value::Object(fields) = &mut document {
        for (section, _) in DEVICE_SECTIONS {
            let Some(value) = fields.remove(*section) else {
                continue;
            };
            let bodies = match value {
                Value::Array(items) => items,
                Value::Null => Vec::new(),
                single => vec![single],
            };
            for (index, body) in bodies.into_iter().enumerate() {
                let (client_id, device_id) = ids(section, index, &body);
                devices.push(ClientDevice {
                    client_id,
                    device_id,
                    section: section.to_string(),
                    body,
                });
            }
        }
    }
    ClientRecord { document, devices }
}

/// A configured device's ids as vm.create's translation names it: (the client's, gpuvm's).
fn ids(section: &str, index: usize, body: &Value) -> (String, String) {
    let own = body["id"].as_str().map(String::from);
    let named = |prefix: &str| own.clone().unwrap_or_else(|| format!("{prefix}{index}"));
    match section {
        "disks" => (named("_disk"), named("_disk")),
        "net" => (named("_net"), named("_net")),
        "devices" => (named("_vfio"), named("_vfio")),
        "user_devices" => (named("_user_device"), named("_user_device")),
        "fs" => {
            let tag = body["tag"].as_str().unwrap_or_default().to_string();
            (own.unwrap_or_else(|| tag.clone()), tag)
        }
        // The vsock device: gpuvm's actions call it `vsock`.
        _ => (own.unwrap_or_else(|| "vsock".into()), "vsock".into()),
    }
}

/// vm.info's `config`: the document with its devices back in their sections. A VM
/// without a document (restored from a snapshot written before snapshots kept the record,
/// or started through another front end) has its machine's sizes stand in (`machine` is
/// GET /machine-config's answer).
pub fn to_config(record: &ClientRecord, machine: Option<&Value>) -> Value {
    let mut document = match (&record.document, machine) {
        (Value::Object(_), _) => record.document.clone(),
        (_, Some(m)) => json!({
            "payload": {},
            "cpus": {
                "boot_vcpus": m["vcpu_count"],
                "max_vcpus": if m["max_vcpus"].is_null() { &m["vcpu_count"] } else { &m["max_vcpus"] },
            },
            "memory": {"size": m["mem_size_mib"].as_u64().unwrap_or(0) << 20},
        }),
        _ => json!({"payload": {}}),
    };
    // Sections as VmConfig writes them when empty.
    if let Value::Object(fields) = &mut document {
        for (section, single) in DEVICE_SECTIONS {
            if *section != "user_devices" {
                let empty = if *single { Value::Null } else { json!([]) };
                fields.entry(section.to_string()).or_insert(empty);
            }
        }
    }
    for device in &record.devices {
        let single = DEVICE_SECTIONS
            .iter()
            .any(|(section, single)| *section == device.section && *single);
        if single {
            document[&device.section] = device.body.clone();
            continue;
        }
        match &mut document[&device.section] {
            Value::Array(items) => items.push(device.body.clone()),
            slot => *slot = json!([device.body.clone()]),
        }
    }
    document
}

/// The VmConfig the record stands for (for Cloud Hypervisor's rules on a device added),
/// None when it does not parse as one (a restored VM's).
pub fn parsed(record: &ClientRecord) -> Option<VmConfig> {
    serde_json::from_value(to_config(record, None)).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_config_comes_back_with_its_devices_and_their_ids() {
        let config: VmConfig = serde_json::from_value(json!({
            "payload": {"kernel": "/k"},
            "disks": [{"path": "/a"}, {"path": "/b", "id": "data"}],
            "fs": [{"tag": "share", "socket": "/s"}],
            "vsock": {"cid": 3, "socket": "/v", "id": "vs"},
            "devices": [{"path": "/sys/bus/pci/devices/0000:41:00.0"}],
        }))
        .unwrap();
        let record = of_config(&config);
        let ids: Vec<(&str, &str)> = record
            .devices
            .iter()
            .map(|d| (d.client_id.as_str(), d.device_id.as_str()))
            .collect();
        assert_eq!(
            ids,
            [
                ("_disk0", "_disk0"),
                ("data", "data"),
                ("share", "share"),
                ("vs", "vsock"),
                ("_vfio0", "_vfio0")
            ]
        );
        assert!(record.document.get("disks").is_none());
        let back = to_config(&record, None);
        assert_eq!(back["disks"][1]["id"], "data");
        assert_eq!(back["vsock"]["cid"], 3);
        assert_eq!(back["payload"]["kernel"], "/k");
        assert!(parsed(&record).is_some());
    }

    #[test]
    fn a_restored_vm_shows_its_machine() {
        let record = ClientRecord::default();
        let machine = json!({"vcpu_count": 2, "mem_size_mib": 256, "max_vcpus": null});
        let config = to_config(&record, Some(&machine));
        assert_eq!(config["cpus"]["max_vcpus"], 2);
        assert_eq!(config["memory"]["size"], 256u64 << 20);
    }
}
