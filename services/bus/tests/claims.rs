//! Claims that cannot cost a request: waiting for a live owner counts no attempt, a racing
//! duplicate publishes the first outcome and never its own, and a claim lost while the
//! handler runs cancels the handler and records nothing.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use bytes::Bytes;
use common::*;
use stagehand_bus::{
    BusError, CLAIMS_BUCKET, CancellationToken, Handler, HandlerError, Ledger, WorkContext,
    WorkerConfig, WorkerStats, run_worker,
};
use stagehand_schemas::{Body, Event, StageFailed, subject, wire};
use stagehand_testkit::wait_until;
use tokio::task::JoinHandle;

type Worker = (CancellationToken, JoinHandle<Result<WorkerStats, BusError>>);

fn spawn<H: Handler>(env: &Env, cfg: WorkerConfig, handler: Arc<H>) -> Worker {
    let token = CancellationToken::new();
    let handle = tokio::spawn(run_worker(env.bus.clone(), cfg, handler, token.clone()));
    (token, handle)
}

async fn stop((token, handle): Worker) -> WorkerStats {
    token.cancel();
    handle.await.unwrap().unwrap()
}

/// An instance of `svc` with its own ledger and id, short timers, claims lasting one second.
fn instance(env: &Env, name: &str) -> WorkerConfig {
    let mut cfg = env.worker("svc");
    cfg.instance_id = Some(name.into());
    cfg.ledger_path = env.ledger(&format!("svc-{name}"));
    cfg.ack_wait = Duration::from_secs(1);
    cfg.claim_lifetime = Some(Duration::from_secs(1));
    cfg
}

/// Blocks in its handler until released.
struct Holding {
    started: AtomicU32,
    gate: tokio::sync::Semaphore,
}

impl Holding {
    fn new() -> Arc<Holding> {
        Arc::new(Holding {
            started: AtomicU32::new(0),
            gate: tokio::sync::Semaphore::new(0),
        })
    }
}

impl Handler for Holding {
    async fn handle(&self, event: &Event, _ctx: &WorkContext) -> Result<Vec<Event>, HandlerError> {
        self.started.fetch_add(1, Ordering::SeqCst);
        self.gate.acquire().await.expect("gate open").forget();
        Ok(vec![ready_fact(event)])
    }
}

/// The worker holding a message's claim dies (its task is dropped: no acks, no renewals).
/// The message comes back to another instance, which finds the claim held, waits past its
/// remaining lifetime (judged by the server's clock) without spending its single allowed
/// attempt, then takes the claim over and does the work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_holders_claim_is_waited_out_without_counting_then_taken_over() {
    let env = Env::start().await;
    let request = stage_request("orphaned");
    let holder = Holding::new();
    let mut a = instance(&env, "a");
    a.claim_lifetime = Some(Duration::from_secs(2));
    let (_, a) = spawn(&env, a, holder.clone());
    env.bus.publish(&request).await.unwrap();
    wait_until(WAIT, "the holder working", || async {
        holder.started.load(Ordering::SeqCst) == 1
    })
    .await
    .unwrap();
    a.abort();
    let _ = a.await;

    let mut b = instance(&env, "b");
    b.max_attempts = 1;
    let taker = Arc::new(Emit::default());
    let b = spawn(&env, b, taker.clone());
    wait_until(WAIT, "the fact", || async { env.fact_count().await == 1 })
        .await
        .unwrap();
    wait_until(WAIT, "acked", || env.consumer_drained("svc"))
        .await
        .unwrap();
    let sb = stop(b).await;
    assert!(sb.deferred >= 1, "it waited for the claim: {sb:?}");
    assert_eq!(
        (sb.handled, sb.retried, sb.dead_lettered),
        (1, 0, 0),
        "{sb:?}"
    );
    assert_eq!(taker.calls_for("orphaned"), 1);
    assert_eq!(
        env.facts().await[0].2,
        recorded_fact(&env.ledger("svc-b"), &request)
    );
}

/// A second message carrying an event that a live worker is working on is acked at once as
/// redundant: the first message brings the outcome. It spends no attempt, holds no slot while
/// it waits, and never runs the handler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_of_an_event_in_flight_elsewhere_is_acked_as_redundant() {
    let env = Env::start().await;
    let request = stage_request("long-job");
    let bytes = wire::encode(&request).unwrap();
    let subj = subject::subject_for(&request.body, &request.project);
    env.publish_raw(&subj, "copy-1", &[], bytes.clone()).await;
    let holder = Holding::new();
    let mut a = instance(&env, "a");
    a.concurrency = 1;
    let a = spawn(&env, a, holder.clone());
    wait_until(WAIT, "the owner working", || async {
        holder.started.load(Ordering::SeqCst) == 1
    })
    .await
    .unwrap();
    let b_handler = Arc::new(Emit::default());
    let b = spawn(&env, instance(&env, "b"), b_handler.clone());
    env.publish_raw(&subj, "copy-2", &[], bytes).await;
    wait_until(
        WAIT,
        "the copy acked while the first is in flight",
        || async {
            let stream = env
                .bus
                .jetstream()
                .get_stream(subject::REQUESTS.name)
                .await
                .unwrap();
            stream.consumer_info("svc").await.is_ok_and(|i| {
                i.ack_floor.stream_sequence == 0 && i.num_ack_pending == 1 && i.num_pending == 0
            }) && holder.started.load(Ordering::SeqCst) == 1
        },
    )
    .await
    .unwrap();
    holder.gate.add_permits(1);
    wait_until(WAIT, "both done", || env.consumer_drained("svc"))
        .await
        .unwrap();
    let sb = stop(b).await;
    let sa = stop(a).await;
    assert_eq!((sb.redundant, sb.deferred, sb.retried), (1, 0, 0), "{sb:?}");
    assert_eq!(b_handler.total_calls(), 0);
    assert_eq!(sa.handled, 1, "{sa:?}");
    assert_eq!(env.fact_count().await, 1);
}

/// The one fact the ledger at `path` recorded for `request`.
fn recorded_fact(path: &std::path::Path, request: &Event) -> Event {
    let ledger = Ledger::open(path).unwrap();
    let outcome = ledger
        .outcome("lab-a", request.kind(), &request.id)
        .unwrap()
        .unwrap();
    assert_eq!(outcome.facts.len(), 1);
    outcome.facts[0].clone()
}

/// Two copies of one event in one process with claims off: both handlers run, each with
/// another verdict. The ledger records the first; the second must publish that one, not its
/// own.
struct TwoVerdicts {
    arrived: AtomicU32,
    both_in: tokio::sync::Barrier,
    release_second: tokio::sync::Notify,
}

impl Handler for TwoVerdicts {
    async fn handle(&self, event: &Event, _ctx: &WorkContext) -> Result<Vec<Event>, HandlerError> {
        let n = self.arrived.fetch_add(1, Ordering::SeqCst);
        self.both_in.wait().await;
        if n == 0 {
            return Ok(vec![ready_fact(event)]);
        }
        self.release_second.notified().await;
        let Body::StageRequested(r) = &event.body else {
            unreachable!()
        };
        Ok(vec![event.caused(
            "failed",
            Body::StageFailed(StageFailed {
                dataset: r.dataset.clone(),
                version: r.version.clone(),
                tier: r.tier.clone(),
                job_id: r.job_id.clone(),
                request_id: event.id.clone(),
                reason: "a different verdict".into(),
                retryable: false,
                node: None,
            }),
        )])
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_racing_duplicate_publishes_the_first_outcome_not_its_own() {
    let env = Env::start().await;
    let request = stage_request("raced");
    let bytes = wire::encode(&request).unwrap();
    let subj = subject::subject_for(&request.body, &request.project);
    env.publish_raw(&subj, "copy-1", &[], bytes.clone()).await;
    env.publish_raw(&subj, "copy-2", &[], bytes).await;
    let handler = Arc::new(TwoVerdicts {
        arrived: AtomicU32::new(0),
        both_in: tokio::sync::Barrier::new(2),
        release_second: tokio::sync::Notify::new(),
    });
    let mut cfg = env.worker("svc");
    cfg.claims = false;
    let worker = spawn(&env, cfg.clone(), handler.clone());
    wait_until(WAIT, "the first verdict", || async {
        env.fact_count().await == 1
    })
    .await
    .unwrap();
    handler.release_second.notify_one();
    wait_until(WAIT, "both copies acked", || env.consumer_drained("svc"))
        .await
        .unwrap();
    let stats = stop(worker).await;
    assert_eq!(stats.handled, 2, "both handlers ran: {stats:?}");
    let facts = env.facts().await;
    assert_eq!(facts.len(), 1, "one verdict: {facts:?}");
    let recorded = recorded_fact(&cfg.ledger_path, &request);
    assert_eq!(
        recorded.id,
        ready_fact(&request).id,
        "the first verdict was recorded"
    );
    assert_eq!(facts[0].2, recorded, "and it is the one published");
}

/// Never finishes; says when its future is dropped.
struct Forever {
    started: AtomicBool,
    dropped: Arc<AtomicBool>,
}

struct DropFlag(Arc<AtomicBool>);

impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

impl Handler for Forever {
    async fn handle(&self, _event: &Event, _ctx: &WorkContext) -> Result<Vec<Event>, HandlerError> {
        let _flag = DropFlag(self.dropped.clone());
        self.started.store(true, Ordering::SeqCst);
        std::future::pending::<()>().await;
        unreachable!("never finishes")
    }
}

/// Someone else writes the claim while the handler runs: the next renewal finds another
/// revision, the handler is cancelled (its future dropped) and nothing is recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_claim_cancels_the_handler_and_records_nothing() {
    let env = Env::start().await;
    let dropped = Arc::new(AtomicBool::new(false));
    let handler = Arc::new(Forever {
        started: AtomicBool::new(false),
        dropped: dropped.clone(),
    });
    let cfg = instance(&env, "a");
    let worker = spawn(&env, cfg.clone(), handler.clone());
    let request = stage_request("stolen");
    env.bus.publish(&request).await.unwrap();
    wait_until(WAIT, "the handler running", || async {
        handler.started.load(Ordering::SeqCst)
    })
    .await
    .unwrap();
    // The claim key is `<service>.<project>.<kind>.<hex(event id)>` (claim.rs).
    let kv = env
        .bus
        .jetstream()
        .get_key_value(CLAIMS_BUCKET)
        .await
        .unwrap();
    let key = format!(
        "svc.lab-a.{}.{}",
        request.kind(),
        hex_of(request.id.as_str())
    );
    kv.put(&key, Bytes::from_static(b"taken by an operator"))
        .await
        .unwrap();
    wait_until(WAIT, "the handler cancelled", || async {
        dropped.load(Ordering::SeqCst)
    })
    .await
    .unwrap();
    let stats = stop(worker).await;
    assert_eq!(stats.deferred, 1, "{stats:?}");
    assert_eq!(
        (stats.handled, stats.retried, stats.dead_lettered),
        (0, 0, 0)
    );
    assert_eq!(env.fact_count().await, 0);
    let ledger = Ledger::open(&cfg.ledger_path).unwrap();
    assert!(
        ledger
            .outcome("lab-a", request.kind(), &request.id)
            .unwrap()
            .is_none()
    );
    assert!(
        ledger
            .attempts("lab-a", request.kind(), &request.id)
            .unwrap()
            .is_empty()
    );
}

fn hex_of(s: &str) -> String {
    s.bytes().map(|b| format!("{b:02x}")).collect()
}

/// Two workers configured with one instance id would take each other's claims for their own
/// earlier life's: the one whose registration was overwritten stops, naming the id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_worker_with_the_same_instance_id_stops_the_first() {
    let env = Env::start().await;
    let first = instance(&env, "twin");
    let mut second = instance(&env, "twin");
    second.ledger_path = env.ledger("svc-twin-2");
    let (_t1, h1) = spawn(&env, first, Arc::new(Emit::default()));
    // The first has registered once it handles something.
    env.bus.publish(&stage_request("warmup")).await.unwrap();
    wait_until(WAIT, "the first working", || async {
        env.fact_count().await == 1
    })
    .await
    .unwrap();
    let second = spawn(&env, second, Arc::new(Emit::default()));
    let err = tokio::time::timeout(WAIT, h1)
        .await
        .expect("the first stops within a heartbeat")
        .unwrap()
        .unwrap_err();
    assert_eq!(
        err.kind(),
        stagehand_bus::BusErrorKind::InstanceTaken,
        "{err}"
    );
    assert!(err.to_string().contains("\"twin\""), "{err}");
    stop(second).await;
}

/// Fails its first call after rewriting its own claim (the same value, a new revision), so
/// that the runtime's release of the claim finds another revision and fails — as it does when
/// the release is lost to a server failover.
struct LosesItsRelease {
    kv: async_nats::jetstream::kv::Store,
    calls: AtomicU32,
    /// Whether the first call found its claim and rewrote it (a panic in a handler is only a
    /// failed attempt to the runtime, so the test checks this itself).
    rewrote: AtomicBool,
}

impl Handler for LosesItsRelease {
    async fn handle(&self, event: &Event, _ctx: &WorkContext) -> Result<Vec<Event>, HandlerError> {
        if self.calls.fetch_add(1, Ordering::SeqCst) == 0 {
            let key = format!(
                "svc.{}.{}.{}",
                event.project,
                event.kind(),
                hex_of(event.id.as_str())
            );
            let held = self.kv.get(&key).await.unwrap().unwrap();
            self.kv.put(&key, held).await.unwrap();
            self.rewrote.store(true, Ordering::SeqCst);
            return Err(HandlerError::retryable("tier offline"));
        }
        Ok(vec![ready_fact(event)])
    }
}

/// Regression: a claim this very process left held (its release was lost) made every later
/// delivery of the message wait a claim lifetime, again and again, because the claim named
/// this process. Nobody here works on it, so the redelivery takes it over at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_this_process_left_behind_is_taken_over_on_redelivery() {
    let env = Env::start().await;
    let kv = env
        .bus
        .jetstream()
        .get_key_value(CLAIMS_BUCKET)
        .await
        .unwrap();
    let handler = Arc::new(LosesItsRelease {
        kv,
        calls: AtomicU32::new(0),
        rewrote: AtomicBool::new(false),
    });
    let mut cfg = instance(&env, "a");
    cfg.claim_lifetime = Some(Duration::from_secs(60));
    let worker = spawn(&env, cfg, handler.clone());
    env.bus
        .publish(&stage_request("left-behind"))
        .await
        .unwrap();
    // Well within the claim lifetime: no waiting it out.
    wait_until(Duration::from_secs(20), "the fact", || async {
        env.fact_count().await == 1
    })
    .await
    .unwrap();
    let stats = stop(worker).await;
    assert!(
        handler.rewrote.load(Ordering::SeqCst),
        "the claim was never rewritten"
    );
    assert_eq!(handler.calls.load(Ordering::SeqCst), 2);
    assert_eq!(
        (stats.retried, stats.deferred, stats.handled),
        (1, 0, 1),
        "{stats:?}"
    );
}

/// Answers a stage request with three `stage.failed` facts of `reason_bytes` each: together
/// more than one claim record can carry under nats-server's default `max_payload`.
struct LargeOutcome {
    reason_bytes: usize,
    calls: AtomicU32,
}

impl LargeOutcome {
    fn facts(&self, event: &Event) -> Vec<Event> {
        let Body::StageRequested(r) = &event.body else {
            unreachable!()
        };
        (0..3)
            .map(|i| {
                event.caused(
                    &format!("failed-{i}"),
                    Body::StageFailed(StageFailed {
                        dataset: r.dataset.clone(),
                        version: r.version.clone(),
                        tier: r.tier.clone(),
                        job_id: r.job_id.clone(),
                        request_id: event.id.clone(),
                        reason: "x".repeat(self.reason_bytes),
                        retryable: false,
                        node: None,
                    }),
                )
            })
            .collect()
    }
}

impl Handler for LargeOutcome {
    async fn handle(&self, event: &Event, _ctx: &WorkContext) -> Result<Vec<Event>, HandlerError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        Ok(self.facts(event))
    }
}

/// Regression: an outcome too large for its claim was committed as `done` without facts. An
/// instance that died after that commit and before publishing left the event finished with
/// nothing said: the redelivery, in another instance, found `done`, had no facts to publish
/// and acked. Now the outcome is kept beside the claim and the other instance publishes it,
/// byte for byte, without running the handler again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outcome_too_large_for_its_claim_is_published_by_the_next_instance() {
    let env = Env::start().await;
    let handler = Arc::new(LargeOutcome {
        reason_bytes: 400 * 1024,
        calls: AtomicU32::new(0),
    });
    let request = stage_request("large-outcome");
    let expected = handler.facts(&request);
    let total: usize = expected
        .iter()
        .map(|f| wire::encode(f).unwrap().len())
        .sum();
    let max_payload = env.bus.client().server_info().max_payload;
    assert!(total > max_payload, "{total} bytes must not fit one record");

    // Instance a records the outcome, then dies before it publishes anything.
    let recorded = Arc::new(tokio::sync::Notify::new());
    let mut hooks = stagehand_bus::WorkerHooks::default();
    let said = recorded.clone();
    hooks.after_record = Some(Arc::new(move |_id| {
        let said = said.clone();
        Box::pin(async move {
            said.notify_one();
            std::future::pending::<()>().await;
        })
    }));
    let a = tokio::spawn(stagehand_bus::run_worker_with_hooks(
        env.bus.clone(),
        instance(&env, "a"),
        handler.clone(),
        CancellationToken::new(),
        hooks,
    ));
    env.bus.publish(&request).await.unwrap();
    tokio::time::timeout(WAIT, recorded.notified())
        .await
        .expect("instance a recorded the outcome");
    a.abort();
    let _ = a.await;
    assert_eq!(env.fact_count().await, 0);

    let b = spawn(&env, instance(&env, "b"), handler.clone());
    wait_until(WAIT, "the redelivery acked", || env.consumer_drained("svc"))
        .await
        .unwrap();
    let sb = stop(b).await;
    assert_eq!(handler.calls.load(Ordering::SeqCst), 1, "not handled twice");
    let published: Vec<Event> = env.facts().await.into_iter().map(|(_, _, e)| e).collect();
    let ids = |facts: &[Event]| facts.iter().map(|f| f.id.clone()).collect::<Vec<_>>();
    assert_eq!(
        ids(&published),
        ids(&expected),
        "the recorded outcome: {sb:?}"
    );
    assert!(
        published
            .iter()
            .zip(&expected)
            .all(|(p, e)| p.body == e.body),
        "published whole"
    );
    // Replayed, never handled: a replay slower than the ack wait (a loaded machine) is
    // delivered again and replayed again, which publishes the same facts (dropped as
    // duplicates), so the count of replays is one or more.
    assert!(sb.replayed >= 1 && sb.handled == 0, "{sb:?}");
}
