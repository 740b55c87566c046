//! [`LazyRestore`], the public handle to a running lazy restore: starting its threads,
//! waiting for completion, its statistics ([`LazyStats`]) and stopping it.

use std::os::unix::io::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use log::{error, info};
use userfaultfd::Uffd;
use vmm_sys_util::eventfd::EventFd;

use super::background::background_thread;
use super::fault::fault_thread;
use super::{
    run_thread, Counters, LazyOptions, Queues, Shared, Status, Target, CHUNK_EMPTY, CHUNK_PENDING,
};
use crate::snapshot::bits::AtomicBitmap;
use crate::snapshot::SnapshotChain;
use crate::uffd::fence::RamFence;
use crate::uffd::{io_err, lock, UffdError};

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

/// Waits for a lazy restore's completion; see [`LazyRestore::completion`]. It does not
/// keep the loader running: once the restore is dropped, a wait ends with an error.
#[derive(Clone)]
pub struct LazyCompletion {
    shared: Arc<Shared>,
}

impl LazyCompletion {
    /// Blocks until every data page is loaded; an error if the loader failed or stopped.
    pub fn wait(&self) -> Result<(), UffdError> {
        self.shared.release_background();
        let mut status = lock(&self.shared.status);
        loop {
            if let Some(e) = &status.error {
                return Err(UffdError::RestoreFailed(e.clone()));
            }
            if status.completed_after.is_some() {
                return Ok(());
            }
            if status.stopped {
                return Err(UffdError::RestoreFailed("stopped before completion".into()));
            }
            status = self
                .shared
                .status_changed
                .wait(status)
                .unwrap_or_else(|e| e.into_inner());
        }
    }
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

    /// A handle that waits for this restore's completion from another thread (the DMA
    /// mapping of a restored passthrough device waits for it: a device writing RAM the
    /// loader has not filled yet would have its writes overwritten, or lost).
    pub fn completion(&self) -> LazyCompletion {
        LazyCompletion {
            shared: self.shared.clone(),
        }
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
