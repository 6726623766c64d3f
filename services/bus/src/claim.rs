//! Claims: at most one instance of a service works on an event id at a time.
//!
//! A shared durable consumer already hands each *message* to one puller, and progress acks
//! keep it from being redelivered elsewhere while the work runs. But two distinct messages can
//! carry the same event id (a producer retrying after the duplicate window, or publishing with
//! another `Nats-Msg-Id`), and each instance has its own ledger. So before working, a worker
//! creates the key `<service>.<hex(event id)>` in the `stagehand_claims` bucket (an atomic
//! put-if-absent) with its owner token as the value:
//!
//! - created: this worker owns the event; it renews the claim with every progress ack;
//! - held by a live owner: another instance is working on it; retry later (negative ack);
//! - held, but not renewed for longer than the claim lifetime: its owner died; take it over
//!   with a compare-and-set on the revision;
//! - marked `done`: another instance finished it and published its facts; just ack.
//!
//! After the outcome is recorded and the facts are published the claim becomes `done`; after a
//! retryable failure it is deleted so that any instance may retry.

use std::time::Duration;

use async_nats::jetstream::kv;
use bytes::Bytes;
use stagehand_schemas::EventId;

use crate::bus::{Bus, CLAIMS_BUCKET};
use crate::error::BusError;

const DONE: &str = "done";

/// Result of trying to claim an event id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Claim {
    /// Ours, at this revision.
    Owned(u64),
    /// Another live instance is working on it.
    HeldElsewhere,
    /// Another instance finished it and published its facts.
    Done,
}

#[derive(Clone)]
pub(crate) struct Claims {
    store: kv::Store,
    service: String,
    owner: String,
    lifetime: Duration,
}

fn claim_err(e: impl std::fmt::Display) -> BusError {
    BusError::Claim(e.to_string())
}

impl Claims {
    pub async fn open(
        bus: &Bus,
        service: &str,
        owner: String,
        lifetime: Duration,
    ) -> Result<Claims, BusError> {
        let store = bus
            .jetstream()
            .get_key_value(CLAIMS_BUCKET)
            .await
            .map_err(|e| claim_err(format!("bucket {CLAIMS_BUCKET} (run provision first): {e}")))?;
        Ok(Claims {
            store,
            service: service.to_owned(),
            owner,
            lifetime,
        })
    }

    fn key(&self, id: &EventId) -> String {
        // Hex keeps every id a valid KV key (ids may hold ':' and '..').
        format!("{}.{}", self.service, hex::encode(id.as_str()))
    }

    /// The owner token of one delivery: this instance and the message's stream sequence, so
    /// that two copies of an event in flight in the same instance also exclude each other.
    fn token(&self, stream_sequence: u64) -> Bytes {
        Bytes::from(format!("{}:{stream_sequence}", self.owner))
    }

    pub async fn claim(&self, id: &EventId, stream_sequence: u64) -> Result<Claim, BusError> {
        let key = self.key(id);
        let token = self.token(stream_sequence);
        match self.store.create(&key, token.clone()).await {
            Ok(rev) => return Ok(Claim::Owned(rev)),
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {}
            Err(e) => return Err(claim_err(e)),
        }
        let Some(entry) = self.store.entry(&key).await.map_err(claim_err)? else {
            // Expired or removed between the two calls: try once more.
            return match self.store.create(&key, token).await {
                Ok(rev) => Ok(Claim::Owned(rev)),
                Err(_) => Ok(Claim::HeldElsewhere),
            };
        };
        if !matches!(entry.operation, kv::Operation::Put) {
            return self.take_over(&key, entry.revision, token).await;
        }
        if entry.value.as_ref() == DONE.as_bytes() {
            return Ok(Claim::Done);
        }
        if entry.value == token {
            return Ok(Claim::Owned(entry.revision));
        }
        let age = time::OffsetDateTime::now_utc() - entry.created;
        if age > self.lifetime {
            return self.take_over(&key, entry.revision, token).await;
        }
        Ok(Claim::HeldElsewhere)
    }

    async fn take_over(&self, key: &str, revision: u64, token: Bytes) -> Result<Claim, BusError> {
        match self.store.update(key, token, revision).await {
            Ok(rev) => Ok(Claim::Owned(rev)),
            // Someone else won the compare-and-set.
            Err(_) => Ok(Claim::HeldElsewhere),
        }
    }

    /// Refreshes an owned claim so that it is not taken for stale; returns the new revision.
    pub async fn renew(
        &self,
        id: &EventId,
        stream_sequence: u64,
        revision: u64,
    ) -> Result<u64, BusError> {
        self.store
            .update(self.key(id), self.token(stream_sequence), revision)
            .await
            .map_err(claim_err)
    }

    /// Marks the event finished: later duplicates on any instance are acked without work.
    pub async fn done(&self, id: &EventId) -> Result<(), BusError> {
        self.store
            .put(self.key(id), Bytes::from_static(DONE.as_bytes()))
            .await
            .map(|_| ())
            .map_err(claim_err)
    }

    /// Gives the claim up after a retryable failure.
    pub async fn release(&self, id: &EventId, revision: u64) -> Result<(), BusError> {
        self.store
            .delete_expect_revision(self.key(id), Some(revision))
            .await
            .map_err(claim_err)
    }
}
