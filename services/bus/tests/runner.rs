//! The service runner in-process against a real nats-server: a service that fails stops with
//! its error and the exit status of a failure, one that ignores shutdown is cut off at its
//! drain deadline, a clean stop returns what the service returned, and the metrics endpoint's
//! `/readyz` follows the connection and the workers while `/healthz` always answers.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use stagehand_bus::runner::{self, EXIT_FAILED, RunError, ServiceConfig};
use stagehand_bus::{
    BusConfig, CancellationToken, Handler, HandlerError, WorkContext, WorkerConfig,
};
use stagehand_schemas::{Event, subject};
use stagehand_testkit::{NatsServer, wait_for};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

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

/// `GET path` on the service's metrics endpoint: the status code and the body.
async fn probe(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
    stream
        .write_all(format!("GET {path} HTTP/1.1\r\nHost: probe\r\n\r\n").as_bytes())
        .await
        .ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.ok()?;
    let status = answer.split_whitespace().nth(1)?.parse().ok()?;
    let body = answer.split_once("\r\n\r\n")?.1.to_owned();
    Some((status, body))
}

/// Waits until `path` answers `status` with a body containing `said`.
async fn wait_probe(addr: SocketAddr, path: &str, status: u16, said: &str) -> (u16, String) {
    let what = format!("{path} to answer {status} ({said})");
    let last = std::sync::Mutex::new(None);
    let last = &last;
    wait_for(Duration::from_secs(30), &what, || async move {
        let answer = probe(addr, path).await;
        *last.lock().unwrap() = answer.clone();
        answer.filter(|(code, body)| *code == status && body.contains(said))
    })
    .await
    .unwrap_or_else(|e| panic!("{e}; the last answer: {:?}", last.lock().unwrap()))
}

struct Idle;

impl Handler for Idle {
    async fn handle(&self, _: &Event, _: &WorkContext) -> Result<Vec<Event>, HandlerError> {
        Ok(Vec::new())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_follows_the_connection_and_the_workers_and_healthz_always_answers() {
    let mut nats = NatsServer::start();
    let url = nats.url();
    // Down when the service starts: it keeps trying (connect_timeout) while /readyz says why.
    nats.kill();
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut config = ServiceConfig::new(BusConfig::new(&url), ());
    config.telemetry.metrics_listen = Some(addr);
    config.worker.shutdown_deadline = Some(Duration::from_secs(5));
    let shutdown = CancellationToken::new();
    let (fail_second, second_fails) = tokio::sync::oneshot::channel::<()>();
    let ledgers = dir.path().to_owned();
    let service = tokio::spawn(runner::run(
        "svc-probed",
        config,
        shutdown.clone(),
        move |ctx| async move {
            let filter = vec![subject::kind_filter(subject::REQ, "stage.released")];
            let cfg = ctx.worker(WorkerConfig::new(
                "svc-probed",
                subject::REQUESTS.name,
                filter.clone(),
                ledgers.join("a.redb"),
            ));
            let mut tasks = ctx.tasks();
            tasks.spawn(
                "worker",
                ctx.run_worker_until(cfg, Idle, tasks.shutdown().clone()),
            );
            // A second worker that stops on its own once told to (its consumer cannot be
            // made: concurrency 0 is refused), while the first one goes on.
            let mut broken = ctx.worker(WorkerConfig::new(
                "svc-probed-2",
                subject::REQUESTS.name,
                filter,
                ledgers.join("b.redb"),
            ));
            broken.concurrency = 0;
            let second = ctx.run_worker_until(broken, Idle, tasks.shutdown().clone());
            tasks.spawn("second", async move {
                let _ = second_fails.await;
                let _ = second.await;
                Ok::<(), std::io::Error>(())
            });
            tasks.join(Duration::from_secs(5)).await
        },
    ));

    let (_, body) = wait_probe(addr, "/readyz", 503, "connecting to NATS").await;
    assert_eq!(body, "not ready: connecting to NATS\n");
    assert_eq!(probe(addr, "/healthz").await, Some((200, "ok\n".into())));

    nats.restart();
    wait_probe(addr, "/readyz", 200, "ready").await;

    // NATS goes away: not ready, but alive (a liveness probe must not restart the service).
    nats.kill();
    wait_probe(addr, "/readyz", 503, "NATS connection").await;
    assert_eq!(probe(addr, "/healthz").await, Some((200, "ok\n".into())));
    nats.restart();
    wait_probe(addr, "/readyz", 200, "ready").await;

    // A worker that stopped takes the service out of readiness.
    fail_second.send(()).unwrap();
    wait_probe(addr, "/readyz", 503, "a worker stopped").await;

    shutdown.cancel();
    service.await.unwrap().unwrap();
}
