//! How to run a lazy restore: [`LazyOptions`] and the per-thread start hook.

use std::sync::Arc;

#[cfg(doc)]
use super::LazyRestore;

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
