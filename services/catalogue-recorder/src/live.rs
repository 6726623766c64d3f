//! Folding facts as they arrive: the worker runtime's handler.
//!
//! For each fact: its file list into the store first when it records a version ([`FileLists`]),
//! then the fold by the single writer, then what it touched mirrored into the KV buckets
//! (readiness; a stage request's status). Stage requests and releases come from the requests
//! stream, the promoter's progress reports from core NATS ([`follow_progress`]). What becomes of a fact that cannot be folded:
//!
//! - for a reason a retry can fix (its manifest is not in the bucket yet, a fetch timed out,
//!   the store failed, the mirror failed): a retryable error, so the runtime naks it with a
//!   delay and, when deliveries run out, dead-letters it. Never acked, never Termed without a
//!   dead letter.
//! - for a reason no retry can fix (its manifest does not match its digest, it contradicts
//!   itself): recorded as a catalogue problem, logged at ERROR, and a permanent error, so the
//!   runtime dead-letters it (replayable once the cause is fixed).
//! - refused by the runtime before it is handled (it travelled on another kind's or project's
//!   subject, or names a location outside its project: `stagehand_schemas::trust`): recorded
//!   as a catalogue problem naming the rule ([`LiveFold`]'s `refused`), then dead-lettered;
//!   nothing of it is fetched or folded.
//! - the store itself failed (ENOSPC, EIO, a failed commit — any redb error — or the manifest
//!   spool beside it): the recorder stops at once (its run returns the first failure, naming the
//!   store's file) instead of retrying the fact until it is dead-lettered; the fact is left for
//!   redelivery without counting an attempt, and the supervisor restarts the recorder with the
//!   store reopened.

use std::sync::{Arc, Mutex};

use std::collections::HashMap;
use std::time::{Duration, Instant};

use async_nats::jetstream::kv;
use futures::StreamExt;
use stagehand_bus::{Handler, HandlerError, WorkContext};
use stagehand_catalogue::{ReadinessKey, StageProgress, StageStatus, stage_kv_key};
use stagehand_schemas::progress::{
    WorkProgress, progress_filter, progress_place, progress_subject,
};
use stagehand_schemas::{Body, Event, EventId, Refusal};
use tokio_util::sync::CancellationToken;

use crate::error::{RecorderError, StoreError};
use crate::files::FileLists;
use crate::fold::{self, FoldError, touched};
use crate::readiness::{current, mirror, open_bucket};
use crate::store::{FoldItem, Folded, Store, Writer};
use stagehand_schemas::Retryable;

/// The handler of the recorder's two workers (facts, dead letters). It causes no facts.
pub(crate) struct LiveFold {
    pub store: Arc<Store>,
    pub writer: Writer,
    pub files: FileLists,
    pub mirror: Mirror,
    /// Cancelled when the store failed: stops the recorder.
    pub stop: CancellationToken,
    /// The store's first failure, once it failed: what the recorder exits with.
    pub store_failed: Arc<Mutex<Option<StoreError>>>,
}

impl LiveFold {
    fn store_error(&self, event: &Event, e: StoreError) -> HandlerError {
        if e.is_store_failure() {
            let failed = StoreError::Failed {
                path: self.store.path().to_owned(),
                detail: e.to_string(),
            };
            tracing::error!(event_id = %event.id, error = %failed, "stopping the recorder");
            let mut first = self
                .store_failed
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let reported = first.get_or_insert(failed).to_string();
            drop(first);
            self.stop.cancel();
            // Not the fact's fault: the runtime leaves it for redelivery without counting an
            // attempt (never dead-lettered and terminated) and stops the worker.
            return HandlerError::fatal(reported);
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
        if changes_dead_letters_waiting(event) {
            report_dead_letters_waiting(&self.store).await;
        }
        match self.mirror.event(&self.store, event).await {
            Ok(()) => Ok(Vec::new()),
            Err(RecorderError::Store(e)) => Err(self.store_error(event, e)),
            Err(e) => Err(HandlerError::retryable(e)),
        }
    }

    /// A fact the runtime refused (another kind's or project's subject, a location outside
    /// its project) is listed as a catalogue problem naming the rule before it is
    /// dead-lettered: nothing of it is fetched or folded.
    async fn refused(&self, event: &Event, stream_sequence: u64, refusal: &Refusal) {
        let error = FoldError::refused(refusal);
        let code = error
            .problem_code()
            .unwrap_or(stagehand_catalogue::FoldProblemCode::Other);
        tracing::error!(event_id = %event.id, kind = event.kind(), rule = refusal.rule(), detail = %refusal, "a fact was refused: listed as a catalogue problem and dead-lettered");
        let item = FoldItem {
            event: event.clone(),
            sequence: Some(stream_sequence),
            problem: Some(fold::problem(
                event,
                Some(stream_sequence),
                code,
                error.to_string(),
            )),
        };
        if let Err(e) = self.writer.apply(item).await {
            // The dead letter still records it; a latched store stops the recorder.
            let _ = self.store_error(event, e);
        }
    }
}

/// Whether folding `event` can change how many dead letters wait for a person.
fn changes_dead_letters_waiting(event: &Event) -> bool {
    matches!(
        event.body,
        Body::DeadLetter(_) | Body::DeadLetterReplayed(_) | Body::OperatorAction(_)
    )
}

/// Sets the dead-letter gauges from the store. A failure to read them is logged, not the
/// fact's: the fact is folded, and the next fold or start sets them again.
pub(crate) async fn report_dead_letters_waiting(store: &Arc<Store>) {
    let s = store.clone();
    match tokio::task::spawn_blocking(move || crate::gauges::report_dead_letters_waiting(&s)).await
    {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(error = %e, "could not read the dead letters waiting"),
        Err(e) => tracing::warn!(error = %e, "could not read the dead letters waiting"),
    }
}

/// The two KV buckets the recorder keeps for schedulers: readiness per (version, tier, node)
/// and the status of each stage request.
#[derive(Clone)]
pub(crate) struct Mirror {
    pub readiness: kv::Store,
    pub stages: kv::Store,
}

impl Mirror {
    /// Opens (or creates, correcting the drift of their replicas) both buckets.
    pub async fn open(bus: &stagehand_bus::Bus) -> Result<Mirror, RecorderError> {
        Ok(Mirror {
            readiness: open_bucket(bus).await?,
            stages: bus.provision_kv(&stagehand_bus::STAGES).await?,
        })
    }

    /// Mirrors what `event` touched.
    pub async fn event(&self, store: &Arc<Store>, event: &Event) -> Result<(), RecorderError> {
        if let Some(key) = touched(event) {
            self.readiness_of(store, key).await?;
        }
        // A release names its requests however either spelled the version: each is rewritten.
        let (s, e) = (store.clone(), event.clone());
        let stages = tokio::task::spawn_blocking(move || s.stages_touched(&e))
            .await
            .map_err(|e| RecorderError::nats("reading stage requests", e))??;
        for id in stages {
            self.stage(store, &event.project, &id).await?;
        }
        Ok(())
    }

    /// Mirrors one readiness key.
    pub async fn readiness_of(
        &self,
        store: &Arc<Store>,
        key: ReadinessKey,
    ) -> Result<(), RecorderError> {
        let s = store.clone();
        let readiness = tokio::task::spawn_blocking(move || current(&s, &key))
            .await
            .map_err(|e| RecorderError::nats("reading readiness", e))??;
        if let Some(readiness) = readiness {
            mirror(&self.readiness, &readiness).await?;
        }
        Ok(())
    }

    /// Mirrors one stage request's status, and the readiness it counts in.
    pub async fn stage(
        &self,
        store: &Arc<Store>,
        project: &str,
        id: &EventId,
    ) -> Result<(), RecorderError> {
        let s = store.clone();
        let (p, i) = (project.to_owned(), id.to_string());
        let found = tokio::task::spawn_blocking(move || s.stage_status(&p, &i))
            .await
            .map_err(|e| RecorderError::nats("reading a stage request", e))??;
        let Some((status, key)) = found else {
            return Ok(());
        };
        mirror_stage(&self.stages, &status).await?;
        if let Some(key) = key {
            self.readiness_of(store, key).await?;
        }
        Ok(())
    }
}

/// Writes one stage request's status into its bucket.
pub(crate) async fn mirror_stage(
    bucket: &kv::Store,
    status: &StageStatus,
) -> Result<(), RecorderError> {
    let value = serde_json::to_vec(status)
        .map_err(|e| RecorderError::nats("encoding a stage status", e))?;
    bucket
        .put(
            stage_kv_key(&status.project, &status.request_id),
            value.into(),
        )
        .await
        .map_err(|e| RecorderError::nats("writing a stage status", e))?;
    Ok(())
}

/// Least time between two progress reports of one request that are kept and mirrored.
pub const PROGRESS_EVERY: Duration = Duration::from_secs(1);

/// Follows the promoter's progress reports of stage requests
/// (`stagehand.progress.stage.requested.[<node>.]<project>.<hex(id)>`) until `shutdown`: a
/// pending request with progress is `copying`. Reports come about once a second per copy and
/// are throttled to [`PROGRESS_EVERY`] per request; one whose subject does not name the request
/// its body names (another project's, say), or names another node than the request's (a node's
/// user may report on its own node's subjects only), is ignored.
pub(crate) async fn follow_progress(
    client: async_nats::Client,
    store: Arc<Store>,
    mirror: Mirror,
    shutdown: CancellationToken,
) -> Result<(), RecorderError> {
    let filter = progress_filter("stage.requested");
    let mut subscription = client
        .subscribe(filter)
        .await
        .map_err(|e| RecorderError::nats("subscribing to stage progress", e))?;
    let mut last: HashMap<(Option<String>, String, EventId), Instant> = HashMap::new();
    loop {
        let message = tokio::select! {
            _ = shutdown.cancelled() => break,
            message = subscription.next() => match message {
                Some(m) => m,
                None => break,
            },
        };
        let Ok(report) = WorkProgress::decode(&message.payload) else {
            tracing::debug!(subject = %message.subject, "ignoring a progress message that does not decode");
            continue;
        };
        let Some((node, project)) = progress_place("stage.requested", &message.subject) else {
            tracing::debug!(subject = %message.subject, "ignoring a progress message on no request's subject");
            continue;
        };
        if progress_subject(
            "stage.requested",
            node.as_deref(),
            &project,
            &report.request_id,
        ) != message.subject.as_str()
        {
            tracing::debug!(subject = %message.subject, "ignoring a progress message for another request than its subject's");
            continue;
        }
        let now = Instant::now();
        // By place too: reports on another node's subject (which the request's place refuses
        // below) do not hold back the real ones.
        let key = (node, project, report.request_id.clone());
        if last
            .get(&key)
            .is_some_and(|t| now.duration_since(*t) < PROGRESS_EVERY)
        {
            continue;
        }
        if last.len() > 10_000 {
            last.retain(|_, t| now.duration_since(*t) < PROGRESS_EVERY * 10);
        }
        last.insert(key.clone(), now);
        let progress = StageProgress {
            files_done: report.files_done,
            files_total: report.files_total,
            bytes_done: report.bytes_done,
            bytes_total: report.bytes_total,
            eta_seconds: report.eta_seconds,
        };
        let s = store.clone();
        let (node, p, id) = (key.0.clone(), key.1.clone(), key.2.to_string());
        let shown = tokio::task::spawn_blocking(move || {
            s.record_progress(&p, &id, node.as_deref(), &progress)
        })
        .await;
        match shown {
            Ok(Ok(Some(status))) => {
                if let Err(e) = mirror_stage(&mirror.stages, &status).await {
                    tracing::warn!(error = %e, request_id = %key.2, "could not mirror stage progress");
                }
            }
            Ok(Ok(None)) => {}
            Ok(Err(e)) => {
                tracing::warn!(error = %e, request_id = %key.2, "could not keep stage progress")
            }
            Err(e) => tracing::warn!(error = %e, "progress task failed"),
        }
    }
    let _ = subscription.unsubscribe().await;
    Ok(())
}

/// Mirrors what a rebuild touched.
pub(crate) async fn mirror_all(
    store: &Arc<Store>,
    mirror: &Mirror,
    keys: Vec<ReadinessKey>,
    stages: Vec<(String, EventId)>,
) -> Result<(), RecorderError> {
    for key in keys {
        mirror.readiness_of(store, key).await?;
    }
    for (project, id) in stages {
        mirror.stage(store, &project, &id).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    /// The client crate names the buckets for readers that do not link the runtime; the
    /// runtime declares and provisions them. They must be the same buckets.
    #[test]
    fn the_client_names_the_buckets_the_runtime_provisions() {
        assert_eq!(
            stagehand_catalogue::READINESS_BUCKET,
            stagehand_bus::READINESS_BUCKET
        );
        assert_eq!(
            stagehand_catalogue::STAGES_BUCKET,
            stagehand_bus::STAGES_BUCKET
        );
    }
}
