//! What a stream stored, for assertions: each stored message once, in stream order, however
//! often its publisher sent it (services republish an answer they are not sure was stored,
//! and a plain subscriber sees every copy). The one stream reader of the tests: raw messages
//! with their subjects and headers ([`stored_messages`]), decoded events ([`stored_events`]),
//! and the facts of a kind or of a cause.

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, consumer::pull};
use futures::StreamExt;
use stagehand_schemas::{Event, EventId, subject};

/// A failure to read a stream (a missing stream, a message that is not an event).
pub type StoredEventsError = Box<dyn std::error::Error + Send + Sync>;

/// One message a stream stored.
#[derive(Debug, Clone)]
pub struct StoredMessage {
    /// Its stream sequence.
    pub sequence: u64,
    pub subject: String,
    pub headers: HeaderMap,
    pub payload: Vec<u8>,
}

impl StoredMessage {
    /// The message as an event.
    pub fn event(&self) -> Result<Event, StoredEventsError> {
        Ok(stagehand_schemas::wire::decode(&self.payload)?)
    }
}

/// Every message stored in `stream` on a subject matching `filter` (`""` for all), in stream
/// order: what the stream held when asked.
pub async fn stored_messages(
    js: &jetstream::Context,
    stream: &str,
    filter: impl Into<String>,
) -> Result<Vec<StoredMessage>, StoredEventsError> {
    let filter = filter.into();
    let mut consumer = js
        .get_stream(stream)
        .await?
        .create_consumer(pull::Config {
            filter_subject: filter.clone(),
            ack_policy: jetstream::consumer::AckPolicy::None,
            deliver_policy: jetstream::consumer::DeliverPolicy::All,
            inactive_threshold: Duration::from_secs(30),
            ..Default::default()
        })
        .await?;
    let pending = consumer.info().await?.num_pending as usize;
    let mut out = Vec::with_capacity(pending);
    if pending == 0 {
        return Ok(out);
    }
    let mut messages = consumer
        .fetch()
        .max_messages(pending)
        .expires(Duration::from_secs(5))
        .messages()
        .await?;
    while out.len() < pending {
        let Some(m) = messages.next().await else {
            return Err(format!(
                "{stream} gave {} of its {pending} messages on {filter}",
                out.len()
            )
            .into());
        };
        let m = m?;
        let sequence = m.info()?.stream_sequence;
        out.push(StoredMessage {
            sequence,
            subject: m.subject.to_string(),
            headers: m.headers.clone().unwrap_or_default(),
            payload: m.payload.to_vec(),
        });
    }
    Ok(out)
}

/// Every event stored in `stream` on a subject matching `filter`, in stream order: what the
/// stream held when asked.
pub async fn stored_events(
    js: &jetstream::Context,
    stream: &str,
    filter: impl Into<String>,
) -> Result<Vec<Event>, StoredEventsError> {
    stored_messages(js, stream, filter)
        .await?
        .iter()
        .map(StoredMessage::event)
        .collect()
}

/// Every fact of `kind` (`stage.ready`, or a pattern such as `replica.*`) in the facts
/// stream, in stream order, those about a node's local tier included (their subjects name the
/// node). Panics when the stream cannot be read: a test's facts stream exists and holds events.
pub async fn stored_facts(js: &jetstream::Context, kind: &str) -> Vec<Event> {
    let filter = if kind.contains('*') {
        format!(
            "{}.{kind}.>",
            subject::class_filter(subject::FACT).trim_end_matches(".>")
        )
    } else {
        subject::kind_filter(subject::FACT, kind)
    };
    stored_events(js, subject::FACTS.name, filter)
        .await
        .unwrap_or_else(|e| panic!("reading the {kind} facts: {e}"))
}

/// Every fact caused by `cause` (whose causation id it is), in stream order.
pub async fn facts_caused_by(js: &jetstream::Context, cause: &EventId) -> Vec<Event> {
    stored_events(js, subject::FACTS.name, "")
        .await
        .unwrap_or_else(|e| panic!("reading the facts: {e}"))
        .into_iter()
        .filter(|e| e.causation_id.as_ref() == Some(cause))
        .collect()
}
