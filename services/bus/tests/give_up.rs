//! Step G, the one give-up path: every kind of failure on the last allowed attempt or
//! delivery ends in `STAGEHAND_DEAD_LETTERS` with the attempt history — a handler error, a
//! ledger that cannot be read or written, a claims bucket that is gone, a claim held by a live
//! owner at the delivery ceiling, facts that cannot be published. None is a negative ack that
//! JetStream never redelivers (`consumer_drained` panics on a message dropped at
//! `max_deliver`).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use common::*;
use stagehand_bus::{
    BusError, CLAIMS_BUCKET, CancellationToken, Handler, HandlerError, WorkContext, WorkerConfig,
    WorkerStats, run_worker,
};
use stagehand_schemas::{Attempt, Body, Event, subject, wire};
use stagehand_testkit::{Tmpfs, wait_until};
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

/// One allowed attempt: the first failure that counts is the last.
fn one_attempt(env: &Env) -> WorkerConfig {
    let mut cfg = env.worker("svc");
    cfg.max_attempts = 1;
    cfg
}

/// Waits for the one dead letter and returns its attempt history; checks that the consumer
/// finished with the message (terminated, not dropped).
async fn the_dead_letter(env: &Env, request: &Event) -> Vec<Attempt> {
    wait_until(WAIT, "a dead letter", || async {
        env.dead_letter_count().await == 1
    })
    .await
    .unwrap();
    wait_until(WAIT, "the message terminated", || {
        env.consumer_drained("svc")
    })
    .await
    .unwrap();
    let (_, dl) = env.dead_letters().await.remove(0);
    let Body::DeadLetter(d) = dl.body else {
        panic!("not a dead letter: {dl:?}")
    };
    assert_eq!(d.original_id.as_ref(), Some(&request.id));
    assert_eq!(d.original, wire::encode(request).unwrap());
    d.errors
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_error_on_the_last_attempt_is_dead_lettered() {
    let env = Env::start().await;
    let handler = Arc::new(Flaky::retryable(u32::MAX));
    let worker = spawn(&env, one_attempt(&env), handler.clone());
    let request = stage_request("handler-fails");
    env.bus.publish(&request).await.unwrap();
    let errors = the_dead_letter(&env, &request).await;
    let stats = stop(worker).await;
    assert_eq!(errors.len(), 1);
    assert!(
        errors[0].error.contains("offline") && !errors[0].permanent,
        "{errors:?}"
    );
    assert_eq!((stats.dead_lettered, stats.retried), (1, 0));
}

/// A damaged ledger record: the check of step 2 fails, and that failure counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ledger_read_failure_on_the_last_attempt_is_dead_lettered() {
    let env = Env::start().await;
    let request = stage_request("unreadable");
    {
        // The ledger's own table of outcomes (`ledger.rs`), with bytes that are no record.
        let db = redb::Database::create(env.ledger("svc")).unwrap();
        let txn = db.begin_write().unwrap();
        {
            let def = redb::TableDefinition::<&str, &[u8]>::new("outcomes_v2");
            let mut t = txn.open_table(def).unwrap();
            t.insert(
                format!("lab-a/{}", request.id).as_str(),
                &[0xc1u8, 0xc1][..],
            )
            .unwrap();
        }
        txn.commit().unwrap();
    }
    let handler = Arc::new(Emit::default());
    let worker = spawn(&env, one_attempt(&env), handler.clone());
    env.bus.publish(&request).await.unwrap();
    let errors = the_dead_letter(&env, &request).await;
    stop(worker).await;
    assert_eq!(handler.total_calls(), 0, "the work never started");
    assert!(errors[0].error.contains("reading the ledger"), "{errors:?}");
}

/// The ledger on a full disk: recording the outcome fails, and so does recording the dead
/// letter — which is published all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ledger_write_failure_on_the_last_attempt_is_dead_lettered() {
    let env = Env::start().await;
    let disk = Tmpfs::mount(env.dir.path().join("disk"), "8m");
    let mut cfg = one_attempt(&env);
    cfg.ledger_path = disk.path().join("svc.redb");
    cfg.claims = false;
    let handler = Arc::new(Emit::default());
    let worker = spawn(&env, cfg, handler.clone());
    let first = stage_request("before-full");
    env.bus.publish(&first).await.unwrap();
    wait_until(WAIT, "the first fact", || async {
        env.fact_count().await == 1
    })
    .await
    .unwrap();
    disk.fill();
    let request = stage_request("unrecordable");
    env.bus.publish(&request).await.unwrap();
    let errors = the_dead_letter(&env, &request).await;
    let stats = stop(worker).await;
    assert!(
        errors[0].error.contains("recording the outcome"),
        "{errors:?}"
    );
    assert_eq!(
        env.fact_count().await,
        1,
        "an unrecorded outcome is never published"
    );
    assert_eq!(stats.dead_lettered, 1);
    drop(disk);
}

/// The claims bucket is gone (deleted by an operator): claiming fails, and that counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_failure_on_the_last_attempt_is_dead_lettered() {
    let env = Env::start().await;
    let handler = Arc::new(Emit::default());
    let worker = spawn(&env, one_attempt(&env), handler.clone());
    // The worker opened the bucket; wait until it is pulling before removing it.
    let warmup = stage_request("warmup");
    env.bus.publish(&warmup).await.unwrap();
    wait_until(WAIT, "the warmup fact", || async {
        env.fact_count().await == 1
    })
    .await
    .unwrap();
    env.bus
        .jetstream()
        .delete_key_value(CLAIMS_BUCKET)
        .await
        .unwrap();
    let request = stage_request("unclaimable");
    env.bus.publish(&request).await.unwrap();
    let errors = the_dead_letter(&env, &request).await;
    stop(worker).await;
    assert_eq!(handler.calls_for("unclaimable"), 0);
    assert!(errors[0].error.contains("claiming the event"), "{errors:?}");
}

/// The facts stream is gone: the outcome is recorded, its facts cannot be stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_failure_on_the_last_attempt_is_dead_lettered() {
    let env = Env::start().await;
    let handler = Arc::new(Emit::default());
    let worker = spawn(&env, one_attempt(&env), handler.clone());
    env.bus
        .jetstream()
        .delete_stream(subject::FACTS.name)
        .await
        .unwrap();
    let request = stage_request("unpublishable");
    env.bus.publish(&request).await.unwrap();
    let errors = the_dead_letter(&env, &request).await;
    stop(worker).await;
    assert!(errors[0].error.contains("publishing"), "{errors:?}");
}

/// Blocks in its handler until released; counts the calls.
struct Holding {
    started: AtomicU32,
    gate: tokio::sync::Semaphore,
}

impl Handler for Holding {
    async fn handle(&self, event: &Event, _ctx: &WorkContext) -> Result<Vec<Event>, HandlerError> {
        self.started.fetch_add(1, Ordering::SeqCst);
        self.gate.acquire().await.expect("gate open").forget();
        Ok(vec![ready_fact(event)])
    }
}

/// The worker holding a message's claim dies (its task is dropped: no more acks, no more
/// renewals) with a long claim lifetime; the message comes back to another instance at its
/// delivery ceiling. The claim cannot be taken yet — and rather than being dropped, the message
/// is dead-lettered, saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_held_elsewhere_at_the_delivery_ceiling_is_dead_lettered() {
    let env = Env::start().await;
    let request = stage_request("held");
    let holder = Arc::new(Holding {
        started: AtomicU32::new(0),
        gate: tokio::sync::Semaphore::new(0),
    });
    let mut a = env.worker("svc");
    a.instance_id = Some("a".into());
    a.ledger_path = env.ledger("svc-a");
    a.ack_wait = Duration::from_secs(1);
    a.claim_lifetime = Some(Duration::from_secs(60));
    let (_, a) = spawn(&env, a, holder.clone());
    env.bus.publish(&request).await.unwrap();
    wait_until(WAIT, "the holder working", || async {
        holder.started.load(Ordering::SeqCst) == 1
    })
    .await
    .unwrap();
    a.abort();
    let _ = a.await;

    let mut b = one_attempt(&env);
    b.instance_id = Some("b".into());
    b.ledger_path = env.ledger("svc-b");
    b.ack_wait = Duration::from_secs(1);
    b.max_deliver = 2;
    let b_handler = Arc::new(Emit::default());
    let b = spawn(&env, b, b_handler.clone());
    let errors = the_dead_letter(&env, &request).await;
    let sb = stop(b).await;
    assert_eq!(b_handler.total_calls(), 0, "the handler never ran again");
    assert_eq!((sb.dead_lettered, sb.retried), (1, 0), "{sb:?}");
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(errors[0].delivery, 2);
    assert!(
        errors[0].error.contains("claimed by another delivery"),
        "{errors:?}"
    );
    assert_eq!(env.fact_count().await, 0);
}
