//! The VMM thread's side of the API: holds the pre-boot configuration, builds or
//! restores the machine on request, and serves actions while it runs.

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::mpsc::Receiver;
use std::sync::Arc;

use gpuvm_arch::x86_64::boot::BootSource;
use vmm_sys_util::eventfd::EventFd;

use crate::action::{
    absolute_path, ActionError, ActionRequest, ActionResult, BootSourceBody, GpuBody,
    InstanceState, LoadOverrides, MachineConfigBody, RestoreModeBody, SnapshotLoadBody, VmmAction,
    VmmData,
};
use crate::config::{MachineConfig, PciOptions, VmConfig};
use crate::machine::{Machine, RunControl};
use crate::metrics::{Metrics, METRICS};
use crate::snapshot::RestoreMode;

mod balloon;
mod client;
mod configure;
pub mod mmds;
mod resize;
mod running;
#[cfg(test)]
mod tests;

use configure::replace_or_push;
use running::{patch_drive, RunningApi};

/// Passthrough devices one VM may have (bus 0 has 31 free slots; GPUs come with
/// companions such as audio functions).
pub const MAX_GPUS: usize = 16;

/// Makes the serial console's output stream for a new machine.
pub type SerialOutFactory = Box<dyn Fn() -> Box<dyn Write + Send> + Send>;

/// Builds a machine for InstanceStart with the configured passthrough devices.
pub type BuildFn = Box<
    dyn Fn(&VmConfig, &PciOptions, Box<dyn Write + Send>) -> Result<Machine, crate::Error> + Send,
>;

/// A machine the API created, and whether it should run at once.
pub struct Started {
    pub machine: Machine,
    /// Restored with `resume_vm: false`: wait for PATCH /vm Resumed before running.
    pub paused: bool,
}

/// What a paused, not yet running machine was told.
#[derive(Debug, PartialEq, Eq)]
pub enum BeforeRun {
    Run,
    /// SendCtrlAltDel, or the API went away: end without running.
    End,
}

pub struct ApiController {
    requests: Receiver<ActionRequest>,
    event: EventFd,
    machine_config: MachineConfig,
    boot: BootSource,
    /// Passthrough devices by id, in the order they were added (their bus order).
    gpus: Vec<GpuBody>,
    /// Window sizes and devices given on the command line.
    pci: PciOptions,
    serial_out: SerialOutFactory,
    build: BuildFn,
    /// ShutdownVmm came before start: [`ApiController::wait_for_start`] returned None.
    shutdown_requested: bool,
    /// A sender into `requests`, for actions made of other actions (a snapshot that
    /// releases GPUs through the guest sends PUT and DELETE /gpus to this controller).
    own_requests: Option<std::sync::mpsc::Sender<ActionRequest>>,
    /// Whether a client created the VM as one document, and its record of it.
    client: client::ClientState,
    /// The VM's MMDS: the API's MMDS actions change it, and every network interface
    /// built for the VM is given it.
    mmds: Arc<gpuvm_mmds::Mmds>,
    /// The ids of the devices plugged at start, by backend, that a restored or handed-over
    /// machine came with ([`ApiController::adopt_record`]).
    adopted_cold_ids: BTreeMap<String, String>,
}

/// The configuration the test guest gets when nobody says otherwise.
pub fn default_boot_source() -> BootSource {
    BootSourceBody::default().into_boot_source()
}

fn instance_info(state: InstanceState, client: &client::ClientState) -> VmmData {
    let mut info = serde_json::json!({
        "app_name": "gpuvm",
        "vmm_version": env!("CARGO_PKG_VERSION"),
        "pid": std::process::id(),
        "state": state,
    });
    if let Some(record) = client.json() {
        info["client_record"] = record;
    }
    VmmData::Json(info)
}

fn metrics(state: InstanceState, machine: Option<&Machine>) -> VmmData {
    let mut json = METRICS.to_json();
    json["vm"] = serde_json::json!({ "state": state });
    if let Some(stats) = machine.and_then(|m| m.lazy_stats()) {
        json["lazy_restore"] = serde_json::json!({
            "faults": stats.faults,
            "faults_served_data": stats.faults_served_data,
            "faults_served_zero": stats.faults_served_zero,
            "total_data_pages": stats.total_data_pages,
            "loaded_data_pages": stats.loaded_data_pages,
            "bytes_loaded_by_faults": stats.bytes_loaded_by_faults,
            "bytes_loaded_background": stats.bytes_loaded_background,
        });
    }
    if let Some(machine) = machine {
        let mappings = machine.devices().dma_mapping_status();
        if !mappings.is_empty() {
            json["dma_mapping"] = dma_mapping_json(&mappings);
        }
    }
    VmmData::Json(json)
}

/// The `dma_mapping` object of GET /metrics: totals over the VM's background mappings of
/// guest RAM (one per kernel VFIO context or vfio-user device), then each one.
fn dma_mapping_json(mappings: &[gpuvm_vfio::dma::DmaStatus]) -> serde_json::Value {
    let each: Vec<serde_json::Value> = mappings
        .iter()
        .map(|m| {
            serde_json::json!({
                "name": m.name,
                "mapped_bytes": m.mapped_bytes,
                "total_bytes": m.total_bytes,
                "done": m.done,
                "error": m.error,
                "elapsed_ms": m.elapsed.as_millis() as u64,
                "parallel": m.parallel,
                "bus_master_refused": m.bus_master_refused,
            })
        })
        .collect();
    serde_json::json!({
        "mapped_bytes": mappings.iter().map(|m| m.mapped_bytes).sum::<u64>(),
        "total_bytes": mappings.iter().map(|m| m.total_bytes).sum::<u64>(),
        "done": mappings.iter().all(|m| m.done),
        "error": mappings.iter().find_map(|m| m.error.clone()),
        "mappings": each,
    })
}

/// Why a restored VM not yet resumed takes no hot-plug or removal.
const RESUME_FIRST: &str =
    "resume the VM first: devices are hot-plugged and removed with the guest's help";

fn not_created() -> ActionError {
    ActionError {
        status: 404,
        message: "the VM is not created".into(),
    }
}

fn started_already() -> ActionError {
    ActionError::wrong_state("the VM has already been started or loaded")
}

impl ApiController {
    pub fn new(
        requests: Receiver<ActionRequest>,
        event: EventFd,
        config: VmConfig,
        serial_out: SerialOutFactory,
    ) -> Self {
        ApiController {
            requests,
            event,
            machine_config: config.machine,
            boot: config.boot,
            gpus: Vec::new(),
            pci: PciOptions::default(),
            serial_out,
            build: Box::new(crate::builder::build_with_pci),
            shutdown_requested: false,
            own_requests: None,
            client: client::ClientState::default(),
            mmds: Arc::default(),
            adopted_cold_ids: BTreeMap::new(),
        }
    }

    /// A sender into the request channel this controller serves (the API server holds
    /// another): lets actions made of other actions send those to the VMM thread.
    pub fn set_request_sender(&mut self, requests: std::sync::mpsc::Sender<ActionRequest>) {
        self.own_requests = Some(requests);
    }

    /// Devices and window sizes from the command line; PUT /gpus adds to them.
    pub fn set_pci_options(&mut self, pci: PciOptions) {
        self.pci = pci;
    }

    /// The devices InstanceStart attaches: the command line's, then the API's; its
    /// network interfaces get the VM's MMDS.
    pub fn pci_options(&self) -> PciOptions {
        let mut pci = self.pci.clone();
        pci.device_resources = self.pci.device_resources.with_mmds(&self.mmds);
        for gpu in &self.gpus {
            if let Some(key) = gpu.backend_key() {
                pci.tuning.insert(key, gpu.tuning());
            }
            if let Some(bdf) = &gpu.host_bdf {
                pci.gpus.push(bdf.clone());
            }
            if let Some(socket) = &gpu.vfio_user_socket {
                pci.vfio_user.push(socket.clone());
            }
        }
        pci
    }

    /// Replaces how InstanceStart builds the machine (default: [`crate::builder::build_with_pci`]).
    pub fn set_builder(&mut self, build: BuildFn) {
        self.build = build;
    }

    /// Serves pre-boot requests until InstanceStart or snapshot/load yields a machine.
    /// None when the API thread has gone (it never does while the socket lives).
    pub fn wait_for_start(&mut self) -> Option<Started> {
        loop {
            let request = self.requests.recv().ok()?;
            let _ = self.event.read();
            let (result, started) = self.pre_boot(request.action);
            let _ = request.reply.send(result);
            if started.is_some() || self.shutdown_requested {
                return started;
            }
        }
    }

    fn pre_boot(&mut self, action: VmmAction) -> (ActionResult, Option<Started>) {
        let state = if self.client.is_created() {
            InstanceState::Created
        } else {
            InstanceState::NotStarted
        };
        let result = match action {
            VmmAction::GetInstanceInfo => Ok(instance_info(state, &self.client)),
            VmmAction::CreateVm { actions, record } => {
                if self.client.is_created() {
                    Err(ActionError::wrong_state("the VM is already created"))
                } else {
                    self.batch(actions).inspect(|_| self.client.create(record))
                }
            }
            VmmAction::BootCreated if !self.client.is_created() => Err(not_created()),
            VmmAction::BootCreated => return self.pre_boot(VmmAction::StartInstance),
            VmmAction::AddDevice(add) => self.add_device(add),
            VmmAction::Recorded { action, entry } => {
                let (result, started) = self.pre_boot(*action);
                if result.is_ok() {
                    self.client.remember(entry);
                }
                return (result, started);
            }
            VmmAction::Remember(entries) => Ok(self.client.remember_all(entries)),
            action @ (VmmAction::PutMmds(_)
            | VmmAction::PatchMmds(_)
            | VmmAction::GetMmds
            | VmmAction::SetMmdsSizeLimit(_)
            | VmmAction::PutMmdsConfig(_)) => {
                let nets: Vec<&str> = self
                    .pci
                    .virtio
                    .nets
                    .iter()
                    .map(|net| net.iface_id.as_str())
                    .collect();
                mmds::act(&self.mmds, action, mmds::Stage::PreBoot { nets: &nets })
            }
            VmmAction::RestoreWithTaps { .. } if self.client.is_created() => Err(
                ActionError::wrong_state("the VM is already created: restore into a new gpuvm"),
            ),
            VmmAction::RestoreWithTaps { load, taps } => return self.restore_with_taps(load, taps),
            VmmAction::GetMetrics => Ok(metrics(state, None)),
            VmmAction::GetMachineConfig => {
                Ok(VmmData::Json(serde_json::json!(self.machine_config_body())))
            }
            VmmAction::PatchMachineConfig(patch) => {
                // Read and replaced here, on the VMM thread: no request comes between.
                let mut body = self.machine_config_body();
                patch.apply(&mut body);
                return self.pre_boot(VmmAction::PutMachineConfig(body));
            }
            VmmAction::PutMachineConfig(body) => body.checked_max_vcpus().and_then(|max| {
                let hotplug_size = body.checked_ram_hotplug_size()?;
                let numa = body.numa.as_ref().map(|n| n.to_options()).transpose()?;
                let root_ports = body.checked_pcie_root_ports()?;
                body.to_config().map(|config| {
                    self.machine_config = config;
                    self.pci.max_vcpus = max;
                    self.pci.ram_hotplug_size = hotplug_size;
                    if let Some(numa) = numa {
                        self.pci.numa = numa;
                    }
                    if let Some(ports) = root_ports {
                        self.pci.pcie_root_ports = ports;
                    }
                    VmmData::Empty
                })
            }),
            VmmAction::Resize {
                desired_vcpus,
                desired_ram,
            } => self.resize_pre_boot(desired_vcpus, desired_ram),
            VmmAction::PutBootSource(body) => self.set_boot_source(body),
            VmmAction::PutGpu(body) => self.put_gpu(body),
            VmmAction::RemoveDevice(id) => {
                let result = self.remove_configured(&self.client.device_id(&id));
                if result.is_ok() {
                    self.client.forget(&id);
                }
                result
            }
            VmmAction::DeleteGpu(id) => match self.gpus.iter().position(|g| g.gpu_id == id) {
                Some(index) => {
                    self.gpus.remove(index);
                    Ok(VmmData::Empty)
                }
                None => Err(ActionError {
                    status: 404,
                    message: format!("no device with id {id:?} is configured"),
                }),
            },
            VmmAction::PutDrive(body) => self.put_drive(body),
            VmmAction::PutFs(body) => absolute_path(&body.socket, "socket").and_then(|()| {
                self.put_virtio(|v| replace_or_push(&mut v.fs, body, |f| f.tag.clone()))
            }),
            VmmAction::PutNetworkInterface(body) => {
                let id = body.iface_id.clone();
                let result =
                    self.put_virtio(|v| replace_or_push(&mut v.nets, body, |n| n.iface_id.clone()));
                if result.is_ok() {
                    // Replaced by one that names its tap: descriptors passed before close.
                    self.pci.device_resources.take(&id);
                }
                result
            }
            VmmAction::PutNetworkInterfaceFds { config, fds } => self.put_net_fds(config, fds),
            VmmAction::PassTaps { iface_id, fds } => {
                let taps = fds
                    .into_iter()
                    .map(gpuvm_virtio::net::Tap::from_fd)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| {
                        ActionError::bad_request(format!("network interface {iface_id}: {e}"))
                    });
                taps.map(|taps| {
                    self.pci.device_resources.insert(&iface_id, taps);
                    VmmData::Empty
                })
            }
            VmmAction::PutVsock(body) => absolute_path(&body.uds_path, "uds_path")
                .and_then(|()| self.put_virtio(|v| v.vsock = Some(body))),
            VmmAction::PutEntropy(body) => body
                .source
                .as_deref()
                .map_or(Ok(()), |source| absolute_path(source, "source"))
                .and_then(|()| self.put_virtio(|v| v.rng = Some(body))),
            VmmAction::PutPciSegments(body) => body.apply(&mut self.pci).map(|()| VmmData::Empty),
            VmmAction::HotplugVirtio(_) => Err(ActionError::wrong_state(
                "the VM is not running: a device added before boot is configured, not hot-plugged",
            )),
            VmmAction::PatchDrive(_) => Err(ActionError::wrong_state(
                "PATCH /drives changes a running VM's drive; before start, PUT it again",
            )),
            action @ (VmmAction::PutBalloon(_)
            | VmmAction::PatchBalloon(_)
            | VmmAction::GetBalloon
            | VmmAction::GetBalloonStats
            | VmmAction::PatchBalloonStats(_)) => self.balloon_pre_boot(action),
            VmmAction::StartInstance => {
                let config = VmConfig {
                    machine: self.machine_config.clone(),
                    boot: self.boot.clone(),
                };
                let pci = self.pci_options();
                if pci.virtio.balloon.is_some() && !pci.is_empty() {
                    return (Err(balloon::passthrough_refusal()), None);
                }
                return match (self.build)(&config, &pci, (self.serial_out)()) {
                    Ok(machine) => (
                        Ok(VmmData::Empty),
                        Some(Started {
                            machine,
                            paused: false,
                        }),
                    ),
                    Err(error) => (
                        Err(ActionError::bad_request(format!(
                            "cannot start the VM: {error}"
                        ))),
                        None,
                    ),
                };
            }
            VmmAction::LoadSnapshot(body) => return self.load(body, &LoadOverrides::default()),
            VmmAction::LoadSnapshotWith { load, overrides } => return self.load(load, &overrides),
            VmmAction::Batch(actions) => self.batch(actions),
            VmmAction::ShutdownVmm => {
                self.shutdown_requested = true;
                Ok(VmmData::Empty)
            }
            VmmAction::PutLogger(config) => crate::outputs::put_logger(config),
            VmmAction::PutMetrics(config) => crate::outputs::put_metrics(config),
            VmmAction::FlushMetrics => crate::outputs::flush_metrics(),
            VmmAction::SendCtrlAltDel | VmmAction::Pause | VmmAction::Resume => {
                Err(ActionError::wrong_state(
                    "the VM is not running (PUT /actions InstanceStart first)",
                ))
            }
            VmmAction::CreateSnapshot(_) => Err(ActionError::wrong_state(
                "there is no VM to snapshot yet (PUT /actions InstanceStart first)",
            )),
            VmmAction::LiveUpdate { .. } => Err(ActionError::wrong_state(
                "there is no running VM to hand over (PUT /actions InstanceStart first)",
            )),
        };
        (result, None)
    }

    fn set_boot_source(&mut self, body: BootSourceBody) -> ActionResult {
        let files = [
            ("kernel_image_path", "kernel image", &body.kernel_image_path),
            ("initrd_path", "initrd", &body.initrd_path),
        ];
        for (field, what, path) in files {
            let Some(path) = path else { continue };
            absolute_path(path, field)?;
            gpuvm_arch::x86_64::boot::open_boot_file(path).map_err(|error| {
                ActionError::bad_request(format!("cannot open {what} {}: {error}", path.display()))
            })?;
        }
        self.boot = body.into_boot_source();
        Ok(VmmData::Empty)
    }

    fn load(
        &mut self,
        mut body: SnapshotLoadBody,
        overrides: &LoadOverrides,
    ) -> (ActionResult, Option<Started>) {
        if let Some(mem_file) = body.mem_file_path.take() {
            // Firecracker's layout: a state file and a memory file, staged as a directory.
            let staged = absolute_path(&body.snapshot_path, "snapshot_path")
                .and_then(|()| absolute_path(&mem_file, "mem_file_path"))
                .and_then(|()| {
                    crate::snapshot::files::stage(&body.snapshot_path, &mem_file)
                        .map_err(ActionError::bad_request)
                });
            match staged {
                Ok(dir) => body.snapshot_path = dir,
                Err(error) => return (Err(error), None),
            }
        }
        let mode = match (body.restore_mode, &body.uffd_socket_path) {
            (RestoreModeBody::Eager, _) => RestoreMode::Eager,
            (RestoreModeBody::Lazy, _) => RestoreMode::Lazy,
            (RestoreModeBody::External, Some(socket)) => RestoreMode::External(socket.clone()),
            (RestoreModeBody::External, None) => {
                return (
                    Err(ActionError::bad_request(
                        "restore_mode External needs uffd_socket_path",
                    )),
                    None,
                )
            }
        };
        if body.record_working_set && body.restore_mode != RestoreModeBody::Lazy {
            return (
                Err(ActionError::bad_request(
                    "record_working_set needs restore_mode Lazy (the working set is what a lazy restore's guest faults on)",
                )),
                None,
            );
        }
        if let Err(error) = absolute_path(&body.snapshot_path, "snapshot_path") {
            return (Err(error), None);
        }
        if !self.pci_options().is_empty() {
            return (
                Err(ActionError::bad_request(
                    "a snapshot cannot be loaded into a VM with passthrough devices configured: it brings back the GPUs whose state it holds (give their new place in the load's `gpus`)",
                )),
                None,
            );
        }
        if !self.pci.virtio.is_empty() {
            return (
                Err(ActionError::bad_request(
                    "a snapshot brings its own virtio devices: load it into a VM with none configured",
                )),
                None,
            );
        }
        for gpu in &body.gpus {
            if let Err(error) = gpu.validate(None) {
                return (Err(error), None);
            }
        }
        let restored = crate::builder::restore_with_overrides(
            &body.snapshot_path,
            &mode,
            (self.serial_out)(),
            &body.gpus,
            &self.pci.device_resources.with_mmds(&self.mmds),
            overrides,
        );
        match restored {
            Ok((mut machine, timings)) => {
                if body.record_working_set {
                    machine.record_working_set();
                }
                Metrics::add(&METRICS.snapshots_loaded, 1);
                log::info!("snapshot loaded through the API: {timings:?}");
                if !body.resume_vm {
                    // Nothing competes for CPUs while it waits for `Resumed`: load now.
                    machine.release_lazy_loading();
                }
                self.machine_config = machine.config().clone();
                self.adopt_record(&machine);
                (
                    Ok(VmmData::Empty),
                    Some(Started {
                        machine,
                        paused: !body.resume_vm,
                    }),
                )
            }
            Err(error) => (
                Err(ActionError::bad_request(format!(
                    "cannot load the snapshot: {error}"
                ))),
                None,
            ),
        }
    }

    /// For a machine loaded with `resume_vm: false`: serves requests until it is resumed
    /// (its vCPUs have not run yet, so it is exactly at the snapshot).
    pub fn wait_for_resume(&mut self, machine: &Machine) -> BeforeRun {
        let state = InstanceState::Paused;
        loop {
            let Ok(request) = self.requests.recv() else {
                return BeforeRun::End;
            };
            let _ = self.event.read();
            let (action, recorded) = client::unwrap_recorded(request.action);
            let (result, next) = match action {
                VmmAction::Remember(entries) => (Ok(self.client.remember_all(entries)), None),
                VmmAction::Recorded { .. } => (
                    Err(ActionError::bad_request("a recorded action records one action")),
                    None,
                ),
                // As a running VM's: its devices are there, only its vCPUs wait.
                VmmAction::GetInstanceInfo => {
                    let info = instance_info(state, &self.client);
                    let devices = machine.devices();
                    let info = running::with_hot_plugged(info, devices);
                    let cold_ids = self.cold_plugged_ids();
                    (
                        Ok(running::with_pci_devices(info, devices, &cold_ids)),
                        None,
                    )
                }
                action @ (VmmAction::PutMmds(_)
                | VmmAction::PatchMmds(_)
                | VmmAction::GetMmds
                | VmmAction::SetMmdsSizeLimit(_)
                | VmmAction::PutMmdsConfig(_)) => {
                    (mmds::act(&self.mmds, action, mmds::Stage::Started), None)
                }
                VmmAction::GetMetrics => (Ok(metrics(state, Some(machine))), None),
                VmmAction::GetMachineConfig => (Ok(machine_config_json(machine)), None),
                VmmAction::Pause => (Ok(VmmData::Empty), None),
                VmmAction::Resume => (Ok(VmmData::Empty), Some(BeforeRun::Run)),
                VmmAction::SendCtrlAltDel => (Ok(VmmData::Empty), Some(BeforeRun::End)),
                VmmAction::CreateSnapshot(_) => (
                    Err(ActionError::wrong_state(
                        "this VM was loaded and has not run since; its snapshot is the one it came from",
                    )),
                    None,
                ),
                VmmAction::PatchDrive(body) => (patch_drive(machine, body), None),
                VmmAction::Resize {
                    desired_vcpus,
                    desired_ram,
                } => (
                    resize::resize_before_resume(machine, desired_vcpus, desired_ram),
                    None,
                ),
                action @ (VmmAction::PutBalloon(_)
                | VmmAction::PatchBalloon(_)
                | VmmAction::GetBalloon
                | VmmAction::GetBalloonStats
                | VmmAction::PatchBalloonStats(_)) => {
                    (balloon::balloon_running(machine, action), None)
                }
                VmmAction::ShutdownVmm => (Ok(VmmData::Empty), Some(BeforeRun::End)),
                VmmAction::PutLogger(config) => (crate::outputs::put_logger(config), None),
                VmmAction::PutMetrics(config) => (crate::outputs::put_metrics(config), None),
                VmmAction::FlushMetrics => (crate::outputs::flush_metrics(), None),
                VmmAction::Batch(_) => (Err(started_already()), None),
                VmmAction::DeleteGpu(_)
                | VmmAction::RemoveDevice(_)
                | VmmAction::HotplugVirtio(_) => (Err(ActionError::wrong_state(RESUME_FIRST)), None),
                // As a running VM answers a hot-plug it cannot take now.
                VmmAction::AddDevice(request) => (
                    request
                        .translate(self.client.recorded())
                        .and_then(|add| {
                            Err(ActionError::bad_request(format!(
                                "{} hot-plug refused: {RESUME_FIRST}",
                                add.noun
                            )))
                        }),
                    None,
                ),
                VmmAction::LiveUpdate { .. } => (
                    Err(ActionError::wrong_state(
                        "live update of a VM that has not run yet is not supported: resume it first",
                    )),
                    None,
                ),
                VmmAction::PutMachineConfig(_)
                | VmmAction::PatchMachineConfig(_)
                | VmmAction::PutBootSource(_)
                | VmmAction::PutGpu(_)
                | VmmAction::PutDrive(_)
                | VmmAction::PutFs(_)
                | VmmAction::PutNetworkInterface(_)
                | VmmAction::PutNetworkInterfaceFds { .. }
                | VmmAction::PassTaps { .. }
                | VmmAction::PutVsock(_)
                | VmmAction::PutEntropy(_)
                | VmmAction::PutPciSegments(_)
                | VmmAction::StartInstance
                | VmmAction::CreateVm { .. }
                | VmmAction::BootCreated
                | VmmAction::RestoreWithTaps { .. }
                | VmmAction::LoadSnapshot(_)
                | VmmAction::LoadSnapshotWith { .. } => (Err(started_already()), None),
            };
            if let (Ok(_), Some(entry)) = (&result, recorded) {
                self.client.remember(entry);
            }
            let _ = request.reply.send(result);
            if let Some(next) = next {
                return next;
            }
        }
    }

    /// The machine configuration as PUT /machine-config takes it (what GET shows).
    fn machine_config_body(&self) -> MachineConfigBody {
        let mut body =
            MachineConfigBody::from_config(&self.machine_config).with_max_vcpus(self.pci.max_vcpus);
        body.ram_hotplug_size =
            (self.pci.ram_hotplug_size > 0).then_some(self.pci.ram_hotplug_size);
        body.numa = crate::action::NumaBody::from_options(&self.pci.numa);
        body.pcie_root_ports = (self.pci.pcie_root_ports > 0).then_some(self.pci.pcie_root_ports);
        body
    }

    /// Takes the client's record `machine` came with (kept by the snapshot it was
    /// restored from, or handed over by a live update), when it has one: the client's
    /// configuration and its devices under their ids, as before.
    pub fn adopt_record(&mut self, machine: &Machine) {
        if let Some(record) = &machine.devices().client_record {
            self.client.restored(record.clone());
        }
        // The ids the old process named its devices plugged at start by.
        self.adopted_cold_ids = machine.devices().cold_plugged_ids.clone();
    }

    /// Serves `mmds` as the VM's MMDS: the one a live update handed over, which the VM's
    /// interfaces answer from already.
    pub fn adopt_mmds(&mut self, mmds: Arc<gpuvm_mmds::Mmds>) {
        self.mmds = mmds;
    }

    /// The part that serves a running machine.
    pub fn into_run_control(self) -> Box<dyn RunControl> {
        // Requests queued behind the one that started or resumed the machine had their
        // wake-up read with it: the run loop is woken once to serve them.
        let _ = self.event.write(1);
        let cold = self.cold_plugged_ids();
        Box::new(RunningApi::new(
            self.requests,
            self.own_requests,
            self.event,
            cold,
            self.client,
            self.mmds,
        ))
    }

    /// The ids of the passthrough devices InstanceStart plugs, by backend (the host PCI
    /// address or socket path they were configured with): the client's ids for the API's;
    /// the command line's, which have none, get one made up as Cloud Hypervisor's front
    /// end names a device given without one (`_vfio0`, `_user_device0`), free among the
    /// configured devices' ids.
    fn cold_plugged_ids(&self) -> BTreeMap<String, String> {
        let mut ids: BTreeMap<String, String> = self.adopted_cold_ids.clone();
        ids.extend(
            (self.gpus.iter()).filter_map(|gpu| Some((gpu.backend_key()?, gpu.gpu_id.clone()))),
        );
        let mut taken = self.configured_ids();
        let command_line = (self.pci.gpus.iter().map(|bdf| (bdf.clone(), false)))
            .chain((self.pci.vfio_user.iter()).map(|socket| (socket.display().to_string(), true)));
        for (backend, vfio_user) in command_line {
            if ids.contains_key(&backend) {
                continue;
            }
            let id = client::fresh_id(&taken, running::made_up_id_prefix(vfio_user));
            taken.push(id.clone());
            ids.insert(backend, id);
        }
        ids
    }
}

impl ApiController {
    /// Whether ShutdownVmm ended [`ApiController::wait_for_start`] (the process should
    /// end without running a VM).
    pub fn shutdown_requested(&self) -> bool {
        self.shutdown_requested
    }

    /// The ids of the devices configured so far, as gpuvm's actions name them.
    fn configured_ids(&self) -> Vec<String> {
        let v = &self.pci.virtio;
        let mut ids: Vec<String> = self.gpus.iter().map(|g| g.gpu_id.clone()).collect();
        ids.extend(v.drives.iter().map(|d| d.drive_id.clone()));
        ids.extend(v.vhost_user_drives.iter().map(|d| d.drive_id.clone()));
        ids.extend(v.nets.iter().map(|n| n.iface_id.clone()));
        ids.extend(v.fs.iter().map(|f| f.tag.clone()));
        ids.extend(v.vhost_user.iter().map(|u| u.id.clone()));
        if v.vsock.is_some() {
            ids.push("vsock".into());
        }
        ids
    }

    /// [`VmmAction::AddDevice`] before boot: the device joins the configuration (on its
    /// PCI segment), all or nothing.
    fn add_device(&mut self, request: crate::action::AddDeviceRequest) -> ActionResult {
        if !self.client.is_created() {
            return Err(not_created());
        }
        let add = request.translate(self.client.recorded())?;
        let (segment, section, body) = (add.segment, add.section.clone(), add.body.clone());
        let client::SettledDevice {
            action,
            client_id,
            device_id,
        } = self.client.settle(add, &self.configured_ids())?;
        let placed = client::segment_action(&device_id, segment);
        self.pre_boot(action).0?;
        if let Some(place) = placed {
            if let Err(error) = self.pre_boot(place).0 {
                let _ = self.remove_configured(&device_id);
                return Err(error);
            }
        }
        self.client.record(&client_id, &device_id, section, body);
        Ok(VmmData::Empty)
    }

    /// [`VmmAction::RestoreWithTaps`]: the taps for the snapshot's interfaces, then the
    /// load; a failed load closes the taps.
    fn restore_with_taps(
        &mut self,
        load: SnapshotLoadBody,
        taps: Vec<(String, Vec<std::os::fd::OwnedFd>)>,
    ) -> (ActionResult, Option<Started>) {
        let ids: Vec<String> = taps.iter().map(|(id, _)| id.clone()).collect();
        for (iface_id, fds) in taps {
            let (result, _) = self.pre_boot(VmmAction::PassTaps { iface_id, fds });
            if let Err(error) = result {
                ids.iter()
                    .for_each(|id| drop(self.pci.device_resources.take(id)));
                return (Err(error), None);
            }
        }
        let (result, started) = self.load(load, &LoadOverrides::default());
        if result.is_ok() {
            self.client.ensure_created();
        } else {
            ids.iter()
                .for_each(|id| drop(self.pci.device_resources.take(id)));
        }
        (result, started)
    }

    /// Configures the VM from a list of actions (a config file) before anything runs:
    /// all of them, or none (the first refusal is the error).
    pub fn configure(&mut self, actions: Vec<VmmAction>) -> Result<(), ActionError> {
        self.batch(actions).map(|_| ())
    }

    /// The machine and boot source configured so far.
    pub fn vm_config(&self) -> VmConfig {
        VmConfig {
            machine: self.machine_config.clone(),
            boot: self.boot.clone(),
        }
    }

    /// [`VmmAction::Batch`]: every configuration action, or none of them. A batch is one
    /// configuration: a device id in it twice is refused (a PUT outside a batch replaces).
    fn batch(&mut self, actions: Vec<VmmAction>) -> ActionResult {
        let mut ids = std::collections::BTreeSet::new();
        for id in actions.iter().filter_map(VmmAction::device_id) {
            if !ids.insert(id.clone()) {
                return Err(ActionError::bad_request(format!(
                    "device id {id:?} appears twice"
                )));
            }
        }
        let saved = (
            self.machine_config.clone(),
            self.boot.clone(),
            self.gpus.clone(),
            self.pci.clone(),
        );
        for action in actions {
            let configures = matches!(
                action,
                VmmAction::PutMachineConfig(_)
                    | VmmAction::PatchMachineConfig(_)
                    | VmmAction::PutBootSource(_)
                    | VmmAction::PutGpu(_)
                    | VmmAction::PutDrive(_)
                    | VmmAction::PutFs(_)
                    | VmmAction::PutNetworkInterface(_)
                    | VmmAction::PutVsock(_)
                    | VmmAction::PutEntropy(_)
                    | VmmAction::PutBalloon(_)
                    | VmmAction::PutPciSegments(_)
            );
            let result = if configures {
                self.pre_boot(action).0
            } else {
                Err(ActionError::bad_request(format!(
                    "a batch holds configuration actions only, not {action:?}"
                )))
            };
            if let Err(error) = result {
                (self.machine_config, self.boot, self.gpus, self.pci) = saved;
                return Err(error);
            }
        }
        Ok(VmmData::Empty)
    }
}

fn machine_config_json(machine: &Machine) -> VmmData {
    let mut body = MachineConfigBody::from_config(machine.config());
    // The vCPUs it has now (hot-plug changes them), and how many it may have.
    body.vcpu_count = machine.vcpu_count();
    // A VM with vCPU hot-plug always says how far it may grow.
    body.max_vcpus = machine.has_vcpu_hotplug().then(|| machine.max_vcpus());
    // Likewise the RAM it has now, hot-plugged RAM included, and the room for more.
    body.mem_size_mib = machine.ram_size() >> 20;
    body.ram_hotplug_size = machine.ram_hotplug_size();
    let root_ports = (machine.devices().pci_hotplug.as_ref())
        .map_or(0, |hotplug| hotplug.save_root_ports().len());
    body.pcie_root_ports = (root_ports > 0).then_some(root_ports as u8);
    VmmData::Json(serde_json::json!(body))
}
