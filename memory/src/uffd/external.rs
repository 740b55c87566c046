//! Handing guest RAM page faults to another process, with Firecracker's handshake.
//!
//! Wire format matched: Firecracker's `GuestRegionUffdMapping` as sent by
//! `send_uffd_handshake` in `src/vmm/src/persist.rs` (v1.7 and later): the VMM connects to
//! the handler's Unix stream socket and sends, in one `sendmsg` with the userfaultfd
//! attached as `SCM_RIGHTS`, a JSON array with one object per guest RAM region:
//! `{"base_host_virt_addr": u64, "size": u64, "offset": u64, "page_size": u64,
//! "page_size_kib": u64}`. `offset` is the region's offset in the flat guest RAM image,
//! `page_size` is in bytes, and `page_size_kib` is the deprecated older name which
//! Firecracker also fills with the size in bytes. Older senders only send
//! `page_size_kib`; we accept it in bytes or KiB (the valid page sizes tell them apart).
//!
//! gpuvm sends `offset` = the region's offset in the guest RAM memfd, which is that flat
//! image.

use std::fs::File;
use std::io::Read;
use std::os::unix::io::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use log::{debug, error, info, warn};
use serde::{Deserialize, Serialize};
use userfaultfd::Uffd;
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use super::fence::RamFence;
use super::{io_err, lock, LazyOptions, LazyRestore, ThreadStartHook, UffdError};
use crate::snapshot::SnapshotChain;

/// Largest handshake message accepted (a few hundred regions fit easily).
const MAX_MESSAGE: usize = 1 << 20;
/// Page sizes a mapping may declare.
const VALID_PAGE_SIZES: [u64; 3] = [4096, 2 << 20, 1 << 30];

/// One guest RAM region in the handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UffdRegionMapping {
    /// Where the region is mapped in the VMM (fault addresses are in these terms).
    pub base_host_virt_addr: u64,
    /// Region size in bytes.
    pub size: u64,
    /// Offset of the region in the flat guest RAM image (gpuvm: the memfd offset).
    pub offset: u64,
    /// Page size in bytes (4 KiB, or the huge page size for hugetlb backing).
    pub page_size: u64,
}

/// The JSON object on the wire.
#[derive(Serialize, Deserialize)]
struct WireMapping {
    base_host_virt_addr: u64,
    size: u64,
    offset: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    page_size: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    page_size_kib: Option<u64>,
}

impl From<&UffdRegionMapping> for WireMapping {
    fn from(m: &UffdRegionMapping) -> Self {
        WireMapping {
            base_host_virt_addr: m.base_host_virt_addr,
            size: m.size,
            offset: m.offset,
            page_size: Some(m.page_size),
            // Like Firecracker: the legacy field carries the size in bytes.
            page_size_kib: Some(m.page_size),
        }
    }
}

impl TryFrom<WireMapping> for UffdRegionMapping {
    type Error = UffdError;

    fn try_from(w: WireMapping) -> Result<Self, UffdError> {
        let page_size = match (w.page_size, w.page_size_kib) {
            (Some(bytes), _) if bytes != 0 => bytes,
            (_, Some(legacy)) if VALID_PAGE_SIZES.contains(&legacy) => legacy,
            (_, Some(kib)) if VALID_PAGE_SIZES.contains(&kib.saturating_mul(1024)) => kib * 1024,
            _ => {
                return Err(UffdError::Handshake(format!(
                    "region at {:#x} has no valid page_size",
                    w.base_host_virt_addr
                )))
            }
        };
        let m = UffdRegionMapping {
            base_host_virt_addr: w.base_host_virt_addr,
            size: w.size,
            offset: w.offset,
            page_size,
        };
        let aligned = |v: u64| v.is_multiple_of(page_size);
        if !VALID_PAGE_SIZES.contains(&page_size)
            || m.size == 0
            || !aligned(m.size)
            || !aligned(m.base_host_virt_addr)
            || !aligned(m.offset)
            || m.base_host_virt_addr.checked_add(m.size).is_none()
        {
            return Err(UffdError::Handshake(format!(
                "region {m:x?} is empty, unaligned or has an invalid page size"
            )));
        }
        Ok(m)
    }
}

/// Encodes the handshake message.
pub fn encode_mappings(regions: &[UffdRegionMapping]) -> Result<String, UffdError> {
    let wire: Vec<WireMapping> = regions.iter().map(WireMapping::from).collect();
    serde_json::to_string(&wire).map_err(UffdError::HandshakeJson)
}

/// Decodes and checks a handshake message.
pub fn decode_mappings(json: &[u8]) -> Result<Vec<UffdRegionMapping>, UffdError> {
    let wire: Vec<WireMapping> = serde_json::from_slice(json).map_err(UffdError::HandshakeJson)?;
    if wire.is_empty() {
        return Err(UffdError::Handshake("no regions".into()));
    }
    let regions = wire
        .into_iter()
        .map(UffdRegionMapping::try_from)
        .collect::<Result<Vec<_>, _>>()?;
    if regions.iter().any(|r| r.page_size != regions[0].page_size) {
        return Err(UffdError::Handshake(
            "regions have different page sizes".into(),
        ));
    }
    Ok(regions)
}

/// VMM side: connects to the handler at `socket_path` and sends the region list with
/// `uffd` attached. Returns the connection; keep it open while the guest runs, the
/// handler sees the VMM's exit as EOF on it.
pub fn send_handshake(
    socket_path: &Path,
    regions: &[UffdRegionMapping],
    uffd: &impl AsRawFd,
) -> Result<UnixStream, UffdError> {
    let message = encode_mappings(regions)?;
    let stream =
        UnixStream::connect(socket_path).map_err(io_err("connect to the page-fault handler"))?;
    let mut sent = stream
        .send_with_fd(message.as_bytes(), uffd.as_raw_fd())
        .map_err(|e| UffdError::Io {
            op: "send the userfaultfd handshake",
            source: std::io::Error::from_raw_os_error(e.errno()),
        })?;
    // A stream socket may take a long message in pieces; the fd went with the first.
    while sent < message.len() {
        use std::io::Write;
        sent += (&stream)
            .write(&message.as_bytes()[sent..])
            .map_err(io_err("send the userfaultfd handshake"))?;
    }
    Ok(stream)
}

/// VMM side: watches the external page-fault handler after the handshake.
///
/// The VMM keeps its own reference to the userfaultfd it sent, so the handler's death
/// does not drop the registration (which would make every page the handler had not
/// served read as zero). Instead a watcher thread notices the death — through a pidfd of
/// the handler process (`SO_PEERPIDFD`, else `pidfd_open` on `SO_PEERCRED`'s pid), or,
/// where no pidfd can be had, the handler hanging up the connection — and then fences
/// guest RAM (see [`RamFence`]): vCPUs waiting on a fault fault out of `KVM_RUN`, and
/// [`HandlerWatch::failure`] says what happened so the VMM ends the run with that error.
pub struct HandlerWatch {
    shared: Arc<WatchShared>,
    stop: EventFd,
    thread: Option<JoinHandle<()>>,
    /// A [`HandlerWatch::fault_in`] still under way (its caller gave up waiting).
    fault_in: Mutex<Option<Arc<FaultIn>>>,
}

struct WatchShared {
    uffd: Uffd,
    fence: RamFence,
    failure: Mutex<Option<String>>,
}

impl HandlerWatch {
    /// Starts watching the handler at the other end of `connection` (kept open, the
    /// handler sees the VMM's exit as EOF on it). `uffd` is the VMM's reference to the
    /// userfaultfd it sent; `ranges` are guest RAM (`(host address, length)`, mapped in
    /// this process for as long as the watch lives). `on_thread_start` runs first on the
    /// watcher thread (e.g. to install a seccomp filter); if it fails, the watch fails
    /// at once, as if the handler had died.
    pub fn start(
        connection: UnixStream,
        uffd: Uffd,
        ranges: Vec<(u64, u64)>,
        on_thread_start: Option<ThreadStartHook>,
    ) -> Result<HandlerWatch, UffdError> {
        let pidfd = peer_pidfd(&connection);
        match &pidfd {
            Ok(_) => debug!("watching the page-fault handler through a pidfd"),
            Err(e) => {
                warn!("no pidfd for the page-fault handler ({e}); watching its connection instead")
            }
        }
        let shared = Arc::new(WatchShared {
            uffd,
            fence: RamFence::new(ranges),
            failure: Mutex::new(None),
        });
        let stop = EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC)
            .map_err(io_err("create eventfd"))?;
        let thread_stop = stop.try_clone().map_err(io_err("clone eventfd"))?;
        let thread_shared = shared.clone();
        let thread = std::thread::Builder::new()
            .name("uffd-handler-watch".into())
            .spawn(move || {
                let started = on_thread_start.map_or(Ok(()), |hook| hook());
                let outcome = match started {
                    Ok(()) => watch(&connection, pidfd.ok(), &thread_stop),
                    Err(e) => Some(format!(
                        "cannot prepare the page-fault handler watcher thread: {e}"
                    )),
                };
                if let Some(reason) = outcome {
                    thread_shared.fail(reason);
                }
                // The connection closes here, after the fence (if any).
                drop(connection);
            })
            .map_err(io_err("spawn the page-fault handler watcher"))?;
        Ok(HandlerWatch {
            shared,
            stop,
            thread: Some(thread),
            fault_in: Mutex::new(None),
        })
    }

    /// Faults every page of guest RAM in (the handler serves what is missing), for a
    /// snapshot that must read it all. The faults are taken on a thread of their own,
    /// because a fault the handler never answers cannot be interrupted: when the handler
    /// has made no progress for `no_progress` during the call, this gives up with
    /// [`UffdError::NoProgress`] and leaves that thread waiting (it ends with the
    /// process); the next call waits for the same thread again. A handler that dies
    /// meanwhile fences guest RAM, which ends the faults with an error:
    /// [`UffdError::HandlerFailed`].
    pub fn fault_in(&self, no_progress: Duration) -> Result<(), UffdError> {
        let job = {
            let mut slot = lock(&self.fault_in);
            match &*slot {
                Some(job) => job.clone(),
                None => slot
                    .insert(FaultIn::start(self.shared.fence.ranges().to_vec())?)
                    .clone(),
            }
        };
        let Some(outcome) = job.wait(no_progress) else {
            return Err(UffdError::NoProgress {
                server: "the external page-fault handler",
                stalled: no_progress,
            });
        };
        *lock(&self.fault_in) = None;
        outcome.map_err(|source| match self.failure() {
            Some(reason) => UffdError::HandlerFailed(format!(
                "{reason} (while the snapshot was loading guest memory)"
            )),
            None => UffdError::Io {
                op: "fault in guest memory from the page-fault handler",
                source,
            },
        })
    }

    /// Why the handler can no longer serve faults, once it cannot (guest RAM is fenced
    /// by then).
    pub fn failure(&self) -> Option<String> {
        lock(&self.shared.failure).clone()
    }
}

/// Guest RAM being faulted in on a thread of its own (see [`HandlerWatch::fault_in`]).
struct FaultIn {
    state: Mutex<FaultInState>,
    finished: Condvar,
}

struct FaultInState {
    /// When the last piece was faulted in (or the work started).
    moved_at: Instant,
    /// Set when the thread is done, taken by the waiter.
    outcome: Option<std::io::Result<()>>,
}

impl FaultIn {
    /// Pieces faulted in at a time: each is a sign of progress. 64 base pages, so a
    /// handler that serves at all shows progress within the limit (one at 150 ms a
    /// fault still does within 10 s), while present memory costs a system call per
    /// 256 KiB.
    const PIECE: u64 = 256 << 10;

    /// Starts faulting `ranges` (`(host address, length)` of guest RAM) in.
    fn start(ranges: Vec<(u64, u64)>) -> Result<Arc<FaultIn>, UffdError> {
        let job = Arc::new(FaultIn {
            state: Mutex::new(FaultInState {
                moved_at: Instant::now(),
                outcome: None,
            }),
            finished: Condvar::new(),
        });
        let worker = job.clone();
        // Started from the VMM thread, it runs under that thread's seccomp filter, which
        // allows `madvise`.
        std::thread::Builder::new()
            .name("uffd-fault-in".into())
            .spawn(move || {
                let outcome = ranges
                    .iter()
                    .try_for_each(|&(addr, len)| worker.populate(addr, len));
                lock(&worker.state).outcome = Some(outcome);
                worker.finished.notify_all();
            })
            .map_err(io_err("spawn the guest memory fault-in thread"))?;
        Ok(job)
    }

    /// Faults `len` bytes at `addr` in for reading (`MADV_POPULATE_READ`, Linux 5.14),
    /// piece by piece, noting the progress.
    fn populate(&self, addr: u64, len: u64) -> std::io::Result<()> {
        let mut done = 0;
        while done < len {
            let n = Self::PIECE.min(len - done);
            // SAFETY: the range is guest RAM, mapped while the machine lives. If the
            // machine is torn down while this thread is left waiting on the handler, the
            // call meets an unmapped range (an error) or whatever is mapped there by
            // then; the advice only faults pages in for reading, so it changes no memory
            // either way.
            let ret = unsafe {
                libc::madvise(
                    (addr + done) as *mut libc::c_void,
                    n as usize,
                    libc::MADV_POPULATE_READ,
                )
            };
            if ret != 0 {
                let error = std::io::Error::last_os_error();
                if error.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(error);
            }
            done += n;
            lock(&self.state).moved_at = Instant::now();
        }
        Ok(())
    }

    /// The thread's outcome once it is done; `None` once it has made no progress for
    /// `no_progress` since this call began (a handler stalled before it may have gone on
    /// since; its next fault shows it).
    fn wait(&self, no_progress: Duration) -> Option<std::io::Result<()>> {
        let called = Instant::now();
        let mut state = lock(&self.state);
        loop {
            if let Some(outcome) = state.outcome.take() {
                return Some(outcome);
            }
            let moved_at = state.moved_at.max(called);
            let left = (moved_at + no_progress).checked_duration_since(Instant::now())?;
            state = self
                .finished
                .wait_timeout(state, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl WatchShared {
    fn fail(&self, reason: String) {
        {
            let mut failure = lock(&self.failure);
            if failure.is_some() {
                return;
            }
            error!("{reason}");
            *failure = Some(reason);
        }
        // Publish first, fence second: whoever is woken by the fence finds the reason.
        if let Err(e) = self.fence.fence(&self.uffd) {
            error!("fencing guest RAM after the page-fault handler failed: {e}");
        }
    }
}

impl Drop for HandlerWatch {
    fn drop(&mut self) {
        let _ = self.stop.write(1);
        if let Some(thread) = self.thread.take() {
            if thread.join().is_err() {
                error!("the page-fault handler watcher panicked");
            }
        }
    }
}

impl std::fmt::Debug for HandlerWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandlerWatch")
            .field("failure", &self.failure())
            .finish()
    }
}

/// `SO_PEERPIDFD` (Linux 6.5): a pidfd of the peer, free of pid-reuse races.
const SO_PEERPIDFD: libc::c_int = 77;

/// A pidfd for the process at the other end of `connection`.
fn peer_pidfd(connection: &UnixStream) -> std::io::Result<OwnedFd> {
    let fd = connection.as_raw_fd();
    let mut pidfd: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `pidfd`, which lives on the stack.
    let ret = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            SO_PEERPIDFD,
            (&mut pidfd as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if ret == 0 && pidfd >= 0 {
        // SAFETY: the kernel just created this fd for us; nothing else owns it.
        return Ok(unsafe { OwnedFd::from_raw_fd(pidfd) });
    }
    // Older kernels: the peer's pid (a pid-reuse race in theory; the connection is
    // watched too), then pidfd_open.
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`, which lives on the stack.
    let ret = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if ret != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if cred.pid <= 0 {
        return Err(std::io::Error::other("the peer's pid is unknown"));
    }
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, cred.pid, 0) };
    if pidfd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(pidfd as libc::c_int) })
}

/// Waits until the handler is gone (returns why) or `stop` is written (returns `None`).
fn watch(connection: &UnixStream, pidfd: Option<OwnedFd>, stop: &EventFd) -> Option<String> {
    let have_pidfd = pidfd.is_some();
    let mut fds = vec![libc::pollfd {
        fd: stop.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    }];
    if let Some(pidfd) = &pidfd {
        fds.push(libc::pollfd {
            fd: pidfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        });
    }
    // The connection: the only sign of death without a pidfd; with one, a hang-up is
    // only noted (a handler may close it and go on serving).
    fds.push(libc::pollfd {
        fd: connection.as_raw_fd(),
        events: libc::POLLIN | libc::POLLRDHUP,
        revents: 0,
    });
    loop {
        if let Err(err) = super::ops::poll_until_ready(&mut fds) {
            return Some(format!(
                "cannot watch the external page-fault handler: {err}"
            ));
        }
        if fds[0].revents != 0 {
            return None;
        }
        if have_pidfd && fds[1].revents != 0 {
            return Some(
                "the external page-fault handler exited while the guest was running; pages it \
                 had not served are unavailable"
                    .into(),
            );
        }
        let conn = fds.last_mut().expect("connection pollfd");
        if conn.revents != 0 {
            let hung_up = conn.revents & (libc::POLLHUP | libc::POLLRDHUP | libc::POLLERR) != 0
                || {
                    // Readable: EOF, or bytes the handshake does not define, which we drop.
                    let mut buf = [0u8; 256];
                    matches!((&*connection).read(&mut buf), Ok(0) | Err(_))
                };
            if hung_up {
                if !have_pidfd {
                    return Some(
                        "the external page-fault handler hung up while the guest was running; \
                         pages it had not served are unavailable"
                            .into(),
                    );
                }
                info!("the page-fault handler closed its connection; still watching its process");
                conn.fd = -1; // poll ignores negative fds
            }
        }
    }
}

/// Handler side: the userfaultfd and region list received from a VMM.
#[derive(Debug)]
pub struct ExternalHandler {
    stream: UnixStream,
    uffd: Uffd,
    regions: Vec<UffdRegionMapping>,
}

impl ExternalHandler {
    /// Accepts one VMM connection on `listener` and receives its handshake.
    pub fn accept(listener: &UnixListener) -> Result<ExternalHandler, UffdError> {
        let (stream, _) = listener
            .accept()
            .map_err(io_err("accept a VMM connection"))?;
        Self::from_stream(stream)
    }

    /// Receives the handshake on an accepted connection.
    pub fn from_stream(stream: UnixStream) -> Result<ExternalHandler, UffdError> {
        let mut buf = vec![0u8; 64 << 10];
        let (mut len, file) = stream.recv_with_fd(&mut buf).map_err(|e| UffdError::Io {
            op: "receive the userfaultfd handshake",
            source: std::io::Error::from_raw_os_error(e.errno()),
        })?;
        let file =
            file.ok_or_else(|| UffdError::Handshake("no file descriptor attached".into()))?;
        check_is_userfaultfd(&file)?;
        // SAFETY: the fd was just received, is owned by `file` and is a userfaultfd;
        // ownership moves into the Uffd.
        let uffd = unsafe { Uffd::from_raw_fd(file.into_raw_fd()) };

        // Read on until the JSON is complete (long lists may arrive in pieces).
        let regions = loop {
            match decode_mappings(&buf[..len]) {
                Err(UffdError::HandshakeJson(e)) if e.is_eof() && len < MAX_MESSAGE => {
                    if len == buf.len() {
                        buf.resize((buf.len() * 2).min(MAX_MESSAGE), 0);
                    }
                    let n = (&stream)
                        .read(&mut buf[len..])
                        .map_err(io_err("receive the userfaultfd handshake"))?;
                    if n == 0 {
                        return Err(UffdError::HandshakeJson(e));
                    }
                    len += n;
                }
                other => break other?,
            }
        };
        info!("userfaultfd handshake: {} regions", regions.len());
        Ok(ExternalHandler {
            stream,
            uffd,
            regions,
        })
    }

    /// The regions the VMM described.
    pub fn regions(&self) -> &[UffdRegionMapping] {
        &self.regions
    }

    /// The received userfaultfd.
    pub fn uffd(&self) -> &Uffd {
        &self.uffd
    }

    /// Splits into the connection, the userfaultfd and the regions, for handlers that
    /// serve faults their own way.
    pub fn into_parts(self) -> (UnixStream, Uffd, Vec<UffdRegionMapping>) {
        (self.stream, self.uffd, self.regions)
    }

    /// Starts serving the VMM's faults from `chain` (typically opened with
    /// [`SnapshotChain::open_with_file_layout`]). Each chain region is matched to the
    /// mapping with its offset: the memfd offset recorded in the file, or else the
    /// region's position in the flat RAM image. Returns the running restore and the
    /// connection (EOF on it means the VMM exited).
    pub fn serve(
        self,
        chain: Arc<SnapshotChain>,
        opts: LazyOptions,
    ) -> Result<(LazyRestore, UnixStream), UffdError> {
        let host_addrs = match_regions(&chain, &self.regions)?;
        let restore = LazyRestore::start(chain, &host_addrs, self.uffd, opts)?;
        Ok((restore, self.stream))
    }
}

/// For each region of the chain, the host address of the mapping that covers it.
fn match_regions(
    chain: &SnapshotChain,
    mappings: &[UffdRegionMapping],
) -> Result<Vec<u64>, UffdError> {
    let layout = chain.layout();
    if let Some(m) = mappings.iter().find(|m| m.page_size != layout.page_size()) {
        return Err(UffdError::Layout(format!(
            "the VMM uses {}-byte pages, the snapshot {}-byte pages",
            m.page_size,
            layout.page_size()
        )));
    }
    let by_offset = |offset_of: &dyn Fn(usize) -> u64| -> Option<Vec<u64>> {
        layout
            .regions()
            .iter()
            .enumerate()
            .map(|(i, r)| {
                mappings
                    .iter()
                    .find(|m| m.offset == offset_of(i) && m.size == r.size)
                    .map(|m| m.base_host_virt_addr)
            })
            .collect()
    };
    let regions = layout.regions();
    let memfd_offset = |i: usize| regions[i].file_offset;
    let flat_offset = |i: usize| regions[..i].iter().map(|r| r.size).sum::<u64>();
    by_offset(&memfd_offset)
        .or_else(|| by_offset(&flat_offset))
        .ok_or_else(|| {
            UffdError::Layout(format!(
                "the VMM's regions {mappings:x?} do not cover the snapshot's regions {regions:x?}"
            ))
        })
}

/// Refuses anything but a userfaultfd: a handler must not run ioctls on a random fd.
fn check_is_userfaultfd(file: &File) -> Result<(), UffdError> {
    let link = std::fs::read_link(format!("/proc/self/fd/{}", file.as_raw_fd()))
        .map_err(io_err("inspect the received file descriptor"))?;
    if link.to_string_lossy() != "anon_inode:[userfaultfd]" {
        return Err(UffdError::Handshake(format!(
            "the received file descriptor is {}, not a userfaultfd",
            link.display()
        )));
    }
    Ok(())
}

/// The handshake regions describing `ram` as this process maps it.
pub fn mappings_for(ram: &crate::snapshot::RamMappings<'_>) -> Vec<UffdRegionMapping> {
    let page_size = ram.layout().page_size();
    ram.host_addrs()
        .into_iter()
        .zip(ram.layout().regions())
        .map(|(addr, r)| UffdRegionMapping {
            base_host_virt_addr: addr,
            size: r.size,
            offset: r.file_offset,
            page_size,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_format_matches_firecracker() {
        let m = UffdRegionMapping {
            base_host_virt_addr: 0x7f00_0000_0000,
            size: 0x1000_0000,
            offset: 0x2000_0000,
            page_size: 4096,
        };
        let json = encode_mappings(&[m]).unwrap();
        assert_eq!(
            json,
            r#"[{"base_host_virt_addr":139637976727552,"size":268435456,"offset":536870912,"page_size":4096,"page_size_kib":4096}]"#
        );
        assert_eq!(decode_mappings(json.as_bytes()).unwrap(), vec![m]);
    }

    #[test]
    fn legacy_page_size_kib_is_understood() {
        let bytes = br#"[{"base_host_virt_addr":2097152,"size":4194304,"offset":0,"page_size_kib":2097152}]"#;
        assert_eq!(decode_mappings(bytes).unwrap()[0].page_size, 2 << 20);
        let kib = br#"[{"base_host_virt_addr":4096,"size":8192,"offset":0,"page_size_kib":4}]"#;
        assert_eq!(decode_mappings(kib).unwrap()[0].page_size, 4096);
    }

    #[test]
    fn bad_messages_are_rejected() {
        for bad in [
            &br#"[]"#[..],
            br#"{"base_host_virt_addr":0}"#,
            br#"[{"base_host_virt_addr":4096,"size":8192,"offset":0}]"#,
            br#"[{"base_host_virt_addr":4097,"size":8192,"offset":0,"page_size":4096}]"#,
            br#"[{"base_host_virt_addr":4096,"size":0,"offset":0,"page_size":4096}]"#,
            br#"[{"base_host_virt_addr":4096,"size":8192,"offset":0,"page_size":8192}]"#,
        ] {
            assert!(
                decode_mappings(bad).is_err(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
