//! The `gpu-migrate` workload: state in the emulated GPU that a snapshot must carry
//! through VFIO migration, checked before and after a restore onto another device process.
//!
//! It waits for a hot-plugged GPU (PUT /gpus/{id}), runs the `pci` checks on it (MSI-X on,
//! one DMA), then gives the device state of its own: 32 scratch registers, 8 pages of
//! device memory written through the guest's direct BAR1 mapping, and an in-flight job: with
//! the device's HOLD register set, a doorbell queues its DMA instead of running it. It then
//! checks all of it in a loop, printing `gpu-migrate: iter N ok`, until a byte arrives on
//! the serial port (the VMM's stdin): then it clears HOLD, and the queued job must run: the
//! DMA lands with its pattern and its MSI-X interrupt arrives. The test snapshots between
//! two iterations, restores onto a fresh device process, and sends the byte to the
//! restored VM.

use core::sync::atomic::Ordering;

use crate::console::exit;
use crate::pattern::pattern;
use crate::pci::{
    config_read, mmio_read, mmio_write, wait_for_interrupt, REG_DMA_ADDR_HI, REG_DMA_ADDR_LO,
    REG_DMA_DONE, REG_DMA_LEN, REG_DMA_SEED, REG_DMA_STATUS, REG_DOORBELL, REG_SCRATCH,
    TG_MSI_COUNT,
};
use crate::println;

/// While non-zero, doorbells queue their jobs; writing 0 runs them (gpuvm-vfio emu::regs).
const REG_HOLD: u64 = 0x1038;
/// The scratch registers after the 16 the `pci` checks use.
const STATE_SCRATCH: core::ops::Range<u64> = 16..48;
/// Device memory the workload fills: 8 pages, 64 KiB apart, from 1 MiB into BAR1.
const BAR1_PAGES: u64 = 8;
const BAR1_FIRST: u64 = 1 << 20;
const BAR1_STRIDE: u64 = 64 << 10;
const BAR1_SEED: u64 = 0xd3e7;
/// The queued job's target: 64 KiB at 48 MiB.
const JOB_ADDR: u64 = 48 << 20;
const JOB_LEN: u64 = 64 << 10;
const JOB_SEED: u64 = 0x3161;
const SERIAL_DATA: u16 = 0x3f8;
const SERIAL_LINE_STATUS: u16 = 0x3fd;
const EXIT_FAIL: u32 = 1;

fn fail(what: core::fmt::Arguments) -> ! {
    println!("gpu-migrate: FAIL {what}");
    exit(EXIT_FAIL)
}

/// 8-bit port read (the #GP handler emulates it where the hypervisor drops IOPL).
fn inb(port: u16) -> u8 {
    let value: u8;
    // SAFETY: port I/O to an emulated device touches no memory.
    unsafe {
        core::arch::asm!("in al, dx", in("dx") port, out("al") value,
            options(nomem, nostack, preserves_flags));
    }
    value
}

/// A byte from the serial port, if one is waiting.
fn serial_byte() -> Option<u8> {
    (inb(SERIAL_LINE_STATUS) & 1 != 0).then(|| inb(SERIAL_DATA))
}

fn scratch_value(i: u64) -> u32 {
    0x5a17_0000 ^ (i as u32).wrapping_mul(0x9e37_79b9)
}

fn bar1_word(bar1: u64, page: u64, word: u64) -> (*mut u64, u64) {
    let offset = BAR1_FIRST + page * BAR1_STRIDE + word * 8;
    ((bar1 + offset) as *mut u64, pattern(BAR1_SEED, offset))
}

fn write_state(bar0: u64, bar1: u64) {
    for i in STATE_SCRATCH {
        mmio_write(bar0 + REG_SCRATCH + 4 * i, scratch_value(i));
    }
    for page in 0..BAR1_PAGES {
        for word in 0..512 {
            let (at, value) = bar1_word(bar1, page, word);
            // SAFETY: BAR1 is identity mapped device memory the VMM maps into the guest.
            unsafe { at.write_volatile(value) };
        }
    }
}

/// Checks the state the workload gave the device; the queued job must not have run.
fn check_state(bar0: u64, bar1: u64, iteration: u64) {
    for i in STATE_SCRATCH {
        let got = mmio_read(bar0 + REG_SCRATCH + 4 * i);
        if got != scratch_value(i) {
            fail(format_args!(
                "iter {iteration}: scratch {i} reads {got:#x}, expected {:#x}",
                scratch_value(i)
            ));
        }
    }
    for page in 0..BAR1_PAGES {
        for word in 0..512 {
            let (at, value) = bar1_word(bar1, page, word);
            // SAFETY: as in write_state.
            let got = unsafe { at.read_volatile() };
            if got != value {
                fail(format_args!(
                    "iter {iteration}: device memory at BAR1+{:#x} reads {got:#x}, expected {value:#x}",
                    at as u64 - bar1
                ));
            }
        }
    }
    let done = mmio_read(bar0 + REG_DMA_DONE);
    if done != 1 {
        fail(format_args!(
            "iter {iteration}: {done} DMA jobs done while the second is held"
        ));
    }
}

fn check_job() {
    let mut addr = JOB_ADDR;
    while addr < JOB_ADDR + JOB_LEN {
        // SAFETY: RAM at 48 MiB, identity mapped; the device wrote it before the interrupt.
        let got = unsafe { (addr as *const u64).read_volatile() };
        if got != pattern(JOB_SEED, addr) {
            fail(format_args!(
                "queued job's DMA at {addr:#x}: got {got:#x}, expected {:#x}",
                pattern(JOB_SEED, addr)
            ));
        }
        addr += 8;
    }
}

pub fn run() -> ! {
    println!("gpu-migrate: waiting for a device");
    let arrived = loop {
        let bits = crate::arch::inl(crate::hotplug::PCIU);
        if bits != 0 {
            break bits;
        }
        core::hint::spin_loop();
    };
    let slot = arrived.trailing_zeros() as u8;
    if !crate::pci::is_gpu(slot) {
        fail(format_args!("00:{slot:02x}.0 is not the emulated GPU"));
    }
    crate::pci::check_device(slot, false);
    let bar0 = u64::from(config_read(slot, 0x10) & !0xf);
    let bar1 = crate::pci::bar1_address(slot);
    write_state(bar0, bar1);
    crate::pattern::zero(JOB_ADDR, JOB_LEN);
    TG_MSI_COUNT.store(0, Ordering::Release);
    mmio_write(bar0 + REG_HOLD, 1);
    mmio_write(bar0 + REG_DMA_ADDR_LO, JOB_ADDR as u32);
    mmio_write(bar0 + REG_DMA_ADDR_HI, (JOB_ADDR >> 32) as u32);
    mmio_write(bar0 + REG_DMA_LEN, JOB_LEN as u32);
    mmio_write(bar0 + REG_DMA_SEED, JOB_SEED as u32);
    mmio_write(bar0 + REG_DOORBELL, 0);
    check_state(bar0, bar1, 0);
    println!("gpu-migrate: state written, a DMA job queued at 00:{slot:02x}.0");
    let mut iteration = 1u64;
    loop {
        check_state(bar0, bar1, iteration);
        // SAFETY: RAM at 48 MiB, identity mapped.
        if unsafe { (JOB_ADDR as *const u64).read_volatile() } != 0 {
            fail(format_args!("the held job wrote RAM"));
        }
        println!("gpu-migrate: iter {iteration} ok");
        // About a second between checks, but the byte is noticed within milliseconds.
        let released = (0..20).any(|_| {
            for _ in 0..1_000_000 {
                core::hint::spin_loop();
            }
            serial_byte().is_some()
        });
        if released {
            break;
        }
        iteration += 1;
    }
    // The device may have changed under the loop (a restore onto another device process).
    check_state(bar0, bar1, iteration);
    println!("gpu-migrate: device state intact, releasing the queued job");
    mmio_write(bar0 + REG_HOLD, 0);
    if wait_for_interrupt(&TG_MSI_COUNT) == 0 {
        fail(format_args!("no MSI-X interrupt from the queued job"));
    }
    let (done, status) = (
        mmio_read(bar0 + REG_DMA_DONE),
        mmio_read(bar0 + REG_DMA_STATUS),
    );
    if done != 2 || status != 0 {
        fail(format_args!(
            "after the queued job: done {done}, status {status}"
        ));
    }
    check_job();
    println!("gpu-migrate: queued job ran, msi-x received, dma verified");
    println!("gpu-migrate: ok");
    exit(0)
}
