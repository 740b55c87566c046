//! One connection to a vhost-user backend: connecting with a bounded wait, feature
//! negotiation, and every request bounded by [`Timeouts::reply`].

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vhost::vhost_user::message::{VhostUserHeaderFlag, VhostUserProtocolFeatures};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::VhostBackend;

use super::watchdog::{self, Deadline};
use super::VhostUserError;
use crate::socket::connect_nonblocking;

/// VHOST_USER_F_PROTOCOL_FEATURES: a virtio feature bit that only means "the backend
/// speaks GET/SET_PROTOCOL_FEATURES"; never offered to the guest.
pub(super) const PROTOCOL_FEATURES_BIT: u64 = 1 << 30;

/// How long gpuvm waits for a backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeouts {
    /// For the socket to accept a connection (a backend still starting refuses it or has
    /// not created the socket yet: retried until then).
    pub connect: Duration,
    /// For each reply (and each send); a backend that misses it is treated as dead.
    pub reply: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            connect: Duration::from_secs(5),
            reply: Duration::from_secs(5),
        }
    }
}

/// What a connection's negotiation settled, as a live update carries it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Negotiated {
    /// GET_FEATURES' answer.
    pub backend_features: u64,
    /// The protocol features both sides speak (VhostUserProtocolFeatures bits).
    pub protocol_features: u64,
    /// GET_QUEUE_NUM's answer, when MQ was negotiated.
    pub backend_queues: Option<u64>,
    /// Guest RAM as the backend was last told it (SET_MEM_TABLE): the frontend addresses it
    /// knows each region by, which ring addresses are given in. A new process keeps them
    /// (its own mapping is elsewhere): a backend may translate rings it knows already
    /// through a new table (libvhost-user does, and gives up when it cannot).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub memory: Vec<RegionAddress>,
}

/// A guest RAM region as a backend knows it: its guest address and size, and the frontend
/// (userspace) address it was told.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegionAddress {
    pub guest: u64,
    pub size: u64,
    pub frontend: u64,
}

/// A negotiated connection.
pub(super) struct Connection {
    socket_path: PathBuf,
    frontend: Frontend,
    /// The connection's socket, for the watchdog's shutdown and the relay's hang-up watch.
    socket: Arc<OwnedFd>,
    timeouts: Timeouts,
    broken: Arc<AtomicBool>,
    /// GET_FEATURES' answer.
    backend_features: u64,
    /// What both sides speak.
    protocol_features: VhostUserProtocolFeatures,
    /// GET_QUEUE_NUM's answer, when MQ was negotiated.
    backend_queues: Option<u64>,
    /// Who we are in log lines ("vhost-user-blk rootfs").
    owner: String,
    /// Adopted from another gpuvm process and not yet renegotiated
    /// ([`Connection::renegotiate_if_adopted`]).
    renegotiate: bool,
    /// Guest RAM as the backend knows it ([`Negotiated::memory`]).
    memory: Vec<RegionAddress>,
}

impl Connection {
    /// Connects to `socket_path` and negotiates: GET_FEATURES, GET/SET_PROTOCOL_FEATURES
    /// (the subset of `wanted` the backend offers; REPLY_ACK makes every request wait for
    /// the backend's acknowledgement), GET_QUEUE_NUM (with MQ), SET_OWNER.
    pub(super) fn connect(
        owner: &str,
        socket_path: &Path,
        queues: usize,
        wanted: VhostUserProtocolFeatures,
        timeouts: Timeouts,
    ) -> Result<Connection, VhostUserError> {
        watchdog::start().map_err(VhostUserError::Watchdog)?;
        let stream = connect_bounded(socket_path, timeouts.connect)?;
        let socket = stream
            .try_clone()
            .map(|s| Arc::new(OwnedFd::from(s)))
            .map_err(|source| VhostUserError::Connect {
                socket: socket_path.to_path_buf(),
                source,
            })?;
        let mut connection = Connection {
            socket_path: socket_path.to_path_buf(),
            frontend: Frontend::from_stream(stream, queues as u64),
            socket,
            timeouts,
            broken: Arc::new(AtomicBool::new(false)),
            backend_features: 0,
            protocol_features: VhostUserProtocolFeatures::empty(),
            backend_queues: None,
            owner: owner.to_string(),
            renegotiate: false,
            memory: Vec::new(),
        };
        connection.negotiate(wanted)?;
        Ok(connection)
    }

    /// The connection another gpuvm process negotiated on `stream` and handed over (a live
    /// update): nothing is sent (the backend serves one frontend and already has it set
    /// up); what was negotiated comes with it (`negotiated`).
    pub(super) fn adopt(
        owner: &str,
        socket_path: &Path,
        stream: UnixStream,
        queues: usize,
        negotiated: &Negotiated,
        timeouts: Timeouts,
    ) -> Result<Connection, VhostUserError> {
        watchdog::start().map_err(VhostUserError::Watchdog)?;
        let io_error = |source| VhostUserError::Connect {
            socket: socket_path.to_path_buf(),
            source,
        };
        stream.set_nonblocking(false).map_err(io_error)?;
        let socket = stream
            .try_clone()
            .map(|s| Arc::new(OwnedFd::from(s)))
            .map_err(io_error)?;
        let protocol_features =
            VhostUserProtocolFeatures::from_bits_truncate(negotiated.protocol_features);
        Ok(Connection {
            socket_path: socket_path.to_path_buf(),
            frontend: Frontend::from_stream(stream, queues as u64),
            socket,
            timeouts,
            broken: Arc::new(AtomicBool::new(false)),
            backend_features: negotiated.backend_features,
            protocol_features,
            backend_queues: negotiated.backend_queues,
            owner: owner.to_string(),
            // The vhost crate's frontend learns what was agreed only by asking and setting
            // it: done before the first ring start, once the connection is this process's.
            renegotiate: true,
            memory: negotiated.memory.clone(),
        })
    }

    /// Gives the regions of a memory table about to be sent the frontend addresses the
    /// backend knows them by (this process's own for a region it does not know), and
    /// remembers the table as sent.
    pub(super) fn announce_table(&mut self, table: &mut [vhost::VhostUserMemoryRegionInfo]) {
        for region in table.iter_mut() {
            let known = (self.memory.iter()).find(|known| {
                known.guest == region.guest_phys_addr && known.size == region.memory_size
            });
            if let Some(known) = known {
                region.userspace_addr = known.frontend;
            }
        }
        self.memory = (table.iter())
            .map(|region| RegionAddress {
                guest: region.guest_phys_addr,
                size: region.memory_size,
                frontend: region.userspace_addr,
            })
            .collect();
    }

    /// The frontend address the backend knows `guest` by (through the last table sent);
    /// `own`, this process's address for it, when no region holds it.
    pub(super) fn frontend_address(&self, guest: u64, own: u64) -> u64 {
        (self.memory.iter())
            .find(|known| guest >= known.guest && guest - known.guest < known.size)
            .map_or(own, |known| known.frontend + (guest - known.guest))
    }

    /// An adopted connection's first step, before its rings start: the vhost crate's
    /// frontend learns the features again as it negotiated them (GET_FEATURES,
    /// GET/SET_PROTOCOL_FEATURES; no SET_OWNER: the session is owned already), and every
    /// request waits for its acknowledgement again where REPLY_ACK was agreed. A backend
    /// whose features changed is refused.
    pub(super) fn renegotiate_if_adopted(&mut self) -> Result<(), VhostUserError> {
        if !std::mem::take(&mut self.renegotiate) {
            return Ok(());
        }
        let features = self.request("GET_FEATURES", |f| f.get_features())?;
        if features != self.backend_features {
            return Err(VhostUserError::Unsupported {
                socket: self.socket_path.clone(),
                missing: format!(
                    "offers features {features:#x} after the hand-over, {:#x} before",
                    self.backend_features
                ),
            });
        }
        if features & PROTOCOL_FEATURES_BIT != 0 {
            let agreed = self.protocol_features;
            let offered = self.request("GET_PROTOCOL_FEATURES", |f| f.get_protocol_features())?;
            if !offered.contains(agreed) {
                return Err(VhostUserError::Unsupported {
                    socket: self.socket_path.clone(),
                    missing: format!(
                        "offers protocol features {offered:?} after the hand-over, without \
                         {agreed:?}"
                    ),
                });
            }
            self.request("SET_PROTOCOL_FEATURES", |f| f.set_protocol_features(agreed))?;
            if agreed.contains(VhostUserProtocolFeatures::REPLY_ACK) {
                self.frontend.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
            }
        }
        log::info!(
            "{}: took over the connection to the backend at {}",
            self.owner,
            self.socket_path.display()
        );
        Ok(())
    }

    /// What was negotiated, for a live update to hand over with the socket.
    pub(super) fn negotiated(&self) -> Negotiated {
        Negotiated {
            backend_features: self.backend_features,
            protocol_features: self.protocol_features.bits(),
            backend_queues: self.backend_queues,
            memory: self.memory.clone(),
        }
    }

    fn negotiate(&mut self, wanted: VhostUserProtocolFeatures) -> Result<(), VhostUserError> {
        self.backend_features = self.request("GET_FEATURES", |f| f.get_features())?;
        if self.backend_features & PROTOCOL_FEATURES_BIT != 0 {
            let offered = self.request("GET_PROTOCOL_FEATURES", |f| f.get_protocol_features())?;
            let agreed = offered & wanted;
            self.request("SET_PROTOCOL_FEATURES", |f| f.set_protocol_features(agreed))?;
            self.protocol_features = agreed;
            if agreed.contains(VhostUserProtocolFeatures::REPLY_ACK) {
                self.frontend.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
            }
            if agreed.contains(VhostUserProtocolFeatures::MQ) {
                self.backend_queues = Some(self.request("GET_QUEUE_NUM", |f| f.get_queue_num())?);
            }
        }
        self.request("SET_OWNER", |f| f.set_owner())?;
        log::debug!(
            "{}: backend at {} offers features {:#x}, protocol features {:?}, queues {:?}",
            self.owner,
            self.socket_path.display(),
            self.backend_features,
            self.protocol_features,
            self.backend_queues
        );
        Ok(())
    }

    /// Sends one request (and waits for its reply) through `send`, within the reply
    /// timeout. A late reply or a broken stream marks the connection broken for good.
    pub(super) fn request<T>(
        &mut self,
        request: &'static str,
        send: impl FnOnce(&mut Frontend) -> vhost::Result<T>,
    ) -> Result<T, VhostUserError> {
        if self.is_broken() {
            return Err(VhostUserError::Broken {
                socket: self.socket_path.clone(),
            });
        }
        let deadline = Deadline::arm(&self.socket, self.timeouts.reply);
        let result = send(&mut self.frontend);
        let late = deadline.disarm();
        match result {
            Ok(value) if !late => Ok(value),
            Ok(_) => {
                self.mark_broken(&format!("{request} was answered too late"));
                Err(self.timeout(request))
            }
            Err(_) if late => {
                self.mark_broken(&format!("no answer to {request}"));
                Err(self.timeout(request))
            }
            Err(source) => {
                if breaks_connection(&source) {
                    self.mark_broken(&format!("{request} failed: {source}"));
                    // The stream may hold half a message: nothing after it can be trusted.
                    // SAFETY: shutdown(2) on the socket the Arc keeps open.
                    unsafe { libc::shutdown(self.socket.as_raw_fd(), libc::SHUT_RDWR) };
                }
                Err(VhostUserError::Protocol {
                    socket: self.socket_path.clone(),
                    request,
                    source,
                })
            }
        }
    }

    fn timeout(&self, request: &'static str) -> VhostUserError {
        VhostUserError::Timeout {
            socket: self.socket_path.clone(),
            request,
            waited: self.timeouts.reply,
            hint: if request == "GET_FEATURES" {
                " (a backend that already serves a frontend, such as another device or VM on \
                 the same socket, does not answer a second one)"
            } else {
                ""
            },
        }
    }

    /// Marks the connection broken, logging the first reason only.
    pub(super) fn mark_broken(&self, reason: &str) {
        mark_broken(&self.broken, &self.owner, &self.socket_path, reason);
    }

    pub(super) fn is_broken(&self) -> bool {
        self.broken.load(Ordering::SeqCst)
    }

    /// The flag [`Connection::is_broken`] reads, for the relay to set on a hang-up.
    pub(super) fn broken_flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.broken)
    }

    pub(super) fn socket(&self) -> Arc<OwnedFd> {
        Arc::clone(&self.socket)
    }

    pub(super) fn socket_path(&self) -> &Path {
        &self.socket_path
    }

    pub(super) fn owner(&self) -> &str {
        &self.owner
    }

    pub(super) fn backend_features(&self) -> u64 {
        self.backend_features
    }

    pub(super) fn protocol_features(&self) -> VhostUserProtocolFeatures {
        self.protocol_features
    }

    pub(super) fn backend_queues(&self) -> Option<u64> {
        self.backend_queues
    }

    /// SET_VRING_ENABLE is only spoken (and needed: rings start enabled without it) once
    /// protocol features are negotiated.
    pub(super) fn has_vring_enable(&self) -> bool {
        self.backend_features & PROTOCOL_FEATURES_BIT != 0
    }
}

/// Sets `broken`, logging `reason` the first time only.
pub(super) fn mark_broken(broken: &AtomicBool, owner: &str, socket: &Path, reason: &str) {
    if !broken.swap(true, Ordering::SeqCst) {
        log::error!(
            "{owner}: vhost-user backend at {} lost ({reason}); the device is broken, its \
             queues are no longer served",
            socket.display()
        );
    }
}

/// Whether `error` leaves the stream in an unknown state (as opposed to a refusal checked
/// before anything was sent, or a well-formed negative acknowledgement).
fn breaks_connection(error: &vhost::Error) -> bool {
    use vhost::vhost_user::Error as Protocol;
    match error {
        vhost::Error::VhostUserProtocol(inner) => !matches!(
            inner,
            Protocol::InvalidParam
                | Protocol::InactiveFeature(_)
                | Protocol::InactiveOperation(_)
                | Protocol::BackendInternalError
                | Protocol::FeatureMismatch
        ),
        _ => false,
    }
}

/// Connects to a Unix socket, retrying while nobody listens yet (ENOENT, ECONNREFUSED) or
/// the listener's backlog is full (EAGAIN), until `timeout` has passed. The socket is
/// non-blocking while connecting so a full backlog cannot block the caller.
fn connect_bounded(path: &Path, timeout: Duration) -> Result<UnixStream, VhostUserError> {
    let begin = Instant::now();
    loop {
        match connect_nonblocking(path) {
            Ok(stream) => {
                stream
                    .set_nonblocking(false)
                    .map_err(|source| VhostUserError::Connect {
                        socket: path.to_path_buf(),
                        source,
                    })?;
                return Ok(stream);
            }
            Err(error) if retryable(&error) => {
                if let Some(source) = not_a_socket(path) {
                    return Err(VhostUserError::Connect {
                        socket: path.to_path_buf(),
                        source,
                    });
                }
                let waited = begin.elapsed();
                if waited >= timeout {
                    return Err(VhostUserError::ConnectTimeout {
                        socket: path.to_path_buf(),
                        waited,
                        last: error,
                    });
                }
                std::thread::sleep((timeout - waited).min(Duration::from_millis(20)));
            }
            Err(source) => {
                return Err(VhostUserError::Connect {
                    socket: path.to_path_buf(),
                    source,
                })
            }
        }
    }
}

/// A path that exists but is no socket will never accept: say so at once.
fn not_a_socket(path: &Path) -> Option<std::io::Error> {
    use std::os::unix::fs::FileTypeExt;
    let metadata = std::fs::metadata(path).ok()?;
    (!metadata.file_type().is_socket()).then(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "the path exists but is not a Unix socket",
        )
    })
}

fn retryable(error: &std::io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(libc::ENOENT | libc::ECONNREFUSED | libc::EAGAIN)
    )
}
