//! Moving frames between a tap queue and a pair of virtqueues, zero-copy: the tap reads a
//! frame straight into the guest's RX buffers (readv) and writes a frame straight from the
//! guest's TX buffers (writev).
//!
//! Each frame on the tap carries a virtio_net_hdr_v1 (IFF_VNET_HDR); so does each buffer in
//! the virtqueues. With no offloads negotiated both headers are all zero apart from RX's
//! num_buffers (1: without VIRTIO_NET_F_MRG_RXBUF a frame fills exactly one chain), so the
//! device never forwards a header the guest wrote: TX sends a zeroed one, RX writes its own.
//!
//! Everything about a chain is the guest's choice and is checked: a chain that cannot carry
//! a frame (too short, wrong direction, outside guest memory, too long, too fragmented, an
//! offload header nobody negotiated) is dropped and counted, never a panic or a hang.
//!
//! `guest_slices` turns a chain into host memory and does the readv/writev over it.

use crate::queue::{pop_available, Available};
use std::fmt;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use virtio_bindings::virtio_net::{
    virtio_net_hdr_v1, VIRTIO_NET_HDR_F_NEEDS_CSUM, VIRTIO_NET_HDR_GSO_NONE,
};
use virtio_queue::{DescriptorChain, QueueOwnedT, QueueT};

use super::tap::Tap;
use super::VNET_HDR_LEN;
use crate::device::ActiveQueue;
use crate::rate_limiter::RateLimiter;
use crate::{GuestMemory, VirtioInterrupt};

mod guest_slices;
use guest_slices::{chain_slices, mark_dirty, split_slices, vectored_io, write_into, Slices};

/// The largest chain a frame may occupy, header included: a 64 KiB IP packet in an Ethernet
/// frame with a VLAN tag, plus the header (Firecracker's bound).
pub const MAX_FRAME_LEN: usize = 65562;
/// An Ethernet header; anything shorter is not a frame.
const ETH_HEADER_LEN: usize = 14;
/// Frames (or chains) one pass over a queue handles before the loop looks at other events.
const BUDGET: usize = 256;
/// readv/writev take at most IOV_MAX (1024) pieces; two are the device's own (the header,
/// and on RX a spill byte that tells a frame too big for the chain).
const MAX_GUEST_PIECES: usize = 1024 - 2;

const FLAGS_OFFSET: usize = std::mem::offset_of!(virtio_net_hdr_v1, flags);
const GSO_TYPE_OFFSET: usize = std::mem::offset_of!(virtio_net_hdr_v1, gso_type);
const NUM_BUFFERS_OFFSET: usize = std::mem::offset_of!(virtio_net_hdr_v1, num_buffers);

/// Frame and byte counts for metrics (bytes count Ethernet frames, without the header).
#[derive(Debug, Default)]
pub struct NetCounters {
    rx_packets: AtomicU64,
    rx_bytes: AtomicU64,
    /// Frames read from the tap that no guest buffer took (too big for the chain, or an
    /// offload header the guest did not negotiate).
    rx_dropped: AtomicU64,
    tx_packets: AtomicU64,
    tx_bytes: AtomicU64,
    /// TX chains not sent: malformed, or refused by the tap.
    tx_dropped: AtomicU64,
    /// Chains (RX, TX or control) the guest built wrong: returned unused.
    invalid_chains: AtomicU64,
}

/// A copy of [`NetCounters`] at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct NetStats {
    pub rx_packets: u64,
    pub rx_bytes: u64,
    pub rx_dropped: u64,
    pub tx_packets: u64,
    pub tx_bytes: u64,
    pub tx_dropped: u64,
    pub invalid_chains: u64,
}

impl NetCounters {
    pub(crate) fn count_invalid_chain(&self) {
        bump(&self.invalid_chains, 1);
    }

    pub fn snapshot(&self) -> NetStats {
        let get = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        NetStats {
            rx_packets: get(&self.rx_packets),
            rx_bytes: get(&self.rx_bytes),
            rx_dropped: get(&self.rx_dropped),
            tx_packets: get(&self.tx_packets),
            tx_bytes: get(&self.tx_bytes),
            tx_dropped: get(&self.tx_dropped),
            invalid_chains: get(&self.invalid_chains),
        }
    }
}

fn bump(counter: &AtomicU64, by: u64) {
    counter.fetch_add(by, Ordering::Relaxed);
}

/// At most one warning a second from the data path (the guest decides how many bad chains
/// come), with a count of those held back.
pub(crate) struct LogThrottle {
    device: String,
    next: Instant,
    held_back: u64,
}

impl LogThrottle {
    pub(crate) fn new(device: &str) -> Self {
        LogThrottle {
            device: device.to_string(),
            next: Instant::now(),
            held_back: 0,
        }
    }

    pub(crate) fn device(&self) -> &str {
        &self.device
    }

    pub(crate) fn warn(&mut self, message: fmt::Arguments<'_>) {
        let now = Instant::now();
        if now < self.next {
            self.held_back += 1;
            return;
        }
        if self.held_back > 0 {
            log::warn!(
                "{}: {message} ({} similar messages held back)",
                self.device,
                self.held_back
            );
        } else {
            log::warn!("{}: {message}", self.device);
        }
        self.held_back = 0;
        self.next = now + Duration::from_secs(1);
    }
}

/// Why a chain could not carry a frame.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum ChainError {
    #[error(
        "chain of {0} bytes is shorter than the {VNET_HDR_LEN}-byte header and an Ethernet header"
    )]
    TooShort(usize),
    #[error("chain is longer than {MAX_FRAME_LEN} bytes")]
    TooLong,
    #[error("chain has more than {MAX_GUEST_PIECES} pieces")]
    TooFragmented,
    #[error("chain points outside guest memory: {0}")]
    BadAddress(String),
    #[error(
        "header asks for offloads that were not negotiated (flags {flags:#x}, gso_type {gso_type})"
    )]
    UnnegotiatedOffload { flags: u8, gso_type: u8 },
}

/// What reading one frame into an RX chain came to.
#[derive(Debug)]
enum RxOutcome {
    /// The frame is in the chain: `used_len` bytes written, header included.
    Received {
        used_len: u32,
        frame_len: u64,
    },
    /// The tap has no frame.
    TapEmpty,
    /// A frame was read and thrown away; the chain is still free.
    FrameDropped(String),
    /// The chain cannot hold any frame.
    BadChain(ChainError),
    TapFailed(std::io::Error),
}

fn receive_frame(
    fd: RawFd,
    memory: &GuestMemory,
    chain: DescriptorChain<&GuestMemory>,
) -> RxOutcome {
    let (slices, capacity) = match chain_slices(memory, chain, true, MAX_FRAME_LEN, true) {
        Ok(found) => found,
        Err(error) => return RxOutcome::BadChain(error),
    };
    if capacity < VNET_HDR_LEN + ETH_HEADER_LEN {
        return RxOutcome::BadChain(ChainError::TooShort(capacity));
    }
    let (header_slices, payload_slices) = split_slices(slices, VNET_HDR_LEN);
    let mut header = [0u8; VNET_HDR_LEN];
    // One byte past the chain: a socket fills it when the frame is too big (a tap instead
    // returns the frame's full length); either way the frame did not fit.
    let mut spill = [0u8; 1];
    let read = match vectored_io(fd, &mut header, &payload_slices, &mut spill, false) {
        Ok(read) => read,
        Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => return RxOutcome::TapEmpty,
        Err(error) => return RxOutcome::TapFailed(error),
    };
    if read > capacity {
        return RxOutcome::FrameDropped(format!(
            "a frame of {} bytes does not fit a {capacity}-byte RX chain (no VIRTIO_NET_F_MRG_RXBUF)",
            read.saturating_sub(VNET_HDR_LEN)
        ));
    }
    if read < VNET_HDR_LEN + ETH_HEADER_LEN {
        return RxOutcome::FrameDropped(format!("the tap gave a {read}-byte frame"));
    }
    let flags = header[FLAGS_OFFSET];
    let gso_type = header[GSO_TYPE_OFFSET];
    // No offloads are set on the tap, so the host finished checksums and segmentation; a
    // header that says otherwise would hand the guest a frame it cannot take.
    if u32::from(gso_type) != VIRTIO_NET_HDR_GSO_NONE
        || u32::from(flags) & VIRTIO_NET_HDR_F_NEEDS_CSUM != 0
    {
        return RxOutcome::FrameDropped(format!(
            "the tap gave a frame with offloads (flags {flags:#x}, gso_type {gso_type})"
        ));
    }
    // Flags zero (no DATA_VALID without VIRTIO_NET_F_GUEST_CSUM), num_buffers 1.
    let mut guest_header = [0u8; VNET_HDR_LEN];
    guest_header[NUM_BUFFERS_OFFSET..NUM_BUFFERS_OFFSET + 2].copy_from_slice(&1u16.to_le_bytes());
    write_into(&header_slices, &guest_header);
    mark_dirty(&payload_slices, read - VNET_HDR_LEN);
    RxOutcome::Received {
        used_len: read as u32,
        frame_len: (read - VNET_HDR_LEN) as u64,
    }
}

/// A TX chain checked and ready to write: the frame after the guest's header.
struct TxFrame<'m> {
    payload: Slices<'m>,
    frame_len: usize,
}

fn prepare_frame<'m>(
    memory: &'m GuestMemory,
    chain: DescriptorChain<&'m GuestMemory>,
) -> Result<TxFrame<'m>, ChainError> {
    let (slices, total) = chain_slices(memory, chain, false, MAX_FRAME_LEN, false)?;
    if total < VNET_HDR_LEN + ETH_HEADER_LEN {
        return Err(ChainError::TooShort(total));
    }
    let (header_slices, payload) = split_slices(slices, VNET_HDR_LEN);
    let mut header = [0u8; VNET_HDR_LEN];
    let mut filled = 0;
    for slice in &header_slices {
        filled += slice.copy_to(&mut header[filled..]);
    }
    let flags = header[FLAGS_OFFSET];
    let gso_type = header[GSO_TYPE_OFFSET];
    // Neither VIRTIO_NET_F_CSUM nor any GSO feature is offered.
    if flags != 0 || u32::from(gso_type) != VIRTIO_NET_HDR_GSO_NONE {
        return Err(ChainError::UnnegotiatedOffload { flags, gso_type });
    }
    Ok(TxFrame {
        payload,
        frame_len: total - VNET_HDR_LEN,
    })
}

/// A frame the tap delivered into a chain that waits for RX rate-limiter tokens before the
/// guest sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct HeldFrame {
    pub head: u16,
    pub used_len: u32,
    pub frame_len: u64,
}

/// What a pass over a queue did.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Pass {
    /// Chains went to the used ring.
    pub used: bool,
    /// The pass stopped at its budget with work left.
    pub more: bool,
}

/// Puts a chain in the used ring; a guest that broke its ring gets a log line.
fn complete(
    queue: &mut ActiveQueue,
    memory: &GuestMemory,
    head: u16,
    len: u32,
    log: &mut LogThrottle,
) {
    if let Err(error) = queue.queue.add_used(memory, head, len) {
        log.warn(format_args!("cannot return chain {head}: {error}"));
    }
}

/// Raises the queue's interrupt if the driver wants one.
pub(crate) fn notify(
    queue: &mut ActiveQueue,
    index: u16,
    memory: &GuestMemory,
    interrupt: &dyn VirtioInterrupt,
    log: &mut LogThrottle,
) {
    let wanted = queue.queue.needs_notification(memory).unwrap_or(true);
    if wanted {
        if let Err(error) = interrupt.signal_queue(index) {
            log.warn(format_args!("cannot signal queue {index}: {error}"));
        }
    }
}

/// One RX/TX virtqueue pair and its tap queue.
pub(crate) struct QueuePair {
    pub tap: Tap,
    /// `None` when the driver did not enable the queue (pairs past the first only).
    pub rx: Option<ActiveQueue>,
    pub tx: Option<ActiveQueue>,
    pub rx_index: u16,
    pub tx_index: u16,
    /// The driver uses this pair (VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET); frames go to enabled
    /// pairs only.
    pub enabled: bool,
    /// The RX queue may have buffers (cleared when it runs dry, set by the driver's kick):
    /// the tap is read only while it may.
    pub rx_has_buffers: bool,
    pub held: Option<HeldFrame>,
    /// A read failed other than EAGAIN; the tap is not read until the next RX kick.
    pub rx_tap_failed: bool,
    /// A write got EAGAIN: the chain waits for the tap to be writable.
    pub tx_waiting_for_tap: bool,
    /// The tap reported an error condition (its interface is gone): no more reads.
    pub tap_broken: bool,
    /// MMDS on this interface (pair 0 only): takes the guest's frames for it instead of
    /// the tap, and its answers go into the RX queue before the tap's frames.
    pub mmds: Option<gpuvm_mmds::MmdsStack>,
}

impl QueuePair {
    pub fn new(
        tap: Tap,
        pair_index: u16,
        rx: Option<ActiveQueue>,
        tx: Option<ActiveQueue>,
    ) -> Self {
        QueuePair {
            tap,
            rx,
            tx,
            rx_index: pair_index * 2,
            tx_index: pair_index * 2 + 1,
            enabled: pair_index == 0,
            rx_has_buffers: true,
            held: None,
            rx_tap_failed: false,
            tx_waiting_for_tap: false,
            tap_broken: false,
            mmds: None,
        }
    }

    /// Whether MMDS has answers waiting for RX buffers.
    pub fn mmds_pending(&self) -> bool {
        self.mmds.as_ref().is_some_and(|m| m.has_replies())
    }

    /// Puts MMDS's answers into RX chains while both last; true if any went in.
    fn deliver_mmds(
        &mut self,
        memory: &GuestMemory,
        counters: &NetCounters,
        log: &mut LogThrottle,
    ) -> bool {
        let (Some(mmds), Some(rx)) = (self.mmds.as_mut(), self.rx.as_mut()) else {
            return false;
        };
        let mut used = false;
        while mmds.has_replies() {
            let chain = match pop_available(&mut rx.queue, memory) {
                Available::Chain(chain) => chain,
                Available::Empty | Available::Broken(_) => {
                    self.rx_has_buffers = false;
                    break;
                }
            };
            let head = chain.head_index();
            let Some(frame) = mmds.next_reply() else {
                rx.queue.go_to_previous_position();
                break;
            };
            match chain_slices(memory, chain, true, MAX_FRAME_LEN, true) {
                Ok((slices, capacity)) if capacity >= VNET_HDR_LEN + frame.len() => {
                    let (header_slices, payload_slices) = split_slices(slices, VNET_HDR_LEN);
                    let mut guest_header = [0u8; VNET_HDR_LEN];
                    guest_header[NUM_BUFFERS_OFFSET..NUM_BUFFERS_OFFSET + 2]
                        .copy_from_slice(&1u16.to_le_bytes());
                    write_into(&header_slices, &guest_header);
                    write_into(&payload_slices, &frame);
                    mark_dirty(&payload_slices, frame.len());
                    complete(rx, memory, head, (VNET_HDR_LEN + frame.len()) as u32, log);
                    bump(&counters.rx_packets, 1);
                    bump(&counters.rx_bytes, frame.len() as u64);
                }
                Ok(_) => {
                    // Too small a chain for this answer: it is dropped, the chain serves on.
                    rx.queue.go_to_previous_position();
                    bump(&counters.rx_dropped, 1);
                    log.warn(format_args!(
                        "MMDS answer of {} bytes dropped: the RX chain is too small",
                        frame.len()
                    ));
                    continue;
                }
                Err(error) => {
                    mmds.unget_reply(frame);
                    complete(rx, memory, head, 0, log);
                    bump(&counters.invalid_chains, 1);
                    log.warn(format_args!("RX chain {head} returned unused: {error}"));
                }
            }
            used = true;
        }
        used
    }
}

/// Whether MMDS takes the TX `frame` (copied out of guest memory first).
fn mmds_takes(mmds: &mut Option<gpuvm_mmds::MmdsStack>, frame: &TxFrame<'_>) -> bool {
    let Some(mmds) = mmds.as_mut() else {
        return false;
    };
    let mut bytes = vec![0u8; frame.frame_len];
    let mut filled = 0;
    for slice in &frame.payload {
        filled += slice.copy_to(&mut bytes[filled..]);
    }
    bytes.truncate(filled);
    mmds.intercept(&bytes)
}

impl QueuePair {
    /// Whether the tap should be watched for frames to read.
    pub fn wants_rx(&self, limiter: &RateLimiter) -> bool {
        self.rx.is_some()
            && self.enabled
            && self.rx_has_buffers
            && self.held.is_none()
            && !self.rx_tap_failed
            && !self.tap_broken
            && !limiter.is_blocked()
    }

    /// Moves frames from the tap into the RX queue until the tap or the queue runs dry, the
    /// limiter blocks, or the budget is spent.
    pub fn process_rx(
        &mut self,
        memory: &GuestMemory,
        limiter: &mut RateLimiter,
        counters: &NetCounters,
        log: &mut LogThrottle,
    ) -> Pass {
        let mut pass = Pass::default();
        let fd = self.tap.as_raw_fd();
        let Some(rx) = self.rx.as_mut() else {
            return pass;
        };
        if let Some(held) = self.held {
            if !limiter.consume(held.frame_len, 1) {
                return pass;
            }
            complete(rx, memory, held.head, held.used_len, log);
            bump(&counters.rx_packets, 1);
            bump(&counters.rx_bytes, held.frame_len);
            self.held = None;
            pass.used = true;
        }
        if self.deliver_mmds(memory, counters, log) {
            pass.used = true;
        }
        let Some(rx) = self.rx.as_mut() else {
            return pass;
        };
        if !self.enabled || self.tap_broken || self.rx_tap_failed {
            return pass;
        }
        let mut spent = 0;
        while spent < BUDGET {
            if limiter.is_blocked() {
                return pass;
            }
            let chain = match pop_available(&mut rx.queue, memory) {
                Available::Chain(chain) => chain,
                Available::Empty => {
                    self.rx_has_buffers = false;
                    return pass;
                }
                Available::Broken(why) => {
                    // Waits for the driver's next kick rather than spin on the ring.
                    log.warn(format_args!("RX queue: {why}"));
                    self.rx_has_buffers = false;
                    return pass;
                }
            };
            spent += 1;
            let head = chain.head_index();
            match receive_frame(fd, memory, chain) {
                RxOutcome::Received {
                    used_len,
                    frame_len,
                } => {
                    if !limiter.consume(frame_len, 1) {
                        self.held = Some(HeldFrame {
                            head,
                            used_len,
                            frame_len,
                        });
                        return pass;
                    }
                    complete(rx, memory, head, used_len, log);
                    bump(&counters.rx_packets, 1);
                    bump(&counters.rx_bytes, frame_len);
                    pass.used = true;
                }
                RxOutcome::TapEmpty => {
                    rx.queue.go_to_previous_position();
                    return pass;
                }
                RxOutcome::FrameDropped(why) => {
                    // The chain took nothing the guest may see: it serves the next frame.
                    rx.queue.go_to_previous_position();
                    bump(&counters.rx_dropped, 1);
                    log.warn(format_args!("RX frame dropped: {why}"));
                }
                RxOutcome::BadChain(error) => {
                    complete(rx, memory, head, 0, log);
                    bump(&counters.invalid_chains, 1);
                    log.warn(format_args!("RX chain {head} returned unused: {error}"));
                    pass.used = true;
                }
                RxOutcome::TapFailed(error) => {
                    rx.queue.go_to_previous_position();
                    self.rx_tap_failed = true;
                    log.warn(format_args!("reading tap {}: {error}", self.tap.name()));
                    return pass;
                }
            }
        }
        pass.more = true;
        pass
    }

    /// Sends the TX queue's frames to the tap until the queue runs dry, the tap is full, the
    /// limiter blocks, or the budget is spent.
    pub fn process_tx(
        &mut self,
        memory: &GuestMemory,
        limiter: &mut RateLimiter,
        counters: &NetCounters,
        log: &mut LogThrottle,
    ) -> Pass {
        let mut pass = Pass::default();
        let fd = self.tap.as_raw_fd();
        let Some(tx) = self.tx.as_mut() else {
            return pass;
        };
        let mut spent = 0;
        while spent < BUDGET {
            if self.tx_waiting_for_tap || limiter.is_blocked() {
                return pass;
            }
            let chain = match pop_available(&mut tx.queue, memory) {
                Available::Chain(chain) => chain,
                Available::Empty => return pass,
                Available::Broken(why) => {
                    // Waits for the driver's next kick rather than spin on the ring.
                    log.warn(format_args!("TX queue: {why}"));
                    return pass;
                }
            };
            spent += 1;
            let head = chain.head_index();
            let frame = match prepare_frame(memory, chain) {
                Ok(frame) => frame,
                Err(error) => {
                    complete(tx, memory, head, 0, log);
                    bump(&counters.tx_dropped, 1);
                    bump(&counters.invalid_chains, 1);
                    log.warn(format_args!("TX chain {head} dropped: {error}"));
                    pass.used = true;
                    continue;
                }
            };
            let frame_len = frame.frame_len as u64;
            if mmds_takes(&mut self.mmds, &frame) {
                complete(tx, memory, head, 0, log);
                bump(&counters.tx_packets, 1);
                bump(&counters.tx_bytes, frame_len);
                pass.used = true;
                continue;
            }
            if !limiter.consume(frame_len, 1) {
                tx.queue.go_to_previous_position();
                return pass;
            }
            // A zeroed header: no offloads, whatever the guest's copy says by now.
            let mut header = [0u8; VNET_HDR_LEN];
            match vectored_io(fd, &mut header, &frame.payload, &mut [], true) {
                Ok(_) => {
                    bump(&counters.tx_packets, 1);
                    bump(&counters.tx_bytes, frame_len);
                }
                Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {
                    limiter.refund(frame_len, 1);
                    tx.queue.go_to_previous_position();
                    self.tx_waiting_for_tap = true;
                    return pass;
                }
                Err(error) => {
                    bump(&counters.tx_dropped, 1);
                    log.warn(format_args!(
                        "tap {} refused a frame: {error}",
                        self.tap.name()
                    ));
                }
            }
            complete(tx, memory, head, 0, log);
            pass.used = true;
        }
        pass.more = true;
        pass
    }

    /// Puts a frame held for tokens in the used ring now (the device is pausing).
    pub fn release_held(
        &mut self,
        memory: &GuestMemory,
        counters: &NetCounters,
        log: &mut LogThrottle,
    ) -> bool {
        let (Some(held), Some(rx)) = (self.held.take(), self.rx.as_mut()) else {
            return false;
        };
        complete(rx, memory, held.head, held.used_len, log);
        bump(&counters.rx_packets, 1);
        bump(&counters.rx_bytes, held.frame_len);
        true
    }
}

#[cfg(test)]
mod tests;
