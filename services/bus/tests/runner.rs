//! The service runner in-process against a real nats-server: a service that fails stops with
//! its error and the exit status of a failure, one that ignores shutdown is cut off at its
//! drain deadline, a clean stop returns what the service returned, and the metrics endpoint's
//! `/readyz` follows the connection and the workers while `/healthz` always answers; each run
//! keeps its heartbeat in `stagehand_heartbeats`.

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
            // Once told to, a second worker that cannot start (concurrency 0 is refused): built,
            // it takes the service out of readiness, and stopping keeps it out.
            tokio::select! {
                _ = second_fails => {}
                _ = ctx.shutdown.cancelled() => {}
            }
            let mut broken = ctx.worker(WorkerConfig::new(
                "svc-probed-2",
                subject::REQUESTS.name,
                filter,
                ledgers.join("b.redb"),
            ));
            broken.concurrency = 0;
            let second = ctx.run_worker_until(broken, Idle, tasks.shutdown().clone());
            tasks.spawn("second", async move {
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

/// The heartbeat of `service` on `instance`, as the runner last wrote it.
async fn heartbeat(nats: &NatsServer, service: &str, instance: &str) -> Option<runner::Heartbeat> {
    let bus = stagehand_bus::Bus::connect(&BusConfig::new(nats.url()))
        .await
        .ok()?;
    let store = bus
        .jetstream()
        .get_key_value(stagehand_bus::HEARTBEATS_BUCKET)
        .await
        .ok()?;
    let bytes = store
        .get(runner::heartbeat_key(service, instance))
        .await
        .ok()??;
    serde_json::from_slice(&bytes).ok()
}

/// Every run keeps the instance's heartbeat: written at start with its version, host and
/// start, carrying the progress the service notes, marked stopped on a clean stop and failed
/// with its error on a failure; the next start counts a restart, and a start after a run that
/// never wrote its end counts an unclean stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_run_keeps_its_heartbeat_from_start_to_stop() {
    let nats = NatsServer::start();
    let mut cfg = config(&nats, Duration::from_secs(5));
    cfg.worker.instance_id = Some("node-7".into());
    let shutdown = CancellationToken::new();
    let (noted, is_noted) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(runner::run(
        "svc-beat",
        cfg.clone(),
        shutdown.clone(),
        |ctx| async move {
            ctx.progress().note();
            let _ = noted.send(());
            ctx.shutdown.cancelled().await;
            Ok::<_, std::io::Error>(())
        },
    ));
    is_noted.await.unwrap();
    let first = wait_for(Duration::from_secs(30), "the first heartbeat", || async {
        heartbeat(&nats, "svc-beat", "node-7").await
    })
    .await
    .unwrap();
    assert_eq!(
        (first.service.as_str(), first.instance.as_str()),
        ("svc-beat", "node-7")
    );
    assert_eq!(first.version, env!("CARGO_PKG_VERSION"));
    assert_eq!((first.starts, first.unclean_stops), (1, 0));
    assert!(!first.ended());
    shutdown.cancel();
    run.await.unwrap().unwrap();
    let stopped = heartbeat(&nats, "svc-beat", "node-7").await.unwrap();
    assert!(stopped.stopped_at.is_some() && stopped.failed_at.is_none());
    assert!(
        stopped.last_progress_at.is_some(),
        "the noted progress is kept"
    );

    // Started again, failing: a restart, no unclean stop, and the failure with its error.
    let err = runner::run(
        "svc-beat",
        cfg.clone(),
        CancellationToken::new(),
        |_ctx| async { Err::<(), _>(std::io::Error::other("the ledger's disk failed")) },
    )
    .await
    .unwrap_err();
    assert!(matches!(err, RunError::Service(_)));
    let failed = heartbeat(&nats, "svc-beat", "node-7").await.unwrap();
    assert_eq!((failed.starts, failed.unclean_stops), (2, 0));
    assert_eq!(failed.recent_starts.len(), 2);
    assert!(failed.failed_at.is_some());
    assert!(
        failed
            .error
            .as_deref()
            .unwrap_or_default()
            .contains("the ledger's disk failed")
    );

    // A run that ended without writing its end (killed): the next start counts it.
    let store = stagehand_bus::Bus::connect(&BusConfig::new(nats.url()))
        .await
        .unwrap()
        .jetstream()
        .get_key_value(stagehand_bus::HEARTBEATS_BUCKET)
        .await
        .unwrap();
    let mut killed = failed.clone();
    killed.failed_at = None;
    killed.error = None;
    store
        .put(
            runner::heartbeat_key("svc-beat", "node-7"),
            serde_json::to_vec(&killed).unwrap().into(),
        )
        .await
        .unwrap();
    let stop = CancellationToken::new();
    stop.cancel();
    runner::run("svc-beat", cfg, stop, |ctx| async move {
        ctx.shutdown.cancelled().await;
        Ok::<_, std::io::Error>(())
    })
    .await
    .unwrap();
    let after = heartbeat(&nats, "svc-beat", "node-7").await.unwrap();
    assert_eq!((after.starts, after.unclean_stops), (3, 1));
}
