//! What promoter instances agree on through the JetStream KV bucket [`PROMOTER_BUCKET`]
//! (declared in `stagehand-bus` beside the other buckets, [`stagehand_bus::PROMOTER`]): the
//! space reserved on each bounded tier, and who copies which version onto which tier.
//!
//! **Reservations** (`quota.<tier>` or `quota.<tier>.<node>`): one value per tier (per node for
//! a node-local tier) listing every replica placed or being placed there and its bytes. A
//! reservation reads the value, checks the project's quota and the tier's capacity against
//! what is listed, and writes it back with a compare-and-set on the revision it read: two
//! requests (in one instance or several) that race both read the same revision, one write
//! wins, the other reads again and sees the first one's bytes. So concurrent requests can
//! never together exceed a quota, and a reservation is one durable, atomic step. Reserving a
//! replica already listed is a no-op (a second request for the same version costs nothing);
//! `replica.removed` releases it.
//!
//! **Copy leases** (`copy.<hash of tier, node, prefix>`): the instance that creates the key
//! copies the version; the others wait for its `replica.created`. The holder renews the lease
//! while it copies; a lease not renewed for its lifetime belongs to a dead instance and is
//! taken over with a compare-and-set (a lease held by an earlier run of the same instance name
//! at once: instance names are unique among running promoters).

use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::jetstream::kv;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use stagehand_bus::PROMOTER_BUCKET;
use time::OffsetDateTime;

/// A KV operation that failed (NATS unreachable, the bucket missing): retryable.
#[derive(Debug, thiserror::Error)]
#[error("promoter bucket {PROMOTER_BUCKET}, key {key}: {detail}")]
pub struct KvError {
    pub key: String,
    pub detail: String,
}

fn kv_err(key: &str, e: impl std::fmt::Display) -> KvError {
    KvError {
        key: key.to_owned(),
        detail: e.to_string(),
    }
}

/// Every replica reserved on one tier (or one node's local tier): prefix → bytes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reservations {
    pub replicas: BTreeMap<String, u64>,
}

impl Reservations {
    /// Bytes reserved by `project` (replicas under `<project>/`).
    pub fn used_by(&self, project: &str) -> u64 {
        let start = format!("{project}/");
        self.replicas
            .range(start.clone()..)
            .take_while(|(k, _)| k.starts_with(&start))
            .map(|(_, b)| b)
            .sum()
    }

    pub fn total(&self) -> u64 {
        self.replicas.values().sum()
    }
}

/// Why space could not be reserved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    Quota { used: u64, quota: u64 },
    Full { used: u64, capacity: u64 },
}

/// The limits a reservation is checked against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub capacity: u64,
    pub quota: Option<u64>,
}

/// The coordination bucket.
#[derive(Clone)]
pub struct Coordination {
    store: kv::Store,
    /// This instance: the owner written into leases.
    owner: String,
    instance: String,
    lease_lifetime: Duration,
}

impl std::fmt::Debug for Coordination {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coordination")
            .field("owner", &self.owner)
            .finish()
    }
}

/// A copy lease's value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Lease {
    instance: String,
    owner: String,
    request_id: String,
}

/// The outcome of asking for a copy lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseState {
    /// Ours, at this revision.
    Owned(u64),
    /// Another live instance copies it (for this request).
    Held {
        instance: String,
        request_id: String,
    },
}

/// The key token of a tier (and node).
fn place(tier: &str, node: Option<&str>) -> String {
    let token = |s: &str| {
        s.bytes()
            .map(|b| {
                if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' {
                    (b as char).to_string()
                } else {
                    format!("={b:02X}")
                }
            })
            .collect::<String>()
    };
    match node {
        Some(n) => format!("{}.{}", token(tier), token(n)),
        None => token(tier),
    }
}

impl Coordination {
    pub fn new(store: kv::Store, instance: &str, lease_lifetime: Duration) -> Self {
        Coordination {
            store,
            owner: format!("{instance}:{}", uuid_like()),
            instance: instance.to_owned(),
            lease_lifetime,
        }
    }

    pub fn lease_lifetime(&self) -> Duration {
        self.lease_lifetime
    }

    /// Reads the reservations of a tier.
    pub async fn reservations(
        &self,
        tier: &str,
        node: Option<&str>,
    ) -> Result<(Reservations, Option<u64>), KvError> {
        let key = format!("quota.{}", place(tier, node));
        match self.store.entry(&key).await.map_err(|e| kv_err(&key, e))? {
            Some(entry) if matches!(entry.operation, kv::Operation::Put) => {
                let r = serde_json::from_slice(&entry.value).map_err(|e| kv_err(&key, e))?;
                Ok((r, Some(entry.revision)))
            }
            Some(entry) => Ok((Reservations::default(), Some(entry.revision))),
            None => Ok((Reservations::default(), None)),
        }
    }

    async fn write(
        &self,
        key: &str,
        value: &Reservations,
        revision: Option<u64>,
    ) -> Result<bool, KvError> {
        let bytes = Bytes::from(serde_json::to_vec(value).map_err(|e| kv_err(key, e))?);
        let written = match revision {
            None => self
                .store
                .create(key, bytes)
                .await
                .map(|_| ())
                .map_err(|e| {
                    if e.kind() == kv::CreateErrorKind::AlreadyExists {
                        None
                    } else {
                        Some(kv_err(key, e))
                    }
                }),
            Some(rev) => self
                .store
                .update(key, bytes, rev)
                .await
                .map(|_| ())
                .map_err(|e| {
                    if e.kind() == kv::UpdateErrorKind::WrongLastRevision {
                        None
                    } else {
                        Some(kv_err(key, e))
                    }
                }),
        };
        match written {
            Ok(()) => Ok(true),
            // Another writer won the compare-and-set: read again.
            Err(None) => Ok(false),
            Err(Some(e)) => Err(e),
        }
    }

    /// Reserves `bytes` for the replica at `prefix` of `project` on a tier: `Ok(Ok(()))` when
    /// it is reserved (now or before), `Ok(Err(refused))` when the quota or capacity does
    /// not allow it.
    pub async fn reserve(
        &self,
        tier: &str,
        node: Option<&str>,
        project: &str,
        prefix: &str,
        bytes: u64,
        limits: Limits,
    ) -> Result<Result<(), Refused>, KvError> {
        let key = format!("quota.{}", place(tier, node));
        loop {
            let (mut r, revision) = self.reservations(tier, node).await?;
            if r.replicas.contains_key(prefix) {
                return Ok(Ok(()));
            }
            if let Some(quota) = limits.quota {
                let used = r.used_by(project);
                if used.saturating_add(bytes) > quota {
                    return Ok(Err(Refused::Quota { used, quota }));
                }
            }
            let used = r.total();
            if used.saturating_add(bytes) > limits.capacity {
                return Ok(Err(Refused::Full {
                    used,
                    capacity: limits.capacity,
                }));
            }
            r.replicas.insert(prefix.to_owned(), bytes);
            if self.write(&key, &r, revision).await? {
                return Ok(Ok(()));
            }
        }
    }

    /// Releases the reservation of the replica at `prefix` (idempotent).
    pub async fn release(
        &self,
        tier: &str,
        node: Option<&str>,
        prefix: &str,
    ) -> Result<bool, KvError> {
        let key = format!("quota.{}", place(tier, node));
        loop {
            let (mut r, revision) = self.reservations(tier, node).await?;
            if r.replicas.remove(prefix).is_none() {
                return Ok(false);
            }
            if self.write(&key, &r, revision).await? {
                return Ok(true);
            }
        }
    }

    fn lease_key(tier: &str, node: Option<&str>, prefix: &str) -> String {
        let digest = Sha256::digest(prefix.as_bytes());
        format!("copy.{}.{}", place(tier, node), hex::encode(&digest[..16]))
    }

    /// Asks for the lease on copying `prefix` onto a tier for `request_id`.
    pub async fn lease(
        &self,
        tier: &str,
        node: Option<&str>,
        prefix: &str,
        request_id: &str,
    ) -> Result<LeaseState, KvError> {
        let key = Self::lease_key(tier, node, prefix);
        let mine = Lease {
            instance: self.instance.clone(),
            owner: self.owner.clone(),
            request_id: request_id.to_owned(),
        };
        let value = Bytes::from(serde_json::to_vec(&mine).map_err(|e| kv_err(&key, e))?);
        // A lease deleted or taken between two calls: look again (a few times at most).
        for _ in 0..5 {
            match self.store.create(&key, value.clone()).await {
                Ok(rev) => return Ok(LeaseState::Owned(rev)),
                Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {}
                Err(e) => return Err(kv_err(&key, e)),
            }
            let Some(entry) = self.store.entry(&key).await.map_err(|e| kv_err(&key, e))? else {
                continue;
            };
            let held: Option<Lease> = serde_json::from_slice(&entry.value).ok();
            let take = match (&entry.operation, &held) {
                (kv::Operation::Put, Some(h)) => {
                    h.owner == self.owner
                        // An earlier run of this instance is dead: it is this process now.
                        || h.instance == self.instance
                        || OffsetDateTime::now_utc() - entry.created > self.lease_lifetime
                }
                _ => true,
            };
            if !take {
                let held = held.expect("a live lease decodes");
                return Ok(LeaseState::Held {
                    instance: held.instance,
                    request_id: held.request_id,
                });
            }
            if let Ok(rev) = self.store.update(&key, value.clone(), entry.revision).await {
                return Ok(LeaseState::Owned(rev));
            }
        }
        Err(kv_err(
            &key,
            "the copy lease changed hands five times in a row",
        ))
    }

    /// Renews an owned lease; returns its new revision.
    pub async fn renew(
        &self,
        tier: &str,
        node: Option<&str>,
        prefix: &str,
        request_id: &str,
        revision: u64,
    ) -> Result<u64, KvError> {
        let key = Self::lease_key(tier, node, prefix);
        let mine = Lease {
            instance: self.instance.clone(),
            owner: self.owner.clone(),
            request_id: request_id.to_owned(),
        };
        let value = Bytes::from(serde_json::to_vec(&mine).map_err(|e| kv_err(&key, e))?);
        self.store
            .update(&key, value, revision)
            .await
            .map_err(|e| kv_err(&key, e))
    }

    /// Gives an owned lease up (the copy is published, or failed for good).
    pub async fn end_lease(
        &self,
        tier: &str,
        node: Option<&str>,
        prefix: &str,
        revision: u64,
    ) -> Result<(), KvError> {
        let key = Self::lease_key(tier, node, prefix);
        self.store
            .delete_expect_revision(&key, Some(revision))
            .await
            .map_err(|e| kv_err(&key, e))
    }
}

/// A token telling this process's leases from an earlier run's.
fn uuid_like() -> String {
    let mut h = Sha256::new();
    h.update(std::process::id().to_be_bytes());
    h.update(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos()
            .to_be_bytes(),
    );
    hex::encode(&h.finalize()[..8])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_is_counted_per_project_prefix() {
        let mut r = Reservations::default();
        r.replicas.insert("lab-a/cats/v1".into(), 10);
        r.replicas.insert("lab-a/dogs/v2".into(), 5);
        r.replicas.insert("lab-ab/cats/v1".into(), 100);
        assert_eq!(r.used_by("lab-a"), 15);
        assert_eq!(r.used_by("lab-ab"), 100);
        assert_eq!(r.total(), 115);
        assert_eq!(place("local", Some("gpu.07")), "local.gpu=2E07");
    }
}
