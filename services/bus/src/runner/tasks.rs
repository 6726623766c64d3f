//! The tasks a service runs side by side — its worker(s), and whatever else it needs (the
//! catalogue recorder answers queries; later services run a policy clock) — stopped together.
//!
//! A [`TaskGroup`] holds named tasks that share one shutdown token. The first task to fail
//! cancels the token, so the others drain; [`TaskGroup::join`] waits for all of them and
//! returns the first error with the task's name. A task that ends cleanly while the others
//! run is fine (a disabled dead-letter counter returns at once).

use std::future::Future;
use std::time::Duration;
use tracing::instrument::WithSubscriber;

use stagehand_telemetry::names;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

type TaskResult = Result<(), Box<dyn std::error::Error + Send + Sync + 'static>>;

/// A task of a service that stopped with an error (or panicked).
#[derive(Debug, thiserror::Error)]
#[error("task {task} of {service} failed: {source}")]
pub struct TaskError {
    pub service: String,
    pub task: &'static str,
    #[source]
    pub source: Box<dyn std::error::Error + Send + Sync + 'static>,
}

/// Named tasks of one service sharing one shutdown token.
pub struct TaskGroup {
    service: String,
    shutdown: CancellationToken,
    tasks: JoinSet<(&'static str, TaskResult)>,
}

impl std::fmt::Debug for TaskGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TaskGroup")
            .field("service", &self.service)
            .field("tasks", &self.tasks.len())
            .finish()
    }
}

impl TaskGroup {
    /// A group whose tasks stop when `shutdown` is cancelled (a child token is used, so a
    /// failing task stops this service without stopping whoever runs it beside others).
    pub fn new(service: impl Into<String>, shutdown: &CancellationToken) -> TaskGroup {
        TaskGroup {
            service: service.into(),
            shutdown: shutdown.child_token(),
            tasks: JoinSet::new(),
        }
    }

    /// The token every task of the group must watch.
    pub fn shutdown(&self) -> &CancellationToken {
        &self.shutdown
    }

    /// Runs `task` in the group under a fixed `name` (a metric label: keep it one of a few).
    /// What a task returns on success is dropped: a worker's statistics are logged by the
    /// worker itself when it stops.
    pub fn spawn<F, T, E>(&mut self, name: &'static str, task: F)
    where
        F: Future<Output = Result<T, E>> + Send + 'static,
        E: Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    {
        let shutdown = self.shutdown.clone();
        // The task logs and traces through the subscriber of the service that spawned it
        // (under `stagehand up`, each service has its own).
        let task = task.with_current_subscriber();
        self.tasks.spawn(async move {
            let result = task.await.map(drop).map_err(Into::into);
            if result.is_err() {
                // The others drain; the error is reported by `join`.
                shutdown.cancel();
            }
            (name, result)
        });
    }

    /// Waits for every task. Once shutdown is asked for, tasks get `deadline` to finish;
    /// those still running then are aborted (their un-acked messages are redelivered later).
    /// Returns the first failure.
    pub async fn join(mut self, deadline: Duration) -> Result<(), TaskError> {
        let mut first: Option<TaskError> = None;
        let service = self.service.clone();
        let record = |name: &'static str, result: TaskResult, first: &mut Option<TaskError>| {
            if let Err(source) = result {
                metrics::counter!(
                    names::TASK_FAILURES_TOTAL,
                    names::label::SERVICE => service.clone(),
                    names::label::TASK => name
                )
                .increment(1);
                tracing::error!(service = %service, task = name, error = %source, "task failed; stopping the service");
                if first.is_none() {
                    *first = Some(TaskError {
                        service: service.clone(),
                        task: name,
                        source,
                    });
                }
            }
        };
        loop {
            let next = tokio::select! {
                next = self.tasks.join_next() => next,
                _ = self.shutdown.cancelled() => break,
            };
            match next {
                None => return first.map_or(Ok(()), Err),
                Some(Ok((name, result))) => record(name, result, &mut first),
                Some(Err(joined)) => {
                    self.shutdown.cancel();
                    record("panicked", Err(joined.to_string().into()), &mut first);
                }
            }
        }
        let drain = async {
            while let Some(next) = self.tasks.join_next().await {
                match next {
                    Ok((name, result)) => record(name, result, &mut first),
                    Err(joined) if joined.is_panic() => {
                        record("panicked", Err(joined.to_string().into()), &mut first)
                    }
                    Err(_) => {}
                }
            }
        };
        if tokio::time::timeout(deadline, drain).await.is_err() {
            tracing::warn!(
                service = %self.service,
                still_running = self.tasks.len(),
                ?deadline,
                "tasks still running at the shutdown deadline; aborting them"
            );
            self.tasks.shutdown().await;
        }
        first.map_or(Ok(()), Err)
    }
}

/// Calls `tick` every `period` (the first call after one period) until `shutdown` is
/// cancelled: a policy clock. A tick that fails ends the loop with its error, which stops the
/// service when run in a [`TaskGroup`]; a tick is never cut off half-way by shutdown.
pub async fn every<F, Fut, E>(
    period: Duration,
    shutdown: CancellationToken,
    mut tick: F,
) -> Result<(), E>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), E>>,
{
    let mut interval = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            _ = interval.tick() => tick().await?,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    #[tokio::test]
    async fn a_failing_task_stops_the_others_and_is_named() {
        let outer = CancellationToken::new();
        let mut group = TaskGroup::new("svc", &outer);
        let token = group.shutdown().clone();
        let drained = Arc::new(AtomicU32::new(0));
        let seen = drained.clone();
        group.spawn("worker", async move {
            token.cancelled().await;
            seen.fetch_add(1, Ordering::SeqCst);
            Ok::<(), std::io::Error>(())
        });
        group.spawn("queries", async {
            Err::<(), _>(std::io::Error::other("store is dead"))
        });
        let err = group.join(Duration::from_secs(5)).await.unwrap_err();
        assert_eq!(err.task, "queries");
        assert!(err.to_string().contains("store is dead"), "{err}");
        assert_eq!(drained.load(Ordering::SeqCst), 1, "the worker drained");
        assert!(!outer.is_cancelled(), "the caller's token is not cancelled");
    }

    #[tokio::test]
    async fn shutdown_waits_for_tasks_then_aborts_at_the_deadline() {
        let outer = CancellationToken::new();
        let mut group = TaskGroup::new("svc", &outer);
        group.spawn(
            "stuck",
            std::future::pending::<Result<(), std::io::Error>>(),
        );
        let token = group.shutdown().clone();
        group.spawn("clean", async move {
            token.cancelled().await;
            Ok::<(), std::io::Error>(())
        });
        outer.cancel();
        let started = tokio::time::Instant::now();
        group.join(Duration::from_millis(200)).await.unwrap();
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(200) && took < Duration::from_secs(5),
            "{took:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_clock_ticks_each_period_until_shutdown_and_stops_on_error() {
        let shutdown = CancellationToken::new();
        let ticks = AtomicU32::new(0);
        let stop = shutdown.clone();
        let run = every(Duration::from_secs(60), shutdown.clone(), || {
            let n = ticks.fetch_add(1, Ordering::SeqCst) + 1;
            let stop = stop.clone();
            async move {
                if n == 3 {
                    stop.cancel();
                }
                Ok::<(), std::io::Error>(())
            }
        });
        let started = tokio::time::Instant::now();
        run.await.unwrap();
        assert_eq!(ticks.load(Ordering::SeqCst), 3);
        assert_eq!(started.elapsed(), Duration::from_secs(180));

        let failing = every(Duration::from_secs(1), CancellationToken::new(), || async {
            Err::<(), _>(std::io::Error::other("tier unreachable"))
        });
        assert!(failing.await.is_err());
    }
}
