//! The `big-bars COUNT [hotplug]` workload: COUNT emulated GPUs with large 64-bit BARs (256 GiB
//! BAR1s, as an H200's) in one VM. For every GPU on bus 0 it sizes the BARs (memory
//! decoding off meanwhile, as Linux does), and checks that each is assigned, aligned to
//! its size, BAR0 in the 32-bit hole and the 64-bit ones inside the 64-bit window the
//! host bridge's `_CRS` declares, that no two BARs overlap and that the window lies within
//! the guest's physical address width (CPUID 0x80000008) and clear of RAM. Then it maps
//! the first and last page of each BAR1 and BAR3 (2 MiB pages, anywhere in the 48-bit
//! space: the boot tables only map 64 GiB) and writes and reads back a word at the start
//! and the end of each; BAR1's first word must reach the device (its BAR1 checksum
//! register sums BAR1's first page).
//!
//! With `big-bars COUNT hotplug` the GPUs are hot-plugged after boot: it waits for COUNT
//! arrivals (gpuvm's ACPI hot-plug registers, as `pci-hotplug` polls them) first.
//!
//! Lines: `big-bars: window START..END`, `big-bars: phys-bits N`, one `big-bars: 00:DD.0
//! BAR1 ADDR size=SIZE BAR3 ADDR size=SIZE` per GPU, one `big-bars: 00:DD.0 words ok` per
//! GPU, then `big-bars: ok COUNT`; any failure prints `big-bars: FAIL ...` and exits 1.

use core::ptr::addr_of_mut;

use crate::bootinfo::BootInfo;
use crate::console::exit;
use crate::pci::{config_read, config_write, is_gpu, mmio_read, size_bar};
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

/// The DSDT, through the RSDP the start info gives, the XSDT and the FADT.
fn dsdt(info: &BootInfo) -> u64 {
    let rsdp = info.rsdp_paddr;
    if rsdp == 0 || !bytes_equal(rsdp, b"RSD PTR ") {
        fail(format_args!("no RSDP in the start info"));
    }
    let xsdt = read_u64(rsdp + 24);
    let len = u64::from(read_u32(xsdt + 4)).min(0x10000);
    for entry in (xsdt + HEADER_LEN..xsdt + len).step_by(8) {
        let table = read_u64(entry);
        if table != 0 && bytes_equal(table, b"FACP") {
            let fadt_len = u64::from(read_u32(table + 4));
            let x_dsdt = if fadt_len >= 148 {
                read_u64(table + 140)
            } else {
                0
            };
            return if x_dsdt != 0 {
                x_dsdt
            } else {
                u64::from(read_u32(table + 40))
            };
        }
    }
    fail(format_args!("no FADT in the XSDT"))
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
fn round_trip(address: u64, value: u64) {
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
    device: u8,
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
    for device in 0..32u8 {
        if !is_gpu(device) {
            continue;
        }
        // Memory decoding off while sizing, as Linux does: the BARs do not move under the
        // guest while they read all ones.
        let command = config_read(device, 0x04) & 0xffff;
        config_write(device, 0x04, command & !0x2);
        let bar = |index| {
            let (address, size, _) = size_bar(device, index);
            (address, size)
        };
        let (bar0, bar1, bar3) = (bar(0), bar(1), bar(3));
        config_write(device, 0x04, command | 0x2);
        println!(
            "big-bars: 00:{device:02x}.0 BAR1 {:#x} size={:#x} BAR3 {:#x} size={:#x}",
            bar1.0, bar1.1, bar3.0, bar3.1
        );
        gpus[found] = Some(Gpu {
            device,
            bar0,
            bar1,
            bar3,
        });
        found += 1;
    }
    if found != expected {
        fail(format_args!("{found} GPUs on bus 0, expected {expected}"));
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
                    "00:{:02x}.0: BAR {address:#x}+{size:#x} is outside the _CRS windows",
                    gpu.device
                ));
            }
        }
    }
    for gpu in gpus.iter().flatten() {
        let seed = 0x5a5a_0000_0000_0000 | u64::from(gpu.device) << 32;
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
                "00:{:02x}.0: the device's BAR1 page sum is {sum:#x}, the guest wrote {:#x}",
                gpu.device,
                seed | 1
            ));
        }
        println!("big-bars: 00:{:02x}.0 words ok", gpu.device);
    }
    println!("big-bars: ok {found}");
    exit(0)
}
