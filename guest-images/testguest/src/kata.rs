//! The `kata-agent` workload: what a Kata Containers pod asks of its guest while Kata's clh
//! driver drives the VMM (tests/kata_cloud_hypervisor.rs), one step after another, each
//! step's lines starting `kata-agent: `:
//!
//! 1. the agent's vsock port 1024: one host connection (hybrid vsock `CONNECT 1024`), echoed;
//! 2. a vCPU hot-plugged by vm.resize: started with INIT/SIPI/SIPI once its ACPI insert
//!    event shows (the `cpu-hotplug` workload's registers), it checks itself in ring 3
//!    (`kata-agent: cpu N online`) and then sleeps in `hlt`;
//! 3. the hot-plugged devices of the pod's containers, in whatever order and batches they
//!    show in PCIU: a GPU (vm.add-user-device; the `pci` checks on it) and [`DISKS`]
//!    virtio-blk disks (vm.add-disk; the `virtio-blk` checks on each). All are kept;
//! 4. a second agent connection, which may come after a snapshot and restore (the restore's
//!    TRANSPORT_RESET is taken in stride);
//! 5. the kept devices used again: the GPU's registers still hold what its checks wrote and
//!    a DMA job lands with its MSI-X interrupt; each disk still has its magic, its tag (the
//!    8 bytes after the magic, printed) and the pattern its checks wrote;
//!
//! then `kata-agent: ok`, and the guest idles until the VMM is shut down (vmm.shutdown), as
//! a pod's guest does.
//!
//! Failures are `kata-agent: FAIL ...` (or the reused steps' own FAIL lines) and exit 1.

use core::sync::atomic::{AtomicU32, Ordering};

use crate::arch::{cpuid, pause};
use crate::bootinfo::BootInfo;
use crate::console::{exit, halt_forever};
use crate::println;
use crate::virtio::transport::{VirtioPci, TYPE_VSOCK};
use crate::virtio::vsock::{Server, PORT};
use crate::virtio::Dma;
use crate::{hotplug, smp};

const NAME: &str = "kata-agent";
const EXIT_FAIL: u32 = 1;
/// The disks the test hot-plugs: one per container.
const DISKS: usize = 8;
/// The seed of the DMA job on the kept GPU.
const KEPT_GPU_SEED: u64 = 0x6b61_7461;

/// Hot-plugged CPUs that passed their ring-3 check.
static CPUS_ONLINE: AtomicU32 = AtomicU32::new(0);

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

    hot_plugged_cpu(info);
    let (gpu, disks) = hot_plugged_devices(&mut dma);

    println!("{NAME}: agent waiting for connection 2");
    serve_agent(&mut agent, 2);
    kept_devices(&mut dma, gpu, &disks);
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

/// Step 2: the first CPU the VMM inserts, brought online.
fn hot_plugged_cpu(info: &BootInfo) {
    let Some(table) = smp::hotpluggable(info.rsdp_paddr) else {
        fail(format_args!("the MADT lists no online-capable CPU"));
    };
    let possible = table.apic_ids().iter().copied().max().unwrap_or(0) + 1;
    let starter = smp::Starter::new(table.lapic_base, crate::arch::tsc_hz());
    smp::run_on_aps(hot_plugged_cpu_job);
    println!("{NAME}: waiting for a hot-plugged vCPU");
    let cpu = crate::cpu_hotplug::wait_for_insert(possible);
    println!("{NAME}: cpu {cpu} inserted");
    if starter.start(cpu).is_none() {
        fail(format_args!("cpu {cpu} did not come up"));
    }
    while CPUS_ONLINE.load(Ordering::Acquire) == 0 {
        pause();
    }
}

/// What the hot-plugged CPU runs in ring 3: it checks who it is, says so, and sleeps (its
/// `hlt`s wait in ring 0, through the #GP handler, so it costs the host nothing).
fn hot_plugged_cpu_job(_index: usize) {
    let apic = crate::lapic::id();
    let initial = cpuid(1, 0).ebx >> 24;
    if apic != initial {
        fail(format_args!(
            "cpu with local APIC id {apic} has initial APIC id {initial} in CPUID"
        ));
    }
    println!("{NAME}: cpu {apic} online (ring 3, cpuid apic id {initial})");
    CPUS_ONLINE.fetch_add(1, Ordering::AcqRel);
    loop {
        // SAFETY: hlt faults in ring 3; the #GP handler waits for an interrupt in ring 0.
        unsafe { core::arch::asm!("hlt", options(nomem, nostack)) };
    }
}

/// Step 3: the GPU and the disks, each checked where it arrived; their slots.
fn hot_plugged_devices(dma: &mut Dma) -> (u8, [u8; DISKS]) {
    println!("{NAME}: waiting for a hot-plugged GPU and {DISKS} disks");
    // PCIU shows every slot that arrived since it was last read: one read may hold several.
    let mut arrivals = 0u32;
    let mut gpu = None;
    let mut disks = [0u8; DISKS];
    let mut disk_count = 0;
    while gpu.is_none() || disk_count < DISKS {
        let slot = hotplug::next_arrival(&mut arrivals);
        let is_gpu = crate::pci::is_gpu(slot);
        if is_gpu && gpu.is_none() {
            println!("{NAME}: GPU arrived at 00:{slot:02x}.0");
            crate::pci::check_device(slot, false);
            println!("{NAME}: GPU at 00:{slot:02x}.0 passed the pci checks");
            gpu = Some(slot);
        } else if !is_gpu && disk_count < DISKS {
            crate::virtio::hotplug::check_disk(dma, slot);
            println!("{NAME}: disk at 00:{slot:02x}.0 passed the virtio-blk checks");
            disks[disk_count] = slot;
            disk_count += 1;
        } else {
            fail(format_args!(
                "00:{slot:02x}.0 ({:#010x}) arrived beyond the GPU and {DISKS} disks",
                crate::pci::vendor_device(slot)
            ));
        }
    }
    let Some(gpu) = gpu else {
        fail(format_args!("no GPU"));
    };
    println!("{NAME}: the GPU and {DISKS} disks are in place");
    (gpu, disks)
}

/// Step 5: the devices kept since step 3, used again.
fn kept_devices(dma: &mut Dma, gpu: u8, disks: &[u8]) {
    crate::pci::check_kept_device(gpu, KEPT_GPU_SEED);
    println!("{NAME}: GPU at 00:{gpu:02x}.0 kept its registers, DMA verified");
    for &slot in disks {
        let tag = crate::virtio::hotplug::check_kept_disk(dma, slot);
        let printable = tag.iter().take_while(|b| b.is_ascii_graphic()).count();
        let text = core::str::from_utf8(&tag[..printable]).unwrap_or("");
        println!("{NAME}: disk at 00:{slot:02x}.0 kept its data, tag '{text}'");
    }
}
