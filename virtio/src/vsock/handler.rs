//! The device's serving state on its worker thread: the three virtqueues around the
//! [`Muxer`].
//!
//! Epoll tokens: the queue kicks are their queue indices (0 rx, 1 tx, 2 event), the host
//! listener 3, the timeout timer 4, host clients and connections 16 and up.

use crate::queue::{pop_available, Available};
use std::sync::Arc;

use virtio_queue::{DescriptorChain, Queue, QueueOwnedT, QueueT};
use virtio_vsock::packet::{VsockPacket, PKT_HEADER_SIZE};
use vmm_sys_util::epoll::EventSet;

use super::muxer::{LogLimiter, Muxer};
use super::packet::{MAX_PKT_DATA, VSOCK_EVENT_TRANSPORT_RESET};
use crate::worker::{EventControl, WorkerHandler};
use crate::{ActiveQueue, GuestMemory, QueuePosition, VirtioInterrupt};

/// Queue indices, which are also the kicks' epoll tokens.
pub const RX_QUEUE: u16 = 0;
pub const TX_QUEUE: u16 = 1;
pub const EVENT_QUEUE: u16 = 2;

pub struct VsockWorker {
    memory: GuestMemory,
    interrupt: Arc<dyn VirtioInterrupt>,
    rx: ActiveQueue,
    tx: ActiveQueue,
    event: ActiveQueue,
    muxer: Muxer,
    /// A TRANSPORT_RESET event waits for an event-queue buffer (after a restore).
    transport_reset_pending: bool,
    /// The tx queue waits until the guest reads the RSTs already queued.
    tx_stalled: bool,
    warnings: LogLimiter,
}

impl VsockWorker {
    pub fn new(
        memory: GuestMemory,
        interrupt: Arc<dyn VirtioInterrupt>,
        [rx, tx, event]: [ActiveQueue; 3],
        muxer: Muxer,
        transport_reset_pending: bool,
    ) -> Self {
        VsockWorker {
            memory,
            interrupt,
            rx,
            tx,
            event,
            muxer,
            transport_reset_pending,
            tx_stalled: false,
            warnings: LogLimiter::new(),
        }
    }

    /// Where each queue stands, in queue order.
    pub fn queue_positions(&self) -> Vec<Option<QueuePosition>> {
        [&self.rx, &self.tx, &self.event]
            .into_iter()
            .map(|active| {
                Some(QueuePosition {
                    next_avail: active.queue.next_avail(),
                    next_used: active.queue.next_used(),
                })
            })
            .collect()
    }

    #[cfg(test)]
    pub fn muxer(&self) -> &Muxer {
        &self.muxer
    }

    /// The muxer's connections and what waits for the guest, with duplicates of their
    /// sockets (a live update; the worker is stopped), and whether a TRANSPORT_RESET
    /// still waits for an event buffer.
    pub fn hand_over(
        &self,
    ) -> std::io::Result<(super::muxer::MuxerLive, Vec<std::os::fd::OwnedFd>, bool)> {
        let (live, fds) = self.muxer.hand_over()?;
        Ok((live, fds, self.transport_reset_pending))
    }

    fn notify(&mut self, index: u16) {
        let active = match index {
            RX_QUEUE => &mut self.rx,
            TX_QUEUE => &mut self.tx,
            _ => &mut self.event,
        };
        // If the ring cannot be read, interrupting is the safe side.
        let needed = active
            .queue
            .needs_notification(&self.memory)
            .unwrap_or(true);
        if needed {
            if let Err(error) = self.interrupt.signal_queue(index) {
                log::error!("virtio-vsock: cannot interrupt the guest for queue {index}: {error}");
            }
        }
    }

    fn add_used(&mut self, index: u16, head: u16, len: u32) {
        let active = match index {
            RX_QUEUE => &mut self.rx,
            TX_QUEUE => &mut self.tx,
            _ => &mut self.event,
        };
        if let Err(error) = active.queue.add_used(&self.memory, head, len) {
            if self.warnings.allow() {
                log::warn!("virtio-vsock: queue {index}: cannot return buffer {head}: {error}");
            }
        }
    }

    /// Hands every packet on the tx queue to the muxer.
    fn process_tx(&mut self, control: &EventControl) {
        self.tx_stalled = false;
        let mut used = false;
        loop {
            if self.muxer.rst_backlog_full() {
                self.tx_stalled = true;
                break;
            }
            let Some(mut chain) = pop_chain(
                &mut self.tx.queue,
                &self.memory,
                TX_QUEUE,
                &mut self.warnings,
            ) else {
                break;
            };
            let head = chain.head_index();
            match VsockPacket::from_tx_virtq_chain(&self.memory, &mut chain, MAX_PKT_DATA) {
                Ok(packet) => self.muxer.handle_guest_packet(&packet, control),
                Err(error) => {
                    if self.warnings.allow() {
                        log::warn!("virtio-vsock: dropping a bad tx buffer: {error}");
                    }
                }
            }
            self.add_used(TX_QUEUE, head, 0);
            used = true;
        }
        if used {
            self.notify(TX_QUEUE);
        }
    }

    /// Fills rx buffers while the muxer has packets for the guest; with none left in the
    /// queue, the rx kick brings the next ones.
    fn process_rx(&mut self, control: &EventControl) {
        let mut used = false;
        while self.muxer.has_rx_work() {
            let Some(mut chain) = pop_chain(
                &mut self.rx.queue,
                &self.memory,
                RX_QUEUE,
                &mut self.warnings,
            ) else {
                break;
            };
            let head = chain.head_index();
            let written =
                match VsockPacket::from_rx_virtq_chain(&self.memory, &mut chain, MAX_PKT_DATA) {
                    Ok(mut packet) => self.muxer.fill_rx(&mut packet, control),
                    Err(error) => {
                        if self.warnings.allow() {
                            log::warn!("virtio-vsock: dropping a bad rx buffer: {error}");
                        }
                        self.add_used(RX_QUEUE, head, 0);
                        used = true;
                        continue;
                    }
                };
            match written {
                Some(len) => {
                    self.add_used(RX_QUEUE, head, PKT_HEADER_SIZE as u32 + len);
                    used = true;
                }
                None => {
                    // Nothing for this buffer after all: it stays the guest's next one.
                    self.rx.queue.go_to_previous_position();
                    break;
                }
            }
        }
        if used {
            self.notify(RX_QUEUE);
        }
    }

    /// Puts the pending TRANSPORT_RESET event into the next event-queue buffer.
    fn send_transport_reset(&mut self) {
        let mut used = false;
        while self.transport_reset_pending {
            let Some(chain) = pop_chain(
                &mut self.event.queue,
                &self.memory,
                EVENT_QUEUE,
                &mut self.warnings,
            ) else {
                break;
            };
            let head = chain.head_index();
            let written = chain
                .writer(&self.memory)
                .map_err(|error| error.to_string())
                .and_then(|mut writer| {
                    writer
                        .write_obj(VSOCK_EVENT_TRANSPORT_RESET.to_le())
                        .map_err(|error| error.to_string())
                });
            match written {
                Ok(()) => {
                    self.add_used(EVENT_QUEUE, head, std::mem::size_of::<u32>() as u32);
                    self.transport_reset_pending = false;
                }
                Err(error) => {
                    log::warn!("virtio-vsock: bad event buffer: {error}");
                    self.add_used(EVENT_QUEUE, head, 0);
                }
            }
            used = true;
        }
        if used {
            self.notify(EVENT_QUEUE);
        }
    }
}

/// The next chain the driver made available on `queue`; `None` once there is none, or when
/// its available ring is unusable: an index more than a queue's length ahead of the device's,
/// or a ring from which nothing can be taken although its index says more is there (at
/// guest address 0, which virtio-queue treats as "not set up"). Such a ring is left alone
/// until the driver's next kick instead of being spun on, which would keep the worker from
/// ever returning to its loop (and a reset, which waits for it, from ever ending).
fn pop_chain<'m>(
    queue: &mut Queue,
    memory: &'m GuestMemory,
    index: u16,
    warnings: &mut LogLimiter,
) -> Option<DescriptorChain<&'m GuestMemory>> {
    match pop_available(queue, memory) {
        Available::Chain(chain) => Some(chain),
        Available::Empty => None,
        Available::Broken(why) => {
            if warnings.allow() {
                log::warn!("virtio-vsock: queue {index}: {why}; ignoring it until the next kick");
            }
            None
        }
    }
}

impl WorkerHandler for VsockWorker {
    fn register(&mut self, control: &EventControl) -> std::io::Result<()> {
        use std::os::fd::AsRawFd;
        control.add(self.rx.kick.as_raw_fd(), u64::from(RX_QUEUE))?;
        control.add(self.tx.kick.as_raw_fd(), u64::from(TX_QUEUE))?;
        control.add(self.event.kick.as_raw_fd(), u64::from(EVENT_QUEUE))?;
        self.muxer.register(control)?;
        // Work left from before a pause, and a pending TRANSPORT_RESET, start with a pass
        // over the queues.
        self.rx.kick.write(1)?;
        self.event.kick.write(1)?;
        Ok(())
    }

    fn handle_event(&mut self, token: u64, events: EventSet, control: &EventControl) {
        match token {
            token if token == u64::from(RX_QUEUE) => {
                let _ = self.rx.kick.read();
            }
            token if token == u64::from(TX_QUEUE) => {
                let _ = self.tx.kick.read();
                self.process_tx(control);
            }
            token if token == u64::from(EVENT_QUEUE) => {
                let _ = self.event.kick.read();
                self.send_transport_reset();
            }
            token => self.muxer.handle_event(token, events, control),
        }
        // Packets the event produced go out; RSTs that made the tx queue wait may have
        // drained.
        loop {
            self.process_rx(control);
            if !self.tx_stalled || self.muxer.rst_backlog_full() {
                break;
            }
            self.process_tx(control);
        }
    }
}
