//! The lazy loader: serves userfaultfd faults from a snapshot chain while a background
//! thread streams everything else in.
//!
//! Design (after gVisor's asynchronous page loader, written from scratch):
//! - Guest RAM is cut into fixed chunks (`chunk_bytes`, 4 MiB by default) in linear page
//!   order, which is also file order, so loading chunks front to back is a sequential read.
//! - The **fault thread** polls the userfaultfd. For a fault it loads just that page (one
//!   small pread + `UFFDIO_COPY`, or a zero page for a hole) so the vCPU resumes quickly,
//!   then pushes the page's chunk to the front of the background queue: a guest touching
//!   an area usually touches its neighbours next.
//! - The **background thread** takes queued chunks first (faulted chunks, then the
//!   recorded working set), otherwise the next chunk in order; each chunk is one large
//!   pread per contiguous file range and one `UFFDIO_COPY` per run of missing pages.
//! - A shared bitmap marks loaded pages so nothing is copied twice; when the two paths
//!   race anyway the kernel answers EEXIST, which is harmless (see `ops`).
//! - Holes (pages no file stores) are never filled in the background: the memfd stays
//!   sparse. When every data page is in, the ranges are unregistered, so later first
//!   touches of holes are ordinary zero-fill faults.
//!
//! Here: the state the threads share and its bookkeeping. [`LazyOptions`] and
//! [`LazyRestore`] (the public handle) are in `options` and `restore`, the fault thread in
//! `fault`, the background loader's ordering and chunk loading in `background`.

mod background;
mod fault;
mod options;
mod restore;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use log::{debug, error, info, warn};
use userfaultfd::Uffd;
use vmm_sys_util::eventfd::EventFd;

use super::fence::RamFence;
use super::ops::Filled;
use super::{io_err, lock, UffdError};
use crate::snapshot::bits::AtomicBitmap;
use crate::snapshot::{PlanRun, SnapshotChain};

pub use self::options::{LazyOptions, ThreadStartHook};
pub use self::restore::{LazyCompletion, LazyRestore, LazyStats};

/// Chunk states.
const CHUNK_EMPTY: u8 = 0;
const CHUNK_PENDING: u8 = 1;
const CHUNK_CLAIMED: u8 = 2;

/// One guest RAM region as the loader sees it.
struct Target {
    host_addr: u64,
    size: u64,
    first_linear: u64,
}

#[derive(Default)]
struct Counters {
    faults: AtomicU64,
    faults_data: AtomicU64,
    faults_zero: AtomicU64,
    faults_already_loaded: AtomicU64,
    bytes_by_faults: AtomicU64,
    bytes_background: AtomicU64,
    bytes_working_set: AtomicU64,
    loaded_data_pages: AtomicU64,
    copy_races: AtomicU64,
    eagain_retries: AtomicU64,
}

#[derive(Default)]
struct Status {
    completed_after: Option<Duration>,
    error: Option<String>,
    stopped: bool,
}

#[derive(Default)]
struct Queues {
    /// Chunks with faults in them, oldest first.
    faulted: VecDeque<usize>,
    /// The working set, in order.
    working_set: VecDeque<usize>,
    /// Next chunk for the in-order sweep.
    cursor: usize,
}

struct Shared {
    chain: Arc<SnapshotChain>,
    uffd: Uffd,
    opts: LazyOptions,
    /// In region order.
    targets: Vec<Target>,
    /// Indices into `targets`, sorted by host address.
    by_host: Vec<usize>,
    page_size: u64,
    chunk_pages: u64,
    total_data_pages: u64,
    loaded: AtomicBitmap,
    chunk_state: Vec<AtomicU8>,
    queues: Mutex<Queues>,
    stop: AtomicBool,
    stop_event: EventFd,
    counters: Counters,
    latencies_ns: Mutex<Vec<u64>>,
    fault_order: Mutex<Vec<u64>>,
    status: Mutex<Status>,
    status_changed: Condvar,
    started: Instant,
    /// Guest RAM in this process, fenced when the loader fails (in-process restores).
    fence: Option<RamFence>,
    /// Whether background loaders may run (see [`LazyOptions::hold_background`]).
    background_released: Mutex<bool>,
    background_gate: Condvar,
}

/// Sets the calling thread's nice value.
fn set_thread_nice(nice: i32) {
    // SAFETY: gettid has no arguments and cannot fail.
    let tid = unsafe { libc::gettid() };
    // SAFETY: setpriority on our own thread id; no memory is passed.
    let ret = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice) };
    if ret != 0 {
        debug!(
            "cannot set nice {nice} on lazy-restore thread {tid}: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// Runs a loader thread body and records its error, if any.
fn run_thread(shared: &Shared, body: fn(&Shared) -> Result<(), UffdError>) {
    // Priority first: the hook may install a seccomp filter without setpriority.
    if let Some(nice) = shared.opts.thread_nice {
        set_thread_nice(nice);
    }
    let started = match &shared.opts.on_thread_start {
        Some(hook) => hook().map_err(io_err("prepare a lazy-restore thread")),
        None => Ok(()),
    };
    if let Err(e) = started.and_then(|()| body(shared)) {
        if shared.stop.load(Ordering::SeqCst) {
            debug!("lazy-restore thread ended during shutdown: {e}");
            return;
        }
        error!("lazy restore failed: {e}");
        {
            let mut status = lock(&shared.status);
            status.error.get_or_insert(e.to_string());
            shared.status_changed.notify_all();
        }
        // The other loader threads stop; nothing more is loaded.
        shared.request_stop();
        // Publish first, fence second: a vCPU woken by the fence faults out of KVM_RUN,
        // and the VMM then finds the loader's error, not only the vCPU's.
        if let Some(fence) = &shared.fence {
            if let Err(e) = fence.fence(&shared.uffd) {
                error!("fencing guest RAM after the lazy restore failed: {e}");
            }
        }
    }
}

impl Shared {
    /// Tells every loader thread to stop (held background loaders included).
    fn request_stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.stop_event.write(1);
        self.release_background();
    }

    fn release_background(&self) {
        let mut released = lock(&self.background_released);
        if !*released {
            *released = true;
            self.background_gate.notify_all();
        }
    }

    /// Blocks a background loader until it may run; `false` when stopping instead.
    fn wait_for_background_release(&self) -> bool {
        let mut released = lock(&self.background_released);
        while !*released {
            released = self
                .background_gate
                .wait(released)
                .unwrap_or_else(|e| e.into_inner());
        }
        !self.stop.load(Ordering::SeqCst)
    }

    fn stats(&self) -> LazyStats {
        let c = &self.counters;
        let mut latencies = lock(&self.latencies_ns).clone();
        latencies.sort_unstable();
        let pick = |q: f64| -> Option<Duration> {
            if latencies.is_empty() {
                return None;
            }
            let idx = ((latencies.len() - 1) as f64 * q).round() as usize;
            Some(Duration::from_nanos(latencies[idx]))
        };
        LazyStats {
            total_data_pages: self.total_data_pages,
            loaded_data_pages: c.loaded_data_pages.load(Ordering::Relaxed),
            faults: c.faults.load(Ordering::Relaxed),
            faults_served_data: c.faults_data.load(Ordering::Relaxed),
            faults_served_zero: c.faults_zero.load(Ordering::Relaxed),
            faults_already_loaded: c.faults_already_loaded.load(Ordering::Relaxed),
            fault_latency_p50: pick(0.5),
            fault_latency_p99: pick(0.99),
            fault_latency_max: latencies.last().map(|&ns| Duration::from_nanos(ns)),
            bytes_loaded_by_faults: c.bytes_by_faults.load(Ordering::Relaxed),
            bytes_loaded_background: c.bytes_background.load(Ordering::Relaxed),
            bytes_loaded_working_set: c.bytes_working_set.load(Ordering::Relaxed),
            copy_races: c.copy_races.load(Ordering::Relaxed),
            eagain_retries: c.eagain_retries.load(Ordering::Relaxed),
            time_to_complete: lock(&self.status).completed_after,
        }
    }

    /// Which region and linear page a faulting host address belongs to.
    fn locate(&self, addr: u64) -> Option<u64> {
        let idx = self
            .by_host
            .partition_point(|&i| self.targets[i].host_addr + self.targets[i].size <= addr);
        let t = &self.targets[*self.by_host.get(idx)?];
        if addr < t.host_addr {
            return None;
        }
        Some(t.first_linear + (addr - t.host_addr) / self.page_size)
    }

    /// Host address of linear page `linear` (inside guest RAM).
    fn host_addr_of(&self, linear: u64) -> u64 {
        let t = &self.targets[self.chain.layout().region_of_linear(linear)];
        t.host_addr + (linear - t.first_linear) * self.page_size
    }

    /// The plan run holding `linear`, if the page has data.
    fn run_of(&self, linear: u64) -> Option<&PlanRun> {
        let plan = self.chain.plan();
        let idx = plan.partition_point(|r| r.start + r.count <= linear);
        plan.get(idx).filter(|r| r.start <= linear)
    }

    /// Records pages `start..end` as loaded; `data` says whether they are data pages
    /// (which count towards completion).
    fn mark_loaded(&self, start: u64, end: u64, data: bool) {
        let newly = self.loaded.set_range(start, end);
        if data && newly > 0 {
            let total = self
                .counters
                .loaded_data_pages
                .fetch_add(newly, Ordering::AcqRel)
                + newly;
            if total == self.total_data_pages {
                self.finish();
            }
        }
    }

    fn note_fill(&self, filled: Filled) {
        self.counters
            .copy_races
            .fetch_add(filled.existed, Ordering::Relaxed);
        self.counters
            .eagain_retries
            .fetch_add(filled.retries, Ordering::Relaxed);
    }

    /// Every data page is in: record the time, wake waiters, unregister.
    fn finish(&self) {
        let elapsed = self.started.elapsed();
        {
            let mut status = lock(&self.status);
            if status.completed_after.is_some() {
                return;
            }
            status.completed_after = Some(elapsed);
            self.status_changed.notify_all();
        }
        info!("lazy restore complete after {elapsed:?}");
        if self.opts.unregister_when_done {
            // Faults still queued are woken by the kernel and retried as ordinary faults;
            // holes then fill with zeros without us.
            for t in &self.targets {
                let addr = t.host_addr as *mut libc::c_void;
                if let Err(e) = self.uffd.unregister(addr, t.size as usize) {
                    // The VMM may already be gone (external handler); nothing to serve then.
                    warn!("cannot unregister guest RAM at {:#x}: {e}", t.host_addr);
                }
                // Unregistering is meant to wake threads queued on a fault in the range, but
                // a thread can still be left asleep (seen on the nested CI hosts: a reader
                // blocked in handle_userfault forever after the range was unregistered).
                // The userfaultfd is still open, so wake the whole range once more; waking
                // nobody is harmless, and the woken retry faults normally.
                if let Err(e) = self.uffd.wake(addr, t.size as usize) {
                    debug!("wake after unregister at {:#x}: {e}", t.host_addr);
                }
            }
        }
    }

    fn is_done(&self) -> bool {
        lock(&self.status).completed_after.is_some()
    }
}
