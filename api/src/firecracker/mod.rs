//! Firecracker's API (its OpenAPI document src/firecracker/swagger/firecracker.yaml), served
//! on the whole socket when gpuvm runs as `firecracker` (or `--fc-compat`), so clients
//! written for Firecracker drive gpuvm unchanged. A thin front end like [`crate::routes`]:
//! each request becomes gpuvm actions; gpuvm's own routes answer where Firecracker's path
//! and meaning are the same (drives, network interfaces, vsock, entropy, PATCH /vm, and
//! gpuvm's extensions such as /gpus/{id}).
//!
//! - [`validate`]: Firecracker's rules for each body and config-file section, one pass
//!   that names every refused value by its field path.
//! - [`translate`]: Firecracker's bodies → gpuvm's actions (pure, unit-tested).
//! - [`routes`]: the routes, Firecracker's status codes (204 for every successful PUT and
//!   PATCH, 400 for every refusal) and its GET / shape.

pub mod routes;
pub mod translate;
pub mod validate;

#[cfg(test)]
mod tests;

use std::path::PathBuf;

pub use routes::handle;

/// The Firecracker API version whose document this front end follows (GET /version).
pub const FIRECRACKER_API_VERSION: &str = "1.17.0";

/// The MMDS data store's limit without `--mmds-size-limit`: Firecracker's default HTTP
/// payload limit, which is its default for MMDS too.
pub const DEFAULT_MMDS_SIZE_LIMIT: usize = gpuvm_mmds::DEFAULT_SIZE_LIMIT;

/// What this front end knows of its process: the instance id and the directory relative
/// paths resolve against. The bodies GET /vm/config echoes are kept by the controller
/// (the client's record).
pub struct Session {
    pub id: String,
    /// gpuvm's working directory when it started (gpuvm never changes it, so it is the
    /// one at the time of each request, as Firecracker resolves them).
    pub cwd: PathBuf,
}

impl Session {
    pub fn new(id: impl Into<String>) -> Session {
        Session {
            id: id.into(),
            cwd: std::env::current_dir().unwrap_or_else(|_| PathBuf::from("/")),
        }
    }
}

/// The sections of Firecracker's configuration that are lists (by id).
pub(crate) const LIST_SECTIONS: &[&str] = &["drives", "network-interfaces"];

/// One body of Firecracker's configuration as the controller keeps it: `section`, and
/// for the lists the item's id.
pub(crate) fn record_entry(
    section: &str,
    id: Option<&str>,
    body: serde_json::Value,
) -> gpuvm_vmm::action::ClientDevice {
    let id = id.unwrap_or(section).to_string();
    gpuvm_vmm::action::ClientDevice {
        client_id: id.clone(),
        device_id: id,
        section: section.to_string(),
        body,
    }
}

/// The record of a `--config-file`'s sections for GET /vm/config, as if each had come
/// through its route (`null` sections and machine-config, which the controller reports
/// itself, are left out): sent to the controller as [`gpuvm_vmm::action::VmmAction::Remember`].
pub fn config_file_record(json: &serde_json::Value) -> Vec<gpuvm_vmm::action::ClientDevice> {
    let Some(sections) = json.as_object() else {
        return Vec::new();
    };
    let mut entries = Vec::new();
    for (section, value) in sections {
        if value.is_null() || section == "machine-config" {
            continue;
        }
        match (LIST_SECTIONS.contains(&section.as_str()), value) {
            (true, serde_json::Value::Array(items)) => {
                let id_field = if section == "drives" {
                    "drive_id"
                } else {
                    "iface_id"
                };
                entries.extend(
                    items
                        .iter()
                        .map(|item| record_entry(section, item[id_field].as_str(), item.clone())),
                );
            }
            _ => entries.push(record_entry(section, None, value.clone())),
        }
    }
    entries
}
