//! The `p2p [off | hotplug | loop | bench MIB ROUNDS]` workload: peer-to-peer DMA between two emulated GPUs.
//!
//! GPU A's DMA engine writes a pattern at GPU B's BAR1 guest address; the VMM has mapped
//! B's BAR1 there in A's DMA context, so the device process writes B's memory, and the
//! guest reads the pattern back through its own mapping of B's BAR1. Then the guest moves
//! B's BAR1 to a free address above every 64-bit BAR (memory decoding off while it
//! rewrites the BAR, as Linux does), DMAs again at the new address and checks it, and a
//! DMA to the old address must now fail (the device's DMA_STATUS 1: not mapped).
//! Lines: `p2p: A 00:DD.0 B 00:DD.0 B.BAR1 ADDR`, `p2p: dma at ADDR ok`, `p2p: moved
//! B.BAR1 to ADDR`, `p2p: old address refused`, then `p2p: ok`.
//!
//! `p2p off` (B started with `p2p=off`): the DMA to B's BAR1 must fail (status 1);
//! prints `p2p: peer refused` and `p2p: ok off`.
//!
//! `p2p hotplug`: both GPUs hot-plugged (see [`hotplug_checks`]); prints `p2p: ok hotplug`.
//!
//! `p2p loop`: the default checks over and over, without end (see [`loop_checks`]); prints
//! `p2p: round N ok` after each round.
//!
//! `p2p bench MIB ROUNDS`: ROUNDS times MIB MiB written by A into B's BAR1 directly, then
//! the same through guest RAM (A's DMA into RAM, the guest copies RAM to B's BAR1: the
//! bounce NCCL falls back to without P2P); prints `p2p-bench: direct BYTES CYCLES` and
//! `p2p-bench: staged BYTES CYCLES` (TSC cycles; the host converts).

use crate::arch::rdtsc;
use crate::bootinfo::{BootInfo, E820_RAM};
use crate::console::exit;
use crate::pattern::pattern;
use crate::pci::{
    config_read, config_write, is_gpu, mmio_read, mmio_write, size_bar, REG_DMA_ADDR_HI,
    REG_DMA_ADDR_LO, REG_DMA_DONE, REG_DMA_LEN, REG_DMA_SEED, REG_DMA_STATUS, REG_DOORBELL,
};
use crate::println;

const EXIT_FAIL: u32 = 1;
const EXIT_USAGE: u32 = 2;
/// Bytes each check DMAs.
const CHECK_LEN: u64 = 64 << 10;
/// Status the emulated GPU reports for a DMA whose range is not mapped.
const STATUS_UNMAPPED: u32 = 1;
/// The bench's staging buffer in guest RAM.
const STAGING: u64 = 64 << 20;
/// Command register: memory decoding and Bus Master.
const COMMAND_MEMORY: u32 = 0x2;
const COMMAND_BUS_MASTER: u32 = 0x4;

fn fail(what: core::fmt::Arguments) -> ! {
    println!("p2p: FAIL {what}");
    exit(EXIT_FAIL)
}

struct Gpu {
    slot: u8,
    bar0: u64,
    bar1: u64,
    bar1_size: u64,
}

/// Sizes BAR `index` of `slot` with memory decoding off meanwhile (an all-ones BAR must
/// not decode, nor be mapped for peers).
fn sized(slot: u8, index: u8) -> (u64, u64, u32) {
    let command = config_read(slot, 0x04) & 0xffff;
    config_write(slot, 0x04, command & !COMMAND_MEMORY);
    let bar = size_bar(slot, index);
    config_write(slot, 0x04, command);
    bar
}

/// The emulated GPU in `slot`, with memory decoding and Bus Master on.
fn open_gpu(slot: u8) -> Gpu {
    let (bar0, _, _) = sized(slot, 0);
    let (bar1, bar1_size, _) = sized(slot, 1);
    // The VMM holds this write until guest RAM is DMA-mapped for the device.
    let command = config_read(slot, 0x04) & 0xffff;
    config_write(slot, 0x04, command | COMMAND_MEMORY | COMMAND_BUS_MASTER);
    if config_read(slot, 0x04) & COMMAND_BUS_MASTER == 0 {
        fail(format_args!("00:{slot:02x}.0: bus master refused"));
    }
    if bar1 == 0 || !crate::boot::is_mapped(bar1, bar1_size) {
        fail(format_args!(
            "00:{slot:02x}.0: BAR1 at {bar1:#x} is not in a mapped range"
        ));
    }
    Gpu {
        slot,
        bar0,
        bar1,
        bar1_size,
    }
}

/// The first two emulated GPUs on bus 0, with memory decoding and Bus Master on.
fn find_gpus() -> (Gpu, Gpu) {
    let mut found = [None, None];
    let mut count = 0;
    for slot in 0..32u8 {
        if count < 2 && is_gpu(slot) {
            found[count] = Some(slot);
            count += 1;
        }
    }
    let (Some(a), Some(b)) = (found[0], found[1]) else {
        fail(format_args!("need two emulated GPUs, found {count}"));
    };
    (open_gpu(a), open_gpu(b))
}

/// Has `gpu` DMA `len` bytes of pattern `seed` to guest-physical `target`; returns the
/// device's status (the doorbell runs the job before the write completes).
fn dma(gpu: &Gpu, target: u64, len: u64, seed: u64) -> u32 {
    let done = mmio_read(gpu.bar0 + REG_DMA_DONE);
    mmio_write(gpu.bar0 + REG_DMA_ADDR_LO, target as u32);
    mmio_write(gpu.bar0 + REG_DMA_ADDR_HI, (target >> 32) as u32);
    mmio_write(gpu.bar0 + REG_DMA_LEN, len as u32);
    mmio_write(gpu.bar0 + REG_DMA_SEED, seed as u32);
    mmio_write(gpu.bar0 + REG_DOORBELL, 0);
    let mut spins = 0u64;
    while mmio_read(gpu.bar0 + REG_DMA_DONE) == done {
        spins += 1;
        if spins > 10_000_000 {
            fail(format_args!("DMA to {target:#x} never completed"));
        }
        core::hint::spin_loop();
    }
    mmio_read(gpu.bar0 + REG_DMA_STATUS)
}

fn zero(address: u64, len: u64) {
    for word in (address..address + len).step_by(8) {
        // SAFETY: a BAR or RAM range the caller owns, identity mapped and user writable.
        unsafe { (word as *mut u64).write_volatile(0) };
    }
}

/// Checks that the `len` bytes at guest address `at` hold pattern(seed, a).
fn check_pattern(at: u64, len: u64, seed: u64) {
    check_copied_pattern(at, len, seed, at);
}

/// Checks that the `len` bytes at `at` hold what the DMA engine wrote at `written_at`
/// (pattern(seed, written_at + offset)): the same place, or a copy of another.
fn check_copied_pattern(at: u64, len: u64, seed: u64, written_at: u64) {
    for offset in (0..len).step_by(8) {
        let address = at + offset;
        let expected = pattern(seed, written_at + offset);
        // SAFETY: B's BAR1, identity mapped (the VMM maps it into the guest).
        let got = unsafe { (address as *const u64).read_volatile() };
        if got != expected {
            fail(format_args!(
                "B's BAR1 at {address:#x} reads {got:#x}, expected {expected:#x}"
            ));
        }
    }
}

/// A's DMA into B's BAR1 at its current address, read back through the guest's mapping;
/// prints `p2p: dma at ADDR ok`.
fn dma_into_peer(a: &Gpu, b: &Gpu, seed: u64) {
    reach_peer(a, b, seed);
    println!("p2p: dma at {:#x} ok", b.bar1);
}

/// [`dma_into_peer`] without the line.
fn reach_peer(a: &Gpu, b: &Gpu, seed: u64) {
    zero(b.bar1, CHECK_LEN);
    let status = dma(a, b.bar1, CHECK_LEN, seed);
    if status != 0 {
        fail(format_args!(
            "A's DMA to B's BAR1 at {:#x}: status {status}",
            b.bar1
        ));
    }
    check_pattern(b.bar1, CHECK_LEN, seed);
}

/// A's DMA to `old`, the address B's BAR1 just left, must fail: not mapped any more.
fn old_address_refused(a: &Gpu, old: u64, seed: u64) {
    let status = dma(a, old, CHECK_LEN, seed);
    if status != STATUS_UNMAPPED {
        fail(format_args!(
            "DMA to B's old BAR1 address {old:#x}: status {status}, expected {STATUS_UNMAPPED}"
        ));
    }
}

/// A free address for B's BAR1 above every 64-bit BAR, within the guest's mapped range.
fn free_bar1_address(b: &Gpu) -> u64 {
    let to = highest_bar_end().next_multiple_of(b.bar1_size);
    if !crate::boot::is_mapped(to, b.bar1_size) {
        fail(format_args!(
            "no room to move B's BAR1 within its mapped range"
        ));
    }
    to
}

/// The end of the highest 64-bit BAR of any device on bus 0.
fn highest_bar_end() -> u64 {
    let mut end = 0;
    for slot in (0..32u8).filter(|&slot| config_read(slot, 0) & 0xffff != 0xffff) {
        for index in [1u8, 3] {
            let (address, size, flags) = sized(slot, index);
            if flags & 0x6 == 0x4 && address != 0 {
                end = end.max(address + size);
            }
        }
    }
    end
}

/// Moves B's BAR1 to `to` with memory decoding off meanwhile.
fn move_bar1(b: &mut Gpu, to: u64) {
    let command = config_read(b.slot, 0x04) & 0xffff;
    config_write(b.slot, 0x04, command & !COMMAND_MEMORY);
    let flags = config_read(b.slot, 0x14) & 0xf;
    config_write(b.slot, 0x14, to as u32 | flags);
    config_write(b.slot, 0x18, (to >> 32) as u32);
    config_write(b.slot, 0x04, command | COMMAND_MEMORY);
    let (now, _, _) = sized(b.slot, 1);
    if now != to {
        fail(format_args!(
            "B's BAR1 reads {now:#x} after moving it to {to:#x}"
        ));
    }
    b.bar1 = to;
}

fn checks(off: bool) -> ! {
    let (a, mut b) = find_gpus();
    println!(
        "p2p: A 00:{:02x}.0 B 00:{:02x}.0 B.BAR1 {:#x}",
        a.slot, b.slot, b.bar1
    );
    if off {
        let status = dma(&a, b.bar1, CHECK_LEN, 0x0ff);
        if status != STATUS_UNMAPPED {
            fail(format_args!(
                "DMA to the BAR1 of a p2p=off device: status {status}, expected {STATUS_UNMAPPED}"
            ));
        }
        println!("p2p: peer refused");
        println!("p2p: ok off");
        exit(0)
    }
    dma_into_peer(&a, &b, 0x9a1);
    let old = b.bar1;
    let to = free_bar1_address(&b);
    move_bar1(&mut b, to);
    println!("p2p: moved B.BAR1 to {to:#x}");
    dma_into_peer(&a, &b, 0x9a2);
    old_address_refused(&a, old, 0x9a3);
    println!("p2p: old address refused");
    println!("p2p: ok");
    exit(0)
}

/// `p2p loop`: rounds without end, each A's DMA into B's BAR1 where it is, then B's BAR1
/// moved to the other of two addresses (its first one and a free one above every 64-bit
/// BAR, by turns), A's DMA there, and A's DMA to the address it left refused. Something
/// outside the guest that changes hands between rounds (a live update of the VMM) must
/// keep the peer mappings following the BAR.
fn loop_checks() -> ! {
    let (a, mut b) = find_gpus();
    let home = b.bar1;
    let away = free_bar1_address(&b);
    println!(
        "p2p: A 00:{:02x}.0 B 00:{:02x}.0 B.BAR1 {home:#x} and {away:#x} by turns",
        a.slot, b.slot
    );
    let mut round = 0u64;
    loop {
        round += 1;
        let seed = round << 2;
        reach_peer(&a, &b, seed);
        let old = b.bar1;
        move_bar1(&mut b, if old == home { away } else { home });
        reach_peer(&a, &b, seed + 1);
        old_address_refused(&a, old, seed + 2);
        println!("p2p: round {round} ok");
    }
}

/// `p2p hotplug`: two GPUs hot-plugged one after the other (PUT /gpus); each must reach the
/// other's BAR1 (the second's BAR mapped for the first, the first's into the second). When
/// the VMM asks to eject the second, the guest ejects it; A's DMA to the address B's BAR1
/// had must then fail once the VMM has taken B down (polled for up to 10 s).
fn hotplug_checks() -> ! {
    println!("p2p: waiting for 2 devices");
    let mut pending = 0;
    let first = crate::hotplug::next_arrival(&mut pending);
    let second = crate::hotplug::next_arrival(&mut pending);
    if !is_gpu(first) || !is_gpu(second) {
        fail(format_args!(
            "00:{first:02x}.0 and 00:{second:02x}.0 are not both emulated GPUs"
        ));
    }
    let (a, b) = (open_gpu(first), open_gpu(second));
    println!(
        "p2p: A 00:{:02x}.0 B 00:{:02x}.0 B.BAR1 {:#x}",
        a.slot, b.slot, b.bar1
    );
    dma_into_peer(&a, &b, 0x7a1);
    dma_into_peer(&b, &a, 0x7a2);
    println!("p2p: both directions ok");
    crate::hotplug::wait_for_eject_request("p2p", b.slot);
    crate::pci::release_device(b.slot);
    if let Err(ids) = crate::hotplug::eject(b.slot) {
        fail(format_args!(
            "00:{:02x}.0 still reads {ids:#010x} after the eject",
            b.slot
        ));
    }
    println!("p2p: B ejected");
    let tsc_hz = crate::arch::tsc_hz();
    for _ in 0..2000 {
        if dma(&a, b.bar1, CHECK_LEN, 0x7a3) == STATUS_UNMAPPED {
            println!("p2p: ejected peer's address refused");
            println!("p2p: ok hotplug");
            exit(0)
        }
        crate::arch::delay_us(tsc_hz, 5000);
    }
    fail(format_args!(
        "A's DMA to the ejected B's BAR1 at {:#x} still succeeds",
        b.bar1
    ))
}

fn bench(info: &BootInfo, mib: u64, rounds: u64) -> ! {
    let (a, b) = find_gpus();
    let len = mib << 20;
    if len == 0 || len > b.bar1_size || len > u64::from(u32::MAX) {
        println!("p2p-bench: MIB must be 1 to B's BAR1 size and below 4 GiB");
        exit(EXIT_USAGE);
    }
    let staging_fits = info.memmap().iter().any(|entry| {
        entry.kind == E820_RAM && entry.addr <= STAGING && STAGING + len <= entry.addr + entry.size
    });
    if !staging_fits {
        println!("p2p-bench: FAIL no RAM for {mib} MiB at {STAGING:#x}");
        exit(EXIT_USAGE);
    }
    // One untimed pass of each path first: every page of the staging RAM and of B's BAR1
    // is then allocated in the host and mapped for the guest and the device process, so
    // the timed passes measure copies, not first-touch faults.
    let direct_pass = |round: u64| {
        if dma(&a, b.bar1, len, round) != 0 {
            fail(format_args!("bench DMA into B's BAR1 failed"));
        }
    };
    let staged_pass = |round: u64| {
        if dma(&a, STAGING, len, round) != 0 {
            fail(format_args!("bench DMA into guest RAM failed"));
        }
        // SAFETY: the staging RAM and B's BAR1 are identity mapped, `len` bytes each
        // (checked above), and do not overlap.
        unsafe {
            core::ptr::copy_nonoverlapping(STAGING as *const u8, b.bar1 as *mut u8, len as usize)
        };
    };
    direct_pass(0);
    staged_pass(0);
    let start = rdtsc();
    (0..rounds).for_each(direct_pass);
    let direct = rdtsc() - start;
    check_pattern(b.bar1, CHECK_LEN, rounds - 1);
    println!("p2p-bench: direct {} {direct}", len * rounds);
    let start = rdtsc();
    (0..rounds).for_each(staged_pass);
    let staged = rdtsc() - start;
    check_copied_pattern(b.bar1, CHECK_LEN, rounds - 1, STAGING);
    println!("p2p-bench: staged {} {staged}", len * rounds);
    println!("p2p-bench: ok");
    exit(0)
}

pub fn run(info: &BootInfo, words: &mut crate::args::Words) -> ! {
    match words.next_word() {
        None => checks(false),
        Some("off") => checks(true),
        Some("hotplug") => hotplug_checks(),
        Some("loop") => loop_checks(),
        Some("bench") => {
            let number = |word: Option<&str>| word.and_then(crate::args::parse_number);
            let (Some(mib), Some(rounds)) = (number(words.next_word()), number(words.next_word()))
            else {
                println!("p2p: usage: p2p [off | hotplug | loop | bench MIB ROUNDS]");
                exit(EXIT_USAGE)
            };
            bench(info, mib, rounds.max(1))
        }
        Some(other) => {
            println!(
                "p2p: unknown mode '{other}'; usage: p2p [off | hotplug | loop | bench MIB ROUNDS]"
            );
            exit(EXIT_USAGE)
        }
    }
}
