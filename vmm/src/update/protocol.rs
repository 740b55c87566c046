//! The hand-over protocol between the running gpuvm (old) and the new one, on one Unix
//! stream socket. Every message is a frame:
//!
//! ```text
//! offset 0   4 bytes  magic "GPVU"
//! offset 4   u32      protocol version (PROTOCOL_VERSION)
//! offset 8   u32      kind (MessageKind)
//! offset 12  u32      number of descriptors sent with the frame's first byte (SCM_RIGHTS)
//! offset 16  u64      payload length
//! offset 24  payload
//! ```
//!
//! The exchange:
//! 1. old → new `Offer` (JSON [`OfferMeta`], with the descriptors of [`OFFER_FDS`], then
//!    one per virtio-blk drive, in the order of [`OfferMeta::drives`], then each network
//!    interface's tap queues, in the order of [`OfferMeta::interfaces`], then each
//!    vfio-user device's connection and region files, in the order of
//!    [`OfferMeta::vfio_user`], then the kernel VFIO devices' iommufd and cdevs, then the log
//!    and metrics outputs of [`OfferMeta::outputs`]) and
//!    `State`: the machine's configuration and device state, saved while the guest runs
//!    (no vCPU state), framed exactly as a snapshot's `state` file so that the new binary's
//!    version checks and migrations apply;
//! 2. new → old `Built` (or `Refused`, with a reason): its VM, RAM mapping, devices and
//!    vCPUs exist, nothing loaded;
//! 3. old: pauses the vCPUs; → new `PausedState`: the pause time (u64 CLOCK_MONOTONIC ns,
//!    little-endian), then the whole state framed as above;
//! 4. new → old `Ready` (JSON [`ReadyBody`]) or `Refused`;
//! 5. old → new `Commit` (the old one exits) or, at any step, `Abort` (it kept the VM).
//!    `Commit` brings the old process's API listening socket as its one descriptor
//!    ([`COMMIT_API_LISTENER`]), or none (an older sender, or no API socket): the new
//!    process then serves that very socket, with the connections waiting in its backlog,
//!    instead of binding the path again once the old one has gone. No version change: an
//!    older receiver takes `Commit` as before and closes the descriptor unused.

use std::io::{Read, Write};
use std::os::unix::io::{FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use serde::{Deserialize, Serialize};
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use super::UpdateError;

const MAGIC: &[u8; 4] = b"GPVU";
/// The version of the frames and of the message sequence. A receiver refuses any other.
pub const PROTOCOL_VERSION: u32 = 1;
const HEADER_LEN: usize = 24;
/// The largest payload accepted: a state is tens of KiB per vCPU.
const MAX_PAYLOAD: u64 = 64 << 20;
/// The most disk images an offer may bring, after its [`OFFER_FDS`].
pub const MAX_DRIVES: usize = 16;
/// The most tap queues an offer may bring (all interfaces together), after the drives'.
pub const MAX_TAP_QUEUES: usize = 64;
/// The most descriptors the vfio-user devices of an offer may bring (each its connection
/// and its region files), after the tap queues.
pub const MAX_VFIO_USER_FDS: usize = 16;
/// The most kernel VFIO devices an offer may bring (each its cdev, or a type1 group's device
/// file and at most as many group files), after the iommufd or container they are bound
/// to, after the vfio-user devices' descriptors.
pub const MAX_KERNEL_VFIO_DEVICES: usize = 16;
/// The most hot-plugged kernel VFIO devices an offer may bring (each its own iommufd or
/// container, its group's file for type1, and its device's file), after the cold-plugged
/// ones' descriptors.
pub const MAX_HOT_KERNEL_VFIO_DEVICES: usize = 8;
/// The most vhost-user devices an offer may bring (each its connection's socket).
pub const MAX_VHOST_USER: usize = 16;
/// The most vsock connections and waiting host clients whose sockets the paused state
/// may bring (one frame holds at most 253 descriptors): a VM with more is not handed
/// over until it has fewer.
pub const MAX_VSOCK_SOCKETS: usize = 128;
/// The most bytes the vsock connections of a paused state may hold for their host
/// sockets (guest data a host program has not read yet).
pub const MAX_VSOCK_BUFFERED: usize = 8 << 20;
/// The most descriptors one frame may bring: an offer's, or a paused state's.
const MAX_FDS: usize = {
    let offer = OFFER_FDS
        + MAX_DRIVES
        + MAX_TAP_QUEUES
        + MAX_VFIO_USER_FDS
        + 1
        + 2 * MAX_KERNEL_VFIO_DEVICES
        + 3 * MAX_HOT_KERNEL_VFIO_DEVICES
        + 2
        + 1
        + MAX_VHOST_USER;
    if offer > MAX_VSOCK_SOCKETS {
        offer
    } else {
        MAX_VSOCK_SOCKETS
    }
};

/// What a frame is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MessageKind {
    Offer = 1,
    State = 2,
    Ready = 3,
    Refused = 4,
    Commit = 5,
    Abort = 6,
    Built = 7,
    PausedState = 8,
}

impl MessageKind {
    fn from_u32(value: u32) -> Option<MessageKind> {
        Some(match value {
            1 => MessageKind::Offer,
            2 => MessageKind::State,
            3 => MessageKind::Ready,
            4 => MessageKind::Refused,
            5 => MessageKind::Commit,
            6 => MessageKind::Abort,
            7 => MessageKind::Built,
            8 => MessageKind::PausedState,
            _ => return None,
        })
    }
}

/// What the offer says besides the state: how guest RAM is backed (the memfd comes as a
/// descriptor), which vCPUs the guest has, and who the old process is.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct OfferMeta {
    /// The guest RAM memfd's size in bytes (checked against the descriptor).
    pub ram_size: u64,
    /// Guest RAM is a file on gpuvm's private huge-page tmpfs rather than a memfd.
    pub huge_tmpfs: bool,
    /// The ids of the guest's vCPUs, in order (the state of each comes once paused).
    pub vcpu_ids: Vec<u8>,
    /// The old process's id (the new one takes the VM over if it dies before `Commit`).
    pub old_pid: u32,
    /// The secret `gpuvm update` gave both processes when the new one is in another pid
    /// namespace (it cannot read the old one's pid): the new one takes no offer without it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handover_token: Option<String>,
    /// The virtio-blk drives (by drive ID) whose open image descriptors follow the
    /// [`OFFER_FDS`], in this order: the new process adopts them (with their locks)
    /// rather than open the images again. Absent without drives, so that an offer
    /// without them reads as before.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub drives: Vec<String>,
    /// The network interfaces whose tap queues follow the drives' images, in this order:
    /// the new process's devices take them rather than open the taps by name (a tap queue
    /// attached here cannot be attached twice, and taps a container runtime passed as
    /// descriptors have no name to open). Absent without interfaces, so that an offer
    /// without them reads as before; an older receiver refuses an offer with them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub interfaces: Vec<OfferedInterface>,
    /// The cold-plugged vfio-user devices whose connections (each its socket, then its
    /// region files) follow the tap queues, in this order: the new process takes the
    /// connection over rather than connect again. Absent without them; an older receiver
    /// refuses an offer with them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub vfio_user: Vec<super::passthrough::OfferedVfioUser>,
    /// The cold-plugged kernel VFIO devices (iommufd): the iommufd, then each device's
    /// cdev, follow the vfio-user devices' descriptors. Absent without them; an older
    /// receiver refuses an offer with them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel_vfio: Option<super::handed_over::OfferedKernelVfio>,
    /// The hot-plugged kernel VFIO devices, each its own context as `kernel_vfio` is
    /// offered, in the paused state's order: their descriptors follow the cold-plugged
    /// ones'. Absent without them; an older receiver refuses an offer with them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hot_kernel_vfio: Vec<super::handed_over::OfferedKernelVfio>,
    /// The log and metrics outputs (Firecracker's `--log-path`/`--metrics-path`, PUT
    /// /logger and /metrics): their descriptors come last, log first. Absent without
    /// them; an older receiver refuses an offer with them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outputs: Option<crate::outputs::HandedOverOutputs>,
    /// The vsock device's listening socket comes after the outputs' descriptors: the new
    /// process's device takes it instead of binding `uds_path` again (its connections'
    /// sockets come with the paused state). Absent without vsock; an older receiver refuses
    /// an offer with it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub vsock_listener: bool,
    /// The vhost-user devices whose connections' sockets come after the vsock listener, in
    /// this order: the new process's devices take them over rather than connect again (a
    /// backend serves one frontend) and say nothing on them until the VM is theirs. Absent
    /// without them; an older receiver refuses an offer with them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub vhost_user: Vec<OfferedVhostUser>,
}

/// One vhost-user device in an offer: its id and what its connection negotiated and its
/// guest sees.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct OfferedVhostUser {
    pub id: String,
    pub live: gpuvm_virtio::vhost_user::VhostUserLive,
}

/// One network interface in an offer: its id and how many tap queues it brings.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct OfferedInterface {
    pub iface_id: String,
    pub queues: u16,
}

impl OfferMeta {
    /// How many descriptors the offer frame must bring.
    pub fn descriptor_count(&self) -> usize {
        OFFER_FDS
            + self.drives.len()
            + self
                .interfaces
                .iter()
                .map(|iface| usize::from(iface.queues))
                .sum::<usize>()
            + self
                .vfio_user
                .iter()
                .map(super::passthrough::OfferedVfioUser::descriptor_count)
                .sum::<usize>()
            + self
                .kernel_vfio
                .as_ref()
                .map_or(0, super::handed_over::OfferedKernelVfio::descriptor_count)
            + (self.hot_kernel_vfio.iter())
                .map(super::handed_over::OfferedKernelVfio::descriptor_count)
                .sum::<usize>()
            + (self.outputs.as_ref()).map_or(0, crate::outputs::HandedOverOutputs::descriptor_count)
            + usize::from(self.vsock_listener)
            + self.vhost_user.len()
    }
}

/// A `PausedState` payload: when the vCPUs were paused, then the framed state.
pub fn paused_state(paused_at_ns: u64, framed: &[u8]) -> Vec<u8> {
    let mut payload = Vec::with_capacity(8 + framed.len());
    payload.extend_from_slice(&paused_at_ns.to_le_bytes());
    payload.extend_from_slice(framed);
    payload
}

/// A `PausedState` payload's pause time and framed state.
pub fn split_paused_state(payload: &[u8]) -> Result<(u64, &[u8]), UpdateError> {
    if payload.len() < 8 {
        return Err(UpdateError::Protocol(
            "a PausedState without its pause time".into(),
        ));
    }
    let (time, framed) = payload.split_at(8);
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(time);
    Ok((u64::from_le_bytes(bytes), framed))
}

/// What `Ready` says: who the new process is.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ReadyBody {
    pub pid: u32,
}

/// How many descriptors an offer has: the guest RAM memfd, then the old process's stdin,
/// stdout (the serial console) and stderr (its log).
pub const OFFER_FDS: usize = 4;

/// The most descriptors a `Commit` brings: the old process's API listening socket.
pub const COMMIT_API_LISTENER: usize = 1;

/// A frame received: its kind, payload and descriptors.
pub struct Frame {
    pub kind: MessageKind,
    pub payload: Vec<u8>,
    pub fds: Vec<OwnedFd>,
}

fn header(kind: MessageKind, fds: usize, len: usize) -> [u8; HEADER_LEN] {
    let mut bytes = [0u8; HEADER_LEN];
    bytes[..4].copy_from_slice(MAGIC);
    bytes[4..8].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    bytes[8..12].copy_from_slice(&(kind as u32).to_le_bytes());
    bytes[12..16].copy_from_slice(&(fds as u32).to_le_bytes());
    bytes[16..24].copy_from_slice(&(len as u64).to_le_bytes());
    bytes
}

/// Sends one frame; `fds` travel with its header.
pub fn send(
    socket: &UnixStream,
    kind: MessageKind,
    payload: &[u8],
    fds: &[RawFd],
) -> Result<(), UpdateError> {
    let io = |source| UpdateError::Socket {
        what: "send a hand-over message",
        source,
    };
    let head = header(kind, fds.len(), payload.len());
    if fds.is_empty() {
        (&*socket).write_all(&head).map_err(io)?;
    } else {
        let sent = socket
            .send_with_fds(&[&head[..]], fds)
            .map_err(|e| io(std::io::Error::from_raw_os_error(e.errno())))?;
        (&*socket).write_all(&head[sent..]).map_err(io)?;
    }
    (&*socket).write_all(payload).map_err(io)
}

/// Receives one frame (blocking, under the socket's receive timeout).
pub fn receive(socket: &UnixStream) -> Result<Frame, UpdateError> {
    let io = |source| UpdateError::Socket {
        what: "receive a hand-over message",
        source,
    };
    let mut head = [0u8; HEADER_LEN];
    let mut raw_fds: [RawFd; MAX_FDS] = [-1; MAX_FDS];
    let mut iov = [libc::iovec {
        iov_base: head.as_mut_ptr().cast(),
        iov_len: head.len(),
    }];
    // SAFETY: the iovec points into `head`, a live local buffer of that length, which
    // may take any bytes.
    let (read, fd_count) = unsafe { socket.recv_with_fds(&mut iov, &mut raw_fds) }
        .map_err(|e| io(std::io::Error::from_raw_os_error(e.errno())))?;
    let fds: Vec<OwnedFd> = raw_fds[..fd_count]
        .iter()
        // SAFETY: recvmsg gave this process these descriptors; nothing else owns them.
        .map(|&fd| unsafe { OwnedFd::from_raw_fd(fd) })
        .collect();
    if read == 0 {
        return Err(UpdateError::PeerClosed);
    }
    (&*socket).read_exact(&mut head[read..]).map_err(io)?;
    let word = |at: usize| u32::from_le_bytes([head[at], head[at + 1], head[at + 2], head[at + 3]]);
    if &head[..4] != MAGIC {
        return Err(UpdateError::Protocol(
            "a frame without the hand-over magic".into(),
        ));
    }
    let version = word(4);
    if version != PROTOCOL_VERSION {
        return Err(UpdateError::ProtocolVersion {
            found: version,
            supported: PROTOCOL_VERSION,
        });
    }
    let kind = MessageKind::from_u32(word(8))
        .ok_or_else(|| UpdateError::Protocol(format!("unknown message kind {}", word(8))))?;
    let declared_fds = word(12) as usize;
    if declared_fds != fds.len() {
        return Err(UpdateError::Protocol(format!(
            "{kind:?} announces {declared_fds} descriptors, {} came",
            fds.len()
        )));
    }
    let mut len = [0u8; 8];
    len.copy_from_slice(&head[16..24]);
    let len = u64::from_le_bytes(len);
    if len > MAX_PAYLOAD {
        return Err(UpdateError::Protocol(format!(
            "{kind:?} has a payload of {len} bytes, more than {MAX_PAYLOAD}"
        )));
    }
    let mut payload = vec![0u8; len as usize];
    (&*socket).read_exact(&mut payload).map_err(io)?;
    Ok(Frame { kind, payload, fds })
}

/// Receives a frame that must be `kind` (a `Refused` or `Abort` is the peer's error).
pub fn expect(socket: &UnixStream, kind: MessageKind) -> Result<Frame, UpdateError> {
    let frame = receive(socket)?;
    match frame.kind {
        found if found == kind => Ok(frame),
        MessageKind::Refused => Err(UpdateError::Refused(
            String::from_utf8_lossy(&frame.payload).into_owned(),
        )),
        MessageKind::Abort => Err(UpdateError::Aborted),
        found => Err(UpdateError::Protocol(format!(
            "expected {kind:?}, got {found:?}"
        ))),
    }
}

/// CLOCK_MONOTONIC now, in ns: comparable between processes on one host.
pub fn monotonic_ns() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into `now`, a live local.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    (now.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(now.tv_nsec as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::io::AsRawFd;

    #[test]
    fn frames_round_trip_with_descriptors() {
        let (a, b) = UnixStream::pair().unwrap();
        let file = std::fs::File::open("/proc/self/exe").unwrap();
        send(&a, MessageKind::Offer, b"{}", &[file.as_raw_fd()]).unwrap();
        send(&a, MessageKind::Ready, b"", &[]).unwrap();
        let offer = receive(&b).unwrap();
        assert_eq!(offer.kind, MessageKind::Offer);
        assert_eq!(offer.payload, b"{}");
        assert_eq!(offer.fds.len(), 1);
        assert_eq!(expect(&b, MessageKind::Ready).unwrap().payload, b"");
    }

    #[test]
    fn refusals_and_bad_frames_are_errors() {
        let (a, b) = UnixStream::pair().unwrap();
        send(&a, MessageKind::Refused, b"too new", &[]).unwrap();
        assert!(matches!(
            expect(&b, MessageKind::Ready),
            Err(UpdateError::Refused(reason)) if reason == "too new"
        ));
        let mut bad = header(MessageKind::Ready, 0, 0);
        bad[4] = 9;
        (&a).write_all(&bad).unwrap();
        assert!(matches!(
            receive(&b),
            Err(UpdateError::ProtocolVersion { found: 9, .. })
        ));
        drop(a);
        assert!(matches!(receive(&b), Err(UpdateError::PeerClosed)));
    }
}
