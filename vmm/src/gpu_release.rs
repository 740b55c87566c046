//! Snapshots of VMs with GPUs through the guest (the path NVIDIA GPUs need: no VFIO
//! driver migrates their state). The VMM asks an agent in the guest to release each
//! hot-plugged GPU, ejects it through ACPI PCI hot-plug, snapshots the VM without it, and
//! gives the guest a GPU of the same model back (the same one when the VM runs on, any free
//! one after a restore) and tells the agent to resume.
//!
//! The agent channel is the VM's hybrid vsock: the VMM connects to the device's Unix
//! socket like any host client (`CONNECT 1027`) and speaks lines of text:
//!
//! ```text
//! VMM -> guest  RELEASE <id> <bdf>   checkpoint the device's users (cuda-checkpoint), unbind
//! guest -> VMM  RELEASED <id>        the device may go: nothing in the guest touches it
//! VMM -> guest  ATTACH <id> <bdf>    a device of the same model is at <bdf>: bind, restore
//! guest -> VMM  RESUMED <id>         the users run on the new device
//! guest -> VMM  ERROR <id> <why>     refused; the VMM gives up and says why
//! ```
//!
//! docs/gpu-snapshots.md describes the guest side for Linux + NVIDIA.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::action::{
    ActionError, ActionResult, GpuBody, PassthroughPolicy, ReleasedGpu, SnapshotCreateBody,
    VmmAction, VmmData,
};
use crate::action_channel::ActionSender;

/// The guest's vsock port for the agent.
pub const AGENT_PORT: u32 = 1027;
/// How long the guest may take to release or resume a device, unless
/// [`AGENT_TIMEOUT_VAR`] says otherwise: a checkpoint copies the device's memory out.
pub const AGENT_TIMEOUT: Duration = Duration::from_secs(120);
/// `GPUVM_GPU_AGENT_TIMEOUT_MS=<ms>`: the agent timeout.
pub const AGENT_TIMEOUT_VAR: &str = "GPUVM_GPU_AGENT_TIMEOUT_MS";
/// How long the guest's vsock driver may take to accept the agent's connection: it answers
/// at once when the agent listens (a guest without a vsock driver never does).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest line the agent may send.
const MAX_LINE: u64 = 512;

/// The agent timeout in effect.
pub fn agent_timeout() -> Duration {
    std::env::var(AGENT_TIMEOUT_VAR)
        .ok()
        .and_then(|ms| ms.parse().ok())
        .map_or(AGENT_TIMEOUT, Duration::from_millis)
}

/// A hot-plugged GPU as the release needs it.
#[derive(Clone, Debug)]
pub struct AttachedGpu {
    pub body: GpuBody,
    pub bdf: String,
    pub vendor_id: u16,
    pub device_id: u16,
}

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("this VM has no vsock device: the GPU agent protocol runs over vsock")]
    NoVsock,
    #[error("cannot reach the guest's GPU agent through {path} (port {AGENT_PORT}): {source}")]
    Connect {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the guest's GPU agent (port {AGENT_PORT}) is not listening: {0}")]
    Refused(String),
    #[error("the guest's GPU agent did not answer {request:?} within {} ms", timeout.as_millis())]
    Timeout { request: String, timeout: Duration },
    #[error("the guest's GPU agent refused {request:?}: {reply}")]
    Guest { request: String, reply: String },
    #[error("the guest's GPU agent connection failed: {0}")]
    Io(#[from] std::io::Error),
}

/// A connection to the guest's agent through the vsock device's Unix socket.
pub struct AgentChannel {
    stream: BufReader<UnixStream>,
    timeout: Duration,
}

impl AgentChannel {
    /// Connects through `uds` (the vsock device's socket) to the agent's port.
    pub fn connect(uds: &Path, timeout: Duration) -> Result<Self, AgentError> {
        let stream = UnixStream::connect(uds).map_err(|source| AgentError::Connect {
            path: uds.to_path_buf(),
            source,
        })?;
        let connect_timeout = timeout.min(CONNECT_TIMEOUT);
        stream.set_read_timeout(Some(connect_timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        let mut channel = AgentChannel {
            stream: BufReader::new(stream),
            timeout: connect_timeout,
        };
        let request = format!("CONNECT {AGENT_PORT}");
        let reply = match channel.exchange(&request) {
            Err(AgentError::Timeout { .. }) => {
                return Err(AgentError::Refused(format!(
                    "no answer within {} ms (is the guest's vsock driver up?)",
                    connect_timeout.as_millis()
                )))
            }
            other => other?,
        };
        channel.timeout = timeout;
        channel.stream.get_ref().set_read_timeout(Some(timeout))?;
        if !reply.starts_with("OK ") {
            return Err(AgentError::Refused(if reply.is_empty() {
                "the connection was closed".into()
            } else {
                reply
            }));
        }
        Ok(channel)
    }

    /// Sends `request` as a line and reads the one-line reply ("" when the peer closed).
    fn exchange(&mut self, request: &str) -> Result<String, AgentError> {
        let stream = self.stream.get_mut();
        stream.write_all(format!("{request}\n").as_bytes())?;
        let mut line = String::new();
        let read = std::io::Read::take(&mut self.stream, MAX_LINE)
            .read_line(&mut line)
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                    AgentError::Timeout {
                        request: request.to_string(),
                        timeout: self.timeout,
                    }
                }
                _ => AgentError::Io(e),
            })?;
        if read > 0 && !line.ends_with('\n') {
            return Err(AgentError::Guest {
                request: request.to_string(),
                reply: format!("a reply line longer than {MAX_LINE} bytes"),
            });
        }
        Ok(line.trim_end().to_string())
    }

    /// Sends `<verb> <id> <bdf>` and expects `<done> <id>`.
    fn command(&mut self, verb: &str, done: &str, id: &str, bdf: &str) -> Result<(), AgentError> {
        let request = format!("{verb} {id} {bdf}");
        let reply = self.exchange(&request)?;
        if reply == format!("{done} {id}") {
            return Ok(());
        }
        Err(AgentError::Guest {
            request,
            reply: if reply.is_empty() {
                "the connection was closed".into()
            } else {
                reply
            },
        })
    }

    /// Asks the guest to stop using the device at `bdf` and let it go.
    pub fn release(&mut self, id: &str, bdf: &str) -> Result<(), AgentError> {
        self.command("RELEASE", "RELEASED", id, bdf)
    }

    /// Tells the guest a device of the model it released is at `bdf`.
    pub fn attach(&mut self, id: &str, bdf: &str) -> Result<(), AgentError> {
        self.command("ATTACH", "RESUMED", id, bdf)
    }
}

/// Sends one action to the VMM thread and waits for its answer; a VMM thread that has
/// gone is a 409 (the VM ended while the release was under way).
fn call(vmm: &ActionSender, action: VmmAction) -> ActionResult {
    vmm.call(action)
        .unwrap_or_else(|_| Err(ActionError::wrong_state("the VM ended")))
}

fn agent_error(during: &str, error: AgentError) -> ActionError {
    let status = match error {
        AgentError::Timeout { .. } => 504,
        AgentError::NoVsock | AgentError::Refused(_) | AgentError::Connect { .. } => 409,
        _ => 400,
    };
    ActionError {
        status,
        message: format!("{during}: {error}"),
    }
}

/// The bdf a PUT /gpus answer names.
fn plugged_bdf(answer: &VmmData) -> Option<String> {
    match answer {
        VmmData::Json(value) => value.get("bdf")?.as_str().map(str::to_string),
        VmmData::Empty => None,
    }
}

/// Hot-plugs `body` and tells the guest's agent where it is (the second half of a release,
/// on a restored VM or on the one that was snapshotted).
pub fn attach(vmm: &ActionSender, uds: &Path, body: GpuBody) -> Result<String, ActionError> {
    let id = body.gpu_id.clone();
    let answer = call(vmm, VmmAction::PutGpu(body))?;
    let bdf = plugged_bdf(&answer)
        .ok_or_else(|| ActionError::bad_request("the hot-plug named no bus address"))?;
    resume_in_guest(uds, &id, &bdf)?;
    Ok(bdf)
}

/// Tells the guest's agent that `id` is back at `bdf` and waits for it to resume.
pub fn resume_in_guest(uds: &Path, id: &str, bdf: &str) -> Result<(), ActionError> {
    let timeout = agent_timeout();
    AgentChannel::connect(uds, timeout)
        .and_then(|mut agent| agent.attach(id, bdf))
        .map_err(|e| agent_error(&format!("{id} is plugged at {bdf}, but"), e))?;
    log::info!("gpu release: the guest resumed {id} at {bdf}");
    Ok(())
}

/// PUT /snapshot/create with `passthrough: guest_release`, run on its own thread: every
/// action goes through `vmm` like a client's, so the VMM thread serves the API
/// meanwhile. Releases `gpus` (all or none: a refusal hands those already released back),
/// snapshots, and gives the same devices back when `reattach`.
pub fn snapshot_releasing(
    vmm: ActionSender,
    uds: PathBuf,
    gpus: Vec<AttachedGpu>,
    mut body: SnapshotCreateBody,
) -> ActionResult {
    let started = Instant::now();
    let timeout = agent_timeout();
    let mut agent = AgentChannel::connect(&uds, timeout)
        .map_err(|e| agent_error("cannot release the GPUs for the snapshot", e))?;
    let mut released = Vec::new();
    for gpu in &gpus {
        let id = &gpu.body.gpu_id;
        if let Err(error) = agent.release(id, &gpu.bdf) {
            give_back_to_guest(&mut agent, &released);
            return Err(agent_error(
                &format!("the guest did not release {id}"),
                error,
            ));
        }
        log::info!("gpu release: the guest released {id} ({})", gpu.bdf);
        released.push(gpu.clone());
    }
    drop(agent);
    let mut ejected: Vec<&AttachedGpu> = Vec::new();
    for gpu in &gpus {
        if let Err(error) = call(&vmm, VmmAction::DeleteGpu(gpu.body.gpu_id.clone())) {
            let reattached = reattach(&vmm, &uds, &ejected);
            if let Ok(mut agent) = AgentChannel::connect(&uds, timeout) {
                let still: Vec<AttachedGpu> = gpus
                    .iter()
                    .filter(|g| !ejected.iter().any(|e| e.body.gpu_id == g.body.gpu_id))
                    .cloned()
                    .collect();
                give_back_to_guest(&mut agent, &still);
            }
            return Err(ActionError {
                status: error.status,
                message: format!(
                    "cannot eject {} for the snapshot: {}{}",
                    gpu.body.gpu_id,
                    error.message,
                    reattached.err().map_or(String::new(), |e| format!(
                        "; giving the others back failed too: {}",
                        e.message
                    ))
                ),
            });
        }
        ejected.push(gpu);
    }
    let released_ms = started.elapsed().as_millis() as u64;
    body.passthrough = PassthroughPolicy::Migrate;
    body.released_gpus = gpus
        .iter()
        .map(|gpu| ReleasedGpu {
            gpu_id: gpu.body.gpu_id.clone(),
            vendor_id: gpu.vendor_id,
            device_id: gpu.device_id,
            bdf: gpu.bdf.clone(),
        })
        .collect();
    let reattach_after = body.reattach;
    let snapshot = call(&vmm, VmmAction::CreateSnapshot(body));
    let reattached = if reattach_after || snapshot.is_err() {
        reattach(&vmm, &uds, &ejected)
    } else {
        Ok(Vec::new())
    };
    let mut answer = match snapshot {
        Ok(VmmData::Json(value)) => value,
        Ok(VmmData::Empty) => serde_json::json!({}),
        Err(error) => {
            return Err(ActionError {
                status: error.status,
                message: format!(
                    "{} (the GPUs were released; {})",
                    error.message,
                    match &reattached {
                        Ok(_) => "they are attached again".to_string(),
                        Err(e) => format!("giving them back failed: {}", e.message),
                    }
                ),
            })
        }
    };
    let reattached = reattached.map_err(|error| ActionError {
        status: error.status,
        message: format!(
            "the snapshot was written to {}, but giving the GPUs back failed: {}",
            answer["snapshot_path"].as_str().unwrap_or_default(),
            error.message
        ),
    })?;
    answer["released_gpus"] = serde_json::json!(gpus
        .iter()
        .map(|g| g.body.gpu_id.clone())
        .collect::<Vec<_>>());
    answer["reattached_gpus"] = serde_json::json!(reattached);
    answer["release_ms"] = serde_json::json!(released_ms);
    answer["total_ms"] = serde_json::json!(started.elapsed().as_millis() as u64);
    Ok(VmmData::Json(answer))
}

/// Tells the agent to take back devices it released that never left (best effort: the
/// request already failed).
fn give_back_to_guest(agent: &mut AgentChannel, gpus: &[AttachedGpu]) {
    for gpu in gpus {
        if let Err(error) = agent.attach(&gpu.body.gpu_id, &gpu.bdf) {
            log::warn!(
                "gpu release: the guest did not take {} back: {error}",
                gpu.body.gpu_id
            );
        }
    }
}

/// Plugs `gpus` again and resumes them in the guest; their new bus addresses.
fn reattach(
    vmm: &ActionSender,
    uds: &Path,
    gpus: &[&AttachedGpu],
) -> Result<Vec<serde_json::Value>, ActionError> {
    let mut done = Vec::new();
    for gpu in gpus {
        let bdf = attach(vmm, uds, gpu.body.clone())?;
        done.push(serde_json::json!({"id": gpu.body.gpu_id, "bdf": bdf}));
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    /// A fake vsock device socket whose "guest" answers with `replies`, one per line read.
    fn fake_agent(
        name: &str,
        replies: Vec<&'static str>,
    ) -> (PathBuf, std::thread::JoinHandle<Vec<String>>) {
        let path = std::env::temp_dir().join(format!("gpuvm-agent-{name}-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).unwrap();
        let handle = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut writer = stream;
            let mut seen = Vec::new();
            for reply in replies {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap() == 0 {
                    break;
                }
                seen.push(line.trim_end().to_string());
                if reply.is_empty() {
                    // Silent, with the connection open (the caller's timeout is shorter).
                    std::thread::sleep(Duration::from_millis(1500));
                } else {
                    writer.write_all(reply.as_bytes()).unwrap();
                }
            }
            seen
        });
        (path, handle)
    }

    #[test]
    fn release_and_attach_speak_the_line_protocol() {
        let (path, guest) =
            fake_agent("ok", vec!["OK 1027\n", "RELEASED gpu0\n", "RESUMED gpu0\n"]);
        let mut agent = AgentChannel::connect(&path, Duration::from_secs(5)).unwrap();
        agent.release("gpu0", "0000:00:05.0").unwrap();
        agent.attach("gpu0", "0000:00:06.0").unwrap();
        drop(agent);
        assert_eq!(
            guest.join().unwrap(),
            [
                "CONNECT 1027",
                "RELEASE gpu0 0000:00:05.0",
                "ATTACH gpu0 0000:00:06.0"
            ]
        );
        let _ = std::fs::remove_file(path);
    }

    #[test]
    fn refusals_wrong_ids_and_silence_are_errors() {
        // Nothing answers the CONNECT (no vsock driver in the guest).
        let (path, _guest) = fake_agent("closed", vec![""]);
        let error = AgentChannel::connect(&path, Duration::from_millis(300))
            .err()
            .unwrap();
        assert!(matches!(error, AgentError::Refused(_)), "{error}");
        let _ = std::fs::remove_file(path);

        let (path, _guest) = fake_agent("error", vec!["OK 1\n", "ERROR gpu0 busy\n"]);
        let mut agent = AgentChannel::connect(&path, Duration::from_secs(5)).unwrap();
        let error = agent.release("gpu0", "0000:00:05.0").unwrap_err();
        assert!(error.to_string().contains("ERROR gpu0 busy"), "{error}");
        let _ = std::fs::remove_file(path);

        let (path, _guest) = fake_agent("other", vec!["OK 1\n", "RELEASED gpu1\n"]);
        let mut agent = AgentChannel::connect(&path, Duration::from_secs(5)).unwrap();
        assert!(agent.release("gpu0", "0000:00:05.0").is_err());
        let _ = std::fs::remove_file(path);

        let (path, _guest) = fake_agent("silent", vec!["OK 1\n", ""]);
        let mut agent = AgentChannel::connect(&path, Duration::from_millis(200)).unwrap();
        let error = agent.release("gpu0", "0000:00:05.0").unwrap_err();
        assert!(matches!(error, AgentError::Timeout { .. }), "{error}");
        let _ = std::fs::remove_file(path);
    }

    #[test]
    fn an_endless_line_is_refused() {
        let long: &'static str = Box::leak("x".repeat(4096).into_boxed_str());
        let (path, _guest) = fake_agent("long", vec!["OK 1\n", long]);
        let mut agent = AgentChannel::connect(&path, Duration::from_secs(5)).unwrap();
        let error = agent.release("gpu0", "0000:00:05.0").unwrap_err();
        assert!(error.to_string().contains("longer than"), "{error}");
        let _ = std::fs::remove_file(path);
    }
}
