//! The consume loop against a real nats-server: facts, dedup, poison messages, retries, dead
//! letters, shutdown, ledger batching, provisioning and two instances sharing a consumer.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use common::*;
use stagehand_bus::{
    Bus, BusConfig, BusError, BusErrorKind, CLAIMS_BUCKET, CancellationToken, Handler,
    HandlerError, Ledger, REPLAY_HEADER, WorkContext, WorkerStats, provision_consumer, run_worker,
};
use stagehand_schemas::subject::{self, dead_letter_subject, subject_for};
use stagehand_schemas::{Body, Event, Retryable, wire};
use stagehand_testkit::{wait_for, wait_until};
use tokio::task::JoinHandle;

fn spawn<H: Handler>(
    bus: &Bus,
    cfg: stagehand_bus::WorkerConfig,
    handler: Arc<H>,
) -> (CancellationToken, JoinHandle<Result<WorkerStats, BusError>>) {
    let token = CancellationToken::new();
    let handle = tokio::spawn(run_worker(bus.clone(), cfg, handler, token.clone()));
    (token, handle)
}

async fn stop(
    token: CancellationToken,
    handle: JoinHandle<Result<WorkerStats, BusError>>,
) -> WorkerStats {
    token.cancel();
    handle.await.unwrap().unwrap()
}

async fn publish(env: &Env, event: &Event) {
    env.bus.publish(event).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_request_yields_its_facts_with_trace_context_and_a_ledger_outcome() {
    let env = Env::start().await;
    let handler = Arc::new(Emit::default());
    let (token, handle) = spawn(&env.bus, env.worker("svc"), handler.clone());
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let requests: Vec<Event> = (0..3).map(|i| stage_request(&format!("req-{i}"))).collect();
    for r in &requests {
        let bytes = wire::encode(r).unwrap();
        let tp = format!("00-{trace_id}-00f067aa0ba902b7-01");
        env.publish_raw(
            &subject_for(&r.body, &r.project),
            r.id.as_str(),
            &[("traceparent", &tp)],
            bytes,
        )
        .await;
    }
    wait_until(WAIT, "three facts", || async {
        env.fact_count().await == 3
    })
    .await
    .unwrap();
    let stats = stop(token, handle).await;
    assert_eq!(stats.handled, 3);

    let facts = env.facts().await;
    for r in &requests {
        let expected = ready_fact(r);
        let (subj, headers, fact) = facts
            .iter()
            .find(|(_, _, f)| f.id == expected.id)
            .expect("fact published");
        assert_eq!(subj, &subject_for(&fact.body, &fact.project));
        // The fact id scoped by its subject: no other project's or kind's message shares it.
        assert_eq!(
            headers.get("Nats-Msg-Id").unwrap().as_str(),
            stagehand_bus::msg_id_for(subj, expected.id.as_str())
        );
        assert_eq!(fact.causation_id.as_ref(), Some(&r.id));
        let tp = headers
            .get("traceparent")
            .expect("facts carry the trace context")
            .as_str();
        assert!(tp.contains(trace_id), "{tp}");
    }
    let ledger = Ledger::open(env.ledger("svc")).unwrap();
    for r in &requests {
        let outcome = ledger
            .outcome("lab-a", r.kind(), &r.id)
            .unwrap()
            .expect("outcome recorded");
        assert_eq!(outcome.facts.len(), 1);
        assert_eq!(outcome.facts[0].id, ready_fact(r).id);
        assert!(outcome.dead_letter.is_none());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_request_fifty_times_yields_one_set_of_facts() {
    let env = Env::start().await;
    let request = stage_request("upload-7");
    let bytes = wire::encode(&request).unwrap();
    let subj = subject_for(&request.body, &request.project);
    // 50 publishes with the same Nats-Msg-Id: the stream keeps one.
    let mut duplicates = 0;
    for _ in 0..50 {
        duplicates += u32::from(
            env.publish_raw(&subj, request.id.as_str(), &[], bytes.clone())
                .await,
        );
    }
    assert_eq!(duplicates, 49);
    // 50 more copies that bypass the duplicate window (other message ids): the ledger and the
    // claims must keep the work to one.
    for i in 0..50 {
        env.publish_raw(
            &subj,
            &format!("{}-copy-{i}", request.id),
            &[],
            bytes.clone(),
        )
        .await;
    }
    let handler = Arc::new(Emit::default());
    let (token, handle) = spawn(&env.bus, env.worker("svc"), handler.clone());
    let consumer_done = || env.consumer_drained("svc");
    wait_until(WAIT, "all 51 messages acked", consumer_done)
        .await
        .unwrap();
    let stats = stop(token, handle).await;
    assert_eq!(handler.calls_for("upload-7"), 1, "the work ran once");
    assert_eq!(stats.handled, 1);
    // Every other copy was answered with the recorded outcome (from the ledger or the claim),
    // or, arriving while the first was in flight, acked as redundant.
    assert_eq!(stats.replayed + stats.redundant, 50, "{stats:?}");
    assert_eq!((stats.dead_lettered, stats.retried), (0, 0), "{stats:?}");
    let facts = env.facts().await;
    assert_eq!(facts.len(), 1);
    assert_eq!(facts[0].2.id, ready_fact(&request).id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_messages_are_dead_lettered_with_their_bytes_and_the_next_is_processed() {
    let env = Env::start().await;
    let subj = "stagehand.req.stage.requested.lab-a";
    let garbage: Vec<u8> = vec![0xc1, 0xff, 0x00, 0x13, 0x37, 0x80, 0x92];
    env.publish_raw(subj, "poison-1", &[("x-origin", "fuzzer")], garbage.clone())
        .await;
    // A well-formed map with a kind this contract does not know.
    let mut unknown = rmp_serde::to_vec_named(&stage_request("unknown-kind")).unwrap();
    let needle = b"stage.requested";
    let at = unknown
        .windows(needle.len())
        .position(|w| w == needle)
        .unwrap();
    unknown[at..at + needle.len()].copy_from_slice(b"stage.teleports");
    env.publish_raw(subj, "poison-2", &[], unknown.clone())
        .await;
    let good = stage_request("after-poison");
    publish(&env, &good).await;

    let handler = Arc::new(Emit::default());
    let (token, handle) = spawn(&env.bus, env.worker("svc"), handler.clone());
    wait_until(WAIT, "fact and two dead letters", || async {
        env.fact_count().await == 1 && env.dead_letter_count().await == 2
    })
    .await
    .unwrap();
    let stats = stop(token, handle).await;
    assert_eq!(stats.dead_lettered, 2);
    assert_eq!(handler.calls_for("after-poison"), 1);

    let mut dls = env.dead_letters().await;
    // The two poison messages are handled concurrently, so their dead letters may be published
    // in either order: put them back in the order the messages were published.
    dls.sort_by_key(|(_, dl)| match &dl.body {
        Body::DeadLetter(d) => d.stream_sequence,
        _ => u64::MAX,
    });
    assert_eq!(dls.len(), 2);
    for (dl_subject, dl) in &dls {
        assert_eq!(dl_subject, &dead_letter_subject("svc"));
        let Body::DeadLetter(d) = &dl.body else {
            panic!("not a dead letter")
        };
        assert_eq!(d.service, "svc");
        assert_eq!(d.stream, subject::REQUESTS.name);
        assert_eq!(d.subject, subj);
        assert_eq!(d.delivered, 1);
        assert_eq!(d.errors.len(), 1);
        assert!(d.errors[0].permanent);
        assert!(
            d.errors[0].error.contains("undecodable"),
            "{}",
            d.errors[0].error
        );
        assert!(d.original_id.is_none());
    }
    let (_, first) = &dls[0];
    let Body::DeadLetter(d) = &first.body else {
        unreachable!()
    };
    assert_eq!(d.original, garbage);
    assert!(
        d.headers.contains(&("x-origin".into(), "fuzzer".into())),
        "{:?}",
        d.headers
    );
    assert!(
        d.headers
            .contains(&("Nats-Msg-Id".into(), "poison-1".into())),
        "{:?}",
        d.headers
    );
    let Body::DeadLetter(d2) = &dls[1].1.body else {
        unreachable!()
    };
    assert_eq!(d2.original, unknown);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retryable_failure_is_retried_after_its_delay_then_succeeds() {
    let env = Env::start().await;
    let handler = Arc::new(Flaky::retryable(2));
    let mut cfg = env.worker("svc");
    cfg.retry.initial = Duration::from_millis(300);
    cfg.retry.factor = 1.0;
    let (token, handle) = spawn(&env.bus, cfg, handler.clone());
    let request = stage_request("flaky-1");
    publish(&env, &request).await;
    wait_until(WAIT, "the fact after two failures", || async {
        env.fact_count().await == 1
    })
    .await
    .unwrap();
    let stats = stop(token, handle).await;
    assert_eq!(handler.calls.load(Ordering::SeqCst), 3);
    assert_eq!(stats.retried, 2);
    assert_eq!(env.dead_letter_count().await, 0);
    let outcome = Ledger::open(env.ledger("svc"))
        .unwrap()
        .outcome("lab-a", request.kind(), &request.id)
        .unwrap()
        .unwrap();
    assert_eq!(outcome.facts, vec![env.facts().await[0].2.clone()]);
    let deliveries: Vec<u64> = outcome.attempts.iter().map(|a| a.delivery).collect();
    assert_eq!(
        deliveries,
        vec![1, 2],
        "the history of failed attempts is kept"
    );
    assert!(
        outcome
            .attempts
            .iter()
            .all(|a| !a.permanent && a.error.contains("offline"))
    );
    // The redelivery waited for the negative ack's delay (a lower bound, so never flaky).
    let gap = outcome.attempts[1].at - outcome.attempts[0].at;
    assert!(
        gap >= time::Duration::milliseconds(250),
        "redelivered after {gap}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permanent_failure_is_dead_lettered_at_once() {
    let env = Env::start().await;
    let handler = Arc::new(Flaky::permanent());
    let (token, handle) = spawn(&env.bus, env.worker("svc"), handler.clone());
    let request = stage_request("impossible-1");
    publish(&env, &request).await;
    wait_until(WAIT, "a dead letter", || async {
        env.dead_letter_count().await == 1
    })
    .await
    .unwrap();
    let stats = stop(token, handle).await;
    assert_eq!(handler.calls.load(Ordering::SeqCst), 1);
    assert_eq!((stats.dead_lettered, stats.retried), (1, 0));
    assert_eq!(env.fact_count().await, 0);
    let (_, dl) = &env.dead_letters().await[0];
    let Body::DeadLetter(d) = &dl.body else {
        panic!()
    };
    assert_eq!(d.delivered, 1);
    assert_eq!(d.original_id.as_ref(), Some(&request.id));
    assert_eq!(d.original, wire::encode(&request).unwrap());
    assert_eq!(d.errors.len(), 1);
    assert!(d.errors[0].permanent && d.errors[0].error.contains("nowhere"));
    assert_eq!(dl.causation_id.as_ref(), Some(&request.id));
    let ledger = Ledger::open(env.ledger("svc")).unwrap();
    // Recorded under the dead letter's own id, not as the event's outcome: a replayed copy
    // of the event is worked on again.
    let recorded = ledger.dead_letter(&dl.id).unwrap().unwrap();
    assert!(recorded.permanent_error.unwrap().contains("nowhere"));
    assert_eq!(recorded.dead_letter.unwrap().id, dl.id);
    assert!(
        ledger
            .outcome("lab-a", request.kind(), &request.id)
            .unwrap()
            .is_none()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exhausting_max_attempts_dead_letters_with_the_whole_history() {
    let env = Env::start().await;
    let handler = Arc::new(Flaky::retryable(u32::MAX));
    let mut cfg = env.worker("svc");
    cfg.max_attempts = 3;
    cfg.retry.initial = Duration::from_millis(50);
    let (token, handle) = spawn(&env.bus, cfg, handler.clone());
    let request = stage_request("never-works");
    publish(&env, &request).await;
    wait_until(WAIT, "a dead letter", || async {
        env.dead_letter_count().await == 1
    })
    .await
    .unwrap();
    let stats = stop(token, handle).await;
    assert_eq!(handler.calls.load(Ordering::SeqCst), 3);
    assert_eq!((stats.retried, stats.dead_lettered), (2, 1));
    let (_, dl) = &env.dead_letters().await[0];
    let Body::DeadLetter(d) = &dl.body else {
        panic!()
    };
    assert_eq!(d.delivered, 3);
    let deliveries: Vec<u64> = d.errors.iter().map(|a| a.delivery).collect();
    assert_eq!(deliveries, vec![1, 2, 3]);
    assert!(
        d.errors
            .iter()
            .all(|a| !a.permanent && a.error.contains("offline"))
    );
}

/// Blocks every handler until the test lets it through.
struct Gated {
    started: AtomicU32,
    finished: AtomicU32,
    gate: tokio::sync::Semaphore,
}

impl Handler for Gated {
    async fn handle(&self, event: &Event, _ctx: &WorkContext) -> Result<Vec<Event>, HandlerError> {
        self.started.fetch_add(1, Ordering::SeqCst);
        self.gate.acquire().await.expect("gate open").forget();
        self.finished.fetch_add(1, Ordering::SeqCst);
        Ok(vec![ready_fact(event)])
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_during_work_loses_nothing_and_records_nothing_twice() {
    let env = Env::start().await;
    let requests: Vec<Event> = (0..10)
        .map(|i| stage_request(&format!("job-{i}")))
        .collect();
    for r in &requests {
        publish(&env, r).await;
    }
    let gated = Arc::new(Gated {
        started: AtomicU32::new(0),
        finished: AtomicU32::new(0),
        gate: tokio::sync::Semaphore::new(0),
    });
    let mut cfg = env.worker("svc");
    cfg.concurrency = 4;
    cfg.shutdown_deadline = Duration::from_millis(1500);
    let (token, handle) = spawn(&env.bus, cfg.clone(), gated.clone());
    wait_until(WAIT, "four handlers running", || async {
        gated.started.load(Ordering::SeqCst) == 4
    })
    .await
    .unwrap();
    // Ask for shutdown while four are mid-work; let two finish within the deadline.
    token.cancel();
    gated.gate.add_permits(2);
    let stats = handle.await.unwrap().unwrap();
    assert_eq!(stats.handled, 2, "{stats:?}");
    assert_eq!(stats.abandoned, 2, "{stats:?}");
    assert_eq!(env.fact_count().await, 2);
    {
        let ledger = Ledger::open(&cfg.ledger_path).unwrap();
        assert_eq!(ledger.len().unwrap(), 2, "only finished work is recorded");
    }

    // A new worker with the same ledger picks up everything else, once.
    let emit = Arc::new(Emit::default());
    let (token, handle) = spawn(&env.bus, cfg.clone(), emit.clone());
    wait_until(WAIT, "ten facts", || async { env.fact_count().await == 10 })
        .await
        .unwrap();
    let consumer_done = || env.consumer_drained("svc");
    wait_until(WAIT, "everything acked", consumer_done)
        .await
        .unwrap();
    stop(token, handle).await;
    let facts = env.facts().await;
    assert_eq!(facts.len(), 10);
    for r in &requests {
        assert_eq!(
            facts
                .iter()
                .filter(|(_, _, f)| f.causation_id.as_ref() == Some(&r.id))
                .count(),
            1
        );
    }
    for id in ["job-0", "job-1", "job-2", "job-3"] {
        assert!(emit.calls_for(id) <= 1);
    }
    let ledger = Ledger::open(&cfg.ledger_path).unwrap();
    assert_eq!(ledger.len().unwrap(), 10);
    for r in &requests {
        assert_eq!(
            ledger
                .outcome("lab-a", r.kind(), &r.id)
                .unwrap()
                .unwrap()
                .facts
                .len(),
            1
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_outcomes_share_ledger_commits() {
    let env = Env::start().await;
    for i in 0..300 {
        publish(&env, &stage_request(&format!("batch-{i}"))).await;
    }
    let mut cfg = env.worker("svc");
    cfg.concurrency = 64;
    let handler = Arc::new(Emit::default());
    let (token, handle) = spawn(&env.bus, cfg, handler.clone());
    wait_until(WAIT, "300 facts", || async {
        env.fact_count().await == 300
    })
    .await
    .unwrap();
    let stats = stop(token, handle).await;
    assert_eq!(stats.handled, 300);
    assert_eq!(stats.ledger_writes, 300);
    assert!(
        stats.ledger_commits < stats.ledger_writes,
        "{} commits for {} outcomes",
        stats.ledger_commits,
        stats.ledger_writes
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provisioning_applies_changed_configuration() {
    let env = Env::start().await;
    let js = env.bus.jetstream();
    // Someone shortened the facts stream's duplicate window and capped it.
    let mut drifted = stagehand_bus::stream_config(&subject::FACTS, 1);
    drifted.duplicate_window = Duration::from_secs(5);
    drifted.max_bytes = 1 << 20;
    js.update_stream(drifted).await.unwrap();
    env.bus.provision().await.unwrap();
    let mut facts = js.get_stream(subject::FACTS.name).await.unwrap();
    let config = facts.info().await.unwrap().config.clone();
    assert_eq!(config.duplicate_window, subject::FACTS.duplicate_window);
    assert_eq!(config.max_bytes, -1);

    // A stream with the wrong retention cannot be fixed in place: a clear error.
    js.delete_stream(subject::DEAD_LETTERS.name).await.unwrap();
    let mut wrong = stagehand_bus::stream_config(&subject::DEAD_LETTERS, 1);
    wrong.retention = async_nats::jetstream::stream::RetentionPolicy::WorkQueue;
    js.create_stream(wrong).await.unwrap();
    let err = env.bus.provision().await.unwrap_err();
    assert_eq!(err.kind(), BusErrorKind::RetentionMismatch, "{err}");
    assert!(!err.is_retryable());
    assert!(err.to_string().contains(subject::DEAD_LETTERS.name));

    // The consumer follows its worker configuration.
    let mut cfg = env.worker("svc");
    provision_consumer(&env.bus, &cfg).await.unwrap();
    cfg.ack_wait = Duration::from_secs(7);
    cfg.max_deliver = 3;
    cfg.concurrency = 5;
    cfg.filter_subjects = vec![
        subject::kind_filter("req", "stage.requested"),
        subject::kind_filter("req", "stage.released"),
    ];
    let mut consumer = provision_consumer(&env.bus, &cfg).await.unwrap();
    let info = consumer.info().await.unwrap();
    assert_eq!(info.config.ack_wait, Duration::from_secs(7));
    assert_eq!(info.config.max_deliver, 3);
    assert_eq!(info.config.max_ack_pending, 10);
    let mut filters = info.config.filter_subjects.clone();
    filters.sort();
    cfg.filter_subjects.sort();
    assert_eq!(filters, cfg.filter_subjects);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provisioning_creates_the_manifest_bucket_and_upload_buckets_and_corrects_their_drift() {
    let env = Env::start().await;
    let js = env.bus.jetstream();
    let bucket_config = |name: &'static str| async move {
        js.get_stream(name)
            .await
            .unwrap()
            .info()
            .await
            .unwrap()
            .config
            .clone()
    };
    // `provision` made the services' manifest bucket: an Object Store, kept for ever, with
    // direct gets (what readers' NATS rights allow) and the configured replicas.
    let manifests = subject::MANIFESTS.stream_name();
    assert_eq!(manifests, "OBJ_stagehand_manifests");
    js.get_object_store(subject::MANIFEST_BUCKET).await.unwrap();
    let config = bucket_config("OBJ_stagehand_manifests").await;
    assert_eq!(config.max_age, Duration::ZERO);
    assert!(config.allow_direct);
    assert_eq!(config.num_replicas, 1);
    assert_eq!(
        config.description.as_deref(),
        Some(subject::MANIFESTS.description)
    );

    // Someone aged it out and turned direct gets off: provisioning puts both back.
    let mut drifted = config.clone();
    drifted.max_age = Duration::from_secs(3600);
    drifted.allow_direct = false;
    js.update_stream(drifted.clone()).await.unwrap();
    // A user that may not manage streams only finds it …
    let mut check_only = BusConfig::new(env.nats.url());
    check_only.provision = false;
    let checker = Bus::connect(&check_only).await.unwrap();
    checker.provision().await.unwrap();
    assert_eq!(
        bucket_config("OBJ_stagehand_manifests").await.max_age,
        Duration::from_secs(3600)
    );
    // … the operator corrects it.
    env.bus.provision().await.unwrap();
    let config = bucket_config("OBJ_stagehand_manifests").await;
    assert_eq!(config.max_age, Duration::ZERO);
    assert!(config.allow_direct);

    // A project's upload bucket, made on demand (`stagehand provision --project lab-a`), kept
    // as long as the requests that reference its manifests.
    let uploads = subject::upload_bucket_spec("lab-a");
    env.bus.provision_object_bucket(&uploads).await.unwrap();
    env.bus.provision_object_bucket(&uploads).await.unwrap();
    js.get_object_store("stagehand_uploads_lab-a")
        .await
        .unwrap();
    let config = bucket_config("OBJ_stagehand_uploads_lab-a").await;
    assert_eq!(config.max_age, subject::UPLOAD_MAX_AGE);

    // Without it, a user that may not manage streams is told who makes it.
    js.delete_stream("OBJ_stagehand_manifests").await.unwrap();
    let err = checker.provision().await.unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("Object Store bucket stagehand_manifests")
            && text.contains("run `stagehand provision` as the operator"),
        "{text}"
    );
    assert!(js.get_stream("OBJ_stagehand_manifests").await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_sharing_a_consumer_do_each_event_once() {
    let env = Env::start().await;
    let handler = Arc::new(Emit::default());
    // A copy that finds the other instance's claim waits out its lifetime: keep it short.
    let quick = |ledger: &str| {
        let mut cfg = env.worker("svc");
        cfg.ledger_path = env.ledger(ledger);
        cfg.ack_wait = Duration::from_secs(1);
        cfg.claim_lifetime = Some(Duration::from_secs(1));
        cfg
    };
    let (a, b) = (quick("svc-a"), quick("svc-b"));
    let (ta, ha) = spawn(&env.bus, a, handler.clone());
    let (tb, hb) = spawn(&env.bus, b, handler.clone());
    let mut expected = 0;
    for i in 0..40 {
        let r = stage_request(&format!("shared-{i}"));
        let bytes = wire::encode(&r).unwrap();
        let subj = subject_for(&r.body, &r.project);
        // Three messages per event id, two of them bypassing the duplicate window.
        for copy in 0..3 {
            env.publish_raw(&subj, &format!("{}-{copy}", r.id), &[], bytes.clone())
                .await;
            expected += 1;
        }
    }
    let consumer_done = || env.consumer_drained("svc");
    wait_until(WAIT, "all copies acked", consumer_done)
        .await
        .unwrap();
    let sa = stop(ta, ha).await;
    let sb = stop(tb, hb).await;
    assert!(
        sa.handled > 0 && sb.handled > 0,
        "both instances worked: {sa:?} {sb:?}"
    );
    for i in 0..40 {
        assert_eq!(
            handler.calls_for(&format!("shared-{i}")),
            1,
            "shared-{i} worked once"
        );
    }
    assert_eq!(sa.handled + sb.handled, 40);
    assert_eq!(
        sa.replayed + sb.replayed + sa.redundant + sb.redundant,
        expected - 40,
        "every other copy was answered with the recorded outcome or acked as redundant: {sa:?} {sb:?}"
    );
    assert_eq!(sa.dead_lettered + sb.dead_lettered, 0);
    assert_eq!(env.fact_count().await, 40);
}

/// Regression: a message the server drops at `max_deliver` leaves nothing pending and nothing
/// awaiting an ack, so counting pending messages alone called a consumer that lost it
/// "drained". The helper must see the loss.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_drained_does_not_count_a_message_dropped_at_max_deliver_as_drained() {
    use async_nats::jetstream::{AckKind, consumer::pull};
    use futures::StreamExt;

    let env = Env::start().await;
    let stream = env
        .bus
        .jetstream()
        .get_stream(subject::REQUESTS.name)
        .await
        .unwrap();
    let consumer = stream
        .create_consumer(pull::Config {
            durable_name: Some("raw".into()),
            max_deliver: 1,
            filter_subject: subject::kind_filter("req", "stage.requested"),
            ..Default::default()
        })
        .await
        .unwrap();
    publish(&env, &stage_request("dropped")).await;
    let mut batch = consumer.fetch().max_messages(1).messages().await.unwrap();
    let msg = batch.next().await.unwrap().unwrap();
    // The first delivery is the last one allowed: this nak is a silent drop.
    msg.ack_with(AckKind::Nak(None)).await.unwrap();
    let state = wait_for(WAIT, "the server to give up on the message", || async {
        // A pull request gives the server the occasion to try the redelivery it may not make.
        let _ = consumer
            .fetch()
            .max_messages(1)
            .expires(Duration::from_millis(100))
            .messages()
            .await
            .map(|b| b.count());
        match env.consumer_state("raw").await {
            Drained::No => None,
            other => Some(other),
        }
    })
    .await
    .unwrap();
    // Nothing pending, nothing awaiting an ack: what the old helper took for drained.
    let info = stream.consumer_info("raw").await.unwrap();
    assert_eq!((info.num_pending, info.num_ack_pending), (0, 0));
    assert_eq!(
        state,
        Drained::Dropped {
            ack_floor: 0,
            delivered: 1
        }
    );
}

/// The ledger is pruned, on the worker's timer, of outcomes older than `ledger_retention`
/// (two seconds here): a copy of a pruned event is worked on again, while a copy of an event
/// recorded within the retention is still answered from the ledger. Claims are off, since a
/// claim's `done` record (kept by the bucket for a day) would answer the copy too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ledger_is_pruned_of_old_outcomes_on_a_timer_and_keeps_live_ones() {
    let env = Env::start().await;
    let mut cfg = env.worker("svc");
    cfg.claims = false;
    cfg.ledger_retention = Duration::from_secs(2);
    cfg.prune_interval = Duration::from_millis(200);
    let handler = Arc::new(Emit::default());
    let (token, handle) = spawn(&env.bus, cfg, handler.clone());
    let old = stage_request("old");
    let old_bytes = wire::encode(&old).unwrap();
    let subj = subject_for(&old.body, &old.project);
    publish(&env, &old).await;
    // Its fact is published after its outcome is recorded.
    wait_until(WAIT, "the old event's fact", || async {
        env.fact_count().await == 1
    })
    .await
    .unwrap();
    let copies = AtomicU32::new(0);
    wait_until(WAIT, "a copy of the old event worked on again", || async {
        let n = copies.fetch_add(1, Ordering::SeqCst);
        env.publish_raw(&subj, &format!("old-copy-{n}"), &[], old_bytes.clone())
            .await;
        handler.calls_for("old") >= 2
    })
    .await
    .unwrap();

    let live = stage_request("live");
    publish(&env, &live).await;
    // The old event's second fact has the first one's id, so the stream kept one.
    wait_until(WAIT, "the live event's fact", || async {
        env.fact_count().await == 2
    })
    .await
    .unwrap();
    env.publish_raw(
        &subject_for(&live.body, &live.project),
        "live-copy",
        &[],
        wire::encode(&live).unwrap(),
    )
    .await;
    wait_until(WAIT, "everything acked", || env.consumer_drained("svc"))
        .await
        .unwrap();
    let stats = stop(token, handle).await;
    assert_eq!(handler.calls_for("live"), 1, "a live outcome is kept");
    assert!(stats.ledger_pruned >= 1, "{stats:?}");
    // Every copy was answered from the ledger but the ones that came after the pruning.
    assert_eq!(
        stats.handled + stats.replayed,
        u64::from(copies.load(Ordering::SeqCst)) + 3,
        "{stats:?}"
    );
}

/// Republishes a dead letter's message as `stagehand dlq replay` does: its bytes and headers,
/// a fresh `Nats-Msg-Id`, and the replay header naming the dead letter.
async fn replay_dead_letter(env: &Env, dl: &Event) {
    let Body::DeadLetter(d) = &dl.body else {
        panic!("not a dead letter")
    };
    let mut headers: Vec<(&str, &str)> = d
        .headers
        .iter()
        .filter(|(k, _)| k != "Nats-Msg-Id")
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    headers.push((REPLAY_HEADER, dl.id.as_str()));
    env.publish_raw(
        &d.subject,
        &format!("replay-{}", dl.id),
        &headers,
        d.original.clone(),
    )
    .await;
}

/// A dead-lettered event, replayed once its cause is gone, is worked on again: the dead
/// letter is recorded under its own id, not as the event's outcome, and its claim is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_dead_letter_is_worked_on_again() {
    let env = Env::start().await;
    let handler = Arc::new(Flaky::retryable(1));
    let mut cfg = env.worker("svc");
    cfg.max_attempts = 1;
    let (token, handle) = spawn(&env.bus, cfg.clone(), handler.clone());
    let request = stage_request("replay-me");
    publish(&env, &request).await;
    wait_until(WAIT, "a dead letter", || async {
        env.dead_letter_count().await == 1
    })
    .await
    .unwrap();
    let (_, dl) = env.dead_letters().await.remove(0);
    replay_dead_letter(&env, &dl).await;
    wait_until(WAIT, "the fact of the replay", || async {
        env.fact_count().await == 1
    })
    .await
    .unwrap();
    wait_until(WAIT, "drained", || env.consumer_drained("svc"))
        .await
        .unwrap();
    let stats = stop(token, handle).await;
    assert_eq!(
        handler.calls.load(Ordering::SeqCst),
        2,
        "the handler ran again"
    );
    assert_eq!((stats.dead_lettered, stats.handled), (1, 1), "{stats:?}");
    let ledger = Ledger::open(&cfg.ledger_path).unwrap();
    assert!(ledger.dead_letter(&dl.id).unwrap().is_some());
    let outcome = ledger
        .outcome("lab-a", request.kind(), &request.id)
        .unwrap()
        .unwrap();
    assert_eq!(outcome.facts.len(), 1);
    assert_eq!(outcome.facts[0].id, ready_fact(&request).id);
}

/// An older runtime marked a dead-lettered event's claim `done` (without facts), which
/// answers any later copy without work. A replay — it carries the replay header — is not
/// answered by such a marker; a plain copy still is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_is_not_answered_by_an_old_runtimes_done_marker() {
    let env = Env::start().await;
    let request = stage_request("marked-done");
    let kv = env
        .bus
        .jetstream()
        .get_key_value(CLAIMS_BUCKET)
        .await
        .unwrap();
    let hex: String = request
        .id
        .as_str()
        .bytes()
        .map(|b| format!("{b:02x}"))
        .collect();
    kv.put(
        format!("svc.lab-a.{}.{hex}", request.kind()),
        bytes::Bytes::from_static(b"done"),
    )
    .await
    .unwrap();
    let handler = Arc::new(Emit::default());
    let (token, handle) = spawn(&env.bus, env.worker("svc"), handler.clone());
    let bytes = wire::encode(&request).unwrap();
    let subj = subject_for(&request.body, &request.project);
    env.publish_raw(&subj, "plain-copy", &[], bytes.clone())
        .await;
    wait_until(WAIT, "the plain copy acked", || env.consumer_drained("svc"))
        .await
        .unwrap();
    assert_eq!(handler.calls_for("marked-done"), 0);
    env.publish_raw(
        &subj,
        "replayed-copy",
        &[(REPLAY_HEADER, "some-dead-letter")],
        bytes,
    )
    .await;
    wait_until(WAIT, "the replay's fact", || async {
        env.fact_count().await == 1
    })
    .await
    .unwrap();
    let stats = stop(token, handle).await;
    assert_eq!(handler.calls_for("marked-done"), 1);
    assert_eq!((stats.replayed, stats.handled), (1, 1), "{stats:?}");
}

/// Fails fatally: the service's own store is gone.
struct StoreGone;

impl Handler for StoreGone {
    async fn handle(&self, _e: &Event, _ctx: &WorkContext) -> Result<Vec<Event>, HandlerError> {
        Err(HandlerError::fatal("the catalogue store failed"))
    }
}

/// A fatal handler error is not the event's: the worker stops with it (the service exits
/// non-zero for its supervisor) and leaves the message for redelivery — no attempt counted,
/// no dead letter, no Term.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fatal_handler_error_stops_the_worker_and_leaves_the_message() {
    let env = Env::start().await;
    let mut cfg = env.worker("svc");
    cfg.max_attempts = 1;
    let (_token, handle) = spawn(&env.bus, cfg.clone(), Arc::new(StoreGone));
    let request = stage_request("unfoldable");
    publish(&env, &request).await;
    let err = tokio::time::timeout(WAIT, handle)
        .await
        .expect("the worker stops")
        .unwrap()
        .unwrap_err();
    assert_eq!(err.kind(), BusErrorKind::HandlerFatal, "{err}");
    assert!(err.to_string().contains("catalogue store failed"), "{err}");
    assert_eq!(env.dead_letter_count().await, 0);
    // Restarted with a working handler, it does the work.
    let handler = Arc::new(Emit::default());
    let (token, handle) = spawn(&env.bus, cfg, handler.clone());
    wait_until(WAIT, "the fact", || async { env.fact_count().await == 1 })
        .await
        .unwrap();
    stop(token, handle).await;
    assert_eq!(handler.calls_for("unfoldable"), 1);
}
