//! vhost-user devices: virtio devices whose queues an external backend process serves
//! (virtiofsd for virtio-fs, qemu-storage-daemon for virtio-blk), over a Unix socket
//! with rust-vmm's `vhost` crate on the frontend side.
//!
//! - [`VhostUserBlock`] (device type 2) and [`VhostUserFs`] (device type 26) are
//!   [`VirtioDevice`](crate::VirtioDevice)s like the built-in ones; the VMM builds one from
//!   its config ([`VhostUserBlockConfig`], [`FsConfig`]) and puts it behind a
//!   [`VirtioPciDevice`](crate::transport::VirtioPciDevice).
//! - [`VhostUserGeneric`] is any other virtio device type a backend implements
//!   ([`VhostUserConfig`], `--vhost-user type=ID,socket=S`): the backend's device-specific
//!   features and GET_CONFIG answer go to the guest unchanged; types gpuvm must own
//!   (balloons, IOMMU, virtio-mem) or cannot pass (GPU, pmem: shared memory) are refused.
//! - Construction connects to the backend and negotiates (GET/SET_PROTOCOL_FEATURES,
//!   GET_QUEUE_NUM, SET_OWNER, GET_CONFIG for blk). When the driver sets DRIVER_OK the
//!   device's I/O thread sends SET_FEATURES, SET_MEM_TABLE (each guest RAM region's memfd and
//!   offset: the backend maps guest RAM itself, nothing is copied) and per queue
//!   SET_VRING_NUM/ADDR/BASE/KICK/CALL/ENABLE. Reset and pause stop the rings with
//!   SET_VRING_ENABLE 0 and GET_VRING_BASE.
//! - Kicks: the transport's kick eventfds (KVM ioeventfds) go to the backend directly, so a
//!   guest notification reaches it without gpuvm. Interrupts take one extra hop: the
//!   backend signals a per-queue call eventfd that gpuvm owns, and the device's I/O thread
//!   (`relay`) turns that into [`VirtioInterrupt::signal_queue`](crate::VirtioInterrupt)
//!   (the transport decides the MSI-X vector, masking and the ISR bit, which an irqfd
//!   handed to the backend would bypass).
//! - Every reply is awaited for at most [`Timeouts::reply`]: the vhost crate retries a
//!   timed-out `recvmsg` forever, so a process-wide watchdog thread (`watchdog`) shuts the socket
//!   down when a reply is late, which ends the wait with an error. A backend that never
//!   answers, dies or closes its socket marks the device broken (logged once,
//!   [`VhostUserBlock::is_broken`]): the guest's requests go unanswered, as with a hung
//!   disk, and gpuvm carries on. There is no reconnection.
//! - Snapshots are refused: a vhost-user device's state lives in its backend, and the
//!   DEVICE_STATE transfer is not implemented. The VMM asks each device's
//!   `snapshot_refusal()` before pausing for a snapshot.
//! - No DAX window for virtio-fs, no backend-initiated requests (BACKEND_REQ), no
//!   inflight tracking.

mod block;
mod connection;
mod fs;
mod generic;
mod lifecycle;
mod relay;
mod watchdog;

#[cfg(test)]
mod test_util;
#[cfg(test)]
mod tests_blk;
#[cfg(test)]
mod tests_fs;
#[cfg(test)]
mod tests_peers;

use std::path::PathBuf;
use std::time::Duration;

pub use block::{VhostUserBlock, VhostUserBlockConfig};
pub use connection::{Negotiated, Timeouts};
pub use fs::{FsConfig, VhostUserFs, FS_TAG_BYTES};
pub use generic::{VhostUserConfig, VhostUserGeneric};
pub use lifecycle::{
    VhostUserDevice, VhostUserKind, VhostUserLive, VhostUserState, VhostUserStateError,
};

/// Why a vhost-user device could not be built or talk to its backend.
#[derive(Debug, thiserror::Error)]
pub enum VhostUserError {
    #[error("{device}: {reason}")]
    Config { device: String, reason: String },
    #[error("cannot connect to the vhost-user backend at {}: {source}", socket.display())]
    Connect {
        socket: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "no vhost-user backend accepted a connection at {} within {waited:?} (last error: {last})",
        socket.display()
    )]
    ConnectTimeout {
        socket: PathBuf,
        waited: Duration,
        last: std::io::Error,
    },
    #[error(
        "the vhost-user backend at {} did not answer {request} within {waited:?}; the connection is closed{hint}",
        socket.display()
    )]
    Timeout {
        socket: PathBuf,
        request: &'static str,
        waited: Duration,
        /// Why a backend may stay silent, where that is known.
        hint: &'static str,
    },
    #[error("{request} to the vhost-user backend at {} failed: {source}", socket.display())]
    Protocol {
        socket: PathBuf,
        request: &'static str,
        source: vhost::Error,
    },
    #[error(
        "the vhost-user backend at {} is gone (its connection failed earlier); the device is broken",
        socket.display()
    )]
    Broken { socket: PathBuf },
    #[error("the vhost-user backend at {} {missing}", socket.display())]
    Unsupported { socket: PathBuf, missing: String },
    #[error(
        "guest memory region at {start:#x} ({size:#x} bytes) is not backed by a file, so the \
         vhost-user backend cannot map it (gpuvm's memfd and hugetlb RAM backings are shareable)"
    )]
    MemoryNotShareable { start: u64, size: u64 },
    #[error("guest memory has {regions} regions; the vhost-user memory table holds at most {max}")]
    TooManyRegions { regions: usize, max: usize },
    #[error("queue {queue}: its {ring} at {address:#x} is not in guest memory")]
    RingAddress {
        queue: usize,
        ring: &'static str,
        address: u64,
    },
    #[error("cannot start the vhost-user reply watchdog thread: {0}")]
    Watchdog(std::io::Error),
    #[error("cannot create an eventfd: {0}")]
    EventFd(std::io::Error),
}
