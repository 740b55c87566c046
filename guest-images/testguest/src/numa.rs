//! The `numa` workload: read the SRAT and SLIT as an OS does, print the NUMA nodes, their
//! memory ranges, each vCPU's node, each device's node and the distances, and check them
//! against what the test expects (it passes the VMM's command line on in words):
//!
//! ```text
//! numa cpus=D0,D1,.. mem=SIZE0,SIZE1,.. dist=D00,D01,..,D10,.. [gi=N0,N1,..]
//!      [hotplug=NODE,SIZE] [hold=SECONDS]
//! ```
//!
//! `cpus`: the node of APIC id 0, 1, ..; `mem`: each node's total boot RAM; `dist`: the SLIT
//! row by row; `gi`: the node of each Generic Initiator (passthrough device) in SRAT order;
//! `hotplug`: the one hot-pluggable memory range (room for hot-plugged RAM) and its node,
//! which must be flagged enabled and hot-pluggable, lie outside e820 RAM and start right
//! after it (the highest e820 RAM's end, at least 4 GiB, on a 1 GiB boundary); without
//! `hotplug` there must be none; `hold`: stay this long after `numa: ok` (the host side reads
//! the VMM's numa_maps then). Every boot RAM range must lie in e820 RAM and not overlap another,
//! and every Generic Initiator with a PCI handle must name a function that is there (in
//! segment 0 on bus 0 or behind bridges, read through 0xCF8; in another segment through
//! its ECAM window from the MCFG). Each online vCPU reads its own APIC id, and the node
//! the SRAT gives that id is printed ("numa: vcpu apic A runs on node D"), so the node of
//! each vCPU that really runs is what is checked. Ends `numa: ok`, or `numa: FAIL ...` and
//! exit 1.

use core::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

use crate::args::{parse_number, parse_size, Words};
use crate::bootinfo::BootInfo;
use crate::console::exit;
use crate::println;
use crate::smp::{self, read_u32, read_u64, read_u8};

const EXIT_FAIL: u32 = 1;
const HEADER_LEN: u64 = 36;
const MAX_TABLE_LEN: u64 = 0x10000;
/// Most nodes, vCPUs and devices this workload keeps.
const MAX_ITEMS: usize = 64;
const E820_RAM: u32 = 1;
/// SRAT memory affinity flags.
const MEMORY_ENABLED: u32 = 1;
const MEMORY_HOTPLUGGABLE: u32 = 1 << 1;
/// Where the VMM puts the hot-plug area: the end of boot RAM, at least 4 GiB, rounded up
/// to this.
const HOTPLUG_AREA_ALIGN: u64 = 1 << 30;
const FOUR_GIB: u64 = 1 << 32;
/// Generic Initiator device handle type: PCI (segment and bus/device/function).
const HANDLE_PCI: u8 = 1;
const CONFIG_ADDRESS: u16 = 0xcf8;
const CONFIG_DATA: u16 = 0xcfc;
/// The MCFG's allocations start after its header and 8 reserved bytes; each is 16 bytes
/// (base address, segment, start bus, end bus, reserved).
const MCFG_ENTRIES: u64 = HEADER_LEN + 8;
const MCFG_ENTRY_LEN: u64 = 16;
/// How long APs have to report their APIC ids.
const REPORT_WAIT_US: u64 = 2_000_000;

fn fail(what: core::fmt::Arguments) -> ! {
    println!("numa: FAIL {what}");
    exit(EXIT_FAIL)
}

/// A fixed-capacity list (no allocator here).
struct List {
    items: [u64; MAX_ITEMS],
    len: usize,
}

impl List {
    const fn new() -> List {
        List {
            items: [0; MAX_ITEMS],
            len: 0,
        }
    }

    fn push(&mut self, value: u64) {
        if self.len == MAX_ITEMS {
            fail(format_args!("more than {MAX_ITEMS} items"));
        }
        self.items[self.len] = value;
        self.len += 1;
    }

    fn as_slice(&self) -> &[u64] {
        &self.items[..self.len]
    }
}

fn parse_list(text: &str, parse: fn(&str) -> Option<u64>) -> List {
    let mut list = List::new();
    for word in text.split(',').filter(|w| !w.is_empty()) {
        match parse(word) {
            Some(value) => list.push(value),
            None => fail(format_args!("bad expectation '{word}'")),
        }
    }
    list
}

fn table_ok(addr: u64) -> u64 {
    let len = u64::from(read_u32(addr + 4));
    if !(HEADER_LEN..=MAX_TABLE_LEN).contains(&len) {
        fail(format_args!("table at {addr:#x} has length {len}"));
    }
    if !smp::checksum_ok(addr, len) {
        fail(format_args!("table at {addr:#x}: bad checksum"));
    }
    len
}

/// The XSDT's table with signature `sig`.
fn find_table(rsdp: u64, sig: &[u8; 4]) -> Option<(u64, u64)> {
    let xsdt = read_u64(rsdp + 24);
    let len = table_ok(xsdt);
    (xsdt + HEADER_LEN..xsdt + len)
        .step_by(8)
        .map(read_u64)
        .find(|&table| smp::bytes_equal(table, sig))
        .map(|table| (table, table_ok(table)))
}

/// APIC ids the online vCPUs read themselves (index: the order they reported in).
static REPORTED: [AtomicU32; MAX_ITEMS] = [const { AtomicU32::new(u32::MAX) }; MAX_ITEMS];
static REPORTS: AtomicUsize = AtomicUsize::new(0);

fn own_apic_id() -> u32 {
    crate::arch::cpuid(1, 0).ebx >> 24
}

fn report_apic_id(_cpu_index: usize) {
    let slot = REPORTS.fetch_add(1, Ordering::AcqRel);
    if slot < MAX_ITEMS {
        REPORTED[slot].store(own_apic_id(), Ordering::Release);
    }
}

/// A Generic Initiator names its device by the guest address it has, behind however many
/// bridges: a function must answer there (read with configuration mechanism #1, which
/// reaches every bus of segment 0).
fn check_device_present(bdf: u32) {
    let address = 1 << 31 | (bdf & 0xffff) << 8;
    crate::arch::outl(CONFIG_ADDRESS, address);
    let ids = crate::arch::inl(CONFIG_DATA);
    if ids & 0xffff == 0xffff {
        fail(format_args!(
            "the SRAT names device {:02x}:{:02x}.{}, where there is none",
            bdf >> 8,
            (bdf >> 3) & 0x1f,
            bdf & 7
        ));
    }
    println!(
        "numa: device {:02x}:{:02x}.{} is {:04x}:{:04x}",
        bdf >> 8,
        (bdf >> 3) & 0x1f,
        bdf & 7,
        ids & 0xffff,
        ids >> 16
    );
}

/// Where segment `segment`'s bus 0 configuration space starts (its MCFG entry's ECAM
/// base, for a window that starts at bus 0), if the MCFG has one.
pub(crate) fn ecam_base(rsdp: u64, segment: u32) -> Option<u64> {
    let (mcfg, mcfg_len) = find_table(rsdp, b"MCFG")?;
    let mut entry = mcfg + MCFG_ENTRIES;
    while entry + MCFG_ENTRY_LEN <= mcfg + mcfg_len {
        if (read_u32(entry + 8) & 0xffff) == segment && read_u8(entry + 10) == 0 {
            return Some(read_u64(entry));
        }
        entry += MCFG_ENTRY_LEN;
    }
    None
}

/// A Generic Initiator on a segment other than 0 (the VMM puts a NUMA node's passthrough
/// devices on a segment of their own): a function must answer at that address through the
/// segment's ECAM window, which the MCFG gives (0xCF8 reaches segment 0 only).
fn check_device_on_segment(rsdp: u64, segment: u32, bdf: u32) {
    let Some((mcfg, mcfg_len)) = find_table(rsdp, b"MCFG") else {
        fail(format_args!("the XSDT lists no MCFG for segment {segment}"))
    };
    let (bus, device, function) = (bdf >> 8, (bdf >> 3) & 0x1f, bdf & 7);
    let mut entry = mcfg + MCFG_ENTRIES;
    while entry + MCFG_ENTRY_LEN <= mcfg + mcfg_len {
        let (start_bus, end_bus) = (
            u32::from(read_u8(entry + 10)),
            u32::from(read_u8(entry + 11)),
        );
        let covers =
            (read_u32(entry + 8) & 0xffff) == segment && (start_bus..=end_bus).contains(&bus);
        if covers {
            let offset = u64::from(bus - start_bus) << 20
                | u64::from(device) << 15
                | u64::from(function) << 12;
            let addr = read_u64(entry) + offset;
            // SAFETY: the ECAM windows lie in the identity-mapped, user-accessible first
            // 4 GiB; the read traps to the VMM's PCI root of that segment.
            let ids = unsafe { (addr as *const u32).read_volatile() };
            if ids & 0xffff == 0xffff {
                fail(format_args!(
                    "the SRAT names device {segment:04x}:{bus:02x}:{device:02x}.{function}, where there is none"
                ));
            }
            println!(
                "numa: device {segment:04x}:{bus:02x}:{device:02x}.{function} is {:04x}:{:04x} (ECAM {addr:#x})",
                ids & 0xffff,
                ids >> 16
            );
            return;
        }
        entry += MCFG_ENTRY_LEN;
    }
    fail(format_args!(
        "the SRAT names segment {segment} bus {bus:02x}, which no MCFG window covers"
    ));
}

/// The hot-pluggable range `found` (node, base, size, flags) against `expected` (node,
/// size) and the e820 map: enabled and hot-pluggable, starting where the VMM's hot-plug
/// area starts, outside e820 RAM.
fn check_hotplug_range(
    info: &BootInfo,
    expected: Option<(u64, u64)>,
    found: Option<(u64, u64, u64, u32)>,
) {
    let (expected, (node, base, size, flags)) = match (expected, found) {
        (None, None) => return,
        (Some(_), None) => fail(format_args!("the SRAT has no hot-pluggable memory range")),
        (None, Some((node, base, ..))) => fail(format_args!(
            "a hot-pluggable memory range at {base:#x} (node {node}), not expected"
        )),
        (Some(expected), Some(found)) => (expected, found),
    };
    let ram_top = info
        .memmap()
        .iter()
        .filter(|e| e.kind == E820_RAM)
        .map(|e| e.addr + e.size)
        .max()
        .unwrap_or(0);
    let area_start = ram_top.max(FOUR_GIB).next_multiple_of(HOTPLUG_AREA_ALIGN);
    let overlaps_ram = info
        .memmap()
        .iter()
        .any(|e| e.kind == E820_RAM && e.addr < base + size && base < e.addr + e.size);
    println!(
        "numa: hot-pluggable range node {node} {base:#x}+{size:#x}, e820 RAM ends at {ram_top:#x}"
    );
    if flags != MEMORY_ENABLED | MEMORY_HOTPLUGGABLE {
        fail(format_args!(
            "hot-pluggable range flags {flags:#x}, expected enabled | hot-pluggable"
        ));
    }
    if base != area_start {
        fail(format_args!(
            "hot-pluggable range at {base:#x}, expected {area_start:#x} (after boot RAM)"
        ));
    }
    if overlaps_ram {
        fail(format_args!(
            "hot-pluggable range {base:#x} overlaps e820 RAM"
        ));
    }
    if (node, size) != expected {
        fail(format_args!(
            "hot-pluggable range: node {node}, {size:#x} bytes; expected node {}, {:#x}",
            expected.0, expected.1
        ));
    }
}

pub fn run(info: &BootInfo, words: &mut Words) -> ! {
    let (mut cpus, mut mem, mut dist, mut gi) = (None, None, None, None);
    let mut hotplug = None;
    let mut hold_seconds = 0;
    while let Some(word) = words.next_word() {
        match word.split_once('=') {
            Some(("cpus", v)) => cpus = Some(parse_list(v, parse_number)),
            Some(("mem", v)) => mem = Some(parse_list(v, parse_size)),
            Some(("dist", v)) => dist = Some(parse_list(v, parse_number)),
            Some(("gi", v)) => gi = Some(parse_list(v, parse_number)),
            Some(("hotplug", v)) => {
                let parsed = v
                    .split_once(',')
                    .and_then(|(node, size)| Some((parse_number(node)?, parse_size(size)?)));
                match parsed {
                    Some(expected) => hotplug = Some(expected),
                    None => fail(format_args!("bad hotplug '{v}' (NODE,SIZE)")),
                }
            }
            Some(("hold", v)) => match parse_number(v) {
                Some(seconds) => hold_seconds = seconds,
                None => fail(format_args!("bad hold '{v}'")),
            },
            _ => fail(format_args!(
                "unknown argument '{word}'; usage: numa cpus=.. mem=.. dist=.. [gi=..] [hotplug=N,SIZE] [hold=S]"
            )),
        }
    }
    let (Some(cpus), Some(mem), Some(dist)) = (cpus, mem, dist) else {
        fail(format_args!(
            "usage: numa cpus=.. mem=.. dist=.. [gi=..] [hold=S]"
        ))
    };
    if info.rsdp_paddr == 0 {
        fail(format_args!("no RSDP in the start info"));
    }
    let Some((srat, srat_len)) = find_table(info.rsdp_paddr, b"SRAT") else {
        fail(format_args!("the XSDT lists no SRAT"))
    };
    let Some((slit, _)) = find_table(info.rsdp_paddr, b"SLIT") else {
        fail(format_args!("the XSDT lists no SLIT"))
    };
    println!(
        "numa: SRAT at {srat:#x} revision {}, SLIT at {slit:#x}",
        read_u8(srat + 8)
    );

    // SRAT entries.
    let mut cpu_node = [u64::MAX; MAX_ITEMS];
    let mut node_mem = [0u64; MAX_ITEMS];
    let mut ranges = List::new();
    let mut range_ends = List::new();
    let mut devices = List::new();
    // The hot-pluggable range: (node, base, size, flags).
    let mut hotplug_range: Option<(u64, u64, u64, u32)> = None;
    let mut entry = srat + HEADER_LEN + 12;
    while entry + 2 <= srat + srat_len {
        let (kind, len) = (read_u8(entry), u64::from(read_u8(entry + 1)));
        if len < 2 || entry + len > srat + srat_len {
            fail(format_args!("SRAT entry at {entry:#x} has length {len}"));
        }
        match kind {
            0 => {
                let domain =
                    u64::from(read_u8(entry + 2)) | u64::from(read_u32(entry + 8) >> 8) << 8;
                let apic = usize::from(read_u8(entry + 3));
                let enabled = read_u32(entry + 4) & 1;
                println!("numa: SRAT apic {apic} node {domain} enabled {enabled}");
                if apic < MAX_ITEMS {
                    cpu_node[apic] = domain;
                }
            }
            1 if read_u32(entry + 28) & MEMORY_HOTPLUGGABLE != 0 => {
                let domain = u64::from(read_u32(entry + 2));
                let (base, size) = (read_u64(entry + 8), read_u64(entry + 16));
                let flags = read_u32(entry + 28);
                println!(
                    "numa: SRAT hot-pluggable memory node {domain} {base:#x}-{:#x} flags {flags:#x}",
                    base + size
                );
                if hotplug_range.is_some() {
                    fail(format_args!("more than one hot-pluggable memory range"));
                }
                hotplug_range = Some((domain, base, size, flags));
            }
            1 => {
                let domain = u64::from(read_u32(entry + 2));
                let base = read_u64(entry + 8);
                let size = read_u64(entry + 16);
                let flags = read_u32(entry + 28);
                println!(
                    "numa: SRAT memory node {domain} {base:#x}-{:#x} flags {flags:#x}",
                    base + size
                );
                let in_ram = info.memmap().iter().any(|e| {
                    e.kind == E820_RAM && e.addr <= base && base + size <= e.addr + e.size
                });
                // The first MiB holds reserved BIOS areas inside node 0's range, as on
                // real machines; only ranges above it must be RAM throughout.
                if base >= 1 << 20 && !in_ram {
                    fail(format_args!(
                        "node {domain} range {base:#x} is not e820 RAM"
                    ));
                }
                for (start, end) in ranges.as_slice().iter().zip(range_ends.as_slice()) {
                    if base < *end && *start < base + size {
                        fail(format_args!(
                            "node {domain} range {base:#x} overlaps another"
                        ));
                    }
                }
                ranges.push(base);
                range_ends.push(base + size);
                if (domain as usize) < MAX_ITEMS {
                    node_mem[domain as usize] += size;
                }
            }
            5 => {
                let domain = u64::from(read_u32(entry + 4));
                let handle_type = read_u8(entry + 3);
                let segment = read_u32(entry + 8) & 0xffff;
                let bdf = read_u32(entry + 8) >> 16;
                println!(
                    "numa: SRAT device {segment:04x}:{:02x}:{:02x}.{} node {domain} (handle type {handle_type})",
                    bdf >> 8,
                    (bdf >> 3) & 0x1f,
                    bdf & 7
                );
                if handle_type == HANDLE_PCI && segment == 0 {
                    check_device_present(bdf);
                } else if handle_type == HANDLE_PCI {
                    check_device_on_segment(info.rsdp_paddr, segment, bdf);
                }
                devices.push(domain);
            }
            other => println!("numa: SRAT entry type {other} skipped"),
        }
        entry += len;
    }

    // SLIT.
    let localities = read_u64(slit + HEADER_LEN);
    println!("numa: SLIT {localities} localities");
    for from in 0..localities {
        let mut row = [0u8; MAX_ITEMS];
        for to in 0..localities.min(MAX_ITEMS as u64) {
            row[to as usize] = read_u8(slit + HEADER_LEN + 8 + from * localities + to);
        }
        println!(
            "numa: distance from node {from}: {:?}",
            &row[..localities.min(MAX_ITEMS as u64) as usize]
        );
    }

    // Against the expectations.
    for (apic, expected) in cpus.as_slice().iter().enumerate() {
        if cpu_node[apic] != *expected {
            fail(format_args!(
                "apic {apic} is on node {} in the SRAT, expected {expected}",
                cpu_node[apic] as i64
            ));
        }
    }
    if let Some(extra) = (cpus.len..MAX_ITEMS).find(|a| cpu_node[*a] != u64::MAX) {
        fail(format_args!("the SRAT lists apic {extra}, not expected"));
    }
    for (node, expected) in mem.as_slice().iter().enumerate() {
        println!("numa: node {node} memory {} MiB", node_mem[node] >> 20);
        if node_mem[node] != *expected {
            fail(format_args!(
                "node {node} has {:#x} bytes of memory, expected {expected:#x}",
                node_mem[node]
            ));
        }
    }
    if (mem.len..MAX_ITEMS).any(|n| node_mem[n] != 0) {
        fail(format_args!("memory on a node not expected"));
    }
    if localities * localities != dist.len as u64 {
        fail(format_args!(
            "the SLIT has {localities} localities, expected {} distances",
            dist.len
        ));
    }
    for (index, expected) in dist.as_slice().iter().enumerate() {
        let found = u64::from(read_u8(slit + HEADER_LEN + 8 + index as u64));
        if found != *expected {
            fail(format_args!(
                "SLIT entry {index} is {found}, expected {expected}"
            ));
        }
    }
    check_hotplug_range(info, hotplug, hotplug_range);
    if let Some(gi) = gi {
        if gi.as_slice() != devices.as_slice() {
            fail(format_args!(
                "device nodes {:?}, expected {:?}",
                devices.as_slice(),
                gi.as_slice()
            ));
        }
    }

    // Each online vCPU reads its own APIC id; its node is the SRAT's for that id.
    report_apic_id(0);
    let table = smp::discover(info.rsdp_paddr);
    let online = smp::bring_up(&table, crate::arch::tsc_hz());
    smp::run_on_aps(report_apic_id);
    let started = crate::arch::rdtsc();
    let timeout = crate::arch::tsc_hz() / 1_000_000 * REPORT_WAIT_US;
    while REPORTS.load(Ordering::Acquire) < online.online {
        if crate::arch::rdtsc().wrapping_sub(started) > timeout {
            fail(format_args!(
                "{} of {} vCPUs reported their APIC id",
                REPORTS.load(Ordering::Acquire),
                online.online
            ));
        }
        core::hint::spin_loop();
    }
    // In APIC id order (the APs report in any order).
    let reported = REPORTS.load(Ordering::Acquire).min(MAX_ITEMS);
    for apic in 0..=u8::MAX as u32 {
        if !REPORTED[..reported]
            .iter()
            .any(|slot| slot.load(Ordering::Acquire) == apic)
        {
            continue;
        }
        let node = cpu_node.get(apic as usize).copied().unwrap_or(u64::MAX);
        if node == u64::MAX {
            fail(format_args!("vCPU with apic {apic} has no SRAT entry"));
        }
        println!("numa: vcpu apic {apic} runs on node {node}");
    }
    println!("numa: ok");
    if hold_seconds > 0 {
        crate::arch::delay_us(crate::arch::tsc_hz(), hold_seconds * 1_000_000);
    }
    exit(0)
}
