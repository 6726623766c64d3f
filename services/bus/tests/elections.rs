//! A publish rides out a JetStream leader election (issue 19, item 10): on a three-node
//! cluster, the node leading a stream is killed and the very next publish — answered "no
//! stream found for given subject" while the survivors elect a new leader — is stored once the
//! election is over, exactly once; past its budget a publish gives up with one
//! `Unavailable` error naming the subject; and on a single server a subject no stream captures
//! is refused at once, never waited on.

use std::time::{Duration, Instant};

use stagehand_bus::{Bus, BusConfig, BusErrorKind};
use stagehand_schemas::{Body, Event, EventId, StageReleased, subject};
use stagehand_testkit::{NatsCluster, NatsServer, stored_events_through_election, stream_leader};

fn release(job: &str) -> Event {
    Event::request(
        EventId::for_stage_release("lab-e", job, "ds", "v1", "hot", None),
        "lab-e",
        Body::StageReleased(StageReleased {
            dataset: "ds".into(),
            version: "v1".into(),
            tier: "hot".into(),
            job_id: job.into(),
            node: None,
            reason: None,
        }),
    )
}

/// The index of the node leading `stream`, once the cluster names one.
async fn leader_of(bus: &Bus, stream: &str) -> usize {
    stream_leader(bus.jetstream(), stream).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_right_after_the_streams_leader_is_killed_is_stored_once() {
    let mut cluster = NatsCluster::start(3);
    let bus = Bus::connect(&BusConfig::new(cluster.urls().join(",")))
        .await
        .unwrap();
    bus.provision().await.unwrap();
    bus.publish(&release("before")).await.unwrap();
    let leader = leader_of(&bus, subject::REQUESTS.name).await;
    cluster.node_mut(leader).kill();

    // At once, while the survivors elect a new leader.
    let ack = bus.publish(&release("during")).await.unwrap();
    assert!(!ack.duplicate);
    assert_ne!(leader_of(&bus, subject::REQUESTS.name).await, leader);
    let stored = stored_events_through_election(bus.jetstream(), subject::REQUESTS.name, ">")
        .await
        .unwrap();
    let ids: Vec<_> = stored.iter().map(|e| e.id.clone()).collect();
    assert_eq!(ids, vec![release("before").id, release("during").id]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_never_answers_ends_the_publish_at_its_budget_with_one_error() {
    let cluster = NatsCluster::start(3);
    // No streams: on a cluster, "no responders" may be an election, so it is waited out.
    let bus = Bus::connect(&BusConfig::new(cluster.urls().join(",")))
        .await
        .unwrap()
        .with_publish_timeout(Duration::from_secs(2));
    let started = Instant::now();
    let err = bus.publish(&release("lost")).await.unwrap_err();
    let took = started.elapsed();
    assert_eq!(err.kind(), BusErrorKind::Unavailable, "{err}");
    assert!(
        // Bounded well above the budget: the point is that it ends, on a loaded machine too.
        took >= Duration::from_secs(2) && took < Duration::from_secs(30),
        "{took:?}"
    );
    let text = err.to_string();
    assert!(
        text.contains("stagehand.req.stage.released.lab-e") && text.contains("tries"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_single_server_a_subject_no_stream_captures_is_refused_at_once() {
    let server = NatsServer::start();
    let bus = Bus::connect(&BusConfig::new(server.url())).await.unwrap();
    let started = Instant::now();
    let err = bus.publish(&release("nowhere")).await.unwrap_err();
    assert_eq!(err.kind(), BusErrorKind::Publish, "{err}");
    assert!(started.elapsed() < Duration::from_secs(2));
}

/// Counts the events it handles.
struct Counting(std::sync::atomic::AtomicU32);

impl stagehand_bus::Handler for Counting {
    async fn handle(
        &self,
        _event: &Event,
        _ctx: &stagehand_bus::WorkContext,
    ) -> Result<Vec<Event>, stagehand_bus::HandlerError> {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(Vec::new())
    }
}

/// A worker that starts while its stream has no leader (two of three servers gone) asks for its
/// consumer again until the cluster answers, then consumes; before, its first failed answer
/// ended it, and a service starting during an election failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_starting_while_its_stream_has_no_leader_consumes_once_it_has_one() {
    let mut cluster = NatsCluster::start(3);
    let bus = Bus::connect(&BusConfig::new(cluster.urls().join(",")))
        .await
        .unwrap();
    bus.provision().await.unwrap();
    let state = tempfile::tempdir().unwrap();
    let mut cfg = stagehand_bus::WorkerConfig::new(
        "patient",
        subject::REQUESTS.name,
        vec!["stagehand.req.stage.released.>".into()],
        state.path().join("ledger.redb"),
    );
    cfg.claims = false;
    cfg.instance_id = Some("patient".into());
    let survivor = leader_of(&bus, subject::REQUESTS.name).await;
    for i in (0..3).filter(|i| *i != survivor) {
        cluster.node_mut(i).kill();
    }
    // What the worker's first try meets: a failure that may pass.
    let Err(err) = stagehand_bus::provision_consumer(&bus, &cfg).await else {
        panic!("a consumer made without a quorum");
    };
    assert!(stagehand_schemas::Retryable::is_retryable(&err), "{err}");
    let handler = std::sync::Arc::new(Counting(Default::default()));
    let stop = stagehand_bus::CancellationToken::new();
    let worker = tokio::spawn(stagehand_bus::run_worker(
        bus.clone(),
        cfg,
        handler.clone(),
        stop.clone(),
    ));
    for i in (0..3).filter(|i| *i != survivor) {
        cluster.node_mut(i).restart();
    }
    bus.publish(&release("after")).await.unwrap();
    stagehand_testkit::wait_until(
        Duration::from_secs(60),
        "the worker to handle one event",
        || {
            let (handler, worker) = (&handler, &worker);
            async move {
                assert!(!worker.is_finished(), "the worker ended");
                handler.0.load(std::sync::atomic::Ordering::SeqCst) == 1
            }
        },
    )
    .await
    .unwrap();
    stop.cancel();
    worker.await.unwrap().unwrap();
}
