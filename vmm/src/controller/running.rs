//! The controller's side of a running machine: actions served from the run loop
//! (pause, resume, snapshots, drive changes, GPU hot-plug and the unplugs waiting for the
//! guest's eject).

use std::sync::mpsc::{Receiver, Sender};
use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::EventFd;

use super::{instance_info, machine_config_json, metrics, started_already, MAX_GPUS};
use crate::action::{
    absolute_path, ActionError, ActionRequest, ActionResult, DrivePatchBody, GpuBody,
    InstanceState, SnapshotCreateBody, SnapshotType, VmmAction, VmmData,
};
use crate::hotplug::EjectState;
use crate::machine::{GuestEnd, Machine, RunControl, RunningMachine};
use crate::metrics::{Metrics, METRICS};

pub(super) struct RunningApi {
    requests: Receiver<ActionRequest>,
    event: EventFd,
    /// Ids of the devices PUT /gpus configured before start (not hot-pluggable).
    cold_plugged: Vec<String>,
    /// DELETE /gpus/{id} requests waiting for the guest to eject.
    unplugs: Vec<PendingUnplug>,
}

/// A DELETE /gpus/{id} whose answer waits for the guest's eject, or the timeout.
struct PendingUnplug {
    id: String,
    bdf: String,
    deadline: Instant,
    reply: Sender<ActionResult>,
}

fn hotplug_error(error: crate::hotplug::HotplugError) -> ActionError {
    ActionError {
        status: error.status(),
        message: error.to_string(),
    }
}

impl RunningApi {
    pub(super) fn new(
        requests: Receiver<ActionRequest>,
        event: EventFd,
        cold_plugged: Vec<String>,
    ) -> Self {
        RunningApi {
            requests,
            event,
            cold_plugged,
            unplugs: Vec::new(),
        }
    }

    /// PUT /gpus/{id} while running: hot-plug.
    fn hot_plug(&mut self, running: &mut RunningMachine<'_>, body: GpuBody) -> ActionResult {
        body.validate(None)?;
        if self.cold_plugged.contains(&body.gpu_id) {
            return Err(ActionError::wrong_state(format!(
                "{:?} was attached at start; it cannot be replaced while the VM runs",
                body.gpu_id
            )));
        }
        let devices = running.devices_mut();
        if devices.passthrough.len() >= MAX_GPUS {
            return Err(ActionError::bad_request(format!(
                "at most {MAX_GPUS} passthrough devices per VM"
            )));
        }
        let hotplug = devices
            .pci_hotplug
            .as_mut()
            .ok_or_else(|| ActionError::wrong_state("this VM has no PCI hot-plug"))?;
        let (bdf, label) = hotplug.plug(&body).map_err(hotplug_error)?;
        devices.passthrough.push(label);
        Ok(VmmData::Json(serde_json::json!({
            "id": body.gpu_id,
            "bdf": format!("0000:{bdf}"),
        })))
    }

    /// DELETE /gpus/{id} while running: asks the guest to eject; the answer comes from
    /// [`RunningApi::finish_unplugs`] once it did, or the timeout passed.
    fn hot_unplug(
        &mut self,
        running: &mut RunningMachine<'_>,
        id: String,
        reply: Sender<ActionResult>,
    ) {
        let result = (|| {
            if self.cold_plugged.contains(&id) {
                return Err(ActionError::wrong_state(format!(
                    "{id:?} was attached at start; only hot-plugged devices can be removed"
                )));
            }
            let hotplug = running
                .devices_mut()
                .pci_hotplug
                .as_mut()
                .ok_or_else(|| ActionError::wrong_state("this VM has no PCI hot-plug"))?;
            let wake = self
                .event
                .try_clone()
                .map_err(|e| ActionError::bad_request(format!("cannot wait for the eject: {e}")))?;
            hotplug.set_wake(wake);
            hotplug.request_eject(&id).map_err(hotplug_error)
        })();
        let bdf = match result {
            Ok(bdf) => bdf,
            Err(error) => {
                let _ = reply.send(Err(error));
                return;
            }
        };
        let timeout = crate::hotplug::eject_timeout();
        // Wakes this thread when the time is up (the guest's eject wakes it sooner).
        if let Ok(wake) = self.event.try_clone() {
            let spawned = std::thread::Builder::new()
                .name("eject-timer".into())
                .spawn(move || {
                    std::thread::sleep(timeout + Duration::from_millis(5));
                    let _ = wake.write(1);
                });
            if let Err(error) = spawned {
                log::warn!(
                    "no eject timer thread ({error}); the timeout is checked on the next request"
                );
            }
        }
        self.unplugs.push(PendingUnplug {
            id,
            bdf: format!("0000:{bdf}"),
            deadline: Instant::now() + timeout,
            reply,
        });
        // The guest may have been quick.
        self.finish_unplugs(running);
    }

    /// Answers the DELETEs whose device the guest ejected (after taking it down), and
    /// those whose time ran out (the device stays, the eject request is withdrawn).
    fn finish_unplugs(&mut self, running: &mut RunningMachine<'_>) {
        if self.unplugs.is_empty() {
            return;
        }
        let devices = running.devices_mut();
        let now = Instant::now();
        let mut still = Vec::new();
        for unplug in std::mem::take(&mut self.unplugs) {
            let Some(hotplug) = devices.pci_hotplug.as_mut() else {
                continue;
            };
            match hotplug.poll_eject(&unplug.id) {
                Ok(EjectState::Removed(label)) => {
                    devices.passthrough.retain(|l| *l != label);
                    let _ = unplug.reply.send(Ok(VmmData::Empty));
                }
                Ok(EjectState::Waiting) if now >= unplug.deadline => {
                    hotplug.cancel_eject(&unplug.id);
                    let timeout = crate::hotplug::eject_timeout();
                    let _ = unplug.reply.send(Err(ActionError {
                        status: 504,
                        message: format!(
                            "the guest did not eject {} ({}) within {} ms; the device stays attached (a Linux guest needs the acpiphp driver: CONFIG_HOTPLUG_PCI_ACPI=y)",
                            unplug.id,
                            unplug.bdf,
                            timeout.as_millis()
                        ),
                    }));
                }
                Ok(EjectState::Waiting) => still.push(unplug),
                Err(error) => {
                    let _ = unplug.reply.send(Err(hotplug_error(error)));
                }
            }
        }
        self.unplugs = still;
    }
}

impl RunningApi {
    fn act(
        &mut self,
        action: VmmAction,
        running: &mut RunningMachine<'_>,
    ) -> (ActionResult, Option<GuestEnd>) {
        let state = if running.is_paused() {
            InstanceState::Paused
        } else {
            InstanceState::Running
        };
        let result = match action {
            VmmAction::GetInstanceInfo => Ok(instance_info(state)),
            VmmAction::GetMetrics => Ok(metrics(state, Some(running.machine()))),
            VmmAction::GetMachineConfig => Ok(machine_config_json(running.machine())),
            VmmAction::PatchDrive(body) => patch_drive(running.machine(), body),
            VmmAction::PutGpu(body) => self.hot_plug(running, body),
            VmmAction::DeleteGpu(_) => Err(ActionError::bad_request(
                "DELETE /gpus is answered once the guest ejected the device",
            )),
            VmmAction::PutMachineConfig(_)
            | VmmAction::PutBootSource(_)
            | VmmAction::PutDrive(_)
            | VmmAction::PutFs(_)
            | VmmAction::PutNetworkInterface(_)
            | VmmAction::PutNetworkInterfaceFds { .. }
            | VmmAction::PutVsock(_)
            | VmmAction::PutEntropy(_)
            | VmmAction::StartInstance
            | VmmAction::LoadSnapshot(_) => Err(started_already()),
            VmmAction::Batch(_) => Err(started_already()),
            VmmAction::ShutdownVmm => {
                log::info!("ShutdownVmm: ending the run");
                return (Ok(VmmData::Empty), Some(GuestEnd::Reset));
            }
            VmmAction::SendCtrlAltDel => {
                log::info!("SendCtrlAltDel: ending the run as a guest reset");
                return (Ok(VmmData::Empty), Some(GuestEnd::Reset));
            }
            VmmAction::Pause => running
                .pause()
                .map(|()| VmmData::Empty)
                .map_err(|e| ActionError::bad_request(format!("cannot pause: {e}"))),
            VmmAction::Resume => running
                .resume()
                .map(|()| VmmData::Empty)
                .map_err(|e| ActionError::bad_request(format!("cannot resume: {e}"))),
            VmmAction::CreateSnapshot(body) => snapshot(running, body),
            VmmAction::PutLogger(config) => crate::outputs::put_logger(config),
            VmmAction::PutMetrics(config) => crate::outputs::put_metrics(config),
            VmmAction::FlushMetrics => crate::outputs::flush_metrics(),
        };
        (result, None)
    }
}

/// PATCH /drives/{id}: a new image and/or rate limit for a running drive.
pub(super) fn patch_drive(machine: &Machine, body: DrivePatchBody) -> ActionResult {
    if let Some(path) = &body.path {
        absolute_path(path, "path")?;
    }
    crate::virtio::update_drive(
        &machine.devices().virtio,
        &body.drive_id,
        body.path,
        body.rate_limiter,
    )
    .map_err(|e| match e {
        crate::virtio::DriveUpdateError::NoSuchDrive(_) => ActionError {
            status: 404,
            message: e.to_string(),
        },
        other => ActionError::bad_request(other.to_string()),
    })?;
    Ok(VmmData::Empty)
}

fn snapshot(running: &mut RunningMachine<'_>, mut body: SnapshotCreateBody) -> ActionResult {
    absolute_path(&body.snapshot_path, "snapshot_path")?;
    // Firecracker's layout: gpuvm's directory beside the state file, then the two files.
    let files = match body.mem_file_path.take() {
        Some(mem_file) => {
            absolute_path(&mem_file, "mem_file_path")?;
            let dir = crate::snapshot::files::directory_for(&body.snapshot_path)
                .map_err(ActionError::bad_request)?;
            let state_file = std::mem::replace(&mut body.snapshot_path, dir);
            Some((state_file, mem_file))
        }
        None => None,
    };
    if body.snapshot_type == SnapshotType::Diff && !running.machine().config().track_dirty_pages {
        return Err(ActionError::bad_request(
            "Diff snapshots need track_dirty_pages in the machine configuration",
        ));
    }
    let report = running
        .snapshot(
            &body.snapshot_path,
            body.snapshot_type == SnapshotType::Full,
        )
        .map_err(|e| ActionError::bad_request(format!("snapshot failed: {e}")))?;
    Metrics::add(&METRICS.snapshots_created, 1);
    Metrics::add(&METRICS.snapshot_bytes_written, report.memory_bytes_written);
    if let Some((state_file, mem_file)) = &files {
        crate::snapshot::files::export(&report, state_file, mem_file).map_err(|e| {
            ActionError::bad_request(format!(
                "snapshot written to {}, but {e}",
                report.dir.display()
            ))
        })?;
    }
    Ok(VmmData::Json(serde_json::json!({
        "snapshot_path": report.dir,
        "memory_file": report.memory_file,
        "diff": report.diff,
        "memory_bytes_written": report.memory_bytes_written,
        "data_pages": report.data_pages,
        "paused_ms": report.pause_to_resume.as_millis() as u64,
    })))
}

impl RunControl for RunningApi {
    fn event(&self) -> &EventFd {
        &self.event
    }

    fn serve(&mut self, running: &mut RunningMachine<'_>) -> Option<GuestEnd> {
        self.finish_unplugs(running);
        while let Ok(request) = self.requests.try_recv() {
            if let VmmAction::DeleteGpu(id) = request.action {
                self.hot_unplug(running, id, request.reply);
                continue;
            }
            let (result, end) = self.act(request.action, running);
            let _ = request.reply.send(result);
            if end.is_some() {
                return end;
            }
        }
        None
    }
}
