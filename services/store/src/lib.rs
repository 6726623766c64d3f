//! One group-commit writer for Stagehand's redb stores.
//!
//! A redb commit is durable when it returns, and each commit pays its own flush. A store whose
//! writes arrive from many tasks at once therefore hands them to one writer thread, which takes
//! the first write waiting and every other one queued meanwhile (up to a bound) and applies
//! them in one transaction: one flush for the batch, where each write alone would pay its own.
//! Each waiter is answered only after that commit returned, with its own outcome; a failed
//! commit fails every write it held (the batch is all or nothing).
//!
//! The store supplies what a batch means (`apply`: open one write transaction, apply every
//! write, commit); this crate supplies the queue, the batching and the answers.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let (writer, thread) = stagehand_store::spawn("example", 64, |batch: &[u32]| {
//!     // one transaction for the whole batch, committed here
//!     Ok::<_, String>(batch.iter().map(|n| n * 2).collect())
//! })
//! .unwrap();
//! assert_eq!(writer.submit(21).await.unwrap(), 42);
//! drop(writer);
//! thread.join();
//! # }
//! ```

use std::sync::mpsc;

use tokio::sync::oneshot;

/// How a queued write did not become durable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CommitError<E> {
    /// The batch holding the write failed to commit (or to apply): nothing of it was written.
    #[error(transparent)]
    Failed(E),
    /// The writer thread is gone (it panicked, or the store is closing); the write may or may
    /// not have been committed.
    #[error("the {0} writer thread has stopped")]
    Stopped(&'static str),
}

/// A write waiting for the writer, and who to tell how it ended.
type Queued<W, T, E> = (W, oneshot::Sender<Result<T, CommitError<E>>>);

/// The queue into a store's writer thread. Clones share the thread; it ends once every clone
/// is dropped and the writes queued before were committed.
pub struct GroupWriter<W, T, E> {
    name: &'static str,
    tx: mpsc::Sender<Queued<W, T, E>>,
}

impl<W, T, E> Clone for GroupWriter<W, T, E> {
    fn clone(&self) -> Self {
        GroupWriter {
            name: self.name,
            tx: self.tx.clone(),
        }
    }
}

impl<W, T, E> std::fmt::Debug for GroupWriter<W, T, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupWriter")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// The writer thread, to wait for once every [`GroupWriter`] is dropped.
#[derive(Debug)]
pub struct WriterThread(std::thread::JoinHandle<()>);

impl WriterThread {
    /// Waits for the writer thread to end (every write queued before is answered by then).
    pub fn join(self) {
        // A panic in `apply` already answered its waiters with `Stopped`.
        let _ = self.0.join();
    }
}

/// Starts the writer thread `name` (named `<name>-writer`). `apply` gets each batch (at most
/// `max_batch` writes, in the order queued) and must make it durable in one commit before it
/// returns, giving one outcome per write in order; `Err` fails every write of the batch.
pub fn spawn<W, T, E, F>(
    name: &'static str,
    max_batch: usize,
    mut apply: F,
) -> std::io::Result<(GroupWriter<W, T, E>, WriterThread)>
where
    W: Send + 'static,
    T: Send + 'static,
    E: Clone + Send + 'static,
    F: FnMut(&[W]) -> Result<Vec<T>, E> + Send + 'static,
{
    let max_batch = max_batch.max(1);
    let (tx, queue) = mpsc::channel::<Queued<W, T, E>>();
    let thread = std::thread::Builder::new()
        .name(format!("{name}-writer"))
        .spawn(move || {
            while let Ok(first) = queue.recv() {
                let mut batch = vec![first];
                batch.extend(queue.try_iter().take(max_batch - 1));
                let (writes, waiters): (Vec<W>, Vec<_>) = batch.into_iter().unzip();
                match apply(&writes) {
                    Ok(outcomes) if outcomes.len() == waiters.len() => {
                        for (done, outcome) in waiters.into_iter().zip(outcomes) {
                            // A waiter that gave up no longer listens; its write stands.
                            let _ = done.send(Ok(outcome));
                        }
                    }
                    // `apply` broke its contract: no waiter can be told its own outcome, and
                    // claiming success for any would be a guess.
                    Ok(_) => {
                        for done in waiters {
                            let _ = done.send(Err(CommitError::Stopped(name)));
                        }
                    }
                    Err(e) => {
                        for done in waiters {
                            let _ = done.send(Err(CommitError::Failed(e.clone())));
                        }
                    }
                }
            }
        })?;
    Ok((GroupWriter { name, tx }, WriterThread(thread)))
}

impl<W, T, E> GroupWriter<W, T, E> {
    /// Queues `write` at once (so writes submitted in order are applied in order) and returns
    /// a future that resolves once the batch holding it is durable, or failed.
    pub fn submit(
        &self,
        write: W,
    ) -> impl Future<Output = Result<T, CommitError<E>>> + Send + 'static
    where
        T: Send + 'static,
        E: Send + 'static,
    {
        let name = self.name;
        let (done, outcome) = oneshot::channel();
        let queued = self.tx.send((write, done)).is_ok();
        async move {
            if !queued {
                return Err(CommitError::Stopped(name));
            }
            outcome.await.map_err(|_| CommitError::Stopped(name))?
        }
    }
}
