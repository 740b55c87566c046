//! The balloon's serving state on its worker thread: frees the host memory behind inflated
//! pages, counts deflated ones, keeps the guest's statistics and asks for new ones on a timer.

use std::io::Read;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use virtio_queue::{DescriptorChain, QueueT};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::timerfd::TimerFd;

use super::device::BalloonCounters;
use super::{
    coalesce, discard, parse_stats, pfn_is_ram, GuestStats, DEFLATE_QUEUE, DEVICE_NAME,
    INFLATE_QUEUE, MAX_PFNS_PER_REQUEST, MAX_STAT_ENTRIES, QUEUE_MAX_SIZE, STATS_QUEUE,
    STAT_ENTRY_SIZE,
};
use crate::device::{ActiveQueue, QueuePosition, VirtioInterrupt};
use crate::queue::{pop_available, Available};
use crate::worker::{EventControl, WorkerHandler};
use crate::{GuestMemory, LogSampler};

const TIMER_TOKEN: u64 = 3;
/// The most chains served per queue per wake-up (a driver that keeps refilling a queue
/// cannot keep the worker from stopping).
const MAX_CHAINS_PER_WAKE: usize = 2 * QUEUE_MAX_SIZE as usize;

/// What the device and its worker share: the guest's statistics and the counters (read by
/// the VMM thread's queries), and the polling interval (set by PATCH).
pub(super) struct Shared {
    pub(super) stats: Option<GuestStats>,
    pub(super) counters: BalloonCounters,
    pub(super) interval_s: u16,
}

impl Shared {
    pub(super) fn new(interval_s: u16) -> Self {
        Shared {
            stats: None,
            counters: BalloonCounters::default(),
            interval_s,
        }
    }
}

/// Which queue a chain came from.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Inflate,
    Deflate,
}

pub(super) struct BalloonHandler {
    /// Indexed by queue: inflate, deflate, stats (None when not negotiated).
    queues: Vec<Option<ActiveQueue>>,
    memory: GuestMemory,
    interrupt: Arc<dyn VirtioInterrupt>,
    shared: Arc<Mutex<Shared>>,
    stats_timer: TimerFd,
    /// The statistics buffer the device keeps until it wants new statistics.
    held_stats_head: Option<u16>,
    log: LogSampler,
}

impl BalloonHandler {
    /// `queues`: inflate, deflate, and stats when negotiated.
    pub(super) fn new(
        queues: [Option<ActiveQueue>; 3],
        memory: GuestMemory,
        interrupt: Arc<dyn VirtioInterrupt>,
        shared: Arc<Mutex<Shared>>,
        stats_timer: TimerFd,
        held_stats_head: Option<u16>,
    ) -> Self {
        // A held statistics buffer only means something with a stats queue.
        let held_stats_head =
            held_stats_head.filter(|_| queues[usize::from(STATS_QUEUE)].is_some());
        BalloonHandler {
            queues: queues.into(),
            memory,
            interrupt,
            shared,
            stats_timer,
            held_stats_head,
            log: LogSampler::new(8),
        }
    }

    pub(super) fn held_stats_head(&self) -> Option<u16> {
        self.held_stats_head
    }

    pub(super) fn positions(&self) -> Vec<Option<QueuePosition>> {
        self.queues
            .iter()
            .map(|q| {
                q.as_ref().map(|q| QueuePosition {
                    next_avail: q.queue.next_avail(),
                    next_used: q.queue.next_used(),
                })
            })
            .collect()
    }

    /// Arms the statistics timer at the interval in force (periodic); `now` fires the first
    /// request at once (a new interval asks for fresh statistics right away).
    pub(super) fn rearm_stats_timer(&mut self, now: bool) {
        if self.queues[usize::from(STATS_QUEUE)].is_none() {
            return;
        }
        let interval_s = crate::lock(&self.shared).interval_s;
        let result = if interval_s == 0 {
            self.stats_timer.clear()
        } else {
            let period = Duration::from_secs(u64::from(interval_s));
            let first = if now {
                Duration::from_millis(1)
            } else {
                period
            };
            self.stats_timer.reset(first, Some(period))
        };
        if let Err(error) = result {
            log::error!("{DEVICE_NAME}: cannot set the statistics timer: {error}");
        }
    }

    fn refuse(&mut self, what: std::fmt::Arguments) {
        crate::lock(&self.shared).counters.refused_buffers += 1;
        if self.log.sample() {
            log::warn!("{DEVICE_NAME}: {what}");
        }
    }

    /// Serves queue `index`'s chains the driver made available, at most
    /// [`MAX_CHAINS_PER_WAKE`] a wake-up (the worker then kicks itself to come back for the
    /// rest after its other events), and interrupts the driver if any buffer went back.
    /// `read` makes each chain into what the queue carries; `serve` gets that and the
    /// chain's head and says whether it put a buffer in the used ring. A ring that cannot
    /// be served is refused as `{ring}: {why}`. The inflate, deflate and stats queues
    /// differ only in these.
    fn serve_queue<T>(
        &mut self,
        index: u16,
        ring: &dyn std::fmt::Display,
        read: fn(DescriptorChain<&GuestMemory>, &GuestMemory) -> Result<T, String>,
        mut serve: impl FnMut(&mut Self, &mut ActiveQueue, u16, Result<T, String>) -> bool,
    ) {
        let Some(mut active) = self.queues[usize::from(index)].take() else {
            return;
        };
        let _ = active.kick.read();
        let mut returned = false;
        for served in 0.. {
            if served >= MAX_CHAINS_PER_WAKE {
                let _ = active.kick.write(1);
                break;
            }
            let chain = match pop_available(&mut active.queue, &self.memory) {
                Available::Chain(chain) => chain,
                Available::Empty => break,
                Available::Broken(why) => {
                    self.refuse(format_args!("{ring}: {why}"));
                    break;
                }
            };
            let head = chain.head_index();
            let content = read(chain, &self.memory);
            returned |= serve(self, &mut active, head, content);
        }
        if returned {
            signal_used(&self.memory, self.interrupt.as_ref(), index, &mut active);
        }
        self.queues[usize::from(index)] = Some(active);
    }

    /// Serves inflate or deflate chains until the queue is empty.
    fn process_pages(&mut self, index: u16, kind: Kind) {
        self.serve_queue(
            index,
            &format_args!("queue {index}"),
            read_pfns,
            |handler, active, head, pfns| {
                match pfns {
                    Ok(pfns) => handler.apply(kind, pfns),
                    Err(why) => handler.refuse(format_args!("queue {index}: buffer {head}: {why}")),
                }
                if head >= active.queue.size() {
                    return false;
                }
                match active.queue.add_used(&handler.memory, head, 0) {
                    Ok(()) => true,
                    Err(error) => {
                        handler
                            .refuse(format_args!("queue {index}: cannot return {head}: {error}"));
                        false
                    }
                }
            },
        );
    }

    /// Frees (inflate) or counts (deflate) the valid pages; PFNs outside guest RAM are
    /// refused and counted.
    fn apply(&mut self, kind: Kind, mut pfns: Vec<u32>) {
        let before = pfns.len();
        let memory = &self.memory;
        pfns.retain(|&pfn| pfn_is_ram(memory, pfn));
        let refused = (before - pfns.len()) as u64;
        if refused > 0 {
            crate::lock(&self.shared).counters.refused_pfns += refused;
            if self.log.sample() {
                log::warn!(
                    "{DEVICE_NAME}: refused {refused} page frame number(s) outside guest RAM"
                );
            }
        }
        let runs = coalesce(&mut pfns);
        let pages: u64 = runs.iter().map(|run| run.pages).sum();
        let mut errors = 0u64;
        if kind == Kind::Inflate {
            for run in &runs {
                if let Err(error) = discard(&self.memory, *run) {
                    errors += 1;
                    if self.log.sample() {
                        log::warn!(
                            "{DEVICE_NAME}: cannot free {} page(s) at pfn {:#x}: {error}",
                            run.pages,
                            run.first_pfn
                        );
                    }
                }
            }
        }
        let mut shared = crate::lock(&self.shared);
        shared.counters.discard_errors += errors;
        match kind {
            Kind::Inflate => shared.counters.inflated_pages += pages,
            Kind::Deflate => shared.counters.deflated_pages += pages,
        }
    }

    /// The guest sent (or resent) its statistics buffer: keep what it says, and keep the
    /// buffer until the timer asks for new statistics.
    fn process_stats(&mut self) {
        self.serve_queue(
            STATS_QUEUE,
            &"stats queue",
            read_stats,
            |handler, active, head, stats| {
                match stats {
                    Ok(stats) => crate::lock(&handler.shared).stats = Some(stats),
                    Err(why) => handler.refuse(format_args!("stats buffer {head}: {why}")),
                }
                if head >= active.queue.size() {
                    return false;
                }
                // A driver keeps one buffer here; a second one is returned at once.
                handler
                    .held_stats_head
                    .replace(head)
                    .is_some_and(|previous| {
                        active.queue.add_used(&handler.memory, previous, 0).is_ok()
                    })
            },
        );
    }

    /// The polling interval passed: give the statistics buffer back, asking for new ones.
    fn on_timer(&mut self) {
        let _ = self.stats_timer.wait();
        let Some(head) = self.held_stats_head.take() else {
            return;
        };
        let Some(active) = self.queues[usize::from(STATS_QUEUE)].as_mut() else {
            return;
        };
        match active.queue.add_used(&self.memory, head, 0) {
            Ok(()) => signal_used(&self.memory, self.interrupt.as_ref(), STATS_QUEUE, active),
            Err(error) => self.refuse(format_args!("cannot return stats buffer {head}: {error}")),
        }
    }
}

/// Tells the driver that queue `index` (`active`) has new used buffers, unless it asked
/// not to be. The caller passes the queue it holds: the handlers take a queue out of
/// `BalloonHandler::queues` while serving it, so looking it up there would find nothing
/// and lose the interrupt (which a driver that sleeps until its buffer comes back, such as
/// Linux's, waits for forever).
fn signal_used(
    memory: &GuestMemory,
    interrupt: &dyn VirtioInterrupt,
    index: u16,
    active: &mut ActiveQueue,
) {
    // Interrupting once too often is harmless; missing one could stall the driver.
    if active.queue.needs_notification(memory).unwrap_or(true) {
        if let Err(error) = interrupt.signal_queue(index) {
            log::error!("{DEVICE_NAME}: cannot interrupt the driver: {error}");
        }
    }
}

/// Reads a buffer of little-endian u32 PFNs: at most [`MAX_PFNS_PER_REQUEST`], whole PFNs.
fn read_pfns(
    chain: DescriptorChain<&GuestMemory>,
    memory: &GuestMemory,
) -> Result<Vec<u32>, String> {
    let mut reader = chain.reader(memory).map_err(|e| e.to_string())?;
    let len = reader.available_bytes();
    if len > MAX_PFNS_PER_REQUEST * 4 {
        return Err(format!(
            "{len} bytes is more than {MAX_PFNS_PER_REQUEST} page frame numbers"
        ));
    }
    if !len.is_multiple_of(4) {
        return Err(format!("{len} bytes is not a whole number of 4-byte PFNs"));
    }
    let mut bytes = vec![0u8; len];
    reader.read_exact(&mut bytes).map_err(|e| e.to_string())?;
    Ok(bytes
        .chunks_exact(4)
        .map(|pfn| u32::from_le_bytes([pfn[0], pfn[1], pfn[2], pfn[3]]))
        .collect())
}

/// Reads a statistics buffer (see [`parse_stats`]).
fn read_stats(
    chain: DescriptorChain<&GuestMemory>,
    memory: &GuestMemory,
) -> Result<GuestStats, String> {
    let mut reader = chain.reader(memory).map_err(|e| e.to_string())?;
    let len = reader.available_bytes();
    if len > MAX_STAT_ENTRIES * STAT_ENTRY_SIZE {
        return Err(format!(
            "{len} bytes is more than {MAX_STAT_ENTRIES} entries"
        ));
    }
    let mut bytes = vec![0u8; len];
    reader.read_exact(&mut bytes).map_err(|e| e.to_string())?;
    parse_stats(&bytes)
}

const INFLATE_TOKEN: u64 = INFLATE_QUEUE as u64;
const DEFLATE_TOKEN: u64 = DEFLATE_QUEUE as u64;
const STATS_TOKEN: u64 = STATS_QUEUE as u64;

impl WorkerHandler for BalloonHandler {
    fn register(&mut self, control: &EventControl) -> std::io::Result<()> {
        for (token, active) in self.queues.iter().enumerate() {
            if let Some(active) = active {
                control.add(active.kick.as_raw_fd(), token as u64)?;
                // Serve what the driver queued before the worker (re)started.
                active.kick.write(1)?;
            }
        }
        if self.queues[usize::from(STATS_QUEUE)].is_some() {
            control.add(self.stats_timer.as_raw_fd(), TIMER_TOKEN)?;
            self.rearm_stats_timer(false);
        }
        Ok(())
    }

    fn handle_event(&mut self, token: u64, _events: EventSet, _control: &EventControl) {
        match token {
            INFLATE_TOKEN => self.process_pages(INFLATE_QUEUE, Kind::Inflate),
            DEFLATE_TOKEN => self.process_pages(DEFLATE_QUEUE, Kind::Deflate),
            STATS_TOKEN => self.process_stats(),
            TIMER_TOKEN => self.on_timer(),
            other => log::error!("{DEVICE_NAME}: event for unknown token {other}"),
        }
    }
}
