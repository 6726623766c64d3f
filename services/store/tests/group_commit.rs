//! The group-commit writer against a real redb file: writes queued while a commit runs share
//! the next one (bounded), a full queue makes submitters wait rather than grow, an
//! acknowledged write survives the store being closed and reopened, a failed commit is
//! reported to every waiter of its batch before the store's failure hook runs, and a writer
//! that died never reports success.

use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use redb::{Database, ReadableDatabase, TableDefinition};
use stagehand_store::{CommitError, writer};

const VALUES: TableDefinition<u32, u32> = TableDefinition::new("values");

/// Every batch `apply` was given, in order.
type Batches = Arc<Mutex<Vec<Vec<u32>>>>;

/// A gate the first batch waits at, so a test can queue more writes while it is "committing";
/// and what `apply` was given.
struct Gate {
    batches: Batches,
    started: mpsc::Receiver<()>,
    go: mpsc::Sender<()>,
}

/// An `apply` that records each batch, holding the first one at a gate.
fn recording(
    fail_on: Option<u32>,
) -> (
    impl FnMut(&[u32]) -> Result<Vec<u32>, String> + Send + 'static,
    Gate,
) {
    let batches = Arc::new(Mutex::new(Vec::new()));
    let seen = batches.clone();
    let (started_tx, started) = mpsc::channel();
    let (go, go_rx) = mpsc::channel::<()>();
    let mut first = true;
    let apply = move |batch: &[u32]| {
        if first {
            first = false;
            started_tx.send(()).unwrap();
            go_rx.recv().unwrap();
        }
        seen.lock().unwrap().push(batch.to_vec());
        if fail_on.is_some_and(|n| batch.contains(&n)) {
            return Err(format!("disk full at {n}", n = fail_on.unwrap()));
        }
        Ok(batch.iter().map(|n| n * 10).collect())
    };
    (
        apply,
        Gate {
            batches,
            started,
            go,
        },
    )
}

#[tokio::test]
async fn writes_queued_during_a_commit_share_the_next_one_up_to_the_bound() {
    let (apply, gate) = recording(None);
    let (writer, thread) = writer("test").max_batch(3).spawn(apply).unwrap();
    let first = writer.submit(1);
    gate.started.recv().unwrap();
    let rest: Vec<_> = (2..=6).map(|n| writer.submit(n)).collect();
    gate.go.send(()).unwrap();
    assert_eq!(first.await.unwrap(), 10);
    for (n, w) in (2..=6).zip(rest) {
        assert_eq!(w.await.unwrap(), n * 10, "each waiter gets its own outcome");
    }
    drop(writer);
    thread.join();
    assert_eq!(
        *gate.batches.lock().unwrap(),
        vec![vec![1], vec![2, 3, 4], vec![5, 6]],
        "the five queued meanwhile went in two commits of at most three, in order"
    );
}

#[tokio::test]
async fn a_failed_commit_fails_every_waiter_of_its_batch_and_the_writer_goes_on() {
    let (apply, gate) = recording(Some(3));
    let (hook_tx, hook_rx) = mpsc::channel();
    let (writer, thread) = writer("test")
        .max_batch(16)
        .on_failure(move |cause: &String| hook_tx.send(cause.clone()).unwrap())
        .spawn(apply)
        .unwrap();
    let first = writer.submit(1);
    gate.started.recv().unwrap();
    let batch: Vec<_> = (2..=4).map(|n| writer.submit(n)).collect();
    gate.go.send(()).unwrap();
    assert_eq!(first.await.unwrap(), 10);
    for w in batch {
        assert_eq!(
            w.await,
            Err(CommitError::Failed(Arc::new("disk full at 3".to_string()))),
            "every write of the failed batch is told, not only the one that failed it"
        );
    }
    assert_eq!(
        hook_rx.recv().unwrap(),
        "disk full at 3",
        "the failure hook is given the batch's cause"
    );
    assert_eq!(
        writer.submit(5).await.unwrap(),
        50,
        "the next batch commits"
    );
    drop(writer);
    thread.join();
    assert_eq!(gate.batches.lock().unwrap().len(), 3);
}

#[tokio::test]
async fn an_apply_that_breaks_its_contract_answers_stopped_never_success() {
    let (writer, thread) = writer("test")
        .max_batch(16)
        .spawn(|batch: &[u32]| -> Result<Vec<u32>, String> {
            Ok(vec![0; batch.len() + 1]) // one outcome too many: a broken contract
        })
        .unwrap();
    assert_eq!(writer.submit(1).await, Err(CommitError::Stopped("test")));
    drop(writer);
    thread.join();
}

#[tokio::test]
async fn a_panic_in_apply_answers_its_batch_and_every_later_write_stopped() {
    let (writer, thread) = writer("test")
        .max_batch(16)
        .spawn(|batch: &[u32]| -> Result<Vec<u32>, String> {
            if batch.contains(&13) {
                panic!("a bug in apply");
            }
            Ok(batch.to_vec())
        })
        .unwrap();
    assert_eq!(writer.submit(1).await, Ok(1));
    assert_eq!(writer.submit(13).await, Err(CommitError::Stopped("test")));
    assert_eq!(
        writer.submit(2).await,
        Err(CommitError::Stopped("test")),
        "the thread is gone: a later write is refused, not lost silently"
    );
    assert!(
        thread.into_handle().join().is_err(),
        "the panic is the thread's"
    );
}

#[tokio::test]
async fn a_full_queue_makes_the_submitter_wait_for_room_and_keeps_its_order() {
    let (apply, gate) = recording(None);
    let (writer, thread) = writer("test").max_batch(8).queue(2).spawn(apply).unwrap();
    let first = writer.submit(1);
    gate.started.recv().unwrap();
    // The thread holds write 1 at the gate; 2 and 3 fill the queue, 4 and 5 must wait.
    let queued: Vec<_> = (2..=3).map(|n| writer.submit(n)).collect();
    let mut waiting: Vec<_> = (4..=5).map(|n| Box::pin(writer.submit(n))).collect();
    for w in &mut waiting {
        // Polled once: it cannot be queued, so it now waits for room, first come first queued.
        assert!(futures_poll_once(w.as_mut()).await.is_none());
    }
    gate.go.send(()).unwrap();
    assert_eq!(first.await.unwrap(), 10);
    for (n, w) in (2..=3).zip(queued) {
        assert_eq!(w.await.unwrap(), n * 10);
    }
    for (n, w) in (4..=5).zip(waiting) {
        assert_eq!(
            w.await.unwrap(),
            n * 10,
            "a waiting write is applied once room came"
        );
    }
    drop(writer);
    thread.join();
    assert_eq!(
        *gate.batches.lock().unwrap(),
        vec![vec![1], vec![2, 3], vec![4], vec![5]],
        "the batch after the gate held only the two the queue had room for (an unbounded queue \
         would have put all four in it); the two that waited came after, in order"
    );
}

/// Polls `f` once: its output if it was ready.
async fn futures_poll_once<F: Future + Unpin>(mut f: F) -> Option<F::Output> {
    std::future::poll_fn(|cx| {
        std::task::Poll::Ready(match std::pin::Pin::new(&mut f).poll(cx) {
            std::task::Poll::Ready(out) => Some(out),
            std::task::Poll::Pending => None,
        })
    })
    .await
}

#[tokio::test]
async fn an_acknowledged_write_is_durable_in_the_redb_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store.redb");
    let db = Database::create(&path).unwrap();
    let (writer, thread) = writer("test")
        .max_batch(64)
        .spawn(move |batch: &[(u32, u32)]| -> Result<Vec<()>, String> {
            let txn = db.begin_write().map_err(|e| e.to_string())?;
            {
                let mut table = txn.open_table(VALUES).map_err(|e| e.to_string())?;
                for (k, v) in batch {
                    table.insert(k, v).map_err(|e| e.to_string())?;
                }
            }
            txn.commit().map_err(|e| e.to_string())?;
            Ok(vec![(); batch.len()])
        })
        .unwrap();
    let writes: Vec<_> = (0..100u32).map(|k| writer.submit((k, k * k))).collect();
    for w in writes {
        w.await.unwrap();
    }
    // Closing the writer drops the only handle of the database, so it can be opened again.
    drop(writer);
    thread.join();
    let db = Database::open(&path).unwrap();
    let read = db.begin_read().unwrap();
    let table = read.open_table(VALUES).unwrap();
    for k in 0..100u32 {
        assert_eq!(table.get(k).unwrap().map(|v| v.value()), Some(k * k));
    }
}
