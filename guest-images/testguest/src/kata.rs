//! The `kata-agent` workload: what a Kata Containers pod asks of its guest while Kata's clh
//! driver drives the VMM (tests/kata_cloud_hypervisor.rs), one step after another, each
//! step's lines starting `kata-agent: `:
//!
//! 1. the agent's vsock port 1024: one host connection (hybrid vsock `CONNECT 1024`), echoed;
//! 2. a hot-plugged GPU (vm.add-user-device): the `pci` checks on it, then its eject
//!    (vm.remove-device);
//! 3. a hot-plugged virtio-blk disk (vm.add-disk after boot): checked, then its eject;
//! 4. a second agent connection, which may come after a snapshot and restore (the restore's
//!    TRANSPORT_RESET is taken in stride); then `kata-agent: ok`, and the guest idles until
//!    the VMM is shut down (vmm.shutdown), as a pod's guest does.
//!
//! Failures are `kata-agent: FAIL ...` (or the reused steps' own FAIL lines) and exit 1.

use crate::bootinfo::BootInfo;
use crate::console::{exit, halt_forever};
use crate::hotplug;
use crate::println;
use crate::virtio::transport::{VirtioPci, TYPE_VSOCK};
use crate::virtio::vsock::{Server, PORT};
use crate::virtio::Dma;

const NAME: &str = "kata-agent";
const EXIT_FAIL: u32 = 1;

fn fail(what: core::fmt::Arguments) -> ! {
    println!("{NAME}: FAIL {what}");
    exit(EXIT_FAIL)
}

pub fn run(info: &BootInfo) -> ! {
    let mut dma = Dma::new(info, NAME);
    let mut vsock = VirtioPci::find(NAME, TYPE_VSOCK);
    vsock.initialize(0);
    let mut agent = Server::start(NAME, &vsock, &mut dma);
    println!("{NAME}: agent listening cid={} port={PORT}", agent.cid);
    serve_agent(&mut agent, 1);

    // PCIU shows every slot that arrived since it was last read: one read may hold both.
    let mut arrivals = 0u32;
    hot_plugged_gpu(&mut arrivals);
    hot_plugged_disk(&mut dma, &mut arrivals);

    println!("{NAME}: agent waiting for connection 2");
    serve_agent(&mut agent, 2);
    println!("{NAME}: ok");
    halt_forever()
}

/// Serves the agent's port until `connections` connections in all have ended.
fn serve_agent(agent: &mut Server, connections: u32) {
    agent.serve(connections, true, |k| {
        println!("{NAME}: agent connection {k} done");
    });
    println!("{NAME}: agent echoed {} bytes in all", agent.echoed);
}

/// Waits for the next hot-plugged device and prints where it arrived as `<what>`.
fn arrival(arrivals: &mut u32, what: &str) -> u8 {
    println!("{NAME}: waiting for a hot-plugged {what}");
    let slot = hotplug::next_arrival(arrivals);
    println!("{NAME}: {what} arrived at 00:{slot:02x}.0");
    slot
}

/// Waits for the VMM's eject request for `slot` and ejects it.
fn eject(slot: u8, what: &str) {
    hotplug::wait_for_eject_request(NAME, slot);
    println!("{NAME}: {what} eject requested for 00:{slot:02x}.0");
    if let Err(ids) = hotplug::eject(slot) {
        fail(format_args!(
            "{what} at 00:{slot:02x}.0 still reads {ids:#010x} after the eject"
        ));
    }
    println!("{NAME}: {what} ejected, 00:{slot:02x}.0 reads all ones");
}

/// Step 2: the emulated GPU, checked as the `pci` workload checks it, then ejected.
fn hot_plugged_gpu(arrivals: &mut u32) {
    let slot = arrival(arrivals, "GPU");
    if !crate::pci::is_gpu(slot) {
        fail(format_args!(
            "00:{slot:02x}.0 ({:#010x}) is not the emulated GPU",
            crate::pci::vendor_device(slot)
        ));
    }
    crate::pci::check_device(slot, false);
    println!("{NAME}: GPU at 00:{slot:02x}.0 passed the pci checks");
    crate::pci::release_device(slot);
    eject(slot, "GPU");
}

/// Step 3: a virtio-blk disk, checked and ejected by the `virtio-blk-hotplug` workload's
/// steps (the `virtio-blk` checks: sector 0's magic, the serial, a pattern written to
/// sectors 8..16 and read back).
fn hot_plugged_disk(dma: &mut Dma, arrivals: &mut u32) {
    println!("{NAME}: waiting for a hot-plugged disk");
    let slot = crate::virtio::hotplug::check_arriving_disk(dma, arrivals);
    println!("{NAME}: disk at 00:{slot:02x}.0 passed the virtio-blk checks");
    crate::virtio::hotplug::eject_disk(slot);
    println!("{NAME}: disk ejected, 00:{slot:02x}.0 reads all ones");
}
