//! The service runner in-process against a real nats-server: a service that fails stops with
//! its error and the exit status of a failure, one that ignores shutdown is cut off at its
//! drain deadline, and a clean stop returns what the service returned.

use std::time::{Duration, Instant};

use stagehand_bus::runner::{self, EXIT_FAILED, RunError, ServiceConfig};
use stagehand_bus::{BusConfig, CancellationToken};
use stagehand_testkit::NatsServer;

fn config(nats: &NatsServer, deadline: Duration) -> ServiceConfig<()> {
    let mut config = ServiceConfig::new(BusConfig::new(nats.url()), ());
    config.worker.shutdown_deadline = Some(deadline);
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_task_stops_the_service_with_its_error_and_exit_status_one() {
    let nats = NatsServer::start();
    let err = runner::run(
        "svc-fail",
        config(&nats, Duration::from_secs(5)),
        CancellationToken::new(),
        |ctx| async move {
            let mut tasks = ctx.tasks();
            let token = tasks.shutdown().clone();
            tasks.spawn("worker", async move {
                token.cancelled().await;
                Ok::<(), std::io::Error>(())
            });
            tasks.spawn("store", async {
                Err::<(), _>(std::io::Error::other("the ledger's disk failed"))
            });
            tasks.join(Duration::from_secs(5)).await
        },
    )
    .await
    .unwrap_err();
    assert!(matches!(err, RunError::Service(_)), "{err:?}");
    assert_eq!(err.exit_code(), EXIT_FAILED);
    let text = err.to_string();
    assert!(
        text.contains("store") && text.contains("the ledger's disk failed"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_that_ignores_shutdown_is_cut_off_at_its_deadline() {
    let nats = NatsServer::start();
    let shutdown = CancellationToken::new();
    let stop = shutdown.clone();
    let started = tokio::sync::oneshot::channel::<()>();
    let (ready, is_ready) = started;
    let run = tokio::spawn(runner::run(
        "svc-stuck",
        config(&nats, Duration::from_millis(500)),
        shutdown,
        |_ctx| async move {
            let _ = ready.send(());
            std::future::pending::<Result<(), std::io::Error>>().await
        },
    ));
    is_ready.await.unwrap();
    let asked = Instant::now();
    stop.cancel();
    let err = run.await.unwrap().unwrap_err();
    let took = asked.elapsed();
    assert!(err.to_string().contains("did not stop within"), "{err}");
    // The worker's deadline (0.5 s) plus the runner's margin (2 s), not for ever.
    assert!(
        took >= Duration::from_millis(2500) && took < Duration::from_secs(10),
        "{took:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_stop_returns_what_the_service_returned() {
    let nats = NatsServer::start();
    let shutdown = CancellationToken::new();
    shutdown.cancel();
    let got = runner::run(
        "svc-clean",
        config(&nats, Duration::from_secs(5)),
        shutdown,
        |ctx| async move {
            ctx.shutdown.cancelled().await;
            // The runner connected and provisioned before serving.
            let streams = ctx
                .bus
                .jetstream()
                .get_stream("STAGEHAND_FACTS")
                .await
                .is_ok();
            Ok::<_, std::io::Error>((ctx.name, streams))
        },
    )
    .await
    .unwrap();
    assert_eq!(got, ("svc-clean", true));
}
