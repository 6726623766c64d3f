//! Rebuilding the catalogue from the streams it is folded from.
//!
//! The facts stream is the log and the redb file is a view of it. When the store is missing, or
//! a previous rebuild did not finish, the recorder replays the stream from sequence 1 with an
//! ordered consumer into the store, in batches of one commit each, up to the stream's last
//! sequence at the start of the replay; the durable consumer then continues live. Facts that
//! arrive during the replay reach the store through both paths, and the fold's idempotence makes
//! that harmless.

use async_nats::jetstream::{self, consumer::DeliverPolicy, consumer::pull::OrderedConfig};
use futures::StreamExt;
use stagehand_schemas::wire;

use crate::error::RecorderError;
use crate::fold::TierKey;
use crate::store::{MAX_BATCH, Store};

/// What a replay did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Replayed {
    /// The stream's last sequence when the replay started (what it replayed through).
    pub through: u64,
    /// Messages folded.
    pub events: u64,
    /// Messages that did not decode (the worker dead-letters them live; a replay skips them).
    pub undecodable: u64,
    /// Tiers whose readiness the replay touched.
    pub touched: Vec<TierKey>,
}

/// Replays `stream` (all subjects matching `filter`) into `store`.
pub async fn replay(
    js: &jetstream::Context,
    stream: &str,
    filter: &str,
    store: &std::sync::Arc<Store>,
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
            filter_subject: filter.into(),
            deliver_policy: DeliverPolicy::ByStartSequence { start_sequence: 1 },
            ..Default::default()
        })
        .await
        .map_err(|e| RecorderError::nats("creating the replay consumer", e))?;
    let mut messages = consumer
        .messages()
        .await
        .map_err(|e| RecorderError::nats("starting the replay", e))?;
    let mut batch = Vec::with_capacity(MAX_BATCH);
    let mut done = false;
    while !done {
        let message = match messages.next().await {
            Some(Ok(m)) => m,
            Some(Err(e)) => return Err(RecorderError::nats("replaying the stream", e)),
            None => break,
        };
        let sequence = message
            .info()
            .map_err(|e| RecorderError::nats("reading a replayed message", e))?
            .stream_sequence;
        match wire::decode(&message.payload) {
            Ok(event) => batch.push(event),
            Err(e) => {
                out.undecodable += 1;
                tracing::warn!(%sequence, error = %e, "skipping an undecodable message in replay");
            }
        }
        // The last message of a filtered replay may sit below `last`: stop when nothing is
        // pending either.
        let pending = message.info().map(|i| i.pending).unwrap_or(0);
        done = sequence >= last || pending == 0;
        if batch.len() >= MAX_BATCH || (done && !batch.is_empty()) {
            let events = std::mem::take(&mut batch);
            out.events += events.len() as u64;
            let store = store.clone();
            let touched = tokio::task::spawn_blocking(move || store.apply_batch(&events)).await??;
            out.touched.extend(touched);
        }
    }
    out.touched.sort();
    out.touched.dedup();
    Ok(out)
}
