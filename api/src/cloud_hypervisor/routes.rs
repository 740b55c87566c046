//! The `/api/v1/` routes: Cloud Hypervisor's paths, bodies, status codes and VM states
//! on gpuvm's actions.

use std::os::fd::OwnedFd;
use std::path::PathBuf;

use serde_json::{json, Value};

use gpuvm_vmm::action::{
    ActionError, ActionResult, GpuBody, RestoreModeBody, SnapshotCreateBody, SnapshotLoadBody,
    VirtioHotplug, VmmAction, VmmData,
};

use super::config::{
    check_other, DeviceConfig, DiskConfig, FsConfig, NetConfig, RemoveDevice, RestoreConfig,
    SnapshotConfig, VmConfig, VsockConfig,
};
use super::{translate, Session, PREFIX};
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

/// Where the VM is, in Cloud Hypervisor's words; None before vm.create.
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

fn state(session: &Session, dispatch: Dispatch) -> Result<Option<VmState>, Response> {
    let info = match dispatch(VmmAction::GetInstanceInfo).map_err(from_error)? {
        VmmData::Json(info) => info,
        VmmData::Empty => Value::Null,
    };
    Ok(match info["state"].as_str() {
        Some("Running") => Some(VmState::Running),
        Some("Paused") => Some(VmState::Paused),
        _ if session.config().is_some() => Some(VmState::Created),
        _ => None,
    })
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
fn on_booted(session: &Session, dispatch: Dispatch, action: VmmAction) -> Response {
    match state(session, dispatch) {
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
pub fn handle(
    request: &Request,
    fds: Vec<OwnedFd>,
    session: &Session,
    dispatch: Dispatch,
) -> Response {
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
        "vm.info" => get_only(&|| info(session, dispatch)),
        "vm.counters" => get_only(&|| counters(session, dispatch)),
        "vm.create" => put_only(&|| create(request, session, dispatch)),
        "vm.boot" => put_only(&|| match state(session, dispatch) {
            Err(response) => response,
            Ok(None) => not_created(),
            Ok(Some(VmState::Created)) => empty(dispatch(VmmAction::StartInstance)),
            Ok(Some(_)) => fault(409, "the VM is already booted"),
        }),
        "vm.pause" => put_only(&|| on_booted(session, dispatch, VmmAction::Pause)),
        "vm.resume" => put_only(&|| on_booted(session, dispatch, VmmAction::Resume)),
        // gpuvm's run ends with its VM: the process exits once the guest is stopped.
        "vm.shutdown" => put_only(&|| on_booted(session, dispatch, VmmAction::ShutdownVmm)),
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
                    session,
                    dispatch,
                    VmmAction::CreateSnapshot(SnapshotCreateBody::full(path)),
                ),
                Err(response) => response,
            }
        }),
        "vm.restore" => {
            // The taps of `net_fds` come with the request (taken once: the route runs once).
            let fds = std::cell::Cell::new(fds);
            put_only(&|| restore(request, session, dispatch, fds.take()))
        }
        "vm.add-disk" => put_only(&|| add(request, session, dispatch, Kind::Disk, fds_none(&fds))),
        "vm.add-fs" => put_only(&|| add(request, session, dispatch, Kind::Fs, fds_none(&fds))),
        "vm.add-vsock" => {
            put_only(&|| add(request, session, dispatch, Kind::Vsock, fds_none(&fds)))
        }
        "vm.add-device" => {
            put_only(&|| add(request, session, dispatch, Kind::Device, fds_none(&fds)))
        }
        "vm.add-user-device" => {
            put_only(&|| add(request, session, dispatch, Kind::UserDevice, fds_none(&fds)))
        }
        "vm.add-net" => {
            // The tap descriptors go with the action (taken once: the route runs once).
            let fds = std::cell::Cell::new(fds);
            put_only(&|| add(request, session, dispatch, Kind::Net, fds.take()))
        }
        "vm.remove-device" => put_only(&|| {
            let body: RemoveDevice = match parse(&request.body) {
                Ok(body) => body,
                Err(response) => return response,
            };
            // Before boot any device added leaves the configuration; after boot the guest
            // is asked to eject the hot-plugged device, and the answer comes at once (the
            // device goes when the guest ejects it).
            let booted = match state(session, dispatch) {
                Err(response) => return response,
                Ok(None) => return not_created(),
                Ok(Some(state)) => state != VmState::Created,
            };
            // gpuvm names a share by its tag and the vsock device `vsock`.
            let target = match session.config().as_ref() {
                Some(config) if !booted => gpuvm_id(config, &body.id),
                _ => body.id.clone(),
            };
            let result = dispatch(VmmAction::RemoveDevice(target));
            if result.is_ok() {
                if let Some(config) = session.config().as_mut() {
                    forget_device(config, &body.id);
                }
            }
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
        "vm.resize" => put_only(&|| resize::resize(request, session, dispatch)),
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

fn info(session: &Session, dispatch: Dispatch) -> Response {
    let state = match state(session, dispatch) {
        Ok(Some(state)) => state,
        Ok(None) => return not_created(),
        Err(response) => return response,
    };
    let config = session.config().clone();
    let memory = config
        .as_ref()
        .and_then(|c| c.memory.as_ref())
        .map_or(512 << 20, |m| m.size);
    let mut answer = json!({
        "config": config,
        "state": state.name(),
        "memory_actual_size": memory,
    });
    if state != VmState::Created {
        answer["device_tree"] = device_tree(dispatch);
    }
    Response::json(200, &answer)
}

/// vm.info's `device_tree` once the VM runs: a node per PCI device gpuvm lists (virtio
/// devices and hot-plugged passthrough devices), by id, with its address. gpuvm gives no
/// resources and no parent/child links.
fn device_tree(dispatch: Dispatch) -> Value {
    let listed = match dispatch(VmmAction::GetInstanceInfo) {
        Ok(VmmData::Json(info)) => info["pci_devices"].as_array().cloned().unwrap_or_default(),
        _ => Vec::new(),
    };
    let nodes = listed.into_iter().filter_map(|device| {
        let id = device["id"].as_str()?.to_string();
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

/// vm.counters: gpuvm's counters, as Cloud Hypervisor's map of names to integer maps.
fn counters(session: &Session, dispatch: Dispatch) -> Response {
    match state(session, dispatch) {
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

fn create(request: &Request, session: &Session, dispatch: Dispatch) -> Response {
    let config: VmConfig = match parse(&request.body) {
        Ok(config) => config,
        Err(response) => return response,
    };
    match state(session, dispatch) {
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
    match dispatch(VmmAction::Batch(actions)) {
        Ok(_) => {
            *session.config() = Some(config);
            Response::no_content()
        }
        Err(error) => from_error(error),
    }
}

fn restore(
    request: &Request,
    session: &Session,
    dispatch: Dispatch,
    tap_fds: Vec<OwnedFd>,
) -> Response {
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
    match state(session, dispatch) {
        Ok(None) => {}
        Ok(Some(_)) => return fault(404, "the VM is already created: restore into a new gpuvm"),
        Err(response) => return response,
    }
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
    // The taps go to the VMM thread first; the load's interfaces take them.
    let mut fds = tap_fds.into_iter();
    for net in &net_fds {
        let pass = VmmAction::PassTaps {
            iface_id: net.id.clone(),
            fds: fds.by_ref().take(net.num_fds).collect(),
        };
        if let Err(error) = dispatch(pass) {
            return from_error(error);
        }
    }
    let action = VmmAction::LoadSnapshot(SnapshotLoadBody {
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
    });
    let result = dispatch(action);
    if result.is_ok() {
        let machine = dispatch(VmmAction::GetMachineConfig).ok();
        let (vcpus, mib, max_vcpus) = match machine {
            Some(VmmData::Json(m)) => (
                m["vcpu_count"].as_u64().unwrap_or(1),
                m["mem_size_mib"].as_u64().unwrap_or(0),
                m["max_vcpus"].as_u64(),
            ),
            _ => (1, 0, None),
        };
        let restored = json!({
            "payload": {},
            "cpus": {"boot_vcpus": vcpus, "max_vcpus": max_vcpus.unwrap_or(vcpus)},
            "memory": {"size": mib << 20},
        });
        *session.config() = serde_json::from_value(restored).ok();
    }
    empty(result)
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
/// hot-plugged (200 with Cloud Hypervisor's PciDeviceInfo).
fn add(
    request: &Request,
    session: &Session,
    dispatch: Dispatch,
    kind: Kind,
    tap_fds: Vec<OwnedFd>,
) -> Response {
    let mut value: Value = match parse(&request.body) {
        Ok(value) => value,
        Err(response) => return response,
    };
    let booted = match state(session, dispatch) {
        Ok(None) => return not_created(),
        Ok(Some(state)) => state != VmState::Created,
        Err(response) => return response,
    };
    let bad = |e: serde_json::Error| fault(400, format!("invalid body: {e}"));
    let mut guard = session.config();
    let Some(config) = guard.as_mut() else {
        return not_created();
    };
    // A device added without an id gets one no device of this VM has (Cloud Hypervisor's
    // `_disk0`, `_net1`, ...), also after others were removed; a booted VM's devices count
    // too (a restored VM's configuration does not list them).
    if let (Value::Object(fields), Some(prefix)) = (&mut value, kind.id_prefix()) {
        if fields.get("id").is_none_or(Value::is_null) {
            let mut taken = config_ids(config);
            if booted {
                let tree = device_tree(dispatch);
                taken.extend(tree.as_object().into_iter().flat_map(|t| t.keys().cloned()));
            }
            fields.insert("id".into(), json!(fresh_id(&taken, prefix)));
        }
    }
    // Cloud Hypervisor's rules, for the configuration with the device in it.
    if let Err(message) = validate_added(config, kind, &value) {
        return fault(400, message);
    }
    // vm.create checked it; a device's pci_segment must be one of these.
    let segments = translate::num_pci_segments(config).unwrap_or(1);
    let passthrough_segment = |value: &Value| {
        let other: super::config::Other = value
            .get("pci_segment")
            .map(|s| [("pci_segment".to_string(), s.clone())].into())
            .unwrap_or_default();
        translate::passthrough_segment("device", &other, segments)
    };
    if matches!(kind, Kind::Device | Kind::UserDevice) {
        if let Err(message) = passthrough_segment(&value) {
            return fault(400, message);
        }
    }
    // What the device is in gpuvm's terms, its id and PCI segment, and how vm.info's
    // configuration records it.
    type Record<'c> = Box<dyn FnOnce(&mut VmConfig) + 'c>;
    let (id, action, segment, record): (String, VmmAction, u16, Record) = match kind {
        Kind::Device | Kind::UserDevice => {
            let gpu = if kind == Kind::Device {
                let device: DeviceConfig = match serde_json::from_value(value.clone()) {
                    Ok(d) => d,
                    Err(e) => return bad(e),
                };
                let index = config.devices.len();
                match translate::device(index, &device) {
                    Ok(gpu) => (gpu, Some(device)),
                    Err(message) => return fault(400, message),
                }
            } else {
                #[derive(serde::Deserialize)]
                struct UserDevice {
                    socket: PathBuf,
                    id: String,
                    #[serde(flatten)]
                    other: super::config::Other,
                }
                let user: UserDevice = match serde_json::from_value(value.clone()) {
                    Ok(d) => d,
                    Err(e) => return bad(e),
                };
                if let Err(message) = check_other("", &user.other) {
                    return fault(400, message);
                }
                let gpu = GpuBody::new(user.id, None, Some(user.socket));
                (gpu, None)
            };
            let (gpu, device) = gpu;
            let id = gpu.gpu_id.clone();
            let record: Record = match device {
                Some(device) => Box::new(move |c: &mut VmConfig| c.devices.push(device)),
                None => Box::new(move |c: &mut VmConfig| push_user_device(c, value)),
            };
            (id, VmmAction::PutGpu(gpu), 0, record)
        }
        Kind::Disk => {
            let disk: DiskConfig = match serde_json::from_value(value) {
                Ok(d) => d,
                Err(e) => return bad(e),
            };
            let segment = match translate::pci_segment("disk", &disk.other, segments) {
                Ok(segment) => segment,
                Err(message) => return fault(400, message),
            };
            match translate::disk(config.disks.len(), &disk) {
                Ok((id, action)) => (
                    id,
                    action,
                    segment,
                    Box::new(|c: &mut VmConfig| c.disks.push(disk)) as Record,
                ),
                Err(message) => return fault(400, message),
            }
        }
        Kind::Fs => {
            let fs: FsConfig = match serde_json::from_value(value) {
                Ok(d) => d,
                Err(e) => return bad(e),
            };
            let segment = match translate::pci_segment("fs", &fs.other, segments) {
                Ok(segment) => segment,
                Err(message) => return fault(400, message),
            };
            match translate::fs(config.fs.len(), &fs) {
                // gpuvm names a share by its tag.
                Ok((_, action)) => (
                    fs.tag.clone(),
                    action,
                    segment,
                    Box::new(|c: &mut VmConfig| c.fs.push(fs)) as Record,
                ),
                Err(message) => return fault(400, message),
            }
        }
        Kind::Vsock => {
            let vsock: VsockConfig = match serde_json::from_value(value) {
                Ok(d) => d,
                Err(e) => return bad(e),
            };
            let segment = match translate::pci_segment("vsock", &vsock.other, segments) {
                Ok(segment) => segment,
                Err(message) => return fault(400, message),
            };
            match translate::vsock(&vsock) {
                Ok((_, action)) => (
                    "vsock".into(),
                    action,
                    segment,
                    Box::new(|c: &mut VmConfig| c.vsock = Some(vsock)) as Record,
                ),
                Err(message) => return fault(400, message),
            }
        }
        Kind::Net => {
            let net: NetConfig = match serde_json::from_value(value) {
                Ok(d) => d,
                Err(e) => return bad(e),
            };
            let passed = !tap_fds.is_empty();
            let segment = match translate::pci_segment("net", &net.other, segments) {
                Ok(segment) => segment,
                Err(message) => return fault(400, message),
            };
            match translate::net(config.net.len(), &net, passed) {
                // The VMM thread checks that each is a tap, one per queue pair.
                Ok((id, body)) => {
                    let action = if passed {
                        VmmAction::PutNetworkInterfaceFds {
                            config: body,
                            fds: tap_fds,
                        }
                    } else {
                        VmmAction::PutNetworkInterface(body)
                    };
                    (
                        id,
                        action,
                        segment,
                        Box::new(|c: &mut VmConfig| c.net.push(net)) as Record,
                    )
                }
                Err(message) => return fault(400, message),
            }
        }
    };
    if booted {
        return hot_plug(dispatch, kind, &id, action, segment, || record(config));
    }
    let result = match action {
        // The taps are handed over first; placing the interface cannot fail (the
        // segment was checked above).
        action @ VmmAction::PutNetworkInterfaceFds { .. } => {
            match (dispatch(action), translate::segment_action(&id, segment)) {
                (Ok(_), Some(place)) => dispatch(place),
                (result, _) => result,
            }
        }
        action => dispatch(with_segment(action, &id, segment)),
    };
    match result {
        Ok(_) => {
            record(config);
            Response::no_content()
        }
        Err(error) => from_error(error),
    }
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

/// A device added after vm.boot: hot-plugged on PCI segment 0 (where the hot-plug
/// controller is); answers `{id, bdf}` as Cloud Hypervisor does.
fn hot_plug(
    dispatch: Dispatch,
    kind: Kind,
    id: &str,
    action: VmmAction,
    segment: u16,
    record: impl FnOnce(),
) -> Response {
    if segment != 0 {
        return fault(
            400,
            format!(
                "{id}: gpuvm hot-plugs devices on PCI segment 0 only (pci_segment = {segment})"
            ),
        );
    }
    let action = match action {
        gpu @ VmmAction::PutGpu(_) => gpu,
        other => match VirtioHotplug::from_action(other) {
            Some(device) => VmmAction::HotplugVirtio(device),
            None => return fault(500, format!("{id}: no hot-plug for this kind of device")),
        },
    };
    match dispatch(action) {
        Ok(VmmData::Json(answer)) => match answer["bdf"].as_str() {
            Some(bdf) => {
                record();
                Response::json(200, &json!({"id": id, "bdf": bdf}))
            }
            None => fault(
                500,
                "the hot-plugged device has no PCI address in gpuvm's answer",
            ),
        },
        Ok(_) => fault(500, "gpuvm's hot-plug did not say where the device is"),
        // Any conflict (no hot-plug in this VM, an id already attached, a device being
        // removed): the controller's message says which.
        Err(error) if error.status == 409 => fault(
            400,
            format!("{} hot-plug refused: {}", kind.noun(), error.message),
        ),
        Err(error) => from_error(error),
    }
}

/// Every device id the VM's configuration holds, those the translation made up for
/// devices given without one included (`_disk0` for the first disk, ...).
fn config_ids(config: &VmConfig) -> Vec<String> {
    let named = |id: &Option<String>, prefix: &str, index: usize| {
        id.clone().unwrap_or_else(|| format!("{prefix}{index}"))
    };
    let mut ids: Vec<String> = (config.disks.iter().enumerate())
        .map(|(i, d)| named(&d.id, "_disk", i))
        .collect();
    ids.extend((config.net.iter().enumerate()).map(|(i, n)| named(&n.id, "_net", i)));
    ids.extend(
        config
            .fs
            .iter()
            .flat_map(|f| [Some(f.tag.clone()), f.id.clone()])
            .flatten(),
    );
    ids.extend((config.devices.iter().enumerate()).map(|(i, d)| named(&d.id, "_vfio", i)));
    ids.extend(config.vsock.iter().filter_map(|v| v.id.clone()));
    if let Some(Value::Array(users)) = config.other.get(USER_DEVICES) {
        ids.extend(
            users
                .iter()
                .filter_map(|u| u["id"].as_str().map(String::from)),
        );
    }
    ids
}

/// `prefix` followed by the first number that makes an id not `taken`.
fn fresh_id(taken: &[String], prefix: &str) -> String {
    (0..)
        .map(|n| format!("{prefix}{n}"))
        .find(|id| !taken.contains(id))
        .unwrap_or_default()
}

/// vm.info's `user_devices`: the vfio-user devices added, as their requests gave them.
const USER_DEVICES: &str = "user_devices";

fn push_user_device(config: &mut VmConfig, device: Value) {
    match config
        .other
        .entry(USER_DEVICES.into())
        .or_insert_with(|| json!([]))
    {
        Value::Array(users) => users.push(device),
        other => *other = json!([device]),
    }
}

/// The id gpuvm knows the configured device `id` by: a share's tag for a share's id,
/// `vsock` for the vsock device's id; any other id is the same.
fn gpuvm_id(config: &VmConfig, id: &str) -> String {
    if let Some(fs) = config.fs.iter().find(|f| f.id.as_deref() == Some(id)) {
        return fs.tag.clone();
    }
    if config
        .vsock
        .as_ref()
        .is_some_and(|v| v.id.as_deref() == Some(id))
    {
        return "vsock".into();
    }
    id.to_string()
}

/// Drops the device `id` from the configuration vm.info shows.
fn forget_device(config: &mut VmConfig, id: &str) {
    let named = |own: &Option<String>| own.as_deref() == Some(id);
    config.devices.retain(|d| !named(&d.id));
    config.disks.retain(|d| !named(&d.id));
    config.net.retain(|n| !named(&n.id));
    config.fs.retain(|f| !named(&f.id) && f.tag != id);
    if config
        .vsock
        .as_ref()
        .is_some_and(|v| named(&v.id) || id == "vsock")
    {
        config.vsock = None;
    }
    if let Some(Value::Array(users)) = config.other.get_mut(USER_DEVICES) {
        users.retain(|u| u["id"].as_str() != Some(id));
    }
}

/// `action`, and the device `id` put on PCI segment `segment` with it (one unit).
fn with_segment(action: VmmAction, id: &str, segment: u16) -> VmmAction {
    match translate::segment_action(id, segment) {
        Some(place) => VmmAction::Batch(vec![action, place]),
        None => action,
    }
}
