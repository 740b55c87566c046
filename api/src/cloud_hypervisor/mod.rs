//! Cloud Hypervisor's REST API (`/api/v1/...`, its OpenAPI document
//! vmm/src/api/openapi/cloud-hypervisor.yaml), so Kata Containers' clh driver can drive
//! gpuvm. A thin front end like [`crate::routes`]: each request becomes gpuvm actions.
//!
//! - [`config`]: the VmConfig and device bodies, with Cloud Hypervisor's field names.
//! - [`validate`]: Cloud Hypervisor's own rules for a VmConfig, in one pass.
//! - [`translate`]: bodies → actions.
//! - [`routes`]: the routes, their status codes and state names.
//!
//! - [`record`]: the VmConfig as the client gave it, which gpuvm's controller keeps.
//!
//! What a request means (Cloud Hypervisor's Created state, device ids, configuring a
//! device or hot-plugging it, restores) is decided by gpuvm's controller
//! (vmm/src/controller/client.rs): this front end keeps no state of its own.

pub mod config;
pub mod record;
pub mod routes;
pub mod translate;
pub mod validate;

#[cfg(test)]
mod test_vmm;
#[cfg(test)]
mod tests;

pub use routes::handle;

/// Where this API path prefix starts; everything under it is Cloud Hypervisor's.
pub const PREFIX: &str = "/api/v1/";
