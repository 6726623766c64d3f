//! The demoter's work: a pass over every hot posix tier — survey, choose, demote — and the
//! recorded steps that carry one replica off a tier safely.
//!
//! One demotion is one [`Step`](crate::state::Step) in the state store, advanced phase by phase, each phase
//! recorded after its effect is durable:
//!
//! 1. `planned`: when no durable tier (capacity, backup) holds a verified copy, the replica is
//!    copied to `demotion.toml`'s `target` with the mover's set copy (background class,
//!    read back before it is published) and announced with `replica.created`;
//! 2. `copied-down`: the holds are looked at again (a job that asked meanwhile keeps it), then
//!    `replica.removed` is published with the reason, and the demoter waits until the catalogue
//!    has withdrawn the replica's readiness (its key absent or not `ready`): from here no
//!    scheduler starts a job on it;
//! 3. `withdrawn`: the holds are looked at once more — a job that asked meanwhile keeps the
//!    replica (the removal is undone: `replica.created` again) — then the folder is renamed out
//!    of the tier's namespace (`<parent>/.<version>.stagehand-removed`, one `renameat2`), so no
//!    reader sees part of it;
//! 4. `renamed`: the hidden folder is deleted and the step forgotten.
//!
//! A demoter killed anywhere takes every unfinished step up again on start, at its phase; a
//! repeated effect is harmless (the copy finds its set present and verifies every file of it,
//! facts carry the step's ids). A checkpoint's folder is removed only when it holds nothing
//! but its committed files and no other live step's folder overlaps it; otherwise
//! `checkpoint.held` says why and the folder stays whole.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use async_nats::jetstream::kv;
use stagehand_bus::{Bus, CancellationToken};
use stagehand_catalogue::{Catalogue, CatalogueError};
use stagehand_mover::{Mover, Tier};
use stagehand_policy::{DemotionPolicy, Policies};
use stagehand_schemas::{Body, Event, Retryable};
use tokio::sync::Notify;
use tracing::warn;

use crate::state::{CheckpointNote, CheckpointPlace, Phase, State};

mod pass;
mod retention;
mod step;

pub use pass::PassReport;
pub use retention::CHECKPOINT_PRIORITY;
pub use step::{COPY_DOWN_PRIORITY, COPY_DOWN_VERIFY};

/// What the demoter needs, built once at start.
pub struct Parts {
    pub bus: Bus,
    pub catalogue: Catalogue,
    pub policies: Policies,
    pub demotion: DemotionPolicy,
    /// Every declared tier that opened.
    pub tiers: HashMap<String, Tier>,
    pub state: State,
    /// Shared with the scrub, so both take their slots from one scheduler.
    pub mover: Arc<Mover>,
    pub spool_dir: PathBuf,
    /// The readiness bucket (read only: the recorder writes it).
    pub readiness: kv::Store,
    /// The promoter's bucket: the replicas' use records and the tiers' reservations
    /// (`stagehand_bus::placement`), which the demoter takes part in.
    pub placement: kv::Store,
    /// A fault-test seam: after recording this phase the demoter stops where it is.
    pub halt_after: Option<Phase>,
    /// Set for a node's demoter: it demotes that node's replicas on the `local` tiers (and
    /// nothing else); `None`: the shared demoter, which demotes the hot tiers and carries out
    /// checkpoint retention.
    pub node: Option<String>,
    /// A test seam: right before a rename (every check made) the process stops itself with
    /// `SIGSTOP`, so a test can interleave a stage request there and continue it (`SIGCONT`).
    pub stop_before_rename: bool,
    pub shutdown: CancellationToken,
}

/// The demoter. Clones share everything.
#[derive(Clone)]
pub struct Demoter {
    inner: Arc<Inner>,
}

struct Inner {
    parts: Parts,
    /// Facts that may change what to demote ask for a pass.
    wake: Notify,
}

/// Why a pass stopped early. Retryable ones wait for the next pass.
#[derive(Debug, thiserror::Error)]
pub enum PassError {
    #[error("asking the catalogue: {0}")]
    Catalogue(#[from] CatalogueError),
    #[error(transparent)]
    State(#[from] crate::state::StateError),
    #[error("{0}")]
    Step(String),
}

impl Retryable for PassError {
    fn is_retryable(&self) -> bool {
        match self {
            PassError::Catalogue(e) => e.is_retryable(),
            PassError::State(_) => false,
            PassError::Step(_) => true,
        }
    }
}

fn step_err(what: impl std::fmt::Display) -> PassError {
    PassError::Step(what.to_string())
}

impl Demoter {
    pub fn new(parts: Parts) -> Demoter {
        Demoter {
            inner: Arc::new(Inner {
                parts,
                wake: Notify::new(),
            }),
        }
    }

    fn p(&self) -> &Parts {
        &self.inner.parts
    }

    /// Asks for a pass soon (a fact changed what is placed or held).
    pub fn wake(&self) {
        self.inner.wake.notify_one();
    }

    /// A fact or release the consumers deliver: a checkpoint commit is noted (retention
    /// decides over every noted checkpoint of its run); then a pass is asked for.
    pub fn on_event(&self, event: &Event) -> Result<(), PassError> {
        match &event.body {
            Body::CheckpointCommitted(c) => {
                // A step is one folder of its own: one overlapping a step noted before is
                // not carried out (the recorder refuses it too), so that removing either never
                // removes the other's files.
                let refused = self.p().state.note_checkpoint(&CheckpointNote {
                    project: event.project.clone(),
                    committed: c.clone(),
                    committed_at: event.occurred_at,
                    place: CheckpointPlace::Committed,
                    demoted_to: None,
                })?;
                if let Some(other) = refused {
                    warn!(
                        run = %c.run, step = c.step, prefix = %c.location.prefix,
                        other_run = %other.committed.run, other_step = other.committed.step,
                        other_prefix = %other.committed.location.prefix,
                        "checkpoint overlaps the folder of another live step; not noted for retention"
                    );
                    return Ok(());
                }
                self.wake();
            }
            Body::StageReleased(_) | Body::ReplicaCreated(_) | Body::ReplicaRemoved(_) => {
                self.wake()
            }
            _ => {}
        }
        Ok(())
    }
}
