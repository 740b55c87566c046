//! The `gpu-clique [COUNT]` workload: for every NVIDIA device (function 0 of each slot of
//! bus 0, and of any bus behind a bridge the VMM numbered, so GPUs under virtual root
//! ports and switches count too) it walks the capability list from 0x34, as NVIDIA's
//! driver does, looking for the vendor-specific capability (id 0x09) with the "P2P"
//! signature that carries the GPUDirect clique (bits 6:3 of its byte 6).
//!
//! Lines: one `gpu-clique: BB:DD.0 clique N` (or `gpu-clique: BB:DD.0 none`) per NVIDIA
//! device in bus and slot order, then `gpu-clique: ok COUNT`; when COUNT is given and
//! another number of NVIDIA devices is found, or a P2P capability is malformed,
//! `gpu-clique: FAIL ...` and exit 1.

use crate::arch::{inl, outl};
use crate::console::exit;
use crate::println;

const CONFIG_ADDRESS: u16 = 0xcf8;
const CONFIG_DATA: u16 = 0xcfc;

const EXIT_FAIL: u32 = 1;
const NVIDIA: u32 = 0x10de;
const CAP_ID_VENDOR: u8 = 0x09;
const STATUS_CAPABILITY_LIST: u32 = 1 << 4;

fn fail(what: core::fmt::Arguments) -> ! {
    println!("gpu-clique: FAIL {what}");
    exit(EXIT_FAIL)
}

/// A PCI function: (bus, device), function 0.
type Slot = (u8, u8);

fn config_read((bus, device): Slot, register: u8) -> u32 {
    let address =
        1 << 31 | u32::from(bus) << 16 | u32::from(device) << 11 | u32::from(register & 0xfc);
    outl(CONFIG_ADDRESS, address);
    inl(CONFIG_DATA)
}

/// One configuration byte of `device`.
fn config_byte(device: Slot, offset: u8) -> u8 {
    (config_read(device, offset & 0xfc) >> (8 * u32::from(offset & 3))) as u8
}

/// The clique in `device`'s GPUDirect capability, if it has one.
fn clique_of(device: Slot) -> Option<u8> {
    if config_read(device, 0x04) >> 16 & STATUS_CAPABILITY_LIST == 0 {
        return None;
    }
    let mut pointer = config_byte(device, 0x34) & 0xfc;
    // At most 48 capabilities fit in the standard space; more is a loop.
    for _ in 0..48 {
        if pointer < 0x40 {
            return None;
        }
        let id = config_byte(device, pointer);
        let signature = [
            config_byte(device, pointer + 3),
            config_byte(device, pointer + 4),
            config_byte(device, pointer + 5),
        ];
        if id == CAP_ID_VENDOR && signature == *b"P2P" {
            let length = config_byte(device, pointer + 2);
            if length != 8 {
                fail(format_args!(
                    "{:02x}:{:02x}.0 P2P capability at {pointer:#x} has length {length}",
                    device.0, device.1
                ));
            }
            let word = config_byte(device, pointer + 6);
            return Some((word >> 3) & 0xf);
        }
        pointer = config_byte(device, pointer + 1) & 0xfc;
    }
    None
}

pub fn run(count: Option<&str>) -> ! {
    let expected = count.and_then(|word| word.parse::<u32>().ok());
    let mut found = 0u32;
    // Buses bridges lead to (their secondary bus numbers), scanned after bus 0.
    let mut buses = [false; 256];
    buses[0] = true;
    for bus in 0..=255u8 {
        if !buses[usize::from(bus)] {
            continue;
        }
        for device in 0..32u8 {
            let slot = (bus, device);
            let ids = config_read(slot, 0);
            if ids & 0xffff == 0xffff {
                continue;
            }
            // A PCI-to-PCI bridge (header type 1): what is behind it is on its secondary bus.
            if (config_read(slot, 0x0c) >> 16) & 0x7f == 1 {
                let secondary = (config_read(slot, 0x18) >> 8) as u8;
                if secondary > bus {
                    buses[usize::from(secondary)] = true;
                }
                continue;
            }
            if ids & 0xffff != NVIDIA {
                continue;
            }
            found += 1;
            match clique_of(slot) {
                Some(clique) => println!("gpu-clique: {bus:02x}:{device:02x}.0 clique {clique}"),
                None => println!("gpu-clique: {bus:02x}:{device:02x}.0 none"),
            }
        }
    }
    if let Some(expected) = expected.filter(|expected| *expected != found) {
        fail(format_args!(
            "{found} NVIDIA device(s), expected {expected}"
        ));
    }
    println!("gpu-clique: ok {found}");
    exit(0)
}
