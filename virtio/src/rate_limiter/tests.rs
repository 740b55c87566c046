//! The token buckets against a clock the tests move by hand, and the timer that wakes a
//! blocked device.

use super::*;

fn bucket(size: u64, one_time_burst: u64, refill_time_ms: u64) -> TokenBucketConfig {
    TokenBucketConfig {
        size,
        one_time_burst,
        refill_time_ms,
    }
}

/// Limits bytes only.
fn bandwidth(bucket: TokenBucketConfig) -> RateLimiterConfig {
    RateLimiterConfig {
        bandwidth: Some(bucket),
        ops: None,
    }
}

/// Limits operations only.
fn ops(bucket: TokenBucketConfig) -> RateLimiterConfig {
    RateLimiterConfig {
        bandwidth: None,
        ops: Some(bucket),
    }
}

fn limiter(config: RateLimiterConfig, start: Instant) -> RateLimiter {
    RateLimiter::new_at(config, start).unwrap()
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn timer_armed(limiter: &RateLimiter) -> bool {
    limiter.timer.as_ref().unwrap().is_armed().unwrap()
}

#[test]
fn validation_refuses_empty_or_never_refilling_buckets() {
    let cases = [
        (bucket(0, 0, 100), "size"),
        (bucket(0, 0, 0), "size"),
        (bucket(100, 0, 0), "refill_time_ms"),
        (bucket(100, 5, MAX_REFILL_TIME_MS + 1), "longer"),
    ];
    for (config, word) in cases {
        for limiter_config in [bandwidth(config), ops(config)] {
            let error = RateLimiter::new(limiter_config).unwrap_err().to_string();
            assert!(error.contains(word), "{error}");
        }
    }
    assert!(RateLimiter::new(RateLimiterConfig {
        bandwidth: Some(bucket(1, 0, MAX_REFILL_TIME_MS)),
        ops: Some(bucket(u64::MAX, u64::MAX, 1)),
    })
    .is_ok());
}

#[test]
fn config_parses_with_defaults_and_refuses_unknown_fields() {
    let config: RateLimiterConfig =
        serde_json::from_str(r#"{"bandwidth": {"size": 1000, "refill_time_ms": 100}}"#).unwrap();
    assert_eq!(config.bandwidth, Some(bucket(1000, 0, 100)));
    assert_eq!(config.ops, None);
    assert!(serde_json::from_str::<RateLimiterConfig>(r#"{"bandwith": null}"#).is_err());
    assert!(serde_json::from_str::<RateLimiterConfig>(
        r#"{"ops": {"size": 1, "refill_time_ms": 1, "burst": 3}}"#
    )
    .is_err());
}

#[test]
fn unlimited_always_consumes() {
    let mut limiter = RateLimiter::unlimited();
    assert!(limiter.timer_fd() >= 0);
    for _ in 0..1000 {
        assert!(limiter.consume(u64::MAX, u64::MAX));
    }
    assert!(!limiter.is_blocked());
    assert_eq!(limiter.config(), RateLimiterConfig::default());
    let from_empty_config = RateLimiter::new(RateLimiterConfig::default()).unwrap();
    assert!(from_empty_config.timer_fd() >= 0);
}

#[test]
fn full_bucket_then_exact_refill() {
    let start = Instant::now();
    // 1000 bytes per second: one token per millisecond.
    let mut limiter = limiter(bandwidth(bucket(1000, 0, 1000)), start);
    assert!(limiter.consume_at(600, 0, start));
    assert!(limiter.consume_at(400, 0, start));
    assert!(!limiter.consume_at(1, 0, start));
    assert!(limiter.is_blocked());
    assert_eq!(limiter.last_wait, Some(ms(1)));
    assert!(timer_armed(&limiter));
    // Blocked: even with tokens back it refuses until the timer was handled.
    assert!(!limiter.consume_at(1, 0, start + ms(500)));
    limiter.on_timer();
    assert!(!limiter.is_blocked());
    assert!(!timer_armed(&limiter));
    // 250 ms earned 250 tokens, no more.
    assert!(!limiter.consume_at(251, 0, start + ms(250)));
    assert_eq!(limiter.last_wait, Some(ms(1)));
    limiter.on_timer();
    assert!(limiter.consume_at(250, 0, start + ms(250)));
    assert!(!limiter.consume_at(1, 0, start + ms(250)));
    limiter.on_timer();
    // Fractions of a token carry over between refills.
    let t = start + ms(250);
    let half = Duration::from_micros(500);
    assert!(!limiter.consume_at(1, 0, t + half));
    assert_eq!(limiter.last_wait, Some(half));
    limiter.on_timer();
    assert!(limiter.consume_at(1, 0, t + half * 2));
    assert!(!limiter.consume_at(1, 0, t + half * 3));
    // Half a token is there: the wait is for the other half.
    assert_eq!(limiter.last_wait, Some(half));
    limiter.on_timer();
    assert!(limiter.consume_at(1, 0, t + half * 4));
    // A long idle time does not overfill the bucket.
    let later = start + Duration::from_secs(3600);
    assert!(limiter.consume_at(1000, 0, later));
    assert!(!limiter.consume_at(1, 0, later));
}

#[test]
fn refill_with_an_awkward_ratio_is_exact() {
    let start = Instant::now();
    // 7 tokens per 3 ms: not a whole number of nanoseconds per token.
    let mut limiter = limiter(ops(bucket(7, 0, 3)), start);
    assert!(limiter.consume_at(0, 7, start));
    // Ask one token at a time at 1 µs steps over 3 ms: exactly 7 tokens come back.
    let mut served = 0;
    for step in 1..=3000u64 {
        let now = start + Duration::from_micros(step);
        if limiter.consume_at(0, 1, now) {
            served += 1;
        } else {
            // The wait is what one token costs: ceil(3 ms / 7) at most.
            assert!(limiter.last_wait.unwrap() <= Duration::from_nanos(428_572));
            limiter.on_timer();
        }
    }
    assert_eq!(served, 7);
}

#[test]
fn one_time_burst_comes_first_and_does_not_refill() {
    let start = Instant::now();
    let mut limiter = limiter(bandwidth(bucket(100, 1000, 100)), start);
    // 1000 burst + 100 budget.
    assert!(limiter.consume_at(900, 0, start));
    // 100 from the burst, 50 from the budget.
    assert!(limiter.consume_at(150, 0, start));
    assert!(limiter.consume_at(50, 0, start));
    assert!(!limiter.consume_at(1, 0, start));
    limiter.on_timer();
    // A second later the bucket is full again, but the burst is gone.
    let later = start + Duration::from_secs(1);
    assert!(limiter.consume_at(100, 0, later));
    assert!(!limiter.consume_at(1, 0, later));
    assert_eq!(limiter.config().bandwidth, Some(bucket(100, 1000, 100)));
}

#[test]
fn both_buckets_all_or_nothing() {
    let start = Instant::now();
    let mut limiter = limiter(
        RateLimiterConfig {
            bandwidth: Some(bucket(1000, 0, 1000)),
            ops: Some(bucket(2, 0, 1000)),
        },
        start,
    );
    assert!(limiter.consume_at(100, 1, start));
    // Bandwidth short: the op is not taken either.
    assert!(!limiter.consume_at(901, 1, start));
    limiter.on_timer();
    assert!(limiter.consume_at(900, 1, start));
    // Ops short (2 used): the bytes are not taken.
    assert!(!limiter.consume_at(0, 1, start));
    // One op comes back after 500 ms (zero bytes need no bandwidth).
    assert_eq!(limiter.last_wait, Some(ms(500)));
    limiter.on_timer();
    let t = start + ms(500);
    assert!(limiter.consume_at(300, 1, t));
    // 200 bytes remain: 201 fail, and take nothing.
    assert!(!limiter.consume_at(201, 0, t));
    limiter.on_timer();
    assert!(limiter.consume_at(200, 0, t));
    assert!(!limiter.consume_at(1, 0, t));
    limiter.on_timer();
}

#[test]
fn bigger_than_the_bucket_goes_when_full_and_leaves_debt() {
    let start = Instant::now();
    let mut limiter = limiter(bandwidth(bucket(1000, 0, 1000)), start);
    // A full bucket lets a 5000-byte request through, 4000 in debt.
    assert!(limiter.consume_at(5000, 0, start));
    // The debt plus one token must refill first: 4001 ms.
    assert!(!limiter.consume_at(1, 0, start));
    assert_eq!(limiter.last_wait, Some(ms(4001)));
    limiter.on_timer();
    assert!(!limiter.consume_at(1, 0, start + ms(4000)));
    limiter.on_timer();
    assert!(limiter.consume_at(1, 0, start + ms(4001)));
    // Another big one needs a full bucket again: 1000 ms more (999 to refill + the one
    // just taken).
    let t = start + ms(4001);
    assert!(!limiter.consume_at(u64::MAX, 0, t));
    assert_eq!(limiter.last_wait, Some(ms(1000)));
    limiter.on_timer();
    // Even u64::MAX bytes go through, and nothing overflows.
    assert!(limiter.consume_at(u64::MAX, 0, t + ms(1000)));
    assert!(!limiter.consume_at(1, 0, t + ms(1000)));
    // The wait saturates instead of overflowing.
    assert!(limiter.last_wait.unwrap() >= Duration::from_secs(1 << 30));
    limiter.on_timer();
}

#[test]
fn timer_fires_for_real_and_unblocks() {
    let mut limiter = RateLimiter::new(ops(bucket(1, 0, 20))).unwrap();
    assert!(limiter.consume(0, 1));
    assert!(!limiter.consume(0, 1));
    assert!(limiter.is_blocked());
    let wait = limiter.last_wait.unwrap();
    assert!(wait > Duration::ZERO && wait <= ms(20), "{wait:?}");
    let mut poll = libc::pollfd {
        fd: limiter.timer_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, and the count says one.
    let ready = unsafe { libc::poll(&mut poll, 1, 5000) };
    assert_eq!(ready, 1, "the timer did not fire");
    limiter.on_timer();
    assert!(!limiter.is_blocked());
    // The fd is drained: not readable any more.
    // SAFETY: as above.
    let ready = unsafe { libc::poll(&mut poll, 1, 0) };
    assert_eq!(ready, 0);
    assert!(limiter.consume(0, 1));
}

#[test]
fn update_replaces_changed_buckets_and_rearms_a_blocked_timer() {
    let start = Instant::now();
    let config = RateLimiterConfig {
        bandwidth: Some(bucket(100, 0, 1000)),
        ops: Some(bucket(10, 0, 1000)),
    };
    let mut limiter = limiter(config, start);
    let fd = limiter.timer_fd();
    assert!(limiter.consume_at(100, 1, start));
    // The same config again: the empty bandwidth bucket stays empty.
    limiter.update_at(config, start).unwrap();
    assert!(!limiter.consume_at(1, 0, start));
    assert!(limiter.is_blocked());
    assert_eq!(limiter.last_wait, Some(ms(10)));
    // A new bandwidth bucket starts full, the ops bucket is gone; the blocked limiter
    // fires at once.
    let new_config = bandwidth(bucket(200, 0, 1000));
    limiter.update_at(new_config, start).unwrap();
    assert_eq!(limiter.config(), new_config);
    assert_eq!(limiter.timer_fd(), fd);
    assert_eq!(limiter.last_wait, Some(Duration::from_nanos(1)));
    let mut poll = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, and the count says one.
    assert_eq!(unsafe { libc::poll(&mut poll, 1, 5000) }, 1);
    limiter.on_timer();
    assert!(limiter.consume_at(200, 1_000_000, start));
    // Nothing limits any more once both buckets are left out.
    limiter
        .update_at(RateLimiterConfig::default(), start)
        .unwrap();
    assert!(limiter.consume_at(u64::MAX, u64::MAX, start));
    // An invalid update changes nothing.
    assert!(limiter
        .update(RateLimiterConfig {
            bandwidth: Some(bucket(0, 0, 1)),
            ops: None
        })
        .is_err());
    assert_eq!(limiter.config(), RateLimiterConfig::default());
}

#[test]
fn unlimited_can_become_limited() {
    let start = Instant::now();
    let mut limiter = RateLimiter::unlimited();
    let fd = limiter.timer_fd();
    limiter.update_at(ops(bucket(1, 0, 1000)), start).unwrap();
    assert_eq!(limiter.timer_fd(), fd);
    assert!(limiter.consume_at(0, 1, start));
    assert!(!limiter.consume_at(0, 1, start));
    assert!(timer_armed(&limiter));
}

#[test]
fn refund_gives_tokens_back_up_to_the_size() {
    let start = Instant::now();
    let mut limiter = limiter(bandwidth(bucket(100, 0, 1000)), start);
    assert!(limiter.consume_at(100, 0, start));
    limiter.refund(60, 0);
    assert!(limiter.consume_at(60, 0, start));
    assert!(!limiter.consume_at(1, 0, start));
    limiter.on_timer();
    limiter.refund(1000, 0);
    assert!(limiter.consume_at(100, 0, start));
    assert!(!limiter.consume_at(1, 0, start));
}

#[test]
fn time_going_backwards_earns_nothing() {
    let start = Instant::now() + Duration::from_secs(10);
    let mut limiter = limiter(bandwidth(bucket(10, 0, 10)), start);
    assert!(limiter.consume_at(10, 0, start));
    assert!(!limiter.consume_at(1, 0, start - ms(5)));
    limiter.on_timer();
    assert!(limiter.consume_at(1, 0, start + ms(1)));
}

/// Issue 25: a restored limiter goes on where the saved one stopped, through JSON: the
/// budget spent, the burst used, the time earned before the pause; the time between save
/// and restore earns nothing.
#[test]
fn a_restored_limiter_continues_without_a_fresh_burst() {
    let start = Instant::now();
    let config = RateLimiterConfig {
        bandwidth: Some(bucket(1000, 500, 100)),
        ops: Some(bucket(10, 0, 100)),
    };
    let mut saved = limiter(config, start);
    // The burst and 900 of the budget go; 3 operations.
    assert!(saved.consume_at(1400, 3, start));
    // 40 ms earn 400 bytes and 4 operations (capped at the size).
    let state = saved.save_at(start + ms(40));
    let state: RateLimiterState =
        serde_json::from_str(&serde_json::to_string(&state).unwrap()).unwrap();
    let bandwidth_state = state.bandwidth.unwrap();
    assert_eq!(
        (
            bandwidth_state.budget,
            bandwidth_state.debt,
            bandwidth_state.burst_left
        ),
        (100, 0, 0)
    );
    assert_eq!(bandwidth_state.since_refill_ns, 40_000_000);

    // Restored much later: the bucket stands as it did 40 ms after the last refill.
    let later = start + Duration::from_secs(3600);
    let mut restored = limiter(config, later);
    restored.restore_at(&state, later).unwrap();
    assert!(restored.consume_at(500, 1, later), "100 + 400 earned");
    assert!(
        !restored.consume_at(1, 1, later),
        "no fresh burst, no tokens earned between save and restore"
    );

    // A fresh limiter would have had the burst: the restore is what took it away.
    let mut fresh = limiter(config, later);
    assert!(fresh.consume_at(1500, 1, later));
}

#[test]
fn a_saved_bucket_loads_only_into_one_configured_alike() {
    let start = Instant::now();
    let mut saved = limiter(bandwidth(bucket(1000, 0, 100)), start);
    assert!(saved.consume_at(1000, 1, start));
    let state = saved.save_at(start);
    // Through a flattened structure, as in the state file (serde buffers it).
    #[derive(serde::Serialize, serde::Deserialize)]
    struct Outer {
        #[serde(flatten)]
        inner: Inner,
    }
    #[derive(serde::Serialize, serde::Deserialize)]
    struct Inner {
        limiter: RateLimiterState,
    }
    let json = serde_json::to_string(&Outer {
        inner: Inner { limiter: state },
    })
    .unwrap();
    let back: Outer = serde_json::from_str(&json).unwrap();
    assert_eq!(back.inner.limiter, state);
    // Another size: the bucket starts full.
    let mut other = limiter(bandwidth(bucket(2000, 0, 100)), start);
    other.restore_at(&state, start).unwrap();
    assert!(other.consume_at(2000, 1, start));
    // No bandwidth bucket at all: nothing to load, nothing limited.
    let mut unlimited = limiter(RateLimiterConfig::default(), start);
    unlimited.restore_at(&state, start).unwrap();
    assert!(unlimited.consume_at(u64::MAX, 1, start));
}

#[test]
fn impossible_bucket_states_are_refused_and_change_nothing() {
    let start = Instant::now();
    let config = RateLimiterConfig {
        bandwidth: Some(bucket(1000, 500, 100)),
        ops: Some(bucket(10, 0, 100)),
    };
    let good = limiter(config, start).save_at(start);
    let with = |change: &dyn Fn(&mut TokenBucketState)| {
        let mut state = good;
        change(state.ops.as_mut().unwrap());
        state
    };
    let cases: [(RateLimiterState, &str); 5] = [
        (
            with(&|b| {
                b.budget = 1;
                b.debt = 1
            }),
            "both",
        ),
        (with(&|b| b.budget = 11), "more than its size"),
        (with(&|b| b.debt = u64::MAX), "debt"),
        (with(&|b| b.burst_left = 1), "one-time burst"),
        (with(&|b| b.partial = 100_000_000), "partial"),
    ];
    for (state, needle) in cases {
        let mut target = limiter(config, start);
        let error = target.restore_at(&state, start).unwrap_err().to_string();
        assert!(error.contains(needle), "{error}");
        // The bandwidth bucket, checked first and valid, was not loaded either: still
        // the full burst and budget.
        assert!(target.consume_at(1500, 10, start), "{needle}");
    }
}

#[test]
fn a_debt_is_saved_and_still_owed_after_the_restore() {
    let start = Instant::now();
    let config = bandwidth(bucket(1000, 0, 100));
    let mut saved = limiter(config, start);
    // A request of 3000 bytes goes with a full bucket and leaves a debt of 2000.
    assert!(saved.consume_at(3000, 1, start));
    let state = saved.save_at(start);
    let bucket_state = state.bandwidth.unwrap();
    assert_eq!((bucket_state.budget, bucket_state.debt), (0, 2000));
    let later = start + Duration::from_secs(60);
    let mut restored = limiter(config, later);
    restored.restore_at(&state, later).unwrap();
    assert!(!restored.consume_at(1, 1, later), "still in debt");
    // The debt and a full bucket take 300 ms to earn.
    let mut check = limiter(config, later);
    check.restore_at(&state, later).unwrap();
    assert!(!check.consume_at(1000, 1, later + ms(299)));
    let mut check = limiter(config, later);
    check.restore_at(&state, later).unwrap();
    assert!(check.consume_at(1000, 1, later + ms(300)));
}
