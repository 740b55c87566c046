//! The `acpi` workload: find the ACPI tables the way an OS does and check what they say
//! against the machine.
//!
//! - RSDP from the PVH start info, and by scanning 0xE0000..0xFFFFF for "RSD PTR ": both
//!   must agree; its ACPI 1.0 (20 bytes) and extended checksums must be zero.
//! - XSDT: signature and checksum, then every table it lists (signature, length, checksum).
//! - FADT → DSDT (X_DSDT, else DSDT): signature and checksum.
//! - MADT: enabled local APICs == the CPUs the MP table lists (an independent description
//!   the VMM writes from the same vCPU count).
//! - MCFG: for each ECAM allocation of segment 0, the vendor/device id of every bus-0
//!   slot read through ECAM MMIO must equal what configuration mechanism #1 (0xCF8/0xCFC)
//!   returns, and the host bridge at 00:00.0 must answer; every other segment's bus 0 is
//!   walked through its ECAM window alone (each function printed as `SSSS:BB:DD.F`, with
//!   what 0xCF8 reads at the same slot of segment 0) and must have its host bridge.
//!
//! Each result is a line `acpi: ...`; any mismatch prints `acpi: FAIL ...` and exits 1.
//! `acpi corrupt SIG` first changes one byte of table SIG (or `RSDP`) in guest memory, as a
//! VMM writing a bad table would, so tests can check that the mismatch is caught.

use crate::arch::{inl, outl};
use crate::bootinfo::BootInfo;
use crate::console::exit;
use crate::println;
use crate::smp::{self, bytes_equal, checksum_ok, read_u32, read_u64, read_u8, scan, CpuSource};

const EXIT_FAIL: u32 = 1;
const EXIT_USAGE: u32 = 2;
const SCAN_START: u64 = 0xE0000;
const SCAN_END: u64 = 0x100000;
const HEADER_LEN: u64 = 36;
/// Longest table this workload accepts (a sanity bound, far above what gpuvm writes).
const MAX_TABLE_LEN: u64 = 0x10000;
const CONFIG_ADDRESS: u16 = 0xcf8;
const CONFIG_DATA: u16 = 0xcfc;
/// Buses checked per ECAM allocation (each config read traps to the VMM).
const MAX_BUSES_CHECKED: u64 = 4;

fn fail(what: core::fmt::Arguments) -> ! {
    println!("acpi: FAIL {what}");
    exit(EXIT_FAIL)
}

fn signature(addr: u64) -> [u8; 4] {
    [
        read_u8(addr),
        read_u8(addr + 1),
        read_u8(addr + 2),
        read_u8(addr + 3),
    ]
}

fn sig_str(sig: &[u8; 4]) -> &str {
    core::str::from_utf8(sig).unwrap_or("????")
}

fn byte_sum(addr: u64, len: u64) -> u8 {
    (0..len).fold(0u8, |sum, i| sum.wrapping_add(read_u8(addr + i)))
}

/// Checks a table header at `addr`: the expected signature (if any), a sane length and a
/// zero checksum. Returns the length.
fn check_table(addr: u64, expected: Option<&[u8; 4]>) -> u64 {
    let sig = signature(addr);
    if let Some(expected) = expected {
        if &sig != expected {
            fail(format_args!(
                "{} expected at {addr:#x}, found {:?}",
                sig_str(expected),
                sig
            ));
        }
    }
    let len = u64::from(read_u32(addr + 4));
    if !(HEADER_LEN..=MAX_TABLE_LEN).contains(&len) {
        fail(format_args!(
            "{} at {addr:#x} has length {len}",
            sig_str(&sig)
        ));
    }
    let sum = byte_sum(addr, len);
    if sum != 0 {
        fail(format_args!(
            "{} checksum at {addr:#x} (bytes sum to {sum:#04x})",
            sig_str(&sig)
        ));
    }
    len
}

fn config_read(bus: u8, device: u8, register: u8) -> u32 {
    outl(
        CONFIG_ADDRESS,
        1 << 31 | u32::from(bus) << 16 | u32::from(device) << 11 | u32::from(register & 0xfc),
    );
    inl(CONFIG_DATA)
}

fn ecam_read(base: u64, bus: u8, device: u8, register: u64) -> u32 {
    let addr = base + (u64::from(bus) << 20 | u64::from(device) << 15 | register);
    // SAFETY: the ECAM window lies in the identity-mapped, user-accessible first 4 GiB; the
    // read traps to the VMM's PCI root (or reads all-ones where nothing is mapped).
    unsafe { (addr as *const u32).read_volatile() }
}

/// The RSDP: the start info's and the scan's must agree.
fn find_rsdp(info: &BootInfo) -> u64 {
    let scanned = scan(SCAN_START, SCAN_END, b"RSD PTR ", 20);
    match (info.rsdp_paddr, scanned) {
        (0, None) => fail(format_args!(
            "no RSDP: none in the start info, none in {SCAN_START:#x}..{SCAN_END:#x}"
        )),
        (0, Some(found)) => {
            println!("acpi: RSDP at {found:#x} (scan; the start info has none)");
            found
        }
        (given, Some(found)) if given != found => fail(format_args!(
            "the start info gives the RSDP at {given:#x}, the scan finds {found:#x}"
        )),
        (given, scanned) => {
            println!(
                "acpi: RSDP at {given:#x} (start info), scan {}",
                if scanned.is_some() {
                    "agrees"
                } else {
                    "finds none"
                }
            );
            given
        }
    }
}

/// Table SIG (or the RSDP): the XSDT's entry, the DSDT through the FADT.
fn locate(rsdp: u64, sig: &[u8; 4]) -> Option<u64> {
    if sig == b"RSDP" {
        return Some(rsdp);
    }
    let xsdt = read_u64(rsdp + 24);
    if sig == b"XSDT" {
        return Some(xsdt);
    }
    let len = u64::from(read_u32(xsdt + 4)).min(MAX_TABLE_LEN);
    let tables = (xsdt + HEADER_LEN..xsdt + len)
        .step_by(8)
        .map(read_u64)
        .filter(|&t| t != 0);
    let mut found = None;
    for table in tables {
        if &signature(table) == sig {
            found = Some(table);
        }
        if sig == b"DSDT" && bytes_equal(table, b"FACP") {
            found = Some(dsdt_of(table));
        }
    }
    found
}

fn dsdt_of(fadt: u64) -> u64 {
    let len = u64::from(read_u32(fadt + 4));
    let x_dsdt = if len >= 148 { read_u64(fadt + 140) } else { 0 };
    if x_dsdt != 0 {
        x_dsdt
    } else {
        u64::from(read_u32(fadt + 40))
    }
}

/// `acpi corrupt SIG`: add one to the table's last byte, breaking its checksum.
fn corrupt(rsdp: u64, sig: &str) {
    let Ok(sig) = <[u8; 4]>::try_from(sig.as_bytes()) else {
        println!("acpi: corrupt needs a 4-letter table signature, not '{sig}'");
        exit(EXIT_USAGE)
    };
    let Some(table) = locate(rsdp, &sig) else {
        println!("acpi: no table {} to corrupt", sig_str(&sig));
        exit(EXIT_USAGE)
    };
    let len = if &sig == b"RSDP" {
        20
    } else {
        u64::from(read_u32(table + 4)).clamp(HEADER_LEN, MAX_TABLE_LEN)
    };
    let addr = table + len - 1;
    // SAFETY: guest-physical memory below 4 GiB is identity mapped, user writable; this byte
    // is inside the table the VMM wrote into reserved RAM, which nothing else uses.
    unsafe { (addr as *mut u8).write_volatile(read_u8(addr).wrapping_add(1)) };
    println!(
        "acpi: corrupted {} at {table:#x} (test mode)",
        sig_str(&sig)
    );
}

fn check_rsdp(rsdp: u64) -> u64 {
    if !checksum_ok(rsdp, 20) {
        fail(format_args!(
            "RSDP checksum (ACPI 1.0 part sums to {:#04x})",
            byte_sum(rsdp, 20)
        ));
    }
    let revision = read_u8(rsdp + 15);
    if revision < 2 {
        fail(format_args!("RSDP revision {revision}: no XSDT"));
    }
    let len = u64::from(read_u32(rsdp + 20));
    if !(36..=1024).contains(&len) {
        fail(format_args!("RSDP length {len}"));
    }
    if !checksum_ok(rsdp, len) {
        fail(format_args!(
            "RSDP extended checksum (sums to {:#04x})",
            byte_sum(rsdp, len)
        ));
    }
    let xsdt = read_u64(rsdp + 24);
    println!("acpi: RSDP revision {revision} checksums ok, XSDT at {xsdt:#x}");
    xsdt
}

struct Found {
    fadt: u64,
    madt: u64,
    mcfg: u64,
}

fn check_xsdt(xsdt: u64) -> Found {
    let len = check_table(xsdt, Some(b"XSDT"));
    let count = (len - HEADER_LEN) / 8;
    println!("acpi: XSDT checksum ok, {count} tables");
    let mut found = Found {
        fadt: 0,
        madt: 0,
        mcfg: 0,
    };
    for i in 0..count {
        let table = read_u64(xsdt + HEADER_LEN + 8 * i);
        if table == 0 {
            fail(format_args!("XSDT entry {i} is null"));
        }
        let sig = signature(table);
        let len = check_table(table, None);
        println!(
            "acpi: {} at {table:#x} length {len} checksum ok",
            sig_str(&sig)
        );
        match &sig {
            b"FACP" => found.fadt = table,
            b"APIC" => found.madt = table,
            b"MCFG" => found.mcfg = table,
            _ => {}
        }
    }
    for (name, addr) in [
        ("FACP", found.fadt),
        ("APIC", found.madt),
        ("MCFG", found.mcfg),
    ] {
        if addr == 0 {
            fail(format_args!("the XSDT lists no {name}"));
        }
    }
    found
}

fn check_dsdt(fadt: u64) {
    let dsdt = dsdt_of(fadt);
    if dsdt == 0 {
        fail(format_args!("the FADT points at no DSDT"));
    }
    let len = check_table(dsdt, Some(b"DSDT"));
    let flags = read_u32(fadt + 112);
    println!(
        "acpi: FACP -> DSDT at {dsdt:#x} length {len} checksum ok, flags {flags:#x}, reset port {:#x} value {:#x}",
        read_u64(fadt + 120),
        read_u8(fadt + 128)
    );
}

fn check_madt(madt: u64, info: &BootInfo) {
    let len = u64::from(read_u32(madt + 4));
    let mut lapics = 0usize;
    let mut ioapics = 0usize;
    let mut entry = madt + 44;
    while entry + 2 <= madt + len {
        let (kind, entry_len) = (read_u8(entry), u64::from(read_u8(entry + 1)));
        if entry_len < 2 || entry + entry_len > madt + len {
            fail(format_args!(
                "MADT entry at {entry:#x} has length {entry_len}"
            ));
        }
        match kind {
            0 if read_u32(entry + 4) & 1 != 0 => lapics += 1,
            1 => ioapics += 1,
            _ => {}
        }
        entry += entry_len;
    }
    let cpus = smp::discover(info.rsdp_paddr);
    if cpus.source != CpuSource::MpTable {
        fail(format_args!(
            "no MP table to compare the MADT's {lapics} local APICs with"
        ));
    }
    let listed = cpus.apic_ids().len() + cpus.ignored;
    if lapics != listed || ioapics != 1 {
        fail(format_args!(
            "MADT lists {lapics} local APICs and {ioapics} IOAPICs; the MP table {listed} cpus and 1 IOAPIC"
        ));
    }
    println!(
        "acpi: MADT {lapics} local APICs (MP table: {listed} cpus), {ioapics} IOAPIC, local APIC at {:#x}",
        read_u32(madt + 36)
    );
}

fn check_mcfg(mcfg: u64) {
    let len = u64::from(read_u32(mcfg + 4));
    let allocations = len.saturating_sub(44) / 16;
    if allocations == 0 {
        fail(format_args!("MCFG lists no ECAM window"));
    }
    let mut host_bridge_seen = false;
    for i in 0..allocations {
        let entry = mcfg + 44 + 16 * i;
        let base = read_u64(entry);
        let segment = u16::from_le_bytes([read_u8(entry + 8), read_u8(entry + 9)]);
        let (start, end) = (read_u8(entry + 10), read_u8(entry + 11));
        println!("acpi: MCFG ECAM {base:#x} segment {segment} buses {start}-{end}");
        if segment != 0 {
            walk_other_segment(base, segment, start);
            continue;
        }
        if end < start {
            fail(format_args!("MCFG bus range {start}-{end}"));
        }
        // The ECAM base describes bus 0 even when the range starts later.
        let buses = u64::from(end - start) + 1;
        for bus in start..=start.saturating_add(buses.min(MAX_BUSES_CHECKED) as u8 - 1) {
            for device in 0..32u8 {
                let via_cf8 = config_read(bus, device, 0);
                let via_ecam = ecam_read(base, bus, device, 0);
                if via_cf8 != via_ecam {
                    fail(format_args!(
                        "{bus:02x}:{device:02x}.0 id {via_ecam:#010x} through ECAM {base:#x}, {via_cf8:#010x} through 0xcf8"
                    ));
                }
                if via_cf8 != 0xffff_ffff {
                    println!(
                        "acpi: {bus:02x}:{device:02x}.0 id {via_ecam:#010x} through ECAM and 0xcf8"
                    );
                    host_bridge_seen |= bus == 0 && device == 0;
                }
            }
        }
    }
    if !host_bridge_seen {
        fail(format_args!("no host bridge at 00:00.0 through ECAM"));
    }
}

/// A segment other than 0: its configuration space is reachable through its ECAM window
/// only (0xCF8/0xCFC reach segment 0), so each function found is printed with what 0xCF8
/// reads at the same bus and slot, to show the two are different places.
fn walk_other_segment(base: u64, segment: u16, bus: u8) {
    let mut bridge_seen = false;
    for device in 0..32u8 {
        let id = ecam_read(base, bus, device, 0);
        if id == 0xffff_ffff {
            continue;
        }
        let via_cf8 = config_read(bus, device, 0);
        println!(
            "acpi: {segment:04x}:{bus:02x}:{device:02x}.0 id {id:#010x} through ECAM only (0xcf8 {bus:02x}:{device:02x}.0 reads {via_cf8:#010x})"
        );
        bridge_seen |= device == 0;
    }
    if !bridge_seen {
        fail(format_args!(
            "no host bridge at {segment:04x}:{bus:02x}:00.0 through ECAM {base:#x}"
        ));
    }
}

pub fn run(info: &BootInfo, mut args: crate::args::Words) -> ! {
    let rsdp = find_rsdp(info);
    match args.next_word() {
        None => {}
        Some("corrupt") => corrupt(rsdp, args.next_word().unwrap_or("MCFG")),
        Some(other) => {
            println!("acpi: unknown argument '{other}'; usage: acpi [corrupt SIG]");
            exit(EXIT_USAGE)
        }
    }
    let xsdt = check_rsdp(rsdp);
    let found = check_xsdt(xsdt);
    check_dsdt(found.fadt);
    check_madt(found.madt, info);
    check_mcfg(found.mcfg);
    println!("acpi: ok");
    exit(0)
}
