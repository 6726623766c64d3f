//! Answers to catalogue queries (the [`stagehand_catalogue`] protocol), from the store, over
//! NATS request/reply.
//!
//! Every list is read with a range over its table from the cursor on, and cut at the query's
//! `limit` or when the next item would take the answer past its byte budget (measured as the
//! JSON it becomes), so no answer exceeds [`MAX_ANSWER_BYTES`] whatever the catalogue holds.
//! A page of a version's files costs one range lookup and the decoding of the chunks it
//! touches, so it is as fast on a version of 14 million files as on one of ten.
//!
//! An answer goes only to an inbox: a reply subject that begins with one of the configured
//! inbox prefixes ([`Replies`]). A query's reply subject is the asker's to choose, so anything
//! else — a KV key (`$KV.stagehand_promoter.quota.hot`), a facts subject, an inbox of a user
//! the recorder does not answer — is refused without publishing a byte, logged and counted
//! (`stagehand_queries_refused_total`): the recorder's user would otherwise write there.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use futures::StreamExt;
use redb::{ReadTransaction, ReadableTable, ReadableTableMetadata};
use serde::Serialize;
use serde::de::DeserializeOwned;
use stagehand_catalogue::*;
use stagehand_schemas::FileRef;
use stagehand_schemas::subject::CATALOGUE_QUERY;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::chunk;
use crate::error::{RecorderError, StoreError};
use crate::model::ReadinessAggregate;
use crate::readiness::{derive, replica_of};
use crate::store::*;

/// Bytes of an answer kept for what is not an item of its list (the answer's tag, a version
/// record, the `next` cursor — a path of up to 4096 bytes escaped as JSON).
const ANSWER_RESERVE: usize = 64 * 1024;

/// Queries answered at once by one recorder.
const QUERIES_AT_ONCE: usize = 8;

/// Why a query got no list: an error answer to send, or a store failure.
enum Fail {
    Answer(ErrorCode, String),
    Store(StoreError),
}

impl From<StoreError> for Fail {
    fn from(e: StoreError) -> Self {
        Fail::Store(e)
    }
}

macro_rules! from_redb {
    ($($t:ty),*) => {$(
        impl From<$t> for Fail {
            fn from(e: $t) -> Self {
                Fail::Store(e.into())
            }
        }
    )*};
}
from_redb!(redb::TableError, redb::StorageError);

fn not_found(message: String) -> Fail {
    Fail::Answer(ErrorCode::NotFound, message)
}

fn bad_query(message: String) -> Fail {
    Fail::Answer(ErrorCode::BadQuery, message)
}

/// Bytes `value` takes as JSON.
fn json_len<T: Serialize>(value: &T) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0 += b.len();
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut c = Count(0);
    let _ = serde_json::to_writer(&mut c, value);
    c.0
}

/// Collects one page: at most `limit` items within `budget` bytes of JSON.
struct Page<T> {
    items: Vec<T>,
    /// Whether the first item is taken whatever its size (every record fits an answer); off
    /// where a list shares an answer with others that already take their first.
    first_always: bool,
    limit: usize,
    budget: usize,
    used: usize,
    /// The cursor of the last item taken.
    last: Option<String>,
    /// Set once an item did not fit: the cursor to continue after.
    next: Option<String>,
}

impl<T: Serialize> Page<T> {
    fn new(limit: Option<u32>, default: u32, budget: usize) -> Self {
        Page {
            items: Vec::new(),
            first_always: true,
            limit: limit.unwrap_or(default).clamp(1, MAX_PAGE) as usize,
            budget,
            used: 0,
            last: None,
            next: None,
        }
    }

    /// Takes `item` (whose cursor is `cursor`) if it fits; returns false once the page is
    /// full, with `next` set — the caller stops reading.
    fn offer(&mut self, item: T, cursor: impl FnOnce() -> String) -> bool {
        let size = json_len(&item) + 1;
        let fits = self.items.len() < self.limit
            && (self.used + size <= self.budget || (self.items.is_empty() && self.first_always));
        if !fits {
            self.next = self.last.take();
            return false;
        }
        self.used += size;
        self.items.push(item);
        self.last = Some(cursor());
        true
    }

    fn done(self) -> (Vec<T>, Option<String>) {
        (self.items, self.next)
    }
}

fn read<T: DeserializeOwned>(bytes: &[u8], what: impl FnOnce() -> String) -> Result<T, StoreError> {
    decode(bytes, what)
}

/// Answers a query from the store. Store failures become `internal` answers.
pub fn answer(store: &Store, query: &Query) -> Answer {
    let result = store
        .reader()
        .map_err(Fail::Store)
        .and_then(|txn| try_answer(&txn, query));
    match result {
        Ok(answer) => answer,
        Err(Fail::Answer(code, message)) => Answer::error(code, message),
        Err(Fail::Store(e)) => Answer::error(ErrorCode::Internal, e.to_string()),
    }
}

const BUDGET: usize = MAX_ANSWER_BYTES - ANSWER_RESERVE;

fn try_answer(txn: &ReadTransaction, query: &Query) -> Result<Answer, Fail> {
    Ok(match query {
        Query::Datasets {
            project,
            limit,
            after,
        } => {
            let (datasets, next) = datasets(txn, project.as_deref(), *limit, after.as_deref())?;
            Answer::Datasets { datasets, next }
        }
        Query::Dataset {
            project,
            dataset,
            limit,
        } => Answer::Dataset(dataset_detail(txn, project, dataset, *limit)?),
        Query::Versions {
            project,
            dataset,
            limit,
            after,
        } => {
            let project = resolve_project(txn, project, dataset)?;
            let (versions, next) = versions(
                txn,
                &project,
                dataset,
                *limit,
                DEFAULT_PAGE,
                after.as_deref(),
                BUDGET,
            )?;
            Answer::Versions { versions, next }
        }
        Query::Version {
            project,
            dataset,
            version,
            limit,
        } => {
            let version = resolve_version(txn, project, dataset, version)?;
            // The version record shares the answer with its replicas.
            let budget = BUDGET.saturating_sub(json_len(&version));
            let (replicas, replicas_next) =
                replicas(txn, &version, *limit, DEFAULT_DETAIL, None, budget, true)?;
            Answer::Version(VersionDetail {
                version,
                replicas,
                replicas_next,
            })
        }
        Query::Replicas {
            project,
            dataset,
            version,
            limit,
            after,
        } => {
            let version = resolve_version(txn, project, dataset, version)?;
            let (replicas, next) = replicas(
                txn,
                &version,
                *limit,
                DEFAULT_PAGE,
                after.as_deref(),
                BUDGET,
                true,
            )?;
            Answer::Replicas { replicas, next }
        }
        Query::Files {
            project,
            dataset,
            version,
            limit,
            after,
        } => {
            let version = resolve_version(txn, project, dataset, version)?;
            let (files, next) = files(txn, &version.version, *limit, after.as_deref())?;
            Answer::Files {
                version: version.version,
                files,
                next,
            }
        }
        Query::File {
            project,
            dataset,
            version,
            path,
        } => {
            let version = resolve_version(txn, project, dataset, version)?;
            match file(txn, &version.version, path)? {
                Some(file) => Answer::File {
                    version: version.version,
                    file,
                },
                None => {
                    return Err(not_found(format!(
                        "no file {path:?} in version {} of {}/{}",
                        version.version, version.project, version.dataset
                    )));
                }
            }
        }
        Query::Rejections {
            project,
            dataset,
            limit,
            after,
        } => {
            let project = resolve_project(txn, project, dataset)?;
            let (rejections, next) = rejections(
                txn,
                &project,
                dataset,
                *limit,
                DEFAULT_PAGE,
                after.as_deref(),
                BUDGET,
            )?;
            Answer::Rejections { rejections, next }
        }
        Query::Rejection {
            project,
            dataset,
            request_id,
        } => {
            let project = resolve_project(txn, project, dataset)?;
            let key = (project.as_str(), dataset.as_str(), request_id.as_str());
            let what = || format!("rejection {key:?}");
            match txn.open_table(REJECTIONS)?.get(key)? {
                Some(v) => Answer::Rejection {
                    rejection: read(v.value(), what)?,
                },
                None => {
                    return Err(not_found(format!(
                        "no rejection of request {request_id:?} for {project}/{dataset}"
                    )));
                }
            }
        }
        Query::StageRequests {
            project,
            job_id,
            dataset,
            version,
            limit,
            after,
        } => {
            let (stages, next) = stage_requests(
                txn,
                project,
                job_id.as_deref(),
                dataset.as_deref(),
                version.as_deref(),
                *limit,
                after.as_deref(),
            )?;
            Answer::StageRequests { stages, next }
        }
        Query::StageRequest {
            project,
            request_id,
        } => match crate::stage::status_in(txn, project, request_id)? {
            Some((stage, _)) => Answer::StageRequest { stage },
            None => {
                return Err(not_found(format!(
                    "no stage request {request_id:?} in project {project:?}"
                )));
            }
        },
        Query::Readiness {
            project,
            dataset,
            version,
            tier,
            limit,
            after,
        } => {
            let version = resolve_version(txn, project, dataset, version)?;
            let (readiness, next) =
                readiness(txn, &version, tier.as_deref(), *limit, after.as_deref())?;
            Answer::Readiness { readiness, next }
        }
        Query::Checkpoints {
            project,
            run,
            limit,
            after,
        } => {
            let (checkpoints, next) = checkpoints(txn, project, run, *limit, after.as_deref())?;
            Answer::Checkpoints { checkpoints, next }
        }
        Query::CheckpointParts { project, run, step } => Answer::CheckpointParts {
            parts: crate::parts::parts(txn, project, run, *step)?,
        },
        Query::CheckpointPartsOn { tier, node } => Answer::CheckpointParts {
            parts: crate::parts::parts_on(txn, tier, node.as_deref())?,
        },
        Query::CheckpointsOverlapping { project, prefix } => {
            let table = txn.open_table(CHECKPOINTS)?;
            let checkpoints = crate::fold::overlapping_checkpoints(&table, project, prefix)?;
            Answer::Checkpoints {
                checkpoints,
                next: None,
            }
        }
        Query::BackupStatus {
            project,
            tier,
            protected_only,
            limit,
            after,
        } => {
            let (versions, next) = backup_status(
                txn,
                project.as_deref(),
                tier.as_deref(),
                *protected_only,
                *limit,
                after.as_deref(),
            )?;
            Answer::BackupStatus { versions, next }
        }
        Query::DeadLetters { limit, after } => {
            let (mut services, next): (Vec<DeadLetterRecord>, _) =
                by_name(txn, DEAD_LETTERS, *limit, after.as_deref(), "dead letters")?;
            let waiting = txn.open_table(DEAD_LETTERS_WAITING)?;
            for s in &mut services {
                s.waiting = Some(waiting.get(s.service.as_str())?.map_or(0, |v| v.value()));
            }
            Answer::DeadLetters { services, next }
        }
        Query::OpenStages {
            state,
            projects,
            limit,
            after,
        } => {
            let (stages, counts, next) =
                open_stages(txn, *state, projects, *limit, after.as_deref())?;
            Answer::OpenStages {
                stages,
                counts,
                next,
            }
        }
        Query::ScrubStatus {
            tier,
            verified_since,
            limit,
        } => Answer::ScrubStatus(Box::new(scrub_status(txn, tier, *verified_since, *limit)?)),
        Query::TierUsage { tier, limit, after } => {
            let (usage, next) = tier_usage(txn, tier.as_deref(), *limit, after.as_deref())?;
            Answer::TierUsage { usage, next }
        }
        Query::ReplicasOn {
            tier,
            node,
            state,
            limit,
            after,
        } => {
            let (replicas, next) = replicas_on(
                txn,
                (tier, node.as_deref()),
                *state,
                *limit,
                after.as_deref(),
            )?;
            Answer::ReplicasOn { replicas, next }
        }
        Query::OperatorActions { limit, after } => {
            let (actions, next) = by_name(
                txn,
                OPERATOR_ACTIONS,
                *limit,
                after.as_deref(),
                "operator action",
            )?;
            Answer::OperatorActions { actions, next }
        }
        Query::Problems { limit, after } => {
            let total = txn.open_table(PROBLEMS)?.len()?;
            let (problems, next) = by_name(txn, PROBLEMS, *limit, after.as_deref(), "problem")?;
            Answer::Problems {
                problems,
                total,
                next,
            }
        }
        Query::Lineage {
            project,
            dataset,
            version,
            limit,
            after,
        } => {
            let (lineage, next) = lineage(
                txn,
                project,
                dataset,
                version.as_deref(),
                *limit,
                after.as_deref(),
            )?;
            Answer::Lineage { lineage, next }
        }
    })
}

/// The project of `dataset`: the one given, or the only project that has a dataset so named.
fn resolve_project(
    txn: &ReadTransaction,
    project: &Option<String>,
    dataset: &str,
) -> Result<String, Fail> {
    if let Some(p) = project {
        return Ok(p.clone());
    }
    let names = txn.open_table(DATASET_NAMES)?;
    let mut projects = Vec::new();
    for row in names.range((dataset, "")..)? {
        let (k, _) = row?;
        let (name, project) = k.value();
        if name != dataset || projects.len() > 20 {
            break;
        }
        projects.push(project.to_owned());
    }
    match projects.len() {
        0 => Err(not_found(format!(
            "no dataset {dataset:?} in the catalogue"
        ))),
        1 => Ok(projects.remove(0)),
        _ => Err(Fail::Answer(
            ErrorCode::Ambiguous,
            format!(
                "dataset {dataset:?} exists in several projects ({}): name the project",
                projects.join(", ")
            ),
        )),
    }
}

fn dataset_record(
    txn: &ReadTransaction,
    project: &str,
    dataset: &str,
) -> Result<DatasetRecord, Fail> {
    match txn.open_table(DATASETS)?.get((project, dataset))? {
        Some(v) => Ok(read(v.value(), || format!("dataset {project}/{dataset}"))?),
        None => Err(not_found(format!(
            "no dataset {dataset:?} in project {project:?}"
        ))),
    }
}

/// The version a digest or a unique prefix names.
fn resolve_version(
    txn: &ReadTransaction,
    project: &Option<String>,
    dataset: &str,
    version: &str,
) -> Result<VersionRecord, Fail> {
    if version.len() < MIN_VERSION_PREFIX {
        return Err(bad_query(format!(
            "version {version:?} is too short: give at least {MIN_VERSION_PREFIX} characters of the digest"
        )));
    }
    let project = resolve_project(txn, project, dataset)?;
    let table = txn.open_table(VERSIONS)?;
    let mut found = Vec::new();
    for row in table.range((project.as_str(), dataset, version)..)? {
        let (k, v) = row?;
        let (p, d, digest) = k.value();
        if p != project || d != dataset || !digest.starts_with(version) || found.len() == 2 {
            break;
        }
        found.push(read::<VersionRecord>(v.value(), || {
            format!("version {p}/{d}/{digest}")
        })?);
    }
    match found.len() {
        0 => Err(not_found(format!(
            "no version {version:?} of dataset {dataset:?} in project {project:?}"
        ))),
        1 => Ok(found.remove(0)),
        _ => Err(Fail::Answer(
            ErrorCode::Ambiguous,
            format!(
                "version prefix {version:?} matches several versions of {dataset:?}; give more characters"
            ),
        )),
    }
}

fn datasets(
    txn: &ReadTransaction,
    project: Option<&str>,
    limit: Option<u32>,
    after: Option<&str>,
) -> Result<(Vec<DatasetRecord>, Option<String>), Fail> {
    let start: (String, String) = match after {
        Some(cursor) => cursor::split(cursor)
            .ok_or_else(|| bad_query(format!("{cursor:?} is not a dataset cursor")))?,
        None => (project.unwrap_or("").to_owned(), String::new()),
    };
    let table = txn.open_table(DATASETS)?;
    let mut page = Page::new(limit, DEFAULT_PAGE, BUDGET);
    for row in table.range((start.0.as_str(), start.1.as_str())..)? {
        let (k, v) = row?;
        let (p, d) = k.value();
        if after.is_some() && (p, d) == (start.0.as_str(), start.1.as_str()) {
            continue;
        }
        if project.is_some_and(|want| want != p) {
            break;
        }
        let record: DatasetRecord = read(v.value(), || format!("dataset {p}/{d}"))?;
        if !page.offer(record, || cursor::join(p, d)) {
            break;
        }
    }
    Ok(page.done())
}

fn dataset_detail(
    txn: &ReadTransaction,
    project: &Option<String>,
    dataset: &str,
    limit: Option<u32>,
) -> Result<DatasetDetail, Fail> {
    let project = resolve_project(txn, project, dataset)?;
    let record = dataset_record(txn, &project, dataset)?;
    let (versions, versions_next) = versions(
        txn,
        &project,
        dataset,
        limit,
        DEFAULT_DETAIL,
        None,
        BUDGET / 4,
    )?;
    let mut replicas_of_versions = Vec::new();
    let mut left = BUDGET / 4;
    for v in &versions {
        let (rs, _) = replicas(txn, v, None, DEFAULT_DETAIL, None, left, false)?;
        left = left.saturating_sub(rs.iter().map(|r| json_len(r) + 1).sum());
        replicas_of_versions.extend(rs);
        if left == 0 {
            break;
        }
    }
    let (rejections, rejections_next) = rejections(
        txn,
        &project,
        dataset,
        limit,
        DEFAULT_DETAIL,
        None,
        BUDGET / 2,
    )?;
    Ok(DatasetDetail {
        dataset: record,
        versions,
        versions_next,
        replicas: replicas_of_versions,
        rejections,
        rejections_next,
    })
}

fn versions(
    txn: &ReadTransaction,
    project: &str,
    dataset: &str,
    limit: Option<u32>,
    default: u32,
    after: Option<&str>,
    budget: usize,
) -> Result<(Vec<VersionRecord>, Option<String>), Fail> {
    let table = txn.open_table(VERSIONS)?;
    let order = txn.open_table(VERSION_ORDER)?;
    let start: (i128, String) = match after {
        Some(digest) => match table.get((project, dataset, digest))? {
            Some(v) => {
                let r: VersionRecord = read(v.value(), || format!("version {digest}"))?;
                (r.provenance.at.unix_timestamp_nanos(), digest.to_owned())
            }
            None => {
                return Err(bad_query(format!(
                    "{digest:?} is not a version of {project}/{dataset}"
                )));
            }
        },
        None => (i128::MIN, String::new()),
    };
    let mut page = Page::new(limit, default, budget);
    for row in order.range((project, dataset, start.0, start.1.as_str())..)? {
        let (k, _) = row?;
        let (p, d, at, digest) = k.value();
        if p != project || d != dataset {
            break;
        }
        if after.is_some() && (at, digest) == (start.0, start.1.as_str()) {
            continue;
        }
        let Some(v) = table.get((p, d, digest))? else {
            continue;
        };
        let record: VersionRecord = read(v.value(), || format!("version {p}/{d}/{digest}"))?;
        if !page.offer(record, || digest.to_owned()) {
            break;
        }
    }
    Ok(page.done())
}

fn replicas(
    txn: &ReadTransaction,
    version: &VersionRecord,
    limit: Option<u32>,
    default: u32,
    after: Option<&str>,
    budget: usize,
    first_always: bool,
) -> Result<(Vec<ReplicaRecord>, Option<String>), Fail> {
    let (p, d, v) = (
        version.project.as_str(),
        version.dataset.as_str(),
        version.version.as_str(),
    );
    let after = after.map(replica_cursor_parts);
    let (t0, n0) = after.clone().unwrap_or_default();
    let table = txn.open_table(REPLICAS)?;
    let mut page = Page::new(limit, default, budget);
    page.first_always = first_always;
    for row in table.range((p, d, v, t0.as_str(), n0.as_str())..)? {
        let (k, val) = row?;
        let key = k.value();
        if (key.0, key.1, key.2) != (p, d, v) {
            break;
        }
        if after
            .as_ref()
            .is_some_and(|(t, n)| (t.as_str(), n.as_str()) == (key.3, key.4))
        {
            continue;
        }
        let record: ReplicaRecord = read(val.value(), || format!("replica {key:?}"))?;
        let cursor = replica_cursor(key.3, key.4);
        if !page.offer(record, || cursor) {
            break;
        }
    }
    Ok(page.done())
}

/// The `after` of the replica after (tier, node): the tier name for a shared tier's replica,
/// `<tier>/<node>` for a node's.
fn replica_cursor(tier: &str, node: &str) -> String {
    if node.is_empty() {
        tier.to_owned()
    } else {
        cursor::join(tier, node)
    }
}

/// (tier, node or "") of a [`replica_cursor`]; a bare tier name is the shared replica's.
fn replica_cursor_parts(after: &str) -> (String, String) {
    cursor::split(after).unwrap_or_else(|| (after.to_owned(), String::new()))
}

fn files(
    txn: &ReadTransaction,
    digest: &str,
    limit: Option<u32>,
    after: Option<&str>,
) -> Result<(Vec<FileRef>, Option<String>), Fail> {
    let chunks = txn.open_table(FILE_CHUNKS)?;
    let damaged = |e: chunk::ChunkError| {
        Fail::Store(StoreError::Corrupt {
            key: format!("file chunk of {digest}"),
            detail: e.to_string(),
        })
    };
    // The chunk holding the first entry after `after`: the last one starting at or before it.
    let start = match after {
        Some(after) => chunks
            .range((digest, "")..=(digest, after))?
            .next_back()
            .transpose()?
            .map(|(k, _)| k.value().1.to_owned()),
        None => None,
    };
    let mut page = Page::new(limit, DEFAULT_PAGE, BUDGET);
    for row in chunks.range((digest, start.as_deref().unwrap_or(""))..)? {
        let (k, v) = row?;
        if k.value().0 != digest {
            break;
        }
        for file in chunk::decode(v.value()).map_err(damaged)? {
            if after.is_some_and(|a| file.path.as_bytes() <= a.as_bytes()) {
                continue;
            }
            let path = file.path.clone();
            if !page.offer(file, || path) {
                return Ok(page.done());
            }
        }
    }
    Ok(page.done())
}

fn file(txn: &ReadTransaction, digest: &str, path: &str) -> Result<Option<FileRef>, Fail> {
    let chunks = txn.open_table(FILE_CHUNKS)?;
    let Some(row) = chunks.range((digest, "")..=(digest, path))?.next_back() else {
        return Ok(None);
    };
    let (_, v) = row?;
    let entries = chunk::decode(v.value()).map_err(|e| {
        Fail::Store(StoreError::Corrupt {
            key: format!("file chunk of {digest}"),
            detail: e.to_string(),
        })
    })?;
    Ok(entries
        .binary_search_by(|f| f.path.as_bytes().cmp(path.as_bytes()))
        .ok()
        .map(|i| entries[i].clone()))
}

/// A run's checkpoints in step order, after step `after`.
fn checkpoints(
    txn: &ReadTransaction,
    project: &str,
    run: &str,
    limit: Option<u32>,
    after: Option<&str>,
) -> Result<(Vec<CheckpointRecord>, Option<String>), Fail> {
    let after: Option<u64> = after
        .map(|a| {
            a.parse()
                .map_err(|_| bad_query(format!("checkpoint cursor {a:?} is not a step")))
        })
        .transpose()?;
    let first = match after {
        Some(step) => match step.checked_add(1) {
            Some(first) => first,
            None => return Ok((Vec::new(), None)),
        },
        None => 0,
    };
    let table = txn.open_table(CHECKPOINTS)?;
    let mut page = Page::new(limit, DEFAULT_PAGE, BUDGET);
    for row in table.range((project, run, first)..=(project, run, u64::MAX))? {
        let (k, v) = row?;
        let (_, _, step) = k.value();
        let record: CheckpointRecord =
            read(v.value(), || format!("checkpoint {project}/{run}/{step}"))?;
        if !page.offer(record, || step.to_string()) {
            break;
        }
    }
    Ok(page.done())
}

fn rejections(
    txn: &ReadTransaction,
    project: &str,
    dataset: &str,
    limit: Option<u32>,
    default: u32,
    after: Option<&str>,
    budget: usize,
) -> Result<(Vec<RejectionRecord>, Option<String>), Fail> {
    let table = txn.open_table(REJECTIONS)?;
    let mut page = Page::new(limit, default, budget);
    for row in table.range((project, dataset, after.unwrap_or(""))..)? {
        let (k, v) = row?;
        let (p, d, request) = k.value();
        if (p, d) != (project, dataset) {
            break;
        }
        if after == Some(request) {
            continue;
        }
        let record: RejectionRecord = read(v.value(), || format!("rejection {p}/{d}/{request}"))?;
        if !page.offer(record, || request.to_owned()) {
            break;
        }
    }
    Ok(page.done())
}

/// How deep a lineage is followed (raw → prepared → a version derived from that …).
const LINEAGE_DEPTH: usize = 4;

/// A dataset's lineage: its versions grouped into trees by `derived_from`, one tree per
/// raw version (a version whose parent is not a version of the dataset counts as raw),
/// oldest first; with `version`, only the tree holding it. One pass over the dataset's
/// versions finds every parent link, so a page costs a read of the dataset's version records.
fn lineage(
    txn: &ReadTransaction,
    project: &Option<String>,
    dataset: &str,
    version: Option<&str>,
    limit: Option<u32>,
    after: Option<&str>,
) -> Result<(Vec<LineageNode>, Option<String>), Fail> {
    let project = resolve_project(txn, project, dataset)?;
    let table = txn.open_table(VERSIONS)?;
    let order = txn.open_table(VERSION_ORDER)?;
    // Every version in version order, and its parent.
    let mut versions: Vec<VersionRecord> = Vec::new();
    for row in order.range((project.as_str(), dataset, i128::MIN, "")..)? {
        let (k, _) = row?;
        let (p, d, _, digest) = k.value();
        if p != project || d != dataset {
            break;
        }
        if let Some(v) = table.get((p, d, digest))? {
            versions.push(read(v.value(), || format!("version {p}/{d}/{digest}"))?);
        }
    }
    let index: std::collections::HashMap<&str, usize> = versions
        .iter()
        .enumerate()
        .map(|(i, v)| (v.version.as_str(), i))
        .collect();
    let parent = |v: &VersionRecord| {
        v.provenance
            .derived_from
            .as_deref()
            .and_then(|p| index.get(p).copied())
            .filter(|&p| versions[p].version != v.version)
    };
    let mut children: Vec<Vec<usize>> = vec![Vec::new(); versions.len()];
    for (i, v) in versions.iter().enumerate() {
        if let Some(p) = parent(v) {
            children[p].push(i);
        }
    }
    let roots: Vec<usize> = match version {
        Some(wanted) => {
            let found = resolve_version(txn, &Some(project.clone()), dataset, wanted)?;
            let Some(&found_at) = index.get(found.version.as_str()) else {
                return Err(not_found(format!(
                    "version {} of {project}/{dataset} is not in the version order",
                    found.version
                )));
            };
            let mut at = found_at;
            for _ in 0..LINEAGE_DEPTH {
                match parent(&versions[at]) {
                    Some(p) => at = p,
                    None => break,
                }
            }
            vec![at]
        }
        None => (0..versions.len())
            .filter(|&i| parent(&versions[i]).is_none())
            .collect(),
    };
    let start = match after {
        Some(after) => match roots.iter().position(|&r| versions[r].version == after) {
            Some(i) => i + 1,
            None => {
                return Err(bad_query(format!(
                    "{after:?} is not a raw version of {project}/{dataset}"
                )));
            }
        },
        None => 0,
    };
    let mut page = Page::new(limit, DEFAULT_DETAIL, BUDGET);
    for &root in &roots[start..] {
        let mut left = BUDGET.saturating_sub(page.used);
        let node = lineage_node(txn, &versions, &children, root, LINEAGE_DEPTH, &mut left)?;
        let digest = versions[root].version.clone();
        if !page.offer(node, || digest) {
            break;
        }
    }
    Ok(page.done())
}

/// One version's node: its replicas and, while `left` bytes allow, its derived versions.
fn lineage_node(
    txn: &ReadTransaction,
    versions: &[VersionRecord],
    children: &[Vec<usize>],
    at: usize,
    depth: usize,
    left: &mut usize,
) -> Result<LineageNode, Fail> {
    let version = versions[at].clone();
    *left = left.saturating_sub(json_len(&version));
    let (replicas, replicas_next) =
        replicas(txn, &version, None, DEFAULT_DETAIL, None, *left, false)?;
    *left = left.saturating_sub(replicas.iter().map(|r| json_len(r) + 1).sum());
    let mut node = LineageNode {
        version,
        replicas,
        derived: Vec::new(),
        truncated: replicas_next.is_some(),
    };
    for &child in &children[at] {
        if depth == 0 || *left < ANSWER_RESERVE / 16 {
            node.truncated = true;
            break;
        }
        node.derived.push(lineage_node(
            txn,
            versions,
            children,
            child,
            depth - 1,
            left,
        )?);
    }
    Ok(node)
}

fn two_part_cursor(after: Option<&str>) -> Result<Option<(String, String)>, Fail> {
    after
        .map(|c| {
            cursor::split(c)
                .ok_or_else(|| bad_query(format!("{c:?} is not a <tier>/<name> cursor")))
        })
        .transpose()
}

/// A page of open stages of one state from the `stages_open` index (pending oldest first,
/// failed newest first), and the counts of every open stage of `projects` (all when empty):
/// keys only, the records of the page's stages alone are read.
fn open_stages(
    txn: &ReadTransaction,
    state: StageState,
    projects: &[String],
    limit: Option<u32>,
    after: Option<&str>,
) -> Result<(Vec<StageStatus>, OpenStageCounts, Option<String>), Fail> {
    use crate::stage::{OPEN_FAILED, OPEN_PENDING};
    let code = match state {
        StageState::Pending | StageState::Copying => OPEN_PENDING,
        StageState::Failed => OPEN_FAILED,
        StageState::Ready | StageState::Released => {
            return Err(bad_query(
                "open_stages lists pending or failed stages".into(),
            ));
        }
    };
    let wanted = |project: &str| projects.is_empty() || projects.iter().any(|p| p == project);
    let open = txn.open_table(STAGES_OPEN)?;
    let mut counts = OpenStageCounts::default();
    for row in open.iter()? {
        let (k, _) = row?;
        let (s, _, project, _) = k.value();
        if wanted(project) {
            match s {
                OPEN_PENDING => counts.pending += 1,
                _ => counts.failed += 1,
            }
        }
    }
    for row in txn.open_table(STAGE_PROGRESS)?.iter()? {
        let (k, _) = row?;
        if wanted(k.value().0) {
            counts.copying += 1;
        }
    }
    // The cursor: `<ns>/<project>/<request id>` of the last stage of the previous page.
    let start: Option<(i128, String, String)> = match after {
        None => None,
        Some(c) => {
            let parsed = cursor::split(c).and_then(|(ns, rest)| {
                let (project, id) = rest.split_once('/')?;
                Some((ns.parse::<i128>().ok()?, project.to_owned(), id.to_owned()))
            });
            Some(parsed.ok_or_else(|| bad_query(format!("{c:?} is not an open_stages cursor")))?)
        }
    };
    let mut page = Page::new(limit, DEFAULT_PAGE, BUDGET);
    let mut offer = |at: i128, project: &str, id: &str| -> Result<bool, Fail> {
        if !wanted(project) {
            return Ok(true);
        }
        match crate::stage::status_in(txn, project, id)? {
            Some((status, _)) => Ok(page.offer(status, || {
                cursor::join(&at.to_string(), &format!("{project}/{id}"))
            })),
            None => Ok(true),
        }
    };
    if code == OPEN_PENDING {
        let from = match &start {
            Some((at, p, id)) => (code, *at, p.as_str(), id.as_str()),
            None => (code, i128::MIN, "", ""),
        };
        for row in open.range(from..(code + 1, i128::MIN, "", ""))? {
            let (k, _) = row?;
            let (_, at, project, id) = k.value();
            if start
                .as_ref()
                .is_some_and(|(a, p, i)| (*a, p.as_str(), i.as_str()) == (at, project, id))
            {
                continue;
            }
            if !offer(at, project, id)? {
                break;
            }
        }
    } else {
        let to = match &start {
            Some((at, p, id)) => (code, *at, p.as_str(), id.as_str()),
            None => (code + 1, i128::MIN, "", ""),
        };
        for row in open.range((code, i128::MIN, "", "")..to)?.rev() {
            let (k, _) = row?;
            let (_, at, project, id) = k.value();
            if !offer(at, project, id)? {
                break;
            }
        }
    }
    let (stages, next) = page.done();
    Ok((stages, counts, next))
}

/// Bytes and replicas present per (tier, node, project): one pass over the replicas table
/// (a few rows per version, whatever its file count), summed, then paged in (tier, node,
/// project) order. A replica counts with the larger of its own and its version's byte count
/// and is left out when it is a checkpoint's own copy, as the demoter's survey does.
/// One tier's scrub coverage: one pass over the replicas table (as `tier_usage`), the
/// damaged copies listed up to `limit` (at most [`MAX_DETAIL`]).
fn scrub_status(
    txn: &ReadTransaction,
    tier: &str,
    verified_since: ::time::OffsetDateTime,
    limit: Option<u32>,
) -> Result<TierScrub, Fail> {
    let limit = limit.unwrap_or(DEFAULT_DETAIL).clamp(1, MAX_DETAIL) as usize;
    let replicas = txn.open_table(REPLICAS)?;
    let mut out = TierScrub {
        tier: tier.to_owned(),
        replicas: 0,
        bytes: 0,
        verified_replicas: 0,
        verified_bytes: 0,
        oldest: None,
        damaged: Vec::new(),
        damaged_total: 0,
        repaired_replicas: 0,
    };
    let mut oldest_since = None;
    for row in replicas.iter()? {
        let (k, v) = row?;
        let (project, dataset, version, t, _node) = k.value();
        if t != tier {
            continue;
        }
        let r: ReplicaRecord = read(v.value(), || {
            format!("replica {project}/{dataset}/{version} on {t}")
        })?;
        if !matches!(r.state, ReplicaState::Present | ReplicaState::Damaged)
            || r.verified_by.as_deref() == Some(CHECKPOINT_VERIFIED_BY)
        {
            continue;
        }
        out.replicas += 1;
        out.bytes += r.total_bytes;
        if (r.last_repaired.as_ref()).is_some_and(|rep| rep.stamp.at >= verified_since) {
            out.repaired_replicas += 1;
        }
        if r.state == ReplicaState::Damaged {
            out.damaged_total += 1;
            if out.damaged.len() < limit {
                out.damaged.push(r);
            }
            continue;
        }
        let last = r.last_verified.as_ref().map(|v| v.stamp.at);
        if last.is_some_and(|at| at >= verified_since) {
            out.verified_replicas += 1;
            out.verified_bytes += r.total_bytes;
        }
        let since = r.unverified_since();
        if out.oldest.is_none() || since < oldest_since {
            oldest_since = since;
            out.oldest = Some(r);
        }
    }
    Ok(out)
}

fn tier_usage(
    txn: &ReadTransaction,
    tier: Option<&str>,
    limit: Option<u32>,
    after: Option<&str>,
) -> Result<(Vec<TierProjectUsage>, Option<String>), Fail> {
    use std::collections::BTreeMap;
    let replicas = txn.open_table(REPLICAS)?;
    let versions = txn.open_table(VERSIONS)?;
    let mut sums: BTreeMap<(String, String, String), (u64, u64)> = BTreeMap::new();
    for row in replicas.iter()? {
        let (k, v) = row?;
        let (project, dataset, version, t, node) = k.value();
        if tier.is_some_and(|want| want != t) {
            continue;
        }
        let r: ReplicaRecord = read(v.value(), || {
            format!("replica {project}/{dataset}/{version} on {t}")
        })?;
        if r.state != ReplicaState::Present
            || r.verified_by.as_deref() == Some(CHECKPOINT_VERIFIED_BY)
        {
            continue;
        }
        let version_bytes = match versions.get((project, dataset, version))? {
            Some(v) => {
                read::<VersionRecord>(v.value(), || {
                    format!("version {project}/{dataset}/{version}")
                })?
                .total_bytes
            }
            None => 0,
        };
        let sum = sums
            .entry((t.to_owned(), node.to_owned(), project.to_owned()))
            .or_default();
        sum.0 += 1;
        sum.1 += r.total_bytes.max(version_bytes);
    }
    let start = match after {
        None => None,
        Some(c) => {
            let parsed = cursor::split(c).and_then(|(t, rest)| {
                let (node, project) = cursor::split(&rest)?;
                Some((t, node, project))
            });
            Some(parsed.ok_or_else(|| bad_query(format!("{c:?} is not a tier_usage cursor")))?)
        }
    };
    let mut page = Page::new(limit, DEFAULT_PAGE, BUDGET);
    for ((t, node, project), (replicas, bytes)) in sums {
        if let Some((st, sn, sp)) = &start
            && (t.as_str(), node.as_str(), project.as_str())
                <= (st.as_str(), sn.as_str(), sp.as_str())
        {
            continue;
        }
        let cursor = cursor::join(&t, &cursor::join(&node, &project));
        let usage = TierProjectUsage {
            tier: t,
            node: (!node.is_empty()).then_some(node),
            project,
            replicas,
            bytes,
        };
        if !page.offer(usage, || cursor) {
            break;
        }
    }
    Ok(page.done())
}

/// The cursor of a replica key: (project, dataset, version, tier, node), each part escaped.
fn replica_key_cursor(key: (&str, &str, &str, &str, &str)) -> String {
    let (project, dataset, version, tier, node) = key;
    cursor::join(
        project,
        &cursor::join(dataset, &cursor::join(version, &cursor::join(tier, node))),
    )
}

/// The replica key of a [`replica_key_cursor`]; `None` when it is not one.
fn split_replica_cursor(c: &str) -> Option<(String, String, String, String, String)> {
    let (project, rest) = cursor::split(c)?;
    let (dataset, rest) = cursor::split(&rest)?;
    let (version, rest) = cursor::split(&rest)?;
    let (tier, node) = cursor::split(&rest)?;
    Some((project, dataset, version, tier, node))
}

/// The replicas on `tier` (of `node`, when given) in `state` (when given), in (node, project,
/// dataset, version) order: the index of replicas by place read from the cursor on, so the
/// answer costs the replicas of that tier (or node), not every replica. The cursor is the
/// replica's own key.
fn replicas_on(
    txn: &ReadTransaction,
    (tier, node): (&str, Option<&str>),
    state: Option<ReplicaState>,
    limit: Option<u32>,
    after: Option<&str>,
) -> Result<(Vec<ReplicaRecord>, Option<String>), Fail> {
    let start = match after {
        None => None,
        Some(c) => Some(
            split_replica_cursor(c)
                .ok_or_else(|| bad_query(format!("{c:?} is not a replicas_on cursor")))?,
        ),
    };
    let by_place = txn.open_table(REPLICAS_BY_PLACE)?;
    let replicas = txn.open_table(REPLICAS)?;
    let rows = match &start {
        None => by_place.range((tier, node.unwrap_or(""), "", "", "")..)?,
        Some((p, d, v, t, n)) => {
            by_place.range((t.as_str(), n.as_str(), p.as_str(), d.as_str(), v.as_str())..)?
        }
    };
    let mut page = Page::new(limit, DEFAULT_PAGE, BUDGET);
    for row in rows {
        let (k, _) = row?;
        let (t, n, project, dataset, version) = k.value();
        if t != tier || node.is_some_and(|want| want != n) {
            break;
        }
        let key = (project, dataset, version, t, n);
        if start.as_ref().is_some_and(|(p, d, v, t, n)| {
            (p.as_str(), d.as_str(), v.as_str(), t.as_str(), n.as_str()) == key
        }) {
            continue;
        }
        let Some(value) = replicas.get(key)? else {
            continue;
        };
        let r: ReplicaRecord = read(value.value(), || {
            format!("replica {project}/{dataset}/{version} on {t}")
        })?;
        if state.is_some_and(|want| want != r.state) {
            continue;
        }
        if !page.offer(r, || replica_key_cursor(key)) {
            break;
        }
    }
    Ok(page.done())
}

/// Versions in (project, dataset, version) order with their backup replicas: one pass over
/// the replicas table (every recorded version has its source replica there, a checkpoint's
/// backup its backup replica), grouped by version.
fn backup_status(
    txn: &ReadTransaction,
    project: Option<&str>,
    tier: Option<&str>,
    protected_only: bool,
    limit: Option<u32>,
    after: Option<&str>,
) -> Result<(Vec<VersionBackups>, Option<String>), Fail> {
    let start: (String, String, String) = match after {
        Some(c) => split_backup_cursor(c).ok_or_else(|| {
            bad_query(format!(
                "{c:?} is not a <project>/<dataset>/<version> cursor"
            ))
        })?,
        None => (
            project.unwrap_or("").to_owned(),
            String::new(),
            String::new(),
        ),
    };
    let table = txn.open_table(REPLICAS)?;
    let versions = txn.open_table(VERSIONS)?;
    let mut page = Page::new(limit, DEFAULT_PAGE, BUDGET);
    // Offers a finished group; false once the page is full.
    let offer = |mut g: VersionBackups, page: &mut Page<VersionBackups>| -> Result<bool, Fail> {
        if protected_only && g.backups.is_empty() {
            return Ok(true);
        }
        let key = (g.project.as_str(), g.dataset.as_str(), g.version.as_str());
        if let Some(v) = versions.get(key)? {
            let record: VersionRecord = read(v.value(), || format!("version {key:?}"))?;
            g.files = record.file_count;
            g.total_bytes = record.total_bytes;
            g.recorded = true;
        }
        let cursor = backup_cursor(&g.project, &g.dataset, &g.version);
        Ok(page.offer(g, || cursor))
    };
    // After a cursor, start past every tier of its version: those were on the previous page.
    let past_tiers = if after.is_some() { "\u{10FFFF}" } else { "" };
    let from = (
        start.0.as_str(),
        start.1.as_str(),
        start.2.as_str(),
        past_tiers,
        "",
    );
    let mut group: Option<VersionBackups> = None;
    for row in table.range(from..)? {
        let (k, v) = row?;
        // Backup tiers are shared, never node-local: the node part of the key is empty.
        let (p, d, ver, t, _node) = k.value();
        if project.is_some_and(|want| want != p) {
            break;
        }
        let same = group.as_ref().is_some_and(|g| {
            (g.project.as_str(), g.dataset.as_str(), g.version.as_str()) == (p, d, ver)
        });
        if !same {
            if let Some(done) = group.take()
                && !offer(done, &mut page)?
            {
                return Ok(page.done());
            }
            group = Some(VersionBackups {
                project: p.to_owned(),
                dataset: d.to_owned(),
                version: ver.to_owned(),
                files: 0,
                total_bytes: 0,
                recorded: false,
                backups: Vec::new(),
            });
        }
        let record: ReplicaRecord = read(v.value(), || format!("replica {p}/{d}/{ver}/{t}"))?;
        if let Some(g) = group.as_mut()
            && record.backup
            && tier.is_none_or(|want| want == t)
        {
            if g.backups.is_empty() {
                g.files = record.files;
                g.total_bytes = record.total_bytes;
            }
            g.backups.push(record);
        }
    }
    if let Some(done) = group.take() {
        offer(done, &mut page)?;
    }
    Ok(page.done())
}

fn stage_requests(
    txn: &ReadTransaction,
    project: &str,
    job_id: Option<&str>,
    dataset: Option<&str>,
    version: Option<&str>,
    limit: Option<u32>,
    after: Option<&str>,
) -> Result<(Vec<StageStatus>, Option<String>), Fail> {
    let mut page = Page::new(limit, DEFAULT_PAGE, BUDGET);
    let offer = |page: &mut Page<StageStatus>, id: &str, cursor: String| -> Result<bool, Fail> {
        match crate::stage::status_in(txn, project, id)? {
            Some((status, _)) => Ok(page.offer(status, || cursor)),
            None => Ok(true),
        }
    };
    if let Some(job) = job_id {
        let table = txn.open_table(STAGES_BY_JOB)?;
        for row in table.range((project, job, after.unwrap_or(""))..)? {
            let (k, _) = row?;
            let (p, j, id) = k.value();
            if (p, j) != (project, job) {
                break;
            }
            if after == Some(id) {
                continue;
            }
            if !offer(&mut page, id, id.to_owned())? {
                break;
            }
        }
    } else if let Some(dataset) = dataset {
        let prefix = version.unwrap_or("");
        let start = two_part_cursor(after)?;
        let (v0, id0) = start
            .clone()
            .unwrap_or_else(|| (prefix.to_owned(), String::new()));
        let table = txn.open_table(STAGES_BY_VERSION)?;
        for row in table.range((project, dataset, v0.as_str(), id0.as_str())..)? {
            let (k, _) = row?;
            let (p, d, v, id) = k.value();
            if (p, d) != (project, dataset) || !v.starts_with(prefix) {
                break;
            }
            if start
                .as_ref()
                .is_some_and(|(sv, sid)| (sv.as_str(), sid.as_str()) == (v, id))
            {
                continue;
            }
            if !offer(&mut page, id, cursor::join(v, id))? {
                break;
            }
        }
    } else {
        return Err(bad_query(
            "a stage_requests query names a job_id or a dataset".into(),
        ));
    }
    Ok(page.done())
}

fn readiness(
    txn: &ReadTransaction,
    version: &VersionRecord,
    tier: Option<&str>,
    limit: Option<u32>,
    after: Option<&str>,
) -> Result<(Vec<Readiness>, Option<String>), Fail> {
    let (p, d, v) = (
        version.project.as_str(),
        version.dataset.as_str(),
        version.version.as_str(),
    );
    let after = two_part_cursor(after)?;
    let (t0, n0) = after
        .clone()
        .unwrap_or_else(|| (tier.unwrap_or("").to_owned(), String::new()));
    let table = txn.open_table(READINESS)?;
    let mut page = Page::new(limit, DEFAULT_PAGE, BUDGET);
    for row in table.range((p, d, v, t0.as_str(), n0.as_str())..)? {
        let (k, val) = row?;
        let key = k.value();
        if (key.0, key.1, key.2) != (p, d, v) || tier.is_some_and(|t| t != key.3) {
            break;
        }
        if after
            .as_ref()
            .is_some_and(|(t, n)| (t.as_str(), n.as_str()) == (key.3, key.4))
        {
            continue;
        }
        let aggregate: ReadinessAggregate = read(val.value(), || format!("readiness {key:?}"))?;
        let rkey = ReadinessKey {
            project: p.into(),
            dataset: d.into(),
            version: v.into(),
            tier: key.3.into(),
            node: (!key.4.is_empty()).then(|| key.4.to_owned()),
        };
        let replica = replica_of(txn, &rkey)?;
        let c = cursor::join(key.3, key.4);
        if !page.offer(derive(rkey, &aggregate, replica.as_ref()), || c) {
            break;
        }
    }
    Ok(page.done())
}

fn by_name<T: DeserializeOwned + Serialize>(
    txn: &ReadTransaction,
    table: redb::TableDefinition<&'static str, &'static [u8]>,
    limit: Option<u32>,
    after: Option<&str>,
    what: &str,
) -> Result<(Vec<T>, Option<String>), Fail> {
    let table = txn.open_table(table)?;
    let mut page = Page::new(limit, DEFAULT_PAGE, BUDGET);
    for row in table.range(after.unwrap_or("")..)? {
        let (k, v) = row?;
        let name = k.value();
        if after == Some(name) {
            continue;
        }
        let record: T = read(v.value(), || format!("{what} {name}"))?;
        if !page.offer(record, || name.to_owned()) {
            break;
        }
    }
    Ok(page.done())
}

/// The answer's bytes; an answer that would exceed the bound (it cannot, by construction) is
/// replaced by an `internal` error rather than sent.
pub fn encode_answer(answer: &Answer) -> Vec<u8> {
    let bytes = serde_json::to_vec(answer).unwrap_or_default();
    if bytes.len() <= MAX_ANSWER_BYTES {
        return bytes;
    }
    tracing::error!(bytes = bytes.len(), "a catalogue answer exceeded its bound");
    serde_json::to_vec(&Answer::error(
        ErrorCode::Internal,
        format!(
            "the answer would be {} bytes, over the bound of {MAX_ANSWER_BYTES}",
            bytes.len()
        ),
    ))
    .unwrap_or_default()
}

/// Where answers may go: reply subjects beginning with one of these inbox prefixes, and how
/// many queries asked for another.
#[derive(Debug, Clone)]
pub struct Replies {
    /// Each ends with `.`, so `_INBOX_scheduler.` admits no `_INBOX_schedulerX.…`.
    prefixes: Vec<String>,
    refused: Arc<AtomicU64>,
}

/// The longest reply subject shown in a log line: the asker chooses it.
const SHOWN_REPLY_CHARS: usize = 160;

impl Replies {
    /// Answers to inboxes of `prefixes` (each with or without its trailing `.`).
    pub fn new<S: AsRef<str>>(prefixes: impl IntoIterator<Item = S>) -> Self {
        let mut prefixes: Vec<String> = prefixes
            .into_iter()
            .map(|p| format!("{}.", p.as_ref().trim_end_matches('.')))
            .collect();
        prefixes.sort();
        prefixes.dedup();
        Self {
            prefixes,
            refused: Arc::default(),
        }
    }

    /// Whether an answer may be published on `reply`: an inbox of a configured prefix (one more
    /// token at least) and a plain subject, no wildcard, no blank.
    pub fn admits(&self, reply: &str) -> bool {
        let plain = !reply
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || matches!(c, '*' | '>'));
        plain
            && !reply.contains("..")
            && !reply.ends_with('.')
            && self
                .prefixes
                .iter()
                .any(|p| reply.len() > p.len() && reply.starts_with(p.as_str()))
    }

    /// Queries refused so far.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    fn refuse(&self, reply: &str) {
        self.refused.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(
            stagehand_telemetry::names::QUERIES_REFUSED_TOTAL,
            stagehand_telemetry::names::label::SERVICE => crate::SERVICE
        )
        .increment(1);
        let shown: String = reply.chars().take(SHOWN_REPLY_CHARS).collect();
        tracing::warn!(reply = %shown, "a catalogue query asked for its answer on a subject that is no inbox the recorder answers: refused, nothing published");
    }
}

/// Serves queries until `shutdown` is cancelled, answering only where `replies` admits.
pub async fn serve(
    client: async_nats::Client,
    store: Arc<Store>,
    replies: Replies,
    shutdown: CancellationToken,
) -> Result<(), RecorderError> {
    let mut subscription = client
        .queue_subscribe(CATALOGUE_QUERY, QUEUE_GROUP.into())
        .await
        .map_err(|e| RecorderError::nats("subscribing to catalogue queries", e))?;
    let slots = Arc::new(Semaphore::new(QUERIES_AT_ONCE));
    let mut tasks = tokio::task::JoinSet::new();
    loop {
        let message = tokio::select! {
            _ = shutdown.cancelled() => break,
            message = subscription.next() => match message {
                Some(m) => m,
                None => break,
            },
        };
        let Some(reply) = message.reply.clone() else {
            continue;
        };
        if !replies.admits(reply.as_str()) {
            replies.refuse(reply.as_str());
            continue;
        }
        let Ok(slot) = slots.clone().acquire_owned().await else {
            break;
        };
        let store = store.clone();
        let client = client.clone();
        while tasks.try_join_next().is_some() {}
        tasks.spawn(async move {
            let answered = tokio::task::spawn_blocking(move || {
                let answer = match serde_json::from_slice::<Query>(&message.payload) {
                    Ok(query) => answer(&store, &query),
                    Err(e) => {
                        Answer::error(ErrorCode::BadQuery, format!("not a catalogue query: {e}"))
                    }
                };
                encode_answer(&answer)
            })
            .await;
            let bytes = answered.unwrap_or_else(|e| {
                encode_answer(&Answer::error(ErrorCode::Internal, e.to_string()))
            });
            if let Err(e) = client.publish(reply, bytes.into()).await {
                tracing::warn!(error = %e, "could not send a catalogue answer");
            }
            drop(slot);
        });
    }
    let _ = subscription.unsubscribe().await;
    while tasks.join_next().await.is_some() {}
    Ok(())
}

#[cfg(test)]
mod tests {
    use stagehand_manifest::Manifest;

    /// Guards the reply rule: only inboxes of the configured prefixes, never a KV key, a
    /// facts subject, a prefix's look-alike or a wildcard.
    #[test]
    fn answers_go_only_to_inboxes_of_the_configured_prefixes() {
        let replies = super::Replies::new(["_INBOX", "_INBOX_scheduler.", "_INBOX_operator"]);
        for ok in [
            "_INBOX.abc.1",
            "_INBOX_scheduler.Xy7.2",
            "_INBOX_operator.q",
        ] {
            assert!(replies.admits(ok), "{ok}");
        }
        for refused in [
            "$KV.stagehand_promoter.quota.hot",
            "stagehand.fact.dataset.validated.labb",
            "_INBOX_promoter.abc",
            "_INBOX_schedulerX.abc",
            "_INBOX_scheduler.",
            "_INBOX_scheduler",
            "_INBOX.>",
            "_INBOX.*.x",
            "_INBOX.a b",
            "_INBOX..x",
            "",
        ] {
            assert!(!replies.admits(refused), "{refused:?}");
        }
    }
    use stagehand_schemas::{FileRef, sha256_hex};

    use super::*;
    use crate::testing::*;

    /// `backup_status` lists every version with its backup copies and their drills, pages
    /// without repeating or skipping a version, and can leave out unprotected versions.
    #[test]
    fn backup_status_lists_versions_with_their_backups_and_drills() {
        use stagehand_schemas::{
            BackupCompleted, Body, Event, Location, Problem, RestoreFailed, RestoreVerified,
        };
        let dir = tempfile::tempdir().unwrap();
        let (v1, v2, v3) = (validated(1), validated(2), validated(3));
        let backup = |v: &Event, tier: &str| {
            v.caused(
                &format!("backup:{tier}"),
                Body::BackupCompleted(BackupCompleted {
                    dataset: "cats".into(),
                    version: version_of(v),
                    location: Location {
                        tier: tier.into(),
                        prefix: format!("lab-a/cats/{}", version_of(v)),
                    },
                    files: 2,
                    total_bytes: 3,
                }),
            )
        };
        let location = |v: &Event| Location {
            tier: "backup".into(),
            prefix: format!("lab-a/cats/{}", version_of(v)),
        };
        // Backed up first, drilled after, as the copier does.
        let backups = [
            backup(&v1, "backup"),
            backup(&v1, "offsite"),
            backup(&v2, "backup"),
        ];
        let ok = v1.caused(
            "drill",
            Body::RestoreVerified(RestoreVerified {
                dataset: "cats".into(),
                version: version_of(&v1),
                location: location(&v1),
                sampled_files: 2,
                sampled_bytes: 3,
            }),
        );
        let failed = v2.caused(
            "drill",
            Body::RestoreFailed(RestoreFailed {
                dataset: "cats".into(),
                version: version_of(&v2),
                location: location(&v2),
                problems: vec![Problem::new("checksum_mismatch", Some("f2.bin"), "bad")],
                problem_counts: vec![("checksum_mismatch".into(), 1)],
                problems_total: Some(1),
            }),
        );
        let events = [
            v1.clone(),
            v2.clone(),
            v3.clone(),
            backups[0].clone(),
            backups[1].clone(),
            backups[2].clone(),
            ok,
            failed,
        ];
        let store = store_with(dir.path(), "a.redb", &events);
        let ask =
            |tier: Option<&str>, protected_only: bool, limit, after: Option<String>| match answer(
                &store,
                &Query::BackupStatus {
                    project: Some("lab-a".into()),
                    tier: tier.map(Into::into),
                    protected_only,
                    limit,
                    after,
                },
            ) {
                Answer::BackupStatus { versions, next } => (versions, next),
                other => panic!("{other:?}"),
            };
        let (all, next) = ask(None, false, None, None);
        assert_eq!(next, None);
        assert_eq!(all.len(), 3, "{all:#?}");
        let of = |v: &Event| {
            all.iter()
                .find(|e| e.version == version_of(v))
                .unwrap()
                .clone()
        };
        assert_eq!(of(&v1).backups.len(), 2);
        assert!(of(&v1).recorded);
        assert_eq!((of(&v1).files, of(&v1).total_bytes), (2, 3));
        assert!(
            of(&v1)
                .on("backup")
                .unwrap()
                .last_drill
                .as_ref()
                .unwrap()
                .ok
        );
        // A backup that failed its drill is damaged: no longer the present copy on its tier,
        // its reason naming what the drill found.
        assert_eq!(of(&v2).on("backup"), None);
        let damaged = of(&v2).backups[0].clone();
        assert_eq!(damaged.state, ReplicaState::Damaged);
        assert!(
            damaged
                .reason
                .as_deref()
                .unwrap()
                .contains("found by restore drill): 1 problem(s) — f2.bin checksum_mismatch"),
            "{damaged:#?}"
        );
        let drill = damaged.last_drill.unwrap();
        assert!(!drill.ok);
        assert_eq!(drill.problems[0].path.as_deref(), Some("f2.bin"));
        // v3's backup, made before the drill below but folded after it.
        let late_backup = backup(&v3, "backup");
        // A drill of a copy the catalogue does not know records the drill and invents no copy.
        let stray = v3.caused(
            "drill",
            Body::RestoreFailed(RestoreFailed {
                dataset: "cats".into(),
                version: version_of(&v3),
                location: location(&v3),
                problems: vec![Problem::new("missing", Some("f1.bin"), "gone")],
                problem_counts: vec![("missing".into(), 1)],
                problems_total: None,
            }),
        );
        // The scrub's repair of v2's backup, after the drill, makes it present again.
        let repaired = v2.caused(
            "repair",
            Body::ReplicaRepaired(stagehand_schemas::ReplicaRepaired {
                dataset: "cats".into(),
                version: version_of(&v2),
                location: location(&v2),
                node: None,
                from_tier: "source".into(),
                repaired: vec!["f2.bin".into()],
                repaired_total: 1,
                files: 2,
                total_bytes: 3,
            }),
        );
        fold_into(&store, &[stray, repaired]);
        let (all_after, _) = ask(None, false, None, None);
        let after = |v: &Event| {
            all_after
                .iter()
                .find(|e| e.version == version_of(v))
                .unwrap()
                .clone()
        };
        assert!(after(&v2).on("backup").is_some(), "{:#?}", after(&v2));
        assert!(after(&v3).backups.is_empty(), "{:#?}", after(&v3));
        // The copy folded after its failed drill is damaged all the same: the order the facts
        // of one copy fold in does not matter.
        fold_into(&store, &[late_backup]);
        let (all_last, _) = ask(None, false, None, None);
        let v3_backup = (all_last.iter())
            .find(|e| e.version == version_of(&v3))
            .unwrap()
            .backups[0]
            .clone();
        assert_eq!(v3_backup.state, ReplicaState::Damaged, "{v3_backup:#?}");
        assert!(
            v3_backup
                .reason
                .as_deref()
                .unwrap()
                .contains("f1.bin missing"),
            "{v3_backup:#?}"
        );
        assert!(of(&v3).backups.is_empty());
        assert!(!of(&v3).is_protected());

        // One tier only, versions with a copy there only (v3's damaged one counts: it is
        // there, waiting for its repair).
        let (on_backup, _) = ask(Some("backup"), true, None, None);
        assert_eq!(on_backup.len(), 3);
        assert!(on_backup.iter().all(|e| e.backups.len() == 1));

        // Pages of one meet exactly.
        let mut seen = Vec::new();
        let mut after = None;
        loop {
            let (page, next) = ask(None, false, Some(1), after);
            assert_eq!(page.len(), 1);
            seen.push(page[0].version.clone());
            match next {
                Some(n) => after = Some(n),
                None => break,
            }
        }
        let mut expected: Vec<String> = [&v1, &v2, &v3].iter().map(|v| version_of(v)).collect();
        expected.sort();
        assert_eq!(seen, expected);
    }

    #[test]
    fn pages_of_files_meet_exactly_across_chunks() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_with(dir.path(), "a.redb", &[validated(1)]);
        // A second list, long enough for several chunks, read by digest.
        let files: Vec<FileRef> = (0..2500)
            .map(|i| FileRef::new(format!("d/{i:05}"), i, sha256_hex(&i.to_le_bytes())))
            .collect();
        let manifest = Manifest::from_entries(files.clone());
        store.put_file_list(&manifest).unwrap();
        let txn = store.reader().unwrap();
        let mut after: Option<String> = None;
        let mut seen = Vec::new();
        for limit in [1, 1023, 1024, 7, 10_000] {
            let (page, next) = super::files(&txn, manifest.digest(), Some(limit), after.as_deref())
                .map_err(|_| "fail")
                .unwrap();
            seen.extend(page);
            after = next;
        }
        assert_eq!(after, None);
        assert_eq!(seen, files);
        let one = super::file(&txn, manifest.digest(), "d/01024")
            .map_err(|_| "fail")
            .unwrap();
        assert_eq!(one, Some(files[1024].clone()));
        assert_eq!(
            super::file(&txn, manifest.digest(), "d/0")
                .map_err(|_| "fail")
                .unwrap(),
            None
        );
    }

    #[test]
    fn versions_resolve_by_prefix_and_projects_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_with(dir.path(), "a.redb", &[validated(1), rejected(2)]);
        let digest = version_of(&validated(1));
        let q = |v: &str| Query::Files {
            project: None,
            dataset: "cats".into(),
            version: v.into(),
            limit: None,
            after: None,
        };
        let Answer::Files {
            version,
            files,
            next,
        } = answer(&store, &q(&digest[..8]))
        else {
            panic!()
        };
        assert_eq!((version, files.len(), next), (digest.clone(), 2, None));
        assert!(matches!(
            answer(&store, &q(&digest[..7])),
            Answer::Error {
                code: ErrorCode::BadQuery,
                ..
            }
        ));
        assert!(matches!(
            answer(&store, &q("ffffffffff")),
            Answer::Error {
                code: ErrorCode::NotFound,
                ..
            }
        ));
        let Answer::Rejection { rejection } = answer(
            &store,
            &Query::Rejection {
                project: None,
                dataset: "cats".into(),
                request_id: "req-2".into(),
            },
        ) else {
            panic!()
        };
        assert_eq!(rejection.requested_by, "mallory");
    }

    /// A prepared version derived from raw version `n`, on the capacity tier.
    fn prepared_from(n: u32) -> stagehand_schemas::Event {
        use stagehand_schemas::{Body, DatasetPrepared, Location, version_digest};
        let v = validated(n);
        let files = vec![
            FileRef::new("prepared.json", 2, sha256_hex(b"{}")),
            FileRef::new("shard-000000.tar", 3, sha256_hex(b"tar")),
        ];
        let version = version_digest(&files);
        v.caused(
            "prepared",
            Body::DatasetPrepared(DatasetPrepared {
                dataset: "cats".into(),
                version: version.clone(),
                derived_from: version_of(&v),
                location: Location {
                    tier: "capacity".into(),
                    prefix: format!("lab-a/cats/{version}"),
                },
                files,
                manifest: None,
                total_bytes: 5,
                layout: "webdataset".into(),
                samples: 1,
                seed: 7,
            }),
        )
    }

    /// Guards `catalogue show D --lineage`: each raw version with the versions prepared from
    /// it and every version's replicas per tier, paged by raw version; a prepared version's
    /// lineage is its raw version's.
    #[test]
    fn lineage_puts_prepared_versions_under_their_raw_version() {
        let dir = tempfile::tempdir().unwrap();
        let prepared = prepared_from(1);
        let store = store_with(
            dir.path(),
            "a.redb",
            &[
                validated(1),
                validated(2),
                prepared.clone(),
                replica(1, false),
            ],
        );
        let (raw1, raw2) = (version_of(&validated(1)), version_of(&validated(2)));
        let stagehand_schemas::Body::DatasetPrepared(p) = &prepared.body else {
            unreachable!()
        };
        let q = |version: Option<&str>, limit: Option<u32>, after: Option<&str>| Query::Lineage {
            project: None,
            dataset: "cats".into(),
            version: version.map(Into::into),
            limit,
            after: after.map(Into::into),
        };
        let Answer::Lineage { lineage, next } = answer(&store, &q(None, None, None)) else {
            panic!()
        };
        assert_eq!(next, None);
        // The two raw versions are the roots; the prepared one is not.
        let mut roots: Vec<&str> = lineage.iter().map(|n| n.version.version.as_str()).collect();
        roots.sort();
        let mut want = vec![raw1.as_str(), raw2.as_str()];
        want.sort();
        assert_eq!(roots, want);
        let one = lineage.iter().find(|n| n.version.version == raw1).unwrap();
        let tiers: Vec<&str> = one.replicas.iter().map(|r| r.tier.as_str()).collect();
        assert_eq!(tiers, ["hot", "source"]);
        assert_eq!(one.derived.len(), 1);
        let derived = &one.derived[0];
        assert_eq!(derived.version.version, p.version);
        assert_eq!(
            derived.version.provenance.layout.as_deref(),
            Some("webdataset")
        );
        assert_eq!(
            derived
                .replicas
                .iter()
                .map(|r| r.tier.as_str())
                .collect::<Vec<_>>(),
            ["capacity"]
        );
        assert!(derived.derived.is_empty() && !one.truncated);
        let two = lineage.iter().find(|n| n.version.version == raw2).unwrap();
        assert!(two.derived.is_empty());

        // Paged by raw version.
        let Answer::Lineage {
            lineage: first,
            next,
        } = answer(&store, &q(None, Some(1), None))
        else {
            panic!()
        };
        assert_eq!(first.len(), 1);
        let next = next.expect("a second page");
        let Answer::Lineage {
            lineage: second,
            next,
        } = answer(&store, &q(None, Some(1), Some(&next)))
        else {
            panic!()
        };
        assert_eq!((second.len(), next), (1, None));
        assert_ne!(first[0].version.version, second[0].version.version);

        // A prepared version (by prefix) answers with its raw version's lineage.
        let Answer::Lineage { lineage, .. } =
            answer(&store, &q(Some(&p.version[..10]), None, None))
        else {
            panic!()
        };
        assert_eq!(lineage.len(), 1);
        assert_eq!(lineage[0].version.version, raw1);
        assert_eq!(lineage[0].derived[0].version.version, p.version);
    }

    #[test]
    fn a_store_of_the_old_layout_is_emptied_to_be_rebuilt() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("old.redb");
        {
            let db = redb::Database::create(&path).unwrap();
            let txn = db.begin_write().unwrap();
            let records: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("records");
            txn.open_table(records)
                .unwrap()
                .insert("D\0lab-a\0cats", &b"{}"[..])
                .unwrap();
            let meta: redb::TableDefinition<&str, u64> = redb::TableDefinition::new("meta");
            txn.open_table(meta)
                .unwrap()
                .insert("complete_through", 9)
                .unwrap();
            txn.commit().unwrap();
        }
        let store = Store::open(&path).unwrap();
        assert!(!store.is_complete().unwrap(), "rebuilt on start");
        store.mark_complete(1).unwrap();
        drop(store);
        assert!(
            Store::open(&path).unwrap().is_complete().unwrap(),
            "this layout is kept"
        );
    }
}
