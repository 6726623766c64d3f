//! Steps 2–7 of the consume loop for a decoded event: ledger check, claim, handle, commit,
//! publish, ack. Every failure goes to step G (`dead_letter.rs`), which decides between a
//! retry and a dead letter.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use async_nats::jetstream::AckKind;
use bytes::Bytes;
use futures::FutureExt;
use opentelemetry::Context as OtelContext;
use stagehand_schemas::subject::{dead_letter_subject, subject_for};
use stagehand_schemas::{Body, Event, wire};
use tokio::sync::OwnedSemaphorePermit;
use tracing::{debug, error, warn};

use super::dead_letter::{Failure, dead_letter_id};
use super::{Delivery, Handler, Shared, WorkContext, outgoing_context};
use crate::bus::headers_for;
use crate::claim::{Claim, Commit, Lease, LeaseError};
use crate::error::HandlerError;
use crate::ledger::{EventKey, RecordedBytes};

/// How a handler run ended.
enum Ran {
    Finished(Result<Vec<Event>, HandlerError>),
    /// The claim was lost while the handler ran; the handler was cancelled.
    ClaimLost,
}

/// One message to publish: subject, headers, payload.
type Publication = (String, HeaderMap, Bytes);

impl<H: Handler> Shared<H> {
    pub(super) async fn process_event(
        self: &Arc<Self>,
        d: &Delivery,
        event: &Event,
        key: &EventKey,
        handler_slot: OwnedSemaphorePermit,
    ) {
        // 2. Finished already? Republish exactly what was recorded.
        match self.ledger.recorded_bytes(key) {
            // Boxed, like the other uncommon paths, to keep the per-message future small.
            Ok(Some(recorded)) => return Box::pin(self.replay(d, recorded)).await,
            Ok(None) => {}
            Err(e) => return Box::pin(self.failed(d, Failure::ledger_read(e), None)).await,
        }
        // A redelivery of a message this service dead-lettered (the Term was lost): the same
        // dead letter again, not the work again.
        if d.info.delivered > 1 {
            match self.ledger.recorded_dead_letter(&dead_letter_id(&d.info)) {
                Ok(Some(recorded)) => return Box::pin(self.replay(d, recorded)).await,
                Ok(None) => {}
                Err(e) => return Box::pin(self.failed(d, Failure::ledger_read(e), None)).await,
            }
        }
        // 3. Claim it, so that no other delivery works on the same event at the same time.
        let mut lease = None;
        if let Some(claims) = &self.claims {
            let mut claim = claims
                .claim(
                    &event.project,
                    event.kind(),
                    &event.id,
                    d.info.stream_sequence,
                )
                .await;
            if d.replay_of.is_some() && matches!(claim, Ok(Claim::Done(None))) {
                // A marker without facts may be an older runtime's mark of a dead letter: a
                // replay must do the work again.
                claim = claims
                    .take_for_replay(
                        &event.project,
                        event.kind(),
                        &event.id,
                        d.info.stream_sequence,
                    )
                    .await;
            }
            match claim {
                Ok(Claim::Owned(l)) => lease = Some(l),
                Ok(Claim::Done(facts)) => {
                    self.counters
                        .claimed_elsewhere
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    return Box::pin(self.adopt(d, key, facts)).await;
                }
                Ok(Claim::InFlightElsewhere) if d.replay_of.is_some() => {
                    // A replay is on-call asking for the work again: never answered by a claim
                    // that may be a dead letter's, left behind; wait for it instead.
                    let f = Failure::held_elsewhere(self.cfg.claim_lifetime(), &self.cfg);
                    return Box::pin(self.failed(d, f, None)).await;
                }
                Ok(Claim::InFlightElsewhere) => {
                    self.counters
                        .claimed_elsewhere
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    debug!("another message of this event is being worked on; acking this copy");
                    self.ack(&d.msg, AckKind::Ack).await;
                    self.counters.redundant.bump();
                    return;
                }
                Ok(Claim::HeldElsewhere { remaining }) => {
                    self.counters
                        .claimed_elsewhere
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let f = Failure::held_elsewhere(remaining, &self.cfg);
                    return Box::pin(self.failed(d, f, None)).await;
                }
                Err(e) => return Box::pin(self.failed(d, Failure::claim(e), None)).await,
            }
        }
        // At the delivery ceiling the handler does not run: if it crashed the process, this
        // delivery would be the one JetStream never makes again, and nothing would be said.
        if d.info.delivered >= self.ceiling() {
            return Box::pin(self.failed(d, Failure::ceiling(&self.cfg), lease)).await;
        }
        // 4. Do the work, keeping the message and the claim alive while it runs.
        let ran = self.run_handler(d, event, &mut lease).await;
        drop(handler_slot);
        match ran {
            Ran::Finished(Ok(facts)) => self.finish(d, key, facts, lease).await,
            Ran::Finished(Err(e)) => Box::pin(self.failed(d, Failure::handler(e), lease)).await,
            Ran::ClaimLost => {
                let f = Failure::claim_lost(&self.cfg);
                Box::pin(self.failed(d, f, None)).await;
            }
        }
    }

    /// The delivery at which the runtime gives up whatever happened: the consumer's
    /// `max_deliver`.
    pub(super) fn ceiling(&self) -> u64 {
        u64::try_from(self.cfg.max_deliver).unwrap_or(u64::MAX)
    }

    /// Step 4: runs the handler, sending progress acks and renewing the claim every
    /// AckWait/3. A renewal that finds the claim taken, or no renewal succeeding for a whole
    /// claim lifetime, cancels the handler: the work is someone else's now.
    async fn run_handler(&self, d: &Delivery, event: &Event, lease: &mut Option<Lease>) -> Ran {
        let ctx = WorkContext {
            msg: d.msg.clone(),
            delivery: d.info.delivered,
            stream_sequence: d.info.stream_sequence,
            shutdown: self.stop.clone(),
        };
        let work = AssertUnwindSafe(self.handler.handle(event, &ctx)).catch_unwind();
        tokio::pin!(work);
        // A handler that finishes on its first poll needs no progress timer: arming one per
        // message costs more than a quick handler does.
        if let std::task::Poll::Ready(r) = futures::poll!(&mut work) {
            return Ran::Finished(flatten_panic(r));
        }
        let lifetime = self.cfg.claim_lifetime();
        let period = self.cfg.ack_wait.min(lifetime) / 3;
        let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        let mut renewed = Instant::now();
        loop {
            tokio::select! {
                r = &mut work => return Ran::Finished(flatten_panic(r)),
                _ = ticker.tick() => {
                    if let Err(e) = d.msg.ack_with(AckKind::Progress).await {
                        warn!(error = %e, "progress ack failed");
                    }
                    if let (Some(claims), Some(l)) = (&self.claims, lease.as_mut()) {
                        match claims.renew(l).await {
                            Ok(()) => renewed = Instant::now(),
                            Err(LeaseError::Lost) => {
                                warn!("claim lost to another delivery; cancelling the handler");
                                return Ran::ClaimLost;
                            }
                            Err(LeaseError::Unavailable(e)) => {
                                warn!(error = %e, "claim renewal failed");
                                if renewed.elapsed() + period >= lifetime {
                                    warn!("no claim renewal for a claim lifetime; cancelling the handler");
                                    return Ran::ClaimLost;
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// Steps 5–7: commit the outcome (the claim, then the ledger), publish the facts, ack.
    async fn finish(&self, d: &Delivery, key: &EventKey, facts: Vec<Event>, lease: Option<Lease>) {
        let cx = outgoing_context(&d.parent);
        let mut ours = Vec::with_capacity(facts.len());
        let mut bytes = Vec::with_capacity(facts.len());
        for fact in &facts {
            match crate::bus::prepare(fact, &cx) {
                Ok((subject, headers, payload)) => {
                    bytes.push(payload.to_vec());
                    ours.push((subject, headers, payload));
                }
                Err(e) => {
                    // A fact that cannot be encoded will not encode next time either.
                    let err = HandlerError::permanent(e);
                    return Box::pin(self.failed(d, Failure::handler(err), lease)).await;
                }
            }
        }
        // 5a. The claim is the commit point across instances: a compare-and-set from the
        // revision this delivery owns to `done` with the facts. Whoever committed first, its
        // facts are the outcome.
        let mut publish = Some(ours);
        if let (Some(claims), Some(lease)) = (&self.claims, lease) {
            match claims.commit(&lease, &bytes).await {
                Ok(Commit::Ours) => {}
                Ok(Commit::Theirs(Some(first))) => {
                    debug!("another delivery committed this event first; publishing its facts");
                    bytes = first;
                    publish = None;
                }
                Ok(Commit::Theirs(None)) => {
                    debug!("another delivery committed this event first; acking");
                    self.ack(&d.msg, AckKind::Ack).await;
                    self.counters.replayed.bump();
                    return;
                }
                Err(LeaseError::Lost) => {
                    let f = Failure::claim_lost(&self.cfg);
                    return Box::pin(self.failed(d, f, None)).await;
                }
                Err(LeaseError::Unavailable(e)) => {
                    return Box::pin(self.failed(d, Failure::claim(e), Some(lease))).await;
                }
            }
        }
        // 5b. The ledger: the first outcome recorded for the key wins here too.
        // Our own facts are published from `ours`; only someone else's need their bytes back.
        let keep = if publish.is_some() {
            Vec::new()
        } else {
            bytes.clone()
        };
        match self.writer.record_outcome(key, bytes).await {
            Ok(None) => bytes = keep,
            Ok(Some(earlier)) => {
                debug!("an outcome was recorded before; publishing it instead");
                bytes = earlier;
                publish = None;
            }
            Err(e) => return Box::pin(self.failed(d, Failure::ledger_write(e), None)).await,
        }
        self.memory.forget(key);
        // The outcome is durable: from here a crash or error leads to a replay of these facts.
        if let Some(hook) = &self.hooks.after_record
            && let Some((event, _)) = &d.event
        {
            hook(&event.id).await;
        }
        // 6. Publish.
        let publications = match publish {
            Some(ours) => ours,
            None => self.publications(&bytes, None, &cx),
        };
        if let Err(f) = self.publish_all(publications).await {
            return Box::pin(self.failed(d, f, None)).await;
        }
        // 7. Ack.
        self.ack(&d.msg, AckKind::Ack).await;
        self.counters.handled.bump();
        debug!(facts = facts.len(), "handled");
    }

    /// A claim found `done`: record its facts in this ledger too and publish them — the first
    /// outcome, never one of our own — then ack. Without facts (only an older runtime's
    /// marker: a large outcome is kept in parts beside the claim), ack: the instance that
    /// committed it published.
    async fn adopt(&self, d: &Delivery, key: &EventKey, facts: Option<Vec<Vec<u8>>>) {
        let Some(facts) = facts else {
            debug!("another delivery finished this event; acking");
            self.ack(&d.msg, AckKind::Ack).await;
            self.counters.replayed.bump();
            return;
        };
        let facts = match self.writer.record_outcome(key, facts.clone()).await {
            Ok(recorded) => recorded.unwrap_or(facts),
            Err(e) => {
                // The claim holds the outcome; publishing it needs no local record.
                warn!(error = %e, "could not record the claim's outcome in the ledger");
                facts
            }
        };
        self.memory.forget(key);
        self.replay(
            d,
            RecordedBytes {
                facts,
                dead_letter: None,
            },
        )
        .await;
    }

    /// Republishes a recorded outcome (same bytes, same ids) and acks; a recorded dead letter
    /// is republished and the message terminated.
    pub(super) async fn replay(&self, d: &Delivery, recorded: RecordedBytes) {
        let cx = outgoing_context(&d.parent);
        let out = self.publications(&recorded.facts, recorded.dead_letter.as_deref(), &cx);
        if let Err(f) = self.publish_all(out).await {
            return Box::pin(self.failed(d, f, None)).await;
        }
        let kind = if recorded.dead_letter.is_some() {
            AckKind::Term
        } else {
            AckKind::Ack
        };
        self.ack(&d.msg, kind).await;
        self.counters.replayed.bump();
        debug!("replayed recorded outcome");
    }

    /// Subjects and headers for recorded bytes (each decoded for its id and subject).
    fn publications(
        &self,
        facts: &[Vec<u8>],
        dead_letter: Option<&[u8]>,
        cx: &OtelContext,
    ) -> Vec<Publication> {
        let mut out = Vec::with_capacity(facts.len() + 1);
        for bytes in facts {
            match wire::decode(bytes) {
                Ok(fact) => out.push((
                    subject_for(&fact.body, &fact.project),
                    headers_for(fact.id.as_str(), cx),
                    Bytes::from(bytes.clone()),
                )),
                Err(e) => error!(error = %e, "recorded fact no longer decodes; not republished"),
            }
        }
        if let Some(bytes) = dead_letter {
            match wire::decode(bytes) {
                Ok(dl) => {
                    let service = match &dl.body {
                        Body::DeadLetter(d) => d.service.clone(),
                        _ => self.cfg.service.clone(),
                    };
                    out.push((
                        dead_letter_subject(&service),
                        headers_for(dl.id.as_str(), cx),
                        Bytes::from(bytes.to_vec()),
                    ));
                }
                Err(e) => error!(error = %e, "recorded dead letter no longer decodes"),
            }
        }
        out
    }

    /// Publishes every message and waits for every PubAck.
    async fn publish_all(&self, out: Vec<Publication>) -> Result<(), Failure> {
        let publishes = out
            .into_iter()
            .map(|(s, h, p)| self.bus.publish_prepared(s, h, p));
        for r in futures::future::join_all(publishes).await {
            r.map_err(Failure::publish)?;
        }
        Ok(())
    }

    pub(super) async fn ack(&self, msg: &async_nats::jetstream::Message, kind: AckKind) {
        if let Err(e) = msg.double_ack_with(kind).await {
            // The outcome is recorded: a redelivery republishes it and acks again.
            warn!(error = %e, "ack not confirmed; the message may be redelivered and replayed");
        }
    }

    pub(super) async fn nak(&self, msg: &async_nats::jetstream::Message, delay: Duration) {
        debug!(?delay, "negative ack");
        if let Err(e) = msg.ack_with(AckKind::Nak(Some(delay))).await {
            warn!(error = %e, "negative ack failed; the server redelivers after AckWait");
        }
    }
}

fn flatten_panic(
    r: Result<Result<Vec<Event>, HandlerError>, Box<dyn std::any::Any + Send>>,
) -> Result<Vec<Event>, HandlerError> {
    r.unwrap_or_else(|panic| {
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "non-string panic".into());
        Err(HandlerError::retryable(format!("handler panicked: {what}")))
    })
}
