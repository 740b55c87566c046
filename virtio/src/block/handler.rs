//! The worker thread's side of the device: pops the queue, charges the rate limiter, runs
//! each request on a backend and completes it (status byte, used ring, interrupt).

use crate::queue::{pop_available, Available};
use std::os::fd::AsRawFd;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress, VolatileSlice};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::backend::{io_uring::Operation as RingOperation, needs_bounce, Completion, GuestCursor};
use super::backend::{IoUringBackend, SyncBackend};
use super::disk::Disk;
use super::request::{self, Geometry, Operation, Parsed, Segment, Status};
use super::{DRAIN_TIMEOUT, ID_BYTES, QUEUE_SIZE};
use crate::rate_limiter::RateLimiter;
use crate::worker::{EventControl, WorkerHandler};
use crate::{GuestMemory, LogSampler, QueuePosition, VirtioInterrupt};

const KICK: u64 = 1;
const COMPLETIONS: u64 = 2;
const RATE_LIMITER: u64 = 3;
const QUIESCE: u64 = 4;

/// The most chains one event serves before the worker comes back to its epoll (it kicks
/// itself to go on), so a guest that keeps the queue full cannot keep it from stopping.
const CHAINS_PER_EVENT: usize = 2 * QUEUE_SIZE as usize;

/// The device's end of the quiesce handshake: pause, reset and hot-swap ask the worker to
/// stop taking requests and finish those in flight *on its own thread* (the caller is often
/// a vCPU thread, whose seccomp filter has no io_uring), then stop the worker.
pub(crate) struct QuiesceRequest {
    request: EventFd,
    replies: Receiver<bool>,
}

/// The worker's end (travels with [`IoResources`]).
pub(crate) struct QuiesceReply {
    request: EventFd,
    replies: Sender<bool>,
}

/// A connected pair of handshake ends.
pub(crate) fn quiesce_channel() -> std::io::Result<(QuiesceRequest, QuiesceReply)> {
    let request = EventFd::new(EFD_NONBLOCK)?;
    let worker_side = request.try_clone()?;
    let (sender, receiver) = channel();
    Ok((
        QuiesceRequest {
            request,
            replies: receiver,
        },
        QuiesceReply {
            request: worker_side,
            replies: sender,
        },
    ))
}

impl QuiesceRequest {
    /// Asks the running worker to quiesce and waits at most `timeout` for it (a worker in a
    /// long synchronous request answers late). True when nothing is left in flight.
    pub fn quiesce(&self, name: &str, timeout: Duration) -> bool {
        // A reply to an earlier request that gave up waiting.
        while self.replies.try_recv().is_ok() {}
        if let Err(error) = self.request.write(1) {
            log::error!("{name}: cannot ask the I/O thread to quiesce: {error}");
            return false;
        }
        match self.replies.recv_timeout(timeout) {
            Ok(drained) => drained,
            Err(_) => {
                log::error!("{name}: the I/O thread did not quiesce within {timeout:?}");
                false
            }
        }
    }
}

/// What the device keeps across activations: the disk and how it is served.
pub(crate) struct IoResources {
    pub name: String,
    pub disk: Disk,
    pub sync: SyncBackend,
    pub ring: Option<IoUringBackend>,
    pub rate_limiter: RateLimiter,
    pub device_id: [u8; ID_BYTES],
    quiesce: QuiesceReply,
    /// O_DIRECT requests whose unaligned guest buffers went through the bounce buffer
    /// (tests).
    pub bounced: u64,
    bad_requests: LogSampler,
    discard_unsupported_logged: bool,
}

impl IoResources {
    pub fn new(
        name: String,
        disk: Disk,
        ring: Option<IoUringBackend>,
        rate_limiter: RateLimiter,
        device_id: [u8; ID_BYTES],
        quiesce: QuiesceReply,
    ) -> Self {
        IoResources {
            quiesce,
            name,
            disk,
            sync: SyncBackend::new(),
            ring,
            rate_limiter,
            device_id,
            bounced: 0,
            bad_requests: LogSampler::new(10),
            discard_unsupported_logged: false,
        }
    }

    fn geometry(&self) -> Geometry {
        Geometry {
            capacity_sectors: self.disk.capacity_sectors(),
            read_only: self.disk.read_only(),
        }
    }

    /// Runs a read, write or flush: queued on the ring (`None`: its completion comes
    /// later), or done now, straight between the file and guest memory. O_DIRECT requests
    /// whose guest buffers are not aligned go through the sync backend's aligned bounce
    /// buffer, whatever the engine.
    #[allow(clippy::too_many_arguments)]
    fn transfer(
        &mut self,
        operation: RingOperation,
        offset: u64,
        buffers: &[VolatileSlice],
        head: u16,
        status_addr: GuestAddress,
        used_len: u32,
    ) -> Option<std::io::Result<()>> {
        let direct = self.disk.direct();
        if let Some(ring) = &mut self.ring {
            if operation == RingOperation::Flush || IoUringBackend::takes(buffers, direct) {
                return ring
                    .push(
                        operation,
                        self.disk.file(),
                        offset,
                        buffers,
                        head,
                        status_addr,
                        used_len,
                    )
                    .err()
                    .map(Err);
            }
        }
        let file = self.disk.file();
        let bounce = operation != RingOperation::Flush && needs_bounce(buffers, direct);
        if bounce {
            self.bounced += 1;
        }
        Some(match operation {
            RingOperation::Read if bounce => self.sync.read_bounced(file, offset, buffers),
            RingOperation::Read => SyncBackend::read(file, offset, buffers),
            RingOperation::Write if bounce => self.sync.write_bounced(file, offset, buffers),
            RingOperation::Write => SyncBackend::write(file, offset, buffers),
            RingOperation::Flush => SyncBackend::flush(file),
        })
    }

    /// Logs a bad request: the first ten, then every power of two (a guest can send
    /// millions).
    fn log_bad_request(&mut self, what: &str, reason: &str) {
        if self.bad_requests.sample() {
            log::warn!(
                "{}: {what}: {reason} ({} bad requests so far)",
                self.name,
                self.bad_requests.count()
            );
        }
    }
}

/// The serving state while the device is active.
pub(crate) struct BlockHandler {
    pub io: IoResources,
    memory: Arc<GuestMemory>,
    queue: Queue,
    kick: EventFd,
    interrupt: Arc<dyn VirtioInterrupt>,
    needs_signal: bool,
    /// Set by a quiesce request: no new requests until the worker runs again.
    quiesced: bool,
}

impl BlockHandler {
    pub fn new(
        mut io: IoResources,
        memory: GuestMemory,
        queue: Queue,
        kick: EventFd,
        interrupt: Arc<dyn VirtioInterrupt>,
    ) -> Self {
        let memory = Arc::new(memory);
        if let Some(ring) = &mut io.ring {
            ring.attach_memory(Arc::clone(&memory));
        }
        BlockHandler {
            io,
            memory,
            queue,
            kick,
            interrupt,
            needs_signal: false,
            quiesced: false,
        }
    }

    /// Readies the handler for a (new) worker: takes requests again, forgets a quiesce
    /// request that came too late, and looks at the queue once it runs (requests the driver
    /// made available while the device was paused, or before a restore).
    fn prepare_to_run(&mut self) {
        self.quiesced = false;
        let _ = self.io.quiesce.request.read();
        self.kick_self();
    }

    fn kick_self(&self) {
        if let Err(error) = self.kick.write(1) {
            log::warn!("{}: cannot kick its own queue: {error}", self.io.name);
        }
    }

    pub fn position(&self) -> QueuePosition {
        QueuePosition {
            next_avail: self.queue.next_avail(),
            next_used: self.queue.next_used(),
        }
    }

    /// Waits at most `timeout` for the requests in flight on the ring and completes them;
    /// false if some were still in flight when it gave up. Runs on the worker thread.
    fn drain(&mut self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let memory = Arc::clone(&self.memory);
        let drained = loop {
            let Some(ring) = &mut self.io.ring else {
                break true;
            };
            if ring.in_flight() == 0 {
                break true;
            }
            let now = Instant::now();
            if now >= deadline {
                log::error!(
                    "{}: {} requests still in flight after {timeout:?}; they complete after resume",
                    self.io.name,
                    ring.in_flight()
                );
                break false;
            }
            ring.wait(deadline - now);
            self.reap(&memory);
        };
        self.signal_if_needed(&memory);
        drained
    }

    /// Hands the disk and backends back (after [`BlockHandler::drain`]).
    pub fn into_resources(self) -> IoResources {
        self.io
    }

    fn reap(&mut self, memory: &GuestMemory) {
        let Some(ring) = &mut self.io.ring else {
            return;
        };
        let mut finished = Vec::new();
        ring.reap(|completion| finished.push(completion));
        for completion in finished {
            self.finish(memory, completion);
        }
    }

    /// Serves the queue until it is empty, the rate limiter blocks, the ring is full, or
    /// this event's share of work is done.
    fn process_queue(&mut self) {
        let memory = Arc::clone(&self.memory);
        let memory = &*memory;
        if let Err(error) = self.queue.disable_notification(memory) {
            log::warn!("{}: cannot disable notifications: {error}", self.io.name);
        }
        // Until the ring is empty (notifications are on again then, with no race), broken
        // (until the next kick), or this event's share of work is done.
        self.serve_available(memory);
        if let Some(ring) = &mut self.io.ring {
            ring.submit();
        }
        self.signal_if_needed(memory);
    }

    /// Pops and runs chains until the queue is empty or the device must stop for now.
    fn serve_available(&mut self, memory: &GuestMemory) {
        let mut served = 0;
        loop {
            if self.quiesced || self.io.rate_limiter.is_blocked() {
                return;
            }
            if self.io.ring.as_ref().is_some_and(|ring| !ring.has_room()) {
                // A completion frees a slot and serves the queue again.
                return;
            }
            if served >= CHAINS_PER_EVENT {
                self.kick_self();
                return;
            }
            let chain = match pop_available(&mut self.queue, memory) {
                Available::Chain(chain) => chain,
                Available::Empty => return,
                Available::Broken(why) => {
                    // Waits for the driver's next kick rather than spin on the ring.
                    self.io.log_bad_request("queue", why);
                    return;
                }
            };
            let parsed = request::parse(chain, memory, self.io.geometry());
            if !self.io.rate_limiter.consume(parsed.data_bytes(), 1) {
                // Served again when the limiter's timer fires.
                self.queue.go_to_previous_position();
                return;
            }
            served += 1;
            self.run(memory, parsed);
        }
    }

    fn run(&mut self, memory: &GuestMemory, parsed: Parsed) {
        let request = match parsed {
            Parsed::Request(request) => request,
            Parsed::Refused {
                head,
                status_addr,
                status,
                reason,
            } => {
                self.io.log_bad_request("refused a request", &reason);
                self.finish(
                    memory,
                    Completion {
                        head,
                        status_addr,
                        status,
                        used_len: 1,
                    },
                );
                return;
            }
            Parsed::Dropped { head, reason } => {
                self.io
                    .log_bad_request("dropped a descriptor chain", &reason);
                if let Err(error) = self.queue.add_used(memory, head, 0) {
                    log::warn!("{}: cannot return chain {head}: {error}", self.io.name);
                }
                self.needs_signal = true;
                return;
            }
        };
        let (head, status_addr) = (request.head, request.status_addr);
        let done = |status: Status, used_len: u32| Completion {
            head,
            status_addr,
            status,
            used_len: if status == Status::Ok { used_len } else { 1 },
        };
        let io = &mut self.io;
        let transferred = match request.operation {
            Operation::Read {
                offset,
                len,
                buffers,
            } => {
                // len + 1 fits: the chain iterator stops at 4 GiB in all.
                let used_len = u32::try_from(len + 1).unwrap_or(u32::MAX);
                let result = io.transfer(
                    RingOperation::Read,
                    offset,
                    &buffers,
                    head,
                    status_addr,
                    used_len,
                );
                result.map(|result| (result, "read", used_len))
            }
            Operation::Write {
                offset, buffers, ..
            } => {
                let result =
                    io.transfer(RingOperation::Write, offset, &buffers, head, status_addr, 1);
                result.map(|result| (result, "write", 1))
            }
            Operation::Flush => {
                let result = io.transfer(RingOperation::Flush, 0, &[], head, status_addr, 1);
                result.map(|result| (result, "flush", 1))
            }
            Operation::GetId { buffers } => {
                let written = GuestCursor::new(&buffers).write_from(&io.device_id);
                Some((Ok(()), "get id", written as u32 + 1))
            }
            Operation::Discard(segments) => Some((discard(io, &segments), "discard", 1)),
            Operation::WriteZeroes(segments) => {
                Some((write_zeroes(io, &segments), "write zeroes", 1))
            }
        };
        // None: on the ring, its completion comes later.
        let Some((result, what, used_len)) = transferred else {
            return;
        };
        let completion = match result {
            Ok(()) => done(Status::Ok, used_len),
            Err(error) => {
                log::warn!("{}: {what} failed: {error}", io.name);
                done(Status::IoError, 1)
            }
        };
        self.finish(memory, completion);
    }

    /// Writes the status byte and puts the chain in the used ring.
    fn finish(&mut self, memory: &GuestMemory, completion: Completion) {
        if let Err(error) = memory.write_obj(completion.status as u8, completion.status_addr) {
            log::warn!(
                "{}: cannot write the status of chain {}: {error}",
                self.io.name,
                completion.head
            );
        }
        if let Err(error) = self
            .queue
            .add_used(memory, completion.head, completion.used_len)
        {
            log::warn!(
                "{}: cannot return chain {}: {error}",
                self.io.name,
                completion.head
            );
        }
        self.needs_signal = true;
    }

    fn signal_if_needed(&mut self, memory: &GuestMemory) {
        if !std::mem::take(&mut self.needs_signal) {
            return;
        }
        // An error reading the ring's event index errs on the side of an interrupt.
        if self.queue.needs_notification(memory).unwrap_or(true) {
            if let Err(error) = self.interrupt.signal_queue(0) {
                log::warn!("{}: cannot signal the queue: {error}", self.io.name);
            }
        }
    }
}

/// Deallocates the segments. A file system that cannot punch holes makes discard a no-op
/// (its data is unspecified after a discard anyway).
fn discard(io: &mut IoResources, segments: &[Segment]) -> std::io::Result<()> {
    for segment in segments {
        match io.disk.punch_hole(segment.offset, segment.len) {
            Ok(()) => {}
            Err(error) if error.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                if !std::mem::replace(&mut io.discard_unsupported_logged, true) {
                    log::info!(
                        "{}: the host file cannot punch holes; discard does nothing",
                        io.name
                    );
                }
            }
            Err(error) => return Err(error),
        }
    }
    Ok(())
}

/// Zeroes the segments: deallocating where the driver allows it (UNMAP) and the file
/// system can, zeroing in place otherwise.
fn write_zeroes(io: &mut IoResources, segments: &[Segment]) -> std::io::Result<()> {
    for segment in segments {
        if segment.unmap && io.disk.punch_hole(segment.offset, segment.len).is_ok() {
            continue;
        }
        let zeroes = io.sync.zeroes();
        io.disk.write_zeroes(segment.offset, segment.len, zeroes)?;
    }
    Ok(())
}

impl WorkerHandler for BlockHandler {
    fn register(&mut self, control: &EventControl) -> std::io::Result<()> {
        self.prepare_to_run();
        control.add(self.kick.as_raw_fd(), KICK)?;
        if let Some(ring) = &self.io.ring {
            control.add(ring.completion_fd(), COMPLETIONS)?;
        }
        control.add(self.io.quiesce.request.as_raw_fd(), QUIESCE)?;
        let timer = self.io.rate_limiter.timer_fd();
        if timer >= 0 {
            control.add(timer, RATE_LIMITER)?;
        }
        Ok(())
    }

    fn handle_event(&mut self, token: u64, _events: EventSet, _control: &EventControl) {
        match token {
            KICK => {
                // Non-blocking or not, it is readable: epoll said so.
                let _ = self.kick.read();
                self.process_queue();
            }
            COMPLETIONS => {
                let memory = Arc::clone(&self.memory);
                self.reap(&memory);
                // Slots were freed: serve what waited for them (and signal).
                self.process_queue();
            }
            RATE_LIMITER => {
                self.io.rate_limiter.on_timer();
                self.process_queue();
            }
            QUIESCE => {
                let _ = self.io.quiesce.request.read();
                self.quiesced = true;
                let drained = self.drain(DRAIN_TIMEOUT);
                let _ = self.io.quiesce.replies.send(drained);
            }
            other => log::error!("{}: event for unknown token {other}", self.io.name),
        }
    }
}
