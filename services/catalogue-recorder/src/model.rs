//! The catalogue's records, as stored in redb and as answered to queries.
//!
//! Every record that facts can change carries the [`Stamp`] of the fact that last changed it.
//! A fact changes a record only when its stamp is newer (`occurred_at`, then event id), so the
//! fold gives the same catalogue whatever order facts arrive in: live with several workers, after
//! redeliveries, or replayed from the stream.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use stagehand_schemas::{EventId, FileRef, Location, Problem};
use time::OffsetDateTime;

/// Which fact last changed a record: ordered by time, then by id so ties are broken the same
/// way everywhere.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Stamp {
    #[serde(with = "time::serde::rfc3339")]
    pub at: OffsetDateTime,
    pub event_id: EventId,
}

/// A dataset of a project: the versions and rejected requests recorded for it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DatasetRecord {
    pub project: String,
    pub dataset: String,
    /// When the first fact about it happened.
    #[serde(with = "time::serde::rfc3339")]
    pub first_seen: OffsetDateTime,
    /// Version digests.
    pub versions: BTreeSet<String>,
    /// Ids of ingest requests that were rejected.
    pub rejected_requests: BTreeSet<String>,
}

/// Who made a version, when, and from what.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Provenance {
    /// Who asked (the uploader), or the service that derived it.
    pub by: String,
    #[serde(with = "time::serde::rfc3339")]
    pub at: OffsetDateTime,
    /// The request that started the chain (the ingest request id).
    pub request_id: EventId,
    /// The fact that recorded the version.
    pub event_id: EventId,
    pub labels: Vec<(String, String)>,
    /// For a derived version, the version it came from.
    pub derived_from: Option<String>,
    /// For a derived version, its packing layout.
    pub layout: Option<String>,
    /// Where the version was first recorded.
    pub location: Location,
}

/// One content-addressed version of a dataset. Its files are a separate record (see
/// [`crate::fold`]) so that reading a version for a replica fact does not read its manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VersionRecord {
    pub project: String,
    pub dataset: String,
    pub version: String,
    pub file_count: u64,
    pub total_bytes: u64,
    /// The earliest fact that recorded this version; later identical uploads add only their
    /// request id to `request_ids`.
    pub provenance: Provenance,
    pub request_ids: BTreeSet<String>,
}

/// The state of a copy of a version on a tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReplicaState {
    /// A stage request asked for it; not complete yet.
    Staging,
    /// Complete and verified.
    Present,
    /// Removed (demoted, expired, drained).
    Removed,
}

/// The last restore drill of a backup replica.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Drill {
    pub ok: bool,
    pub sampled_files: u64,
    pub problems: Vec<Problem>,
    pub stamp: Stamp,
}

/// A copy of a version on one tier.
///
/// Two registers, each following its newest fact: the state (`state`, `prefix`, `reason`,
/// `stamp`) follows every replica fact; what the copy holds (`files`, `total_bytes`,
/// `verified_by`, `backup`, `copied`) follows only the facts that made a copy. A removal
/// therefore keeps what was removed, whichever order the two facts arrive in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaRecord {
    pub project: String,
    pub dataset: String,
    pub version: String,
    pub tier: String,
    pub prefix: String,
    pub state: ReplicaState,
    /// Why it was removed, when it was.
    pub reason: Option<String>,
    /// The fact that set the state; none while only a restore drill mentioned the replica.
    pub stamp: Option<Stamp>,
    pub files: u64,
    pub total_bytes: u64,
    /// How the copy was proven (`ingest-validation`, `read-back`, `hashed-in-flight`, …).
    pub verified_by: Option<String>,
    /// Whether this replica is a backup copy.
    pub backup: bool,
    /// The fact that made the copy.
    pub copied: Option<Stamp>,
    pub last_drill: Option<Drill>,
}

/// Readiness of one (version, tier, job).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StageState {
    Pending,
    Ready,
    Failed,
    Released,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageRecord {
    pub project: String,
    pub dataset: String,
    pub version: String,
    pub tier: String,
    pub job_id: String,
    pub state: StageState,
    pub reason: Option<String>,
    pub retryable: Option<bool>,
    pub request_id: Option<EventId>,
    pub stamp: Stamp,
}

/// A rejected ingest request with every reason.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RejectionRecord {
    pub project: String,
    pub dataset: String,
    pub request_id: EventId,
    pub declared_version: String,
    pub requested_by: String,
    pub source: Location,
    pub problems: Vec<Problem>,
    pub quarantine: Option<String>,
    pub stamp: Stamp,
}

/// Dead letters of one service.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeadLetterRecord {
    pub service: String,
    pub count: u64,
    /// The newest dead letter: its subject, stream sequence and last error.
    pub last_subject: String,
    pub last_stream_sequence: u64,
    pub last_error: Option<String>,
    pub stamp: Stamp,
}

/// The state of a checkpoint of a training run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CheckpointState {
    Committed,
    Demoted,
    Expired,
}

/// A checkpoint. The state register (`state`, `location`, `stamp`) follows every checkpoint
/// fact; `total_bytes` and `tags` come from its commit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointRecord {
    pub project: String,
    pub run: String,
    pub step: u64,
    pub state: CheckpointState,
    pub location: Location,
    pub stamp: Stamp,
    pub total_bytes: u64,
    pub tags: Vec<String>,
    pub committed: Option<Stamp>,
}

/// Readiness of a version on a tier, as mirrored into the `stagehand_readiness` KV bucket under
/// `<project>.<dataset>.<version>.<tier>` for schedulers to watch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierReadiness {
    pub project: String,
    pub dataset: String,
    pub version: String,
    pub tier: String,
    /// True when a verified replica is present on the tier.
    pub ready: bool,
    pub replica: Option<ReplicaState>,
    /// Every job that asked for it, with its state.
    pub jobs: BTreeMap<String, StageState>,
    /// Why the latest failed job failed, if any did.
    pub reason: Option<String>,
}

/// Everything about one dataset: the answer to `catalogue show D`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DatasetDetail {
    pub dataset: DatasetRecord,
    pub versions: Vec<VersionRecord>,
    pub replicas: Vec<ReplicaRecord>,
    pub stages: Vec<StageRecord>,
    pub rejections: Vec<RejectionRecord>,
}

/// One version with its files: the answer to `catalogue show D@V`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VersionDetail {
    pub version: VersionRecord,
    pub files: Vec<FileRef>,
    pub replicas: Vec<ReplicaRecord>,
    pub stages: Vec<StageRecord>,
}
