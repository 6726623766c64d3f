//! The catalogue's records, as the recorder keeps them and as answers carry them.
//!
//! Every record that facts can change carries the [`Stamp`] of the fact that last changed it.
//! A fact changes a record only when its stamp is newer (`occurred_at`, then event id), so the
//! recorder's fold gives the same catalogue whatever order facts arrive in: live with several
//! workers, after redeliveries, or replayed from the stream. Every record is small and of
//! bounded size: lists that grow with use (a dataset's versions, a version's files and
//! requests, its jobs) are records of their own, paged by queries, never fields of another.

use serde::{Deserialize, Serialize};
use stagehand_schemas::{EventId, Location, Problem, ReadyEstimate};
use time::OffsetDateTime;

use crate::time::utc;

/// Which fact last changed a record: ordered by time, then by id so ties are broken the same
/// way everywhere.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Stamp {
    #[serde(with = "utc")]
    pub at: OffsetDateTime,
    pub event_id: EventId,
}

/// A dataset of a project, with how many versions and rejected requests it has (listed by
/// the `versions` and `rejections` queries).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DatasetRecord {
    pub project: String,
    pub dataset: String,
    /// When the first fact about it happened.
    #[serde(with = "utc")]
    pub first_seen: OffsetDateTime,
    /// Versions recorded (validated or prepared).
    pub version_count: u64,
    /// Ingest requests rejected.
    pub rejection_count: u64,
}

/// Who made a version, when, and from what.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Provenance {
    /// Who asked (the uploader), or the service that derived it.
    pub by: String,
    #[serde(with = "utc")]
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

/// One content-addressed version of a dataset. Its files are listed by the `files` query,
/// page by page, in path order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VersionRecord {
    pub project: String,
    pub dataset: String,
    /// The version digest (64 hex characters).
    pub version: String,
    pub file_count: u64,
    pub total_bytes: u64,
    /// The earliest fact that recorded this version; later identical uploads only count in
    /// `request_count`.
    pub provenance: Provenance,
    /// Distinct requests that produced this version (uploads of the same bytes).
    pub request_count: u64,
}

/// The state of a copy of a version on a tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReplicaState {
    /// Mentioned (by a restore drill) but not known to be complete.
    Staging,
    /// Complete and verified.
    Present,
    /// Removed (demoted, expired, drained).
    Removed,
    /// Found damaged (`replica.damaged`): handed to no job, its readiness withdrawn, until a
    /// later copy of it (its repair) makes it present again. `reason` says what was found.
    Damaged,
    /// On a node whose agent went silent past the policy's interval (`replica.unreachable`):
    /// handed to no job, its readiness withdrawn, its bytes not counted in the tier's usage or
    /// the project's quota, until the node's agent re-checks it (`replica.created` when
    /// intact, `replica.damaged` when not). `reason` says since when and why.
    Unreachable,
}

impl ReplicaState {
    /// The state's name, as its JSON writes it (`present`, `unreachable`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            ReplicaState::Staging => "staging",
            ReplicaState::Present => "present",
            ReplicaState::Removed => "removed",
            ReplicaState::Damaged => "damaged",
            ReplicaState::Unreachable => "unreachable",
        }
    }

    /// Whether a copy in this state is withdrawn — there, but handed to no job until it is
    /// checked again: damaged, or on a node out of reach.
    pub fn is_withdrawn(self) -> bool {
        matches!(self, ReplicaState::Damaged | ReplicaState::Unreachable)
    }
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
    /// The node holding this copy, on a node-local tier (each node has its own replica there,
    /// under the same prefix); `None` on a tier every node shares.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// Where the copy is, beneath the tier's root.
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
    /// The newest `replica.verified` of this copy (its scrub read every file back and each
    /// hashed to the listed SHA-256); `None` until the first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_verified: Option<Verification>,
    /// The newest `replica.repaired` of this copy: its damaged files copied again, verified.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_repaired: Option<Repair>,
}

impl ReplicaRecord {
    /// Since when the copy has gone without a scrub's read: its last verification, else its
    /// making (the copy's fact, else the newest fact about it). What the scrub's `oldest` and
    /// `stagehand status`'s "scrub behind" measure.
    pub fn unverified_since(&self) -> Option<OffsetDateTime> {
        (self.last_verified.as_ref().map(|v| v.stamp.at)).or(self
            .copied
            .as_ref()
            .or(self.stamp.as_ref())
            .map(|s| s.at))
    }

    /// Whether a job may be handed this copy: complete and verified (`present`). A copy
    /// found damaged (its repair pending or under way), on a node out of reach
    /// (`unreachable`), removed or withdrawn, or only
    /// mentioned by a restore drill is not. The one rule every view of usable copies applies
    /// (the demoter's survey, `catalogue show`'s holds, `stage where`).
    pub fn is_usable(&self) -> bool {
        self.state == ReplicaState::Present
    }
}

/// A damaged copy repaired from another replica (`replica.repaired`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Repair {
    pub from_tier: String,
    /// Files copied again.
    pub files: u64,
    /// The fact; its `at` is when the repaired copy was published.
    pub stamp: Stamp,
}

/// One tier's scrub coverage, as the catalogue knows it (the `scrub_status` query): what is
/// on the tier (present or damaged copies, every node's), how much of it a scrub verified
/// since a time (the tier's period ago), the copy longest without a verification, and the
/// damaged copies.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierScrub {
    pub tier: String,
    /// Copies present or damaged on the tier (a checkpoint's own copies are not scrubbed).
    pub replicas: u64,
    pub bytes: u64,
    /// Of the present ones, those a scrub verified at or after the query's `verified_since`.
    pub verified_replicas: u64,
    pub verified_bytes: u64,
    /// The present copy whose last verification (else its making) is oldest.
    pub oldest: Option<ReplicaRecord>,
    /// The damaged copies, the first `limit` in (project, dataset, version, node) order.
    pub damaged: Vec<ReplicaRecord>,
    /// How many copies are damaged in all.
    pub damaged_total: u64,
    /// Copies repaired at or after `verified_since` (found damaged and copied again).
    #[serde(default)]
    pub repaired_replicas: u64,
}

/// A replica read back whole and found to hash to what the catalogue lists (`replica.verified`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verification {
    pub files: u64,
    pub total_bytes: u64,
    /// Who read it (`scrub`).
    pub verified_by: String,
    /// The fact; its `at` is when the read finished.
    pub stamp: Stamp,
}

/// One version and its copies on backup tiers: an item of the `backup_status` answer (what
/// `stagehand backup status` shows and what the backup copier's restore drills choose from).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VersionBackups {
    pub project: String,
    pub dataset: String,
    pub version: String,
    /// Files and bytes of the version (from its version record, else from a backup copy).
    pub files: u64,
    pub total_bytes: u64,
    /// Whether the catalogue holds a version record (validated or prepared); a checkpoint's
    /// backup has none.
    pub recorded: bool,
    /// Its replicas on backup tiers, in tier order, with each one's last drill.
    pub backups: Vec<ReplicaRecord>,
}

impl VersionBackups {
    /// The present backup copy on `tier`, if there is one.
    pub fn on(&self, tier: &str) -> Option<&ReplicaRecord> {
        self.backups
            .iter()
            .find(|r| r.tier == tier && r.state == ReplicaState::Present)
    }

    /// Whether some backup tier holds a present copy.
    pub fn is_protected(&self) -> bool {
        self.backups
            .iter()
            .any(|r| r.state == ReplicaState::Present)
    }
}

/// The cursor of a (project, dataset, version) in the `backup_status` query.
pub fn backup_cursor(project: &str, dataset: &str, version: &str) -> String {
    crate::query::cursor::join(project, &format!("{dataset}/{version}"))
}

/// The (project, dataset, version) of a [`backup_cursor`]; `None` when it is not one.
pub fn split_backup_cursor(cursor: &str) -> Option<(String, String, String)> {
    let (project, rest) = crate::query::cursor::split(cursor)?;
    // A version is a hex digest: the last `/` ends the dataset.
    let (dataset, version) = rest.rsplit_once('/')?;
    Some((project, dataset.to_owned(), version.to_owned()))
}

/// Where one stage request stands. Stored states are `pending`, `ready`, `failed` and
/// `released`; `copying` is `pending` while the promoter reports progress.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StageState {
    Pending,
    Copying,
    Ready,
    Failed,
    Released,
}

/// How far the copy of a stage request has come (from the promoter's progress messages).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageProgress {
    pub files_done: u64,
    pub files_total: u64,
    pub bytes_done: u64,
    pub bytes_total: u64,
    #[serde(default)]
    pub eta_seconds: Option<u64>,
}

/// One stage request as a scheduler waits on it: the value of its key
/// `<project>.<hex(request id)>` in the KV bucket [`STAGES_BUCKET`] ([`stage_kv_key`]), and
/// what the `stage_requests` query lists. Written by the catalogue recorder only, from the
/// request, the promoter's facts (`stage.pending`, `stage.ready`, `stage.failed`), the release,
/// and progress messages (`copying`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageStatus {
    pub request_id: EventId,
    pub project: String,
    pub dataset: String,
    /// The version as the request named it (possibly a unique prefix).
    pub version: String,
    /// The full digest, once a fact named it.
    #[serde(default)]
    pub resolved_version: Option<String>,
    pub tier: String,
    #[serde(default)]
    pub node: Option<String>,
    pub job_id: String,
    pub state: StageState,
    /// What a pending request waits for: `validation`, `preparation`, `quota`, `copy`.
    #[serde(default)]
    pub waiting_for: Option<String>,
    /// Why it waits, or why it failed, for a person.
    #[serde(default)]
    pub reason: Option<String>,
    /// Whether a failed request may succeed if asked again later.
    #[serde(default)]
    pub retryable: Option<bool>,
    /// Where the job finds the data (the absolute path on the tier's mount), once ready.
    #[serde(default)]
    pub path: Option<String>,
    #[serde(default)]
    pub progress: Option<StageProgress>,
    /// A copy queued behind others: when it should be ready and what that is based on (while
    /// copying, the progress's `eta_seconds` says it instead).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_estimate: Option<ReadyEstimate>,
    #[serde(with = "utc")]
    pub updated_at: OffsetDateTime,
    /// When the job's hold ends at the latest (the request's `hold_until`); absent: held
    /// until released. See [`StageStatus::holds_at`].
    #[serde(default, with = "utc::option")]
    pub hold_until: Option<OffsetDateTime>,
}

impl StageStatus {
    /// Whether this stage holds its replica at `now`: requested and not released (pending,
    /// copying or ready), and within its job's lifetime (`hold_until`). A replica a stage
    /// holds is never removed.
    pub fn holds_at(&self, now: OffsetDateTime) -> bool {
        matches!(
            self.state,
            StageState::Pending | StageState::Copying | StageState::Ready
        ) && self.hold_until.is_none_or(|until| now < until)
    }
}

/// The KV bucket of [`StageStatus`] records (declared with Stagehand's other buckets in the
/// runtime crate, which provisions it).
pub const STAGES_BUCKET: &str = "stagehand_stages";

/// The key of a stage request's status in [`STAGES_BUCKET`]: `<project>.<hex(request id)>`
/// (hex keeps any id one token).
pub fn stage_kv_key(project: &str, request_id: &EventId) -> String {
    let mut key = String::with_capacity(project.len() + 1 + 2 * request_id.as_str().len());
    key.push_str(project);
    key.push('.');
    for b in request_id.as_str().bytes() {
        key.push_str(&format!("{b:02x}"));
    }
    key
}

/// A rejected ingest request, one record per request, with its reasons: the problems the
/// rejection listed (cut to the contract's bound), the count per code of all of them, and
/// where the full report is (`quarantine`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RejectionRecord {
    pub project: String,
    pub dataset: String,
    pub request_id: EventId,
    pub declared_version: String,
    pub requested_by: String,
    pub source: Location,
    pub problems: Vec<Problem>,
    /// `[code, count]` of every problem, sorted by code.
    pub problem_counts: Vec<(String, u64)>,
    /// Every problem counted, listed or not.
    pub problems_total: u64,
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
    /// Dead letters not replayed since (a replayed one no longer waits; one replayed twice
    /// counts once); absent from a recorder that does not fold replays.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting: Option<u64>,
}

/// How many stage requests are open (of the projects asked about): `pending` counts the
/// `copying` ones too.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpenStageCounts {
    pub pending: u64,
    pub copying: u64,
    pub failed: u64,
}

/// What a project's replicas take on a tier (on one node of a node-local tier).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierProjectUsage {
    pub tier: String,
    #[serde(default)]
    pub node: Option<String>,
    pub project: String,
    pub replicas: u64,
    pub bytes: u64,
}

/// The state of a checkpoint of a training run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CheckpointState {
    Committed,
    Demoted,
    Expired,
}

/// The dataset under which the catalogue lists a run's checkpoints as versions: `ckpt-<run>`
/// (one version per committed step, its digest the manifest's), so that a checkpoint is
/// staged like any version (`stagehand checkpoint restore`) and at the checkpoint priority
/// (`promotion.toml`'s `checkpoint_datasets` default `ckpt-*`).
pub fn checkpoint_dataset(run: &str) -> String {
    format!("{CHECKPOINT_DATASET_PREFIX}{run}")
}

/// What [`checkpoint_dataset`] puts before the run's name.
pub const CHECKPOINT_DATASET_PREFIX: &str = "ckpt-";

/// The `verified_by` of a replica a checkpoint fact records (the committed copy where the run
/// wrote it, the demoted copy where retention put it): retention owns these replicas, not the
/// watermarks (the demoter leaves them to `retention.toml`).
pub const CHECKPOINT_VERIFIED_BY: &str = "checkpoint";

/// A checkpoint. The state register (`state`, `location`, `stamp`, `rule`) follows every
/// checkpoint fact; `total_bytes`, `tags` and `digest` come from its commit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointRecord {
    pub project: String,
    pub run: String,
    pub step: u64,
    /// The latest decision carried out: committed (on the tier it was written to), demoted,
    /// expired.
    pub state: CheckpointState,
    /// Where it is (demoted: the tier it went to; expired: where it was removed from).
    pub location: Location,
    pub stamp: Stamp,
    pub total_bytes: u64,
    pub tags: Vec<String>,
    pub committed: Option<Stamp>,
    /// The retention rule of the latest demotion or expiry (`keep_every`, `tagged:best`,
    /// `expired`, ...); `None` while committed, or for a demotion that named none.
    #[serde(default)]
    pub rule: Option<String>,
    /// The digest of its manifest: its version in dataset [`checkpoint_dataset`]`(run)`.
    /// `None` until its commit is folded.
    #[serde(default)]
    pub digest: Option<String>,
    /// The newest `checkpoint.held`: a demotion or expiry the demoter did not carry out, and
    /// why. It concerns the checkpoint only while it is newer than the state register
    /// ([`CheckpointRecord::held_now`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held: Option<CheckpointHold>,
}

/// One node's part of a checkpoint step committed on node-local tiers: from its
/// `checkpoint.part.committed` and, once it is off the node, its `checkpoint.part.offloaded`
/// (either may fold first: each fills its own fields).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointPartRecord {
    pub project: String,
    pub run: String,
    pub step: u64,
    pub part: u32,
    /// How many parts the step has.
    pub parts: u32,
    /// The node whose local tier holds it.
    pub node: String,
    /// Its folder on the node's local tier.
    pub location: Location,
    /// Its files with their SHA-256 (empty in answers that leave them out, and until they are
    /// known: from its commit when that lists hashes, else from its offload's `hashed`).
    #[serde(default)]
    pub files: Vec<stagehand_schemas::FileRef>,
    pub total_bytes: u64,
    #[serde(default)]
    pub tags: Vec<String>,
    /// Its commit on the node; `None` while only its offload is folded.
    #[serde(default)]
    pub committed: Option<Stamp>,
    /// Its folder on the offload tier, once offloaded.
    #[serde(default)]
    pub offloaded_to: Option<Location>,
    #[serde(default)]
    pub offloaded: Option<Stamp>,
    /// Its removal from the node's local tier (`checkpoint.part.removed`), once its step was
    /// committed whole; `None` while the part is on the node (a newer commit of the part puts
    /// it back there).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub removed: Option<Stamp>,
}

impl CheckpointPartRecord {
    /// Whether the part is durable off its node.
    pub fn is_offloaded(&self) -> bool {
        self.offloaded.is_some()
    }

    /// Whether its folder on the node's local tier was removed.
    pub fn is_removed(&self) -> bool {
        self.removed.is_some()
    }
}

/// Where a checkpoint step committed in parts stands, from its parts' records.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StepParts {
    pub step: u64,
    /// Parts the step has (the largest `parts` any part stated).
    pub parts: u32,
    /// Parts offloaded.
    pub offloaded: u32,
    /// Parts not offloaded, as (part, node); a part never committed is listed with node "?".
    pub on_node: Vec<(u32, String)>,
    /// Bytes of the committed parts not offloaded: on node NVMe only.
    pub bytes_on_node: u64,
    /// The earliest commit of a part not offloaded: when its offload deadline runs from.
    #[serde(skip)]
    pub oldest_on_node: Option<OffsetDateTime>,
}

impl StepParts {
    /// Whether every part is committed and offloaded.
    pub fn complete(&self) -> bool {
        self.on_node.is_empty() && self.offloaded == self.parts
    }

    /// Whether a part still on its node was committed longer than `deadline` before `now`:
    /// its offload is late.
    pub fn late(&self, deadline: std::time::Duration, now: OffsetDateTime) -> bool {
        self.oldest_on_node.is_some_and(|at| {
            now - at > time::Duration::try_from(deadline).unwrap_or(time::Duration::MAX)
        })
    }

    /// The steps of `records` (any order), in step order.
    pub fn of(records: &[CheckpointPartRecord]) -> Vec<StepParts> {
        let mut steps: std::collections::BTreeMap<u64, Vec<&CheckpointPartRecord>> =
            Default::default();
        for r in records {
            steps.entry(r.step).or_default().push(r);
        }
        steps
            .into_iter()
            .map(|(step, parts)| StepParts::one(step, &parts))
            .collect()
    }

    fn one(step: u64, records: &[&CheckpointPartRecord]) -> StepParts {
        let parts = records.iter().map(|r| r.parts).max().unwrap_or(0);
        let mut on_node = Vec::new();
        let mut bytes_on_node = 0;
        let mut oldest_on_node: Option<OffsetDateTime> = None;
        for part in 0..parts {
            match records.iter().find(|r| r.part == part) {
                Some(r) if r.is_offloaded() => {}
                Some(r) => {
                    on_node.push((part, r.node.clone()));
                    bytes_on_node += r.total_bytes;
                    if let Some(c) = &r.committed {
                        oldest_on_node = Some(oldest_on_node.map_or(c.at, |o| o.min(c.at)));
                    }
                }
                None => on_node.push((part, "?".to_owned())),
            }
        }
        let offloaded = records
            .iter()
            .filter(|r| r.part < parts && r.is_offloaded())
            .count() as u32;
        StepParts {
            step,
            parts,
            offloaded,
            on_node,
            bytes_on_node,
            oldest_on_node,
        }
    }
}

/// A demotion or expiry of a checkpoint the demoter left undone, from `checkpoint.held`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointHold {
    /// What retention decided (`demote to capacity (keep_last)`).
    pub decision: String,
    /// Why it was not carried out.
    pub reason: String,
    /// The first unlisted paths the folder holds, and how many there are.
    #[serde(default)]
    pub unlisted: Vec<String>,
    #[serde(default)]
    pub unlisted_total: u64,
    pub stamp: Stamp,
}

impl CheckpointRecord {
    /// The hold that stands now: one newer than the checkpoint's latest demotion, expiry or
    /// commit (a later demotion or expiry carried it out).
    pub fn held_now(&self) -> Option<&CheckpointHold> {
        self.held.as_ref().filter(|h| h.stamp > self.stamp)
    }

    /// The tiers holding the checkpoint: its location's, or none once expired.
    pub fn tiers(&self) -> Vec<&str> {
        match self.state {
            CheckpointState::Expired => Vec::new(),
            CheckpointState::Committed | CheckpointState::Demoted => {
                vec![self.location.tier.as_str()]
            }
        }
    }
}

/// Why the recorder could not fold a fact.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FoldProblemCode {
    /// The manifest the fact references is not in the manifest bucket.
    ManifestMissing,
    /// The manifest object's bytes or counts are not what the reference says.
    ManifestMismatch,
    /// The manifest object is not canonical manifest lines.
    ManifestMalformed,
    /// The manifest could not be fetched (NATS failed or timed out, every retry).
    ManifestUnreachable,
    /// The fact contradicts itself (a version that is not the digest of its files, a file
    /// list both inline and by reference).
    MalformedFact,
    /// A record the fact would write is larger than a record may be.
    RecordTooLarge,
    /// A catalogue record the fact needs does not decode (the store is damaged).
    CorruptRecord,
    /// A location the fact names is not beneath its project's folder (the rule
    /// `outside_project`, `stagehand_schemas::layout`): nothing of it was read or folded.
    OutsideProject,
    /// The fact travelled on another kind's or another project's subject (the rules
    /// `subject_kind`, `subject_project`, `stagehand_schemas::trust`): nothing was folded.
    WrongSubject,
    /// A checkpoint commit whose folder is, contains or lies in the folder of another live
    /// checkpoint of the project.
    CheckpointOverlap,
    /// A code this client does not know yet.
    #[serde(other)]
    Other,
}

/// A fact the recorder could not fold, listed for on-call (`stagehand catalogue problems`).
/// It stays listed until the same fact folds (for instance after its manifest was put back
/// and the catalogue rebuilt, or the fact replayed).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FoldProblem {
    pub event_id: EventId,
    pub kind: String,
    pub project: String,
    pub dataset: Option<String>,
    pub version: Option<String>,
    /// The fact's sequence in `STAGEHAND_FACTS`.
    pub stream_sequence: Option<u64>,
    pub code: FoldProblemCode,
    /// What went wrong, for a person.
    pub detail: String,
    /// When the fact happened.
    #[serde(with = "utc")]
    pub occurred_at: OffsetDateTime,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backup_cursors_split_where_they_were_joined() {
        for (p, d, v) in [("lab-a", "cats", "ab12"), ("p%/x", "a/b", "ff")] {
            let c = backup_cursor(p, d, v);
            assert_eq!(
                split_backup_cursor(&c),
                Some((p.to_owned(), d.to_owned(), v.to_owned()))
            );
        }
        assert_eq!(split_backup_cursor("no-slash"), None);
    }

    #[test]
    fn stage_keys_keep_any_request_id_one_token() {
        let id = EventId::new("slurm-4815162.stage").unwrap();
        let key = stage_kv_key("vision-lab", &id);
        assert_eq!(key, "vision-lab.736c75726d2d343831353136322e7374616765");
        assert_eq!(key.split('.').count(), 2);
    }
}

/// One operator action (an `operator.action` fact), as the recorder keeps it: every one, as
/// long as the facts are kept.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OperatorActionRecord {
    /// The project acted on.
    pub project: String,
    /// `stage.cancel`, `dlq.discard`, `dlq.replay`.
    pub action: String,
    /// Who did it.
    pub by: String,
    /// What it was done to, for people.
    pub target: String,
    /// Why, in the operator's words.
    pub reason: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dead_letter_id: Option<EventId>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dead_letter_sequence: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<EventId>,
    /// When (`at`) and the fact that recorded it.
    pub stamp: Stamp,
}
