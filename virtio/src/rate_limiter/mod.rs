//! Token-bucket rate limiting for device I/O (block, net, rng), Firecracker's shape: a
//! bandwidth bucket (bytes) and an operations bucket (requests), each `size` tokens refilled
//! linearly over `refill_time_ms`, plus a one-time burst that does not refill.
//!
//! A device asks [`RateLimiter::consume`] before serving a request. When the buckets cannot
//! cover it the limiter is *blocked*: it arms its timerfd for the moment enough tokens will
//! be there, and the device stops serving until its worker sees [`RateLimiter::timer_fd`]
//! readable and calls [`RateLimiter::on_timer`].
//!
//! Requests bigger than a bucket: a request that needs more tokens than the bucket holds
//! goes through once the bucket is *full*, and leaves the bucket in debt (a negative budget)
//! that refills before anything else goes through. So a guest cannot wedge a device with a
//! big request, and the long-run rate still holds.
//!
//! Refill is exact: fractions of a token carry over between refills (no rounding drift), and
//! times come from the monotonic clock (`Instant`, CLOCK_MONOTONIC like the timerfd).

use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

use vmm_sys_util::timerfd::TimerFd;

mod persist;
pub use persist::{RateLimiterState, RateLimiterStateError, TokenBucketState};

const NANOS_PER_MILLI: u128 = 1_000_000;
/// The longest refill time accepted (about 49 days); keeps the token arithmetic in u128.
pub const MAX_REFILL_TIME_MS: u64 = u32::MAX as u64;

/// One token bucket, Firecracker's shape: `size` tokens, refilled completely over
/// `refill_time_ms`, plus an initial `one_time_burst` that does not refill.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenBucketConfig {
    pub size: u64,
    #[serde(default)]
    pub one_time_burst: u64,
    /// Firecracker calls it `refill_time` (also milliseconds).
    #[serde(alias = "refill_time")]
    pub refill_time_ms: u64,
}

/// A bandwidth bucket (bytes) and an operations bucket (requests); a bucket left out does
/// not limit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimiterConfig {
    #[serde(default)]
    pub bandwidth: Option<TokenBucketConfig>,
    #[serde(default)]
    pub ops: Option<TokenBucketConfig>,
}

/// Why a rate limiter configuration was refused, or its timer could not be made.
#[derive(Debug, thiserror::Error)]
pub enum RateLimiterError {
    #[error("rate limiter {bucket} bucket: size must be greater than 0 (leave the bucket out for no limit)")]
    ZeroSize { bucket: &'static str },
    #[error("rate limiter {bucket} bucket: refill_time_ms must be greater than 0 (leave the bucket out for no limit)")]
    ZeroRefillTime { bucket: &'static str },
    #[error("rate limiter {bucket} bucket: refill_time_ms {given} is longer than the maximum {MAX_REFILL_TIME_MS}")]
    RefillTimeTooLong { bucket: &'static str, given: u64 },
    #[error("rate limiter: cannot create its timerfd: {0}")]
    Timer(#[source] std::io::Error),
}

impl TokenBucketConfig {
    fn validate(&self, bucket: &'static str) -> Result<(), RateLimiterError> {
        if self.size == 0 {
            return Err(RateLimiterError::ZeroSize { bucket });
        }
        if self.refill_time_ms == 0 {
            return Err(RateLimiterError::ZeroRefillTime { bucket });
        }
        if self.refill_time_ms > MAX_REFILL_TIME_MS {
            return Err(RateLimiterError::RefillTimeTooLong {
                bucket,
                given: self.refill_time_ms,
            });
        }
        Ok(())
    }
}

impl RateLimiterConfig {
    /// Checks both buckets.
    pub fn validate(&self) -> Result<(), RateLimiterError> {
        if let Some(bandwidth) = &self.bandwidth {
            bandwidth.validate("bandwidth")?;
        }
        if let Some(ops) = &self.ops {
            ops.validate("ops")?;
        }
        Ok(())
    }

    /// Whether neither bucket limits anything.
    pub fn is_unlimited(&self) -> bool {
        self.bandwidth.is_none() && self.ops.is_none()
    }
}

/// One validated bucket and where it stands.
#[derive(Debug)]
struct TokenBucket {
    config: TokenBucketConfig,
    /// `refill_time_ms` in nanoseconds: `size` tokens arrive every `refill_ns`.
    refill_ns: u128,
    /// Tokens in the bucket, at most `size`; negative while a request bigger than the bucket
    /// is being paid back.
    budget: i128,
    /// What is left of the one-time burst, spent before the budget.
    burst_left: u64,
    /// The fraction of the next token already earned, in units of 1/`refill_ns` token.
    partial: u128,
    last_update: Instant,
}

impl TokenBucket {
    /// A full bucket. `config` must be validated.
    fn new(config: TokenBucketConfig, now: Instant) -> Self {
        TokenBucket {
            config,
            refill_ns: u128::from(config.refill_time_ms) * NANOS_PER_MILLI,
            budget: i128::from(config.size),
            burst_left: config.one_time_burst,
            partial: 0,
            last_update: now,
        }
    }

    fn size(&self) -> i128 {
        i128::from(self.config.size)
    }

    /// Adds the tokens earned since the last update: `elapsed * size / refill_ns`, exactly.
    fn refill(&mut self, now: Instant) {
        let Some(elapsed) = now.checked_duration_since(self.last_update) else {
            // A time before the last update (only possible with injected times): nothing
            // earned, and the bucket keeps its later reference point.
            return;
        };
        self.last_update = now;
        if self.budget >= self.size() {
            self.partial = 0;
            return;
        }
        let size = u128::from(self.config.size);
        // Positive: the budget is below size, and partial < refill_ns.
        let deficit = (self.size() - self.budget) as u128;
        let to_full = deficit
            .saturating_mul(self.refill_ns)
            .saturating_sub(self.partial);
        let earned = elapsed.as_nanos().saturating_mul(size);
        if earned >= to_full {
            self.budget = self.size();
            self.partial = 0;
            return;
        }
        // earned < to_full, which fits comfortably: no overflow.
        let accumulated = self.partial + earned;
        self.budget += (accumulated / self.refill_ns) as i128;
        self.partial = accumulated % self.refill_ns;
    }

    /// How much of `tokens` the burst pays, and how much the budget must.
    fn split(&self, tokens: u64) -> (u64, u64) {
        let from_burst = tokens.min(self.burst_left);
        (from_burst, tokens - from_burst)
    }

    /// The budget a request for `tokens` needs before it may go: all of them, or a full
    /// bucket for a request bigger than the bucket.
    fn required_budget(&self, tokens: u64) -> i128 {
        let (_, from_budget) = self.split(tokens);
        i128::from(from_budget.min(self.config.size))
    }

    fn can_take(&self, tokens: u64) -> bool {
        let (_, from_budget) = self.split(tokens);
        from_budget == 0 || self.budget >= self.required_budget(tokens)
    }

    fn take(&mut self, tokens: u64) {
        let (from_burst, from_budget) = self.split(tokens);
        self.burst_left -= from_burst;
        self.budget -= i128::from(from_budget);
    }

    /// Gives back tokens taken for a request that was not served, up to a full bucket.
    fn refund(&mut self, tokens: u64) {
        self.budget = (self.budget + i128::from(tokens)).min(self.size());
        if self.budget == self.size() {
            self.partial = 0;
        }
    }

    /// How long after `last_update` a request for `tokens` can go (zero if it can now).
    fn wait_for(&self, tokens: u64) -> Duration {
        if self.can_take(tokens) {
            return Duration::ZERO;
        }
        let missing = (self.required_budget(tokens) - self.budget) as u128;
        let numerator = missing
            .saturating_mul(self.refill_ns)
            .saturating_sub(self.partial);
        let nanos = numerator.div_ceil(u128::from(self.config.size));
        Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
    }
}

/// A bandwidth and an operations token bucket, with the timerfd that says when a blocked
/// limiter may have tokens again.
#[derive(Debug)]
pub struct RateLimiter {
    bandwidth: Option<TokenBucket>,
    ops: Option<TokenBucket>,
    /// `None` only if an unlimited limiter could not make one (see [`RateLimiter::unlimited`]).
    timer: Option<TimerFd>,
    blocked: bool,
    /// The delay the timer was last armed with (for tests and logs).
    last_wait: Option<Duration>,
}

impl RateLimiter {
    /// Validates `config` and makes the limiter (with full buckets) and its timerfd. A
    /// config without buckets makes an unlimited limiter that can be limited later by
    /// [`RateLimiter::update`] without changing its timer fd.
    pub fn new(config: RateLimiterConfig) -> Result<Self, RateLimiterError> {
        Self::new_at(config, Instant::now())
    }

    fn new_at(config: RateLimiterConfig, now: Instant) -> Result<Self, RateLimiterError> {
        config.validate()?;
        let timer = new_timer().map_err(RateLimiterError::Timer)?;
        Ok(RateLimiter {
            bandwidth: config.bandwidth.map(|c| TokenBucket::new(c, now)),
            ops: config.ops.map(|c| TokenBucket::new(c, now)),
            timer: Some(timer),
            blocked: false,
            last_wait: None,
        })
    }

    /// A limiter without buckets: [`RateLimiter::consume`] always succeeds. It has an idle
    /// timerfd for [`RateLimiter::timer_fd`]; if even that cannot be made (the process is out
    /// of file descriptors) it has none, `timer_fd` returns -1, and registering it fails.
    pub fn unlimited() -> Self {
        let timer = match new_timer() {
            Ok(timer) => Some(timer),
            Err(error) => {
                log::warn!("rate limiter: cannot create its timerfd: {error}");
                None
            }
        };
        RateLimiter {
            bandwidth: None,
            ops: None,
            timer,
            blocked: false,
            last_wait: None,
        }
    }

    /// Takes `bytes` from the bandwidth bucket and `ops` from the ops bucket, all or nothing.
    /// When it cannot, it returns false, arms the timer for when enough tokens will be
    /// there, and the caller retries after the timer fires. While blocked it returns false
    /// without looking at the buckets.
    pub fn consume(&mut self, bytes: u64, ops: u64) -> bool {
        self.consume_at(bytes, ops, Instant::now())
    }

    fn consume_at(&mut self, bytes: u64, ops: u64, now: Instant) -> bool {
        if self.blocked {
            return false;
        }
        if let Some(bucket) = &mut self.bandwidth {
            bucket.refill(now);
        }
        if let Some(bucket) = &mut self.ops {
            bucket.refill(now);
        }
        let bandwidth_ok = self.bandwidth.as_ref().is_none_or(|b| b.can_take(bytes));
        let ops_ok = self.ops.as_ref().is_none_or(|b| b.can_take(ops));
        if bandwidth_ok && ops_ok {
            if let Some(bucket) = &mut self.bandwidth {
                bucket.take(bytes);
            }
            if let Some(bucket) = &mut self.ops {
                bucket.take(ops);
            }
            return true;
        }
        // Both buckets were refilled at `now`, so their waits count from `now`.
        let wait = self
            .bandwidth
            .as_ref()
            .map_or(Duration::ZERO, |b| b.wait_for(bytes))
            .max(
                self.ops
                    .as_ref()
                    .map_or(Duration::ZERO, |b| b.wait_for(ops)),
            );
        if self.arm(wait) {
            self.blocked = true;
            false
        } else {
            // Without a timer nothing would ever unblock the device: serve rather than wedge.
            if let Some(bucket) = &mut self.bandwidth {
                bucket.take(bytes);
            }
            if let Some(bucket) = &mut self.ops {
                bucket.take(ops);
            }
            true
        }
    }

    /// Gives back tokens from a [`RateLimiter::consume`] whose request was not served after
    /// all (e.g. a tap had no frame); the buckets do not grow past their size.
    pub fn refund(&mut self, bytes: u64, ops: u64) {
        if let Some(bucket) = &mut self.bandwidth {
            bucket.refund(bytes);
        }
        if let Some(bucket) = &mut self.ops {
            bucket.refund(ops);
        }
    }

    /// Arms the one-shot timer `wait` from now (at least 1 ns: zero would disarm it).
    fn arm(&mut self, wait: Duration) -> bool {
        let wait = wait.max(Duration::from_nanos(1));
        let Some(timer) = &mut self.timer else {
            log::error!("rate limiter: no timer to wait for tokens with, not limiting");
            return false;
        };
        match timer.reset(wait, None) {
            Ok(()) => {
                self.last_wait = Some(wait);
                true
            }
            Err(error) => {
                log::error!("rate limiter: cannot arm its timer, not limiting: {error}");
                false
            }
        }
    }

    /// Whether the limiter waits for its timer.
    pub fn is_blocked(&self) -> bool {
        self.blocked
    }

    /// Readable when a blocked limiter may have tokens again (register it with the worker's
    /// EventControl). The fd stays the same for the limiter's life, across updates.
    pub fn timer_fd(&self) -> RawFd {
        self.timer.as_ref().map_or(-1, |timer| timer.as_raw_fd())
    }

    /// Call when [`RateLimiter::timer_fd`] is readable: clears it and unblocks. Harmless
    /// when called spuriously (the next consume just blocks again if it must).
    pub fn on_timer(&mut self) {
        if let Some(timer) = &mut self.timer {
            // The fd is non-blocking: EAGAIN when it has not fired, which is fine.
            let _ = timer.wait();
            // Disarms a timer that has not fired yet, so no stale wake-up follows.
            if let Err(error) = timer.clear() {
                log::warn!("rate limiter: cannot disarm its timer: {error}");
            }
        }
        self.blocked = false;
    }

    /// Replaces the buckets (PATCH of a running device); a bucket left `None` becomes
    /// unlimited. A bucket whose config does not change keeps its tokens (so re-sending the
    /// same config grants no new burst); a changed one starts full. A blocked limiter's
    /// timer is re-armed to fire at once, so the device retries under the new limits.
    pub fn update(&mut self, config: RateLimiterConfig) -> Result<(), RateLimiterError> {
        self.update_at(config, Instant::now())
    }

    fn update_at(
        &mut self,
        config: RateLimiterConfig,
        now: Instant,
    ) -> Result<(), RateLimiterError> {
        config.validate()?;
        if self.timer.is_none() && !config.is_unlimited() {
            self.timer = Some(new_timer().map_err(RateLimiterError::Timer)?);
        }
        fn replace(
            old: Option<TokenBucket>,
            new: Option<TokenBucketConfig>,
            now: Instant,
        ) -> Option<TokenBucket> {
            match (old, new) {
                (Some(bucket), Some(config)) if bucket.config == config => Some(bucket),
                (_, new) => new.map(|config| TokenBucket::new(config, now)),
            }
        }
        self.bandwidth = replace(self.bandwidth.take(), config.bandwidth, now);
        self.ops = replace(self.ops.take(), config.ops, now);
        if self.blocked && !self.arm(Duration::ZERO) {
            self.blocked = false;
        }
        Ok(())
    }

    /// The buckets' configuration (as given, not what is left of them).
    pub fn config(&self) -> RateLimiterConfig {
        RateLimiterConfig {
            bandwidth: self.bandwidth.as_ref().map(|b| b.config),
            ops: self.ops.as_ref().map(|b| b.config),
        }
    }
}

impl AsRawFd for RateLimiter {
    fn as_raw_fd(&self) -> RawFd {
        self.timer_fd()
    }
}

/// A timerfd whose reads do not block (the worker reads it only when epoll says it fired,
/// but a spurious or early [`RateLimiter::on_timer`] must not hang the worker).
fn new_timer() -> std::io::Result<TimerFd> {
    let timer = TimerFd::new().map_err(std::io::Error::from)?;
    let fd = timer.as_raw_fd();
    // SAFETY: fcntl on a descriptor this function owns, with integer arguments only.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: as above; sets O_NONBLOCK on the timerfd's own file description.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(timer)
}

#[cfg(test)]
mod tests;
