//! The `pci-topology` workload: walks the PCI hierarchy from bus 0 through every bridge
//! (configuration mechanism #1, any bus), prints the tree, and checks it.
//!
//! - `pci-topology SWITCHES PER_SWITCH`: the emulated GPUs sit behind SWITCHES switches
//!   (a root port, then a switch upstream port, then a downstream port per GPU) with
//!   PER_SWITCH GPUs each, and none elsewhere;
//! - `pci-topology flat COUNT`: COUNT GPUs on bus 0 and no bridges;
//! - `pci-topology ports COUNT`: COUNT GPUs, each alone behind a root port on bus 0.
//!
//! For every GPU each BAR must lie inside the matching window of every bridge above it
//! (BAR0 in the memory windows, the 64-bit prefetchable BARs in the prefetchable ones),
//! and its BAR0 must answer (the BOOT_0 register). Then `pci-topology: ok`. A last word
//! `hold` repeats the whole check forever (`pci-topology: ok N` each pass) so a test can
//! snapshot the VM and check the restored one.
//!
//! A last word `snapshot` runs the `pci` checks on every GPU (MSI-X on, a DMA, its scratch
//! registers written), then waits for a byte on the serial port (sent to the restored VMM's
//! stdin once the VM was snapshotted and restored in a new process), walks the tree again,
//! which must be the same (every port's place, bus numbers and windows, every GPU's place
//! and BARs), and checks that each GPU kept its state and does one more DMA signalled by
//! its MSI-X interrupt: `pci-topology: restored ok`. The GPUs are reached through the
//! configuration address's device field, as the `pci` checks take them (buses below 8).

use crate::arch::{inl, outl};
use crate::console::exit;
use crate::pci::mmio_read;
use crate::println;

const CONFIG_ADDRESS: u16 = 0xcf8;
const CONFIG_DATA: u16 = 0xcfc;
const NVIDIA: u32 = 0x10de;
/// gpuvm-vfio's emu::regs::BOOT_0 value.
const BOOT_0_VALUE: u32 = 0x1a00_00a1;
const EXIT_FAIL: u32 = 1;
const EXIT_USAGE: u32 = 2;
const MAX_DEPTH: usize = 8;
const MAX_GPUS: usize = 32;
const MAX_SWITCHES: usize = 16;
const MAX_SEEN: usize = 64;
/// The DMA each GPU does after the restore (pci::check_kept_device's seed).
const AFTER_RESTORE_SEED: u64 = 0x70b0;
const SERIAL_DATA: u16 = 0x3f8;
const SERIAL_LINE_STATUS: u16 = 0x3fd;
const PORT_ROOT: u32 = 0x4;
const PORT_UPSTREAM: u32 = 0x5;
const PORT_DOWNSTREAM: u32 = 0x6;

fn fail(what: core::fmt::Arguments) -> ! {
    println!("pci-topology: FAIL {what}");
    exit(EXIT_FAIL)
}

fn read(bus: u8, device: u8, register: u8) -> u32 {
    let address =
        1 << 31 | u32::from(bus) << 16 | u32::from(device) << 11 | u32::from(register & 0xfc);
    outl(CONFIG_ADDRESS, address);
    inl(CONFIG_DATA)
}

/// A bridge on the way down: its port type, address and windows ([base, end)).
#[derive(Clone, Copy, Default)]
struct Bridge {
    port: u32,
    bus: u8,
    device: u8,
    memory: (u64, u64),
    prefetchable: (u64, u64),
}

/// What the walk found.
struct Found {
    gpus: usize,
    bridges: usize,
    /// Upstream ports (bus << 8 | device) and the GPUs below each.
    switches: [(u16, usize); MAX_SWITCHES],
    switch_count: usize,
    gpus_on_bus0: usize,
    /// GPUs right behind a root port on bus 0.
    gpus_on_root_ports: usize,
    /// What a restore must keep: each bridge (bus, device, secondary, subordinate and its
    /// windows) and each GPU (bus, device and BARs), in walk order.
    seen: [[u64; 6]; MAX_SEEN],
    seen_count: usize,
    /// Each GPU's bus and device.
    gpu_places: [(u8, u8); MAX_GPUS],
}

impl Found {
    fn new() -> Self {
        Found {
            gpus: 0,
            bridges: 0,
            switches: [(0, 0); MAX_SWITCHES],
            switch_count: 0,
            gpus_on_bus0: 0,
            gpus_on_root_ports: 0,
            seen: [[0; 6]; MAX_SEEN],
            seen_count: 0,
            gpu_places: [(0, 0); MAX_GPUS],
        }
    }

    fn see(&mut self, entry: [u64; 6]) {
        if self.seen_count == MAX_SEEN {
            fail(format_args!("more than {MAX_SEEN} functions"));
        }
        self.seen[self.seen_count] = entry;
        self.seen_count += 1;
    }
}

/// The PCIe port type of a bridge (0 if it has no PCIe capability).
fn port_type(bus: u8, device: u8) -> u32 {
    if read(bus, device, 0x04) >> 16 & 0x10 == 0 {
        return 0;
    }
    let mut pointer = (read(bus, device, 0x34) & 0xfc) as u8;
    for _ in 0..48 {
        if pointer < 0x40 {
            return 0;
        }
        let header = read(bus, device, pointer);
        if header & 0xff == 0x10 {
            return header >> 20 & 0xf;
        }
        pointer = (header >> 8 & 0xfc) as u8;
    }
    0
}

fn windows(bus: u8, device: u8) -> ((u64, u64), (u64, u64)) {
    let memory = read(bus, device, 0x20);
    let memory_base = u64::from(memory & 0xfff0) << 16;
    let memory_end = (u64::from(memory >> 16 & 0xfff0) << 16) + (1 << 20);
    let pref = read(bus, device, 0x24);
    let pref_base = u64::from(pref & 0xfff0) << 16 | u64::from(read(bus, device, 0x28)) << 32;
    let pref_end = (u64::from(pref >> 16 & 0xfff0) << 16
        | u64::from(read(bus, device, 0x2c)) << 32)
        + (1 << 20);
    ((memory_base, memory_end), (pref_base, pref_end))
}

fn port_name(port: u32) -> &'static str {
    match port {
        PORT_ROOT => "root-port",
        PORT_UPSTREAM => "switch-upstream",
        PORT_DOWNSTREAM => "switch-downstream",
        _ => "bridge",
    }
}

fn indent(depth: usize) -> &'static str {
    &"                "[..(2 * depth).min(16)]
}

/// A GPU's BAR `index` (address; 64-bit BARs read both halves).
fn bar(bus: u8, device: u8, index: u8) -> (u64, bool) {
    let low = read(bus, device, 0x10 + 4 * index);
    let wide = low & 0b110 == 0b100;
    let high = if wide {
        u64::from(read(bus, device, 0x14 + 4 * index)) << 32
    } else {
        0
    };
    (high | u64::from(low & !0xf), wide && low & 0b1000 != 0)
}

fn check_gpu(bus: u8, device: u8, above: &[Bridge], print: bool) {
    let (bar0, _) = bar(bus, device, 0);
    let (bar1, pref1) = bar(bus, device, 1);
    let (bar3, pref3) = bar(bus, device, 3);
    if bar0 == 0 || bar1 == 0 || bar3 == 0 || !pref1 || !pref3 {
        fail(format_args!(
            "{bus:02x}:{device:02x}.0: BARs not assigned ({bar0:#x} {bar1:#x} {bar3:#x})"
        ));
    }
    for bridge in above {
        let inside = |address: u64, (base, end): (u64, u64)| base <= address && address < end;
        if !inside(bar0, bridge.memory)
            || !inside(bar1, bridge.prefetchable)
            || !inside(bar3, bridge.prefetchable)
        {
            fail(format_args!(
                "{bus:02x}:{device:02x}.0 BARs {bar0:#x} {bar1:#x} {bar3:#x} outside the windows of \
                 {:02x}:{:02x}.0 (memory {:#x}..{:#x}, prefetchable {:#x}..{:#x})",
                bridge.bus,
                bridge.device,
                bridge.memory.0,
                bridge.memory.1,
                bridge.prefetchable.0,
                bridge.prefetchable.1
            ));
        }
    }
    let boot = mmio_read(bar0);
    if boot != BOOT_0_VALUE {
        fail(format_args!(
            "{bus:02x}:{device:02x}.0 BOOT_0 reads {boot:#x} at {bar0:#x}"
        ));
    }
    if print {
        println!(
            "pci-topology: {}{bus:02x}:{device:02x}.0 gpu BAR0 {bar0:#x} BAR1 {bar1:#x} BAR3 {bar3:#x} boot0 {boot:#x}",
            indent(above.len())
        );
    }
}

/// Walks `bus` with the bridges `above` it (depth first).
fn walk(bus: u8, above: &mut [Bridge; MAX_DEPTH], depth: usize, found: &mut Found, print: bool) {
    for device in 0..32u8 {
        let ids = read(bus, device, 0);
        if ids & 0xffff == 0xffff {
            continue;
        }
        let header = read(bus, device, 0x0c) >> 16 & 0x7f;
        if header == 1 {
            let buses = read(bus, device, 0x18);
            let (secondary, subordinate) = ((buses >> 8) as u8, (buses >> 16) as u8);
            let port = port_type(bus, device);
            let (memory, prefetchable) = windows(bus, device);
            if print {
                println!(
                    "pci-topology: {}{bus:02x}:{device:02x}.0 {} buses {secondary:02x}..{subordinate:02x} \
                     memory {:#x}..{:#x} prefetchable {:#x}..{:#x}",
                    indent(depth),
                    port_name(port),
                    memory.0,
                    memory.1,
                    prefetchable.0,
                    prefetchable.1
                );
            }
            if secondary <= bus || depth + 1 >= MAX_DEPTH {
                fail(format_args!(
                    "{bus:02x}:{device:02x}.0: secondary bus {secondary:#x} at depth {depth}"
                ));
            }
            found.bridges += 1;
            found.see([
                u64::from(bus) << 8 | u64::from(device),
                u64::from(secondary) << 8 | u64::from(subordinate),
                memory.0,
                memory.1,
                prefetchable.0,
                prefetchable.1,
            ]);
            if port == PORT_UPSTREAM {
                if found.switch_count == MAX_SWITCHES {
                    fail(format_args!("more than {MAX_SWITCHES} switches"));
                }
                found.switches[found.switch_count] = (u16::from(bus) << 8 | u16::from(device), 0);
                found.switch_count += 1;
            }
            above[depth] = Bridge {
                port,
                bus,
                device,
                memory,
                prefetchable,
            };
            walk(secondary, above, depth + 1, found, print);
        } else if ids & 0xffff == NVIDIA {
            check_gpu(bus, device, &above[..depth], print);
            if found.gpus == MAX_GPUS {
                fail(format_args!("more than {MAX_GPUS} GPUs"));
            }
            found.gpu_places[found.gpus] = (bus, device);
            found.gpus += 1;
            found.see([
                1 << 32 | u64::from(bus) << 8 | u64::from(device),
                0,
                bar(bus, device, 0).0,
                bar(bus, device, 1).0,
                bar(bus, device, 3).0,
                0,
            ]);
            if depth == 0 {
                found.gpus_on_bus0 += 1;
            }
            if depth == 1 && above[0].port == PORT_ROOT {
                found.gpus_on_root_ports += 1;
            }
            // The switch it sits behind: an upstream port right above its downstream port.
            if depth >= 2
                && above[depth - 1].port == PORT_DOWNSTREAM
                && above[depth - 2].port == PORT_UPSTREAM
            {
                let key = u16::from(above[depth - 2].bus) << 8 | u16::from(above[depth - 2].device);
                if let Some(entry) = found.switches[..found.switch_count]
                    .iter_mut()
                    .find(|(k, _)| *k == key)
                {
                    entry.1 += 1;
                }
            }
        }
    }
}

fn number(word: Option<&str>) -> usize {
    match word.and_then(|w| w.parse().ok()) {
        Some(n) => n,
        None => {
            println!(
                "pci-topology: usage: pci-topology SWITCHES PER_SWITCH | flat COUNT | ports COUNT [hold|snapshot]"
            );
            exit(EXIT_USAGE)
        }
    }
}

/// The layout the command line expects.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Expect {
    Switches,
    Flat,
    Ports,
}

/// One walk and check; prints the tree when `print`.
fn check(expect: Expect, first: usize, second: usize, print: bool) -> Found {
    let mut found = Found::new();
    let mut above = [Bridge::default(); MAX_DEPTH];
    walk(0, &mut above, 0, &mut found, print);
    if expect == Expect::Ports {
        if found.switch_count != 0 || found.gpus_on_root_ports != second || found.gpus != second {
            fail(format_args!(
                "expected {second} GPUs each behind a root port, found {} GPUs ({} so), {} switches",
                found.gpus, found.gpus_on_root_ports, found.switch_count
            ));
        }
        return found;
    }
    if expect == Expect::Flat {
        if found.bridges != 0 || found.gpus_on_bus0 != second || found.gpus != second {
            fail(format_args!(
                "expected {second} GPUs on bus 0 and no bridges, found {} GPUs ({} on bus 0), {} bridges",
                found.gpus, found.gpus_on_bus0, found.bridges
            ));
        }
        return found;
    }
    let switches = &found.switches[..found.switch_count];
    if switches.len() != first
        || switches.iter().any(|&(_, gpus)| gpus != second)
        || found.gpus != first * second
    {
        fail(format_args!(
            "expected {first} switches with {second} GPUs each, found {} switches, {} GPUs",
            switches.len(),
            found.gpus
        ));
    }
    found
}

/// The `pci` checks' handle on the GPU at `bus`:`device` (bus below 8: it goes in the
/// configuration address above the device number).
fn pci_handle(bus: u8, device: u8) -> u8 {
    if bus >= 8 || device >= 32 {
        fail(format_args!(
            "{bus:02x}:{device:02x}.0 is out of the pci checks' reach"
        ));
    }
    bus << 5 | device
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

/// `snapshot`: the GPUs checked and left with state, then (after the restore) the same
/// tree, and each GPU's kept state and one more DMA with its MSI-X interrupt.
fn snapshot_and_check(expect: Expect, first: usize, second: usize, before: Found) -> ! {
    for &(bus, device) in &before.gpu_places[..before.gpus] {
        crate::pci::check_device(pci_handle(bus, device), false);
        println!("pci-topology: {bus:02x}:{device:02x}.0 passed the pci checks");
    }
    println!("pci-topology: GPUs checked; send a byte once the VM is restored");
    while inb(SERIAL_LINE_STATUS) & 1 == 0 {
        core::hint::spin_loop();
    }
    inb(SERIAL_DATA);
    let after = check(expect, first, second, true);
    if after.seen[..after.seen_count] != before.seen[..before.seen_count] {
        for (index, entry) in before.seen[..before.seen_count].iter().enumerate() {
            let now = after.seen.get(index).copied().unwrap_or_default();
            if now != *entry {
                fail(format_args!(
                    "after the restore entry {index} of the tree is {now:x?}, was {entry:x?}"
                ));
            }
        }
        fail(format_args!(
            "after the restore the tree has {} entries, had {}",
            after.seen_count, before.seen_count
        ));
    }
    println!(
        "pci-topology: after the restore the same tree: {} ports, {} GPUs, same buses, windows \
         and BARs",
        after.bridges, after.gpus
    );
    for &(bus, device) in &after.gpu_places[..after.gpus] {
        crate::pci::check_kept_device(pci_handle(bus, device), AFTER_RESTORE_SEED);
        println!(
            "pci-topology: {bus:02x}:{device:02x}.0 kept its state and did one more DMA with \
             MSI-X, verified"
        );
    }
    println!("pci-topology: restored ok");
    exit(0)
}

pub fn run(words: &mut crate::args::Words) -> ! {
    let first = words.next_word();
    let expect = match first {
        Some("flat") => Expect::Flat,
        Some("ports") => Expect::Ports,
        _ => Expect::Switches,
    };
    let (first, second) = if expect == Expect::Switches {
        (number(first), number(words.next_word()))
    } else {
        (0, number(words.next_word()))
    };
    let last = words.next_word();
    let hold = last == Some("hold");
    let found = check(expect, first, second, true);
    println!("pci-topology: ok");
    if last == Some("snapshot") {
        snapshot_and_check(expect, first, second, found);
    }
    if !hold {
        exit(0);
    }
    let mut pass = 1u64;
    loop {
        check(expect, first, second, false);
        println!("pci-topology: ok {pass}");
        pass += 1;
        for _ in 0..20_000_000u64 {
            core::hint::spin_loop();
        }
    }
}
