//! The API thread: accepts connections on the Unix socket, parses requests, turns each
//! into a [`VmmAction`], hands it to the VMM thread (channel + eventfd) and writes the
//! answer back.

use std::io::Write;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::EventFd;

use super::action::{
    ActionBody, ActionResult, ActionType, BootSourceBody, GpuBody, MachineConfigBody,
    SnapshotCreateBody, SnapshotLoadBody, VmStateBody, VmStateRequest, VmmAction, VmmData,
};
use super::http::{Method, ReadOutcome, Request, RequestReader, Response};
use super::ApiError;
use crate::metrics::METRICS;

/// How long a client may stay silent in the middle of a request, or idle between
/// requests on a kept-alive connection.
const READ_TIMEOUT: Duration = Duration::from_secs(5);
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections served at once; more are answered 503 and closed.
const MAX_CONNECTIONS: usize = 16;

/// One action on its way to the VMM thread, with where to send the answer.
pub struct ApiRequest {
    pub action: VmmAction,
    pub reply: Sender<ActionResult>,
}

/// The VMM thread's end: where actions arrive and the eventfd that says so.
#[derive(Clone)]
struct VmmLink {
    requests: Sender<ApiRequest>,
    wake: Arc<EventFd>,
}

/// The running API server. Dropping it removes the socket file.
pub struct ApiServer {
    path: PathBuf,
    busy: Arc<AtomicUsize>,
}

impl ApiServer {
    /// Binds `path` and serves it on a new thread. A stale socket file at `path` is
    /// replaced; any other file there is an error. The API threads run under the `api`
    /// seccomp filter once [`crate::seccomp::enable`] ran (installed before the first
    /// accept; connection threads inherit it).
    pub fn start(
        path: &Path,
        requests: Sender<ApiRequest>,
        wake: EventFd,
    ) -> Result<ApiServer, ApiError> {
        if let Ok(meta) = std::fs::symlink_metadata(path) {
            if meta.file_type().is_socket() {
                let _ = std::fs::remove_file(path);
            } else {
                return Err(ApiError::PathTaken(path.to_path_buf()));
            }
        }
        let listener = UnixListener::bind(path).map_err(|source| ApiError::Bind {
            path: path.to_path_buf(),
            source,
        })?;
        let busy = Arc::new(AtomicUsize::new(0));
        let link = VmmLink {
            requests,
            wake: Arc::new(wake),
        };
        let server_busy = busy.clone();
        let (ready_tx, ready_rx) = channel();
        std::thread::Builder::new()
            .name("api".into())
            .spawn(move || {
                let applied = crate::seccomp::apply(crate::seccomp::ThreadKind::Api);
                let failed = applied.is_err();
                let _ = ready_tx.send(applied);
                if failed {
                    return;
                }
                accept_loop(listener, link, server_busy)
            })
            .map_err(ApiError::Spawn)?;
        match ready_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(error)) => return Err(ApiError::Seccomp(error)),
            Err(_) => return Err(ApiError::Spawn(std::io::Error::other("API thread ended"))),
        }
        log::info!("API listening on {}", path.display());
        Ok(ApiServer {
            path: path.to_path_buf(),
            busy,
        })
    }

    /// Leaves the socket file in place at the end (after a chroot its path is gone).
    pub fn keep_socket_file(&mut self) {
        self.path = PathBuf::new();
    }

    /// Waits (at most `limit`) until no request is between parse and written answer, so
    /// the answer to a request that ended the VM still reaches its client.
    pub fn wait_idle(&self, limit: Duration) {
        let started = Instant::now();
        while self.busy.load(Ordering::SeqCst) > 0 && started.elapsed() < limit {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        if self.path.as_os_str().is_empty() {
            return;
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

fn accept_loop(listener: UnixListener, link: VmmLink, busy: Arc<AtomicUsize>) {
    let connections = Arc::new(AtomicUsize::new(0));
    for stream in listener.incoming() {
        let mut stream = match stream {
            Ok(stream) => stream,
            Err(error) => {
                log::warn!("API accept failed: {error}");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        if connections.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
            connections.fetch_sub(1, Ordering::SeqCst);
            let _ = stream.set_write_timeout(Some(WRITE_TIMEOUT));
            let _ = Response::fault(503, "too many API connections").write_to(&mut stream, true);
            continue;
        }
        let link = link.clone();
        let busy = busy.clone();
        let counter = connections.clone();
        let spawned = std::thread::Builder::new()
            .name("api-conn".into())
            .spawn(move || {
                serve_connection(stream, &link, &busy);
                counter.fetch_sub(1, Ordering::SeqCst);
            });
        if let Err(error) = spawned {
            log::warn!("cannot start an API connection thread: {error}");
            connections.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

fn serve_connection(stream: UnixStream, link: &VmmLink, busy: &AtomicUsize) {
    if stream.set_read_timeout(Some(READ_TIMEOUT)).is_err()
        || stream.set_write_timeout(Some(WRITE_TIMEOUT)).is_err()
    {
        return;
    }
    let Ok(mut writer) = stream.try_clone() else {
        return;
    };
    let mut reader = RequestReader::new(stream);
    loop {
        let (response, close, path) = match reader.next_request() {
            ReadOutcome::Closed => return,
            ReadOutcome::Bad(error) => {
                log::debug!("bad API request: {error}");
                (
                    Response::fault(error.status(), error.to_string()),
                    true,
                    None,
                )
            }
            ReadOutcome::Request(request) => {
                busy.fetch_add(1, Ordering::SeqCst);
                let response = handle(&request, link);
                (response, request.close, Some(request.path))
            }
        };
        METRICS.count_api_request(path.as_deref().unwrap_or("other"), response.status);
        let written = response.write_to(&mut writer, close);
        if path.is_some() {
            busy.fetch_sub(1, Ordering::SeqCst);
        }
        if written.is_err() || close {
            let _ = writer.flush();
            return;
        }
    }
}

/// Answers one request.
fn handle(request: &Request, link: &VmmLink) -> Response {
    let action = match route(request) {
        Ok(action) => action,
        Err(response) => return response,
    };
    log::debug!(
        "API {} {}: {action:?}",
        request.method.as_str(),
        request.path
    );
    match dispatch(action, link) {
        Ok(VmmData::Empty) => Response::no_content(),
        Ok(VmmData::Json(value)) => Response::json(200, &value),
        Err(error) => Response::fault(error.status, error.message),
    }
}

fn dispatch(action: VmmAction, link: &VmmLink) -> ActionResult {
    let (reply_tx, reply_rx) = channel();
    let gone = || super::action::ActionError {
        status: 503,
        message: "the VMM has stopped".into(),
    };
    link.requests
        .send(ApiRequest {
            action,
            reply: reply_tx,
        })
        .map_err(|_| gone())?;
    if link.wake.write(1).is_err() {
        return Err(gone());
    }
    reply_rx.recv().map_err(|_| gone())?
}

fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, Response> {
    if body.is_empty() {
        return Err(Response::fault(400, "this request needs a JSON body"));
    }
    serde_json::from_slice(body)
        .map_err(|error| Response::fault(400, format!("invalid JSON body: {error}")))
}

fn method_not_allowed(allow: &'static str) -> Response {
    let mut response = Response::fault(405, format!("method not allowed here (allowed: {allow})"));
    response.allow = Some(allow);
    response
}

/// Maps a request to an action, or to the error response it deserves.
pub fn route(request: &Request) -> Result<VmmAction, Response> {
    use Method::{Get, Patch, Put};
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
            Patch => Err(method_not_allowed("GET, PUT")),
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
            _ => Err(method_not_allowed("PUT")),
        },
        _ if path.starts_with("/drives") => {
            Err(Response::fault(400, "gpuvm has no block device yet"))
        }
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
        assert_eq!(
            status(route(&request(Method::Put, "/drives/rootfs", "{}"))),
            400
        );
        let response = route(&request(Method::Get, "/vm", "")).err().unwrap();
        assert_eq!(response.allow, Some("PATCH"));
        let body: serde_json::Value = serde_json::from_slice(&response.body).unwrap();
        assert!(body["fault_message"].as_str().unwrap().contains("PATCH"));
    }
}
