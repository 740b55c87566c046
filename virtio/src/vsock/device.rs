//! [`Vsock`]: the virtio-vsock device as the transport sees it (configuration space,
//! activation, pause/resume, snapshot state).

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixListener;
use std::sync::Arc;

use gpuvm_devices::Persist;
use virtio_bindings::virtio_ids::VIRTIO_ID_VSOCK;
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use virtio_queue::QueueT;
use vmm_sys_util::timerfd::TimerFd;

use super::handler::VsockWorker;
use super::muxer::{Muxer, MuxerLive};
use super::unix::HostListener;
use super::{validate_guest_cid, VsockConfig, VsockError};
use crate::worker::{duplicate_timer, Worker};
use crate::{
    read_config_bytes, ActivateError, Activation, DeviceState, DeviceStateError, QueuePosition,
    VirtioDevice,
};

/// The name of the device's I/O thread.
pub const THREAD_NAME: &str = "virtio-vsock";
/// rx, tx, event.
const QUEUE_COUNT: usize = 3;
const QUEUE_MAX_SIZE: u16 = 256;
const DEVICE: &str = "virtio-vsock";

/// What the device keeps across a snapshot. Live host connections cannot be kept: the
/// restored guest gets a TRANSPORT_RESET and starts without any.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VsockState {
    pub guest_cid: u64,
}

/// A running vsock device's connections as a live update carries them to the new process
/// (never in a snapshot, which cannot keep host connections): the muxer's state, whose
/// sockets go beside as descriptors, and whether a TRANSPORT_RESET still waits.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VsockLiveState {
    pub muxer: MuxerLive,
    pub transport_reset_pending: bool,
}

impl VsockLiveState {
    /// How many descriptors go with it (connections', then waiting clients').
    pub fn descriptors(&self) -> usize {
        self.muxer.descriptors()
    }

    /// The bytes its connections hold for their host sockets.
    pub fn buffered(&self) -> usize {
        self.muxer.buffered()
    }
}

/// Why a vsock device's state was refused.
#[derive(Debug, thiserror::Error)]
pub enum VsockStateError {
    #[error("{device}: the saved {source}")]
    GuestCid { device: String, source: VsockError },
}

enum Run {
    Inactive,
    Running(Worker<VsockWorker>),
    Paused(Box<VsockWorker>),
    /// The worker thread panicked or could not restart: the queues are lost until reset.
    Failed,
}

/// A virtio-vsock device whose host side is Firecracker's hybrid vsock: a Unix socket at
/// `uds_path` for host-initiated connections (`CONNECT <port>\n`), and
/// `<uds_path>_<port>` sockets for the guest's.
pub struct Vsock {
    name: String,
    guest_cid: u64,
    listener: Arc<HostListener>,
    /// The muxer's timeout timer; each activation's muxer gets a duplicate of it.
    timer: TimerFd,
    run: Run,
    /// Set by a restore: the next activation sends the guest a TRANSPORT_RESET.
    transport_reset_on_activate: bool,
    /// A live update's connections (and their sockets): the next activation serves them
    /// instead of starting empty, with no TRANSPORT_RESET.
    adopted: Option<(VsockLiveState, Vec<OwnedFd>)>,
}

impl Vsock {
    /// Checks `config` and listens on its `uds_path` (host clients may connect before the
    /// guest's driver is up; they are served once it is).
    pub fn new(config: &VsockConfig) -> Result<Self, VsockError> {
        config.validate()?;
        let listener = HostListener::bind(&config.uds_path)?;
        Self::with_listener(config, listener)
    }

    /// As [`Vsock::new`], over the listener another gpuvm process bound at `uds_path`
    /// and handed over (a live update); the socket file is this device's once
    /// [`Vsock::own_socket_file`] says so.
    pub fn adopting(config: &VsockConfig, listener: UnixListener) -> Result<Self, VsockError> {
        config.validate()?;
        let listener = HostListener::adopt(listener, &config.uds_path)?;
        Self::with_listener(config, listener)
    }

    fn with_listener(config: &VsockConfig, listener: HostListener) -> Result<Self, VsockError> {
        let timer = TimerFd::new().map_err(|error| VsockError::Timer(error.into()))?;
        let name = match &config.vsock_id {
            Some(id) => format!("virtio-vsock {id}"),
            None => "virtio-vsock".to_string(),
        };
        Ok(Vsock {
            name,
            guest_cid: config.guest_cid,
            listener: Arc::new(listener),
            timer,
            run: Run::Inactive,
            transport_reset_on_activate: false,
            adopted: None,
        })
    }

    /// A duplicate of the listening socket (a live update hands it to the new process).
    pub fn listener_descriptor(&self) -> std::io::Result<OwnedFd> {
        Ok(OwnedFd::from(self.listener.listener.try_clone()?))
    }

    /// The paused device's connections and waiting host clients with duplicates of their
    /// sockets (a live update); None when the driver never started the device (nothing
    /// to carry).
    pub fn hand_over(&self) -> Result<Option<(VsockLiveState, Vec<OwnedFd>)>, String> {
        match &self.run {
            Run::Paused(handler) => {
                let (muxer, fds, transport_reset_pending) = handler
                    .hand_over()
                    .map_err(|e| format!("{}: cannot duplicate a socket: {e}", self.name))?;
                let live = VsockLiveState {
                    muxer,
                    transport_reset_pending,
                };
                Ok(Some((live, fds)))
            }
            Run::Inactive => Ok(None),
            Run::Running(_) => Err(format!("{} runs: pause it first", self.name)),
            Run::Failed => Err(format!(
                "{}: its worker thread died; the driver must reset it",
                self.name
            )),
        }
    }

    /// Takes over the connections a live update carried (`live`, their sockets `fds`):
    /// the device's next activation (the restore of its saved state) serves them, with
    /// no TRANSPORT_RESET, and stays paused until resumed (nothing is read from or
    /// written to the host sockets before the new process runs the VM).
    pub fn adopt_connections(&mut self, live: VsockLiveState, fds: Vec<OwnedFd>) {
        self.adopted = Some((live, fds));
    }

    /// Whether dropping the device removes `uds_path`'s socket file: a live update's old
    /// process gives it up (`false`) once the new one has the VM, and the new one takes
    /// it (`true`) then.
    pub fn own_socket_file(&self, owns: bool) {
        self.listener.set_owns_file(owns);
    }

    pub fn guest_cid(&self) -> u64 {
        self.guest_cid
    }

    pub fn uds_path(&self) -> &std::path::Path {
        self.listener.path()
    }

    fn stop(&mut self) -> Option<Box<VsockWorker>> {
        match std::mem::replace(&mut self.run, Run::Inactive) {
            Run::Running(worker) => match worker.stop() {
                Some(handler) => Some(Box::new(handler)),
                None => {
                    log::error!("{}: the worker thread panicked", self.name);
                    self.run = Run::Failed;
                    None
                }
            },
            Run::Paused(handler) => Some(handler),
            Run::Inactive | Run::Failed => None,
        }
    }

    fn spawn(&mut self, handler: VsockWorker) -> Result<(), ActivateError> {
        match Worker::spawn(THREAD_NAME, handler) {
            Ok(worker) => {
                self.run = Run::Running(worker);
                Ok(())
            }
            Err(source) => {
                self.run = Run::Failed;
                Err(ActivateError::thread(DEVICE, source))
            }
        }
    }

    #[cfg(test)]
    pub(super) fn with_paused_worker<T>(&self, look: impl FnOnce(&VsockWorker) -> T) -> Option<T> {
        match &self.run {
            Run::Paused(handler) => Some(look(handler)),
            _ => None,
        }
    }
}

impl VirtioDevice for Vsock {
    fn name(&self) -> &str {
        &self.name
    }

    fn device_type(&self) -> u32 {
        VIRTIO_ID_VSOCK
    }

    fn queue_max_sizes(&self) -> Vec<u16> {
        vec![QUEUE_MAX_SIZE; QUEUE_COUNT]
    }

    fn device_features(&self) -> u64 {
        1 << VIRTIO_RING_F_EVENT_IDX
    }

    /// The configuration space is `le64 guest_cid`.
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.guest_cid.to_le_bytes(), offset, data);
    }

    fn write_config(&mut self, offset: u64, data: &[u8]) {
        log::debug!(
            "{}: ignoring a {}-byte write at {offset} to the read-only configuration",
            self.name,
            data.len()
        );
    }

    fn activate(&mut self, activation: Activation) -> Result<(), ActivateError> {
        if !matches!(self.run, Run::Inactive) {
            self.reset();
        }
        let given = activation.queues.iter().flatten().count();
        let mut queues = activation.queues.into_iter();
        let mut take = || queues.next().flatten();
        let (Some(rx), Some(tx), Some(event)) = (take(), take(), take()) else {
            return Err(ActivateError::QueueCount {
                device: DEVICE,
                given,
                needed: QUEUE_COUNT,
            });
        };
        let mut queues = [rx, tx, event];
        let event_idx = activation.acked_features & (1 << VIRTIO_RING_F_EVENT_IDX) != 0;
        for active in &mut queues {
            active.queue.set_event_idx(event_idx);
        }
        let timer = duplicate_timer(&self.timer).map_err(|error| ActivateError::Device {
            device: DEVICE,
            message: format!("cannot use its timer: {error}"),
        })?;
        let adopted = self.adopted.take();
        let (muxer, transport_reset) = match adopted {
            // A live update's connections: held until the transport resumes the device.
            Some((live, fds)) => {
                let muxer = Muxer::from_live(
                    self.guest_cid,
                    self.listener.clone(),
                    timer,
                    &live.muxer,
                    fds,
                )
                .map_err(|message| ActivateError::Device {
                    device: DEVICE,
                    message: format!("the handed-over connections: {message}"),
                })?;
                log::info!(
                    "{}: {} connection(s) and {} waiting host client(s) taken over",
                    self.name,
                    live.muxer.connections.len(),
                    live.muxer.pending_clients.len()
                );
                (muxer, Some(live.transport_reset_pending))
            }
            None => (
                Muxer::new(self.guest_cid, self.listener.clone(), timer),
                None,
            ),
        };
        let handler = VsockWorker::new(
            activation.memory,
            activation.interrupt,
            queues,
            muxer,
            transport_reset.unwrap_or(self.transport_reset_on_activate),
        );
        self.transport_reset_on_activate = false;
        if transport_reset.is_some() {
            self.run = Run::Paused(Box::new(handler));
            return Ok(());
        }
        self.spawn(handler)
    }

    fn reset(&mut self) {
        // Dropping the worker's state closes every connection's host socket; the listener
        // stays for the next activation.
        drop(self.stop());
        self.run = Run::Inactive;
    }

    fn pause(&mut self) -> Vec<Option<QueuePosition>> {
        match self.stop() {
            Some(handler) => {
                let positions = handler.queue_positions();
                self.run = Run::Paused(handler);
                positions
            }
            None => Vec::new(),
        }
    }

    fn resume(&mut self) -> Result<(), ActivateError> {
        match std::mem::replace(&mut self.run, Run::Inactive) {
            Run::Paused(handler) => self.spawn(*handler),
            Run::Failed => {
                self.run = Run::Failed;
                Err(ActivateError::Device {
                    device: DEVICE,
                    message: "its worker thread died; the driver must reset it".to_string(),
                })
            }
            other => {
                self.run = other;
                Ok(())
            }
        }
    }

    fn save_state(&self) -> Result<DeviceState, DeviceStateError> {
        Ok(DeviceState::Vsock(Persist::save(self)?))
    }

    /// A live update reaches the device's listener and connections through this.
    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }

    fn restore_state(&mut self, state: &DeviceState) -> Result<(), DeviceStateError> {
        match state {
            DeviceState::Vsock(state) => Ok(Persist::restore(self, state)?),
            other => Err(DeviceStateError::wrong_kind(&self.name, "vsock", other)),
        }
    }
}

impl Persist for Vsock {
    type State = VsockState;
    type Error = VsockStateError;

    fn save(&self) -> Result<VsockState, VsockStateError> {
        Ok(VsockState {
            guest_cid: self.guest_cid,
        })
    }

    /// The restored guest gets a TRANSPORT_RESET once activated; it then re-reads
    /// guest_cid, so the CID configured now (which a clone of the snapshot may change)
    /// is the one in force.
    fn restore(&mut self, state: &VsockState) -> Result<(), VsockStateError> {
        validate_guest_cid(state.guest_cid).map_err(|source| VsockStateError::GuestCid {
            device: self.name.clone(),
            source,
        })?;
        if state.guest_cid != self.guest_cid {
            log::info!(
                "{}: the snapshot's guest_cid {} becomes {} (the guest re-reads it on the transport reset)",
                self.name,
                state.guest_cid,
                self.guest_cid
            );
        }
        // A live update's connections go on: the guest must not hear of a reset.
        self.transport_reset_on_activate = self.adopted.is_none();
        Ok(())
    }
}
