//! Firecracker's routes: its paths, status codes (204 for a successful PUT or PATCH, 200
//! with a body for a GET, 400 with `fault_message` for every refusal) and GET / shape.

use serde_json::{json, Value};

use gpuvm_vmm::action::{ActionResult, ClientRecord, VmmAction, VmmData};

use super::translate::{self, Refusal};
use super::validate::{self, Body};
use super::{Session, FIRECRACKER_API_VERSION};
use crate::http::{Method, Request, Response};

/// Carries one action to the VMM thread and brings its answer back.
pub type Dispatch<'a> = &'a dyn Fn(VmmAction) -> ActionResult;

/// Firecracker answers every refusal 400 (the VMM's 5xx stay as they are).
fn fault(status: u16, message: impl Into<String>) -> Response {
    let status = if (400..500).contains(&status) {
        400
    } else {
        status
    };
    Response::fault(status, message)
}

fn body(request: &Request) -> Result<Value, Response> {
    if request.body.is_empty() {
        return Err(fault(400, "this request needs a JSON body"));
    }
    serde_json::from_slice(&request.body).map_err(|e| fault(400, format!("invalid JSON body: {e}")))
}

fn refused(message: Refusal) -> Response {
    fault(400, message)
}

/// The body, checked by Firecracker's rules for `kind` (every bad field named).
fn checked_body(request: &Request, kind: Body) -> Result<Value, Response> {
    let value = body(request)?;
    validate::api_body(kind, &value).map_err(refused)?;
    Ok(value)
}

/// Runs `action`; success is 204 (whatever gpuvm's own answer carried).
fn no_content(action: VmmAction, dispatch: Dispatch) -> Response {
    match dispatch(action) {
        Ok(_) => Response::no_content(),
        Err(error) => fault(error.status, error.message),
    }
}

fn json_of(action: VmmAction, dispatch: Dispatch) -> Result<Value, Response> {
    match dispatch(action) {
        Ok(VmmData::Json(value)) => Ok(value),
        Ok(VmmData::Empty) => Ok(Value::Null),
        Err(error) => Err(fault(error.status, error.message)),
    }
}

/// `action`, with its body kept by the controller for GET /vm/config once it succeeded
/// (in the client's record: `section`, under `id` for the lists, replacing what the same
/// section and id held).
fn recorded(action: VmmAction, section: &str, id: Option<&str>, body: Value) -> VmmAction {
    VmmAction::Recorded {
        action: Box::new(action),
        entry: super::record_entry(section, id, body),
    }
}

/// The client's record the controller keeps (see [`recorded`]).
fn client_record(dispatch: Dispatch) -> Result<ClientRecord, Response> {
    let info = json_of(VmmAction::GetInstanceInfo, dispatch)?;
    Ok(serde_json::from_value(info["client_record"].clone()).unwrap_or_default())
}

fn method_not_allowed(allow: &str) -> Response {
    fault(
        400,
        format!("invalid request method (allowed here: {allow})"),
    )
}

/// Answers one request in Firecracker's terms.
pub fn handle(request: &Request, session: &Session, dispatch: Dispatch) -> Response {
    use Method::{Get, Patch, Put};
    let path = request.path.trim_end_matches('/');
    let path = if path.is_empty() { "/" } else { path };
    let method = request.method;
    let cwd = &session.cwd;
    let result: Result<Response, Response> = (|| match (method, path) {
        (Get, "/") => {
            let info = json_of(VmmAction::GetInstanceInfo, dispatch)?;
            let state = match info["state"].as_str() {
                Some("Running") => "Running",
                Some("Paused") => "Paused",
                _ => "Not started",
            };
            Ok(Response::json(
                200,
                &json!({
                    "id": session.id,
                    "state": state,
                    "vmm_version": info["vmm_version"],
                    "app_name": info["app_name"],
                }),
            ))
        }
        (_, "/") => Err(method_not_allowed("GET")),
        (Get, "/version") => Ok(Response::json(
            200,
            &json!({ "firecracker_version": FIRECRACKER_API_VERSION }),
        )),
        (_, "/version") => Err(method_not_allowed("GET")),
        (Get, "/vm/config") => {
            let machine = json_of(VmmAction::GetMachineConfig, dispatch)?;
            let mut config = serde_json::Map::new();
            for entry in client_record(dispatch)?.devices {
                if super::LIST_SECTIONS.contains(&entry.section.as_str()) {
                    let list = config.entry(entry.section).or_insert_with(|| json!([]));
                    if let Some(items) = list.as_array_mut() {
                        items.push(entry.body);
                    }
                } else {
                    config.insert(entry.section, entry.body);
                }
            }
            config.insert(
                "machine-config".into(),
                translate::machine_config_json(&machine),
            );
            for list in ["drives", "network-interfaces"] {
                config.entry(list).or_insert_with(|| json!([]));
            }
            Ok(Response::json(200, &Value::Object(config)))
        }
        (_, "/vm/config") => Err(method_not_allowed("GET")),
        (Get, "/machine-config") => {
            let machine = json_of(VmmAction::GetMachineConfig, dispatch)?;
            Ok(Response::json(
                200,
                &translate::machine_config_json(&machine),
            ))
        }
        (Put | Patch, "/machine-config") => {
            let kind = if method == Patch {
                Body::MachineConfigPatch
            } else {
                Body::MachineConfig
            };
            let fc = checked_body(request, kind)?;
            let action = if method == Patch {
                VmmAction::PatchMachineConfig(
                    translate::machine_config_patch(&fc).map_err(refused)?,
                )
            } else {
                VmmAction::PutMachineConfig(translate::machine_config(&fc).map_err(refused)?)
            };
            Ok(no_content(action, dispatch))
        }
        (_, "/machine-config") => Err(method_not_allowed("GET, PUT, PATCH")),
        (Put, "/boot-source") => {
            let fc = checked_body(request, Body::BootSource)?;
            let boot = translate::boot_source(&fc, cwd).map_err(refused)?;
            Ok(no_content(
                recorded(VmmAction::PutBootSource(boot), "boot-source", None, fc),
                dispatch,
            ))
        }
        (Put, "/logger") => {
            let fc = checked_body(request, Body::Logger)?;
            let config = translate::logger(&fc, cwd).map_err(refused)?;
            Ok(no_content(
                recorded(VmmAction::PutLogger(config), "logger", None, fc),
                dispatch,
            ))
        }
        (Put, "/metrics") => {
            let fc = checked_body(request, Body::Metrics)?;
            let config = translate::metrics(&fc, cwd).map_err(refused)?;
            Ok(no_content(
                recorded(VmmAction::PutMetrics(config), "metrics", None, fc),
                dispatch,
            ))
        }
        (Get, "/metrics") => {
            // gpuvm's extension: the counters as JSON (Firecracker has no GET here).
            Ok(Response::json(
                200,
                &json_of(VmmAction::GetMetrics, dispatch)?,
            ))
        }
        (Put, "/actions") => {
            let fc = body(request)?;
            let action = match fc["action_type"].as_str() {
                Some("InstanceStart") => VmmAction::StartInstance,
                Some("SendCtrlAltDel") => VmmAction::SendCtrlAltDel,
                Some("FlushMetrics") => VmmAction::FlushMetrics,
                _ => {
                    return Err(fault(
                        400,
                        "action_type: FlushMetrics, InstanceStart or SendCtrlAltDel",
                    ))
                }
            };
            if fc.as_object().is_some_and(|o| o.len() > 1) {
                return Err(fault(400, "actions: only action_type is taken"));
            }
            Ok(no_content(action, dispatch))
        }
        (Put, "/snapshot/create") => {
            let snapshot =
                translate::snapshot_create(&checked_body(request, Body::SnapshotCreate)?, cwd)
                    .map_err(refused)?;
            Ok(no_content(VmmAction::CreateSnapshot(snapshot), dispatch))
        }
        (Put, "/snapshot/load") => {
            let (load, overrides) =
                translate::snapshot_load(&checked_body(request, Body::SnapshotLoad)?, cwd)
                    .map_err(refused)?;
            let action = if overrides == Default::default() {
                VmmAction::LoadSnapshot(load)
            } else {
                VmmAction::LoadSnapshotWith { load, overrides }
            };
            Ok(no_content(action, dispatch))
        }
        (Put | Patch, "/mmds") => {
            let value = body(request)?;
            let action = if method == Put {
                VmmAction::PutMmds(value)
            } else {
                VmmAction::PatchMmds(value)
            };
            match dispatch(action) {
                Ok(_) => Ok(Response::no_content()),
                // Firecracker answers a store over its limit 413, its one refusal that
                // is not 400.
                Err(error) if error.status == gpuvm_vmm::controller::mmds::TOO_LARGE => {
                    Err(Response::fault(
                        413,
                        format!(
                            "MMDS data store limit exceeded: {} (--mmds-size-limit)",
                            error.message
                        ),
                    ))
                }
                Err(error) => Err(fault(error.status, error.message)),
            }
        }
        (Get, "/mmds") => Ok(Response::json(200, &json_of(VmmAction::GetMmds, dispatch)?)),
        (_, "/mmds") => Err(method_not_allowed("GET, PUT, PATCH")),
        (Put, "/mmds/config") => {
            let fc = checked_body(request, Body::MmdsConfig)?;
            let config = translate::mmds_config(&fc).map_err(refused)?;
            Ok(no_content(
                recorded(VmmAction::PutMmdsConfig(config), "mmds-config", None, fc),
                dispatch,
            ))
        }
        (_, "/mmds/config") => Err(method_not_allowed("PUT")),
        (Put, "/vsock") => {
            let fc = checked_body(request, Body::Vsock)?;
            let config = translate::vsock(&fc, cwd).map_err(refused)?;
            Ok(no_content(
                recorded(VmmAction::PutVsock(config), "vsock", None, fc),
                dispatch,
            ))
        }
        (Put, _) if path.starts_with("/drives/") => {
            let fc = checked_body(request, Body::Drive)?;
            let drive = translate::drive(&fc, cwd).map_err(refused)?;
            let id = &path["/drives/".len()..];
            if drive.drive_id() != id {
                return Err(fault(
                    400,
                    format!(
                        "drive_id {:?} in the body does not match {id:?} in the path",
                        drive.drive_id()
                    ),
                ));
            }
            Ok(no_content(
                recorded(VmmAction::PutDrive(drive), "drives", Some(id), fc),
                dispatch,
            ))
        }
        (Put, _) if path.starts_with("/network-interfaces/") => {
            let fc = checked_body(request, Body::NetworkInterface)?;
            let id = &path["/network-interfaces/".len()..];
            let action = gpuvm_action(request)?;
            Ok(no_content(
                recorded(action, "network-interfaces", Some(id), fc),
                dispatch,
            ))
        }
        (Put, "/entropy") => {
            let fc = checked_body(request, Body::Entropy)?;
            let action = gpuvm_action(request)?;
            Ok(no_content(recorded(action, "entropy", None, fc), dispatch))
        }
        (Put, "/balloon") => {
            let fc = checked_body(request, Body::Balloon)?;
            let config = translate::balloon(&fc).map_err(refused)?;
            Ok(no_content(
                recorded(VmmAction::PutBalloon(config), "balloon", None, fc),
                dispatch,
            ))
        }
        (Put, "/vmm/update") => {
            // gpuvm's live update, no Firecracker route: its answer says which process
            // runs the VM now, which `gpuvm update` checks, so it goes out as gpuvm's.
            let action = gpuvm_action(request)?;
            let answer = json_of(action, dispatch)?;
            Ok(Response::json(200, &answer))
        }
        _ => {
            if let Some(why) = translate::unsupported(path) {
                return Err(fault(
                    400,
                    format!("{} {}: {why}", method.as_str(), request.path),
                ));
            }
            // The same path and meaning in gpuvm's own routes: PATCH /vm, PATCH
            // /drives/{id}, PATCH /network-interfaces/{id}, gpuvm's /gpus/{id}, /fs/{tag}.
            Ok(gpuvm_route(request, dispatch))
        }
    })();
    result.unwrap_or_else(|response| response)
}

/// One of gpuvm's own routes, answered with Firecracker's codes.
/// The action gpuvm's own route makes of `request`, or its refusal in Firecracker's shape.
fn gpuvm_action(request: &Request) -> Result<VmmAction, Response> {
    crate::routes::route(request)
        .map_err(|response| fault(response.status, fault_message(&response)))
}

fn gpuvm_route(request: &Request, dispatch: Dispatch) -> Response {
    match crate::routes::route(request) {
        Ok(action) => match dispatch(action) {
            Ok(VmmData::Empty) => Response::no_content(),
            Ok(VmmData::Json(value)) if request.method == Method::Get => {
                Response::json(200, &value)
            }
            Ok(VmmData::Json(_)) => Response::no_content(),
            Err(error) => fault(error.status, error.message),
        },
        Err(response) => fault(response.status, fault_message(&response)),
    }
}

fn fault_message(response: &Response) -> String {
    serde_json::from_slice::<Value>(&response.body)
        .ok()
        .and_then(|v| v["fault_message"].as_str().map(str::to_string))
        .unwrap_or_else(|| "bad request".into())
}
