//! What a stream stored, for assertions: each stored message once, in stream order, however
//! often its publisher sent it (services republish an answer they are not sure was stored,
//! and a plain subscriber sees every copy).

use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull};
use futures::StreamExt;
use stagehand_schemas::Event;

/// A failure to read a stream (a missing stream, a message that is not an event).
pub type StoredEventsError = Box<dyn std::error::Error + Send + Sync>;

/// Every event stored in `stream` on a subject matching `filter`, in stream order: what the
/// stream held when asked.
pub async fn stored_events(
    js: &jetstream::Context,
    stream: &str,
    filter: impl Into<String>,
) -> Result<Vec<Event>, StoredEventsError> {
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
        out.push(stagehand_schemas::wire::decode(&m?.payload)?);
    }
    Ok(out)
}
