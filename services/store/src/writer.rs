//! The group-commit writer: a bounded queue into one thread, which takes the first write
//! waiting and every other one queued meanwhile (up to a bound), hands them to the store's
//! `apply` as one batch, and answers each waiter once that batch's commit returned.

use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};

use crate::CommitError;

/// A write waiting for the writer, and who to tell how it ended.
type Queued<W, T, E> = (W, oneshot::Sender<Result<T, CommitError<E>>>);

/// What runs on the writer thread after a failed batch's waiters were answered.
type FailureHook<E> = Box<dyn FnMut(&E) + Send>;

/// The queue into a store's writer thread. Clones share the thread; it ends once every clone
/// is dropped and the writes queued before were answered.
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

    /// The thread's handle, for a caller that wants to see a panic of `apply` itself.
    pub fn into_handle(self) -> std::thread::JoinHandle<()> {
        self.0
    }
}

/// The largest queue: far above any store's need, and within what the channel can count.
const MAX_QUEUE: usize = 1 << 24;

/// How a writer is started: its name, its bounds and what runs after a failed batch.
/// Made by [`writer`]; [`Builder::spawn`] starts the thread.
pub struct Builder<E> {
    name: &'static str,
    max_batch: usize,
    queue: Option<usize>,
    on_failure: Option<FailureHook<E>>,
}

/// Starts describing the writer `name` (its thread is named `<name>-writer`): batches of at
/// most 512 writes and a queue of twice the batch, unless set otherwise.
pub fn writer<E>(name: &'static str) -> Builder<E> {
    Builder {
        name,
        max_batch: 512,
        queue: None,
        on_failure: None,
    }
}

impl<E> Builder<E> {
    /// The most writes one batch (one commit) holds; at least 1.
    pub fn max_batch(mut self, writes: usize) -> Self {
        self.max_batch = writes.max(1);
        self
    }

    /// The most writes waiting for the thread; a submitter past it waits (asynchronously)
    /// for room, so a store that cannot keep up slows its callers rather than growing
    /// without bound. At least 1 and at most 2^24; twice [`Builder::max_batch`] unless set.
    pub fn queue(mut self, writes: usize) -> Self {
        self.queue = Some(writes);
        self
    }

    /// Runs `hook` on the writer thread with the cause of each failed batch, after every
    /// waiter of the batch was answered and before the next batch is taken: where a store
    /// repairs itself (reopens a file that redb latched as failed) without holding its
    /// callers' answers back.
    pub fn on_failure(mut self, hook: impl FnMut(&E) + Send + 'static) -> Self {
        self.on_failure = Some(Box::new(hook));
        self
    }

    /// Starts the writer thread. `apply` gets each batch (in the order queued) and must make
    /// it durable in one commit before it returns, giving one outcome per write in order;
    /// `Err` fails every write of the batch, each waiter getting the one cause in an [`Arc`].
    pub fn spawn<W, T, F>(
        self,
        mut apply: F,
    ) -> std::io::Result<(GroupWriter<W, T, E>, WriterThread)>
    where
        W: Send + 'static,
        T: Send + 'static,
        E: Send + Sync + 'static,
        F: FnMut(&[W]) -> Result<Vec<T>, E> + Send + 'static,
    {
        let Builder {
            name,
            max_batch,
            queue,
            mut on_failure,
        } = self;
        let queue = queue
            .unwrap_or(max_batch.saturating_mul(2))
            .clamp(1, MAX_QUEUE);
        let (tx, mut rx) = mpsc::channel::<Queued<W, T, E>>(queue);
        let thread = std::thread::Builder::new()
            .name(format!("{name}-writer"))
            .spawn(move || {
                let mut batch = Vec::new();
                while let Some(first) = rx.blocking_recv() {
                    batch.push(first);
                    while batch.len() < max_batch {
                        match rx.try_recv() {
                            Ok(queued) => batch.push(queued),
                            Err(_) => break,
                        }
                    }
                    let (writes, waiters): (Vec<W>, Vec<_>) = batch.drain(..).unzip();
                    // A waiter that gave up no longer listens; its write stands, so its
                    // answer is dropped.
                    match apply(&writes) {
                        Ok(outcomes) if outcomes.len() == waiters.len() => {
                            for (done, outcome) in waiters.into_iter().zip(outcomes) {
                                let _ = done.send(Ok(outcome));
                            }
                        }
                        // `apply` broke its contract: no waiter can be told its own outcome,
                        // and claiming success for any would be a guess.
                        Ok(_) => {
                            for done in waiters {
                                let _ = done.send(Err(CommitError::Stopped(name)));
                            }
                        }
                        Err(cause) => {
                            let cause = Arc::new(cause);
                            for done in waiters {
                                let _ = done.send(Err(CommitError::Failed(cause.clone())));
                            }
                            if let Some(hook) = on_failure.as_mut() {
                                hook(&cause);
                            }
                        }
                    }
                }
            })?;
        Ok((GroupWriter { name, tx }, WriterThread(thread)))
    }
}

impl<W, T, E> GroupWriter<W, T, E> {
    /// Queues `write` and returns a future that resolves once the batch holding it is
    /// durable, or failed. While the queue has room the write is queued at once, so writes
    /// submitted in order are applied in order; when it is full the future waits for room
    /// (first come, first queued) once it is polled.
    pub fn submit(
        &self,
        write: W,
    ) -> impl Future<Output = Result<T, CommitError<E>>> + Send + 'static
    where
        W: Send + 'static,
        T: Send + 'static,
        E: Send + Sync + 'static,
    {
        let name = self.name;
        let (done, outcome) = oneshot::channel();
        let waiting = match self.tx.try_send((write, done)) {
            Ok(()) => Ok(None),
            Err(mpsc::error::TrySendError::Full(queued)) => Ok(Some((self.tx.clone(), queued))),
            Err(mpsc::error::TrySendError::Closed(_)) => Err(CommitError::Stopped(name)),
        };
        async move {
            if let Some((tx, queued)) = waiting? {
                tx.send(queued)
                    .await
                    .map_err(|_| CommitError::Stopped(name))?;
            }
            outcome.await.map_err(|_| CommitError::Stopped(name))?
        }
    }
}
