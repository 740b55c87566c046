//! virtio-vsock (device type 19) with Firecracker's *hybrid vsock* host side.
//!
//! The guest sees a vsock device with CID `guest_cid`; the host sees Unix sockets:
//!
//! - Host-initiated: gpuvm listens on `uds_path`. A client connects and writes
//!   `CONNECT <port>\n`; the guest gets a REQUEST for `<port>` from a fresh host port
//!   (counting up from 2^30), and once it answers, the client reads `OK <host port>\n` and
//!   the socket is the stream. A refusal (RST) or no answer within [`CONNECT_TIMEOUT`]
//!   closes the client; so does a malformed line.
//! - Guest-initiated: a guest connection to host port P goes to the Unix socket
//!   `<uds_path>_P`, which a host program listens on; no listener means RST.
//!
//! Data flows under the spec's credit-based flow control: gpuvm never sends the guest
//! more than its credit (the host socket is read straight into rx buffers, only as much as
//! the credit allows), and a connection never holds more of the guest's data than the
//! [`BUF_ALLOC`] it advertises when the host socket does not read.
//!
//! Files by idea:
//! - [`device`]: [`Vsock`], the [`crate::VirtioDevice`] (configuration space, activation,
//!   pause/resume, snapshot state).
//! - [`handler`]: the worker-thread state: the rx, tx and event queues around the muxer.
//! - [`muxer`]: the connection table, the host listener and its clients, timeouts, and the
//!   order packets go to the guest in.
//! - [`connection`]: one stream's state machine and credit accounting.
//! - [`unix`]: the Unix-socket side (listener, `CONNECT` line, non-blocking connects).
//! - [`packet`]: the spec's constants and header stamping over
//!   [`virtio_vsock::packet::VsockPacket`].
//!
//! Wiring: the VMM builds [`Vsock::new`] from a [`VsockConfig`] and puts it behind the
//! virtio-pci transport; everything else follows from the [`crate::VirtioDevice`] calls.
//! Snapshots cannot carry live host connections: a restored device sends the guest a
//! TRANSPORT_RESET event and starts with none (the listener is bound again at the same
//! `uds_path`). A live update carries them: the old process hands the listener, every
//! connection's and waiting client's socket and the muxer's state ([`VsockLiveState`])
//! to the new one, whose device serves them on ([`Vsock::adopting`],
//! [`Vsock::adopt_connections`]) with no reset the guest could see.

use std::path::PathBuf;
use std::time::Duration;

mod connection;
mod device;
mod handler;
mod muxer;
mod packet;
mod unix;

#[cfg(test)]
mod tests;

pub use connection::BUF_ALLOC;
pub use connection::{ConnectionLive, State as ConnectionState};
pub use device::{Vsock, VsockLiveState, VsockState, VsockStateError, THREAD_NAME};
pub use muxer::{MuxerLive, RxItemLive, FIRST_HOST_PORT, MAX_CONNECTIONS};
pub use unix::PendingClientLive;
pub use unix::MAX_CONNECT_LINE;

/// How long the guest has to answer a host-initiated REQUEST.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long the guest has to answer gpuvm's SHUTDOWN with RST (and a host socket to take
/// the last of the guest's data) before gpuvm resets the connection.
pub const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a host client has to write its `CONNECT <port>\n` line.
pub const CONNECT_LINE_TIMEOUT: Duration = Duration::from_secs(5);

/// The longest `_<port>` suffix a guest-initiated connection adds to `uds_path`.
const PORT_SUFFIX_MAX: usize = "_4294967295".len();

/// A vsock device as the VMM's configuration names it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VsockConfig {
    /// A name for the device in logs and the API.
    pub vsock_id: Option<String>,
    /// The guest's address: 3 or more (0-2 are the hypervisor, local and host), below
    /// 2^32 - 1 (VMADDR_CID_ANY).
    pub guest_cid: u64,
    /// The Unix socket host clients connect to; `<uds_path>_<port>` are where guest
    /// connections to host port `<port>` go.
    pub uds_path: PathBuf,
}

impl VsockConfig {
    pub fn validate(&self) -> Result<(), VsockError> {
        validate_guest_cid(self.guest_cid)?;
        let max = crate::socket::max_path_len() - PORT_SUFFIX_MAX;
        let length = self.uds_path.as_os_str().len();
        if length == 0 || length > max {
            return Err(VsockError::PathLength {
                path: self.uds_path.clone(),
                max,
            });
        }
        Ok(())
    }
}

fn validate_guest_cid(guest_cid: u64) -> Result<(), VsockError> {
    if guest_cid < 3 || guest_cid >= u64::from(u32::MAX) {
        return Err(VsockError::GuestCid(guest_cid));
    }
    Ok(())
}

/// Why a vsock device cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum VsockError {
    #[error("guest_cid {0} is reserved or out of range: use 3 to 4294967294")]
    GuestCid(u64),
    #[error("uds_path {path:?}: must be 1 to {max} bytes long (a Unix socket address holds 107, and guest connections add _<port>)")]
    PathLength { path: PathBuf, max: usize },
    #[error("uds_path {0:?} exists and is not a socket")]
    PathNotSocket(PathBuf),
    #[error("uds_path {0:?} is in use: another process listens on it")]
    PathInUse(PathBuf),
    #[error("cannot create the timeout timer: {0}")]
    Timer(std::io::Error),
    #[error("uds_path {path:?}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// A socket path under the temporary directory that no other test uses.
#[cfg(test)]
fn temp_socket_path(tag: &str) -> PathBuf {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let unique = NEXT.fetch_add(1, Ordering::Relaxed);
    std::env::temp_dir().join(format!("gpuvm-vsock-{tag}-{}-{unique}", std::process::id()))
}
