//! The fold: facts in, catalogue records out, one function per kind of fact.
//!
//! [`apply`] takes one event and the store's write transaction and changes the records the
//! event concerns (the tables are listed in `src/store.rs`). Applying an event whose id was
//! applied before changes nothing, and every record keeps the newest [`Stamp`] — counts move
//! only when a record is created or replaced, and the "newest" registers are maxima — so any
//! order and any number of copies of the same facts fold to the same catalogue.
//!
//! A fact that carries a file list (`dataset.validated`, `dataset.prepared`) is folded only
//! once its list is in the store (`src/files.rs` fetches it, verified, and writes it in
//! chunks first); here the version record only points at it.

use redb::{ReadableTable, WriteTransaction};
use stagehand_catalogue::*;
use stagehand_manifest::{ManifestError, ManifestErrorKind, ManifestSource};
use stagehand_schemas::problem::ProblemTally;
use stagehand_schemas::*;

use crate::error::StoreError;
use crate::model::{FileListRecord, ReadinessAggregate};
use crate::stage::{self, StageChange};
use crate::store::*;
use stagehand_schemas::Retryable;

/// Why one fact could not be folded.
#[derive(Debug, thiserror::Error)]
pub enum FoldError {
    /// The store failed (I/O, a lock): nothing about this fact in particular.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Something about this fact: its manifest, its content.
    #[error("{detail}")]
    Problem {
        code: FoldProblemCode,
        detail: String,
        retryable: bool,
    },
}

macro_rules! from_redb {
    ($($t:ty),*) => {$(
        impl From<$t> for FoldError {
            fn from(e: $t) -> Self {
                FoldError::Store(e.into())
            }
        }
    )*};
}
from_redb!(
    redb::TableError,
    redb::StorageError,
    redb::TransactionError,
    redb::CommitError
);

impl FoldError {
    /// A manifest that could not be opened or read.
    pub fn manifest(e: ManifestError) -> Self {
        if e.kind == ManifestErrorKind::Io {
            // The recorder's own spool failed, not the fact's manifest.
            return FoldError::Store(StoreError::Spool(e.to_string()));
        }
        let code = match e.kind {
            ManifestErrorKind::NotFound => FoldProblemCode::ManifestMissing,
            ManifestErrorKind::Mismatch => FoldProblemCode::ManifestMismatch,
            ManifestErrorKind::Malformed => FoldProblemCode::ManifestMalformed,
            ManifestErrorKind::Invalid => FoldProblemCode::MalformedFact,
            _ => FoldProblemCode::ManifestUnreachable,
        };
        FoldError::Problem {
            code,
            retryable: e.is_retryable(),
            detail: e.to_string(),
        }
    }

    /// A fact refused before folding: its subject or a location it names breaks a rule of
    /// `stagehand_schemas::trust` (the detail names it).
    pub fn refused(refusal: &Refusal) -> Self {
        let code = match refusal.rule() {
            stagehand_schemas::trust::rule::OUTSIDE_PROJECT => FoldProblemCode::OutsideProject,
            _ => FoldProblemCode::WrongSubject,
        };
        FoldError::Problem {
            code,
            detail: refusal.to_string(),
            retryable: false,
        }
    }

    /// A fact that contradicts itself.
    pub fn malformed(detail: impl Into<String>) -> Self {
        FoldError::Problem {
            code: FoldProblemCode::MalformedFact,
            detail: detail.into(),
            retryable: false,
        }
    }

    /// The problem code when the failure is this fact's own (it can be skipped and listed);
    /// `None` when the store itself failed.
    pub fn problem_code(&self) -> Option<FoldProblemCode> {
        match self {
            FoldError::Problem { code, .. } => Some(*code),
            FoldError::Store(StoreError::Corrupt { .. }) => Some(FoldProblemCode::CorruptRecord),
            FoldError::Store(StoreError::TooLarge { .. }) => Some(FoldProblemCode::RecordTooLarge),
            FoldError::Store(_) => None,
        }
    }
}

impl Retryable for FoldError {
    /// Whether folding the same fact later may succeed.
    fn is_retryable(&self) -> bool {
        match self {
            FoldError::Problem { retryable, .. } => *retryable,
            FoldError::Store(e) => e.is_retryable(),
        }
    }
}

/// The problem record of `event` failing with `detail`.
pub fn problem(
    event: &Event,
    sequence: Option<u64>,
    code: FoldProblemCode,
    detail: String,
) -> FoldProblem {
    let version = match &event.body {
        Body::DatasetValidated(p) => Some(p.version.clone()),
        Body::DatasetPrepared(p) => Some(p.version.clone()),
        // A checkpoint's version is its manifest's digest, known without fetching anything.
        Body::CheckpointCommitted(_) => {
            ManifestSource::of(event).ok().flatten().map(|m| m.digest())
        }
        _ => None,
    };
    // A checkpoint's problems are listed under its run's dataset, where a restore looks.
    let dataset = match &event.body {
        Body::CheckpointCommitted(p) => Some(checkpoint_dataset(&p.run)),
        Body::CheckpointDemoted(p) => Some(checkpoint_dataset(&p.run)),
        Body::CheckpointExpired(p) => Some(checkpoint_dataset(&p.run)),
        Body::CheckpointPartCommitted(p) => Some(checkpoint_dataset(&p.run)),
        Body::CheckpointPartOffloaded(p) => Some(checkpoint_dataset(&p.run)),
        Body::CheckpointPartRemoved(p) => Some(checkpoint_dataset(&p.run)),
        other => other.dataset().map(str::to_owned),
    };
    FoldProblem {
        event_id: event.id.clone(),
        kind: event.kind().to_owned(),
        project: event.project.clone(),
        dataset,
        version,
        stream_sequence: sequence,
        code,
        detail,
        occurred_at: event.occurred_at,
    }
}

/// The readiness keys one event touches: the ones to mirror after it folded. Computed from
/// the event alone, so a redelivered (already applied) event still re-mirrors — the mirror
/// may be what failed.
pub fn touched(event: &Event) -> Option<ReadinessKey> {
    let (dataset, version, tier, node) = match &event.body {
        Body::DatasetValidated(p) => (&p.dataset, &p.version, &p.source.tier, None),
        Body::DatasetPrepared(p) => (&p.dataset, &p.version, &p.location.tier, None),
        Body::StageRequested(p) => (&p.dataset, &p.version, &p.tier, p.node.as_ref()),
        Body::StageReleased(p) => (&p.dataset, &p.version, &p.tier, p.node.as_ref()),
        Body::StagePending(p) => (&p.dataset, &p.version, &p.tier, p.node.as_ref()),
        Body::StageReady(p) => (&p.dataset, &p.version, &p.location.tier, p.node.as_ref()),
        Body::StageFailed(p) => (&p.dataset, &p.version, &p.tier, p.node.as_ref()),
        Body::ReplicaCreated(p) => (&p.dataset, &p.version, &p.location.tier, p.node.as_ref()),
        Body::ReplicaRemoved(p) => (&p.dataset, &p.version, &p.location.tier, p.node.as_ref()),
        Body::ReplicaDamaged(p) => (&p.dataset, &p.version, &p.location.tier, p.node.as_ref()),
        Body::ReplicaRepaired(p) => (&p.dataset, &p.version, &p.location.tier, p.node.as_ref()),
        Body::ReplicaUnreachable(p) => (&p.dataset, &p.version, &p.location.tier, Some(&p.node)),
        Body::BackupCompleted(p) => (&p.dataset, &p.version, &p.location.tier, None),
        Body::RestoreVerified(p) => (&p.dataset, &p.version, &p.location.tier, None),
        Body::RestoreFailed(p) => (&p.dataset, &p.version, &p.location.tier, None),
        // A checkpoint's own copies (its version of `ckpt-<run>`) are no stage's: no
        // readiness; a restored copy's is the promoter's stage facts'.
        _ => return None,
    };
    // A stage fact may name a version prefix: its readiness is found through its request.
    if !is_sha256_hex(version) {
        return None;
    }
    Some(ReadinessKey {
        project: event.project.clone(),
        dataset: dataset.clone(),
        version: version.clone(),
        tier: tier.clone(),
        node: node.cloned(),
    })
}

/// Applies one event. Returns whether it changed anything (false for an event applied before:
/// one of the same project, kind and id).
pub fn apply(txn: &WriteTransaction, event: &Event) -> Result<bool, FoldError> {
    // Nothing of a fact naming another project's location is folded, however it got here
    // (a rebuild, a recorder whose consumer did not check): the one location rule.
    event
        .check_locations()
        .map_err(|r| FoldError::refused(&r))?;
    let scope = (event.project.as_str(), event.kind(), event.id.as_str());
    if txn.open_table(APPLIED)?.get(scope)?.is_some() {
        return Ok(false);
    }
    let stamp = Stamp {
        at: event.occurred_at,
        event_id: event.id.clone(),
    };
    match &event.body {
        Body::DatasetValidated(p) => dataset_validated(txn, event, p, &stamp)?,
        Body::DatasetPrepared(p) => dataset_prepared(txn, event, p, &stamp)?,
        Body::DatasetRejected(p) => dataset_rejected(txn, event, p, &stamp)?,
        Body::ReplicaCreated(p) => replica_created(txn, event, p, &stamp)?,
        Body::ReplicaRemoved(p) => replica_removed(txn, event, p, &stamp)?,
        Body::ReplicaDamaged(p) => replica_damaged(txn, event, p, &stamp)?,
        Body::ReplicaVerified(p) => replica_verified(txn, event, p, &stamp)?,
        Body::ReplicaRepaired(p) => replica_repaired(txn, event, p, &stamp)?,
        Body::ReplicaUnreachable(p) => replica_unreachable(txn, event, p, &stamp)?,
        Body::BackupCompleted(p) => backup_completed(txn, event, p, &stamp)?,
        Body::RestoreVerified(p) => restore_verified(txn, event, p, &stamp)?,
        Body::RestoreFailed(p) => restore_failed(txn, event, p, &stamp)?,
        Body::StageRequested(p) => stage_requested(txn, event, p, &stamp)?,
        Body::StageReleased(p) => stage_released(txn, event, p, &stamp)?,
        Body::StagePending(p) => stage_pending(txn, event, p, &stamp)?,
        Body::StageReady(p) => stage_ready(txn, event, p, &stamp)?,
        Body::StageFailed(p) => stage_failed(txn, event, p, &stamp)?,
        Body::CheckpointCommitted(p) => checkpoint_committed(txn, event, p, &stamp)?,
        Body::CheckpointDemoted(p) => checkpoint_demoted(txn, event, p, &stamp)?,
        Body::CheckpointExpired(p) => checkpoint_expired(txn, event, p, &stamp)?,
        Body::CheckpointHeld(p) => checkpoint_held(txn, event, p, &stamp)?,
        Body::CheckpointPartCommitted(p) => crate::parts::part_committed(txn, event, p, &stamp)?,
        Body::CheckpointPartOffloaded(p) => crate::parts::part_offloaded(txn, event, p, &stamp)?,
        Body::CheckpointPartRemoved(p) => crate::parts::part_removed(txn, event, p, &stamp)?,
        Body::DeadLetter(p) => dead_letter(txn, p, &stamp)?,
        Body::DeadLetterReplayed(p) => dead_letter_replayed(txn, p)?,
        Body::OperatorAction(p) => operator_action(txn, event, p, &stamp)?,
        // Ingest requests are not facts (the validator answers them with one). Kinds this
        // recorder does not know yet are marked applied too, so that a replay skips them the
        // same way.
        _ => {}
    }
    txn.open_table(APPLIED)?.insert(scope, ())?;
    Ok(true)
}

fn dataset_validated(
    txn: &WriteTransaction,
    event: &Event,
    p: &DatasetValidated,
    stamp: &Stamp,
) -> Result<(), FoldError> {
    let provenance = Provenance {
        by: p.requested_by.clone(),
        at: event.occurred_at,
        request_id: p.request_id.clone(),
        event_id: event.id.clone(),
        labels: p.labels.clone(),
        derived_from: None,
        layout: None,
        location: p.source.clone(),
    };
    let list = record_version(
        txn,
        event,
        &p.dataset,
        &p.version,
        p.total_bytes,
        provenance,
        stamp,
    )?;
    let copy = Copy {
        files: list.files,
        total_bytes: list.bytes,
        verified_by: "ingest-validation".into(),
        backup: false,
    };
    let state = (ReplicaState::Present, None);
    set_replica(
        txn,
        event,
        (&p.dataset, &p.version),
        (&p.source, None),
        stamp,
        state,
        Some(copy),
    )
}

fn dataset_prepared(
    txn: &WriteTransaction,
    event: &Event,
    p: &DatasetPrepared,
    stamp: &Stamp,
) -> Result<(), FoldError> {
    let provenance = Provenance {
        by: "resharder".into(),
        at: event.occurred_at,
        request_id: event.correlation_id.clone(),
        event_id: event.id.clone(),
        labels: vec![],
        derived_from: Some(p.derived_from.clone()),
        layout: Some(p.layout.clone()),
        location: p.location.clone(),
    };
    let list = record_version(
        txn,
        event,
        &p.dataset,
        &p.version,
        p.total_bytes,
        provenance,
        stamp,
    )?;
    let copy = Copy {
        files: list.files,
        total_bytes: list.bytes,
        verified_by: "prepared".into(),
        backup: false,
    };
    let state = (ReplicaState::Present, None);
    set_replica(
        txn,
        event,
        (&p.dataset, &p.version),
        (&p.location, None),
        stamp,
        state,
        Some(copy),
    )
}

fn dataset_rejected(
    txn: &WriteTransaction,
    event: &Event,
    p: &DatasetRejected,
    stamp: &Stamp,
) -> Result<(), FoldError> {
    let project = event.project.as_str();
    let what = || format!("rejection {project}/{}/{}", p.dataset, p.request_id);
    let (mut problems, problem_counts, problems_total) = if p.problem_counts.is_empty() {
        // Schema 1 listed every problem, unbounded: count them all, keep what fits.
        let mut tally = ProblemTally::new();
        for problem in &p.problems {
            tally.add(problem.clone());
        }
        tally.finish()
    } else {
        let total = p.problems_total.unwrap_or(p.problems.len() as u64);
        (p.problems.clone(), p.problem_counts.clone(), total)
    };
    let mut record = RejectionRecord {
        project: project.into(),
        dataset: p.dataset.clone(),
        request_id: p.request_id.clone(),
        declared_version: p.declared_version.clone(),
        requested_by: p.requested_by.clone(),
        source: p.source.clone(),
        problems: Vec::new(),
        problem_counts,
        problems_total,
        quarantine: p.quarantine.clone(),
        stamp: stamp.clone(),
    };
    // Problems are bounded by the contract, but a person's text can escape to more JSON than
    // it took in MessagePack: drop listed problems from the end until the record fits (the
    // counts still hold every one, and `quarantine` the full report).
    let value = loop {
        record.problems.clone_from(&problems);
        match encode(&record, what) {
            Ok(v) => break v,
            Err(StoreError::TooLarge { .. }) if !problems.is_empty() => {
                problems.truncate(problems.len() / 2);
            }
            Err(e) => return Err(e.into()),
        }
    };
    let new = {
        let mut rejections = txn.open_table(REJECTIONS)?;
        let key = (project, p.dataset.as_str(), p.request_id.as_str());
        let old: Option<RejectionRecord> = rejections
            .get(key)?
            .map(|v| decode(v.value(), what))
            .transpose()?;
        if old.as_ref().is_none_or(|old| *stamp > old.stamp) {
            rejections.insert(key, value.as_slice())?;
        }
        old.is_none()
    };
    dataset_seen(txn, project, &p.dataset, stamp, (0, u64::from(new)))
}

fn replica_created(
    txn: &WriteTransaction,
    event: &Event,
    p: &ReplicaCreated,
    stamp: &Stamp,
) -> Result<(), FoldError> {
    dataset_seen(txn, &event.project, &p.dataset, stamp, (0, 0))?;
    let copy = Copy {
        files: p.files,
        total_bytes: p.total_bytes,
        verified_by: p.verified_by.clone(),
        backup: false,
    };
    let state = (ReplicaState::Present, None);
    set_replica(
        txn,
        event,
        (&p.dataset, &p.version),
        (&p.location, p.node.as_deref()),
        stamp,
        state,
        Some(copy),
    )
}

fn replica_removed(
    txn: &WriteTransaction,
    event: &Event,
    p: &ReplicaRemoved,
    stamp: &Stamp,
) -> Result<(), FoldError> {
    dataset_seen(txn, &event.project, &p.dataset, stamp, (0, 0))?;
    // A copy held unreachable by a newer silence is gone all the same: the removal was
    // decided on it before (the folder is no longer there), and the silence never undoes one.
    let place = (&p.location, p.node.as_deref());
    let mut record = read_replica(txn, &event.project, (&p.dataset, &p.version), place)?;
    if record.state == ReplicaState::Unreachable && record.stamp.as_ref().is_some_and(|s| s > stamp)
    {
        record.state = ReplicaState::Removed;
        record.reason = Some(p.reason.clone());
        return write_replica(txn, &record);
    }
    let state = (ReplicaState::Removed, Some(p.reason.clone()));
    set_replica(
        txn,
        event,
        (&p.dataset, &p.version),
        (&p.location, p.node.as_deref()),
        stamp,
        state,
        None,
    )
}

/// A damaged replica is withdrawn: its state `damaged` with what was found (readiness derives
/// `pending` from it, whatever stages hold it) until a newer `replica.created` of it.
fn replica_damaged(
    txn: &WriteTransaction,
    event: &Event,
    p: &ReplicaDamaged,
    stamp: &Stamp,
) -> Result<(), FoldError> {
    dataset_seen(txn, &event.project, &p.dataset, stamp, (0, 0))?;
    let state = (ReplicaState::Damaged, Some(damage_reason(p)));
    set_replica(
        txn,
        event,
        (&p.dataset, &p.version),
        (&p.location, p.node.as_deref()),
        stamp,
        state,
        None,
    )
}

/// A scrub read the replica back whole and it verified: its record keeps when (the newest such
/// fact wins). It changes nothing else — a damaged copy is made present again only by its
/// repair — and a replica the catalogue does not know is not invented from it.
fn replica_verified(
    txn: &WriteTransaction,
    event: &Event,
    p: &ReplicaVerified,
    stamp: &Stamp,
) -> Result<(), FoldError> {
    let place = (&p.location, p.node.as_deref());
    let mut record = read_replica(txn, &event.project, (&p.dataset, &p.version), place)?;
    if record.stamp.is_none() {
        return Ok(());
    }
    if record
        .last_verified
        .as_ref()
        .is_some_and(|old| &old.stamp >= stamp)
    {
        return Ok(());
    }
    record.last_verified = Some(Verification {
        files: p.files,
        total_bytes: p.total_bytes,
        verified_by: p.verified_by.clone(),
        stamp: stamp.clone(),
    });
    write_replica(txn, &record)
}

/// A damaged replica repaired (its files that did not verify copied again, verified) is
/// present again, its readiness derived as before the damage; a newer fact still wins.
fn replica_repaired(
    txn: &WriteTransaction,
    event: &Event,
    p: &ReplicaRepaired,
    stamp: &Stamp,
) -> Result<(), FoldError> {
    dataset_seen(txn, &event.project, &p.dataset, stamp, (0, 0))?;
    set_replica(
        txn,
        event,
        (&p.dataset, &p.version),
        (&p.location, p.node.as_deref()),
        stamp,
        (ReplicaState::Present, None),
        None,
    )?;
    let place = (&p.location, p.node.as_deref());
    let mut record = read_replica(txn, &event.project, (&p.dataset, &p.version), place)?;
    if record
        .last_repaired
        .as_ref()
        .is_none_or(|old| &old.stamp < stamp)
    {
        record.last_repaired = Some(Repair {
            from_tier: p.from_tier.clone(),
            files: p.repaired_total,
            stamp: stamp.clone(),
        });
        write_replica(txn, &record)?;
    }
    Ok(())
}

/// A copy on a node whose agent went silent is withdrawn: `unreachable`, with since when,
/// until a newer fact of it (the agent's re-check: `replica.created` or `replica.damaged`). A
/// damaged copy stays damaged and a removed one gone; a copy not folded yet (the fact that made
/// it arrives later, older) is unreachable at once, so the order facts fold in does not decide
/// whether a job is sent to a silent node. A removal folded after it is applied whatever its
/// time ([`replica_removed`]).
fn replica_unreachable(
    txn: &WriteTransaction,
    event: &Event,
    p: &ReplicaUnreachable,
    stamp: &Stamp,
) -> Result<(), FoldError> {
    let place = (&p.location, Some(p.node.as_str()));
    let record = read_replica(txn, &event.project, (&p.dataset, &p.version), place)?;
    if matches!(record.state, ReplicaState::Removed | ReplicaState::Damaged)
        && record.stamp.is_some()
    {
        return Ok(());
    }
    set_replica(
        txn,
        event,
        (&p.dataset, &p.version),
        place,
        stamp,
        (ReplicaState::Unreachable, Some(unreachable_reason(p))),
        None,
    )
}

/// The sentence an unreachable copy's record keeps.
pub fn unreachable_reason(p: &ReplicaUnreachable) -> String {
    let last_seen = p
        .last_seen
        .format(&::time::format_description::well_known::Rfc3339)
        .unwrap_or_else(|_| p.last_seen.to_string());
    format!(
        "unreachable: node {} silent since {last_seen} (more than {}s); its agent re-checks the copy when it returns",
        p.node, p.silent_after_seconds
    )
}

/// The sentence a damaged replica's record keeps: how it was found, the first paths and how
/// each is damaged, and what happens next.
pub fn damage_reason(p: &ReplicaDamaged) -> String {
    let listed = p
        .files
        .iter()
        .map(|f| match (f.expected_size, f.found_size) {
            (Some(e), Some(found)) => format!("{} {} ({found} bytes, {e} listed)", f.path, f.how),
            _ => format!("{} {}", f.path, f.how),
        });
    let text = damage_text(&p.found_by, p.damaged_total, "path(s)", listed);
    format!("{text}; {}", p.reason)
}

/// `damaged (found by F): N what — the first few listed and how many more`: the one form of a
/// damaged copy's reason, whoever found it.
fn damage_text(
    found_by: &str,
    total: u64,
    what: &str,
    listed: impl Iterator<Item = String>,
) -> String {
    const SHOWN: usize = 5;
    let listed: Vec<String> = listed.take(SHOWN).collect();
    let more = total.saturating_sub(listed.len() as u64);
    let more = if more > 0 {
        format!(" and {more} more")
    } else {
        String::new()
    };
    format!(
        "damaged (found by {found_by}): {total} {what} — {}{more}",
        listed.join(", ")
    )
}

fn backup_completed(
    txn: &WriteTransaction,
    event: &Event,
    p: &BackupCompleted,
    stamp: &Stamp,
) -> Result<(), FoldError> {
    dataset_seen(txn, &event.project, &p.dataset, stamp, (0, 0))?;
    let copy = Copy {
        files: p.files,
        total_bytes: p.total_bytes,
        verified_by: "backup".into(),
        backup: true,
    };
    let version = (p.dataset.as_str(), p.version.as_str());
    // The facts of one copy may fold in any order: a drill that failed after the copy was
    // made, folded first, still holds it damaged.
    let record = read_replica(txn, &event.project, version, (&p.location, None))?;
    let state = match record
        .last_drill
        .as_ref()
        .filter(|d| !d.ok && &d.stamp > stamp)
    {
        Some(d) => (
            ReplicaState::Damaged,
            Some(drill_damage_reason(&d.problems, d.problems.len() as u64)),
        ),
        None => (ReplicaState::Present, None),
    };
    set_replica(
        txn,
        event,
        version,
        (&p.location, None),
        stamp,
        state,
        Some(copy),
    )
}

fn restore_verified(
    txn: &WriteTransaction,
    event: &Event,
    p: &RestoreVerified,
    stamp: &Stamp,
) -> Result<(), FoldError> {
    let drill = Drill {
        ok: true,
        sampled_files: p.sampled_files,
        problems: vec![],
        stamp: stamp.clone(),
    };
    set_drill(
        txn,
        event,
        (&p.dataset, &p.version),
        (&p.location, None),
        drill,
    )
}

fn restore_failed(
    txn: &WriteTransaction,
    event: &Event,
    p: &RestoreFailed,
    stamp: &Stamp,
) -> Result<(), FoldError> {
    let drill = Drill {
        ok: false,
        sampled_files: 0,
        problems: p.problems.clone(),
        stamp: stamp.clone(),
    };
    let version = (p.dataset.as_str(), p.version.as_str());
    set_drill(txn, event, version, (&p.location, None), drill)?;
    // A backup that does not restore is damaged, whoever found it: marked so, it no longer
    // counts as a verified copy (nothing is demoted or expired on its strength) and the scrub
    // repairs it from a copy that verifies, as it does the damage it finds itself. A drill of
    // a copy the catalogue does not know invents none; one older than the copy's last fact (a
    // repair) changes nothing.
    if read_replica(txn, &event.project, version, (&p.location, None))?
        .stamp
        .is_some()
    {
        let total = p.problems_total.unwrap_or(p.problems.len() as u64);
        let reason = drill_damage_reason(&p.problems, total);
        set_replica(
            txn,
            event,
            version,
            (&p.location, None),
            stamp,
            (ReplicaState::Damaged, Some(reason)),
            None,
        )?;
    }
    Ok(())
}

/// The reason a backup that failed its restore drill is damaged: the problems it found
/// (`total` of them in all).
fn drill_damage_reason(problems: &[Problem], total: u64) -> String {
    let listed = problems.iter().map(|f| match &f.path {
        Some(path) => format!("{path} {}", f.code),
        None => f.code.clone(),
    });
    damage_text("restore drill", total, "problem(s)", listed)
}

fn stage_requested(
    txn: &WriteTransaction,
    event: &Event,
    p: &StageRequested,
    stamp: &Stamp,
) -> Result<(), FoldError> {
    let change = StageChange {
        request_id: event.id.clone(),
        dataset: &p.dataset,
        version: &p.version,
        tier: &p.tier,
        node: p.node.as_deref(),
        job_id: &p.job_id,
        rank: stage::REQUESTED,
        state: StageState::Pending,
        waiting_for: None,
        reason: Some("waiting for the promoter".into()),
        retryable: None,
        ready: None,
        hold_until: p.hold_until,
        ready_estimate: None,
    };
    stage::record(txn, event, change, stamp)
}

fn stage_pending(
    txn: &WriteTransaction,
    event: &Event,
    p: &StagePending,
    stamp: &Stamp,
) -> Result<(), FoldError> {
    let change = StageChange {
        request_id: p.request_id.clone(),
        dataset: &p.dataset,
        version: &p.version,
        tier: &p.tier,
        node: p.node.as_deref(),
        job_id: &p.job_id,
        rank: stage::ANSWERED,
        state: StageState::Pending,
        waiting_for: Some(p.waiting_for.clone()),
        reason: Some(p.reason.clone()),
        retryable: None,
        ready: None,
        hold_until: None,
        ready_estimate: p.ready_estimate.clone(),
    };
    stage::record(txn, event, change, stamp)
}

fn stage_ready(
    txn: &WriteTransaction,
    event: &Event,
    p: &StageReady,
    stamp: &Stamp,
) -> Result<(), FoldError> {
    let change = StageChange {
        request_id: p.request_id.clone(),
        dataset: &p.dataset,
        version: &p.version,
        tier: &p.location.tier,
        node: p.node.as_deref(),
        job_id: &p.job_id,
        rank: stage::ANSWERED,
        state: StageState::Ready,
        waiting_for: None,
        reason: None,
        retryable: None,
        ready: Some((p.path.clone(), p.location.prefix.clone())),
        hold_until: None,
        ready_estimate: None,
    };
    stage::record(txn, event, change, stamp)
}

fn stage_failed(
    txn: &WriteTransaction,
    event: &Event,
    p: &StageFailed,
    stamp: &Stamp,
) -> Result<(), FoldError> {
    let change = StageChange {
        request_id: p.request_id.clone(),
        dataset: &p.dataset,
        version: &p.version,
        tier: &p.tier,
        node: p.node.as_deref(),
        job_id: &p.job_id,
        rank: stage::ANSWERED,
        state: StageState::Failed,
        waiting_for: None,
        reason: Some(p.reason.clone()),
        retryable: Some(p.retryable),
        ready: None,
        hold_until: None,
        ready_estimate: None,
    };
    stage::record(txn, event, change, stamp)
}

fn stage_released(
    txn: &WriteTransaction,
    event: &Event,
    p: &StageReleased,
    stamp: &Stamp,
) -> Result<(), FoldError> {
    // Applied to every request of the job it names, however either spelled the version: now
    // to those folded, and to those folded later as they come (`stage::release`).
    stage::release(txn, &event.project, p, stamp)
}

/// The stage request a release ends: the one the same job, data, tier and node asked with.
pub fn released_request(event: &Event, p: &StageReleased) -> EventId {
    EventId::for_stage(
        &event.project,
        &p.job_id,
        &p.dataset,
        &p.version,
        &p.tier,
        p.node.as_deref(),
    )
}

/// The stage request an event is about, if it is about one.
pub fn stage_request_of(event: &Event) -> Option<EventId> {
    match &event.body {
        Body::StageRequested(_) => Some(event.id.clone()),
        Body::StagePending(p) => Some(p.request_id.clone()),
        Body::StageReady(p) => Some(p.request_id.clone()),
        Body::StageFailed(p) => Some(p.request_id.clone()),
        Body::StageReleased(p) => Some(released_request(event, p)),
        _ => None,
    }
}

/// The version a checkpoint commit records: its manifest's digest.
fn checkpoint_digest(event: &Event) -> Result<String, FoldError> {
    Ok(ManifestSource::of(event)
        .map_err(FoldError::manifest)?
        .ok_or_else(|| FoldError::malformed("the fact carries no manifest"))?
        .digest())
}

/// A checkpoint commit: the checkpoint's record, and a version of its run's dataset
/// ([`checkpoint_dataset`]) with the committed copy as its replica, so that it is staged
/// like any other version. A demotion or expiry folded before the commit (the digest was
/// unknown then) is carried out on the replicas now, from the record.
fn checkpoint_committed(
    txn: &WriteTransaction,
    event: &Event,
    p: &CheckpointCommitted,
    stamp: &Stamp,
) -> Result<(), FoldError> {
    refuse_overlapping_checkpoint(txn, event, p)?;
    let digest = checkpoint_digest(event)?;
    let dataset = checkpoint_dataset(&p.run);
    let provenance = Provenance {
        by: format!("checkpoint commit of run {} step {}", p.run, p.step),
        at: event.occurred_at,
        request_id: event.id.clone(),
        event_id: event.id.clone(),
        labels: vec![("step".into(), p.step.to_string())],
        derived_from: None,
        layout: None,
        location: p.location.clone(),
    };
    let list = record_version(
        txn,
        event,
        &dataset,
        &digest,
        p.total_bytes,
        provenance,
        stamp,
    )?;
    let commit = (p.total_bytes, p.tags.clone(), digest.clone());
    let state = (CheckpointState::Committed, &p.location, None);
    let record = set_checkpoint(
        txn,
        &event.project,
        (&p.run, p.step),
        stamp,
        state,
        Some(commit),
    )?;
    let version = (dataset.as_str(), digest.as_str());
    let copy = || Copy {
        files: list.files,
        total_bytes: list.bytes,
        verified_by: CHECKPOINT_VERIFIED_BY.into(),
        backup: false,
    };
    // Checkpoints live on shared tiers (hot, capacity): their copies carry no node.
    let present = (ReplicaState::Present, None);
    set_replica(
        txn,
        event,
        version,
        (&p.location, None),
        stamp,
        present.clone(),
        Some(copy()),
    )?;
    let later = &record.stamp;
    match record.state {
        CheckpointState::Committed => Ok(()),
        CheckpointState::Demoted => {
            let removed = (
                ReplicaState::Removed,
                Some(demoted_reason(
                    &record.location.tier,
                    record.rule.as_deref(),
                )),
            );
            if record.location.tier != p.location.tier {
                set_replica(
                    txn,
                    event,
                    version,
                    (&p.location, None),
                    later,
                    removed,
                    None,
                )?;
            }
            let to = &record.location;
            set_replica(
                txn,
                event,
                version,
                (to, None),
                later,
                present,
                Some(copy()),
            )
        }
        CheckpointState::Expired => {
            let removed = (
                ReplicaState::Removed,
                Some(expired_reason(record.rule.as_deref())),
            );
            // Expired elsewhere than where it was committed: it was demoted there first.
            if record.location.tier != p.location.tier {
                set_replica(
                    txn,
                    event,
                    version,
                    (&p.location, None),
                    later,
                    removed.clone(),
                    None,
                )?;
            }
            set_replica(
                txn,
                event,
                version,
                (&record.location, None),
                later,
                removed,
                None,
            )
        }
    }
}

/// A step is one folder of its own: a commit whose folder is, contains or lies in the folder
/// of another live step of the project (any run, any tier: a demotion keeps the prefix) is not
/// folded — a problem naming both — so that removing one step never removes the other's files.
fn refuse_overlapping_checkpoint(
    txn: &WriteTransaction,
    event: &Event,
    p: &CheckpointCommitted,
) -> Result<(), FoldError> {
    let table = txn.open_table(CHECKPOINTS)?;
    let found = overlapping_checkpoints(&table, &event.project, &p.location.prefix)?
        .into_iter()
        .find(|other| (other.run.as_str(), other.step) != (p.run.as_str(), p.step));
    match found {
        None => Ok(()),
        Some(other) => Err(FoldError::Problem {
            code: FoldProblemCode::CheckpointOverlap,
            retryable: false,
            detail: format!(
                "checkpoint run {} step {} at {}:{} overlaps run {} step {} at {}:{}: a step is \
                 one folder that no other live step is in, contains or lies in; not folded",
                p.run,
                p.step,
                p.location.tier,
                p.location.prefix,
                other.run,
                other.step,
                other.location.tier,
                other.location.prefix
            ),
        }),
    }
}

/// The live (not expired) checkpoints of `project` whose folder overlaps `prefix`
/// ([`folders_overlap`]), in (run, step) order. Scans the project's checkpoints: a project
/// has hundreds, not millions.
pub(crate) fn overlapping_checkpoints(
    table: &impl ReadableTable<(&'static str, &'static str, u64), &'static [u8]>,
    project: &str,
    prefix: &str,
) -> Result<Vec<CheckpointRecord>, StoreError> {
    let mut out = Vec::new();
    for row in table.range((project, "", 0)..)? {
        let (k, v) = row?;
        let (p, run, step) = k.value();
        if p != project {
            break;
        }
        let record: CheckpointRecord =
            decode(v.value(), || format!("checkpoint {project}/{run}/{step}"))?;
        if record.state != CheckpointState::Expired
            && folders_overlap(&record.location.prefix, prefix)
        {
            out.push(record);
        }
    }
    Ok(out)
}

/// A demotion or expiry the demoter left undone: kept on the checkpoint's record (the newest
/// one), shown while no later demotion or expiry has folded. A hold of a step the catalogue
/// does not hold (its commit refused) is dropped.
fn checkpoint_held(
    txn: &WriteTransaction,
    event: &Event,
    p: &CheckpointHeld,
    stamp: &Stamp,
) -> Result<(), FoldError> {
    let project = event.project.as_str();
    let what = || format!("checkpoint {project}/{}/{}", p.run, p.step);
    let mut table = txn.open_table(CHECKPOINTS)?;
    let existing: Option<CheckpointRecord> = table
        .get((project, p.run.as_str(), p.step))?
        .map(|v| decode(v.value(), what))
        .transpose()?;
    let Some(mut record) = existing else {
        return Ok(());
    };
    if record.held.as_ref().is_some_and(|h| &h.stamp >= stamp) {
        return Ok(());
    }
    record.held = Some(CheckpointHold {
        decision: p.decision.clone(),
        reason: p.reason.clone(),
        unlisted: p.unlisted.clone(),
        unlisted_total: p.unlisted_total,
        stamp: stamp.clone(),
    });
    table.insert(
        (project, p.run.as_str(), p.step),
        encode(&record, what)?.as_slice(),
    )?;
    Ok(())
}

/// The `reason` of a checkpoint replica removed by a demotion to `tier`.
fn demoted_reason(tier: &str, rule: Option<&str>) -> String {
    format!(
        "checkpoint demoted to {tier} ({})",
        rule.unwrap_or("retention")
    )
}

/// The `reason` of a checkpoint replica removed by an expiry.
fn expired_reason(rule: Option<&str>) -> String {
    format!("checkpoint expired ({})", rule.unwrap_or("retention"))
}

/// A demotion: the checkpoint's replica moves from the tier it was on to the one it went to
/// (once the commit, and so the version, is known).
fn checkpoint_demoted(
    txn: &WriteTransaction,
    event: &Event,
    p: &CheckpointDemoted,
    stamp: &Stamp,
) -> Result<(), FoldError> {
    let state = (CheckpointState::Demoted, &p.to, p.rule.as_deref());
    let record = set_checkpoint(txn, &event.project, (&p.run, p.step), stamp, state, None)?;
    let Some(digest) = record.digest.as_deref() else {
        return Ok(());
    };
    let dataset = checkpoint_dataset(&p.run);
    let version = (dataset.as_str(), digest);
    let files = txn
        .open_table(FILE_LISTS)?
        .get(digest)?
        .map(|v| decode::<FileListRecord>(v.value(), || format!("file list {digest}")))
        .transpose()?
        .map_or(0, |l| l.files);
    let copy = Copy {
        files,
        total_bytes: p.total_bytes,
        verified_by: CHECKPOINT_VERIFIED_BY.into(),
        backup: false,
    };
    let why = demoted_reason(&p.to.tier, p.rule.as_deref());
    if p.from.tier != p.to.tier {
        let removed = (ReplicaState::Removed, Some(why));
        set_replica(txn, event, version, (&p.from, None), stamp, removed, None)?;
    }
    let present = (ReplicaState::Present, None);
    set_replica(
        txn,
        event,
        version,
        (&p.to, None),
        stamp,
        present,
        Some(copy),
    )
}

/// An expiry: the checkpoint's replica where it was is removed (once the version is known).
fn checkpoint_expired(
    txn: &WriteTransaction,
    event: &Event,
    p: &CheckpointExpired,
    stamp: &Stamp,
) -> Result<(), FoldError> {
    let state = (CheckpointState::Expired, &p.location, Some(p.rule.as_str()));
    let record = set_checkpoint(txn, &event.project, (&p.run, p.step), stamp, state, None)?;
    let Some(digest) = record.digest.as_deref() else {
        return Ok(());
    };
    let dataset = checkpoint_dataset(&p.run);
    let removed = (ReplicaState::Removed, Some(expired_reason(Some(&p.rule))));
    set_replica(
        txn,
        event,
        (&dataset, digest),
        (&p.location, None),
        stamp,
        removed,
        None,
    )
}

fn dead_letter(txn: &WriteTransaction, p: &DeadLetter, stamp: &Stamp) -> Result<(), FoldError> {
    let what = || format!("dead letters of {}", p.service);
    let mut table = txn.open_table(DEAD_LETTERS)?;
    let old: Option<DeadLetterRecord> = table
        .get(p.service.as_str())?
        .map(|v| decode(v.value(), what))
        .transpose()?;
    let mut record = old.unwrap_or(DeadLetterRecord {
        service: p.service.clone(),
        count: 0,
        last_subject: String::new(),
        last_stream_sequence: 0,
        last_error: None,
        stamp: stamp.clone(),
        waiting: None,
    });
    // The count is a sum, so it is order-free; "last" follows the stamp.
    record.count += 1;
    if record.count == 1 || *stamp >= record.stamp {
        record.last_subject.clone_from(&p.subject);
        record.last_stream_sequence = p.stream_sequence;
        record.last_error = p.errors.last().map(|a| a.error.clone());
        record.stamp = stamp.clone();
    }
    table.insert(p.service.as_str(), encode(&record, what)?.as_slice())?;
    let id = stamp.event_id.as_str();
    let was = dead_letter_state(txn, &p.service, id)?;
    txn.open_table(DEAD_LETTER_STATES)?
        .insert((p.service.as_str(), id), was | DEAD_LETTER_FOLDED)?;
    // A replay or discard folded before its dead letter (a redelivery can reorder them)
    // leaves it done.
    if was & (DEAD_LETTER_REPLAYED | DEAD_LETTER_DISCARDED) == 0 {
        add_waiting(txn, &p.service, 1)?;
    }
    Ok(())
}

fn dead_letter_state(txn: &WriteTransaction, service: &str, id: &str) -> Result<u8, FoldError> {
    Ok(txn
        .open_table(DEAD_LETTER_STATES)?
        .get((service, id))?
        .map_or(0, |v| v.value()))
}

fn add_waiting(txn: &WriteTransaction, service: &str, delta: i64) -> Result<(), FoldError> {
    let mut table = txn.open_table(DEAD_LETTERS_WAITING)?;
    let now = table.get(service)?.map_or(0, |v| v.value());
    table.insert(service, now.saturating_add_signed(delta))?;
    Ok(())
}

/// A replay (`stagehand dlq replay`): the dead letter no longer waits for a person. Counted
/// once per dead letter, however often it was replayed; the dead letter itself stays counted
/// in `count`, and the replayed message, if it fails again, is a new dead letter.
fn dead_letter_replayed(txn: &WriteTransaction, p: &DeadLetterReplayed) -> Result<(), FoldError> {
    let id = p.dead_letter_id.as_str();
    let was = dead_letter_state(txn, &p.service, id)?;
    if was & DEAD_LETTER_REPLAYED != 0 {
        return Ok(());
    }
    // On a store upgraded from a layout that did not fold replays, an unknown dead letter
    // is one counted then (see `dead_letters_counted_before_upgrade`).
    let folded =
        was & DEAD_LETTER_FOLDED != 0 || crate::store::dead_letters_counted_before_upgrade(txn)?;
    txn.open_table(DEAD_LETTER_STATES)?.insert(
        (p.service.as_str(), id),
        was | DEAD_LETTER_REPLAYED | if folded { DEAD_LETTER_FOLDED } else { 0 },
    )?;
    if folded && was & DEAD_LETTER_DISCARDED == 0 {
        add_waiting(txn, &p.service, -1)?;
    }
    Ok(())
}

/// An operator's action: kept (newest first) for `stagehand status --actions`. A discard
/// stops its dead letter waiting, once, whether it is folded before or after the dead letter
/// and whatever replay of it was folded before.
fn operator_action(
    txn: &WriteTransaction,
    event: &Event,
    p: &OperatorAction,
    stamp: &Stamp,
) -> Result<(), FoldError> {
    let record = OperatorActionRecord {
        project: event.project.clone(),
        action: p.action.clone(),
        by: p.by.clone(),
        target: p.target.clone(),
        reason: p.reason.clone(),
        service: p.service.clone(),
        dead_letter_id: p.dead_letter_id.clone(),
        dead_letter_sequence: p.dead_letter_sequence,
        request_id: p.request_id.clone(),
        stamp: stamp.clone(),
    };
    let key = operator_action_key(stamp);
    let what = || format!("operator action {}", stamp.event_id);
    txn.open_table(OPERATOR_ACTIONS)?
        .insert(key.as_str(), encode(&record, what)?.as_slice())?;
    if let (action::DLQ_DISCARD, Some(service), Some(id)) =
        (p.action.as_str(), &p.service, &p.dead_letter_id)
    {
        let was = dead_letter_state(txn, service, id.as_str())?;
        if was & DEAD_LETTER_DISCARDED != 0 {
            return Ok(());
        }
        txn.open_table(DEAD_LETTER_STATES)?
            .insert((service.as_str(), id.as_str()), was | DEAD_LETTER_DISCARDED)?;
        if was & DEAD_LETTER_FOLDED != 0 && was & DEAD_LETTER_REPLAYED == 0 {
            add_waiting(txn, service, -1)?;
        }
    }
    Ok(())
}

/// The `operator_actions` key of the action stamped `stamp`: the time inverted, so that the
/// table's order is newest first, then the event id.
pub(crate) fn operator_action_key(stamp: &Stamp) -> String {
    let micros = u64::try_from(stamp.at.unix_timestamp_nanos() / 1_000).unwrap_or(0);
    format!("{:020}.{}", u64::MAX - micros, stamp.event_id)
}

/// Creates the dataset record on its first fact and adds `(versions, rejections)` to its counts.
fn dataset_seen(
    txn: &WriteTransaction,
    project: &str,
    dataset: &str,
    stamp: &Stamp,
    (versions, rejections): (u64, u64),
) -> Result<(), FoldError> {
    let what = || format!("dataset {project}/{dataset}");
    let mut table = txn.open_table(DATASETS)?;
    let old: Option<DatasetRecord> = table
        .get((project, dataset))?
        .map(|v| decode(v.value(), what))
        .transpose()?;
    let mut record = match old {
        Some(old) => {
            if old.first_seen <= stamp.at && versions == 0 && rejections == 0 {
                return Ok(());
            }
            old
        }
        None => {
            txn.open_table(DATASET_NAMES)?
                .insert((dataset, project), ())?;
            DatasetRecord {
                project: project.into(),
                dataset: dataset.into(),
                first_seen: stamp.at,
                version_count: 0,
                rejection_count: 0,
            }
        }
    };
    record.first_seen = record.first_seen.min(stamp.at);
    record.version_count += versions;
    record.rejection_count += rejections;
    table.insert((project, dataset), encode(&record, what)?.as_slice())?;
    Ok(())
}

/// The sort key of a version by its provenance time.
fn order_key(at: ::time::OffsetDateTime) -> i128 {
    at.unix_timestamp_nanos()
}

/// Records a version (or one more request for it) and returns its file list.
fn record_version(
    txn: &WriteTransaction,
    event: &Event,
    dataset: &str,
    version: &str,
    declared_bytes: u64,
    provenance: Provenance,
    stamp: &Stamp,
) -> Result<FileListRecord, FoldError> {
    let project = event.project.as_str();
    let list: FileListRecord = match txn.open_table(FILE_LISTS)?.get(version)? {
        Some(v) => decode(v.value(), || format!("file list {version}"))?,
        None => {
            return Err(FoldError::Problem {
                code: FoldProblemCode::ManifestMissing,
                detail: format!("the file list of version {version} is not in the catalogue store"),
                retryable: true,
            });
        }
    };
    if list.bytes != declared_bytes {
        return Err(FoldError::malformed(format!(
            "the fact says {declared_bytes} bytes but version {version}'s manifest holds {}",
            list.bytes
        )));
    }
    let what = || format!("version {project}/{dataset}/{version}");
    let request_new = txn
        .open_table(VERSION_REQUESTS)?
        .insert(
            (project, dataset, version, provenance.request_id.as_str()),
            (),
        )?
        .is_none();
    let mut versions = txn.open_table(VERSIONS)?;
    let old: Option<VersionRecord> = versions
        .get((project, dataset, version))?
        .map(|v| decode(v.value(), what))
        .transpose()?;
    let new = old.is_none();
    let mut order = txn.open_table(VERSION_ORDER)?;
    let record = match old {
        Some(mut old) => {
            old.request_count += u64::from(request_new);
            // The earliest recording is the version's provenance.
            if (provenance.at, &provenance.event_id) < (old.provenance.at, &old.provenance.event_id)
            {
                order.remove((project, dataset, order_key(old.provenance.at), version))?;
                order.insert((project, dataset, order_key(provenance.at), version), ())?;
                old.provenance = provenance;
            }
            old
        }
        None => {
            order.insert((project, dataset, order_key(provenance.at), version), ())?;
            VersionRecord {
                project: project.into(),
                dataset: dataset.into(),
                version: version.into(),
                file_count: list.files,
                total_bytes: list.bytes,
                provenance,
                request_count: 1,
            }
        }
    };
    versions.insert(
        (project, dataset, version),
        encode(&record, what)?.as_slice(),
    )?;
    drop((versions, order));
    dataset_seen(txn, project, dataset, stamp, (u64::from(new), 0))?;
    Ok(list)
}

/// What a copy holds, from the fact that made it.
struct Copy {
    files: u64,
    total_bytes: u64,
    verified_by: String,
    backup: bool,
}

fn empty_replica(
    project: &str,
    (dataset, version): (&str, &str),
    (location, node): (&Location, Option<&str>),
) -> ReplicaRecord {
    ReplicaRecord {
        project: project.into(),
        dataset: dataset.into(),
        version: version.into(),
        tier: location.tier.clone(),
        node: node.map(str::to_owned),
        prefix: location.prefix.clone(),
        state: ReplicaState::Staging,
        reason: None,
        stamp: None,
        files: 0,
        total_bytes: 0,
        verified_by: None,
        backup: false,
        copied: None,
        last_drill: None,
        last_verified: None,
        last_repaired: None,
    }
}

/// The replica on `location`'s tier (and on `node`, for a node-local tier: each node has its
/// own), or a new record of it.
fn read_replica(
    txn: &WriteTransaction,
    project: &str,
    (dataset, version): (&str, &str),
    (location, node): (&Location, Option<&str>),
) -> Result<ReplicaRecord, FoldError> {
    let node_key = node.unwrap_or("");
    let what = || {
        format!(
            "replica {project}/{dataset}/{version}/{}/{node_key}",
            location.tier
        )
    };
    let table = txn.open_table(REPLICAS)?;
    let old = table
        .get((project, dataset, version, location.tier.as_str(), node_key))?
        .map(|v| decode::<ReplicaRecord>(v.value(), what))
        .transpose()?;
    Ok(old.unwrap_or_else(|| empty_replica(project, (dataset, version), (location, node))))
}

fn write_replica(txn: &WriteTransaction, record: &ReplicaRecord) -> Result<(), FoldError> {
    let key = (
        record.project.as_str(),
        record.dataset.as_str(),
        record.version.as_str(),
        record.tier.as_str(),
        record.node.as_deref().unwrap_or(""),
    );
    let value = encode(record, || format!("replica {key:?}"))?;
    txn.open_table(REPLICAS)?.insert(key, value.as_slice())?;
    let (project, dataset, version, tier, node) = key;
    txn.open_table(REPLICAS_BY_PLACE)?
        .insert((tier, node, project, dataset, version), ())?;
    // Every tier (and node) with a replica has a readiness record to list and mirror.
    let mut readiness = txn.open_table(READINESS)?;
    if readiness.get(key)?.is_none() {
        let value = encode(&ReadinessAggregate::default(), || {
            format!("readiness {key:?}")
        })?;
        readiness.insert(key, value.as_slice())?;
    }
    Ok(())
}

fn set_replica(
    txn: &WriteTransaction,
    event: &Event,
    version: (&str, &str),
    place: (&Location, Option<&str>),
    stamp: &Stamp,
    (state, reason): (ReplicaState, Option<String>),
    copy: Option<Copy>,
) -> Result<(), FoldError> {
    let mut record = read_replica(txn, &event.project, version, place)?;
    let mut changed = false;
    if record.stamp.as_ref().is_none_or(|old| stamp > old) {
        record.state = state;
        record.reason = reason;
        record.prefix.clone_from(&place.0.prefix);
        record.stamp = Some(stamp.clone());
        changed = true;
    }
    if let Some(copy) = copy
        && record.copied.as_ref().is_none_or(|old| stamp > old)
    {
        record.files = copy.files;
        record.total_bytes = copy.total_bytes;
        record.verified_by = Some(copy.verified_by);
        record.backup = copy.backup;
        record.copied = Some(stamp.clone());
        changed = true;
    }
    if changed {
        write_replica(txn, &record)?;
    }
    Ok(())
}

fn set_drill(
    txn: &WriteTransaction,
    event: &Event,
    version: (&str, &str),
    place: (&Location, Option<&str>),
    drill: Drill,
) -> Result<(), FoldError> {
    // The drill of a replica the catalogue does not know yet is still recorded, so that a
    // later `backup.completed` finds it.
    let mut record = read_replica(txn, &event.project, version, place)?;
    if record
        .last_drill
        .as_ref()
        .is_none_or(|old| drill.stamp > old.stamp)
    {
        record.last_drill = Some(drill);
        write_replica(txn, &record)?;
    }
    Ok(())
}

fn set_checkpoint(
    txn: &WriteTransaction,
    project: &str,
    (run, step): (&str, u64),
    stamp: &Stamp,
    (state, location, rule): (CheckpointState, &Location, Option<&str>),
    commit: Option<(u64, Vec<String>, String)>,
) -> Result<CheckpointRecord, FoldError> {
    let what = || format!("checkpoint {project}/{run}/{step}");
    let mut table = txn.open_table(CHECKPOINTS)?;
    let existing: Option<CheckpointRecord> = table
        .get((project, run, step))?
        .map(|v| decode(v.value(), what))
        .transpose()?;
    let mut changed = existing.is_none();
    let mut record = existing.unwrap_or(CheckpointRecord {
        project: project.into(),
        run: run.into(),
        step,
        state,
        location: location.clone(),
        stamp: stamp.clone(),
        total_bytes: 0,
        tags: vec![],
        committed: None,
        rule: rule.map(str::to_owned),
        digest: None,
        held: None,
    });
    if *stamp > record.stamp {
        record.state = state;
        record.location = location.clone();
        record.stamp = stamp.clone();
        record.rule = rule.map(str::to_owned);
        changed = true;
    }
    if let Some((total_bytes, tags, digest)) = commit
        && record.committed.as_ref().is_none_or(|old| stamp > old)
    {
        record.total_bytes = total_bytes;
        record.tags = tags;
        record.digest = Some(digest);
        record.committed = Some(stamp.clone());
        changed = true;
    }
    if changed {
        table.insert((project, run, step), encode(&record, what)?.as_slice())?;
    }
    Ok(record)
}

#[cfg(test)]
mod tests {
    use stagehand_catalogue::*;

    use crate::store::Folded;
    use crate::testing::*;

    #[test]
    fn same_fact_twice_is_once() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_with(dir.path(), "a.redb", &[validated(1)]);
        let once = store.dump().unwrap();
        assert_eq!(fold_into(&store, &[validated(1)]), vec![Folded::Done]);
        assert_eq!(store.dump().unwrap(), once, "a second copy changes nothing");
    }

    /// The hot replica of version 1 as the `version` query answers it.
    fn hot_replica(store: &crate::store::Store) -> ReplicaRecord {
        let v = validated(1);
        let Answer::Version(detail) = crate::answer(
            store,
            &Query::Version {
                project: Some("lab-a".into()),
                dataset: "cats".into(),
                version: version_of(&v),
                limit: None,
            },
        ) else {
            panic!("not a version answer")
        };
        detail
            .replicas
            .into_iter()
            .find(|r| r.tier == "hot")
            .expect("the hot replica")
    }

    /// `replica.verified` of version 1's hot replica, `seconds` after its creation.
    fn verified(seconds: i64) -> stagehand_schemas::Event {
        let created = replica(1, false);
        let mut e = created.caused(
            &format!("verified:{seconds}"),
            stagehand_schemas::Body::ReplicaVerified(stagehand_schemas::ReplicaVerified {
                dataset: "cats".into(),
                version: version_of(&validated(1)),
                location: stagehand_schemas::Location {
                    tier: "hot".into(),
                    prefix: "lab-a/cats/hot".into(),
                },
                node: None,
                files: 2,
                total_bytes: 3,
                verified_by: "scrub".into(),
            }),
        );
        e.occurred_at = created.occurred_at + ::time::Duration::seconds(seconds);
        e
    }

    /// Guards the catalogue's record of scrubs: the newest `replica.verified` of a replica is
    /// kept as its last verification whatever order they fold in, nothing else of the replica
    /// changes, and one of a replica the catalogue does not know invents none.
    #[test]
    fn a_replica_keeps_its_newest_verification_and_nothing_else_changes() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_with(
            dir.path(),
            "a.redb",
            &[validated(1), replica(1, false), verified(60), verified(30)],
        );
        let r = hot_replica(&store);
        assert_eq!(r.state, ReplicaState::Present);
        assert_eq!(r.verified_by.as_deref(), Some("read-back"));
        let last = r.last_verified.expect("verified");
        assert_eq!(last.stamp.event_id, verified(60).id);
        assert_eq!((last.files, last.total_bytes), (2, 3));
        assert_eq!(last.verified_by, "scrub");

        let other = tempfile::tempdir().unwrap();
        let unknown = store_with(other.path(), "b.redb", &[validated(1), verified(60)]);
        let Answer::Version(detail) = crate::answer(
            &unknown,
            &Query::Version {
                project: Some("lab-a".into()),
                dataset: "cats".into(),
                version: version_of(&validated(1)),
                limit: None,
            },
        ) else {
            panic!("not a version answer")
        };
        assert!(
            detail.replicas.iter().all(|r| r.tier != "hot"),
            "{detail:?}"
        );
    }

    /// `replica.unreachable` of version 1's copy on `node`'s local tier, at `at` seconds.
    fn unreachable(node: &str, at: i64) -> stagehand_schemas::Event {
        let created = node_replica(1, node, false, 0);
        let mut e = created.caused(
            &format!("unreachable:local:{node}:{at}"),
            stagehand_schemas::Body::ReplicaUnreachable(stagehand_schemas::ReplicaUnreachable {
                dataset: "cats".into(),
                version: version_of(&validated(1)),
                location: stagehand_schemas::Location {
                    tier: "local".into(),
                    prefix: "lab-a/cats/v".into(),
                },
                node: node.into(),
                last_seen: created.occurred_at,
                silent_after_seconds: 120,
            }),
        );
        e.occurred_at = ::time::OffsetDateTime::from_unix_timestamp(1_700_000_000 + at).unwrap();
        e
    }

    /// Version 1's copies on the local tier: (node, state, reason), in node order.
    fn local_copies(store: &crate::store::Store) -> Vec<(String, ReplicaState, Option<String>)> {
        let Answer::ReplicasOn { replicas, next } = crate::answer(
            store,
            &Query::ReplicasOn {
                tier: "local".into(),
                node: None,
                state: None,
                limit: None,
                after: None,
            },
        ) else {
            panic!("not a replicas_on answer")
        };
        assert!(next.is_none());
        replicas
            .into_iter()
            .map(|r| (r.node.unwrap_or_default(), r.state, r.reason))
            .collect()
    }

    /// Guards the index of replicas by place: a node's copies are its own, a tier's are every
    /// node's in node order, page after page from the cursor, and a copy on another tier is in
    /// neither.
    #[test]
    fn the_replicas_on_a_tier_or_a_node_are_read_by_place_page_by_page() {
        let dir = tempfile::tempdir().unwrap();
        let facts = vec![
            validated(1),
            node_replica(1, "gpu-b", false, 0),
            node_replica(1, "gpu-a", false, 0),
            node_replica(1, "gpu-c", false, 0),
        ];
        let store = store_with(dir.path(), "place.redb", &facts);
        let ask = |tier: &str, node: Option<&str>, limit: Option<u32>, after: Option<String>| {
            let query = Query::ReplicasOn {
                tier: tier.into(),
                node: node.map(Into::into),
                state: None,
                limit,
                after,
            };
            let Answer::ReplicasOn { replicas, next } = crate::answer(&store, &query) else {
                panic!("not a replicas_on answer")
            };
            let places = (replicas.into_iter())
                .map(|r| format!("{}:{}", r.tier, r.node.unwrap_or_default()))
                .collect::<Vec<_>>();
            (places, next)
        };
        assert_eq!(
            ask("local", Some("gpu-b"), None, None),
            (vec!["local:gpu-b".to_owned()], None)
        );
        assert_eq!(ask("local", Some("gpu-z"), None, None), (vec![], None));
        let (mut seen, mut after) = (Vec::new(), None);
        loop {
            let (page, next) = ask("local", None, Some(1), after.take());
            assert!(page.len() <= 1, "{page:?}");
            seen.extend(page);
            match next {
                Some(next) => after = Some(next),
                None => break,
            }
        }
        assert_eq!(seen, ["local:gpu-a", "local:gpu-b", "local:gpu-c"]);
        let (source, _) = ask("source", None, None, None);
        assert_eq!(source, ["source:"]);
    }

    /// Guards node failure's cost: a silent node's present copy becomes `unreachable` (not
    /// usable, with since when), the other node's stays present, the copy's re-check on return
    /// (`replica.created`) makes it present again, and a silence decided after a removal does
    /// not bring the copy back — whatever order the facts fold in.
    #[test]
    fn a_silent_nodes_copy_is_unreachable_until_it_is_created_again() {
        let dir = tempfile::tempdir().unwrap();
        let facts = vec![
            validated(1),
            node_replica(1, "gpu-a", false, 0),
            node_replica(1, "gpu-b", false, 0),
            unreachable("gpu-b", 100),
        ];
        let mut reversed = facts.clone();
        reversed.reverse();
        for (name, events) in [("a.redb", facts.clone()), ("b.redb", reversed)] {
            let store = store_with(dir.path(), name, &events);
            let copies = local_copies(&store);
            assert_eq!(copies[0].0, "gpu-a");
            assert_eq!(copies[0].1, ReplicaState::Present, "{name}");
            assert_eq!(copies[1].0, "gpu-b");
            assert_eq!(copies[1].1, ReplicaState::Unreachable, "{name}");
            let reason = copies[1].2.clone().unwrap();
            assert!(reason.contains("node gpu-b silent since"), "{reason}");
        }

        // Back: the agent's re-check states the copy again, newer than the silence.
        let store = store_with(dir.path(), "c.redb", &facts);
        let mut returned = node_replica(1, "gpu-b", false, 200);
        returned.id = stagehand_schemas::EventId::new("returned-gpu-b").unwrap();
        fold_into(&store, &[returned]);
        assert_eq!(local_copies(&store)[1].1, ReplicaState::Present);

        // Removed before the silence was decided: it stays removed, in either order.
        let removed_first = vec![
            validated(1),
            node_replica(1, "gpu-b", false, 0),
            node_replica(1, "gpu-b", true, 50),
            unreachable("gpu-b", 100),
        ];
        let mut reversed = removed_first.clone();
        reversed.reverse();
        for (name, events) in [("d.redb", removed_first), ("e.redb", reversed)] {
            let store = store_with(dir.path(), name, &events);
            assert_eq!(local_copies(&store)[0].1, ReplicaState::Removed, "{name}");
        }
    }

    #[test]
    fn dead_letters_are_counted_once_per_id() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_with(
            dir.path(),
            "a.redb",
            &[dead_letter(1), dead_letter(2), dead_letter(1)],
        );
        let Answer::DeadLetters { services, .. } = crate::answer(
            &store,
            &Query::DeadLetters {
                limit: None,
                after: None,
            },
        ) else {
            panic!()
        };
        assert_eq!(services.len(), 1);
        assert_eq!(services[0].count, 2);
    }

    /// The replicas of step `step`'s version of `ckpt-r1`: (tier, present) in tier order.
    fn checkpoint_replicas(store: &crate::store::Store, step: u64) -> Vec<(String, bool)> {
        let Answer::Checkpoints { checkpoints, .. } = crate::answer(
            store,
            &Query::Checkpoints {
                project: "lab-a".into(),
                run: "r1".into(),
                limit: None,
                after: None,
            },
        ) else {
            panic!("not a checkpoints answer")
        };
        let record = checkpoints.iter().find(|c| c.step == step).unwrap();
        let Answer::Version(detail) = crate::answer(
            store,
            &Query::Version {
                project: Some("lab-a".into()),
                dataset: checkpoint_dataset("r1"),
                version: record.digest.clone().expect("the commit's digest"),
                limit: None,
            },
        ) else {
            panic!("not a version answer")
        };
        assert_eq!(detail.version.file_count, 1);
        let mut replicas: Vec<(String, bool)> = detail
            .replicas
            .iter()
            .map(|r| (r.tier.clone(), r.state == ReplicaState::Present))
            .collect();
        replicas.sort();
        replicas
    }

    /// Guards restore's source: each committed checkpoint is a version of `ckpt-<run>` whose
    /// replicas follow its facts — committed on hot, demoted to capacity (gone from hot),
    /// expired (gone) — in whatever order the facts are folded.
    #[test]
    fn checkpoints_are_versions_with_replicas_where_retention_put_them() {
        let dir = tempfile::tempdir().unwrap();
        // Expired from where it was demoted to, as the demoter does.
        let mut expired_on_capacity = checkpoint_expired(30, 60);
        if let stagehand_schemas::Body::CheckpointExpired(p) = &mut expired_on_capacity.body {
            p.location.tier = "capacity".into();
        }
        let in_order = vec![
            checkpoint_committed(10, &[], 10),
            checkpoint_committed(20, &[], 20),
            checkpoint_demoted(20, Some("keep_last"), 50),
            checkpoint_committed(30, &[], 30),
            checkpoint_demoted(30, Some("keep_last"), 40),
            expired_on_capacity,
        ];
        let mut reversed = in_order.clone();
        reversed.reverse();
        for (name, events) in [("a.redb", in_order), ("b.redb", reversed)] {
            let store = store_with(dir.path(), name, &events);
            let hot_only = vec![("hot".to_owned(), true)];
            assert_eq!(checkpoint_replicas(&store, 10), hot_only, "{name}");
            let demoted = vec![("capacity".to_owned(), true), ("hot".to_owned(), false)];
            assert_eq!(checkpoint_replicas(&store, 20), demoted, "{name}");
            let gone = vec![("capacity".to_owned(), false), ("hot".to_owned(), false)];
            assert_eq!(checkpoint_replicas(&store, 30), gone, "{name}");
        }
    }

    /// A run's checkpoints fold into one record per step whose state, tier and rule follow the
    /// newest fact (whatever order they arrive in), listed in step order a page at a time.
    #[test]
    fn checkpoints_fold_per_step_with_tier_and_rule() {
        let events = vec![
            checkpoint_demoted(20, Some("tagged:best"), 50),
            checkpoint_committed(10, &[], 10),
            checkpoint_committed(20, &["best"], 20),
            checkpoint_committed(30, &[], 30),
            checkpoint_expired(10, 40),
            checkpoint_committed(30, &[], 30),
        ];
        let dir = tempfile::tempdir().unwrap();
        let store = store_with(dir.path(), "c.redb", &events);
        let ask = |limit, after: Option<&str>| match crate::answer(
            &store,
            &Query::Checkpoints {
                project: "lab-a".into(),
                run: "r1".into(),
                limit,
                after: after.map(Into::into),
            },
        ) {
            Answer::Checkpoints { checkpoints, next } => (checkpoints, next),
            other => panic!("{other:?}"),
        };
        let (all, next) = ask(None, None);
        assert_eq!(next, None);
        let summary: Vec<_> = all
            .iter()
            .map(|c| {
                (
                    c.step,
                    c.state,
                    c.tiers(),
                    c.rule.as_deref(),
                    c.tags.clone(),
                )
            })
            .collect();
        assert_eq!(
            summary,
            vec![
                (
                    10,
                    CheckpointState::Expired,
                    vec![],
                    Some("expired"),
                    vec![]
                ),
                (
                    20,
                    CheckpointState::Demoted,
                    vec!["capacity"],
                    Some("tagged:best"),
                    vec!["best".to_owned()]
                ),
                (30, CheckpointState::Committed, vec!["hot"], None, vec![]),
            ]
        );
        let (first, next) = ask(Some(2), None);
        assert_eq!(first.len(), 2);
        assert_eq!(next.as_deref(), Some("20"));
        let (rest, next) = ask(Some(2), Some("20"));
        assert_eq!((rest.len(), rest[0].step, next), (1, 30, None));
        let other_run = crate::answer(
            &store,
            &Query::Checkpoints {
                project: "lab-a".into(),
                run: "r0".into(),
                limit: None,
                after: None,
            },
        );
        assert_eq!(
            other_run,
            Answer::Checkpoints {
                checkpoints: vec![],
                next: None
            }
        );
        assert!(matches!(
            crate::answer(
                &store,
                &Query::Checkpoints {
                    project: "lab-a".into(),
                    run: "r1".into(),
                    limit: None,
                    after: Some("x".into()),
                },
            ),
            Answer::Error {
                code: ErrorCode::BadQuery,
                ..
            }
        ));
    }

    /// Guards the rebuild == live property at its root: any order of the same facts folds to
    /// the same tables, row for row.
    #[test]
    fn order_does_not_matter() {
        let events = vec![
            validated(1),
            replica(1, false),
            replica(1, true),
            rejected(2),
            validated(3),
            stage(1, "job-1", true),
            stage(1, "job-2", false),
            stage(1, "job-1", false),
            dead_letter(4),
            checkpoint_committed(10, &["best"], 10),
            checkpoint_demoted(10, Some("tagged:best"), 20),
            checkpoint_committed(20, &[], 15),
            checkpoint_expired(20, 30),
        ];
        let dir = tempfile::tempdir().unwrap();
        let forward = store_with(dir.path(), "f.redb", &events);
        let mut reversed = events.clone();
        reversed.reverse();
        let backward = store_with(dir.path(), "b.redb", &reversed);
        let one_by_one = crate::store::Store::open(dir.path().join("o.redb")).unwrap();
        for e in events.iter().rev() {
            fold_into(&one_by_one, std::slice::from_ref(e));
        }
        let dump = forward.dump().unwrap();
        assert_eq!(dump, backward.dump().unwrap());
        assert_eq!(dump, one_by_one.dump().unwrap());
        assert_eq!(dump.rows("applied").len(), events.len());
        // The removal is the newest replica fact, whichever came first.
        let Answer::Version(v) = crate::answer(
            &forward,
            &Query::Version {
                project: None,
                dataset: "cats".into(),
                version: version_of(&validated(1)),
                limit: None,
            },
        ) else {
            panic!()
        };
        let hot = v.replicas.iter().find(|r| r.tier == "hot").unwrap();
        assert_eq!(hot.state, ReplicaState::Removed);
    }

    /// Node-local replicas are one per (tier, node): two nodes' copies of a version on `local`
    /// and the shared `hot` one are three replicas, in (tier, node) order, paged with
    /// `<tier>/<node>` cursors; removing one node's leaves the other's, in any fact order; each
    /// node's readiness stands on its own replica.
    #[test]
    fn node_local_replicas_fold_per_tier_and_node() {
        let events = vec![
            validated(1),
            replica(1, false),
            node_replica(1, "gpu-07", false, 10),
            node_replica(1, "gpu-02", false, 11),
            node_replica(1, "gpu-07", true, 20),
        ];
        let dir = tempfile::tempdir().unwrap();
        let store = store_with(dir.path(), "n.redb", &events);
        let mut reversed = events.clone();
        reversed.reverse();
        let backward = store_with(dir.path(), "r.redb", &reversed);
        assert_eq!(store.dump().unwrap(), backward.dump().unwrap());
        let version = version_of(&validated(1));
        let page = |limit, after: Option<String>| match crate::answer(
            &store,
            &Query::Replicas {
                project: Some("lab-a".into()),
                dataset: "cats".into(),
                version: version.clone(),
                limit,
                after,
            },
        ) {
            Answer::Replicas { replicas, next } => (replicas, next),
            other => panic!("{other:?}"),
        };
        let summary = |rs: &[ReplicaRecord]| -> Vec<(String, Option<String>, ReplicaState)> {
            rs.iter()
                .map(|r| (r.tier.clone(), r.node.clone(), r.state))
                .collect()
        };
        let (all, next) = page(None, None);
        assert_eq!(next, None);
        assert_eq!(
            summary(&all),
            vec![
                ("hot".into(), None, ReplicaState::Present),
                ("local".into(), Some("gpu-02".into()), ReplicaState::Present),
                ("local".into(), Some("gpu-07".into()), ReplicaState::Removed),
                ("source".into(), None, ReplicaState::Present),
            ]
        );
        let removed = &all[2];
        assert_eq!(
            (removed.files, removed.reason.as_deref()),
            (2, Some("idle"))
        );
        // Paged one at a time, each cursor is the replica's (tier, node).
        let mut cursors = Vec::new();
        let mut after = None;
        let mut paged = Vec::new();
        loop {
            let (rs, next) = page(Some(1), after.clone());
            paged.extend(rs);
            match next {
                Some(n) => {
                    cursors.push(n.clone());
                    after = Some(n);
                }
                None => break,
            }
        }
        assert_eq!(summary(&paged), summary(&all));
        assert_eq!(cursors, ["hot", "local/gpu-02", "local/gpu-07"]);
        // Each node's readiness follows its own replica.
        let key = |node: &str| ReadinessKey {
            project: "lab-a".into(),
            dataset: "cats".into(),
            version: version.clone(),
            tier: "local".into(),
            node: Some(node.into()),
        };
        let on = |node| {
            crate::readiness::current(&store, &key(node))
                .unwrap()
                .unwrap()
        };
        assert_eq!(
            on("gpu-02").state,
            ReadinessState::Ready {
                path: "lab-a/cats/v".into()
            }
        );
        assert_eq!(on("gpu-02").replica, Some(ReplicaState::Present));
        assert!(!on("gpu-07").ready);
        assert_eq!(on("gpu-07").replica, Some(ReplicaState::Removed));
        // The facts touch the node's readiness key, so the live recorder mirrors it.
        assert_eq!(
            crate::fold::touched(&node_replica(1, "gpu-07", true, 20)),
            Some(key("gpu-07"))
        );
    }

    /// Guards the O(n²) rejection list: each rejected request is one record of its own, and
    /// the dataset only counts them.
    #[test]
    fn rejections_are_one_record_per_request() {
        let dir = tempfile::tempdir().unwrap();
        let events: Vec<_> = (0..50).map(rejected).collect();
        let store = store_with(dir.path(), "a.redb", &events);
        let dump = store.dump().unwrap();
        assert_eq!(dump.rows("rejections").len(), 50);
        assert_eq!(dump.rows("datasets").len(), 1);
        let Answer::Dataset(d) = crate::answer(
            &store,
            &Query::Dataset {
                project: Some("lab-a".into()),
                dataset: "cats".into(),
                limit: None,
            },
        ) else {
            panic!()
        };
        assert_eq!(d.dataset.rejection_count, 50);
        assert_eq!(d.rejections.len(), DEFAULT_DETAIL as usize);
        let r = &d.rejections[0];
        assert_eq!(r.problems.len(), 2, "every reason kept");
        assert_eq!(r.problems_total, 2);
        assert_eq!(
            r.problem_counts,
            vec![("missing".to_owned(), 1), ("path_rule".to_owned(), 1)],
            "schema-1 rejections are counted per code"
        );
    }

    /// The checkpoint `step` of run r1 committed at `prefix`, `second` seconds in.
    fn committed_at(step: u64, prefix: &str, second: i64) -> stagehand_schemas::Event {
        let mut e = checkpoint_committed(step, &[], second);
        if let stagehand_schemas::Body::CheckpointCommitted(c) = &mut e.body {
            c.location.prefix = prefix.into();
        }
        e
    }

    fn run_r1(store: &crate::store::Store) -> Vec<CheckpointRecord> {
        match crate::answer(
            store,
            &Query::Checkpoints {
                project: "lab-a".into(),
                run: "r1".into(),
                limit: None,
                after: None,
            },
        ) {
            Answer::Checkpoints { checkpoints, .. } => checkpoints,
            other => panic!("{other:?}"),
        }
    }

    /// Guards issue 19's nested step: a step committed inside another live step's folder (or
    /// around it) is not folded — a problem naming both steps and folders — and the catalogue
    /// answers which steps a folder overlaps; once the outer step expired, its folder may be
    /// used again.
    #[test]
    fn a_commit_overlapping_a_live_step_is_a_problem_naming_both() {
        let dir = tempfile::tempdir().unwrap();
        let outer = committed_at(10, "lab-a/ckpt/r1/step-10", 10);
        let store = store_with(dir.path(), "o.redb", &[outer]);
        let inner = committed_at(20, "lab-a/ckpt/r1/step-10/step-20", 20);
        let around = committed_at(30, "lab-a/ckpt/r1", 30);
        let beside = committed_at(40, "lab-a/ckpt/r1/step-100", 40);
        let folded = fold_into(&store, &[inner.clone(), around, beside]);
        for (i, (step, prefix)) in [(20, "lab-a/ckpt/r1/step-10/step-20"), (30, "lab-a/ckpt/r1")]
            .into_iter()
            .enumerate()
        {
            let Folded::Skipped { problem, retryable } = &folded[i] else {
                panic!("{folded:?}")
            };
            assert!(!retryable);
            assert_eq!(problem.code, FoldProblemCode::CheckpointOverlap);
            for named in [
                format!("step {step} at hot:{prefix}"),
                "run r1 step 10 at hot:lab-a/ckpt/r1/step-10".to_owned(),
            ] {
                assert!(problem.detail.contains(&named), "{}", problem.detail);
            }
        }
        assert_eq!(
            folded[2],
            Folded::Done,
            "step-100 is beside step-10, not in it"
        );
        let steps: Vec<u64> = run_r1(&store).iter().map(|r| r.step).collect();
        assert_eq!(steps, vec![10, 40]);
        let overlapping = |prefix: &str| match crate::answer(
            &store,
            &Query::CheckpointsOverlapping {
                project: "lab-a".into(),
                prefix: prefix.into(),
            },
        ) {
            Answer::Checkpoints { checkpoints, .. } => {
                checkpoints.iter().map(|r| r.step).collect::<Vec<_>>()
            }
            other => panic!("{other:?}"),
        };
        assert_eq!(overlapping("lab-a/ckpt/r1"), vec![10, 40]);
        assert_eq!(overlapping("lab-a/ckpt/r1/step-10/x"), vec![10]);
        assert_eq!(overlapping("lab-a/ckpt/r1/step-1"), Vec::<u64>::new());

        // The outer step expired: its folder is gone, and the inner one folds.
        let mut expired = checkpoint_expired(10, 50);
        if let stagehand_schemas::Body::CheckpointExpired(x) = &mut expired.body {
            x.location.prefix = "lab-a/ckpt/r1/step-10".into();
        }
        assert_eq!(
            fold_into(&store, &[expired, inner]),
            vec![Folded::Done, Folded::Done]
        );
        assert_eq!(overlapping("lab-a/ckpt/r1/step-10"), vec![20]);
    }

    /// Guards the report of a demotion the demoter left undone: `checkpoint.held` stands on
    /// the step's record until a later demotion folds, in either order of the two.
    #[test]
    fn a_hold_stands_on_the_step_until_a_later_demotion() {
        let commit = checkpoint_committed(10, &[], 10);
        let stagehand_schemas::Body::CheckpointCommitted(c) = &commit.body else {
            unreachable!()
        };
        let mut held = commit.caused(
            "held",
            stagehand_schemas::Body::CheckpointHeld(stagehand_schemas::CheckpointHeld {
                run: "r1".into(),
                step: 10,
                location: c.location.clone(),
                decision: "demote to capacity (keep_last)".into(),
                reason: "the folder holds 1 file its commit does not list".into(),
                unlisted: vec!["late.bin".into()],
                unlisted_total: 1,
            }),
        );
        held.occurred_at = commit.occurred_at + std::time::Duration::from_secs(10);
        let dir = tempfile::tempdir().unwrap();
        let store = store_with(dir.path(), "h.redb", &[commit.clone(), held.clone()]);
        let record = run_r1(&store).remove(0);
        let hold = record.held_now().expect("held");
        assert_eq!(hold.unlisted, vec!["late.bin".to_owned()]);
        assert!(hold.reason.contains("does not list"));
        let demoted = checkpoint_demoted(10, Some("keep_last"), 30);
        fold_into(&store, std::slice::from_ref(&demoted));
        let record = run_r1(&store).remove(0);
        assert_eq!(record.state, CheckpointState::Demoted);
        assert!(record.held_now().is_none(), "{record:?}");
        let reversed = store_with(dir.path(), "r.redb", &[commit, demoted, held]);
        assert_eq!(reversed.dump().unwrap(), store.dump().unwrap());
    }

    #[test]
    fn a_corrupt_record_is_listed_as_a_problem_not_a_panic() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_with(dir.path(), "a.redb", &[validated(1)]);
        store
            .damage_dataset_record("lab-a", "cats", b"\xff not json")
            .unwrap();
        let folded = fold_into(&store, &[validated(3), dead_letter(9)]);
        let Folded::Skipped { problem, retryable } = &folded[0] else {
            panic!("{folded:?}")
        };
        assert_eq!(problem.code, FoldProblemCode::CorruptRecord);
        assert!(
            problem.detail.contains("dataset lab-a/cats"),
            "{}",
            problem.detail
        );
        assert!(!retryable);
        assert_eq!(
            folded[1],
            Folded::Done,
            "its neighbour in the batch still folds"
        );
        assert_eq!(store.problem_count().unwrap(), 1);
    }

    #[test]
    fn readiness_follows_the_stages() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_with(
            dir.path(),
            "a.redb",
            &[validated(1), stage(1, "job-2", false)],
        );
        let key = ReadinessKey {
            project: "lab-a".into(),
            dataset: "cats".into(),
            version: version_of(&validated(1)),
            tier: "local".into(),
            node: None,
        };
        let r = crate::readiness::current(&store, &key).unwrap().unwrap();
        assert!(
            matches!(&r.state, ReadinessState::Failed { reason, .. } if reason == "quota exceeded")
        );
        fold_into(&store, &[stage(1, "job-1", true)]);
        let r = crate::readiness::current(&store, &key).unwrap().unwrap();
        assert_eq!(
            r.state,
            ReadinessState::Ready {
                path: "lab-a/cats/v".into()
            }
        );
        assert_eq!(r.jobs.ready, 1);
        assert_eq!(r.jobs.failed, 1);
    }
}
