//! The API thread: accepts connections on the Unix socket, parses requests, turns each
//! into a [`VmmAction`](gpuvm_vmm::action::VmmAction), hands it to the VMM thread
//! ([`ActionSender`]) and writes the answer back. While a front end's command line is
//! still starting the VM, requests wait for it ([`StartGate`]).

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::channel;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use gpuvm_vmm::action::VmmData;
use gpuvm_vmm::action_channel::ActionSender;
use gpuvm_vmm::metrics::METRICS;

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
}

/// The running API server. Dropping it removes the socket file.
pub struct ApiServer {
    path: PathBuf,
    busy: Arc<AtomicUsize>,
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
        let busy = Arc::new(AtomicUsize::new(0));
        let link = VmmLink {
            vmm,
            started,
            firecracker,
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

/// Bounds the accept wait (SO_RCVTIMEO applies to accept), so connections waiting for a
/// slot are refused on time even when nothing else happens; None waits forever.
fn set_accept_timeout(listener: &UnixListener, timeout: Option<Duration>) {
    let timeout = timeout.map_or(Duration::ZERO, |t| t.max(Duration::from_millis(1)));
    let value = libc::timeval {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_usec: timeout.subsec_micros() as libc::suseconds_t,
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

fn accept_loop(listener: UnixListener, link: VmmLink, busy: Arc<AtomicUsize>) {
    let slots = Arc::new(Slots::default());
    loop {
        set_accept_timeout(&listener, slots.next_expiry(Instant::now()));
        let accepted = match listener.accept() {
            Ok((stream, _)) => Some(stream),
            // The accept wait ran out: time to refuse connections that waited too long.
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => None,
            Err(error) => {
                log::warn!("API accept failed: {error}");
                std::thread::sleep(Duration::from_millis(10));
                None
            }
        };
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
struct Deadlined {
    stream: UnixStream,
    deadline: Instant,
    /// Descriptors that came with the bytes read (SCM_RIGHTS), for the request being
    /// read: Kata passes tap descriptors with Cloud Hypervisor's vm.add-net.
    fds: Vec<OwnedFd>,
}

impl Deadlined {
    /// Time left, as a socket timeout; TimedOut once the deadline has passed.
    fn left(&self) -> std::io::Result<Option<Duration>> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        Ok(Some(left))
    }
}

impl Read for Deadlined {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.stream.set_read_timeout(self.left()?)?;
        // recvmsg, not read: descriptors may come with the bytes.
        let room =
            gpuvm_virtio::net::fd_passing::MAX_FDS_PER_MESSAGE.saturating_sub(self.fds.len());
        let (read, fds) = gpuvm_virtio::net::recv_with_fds(&self.stream, buf, room)?;
        self.fds.extend(fds);
        Ok(read)
    }
}

impl Write for Deadlined {
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
    let mut writer = Deadlined {
        stream: writer,
        deadline: Instant::now(),
        fds: Vec::new(),
    };
    let mut reader = RequestReader::new(Deadlined {
        stream,
        deadline: Instant::now(),
        fds: Vec::new(),
    });
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
                busy.fetch_add(1, Ordering::SeqCst);
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
            response.write_without_reason_to(&mut writer, close)
        } else {
            response.write_to(&mut writer, close)
        };
        if path.is_some() {
            busy.fetch_sub(1, Ordering::SeqCst);
        }
        if written.is_err() || close {
            return;
        }
    }
}

/// Answers one request: paths under `/api/v1/` are Cloud Hypervisor's API, the others
/// gpuvm's own routes. `fds` came with the request (only Cloud Hypervisor's vm.add-net
/// takes any; the others close them).
fn handle(request: &Request, fds: Vec<OwnedFd>, link: &VmmLink) -> Response {
    if !link.started.wait(START_WAIT) {
        return still_starting(&request.path);
    }
    if let Some(session) = &link.firecracker {
        drop(fds);
        return crate::firecracker::handle(request, session, &|action| link.vmm.dispatch(action));
    }
    if request.path.starts_with(cloud_hypervisor::PREFIX) {
        return cloud_hypervisor::handle(request, fds, &|action| link.vmm.dispatch(action));
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
    match link.vmm.dispatch(action) {
        Ok(VmmData::Empty) => Response::no_content(),
        Ok(VmmData::Json(value)) => Response::json(200, &value),
        Err(error) => Response::fault(error.status, error.message),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            stream: ours,
            deadline: started + Duration::from_millis(300),
            fds: Vec::new(),
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
            stream: ours,
            deadline: Instant::now() + Duration::from_millis(50),
            fds: Vec::new(),
        });
        assert_eq!(reader.next_request(), ReadOutcome::Closed);
    }
}
