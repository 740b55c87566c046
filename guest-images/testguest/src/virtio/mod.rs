//! The `virtio-*` workloads: a minimal modern virtio-pci driver (virtio 1.x, spec 4.1) running
//! in ring 3. It finds a device on bus 0 through configuration mechanism #1, maps its virtio
//! capabilities onto the BARs (identity mapped, user accessible), negotiates VERSION_1 and only
//! the optional features it implements, sets up split virtqueues in guest RAM at
//! [`DMA_START`].., and polls the used rings with bounded waits. `virtio-rng` also checks one
//! MSI-X interrupt, waited for in ring 0 the way the `pci` workload does.
//!
//! - [`pci`]: configuration space, capability list, BAR addresses, MSI-X capability.
//! - [`transport`]: the virtio-pci common/notify/ISR/device configuration structures, status
//!   and feature negotiation, queue setup.
//! - [`queue`]: split virtqueues (descriptor table, available and used rings).
//! - [`irq`]: the local APIC, IDT gates and the ring-0 wait for an MSI with a timer timeout.
//! - The workloads: [`rng`], [`blk`], [`vsock`], [`net`], and [`devices`] (block, entropy
//!   and socket together, for snapshot and hot-swap tests).
//!
//! Every result is one line `<workload>: ...`; failures are `<workload>: FAIL ...` with exit
//! status 1 ([`EXIT_FAIL`]), or 2 ([`EXIT_SETUP`]) when the device or the RAM the driver needs
//! is missing or an argument is bad.

mod balloon;
pub mod bench;
mod blk;
pub(crate) use blk::DiskIo;
mod devices;
mod fs;
mod gpu_agent;
pub mod hostile;
pub(crate) mod hotplug;
pub(crate) mod irq;
mod net;
mod pci;
mod queue;
mod rng;
pub(crate) mod transport;
pub(crate) mod vsock;

use core::fmt;
use core::sync::atomic::{fence, AtomicU64, Ordering};

use crate::args::Words;
use crate::bootinfo::{BootInfo, E820_RAM};
use crate::console::exit;
use crate::println;

/// The device misbehaved (or a request failed).
pub const EXIT_FAIL: u32 = 1;
/// No such device, not enough RAM for the rings and buffers, or a bad argument.
pub const EXIT_SETUP: u32 = 2;

/// Guest RAM the driver owns: rings and buffers (the `pci` workload's DMA is at 32 MiB).
pub const DMA_START: u64 = 40 << 20;
pub const DMA_END: u64 = 48 << 20;

/// How long the device may take to complete one request we submitted.
pub const REQUEST_TIMEOUT_MS: u64 = 5_000;
/// How long `virtio-vsock` and `virtio-net` wait for the host to send something.
pub const PEER_TIMEOUT_MS: u64 = 60_000;

pub fn run(info: &BootInfo, workload: &str, words: &mut Words) -> ! {
    if workload == "virtio-balloon" {
        let (mut hostile, mut touch_mib) = (false, 0);
        while let Some(word) = words.next_word() {
            match (word, crate::args::parse_number(word)) {
                ("hostile", _) => hostile = true,
                (_, Some(mib)) => touch_mib = mib,
                _ => fail_setup(
                    "virtio-balloon",
                    format_args!(
                        "unknown argument '{word}' (usage: virtio-balloon [hostile] [TOUCH_MIB])"
                    ),
                ),
            }
        }
        balloon::run(
            info,
            &mut Dma::new(info, "virtio-balloon"),
            hostile,
            touch_mib,
        );
    }
    let (name, workload): (&'static str, fn(&mut Dma, &mut Words) -> !) = match workload {
        "virtio-rng" => ("virtio-rng", |dma, _| rng::run(dma)),
        "virtio-blk" => ("virtio-blk", |dma, _| blk::run(dma)),
        "virtio-blk-hotplug" => ("virtio-blk-hotplug", hotplug::run),
        "virtio-vsock" => ("virtio-vsock", vsock::run),
        "virtio-vsock-connect" => ("virtio-vsock-connect", vsock::connect),
        "virtio-net" => ("virtio-net", net::run),
        "virtio-net-mq" => ("virtio-net-mq", net::run_mq),
        "virtio-net-bench" => ("virtio-net-bench", net::run_bench),
        "virtio-devices" => ("virtio-devices", devices::run),
        "virtio-fs" => ("virtio-fs", |dma, _| fs::run(dma)),
        "gpu-agent" => ("gpu-agent", gpu_agent::run),
        other => {
            println!("testguest: unknown workload '{other}'");
            exit(EXIT_SETUP)
        }
    };
    workload(&mut Dma::new(info, name), words)
}

/// Prints `<workload>: FAIL <what>` and exits with [`EXIT_FAIL`].
pub fn fail(workload: &str, what: fmt::Arguments) -> ! {
    println!("{workload}: FAIL {what}");
    exit(EXIT_FAIL)
}

/// Prints `<workload>: FAIL <what>` and exits with [`EXIT_SETUP`].
pub fn fail_setup(workload: &str, what: fmt::Arguments) -> ! {
    println!("{workload}: FAIL {what}");
    exit(EXIT_SETUP)
}

/// A bump allocator over `[DMA_START, DMA_END)`: everything the device reads or writes.
pub struct Dma {
    workload: &'static str,
    next: u64,
}

impl Dma {
    /// Checks that e820 RAM covers the whole area (fails with [`EXIT_SETUP`] otherwise).
    pub(crate) fn new(info: &BootInfo, workload: &'static str) -> Dma {
        let covered = info.memmap().iter().any(|entry| {
            entry.kind == E820_RAM
                && entry.addr <= DMA_START
                && entry.addr.saturating_add(entry.size) >= DMA_END
        });
        if !covered {
            fail_setup(
                workload,
                format_args!(
                    "not enough RAM: the driver needs {DMA_START:#x}-{DMA_END:#x} (--memory 64M or more)"
                ),
            );
        }
        Dma {
            workload,
            next: DMA_START,
        }
    }

    /// `len` zeroed bytes aligned to `align` (a power of two).
    pub fn alloc(&mut self, len: u64, align: u64) -> u64 {
        let start = (self.next + align - 1) & !(align - 1);
        if start + len > DMA_END {
            fail(
                self.workload,
                format_args!("driver out of DMA memory ({len} bytes)"),
            );
        }
        self.next = start + len;
        crate::pattern::zero(start, len);
        start
    }
}

/// Copies `bytes` into guest RAM the device will read, then fences so the copy is complete
/// before anything published afterwards (an available index, a notification).
pub fn write_ram(addr: u64, bytes: &[u8]) {
    // SAFETY: `addr` is in the DMA area (identity mapped RAM the driver owns) and the caller
    // keeps `addr + bytes.len()` inside the buffer it allocated.
    unsafe { core::ptr::copy_nonoverlapping(bytes.as_ptr(), addr as *mut u8, bytes.len()) };
    fence(Ordering::SeqCst);
}

/// Copies guest RAM the device wrote (after its used index was read) into `bytes`.
pub fn read_ram(addr: u64, bytes: &mut [u8]) {
    fence(Ordering::SeqCst);
    // SAFETY: as in `write_ram`; the device finished with the buffer before publishing it.
    unsafe { core::ptr::copy_nonoverlapping(addr as *const u8, bytes.as_mut_ptr(), bytes.len()) };
}

/// A point in time `ms` milliseconds from now, measured with the TSC.
pub struct Deadline {
    start: u64,
    ticks: u64,
}

static TSC_HZ: AtomicU64 = AtomicU64::new(0);

fn tsc_hz() -> u64 {
    let cached = TSC_HZ.load(Ordering::Relaxed);
    if cached != 0 {
        return cached;
    }
    let hz = crate::arch::tsc_hz();
    TSC_HZ.store(hz, Ordering::Relaxed);
    hz
}

impl Deadline {
    pub fn after_ms(ms: u64) -> Deadline {
        Deadline {
            start: crate::arch::rdtsc(),
            ticks: tsc_hz() / 1000 * ms,
        }
    }

    pub fn expired(&self) -> bool {
        crate::arch::rdtsc().wrapping_sub(self.start) >= self.ticks
    }
}

/// Bytes as lowercase hex without separators.
pub struct Hex<'a>(pub &'a [u8]);

impl fmt::Display for Hex<'_> {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        self.0.iter().try_for_each(|byte| write!(f, "{byte:02x}"))
    }
}
