//! `stagehand dlq list|replay|discard`: dead letters for on-call.
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
//!
//! `replay --service S --since T` replays every dead letter of one service that came since T
//! and still waits (never replayed, never discarded), one by one as `replay SEQ` does;
//! `--dry-run` only lists them.
//!
//! `discard SEQ --reason TEXT` marks a dead letter as settled without its work being done: it
//! no longer waits (the recorder stops counting it, `stagehand_dead_letters_waiting` drops) and
//! no replay, single or bulk, will ever publish it. Discards and replays are operator actions,
//! each recorded as an `operator.action` fact (who, what, which dead letter, why) that the
//! recorder keeps with the facts and `stagehand status --actions` lists; the facts stream is
//! also where a replay looks for a discard, so a discard is final as soon as it is stored.

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
use stagehand_schemas::{
    Body, DeadLetter, DeadLetterReplayed, Event, EventId, OperatorAction, action, wire,
};

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
    /// When the service gave up (RFC 3339).
    pub at: String,
    /// Every replay of this dead letter, oldest first.
    pub replays: Vec<ListedReplay>,
    /// The discard of this dead letter, if an operator discarded it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub discarded: Option<ListedDiscard>,
}

/// The discard of a dead letter, as recorded by `discard`.
#[derive(Debug, Clone, Serialize)]
pub struct ListedDiscard {
    /// When it was discarded (RFC 3339).
    pub at: String,
    pub by: String,
    pub reason: String,
}

impl Listed {
    /// Whether the dead letter still waits for a person: never replayed, never discarded.
    pub fn waiting(&self) -> bool {
        self.replays.is_empty() && self.discarded.is_none()
    }
}

fn rfc3339(at: time::OffsetDateTime) -> String {
    at.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

/// Every event on `filter` in `stream`, oldest first, with its stream sequence. A message that
/// does not decode is named on stderr and skipped.
async fn read_events(
    bus: &Bus,
    stream: &str,
    filter_subject: String,
    filter_subjects: Vec<String>,
) -> anyhow::Result<Vec<(u64, Event)>> {
    let stream = bus.jetstream().get_stream(stream).await?;
    let mut consumer = stream
        .create_consumer(OrderedConfig {
            filter_subject,
            filter_subjects,
            deliver_policy: DeliverPolicy::All,
            ..Default::default()
        })
        .await?;
    let mut out = Vec::new();
    if consumer.info().await?.num_pending == 0 {
        return Ok(out);
    }
    let mut messages = consumer.messages().await?;
    // An ordered consumer reports how many messages remain after each one; when nothing does,
    // the list is complete.
    while let Some(message) = messages.next().await {
        let message = message?;
        let info = message.info().map_err(|e| anyhow::anyhow!("{e}"))?;
        let (sequence, pending) = (info.stream_sequence, info.pending);
        match wire::decode(&message.payload) {
            Ok(event) => out.push((sequence, event)),
            Err(e) => eprintln!("warning: message at sequence {sequence} does not decode: {e}"),
        }
        if pending == 0 {
            break;
        }
    }
    Ok(out)
}

/// Every discard recorded on the facts stream, by dead letter id: (when, who, why).
pub async fn discards(bus: &Bus) -> anyhow::Result<Vec<(EventId, ListedDiscard)>> {
    let filter = subject::kind_filter(subject::FACT, "operator.action");
    let mut out = Vec::new();
    for (_, event) in read_events(bus, FACTS.name, filter, Vec::new()).await? {
        if let Body::OperatorAction(a) = event.body
            && a.action == action::DLQ_DISCARD
            && let Some(id) = a.dead_letter_id
        {
            out.push((
                id,
                ListedDiscard {
                    at: rfc3339(event.occurred_at),
                    by: a.by,
                    reason: a.reason,
                },
            ));
        }
    }
    Ok(out)
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

/// Every dead letter (of `service`, if given), oldest first, with its replays and discard.
pub async fn list(bus: &Bus, service: Option<&str>) -> anyhow::Result<Vec<Listed>> {
    let (filter_subject, filter_subjects) = match service {
        Some(s) => (
            String::new(),
            vec![dead_letter_subject(s), replayed_subject(s)],
        ),
        None => (subject::class_filter(subject::DLQ), Vec::new()),
    };
    let mut out: Vec<Listed> = Vec::new();
    let mut replays: Vec<(EventId, ListedReplay)> = Vec::new();
    for (sequence, event) in
        read_events(bus, DEAD_LETTERS.name, filter_subject, filter_subjects).await?
    {
        match event.body {
            Body::DeadLetter(ref d) => out.push(listed(sequence, &event, d)),
            Body::DeadLetterReplayed(r) => replays.push((
                r.dead_letter_id,
                ListedReplay {
                    at: rfc3339(event.occurred_at),
                    replayed_by: r.replayed_by,
                    replay_msg_id: r.replay_msg_id,
                },
            )),
            _ => {}
        }
    }
    for (dead_letter_id, replay) in replays {
        if let Some(l) = out
            .iter_mut()
            .find(|l| l.dead_letter_id == dead_letter_id.as_str())
        {
            l.replays.push(replay);
        }
    }
    if !out.is_empty() {
        for (dead_letter_id, discard) in discards(bus).await? {
            if let Some(l) = out
                .iter_mut()
                .find(|l| l.dead_letter_id == dead_letter_id.as_str())
            {
                l.discarded.get_or_insert(discard);
            }
        }
    }
    Ok(out)
}

fn listed(sequence: u64, event: &Event, d: &DeadLetter) -> Listed {
    Listed {
        sequence,
        dead_letter_id: event.id.to_string(),
        service: d.service.clone(),
        subject: d.subject.clone(),
        original_id: d.original_id.as_ref().map(|i| i.to_string()),
        delivered: d.delivered,
        last_error: d.errors.last().map(|a| a.error.clone()),
        original_bytes: d.original.len(),
        at: rfc3339(event.occurred_at),
        replays: Vec::new(),
        discarded: None,
    }
}

pub fn list_text(items: &[Listed]) -> String {
    let mut out = format!(
        "{:>6}  {:<20} {:<44} {:>9}  {:<30}  LAST ERROR\n",
        "SEQ", "SERVICE", "SUBJECT", "DELIVERED", "REPLAYED"
    );
    for l in items {
        let replayed = match (&l.discarded, l.replays.last()) {
            (Some(d), _) => format!("discarded {} by {}", d.at, d.by),
            (None, None) => "-".to_owned(),
            (None, Some(r)) => format!("{}× last {} by {}", l.replays.len(), r.at, r.replayed_by),
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

/// The dead letter stored at `sequence`, with the subject it is stored on.
async fn dead_letter_at(bus: &Bus, sequence: u64) -> anyhow::Result<(Event, String)> {
    let stream = bus.jetstream().get_stream(DEAD_LETTERS.name).await?;
    let raw = stream
        .get_raw_message(sequence)
        .await
        .with_context(|| format!("no dead letter at sequence {sequence}"))?;
    let event = wire::decode(&raw.payload)
        .with_context(|| format!("the message at sequence {sequence} is not a dead letter"))?;
    if !matches!(event.body, Body::DeadLetter(_)) {
        bail!(
            "the message at sequence {sequence} is a {}, not a dead letter",
            event.body.kind()
        );
    }
    Ok((event, raw.subject.to_string()))
}

/// The discard of dead letter `id`, if one is recorded.
async fn discard_of(bus: &Bus, id: &EventId) -> anyhow::Result<Option<ListedDiscard>> {
    Ok(discards(bus)
        .await?
        .into_iter()
        .find_map(|(d, discard)| (d == *id).then_some(discard)))
}

/// The `operator.action` fact recording `body` on `project`'s subject, its id derived from
/// `key` (the same action on the same thing is the same fact).
pub fn action_event(
    project: &str,
    cause: Option<&EventId>,
    key: &[&[u8]],
    body: OperatorAction,
) -> Event {
    let mut parts: Vec<&[u8]> = vec![b"operator.action", body.action.as_bytes()];
    parts.extend_from_slice(key);
    let id = EventId::for_content(&parts);
    Event {
        correlation_id: cause.cloned().unwrap_or_else(|| id.clone()),
        id,
        schema: stagehand_schemas::SCHEMA_VERSION,
        occurred_at: stagehand_schemas::now(),
        project: project.to_owned(),
        causation_id: cause.cloned(),
        body: Body::OperatorAction(body),
    }
}

/// The operator action `action` (a replay or a discard) on the dead letter `event` (`dead`, at
/// `sequence` of the dead-letter stream), its id derived from `key`.
fn dead_letter_action(
    (event, dead, sequence): (&Event, &DeadLetter, u64),
    action: &str,
    key: &[u8],
    by: &str,
    reason: &str,
) -> Event {
    action_event(
        &event.project,
        Some(&event.id),
        &[key],
        OperatorAction {
            action: action.into(),
            by: by.to_owned(),
            target: format!("dead letter {sequence} of {}", dead.service),
            reason: reason.to_owned(),
            service: Some(dead.service.clone()),
            dead_letter_id: Some(event.id.clone()),
            dead_letter_sequence: Some(sequence),
            request_id: None,
        },
    )
}

/// Republishes the message carried by the dead letter at `sequence` and records that
/// `replayed_by` did.
pub async fn replay_as(bus: &Bus, sequence: u64, replayed_by: &str) -> anyhow::Result<Replayed> {
    replay_because(bus, sequence, replayed_by, "").await
}

/// Republishes the message carried by the dead letter at `sequence` and records that
/// `replayed_by` did, and why (`reason`, may be empty). A discarded dead letter is refused.
pub async fn replay_because(
    bus: &Bus,
    sequence: u64,
    replayed_by: &str,
    reason: &str,
) -> anyhow::Result<Replayed> {
    let (event, stored_on) = dead_letter_at(bus, sequence).await?;
    let Body::DeadLetter(dead) = &event.body else {
        unreachable!("dead_letter_at returns dead letters only")
    };
    if let Some(d) = discard_of(bus, &event.id).await? {
        bail!(
            "dead letter {sequence} was discarded at {} by {} ({}); a discarded dead letter is never replayed",
            d.at,
            d.by,
            d.reason
        );
    }
    check_replayable(bus, sequence, &stored_on, dead).await?;
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
    let act = dead_letter_action(
        (&event, dead, sequence),
        action::DLQ_REPLAY,
        msg_id.as_bytes(),
        replayed_by,
        reason,
    );
    bus.publish(&act).await.with_context(|| {
        format!(
            "the message was replayed (as {msg_id}) but the operator action could not be recorded"
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

/// What `discard` did.
#[derive(Debug, Clone, Serialize)]
pub struct Discarded {
    pub sequence: u64,
    pub dead_letter_id: String,
    pub service: String,
    pub by: String,
    pub reason: String,
    /// False when the dead letter had been discarded before (by [`Discarded::by`], for
    /// [`Discarded::reason`]): nothing new was recorded.
    pub newly: bool,
}

/// Discards the dead letter at `sequence` as `by`, for `reason`: records a `dlq.discard`
/// operator action, after which the dead letter no longer waits and is never replayed. A
/// dead letter discarded before is left as it was and said so.
pub async fn discard(
    bus: &Bus,
    sequence: u64,
    by: &str,
    reason: &str,
) -> anyhow::Result<Discarded> {
    if reason.trim().is_empty() {
        bail!("--reason must say why the dead letter is discarded");
    }
    let (event, _) = dead_letter_at(bus, sequence).await?;
    let Body::DeadLetter(dead) = &event.body else {
        unreachable!("dead_letter_at returns dead letters only")
    };
    if let Some(d) = discard_of(bus, &event.id).await? {
        return Ok(Discarded {
            sequence,
            dead_letter_id: event.id.to_string(),
            service: dead.service.clone(),
            by: d.by,
            reason: d.reason,
            newly: false,
        });
    }
    let act = dead_letter_action(
        (&event, dead, sequence),
        action::DLQ_DISCARD,
        event.id.as_str().as_bytes(),
        by,
        reason,
    );
    bus.publish(&act)
        .await
        .with_context(|| format!("recording the discard of dead letter {sequence}"))?;
    Ok(Discarded {
        sequence,
        dead_letter_id: event.id.to_string(),
        service: dead.service.clone(),
        by: by.to_owned(),
        reason: reason.to_owned(),
        newly: true,
    })
}

/// What a bulk replay did, or with `dry_run` would do, per dead letter.
#[derive(Debug, Clone, Serialize)]
pub struct BulkReplayed {
    /// The dead letters that wait (never replayed, never discarded) and came since the time
    /// asked, oldest first.
    pub selected: Vec<Listed>,
    /// Each replay done (none on a dry run).
    pub replayed: Vec<Replayed>,
    /// Each dead letter whose replay was refused or failed: its sequence and why.
    pub refused: Vec<(u64, String)>,
    pub dry_run: bool,
}

/// Replays, as `by`, every dead letter of `service` that came at or after `since` and still
/// waits; with `dry_run` only selects them. One refused (or failing) replay does not stop the
/// others: each is reported.
pub async fn replay_since(
    bus: &Bus,
    service: &str,
    since: time::OffsetDateTime,
    dry_run: bool,
    by: &str,
    reason: &str,
) -> anyhow::Result<BulkReplayed> {
    let selected: Vec<Listed> = list(bus, Some(service))
        .await?
        .into_iter()
        .filter(|l| l.waiting())
        .filter(|l| {
            time::OffsetDateTime::parse(&l.at, &time::format_description::well_known::Rfc3339)
                .is_ok_and(|at| at >= since)
        })
        .collect();
    let mut out = BulkReplayed {
        selected,
        replayed: Vec::new(),
        refused: Vec::new(),
        dry_run,
    };
    if dry_run {
        return Ok(out);
    }
    for l in &out.selected {
        match replay_because(bus, l.sequence, by, reason).await {
            Ok(r) => out.replayed.push(r),
            Err(e) => out.refused.push((l.sequence, format!("{e:#}"))),
        }
    }
    Ok(out)
}

/// The text of a bulk replay: what was selected, and what became of each.
pub fn bulk_text(r: &BulkReplayed) -> String {
    let mut out = String::new();
    let verb = if r.dry_run {
        "would replay"
    } else {
        "selected"
    };
    let _ = writeln!(out, "{verb} {} dead letter(s)", r.selected.len());
    for l in &r.selected {
        let _ = writeln!(
            out,
            "  {:>6}  {}  {}  {}",
            l.sequence,
            l.at,
            l.subject,
            l.last_error.as_deref().unwrap_or("-")
        );
    }
    for x in &r.replayed {
        let _ = writeln!(
            out,
            "replayed dead letter {} to {} as {}",
            x.sequence, x.subject, x.msg_id
        );
    }
    for (sequence, why) in &r.refused {
        let _ = writeln!(out, "not replayed: dead letter {sequence}: {why}");
    }
    out
}
