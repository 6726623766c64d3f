//! The demoter's own state, in its redb file: every demotion step begun and not finished, and
//! how far it got. A step is written before its first effect and advanced after each one, so a
//! demoter killed anywhere takes the step up again on start at the phase it reached.
//!
//! | table | key | value |
//! | --- | --- | --- |
//! | `steps` | (tier, prefix) | [`Step`] (JSON) |
//! | `checkpoints` | (project, run, step) | [`CheckpointNote`] (JSON): the commit fact and where retention has put it |

use std::path::Path;
use std::sync::Arc;

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};
use stagehand_schemas::{CheckpointCommitted, EventId};
use stagehand_store::GroupWriter;
use time::OffsetDateTime;

const STEPS: TableDefinition<(&str, &str), &[u8]> = TableDefinition::new("steps");
const CHECKPOINTS: TableDefinition<(&str, &str, u64), &[u8]> = TableDefinition::new("checkpoints");

/// Where a committed checkpoint is, as the demoter carried out retention's decisions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CheckpointPlace {
    /// Where the run wrote it.
    Committed,
    /// Moved to the retention policy's `demote_to` tier.
    Demoted,
    /// Removed by retention.
    Expired,
}

/// A committed checkpoint the demoter follows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointNote {
    pub project: String,
    pub committed: CheckpointCommitted,
    #[serde(with = "time::serde::rfc3339")]
    pub committed_at: OffsetDateTime,
    pub place: CheckpointPlace,
    /// The tier it was demoted to, once it was.
    #[serde(default)]
    pub demoted_to: Option<String>,
}

/// What a checkpoint step does besides moving the folder.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointStep {
    pub run: String,
    pub step: u64,
    /// The retention rule that decided (`keep_last`, `expired`, …).
    pub rule: String,
}

/// How far a demotion step got. Each phase is recorded after its effect is durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Decided; nothing done yet (or the copy down is under way).
    Planned,
    /// A verified copy exists on a durable tier (made by this step and announced with
    /// `replica.created`, or there before).
    CopiedDown,
    /// `replica.removed` is stored and the catalogue has withdrawn the replica's readiness.
    Withdrawn,
    /// The replica's folder was renamed out of the tier's namespace; its bytes remain to delete.
    Renamed,
}

impl Phase {
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Planned => "planned",
            Phase::CopiedDown => "copied-down",
            Phase::Withdrawn => "withdrawn",
            Phase::Renamed => "renamed",
        }
    }
}

/// One replica being demoted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Step {
    /// The base of the step's fact ids (unique per step, kept across restarts).
    pub id: EventId,
    pub project: String,
    pub dataset: String,
    pub version: String,
    pub tier: String,
    /// `<project>/<dataset>/<version>` beneath the tier's root.
    pub prefix: String,
    pub files: u64,
    pub bytes: u64,
    /// The sentence `replica.removed` carries.
    pub reason: String,
    /// The durable tier to copy to first, when no verified copy exists on one.
    pub copy_to: Option<String>,
    pub phase: Phase,
    #[serde(with = "time::serde::rfc3339")]
    pub begun_at: OffsetDateTime,
    /// Set for a checkpoint's demotion or expiry (retention decided it): its facts are
    /// `checkpoint.demoted` / `checkpoint.expired`, and no readiness is withdrawn.
    #[serde(default)]
    pub checkpoint: Option<CheckpointStep>,
    /// How the replica was proven when it was made (announced again if the step is undone).
    #[serde(default)]
    pub verified_by: Option<String>,
    /// The node whose `local` tier holds the replica (a node demoter's step); `None` on a
    /// shared tier.
    #[serde(default)]
    pub node: Option<String>,
}

/// A failure of the state store: the demoter cannot go on safely. Typed and classified
/// (retryable or permanent) in [`stagehand_store`], shared with the promoter's state.
pub use stagehand_store::StateError;

/// The demoter's state store. Clones share one database and one committer.
#[derive(Clone)]
pub struct State {
    db: Arc<Database>,
    /// To the committer thread: the writes of steps carried at once, each acknowledged once
    /// the transaction holding it is durable.
    committer: GroupWriter<StepWrite, (), StateError>,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State").finish_non_exhaustive()
    }
}

/// One change to the `steps` table.
#[derive(Debug, Clone)]
enum StepWrite {
    /// A new step, or its next phase.
    Put {
        tier: String,
        prefix: String,
        json: Vec<u8>,
    },
    /// A finished (or abandoned) step forgotten.
    Forget { tier: String, prefix: String },
}

impl StepWrite {
    fn put(step: &Step) -> Result<StepWrite, StateError> {
        Ok(StepWrite::Put {
            tier: step.tier.clone(),
            prefix: step.prefix.clone(),
            json: serde_json::to_vec(step)
                .map_err(|e| StateError::encode(format!("step {}", step.prefix), e))?,
        })
    }

    fn forget(step: &Step) -> StepWrite {
        StepWrite::Forget {
            tier: step.tier.clone(),
            prefix: step.prefix.clone(),
        }
    }
}

/// Applies `writes` in one transaction and commits it (durably: redb's default).
fn commit_steps<'a>(
    db: &Database,
    writes: impl IntoIterator<Item = &'a StepWrite>,
) -> Result<(), StateError> {
    let txn = db.begin_write()?;
    {
        let mut table = txn.open_table(STEPS)?;
        for w in writes {
            match w {
                StepWrite::Put { tier, prefix, json } => table
                    .insert((tier.as_str(), prefix.as_str()), json.as_slice())
                    .map(drop),
                StepWrite::Forget { tier, prefix } => {
                    table.remove((tier.as_str(), prefix.as_str())).map(drop)
                }
            }?;
        }
    }
    Ok(txn.commit()?)
}

/// The committer ([`stagehand_store`]): takes the first write waiting, then every other one
/// queued meanwhile, and makes them durable in one commit (one flush for several steps carried
/// at once, where each alone would pay its own). Each write is acknowledged only after that
/// commit; a failed commit fails every write it held. At most `max_concurrent` steps write at
/// once, far fewer than a batch holds. It ends when the last [`State`] is dropped; it holds the
/// database only weakly, so dropping the last [`State`] closes it (and a reopening in the same
/// process finds it closed).
const COMMITTER_BATCH: usize = 1024;

/// The committer's name (its thread is `demoter-state-writer`).
const COMMITTER: &str = "demoter-state";

impl State {
    pub fn open(path: &Path) -> Result<State, StateError> {
        let db = stagehand_store::create_state_file(path)?;
        let txn = db.begin_write()?;
        txn.open_table(STEPS)?;
        txn.open_table(CHECKPOINTS)?;
        txn.commit()?;
        let db = Arc::new(db);
        let committer_db = Arc::downgrade(&db);
        // The thread is not joined: it ends by itself once the last `State` is dropped.
        let (committer, _thread) = stagehand_store::writer(COMMITTER)
            .max_batch(COMMITTER_BATCH)
            .spawn(move |batch: &[StepWrite]| {
                let db = committer_db
                    .upgrade()
                    .ok_or(StateError::Redb(redb::Error::DatabaseClosed))?;
                commit_steps(&db, batch)?;
                Ok(vec![(); batch.len()])
            })
            .map_err(|source| StateError::Spawn {
                name: COMMITTER,
                source,
            })?;
        Ok(State { db, committer })
    }

    /// Writes `step` (a new one, or its next phase) durably, in a transaction of its own.
    pub fn put(&self, step: &Step) -> Result<(), StateError> {
        commit_steps(&self.db, [&StepWrite::put(step)?])
    }

    /// Forgets a finished (or abandoned) step, in a transaction of its own.
    pub fn finish(&self, step: &Step) -> Result<(), StateError> {
        commit_steps(&self.db, [&StepWrite::forget(step)])
    }

    /// Writes `step` durably, committed with the writes of other steps queued at the same
    /// time; returns once it is durable. What [`State::put`] does, for steps carried at once.
    pub async fn record(&self, step: &Step) -> Result<(), StateError> {
        self.queue(StepWrite::put(step)?).await
    }

    /// Forgets a finished (or abandoned) step, committed with other steps' writes as
    /// [`State::record`].
    pub async fn forget(&self, step: &Step) -> Result<(), StateError> {
        self.queue(StepWrite::forget(step)).await
    }

    async fn queue(&self, write: StepWrite) -> Result<(), StateError> {
        Ok(self.committer.submit(write).await?)
    }

    /// Every step begun and not finished, in (tier, prefix) order.
    pub fn steps(&self) -> Result<Vec<Step>, StateError> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(STEPS)?;
        let mut out = Vec::new();
        for row in table.iter()? {
            let (k, v) = row?;
            out.push(serde_json::from_slice(v.value()).map_err(|e| {
                let (tier, prefix) = k.value();
                StateError::decode(format!("step {tier}:{prefix}"), e)
            })?);
        }
        Ok(out)
    }
}

impl State {
    /// Notes a committed checkpoint the first time its commit is seen — unless a live (not
    /// expired) step of the project noted before lies in the same folder, beneath it or above
    /// it (`stagehand_schemas::folders_overlap`): then nothing is noted and that step is
    /// returned. Looked at and written in one transaction, so of two overlapping commits
    /// handled at once exactly one is noted.
    pub fn note_checkpoint(
        &self,
        note: &CheckpointNote,
    ) -> Result<Option<CheckpointNote>, StateError> {
        let key = (
            note.project.as_str(),
            note.committed.run.as_str(),
            note.committed.step,
        );
        let bytes = serde_json::to_vec(note).map_err(|e| StateError::encode(checkpoint(key), e))?;
        let txn = self.db.begin_write()?;
        let mut overlapping = None;
        {
            let mut table = txn.open_table(CHECKPOINTS)?;
            if table.get(key)?.is_none() {
                for row in table.range((note.project.as_str(), "", 0)..)? {
                    let (k, v) = row?;
                    if k.value().0 != note.project {
                        break;
                    }
                    let other: CheckpointNote = serde_json::from_slice(v.value())
                        .map_err(|e| StateError::decode(checkpoint(k.value()), e))?;
                    if other.place != CheckpointPlace::Expired
                        && stagehand_schemas::folders_overlap(
                            &other.committed.location.prefix,
                            &note.committed.location.prefix,
                        )
                    {
                        overlapping = Some(other);
                        break;
                    }
                }
                if overlapping.is_none() {
                    table.insert(key, bytes.as_slice())?;
                }
            }
        }
        txn.commit()?;
        Ok(overlapping)
    }

    /// Records where a checkpoint now is.
    pub fn place_checkpoint(
        &self,
        project: &str,
        run: &str,
        step: u64,
        place: CheckpointPlace,
        demoted_to: Option<&str>,
    ) -> Result<(), StateError> {
        let key = (project, run, step);
        let txn = self.db.begin_write()?;
        {
            let mut table = txn.open_table(CHECKPOINTS)?;
            let current = table
                .get(key)?
                .map(|v| serde_json::from_slice::<CheckpointNote>(v.value()));
            if let Some(note) = current {
                let mut note = note.map_err(|e| StateError::decode(checkpoint(key), e))?;
                note.place = place;
                if let Some(t) = demoted_to {
                    note.demoted_to = Some(t.to_owned());
                }
                let bytes = serde_json::to_vec(&note)
                    .map_err(|e| StateError::encode(checkpoint(key), e))?;
                table.insert(key, bytes.as_slice())?;
            }
        }
        Ok(txn.commit()?)
    }

    /// Every checkpoint noted, grouped by (project, run), in step order within each.
    pub fn runs(&self) -> Result<Vec<Vec<CheckpointNote>>, StateError> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(CHECKPOINTS)?;
        let mut out: Vec<Vec<CheckpointNote>> = Vec::new();
        for row in table.iter()? {
            let (k, v) = row?;
            let note: CheckpointNote = serde_json::from_slice(v.value())
                .map_err(|e| StateError::decode(checkpoint(k.value()), e))?;
            match out.last_mut() {
                Some(run)
                    if run[0].project == note.project
                        && run[0].committed.run == note.committed.run =>
                {
                    run.push(note)
                }
                _ => out.push(vec![note]),
            }
        }
        Ok(out)
    }
}

/// A `checkpoints` record's name in an error.
fn checkpoint((project, run, step): (&str, &str, u64)) -> String {
    format!("checkpoint {project}/{run} step {step}")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Guards the one-folder rule at noting: a step inside a noted live step's folder is not
    /// noted, and the step it overlaps is said.
    #[test]
    fn a_step_overlapping_a_noted_one_is_not_noted() {
        let dir = tempfile::tempdir().unwrap();
        let s = State::open(&dir.path().join("s.redb")).unwrap();
        let note = |step: u64, prefix: &str| CheckpointNote {
            project: "p".into(),
            committed: CheckpointCommitted {
                run: "r".into(),
                step,
                location: stagehand_schemas::Location {
                    tier: "hot".into(),
                    prefix: prefix.into(),
                },
                files: vec![],
                manifest: None,
                total_bytes: 0,
                tags: vec![],
            },
            committed_at: OffsetDateTime::UNIX_EPOCH,
            place: CheckpointPlace::Committed,
            demoted_to: None,
        };
        assert_eq!(s.note_checkpoint(&note(1, "p/r/step-1")).unwrap(), None);
        let refused = s.note_checkpoint(&note(2, "p/r/step-1/step-2")).unwrap();
        assert_eq!(refused.map(|n| n.committed.step), Some(1));
        assert_eq!(s.note_checkpoint(&note(10, "p/r/step-10")).unwrap(), None);
        let steps: Vec<u64> = s
            .runs()
            .unwrap()
            .concat()
            .iter()
            .map(|n| n.committed.step)
            .collect();
        assert_eq!(steps, vec![1, 10]);
    }

    #[test]
    fn steps_survive_reopening_at_their_phase() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.redb");
        let mut step = Step {
            id: EventId::for_content(&[b"x"]),
            project: "p".into(),
            dataset: "d".into(),
            version: "v".into(),
            tier: "hot".into(),
            prefix: "p/d/v".into(),
            files: 1,
            bytes: 2,
            reason: "idle".into(),
            copy_to: Some("capacity".into()),
            phase: Phase::Planned,
            begun_at: OffsetDateTime::UNIX_EPOCH,
            checkpoint: None,
            verified_by: None,
            node: None,
        };
        {
            let s = State::open(&path).unwrap();
            s.put(&step).unwrap();
            step.phase = Phase::Renamed;
            s.put(&step).unwrap();
        }
        let s = State::open(&path).unwrap();
        assert_eq!(s.steps().unwrap(), vec![step.clone()]);
        s.finish(&step).unwrap();
        assert!(s.steps().unwrap().is_empty());
    }
}
