//! The API thread: accepts connections on the Unix socket, parses requests, turns each
//! into a [`VmmAction`](gpuvm_vmm::action::VmmAction), hands it to the VMM thread
//! ([`ActionSender`]) and writes the answer back. While a front end's command line is
//! still starting the VM, requests wait for it ([`StartGate`]). A live update (PUT
//! /vmm/update) stops the accept loop while the VM changes hands and takes the listening
//! socket along ([`AcceptGate`]): the socket keeps its path and every connection is
//! answered, by this process or by the one that runs the VM after.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::channel;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use gpuvm_vmm::action::{ActionError, ActionResult, VmmAction, VmmData};
use gpuvm_vmm::action_channel::ActionSender;
use gpuvm_vmm::metrics::METRICS;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::cloud_hypervisor;
use crate::http::{ReadOutcome, Request, RequestReader, Response};
use crate::routes::route;
use crate::ApiError;

/// Connections served at once.
pub const MAX_CONNECTIONS: usize = 16;
/// Connections accepted while every slot is taken, waiting in order for one; a connection
/// beyond them is answered 503 and closed.
pub const MAX_WAITING: usize = 64;
/// Each request must be complete this long after the server starts waiting for it (at
/// accept, or after the previous answer on a kept-alive connection); this is also how
/// long an idle kept-alive connection stays open. A client that trickles bytes cannot
/// hold a slot longer than this.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(5);
/// How long a connection waits for a slot before it is answered 503. Longer than
/// [`REQUEST_DEADLINE`], so slots held by slow or idle clients always free in time for
/// the connections waiting behind them.
pub const SLOT_WAIT: Duration = Duration::from_secs(10);
/// How long writing one answer may take.
const WRITE_DEADLINE: Duration = Duration::from_secs(5);

/// What a connection needs to answer requests: the way into the VMM thread and the front
/// end's state.
#[derive(Clone)]
struct VmmLink {
    vmm: ActionSender,
    /// Held while the front end's command line starts the VM.
    started: StartGate,
    /// Set when gpuvm runs as Firecracker: its front end answers every path.
    firecracker: Option<Arc<crate::firecracker::Session>>,
    /// The accept loop's gate, which a live update closes.
    gate: Arc<AcceptGate>,
}

/// The running API server. Dropping it removes the socket file, unless the listening
/// socket went to another process with the VM (a live update).
pub struct ApiServer {
    path: PathBuf,
    busy: Arc<AtomicUsize>,
    gate: Arc<AcceptGate>,
}

impl ApiServer {
    /// Binds `path` and serves it on a new thread. A stale socket file at `path` is
    /// replaced; any other file there is an error. The API threads run under the `api`
    /// seccomp filter once [`gpuvm_vmm::seccomp::enable`] ran (installed before the first
    /// accept; connection threads inherit it).
    pub fn start(path: &Path, vmm: ActionSender) -> Result<ApiServer, ApiError> {
        Self::start_with(path, vmm, StartGate::default(), None)
    }

    /// As [`ApiServer::start`] for the `cloud-hypervisor` command line, which creates
    /// the VM through the same routes (the controller keeps what it configured, so
    /// vm.info on the socket echoes it). Requests wait while `started` is held (the
    /// command line's boot or restore).
    pub fn start_cloud_hypervisor(
        path: &Path,
        vmm: ActionSender,
        started: StartGate,
    ) -> Result<ApiServer, ApiError> {
        Self::start_with(path, vmm, started, None)
    }

    /// As [`ApiServer::start`], serving Firecracker's API ([`crate::firecracker`]) on
    /// every path instead of gpuvm's own (which it falls back on where they agree).
    /// Requests wait while `started` is held (the `--config-file` boot).
    pub fn start_firecracker(
        path: &Path,
        vmm: ActionSender,
        session: crate::firecracker::Session,
        started: StartGate,
    ) -> Result<ApiServer, ApiError> {
        Self::start_with(path, vmm, started, Some(Arc::new(session)))
    }

    /// Serves `listener`, the API socket at `path` that the old gpuvm handed over with
    /// the VM (a live update), at once: the connections waiting in its backlog are the
    /// first accepted. Firecracker's API with `firecracker`, else gpuvm's (and Cloud
    /// Hypervisor's beside it). Seccomp as [`ApiServer::start`].
    pub fn serve_handed_over(
        listener: UnixListener,
        path: &Path,
        vmm: ActionSender,
        firecracker: Option<crate::firecracker::Session>,
    ) -> Result<ApiServer, ApiError> {
        let link_firecracker = firecracker.map(Arc::new);
        let server = Self::serve(listener, path, vmm, StartGate::default(), link_firecracker)?;
        log::info!("API serving the handed-over socket {}", path.display());
        Ok(server)
    }

    fn start_with(
        path: &Path,
        vmm: ActionSender,
        started: StartGate,
        firecracker: Option<Arc<crate::firecracker::Session>>,
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
        let server = Self::serve(listener, path, vmm, started, firecracker)?;
        log::info!("API listening on {}", path.display());
        Ok(server)
    }

    /// Serves `listener` (the socket at `path`) on a new thread, under the `api` filter
    /// from before its first accept.
    fn serve(
        listener: UnixListener,
        path: &Path,
        vmm: ActionSender,
        started: StartGate,
        firecracker: Option<Arc<crate::firecracker::Session>>,
    ) -> Result<ApiServer, ApiError> {
        let gate = Arc::new(AcceptGate {
            listener,
            state: Mutex::default(),
            changed: Condvar::new(),
            wake: EventFd::new(EFD_NONBLOCK).map_err(ApiError::EventFd)?,
        });
        let busy = Arc::new(AtomicUsize::new(0));
        let link = VmmLink {
            vmm,
            started,
            firecracker,
            gate: gate.clone(),
        };
        let server_busy = busy.clone();
        let (ready_tx, ready_rx) = channel();
        std::thread::Builder::new()
            .name("api".into())
            .spawn(move || {
                let applied = gpuvm_vmm::seccomp::apply(gpuvm_vmm::seccomp::ThreadKind::Api);
                let failed = applied.is_err();
                let _ = ready_tx.send(applied);
                if failed {
                    return;
                }
                accept_loop(link, server_busy)
            })
            .map_err(ApiError::Spawn)?;
        match ready_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(error)) => return Err(ApiError::Seccomp(error)),
            Err(_) => return Err(ApiError::Spawn(std::io::Error::other("API thread ended"))),
        }
        Ok(ApiServer {
            path: path.to_path_buf(),
            busy,
            gate,
        })
    }

    /// Leaves the socket file in place at the end (after a chroot its path is gone).
    pub fn keep_socket_file(&mut self) {
        self.path = PathBuf::new();
    }

    /// Waits (at most `limit`) until no request is between its first byte and its written
    /// answer, so the answer to a request that ended the VM still reaches its client, and
    /// a client still sending its request when a live update handed the VM over gets an
    /// answer (503 with Retry-After) rather than a closed connection.
    pub fn wait_idle(&self, limit: Duration) {
        let started = Instant::now();
        while self.busy.load(Ordering::SeqCst) > 0 && started.elapsed() < limit {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        // After a live update the file names the new process's socket (the same inode).
        if self.path.as_os_str().is_empty() || self.gate.lock().handed_over {
            return;
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

/// How long a live update waits for the accept loop to stop before it is refused.
const PAUSE_WAIT: Duration = Duration::from_secs(5);
/// The longest a single accept may wait once poll said a connection waits: none can be
/// taken from under this loop (nothing else accepts while it may), but an accept must
/// never hold the loop.
const ACCEPT_GUARD: Duration = Duration::from_millis(100);

/// Whether the accept loop may accept. A live update closes it before the VM leaves this
/// process: connections made meanwhile wait in the listen backlog, for whichever process
/// runs the VM after (this one again if the update fails; the new one, which gets the
/// listening socket with the VM, if it goes through). Once the socket went with the VM
/// the loop never accepts again. Connections accepted before are answered here.
struct AcceptGate {
    listener: UnixListener,
    state: Mutex<GateState>,
    /// Signalled when `state` changes.
    changed: Condvar,
    /// Wakes the accept loop from its poll when a pause is asked.
    wake: EventFd,
}

#[derive(Default)]
struct GateState {
    /// Live updates under way, each holding a [`Paused`].
    pauses: usize,
    /// The accept loop has seen the pause and waits: it accepts nothing until it ends.
    stopped: bool,
    /// The listening socket is another process's now, with the VM.
    handed_over: bool,
}

impl GateState {
    fn closed(&self) -> bool {
        self.pauses > 0 || self.handed_over
    }
}

/// What woke the accept loop's poll.
#[derive(Debug, PartialEq, Eq)]
enum Woken {
    /// A connection waits to be accepted.
    Connection,
    /// The gate may have changed, or the wait ran out.
    Other,
}

impl AcceptGate {
    fn lock(&self) -> MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Stops accepting: returns once the accept loop has stopped (a connection it was
    /// accepting meanwhile was accepted before the pause, and is answered here). None if
    /// it did not stop within [`PAUSE_WAIT`] (then nothing is paused).
    fn pause(self: &Arc<Self>) -> Option<Paused> {
        let mut state = self.lock();
        state.pauses += 1;
        // Made under the lock: dropping it (below, on failure) resumes.
        let paused = Paused(self.clone());
        if let Err(error) = self.wake.write(1) {
            log::warn!("cannot wake the API accept loop: {error}");
        }
        let (state, _) = self
            .changed
            .wait_timeout_while(state, PAUSE_WAIT, |state| !state.stopped)
            .unwrap_or_else(|e| e.into_inner());
        let stopped = state.stopped;
        drop(state);
        stopped.then_some(paused)
    }

    /// Waits while the gate is closed, refusing connections that waited too long for a
    /// slot meanwhile; returns once accepting may go on.
    fn wait_open(&self, slots: &Slots) {
        let mut state = self.lock();
        while state.closed() {
            if !state.stopped {
                state.stopped = true;
                self.changed.notify_all();
            }
            let wait = slots
                .next_expiry(Instant::now())
                .unwrap_or(Duration::from_secs(3600));
            state = self
                .changed
                .wait_timeout(state, wait)
                .unwrap_or_else(|e| e.into_inner())
                .0;
            slots.admit(None, Instant::now());
        }
        state.stopped = false;
    }

    /// Waits (at most `timeout`, None: forever) for a connection or a wake-up.
    fn poll(&self, timeout: Option<Duration>) -> Woken {
        let mut polled = [
            libc::pollfd {
                fd: self.listener.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.wake.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // Rounded up: a wait of less than a millisecond is not a zero-timeout poll.
        let millis = timeout.map_or(-1, |t| {
            t.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32
        });
        // SAFETY: poll reads and writes the two pollfds passed, a live local array of
        // that length.
        let ready =
            unsafe { libc::poll(polled.as_mut_ptr(), polled.len() as libc::nfds_t, millis) };
        if ready < 0 {
            let error = std::io::Error::last_os_error();
            if error.kind() != std::io::ErrorKind::Interrupted {
                log::warn!("API poll failed: {error}");
                std::thread::sleep(Duration::from_millis(10));
            }
            return Woken::Other;
        }
        if polled[1].revents != 0 {
            // Cleared; the caller looks at the gate again.
            let _ = self.wake.read();
            return Woken::Other;
        }
        if polled[0].revents != 0 {
            return Woken::Connection;
        }
        Woken::Other
    }
}

/// A pause of the accept loop (a live update under way): accepting resumes when it is
/// dropped, unless [`Paused::hand_over`] said the socket went with the VM.
struct Paused(Arc<AcceptGate>);

impl Paused {
    /// A duplicate of the listening socket, for the new process.
    fn listener(&self) -> std::io::Result<OwnedFd> {
        self.0.listener.try_clone().map(OwnedFd::from)
    }

    /// The VM, and the listening socket with it, went to another process: accept nothing
    /// ever again, and leave the socket file to that process.
    fn hand_over(self) {
        self.0.lock().handed_over = true;
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        let mut state = self.0.lock();
        state.pauses = state.pauses.saturating_sub(1);
        self.0.changed.notify_all();
    }
}

/// How long a request that arrives while the command line is still starting the VM waits
/// for that start before it is answered 503 (with Retry-After).
pub const START_WAIT: Duration = Duration::from_secs(30);

/// Whether a front end's command line is still starting the VM: Cloud Hypervisor's
/// `--restore` or `--kernel`, Firecracker's `--config-file`. Those VMMs answer a request
/// that arrives meanwhile once the start is done (it waits in their VMM thread's queue),
/// so a client may send `vm.resume` as soon as the socket accepts; gpuvm's front ends
/// send the start's requests from a thread of their own, and the API server holds the
/// clients' requests until it is done, at most [`START_WAIT`]. Open unless made by
/// [`StartGate::held`].
#[derive(Clone, Default)]
pub struct StartGate(Option<Arc<StartState>>);

/// Whether the start is over, and the condition that says when it ends.
#[derive(Default)]
struct StartState {
    over: Mutex<bool>,
    ended: Condvar,
}

/// The start under way: whatever carries it out holds this, and the gate opens when it is
/// dropped, however the start ended (done, refused, or its thread never ran).
pub struct StartUnderWay(Arc<StartState>);

impl StartGate {
    /// A gate held until the returned [`StartUnderWay`] is dropped.
    pub fn held() -> (StartGate, StartUnderWay) {
        let state = Arc::new(StartState::default());
        (StartGate(Some(state.clone())), StartUnderWay(state))
    }

    /// Waits until the start is over, at most `limit`; whether it is.
    fn wait(&self, limit: Duration) -> bool {
        let Some(state) = &self.0 else {
            return true;
        };
        let over = state.over.lock().unwrap_or_else(|e| e.into_inner());
        let (over, _) = state
            .ended
            .wait_timeout_while(over, limit, |over| !*over)
            .unwrap_or_else(|e| e.into_inner());
        *over
    }
}

impl Drop for StartUnderWay {
    fn drop(&mut self) {
        *self.0.over.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.0.ended.notify_all();
    }
}

/// The answer to a request that waited [`START_WAIT`] for the command line's start in
/// vain: 503, to be tried again (in Cloud Hypervisor's error shape on its paths).
fn still_starting(path: &str) -> Response {
    let message = format!(
        "the VM is still being started (restored or booted) from the command line after {} s; try again",
        START_WAIT.as_secs()
    );
    let mut answer = if path.starts_with(cloud_hypervisor::PREFIX) {
        cloud_hypervisor::routes::fault(503, message)
    } else {
        Response::fault(503, message)
    };
    answer.retry_after = Some(RETRY_AFTER_S);
    answer
}

/// Who holds the connection slots, and the connections waiting for one (oldest first).
/// Invariant: connections wait only while every slot is taken, so a connection that
/// ends hands its slot to the oldest waiting one.
#[derive(Default)]
struct Slots {
    state: Mutex<SlotState>,
}

#[derive(Default)]
struct SlotState {
    serving: usize,
    waiting: VecDeque<(UnixStream, Instant)>,
}

impl Slots {
    fn lock(&self) -> std::sync::MutexGuard<'_, SlotState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes a new connection: a slot if one is free (returned to be served), else a
    /// place in the queue, else it is refused. Also refuses those that waited too long.
    fn admit(&self, stream: Option<UnixStream>, now: Instant) -> Option<UnixStream> {
        let mut state = self.lock();
        state.refuse_expired(now);
        let stream = stream?;
        if state.serving < MAX_CONNECTIONS {
            state.serving += 1;
            Some(stream)
        } else if state.waiting.len() < MAX_WAITING {
            state.waiting.push_back((stream, now));
            None
        } else {
            refuse(stream, "too many API connections");
            None
        }
    }

    /// A served connection ended: its slot goes to the oldest waiting connection (to be
    /// served next, on the same thread), or is freed.
    fn hand_over(&self, now: Instant) -> Option<UnixStream> {
        let mut state = self.lock();
        state.refuse_expired(now);
        let next = state.waiting.pop_front().map(|(stream, _)| stream);
        if next.is_none() {
            state.serving -= 1;
        }
        next
    }

    /// When the oldest waiting connection runs out of time; None when none waits.
    fn next_expiry(&self, now: Instant) -> Option<Duration> {
        let state = self.lock();
        let (_, since) = state.waiting.front()?;
        Some((*since + SLOT_WAIT).saturating_duration_since(now))
    }
}

impl SlotState {
    fn refuse_expired(&mut self, now: Instant) {
        while self
            .waiting
            .front()
            .is_some_and(|(_, since)| now.duration_since(*since) >= SLOT_WAIT)
        {
            if let Some((stream, _)) = self.waiting.pop_front() {
                refuse(stream, "no API connection slot freed in time");
            }
        }
    }
}

/// The Retry-After of a 503 for a full server: by then slots held by idle or slow
/// clients have freed ([`REQUEST_DEADLINE`]).
const RETRY_AFTER_S: u32 = 1;
/// How long a refused connection stays open after its 503, its request read and
/// dropped: a client that writes its request after the server answered must not get
/// EPIPE (or ECONNRESET, for a request left unread at close) instead of the answer.
const LINGER: Duration = Duration::from_secs(2);
/// Refused connections kept lingering at once; beyond, one is closed right after its 503.
const MAX_LINGERING: usize = 256;

/// Answers 503 (with Retry-After) and hands the connection to the lingering thread, which
/// reads and drops what the client sends until it closes or [`LINGER`] ends (a fresh
/// connection's send buffer is empty: the answer never waits).
fn refuse(mut stream: UnixStream, why: &str) {
    let _ = stream.set_write_timeout(Some(WRITE_DEADLINE));
    let mut answer = Response::fault(503, why);
    answer.retry_after = Some(RETRY_AFTER_S);
    let _ = answer.write_to(&mut stream, true);
    // The answer is all it gets: EOF after it.
    let _ = stream.shutdown(std::net::Shutdown::Write);
    linger(stream);
}

/// The lingering thread's queue, started with the first refusal.
static LINGERING: std::sync::OnceLock<Option<std::sync::mpsc::SyncSender<UnixStream>>> =
    std::sync::OnceLock::new();

/// Keeps `stream` open a moment (see [`LINGER`]); closes it at once when the lingering
/// thread is full or cannot run.
fn linger(stream: UnixStream) {
    let queue = LINGERING.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::sync_channel(MAX_LINGERING);
        let spawned = std::thread::Builder::new()
            .name("api-linger".into())
            .spawn(move || linger_loop(rx));
        match spawned {
            Ok(_) => Some(tx),
            Err(error) => {
                log::warn!("cannot start the API lingering thread: {error}");
                None
            }
        }
    });
    if let Some(queue) = queue {
        // Full: dropped, closed at once.
        let _ = queue.try_send(stream);
    }
}

/// Holds refused connections until their client closes or [`LINGER`] ends, reading and
/// dropping what they send (non-blocking reads, every 10 ms: the API filter has no poll).
fn linger_loop(queue: std::sync::mpsc::Receiver<UnixStream>) {
    let mut held: Vec<(UnixStream, Instant)> = Vec::new();
    let mut scratch = [0u8; 4096];
    loop {
        if held.is_empty() {
            match queue.recv() {
                Ok(stream) => held.push((stream, Instant::now() + LINGER)),
                Err(_) => return,
            }
        }
        while let Ok(stream) = queue.try_recv() {
            if held.len() < MAX_LINGERING {
                held.push((stream, Instant::now() + LINGER));
            }
        }
        let now = Instant::now();
        held.retain(|(stream, until)| now < *until && !drained(stream, &mut scratch));
        if !held.is_empty() {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Reads and drops what `stream` has (a bounded amount per call); whether its client
/// closed (or it failed).
fn drained(stream: &UnixStream, scratch: &mut [u8]) -> bool {
    for _ in 0..16 {
        // SAFETY: recv writes at most `scratch.len()` bytes into `scratch`, which is
        // ours for the call; MSG_DONTWAIT makes it return at once.
        let read = unsafe {
            libc::recv(
                stream.as_raw_fd(),
                scratch.as_mut_ptr().cast(),
                scratch.len(),
                libc::MSG_DONTWAIT,
            )
        };
        match read {
            0 => return true,
            n if n > 0 => continue,
            _ => {
                let error = std::io::Error::last_os_error();
                return !matches!(
                    error.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                );
            }
        }
    }
    false
}

/// Bounds each accept's wait (SO_RCVTIMEO applies to accept) by [`ACCEPT_GUARD`].
fn set_accept_timeout(listener: &UnixListener) {
    let value = libc::timeval {
        tv_sec: ACCEPT_GUARD.as_secs() as libc::time_t,
        tv_usec: ACCEPT_GUARD.subsec_micros() as libc::suseconds_t,
    };
    // SAFETY: SO_RCVTIMEO reads a timeval of the given size from `value`, which lives
    // across the call; the descriptor is the listener's own.
    let result = unsafe {
        libc::setsockopt(
            listener.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&value as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if result != 0 {
        log::warn!(
            "cannot bound the API accept wait: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// Accepts connections while the gate is open. It waits in poll (bounded by when the
/// oldest connection waiting for a slot runs out of time, so it is refused on time) on the
/// listener and the gate's eventfd, and looks at the gate before every accept.
fn accept_loop(link: VmmLink, busy: Arc<AtomicUsize>) {
    let gate = link.gate.clone();
    let slots = Arc::new(Slots::default());
    set_accept_timeout(&gate.listener);
    loop {
        gate.wait_open(&slots);
        let woken = gate.poll(slots.next_expiry(Instant::now()));
        // A pause asked meanwhile wins over a waiting connection.
        let accepted = if woken == Woken::Connection && !gate.lock().closed() {
            match gate.listener.accept() {
                Ok((stream, _)) => Some(stream),
                Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => None,
                Err(error) => {
                    log::warn!("API accept failed: {error}");
                    std::thread::sleep(Duration::from_millis(10));
                    None
                }
            }
        } else {
            None
        };
        // With no connection: time to refuse those that waited too long for a slot.
        let Some(stream) = slots.admit(accepted, Instant::now()) else {
            continue;
        };
        let (link, busy, thread_slots) = (link.clone(), busy.clone(), slots.clone());
        let spawned = std::thread::Builder::new()
            .name("api-conn".into())
            .spawn(move || {
                let mut next = Some(stream);
                while let Some(stream) = next {
                    serve_connection(stream, &link, &busy);
                    next = thread_slots.hand_over(Instant::now());
                }
            });
        if let Err(error) = spawned {
            log::warn!("cannot start an API connection thread: {error}");
            // Its connection went with the closure; no thread can serve the waiting
            // ones either: refuse them until the slot is free.
            while let Some(stream) = slots.hand_over(Instant::now()) {
                refuse(stream, "cannot start an API connection thread");
            }
        }
    }
}

/// One side of a connection with an overall deadline: every read or write waits at most
/// until it, so a client that sends or reads a byte at a time cannot stretch a request.
struct Deadlined<'a> {
    stream: UnixStream,
    deadline: Instant,
    /// Descriptors that came with the bytes read (SCM_RIGHTS), for the request being
    /// read: Kata passes tap descriptors with Cloud Hypervisor's vm.add-net.
    fds: Vec<OwnedFd>,
    /// Counts the requests begun and not yet answered: the first byte of a request adds
    /// one ([`Deadlined::begun`] says so), so a process that ends (after a live update)
    /// waits for a client still sending its request and answers it rather than drop it.
    in_flight: Option<&'a AtomicUsize>,
    begun: bool,
}

impl<'a> Deadlined<'a> {
    fn new(stream: UnixStream, in_flight: Option<&'a AtomicUsize>) -> Self {
        Deadlined {
            stream,
            deadline: Instant::now(),
            fds: Vec::new(),
            in_flight,
            begun: false,
        }
    }

    /// Ends the request [`Deadlined::read`] counted, if one was: answered, or given up.
    fn end_request(&mut self) {
        if std::mem::take(&mut self.begun) {
            if let Some(in_flight) = self.in_flight {
                in_flight.fetch_sub(1, Ordering::SeqCst);
            }
        }
    }

    /// Time left, as a socket timeout; TimedOut once the deadline has passed.
    fn left(&self) -> std::io::Result<Option<Duration>> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        Ok(Some(left))
    }
}

impl Read for Deadlined<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.stream.set_read_timeout(self.left()?)?;
        // recvmsg, not read: descriptors may come with the bytes.
        let room =
            gpuvm_virtio::net::fd_passing::MAX_FDS_PER_MESSAGE.saturating_sub(self.fds.len());
        let (read, fds) = gpuvm_virtio::net::recv_with_fds(&self.stream, buf, room)?;
        self.fds.extend(fds);
        if read > 0 && !self.begun {
            self.begun = true;
            if let Some(in_flight) = self.in_flight {
                in_flight.fetch_add(1, Ordering::SeqCst);
            }
        }
        Ok(read)
    }
}

impl Write for Deadlined<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.stream.set_write_timeout(self.left()?)?;
        self.stream.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.stream.flush()
    }
}

fn serve_connection(stream: UnixStream, link: &VmmLink, busy: &AtomicUsize) {
    let Ok(writer) = stream.try_clone() else {
        return;
    };
    let mut writer = Deadlined::new(writer, None);
    let mut reader = RequestReader::new(Deadlined::new(stream, Some(busy)));
    serve_requests(&mut reader, &mut writer, link);
    // A request begun and neither answered nor completed (the client left, or ran out of
    // time) is no longer in flight.
    reader.get_mut().end_request();
}

/// Answers the requests of one connection until it closes or one asks to close.
fn serve_requests(
    reader: &mut RequestReader<Deadlined<'_>>,
    writer: &mut Deadlined<'_>,
    link: &VmmLink,
) {
    loop {
        reader.get_mut().deadline = Instant::now() + REQUEST_DEADLINE;
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
                let fds = std::mem::take(&mut reader.get_mut().fds);
                let response = handle(&request, fds, link);
                (response, request.close, Some(request.path))
            }
        };
        METRICS.count_api_request(path.as_deref().unwrap_or("other"), response.status);
        writer.deadline = Instant::now() + WRITE_DEADLINE;
        // Cloud Hypervisor's server sends no reason phrase, and its client (ch-remote,
        // api_client) parses everything after "HTTP/1.1 " to the CR as the status code.
        let plain = path
            .as_deref()
            .is_some_and(|path| path.starts_with(cloud_hypervisor::PREFIX));
        let written = if plain {
            response.write_without_reason_to(writer, close)
        } else {
            response.write_to(writer, close)
        };
        reader.get_mut().end_request();
        if written.is_err() || close {
            return;
        }
    }
}

/// Answers one request ([`answer`]). A 503 while a live update is under way or done
/// carries Retry-After: the client connects again, and the process that runs the VM
/// answers.
fn handle(request: &Request, fds: Vec<OwnedFd>, link: &VmmLink) -> Response {
    let mut response = answer(request, fds, link);
    if response.status == 503 && response.retry_after.is_none() && link.gate.lock().closed() {
        response.retry_after = Some(RETRY_AFTER_S);
    }
    response
}

/// Answers one request: paths under `/api/v1/` are Cloud Hypervisor's API, the others
/// gpuvm's own routes. `fds` came with the request (only Cloud Hypervisor's vm.add-net
/// takes any; the others close them).
fn answer(request: &Request, fds: Vec<OwnedFd>, link: &VmmLink) -> Response {
    if !link.started.wait(START_WAIT) {
        return still_starting(&request.path);
    }
    if let Some(session) = &link.firecracker {
        drop(fds);
        return crate::firecracker::handle(request, session, &|action| dispatch(link, action));
    }
    if request.path.starts_with(cloud_hypervisor::PREFIX) {
        return cloud_hypervisor::handle(request, fds, &|action| dispatch(link, action));
    }
    drop(fds);
    let action = match route(request) {
        Ok(action) => action,
        Err(response) => return response,
    };
    log::debug!(
        "API {} {}: {action:?}",
        request.method.as_str(),
        request.path
    );
    match dispatch(link, action) {
        Ok(VmmData::Empty) => Response::no_content(),
        Ok(VmmData::Json(value)) => Response::json(200, &value),
        Err(error) => Response::fault(error.status, error.message),
    }
}

/// Hands `action` to the VMM thread and waits for its answer. A live update (whichever
/// front end's route built it) first stops the accept loop and takes a duplicate of the
/// listening socket along to the new process; accepting resumes if the VM stays here.
fn dispatch(link: &VmmLink, mut action: VmmAction) -> ActionResult {
    let VmmAction::LiveUpdate { api_listener, .. } = &mut action else {
        return call(link, action);
    };
    let Some(paused) = link.gate.pause() else {
        return Err(ActionError {
            status: 503,
            message: "the API server did not stop accepting connections for the live update \
                      in time; the VM was not touched, try again"
                .into(),
        });
    };
    match paused.listener() {
        Ok(listener) => *api_listener = Some(listener),
        // The new process binds the path again then, as from an older gpuvm.
        Err(error) => log::warn!("live update: cannot pass the API socket on: {error}"),
    }
    let result = call(link, action);
    if result.is_ok() {
        paused.hand_over();
    }
    result
}

/// [`ActionSender::call`]; a VMM thread that ended during or after a live update is said
/// as such (the client is to connect again: the new process answers).
fn call(link: &VmmLink, action: VmmAction) -> ActionResult {
    link.vmm.call(action).unwrap_or_else(|gone| {
        if link.gate.lock().closed() {
            Err(ActionError {
                status: 503,
                message: "the VM is being handed to another gpuvm process (live update); \
                          connect again"
                    .into(),
            })
        } else {
            Err(gone.into())
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A gate over a listener no client reaches (abstract and unique).
    fn unbound_gate() -> Arc<AcceptGate> {
        use std::os::linux::net::SocketAddrExt;
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let name = format!(
            "gpuvm-api-test-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::SeqCst)
        );
        let address = std::os::unix::net::SocketAddr::from_abstract_name(name).unwrap();
        Arc::new(AcceptGate {
            listener: UnixListener::bind_addr(&address).unwrap(),
            state: Mutex::default(),
            changed: Condvar::new(),
            wake: EventFd::new(EFD_NONBLOCK).unwrap(),
        })
    }

    /// Connects to `path` and writes `request` (a whole HTTP request).
    fn send(path: &Path, request: &str) -> UnixStream {
        let mut stream = UnixStream::connect(path).unwrap();
        stream.write_all(request.as_bytes()).unwrap();
        stream
    }

    /// The answer on `stream`, read until it closes; None if nothing came within `limit`.
    fn answer_within(mut stream: UnixStream, limit: Duration) -> Option<String> {
        stream.set_read_timeout(Some(limit)).unwrap();
        let mut text = Vec::new();
        match stream.read_to_end(&mut text) {
            Err(error) if text.is_empty() && error.kind() == std::io::ErrorKind::WouldBlock => None,
            _ => Some(String::from_utf8_lossy(&text).into_owned()),
        }
    }

    const NOT_FOUND: &str = "GET /no-such-path HTTP/1.1\r\nConnection: close\r\n\r\n";

    fn put_update() -> String {
        let body = r#"{"handover_socket": "/nowhere/handover.sock"}"#;
        format!(
            "PUT /vmm/update HTTP/1.1\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
    }

    /// A live update: the accept loop stops while the VMM thread hands the VM over (a
    /// connection made meanwhile is not answered, even for a request the API answers by
    /// itself) and the VMM thread gets the listening socket along. A failed update lets
    /// the waiting connection be answered here; after one that went through nothing is
    /// accepted here again, the socket's new holder accepts the connection waiting in
    /// the backlog, and the socket file stays.
    #[test]
    fn a_live_update_pauses_accepting_and_hands_the_socket_over() {
        let dir = std::env::temp_dir().join(format!("gpuvm-api-gate-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("api.sock");
        let (vmm, end) = gpuvm_vmm::action_channel::action_channel().unwrap();
        let server = ApiServer::start(&path, vmm).unwrap();
        // The VMM thread: gives the test each live update's listener, and answers the
        // update with what the test says.
        let (listeners_tx, listeners_rx) = channel();
        let (outcomes_tx, outcomes_rx) = channel::<ActionResult>();
        std::thread::spawn(move || {
            while let Ok(request) = end.requests.recv() {
                let answer = match request.action {
                    VmmAction::LiveUpdate { api_listener, .. } => {
                        let _ = listeners_tx.send(api_listener);
                        outcomes_rx.recv().unwrap_or(Ok(VmmData::Empty))
                    }
                    _ => Ok(VmmData::Empty),
                };
                let _ = request.reply.send(answer);
            }
        });
        let short = Duration::from_millis(300);
        let long = Duration::from_secs(10);

        // An update the new process refuses.
        let update = send(&path, &put_update());
        let listener = listeners_rx.recv_timeout(long).unwrap();
        assert!(
            listener.is_some(),
            "the listening socket goes with the update"
        );
        let waiting = send(&path, NOT_FOUND);
        let waiting_reader = waiting.try_clone().unwrap();
        assert_eq!(
            answer_within(waiting_reader, short),
            None,
            "accepted mid-update"
        );
        outcomes_tx
            .send(Err(ActionError {
                status: 500,
                message: "refused".into(),
            }))
            .unwrap();
        let refused = answer_within(update, long).unwrap();
        assert!(refused.starts_with("HTTP/1.1 500 "), "{refused}");
        let answered = answer_within(waiting, long).expect("answered once the update failed");
        assert!(answered.starts_with("HTTP/1.1 404 "), "{answered}");

        // An update that goes through.
        let update = send(&path, &put_update());
        let listener = listeners_rx.recv_timeout(long).unwrap().unwrap();
        outcomes_tx.send(Ok(VmmData::Empty)).unwrap();
        let done = answer_within(update, long).unwrap();
        assert!(done.starts_with("HTTP/1.1 204 "), "{done}");
        let after = send(&path, NOT_FOUND);
        assert_eq!(
            answer_within(after.try_clone().unwrap(), short),
            None,
            "accepted after the hand-over"
        );
        // The new holder accepts it from the same socket's backlog.
        let listener = UnixListener::from(listener);
        let (taken, _) = listener.accept().unwrap();
        drop(taken);
        drop(server);
        assert!(path.exists(), "the socket file is the new holder's");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A request whose VMM thread has gone during or after a live update: 503 with
    /// Retry-After, saying why; without an update, 503 as before.
    #[test]
    fn a_request_the_handed_over_vmm_cannot_answer_is_told_to_retry() {
        let (vmm, end) = gpuvm_vmm::action_channel::action_channel().unwrap();
        drop(end);
        let link = VmmLink {
            vmm,
            started: StartGate::default(),
            firecracker: None,
            gate: unbound_gate(),
        };
        let request = Request {
            method: crate::http::Method::Get,
            path: "/".into(),
            body: Vec::new(),
            close: true,
        };
        let gone = handle(&request, Vec::new(), &link);
        assert_eq!((gone.status, gone.retry_after), (503, None));
        link.gate.lock().handed_over = true;
        let handed = handle(&request, Vec::new(), &link);
        assert_eq!(
            (handed.status, handed.retry_after),
            (503, Some(RETRY_AFTER_S))
        );
        let body = String::from_utf8_lossy(&handed.body);
        assert!(body.contains("live update"), "{body}");
    }

    /// Reads what the server side wrote to `peer` until it closed.
    fn answer(mut peer: UnixStream) -> String {
        peer.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut text = String::new();
        let _ = peer.read_to_string(&mut text);
        text
    }

    #[test]
    fn slots_queue_in_order_then_refuse() {
        let slots = Slots::default();
        let now = Instant::now();
        let mut peers = Vec::new();
        let mut served = Vec::new();
        for _ in 0..MAX_CONNECTIONS {
            let (ours, theirs) = UnixStream::pair().unwrap();
            served.push(slots.admit(Some(ours), now).expect("a free slot"));
            peers.push(theirs);
        }
        let mut waiting = Vec::new();
        for _ in 0..MAX_WAITING {
            let (ours, theirs) = UnixStream::pair().unwrap();
            assert!(slots.admit(Some(ours), now).is_none(), "queued");
            waiting.push(theirs);
        }
        let (ours, theirs) = UnixStream::pair().unwrap();
        assert!(slots.admit(Some(ours), now).is_none());
        assert!(
            answer(theirs).starts_with("HTTP/1.1 503 "),
            "beyond the queue"
        );
        assert_eq!(slots.next_expiry(now), Some(SLOT_WAIT));

        // A slot that frees goes to the oldest waiting connection.
        let next = slots.hand_over(now).expect("handed over");
        next.set_nonblocking(true).unwrap();
        waiting[0].write_all(b"x").unwrap();
        let mut byte = [0u8; 1];
        assert_eq!((&next).read(&mut byte).unwrap(), 1, "the oldest one");
        assert_eq!(slots.lock().serving, MAX_CONNECTIONS);

        // The others run out of time: 503, and slots free as connections end.
        let later = now + SLOT_WAIT;
        assert!(slots.admit(None, later).is_none());
        assert!(answer(waiting.pop().unwrap()).starts_with("HTTP/1.1 503 "));
        assert_eq!(slots.next_expiry(later), None);
        assert!(slots.hand_over(later).is_none());
        assert_eq!(slots.lock().serving, MAX_CONNECTIONS - 1);
    }

    /// Issue 31: a refused connection's client may write its request after the 503 went
    /// out; the write succeeds (no EPIPE), and it reads the 503, with Retry-After, then
    /// EOF.
    #[test]
    fn a_refused_client_writes_its_request_and_reads_the_503() {
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        refuse(ours, "too many API connections");
        std::thread::sleep(Duration::from_millis(100));
        theirs
            .write_all(b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n")
            .expect("the request is written, not EPIPE");
        let text = answer(theirs);
        assert!(text.starts_with("HTTP/1.1 503 "), "{text}");
        assert!(text.contains("Retry-After: 1\r\n"), "{text}");
        assert!(text.ends_with("too many API connections\"}"), "{text}");
    }

    /// Issue 26: a request that arrives while the command line starts the VM reaches the
    /// VMM thread only once that start is over.
    #[test]
    fn requests_wait_while_the_start_is_under_way() {
        let (vmm, end) = gpuvm_vmm::action_channel::action_channel().unwrap();
        let (started, under_way) = StartGate::held();
        let link = VmmLink {
            vmm,
            started,
            firecracker: None,
            gate: unbound_gate(),
        };
        let request = Request {
            method: crate::http::Method::Get,
            path: "/api/v1/vm.info".into(),
            body: Vec::new(),
            close: true,
        };
        let client = std::thread::spawn(move || handle(&request, Vec::new(), &link));
        std::thread::sleep(Duration::from_millis(100));
        assert!(end.requests.try_recv().is_err(), "the request went ahead");
        drop(under_way);
        // The VMM thread: the VM was restored, paused. The channel closes when the
        // client's thread is done with its sender.
        while let Ok(request) = end.requests.recv_timeout(Duration::from_secs(5)) {
            let info = serde_json::json!({"state": "Paused"});
            let _ = request.reply.send(Ok(VmmData::Json(info)));
        }
        let answer = client.join().unwrap();
        assert_eq!(
            answer.status,
            200,
            "{}",
            String::from_utf8_lossy(&answer.body)
        );
    }

    #[test]
    fn a_start_gate_opens_when_the_start_ends() {
        assert!(
            StartGate::default().wait(Duration::ZERO),
            "open unless held"
        );
        let (gate, under_way) = StartGate::held();
        assert!(!gate.wait(Duration::from_millis(20)));
        let opener = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            drop(under_way);
        });
        let started = Instant::now();
        assert!(gate.clone().wait(Duration::from_secs(10)));
        assert!(started.elapsed() < Duration::from_secs(5));
        opener.join().unwrap();
        assert!(gate.wait(Duration::ZERO), "stays open");
    }

    /// A request that waited [`START_WAIT`] in vain: 503 with Retry-After, in each front
    /// end's error shape.
    #[test]
    fn a_start_that_takes_too_long_is_answered_503() {
        let ch = still_starting("/api/v1/vm.resume");
        assert_eq!((ch.status, ch.retry_after), (503, Some(RETRY_AFTER_S)));
        let body: serde_json::Value = serde_json::from_slice(&ch.body).unwrap();
        assert!(
            body[0].as_str().unwrap().contains("still being started"),
            "{body}"
        );
        let own = still_starting("/");
        assert_eq!((own.status, own.retry_after), (503, Some(RETRY_AFTER_S)));
        let body: serde_json::Value = serde_json::from_slice(&own.body).unwrap();
        assert!(
            body["fault_message"]
                .as_str()
                .unwrap()
                .contains("try again"),
            "{body}"
        );
    }

    #[test]
    fn a_trickled_request_times_out_at_its_deadline() {
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let started = Instant::now();
        let mut reader = RequestReader::new(Deadlined {
            deadline: started + Duration::from_millis(300),
            ..Deadlined::new(ours, None)
        });
        let trickle = std::thread::spawn(move || {
            for byte in b"GET / HTTP/1.1\r\nX: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa".iter() {
                if theirs.write_all(&[*byte]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        let outcome = reader.next_request();
        let took = started.elapsed();
        assert_eq!(outcome, ReadOutcome::Bad(crate::http::HttpError::Timeout));
        assert!(took < Duration::from_secs(2), "{took:?}");
        drop(reader);
        trickle.join().unwrap();

        // Nothing sent by the deadline: the connection just closes.
        let (ours, _theirs) = UnixStream::pair().unwrap();
        let mut reader = RequestReader::new(Deadlined {
            deadline: Instant::now() + Duration::from_millis(50),
            ..Deadlined::new(ours, None)
        });
        assert_eq!(reader.next_request(), ReadOutcome::Closed);
    }
}
