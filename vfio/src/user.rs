//! The vfio-user backend: gpuvm is the client, the device runs in another process and
//! DMAs into guest RAM through the memfd it receives with each mapping.
//!
//! The device process may die while the device is in use (a crash, `kill -9`, a surprise
//! removal). Its end of the socket then closes: [`HangupWatch`] sees the hang-up at once,
//! and any request that fails with a broken-connection error says the same. From then on
//! the device is gone ([`BackendHealth`]): reads of its regions return all ones (what a
//! surprise-removed PCI function answers), writes are dropped and every other request
//! fails at once, so no vCPU ever waits on the dead socket.
//!
//! Migration goes through a migration *region* (index 9, libvfio-user's), laid out as
//! linux/vfio.h's deprecated v1 `struct vfio_device_migration_info` plus a data window:
//! the region-based vfio-user migration libvfio-user used before the protocol gained
//! VFIO_USER_DEVICE_FEATURE and VFIO_USER_MIG_DATA_READ/WRITE. The `vfio_user` 0.1.7
//! crate has none of those messages and owns the socket, so this is the transport that
//! works today; when the crate gains the v2 messages, this backend moves to them. The v2
//! states map onto the v1 bits as the kernel documents (STOP = 0, RUNNING = RUNNING,
//! STOP_COPY = SAVING, RESUMING = RESUMING); a refused change reads back as the v1 error
//! state (SAVING | RESUMING) with the device's reason code in `reserved`.
//!
//! A device process that stops answering (it never replies to the version negotiation,
//! or a later request) must not hold the VMM thread: the connect runs on a thread of its
//! own under a deadline ([`answer_timeout`]), and once connected every read and write on
//! the socket has the same deadline (SO_RCVTIMEO/SO_SNDTIMEO). The client's `read_exact`
//! and `write_all` retry only on EINTR, so a timed-out request fails with EAGAIN; a
//! request that timed out leaves the connection desynchronized (a late answer would be
//! taken for the next request's), so the device is then gone.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use vfio_bindings::bindings::vfio::{
    VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_ACTION_UNMASK, VFIO_IRQ_SET_DATA_EVENTFD,
    VFIO_IRQ_SET_DATA_NONE, VFIO_PCI_INTX_IRQ_INDEX, VFIO_PCI_MSIX_IRQ_INDEX,
    VFIO_PCI_MSI_IRQ_INDEX,
};
use vfio_user::Client;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::dma::{DmaMapper, PeerMapper};
use crate::emu::{self as mig, mig_region, MIGRATION_REGION};
use crate::migration::{MigrationInfo, MigrationState};
use crate::{DmaRegion, PassthroughDevice, RegionInfo, Result, VfioError};

/// How long a vfio-user device may take to answer the connect's negotiation or any
/// request, unless [`ANSWER_TIMEOUT_VAR`] says otherwise.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);
/// `GPUVM_VFIO_USER_TIMEOUT_MS=<ms>`: the answer timeout.
pub const ANSWER_TIMEOUT_VAR: &str = "GPUVM_VFIO_USER_TIMEOUT_MS";

/// The answer timeout in effect (at least 1 ms: a zero socket timeout means none).
pub fn answer_timeout() -> Duration {
    std::env::var(ANSWER_TIMEOUT_VAR)
        .ok()
        .and_then(|ms| ms.trim().parse::<u64>().ok())
        .map_or(ANSWER_TIMEOUT, |ms| Duration::from_millis(ms.max(1)))
}

/// A timeout as people write it: "5 s", "500 ms".
fn describe(timeout: Duration) -> String {
    if timeout.subsec_millis() == 0 && timeout.as_secs() > 0 {
        format!("{} s", timeout.as_secs())
    } else {
        format!("{} ms", timeout.as_millis())
    }
}

/// A device behind a vfio-user socket. The client is shared with the device's
/// [`UserDmaMapper`], which maps guest RAM from its own thread while vCPUs use the device.
pub struct VfioUserDevice {
    client: Arc<Mutex<Client>>,
    path: PathBuf,
    health: Arc<BackendHealth>,
    /// How long each request may wait for the device (the socket's timeouts).
    timeout: Duration,
    /// A duplicate of the client's socket, to watch for the server's hang-up (None if
    /// it could not be told apart from other new sockets).
    socket: Option<OwnedFd>,
    migration: UserMigration,
}

/// The client's side of the migration region.
struct UserMigration {
    /// Probed on first use: None until then.
    info: Option<Option<MigrationInfo>>,
    state: MigrationState,
    /// STOP_COPY: the part of the window not read yet (offset in the region, bytes).
    chunk_offset: u64,
    chunk_left: u64,
}

impl Default for UserMigration {
    fn default() -> Self {
        UserMigration {
            info: None,
            state: MigrationState::Running,
            chunk_offset: 0,
            chunk_left: 0,
        }
    }
}

/// Whether the device process is still there, shared by everything that talks to it.
#[derive(Default)]
pub struct BackendHealth {
    gone: AtomicBool,
    /// Gone because another gpuvm process has the connection now (a live update).
    handed_over: AtomicBool,
    /// Taken over from another gpuvm process that may yet take it back (a live update
    /// until it commits): usable, but neither reset nor closed here.
    provisional: AtomicBool,
    reason: Mutex<Option<String>>,
    /// Written once when the device goes (the VMM thread's wake-up eventfd).
    wake: Mutex<Option<EventFd>>,
}

impl BackendHealth {
    /// Whether the device process went away.
    pub fn is_gone(&self) -> bool {
        self.gone.load(Ordering::Acquire)
    }

    /// Why it is gone.
    pub fn reason(&self) -> Option<String> {
        self.reason
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Where to say that the device went (also at once if it already has).
    pub fn set_wake(&self, wake: EventFd) {
        if self.is_gone() {
            let _ = wake.write(1);
        }
        *self.wake.lock().unwrap_or_else(|e| e.into_inner()) = Some(wake);
    }

    /// Marks the connection as another gpuvm process's now (a live update): from here on
    /// this process sends nothing on it, as if the device were gone, without waking anyone
    /// or logging an error (the device is fine).
    pub fn mark_handed_over(&self, reason: String) {
        {
            let mut saved = self.reason.lock().unwrap_or_else(|e| e.into_inner());
            if saved.is_some() {
                return;
            }
            log::info!("vfio-user: {reason}");
            *saved = Some(reason);
        }
        self.handed_over.store(true, Ordering::Release);
        self.gone.store(true, Ordering::Release);
    }

    /// Whether another process has the connection now ([`BackendHealth::mark_handed_over`]).
    pub fn is_handed_over(&self) -> bool {
        self.handed_over.load(Ordering::Acquire)
    }

    /// The connection was taken over from a process that may yet take it back: until
    /// [`BackendHealth::confirm`], dropping the device neither resets it nor closes the
    /// connection.
    pub fn mark_provisional(&self) {
        self.provisional.store(true, Ordering::Release);
    }

    /// The connection is this process's for good (the live update committed).
    pub fn confirm(&self) {
        self.provisional.store(false, Ordering::Release);
    }

    /// Whether the device must be left as it is when its model here goes.
    fn leaves_device_alone(&self) -> bool {
        self.is_handed_over() || self.provisional.load(Ordering::Acquire)
    }

    /// Marks the device gone (the first reason wins) and wakes whoever watches.
    pub fn mark_gone(&self, reason: String) {
        {
            let mut saved = self.reason.lock().unwrap_or_else(|e| e.into_inner());
            if saved.is_some() {
                return;
            }
            log::error!("vfio-user: {reason}");
            *saved = Some(reason);
        }
        self.gone.store(true, Ordering::Release);
        if let Some(wake) = self.wake.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            let _ = wake.write(1);
        }
    }
}

/// Whether `error` means the other end of the socket is gone (not a refused request).
fn is_hang_up(error: &vfio_user::Error) -> bool {
    use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset, UnexpectedEof};
    match error {
        vfio_user::Error::StreamWrite(e) | vfio_user::Error::StreamRead(e) => matches!(
            e.kind(),
            BrokenPipe | ConnectionReset | ConnectionAborted | UnexpectedEof
        ),
        _ => false,
    }
}

/// Whether `error` is a socket timeout: the device did not answer in time.
fn is_timeout(error: &vfio_user::Error) -> bool {
    use std::io::ErrorKind::{TimedOut, WouldBlock};
    match error {
        vfio_user::Error::StreamWrite(e) | vfio_user::Error::StreamRead(e) => {
            matches!(e.kind(), WouldBlock | TimedOut)
        }
        vfio_user::Error::SendWithFd(e) | vfio_user::Error::ReceiveWithFd(e) => {
            matches!(e.errno(), libc::EAGAIN | libc::ETIMEDOUT)
        }
        _ => false,
    }
}

/// Marks the device gone if `error` means it is: its process hung up, or it stopped
/// answering (after a timeout the connection is out of step, so it cannot be used again).
fn note_failure(
    health: &BackendHealth,
    name: &str,
    what: &str,
    timeout: Duration,
    error: &vfio_user::Error,
) {
    if is_hang_up(error) {
        health.mark_gone(format!(
            "{name}: {what} failed ({error}); the device is gone"
        ));
    } else if is_timeout(error) {
        health.mark_gone(format!(
            "{name}: the device stopped answering: {what} got no answer within {}; the device is gone",
            describe(timeout)
        ));
    }
}

/// The error every request of a gone device fails with.
fn gone_error(health: &BackendHealth) -> VfioError {
    VfioError::Io(std::io::Error::new(
        std::io::ErrorKind::NotConnected,
        health
            .reason()
            .unwrap_or_else(|| "the vfio-user device is gone".into()),
    ))
}

/// A thread that waits for the device process's end of the socket to close and then
/// marks the device gone. Stopped (and joined) when dropped.
pub struct HangupWatch {
    stop: EventFd,
    thread: Option<JoinHandle<()>>,
}

impl HangupWatch {
    fn start(socket: OwnedFd, health: Arc<BackendHealth>, name: String) -> std::io::Result<Self> {
        let stop = EventFd::new(EFD_NONBLOCK)?;
        let stop_seen = stop.try_clone()?;
        let thread = std::thread::Builder::new()
            .name("vfio-user-watch".into())
            .spawn(move || {
                let hung_up = wait_for_hang_up(socket.as_fd(), stop_seen.as_raw_fd());
                if hung_up {
                    health.mark_gone(format!(
                        "{name}: the device process hung up (it exited or was killed); the device is gone"
                    ));
                }
            })?;
        Ok(HangupWatch {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for HangupWatch {
    fn drop(&mut self) {
        let _ = self.stop.write(1);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Blocks until `socket`'s peer closes (true) or `stop` is written (false). A live server
/// never shuts its side down, so a hang-up means it is gone; replies (POLLIN) are not
/// watched: they belong to whoever holds the client.
fn wait_for_hang_up(socket: BorrowedFd<'_>, stop: RawFd) -> bool {
    loop {
        let mut fds = [
            libc::pollfd {
                fd: socket.as_raw_fd(),
                events: libc::POLLRDHUP,
                revents: 0,
            },
            libc::pollfd {
                fd: stop,
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: two valid pollfd entries, both fds open for the duration of the call
        // (the socket is owned by the caller, the stop eventfd by the watch).
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
        if n < 0 {
            if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            log::warn!(
                "vfio-user: cannot watch for hang-ups: {}",
                std::io::Error::last_os_error()
            );
            return false;
        }
        if fds[1].revents != 0 {
            return false;
        }
        if fds[0].revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0 {
            return true;
        }
    }
}

/// Identities (fd, inode) of the process's sockets with fds below the first long run of
/// closed fds: fds are handed out lowest first, so a new socket is below it.
fn open_sockets() -> Vec<(RawFd, u64)> {
    const CLOSED_RUN: i32 = 256;
    let mut sockets = Vec::new();
    let mut closed = 0;
    let mut fd = 0;
    while closed < CLOSED_RUN && fd < 1 << 20 {
        let mut stat = std::mem::MaybeUninit::<libc::stat>::uninit();
        // SAFETY: fstat writes a stat into the buffer or fails; any fd number is fine.
        if unsafe { libc::fstat(fd, stat.as_mut_ptr()) } == 0 {
            closed = 0;
            // SAFETY: fstat succeeded, so it filled the buffer.
            let stat = unsafe { stat.assume_init() };
            if stat.st_mode & libc::S_IFMT == libc::S_IFSOCK {
                sockets.push((fd, stat.st_ino));
            }
        } else {
            closed += 1;
        }
        fd += 1;
    }
    sockets
}

/// The socket among `candidates` (fd, inode) that is connected to `path`: the only one,
/// or else the only one whose peer is `path` (other threads may open sockets meanwhile).
/// Returned as a duplicate, checked to be the same socket (the fd may have been closed
/// and reused since it was listed), with the descriptor number it was found at.
fn claim_socket(candidates: &[(RawFd, u64)], path: &Path) -> Option<(UnixStream, RawFd)> {
    let claimed: Vec<_> = candidates
        .iter()
        .filter_map(|&(fd, inode)| Some(((duplicate_socket(fd, inode)?, fd), inode)))
        .collect();
    if claimed.len() <= 1 {
        return claimed.into_iter().next().map(|(socket, _)| socket);
    }
    let mut to_path: Vec<_> = claimed
        .into_iter()
        .filter(|((socket, _), _)| {
            socket
                .peer_addr()
                .is_ok_and(|peer| peer.as_pathname() == Some(path))
        })
        .collect();
    (to_path.len() == 1).then(|| to_path.remove(0).0)
}

/// A duplicate of `fd` if it is still the socket with `inode`.
fn duplicate_socket(fd: RawFd, inode: u64) -> Option<UnixStream> {
    // SAFETY: F_DUPFD_CLOEXEC on any fd number either fails or returns a new fd that
    // nothing else owns.
    let copy = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if copy < 0 {
        return None;
    }
    // SAFETY: a fresh fd from fcntl, owned from here on.
    let copy = unsafe { OwnedFd::from_raw_fd(copy) };
    let mut stat = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: fstat writes a stat into the buffer or fails; the fd is open.
    if unsafe { libc::fstat(copy.as_raw_fd(), stat.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: fstat succeeded, so it filled the buffer.
    let stat = unsafe { stat.assume_init() };
    (stat.st_mode & libc::S_IFMT == libc::S_IFSOCK && stat.st_ino == inode)
        .then(|| UnixStream::from(copy))
}

/// Runs `Client::new` on a thread of its own and waits at most `timeout` for it. On
/// timeout the connection's socket is shut down, so the stuck thread's read fails and
/// the thread ends.
fn connect_client(path: &Path, timeout: Duration) -> Result<(Client, Option<(UnixStream, RawFd)>)> {
    let before = open_sockets();
    let new_sockets = || -> Vec<(RawFd, u64)> {
        open_sockets()
            .into_iter()
            .filter(|socket| !before.contains(socket))
            .collect()
    };
    let (sender, receiver) = mpsc::sync_channel(1);
    let target = path.to_path_buf();
    let connecting = std::thread::Builder::new()
        .name("vfio-user-connect".into())
        .spawn(move || {
            let _ = sender.send(Client::new(&target));
        })?;
    let client = match receiver.recv_timeout(timeout) {
        Ok(result) => {
            let _ = connecting.join();
            result.map_err(|source| VfioError::Connect {
                path: path.to_path_buf(),
                source,
            })?
        }
        Err(mpsc::RecvTimeoutError::Timeout) => {
            match claim_socket(&new_sockets(), path) {
                Some((socket, _)) => {
                    if let Err(e) = socket.shutdown(std::net::Shutdown::Both) {
                        log::warn!("vfio-user: {}: shutdown: {e}", path.display());
                    }
                    // The read fails at once now; a connect still waiting for the
                    // listener's backlog is left behind rather than waited for.
                    if receiver.recv_timeout(timeout).is_ok() {
                        let _ = connecting.join();
                    }
                }
                None => log::warn!(
                    "vfio-user: {}: cannot single out the connection's socket; its thread stays blocked until the device closes it",
                    path.display()
                ),
            }
            return Err(VfioError::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "vfio-user device at {} did not answer the version negotiation within {}",
                    path.display(),
                    describe(timeout)
                ),
            )));
        }
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            return Err(VfioError::Io(std::io::Error::other(format!(
                "vfio-user: {}: the connecting thread ended without an answer",
                path.display()
            ))))
        }
    };
    Ok((client, claim_socket(&new_sockets(), path)))
}

/// A client connected to `path` (negotiated, regions read) under `timeout`, and the number
/// of the descriptor it holds its socket at (the live update's adoption puts another
/// connection there: crate::user_handover).
pub(crate) fn connect_to(path: &Path, timeout: Duration) -> Result<(Client, RawFd)> {
    let (client, socket) = connect_client(path, timeout)?;
    match socket {
        Some((_, fd)) => Ok((client, fd)),
        None => Err(VfioError::Io(std::io::Error::other(format!(
            "vfio-user: {}: cannot single out the client's socket",
            path.display()
        )))),
    }
}

fn lock(client: &Mutex<Client>) -> MutexGuard<'_, Client> {
    client.lock().unwrap_or_else(|e| e.into_inner())
}

/// Sends guest RAM to the device process (DMA_MAP with the RAM memfd), one request at a
/// time: they share the device's socket.
pub struct UserDmaMapper {
    client: Arc<Mutex<Client>>,
    name: String,
    health: Arc<BackendHealth>,
    timeout: Duration,
}

impl DmaMapper for UserDmaMapper {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn max_parallel(&self) -> usize {
        1
    }

    unsafe fn map(&self, chunk: &DmaRegion) -> std::io::Result<()> {
        if self.health.is_gone() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::NotConnected,
                format!("vfio-user DMA map: {} is gone", self.name),
            ));
        }
        lock(&self.client)
            .dma_map(chunk.fd_offset, chunk.guest_addr, chunk.size, chunk.fd)
            .map_err(|e| {
                note_failure(&self.health, &self.name, "DMA map", self.timeout, &e);
                std::io::Error::other(format!("vfio-user DMA map: {e}"))
            })
    }

    fn unmap(&self, guest_addr: u64, size: u64) -> std::io::Result<()> {
        self.check_health("DMA unmap")?;
        lock(&self.client).dma_unmap(guest_addr, size).map_err(|e| {
            note_failure(&self.health, &self.name, "DMA unmap", self.timeout, &e);
            std::io::Error::other(format!("vfio-user DMA unmap: {e}"))
        })
    }
}

impl UserDmaMapper {
    fn check_health(&self, what: &str) -> std::io::Result<()> {
        if self.health.is_gone() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::NotConnected,
                format!("vfio-user {what}: {} is gone", self.name),
            ));
        }
        Ok(())
    }
}

/// A peer's BAR goes to the device process as a file and an offset, like guest RAM: the
/// process maps that file and its DMA engine writes through it.
impl PeerMapper for UserDmaMapper {
    fn name(&self) -> String {
        self.name.clone()
    }

    unsafe fn map_peer(&self, window: &DmaRegion) -> std::io::Result<()> {
        // SAFETY: forwarded from the caller's contract.
        unsafe { DmaMapper::map(self, window) }
    }

    fn unmap_peer(&self, guest_addr: u64, size: u64) -> std::io::Result<()> {
        DmaMapper::unmap(self, guest_addr, size)
    }
}

impl VfioUserDevice {
    /// Connects and negotiates; the server must already be listening. A device that
    /// does not answer within [`answer_timeout`] is refused.
    pub fn connect(path: &Path) -> Result<Self> {
        Self::connect_within(path, answer_timeout())
    }

    /// [`Self::connect`] with `timeout` for the negotiation and every later request.
    pub fn connect_within(path: &Path, timeout: Duration) -> Result<Self> {
        // The client does not give out its socket: it is the new socket after the
        // connect (if it cannot be told apart, no hang-up watch and no timeouts).
        let (client, socket) = connect_client(path, timeout)?;
        let socket = socket.map(|(socket, _)| socket).filter(|socket| {
            let timeouts = socket
                .set_read_timeout(Some(timeout))
                .and_then(|()| socket.set_write_timeout(Some(timeout)));
            if let Err(e) = &timeouts {
                log::warn!(
                    "vfio-user: {}: cannot set the socket's timeouts: {e}",
                    path.display()
                );
            }
            timeouts.is_ok()
        });
        if socket.is_none() {
            log::warn!(
                "vfio-user: {}: cannot single out the connection's socket; the device's death is noticed on its next request, and a request it never answers is not bounded",
                path.display()
            );
        }
        log::info!("vfio-user: connected to {}", path.display());
        Ok(VfioUserDevice {
            client: Arc::new(Mutex::new(client)),
            path: path.to_path_buf(),
            health: Arc::new(BackendHealth::default()),
            timeout,
            socket: socket.map(OwnedFd::from),
            migration: UserMigration::default(),
        })
    }

    /// Takes over a connection another gpuvm process had to the device at `path` (a live
    /// update): `connection` is its socket, `layout` and `files` what that process's client
    /// knew of the device ([`UserConnection::hand_over`]); `health` is the caller's, to
    /// mark the connection handed back should this process not run the VM. Nothing goes to
    /// the device: it sees no new connection, negotiation or reset, and keeps its DMA
    /// mappings.
    pub fn adopt(
        path: &Path,
        connection: OwnedFd,
        layout: &crate::user_handover::ConnectionLayout,
        files: &[OwnedFd],
        timeout: Duration,
        health: Arc<BackendHealth>,
    ) -> Result<Self> {
        let client =
            crate::user_handover::adopt_client(&connection, layout, files, timeout, connect_to)?;
        let socket = UnixStream::from(connection);
        socket.set_read_timeout(Some(timeout))?;
        socket.set_write_timeout(Some(timeout))?;
        log::info!(
            "vfio-user: took over the connection to {} ({} regions)",
            path.display(),
            layout.regions.len()
        );
        Ok(VfioUserDevice {
            client: Arc::new(Mutex::new(client)),
            path: path.to_path_buf(),
            health,
            timeout,
            socket: Some(OwnedFd::from(socket)),
            migration: UserMigration::default(),
        })
    }

    /// The device's socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// What hands this device's connection to another process ([`UserConnection`]).
    pub fn connection(&self) -> UserConnection {
        UserConnection {
            client: self.client.clone(),
            socket: self
                .socket
                .as_ref()
                .and_then(|socket| socket.try_clone().ok()),
            health: self.health.clone(),
            name: self.name(),
        }
    }

    /// Whether the device process is still there; shared with the DMA mapper.
    pub fn health(&self) -> Arc<BackendHealth> {
        self.health.clone()
    }

    /// Starts watching for the device process's hang-up (None: its socket is unknown or
    /// no thread could be started; the first failed request notices instead).
    pub fn watch_hang_up(&self) -> Option<HangupWatch> {
        let socket = self.socket.as_ref()?.try_clone().ok()?;
        HangupWatch::start(socket, self.health.clone(), self.name())
            .map_err(|e| log::warn!("vfio-user: no hang-up watch for {}: {e}", self.name()))
            .ok()
    }

    /// The mapper for guest RAM ([`crate::dma::BackgroundMapping`]), over this device's
    /// connection.
    pub fn dma_mapper(&self) -> Arc<dyn DmaMapper> {
        Arc::new(UserDmaMapper {
            client: self.client.clone(),
            name: self.name(),
            health: self.health.clone(),
            timeout: self.timeout,
        })
    }

    /// The mapper for peers' BARs (peer-to-peer DMA), over this device's connection.
    pub fn peer_mapper(&self) -> Arc<dyn PeerMapper> {
        Arc::new(UserDmaMapper {
            client: self.client.clone(),
            name: self.name(),
            health: self.health.clone(),
            timeout: self.timeout,
        })
    }

    /// A duplicate of the file the server shares for region `index` and the region's
    /// offset in it (None when the region cannot be mmapped): what a peer is given to
    /// map this device's BAR.
    pub fn region_file(&self, index: u32) -> Option<(OwnedFd, u64)> {
        let client = self.client();
        let region = client.region(index)?;
        let file = region
            .file_offset
            .as_ref()
            .filter(|_| region.flags & crate::REGION_MMAP != 0)?;
        let copy = file.file().as_fd().try_clone_to_owned().ok()?;
        Some((copy, file.start()))
    }

    fn client(&self) -> MutexGuard<'_, Client> {
        lock(&self.client)
    }

    /// Runs one request, unless the device is gone; a broken connection marks it gone.
    fn request<T>(
        &self,
        what: &'static str,
        call: impl FnOnce(&mut Client) -> std::result::Result<T, vfio_user::Error>,
    ) -> Result<T> {
        if self.health.is_gone() {
            return Err(gone_error(&self.health));
        }
        call(&mut self.client()).map_err(|source| {
            note_failure(&self.health, &self.name(), what, self.timeout, &source);
            VfioError::User { what, source }
        })
    }

    /// VFIO_USER_DEVICE_SET_IRQS on interrupt `index`'s triggers from vector 0:
    /// `Some(eventfds)` makes vector i signal eventfds[i] (DATA_EVENTFD, one vector per
    /// eventfd), `None` turns them all off (DATA_NONE, count 0). The MSI-X, MSI and INTx
    /// enables and disables differ only in these arguments.
    fn set_irq_triggers(
        &self,
        what: &'static str,
        index: u32,
        eventfds: Option<&[&EventFd]>,
    ) -> Result<()> {
        let (data, fds) = match eventfds {
            Some(eventfds) => (
                VFIO_IRQ_SET_DATA_EVENTFD,
                eventfds.iter().map(|fd| fd.as_raw_fd()).collect(),
            ),
            None => (VFIO_IRQ_SET_DATA_NONE, Vec::new()),
        };
        self.request(what, |client| {
            client.set_irqs(
                index,
                data | VFIO_IRQ_SET_ACTION_TRIGGER,
                0,
                fds.len() as u32,
                &fds,
            )
        })
    }

    fn mig_read_u64(&mut self, field: u64) -> Result<u64> {
        let mut bytes = [0u8; 8];
        self.region_read(MIGRATION_REGION, field, &mut bytes)?;
        Ok(u64::from_le_bytes(bytes))
    }

    fn mig_read_u32(&mut self, field: u64) -> Result<u32> {
        let mut bytes = [0u8; 4];
        self.region_read(MIGRATION_REGION, field, &mut bytes)?;
        Ok(u32::from_le_bytes(bytes))
    }

    /// Reads data_offset, where the device puts (STOP_COPY) or wants (RESUMING) the next
    /// chunk, and checks it lies past the header and inside the region; with the region's
    /// size. Saving and loading both trust it only after this.
    fn mig_data_offset(&mut self) -> Result<(u64, u64)> {
        let data_offset = self.mig_read_u64(mig_region::DATA_OFFSET)?;
        let size = self
            .region_info(MIGRATION_REGION)
            .map_or(0, |region| region.size);
        if data_offset < mig_region::DATA_SIZE + 8 || data_offset >= size {
            return Err(self.mig_data_error(format!(
                "data_offset {data_offset:#x} is outside the region's window (size {size:#x})"
            )));
        }
        Ok((data_offset, size))
    }

    fn mig_data_error(&self, reason: String) -> VfioError {
        VfioError::MigrationData {
            device: self.name(),
            reason,
        }
    }

    /// What the device says about its last failure (its reason code).
    fn mig_device_reason(&mut self) -> String {
        match self.mig_read_u32(mig_region::RESERVED) {
            Ok(0) | Err(_) => "no reason given".into(),
            Ok(code) => format!("{} (device code {code})", mig::mig_error::describe(code)),
        }
    }

    fn probe_migration(&mut self) -> Option<MigrationInfo> {
        let info = self.region_info(MIGRATION_REGION)?;
        let needed = crate::REGION_READ | crate::REGION_WRITE;
        if info.flags & needed != needed || info.size <= mig_region::WINDOW {
            log::info!(
                "{}: region {MIGRATION_REGION} ({:#x} bytes, flags {:#x}) is no migration region",
                self.name(),
                info.size,
                info.flags
            );
            return None;
        }
        let state = self.mig_read_u32(mig_region::DEVICE_STATE).ok()?;
        self.migration.state = match state {
            0 => MigrationState::Stop,
            mig::MIG_V1_RUNNING => MigrationState::Running,
            _ => {
                log::warn!(
                    "{}: migration region reads device_state {state:#x}, neither RUNNING nor STOP",
                    self.name()
                );
                return None;
            }
        };
        Some(MigrationInfo {
            stop_copy: true,
            p2p: false,
            pre_copy: false,
            transport: "vfio-user migration region",
        })
    }

    fn check_range(&self, index: u32, offset: u64, len: usize) -> Result<()> {
        let size = self
            .client()
            .region(index)
            .ok_or(VfioError::NoRegion(index))?
            .size;
        if offset.checked_add(len as u64).is_none_or(|end| end > size) {
            return Err(VfioError::OutOfRange {
                index,
                offset,
                len,
                size,
            });
        }
        Ok(())
    }
}

/// A vfio-user device's connection as a live update hands it over: the client (for its
/// layout), a duplicate of the socket and the device's health (marked handed over once the
/// other process has it, so that this one never speaks on it again).
pub struct UserConnection {
    client: Arc<Mutex<Client>>,
    socket: Option<OwnedFd>,
    health: Arc<BackendHealth>,
    name: String,
}

impl UserConnection {
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Why the connection cannot be handed over now, if it cannot.
    pub fn refusal(&self) -> Option<String> {
        if self.health.is_gone() {
            return Some(
                self.health
                    .reason()
                    .unwrap_or_else(|| "the device is gone".into()),
            );
        }
        if self.socket.is_none() {
            return Some(
                "its connection's socket could not be singled out when it connected".into(),
            );
        }
        None
    }

    /// A duplicate of the socket, the layout the client knows and duplicates of the
    /// regions' files (in region order): what [`VfioUserDevice::adopt`] takes.
    pub fn hand_over(
        &self,
    ) -> Result<(
        crate::user_handover::ConnectionLayout,
        OwnedFd,
        Vec<OwnedFd>,
    )> {
        if let Some(reason) = self.refusal() {
            return Err(VfioError::Io(std::io::Error::other(format!(
                "{}: {reason}",
                self.name
            ))));
        }
        let socket = self
            .socket
            .as_ref()
            .map(OwnedFd::try_clone)
            .transpose()?
            .ok_or_else(|| VfioError::Io(std::io::Error::other("no socket")))?;
        let (layout, files) = crate::user_handover::layout_of(&lock(&self.client))?;
        Ok((layout, socket, files))
    }

    /// From now on another process owns the connection: this one sends nothing on it
    /// (requests fail at once, reads of the device return all ones) and neither resets
    /// the device nor shuts the connection down when its device model goes.
    pub fn release(&self, to: &str) {
        self.health
            .mark_handed_over(format!("{}: the connection is handed to {to}", self.name));
    }
}

/// The name of the vfio-user device served on `socket` (its backend's
/// [`PassthroughDevice::name`]).
pub fn device_name(socket: &Path) -> String {
    format!("vfio-user:{}", socket.display())
}

impl PassthroughDevice for VfioUserDevice {
    fn name(&self) -> String {
        device_name(&self.path)
    }

    fn left_running_on_drop(&self) -> bool {
        self.health.leaves_device_alone()
    }

    fn region_info(&self, index: u32) -> Option<RegionInfo> {
        let client = self.client();
        let region = client.region(index)?;
        Some(RegionInfo {
            index,
            size: region.size,
            flags: region.flags,
            mmap_areas: region
                .sparse_areas
                .iter()
                .map(|area| (area.offset, area.size))
                .collect(),
        })
    }

    /// A gone device reads all ones, as a surprise-removed PCI function does.
    fn region_read(&mut self, index: u32, offset: u64, data: &mut [u8]) -> Result<()> {
        self.check_range(index, offset, data.len())?;
        if self.health.is_gone() {
            data.fill(0xff);
            return Ok(());
        }
        self.request("region read", |client| {
            client.region_read(index, offset, data)
        })
        .inspect_err(|_| data.fill(0xff))
    }

    /// Writes to a gone device are dropped.
    fn region_write(&mut self, index: u32, offset: u64, data: &[u8]) -> Result<()> {
        self.check_range(index, offset, data.len())?;
        if self.health.is_gone() {
            return Ok(());
        }
        self.request("region write", |client| {
            client.region_write(index, offset, data)
        })
    }

    /// Regions the server shares a file for (flag MMAP plus an fd) are mmapped; the rest
    /// go over the socket.
    fn mmap_region(&mut self, index: u32, offset: u64, size: u64) -> Result<Option<*mut u8>> {
        let client = self.client();
        let region = client.region(index).ok_or(VfioError::NoRegion(index))?;
        let Some(file) = region
            .file_offset
            .as_ref()
            .filter(|_| region.flags & crate::REGION_MMAP != 0)
        else {
            return Ok(None);
        };
        if offset.checked_add(size).is_none_or(|end| end > region.size) {
            return Err(VfioError::OutOfRange {
                index,
                offset,
                len: size as usize,
                size: region.size,
            });
        }
        // Never unmapped: it lives as long as the VM's memory slots may use it.
        let address = crate::mmap_shared(
            file.file().as_raw_fd(),
            file.start() + offset,
            size as usize,
        )?;
        log::info!(
            "{}: region {index} +{offset:#x} ({size:#x} bytes) mmapped",
            self.name()
        );
        Ok(Some(address))
    }

    fn msix_vectors(&mut self) -> Result<u32> {
        let info = self.request("get MSI-X info", |client| {
            client.get_irq_info(VFIO_PCI_MSIX_IRQ_INDEX)
        })?;
        Ok(info.count)
    }

    fn enable_msix(&mut self, eventfds: &[&EventFd]) -> Result<()> {
        self.set_irq_triggers(
            "set MSI-X eventfds",
            VFIO_PCI_MSIX_IRQ_INDEX,
            Some(eventfds),
        )
    }

    fn disable_msix(&mut self) -> Result<()> {
        self.set_irq_triggers("disable MSI-X", VFIO_PCI_MSIX_IRQ_INDEX, None)
    }

    fn enable_msi(&mut self, eventfds: &[&EventFd]) -> Result<()> {
        self.set_irq_triggers("set MSI eventfds", VFIO_PCI_MSI_IRQ_INDEX, Some(eventfds))
    }

    fn disable_msi(&mut self) -> Result<()> {
        self.set_irq_triggers("disable MSI", VFIO_PCI_MSI_IRQ_INDEX, None)
    }

    fn intx_supported(&mut self) -> bool {
        self.request("get INTx info", |client| {
            client.get_irq_info(VFIO_PCI_INTX_IRQ_INDEX)
        })
        .is_ok_and(|info| info.count > 0)
    }

    fn enable_intx(&mut self, trigger: &EventFd) -> Result<()> {
        self.set_irq_triggers(
            "set the INTx eventfd",
            VFIO_PCI_INTX_IRQ_INDEX,
            Some(&[trigger]),
        )
    }

    fn disable_intx(&mut self) -> Result<()> {
        self.set_irq_triggers("disable INTx", VFIO_PCI_INTX_IRQ_INDEX, None)
    }

    fn unmask_intx(&mut self) -> Result<()> {
        self.request("unmask INTx", |client| {
            client.set_irqs(
                VFIO_PCI_INTX_IRQ_INDEX,
                VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_ACTION_UNMASK,
                0,
                1,
                &[],
            )
        })
    }

    fn dma_map(&mut self, region: &DmaRegion) -> Result<()> {
        log::info!(
            "vfio-user: DMA map {:#x}+{:#x} (fd offset {:#x})",
            region.guest_addr,
            region.size,
            region.fd_offset
        );
        self.request("DMA map", |client| {
            client.dma_map(region.fd_offset, region.guest_addr, region.size, region.fd)
        })
    }

    fn reset(&mut self) -> Result<()> {
        use crate::reset::{ResetError, ResetMethod, UserResetFailure};
        let name = self.name();
        if self.health.leaves_device_alone() {
            // The device runs on for the process that has the connection now (or may
            // take it back): not ours to reset.
            log::debug!("{name}: not reset: the connection is another process's");
            return Ok(());
        }
        // vfio_user 0.1.7 inverts the flag: `resettable()` is true when the device does
        // NOT advertise VFIO_DEVICE_FLAGS_RESET.
        let method = if self.client().resettable() {
            ResetMethod::None {
                reason: "the device does not advertise VFIO_DEVICE_FLAGS_RESET".into(),
            }
        } else {
            let answer = match &self.socket {
                _ if self.health.is_gone() => Err(gone_error(&self.health).to_string()),
                Some(socket) => {
                    let _in_step = self.client();
                    crate::reset::vfio_user_device_reset(socket.as_fd()).map_err(|failure| {
                        if let UserResetFailure::Connection(error) = &failure {
                            self.health
                                .mark_gone(format!("{name}: the reset exchange failed: {error}"));
                        }
                        failure.to_string()
                    })
                }
                None => self
                    .request("reset", Client::reset)
                    .map_err(|e| e.to_string()),
            };
            answer.map_err(|reason| ResetError::Failed {
                device: name.clone(),
                method: ResetMethod::VfioUser.to_string(),
                reason,
            })?;
            ResetMethod::VfioUser
        };
        let mut ids = [0u8; 4];
        let ids = self
            .region_read(crate::region::CONFIG, 0, &mut ids)
            .map(|()| u32::from_le_bytes(ids))
            .map_err(|e| std::io::Error::other(e.to_string()));
        crate::reset::check_came_back(&name, &method, ids)?;
        crate::reset::log_reset(&name, &method);
        // A reset device is RUNNING with no migration stream.
        self.migration.state = MigrationState::Running;
        self.migration.chunk_left = 0;
        Ok(())
    }

    fn migration(&mut self) -> Option<MigrationInfo> {
        if self.migration.info.is_none() {
            let info = self.probe_migration();
            self.migration.info = Some(info);
        }
        self.migration.info.clone().flatten()
    }

    fn set_migration_state(&mut self, to: MigrationState) -> Result<()> {
        if self.migration().is_none() {
            return Err(VfioError::MigrationUnsupported(format!(
                "{}: the vfio-user device has no migration region (region {MIGRATION_REGION})",
                self.name()
            )));
        }
        let from = self.migration.state;
        if from == to {
            return Ok(());
        }
        let arc_error = |device: String, reason: String| VfioError::MigrationArc {
            device,
            from,
            to,
            reason,
        };
        let Some(bits) = mig::v1_bits(to).filter(|_| from.is_single_arc(to)) else {
            return Err(arc_error(
                self.name(),
                "not a single arc of the v2 state machine".into(),
            ));
        };
        self.migration.chunk_left = 0;
        self.region_write(
            MIGRATION_REGION,
            mig_region::DEVICE_STATE,
            &bits.to_le_bytes(),
        )
        .map_err(|e| arc_error(self.name(), e.to_string()))?;
        let now = self
            .mig_read_u32(mig_region::DEVICE_STATE)
            .map_err(|e| arc_error(self.name(), e.to_string()))?;
        if now != bits {
            self.migration.state = if now == mig::MIG_V1_ERROR {
                MigrationState::Error
            } else {
                from
            };
            let reason = format!(
                "device_state reads {now:#x}, not {bits:#x}: {}",
                self.mig_device_reason()
            );
            return Err(arc_error(self.name(), reason));
        }
        self.migration.state = to;
        Ok(())
    }

    /// Reads the window chunk by chunk: pending_bytes (which retires the last chunk),
    /// data_offset (which stages the next), data_size, then the data. Everything the
    /// device says is bounded by the region; a device whose pending_bytes never reaches 0
    /// is stopped by the caller's limit.
    fn read_migration_data(&mut self, buf: &mut [u8]) -> Result<usize> {
        if self.migration.state != MigrationState::StopCopy {
            return Err(self.mig_data_error(format!(
                "reading state in {:?}, not StopCopy",
                self.migration.state
            )));
        }
        if buf.is_empty() {
            return Ok(0);
        }
        if self.migration.chunk_left == 0 {
            let pending = self.mig_read_u64(mig_region::PENDING_BYTES)?;
            if pending == 0 {
                return Ok(0);
            }
            let (data_offset, size) = self.mig_data_offset()?;
            let data_size = self.mig_read_u64(mig_region::DATA_SIZE)?;
            let window = size - data_offset;
            if data_size == 0 || data_size > window || data_size > pending {
                return Err(self.mig_data_error(format!(
                    "data_size {data_size:#x} with {pending:#x} bytes pending and a {window:#x}-byte window"
                )));
            }
            self.migration.chunk_offset = data_offset;
            self.migration.chunk_left = data_size;
        }
        let n = (buf.len() as u64).min(self.migration.chunk_left) as usize;
        let offset = self.migration.chunk_offset;
        self.region_read(MIGRATION_REGION, offset, &mut buf[..n])?;
        self.migration.chunk_offset += n as u64;
        self.migration.chunk_left -= n as u64;
        Ok(n)
    }

    /// Writes the data into the window and then its size, window by window.
    fn write_migration_data(&mut self, mut data: &[u8]) -> Result<()> {
        if self.migration.state != MigrationState::Resuming {
            return Err(self.mig_data_error(format!(
                "writing state in {:?}, not Resuming",
                self.migration.state
            )));
        }
        let (data_offset, size) = self.mig_data_offset()?;
        let window = (size - data_offset) as usize;
        while !data.is_empty() {
            let n = data.len().min(window);
            self.region_write(MIGRATION_REGION, data_offset, &data[..n])?;
            self.region_write(
                MIGRATION_REGION,
                mig_region::DATA_SIZE,
                &(n as u64).to_le_bytes(),
            )?;
            data = &data[n..];
        }
        let state = self.mig_read_u32(mig_region::DEVICE_STATE)?;
        if state != mig::MIG_V1_RESUMING {
            self.migration.state = MigrationState::Error;
            let reason = format!(
                "the device left RESUMING (device_state {state:#x}): {}",
                self.mig_device_reason()
            );
            return Err(self.mig_data_error(reason));
        }
        Ok(())
    }
}

impl Drop for VfioUserDevice {
    fn drop(&mut self) {
        if self.health.is_gone() || self.health.leaves_device_alone() {
            return;
        }
        if let Err(error) = self.client().shutdown() {
            log::debug!("vfio-user: shutdown of {}: {error}", self.path.display());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::os::unix::net::UnixListener;

    use super::*;

    fn socket_path(name: &str) -> PathBuf {
        let path = std::env::temp_dir().join(format!(
            "gpuvm-vfio-user-{name}-{}.sock",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&path);
        path
    }

    #[test]
    fn a_device_that_never_answers_the_negotiation_is_refused() {
        let path = socket_path("silent");
        let listener = UnixListener::bind(&path).expect("bind");
        let (seen, bytes_until_eof) = mpsc::channel();
        // Accepts, reads what the client sends and never answers; reports how much it
        // got once the client's side is shut down.
        std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().expect("accept");
            let mut received = Vec::new();
            let _ = seen.send(stream.read_to_end(&mut received).map(|_| received.len()));
        });

        let error = VfioUserDevice::connect_within(&path, Duration::from_millis(300))
            .err()
            .expect("a silent device is refused");
        let message = error.to_string();
        assert!(message.contains(&path.display().to_string()), "{message}");
        assert!(
            message.contains("did not answer the version negotiation within 300 ms"),
            "{message}"
        );
        // The connection was shut down: the device sees the end of the stream after the
        // version message, so the connecting thread is not left blocked.
        let received = bytes_until_eof
            .recv_timeout(Duration::from_secs(30))
            .expect("the silent device saw the connection end")
            .expect("read");
        assert!(received > 0, "the client sent its version first");
        let _ = std::fs::remove_file(&path);
    }

    /// Answers everything except region reads, which it holds until the test ends.
    struct SilentOnRead {
        hold: mpsc::Receiver<()>,
    }

    impl vfio_user::ServerBackend for SilentOnRead {
        fn region_read(&mut self, _: u32, _: u64, _: &mut [u8]) -> std::io::Result<()> {
            let _ = self.hold.recv();
            Err(std::io::Error::other("released"))
        }
        fn region_write(&mut self, _: u32, _: u64, _: &[u8]) -> std::io::Result<()> {
            Ok(())
        }
        fn dma_map(
            &mut self,
            _: vfio_user::DmaMapFlags,
            _: u64,
            _: u64,
            _: u64,
            _: Option<std::fs::File>,
        ) -> std::io::Result<()> {
            Ok(())
        }
        fn dma_unmap(
            &mut self,
            _: vfio_user::DmaUnmapFlags,
            _: u64,
            _: u64,
        ) -> std::io::Result<()> {
            Ok(())
        }
        fn reset(&mut self) -> std::io::Result<()> {
            Ok(())
        }
        fn set_irqs(
            &mut self,
            _: u32,
            _: u32,
            _: u32,
            _: u32,
            _: Vec<std::fs::File>,
        ) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_request_never_answered_fails_and_the_device_is_gone() {
        use vfio_bindings::bindings::vfio::vfio_region_info;
        let path = socket_path("mute-read");
        let regions = (0..9u32)
            .map(|index| vfio_user::ServerRegion {
                region_info: vfio_region_info {
                    argsz: std::mem::size_of::<vfio_region_info>() as u32,
                    flags: crate::REGION_READ | crate::REGION_WRITE,
                    index,
                    cap_offset: 0,
                    size: if index == 0 { 4096 } else { 0 },
                    offset: 0,
                },
                sparse_areas: Vec::new(),
                mmap_fd: None,
            })
            .collect();
        let server = vfio_user::Server::new(&path, true, Vec::new(), regions).expect("listen");
        let (release, hold) = mpsc::channel();
        std::thread::spawn(move || server.run(&mut SilentOnRead { hold }));

        let mut device =
            VfioUserDevice::connect_within(&path, Duration::from_millis(300)).expect("connect");
        assert!(device.region_write(0, 0, &[1, 2, 3, 4]).is_ok());
        let health = device.health();
        assert!(!health.is_gone());

        let mut data = [0u8; 4];
        let error = device.region_read(0, 0, &mut data).unwrap_err();
        assert!(
            matches!(
                error,
                VfioError::User {
                    what: "region read",
                    ..
                }
            ),
            "{error}"
        );
        assert_eq!(data, [0xff; 4], "a failed read reads all ones");
        assert!(
            health.is_gone(),
            "a request never answered marks the device gone"
        );
        let reason = health.reason().unwrap();
        assert!(reason.contains("stopped answering"), "{reason}");
        assert!(reason.contains("region read"), "{reason}");
        assert!(reason.contains(&path.display().to_string()), "{reason}");

        // From now on nothing goes to the device: reads are all ones, other requests fail.
        let mut data = [0u8; 4];
        assert!(device.region_read(0, 0, &mut data).is_ok());
        assert_eq!(data, [0xff; 4]);
        let error = device.msix_vectors().unwrap_err();
        assert!(error.to_string().contains("stopped answering"), "{error}");
        drop(release);
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn timeouts_read_as_people_write_them() {
        assert_eq!(describe(Duration::from_secs(5)), "5 s");
        assert_eq!(describe(Duration::from_millis(500)), "500 ms");
        assert_eq!(describe(Duration::from_millis(1500)), "1500 ms");
    }
}
