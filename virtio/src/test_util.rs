//! Helpers the devices' unit tests share: guest memory, rate limits, an interrupt that
//! records what it was asked to signal, and waiting for a worker thread to get something done.

use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use vm_memory::GuestAddress;

use crate::rate_limiter::{RateLimiterConfig, TokenBucketConfig};
use crate::{GuestMemory, VirtioInterrupt};

/// How long a test waits for a worker thread before it fails.
pub const WAIT: Duration = Duration::from_secs(10);

/// `size` bytes of guest memory from address 0.
pub fn memory(size: usize) -> GuestMemory {
    GuestMemory::from_ranges(&[(GuestAddress(0), size)]).unwrap()
}

/// A limit of `size` operations per `refill_time_ms`, starting full.
pub fn ops_limit(size: u64, refill_time_ms: u64) -> RateLimiterConfig {
    RateLimiterConfig {
        bandwidth: None,
        ops: Some(bucket(size, refill_time_ms)),
    }
}

/// A limit of `size` bytes per `refill_time_ms`, starting full.
pub fn bandwidth_limit(size: u64, refill_time_ms: u64) -> RateLimiterConfig {
    RateLimiterConfig {
        bandwidth: Some(bucket(size, refill_time_ms)),
        ops: None,
    }
}

fn bucket(size: u64, refill_time_ms: u64) -> TokenBucketConfig {
    TokenBucketConfig {
        size,
        one_time_burst: 0,
        refill_time_ms,
    }
}

/// Records the queue interrupts and configuration changes a device signals, and lets a
/// test wait for them.
#[derive(Default)]
pub struct RecordingInterrupt {
    /// Queue indices, in the order signalled.
    queues: Mutex<Vec<u16>>,
    config_changes: Mutex<usize>,
    signalled: Condvar,
}

impl RecordingInterrupt {
    /// The queues signalled so far, in order.
    pub fn queues(&self) -> Vec<u16> {
        crate::lock(&self.queues).clone()
    }

    /// How many queue interrupts were signalled.
    pub fn count(&self) -> usize {
        crate::lock(&self.queues).len()
    }

    /// How many configuration changes were signalled.
    pub fn config_changes(&self) -> usize {
        *crate::lock(&self.config_changes)
    }

    /// Waits at most [`WAIT`] for `count` queue interrupts in all; false if they did not
    /// come.
    pub fn wait_for(&self, count: usize) -> bool {
        let deadline = Instant::now() + WAIT;
        let mut queues = crate::lock(&self.queues);
        while queues.len() < count {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            queues = self
                .signalled
                .wait_timeout(queues, left)
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .0;
        }
        true
    }
}

impl VirtioInterrupt for RecordingInterrupt {
    fn signal_queue(&self, queue_index: u16) -> std::io::Result<()> {
        crate::lock(&self.queues).push(queue_index);
        self.signalled.notify_all();
        Ok(())
    }

    fn signal_config(&self) -> std::io::Result<()> {
        *crate::lock(&self.config_changes) += 1;
        Ok(())
    }
}

/// Polls `found` until it gives a value, failing the test after [`WAIT`].
pub fn wait_for<T>(what: &str, mut found: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(value) = found() {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Polls `done` until it holds, failing the test after [`WAIT`].
pub fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    wait_for(what, || done().then_some(()));
}
