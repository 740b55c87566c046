//! Cloud Hypervisor's vm.resize ([`VmmAction::Resize`]): the vCPU count changes by ACPI
//! hot-plug between 1 and the machine's `max_vcpus` (before start, the count to boot
//! with); memory cannot change yet, so only its current size is accepted.
//!
//! [`VmmAction::Resize`]: crate::action::VmmAction::Resize

use crate::action::{ActionError, ActionResult, VmmData};
use crate::machine::RunningMachine;

use super::ApiController;

/// What Kata users can set to keep Kata from resizing the VM at all.
const KATA_STATIC: &str =
    "Kata Containers: set static_sandbox_resource_mgmt = true in configuration-clh.toml";

/// A memory size other than `current` (in bytes) is refused.
pub(super) fn check_ram(desired: Option<u64>, current: u64) -> Result<(), ActionError> {
    match desired {
        Some(ram) if ram != current => Err(ActionError::bad_request(format!(
            "desired_ram = {ram}: gpuvm has no memory hot-plug yet; the VM keeps its {current} bytes ({KATA_STATIC})"
        ))),
        _ => Ok(()),
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
        check_ram(desired_ram, self.machine_config.memory_size)?;
        if let Some(vcpus) = desired_vcpus {
            let max = self.pci.max_vcpus(&self.machine_config);
            check_vcpus(vcpus, max)?;
            self.machine_config.vcpus = vcpus;
            // The maximum stays what it was (it is at least the new count).
            self.pci.max_vcpus = max;
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
    check_ram(desired_ram, machine.config().memory_size)?;
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
/// the highest ones.
pub(super) fn resize_running(
    running: &mut RunningMachine<'_>,
    desired_vcpus: Option<u8>,
    desired_ram: Option<u64>,
) -> ActionResult {
    check_ram(desired_ram, running.machine().config().memory_size)?;
    let Some(vcpus) = desired_vcpus else {
        return Ok(VmmData::Empty);
    };
    check_vcpus(vcpus, running.machine().max_vcpus())?;
    // A snapshot through the guest's agent is several steps (release, snapshot, give
    // back): the vCPUs it saw stay until it is done.
    if !running.devices_mut().released_gpus.is_empty() && vcpus != running.machine().vcpu_count() {
        return Err(ActionError::wrong_state(
            "a snapshot that released GPUs is under way (they are not given back yet): resize once it is done",
        ));
    }
    running
        .resize_vcpus(vcpus)
        .map(|()| VmmData::Empty)
        .map_err(|error| ActionError {
            status: error.status(),
            message: format!("cannot resize the VM to {vcpus} vCPU(s): {error}"),
        })
}
