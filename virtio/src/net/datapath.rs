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

use std::fmt;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use virtio_bindings::virtio_net::{
    virtio_net_hdr_v1, VIRTIO_NET_HDR_F_NEEDS_CSUM, VIRTIO_NET_HDR_GSO_NONE,
};
use virtio_queue::{DescriptorChain, QueueOwnedT, QueueT};
use vm_memory::bitmap::{Bitmap, BitmapSlice};
use vm_memory::{GuestMemory as _, Permissions, VolatileSlice};

use super::tap::Tap;
use super::VNET_HDR_LEN;
use crate::device::ActiveQueue;
use crate::rate_limiter::RateLimiter;
use crate::{GuestMemory, VirtioInterrupt};

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

type Slices<'m> = Vec<VolatileSlice<'m>>;

/// The host memory behind a chain's readable (`for_device_write == false`) or writable
/// descriptors, at most `limit` bytes of it; `Err(TooLong)` if the chain holds more and
/// `stop_at_limit` is false.
fn chain_slices<'m>(
    memory: &'m GuestMemory,
    chain: DescriptorChain<&'m GuestMemory>,
    writable: bool,
    limit: usize,
    stop_at_limit: bool,
) -> Result<(Slices<'m>, usize), ChainError> {
    let (descriptors, access) = if writable {
        (chain.writable(), Permissions::Write)
    } else {
        (chain.readable(), Permissions::Read)
    };
    let mut slices = Vec::new();
    let mut total = 0usize;
    for descriptor in descriptors {
        let mut len = descriptor.len() as usize;
        if total + len > limit {
            if !stop_at_limit {
                return Err(ChainError::TooLong);
            }
            len = limit - total;
        }
        let pieces = memory
            .get_slices(descriptor.addr(), len, access)
            .map_err(|error| ChainError::BadAddress(error.to_string()))?;
        for piece in pieces {
            let piece = piece.map_err(|error| ChainError::BadAddress(error.to_string()))?;
            if slices.len() == MAX_GUEST_PIECES {
                if stop_at_limit {
                    return Ok((slices, total));
                }
                return Err(ChainError::TooFragmented);
            }
            total += piece.len();
            slices.push(piece);
        }
        if total == limit && stop_at_limit {
            break;
        }
    }
    Ok((slices, total))
}

/// Splits `slices` after `at` bytes (which they hold).
fn split_slices<'m>(slices: Slices<'m>, at: usize) -> (Slices<'m>, Slices<'m>) {
    let mut head = Vec::new();
    let mut tail = Vec::with_capacity(slices.len());
    let mut left = at;
    for slice in slices {
        if left == 0 {
            tail.push(slice);
        } else if slice.len() <= left {
            left -= slice.len();
            head.push(slice);
        } else {
            // In bounds: 0 < left < slice.len().
            if let (Ok(first), Ok(rest)) = (slice.subslice(0, left), slice.offset(left)) {
                head.push(first);
                tail.push(rest);
            }
            left = 0;
        }
    }
    (head, tail)
}

/// One readv or writev over the device's own buffers and guest slices.
fn vectored_io(
    fd: RawFd,
    prefix: &mut [u8],
    guest: &[VolatileSlice<'_>],
    suffix: &mut [u8],
    write: bool,
) -> std::io::Result<usize> {
    let guards: Vec<_> = guest.iter().map(|slice| slice.ptr_guard_mut()).collect();
    let mut iovecs = Vec::with_capacity(guards.len() + 2);
    iovecs.push(libc::iovec {
        iov_base: prefix.as_mut_ptr().cast(),
        iov_len: prefix.len(),
    });
    iovecs.extend(guards.iter().map(|guard| libc::iovec {
        iov_base: guard.as_ptr().cast(),
        iov_len: guard.len(),
    }));
    if !suffix.is_empty() {
        iovecs.push(libc::iovec {
            iov_base: suffix.as_mut_ptr().cast(),
            iov_len: suffix.len(),
        });
    }
    let count = iovecs.len() as libc::c_int;
    loop {
        // SAFETY: every iovec covers memory valid for its length while the call runs: the
        // device's buffers are borrowed mutably, and the guest slices are mapped guest RAM
        // (the guards keep them so). The kernel reads or writes only within them. Guest
        // memory may change under the kernel's feet; that is the guest's own business.
        let result = unsafe {
            if write {
                libc::writev(fd, iovecs.as_ptr(), count)
            } else {
                libc::readv(fd, iovecs.as_ptr(), count)
            }
        };
        if result >= 0 {
            return Ok(result as usize);
        }
        let error = std::io::Error::last_os_error();
        if error.kind() != std::io::ErrorKind::Interrupted {
            return Err(error);
        }
    }
}

/// Writes `bytes` over the start of `slices` (which hold at least that many).
fn write_into<B: BitmapSlice>(slices: &[VolatileSlice<'_, B>], bytes: &[u8]) {
    let mut rest = bytes;
    for slice in slices {
        if rest.is_empty() {
            break;
        }
        let n = slice.len().min(rest.len());
        slice.copy_from(&rest[..n]);
        rest = &rest[n..];
    }
}

fn mark_dirty(slices: &[VolatileSlice<'_>], mut bytes: usize) {
    for slice in slices {
        if bytes == 0 {
            break;
        }
        let n = slice.len().min(bytes);
        slice.bitmap().mark_dirty(0, n);
        bytes -= n;
    }
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
        }
    }

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
        if !self.enabled || self.tap_broken || self.rx_tap_failed {
            return pass;
        }
        let mut spent = 0;
        while spent < BUDGET {
            if limiter.is_blocked() {
                return pass;
            }
            let Some(chain) = rx.queue.pop_descriptor_chain(memory) else {
                match rx.queue.enable_notification(memory) {
                    Ok(true) => continue,
                    Ok(false) => {}
                    Err(error) => log.warn(format_args!("RX queue: {error}")),
                }
                self.rx_has_buffers = false;
                return pass;
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
            let Some(chain) = tx.queue.pop_descriptor_chain(memory) else {
                match tx.queue.enable_notification(memory) {
                    Ok(true) => continue,
                    Ok(false) => {}
                    Err(error) => log.warn(format_args!("TX queue: {error}")),
                }
                return pass;
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
pub(crate) mod tests {
    use super::*;
    use std::os::fd::OwnedFd;
    use std::os::unix::net::UnixDatagram;

    use virtio_bindings::virtio_ring::VRING_DESC_F_WRITE;
    use virtio_queue::desc::split::Descriptor as SplitDescriptor;
    use virtio_queue::desc::RawDescriptor;
    use virtio_queue::mock::MockSplitQueue;
    use virtio_queue::Queue;
    use vm_memory::{Bytes, GuestAddress};
    use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

    use crate::rate_limiter::{RateLimiterConfig, TokenBucketConfig};

    pub const MEMORY_SIZE: usize = 0x20_0000;
    pub const QUEUE_SIZE: u16 = 16;
    pub const DATA: u64 = 0x10_0000;

    pub fn memory() -> GuestMemory {
        GuestMemory::from_ranges(&[(GuestAddress(0), MEMORY_SIZE)]).unwrap()
    }

    pub fn descriptor(addr: u64, len: u32, writable: bool) -> RawDescriptor {
        let flags = if writable {
            VRING_DESC_F_WRITE as u16
        } else {
            0
        };
        RawDescriptor::from(SplitDescriptor::new(addr, len, flags, 0))
    }

    /// Puts one chain made of `descriptors` in the avail ring, at descriptor table slot `at`.
    pub fn add_chain(mock: &MockSplitQueue<GuestMemory>, at: u16, descriptors: &[RawDescriptor]) {
        use virtio_bindings::virtio_ring::VRING_DESC_F_NEXT;
        let linked: Vec<RawDescriptor> = descriptors
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let d = SplitDescriptor::from(*d);
                let last = i + 1 == descriptors.len();
                let flags = if last {
                    d.flags() & !(VRING_DESC_F_NEXT as u16)
                } else {
                    d.flags() | VRING_DESC_F_NEXT as u16
                };
                RawDescriptor::from(SplitDescriptor::new(
                    d.addr().0,
                    d.len(),
                    flags,
                    at + i as u16 + 1,
                ))
            })
            .collect();
        mock.add_desc_chains(&linked, at).unwrap();
    }

    pub fn active_queue(mock: &MockSplitQueue<GuestMemory>) -> ActiveQueue {
        ActiveQueue {
            queue: mock.create_queue::<Queue>().unwrap(),
            kick: EventFd::new(EFD_NONBLOCK).unwrap(),
        }
    }

    /// (used ring index, (chain head, length)) entries so far.
    pub fn used(mock: &MockSplitQueue<GuestMemory>) -> Vec<(u32, u32)> {
        let count = mock.used().idx().load();
        (0..count)
            .map(|i| {
                let element = mock.used().ring().ref_at(i as usize).unwrap().load();
                (element.id(), element.len())
            })
            .collect()
    }

    pub fn frame(len: usize, seed: u8) -> Vec<u8> {
        (0..len).map(|i| seed.wrapping_add(i as u8)).collect()
    }

    struct Rig {
        memory: GuestMemory,
        pair: QueuePair,
        peer: UnixDatagram,
        limiter: RateLimiter,
        counters: NetCounters,
        log: LogThrottle,
    }

    impl Rig {
        fn new(
            rx: &MockSplitQueue<GuestMemory>,
            tx: &MockSplitQueue<GuestMemory>,
            memory: &GuestMemory,
        ) -> Rig {
            let (ours, peer) = UnixDatagram::pair().unwrap();
            peer.set_nonblocking(true).unwrap();
            let tap = Tap::stand_in(OwnedFd::from(ours));
            Rig {
                memory: memory.clone(),
                pair: QueuePair::new(tap, 0, Some(active_queue(rx)), Some(active_queue(tx))),
                peer,
                limiter: RateLimiter::unlimited(),
                counters: NetCounters::default(),
                log: LogThrottle::new("test-net"),
            }
        }

        fn rx(&mut self) -> Pass {
            self.pair.process_rx(
                &self.memory,
                &mut self.limiter,
                &self.counters,
                &mut self.log,
            )
        }

        fn tx(&mut self) -> Pass {
            self.pair.process_tx(
                &self.memory,
                &mut self.limiter,
                &self.counters,
                &mut self.log,
            )
        }

        fn peer_frames(&self) -> Vec<Vec<u8>> {
            let mut frames = Vec::new();
            let mut buf = vec![0u8; 70000];
            while let Ok(n) = self.peer.recv(&mut buf) {
                frames.push(buf[..n].to_vec());
            }
            frames
        }

        /// Sends `frame` to the device as the tap would: header first.
        fn tap_sends(&self, header: [u8; VNET_HDR_LEN], frame: &[u8]) {
            let mut datagram = header.to_vec();
            datagram.extend_from_slice(frame);
            self.peer.send(&datagram).unwrap();
        }
    }

    fn queues(
        memory: &GuestMemory,
    ) -> (
        MockSplitQueue<'_, GuestMemory>,
        MockSplitQueue<'_, GuestMemory>,
    ) {
        (
            MockSplitQueue::create(memory, GuestAddress(0), QUEUE_SIZE),
            MockSplitQueue::create(memory, GuestAddress(0x8000), QUEUE_SIZE),
        )
    }

    fn put_tx_frame(
        memory: &GuestMemory,
        addr: u64,
        header: [u8; VNET_HDR_LEN],
        frame: &[u8],
    ) -> u32 {
        memory.write_slice(&header, GuestAddress(addr)).unwrap();
        memory
            .write_slice(frame, GuestAddress(addr + VNET_HDR_LEN as u64))
            .unwrap();
        (VNET_HDR_LEN + frame.len()) as u32
    }

    #[test]
    fn header_layout_is_virtio_net_hdr_v1() {
        assert_eq!(VNET_HDR_LEN, 12);
        assert_eq!(
            (FLAGS_OFFSET, GSO_TYPE_OFFSET, NUM_BUFFERS_OFFSET),
            (0, 1, 10)
        );
    }

    #[test]
    fn tx_writes_header_and_frame_split_over_descriptors() {
        let memory = memory();
        let (rxq, txq) = queues(&memory);
        let payload = frame(100, 7);
        put_tx_frame(&memory, DATA, [0; VNET_HDR_LEN], &payload);
        // Header split across two descriptors, the frame across two more.
        add_chain(
            &txq,
            0,
            &[
                descriptor(DATA, 5, false),
                descriptor(DATA + 5, 20, false),
                descriptor(DATA + 25, 50, false),
                descriptor(DATA + 75, 37, false),
            ],
        );
        let mut rig = Rig::new(&rxq, &txq, &memory);
        let pass = rig.tx();
        assert!(pass.used);
        let frames = rig.peer_frames();
        assert_eq!(frames.len(), 1);
        assert_eq!(&frames[0][..VNET_HDR_LEN], &[0; VNET_HDR_LEN]);
        assert_eq!(&frames[0][VNET_HDR_LEN..], &payload[..]);
        assert_eq!(used(&txq), vec![(0, 0)]);
        let stats = rig.counters.snapshot();
        assert_eq!(
            (stats.tx_packets, stats.tx_bytes, stats.tx_dropped),
            (1, 100, 0)
        );
    }

    #[test]
    fn tx_drops_hostile_chains_and_keeps_going() {
        let memory = memory();
        let (rxq, txq) = queues(&memory);
        let good = frame(60, 1);
        let good_len = put_tx_frame(&memory, DATA, [0; VNET_HDR_LEN], &good);
        let mut csum_header = [0u8; VNET_HDR_LEN];
        csum_header[FLAGS_OFFSET] = VIRTIO_NET_HDR_F_NEEDS_CSUM as u8;
        let csum_len = put_tx_frame(&memory, DATA + 0x1000, csum_header, &good);
        let mut gso_header = [0u8; VNET_HDR_LEN];
        gso_header[GSO_TYPE_OFFSET] = 1; // VIRTIO_NET_HDR_GSO_TCPV4
        let gso_len = put_tx_frame(&memory, DATA + 0x2000, gso_header, &good);

        // Too short for a header.
        add_chain(&txq, 0, &[descriptor(DATA, 8, false)]);
        // Only writable descriptors: nothing to send.
        add_chain(&txq, 1, &[descriptor(DATA, good_len, true)]);
        // Outside guest memory.
        add_chain(&txq, 2, &[descriptor(MEMORY_SIZE as u64 - 16, 64, false)]);
        // Huge lengths: past the frame bound (and past memory).
        add_chain(&txq, 3, &[descriptor(DATA, u32::MAX, false)]);
        add_chain(
            &txq,
            4,
            &[
                descriptor(DATA, 40000, false),
                descriptor(DATA, 40000, false),
            ],
        );
        // Offloads that were never offered.
        add_chain(&txq, 6, &[descriptor(DATA + 0x1000, csum_len, false)]);
        add_chain(&txq, 7, &[descriptor(DATA + 0x2000, gso_len, false)]);
        // And a good one after all of that.
        add_chain(&txq, 8, &[descriptor(DATA, good_len, false)]);

        let mut rig = Rig::new(&rxq, &txq, &memory);
        rig.tx();
        let frames = rig.peer_frames();
        assert_eq!(frames.len(), 1, "only the good frame goes out");
        assert_eq!(&frames[0][VNET_HDR_LEN..], &good[..]);
        let heads: Vec<u32> = used(&txq).iter().map(|&(head, _)| head).collect();
        assert_eq!(
            heads,
            vec![0, 1, 2, 3, 4, 6, 7, 8],
            "every chain comes back"
        );
        let stats = rig.counters.snapshot();
        assert_eq!(
            (stats.tx_packets, stats.tx_dropped, stats.invalid_chains),
            (1, 7, 7)
        );
    }

    #[test]
    fn tx_waits_for_a_full_tap_and_resends_the_same_chain() {
        let memory = memory();
        let (rxq, txq) = queues(&memory);
        let payload = frame(1000, 3);
        let len = put_tx_frame(&memory, DATA, [0; VNET_HDR_LEN], &payload);
        for slot in 0..QUEUE_SIZE {
            add_chain(&txq, slot, &[descriptor(DATA, len, false)]);
        }
        let mut rig = Rig::new(&rxq, &txq, &memory);
        // Shrink the socket buffer so the "tap" fills up quickly.
        let size: libc::c_int = 4096;
        // SAFETY: SO_SNDBUF reads one c_int from the pointer given, which points at one.
        unsafe {
            libc::setsockopt(
                rig.pair.tap.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_SNDBUF,
                (&size as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as u32,
            );
        }
        rig.tx();
        assert!(rig.pair.tx_waiting_for_tap, "the tap filled up");
        let sent_first = used(&txq).len();
        assert!(sent_first < QUEUE_SIZE as usize);
        assert_eq!(
            rig.counters.snapshot().tx_dropped,
            0,
            "a full tap drops nothing"
        );
        let mut received = rig.peer_frames().len();
        // The tap is writable again: the device carries on where it stopped.
        rig.pair.tx_waiting_for_tap = false;
        while used(&txq).len() < QUEUE_SIZE as usize {
            rig.tx();
            received += rig.peer_frames().len();
            rig.pair.tx_waiting_for_tap = false;
        }
        assert_eq!(received, QUEUE_SIZE as usize, "every frame exactly once");
        assert_eq!(rig.counters.snapshot().tx_packets, QUEUE_SIZE as u64);
    }

    #[test]
    fn rx_reads_a_frame_into_a_chain_and_sets_num_buffers() {
        let memory = memory();
        let (rxq, txq) = queues(&memory);
        // Header and frame across three writable descriptors, a readable one in front that
        // the device must not write to.
        memory
            .write_slice(&[0xee; 16], GuestAddress(DATA + 0x3000))
            .unwrap();
        add_chain(
            &rxq,
            0,
            &[
                descriptor(DATA + 0x3000, 16, false),
                descriptor(DATA, 6, true),
                descriptor(DATA + 0x100, 40, true),
                descriptor(DATA + 0x200, 2000, true),
            ],
        );
        let mut rig = Rig::new(&rxq, &txq, &memory);
        let payload = frame(300, 9);
        let mut tap_header = [0u8; VNET_HDR_LEN];
        tap_header[FLAGS_OFFSET] = 2; // DATA_VALID: not for a guest without GUEST_CSUM
        rig.tap_sends(tap_header, &payload);
        let pass = rig.rx();
        assert!(pass.used);
        assert_eq!(used(&rxq), vec![(0, (VNET_HDR_LEN + 300) as u32)]);
        let mut header = [0u8; VNET_HDR_LEN];
        memory
            .read_slice(&mut header[..6], GuestAddress(DATA))
            .unwrap();
        memory
            .read_slice(&mut header[6..], GuestAddress(DATA + 0x100))
            .unwrap();
        let mut expected = [0u8; VNET_HDR_LEN];
        expected[NUM_BUFFERS_OFFSET] = 1;
        assert_eq!(header, expected);
        let mut got = vec![0u8; 300];
        memory
            .read_slice(&mut got[..34], GuestAddress(DATA + 0x106))
            .unwrap();
        memory
            .read_slice(&mut got[34..], GuestAddress(DATA + 0x200))
            .unwrap();
        assert_eq!(got, payload);
        let mut untouched = [0u8; 16];
        memory
            .read_slice(&mut untouched, GuestAddress(DATA + 0x3000))
            .unwrap();
        assert_eq!(untouched, [0xee; 16]);
        let stats = rig.counters.snapshot();
        assert_eq!((stats.rx_packets, stats.rx_bytes), (1, 300));
        // The only chain is used: the tap is not read until the driver adds buffers.
        assert!(!rig.pair.rx_has_buffers);
    }

    #[test]
    fn rx_drops_frames_too_big_for_the_chain_and_reuses_it() {
        let memory = memory();
        let (rxq, txq) = queues(&memory);
        add_chain(&rxq, 0, &[descriptor(DATA, 200, true)]);
        let mut rig = Rig::new(&rxq, &txq, &memory);
        rig.tap_sends([0; VNET_HDR_LEN], &frame(1000, 1));
        rig.tap_sends([0; VNET_HDR_LEN], &frame(200 - VNET_HDR_LEN + 1, 2));
        rig.tap_sends([0; VNET_HDR_LEN], &frame(200 - VNET_HDR_LEN, 3));
        rig.rx();
        assert_eq!(
            used(&rxq),
            vec![(0, 200)],
            "the exact fit lands in the chain"
        );
        let mut got = vec![0u8; 200 - VNET_HDR_LEN];
        memory
            .read_slice(&mut got, GuestAddress(DATA + VNET_HDR_LEN as u64))
            .unwrap();
        assert_eq!(got, frame(200 - VNET_HDR_LEN, 3));
        let stats = rig.counters.snapshot();
        assert_eq!((stats.rx_packets, stats.rx_dropped), (1, 2));
    }

    #[test]
    fn rx_returns_chains_that_cannot_hold_a_frame() {
        let memory = memory();
        let (rxq, txq) = queues(&memory);
        // Readable only, too short, outside memory, huge: none can take a frame.
        add_chain(&rxq, 0, &[descriptor(DATA, 2000, false)]);
        add_chain(&rxq, 1, &[descriptor(DATA, 10, true)]);
        add_chain(&rxq, 2, &[descriptor(MEMORY_SIZE as u64 - 8, 2000, true)]);
        add_chain(&rxq, 3, &[descriptor(u64::MAX - 100, u32::MAX, true)]);
        // A huge descriptor inside memory is fine: the device uses what a frame needs.
        add_chain(
            &rxq,
            4,
            &[descriptor(0x1000, (MEMORY_SIZE - 0x1000) as u32, true)],
        );
        let mut rig = Rig::new(&rxq, &txq, &memory);
        rig.tap_sends([0; VNET_HDR_LEN], &frame(64, 5));
        rig.rx();
        assert_eq!(
            used(&rxq),
            vec![
                (0, 0),
                (1, 0),
                (2, 0),
                (3, 0),
                (4, (VNET_HDR_LEN + 64) as u32)
            ]
        );
        let stats = rig.counters.snapshot();
        assert_eq!((stats.invalid_chains, stats.rx_packets), (4, 1));
    }

    #[test]
    fn rx_stops_watching_the_tap_when_the_queue_is_empty() {
        let memory = memory();
        let (rxq, txq) = queues(&memory);
        add_chain(&rxq, 0, &[descriptor(DATA, 2000, true)]);
        let mut rig = Rig::new(&rxq, &txq, &memory);
        rig.tap_sends([0; VNET_HDR_LEN], &frame(64, 1));
        rig.tap_sends([0; VNET_HDR_LEN], &frame(64, 2));
        rig.rx();
        assert_eq!(used(&rxq).len(), 1);
        assert!(!rig.pair.rx_has_buffers);
        assert!(
            !rig.pair.wants_rx(&rig.limiter),
            "no buffers: the tap is not watched"
        );
        // The second frame waits in the tap for a buffer.
        add_chain(&rxq, 1, &[descriptor(DATA + 0x1000, 2000, true)]);
        rig.pair.rx_has_buffers = true; // what an RX kick does
        assert!(rig.pair.wants_rx(&rig.limiter));
        rig.rx();
        assert_eq!(used(&rxq).len(), 2);
        let mut got = vec![0u8; 64];
        memory
            .read_slice(&mut got, GuestAddress(DATA + 0x1000 + VNET_HDR_LEN as u64))
            .unwrap();
        assert_eq!(got, frame(64, 2));
    }

    #[test]
    fn rx_drops_frames_with_offloads_from_the_tap() {
        let memory = memory();
        let (rxq, txq) = queues(&memory);
        add_chain(&rxq, 0, &[descriptor(DATA, 2000, true)]);
        let mut rig = Rig::new(&rxq, &txq, &memory);
        let mut header = [0u8; VNET_HDR_LEN];
        header[GSO_TYPE_OFFSET] = 1;
        rig.tap_sends(header, &frame(64, 1));
        rig.tap_sends([0; VNET_HDR_LEN], &frame(64, 2));
        rig.rx();
        assert_eq!(used(&rxq).len(), 1);
        assert_eq!(rig.counters.snapshot().rx_dropped, 1);
    }

    #[test]
    fn rate_limited_rx_holds_the_frame_until_tokens_come() {
        let memory = memory();
        let (rxq, txq) = queues(&memory);
        add_chain(&rxq, 0, &[descriptor(DATA, 2000, true)]);
        add_chain(&rxq, 1, &[descriptor(DATA + 0x1000, 2000, true)]);
        let mut rig = Rig::new(&rxq, &txq, &memory);
        rig.limiter = RateLimiter::new(RateLimiterConfig {
            bandwidth: None,
            ops: Some(TokenBucketConfig {
                size: 1,
                one_time_burst: 0,
                refill_time_ms: 50,
            }),
        })
        .unwrap();
        rig.tap_sends([0; VNET_HDR_LEN], &frame(64, 1));
        rig.tap_sends([0; VNET_HDR_LEN], &frame(64, 2));
        rig.rx();
        assert_eq!(used(&rxq).len(), 1, "one token, one frame");
        assert!(
            rig.pair.held.is_some(),
            "the second frame waits in its chain"
        );
        assert!(!rig.pair.wants_rx(&rig.limiter));
        rig.rx();
        assert_eq!(used(&rxq).len(), 1, "still blocked");
        // Wait for the timer as the worker would.
        let mut poll = libc::pollfd {
            fd: rig.limiter.timer_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll reads and writes the one pollfd given.
        assert_eq!(unsafe { libc::poll(&mut poll, 1, 2000) }, 1);
        rig.limiter.on_timer();
        rig.rx();
        assert_eq!(used(&rxq).len(), 2);
        assert!(rig.pair.held.is_none());
        assert_eq!(rig.counters.snapshot().rx_packets, 2);
    }

    #[test]
    fn rate_limited_tx_leaves_the_chain_in_the_queue() {
        let memory = memory();
        let (rxq, txq) = queues(&memory);
        let len = put_tx_frame(&memory, DATA, [0; VNET_HDR_LEN], &frame(100, 1));
        add_chain(&txq, 0, &[descriptor(DATA, len, false)]);
        add_chain(&txq, 1, &[descriptor(DATA, len, false)]);
        let mut rig = Rig::new(&rxq, &txq, &memory);
        rig.limiter = RateLimiter::new(RateLimiterConfig {
            bandwidth: Some(TokenBucketConfig {
                size: 150,
                one_time_burst: 0,
                refill_time_ms: 20,
            }),
            ops: None,
        })
        .unwrap();
        rig.tx();
        assert_eq!(used(&txq).len(), 1);
        assert!(rig.limiter.is_blocked());
        assert_eq!(
            rig.pair.tx.as_ref().unwrap().queue.next_avail(),
            1,
            "the second chain is not taken"
        );
        std::thread::sleep(Duration::from_millis(40));
        rig.limiter.on_timer();
        rig.tx();
        assert_eq!(used(&txq).len(), 2);
        assert_eq!(rig.peer_frames().len(), 2);
    }

    #[test]
    fn split_slices_splits_inside_a_slice() {
        let memory = memory();
        let slices: Slices = memory
            .get_slices(GuestAddress(DATA), 30, Permissions::Read)
            .unwrap()
            .map(Result::unwrap)
            .collect();
        let (head, tail) = split_slices(slices, 12);
        assert_eq!(head.iter().map(|s| s.len()).sum::<usize>(), 12);
        assert_eq!(tail.iter().map(|s| s.len()).sum::<usize>(), 18);
    }

    #[test]
    fn chain_slices_refuses_too_many_pieces() {
        let memory = memory();
        let mock = MockSplitQueue::create(&memory, GuestAddress(0), 16);
        // An indirect table of 2000 one-byte descriptors.
        let table = GuestAddress(0x18_0000);
        for i in 0..2000u64 {
            let next = (i + 1) as u16;
            let flags = if i + 1 < 2000 {
                virtio_bindings::virtio_ring::VRING_DESC_F_NEXT as u16
            } else {
                0
            };
            let d = RawDescriptor::from(SplitDescriptor::new(DATA + i, 1, flags, next));
            memory.write_obj(d, table.unchecked_add(i * 16)).unwrap();
        }
        use vm_memory::Address;
        let head = RawDescriptor::from(SplitDescriptor::new(
            table.0,
            2000 * 16,
            virtio_bindings::virtio_ring::VRING_DESC_F_INDIRECT as u16,
            0,
        ));
        mock.add_desc_chains(&[head], 0).unwrap();
        let mut queue: Queue = mock.create_queue().unwrap();
        let chain = queue.pop_descriptor_chain(&memory).unwrap();
        assert_eq!(
            chain_slices(&memory, chain.clone(), false, MAX_FRAME_LEN, false).err(),
            Some(ChainError::TooFragmented)
        );
        let (slices, total) = chain_slices(&memory, chain, false, MAX_FRAME_LEN, true).unwrap();
        assert_eq!((slices.len(), total), (MAX_GUEST_PIECES, MAX_GUEST_PIECES));
    }
}
