//! Message ids no other publisher can borrow: what Stagehand puts in `Nats-Msg-Id`, and why a
//! PubAck that says "duplicate" is checked before it is believed.
//!
//! JetStream's duplicate window is per stream and keyed by `Nats-Msg-Id` alone, whatever the
//! subject. Stagehand's ids follow from public names (`stagehand_schemas::id`), so any user
//! that may publish anything on a stream could store, on its own subject, a message under the
//! id another project's next request or fact will carry; the victim's publish would then be
//! acknowledged as a duplicate and never stored. Two defences, both in [`Bus`]'s one publish
//! path:
//!
//! 1. **Scoped ids.** Every message is published under [`msg_id_for`]`(subject, id)`, so two
//!    projects' (or two kinds') honest ids never collide.
//! 2. **Duplicates proven.** The publisher sets the header freely, so no naming scheme stops a
//!    hostile one. A duplicate's PubAck names the sequence of the message the stream already
//!    holds under that id (nats-server `stream.go`: `"seq": dde.seq, "duplicate": true`); it
//!    counts as this publish only when it travels on the same subject and carries the same
//!    event id (or the last message on the subject does: this event, stored under a fresh id
//!    by an earlier publish whose id was borrowed). Anything else — another subject, another
//!    id, a message that cannot be read — is *unproven*, and the event is published again under
//!    a `Nats-Msg-Id` no one can predict (the scoped id and a random suffix). Consumers are
//!    idempotent per subject and event id (the worker's ledger and claims, the recorder's
//!    applied events), so a second stored copy costs nothing; a lost request would cost a job.
//!
//! Reading the stored message: first as the last message on the publish's own subject (a direct
//! get by subject, which every publisher is granted for its own subjects in
//! `deploy/nats/accounts.conf`); when that is another message, by its sequence (a direct get
//! any message of the stream could be read by: granted to services, never to tenants, whose
//! buses say so with [`Bus::reading_own_subjects_only`] and republish instead).

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::message::StreamMessage;
use bytes::Bytes;
use stagehand_schemas::wire;
use tracing::{debug, warn};

use crate::bus::{Bus, MSG_ID_HEADER, PublishAck};
use crate::error::BusError;

/// How long reading a stored message may take. A user without the right to read gets no
/// answer at all (the server drops a denied request), so this bounds the wait, not the
/// client's default request timeout.
const READ_TIMEOUT: Duration = Duration::from_secs(2);

/// The `Nats-Msg-Id` of event `id` published on `subject`: `<subject>:<id>`. Subjects never
/// contain `:`, so the pair is unambiguous, and two events on different subjects (another
/// project, another kind) never share a message id.
pub fn msg_id_for(subject: &str, id: &str) -> String {
    format!("{subject}:{id}")
}

/// Puts the message id in `headers` in its scoped form ([`msg_id_for`]) unless it already is:
/// callers set the event's id (or a run's id for it), the bus scopes it by the subject.
pub(crate) fn scope_msg_id(subject: &str, headers: &mut HeaderMap) {
    let Some(given) = headers.get(MSG_ID_HEADER).map(|v| v.as_str().to_owned()) else {
        return;
    };
    let scoped_prefix = format!("{subject}:");
    if !given.starts_with(&scoped_prefix) {
        headers.insert(MSG_ID_HEADER, msg_id_for(subject, &given).as_str());
    }
}

/// The event id a message carries, when it decodes.
fn event_id_of(payload: &[u8]) -> Option<String> {
    wire::decode(payload).ok().map(|e| e.id.to_string())
}

/// Whether `stored` is the message this publish meant to store: the same subject and the same
/// event (by id; bytes when the payload is no event).
fn is_ours(stored: &StreamMessage, subject: &str, payload: &[u8]) -> bool {
    if stored.subject.as_str() != subject {
        return false;
    }
    match (event_id_of(payload), event_id_of(&stored.payload)) {
        (Some(ours), Some(theirs)) => ours == theirs,
        (None, None) => stored.payload.as_ref() == payload,
        _ => false,
    }
}

impl Bus {
    /// Marks this connection as one whose user may read only the last message of the subjects
    /// it publishes on (a tenant: an uploader, a scheduler, a training job): a duplicate is
    /// then proven by that read alone, and otherwise published again, never read by its
    /// sequence (a read such a user is refused, which costs a timeout and a logged violation).
    pub fn reading_own_subjects_only(mut self) -> Self {
        self.reads_by_sequence = false;
        self
    }

    /// The message stored at the sequence `ack` names, read as the last message on `subject`
    /// or, when that is another one and this connection may, by its sequence. `None` when it
    /// cannot be read within a short bound (denied, gone, the stream unreachable).
    pub async fn stored_message(&self, ack: &PublishAck, subject: &str) -> Option<StreamMessage> {
        let last = self.last_on(&ack.stream, subject).await;
        match last {
            Some(last) if last.sequence == ack.sequence => Some(last),
            _ => self.at_sequence(&ack.stream, ack.sequence).await,
        }
    }

    /// The last message on `subject` in `stream`, if it can be read within a short bound.
    async fn last_on(&self, stream: &str, subject: &str) -> Option<StreamMessage> {
        let stream = self.jetstream().get_stream_no_info(stream).await.ok()?;
        match tokio::time::timeout(
            READ_TIMEOUT,
            stream.direct_get_last_for_subject(subject.to_owned()),
        )
        .await
        {
            Ok(Ok(last)) => Some(last),
            Ok(Err(e)) => {
                debug!(error = %e, subject, "the last message on the subject could not be read");
                None
            }
            Err(_) => {
                debug!(subject, "no answer reading the last message on the subject");
                None
            }
        }
    }

    /// The message at `sequence` of `stream`, when this connection may read by sequence and it
    /// answers within a short bound.
    async fn at_sequence(&self, stream: &str, sequence: u64) -> Option<StreamMessage> {
        if !self.reads_by_sequence || sequence == 0 {
            return None;
        }
        let stream = self.jetstream().get_stream_no_info(stream).await.ok()?;
        match tokio::time::timeout(READ_TIMEOUT, stream.direct_get(sequence)).await {
            Ok(Ok(message)) => Some(message),
            Ok(Err(e)) => {
                debug!(error = %e, sequence, "the stored message could not be read");
                None
            }
            Err(_) => {
                debug!(sequence, "no answer reading the stored message");
                None
            }
        }
    }

    /// Where this publish's event is proven stored, after a duplicate `ack`: at the acked
    /// sequence when that message is this event, or at the last message on its subject when
    /// that one is (a copy stored under a fresh id by an earlier publish whose id was borrowed).
    async fn proven_stored(&self, ack: &PublishAck, subject: &str, payload: &[u8]) -> Option<u64> {
        let last = self.last_on(&ack.stream, subject).await;
        if let Some(last) = &last
            && is_ours(last, subject, payload)
        {
            return Some(last.sequence);
        }
        if last.is_some_and(|l| l.sequence == ack.sequence) {
            return None;
        }
        self.at_sequence(&ack.stream, ack.sequence)
            .await
            .filter(|stored| is_ours(stored, subject, payload))
            .map(|stored| stored.sequence)
    }

    /// Step two of every publish, after its PubAck: a duplicate is believed only once the
    /// message stored under its id is proven to be this one (see the module docs); otherwise
    /// the message is published again under an id no one can predict, and that PubAck returned.
    pub(crate) async fn unless_shadowed(
        &self,
        subject: String,
        mut headers: HeaderMap,
        payload: Bytes,
        ack: PublishAck,
    ) -> Result<PublishAck, BusError> {
        if !ack.duplicate {
            return Ok(ack);
        }
        if let Some(sequence) = self.proven_stored(&ack, &subject, &payload).await {
            return Ok(PublishAck { sequence, ..ack });
        }
        let given = headers
            .get(MSG_ID_HEADER)
            .map(|v| v.as_str().to_owned())
            .unwrap_or_else(|| msg_id_for(&subject, "-"));
        let fresh = format!("{given}.{}", uuid::Uuid::new_v4().simple());
        warn!(
            %subject,
            stream = %ack.stream,
            stored_sequence = ack.sequence,
            msg_id = %given,
            "the stream holds another message under this publish's message id (or it could not be read): publishing again under an unpredictable id"
        );
        metrics::counter!(
            stagehand_telemetry::names::PUBLISHES_SHADOWED_TOTAL,
            stagehand_telemetry::names::label::STREAM => ack.stream.clone()
        )
        .increment(1);
        headers.insert(MSG_ID_HEADER, fresh.as_str());
        Box::pin(self.publish_prepared(subject, headers, payload)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_ids_are_scoped_by_subject_once() {
        let subject = "stagehand.req.stage.requested.labb";
        assert_eq!(
            msg_id_for(subject, "abc"),
            "stagehand.req.stage.requested.labb:abc"
        );
        let mut headers = HeaderMap::new();
        headers.insert(MSG_ID_HEADER, "abc");
        scope_msg_id(subject, &mut headers);
        scope_msg_id(subject, &mut headers);
        assert_eq!(
            headers.get(MSG_ID_HEADER).map(|v| v.as_str()),
            Some("stagehand.req.stage.requested.labb:abc")
        );
        // The same id on another project's subject is another message id.
        assert_ne!(
            msg_id_for("stagehand.req.stage.requested.demo", "abc"),
            msg_id_for(subject, "abc")
        );
    }
}
