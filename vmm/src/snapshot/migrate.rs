//! Older state formats, rewritten into the current one as they are read: each step takes
//! the payload of one version (as JSON) to the next. [`crate::persist`] runs the steps
//! from the version in a file's header up to [`crate::persist::STATE_FORMAT_VERSION`].
//!
//! Version 1 → 2: a virtio device's own state (`virtio[i].transport.device`) was untyped
//! JSON whose kind only the device's configuration told; version 2 tags it with its kind
//! (`{"block": {...}}`), the variant of `gpuvm_virtio::DeviceState`. Fields version 2
//! added (the rate limiters' buckets) are absent and take their defaults: a version-1
//! file's buckets restore full, as version 1 restored them.

use serde_json::Value;

/// Why a state file of an older version could not be rewritten.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MigrationError {
    #[error("its {what} is not a JSON {expected}")]
    Shape {
        what: String,
        expected: &'static str,
    },
    #[error("virtio device {index} has a configuration of no known kind ({kind})")]
    UnknownKind { index: usize, kind: String },
    #[error("virtio device {index} ({kind}) has no device state")]
    NoDeviceState { index: usize, kind: String },
    #[error("virtio device {index} is a vhost-user device ({kind}), which version 1 never saved")]
    VhostUser { index: usize, kind: String },
}

/// Rewrites `payload` of format `version` into format `version + 1`. Payloads that are
/// not a machine state (a working set shares the framing) have nothing the steps touch.
pub(crate) fn step(version: u32, payload: Value) -> Result<Value, MigrationError> {
    match version {
        1 => v1_to_v2(payload),
        _ => Ok(payload),
    }
}

fn v1_to_v2(mut payload: Value) -> Result<Value, MigrationError> {
    let Some(devices) = payload.get_mut("virtio") else {
        return Ok(payload);
    };
    let devices = devices.as_array_mut().ok_or(MigrationError::Shape {
        what: "virtio device list".into(),
        expected: "array",
    })?;
    for (index, device) in devices.iter_mut().enumerate() {
        let kind = config_kind(device, index)?;
        let tag = match kind.as_str() {
            "block" | "net" | "vsock" | "rng" | "balloon" => kind.clone(),
            "vhost_user_block" | "fs" | "vhost_user" => {
                return Err(MigrationError::VhostUser { index, kind })
            }
            _ => return Err(MigrationError::UnknownKind { index, kind }),
        };
        let transport = device
            .get_mut("transport")
            .and_then(Value::as_object_mut)
            .ok_or_else(|| MigrationError::Shape {
                what: format!("virtio device {index}'s transport"),
                expected: "object",
            })?;
        let state = transport
            .remove("device")
            .filter(|state| state.is_object())
            .ok_or(MigrationError::NoDeviceState { index, kind })?;
        let mut tagged = serde_json::Map::new();
        tagged.insert(tag, state);
        transport.insert("device".into(), Value::Object(tagged));
    }
    Ok(payload)
}

/// The kind of device entry `index` is: the one key of its `config`.
fn config_kind(device: &Value, index: usize) -> Result<String, MigrationError> {
    let config = device
        .get("config")
        .and_then(Value::as_object)
        .ok_or_else(|| MigrationError::Shape {
            what: format!("virtio device {index}'s configuration"),
            expected: "object",
        })?;
    let mut keys = config.keys();
    match (keys.next(), keys.next()) {
        (Some(kind), None) => Ok(kind.clone()),
        _ => Err(MigrationError::Shape {
            what: format!("virtio device {index}'s configuration"),
            expected: "object of one kind",
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn v1_device(config: Value, device: Value) -> Value {
        json!({"config": config, "pci_segment": 0, "transport": {"isr": 0, "device": device}})
    }

    #[test]
    fn v1_device_states_are_tagged_with_their_kind() {
        let payload = json!({
            "config": {"vcpus": 1},
            "virtio": [
                v1_device(json!({"block": {"drive_id": "root"}}), json!({"capacity_sectors": 128})),
                v1_device(json!({"vsock": {"guest_cid": 3}}), json!({"guest_cid": 3})),
                v1_device(json!({"rng": {}}), json!({"rate_limiter": {}})),
            ],
        });
        let migrated = step(1, payload).unwrap();
        let devices = migrated["virtio"].as_array().unwrap();
        assert_eq!(
            devices[0]["transport"]["device"],
            json!({"block": {"capacity_sectors": 128}})
        );
        assert_eq!(devices[0]["transport"]["isr"], 0);
        assert_eq!(
            devices[1]["transport"]["device"],
            json!({"vsock": {"guest_cid": 3}})
        );
        assert_eq!(
            devices[2]["transport"]["device"],
            json!({"rng": {"rate_limiter": {}}})
        );
        assert_eq!(migrated["config"], json!({"vcpus": 1}));
    }

    #[test]
    fn payloads_without_virtio_devices_pass_unchanged() {
        let working_set = json!({"memory_file_id": "x", "block_size": 2, "blocks": [1]});
        assert_eq!(step(1, working_set.clone()).unwrap(), working_set);
        let no_devices = json!({"config": {}, "virtio": []});
        assert_eq!(step(1, no_devices.clone()).unwrap(), no_devices);
    }

    #[test]
    fn damaged_v1_entries_are_refused_naming_the_device() {
        let cases = [
            (json!({"virtio": {}}), "virtio device list"),
            (
                json!({"virtio": [{"transport": {}}]}),
                "device 0's configuration",
            ),
            (
                json!({"virtio": [v1_device(json!({"block": {}, "net": {}}), json!({}))]}),
                "of one kind",
            ),
            (
                json!({"virtio": [v1_device(json!({"gpu": {}}), json!({}))]}),
                "no known kind (gpu)",
            ),
            (
                json!({"virtio": [v1_device(json!({"fs": {}}), json!({}))]}),
                "never saved",
            ),
            (
                json!({"virtio": [v1_device(json!({"rng": {}}), Value::Null)]}),
                "no device state",
            ),
            (
                json!({"virtio": [{"config": {"rng": {}}, "transport": 3}]}),
                "transport",
            ),
        ];
        for (payload, needle) in cases {
            let error = step(1, payload).unwrap_err().to_string();
            assert!(error.contains(needle), "{needle}: {error}");
        }
    }
}
