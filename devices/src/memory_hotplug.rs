//! ACPI memory hot-plug: a port-I/O register block modelled on QEMU's ACPI memory hot-plug
//! interface (its docs/specs/acpi_mem_hotplug.rst), which the DSDT's memory devices
//! (arch/src/x86_64/acpi/memory.rs, `PNP0C80`) read and write, and the Generic Event
//! Device's interrupt that tells the guest to look.
//!
//! ```text
//! port MEMORY_HOTPLUG_PORT + 0x00  read: MBAS low 32 bits of the slot's base address
//!                                  write: MSEL, the slot the other registers refer to
//!                          + 0x04  read: MBAS high 32 bits      write: MOEV, _OST event
//!                          + 0x08  read: MLEN low 32 bits       write: MOSC, _OST status
//!                          + 0x0c  read: MLEN high 32 bits
//!                          + 0x10  read: proximity domain (0)
//!                          + 0x14  flags (8 bits):
//!                                  bit 0 MEN  (r)      the slot holds RAM (`_STA`)
//!                                  bit 1 MINS (r/w1c)  it was inserted: the guest is to add it
//!                                  bit 2 MRMV (r/w1c)  the VMM asks the guest to eject it
//!                                  bit 3 MEJ  (w)      the guest ejects it (`_EJ0`)
//!                          + 0x18  MEVN (r/w, bit 0)   raise the GED's GSI for events
//!                          + 0x1c  MSLT (r)            how many slots there are
//! ```
//!
//! A slot holds one hot-plugged RAM range of any size that is a multiple of
//! [`MEMORY_BLOCK_SIZE`], so the DSDT has a fixed, small number of devices whatever the
//! hot-plug size (Cloud Hypervisor's ACPI memory hot-plug also fills one device per
//! resize). The VMM maps the RAM (KVM memslot, DMA) first, then calls
//! [`MemoryHotplug::insert`]; the guest's `MSCN` (run by the GED's `_EVT`, or the test
//! guest polling from ring 3) finds MINS, clears it and notifies the device, whose `_CRS`
//! reads MBAS and MLEN. Removal is the reverse: [`MemoryHotplug::request_remove`] sets MRMV
//! and raises the interrupt, the guest offlines the range and writes MEJ (`_EJ0`), and the
//! slot keeps its base and size until the VMM freed the RAM
//! ([`MemoryHotplug::release_ejected`]), so it is not filled again before that.

use serde::{Deserialize, Serialize};
use vmm_sys_util::eventfd::EventFd;

use crate::{BusDevice, Persist};

/// First port of the register block: right after the CPU hot-plug block (0xaf00..0xaf0c).
pub const MEMORY_HOTPLUG_PORT: u16 = 0xaf10;
/// Bytes of the register block.
pub const MEMORY_HOTPLUG_PORT_LEN: u16 = 0x20;
/// Register offsets.
pub const MBAS_LO: u64 = 0x00;
pub const MSEL: u64 = 0x00;
pub const MBAS_HI: u64 = 0x04;
pub const MOEV: u64 = 0x04;
pub const MLEN_LO: u64 = 0x08;
pub const MOSC: u64 = 0x08;
pub const MLEN_HI: u64 = 0x0c;
pub const MPXM: u64 = 0x10;
pub const FLAGS: u64 = 0x14;
pub const MEVN: u64 = 0x18;
pub const MSLT: u64 = 0x1c;
/// Bits of the flags register.
pub const MEN: u8 = 1 << 0;
pub const MINS: u8 = 1 << 1;
pub const MRMV: u8 = 1 << 2;
pub const MEJ: u8 = 1 << 3;

/// `_OST` source event of an eject request (the `Notify (MPnn, 3)` of a remove event).
pub const OST_EJECT_REQUEST: u32 = 3;
/// `_OST` status for an eject request: the eject is under way (Linux reports it before it
/// offlines the range; the eject itself follows).
pub const OST_EJECT_IN_PROGRESS: u32 = 0x84;

/// What an `_OST` status code means (ACPI 6.5, 6.3.5 `_OST`; 0x80.. for eject requests).
pub fn ost_status_meaning(status: u32) -> &'static str {
    match status {
        0 => "success",
        1 => "non-specific failure",
        2 => "unrecognized notify",
        0x80 => "ejection not supported by the OS",
        0x81 => "device in use",
        0x82 => "device busy",
        0x83 => "ejection dependency busy",
        OST_EJECT_IN_PROGRESS => "ejection in progress",
        _ => "unknown status",
    }
}

/// Hot-plugged RAM comes in multiples of this, at addresses aligned to it: Linux's memory
/// block size on x86_64 (one sparsemem section, 128 MiB, for machines below 64 GiB). Linux
/// onlines and offlines whole blocks, so a range that is not made of whole blocks leaves
/// part of a block unusable (and it refuses ranges not aligned to one).
pub const MEMORY_BLOCK_SIZE: u64 = 128 << 20;

/// How many memory devices (slots) the DSDT has. Each successful resize that grows RAM
/// takes one. KVM memory slots 2..16 (below the BAR slots, after boot RAM's two) are
/// theirs, so the count fits there.
pub const MEMORY_HOTPLUG_SLOTS: u8 = 14;

/// One slot's RAM, as the guest sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemorySlot {
    pub base: u64,
    pub size: u64,
    /// The guest has it (inserted and not ejected).
    pub present: bool,
    /// The guest has not taken the insert event yet.
    #[serde(default)]
    pub inserting: bool,
    /// The guest was asked to eject it.
    #[serde(default)]
    pub removing: bool,
}

/// The register block. Shared between the port-I/O bus (vCPU threads) and the VMM thread.
pub struct MemoryHotplug {
    slots: Vec<MemorySlot>,
    selected: u32,
    /// Slots the guest ejected that the VMM has not freed yet.
    ejected: Vec<u8>,
    enabled: bool,
    /// The last `_OST` the guest reported: (slot, event, status).
    last_ost: Option<(u32, u32, u32)>,
    ost_event: u32,
    interrupt: Option<EventFd>,
    wake: Option<EventFd>,
}

impl MemoryHotplug {
    /// [`MEMORY_HOTPLUG_SLOTS`] empty slots.
    pub fn new(interrupt: Option<EventFd>) -> Self {
        MemoryHotplug {
            slots: vec![MemorySlot::default(); usize::from(MEMORY_HOTPLUG_SLOTS)],
            selected: 0,
            ejected: Vec::new(),
            enabled: false,
            last_ost: None,
            ost_event: 0,
            interrupt,
            wake: None,
        }
    }

    /// Where to signal ejects (the VMM thread's wake-up eventfd).
    pub fn set_wake(&mut self, wake: EventFd) {
        self.wake = Some(wake);
    }

    /// Every slot, in order.
    pub fn slots(&self) -> &[MemorySlot] {
        &self.slots
    }

    /// The first slot with no RAM, if any.
    pub fn free_slot(&self) -> Option<u8> {
        self.slots
            .iter()
            .position(|slot| !slot.present && slot.size == 0)
            .and_then(|index| u8::try_from(index).ok())
    }

    /// Bytes of RAM the guest has in slots.
    pub fn plugged_bytes(&self) -> u64 {
        self.slots
            .iter()
            .filter(|slot| slot.present)
            .map(|slot| slot.size)
            .sum()
    }

    /// The last `_OST` evaluation the guest reported: (slot, event, status).
    pub fn last_ost(&self) -> Option<(u32, u32, u32)> {
        self.last_ost
    }

    fn signal(&mut self) {
        if !self.enabled {
            return;
        }
        if let Some(interrupt) = &self.interrupt {
            if let Err(error) = interrupt.write(1) {
                log::warn!("memory hot-plug: cannot raise the GED interrupt: {error}");
            }
        }
    }

    /// Slot `slot` holds RAM at `[base, base + size)` now, mapped for KVM and devices: tell
    /// the guest. False if there is no such free slot.
    pub fn insert(&mut self, slot: u8, base: u64, size: u64) -> bool {
        let Some(entry) = self.slots.get_mut(usize::from(slot)) else {
            return false;
        };
        if entry.present || entry.size != 0 || size == 0 {
            return false;
        }
        *entry = MemorySlot {
            base,
            size,
            present: true,
            inserting: true,
            removing: false,
        };
        self.signal();
        true
    }

    /// The slots the guest ejected whose RAM the VMM has not freed yet.
    pub fn ejected_slots(&self) -> Vec<u8> {
        self.ejected.clone()
    }

    /// The VMM freed the RAM of ejected slot `slot`: the slot may be filled again. False
    /// if the guest had not ejected it.
    pub fn release_ejected(&mut self, slot: u8) -> bool {
        let Some(at) = self.ejected.iter().position(|&ejected| ejected == slot) else {
            return false;
        };
        self.ejected.remove(at);
        if let Some(entry) = self.slots.get_mut(usize::from(slot)) {
            *entry = MemorySlot::default();
        }
        true
    }

    /// Whether the guest ejected slot `slot` and the VMM has not freed its RAM yet.
    pub fn is_ejected(&self, slot: u8) -> bool {
        self.ejected.contains(&slot)
    }

    /// Whether the guest was asked to eject some slot and has not yet.
    pub fn removal_pending(&self) -> bool {
        self.slots.iter().any(|slot| slot.removing)
    }

    /// Withdraws the eject request for slot `slot` (the guest did not eject it in time):
    /// the slot keeps its RAM.
    pub fn cancel_remove(&mut self, slot: u8) {
        if let Some(entry) = self.slots.get_mut(usize::from(slot)) {
            entry.removing = false;
        }
    }

    /// Asks the guest to eject slot `slot` (one that holds RAM).
    pub fn request_remove(&mut self, slot: u8) -> bool {
        let Some(entry) = self.slots.get_mut(usize::from(slot)) else {
            return false;
        };
        if !entry.present {
            return false;
        }
        entry.removing = true;
        entry.inserting = false;
        self.signal();
        true
    }

    fn selected_slot(&self) -> Option<&MemorySlot> {
        usize::try_from(self.selected)
            .ok()
            .and_then(|index| self.slots.get(index))
    }

    fn flags(&self) -> u8 {
        let Some(slot) = self.selected_slot() else {
            return 0;
        };
        let mut flags = 0;
        if slot.present {
            flags |= MEN;
        }
        if slot.inserting {
            flags |= MINS;
        }
        if slot.removing {
            flags |= MRMV;
        }
        flags
    }

    fn write_flags(&mut self, value: u8) {
        let selected = self.selected;
        let Some(slot) = usize::try_from(selected)
            .ok()
            .and_then(|index| self.slots.get_mut(index))
        else {
            return;
        };
        if value & MINS != 0 {
            slot.inserting = false;
        }
        if value & MRMV != 0 {
            slot.removing = false;
        }
        if value & MEJ != 0 && slot.present {
            slot.present = false;
            slot.inserting = false;
            slot.removing = false;
            // The slot's base and size stay until the VMM frees its RAM (take_ejected), so
            // it is not handed out again before that.
            if let Ok(index) = u8::try_from(selected) {
                self.ejected.push(index);
            }
            log::info!("memory hot-plug: the guest ejected slot {selected}");
            if let Some(wake) = &self.wake {
                let _ = wake.write(1);
            }
        }
    }
}

impl BusDevice for MemoryHotplug {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        let slot = self.selected_slot().copied().unwrap_or_default();
        // Fields of an absent slot read as 0 (QEMU's do too).
        let (base, size) = if slot.present {
            (slot.base, slot.size)
        } else {
            (0, 0)
        };
        let value: u32 = match offset {
            MBAS_LO => base as u32,
            MBAS_HI => (base >> 32) as u32,
            MLEN_LO => size as u32,
            MLEN_HI => (size >> 32) as u32,
            MPXM => 0,
            FLAGS => u32::from(self.flags()),
            MEVN => u32::from(self.enabled),
            MSLT => u32::from(MEMORY_HOTPLUG_SLOTS),
            _ => 0,
        };
        let bytes = value.to_le_bytes();
        for (index, byte) in data.iter_mut().enumerate() {
            *byte = bytes.get(index).copied().unwrap_or(0);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if data.is_empty() {
            return;
        }
        let mut bytes = [0u8; 4];
        for (slot, byte) in bytes.iter_mut().zip(data) {
            *slot = *byte;
        }
        let value = u32::from_le_bytes(bytes);
        match offset {
            MSEL => self.selected = value,
            MOEV => self.ost_event = value,
            MOSC => {
                self.last_ost = Some((self.selected, self.ost_event, value));
                let meaning = ost_status_meaning(value);
                let (event, slot) = (self.ost_event, self.selected);
                if value == 0 || (event == OST_EJECT_REQUEST && value == OST_EJECT_IN_PROGRESS) {
                    log::info!(
                        "memory hot-plug: the guest reports _OST {value:#x} ({meaning}) for event {event:#x} on slot {slot}"
                    );
                } else {
                    log::warn!(
                        "memory hot-plug: the guest reports _OST {value:#x} ({meaning}) for event {event:#x} on slot {slot}"
                    );
                }
            }
            FLAGS => self.write_flags(bytes[0]),
            MEVN => self.enabled = value & 1 != 0,
            _ => {}
        }
    }
}

/// What a snapshot keeps of the register block: every slot, the selector and whether the
/// guest enabled the interrupt.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryHotplugState {
    pub slots: Vec<MemorySlot>,
    #[serde(default)]
    pub selected: u32,
    #[serde(default)]
    pub enabled: bool,
}

/// A saved state this block cannot take.
#[derive(Debug, thiserror::Error)]
pub enum MemoryHotplugStateError {
    #[error("the snapshot's memory hot-plug block has {saved} slots, this VM's {built}")]
    SlotCount { saved: usize, built: usize },
    #[error(
        "the snapshot's memory hot-plug slot {slot} ({base:#x}, {size:#x} bytes) is not made \
         of whole {MEMORY_BLOCK_SIZE}-byte blocks"
    )]
    Slot { slot: usize, base: u64, size: u64 },
}

impl Persist for MemoryHotplug {
    type State = MemoryHotplugState;
    type Error = MemoryHotplugStateError;

    fn save(&self) -> Result<MemoryHotplugState, Self::Error> {
        Ok(MemoryHotplugState {
            slots: self.slots.clone(),
            selected: self.selected,
            enabled: self.enabled,
        })
    }

    fn restore(&mut self, state: &MemoryHotplugState) -> Result<(), Self::Error> {
        if state.slots.len() != self.slots.len() {
            return Err(MemoryHotplugStateError::SlotCount {
                saved: state.slots.len(),
                built: self.slots.len(),
            });
        }
        if let Some((slot, bad)) = state.slots.iter().enumerate().find(|(_, s)| {
            !s.base.is_multiple_of(MEMORY_BLOCK_SIZE) || !s.size.is_multiple_of(MEMORY_BLOCK_SIZE)
        }) {
            return Err(MemoryHotplugStateError::Slot {
                slot,
                base: bad.base,
                size: bad.size,
            });
        }
        self.slots = state.slots.clone();
        self.ejected.clear();
        self.selected = state.selected;
        self.enabled = state.enabled;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn read32(block: &mut MemoryHotplug, offset: u64) -> u32 {
        let mut bytes = [0u8; 4];
        block.read(offset, &mut bytes);
        u32::from_le_bytes(bytes)
    }

    fn select(block: &mut MemoryHotplug, slot: u32) -> u8 {
        block.write(MSEL, &slot.to_le_bytes());
        read32(block, FLAGS) as u8
    }

    #[test]
    fn insert_shows_base_and_size_and_the_event_is_taken_once() {
        let interrupt = EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK).unwrap();
        let mut block = MemoryHotplug::new(Some(interrupt.try_clone().unwrap()));
        assert_eq!(read32(&mut block, MSLT), u32::from(MEMORY_HOTPLUG_SLOTS));
        assert_eq!(select(&mut block, 0), 0);
        assert_eq!(block.free_slot(), Some(0));
        // No interrupt before the guest enables it; the event waits in MINS.
        let base = 5 * GIB + (3 << 27);
        assert!(block.insert(0, base, 2 * MEMORY_BLOCK_SIZE));
        assert!(interrupt.read().is_err());
        assert!(!block.insert(0, 6 * GIB, MEMORY_BLOCK_SIZE), "slot taken");
        block.write(MEVN, &[1]);
        assert_eq!(read32(&mut block, MEVN), 1);
        assert!(block.insert(1, 6 * GIB, MEMORY_BLOCK_SIZE));
        assert_eq!(interrupt.read().unwrap(), 1);
        assert_eq!(select(&mut block, 0), MEN | MINS);
        assert_eq!(read32(&mut block, MBAS_LO), base as u32);
        assert_eq!(read32(&mut block, MBAS_HI), (base >> 32) as u32);
        assert_eq!(read32(&mut block, MLEN_LO), (2 * MEMORY_BLOCK_SIZE) as u32);
        assert_eq!(read32(&mut block, MLEN_HI), 0);
        block.write(FLAGS, &[MINS]);
        assert_eq!(select(&mut block, 0), MEN);
        assert_eq!(block.plugged_bytes(), 3 * MEMORY_BLOCK_SIZE);
        assert_eq!(block.free_slot(), Some(2));
        // _OST is recorded.
        block.write(MOEV, &1u32.to_le_bytes());
        block.write(MOSC, &0u32.to_le_bytes());
        assert_eq!(block.last_ost(), Some((0, 1, 0)));
        assert_eq!(ost_status_meaning(0x81), "device in use");
        assert_eq!(ost_status_meaning(0x84), "ejection in progress");
        // Beyond the slots: nothing.
        assert!(!block.insert(MEMORY_HOTPLUG_SLOTS, 7 * GIB, MEMORY_BLOCK_SIZE));
        assert!(!block.insert(2, 7 * GIB, 0));
        assert_eq!(select(&mut block, u32::from(MEMORY_HOTPLUG_SLOTS)), 0);
        assert_eq!(read32(&mut block, MLEN_LO), 0);
    }

    #[test]
    fn eject_frees_the_slot_only_once_the_vmm_took_it() {
        let wake = EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK).unwrap();
        let mut block = MemoryHotplug::new(None);
        block.set_wake(wake.try_clone().unwrap());
        assert!(block.insert(0, 4 * GIB, MEMORY_BLOCK_SIZE));
        assert!(!block.request_remove(1));
        assert!(block.request_remove(0));
        assert!(block.removal_pending());
        assert_eq!(select(&mut block, 0), MEN | MRMV);
        // Withdrawn, then asked again.
        block.cancel_remove(0);
        assert!(!block.removal_pending());
        assert_eq!(select(&mut block, 0), MEN);
        assert!(block.request_remove(0));
        assert!(!block.is_ejected(0));
        block.write(FLAGS, &[MEJ]);
        assert!(block.is_ejected(0));
        assert!(!block.removal_pending());
        assert_eq!(select(&mut block, 0), 0);
        assert_eq!(wake.read().unwrap(), 1);
        // Not free again before the VMM freed its RAM.
        assert_eq!(block.free_slot(), Some(1));
        assert_eq!(block.ejected_slots(), [0]);
        assert!(!block.release_ejected(1));
        assert!(block.release_ejected(0));
        assert_eq!(block.free_slot(), Some(0));
        assert!(block.ejected_slots().is_empty());
        assert!(!block.release_ejected(0));
        assert_eq!(block.plugged_bytes(), 0);
    }

    #[test]
    fn odd_accesses_are_harmless() {
        let mut block = MemoryHotplug::new(None);
        block.write(MSEL, &[]);
        block.write(0x1f, &[0xff; 8]);
        block.write(0x40, &[1, 2, 3, 4]);
        let mut wide = [0xaau8; 8];
        block.read(MBAS_LO, &mut wide);
        assert_eq!(wide, [0; 8]);
        let mut none = [0u8; 0];
        block.read(FLAGS, &mut none);
        block.read(0x40, &mut wide);
        block.write(MSEL, &[0xff, 0xff, 0xff, 0xff]);
        block.write(FLAGS, &[MEJ | MINS | MRMV]);
        assert_eq!(block.plugged_bytes(), 0);
        assert!(block.ejected_slots().is_empty());
    }

    #[test]
    fn state_round_trips_and_bad_slots_are_refused() {
        let mut block = MemoryHotplug::new(None);
        block.write(MEVN, &[1]);
        block.insert(0, 4 * GIB, 2 * MEMORY_BLOCK_SIZE);
        let state = block.save().unwrap();
        let mut fresh = MemoryHotplug::new(None);
        fresh.restore(&state).unwrap();
        assert_eq!(fresh.save().unwrap(), state);
        assert_eq!(fresh.plugged_bytes(), 2 * MEMORY_BLOCK_SIZE);
        let mut short = state.clone();
        short.slots.pop();
        assert!(fresh.restore(&short).is_err());
        let mut odd = state.clone();
        odd.slots[1] = MemorySlot {
            base: 4 * GIB + 4096,
            size: MEMORY_BLOCK_SIZE,
            present: true,
            ..Default::default()
        };
        assert!(fresh.restore(&odd).is_err());
        assert_eq!(fresh.save().unwrap(), state);
    }
}
