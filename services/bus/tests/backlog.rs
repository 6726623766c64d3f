//! A worker run through the runner's [`Context`] reports its consumer's backlog in the work
//! metrics (issue 18 item 2), read from a real nats-server: messages waiting while the handler
//! is held, none once it is let go. One test per process, so the process-wide gauges are this
//! test's alone.

mod common;

use std::sync::Arc;

use common::*;
use stagehand_bus::runner::Context;
use stagehand_bus::{CancellationToken, Handler, HandlerError, WorkContext};
use stagehand_schemas::Event;
use stagehand_telemetry::names;
use stagehand_testkit::wait_until;
use tokio::sync::Semaphore;

/// A handler that waits for a permit per message.
struct Gate(Arc<Semaphore>);

impl Handler for Gate {
    async fn handle(&self, _: &Event, _: &WorkContext) -> Result<Vec<Event>, HandlerError> {
        self.0
            .acquire()
            .await
            .map_err(HandlerError::retryable)?
            .forget();
        Ok(Vec::new())
    }
}

use stagehand_testkit::scrape_sample as sample;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workers_consumer_backlog_is_in_the_metrics() {
    let handle = stagehand_telemetry::metrics::install();
    let env = Env::start().await;
    for i in 0..3 {
        env.bus
            .publish(&stage_request(&format!("backlog-{i}")))
            .await
            .unwrap();
    }
    let shutdown = CancellationToken::new();
    let ctx = Context::new("svc-backlog", (), env.bus.clone(), shutdown.clone());
    let mut cfg = env.worker("svc-backlog");
    cfg.concurrency = 1;
    let gate = Arc::new(Semaphore::new(0));
    let worker = tokio::spawn(ctx.run_worker_until(cfg, Gate(gate.clone()), shutdown.clone()));

    let labels = r#"service="svc-backlog",consumer="svc-backlog""#;
    let backlog = || {
        let scrape = handle.render();
        (
            sample(&scrape, names::CONSUMER_PENDING_MESSAGES, labels),
            sample(&scrape, names::CONSUMER_ACK_PENDING_MESSAGES, labels),
        )
    };
    wait_until(
        WAIT,
        "three messages in the backlog, one at least delivered",
        || async { matches!(backlog(), (Some(p), Some(a)) if p + a == 3.0 && a >= 1.0) },
    )
    .await
    .unwrap();
    gate.add_permits(3);
    wait_until(WAIT, "the backlog empty", || async {
        backlog() == (Some(0.0), Some(0.0))
    })
    .await
    .unwrap();
    shutdown.cancel();
    worker.await.unwrap().unwrap();
}
