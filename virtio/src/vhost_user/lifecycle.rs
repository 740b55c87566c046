//! What both vhost-user devices share: the connection, and activate / reset / pause /
//! resume on top of the relay worker.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vhost::vhost_user::message::{VhostUserConfigFlags, VhostUserProtocolFeatures};
use vhost::vhost_user::VhostUserFrontend;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::connection::{Connection, Negotiated, Timeouts};
use super::relay::{RelayHandler, RingQueue, Rings, StopRequest};
use super::VhostUserError;
use crate::device::{
    read_config_bytes, ActivateError, Activation, ActiveQueue, DeviceState, DeviceStateError,
    QueuePosition, VirtioDevice,
};
use crate::worker::Worker;
use gpuvm_devices::Persist;

enum State {
    Idle,
    Running {
        worker: Worker<RelayHandler>,
        stop_signal: EventFd,
        stopped: Receiver<()>,
    },
    Paused(Rings),
    /// The I/O thread panicked; the rings went with it.
    Failed,
}

/// A device whose queues a vhost-user backend serves.
pub(super) struct VhostUserCore {
    /// "vhost-user-blk": what [`ActivateError`] names.
    kind: &'static str,
    name: String,
    thread_name: String,
    connection: Arc<Mutex<Connection>>,
    broken: Arc<AtomicBool>,
    socket_path: PathBuf,
    reply_timeout: Duration,
    queue_count: usize,
    state: State,
    /// Adopted from another gpuvm process (a live update) and not activated since: the
    /// activation that restores its state holds the rings until resumed.
    adopted: bool,
}

impl VhostUserCore {
    /// Connects and negotiates (see [`Connection::connect`]); refuses a backend with fewer
    /// queues than `queue_count`.
    pub fn connect(
        kind: &'static str,
        name: String,
        thread_name: String,
        socket: &Path,
        queue_count: usize,
        wanted: VhostUserProtocolFeatures,
        timeouts: Timeouts,
    ) -> Result<VhostUserCore, VhostUserError> {
        let connection = Connection::connect(&name, socket, queue_count, wanted, timeouts)?;
        if let Some(backend_queues) = connection.backend_queues() {
            if backend_queues < queue_count as u64 {
                return Err(VhostUserError::Unsupported {
                    socket: socket.to_path_buf(),
                    missing: format!("serves {backend_queues} queues, {name} needs {queue_count}"),
                });
            }
        }
        Ok(Self::over(
            (kind, name, thread_name),
            socket,
            connection,
            queue_count,
            timeouts,
        ))
    }

    /// The device's connection as another gpuvm process negotiated it on `stream` and
    /// handed it over (a live update): nothing is sent until its rings start, once the VM
    /// is this process's. `names`: as [`VhostUserKind::names`].
    pub fn adopt(
        names: (&'static str, String, String),
        socket: &Path,
        stream: std::os::unix::net::UnixStream,
        queue_count: usize,
        negotiated: &Negotiated,
        timeouts: Timeouts,
    ) -> Result<VhostUserCore, VhostUserError> {
        let connection =
            Connection::adopt(&names.1, socket, stream, queue_count, negotiated, timeouts)?;
        let mut core = Self::over(names, socket, connection, queue_count, timeouts);
        core.adopted = true;
        Ok(core)
    }

    /// An idle device over `connection`.
    fn over(
        (kind, name, thread_name): (&'static str, String, String),
        socket: &Path,
        connection: Connection,
        queue_count: usize,
        timeouts: Timeouts,
    ) -> VhostUserCore {
        VhostUserCore {
            kind,
            name,
            thread_name,
            broken: connection.broken_flag(),
            connection: Arc::new(Mutex::new(connection)),
            socket_path: socket.to_path_buf(),
            reply_timeout: timeouts.reply,
            queue_count,
            state: State::Idle,
            adopted: false,
        }
    }

    /// What was negotiated and a duplicate of the connection's socket (a live update).
    fn hand_over(&self) -> std::io::Result<(Negotiated, std::os::fd::OwnedFd)> {
        let connection = crate::lock(&self.connection);
        let socket = connection.socket().try_clone()?;
        Ok((connection.negotiated(), socket))
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn is_broken(&self) -> bool {
        self.broken.load(Ordering::SeqCst)
    }

    pub fn backend_features(&self) -> u64 {
        crate::lock(&self.connection).backend_features()
    }

    pub fn protocol_features(&self) -> VhostUserProtocolFeatures {
        crate::lock(&self.connection).protocol_features()
    }

    /// Runs `request` on the connection (construction time only: once active, requests
    /// run on the I/O thread).
    pub fn request<T>(
        &self,
        name: &'static str,
        request: impl FnOnce(&mut vhost::vhost_user::Frontend) -> vhost::Result<T>,
    ) -> Result<T, VhostUserError> {
        crate::lock(&self.connection).request(name, request)
    }

    pub fn activate(&mut self, activation: Activation) -> Result<(), ActivateError> {
        match self.state {
            State::Idle => {}
            State::Failed => return Err(self.error("its I/O thread failed earlier".into())),
            _ => return Err(self.error("already active".into())),
        }
        if self.is_broken() {
            return Err(self.error(
                VhostUserError::Broken {
                    socket: self.socket_path.clone(),
                }
                .to_string(),
            ));
        }
        let Activation {
            memory,
            acked_features,
            queues,
            interrupt,
        } = activation;
        if queues.len() != self.queue_count {
            return Err(ActivateError::QueueCount {
                device: self.kind,
                given: queues.len(),
                needed: self.queue_count,
            });
        }
        let mut rings = Vec::new();
        for (index, queue) in queues.into_iter().enumerate() {
            if let Some(ActiveQueue { queue, kick }) = queue {
                let call = EventFd::new(EFD_NONBLOCK)
                    .map_err(|error| self.error(VhostUserError::EventFd(error).to_string()))?;
                rings.push(RingQueue {
                    index,
                    queue,
                    kick,
                    call,
                });
            }
        }
        if rings.is_empty() {
            return Err(ActivateError::QueueCount {
                device: self.kind,
                given: 0,
                needed: self.queue_count,
            });
        }
        let rings = Rings {
            memory,
            acked_features,
            queues: rings,
            total_queues: self.queue_count,
            interrupt,
        };
        if std::mem::take(&mut self.adopted) {
            // A live update's restore: the old process may still take the VM back, so the
            // backend hears nothing from here until the device resumes.
            self.state = State::Paused(rings);
            return Ok(());
        }
        self.start(rings)
    }

    /// Starts the I/O thread, which starts the backend's rings before it serves.
    fn start(&mut self, rings: Rings) -> Result<(), ActivateError> {
        let signal = EventFd::new(EFD_NONBLOCK)
            .map_err(|error| self.error(VhostUserError::EventFd(error).to_string()))?;
        let their_signal = signal
            .try_clone()
            .map_err(|error| self.error(VhostUserError::EventFd(error).to_string()))?;
        let (done, stopped) = channel();
        let (outcome_sender, outcome) = channel();
        let handler = RelayHandler::new(
            Arc::clone(&self.connection),
            rings,
            StopRequest {
                signal: their_signal,
                done,
            },
            outcome_sender,
        );
        match Worker::spawn(&self.thread_name, handler) {
            Ok(worker) => {
                self.state = State::Running {
                    worker,
                    stop_signal: signal,
                    stopped,
                };
                Ok(())
            }
            Err(error) => {
                // The rings went with the handler; a reset and a new DRIVER_OK start over.
                self.state = State::Idle;
                let message = match outcome.try_recv() {
                    Ok(Err(setup)) => setup.to_string(),
                    _ => error.to_string(),
                };
                Err(self.error(message))
            }
        }
    }

    /// Stops the rings on the I/O thread, then the thread; the rings come back with their
    /// positions.
    fn stop(&mut self) -> Option<Rings> {
        match std::mem::replace(&mut self.state, State::Failed) {
            State::Running {
                worker,
                stop_signal,
                stopped,
            } => {
                // Every request on the way is bounded by the reply timeout, and a first
                // timeout fails the rest fast; the margin covers the thread's wake-up.
                let bound = self.reply_timeout * 2 + Duration::from_secs(1);
                let asked = stop_signal.write(1).is_ok();
                if !asked || stopped.recv_timeout(bound).is_err() {
                    log::error!(
                        "{}: the I/O thread did not stop the backend's rings within {bound:?}",
                        self.name
                    );
                }
                match worker.stop() {
                    Some(handler) => Some(handler.into_rings()),
                    None => {
                        log::error!("{}: its I/O thread had panicked", self.name);
                        None
                    }
                }
            }
            State::Paused(rings) => Some(rings),
            other => {
                self.state = other;
                None
            }
        }
    }

    pub fn reset(&mut self) {
        if let Some(rings) = self.stop() {
            drop(rings);
            self.state = State::Idle;
        }
    }

    pub fn pause(&mut self) -> Vec<Option<QueuePosition>> {
        match self.stop() {
            Some(rings) => {
                let positions = rings.positions();
                self.state = State::Paused(rings);
                positions
            }
            None => Vec::new(),
        }
    }

    pub fn resume(&mut self) -> Result<(), ActivateError> {
        match std::mem::replace(&mut self.state, State::Idle) {
            State::Paused(rings) => {
                if self.is_broken() {
                    // Keep the rings: a later reset still finds the device paused.
                    self.state = State::Paused(rings);
                    return Err(self.error(
                        VhostUserError::Broken {
                            socket: self.socket_path.clone(),
                        }
                        .to_string(),
                    ));
                }
                self.start(rings)
            }
            other => {
                self.state = other;
                Ok(())
            }
        }
    }

    fn error(&self, message: String) -> ActivateError {
        ActivateError::Device {
            device: self.kind,
            message: format!("{}: {message}", self.name),
        }
    }
}

impl Drop for VhostUserCore {
    /// Stops the backend's rings before guest memory can go away.
    fn drop(&mut self) {
        self.reset();
    }
}

/// "prefix" and up to `15 - prefix - 1` letters or digits of `id` (thread names show 15
/// bytes).
pub(super) fn thread_name(prefix: &str, id: &str) -> String {
    let room = 15usize.saturating_sub(prefix.len() + 1);
    let suffix: String = id
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .take(room)
        .collect();
    if suffix.is_empty() {
        prefix.to_string()
    } else {
        format!("{prefix}-{suffix}")
    }
}

/// A queue count from 1 to 64, and a queue size a virtio-pci transport accepts: a power
/// of two, 1 to 32768.
pub(super) fn check_queues(device: &str, num_queues: u16, size: u16) -> Result<(), VhostUserError> {
    if num_queues == 0 || num_queues > 64 {
        return Err(VhostUserError::Config {
            device: device.to_string(),
            reason: format!("num_queues {num_queues} is not from 1 to 64"),
        });
    }
    if size == 0 || !size.is_power_of_two() || size > 32768 {
        return Err(VhostUserError::Config {
            device: device.to_string(),
            reason: format!("queue_size {size} is not a power of two from 1 to 32768"),
        });
    }
    Ok(())
}

/// What tells one kind of vhost-user device from another, implemented by its
/// configuration ([`VhostUserBlockConfig`](super::VhostUserBlockConfig),
/// [`FsConfig`](super::FsConfig), [`VhostUserConfig`](super::VhostUserConfig));
/// [`VhostUserDevice`] does the rest.
pub trait VhostUserKind: Send + 'static {
    /// The virtio device ID (virtio_bindings::virtio_ids::VIRTIO_ID_*).
    fn device_type(&self) -> u32;
    /// The backend's listening Unix socket.
    fn socket(&self) -> &Path;
    /// The device's queues, every one served by the backend.
    fn queue_count(&self) -> usize;
    /// The largest size of each queue.
    fn queue_size(&self) -> u16;
    /// Whether the guest's configuration-space writes go to the backend (SET_CONFIG, when
    /// the backend speaks CONFIG): only where the configuration space is the backend's.
    fn passes_config_writes(&self) -> bool {
        false
    }
    /// The device's kind ("vhost-user-blk"), its name in logs ("vhost-user-blk data") and
    /// its I/O thread's name.
    fn names(&self) -> (&'static str, String, String);
}

/// What a live update carries of a vhost-user device besides its connection's socket: what
/// the connection negotiated, and the features and configuration space its guest sees.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VhostUserLive {
    pub negotiated: Negotiated,
    pub features: u64,
    pub config_space: Vec<u8>,
}

/// What a vhost-user device's state can tell: which device it was. Its real state lives in
/// the backend, which gpuvm cannot ask for it, so a restore refuses it (and a snapshot is
/// refused before it gets there, see [`VhostUserDevice::snapshot_refusal`]).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VhostUserState {
    /// The device's name ("vhost-user-blk data").
    pub device: String,
    /// The virtio device ID.
    pub device_type: u32,
    /// The backend's socket.
    pub socket: std::path::PathBuf,
}

/// Why a vhost-user device's state cannot be loaded.
#[derive(Debug, thiserror::Error)]
pub enum VhostUserStateError {
    #[error(
        "{device}: a vhost-user device cannot be snapshotted: its state lives in the backend at \
         {} and gpuvm does not implement the vhost-user DEVICE_STATE transfer",
        socket.display()
    )]
    InBackend {
        device: String,
        socket: std::path::PathBuf,
    },
}

/// A virtio device whose queues a vhost-user backend serves: [`VhostUserBlock`],
/// [`VhostUserFs`](super::VhostUserFs) or [`VhostUserGeneric`](super::VhostUserGeneric), by
/// its configuration `C`.
///
/// [`VhostUserBlock`]: super::VhostUserBlock
pub struct VhostUserDevice<C: VhostUserKind> {
    pub(super) config: C,
    pub(super) core: VhostUserCore,
    /// The backend's features gpuvm passes on to the guest.
    pub(super) features: u64,
    /// What the guest reads from the configuration space.
    pub(super) config_space: Vec<u8>,
}

impl<C: VhostUserKind> VhostUserDevice<C> {
    pub fn config(&self) -> &C {
        &self.config
    }

    /// The backend died, closed its socket or missed a reply: the queues are no longer
    /// served (the guest sees a hung device). There is no reconnection.
    pub fn is_broken(&self) -> bool {
        self.core.is_broken()
    }

    /// Why a snapshot of a VM with this device must be refused (always, for now: the
    /// device's state (a disk's, virtiofsd's open files and inodes) lives in the backend
    /// and DEVICE_STATE is not implemented). The VMM calls it on every device before
    /// pausing for a snapshot.
    pub fn snapshot_refusal(&self) -> Option<String> {
        Some(self.refusal())
    }

    fn refusal(&self) -> String {
        self.state_refusal().to_string()
    }

    /// What a live update carries of the device (the connection's negotiation, the
    /// features and configuration space the guest sees) and a duplicate of the
    /// connection's socket.
    pub fn hand_over(&self) -> Result<(VhostUserLive, std::os::fd::OwnedFd), String> {
        let (negotiated, socket) = self
            .core
            .hand_over()
            .map_err(|e| format!("{}: cannot duplicate its socket: {e}", self.core.name()))?;
        let live = VhostUserLive {
            negotiated,
            features: self.features,
            config_space: self.config_space.clone(),
        };
        Ok((live, socket))
    }

    /// The device over the connection another gpuvm process handed over (`stream`, what
    /// it negotiated and showed the guest in `live`): nothing is asked of the backend
    /// here (it serves one frontend, set up already); the device's restored state activates
    /// it held, and its resume (once the VM is this process's) renegotiates and starts the
    /// rings.
    pub fn adopting(
        config: C,
        stream: std::os::unix::net::UnixStream,
        live: &VhostUserLive,
    ) -> Result<Self, VhostUserError> {
        let core = VhostUserCore::adopt(
            config.names(),
            config.socket(),
            stream,
            config.queue_count(),
            &live.negotiated,
            Timeouts::default(),
        )?;
        log::info!(
            "{}: adopting the handed-over connection to {}",
            core.name(),
            config.socket().display()
        );
        Ok(VhostUserDevice {
            config,
            core,
            features: live.features,
            config_space: live.config_space.clone(),
        })
    }

    fn state_refusal(&self) -> VhostUserStateError {
        VhostUserStateError::InBackend {
            device: self.core.name().to_string(),
            socket: self.config.socket().to_path_buf(),
        }
    }
}

impl<C: VhostUserKind> VirtioDevice for VhostUserDevice<C> {
    fn name(&self) -> &str {
        self.core.name()
    }

    fn device_type(&self) -> u32 {
        self.config.device_type()
    }

    fn queue_max_sizes(&self) -> Vec<u16> {
        vec![self.config.queue_size(); self.config.queue_count()]
    }

    fn device_features(&self) -> u64 {
        self.features
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.config_space, offset, data);
    }

    fn write_config(&mut self, offset: u64, data: &[u8]) {
        let range = usize::try_from(offset)
            .ok()
            .and_then(|start| Some(start..start.checked_add(data.len())?))
            .filter(|range| range.end <= self.config_space.len());
        let passed = self.config.passes_config_writes()
            && self
                .core
                .protocol_features()
                .contains(VhostUserProtocolFeatures::CONFIG);
        let Some(range) = range.filter(|_| passed) else {
            log::debug!(
                "{}: ignored a {}-byte configuration write at {offset}",
                self.core.name(),
                data.len()
            );
            return;
        };
        // The offset fits a u32: it is inside the configuration space. Flags 0 is "a
        // front-end write of a writable field" in the vhost-user specification (the vhost
        // crate's WRITABLE, 1, is what QEMU's backends take for live migration).
        let written = self.core.request("SET_CONFIG", |f| {
            f.set_config(range.start as u32, VhostUserConfigFlags::empty(), data)
        });
        match written {
            Ok(()) => self.config_space[range].copy_from_slice(data),
            Err(error) => log::warn!(
                "{}: the backend refused a {}-byte configuration write at {offset}: {error}",
                self.core.name(),
                data.len()
            ),
        }
    }

    fn activate(&mut self, activation: Activation) -> Result<(), ActivateError> {
        self.core.activate(activation)
    }

    fn reset(&mut self) {
        self.core.reset();
    }

    fn pause(&mut self) -> Vec<Option<QueuePosition>> {
        self.core.pause()
    }

    fn resume(&mut self) -> Result<(), ActivateError> {
        self.core.resume()
    }

    fn save_state(&self) -> Result<DeviceState, DeviceStateError> {
        Ok(DeviceState::VhostUser(Persist::save(self)?))
    }

    fn restore_state(&mut self, state: &DeviceState) -> Result<(), DeviceStateError> {
        match state {
            DeviceState::VhostUser(state) => Ok(Persist::restore(self, state)?),
            other => Err(DeviceStateError::wrong_kind(
                self.core.name(),
                "vhost_user",
                other,
            )),
        }
    }

    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }
}

impl<C: VhostUserKind> Persist for VhostUserDevice<C> {
    type State = VhostUserState;
    type Error = VhostUserStateError;

    /// Which device it was (a snapshot is refused before it gets here, see
    /// [`VhostUserDevice::snapshot_refusal`]).
    fn save(&self) -> Result<VhostUserState, VhostUserStateError> {
        Ok(VhostUserState {
            device: self.core.name().to_string(),
            device_type: self.config.device_type(),
            socket: self.config.socket().to_path_buf(),
        })
    }

    /// Refused (the backend's state was never saved) unless the device took over a live
    /// update's connection, whose backend kept its state: the same device on the same socket.
    fn restore(&mut self, state: &VhostUserState) -> Result<(), VhostUserStateError> {
        let same =
            state.device_type == self.config.device_type() && state.socket == self.config.socket();
        if self.core.adopted && same {
            return Ok(());
        }
        Err(self.state_refusal())
    }
}
