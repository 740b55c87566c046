//! `virtio-hostile`: a hostile driver. For every virtio device present (block, entropy,
//! socket, network) it attacks the device through its rings and registers the way a
//! malicious guest would, and after each attack checks that gpuvm is still there and that
//! the device (after a reset where the attack left it broken) serves a good request again.
//!
//! One line per attack, `virtio-hostile: <device> <attack>: <outcome>`, where the outcome is
//! what the device did (`answered status 1`, `returned 0 bytes`, `answered RST`, `dropped`
//! when nothing came back within [`ATTACK_WAIT_MS`], `needs reset` when the device set
//! DEVICE_NEEDS_RESET, `refused ...` for register writes), followed by `; stuck until reset`
//! when the good request only worked after a reset the outcome did not call for. Then
//! `virtio-hostile: ok attacks=<n>` and exit 0; a `FAIL` line and exit 1 when a device did
//! not work again after a reset, wrote guest memory outside the device-writable buffers it
//! was given (the driver's whole area is compared with a copy taken before each attack),
//! claimed to have written more than it was given, accepted a request it had to refuse
//! (a sector past the end, a length that is not a multiple of 512), or started with rings
//! outside RAM without setting DEVICE_NEEDS_RESET.
//!
//! Its memory is its own: [`AREA_START`]..[`AREA_END`] (48-56 MiB), apart from the other
//! virtio workloads' DMA area (40-48 MiB) and the `pci` workload's (32 MiB). The first 4 MiB
//! are watched (a guard that no descriptor ever names, the rings, the buffers and the
//! indirect tables); the copy goes into the next 4 MiB. Attacks also name the last bytes of
//! RAM, guest-physical 0 (an available ring there) and the device's own BAR.

// Errors are short texts on the stack (there is no allocator); they are only ever printed.
#![allow(clippy::result_large_err)]

use core::fmt::{self, Write};
use core::sync::atomic::{fence, Ordering};

use super::pci;
use super::{Deadline, EXIT_SETUP};
use crate::bootinfo::{BootInfo, E820_RAM};
use crate::console::exit;
use crate::println;

const NAME: &str = "virtio-hostile";

/// The watched area: guard, rings, buffers, indirect tables.
const AREA_START: u64 = 48 << 20;
const AREA_LEN: u64 = 4 << 20;
/// The copy of the watched area taken before each attack.
const SHADOW: u64 = AREA_START + AREA_LEN;
const AREA_END: u64 = SHADOW + AREA_LEN;
/// Queue `q`'s descriptor table, available ring and used ring: one 4 KiB page each at
/// `RINGS + q * RING_STRIDE` (up to 256 entries fit a page).
const RINGS: u64 = AREA_START + (64 << 10);
const RING_STRIDE: u64 = 16 << 10;
const MAX_QUEUES: usize = 3;
const MAX_QUEUE_SIZE: u16 = 256;
/// Request headers, the block status byte, data buffers.
const HDR: u64 = AREA_START + (1 << 20);
const STATUS: u64 = HDR + 0x100;
const DATA: u64 = HDR + 0x1000;
const DATA2: u64 = HDR + 0x2000;
/// The socket device's receive buffers: buffer `i` at `RX + i * 4 KiB`, descriptor `i`.
const RX: u64 = HDR + 0x1_0000;
const RX_BUFFERS: u16 = 8;
const RX_LEN: u32 = 44 + 256;
/// Indirect descriptor tables (up to 2^16 entries, 1 MiB).
const INDIRECT: u64 = HDR + (1 << 20);
/// Where 4 GiB-long buffers start: everything from here to the end of the area is theirs.
const HUGE: u64 = INDIRECT + (1 << 20);
const _: () = assert!(HUGE + (1 << 20) == AREA_START + AREA_LEN);

/// An address far outside guest RAM (and every MMIO window).
const OUTSIDE: u64 = 0xffff_ffff_f000;
/// How long an attacked device may take to answer before the chain counts as dropped.
const ATTACK_WAIT_MS: u64 = 1_000;
/// How long a good request may take.
const GOOD_WAIT_MS: u64 = 2_000;

const VIRTIO_VENDOR: u16 = 0x1af4;
const MODERN_DEVICE_BASE: u16 = 0x1040;
const F_INDIRECT_DESC: u64 = 1 << 28;
const F_VERSION_1: u64 = 1 << 32;

const S_ACKNOWLEDGE: u8 = 1;
const S_DRIVER: u8 = 2;
const S_DRIVER_OK: u8 = 4;
const S_FEATURES_OK: u8 = 8;
const S_NEEDS_RESET: u8 = 0x40;

const COMMON_DEVICE_FEATURE_SELECT: u64 = 0x00;
const COMMON_DEVICE_FEATURE: u64 = 0x04;
const COMMON_DRIVER_FEATURE_SELECT: u64 = 0x08;
const COMMON_DRIVER_FEATURE: u64 = 0x0c;
const COMMON_NUM_QUEUES: u64 = 0x12;
const COMMON_DEVICE_STATUS: u64 = 0x14;
const COMMON_QUEUE_SELECT: u64 = 0x16;
const COMMON_QUEUE_SIZE: u64 = 0x18;
const COMMON_QUEUE_MSIX_VECTOR: u64 = 0x1a;
const COMMON_QUEUE_ENABLE: u64 = 0x1c;
const COMMON_QUEUE_NOTIFY_OFF: u64 = 0x1e;
const COMMON_QUEUE_DESC: u64 = 0x20;
const COMMON_QUEUE_DRIVER: u64 = 0x28;
const COMMON_QUEUE_DEVICE: u64 = 0x30;

const DESC_NEXT: u16 = 1;
const DESC_WRITE: u16 = 2;
const DESC_INDIRECT: u16 = 4;

const BLK_T_IN: u32 = 0;
const BLK_T_OUT: u32 = 1;
const BLK_T_DISCARD: u32 = 11;
const BLK_T_WRITE_ZEROES: u32 = 13;
const BLK_MAGIC: &[u8; 8] = b"GPUVMBLK";
/// The one sector the good block request writes (the host test leaves it out of its
/// comparison); the attacks aim their refused writes at sectors 16, 20 and 24.
pub const BLK_SCRATCH_SECTOR: u64 = 1;

const VSOCK_HOST_CID: u64 = 2;
const VSOCK_HEADER: u32 = 44;
const VSOCK_TYPE_STREAM: u16 = 1;
const VSOCK_OP_REQUEST: u16 = 1;
const VSOCK_OP_RST: u16 = 3;
const VSOCK_OP_RW: u16 = 5;
/// A host port nobody listens on (`<uds>_4444` does not exist): a REQUEST there is answered
/// with RST.
const VSOCK_CLOSED_PORT: u32 = 4444;

/// virtio_net_hdr_v1 and a minimal Ethernet frame.
const NET_HEADER: u32 = 12;
const NET_FRAME: u32 = 60;

// ---------------------------------------------------------------------------------------
// Memory and MMIO access.

fn mmio_read(addr: u64, width: u32) -> u64 {
    // SAFETY: `addr` is in a BAR of a virtio device (below MAPPED_LIMIT, identity mapped,
    // user accessible) or guest RAM of the driver's area; the access touches nothing else.
    unsafe {
        match width {
            1 => u64::from((addr as *const u8).read_volatile()),
            2 => u64::from((addr as *const u16).read_volatile()),
            4 => u64::from((addr as *const u32).read_volatile()),
            _ => (addr as *const u64).read_volatile(),
        }
    }
}

fn mmio_write(addr: u64, width: u32, value: u64) {
    // SAFETY: as in `mmio_read`.
    unsafe {
        match width {
            1 => (addr as *mut u8).write_volatile(value as u8),
            2 => (addr as *mut u16).write_volatile(value as u16),
            4 => (addr as *mut u32).write_volatile(value as u32),
            _ => (addr as *mut u64).write_volatile(value),
        }
    }
}

fn put8(addr: u64, value: u8) {
    mmio_write(addr, 1, u64::from(value));
}
fn put16(addr: u64, value: u16) {
    mmio_write(addr, 2, u64::from(value));
}
fn put32(addr: u64, value: u32) {
    mmio_write(addr, 4, u64::from(value));
}
fn put64(addr: u64, value: u64) {
    mmio_write(addr, 8, value);
}
fn get8(addr: u64) -> u8 {
    mmio_read(addr, 1) as u8
}
fn get16(addr: u64) -> u16 {
    mmio_read(addr, 2) as u16
}
fn get32(addr: u64) -> u32 {
    mmio_read(addr, 4) as u32
}

/// A 16-bit store to low guest-physical memory (address 0 included), where a Rust pointer
/// may not go.
fn poke16_low(addr: u64, value: u16) {
    // SAFETY: guest-physical memory below 1 MiB is identity mapped, user writable RAM; the
    // caller saved what it overwrites and puts it back.
    unsafe {
        core::arch::asm!("mov word ptr [{a}], {v:x}", a = in(reg) addr, v = in(reg) value,
            options(nostack, preserves_flags));
    }
}

fn peek64_low(addr: u64) -> u64 {
    let value: u64;
    // SAFETY: as in `poke16_low`; a read.
    unsafe {
        core::arch::asm!("mov {v}, qword ptr [{a}]", a = in(reg) addr, v = out(reg) value,
            options(nostack, preserves_flags, readonly));
    }
    value
}

fn poke64_low(addr: u64, value: u64) {
    // SAFETY: as in `poke16_low`.
    unsafe {
        core::arch::asm!("mov qword ptr [{a}], {v}", a = in(reg) addr, v = in(reg) value,
            options(nostack, preserves_flags));
    }
}

fn fill(addr: u64, len: u64, byte: u8) {
    // SAFETY: the range lies in the driver's area (identity mapped RAM it owns).
    unsafe { core::ptr::write_bytes(addr as *mut u8, byte, len as usize) };
    fence(Ordering::SeqCst);
}

fn copy(to: u64, from: u64, len: u64) {
    fence(Ordering::SeqCst);
    // SAFETY: both ranges lie in the driver's area and do not overlap.
    unsafe { core::ptr::copy_nonoverlapping(from as *const u8, to as *mut u8, len as usize) };
    fence(Ordering::SeqCst);
}

// ---------------------------------------------------------------------------------------
// Outcome text without an allocator.

struct Text {
    bytes: [u8; 160],
    len: usize,
}

impl Text {
    fn new() -> Text {
        Text {
            bytes: [0; 160],
            len: 0,
        }
    }
}

impl Write for Text {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        for &byte in s.as_bytes() {
            if self.len < self.bytes.len() {
                self.bytes[self.len] = byte;
                self.len += 1;
            }
        }
        Ok(())
    }
}

impl fmt::Display for Text {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(core::str::from_utf8(&self.bytes[..self.len]).unwrap_or("?"))
    }
}

macro_rules! text {
    ($($arg:tt)*) => {{
        let mut text = Text::new();
        let _ = write!(text, $($arg)*);
        text
    }};
}

/// What an attack did, and whether the device must be reset before the next request.
struct Outcome {
    text: Text,
    reset: bool,
}

impl Outcome {
    fn fine(text: Text) -> Outcome {
        Outcome { text, reset: false }
    }

    fn broken(text: Text) -> Outcome {
        Outcome { text, reset: true }
    }
}

fn fail(what: fmt::Arguments) -> ! {
    super::fail(NAME, what)
}

// ---------------------------------------------------------------------------------------
// The devices and their virtio-pci structures.

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Blk,
    Rng,
    Vsock,
    Net,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Blk => "blk",
            Kind::Rng => "rng",
            Kind::Vsock => "vsock",
            Kind::Net => "net",
        }
    }

    fn device_type(self) -> u16 {
        match self {
            Kind::Net => 1,
            Kind::Blk => 2,
            Kind::Rng => 4,
            Kind::Vsock => 19,
        }
    }

    /// Queues the driver sets up: block and entropy 1, net rx + tx, vsock rx, tx, event.
    fn queues(self) -> u16 {
        match self {
            Kind::Blk | Kind::Rng => 1,
            Kind::Net => 2,
            Kind::Vsock => 3,
        }
    }

    /// The queue the chain attacks go to (net and vsock: transmit).
    fn attack_queue(self) -> u16 {
        match self {
            Kind::Blk | Kind::Rng => 0,
            Kind::Net | Kind::Vsock => 1,
        }
    }

    /// Optional features acked besides VERSION_1.
    fn features(self) -> u64 {
        match self {
            Kind::Rng => F_INDIRECT_DESC,
            _ => 0,
        }
    }
}

#[derive(Clone, Copy)]
struct Dev {
    kind: Kind,
    pci_device: u8,
    bar0: u64,
    common: u64,
    notify: u64,
    notify_multiplier: u32,
    notify_len: u32,
    device_config: u64,
    device_config_len: u32,
}

impl Dev {
    /// The first modern virtio device of `kind` on bus 0, with memory decoding and bus
    /// mastering on; `None` when there is none.
    fn find(kind: Kind) -> Option<Dev> {
        let device_id = MODERN_DEVICE_BASE + kind.device_type();
        let device = pci::find(VIRTIO_VENDOR, device_id)?;
        pci::enable_memory_and_bus_master(device);
        let mut common = None;
        let mut notify = None;
        let mut device_config = None;
        let mut notify_multiplier = 0;
        for (pointer, id) in pci::capabilities(device) {
            if id != pci::CAP_VENDOR {
                continue;
            }
            let cfg_type = (pci::config_read(device, pointer) >> 24) as u8;
            let bar = pci::config_read(device, pointer + 4) as u8;
            let offset = pci::config_read(device, pointer + 8);
            let len = pci::config_read(device, pointer + 12);
            let Ok(base) = pci::bar_address(device, bar) else {
                continue;
            };
            let region = (base + u64::from(offset), len);
            if region.0 + u64::from(len) > crate::boot::MAPPED_LIMIT {
                continue;
            }
            match cfg_type {
                1 if common.is_none() => common = Some(region),
                2 if notify.is_none() => {
                    notify = Some(region);
                    notify_multiplier = pci::config_read(device, pointer + 16);
                }
                4 if device_config.is_none() => device_config = Some(region),
                _ => {}
            }
        }
        let (Some(common), Some(notify)) = (common, notify) else {
            fail(format_args!(
                "{}: virtio device at 00:{device:02x}.0 lacks its common or notify structure",
                kind.name()
            ));
        };
        let bar0 = pci::bar_address(device, 0).unwrap_or(common.0);
        let device_config = device_config.unwrap_or((0, 0));
        println!(
            "{NAME}: {} at 00:{device:02x}.0, BAR0 {bar0:#x}, common {:#x}, notify {:#x}",
            kind.name(),
            common.0,
            notify.0
        );
        Some(Dev {
            kind,
            pci_device: device,
            bar0,
            common: common.0,
            notify: notify.0,
            notify_multiplier,
            notify_len: notify.1,
            device_config: device_config.0,
            device_config_len: device_config.1,
        })
    }

    fn status(&self) -> u8 {
        get8(self.common + COMMON_DEVICE_STATUS)
    }

    fn set_status(&self, status: u8) {
        put8(self.common + COMMON_DEVICE_STATUS, status);
    }

    /// Writes 0 to device_status and waits for it to read 0 (a device that does not reset
    /// within a second is a failure).
    fn reset(&self) {
        self.set_status(0);
        let deadline = Deadline::after_ms(ATTACK_WAIT_MS);
        while self.status() != 0 {
            if deadline.expired() {
                fail(format_args!(
                    "{}: device status still {:#x} a second after a reset",
                    self.kind.name(),
                    self.status()
                ));
            }
            crate::arch::pause();
        }
    }

    fn num_queues(&self) -> u16 {
        get16(self.common + COMMON_NUM_QUEUES)
    }

    fn select(&self, queue: u16) {
        put16(self.common + COMMON_QUEUE_SELECT, queue);
    }

    fn offered_features(&self) -> u64 {
        put32(self.common + COMMON_DEVICE_FEATURE_SELECT, 0);
        let low = get32(self.common + COMMON_DEVICE_FEATURE);
        put32(self.common + COMMON_DEVICE_FEATURE_SELECT, 1);
        let high = get32(self.common + COMMON_DEVICE_FEATURE);
        u64::from(high) << 32 | u64::from(low)
    }

    fn write_driver_features(&self, features: u64) {
        put32(self.common + COMMON_DRIVER_FEATURE_SELECT, 0);
        put32(self.common + COMMON_DRIVER_FEATURE, features as u32);
        put32(self.common + COMMON_DRIVER_FEATURE_SELECT, 1);
        put32(self.common + COMMON_DRIVER_FEATURE, (features >> 32) as u32);
    }

    /// ACKNOWLEDGE, DRIVER, VERSION_1 plus `optional` where offered, FEATURES_OK.
    fn negotiate(&self, optional: u64) -> Result<u64, Text> {
        self.set_status(S_ACKNOWLEDGE);
        self.set_status(S_ACKNOWLEDGE | S_DRIVER);
        let offered = self.offered_features();
        if offered & F_VERSION_1 == 0 {
            return Err(text!("VERSION_1 not offered (features {offered:#x})"));
        }
        let accepted = offered & (F_VERSION_1 | optional);
        self.write_driver_features(accepted);
        self.set_status(S_ACKNOWLEDGE | S_DRIVER | S_FEATURES_OK);
        let status = self.status();
        if status & S_FEATURES_OK == 0 {
            return Err(text!(
                "features {accepted:#x} not accepted (status {status:#x})"
            ));
        }
        Ok(accepted)
    }

    fn driver_ok(&self) -> u8 {
        self.set_status(S_ACKNOWLEDGE | S_DRIVER | S_FEATURES_OK | S_DRIVER_OK);
        self.status()
    }

    fn config64(&self, offset: u64) -> u64 {
        if self.device_config == 0 {
            return 0;
        }
        let low = get32(self.device_config + offset);
        let high = get32(self.device_config + offset + 4);
        u64::from(high) << 32 | u64::from(low)
    }
}

/// One split virtqueue as the driver wrote it.
#[derive(Clone, Copy, Default)]
struct Ring {
    queue: u16,
    size: u16,
    desc: u64,
    avail: u64,
    used: u64,
    notify: u64,
    /// The available index the driver publishes next.
    next_avail: u16,
}

impl Ring {
    fn set_desc(&self, table: u64, index: u32, d: D) {
        let entry = table + 16 * u64::from(index);
        put64(entry, d.addr);
        put32(entry + 8, d.len);
        put16(entry + 12, d.flags);
        put16(entry + 14, d.next);
    }

    /// Puts `head` in the available ring and publishes it.
    fn offer(&mut self, head: u16) {
        put16(
            self.avail + 4 + 2 * u64::from(self.next_avail % self.size),
            head,
        );
        fence(Ordering::SeqCst);
        self.next_avail = self.next_avail.wrapping_add(1);
        put16(self.avail + 2, self.next_avail);
    }

    fn notify(&self) {
        fence(Ordering::SeqCst);
        put16(self.notify, self.queue);
    }

    fn used_index(&self) -> u16 {
        get16(self.used + 2)
    }

    /// The used element at index `at` (id, len).
    fn used_element(&self, at: u16) -> (u32, u32) {
        fence(Ordering::SeqCst);
        let element = self.used + 4 + 8 * u64::from(at % self.size);
        (get32(element), get32(element + 4))
    }

    /// The first used element after `since`, waiting at most `ms`.
    fn wait_used(&self, since: u16, ms: u64) -> Option<(u32, u32)> {
        let deadline = Deadline::after_ms(ms);
        loop {
            if self.used_index() != since {
                return Some(self.used_element(since));
            }
            if deadline.expired() {
                return None;
            }
            crate::arch::pause();
        }
    }
}

/// A descriptor as the attack writes it.
#[derive(Clone, Copy)]
struct D {
    addr: u64,
    len: u32,
    flags: u16,
    next: u16,
}

impl D {
    fn r(addr: u64, len: u32) -> D {
        D {
            addr,
            len,
            flags: 0,
            next: 0,
        }
    }

    fn w(addr: u64, len: u32) -> D {
        D {
            addr,
            len,
            flags: DESC_WRITE,
            next: 0,
        }
    }

    fn to(mut self, next: u16) -> D {
        self.flags |= DESC_NEXT;
        self.next = next;
        self
    }
}

/// A well-formed request for the attacked queue, which the chain attacks bend: up to four
/// descriptors, and the one whose address and length the attacks change (`payload`).
#[derive(Clone, Copy)]
struct Template {
    d: [D; 4],
    n: usize,
    payload: usize,
}

impl Template {
    /// The descriptors chained 0 -> 1 -> ... in table order.
    fn linked(&self) -> [D; 4] {
        let mut d = self.d;
        for (i, entry) in d.iter_mut().enumerate().take(self.n - 1) {
            *entry = entry.to(i as u16 + 1);
        }
        d
    }
}

// ---------------------------------------------------------------------------------------
// One device under attack.

struct Session {
    dev: Dev,
    rings: [Ring; MAX_QUEUES],
    features: u64,
    /// Block: capacity in sectors. Socket: the guest's CID.
    capacity: u64,
    cid: u64,
    ram_end: u64,
    /// Good requests so far (each writes a different pattern / uses a different port).
    checks: u32,
    /// Attacks on this device so far (each names its own socket port).
    tag: u32,
    /// The device must be reset and set up again before the next request.
    dirty: bool,
    /// Receive queue (socket): used elements consumed so far, buffers to give back.
    rx_seen: u16,
    rx_repost: u16,
    /// Ranges the device may write during the current attack (clipped to the area).
    writable: [(u64, u64); 24],
    writable_len: usize,
    /// Whether the area was copied for the current attack and awaits the comparison.
    armed: bool,
    /// The attack under way, for failure messages.
    current: Text,
    /// `virtio-hostile storm`: the notification storm too.
    storm: bool,
}

impl Session {
    fn new(dev: Dev, ram_end: u64) -> Session {
        Session {
            dev,
            rings: [Ring::default(); MAX_QUEUES],
            features: 0,
            capacity: 0,
            cid: 0,
            ram_end,
            checks: 0,
            tag: 0,
            dirty: true,
            rx_seen: 0,
            rx_repost: 0,
            writable: [(0, 0); 24],
            writable_len: 0,
            armed: false,
            current: Text::new(),
            storm: false,
        }
    }

    fn kind(&self) -> Kind {
        self.dev.kind
    }

    fn attack_ring(&self) -> Ring {
        self.rings[usize::from(self.kind().attack_queue())]
    }

    /// Queue `queue`'s rings from its registers; `size` is written unless `None` (then the
    /// size the device reports is used). The rings are zeroed, interrupts suppressed.
    fn setup_queue(&mut self, queue: u16, size: Option<u16>) -> Result<Ring, Text> {
        self.dev.select(queue);
        let max = get16(self.dev.common + COMMON_QUEUE_SIZE);
        if max == 0 {
            return Err(text!("queue {queue} has size 0"));
        }
        let size = match size {
            Some(size) => {
                put16(self.dev.common + COMMON_QUEUE_SIZE, size);
                get16(self.dev.common + COMMON_QUEUE_SIZE)
            }
            None => max,
        };
        if size == 0 || size > MAX_QUEUE_SIZE {
            return Err(text!("queue {queue} size reads {size}"));
        }
        let notify_off = get16(self.dev.common + COMMON_QUEUE_NOTIFY_OFF);
        let notify_offset = u64::from(notify_off) * u64::from(self.dev.notify_multiplier);
        if notify_offset + 2 > u64::from(self.dev.notify_len) {
            return Err(text!(
                "queue {queue} notify offset {notify_offset:#x} outside"
            ));
        }
        let base = RINGS + u64::from(queue) * RING_STRIDE;
        fill(base, 3 * 4096, 0);
        let ring = Ring {
            queue,
            size,
            desc: base,
            avail: base + 4096,
            used: base + 8192,
            notify: self.dev.notify + notify_offset,
            next_avail: 0,
        };
        // VIRTQ_AVAIL_F_NO_INTERRUPT: the driver polls.
        put16(ring.avail, 1);
        put32(self.dev.common + COMMON_QUEUE_DESC, ring.desc as u32);
        put32(
            self.dev.common + COMMON_QUEUE_DESC + 4,
            (ring.desc >> 32) as u32,
        );
        put32(self.dev.common + COMMON_QUEUE_DRIVER, ring.avail as u32);
        put32(self.dev.common + COMMON_QUEUE_DRIVER + 4, 0);
        put32(self.dev.common + COMMON_QUEUE_DEVICE, ring.used as u32);
        put32(self.dev.common + COMMON_QUEUE_DEVICE + 4, 0);
        put16(self.dev.common + COMMON_QUEUE_ENABLE, 1);
        self.rings[usize::from(queue)] = ring;
        Ok(ring)
    }

    fn setup_queues(&mut self, attack_queue_size: Option<u16>) -> Result<(), Text> {
        let needed = self.kind().queues();
        let offered = self.dev.num_queues();
        if offered < needed {
            return Err(text!("{offered} queues, the driver needs {needed}"));
        }
        for queue in 0..needed {
            let size = if queue == self.kind().attack_queue() {
                attack_queue_size
            } else {
                None
            };
            let size = match size {
                Some(size) => Some(size),
                // The largest power of two up to MAX_QUEUE_SIZE.
                None => {
                    self.dev.select(queue);
                    let max = get16(self.dev.common + COMMON_QUEUE_SIZE).min(MAX_QUEUE_SIZE);
                    if max == 0 {
                        return Err(text!("queue {queue} has size 0"));
                    }
                    Some(1u16 << (15 - max.leading_zeros()))
                }
            };
            self.setup_queue(queue, size)?;
        }
        Ok(())
    }

    /// What follows DRIVER_OK: configuration read, socket receive buffers posted.
    fn after_driver_ok(&mut self) -> Result<(), Text> {
        let status = self.dev.status();
        if status & S_DRIVER_OK == 0 || status & S_NEEDS_RESET != 0 {
            return Err(text!("status {status:#x} after DRIVER_OK"));
        }
        match self.kind() {
            Kind::Blk => self.capacity = self.dev.config64(0),
            Kind::Vsock => {
                self.cid = self.dev.config64(0);
                self.rx_seen = 0;
                self.rx_repost = 0;
                let mut rx = self.rings[0];
                for i in 0..RX_BUFFERS {
                    rx.set_desc(rx.desc, u32::from(i), D::w(rx_buffer(i), RX_LEN));
                    rx.offer(i);
                }
                rx.notify();
                self.rings[0] = rx;
            }
            _ => {}
        }
        self.dirty = false;
        Ok(())
    }

    /// Reset and the whole initialization (spec 3.1.1).
    fn bring_up(&mut self) -> Result<(), Text> {
        self.dev.reset();
        self.features = self.dev.negotiate(self.kind().features())?;
        self.setup_queues(None)?;
        self.dev.driver_ok();
        self.after_driver_ok()
    }

    fn restart(&mut self, why: &str) {
        if let Err(err) = self.bring_up() {
            fail(format_args!(
                "{}: cannot set the device up again {why}: {err}",
                self.kind().name()
            ));
        }
    }

    // -- The watched area.

    /// The device may write `[addr, addr + len)` during this attack.
    fn allow(&mut self, addr: u64, len: u64) {
        let area_end = AREA_START + AREA_LEN;
        let start = addr.max(AREA_START);
        let end = addr.saturating_add(len).min(area_end);
        if start >= end {
            return;
        }
        if self.writable[..self.writable_len].contains(&(start, end)) {
            return;
        }
        if self.writable_len == self.writable.len() {
            let last = &mut self.writable[self.writable_len - 1];
            *last = (last.0.min(start), last.1.max(end));
            return;
        }
        self.writable[self.writable_len] = (start, end);
        self.writable_len += 1;
    }

    /// Writes descriptor `index` of `table`, allowing the device to write its buffer.
    fn desc(&mut self, table: u64, index: u32, d: D) {
        if d.flags & DESC_WRITE != 0 && d.flags & DESC_INDIRECT == 0 {
            self.allow(d.addr, u64::from(d.len));
        }
        self.attack_ring().set_desc(table, index, d);
    }

    /// Copies the area: from now on only the allowed ranges and the used rings may change.
    fn arm(&mut self) {
        copy(SHADOW, AREA_START, AREA_LEN);
        self.armed = true;
    }

    /// Compares the area with its copy (FAIL on a byte the device had no business writing).
    fn check(&mut self) {
        if !core::mem::replace(&mut self.armed, false) {
            return;
        }
        fence(Ordering::SeqCst);
        let mut addr = AREA_START;
        let end = AREA_START + AREA_LEN;
        while addr < end {
            if let Some(skip_to) = self.skip(addr) {
                addr = skip_to;
                continue;
            }
            // SAFETY: both words lie in the driver's area (identity mapped RAM).
            let (now, before) = unsafe {
                (
                    (addr as *const u64).read_volatile(),
                    ((SHADOW + addr - AREA_START) as *const u64).read_volatile(),
                )
            };
            if now != before {
                fail(format_args!(
                    "{} {}: guest memory at {addr:#x} changed from {before:#018x} to {now:#018x}, outside every device-writable buffer",
                    self.kind().name(),
                    self.current
                ));
            }
            addr += 8;
        }
    }

    /// Where the excluded range containing `addr` ends (used rings, allowed buffers).
    fn skip(&self, addr: u64) -> Option<u64> {
        for queue in 0..MAX_QUEUES as u64 {
            let used = RINGS + queue * RING_STRIDE + 8192;
            if (used..used + 4096).contains(&addr) {
                return Some(used + 4096);
            }
        }
        if self.kind() == Kind::Vsock {
            let rx_end = rx_buffer(RX_BUFFERS);
            if (RX..rx_end).contains(&addr) {
                return Some(rx_end);
            }
        }
        self.writable[..self.writable_len]
            .iter()
            .find(|(start, end)| *start <= addr && addr < *end)
            .map(|&(_, end)| (end + 7) & !7)
    }

    // -- Requests.

    /// A well-formed request for the attacked queue; writes its header. `tag` makes a
    /// socket request's port unique.
    fn template(&mut self) -> Template {
        let unused = D::r(0, 0);
        match self.kind() {
            Kind::Blk => {
                blk_header(BLK_T_IN, 0);
                put8(STATUS, 0xff);
                Template {
                    d: [D::r(HDR, 16), D::w(DATA, 512), D::w(STATUS, 1), unused],
                    n: 3,
                    payload: 1,
                }
            }
            Kind::Rng => Template {
                d: [D::w(DATA, 64), unused, unused, unused],
                n: 1,
                payload: 0,
            },
            Kind::Vsock => {
                // Data for a connection that does not exist: answered with RST.
                self.vsock_header(VsockHeader {
                    src_cid: self.cid,
                    dst_cid: VSOCK_HOST_CID,
                    src_port: self.attack_port(),
                    dst_port: VSOCK_CLOSED_PORT,
                    len: 16,
                    kind: VSOCK_TYPE_STREAM,
                    op: VSOCK_OP_RW,
                });
                Template {
                    d: [D::r(HDR, VSOCK_HEADER), D::r(DATA, 16), unused, unused],
                    n: 2,
                    payload: 1,
                }
            }
            Kind::Net => {
                net_frame(HDR);
                Template {
                    d: [D::r(HDR, NET_HEADER + NET_FRAME), unused, unused, unused],
                    n: 1,
                    payload: 0,
                }
            }
        }
    }

    fn attack_port(&self) -> u32 {
        50_000 + self.tag
    }

    fn vsock_header(&self, h: VsockHeader) {
        fill(HDR, 64, 0);
        put64(HDR, h.src_cid);
        put64(HDR + 8, h.dst_cid);
        put32(HDR + 16, h.src_port);
        put32(HDR + 20, h.dst_port);
        put32(HDR + 24, h.len);
        put16(HDR + 28, h.kind);
        put16(HDR + 30, h.op);
        put32(HDR + 36, 4096);
    }

    /// Writes `descs` at table indices 0.., offers `head`, notifies and classifies.
    fn submit(&mut self, descs: &[D], head: u16) -> Outcome {
        let table = self.attack_ring().desc;
        for (i, &d) in descs.iter().enumerate() {
            self.desc(table, i as u32, d);
        }
        self.offer_and_classify(head, None)
    }

    /// Offers `head` (and then publishes `avail_index` instead of the next index, when
    /// given), notifies, waits for the device and says what it did.
    fn offer_and_classify(&mut self, head: u16, avail_index: Option<u16>) -> Outcome {
        let queue = usize::from(self.kind().attack_queue());
        let mut ring = self.rings[queue];
        let since = ring.used_index();
        ring.offer(head);
        if let Some(index) = avail_index {
            put16(ring.avail + 2, index);
        }
        self.rings[queue] = ring;
        self.arm();
        ring.notify();
        self.classify(since, head)
    }

    /// Waits for the attacked queue's answer after `since`.
    fn classify(&mut self, since: u16, head: u16) -> Outcome {
        let ring = self.attack_ring();
        let answer = ring.wait_used(since, ATTACK_WAIT_MS);
        self.check();
        let status = self.dev.status();
        let Some((id, len)) = answer else {
            if status & S_NEEDS_RESET != 0 {
                return Outcome::broken(text!("needs reset (status {status:#x})"));
            }
            return Outcome::broken(text!("dropped (no answer within {ATTACK_WAIT_MS} ms)"));
        };
        let mut text = match self.kind() {
            Kind::Blk => match get8(STATUS) {
                0xff => text!("returned unanswered, len {len}"),
                status => text!("answered status {status}"),
            },
            Kind::Rng => text!("returned {len} bytes"),
            Kind::Net => text!("returned"),
            Kind::Vsock => match self.vsock_reply(self.attack_port(), 200) {
                Some(op) => text!("returned, answered op {}", vsock_op(op)),
                None => text!("returned, no reply"),
            },
        };
        if id != u32::from(head) {
            let _ = write!(text, " (used id {id}, head {head})");
        }
        if status & S_NEEDS_RESET != 0 {
            let _ = write!(text, ", needs reset (status {status:#x})");
            return Outcome::broken(text);
        }
        Outcome::fine(text)
    }

    /// Receive-queue packets not seen yet, until one for `port` arrives (its op) or `ms`
    /// pass. The buffers consumed are given back later ([`Session::repost_rx`]).
    fn vsock_reply(&mut self, port: u32, ms: u64) -> Option<u16> {
        let rx = self.rings[0];
        let mut seen = self.rx_seen;
        let deadline = Deadline::after_ms(ms);
        loop {
            while rx.used_index() != seen {
                let (id, len) = rx.used_element(seen);
                seen = seen.wrapping_add(1);
                self.rx_seen = seen;
                if id < u32::from(RX_BUFFERS) {
                    self.rx_repost |= 1 << id;
                    let buffer = rx_buffer(id as u16);
                    if len >= VSOCK_HEADER && get32(buffer + 20) == port {
                        return Some(get16(buffer + 30));
                    }
                }
            }
            if deadline.expired() {
                return None;
            }
            crate::arch::pause();
        }
    }

    /// Gives the socket device back the receive buffers it filled.
    fn repost_rx(&mut self) {
        if self.kind() != Kind::Vsock || self.rx_repost == 0 {
            return;
        }
        let mut rx = self.rings[0];
        for i in 0..RX_BUFFERS {
            if self.rx_repost & (1 << i) != 0 {
                rx.set_desc(rx.desc, u32::from(i), D::w(rx_buffer(i), RX_LEN));
                rx.offer(i);
            }
        }
        rx.notify();
        self.rings[0] = rx;
        self.rx_repost = 0;
    }

    /// One request that must work: Err says how it did not.
    fn good(&mut self) -> Result<(), Text> {
        self.checks += 1;
        self.repost_rx();
        match self.kind() {
            Kind::Blk => self.good_blk(),
            Kind::Rng => {
                fill(DATA, 64, 0);
                let ring = self.attack_ring();
                ring.set_desc(ring.desc, 0, D::w(DATA, 64));
                match self.good_request(0) {
                    Some((_, len)) if (1..=64).contains(&len) => Ok(()),
                    Some((_, len)) => Err(text!("{len} bytes for a 64-byte buffer")),
                    None => Err(text!("no answer")),
                }
            }
            Kind::Net => {
                net_frame(HDR);
                let ring = self.attack_ring();
                ring.set_desc(ring.desc, 0, D::r(HDR, NET_HEADER + NET_FRAME));
                self.good_request(0)
                    .map(|_| ())
                    .ok_or_else(|| text!("frame not sent"))
            }
            Kind::Vsock => {
                let port = 30_000 + self.checks % 10_000;
                self.vsock_header(VsockHeader {
                    src_cid: self.cid,
                    dst_cid: VSOCK_HOST_CID,
                    src_port: port,
                    dst_port: VSOCK_CLOSED_PORT,
                    len: 0,
                    kind: VSOCK_TYPE_STREAM,
                    op: VSOCK_OP_REQUEST,
                });
                let ring = self.attack_ring();
                ring.set_desc(ring.desc, 0, D::r(HDR, VSOCK_HEADER));
                if self.good_request(0).is_none() {
                    return Err(text!("REQUEST not taken"));
                }
                let reply = self.vsock_reply(port, GOOD_WAIT_MS);
                self.repost_rx();
                match reply {
                    Some(VSOCK_OP_RST) => Ok(()),
                    Some(op) => Err(text!("REQUEST to a closed port answered with op {op}")),
                    None => Err(text!("REQUEST to a closed port not answered")),
                }
            }
        }
    }

    /// Offers descriptor `head` of the attacked queue (already written) and waits for it.
    fn good_request(&mut self, head: u16) -> Option<(u32, u32)> {
        let queue = usize::from(self.kind().attack_queue());
        let mut ring = self.rings[queue];
        let since = ring.used_index();
        ring.offer(head);
        ring.notify();
        self.rings[queue] = ring;
        ring.wait_used(since, GOOD_WAIT_MS)
    }

    /// Block request: header at HDR, `data` between it and the status byte.
    fn blk_request(&mut self, kind: u32, sector: u64, data: D) -> Result<u8, Text> {
        blk_header(kind, sector);
        put8(STATUS, 0xff);
        let ring = self.attack_ring();
        ring.set_desc(ring.desc, 0, D::r(HDR, 16).to(1));
        ring.set_desc(ring.desc, 1, data.to(2));
        ring.set_desc(ring.desc, 2, D::w(STATUS, 1));
        match self.good_request(0) {
            Some(_) => Ok(get8(STATUS)),
            None => Err(text!("request type {kind} sector {sector} not answered")),
        }
    }

    /// Reads sector 0 (the magic), writes the scratch sector and reads it back.
    fn good_blk(&mut self) -> Result<(), Text> {
        fill(DATA, 512, 0);
        let status = self.blk_request(BLK_T_IN, 0, D::w(DATA, 512))?;
        let mut magic = [0u8; 8];
        for (i, byte) in magic.iter_mut().enumerate() {
            *byte = get8(DATA + i as u64);
        }
        if status != 0 || &magic != BLK_MAGIC {
            return Err(text!("read sector 0: status {status}, magic {:?}", magic));
        }
        let seed = 0x4057_11e0_0000 + u64::from(self.checks);
        for word in 0..64 {
            put64(DATA + 8 * word, crate::pattern::pattern(seed, word));
        }
        let status = self.blk_request(BLK_T_OUT, BLK_SCRATCH_SECTOR, D::r(DATA, 512))?;
        if status != 0 {
            return Err(text!("write sector {BLK_SCRATCH_SECTOR}: status {status}"));
        }
        fill(DATA2, 512, 0);
        let status = self.blk_request(BLK_T_IN, BLK_SCRATCH_SECTOR, D::w(DATA2, 512))?;
        if status != 0 {
            return Err(text!("read sector {BLK_SCRATCH_SECTOR}: status {status}"));
        }
        for word in 0..64 {
            let got = mmio_read(DATA2 + 8 * word, 8);
            if got != crate::pattern::pattern(seed, word) {
                return Err(text!(
                    "sector {BLK_SCRATCH_SECTOR} reads back {got:#x} at word {word}"
                ));
            }
        }
        Ok(())
    }

    /// Runs one attack: a clean device first, the attack, the comparison of the area, then
    /// a good request (after a reset where the attack left the device broken, or where the
    /// request fails without one). One line per attack.
    fn attack(&mut self, counter: &mut u32, name: &str, f: impl FnOnce(&mut Session) -> Outcome) {
        if self.dirty {
            self.restart("before the attack");
        }
        self.repost_rx();
        self.tag += 1;
        self.writable_len = 0;
        self.current = text!("{name}");
        let outcome = f(self);
        self.check();
        let kind = self.kind().name();
        let mut suffix = "";
        if outcome.reset || self.dirty {
            self.restart("after the attack");
            if let Err(err) = self.good() {
                fail(format_args!(
                    "{kind} {name}: ({}) the device does not work after a reset: {err}",
                    outcome.text
                ));
            }
        } else if let Err(first) = self.good() {
            self.restart("after a failed good request");
            if let Err(err) = self.good() {
                fail(format_args!(
                    "{kind} {name}: ({}) the device does not work, not even after a reset: {first}; {err}",
                    outcome.text
                ));
            }
            suffix = "; stuck until reset";
        }
        *counter += 1;
        println!("{NAME}: {kind} {name}: {}{suffix}", outcome.text);
    }
}

struct VsockHeader {
    src_cid: u64,
    dst_cid: u64,
    src_port: u32,
    dst_port: u32,
    len: u32,
    kind: u16,
    op: u16,
}

fn vsock_op(op: u16) -> &'static str {
    match op {
        1 => "REQUEST",
        2 => "RESPONSE",
        3 => "RST",
        4 => "SHUTDOWN",
        5 => "RW",
        6 => "CREDIT_UPDATE",
        7 => "CREDIT_REQUEST",
        _ => "unknown",
    }
}

fn rx_buffer(i: u16) -> u64 {
    RX + u64::from(i) * 0x1000
}

fn blk_header(kind: u32, sector: u64) {
    put32(HDR, kind);
    put32(HDR + 4, 0);
    put64(HDR + 8, sector);
}

/// virtio_net_hdr_v1 (zero: no offloads) and a broadcast frame of a local experimental
/// ethertype.
fn net_frame(at: u64) {
    fill(at, u64::from(NET_HEADER + NET_FRAME), 0);
    let frame = at + u64::from(NET_HEADER);
    for i in 0..6 {
        put8(frame + i, 0xff);
    }
    for (i, byte) in [0x02u8, 0, 0, 0, 0x68, 0x01].iter().enumerate() {
        put8(frame + 6 + i as u64, *byte);
    }
    put8(frame + 12, 0x88);
    put8(frame + 13, 0xb5);
}

// ---------------------------------------------------------------------------------------
// The attacks.

/// With `storm`: a ring whose available index is far ahead, notified 100000 times (a
/// device must not log every look at it).
fn chain_storm(s: &mut Session, n: &mut u32) {
    s.attack(n, "avail index 50000 ahead, notified 100000 times", |s| {
        let t = s.template();
        let d = t.linked();
        let table = s.attack_ring().desc;
        for (i, &entry) in d.iter().enumerate().take(t.n) {
            s.desc(table, i as u32, entry);
        }
        let next = s.attack_ring().next_avail;
        let outcome = s.offer_and_classify(0, Some(next.wrapping_add(50_000)));
        let ring = s.attack_ring();
        for _ in 0..100_000 {
            ring.notify();
        }
        outcome
    });
}

/// Chain attacks every device gets, on its attacked queue.
fn chain_attacks(s: &mut Session, n: &mut u32) {
    s.attack(n, "descriptor loop (last next -> head)", |s| {
        let t = s.template();
        let mut d = t.linked();
        d[t.n - 1] = d[t.n - 1].to(0);
        s.submit(&d[..t.n], 0)
    });
    s.attack(n, "descriptor pointing at itself", |s| {
        let t = s.template();
        let mut d = t.linked();
        d[0] = d[0].to(0);
        s.submit(&d[..t.n], 0)
    });
    s.attack(
        n,
        "chain through every descriptor, last next out of range",
        |s| {
            let t = s.template();
            let ring = s.attack_ring();
            let size = ring.size;
            for i in 0..size {
                let d = if i == 0 { t.d[0] } else { t.d[t.n - 1] };
                s.desc(ring.desc, u32::from(i), d.to(i + 1));
            }
            s.offer_and_classify(0, None)
        },
    );
    s.attack(n, "next index 0xffff", |s| {
        let t = s.template();
        let mut d = t.linked();
        d[0] = d[0].to(0xffff);
        s.submit(&d[..t.n], 0)
    });
    s.attack(n, "head index out of range", |s| {
        let t = s.template();
        let d = t.linked();
        let size = s.attack_ring().size;
        s.submit(&d[..t.n], size)
    });
    s.attack(n, "buffer outside RAM (0xffff_ffff_f000)", |s| {
        let t = s.template();
        let mut d = t.linked();
        d[t.payload].addr = OUTSIDE;
        s.submit(&d[..t.n], 0)
    });
    s.attack(n, "buffer straddling the end of RAM", |s| {
        let t = s.template();
        let mut d = t.linked();
        let len = u64::from(d[t.payload].len);
        d[t.payload].addr = s.ram_end - len / 2;
        s.submit(&d[..t.n], 0)
    });
    s.attack(n, "buffer in the device's own BAR", |s| {
        let t = s.template();
        let mut d = t.linked();
        d[t.payload].addr = s.dev.bar0;
        s.submit(&d[..t.n], 0)
    });
    s.attack(n, "buffer address wrapping past 2^64", |s| {
        let t = s.template();
        let mut d = t.linked();
        d[t.payload].addr = u64::MAX - 7;
        s.submit(&d[..t.n], 0)
    });
    s.attack(n, "length 0xffff_ffff", |s| {
        let t = s.template();
        let mut d = t.linked();
        d[t.payload].addr = HUGE;
        d[t.payload].len = u32::MAX;
        if d[t.payload].flags & DESC_WRITE != 0 {
            s.allow(HUGE, AREA_START + AREA_LEN - HUGE);
        }
        s.submit(&d[..t.n], 0)
    });
    s.attack(n, "zero length", |s| {
        let t = s.template();
        let mut d = t.linked();
        d[t.payload].len = 0;
        s.submit(&d[..t.n], 0)
    });
    s.attack(n, "avail index 50000 ahead", |s| {
        let t = s.template();
        let d = t.linked();
        let table = s.attack_ring().desc;
        for (i, &entry) in d.iter().enumerate().take(t.n) {
            s.desc(table, i as u32, entry);
        }
        let next = s.attack_ring().next_avail;
        s.offer_and_classify(0, Some(next.wrapping_add(50_000)))
    });

    if s.storm {
        chain_storm(s, n);
    }

    let negotiated = s.features & F_INDIRECT_DESC != 0;
    let suffix = if negotiated { "" } else { " (not negotiated)" };
    let mut name = Text::new();
    let _ = write!(name, "indirect table outside RAM{suffix}");
    s.attack(n, name_str(&name), |s| {
        let t = s.template();
        s.submit(&[D::r(OUTSIDE, 16 * t.n as u32).flag(DESC_INDIRECT)], 0)
    });
    for (entries, label) in [
        (65_535u32, "indirect chain of 65535 descriptors"),
        (65_536, "indirect table of 2^16 descriptors"),
    ] {
        let mut name = Text::new();
        let _ = write!(name, "{label}{suffix}");
        s.attack(n, name_str(&name), |s| {
            let t = s.template();
            for i in 0..entries {
                let d = if i == 0 { t.d[0] } else { t.d[t.n - 1] };
                let d = if i + 1 < entries {
                    d.to((i + 1) as u16)
                } else {
                    d
                };
                s.desc(INDIRECT, i, d);
            }
            s.submit(&[D::r(INDIRECT, 16 * entries).flag(DESC_INDIRECT)], 0)
        });
    }
    let mut name = Text::new();
    let _ = write!(name, "indirect descriptor inside an indirect table{suffix}");
    s.attack(n, name_str(&name), |s| {
        let t = s.template();
        let d = t.linked();
        for (i, &entry) in d.iter().enumerate().take(t.n) {
            s.desc(INDIRECT + 0x1000, i as u32, entry);
        }
        s.desc(
            INDIRECT,
            0,
            D::r(INDIRECT + 0x1000, 16 * t.n as u32).flag(DESC_INDIRECT),
        );
        s.submit(&[D::r(INDIRECT, 16).flag(DESC_INDIRECT)], 0)
    });
    let mut name = Text::new();
    let _ = write!(name, "indirect table length not a multiple of 16{suffix}");
    s.attack(n, name_str(&name), |s| {
        let t = s.template();
        let d = t.linked();
        for (i, &entry) in d.iter().enumerate().take(t.n) {
            s.desc(INDIRECT, i as u32, entry);
        }
        s.submit(
            &[D::r(INDIRECT, 16 * t.n as u32 + 8).flag(DESC_INDIRECT)],
            0,
        )
    });
    let mut name = Text::new();
    let _ = write!(name, "indirect descriptor with NEXT{suffix}");
    s.attack(n, name_str(&name), |s| {
        let t = s.template();
        let d = t.linked();
        for (i, &entry) in d.iter().enumerate().take(t.n) {
            s.desc(INDIRECT, i as u32, entry);
        }
        s.submit(
            &[
                D::r(INDIRECT, 16 * t.n as u32).flag(DESC_INDIRECT).to(1),
                t.d[t.n - 1],
            ],
            0,
        )
    });
}

fn name_str(text: &Text) -> &str {
    core::str::from_utf8(&text.bytes[..text.len]).unwrap_or("?")
}

impl D {
    fn flag(mut self, flag: u16) -> D {
        self.flags |= flag;
        self
    }
}

/// Register attacks every device gets.
fn register_attacks(s: &mut Session, n: &mut u32) {
    s.attack(n, "queue size not a power of two", |s| {
        s.dev.reset();
        if let Err(err) = s.dev.negotiate(s.kind().features()) {
            fail(format_args!("{}: {err}", s.kind().name()));
        }
        let queue = s.kind().attack_queue();
        s.dev.select(queue);
        let max = get16(s.dev.common + COMMON_QUEUE_SIZE);
        let mut reads = [0u16; 3];
        for (i, size) in [0u16, 100, 0xffff].into_iter().enumerate() {
            put16(s.dev.common + COMMON_QUEUE_SIZE, size);
            reads[i] = get16(s.dev.common + COMMON_QUEUE_SIZE);
        }
        // Leave the size as the last write left it and go on to DRIVER_OK.
        if let Err(err) = s.setup_queues(Some(100)) {
            return Outcome::broken(text!("size writes 0/100/0xffff read back {reads:?}; {err}"));
        }
        let status = s.dev.driver_ok();
        let size = s.attack_ring().size;
        let mut text = if reads.iter().all(|&r| r == max) && size == max {
            text!("refused (size stays {max})")
        } else {
            text!("size writes 0/100/0xffff read back {reads:?}, {size} at DRIVER_OK")
        };
        if let Err(err) = s.after_driver_ok() {
            let _ = write!(text, "; {err}");
            return Outcome::broken(text);
        }
        if !size.is_power_of_two() {
            let _ = write!(text, "; status {status:#x}");
            return Outcome::broken(text);
        }
        Outcome::fine(text)
    });
    for (label, which) in [
        ("descriptor table outside RAM, then DRIVER_OK", 0),
        ("used ring outside RAM, then DRIVER_OK", 1),
        (
            "descriptor table straddling the end of RAM, then DRIVER_OK",
            2,
        ),
    ] {
        s.attack(n, label, |s| {
            s.dev.reset();
            if let Err(err) = s.dev.negotiate(s.kind().features()) {
                fail(format_args!("{}: {err}", s.kind().name()));
            }
            if let Err(err) = s.setup_queues(None) {
                fail(format_args!("{}: {err}", s.kind().name()));
            }
            let ring = s.attack_ring();
            s.dev.select(ring.queue);
            let (register, addr) = match which {
                0 => (COMMON_QUEUE_DESC, OUTSIDE),
                1 => (COMMON_QUEUE_DEVICE, OUTSIDE),
                _ => (COMMON_QUEUE_DESC, s.ram_end - 8 * u64::from(ring.size)),
            };
            put32(s.dev.common + register, addr as u32);
            put32(s.dev.common + register + 4, (addr >> 32) as u32);
            let status = s.dev.driver_ok();
            // Kicks for a device that could not start go nowhere.
            ring.notify();
            if status & S_NEEDS_RESET == 0 {
                fail(format_args!(
                    "{} {label}: status {status:#x} after DRIVER_OK, DEVICE_NEEDS_RESET expected",
                    s.kind().name()
                ));
            }
            Outcome::broken(text!("needs reset (status {status:#x})"))
        });
    }
    s.attack(n, "available ring at guest-physical 0", |s| {
        s.dev.reset();
        if let Err(err) = s.dev.negotiate(s.kind().features()) {
            fail(format_args!("{}: {err}", s.kind().name()));
        }
        if let Err(err) = s.setup_queues(None) {
            fail(format_args!("{}: {err}", s.kind().name()));
        }
        let ring = s.attack_ring();
        s.dev.select(ring.queue);
        put32(s.dev.common + COMMON_QUEUE_DRIVER, 0);
        put32(s.dev.common + COMMON_QUEUE_DRIVER + 4, 0);
        let status = s.dev.driver_ok();
        if status & S_NEEDS_RESET != 0 {
            return Outcome::broken(text!("needs reset (status {status:#x})"));
        }
        // Keep what low memory held (the real-mode vector table, unused here).
        let low_len = 4 + 2 * u64::from(ring.size) + 2;
        let mut saved = [0u64; 72];
        for (i, word) in saved.iter_mut().enumerate() {
            *word = peek64_low(8 * i as u64);
        }
        for i in 0..low_len.div_ceil(8) {
            poke64_low(8 * i, 0);
        }
        let t = s.template();
        let d = t.linked();
        for (i, &entry) in d.iter().enumerate().take(t.n) {
            s.desc(ring.desc, i as u32, entry);
        }
        let since = ring.used_index();
        poke16_low(4, 0);
        fence(Ordering::SeqCst);
        poke16_low(2, 1);
        s.arm();
        ring.notify();
        let outcome = s.classify(since, 0);
        // Reset while the ring is still there: a device that spins on it never lets the
        // reset finish (putting low memory back first would hide that).
        s.dev.reset();
        for (i, word) in saved.iter().enumerate() {
            poke64_low(8 * i as u64, *word);
        }
        Outcome::broken(outcome.text)
    });
    s.attack(n, "notify of queues that do not exist", |s| {
        let queues = s.dev.num_queues();
        let multiplier = u64::from(s.dev.notify_multiplier.max(2));
        s.arm();
        // Past the notify area, at its end, a bogus index at queue 0's address, every width.
        put16(s.dev.notify + u64::from(queues) * multiplier, queues);
        put16(s.dev.notify + 0xffe, 0xffff);
        put16(s.dev.notify, 0xffff);
        for width in [1, 2, 4, 8] {
            mmio_write(s.dev.notify + 1, width.min(2), 0xffff);
            mmio_write(s.dev.notify, width, u64::MAX);
        }
        Outcome::fine(text!("ignored (status {:#x})", s.dev.status()))
    });
    s.attack(n, "device status out of order", |s| {
        s.dev.reset();
        s.dev.set_status(S_ACKNOWLEDGE | S_DRIVER | S_DRIVER_OK);
        let early = s.dev.status();
        s.dev.reset();
        s.dev.set_status(S_ACKNOWLEDGE | S_DRIVER);
        let offered = s.dev.offered_features();
        s.dev.write_driver_features(offered | 1 << 63 | F_VERSION_1);
        s.dev.set_status(S_ACKNOWLEDGE | S_DRIVER | S_FEATURES_OK);
        let unoffered = s.dev.status();
        if let Err(err) = s.bring_up() {
            fail(format_args!("{}: {err}", s.kind().name()));
        }
        // Live device: features again, bits cleared without a reset, FAILED.
        s.dev.write_driver_features(u64::MAX);
        s.dev.set_status(S_ACKNOWLEDGE);
        let cleared = s.dev.status();
        let mut text = text!(
            "DRIVER_OK without FEATURES_OK reads {early:#x}, unoffered feature reads {unoffered:#x}, clearing bits reads {cleared:#x}"
        );
        if early & S_DRIVER_OK != 0 || unoffered & S_FEATURES_OK != 0 {
            let _ = write!(text, " (accepted!)");
        }
        Outcome::fine(text)
    });
    s.attack(n, "queue registers rewritten after DRIVER_OK", |s| {
        let ring = s.attack_ring();
        s.dev.select(ring.queue);
        put16(s.dev.common + COMMON_QUEUE_SIZE, 100);
        put64(s.dev.common + COMMON_QUEUE_DESC, OUTSIDE);
        put64(s.dev.common + COMMON_QUEUE_DEVICE, 0);
        put16(s.dev.common + COMMON_QUEUE_ENABLE, 0);
        let size = get16(s.dev.common + COMMON_QUEUE_SIZE);
        let desc = mmio_read(s.dev.common + COMMON_QUEUE_DESC, 8);
        if size == ring.size && desc == ring.desc {
            Outcome::fine(text!("refused"))
        } else {
            Outcome::fine(text!("size reads {size}, desc {desc:#x}"))
        }
    });
    s.attack(n, "every width at every common configuration offset", |s| {
        for value in [u64::MAX, 0x8000_0001_8000_0001, 0x0000_0004_0000_0101] {
            for width in [1u32, 2, 4, 8] {
                for offset in 0..0x48u64 {
                    mmio_write(s.dev.common + offset, width, value);
                    let _ = mmio_read(s.dev.common + offset, width);
                }
            }
        }
        Outcome::broken(text!("survived (status {:#x})", s.dev.status()))
    });
    s.attack(n, "every width at every device configuration offset", |s| {
        if s.dev.device_config == 0 {
            return Outcome::fine(text!("no device configuration"));
        }
        let len = u64::from(s.dev.device_config_len).min(0x100);
        for value in [u64::MAX, 0] {
            for width in [1u32, 2, 4, 8] {
                for offset in 0..len {
                    mmio_write(s.dev.device_config + offset, width, value);
                    let _ = mmio_read(s.dev.device_config + offset, width);
                }
            }
        }
        Outcome::fine(text!("survived (status {:#x})", s.dev.status()))
    });
    s.attack(n, "BAR0 accesses outside every register", |s| {
        for offset in [
            0x40u64,
            0x48,
            0x800,
            0xff8,
            0x1004,
            0x1ff8,
            0x3ff8,
            0x4000 + 16 * 2047,
            0xbff8,
            0xc100,
            0xfff8,
        ] {
            for width in [1u32, 2, 4, 8] {
                if offset + u64::from(width) > 0x1_0000 {
                    continue;
                }
                mmio_write(s.dev.bar0 + offset, width, u64::MAX);
                let _ = mmio_read(s.dev.bar0 + offset, width);
            }
        }
        Outcome::broken(text!("ignored (status {:#x})", s.dev.status()))
    });
    s.attack(n, "MSI-X vectors with garbage addresses and data", |s| {
        let Some(msix) = pci::Msix::find(s.dev.pci_device) else {
            return Outcome::fine(text!("no MSI-X capability"));
        };
        let Ok(table_bar) = pci::bar_address(s.dev.pci_device, msix.table_bar) else {
            return Outcome::fine(text!("MSI-X table BAR unassigned"));
        };
        let table = table_bar + u64::from(msix.table_offset);
        let entries = u64::from(msix.table_size);
        let garbage = [
            (0xffff_ffffu32, 0xdead_beefu32, 0xffff_ffffu32),
            (0, 0, 0),
            (0xfee0_0000, 0, 0x0e),
            (0x1000, 0xffff_ffff, 0x4_00ff),
        ];
        // Every entry, and one past the table.
        for entry in 0..=entries {
            let (low, high, data) = garbage[(entry % 4) as usize];
            let at = table + 16 * entry;
            put32(at, low);
            put32(at + 4, high);
            put32(at + 8, data);
            put32(at + 12, 0);
        }
        let pointer = msix.pointer();
        let control = pci::config_read(s.dev.pci_device, pointer);
        msix.enable();
        // Config vector and every queue's: in range, out of range, NO_VECTOR.
        put16(s.dev.common + 0x10, 0);
        let queue = s.kind().attack_queue();
        s.dev.select(queue);
        put16(s.dev.common + COMMON_QUEUE_MSIX_VECTOR, 0x7ff);
        let out_of_range = get16(s.dev.common + COMMON_QUEUE_MSIX_VECTOR);
        put16(
            s.dev.common + COMMON_QUEUE_MSIX_VECTOR,
            (queue + 1) % (entries as u16),
        );
        // Requests now signal through the garbage routes (RFLAGS.IF is clear in ring 3, so
        // whatever arrives stays pending).
        let served = s.good();
        // Masks flipping while the device signals.
        for _ in 0..64 {
            pci::config_write(s.dev.pci_device, pointer, control | 1 << 31 | 1 << 30);
            pci::config_write(s.dev.pci_device, pointer, control | 1 << 31);
        }
        pci::config_write(s.dev.pci_device, pointer, control & !(1 << 31));
        for entry in 0..entries {
            put32(table + 16 * entry + 12, 1);
        }
        let mut text = text!("vector 0x7ff reads back {out_of_range:#x}");
        match served {
            Ok(()) => {
                let _ = write!(text, ", requests served");
            }
            Err(err) => {
                let _ = write!(text, ", request failed: {err}");
            }
        }
        Outcome::broken(text)
    });
}

fn blk_attacks(s: &mut Session, n: &mut u32) {
    // (name, request type, sector, data descriptor, status that would be wrong)
    type Sector = fn(&Session) -> u64;
    let cases: [(&str, u32, Sector, D); 7] = [
        (
            "read past the end",
            BLK_T_IN,
            |s| s.capacity,
            D::w(DATA, 512),
        ),
        (
            "read straddling the end",
            BLK_T_IN,
            |s| s.capacity - 1,
            D::w(DATA, 1024),
        ),
        (
            "read at sector 2^64-1",
            BLK_T_IN,
            |_| u64::MAX,
            D::w(DATA, 512),
        ),
        (
            "write past the end",
            BLK_T_OUT,
            |s| s.capacity,
            D::r(DATA, 512),
        ),
        (
            "read of 100 bytes (not a multiple of 512)",
            BLK_T_IN,
            |_| 0,
            D::w(DATA, 100),
        ),
        (
            "write of 100 bytes at sector 16",
            BLK_T_OUT,
            |_| 16,
            D::r(DATA, 100),
        ),
        (
            "write at sector 24 from a buffer outside RAM",
            BLK_T_OUT,
            |_| 24,
            D::r(OUTSIDE, 512),
        ),
    ];
    for (name, kind, sector, data) in cases {
        s.attack(n, name, |s| {
            fill(DATA, 1024, 0x5a);
            let sector = sector(s);
            blk_header(kind, sector);
            put8(STATUS, 0xff);
            let outcome = s.submit(&[D::r(HDR, 16).to(1), data.to(2), D::w(STATUS, 1)], 0);
            blk_expect_error(s, name, outcome)
        });
    }
    s.attack(
        n,
        "write at sector 20 with a read-only status descriptor",
        |s| {
            fill(DATA, 512, 0x5a);
            blk_header(BLK_T_OUT, 20);
            put8(STATUS, 0xff);
            // STATUS is not device-writable here: a status written into it fails the check.
            s.submit(
                &[D::r(HDR, 16).to(1), D::r(DATA, 512).to(2), D::r(STATUS, 1)],
                0,
            )
        },
    );
    s.attack(n, "status byte outside RAM", |s| {
        blk_header(BLK_T_IN, 0);
        put8(STATUS, 0xff);
        s.submit(
            &[D::r(HDR, 16).to(1), D::w(DATA, 512).to(2), D::w(OUTSIDE, 1)],
            0,
        )
    });
    s.attack(n, "readable descriptor after a writable one", |s| {
        blk_header(BLK_T_OUT, 16);
        put8(STATUS, 0xff);
        let outcome = s.submit(
            &[
                D::r(HDR, 16).to(1),
                D::w(DATA, 512).to(2),
                D::r(DATA2, 512).to(3),
                D::w(STATUS, 1),
            ],
            0,
        );
        blk_expect_error(s, "readable after writable", outcome)
    });
    s.attack(n, "header of 8 bytes", |s| {
        blk_header(BLK_T_IN, 0);
        put8(STATUS, 0xff);
        let outcome = s.submit(&[D::r(HDR, 8).to(1), D::w(STATUS, 1)], 0);
        blk_expect_error(s, "short header", outcome)
    });
    s.attack(n, "unknown request type 0x7fffffff", |s| {
        blk_header(0x7fff_ffff, 0);
        put8(STATUS, 0xff);
        let outcome = s.submit(
            &[D::r(HDR, 16).to(1), D::w(DATA, 512).to(2), D::w(STATUS, 1)],
            0,
        );
        blk_expect_error(s, "unknown type", outcome)
    });
    s.attack(n, "discard of 2^32-1 sectors from the last one", |s| {
        blk_header(BLK_T_DISCARD, 0);
        put64(DATA, s.capacity - 1);
        put32(DATA + 8, u32::MAX);
        put32(DATA + 12, 0);
        put8(STATUS, 0xff);
        let outcome = s.submit(
            &[D::r(HDR, 16).to(1), D::r(DATA, 16).to(2), D::w(STATUS, 1)],
            0,
        );
        blk_expect_error(s, "discard", outcome)
    });
    s.attack(
        n,
        "write zeroes of 2^32-1 sectors with unknown flags",
        |s| {
            blk_header(BLK_T_WRITE_ZEROES, 0);
            put64(DATA, 0);
            put32(DATA + 8, u32::MAX);
            put32(DATA + 12, 0xffff_fffe);
            put8(STATUS, 0xff);
            let outcome = s.submit(
                &[D::r(HDR, 16).to(1), D::r(DATA, 16).to(2), D::w(STATUS, 1)],
                0,
            );
            blk_expect_error(s, "write zeroes", outcome)
        },
    );
    s.attack(n, "discard with 2^20 segments", |s| {
        blk_header(BLK_T_DISCARD, 0);
        put8(STATUS, 0xff);
        fill(HUGE, 1 << 20, 0);
        let outcome = s.submit(
            &[
                D::r(HDR, 16).to(1),
                D::r(HUGE, 1 << 20).to(2),
                D::w(STATUS, 1),
            ],
            0,
        );
        blk_expect_error(s, "discard segments", outcome)
    });
}

/// A block request that had to fail must not have answered OK.
fn blk_expect_error(s: &Session, name: &str, outcome: Outcome) -> Outcome {
    if get8(STATUS) == 0 {
        fail(format_args!(
            "blk {name}: answered status 0 (OK) for a request it had to refuse (capacity {} sectors)",
            s.capacity
        ));
    }
    outcome
}

fn rng_attacks(s: &mut Session, n: &mut u32) {
    s.attack(n, "read-only buffer", |s| {
        fill(DATA, 64, 0x5a);
        s.submit(&[D::r(DATA, 64)], 0)
    });
    s.attack(n, "64 KiB + 1 in one descriptor", |s| {
        let outcome = s.submit(&[D::w(HUGE, 0x1_0001)], 0);
        let used = s
            .attack_ring()
            .used_element(s.attack_ring().used_index().wrapping_sub(1));
        if !outcome.reset && used.1 > 0x1_0001 {
            fail(format_args!(
                "rng: the device says it wrote {} bytes into 65537",
                used.1
            ));
        }
        outcome
    });
    s.attack(n, "read-only and writable descriptors interleaved", |s| {
        let d = [
            D::r(DATA, 16).to(1),
            D::w(DATA + 64, 16).to(2),
            D::r(DATA + 128, 16).to(3),
            D::w(DATA + 192, 16),
        ];
        let outcome = s.submit(&d, 0);
        let used = s
            .attack_ring()
            .used_element(s.attack_ring().used_index().wrapping_sub(1));
        if !outcome.reset && used.1 > 32 {
            fail(format_args!(
                "rng: the device says it wrote {} bytes into 32",
                used.1
            ));
        }
        outcome
    });
}

fn vsock_attacks(s: &mut Session, n: &mut u32) {
    // (name, header tweak, header descriptor length, data descriptor)
    type Tweak = fn(&mut VsockHeader);
    let cases: [(&str, Tweak, u32, Option<D>); 9] = [
        (
            "packet with a wrong src_cid",
            |h| h.src_cid = 99,
            VSOCK_HEADER,
            None,
        ),
        (
            "packet with src_cid 2^64-1",
            |h| h.src_cid = u64::MAX,
            VSOCK_HEADER,
            None,
        ),
        (
            "packet to dst_cid 2^64-1",
            |h| h.dst_cid = u64::MAX,
            VSOCK_HEADER,
            None,
        ),
        ("unknown op 99", |h| h.op = 99, VSOCK_HEADER, None),
        (
            "unknown socket type 99",
            |h| h.kind = 99,
            VSOCK_HEADER,
            None,
        ),
        (
            "len 4096 with a 16-byte buffer",
            |h| {
                h.op = VSOCK_OP_RW;
                h.len = 4096
            },
            VSOCK_HEADER,
            Some(D::r(DATA, 16)),
        ),
        (
            "len 0xffff_ffff",
            |h| {
                h.op = VSOCK_OP_RW;
                h.len = u32::MAX
            },
            VSOCK_HEADER,
            Some(D::r(DATA, 16)),
        ),
        (
            "len 100 and one 60-byte descriptor",
            |h| {
                h.op = VSOCK_OP_RW;
                h.len = 100
            },
            VSOCK_HEADER + 16,
            None,
        ),
        ("header of 20 bytes", |_| {}, 20, None),
    ];
    for (name, tweak, header_len, data) in cases {
        s.attack(n, name, |s| {
            let mut h = VsockHeader {
                src_cid: s.cid,
                dst_cid: VSOCK_HOST_CID,
                src_port: s.attack_port(),
                dst_port: VSOCK_CLOSED_PORT,
                len: 0,
                kind: VSOCK_TYPE_STREAM,
                op: VSOCK_OP_REQUEST,
            };
            tweak(&mut h);
            s.vsock_header(h);
            match data {
                Some(data) => s.submit(&[D::r(HDR, header_len).to(1), data], 0),
                None => s.submit(&[D::r(HDR, header_len)], 0),
            }
        });
    }
    s.attack(n, "device-writable tx descriptor", |s| {
        s.template();
        s.submit(&[D::w(HDR, VSOCK_HEADER).to(1), D::r(DATA, 16)], 0)
    });
    for (label, rx) in [
        ("read-only rx buffers", D::r(0, RX_LEN)),
        ("rx buffers outside RAM", D::w(OUTSIDE, RX_LEN)),
        ("rx buffers of 0xffff_ffff bytes", D::w(HUGE, u32::MAX)),
        ("rx buffers of 20 bytes", D::w(0, 20)),
    ] {
        s.attack(n, label, |s| {
            // Replace every posted receive buffer, then make the device answer (RST).
            let ring = s.rings[0];
            for i in 0..RX_BUFFERS {
                let mut d = rx;
                if d.addr == 0 {
                    d.addr = rx_buffer(i);
                }
                if d.flags & DESC_WRITE != 0 {
                    s.allow(d.addr, u64::from(d.len));
                }
                ring.set_desc(ring.desc, u32::from(i), d);
            }
            let rx_since = ring.used_index();
            s.rings[0] = ring;
            let t = s.template();
            let outcome = s.submit(&t.linked()[..t.n], 0);
            let mut returned = 0;
            let deadline = Deadline::after_ms(200);
            while !deadline.expired() && returned < u32::from(RX_BUFFERS) {
                returned = u32::from(s.rings[0].used_index().wrapping_sub(rx_since));
                crate::arch::pause();
            }
            Outcome::broken(text!("{}; {returned} rx buffers returned", outcome.text))
        });
    }
    s.attack(n, "RST flood without rx buffers", |s| {
        // Every rx buffer taken away first (a reset, then no buffers posted).
        s.dev.reset();
        if let Err(err) = s.dev.negotiate(s.kind().features()) {
            fail(format_args!("vsock: {err}"));
        }
        if let Err(err) = s.setup_queues(None) {
            fail(format_args!("vsock: {err}"));
        }
        s.dev.driver_ok();
        let mut ring = s.attack_ring();
        let batch = ring.size;
        let mut sent = 0u32;
        let mut stalled = false;
        while sent < 4096 && !stalled {
            for i in 0..batch {
                let header = HDR + 64 * u64::from(i);
                put64(header, s.cid);
                put64(header + 8, VSOCK_HOST_CID);
                put32(header + 16, 10_000 + sent + u32::from(i));
                put32(header + 20, VSOCK_CLOSED_PORT);
                put32(header + 24, 0);
                put16(header + 28, VSOCK_TYPE_STREAM);
                put16(header + 30, 99);
                ring.set_desc(ring.desc, u32::from(i), D::r(header, VSOCK_HEADER));
                ring.offer(i);
            }
            let since = ring.used_index();
            ring.notify();
            let deadline = Deadline::after_ms(ATTACK_WAIT_MS);
            while ring.used_index().wrapping_sub(since) < batch {
                if deadline.expired() {
                    stalled = true;
                    break;
                }
                crate::arch::pause();
            }
            sent += u32::from(ring.used_index().wrapping_sub(since));
        }
        s.rings[usize::from(ring.queue)] = ring;
        if stalled {
            Outcome::broken(text!(
                "tx stalls after {sent} packets (RST backlog bounded)"
            ))
        } else {
            Outcome::broken(text!("{sent} packets taken without stalling"))
        }
    });
}

// ---------------------------------------------------------------------------------------

/// The end of the highest e820 RAM entry below the mapped range.
fn ram_end(info: &BootInfo) -> u64 {
    info.memmap()
        .iter()
        .filter(|entry| entry.kind == E820_RAM)
        .map(|entry| entry.addr.saturating_add(entry.size))
        .filter(|&end| end <= crate::boot::MAPPED_LIMIT)
        .max()
        .unwrap_or(0)
}

pub fn run(info: &BootInfo) -> ! {
    let covered = info.memmap().iter().any(|entry| {
        entry.kind == E820_RAM
            && entry.addr <= AREA_START
            && entry.addr.saturating_add(entry.size) >= AREA_END
    });
    let low_ram = info
        .memmap()
        .iter()
        .any(|entry| entry.kind == E820_RAM && entry.addr == 0 && entry.size >= 0x1000);
    if !covered || !low_ram {
        println!(
            "{NAME}: FAIL not enough RAM: needs {AREA_START:#x}-{AREA_END:#x} and the first page (--memory 64M or more)"
        );
        exit(EXIT_SETUP);
    }
    // `virtio-hostile storm` adds the notification storm (one more attack per device).
    let storm = info.cmdline().is_ok_and(|cmdline| {
        cmdline
            .split_whitespace()
            .skip(1)
            .any(|word| word == "storm")
    });
    let ram_end = ram_end(info);
    println!("{NAME}: RAM ends at {ram_end:#x}");
    let mut attacks = 0u32;
    let mut devices = 0;
    for kind in [Kind::Blk, Kind::Rng, Kind::Vsock, Kind::Net] {
        let Some(dev) = Dev::find(kind) else {
            println!("{NAME}: no {} device", kind.name());
            continue;
        };
        devices += 1;
        let mut s = Session::new(dev, ram_end);
        s.storm = storm;
        s.restart("at the start");
        if let Err(err) = s.good() {
            fail(format_args!(
                "{}: a good request fails before any attack: {err}",
                kind.name()
            ));
        }
        let before = attacks;
        chain_attacks(&mut s, &mut attacks);
        register_attacks(&mut s, &mut attacks);
        match kind {
            Kind::Blk => blk_attacks(&mut s, &mut attacks),
            Kind::Rng => rng_attacks(&mut s, &mut attacks),
            Kind::Vsock => vsock_attacks(&mut s, &mut attacks),
            Kind::Net => {}
        }
        // The device stops touching memory before the next one gets the same rings.
        s.dev.reset();
        println!(
            "{NAME}: {} survived {} attacks",
            kind.name(),
            attacks - before
        );
    }
    if devices == 0 {
        println!("{NAME}: FAIL no virtio device to attack");
        exit(EXIT_SETUP);
    }
    println!("{NAME}: ok attacks={attacks}");
    exit(0)
}
