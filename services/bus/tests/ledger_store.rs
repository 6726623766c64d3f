//! The ledger on a disk that fills up. redb latches an I/O failure (ENOSPC in a commit) and
//! answers `PreviousIo` until the database is reopened: the ledger must reopen and re-check
//! the store and carry on once there is space again — no event lost, none done twice — or,
//! when the store cannot be reopened, stop the worker with an error that names it. The disk
//! is a real tmpfs of a few MiB (mounting needs root).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use stagehand_bus::{BusErrorKind, CancellationToken, Ledger, LedgerErrorKind, run_worker};
use stagehand_schemas::{Retryable, subject};
use stagehand_testkit::{Tmpfs, wait_until};

/// While the disk is full every commit fails and the requests come back; once space is back
/// each is recorded and published exactly once. Claims are off, so the ledger is the only
/// commit point and nothing else can carry an outcome through the outage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_then_space_again_loses_no_event_and_does_none_twice() {
    let env = Env::start().await;
    let disk = Tmpfs::mount(env.dir.path().join("disk"), "8m");
    let mut cfg = env.worker("svc");
    cfg.ledger_path = disk.path().join("svc.redb");
    cfg.claims = false;
    cfg.max_attempts = 100;
    cfg.retry.initial = Duration::from_millis(50);
    cfg.retry.max = Duration::from_millis(200);
    let handler = Arc::new(Emit::default());
    let token = CancellationToken::new();
    let handle = tokio::spawn(run_worker(
        env.bus.clone(),
        cfg.clone(),
        handler.clone(),
        token.clone(),
    ));
    env.bus
        .publish(&stage_request("before-full"))
        .await
        .unwrap();
    wait_until(WAIT, "the first fact", || async {
        env.fact_count().await == 1
    })
    .await
    .unwrap();

    disk.fill();
    let requests: Vec<_> = (0..20)
        .map(|i| stage_request(&format!("full-{i}")))
        .collect();
    for r in &requests {
        env.bus.publish(r).await.unwrap();
    }
    wait_until(
        WAIT,
        "requests failing to record and coming back",
        || async {
            let stream = env
                .bus
                .jetstream()
                .get_stream(subject::REQUESTS.name)
                .await
                .unwrap();
            stream
                .consumer_info("svc")
                .await
                .is_ok_and(|i| i.num_redelivered >= 5)
        },
    )
    .await
    .unwrap();
    assert_eq!(env.fact_count().await, 1, "nothing is published unrecorded");

    disk.free();
    wait_until(WAIT, "every fact", || async {
        env.fact_count().await == 21
    })
    .await
    .unwrap();
    wait_until(WAIT, "everything acked", || env.consumer_drained("svc"))
        .await
        .unwrap();
    token.cancel();
    let stats = handle.await.unwrap().unwrap();
    assert!(
        stats.ledger_reopens >= 1,
        "the store was reopened: {stats:?}"
    );
    assert!(stats.retried >= 5, "{stats:?}");
    assert_eq!((stats.handled, stats.dead_lettered), (21, 0), "{stats:?}");

    let facts = env.facts().await;
    let ledger = Ledger::open(&cfg.ledger_path).unwrap();
    assert_eq!(ledger.len().unwrap(), 21);
    for r in &requests {
        let published: Vec<_> = facts
            .iter()
            .filter(|(_, _, f)| f.causation_id.as_ref() == Some(&r.id))
            .collect();
        assert_eq!(published.len(), 1, "one fact for {}", r.id);
        let recorded = ledger.outcome("lab-a", r.kind(), &r.id).unwrap().unwrap();
        assert_eq!(recorded.facts, vec![published[0].2.clone()]);
    }
}

/// A store that fails and cannot be reopened (its file is gone and the disk is full) stops
/// the worker with an error naming the ledger; the request it could not record is not lost:
/// a worker with a working ledger handles it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ledger_that_cannot_be_reopened_stops_the_worker_with_an_error() {
    let env = Env::start().await;
    let disk = Tmpfs::mount(env.dir.path().join("disk"), "8m");
    let mut cfg = env.worker("svc");
    cfg.ledger_path = disk.path().join("svc.redb");
    cfg.claims = false;
    let handler = Arc::new(Emit::default());
    let token = CancellationToken::new();
    let handle = tokio::spawn(run_worker(
        env.bus.clone(),
        cfg.clone(),
        handler.clone(),
        token.clone(),
    ));
    env.bus.publish(&stage_request("first")).await.unwrap();
    wait_until(WAIT, "the first fact", || async {
        env.fact_count().await == 1
    })
    .await
    .unwrap();

    disk.fill();
    std::fs::remove_file(&cfg.ledger_path).unwrap();
    env.bus
        .publish(&stage_request("unrecordable"))
        .await
        .unwrap();
    let err = tokio::time::timeout(WAIT, handle)
        .await
        .expect("the worker stops")
        .unwrap()
        .unwrap_err();
    assert_eq!(
        err.kind(),
        BusErrorKind::Ledger(LedgerErrorKind::Failed),
        "{err}"
    );
    // Retryable for the supervisor: a restart reopens the store (the runner exits 1, not 78).
    assert!(err.is_retryable());
    assert!(
        err.to_string()
            .contains(&cfg.ledger_path.display().to_string()),
        "{err}"
    );
    assert_eq!(env.fact_count().await, 1);

    let mut cfg = env.worker("svc");
    cfg.ledger_path = env.ledger("svc-again");
    let token = CancellationToken::new();
    let again = tokio::spawn(run_worker(
        env.bus.clone(),
        cfg,
        handler.clone(),
        token.clone(),
    ));
    wait_until(WAIT, "the unrecorded request handled", || async {
        env.fact_count().await == 2
    })
    .await
    .unwrap();
    wait_until(WAIT, "everything acked", || env.consumer_drained("svc"))
        .await
        .unwrap();
    token.cancel();
    again.await.unwrap().unwrap();
    assert_eq!(handler.calls_for("first"), 1);
    drop(disk);
}
