//! The machine's side of a lazy restore: releasing and watching the background loader,
//! what a stalled vCPU waits for, and recording the working set the guest needed.

use std::time::Duration;

use gpuvm_memory::uffd::{LazyStats, UffdError};

use super::{LazyMemory, Machine};
use crate::snapshot::SnapshotError;
use crate::working_set;
use crate::Error;

/// How often the VMM checks on a lazy restore (for failures and completion).
pub(super) const LAZY_CHECK_INTERVAL: Duration = Duration::from_millis(20);

impl Machine {
    /// Lets a lazy restore's background loader start now rather than when the vCPUs run
    /// (for a restored machine that waits, not yet run, e.g. for an API `Resumed`).
    pub fn release_lazy_loading(&self) {
        if let Some(LazyMemory::InProcess(lazy)) = &self.lazy {
            lazy.release_background();
        }
    }

    /// Statistics of an in-process lazy restore, if one ran.
    pub fn lazy_stats(&self) -> Option<LazyStats> {
        match &self.lazy {
            Some(LazyMemory::InProcess(lazy)) => Some(lazy.stats()),
            _ => None,
        }
    }

    /// Waits until lazily restored memory is fully loaded (for benchmarks and tests).
    pub fn wait_lazy_complete(&self, limit: Duration) -> Option<LazyStats> {
        match &self.lazy {
            Some(LazyMemory::InProcess(lazy)) => lazy.wait_timeout(Some(limit)).ok().flatten(),
            _ => None,
        }
    }

    /// Makes every page of a lazily restored guest's RAM present in its file, for a live
    /// update: the new process maps the file without this process's userfaultfd, so a page
    /// not loaded yet would read as zero there. The in-process loader is given `limit` to
    /// finish (it keeps loading if it does not: the update can be retried); an external
    /// handler's pages are faulted in, bounded by its progress as a snapshot bounds it.
    /// Returns how long it waited; None when there was nothing to wait for (no lazy
    /// restore, or its loader had finished).
    pub(crate) fn finish_lazy_restore(&self, limit: Duration) -> Result<Option<Duration>, String> {
        let started = std::time::Instant::now();
        match &self.lazy {
            None => return Ok(None),
            Some(LazyMemory::InProcess(_)) if matches!(self.lazy_progress(), Ok(true)) => {
                return Ok(None)
            }
            Some(LazyMemory::InProcess(lazy)) => match lazy.wait_timeout(Some(limit)) {
                Ok(Some(_)) => {}
                Ok(None) => {
                    let stats = lazy.stats();
                    return Err(format!(
                        "the lazy restore has loaded {} of {} pages of guest RAM after {:?}; \
                         retry once it has finished",
                        stats.loaded_data_pages,
                        stats.total_data_pages,
                        started.elapsed()
                    ));
                }
                Err(error) => return Err(format!("the lazy restore failed: {error}")),
            },
            Some(LazyMemory::External(watch)) => watch
                .fault_in(super::take_snapshot::SNAPSHOT_MEMORY_STALL)
                .map_err(|e| format!("the page-fault handler did not serve guest RAM: {e}"))?,
        }
        Ok(Some(started.elapsed()))
    }

    /// What a vCPU that does not leave KVM_RUN when kicked waits for: guest memory that a
    /// lazy restore has not served (nothing else blocks a kicked vCPU for long).
    pub(super) fn stall_cause(&self) -> Option<&'static str> {
        match &self.lazy {
            Some(LazyMemory::External(_)) => {
                Some("guest memory from the external page-fault handler, which has not served it")
            }
            Some(LazyMemory::InProcess(_)) => {
                Some("guest memory that the lazy restore has not loaded yet")
            }
            None => None,
        }
    }

    /// Whether lazily restored memory is fully loaded; an error if the loader failed or
    /// the external handler is gone (an external handler's progress is unknown: `false`).
    pub(super) fn lazy_progress(&self) -> Result<bool, Error> {
        match &self.lazy {
            Some(LazyMemory::InProcess(lazy)) => lazy
                .wait_timeout(Some(Duration::ZERO))
                .map(|done| done.is_some())
                .map_err(|e| Error::Snapshot(SnapshotError::Uffd(e))),
            Some(LazyMemory::External(watch)) => match watch.failure() {
                Some(reason) => Err(SnapshotError::Uffd(UffdError::HandlerFailed(reason)).into()),
                None => Ok(false),
            },
            None => Ok(true),
        }
    }

    /// Records, once the lazy restore has loaded everything (or the run ends first), which
    /// memory the guest needed first, as the working set of the snapshot it was restored
    /// from (see [`crate::working_set`]): the working set this restore loaded, if any,
    /// then the blocks the guest faulted on. Only for in-process lazy restores; a no-op
    /// otherwise.
    pub fn record_working_set(&mut self) {
        if !matches!(self.lazy, Some(LazyMemory::InProcess(_))) {
            log::warn!("--record-working-set needs a lazy restore; nothing will be recorded");
            return;
        }
        self.working_set_target = self
            .memory_chain
            .as_ref()
            .map(|chain| (chain.dir.clone(), chain.last.id));
    }

    /// Writes the working set if one is to be recorded (best effort: a failure is logged,
    /// the guest is not disturbed).
    pub(super) fn save_working_set(&mut self) {
        let Some((dir, memory_file)) = self.working_set_target.take() else {
            return;
        };
        let Some(LazyMemory::InProcess(lazy)) = &self.lazy else {
            return;
        };
        // What was loaded first (the guest did not fault there), then what it still
        // faulted on.
        let mut needed = lazy.working_set().to_vec();
        needed.extend(lazy.fault_order());
        let blocks = working_set::blocks_of(&needed);
        if blocks.is_empty() {
            log::info!("the guest faulted on nothing: no working set to record");
            return;
        }
        match working_set::write(&dir, &memory_file, &blocks) {
            Ok(()) => log::info!(
                "recorded a working set of {} blocks in {}",
                blocks.len(),
                dir.join(working_set::FILE).display()
            ),
            Err(error) => log::warn!("cannot record the working set: {error}"),
        }
    }
}
