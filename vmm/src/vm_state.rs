//! The VM-wide state KVM holds: the in-kernel PIC, IOAPIC and PIT, and the guest clock.

use gpuvm_devices::Persist;
use kvm_bindings::{
    kvm_clock_data, kvm_irqchip, kvm_pit_state2, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER,
    KVM_IRQCHIP_PIC_SLAVE,
};
use kvm_ioctls::VmFd;
use serde::{Deserialize, Serialize};

use crate::persist::{exact_bytes, PersistError};

/// The VM's in-kernel devices and clock, as one snapshot component.
pub struct InKernelDevices<'a>(pub &'a VmFd);

/// The VM-wide in-kernel devices and clock.
#[derive(Serialize, Deserialize)]
/// KVM's structures are read back at exactly their size ([`exact_bytes`]).
pub struct VmState {
    #[serde(deserialize_with = "exact_bytes::deserialize")]
    pub pic_master: kvm_irqchip,
    #[serde(deserialize_with = "exact_bytes::deserialize")]
    pub pic_slave: kvm_irqchip,
    #[serde(deserialize_with = "exact_bytes::deserialize")]
    pub ioapic: kvm_irqchip,
    #[serde(deserialize_with = "exact_bytes::deserialize")]
    pub pit: kvm_pit_state2,
    #[serde(deserialize_with = "exact_bytes::deserialize")]
    pub clock: kvm_clock_data,
}

fn read_irqchip(vm: &VmFd, chip_id: u32) -> Result<kvm_irqchip, PersistError> {
    let mut chip = kvm_irqchip {
        chip_id,
        ..Default::default()
    };
    vm.get_irqchip(&mut chip)
        .map_err(|source| PersistError::Vm {
            what: "read the interrupt controller",
            source,
        })?;
    Ok(chip)
}

impl Persist for InKernelDevices<'_> {
    type State = VmState;
    type Error = PersistError;

    /// Captures the in-kernel PIC, IOAPIC, PIT and clock (vCPUs paused).
    fn save(&self) -> Result<VmState, PersistError> {
        let vm = self.0;
        let err = |what| move |source| PersistError::Vm { what, source };
        Ok(VmState {
            pic_master: read_irqchip(vm, KVM_IRQCHIP_PIC_MASTER)?,
            pic_slave: read_irqchip(vm, KVM_IRQCHIP_PIC_SLAVE)?,
            ioapic: read_irqchip(vm, KVM_IRQCHIP_IOAPIC)?,
            pit: vm.get_pit2().map_err(err("read the PIT"))?,
            clock: vm.get_clock().map_err(err("read the clock"))?,
        })
    }

    fn restore(&mut self, state: &VmState) -> Result<(), PersistError> {
        let vm = self.0;
        let err = |what| move |source| PersistError::Vm { what, source };
        vm.set_irqchip(&state.pic_master)
            .map_err(err("restore the PIC"))?;
        vm.set_irqchip(&state.pic_slave)
            .map_err(err("restore the PIC"))?;
        vm.set_irqchip(&state.ioapic)
            .map_err(err("restore the IOAPIC"))?;
        vm.set_pit2(&state.pit).map_err(err("restore the PIT"))?;
        // Only the clock value: the flags describe the source host's clock.
        let clock = kvm_clock_data {
            clock: state.clock.clock,
            ..Default::default()
        };
        vm.set_clock(&clock).map_err(err("restore the clock"))?;
        Ok(())
    }
}
