//! Waiting on real conditions instead of sleeping: poll a check until it holds, within a bound.

use std::future::Future;
use std::time::{Duration, Instant};

/// A condition that did not hold in time.
#[derive(Debug, Clone, thiserror::Error)]
#[error("timed out after {elapsed:?} waiting for {what}")]
pub struct WaitTimeout {
    /// What was awaited, as the caller described it.
    pub what: String,
    /// How long was waited.
    pub elapsed: Duration,
}

/// Polls `check` until it returns `true`, or fails after `timeout` naming `what` was awaited.
///
/// Polls at once, then every 5 ms growing to 100 ms, so a fast condition costs little and a slow
/// one does not spin.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// use std::sync::atomic::{AtomicU32, Ordering};
/// use std::time::Duration;
/// let n = AtomicU32::new(0);
/// stagehand_testkit::wait_until(Duration::from_secs(5), "three polls", || async {
///     n.fetch_add(1, Ordering::SeqCst) >= 2
/// })
/// .await
/// .unwrap();
/// # }
/// ```
pub async fn wait_until<F, Fut>(
    timeout: Duration,
    what: &str,
    mut check: F,
) -> Result<(), WaitTimeout>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    wait_for(timeout, what, || {
        let fut = check();
        async move { fut.await.then_some(()) }
    })
    .await
}

/// Polls `check` until it returns `Some(value)` and returns that value, or fails after
/// `timeout` naming `what` was awaited.
pub async fn wait_for<T, F, Fut>(
    timeout: Duration,
    what: &str,
    mut check: F,
) -> Result<T, WaitTimeout>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let start = Instant::now();
    let mut interval = Duration::from_millis(5);
    loop {
        if let Some(v) = check().await {
            return Ok(v);
        }
        let elapsed = start.elapsed();
        if elapsed >= timeout {
            return Err(WaitTimeout {
                what: what.to_string(),
                elapsed,
            });
        }
        tokio::time::sleep(interval.min(timeout - elapsed)).await;
        interval = (interval * 2).min(Duration::from_millis(100));
    }
}

/// [`wait_until`] for a test that has no async runtime of its own (one that drives a child
/// process, say): polls `check` the same way, on a runtime of its own.
pub fn wait_until_blocking(
    timeout: Duration,
    what: &str,
    mut check: impl FnMut() -> bool + Send,
) -> Result<(), WaitTimeout> {
    block_on(wait_until(timeout, what, || std::future::ready(check())))
}

/// Runs a future to completion on a private runtime in its own thread, so that the synchronous
/// start-up helpers work both inside and outside a tokio test.
pub(crate) fn block_on<F>(fut: F) -> F::Output
where
    F: Future + Send,
    F::Output: Send,
{
    std::thread::scope(|s| {
        s.spawn(|| {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("build a tokio runtime")
                .block_on(fut)
        })
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p))
    })
}
