//! virtio-net over Linux taps.
//!
//! - [`config`]: [`NetConfig`] (what the VMM's configuration says about an interface) and
//!   [`MacAddr`].
//! - [`tap`]: [`Tap`], one queue of a tap, opened by name or taken as a passed descriptor.
//! - [`fd_passing`]: [`recv_with_fds`], descriptors passed over a Unix socket (SCM_RIGHTS),
//!   for an API that takes taps opened by a container runtime.
//! - `datapath`: frames between a tap and a virtqueue pair (zero-copy readv/writev),
//!   [`NetStats`] counters.
//! - `handler`: the I/O thread's state and event dispatch, the control queue.
//! - [`device`]: [`Net`], the [`crate::VirtioDevice`].
//!
//! Wiring in the VMM: for each interface, `Net::open(config)` (taps by `host_dev_name`) or
//! `Net::new(config, taps)` with taps from [`Tap::from_fd`] on descriptors received by
//! [`recv_with_fds`]; put it behind the virtio-pci transport; read [`Net::stats`] for
//! metrics and call [`Net::update_rate_limiters`] for a PATCH. On restore, build the device
//! from the same configuration and fresh taps, then `restore_state`.
//!
//! Multiqueue: with `num_queue_pairs` > 1 the device offers VIRTIO_NET_F_MQ together with
//! VIRTIO_NET_F_CTRL_VQ (the spec requires it) and serves VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET
//! on the control queue, attaching and detaching tap queues (TUNSETQUEUE) to match; every
//! other control command is answered VIRTIO_NET_ERR, since no feature that would allow one
//! is offered. All pairs are served by one I/O thread.

pub mod config;
pub(crate) mod datapath;
pub mod device;
pub mod fd_passing;
pub(crate) mod handler;
pub mod tap;

#[cfg(test)]
mod tap_tests;
#[cfg(test)]
mod test_util;

pub use config::{MacAddr, MacAddrError, NetConfig, NetConfigError};
pub use datapath::{NetCounters, NetStats, MAX_FRAME_LEN};
pub use device::{Net, NetState, NetStateError};
pub use fd_passing::recv_with_fds;
pub use tap::{Tap, TapError};

use virtio_bindings::virtio_net::virtio_net_hdr_v1;

/// The header in front of every frame, on the tap and in the virtqueues:
/// virtio_net_hdr_v1 (num_buffers always present with VIRTIO_F_VERSION_1), 12 bytes.
pub const VNET_HDR_LEN: usize = std::mem::size_of::<virtio_net_hdr_v1>();

/// Why a virtio-net device could not be made or changed.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error(transparent)]
    Config(#[from] NetConfigError),
    #[error(transparent)]
    Tap(#[from] TapError),
    #[error("net {iface_id}: {expected} queue pairs need {expected} tap queues, got {given}")]
    TapCount {
        iface_id: String,
        expected: u16,
        given: usize,
    },
    #[error("net {iface_id}: no host_dev_name to open a tap by, and no tap descriptors given")]
    NoTapName { iface_id: String },
    #[error(transparent)]
    RateLimiter(#[from] crate::rate_limiter::RateLimiterError),
    #[error("{0}: its I/O thread died and took its taps; re-add the device")]
    Broken(String),
    #[error("virtio-net: cannot start its I/O thread: {0}")]
    Thread(#[source] crate::worker::WorkerError),
    #[error("net {iface_id}: cannot duplicate a tap queue's descriptor: {source}")]
    Duplicate {
        iface_id: String,
        source: std::io::Error,
    },
}
