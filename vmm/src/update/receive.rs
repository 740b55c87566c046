//! The new process's side of a live update (`gpuvm update-receive`): take the offer,
//! build the VM over the handed-over RAM while the guest still runs in the old process,
//! load the paused state, say it is ready, and run the VM only once the old process commits
//! (or has died after `Ready` without taking the VM back).

use std::fs::File;
use std::io::Write;
use std::os::unix::io::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpuvm_vfio::kernel::HandOverMark;
use gpuvm_vfio::user::BackendHealth;

use super::kernel_vfio::IncomingKernelVfio;
use super::passthrough::IncomingVfioUser;
use super::protocol::{self, MessageKind, OfferMeta, ReadyBody, OFFER_FDS};
use super::{socket, UpdateError};
use crate::builder::PreparedMachine;
use crate::machine::Machine;
use crate::snapshot::{MachineState, RestoreTimings};

/// The test hook that makes the new process fail at one step, to check that the old one
/// takes the VM back: `refuse` (answers the paused state with `Refused`), `crash` (aborts
/// before `Ready`), `hang` (never sends `Ready`).
pub const FAIL_HOOK: &str = "GPUVM_TEST_UPDATE_FAIL";

/// How long the new process waits for the old one to be gone once the hand-over socket
/// closed without `Commit` or `Abort`.
const OLD_EXIT_WAIT: Duration = Duration::from_secs(2);

/// An offer taken from the old process, its descriptors owned here.
pub struct Incoming {
    socket: UnixStream,
    /// The old process, watched for its exit.
    old: OldProcess,
    pub meta: OfferMeta,
    ram: Option<OwnedFd>,
    stdio: [OwnedFd; 3],
    /// The virtio-blk drives' open images (drive ID, descriptor), until the VM is built.
    images: Vec<(String, std::fs::File)>,
    /// The network interfaces' tap queues (interface ID, queues), until the VM is built.
    taps: Vec<(String, Vec<gpuvm_virtio::net::Tap>)>,
    /// The vfio-user devices' connections, until the paused state is loaded.
    vfio_user: Vec<IncomingVfioUser>,
    /// The taken-over vfio-user connections' health: marked handed back if this process
    /// does not run the VM, so that it neither speaks on them nor resets the devices.
    adopted: Vec<Arc<BackendHealth>>,
    /// The kernel VFIO devices' iommufd and cdevs, until the paused state is loaded.
    kernel_vfio: Option<IncomingKernelVfio>,
    /// The hot-plugged kernel VFIO devices' contexts and files, each its own, likewise.
    hot_kernel_vfio: Vec<IncomingKernelVfio>,
    /// Their marks: left alone here (neither detached nor reset) unless this process
    /// commits.
    kernel_marks: Vec<Arc<HandOverMark>>,
    /// The log and metrics outputs, as the offer said, until adopted.
    outputs: Option<(
        crate::outputs::HandedOverOutputs,
        Option<File>,
        Option<File>,
    )>,
    /// The configuration and device state the VM is built from, saved while it ran.
    state: MachineState,
    /// The VM built from `state`, until the paused state is loaded into it.
    prepared: Option<PreparedMachine>,
    /// When the old process paused the vCPUs (CLOCK_MONOTONIC ns), once it has.
    paused_at_ns: Option<u64>,
    /// The VM's MMDS: given to the interfaces built here, taken from the state (the
    /// offer's, then the paused one's), served by this process's API
    /// ([`Incoming::mmds`]).
    mmds: Arc<gpuvm_mmds::Mmds>,
    /// The old process's API listening socket, which came with `Commit`
    /// ([`Incoming::take_api_listener`]).
    api_listener: Option<UnixListener>,
    /// The vsock device's listening socket, until the VM is built.
    vsock_listener: Option<UnixListener>,
    /// The vhost-user devices' connections (device id, socket and what goes with it), until
    /// the VM is built.
    vhost_user: Vec<(String, crate::virtio::HandedOverVhostUser)>,
}

/// How the hand-over ended for the new process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The old process committed: the VM is this process's.
    Committed,
    /// The old process died after `Ready` without a word: nobody else runs the VM.
    OldProcessDied,
}

/// Waits (at most `timeout`) for the old process, `old_pid`, to connect to `listener`, and
/// takes its offer and state. Connections from any other process are refused (closed
/// unread) and the wait goes on.
pub fn accept(
    listener: &UnixListener,
    old: OldProcess,
    timeout: Duration,
) -> Result<Incoming, UpdateError> {
    let old_pid = old.pid;
    let (socket, offer, meta) = offer_from(listener, &old, timeout)?;
    // (One in another pid namespace names itself by its pid there.)
    if old.token.is_none() && meta.old_pid != old_pid {
        return Err(UpdateError::Protocol(format!(
            "the offer comes from process {old_pid} but names process {}",
            meta.old_pid
        )));
    }
    if offer.fds.len() != meta.descriptor_count() {
        return Err(UpdateError::Protocol(format!(
            "the offer brings {} descriptors, not {OFFER_FDS}, one for each of its {} drives, \
             one for each tap queue of its {} interfaces and {} for its vfio-user devices",
            offer.fds.len(),
            meta.drives.len(),
            meta.interfaces.len(),
            meta.vfio_user
                .iter()
                .map(super::passthrough::OfferedVfioUser::descriptor_count)
                .sum::<usize>()
        )));
    }
    let mut fds = offer.fds.into_iter();
    let mut next = || fds.next().ok_or(UpdateError::PeerClosed);
    let ram = next()?;
    let stdio = [next()?, next()?, next()?];
    let mut images = Vec::new();
    for drive in &meta.drives {
        images.push((drive.clone(), std::fs::File::from(next()?)));
    }
    let mut taps = Vec::new();
    for iface in &meta.interfaces {
        let queues = (0..iface.queues)
            .map(|_| {
                // Checked as any tap passed by descriptor: an attached tap queue, with the
                // flags the device needs.
                gpuvm_virtio::net::Tap::from_fd(next()?).map_err(|e| {
                    UpdateError::Protocol(format!("interface {}: {e}", iface.iface_id))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        taps.push((iface.iface_id.clone(), queues));
    }
    let mut vfio_user = Vec::new();
    for offered in &meta.vfio_user {
        let connection = next()?;
        let files = (0..offered.layout.file_count())
            .map(|_| next())
            .collect::<Result<Vec<_>, _>>()?;
        vfio_user.push(IncomingVfioUser::new(offered.clone(), connection, files));
    }
    // One kernel VFIO context's descriptors: its iommufd or container, its type1 groups'
    // files, its devices' files.
    let mut kernel_context = |offered: &super::handed_over::OfferedKernelVfio| {
        let groups = offered.type1_groups.as_ref().map_or(0, Vec::len);
        if groups > offered.devices.len() {
            return Err(UpdateError::Protocol(format!(
                "the offer brings {groups} type1 groups for {} devices",
                offered.devices.len()
            )));
        }
        let context = next()?;
        let groups = (0..groups).map(|_| next()).collect::<Result<Vec<_>, _>>()?;
        let cdevs = (offered.devices.iter())
            .map(|_| next())
            .collect::<Result<Vec<_>, _>>()?;
        Ok(IncomingKernelVfio::new(
            offered.clone(),
            context,
            groups,
            cdevs,
        ))
    };
    let kernel_vfio = meta
        .kernel_vfio
        .as_ref()
        .map(&mut kernel_context)
        .transpose()?;
    if meta.hot_kernel_vfio.len() > protocol::MAX_HOT_KERNEL_VFIO_DEVICES
        || meta.hot_kernel_vfio.iter().any(|o| o.devices.len() != 1)
    {
        return Err(UpdateError::Protocol(format!(
            "the offer brings {} hot-plugged kernel VFIO contexts (at most {}, one device each)",
            meta.hot_kernel_vfio.len(),
            protocol::MAX_HOT_KERNEL_VFIO_DEVICES
        )));
    }
    let hot_kernel_vfio = (meta.hot_kernel_vfio.iter())
        .map(&mut kernel_context)
        .collect::<Result<Vec<_>, _>>()?;
    let outputs = match &meta.outputs {
        None => None,
        Some(offered) => {
            let log = if offered.log {
                Some(File::from(next()?))
            } else {
                None
            };
            let metrics = if offered.metrics {
                Some(File::from(next()?))
            } else {
                None
            };
            Some((offered.clone(), log, metrics))
        }
    };
    let vsock_listener = match meta.vsock_listener {
        true => Some(UnixListener::from(next()?)),
        false => None,
    };
    let mut vhost_user = Vec::new();
    for offered in &meta.vhost_user {
        let stream = std::os::unix::net::UnixStream::from(next()?);
        vhost_user.push((offered.id.clone(), (stream, offered.live.clone())));
    }
    let kernel_marks = (kernel_vfio.iter().chain(&hot_kernel_vfio))
        .flat_map(|kernel| kernel.marks.clone())
        .collect();
    let adopted = vfio_user
        .iter()
        .map(|device| device.health.clone())
        .collect();
    let framed = protocol::expect(&socket, MessageKind::State)?;
    let state = match decode_state(&framed.payload) {
        Ok(state) => state,
        Err(error) => {
            // The old process hears why, and takes the VM back.
            let _ = protocol::send(
                &socket,
                MessageKind::Refused,
                error.to_string().as_bytes(),
                &[],
            );
            return Err(error);
        }
    };
    Ok(Incoming {
        socket,
        old,
        meta,
        ram: Some(ram),
        stdio,
        images,
        taps,
        vfio_user,
        adopted,
        kernel_vfio,
        hot_kernel_vfio,
        kernel_marks,
        outputs,
        state,
        prepared: None,
        paused_at_ns: None,
        mmds: Arc::default(),
        api_listener: None,
        vsock_listener,
        vhost_user,
    })
}

/// The old process's connection and offer. Known by its token, it is the first connection
/// whose offer brings it (others are closed with no answer, and the wait goes on: a
/// process that connects first learns nothing); known by its pid, the first connection
/// from it.
fn offer_from(
    listener: &UnixListener,
    old: &OldProcess,
    timeout: Duration,
) -> Result<(UnixStream, protocol::Frame, OfferMeta), UpdateError> {
    let set_timeout = |socket: &UnixStream, wait: Duration| {
        socket
            .set_read_timeout(Some(wait))
            .map_err(|source| UpdateError::Socket {
                what: "set the hand-over socket's timeout",
                source,
            })
    };
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let socket = accept_from(listener, old, left)?;
        let Some(token) = &old.token else {
            set_timeout(&socket, timeout)?;
            let offer = protocol::expect(&socket, MessageKind::Offer)?;
            let meta = serde_json::from_slice(&offer.payload)
                .map_err(|e| UpdateError::Protocol(format!("a bad offer: {e}")))?;
            return Ok((socket, offer, meta));
        };
        // A connection that may not be the old process's gets what is left of the wait.
        set_timeout(&socket, left.max(Duration::from_millis(1)))?;
        let offer = protocol::expect(&socket, MessageKind::Offer).ok();
        let parsed = offer.and_then(|offer| {
            let meta: OfferMeta = serde_json::from_slice(&offer.payload).ok()?;
            Some((offer, meta))
        });
        match parsed {
            Some((offer, meta)) if meta.handover_token.as_deref() == Some(token.as_str()) => {
                set_timeout(&socket, timeout)?;
                return Ok((socket, offer, meta));
            }
            _ => log::warn!(
                "live update: refused a connection to the hand-over socket whose offer does not \
                 bring the hand-over token"
            ),
        }
    }
}

/// The first connection to `listener` from process `old_pid` (of root or of this
/// process's user) within `timeout`. Any other is closed at once, unread: whoever connects
/// first cannot take the VM, nor end the wait for the old process.
fn accept_from(
    listener: &UnixListener,
    old: &OldProcess,
    timeout: Duration,
) -> Result<UnixStream, UpdateError> {
    let old_pid = old.pid;
    let deadline = Instant::now() + timeout;
    let uid = socket::effective_uid();
    let mut refused = 0usize;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let mut poll = libc::pollfd {
            fd: listener.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // Rounded up: a wait of less than a millisecond is not a zero-timeout poll.
        let millis = left.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
        // SAFETY: poll reads and writes the one pollfd passed, a live local.
        let ready = unsafe { libc::poll(&mut poll, 1, millis) };
        if ready < 0 {
            let error = std::io::Error::last_os_error();
            if error.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(UpdateError::Socket {
                what: "wait for the running gpuvm to connect",
                source: error,
            });
        }
        if ready == 0 {
            let others = match refused {
                0 => String::new(),
                n => format!("; connections refused from other processes: {n}"),
            };
            return Err(UpdateError::Socket {
                what: "wait for the running gpuvm to connect",
                source: std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("process {old_pid} did not connect within {timeout:?}{others}"),
                ),
            });
        }
        let (socket, _) = listener.accept().map_err(|source| UpdateError::Socket {
            what: "accept the running gpuvm's connection",
            source,
        })?;
        let peer = socket::peer_credentials(&socket)?;
        if old.may_be(peer) && (peer.uid == uid || uid == 0) {
            return Ok(socket);
        }
        refused += 1;
        log::warn!(
            "live update: refused a connection to the hand-over socket from process {} \
             (uid {}): only process {old_pid} hands its VM over",
            peer.pid,
            peer.uid
        );
    }
}

/// Reads the state as this binary reads a snapshot's state file: magic, version (older
/// ones migrated, newer ones refused), length, CRC, by the one decoder of state files.
fn decode_state(framed: &[u8]) -> Result<MachineState, UpdateError> {
    // Decoded from memory: a jailed new process has no /proc to reopen a memfd by.
    crate::persist::decode_state_bytes(framed, "the handed-over state")
        .map_err(|e| UpdateError::Load(e.to_string()))
}

impl Incoming {
    /// The VM's MMDS as the old process handed it over: the API of the process that runs
    /// the VM must serve this one (its interfaces answer from it).
    pub fn mmds(&self) -> Arc<gpuvm_mmds::Mmds> {
        self.mmds.clone()
    }

    /// Takes the MMDS from `state`, if it brings one.
    fn take_mmds(&self, state: &MachineState) -> Result<(), UpdateError> {
        match &state.devices.handed_over_mmds {
            Some(saved) => self
                .mmds
                .restore(saved)
                .map_err(|e| self.refuse(UpdateError::Load(e.to_string()))),
            None => Ok(()),
        }
    }

    /// Makes the old process's stdin, stdout (the serial console) and stderr this
    /// process's, and its log and metrics outputs and log level, so the console, the log
    /// and the metrics go on where they went.
    pub fn adopt_outputs(&mut self) -> Result<(), UpdateError> {
        if let Some((outputs, log, metrics)) = self.outputs.take() {
            crate::outputs::adopt(&outputs, log, metrics)
                .map_err(|reason| self.refuse(UpdateError::Protocol(reason)))?;
        }
        for (target, fd) in self.stdio.iter().enumerate() {
            // SAFETY: dup2 onto 0, 1 and 2, which this process owns; `fd` is live.
            if unsafe { libc::dup2(fd.as_raw_fd(), target as i32) } < 0 {
                return Err(UpdateError::Io {
                    what: "take over the old process's stdio",
                    source: std::io::Error::last_os_error(),
                });
            }
        }
        Ok(())
    }

    /// Builds the VM over the handed-over RAM, with its devices and vCPUs, while the old
    /// process still runs the guest, and says so (`Built`). A failure is told to the old
    /// process (which keeps the VM) and returned.
    pub fn prepare(&mut self, serial_out: Box<dyn Write + Send>) -> Result<(), UpdateError> {
        self.prepare_or_hand_back(serial_out)
            .inspect_err(|_| self.hand_back())
    }

    fn prepare_or_hand_back(
        &mut self,
        serial_out: Box<dyn Write + Send>,
    ) -> Result<(), UpdateError> {
        if self.meta.ram_size != self.state.config.memory_size {
            return Err(self.refuse(UpdateError::Protocol(format!(
                "the offer's RAM is {} bytes, the state's {}",
                self.meta.ram_size, self.state.config.memory_size
            ))));
        }
        let mut offered: Vec<&str> = self.images.iter().map(|(id, _)| id.as_str()).collect();
        let mut saved = state_drives(&self.state);
        offered.sort_unstable();
        saved.sort_unstable();
        if offered != saved {
            return Err(self.refuse(UpdateError::Protocol(format!(
                "the offer brings the images of drives {offered:?}, the state has drives \
                 {saved:?}"
            ))));
        }
        let mut offered: Vec<&str> = self.taps.iter().map(|(id, _)| id.as_str()).collect();
        let mut saved = state_interfaces(&self.state);
        offered.sort_unstable();
        saved.sort_unstable();
        if offered != saved {
            return Err(self.refuse(UpdateError::Protocol(format!(
                "the offer brings the taps of interfaces {offered:?}, the state has interfaces \
                 {saved:?}"
            ))));
        }
        let offered: Vec<&std::path::Path> = self
            .vfio_user
            .iter()
            .map(|device| device.offered.socket.as_path())
            .collect();
        let saved: Vec<&std::path::Path> = self
            .state
            .devices
            .handed_over_vfio_user
            .iter()
            .map(|device| device.socket.as_path())
            .collect();
        if offered != saved {
            return Err(self.refuse(UpdateError::Protocol(format!(
                "the offer brings the connections of vfio-user devices {offered:?}, the state \
                 has {saved:?}"
            ))));
        }
        // The vfio-user clients take their connections over now, outside the pause: only
        // plugging the devices back (`load`) speaks to them.
        let taken_over: Result<(), String> = self
            .vfio_user
            .iter_mut()
            .try_for_each(IncomingVfioUser::take_over);
        if let Err(reason) = taken_over {
            return Err(self.refuse(UpdateError::Load(reason)));
        }
        let ram = self
            .ram
            .take()
            .ok_or_else(|| UpdateError::Protocol("the RAM descriptor was used already".into()))?;
        self.take_mmds(&self.state)?;
        // Each drive takes its handed-over image (and lock) instead of opening its path,
        // each interface its tap queues instead of opening the tap; the interfaces get
        // the VM's MMDS.
        let resources = crate::virtio::DeviceResources::default().with_mmds(&self.mmds);
        for (drive_id, image) in self.images.drain(..) {
            resources.insert_image(&drive_id, image);
        }
        for (iface_id, taps) in self.taps.drain(..) {
            resources.insert(&iface_id, taps);
        }
        // The vsock device listens on the old process's socket (its path is taken).
        if let Some(listener) = self.vsock_listener.take() {
            resources.insert_vsock_listener(listener);
        }
        // The vhost-user devices take the old process's connections (quiet until Commit).
        for (id, connection) in self.vhost_user.drain(..) {
            resources.insert_vhost_user(&id, connection);
        }
        let prepared = crate::builder::prepare_handed_over(
            &self.state,
            &self.meta.vcpu_ids,
            std::fs::File::from(ram),
            self.meta.huge_tmpfs,
            serial_out,
            &resources,
        );
        let unused = resources.forget_unused();
        if !unused.is_empty() && prepared.is_ok() {
            log::warn!("live update: handed-over descriptors of devices {unused:?} were not used");
        }
        let prepared = prepared.map_err(|e| self.refuse(UpdateError::Build(Box::new(e))))?;
        self.prepared = Some(prepared);
        protocol::send(&self.socket, MessageKind::Built, b"", &[])
    }

    /// Takes the paused VM's whole state and loads it into the prepared VM; its vCPUs run
    /// once [`Machine::run`] is called, after [`Incoming::ready`]. A failure is told to the
    /// old process (which takes the VM back) and returned.
    pub fn load(&mut self) -> Result<(Machine, RestoreTimings), UpdateError> {
        self.load_or_hand_back().inspect_err(|_| self.hand_back())
    }

    fn load_or_hand_back(&mut self) -> Result<(Machine, RestoreTimings), UpdateError> {
        let frame = protocol::expect(&self.socket, MessageKind::PausedState)?;
        let (paused_at_ns, framed) = protocol::split_paused_state(&frame.payload)?;
        self.paused_at_ns = Some(paused_at_ns);
        let state = decode_state(framed).map_err(|e| self.refuse(e))?;
        fail_hook("refuse").map_err(|reason| self.refuse(UpdateError::Refused(reason)))?;
        if build_inputs(&state) != build_inputs(&self.state) {
            return Err(self.refuse(UpdateError::Load(
                "the VM's configuration or devices changed while this process built it".into(),
            )));
        }
        self.take_mmds(&state)?;
        let prepared = self
            .prepared
            .take()
            .ok_or_else(|| UpdateError::Protocol("no VM was prepared".into()))?;
        let vfio_user = std::mem::take(&mut self.vfio_user);
        let kernel_vfio = self.kernel_vfio.take();
        let hot_kernel_vfio = std::mem::take(&mut self.hot_kernel_vfio);
        // The vsock connections' sockets came with the paused state.
        let vsock_sockets = (state.devices.handed_over_vsock.as_ref())
            .map_or(0, gpuvm_virtio::vsock::VsockLiveState::descriptors);
        if frame.fds.len() != vsock_sockets {
            return Err(self.refuse(UpdateError::Protocol(format!(
                "the paused state brings {} descriptors, its vsock connections {vsock_sockets}",
                frame.fds.len()
            ))));
        }
        prepared
            .load(&state, (vfio_user, kernel_vfio, hot_kernel_vfio), frame.fds)
            .map_err(|e| self.refuse(UpdateError::Build(Box::new(e))))
    }

    /// This process will not run the VM: its taken-over vfio-user connections are the old
    /// process's again (nothing here speaks on them, resets the devices or closes the
    /// connections as its half-built VM goes).
    fn hand_back(&self) {
        for health in &self.adopted {
            health.mark_handed_over(format!(
                "the vfio-user connection goes back to gpuvm process {}",
                self.meta.old_pid
            ));
        }
        for mark in &self.kernel_marks {
            mark.mark_handed_over();
        }
    }

    /// Tells the old process why this one refuses the VM; returns `error`.
    fn refuse(&self, error: UpdateError) -> UpdateError {
        let _ = protocol::send(
            &self.socket,
            MessageKind::Refused,
            error.to_string().as_bytes(),
            &[],
        );
        error
    }

    /// Says the VM is ready here and waits (at most `timeout`) for the old process's
    /// `Commit`. Only [`Outcome`]s let this process run the VM; any error means it must
    /// not.
    pub fn ready(&mut self, timeout: Duration) -> Result<Outcome, UpdateError> {
        self.ready_or_hand_back(timeout)
            .inspect(|_| {
                // The VM is this process's: so are the vfio-user connections.
                for mark in &self.kernel_marks {
                    mark.confirm();
                }
                for health in &self.adopted {
                    health.confirm();
                }
            })
            .inspect_err(|_| self.hand_back())
    }

    fn ready_or_hand_back(&mut self, timeout: Duration) -> Result<Outcome, UpdateError> {
        if fail_hook("crash").is_err() {
            log::error!("{FAIL_HOOK}=crash: ending abruptly before Ready");
            std::process::abort();
        }
        if fail_hook("hang").is_err() {
            log::error!("{FAIL_HOOK}=hang: never answering");
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        }
        let body = serde_json::to_vec(&ReadyBody {
            pid: std::process::id(),
        })
        .map_err(|e| UpdateError::Protocol(e.to_string()))?;
        protocol::send(&self.socket, MessageKind::Ready, &body, &[])?;
        self.socket
            .set_read_timeout(Some(timeout))
            .map_err(|source| UpdateError::Socket {
                what: "set the hand-over socket's timeout",
                source,
            })?;
        match protocol::expect(&self.socket, MessageKind::Commit) {
            Ok(commit) => {
                self.api_listener = api_listener(commit.fds);
                Ok(Outcome::Committed)
            }
            // Killed between our Ready and its Commit: its VM went with it, ours is the
            // only one left. (A process that took the VM back says Abort first; one that
            // dies closes the socket while its threads still exit, hence the wait.)
            Err(UpdateError::PeerClosed) | Err(UpdateError::Socket { .. })
                if self.wait_old_exit(OLD_EXIT_WAIT) =>
            {
                log::warn!(
                    "the old gpuvm (pid {}) died after this one was ready: running the VM",
                    self.meta.old_pid
                );
                Ok(Outcome::OldProcessDied)
            }
            Err(error) => Err(error),
        }
    }

    /// The old process's API listening socket, if it came with `Commit`: this process
    /// serves it from now on (the connections waiting in its backlog included). None from
    /// an older gpuvm, or when the old process died before committing: the API socket is
    /// then bound again at its path once the old process has gone.
    pub fn take_api_listener(&mut self) -> Option<UnixListener> {
        self.api_listener.take()
    }

    /// How long the guest has been paused, from the old process's pause until now (zero
    /// before [`Incoming::load`]).
    pub fn paused_for(&self) -> Duration {
        self.paused_at_ns.map_or(Duration::ZERO, |paused_at| {
            Duration::from_nanos(protocol::monotonic_ns().saturating_sub(paused_at))
        })
    }

    /// Waits (at most `limit`) until the old process has exited, so that the API socket
    /// it removes on its way out can be bound again. Returns whether it has.
    pub fn wait_old_exit(&self, limit: Duration) -> bool {
        let started = Instant::now();
        while self.old.alive() {
            if started.elapsed() >= limit {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }
}

/// The API listening socket among the descriptors of `Commit`, checked to be one. The VM
/// is this process's by then whatever came: anything else is dropped with a warning, and
/// the API socket is bound again by path.
fn api_listener(fds: Vec<OwnedFd>) -> Option<UnixListener> {
    if fds.len() > protocol::COMMIT_API_LISTENER {
        log::warn!(
            "live update: Commit brought {} descriptors, not at most {}: the API socket is \
             bound again at its path",
            fds.len(),
            protocol::COMMIT_API_LISTENER
        );
        return None;
    }
    let fd = fds.into_iter().next()?;
    socket::listening_unix_stream(fd)
        .inspect_err(|error| {
            log::warn!("live update: {error}; the API socket is bound again at its path")
        })
        .ok()
}

/// What the VM is built from in a state: its configuration and what its devices are
/// made from (the PCI options of `handed_over_pci_options`), not their running state.
fn build_inputs(state: &MachineState) -> serde_json::Value {
    let devices = &state.devices;
    serde_json::json!({
        "config": state.config,
        "virtio": devices.virtio.len(),
        "cpu_hotplug": devices.cpu_hotplug.as_ref().map(|cpus| cpus.max_vcpus),
        "pci_mmio64_window": devices.pci_mmio64_window,
        // The 0xCF8 register is the guest's running state, loaded with the paused state.
        "pci_root": devices.pci_root.as_ref().map(|root| gpuvm_devices::pci::PciRootState {
            config_address: 0,
            ..root.clone()
        }),
        "ram_hotplug_size": devices.ram_hotplug.as_ref().map(|hotplug| hotplug.hotplug_size),
        "pci_segments": devices.handed_over_pci_segments,
        "numa": state.numa,
        "vfio_user": devices
            .handed_over_vfio_user
            .iter()
            .map(|device| (&device.socket, device.slot))
            .collect::<Vec<_>>(),
    })
}

/// The IDs of the virtio-blk drives in `state`.
fn state_drives(state: &MachineState) -> Vec<&str> {
    state
        .devices
        .virtio
        .iter()
        .filter_map(|device| match &device.config {
            crate::virtio::VirtioDeviceConfig::Block(config) => Some(config.drive_id.as_str()),
            _ => None,
        })
        .collect()
}

/// The IDs of the network interfaces in `state`.
fn state_interfaces(state: &MachineState) -> Vec<&str> {
    state
        .devices
        .virtio
        .iter()
        .filter_map(|device| match &device.config {
            crate::virtio::VirtioDeviceConfig::Net(config) => Some(config.iface_id.as_str()),
            _ => None,
        })
        .collect()
}

/// The running gpuvm that hands its VM over, watched through a pidfd: a jailed new
/// process has no /proc to look in, and a pidfd cannot come to name another process
/// that reused the pid.
#[derive(Debug)]
pub struct OldProcess {
    /// Its pid: in this process's pid namespace, or (`token` set) as `gpuvm update` saw
    /// it, for messages only.
    pid: u32,
    pidfd: OwnedFd,
    /// When it is in another pid namespace than this process (whose pid it cannot read):
    /// the secret `gpuvm update` gave both, which its offer must bring.
    token: Option<String>,
}

impl OldProcess {
    /// Process `pid` of this process's pid namespace; opened before this process's
    /// seccomp filters, which do not allow `pidfd_open`.
    pub fn open(pid: u32) -> Result<OldProcess, UpdateError> {
        let io = |source| UpdateError::Io {
            what: "watch the running gpuvm (pidfd_open)",
            source,
        };
        let pid_t = libc::pid_t::try_from(pid)
            .map_err(|_| io(std::io::Error::from_raw_os_error(libc::ESRCH)))?;
        // SAFETY: pidfd_open takes a pid and flags; the result is checked.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid_t, 0) };
        if fd < 0 {
            return Err(io(std::io::Error::last_os_error()));
        }
        // SAFETY: pidfd_open returned this descriptor, owned by nothing else; pidfds are
        // close-on-exec.
        let pidfd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        Ok(OldProcess {
            pid,
            pidfd,
            token: None,
        })
    }

    /// Process `pid` of another pid namespace (`gpuvm update`'s view of its pid, for
    /// messages), watched through `pidfd`, a pidfd of it `gpuvm update` passed on, and
    /// known by the secret `token` its offer must bring.
    pub fn inherited(pid: u32, pidfd: OwnedFd, token: String) -> Result<OldProcess, UpdateError> {
        super::check_token(&token).map_err(UpdateError::Protocol)?;
        Ok(OldProcess {
            pid,
            pidfd,
            token: Some(token),
        })
    }

    /// Whether `peer`, at the other end of a connection, may be this process: its pid, or
    /// any pid when it is known by its token instead (checked in its offer).
    fn may_be(&self, peer: socket::PeerCredentials) -> bool {
        self.token.is_some() || peer.pid == self.pid
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Whether the process runs: its pidfd turns readable once it has exited (a zombie,
    /// dead but not yet reaped by its parent, has).
    fn alive(&self) -> bool {
        let mut poll = libc::pollfd {
            fd: self.pidfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll reads and writes the one pollfd passed, a live local.
        let ready = unsafe { libc::poll(&mut poll, 1, 0) };
        ready == 0
    }
}

/// `Err` with a reason when the test hook [`FAIL_HOOK`] names `step`.
fn fail_hook(step: &str) -> Result<(), String> {
    match std::env::var(FAIL_HOOK) {
        Ok(value) if value == step => Err(format!("{FAIL_HOOK}={step}")),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_old_process_is_alive_until_it_exits_and_a_bad_pid_is_refused() {
        assert!(OldProcess::open(std::process::id()).unwrap().alive());
        assert!(OldProcess::open(u32::MAX).is_err());
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let old = OldProcess::open(child.id()).unwrap();
        assert!(old.alive());
        child.kill().unwrap();
        // Dead, not yet reaped: no longer alive.
        let deadline = Instant::now() + Duration::from_secs(10);
        while old.alive() {
            assert!(Instant::now() < deadline, "the killed child reads as alive");
            std::thread::sleep(Duration::from_millis(5));
        }
        child.wait().unwrap();
        assert!(!old.alive());
    }

    #[test]
    fn only_the_old_process_is_accepted_and_others_are_closed_unread() {
        use std::io::Read;
        let dir = socket::PrivateDir::create(&std::env::temp_dir(), "gpuvm-receive-").unwrap();
        let path = dir.path().join("handover.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let mut squatter = UnixStream::connect(&path).unwrap();
        let other = OldProcess {
            pid: u32::MAX,
            pidfd: OldProcess::open(std::process::id()).unwrap().pidfd,
            token: None,
        };
        let error = accept_from(&listener, &other, Duration::from_millis(200))
            .err()
            .unwrap()
            .to_string();
        assert!(
            error.contains("process 4294967295 did not connect")
                && error.contains("connections refused from other processes: 1"),
            "{error}"
        );
        let mut got = Vec::new();
        squatter.read_to_end(&mut got).unwrap();
        assert!(got.is_empty());
        let _old = UnixStream::connect(&path).unwrap();
        let this = OldProcess::open(std::process::id()).unwrap();
        accept_from(&listener, &this, Duration::from_secs(5)).unwrap();
    }

    #[test]
    fn an_old_process_of_another_pid_namespace_is_known_by_its_token() {
        let dir = socket::PrivateDir::create(&std::env::temp_dir(), "gpuvm-receive-").unwrap();
        let path = dir.path().join("handover.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let token = "5a".repeat(16);
        // Named by any pid: only the token counts.
        let pidfd = OldProcess::open(std::process::id()).unwrap().pidfd;
        let old = OldProcess::inherited(12345, pidfd, token.clone()).unwrap();
        let ram = std::fs::File::open("/dev/null").unwrap();
        let fds = [std::os::fd::AsRawFd::as_raw_fd(&ram), 0, 1, 2];
        let offer = |token: Option<String>| {
            let connection = UnixStream::connect(&path).unwrap();
            let meta = OfferMeta {
                handover_token: token,
                ..empty_offer()
            };
            let payload = serde_json::to_vec(&meta).unwrap();
            protocol::send(&connection, MessageKind::Offer, &payload, &fds).unwrap();
            connection
        };
        // Without the token, or with another, refused; with it, taken.
        let _none = offer(None);
        let _wrong = offer(Some("a5".repeat(16)));
        let _right = offer(Some(token.clone()));
        let (_, _, meta) = offer_from(&listener, &old, Duration::from_secs(5)).unwrap();
        assert_eq!(meta.handover_token.as_deref(), Some(token.as_str()));
        // Without the right one in time, the wait ends saying so.
        let _late = offer(None);
        assert!(offer_from(&listener, &old, Duration::from_millis(300)).is_err());
        // A malformed token is refused up front.
        let pidfd = OldProcess::open(std::process::id()).unwrap().pidfd;
        assert!(OldProcess::inherited(1, pidfd, "xyz".into()).is_err());
    }

    /// An offer from `meta` with the four descriptors every offer has (this process's
    /// stdio and /dev/null for the RAM) and `extra`; what `accept` answers it with.
    fn accept_offer(
        meta: &OfferMeta,
        extra: &[std::os::fd::RawFd],
    ) -> Result<Incoming, UpdateError> {
        use std::os::fd::AsRawFd;
        let dir = socket::PrivateDir::create(&std::env::temp_dir(), "gpuvm-receive-").unwrap();
        let path = dir.path().join("handover.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let old = UnixStream::connect(&path).unwrap();
        let ram = std::fs::File::open("/dev/null").unwrap();
        let mut fds = vec![ram.as_raw_fd(), 0, 1, 2];
        fds.extend_from_slice(extra);
        let payload = serde_json::to_vec(meta).unwrap();
        protocol::send(&old, MessageKind::Offer, &payload, &fds).unwrap();
        accept(
            &listener,
            OldProcess::open(std::process::id()).unwrap(),
            Duration::from_secs(5),
        )
    }

    /// An offer of this process with one vCPU and nothing else.
    fn empty_offer() -> OfferMeta {
        OfferMeta {
            ram_size: 0,
            huge_tmpfs: false,
            vcpu_ids: vec![0],
            old_pid: std::process::id(),
            handover_token: None,
            drives: Vec::new(),
            vfio_user: Vec::new(),
            interfaces: Vec::new(),
            kernel_vfio: None,
            hot_kernel_vfio: Vec::new(),
            outputs: None,
            vsock_listener: false,
            vhost_user: Vec::new(),
        }
    }

    /// A forged offer's tap queues: a descriptor that is not an attached tap queue is
    /// refused by name, and so is a descriptor count that is not the queues' count.
    #[test]
    fn handed_over_tap_queues_are_checked_before_anything_is_taken() {
        use std::os::fd::AsRawFd;
        let meta = OfferMeta {
            interfaces: vec![protocol::OfferedInterface {
                iface_id: "eth0".into(),
                queues: 1,
            }],
            ..empty_offer()
        };
        let not_a_tap = std::fs::File::open("/dev/null").unwrap();
        let error = accept_offer(&meta, &[not_a_tap.as_raw_fd()])
            .err()
            .expect("a descriptor that is no tap")
            .to_string();
        assert!(error.contains("interface eth0"), "{error}");
        let error = accept_offer(&meta, &[])
            .err()
            .expect("one descriptor short")
            .to_string();
        assert!(
            error.contains("one for each tap queue of its 1 interfaces"),
            "{error}"
        );
    }

    /// A forged offer's kernel VFIO devices: the iommufd and one cdev per device must come,
    /// or the offer is refused before anything is taken.
    #[test]
    fn an_offer_short_of_kernel_vfio_descriptors_is_refused() {
        use std::os::fd::AsRawFd;
        let meta = OfferMeta {
            kernel_vfio: Some(super::super::handed_over::OfferedKernelVfio {
                ioas_id: 2,
                devices: vec!["0000:00:04.0".into(), "0000:00:05.0".into()],
                type1_groups: None,
            }),
            ..empty_offer()
        };
        assert_eq!(meta.descriptor_count(), OFFER_FDS + 3);
        let iommufd = std::fs::File::open("/dev/null").unwrap();
        let error = accept_offer(&meta, &[iommufd.as_raw_fd(), iommufd.as_raw_fd()])
            .err()
            .expect("one cdev short")
            .to_string();
        assert!(error.contains("descriptors"), "{error}");
    }

    /// A forged type1 offer: the container, each group's file and each device's file must
    /// come, and more groups than devices is refused before anything is taken.
    #[test]
    fn a_type1_offer_brings_its_container_groups_and_device_files() {
        use std::os::fd::AsRawFd;
        let offered = |groups: Vec<u32>| super::super::handed_over::OfferedKernelVfio {
            ioas_id: 0,
            devices: vec!["0000:00:04.0".into()],
            type1_groups: Some(groups),
        };
        let meta = OfferMeta {
            kernel_vfio: Some(offered(vec![7])),
            ..empty_offer()
        };
        assert_eq!(meta.descriptor_count(), OFFER_FDS + 3);
        let null = std::fs::File::open("/dev/null").unwrap();
        let error = accept_offer(&meta, &[null.as_raw_fd(), null.as_raw_fd()])
            .err()
            .expect("the device file short")
            .to_string();
        assert!(error.contains("descriptors"), "{error}");
        let meta = OfferMeta {
            kernel_vfio: Some(offered(vec![7, 8])),
            ..empty_offer()
        };
        let error = accept_offer(&meta, &[null.as_raw_fd(); 4])
            .err()
            .expect("two groups for one device")
            .to_string();
        assert!(error.contains("2 type1 groups for 1 devices"), "{error}");
    }

    /// A forged offer's hot-plugged kernel VFIO devices: each context's descriptors must
    /// come, a context holds one device, and an offer without them says nothing of them
    /// (an older receiver reads it).
    #[test]
    fn hot_plugged_kernel_vfio_contexts_bring_their_descriptors_one_device_each() {
        use std::os::fd::AsRawFd;
        let context = |devices: Vec<String>| super::super::handed_over::OfferedKernelVfio {
            ioas_id: 0,
            devices,
            type1_groups: Some(vec![7]),
        };
        let meta = OfferMeta {
            hot_kernel_vfio: vec![context(vec!["0000:00:04.0".into()])],
            ..empty_offer()
        };
        // The container, the group's file, the device's file.
        assert_eq!(meta.descriptor_count(), OFFER_FDS + 3);
        let null = std::fs::File::open("/dev/null").unwrap();
        let error = accept_offer(&meta, &[null.as_raw_fd(); 2])
            .err()
            .expect("the device file short")
            .to_string();
        assert!(error.contains("descriptors"), "{error}");
        let meta = OfferMeta {
            hot_kernel_vfio: vec![context(vec!["0000:00:04.0".into(), "0000:00:05.0".into()])],
            ..empty_offer()
        };
        let error = accept_offer(&meta, &[null.as_raw_fd(); 4])
            .err()
            .expect("two devices in one hot-plugged context")
            .to_string();
        assert!(error.contains("one device each"), "{error}");
        // More contexts than an offer may bring, each with its descriptors: refused by count.
        let many = protocol::MAX_HOT_KERNEL_VFIO_DEVICES + 1;
        let meta = OfferMeta {
            hot_kernel_vfio: vec![context(vec!["0000:00:04.0".into()]); many],
            ..empty_offer()
        };
        let error = accept_offer(&meta, &vec![null.as_raw_fd(); 3 * many])
            .err()
            .expect("one hot-plugged context too many")
            .to_string();
        assert!(
            error.contains(&format!("brings {many} hot-plugged")),
            "{error}"
        );
        let json = serde_json::to_string(&empty_offer()).unwrap();
        assert!(!json.contains("hot_kernel_vfio"), "{json}");
    }

    /// A forged offer's outputs: both descriptors must come, or the offer is refused
    /// before anything is taken (what each must be: outputs::adopt's test).
    #[test]
    fn an_offer_short_of_its_outputs_is_refused() {
        use std::os::fd::AsRawFd;
        let meta = OfferMeta {
            outputs: Some(crate::outputs::HandedOverOutputs {
                log: true,
                metrics: true,
                log_level: "Info".into(),
            }),
            ..empty_offer()
        };
        assert_eq!(meta.descriptor_count(), OFFER_FDS + 2);
        let log = std::fs::File::open("/dev/null").unwrap();
        let error = accept_offer(&meta, &[log.as_raw_fd()])
            .err()
            .expect("one output short")
            .to_string();
        assert!(error.contains("descriptors"), "{error}");
    }

    /// An offer that announces the vsock listener must bring it: the count is checked
    /// before any descriptor is taken.
    #[test]
    fn an_offer_short_of_its_vsock_listener_is_refused() {
        let meta = OfferMeta {
            vsock_listener: true,
            ..empty_offer()
        };
        assert_eq!(meta.descriptor_count(), OFFER_FDS + 1);
        let error = accept_offer(&meta, &[])
            .err()
            .expect("the listener short")
            .to_string();
        assert!(error.contains("descriptors"), "{error}");
        // The field is left out of offers without it (an older receiver reads them).
        let json = serde_json::to_string(&empty_offer()).unwrap();
        assert!(!json.contains("vsock_listener"), "{json}");
    }

    /// `Commit`'s descriptor: a listening Unix socket is served, anything else (or more)
    /// leaves the API socket to be bound by path.
    #[test]
    fn commit_brings_the_api_listener_or_nothing_usable() {
        let dir = socket::PrivateDir::create(&std::env::temp_dir(), "gpuvm-commit-").unwrap();
        let listener = UnixListener::bind(dir.path().join("api.sock")).unwrap();
        let dup = || OwnedFd::from(listener.try_clone().unwrap());
        assert!(api_listener(Vec::new()).is_none(), "an older sender");
        assert!(api_listener(vec![dup()]).is_some());
        assert!(api_listener(vec![dup(), dup()]).is_none(), "too many");
        let (stream, _peer) = UnixStream::pair().unwrap();
        assert!(api_listener(vec![OwnedFd::from(stream)]).is_none());
    }

    #[test]
    fn a_state_of_an_unknown_version_is_refused() {
        let mut framed = Vec::new();
        framed.extend_from_slice(crate::persist::STATE_MAGIC);
        framed.extend_from_slice(&(crate::persist::STATE_FORMAT_VERSION + 1).to_le_bytes());
        framed.extend_from_slice(&crc32fast::hash(b"{}").to_le_bytes());
        framed.extend_from_slice(&2u64.to_le_bytes());
        framed.extend_from_slice(b"{}");
        let error = decode_state(&framed).err().unwrap().to_string();
        assert!(error.contains("state format version"), "{error}");
    }
}
