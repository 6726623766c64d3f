//! Who transfers next, and how fast: a weighted scheduler over the priority classes and an
//! optional byte-rate limit.
//!
//! The scheduler hands out a fixed number of transfer slots. When a slot frees and several
//! classes wait, the class chosen is the one with the lowest "pass" (stride scheduling): each
//! grant advances a class's pass by `STRIDE / weight`, so over any stretch checkpoint gets
//! 8 grants for every 4 stage, 2 ingest and 1 backup grant. A class that was idle joins at
//! the current minimum pass, so it cannot bank credit while idle and then monopolise slots.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use crate::transfer::Priority;

/// Divisible by every weight, so passes stay integers.
const STRIDE: u64 = 840;

/// Hands out transfer slots by priority class.
#[derive(Debug, Clone)]
pub struct Scheduler {
    state: Arc<Mutex<State>>,
}

#[derive(Debug)]
struct State {
    free: usize,
    waiting: [VecDeque<tokio::sync::oneshot::Sender<Permit>>; 4],
    pass: [u64; 4],
}

/// One transfer slot; dropping it frees the slot for the next waiter.
#[derive(Debug)]
pub struct Permit {
    sched: Option<Scheduler>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        if let Some(s) = self.sched.take() {
            s.release();
        }
    }
}

/// A place in a class's queue; resolves to a [`Permit`]. Dropping it leaves the queue.
#[derive(Debug)]
pub struct Ticket {
    rx: tokio::sync::oneshot::Receiver<Permit>,
}

impl Future for Ticket {
    type Output = Permit;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Permit> {
        match Pin::new(&mut self.rx).poll(cx) {
            Poll::Ready(Ok(p)) => Poll::Ready(p),
            // The sender lives in the scheduler's queue until a permit is sent; it is only
            // dropped with the scheduler, which a ticket's holder keeps alive.
            Poll::Ready(Err(_)) => Poll::Ready(Permit { sched: None }),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Scheduler {
    pub fn new(slots: usize) -> Scheduler {
        Scheduler {
            state: Arc::new(Mutex::new(State {
                free: slots.max(1),
                waiting: Default::default(),
                pass: [0; 4],
            })),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Joins `class`'s queue now (or takes a free slot at once).
    pub fn enqueue(&self, class: Priority) -> Ticket {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let mut st = self.lock();
        let i = class.index();
        if st.waiting[i].is_empty() {
            let floor = min_waiting_pass(&st).unwrap_or(st.pass[i]);
            st.pass[i] = st.pass[i].max(floor);
        }
        if st.free > 0 && st.waiting.iter().all(VecDeque::is_empty) {
            st.free -= 1;
            st.pass[i] += STRIDE / u64::from(class.weight());
            drop(st);
            let _ = tx.send(Permit {
                sched: Some(self.clone()),
            });
        } else {
            st.waiting[i].push_back(tx);
        }
        Ticket { rx }
    }

    /// Waits for a slot for `class`.
    pub async fn acquire(&self, class: Priority) -> Permit {
        self.enqueue(class).await
    }

    fn release(&self) {
        let mut st = self.lock();
        st.free += 1;
        while st.free > 0 {
            let Some(i) = (0..4)
                .filter(|&i| !st.waiting[i].is_empty())
                .min_by_key(|&i| (st.pass[i], i))
            else {
                break;
            };
            let tx = st.waiting[i].pop_front().expect("non-empty queue");
            st.free -= 1;
            st.pass[i] += STRIDE / u64::from(Priority::ALL[i].weight());
            let permit = Permit {
                sched: Some(self.clone()),
            };
            if let Err(mut unwanted) = tx.send(permit) {
                // The waiter left; give the slot back without re-entering this lock.
                unwanted.sched = None;
                st.free += 1;
            }
        }
    }
}

fn min_waiting_pass(st: &State) -> Option<u64> {
    (0..4)
        .filter(|&i| !st.waiting[i].is_empty())
        .map(|i| st.pass[i])
        .min()
}

/// A token bucket of bytes per second, with one second of burst. Takers may overdraw; the
/// next taker then waits until the debt is paid, so the long-run rate holds for any sizes.
#[derive(Debug)]
pub struct RateLimiter {
    rate: u64,
    bucket: Mutex<(f64, Instant)>,
}

impl RateLimiter {
    pub fn new(bytes_per_second: u64) -> RateLimiter {
        let rate = bytes_per_second.max(1);
        RateLimiter {
            rate,
            bucket: Mutex::new((rate as f64, Instant::now())),
        }
    }

    /// Takes `bytes` from the bucket as of `now` and says how long to wait before using them.
    pub fn reserve_at(&self, bytes: u64, now: Instant) -> Duration {
        let mut b = self.bucket.lock().unwrap_or_else(|p| p.into_inner());
        let elapsed = now.saturating_duration_since(b.1).as_secs_f64();
        b.0 = (b.0 + elapsed * self.rate as f64).min(self.rate as f64);
        b.1 = b.1.max(now);
        b.0 -= bytes as f64;
        if b.0 >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-b.0 / self.rate as f64)
        }
    }

    /// Takes `bytes`, blocking the calling (engine) thread until they may be used.
    pub fn take_blocking(&self, bytes: u64) {
        let wait = self.reserve_at(bytes, Instant::now());
        if !wait.is_zero() {
            std::thread::sleep(wait);
        }
    }

    /// Takes `bytes`, waiting asynchronously until they may be used.
    pub async fn take(&self, bytes: u64) {
        let wait = self.reserve_at(bytes, Instant::now());
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt;

    /// With every slot taken and many backups queued before a few checkpoints, freed slots go
    /// to the checkpoints first (weight 8 vs 1): a bulk backup never starves them.
    #[test]
    fn checkpoint_is_not_starved_by_queued_backups() {
        let s = Scheduler::new(1);
        let held = s
            .enqueue(Priority::Backup)
            .now_or_never()
            .expect("a free slot");
        let mut tickets: Vec<(Priority, Ticket)> = Vec::new();
        for _ in 0..20 {
            tickets.push((Priority::Backup, s.enqueue(Priority::Backup)));
        }
        for _ in 0..4 {
            tickets.push((Priority::Checkpoint, s.enqueue(Priority::Checkpoint)));
        }
        drop(held);
        let mut order = Vec::new();
        while !tickets.is_empty() {
            let pos = tickets.iter_mut().position(|(_, t)| {
                (&mut t.rx).now_or_never().is_some_and(|p| {
                    drop(p.ok());
                    true
                })
            });
            let Some(pos) = pos else { break };
            order.push(tickets.remove(pos).0);
        }
        assert_eq!(order.len(), 24, "every waiter is granted in turn");
        let first_five: Vec<_> = order[..5].to_vec();
        assert_eq!(
            first_five
                .iter()
                .filter(|p| **p == Priority::Checkpoint)
                .count(),
            4,
            "checkpoints get the first slots: {first_five:?}"
        );
    }

    #[test]
    fn grants_follow_the_weights() {
        let s = Scheduler::new(1);
        let held = s
            .enqueue(Priority::Ingest)
            .now_or_never()
            .expect("a free slot");
        let mut tickets = Vec::new();
        for p in Priority::ALL {
            for _ in 0..30 {
                tickets.push((p, s.enqueue(p)));
            }
        }
        drop(held);
        let mut counts = [0usize; 4];
        for _ in 0..30 {
            let pos = tickets
                .iter_mut()
                .position(|(_, t)| {
                    (&mut t.rx).now_or_never().is_some_and(|p| {
                        drop(p.ok());
                        true
                    })
                })
                .expect("one grant per freed slot");
            counts[tickets.remove(pos).0.index()] += 1;
        }
        // The held slot was ingest's first grant: with it, 31 grants split 17:8:4:2, the
        // weights 8:4:2:1 to within one grant.
        counts[Priority::Ingest.index()] += 1;
        assert_eq!(counts, [17, 8, 4, 2]);
    }

    #[test]
    fn a_dropped_ticket_passes_its_slot_on() {
        let s = Scheduler::new(1);
        let held = s
            .enqueue(Priority::Stage)
            .now_or_never()
            .expect("a free slot");
        let gone = s.enqueue(Priority::Checkpoint);
        let mut waiting = s.enqueue(Priority::Backup);
        drop(gone);
        drop(held);
        assert!((&mut waiting).now_or_never().is_some());
    }

    #[test]
    fn rate_limiter_charges_debt() {
        let l = RateLimiter::new(1000);
        let t0 = Instant::now();
        assert_eq!(
            l.reserve_at(1000, t0),
            Duration::ZERO,
            "one second of burst"
        );
        assert_eq!(l.reserve_at(500, t0), Duration::from_millis(500));
        // Half a second later the debt is paid and nothing more is owed.
        assert_eq!(
            l.reserve_at(0, t0 + Duration::from_millis(500)),
            Duration::ZERO
        );
        assert_eq!(
            l.reserve_at(2000, t0 + Duration::from_millis(500)),
            Duration::from_secs(2)
        );
    }
}
