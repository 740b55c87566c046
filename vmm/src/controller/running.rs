//! The controller's side of a running machine: actions served from the run loop
//! (pause, resume, snapshots, drive changes, GPU hot-plug and the unplugs waiting for the
//! guest's eject).

use std::collections::BTreeMap;
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::EventFd;

use super::{instance_info, machine_config_json, metrics, started_already, MAX_GPUS};
use crate::action::{
    absolute_path, ActionError, ActionRequest, ActionResult, DriveBody, DrivePatchBody, GpuBody,
    InstanceState, PassthroughPolicy, SnapshotCreateBody, SnapshotType, VirtioHotplug, VmmAction,
    VmmData,
};
use crate::devices::MachineDevices;
use crate::hotplug::EjectState;
use crate::machine::{GuestEnd, Machine, RunControl, RunningMachine};
use crate::metrics::{Metrics, METRICS};

/// How long a hot-plug into a lazily restored VM waits for guest memory to be loaded.
const LAZY_LOAD_LIMIT: Duration = Duration::from_secs(60);

pub(super) struct RunningApi {
    requests: Receiver<ActionRequest>,
    /// A sender into `requests` (see [`super::ApiController::set_request_sender`]).
    own_requests: Option<Sender<ActionRequest>>,
    event: EventFd,
    /// The ids of the passthrough devices plugged at start (not hot-pluggable), by
    /// backend ([`crate::devices::ColdPlugged::backend`]): as the client configured them,
    /// or made up for the command line's (see [`cold_plugged_devices`]).
    cold_plugged: BTreeMap<String, String>,
    /// DELETE /gpus/{id} requests waiting for the guest to eject.
    unplugs: Vec<PendingUnplug>,
    /// Wakes this thread at each unplug's deadline.
    eject_timer: EjectTimer,
    /// A client's record of the VM (see [`super::client`]).
    client: super::client::ClientState,
    /// The VM's MMDS (see [`super::mmds`]): hot-plugged network interfaces get it too.
    mmds: Arc<gpuvm_mmds::Mmds>,
    /// The revision of `client`'s record the machine's devices hold (for snapshots and
    /// live updates); None until the first copy.
    record_in_machine: Option<u64>,
}

/// A DELETE /gpus/{id} whose answer waits for the guest's eject, or the timeout.
struct PendingUnplug {
    id: String,
    bdf: String,
    deadline: Instant,
    reply: Sender<ActionResult>,
}

/// One thread for all the VM's eject deadlines, started by a removal when none runs: it
/// inherits this (VMM) thread's seccomp filter, as it is spawned from it, sleeps until the
/// earliest deadline it holds, and ends once none is left. Removals while it runs add a
/// deadline and cost no thread.
#[derive(Default)]
struct EjectTimer {
    shared: std::sync::Arc<(std::sync::Mutex<EjectDeadlines>, std::sync::Condvar)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

#[derive(Default)]
struct EjectDeadlines {
    pending: Vec<Instant>,
    /// Whether the thread runs (it clears this as it ends, under the lock).
    running: bool,
    stop: bool,
}

impl EjectTimer {
    /// Writes `wake` once `deadline` has passed.
    fn wake_at(&mut self, wake: &EventFd, deadline: Instant) -> std::io::Result<()> {
        let (deadlines, changed) = &*self.shared;
        let mut state = lock_deadlines(deadlines);
        if !state.running {
            // The last one ended (or none ran): reap it, start one.
            if let Some(ended) = self.thread.take() {
                let _ = ended.join();
            }
            let wake = wake.try_clone()?;
            let shared = self.shared.clone();
            self.thread = Some(
                std::thread::Builder::new()
                    .name("eject-timer".into())
                    .spawn(move || EjectTimer::serve(&shared, &wake))?,
            );
            state.running = true;
        }
        state.pending.push(deadline);
        changed.notify_one();
        Ok(())
    }

    fn serve(shared: &(std::sync::Mutex<EjectDeadlines>, std::sync::Condvar), wake: &EventFd) {
        let (deadlines, changed) = shared;
        let mut state = lock_deadlines(deadlines);
        while !state.stop {
            let now = Instant::now();
            let before = state.pending.len();
            state.pending.retain(|deadline| *deadline > now);
            if state.pending.len() < before {
                let _ = wake.write(1);
            }
            let Some(next) = state.pending.iter().min() else {
                break;
            };
            let wait = next.saturating_duration_since(now);
            state = changed
                .wait_timeout(state, wait)
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .0;
        }
        state.running = false;
    }

    /// How many deadlines are still to come (tests).
    #[cfg(test)]
    fn pending(&self) -> usize {
        lock_deadlines(&self.shared.0).pending.len()
    }
}

impl Drop for EjectTimer {
    fn drop(&mut self) {
        let (deadlines, changed) = &*self.shared;
        lock_deadlines(deadlines).stop = true;
        changed.notify_one();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The deadlines' lock; a panic elsewhere while holding it leaves nothing half-done.
fn lock_deadlines(
    deadlines: &std::sync::Mutex<EjectDeadlines>,
) -> std::sync::MutexGuard<'_, EjectDeadlines> {
    deadlines
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
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
        own_requests: Option<Sender<ActionRequest>>,
        event: EventFd,
        cold_plugged: BTreeMap<String, String>,
        client: super::client::ClientState,
        mmds: Arc<gpuvm_mmds::Mmds>,
    ) -> Self {
        RunningApi {
            requests,
            own_requests,
            event,
            cold_plugged,
            unplugs: Vec::new(),
            eject_timer: EjectTimer::default(),
            client,
            mmds,
            record_in_machine: None,
        }
    }

    /// Copies the client's record into the machine's devices when it changed, so that a
    /// snapshot (whichever way it is taken) or a live update carries it as it is now.
    fn sync_record(&mut self, running: &mut RunningMachine<'_>) {
        let revision = self.client.revision();
        if self.record_in_machine != Some(revision) {
            running.devices_mut().client_record = self.client.saved();
            self.record_in_machine = Some(revision);
        }
        // The ids of the devices plugged at start go along too.
        if running.machine().devices().cold_plugged_ids != self.cold_plugged {
            running.devices_mut().cold_plugged_ids = self.cold_plugged.clone();
        }
    }

    /// The ids of the running VM's devices, as gpuvm's actions name them.
    fn device_ids(&self, running: &mut RunningMachine<'_>) -> Vec<String> {
        let devices = running.devices_mut();
        let mut ids: Vec<String> = devices
            .virtio
            .iter()
            .map(|handle| handle.config.id().to_string())
            .collect();
        if let Some(hotplug) = devices.pci_hotplug.as_ref() {
            ids.extend(hotplug.attached().map(|(id, _)| id.to_string()));
        }
        ids.extend(self.cold_plugged_ids(devices));
        ids
    }

    /// The ids of the passthrough devices plugged at start, as vm.info lists them.
    fn cold_plugged_ids(&self, devices: &MachineDevices) -> Vec<String> {
        (cold_plugged_devices(devices, &self.cold_plugged).into_iter())
            .map(|(id, _)| id)
            .collect()
    }

    /// [`VmmAction::AddDevice`] while running: a hot-plug (a GPU on the PCI segment it
    /// names, other devices on segment 0), recorded for the client when the device is in.
    fn add_device(
        &mut self,
        running: &mut RunningMachine<'_>,
        request: crate::action::AddDeviceRequest,
    ) -> ActionResult {
        let add = request.translate(self.client.recorded())?;
        let noun = add.noun.clone();
        // The VM cannot take the device now (no hot-plug in it, its id attached or being
        // removed): for the client, a request this VM does not fit.
        self.hot_plug_added(running, add)
            .map_err(|error| match error.status {
                409 => {
                    ActionError::bad_request(format!("{noun} hot-plug refused: {}", error.message))
                }
                _ => error,
            })
    }

    fn hot_plug_added(
        &mut self,
        running: &mut RunningMachine<'_>,
        add: crate::action::AddDevice,
    ) -> ActionResult {
        let (segment, section, body) = (add.segment, add.section.clone(), add.body.clone());
        let in_use = self.device_ids(running);
        let super::client::SettledDevice {
            action,
            client_id,
            device_id,
        } = self.client.settle(add, &in_use)?;
        let result = match action {
            VmmAction::PutGpu(mut gpu) => {
                gpu.pci_segment = (segment != 0).then_some(segment).or(gpu.pci_segment);
                self.hot_plug(running, gpu)
            }
            _ if segment != 0 => Err(super::client::hot_plug_segment_refusal(&client_id, segment)),
            other => match VirtioHotplug::from_action(other) {
                Some(device) => hot_plug_virtio(running, device, &self.mmds),
                None => Err(ActionError::bad_request(format!(
                    "{client_id}: no hot-plug for this kind of device"
                ))),
            },
        }?;
        self.client.record(&client_id, &device_id, section, body);
        // The client knows the device by its own id.
        Ok(match result {
            VmmData::Json(mut answer) => {
                answer["id"] = client_id.into();
                VmmData::Json(answer)
            }
            other => other,
        })
    }

    /// PUT /gpus/{id} while running: hot-plug.
    fn hot_plug(&mut self, running: &mut RunningMachine<'_>, body: GpuBody) -> ActionResult {
        body.validate(None)?;
        super::balloon::refuse_passthrough_with_balloon(running.machine())?;
        if (self.cold_plugged_ids(running.machine().devices())).contains(&body.gpu_id) {
            return Err(ActionError::wrong_state(format!(
                "{:?} was attached at start; it cannot be replaced while the VM runs",
                body.gpu_id
            )));
        }
        // A device process reads guest RAM through its own mapping of the RAM file, which
        // a lazy restore does not serve: it would read zeros where the snapshot's data is
        // not loaded yet. So a lazily restored VM's memory is all loaded first.
        if running.machine().lazy_stats().is_some()
            && running
                .machine()
                .wait_lazy_complete(LAZY_LOAD_LIMIT)
                .is_none()
        {
            return Err(ActionError::wrong_state(format!(
                "cannot hot-plug {:?}: the lazy restore did not load guest memory within {} s",
                body.gpu_id,
                LAZY_LOAD_LIMIT.as_secs()
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
        // A device process that dies wakes this thread (see `serve`).
        if let Ok(wake) = self.event.try_clone() {
            hotplug.set_wake(wake);
        }
        let released = devices
            .released_gpus
            .iter()
            .position(|gpu| gpu.gpu_id == body.gpu_id);
        let expected = released.map(|at| {
            let gpu = &devices.released_gpus[at];
            (gpu.vendor_id, gpu.device_id)
        });
        let (bdf, label) = hotplug
            .plug_expecting(&body, expected)
            .map_err(hotplug_error)?;
        if let Some(at) = released {
            devices.released_gpus.remove(at);
        }
        devices.passthrough.push(label);
        Ok(VmmData::Json(serde_json::json!({
            "id": body.gpu_id,
            "bdf": bdf.full(),
        })))
    }

    /// DELETE /gpus/{id} while running: asks the guest to eject; the answer comes from
    /// [`RunningApi::finish_unplugs`] once it did, or the timeout passed.
    /// With `at_once` (Cloud Hypervisor's vm.remove-device), the answer comes as soon as
    /// the guest was asked, and the device goes when it ejects it.
    /// Whether the guest was asked to eject (the removal goes on).
    fn hot_unplug(
        &mut self,
        running: &mut RunningMachine<'_>,
        id: String,
        reply: Sender<ActionResult>,
        at_once: bool,
    ) -> bool {
        let result = (|| {
            if (self.cold_plugged_ids(running.machine().devices())).contains(&id) {
                return Err(ActionError::wrong_state(format!(
                    "{id:?} was attached at start; only hot-plugged devices can be removed"
                )));
            }
            let devices = running.devices_mut();
            let hotplug = devices
                .pci_hotplug
                .as_mut()
                .ok_or_else(|| ActionError::wrong_state("this VM has no PCI hot-plug"))?;
            let wake = self
                .event
                .try_clone()
                .map_err(|e| ActionError::bad_request(format!("cannot wait for the eject: {e}")))?;
            hotplug.set_wake(wake);
            hotplug
                .request_eject(&devices.virtio, &id)
                .map_err(hotplug_error)
        })();
        let bdf = match result {
            Ok(bdf) => bdf,
            Err(error) => {
                let _ = reply.send(Err(error));
                return false;
            }
        };
        let reply = if at_once {
            let _ = reply.send(Ok(VmmData::Empty));
            // Nobody waits for the eject's outcome: it is logged.
            std::sync::mpsc::channel().0
        } else {
            reply
        };
        // One instant for the timer and the check: a timer armed for an earlier instant
        // than the one `finish_unplugs` compares with could fire just before the deadline
        // and leave the DELETE unanswered with nothing left to wake it.
        let deadline = Instant::now() + crate::hotplug::eject_timeout();
        self.wake_at(deadline);
        self.unplugs.push(PendingUnplug {
            id,
            bdf: bdf.full(),
            deadline,
            reply,
        });
        // The guest may have been quick.
        self.finish_unplugs(running);
        true
    }

    /// Wakes this thread once `deadline` has passed (the guest's eject wakes it sooner).
    fn wake_at(&mut self, deadline: Instant) {
        if let Err(error) = self.eject_timer.wake_at(&self.event, deadline) {
            log::warn!(
                "no eject timer thread ({error}); the timeout is checked on the next request"
            );
        }
    }

    /// Hot-plugged devices whose process went away: marked gone (the guest is asked to
    /// eject them), and their slots freed once the guest ejected them or the eject
    /// timeout passed. The DELETEs waiting on them are answered by `finish_unplugs`.
    fn handle_gone_devices(&mut self, running: &mut RunningMachine<'_>) {
        let devices = running.devices_mut();
        let Some(hotplug) = devices.pci_hotplug.as_mut() else {
            return;
        };
        let deadlines = hotplug.check_backends();
        let waiting: Vec<&str> = self.unplugs.iter().map(|u| u.id.as_str()).collect();
        let freed = hotplug.free_gone(&waiting);
        devices.passthrough.retain(|l| !freed.contains(l));
        for deadline in deadlines {
            self.wake_at(deadline);
        }
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
            match hotplug.poll_eject(&mut devices.virtio, &unplug.id) {
                Ok(EjectState::Removed(label)) => {
                    devices.passthrough.retain(|l| *l != label);
                    let _ = unplug.reply.send(Ok(VmmData::Empty));
                }
                Ok(EjectState::Waiting) if now >= unplug.deadline => {
                    if let Some(label) = hotplug.cancel_eject(&devices.virtio, &unplug.id) {
                        // Its process is gone: the slot is freed, the DELETE succeeds.
                        devices.passthrough.retain(|l| *l != label);
                        let _ = unplug.reply.send(Ok(VmmData::Empty));
                        continue;
                    }
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
        let (action, recorded) = super::client::unwrap_recorded(action);
        let (result, end) = self.act_on(action, running);
        if let (Ok(_), Some(entry)) = (&result, recorded) {
            self.client.remember(entry);
        }
        (result, end)
    }

    fn act_on(
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
            VmmAction::Remember(entries) => Ok(self.client.remember_all(entries)),
            VmmAction::Recorded { .. } => Err(ActionError::bad_request(
                "a recorded action records one action",
            )),
            action @ (VmmAction::PutMmds(_)
            | VmmAction::PatchMmds(_)
            | VmmAction::GetMmds
            | VmmAction::SetMmdsSizeLimit(_)
            | VmmAction::PutMmdsConfig(_)) => {
                super::mmds::act(&self.mmds, action, super::mmds::Stage::Started)
            }
            VmmAction::GetInstanceInfo => {
                let devices = running.machine().devices();
                let info = with_hot_plugged(instance_info(state, &self.client), devices);
                Ok(with_pci_devices(info, devices, &self.cold_plugged))
            }
            VmmAction::GetMetrics => Ok(with_hot_plugged(
                metrics(state, Some(running.machine())),
                running.machine().devices(),
            )),
            VmmAction::GetMachineConfig => Ok(machine_config_json(running.machine())),
            VmmAction::PatchDrive(body) => patch_drive(running.machine(), body),
            action @ (VmmAction::PutBalloon(_)
            | VmmAction::PatchBalloon(_)
            | VmmAction::GetBalloon
            | VmmAction::GetBalloonStats
            | VmmAction::PatchBalloonStats(_)) => {
                super::balloon::balloon_running(running.machine(), action)
            }
            VmmAction::PutGpu(body) => self.hot_plug(running, body),
            VmmAction::AddDevice(add) => self.add_device(running, add),
            VmmAction::BootCreated => Err(ActionError::wrong_state("the VM is already booted")),
            VmmAction::CreateVm { .. } => {
                Err(ActionError::wrong_state("the VM is already created"))
            }
            VmmAction::RestoreWithTaps { .. } => Err(started_already()),
            VmmAction::DeleteGpu(_) | VmmAction::RemoveDevice(_) => Err(ActionError::bad_request(
                "a removal is answered from the run loop",
            )),
            VmmAction::HotplugVirtio(device) => hot_plug_virtio(running, device, &self.mmds),
            VmmAction::Resize {
                desired_vcpus,
                desired_ram,
            } => super::resize::resize_running(running, desired_vcpus, desired_ram),
            VmmAction::PutMachineConfig(_)
            | VmmAction::PatchMachineConfig(_)
            | VmmAction::PutBootSource(_)
            | VmmAction::PutDrive(_)
            | VmmAction::PutFs(_)
            | VmmAction::PutNetworkInterface(_)
            | VmmAction::PutNetworkInterfaceFds { .. }
            | VmmAction::PassTaps { .. }
            | VmmAction::PutVsock(_)
            | VmmAction::PutEntropy(_)
            | VmmAction::PutPciSegments(_)
            | VmmAction::StartInstance
            | VmmAction::LoadSnapshot(_)
            | VmmAction::LoadSnapshotWith { .. } => Err(started_already()),
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
            VmmAction::LiveUpdate { body, api_listener } => {
                return match live_update(running, &body, api_listener, &self.mmds) {
                    Ok(answer) => (Ok(answer), Some(GuestEnd::HandedOver)),
                    Err(error) => (Err(error), None),
                }
            }
            VmmAction::PutLogger(config) => crate::outputs::put_logger(config),
            VmmAction::PutMetrics(config) => crate::outputs::put_metrics(config),
            VmmAction::FlushMetrics => crate::outputs::flush_metrics(),
        };
        (result, None)
    }
}

/// PUT /vmm/update: hands the VM to the new gpuvm (crate::update). On success the run
/// ends here (the new process runs the VM); on failure the VM runs on, as before.
fn live_update(
    running: &mut RunningMachine<'_>,
    body: &crate::action::LiveUpdateBody,
    api_listener: Option<std::os::fd::OwnedFd>,
    mmds: &gpuvm_mmds::Mmds,
) -> ActionResult {
    absolute_path(&body.handover_socket, "handover_socket")?;
    if body.timeout_ms == Some(0) {
        return Err(ActionError::bad_request("timeout_ms must be at least 1"));
    }
    if let Some(token) = &body.handover_token {
        crate::update::check_token(token).map_err(ActionError::bad_request)?;
    }
    let timeout = body
        .timeout_ms
        .map_or(crate::update::DEFAULT_TIMEOUT, Duration::from_millis);
    let socket = &body.handover_socket;
    let handed = crate::update::hand_over(
        running,
        socket,
        timeout,
        crate::update::ExpectedReceiver {
            pid: body.receiver_pid,
            token: body.handover_token.clone(),
        },
        api_listener.as_ref().map(std::os::fd::AsFd::as_fd),
        mmds,
    );
    match handed {
        Ok(report) => {
            log::info!(
                "live update: the VM is handed to pid {:?} ({} bytes of state, {:?} from the \
                 pause to its Ready); this process ends",
                report.new_pid,
                report.state_bytes,
                report.paused_to_ready
            );
            Ok(VmmData::Json(serde_json::json!({
                "new_pid": report.new_pid,
                "state_bytes": report.state_bytes,
                "paused_to_ready_us": report.paused_to_ready.as_micros() as u64,
            })))
        }
        Err(error @ crate::update::UpdateError::Unsupported { .. }) => {
            Err(ActionError::bad_request(error.to_string()))
        }
        Err(error @ crate::update::UpdateError::NotReady(_)) => Err(ActionError {
            status: 409,
            message: error.to_string(),
        }),
        Err(error) => Err(ActionError {
            status: 500,
            message: format!("live update failed; the VM runs on in this process: {error}"),
        }),
    }
}

/// A virtio device hot-plugged into the running VM: `{id, bdf}` (a network interface
/// gets the VM's `mmds`).
fn hot_plug_virtio(
    running: &mut RunningMachine<'_>,
    device: VirtioHotplug,
    mmds: &Arc<gpuvm_mmds::Mmds>,
) -> ActionResult {
    use crate::virtio::{DeviceResources, VirtioDeviceConfig};
    let passed = DeviceResources::default().with_mmds(mmds);
    let config = match device {
        VirtioHotplug::Drive(DriveBody::Local(config)) => {
            absolute_path(&config.path, "path")?;
            VirtioDeviceConfig::Block(config)
        }
        VirtioHotplug::Drive(DriveBody::VhostUser(config)) => {
            absolute_path(&config.socket, "socket")?;
            VirtioDeviceConfig::VhostUserBlock(config)
        }
        VirtioHotplug::Fs(config) => {
            absolute_path(&config.socket, "socket")?;
            VirtioDeviceConfig::Fs(config)
        }
        VirtioHotplug::Net(config) => VirtioDeviceConfig::Net(config),
        VirtioHotplug::NetFds { mut config, fds } => {
            let taps = super::configure::taps_from_fds(&config, fds)?;
            config.host_dev_name = None;
            passed.insert(&config.iface_id, taps);
            VirtioDeviceConfig::Net(config)
        }
        VirtioHotplug::Vsock(config) => {
            absolute_path(&config.uds_path, "uds_path")?;
            VirtioDeviceConfig::Vsock(config)
        }
    };
    let id = config.id().to_string();
    let devices = running.devices_mut();
    let hotplug = devices
        .pci_hotplug
        .as_mut()
        .ok_or_else(|| ActionError::wrong_state("this VM has no PCI hot-plug"))?;
    let bdf = hotplug
        .plug_virtio(&mut devices.virtio, config, &passed)
        .map_err(hotplug_error)?;
    Ok(VmmData::Json(serde_json::json!({
        "id": id,
        "bdf": bdf.full(),
    })))
}

/// Adds `hot_plugged_gpus` (each device's id, address and state: attached, ejecting or
/// gone, with why) to a JSON answer, when any device was hot-plugged, and `p2p_limits`
/// (the DMA contexts that cannot map peers' BARs, and why), when there are any.
pub(super) fn with_hot_plugged(data: VmmData, devices: &MachineDevices) -> VmmData {
    let hotplug = devices.pci_hotplug.as_ref();
    let described = hotplug.map(|h| h.describe()).unwrap_or_default();
    let p2p_limits = hotplug.map(|h| h.peer_dma_limits()).unwrap_or_default();
    let data = match data {
        VmmData::Json(mut json) if !p2p_limits.is_empty() => {
            json["p2p_limits"] = serde_json::json!(p2p_limits);
            VmmData::Json(json)
        }
        other => other,
    };
    match data {
        VmmData::Json(mut json) if !described.is_empty() => {
            json["hot_plugged_gpus"] = serde_json::Value::Array(described);
            VmmData::Json(json)
        }
        other => other,
    }
}

/// How an id made up for a passthrough device plugged at start begins: Cloud Hypervisor's
/// front end names devices given without an id so (`_vfio0`, `_user_device1`).
pub(super) fn made_up_id_prefix(vfio_user: bool) -> &'static str {
    if vfio_user {
        "_user_device"
    } else {
        "_vfio"
    }
}

/// The passthrough devices plugged at start, each with its id and place: the id `ids`
/// has for its backend; else (a live update's new process, which is not told the old
/// process's ids) one made up as for a device from the command line, free among the
/// VM's other devices' ids.
pub(super) fn cold_plugged_devices(
    devices: &MachineDevices,
    ids: &BTreeMap<String, String>,
) -> Vec<(String, crate::devices::ColdPlugged)> {
    let mut taken: Vec<String> = (devices.virtio.iter())
        .map(|handle| handle.config.id().to_string())
        .collect();
    if let Some(hotplug) = devices.pci_hotplug.as_ref() {
        taken.extend(hotplug.attached().map(|(id, _)| id.to_string()));
    }
    taken.extend(ids.values().cloned());
    (devices.cold_plugged().into_iter())
        .map(|device| {
            let id = ids.get(&device.backend).cloned().unwrap_or_else(|| {
                let id = super::client::fresh_id(&taken, made_up_id_prefix(device.vfio_user));
                taken.push(id.clone());
                id
            });
            (id, device)
        })
        .collect()
}

/// Adds `pci_devices`: each virtio device and passthrough device (plugged at start, whose
/// ids are `cold_ids` by backend, or hot-plugged) with its id, PCI address (segment
/// included) and kind; a passthrough device with its backend too. Cloud Hypervisor's
/// vm.info builds its device_tree from it.
pub(super) fn with_pci_devices(
    data: VmmData,
    devices: &MachineDevices,
    cold_ids: &BTreeMap<String, String>,
) -> VmmData {
    let VmmData::Json(mut json) = data else {
        return data;
    };
    let mut listed: Vec<serde_json::Value> = devices
        .virtio
        .iter()
        .map(|handle| {
            serde_json::json!({
                "id": handle.config.id(),
                "bdf": handle.bdf.full(),
                "kind": crate::lock(&handle.transport).name(),
                "hot_plugged": handle.hot_plugged,
            })
        })
        .collect();
    listed.extend(
        (cold_plugged_devices(devices, cold_ids).into_iter()).map(|(id, device)| {
            serde_json::json!({
                "id": id,
                "bdf": device.bdf.full(),
                "kind": "passthrough",
                "hot_plugged": false,
                "backend": device.backend,
            })
        }),
    );
    if let Some(hotplug) = devices.pci_hotplug.as_ref() {
        listed.extend(hotplug.attached().map(|(id, bdf)| {
            let backend = hotplug.plug_body(id).and_then(|body| body.backend_key());
            serde_json::json!({
                "id": id,
                "bdf": bdf.full(),
                "kind": "passthrough",
                "hot_plugged": true,
                "backend": backend,
            })
        }));
    }
    json["pci_devices"] = serde_json::Value::Array(listed);
    VmmData::Json(json)
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
    // GPUs the guest released for this snapshot: in its state while it is written, and
    // kept as waiting for the guest only when they are not given back at once.
    let waiting = running.devices_mut().released_gpus.clone();
    let released = std::mem::take(&mut body.released_gpus);
    let given_back = body.reattach;
    running
        .devices_mut()
        .released_gpus
        .extend(released.iter().cloned());
    let result = write_snapshot(running, body);
    if result.is_err() || given_back {
        running.devices_mut().released_gpus = waiting;
    }
    result
}

fn write_snapshot(running: &mut RunningMachine<'_>, mut body: SnapshotCreateBody) -> ActionResult {
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

/// Whether the guest released a GPU under `id` for a snapshot and waits for it.
fn is_released(running: &mut RunningMachine<'_>, id: &str) -> bool {
    running
        .devices_mut()
        .released_gpus
        .iter()
        .any(|gpu| gpu.gpu_id == id)
}

/// The Unix socket of the VM's vsock device: the GPU agent's channel.
fn vsock_socket(running: &RunningMachine<'_>) -> Option<std::path::PathBuf> {
    running
        .machine()
        .devices()
        .virtio
        .iter()
        .find_map(|handle| match &handle.config {
            crate::virtio::VirtioDeviceConfig::Vsock(vsock) => Some(vsock.uds_path.clone()),
            _ => None,
        })
}

/// Runs `work` on its own thread and sends its result to `reply`.
fn answer_from_thread(
    name: &str,
    reply: Sender<ActionResult>,
    work: impl FnOnce() -> ActionResult + Send + 'static,
) -> Result<(), ActionError> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let _ = reply.send(work());
        })
        .map(|_| ())
        .map_err(|e| ActionError::bad_request(format!("cannot start the {name} thread: {e}")))
}

impl RunningApi {
    /// PUT /snapshot/create with `passthrough: guest_release`: hands the hot-plugged GPUs
    /// to [`crate::gpu_release::snapshot_releasing`] on its own thread, which sends this
    /// thread the DELETE, snapshot and PUT actions it needs.
    fn snapshot_releasing(
        &mut self,
        running: &mut RunningMachine<'_>,
        body: SnapshotCreateBody,
        reply: Sender<ActionResult>,
    ) -> Result<(), ActionError> {
        if body.mem_file_path.is_some() {
            return Err(ActionError::bad_request(
                "guest_release writes gpuvm's snapshot directory; mem_file_path is not supported with it",
            ));
        }
        let requests = self.own_requests.clone().ok_or_else(|| {
            ActionError::wrong_state("guest_release is served on gpuvm's own API socket only")
        })?;
        let cold = self.cold_plugged_ids(running.machine().devices());
        if !cold.is_empty() {
            return Err(ActionError::wrong_state(format!(
                "{cold:?} were attached at start and cannot be ejected; guest_release needs GPUs hot-plugged after start (PUT /gpus while running)"
            )));
        }
        let Some(hotplug) = running.devices_mut().pci_hotplug.as_ref() else {
            return Err(ActionError::wrong_state("this VM has no PCI hot-plug"));
        };
        let mut gpus = Vec::new();
        for (id, bdf) in hotplug.attached() {
            // What it was plugged with, hot-plugged here or brought back by a restore or a
            // live update (which plug it again after the release).
            let body = hotplug.plug_body(id).ok_or_else(|| {
                ActionError::wrong_state(format!("{id} is being plugged or removed; try again"))
            })?;
            let (vendor_id, device_id) = hotplug.pci_ids(id).unwrap_or_default();
            gpus.push(crate::gpu_release::AttachedGpu {
                body,
                bdf: bdf.full(),
                vendor_id,
                device_id,
            });
        }
        if !self.unplugs.is_empty() {
            return Err(ActionError::wrong_state(
                "a GPU is being hot-unplugged; snapshot once that is done",
            ));
        }
        let uds = vsock_socket(running).ok_or_else(|| {
            ActionError::wrong_state(crate::gpu_release::AgentError::NoVsock.to_string())
        })?;
        absolute_path(&body.snapshot_path, "snapshot_path")?;
        let wake = self
            .event
            .try_clone()
            .map_err(|e| ActionError::bad_request(format!("cannot wake the VMM thread: {e}")))?;
        let vmm = crate::action_channel::ActionSender::new(requests, wake);
        answer_from_thread("gpu-release", reply, move || {
            crate::gpu_release::snapshot_releasing(vmm, uds, gpus, body)
        })
    }

    /// PUT /gpus/{id} for a GPU the guest released: plugs a device of the same model and
    /// answers once the guest's agent resumed it.
    fn give_back(
        &mut self,
        running: &mut RunningMachine<'_>,
        body: GpuBody,
        reply: Sender<ActionResult>,
    ) {
        let plugged = self.hot_plug(running, body.clone());
        let uds = vsock_socket(running);
        let result = plugged.and_then(|answer| {
            let uds = uds.ok_or_else(|| {
                ActionError::wrong_state(crate::gpu_release::AgentError::NoVsock.to_string())
            })?;
            let bdf = match &answer {
                VmmData::Json(value) => value["bdf"].as_str().unwrap_or_default().to_string(),
                VmmData::Empty => String::new(),
            };
            let id = body.gpu_id.clone();
            answer_from_thread("gpu-resume", reply.clone(), move || {
                crate::gpu_release::resume_in_guest(&uds, &id, &bdf)?;
                let mut answer = answer;
                if let VmmData::Json(value) = &mut answer {
                    value["resumed"] = serde_json::json!(true);
                }
                Ok(answer)
            })
        });
        if let Err(error) = result {
            let _ = reply.send(Err(error));
        }
    }
}

impl RunControl for RunningApi {
    fn event(&self) -> &EventFd {
        &self.event
    }

    fn serve(&mut self, running: &mut RunningMachine<'_>) -> Option<GuestEnd> {
        self.handle_gone_devices(running);
        self.finish_unplugs(running);
        self.sync_record(running);
        while let Ok(request) = self.requests.try_recv() {
            let request = match request.action {
                VmmAction::DeleteGpu(id) => {
                    self.hot_unplug(running, id, request.reply, false);
                    continue;
                }
                VmmAction::RemoveDevice(id) => {
                    let device_id = self.client.device_id(&id);
                    if self.hot_unplug(running, device_id, request.reply, true) {
                        self.client.forget(&id);
                        self.sync_record(running);
                    }
                    continue;
                }
                // With no hot-plugged GPU there is nothing to release: a plain snapshot.
                VmmAction::CreateSnapshot(body)
                    if body.passthrough == PassthroughPolicy::GuestRelease
                        && running
                            .devices_mut()
                            .pci_hotplug
                            .as_ref()
                            .is_some_and(|hotplug| hotplug.attached().next().is_some()) =>
                {
                    let result = self.snapshot_releasing(running, body, request.reply.clone());
                    if let Err(error) = result {
                        let _ = request.reply.send(Err(error));
                    }
                    continue;
                }
                VmmAction::PutGpu(body) if is_released(running, &body.gpu_id) => {
                    self.give_back(running, body, request.reply);
                    continue;
                }
                action => ActionRequest {
                    action,
                    reply: request.reply,
                },
            };
            let (result, end) = self.act(request.action, running);
            self.sync_record(running);
            let _ = request.reply.send(result);
            if end.is_some() {
                return end;
            }
        }
        None
    }
}

#[cfg(test)]
mod eject_timer_tests {
    use super::*;

    /// Many removals share one thread; each deadline wakes the event once it passed,
    /// none before, and a passed deadline leaves nothing behind.
    #[test]
    fn one_thread_wakes_at_each_deadline() {
        let event = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let mut timer = EjectTimer::default();
        let start = Instant::now();
        // Far first, then near: the near ones must not wait for the far one.
        for after in [60_000, 40, 80, 120] {
            timer
                .wake_at(&event, start + Duration::from_millis(after))
                .unwrap();
        }
        let thread = timer.thread.as_ref().expect("started").thread().id();
        let mut woken = 0;
        while woken < 3 {
            match event.read() {
                Ok(count) => woken += count,
                Err(_) => std::thread::sleep(Duration::from_millis(2)),
            }
            assert!(start.elapsed() < Duration::from_secs(10), "no wake");
        }
        assert!(start.elapsed() >= Duration::from_millis(40));
        assert_eq!(timer.pending(), 1, "the 60 s deadline is still to come");
        timer
            .wake_at(&event, Instant::now() + Duration::from_millis(1))
            .unwrap();
        assert_eq!(
            timer.thread.as_ref().map(|t| t.thread().id()),
            Some(thread),
            "no new thread"
        );
        // Drop stops and joins the thread although a deadline 60 s away is pending.
        assert!(lock_deadlines(&timer.shared.0).running);
        let dropped = Instant::now();
        drop(timer);
        assert!(dropped.elapsed() < Duration::from_secs(5));
    }

    /// With no deadline left the thread ends; the next removal starts one again.
    #[test]
    fn the_thread_ends_when_idle_and_comes_again() {
        let event = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let mut timer = EjectTimer::default();
        for round in 0..2 {
            timer
                .wake_at(&event, Instant::now() + Duration::from_millis(20))
                .unwrap();
            let start = Instant::now();
            while lock_deadlines(&timer.shared.0).running {
                assert!(start.elapsed() < Duration::from_secs(10), "round {round}");
                std::thread::sleep(Duration::from_millis(2));
            }
            assert_eq!(event.read().unwrap(), 1, "round {round}");
        }
    }
}

#[cfg(test)]
mod cold_plugged_id_tests {
    use super::*;

    /// The ids of the devices InstanceStart plugs: the client's for those configured
    /// through the API; the command line's get Cloud Hypervisor's kind of made-up id, one
    /// no configured device has (here `_vfio0` is a client's).
    #[test]
    fn command_line_devices_get_ids_no_configured_device_has() {
        let (_, requests) = std::sync::mpsc::channel();
        let config = crate::config::VmConfig {
            machine: crate::config::MachineConfig::default(),
            boot: super::super::default_boot_source(),
        };
        let mut controller = super::super::ApiController::new(
            requests,
            EventFd::new(0).unwrap(),
            config,
            Box::new(|| Box::new(std::io::sink())),
        );
        controller.set_pci_options(crate::config::PciOptions {
            gpus: vec!["0000:41:00.0".into()],
            vfio_user: vec!["/run/cli.sock".into()],
            ..Default::default()
        });
        let api = GpuBody::new("_vfio0", None, Some("/run/api.sock".into()));
        controller.put_gpu(api).unwrap();
        let ids = controller.cold_plugged_ids();
        let expected: BTreeMap<String, String> = [
            ("/run/api.sock", "_vfio0"),
            ("0000:41:00.0", "_vfio1"),
            ("/run/cli.sock", "_user_device0"),
        ]
        .into_iter()
        .map(|(backend, id)| (backend.to_string(), id.to_string()))
        .collect();
        assert_eq!(ids, expected);
    }
}
