//! The `memory-hotplug [noeject] [blk] [COUNT]` workload: uses RAM the VMM hot-plugs
//! (vm.resize desired_ram), gives it back when asked, and exits 0 once COUNT slots were
//! added (forever without COUNT).
//!
//! It reads gpuvm's ACPI memory hot-plug registers the way the DSDT's AML does (MSCN selects
//! each slot and reads its flags, `_CRS` reads the base and length, `_OST` reports), from
//! ring 3 and by polling: no ACPI interpreter, no GED interrupt. For each slot whose insert
//! event it sees, it checks the range (present, whole 128 MiB blocks, not RAM the boot
//! memory map already has, below the identity-mapped limit), runs a memtest over all of it
//! (a pattern written, then read back) and prints
//! `memory-hotplug: slot N base=0x... size=... memtest ok checksum=0x...`.
//!
//! `memory-hotplug blk [COUNT]` also moves data through the virtio-blk disk with both
//! buffers in each new range: [`BLK_BYTES`] of slot N's pattern written from the range's
//! first bytes to disk sector `N * BLK_SECTORS`, read back into the range's next bytes
//! and compared (`memory-hotplug: slot N virtio-blk wrote and read back ...`): the
//! device reads and writes RAM the VM did not boot with. The host checks the disk.
//!
//! Before it takes a new slot, it checks that every slot it took before still holds its
//! pattern (`memory-hotplug: N earlier slot(s) still hold their patterns`): across a
//! snapshot and restore of the VM, hot-plugged RAM must come back with its contents.
//!
//! On a slot's remove request (MRMV, a shrinking vm.resize) it stops using the range (no
//! longer rechecked), clears the event, reports `_OST` and ejects the slot (MEJ, as `_EJ0`
//! does): `memory-hotplug: slot N base=0x... ejected`. With `noeject` it ignores remove
//! requests (`memory-hotplug: slot N remove request ignored`, once per request), for the
//! host's eject timeout.

use crate::arch::{inl, outl};
use crate::args::Words;
use crate::boot::MAPPED_LIMIT;
use crate::bootinfo::BootInfo;
use crate::console::exit;
use crate::pattern::{fill, pattern, verify, zero, Mismatch};
use crate::println;
use crate::virtio::transport::{VirtioPci, TYPE_BLOCK};
use crate::virtio::{DiskIo, Dma};

/// gpuvm_devices::memory_hotplug's register block.
const PORT: u16 = 0xaf10;
const MSEL: u16 = PORT;
const MBAS_LO: u16 = PORT;
const MBAS_HI: u16 = PORT + 0x04;
const MOEV: u16 = PORT + 0x04;
const MLEN_LO: u16 = PORT + 0x08;
const MOSC: u16 = PORT + 0x08;
const MLEN_HI: u16 = PORT + 0x0c;
const FLAGS: u16 = PORT + 0x14;
const MSLT: u16 = PORT + 0x1c;
const MEN: u32 = 1 << 0;
const MINS: u32 = 1 << 1;
const MRMV: u32 = 1 << 2;
const MEJ: u32 = 1 << 3;
/// _OST: insertion processing (ACPI "device check" event), status success.
const OST_INSERT: u32 = 1;
const OST_SUCCESS: u32 = 0;
/// _OST: ejection processing (ACPI "eject request" event).
const OST_EJECT: u32 = 3;
const BLOCK: u64 = 128 << 20;
const EXIT_FAIL: u32 = 1;
const EXIT_USAGE: u32 = 2;
/// A seed per slot, so that two slots mapped onto the same memory would show.
const SEED: u64 = 0x6d65_6d68_6f74;
/// What `blk` moves through the disk per slot, and where: slot N at sector N * BLK_SECTORS.
pub const BLK_BYTES: u64 = 64 << 10;
const BLK_SECTORS: u64 = BLK_BYTES / 512;
/// The pattern seed of slot N's disk data: BLK_SEED + N (word at disk offset o:
/// pattern(BLK_SEED + N, o)).
const BLK_SEED: u64 = 0x6d68_626c_6b00;

fn fail(what: core::fmt::Arguments) -> ! {
    println!("memory-hotplug: FAIL {what}");
    exit(EXIT_FAIL)
}

fn between_polls() {
    for _ in 0..200_000 {
        core::hint::spin_loop();
    }
}

fn flags_of(slot: u32) -> u32 {
    outl(MSEL, slot);
    inl(FLAGS) & 0xff
}

fn read64(low: u16, high: u16) -> u64 {
    u64::from(inl(low)) | u64::from(inl(high)) << 32
}

fn read_base(slot: u32) -> u64 {
    outl(MSEL, slot);
    read64(MBAS_LO, MBAS_HI)
}

/// Checks slot `slot`'s range and memtests it; returns its size.
fn take(info: &BootInfo, slot: u32) -> u64 {
    outl(MSEL, slot);
    let flags = inl(FLAGS) & 0xff;
    if flags & MEN == 0 {
        fail(format_args!("slot {slot} inserted but not present"));
    }
    let base = read64(MBAS_LO, MBAS_HI);
    let size = read64(MLEN_LO, MLEN_HI);
    if size == 0 || !base.is_multiple_of(BLOCK) || !size.is_multiple_of(BLOCK) {
        fail(format_args!(
            "slot {slot}: {base:#x}+{size:#x} is not whole 128 MiB blocks"
        ));
    }
    let end = base.saturating_add(size);
    if end > MAPPED_LIMIT {
        fail(format_args!(
            "slot {slot}: {base:#x}+{size:#x} is above what this guest maps"
        ));
    }
    if let Some(ram) = info
        .memmap()
        .iter()
        .find(|e| e.addr < end && base < e.addr.saturating_add(e.size))
    {
        fail(format_args!(
            "slot {slot}: {base:#x}+{size:#x} overlaps the boot memory map entry {:#x}+{:#x}",
            ram.addr, ram.size
        ));
    }
    let seed = SEED.wrapping_add(u64::from(slot));
    fill(base, size, seed);
    let checksum = match verify(base, size, seed) {
        Ok(sum) => sum,
        Err(Mismatch {
            addr,
            expected,
            got,
        }) => fail(format_args!(
            "slot {slot}: at {addr:#x} expected {expected:#018x} got {got:#018x}"
        )),
    };
    // As Linux's acpi_memhotplug reports a device it added.
    outl(MSEL, slot);
    outl(MOEV, OST_INSERT);
    outl(MOSC, OST_SUCCESS);
    println!(
        "memory-hotplug: slot {slot} base={base:#x} size={size} memtest ok checksum={checksum:#018x}"
    );
    size
}

/// Writes slot `slot`'s disk pattern from the start of `base`, reads it back after it and
/// compares: virtio-blk I/O with both buffers in hot-plugged RAM.
fn disk_round_trip(disk: &mut DiskIo, slot: u32, base: u64) {
    let sector = u64::from(slot) * BLK_SECTORS;
    let seed = BLK_SEED + u64::from(slot);
    let (from, into) = (base, base + BLK_BYTES);
    let mut word = 0;
    while word < BLK_BYTES {
        let value = pattern(seed, sector * 512 + word);
        // SAFETY: [base, base + 2 * BLK_BYTES) is hot-plugged RAM this workload took (a
        // whole 128 MiB block, identity mapped below MAPPED_LIMIT: checked in take()).
        unsafe { core::ptr::write_volatile((from + word) as *mut u64, value) };
        word += 8;
    }
    zero(into, BLK_BYTES);
    disk.write(sector, from, BLK_BYTES as u32);
    disk.read(sector, into, BLK_BYTES as u32);
    let mut word = 0;
    while word < BLK_BYTES {
        let expected = pattern(seed, sector * 512 + word);
        // SAFETY: as above; the device finished with the buffer before publishing it.
        let got = unsafe { core::ptr::read_volatile((into + word) as *const u64) };
        if got != expected {
            fail(format_args!(
                "slot {slot}: virtio-blk read back {:#x}: expected {expected:#018x} got {got:#018x}",
                into + word
            ));
        }
        word += 8;
    }
    println!(
        "memory-hotplug: slot {slot} virtio-blk wrote and read back {BLK_BYTES} bytes at {from:#x}, sector {sector}"
    );
}

/// Checks that each of `taken` (slot, base, size) still holds its memtest pattern past its
/// first `skip` bytes.
fn recheck(taken: &[(u32, u64, u64)], skip: u64) {
    if taken.is_empty() {
        return;
    }
    for &(slot, base, size) in taken {
        let seed = SEED.wrapping_add(u64::from(slot));
        if let Err(Mismatch {
            addr,
            expected,
            got,
        }) = verify(base + skip, size - skip, seed)
        {
            fail(format_args!(
                "slot {slot} lost its pattern: at {addr:#x} expected {expected:#018x} got {got:#018x}"
            ));
        }
    }
    println!(
        "memory-hotplug: {} earlier slot(s) still hold their patterns",
        taken.len()
    );
}

/// Gives slot `slot` back: the remove event cleared (as MSCN does), `_OST`, then `_EJ0`.
fn eject(slot: u32) {
    let base = read_base(slot);
    outl(MSEL, slot);
    outl(FLAGS, MRMV);
    outl(MOEV, OST_EJECT);
    outl(MOSC, OST_SUCCESS);
    outl(MSEL, slot);
    outl(FLAGS, MEJ);
    println!("memory-hotplug: slot {slot} base={base:#x} ejected");
}

pub fn run(info: &BootInfo, mut words: Words) -> ! {
    let mut count = words.next_word();
    let ejects = count != Some("noeject");
    if !ejects {
        count = words.next_word();
    }
    let with_disk = count == Some("blk");
    if with_disk {
        count = words.next_word();
    }
    let mut dma;
    let mut dev;
    let mut disk = if with_disk {
        dma = Dma::new(info, "memory-hotplug");
        dev = VirtioPci::find("memory-hotplug", TYPE_BLOCK);
        Some(DiskIo::open(&mut dev, &mut dma))
    } else {
        None
    };
    let wanted = match count.map(crate::args::parse_number) {
        None => None,
        Some(Some(n)) => Some(n),
        Some(None) => {
            println!("testguest: usage: memory-hotplug [noeject] [blk] [COUNT]");
            exit(EXIT_USAGE)
        }
    };
    let slots = inl(MSLT);
    if slots == 0 || slots == u32::MAX {
        fail(format_args!("no memory hot-plug block (MSLT = {slots:#x})"));
    }
    println!("memory-hotplug: waiting, {slots} slot(s)");
    let (mut added, mut bytes) = (0u64, 0u64);
    // The slots held now: (slot, base, size), the first `held` entries.
    let mut taken = [(0u32, 0u64, 0u64); 32];
    let mut held = 0usize;
    // Slots whose remove request was ignored already (`noeject`), one bit each.
    let mut ignored = 0u64;
    loop {
        for slot in 0..slots {
            let flags = flags_of(slot);
            if flags & MRMV != 0 {
                if !ejects {
                    if slot < 64 && ignored & (1 << slot) == 0 {
                        ignored |= 1 << slot;
                        println!("memory-hotplug: slot {slot} remove request ignored");
                    }
                    continue;
                }
                // Stop using the range first, then give it back.
                if let Some(at) = taken[..held].iter().position(|t| t.0 == slot) {
                    taken.copy_within(at + 1..held, at);
                    held -= 1;
                }
                eject(slot);
                continue;
            }
            if slot < 64 {
                ignored &= !(1 << slot);
            }
            if flags & MINS == 0 {
                continue;
            }
            // What `disk_round_trip` overwrote at the start of each range is not the memtest's.
            let skip = if disk.is_some() { 2 * BLK_BYTES } else { 0 };
            recheck(&taken[..held], skip);
            // Taken: clear the event first, as MSCN does.
            outl(FLAGS, MINS);
            let base = read_base(slot);
            let size = take(info, slot);
            bytes += size;
            if let Some(entry) = taken.get_mut(held) {
                *entry = (slot, base, size);
                held += 1;
            }
            if let Some(disk) = disk.as_mut() {
                disk_round_trip(disk, slot, base);
            }
            added += 1;
            println!("memory-hotplug: {added} slot(s), {bytes} bytes added");
            if wanted == Some(added) {
                exit(0);
            }
        }
        between_polls();
    }
}
