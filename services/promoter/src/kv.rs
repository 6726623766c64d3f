//! What promoter instances agree on through the JetStream KV bucket [`PROMOTER_BUCKET`]
//! (declared in `stagehand-bus` beside the other buckets, [`stagehand_bus::PROMOTER`]): the
//! space reserved on each bounded tier, and who copies which version onto which tier.
//!
//! **Reservations** (`quota.<tier>` or `quota.<tier>.<node>`): one value per tier (per node for
//! a node-local tier) listing every replica placed or being placed there and its bytes. A
//! reservation reads the value, checks the project's quota and the tier's capacity against
//! what is listed and, on a posix tier, the room its filesystem has left ([`FsRoom`], the
//! caller's measure: others share the filesystem; [`admit`] is the rule), and writes it back
//! with a compare-and-set on the revision it read: two requests (in one instance or several)
//! that race both read the same revision, one write wins, the other reads again and sees the
//! first one's bytes. So concurrent requests can never together exceed a quota, and a
//! reservation is one durable, atomic step. Reserving a replica already listed is a no-op (a
//! second request for the same version costs nothing), unless the demoter has marked it
//! `withdrawing`: then the request waits for the removal.
//! A reservation is made only under the copy lease of its prefix (or for a replica already on
//! the tier), which is what lets the reconciler give back one with no live request and no
//! replica without racing a reserve on another instance: it takes the same lease first.
//! The value and its key are defined once, in [`stagehand_bus::placement`], which the demoter
//! uses too: on a shared tier it gives a replica's space back once the folder is gone; on a
//! node-local tier the node's agent does on a `replica.removed` naming the node. The replicas'
//! use records (handed out / withdrawing) live there as well.
//!
//! **Copy leases** (`copy.<hash of tier, node, prefix>`): the instance that creates the key
//! copies the version; the others wait for its `replica.created`. The holder renews the lease
//! while it copies; a lease not renewed for its lifetime belongs to a dead instance and is
//! taken over with a compare-and-set (a lease held by an earlier run of the same instance name
//! at once: instance names are unique among running promoters).

use std::time::Duration;

use async_nats::jetstream::kv;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use stagehand_bus::PROMOTER_BUCKET;
pub use stagehand_bus::placement::{self, Reservations, place};
use time::OffsetDateTime;

/// A KV operation that failed (NATS unreachable, the bucket missing): retryable.
#[derive(Debug, thiserror::Error)]
#[error("promoter bucket {PROMOTER_BUCKET}, key {key}: {detail}")]
pub struct KvError {
    pub key: String,
    pub detail: String,
}

fn from_placement(e: placement::PlacementError) -> KvError {
    KvError {
        key: e.key,
        detail: e.detail,
    }
}

fn kv_err(key: &str, e: impl std::fmt::Display) -> KvError {
    KvError {
        key: key.to_owned(),
        detail: e.to_string(),
    }
}

/// Why space could not be reserved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    Quota {
        used: u64,
        quota: u64,
    },
    Full {
        used: u64,
        capacity: u64,
    },
    /// The filesystem under the tier's root cannot take the copy: the policy would admit it,
    /// but others filled the filesystem (or copies admitted before it will).
    NoRoom(FsRoom),
    /// The demoter is removing the replica at that prefix: its space is given back once the
    /// folder is gone, and only then may a copy reserve it afresh.
    Withdrawing,
}

/// The limits a reservation is checked against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub capacity: u64,
    pub quota: Option<u64>,
    /// The room the filesystem under a posix tier's root has, measured just before the
    /// reservation; `None` when it is not known (an S3 tier, a filesystem that reports no
    /// size, a replica already on the tier), which bounds nothing.
    pub filesystem: Option<FsRoom>,
}

/// What the filesystem under a posix tier's root can take for a new copy, as measured on the
/// host that copies onto it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsRoom {
    /// What an unprivileged writer may still write there
    /// ([`stagehand_mover::PosixTier::available_bytes`]).
    pub available: u64,
    /// Bytes that copies this process admitted onto the tier, queued or running, have still to
    /// write: reserved, yet in no `available` figure. Copies of other instances are not in it;
    /// each counts its own.
    pub unwritten: u64,
}

impl FsRoom {
    /// The largest copy the filesystem can still take.
    pub fn free(&self) -> u64 {
        self.available.saturating_sub(self.unwritten)
    }
}

/// Whether a new reservation of `bytes` for `project` fits beside `reserved`: the project's
/// quota first, then the tier's capacity (both policy), then the filesystem's room.
pub fn admit(
    reserved: &Reservations,
    project: &str,
    bytes: u64,
    limits: Limits,
) -> Result<(), Refused> {
    if let Some(quota) = limits.quota {
        let used = reserved.used_by(project);
        if used.saturating_add(bytes) > quota {
            return Err(Refused::Quota { used, quota });
        }
    }
    if !reserved.fits(bytes, limits.capacity) {
        return Err(Refused::Full {
            used: reserved.total(),
            capacity: limits.capacity,
        });
    }
    if let Some(room) = limits.filesystem
        && bytes > room.free()
    {
        return Err(Refused::NoRoom(room));
    }
    Ok(())
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
        let r = placement::reservations(&self.store, tier, node)
            .await
            .map_err(from_placement)?;
        Ok((r.value.unwrap_or_default(), r.revision))
    }

    /// The bucket, for the records [`placement`] defines.
    pub fn store(&self) -> &kv::Store {
        &self.store
    }

    /// Reserves `bytes` for the replica at `prefix` of `project` on a tier: `Ok(Ok(()))` when
    /// it is reserved (now or before), `Ok(Err(refused))` when the quota, the capacity or the
    /// filesystem does not allow it ([`admit`]). A replica reserved before is not measured
    /// again: its bytes may be on the filesystem already (a copy resumed).
    pub async fn reserve(
        &self,
        tier: &str,
        node: Option<&str>,
        project: &str,
        prefix: &str,
        bytes: u64,
        limits: Limits,
    ) -> Result<Result<(), Refused>, KvError> {
        loop {
            let (mut r, revision) = self.reservations(tier, node).await?;
            if r.withdrawing.contains(prefix) {
                return Ok(Err(Refused::Withdrawing));
            }
            if r.replicas.contains_key(prefix) {
                return Ok(Ok(()));
            }
            if let Err(refused) = admit(&r, project, bytes, limits) {
                return Ok(Err(refused));
            }
            r.replicas.insert(prefix.to_owned(), bytes);
            if placement::write_reservations(&self.store, tier, node, &r, revision)
                .await
                .map_err(from_placement)?
            {
                return Ok(Ok(()));
            }
        }
    }

    /// Gives back the reservation of the replica at `prefix` that a copy made and never
    /// placed (idempotent); one the demoter is removing is left to it.
    pub async fn release(
        &self,
        tier: &str,
        node: Option<&str>,
        prefix: &str,
    ) -> Result<bool, KvError> {
        placement::release_reservation(&self.store, tier, node, prefix)
            .await
            .map_err(from_placement)
    }

    fn lease_key(tier: &str, node: Option<&str>, prefix: &str) -> String {
        format!(
            "copy.{}.{}",
            place(tier, node),
            placement::prefix_hash(prefix)
        )
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

    const MIB: u64 = 1 << 20;

    fn reserved(entries: &[(&str, u64)]) -> Reservations {
        let mut r = Reservations::default();
        for (prefix, bytes) in entries {
            r.replicas.insert((*prefix).to_owned(), *bytes);
        }
        r
    }

    /// A tier whose policy capacity is far beyond its disk: the filesystem's room decides,
    /// less what copies admitted before have still to write; a copy of exactly the room fits.
    #[test]
    fn a_copy_larger_than_the_filesystem_can_take_is_refused_whatever_the_capacity() {
        let r = reserved(&[("lab/a/v1", 3 * MIB)]);
        let limits = |available, unwritten| Limits {
            capacity: 1 << 60,
            quota: None,
            filesystem: Some(FsRoom {
                available,
                unwritten,
            }),
        };
        assert_eq!(admit(&r, "lab", 4 * MIB, limits(4 * MIB, 0)), Ok(()));
        let room = FsRoom {
            available: 4 * MIB - 1,
            unwritten: 0,
        };
        assert_eq!(
            admit(&r, "lab", 4 * MIB, limits(4 * MIB - 1, 0)),
            Err(Refused::NoRoom(room))
        );
        // 8 MiB available, of which a queued copy will write 5: 3 MiB left.
        assert_eq!(admit(&r, "lab", 3 * MIB, limits(8 * MIB, 5 * MIB)), Ok(()));
        assert_eq!(
            admit(&r, "lab", 3 * MIB + 1, limits(8 * MIB, 5 * MIB)),
            Err(Refused::NoRoom(FsRoom {
                available: 8 * MIB,
                unwritten: 5 * MIB
            }))
        );
        // More promised than available (others wrote meanwhile): nothing fits, not even 1 byte.
        assert!(admit(&r, "lab", 1, limits(MIB, 2 * MIB)).is_err());
        // Not measured: the policy alone decides.
        let unmeasured = Limits {
            filesystem: None,
            ..limits(0, 0)
        };
        assert_eq!(admit(&r, "lab", 64 * MIB, unmeasured), Ok(()));
    }

    /// The policy speaks first: a copy over the quota or the capacity is refused for that,
    /// even when the filesystem is full too.
    #[test]
    fn quota_and_capacity_are_checked_before_the_filesystem() {
        let r = reserved(&[("lab/a/v1", 6 * MIB), ("other/b/v1", 2 * MIB)]);
        let full = Some(FsRoom {
            available: 0,
            unwritten: 0,
        });
        let quota = Limits {
            capacity: 1 << 40,
            quota: Some(7 * MIB),
            filesystem: full,
        };
        assert_eq!(
            admit(&r, "lab", 2 * MIB, quota),
            Err(Refused::Quota {
                used: 6 * MIB,
                quota: 7 * MIB
            })
        );
        let capacity = Limits {
            capacity: 9 * MIB,
            quota: None,
            filesystem: full,
        };
        assert_eq!(
            admit(&r, "lab", 2 * MIB, capacity),
            Err(Refused::Full {
                used: 8 * MIB,
                capacity: 9 * MIB
            })
        );
    }
}
