//! Rebuilding the catalogue from the streams it is folded from.
//!
//! The facts stream is the log and the redb file is a view of it. When the store is missing, of
//! another layout, or a previous rebuild did not finish, the recorder replays the stream from
//! sequence 1 with an ordered consumer into the store up to the stream's last sequence at the
//! start of the replay; the durable consumer then continues live. Facts that arrive during the
//! replay reach the store through both paths, and the fold's idempotence makes that harmless.
//!
//! Batches are cut by bytes ([`MAX_REPLAY_BATCH_BYTES`] of messages), one commit each. Before a
//! batch is folded, each version's file list is fetched once and written in chunks
//! ([`FileLists`]). A fact that cannot be folded — it travelled on another kind's or project's
//! subject or names a location outside its project (checked first, as live consumption does:
//! nothing of it is fetched), its manifest object is gone or damaged, a record it needs is
//! corrupt, it contradicts itself — does not stop the rebuild: it is logged
//! at ERROR with its event id, counted, recorded as a problem on-call can list (`stagehand
//! catalogue problems`), and skipped. Only a failure of the store or of NATS itself stops it
//! (the store then stays incomplete and the next start rebuilds again).

use std::sync::Arc;

use async_nats::jetstream::{self, consumer::DeliverPolicy, consumer::pull::OrderedConfig};
use futures::StreamExt;
use stagehand_catalogue::ReadinessKey;
use stagehand_schemas::{EventId, wire};

use crate::error::RecorderError;
use crate::files::FileLists;
use crate::fold::{self, stage_request_of, touched};
use crate::store::{FoldItem, Folded, Store};

/// Bytes of messages folded in one commit during a rebuild.
pub const MAX_REPLAY_BATCH_BYTES: usize = 8 * 1024 * 1024;

/// Fetch attempts for a manifest that NATS did not deliver (timeouts) during a rebuild.
const REBUILD_FETCH_ATTEMPTS: u32 = 3;

/// What a replay did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Replayed {
    /// The stream's last sequence when the replay started (what it replayed through).
    pub through: u64,
    /// Messages replayed that decoded (folded, or skipped as problems).
    pub events: u64,
    /// Of those, facts that could not be folded: recorded as problems and skipped.
    pub skipped: u64,
    /// Messages that did not decode (the worker dead-letters them live; a replay skips them).
    pub undecodable: u64,
    /// Commits made.
    pub batches: u64,
    /// Readiness keys the replay touched.
    pub touched: Vec<ReadinessKey>,
    /// Stage requests (project, request id) the replay touched.
    pub stages: Vec<(String, EventId)>,
}

/// Replays `stream` (all subjects matching `filter`, a comma-separated list) into `store`.
pub async fn replay(
    js: &jetstream::Context,
    stream: &str,
    filter: &str,
    store: &Arc<Store>,
    files: &FileLists,
) -> Result<Replayed, RecorderError> {
    let mut s = js
        .get_stream(stream)
        .await
        .map_err(|e| RecorderError::nats("opening the stream to replay", e))?;
    let info = s
        .info()
        .await
        .map_err(|e| RecorderError::nats("reading the stream to replay", e))?;
    let last = info.state.last_sequence;
    let mut out = Replayed {
        through: last,
        ..Default::default()
    };
    if info.state.messages == 0 {
        return Ok(out);
    }
    let consumer = s
        .create_consumer(OrderedConfig {
            filter_subjects: filter.split(',').map(str::to_owned).collect(),
            deliver_policy: DeliverPolicy::ByStartSequence { start_sequence: 1 },
            ..Default::default()
        })
        .await
        .map_err(|e| RecorderError::nats("creating the replay consumer", e))?;
    // Nothing matches the filter (a requests stream with no stage request yet): no message
    // would ever come.
    if consumer.cached_info().num_pending == 0 {
        return Ok(out);
    }
    let mut messages = consumer
        .messages()
        .await
        .map_err(|e| RecorderError::nats("starting the replay", e))?;
    let mut batch: Vec<FoldItem> = Vec::new();
    let mut batch_bytes = 0usize;
    let mut done = false;
    while !done {
        let message = match messages.next().await {
            Some(Ok(m)) => m,
            Some(Err(e)) => return Err(RecorderError::nats("replaying the stream", e)),
            None => break,
        };
        let info = message
            .info()
            .map_err(|e| RecorderError::nats("reading a replayed message", e))?;
        let (sequence, pending) = (info.stream_sequence, info.pending);
        match wire::decode(&message.payload) {
            Ok(event) => {
                // Held to its subject, as live consumption holds it, before its manifest is
                // fetched: a refused fact is listed as a problem naming the rule.
                let checked = stagehand_schemas::trust::check_published(&event, &message.subject)
                    .map_err(|r| fold::FoldError::refused(&r));
                let ensured = match checked {
                    Ok(()) => files.ensure_retrying(&event, REBUILD_FETCH_ATTEMPTS).await,
                    Err(refused) => Err(refused),
                };
                let problem = match ensured {
                    Ok(()) => None,
                    Err(e) => match e.problem_code() {
                        Some(code) => {
                            Some(fold::problem(&event, Some(sequence), code, e.to_string()))
                        }
                        None => return Err(e_to_recorder(e)),
                    },
                };
                batch_bytes += message.payload.len();
                batch.push(FoldItem {
                    event,
                    sequence: Some(sequence),
                    problem,
                });
            }
            Err(e) => {
                out.undecodable += 1;
                tracing::warn!(%sequence, error = %e, "skipping an undecodable message in replay");
            }
        }
        // The last message of a filtered replay may sit below `last`: stop when nothing is
        // pending either.
        done = sequence >= last || pending == 0;
        if batch_bytes >= MAX_REPLAY_BATCH_BYTES || (done && !batch.is_empty()) {
            fold_batch(store, std::mem::take(&mut batch), &mut out).await?;
            batch_bytes = 0;
        }
    }
    if !batch.is_empty() {
        fold_batch(store, batch, &mut out).await?;
    }
    out.touched.sort();
    out.touched.dedup();
    out.stages.sort();
    out.stages.dedup();
    Ok(out)
}

fn e_to_recorder(e: fold::FoldError) -> RecorderError {
    match e {
        fold::FoldError::Store(e) => RecorderError::Store(e),
        other => RecorderError::nats("folding a replayed fact", other),
    }
}

async fn fold_batch(
    store: &Arc<Store>,
    items: Vec<FoldItem>,
    out: &mut Replayed,
) -> Result<(), RecorderError> {
    let s = store.clone();
    let (items, results) = tokio::task::spawn_blocking(move || {
        let results = s.apply_batch(&items);
        (items, results)
    })
    .await
    .map_err(|e| RecorderError::nats("folding a replay batch", e))?;
    let results = results?;
    out.batches += 1;
    for (item, result) in items.iter().zip(results) {
        out.events += 1;
        match result {
            Folded::Done => {
                out.touched.extend(touched(&item.event));
                if let Some(id) = stage_request_of(&item.event) {
                    out.stages.push((item.event.project.clone(), id));
                }
            }
            Folded::Skipped { problem, .. } => {
                out.skipped += 1;
                tracing::error!(
                    event_id = %item.event.id,
                    kind = item.event.kind(),
                    sequence = ?item.sequence,
                    code = ?problem.code,
                    detail = %problem.detail,
                    "a fact could not be folded during the rebuild: skipped and listed as a catalogue problem"
                );
            }
        }
    }
    Ok(())
}
