//! Pruning stage records: a stage request's record (table `stage_requests`, with its rows in
//! `stages_by_job`, `stages_by_version`, `stages_open`, `stage_progress` and its count in the readiness of
//! its version) is removed once it holds nothing and has not changed for the recorder's
//! `stage_retention`. Without it the store grows by a record per job for ever.
//!
//! "Holds nothing" is [`StageStatus::holds_at`] false at the cutoff: released, failed, or past
//! the job's `hold_until`. A record still pending or ready within its hold is never pruned,
//! however old: the demoter never removes a replica a live stage holds, and a pruned record
//! would hold nothing. The facts that built a pruned record stay in the `applied` table, so a
//! redelivered copy of one does not bring the record back.
//!
//! A pass walks `stage_requests` from a cursor, [`SCAN`] records per read transaction, and
//! removes what it found in one write transaction, re-checking each record there: a fact folded
//! meanwhile keeps its record. Passes repeat until the walk reaches the end.

use std::sync::Arc;
use std::time::Duration;

use redb::ReadableTable;
use stagehand_catalogue::StageStatus;
use time::OffsetDateTime;
use tokio_util::sync::CancellationToken;

use crate::error::{RecorderError, StoreError};
use crate::model::StageRecord;
use crate::stage::{counted_key, open_key, read_aggregate, version_key, write_aggregate};
use crate::store::{
    STAGE_PROGRESS, STAGE_REQUESTS, STAGES_BY_JOB, STAGES_BY_VERSION, STAGES_OPEN, Store, decode,
};

/// How long a stage record that holds nothing is kept after its last change, unless the
/// recorder's `stage_retention` says otherwise: long enough for on-call to look at a job's
/// stages after the fact.
pub const DEFAULT_STAGE_RETENTION: Duration = Duration::from_secs(14 * 24 * 3600);

/// How often the recorder prunes, unless its `stage_prune_interval` says otherwise.
pub const DEFAULT_STAGE_PRUNE_INTERVAL: Duration = Duration::from_secs(3600);

/// Stage records examined per pass.
pub const SCAN: usize = 10_000;

/// Where the next pass starts: after this (project, request id).
pub type Cursor = (String, String);

/// What one pass did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrunePass {
    /// Records removed.
    pub pruned: u64,
    /// Where the next pass starts; `None` once the walk reached the end.
    pub next: Option<Cursor>,
}

/// Whether a stage record may go: it holds nothing at `cutoff` and last changed before it.
fn prunable(status: &StageStatus, cutoff: OffsetDateTime) -> bool {
    !status.holds_at(cutoff) && status.updated_at < cutoff
}

impl Store {
    /// One pass of pruning: examines up to `SCAN` stage records after `after` and removes
    /// those that hold nothing at `cutoff` and last changed before it, with their index rows
    /// and their count in their version's readiness.
    pub fn prune_stages(
        &self,
        cutoff: OffsetDateTime,
        after: Option<&Cursor>,
    ) -> Result<PrunePass, StoreError> {
        let mut victims: Vec<Cursor> = Vec::new();
        let mut last: Option<Cursor> = None;
        let mut examined = 0;
        {
            let txn = self.reader()?;
            let table = txn.open_table(STAGE_REQUESTS)?;
            let range = match after {
                Some((p, id)) => table.range((p.as_str(), id.as_str())..)?,
                None => table.range::<(&str, &str)>(..)?,
            };
            for row in range {
                let (key, value) = row?;
                let (project, id) = key.value();
                if after.is_some_and(|(p, i)| p == project && i == id) {
                    continue;
                }
                examined += 1;
                let record: StageRecord =
                    decode(value.value(), || format!("stage request {project}/{id}"))?;
                if prunable(&record.status, cutoff) {
                    victims.push((project.to_owned(), id.to_owned()));
                }
                last = Some((project.to_owned(), id.to_owned()));
                if examined >= SCAN {
                    break;
                }
            }
        }
        let next = if examined >= SCAN { last } else { None };
        if victims.is_empty() {
            return Ok(PrunePass { pruned: 0, next });
        }
        let txn = self.writer_txn()?;
        let mut pruned = 0;
        for (project, id) in &victims {
            let (project, id) = (project.as_str(), id.as_str());
            let record: Option<StageRecord> = txn
                .open_table(STAGE_REQUESTS)?
                .get((project, id))?
                .map(|v| decode(v.value(), || format!("stage request {project}/{id}")))
                .transpose()?;
            // Re-checked here: a fact folded since the read may have made it hold again.
            let Some(record) = record.filter(|r| prunable(&r.status, cutoff)) else {
                continue;
            };
            let status = &record.status;
            txn.open_table(STAGE_REQUESTS)?.remove((project, id))?;
            txn.open_table(STAGES_BY_JOB)?
                .remove((project, status.job_id.as_str(), id))?;
            txn.open_table(STAGES_BY_VERSION)?.remove((
                project,
                status.dataset.as_str(),
                version_key(status),
                id,
            ))?;
            txn.open_table(STAGE_PROGRESS)?.remove((project, id))?;
            if let Some((state, at)) = open_key(status) {
                txn.open_table(STAGES_OPEN)?
                    .remove((state, at, project, id))?;
            }
            if let Some(key) = counted_key(status) {
                let mut aggregate = read_aggregate(&txn, &key)?;
                aggregate.left(status.state);
                write_aggregate(&txn, &key, &aggregate)?;
            }
            pruned += 1;
        }
        txn.commit()?;
        Ok(PrunePass { pruned, next })
    }

    /// Prunes every stage record that holds nothing at `cutoff` and last changed before it,
    /// pass by pass; returns how many went.
    pub fn prune_all_stages(&self, cutoff: OffsetDateTime) -> Result<u64, StoreError> {
        let mut total = 0;
        let mut cursor = None;
        loop {
            let pass = self.prune_stages(cutoff, cursor.as_ref())?;
            total += pass.pruned;
            match pass.next {
                Some(next) => cursor = Some(next),
                None => return Ok(total),
            }
        }
    }
}

/// Prunes every `interval` (the first time one interval after start) what has held nothing
/// for `retention`, until `shutdown`. A failure of the store stops the recorder, as it does
/// when folding.
pub(crate) async fn every(
    store: Arc<Store>,
    retention: Duration,
    interval: Duration,
    shutdown: CancellationToken,
) -> Result<(), RecorderError> {
    let start = tokio::time::Instant::now() + interval;
    let mut ticks = tokio::time::interval_at(start, interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let retention = time::Duration::try_from(retention).unwrap_or(time::Duration::MAX);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            _ = ticks.tick() => {}
        }
        let cutoff = stagehand_schemas::now() - retention;
        let mut cursor: Option<Cursor> = None;
        let mut pruned = 0;
        loop {
            let s = store.clone();
            let after = cursor.take();
            let pass = tokio::task::spawn_blocking(move || s.prune_stages(cutoff, after.as_ref()))
                .await??;
            pruned += pass.pruned;
            match pass.next {
                Some(next) if !shutdown.is_cancelled() => cursor = Some(next),
                _ => break,
            }
        }
        if pruned > 0 {
            tracing::info!(pruned, %cutoff, "stage records that held nothing pruned");
        }
    }
}

#[cfg(test)]
mod tests {
    use stagehand_catalogue::*;
    use stagehand_schemas::*;

    use crate::testing::*;

    /// A request of `job` for the validated version on `tier`, answered `ready`, `days` ago;
    /// released too when `released`. The request holds until `hold_until` when given.
    fn stage(
        job: &str,
        days: i64,
        released: bool,
        hold_until: Option<::time::OffsetDateTime>,
    ) -> (EventId, Vec<Event>) {
        let v = version_of(&validated(1));
        let id = EventId::for_stage("lab-a", job, "cats", &v, "hot", None);
        let mut request = Event::request(
            id.clone(),
            "lab-a",
            Body::StageRequested(StageRequested {
                dataset: "cats".into(),
                version: v.clone(),
                tier: "hot".into(),
                job_id: job.into(),
                requested_by: "slurm".into(),
                deadline: None,
                node: None,
                form: None,
                hold_until,
            }),
        );
        request.occurred_at -= ::time::Duration::days(days);
        let mut ready = request.caused(
            "ready",
            Body::StageReady(StageReady {
                dataset: "cats".into(),
                version: v.clone(),
                location: Location {
                    tier: "hot".into(),
                    prefix: format!("lab-a/cats/{v}"),
                },
                job_id: job.into(),
                request_id: id.clone(),
                node: None,
                path: None,
            }),
        );
        ready.occurred_at = request.occurred_at + ::time::Duration::seconds(1);
        let mut events = vec![request, ready];
        if released {
            let mut release = Event::request(
                EventId::for_stage_release("lab-a", job, "cats", &v, "hot", None),
                "lab-a",
                Body::StageReleased(StageReleased {
                    dataset: "cats".into(),
                    version: v.clone(),
                    tier: "hot".into(),
                    job_id: job.into(),
                    node: None,
                    reason: None,
                }),
            );
            release.occurred_at = events[0].occurred_at + ::time::Duration::seconds(2);
            events.push(release);
        }
        (id, events)
    }

    fn listed_for_job(store: &crate::store::Store, job: &str) -> usize {
        let answer = crate::answer(
            store,
            &Query::StageRequests {
                project: "lab-a".into(),
                job_id: Some(job.into()),
                dataset: None,
                version: None,
                limit: None,
                after: None,
            },
        );
        let Answer::StageRequests { stages, .. } = answer else {
            panic!("{answer:?}")
        };
        stages.len()
    }

    /// Released records older than the cutoff go, with their index rows and readiness counts;
    /// a recent release, an old stage still held, and an old stage whose hold ended but that was
    /// never released are kept or pruned by whether they hold anything at the cutoff.
    #[test]
    fn records_that_hold_nothing_are_pruned_after_the_retention_and_held_ones_never() {
        let dir = tempfile::tempdir().unwrap();
        let now = stagehand_schemas::now();
        let (old_released, a) = stage("old-released", 30, true, None);
        let (recent_released, b) = stage("recent-released", 1, true, None);
        let (old_held, c) = stage("old-held", 30, false, None);
        let (old_lapsed, d) = stage(
            "old-lapsed",
            30,
            false,
            Some(now - ::time::Duration::days(20)),
        );
        let events: Vec<Event> = std::iter::once(validated(1))
            .chain([a, b, c, d].into_iter().flatten())
            .collect();
        let store = store_with(dir.path(), "s.redb", &events);
        let key = ReadinessKey {
            project: "lab-a".into(),
            dataset: "cats".into(),
            version: version_of(&validated(1)),
            tier: "hot".into(),
            node: None,
        };
        let before = crate::readiness::current(&store, &key).unwrap().unwrap();
        assert_eq!((before.jobs.ready, before.jobs.released), (2, 2));

        let cutoff = now - ::time::Duration::days(14);
        assert_eq!(store.prune_all_stages(cutoff).unwrap(), 2);
        let status = |id: &EventId| store.stage_status("lab-a", id.as_str()).unwrap();
        assert!(status(&old_released).is_none());
        assert!(
            status(&old_lapsed).is_none(),
            "its hold ended before the cutoff"
        );
        assert!(status(&recent_released).is_some());
        assert!(status(&old_held).is_some(), "still held: never pruned");
        assert_eq!(
            listed_for_job(&store, "old-released"),
            0,
            "its job index row is gone"
        );
        assert_eq!(listed_for_job(&store, "old-held"), 1);
        let dump = store.dump().unwrap();
        assert_eq!(dump.rows("stages_by_version").len(), 2);
        let after = crate::readiness::current(&store, &key).unwrap().unwrap();
        assert_eq!((after.jobs.ready, after.jobs.released), (1, 1));
        assert!(after.ready, "the held stage still makes it ready");

        // Nothing more to prune; a redelivered fact of a pruned stage does not bring it back.
        assert_eq!(store.prune_all_stages(cutoff).unwrap(), 0);
        let (_, again) = stage("old-released", 30, true, None);
        fold_into(&store, &again);
        assert!(
            status(&old_released).is_none(),
            "applied before: not folded again"
        );
    }

    /// A walk of more records than one pass examines finds every one.
    #[test]
    fn pruning_walks_the_whole_table_pass_by_pass() {
        let dir = tempfile::tempdir().unwrap();
        let mut events = vec![validated(1)];
        let n = super::SCAN + 50;
        for i in 0..n {
            events.extend(stage(&format!("job-{i:06}"), 30, true, None).1);
        }
        let store = store_with(dir.path(), "many.redb", &events);
        let cutoff = stagehand_schemas::now() - ::time::Duration::days(14);
        let first = store.prune_stages(cutoff, None).unwrap();
        assert_eq!(first.pruned, super::SCAN as u64);
        assert!(first.next.is_some());
        let second = store.prune_stages(cutoff, first.next.as_ref()).unwrap();
        assert_eq!((second.pruned, second.next), (50, None));
        assert_eq!(store.dump().unwrap().rows("stage_requests").len(), 0);
    }
}
