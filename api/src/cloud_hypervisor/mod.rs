//! Cloud Hypervisor's REST API (`/api/v1/...`, its OpenAPI document
//! vmm/src/api/openapi/cloud-hypervisor.yaml), so Kata Containers' clh driver can drive
//! gpuvm. A thin front end like [`crate::routes`]: each request becomes gpuvm actions.
//!
//! - [`config`]: the VmConfig and device bodies, with Cloud Hypervisor's field names.
//! - [`validate`]: Cloud Hypervisor's own rules for a VmConfig, in one pass.
//! - [`translate`]: bodies → actions.
//! - [`routes`]: the routes, their status codes and state names.
//!
//! Cloud Hypervisor distinguishes "no VM" from "created, not booted"; gpuvm's controller
//! has one pre-boot state, so whether vm.create happened (and the VmConfig vm.info echoes)
//! is kept here, in a [`Session`] per API server.

pub mod config;
pub mod routes;
pub mod translate;
pub mod validate;

#[cfg(test)]
mod tests;

use std::sync::Mutex;

pub use routes::handle;

/// Where this API path prefix starts; everything under it is Cloud Hypervisor's.
pub const PREFIX: &str = "/api/v1/";

/// What vm.create left: the VmConfig as given (plus what vm.add-* added before boot).
#[derive(Default)]
pub struct Session {
    config: Mutex<Option<config::VmConfig>>,
}

impl Session {
    fn config(&self) -> std::sync::MutexGuard<'_, Option<config::VmConfig>> {
        self.config.lock().unwrap_or_else(|e| e.into_inner())
    }
}
