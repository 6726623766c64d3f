//! The fold: facts in, catalogue state out.
//!
//! [`apply`] takes one event and a [`View`] of the catalogue (a key → bytes map plus the set of
//! event ids already applied) and changes the records the event concerns. It is pure over the
//! view, so it runs the same against the redb transaction and against the in-memory map the
//! unit tests use. Applying an event whose id was applied before changes nothing, and records
//! keep the newest [`Stamp`], so any order and any number of copies of the same facts fold to
//! the same catalogue.
//!
//! Keys are the record type's letter and the record's identity, joined by NUL:
//! `D project dataset`, `V project dataset version`, `F project dataset version` (files),
//! `R project dataset version tier`, `S project dataset version tier job`,
//! `X project dataset request`, `L service`, `C project run step`. A part that itself holds
//! `%` or NUL has them escaped (`%25`, `%00`), so a prefix scan never crosses records.

use serde::Serialize;
use serde::de::DeserializeOwned;
use stagehand_schemas::{Body, Event, FileRef, Location};

use crate::error::StoreError;
use crate::model::*;

/// A key → bytes map the fold reads and writes, and the set of applied event ids.
pub trait View {
    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError>;
    fn put(&mut self, key: &str, value: Vec<u8>) -> Result<(), StoreError>;
    fn applied(&self, event_id: &str) -> Result<bool, StoreError>;
    fn mark_applied(&mut self, event_id: &str) -> Result<(), StoreError>;
}

/// Key separator: cannot occur inside an escaped part.
pub const SEP: char = '\0';

fn escape(part: &str) -> std::borrow::Cow<'_, str> {
    if part.contains(['%', '\0']) {
        part.replace('%', "%25").replace('\0', "%00").into()
    } else {
        part.into()
    }
}

/// Builds a key from its record letter and identity parts.
pub fn key(kind: char, parts: &[&str]) -> String {
    let mut key = String::from(kind);
    for part in parts {
        key.push(SEP);
        key.push_str(&escape(part));
    }
    key
}

/// The prefix of every key of `kind` whose identity starts with `parts` (ends with a separator).
pub fn prefix(kind: char, parts: &[&str]) -> String {
    let mut p = key(kind, parts);
    p.push(SEP);
    p
}

/// A (project, dataset, version, tier) whose readiness may have changed; the recorder mirrors
/// it into the KV bucket after the commit.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TierKey {
    pub project: String,
    pub dataset: String,
    pub version: String,
    pub tier: String,
}

/// What one event touches: the tiers whose readiness to mirror. Computed from the event alone,
/// so a redelivered (already applied) event still re-mirrors — the mirror may be what failed.
pub fn touched(event: &Event) -> Option<TierKey> {
    let (dataset, version, tier) = match &event.body {
        Body::DatasetValidated(p) => (&p.dataset, &p.version, &p.source.tier),
        Body::DatasetPrepared(p) => (&p.dataset, &p.version, &p.location.tier),
        Body::StageRequested(p) => (&p.dataset, &p.version, &p.tier),
        Body::StageReleased(p) => (&p.dataset, &p.version, &p.tier),
        Body::StageReady(p) => (&p.dataset, &p.version, &p.location.tier),
        Body::StageFailed(p) => (&p.dataset, &p.version, &p.tier),
        Body::ReplicaCreated(p) => (&p.dataset, &p.version, &p.location.tier),
        Body::ReplicaRemoved(p) => (&p.dataset, &p.version, &p.location.tier),
        Body::BackupCompleted(p) => (&p.dataset, &p.version, &p.location.tier),
        _ => return None,
    };
    Some(TierKey {
        project: event.project.clone(),
        dataset: dataset.clone(),
        version: version.clone(),
        tier: tier.clone(),
    })
}

/// Reads and decodes a record; a value that does not decode is an error naming its key, never a
/// panic.
pub fn read<T: DeserializeOwned>(view: &impl View, key: &str) -> Result<Option<T>, StoreError> {
    match view.get(key)? {
        None => Ok(None),
        Some(bytes) => decode(key, &bytes).map(Some),
    }
}

/// Decodes a stored value.
pub fn decode<T: DeserializeOwned>(key: &str, bytes: &[u8]) -> Result<T, StoreError> {
    serde_json::from_slice(bytes).map_err(|e| StoreError::Corrupt {
        key: key.replace(SEP, "/"),
        detail: e.to_string(),
    })
}

fn write<T: Serialize>(view: &mut impl View, key: &str, value: &T) -> Result<(), StoreError> {
    let bytes = serde_json::to_vec(value).map_err(|e| StoreError::Corrupt {
        key: key.replace(SEP, "/"),
        detail: format!("cannot encode: {e}"),
    })?;
    view.put(key, bytes)
}

/// Applies one event. Returns whether it changed anything (false for an event applied before).
pub fn apply(view: &mut impl View, event: &Event) -> Result<bool, StoreError> {
    if view.applied(event.id.as_str())? {
        return Ok(false);
    }
    let stamp = Stamp {
        at: event.occurred_at,
        event_id: event.id.clone(),
    };
    let project = event.project.as_str();
    match &event.body {
        Body::DatasetValidated(p) => {
            dataset_seen(view, project, &p.dataset, &stamp, |d| {
                d.versions.insert(p.version.clone());
            })?;
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
            record_version(view, project, &p.dataset, &p.version, &p.files, provenance)?;
            set_replica(
                view,
                project,
                &p.dataset,
                &p.version,
                &p.source,
                &stamp,
                ReplicaState::Present,
                None,
                Some(Copy {
                    files: p.files.len() as u64,
                    total_bytes: p.total_bytes,
                    verified_by: "ingest-validation".into(),
                    backup: false,
                }),
            )?;
        }
        Body::DatasetPrepared(p) => {
            dataset_seen(view, project, &p.dataset, &stamp, |d| {
                d.versions.insert(p.version.clone());
            })?;
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
            record_version(view, project, &p.dataset, &p.version, &p.files, provenance)?;
            set_replica(
                view,
                project,
                &p.dataset,
                &p.version,
                &p.location,
                &stamp,
                ReplicaState::Present,
                None,
                Some(Copy {
                    files: p.files.len() as u64,
                    total_bytes: p.total_bytes,
                    verified_by: "prepared".into(),
                    backup: false,
                }),
            )?;
        }
        Body::DatasetRejected(p) => {
            dataset_seen(view, project, &p.dataset, &stamp, |d| {
                d.rejected_requests.insert(p.request_id.to_string());
            })?;
            let key = key('X', &[project, &p.dataset, p.request_id.as_str()]);
            let record = RejectionRecord {
                project: project.into(),
                dataset: p.dataset.clone(),
                request_id: p.request_id.clone(),
                declared_version: p.declared_version.clone(),
                requested_by: p.requested_by.clone(),
                source: p.source.clone(),
                problems: p.problems.clone(),
                quarantine: p.quarantine.clone(),
                stamp: stamp.clone(),
            };
            let newer = match read::<RejectionRecord>(view, &key)? {
                Some(old) => stamp > old.stamp,
                None => true,
            };
            if newer {
                write(view, &key, &record)?;
            }
        }
        Body::ReplicaCreated(p) => {
            dataset_seen(view, project, &p.dataset, &stamp, |_| {})?;
            set_replica(
                view,
                project,
                &p.dataset,
                &p.version,
                &p.location,
                &stamp,
                ReplicaState::Present,
                None,
                Some(Copy {
                    files: p.files,
                    total_bytes: p.total_bytes,
                    verified_by: p.verified_by.clone(),
                    backup: false,
                }),
            )?;
        }
        Body::ReplicaRemoved(p) => {
            dataset_seen(view, project, &p.dataset, &stamp, |_| {})?;
            set_replica(
                view,
                project,
                &p.dataset,
                &p.version,
                &p.location,
                &stamp,
                ReplicaState::Removed,
                Some(p.reason.clone()),
                None,
            )?;
        }
        Body::BackupCompleted(p) => {
            dataset_seen(view, project, &p.dataset, &stamp, |_| {})?;
            set_replica(
                view,
                project,
                &p.dataset,
                &p.version,
                &p.location,
                &stamp,
                ReplicaState::Present,
                None,
                Some(Copy {
                    files: p.files,
                    total_bytes: p.total_bytes,
                    verified_by: "backup".into(),
                    backup: true,
                }),
            )?;
        }
        Body::RestoreVerified(p) => {
            let drill = Drill {
                ok: true,
                sampled_files: p.sampled_files,
                problems: vec![],
                stamp: stamp.clone(),
            };
            set_drill(view, project, &p.dataset, &p.version, &p.location, drill)?;
        }
        Body::RestoreFailed(p) => {
            let drill = Drill {
                ok: false,
                sampled_files: 0,
                problems: p.problems.clone(),
                stamp: stamp.clone(),
            };
            set_drill(view, project, &p.dataset, &p.version, &p.location, drill)?;
        }
        Body::StageRequested(p) => {
            let stage = Stage {
                state: StageState::Pending,
                reason: None,
                retryable: None,
                request_id: Some(event.id.clone()),
            };
            let id = [project, &p.dataset, &p.version, &p.tier, &p.job_id];
            set_stage(view, id, &stamp, stage)?;
        }
        Body::StageReleased(p) => {
            let stage = Stage {
                state: StageState::Released,
                reason: None,
                retryable: None,
                request_id: None,
            };
            let id = [project, &p.dataset, &p.version, &p.tier, &p.job_id];
            set_stage(view, id, &stamp, stage)?;
        }
        Body::StageReady(p) => {
            let stage = Stage {
                state: StageState::Ready,
                reason: None,
                retryable: None,
                request_id: Some(p.request_id.clone()),
            };
            let id = [project, &p.dataset, &p.version, &p.location.tier, &p.job_id];
            set_stage(view, id, &stamp, stage)?;
        }
        Body::StageFailed(p) => {
            let stage = Stage {
                state: StageState::Failed,
                reason: Some(p.reason.clone()),
                retryable: Some(p.retryable),
                request_id: Some(p.request_id.clone()),
            };
            let id = [project, &p.dataset, &p.version, &p.tier, &p.job_id];
            set_stage(view, id, &stamp, stage)?;
        }
        Body::CheckpointCommitted(p) => {
            let commit = (p.total_bytes, p.tags.clone());
            let state = (CheckpointState::Committed, &p.location);
            set_checkpoint(view, project, &p.run, p.step, &stamp, state, Some(commit))?;
        }
        Body::CheckpointDemoted(p) => {
            let state = (CheckpointState::Demoted, &p.to);
            set_checkpoint(view, project, &p.run, p.step, &stamp, state, None)?;
        }
        Body::CheckpointExpired(p) => {
            let state = (CheckpointState::Expired, &p.location);
            set_checkpoint(view, project, &p.run, p.step, &stamp, state, None)?;
        }
        Body::DeadLetter(p) => {
            let key = key('L', &[&p.service]);
            let mut record = read::<DeadLetterRecord>(view, &key)?.unwrap_or(DeadLetterRecord {
                service: p.service.clone(),
                count: 0,
                last_subject: String::new(),
                last_stream_sequence: 0,
                last_error: None,
                stamp: stamp.clone(),
            });
            // The count is a sum, so it is order-free; "last" follows the stamp.
            record.count += 1;
            if record.count == 1 || stamp >= record.stamp {
                record.last_subject = p.subject.clone();
                record.last_stream_sequence = p.stream_sequence;
                record.last_error = p.errors.last().map(|a| a.error.clone());
                record.stamp = stamp.clone();
            }
            write(view, &key, &record)?;
        }
        // Ingest requests are not facts: the validator answers them with one.
        Body::IngestRequested(_) => {}
        // The contract may grow kinds this recorder does not know yet; they are marked applied
        // so a replay skips them the same way.
        _ => {}
    }
    view.mark_applied(event.id.as_str())?;
    Ok(true)
}

fn dataset_seen(
    view: &mut impl View,
    project: &str,
    dataset: &str,
    stamp: &Stamp,
    change: impl FnOnce(&mut DatasetRecord),
) -> Result<(), StoreError> {
    let key = key('D', &[project, dataset]);
    let mut record = read::<DatasetRecord>(view, &key)?.unwrap_or(DatasetRecord {
        project: project.into(),
        dataset: dataset.into(),
        first_seen: stamp.at,
        versions: Default::default(),
        rejected_requests: Default::default(),
    });
    record.first_seen = record.first_seen.min(stamp.at);
    change(&mut record);
    write(view, &key, &record)
}

fn record_version(
    view: &mut impl View,
    project: &str,
    dataset: &str,
    version: &str,
    files: &[FileRef],
    provenance: Provenance,
) -> Result<(), StoreError> {
    let version_key = key('V', &[project, dataset, version]);
    let request_id = provenance.request_id.to_string();
    let record = match read::<VersionRecord>(view, &version_key)? {
        Some(mut old) => {
            old.request_ids.insert(request_id);
            // The earliest recording is the version's provenance.
            if (provenance.at, &provenance.event_id) < (old.provenance.at, &old.provenance.event_id)
            {
                old.provenance = provenance;
            }
            old
        }
        None => {
            let files_key = key('F', &[project, dataset, version]);
            let mut sorted = files.to_vec();
            sorted.sort_by(|a, b| a.path.as_bytes().cmp(b.path.as_bytes()));
            write(view, &files_key, &sorted)?;
            VersionRecord {
                project: project.into(),
                dataset: dataset.into(),
                version: version.into(),
                file_count: files.len() as u64,
                total_bytes: stagehand_schemas::total_bytes(files),
                provenance,
                request_ids: [request_id].into(),
            }
        }
    };
    write(view, &version_key, &record)
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
    dataset: &str,
    version: &str,
    location: &Location,
) -> ReplicaRecord {
    ReplicaRecord {
        project: project.into(),
        dataset: dataset.into(),
        version: version.into(),
        tier: location.tier.clone(),
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
    }
}

#[allow(clippy::too_many_arguments)]
fn set_replica(
    view: &mut impl View,
    project: &str,
    dataset: &str,
    version: &str,
    location: &Location,
    stamp: &Stamp,
    state: ReplicaState,
    reason: Option<String>,
    copy: Option<Copy>,
) -> Result<(), StoreError> {
    let key = key('R', &[project, dataset, version, &location.tier]);
    let mut record = read::<ReplicaRecord>(view, &key)?
        .unwrap_or_else(|| empty_replica(project, dataset, version, location));
    let mut changed = false;
    if record.stamp.as_ref().is_none_or(|old| stamp > old) {
        record.state = state;
        record.reason = reason;
        record.prefix = location.prefix.clone();
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
        write(view, &key, &record)?;
    }
    Ok(())
}

fn set_drill(
    view: &mut impl View,
    project: &str,
    dataset: &str,
    version: &str,
    location: &Location,
    drill: Drill,
) -> Result<(), StoreError> {
    let key = key('R', &[project, dataset, version, &location.tier]);
    // A drill only annotates a replica the catalogue knows; the drill of an unknown replica is
    // still recorded so that a later `backup.completed` finds it.
    let mut record = read::<ReplicaRecord>(view, &key)?
        .unwrap_or_else(|| empty_replica(project, dataset, version, location));
    let newer = record
        .last_drill
        .as_ref()
        .is_none_or(|old| drill.stamp > old.stamp);
    if newer {
        record.last_drill = Some(drill);
        write(view, &key, &record)?;
    }
    Ok(())
}

/// A stage record's fields as one fact sets them (all of them, so the newest fact alone
/// decides the record).
struct Stage {
    state: StageState,
    reason: Option<String>,
    retryable: Option<bool>,
    request_id: Option<stagehand_schemas::EventId>,
}

fn set_stage(
    view: &mut impl View,
    [project, dataset, version, tier, job_id]: [&str; 5],
    stamp: &Stamp,
    stage: Stage,
) -> Result<(), StoreError> {
    let key = key('S', &[project, dataset, version, tier, job_id]);
    if let Some(old) = read::<StageRecord>(view, &key)?
        && old.stamp >= *stamp
    {
        return Ok(());
    }
    let record = StageRecord {
        project: project.into(),
        dataset: dataset.into(),
        version: version.into(),
        tier: tier.into(),
        job_id: job_id.into(),
        state: stage.state,
        reason: stage.reason,
        retryable: stage.retryable,
        request_id: stage.request_id,
        stamp: stamp.clone(),
    };
    write(view, &key, &record)
}

fn set_checkpoint(
    view: &mut impl View,
    project: &str,
    run: &str,
    step: u64,
    stamp: &Stamp,
    (state, location): (CheckpointState, &Location),
    commit: Option<(u64, Vec<String>)>,
) -> Result<(), StoreError> {
    // Zero-padded so checkpoints of a run list in step order.
    let step_key = format!("{step:020}");
    let key = key('C', &[project, run, &step_key]);
    let existing = read::<CheckpointRecord>(view, &key)?;
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
    });
    if *stamp > record.stamp {
        record.state = state;
        record.location = location.clone();
        record.stamp = stamp.clone();
        changed = true;
    }
    if let Some((total_bytes, tags)) = commit
        && record.committed.as_ref().is_none_or(|old| stamp > old)
    {
        record.total_bytes = total_bytes;
        record.tags = tags;
        record.committed = Some(stamp.clone());
        changed = true;
    }
    if changed {
        write(view, &key, &record)?;
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use stagehand_schemas::*;

    use super::*;

    /// An in-memory view: the fold's unit tests need no redb.
    #[derive(Default, Debug, PartialEq)]
    pub struct MemView {
        pub records: BTreeMap<String, Vec<u8>>,
        pub applied: BTreeSet<String>,
    }

    impl View for MemView {
        fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
            Ok(self.records.get(key).cloned())
        }
        fn put(&mut self, key: &str, value: Vec<u8>) -> Result<(), StoreError> {
            self.records.insert(key.into(), value);
            Ok(())
        }
        fn applied(&self, event_id: &str) -> Result<bool, StoreError> {
            Ok(self.applied.contains(event_id))
        }
        fn mark_applied(&mut self, event_id: &str) -> Result<(), StoreError> {
            self.applied.insert(event_id.into());
            Ok(())
        }
    }

    pub fn request(n: u32) -> Event {
        let files = vec![
            FileRef::new(format!("f{n}.bin"), 3, sha256_hex(b"abc")),
            FileRef::new("labels.csv", 0, sha256_hex(b"")),
        ];
        Event::request(
            EventId::new(format!("req-{n}")).unwrap(),
            "lab-a",
            Body::IngestRequested(IngestRequested {
                dataset: "cats".into(),
                source: Location {
                    tier: "source".into(),
                    prefix: "lab-a/cats/x".into(),
                },
                files,
                manifest: None,
                requested_by: "alice".into(),
                labels: vec![],
            }),
        )
    }

    pub fn validated(n: u32) -> Event {
        let req = request(n);
        let Body::IngestRequested(p) = &req.body else {
            unreachable!()
        };
        req.caused(
            "validated",
            Body::DatasetValidated(DatasetValidated {
                dataset: p.dataset.clone(),
                version: version_digest(&p.files),
                source: p.source.clone(),
                files: p.files.clone(),
                manifest: None,
                total_bytes: total_bytes(&p.files),
                requested_by: p.requested_by.clone(),
                request_id: req.id.clone(),
                labels: vec![("modality".into(), "image".into())],
            }),
        )
    }

    pub fn rejected(n: u32) -> Event {
        let req = request(n);
        req.caused(
            "rejected",
            Body::DatasetRejected(DatasetRejected {
                dataset: "cats".into(),
                source: Location {
                    tier: "source".into(),
                    prefix: "p".into(),
                },
                declared_version: "0".repeat(64),
                requested_by: "mallory".into(),
                request_id: req.id.clone(),
                problems: vec![
                    Problem {
                        code: "path_rule".into(),
                        path: Some("../x".into()),
                        detail: "parent component".into(),
                    },
                    Problem {
                        code: "missing".into(),
                        path: Some("gone.bin".into()),
                        detail: "not on the tier".into(),
                    },
                ],
                quarantine: None,
                problem_counts: vec![],
                problems_total: None,
            }),
        )
    }

    pub fn replica(n: u32, removed: bool) -> Event {
        let v = validated(n);
        let Body::DatasetValidated(p) = &v.body else {
            unreachable!()
        };
        let location = Location {
            tier: "hot".into(),
            prefix: "cats".into(),
        };
        let body = if removed {
            Body::ReplicaRemoved(ReplicaRemoved {
                dataset: p.dataset.clone(),
                version: p.version.clone(),
                location,
                reason: "idle".into(),
            })
        } else {
            Body::ReplicaCreated(ReplicaCreated {
                dataset: p.dataset.clone(),
                version: p.version.clone(),
                location,
                files: 2,
                total_bytes: 3,
                verified_by: "read-back".into(),
            })
        };
        v.caused(if removed { "removed" } else { "created" }, body)
    }

    fn fold(events: &[Event]) -> MemView {
        let mut view = MemView::default();
        for e in events {
            apply(&mut view, e).unwrap();
        }
        view
    }

    #[test]
    fn same_fact_twice_is_once() {
        let v = validated(1);
        let mut view = MemView::default();
        assert!(apply(&mut view, &v).unwrap());
        let once = view.records.clone();
        assert!(
            !apply(&mut view, &v).unwrap(),
            "second copy must change nothing"
        );
        assert_eq!(view.records, once);
    }

    #[test]
    fn dead_letters_are_counted_once_per_id() {
        let dl = |n: u64| {
            request(1).caused(
                &format!("dl{n}"),
                Body::DeadLetter(DeadLetter {
                    service: "ingest-validator".into(),
                    stream: "S".into(),
                    consumer: "c".into(),
                    stream_sequence: n,
                    subject: "stagehand.req.ingest.requested.lab-a".into(),
                    delivered: 5,
                    original: vec![1, 2],
                    headers: vec![],
                    errors: vec![],
                    original_id: None,
                }),
            )
        };
        let view = fold(&[dl(1), dl(2), dl(1)]);
        let rec: DeadLetterRecord = read(&view, &key('L', &["ingest-validator"]))
            .unwrap()
            .unwrap();
        assert_eq!(rec.count, 2);
    }

    #[test]
    fn order_does_not_matter() {
        let events = vec![
            validated(1),
            replica(1, false),
            replica(1, true),
            rejected(2),
            validated(3),
        ];
        let forward = fold(&events);
        let mut reversed = events.clone();
        reversed.reverse();
        let backward = fold(&reversed);
        assert_eq!(forward, backward);
        // The removal is the newest fact, whichever came first.
        let r: ReplicaRecord = read(
            &forward,
            &key('R', &["lab-a", "cats", &version_of(&validated(1)), "hot"]),
        )
        .unwrap()
        .unwrap();
        assert_eq!(r.state, ReplicaState::Removed);
    }

    fn version_of(e: &Event) -> String {
        match &e.body {
            Body::DatasetValidated(p) => p.version.clone(),
            _ => unreachable!(),
        }
    }

    #[test]
    fn a_rejection_keeps_every_reason() {
        let view = fold(&[rejected(2)]);
        let key = key('X', &["lab-a", "cats", "req-2"]);
        let r: RejectionRecord = read(&view, &key).unwrap().unwrap();
        assert_eq!(r.problems.len(), 2);
        let d: DatasetRecord = read(&view, &super::key('D', &["lab-a", "cats"]))
            .unwrap()
            .unwrap();
        assert!(d.rejected_requests.contains("req-2"));
    }

    #[test]
    fn a_corrupt_value_is_an_error_not_a_panic() {
        let mut view = fold(&[validated(1)]);
        let k = key('D', &["lab-a", "cats"]);
        view.records.insert(k, b"\xff not json".to_vec());
        let err = apply(&mut view, &validated(3)).unwrap_err();
        assert!(matches!(err, StoreError::Corrupt { .. }), "{err}");
    }

    #[test]
    fn keys_escape_separators() {
        assert_ne!(key('D', &["a\0b", "c"]), key('D', &["a", "b\0c"]));
        assert!(!key('D', &["a%00", "b"]).contains("a%00\0"));
        assert!(key('V', &["p", "d", "v"]).starts_with(&prefix('V', &["p", "d"])));
        assert!(!key('V', &["p", "dd", "v"]).starts_with(&prefix('V', &["p", "d"])));
    }
}
