//! `virtio-blk-hotplug [N]`: N times (default 1), waits for a virtio-blk disk hot-plugged
//! while the guest runs (Cloud Hypervisor's vm.add-disk after vm.boot), runs the
//! `virtio-blk` checks on it, waits for its eject request (vm.remove-device), resets the
//! device, quiets it and ejects it, as a Linux guest's acpiphp would.

use super::transport::{VirtioPci, TYPE_BLOCK};
use super::{fail, Dma};
use crate::console::exit;
use crate::println;

const NAME: &str = "virtio-blk-hotplug";

/// One hot-plugged disk: waits for it (`pending`: arrivals already read), checks it, and
/// returns its slot once it works.
pub(crate) fn check_arriving_disk(dma: &mut Dma, pending: &mut u32) -> u8 {
    let slot = crate::hotplug::next_arrival(pending);
    check_disk(dma, slot);
    slot
}

/// The disk that arrived in `slot`: the `virtio-blk` checks on it, then a reset.
pub(crate) fn check_disk(dma: &mut Dma, slot: u8) {
    println!("{NAME}: disk arrived at 00:{slot:02x}.0");
    let mut dev = VirtioPci::at(NAME, slot, TYPE_BLOCK);
    super::blk::check(&mut dev, dma);
    dev.reset();
}

/// The disk in `slot`, checked by [`check_disk`] and kept (through a snapshot and restore,
/// say): [`super::blk::check_kept`] on it, then a reset. Returns the disk's tag.
pub(crate) fn check_kept_disk(dma: &mut Dma, slot: u8) -> [u8; 8] {
    let mut dev = VirtioPci::at(NAME, slot, TYPE_BLOCK);
    let tag = super::blk::check_kept(&mut dev, dma);
    dev.reset();
    tag
}

/// Waits for the eject request for the disk in `slot` and ejects it.
pub(crate) fn eject_disk(slot: u8) {
    crate::hotplug::wait_for_eject_request(NAME, slot);
    println!("{NAME}: eject requested for 00:{slot:02x}.0");
    crate::pci::release_device(slot);
    if let Err(ids) = crate::hotplug::eject(slot) {
        fail(
            NAME,
            format_args!("00:{slot:02x}.0 still reads {ids:#010x} after the eject"),
        );
    }
    println!("{NAME}: 00:{slot:02x}.0 ejected, reads all ones");
}

pub fn run(dma: &mut Dma, words: &mut crate::args::Words) -> ! {
    let count = match words.next_word().map(crate::args::parse_number) {
        None => 1,
        Some(Some(n)) if n > 0 => n,
        Some(_) => super::fail_setup(NAME, format_args!("usage: virtio-blk-hotplug [N]")),
    };
    println!("{NAME}: waiting for {count} disk(s)");
    let mut pending = 0;
    for round in 1..=count {
        let slot = check_arriving_disk(dma, &mut pending);
        println!("{NAME}: disk {round} at 00:{slot:02x}.0 passed the checks");
        eject_disk(slot);
    }
    println!("{NAME}: ok");
    exit(0)
}
