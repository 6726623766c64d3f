//! `stagehand dlq list|replay`: dead letters for on-call.
//!
//! `list` reads the dead-letter stream (optionally one service's subject) and prints each dead
//! letter with its stream sequence, the subject and id of the message it carries, how often it
//! was delivered and its last error. `replay SEQ` republishes the carried message — its
//! original bytes and headers — to its original subject with a fresh `Nats-Msg-Id` (the old one
//! would be dropped by the duplicate window), so the service that gave up sees it again.

use std::fmt::Write as _;

use anyhow::{Context, bail};
use async_nats::HeaderMap;
use async_nats::jetstream::consumer::{DeliverPolicy, pull::OrderedConfig};
use futures::StreamExt;
use serde::Serialize;
use stagehand_bus::{Bus, MSG_ID_HEADER};
use stagehand_schemas::subject::{DEAD_LETTERS, dead_letter_subject};
use stagehand_schemas::{Body, DeadLetter, EventId, wire};

/// One dead letter as `list` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct Listed {
    /// Sequence of the dead letter in the dead-letter stream (what `replay` takes).
    pub sequence: u64,
    pub service: String,
    /// Where the original message was published.
    pub subject: String,
    pub original_id: Option<String>,
    pub delivered: u64,
    pub last_error: Option<String>,
    pub original_bytes: usize,
}

/// Every dead letter (of `service`, if given), oldest first.
pub async fn list(bus: &Bus, service: Option<&str>) -> anyhow::Result<Vec<Listed>> {
    let mut stream = bus.jetstream().get_stream(DEAD_LETTERS.name).await?;
    let info = stream.info().await?;
    if info.state.messages == 0 {
        return Ok(Vec::new());
    }
    let filter = service.map_or_else(|| "stagehand.dlq.>".to_owned(), dead_letter_subject);
    let consumer = stream
        .create_consumer(OrderedConfig {
            filter_subject: filter,
            deliver_policy: DeliverPolicy::All,
            ..Default::default()
        })
        .await?;
    let mut messages = consumer.messages().await?;
    let mut out = Vec::new();
    // An ordered consumer reports how many messages remain after each one; when nothing does
    // (or a filter matches nothing at all), the list is complete.
    let first = tokio::time::timeout(std::time::Duration::from_secs(2), messages.next()).await;
    let mut next = match first {
        Ok(m) => m,
        Err(_) => return Ok(out),
    };
    while let Some(message) = next {
        let message = message?;
        let info = message.info().map_err(|e| anyhow::anyhow!("{e}"))?;
        let (sequence, pending) = (info.stream_sequence, info.pending);
        match wire::decode(&message.payload) {
            Ok(event) => {
                if let Body::DeadLetter(d) = event.body {
                    out.push(listed(sequence, &d));
                }
            }
            Err(e) => eprintln!("warning: dead letter at sequence {sequence} does not decode: {e}"),
        }
        if pending == 0 {
            break;
        }
        next = messages.next().await;
    }
    Ok(out)
}

fn listed(sequence: u64, d: &DeadLetter) -> Listed {
    Listed {
        sequence,
        service: d.service.clone(),
        subject: d.subject.clone(),
        original_id: d.original_id.as_ref().map(|i| i.to_string()),
        delivered: d.delivered,
        last_error: d.errors.last().map(|a| a.error.clone()),
        original_bytes: d.original.len(),
    }
}

pub fn list_text(items: &[Listed]) -> String {
    let mut out = format!(
        "{:>6}  {:<20} {:<44} {:>9}  LAST ERROR\n",
        "SEQ", "SERVICE", "SUBJECT", "DELIVERED"
    );
    for l in items {
        let _ = writeln!(
            out,
            "{:>6}  {:<20} {:<44} {:>9}  {}",
            l.sequence,
            l.service,
            l.subject,
            l.delivered,
            l.last_error.as_deref().unwrap_or("-")
        );
    }
    out
}

/// What `replay` did.
#[derive(Debug, Clone, Serialize)]
pub struct Replayed {
    pub sequence: u64,
    pub subject: String,
    /// The fresh `Nats-Msg-Id` the message was republished with.
    pub msg_id: String,
    /// Where the republished copy landed.
    pub stream: String,
    pub stream_sequence: u64,
}

/// Republishes the message carried by the dead letter at `sequence`.
pub async fn replay(bus: &Bus, sequence: u64) -> anyhow::Result<Replayed> {
    let stream = bus.jetstream().get_stream(DEAD_LETTERS.name).await?;
    let raw = stream
        .get_raw_message(sequence)
        .await
        .with_context(|| format!("no dead letter at sequence {sequence}"))?;
    let event = wire::decode(&raw.payload)
        .with_context(|| format!("the message at sequence {sequence} is not a dead letter"))?;
    let Body::DeadLetter(dead) = event.body else {
        bail!(
            "the message at sequence {sequence} is a {}, not a dead letter",
            event.body.kind()
        );
    };
    let mut headers = HeaderMap::new();
    for (name, value) in &dead.headers {
        if !name.eq_ignore_ascii_case(MSG_ID_HEADER) {
            headers.append(name.as_str(), value.as_str());
        }
    }
    // Fresh, yet the same for the same replay of the same dead letter within a second: a
    // retried `replay` command is dropped by the duplicate window rather than doubled.
    let msg_id = EventId::for_content(&[
        b"replay",
        event.id.as_str().as_bytes(),
        &(time::OffsetDateTime::now_utc().unix_timestamp()).to_be_bytes(),
    ])
    .to_string();
    headers.insert(MSG_ID_HEADER, msg_id.as_str());
    let ack = bus
        .jetstream()
        .publish_with_headers(dead.subject.clone(), headers, dead.original.clone().into())
        .await?
        .await
        .with_context(|| format!("republishing to {}", dead.subject))?;
    Ok(Replayed {
        sequence,
        subject: dead.subject,
        msg_id,
        stream: ack.stream,
        stream_sequence: ack.sequence,
    })
}
