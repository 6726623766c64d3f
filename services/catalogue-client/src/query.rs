//! The questions the catalogue answers and the shape of its answers.
//!
//! A query is one JSON document sent to [`stagehand_schemas::subject::CATALOGUE_QUERY`]; the
//! answer is one JSON document, never larger than [`MAX_ANSWER_BYTES`] however large the
//! catalogue. Every list is a page: at most `limit` items ([`DEFAULT_PAGE`] when absent, at
//! most [`MAX_PAGE`]), fewer when the next one would not fit the bound, and `next` — the
//! cursor to pass as `after` for the following page — whenever more remain. Wherever a query
//! names a `version`, a unique prefix of at least [`MIN_VERSION_PREFIX`] characters will do
//! (the answer names the full digest); wherever it may name a `project`, leaving it out
//! means "the only project with a dataset of that name".

use serde::{Deserialize, Serialize};
use stagehand_schemas::FileRef;

use crate::readiness::Readiness;
use crate::records::*;

/// The queue group recorders answer queries in: each query is answered once.
pub const QUEUE_GROUP: &str = "catalogue-recorder";

/// The shortest version prefix a query may use (`stagehand_schemas::layout`, where the rule
/// and why it is shorter than an event's are written once).
pub const MIN_VERSION_PREFIX: usize = stagehand_schemas::layout::MIN_QUERY_VERSION_PREFIX;

/// Items in a page when a query gives no `limit`.
pub const DEFAULT_PAGE: u32 = 100;

/// Items in a list of a `dataset` or `version` answer when the query gives no `limit`.
pub const DEFAULT_DETAIL: u32 = 20;

/// The most damaged copies a `scrub_status` answer lists, whatever `limit` asks.
pub const MAX_DETAIL: u32 = 100;

/// The most items a page holds, whatever `limit` asks.
pub const MAX_PAGE: u32 = 10_000;

/// The most checkpoint parts one [`Query::CheckpointParts`] answers.
pub const MAX_CHECKPOINT_PARTS: usize = 1024;

/// The largest answer, in bytes of JSON: the contract's event bound, well under nats-server's
/// default `max_payload`.
pub const MAX_ANSWER_BYTES: usize = stagehand_schemas::wire::MAX_EVENT_BYTES;

/// A question to the catalogue.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "query", rename_all = "snake_case", deny_unknown_fields)]
pub enum Query {
    /// Datasets in (project, dataset) order, of every project or of one. `after`:
    /// `<project>/<dataset>` (the `next` of the previous page).
    Datasets {
        #[serde(default)]
        project: Option<String>,
        #[serde(default)]
        limit: Option<u32>,
        #[serde(default)]
        after: Option<String>,
    },
    /// One dataset, with the first `limit` versions (oldest first) and their replicas, and
    /// the first `limit` rejections.
    Dataset {
        #[serde(default)]
        project: Option<String>,
        dataset: String,
        #[serde(default)]
        limit: Option<u32>,
    },
    /// A dataset's versions, oldest first. `after`: a version digest.
    Versions {
        #[serde(default)]
        project: Option<String>,
        dataset: String,
        #[serde(default)]
        limit: Option<u32>,
        #[serde(default)]
        after: Option<String>,
    },
    /// One version and its replicas (the first `limit`, in tier order).
    Version {
        #[serde(default)]
        project: Option<String>,
        dataset: String,
        version: String,
        #[serde(default)]
        limit: Option<u32>,
    },
    /// A version's replicas in tier order, a node-local tier's by node. `after`: a tier name,
    /// or `<tier>/<node>` after a node's replica (the `next` of the answer before).
    Replicas {
        #[serde(default)]
        project: Option<String>,
        dataset: String,
        version: String,
        #[serde(default)]
        limit: Option<u32>,
        #[serde(default)]
        after: Option<String>,
    },
    /// A version's files in path order (raw UTF-8 bytes, as in the manifest). `after`: a path.
    Files {
        #[serde(default)]
        project: Option<String>,
        dataset: String,
        version: String,
        #[serde(default)]
        limit: Option<u32>,
        #[serde(default)]
        after: Option<String>,
    },
    /// One file's entry.
    File {
        #[serde(default)]
        project: Option<String>,
        dataset: String,
        version: String,
        path: String,
    },
    /// A dataset's rejected requests in request id order. `after`: a request id.
    Rejections {
        #[serde(default)]
        project: Option<String>,
        dataset: String,
        #[serde(default)]
        limit: Option<u32>,
        #[serde(default)]
        after: Option<String>,
    },
    /// The rejection of one request.
    Rejection {
        #[serde(default)]
        project: Option<String>,
        dataset: String,
        request_id: String,
    },
    /// Stage requests of a job (`job_id`), or of a dataset (`dataset`, and `version`: a digest,
    /// a prefix of one, or a prefix as requests gave it), in request id order within each.
    /// `after`: the `next` of the previous page.
    StageRequests {
        project: String,
        #[serde(default)]
        job_id: Option<String>,
        #[serde(default)]
        dataset: Option<String>,
        #[serde(default)]
        version: Option<String>,
        #[serde(default)]
        limit: Option<u32>,
        #[serde(default)]
        after: Option<String>,
    },
    /// One stage request's status.
    StageRequest { project: String, request_id: String },
    /// Readiness of a version per tier (and node), or on one tier. `after`: `<tier>/<node>`
    /// (an empty node for a shared tier).
    Readiness {
        #[serde(default)]
        project: Option<String>,
        dataset: String,
        version: String,
        #[serde(default)]
        tier: Option<String>,
        #[serde(default)]
        limit: Option<u32>,
        #[serde(default)]
        after: Option<String>,
    },
    /// A training run's checkpoints in step order, each with its state, tier and the rule of
    /// its latest decision. `after`: a step (decimal).
    Checkpoints {
        project: String,
        run: String,
        #[serde(default)]
        limit: Option<u32>,
        #[serde(default)]
        after: Option<String>,
    },
    /// The live (not expired) checkpoints of a project, of any run, whose folder is `prefix`,
    /// lies beneath it or above it (`stagehand_schemas::folders_overlap`): what a new step
    /// committed at `prefix` would overlap. Unpaged (there are few).
    CheckpointsOverlapping { project: String, prefix: String },
    /// The parts of checkpoint steps committed on node-local tiers
    /// (`checkpoint.part.committed`, `checkpoint.part.offloaded`), in (step, part) order.
    /// With `step`: that step's parts with their files (what the step's commit lists). Without:
    /// the parts of every step of the run that is not committed whole yet (no
    /// `checkpoint.committed` folded), without their files. Unpaged: at most
    /// [`MAX_CHECKPOINT_PARTS`] parts.
    CheckpointParts {
        project: String,
        run: String,
        #[serde(default)]
        step: Option<u64>,
    },
    /// The checkpoint parts committed on node-local tier `tier` of `node` (of every node when
    /// absent), of every project, without their files: what the audit of a node's tier must not
    /// take for stray data (a part not offloaded is the only copy), and what `stagehand status`
    /// finds late. At most [`MAX_CHECKPOINT_PARTS`].
    CheckpointPartsOn {
        tier: String,
        #[serde(default)]
        node: Option<String>,
    },
    /// Versions with their backup copies, in (project, dataset, version) order, of every
    /// project or of one: each version the catalogue knows (validated, prepared, or only
    /// backed up, as a checkpoint is) with its replicas on backup tiers (on `tier` only, when
    /// given) and their last restore drills. `protected_only` leaves out versions with no
    /// backup replica. `after`: `<project>/<dataset>/<version>` (the `next` of the previous
    /// page).
    BackupStatus {
        #[serde(default)]
        project: Option<String>,
        #[serde(default)]
        tier: Option<String>,
        #[serde(default)]
        protected_only: bool,
        #[serde(default)]
        limit: Option<u32>,
        #[serde(default)]
        after: Option<String>,
    },
    /// Stage requests that are `pending` (copying included: pending with progress) or
    /// `failed`, across every project or those listed: pending ones oldest change first (the
    /// longest wait first), failed ones newest first, each page with the counts of all of them.
    /// Read from an index of open stages, not from every stage record. `after`: the `next` of
    /// the previous page.
    OpenStages {
        state: StageState,
        #[serde(default)]
        projects: Vec<String>,
        #[serde(default)]
        limit: Option<u32>,
        #[serde(default)]
        after: Option<String>,
    },
    /// Bytes and replicas present per (tier, node, project), on every tier or on `tier`, as
    /// the demoter counts them against watermarks and quotas (a checkpoint's own copy is
    /// retention's, not counted). `after`: the `next` of the previous page.
    TierUsage {
        #[serde(default)]
        tier: Option<String>,
        #[serde(default)]
        limit: Option<u32>,
        #[serde(default)]
        after: Option<String>,
    },
    /// The replicas on `tier`, of `node` only when given (else every node's, and the shared
    /// tier's own), in `state` only when given, in (node, project, dataset, version) order:
    /// a node's agent lists its own unreachable copies to re-check them, the demoter the
    /// present copies whose node it watches, `stagehand status` the unreachable ones.
    /// `after`: the `next` of the previous page.
    ReplicasOn {
        tier: String,
        #[serde(default)]
        node: Option<String>,
        #[serde(default)]
        state: Option<ReplicaState>,
        #[serde(default)]
        limit: Option<u32>,
        #[serde(default)]
        after: Option<String>,
    },
    /// One tier's scrub coverage ([`TierScrub`]): its copies and bytes, those verified by a
    /// scrub at or after `verified_since`, the copy longest unverified, and the first `limit`
    /// damaged copies (at most [`MAX_DETAIL`]) with how many there are.
    ScrubStatus {
        tier: String,
        #[serde(with = "crate::time::utc")]
        verified_since: ::time::OffsetDateTime,
        #[serde(default)]
        limit: Option<u32>,
    },
    /// Dead letters counted per service, in service order, each with how many still wait (not
    /// replayed). `after`: a service name.
    DeadLetters {
        #[serde(default)]
        limit: Option<u32>,
        #[serde(default)]
        after: Option<String>,
    },
    /// Every operator action (`operator.action`: a stage cancelled, a dead letter discarded
    /// or replayed, a stage released by reconcile), newest first. `after`: the `next` of the
    /// previous page.
    OperatorActions {
        #[serde(default)]
        limit: Option<u32>,
        #[serde(default)]
        after: Option<String>,
    },
    /// Facts the recorder could not fold, in event id order. `after`: an event id.
    Problems {
        #[serde(default)]
        limit: Option<u32>,
        #[serde(default)]
        after: Option<String>,
    },
    /// Where a dataset's versions come from: each raw version (oldest first) with the
    /// versions derived from it and every version's replicas per tier. With `version`, the one
    /// lineage that version belongs to. `after`: a raw version's digest (the `next` of the
    /// previous page).
    Lineage {
        #[serde(default)]
        project: Option<String>,
        dataset: String,
        #[serde(default)]
        version: Option<String>,
        #[serde(default)]
        limit: Option<u32>,
        #[serde(default)]
        after: Option<String>,
    },
}

/// Why a query failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    NotFound,
    Ambiguous,
    BadQuery,
    Internal,
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ErrorCode::NotFound => "not_found",
            ErrorCode::Ambiguous => "ambiguous",
            ErrorCode::BadQuery => "bad_query",
            ErrorCode::Internal => "internal",
        })
    }
}

/// The catalogue's answer to one [`Query`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "answer", rename_all = "snake_case")]
pub enum Answer {
    Datasets {
        datasets: Vec<DatasetRecord>,
        next: Option<String>,
    },
    Dataset(DatasetDetail),
    Versions {
        versions: Vec<VersionRecord>,
        next: Option<String>,
    },
    Version(VersionDetail),
    Replicas {
        replicas: Vec<ReplicaRecord>,
        next: Option<String>,
    },
    Files {
        /// The full digest the query's version named.
        version: String,
        files: Vec<FileRef>,
        next: Option<String>,
    },
    File {
        version: String,
        file: FileRef,
    },
    Rejections {
        rejections: Vec<RejectionRecord>,
        next: Option<String>,
    },
    Rejection {
        rejection: RejectionRecord,
    },
    StageRequests {
        stages: Vec<StageStatus>,
        next: Option<String>,
    },
    StageRequest {
        stage: StageStatus,
    },
    Readiness {
        readiness: Vec<Readiness>,
        next: Option<String>,
    },
    Checkpoints {
        checkpoints: Vec<CheckpointRecord>,
        next: Option<String>,
    },
    CheckpointParts {
        parts: Vec<CheckpointPartRecord>,
    },
    BackupStatus {
        versions: Vec<VersionBackups>,
        next: Option<String>,
    },
    OpenStages {
        stages: Vec<StageStatus>,
        /// How many stages are open, in every page.
        counts: OpenStageCounts,
        next: Option<String>,
    },
    TierUsage {
        usage: Vec<TierProjectUsage>,
        next: Option<String>,
    },
    ReplicasOn {
        replicas: Vec<ReplicaRecord>,
        next: Option<String>,
    },
    ScrubStatus(Box<TierScrub>),
    DeadLetters {
        services: Vec<DeadLetterRecord>,
        next: Option<String>,
    },
    OperatorActions {
        actions: Vec<OperatorActionRecord>,
        next: Option<String>,
    },
    Problems {
        problems: Vec<FoldProblem>,
        /// Every fact listed as a problem, on every page.
        total: u64,
        next: Option<String>,
    },
    Lineage {
        /// One tree per raw version.
        lineage: Vec<LineageNode>,
        next: Option<String>,
    },
    Error {
        code: ErrorCode,
        message: String,
    },
}

impl Answer {
    pub fn error(code: ErrorCode, message: impl Into<String>) -> Self {
        Answer::Error {
            code,
            message: message.into(),
        }
    }
}

/// A dataset, the first page of its versions (oldest first) with their replicas, and the
/// first page of its rejections: the answer to `catalogue show D`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DatasetDetail {
    pub dataset: DatasetRecord,
    pub versions: Vec<VersionRecord>,
    /// `after` for the `versions` query, when more versions remain.
    pub versions_next: Option<String>,
    /// Replicas of the versions listed.
    pub replicas: Vec<ReplicaRecord>,
    pub rejections: Vec<RejectionRecord>,
    /// `after` for the `rejections` query, when more rejections remain.
    pub rejections_next: Option<String>,
}

/// One version and the first page of its replicas: the head of `catalogue show D@V` (the
/// files come from the `files` query).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VersionDetail {
    pub version: VersionRecord,
    pub replicas: Vec<ReplicaRecord>,
    /// `after` for the `replicas` query, when more replicas remain.
    pub replicas_next: Option<String>,
}

/// A version in a lineage: its record, its replicas per tier (the first [`DEFAULT_DETAIL`]),
/// and the versions derived from it (a prepared version's `derived_from` names its parent).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LineageNode {
    pub version: VersionRecord,
    pub replicas: Vec<ReplicaRecord>,
    pub derived: Vec<LineageNode>,
    /// Whether replicas or derived versions were left out to keep the answer bounded.
    #[serde(default)]
    pub truncated: bool,
}

/// Cursors of two parts (`<project>/<dataset>`, `<tier>/<job>`): the first part with `%` and
/// `/` escaped, a `/`, the second part as it is.
pub mod cursor {
    /// The cursor of `(first, second)`.
    pub fn join(first: &str, second: &str) -> String {
        let mut out = first.replace('%', "%25").replace('/', "%2F");
        out.push('/');
        out.push_str(second);
        out
    }

    /// The two parts of a cursor made by [`join`]; `None` when it is not one.
    pub fn split(cursor: &str) -> Option<(String, String)> {
        let (first, second) = cursor.split_once('/')?;
        Some((
            first.replace("%2F", "/").replace("%25", "%"),
            second.to_owned(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_json_is_the_documented_shape() {
        let q: Query = serde_json::from_str(r#"{"query":"datasets"}"#).unwrap();
        assert_eq!(
            q,
            Query::Datasets {
                project: None,
                limit: None,
                after: None
            }
        );
        let q: Query = serde_json::from_str(
            r#"{"query":"files","dataset":"cats","version":"3f2a9c01","limit":5,"after":"a/b"}"#,
        )
        .unwrap();
        assert!(
            matches!(q, Query::Files { limit: Some(5), ref after, .. } if after.as_deref() == Some("a/b"))
        );
        assert!(serde_json::from_str::<Query>(r#"{"query":"datasets","x":1}"#).is_err());
        let a = serde_json::to_value(Answer::error(ErrorCode::NotFound, "x")).unwrap();
        assert_eq!(a["answer"], "error");
        assert_eq!(a["code"], "not_found");
        let a = serde_json::to_value(Answer::Files {
            version: "v".into(),
            files: vec![],
            next: None,
        })
        .unwrap();
        assert_eq!(
            a,
            serde_json::json!({"answer":"files","version":"v","files":[],"next":null})
        );
    }

    #[test]
    fn cursors_split_where_they_were_joined() {
        for (a, b) in [("hot", "job/1"), ("a/b%2F", "c"), ("", "")] {
            assert_eq!(
                cursor::split(&cursor::join(a, b)),
                Some((a.to_owned(), b.to_owned()))
            );
        }
    }
}
