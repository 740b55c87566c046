//! virtio-rng, the entropy device (virtio 1.x section 5.4): one queue of device-writable
//! buffers that the device fills with random bytes from the host.
//!
//! The bytes come from getrandom(2) by default, or from a file opened at construction
//! (/dev/urandom, or a regular file of entropy: at its end requests are answered with 0
//! bytes, never a hang). A [`RateLimiter`] bounds bytes and requests; while it waits for
//! tokens the worker stops taking requests and waits for the limiter's timer.
//!
//! Wiring in the VMM: `Rng::new(RngConfig)` at build time, then hand it to the virtio-pci
//! transport like any [`VirtioDevice`]; [`Rng::update_rate_limiter`] changes the limits of a
//! running device (PATCH).

use std::fs::File;
use std::io::{Read, Write};
use std::num::Wrapping;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use virtio_bindings::bindings::virtio_ring::{
    VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC,
};
use virtio_bindings::virtio_ids::VIRTIO_ID_RNG;
use virtio_queue::{Queue, QueueOwnedT, QueueT, Writer};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use crate::device::{ActivateError, Activation, QueuePosition, VirtioDevice, VirtioInterrupt};
use crate::rate_limiter::{RateLimiter, RateLimiterConfig, RateLimiterError};
use crate::worker::{EventControl, Worker, WorkerError, WorkerHandler};
use crate::GuestMemory;

const DEVICE_NAME: &str = "virtio-rng";
/// The worker thread's name (at most 15 bytes show in /proc).
const THREAD_NAME: &str = "virtio-rng";
pub const QUEUE_MAX_SIZE: u16 = 256;
/// The most bytes one request gets, however big its buffers: bounds the work (and the host
/// buffer) per request. Drivers ask again for more.
pub const MAX_REQUEST_BYTES: usize = 64 * 1024;
/// The most chains served per wake-up before the worker yields to its other events (a
/// driver that keeps refilling the queue cannot keep the worker from stopping).
const MAX_CHAINS_PER_WAKE: usize = 4 * QUEUE_MAX_SIZE as usize;

const KICK_TOKEN: u64 = 0;
const TIMER_TOKEN: u64 = 1;

/// How the entropy device is built.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RngConfig {
    /// A file to read entropy from (a character device such as /dev/urandom, or a regular
    /// file); getrandom(2) when left out.
    #[serde(default)]
    pub source: Option<PathBuf>,
    #[serde(default)]
    pub rate_limiter: RateLimiterConfig,
}

/// Why the entropy device could not be built or changed.
#[derive(Debug, thiserror::Error)]
pub enum RngError {
    #[error("entropy source {}: cannot open it for reading: {source}", path.display())]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("entropy source {} is a directory", path.display())]
    Directory { path: PathBuf },
    #[error("entropy source {} is a {kind}: reading it could block the device; use a character device such as /dev/urandom or a regular file", path.display())]
    WouldBlock { path: PathBuf, kind: &'static str },
    #[error(transparent)]
    RateLimiter(#[from] RateLimiterError),
    #[error("virtio-rng: cannot restart its I/O thread: {0}")]
    Thread(#[source] WorkerError),
}

/// Lets the first few of a recurring per-request message through, then ever fewer (the
/// 16th, 32nd, 64th...), so a guest cannot flood the log.
#[derive(Debug, Default)]
struct LogThrottle {
    seen: u64,
}

impl LogThrottle {
    fn allow(&mut self) -> bool {
        self.seen = self.seen.saturating_add(1);
        self.seen <= 8 || self.seen.is_power_of_two()
    }
}

/// Where the random bytes come from.
#[derive(Debug)]
enum EntropySource {
    Getrandom,
    File { file: File, path: PathBuf },
}

impl EntropySource {
    fn open(path: &Path) -> Result<Self, RngError> {
        // O_NONBLOCK: opening a FIFO must not wait for a writer, and a device that has no
        // bytes yet answers EAGAIN instead of stalling the worker.
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open(path)
            .map_err(|source| RngError::Open {
                path: path.to_path_buf(),
                source,
            })?;
        let file_type = file
            .metadata()
            .map_err(|source| RngError::Open {
                path: path.to_path_buf(),
                source,
            })?
            .file_type();
        let refuse = |kind| RngError::WouldBlock {
            path: path.to_path_buf(),
            kind,
        };
        if file_type.is_dir() {
            return Err(RngError::Directory {
                path: path.to_path_buf(),
            });
        }
        if file_type.is_fifo() {
            return Err(refuse("FIFO"));
        }
        if file_type.is_socket() {
            return Err(refuse("socket"));
        }
        Ok(EntropySource::File {
            file,
            path: path.to_path_buf(),
        })
    }

    /// Fills as much of `buf` as the source gives without waiting; fewer bytes (maybe none)
    /// at the end of a file or when a device has none ready.
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let mut filled = 0;
        while filled < buf.len() {
            let result = match self {
                EntropySource::Getrandom => {
                    let rest = &mut buf[filled..];
                    // SAFETY: the pointer and length describe `rest`, which is writable
                    // and lives across the call; getrandom writes at most that many bytes.
                    let got = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
                    if got < 0 {
                        Err(std::io::Error::last_os_error())
                    } else {
                        Ok(got as usize)
                    }
                }
                EntropySource::File { file, .. } => file.read(&mut buf[filled..]),
            };
            match result {
                Ok(0) => break,
                Ok(got) => filled += got,
                Err(error) if error.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(error) if filled == 0 => return Err(error),
                Err(_) => break,
            }
        }
        Ok(filled)
    }

    fn describe(&self) -> String {
        match self {
            EntropySource::Getrandom => "getrandom".to_string(),
            EntropySource::File { path, .. } => path.display().to_string(),
        }
    }
}

/// What outlives one activation: the source and the limiter (its tokens too).
#[derive(Debug)]
struct Backend {
    source: EntropySource,
    limiter: RateLimiter,
    source_log: LogThrottle,
}

impl Backend {
    fn new(config: &RngConfig) -> Result<Self, RngError> {
        let source = match &config.source {
            Some(path) => EntropySource::open(path)?,
            None => EntropySource::Getrandom,
        };
        Ok(Backend {
            source,
            limiter: RateLimiter::new(config.rate_limiter)?,
            source_log: LogThrottle::default(),
        })
    }

    /// Writes up to `len` random bytes through `writer` (`buffer` holds at least `len`);
    /// returns how many went into the guest's buffers. Tokens for bytes the source did not
    /// give are refunded.
    fn fill(&mut self, buffer: &mut [u8], writer: &mut Writer<'_>, len: usize) -> u32 {
        let chunk = &mut buffer[..len];
        let got = match self.source.read(chunk) {
            Ok(got) => got,
            Err(error) => {
                if self.source_log.allow() {
                    log::error!(
                        "{DEVICE_NAME}: reading {} failed: {error}",
                        self.source.describe()
                    );
                }
                0
            }
        };
        if got < len {
            self.limiter.refund((len - got) as u64, 0);
            if got == 0 && self.source_log.allow() {
                log::warn!(
                    "{DEVICE_NAME}: {} gave no bytes (end of file, or none ready); answering with 0 bytes",
                    self.source.describe()
                );
            }
        }
        if let Err(error) = writer.write_all(&chunk[..got]) {
            if self.source_log.allow() {
                log::error!("{DEVICE_NAME}: writing into the guest's buffer failed: {error}");
            }
        }
        // At most MAX_REQUEST_BYTES.
        writer.bytes_written() as u32
    }
}

/// The device's serving state on its worker thread.
struct RngHandler {
    backend: Backend,
    queue: Queue,
    kick: EventFd,
    memory: GuestMemory,
    interrupt: Arc<dyn VirtioInterrupt>,
    /// Host-side staging for one request's bytes, MAX_REQUEST_BYTES long.
    buffer: Vec<u8>,
    chain_log: LogThrottle,
}

/// How a pass over the available ring ended.
#[derive(Debug, PartialEq, Eq)]
enum Pass {
    /// The ring is empty.
    Drained,
    /// The limiter has no tokens: the timer brings the worker back.
    Blocked,
    /// MAX_CHAINS_PER_WAKE reached: more may be waiting.
    Yielded,
    /// The available index is invalid: nothing can be taken until the driver fixes it.
    Broken,
}

impl RngHandler {
    fn position(&self) -> QueuePosition {
        QueuePosition {
            next_avail: self.queue.next_avail(),
            next_used: self.queue.next_used(),
        }
    }

    /// Serves what the driver made available, then interrupts it if it wants to hear.
    fn process_queue(&mut self) {
        let mut served = 0usize;
        let mut returned_any = false;
        let mut empty_rounds = 0;
        let pass = loop {
            let served_before = served;
            // Suppress kicks while the ring is being drained; with EVENT_IDX this is a no-op.
            if let Err(error) = self.queue.disable_notification(&self.memory) {
                if self.chain_log.allow() {
                    log::warn!("{DEVICE_NAME}: cannot disable notifications: {error}");
                }
            }
            let pass = self.serve_available(&mut served, &mut returned_any);
            if pass == Pass::Broken {
                // Let the driver kick again once it has fixed its index.
                let _ = self.queue.enable_notification(&self.memory);
            }
            if pass != Pass::Drained {
                break pass;
            }
            if served == served_before {
                empty_rounds += 1;
            }
            match self.queue.enable_notification(&self.memory) {
                // The ring says more is there, but twice nothing could be taken (its
                // entries cannot be read): wait for the next kick rather than spin.
                Ok(true) if empty_rounds >= 2 => break Pass::Drained,
                // Buffers arrived while notifications were off: serve them too.
                Ok(true) => continue,
                Ok(false) => break Pass::Drained,
                Err(error) => {
                    if self.chain_log.allow() {
                        log::warn!("{DEVICE_NAME}: cannot enable notifications: {error}");
                    }
                    break Pass::Drained;
                }
            }
        };
        if pass == Pass::Yielded {
            // Come back after the loop has looked at its other events (a stop request).
            if let Err(error) = self.kick.write(1) {
                log::error!("{DEVICE_NAME}: cannot reschedule the queue: {error}");
            }
        }
        if returned_any {
            self.notify();
        }
    }

    fn serve_available(&mut self, served: &mut usize, returned_any: &mut bool) -> Pass {
        loop {
            if self.backend.limiter.is_blocked() {
                return Pass::Blocked;
            }
            if *served >= MAX_CHAINS_PER_WAKE {
                return Pass::Yielded;
            }
            if !self.avail_index_is_valid() {
                return Pass::Broken;
            }
            let Some(chain) = self.queue.pop_descriptor_chain(&self.memory) else {
                return Pass::Drained;
            };
            *served += 1;
            let head = chain.head_index();
            if head >= self.queue.size() {
                // Nothing to return it to (add_used would refuse it, and log every time).
                if self.chain_log.allow() {
                    log::warn!("{DEVICE_NAME}: the driver offered descriptor {head}, past the queue's end; dropping it");
                }
                continue;
            }
            let mut writer = match chain.writer(&self.memory) {
                Ok(writer) => Some(writer),
                Err(error) => {
                    if self.chain_log.allow() {
                        log::warn!(
                            "{DEVICE_NAME}: bad descriptor chain {head}: {error}; answering with 0 bytes"
                        );
                    }
                    None
                }
            };
            let len = writer
                .as_ref()
                .map_or(0, |w| w.available_bytes().min(MAX_REQUEST_BYTES));
            // Every request costs an operation, a bad one too.
            if !self.backend.limiter.consume(len as u64, 1) {
                self.queue.go_to_previous_position();
                return Pass::Blocked;
            }
            let written = match &mut writer {
                Some(writer) if len > 0 => self.backend.fill(&mut self.buffer, writer, len),
                _ => {
                    if writer.is_some() && self.chain_log.allow() {
                        log::warn!(
                            "{DEVICE_NAME}: descriptor chain {head} has no device-writable buffer; answering with 0 bytes"
                        );
                    }
                    0
                }
            };
            match self.queue.add_used(&self.memory, head, written) {
                Ok(()) => *returned_any = true,
                Err(error) => {
                    if self.chain_log.allow() {
                        log::warn!("{DEVICE_NAME}: cannot return descriptor chain {head}: {error}");
                    }
                }
            }
        }
    }

    /// Whether the driver's available index is at most a queue's length ahead of the
    /// device's (virtio-queue refuses it otherwise, logging on every try).
    fn avail_index_is_valid(&mut self) -> bool {
        let valid = match self.queue.avail_idx(&self.memory, Ordering::Acquire) {
            Ok(avail) => (avail - Wrapping(self.queue.next_avail())).0 <= self.queue.size(),
            Err(_) => false,
        };
        if !valid && self.chain_log.allow() {
            log::warn!(
                "{DEVICE_NAME}: the available ring's index is invalid or unreadable; ignoring the queue until the next kick"
            );
        }
        valid
    }

    fn notify(&mut self) {
        match self.queue.needs_notification(&self.memory) {
            Ok(false) => {}
            Ok(true) => {
                if let Err(error) = self.interrupt.signal_queue(0) {
                    log::error!("{DEVICE_NAME}: cannot interrupt the driver: {error}");
                }
            }
            Err(error) => {
                // Interrupting once too often is harmless; missing one could stall the driver.
                if self.chain_log.allow() {
                    log::warn!("{DEVICE_NAME}: cannot read used_event: {error}");
                }
                if let Err(error) = self.interrupt.signal_queue(0) {
                    log::error!("{DEVICE_NAME}: cannot interrupt the driver: {error}");
                }
            }
        }
    }

    fn on_kick(&mut self) {
        // Non-blocking or readable (epoll said so); the count itself does not matter.
        let _ = self.kick.read();
        self.process_queue();
    }

    fn on_timer(&mut self) {
        self.backend.limiter.on_timer();
        self.process_queue();
    }
}

impl WorkerHandler for RngHandler {
    fn register(&mut self, control: &EventControl) -> std::io::Result<()> {
        control.add(self.kick.as_raw_fd(), KICK_TOKEN)?;
        control.add(self.backend.limiter.timer_fd(), TIMER_TOKEN)?;
        // Serve what the driver queued before the worker (re)started, kick or no kick
        // (this runs on the I/O thread).
        self.kick.write(1)
    }

    fn handle_event(&mut self, token: u64, _events: EventSet, _control: &EventControl) {
        match token {
            KICK_TOKEN => self.on_kick(),
            TIMER_TOKEN => self.on_timer(),
            other => log::error!("{DEVICE_NAME}: event for unknown token {other}"),
        }
    }
}

/// Where the device stands.
enum State {
    /// Not activated (or reset): the backend waits in `Rng::backend`.
    Idle,
    Running(Worker<RngHandler>),
    Paused(Box<RngHandler>),
}

/// The device's own snapshot state: the limits in force (a PATCH may have changed them).
#[derive(Debug, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RngState {
    rate_limiter: RateLimiterConfig,
}

/// The virtio entropy device.
pub struct Rng {
    config: RngConfig,
    /// The source and limiter while no worker holds them; `None` if a worker thread
    /// panicked with them (the next activation opens the source again).
    backend: Option<Backend>,
    state: State,
}

impl Rng {
    /// Opens the source (refusing directories, FIFOs, sockets and what cannot be read) and
    /// makes the rate limiter.
    pub fn new(config: RngConfig) -> Result<Rng, RngError> {
        let backend = Backend::new(&config)?;
        Ok(Rng {
            config,
            backend: Some(backend),
            state: State::Idle,
        })
    }

    /// The configuration, with the rate limits in force.
    pub fn config(&self) -> &RngConfig {
        &self.config
    }

    /// Changes the rate limits; a running device's worker is stopped after its current
    /// request, given the new limits and started again.
    pub fn update_rate_limiter(&mut self, limits: RateLimiterConfig) -> Result<(), RngError> {
        limits.validate()?;
        match std::mem::replace(&mut self.state, State::Idle) {
            State::Idle => {
                if let Some(backend) = &mut self.backend {
                    backend.limiter.update(limits)?;
                }
            }
            State::Paused(mut handler) => {
                let result = handler.backend.limiter.update(limits);
                self.state = State::Paused(handler);
                result?;
            }
            State::Running(worker) => {
                let Some(mut handler) = worker.stop() else {
                    log::error!("{DEVICE_NAME}: its I/O thread had stopped; the device stays stopped until reset");
                    self.config.rate_limiter = limits;
                    return Ok(());
                };
                let result = handler.backend.limiter.update(limits);
                let worker = Worker::spawn(THREAD_NAME, handler).map_err(RngError::Thread)?;
                self.state = State::Running(worker);
                result?;
            }
        }
        self.config.rate_limiter = limits;
        Ok(())
    }

    /// Stops the worker (if any) and gives its handler back.
    fn stop_worker(&mut self) -> Option<RngHandler> {
        match std::mem::replace(&mut self.state, State::Idle) {
            State::Idle => None,
            State::Paused(handler) => Some(*handler),
            State::Running(worker) => {
                let handler = worker.stop();
                if handler.is_none() {
                    log::error!("{DEVICE_NAME}: its I/O thread panicked");
                }
                handler
            }
        }
    }

    fn spawn(&mut self, handler: RngHandler) -> Result<(), ActivateError> {
        let worker =
            Worker::spawn(THREAD_NAME, handler).map_err(|error| ActivateError::Thread {
                device: DEVICE_NAME,
                source: error.into(),
            })?;
        self.state = State::Running(worker);
        Ok(())
    }
}

impl VirtioDevice for Rng {
    fn name(&self) -> &str {
        DEVICE_NAME
    }

    fn device_type(&self) -> u32 {
        VIRTIO_ID_RNG
    }

    fn queue_max_sizes(&self) -> Vec<u16> {
        vec![QUEUE_MAX_SIZE]
    }

    fn device_features(&self) -> u64 {
        (1 << VIRTIO_RING_F_EVENT_IDX) | (1 << VIRTIO_RING_F_INDIRECT_DESC)
    }

    fn read_config(&self, _offset: u64, data: &mut [u8]) {
        // virtio-rng has no configuration space.
        data.fill(0);
    }

    fn write_config(&mut self, offset: u64, data: &[u8]) {
        log::debug!(
            "{DEVICE_NAME}: ignoring a {}-byte write at {offset:#x} of its (empty) configuration space",
            data.len()
        );
    }

    fn activate(&mut self, activation: Activation) -> Result<(), ActivateError> {
        // A second activation without a reset: start over from the first's backend.
        self.reset();
        let given = activation.queues.iter().filter(|q| q.is_some()).count();
        let Some(Some(active)) = activation.queues.into_iter().next() else {
            return Err(ActivateError::QueueCount {
                device: DEVICE_NAME,
                given,
                needed: 1,
            });
        };
        let backend = match self.backend.take() {
            Some(backend) => backend,
            None => Backend::new(&self.config).map_err(|error| ActivateError::Device {
                device: DEVICE_NAME,
                message: error.to_string(),
            })?,
        };
        let mut queue = active.queue;
        queue.set_event_idx(activation.acked_features & (1 << VIRTIO_RING_F_EVENT_IDX) != 0);
        let handler = RngHandler {
            backend,
            queue,
            kick: active.kick,
            memory: activation.memory,
            interrupt: activation.interrupt,
            buffer: vec![0; MAX_REQUEST_BYTES],
            chain_log: LogThrottle::default(),
        };
        self.spawn(handler)
    }

    fn reset(&mut self) {
        if let Some(handler) = self.stop_worker() {
            self.backend = Some(handler.backend);
        }
    }

    fn pause(&mut self) -> Vec<Option<QueuePosition>> {
        match std::mem::replace(&mut self.state, State::Idle) {
            State::Idle => Vec::new(),
            State::Paused(handler) => {
                let position = handler.position();
                self.state = State::Paused(handler);
                vec![Some(position)]
            }
            State::Running(worker) => match worker.stop() {
                Some(handler) => {
                    let position = handler.position();
                    self.state = State::Paused(Box::new(handler));
                    vec![Some(position)]
                }
                None => {
                    log::error!(
                        "{DEVICE_NAME}: its I/O thread panicked; the queue position is lost"
                    );
                    vec![None]
                }
            },
        }
    }

    fn resume(&mut self) -> Result<(), ActivateError> {
        match std::mem::replace(&mut self.state, State::Idle) {
            State::Paused(handler) => self.spawn(*handler),
            other => {
                self.state = other;
                Ok(())
            }
        }
    }

    fn save_state(&self) -> serde_json::Value {
        serde_json::to_value(RngState {
            rate_limiter: self.config.rate_limiter,
        })
        .unwrap_or(serde_json::Value::Null)
    }

    fn restore_state(&mut self, state: &serde_json::Value) -> Result<(), String> {
        let state: RngState = serde_json::from_value(state.clone())
            .map_err(|error| format!("{DEVICE_NAME}: the saved state does not fit: {error}"))?;
        if state.rate_limiter != self.config.rate_limiter {
            self.update_rate_limiter(state.rate_limiter)
                .map_err(|error| format!("{DEVICE_NAME}: the saved rate limits: {error}"))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::ActiveQueue;
    use crate::rate_limiter::TokenBucketConfig;
    use std::sync::{Condvar, Mutex};
    use std::time::{Duration, Instant};
    use virtio_bindings::bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
    use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::{Address, Bytes, GuestAddress};
    use vmm_sys_util::eventfd::EFD_NONBLOCK;

    const MEMORY_SIZE: usize = 0x10_0000;
    const BUFFERS: u64 = 0x1_0000;
    const QUEUE_SIZE: u16 = 16;
    /// MockSplitQueue puts its used ring over the end of its available ring (it takes the
    /// ring's length in entries for bytes), so the queues here use their own used ring.
    const USED_RING: u64 = 0x2000;
    const WRITE: u16 = VRING_DESC_F_WRITE as u16;
    const NEXT: u16 = VRING_DESC_F_NEXT as u16;

    /// Counts queue interrupts and lets a test wait for them.
    #[derive(Default)]
    struct RecordingInterrupt {
        queue_signals: Mutex<Vec<u16>>,
        signalled: Condvar,
    }

    impl RecordingInterrupt {
        fn count(&self) -> usize {
            self.queue_signals.lock().unwrap().len()
        }

        fn wait_for(&self, count: usize) -> bool {
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut signals = self.queue_signals.lock().unwrap();
            while signals.len() < count {
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return false;
                }
                signals = self.signalled.wait_timeout(signals, left).unwrap().0;
            }
            assert!(signals.iter().all(|&queue| queue == 0));
            true
        }
    }

    impl VirtioInterrupt for RecordingInterrupt {
        fn signal_queue(&self, queue_index: u16) -> std::io::Result<()> {
            self.queue_signals.lock().unwrap().push(queue_index);
            self.signalled.notify_all();
            Ok(())
        }

        fn signal_config(&self) -> std::io::Result<()> {
            panic!("virtio-rng has no configuration to change");
        }
    }

    fn memory() -> GuestMemory {
        GuestMemory::from_ranges(&[(GuestAddress(0), MEMORY_SIZE)]).unwrap()
    }

    fn desc(addr: u64, len: u32, flags: u16, next: u16) -> RawDescriptor {
        RawDescriptor::from(SplitDescriptor::new(addr, len, flags, next))
    }

    fn handler(
        memory: &GuestMemory,
        vq: &MockSplitQueue<GuestMemory>,
        config: &RngConfig,
    ) -> (RngHandler, Arc<RecordingInterrupt>) {
        let interrupt = Arc::new(RecordingInterrupt::default());
        let handler = RngHandler {
            backend: Backend::new(config).unwrap(),
            queue: queue_for(vq),
            kick: EventFd::new(EFD_NONBLOCK).unwrap(),
            memory: memory.clone(),
            interrupt: interrupt.clone(),
            buffer: vec![0; MAX_REQUEST_BYTES],
            chain_log: LogThrottle::default(),
        };
        (handler, interrupt)
    }

    fn queue_for(vq: &MockSplitQueue<GuestMemory>) -> Queue {
        let mut queue: Queue = vq.create_queue().unwrap();
        queue.set_used_ring_address(Some(USED_RING as u32), Some(0));
        queue
    }

    /// The used ring's index and its entries as (head, length).
    fn used(memory: &GuestMemory) -> (u16, Vec<(u32, u32)>) {
        let idx = u16::from_le(memory.read_obj(GuestAddress(USED_RING + 2)).unwrap());
        let entries = (0..u64::from(idx.min(QUEUE_SIZE)))
            .map(|i| {
                let entry = GuestAddress(USED_RING + 4 + 8 * i);
                let id = u32::from_le(memory.read_obj(entry).unwrap());
                let len = u32::from_le(memory.read_obj(entry.unchecked_add(4)).unwrap());
                (id, len)
            })
            .collect();
        (idx, entries)
    }

    fn read(memory: &GuestMemory, addr: u64, len: usize) -> Vec<u8> {
        let mut bytes = vec![0; len];
        memory.read_slice(&mut bytes, GuestAddress(addr)).unwrap();
        bytes
    }

    fn ops_limited(size: u64, refill_time_ms: u64) -> RngConfig {
        RngConfig {
            source: None,
            rate_limiter: RateLimiterConfig {
                bandwidth: None,
                ops: Some(TokenBucketConfig {
                    size,
                    one_time_burst: 0,
                    refill_time_ms,
                }),
            },
        }
    }

    #[test]
    fn fills_every_writable_descriptor_of_a_chain() {
        let memory = memory();
        let vq = MockSplitQueue::new(&memory, QUEUE_SIZE);
        // Chain 0: three writable buffers; chain 3: one.
        vq.add_desc_chains(
            &[
                desc(BUFFERS, 100, WRITE | NEXT, 1),
                desc(BUFFERS + 0x1000, 200, WRITE | NEXT, 2),
                desc(BUFFERS + 0x2000, 300, WRITE, 0),
                desc(BUFFERS + 0x3000, 64, WRITE, 0),
            ],
            0,
        )
        .unwrap();
        let (mut handler, interrupt) = handler(&memory, &vq, &RngConfig::default());
        handler.process_queue();
        assert_eq!(used(&memory), (2, vec![(0, 600), (3, 64)]));
        for (addr, len) in [
            (BUFFERS, 100),
            (BUFFERS + 0x1000, 200),
            (BUFFERS + 0x2000, 300),
        ] {
            let bytes = read(&memory, addr, len);
            assert!(bytes.iter().any(|&b| b != 0), "{addr:#x} is all zero");
            // Nothing past the buffer was written.
            assert_eq!(read(&memory, addr + len as u64, 16), vec![0; 16]);
        }
        assert_ne!(
            read(&memory, BUFFERS, 100),
            read(&memory, BUFFERS + 0x1000, 100)
        );
        assert_eq!(interrupt.count(), 1);
        assert_eq!(
            handler.position(),
            QueuePosition {
                next_avail: 2,
                next_used: 2
            }
        );
    }

    #[test]
    fn a_read_only_buffer_gets_zero_bytes_and_stays_untouched() {
        let memory = memory();
        let vq = MockSplitQueue::new(&memory, QUEUE_SIZE);
        memory
            .write_slice(&[0xaa; 64], GuestAddress(BUFFERS))
            .unwrap();
        vq.add_desc_chains(
            &[
                desc(BUFFERS, 64, 0, 0),
                // Readable then writable: only the writable part is filled.
                desc(BUFFERS + 0x1000, 32, NEXT, 2),
                desc(BUFFERS + 0x2000, 48, WRITE, 0),
            ],
            0,
        )
        .unwrap();
        let (mut handler, interrupt) = handler(&memory, &vq, &RngConfig::default());
        handler.process_queue();
        assert_eq!(used(&memory), (2, vec![(0, 0), (1, 48)]));
        assert_eq!(read(&memory, BUFFERS, 64), vec![0xaa; 64]);
        assert_eq!(read(&memory, BUFFERS + 0x1000, 32), vec![0; 32]);
        assert_eq!(interrupt.count(), 1);
    }

    #[test]
    fn a_request_is_capped() {
        let memory = memory();
        let vq = MockSplitQueue::new(&memory, QUEUE_SIZE);
        vq.add_desc_chains(&[desc(BUFFERS, 0x8_0000, WRITE, 0)], 0)
            .unwrap();
        let (mut handler, _) = handler(&memory, &vq, &RngConfig::default());
        handler.process_queue();
        assert_eq!(used(&memory), (1, vec![(0, MAX_REQUEST_BYTES as u32)]));
        let past = BUFFERS + MAX_REQUEST_BYTES as u64;
        assert_eq!(read(&memory, past, 4096), vec![0; 4096]);
    }

    /// Stores descriptors at their table indices and offers `heads` in the available ring.
    fn offer(vq: &MockSplitQueue<GuestMemory>, descs: &[(u16, RawDescriptor)], heads: &[u16]) {
        for (index, desc) in descs {
            vq.desc_table().store(*index, *desc).unwrap();
        }
        for head in heads {
            let idx = vq.avail().idx().load();
            vq.avail()
                .ring()
                .ref_at((idx % QUEUE_SIZE) as usize)
                .unwrap()
                .store(u16::to_le(*head));
            vq.avail().idx().store(idx.wrapping_add(1));
        }
    }

    #[test]
    fn hostile_chains_neither_panic_nor_hang() {
        let memory = memory();
        let vq = MockSplitQueue::new(&memory, QUEUE_SIZE);
        let end = MEMORY_SIZE as u64;
        offer(
            &vq,
            &[
                // Outside guest memory.
                (0, desc(end + 0x1000, 64, WRITE, 0)),
                // Across the end of guest memory.
                (1, desc(end - 16, 64, WRITE, 0)),
                // u32::MAX bytes.
                (2, desc(BUFFERS, u32::MAX, WRITE, 0)),
                // 3 -> 4 -> 3 ...: a loop, bounded by the queue size.
                (3, desc(BUFFERS + 0x1000, 100, WRITE | NEXT, 4)),
                (4, desc(BUFFERS + 0x2000, 100, WRITE | NEXT, 3)),
                // Next points outside the table.
                (5, desc(BUFFERS + 0x3000, 8, WRITE | NEXT, 999)),
                // An indirect table outside memory.
                (6, desc(end * 4, 64, VRING_DESC_F_INDIRECT_FLAG, 0)),
            ],
            // And a head past the table.
            &[0, 1, 2, 3, 5, 6, 1000],
        );
        let (mut handler, interrupt) = handler(&memory, &vq, &RngConfig::default());
        handler.process_queue();
        let (idx, entries) = used(&memory);
        // Every chain with a head inside the table came back; head 1000 could not.
        assert_eq!(idx, 6, "{entries:?}");
        assert_eq!(
            entries,
            vec![
                (0, 0),
                (1, 0),
                (2, 0),
                // The loop ends after QUEUE_SIZE descriptors.
                (3, 100 * QUEUE_SIZE as u32),
                // A bad next index ends the chain after its first descriptor.
                (5, 8),
                (6, 0),
            ]
        );
        assert_eq!(read(&memory, BUFFERS, 64), vec![0; 64]);
        assert_eq!(interrupt.count(), 1);
        assert_eq!(handler.position().next_avail, 7);

        // An available index too far ahead of the device's: nothing is served, nothing hangs.
        let avail_idx = vq.avail().idx().load();
        vq.avail().idx().store(avail_idx.wrapping_add(1000));
        memory
            .write_obj(
                u16::to_le(VRING_USED_F_NO_NOTIFY_FLAG),
                GuestAddress(USED_RING),
            )
            .unwrap();
        handler.process_queue();
        assert_eq!(used(&memory).0, 6);
        assert_eq!(interrupt.count(), 1);
        // Kicks stay enabled, so a driver that fixes its index is heard.
        let flags: u16 = memory.read_obj(GuestAddress(USED_RING)).unwrap();
        assert_eq!(u16::from_le(flags), 0);
        vq.avail().idx().store(avail_idx);
        offer(&vq, &[(7, desc(BUFFERS, 4, WRITE, 0))], &[7]);
        handler.on_kick();
        assert_eq!(used(&memory).0, 7);
    }

    const VRING_USED_F_NO_NOTIFY_FLAG: u16 =
        virtio_bindings::bindings::virtio_ring::VRING_USED_F_NO_NOTIFY as u16;

    const VRING_DESC_F_INDIRECT_FLAG: u16 =
        virtio_bindings::bindings::virtio_ring::VRING_DESC_F_INDIRECT as u16;

    #[test]
    fn a_rate_limited_device_serves_what_the_bucket_allows_until_the_timer_fires() {
        let memory = memory();
        let vq = MockSplitQueue::new(&memory, QUEUE_SIZE);
        let chains: Vec<RawDescriptor> = (0..4)
            .map(|i| desc(BUFFERS + i * 0x1000, 16, WRITE, 0))
            .collect();
        vq.add_desc_chains(&chains, 0).unwrap();
        // Two requests at once, then one per 500 ms.
        let (mut handler, interrupt) = handler(&memory, &vq, &ops_limited(2, 1000));
        handler.process_queue();
        assert_eq!(used(&memory), (2, vec![(0, 16), (1, 16)]));
        assert!(handler.backend.limiter.is_blocked());
        // The refused chain went back to the ring.
        assert_eq!(
            handler.position(),
            QueuePosition {
                next_avail: 2,
                next_used: 2
            }
        );
        assert_eq!(interrupt.count(), 1);
        // A kick while blocked serves nothing.
        handler.on_kick();
        assert_eq!(used(&memory).0, 2);
        // After the timer fires, the third goes, and the fourth waits again.
        let mut poll = libc::pollfd {
            fd: handler.backend.limiter.timer_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, and the count says one.
        assert_eq!(unsafe { libc::poll(&mut poll, 1, 5000) }, 1, "no timer");
        handler.on_timer();
        assert_eq!(used(&memory), (3, vec![(0, 16), (1, 16), (2, 16)]));
        assert!(handler.backend.limiter.is_blocked());
        assert_eq!(interrupt.count(), 2);
    }

    #[test]
    fn a_bandwidth_limit_is_charged_per_byte() {
        let memory = memory();
        let vq = MockSplitQueue::new(&memory, QUEUE_SIZE);
        let chains: Vec<RawDescriptor> = (0..3)
            .map(|i| desc(BUFFERS + i * 0x1000, 40, WRITE, 0))
            .collect();
        vq.add_desc_chains(&chains, 0).unwrap();
        let config = RngConfig {
            source: None,
            rate_limiter: RateLimiterConfig {
                bandwidth: Some(TokenBucketConfig {
                    size: 100,
                    one_time_burst: 0,
                    refill_time_ms: 100_000,
                }),
                ops: None,
            },
        };
        let (mut handler, _) = handler(&memory, &vq, &config);
        handler.process_queue();
        assert_eq!(used(&memory), (2, vec![(0, 40), (1, 40)]));
        assert!(handler.backend.limiter.is_blocked());
    }

    #[test]
    fn a_regular_file_source_is_read_then_answers_zero_bytes_at_its_end() {
        let dir = std::env::temp_dir().join(format!("gpuvm-rng-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("entropy");
        let content: Vec<u8> = (1..=150u8).collect();
        std::fs::write(&path, &content).unwrap();

        let memory = memory();
        let vq = MockSplitQueue::new(&memory, QUEUE_SIZE);
        let chains: Vec<RawDescriptor> = (0..3)
            .map(|i| desc(BUFFERS + i * 0x1000, 100, WRITE, 0))
            .collect();
        vq.add_desc_chains(&chains, 0).unwrap();
        let config = RngConfig {
            source: Some(path.clone()),
            rate_limiter: RateLimiterConfig::default(),
        };
        let (mut handler, _) = handler(&memory, &vq, &config);
        handler.process_queue();
        assert_eq!(used(&memory), (3, vec![(0, 100), (1, 50), (2, 0)]));
        assert_eq!(read(&memory, BUFFERS, 100), content[..100]);
        assert_eq!(read(&memory, BUFFERS + 0x1000, 50), content[100..]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn unusable_sources_are_refused() {
        let dir = std::env::temp_dir().join(format!("gpuvm-rng-refuse-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let source = |path: &Path| RngConfig {
            source: Some(path.to_path_buf()),
            rate_limiter: RateLimiterConfig::default(),
        };
        let error = Rng::new(source(&dir)).err().unwrap();
        assert!(matches!(error, RngError::Directory { .. }), "{error}");

        let fifo = dir.join("fifo");
        let c_path = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
        // Opening it does not wait for a writer, and it is refused.
        let error = Rng::new(source(&fifo)).err().unwrap();
        assert!(
            matches!(error, RngError::WouldBlock { kind: "FIFO", .. }),
            "{error}"
        );

        let missing = dir.join("missing");
        let error = Rng::new(source(&missing)).err().unwrap();
        assert!(matches!(error, RngError::Open { .. }), "{error}");
        assert!(error.to_string().contains("missing"));

        let error = Rng::new(RngConfig {
            source: None,
            rate_limiter: RateLimiterConfig {
                bandwidth: Some(TokenBucketConfig::default()),
                ops: None,
            },
        })
        .err()
        .unwrap();
        assert!(matches!(error, RngError::RateLimiter(_)), "{error}");

        assert!(Rng::new(source(Path::new("/dev/urandom"))).is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn config_refuses_unknown_fields() {
        let config: RngConfig = serde_json::from_str(r#"{"source": "/dev/urandom"}"#).unwrap();
        assert_eq!(config.source.as_deref(), Some(Path::new("/dev/urandom")));
        assert_eq!(config.rate_limiter, RateLimiterConfig::default());
        assert!(serde_json::from_str::<RngConfig>(r#"{"src": "/dev/urandom"}"#).is_err());
    }

    fn activation_for(
        memory: &GuestMemory,
        vq: &MockSplitQueue<GuestMemory>,
        acked_features: u64,
    ) -> (Activation, EventFd, Arc<RecordingInterrupt>) {
        let kick = EventFd::new(EFD_NONBLOCK).unwrap();
        let trigger = kick.try_clone().unwrap();
        let interrupt = Arc::new(RecordingInterrupt::default());
        let activation = Activation {
            memory: memory.clone(),
            acked_features,
            queues: vec![Some(ActiveQueue {
                queue: queue_for(vq),
                kick,
            })],
            interrupt: interrupt.clone(),
        };
        (activation, trigger, interrupt)
    }

    #[test]
    fn the_device_serves_on_its_worker_and_pauses_resumes_resets() {
        let memory = memory();
        let vq = MockSplitQueue::new(&memory, QUEUE_SIZE);
        let mut rng = Rng::new(RngConfig::default()).unwrap();
        assert_eq!(rng.device_type(), 4);
        assert_eq!(rng.queue_max_sizes(), vec![256]);
        assert!(rng.pause().is_empty());
        let mut config = [0xff; 8];
        rng.read_config(0, &mut config);
        assert_eq!(config, [0; 8]);

        // A request queued before activation is served without a kick.
        vq.add_desc_chains(&[desc(BUFFERS, 32, WRITE, 0)], 0)
            .unwrap();
        let (activation, kick, interrupt) = activation_for(&memory, &vq, 0);
        rng.activate(activation).unwrap();
        assert!(interrupt.wait_for(1), "no interrupt");
        assert_eq!(used(&memory), (1, vec![(0, 32)]));

        // A kicked request.
        vq.add_desc_chains(&[desc(BUFFERS + 0x1000, 48, WRITE, 0)], 1)
            .unwrap();
        kick.write(1).unwrap();
        assert!(interrupt.wait_for(2), "no interrupt");
        assert_eq!(used(&memory), (2, vec![(0, 32), (1, 48)]));

        // Paused: nothing is served.
        assert_eq!(
            rng.pause(),
            vec![Some(QueuePosition {
                next_avail: 2,
                next_used: 2
            })]
        );
        vq.add_desc_chains(&[desc(BUFFERS + 0x2000, 16, WRITE, 0)], 2)
            .unwrap();
        kick.write(1).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(used(&memory).0, 2);
        assert_eq!(
            rng.save_state(),
            serde_json::json!({"rate_limiter": {"bandwidth": null, "ops": null}})
        );
        // Resumed: the request queued meanwhile is served.
        rng.resume().unwrap();
        assert!(interrupt.wait_for(3), "no interrupt");
        assert_eq!(used(&memory).0, 3);

        // Reset, then activate again from a fresh queue.
        rng.reset();
        assert!(rng.pause().is_empty());
        let memory2 = self::memory();
        let vq2 = MockSplitQueue::new(&memory2, QUEUE_SIZE);
        vq2.add_desc_chains(&[desc(BUFFERS, 8, WRITE, 0)], 0)
            .unwrap();
        let (activation, _kick, interrupt) = activation_for(&memory2, &vq2, 0);
        rng.activate(activation).unwrap();
        assert!(interrupt.wait_for(1), "no interrupt");
        assert_eq!(used(&memory2), (1, vec![(0, 8)]));
        rng.reset();
    }

    #[test]
    fn activation_without_the_queue_is_refused() {
        let memory = memory();
        let mut rng = Rng::new(RngConfig::default()).unwrap();
        let activation = Activation {
            memory,
            acked_features: 0,
            queues: vec![None],
            interrupt: Arc::new(RecordingInterrupt::default()),
        };
        let error = rng.activate(activation).unwrap_err();
        assert!(
            matches!(
                error,
                ActivateError::QueueCount {
                    given: 0,
                    needed: 1,
                    ..
                }
            ),
            "{error}"
        );
    }

    #[test]
    fn event_idx_suppresses_interrupts_the_driver_did_not_ask_for() {
        let memory = memory();
        let vq = MockSplitQueue::new(&memory, QUEUE_SIZE);
        let mut rng = Rng::new(RngConfig::default()).unwrap();
        // used_event (after the avail ring) = 5: interrupt only once used passes 5.
        let used_event = vq.avail_addr().unchecked_add(4 + 2 * QUEUE_SIZE as u64);
        memory.write_obj(5u16.to_le(), used_event).unwrap();
        vq.add_desc_chains(&[desc(BUFFERS, 8, WRITE, 0)], 0)
            .unwrap();
        let (activation, kick, interrupt) =
            activation_for(&memory, &vq, 1 << VIRTIO_RING_F_EVENT_IDX);
        rng.activate(activation).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while used(&memory).0 < 1 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(used(&memory).0, 1);
        // Give a stray interrupt time to show.
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(interrupt.count(), 0);
        // The device asked to be kicked at the next available index.
        let avail_event = GuestAddress(USED_RING + 4 + 8 * QUEUE_SIZE as u64);
        assert_eq!(
            u16::from_le(memory.read_obj::<u16>(avail_event).unwrap()),
            1
        );
        // Five more: used goes 1 -> 6, crossing used_event + 1 = 6.
        let chains: Vec<RawDescriptor> = (1..6)
            .map(|i| desc(BUFFERS + i * 0x1000, 8, WRITE, 0))
            .collect();
        vq.add_desc_chains(&chains, 1).unwrap();
        kick.write(1).unwrap();
        let ok = interrupt.wait_for(1);
        assert!(ok, "no interrupt; used {:?}", used(&memory));
        assert_eq!(used(&memory).0, 6);
        rng.reset();
    }

    #[test]
    fn limits_change_on_a_running_device_and_survive_a_snapshot() {
        let memory = memory();
        let vq = MockSplitQueue::new(&memory, QUEUE_SIZE);
        // One request per 100 s: the second waits.
        let mut rng = Rng::new(ops_limited(1, 100_000)).unwrap();
        let chains: Vec<RawDescriptor> = (0..3)
            .map(|i| desc(BUFFERS + i * 0x1000, 8, WRITE, 0))
            .collect();
        vq.add_desc_chains(&chains, 0).unwrap();
        let (activation, _kick, interrupt) = activation_for(&memory, &vq, 0);
        rng.activate(activation).unwrap();
        assert!(interrupt.wait_for(1), "no interrupt");
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(used(&memory).0, 1);
        // Lifting the limit lets the waiting requests through.
        rng.update_rate_limiter(RateLimiterConfig::default())
            .unwrap();
        assert!(interrupt.wait_for(2), "no interrupt");
        assert_eq!(used(&memory).0, 3);
        assert_eq!(rng.config().rate_limiter, RateLimiterConfig::default());
        assert!(rng
            .update_rate_limiter(ops_limited(0, 1).rate_limiter)
            .is_err());

        let limits = ops_limited(7, 700).rate_limiter;
        rng.update_rate_limiter(limits).unwrap();
        rng.pause();
        let state = rng.save_state();
        rng.reset();
        let mut restored = Rng::new(RngConfig::default()).unwrap();
        restored.restore_state(&state).unwrap();
        assert_eq!(restored.config().rate_limiter, limits);
        assert!(restored
            .restore_state(&serde_json::json!({"rate_limiter": {}, "extra": 1}))
            .is_err());
        assert!(restored.restore_state(&serde_json::json!(null)).is_err());
        assert!(restored
            .restore_state(
                &serde_json::json!({"rate_limiter": {"ops": {"size": 0, "refill_time_ms": 1}}})
            )
            .is_err());
    }
}
