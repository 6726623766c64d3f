//! What the recorder keeps beside the records answers carry (those are the client crate's,
//! [`stagehand_catalogue`]): the marker of a stored file list and the per-key state readiness
//! is derived from.

use serde::{Deserialize, Serialize};
use stagehand_catalogue::{JobCounts, StageProgress, StageState, StageStatus, Stamp};

/// A version's file list is complete in the store: `chunks` rows of `files` entries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileListRecord {
    pub digest: String,
    pub files: u64,
    pub bytes: u64,
    pub chunks: u64,
}

/// The newest stage fact of a readiness key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageFact {
    pub stamp: Stamp,
    pub state: StageState,
    pub reason: Option<String>,
    pub retryable: Option<bool>,
}

/// What the fold keeps per (project, dataset, version, tier, node) to derive its
/// [`stagehand_catalogue::Readiness`] with the replica record, without reading every job's
/// stage: counts per state kept exact as stages change (each stage record moves from one
/// count to another only when a newer fact replaces it), the newest stage fact, and the path
/// of the newest `stage.ready`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadinessAggregate {
    pub jobs: JobCounts,
    pub newest: Option<StageFact>,
    pub ready_path: Option<(Stamp, String)>,
}

impl ReadinessAggregate {
    /// Moves one job from `from` (none for a job new to this key) to `to`.
    pub fn moved(&mut self, from: Option<StageState>, to: StageState) {
        if let Some(from) = from {
            let c = self.count(from);
            *c = c.saturating_sub(1);
        }
        *self.count(to) += 1;
    }

    /// Takes one job away from `state`'s count.
    pub fn left(&mut self, state: StageState) {
        let c = self.count(state);
        *c = c.saturating_sub(1);
    }

    fn count(&mut self, state: StageState) -> &mut u64 {
        match state {
            // Copying is never stored: it is pending with progress.
            StageState::Pending | StageState::Copying => &mut self.jobs.pending,
            StageState::Ready => &mut self.jobs.ready,
            StageState::Failed => &mut self.jobs.failed,
            StageState::Released => &mut self.jobs.released,
        }
    }
}

/// A stage request as stored: its status, and the registers that order the facts about it —
/// the state follows the fact of the highest (rank, stamp), so a release is final whatever the
/// clocks say and anything beats the bare request; the path follows the newest `stage.ready`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageRecord {
    pub status: StageStatus,
    pub rank: u8,
    pub stamp: Stamp,
    pub path_stamp: Option<Stamp>,
    /// Whether an answer was folded before the request itself (the facts and requests streams
    /// are folded apart, and a rebuild folds every fact before any request). Until the request
    /// comes the record is shown pending, waiting for its request, never ready: the request
    /// says where the data is to be staged, and an answer about another tier or node is
    /// dropped when it comes (`stage::record_in`), so that no answer stated ahead of a job's
    /// request (a node's user may state answers on its own node's subjects) is handed to it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub answered_first: bool,
}

impl StageRecord {
    /// The status as answered and mirrored: a pending request the promoter reports progress
    /// for is `copying`; one answered before its request was folded is pending.
    pub fn shown(&self, progress: Option<StageProgress>) -> StageStatus {
        let mut status = self.status.clone();
        if self.answered_first {
            status.state = StageState::Pending;
            status.waiting_for = Some("request".into());
            status.reason =
                Some("answered before its request was recorded: waiting for the request".into());
            status.path = None;
            status.progress = None;
            return status;
        }
        if status.state == StageState::Pending
            && let Some(progress) = progress
        {
            status.state = StageState::Copying;
            status.progress = Some(progress);
            // The copy runs: its progress's ETA is the estimate now.
            status.ready_estimate = None;
        }
        status
    }
}
