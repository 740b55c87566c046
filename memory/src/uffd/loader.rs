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

use std::collections::VecDeque;
use std::os::unix::io::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use log::{debug, error, info, warn};
use userfaultfd::{Event, EventBuffer, Uffd};
use vmm_sys_util::eventfd::EventFd;

use super::fence::RamFence;
use super::ops::{self, AlignedBuf, Filled, BASE_PAGE_SIZE};
use super::{io_err, lock, UffdError};
use crate::snapshot::bits::AtomicBitmap;
use crate::snapshot::{PlanRun, SnapshotChain};

/// Runs first thing on each thread a lazy restore starts (e.g. to install a seccomp
/// filter); an error fails the restore.
pub type ThreadStartHook = Arc<dyn Fn() -> std::io::Result<()> + Send + Sync>;

/// How to run a lazy restore.
#[derive(Clone)]
pub struct LazyOptions {
    /// Unit of background loading and of fault-driven prefetch.
    pub chunk_bytes: usize,
    /// Check page CRCs (when the files have them) before data reaches guest memory.
    pub verify_data: bool,
    /// Run the background loader. Without it only faulted pages are loaded (for
    /// measuring pure on-demand behaviour).
    pub background: bool,
    /// Background loader threads (each takes whole chunks; more than one overlaps disk
    /// reads with copying when CPUs are free).
    pub loader_threads: usize,
    /// Guest-physical addresses to load first, in order (e.g. a previous run's
    /// [`LazyRestore::fault_order`]).
    pub working_set: Vec<u64>,
    /// Unregister guest RAM from the userfaultfd once every data page is loaded.
    pub unregister_when_done: bool,
    /// Fault latencies kept for percentiles (the first N faults).
    pub max_latency_samples: usize,
    /// Faulted pages remembered for [`LazyRestore::fault_order`] (the first N).
    pub max_recorded_faults: usize,
    /// Background loaders load only the working set until
    /// [`LazyRestore::release_background`], and sweep the rest after it (the VMM releases
    /// them once the vCPUs run, so the sweep does not compete for CPUs with the last steps
    /// of the restore). Faults are served from the start regardless. A blocking
    /// [`LazyRestore::wait`], and stopping, release them too.
    pub hold_background: bool,
    /// Nice value for the fault and loader threads (`setpriority` on each thread):
    /// negative = more CPU share than the vCPUs and the rest of the host. Needs
    /// CAP_SYS_NICE for negative values; without it the threads keep the default, and
    /// say so at debug level. `None` leaves them alone.
    pub thread_nice: Option<i32>,
    /// Called on the fault thread and each loader thread before they do anything else.
    pub on_thread_start: Option<ThreadStartHook>,
}

impl std::fmt::Debug for LazyOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LazyOptions")
            .field("chunk_bytes", &self.chunk_bytes)
            .field("verify_data", &self.verify_data)
            .field("background", &self.background)
            .field("loader_threads", &self.loader_threads)
            .field("working_set", &self.working_set.len())
            .field("unregister_when_done", &self.unregister_when_done)
            .field("max_latency_samples", &self.max_latency_samples)
            .field("max_recorded_faults", &self.max_recorded_faults)
            .field("hold_background", &self.hold_background)
            .field("thread_nice", &self.thread_nice)
            .field("on_thread_start", &self.on_thread_start.is_some())
            .finish()
    }
}

impl Default for LazyOptions {
    fn default() -> Self {
        LazyOptions {
            chunk_bytes: 4 << 20,
            verify_data: true,
            background: true,
            loader_threads: 1,
            working_set: Vec::new(),
            unregister_when_done: true,
            max_latency_samples: 1 << 20,
            max_recorded_faults: 1 << 16,
            hold_background: false,
            thread_nice: Some(-10),
            on_thread_start: None,
        }
    }
}

/// Progress and performance of a lazy restore.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LazyStats {
    /// Pages that hold data after restore.
    pub total_data_pages: u64,
    /// Of those, pages loaded so far.
    pub loaded_data_pages: u64,
    /// Page-fault events handled.
    pub faults: u64,
    /// Faults resolved by copying data from the snapshot.
    pub faults_served_data: u64,
    /// Faults on holes, resolved with a zero page.
    pub faults_served_zero: u64,
    /// Faults on pages that were already loaded when handled (raced with the background
    /// thread, which had already woken the vCPU).
    pub faults_already_loaded: u64,
    /// Median fault service time (event read to page mapped).
    pub fault_latency_p50: Option<Duration>,
    /// 99th percentile fault service time.
    pub fault_latency_p99: Option<Duration>,
    /// Slowest fault.
    pub fault_latency_max: Option<Duration>,
    /// Bytes copied in by the fault thread.
    pub bytes_loaded_by_faults: u64,
    /// Bytes copied in by the background thread.
    pub bytes_loaded_background: u64,
    /// Of those, bytes of the chunks the working set put first.
    pub bytes_loaded_working_set: u64,
    /// Pages the kernel reported as already present (EEXIST races).
    pub copy_races: u64,
    /// EAGAIN retries.
    pub eagain_retries: u64,
    /// Time from start until every data page was loaded.
    pub time_to_complete: Option<Duration>,
}

impl LazyStats {
    /// Whether every data page is loaded.
    pub fn complete(&self) -> bool {
        self.time_to_complete.is_some()
    }
}

/// Why the background loader took a chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    /// A vCPU faulted in it.
    Faulted,
    /// It holds part of the recorded working set.
    WorkingSet,
    /// Its turn in the front-to-back sweep.
    Sweep,
}

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

/// Handle to a running lazy restore. Dropping it stops the loader threads and closes
/// the userfaultfd, after which still-missing pages read as zero: drop it early only when
/// the guest is being torn down.
pub struct LazyRestore {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl LazyRestore {
    /// Starts serving faults on `uffd` (already registered over guest RAM) from `chain`.
    /// `host_addrs[i]` is where region `i` of `chain.layout()` is mapped in the process
    /// that registered `uffd` (this process, or the VMM for an external handler).
    pub fn start(
        chain: Arc<SnapshotChain>,
        host_addrs: &[u64],
        uffd: Uffd,
        opts: LazyOptions,
    ) -> Result<LazyRestore, UffdError> {
        Self::start_fenced(chain, host_addrs, uffd, opts, None)
    }

    /// Like [`LazyRestore::start`]; when the loader fails, `fence` (guest RAM of this
    /// process) is fenced after the error is recorded.
    pub(crate) fn start_fenced(
        chain: Arc<SnapshotChain>,
        host_addrs: &[u64],
        uffd: Uffd,
        opts: LazyOptions,
        fence: Option<RamFence>,
    ) -> Result<LazyRestore, UffdError> {
        let layout = chain.layout();
        let page_size = layout.page_size();
        if host_addrs.len() != layout.regions().len() {
            return Err(UffdError::Layout(format!(
                "{} host addresses for {} regions",
                host_addrs.len(),
                layout.regions().len()
            )));
        }
        let targets: Vec<Target> = host_addrs
            .iter()
            .zip(layout.regions())
            .enumerate()
            .map(|(i, (&host_addr, r))| Target {
                host_addr,
                size: r.size,
                first_linear: layout.region_first_linear(i),
            })
            .collect();
        if let Some(t) = targets.iter().find(|t| t.host_addr % page_size != 0) {
            return Err(UffdError::Layout(format!(
                "host address {:#x} is not aligned to the page size {page_size:#x}",
                t.host_addr
            )));
        }
        let mut by_host: Vec<usize> = (0..targets.len()).collect();
        by_host.sort_by_key(|&i| targets[i].host_addr);

        let chunk_pages = (opts.chunk_bytes as u64 / page_size).max(1);
        let chunk_count = layout.total_pages().div_ceil(chunk_pages) as usize;
        let chunk_state: Vec<AtomicU8> = (0..chunk_count)
            .map(|_| AtomicU8::new(CHUNK_EMPTY))
            .collect();
        for run in chain.plan() {
            let first = run.start / chunk_pages;
            let last = (run.start + run.count - 1) / chunk_pages;
            for c in first..=last {
                chunk_state[c as usize].store(CHUNK_PENDING, Ordering::Relaxed);
            }
        }
        let mut queues = Queues::default();
        let mut queued = vec![false; chunk_count];
        for &gpa in &opts.working_set {
            if let Some((_, linear)) = layout.locate_guest_page(gpa / page_size) {
                let c = (linear / chunk_pages) as usize;
                if !std::mem::replace(&mut queued[c], true) {
                    queues.working_set.push_back(c);
                }
            }
        }

        set_nonblocking(&uffd)?;
        let shared = Arc::new(Shared {
            total_data_pages: chain.data_pages(),
            loaded: AtomicBitmap::new(layout.total_pages()),
            chain,
            uffd,
            targets,
            by_host,
            page_size,
            chunk_pages,
            chunk_state,
            queues: Mutex::new(queues),
            stop: AtomicBool::new(false),
            stop_event: EventFd::new(libc::EFD_NONBLOCK | libc::EFD_CLOEXEC)
                .map_err(io_err("create eventfd"))?,
            counters: Counters::default(),
            latencies_ns: Mutex::new(Vec::new()),
            fault_order: Mutex::new(Vec::new()),
            status: Mutex::new(Status::default()),
            status_changed: Condvar::new(),
            started: Instant::now(),
            fence,
            background_released: Mutex::new(!opts.hold_background),
            background_gate: Condvar::new(),
            opts,
        });

        let mut restore = LazyRestore {
            shared: shared.clone(),
            threads: Vec::new(),
        };
        let s = shared.clone();
        restore.threads.push(
            std::thread::Builder::new()
                .name("uffd-faults".into())
                .spawn(move || run_thread(&s, fault_thread))
                .map_err(io_err("spawn fault thread"))?,
        );
        let loaders = if shared.opts.background {
            shared.opts.loader_threads.max(1)
        } else {
            0
        };
        for i in 0..loaders {
            let s = shared.clone();
            restore.threads.push(
                std::thread::Builder::new()
                    .name(format!("uffd-loader-{i}"))
                    .spawn(move || run_thread(&s, background_thread))
                    .map_err(io_err("spawn background loader"))?,
            );
        }
        if shared.total_data_pages == 0 {
            shared.finish();
        }
        info!(
            "lazy restore started: {} data pages, chunks of {} pages",
            shared.total_data_pages, chunk_pages
        );
        Ok(restore)
    }

    /// Current statistics.
    pub fn stats(&self) -> LazyStats {
        self.shared.stats()
    }

    /// Whether every data page is loaded.
    pub fn is_complete(&self) -> bool {
        lock(&self.shared.status).completed_after.is_some()
    }

    /// Lets held background loaders start (see [`LazyOptions::hold_background`]).
    pub fn release_background(&self) {
        self.shared.release_background();
    }

    /// Blocks until every data page is loaded (or the loader failed).
    pub fn wait(&self) -> Result<LazyStats, UffdError> {
        self.wait_timeout(None)?
            .ok_or_else(|| UffdError::RestoreFailed("wait ended without completion".into()))
    }

    /// Like [`LazyRestore::wait`] but gives up after `timeout` with `Ok(None)`.
    pub fn wait_timeout(&self, timeout: Option<Duration>) -> Result<Option<LazyStats>, UffdError> {
        if timeout != Some(Duration::ZERO) {
            // Waiting for completion needs the background loaders.
            self.shared.release_background();
        }
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut status = lock(&self.shared.status);
        loop {
            if let Some(e) = &status.error {
                return Err(UffdError::RestoreFailed(e.clone()));
            }
            if status.completed_after.is_some() {
                drop(status);
                return Ok(Some(self.stats()));
            }
            if status.stopped {
                return Err(UffdError::RestoreFailed("stopped before completion".into()));
            }
            status = match deadline {
                None => self
                    .shared
                    .status_changed
                    .wait(status)
                    .unwrap_or_else(|e| e.into_inner()),
                Some(deadline) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Ok(None);
                    }
                    self.shared
                        .status_changed
                        .wait_timeout(status, deadline - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
            };
        }
    }

    /// Like [`LazyRestore::wait`], but gives up with [`UffdError::NoProgress`] once no
    /// page has loaded for `no_progress` (a loader blocked in a read that never returns,
    /// e.g. a hung network file system); the loader goes on regardless.
    pub fn wait_progressing(&self, no_progress: Duration) -> Result<LazyStats, UffdError> {
        let loaded = || {
            self.shared
                .counters
                .loaded_data_pages
                .load(Ordering::Relaxed)
        };
        let (mut seen, mut moved_at) = (loaded(), Instant::now());
        loop {
            let check = no_progress.min(Duration::from_millis(100));
            if let Some(stats) = self.wait_timeout(Some(check))? {
                return Ok(stats);
            }
            let now = loaded();
            if now != seen {
                (seen, moved_at) = (now, Instant::now());
            } else if moved_at.elapsed() >= no_progress {
                return Err(UffdError::NoProgress {
                    server: "the lazy restore's loader (reading the snapshot's memory files)",
                    stalled: no_progress,
                });
            }
        }
    }

    /// The working set this restore was started with ([`LazyOptions::working_set`]).
    pub fn working_set(&self) -> &[u64] {
        &self.shared.opts.working_set
    }

    /// Guest-physical addresses of the pages the guest faulted on, in fault order: save it
    /// and pass it as [`LazyOptions::working_set`] next time.
    pub fn fault_order(&self) -> Vec<u64> {
        lock(&self.shared.fault_order).clone()
    }

    /// Stops the loader threads and returns the final statistics; an error if the loader
    /// had failed.
    pub fn shutdown(mut self) -> Result<LazyStats, UffdError> {
        self.stop_threads();
        let error = lock(&self.shared.status).error.clone();
        match error {
            Some(e) => Err(UffdError::RestoreFailed(e)),
            None => Ok(self.stats()),
        }
    }

    fn stop_threads(&mut self) {
        self.shared.request_stop();
        for t in self.threads.drain(..) {
            if t.join().is_err() {
                error!("a lazy-restore thread panicked");
            }
        }
        lock(&self.shared.status).stopped = true;
        self.shared.status_changed.notify_all();
    }
}

impl Drop for LazyRestore {
    fn drop(&mut self) {
        self.stop_threads();
    }
}

impl std::fmt::Debug for LazyRestore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LazyRestore")
            .field("stats", &self.stats())
            .finish()
    }
}

fn set_nonblocking(uffd: &Uffd) -> Result<(), UffdError> {
    let fd = uffd.as_raw_fd();
    // SAFETY: fcntl on an fd we own; no memory is passed.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(UffdError::Io {
            op: "make the userfaultfd non-blocking",
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
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

    /// Moves chunk `c` to the front of the background queue.
    fn prioritise(&self, c: usize) {
        if self.chunk_state[c].load(Ordering::Acquire) != CHUNK_PENDING {
            return;
        }
        let mut queues = lock(&self.queues);
        if !queues.faulted.contains(&c) {
            queues.faulted.push_back(c);
        }
    }

    /// Claims the next chunk to load: faulted chunks, then the working set, then the
    /// in-order sweep. `None` once every chunk is claimed.
    /// While `held`, only working-set chunks.
    fn next_chunk(&self, held: bool) -> Option<(usize, Source)> {
        let mut queues = lock(&self.queues);
        loop {
            // Once everything is loaded the remaining chunks hold nothing new.
            if self.stop.load(Ordering::SeqCst) || self.is_done() {
                return None;
            }
            let faulted = if held {
                None
            } else {
                queues.faulted.pop_front()
            };
            let (candidate, source) = if let Some(c) = faulted {
                (c, Source::Faulted)
            } else if let Some(c) = queues.working_set.pop_front() {
                (c, Source::WorkingSet)
            } else if held {
                return None;
            } else if queues.cursor < self.chunk_state.len() {
                queues.cursor += 1;
                (queues.cursor - 1, Source::Sweep)
            } else {
                return None;
            };
            if self.chunk_state[candidate]
                .compare_exchange(
                    CHUNK_PENDING,
                    CHUNK_CLAIMED,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok()
            {
                return Some((candidate, source));
            }
        }
    }
}

/// Fault-serving thread: poll the userfaultfd, resolve each fault with its one page.
fn fault_thread(shared: &Shared) -> Result<(), UffdError> {
    let page_size = shared.page_size as usize;
    let mut page_buf = AlignedBuf::new(page_size).map_err(io_err("map the fault buffer"))?;
    // hugetlb has no UFFDIO_ZEROPAGE: holes get a copy of a zeroed huge page.
    let zero_buf = if shared.page_size != BASE_PAGE_SIZE {
        Some(AlignedBuf::new(page_size).map_err(io_err("map the zero page"))?)
    } else {
        None
    };
    let mut events = EventBuffer::new(64);
    let mut pending = Vec::with_capacity(64);
    let mut fds = [
        libc::pollfd {
            fd: shared.uffd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: shared.stop_event.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    loop {
        ops::poll_until_ready(&mut fds).map_err(io_err("poll the userfaultfd"))?;
        if shared.stop.load(Ordering::SeqCst) {
            return Ok(());
        }
        if fds[0].revents & (libc::POLLERR | libc::POLLHUP) != 0 {
            return Err(UffdError::Io {
                op: "poll the userfaultfd",
                source: std::io::Error::other("userfaultfd reported an error or hang-up"),
            });
        }
        pending.clear();
        for event in shared
            .uffd
            .read_events(&mut events)
            .map_err(UffdError::ReadEvents)?
        {
            match event.map_err(UffdError::ReadEvents)? {
                Event::Pagefault { addr, .. } => pending.push(addr as u64),
                other => debug!("ignoring userfaultfd event {other:?}"),
            }
        }
        let read_at = Instant::now();
        for &addr in &pending {
            serve_fault(shared, addr, &mut page_buf, zero_buf.as_ref())?;
            let ns = read_at.elapsed().as_nanos() as u64;
            let mut latencies = lock(&shared.latencies_ns);
            if latencies.len() < shared.opts.max_latency_samples {
                latencies.push(ns);
            }
        }
    }
}

fn serve_fault(
    shared: &Shared,
    addr: u64,
    page_buf: &mut AlignedBuf,
    zero_buf: Option<&AlignedBuf>,
) -> Result<(), UffdError> {
    let c = &shared.counters;
    c.faults.fetch_add(1, Ordering::Relaxed);
    let page_addr = addr & !(shared.page_size - 1);
    let Some(linear) = shared.locate(page_addr) else {
        warn!("userfaultfd fault at {addr:#x} outside guest RAM; ignored");
        return Ok(());
    };
    let page_size = shared.page_size as usize;
    if shared.loaded.get(linear) {
        // The background thread got there first and woke the vCPU; waking again is
        // harmless and covers pages populated some other way.
        c.faults_already_loaded.fetch_add(1, Ordering::Relaxed);
        return ops::wake(&shared.uffd, page_addr, page_size);
    }
    {
        let mut order = lock(&shared.fault_order);
        if order.len() < shared.opts.max_recorded_faults {
            order.push(shared.chain.layout().linear_to_gpa(linear));
        }
    }
    let result = match shared.run_of(linear) {
        Some(run) => {
            let layer = &shared.chain.layers()[run.layer];
            let offset = run.file_offset + (linear - run.start) * shared.page_size;
            layer.read_data(offset, page_buf.as_mut_slice())?;
            if shared.opts.verify_data {
                shared.chain.check_page(run, linear, page_buf.as_slice())?;
            }
            // SAFETY: page_buf holds page_size readable bytes.
            let filled = unsafe {
                ops::copy(
                    &shared.uffd,
                    page_buf.as_ptr(),
                    page_addr,
                    page_size,
                    page_size,
                )
            };
            c.faults_data.fetch_add(1, Ordering::Relaxed);
            filled.map(|f| (f, true))
        }
        None => {
            c.faults_zero.fetch_add(1, Ordering::Relaxed);
            let filled = match zero_buf {
                // SAFETY: zero_buf holds page_size readable bytes.
                Some(zeros) => unsafe {
                    ops::copy(
                        &shared.uffd,
                        zeros.as_ptr(),
                        page_addr,
                        page_size,
                        page_size,
                    )
                },
                None => ops::zeropage(&shared.uffd, page_addr, page_size, page_size),
            };
            filled.map(|f| (f, false))
        }
    };
    match result {
        Ok((filled, data)) => {
            shared.note_fill(filled);
            if data && filled.existed == 0 {
                c.bytes_by_faults
                    .fetch_add(page_size as u64, Ordering::Relaxed);
            }
            shared.mark_loaded(linear, linear + 1, data);
        }
        // After completion the ranges are unregistered; a fault read just before that
        // was already woken by the unregister and retried as a normal fault.
        Err(e) if shared.is_done() => debug!("late fault at {page_addr:#x}: {e}"),
        Err(e) => return Err(e),
    }
    if shared.opts.background {
        shared.prioritise((linear / shared.chunk_pages) as usize);
    }
    Ok(())
}

/// Background thread: load chunks, queued ones first, until all are claimed.
fn background_thread(shared: &Shared) -> Result<(), UffdError> {
    let mut buf = AlignedBuf::new((shared.chunk_pages * shared.page_size) as usize)
        .map_err(io_err("map the loader buffer"))?;
    // While held, only the recorded working set: the guest is about to need it, so it is
    // worth a CPU even before the vCPUs run (after, the guest would fault on it first and
    // the working set would save nothing). Prefetching around faults and the
    // front-to-back sweep wait for the release.
    while let Some((c, source)) = shared.next_chunk(true) {
        load_chunk(shared, c, source, &mut buf)?;
    }
    if !shared.wait_for_background_release() {
        return Ok(());
    }
    while let Some((c, source)) = shared.next_chunk(false) {
        load_chunk(shared, c, source, &mut buf)?;
    }
    Ok(())
}

/// A piece of a plan run inside one chunk.
struct Piece {
    start: u64,
    end: u64,
    run: PlanRun,
}

/// The parts of plan runs that fall in `chunk`.
fn chunk_pieces(shared: &Shared, chunk: usize) -> Vec<Piece> {
    let total = shared.chain.layout().total_pages();
    let first = chunk as u64 * shared.chunk_pages;
    let end = (first + shared.chunk_pages).min(total);
    let plan = shared.chain.plan();
    let mut idx = plan.partition_point(|r| r.start + r.count <= first);
    let mut pieces = Vec::new();
    while let Some(run) = plan.get(idx).filter(|r| r.start < end) {
        pieces.push(Piece {
            start: run.start.max(first),
            end: (run.start + run.count).min(end),
            run: *run,
        });
        idx += 1;
    }
    pieces
}

/// Starts asynchronous readahead of `chunk`'s data, so the disk works on the next chunk
/// while this thread copies the current one into guest memory.
fn prefetch(shared: &Shared, chunk: usize) {
    if chunk >= shared.chunk_state.len()
        || shared.chunk_state[chunk].load(Ordering::Acquire) != CHUNK_PENDING
    {
        return;
    }
    let pieces = chunk_pieces(shared, chunk);
    for (layer_idx, layer) in shared.chain.layers().iter().enumerate() {
        let ranges = pieces.iter().filter(|p| p.run.layer == layer_idx).map(|p| {
            let start = piece_file_offset(p, shared.page_size);
            (start, start + (p.end - p.start) * shared.page_size)
        });
        let (Some(lo), Some(hi)) = (ranges.clone().map(|r| r.0).min(), ranges.map(|r| r.1).max())
        else {
            continue;
        };
        // SAFETY: plain syscall on the layer's fd; no memory is passed.
        unsafe {
            libc::posix_fadvise(
                layer.file().as_raw_fd(),
                lo as libc::off_t,
                (hi - lo) as libc::off_t,
                libc::POSIX_FADV_WILLNEED,
            )
        };
    }
}

fn load_chunk(
    shared: &Shared,
    chunk: usize,
    source: Source,
    buf: &mut AlignedBuf,
) -> Result<(), UffdError> {
    let pieces = chunk_pieces(shared, chunk);
    prefetch(shared, chunk + 1);

    // One read per stretch of pieces stored back to back in the same file.
    let page_size = shared.page_size;
    let mut i = 0;
    while i < pieces.len() {
        let group_start = i;
        let file_start = piece_file_offset(&pieces[i], page_size);
        let layer = pieces[i].run.layer;
        let mut file_end = file_start + (pieces[i].end - pieces[i].start) * page_size;
        i += 1;
        while i < pieces.len()
            && pieces[i].run.layer == layer
            && piece_file_offset(&pieces[i], page_size) == file_end
        {
            file_end += (pieces[i].end - pieces[i].start) * page_size;
            i += 1;
        }
        if shared.stop.load(Ordering::SeqCst) {
            return Ok(());
        }
        // Skip the read when faults already brought everything in.
        if pieces[group_start..i]
            .iter()
            .all(|p| shared.loaded.next(false, p.start, p.end) == p.end)
        {
            continue;
        }
        let len = (file_end - file_start) as usize;
        shared.chain.layers()[layer].read_data(file_start, &mut buf.as_mut_slice()[..len])?;
        let mut buf_offset = 0usize;
        for piece in &pieces[group_start..i] {
            copy_piece(shared, piece, source, buf, buf_offset)?;
            buf_offset += ((piece.end - piece.start) * page_size) as usize;
        }
    }
    Ok(())
}

fn piece_file_offset(piece: &Piece, page_size: u64) -> u64 {
    piece.run.file_offset + (piece.start - piece.run.start) * page_size
}

/// Verifies and copies the not-yet-loaded pages of `piece`, whose data is at
/// `buf[buf_offset..]`.
fn copy_piece(
    shared: &Shared,
    piece: &Piece,
    source: Source,
    buf: &AlignedBuf,
    buf_offset: usize,
) -> Result<(), UffdError> {
    let page_size = shared.page_size;
    let data =
        &buf.as_slice()[buf_offset..buf_offset + ((piece.end - piece.start) * page_size) as usize];
    let mut at = shared.loaded.next(false, piece.start, piece.end);
    while at < piece.end {
        let run_end = shared.loaded.next(true, at, piece.end);
        let rel = ((at - piece.start) * page_size) as usize;
        let len = ((run_end - at) * page_size) as usize;
        let bytes = &data[rel..rel + len];
        if shared.opts.verify_data {
            for (k, page) in bytes.chunks_exact(page_size as usize).enumerate() {
                shared.chain.check_page(&piece.run, at + k as u64, page)?;
            }
        }
        let dst = shared.host_addr_of(at);
        // SAFETY: `bytes` is inside `buf`, readable for `len` bytes.
        let filled = match unsafe {
            ops::copy(&shared.uffd, bytes.as_ptr(), dst, len, page_size as usize)
        } {
            Ok(filled) => filled,
            // The fault thread loaded the last missing pages (these among them) and the
            // ranges were unregistered before this copy: nothing is left to do.
            Err(e) if shared.is_done() => {
                debug!("background copy after completion at {dst:#x}: {e}");
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        shared.note_fill(filled);
        let copied = len as u64 - filled.existed * page_size;
        shared
            .counters
            .bytes_background
            .fetch_add(copied, Ordering::Relaxed);
        if source == Source::WorkingSet {
            shared
                .counters
                .bytes_working_set
                .fetch_add(copied, Ordering::Relaxed);
        }
        shared.mark_loaded(at, run_end, true);
        at = shared.loaded.next(false, run_end, piece.end);
    }
    Ok(())
}
