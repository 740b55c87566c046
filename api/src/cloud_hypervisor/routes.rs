//! The `/api/v1/` routes: Cloud Hypervisor's paths, bodies, status codes and VM states
//! on gpuvm's actions.

use std::os::fd::OwnedFd;
use std::path::PathBuf;

use serde_json::{json, Value};

use gpuvm_vmm::action::{
    ActionError, ActionResult, GpuBody, RestoreModeBody, SnapshotCreateBody, SnapshotLoadBody,
    VmmAction, VmmData,
};

use super::config::{
    check_other, DeviceConfig, DiskConfig, FsConfig, NetConfig, RemoveDevice, RestoreConfig,
    SnapshotConfig, VmConfig, VsockConfig,
};
use super::{translate, Session, PREFIX};
use crate::http::{Method, Request, Response};

/// Carries one action to the VMM thread and brings its answer back.
pub type Dispatch<'a> = &'a dyn Fn(VmmAction) -> ActionResult;

/// An error answer in Cloud Hypervisor's shape.
fn fault(status: u16, message: impl Into<String>) -> Response {
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
        "vm.restore" => put_only(&|| restore(request, session, dispatch)),
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
            // Passthrough devices only: before boot they leave the configuration; after
            // boot the guest is asked to eject them (gpuvm's GPU hot-unplug).
            match state(session, dispatch) {
                Err(response) => return response,
                Ok(None) => return not_created(),
                Ok(Some(_)) => {}
            }
            let result = dispatch(VmmAction::DeleteGpu(body.id.clone()));
            if result.is_ok() {
                if let Some(config) = session.config().as_mut() {
                    config
                        .devices
                        .retain(|d| d.id.as_deref() != Some(body.id.as_str()));
                }
            }
            match result {
                Err(error) if error.status == 404 => fault(
                    404,
                    format!(
                        "no device {:?}: gpuvm removes passthrough devices (GPUs) only",
                        body.id
                    ),
                ),
                other => empty(other),
            }
        }),
        "vm.resize" | "vm.resize-zone" => put_only(&|| {
            unsupported(
            name,
            "gpuvm has no vCPU or memory hot-plug; set static_sandbox_resource_mgmt = true in Kata's configuration-clh.toml",
        )
        }),
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
    Response::json(
        200,
        &json!({
            "config": config,
            "state": state.name(),
            "memory_actual_size": memory,
        }),
    )
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

fn restore(request: &Request, session: &Session, dispatch: Dispatch) -> Response {
    let body: RestoreConfig = match parse(&request.body) {
        Ok(body) => body,
        Err(response) => return response,
    };
    if let Err(message) = check_other("", &body.other) {
        return fault(400, message);
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
        let (vcpus, mib) = match machine {
            Some(VmmData::Json(m)) => (
                m["vcpu_count"].as_u64().unwrap_or(1),
                m["mem_size_mib"].as_u64().unwrap_or(0),
            ),
            _ => (1, 0),
        };
        let restored = json!({
            "payload": {},
            "cpus": {"boot_vcpus": vcpus, "max_vcpus": vcpus},
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

/// vm.add-*: before boot, the device joins the VM's configuration (204); after boot only
/// GPUs can be hot-plugged (200 with Cloud Hypervisor's PciDeviceInfo).
fn add(
    request: &Request,
    session: &Session,
    dispatch: Dispatch,
    kind: Kind,
    tap_fds: Vec<OwnedFd>,
) -> Response {
    let value: Value = match parse(&request.body) {
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
    match kind {
        Kind::Device | Kind::UserDevice => {
            let gpu = if kind == Kind::Device {
                let device: DeviceConfig = match serde_json::from_value(value) {
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
                    id: Option<String>,
                    #[serde(flatten)]
                    other: super::config::Other,
                }
                let user: UserDevice = match serde_json::from_value(value) {
                    Ok(d) => d,
                    Err(e) => return bad(e),
                };
                if let Err(message) = check_other("", &user.other) {
                    return fault(400, message);
                }
                let gpu = GpuBody {
                    gpu_id: user.id.unwrap_or_else(|| format!("_user_device{}", config.devices.len())),
                    host_bdf: None,
                    vfio_user_socket: Some(user.socket),
                };
                (gpu, None)
            };
            let (gpu, device) = gpu;
            let id = gpu.gpu_id.clone();
            match dispatch(VmmAction::PutGpu(gpu)) {
                Ok(VmmData::Empty) if !booted => {
                    config.devices.extend(device);
                    Response::no_content()
                }
                Ok(VmmData::Json(answer)) if booted => match answer["bdf"].as_str() {
                    Some(bdf) => Response::json(200, &json!({"id": id, "bdf": bdf})),
                    None => fault(500, "the hot-plugged device has no PCI address in gpuvm's answer"),
                },
                Ok(_) if booted => fault(500, "gpuvm's hot-plug did not say where the device is"),
                Ok(_) => Response::no_content(),
                // Any conflict (no hot-plug in this VM, an id already attached, a device
                // being removed): the controller's message says which.
                Err(error) if booted && error.status == 409 => fault(
                    400,
                    format!("GPU hot-plug refused: {}", error.message),
                ),
                Err(error) => from_error(error),
            }
        }
        _ if booted => unsupported(
            "hot-plug of disks, network interfaces, virtio-fs and vsock after vm.boot",
            "only GPUs (vm.add-device, vm.add-user-device) are hot-plugged; add the others before vm.boot",
        ),
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
                Ok((id, action)) => added(dispatch(with_segment(action, &id, segment)), || {
                    config.disks.push(disk)
                }),
                Err(message) => fault(400, message),
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
                Ok((_, action)) => added(dispatch(with_segment(action, &fs.tag, segment)), || {
                    config.fs.push(fs)
                }),
                Err(message) => fault(400, message),
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
                Ok((_, action)) => added(dispatch(with_segment(action, "vsock", segment)), || {
                    config.vsock = Some(vsock)
                }),
                Err(message) => fault(400, message),
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
                Ok((id, config_body)) if passed => {
                    let result = dispatch(VmmAction::PutNetworkInterfaceFds {
                        config: config_body,
                        fds: tap_fds,
                    });
                    // The segment was checked above: placing the interface cannot fail.
                    let result = match (result, translate::segment_action(&id, segment)) {
                        (Ok(_), Some(action)) => dispatch(action),
                        (result, _) => result,
                    };
                    added(result, || config.net.push(net))
                }
                Ok((id, body)) => added(
                    dispatch(with_segment(VmmAction::PutNetworkInterface(body), &id, segment)),
                    || config.net.push(net),
                ),
                Err(message) => fault(400, message),
            }
        }
    }
}

/// `action`, and the device `id` put on PCI segment `segment` with it (one unit).
fn with_segment(action: VmmAction, id: &str, segment: u16) -> VmmAction {
    match translate::segment_action(id, segment) {
        Some(place) => VmmAction::Batch(vec![action, place]),
        None => action,
    }
}

fn added(result: ActionResult, record: impl FnOnce()) -> Response {
    match result {
        Ok(_) => {
            record();
            Response::no_content()
        }
        Err(error) => from_error(error),
    }
}
