//! The balloon's actions (Firecracker's `/balloon` routes): configured before start, its
//! target and polling interval changed and its statistics read while the VM runs.

use gpuvm_virtio::balloon::{BalloonConfig, PAGES_PER_MIB, STAT_NAMES};

use super::ApiController;
use crate::action::{
    ActionError, ActionResult, BalloonStatsUpdateBody, BalloonUpdateBody, VmmAction, VmmData,
};
use crate::machine::Machine;

fn no_balloon() -> ActionError {
    ActionError::bad_request("no balloon device is configured (PUT /balloon before start)")
}

/// Why a balloon cannot go with passthrough devices: their RAM is pinned for DMA, so
/// pages the guest gives back would not be freed (and a device could still write them).
pub(super) fn passthrough_refusal() -> ActionError {
    ActionError::bad_request(
        "a balloon cannot be used with passthrough devices: their DMA pins all guest RAM, which the balloon could not give back",
    )
}

/// The target must fit in guest memory.
fn check_amount(amount_mib: u32, memory_size: u64) -> Result<(), ActionError> {
    if u64::from(amount_mib) << 20 > memory_size {
        return Err(ActionError::bad_request(format!(
            "amount_mib {amount_mib} is more than the guest's {} MiB of memory",
            memory_size >> 20
        )));
    }
    Ok(())
}

fn config_json(config: &BalloonConfig) -> VmmData {
    VmmData::Json(serde_json::json!(config))
}

impl ApiController {
    /// The pre-boot balloon actions.
    pub(super) fn balloon_pre_boot(&mut self, action: VmmAction) -> ActionResult {
        match action {
            VmmAction::PutBalloon(config) => {
                check_amount(config.amount_mib, self.machine_config.memory_size)?;
                if !self.pci_options().is_empty() {
                    return Err(passthrough_refusal());
                }
                self.put_virtio(|v| v.balloon = Some(config))
            }
            VmmAction::PatchBalloon(BalloonUpdateBody { amount_mib }) => {
                check_amount(amount_mib, self.machine_config.memory_size)?;
                let balloon = self.pci.virtio.balloon.as_mut().ok_or_else(no_balloon)?;
                balloon.amount_mib = amount_mib;
                Ok(VmmData::Empty)
            }
            VmmAction::PatchBalloonStats(BalloonStatsUpdateBody {
                stats_polling_interval_s,
            }) => {
                let balloon = self.pci.virtio.balloon.as_mut().ok_or_else(no_balloon)?;
                balloon.stats_polling_interval_s = stats_polling_interval_s;
                Ok(VmmData::Empty)
            }
            VmmAction::GetBalloon => self
                .pci
                .virtio
                .balloon
                .as_ref()
                .map(config_json)
                .ok_or_else(no_balloon),
            VmmAction::GetBalloonStats => {
                self.pci.virtio.balloon.as_ref().ok_or_else(no_balloon)?;
                Err(ActionError::bad_request(
                    "the balloon's statistics come from the guest: start the VM first",
                ))
            }
            other => Err(ActionError::bad_request(format!(
                "not a balloon action: {other:?}"
            ))),
        }
    }
}

/// The balloon actions on a built machine (running, paused or loaded).
pub(super) fn balloon_running(machine: &Machine, action: VmmAction) -> ActionResult {
    let handles = &machine.devices().virtio;
    let memory_size = machine.config().memory_size;
    let result = crate::virtio::with_balloon(handles, |balloon| match action {
        VmmAction::PatchBalloon(BalloonUpdateBody { amount_mib }) => {
            check_amount(amount_mib, memory_size)?;
            balloon.set_target_mib(amount_mib);
            Ok(VmmData::Empty)
        }
        VmmAction::PatchBalloonStats(body) => balloon
            .set_stats_interval(body.stats_polling_interval_s)
            .map(|()| VmmData::Empty)
            .map_err(|e| ActionError::bad_request(e.to_string())),
        VmmAction::GetBalloon => Ok(config_json(balloon.config())),
        VmmAction::GetBalloonStats => {
            if balloon.config().stats_polling_interval_s == 0 {
                return Err(ActionError::bad_request(
                    "balloon statistics are not enabled (stats_polling_interval_s was 0 when it was configured)",
                ));
            }
            let report = balloon.report();
            let mut json = serde_json::json!({
                "target_pages": report.target_pages,
                "actual_pages": report.actual_pages,
                "target_mib": report.target_pages / PAGES_PER_MIB,
                "actual_mib": report.actual_pages / PAGES_PER_MIB,
            });
            for (tag, value) in report.stats.iter().flatten() {
                if let Some(name) = STAT_NAMES.get(usize::from(*tag)) {
                    json[*name] = serde_json::json!(value);
                }
            }
            Ok(VmmData::Json(json))
        }
        VmmAction::PutBalloon(_) => Err(super::started_already()),
        other => Err(ActionError::bad_request(format!(
            "not a balloon action: {other:?}"
        ))),
    });
    result.unwrap_or_else(|| Err(no_balloon()))
}

/// A running VM with a balloon cannot take a passthrough device (hot-plug).
pub(super) fn refuse_passthrough_with_balloon(machine: &Machine) -> Result<(), ActionError> {
    match crate::virtio::with_balloon(&machine.devices().virtio, |_| ()) {
        Some(()) => Err(passthrough_refusal()),
        None => Ok(()),
    }
}
