//! Live update: the running gpuvm (old) hands its VM to a new gpuvm process without
//! copying guest RAM. The old one sends the guest RAM memfd, its stdio, its virtio-blk
//! drives' open images and the machine's configuration over a Unix socket ([`protocol`]);
//! the new one builds its KVM VM over that memfd (its drives adopting those images, locks
//! and all) while the guest still runs. Only then does the old one pause the vCPUs and the
//! virtio devices, save every component's state as a snapshot does (the same
//! [`crate::snapshot::MachineState`], no memory file) and send it; the new one loads it and
//! says it is ready; the old one commits (and exits), and the new one runs the vCPUs. Until
//! the commit the old one takes the VM back on any failure. docs/live-update.md has the
//! whole flow.
//!
//! - [`protocol`]: the frames and messages;
//! - `send`: the old side, run from the VMM thread's run loop (PUT /vmm/update);
//! - [`receive`]: the new side (`gpuvm update-receive`);
//! - [`socket`]: the hand-over socket in its private directory, and the checks of who is
//!   at either end (`SO_PEERCRED`);
//! - [`passthrough`]: cold-plugged vfio-user devices, whose connection goes over as it is
//!   (the device sees no new connection, reset or DMA map).

use std::path::PathBuf;

pub mod handed_over;
pub mod kernel_vfio;
pub mod passthrough;
pub mod protocol;
pub mod receive;
mod send;
pub mod socket;

pub use send::{check_token, hand_over, ExpectedReceiver, HandOverReport};

/// How long the old process waits, by default, for the new one to say it is ready.
pub const DEFAULT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum UpdateError {
    /// `what` the hand-over does not carry; `detail` (empty, or ": why") says more.
    #[error("live update of {what} is not supported yet{detail}")]
    Unsupported { what: String, detail: String },
    /// The VM can be handed over, but not now (retry later).
    #[error("the VM cannot be handed over yet: {0}")]
    NotReady(String),
    #[error("cannot connect to the hand-over socket {path}: {source}")]
    Connect {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("refusing the hand-over socket {path}: {reason}")]
    HandOverPath { path: PathBuf, reason: String },
    /// The process at the other end is not the one this side expects.
    #[error("the hand-over socket's peer is process {pid} (uid {uid}), not {expected}")]
    UntrustedPeer {
        pid: u32,
        uid: u32,
        expected: String,
    },
    #[error("cannot {what}: {source}")]
    Socket {
        what: &'static str,
        source: std::io::Error,
    },
    #[error("the other gpuvm closed the hand-over socket (it ended or crashed)")]
    PeerClosed,
    #[error("hand-over protocol error: {0}")]
    Protocol(String),
    #[error(
        "the other gpuvm speaks hand-over protocol version {found}; this one speaks \
         {supported}"
    )]
    ProtocolVersion { found: u32, supported: u32 },
    #[error("the new gpuvm refused the VM: {0}")]
    Refused(String),
    #[error("the old gpuvm took the VM back")]
    Aborted,
    #[error("cannot save the VM's state: {0}")]
    Save(String),
    #[error("cannot load the VM's state: {0}")]
    Load(String),
    #[error("cannot build the VM over the handed-over RAM: {0}")]
    Build(Box<crate::Error>),
    #[error("cannot {what}: {source}")]
    Io {
        what: &'static str,
        source: std::io::Error,
    },
}

impl UpdateError {
    /// [`UpdateError::Unsupported`]: `what` is not handed over yet, because `why` (if any).
    pub fn unsupported(what: impl Into<String>, why: Option<&str>) -> UpdateError {
        UpdateError::Unsupported {
            what: what.into(),
            detail: why.map(|why| format!(": {why}")).unwrap_or_default(),
        }
    }

    /// Whether the peer did not answer in time (a socket timeout).
    pub fn is_timeout(&self) -> bool {
        matches!(
            self,
            UpdateError::Socket { source, .. }
                if matches!(source.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)
        )
    }
}
