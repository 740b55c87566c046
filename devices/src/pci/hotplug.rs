//! ACPI PCI hot-plug for bus 0, modelled on QEMU's (hw/acpi/pcihp.c): a small port-I/O
//! register block that the DSDT's AML (arch/src/x86_64/acpi.rs) reads and writes, and an
//! interrupt that tells the guest to look.
//!
//! ```text
//! port HOTPLUG_PORT + 0x00  PCIU  (read)   slots with a new device; reading clears it
//!                   + 0x04  PCID  (read)   slots the VMM asks the guest to eject; reading clears it
//!                   + 0x08  B0EJ  (write)  the guest ejects the slots whose bits it writes
//!                   + 0x0c  EVTS  (r/w1c)  bit 0: a hot-plug event is pending
//!                   + 0x10  EVEN  (r/w)    bit 0: raise HOTPLUG_GSI for events (the GED's
//!                                          _INI sets it; off until then, like a GPE enable)
//! ```
//!
//! The VMM plugs a device into the [`PciRoot`] and calls [`HotplugController::device_added`];
//! the guest's AML (or the test guest, polling PCIU from ring 3) sees the bit and scans the
//! slot. To unplug, the VMM calls [`HotplugController::request_eject`]; the guest releases
//! the device and writes its slot bit to B0EJ, which takes the device off the bus at once
//! (its configuration space reads all ones from then on) and wakes the VMM, which tears the
//! device down ([`HotplugController::take_ejected`]). Only slots the VMM made hot-pluggable
//! can be ejected: B0EJ bits for other slots (the host bridge, cold-plugged and virtio
//! devices) are ignored.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use vmm_sys_util::eventfd::EventFd;

use super::root::{PciBdf, PciRoot};
use crate::{BusDevice, Persist};

/// First port of the register block (QEMU's PIIX4 uses the same base for its PCIHP block).
pub const HOTPLUG_PORT: u16 = 0xae00;
/// Bytes of the register block.
pub const HOTPLUG_PORT_LEN: u16 = 0x14;
/// Where the register blocks of PCI segments 1.. start, one every
/// [`SEGMENT_HOTPLUG_STRIDE`] ports: each segment's bus 0 has ACPI hot-plug of its own
/// (`\_SB.PC0N`'s slots), so a device can be hot-plugged onto a NUMA node's segment.
/// Below segment 0's block, so the 15 further segments' blocks end before it.
pub const SEGMENT_HOTPLUG_PORT: u16 = 0xac00;
/// Ports between two segments' register blocks.
pub const SEGMENT_HOTPLUG_STRIDE: u16 = 0x20;

/// The first port of PCI segment `segment`'s register block.
pub const fn hotplug_port(segment: u16) -> u16 {
    if segment == 0 {
        HOTPLUG_PORT
    } else {
        SEGMENT_HOTPLUG_PORT + (segment - 1) * SEGMENT_HOTPLUG_STRIDE
    }
}
/// Register offsets.
pub const PCIU: u64 = 0x00;
pub const PCID: u64 = 0x04;
pub const B0EJ: u64 = 0x08;
pub const EVTS: u64 = 0x0c;
pub const EVEN: u64 = 0x10;
/// The edge-triggered GSI (an ISA IRQ, so IOAPIC pin 5 with the ISA defaults) the VMM raises
/// for each hot-plug event; the DSDT's Generic Event Device names it.
pub const HOTPLUG_GSI: u32 = 5;

/// The register block. Shared between the port-I/O bus (vCPU threads) and the VMM thread.
pub struct HotplugController {
    root: Arc<PciRoot>,
    up: u32,
    down: u32,
    /// Slots the guest ejected that the VMM has not taken down yet.
    ejected: u32,
    /// Slots the guest may eject (devices the VMM hot-plugged).
    ejectable: u32,
    events: u32,
    /// Whether the guest enabled the interrupt (bit 0).
    enabled: u32,
    /// An irqfd on [`HOTPLUG_GSI`], if wired.
    interrupt: Option<EventFd>,
    /// Written when the guest ejects a slot, so the VMM thread looks.
    wake: Option<EventFd>,
}

fn bit(slot: u8) -> u32 {
    1u32 << (slot & 31)
}

impl HotplugController {
    pub fn new(root: Arc<PciRoot>, interrupt: Option<EventFd>) -> Self {
        HotplugController {
            root,
            up: 0,
            down: 0,
            ejected: 0,
            ejectable: 0,
            events: 0,
            enabled: 0,
            interrupt,
            wake: None,
        }
    }

    /// Where to signal ejects (the VMM thread's wake-up eventfd).
    pub fn set_wake(&mut self, wake: EventFd) {
        self.wake = Some(wake);
    }

    fn signal(&mut self) {
        self.events |= 1;
        if self.enabled & 1 == 0 {
            return;
        }
        if let Some(interrupt) = &self.interrupt {
            if let Err(error) = interrupt.write(1) {
                log::warn!("PCI hot-plug: cannot raise GSI {HOTPLUG_GSI}: {error}");
            }
        }
    }

    /// A device is now in `slot`: tell the guest.
    pub fn device_added(&mut self, slot: u8) {
        self.up |= bit(slot);
        self.down &= !bit(slot);
        self.ejected &= !bit(slot);
        self.ejectable |= bit(slot);
        self.signal();
    }

    /// Asks the guest to release and eject the device in `slot`.
    pub fn request_eject(&mut self, slot: u8) {
        self.up &= !bit(slot);
        self.down |= bit(slot);
        self.signal();
    }

    /// Withdraws an eject request the guest did not act on (the device stays).
    pub fn cancel_eject(&mut self, slot: u8) {
        self.down &= !bit(slot);
    }

    /// Whether the guest ejected `slot`; clears it, and the slot is no longer ejectable.
    pub fn take_ejected(&mut self, slot: u8) -> bool {
        let ejected = self.ejected & bit(slot) != 0;
        if ejected {
            self.ejected &= !bit(slot);
        }
        ejected
    }

    /// A restored device was plugged back into `slot`: the guest already knows it (its
    /// arrival was before the snapshot), so no event; it can be ejected again.
    pub fn device_restored(&mut self, slot: u8) {
        self.ejectable |= bit(slot);
    }

    /// The VMM took the device in `slot` away itself (it was never ejected by the guest).
    pub fn forget(&mut self, slot: u8) {
        self.up &= !bit(slot);
        self.down &= !bit(slot);
        self.ejected &= !bit(slot);
        self.ejectable &= !bit(slot);
    }

    fn eject(&mut self, slots: u32) {
        let slots = slots & self.ejectable;
        for slot in 0..32u8 {
            if slots & bit(slot) == 0 {
                continue;
            }
            let bdf = PciBdf {
                segment: self.root.segment(),
                bus: 0,
                device: slot,
                function: 0,
            };
            // Off the bus now: from this access on the slot reads all ones. The VMM thread
            // holds its own reference and tears the device down.
            self.root.remove_device(bdf);
            self.ejectable &= !bit(slot);
            self.down &= !bit(slot);
            self.up &= !bit(slot);
            self.ejected |= bit(slot);
            log::info!("PCI hot-plug: the guest ejected 00:{slot:02x}.0");
        }
        if slots != 0 {
            if let Some(wake) = &self.wake {
                let _ = wake.write(1);
            }
        }
    }
}

/// What a snapshot keeps of the register block: whether the guest enabled the interrupt
/// (a Linux guest's GED `_INI` does it once, at boot: a restored VM must keep it, or it
/// never hears of a device hot-plugged after the restore), the pending event, and the
/// arrivals the guest has not read yet (a device plugged just before the snapshot is
/// restored with it: the guest must still hear of it). Eject requests are not kept: a
/// snapshot is refused while a device is being ejected.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HotplugState {
    pub enabled: u32,
    pub events: u32,
    /// Absent in states written before it was kept.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub arrivals: u32,
}

fn is_zero(bits: &u32) -> bool {
    *bits == 0
}

impl Persist for HotplugController {
    type State = HotplugState;
    type Error = std::convert::Infallible;

    fn save(&self) -> Result<HotplugState, Self::Error> {
        Ok(HotplugState {
            enabled: self.enabled & 1,
            events: self.events & 1,
            arrivals: self.up,
        })
    }

    /// The interrupt controller's own state says whether an edge is still pending in the
    /// guest. Slot 0 (the host bridge) never arrives.
    fn restore(&mut self, state: &HotplugState) -> Result<(), Self::Error> {
        self.enabled = state.enabled & 1;
        self.events = state.events & 1;
        self.up = state.arrivals & !bit(0);
        Ok(())
    }
}

fn read_u32(data: &[u8]) -> u32 {
    let mut bytes = [0u8; 4];
    let n = data.len().min(4);
    bytes[..n].copy_from_slice(&data[..n]);
    u32::from_le_bytes(bytes)
}

impl BusDevice for HotplugController {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        let value = match offset {
            PCIU => std::mem::take(&mut self.up),
            PCID => std::mem::take(&mut self.down),
            EVTS => self.events,
            EVEN => self.enabled,
            _ => 0,
        };
        let bytes = value.to_le_bytes();
        let n = data.len().min(4);
        data[..n].copy_from_slice(&bytes[..n]);
        data[n..].fill(0);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let value = read_u32(data);
        match offset {
            B0EJ => self.eject(value),
            EVTS => self.events &= !value,
            EVEN => {
                self.enabled = value & 1;
                // An event that came while it was off is raised now.
                if self.enabled != 0 && self.events != 0 {
                    self.signal();
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pci::{HostBridge, PciRootConfig};
    use std::sync::Mutex;

    #[test]
    fn every_segments_register_block_has_ports_of_its_own() {
        // Segments 0..16 (arch's MAX_PCI_SEGMENTS): no two blocks share a port, and the
        // further segments' blocks stay below segment 0's.
        let blocks: Vec<(u16, u16)> = (0..16u16)
            .map(|segment| {
                (
                    hotplug_port(segment),
                    hotplug_port(segment) + HOTPLUG_PORT_LEN,
                )
            })
            .collect();
        assert_eq!(blocks[0].0, HOTPLUG_PORT);
        for (i, a) in blocks.iter().enumerate() {
            for b in &blocks[i + 1..] {
                assert!(a.1 <= b.0 || b.1 <= a.0, "{a:x?} and {b:x?} overlap");
            }
        }
        assert!(blocks[15].1 <= HOTPLUG_PORT);
    }

    fn root() -> Arc<PciRoot> {
        PciRoot::new(PciRootConfig {
            ecam_base: 0xe000_0000,
            buses: 1,
            mmio32_start: 0xc000_0000,
            mmio32_end: 0xe000_0000,
            mmio64_start: 1 << 36,
            mmio64_size: 1 << 36,
        })
        .unwrap()
    }

    fn read(c: &mut HotplugController, offset: u64) -> u32 {
        let mut data = [0u8; 4];
        c.read(offset, &mut data);
        u32::from_le_bytes(data)
    }

    #[test]
    fn plug_eject_and_read_clear() {
        let root = root();
        let slot = root
            .add_device(Arc::new(Mutex::new(HostBridge::new())))
            .unwrap()
            .device;
        let wake = EventFd::new(0).unwrap();
        let irq = EventFd::new(libc_nonblock()).unwrap();
        let mut c = HotplugController::new(root.clone(), Some(irq.try_clone().unwrap()));
        c.set_wake(wake.try_clone().unwrap());
        c.device_added(slot);
        assert!(
            irq.read().is_err(),
            "no interrupt until the guest enables it"
        );
        c.write(EVEN, &1u32.to_le_bytes());
        assert_eq!(
            irq.read().unwrap(),
            1,
            "the pending event is raised on enable"
        );
        assert_eq!(read(&mut c, EVTS), 1);
        c.write(EVTS, &1u32.to_le_bytes());
        assert_eq!(read(&mut c, EVTS), 0);
        assert_eq!(read(&mut c, PCIU), 1 << slot);
        assert_eq!(read(&mut c, PCIU), 0, "reading PCIU clears it");
        // Slot 0 (the host bridge) is not ejectable.
        c.write(B0EJ, &1u32.to_le_bytes());
        let mut ids = [0u8; 4];
        root.config_read(
            PciBdf {
                segment: 0,
                bus: 0,
                device: 0,
                function: 0,
            },
            0,
            &mut ids,
        );
        assert_ne!(ids, [0xff; 4]);
        c.request_eject(slot);
        assert_eq!(read(&mut c, PCID), 1 << slot);
        assert!(!c.take_ejected(slot));
        c.write(B0EJ, &(1u32 << slot).to_le_bytes());
        assert_eq!(wake.read().unwrap(), 1);
        root.config_read(
            PciBdf {
                segment: 0,
                bus: 0,
                device: slot,
                function: 0,
            },
            0,
            &mut ids,
        );
        assert_eq!(ids, [0xff; 4], "an ejected slot reads all ones");
        assert!(c.take_ejected(slot));
        assert!(!c.take_ejected(slot));
    }

    #[test]
    fn the_interrupt_enable_survives_save_and_restore() {
        let irq = EventFd::new(libc_nonblock()).unwrap();
        let mut saved = HotplugController::new(root(), None);
        saved.write(EVEN, &1u32.to_le_bytes());
        let state = saved.save().unwrap();
        assert_eq!(state.enabled, 1);
        let mut restored = HotplugController::new(root(), Some(irq.try_clone().unwrap()));
        restored.restore(&state).unwrap();
        assert_eq!(read(&mut restored, EVEN), 1);
        // A device plugged after the restore raises the GSI without a new _INI.
        restored.device_added(3);
        assert_eq!(irq.read().unwrap(), 1);
        let fresh = HotplugController::new(root(), None).save().unwrap();
        assert_eq!(fresh, HotplugState::default());
    }

    #[test]
    fn an_arrival_the_guest_has_not_read_survives_save_and_restore() {
        let mut saved = HotplugController::new(root(), None);
        saved.device_added(3);
        let state = saved.save().unwrap();
        let mut restored = HotplugController::new(root(), None);
        restored.restore(&state).unwrap();
        restored.device_restored(3);
        assert_eq!(
            read(&mut restored, PCIU),
            1 << 3,
            "the guest still hears of it"
        );
        // Once read, it is not saved again.
        assert_eq!(read(&mut saved, PCIU), 1 << 3);
        assert_eq!(saved.save().unwrap().arrivals, 0);
    }

    fn libc_nonblock() -> i32 {
        vmm_sys_util::eventfd::EFD_NONBLOCK
    }
}
