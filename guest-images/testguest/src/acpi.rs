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
//!
//! `acpi poweroff` checks the RSDP, XSDT, FADT and DSDT, then powers off the way Linux's
//! hardware-reduced ACPI does (acpi_hw_extended_sleep): it takes the FADT's
//! SLEEP_CONTROL_REG and SLEEP_STATUS_REG and `\_S5_`'s SLP_TYP from the DSDT's AML,
//! prints `acpi: sleep control port 0x... S5 type N`, writes WAK_STS to the status
//! register, then `SLP_TYP << 2 | SLP_EN` to the control register. The VMM should stop the
//! VM there; if it is still running after a while, `acpi: FAIL power-off ignored` and exit
//! 1. Tables that offer no power-off print `acpi: no ACPI power-off ...` and exit 3.

use crate::arch::{delay_us, inl, outl, tsc_hz};
use crate::bootinfo::BootInfo;
use crate::console::exit;
use crate::println;
use crate::smp::{self, bytes_equal, checksum_ok, read_u32, read_u64, read_u8, scan, CpuSource};

const EXIT_FAIL: u32 = 1;
const EXIT_USAGE: u32 = 2;
/// `acpi poweroff` on tables without the sleep registers or `\_S5_`.
const EXIT_NO_POWER_OFF: u32 = 3;
const SCAN_START: u64 = 0xE0000;
const SCAN_END: u64 = 0x100000;
const HEADER_LEN: u64 = 36;
/// Longest table this workload accepts (a sanity bound, far above what gpuvm writes).
const MAX_TABLE_LEN: u64 = 0x10000;
const CONFIG_ADDRESS: u16 = 0xcf8;
const CONFIG_DATA: u16 = 0xcfc;
/// Buses checked per ECAM allocation (each config read traps to the VMM).
const MAX_BUSES_CHECKED: u64 = 4;

/// FADT (revision 5+) SLEEP_CONTROL_REG and SLEEP_STATUS_REG, each a Generic Address
/// Structure: space id, bit width, bit offset, access size, u64 address.
const FADT_SLEEP_CONTROL_REG: u64 = 244;
const FADT_SLEEP_STATUS_REG: u64 = 256;
const GAS_LEN: u64 = 12;
const GAS_SYSTEM_IO: u8 = 1;
/// GAS access sizes: undefined (legacy) and byte.
const GAS_ACCESS_UNDEFINED: u8 = 0;
const GAS_ACCESS_BYTE: u8 = 1;
/// Sleep control register bits (ACPI 6, 4.8.3.7), as ACPICA builds them.
const SLP_TYP_SHIFT: u8 = 2;
const SLP_TYP_MASK: u8 = 0x1c;
const SLP_EN: u8 = 0x20;
/// Sleep status register: wake status, write 1 to clear.
const WAK_STS: u8 = 0x80;
/// AML opcodes and prefixes the `\_S5_` package uses.
const AML_NAME_OP: u8 = 0x08;
const AML_ROOT_PREFIX: u8 = b'\\';
const AML_PACKAGE_OP: u8 = 0x12;
const AML_ZERO_OP: u8 = 0x00;
const AML_ONE_OP: u8 = 0x01;
const AML_BYTE_PREFIX: u8 = 0x0a;
const AML_WORD_PREFIX: u8 = 0x0b;
const AML_DWORD_PREFIX: u8 = 0x0c;
const AML_QWORD_PREFIX: u8 = 0x0e;
/// How long the VMM has to stop the VM after the S5 write (it takes microseconds).
const POWER_OFF_WAIT_US: u64 = 5_000_000;

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

/// 8-bit port write: the sleep registers are byte wide. Where IOPL is dropped, the #GP
/// handler in boot.rs performs the `out dx, al` in ring 0.
fn outb(port: u16, value: u8) {
    // SAFETY: port I/O to an emulated device touches no memory.
    unsafe {
        core::arch::asm!("out dx, al", in("dx") port, in("al") value, options(nomem, nostack, preserves_flags))
    }
}

/// The port of the FADT's sleep register at `offset`: None if the FADT is too short for it
/// or its address is 0 (not implemented); FAIL if it is anything but an 8-bit register
/// in system I/O space.
fn sleep_register(fadt: u64, offset: u64, name: &str) -> Option<u16> {
    if u64::from(read_u32(fadt + 4)) < offset + GAS_LEN {
        return None;
    }
    let gas = fadt + offset;
    let (space, width, bit_offset, access) = (
        read_u8(gas),
        read_u8(gas + 1),
        read_u8(gas + 2),
        read_u8(gas + 3),
    );
    let address = read_u64(gas + 4);
    if address == 0 {
        return None;
    }
    let port = u16::try_from(address).ok();
    if space != GAS_SYSTEM_IO
        || width != 8
        || bit_offset != 0
        || !matches!(access, GAS_ACCESS_UNDEFINED | GAS_ACCESS_BYTE)
        || port.is_none()
    {
        fail(format_args!(
            "FADT {name}: space {space} width {width} offset {bit_offset} access {access} address {address:#x}, not an 8-bit I/O port"
        ));
    }
    port
}

/// `\_S5_`'s SLP_TYPa from the DSDT's AML: `NameOp [\] _S5_ PackageOp PkgLength
/// NumElements` then the first element. None if the DSDT names no `_S5_`.
fn s5_sleep_type(dsdt: u64) -> Option<u8> {
    let end = dsdt + u64::from(read_u32(dsdt + 4)).min(MAX_TABLE_LEN);
    let body = dsdt + HEADER_LEN;
    let name = (body + 1..end.saturating_sub(4)).find(|&at| {
        bytes_equal(at, b"_S5_")
            && (read_u8(at - 1) == AML_NAME_OP
                || (at >= body + 2
                    && read_u8(at - 1) == AML_ROOT_PREFIX
                    && read_u8(at - 2) == AML_NAME_OP))
    })?;
    let package = name + 4;
    if package + 3 > end || read_u8(package) != AML_PACKAGE_OP {
        fail(format_args!("DSDT \\_S5_ at {name:#x} is not a Package"));
    }
    // PkgLength: bits 7..6 of its first byte count the bytes that follow it.
    let elements = package + 2 + u64::from(read_u8(package + 1) >> 6);
    let first = elements + 1;
    if first + 2 > end || read_u8(elements) == 0 {
        fail(format_args!("DSDT \\_S5_ at {name:#x} is an empty Package"));
    }
    match read_u8(first) {
        AML_ZERO_OP => Some(0),
        AML_ONE_OP => Some(1),
        // An integer constant: SLP_TYPa is its low byte (ACPICA takes the same).
        AML_BYTE_PREFIX | AML_WORD_PREFIX | AML_DWORD_PREFIX | AML_QWORD_PREFIX => {
            Some(read_u8(first + 1))
        }
        // A bare small integer, as some hand-written tables have.
        bare @ 2..=7 => Some(bare),
        other => fail(format_args!(
            "DSDT \\_S5_ at {name:#x}: the first element starts with {other:#04x}, not an integer"
        )),
    }
}

/// `acpi poweroff`: S5 through the hardware-reduced sleep registers, as Linux enters it.
fn power_off(fadt: u64) -> ! {
    let control = sleep_register(fadt, FADT_SLEEP_CONTROL_REG, "SLEEP_CONTROL_REG");
    let status = sleep_register(fadt, FADT_SLEEP_STATUS_REG, "SLEEP_STATUS_REG");
    let s5 = s5_sleep_type(dsdt_of(fadt));
    let (Some(control), Some(status), Some(s5)) = (control, status, s5) else {
        let yes_no = |present: bool| if present { "yes" } else { "none" };
        println!(
            "acpi: no ACPI power-off: sleep control register {}, sleep status register {}, \\_S5_ {}",
            yes_no(control.is_some()),
            yes_no(status.is_some()),
            yes_no(s5.is_some())
        );
        exit(EXIT_NO_POWER_OFF)
    };
    println!("acpi: sleep control port {control:#x} S5 type {s5}");
    println!("acpi: sleep status port {status:#x}");
    let request = ((s5 << SLP_TYP_SHIFT) & SLP_TYP_MASK) | SLP_EN;
    println!("acpi: entering S5: {request:#04x} to port {control:#x}");
    outb(status, WAK_STS);
    outb(control, request);
    delay_us(tsc_hz(), POWER_OFF_WAIT_US);
    fail(format_args!(
        "power-off ignored: the VM still runs {} s after the S5 request",
        POWER_OFF_WAIT_US / 1_000_000
    ))
}

pub fn run(info: &BootInfo, mut args: crate::args::Words) -> ! {
    let rsdp = find_rsdp(info);
    let mut poweroff = false;
    match args.next_word() {
        None => {}
        Some("corrupt") => corrupt(rsdp, args.next_word().unwrap_or("MCFG")),
        Some("poweroff") => poweroff = true,
        Some(other) => {
            println!("acpi: unknown argument '{other}'; usage: acpi [corrupt SIG | poweroff]");
            exit(EXIT_USAGE)
        }
    }
    let xsdt = check_rsdp(rsdp);
    let found = check_xsdt(xsdt);
    check_dsdt(found.fadt);
    if poweroff {
        power_off(found.fadt);
    }
    check_madt(found.madt, info);
    check_mcfg(found.mcfg);
    println!("acpi: ok");
    exit(0)
}
