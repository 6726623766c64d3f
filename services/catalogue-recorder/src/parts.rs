//! Checkpoint steps committed in parts on node-local tiers: one record per (project, run,
//! step, part), filled by the part's `checkpoint.part.committed` and its
//! `checkpoint.part.offloaded` in whichever order they fold. A step is the run's latest only
//! once its whole `checkpoint.committed` folds (a node's agent publishes it when every part is
//! offloaded), so nothing here touches the `checkpoints` table: until then the previous step
//! stays latest and `stagehand checkpoint list` shows this one at risk from these records.

use redb::{ReadTransaction, ReadableTable, WriteTransaction};
use stagehand_catalogue::{CheckpointPartRecord, MAX_CHECKPOINT_PARTS, Stamp};
use stagehand_schemas::{
    CheckpointPartCommitted, CheckpointPartOffloaded, CheckpointPartRemoved, Event,
};

use crate::error::StoreError;
use crate::fold::FoldError;
use crate::store::{CHECKPOINT_PARTS, CHECKPOINTS, decode, encode};

/// A part's commit: its node, folder, files and bytes. A later commit of the same part (the
/// same step saved again) replaces them; an older one changes nothing. Its files are the ones
/// its commit lists with their SHA-256; a part committed by stamps lists none until its
/// offload states them, and once offloaded a part keeps the files its offload copied.
pub(crate) fn part_committed(
    txn: &WriteTransaction,
    event: &Event,
    p: &CheckpointPartCommitted,
    stamp: &Stamp,
) -> Result<(), FoldError> {
    update(txn, event, (&p.run, p.step, p.part), |record| {
        let record = record.get_or_insert_with(|| CheckpointPartRecord {
            project: event.project.clone(),
            run: p.run.clone(),
            step: p.step,
            part: p.part,
            parts: p.parts,
            node: p.node.clone(),
            location: p.location.clone(),
            files: Vec::new(),
            total_bytes: 0,
            tags: Vec::new(),
            committed: None,
            offloaded_to: None,
            offloaded: None,
            removed: None,
        });
        if record.committed.as_ref().is_some_and(|old| stamp <= old) {
            return false;
        }
        record.parts = p.parts;
        record.node = p.node.clone();
        record.location = p.location.clone();
        if record.offloaded.is_none() || record.files.is_empty() {
            record.files = p.files.clone();
        }
        record.total_bytes = p.total_bytes;
        record.tags = p.tags.clone();
        record.committed = Some(stamp.clone());
        // A commit newer than the removal wrote the part to the node again.
        if record
            .removed
            .as_ref()
            .is_some_and(|removed| stamp > removed)
        {
            record.removed = None;
        }
        true
    })
}

/// A part's offload: where it is off the node, and the files it copied with the SHA-256 the
/// node's agent computed from their bytes (when it states them: an agent's word, which the
/// step's commit and a restore then verify against, in place of anything the part's commit
/// said). The first offload stands (a redelivered or repeated one names the same folder).
pub(crate) fn part_offloaded(
    txn: &WriteTransaction,
    event: &Event,
    p: &CheckpointPartOffloaded,
    stamp: &Stamp,
) -> Result<(), FoldError> {
    update(txn, event, (&p.run, p.step, p.part), |record| {
        let record = record.get_or_insert_with(|| CheckpointPartRecord {
            project: event.project.clone(),
            run: p.run.clone(),
            step: p.step,
            part: p.part,
            parts: p.parts,
            node: p.node.clone(),
            location: p.from.clone(),
            files: Vec::new(),
            total_bytes: p.total_bytes,
            tags: Vec::new(),
            committed: None,
            offloaded_to: None,
            offloaded: None,
            removed: None,
        });
        if record.offloaded.is_some() {
            return false;
        }
        record.offloaded_to = Some(p.location.clone());
        record.offloaded = Some(stamp.clone());
        if !p.hashed.is_empty() {
            record.files = p.hashed.clone();
        }
        true
    })
}

/// A part's removal from its node: noted on a record the catalogue holds (a removal is stated
/// only of a part its commit and offload made known), unless a newer commit put it back.
pub(crate) fn part_removed(
    txn: &WriteTransaction,
    event: &Event,
    p: &CheckpointPartRemoved,
    stamp: &Stamp,
) -> Result<(), FoldError> {
    update(txn, event, (&p.run, p.step, p.part), |record| {
        let Some(record) = record else {
            return false;
        };
        let put_back = record.committed.as_ref().is_some_and(|c| c > stamp);
        if put_back || record.removed.is_some() || record.node != p.node {
            return false;
        }
        record.removed = Some(stamp.clone());
        true
    })
}

/// Reads the part's record, lets `change` edit it (`None`: there is none yet), and writes it
/// back when `change` says it changed.
fn update(
    txn: &WriteTransaction,
    event: &Event,
    (run, step, part): (&str, u64, u32),
    change: impl FnOnce(&mut Option<CheckpointPartRecord>) -> bool,
) -> Result<(), FoldError> {
    let project = event.project.as_str();
    let what = || format!("checkpoint part {project}/{run}/{step}/{part}");
    let mut table = txn.open_table(CHECKPOINT_PARTS)?;
    let mut record: Option<CheckpointPartRecord> = table
        .get((project, run, step, part))?
        .map(|v| decode(v.value(), what))
        .transpose()?;
    if change(&mut record)
        && let Some(record) = record
    {
        table.insert(
            (project, run, step, part),
            encode(&record, what)?.as_slice(),
        )?;
    }
    Ok(())
}

/// The parts of `step` with their files, or of every step of the run that has no
/// `checkpoint.committed` folded yet, without them ([`stagehand_catalogue::Query::CheckpointParts`]).
pub(crate) fn parts(
    txn: &ReadTransaction,
    project: &str,
    run: &str,
    step: Option<u64>,
) -> Result<Vec<CheckpointPartRecord>, StoreError> {
    let table = txn.open_table(CHECKPOINT_PARTS)?;
    let committed = txn.open_table(CHECKPOINTS)?;
    let (first, last) = match step {
        Some(step) => (step, step),
        None => (0, u64::MAX),
    };
    let mut out = Vec::new();
    for row in table.range((project, run, first, 0)..=(project, run, last, u32::MAX))? {
        let (k, v) = row?;
        let (_, _, s, part) = k.value();
        if step.is_none() && committed.get((project, run, s))?.is_some() {
            continue;
        }
        let mut record: CheckpointPartRecord = decode(v.value(), || {
            format!("checkpoint part {project}/{run}/{s}/{part}")
        })?;
        if step.is_none() {
            record.files = Vec::new();
        }
        out.push(record);
        if out.len() >= MAX_CHECKPOINT_PARTS {
            break;
        }
    }
    Ok(out)
}

/// The parts committed on node-local tier `tier` of `node` (of every node: `None`), of every
/// project, without their
/// files ([`stagehand_catalogue::Query::CheckpointPartsOn`]).
pub(crate) fn parts_on(
    txn: &ReadTransaction,
    tier: &str,
    node: Option<&str>,
) -> Result<Vec<CheckpointPartRecord>, StoreError> {
    let table = txn.open_table(CHECKPOINT_PARTS)?;
    let mut out = Vec::new();
    for row in table.iter()? {
        let (k, v) = row?;
        let (project, run, step, part) = k.value();
        let mut record: CheckpointPartRecord = decode(v.value(), || {
            format!("checkpoint part {project}/{run}/{step}/{part}")
        })?;
        if record.location.tier != tier || node.is_some_and(|n| record.node != n) {
            continue;
        }
        record.files = Vec::new();
        out.push(record);
        if out.len() >= MAX_CHECKPOINT_PARTS {
            break;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use stagehand_catalogue::{Answer, CheckpointPartRecord, Query, StepParts};
    use stagehand_schemas::*;

    use crate::testing::*;

    const RUN: &str = "r1";

    fn committed(step: u64, part: u32, parts: u32, node: &str) -> Event {
        let dataset = stagehand_catalogue::checkpoint_dataset(RUN);
        let files = vec![FileRef::new(
            format!("shard-{part}.bin"),
            10 + u64::from(part),
            sha256_hex(&[part as u8]),
        )];
        Event::request(
            EventId::for_checkpoint_part("lab-a", RUN, step, part),
            "lab-a",
            Body::CheckpointPartCommitted(CheckpointPartCommitted {
                run: RUN.into(),
                step,
                part,
                parts,
                node: node.into(),
                location: Location {
                    tier: "local".into(),
                    prefix: layout::checkpoint_part_folder("lab-a", &dataset, step, part),
                },
                total_bytes: total_bytes(&files),
                files,
                stamps: vec![],
                tags: vec![],
            }),
        )
    }

    fn offloaded(commit: &Event) -> Event {
        let Body::CheckpointPartCommitted(p) = &commit.body else {
            unreachable!()
        };
        commit.caused(
            "offloaded",
            Body::CheckpointPartOffloaded(CheckpointPartOffloaded {
                run: p.run.clone(),
                step: p.step,
                part: p.part,
                parts: p.parts,
                node: p.node.clone(),
                from: p.location.clone(),
                location: Location {
                    tier: "hot".into(),
                    prefix: p.location.prefix.clone(),
                },
                files: p.files.len() as u64,
                total_bytes: p.total_bytes,
                hashed: vec![],
            }),
        )
    }

    fn steps(store: &crate::store::Store) -> Vec<StepParts> {
        let Answer::CheckpointParts { parts } = crate::answer(
            store,
            &Query::CheckpointParts {
                project: "lab-a".into(),
                run: RUN.into(),
                step: None,
            },
        ) else {
            panic!("not a parts answer")
        };
        StepParts::of(&parts)
    }

    #[test]
    fn a_step_is_complete_only_with_every_part_offloaded_in_any_order() {
        let commits: Vec<Event> = (0..4)
            .map(|i| committed(3, i, 4, &format!("n{i}")))
            .collect();
        let offloads: Vec<Event> = commits.iter().map(offloaded).collect();
        // Offloads before their commits, out of order, each twice.
        let events = [
            offloads[2].clone(),
            commits[1].clone(),
            offloads[0].clone(),
            offloads[2].clone(),
            commits[0].clone(),
            commits[2].clone(),
            commits[3].clone(),
            offloads[1].clone(),
            commits[1].clone(),
        ];
        let dir = tempfile::tempdir().unwrap();
        let store = store_with(dir.path(), "parts.redb", &events);
        let step = &steps(&store)[0];
        assert!(!step.complete(), "{step:?}");
        assert_eq!(step.offloaded, 3);
        assert_eq!(step.on_node, vec![(3, "n3".to_owned())]);
        assert_eq!(step.bytes_on_node, 13);
        assert!(step.oldest_on_node.is_some());

        fold_into(&store, &[offloads[3].clone()]);
        let step = &steps(&store)[0];
        assert!(step.complete(), "{step:?}");
        assert_eq!(step.bytes_on_node, 0);
    }

    /// A part committed by stamps (no hash) and its offload stating the hashes it computed.
    fn stamped_and_hashed(step: u64) -> (Event, Event) {
        let mut commit = committed(step, 0, 1, "n0");
        let Body::CheckpointPartCommitted(p) = &mut commit.body else {
            unreachable!()
        };
        let files = std::mem::take(&mut p.files);
        p.stamps = files
            .iter()
            .map(|f| FileStamp {
                path: f.path.clone(),
                size: f.size,
                mtime_secs: 1,
                mtime_nanos: 2,
                ctime_secs: 3,
                ctime_nanos: 4,
                inode: 5,
            })
            .collect();
        let mut offload = offloaded(&commit);
        let Body::CheckpointPartOffloaded(o) = &mut offload.body else {
            unreachable!()
        };
        o.files = files.len() as u64;
        o.hashed = files;
        (commit, offload)
    }

    #[test]
    fn a_stamped_parts_files_are_the_ones_its_offload_hashed_in_either_order() {
        for step in [1, 2] {
            let (commit, offload) = stamped_and_hashed(step);
            let Body::CheckpointPartOffloaded(o) = &offload.body else {
                unreachable!()
            };
            let events = match step {
                1 => [commit.clone(), offload.clone()],
                _ => [offload.clone(), commit.clone()],
            };
            let dir = tempfile::tempdir().unwrap();
            let store = store_with(dir.path(), "parts.redb", &events);
            let record = part_record(&store, step, 0);
            assert_eq!(record.files, o.hashed, "step {step}");
            assert!(!record.files[0].sha256.is_empty());
        }
    }

    #[test]
    fn the_parts_on_a_nodes_tier_are_that_nodes_only() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_with(
            dir.path(),
            "parts.redb",
            &[committed(1, 0, 2, "n0"), committed(1, 1, 2, "n1")],
        );
        let Answer::CheckpointParts { parts } = crate::answer(
            &store,
            &Query::CheckpointPartsOn {
                tier: "local".into(),
                node: Some("n1".into()),
            },
        ) else {
            panic!("not a parts answer")
        };
        let found: Vec<(u32, &str)> = parts.iter().map(|p| (p.part, p.node.as_str())).collect();
        assert_eq!(found, [(1, "n1")]);
    }

    fn removed(commit: &Event, node: &str) -> Event {
        let Body::CheckpointPartCommitted(p) = &commit.body else {
            unreachable!()
        };
        commit.caused(
            &format!("part-removed:{}", p.part),
            Body::CheckpointPartRemoved(CheckpointPartRemoved {
                run: p.run.clone(),
                step: p.step,
                part: p.part,
                node: node.into(),
                location: p.location.clone(),
                offloaded_to: Location {
                    tier: "hot".into(),
                    prefix: p.location.prefix.clone(),
                },
                files: p.files.len() as u64,
                total_bytes: p.total_bytes,
            }),
        )
    }

    fn part_record(store: &crate::store::Store, step: u64, part: u32) -> CheckpointPartRecord {
        let Answer::CheckpointParts { parts } = crate::answer(
            store,
            &Query::CheckpointParts {
                project: "lab-a".into(),
                run: RUN.into(),
                step: Some(step),
            },
        ) else {
            panic!("not a parts answer")
        };
        parts.into_iter().find(|p| p.part == part).unwrap()
    }

    #[test]
    fn a_removal_is_recorded_for_its_own_node_until_a_newer_commit_puts_the_part_back() {
        let commit = committed(6, 0, 1, "n0");
        let dir = tempfile::tempdir().unwrap();
        let store = store_with(
            dir.path(),
            "parts.redb",
            &[commit.clone(), offloaded(&commit), removed(&commit, "n9")],
        );
        assert!(
            !part_record(&store, 6, 0).is_removed(),
            "another node's removal"
        );
        let mut by_its_node = removed(&commit, "n0");
        by_its_node.id = EventId::new("removed-by-n0").unwrap();
        fold_into(&store, &[by_its_node]);
        assert!(part_record(&store, 6, 0).is_removed());
        let mut again = committed(6, 0, 1, "n0");
        again.occurred_at += time::Duration::seconds(60);
        again.id = EventId::new("committed-again").unwrap();
        fold_into(&store, &[again]);
        assert!(!part_record(&store, 6, 0).is_removed());
    }

    #[test]
    fn a_part_never_committed_is_named_missing() {
        let dir = tempfile::tempdir().unwrap();
        let store = store_with(
            dir.path(),
            "parts.redb",
            &[
                committed(5, 0, 2, "n0"),
                offloaded(&committed(5, 0, 2, "n0")),
            ],
        );
        let step = &steps(&store)[0];
        assert_eq!(step.parts, 2);
        assert_eq!(step.on_node, vec![(1, "?".to_owned())]);
        assert!(!step.complete());
    }

    #[test]
    fn the_deadline_runs_from_the_oldest_part_still_on_its_node() {
        let mut early = committed(7, 0, 2, "n0");
        early.occurred_at -= time::Duration::hours(2);
        let late = committed(7, 1, 2, "n1");
        let dir = tempfile::tempdir().unwrap();
        let store = store_with(dir.path(), "parts.redb", &[late.clone(), early.clone()]);
        let step = &steps(&store)[0];
        assert_eq!(step.oldest_on_node, Some(early.occurred_at));
        let deadline = std::time::Duration::from_secs(3600);
        assert!(step.late(deadline, time::OffsetDateTime::now_utc()));
        fold_into(&store, &[offloaded(&early)]);
        let step = &steps(&store)[0];
        assert_eq!(step.oldest_on_node, Some(late.occurred_at));
        assert!(!step.late(deadline, time::OffsetDateTime::now_utc()));
    }

    #[test]
    fn a_step_committed_whole_is_no_longer_listed_but_its_parts_are_kept() {
        let commit = committed(9, 0, 1, "n0");
        let whole = Event::request(
            EventId::for_checkpoint("lab-a", RUN, 9),
            "lab-a",
            Body::CheckpointCommitted(CheckpointCommitted {
                run: RUN.into(),
                step: 9,
                location: Location {
                    tier: "hot".into(),
                    prefix: layout::checkpoint_step_folder(
                        "lab-a",
                        &stagehand_catalogue::checkpoint_dataset(RUN),
                        9,
                    ),
                },
                files: vec![FileRef::new("part-0/shard-0.bin", 10, sha256_hex(&[0]))],
                manifest: None,
                total_bytes: 10,
                tags: vec![],
            }),
        );
        let dir = tempfile::tempdir().unwrap();
        let store = store_with(
            dir.path(),
            "parts.redb",
            &[commit.clone(), offloaded(&commit), whole],
        );
        assert!(steps(&store).is_empty());
        let Answer::CheckpointParts { parts } = crate::answer(
            &store,
            &Query::CheckpointParts {
                project: "lab-a".into(),
                run: RUN.into(),
                step: Some(9),
            },
        ) else {
            panic!("not a parts answer")
        };
        assert_eq!(parts.len(), 1);
        assert_eq!(
            parts[0].files.len(),
            1,
            "one step's parts carry their files"
        );
    }
}
