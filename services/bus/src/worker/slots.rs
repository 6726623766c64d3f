//! The slots that bound a worker's concurrency, so that every pulled message starts its
//! handler at once and none waits in a client buffer while its AckWait runs.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::WorkerConfig;

/// Two kinds of slot bound a worker. A *handler* slot is held while the handler runs
/// (`concurrency` of them); an *in-flight* slot is held from the pull until the ack (as many as
/// the consumer's `max_ack_pending`, 2 × `concurrency`). A message that has finished its work
/// waits for its ledger commit and its acks without keeping a handler from starting, so the
/// fsync latency of the shared commit does not cap throughput at `concurrency` / latency.
pub(super) struct Slots {
    handlers: Arc<Semaphore>,
    in_flight: Arc<Semaphore>,
}

/// The permits one pull holds: as many of each kind as messages asked for.
pub(super) struct PullPermits {
    pub handlers: OwnedSemaphorePermit,
    pub in_flight: OwnedSemaphorePermit,
}

impl Slots {
    pub fn new(cfg: &WorkerConfig) -> Slots {
        Slots {
            handlers: Arc::new(Semaphore::new(cfg.concurrency)),
            in_flight: Arc::new(Semaphore::new(in_flight_window(cfg))),
        }
    }

    fn free(&self) -> usize {
        self.handlers
            .available_permits()
            .min(self.in_flight.available_permits())
    }

    /// Waits until at least one message can be pulled, then takes every free pair of slots.
    /// While work is in flight it waits up to 2 ms for `low_water` pairs, so that pulls are
    /// not one message at a time. `None` once the semaphores are closed.
    pub async fn acquire(&self, busy: bool, low_water: usize) -> Option<PullPermits> {
        let mut permits = PullPermits {
            handlers: self.handlers.clone().acquire_owned().await.ok()?,
            in_flight: self.in_flight.clone().acquire_owned().await.ok()?,
        };
        if busy && 1 + self.free() < low_water {
            let want = u32::try_from(low_water - 1).unwrap_or(u32::MAX);
            let more = async {
                let h = self.handlers.clone().acquire_many_owned(want).await.ok()?;
                let f = self.in_flight.clone().acquire_many_owned(want).await.ok()?;
                Some((h, f))
            };
            if let Ok(Some((h, f))) = tokio::time::timeout(Duration::from_millis(2), more).await {
                permits.handlers.merge(h);
                permits.in_flight.merge(f);
            }
        }
        let free = u32::try_from(self.free()).unwrap_or(u32::MAX);
        if free > 0
            && let (Ok(h), Ok(f)) = (
                self.handlers.clone().try_acquire_many_owned(free),
                self.in_flight.clone().try_acquire_many_owned(free),
            )
        {
            permits.handlers.merge(h);
            permits.in_flight.merge(f);
        }
        // Give back what the other kind cannot match.
        let n = permits
            .handlers
            .num_permits()
            .min(permits.in_flight.num_permits());
        let _ = permits.handlers.split(permits.handlers.num_permits() - n);
        let _ = permits.in_flight.split(permits.in_flight.num_permits() - n);
        Some(permits)
    }
}

/// Messages pulled and not yet acked: the consumer's `max_ack_pending`.
pub(super) fn in_flight_window(cfg: &WorkerConfig) -> usize {
    cfg.concurrency.saturating_mul(2)
}
