//! `stagehand dlq list|replay`: dead letters for on-call.
//!
//! `list` reads the dead-letter stream — the dead letters (`stagehand.dlq.dead.letter.<service>`)
//! and the records of their replays (`stagehand.dlq.replayed.<service>`) — and prints each dead
//! letter with its stream sequence, the subject and id of the message it carries, how often it
//! was delivered, its last error, and who replayed it when.
//!
//! `replay SEQ` republishes the carried message — its original bytes — to its original subject,
//! with a fresh `Nats-Msg-Id` (the old one would be dropped by the duplicate window) and the
//! `Stagehand-Replay` header naming the dead letter, so that the service that gave up works on
//! it again: the runtime keys dead letters by their own id, not as the event's outcome, and
//! starts a replayed message with a clean attempt history. Each replay is recorded as a
//! `dead.letter.replayed` event: who, when, which dead letter, the new id.
//!
//! The replay publishes as the operator, so it must not become a way for a tenant to publish
//! what it could not itself: a tenant chooses the subject (among its own) and the headers of a
//! message it gets dead-lettered. So a replay goes only to a request (`stagehand.req.…`) or fact
//! (`stagehand.fact.…`) subject that the dead letter's service consumes — checked against that
//! service's durable consumer on the stream named, as the server holds it — and carries only the
//! headers Stagehand itself sets: the trace context (`traceparent`, `tracestate`); every other
//! header is dropped and named in the answer. Anything else is refused, saying why.

use std::fmt::Write as _;

use anyhow::{Context, bail};
use async_nats::HeaderMap;
use async_nats::jetstream::consumer::{DeliverPolicy, pull::OrderedConfig};
use futures::StreamExt;
use serde::Serialize;
use stagehand_bus::{Bus, MSG_ID_HEADER, REPLAY_HEADER};
use stagehand_schemas::subject::{
    self, DEAD_LETTERS, FACTS, REQUESTS, dead_letter_subject, replayed_subject, subject_matches,
};
use stagehand_schemas::{Body, DeadLetter, DeadLetterReplayed, Event, EventId, wire};

/// One dead letter as `list` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct Listed {
    /// Sequence of the dead letter in the dead-letter stream (what `replay` takes).
    pub sequence: u64,
    /// The dead letter's id.
    pub dead_letter_id: String,
    pub service: String,
    /// Where the original message was published.
    pub subject: String,
    pub original_id: Option<String>,
    pub delivered: u64,
    pub last_error: Option<String>,
    pub original_bytes: usize,
    /// Every replay of this dead letter, oldest first.
    pub replays: Vec<ListedReplay>,
}

/// One replay of a dead letter, as recorded by `replay`.
#[derive(Debug, Clone, Serialize)]
pub struct ListedReplay {
    /// When it was replayed (RFC 3339).
    pub at: String,
    pub replayed_by: String,
    /// The `Nats-Msg-Id` the replayed copy was published with.
    pub replay_msg_id: String,
}

/// Every dead letter (of `service`, if given), oldest first, with its replays.
pub async fn list(bus: &Bus, service: Option<&str>) -> anyhow::Result<Vec<Listed>> {
    let mut stream = bus.jetstream().get_stream(DEAD_LETTERS.name).await?;
    let info = stream.info().await?;
    if info.state.messages == 0 {
        return Ok(Vec::new());
    }
    let (filter_subject, filter_subjects) = match service {
        Some(s) => (
            String::new(),
            vec![dead_letter_subject(s), replayed_subject(s)],
        ),
        None => (subject::class_filter(subject::DLQ), Vec::new()),
    };
    let consumer = stream
        .create_consumer(OrderedConfig {
            filter_subject,
            filter_subjects,
            deliver_policy: DeliverPolicy::All,
            ..Default::default()
        })
        .await?;
    let mut messages = consumer.messages().await?;
    let mut out: Vec<Listed> = Vec::new();
    let mut replays: Vec<(EventId, ListedReplay)> = Vec::new();
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
            Ok(event) => match event.body {
                Body::DeadLetter(d) => out.push(listed(sequence, &event.id, &d)),
                Body::DeadLetterReplayed(r) => replays.push((
                    r.dead_letter_id,
                    ListedReplay {
                        at: event
                            .occurred_at
                            .format(&time::format_description::well_known::Rfc3339)
                            .unwrap_or_default(),
                        replayed_by: r.replayed_by,
                        replay_msg_id: r.replay_msg_id,
                    },
                )),
                _ => {}
            },
            Err(e) => eprintln!("warning: message at sequence {sequence} does not decode: {e}"),
        }
        if pending == 0 {
            break;
        }
        next = messages.next().await;
    }
    for (dead_letter_id, replay) in replays {
        if let Some(l) = out
            .iter_mut()
            .find(|l| l.dead_letter_id == dead_letter_id.as_str())
        {
            l.replays.push(replay);
        }
    }
    Ok(out)
}

fn listed(sequence: u64, id: &EventId, d: &DeadLetter) -> Listed {
    Listed {
        sequence,
        dead_letter_id: id.to_string(),
        service: d.service.clone(),
        subject: d.subject.clone(),
        original_id: d.original_id.as_ref().map(|i| i.to_string()),
        delivered: d.delivered,
        last_error: d.errors.last().map(|a| a.error.clone()),
        original_bytes: d.original.len(),
        replays: Vec::new(),
    }
}

pub fn list_text(items: &[Listed]) -> String {
    let mut out = format!(
        "{:>6}  {:<20} {:<44} {:>9}  {:<30}  LAST ERROR\n",
        "SEQ", "SERVICE", "SUBJECT", "DELIVERED", "REPLAYED"
    );
    for l in items {
        let replayed = match l.replays.last() {
            None => "-".to_owned(),
            Some(r) => format!("{}× last {} by {}", l.replays.len(), r.at, r.replayed_by),
        };
        let _ = writeln!(
            out,
            "{:>6}  {:<20} {:<44} {:>9}  {:<30}  {}",
            l.sequence,
            l.service,
            l.subject,
            l.delivered,
            replayed,
            l.last_error.as_deref().unwrap_or("-")
        );
    }
    out
}

/// What `replay` did.
#[derive(Debug, Clone, Serialize)]
pub struct Replayed {
    pub sequence: u64,
    pub dead_letter_id: String,
    pub subject: String,
    /// The fresh `Nats-Msg-Id` the message was republished with.
    pub msg_id: String,
    /// Where the republished copy landed.
    pub stream: String,
    pub stream_sequence: u64,
    pub replayed_by: String,
    /// Headers of the dead message that the replay did not carry (not set by Stagehand).
    pub dropped_headers: Vec<String>,
}

/// Headers of a dead message a replay carries: the trace context, which Stagehand's producers
/// set. `Nats-Msg-Id` and `Stagehand-Replay` are rebuilt by the replay; nothing else is
/// Stagehand's, and a tenant's own headers must not ride on the operator's publish.
const KEPT_HEADERS: &[&str] = &[stagehand_telemetry::propagation::TRACEPARENT, "tracestate"];

/// Refuses a dead letter whose message the replay must not publish: stored anywhere but its
/// service's dead-letter subject, from a stream other than requests or facts, or from a subject
/// that its service's durable consumer does not take (as the server holds that consumer).
async fn check_replayable(
    bus: &Bus,
    sequence: u64,
    stored_on: &str,
    dead: &DeadLetter,
) -> anyhow::Result<()> {
    if !subject::is_event_subject(&dead.subject) {
        bail!(
            "dead letter {sequence} carries a message from {:?}; only request (stagehand.req.…) and fact (stagehand.fact.…) messages are replayed",
            dead.subject
        );
    }
    if stored_on != dead_letter_subject(&dead.service) {
        bail!(
            "dead letter {sequence} names service {:?} but is stored on {stored_on}, not on that service's dead-letter subject; not replayed",
            dead.service
        );
    }
    if ![REQUESTS.name, FACTS.name].contains(&dead.stream.as_str()) || dead.consumer != dead.service
    {
        bail!(
            "dead letter {sequence} says service {:?} consumed it through consumer {:?} of stream {:?}; a service consumes through its own durable consumer on {} or {}; not replayed",
            dead.service,
            dead.consumer,
            dead.stream,
            REQUESTS.name,
            FACTS.name
        );
    }
    let literal = dead
        .subject
        .split('.')
        .all(|t| !t.is_empty() && t != "*" && t != ">" && !t.contains(char::is_whitespace));
    let stream = bus.jetstream().get_stream(&dead.stream).await?;
    let consumer = match stream.consumer_info(&dead.service).await {
        Ok(info) => info.config,
        Err(e) => bail!(
            "dead letter {sequence}: service {:?} has no consumer on {} ({e}), so nothing says it consumes {}; not replayed",
            dead.service,
            dead.stream,
            dead.subject
        ),
    };
    let filters: Vec<&str> = if consumer.filter_subjects.is_empty() {
        vec![consumer.filter_subject.as_str()]
    } else {
        consumer
            .filter_subjects
            .iter()
            .map(String::as_str)
            .collect()
    };
    if !literal
        || !filters
            .iter()
            .any(|f| f.is_empty() || subject_matches(f, &dead.subject))
    {
        bail!(
            "dead letter {sequence} carries a message from {}, which service {} does not consume (its consumer on {} takes {}); not replayed",
            dead.subject,
            dead.service,
            dead.stream,
            filters.join(", ")
        );
    }
    Ok(())
}

/// Who runs this command: `$USER@host` (or `$STAGEHAND_OPERATOR` when set).
pub fn operator() -> String {
    if let Ok(name) = std::env::var("STAGEHAND_OPERATOR")
        && !name.is_empty()
    {
        return name;
    }
    let user = std::env::var("USER").unwrap_or_else(|_| "unknown".into());
    format!("{user}@{}", stagehand_bus::host_name())
}

/// Republishes the message carried by the dead letter at `sequence`, as [`operator`].
pub async fn replay(bus: &Bus, sequence: u64) -> anyhow::Result<Replayed> {
    replay_as(bus, sequence, &operator()).await
}

/// Republishes the message carried by the dead letter at `sequence` and records that
/// `replayed_by` did.
pub async fn replay_as(bus: &Bus, sequence: u64, replayed_by: &str) -> anyhow::Result<Replayed> {
    let stream = bus.jetstream().get_stream(DEAD_LETTERS.name).await?;
    let raw = stream
        .get_raw_message(sequence)
        .await
        .with_context(|| format!("no dead letter at sequence {sequence}"))?;
    let event = wire::decode(&raw.payload)
        .with_context(|| format!("the message at sequence {sequence} is not a dead letter"))?;
    let Body::DeadLetter(dead) = &event.body else {
        bail!(
            "the message at sequence {sequence} is a {}, not a dead letter",
            event.body.kind()
        );
    };
    check_replayable(bus, sequence, &raw.subject, dead).await?;
    let mut headers = HeaderMap::new();
    let mut dropped_headers = Vec::new();
    for (name, value) in &dead.headers {
        if KEPT_HEADERS.iter().any(|k| name.eq_ignore_ascii_case(k)) {
            headers.append(name.as_str(), value.as_str());
        } else if !name.eq_ignore_ascii_case(MSG_ID_HEADER)
            && !name.eq_ignore_ascii_case(REPLAY_HEADER)
            && !dropped_headers.contains(name)
        {
            dropped_headers.push(name.clone());
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
    headers.insert(REPLAY_HEADER, event.id.as_str());
    let ack = bus
        .jetstream()
        .publish_with_headers(dead.subject.clone(), headers, dead.original.clone().into())
        .await?
        .await
        .with_context(|| format!("republishing to {}", dead.subject))?;
    let record = Event {
        id: EventId::for_content(&[b"dead-letter-replayed", msg_id.as_bytes()]),
        schema: stagehand_schemas::SCHEMA_VERSION,
        occurred_at: stagehand_schemas::now(),
        project: event.project.clone(),
        correlation_id: event.correlation_id.clone(),
        causation_id: Some(event.id.clone()),
        body: Body::DeadLetterReplayed(DeadLetterReplayed {
            service: dead.service.clone(),
            dead_letter_id: event.id.clone(),
            dead_letter_sequence: sequence,
            subject: dead.subject.clone(),
            original_id: dead.original_id.clone(),
            replay_msg_id: msg_id.clone(),
            replayed_by: replayed_by.to_owned(),
        }),
    };
    bus.publish(&record).await.with_context(|| {
        format!(
            "the message was replayed (as {msg_id}) but the replay could not be recorded on {}",
            replayed_subject(&dead.service)
        )
    })?;
    Ok(Replayed {
        sequence,
        dead_letter_id: event.id.to_string(),
        subject: dead.subject.clone(),
        msg_id,
        stream: ack.stream,
        stream_sequence: ack.sequence,
        replayed_by: replayed_by.to_owned(),
        dropped_headers,
    })
}
