//! Bounded retries with full jitter: the delay before retry `n` is uniform in
//! `[0, min(cap, base · 2ⁿ)]`, the whole loop is bounded by a deadline computed once and by an
//! attempt cap, and the random source and the clock are injected so that a seeded sequence is
//! reproducible and tests need no real time.
//!
//! Invariant: [`Backoff::next_delay`] never returns a delay that ends past the deadline, and
//! returns `None` once the attempts or the time are used up.

use std::time::{Duration, Instant};

use rand::{Rng, RngExt};

/// What the retry loop may spend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Policy {
    pub base: Duration,
    pub cap: Duration,
    /// Retries after the first attempt.
    pub max_retries: u32,
    /// Total time from the first attempt.
    pub budget: Duration,
}

impl Policy {
    /// Polling a reap until the engine lists nothing of the stack: swarm finishes removals
    /// within seconds, so the rounds stay short; the reap budget, not this, bounds the loop.
    pub(crate) const CONFIRM: Policy = Policy {
        base: Duration::from_millis(25),
        cap: Duration::from_millis(100),
        max_retries: u32::MAX,
        budget: Duration::from_secs(365 * 86_400),
    };

    /// Polling a stack until it converges: the rounds stay short so that the command returns
    /// soon after swarm has converged (p95 under a quarter of a second); `--timeout`, not this,
    /// bounds the loop.
    pub(crate) const CONVERGE: Policy = Policy {
        base: Duration::from_millis(25),
        cap: Duration::from_millis(160),
        max_retries: u32::MAX,
        budget: Duration::from_secs(365 * 86_400),
    };

    /// The upper bound of the delay before retry `attempt` (0-based): `min(cap, base · 2^attempt)`,
    /// clamped before the multiplication could overflow.
    pub(crate) fn ceiling(&self, attempt: u32) -> Duration {
        let base = self.base.as_nanos();
        let cap = self.cap.as_nanos();
        let ceiling = if attempt >= 127 || base > (cap >> attempt.min(127)) {
            cap
        } else {
            (base << attempt).min(cap)
        };
        Duration::from_nanos(u64::try_from(ceiling).unwrap_or(u64::MAX))
    }
}

/// A source of "now": the real monotonic clock, or a test's.
pub(crate) trait Clock {
    fn now(&self) -> Instant;
}

/// The real monotonic clock.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct MonotonicClock;

impl Clock for MonotonicClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// One retry loop's state.
#[derive(Debug)]
pub(crate) struct Backoff<R, C> {
    policy: Policy,
    rng: R,
    clock: C,
    deadline: Instant,
    retries: u32,
}

impl<R: Rng, C: Clock> Backoff<R, C> {
    /// Start a loop now: the deadline is fixed here, once.
    pub(crate) fn new(policy: Policy, rng: R, clock: C) -> Self {
        let deadline = clock.now() + policy.budget;
        Self {
            policy,
            rng,
            clock,
            deadline,
            retries: 0,
        }
    }

    /// The delay to wait before the next retry, or `None` when no retry is left.
    pub(crate) fn next_delay(&mut self) -> Option<Duration> {
        if self.retries >= self.policy.max_retries {
            return None;
        }
        let now = self.clock.now();
        if now >= self.deadline {
            return None;
        }
        let ceiling = self.policy.ceiling(self.retries);
        let drawn = Duration::from_nanos(
            self.rng
                .random_range(0..=u64::try_from(ceiling.as_nanos()).unwrap_or(u64::MAX)),
        );
        self.retries += 1;
        Some(drawn.min(self.deadline - now))
    }

    #[cfg(test)]
    fn retries(&self) -> u32 {
        self.retries
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::Xoshiro256PlusPlus;
    use std::cell::Cell;
    use std::rc::Rc;

    /// A clock that moves only when told to.
    #[derive(Clone)]
    struct FakeClock(Rc<Cell<Instant>>);

    impl FakeClock {
        fn new() -> Self {
            Self(Rc::new(Cell::new(Instant::now())))
        }
        fn advance(&self, by: Duration) {
            self.0.set(self.0.get() + by);
        }
    }

    impl Clock for FakeClock {
        fn now(&self) -> Instant {
            self.0.get()
        }
    }

    const POLICY: Policy = Policy {
        base: Duration::from_millis(10),
        cap: Duration::from_secs(1),
        max_retries: 8,
        budget: Duration::from_secs(5),
    };

    fn delays(seed: u64) -> Vec<Duration> {
        let mut b = Backoff::new(
            POLICY,
            Xoshiro256PlusPlus::seed_from_u64(seed),
            FakeClock::new(),
        );
        std::iter::from_fn(|| b.next_delay()).collect()
    }

    #[test]
    fn a_seeded_sequence_is_identical_across_runs() {
        assert_eq!(delays(42), delays(42));
        assert_ne!(delays(42), delays(43));
    }

    #[test]
    fn each_delay_stays_under_its_ceiling_and_the_cap_stops_the_loop() {
        let d = delays(7);
        assert_eq!(d.len(), POLICY.max_retries as usize);
        for (n, delay) in d.iter().enumerate() {
            assert!(*delay <= POLICY.ceiling(n as u32), "retry {n}: {delay:?}");
        }
    }

    #[test]
    fn ceiling_doubles_then_caps_and_never_overflows() {
        assert_eq!(POLICY.ceiling(0), Duration::from_millis(10));
        assert_eq!(POLICY.ceiling(3), Duration::from_millis(80));
        assert_eq!(POLICY.ceiling(7), Duration::from_secs(1));
        for attempt in [63, 64, 65, 127, 128, u32::MAX] {
            assert_eq!(POLICY.ceiling(attempt), POLICY.cap, "attempt {attempt}");
        }
        let huge = Policy {
            base: Duration::MAX,
            cap: Duration::MAX,
            ..POLICY
        };
        assert_eq!(huge.ceiling(5), Duration::from_nanos(u64::MAX));
    }

    #[test]
    fn the_loop_stops_at_its_deadline() {
        let clock = FakeClock::new();
        let policy = Policy {
            max_retries: u32::MAX,
            ..POLICY
        };
        let mut b = Backoff::new(policy, Xoshiro256PlusPlus::seed_from_u64(1), clock.clone());
        let mut slept = Duration::ZERO;
        while let Some(delay) = b.next_delay() {
            clock.advance(delay);
            slept += delay;
            assert!(slept <= policy.budget, "slept past the deadline: {slept:?}");
            // Each retry itself takes time too.
            clock.advance(Duration::from_millis(100));
        }
        assert!(b.retries() > 0);
    }

    /// Full jitter: at an attempt whose ceiling is the cap, 10 000 draws spread evenly over
    /// [0, cap] (chi-square over 10 buckets, far below the 0.1 % critical value 27.9).
    #[test]
    fn draws_are_uniform_over_zero_to_cap() {
        let policy = Policy {
            max_retries: u32::MAX,
            budget: Duration::from_secs(1 << 40),
            ..POLICY
        };
        let mut rng = Xoshiro256PlusPlus::seed_from_u64(2026);
        let mut buckets = [0u32; 10];
        let cap = policy.cap.as_nanos() as f64;
        for _ in 0..10_000 {
            let mut b = Backoff::new(policy, &mut rng, FakeClock::new());
            for _ in 0..20 {
                b.next_delay();
            }
            let d = b.next_delay().unwrap().as_nanos() as f64;
            let i = ((d / cap) * 10.0).floor().min(9.0) as usize;
            buckets[i] += 1;
        }
        let chi2: f64 = buckets
            .iter()
            .map(|&o| (f64::from(o) - 1000.0).powi(2) / 1000.0)
            .sum();
        assert!(chi2 < 27.9, "buckets {buckets:?}, chi² {chi2}");
    }
}
