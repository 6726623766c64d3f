//! Step G, the one give-up path: every failure of every step comes here, and leaves as either
//! a delayed negative ack or a dead letter — never as a negative ack JetStream will not
//! redeliver.
//!
//! A failure either **counts** as an attempt (the handler failed, the ledger or the claims
//! bucket could not be read or written, a publish failed, the message cannot be handled at
//! all) or it does not (the claim is held by a live owner, or was lost to another delivery:
//! the request is not at fault, and waiting must not cost it). The runtime counts attempts
//! itself — from the claim's history, the ledger's, and what this process remembers, so that
//! the count survives a missing ledger and is shared by instances — and gives up when
//!
//! - the failure is permanent, or
//! - this was attempt `max_attempts`, or
//! - this is delivery `max_deliver`, the consumer's high safety ceiling (only deliveries that
//!   did not count can get there: waits for a claim, crashes, shutdowns).
//!
//! Giving up publishes a [`DeadLetter`] with the attempt history, records it in the ledger
//! under its own id (best effort: the dead letter does not need the ledger), deletes the
//! claim so that a replay starts afresh, and terminates the message. On the last delivery a
//! dead letter that cannot be published is retried in place until it is, or the worker stops.

use std::time::Duration;

use async_nats::jetstream::AckKind;
use bytes::Bytes;
use stagehand_schemas::subject::dead_letter_subject;
use stagehand_schemas::{Attempt, Body, DeadLetter, Event, EventId, wire};
use tracing::{info, warn};

use super::{Delivery, Handler, MsgInfo, Shared, outgoing_context};
use crate::bus::headers_for;
use crate::claim::Lease;
use crate::config::WorkerConfig;
use crate::error::{BoxError, BusError, BusErrorKind, HandlerError};
use crate::ledger::{LedgerError, bounded};
use crate::retry::RetrySchedule;

/// One failure of one delivery, as step G needs it.
pub(super) struct Failure {
    error: String,
    permanent: bool,
    /// Whether it counts as an attempt toward `max_attempts`.
    counts: bool,
    /// The delay before redelivery for a failure that does not count.
    delay: Duration,
    /// The worker must stop (a handler's fatal error).
    fatal: Option<BoxError>,
}

impl Failure {
    fn counted(error: String, permanent: bool) -> Self {
        Self {
            error,
            permanent,
            counts: true,
            delay: Duration::ZERO,
            fatal: None,
        }
    }

    pub fn handler(e: HandlerError) -> Self {
        if e.is_fatal() {
            let error = e.to_string();
            return Self {
                error,
                permanent: false,
                counts: false,
                delay: Duration::from_secs(1),
                fatal: Some(e.into_source()),
            };
        }
        Self::counted(e.to_string(), e.is_permanent())
    }

    /// The message cannot be handled at all: undecodable, or on another project's subject.
    pub fn rejected(error: String) -> Self {
        Self::counted(error, true)
    }

    pub fn ledger_read(e: LedgerError) -> Self {
        Self::counted(format!("reading the ledger: {e}"), false)
    }

    pub fn ledger_write(e: LedgerError) -> Self {
        Self::counted(format!("recording the outcome: {e}"), false)
    }

    pub fn claim(e: BusError) -> Self {
        Self::counted(format!("claiming the event: {e}"), false)
    }

    pub fn publish(e: BusError) -> Self {
        Self::counted(format!("publishing: {e}"), false)
    }

    /// A live owner holds the claim for `remaining` more: wait that out (and a little more,
    /// so that an owner that died is judged dead on the next delivery), without counting.
    pub fn held_elsewhere(remaining: Duration, cfg: &WorkerConfig) -> Self {
        Self {
            error: "claimed by another delivery".into(),
            permanent: false,
            counts: false,
            delay: remaining + margin(cfg),
            fatal: None,
        }
    }

    /// The claim was taken by another delivery while this one worked: the work is theirs.
    pub fn claim_lost(cfg: &WorkerConfig) -> Self {
        Self {
            error: "the claim was lost to another delivery".into(),
            permanent: false,
            counts: false,
            delay: cfg.claim_lifetime() + margin(cfg),
            fatal: None,
        }
    }

    /// The delivery ceiling was reached without an outcome.
    pub fn ceiling(cfg: &WorkerConfig) -> Self {
        Self::counted(
            format!(
                "delivered {} times (max_deliver) without an outcome: every delivery crashed, was abandoned at shutdown or waited for another delivery's claim",
                cfg.max_deliver
            ),
            true,
        )
    }
}

/// How long the give-up path waits for the ledger before publishing the dead letter anyway.
const LEDGER_PATIENCE: Duration = Duration::from_secs(2);

/// Slack added to waits for a claim: a tenth of the claim lifetime, at least 100 ms.
fn margin(cfg: &WorkerConfig) -> Duration {
    (cfg.claim_lifetime() / 10).max(Duration::from_millis(100))
}

/// The id of the dead letter for a delivery: derived from stream, consumer and stream
/// sequence, so that dead-lettering the same message twice stores it once.
pub(super) fn dead_letter_id(info: &MsgInfo) -> EventId {
    EventId::for_dead_letter(&info.stream, &info.consumer, info.stream_sequence)
}

impl<H: Handler> Shared<H> {
    /// Step G: retry later, or give up.
    pub(super) async fn failed(&self, d: &Delivery, f: Failure, lease: Option<Lease>) {
        if let Some(source) = f.fatal {
            // Not the event's fault: leave it for redelivery (after a restart) and stop.
            self.nak(&d.msg, f.delay).await;
            self.counters.deferred.bump();
            self.stop_fatal(BusError::with_source(
                BusErrorKind::HandlerFatal,
                format!("the {} handler cannot work", self.cfg.service),
                source,
            ));
            return;
        }
        let last_delivery = d.info.delivered >= self.ceiling();
        let attempt = bounded(Attempt {
            delivery: d.info.delivered,
            at: stagehand_schemas::now(),
            error: f.error,
            permanent: f.permanent,
        });
        if !f.counts && !last_delivery {
            info!(error = %attempt.error, delay = ?f.delay, "deferred without counting an attempt");
            self.nak(&d.msg, f.delay).await;
            self.counters.deferred.bump();
            return;
        }
        let mut history = self.history(d, lease.as_ref());
        history.push(attempt.clone());
        let attempts = history.len();
        let max = self.cfg.max_attempts as usize;
        if attempt.permanent || attempts >= max || last_delivery {
            warn!(error = %attempt.error, permanent = attempt.permanent, attempts, delivery = d.info.delivered, "giving up; dead-lettering");
            return Box::pin(self.dead_letter(d, history, lease)).await;
        }
        info!(error = %attempt.error, attempts, "retryable failure");
        if let Some(key) = d.key() {
            self.memory.set(key, history.clone());
            if let Err(e) = self.writer.record_attempt(key, attempt).await {
                warn!(error = %e, "could not record the failed attempt in the ledger");
            }
        }
        if let (Some(claims), Some(lease)) = (&self.claims, &lease)
            && let Err(e) = claims.release(lease, history).await
        {
            warn!(error = %e, "could not release the claim; it ages out");
        }
        self.nak(&d.msg, self.cfg.retry.delay(attempts as u64))
            .await;
        self.counters.retried.bump();
    }

    /// The failed attempts known for this delivery's event, oldest first: the claim's, the
    /// ledger's (when it can be read) and this process's memory, without duplicates. A
    /// replayed message starts afresh: attempts from before it was published do not count.
    fn history(&self, d: &Delivery, lease: Option<&Lease>) -> Vec<Attempt> {
        let mut h: Vec<Attempt> = lease.map(|l| l.attempts.clone()).unwrap_or_default();
        if let Some(key) = d.key() {
            match self.ledger.attempts_of(key) {
                Ok(a) => h.extend(a),
                Err(e) => {
                    warn!(error = %e, "attempt history unreadable from the ledger; using what this process knows")
                }
            }
            h.extend(self.memory.get(key));
        }
        if d.replay_of.is_some() {
            h.retain(|a| a.at >= d.info.published);
        }
        h.sort_by_key(|a| (a.at, a.delivery));
        h.dedup_by(|a, b| a.at == b.at && a.delivery == b.delivery);
        h
    }

    /// Publishes a dead letter for the delivery, records it, forgets the claim, terminates
    /// the message.
    async fn dead_letter(&self, d: &Delivery, errors: Vec<Attempt>, lease: Option<Lease>) {
        let event = d.event.as_ref().map(|(e, _)| e);
        let dl = dead_letter_event(&self.cfg.service, &d.info, &d.msg, event, errors);
        let bytes = encode_within_bound(dl);
        let (id, last_error) = match wire::decode(&bytes) {
            Ok(Event {
                id,
                body: Body::DeadLetter(dead),
                ..
            }) => (id, dead.errors.last().map(|a| a.error.clone())),
            _ => (dead_letter_id(&d.info), None),
        };
        // Recorded first, so that a redelivery after a crash republishes this dead letter
        // rather than doing the work again; but a dead letter must not need the ledger.
        let record = self
            .writer
            .record_dead_letter(&id, d.key(), bytes.clone(), last_error);
        match tokio::time::timeout(LEDGER_PATIENCE, record).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                warn!(error = %e, "could not record the dead letter in the ledger; publishing it anyway");
            }
            Err(_) => {
                warn!(
                    "the ledger did not record the dead letter in time (it may be reopening); publishing it anyway"
                );
            }
        }
        let subject = dead_letter_subject(&self.cfg.service);
        let cx = outgoing_context(&d.parent);
        let retry = RetrySchedule::exponential(Duration::from_millis(100), Duration::from_secs(5));
        let mut tries = 0u32;
        loop {
            let headers = headers_for(id.as_str(), &cx);
            match self
                .bus
                .publish_prepared(subject.clone(), headers, Bytes::from(bytes.clone()))
                .await
            {
                Ok(_) => break,
                Err(e) => {
                    tries += 1;
                    if tries >= 3 && d.info.delivered < self.ceiling() {
                        warn!(error = %e, "could not publish the dead letter; the message comes back");
                        self.nak(&d.msg, self.cfg.retry.delay(1)).await;
                        self.counters.retried.bump();
                        return;
                    }
                    // The last delivery: JetStream will not bring this message back, so the
                    // dead letter is retried here until it is stored or the worker stops.
                    let delay = retry.delay(u64::from(tries));
                    warn!(error = %e, ?delay, "could not publish the dead letter; retrying");
                    if let Err(e) = d.msg.ack_with(AckKind::Progress).await {
                        warn!(error = %e, "progress ack failed");
                    }
                    tokio::time::sleep(delay).await;
                }
            }
        }
        if let (Some(claims), Some(lease)) = (&self.claims, &lease)
            && let Err(e) = claims.forget(lease).await
        {
            warn!(error = %e, "could not remove the claim of a dead letter; it ages out");
        }
        if let Some(key) = d.key() {
            self.memory.forget(key);
        }
        self.ack(&d.msg, AckKind::Term).await;
        self.counters.dead_lettered.bump();
        self.counters.dead_letters_metric.increment(1);
    }
}

/// Encodes a dead letter within the dead-letter bound. A dead letter too large (a huge
/// original, a long history) keeps its first and last attempts, then drops the original
/// bytes, saying where the message still is: never no dead letter at all.
fn encode_within_bound(mut dl: Event) -> Vec<u8> {
    if let Ok(b) = wire::encode(&dl) {
        return b;
    }
    if let Body::DeadLetter(d) = &mut dl.body
        && d.errors.len() > 2
    {
        let last = d.errors.pop();
        d.errors.truncate(1);
        d.errors.extend(last);
    }
    if let Ok(b) = wire::encode(&dl) {
        return b;
    }
    if let Body::DeadLetter(d) = &mut dl.body {
        let len = d.original.len();
        d.original = Vec::new();
        d.errors.push(Attempt {
            delivery: d.delivered,
            at: stagehand_schemas::now(),
            error: format!(
                "the original message ({len} bytes) is too large to carry; it is at sequence {} of stream {}",
                d.stream_sequence, d.stream
            ),
            permanent: true,
        });
    }
    rmp_serde::to_vec_named(&dl).unwrap_or_default()
}

/// The dead-letter event for a delivery: id derived from stream, consumer and sequence.
fn dead_letter_event(
    service: &str,
    info: &MsgInfo,
    msg: &async_nats::jetstream::Message,
    event: Option<&Event>,
    errors: Vec<Attempt>,
) -> Event {
    let id = dead_letter_id(info);
    let mut headers: Vec<(String, String)> = msg
        .headers
        .iter()
        .flat_map(|h| h.iter())
        .flat_map(|(name, values)| {
            let name: &str = name.as_ref();
            values
                .iter()
                .map(move |v| (name.to_owned(), v.as_str().to_owned()))
        })
        .collect();
    headers.sort();
    Event {
        id: id.clone(),
        schema: stagehand_schemas::SCHEMA_VERSION,
        occurred_at: stagehand_schemas::now(),
        project: event.map_or_else(|| "unknown".to_owned(), |e| e.project.clone()),
        correlation_id: event.map_or(id, |e| e.correlation_id.clone()),
        causation_id: event.map(|e| e.id.clone()),
        body: Body::DeadLetter(DeadLetter {
            service: service.to_owned(),
            stream: info.stream.clone(),
            consumer: info.consumer.clone(),
            stream_sequence: info.stream_sequence,
            subject: msg.subject.to_string(),
            delivered: info.delivered,
            original: msg.payload.to_vec(),
            headers,
            errors,
            original_id: event.map(|e| e.id.clone()),
        }),
    }
}
