//! virtio-rng, the entropy device (virtio 1.x section 5.4): one queue of device-writable
//! buffers that the device fills with random bytes from the host.
//!
//! The bytes come from getrandom(2) by default, or from a file opened at construction
//! (/dev/urandom, or a regular file of entropy: at its end requests are answered with 0
//! bytes, never a hang). A [`RateLimiter`](crate::rate_limiter::RateLimiter) bounds bytes and
//! requests; while it waits for tokens the worker stops taking requests and waits for the
//! limiter's timer.
//!
//! - `source`: where the bytes come from, and the backend that outlives an activation (the
//!   source and the limiter).
//! - `handler`: the worker thread's side: pops the queue, charges the limiter, fills buffers.
//! - [`device`]: [`Rng`], the [`VirtioDevice`](crate::VirtioDevice).
//!
//! Wiring in the VMM: `Rng::new(RngConfig)` at build time, then hand it to the virtio-pci
//! transport like any [`VirtioDevice`](crate::VirtioDevice); [`Rng::update_rate_limiter`]
//! changes the limits of a running device (PATCH).

pub mod device;
mod handler;
mod source;

#[cfg(test)]
mod tests;

use std::path::PathBuf;

pub use device::{Rng, RngState, RngStateError};

use crate::rate_limiter::{RateLimiterConfig, RateLimiterError};
use crate::worker::WorkerError;

const DEVICE_NAME: &str = "virtio-rng";
/// The worker thread's name (at most 15 bytes show in /proc).
const THREAD_NAME: &str = "virtio-rng";
pub const QUEUE_MAX_SIZE: u16 = 256;
/// The most bytes one request gets, however big its buffers: bounds the work (and the host
/// buffer) per request. Drivers ask again for more.
pub const MAX_REQUEST_BYTES: usize = 64 * 1024;

/// How the entropy device is built.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RngConfig {
    /// A file to read entropy from (a character device such as /dev/urandom, or a regular
    /// file); getrandom(2) when left out.
    #[serde(default)]
    pub source: Option<PathBuf>,
    #[serde(default)]
    pub rate_limiter: RateLimiterConfig,
}

/// Why the entropy device could not be built or changed.
#[derive(Debug, thiserror::Error)]
pub enum RngError {
    #[error("entropy source {}: cannot open it for reading: {source}", path.display())]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("entropy source {} is a directory", path.display())]
    Directory { path: PathBuf },
    #[error("entropy source {} is a {kind}: reading it could block the device; use a character device such as /dev/urandom or a regular file", path.display())]
    WouldBlock { path: PathBuf, kind: &'static str },
    #[error(transparent)]
    RateLimiter(#[from] RateLimiterError),
    #[error("virtio-rng: cannot restart its I/O thread: {0}")]
    Thread(#[source] WorkerError),
}
