//! Stage requests: the status a scheduler waits on, folded from the request, the promoter's
//! facts and the release, plus the copy's progress.
//!
//! One record per request id ([`StageRecord`], table `stage_requests`), indexed by job and by
//! dataset version. Its state follows the fact of the highest (rank, stamp): the bare request
//! ranks lowest, the promoter's facts next, the release highest (it is final, whatever the
//! clocks of the scheduler's host and the promoter's say), so the fold stays order-free. A
//! request counts in the readiness of its (version, tier, node) once a fact named the full
//! version; the counts move as its state does.
//!
//! A release names its request however either wrote the version (a unique prefix or the full
//! digest, [`StageReleased::names_version`]): it is kept as written (table `stage_releases`)
//! and applied to every request of the same job, dataset, tier and node it names — those
//! folded already, and each one folded later as it comes — so whichever is folded first the
//! catalogue ends the same, and a release never makes a record of its own.
//!
//! Progress messages (core NATS, about once a second per copy) are not folded: the last one is
//! kept in the live-only table `stage_progress` (throttled, without an fsync) and shown as
//! `copying` until a fact ends the wait.

use redb::{Durability, ReadTransaction, ReadableTable, WriteTransaction};
use serde::{Deserialize, Serialize};
use stagehand_catalogue::{ReadinessKey, StageProgress, StageState, StageStatus, Stamp};
use stagehand_schemas::subject::node_token;
use stagehand_schemas::{Event, EventId, ReadyEstimate, StageReleased, is_sha256_hex};
use time::OffsetDateTime;

use crate::error::StoreError;
use crate::fold::FoldError;
use crate::model::{ReadinessAggregate, StageFact, StageRecord};
use crate::store::*;

/// The rank of a bare request, of the promoter's facts, of a release.
pub const REQUESTED: u8 = 0;
pub const ANSWERED: u8 = 1;
pub const RELEASED: u8 = 2;

/// What one fact says about a stage request.
#[derive(Debug, Clone)]
pub struct StageChange<'a> {
    pub request_id: EventId,
    pub dataset: &'a str,
    /// The version as the fact names it (full, or the request's prefix).
    pub version: &'a str,
    pub tier: &'a str,
    pub node: Option<&'a str>,
    pub job_id: &'a str,
    pub rank: u8,
    pub state: StageState,
    pub waiting_for: Option<String>,
    pub reason: Option<String>,
    pub retryable: Option<bool>,
    /// For `stage.ready`: the absolute path on the tier's mount, and the prefix beneath its
    /// root.
    pub ready: Option<(Option<String>, String)>,
    /// For `stage.requested`: when the job's hold ends at the latest.
    pub hold_until: Option<OffsetDateTime>,
    /// For `stage.pending` of a queued copy: when it should be ready.
    pub ready_estimate: Option<ReadyEstimate>,
}

/// The first part of a pending request's key in `stages_open`.
pub const OPEN_PENDING: u8 = 0;
/// The first part of a failed request's key in `stages_open`.
pub const OPEN_FAILED: u8 = 1;

/// Where a request stands in `stages_open` — (state, last change in ns) — when it is pending or
/// failed; `None` when ready or released (nothing waits on a person).
pub fn open_key(status: &StageStatus) -> Option<(u8, i128)> {
    let state = match status.state {
        StageState::Pending | StageState::Copying => OPEN_PENDING,
        StageState::Failed => OPEN_FAILED,
        StageState::Ready | StageState::Released => return None,
    };
    Some((state, status.updated_at.unix_timestamp_nanos()))
}

/// The readiness key a record counts in, once its full version is known.
pub fn counted_key(status: &StageStatus) -> Option<ReadinessKey> {
    status.resolved_version.as_ref().map(|v| ReadinessKey {
        project: status.project.clone(),
        dataset: status.dataset.clone(),
        version: v.clone(),
        tier: status.tier.clone(),
        node: status.node.clone(),
    })
}

pub(crate) fn version_key(status: &StageStatus) -> &str {
    status
        .resolved_version
        .as_deref()
        .unwrap_or(&status.version)
}

pub(crate) fn read_aggregate(
    txn: &WriteTransaction,
    key: &ReadinessKey,
) -> Result<ReadinessAggregate, StoreError> {
    let k = rkey(key);
    Ok(txn
        .open_table(READINESS)?
        .get(k)?
        .map(|v| decode(v.value(), || format!("readiness {k:?}")))
        .transpose()?
        .unwrap_or_default())
}

pub(crate) fn write_aggregate(
    txn: &WriteTransaction,
    key: &ReadinessKey,
    aggregate: &ReadinessAggregate,
) -> Result<(), StoreError> {
    let k = rkey(key);
    let value = encode(aggregate, || format!("readiness {k:?}"))?;
    txn.open_table(READINESS)?.insert(k, value.as_slice())?;
    Ok(())
}

fn rkey(key: &ReadinessKey) -> (&str, &str, &str, &str, &str) {
    (
        key.project.as_str(),
        key.dataset.as_str(),
        key.version.as_str(),
        key.tier.as_str(),
        key.node.as_deref().unwrap_or(""),
    )
}

/// Folds one fact about a stage request (not a release: [`release`]), then the releases
/// already folded that name it.
pub fn record(
    txn: &WriteTransaction,
    event: &Event,
    change: StageChange<'_>,
    stamp: &Stamp,
) -> Result<(), FoldError> {
    let id = change.request_id.clone();
    record_in(txn, &event.project, change, stamp)?;
    apply_releases(txn, &event.project, &id)
}

/// A release as written, kept in `stage_releases`: the newest one's stamp and reason.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct WrittenRelease {
    stamp: Stamp,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    reason: Option<String>,
}

/// The change a release makes to a request it names.
fn released<'a>(request_id: EventId, p: &'a StageReleased) -> StageChange<'a> {
    StageChange {
        request_id,
        dataset: &p.dataset,
        version: &p.version,
        tier: &p.tier,
        node: p.node.as_deref(),
        job_id: &p.job_id,
        rank: RELEASED,
        state: StageState::Released,
        waiting_for: None,
        reason: p.reason.clone(),
        retryable: None,
        ready: None,
        hold_until: None,
        ready_estimate: None,
    }
}

/// Whether `status` is a request `p` releases: same job, dataset, tier and node, and a version
/// the release names as the request wrote it or as it was resolved.
fn names(p: &StageReleased, status: &StageStatus) -> bool {
    status.job_id == p.job_id
        && status.dataset == p.dataset
        && status.tier == p.tier
        && status.node == p.node
        && (p.names_version(&status.version)
            || status
                .resolved_version
                .as_deref()
                .is_some_and(|v| p.names_version(v)))
}

fn stage_record(
    txn: &WriteTransaction,
    project: &str,
    id: &str,
) -> Result<Option<StageRecord>, StoreError> {
    txn.open_table(STAGE_REQUESTS)?
        .get((project, id))?
        .map(|v| decode(v.value(), || format!("stage request {project}/{id}")))
        .transpose()
}

/// Folds a `stage.released`: kept as written (the newest of the same spelling), and applied
/// to every request of its job it names.
pub fn release(
    txn: &WriteTransaction,
    project: &str,
    p: &StageReleased,
    stamp: &Stamp,
) -> Result<(), FoldError> {
    let key = (
        project,
        p.job_id.as_str(),
        p.dataset.as_str(),
        p.tier.as_str(),
        p.node.as_deref().unwrap_or(""),
        p.version.as_str(),
    );
    let what = || {
        format!(
            "stage release {project}/{}/{}@{}",
            p.job_id, p.dataset, p.version
        )
    };
    let kept: Option<WrittenRelease> = txn
        .open_table(STAGE_RELEASES)?
        .get(key)?
        .map(|v| decode(v.value(), what))
        .transpose()?;
    if kept.as_ref().is_none_or(|k| *stamp > k.stamp) {
        let value = encode(
            &WrittenRelease {
                stamp: stamp.clone(),
                reason: p.reason.clone(),
            },
            what,
        )?;
        txn.open_table(STAGE_RELEASES)?
            .insert(key, value.as_slice())?;
    }
    for id in requests_of_job(txn, project, &p.job_id)? {
        if let Some(record) = stage_record(txn, project, &id)?
            && names(p, &record.status)
        {
            record_in(txn, project, released(record.status.request_id, p), stamp)?;
        }
    }
    Ok(())
}

/// The request ids of a job, as indexed.
fn requests_of_job(
    txn: &WriteTransaction,
    project: &str,
    job: &str,
) -> Result<Vec<String>, StoreError> {
    let table = txn.open_table(STAGES_BY_JOB)?;
    let mut ids = Vec::new();
    for row in table.range((project, job, "")..)? {
        let (k, _) = row?;
        let (p, j, id) = k.value();
        if p != project || j != job {
            break;
        }
        ids.push(id.to_owned());
    }
    Ok(ids)
}

/// Applies to request `id` every release already folded that names it.
fn apply_releases(txn: &WriteTransaction, project: &str, id: &EventId) -> Result<(), FoldError> {
    let Some(record) = stage_record(txn, project, id.as_str())? else {
        return Ok(());
    };
    let s = &record.status;
    let node = s.node.as_deref().unwrap_or("");
    let mut found = Vec::new();
    {
        let table = txn.open_table(STAGE_RELEASES)?;
        let start = (
            project,
            s.job_id.as_str(),
            s.dataset.as_str(),
            s.tier.as_str(),
            node,
            "",
        );
        for row in table.range(start..)? {
            let (k, v) = row?;
            let (p, job, dataset, tier, n, version) = k.value();
            if (p, job, dataset, tier, n) != (project, &s.job_id, &s.dataset, &s.tier, node) {
                break;
            }
            let written: WrittenRelease = decode(v.value(), || {
                format!("stage release {project}/{job}/{dataset}@{version}")
            })?;
            found.push((
                StageReleased {
                    dataset: dataset.to_owned(),
                    version: version.to_owned(),
                    tier: tier.to_owned(),
                    job_id: job.to_owned(),
                    node: s.node.clone(),
                    reason: written.reason,
                },
                written.stamp,
            ));
        }
    }
    for (p, stamp) in &found {
        if names(p, &record.status) {
            record_in(txn, project, released(id.clone(), p), stamp)?;
        }
    }
    Ok(())
}

/// Folds one change into its request's record, its indexes and readiness.
fn record_in(
    txn: &WriteTransaction,
    project: &str,
    change: StageChange<'_>,
    stamp: &Stamp,
) -> Result<(), FoldError> {
    let id = change.request_id.as_str();
    let what = || format!("stage request {project}/{id}");
    let mut old: Option<StageRecord> = txn
        .open_table(STAGE_REQUESTS)?
        .get((project, id))?
        .map(|v| decode(v.value(), what))
        .transpose()?;
    // The request says where it is to be staged; an answer about another tier or node is
    // no answer to it. A node's agent may state answers on its own node's subjects only, so
    // without this it could answer another node's or a shared tier's request (ready, with a
    // path of its choosing). The facts and requests streams are folded apart, so an answer
    // may come first: the request, when it comes, drops what an answer for another place said.
    if let Some(o) = &old
        && (o.status.tier != change.tier || o.status.node.as_deref() != change.node)
    {
        let place = |tier: &str, node: Option<&str>| match node {
            Some(node) => format!("tier {tier} on node {node}"),
            None => format!("tier {tier}"),
        };
        let (recorded, stated) = (
            place(&o.status.tier, o.status.node.as_deref()),
            place(change.tier, change.node),
        );
        if change.rank != REQUESTED {
            return Err(FoldError::malformed(format!(
                "a fact about stage request {project}/{id} names {stated}, but the request is for {recorded}: not folded"
            )));
        }
        tracing::warn!(request = %id, %project, answered = %recorded, asked = %stated, "a stage request's answer folded before it named another place: dropped");
        old = None;
    }
    let full = is_sha256_hex(change.version).then(|| change.version.to_owned());
    let mut record = old.clone().unwrap_or_else(|| StageRecord {
        status: StageStatus {
            request_id: change.request_id.clone(),
            project: project.into(),
            dataset: change.dataset.into(),
            version: change.version.into(),
            resolved_version: None,
            tier: change.tier.into(),
            node: change.node.map(Into::into),
            job_id: change.job_id.into(),
            state: change.state,
            waiting_for: None,
            reason: None,
            retryable: None,
            path: None,
            progress: None,
            ready_estimate: None,
            updated_at: stamp.at,
            hold_until: None,
        },
        rank: change.rank,
        stamp: stamp.clone(),
        path_stamp: None,
        answered_first: change.rank == ANSWERED,
    });
    // The request (or its release, the scheduler's word too) confirms the place.
    if change.rank != ANSWERED {
        record.answered_first = false;
    }
    // Every fact but `stage.ready` and a release (which may spell it otherwise) names the
    // version as the request gave it.
    if change.ready.is_none() && change.rank != RELEASED {
        record.status.version = change.version.into();
    }
    if record.status.resolved_version.is_none() {
        record.status.resolved_version.clone_from(&full);
    }
    let wins = old
        .as_ref()
        .is_none_or(|o| (change.rank, stamp) > (o.rank, &o.stamp));
    if wins {
        record.rank = change.rank;
        record.stamp = stamp.clone();
        record.status.state = change.state;
        record.status.waiting_for.clone_from(&change.waiting_for);
        record.status.reason.clone_from(&change.reason);
        record.status.retryable = change.retryable;
        record
            .status
            .ready_estimate
            .clone_from(&change.ready_estimate);
        record.status.updated_at = stamp.at;
    }
    // Only the request names it, whichever order the facts came in.
    if change.hold_until.is_some() {
        record.status.hold_until = change.hold_until;
    }
    if let Some((Some(path), _)) = &change.ready
        && record.path_stamp.as_ref().is_none_or(|s| stamp > s)
    {
        record.status.path = Some(path.clone());
        record.path_stamp = Some(stamp.clone());
    }
    let value = encode(&record, what)?;
    txn.open_table(STAGE_REQUESTS)?
        .insert((project, id), value.as_slice())?;
    txn.open_table(STAGES_BY_JOB)?
        .insert((project, record.status.job_id.as_str(), id), ())?;
    {
        let mut open = txn.open_table(STAGES_OPEN)?;
        if let Some((state, at)) = old.as_ref().and_then(|o| open_key(&o.status)) {
            open.remove((state, at, project, id))?;
        }
        if let Some((state, at)) = open_key(&record.status) {
            open.insert((state, at, project, id), ())?;
        }
    }
    {
        let mut by_version = txn.open_table(STAGES_BY_VERSION)?;
        let dataset = record.status.dataset.as_str();
        if let Some(old) = &old
            && version_key(&old.status) != version_key(&record.status)
        {
            by_version.remove((project, dataset, version_key(&old.status), id))?;
        }
        by_version.insert((project, dataset, version_key(&record.status), id), ())?;
    }
    if record.status.state != StageState::Pending {
        txn.open_table(STAGE_PROGRESS)?.remove((project, id))?;
    }

    // Readiness: the counts follow the record; the registers follow facts naming the version.
    let before = old
        .as_ref()
        .and_then(|o| counted_key(&o.status).map(|k| (k, o.status.state)));
    let after = counted_key(&record.status).map(|k| (k, record.status.state));
    match (&before, &after) {
        (Some((bk, bs)), Some((ak, as_))) if bk == ak => {
            if bs != as_ {
                let mut agg = read_aggregate(txn, ak)?;
                agg.moved(Some(*bs), *as_);
                write_aggregate(txn, ak, &agg)?;
            }
        }
        _ => {
            if let Some((bk, bs)) = &before {
                let mut agg = read_aggregate(txn, bk)?;
                agg.left(*bs);
                write_aggregate(txn, bk, &agg)?;
            }
            if let Some((ak, as_)) = &after {
                let mut agg = read_aggregate(txn, ak)?;
                agg.moved(None, *as_);
                write_aggregate(txn, ak, &agg)?;
            }
        }
    }
    if let Some(version) = &full {
        let key = ReadinessKey {
            project: project.into(),
            dataset: change.dataset.into(),
            version: version.clone(),
            tier: change.tier.into(),
            node: change.node.map(Into::into),
        };
        let mut agg = read_aggregate(txn, &key)?;
        if change.rank > REQUESTED && agg.newest.as_ref().is_none_or(|n| *stamp > n.stamp) {
            agg.newest = Some(StageFact {
                stamp: stamp.clone(),
                state: change.state,
                reason: change.reason.clone(),
                retryable: change.retryable,
            });
        }
        if let Some((_, prefix)) = &change.ready
            && agg.ready_path.as_ref().is_none_or(|(s, _)| stamp > s)
        {
            agg.ready_path = Some((stamp.clone(), prefix.clone()));
        }
        write_aggregate(txn, &key, &agg)?;
    }
    Ok(())
}

/// The shown status of one request, with its progress.
pub fn status_in(
    txn: &ReadTransaction,
    project: &str,
    request_id: &str,
) -> Result<Option<(StageStatus, Option<ReadinessKey>)>, StoreError> {
    let what = || format!("stage request {project}/{request_id}");
    let Some(record) = txn
        .open_table(STAGE_REQUESTS)?
        .get((project, request_id))?
        .map(|v| decode::<StageRecord>(v.value(), what))
        .transpose()?
    else {
        return Ok(None);
    };
    let progress: Option<StageProgress> = txn
        .open_table(STAGE_PROGRESS)?
        .get((project, request_id))?
        .map(|v| decode(v.value(), what))
        .transpose()?;
    let key = counted_key(&record.status);
    let mut shown = record.shown(progress);
    // A job holding a replica found damaged, or out of reach, since it was handed out sees why.
    if shown.state == StageState::Ready
        && let Some(k) = &key
        && let Some(replica) = crate::readiness::replica_of(txn, k)?
        && replica.state.is_withdrawn()
    {
        shown.reason = Some(format!(
            "the replica it was handed is {}",
            replica.reason.as_deref().unwrap_or("withdrawn")
        ));
    }
    Ok(Some((shown, key)))
}

/// The stage requests of the version on the (tier, node) a replica fact names: the holders
/// whose shown status follows the replica's damage and repair.
fn stages_of_replica(
    txn: &ReadTransaction,
    project: &str,
    (dataset, version): (&str, &str),
    (tier, node): (&str, Option<&str>),
) -> Result<Vec<EventId>, StoreError> {
    let by_version = txn.open_table(STAGES_BY_VERSION)?;
    let requests = txn.open_table(STAGE_REQUESTS)?;
    let mut out = Vec::new();
    for row in by_version.range((project, dataset, version, "")..)? {
        let (k, _) = row?;
        let (pr, ds, v, id) = k.value();
        if pr != project || ds != dataset || v != version {
            break;
        }
        if let Some(value) = requests.get((project, id))? {
            let record: StageRecord =
                decode(value.value(), || format!("stage request {project}/{id}"))?;
            if record.status.tier == tier && record.status.node.as_deref() == node {
                out.push(record.status.request_id);
            }
        }
    }
    Ok(out)
}

impl Store {
    /// The stage requests `event` is about: its own, or for a release every folded request it
    /// names (what the schedulers' mirror rewrites after it is folded).
    pub fn stages_touched(&self, event: &Event) -> Result<Vec<EventId>, StoreError> {
        let replica = match &event.body {
            stagehand_schemas::Body::ReplicaDamaged(p) => {
                Some((&p.dataset, &p.version, &p.location.tier, p.node.as_deref()))
            }
            stagehand_schemas::Body::ReplicaCreated(p) => {
                Some((&p.dataset, &p.version, &p.location.tier, p.node.as_deref()))
            }
            stagehand_schemas::Body::ReplicaRepaired(p) => {
                Some((&p.dataset, &p.version, &p.location.tier, p.node.as_deref()))
            }
            stagehand_schemas::Body::ReplicaUnreachable(p) => Some((
                &p.dataset,
                &p.version,
                &p.location.tier,
                Some(p.node.as_str()),
            )),
            _ => None,
        };
        if let Some((dataset, version, tier, node)) = replica {
            return stages_of_replica(
                &self.reader()?,
                &event.project,
                (dataset, version),
                (tier, node),
            );
        }
        let stagehand_schemas::Body::StageReleased(p) = &event.body else {
            return Ok(crate::fold::stage_request_of(event).into_iter().collect());
        };
        let project = event.project.as_str();
        let txn = self.reader()?;
        let by_job = txn.open_table(STAGES_BY_JOB)?;
        let requests = txn.open_table(STAGE_REQUESTS)?;
        let mut out = Vec::new();
        for row in by_job.range((project, p.job_id.as_str(), "")..)? {
            let (k, _) = row?;
            let (pr, job, id) = k.value();
            if pr != project || job != p.job_id {
                break;
            }
            if let Some(v) = requests.get((project, id))? {
                let record: StageRecord =
                    decode(v.value(), || format!("stage request {project}/{id}"))?;
                if names(p, &record.status) {
                    out.push(record.status.request_id);
                }
            }
        }
        Ok(out)
    }

    /// The status of one stage request as a scheduler sees it, and the readiness key it counts
    /// in.
    pub fn stage_status(
        &self,
        project: &str,
        request_id: &str,
    ) -> Result<Option<(StageStatus, Option<ReadinessKey>)>, StoreError> {
        status_in(&self.reader()?, project, request_id)
    }

    /// Keeps the promoter's last progress report of a pending request (and nothing for a
    /// request the catalogue has not seen, or one whose wait has ended). Returns the status to
    /// mirror when it changed. Live state: committed without an fsync.
    pub fn record_progress(
        &self,
        project: &str,
        request_id: &str,
        node: Option<&str>,
        progress: &StageProgress,
    ) -> Result<Option<StageStatus>, StoreError> {
        let mut txn = self.writer_txn()?;
        txn.set_durability(Durability::None)
            .map_err(|e| StoreError::Redb(redb::Error::Io(std::io::Error::other(e))))?;
        let what = || format!("stage request {project}/{request_id}");
        let record: Option<StageRecord> = txn
            .open_table(STAGE_REQUESTS)?
            .get((project, request_id))?
            .map(|v| decode(v.value(), what))
            .transpose()?;
        // Reported on the subject of the request's own place (its node's, or none): a node's
        // user reports on its own node's work only, and shows no other stage copying.
        let Some(record) = record.filter(|r| {
            r.status.state == StageState::Pending
                && r.status.node.as_deref().map(node_token).as_deref() == node
        }) else {
            txn.abort()?;
            return Ok(None);
        };
        let value = encode(progress, what)?;
        txn.open_table(STAGE_PROGRESS)?
            .insert((project, request_id), value.as_slice())?;
        txn.commit()?;
        Ok(Some(record.shown(Some(progress.clone()))))
    }
}

#[cfg(test)]
mod tests {
    use stagehand_catalogue::*;
    use stagehand_schemas::*;

    use crate::testing::*;

    /// A job's request by version prefix, the promoter's answers, and its release.
    fn chain() -> (EventId, Vec<Event>) {
        let v = version_of(&validated(1));
        chain_spelled(&v[..12], &v[..12])
    }

    /// [`chain`] with the version written as `asked` by the request and as `released` by the
    /// release.
    fn chain_spelled(asked: &str, released: &str) -> (EventId, Vec<Event>) {
        let v = version_of(&validated(1));
        let prefix = asked;
        let id = EventId::for_stage("lab-a", "4815162", "cats", prefix, "local", Some("gpu-07"));
        let mut request = Event::request(
            id.clone(),
            "lab-a",
            Body::StageRequested(StageRequested {
                dataset: "cats".into(),
                version: prefix.into(),
                tier: "local".into(),
                job_id: "4815162".into(),
                requested_by: "slurm".into(),
                deadline: None,
                node: Some("gpu-07".into()),
                form: None,
                hold_until: Some(hold_until()),
            }),
        );
        request.occurred_at -= ::time::Duration::seconds(10);
        let pending = request.caused(
            "pending:validation",
            Body::StagePending(StagePending {
                dataset: "cats".into(),
                version: prefix.into(),
                tier: "local".into(),
                node: Some("gpu-07".into()),
                job_id: "4815162".into(),
                request_id: id.clone(),
                waiting_for: "validation".into(),
                reason: "version not validated yet".into(),
                ready_estimate: None,
            }),
        );
        let ready = request.caused(
            "ready",
            Body::StageReady(StageReady {
                dataset: "cats".into(),
                version: v.clone(),
                location: Location {
                    tier: "local".into(),
                    prefix: format!("lab-a/cats/{v}"),
                },
                job_id: "4815162".into(),
                request_id: id.clone(),
                node: Some("gpu-07".into()),
                path: Some(format!("/nvme/lab-a/cats/{v}")),
            }),
        );
        let mut release = Event::request(
            EventId::for_stage_release(
                "lab-a",
                "4815162",
                "cats",
                released,
                "local",
                Some("gpu-07"),
            ),
            "lab-a",
            Body::StageReleased(StageReleased {
                dataset: "cats".into(),
                version: released.into(),
                tier: "local".into(),
                job_id: "4815162".into(),
                node: Some("gpu-07".into()),
                reason: None,
            }),
        );
        // The scheduler's clock runs behind the promoter's: the release is still final.
        release.occurred_at = ready.occurred_at - ::time::Duration::seconds(5);
        (id, vec![validated(1), request, pending, ready, release])
    }

    /// The end of the chain's job's lifetime.
    fn hold_until() -> ::time::OffsetDateTime {
        ::time::OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap()
    }

    fn key() -> ReadinessKey {
        ReadinessKey {
            project: "lab-a".into(),
            dataset: "cats".into(),
            version: version_of(&validated(1)),
            tier: "local".into(),
            node: Some("gpu-07".into()),
        }
    }

    /// `event`, a stage answer of the chain, made about node `node` instead.
    fn on_node(mut event: Event, node: &str) -> Event {
        match &mut event.body {
            Body::StagePending(p) => p.node = Some(node.into()),
            Body::StageReady(p) => {
                p.node = Some(node.into());
                p.path = Some(format!("/elsewhere/{node}"));
            }
            _ => unreachable!("an answer of the chain"),
        }
        event
    }

    /// Guards a node's word against another node's request: a ready stated by node gpu-08 (on
    /// its own subject, which its user may publish) for the request of a job on gpu-07 is not
    /// folded, and the request stays pending with no path; gpu-07's own answer still is.
    #[test]
    fn an_answer_about_another_node_answers_no_request() {
        let dir = tempfile::tempdir().unwrap();
        let (id, events) = chain();
        let store = store_with(dir.path(), "a.redb", &events[..3]);
        let folded = fold_into(&store, &[on_node(events[3].clone(), "gpu-08")]);
        let crate::store::Folded::Skipped { problem, retryable } = &folded[0] else {
            panic!("another node's ready was folded: {folded:?}");
        };
        assert!(!retryable);
        assert!(
            problem.detail.contains("names tier local on node gpu-08")
                && problem
                    .detail
                    .contains("the request is for tier local on node gpu-07"),
            "{}",
            problem.detail
        );
        let (status, _) = store.stage_status("lab-a", id.as_str()).unwrap().unwrap();
        assert_eq!(status.state, StageState::Pending);
        assert_eq!(status.path, None);
        fold_into(&store, &events[3..4]);
        let (status, _) = store.stage_status("lab-a", id.as_str()).unwrap().unwrap();
        assert_eq!(status.state, StageState::Ready);
    }

    /// The same when the other node's answer is folded before the request (the two streams
    /// are folded apart): the request, when it comes, drops it.
    #[test]
    fn an_answer_about_another_node_folded_first_is_dropped_by_the_request() {
        let dir = tempfile::tempdir().unwrap();
        let (id, events) = chain();
        let forged = on_node(events[3].clone(), "gpu-08");
        let store = store_with(dir.path(), "a.redb", &[events[0].clone(), forged]);
        let (status, _) = store.stage_status("lab-a", id.as_str()).unwrap().unwrap();
        assert_eq!(
            status.state,
            StageState::Pending,
            "never ready before its request"
        );
        assert_eq!(status.waiting_for.as_deref(), Some("request"));
        assert_eq!(status.path, None);
        fold_into(&store, &events[1..3]);
        let (status, _) = store.stage_status("lab-a", id.as_str()).unwrap().unwrap();
        assert_eq!(status.state, StageState::Pending);
        assert_eq!(status.node.as_deref(), Some("gpu-07"));
        assert_eq!(status.path, None);
    }

    /// A genuine answer folded before its request (the recorder's requests consumer behind
    /// its facts consumer, or a rebuild, which folds every fact first) is shown once the
    /// request comes.
    #[test]
    fn an_answer_folded_before_its_request_stands_once_the_request_comes() {
        let dir = tempfile::tempdir().unwrap();
        let (id, events) = chain();
        let store = store_with(
            dir.path(),
            "a.redb",
            &[events[0].clone(), events[3].clone()],
        );
        let (status, _) = store.stage_status("lab-a", id.as_str()).unwrap().unwrap();
        assert_eq!(status.state, StageState::Pending);
        fold_into(&store, &events[1..2]);
        let (status, _) = store.stage_status("lab-a", id.as_str()).unwrap().unwrap();
        assert_eq!(status.state, StageState::Ready);
        assert!(status.path.is_some());
    }

    #[test]
    fn a_stage_request_goes_pending_ready_released() {
        let dir = tempfile::tempdir().unwrap();
        let (id, events) = chain();
        let store = store_with(dir.path(), "a.redb", &events[..3]);
        let (status, counted) = store.stage_status("lab-a", id.as_str()).unwrap().unwrap();
        assert_eq!(status.state, StageState::Pending);
        assert_eq!(status.waiting_for.as_deref(), Some("validation"));
        assert_eq!(status.hold_until, Some(hold_until()));
        assert_eq!(status.resolved_version, None);
        assert_eq!(
            counted, None,
            "a prefix counts nowhere until a fact names the version"
        );

        let progress = StageProgress {
            files_done: 1,
            files_total: 2,
            bytes_done: 3,
            bytes_total: 4,
            eta_seconds: Some(5),
        };
        // Reported on the shared tiers' subject, or another node's: not this stage's copy
        // (the request is for gpu-07's local tier).
        for elsewhere in [None, Some("gpu-08")] {
            assert!(
                store
                    .record_progress("lab-a", id.as_str(), elsewhere, &progress)
                    .unwrap()
                    .is_none(),
                "{elsewhere:?}"
            );
        }
        let (status, _) = store.stage_status("lab-a", id.as_str()).unwrap().unwrap();
        assert_eq!(status.state, StageState::Pending);
        let shown = store
            .record_progress("lab-a", id.as_str(), Some("gpu-07"), &progress)
            .unwrap()
            .unwrap();
        assert_eq!(shown.state, StageState::Copying);
        assert_eq!(shown.progress, Some(progress.clone()));

        fold_into(&store, &events[3..4]);
        let (status, counted) = store.stage_status("lab-a", id.as_str()).unwrap().unwrap();
        assert_eq!(status.state, StageState::Ready);
        assert_eq!(status.progress, None, "a ready request shows no copy");
        assert_eq!(
            status.path.as_deref(),
            Some(format!("/nvme/lab-a/cats/{}", key().version).as_str())
        );
        assert_eq!(
            status.resolved_version.as_deref(),
            Some(key().version.as_str())
        );
        assert_eq!(
            status.version,
            key().version[..12],
            "as the request named it"
        );
        assert_eq!(counted, Some(key()));
        assert!(
            store
                .record_progress("lab-a", id.as_str(), Some("gpu-07"), &progress)
                .unwrap()
                .is_none()
        );
        let r = crate::readiness::current(&store, &key()).unwrap().unwrap();
        assert!(r.ready);
        assert_eq!(r.jobs.ready, 1);

        fold_into(&store, &events[4..]);
        let (status, _) = store.stage_status("lab-a", id.as_str()).unwrap().unwrap();
        assert_eq!(status.state, StageState::Released);
        assert_eq!(
            status.hold_until,
            Some(hold_until()),
            "kept through every answer"
        );
        let r = crate::readiness::current(&store, &key()).unwrap().unwrap();
        assert_eq!((r.jobs.ready, r.jobs.released), (0, 1));
    }

    /// A job holding a ready stage on a replica found damaged sees why in its status, and the
    /// version's readiness is withdrawn; a newer `replica.created` of the same copy (its
    /// repair) makes it ready again and the reason goes.
    #[test]
    fn a_holder_of_a_replica_found_damaged_sees_why() {
        let dir = tempfile::tempdir().unwrap();
        let (id, events) = chain();
        let store = store_with(dir.path(), "a.redb", &events[..4]);
        let v = key().version;
        let location = Location {
            tier: "local".into(),
            prefix: format!("lab-a/cats/{v}"),
        };
        let mut damaged = events[3].caused(
            "damaged:local:gpu-07",
            Body::ReplicaDamaged(ReplicaDamaged {
                dataset: "cats".into(),
                version: v.clone(),
                location: location.clone(),
                node: Some("gpu-07".into()),
                found_by: "fingerprint".into(),
                files: vec![DamagedFile {
                    path: "train/0003.jpg".into(),
                    how: "missing".into(),
                    expected_size: None,
                    found_size: None,
                }],
                damaged_total: 1,
                reason: "being repaired".into(),
            }),
        );
        damaged.occurred_at = events[3].occurred_at + ::time::Duration::seconds(1);
        fold_into(&store, std::slice::from_ref(&damaged));
        let (status, _) = store.stage_status("lab-a", id.as_str()).unwrap().unwrap();
        assert_eq!(status.state, StageState::Ready);
        let reason = status.reason.unwrap_or_default();
        assert!(reason.contains("train/0003.jpg missing"), "{reason}");
        assert!(
            !crate::readiness::current(&store, &key())
                .unwrap()
                .unwrap()
                .ready
        );
        assert_eq!(
            store.stages_touched(&damaged).unwrap(),
            vec![id.clone()],
            "the schedulers' mirror of the holder is rewritten"
        );

        let mut repaired = events[3].caused(
            "replica:local:gpu-07",
            Body::ReplicaCreated(ReplicaCreated {
                dataset: "cats".into(),
                version: v,
                location,
                files: 2,
                total_bytes: 3,
                verified_by: "hashed-in-flight".into(),
                node: Some("gpu-07".into()),
            }),
        );
        repaired.occurred_at = damaged.occurred_at + ::time::Duration::seconds(1);
        fold_into(&store, &[repaired]);
        let (status, _) = store.stage_status("lab-a", id.as_str()).unwrap().unwrap();
        assert_eq!(status.reason, None);
        assert!(
            crate::readiness::current(&store, &key())
                .unwrap()
                .unwrap()
                .ready
        );
    }

    /// Guards order-independence of stage statuses and their readiness counts.
    #[test]
    fn every_order_of_a_stage_chain_folds_the_same() {
        let (_, events) = chain();
        let dir = tempfile::tempdir().unwrap();
        let reference = store_with(dir.path(), "ref.redb", &events).dump().unwrap();
        let n = events.len();
        // Every rotation, reversed and not, folded one event per commit.
        for start in 0..n {
            for reverse in [false, true] {
                let mut order: Vec<Event> =
                    (0..n).map(|i| events[(start + i) % n].clone()).collect();
                if reverse {
                    order.reverse();
                }
                let store =
                    crate::store::Store::open(dir.path().join(format!("{start}-{reverse}.redb")))
                        .unwrap();
                for e in &order {
                    fold_into(&store, std::slice::from_ref(e));
                }
                assert_eq!(
                    store.dump().unwrap(),
                    reference,
                    "start {start}, reversed {reverse}"
                );
            }
        }
    }

    /// A release written with the full digest ends the request written with a prefix, and the
    /// other way round, in every order the facts come in; no record is made for the release's
    /// own spelling.
    #[test]
    fn a_release_names_its_request_however_either_spelled_the_version() {
        let v = version_of(&validated(1));
        let dir = tempfile::tempdir().unwrap();
        for (asked, released) in [(&v[..12], v.as_str()), (v.as_str(), &v[..16])] {
            let (id, events) = chain_spelled(asked, released);
            let n = events.len();
            let mut dumps = Vec::new();
            for start in 0..n {
                for reverse in [false, true] {
                    let mut order: Vec<Event> =
                        (0..n).map(|i| events[(start + i) % n].clone()).collect();
                    if reverse {
                        order.reverse();
                    }
                    let store = crate::store::Store::open(
                        dir.path()
                            .join(format!("{}-{start}-{reverse}.redb", asked.len())),
                    )
                    .unwrap();
                    for e in &order {
                        fold_into(&store, std::slice::from_ref(e));
                    }
                    let (status, _) = store.stage_status("lab-a", id.as_str()).unwrap().unwrap();
                    assert_eq!(status.state, StageState::Released, "{asked} / {released}");
                    assert_eq!(status.version, asked, "as the request wrote it");
                    let own = EventId::for_stage(
                        "lab-a",
                        "4815162",
                        "cats",
                        released,
                        "local",
                        Some("gpu-07"),
                    );
                    assert!(store.stage_status("lab-a", own.as_str()).unwrap().is_none());
                    let r = crate::readiness::current(&store, &key()).unwrap().unwrap();
                    assert_eq!((r.jobs.ready, r.jobs.released), (0, 1));
                    dumps.push(store.dump().unwrap());
                }
            }
            assert!(
                dumps.windows(2).all(|w| w[0] == w[1]),
                "{asked} / {released}"
            );
        }
    }

    #[test]
    fn stage_requests_are_listed_by_job_and_by_version() {
        let dir = tempfile::tempdir().unwrap();
        let (id, events) = chain();
        let store = store_with(dir.path(), "a.redb", &events[..4]);
        let by_job = crate::answer(
            &store,
            &Query::StageRequests {
                project: "lab-a".into(),
                job_id: Some("4815162".into()),
                dataset: None,
                version: None,
                limit: None,
                after: None,
            },
        );
        let Answer::StageRequests { stages, next: None } = by_job else {
            panic!("{by_job:?}")
        };
        assert_eq!(stages.len(), 1);
        assert_eq!(stages[0].request_id, id);
        let by_version = crate::answer(
            &store,
            &Query::StageRequests {
                project: "lab-a".into(),
                job_id: None,
                dataset: Some("cats".into()),
                version: Some(key().version[..8].into()),
                limit: None,
                after: None,
            },
        );
        let Answer::StageRequests { stages, .. } = by_version else {
            panic!("{by_version:?}")
        };
        assert_eq!(stages.len(), 1);
        assert_eq!(stages[0].state, StageState::Ready);
    }
}
