//! Folding facts as they arrive: the worker runtime's handler.
//!
//! For each fact: its file list into the store first when it records a version ([`FileLists`]),
//! then the fold by the single writer, then the readiness it touched mirrored into the KV
//! bucket. What becomes of a fact that cannot be folded:
//!
//! - for a reason a retry can fix (its manifest is not in the bucket yet, a fetch timed out,
//!   the store failed, the mirror failed): a retryable error, so the runtime naks it with a
//!   delay and, when deliveries run out, dead-letters it. Never acked, never Termed without a
//!   dead letter.
//! - for a reason no retry can fix (its manifest does not match its digest, it contradicts
//!   itself): recorded as a catalogue problem, logged at ERROR, and a permanent error, so the
//!   runtime dead-letters it (replayable once the cause is fixed).
//! - redb latched an I/O failure: the recorder stops (its run returns the error) instead of
//!   consuming on with a dead store; the supervisor restarts it and redb reopens.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use async_nats::jetstream::kv;
use stagehand_bus::{Handler, HandlerError, WorkContext};
use stagehand_schemas::Event;
use tokio_util::sync::CancellationToken;

use crate::error::{RecorderError, StoreError};
use crate::files::FileLists;
use crate::fold::{self, FoldError, touched};
use crate::readiness::{current, mirror};
use crate::store::{FoldItem, Folded, Store, Writer};

/// The handler of the recorder's two workers (facts, dead letters). It causes no facts.
pub(crate) struct LiveFold {
    pub store: Arc<Store>,
    pub writer: Writer,
    pub files: FileLists,
    pub bucket: kv::Store,
    /// Cancelled when the store failed for good: stops the recorder.
    pub stop: CancellationToken,
    /// Set when the store failed for good.
    pub store_failed: Arc<AtomicBool>,
}

impl LiveFold {
    fn store_error(&self, event: &Event, e: StoreError) -> HandlerError {
        if e.is_latched() {
            tracing::error!(event_id = %event.id, error = %e, "the catalogue store failed (I/O); stopping the recorder so that it is restarted with the store reopened");
            self.store_failed.store(true, Ordering::SeqCst);
            self.stop.cancel();
        }
        HandlerError::retryable(e)
    }
}

impl Handler for LiveFold {
    async fn handle(&self, event: &Event, ctx: &WorkContext) -> Result<Vec<Event>, HandlerError> {
        let sequence = Some(ctx.stream_sequence());
        let problem = match self.files.ensure(event).await {
            Ok(()) => None,
            Err(FoldError::Store(e)) => return Err(self.store_error(event, e)),
            Err(e) if e.is_retryable() => {
                tracing::warn!(event_id = %event.id, delivery = ctx.delivery(), error = %e, "the fact's file list is not to be had yet; it will be retried");
                return Err(HandlerError::retryable(e));
            }
            Err(e) => {
                let code = e
                    .problem_code()
                    .unwrap_or(stagehand_catalogue::FoldProblemCode::Other);
                Some(fold::problem(event, sequence, code, e.to_string()))
            }
        };
        let given = problem.is_some();
        let item = FoldItem {
            event: event.clone(),
            sequence,
            problem,
        };
        match self.writer.apply(item).await {
            Ok(Folded::Done) => {}
            Ok(Folded::Skipped { problem, retryable }) => {
                if retryable && !given {
                    tracing::warn!(event_id = %event.id, detail = %problem.detail, "the fact could not be folded yet; it will be retried");
                    return Err(HandlerError::retryable(problem.detail));
                }
                tracing::error!(event_id = %event.id, kind = event.kind(), code = ?problem.code, detail = %problem.detail, "a fact cannot be folded: listed as a catalogue problem and dead-lettered");
                return Err(HandlerError::permanent(problem.detail));
            }
            Err(e) => return Err(self.store_error(event, e)),
        }
        if let Some(key) = touched(event) {
            let store = self.store.clone();
            let readiness = tokio::task::spawn_blocking(move || current(&store, &key))
                .await
                .map_err(HandlerError::retryable)?
                .map_err(|e| self.store_error(event, e))?;
            if let Some(readiness) = readiness {
                mirror(&self.bucket, &readiness)
                    .await
                    .map_err(HandlerError::retryable)?;
            }
        }
        Ok(Vec::new())
    }
}

/// Mirrors the readiness of `keys` (after a rebuild).
pub(crate) async fn mirror_all(
    store: &Arc<Store>,
    bucket: &kv::Store,
    keys: Vec<stagehand_catalogue::ReadinessKey>,
) -> Result<(), RecorderError> {
    for key in keys {
        let s = store.clone();
        let readiness = tokio::task::spawn_blocking(move || current(&s, &key))
            .await
            .map_err(|e| RecorderError::nats("reading readiness", e))??;
        if let Some(readiness) = readiness {
            mirror(bucket, &readiness).await?;
        }
    }
    Ok(())
}
