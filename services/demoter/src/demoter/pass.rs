//! A pass: unfinished steps first, then every demoted tier surveyed and its chosen replicas
//! carried off, on the policy clock.

use std::collections::HashSet;
use std::time::Duration;

use futures::StreamExt;
use stagehand_bus::RetrySchedule;
use stagehand_catalogue::survey::{TierSurvey, survey_on_node};
use stagehand_catalogue::views::Placed;
use stagehand_policy::{TierLimits, TierPolicy, TierRole};
use stagehand_schemas::{EventId, Retryable};
use time::OffsetDateTime;
use tracing::{info, warn};

use crate::plan::{self, Candidate, Reason, Rules};
use crate::state::{Phase, Step};

use super::{Demoter, PassError};

/// What a pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PassReport {
    /// Replicas removed (tier, prefix).
    pub removed: Vec<(String, String)>,
    /// Replicas copied down first.
    pub copied_down: Vec<String>,
    /// Steps left for a later pass (a job asked for the replica meanwhile, or the catalogue
    /// did not withdraw its readiness in time).
    pub deferred: usize,
    /// A node's replicas kept although their tier is over its watermark or they are idle:
    /// no shared tier holds a verified copy of them (a node's demoter copies nothing down).
    pub kept_last_copies: usize,
}

/// The pauses before a pass that stopped on a passing failure is tried again: from half a
/// second, doubling up to 30 s (and never longer than `check_every`).
const RETRY_PASS: RetrySchedule =
    RetrySchedule::exponential(Duration::from_millis(500), Duration::from_secs(30));
/// Whether the steps handed to [`Demoter::carry_all`] are recorded already (taken up after a
/// crash or an earlier pass) or begin now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Begun {
    Already,
    Now,
}

impl PassReport {
    /// Adds what another part of the pass did.
    fn absorb(&mut self, other: PassReport) {
        self.removed.extend(other.removed);
        self.copied_down.extend(other.copied_down);
        self.deferred += other.deferred;
        self.kept_last_copies += other.kept_last_copies;
    }
}

impl Demoter {
    /// The policy clock: a pass at once (which takes up the steps a crash interrupted), then
    /// one every `check_every` and whenever a fact asks. A failing state store stops the
    /// service; anything else waits for the next pass.
    pub async fn clock(self) -> Result<(), PassError> {
        let every = self.p().demotion.check_every;
        // After a pass that stopped on a passing failure (the catalogue slow to answer, a
        // tier briefly away), the next one comes after a pause of RETRY_PASS: the facts that
        // asked for it were taken, and none may follow.
        let mut failed_passes = 0;
        loop {
            let mut wait = every;
            match self.pass().await {
                Ok(report) => {
                    failed_passes = 0;
                    if report != PassReport::default() {
                        info!(
                            removed = report.removed.len(),
                            copied_down = report.copied_down.len(),
                            deferred = report.deferred,
                            kept_last_copies = report.kept_last_copies,
                            "demotion pass"
                        );
                    }
                }
                Err(e) if e.is_retryable() => {
                    failed_passes += 1;
                    let pause = RETRY_PASS.delay(failed_passes).min(every);
                    wait = pause;
                    warn!(error = %e, ?pause, "demotion pass stopped; trying again")
                }
                Err(e) => return Err(e),
            }
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = self.inner.wake.notified() => {}
                _ = self.p().shutdown.cancelled() => return Ok(()),
            }
        }
    }

    /// One pass: unfinished steps first, then every hot posix tier (a node's demoter: every
    /// `local` posix tier, its node's replicas on it); each tier's chosen
    /// replicas are demoted `max_concurrent` at a time.
    pub async fn pass(&self) -> Result<PassReport, PassError> {
        let mut report = PassReport::default();
        let unfinished = self.p().state.steps()?;
        self.carry_all(unfinished, Begun::Already, &mut report)
            .await?;
        let now = OffsetDateTime::now_utc();
        let rules = Rules {
            idle_after: self.p().demotion.idle_after,
            expire_after: self
                .p()
                .policies
                .retention()
                .map(|r| r.expiry.unstaged_replica_after),
        };
        let tiers: Vec<TierPolicy> = self
            .p()
            .policies
            .tiers()
            .values()
            .filter(|t| t.role == self.demoted_role())
            .filter(|t| matches!(t.kind, stagehand_policy::TierKind::Posix { .. }))
            .cloned()
            .collect();
        for tier in tiers {
            if !self.p().tiers.contains_key(&tier.name) {
                continue;
            }
            let Some(survey) = survey_on_node(
                &self.p().catalogue,
                &self.p().policies,
                &tier,
                self.p().node.as_deref(),
            )
            .await?
            else {
                continue;
            };
            record_fill(&survey);
            let candidates: Vec<Candidate> = survey
                .replicas
                .iter()
                .map(|(p, h)| Candidate {
                    project: p.project.clone(),
                    bytes: p.bytes,
                    last_used: h
                        .last_staged
                        .or(p.made_at)
                        .unwrap_or(OffsetDateTime::UNIX_EPOCH),
                    held: !h.live_jobs.is_empty() || self.kept_as_last_copy(p),
                })
                .collect();
            let last_copies: Vec<&str> = (survey.replicas.iter())
                .filter(|(p, _)| self.kept_as_last_copy(p))
                .map(|(p, _)| p.prefix.as_str())
                .collect();
            if !last_copies.is_empty() {
                warn!(tier = %tier.name, node = self.p().node.as_deref().unwrap_or("-"), replicas = ?last_copies, "kept: no shared tier holds a verified copy of these, and a node's demoter copies nothing down (its user states nothing about a shared tier); repair or stage the version onto a shared tier to let them go");
                report.kept_last_copies += last_copies.len();
            }
            // A step left unfinished (its readiness not withdrawn in time) keeps its replica:
            // the next pass takes it up at its phase, never begins it afresh.
            let unfinished: HashSet<(String, String)> = self
                .p()
                .state
                .steps()?
                .into_iter()
                .map(|s| (s.tier, s.prefix))
                .collect();
            let mut steps = Vec::new();
            for (i, reason) in plan::choose(&survey.usage, &survey.limits, &candidates, &rules, now)
            {
                let placed = &survey.replicas[i].0;
                if !unfinished.contains(&(tier.name.clone(), placed.prefix.clone())) {
                    steps.push(self.plan_step(&tier.name, placed, reason, &survey.limits, &rules));
                }
            }
            self.carry_all(steps, Begun::Now, &mut report).await?;
        }
        self.checkpoints(&mut report).await?;
        Ok(report)
    }

    /// Whether `placed` stays whatever its tier's fill: on a node's demoter, a replica no
    /// shared tier holds a verified copy of. A node-local replica is a copy of a shared one,
    /// so this is a copy whose shared ones were all lost since; copying it down would be a
    /// fact about a shared tier, which a node's user may not state (deploy/README.md, *Adding
    /// a node*), and removing it would lose the version.
    fn kept_as_last_copy(&self, placed: &Placed) -> bool {
        self.p().node.is_some() && !placed.shared_elsewhere
    }

    /// The role of the tiers this demoter keeps under their watermarks: `local` for a node's
    /// demoter, `hot` for the shared one.
    fn demoted_role(&self) -> TierRole {
        match self.p().node {
            Some(_) => TierRole::Local,
            None => TierRole::Hot,
        }
    }

    /// Carries `steps` `max_concurrent` at a time, in the order given. After a step fails no
    /// further step begins (those under way go to their end), and the first failure is
    /// returned: the next pass takes the failed step up again.
    async fn carry_all(
        &self,
        steps: Vec<Step>,
        begun: Begun,
        report: &mut PassReport,
    ) -> Result<(), PassError> {
        let at_once = self.p().demotion.max_concurrent.max(1) as usize;
        let mut waiting = steps.into_iter();
        let mut running = futures::stream::FuturesUnordered::new();
        let mut first_error = None;
        loop {
            while first_error.is_none() && running.len() < at_once {
                match waiting.next() {
                    Some(step) => running.push(self.carry_one(step, begun)),
                    None => break,
                }
            }
            match running.next().await {
                Some(Ok(done)) => report.absorb(done),
                Some(Err(e)) => {
                    first_error.get_or_insert(e);
                }
                None => break,
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// One step of [`Demoter::carry_all`]: a new one is recorded before its first effect.
    async fn carry_one(&self, step: Step, begun: Begun) -> Result<PassReport, PassError> {
        if begun == Begun::Now {
            self.p().state.record(&step).await?;
            info!(tier = %step.tier, prefix = %step.prefix, reason = %step.reason, copy_down = step.copy_to.is_some(), "demoting");
        }
        let mut done = PassReport::default();
        self.carry(step, &mut done).await?;
        Ok(done)
    }

    /// The step that demotes `placed` from `tier` for `reason` (not recorded yet).
    fn plan_step(
        &self,
        tier: &str,
        placed: &Placed,
        reason: Reason,
        limits: &TierLimits,
        rules: &Rules,
    ) -> Step {
        let begun_at = OffsetDateTime::now_utc();
        let stamp = begun_at.unix_timestamp_nanos().to_string();
        Step {
            id: EventId::for_content(&[
                b"demote",
                tier.as_bytes(),
                placed.prefix.as_bytes(),
                placed.version.as_bytes(),
                stamp.as_bytes(),
            ]),
            project: placed.project.clone(),
            dataset: placed.dataset.clone(),
            version: placed.version.clone(),
            tier: tier.to_owned(),
            prefix: placed.prefix.clone(),
            files: placed.files,
            bytes: placed.bytes,
            reason: reason.describe(tier, limits, rules),
            // A node's demoter removes only what a shared tier holds (`kept_as_last_copy`).
            copy_to: (self.p().node.is_none() && !placed.durable_elsewhere)
                .then(|| self.p().demotion.target.clone()),
            phase: Phase::Planned,
            begun_at,
            checkpoint: None,
            verified_by: placed.verified_by.clone(),
            node: self.p().node.clone(),
        }
    }
}

/// Sets the surveyed tier's fill in the work metrics (`stagehand_tier_*`): its capacity,
/// Stagehand's bytes, the bytes counted against the watermarks, the bytes live stages hold,
/// and per project its bytes and quota (projects with a quota on the tier are listed even
/// with nothing on it, so their quota shows).
fn record_fill(survey: &TierSurvey) {
    let mut projects: std::collections::BTreeMap<String, u64> = survey
        .per_project()
        .into_iter()
        .map(|(project, (placed, _))| (project, placed))
        .collect();
    for project in survey.limits.quotas.keys() {
        projects.entry(project.clone()).or_default();
    }
    stagehand_telemetry::work::tier_fill(&stagehand_telemetry::work::TierFill {
        tier: survey.tier.clone(),
        capacity: survey.usage.capacity,
        used: survey.usage.placed,
        counted: survey.usage.counted(),
        held: survey.held_bytes(),
        high_watermark: survey.limits.high_watermark,
        projects: projects
            .into_iter()
            .map(|(project, used)| {
                let quota = survey.limits.quota_for(&project);
                (project, used, quota)
            })
            .collect(),
    });
}
