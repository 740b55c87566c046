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
//!
//! Here: the flow and the result lines. [`driver`]: devices, rings and descriptors;
//! [`session`]: one device under attack, its good requests and the per-attack loop;
//! [`memory`]: memory access and the guard; [`chains`] and [`registers`]: the attacks every
//! device gets; [`blk`], [`rng`], [`vsock`], [`net`]: each device's own.

// Errors are short texts on the stack (there is no allocator); they are only ever printed.
#![allow(clippy::result_large_err)]

/// A [`Text`] formatted like `format!`.
macro_rules! text {
    ($($arg:tt)*) => {{
        let mut text = $crate::virtio::hostile::Text::new();
        let _ = core::fmt::Write::write_fmt(&mut text, format_args!($($arg)*));
        text
    }};
}

mod blk;
mod chains;
mod driver;
mod memory;
mod net;
mod registers;
mod rng;
mod session;
mod vsock;

use core::fmt;

use super::EXIT_SETUP;
use crate::bootinfo::{BootInfo, E820_RAM};
use crate::console::exit;
use crate::println;
use driver::{Dev, Kind};
use session::Session;

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

// ---------------------------------------------------------------------------------------
// Outcome text without an allocator, and the result lines.

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

    fn as_str(&self) -> &str {
        core::str::from_utf8(&self.bytes[..self.len]).unwrap_or("?")
    }
}

impl fmt::Write for Text {
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
        f.write_str(self.as_str())
    }
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
        chains::attacks(&mut s, &mut attacks);
        registers::attacks(&mut s, &mut attacks);
        match kind {
            Kind::Blk => blk::attacks(&mut s, &mut attacks),
            Kind::Rng => rng::attacks(&mut s, &mut attacks),
            Kind::Vsock => vsock::attacks(&mut s, &mut attacks),
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
