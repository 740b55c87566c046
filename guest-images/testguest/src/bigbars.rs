//! The `big-bars COUNT [hotplug]` workload: COUNT emulated GPUs with large 64-bit BARs (256 GiB
//! BAR1s, as an H200's) in one VM. For every GPU on bus 0 of every PCI segment the MCFG
//! lists (segment 0 through 0xCF8, the others through their ECAM windows: a guest NUMA
//! node's GPUs sit on a host bridge of their own) it sizes the BARs (memory decoding off
//! meanwhile, as Linux does), and checks that each is assigned, aligned to its size, BAR0
//! in the 32-bit hole and the 64-bit ones inside the 64-bit windows the host bridges'
//! `_CRS` declare, that no two BARs overlap and that the windows lie within the guest's
//! physical address width (CPUID 0x80000008) and clear of RAM. Then it maps
//! the first and last page of each BAR1 and BAR3 (2 MiB pages, anywhere in the 48-bit
//! space: the boot tables only map 64 GiB) and writes and reads back a word at the start
//! and the end of each; BAR1's first word must reach the device (its BAR1 checksum
//! register sums BAR1's first page).
//!
//! With `big-bars COUNT hotplug` the GPUs are hot-plugged after boot: it waits for COUNT
//! arrivals (gpuvm's ACPI hot-plug registers, as `pci-hotplug` polls them) first.
//!
//! Lines: `big-bars: window START..END` (segment 0's first), `big-bars: phys-bits N`, one
//! `big-bars: 00:DD.0 BAR1 ADDR size=SIZE BAR3 ADDR size=SIZE` per GPU (`SSSS:00:DD.0` off
//! segment 0, with its BAR0 after BAR3), one `big-bars: 00:DD.0 words ok` per GPU, then
//! `big-bars: ok COUNT`; any failure prints `big-bars: FAIL ...` and exits 1.

use core::ptr::addr_of_mut;

use crate::bootinfo::BootInfo;
use crate::console::exit;
use crate::pci::{config_read, config_write, is_gpu_ids, mmio_read, size_bar_through};
use crate::println;
use crate::smp::{bytes_equal, read_u32, read_u64, read_u8};

const EXIT_FAIL: u32 = 1;
const EXIT_USAGE: u32 = 2;
const FOUR_GIB: u64 = 1 << 32;
const HEADER_LEN: u64 = 36;
/// The emulated GPU's BAR1 checksum register (gpuvm-vfio's emu::regs::BAR1_CHECKSUM).
const REG_BAR1_CHECKSUM: u64 = 0x1020;
/// Page table entry flags, as boot.rs has them.
const TABLE_FLAGS: u64 = crate::boot::TABLE_FLAGS;
const LARGE_PAGE_FLAGS: u64 = crate::boot::LARGE_PAGE_FLAGS;
const MAX_WINDOWS: usize = 8;
const MAX_GPUS: usize = 32;
const MAX_SEGMENTS: usize = 16;
/// Page tables for the BAR mappings: each BAR end may need a page directory and a PDPT.
const POOL_TABLES: usize = 64;

#[repr(C, align(4096))]
struct Table([u64; 512]);

static mut POOL: [Table; POOL_TABLES] = [const { Table([0; 512]) }; POOL_TABLES];
static mut POOL_USED: usize = 0;

extern "C" {
    static mut tg_pml4: [u64; 512];
}

fn fail(what: core::fmt::Arguments) -> ! {
    println!("big-bars: FAIL {what}");
    exit(EXIT_FAIL)
}

/// The table with signature `signature` the XSDT lists (through the RSDP the start info
/// gives).
fn xsdt_table(info: &BootInfo, signature: &[u8; 4]) -> Option<u64> {
    let rsdp = info.rsdp_paddr;
    if rsdp == 0 || !bytes_equal(rsdp, b"RSD PTR ") {
        fail(format_args!("no RSDP in the start info"));
    }
    let xsdt = read_u64(rsdp + 24);
    let len = u64::from(read_u32(xsdt + 4)).min(0x10000);
    (xsdt + HEADER_LEN..xsdt + len)
        .step_by(8)
        .map(read_u64)
        .find(|&table| table != 0 && bytes_equal(table, signature))
}

/// The DSDT, through the FADT.
fn dsdt(info: &BootInfo) -> u64 {
    let Some(table) = xsdt_table(info, b"FACP") else {
        fail(format_args!("no FADT in the XSDT"))
    };
    let fadt_len = u64::from(read_u32(table + 4));
    let x_dsdt = if fadt_len >= 148 {
        read_u64(table + 140)
    } else {
        0
    };
    if x_dsdt != 0 {
        x_dsdt
    } else {
        u64::from(read_u32(table + 40))
    }
}

/// Each PCI segment's bus-0 ECAM base, from the MCFG: (segment, base).
fn segments(info: &BootInfo) -> ([(u16, u64); MAX_SEGMENTS], usize) {
    let Some(mcfg) = xsdt_table(info, b"MCFG") else {
        fail(format_args!("no MCFG in the XSDT"))
    };
    let mut found = [(0, 0); MAX_SEGMENTS];
    let mut count = 0;
    let allocations = u64::from(read_u32(mcfg + 4)).saturating_sub(44) / 16;
    for i in 0..allocations.min(MAX_SEGMENTS as u64) {
        let entry = mcfg + 44 + 16 * i;
        let segment = u16::from(read_u8(entry + 8)) | u16::from(read_u8(entry + 9)) << 8;
        found[count] = (segment, read_u64(entry));
        count += 1;
    }
    (found, count)
}

/// A function on bus 0 of a PCI segment: segment 0's configuration space is read through
/// 0xCF8/0xCFC (as the rest of the test guest reads it), the others' through their ECAM
/// window only.
#[derive(Clone, Copy)]
struct Function {
    segment: u16,
    ecam: u64,
    device: u8,
}

impl Function {
    fn ecam_address(&self, register: u8) -> u64 {
        self.ecam + (u64::from(self.device) << 15 | u64::from(register & 0xfc))
    }

    fn read(&self, register: u8) -> u32 {
        if self.segment == 0 {
            return config_read(self.device, register);
        }
        // SAFETY: ECAM windows lie in the identity-mapped, user-accessible first 4 GiB; the
        // read traps to the VMM's PCI root.
        unsafe { (self.ecam_address(register) as *const u32).read_volatile() }
    }

    fn write(&self, register: u8, value: u32) {
        if self.segment == 0 {
            return config_write(self.device, register, value);
        }
        // SAFETY: as in `read`.
        unsafe { (self.ecam_address(register) as *mut u32).write_volatile(value) }
    }
}

impl core::fmt::Display for Function {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        if self.segment != 0 {
            write!(f, "{:04x}:", self.segment)?;
        }
        write!(f, "00:{:02x}.0", self.device)
    }
}

/// The QWord memory ranges (`[min, max + 1)`) in the DSDT's resource templates above
/// 4 GiB: the host bridges' 64-bit windows.
fn windows_64(dsdt: u64) -> ([(u64, u64); MAX_WINDOWS], usize) {
    let mut windows = [(0, 0); MAX_WINDOWS];
    let mut count = 0;
    let len = u64::from(read_u32(dsdt + 4));
    // QWord Address Space Descriptor: tag 0x8A, length 0x2B, resource type 0 (memory),
    // then flags, granularity, minimum, maximum, translation, length.
    let mut at = dsdt + HEADER_LEN;
    while at + 46 <= dsdt + len {
        if read_u8(at) == 0x8a
            && read_u8(at + 1) == 0x2b
            && read_u8(at + 2) == 0
            && read_u8(at + 3) == 0
        {
            let min = read_u64(at + 14);
            let max = read_u64(at + 22);
            let length = read_u64(at + 38);
            if min >= FOUR_GIB && max > min && length == max - min + 1 && count < MAX_WINDOWS {
                windows[count] = (min, max + 1);
                count += 1;
                at += 46;
                continue;
            }
        }
        at += 1;
    }
    (windows, count)
}

/// Maps the 2 MiB page holding `address` (identity, user), taking page tables from the
/// pool. Only entries that were not present are written, so no TLB entry is stale.
fn map_page(address: u64) {
    // SAFETY: the boot page tables and the pool are this image's statics, identity mapped
    // and user writable; only this CPU runs, and only not-present entries are filled (a
    // table is filled before it is linked).
    unsafe {
        let take = || -> *mut u64 {
            let used = *addr_of_mut!(POOL_USED);
            if used == POOL_TABLES {
                fail(format_args!("out of page tables"));
            }
            *addr_of_mut!(POOL_USED) = used + 1;
            addr_of_mut!(POOL[used]) as *mut u64
        };
        let table_of = |entry: *mut u64| -> *mut u64 {
            let value = entry.read_volatile();
            if value & 1 != 0 {
                if value & 0x80 != 0 {
                    fail(format_args!("{address:#x} is in a large page already"));
                }
                return (value & 0x000f_ffff_ffff_f000) as *mut u64;
            }
            let table = take();
            entry.write_volatile(table as u64 | TABLE_FLAGS);
            table
        };
        let pml4 = addr_of_mut!(tg_pml4) as *mut u64;
        let pdpt = table_of(pml4.add((address >> 39 & 511) as usize));
        let pd = table_of(pdpt.add((address >> 30 & 511) as usize));
        let pde = pd.add((address >> 21 & 511) as usize);
        if pde.read_volatile() & 1 == 0 {
            pde.write_volatile(address & !0x1f_ffff | LARGE_PAGE_FLAGS);
        }
    }
}

/// Writes a word at `address` and reads it back.
pub(crate) fn round_trip(address: u64, value: u64) {
    map_page(address);
    // SAFETY: `address` is in one of the device's BARs, just mapped.
    let got = unsafe {
        (address as *mut u64).write_volatile(value);
        (address as *const u64).read_volatile()
    };
    if got != value {
        fail(format_args!(
            "wrote {value:#x} at {address:#x}, read {got:#x}"
        ));
    }
}

struct Gpu {
    function: Function,
    bar0: (u64, u64),
    bar1: (u64, u64),
    bar3: (u64, u64),
}

pub fn run(info: &BootInfo, count: Option<&str>, mode: Option<&str>) -> ! {
    let Some(expected) = count.and_then(|c| c.parse::<usize>().ok()) else {
        println!("big-bars: usage: big-bars COUNT [hotplug]");
        exit(EXIT_USAGE)
    };
    match mode {
        None => {}
        // The GPUs come by hot-plug into a VM created without them (Kata's path): wait for
        // COUNT arrivals; the VMM placed their BARs in the window it planned at boot.
        Some("hotplug") => {
            println!("big-bars: waiting for {expected} hot-plugged device(s)");
            let mut pending = 0;
            for _ in 0..expected {
                let slot = crate::hotplug::next_arrival(&mut pending);
                println!("big-bars: device arrived at 00:{slot:02x}.0");
            }
        }
        Some(other) => {
            println!("big-bars: unknown mode {other}; usage: big-bars COUNT [hotplug]");
            exit(EXIT_USAGE)
        }
    }
    let (windows, window_count) = windows_64(dsdt(info));
    if window_count == 0 {
        fail(format_args!("no 64-bit window in the DSDT"));
    }
    for &(start, end) in &windows[..window_count] {
        println!("big-bars: window {start:#x}..{end:#x}");
    }
    let phys_bits = crate::arch::cpuid(0x8000_0008, 0).eax & 0xff;
    println!("big-bars: phys-bits {phys_bits}");
    for &(start, end) in &windows[..window_count] {
        if end > 1u64 << phys_bits {
            fail(format_args!(
                "window {start:#x}..{end:#x} ends above the {phys_bits}-bit address space"
            ));
        }
        for entry in info.memmap() {
            if entry.addr < end && start < entry.addr + entry.size {
                fail(format_args!(
                    "window {start:#x}..{end:#x} overlaps memory map entry {:#x}+{:#x}",
                    entry.addr, entry.size
                ));
            }
        }
    }
    let mut gpus: [Option<Gpu>; MAX_GPUS] = [const { None }; MAX_GPUS];
    let mut found = 0;
    let (segments, segment_count) = segments(info);
    let functions = segments[..segment_count]
        .iter()
        .flat_map(|&(segment, ecam)| {
            (0..32u8).map(move |device| Function {
                segment,
                ecam,
                device,
            })
        });
    for function in functions {
        if !is_gpu_ids(function.read(0)) || found == MAX_GPUS {
            continue;
        }
        // Memory decoding off while sizing, as Linux does: the BARs do not move under the
        // guest while they read all ones.
        let command = function.read(0x04) & 0xffff;
        function.write(0x04, command & !0x2);
        let bar = |index| {
            let (address, size, _) =
                size_bar_through(|r| function.read(r), |r, v| function.write(r, v), index);
            (address, size)
        };
        let (bar0, bar1, bar3) = (bar(0), bar(1), bar(3));
        function.write(0x04, command | 0x2);
        if function.segment == 0 {
            println!(
                "big-bars: {function} BAR1 {:#x} size={:#x} BAR3 {:#x} size={:#x}",
                bar1.0, bar1.1, bar3.0, bar3.1
            );
        } else {
            println!(
                "big-bars: {function} BAR1 {:#x} size={:#x} BAR3 {:#x} size={:#x} BAR0 {:#x} size={:#x}",
                bar1.0, bar1.1, bar3.0, bar3.1, bar0.0, bar0.1
            );
        }
        gpus[found] = Some(Gpu {
            function,
            bar0,
            bar1,
            bar3,
        });
        found += 1;
    }
    if found != expected {
        fail(format_args!(
            "{found} GPUs on the segments' bus 0, expected {expected}"
        ));
    }
    let gpus = &gpus[..found];
    let all_bars = || {
        gpus.iter()
            .flatten()
            .flat_map(|gpu| [gpu.bar0, gpu.bar1, gpu.bar3])
    };
    for (address, size) in all_bars() {
        if address == 0 || size == 0 || !size.is_power_of_two() || address % size != 0 {
            fail(format_args!(
                "BAR at {address:#x} size {size:#x} is not assigned or not aligned to its size"
            ));
        }
        for (other, other_size) in all_bars() {
            if (other, other_size) != (address, size)
                && other < address + size
                && address < other + other_size
            {
                fail(format_args!(
                    "BARs {address:#x}+{size:#x} and {other:#x}+{other_size:#x} overlap"
                ));
            }
        }
    }
    for gpu in gpus.iter().flatten() {
        if gpu.bar0.0 + gpu.bar0.1 > FOUR_GIB {
            fail(format_args!("BAR0 at {:#x} is not below 4 GiB", gpu.bar0.0));
        }
        for (address, size) in [gpu.bar1, gpu.bar3] {
            let inside = windows[..window_count]
                .iter()
                .any(|&(start, end)| start <= address && address + size <= end);
            if !inside {
                fail(format_args!(
                    "{}: BAR {address:#x}+{size:#x} is outside the _CRS windows",
                    gpu.function
                ));
            }
        }
    }
    for gpu in gpus.iter().flatten() {
        let seed = 0x5a5a_0000_0000_0000
            | u64::from(gpu.function.segment) << 40
            | u64::from(gpu.function.device) << 32;
        for (n, (address, size)) in [gpu.bar1, gpu.bar3].into_iter().enumerate() {
            let n = n as u64;
            round_trip(address, seed | n << 8 | 1);
            round_trip(address + size - 8, seed | n << 8 | 2);
        }
        // BAR1's first page holds one word: the device's sum over the page is that word.
        let sum = u64::from(mmio_read(gpu.bar0.0 + REG_BAR1_CHECKSUM))
            | u64::from(mmio_read(gpu.bar0.0 + REG_BAR1_CHECKSUM + 4)) << 32;
        if sum != (seed | 1) {
            fail(format_args!(
                "{}: the device's BAR1 page sum is {sum:#x}, the guest wrote {:#x}",
                gpu.function,
                seed | 1
            ));
        }
        println!("big-bars: {} words ok", gpu.function);
    }
    println!("big-bars: ok {found}");
    exit(0)
}
