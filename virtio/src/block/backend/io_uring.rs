//! Asynchronous reads, writes and flushes through io_uring: each request becomes one
//! READV / WRITEV / FSYNC whose iovecs point straight into guest memory; the ring posts
//! completions to an eventfd the worker waits on.
//!
//! In flight: at most one request per queue entry (a slot each, `user_data` is the slot
//! index), holding the chain's head and status address until its completion comes back.
//! Flushes cover the writes that completed before them, which is what virtio-blk promises
//! (the driver waits for the writes it wants flushed before it sends the flush).

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use io_uring::{opcode, types, IoUring, Probe};
use vm_memory::{GuestAddress, VolatileSlice};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::{guest_iovecs, needs_bounce, total_len, Completion, MAX_IOVECS};
use crate::block::request::Status;
use crate::GuestMemory;

/// How long dropping the backend waits for requests still in flight.
const DROP_WAIT: Duration = Duration::from_secs(1);

/// What a request asks of the ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Operation {
    Read,
    Write,
    Flush,
}

/// The iovec array a READV / WRITEV points to; it lives in the request's slot until the
/// completion comes back. Never read by us: it only has to stay alive.
struct IoVecs(#[allow(dead_code)] Box<[libc::iovec]>);

// SAFETY: the iovecs point into guest memory, which every thread of the VMM may access; the
// array is only read by the kernel and dropped by the thread that owns the backend.
unsafe impl Send for IoVecs {}

struct InFlight {
    head: u16,
    status_addr: GuestAddress,
    /// The result a complete READV / WRITEV returns (0 for a flush).
    expected: u64,
    used_len: u32,
    _iovecs: Option<IoVecs>,
}

pub(crate) struct IoUringBackend {
    ring: IoUring,
    completions: EventFd,
    slots: Vec<Option<InFlight>>,
    free: Vec<u32>,
    /// Pushed to the submission queue and not yet submitted.
    unsubmitted: usize,
    /// Keeps guest memory mapped while requests that point into it are in flight.
    memory: Option<Arc<GuestMemory>>,
}

impl IoUringBackend {
    /// A ring for `capacity` requests in flight, with READV, WRITEV and FSYNC checked to be
    /// there and the completion eventfd registered. Fails where io_uring is not allowed
    /// (seccomp, container policy, kernel.io_uring_disabled) or too old.
    pub fn new(capacity: u16) -> std::io::Result<Self> {
        let capacity = capacity.max(1);
        let ring = IoUring::new(u32::from(capacity).next_power_of_two())?;
        let mut probe = Probe::new();
        ring.submitter().register_probe(&mut probe)?;
        for (code, name) in [
            (opcode::Readv::CODE, "READV"),
            (opcode::Writev::CODE, "WRITEV"),
            (opcode::Fsync::CODE, "FSYNC"),
        ] {
            if !probe.is_supported(code) {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::Unsupported,
                    format!("io_uring has no {name}"),
                ));
            }
        }
        let completions = EventFd::new(EFD_NONBLOCK)?;
        ring.submitter().register_eventfd(completions.as_raw_fd())?;
        Ok(IoUringBackend {
            ring,
            completions,
            slots: (0..capacity).map(|_| None).collect(),
            free: (0..u32::from(capacity)).rev().collect(),
            unsubmitted: 0,
            memory: None,
        })
    }

    /// Readable when completions are waiting for [`IoUringBackend::reap`].
    pub fn completion_fd(&self) -> std::os::fd::RawFd {
        self.completions.as_raw_fd()
    }

    /// Keeps `memory` mapped while requests point into it.
    pub fn attach_memory(&mut self, memory: Arc<GuestMemory>) {
        self.memory = Some(memory);
    }

    pub fn has_room(&self) -> bool {
        !self.free.is_empty()
    }

    pub fn in_flight(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// Whether a read or write of `buffers` can go to the ring as it is: few enough
    /// buffers, and aligned where the file is O_DIRECT.
    pub fn takes(buffers: &[VolatileSlice], direct: bool) -> bool {
        buffers.len() <= MAX_IOVECS && !needs_bounce(buffers, direct)
    }

    /// Queues one request; [`IoUringBackend::submit`] hands it to the kernel. Call only
    /// with [`IoUringBackend::has_room`] and buffers [`IoUringBackend::takes`] accepts.
    #[allow(clippy::too_many_arguments)]
    pub fn push(
        &mut self,
        operation: Operation,
        file: &File,
        offset: u64,
        buffers: &[VolatileSlice],
        head: u16,
        status_addr: GuestAddress,
        used_len: u32,
    ) -> std::io::Result<()> {
        let slot = self
            .free
            .pop()
            .ok_or_else(|| std::io::Error::other("no free io_uring slot"))?;
        let fd = types::Fd(file.as_raw_fd());
        let (entry, iovecs, expected) = match operation {
            Operation::Flush => (
                opcode::Fsync::new(fd)
                    .flags(types::FsyncFlags::DATASYNC)
                    .build(),
                None,
                0,
            ),
            Operation::Read | Operation::Write => {
                let iovecs = guest_iovecs(buffers).into_boxed_slice();
                let expected = total_len(buffers);
                let count = iovecs.len() as u32;
                let entry = if operation == Operation::Read {
                    opcode::Readv::new(fd, iovecs.as_ptr(), count)
                        .offset(offset)
                        .build()
                } else {
                    opcode::Writev::new(fd, iovecs.as_ptr(), count)
                        .offset(offset)
                        .build()
                };
                (entry, Some(IoVecs(iovecs)), expected)
            }
        };
        let entry = entry.user_data(u64::from(slot));
        // SAFETY: the entry's iovec array is kept in the slot (a boxed slice does not move)
        // and the guest memory it points to stays mapped through `self.memory` until the
        // completion comes back and frees the slot; the file is referenced by the kernel
        // from submission on.
        let mut pushed = unsafe { self.ring.submission().push(&entry) }.is_ok();
        if !pushed {
            // The queue holds at most one entry per slot, so it is full only if submissions
            // failed earlier; try to make room once.
            self.submit();
            // SAFETY: as above.
            pushed = unsafe { self.ring.submission().push(&entry) }.is_ok();
        }
        if !pushed {
            self.free.push(slot);
            return Err(std::io::Error::other(
                "the io_uring submission queue is full",
            ));
        }
        self.slots[slot as usize] = Some(InFlight {
            head,
            status_addr,
            expected,
            used_len,
            _iovecs: iovecs,
        });
        self.unsubmitted += 1;
        Ok(())
    }

    /// Hands the queued requests to the kernel (one system call for a batch). A busy ring
    /// keeps them queued for the next call.
    pub fn submit(&mut self) {
        if self.unsubmitted == 0 {
            return;
        }
        match self.ring.submit() {
            Ok(submitted) => self.unsubmitted = self.unsubmitted.saturating_sub(submitted),
            Err(error)
                if matches!(
                    error.raw_os_error(),
                    Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::EBUSY)
                ) => {}
            Err(error) => log::error!("virtio-blk: io_uring submit failed: {error}"),
        }
    }

    /// Collects the completions that came back.
    pub fn reap(&mut self, mut done: impl FnMut(Completion)) {
        // Cleared before the queue is read: a completion posted after this signals again.
        let _ = self.completions.read();
        for entry in self.ring.completion() {
            let slot = entry.user_data() as usize;
            let Some(request) = self.slots.get_mut(slot).and_then(Option::take) else {
                log::error!("virtio-blk: io_uring completion for unknown slot {slot}");
                continue;
            };
            self.free.push(slot as u32);
            let result = entry.result();
            let status = if result < 0 {
                log::warn!(
                    "virtio-blk: request {} failed: {}",
                    request.head,
                    std::io::Error::from_raw_os_error(-result)
                );
                Status::IoError
            } else if result as u64 != request.expected {
                // A short read (the file shrank behind our back) or write (disk full).
                log::warn!(
                    "virtio-blk: request {}: {result} of {} bytes done",
                    request.head,
                    request.expected
                );
                Status::IoError
            } else {
                Status::Ok
            };
            done(Completion {
                head: request.head,
                status_addr: request.status_addr,
                status,
                used_len: if status == Status::Ok {
                    request.used_len
                } else {
                    1
                },
            });
        }
    }

    /// Submits what is queued and waits at most `timeout` for a completion (one
    /// io_uring_enter with a timeout, kernel 5.11 and later: the only system call the device
    /// thread's filter needs for it). On an older kernel it naps instead.
    pub fn wait(&mut self, timeout: Duration) {
        let timespec = types::Timespec::new()
            .sec(timeout.as_secs())
            .nsec(timeout.subsec_nanos());
        let args = types::SubmitArgs::new().timespec(&timespec);
        match self.ring.submitter().submit_with_args(1, &args) {
            Ok(submitted) => self.unsubmitted = self.unsubmitted.saturating_sub(submitted),
            Err(error)
                if matches!(
                    error.raw_os_error(),
                    Some(libc::ETIME) | Some(libc::EINTR) | Some(libc::EBUSY) | Some(libc::EAGAIN)
                ) => {}
            Err(error) => {
                log::debug!("virtio-blk: io_uring wait with a timeout failed ({error}), napping");
                self.submit();
                std::thread::sleep(timeout.min(Duration::from_millis(10)));
            }
        }
    }
}

impl Drop for IoUringBackend {
    fn drop(&mut self) {
        // The kernel may still write into guest memory for requests in flight; give them a
        // moment before the memory reference goes.
        let deadline = Instant::now() + DROP_WAIT;
        while self.in_flight() > 0 {
            let now = Instant::now();
            if now >= deadline {
                log::error!(
                    "virtio-blk: {} io_uring requests still in flight at teardown",
                    self.in_flight()
                );
                break;
            }
            self.wait(deadline - now);
            self.reap(|_| {});
        }
    }
}
