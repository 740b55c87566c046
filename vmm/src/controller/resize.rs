//! Cloud Hypervisor's vm.resize ([`VmmAction::Resize`]): the vCPU count changes by ACPI
//! hot-plug between 1 and the machine's `max_vcpus` (before start, the count to boot
//! with); guest RAM grows by ACPI memory hot-plug, in whole memory blocks, up to boot RAM
//! plus `memory.hotplug_size`, and shrinks by removing whole hot-plugged slots, newest
//! first: the answer waits for the guest's eject (an error after the memory eject timeout,
//! the VM keeping its RAM), as DELETE /gpus/{id} waits for a device's (before start,
//! `desired_ram` is the RAM to boot with).
//!
//! [`VmmAction::Resize`]: crate::action::VmmAction::Resize

use crate::action::{ActionError, ActionResult, VmmData};
use crate::machine::{MemoryResizeError, RamResize, RunningMachine};

use super::ApiController;

/// What Kata users can set to keep Kata from resizing the VM at all.
const KATA_STATIC: &str =
    "Kata Containers: set static_sandbox_resource_mgmt = true in configuration-clh.toml";

/// A memory size other than `current` (in bytes) is refused: a VM restored but not
/// resumed yet.
pub(super) fn check_ram(desired: Option<u64>, current: u64) -> Result<(), ActionError> {
    match desired {
        Some(ram) if ram != current => Err(ActionError::wrong_state(format!(
            "desired_ram = {ram}: resume the VM first (RAM is hot-plugged with the guest's help); it keeps its {current} bytes"
        ))),
        _ => Ok(()),
    }
}

/// RAM to boot with: anything but 0 in whole pages of the backing (the build checks the rest).
fn check_boot_ram(desired: u64, page_size: u64) -> Result<(), ActionError> {
    if desired == 0 {
        return Err(ActionError::bad_request("desired_ram = 0: a VM needs RAM"));
    }
    if !desired.is_multiple_of(page_size) {
        return Err(ActionError::bad_request(format!(
            "desired_ram = {desired} is not a multiple of the RAM's {page_size}-byte pages"
        )));
    }
    Ok(())
}

/// The error a RAM resize of the running VM answers with.
fn ram_error(desired: u64, error: MemoryResizeError) -> ActionError {
    let hint = if matches!(error, MemoryResizeError::NoHotplug { .. }) {
        format!(" ({KATA_STATIC})")
    } else {
        String::new()
    };
    ActionError {
        status: error.status(),
        message: format!("cannot resize the VM's RAM to {desired} bytes: {error}{hint}"),
    }
}

/// A vCPU count the VM cannot have (0, or above `max`) is refused.
pub(super) fn check_vcpus(desired: u8, max: u8) -> Result<(), ActionError> {
    if desired == 0 {
        return Err(ActionError::bad_request(
            "desired_vcpus = 0: a VM needs at least 1 vCPU",
        ));
    }
    if desired > max {
        return Err(ActionError::bad_request(format!(
            "desired_vcpus = {desired} is above the VM's max_vcpus = {max} (cpus.max_vcpus in vm.create)"
        )));
    }
    Ok(())
}

impl ApiController {
    /// Before start: the count to boot with (up to `max_vcpus`).
    pub(super) fn resize_pre_boot(
        &mut self,
        desired_vcpus: Option<u8>,
        desired_ram: Option<u64>,
    ) -> ActionResult {
        if let Some(ram) = desired_ram {
            check_boot_ram(ram, self.machine_config.backing.page_size())?;
        }
        if let Some(vcpus) = desired_vcpus {
            let max = self.pci.max_vcpus(&self.machine_config);
            check_vcpus(vcpus, max)?;
            self.machine_config.vcpus = vcpus;
            // The maximum stays what it was (it is at least the new count).
            self.pci.max_vcpus = max;
        }
        if let Some(ram) = desired_ram {
            self.machine_config.memory_size = ram;
        }
        Ok(VmmData::Empty)
    }
}

/// A restored VM that has not run yet: only a resize to what it has is accepted.
pub(super) fn resize_before_resume(
    machine: &crate::machine::Machine,
    desired_vcpus: Option<u8>,
    desired_ram: Option<u64>,
) -> ActionResult {
    check_ram(desired_ram, machine.ram_size())?;
    match desired_vcpus {
        Some(vcpus) if vcpus != machine.vcpu_count() => {
            check_vcpus(vcpus, machine.max_vcpus())?;
            Err(ActionError::wrong_state(
                "resume the VM first: vCPUs are hot-plugged with the guest's help",
            ))
        }
        _ => Ok(VmmData::Empty),
    }
}

/// The running VM: vCPUs are added (and the guest told) or the guest is asked to eject
/// the highest ones; RAM is hot-plugged (and the guest told), or the newest slots are
/// removed once the guest ejected them. Both are checked before either changes.
pub(super) fn resize_running(
    running: &mut RunningMachine<'_>,
    desired_vcpus: Option<u8>,
    desired_ram: Option<u64>,
) -> ActionResult {
    let ram_change = match desired_ram {
        Some(ram) => running
            .machine()
            .check_ram_resize(ram)
            .map_err(|error| ram_error(ram, error))?,
        None => RamResize::Unchanged,
    };
    if let Some(vcpus) = desired_vcpus {
        check_vcpus(vcpus, running.machine().max_vcpus())?;
    }
    let vcpus_change = desired_vcpus.filter(|&vcpus| vcpus != running.machine().vcpu_count());
    // A snapshot through the guest's agent is several steps (release, snapshot, give
    // back): the vCPUs and RAM it saw stay until it is done.
    let ram_change = ram_change != RamResize::Unchanged;
    if !running.devices_mut().released_gpus.is_empty() && (vcpus_change.is_some() || ram_change) {
        return Err(ActionError::wrong_state(
            "a snapshot that released GPUs is under way (they are not given back yet): resize once it is done",
        ));
    }
    if let Some(vcpus) = desired_vcpus {
        running.resize_vcpus(vcpus).map_err(|error| ActionError {
            status: error.status(),
            message: format!("cannot resize the VM to {vcpus} vCPU(s): {error}"),
        })?;
    }
    if let Some(ram) = desired_ram.filter(|_| ram_change) {
        running
            .resize_ram(ram)
            .map_err(|error| ram_error(ram, error))?;
    }
    Ok(VmmData::Empty)
}
