//! The `/api/v1/` routes: Cloud Hypervisor's paths, bodies, status codes and VM states
//! on gpuvm's actions.

use std::os::fd::OwnedFd;
use std::path::PathBuf;

use serde_json::{json, Value};

use gpuvm_vmm::action::{
    ActionError, ActionResult, AddDevice, AddDeviceRequest, ClientRecord, GpuBody, RestoreModeBody,
    SnapshotCreateBody, SnapshotLoadBody, VmmAction, VmmData,
};

use super::config::{
    check_other, DeviceConfig, DiskConfig, FsConfig, NetConfig, RemoveDevice, RestoreConfig,
    SnapshotConfig, VmConfig, VsockConfig,
};
use super::{record, translate, PREFIX};
use crate::http::{Method, Request, Response};

#[path = "resize.rs"]
mod resize;
#[cfg(test)]
#[path = "resize_tests.rs"]
mod resize_tests;

/// Carries one action to the VMM thread and brings its answer back.
pub type Dispatch<'a> = &'a dyn Fn(VmmAction) -> ActionResult;

/// An error answer in Cloud Hypervisor's shape.
pub(crate) fn fault(status: u16, message: impl Into<String>) -> Response {
    // Cloud Hypervisor's error body: a JSON array of messages, the error first and its
    // causes after (ch-remote reads it so); gpuvm's message carries its causes already.
    Response::json(status, &serde_json::json!([message.into()]))
}

fn from_error(error: ActionError) -> Response {
    fault(error.status, error.message)
}

fn method_not_allowed(allow: &'static str) -> Response {
    let mut response = fault(405, format!("method not allowed here (allowed: {allow})"));
    response.allow = Some(allow);
    response
}

fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, Response> {
    if body.is_empty() {
        return Err(fault(400, "this request needs a JSON body"));
    }
    serde_json::from_slice(body).map_err(|e| fault(400, format!("invalid JSON body: {e}")))
}

/// Where the VM is, in Cloud Hypervisor's words (the controller's state); None before
/// vm.create.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum VmState {
    Created,
    Running,
    Paused,
}

impl VmState {
    fn name(self) -> &'static str {
        match self {
            VmState::Created => "Created",
            VmState::Running => "Running",
            VmState::Paused => "Paused",
        }
    }
}

/// What the controller says of the VM: its state, the client's record of it and the PCI
/// devices it lists (GetInstanceInfo's `pci_devices`).
struct Seen {
    state: Option<VmState>,
    record: ClientRecord,
    pci_devices: Vec<Value>,
}

fn look(dispatch: Dispatch) -> Result<Seen, Response> {
    let info = match dispatch(VmmAction::GetInstanceInfo).map_err(from_error)? {
        VmmData::Json(info) => info,
        VmmData::Empty => Value::Null,
    };
    let state = match info["state"].as_str() {
        Some("Running") => Some(VmState::Running),
        Some("Paused") => Some(VmState::Paused),
        Some("Created") => Some(VmState::Created),
        _ => None,
    };
    let record = serde_json::from_value(info["client_record"].clone()).unwrap_or_default();
    let pci_devices = info["pci_devices"].as_array().cloned().unwrap_or_default();
    Ok(Seen {
        state,
        record,
        pci_devices,
    })
}

fn state(dispatch: Dispatch) -> Result<Option<VmState>, Response> {
    look(dispatch).map(|seen| seen.state)
}

fn not_created() -> Response {
    fault(404, "the VM is not created (PUT /api/v1/vm.create first)")
}

fn unsupported(what: &str, why: &str) -> Response {
    fault(400, format!("{what} is not supported by gpuvm: {why}"))
}

fn empty(result: ActionResult) -> Response {
    match result {
        Ok(VmmData::Empty) => Response::no_content(),
        Ok(VmmData::Json(_)) => Response::no_content(),
        Err(error) => from_error(error),
    }
}

/// Runs a state-changing action on a booted VM: 404 before vm.create, 405 (Cloud
/// Hypervisor's "not booted") where the controller says the state is wrong.
fn on_booted(dispatch: Dispatch, action: VmmAction) -> Response {
    match state(dispatch) {
        Err(response) => return response,
        Ok(None) => return not_created(),
        Ok(Some(VmState::Created)) => {
            return fault(405, "the VM is not booted (PUT /api/v1/vm.boot first)")
        }
        Ok(Some(_)) => {}
    }
    match dispatch(action) {
        Err(error) if error.status == 409 => fault(405, error.message),
        other => empty(other),
    }
}

fn file_url(field: &str, url: &str) -> Result<PathBuf, Response> {
    match url.strip_prefix("file://") {
        Some(path) if path.starts_with('/') => Ok(PathBuf::from(path)),
        _ => Err(fault(
            400,
            format!("{field} {url:?}: gpuvm takes file:///absolute/dir URLs only"),
        )),
    }
}

/// Answers one `/api/v1/...` request; `fds` are the descriptors that came with it.
pub fn handle(request: &Request, fds: Vec<OwnedFd>, dispatch: Dispatch) -> Response {
    let name = request.path[PREFIX.len()..].trim_end_matches('/');
    let name = name.split('?').next().unwrap_or(name);
    use Method::{Get, Put};
    let get_only = |f: &dyn Fn() -> Response| {
        if request.method == Get {
            f()
        } else {
            method_not_allowed("GET")
        }
    };
    let put_only = |f: &dyn Fn() -> Response| {
        if request.method == Put {
            f()
        } else {
            method_not_allowed("PUT")
        }
    };
    match name {
        "vmm.ping" => get_only(&|| {
            Response::json(
                200,
                &json!({
                    "build_version": concat!("gpuvm-", env!("CARGO_PKG_VERSION")),
                    "version": env!("CARGO_PKG_VERSION"),
                    "pid": std::process::id(),
                    "features": ["kvm"],
                }),
            )
        }),
        "vmm.shutdown" => put_only(&|| empty(dispatch(VmmAction::ShutdownVmm))),
        "vm.info" => get_only(&|| info(dispatch)),
        "vm.counters" => get_only(&|| counters(dispatch)),
        "vm.create" => put_only(&|| create(request, dispatch)),
        "vm.boot" => put_only(&|| match dispatch(VmmAction::BootCreated) {
            Err(error) if error.status == 404 => not_created(),
            other => empty(other),
        }),
        "vm.pause" => put_only(&|| on_booted(dispatch, VmmAction::Pause)),
        "vm.resume" => put_only(&|| on_booted(dispatch, VmmAction::Resume)),
        // gpuvm's run ends with its VM: the process exits once the guest is stopped.
        "vm.shutdown" => put_only(&|| on_booted(dispatch, VmmAction::ShutdownVmm)),
        "vm.snapshot" => put_only(&|| {
            let body: SnapshotConfig = match parse(&request.body) {
                Ok(body) => body,
                Err(response) => return response,
            };
            if let Err(message) = check_other("", &body.other) {
                return fault(400, message);
            }
            match file_url("destination_url", &body.destination_url) {
                Ok(path) => on_booted(
                    dispatch,
                    VmmAction::CreateSnapshot(SnapshotCreateBody::full(path)),
                ),
                Err(response) => response,
            }
        }),
        "vm.restore" => {
            // The taps of `net_fds` come with the request (taken once: the route runs once).
            let fds = std::cell::Cell::new(fds);
            put_only(&|| restore(request, dispatch, fds.take()))
        }
        "vm.add-disk" => put_only(&|| add(request, dispatch, Kind::Disk, fds_none(&fds))),
        "vm.add-fs" => put_only(&|| add(request, dispatch, Kind::Fs, fds_none(&fds))),
        "vm.add-vsock" => put_only(&|| add(request, dispatch, Kind::Vsock, fds_none(&fds))),
        "vm.add-device" => put_only(&|| add(request, dispatch, Kind::Device, fds_none(&fds))),
        "vm.add-user-device" => {
            put_only(&|| add(request, dispatch, Kind::UserDevice, fds_none(&fds)))
        }
        "vm.add-net" => {
            // The tap descriptors go with the action (taken once: the route runs once).
            let fds = std::cell::Cell::new(fds);
            put_only(&|| add(request, dispatch, Kind::Net, fds.take()))
        }
        "vm.remove-device" => put_only(&|| {
            let body: RemoveDevice = match parse(&request.body) {
                Ok(body) => body,
                Err(response) => return response,
            };
            // Before boot any device added leaves the configuration; after boot the guest
            // is asked to eject the hot-plugged device, and the answer comes at once (the
            // device goes when the guest ejects it). The controller knows the device by
            // the client's id.
            let result = dispatch(VmmAction::RemoveDevice(body.id.clone()));
            match result {
                Err(error) if error.status == 404 => fault(
                    404,
                    format!(
                        "no device {:?}: gpuvm removes hot-plugged devices, and any device added before boot",
                        body.id
                    ),
                ),
                other => empty(other),
            }
        }),
        "vm.resize" => put_only(&|| resize::resize(request, dispatch)),
        "vm.resize-zone" => put_only(&resize::resize_zone),
        "vm.resize-disk" => {
            put_only(&|| unsupported(name, "disks cannot be resized while attached"))
        }
        "vm.delete" => put_only(&|| {
            unsupported(
                name,
                "a gpuvm process holds one VM for its life: end it with vmm.shutdown",
            )
        }),
        "vm.reboot" => {
            put_only(&|| unsupported(name, "gpuvm ends on a guest reset; start a new gpuvm"))
        }
        "vm.power-button" | "vm.nmi" | "vm.coredump" => {
            put_only(&|| unsupported(name, "not implemented"))
        }
        "vm.add-generic-vhost-user" | "vm.add-pmem" | "vm.add-vdpa" => {
            put_only(&|| unsupported(name, "gpuvm has no such device"))
        }
        "vm.send-migration" | "vm.receive-migration" => put_only(&|| {
            unsupported(
                name,
                "gpuvm has no live migration (use vm.snapshot / vm.restore)",
            )
        }),
        _ => fault(404, format!("no such route: {}", request.path)),
    }
}

/// Descriptors only vm.add-net takes: any others are closed (when `handle` drops them);
/// the route gets none.
fn fds_none(fds: &[OwnedFd]) -> Vec<OwnedFd> {
    if !fds.is_empty() {
        log::warn!(
            "Cloud Hypervisor API: {} descriptors passed with a request that takes none: closed",
            fds.len()
        );
    }
    Vec::new()
}

fn info(dispatch: Dispatch) -> Response {
    let seen = match look(dispatch) {
        Ok(seen) => seen,
        Err(response) => return response,
    };
    let Some(state) = seen.state else {
        return not_created();
    };
    // The controller's machine configuration is what the VM has now (a resize changes
    // it): Cloud Hypervisor's vm.info shows it as boot_vcpus and memory.size.
    let machine = match dispatch(VmmAction::GetMachineConfig) {
        Ok(VmmData::Json(machine)) => Some(machine),
        _ => None,
    };
    let mut config = record::to_config(&seen.record, machine.as_ref());
    if let Some(machine) = &machine {
        if config["cpus"].is_object() {
            config["cpus"]["boot_vcpus"] = machine["vcpu_count"].clone();
        }
        if let Some(mib) = machine["mem_size_mib"].as_u64() {
            if config["memory"].is_object() {
                config["memory"]["size"] = json!(mib << 20);
            }
        }
    }
    let memory = config["memory"]["size"].as_u64().unwrap_or(512 << 20);
    let mut answer = json!({
        "config": config,
        "state": state.name(),
        "memory_actual_size": memory,
    });
    if state != VmState::Created {
        answer["device_tree"] = device_tree(&seen);
    }
    Response::json(200, &answer)
}

/// vm.info's `device_tree` once the VM runs: a node per PCI device gpuvm lists (virtio
/// devices, passthrough devices plugged at boot or hot-plugged), by id, with its address
/// (`ssss:bb:dd.f`). A passthrough device the client configured goes by the client's id
/// for its backend, also where gpuvm's process knows it by another (a live update's new
/// process, a snapshot's restore). gpuvm gives no resources and no parent/child links.
fn device_tree(seen: &Seen) -> Value {
    let nodes = seen.pci_devices.iter().filter_map(|device| {
        let own = device["id"].as_str()?;
        let client_id = (device["backend"].as_str())
            .and_then(|backend| client_id_of_backend(&seen.record, backend));
        let id = client_id.unwrap_or(own).to_string();
        let node = json!({
            "id": id,
            "resources": [],
            "children": [],
            "pci_bdf": device["bdf"],
        });
        Some((id, node))
    });
    Value::Object(nodes.collect())
}

/// The id of the passthrough device the client configured with `backend` (gpuvm's key
/// for it: a `user_devices` entry's socket, the host PCI address that ends a `devices`
/// entry's sysfs path), if the record has one.
fn client_id_of_backend<'a>(record: &'a ClientRecord, backend: &str) -> Option<&'a str> {
    let configured_with = |body: &Value, section: &str| match section {
        "user_devices" => body["socket"].as_str() == Some(backend),
        "devices" => (body["path"].as_str())
            .and_then(|path| std::path::Path::new(path).file_name())
            .is_some_and(|name| name == backend),
        _ => false,
    };
    (record.devices.iter())
        .find(|device| configured_with(&device.body, &device.section))
        .map(|device| device.client_id.as_str())
}

/// vm.counters: gpuvm's counters, as Cloud Hypervisor's map of names to integer maps.
fn counters(dispatch: Dispatch) -> Response {
    match state(dispatch) {
        Ok(Some(_)) => {}
        Ok(None) => return not_created(),
        Err(response) => return response,
    }
    let metrics = match dispatch(VmmAction::GetMetrics) {
        Ok(VmmData::Json(metrics)) => metrics,
        Ok(VmmData::Empty) => Value::Null,
        Err(error) => return from_error(error),
    };
    let mut out = serde_json::Map::new();
    if let Value::Object(groups) = metrics {
        for (group, value) in groups {
            let Value::Object(members) = value else {
                continue;
            };
            let ints: serde_json::Map<String, Value> =
                members.into_iter().filter(|(_, v)| v.is_u64()).collect();
            if !ints.is_empty() {
                out.insert(group, Value::Object(ints));
            }
        }
    }
    Response::json(200, &Value::Object(out))
}

fn create(request: &Request, dispatch: Dispatch) -> Response {
    let config: VmConfig = match parse(&request.body) {
        Ok(config) => config,
        Err(response) => return response,
    };
    // A VM that exists is the answer before the body's rules (as Cloud Hypervisor's);
    // the controller checks it again with the creation itself.
    match state(dispatch) {
        Ok(None) => {}
        Ok(Some(_)) => return fault(409, "the VM is already created"),
        Err(response) => return response,
    }
    if let Err(message) = super::validate::vm_config(&config) {
        return fault(400, message);
    }
    let actions = match translate::vm_config(&config) {
        Ok(actions) => actions,
        Err(message) => return fault(400, message),
    };
    let record = record::of_config(&config);
    match dispatch(VmmAction::CreateVm { actions, record }) {
        Ok(_) => Response::no_content(),
        Err(error) if error.status == 409 => fault(409, "the VM is already created"),
        Err(error) => from_error(error),
    }
}

fn restore(request: &Request, dispatch: Dispatch, tap_fds: Vec<OwnedFd>) -> Response {
    let body: RestoreConfig = match parse(&request.body) {
        Ok(body) => body,
        Err(response) => return response,
    };
    if let Err(message) = check_other("", &body.other) {
        return fault(400, message);
    }
    let net_fds = body.net_fds.clone().unwrap_or_default();
    for (index, net) in net_fds.iter().enumerate() {
        // `fds` (descriptor numbers of Cloud Hypervisor's own process) mean nothing here.
        let other: super::config::Other = net
            .other
            .iter()
            .filter(|(name, _)| name.as_str() != "fds")
            .map(|(name, value)| (name.clone(), value.clone()))
            .collect();
        if let Err(message) = check_other(&format!("net_fds[{index}]."), &other) {
            return fault(400, message);
        }
    }
    let wanted: usize = net_fds.iter().map(|n| n.num_fds).sum();
    if wanted != tap_fds.len() {
        return fault(
            400,
            format!(
                "net_fds asks for {wanted} tap descriptor(s); {} came with the request (SCM_RIGHTS)",
                tap_fds.len()
            ),
        );
    }
    let path = match file_url("source_url", &body.source_url) {
        Ok(path) => path,
        Err(response) => return response,
    };
    // Cloud Hypervisor restores paused unless `resume` (vm.resume runs it). Memory:
    // `Copy` or `prefault: true` loads every page first; `OnDemand`, or no mode at all,
    // is gpuvm's lazy restore.
    let eager = match body.memory_restore_mode.as_deref() {
        None => body.prefault,
        Some(mode) if mode.eq_ignore_ascii_case("copy") => true,
        Some(mode) if mode.eq_ignore_ascii_case("ondemand") => body.prefault,
        Some(other) => {
            return fault(
                400,
                format!("memory_restore_mode = {other:?}: Copy or OnDemand"),
            )
        }
    };
    // The taps go with the load, for the snapshot's interfaces that take them.
    let mut fds = tap_fds.into_iter();
    let taps = net_fds
        .iter()
        .map(|net| (net.id.clone(), fds.by_ref().take(net.num_fds).collect()))
        .collect();
    let load = SnapshotLoadBody {
        snapshot_path: path,
        restore_mode: if eager {
            RestoreModeBody::Eager
        } else {
            RestoreModeBody::Lazy
        },
        uffd_socket_path: None,
        mem_file_path: None,
        resume_vm: body.resume,
        record_working_set: false,
        gpus: Vec::new(),
    };
    match dispatch(VmmAction::RestoreWithTaps { load, taps }) {
        Err(error) if error.status == 409 => {
            fault(404, "the VM is already created: restore into a new gpuvm")
        }
        other => empty(other),
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Disk,
    Net,
    Fs,
    Vsock,
    Device,
    UserDevice,
}

impl Kind {
    /// How Cloud Hypervisor names a device added without an id (a share is named by
    /// its tag, the vsock device is the one).
    fn id_prefix(self) -> Option<&'static str> {
        match self {
            Kind::Disk => Some("_disk"),
            Kind::Net => Some("_net"),
            Kind::Device => Some("_vfio"),
            Kind::UserDevice => Some("_user_device"),
            Kind::Fs | Kind::Vsock => None,
        }
    }

    fn noun(self) -> &'static str {
        match self {
            Kind::Disk => "disk",
            Kind::Net => "network interface",
            Kind::Fs => "virtio-fs",
            Kind::Vsock => "vsock",
            Kind::Device | Kind::UserDevice => "GPU",
        }
    }
}

/// vm.add-*: before boot, the device joins the VM's configuration (204); after boot it is
/// hot-plugged (200 with Cloud Hypervisor's PciDeviceInfo). One action: the controller
/// runs this front end's translation (Cloud Hypervisor's rules on the configuration the
/// device joins) against the client's record as it stands, decides which, makes up the
/// id of a device given without one and keeps the record, all in one step.
fn add(request: &Request, dispatch: Dispatch, kind: Kind, tap_fds: Vec<OwnedFd>) -> Response {
    let value: Value = match parse(&request.body) {
        Ok(value) => value,
        Err(response) => return response,
    };
    let translate = move |record: &ClientRecord| {
        let config = record::parsed(record).unwrap_or_else(empty_config);
        validate_added(&config, kind, &value).map_err(ActionError::bad_request)?;
        device_to_add(&config, kind, value, tap_fds).map_err(ActionError::bad_request)
    };
    match dispatch(VmmAction::AddDevice(AddDeviceRequest::new(translate))) {
        Ok(VmmData::Empty) => Response::no_content(),
        Ok(VmmData::Json(answer)) => match answer["bdf"].as_str() {
            Some(bdf) => Response::json(200, &json!({"id": answer["id"], "bdf": bdf})),
            None => fault(
                500,
                "the hot-plugged device has no PCI address in gpuvm's answer",
            ),
        },
        Err(error) if error.status == 404 => not_created(),
        Err(error) => from_error(error),
    }
}

/// A configuration with nothing in it (where the client's record is not one).
fn empty_config() -> VmConfig {
    serde_json::from_value(json!({"payload": {}})).expect("an empty VmConfig parses")
}

/// The [`AddDevice`] a vm.add-* body stands for: the device in gpuvm's terms, the id
/// the client gave (if any), its PCI segment and the body for the client's record.
fn device_to_add(
    config: &VmConfig,
    kind: Kind,
    value: Value,
    tap_fds: Vec<OwnedFd>,
) -> Result<AddDevice, String> {
    let bad = |e: serde_json::Error| format!("invalid body: {e}");
    // vm.create checked it; a device's pci_segment must be one of these.
    let segments = translate::num_pci_segments(config).unwrap_or(1);
    let given_id = value["id"].as_str().map(String::from);
    let (action, client_id, segment, section) = match kind {
        Kind::Device => {
            let device: DeviceConfig = serde_json::from_value(value.clone()).map_err(bad)?;
            let mut gpu = translate::device(config.devices.len(), &device)?;
            // Before boot it goes there; a running VM hot-plugs it onto that segment.
            gpu.pci_segment = translate::passthrough_segment("device", &device.other, segments)?;
            (VmmAction::PutGpu(gpu), given_id, 0, "devices")
        }
        Kind::UserDevice => {
            #[derive(serde::Deserialize)]
            struct UserDevice {
                socket: PathBuf,
                #[serde(default)]
                id: Option<String>,
                #[serde(flatten)]
                other: super::config::Other,
            }
            let user: UserDevice = serde_json::from_value(value.clone()).map_err(bad)?;
            check_other("", &user.other)?;
            // The controller names it (the placeholder id is replaced).
            let mut gpu = GpuBody::new("_user_device", None, Some(user.socket));
            gpu.pci_segment = translate::passthrough_segment("device", &user.other, segments)?;
            gpu.validate(None).map_err(|e| e.message)?;
            (VmmAction::PutGpu(gpu), user.id, 0, "user_devices")
        }
        Kind::Disk => {
            let disk: DiskConfig = serde_json::from_value(value.clone()).map_err(bad)?;
            let segment = translate::pci_segment("disk", &disk.other, segments)?;
            let (_, action) = translate::disk(config.disks.len(), &disk)?;
            (action, given_id, segment, "disks")
        }
        Kind::Fs => {
            let fs: FsConfig = serde_json::from_value(value.clone()).map_err(bad)?;
            let segment = translate::pci_segment("fs", &fs.other, segments)?;
            let (_, action) = translate::fs(config.fs.len(), &fs)?;
            // gpuvm names a share by its tag; so does the client when it gave no id.
            let id = fs.id.clone().unwrap_or_else(|| fs.tag.clone());
            (action, Some(id), segment, "fs")
        }
        Kind::Vsock => {
            let vsock: VsockConfig = serde_json::from_value(value.clone()).map_err(bad)?;
            let segment = translate::pci_segment("vsock", &vsock.other, segments)?;
            let (_, action) = translate::vsock(&vsock)?;
            let id = vsock.id.clone().unwrap_or_else(|| "vsock".into());
            (action, Some(id), segment, "vsock")
        }
        Kind::Net => {
            let net: NetConfig = serde_json::from_value(value.clone()).map_err(bad)?;
            let passed = !tap_fds.is_empty();
            let segment = translate::pci_segment("net", &net.other, segments)?;
            // The VMM thread checks that each descriptor is a tap, one per queue pair.
            let (_, body) = translate::net(config.net.len(), &net, passed)?;
            let action = if passed {
                VmmAction::PutNetworkInterfaceFds {
                    config: body,
                    fds: tap_fds,
                }
            } else {
                VmmAction::PutNetworkInterface(body)
            };
            (action, given_id, segment, "net")
        }
    };
    Ok(AddDevice {
        action: Box::new(action),
        client_id,
        id_prefix: kind.id_prefix().unwrap_or_default().to_string(),
        named_by_client_id: kind.id_prefix().is_some(),
        segment,
        noun: kind.noun().to_string(),
        section: section.to_string(),
        body: value,
    })
}

/// Checks the configuration `config` would be with the device `value` of `kind` added
/// ([`super::validate::vm_config`]): what it refuses is about the new device (vm.create
/// checked the rest). A body that does not parse is left to the caller's refusal.
fn validate_added(config: &VmConfig, kind: Kind, value: &Value) -> Result<(), String> {
    let mut candidate = config.clone();
    let parsed = match kind {
        Kind::Disk => serde_json::from_value(value.clone()).map(|d| candidate.disks.push(d)),
        Kind::Net => serde_json::from_value(value.clone()).map(|n| candidate.net.push(n)),
        Kind::Fs => serde_json::from_value(value.clone()).map(|f| candidate.fs.push(f)),
        Kind::Vsock => serde_json::from_value(value.clone()).map(|v| candidate.vsock = Some(v)),
        Kind::Device => serde_json::from_value(value.clone()).map(|d| candidate.devices.push(d)),
        Kind::UserDevice => Ok(()),
    };
    if parsed.is_err() {
        return Ok(());
    }
    super::validate::vm_config(&candidate)
}
