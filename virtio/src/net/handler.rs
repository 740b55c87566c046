//! The virtio-net I/O thread's state: every queue pair, the control queue, the rate
//! limiters, and which of their file descriptors the epoll loop waits on.

use std::io::Write as _;
use std::sync::Arc;

use virtio_bindings::virtio_net::{
    VIRTIO_NET_CTRL_MQ, VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET, VIRTIO_NET_ERR, VIRTIO_NET_OK,
};
use virtio_queue::{DescriptorChain, QueueT};
use vmm_sys_util::epoll::EventSet;

use super::datapath::{notify, LogThrottle, NetCounters, Pass, QueuePair};
use crate::device::{ActiveQueue, QueuePosition};
use crate::rate_limiter::RateLimiter;
use crate::worker::{EventControl, WorkerHandler};
use crate::{GuestMemory, VirtioInterrupt};

/// Tokens: three per pair (RX kick, TX kick, tap), then the device-wide ones.
const TOKENS_PER_PAIR: u64 = 3;
const CTRL_KICK: u64 = 1 << 32;
const RX_LIMITER_TIMER: u64 = CTRL_KICK + 1;
const TX_LIMITER_TIMER: u64 = CTRL_KICK + 2;

/// The control queue and its index among the device's queues.
pub(crate) struct ControlQueue {
    pub index: u16,
    pub queue: ActiveQueue,
}

/// What the worker thread owns while the device is active.
pub(crate) struct NetHandler {
    pub memory: GuestMemory,
    pub interrupt: Arc<dyn VirtioInterrupt>,
    pub pairs: Vec<QueuePair>,
    pub ctrl: Option<ControlQueue>,
    /// How many queues the driver set up (the length of the positions pause reports).
    pub queue_count: usize,
    pub rx_limiter: RateLimiter,
    pub tx_limiter: RateLimiter,
    pub counters: Arc<NetCounters>,
    pub log: LogThrottle,
    /// The epoll events each pair's tap is registered with (empty: not registered).
    registered: Vec<EventSet>,
}

impl NetHandler {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        name: &str,
        memory: GuestMemory,
        interrupt: Arc<dyn VirtioInterrupt>,
        pairs: Vec<QueuePair>,
        ctrl: Option<ControlQueue>,
        queue_count: usize,
        limiters: (RateLimiter, RateLimiter),
        counters: Arc<NetCounters>,
    ) -> Self {
        let registered = vec![EventSet::empty(); pairs.len()];
        NetHandler {
            memory,
            interrupt,
            pairs,
            ctrl,
            queue_count,
            rx_limiter: limiters.0,
            tx_limiter: limiters.1,
            counters,
            log: LogThrottle::new(name),
            registered,
        }
    }

    /// The number of pairs the driver uses.
    pub fn active_pairs(&self) -> u16 {
        self.pairs.iter().take_while(|pair| pair.enabled).count() as u16
    }

    /// Uses the first `count` pairs (read; [`NetHandler::sync_tap_queues`] attaches their tap
    /// queues and detaches the others, so the host steers no flow to them). Refused (false)
    /// if a pair in range lacks a queue.
    pub fn set_active_pairs(&mut self, count: u16) -> bool {
        let count = usize::from(count);
        if count == 0
            || count > self.pairs.len()
            || self.pairs[..count]
                .iter()
                .any(|pair| pair.rx.is_none() || pair.tx.is_none())
        {
            return false;
        }
        for (index, pair) in self.pairs.iter_mut().enumerate() {
            let enable = index < count;
            if enable && !pair.enabled {
                pair.rx_has_buffers = true;
            }
            pair.enabled = enable;
        }
        true
    }

    /// Attaches the tap queues of the enabled pairs and detaches the others (TUNSETQUEUE).
    /// Only on the I/O thread: activation runs on a vCPU thread, whose filter has no
    /// TUNSETQUEUE, so `register` applies what activation chose.
    fn sync_tap_queues(&mut self) {
        if self.pairs.len() < 2 {
            return;
        }
        for pair in &self.pairs {
            if let Err(error) = pair.tap.set_queue_enabled(pair.enabled) {
                // The pair works without it; the host may steer some flows to a queue
                // nobody reads.
                self.log.warn(format_args!("{error}"));
            }
        }
    }

    /// Where each queue stands, in queue order.
    pub fn positions(&self) -> Vec<Option<QueuePosition>> {
        let mut positions = vec![None; self.queue_count];
        let position = |queue: &ActiveQueue| QueuePosition {
            next_avail: queue.queue.next_avail(),
            next_used: queue.queue.next_used(),
        };
        let mut record = |index: u16, queue: Option<&ActiveQueue>| {
            if let (Some(slot), Some(queue)) = (positions.get_mut(usize::from(index)), queue) {
                *slot = Some(position(queue));
            }
        };
        for pair in &self.pairs {
            record(pair.rx_index, pair.rx.as_ref());
            record(pair.tx_index, pair.tx.as_ref());
        }
        if let Some(ctrl) = &self.ctrl {
            record(ctrl.index, Some(&ctrl.queue));
        }
        positions
    }

    /// Gives frames held for RX tokens to the guest (the device is pausing: nothing may stay
    /// half done in guest memory).
    pub fn release_held_frames(&mut self) {
        for pair in &mut self.pairs {
            if pair.release_held(&self.memory, &self.counters, &mut self.log) {
                notify_rx(pair, &self.memory, self.interrupt.as_ref(), &mut self.log);
            }
        }
    }

    pub fn process_rx(&mut self, index: usize) {
        let pair = &mut self.pairs[index];
        let pass = pair.process_rx(
            &self.memory,
            &mut self.rx_limiter,
            &self.counters,
            &mut self.log,
        );
        if pass.used {
            notify_rx(pair, &self.memory, self.interrupt.as_ref(), &mut self.log);
        }
        // More frames left at the budget: the tap stays readable, so epoll comes back.
    }

    pub fn process_tx(&mut self, index: usize) {
        let pair = &mut self.pairs[index];
        let pass: Pass = pair.process_tx(
            &self.memory,
            &mut self.tx_limiter,
            &self.counters,
            &mut self.log,
        );
        if pair.mmds_pending() {
            // MMDS answered: its frames go into the RX queue now.
            self.process_rx(index);
        }
        let pair = &mut self.pairs[index];
        let Some(tx) = pair.tx.as_mut() else {
            return;
        };
        if pass.used {
            notify(
                tx,
                pair.tx_index,
                &self.memory,
                self.interrupt.as_ref(),
                &mut self.log,
            );
        }
        if pass.more {
            // Nothing else would wake the loop for the chains left: kick ourselves, after
            // other events had their turn.
            if let Err(error) = tx.kick.write(1) {
                self.log
                    .warn(format_args!("cannot re-kick the TX queue: {error}"));
            }
        }
    }

    /// Serves the control queue: VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET; any other command (none of
    /// their features are offered) is answered VIRTIO_NET_ERR.
    pub fn process_ctrl(&mut self) {
        let Some(mut ctrl) = self.ctrl.take() else {
            return;
        };
        let mut used = false;
        // A second handle on the same regions, so chains do not borrow `self`.
        let memory = self.memory.clone();
        // The ring holds at most its size in chains; the bound only guards a driver that
        // refills it as fast as the device empties it.
        for _ in 0..usize::from(ctrl.queue.queue.size()) * 2 {
            let Some(chain) = ctrl.queue.queue.pop_descriptor_chain(&memory) else {
                break;
            };
            let head = chain.head_index();
            // The ack is the chain's last writable byte; without one the command is not
            // run (the driver could not learn its outcome).
            let ack_writer = chain
                .clone()
                .writer(&memory)
                .ok()
                .filter(|writer| writer.available_bytes() > 0)
                .and_then(|mut writer| writer.split_at(writer.available_bytes() - 1).ok());
            let written = match ack_writer {
                Some(mut ack_writer) => {
                    let ack = self.control_command(&memory, chain);
                    u32::from(ack_writer.write_all(&[ack]).is_ok())
                }
                None => 0,
            };
            if written == 0 {
                self.counters_invalid_chain();
                self.log
                    .warn(format_args!("control chain {head} has no room for the ack"));
            }
            if let Err(error) = ctrl.queue.queue.add_used(&self.memory, head, written) {
                self.log
                    .warn(format_args!("cannot return control chain {head}: {error}"));
            }
            used = true;
        }
        if used {
            notify(
                &mut ctrl.queue,
                ctrl.index,
                &self.memory,
                self.interrupt.as_ref(),
                &mut self.log,
            );
        }
        self.ctrl = Some(ctrl);
    }

    fn counters_invalid_chain(&self) {
        self.counters.count_invalid_chain();
    }

    fn control_command(
        &mut self,
        memory: &GuestMemory,
        chain: DescriptorChain<&GuestMemory>,
    ) -> u8 {
        let Ok(mut reader) = chain.reader(memory) else {
            self.counters_invalid_chain();
            return VIRTIO_NET_ERR as u8;
        };
        let Ok([class, command]) = reader.read_obj::<[u8; 2]>() else {
            self.counters_invalid_chain();
            return VIRTIO_NET_ERR as u8;
        };
        if u32::from(class) != VIRTIO_NET_CTRL_MQ
            || u32::from(command) != VIRTIO_NET_CTRL_MQ_VQ_PAIRS_SET
        {
            self.log.warn(format_args!(
                "control command class {class} command {command} is not supported"
            ));
            return VIRTIO_NET_ERR as u8;
        }
        let Ok(pairs) = reader.read_obj::<u16>().map(u16::from_le) else {
            self.counters_invalid_chain();
            return VIRTIO_NET_ERR as u8;
        };
        if self.set_active_pairs(pairs) {
            self.sync_tap_queues();
            log::info!("{}: the driver uses {pairs} queue pairs", self.log_name());
            VIRTIO_NET_OK as u8
        } else {
            self.log.warn(format_args!(
                "the driver asked for {pairs} queue pairs of {}",
                self.pairs.len()
            ));
            VIRTIO_NET_ERR as u8
        }
    }

    fn log_name(&self) -> &str {
        self.log.device()
    }

    /// Registers or changes the tap's epoll events to what its pair needs now.
    fn sync_tap(&mut self, index: usize, control: &EventControl) {
        let pair = &self.pairs[index];
        let mut wanted = EventSet::empty();
        if pair.wants_rx(&self.rx_limiter) {
            wanted |= EventSet::IN;
        }
        if pair.tx_waiting_for_tap && !pair.tap_broken {
            wanted |= EventSet::OUT;
        }
        let registered = self.registered[index];
        if wanted == registered {
            return;
        }
        let fd = std::os::fd::AsRawFd::as_raw_fd(&pair.tap);
        let token = index as u64 * TOKENS_PER_PAIR + 2;
        let result = if registered.is_empty() {
            control.add_with(fd, token, wanted)
        } else if wanted.is_empty() {
            control.remove(fd)
        } else {
            control.modify(fd, token, wanted)
        };
        match result {
            Ok(()) => self.registered[index] = wanted,
            Err(error) => self.log.warn(format_args!(
                "cannot change what the tap is watched for: {error}"
            )),
        }
    }

    fn sync_all(&mut self, control: &EventControl) {
        for index in 0..self.pairs.len() {
            self.sync_tap(index, control);
        }
    }

    fn tap_event(&mut self, index: usize, events: EventSet) {
        let pair = &mut self.pairs[index];
        if events.intersects(EventSet::ERROR | EventSet::HANG_UP) && !pair.tap_broken {
            // A tap whose interface was deleted polls as an error for good: stop watching it
            // rather than spin. TX still drains (its writes fail and are counted).
            pair.tap_broken = true;
            pair.tx_waiting_for_tap = false;
            log::error!(
                "{}: tap {} failed; no more frames from it",
                self.log.device(),
                pair.tap.name()
            );
        }
        if events.contains(EventSet::OUT) {
            pair.tx_waiting_for_tap = false;
            self.process_tx(index);
        }
        if events.contains(EventSet::IN) {
            self.process_rx(index);
        }
        if self.pairs[index].tap_broken {
            self.process_tx(index);
        }
    }
}

fn drain(queue: &ActiveQueue) {
    // A non-blocking eventfd: EAGAIN when it was already read, which is fine.
    let _ = queue.kick.read();
}

/// Interrupts the driver for `pair`'s RX queue, if it has one and wants to hear.
fn notify_rx(
    pair: &mut QueuePair,
    memory: &GuestMemory,
    interrupt: &dyn VirtioInterrupt,
    log: &mut LogThrottle,
) {
    if let Some(rx) = pair.rx.as_mut() {
        notify(rx, pair.rx_index, memory, interrupt, log);
    }
}

impl WorkerHandler for NetHandler {
    fn register(&mut self, control: &EventControl) -> std::io::Result<()> {
        self.registered
            .iter_mut()
            .for_each(|events| *events = EventSet::empty());
        for (index, pair) in self.pairs.iter().enumerate() {
            let base = index as u64 * TOKENS_PER_PAIR;
            for (queue, token) in [(&pair.rx, base), (&pair.tx, base + 1)] {
                if let Some(queue) = queue {
                    control.add(std::os::fd::AsRawFd::as_raw_fd(&queue.kick), token)?;
                    // Start with a pass over every queue: buffers may have arrived while the
                    // device was paused or before it was restored, with no kick to tell.
                    queue.kick.write(1)?;
                }
            }
        }
        if let Some(ctrl) = &self.ctrl {
            control.add(std::os::fd::AsRawFd::as_raw_fd(&ctrl.queue.kick), CTRL_KICK)?;
            ctrl.queue.kick.write(1)?;
        }
        for (limiter, token) in [
            (&self.rx_limiter, RX_LIMITER_TIMER),
            (&self.tx_limiter, TX_LIMITER_TIMER),
        ] {
            let fd = limiter.timer_fd();
            if fd >= 0 {
                control.add(fd, token)?;
            }
        }
        self.sync_tap_queues();
        self.sync_all(control);
        Ok(())
    }

    fn handle_event(&mut self, token: u64, events: EventSet, control: &EventControl) {
        match token {
            CTRL_KICK => {
                if let Some(ctrl) = &self.ctrl {
                    drain(&ctrl.queue);
                }
                self.process_ctrl();
                // Pairs may have been enabled or disabled.
                self.sync_all(control);
            }
            RX_LIMITER_TIMER => {
                self.rx_limiter.on_timer();
                for index in 0..self.pairs.len() {
                    self.process_rx(index);
                }
                self.sync_all(control);
            }
            TX_LIMITER_TIMER => {
                self.tx_limiter.on_timer();
                for index in 0..self.pairs.len() {
                    self.process_tx(index);
                }
                self.sync_all(control);
            }
            token if token < CTRL_KICK => {
                let index = (token / TOKENS_PER_PAIR) as usize;
                if index >= self.pairs.len() {
                    return;
                }
                match token % TOKENS_PER_PAIR {
                    0 => {
                        if let Some(rx) = &self.pairs[index].rx {
                            drain(rx);
                        }
                        let pair = &mut self.pairs[index];
                        pair.rx_has_buffers = true;
                        pair.rx_tap_failed = false;
                        self.process_rx(index);
                    }
                    1 => {
                        if let Some(tx) = &self.pairs[index].tx {
                            drain(tx);
                        }
                        self.process_tx(index);
                    }
                    _ => self.tap_event(index, events),
                }
                // The shared RX limiter may have blocked or a frame be held: other pairs'
                // taps must stop being watched too, or a readable one would spin the loop.
                self.sync_all(control);
            }
            _ => {}
        }
    }
}
