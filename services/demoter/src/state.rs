//! The demoter's own state, in its redb file: every demotion step begun and not finished, and
//! how far it got. A step is written before its first effect and advanced after each one, so a
//! demoter killed anywhere takes the step up again on start at the phase it reached.
//!
//! | table | key | value |
//! | --- | --- | --- |
//! | `steps` | (tier, prefix) | [`Step`] (JSON) |

use std::path::Path;
use std::sync::Arc;

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};
use stagehand_schemas::EventId;
use time::OffsetDateTime;

const STEPS: TableDefinition<(&str, &str), &[u8]> = TableDefinition::new("steps");

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
}

/// A failure of the state store: the demoter cannot go on safely.
#[derive(Debug, thiserror::Error)]
#[error("demoter state {what}: {detail}")]
pub struct StateError {
    pub what: &'static str,
    pub detail: String,
}

fn err(what: &'static str) -> impl Fn(String) -> StateError {
    move |detail| StateError { what, detail }
}

/// The demoter's state store. Clones share one database.
#[derive(Clone)]
pub struct State {
    db: Arc<Database>,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State").finish_non_exhaustive()
    }
}

impl State {
    pub fn open(path: &Path) -> Result<State, StateError> {
        let open = err("open");
        let db = Database::create(path).map_err(|e| open(format!("{}: {e}", path.display())))?;
        let txn = db.begin_write().map_err(|e| open(e.to_string()))?;
        txn.open_table(STEPS).map_err(|e| open(e.to_string()))?;
        txn.commit().map_err(|e| open(e.to_string()))?;
        Ok(State { db: Arc::new(db) })
    }

    /// Writes `step` (a new one, or its next phase) durably.
    pub fn put(&self, step: &Step) -> Result<(), StateError> {
        let e = err("write");
        let bytes = serde_json::to_vec(step).map_err(|x| e(x.to_string()))?;
        let txn = self.db.begin_write().map_err(|x| e(x.to_string()))?;
        txn.open_table(STEPS)
            .map_err(|x| e(x.to_string()))?
            .insert((step.tier.as_str(), step.prefix.as_str()), bytes.as_slice())
            .map_err(|x| e(x.to_string()))?;
        txn.commit().map_err(|x| e(x.to_string()))
    }

    /// Forgets a finished (or abandoned) step.
    pub fn finish(&self, step: &Step) -> Result<(), StateError> {
        let e = err("write");
        let txn = self.db.begin_write().map_err(|x| e(x.to_string()))?;
        txn.open_table(STEPS)
            .map_err(|x| e(x.to_string()))?
            .remove((step.tier.as_str(), step.prefix.as_str()))
            .map_err(|x| e(x.to_string()))?;
        txn.commit().map_err(|x| e(x.to_string()))
    }

    /// Every step begun and not finished, in (tier, prefix) order.
    pub fn steps(&self) -> Result<Vec<Step>, StateError> {
        let e = err("read");
        let txn = self.db.begin_read().map_err(|x| e(x.to_string()))?;
        let table = txn.open_table(STEPS).map_err(|x| e(x.to_string()))?;
        let mut out = Vec::new();
        for row in table.iter().map_err(|x| e(x.to_string()))? {
            let (_, v) = row.map_err(|x| e(x.to_string()))?;
            out.push(serde_json::from_slice(v.value()).map_err(|x| e(x.to_string()))?);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
