//! The entropy device's serving state on its worker thread: pops the queue, charges the
//! rate limiter and fills the driver's buffers.

use std::os::fd::AsRawFd;
use std::sync::Arc;

use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use super::source::{Backend, LOGGED_FIRST};
use super::{DEVICE_NAME, MAX_REQUEST_BYTES, QUEUE_MAX_SIZE};
use crate::device::{QueuePosition, VirtioInterrupt};
use crate::worker::{EventControl, WorkerHandler};
use crate::{GuestMemory, LogSampler};

/// The most chains served per wake-up before the worker yields to its other events (a
/// driver that keeps refilling the queue cannot keep the worker from stopping).
const MAX_CHAINS_PER_WAKE: usize = 4 * QUEUE_MAX_SIZE as usize;

const KICK_TOKEN: u64 = 0;
const TIMER_TOKEN: u64 = 1;

/// The device's serving state on its worker thread.
pub(super) struct RngHandler {
    pub(super) backend: Backend,
    queue: Queue,
    kick: EventFd,
    memory: GuestMemory,
    interrupt: Arc<dyn VirtioInterrupt>,
    /// Host-side staging for one request's bytes, MAX_REQUEST_BYTES long.
    buffer: Vec<u8>,
    chain_log: LogSampler,
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
    pub(super) fn new(
        backend: Backend,
        queue: Queue,
        kick: EventFd,
        memory: GuestMemory,
        interrupt: Arc<dyn VirtioInterrupt>,
    ) -> Self {
        RngHandler {
            backend,
            queue,
            kick,
            memory,
            interrupt,
            buffer: vec![0; MAX_REQUEST_BYTES],
            chain_log: LogSampler::new(LOGGED_FIRST),
        }
    }

    pub(super) fn position(&self) -> QueuePosition {
        QueuePosition {
            next_avail: self.queue.next_avail(),
            next_used: self.queue.next_used(),
        }
    }

    /// Serves what the driver made available, then interrupts it if it wants to hear.
    pub(super) fn process_queue(&mut self) {
        let mut served = 0usize;
        let mut returned_any = false;
        let mut empty_rounds = 0;
        let pass = loop {
            let served_before = served;
            // Suppress kicks while the ring is being drained; with EVENT_IDX this is a no-op.
            if let Err(error) = self.queue.disable_notification(&self.memory) {
                if self.chain_log.sample() {
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
                    if self.chain_log.sample() {
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
                if self.chain_log.sample() {
                    log::warn!("{DEVICE_NAME}: the driver offered descriptor {head}, past the queue's end; dropping it");
                }
                continue;
            }
            let mut writer = match chain.writer(&self.memory) {
                Ok(writer) => Some(writer),
                Err(error) => {
                    if self.chain_log.sample() {
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
                    if writer.is_some() && self.chain_log.sample() {
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
                    if self.chain_log.sample() {
                        log::warn!("{DEVICE_NAME}: cannot return descriptor chain {head}: {error}");
                    }
                }
            }
        }
    }

    /// Whether the driver's available index is at most a queue's length ahead of the
    /// device's (virtio-queue refuses it otherwise, logging on every try).
    fn avail_index_is_valid(&mut self) -> bool {
        let valid = crate::queue::available_index_is_valid(&self.queue, &self.memory);
        if !valid && self.chain_log.sample() {
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
                if self.chain_log.sample() {
                    log::warn!("{DEVICE_NAME}: cannot read used_event: {error}");
                }
                if let Err(error) = self.interrupt.signal_queue(0) {
                    log::error!("{DEVICE_NAME}: cannot interrupt the driver: {error}");
                }
            }
        }
    }

    pub(super) fn on_kick(&mut self) {
        // Non-blocking or readable (epoll said so); the count itself does not matter.
        let _ = self.kick.read();
        self.process_queue();
    }

    pub(super) fn on_timer(&mut self) {
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
