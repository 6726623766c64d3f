//! The one retry schedule: how long to wait before trying again, for every retry in Stagehand.
//!
//! A negative ack after a retryable failure (`[worker] retry`), the first connection to NATS, a
//! provisioning step during a JetStream election, a KV bucket created by two services at once, a
//! ledger reopened after a failure, a dead letter that could not be stored, a poll for a stream's
//! replicas to settle or for the catalogue to record an answer, a demotion pass retried: each is
//! a [`RetrySchedule`] (exponential from `initial`, times `factor`, capped at `max`, with up to
//! `jitter` taken off at random), read either as the delay after the n-th failure
//! ([`RetrySchedule::delay`]) or as an iterator of delays ([`RetrySchedule::delays`]), which is
//! also what `backon`'s `retry` takes.
//!
//! ```
//! use std::time::Duration;
//! use stagehand_bus::RetrySchedule;
//!
//! let poll = RetrySchedule::exponential(Duration::from_millis(20), Duration::from_millis(500));
//! let delays: Vec<Duration> = poll.delays().times(6).collect();
//! assert_eq!(delays.first(), Some(&Duration::from_millis(20)));
//! assert_eq!(delays.last(), Some(&Duration::from_millis(500)));
//! ```

use std::time::Duration;

use rand::Rng;
use serde::{Deserialize, Serialize};

/// Delays between attempts: exponential from `initial`, times `factor` per failure, capped at
/// `max`, with up to `jitter` of each delay taken off at random so that many messages (or
/// clients) failing together do not all come back at once.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetrySchedule {
    /// Delay after the first failed delivery.
    #[serde(with = "stagehand_config::duration")]
    pub initial: Duration,
    /// Longest delay.
    #[serde(with = "stagehand_config::duration")]
    pub max: Duration,
    /// Growth per delivery (≥ 1).
    pub factor: f64,
    /// Fraction (0–1) of each delay that may be removed at random.
    pub jitter: f64,
}

impl Default for RetrySchedule {
    fn default() -> Self {
        Self {
            initial: Duration::from_secs(1),
            max: Duration::from_secs(300),
            factor: 2.0,
            jitter: 0.2,
        }
    }
}

impl RetrySchedule {
    /// Doubling from `initial` up to `max`, without jitter.
    pub const fn exponential(initial: Duration, max: Duration) -> Self {
        Self {
            initial,
            max,
            factor: 2.0,
            jitter: 0.0,
        }
    }

    /// The same schedule with up to `jitter` (0–1) of each delay taken off at random.
    pub const fn with_jitter(mut self, jitter: f64) -> Self {
        self.jitter = jitter;
        self
    }

    /// The delay after failure number `failure` (1-based; for a negative ack, the number of the
    /// delivery that failed), jittered.
    pub fn delay(&self, failure: u64) -> Duration {
        let base = self.base_delay(failure);
        if self.jitter <= 0.0 {
            return base;
        }
        let cut = rand::rng().random_range(0.0..=self.jitter.min(1.0));
        base.mul_f64(1.0 - cut)
    }

    /// The delay after failure number `failure`, without jitter.
    pub fn base_delay(&self, failure: u64) -> Duration {
        let exp = failure.saturating_sub(1).min(64) as i32;
        let secs = self.initial.as_secs_f64() * self.factor.max(1.0).powi(exp);
        if !secs.is_finite() || secs >= self.max.as_secs_f64() {
            self.max
        } else {
            Duration::from_secs_f64(secs)
        }
    }

    /// The delays after the first, second, … failure: endless unless bounded with
    /// [`Delays::times`] or [`Delays::within`].
    pub fn delays(&self) -> Delays {
        Delays {
            schedule: self.clone(),
            failures: 0,
            times_left: None,
            budget_left: None,
        }
    }
}

/// The delays of a [`RetrySchedule`], one per failure; a `backon` backoff.
#[derive(Debug, Clone)]
pub struct Delays {
    schedule: RetrySchedule,
    failures: u64,
    times_left: Option<usize>,
    budget_left: Option<Duration>,
}

impl Delays {
    /// At most `times` delays (so `times` retries after the first attempt).
    pub fn times(mut self, times: usize) -> Self {
        self.times_left = Some(times);
        self
    }

    /// No delay that would bring the delays so far past `total`.
    pub fn within(mut self, total: Duration) -> Self {
        self.budget_left = Some(total);
        self
    }
}

impl Iterator for Delays {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        if let Some(times) = &mut self.times_left {
            *times = times.checked_sub(1)?;
        }
        self.failures = self.failures.saturating_add(1);
        let delay = self.schedule.delay(self.failures);
        if let Some(budget) = &mut self.budget_left {
            *budget = budget.checked_sub(delay)?;
        }
        Some(delay)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_grows_caps_and_jitters_down() {
        let s = RetrySchedule {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(1),
            factor: 2.0,
            jitter: 0.5,
        };
        assert_eq!(s.base_delay(1), Duration::from_millis(100));
        assert_eq!(s.base_delay(3), Duration::from_millis(400));
        assert_eq!(s.base_delay(10), Duration::from_secs(1));
        assert_eq!(s.base_delay(u64::MAX), Duration::from_secs(1));
        for d in 1..10 {
            let j = s.delay(d);
            assert!(j <= s.base_delay(d) && j >= s.base_delay(d) / 2, "{j:?}");
        }
    }

    #[test]
    fn delays_follow_the_schedule_within_their_bounds() {
        let s = RetrySchedule::exponential(Duration::from_millis(100), Duration::from_millis(500));
        let ms = |d: Vec<Duration>| d.iter().map(Duration::as_millis).collect::<Vec<_>>();
        assert_eq!(ms(s.delays().times(5).collect()), [100, 200, 400, 500, 500]);
        assert_eq!(s.delays().take(100).count(), 100, "endless unless bounded");
        // 100 + 200 + 400 = 700 fits in 1 s; the next 500 would not.
        assert_eq!(
            ms(s.delays().within(Duration::from_secs(1)).collect()),
            [100, 200, 400]
        );
        assert_eq!(s.delays().times(0).next(), None);
        let jittered = s.clone().with_jitter(0.5);
        for (n, d) in jittered.delays().times(5).enumerate() {
            let base = s.base_delay(n as u64 + 1);
            assert!(d <= base && d >= base / 2, "{d:?}");
        }
    }
}
