//! `virtio-rng`: reads two 64-byte blocks from the entropy device (type 4) by polling, checks
//! they are not all zero and differ, then reads once more and waits for the queue's MSI-X
//! interrupt in ring 0.

use super::irq;
use super::pci;
use super::queue::{Buffer, SplitQueue};
use super::transport::{VirtioPci, NO_VECTOR, TYPE_ENTROPY};
use super::{read_ram, Dma, Hex, REQUEST_TIMEOUT_MS};
use crate::console::exit;
use crate::println;

const NAME: &str = "virtio-rng";
pub const BLOCK: usize = 64;
/// Table entry used for request queue 0.
const QUEUE_VECTOR: u16 = 0;

/// Fills `BLOCK` bytes at `addr`, one request at a time (a device may return fewer bytes
/// than asked for, but never zero or more).
pub fn read_block(dev: &VirtioPci, queue: &mut SplitQueue, addr: u64) -> [u8; BLOCK] {
    let mut filled = 0usize;
    let mut requests = 0;
    while filled < BLOCK {
        requests += 1;
        if requests > BLOCK {
            dev.fail(format_args!("{requests} requests for {BLOCK} bytes"));
        }
        let wanted = (BLOCK - filled) as u32;
        if let Err(err) = queue.add(&[Buffer::writable(addr + filled as u64, wanted)], 0) {
            dev.fail(format_args!("request queue: {err}"));
        }
        queue.notify();
        let used = queue
            .wait_used()
            .unwrap_or_else(|err| dev.fail(format_args!("request queue: {err}")));
        if used.len == 0 || used.len > wanted {
            dev.fail(format_args!(
                "device wrote {} bytes into a {wanted}-byte buffer",
                used.len
            ));
        }
        filled += used.len as usize;
    }
    let mut block = [0u8; BLOCK];
    read_ram(addr, &mut block);
    block
}

/// Points table entry [`QUEUE_VECTOR`] at this CPU's [`irq::MSI_VECTOR`] and enables MSI-X.
fn program_msix(dev: &VirtioPci, msix: &pci::Msix) {
    let table_base = pci::bar_address(dev.device, msix.table_bar)
        .unwrap_or_else(|err| dev.fail(format_args!("MSI-X table BAR {} {err}", msix.table_bar)));
    let table = table_base + u64::from(msix.table_offset);
    let entry = table + 16 * u64::from(QUEUE_VECTOR);
    if !crate::boot::is_mapped(entry, 16) {
        dev.fail(format_args!(
            "MSI-X table at {table:#x} is above the mapped range"
        ));
    }
    println!(
        "{NAME}: msi-x cap at {:#x}, {} vectors, table at {table:#x}",
        msix.pointer(),
        msix.table_size
    );
    // SAFETY: `entry` is the first MSI-X table entry, in a memory BAR in a mapped range
    // (identity mapped, user accessible); the accesses trap to the VMM.
    unsafe {
        (entry as *mut u32).write_volatile(irq::msi_address());
        ((entry + 4) as *mut u32).write_volatile(0);
        ((entry + 8) as *mut u32).write_volatile(u32::from(irq::MSI_VECTOR));
        ((entry + 12) as *mut u32).write_volatile(0);
    }
    if !msix.enable() {
        dev.fail(format_args!("MSI-X did not enable"));
    }
}

pub fn run(dma: &mut Dma) -> ! {
    let mut dev = VirtioPci::find(NAME, TYPE_ENTROPY);
    dev.initialize(0);
    // MSI-X after the reset and before the queue is given its vector, as Linux does; the
    // local APIC stays disabled during the polled reads, so their interrupts are dropped.
    // Without MSI-X the polled reads still run, and the check fails after them.
    irq::disable_lapic();
    let msix = pci::Msix::find(dev.device);
    let vector = msix.as_ref().map(|msix| {
        program_msix(&dev, msix);
        QUEUE_VECTOR
    });
    dev.set_config_vector(NO_VECTOR);
    let mut queue = dev.setup_queue(dma, 0, vector);
    dev.driver_ok();

    let buffer = dma.alloc(4096, 4096);
    let first = read_block(&dev, &mut queue, buffer);
    let second = read_block(&dev, &mut queue, buffer + BLOCK as u64);
    println!("{NAME}: block 1 {}", Hex(&first));
    println!("{NAME}: block 2 {}", Hex(&second));
    if first.iter().all(|&b| b == 0) || second.iter().all(|&b| b == 0) {
        dev.fail(format_args!("a 64-byte block is all zero"));
    }
    if first == second {
        dev.fail(format_args!("the two 64-byte blocks are identical"));
    }
    println!("{NAME}: ok {} bytes", 2 * BLOCK);
    if msix.is_none() {
        dev.fail(format_args!("no MSI-X capability"));
    }

    irq::enable_lapic();
    let before = irq::msi_count();
    let used_before = queue.used_index();
    if let Err(err) = queue.add(
        &[Buffer::writable(buffer + 2 * BLOCK as u64, BLOCK as u32)],
        0,
    ) {
        dev.fail(format_args!("request queue: {err}"));
    }
    queue.notify();
    let interrupted = irq::wait(REQUEST_TIMEOUT_MS, || irq::msi_count() != before);
    let used_after = queue.used_index();
    if !interrupted {
        dev.fail(format_args!(
            "no MSI-X interrupt on vector {:#x} within {REQUEST_TIMEOUT_MS} ms (used index {used_before} -> {used_after})",
            irq::MSI_VECTOR
        ));
    }
    // The device publishes the used buffer before it signals.
    match queue.pop_used() {
        Ok(Some(used)) if used.len > 0 && used.len <= BLOCK as u32 => {}
        Ok(Some(used)) => dev.fail(format_args!(
            "device wrote {} bytes into a {BLOCK}-byte buffer",
            used.len
        )),
        Ok(None) => dev.fail(format_args!(
            "MSI-X interrupt arrived before the used buffer (used index {used_after})"
        )),
        Err(err) => dev.fail(format_args!("request queue: {err}")),
    }
    println!(
        "{NAME}: msi-x interrupt on vector {:#x} (count {})",
        irq::MSI_VECTOR,
        irq::msi_count() - before
    );
    println!("{NAME}: msi-x ok");
    exit(0)
}
