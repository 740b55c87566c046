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
use std::sync::Mutex;

pub use routes::handle;

/// The Firecracker API version whose document this front end follows (GET /version).
pub const FIRECRACKER_API_VERSION: &str = "1.17.0";

/// The MMDS data store's limit without `--mmds-size-limit`: Firecracker's default HTTP
/// payload limit, which is its default for MMDS too.
pub const DEFAULT_MMDS_SIZE_LIMIT: usize = gpuvm_mmds::DEFAULT_SIZE_LIMIT;

/// `--mmds-size-limit`: PUT and PATCH /mmds that would make the store larger are refused
/// (413, as Firecracker does).
pub fn set_mmds_size_limit(bytes: usize) {
    gpuvm_mmds::shared().store().set_limit(bytes);
}

/// A `--config-file`'s `mmds-config`, checked by [`translate::config_file`]: it takes
/// effect as `PUT /mmds/config`'s does, before the start.
pub fn set_mmds_config(config: gpuvm_mmds::MmdsConfig) {
    gpuvm_mmds::shared().set_config(Some(config));
}

/// What this front end remembers between requests: the instance id, the directory
/// relative paths resolve against, and the bodies GET /vm/config echoes.
pub struct Session {
    pub id: String,
    /// gpuvm's working directory when it started (gpuvm never changes it, so it is the
    /// one at the time of each request, as Firecracker resolves them).
    pub cwd: PathBuf,
    pub(crate) config: Mutex<serde_json::Map<String, serde_json::Value>>,
}

impl Session {
    pub fn new(id: impl Into<String>) -> Session {
        Session {
            id: id.into(),
            cwd: std::env::current_dir().unwrap_or_else(|_| PathBuf::from("/")),
            config: Mutex::new(serde_json::Map::new()),
        }
    }

    /// Remembers the sections of a `--config-file` for GET /vm/config, as if each had
    /// come through its route (`null` sections are left out).
    pub fn remember_config_file(&self, json: &serde_json::Value) {
        let Some(sections) = json.as_object() else {
            return;
        };
        let mut config = self.config();
        for (key, value) in sections {
            if !value.is_null() && key != "machine-config" {
                config.insert(key.clone(), value.clone());
            }
        }
    }

    pub(crate) fn config(
        &self,
    ) -> std::sync::MutexGuard<'_, serde_json::Map<String, serde_json::Value>> {
        self.config.lock().unwrap_or_else(|e| e.into_inner())
    }
}
