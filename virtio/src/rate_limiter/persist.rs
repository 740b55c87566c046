//! Snapshots of a [`RateLimiter`]: where each bucket stood when the device paused.
//!
//! Semantics: a restored bucket continues where the saved one stopped. It keeps its
//! budget (a debt included), what is left of the one-time burst, the fraction of a token
//! already earned, and the time since its last refill; the time between the snapshot and
//! the restore earns nothing. The guest's clock does not run in between either, so the
//! limit holds over the guest's running time: restoring (or cloning) a snapshot never
//! grants a fresh burst, and a one-time burst is spent once per VM, not once per restore.
//!
//! A saved bucket loads only into a bucket of the same configuration; one whose
//! configuration differs (or that the snapshot did not save, as in version-1 state files)
//! starts full, as [`RateLimiter::update`] treats a changed bucket.

use std::time::{Duration, Instant};

use gpuvm_devices::Persist;
use serde::{Deserialize, Serialize};

use super::{RateLimiter, TokenBucket, TokenBucketConfig};

/// One bucket as it stood at the pause.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenBucketState {
    /// The bucket's configuration then: the state loads only into one configured alike.
    pub config: TokenBucketConfig,
    /// Tokens in the bucket, at most `config.size`.
    pub budget: u64,
    /// Tokens owed while a request bigger than the bucket is being paid back (then
    /// `budget` is 0). Two unsigned fields rather than one signed budget: a state file
    /// holds them exactly (serde's buffering for flattened structures has no i128).
    #[serde(default)]
    pub debt: u64,
    /// What is left of the one-time burst.
    pub burst_left: u64,
    /// The fraction of the next token already earned, in 1/(refill time in ns) tokens.
    pub partial: u64,
    /// Nanoseconds from the last refill to the pause: a restored bucket refills from as
    /// far back, so the time it had earned before the snapshot is not lost.
    pub since_refill_ns: u64,
}

/// Both buckets of a limiter; a bucket it does not have is `None`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimiterState {
    #[serde(default)]
    pub bandwidth: Option<TokenBucketState>,
    #[serde(default)]
    pub ops: Option<TokenBucketState>,
}

/// Why a saved bucket was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RateLimiterStateError {
    #[error("rate limiter {bucket} bucket: a saved budget of {budget} tokens is more than its size {size}")]
    BudgetAboveSize {
        bucket: &'static str,
        budget: u64,
        size: u64,
    },
    #[error("rate limiter {bucket} bucket: a saved debt of {debt} tokens is more than any request could leave")]
    DebtTooLarge { bucket: &'static str, debt: u64 },
    #[error("rate limiter {bucket} bucket: saved with both {budget} tokens and a debt of {debt}")]
    BudgetAndDebt {
        bucket: &'static str,
        budget: u64,
        debt: u64,
    },
    #[error("rate limiter {bucket} bucket: {burst_left} tokens of one-time burst left, more than the {one_time_burst} configured")]
    BurstAboveConfig {
        bucket: &'static str,
        burst_left: u64,
        one_time_burst: u64,
    },
    #[error(
        "rate limiter {bucket} bucket: a saved partial token of {partial} is not below {refill_ns}"
    )]
    PartialTooLarge {
        bucket: &'static str,
        partial: u64,
        refill_ns: u128,
    },
}

impl TokenBucketState {
    /// Refuses what no bucket of the saved configuration can have held.
    fn check(&self, bucket: &'static str) -> Result<(), RateLimiterStateError> {
        let size = self.config.size;
        if self.budget > size {
            return Err(RateLimiterStateError::BudgetAboveSize {
                bucket,
                budget: self.budget,
                size,
            });
        }
        if self.budget > 0 && self.debt > 0 {
            return Err(RateLimiterStateError::BudgetAndDebt {
                bucket,
                budget: self.budget,
                debt: self.debt,
            });
        }
        // A request takes at most u64::MAX tokens once the bucket is full.
        if self.debt > u64::MAX - size {
            return Err(RateLimiterStateError::DebtTooLarge {
                bucket,
                debt: self.debt,
            });
        }
        if self.burst_left > self.config.one_time_burst {
            return Err(RateLimiterStateError::BurstAboveConfig {
                bucket,
                burst_left: self.burst_left,
                one_time_burst: self.config.one_time_burst,
            });
        }
        let refill_ns = u128::from(self.config.refill_time_ms) * super::NANOS_PER_MILLI;
        if u128::from(self.partial) >= refill_ns.max(1) {
            return Err(RateLimiterStateError::PartialTooLarge {
                bucket,
                partial: self.partial,
                refill_ns,
            });
        }
        Ok(())
    }
}

impl RateLimiterState {
    /// Refuses a bucket that cannot have been saved (more tokens than its size, more
    /// burst than configured): a damaged or forged state.
    pub fn check(&self) -> Result<(), RateLimiterStateError> {
        if let Some(bucket) = &self.bandwidth {
            bucket.check("bandwidth")?;
        }
        if let Some(bucket) = &self.ops {
            bucket.check("ops")?;
        }
        Ok(())
    }
}

impl TokenBucket {
    fn save_at(&self, now: Instant) -> TokenBucketState {
        let since = now.saturating_duration_since(self.last_update);
        TokenBucketState {
            config: self.config,
            budget: u64::try_from(self.budget.max(0)).unwrap_or(u64::MAX),
            debt: u64::try_from(-self.budget.min(0)).unwrap_or(u64::MAX),
            burst_left: self.burst_left,
            // Below refill_ns, which fits u64 (refill_time_ms is at most u32::MAX).
            partial: u64::try_from(self.partial).unwrap_or(u64::MAX),
            since_refill_ns: u64::try_from(since.as_nanos()).unwrap_or(u64::MAX),
        }
    }

    fn load_at(&mut self, state: &TokenBucketState, now: Instant) {
        self.budget = i128::from(state.budget) - i128::from(state.debt);
        self.burst_left = state.burst_left;
        self.partial = u128::from(state.partial);
        // A reference point the monotonic clock cannot express (a forged, huge interval)
        // counts from now: the bucket then earns nothing for it.
        self.last_update = now
            .checked_sub(Duration::from_nanos(state.since_refill_ns))
            .unwrap_or(now);
    }
}

/// Loads `saved` into `current` when their configurations match; otherwise the bucket
/// stays as it is (full, in a freshly built device).
fn load_matching(
    current: Option<&mut TokenBucket>,
    saved: Option<&TokenBucketState>,
    bucket: &'static str,
    now: Instant,
) {
    match (current, saved) {
        (Some(current), Some(saved)) if current.config == saved.config => {
            current.load_at(saved, now)
        }
        (current, Some(saved)) => log::info!(
            "rate limiter {bucket} bucket: configured {:?} now, {:?} in the snapshot: it starts full",
            current.map(|c| c.config),
            saved.config
        ),
        (_, None) => {}
    }
}

impl RateLimiter {
    pub(super) fn save_at(&self, now: Instant) -> RateLimiterState {
        RateLimiterState {
            bandwidth: self.bandwidth.as_ref().map(|b| b.save_at(now)),
            ops: self.ops.as_ref().map(|b| b.save_at(now)),
        }
    }

    pub(super) fn restore_at(
        &mut self,
        state: &RateLimiterState,
        now: Instant,
    ) -> Result<(), RateLimiterStateError> {
        // Both checked before either changes.
        state.check()?;
        load_matching(
            self.bandwidth.as_mut(),
            state.bandwidth.as_ref(),
            "bandwidth",
            now,
        );
        load_matching(self.ops.as_mut(), state.ops.as_ref(), "ops", now);
        Ok(())
    }
}

impl Persist for RateLimiter {
    type State = RateLimiterState;
    type Error = RateLimiterStateError;

    /// The buckets as they stand now (the device is paused, so nothing consumes).
    fn save(&self) -> Result<RateLimiterState, RateLimiterStateError> {
        Ok(self.save_at(Instant::now()))
    }

    /// Loads the saved buckets into this limiter's buckets of the same configuration; a
    /// state that cannot have been saved (more tokens than the bucket holds, more burst
    /// than configured) is refused and nothing changes.
    fn restore(&mut self, state: &RateLimiterState) -> Result<(), RateLimiterStateError> {
        self.restore_at(state, Instant::now())
    }
}
