//! gpuvm test guest: a freestanding PVH guest that sets up long mode with as few (emulated)
//! ring-0 instructions as possible and runs its workloads in ring 3, talking to the VMM only
//! through port I/O (serial 0x3f8, exit 0xf4) and MMIO. See ../README.md for the I/O contract.

#![no_std]
#![no_main]

mod acpi;
mod arch;
mod args;
mod bigbars;
mod boot;
mod bootinfo;
mod console;
mod cpu_hotplug;
mod edu;
mod exception;
mod gpu_clique;
mod gpu_migrate;
mod hotplug;
mod kata;
mod lapic;
mod memfns;
mod memory_hotplug;
mod numa;
mod p2p;
mod pattern;
mod pci;
mod pci_topology;
mod pcie_hotplug;
mod region;
mod segment_hotplug;
mod smp;
mod virtio;
mod workloads;

use bootinfo::BootInfo;

/// First ring-3 code on the boot CPU (entered by `iretq` from boot.rs).
#[no_mangle]
pub extern "sysv64" fn tg_bsp_main() -> ! {
    arch::init_fpu();
    println!("testguest: ready");
    let info = match BootInfo::read(boot::start_info_paddr()) {
        Ok(info) => info,
        Err(err) => {
            println!("testguest: unusable boot information: {err}");
            console::exit(2)
        }
    };
    boot::map_high_memory();
    workloads::run(&info)
}
