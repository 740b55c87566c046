//! gpuvm's own routes: each request becomes one [`VmmAction`], or the error response it
//! deserves. Other front ends (Firecracker's and Cloud Hypervisor's APIs) translate onto
//! the same actions in files of their own beside this one.

use gpuvm_virtio::balloon::BalloonConfig;
use gpuvm_virtio::net::NetConfig;
use gpuvm_virtio::rng::RngConfig;
use gpuvm_virtio::vhost_user::FsConfig;
use gpuvm_virtio::vsock::VsockConfig;
use gpuvm_vmm::action::{
    ActionBody, ActionType, BalloonStatsUpdateBody, BalloonUpdateBody, BootSourceBody, DriveBody,
    DrivePatchBody, GpuBody, LiveUpdateBody, MachineConfigBody, SnapshotCreateBody,
    SnapshotLoadBody, VmStateBody, VmStateRequest, VmmAction,
};

use crate::http::{Method, Request, Response};

fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, Response> {
    if body.is_empty() {
        return Err(Response::fault(400, "this request needs a JSON body"));
    }
    serde_json::from_slice(body)
        .map_err(|error| Response::fault(400, format!("invalid JSON body: {error}")))
}

/// The id in the path and the one in the body must agree (as Firecracker requires).
fn same_id(field: &str, in_body: &str, in_path: &str) -> Result<(), Response> {
    if in_body == in_path {
        Ok(())
    } else {
        Err(Response::fault(
            400,
            format!("{field} {in_body:?} in the body does not match {in_path:?} in the path"),
        ))
    }
}

fn method_not_allowed(allow: &'static str) -> Response {
    let mut response = Response::fault(405, format!("method not allowed here (allowed: {allow})"));
    response.allow = Some(allow);
    response
}

/// Maps a request to an action, or to the error response it deserves.
pub fn route(request: &Request) -> Result<VmmAction, Response> {
    use Method::{Delete, Get, Patch, Put};
    let path = request.path.trim_end_matches('/');
    let path = if path.is_empty() { "/" } else { path };
    let method = request.method;
    match path {
        "/" => match method {
            Get => Ok(VmmAction::GetInstanceInfo),
            _ => Err(method_not_allowed("GET")),
        },
        "/machine-config" => match method {
            Get => Ok(VmmAction::GetMachineConfig),
            Put => Ok(VmmAction::PutMachineConfig(parse::<MachineConfigBody>(
                &request.body,
            )?)),
            Patch | Delete => Err(method_not_allowed("GET, PUT")),
        },
        "/boot-source" => match method {
            Put => Ok(VmmAction::PutBootSource(parse::<BootSourceBody>(
                &request.body,
            )?)),
            _ => Err(method_not_allowed("PUT")),
        },
        "/actions" => match method {
            Put => Ok(match parse::<ActionBody>(&request.body)?.action_type {
                ActionType::InstanceStart => VmmAction::StartInstance,
                ActionType::SendCtrlAltDel => VmmAction::SendCtrlAltDel,
            }),
            _ => Err(method_not_allowed("PUT")),
        },
        "/vm" => match method {
            Patch => Ok(match parse::<VmStateBody>(&request.body)?.state {
                VmStateRequest::Paused => VmmAction::Pause,
                VmStateRequest::Resumed => VmmAction::Resume,
            }),
            _ => Err(method_not_allowed("PATCH")),
        },
        "/snapshot/create" => match method {
            Put => Ok(VmmAction::CreateSnapshot(parse::<SnapshotCreateBody>(
                &request.body,
            )?)),
            _ => Err(method_not_allowed("PUT")),
        },
        "/vmm/update" => match method {
            // The server attaches its listening socket (crate::server).
            Put => Ok(VmmAction::LiveUpdate {
                body: parse::<LiveUpdateBody>(&request.body)?,
                api_listener: None,
            }),
            _ => Err(method_not_allowed("PUT")),
        },
        "/snapshot/load" => match method {
            Put => Ok(VmmAction::LoadSnapshot(parse::<SnapshotLoadBody>(
                &request.body,
            )?)),
            _ => Err(method_not_allowed("PUT")),
        },
        "/metrics" => match method {
            Get => Ok(VmmAction::GetMetrics),
            _ => Err(method_not_allowed("GET")),
        },
        _ if path.starts_with("/gpus/") => match method {
            Put => {
                let body = parse::<GpuBody>(&request.body)?;
                let id = &path["/gpus/".len()..];
                body.validate(Some(id))
                    .map_err(|e| Response::fault(e.status, e.message))?;
                Ok(VmmAction::PutGpu(body))
            }
            Delete => Ok(VmmAction::DeleteGpu(path["/gpus/".len()..].to_string())),
            _ => Err(method_not_allowed("PUT, DELETE")),
        },
        _ if path.starts_with("/drives/") => {
            let id = &path["/drives/".len()..];
            match method {
                Put => {
                    let body = parse::<DriveBody>(&request.body)?;
                    same_id("drive_id", body.drive_id(), id)?;
                    Ok(VmmAction::PutDrive(body))
                }
                Patch => {
                    let body = parse::<DrivePatchBody>(&request.body)?;
                    same_id("drive_id", &body.drive_id, id)?;
                    Ok(VmmAction::PatchDrive(body))
                }
                Get | Delete => Err(method_not_allowed("PUT, PATCH")),
            }
        }
        _ if path.starts_with("/network-interfaces/") => match method {
            Put => {
                let body = parse::<NetConfig>(&request.body)?;
                let id = &path["/network-interfaces/".len()..];
                same_id("iface_id", &body.iface_id, id)?;
                Ok(VmmAction::PutNetworkInterface(body))
            }
            _ => Err(method_not_allowed("PUT")),
        },
        _ if path.starts_with("/fs/") => match method {
            Put => {
                let body = parse::<FsConfig>(&request.body)?;
                same_id("tag", &body.tag, &path["/fs/".len()..])?;
                Ok(VmmAction::PutFs(body))
            }
            _ => Err(method_not_allowed("PUT")),
        },
        "/vsock" => match method {
            Put => Ok(VmmAction::PutVsock(parse::<VsockConfig>(&request.body)?)),
            _ => Err(method_not_allowed("PUT")),
        },
        "/entropy" => match method {
            Put => Ok(VmmAction::PutEntropy(parse::<RngConfig>(&request.body)?)),
            _ => Err(method_not_allowed("PUT")),
        },
        "/balloon" => match method {
            Put => Ok(VmmAction::PutBalloon(parse::<BalloonConfig>(
                &request.body,
            )?)),
            Patch => Ok(VmmAction::PatchBalloon(parse::<BalloonUpdateBody>(
                &request.body,
            )?)),
            Get => Ok(VmmAction::GetBalloon),
            Delete => Err(method_not_allowed("GET, PUT, PATCH")),
        },
        "/balloon/statistics" => match method {
            Get => Ok(VmmAction::GetBalloonStats),
            Patch => Ok(VmmAction::PatchBalloonStats(
                parse::<BalloonStatsUpdateBody>(&request.body)?,
            )),
            Put | Delete => Err(method_not_allowed("GET, PATCH")),
        },
        _ => Err(Response::fault(
            404,
            format!("no such route: {}", request.path),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(method: Method, path: &str, body: &str) -> Request {
        Request {
            method,
            path: path.into(),
            body: body.as_bytes().to_vec(),
            close: false,
        }
    }

    fn status(result: Result<VmmAction, Response>) -> u16 {
        match result {
            Ok(_) => 0,
            Err(response) => response.status,
        }
    }

    #[test]
    fn routes_map_to_actions() {
        assert!(matches!(
            route(&request(Method::Get, "/", "")),
            Ok(VmmAction::GetInstanceInfo)
        ));
        assert!(matches!(
            route(&request(Method::Patch, "/vm/", r#"{"state":"Paused"}"#)),
            Ok(VmmAction::Pause)
        ));
        assert!(matches!(
            route(&request(
                Method::Put,
                "/actions",
                r#"{"action_type":"SendCtrlAltDel"}"#
            )),
            Ok(VmmAction::SendCtrlAltDel)
        ));
        assert!(matches!(
            route(&request(Method::Put, "/snapshot/load", r#"{"snapshot_path":"/s","resume_vm":true}"#)),
            Ok(VmmAction::LoadSnapshot(body)) if body.resume_vm
        ));
        assert!(matches!(
            route(&request(Method::Put, "/gpus/emu0", r#"{"gpu_id":"emu0","vfio_user_socket":"/run/emu.sock"}"#)),
            Ok(VmmAction::PutGpu(body)) if body.gpu_id == "emu0"
        ));
        assert!(matches!(
            route(&request(Method::Put, "/drives/rootfs", r#"{"drive_id":"rootfs","path":"/img","read_only":true}"#)),
            Ok(VmmAction::PutDrive(DriveBody::Local(body))) if body.read_only
        ));
        // Firecracker's field names are accepted too.
        let firecracker = r#"{"drive_id":"rootfs","path_on_host":"/img","is_root_device":true,"is_read_only":true,
            "rate_limiter":{"bandwidth":{"size":1048576,"refill_time":1000}}}"#;
        assert!(matches!(
            route(&request(Method::Put, "/drives/rootfs", firecracker)),
            Ok(VmmAction::PutDrive(DriveBody::Local(body)))
                if body.read_only && body.root && body.rate_limiter.bandwidth.is_some_and(|b| b.refill_time_ms == 1000)
        ));
        assert!(matches!(
            route(&request(Method::Patch, "/drives/rootfs", r#"{"drive_id":"rootfs","path_on_host":"/img2"}"#)),
            Ok(VmmAction::PatchDrive(body)) if body.path.is_some()
        ));
        assert!(matches!(
            route(&request(Method::Put, "/drives/data", r#"{"drive_id":"data","socket":"/run/qsd.sock"}"#)),
            Ok(VmmAction::PutDrive(DriveBody::VhostUser(body))) if body.drive_id == "data"
        ));
        assert!(matches!(
            route(&request(Method::Put, "/fs/kataShared", r#"{"tag":"kataShared","socket":"/run/vfs.sock"}"#)),
            Ok(VmmAction::PutFs(body)) if body.tag == "kataShared"
        ));
        assert!(matches!(
            route(&request(Method::Patch, "/drives/rootfs", r#"{"drive_id":"rootfs","path":"/img2"}"#)),
            Ok(VmmAction::PatchDrive(body)) if body.path.is_some()
        ));
        assert!(matches!(
            route(&request(Method::Put, "/vsock", r#"{"guest_cid":3,"uds_path":"/v.sock"}"#)),
            Ok(VmmAction::PutVsock(body)) if body.guest_cid == 3
        ));
        assert!(matches!(
            route(&request(Method::Put, "/entropy", "{}")),
            Ok(VmmAction::PutEntropy(_))
        ));
    }

    #[test]
    fn bad_requests_get_4xx() {
        assert_eq!(status(route(&request(Method::Get, "/nope", ""))), 404);
        assert_eq!(status(route(&request(Method::Put, "/", "{}"))), 405);
        assert_eq!(status(route(&request(Method::Put, "/vm", "{}"))), 405);
        assert_eq!(status(route(&request(Method::Patch, "/vm", "{"))), 400);
        assert_eq!(status(route(&request(Method::Patch, "/vm", ""))), 400);
        assert_eq!(
            status(route(&request(
                Method::Patch,
                "/vm",
                r#"{"state":"Paused","x":1}"#
            ))),
            400
        );
        assert_eq!(
            status(route(&request(Method::Put, "/gpus/gpu0", "{}"))),
            400
        );
        let mismatched = r#"{"gpu_id":"gpu1","host_bdf":"0000:41:00.0"}"#;
        assert_eq!(
            status(route(&request(Method::Put, "/gpus/gpu0", mismatched))),
            400
        );
        assert_eq!(status(route(&request(Method::Get, "/gpus/gpu0", ""))), 405);
        assert!(matches!(
            route(&request(Method::Delete, "/gpus/gpu0", "")),
            Ok(VmmAction::DeleteGpu(id)) if id == "gpu0"
        ));
        assert_eq!(status(route(&request(Method::Delete, "/actions", ""))), 405);
        assert_eq!(
            status(route(&request(Method::Put, "/drives/rootfs", "{}"))),
            400
        );
        let other_id = r#"{"drive_id":"data","path":"/img"}"#;
        assert_eq!(
            status(route(&request(Method::Put, "/drives/rootfs", other_id))),
            400
        );
        assert_eq!(
            status(route(&request(Method::Get, "/drives/rootfs", ""))),
            405
        );
        assert_eq!(status(route(&request(Method::Patch, "/vsock", "{}"))), 405);
        let response = route(&request(Method::Get, "/vm", "")).err().unwrap();
        assert_eq!(response.allow, Some("PATCH"));
        let body: serde_json::Value = serde_json::from_slice(&response.body).unwrap();
        assert!(body["fault_message"].as_str().unwrap().contains("PATCH"));
    }
}
