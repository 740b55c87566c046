//! The `pci-hotplug [N] [keep|loop]` workload: waits for the VMM to hot-plug the emulated
//! GPU (PUT /gpus/{id} while running), runs the `pci` checks on it, waits for the eject
//! request (DELETE /gpus/{id}), releases the device and ejects it, N times (default 1).
//! With `keep` it never ejects (for the VMM's eject timeout); with `loop` it runs the DMA
//! jobs of `pci loop` on the device until the eject request (a live update in between).
//!
//! It uses gpuvm's ACPI PCI hot-plug registers the way the DSDT's AML does (PCNT reads
//! PCIU/PCID, _EJ0 writes B0EJ), from ring 3 and by polling: no ACPI interpreter, no SCI.

use crate::arch::{inl, outl};
use crate::console::exit;
use crate::println;

/// gpuvm_devices::pci::hotplug's register block.
const HOTPLUG_PORT: u16 = 0xae00;
pub(crate) const PCIU: u16 = HOTPLUG_PORT;
pub(crate) const PCID: u16 = HOTPLUG_PORT + 4;
pub(crate) const B0EJ: u16 = HOTPLUG_PORT + 8;
const EXIT_FAIL: u32 = 1;

fn fail(what: core::fmt::Arguments) -> ! {
    println!("hotplug: FAIL {what}");
    exit(EXIT_FAIL)
}

/// A short pause between polls (native in ring 3; each register read exits to the VMM).
fn pause() {
    for _ in 0..20_000 {
        core::hint::spin_loop();
    }
}

/// Waits until a register read (which clears it) shows a bit; returns every bit it showed.
fn wait_for(port: u16) -> u32 {
    loop {
        let bits = inl(port);
        if bits != 0 {
            return bits;
        }
        pause();
    }
}

/// The next hot-plugged slot. `pending` holds arrivals already read and not yet taken (a
/// PCIU read clears the register, and it may show several slots at once).
pub(crate) fn next_arrival(pending: &mut u32) -> u8 {
    if *pending == 0 {
        *pending = wait_for(PCIU);
    }
    let slot = pending.trailing_zeros() as u8;
    *pending &= !(1 << slot);
    slot
}

/// Waits for the VMM's eject request for `slot`; requests for other slots are printed as
/// `<name>: eject request for other slots ... ignored`.
pub(crate) fn wait_for_eject_request(name: &str, slot: u8) {
    loop {
        let down = wait_for(PCID);
        if down & 1 << slot != 0 {
            return;
        }
        println!("{name}: eject request for other slots {down:#x} ignored");
    }
}

/// Ejects `slot` (B0EJ, as _EJ0 does); the vendor and device id it still reads if it did not
/// go away (a gone device reads all ones).
pub(crate) fn eject(slot: u8) -> Result<(), u32> {
    outl(B0EJ, 1 << slot);
    match crate::pci::vendor_device(slot) {
        0xffff_ffff => Ok(()),
        ids => Err(ids),
    }
}

pub fn run(count: Option<&str>, mode: Option<&str>) -> ! {
    let count: u32 = match count.map(str::parse) {
        None => 1,
        Some(Ok(n)) if n > 0 => n,
        Some(_) => fail(format_args!("usage: pci-hotplug [N] [keep|loop]")),
    };
    let keep = mode == Some("keep");
    let looping = mode == Some("loop");
    println!("hotplug: waiting for {count} device(s)");
    let mut arrived = 0u32;
    for round in 1..=count {
        let slot = next_arrival(&mut arrived);
        println!("hotplug: device {round} arrived at 00:{slot:02x}.0");
        if !crate::pci::is_gpu(slot) {
            fail(format_args!("00:{slot:02x}.0 is not the emulated GPU"));
        }
        crate::pci::check_device(slot, false);
        println!("hotplug: device {round} at 00:{slot:02x}.0 passed the pci checks");
        if keep {
            println!("hotplug: keeping the device; eject requests are ignored");
            crate::console::halt_forever();
        }
        if looping {
            // PCID clears as it is read: other slots' requests are dropped (one device).
            crate::pci::dma_rounds(slot, || inl(PCID) & 1 << slot != 0);
        } else {
            wait_for_eject_request("hotplug", slot);
        }
        println!("hotplug: eject requested for 00:{slot:02x}.0");
        crate::pci::release_device(slot);
        if let Err(ids) = eject(slot) {
            fail(format_args!(
                "00:{slot:02x}.0 still reads {ids:#010x} after the eject"
            ));
        }
        println!("hotplug: device {round} ejected, 00:{slot:02x}.0 reads all ones");
    }
    println!("hotplug: ok");
    exit(0)
}
