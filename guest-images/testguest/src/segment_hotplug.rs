//! The `segment-hotplug SEGMENT` workload: a GPU hot-plugged onto PCI segment SEGMENT
//! (a NUMA node's segment, or one Cloud Hypervisor's `num_pci_segments` asked for) through
//! that segment's own ACPI hot-plug register block, as its host bridge's AML
//! (`\_SB.PC0N.PCNT`, `_EJ0`) would use it: polls its PCIU, finds the device through the
//! segment's ECAM window (from the MCFG; 0xCF8 reaches segment 0 only), checks it is the
//! emulated GPU, turns memory decoding on and writes and reads back a word at the start and
//! the end of its BAR1, then waits for the eject request on its PCID and ejects it (B0EJ).
//! The host side checks BAR1's address against the segment's window in gpuvm's log.

use crate::arch::{inl, outl};
use crate::bootinfo::BootInfo;
use crate::console::exit;
use crate::println;

/// gpuvm_devices::pci::hotplug::hotplug_port: segment 0's block is at 0xae00, segment N's
/// (N > 0) at 0xac00 + (N - 1) * 0x20.
fn hotplug_port(segment: u32) -> u16 {
    if segment == 0 {
        0xae00
    } else {
        0xac00 + (segment as u16 - 1) * 0x20
    }
}

const EXIT_FAIL: u32 = 1;

fn fail(what: core::fmt::Arguments) -> ! {
    println!("seghotplug: FAIL {what}");
    exit(EXIT_FAIL)
}

fn read32(addr: u64) -> u32 {
    // SAFETY: ECAM windows and BARs lie in the identity-mapped, user-accessible first
    // 4 GiB or are reached through the page tables' 1 GiB mappings of the BAR windows; the
    // access traps to the VMM (or reaches the BAR's memory).
    unsafe { (addr as *const u32).read_volatile() }
}

fn write32(addr: u64, value: u32) {
    // SAFETY: as in `read32`.
    unsafe { (addr as *mut u32).write_volatile(value) }
}

/// Polls `port` (a read clears it) until it shows a bit; returns every bit it showed.
fn wait_for(port: u16) -> u32 {
    loop {
        let bits = inl(port);
        if bits != 0 {
            return bits;
        }
        for _ in 0..20_000 {
            core::hint::spin_loop();
        }
    }
}

pub fn run(info: &BootInfo, segment: Option<&str>) -> ! {
    let Some(segment) = segment.and_then(|s| s.parse::<u32>().ok()) else {
        fail(format_args!("usage: segment-hotplug SEGMENT"))
    };
    let Some(ecam) = crate::numa::ecam_base(info.rsdp_paddr, segment) else {
        fail(format_args!("the MCFG has no window for segment {segment}"))
    };
    let port = hotplug_port(segment);
    println!("seghotplug: waiting on segment {segment} (ECAM {ecam:#x}, ports {port:#x})");
    let arrived = wait_for(port);
    let slot = arrived.trailing_zeros();
    let config = ecam + (u64::from(slot) << 15);
    let ids = read32(config);
    if !crate::pci::is_gpu_ids(ids) {
        fail(format_args!(
            "{segment:04x}:00:{slot:02x}.0 is {ids:#010x}, not the emulated GPU"
        ));
    }
    let bar1_of =
        || u64::from(read32(config + 0x14) & !0xf) | u64::from(read32(config + 0x18)) << 32;
    let bar1 = bar1_of();
    // Sized as Linux does, with memory decoding off (it is until the guest turns it on).
    write32(config + 0x14, u32::MAX);
    write32(config + 0x18, u32::MAX);
    let size = (!bar1_of()).wrapping_add(1);
    write32(config + 0x14, bar1 as u32);
    write32(config + 0x18, (bar1 >> 32) as u32);
    if bar1 == 0 || size == 0 || bar1 % size != 0 || bar1_of() != bar1 {
        fail(format_args!(
            "BAR1 at {bar1:#x} ({size:#x} bytes) is not placed and naturally aligned"
        ));
    }
    let command = read32(config + 4) & 0xffff;
    write32(config + 4, command | 0x2);
    // The first and the last word of BAR1 (mapped on demand: it may lie past what the
    // boot page tables map).
    crate::bigbars::round_trip(bar1, 0x5e97_0000_0000_0001);
    crate::bigbars::round_trip(bar1 + size - 8, 0x5e97_0000_0000_0002);
    println!(
        "seghotplug: device at {segment:04x}:00:{slot:02x}.0 is the emulated GPU, BAR1 at {bar1:#x} ({size:#x} bytes) reads back"
    );
    loop {
        let down = wait_for(port + 4);
        if down & 1 << slot != 0 {
            break;
        }
        println!("seghotplug: eject request for other slots {down:#x} ignored");
    }
    write32(config + 4, command & !0x6);
    outl(port + 8, 1 << slot);
    let gone = read32(config);
    if gone != u32::MAX {
        fail(format_args!(
            "{segment:04x}:00:{slot:02x}.0 still reads {gone:#010x} after the eject"
        ));
    }
    println!("seghotplug: ejected {segment:04x}:00:{slot:02x}.0; it reads all ones");
    println!("seghotplug: ok");
    exit(0)
}
