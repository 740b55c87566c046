//! The control API: HTTP/1.1 over a Unix socket, shaped like Firecracker's.
//!
//! - [`http`]: a strict, bounded request parser and response writer.
//! - [`action`]: [`action::VmmAction`], the one type between the HTTP layer and the VMM
//!   thread, and the JSON bodies of the routes.
//! - [`server`]: the API thread (accept, parse, route, hand over, answer).
//! - [`vmm`]: the VMM thread's side: pre-boot configuration, start/restore, and serving
//!   a running machine through [`crate::machine::RunControl`].
//! - [`client`]: a small client, for `gpuvm ctl`.

pub mod action;
pub mod client;
pub mod http;
pub mod server;
pub mod vmm;

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
    #[error(transparent)]
    Seccomp(#[from] crate::seccomp::SeccompError),
    #[error("cannot create the API eventfd: {0}")]
    EventFd(std::io::Error),
}
