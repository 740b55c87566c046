//! ACPI CPU hot-plug, as Cloud Hypervisor's and QEMU's: a small port-I/O register block
//! that the DSDT's CPU devices (arch/src/x86_64/acpi/cpus.rs) read and write, and the
//! Generic Event Device's interrupt that tells the guest to look.
//!
//! ```text
//! port CPU_HOTPLUG_PORT + 0x00  CSEL  (r/w, 32 bits)  the CPU (ACPI _UID = APIC id = vCPU id)
//!                                                     the flags below refer to
//!                       + 0x04  flags (8 bits):
//!                               bit 0 CPEN (r)        the CPU is present (`_STA`)
//!                               bit 1 CINS (r/w1c)    it was inserted: the guest is to bring it up
//!                               bit 2 CRMV (r/w1c)    the VMM asks the guest to eject it
//!                               bit 3 CEJ0 (w)        the guest ejects it (`_EJ0`): it leaves
//!                       + 0x08  CEVN  (r/w, bit 0)    raise HOTPLUG_GSI for events (the GED's
//!                                                     _INI sets it, like the PCI block's EVEN)
//! ```
//!
//! The VMM creates a vCPU and calls [`CpuHotplug::insert`]; the guest's `CSCN` method (run
//! by the GED's `_EVT`, or the test guest polling from ring 3) finds CINS, clears it and
//! notifies the CPU's device (device check), then starts the CPU with INIT/SIPI. To take a
//! CPU away the VMM calls [`CpuHotplug::request_remove`]; the guest offlines it and writes
//! CEJ0, which marks it not present at once and wakes the VMM, which parks its vCPU
//! ([`CpuHotplug::take_ejected`]). CPU 0 can never be ejected.

use serde::{Deserialize, Serialize};
use vmm_sys_util::eventfd::EventFd;

use crate::{BusDevice, Persist};

/// First port of the register block (QEMU's ACPI CPU hot-plug block sits at the same
/// base on its PC machines; gpuvm's PCI hot-plug block is at 0xae00).
pub const CPU_HOTPLUG_PORT: u16 = 0xaf00;
/// Bytes of the register block.
pub const CPU_HOTPLUG_PORT_LEN: u16 = 0x0c;
/// Register offsets.
pub const CSEL: u64 = 0x00;
pub const FLAGS: u64 = 0x04;
pub const CEVN: u64 = 0x08;
/// Bits of the flags register.
pub const CPEN: u8 = 1 << 0;
pub const CINS: u8 = 1 << 1;
pub const CRMV: u8 = 1 << 2;
pub const CEJ0: u8 = 1 << 3;

/// One bit per possible CPU (APIC ids are 8 bits).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct CpuSet([u64; 4]);

impl CpuSet {
    fn has(&self, cpu: u8) -> bool {
        self.0[usize::from(cpu / 64)] & (1 << (cpu % 64)) != 0
    }

    fn set(&mut self, cpu: u8, on: bool) {
        let word = &mut self.0[usize::from(cpu / 64)];
        if on {
            *word |= 1 << (cpu % 64);
        } else {
            *word &= !(1 << (cpu % 64));
        }
    }

    fn ids(&self) -> Vec<u8> {
        (0..=u8::MAX).filter(|&cpu| self.has(cpu)).collect()
    }

    fn of(ids: &[u8]) -> CpuSet {
        let mut set = CpuSet::default();
        for &cpu in ids {
            set.set(cpu, true);
        }
        set
    }
}

/// The register block. Shared between the port-I/O bus (vCPU threads) and the VMM thread.
pub struct CpuHotplug {
    /// CPUs 0..max_vcpus are possible; the others read as absent and ignore writes.
    max_vcpus: u8,
    selected: u32,
    present: CpuSet,
    inserting: CpuSet,
    removing: CpuSet,
    /// CPUs the guest ejected that the VMM has not parked yet.
    ejected: CpuSet,
    /// Whether the guest enabled the interrupt (bit 0 of CEVN).
    enabled: bool,
    /// An irqfd on the GED's GSI, if wired.
    interrupt: Option<EventFd>,
    /// Written when the guest ejects a CPU, so the VMM thread looks.
    wake: Option<EventFd>,
}

impl CpuHotplug {
    /// CPUs `0..boot_vcpus` present (the guest knows them from the MADT), up to
    /// `max_vcpus` possible.
    pub fn new(boot_vcpus: u8, max_vcpus: u8, interrupt: Option<EventFd>) -> Self {
        let mut present = CpuSet::default();
        for cpu in 0..boot_vcpus.min(max_vcpus) {
            present.set(cpu, true);
        }
        CpuHotplug {
            max_vcpus,
            selected: 0,
            present,
            inserting: CpuSet::default(),
            removing: CpuSet::default(),
            ejected: CpuSet::default(),
            enabled: false,
            interrupt,
            wake: None,
        }
    }

    /// Where to signal ejects (the VMM thread's wake-up eventfd).
    pub fn set_wake(&mut self, wake: EventFd) {
        self.wake = Some(wake);
    }

    pub fn max_vcpus(&self) -> u8 {
        self.max_vcpus
    }

    /// The CPUs the guest has (inserted and not ejected), ascending.
    pub fn present(&self) -> Vec<u8> {
        self.present.ids()
    }

    /// The present CPUs the guest was asked to eject and has not yet.
    pub fn removing(&self) -> Vec<u8> {
        self.removing.ids()
    }

    fn signal(&mut self) {
        if !self.enabled {
            return;
        }
        if let Some(interrupt) = &self.interrupt {
            if let Err(error) = interrupt.write(1) {
                log::warn!("CPU hot-plug: cannot raise the GED interrupt: {error}");
            }
        }
    }

    /// CPU `cpu`'s vCPU exists now: tell the guest. False if it is not a possible CPU.
    pub fn insert(&mut self, cpu: u8) -> bool {
        if cpu >= self.max_vcpus {
            return false;
        }
        self.present.set(cpu, true);
        self.inserting.set(cpu, true);
        self.removing.set(cpu, false);
        self.ejected.set(cpu, false);
        self.signal();
        true
    }

    /// Asks the guest to offline and eject `cpu` (a present CPU other than 0).
    pub fn request_remove(&mut self, cpu: u8) -> bool {
        if cpu == 0 || !self.present.has(cpu) {
            return false;
        }
        self.removing.set(cpu, true);
        self.inserting.set(cpu, false);
        self.signal();
        true
    }

    /// Withdraws an eject request the guest did not act on (the CPU stays).
    pub fn cancel_remove(&mut self, cpu: u8) {
        self.removing.set(cpu, false);
    }

    /// The CPUs the guest ejected since the last call.
    pub fn take_ejected(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.ejected).ids()
    }

    fn selected_cpu(&self) -> Option<u8> {
        u8::try_from(self.selected)
            .ok()
            .filter(|&cpu| cpu < self.max_vcpus)
    }

    fn flags(&self) -> u8 {
        let Some(cpu) = self.selected_cpu() else {
            return 0;
        };
        let mut flags = 0;
        if self.present.has(cpu) {
            flags |= CPEN;
        }
        if self.inserting.has(cpu) {
            flags |= CINS;
        }
        if self.removing.has(cpu) {
            flags |= CRMV;
        }
        flags
    }

    fn write_flags(&mut self, value: u8) {
        let Some(cpu) = self.selected_cpu() else {
            return;
        };
        if value & CINS != 0 {
            self.inserting.set(cpu, false);
        }
        if value & CRMV != 0 {
            self.removing.set(cpu, false);
        }
        if value & CEJ0 != 0 && cpu != 0 && self.present.has(cpu) {
            self.present.set(cpu, false);
            self.inserting.set(cpu, false);
            self.removing.set(cpu, false);
            self.ejected.set(cpu, true);
            log::info!("CPU hot-plug: the guest ejected CPU {cpu}");
            if let Some(wake) = &self.wake {
                let _ = wake.write(1);
            }
        }
    }
}

impl BusDevice for CpuHotplug {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        let value: u32 = match offset {
            CSEL => self.selected,
            FLAGS => u32::from(self.flags()),
            CEVN => u32::from(self.enabled),
            _ => 0,
        };
        let bytes = value.to_le_bytes();
        for (index, byte) in data.iter_mut().enumerate() {
            *byte = bytes.get(index).copied().unwrap_or(0);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let mut bytes = [0u8; 4];
        for (slot, byte) in bytes.iter_mut().zip(data) {
            *slot = *byte;
        }
        let value = u32::from_le_bytes(bytes);
        match offset {
            CSEL if !data.is_empty() => self.selected = value,
            FLAGS if !data.is_empty() => self.write_flags(bytes[0]),
            CEVN if !data.is_empty() => self.enabled = value & 1 != 0,
            _ => {}
        }
    }
}

/// What a snapshot keeps of the register block: the possible and present CPUs (a restore
/// creates the vCPUs of the present ones and keeps threads for the rest), the events the
/// guest has not taken yet, the selector and whether the guest enabled the interrupt.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpuHotplugState {
    pub max_vcpus: u8,
    pub present: Vec<u8>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub inserting: Vec<u8>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub removing: Vec<u8>,
    #[serde(default)]
    pub selected: u32,
    #[serde(default)]
    pub enabled: bool,
}

/// A saved state this block cannot take.
#[derive(Debug, thiserror::Error)]
pub enum CpuHotplugStateError {
    #[error(
        "the snapshot's CPU hot-plug block has {saved} possible CPUs, the restored VM {built}"
    )]
    MaxVcpus { saved: u8, built: u8 },
    #[error("the snapshot's CPU hot-plug block lists CPU {0}, beyond its possible CPUs")]
    Cpu(u8),
}

impl Persist for CpuHotplug {
    type State = CpuHotplugState;
    type Error = CpuHotplugStateError;

    fn save(&self) -> Result<CpuHotplugState, Self::Error> {
        Ok(CpuHotplugState {
            max_vcpus: self.max_vcpus,
            present: self.present.ids(),
            inserting: self.inserting.ids(),
            removing: self.removing.ids(),
            selected: self.selected,
            enabled: self.enabled,
        })
    }

    fn restore(&mut self, state: &CpuHotplugState) -> Result<(), Self::Error> {
        if state.max_vcpus != self.max_vcpus {
            return Err(CpuHotplugStateError::MaxVcpus {
                saved: state.max_vcpus,
                built: self.max_vcpus,
            });
        }
        let lists = [&state.present, &state.inserting, &state.removing];
        if let Some(&cpu) = lists
            .iter()
            .flat_map(|ids| ids.iter())
            .find(|&&cpu| cpu >= self.max_vcpus)
        {
            return Err(CpuHotplugStateError::Cpu(cpu));
        }
        self.present = CpuSet::of(&state.present);
        self.inserting = CpuSet::of(&state.inserting);
        self.removing = CpuSet::of(&state.removing);
        self.ejected = CpuSet::default();
        self.selected = state.selected;
        self.enabled = state.enabled;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn select(block: &mut CpuHotplug, cpu: u32) -> u8 {
        block.write(CSEL, &cpu.to_le_bytes());
        let mut flags = [0u8];
        block.read(FLAGS, &mut flags);
        flags[0]
    }

    #[test]
    fn insert_is_seen_once_and_eject_parks_the_cpu() {
        let interrupt = EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK).unwrap();
        let wake = EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK).unwrap();
        let mut block = CpuHotplug::new(1, 4, Some(interrupt.try_clone().unwrap()));
        block.set_wake(wake.try_clone().unwrap());
        assert_eq!(select(&mut block, 0), CPEN);
        assert_eq!(select(&mut block, 1), 0);
        // No interrupt before the guest enables it; the event waits in CINS.
        assert!(block.insert(1));
        assert!(interrupt.read().is_err());
        block.write(CEVN, &[1]);
        assert!(block.insert(2));
        assert_eq!(interrupt.read().unwrap(), 1);
        assert_eq!(select(&mut block, 1), CPEN | CINS);
        block.write(FLAGS, &[CINS]);
        assert_eq!(select(&mut block, 1), CPEN);
        assert_eq!(block.present(), [0, 1, 2]);
        // Not possible: beyond max_vcpus, or a selector past it.
        assert!(!block.insert(4));
        assert_eq!(select(&mut block, 7), 0);
        assert_eq!(select(&mut block, 0x100), 0);

        assert!(block.request_remove(2));
        assert!(!block.request_remove(0));
        assert!(!block.request_remove(3));
        assert_eq!(select(&mut block, 2), CPEN | CRMV);
        block.write(FLAGS, &[CRMV]);
        assert_eq!(block.removing(), Vec::<u8>::new());
        block.write(FLAGS, &[CEJ0]);
        assert_eq!(select(&mut block, 2), 0);
        assert_eq!(wake.read().unwrap(), 1);
        assert_eq!(block.take_ejected(), [2]);
        assert!(block.take_ejected().is_empty());
        // CPU 0 stays whatever the guest writes.
        select(&mut block, 0);
        block.write(FLAGS, &[CEJ0]);
        assert_eq!(block.present(), [0, 1]);
    }

    #[test]
    fn odd_accesses_are_harmless() {
        let mut block = CpuHotplug::new(2, 2, None);
        block.write(CSEL, &[]);
        block.write(0x0b, &[0xff; 8]);
        let mut wide = [0xaau8; 8];
        block.read(CSEL, &mut wide);
        assert_eq!(wide, [0; 8]);
        let mut none = [0u8; 0];
        block.read(FLAGS, &mut none);
        block.read(0x40, &mut wide);
        assert_eq!(block.present(), [0, 1]);
    }

    #[test]
    fn state_round_trips_and_checks_the_possible_cpus() {
        let mut block = CpuHotplug::new(1, 4, None);
        block.write(CEVN, &[1]);
        block.insert(3);
        block.request_remove(3);
        let state = block.save().unwrap();
        assert_eq!(state.present, [0, 3]);
        assert_eq!(state.removing, [3]);
        let mut fresh = CpuHotplug::new(1, 4, None);
        fresh.restore(&state).unwrap();
        assert_eq!(fresh.save().unwrap(), state);
        let mut smaller = CpuHotplug::new(1, 2, None);
        assert!(smaller.restore(&state).is_err());
        let bad = CpuHotplugState {
            present: vec![0, 9],
            ..state
        };
        assert!(fresh.restore(&bad).is_err());
        assert_eq!(fresh.present(), [0, 3]);
    }
}
