//! What the promoters and the demoter agree on about a replica on a shared or node-local tier,
//! through the promoter's bucket [`PROMOTER_BUCKET`]: one definition of the keys and records
//! both services write.
//!
//! **Space** (`quota.<tier>[.<node>]`, [`Reservations`]): every replica placed or being placed
//! on a bounded tier and its bytes. Promoters reserve there. The space of a placed replica is
//! given back ([`release_removed`]) by whoever finishes its removal, after the folder is gone —
//! never when the removal is only announced, so a removal that is undone keeps its space. A
//! removal marks the entry `withdrawing` when it takes the use record ([`begin_withdraw`]) and
//! gives back only a marked entry: a reserve of a marked entry is refused (the request waits
//! for the removal), and a reservation made afresh once the removal is over (a new copy after
//! the use record was forgotten) is never given back by that removal, even when it runs its
//! last step again after a crash. A reserver gives back a reservation it made and never placed
//! ([`release_reservation`]: a failed copy, a request that ended before its copy), never a
//! marked one.
//!
//! **Use** (`replica.<tier>[.<node>].<hash of prefix>`, [`ReplicaUse`]): whether the replica
//! may be handed to a job, and the requests it was last handed to. A promoter answers a
//! request "ready" from a replica only after [`serve`] bumped the record with a
//! compare-and-set, and never while it is [`UseState::Withdrawing`]. The demoter takes the
//! record into `withdrawing` with a compare-and-set on the revision it read *before* it looked
//! at the replica's holds ([`begin_withdraw`]): a request served in between moved the revision,
//! the demoter's write fails, and it backs off. Once it holds the record no promoter hands the
//! replica out, so the readiness can be withdrawn and the folder renamed away with no job told
//! it is ready meanwhile; an undone removal gives the record back ([`end_withdraw`]), a finished
//! one deletes it ([`forget_use`]) after the folder and its space are gone, and a request that
//! found it withdrawing stages afresh.
//!
//! **Fingerprint** (`replica.<tier>[.<node>].<hash of prefix>.fingerprint`, and its chunks
//! `….fingerprint.<n>`): the encoded metadata of every file of the replica as it was published
//! (`stagehand_mover::Fingerprint`), which whoever hands the replica out again — any promoter
//! instance sharing the tier, a node agent on its own local tier, a restore — compares before
//! answering ready. Kept here rather than in a promoter's own state (one per instance) or on the
//! tier (where a job could change it with the data): every instance and the demoter read this
//! bucket, and no job's user may write it. Written after the set is published ([`put_fingerprint`]),
//! replaced by the next publish of the same replica, and deleted with its use record
//! ([`forget_use`]). A head missing, or chunks that do not hash to what the head says, is an
//! unknown fingerprint ([`fingerprint`] answers `None`): the replica is then verified by hash.
//!
//! **Liveness** (`node.<node>`, [`NodeLiveness`]): the agent of a node (the promoter run with
//! `node`) rewrites it every beat ([`beat`]); the demoter reads it ([`liveness`]) and, when the
//! node has been silent longer than the policy allows ([`NodeLiveness::silent`]), marks the
//! node's local copies unreachable. It is judged by the time the server stored the record, not
//! by the time the node wrote in it, so a node's clock cannot make it look alive. Only the
//! promoter's user writes the bucket; the demoter's may read these keys, never write them.

use std::collections::{BTreeMap, BTreeSet};

use async_nats::jetstream::kv;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::PROMOTER_BUCKET;

/// How many of the latest served request ids a [`ReplicaUse`] keeps: the requests whose holds
/// the catalogue may not have folded yet when the demoter looks (older ones it has).
pub const SERVED_KEPT: usize = 16;

/// A read or write of the bucket that failed (NATS unreachable, the bucket missing, a value
/// that does not decode): retryable.
#[derive(Debug, thiserror::Error)]
#[error("bucket {PROMOTER_BUCKET}, key {key}: {detail}")]
pub struct PlacementError {
    pub key: String,
    pub detail: String,
}

fn err(key: &str, e: impl std::fmt::Display) -> PlacementError {
    PlacementError {
        key: key.to_owned(),
        detail: e.to_string(),
    }
}

/// The key token of a tier (and node): characters outside `[A-Za-z0-9_-]` as `=XX`.
pub fn place(tier: &str, node: Option<&str>) -> String {
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

/// The hash of a replica's prefix that keys it (prefixes are not key tokens).
pub fn prefix_hash(prefix: &str) -> String {
    let digest = Sha256::digest(prefix.as_bytes());
    hex::encode(&digest[..16])
}

/// The reservations key of a tier (or one node's local tier).
pub fn quota_key(tier: &str, node: Option<&str>) -> String {
    format!("quota.{}", place(tier, node))
}

/// The use record's key of the replica at `prefix` on a tier.
pub fn use_key(tier: &str, node: Option<&str>, prefix: &str) -> String {
    format!("replica.{}.{}", place(tier, node), prefix_hash(prefix))
}

/// Every replica reserved on one tier (or one node's local tier): prefix → bytes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reservations {
    pub replicas: BTreeMap<String, u64>,
    /// The replicas listed whose removal has begun ([`begin_withdraw`]): their space comes back
    /// through [`release_removed`] only, and a reserve of one is refused until then.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub withdrawing: BTreeSet<String>,
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

    /// The projects with a replica reserved (the first part of each key, `<project>/...`),
    /// each once, in order.
    pub fn projects(&self) -> impl Iterator<Item = &str> {
        let mut last = None;
        (self.replicas.keys())
            .filter_map(|k| k.split_once('/').map(|(p, _)| p))
            .filter(move |p| last.replace(*p) != Some(*p))
    }

    /// Bytes reserved on the tier: every replica listed, held by a live stage or not (an
    /// unheld one stays listed until the demoter removes it).
    pub fn total(&self) -> u64 {
        self.replicas.values().sum()
    }

    /// Whether a new replica of `bytes` fits beside everything listed on a tier of `capacity`:
    /// the rule the promoter reserves by (`hot is full` when it does not).
    pub fn fits(&self, bytes: u64, capacity: u64) -> bool {
        self.total().saturating_add(bytes) <= capacity
    }

    /// The bytes a new replica may still take on a tier of `capacity`: the largest size
    /// [`Reservations::fits`] admits (none on a tier listed over its capacity).
    pub fn free(&self, capacity: u64) -> u64 {
        capacity.saturating_sub(self.total())
    }
}

/// Whether a replica may be handed to a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum UseState {
    /// Handed out on request.
    Serving,
    /// Being removed by the demoter: handed to no one until the record is gone or given back.
    Withdrawing,
}

/// The use record of one replica.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaUse {
    pub state: UseState,
    /// The latest requests answered from it (at most [`SERVED_KEPT`], the newest last).
    pub served: Vec<String>,
    /// Why it is withdrawn (the sentence its `replica.removed` carries), while it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// A value as read, with the revision a compare-and-set must name (`None`: never written).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Read<T> {
    pub value: Option<T>,
    pub revision: Option<u64>,
}

async fn read<T: for<'de> Deserialize<'de>>(
    store: &kv::Store,
    key: &str,
) -> Result<Read<T>, PlacementError> {
    match store.entry(key).await.map_err(|e| err(key, e))? {
        Some(entry) if matches!(entry.operation, kv::Operation::Put) => Ok(Read {
            value: Some(serde_json::from_slice(&entry.value).map_err(|e| err(key, e))?),
            revision: Some(entry.revision),
        }),
        // Deleted: a compare-and-set names the tombstone's revision.
        Some(entry) => Ok(Read {
            value: None,
            revision: Some(entry.revision),
        }),
        None => Ok(Read {
            value: None,
            revision: None,
        }),
    }
}

/// Writes `value` if the key is still at `revision`: `Ok(false)` when another writer won.
async fn write<T: Serialize>(
    store: &kv::Store,
    key: &str,
    value: &T,
    revision: Option<u64>,
) -> Result<bool, PlacementError> {
    let bytes = Bytes::from(serde_json::to_vec(value).map_err(|e| err(key, e))?);
    match revision {
        None => match store.create(key, bytes).await {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => Ok(false),
            Err(e) => Err(err(key, e)),
        },
        Some(rev) => match store.update(key, bytes, rev).await {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => Ok(false),
            Err(e) => Err(err(key, e)),
        },
    }
}

/// The key of a replica's fingerprint head; its chunks are `<head>.<n>`.
pub fn fingerprint_key(tier: &str, node: Option<&str>, prefix: &str) -> String {
    format!("{}.fingerprint", use_key(tier, node, prefix))
}

/// Bytes of a fingerprint per KV value: well under a stock server's 1 MiB message.
const FINGERPRINT_CHUNK: usize = 256 * 1024;

/// Chunks of a fingerprint read at once.
const FINGERPRINT_READS: usize = 8;

/// What a fingerprint's head says of its chunks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct FingerprintHead {
    chunks: u32,
    bytes: u64,
    /// SHA-256 (hex) of the chunks' bytes in order.
    sha256: String,
}

/// Records the encoded fingerprint of the replica at `prefix` (replacing any earlier one):
/// the head is deleted first and written last, so a reader never pairs new chunks with an old
/// head (it finds none, or chunks that do not hash to the head: unknown either way).
pub async fn put_fingerprint(
    store: &kv::Store,
    tier: &str,
    node: Option<&str>,
    prefix: &str,
    encoded: &[u8],
) -> Result<(), PlacementError> {
    let head_key = fingerprint_key(tier, node, prefix);
    let old: Read<FingerprintHead> = read(store, &head_key).await.unwrap_or(Read {
        value: None,
        revision: None,
    });
    if old.value.is_some() {
        store
            .delete(&head_key)
            .await
            .map_err(|e| err(&head_key, e))?;
    }
    let chunks: Vec<&[u8]> = encoded.chunks(FINGERPRINT_CHUNK).collect();
    for (n, chunk) in chunks.iter().enumerate() {
        let key = format!("{head_key}.{n}");
        store
            .put(&key, Bytes::copy_from_slice(chunk))
            .await
            .map_err(|e| err(&key, e))?;
    }
    let head = FingerprintHead {
        chunks: chunks.len() as u32,
        bytes: encoded.len() as u64,
        sha256: hex::encode(Sha256::digest(encoded)),
    };
    let bytes = Bytes::from(serde_json::to_vec(&head).map_err(|e| err(&head_key, e))?);
    store
        .put(&head_key, bytes)
        .await
        .map_err(|e| err(&head_key, e))?;
    // Chunks an earlier, longer fingerprint left beyond this one's.
    if let Some(old) = old.value {
        for n in head.chunks..old.chunks {
            let key = format!("{head_key}.{n}");
            if let Err(e) = store.purge(&key).await {
                tracing::debug!(%key, error = %e, "an earlier fingerprint's chunk not purged");
            }
        }
    }
    Ok(())
}

/// The recorded fingerprint of the replica at `prefix`, as encoded; `None` when none is
/// recorded or what is recorded is not whole (unknown: verify by hash).
pub async fn fingerprint(
    store: &kv::Store,
    tier: &str,
    node: Option<&str>,
    prefix: &str,
) -> Result<Option<Vec<u8>>, PlacementError> {
    use futures::StreamExt;
    let head_key = fingerprint_key(tier, node, prefix);
    let Some(head) = read::<FingerprintHead>(store, &head_key).await?.value else {
        return Ok(None);
    };
    let head_key = &head_key;
    let chunks: Vec<Result<Option<Bytes>, PlacementError>> = futures::stream::iter(0..head.chunks)
        .map(|n| async move {
            let key = format!("{head_key}.{n}");
            store.get(&key).await.map_err(|e| err(&key, e))
        })
        .buffered(FINGERPRINT_READS)
        .collect()
        .await;
    let mut encoded = Vec::with_capacity(head.bytes.min(1 << 30) as usize);
    for chunk in chunks {
        match chunk? {
            Some(bytes) => encoded.extend_from_slice(&bytes),
            None => return Ok(None),
        }
    }
    if encoded.len() as u64 != head.bytes || hex::encode(Sha256::digest(&encoded)) != head.sha256 {
        return Ok(None);
    }
    Ok(Some(encoded))
}

/// Deletes the fingerprint of the replica at `prefix` (head first).
pub async fn forget_fingerprint(
    store: &kv::Store,
    tier: &str,
    node: Option<&str>,
    prefix: &str,
) -> Result<(), PlacementError> {
    let head_key = fingerprint_key(tier, node, prefix);
    let Some(head) = read::<FingerprintHead>(store, &head_key).await?.value else {
        return Ok(());
    };
    store
        .purge(&head_key)
        .await
        .map_err(|e| err(&head_key, e))?;
    for n in 0..head.chunks {
        let key = format!("{head_key}.{n}");
        store.purge(&key).await.map_err(|e| err(&key, e))?;
    }
    Ok(())
}

/// The reservations of a tier (or one node's local tier).
pub async fn reservations(
    store: &kv::Store,
    tier: &str,
    node: Option<&str>,
) -> Result<Read<Reservations>, PlacementError> {
    read(store, &quota_key(tier, node)).await
}

/// Writes a tier's reservations back if unchanged since `revision` was read.
pub async fn write_reservations(
    store: &kv::Store,
    tier: &str,
    node: Option<&str>,
    value: &Reservations,
    revision: Option<u64>,
) -> Result<bool, PlacementError> {
    write(store, &quota_key(tier, node), value, revision).await
}

/// Which entries a release may give back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Giving {
    /// The reserver's own: an entry no removal has marked.
    Unmarked,
    /// A removal's: an entry it marked `withdrawing`.
    Withdrawn,
}

async fn release(
    store: &kv::Store,
    tier: &str,
    node: Option<&str>,
    prefix: &str,
    giving: Giving,
) -> Result<bool, PlacementError> {
    loop {
        let mut r = reservations(store, tier, node).await?;
        let Some(value) = r.value.as_mut() else {
            return Ok(false);
        };
        let marked = value.withdrawing.contains(prefix);
        if !value.replicas.contains_key(prefix) && !marked {
            return Ok(false);
        }
        if marked != (giving == Giving::Withdrawn) {
            return Ok(false);
        }
        value.replicas.remove(prefix);
        value.withdrawing.remove(prefix);
        if write_reservations(store, tier, node, value, r.revision).await? {
            return Ok(true);
        }
    }
}

/// The reserver gives back the space of the replica at `prefix` it reserved and never placed
/// (idempotent): whether it was reserved. An entry a removal has marked is left to the removal.
pub async fn release_reservation(
    store: &kv::Store,
    tier: &str,
    node: Option<&str>,
    prefix: &str,
) -> Result<bool, PlacementError> {
    release(store, tier, node, prefix, Giving::Unmarked).await
}

/// The remover gives back the space of the replica at `prefix` once its folder is gone
/// (idempotent): only the entry its [`begin_withdraw`] marked, so a reservation made afresh
/// since (by a new copy) is never given back by an old removal.
pub async fn release_removed(
    store: &kv::Store,
    tier: &str,
    node: Option<&str>,
    prefix: &str,
) -> Result<bool, PlacementError> {
    release(store, tier, node, prefix, Giving::Withdrawn).await
}

/// Marks (or unmarks) the reservation of the replica at `prefix` as being removed; a replica
/// with no reservation is left as it is.
async fn mark_withdrawing(
    store: &kv::Store,
    tier: &str,
    node: Option<&str>,
    prefix: &str,
    on: bool,
) -> Result<(), PlacementError> {
    loop {
        let mut r = reservations(store, tier, node).await?;
        let Some(value) = r.value.as_mut() else {
            return Ok(());
        };
        let changed = if on {
            value.replicas.contains_key(prefix) && value.withdrawing.insert(prefix.to_owned())
        } else {
            value.withdrawing.remove(prefix)
        };
        if !changed || write_reservations(store, tier, node, value, r.revision).await? {
            return Ok(());
        }
    }
}

/// The use record of the replica at `prefix`, as read now.
pub async fn read_use(
    store: &kv::Store,
    tier: &str,
    node: Option<&str>,
    prefix: &str,
) -> Result<Read<ReplicaUse>, PlacementError> {
    read(store, &use_key(tier, node, prefix)).await
}

/// What [`serve`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Served {
    /// The record is bumped: the request may be answered from the replica.
    Yes,
    /// The demoter is removing it, for this reason: the request must not be answered from it.
    Withdrawing { reason: Option<String> },
}

/// Notes that `request_id` is about to be answered from the replica, unless it is withdrawing:
/// a compare-and-set on the revision read, so a withdrawal that read before it fails.
pub async fn serve(
    store: &kv::Store,
    tier: &str,
    node: Option<&str>,
    prefix: &str,
    request_id: &str,
) -> Result<Served, PlacementError> {
    let key = use_key(tier, node, prefix);
    loop {
        let r: Read<ReplicaUse> = read(store, &key).await?;
        let mut value = match r.value {
            Some(v) if v.state == UseState::Withdrawing => {
                return Ok(Served::Withdrawing { reason: v.reason });
            }
            Some(v) => v,
            None => ReplicaUse {
                state: UseState::Serving,
                served: Vec::new(),
                reason: None,
            },
        };
        value.served.retain(|id| id != request_id);
        value.served.push(request_id.to_owned());
        let excess = value.served.len().saturating_sub(SERVED_KEPT);
        value.served.drain(..excess);
        if write(store, &key, &value, r.revision).await? {
            return Ok(Served::Yes);
        }
    }
}

/// Takes the record into `withdrawing`, if it is still as `seen` (read before the holds were
/// looked at): `Ok(Some(record))` when taken (or already taken by an earlier run of this step),
/// with the requests served from it for the caller to check again; `Ok(None)` when a request
/// was served since (the caller backs off and looks at the holds again).
pub async fn begin_withdraw(
    store: &kv::Store,
    tier: &str,
    node: Option<&str>,
    prefix: &str,
    seen: &Read<ReplicaUse>,
    reason: &str,
) -> Result<Option<ReplicaUse>, PlacementError> {
    let key = use_key(tier, node, prefix);
    let taken = match &seen.value {
        // Taken by an earlier run of this step, which may have stopped before marking.
        Some(v) if v.state == UseState::Withdrawing => v.clone(),
        seen_value => {
            let taken = ReplicaUse {
                state: UseState::Withdrawing,
                served: seen_value
                    .as_ref()
                    .map(|v| v.served.clone())
                    .unwrap_or_default(),
                reason: Some(reason.to_owned()),
            };
            if !write(store, &key, &taken, seen.revision).await? {
                return Ok(None);
            }
            taken
        }
    };
    // Before anything of the removal is visible (the rename comes later): a promoter that
    // finds the folder gone finds its space marked too, and waits instead of copying onto a
    // reservation about to be given back.
    mark_withdrawing(store, tier, node, prefix, true).await?;
    Ok(Some(taken))
}

/// Gives a withdrawing record back to serving (the removal is undone), and its space back to
/// the replica; idempotent.
pub async fn end_withdraw(
    store: &kv::Store,
    tier: &str,
    node: Option<&str>,
    prefix: &str,
) -> Result<(), PlacementError> {
    // The mark first: while the record still says withdrawing, no promoter copies or reserves.
    mark_withdrawing(store, tier, node, prefix, false).await?;
    let key = use_key(tier, node, prefix);
    loop {
        let r: Read<ReplicaUse> = read(store, &key).await?;
        let Some(mut value) = r.value else {
            return Ok(());
        };
        if value.state != UseState::Withdrawing {
            return Ok(());
        }
        value.state = UseState::Serving;
        value.reason = None;
        if write(store, &key, &value, r.revision).await? {
            return Ok(());
        }
    }
}

/// Deletes the record once the replica and its space are gone: requests stage it afresh.
pub async fn forget_use(
    store: &kv::Store,
    tier: &str,
    node: Option<&str>,
    prefix: &str,
) -> Result<(), PlacementError> {
    let key = use_key(tier, node, prefix);
    loop {
        let r: Read<ReplicaUse> = read(store, &key).await?;
        // Only a withdrawing record is this removal's (a repeat after a new copy was served
        // leaves that one's record alone).
        if r.value
            .as_ref()
            .is_none_or(|v| v.state != UseState::Withdrawing)
        {
            return Ok(());
        }
        if let Err(e) = store.delete_expect_revision(&key, r.revision).await {
            // A lost compare-and-set is not told apart by the client: look again.
            if read::<ReplicaUse>(store, &key).await?.revision == r.revision {
                return Err(err(&key, e));
            }
        } else {
            // What was recorded of the removed folder goes with it (no copy of it is made
            // while the record was withdrawing, so no new fingerprint is there yet).
            return forget_fingerprint(store, tier, node, prefix).await;
        }
    }
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
        assert_eq!(r.projects().collect::<Vec<_>>(), ["lab-a", "lab-ab"]);
        assert_eq!(r.total(), 115);
        assert_eq!(place("local", Some("gpu.07")), "local.gpu=2E07");
    }

    #[test]
    fn free_space_is_what_a_reservation_would_still_be_admitted() {
        let mut r = Reservations::default();
        // One replica a live stage holds, one nobody holds: both count.
        r.replicas.insert("lab/held/v1".into(), 40_960);
        r.replicas.insert("lab/unheld/v1".into(), 10_240);
        assert_eq!(r.free(65_536), 14_336);
        assert!(r.fits(r.free(65_536), 65_536));
        assert!(!r.fits(r.free(65_536) + 1, 65_536));
        // Listed over its capacity (the bound lowered): nothing free, nothing fits.
        assert_eq!(r.free(40_000), 0);
        assert!(!r.fits(0, 40_000));
    }

    #[test]
    fn keys_are_tokens_of_tier_node_and_prefix() {
        let key = use_key("hot", None, "lab/cats/v1");
        assert!(key.starts_with("replica.hot."), "{key}");
        assert_eq!(key.len(), "replica.hot.".len() + 32);
        assert_ne!(key, use_key("hot", Some("n1"), "lab/cats/v1"));
        assert_eq!(quota_key("local", Some("n1")), "quota.local.n1");
    }
}

/// The liveness record's key of a node.
pub fn liveness_key(node: &str) -> String {
    format!("node.{}", place(node, None))
}

/// A node agent's liveness record: the value of [`liveness_key`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeLiveness {
    pub node: String,
    /// Seconds between two records, as the agent writes them.
    pub every_seconds: u64,
    /// When the server stored the record (the KV entry's time; not a field of the value).
    #[serde(skip, default = "unix_epoch")]
    pub stored_at: time::OffsetDateTime,
}

fn unix_epoch() -> time::OffsetDateTime {
    time::OffsetDateTime::UNIX_EPOCH
}

impl NodeLiveness {
    /// Whether the node is silent at `now`: its record was stored longer than `silent_after`
    /// ago.
    pub fn silent(&self, now: time::OffsetDateTime, silent_after: std::time::Duration) -> bool {
        now - self.stored_at > silent_after
    }
}

/// Writes `node`'s liveness record (its agent, every beat).
pub async fn beat(
    store: &kv::Store,
    node: &str,
    every: std::time::Duration,
) -> Result<(), PlacementError> {
    let key = liveness_key(node);
    let record = NodeLiveness {
        node: node.to_owned(),
        every_seconds: every.as_secs().max(1),
        stored_at: unix_epoch(),
    };
    let bytes = Bytes::from(serde_json::to_vec(&record).map_err(|e| err(&key, e))?);
    store.put(&key, bytes).await.map_err(|e| err(&key, e))?;
    Ok(())
}

/// `node`'s liveness record with the time the server stored it; `None` when its agent never
/// wrote one (an agent from before liveness records, or a node that never ran one).
pub async fn liveness(
    store: &kv::Store,
    node: &str,
) -> Result<Option<NodeLiveness>, PlacementError> {
    let key = liveness_key(node);
    match store.entry(&key).await.map_err(|e| err(&key, e))? {
        Some(entry) if matches!(entry.operation, kv::Operation::Put) => {
            let mut record: NodeLiveness =
                serde_json::from_slice(&entry.value).map_err(|e| err(&key, e))?;
            record.stored_at = entry.created;
            Ok(Some(record))
        }
        _ => Ok(None),
    }
}

#[cfg(test)]
mod liveness_tests {
    use super::*;
    use std::time::Duration;
    use time::macros::datetime;

    fn stored(at: time::OffsetDateTime) -> NodeLiveness {
        NodeLiveness {
            node: "gpu-07".into(),
            every_seconds: 1,
            stored_at: at,
        }
    }

    #[test]
    fn a_node_is_silent_only_once_its_record_is_older_than_the_interval() {
        let beat = datetime!(2026-12-09 04:00:00 UTC);
        let after = Duration::from_secs(120);
        assert!(!stored(beat).silent(beat + Duration::from_secs(60), after));
        assert!(
            !stored(beat).silent(beat + after, after),
            "exactly the interval is not past it"
        );
        assert!(stored(beat).silent(beat + Duration::from_secs(121), after));
        // A record stored after `now` (the demoter's clock behind the server's) is not silent.
        assert!(!stored(beat).silent(beat - Duration::from_secs(30), after));
    }

    #[test]
    fn the_stored_time_is_not_taken_from_the_value() {
        // A node writing a `stored_at` of its own (a clock far ahead) is read back as the
        // epoch until the server's time is put in.
        let json = br#"{"node":"gpu-07","every_seconds":1,"stored_at":"2999-01-01T00:00:00Z"}"#;
        let record: NodeLiveness = serde_json::from_slice(json).unwrap();
        assert_eq!(record.stored_at, time::OffsetDateTime::UNIX_EPOCH);
    }

    #[test]
    fn a_node_name_is_one_key_token() {
        assert_eq!(liveness_key("gpu-07"), "node.gpu-07");
        assert_eq!(liveness_key("rack1.gpu7"), "node.rack1=2Egpu7");
    }
}
