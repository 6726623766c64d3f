//! Claims: at most one instance of a service works on an event at a time, and the first
//! outcome is the one every instance publishes.
//!
//! A shared durable consumer already hands each *message* to one puller, and progress acks
//! keep it from being redelivered elsewhere while the work runs. But two distinct messages can
//! carry the same event (a producer retrying after the duplicate window, or publishing with
//! another `Nats-Msg-Id`), and each instance has its own ledger. So before working (step 3 of
//! the consume loop) a worker claims the key `<service>.<project>.<kind>.<hex(event id)>` in the
//! `stagehand_claims` bucket. Its value is a [`Record`]: a state and the history of failed
//! attempts, so that every instance counts the same attempts toward giving up.
//!
//! - **absent** (or deleted): create it as `held` by this delivery (an atomic put-if-absent);
//! - **free** (a retryable failure released it): take it with a compare-and-set, keeping the
//!   attempt history;
//! - **held** by this instance in an earlier life (same instance id, another boot): its owner
//!   was this very service, restarted — take it over at once, so that a restart costs at most
//!   one AckWait;
//! - **held** by another instance, written longer ago than the claim lifetime *by the
//!   server's clock* (the entry's timestamp against the timestamp of a write this instance
//!   just made, both stamped by the server): its owner died; take it over with a
//!   compare-and-set on the revision;
//! - **held for another message** (another stream sequence: a duplicate copy of the event),
//!   and not expired: [`Claim::InFlightElsewhere`]. That message is in a worker's hands and JetStream keeps
//!   redelivering it until it is acked or dead-lettered, so the event will get its outcome
//!   without this copy, which the runtime acks;
//! - **held for this message** by a live owner (the server redelivered it while its owner was
//!   cut off, or the owner died and its claim has not expired): [`Claim::HeldElsewhere`] with
//!   the claim's remaining lifetime, which the runtime waits out without counting an attempt;
//! - **done**: another delivery finished the event; the record carries the facts it recorded
//!   (the first outcome), which the runtime republishes — never facts of its own. An outcome
//!   too large for one record (the bucket's messages share the server's `max_payload`) is
//!   written first as parts beside the claim, under `<claim key>.o.<digest>.<n>`, and the `done`
//!   record names their digest and count: every instance can still publish it, byte for byte.
//!
//! The owner renews the claim (compare-and-set on the revision it owns) with every progress
//! ack; a renewal that finds another revision means the claim was lost, and the work is
//! aborted unrecorded. Committing the outcome (step 5) is one more compare-and-set from the
//! owned revision to `done` with the facts: the commit point, before anything is recorded in
//! the ledger or published. A retryable failure sets the claim `free` with the history; a
//! dead letter deletes it, so that a replayed copy is worked on afresh.

use std::collections::HashMap;
use std::time::Duration;

use async_nats::jetstream::kv;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use stagehand_schemas::{Attempt, EventId};
use time::OffsetDateTime;
use tokio::sync::Mutex;

use crate::bus::{Bus, CLAIMS_BUCKET};
use crate::error::{BusError, BusErrorKind};

/// What a claim says, as stored in the bucket (MessagePack with field names).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Record {
    #[serde(flatten)]
    pub state: State,
    /// Failed attempts so far, oldest first, by whichever instance made them.
    #[serde(default)]
    pub attempts: Vec<Attempt>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub(crate) enum State {
    /// Being worked on by the delivery of `sequence` in instance `instance`, boot `boot`,
    /// which renews it well within `lifetime_ms` (its own claim lifetime: every reader judges
    /// the claim by the holder's promise, not by its own configuration).
    Held {
        instance: String,
        boot: String,
        sequence: u64,
        #[serde(default)]
        lifetime_ms: Option<u64>,
    },
    /// Released after a retryable failure: anyone may claim it.
    Free,
    /// Finished; `facts` are the outcome's facts as recorded, wire-encoded, or `parts` says
    /// where they are kept when they were too large for one record. Neither: a marker written
    /// by an older runtime.
    Done {
        #[serde(default)]
        facts: Option<Vec<serde_bytes::ByteBuf>>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        parts: Option<Parts>,
    },
}

/// Where a `done` record's outcome is kept when it is too large for the record itself: `count`
/// entries beside the claim, each a list of wire-encoded facts, which together hash to `digest`
/// ([`outcome_digest`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Parts {
    pub digest: String,
    pub count: u32,
}

/// The digest naming an outcome kept in parts: a hash of its facts, each length-prefixed, so
/// that two different outcomes never share part keys and a reader can tell a complete one.
fn outcome_digest(facts: &[Vec<u8>]) -> String {
    let slices: Vec<&[u8]> = facts.iter().map(Vec::as_slice).collect();
    EventId::for_content(&slices).as_str().to_owned()
}

/// Splits `facts` into runs of at most `limit` bytes each (a fact larger than `limit` alone).
fn split_facts(facts: &[Vec<u8>], limit: usize) -> Vec<&[Vec<u8>]> {
    let mut runs = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, fact) in facts.iter().enumerate() {
        if i > start && bytes + fact.len() > limit {
            runs.push(&facts[start..i]);
            (start, bytes) = (i, 0);
        }
        bytes += fact.len();
    }
    if start < facts.len() {
        runs.push(&facts[start..]);
    }
    runs
}

/// A claim this delivery owns.
#[derive(Debug, Clone)]
pub struct Lease {
    key: String,
    revision: u64,
    sequence: u64,
    /// The attempt history the claim carried when it was taken.
    pub attempts: Vec<Attempt>,
}

/// Result of trying to claim an event.
#[derive(Debug)]
pub enum Claim {
    /// Ours.
    Owned(Lease),
    /// Another owner holds it for this very message; it cannot be taken before `remaining`
    /// has passed.
    HeldElsewhere { remaining: Duration },
    /// Another message carrying the same event is being worked on: this copy is redundant.
    InFlightElsewhere,
    /// Finished by some delivery: the facts it recorded, if the claim carries them.
    Done(Option<Vec<Vec<u8>>>),
}

/// Result of committing an outcome.
#[derive(Debug)]
pub enum Commit {
    /// Our facts are the outcome.
    Ours,
    /// Another delivery committed first: publish these facts instead of ours.
    Theirs(Option<Vec<Vec<u8>>>),
}

/// Why an owned claim could not be renewed or committed.
#[derive(Debug)]
pub enum LeaseError {
    /// Someone else holds it now: abort the work, record nothing.
    Lost,
    /// The bucket could not be reached; the claim may or may not still be ours.
    Unavailable(BusError),
}

/// The claims of one service instance (see the module's documentation). Besides the
/// consumers' runtime, a service's own background duty (the demoter's scrub) claims its units
/// of work here, under a service name of its own (`demoter.scrub`), so that instances share
/// them and a restarted instance takes its earlier life's claims over at once.
#[derive(Clone)]
pub struct Claims {
    store: kv::Store,
    service: String,
    instance: String,
    boot: String,
    lifetime: Duration,
    /// Largest facts payload kept in a `done` record: the bucket's messages share the
    /// server's `max_payload`.
    max_facts_bytes: usize,
    /// The key this instance registers itself under, and the revision it last wrote: the
    /// server-clock probe, and how a second process with the same instance id is noticed.
    registration: std::sync::Arc<Mutex<u64>>,
    /// Deliveries this process is working on, by stream sequence (a count: the server may
    /// redeliver a message whose first delivery is still being worked on).
    working: std::sync::Arc<std::sync::Mutex<HashMap<u64, usize>>>,
}

/// A delivery this process is working on, from its pull until it is acked, retried or
/// dead-lettered; see [`Claims::working_on`].
pub(crate) struct Working {
    sequence: u64,
    working: std::sync::Arc<std::sync::Mutex<HashMap<u64, usize>>>,
}

impl Drop for Working {
    fn drop(&mut self) {
        let mut w = self
            .working
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(n) = w.get_mut(&self.sequence) {
            *n -= 1;
            if *n == 0 {
                w.remove(&self.sequence);
            }
        }
    }
}

fn kv_err(what: impl Into<String>, e: impl std::error::Error + Send + Sync + 'static) -> BusError {
    BusError::with_source(BusErrorKind::Claim, what, e)
}

/// Room left in a message for headers and the record's other fields.
const RECORD_HEADROOM: usize = 16 * 1024;

impl Claims {
    /// Opens the bucket and registers `instance` (boot `boot`) for `service`.
    pub async fn open(
        bus: &Bus,
        service: &str,
        instance: &str,
        lifetime: Duration,
    ) -> Result<Claims, BusError> {
        let store = bus
            .jetstream()
            .get_key_value(CLAIMS_BUCKET)
            .await
            .map_err(|e| {
                kv_err(
                    format!("opening bucket {CLAIMS_BUCKET} (run provision first)"),
                    e,
                )
            })?;
        let max_payload = bus.client().server_info().max_payload;
        let claims = Claims {
            store,
            service: service.to_owned(),
            instance: instance.to_owned(),
            boot: uuid::Uuid::new_v4().simple().to_string(),
            lifetime,
            max_facts_bytes: max_payload.saturating_sub(RECORD_HEADROOM),
            registration: std::sync::Arc::new(Mutex::new(0)),
            working: std::sync::Arc::default(),
        };
        let rev = claims
            .store
            .put(claims.registration_key(), claims.boot.clone().into())
            .await
            .map_err(|e| kv_err("registering the instance", e))?;
        *claims.registration.lock().await = rev;
        Ok(claims)
    }

    /// Notes that this process works on the delivery of `sequence` until the guard drops.
    pub(crate) fn working_on(&self, sequence: u64) -> Working {
        *self
            .working
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(sequence)
            .or_insert(0) += 1;
        Working {
            sequence,
            working: self.working.clone(),
        }
    }

    /// How many deliveries of `sequence` this process is working on.
    fn deliveries_in_hand(&self, sequence: u64) -> usize {
        self.working
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&sequence)
            .copied()
            .unwrap_or(0)
    }

    /// Key of an event's claim. Hex keeps every id a valid key (ids may hold ':' and '..');
    /// the project token and the kind (`stage.requested`) are valid tokens already. The kind is
    /// part of it so that an event of one kind never holds or finishes another kind's claim.
    fn key(&self, project: &str, kind: &str, id: &EventId) -> String {
        format!(
            "{}.{project}.{kind}.{}",
            self.service,
            hex::encode(id.as_str())
        )
    }

    fn registration_key(&self) -> String {
        format!(
            "{}._instances.{}",
            self.service,
            hex::encode(self.instance.as_bytes())
        )
    }

    /// A `held` record for this delivery.
    fn held(&self, sequence: u64, attempts: &[Attempt]) -> Result<Bytes, BusError> {
        encode_held(
            &self.instance,
            &self.boot,
            sequence,
            self.lifetime,
            attempts,
        )
    }

    /// The server's clock now: the timestamp the server gives a write this instance makes
    /// (its registration), so that claim ages compare two server timestamps. Also notices a
    /// second process registered under this instance id.
    pub async fn server_now(&self) -> Result<OffsetDateTime, BusError> {
        let key = self.registration_key();
        let mut rev = self.registration.lock().await;
        let mut tries = 0;
        loop {
            tries += 1;
            match self
                .store
                .update(&key, self.boot.clone().into(), *rev)
                .await
            {
                Ok(new) => {
                    *rev = new;
                    return self.server_now_at(&key, new).await;
                }
                Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision && tries < 3 => {
                    // Either another process wrote it, or an earlier write of ours went
                    // through although its answer was lost: the value says which.
                    let entry = self
                        .store
                        .entry(&key)
                        .await
                        .map_err(|e| kv_err("reading the instance registration", e))?;
                    match entry {
                        Some(e) if e.value.as_ref() == self.boot.as_bytes() => *rev = e.revision,
                        _ => {
                            return Err(BusError::new(
                                BusErrorKind::InstanceTaken,
                                format!(
                                    "another process registered instance id {:?} of service {}; give every instance its own `instance_id`",
                                    self.instance, self.service
                                ),
                            ));
                        }
                    }
                }
                Err(e) => return Err(kv_err("probing the server clock", e)),
            }
        }
    }

    /// The timestamp of the registration written at revision `rev` (or of a later write of
    /// the key, which is later still). Read as the key's last entry: that direct get is what
    /// `deploy/nats/accounts.conf` grants a service on its own keys, reads by revision are not.
    async fn server_now_at(&self, key: &str, rev: u64) -> Result<OffsetDateTime, BusError> {
        let entry = self
            .store
            .entry(key)
            .await
            .map_err(|e| kv_err("probing the server clock", e))?
            .filter(|e| e.revision >= rev)
            .ok_or_else(|| BusError::new(BusErrorKind::Claim, "the server-clock probe vanished"))?;
        Ok(entry.created)
    }

    pub async fn claim(
        &self,
        project: &str,
        kind: &str,
        id: &EventId,
        sequence: u64,
    ) -> Result<Claim, BusError> {
        let key = self.key(project, kind, id);
        match self.store.create(&key, self.held(sequence, &[])?).await {
            Ok(revision) => {
                return Ok(Claim::Owned(Lease {
                    key,
                    revision,
                    sequence,
                    attempts: Vec::new(),
                }));
            }
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {}
            Err(e) => return Err(kv_err(format!("claiming {key}"), e)),
        }
        let entry = self
            .store
            .entry(&key)
            .await
            .map_err(|e| kv_err(format!("reading claim {key}"), e))?;
        let Some(entry) = entry.filter(|e| matches!(e.operation, kv::Operation::Put)) else {
            // Deleted or expired between the two calls: someone else is creating it now.
            return Ok(Claim::HeldElsewhere {
                remaining: Duration::ZERO,
            });
        };
        let record = decode(&entry.value);
        match record.state {
            State::Done { facts, parts } => {
                Ok(Claim::Done(self.outcome(&key, facts, parts).await?))
            }
            State::Free => {
                self.take(&key, entry.revision, sequence, record.attempts)
                    .await
            }
            State::Held {
                instance,
                boot,
                sequence: held_for,
                lifetime_ms,
            } => {
                let mine = instance == self.instance;
                if mine && boot != self.boot {
                    // This instance's earlier life held it: nobody else can be working on it.
                    return self
                        .take(&key, entry.revision, sequence, record.attempts)
                        .await;
                }
                if mine && held_for == sequence {
                    if self.deliveries_in_hand(sequence) > 1 {
                        // This very message is already being worked on in this process (the
                        // server redelivered it while its first delivery still runs).
                        return Ok(Claim::HeldElsewhere {
                            remaining: self.lifetime,
                        });
                    }
                    // A delivery of this process left the claim behind (releasing it failed):
                    // nobody is working on it.
                    return self
                        .take(&key, entry.revision, sequence, record.attempts)
                        .await;
                }
                let age = self.server_now().await? - entry.created;
                let promised = lifetime_ms.map_or(self.lifetime, Duration::from_millis);
                let lifetime = time::Duration::try_from(promised).unwrap_or(time::Duration::MAX);
                if age > lifetime {
                    return self
                        .take(&key, entry.revision, sequence, record.attempts)
                        .await;
                }
                if held_for != sequence && held_for != 0 {
                    // A copy, and the claim is live: the message it was taken for is pending in
                    // the same consumer, in a worker's hands or due for redelivery, and ends
                    // acked or dead-lettered like any other. (0: a holder written by an older
                    // runtime, whose message is unknown.)
                    return Ok(Claim::InFlightElsewhere);
                }
                let remaining = Duration::try_from(lifetime - age).unwrap_or(Duration::ZERO);
                Ok(Claim::HeldElsewhere { remaining })
            }
        }
    }

    /// Takes a free, dead or own-earlier-life claim with a compare-and-set on `revision`.
    async fn take(
        &self,
        key: &str,
        revision: u64,
        sequence: u64,
        attempts: Vec<Attempt>,
    ) -> Result<Claim, BusError> {
        match self
            .store
            .update(key, self.held(sequence, &attempts)?, revision)
            .await
        {
            Ok(revision) => Ok(Claim::Owned(Lease {
                key: key.to_owned(),
                revision,
                sequence,
                attempts,
            })),
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => {
                // Someone else won the compare-and-set and holds it now.
                Ok(Claim::HeldElsewhere {
                    remaining: self.lifetime,
                })
            }
            Err(e) => Err(kv_err(format!("taking claim {key}"), e)),
        }
    }

    /// Refreshes an owned claim, so that it is not taken for stale.
    pub async fn renew(&self, lease: &mut Lease) -> Result<(), LeaseError> {
        let value = self
            .held(lease.sequence, &lease.attempts)
            .map_err(LeaseError::Unavailable)?;
        match self.store.update(&lease.key, value, lease.revision).await {
            Ok(revision) => {
                lease.revision = revision;
                Ok(())
            }
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => {
                // An earlier renewal of ours may have gone through with its answer lost (a
                // failover): then the claim is still ours, at a newer revision.
                match self.still_ours(lease).await? {
                    Some(revision) => {
                        lease.revision = revision;
                        Ok(())
                    }
                    None => Err(LeaseError::Lost),
                }
            }
            Err(e) => Err(LeaseError::Unavailable(kv_err(
                format!("renewing claim {}", lease.key),
                e,
            ))),
        }
    }

    /// The claim's current revision if it is still held by this very delivery.
    async fn still_ours(&self, lease: &Lease) -> Result<Option<u64>, LeaseError> {
        let entry = self.store.entry(&lease.key).await.map_err(|e| {
            LeaseError::Unavailable(kv_err(format!("reading claim {}", lease.key), e))
        })?;
        Ok(entry.and_then(|e| match decode(&e.value).state {
            State::Held {
                instance,
                boot,
                sequence,
                ..
            } if instance == self.instance && boot == self.boot && sequence == lease.sequence => {
                Some(e.revision)
            }
            _ => None,
        }))
    }

    /// Commits the outcome: compare-and-set from the owned revision to `done` with `facts`.
    /// When another delivery committed first, returns its facts.
    pub async fn commit(&self, lease: &Lease, facts: &[Vec<u8>]) -> Result<Commit, LeaseError> {
        let size: usize = facts.iter().map(Vec::len).sum();
        let fits = size <= self.max_facts_bytes;
        let carried: Option<Vec<&serde_bytes::Bytes>> =
            fits.then(|| facts.iter().map(|f| serde_bytes::Bytes::new(f)).collect());
        let parts = if fits {
            None
        } else {
            Some(
                self.put_parts(&lease.key, facts)
                    .await
                    .map_err(LeaseError::Unavailable)?,
            )
        };
        // The `done` record, encoded from borrowed facts: the same map a [`Record`] reads.
        #[derive(Serialize)]
        struct DoneRecord<'a> {
            state: &'static str,
            facts: Option<Vec<&'a serde_bytes::Bytes>>,
            #[serde(skip_serializing_if = "Option::is_none")]
            parts: Option<Parts>,
        }
        let value = rmp_serde::to_vec_named(&DoneRecord {
            state: "done",
            facts: carried,
            parts,
        })
        .map(Bytes::from)
        .map_err(|e| {
            LeaseError::Unavailable(BusError::with_source(
                BusErrorKind::Encode,
                "encoding a claim",
                e,
            ))
        })?;
        let mut revision = lease.revision;
        let mut tries = 0;
        loop {
            tries += 1;
            match self.store.update(&lease.key, value.clone(), revision).await {
                Ok(_) => return Ok(Commit::Ours),
                Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => {
                    let entry = self.store.entry(&lease.key).await.map_err(|e| {
                        LeaseError::Unavailable(kv_err(format!("reading claim {}", lease.key), e))
                    })?;
                    let Some(entry) = entry else {
                        return Err(LeaseError::Lost);
                    };
                    match decode(&entry.value).state {
                        // Someone's commit, or our own whose answer was lost: the facts in the
                        // claim are the outcome either way.
                        State::Done { facts, parts } => {
                            let facts = self
                                .outcome(&lease.key, facts, parts)
                                .await
                                .map_err(LeaseError::Unavailable)?;
                            return Ok(Commit::Theirs(facts));
                        }
                        // Still ours at a newer revision (a renewal's answer was lost).
                        State::Held {
                            instance,
                            boot,
                            sequence,
                            ..
                        } if instance == self.instance
                            && boot == self.boot
                            && sequence == lease.sequence
                            && tries < 3 =>
                        {
                            revision = entry.revision;
                        }
                        _ => return Err(LeaseError::Lost),
                    }
                }
                Err(e) => {
                    return Err(LeaseError::Unavailable(kv_err(
                        format!("committing claim {}", lease.key),
                        e,
                    )));
                }
            }
        }
    }

    /// Key of part `n` of the outcome with `digest`, kept beside the claim `key` (and so under
    /// the service's own keys, which are all its NATS user may touch).
    fn part_key(key: &str, digest: &str, n: u32) -> String {
        format!("{key}.o.{digest}.{n}")
    }

    /// Writes an outcome too large for one record as parts beside its claim, before the
    /// `done` record that names them: a reader that finds the record finds its parts. Keys are
    /// named by the outcome's digest, so a racing delivery with another outcome never
    /// overwrites these; both expire with the bucket's `max_age`, like the claim.
    async fn put_parts(&self, key: &str, facts: &[Vec<u8>]) -> Result<Parts, BusError> {
        let digest = outcome_digest(facts);
        let runs = split_facts(facts, self.max_facts_bytes);
        let count = u32::try_from(runs.len())
            .map_err(|_| BusError::new(BusErrorKind::Encode, "an outcome of too many parts"))?;
        for (n, run) in (0..count).zip(runs) {
            let run: Vec<&serde_bytes::Bytes> =
                run.iter().map(|f| serde_bytes::Bytes::new(f)).collect();
            let value = rmp_serde::to_vec_named(&run).map_err(|e| {
                BusError::with_source(BusErrorKind::Encode, "encoding an outcome part", e)
            })?;
            let part = Self::part_key(key, &digest, n);
            self.store
                .put(&part, value.into())
                .await
                .map_err(|e| kv_err(format!("writing outcome part {part}"), e))?;
        }
        tracing::debug!(
            bytes = facts.iter().map(Vec::len).sum::<usize>(),
            parts = count,
            "outcome too large for one claim record; kept in parts beside it"
        );
        Ok(Parts { digest, count })
    }

    /// The facts of a `done` record: carried in it, or read back from its parts and checked
    /// against their digest. `None` only for an older runtime's marker.
    async fn outcome(
        &self,
        key: &str,
        facts: Option<Vec<serde_bytes::ByteBuf>>,
        parts: Option<Parts>,
    ) -> Result<Option<Vec<Vec<u8>>>, BusError> {
        if let Some(facts) = facts {
            return Ok(Some(
                facts
                    .into_iter()
                    .map(serde_bytes::ByteBuf::into_vec)
                    .collect(),
            ));
        }
        let Some(parts) = parts else {
            return Ok(None);
        };
        let mut out = Vec::new();
        for n in 0..parts.count {
            let part = Self::part_key(key, &parts.digest, n);
            let value = self
                .store
                .get(&part)
                .await
                .map_err(|e| kv_err(format!("reading outcome part {part}"), e))?
                .ok_or_else(|| {
                    BusError::new(
                        BusErrorKind::Claim,
                        format!("outcome part {part} of a finished claim is missing"),
                    )
                })?;
            let run: Vec<serde_bytes::ByteBuf> = rmp_serde::from_slice(&value).map_err(|e| {
                BusError::with_source(
                    BusErrorKind::Claim,
                    format!("decoding outcome part {part}"),
                    e,
                )
            })?;
            out.extend(run.into_iter().map(serde_bytes::ByteBuf::into_vec));
        }
        if outcome_digest(&out) != parts.digest {
            return Err(BusError::new(
                BusErrorKind::Claim,
                format!(
                    "the outcome parts of claim {key} do not hash to {}",
                    parts.digest
                ),
            ));
        }
        Ok(Some(out))
    }

    /// Gives the claim up after a retryable failure, leaving the attempt history in it.
    pub async fn release(&self, lease: &Lease, attempts: Vec<Attempt>) -> Result<(), BusError> {
        let value = encode(&Record {
            state: State::Free,
            attempts,
        })?;
        self.store
            .update(&lease.key, value, lease.revision)
            .await
            .map(drop)
            .map_err(|e| kv_err(format!("releasing claim {}", lease.key), e))
    }

    /// Removes the claim after a dead letter, history and all: a replayed copy starts afresh.
    pub async fn forget(&self, lease: &Lease) -> Result<(), BusError> {
        self.store
            .delete_expect_revision(&lease.key, Some(lease.revision))
            .await
            .map_err(|e| kv_err(format!("removing claim {}", lease.key), e))
    }

    /// Takes over a claim whatever its state, for a replayed message that must not be
    /// answered by a `done` marker an older runtime wrote for a dead letter.
    pub async fn take_for_replay(
        &self,
        project: &str,
        kind: &str,
        id: &EventId,
        sequence: u64,
    ) -> Result<Claim, BusError> {
        let key = self.key(project, kind, id);
        let entry = self
            .store
            .entry(&key)
            .await
            .map_err(|e| kv_err(format!("reading claim {key}"), e))?;
        match entry {
            Some(e) if matches!(e.operation, kv::Operation::Put) => {
                self.take(&key, e.revision, sequence, Vec::new()).await
            }
            _ => self.claim(project, kind, id, sequence).await,
        }
    }
}

/// Encodes a `held` record from borrowed fields — the same map a [`Record`] reads. Every
/// message's claim writes one, and `flatten` is slow to write.
fn encode_held(
    instance: &str,
    boot: &str,
    sequence: u64,
    lifetime: Duration,
    attempts: &[Attempt],
) -> Result<Bytes, BusError> {
    #[derive(Serialize)]
    struct HeldRecord<'a> {
        state: &'static str,
        instance: &'a str,
        boot: &'a str,
        sequence: u64,
        lifetime_ms: u64,
        attempts: &'a [Attempt],
    }
    rmp_serde::to_vec_named(&HeldRecord {
        state: "held",
        instance,
        boot,
        sequence,
        lifetime_ms: u64::try_from(lifetime.as_millis()).unwrap_or(u64::MAX),
        attempts,
    })
    .map(Bytes::from)
    .map_err(|e| BusError::with_source(BusErrorKind::Encode, "encoding a claim", e))
}

fn encode(record: &Record) -> Result<Bytes, BusError> {
    rmp_serde::to_vec_named(record)
        .map(Bytes::from)
        .map_err(|e| BusError::with_source(BusErrorKind::Encode, "encoding a claim", e))
}

/// Decodes a claim's value. Values an older runtime wrote (`done`, or an owner token) read as
/// `done` without facts and as held by an unknown instance.
fn decode(value: &[u8]) -> Record {
    match rmp_serde::from_slice::<Record>(value) {
        Ok(r) => r,
        Err(_) if value == b"done" => Record {
            state: State::Done {
                facts: None,
                parts: None,
            },
            attempts: Vec::new(),
        },
        Err(_) => Record {
            state: State::Held {
                instance: String::from_utf8_lossy(value).into_owned(),
                boot: String::new(),
                sequence: 0,
                lifetime_ms: None,
            },
            attempts: Vec::new(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_old_markers_still_read() {
        let r = Record {
            state: State::Done {
                facts: Some(vec![serde_bytes::ByteBuf::from(vec![1, 2, 3])]),
                parts: None,
            },
            attempts: vec![],
        };
        assert_eq!(decode(&encode(&r).unwrap()), r);
        assert_eq!(
            decode(b"done").state,
            State::Done {
                facts: None,
                parts: None
            }
        );
        #[derive(Serialize)]
        struct DoneRecord<'a> {
            state: &'static str,
            facts: Option<Vec<&'a serde_bytes::Bytes>>,
        }
        let borrowed = rmp_serde::to_vec_named(&DoneRecord {
            state: "done",
            facts: Some(vec![serde_bytes::Bytes::new(&[1, 2, 3])]),
        })
        .unwrap();
        assert_eq!(
            decode(&borrowed),
            r,
            "what commit writes is what claim reads"
        );
        assert!(matches!(
            decode(b"svc:abc:17").state,
            State::Held { ref instance, .. } if instance == "svc:abc:17"
        ));
    }

    #[test]
    fn an_outcome_splits_into_runs_under_the_limit_in_order() {
        let facts: Vec<Vec<u8>> = [400, 400, 400, 10, 900, 5]
            .iter()
            .map(|&n| vec![0u8; n])
            .collect();
        let runs = split_facts(&facts, 850);
        let lens: Vec<Vec<usize>> = runs
            .iter()
            .map(|r| r.iter().map(Vec::len).collect())
            .collect();
        assert_eq!(
            lens,
            vec![vec![400, 400], vec![400, 10], vec![900], vec![5]]
        );
        assert!(split_facts(&[], 10).is_empty());
    }
}
