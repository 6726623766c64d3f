//! The envelope and the payload of every event in the pipeline.
//!
//! On the wire an event is one MessagePack map with field names:
//!
//! ```text
//! { "id": "…", "kind": "ingest.requested", "schema": 1, "occurred_at": "2026-11-29T20:00:00Z",
//!   "project": "lab-a", "correlation_id": "…", "causation_id": null, "payload": { … } }
//! ```
//!
//! `kind` selects the shape of `payload`. Readers ignore fields they do not know; new fields
//! are added only as optional (`#[serde(default)]`), never renamed or retyped.

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

use crate::id::EventId;
use crate::manifest::{FileRef, ManifestRef};
use crate::problem::Problem;

/// The schema version this crate writes. Readers accept any version ≤ this one.
///
/// Version 2 made manifests travel by reference: `files` of `ingest.requested`,
/// `dataset.validated`, `dataset.prepared` and `checkpoint.committed` became optional (absent or
/// empty when `manifest` is set), which a version-1 reader would misread as an empty dataset.
pub const SCHEMA_VERSION: u32 = 2;

/// One event: the envelope fields and a kind-tagged payload.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// Deterministic id; scoped by the subject, also the `Nats-Msg-Id` (see [`crate::id`]).
    pub id: EventId,
    /// Version of the contract the producer wrote.
    pub schema: u32,
    /// When the fact became true (RFC 3339, UTC).
    #[serde(with = "time::serde::rfc3339")]
    pub occurred_at: OffsetDateTime,
    /// The project (tenant) the data belongs to; a subject token.
    pub project: String,
    /// The id of the request that started this chain (a request's own id for a request).
    pub correlation_id: EventId,
    /// The id of the event that directly caused this one (none for a request).
    #[serde(default)]
    pub causation_id: Option<EventId>,
    /// `kind` and `payload`.
    #[serde(flatten)]
    pub body: Body,
}

/// The kind of an event and its payload. Serialised as two envelope fields, `kind` and
/// `payload`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "payload")]
#[non_exhaustive]
pub enum Body {
    #[serde(rename = "ingest.requested")]
    IngestRequested(IngestRequested),
    #[serde(rename = "dataset.validated")]
    DatasetValidated(DatasetValidated),
    #[serde(rename = "dataset.rejected")]
    DatasetRejected(DatasetRejected),
    #[serde(rename = "dataset.prepared")]
    DatasetPrepared(DatasetPrepared),
    #[serde(rename = "stage.requested")]
    StageRequested(StageRequested),
    #[serde(rename = "stage.released")]
    StageReleased(StageReleased),
    #[serde(rename = "stage.pending")]
    StagePending(StagePending),
    #[serde(rename = "stage.ready")]
    StageReady(StageReady),
    #[serde(rename = "stage.failed")]
    StageFailed(StageFailed),
    #[serde(rename = "replica.created")]
    ReplicaCreated(ReplicaCreated),
    #[serde(rename = "replica.removed")]
    ReplicaRemoved(ReplicaRemoved),
    #[serde(rename = "replica.damaged")]
    ReplicaDamaged(ReplicaDamaged),
    #[serde(rename = "replica.verified")]
    ReplicaVerified(ReplicaVerified),
    #[serde(rename = "replica.repaired")]
    ReplicaRepaired(ReplicaRepaired),
    #[serde(rename = "replica.unreachable")]
    ReplicaUnreachable(ReplicaUnreachable),
    #[serde(rename = "checkpoint.committed")]
    CheckpointCommitted(CheckpointCommitted),
    #[serde(rename = "checkpoint.demoted")]
    CheckpointDemoted(CheckpointDemoted),
    #[serde(rename = "checkpoint.expired")]
    CheckpointExpired(CheckpointExpired),
    #[serde(rename = "checkpoint.held")]
    CheckpointHeld(CheckpointHeld),
    #[serde(rename = "checkpoint.part.committed")]
    CheckpointPartCommitted(CheckpointPartCommitted),
    #[serde(rename = "checkpoint.part.offloaded")]
    CheckpointPartOffloaded(CheckpointPartOffloaded),
    #[serde(rename = "checkpoint.part.removed")]
    CheckpointPartRemoved(CheckpointPartRemoved),
    #[serde(rename = "backup.completed")]
    BackupCompleted(BackupCompleted),
    #[serde(rename = "restore.verified")]
    RestoreVerified(RestoreVerified),
    #[serde(rename = "restore.failed")]
    RestoreFailed(RestoreFailed),
    #[serde(rename = "dead.letter")]
    DeadLetter(DeadLetter),
    #[serde(rename = "dead.letter.replayed")]
    DeadLetterReplayed(DeadLetterReplayed),
    #[serde(rename = "operator.action")]
    OperatorAction(OperatorAction),
}

/// Every kind, in a fixed order, as written on the wire.
pub const ALL_KINDS: &[&str] = &[
    "ingest.requested",
    "dataset.validated",
    "dataset.rejected",
    "dataset.prepared",
    "stage.requested",
    "stage.released",
    "stage.pending",
    "stage.ready",
    "stage.failed",
    "replica.created",
    "replica.removed",
    "replica.damaged",
    "replica.verified",
    "replica.repaired",
    "replica.unreachable",
    "checkpoint.committed",
    "checkpoint.demoted",
    "checkpoint.expired",
    "checkpoint.held",
    "checkpoint.part.committed",
    "checkpoint.part.offloaded",
    "checkpoint.part.removed",
    "backup.completed",
    "restore.verified",
    "restore.failed",
    "dead.letter",
    "dead.letter.replayed",
    "operator.action",
];

/// The kinds that are requests (class `req`: they ask for work); every other kind but the
/// dead-letter kinds is a fact (class `fact`).
pub const REQUEST_KINDS: &[&str] = &["ingest.requested", "stage.requested", "stage.released"];

impl Body {
    /// The wire name of this kind, e.g. `"dataset.validated"`.
    pub fn kind(&self) -> &'static str {
        match self {
            Body::IngestRequested(_) => "ingest.requested",
            Body::DatasetValidated(_) => "dataset.validated",
            Body::DatasetRejected(_) => "dataset.rejected",
            Body::DatasetPrepared(_) => "dataset.prepared",
            Body::StageRequested(_) => "stage.requested",
            Body::StageReleased(_) => "stage.released",
            Body::StagePending(_) => "stage.pending",
            Body::StageReady(_) => "stage.ready",
            Body::StageFailed(_) => "stage.failed",
            Body::ReplicaCreated(_) => "replica.created",
            Body::ReplicaRemoved(_) => "replica.removed",
            Body::ReplicaDamaged(_) => "replica.damaged",
            Body::ReplicaVerified(_) => "replica.verified",
            Body::ReplicaRepaired(_) => "replica.repaired",
            Body::ReplicaUnreachable(_) => "replica.unreachable",
            Body::CheckpointCommitted(_) => "checkpoint.committed",
            Body::CheckpointDemoted(_) => "checkpoint.demoted",
            Body::CheckpointExpired(_) => "checkpoint.expired",
            Body::CheckpointHeld(_) => "checkpoint.held",
            Body::CheckpointPartCommitted(_) => "checkpoint.part.committed",
            Body::CheckpointPartOffloaded(_) => "checkpoint.part.offloaded",
            Body::CheckpointPartRemoved(_) => "checkpoint.part.removed",
            Body::BackupCompleted(_) => "backup.completed",
            Body::RestoreVerified(_) => "restore.verified",
            Body::RestoreFailed(_) => "restore.failed",
            Body::DeadLetter(_) => "dead.letter",
            Body::DeadLetterReplayed(_) => "dead.letter.replayed",
            Body::OperatorAction(_) => "operator.action",
        }
    }

    /// Whether this kind is a request (asks for work) rather than a fact (says what happened).
    pub fn is_request(&self) -> bool {
        REQUEST_KINDS.contains(&self.kind())
    }

    /// The node whose local tier this event is about, when it names one: a stage request,
    /// answer or release for a node's `local` tier, a replica there, a checkpoint part on it.
    /// Such an event travels on its node's subject (`subject::subject_for`).
    pub fn node(&self) -> Option<&str> {
        match self {
            Body::StageRequested(p) => p.node.as_deref(),
            Body::StageReleased(p) => p.node.as_deref(),
            Body::StagePending(p) => p.node.as_deref(),
            Body::StageReady(p) => p.node.as_deref(),
            Body::StageFailed(p) => p.node.as_deref(),
            Body::ReplicaCreated(p) => p.node.as_deref(),
            Body::ReplicaRemoved(p) => p.node.as_deref(),
            Body::ReplicaDamaged(p) => p.node.as_deref(),
            Body::ReplicaVerified(p) => p.node.as_deref(),
            Body::ReplicaRepaired(p) => p.node.as_deref(),
            Body::ReplicaUnreachable(p) => Some(&p.node),
            Body::CheckpointPartCommitted(p) => Some(&p.node),
            Body::CheckpointPartOffloaded(p) => Some(&p.node),
            Body::CheckpointPartRemoved(p) => Some(&p.node),
            _ => None,
        }
    }

    /// The dataset this event concerns, when it concerns one (for spans and subjects).
    pub fn dataset(&self) -> Option<&str> {
        match self {
            Body::IngestRequested(p) => Some(&p.dataset),
            Body::DatasetValidated(p) => Some(&p.dataset),
            Body::DatasetRejected(p) => Some(&p.dataset),
            Body::DatasetPrepared(p) => Some(&p.dataset),
            Body::StageRequested(p) => Some(&p.dataset),
            Body::StageReleased(p) => Some(&p.dataset),
            Body::StagePending(p) => Some(&p.dataset),
            Body::StageReady(p) => Some(&p.dataset),
            Body::StageFailed(p) => Some(&p.dataset),
            Body::ReplicaCreated(p) => Some(&p.dataset),
            Body::ReplicaRemoved(p) => Some(&p.dataset),
            Body::ReplicaDamaged(p) => Some(&p.dataset),
            Body::ReplicaVerified(p) => Some(&p.dataset),
            Body::ReplicaRepaired(p) => Some(&p.dataset),
            Body::ReplicaUnreachable(p) => Some(&p.dataset),
            Body::BackupCompleted(p) => Some(&p.dataset),
            Body::RestoreVerified(p) => Some(&p.dataset),
            Body::RestoreFailed(p) => Some(&p.dataset),
            Body::CheckpointCommitted(_)
            | Body::CheckpointDemoted(_)
            | Body::CheckpointExpired(_)
            | Body::CheckpointHeld(_)
            | Body::CheckpointPartCommitted(_)
            | Body::CheckpointPartOffloaded(_)
            | Body::CheckpointPartRemoved(_)
            | Body::DeadLetter(_)
            | Body::DeadLetterReplayed(_)
            | Body::OperatorAction(_) => None,
        }
    }

    /// Every location this event names, with the field that names it (`payload.location`).
    /// The match names every kind, so a kind added later cannot be forgotten here; consumers
    /// check each against the event's project before reading anything
    /// ([`Event::check_locations`]).
    pub fn locations(&self) -> Vec<(&'static str, &Location)> {
        match self {
            Body::IngestRequested(p) => vec![("payload.source", &p.source)],
            Body::DatasetValidated(p) => vec![("payload.source", &p.source)],
            // A rejection quotes the request's source, possibly the very prefix it was
            // rejected for (`outside_project`): nothing is read there, copied or recorded as
            // data, and refusing the rejection would hide the answer from its uploader.
            Body::DatasetRejected(_) => vec![],
            Body::DatasetPrepared(p) => vec![("payload.location", &p.location)],
            Body::StageReady(p) => vec![("payload.location", &p.location)],
            Body::ReplicaCreated(p) => vec![("payload.location", &p.location)],
            Body::ReplicaRemoved(p) => vec![("payload.location", &p.location)],
            Body::ReplicaDamaged(p) => vec![("payload.location", &p.location)],
            Body::ReplicaVerified(p) => vec![("payload.location", &p.location)],
            Body::ReplicaRepaired(p) => vec![("payload.location", &p.location)],
            Body::ReplicaUnreachable(p) => vec![("payload.location", &p.location)],
            Body::CheckpointCommitted(p) => vec![("payload.location", &p.location)],
            Body::CheckpointDemoted(p) => vec![("payload.from", &p.from), ("payload.to", &p.to)],
            Body::CheckpointExpired(p) => vec![("payload.location", &p.location)],
            Body::CheckpointHeld(p) => vec![("payload.location", &p.location)],
            Body::CheckpointPartCommitted(p) => vec![("payload.location", &p.location)],
            Body::CheckpointPartOffloaded(p) => {
                vec![("payload.location", &p.location), ("payload.from", &p.from)]
            }
            Body::CheckpointPartRemoved(p) => vec![
                ("payload.location", &p.location),
                ("payload.offloaded_to", &p.offloaded_to),
            ],
            Body::BackupCompleted(p) => vec![("payload.location", &p.location)],
            Body::RestoreVerified(p) => vec![("payload.location", &p.location)],
            Body::RestoreFailed(p) => vec![("payload.location", &p.location)],
            Body::StageRequested(_)
            | Body::StageReleased(_)
            | Body::StagePending(_)
            | Body::StageFailed(_)
            | Body::DeadLetter(_)
            | Body::DeadLetterReplayed(_)
            | Body::OperatorAction(_) => vec![],
        }
    }
}

impl Event {
    /// A new request: its own correlation id, no cause.
    pub fn request(id: EventId, project: impl Into<String>, body: Body) -> Self {
        Self {
            correlation_id: id.clone(),
            id,
            schema: SCHEMA_VERSION,
            occurred_at: now(),
            project: project.into(),
            causation_id: None,
            body,
        }
    }

    /// The fact that `step` of handling `self` produced, with a derived id.
    pub fn caused(&self, step: &str, body: Body) -> Event {
        Event {
            id: EventId::for_fact(&self.project, &self.id, step),
            schema: SCHEMA_VERSION,
            occurred_at: now(),
            project: self.project.clone(),
            correlation_id: self.correlation_id.clone(),
            causation_id: Some(self.id.clone()),
            body,
        }
    }

    pub fn kind(&self) -> &'static str {
        self.body.kind()
    }
}

/// Now, truncated to whole microseconds so that encode → decode round-trips exactly.
pub fn now() -> OffsetDateTime {
    let now = OffsetDateTime::now_utc();
    now.replace_nanosecond(now.nanosecond() / 1_000 * 1_000)
        .unwrap_or(now)
}

/// Where a dataset's bytes are: a tier declared in `policies/` and a prefix beneath its root.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
pub struct Location {
    /// Tier name, as declared in the tier policy (`source`, `hot`, `capacity`, …).
    pub tier: String,
    /// Relative prefix beneath the tier root under which the manifest paths live; empty for the
    /// root itself.
    #[serde(default)]
    pub prefix: String,
}

/// A lab uploader asks for a dataset to be validated and recorded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
pub struct IngestRequested {
    /// Dataset name, unique within the project.
    pub dataset: String,
    /// Where the uploaded files are. On a shared tier the prefix lies beneath the project's
    /// own prefix (`<project>/...`).
    pub source: Location,
    /// The manifest inline: every file, with size and SHA-256 as the uploader computed them.
    /// Only for small uploads (at most [`crate::manifest::INLINE_MANIFEST_MAX_BYTES`] of
    /// manifest lines); empty when `manifest` is set.
    #[serde(default)]
    pub files: Vec<FileRef>,
    /// The manifest by reference: an object in the project's upload bucket
    /// ([`crate::subject::upload_manifest_bucket`]) named by its digest, which is the declared
    /// version. Set for any manifest too large to travel inline.
    #[serde(default)]
    pub manifest: Option<ManifestRef>,
    /// Who uploaded (a user or service account name).
    pub requested_by: String,
    /// Free-form labels (`modality=image`, `licence=cc-by`).
    #[serde(default)]
    pub labels: Vec<(String, String)>,
}

/// Every byte of an ingest request was read, hashed and found as declared and within policy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
pub struct DatasetValidated {
    pub dataset: String,
    /// The version digest ([`crate::manifest::version_digest`]).
    #[cfg_attr(
        feature = "json-schema",
        schemars(pattern(crate::json_schema::SHA256_PATTERN))
    )]
    pub version: String,
    pub source: Location,
    /// The manifest inline, for a small version; empty when `manifest` is set.
    #[serde(default)]
    pub files: Vec<FileRef>,
    /// The manifest by reference, in the catalogue's manifest bucket
    /// ([`crate::subject::MANIFEST_BUCKET`]); its digest is `version`.
    #[serde(default)]
    pub manifest: Option<ManifestRef>,
    pub total_bytes: u64,
    pub requested_by: String,
    /// The ingest request this validation answers.
    pub request_id: EventId,
    #[serde(default)]
    pub labels: Vec<(String, String)>,
}

/// An ingest request failed validation. Every problem is counted and reported (in the
/// quarantine marker); the event carries as many as fit its bound.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
pub struct DatasetRejected {
    pub dataset: String,
    pub source: Location,
    /// Digest of the manifest as declared (even though it did not verify).
    #[cfg_attr(
        feature = "json-schema",
        schemars(pattern(crate::json_schema::SHA256_PATTERN))
    )]
    pub declared_version: String,
    pub requested_by: String,
    pub request_id: EventId,
    /// The problems, in manifest order, cut to fit the event bound
    /// ([`crate::problem::ProblemTally`]); `quarantine` holds all of them.
    pub problems: Vec<Problem>,
    /// Where the rejected upload was quarantined or marked, with the full report of every
    /// problem; the upload is never deleted.
    #[serde(default)]
    pub quarantine: Option<String>,
    /// How many problems there were of each code, all of them counted (`[code, count]`
    /// pairs, sorted by code). Empty in events written before schema 2.
    #[serde(default)]
    pub problem_counts: Vec<(String, u64)>,
    /// How many problems there were in all; absent before schema 2, when `problems` was the
    /// whole list.
    #[serde(default)]
    pub problems_total: Option<u64>,
}

/// A derived version (resharded into tar shards) was written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
pub struct DatasetPrepared {
    pub dataset: String,
    /// The derived version's digest (over its shard manifest).
    #[cfg_attr(
        feature = "json-schema",
        schemars(pattern(crate::json_schema::SHA256_PATTERN))
    )]
    pub version: String,
    /// The version it was derived from.
    #[cfg_attr(
        feature = "json-schema",
        schemars(pattern(crate::json_schema::SHA256_PATTERN))
    )]
    pub derived_from: String,
    pub location: Location,
    /// The shards and the shard index, inline for a small version; empty when `manifest` is
    /// set.
    #[serde(default)]
    pub files: Vec<FileRef>,
    /// The shard manifest by reference, in the catalogue's manifest bucket; its digest is
    /// `version`.
    #[serde(default)]
    pub manifest: Option<ManifestRef>,
    pub total_bytes: u64,
    /// Packing layout, e.g. `webdataset`.
    pub layout: String,
    /// Number of samples across all shards.
    pub samples: u64,
    /// The shuffle seed.
    pub seed: u64,
}

/// A scheduler plugin asks for a dataset version on a tier for a job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
pub struct StageRequested {
    pub dataset: String,
    /// A version digest, or a unique prefix of one (at least 12 characters).
    #[cfg_attr(
        feature = "json-schema",
        schemars(pattern(crate::json_schema::VERSION_PREFIX_PATTERN))
    )]
    pub version: String,
    /// Target tier (a `hot` or `local` role tier).
    pub tier: String,
    /// The scheduler's job id (Slurm job id, Kubernetes pod uid).
    pub job_id: String,
    pub requested_by: String,
    /// When the job stops waiting; the promoter answers `stage.failed` after it.
    #[serde(default, with = "time::serde::rfc3339::option")]
    #[cfg_attr(
        feature = "json-schema",
        schemars(with = "Option<crate::json_schema::Timestamp>")
    )]
    pub deadline: Option<OffsetDateTime>,
    /// For a `local` tier: the node whose NVMe the data is staged on (its promoter agent
    /// consumes the requests addressed to it). Absent for shared tiers.
    #[serde(default)]
    pub node: Option<String>,
    /// Which form of the dataset: `raw` (the validated version, the default) or `prepared`
    /// (the resharded version derived from it, when one exists).
    #[serde(default)]
    pub form: Option<String>,
    /// When the job's hold on the staged data ends at the latest: its lifetime (a time limit
    /// plus the time it may still queue). Until then, or until `stage.released`, the replica
    /// is held; past it, a stage never released (a lost job, a teardown that failed) no
    /// longer holds it. Absent: held until released.
    #[serde(default, with = "time::serde::rfc3339::option")]
    #[cfg_attr(
        feature = "json-schema",
        schemars(with = "Option<crate::json_schema::Timestamp>")
    )]
    pub hold_until: Option<OffsetDateTime>,
}

/// A job no longer needs its staged data.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
pub struct StageReleased {
    pub dataset: String,
    #[cfg_attr(
        feature = "json-schema",
        schemars(pattern(crate::json_schema::VERSION_PREFIX_PATTERN))
    )]
    pub version: String,
    pub tier: String,
    pub job_id: String,
    /// The node, for a `local` tier.
    #[serde(default)]
    pub node: Option<String>,
    /// Who released it and why, when it is not the job's own end (a reconciler that found the
    /// job gone from its scheduler): shown as the stage's reason.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl StageReleased {
    /// Whether this release names a request for `requested` (the version as the request wrote
    /// it, or as it was resolved): the same stage however either spelled the version, a unique
    /// prefix or the full digest.
    pub fn names_version(&self, requested: &str) -> bool {
        !requested.is_empty()
            && !self.version.is_empty()
            && (requested.starts_with(&self.version) || self.version.starts_with(requested))
    }
}

/// A stage request cannot be answered yet, and this says why (the version is not validated or
/// prepared yet, the tier's quota is full, a copy slot is busy). The request stays open until
/// it is ready, fails, or its deadline passes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
pub struct StagePending {
    pub dataset: String,
    /// The version as the request named it (possibly a prefix).
    #[cfg_attr(
        feature = "json-schema",
        schemars(pattern(crate::json_schema::VERSION_PREFIX_PATTERN))
    )]
    pub version: String,
    pub tier: String,
    #[serde(default)]
    pub node: Option<String>,
    pub job_id: String,
    pub request_id: EventId,
    /// What the request waits for, as a stable word: `validation`, `preparation`, `quota`,
    /// `copy`.
    pub waiting_for: String,
    /// Why, for a person (shown by `stagehand stage status` and in `squeue`).
    pub reason: String,
    /// For a copy queued behind others: when it should be ready, and what that is based on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_estimate: Option<ReadyEstimate>,
}

/// When a stage request whose copy is queued should be ready, and what that is based on: the
/// bytes queued ahead of it on the same pair of tiers and the throughput recent copies of that
/// pair measured. Presence is a promise of nothing: a scheduler plans with it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
pub struct ReadyEstimate {
    /// The tier the copy reads.
    pub from_tier: String,
    /// The tier the copy writes.
    pub to_tier: String,
    /// Bytes still to copy of the copies running or queued before this one on that pair.
    pub bytes_ahead: u64,
    /// How many copies those are.
    pub copies_ahead: u64,
    /// This copy's own bytes.
    pub bytes: u64,
    /// Bytes a second recent copies of that pair moved (a moving figure); absent before the
    /// first copy of the pair was measured: then there is no estimate yet.
    #[serde(default)]
    pub bytes_per_second: Option<u64>,
    /// When the copy should be published at that throughput, the copies ahead going first;
    /// absent without a measurement.
    #[serde(default, with = "time::serde::rfc3339::option")]
    #[cfg_attr(
        feature = "json-schema",
        schemars(with = "Option<crate::json_schema::Timestamp>")
    )]
    pub ready_at: Option<OffsetDateTime>,
}

impl ReadyEstimate {
    /// For a person, as of `now`: what is ahead and when it should be ready, or that there is
    /// no estimate yet.
    pub fn describe(&self, now: OffsetDateTime) -> String {
        let copies = if self.copies_ahead == 1 {
            "copy"
        } else {
            "copies"
        };
        let ahead = format!(
            "{} bytes in {} {copies} queued ahead on {} -> {}",
            self.bytes_ahead, self.copies_ahead, self.from_tier, self.to_tier
        );
        match (self.ready_at, self.bytes_per_second) {
            (Some(at), Some(rate)) => {
                let left = (at - now).whole_seconds().max(0);
                format!(
                    "{ahead}; ready in about {left} s (by {}, at {rate} bytes/s measured)",
                    at.format(&time::format_description::well_known::Rfc3339)
                        .unwrap_or_default()
                )
            }
            _ => format!("{ahead}; no estimate yet (no copy on that pair measured)"),
        }
    }
}

/// A staged replica is complete and verified; the job may start.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
pub struct StageReady {
    pub dataset: String,
    #[cfg_attr(
        feature = "json-schema",
        schemars(pattern(crate::json_schema::SHA256_PATTERN))
    )]
    pub version: String,
    pub location: Location,
    pub job_id: String,
    /// The stage request this answers.
    pub request_id: EventId,
    /// The node, for a `local` tier.
    #[serde(default)]
    pub node: Option<String>,
    /// Where a job finds the data on a posix tier: the absolute path of the version's folder
    /// as the tier's mount shows it.
    #[serde(default)]
    pub path: Option<String>,
}

/// Staging failed; the job must not start, and this says why.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
pub struct StageFailed {
    pub dataset: String,
    #[cfg_attr(
        feature = "json-schema",
        schemars(pattern(crate::json_schema::VERSION_PREFIX_PATTERN))
    )]
    pub version: String,
    pub tier: String,
    pub job_id: String,
    pub request_id: EventId,
    pub reason: String,
    /// Whether asking again later can succeed.
    pub retryable: bool,
    /// The node, for a `local` tier.
    #[serde(default)]
    pub node: Option<String>,
}

/// A verified copy of a dataset version now exists on a tier.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
pub struct ReplicaCreated {
    pub dataset: String,
    #[cfg_attr(
        feature = "json-schema",
        schemars(pattern(crate::json_schema::SHA256_PATTERN))
    )]
    pub version: String,
    pub location: Location,
    pub files: u64,
    pub total_bytes: u64,
    /// How the copy was proven: `read-back`, `hashed-in-flight`, `s3-checksum`.
    pub verified_by: String,
    /// The node whose node-local tier holds the copy (a `local` tier: each node has its own
    /// copy under the same prefix); absent for a tier every node shares.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
}

/// A replica was removed (demoted, expired, drained).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
pub struct ReplicaRemoved {
    pub dataset: String,
    #[cfg_attr(
        feature = "json-schema",
        schemars(pattern(crate::json_schema::SHA256_PATTERN))
    )]
    pub version: String,
    pub location: Location,
    pub reason: String,
    /// The node whose node-local copy was removed; absent for a tier every node shares.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
}

/// A replica was found not to be what was verified when it was made: files missing, of another
/// size or content, changed since (their metadata differs from the fingerprint recorded when
/// the set was published), or entries its file list does not name. Its readiness is withdrawn
/// as this folds, before anything else is done about it; a later `replica.created` of the same
/// (tier, node) — the repair, or a fresh copy — makes it present again. Stated by whoever
/// finds it: the promoter before it hands a replica out again (`found_by` `fingerprint` or
/// `hash`), and any later checker (a scrub) with its own `found_by`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
pub struct ReplicaDamaged {
    pub dataset: String,
    #[cfg_attr(
        feature = "json-schema",
        schemars(pattern(crate::json_schema::SHA256_PATTERN))
    )]
    pub version: String,
    pub location: Location,
    /// The node whose node-local copy is damaged; absent for a tier every node shares.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// How the damage was found: `fingerprint` (a metadata walk against what was recorded at
    /// publish), `hash` (the files' bytes read and hashed against the manifest), or a later
    /// checker's own word (`scrub`).
    pub found_by: String,
    /// The damaged paths (relative to `location`), the first [`ReplicaDamaged::MAX_LISTED`]
    /// of them, each with how.
    pub files: Vec<DamagedFile>,
    /// How many damaged paths there are in all.
    pub damaged_total: u64,
    /// What happens next, for a person (`being repaired from tier capacity`).
    pub reason: String,
}

impl ReplicaDamaged {
    /// The most damaged paths one fact names (the total says how many there are).
    pub const MAX_LISTED: usize = 32;
}

/// Every file of a replica was read back whole and hashed to the SHA-256 the catalogue lists
/// for it (a scrub): the replica is still what was verified when it was made. `occurred_at` is
/// when the read finished; the catalogue keeps it as the replica's last verification.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
pub struct ReplicaVerified {
    pub dataset: String,
    #[cfg_attr(
        feature = "json-schema",
        schemars(pattern(crate::json_schema::SHA256_PATTERN))
    )]
    pub version: String,
    pub location: Location,
    /// The node whose node-local copy was read; absent for a tier every node shares.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// Files read and hashed.
    pub files: u64,
    /// Bytes read and hashed.
    pub total_bytes: u64,
    /// Who read it: `scrub`.
    pub verified_by: String,
}

/// A replica found damaged was repaired: the files that did not verify were copied again from
/// another verified replica of the same version (each verified, the set published at once),
/// and every file of it now hashes to its listed SHA-256. The catalogue makes it present again
/// (readiness returns).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
pub struct ReplicaRepaired {
    pub dataset: String,
    #[cfg_attr(
        feature = "json-schema",
        schemars(pattern(crate::json_schema::SHA256_PATTERN))
    )]
    pub version: String,
    pub location: Location,
    /// The node whose node-local copy was repaired; absent for a tier every node shares.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// The tier the files were copied from.
    pub from_tier: String,
    /// The paths copied again (relative to `location`), the first
    /// [`ReplicaDamaged::MAX_LISTED`] of them.
    pub repaired: Vec<String>,
    /// How many paths were copied again in all.
    pub repaired_total: u64,
    /// Files and bytes of the whole replica, all verified.
    pub files: u64,
    pub total_bytes: u64,
}

/// A node-local copy is out of reach: the agent of its node (the promoter run with that
/// `node`) has written no liveness record for longer than the policy allows
/// (`promotion.toml`'s `agent_silent_after`). Stated by the demoter, which watches the
/// liveness records; the catalogue marks the (tier, node) copy `unreachable` — handed to no
/// job, its readiness withdrawn, not counted in the tier's space or the project's quota —
/// until the node's agent, beating again, re-checks it against its recorded fingerprint and
/// states `replica.created` (intact) or `replica.damaged`. Only a `present` copy becomes
/// unreachable: a damaged or removed one stays as it is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
pub struct ReplicaUnreachable {
    pub dataset: String,
    #[cfg_attr(
        feature = "json-schema",
        schemars(pattern(crate::json_schema::SHA256_PATTERN))
    )]
    pub version: String,
    pub location: Location,
    /// The node whose agent is silent.
    pub node: String,
    /// When the node's agent last wrote its liveness record.
    #[serde(with = "time::serde::rfc3339")]
    #[cfg_attr(
        feature = "json-schema",
        schemars(with = "crate::json_schema::Timestamp")
    )]
    pub last_seen: OffsetDateTime,
    /// The policy's interval: silent longer than this is unreachable.
    pub silent_after_seconds: u64,
}

/// One damaged path of a replica.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
pub struct DamagedFile {
    /// Relative to the replica's location.
    pub path: String,
    /// `missing`; `size` (another size than listed); `hash` (its bytes do not hash to the
    /// listed SHA-256); `modified` (same size, other mtime, ctime, inode or ETag than
    /// recorded: rewritten, touched, made writable or replaced); `kind` (not a regular file);
    /// `stray` (an entry the file list does not name).
    pub how: String,
    /// The listed or recorded size, for `size`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_size: Option<u64>,
    /// The size found, for `size`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub found_size: Option<u64>,
}

/// A training run wrote a checkpoint.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
pub struct CheckpointCommitted {
    /// Training run name.
    pub run: String,
    pub step: u64,
    pub location: Location,
    /// The checkpoint's files inline; empty when `manifest` is set.
    #[serde(default)]
    pub files: Vec<FileRef>,
    /// The checkpoint's manifest by reference, in the project's upload bucket (a training job
    /// publishes this, as an uploader does).
    #[serde(default)]
    pub manifest: Option<ManifestRef>,
    pub total_bytes: u64,
    /// Tags that retention honours (`keep`, `best`, `release`).
    #[serde(default)]
    pub tags: Vec<String>,
}

/// A checkpoint was moved to a lower tier.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
pub struct CheckpointDemoted {
    pub run: String,
    pub step: u64,
    pub from: Location,
    pub to: Location,
    pub total_bytes: u64,
    /// The retention rule that kept it (`keep_last`, `keep_every`, `tagged:<tag>`; see
    /// `stagehand_policy::retention`). Absent in facts of writers before it existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<String>,
}

/// A checkpoint was removed by retention.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
pub struct CheckpointExpired {
    pub run: String,
    pub step: u64,
    pub location: Location,
    /// The retention rule that allowed it (`keep_last`, `keep_every`, …).
    pub rule: String,
}

/// Retention decided to demote or expire a checkpoint, and the demoter did not: its folder
/// holds what no verified copy would keep (files its commit does not list, written after the
/// commit) or another live checkpoint's folder nests in or overlaps it. The folder is left
/// whole and the decision is tried again each pass; on-call sees it in `stagehand checkpoint
/// list` until a later demotion or expiry of the step folds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
pub struct CheckpointHeld {
    pub run: String,
    pub step: u64,
    /// The folder that was left whole.
    pub location: Location,
    /// What retention decided and could not carry out (`demote to capacity (keep_last)`,
    /// `expire (expired)`).
    pub decision: String,
    /// Why it was not carried out, for a person.
    pub reason: String,
    /// Paths (relative to `location`) the folder holds that the commit does not list: the
    /// first [`CheckpointHeld::MAX_LISTED`] of them, in path order.
    #[serde(default)]
    pub unlisted: Vec<String>,
    /// How many such paths there are in all.
    #[serde(default)]
    pub unlisted_total: u64,
}

impl CheckpointHeld {
    /// The most unlisted paths one fact names (the count says how many there are).
    pub const MAX_LISTED: usize = 32;
}

/// One node's part of a checkpoint step, written to that node's local tier and committed
/// there by the training job (`stagehand checkpoint commit --tier local --node N --part I
/// --parts K`). The training-visible commit: the step is not the run's latest until every
/// part is offloaded ([`CheckpointPartOffloaded`]) and the step's [`CheckpointCommitted`]
/// published.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
pub struct CheckpointPartCommitted {
    /// Training run name.
    pub run: String,
    pub step: u64,
    /// This part's index, `0..parts`.
    pub part: u32,
    /// How many parts the step has: it is complete when all are offloaded.
    pub parts: u32,
    /// The node whose local tier holds the part; its agent offloads it.
    pub node: String,
    /// The part's folder on the node's local tier: exactly
    /// [`crate::layout::checkpoint_part_folder`] of the project, run, step and part.
    pub location: Location,
    /// The part's files with their SHA-256, inline (a part's list travels inline only), when
    /// its writer hashed them (writers before `stamps` existed); empty when `stamps` lists the
    /// files instead. The node's agent copies and verifies against these.
    #[serde(default)]
    pub files: Vec<FileRef>,
    /// The part's files by their metadata, read from the node's filesystem with no byte of
    /// data (`stagehand checkpoint commit --tier local` writes these, not `files`): the node's
    /// agent refuses to offload a part any of whose files no longer has its stamp, and hashes
    /// each file as it copies it, stating the SHA-256 in
    /// [`CheckpointPartOffloaded::hashed`]. A part lists its files in `files` or here, not
    /// both.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stamps: Vec<FileStamp>,
    pub total_bytes: u64,
    /// Tags retention honours, carried to the step's commit.
    #[serde(default)]
    pub tags: Vec<String>,
}

impl CheckpointPartCommitted {
    /// Each listed file's path and size, whichever list names them.
    pub fn listed(&self) -> Vec<(&str, u64)> {
        let hashed = self.files.iter().map(|f| (f.path.as_str(), f.size));
        let stamped = self.stamps.iter().map(|f| (f.path.as_str(), f.size));
        hashed.chain(stamped).collect()
    }
}

/// One file of a checkpoint part as its node's filesystem describes it when the part is
/// committed (`statx`): no byte of it read. A file rewritten, touched, replaced or made
/// writable since has another `mtime`, `ctime` or `inode`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
pub struct FileStamp {
    /// Relative to the part's folder.
    #[cfg_attr(feature = "json-schema", schemars(length(min = 1, max = crate::path::MAX_PATH_BYTES)))]
    pub path: String,
    /// Size in bytes.
    pub size: u64,
    /// Last modification, seconds since the Unix epoch.
    pub mtime_secs: i64,
    /// Nanoseconds within `mtime_secs`.
    pub mtime_nanos: u32,
    /// Last status change (any write, `chmod`, link), seconds since the Unix epoch.
    pub ctime_secs: i64,
    /// Nanoseconds within `ctime_secs`.
    pub ctime_nanos: u32,
    /// Inode number on the node's filesystem.
    pub inode: u64,
}

/// A node's agent copied a checkpoint part off the node, verified, onto the offload tier.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
pub struct CheckpointPartOffloaded {
    pub run: String,
    pub step: u64,
    pub part: u32,
    pub parts: u32,
    pub node: String,
    /// Where the part was committed, on the node's local tier.
    pub from: Location,
    /// The part's folder on the offload tier: [`crate::layout::checkpoint_part_folder`].
    pub location: Location,
    pub files: u64,
    pub total_bytes: u64,
    /// Every file copied, with the SHA-256 the agent computed from the bytes it read from the
    /// node (one read, hashed as copied) and proved on the offload tier, inline: what the
    /// step's `checkpoint.committed` lists and a restore verifies. Absent in facts of agents
    /// before it existed (their parts' commits carried the hashes).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hashed: Vec<FileRef>,
}

/// A node's agent removed a checkpoint part from its node's local tier, once its step was
/// committed whole ([`CheckpointCommitted`]) and the catalogue showed the part's verified copy
/// on the offload tier: every byte removed has that copy. Its id follows from the step's
/// commit and the part, so a removal stated twice (a redelivery, another agent) is one fact.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
pub struct CheckpointPartRemoved {
    pub run: String,
    pub step: u64,
    pub part: u32,
    /// The node whose local tier held the part.
    pub node: String,
    /// The part's folder on the node's local tier, now gone.
    pub location: Location,
    /// The verified copy the removal relied on: the part's folder on the offload tier.
    pub offloaded_to: Location,
    pub files: u64,
    pub total_bytes: u64,
}

/// A dataset version was copied to the backup tier and verified.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
pub struct BackupCompleted {
    pub dataset: String,
    #[cfg_attr(
        feature = "json-schema",
        schemars(pattern(crate::json_schema::SHA256_PATTERN))
    )]
    pub version: String,
    pub location: Location,
    pub files: u64,
    pub total_bytes: u64,
}

/// A restore drill read back a sample from backup and it verified.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
pub struct RestoreVerified {
    pub dataset: String,
    #[cfg_attr(
        feature = "json-schema",
        schemars(pattern(crate::json_schema::SHA256_PATTERN))
    )]
    pub version: String,
    pub location: Location,
    pub sampled_files: u64,
    pub sampled_bytes: u64,
}

/// A restore drill failed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
pub struct RestoreFailed {
    pub dataset: String,
    #[cfg_attr(
        feature = "json-schema",
        schemars(pattern(crate::json_schema::SHA256_PATTERN))
    )]
    pub version: String,
    pub location: Location,
    /// The problems found, cut to fit the event bound.
    pub problems: Vec<Problem>,
    /// How many problems there were of each code (`[code, count]`, sorted by code).
    #[serde(default)]
    pub problem_counts: Vec<(String, u64)>,
    /// How many problems there were in all; absent when `problems` is the whole list.
    #[serde(default)]
    pub problems_total: Option<u64>,
}

/// The most attempts a dead letter's history keeps (the first ones and the last ones), so that
/// a dead letter stays under [`crate::wire::MAX_DEAD_LETTER_BYTES`].
pub const MAX_RECORDED_ATTEMPTS: usize = 64;

/// The most bytes of one attempt's error text a dead letter keeps.
pub const MAX_ATTEMPT_ERROR_BYTES: usize = 4096;

/// One failed attempt at handling a message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
pub struct Attempt {
    /// Delivery count of the attempt (1 for the first).
    pub delivery: u64,
    #[serde(with = "time::serde::rfc3339")]
    #[cfg_attr(
        feature = "json-schema",
        schemars(with = "crate::json_schema::Timestamp")
    )]
    pub at: OffsetDateTime,
    pub error: String,
    pub permanent: bool,
}

/// A message a service gave up on: its original bytes and headers, why, and how often it tried.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
pub struct DeadLetter {
    /// The service (consumer) that gave up.
    pub service: String,
    pub stream: String,
    pub consumer: String,
    pub stream_sequence: u64,
    pub subject: String,
    /// Deliveries made before giving up.
    pub delivered: u64,
    /// The message body exactly as received: MessagePack `bin` on the wire, an array of byte
    /// values in JSON.
    #[serde(with = "serde_bytes")]
    #[cfg_attr(feature = "json-schema", schemars(with = "Vec<u8>"))]
    pub original: Vec<u8>,
    /// The message headers as received (name, value), in order.
    #[serde(default)]
    pub headers: Vec<(String, String)>,
    /// Every recorded failed attempt, oldest first.
    pub errors: Vec<Attempt>,
    /// The original event's id, if it decoded far enough to have one.
    #[serde(default)]
    pub original_id: Option<EventId>,
}

/// An operator republished a dead letter's message to its original subject, to have the work
/// done again (`stagehand dlq replay`). Published on `stagehand.dlq.replayed.<service>`, so
/// that on-call can list who replayed what and when beside the dead letters themselves.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
pub struct DeadLetterReplayed {
    /// The service whose dead letter was replayed.
    pub service: String,
    /// The dead letter's event id.
    pub dead_letter_id: EventId,
    /// The dead letter's sequence in `STAGEHAND_DEAD_LETTERS`.
    pub dead_letter_sequence: u64,
    /// The subject the message was republished on (a request or fact subject).
    pub subject: String,
    /// The replayed event's id, when the message decoded.
    #[serde(default)]
    pub original_id: Option<EventId>,
    /// The `Nats-Msg-Id` the replayed copy was published with (a fresh one: the original id
    /// would fall in the duplicate window).
    pub replay_msg_id: String,
    /// Who replayed it (a user or service account name).
    pub replayed_by: String,
}

/// What an operator's action did ([`OperatorAction::action`]).
pub mod action {
    /// `stagehand stage cancel`: a stage request stopped (or, ready, released).
    pub const STAGE_CANCEL: &str = "stage.cancel";
    /// `stagehand dlq discard`: a dead letter no longer waits and is never replayed.
    pub const DLQ_DISCARD: &str = "dlq.discard";
    /// `stagehand dlq replay`: a dead letter's message republished.
    pub const DLQ_REPLAY: &str = "dlq.replay";
}

/// An operator acted on Stagehand — cancelled a stage, discarded or replayed a dead letter —
/// and says who, what, on what and why (when is
/// the envelope's `occurred_at`). Published on `stagehand.fact.operator.action.<project>`,
/// the project acted on (a dead letter's own envelope project), and kept with the facts, so
/// that every intervention stays on record as long as what it changed
/// (`stagehand status --actions`). Only the operator states it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
pub struct OperatorAction {
    /// What was done: one of [`action`] (`stage.cancel`, `dlq.discard`, `dlq.replay`); readers
    /// show one they do not know as it is.
    pub action: String,
    /// Who did it: a user or account name (`$USER@host`, or `STAGEHAND_OPERATOR`).
    pub by: String,
    /// What it was done to, for people: `dead letter 17 of ingest-validator`,
    /// `stage owls@3f2a… on hot for job 4242`.
    pub target: String,
    /// Why, in the operator's words.
    #[serde(default)]
    pub reason: String,
    /// The service whose dead letter it concerns (`dlq.*`).
    #[serde(default)]
    pub service: Option<String>,
    /// The dead letter's event id (`dlq.*`).
    #[serde(default)]
    pub dead_letter_id: Option<EventId>,
    /// The dead letter's sequence in `STAGEHAND_DEAD_LETTERS` (`dlq.*`).
    #[serde(default)]
    pub dead_letter_sequence: Option<u64>,
    /// The stage request it concerns (`stage.cancel`).
    #[serde(default)]
    pub request_id: Option<EventId>,
}
