//! gpuvm's control API: HTTP/1.1 over a Unix socket, shaped like Firecracker's. A thin
//! front end: every request becomes one [`gpuvm_vmm::action::VmmAction`], which the VMM
//! thread's [`gpuvm_vmm::controller::ApiController`] carries out.
//!
//! - [`http`]: a strict, bounded request parser and response writer.
//! - [`routes`]: gpuvm's own routes, each a translation onto one action.
//! - [`server`]: the API thread (accept, bounded connection slots, parse, route, hand
//!   the action to the VMM thread, answer).
//! - [`cloud_hypervisor`]: Cloud Hypervisor's API under `/api/v1/` (for Kata's clh
//!   driver), on the same actions.
//! - [`firecracker`]: Firecracker's API on every path when gpuvm runs as `firecracker`
//!   (chosen at startup), on the same actions.
//! - [`client`]: a small client, for `gpuvm ctl` and the tests.
//! - The OpenAPI document of the routes is api/openapi.json.

pub mod client;
pub mod cloud_hypervisor;
pub mod firecracker;
pub mod http;
pub mod routes;
pub mod server;

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("cannot listen on API socket {path}: {source}")]
    Bind {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("API socket path {0} exists and is not a socket")]
    PathTaken(PathBuf),
    #[error("cannot start the API thread: {0}")]
    Spawn(std::io::Error),
    #[error("cannot make the eventfd that pauses the API's accept loop: {0}")]
    EventFd(std::io::Error),
    #[error(transparent)]
    Seccomp(#[from] gpuvm_vmm::seccomp::SeccompError),
}
