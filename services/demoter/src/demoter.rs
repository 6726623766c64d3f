//! The demoter's work: a pass over every hot posix tier — survey, choose, demote — and the
//! recorded steps that carry one replica off a tier safely.
//!
//! One demotion is one [`Step`] in the state store, advanced phase by phase, each phase
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

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::kv;
use futures::{StreamExt, TryStreamExt};
use stagehand_bus::placement;
use stagehand_bus::{Bus, CancellationToken, HandlerError};
use stagehand_catalogue::{Catalogue, CatalogueError, ReadinessKey, kv_key};
use stagehand_manifest::Manifest;
use stagehand_manifest::{ManifestBuilder, ManifestSource, Spool};
use stagehand_mover::{CopyOptions, Mover, Priority, Progress, SetCopy, Tier, VerifyMode};
use stagehand_policy::retention::{CommittedCheckpoint, Placement};
use stagehand_policy::{DemotionPolicy, Policies, TierLimits, TierPolicy, TierRole};
use stagehand_schemas::{
    Body, CheckpointCommitted, CheckpointDemoted, CheckpointExpired, CheckpointHeld, Event,
    EventId, Location, ReplicaCreated, ReplicaRemoved, folders_overlap,
};
use time::OffsetDateTime;
use tokio::sync::Notify;
use tracing::{info, warn};

use crate::STOP_BEFORE_RENAME_ENV;
use crate::plan::{self, Candidate, FsUsage, Reason, Rules, TierUsage};
use crate::state::{CheckpointNote, CheckpointPlace, CheckpointStep, Phase, State, Step};
use crate::view::{self, Holds, Placed};

/// How the copy down is proven: read back before it is published, since it is about to become
/// the only copy on a durable tier.
pub const COPY_DOWN_VERIFY: VerifyMode = VerifyMode::ReadBack;

/// The mover's class for demotion copies: the background one.
pub const COPY_DOWN_PRIORITY: Priority = Priority::Backup;

/// The mover's class for checkpoint demotions: never starved by bulk stages.
pub const CHECKPOINT_PRIORITY: Priority = Priority::Checkpoint;

/// How long a step waits for the catalogue to withdraw a replica's readiness before it is left
/// for the next pass.
const WITHDRAW_WAIT: Duration = Duration::from_secs(30);

/// Questions about holds a survey has in flight at once: one per replica, each a round trip
/// to the catalogue, so a tier of many replicas is surveyed in a few round trips' time.
const SURVEY_QUESTIONS_AT_ONCE: usize = 16;

/// The hidden name a removed replica's folder gets before its bytes are deleted.
pub fn removed_name(prefix: &str) -> String {
    match prefix.rsplit_once('/') {
        Some((parent, name)) => format!("{parent}/.{name}.stagehand-removed"),
        None => format!(".{prefix}.stagehand-removed"),
    }
}

/// What a survey of one bounded tier found.
#[derive(Debug, Clone)]
pub struct TierSurvey {
    pub tier: String,
    pub role: TierRole,
    pub limits: TierLimits,
    pub usage: TierUsage,
    /// Every replica present on the tier and what holds it.
    pub replicas: Vec<(Placed, Holds)>,
}

impl TierSurvey {
    /// Bytes of replicas a live stage holds.
    pub fn held_bytes(&self) -> u64 {
        self.replicas
            .iter()
            .filter(|(_, h)| !h.live_jobs.is_empty())
            .map(|(p, _)| p.bytes)
            .sum()
    }

    /// Per project: bytes placed and bytes held.
    pub fn per_project(&self) -> std::collections::BTreeMap<String, (u64, u64)> {
        let mut out = std::collections::BTreeMap::<String, (u64, u64)>::new();
        for (p, h) in &self.replicas {
            let e = out.entry(p.project.clone()).or_default();
            e.0 += p.bytes;
            if !h.live_jobs.is_empty() {
                e.1 += p.bytes;
            }
        }
        out
    }

    /// Sets the tier's fill in the work metrics ([`stagehand_telemetry::work::tier_fill`]):
    /// capacity, Stagehand's bytes, the bytes counted against the watermarks, the bytes live
    /// stages hold, and per project its bytes and quota (projects with a quota on the tier are
    /// listed even with nothing on it, so their quota shows).
    pub fn record_fill(&self) {
        let mut projects: std::collections::BTreeMap<String, u64> = self
            .per_project()
            .into_iter()
            .map(|(project, (placed, _))| (project, placed))
            .collect();
        for project in self.limits.quotas.keys() {
            projects.entry(project.clone()).or_default();
        }
        stagehand_telemetry::work::tier_fill(&stagehand_telemetry::work::TierFill {
            tier: self.tier.clone(),
            capacity: self.usage.capacity,
            used: self.usage.placed,
            counted: self.usage.counted(),
            held: self.held_bytes(),
            high_watermark: self.limits.high_watermark,
            projects: projects
                .into_iter()
                .map(|(project, used)| {
                    let quota = self.limits.quota_for(&project);
                    (project, used, quota)
                })
                .collect(),
        });
    }
}

/// The durable tiers: where a verified copy lets a replica above it go.
pub fn durable_tiers(policies: &Policies) -> HashSet<String> {
    policies
        .tiers()
        .values()
        .filter(|t| matches!(t.role, TierRole::Capacity | TierRole::Backup))
        .map(|t| t.name.clone())
        .collect()
}

/// Surveys one bounded shared tier: the catalogue's replicas on it, their holds, and `statfs`
/// of a posix tier's root.
pub async fn survey(
    catalogue: &Catalogue,
    policies: &Policies,
    tier: &TierPolicy,
) -> Result<Option<TierSurvey>, CatalogueError> {
    survey_on_node(catalogue, policies, tier, None).await
}

/// [`survey`] of a bounded tier as seen from `node` (`None`: a shared tier): on a node-local
/// tier only that node's replicas count, and `statfs` is of the tier's root on this machine
/// (the node's own disk, where its demoter runs).
pub async fn survey_on_node(
    catalogue: &Catalogue,
    policies: &Policies,
    tier: &TierPolicy,
    node: Option<&str>,
) -> Result<Option<TierSurvey>, CatalogueError> {
    let Some(limits) = tier.limits.clone() else {
        return Ok(None);
    };
    let placed = view::placed_on(catalogue, &tier.name, node, &durable_tiers(policies)).await?;
    let replicas: Vec<(Placed, Holds)> = futures::stream::iter(placed)
        .map(|p| async move {
            let h = view::holds(catalogue, &p, &tier.name, node).await?;
            Ok::<_, CatalogueError>((p, h))
        })
        .buffered(SURVEY_QUESTIONS_AT_ONCE)
        .try_collect()
        .await?;
    let fs = match &tier.kind {
        stagehand_policy::TierKind::Posix { root } => {
            rustix::fs::statvfs(root).ok().map(|s| FsUsage {
                total: s.f_blocks.saturating_mul(s.f_frsize),
                avail: s.f_bavail.saturating_mul(s.f_frsize),
            })
        }
        stagehand_policy::TierKind::S3(_) => None,
    };
    let usage = TierUsage {
        capacity: limits.capacity,
        placed: replicas.iter().map(|(p, _)| p.bytes).sum(),
        fs,
    };
    Ok(Some(TierSurvey {
        tier: tier.name.clone(),
        role: tier.role,
        limits,
        usage,
        replicas,
    }))
}

/// What the demoter needs, built once at start.
pub struct Parts {
    pub bus: Bus,
    pub catalogue: Catalogue,
    pub policies: Policies,
    pub demotion: DemotionPolicy,
    /// Every declared tier that opened.
    pub tiers: HashMap<String, Tier>,
    pub state: State,
    pub mover: Mover,
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

impl PassError {
    pub fn is_retryable(&self) -> bool {
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
}

/// The first pause before a pass that stopped on a passing failure is tried again.
const RETRY_PASS_MIN: Duration = Duration::from_millis(500);
/// The longest such pause (never longer than `check_every`).
const RETRY_PASS_MAX: Duration = Duration::from_secs(30);
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
    }
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

    /// A live (not expired) step of `project` noted before, other than `c` itself, whose
    /// folder overlaps `c`'s ([`folders_overlap`]).
    fn overlapping_note(
        &self,
        project: &str,
        c: &CheckpointCommitted,
    ) -> Result<Option<CheckpointNote>, PassError> {
        Ok(self.p().state.runs()?.into_iter().flatten().find(|n| {
            n.project == project
                && n.place != CheckpointPlace::Expired
                && (n.committed.run.as_str(), n.committed.step) != (c.run.as_str(), c.step)
                && folders_overlap(&n.committed.location.prefix, &c.location.prefix)
        }))
    }

    /// Carries out retention's decisions for every run noted: a checkpoint still where the run
    /// wrote it (a hot posix tier) is demoted to `demote_to` or expired as decided.
    async fn checkpoints(&self, report: &mut PassReport) -> Result<(), PassError> {
        let Some(retention) = self.p().policies.retention().cloned() else {
            return Ok(());
        };
        // Checkpoints are written to shared tiers: the shared demoter's to move.
        if self.p().node.is_some() {
            return Ok(());
        }
        for run in self.p().state.runs()? {
            let committed: Vec<CommittedCheckpoint> = run
                .iter()
                .map(|n| CommittedCheckpoint {
                    step: n.committed.step,
                    tags: n.committed.tags.clone(),
                    committed_at: Some(n.committed_at),
                })
                .collect();
            for decision in retention.checkpoints.decide(&committed) {
                let Some(note) = run.iter().rev().find(|n| n.committed.step == decision.step)
                else {
                    continue;
                };
                let c = &note.committed;
                // Where it is now: where the run wrote it, or the tier it was demoted to (a
                // run that grew since may let an earlier kept checkpoint expire).
                let (tier, demote_to) = match (note.place, &decision.placement) {
                    (CheckpointPlace::Committed, Placement::Hot) => continue,
                    (CheckpointPlace::Committed, Placement::Demote { tier }) => {
                        (c.location.tier.clone(), Some(tier.clone()))
                    }
                    (CheckpointPlace::Committed, Placement::Expire) => {
                        (c.location.tier.clone(), None)
                    }
                    (CheckpointPlace::Demoted, Placement::Expire) => match &note.demoted_to {
                        Some(t) => (t.clone(), None),
                        None => continue,
                    },
                    _ => continue,
                };
                let written_on_hot = self
                    .p()
                    .policies
                    .tiers()
                    .get(&c.location.tier)
                    .is_some_and(|t| t.role == TierRole::Hot);
                if !written_on_hot || !self.p().tiers.contains_key(&tier) {
                    continue;
                }
                // A run's checkpoint lies beneath its project's folder, as everything does (the
                // location rule; its commit was refused otherwise, but this store may be older).
                if let Err(e) =
                    stagehand_schemas::layout::check_location(&note.project, &c.location)
                {
                    warn!(run = %c.run, step = c.step, error = %e, "checkpoint outside its project's folder; not moved");
                    continue;
                }
                if self
                    .p()
                    .state
                    .steps()?
                    .iter()
                    .any(|s| s.tier == tier && s.prefix == c.location.prefix)
                {
                    continue;
                }
                let begun_at = OffsetDateTime::now_utc();
                let rule = decision.rule.to_string();
                let step = Step {
                    id: EventId::for_fact(
                        &note.project,
                        &EventId::for_checkpoint(&note.project, &c.run, c.step),
                        &format!("retention:{tier}"),
                    ),
                    project: note.project.clone(),
                    dataset: c.run.clone(),
                    version: String::new(),
                    tier,
                    prefix: c.location.prefix.clone(),
                    files: c.files.len() as u64,
                    bytes: c.total_bytes,
                    reason: format!("retention: {rule}"),
                    copy_to: demote_to,
                    phase: Phase::Planned,
                    begun_at,
                    checkpoint: Some(CheckpointStep {
                        run: c.run.clone(),
                        step: c.step,
                        rule,
                    }),
                    verified_by: None,
                    node: None,
                };
                self.p().state.record(&step).await?;
                info!(run = %c.run, step = c.step, rule = %step.reason, demote_to = ?step.copy_to, "checkpoint retention");
                self.carry(step, report).await?;
            }
        }
        Ok(())
    }

    /// The policy clock: a pass at once (which takes up the steps a crash interrupted), then
    /// one every `check_every` and whenever a fact asks. A failing state store stops the
    /// service; anything else waits for the next pass.
    pub async fn clock(self) -> Result<(), PassError> {
        let every = self.p().demotion.check_every;
        // After a pass that stopped on a passing failure (the catalogue slow to answer, a
        // tier briefly away), the next one comes after this pause, doubling up to
        // RETRY_PASS_MAX: the facts that asked for it were taken, and none may follow.
        let mut retry_pause: Option<Duration> = None;
        loop {
            let mut wait = every;
            match self.pass().await {
                Ok(report) => {
                    retry_pause = None;
                    if report != PassReport::default() {
                        info!(
                            removed = report.removed.len(),
                            copied_down = report.copied_down.len(),
                            deferred = report.deferred,
                            "demotion pass"
                        );
                    }
                }
                Err(e) if e.is_retryable() => {
                    let pause = retry_pause
                        .map_or(RETRY_PASS_MIN, |p| (p * 2).min(RETRY_PASS_MAX))
                        .min(every);
                    retry_pause = Some(pause);
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
            survey.record_fill();
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
                    held: !h.live_jobs.is_empty(),
                })
                .collect();
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
            copy_to: (!placed.durable_elsewhere).then(|| self.p().demotion.target.clone()),
            phase: Phase::Planned,
            begun_at,
            checkpoint: None,
            verified_by: placed.verified_by.clone(),
            node: self.p().node.clone(),
        }
    }

    /// Records `phase` for `step`, then halts there if the fault seam asks.
    async fn advance(&self, step: &mut Step, phase: Phase) -> Result<(), PassError> {
        step.phase = phase;
        self.p().state.record(step).await?;
        if self.p().halt_after == Some(phase) {
            warn!(prefix = %step.prefix, phase = phase.as_str(), "demoter halted after {} (STAGEHAND_DEMOTER_HALT_AFTER)", phase.as_str());
            std::future::pending::<()>().await;
        }
        Ok(())
    }

    /// Carries one step as far as it goes now.
    async fn carry(&self, mut step: Step, report: &mut PassReport) -> Result<(), PassError> {
        let Some(tier) = self.p().tiers.get(&step.tier).cloned() else {
            return Err(step_err(format!("tier {} is not open", step.tier)));
        };
        let Tier::Posix(posix) = &tier else {
            return Err(step_err(format!("tier {} is not posix", step.tier)));
        };
        // Nothing of a checkpoint's folder goes unless everything in it is the step's own.
        if step.phase == Phase::Planned
            && let Some(c) = step.checkpoint.clone()
            && self.held(&step, &c, posix, &step.prefix).await?
        {
            self.p().state.forget(&step).await?;
            report.deferred += 1;
            return Ok(());
        }
        if step.phase == Phase::Planned {
            if let Some(target) = step.copy_to.clone() {
                match &step.checkpoint {
                    None => self.copy_down(&step, &tier, &target).await?,
                    Some(c) => self.demote_checkpoint(&step, c, &tier, &target).await?,
                }
                report.copied_down.push(step.prefix.clone());
            }
            self.advance(&mut step, Phase::CopiedDown).await?;
        }
        if step.phase == Phase::CopiedDown && !self.take_use(&step, report).await? {
            return Ok(());
        }
        if step.phase == Phase::CopiedDown
            && let Some(c) = step.checkpoint.clone()
        {
            if step.copy_to.is_none() {
                let expired = Event::request(
                    EventId::for_fact(&step.project, &step.id, "expired"),
                    step.project.clone(),
                    Body::CheckpointExpired(CheckpointExpired {
                        run: c.run.clone(),
                        step: c.step,
                        location: Location {
                            tier: step.tier.clone(),
                            prefix: step.prefix.clone(),
                        },
                        rule: c.rule.clone(),
                    }),
                );
                self.p().bus.publish(&expired).await.map_err(step_err)?;
            }
            // A checkpoint has no readiness of its own to withdraw.
            self.advance(&mut step, Phase::Withdrawn).await?;
        }
        if step.phase == Phase::CopiedDown {
            let removed = Event::request(
                EventId::for_fact(&step.project, &step.id, "removed"),
                step.project.clone(),
                Body::ReplicaRemoved(ReplicaRemoved {
                    dataset: step.dataset.clone(),
                    version: step.version.clone(),
                    location: Location {
                        tier: step.tier.clone(),
                        prefix: step.prefix.clone(),
                    },
                    reason: step.reason.clone(),
                    node: step.node.clone(),
                }),
            );
            self.p().bus.publish(&removed).await.map_err(step_err)?;
            if !self.withdrawn(&step).await? {
                warn!(prefix = %step.prefix, "the catalogue has not withdrawn the replica's readiness yet; the next pass goes on");
                report.deferred += 1;
                return Ok(());
            }
            self.advance(&mut step, Phase::Withdrawn).await?;
        }
        let hidden = removed_name(&step.prefix);
        if step.phase == Phase::Withdrawn
            && step.checkpoint.is_none()
            && tier.set_present(&step.prefix).await.map_err(step_err)?
            && self.held_again(&step).await?
        {
            // A job asked while the replica was withdrawn (the promoter may have answered it
            // from the folder, which is still whole): the removal is undone, the replica
            // announced again, and it stays while held.
            let restored = Event::request(
                EventId::for_fact(&step.project, &step.id, &format!("restored:{}", step.tier)),
                step.project.clone(),
                Body::ReplicaCreated(ReplicaCreated {
                    dataset: step.dataset.clone(),
                    version: step.version.clone(),
                    location: Location {
                        tier: step.tier.clone(),
                        prefix: step.prefix.clone(),
                    },
                    files: step.files,
                    total_bytes: step.bytes,
                    verified_by: step
                        .verified_by
                        .clone()
                        .unwrap_or_else(|| COPY_DOWN_VERIFY.as_str().into()),
                    node: step.node.clone(),
                }),
            );
            self.p().bus.publish(&restored).await.map_err(step_err)?;
            // Handed out again; its space was never given back.
            self.stays(
                &step,
                "a job asked for the replica while it was being removed; removal undone",
            )
            .await?;
            report.deferred += 1;
            return Ok(());
        }
        // Looked at again right before the rename: a rank may have written since the copy.
        if step.phase == Phase::Withdrawn
            && let Some(c) = step.checkpoint.clone()
            && self.held(&step, &c, posix, &step.prefix).await?
        {
            self.stays(&step, "the checkpoint's folder holds what is not its own")
                .await?;
            report.deferred += 1;
            return Ok(());
        }
        if step.phase == Phase::Withdrawn {
            if tier.set_present(&step.prefix).await.map_err(step_err)? {
                if tier.set_present(&hidden).await.map_err(step_err)? {
                    // An earlier removal of the same version that never finished.
                    remove_tree(posix, &hidden).await?;
                }
                if self.p().stop_before_rename {
                    warn!(prefix = %step.prefix, "demoter stops itself before the rename ({STOP_BEFORE_RENAME_ENV})");
                    // To this thread (a signal to the process may be taken by another thread
                    // while this one goes on to the rename); the whole process stops.
                    // SAFETY: raise has no preconditions; SIGSTOP cannot be caught.
                    if unsafe { libc::raise(libc::SIGSTOP) } != 0 {
                        return Err(step_err(std::io::Error::last_os_error()));
                    }
                }
                let (p, from, to) = (posix.clone(), step.prefix.clone(), hidden.clone());
                tokio::task::spawn_blocking(move || p.rename_dir_noreplace(&from, &to))
                    .await
                    .map_err(step_err)?
                    .map_err(step_err)?;
            }
            self.advance(&mut step, Phase::Renamed).await?;
        }
        if step.phase == Phase::Renamed {
            // A file written in the instant before the rename (through a handle on the
            // folder) is in the hidden folder: the folder is put back, never deleted with it.
            if let Some(c) = step.checkpoint.clone()
                && tier.set_present(&hidden).await.map_err(step_err)?
                && self.held(&step, &c, posix, &hidden).await?
            {
                let (p, from, to) = (posix.clone(), hidden.clone(), step.prefix.clone());
                let back = tokio::task::spawn_blocking(move || p.rename_dir_noreplace(&from, &to))
                    .await
                    .map_err(step_err)?
                    .map_err(step_err)?;
                if !back {
                    warn!(prefix = %step.prefix, hidden = %hidden, "the checkpoint's folder could not be put back (its name is taken again): it is left whole under its hidden name");
                }
                self.stays(
                    &step,
                    "the checkpoint's folder held what is not its own; put back",
                )
                .await?;
                report.deferred += 1;
                return Ok(());
            }
            if tier.set_present(&hidden).await.map_err(step_err)? {
                remove_tree(posix, &hidden).await?;
            }
            // The folder is gone: its space is free, and a request may stage it afresh.
            let store = &self.p().placement;
            placement::release_removed(store, &step.tier, step.node.as_deref(), &step.prefix)
                .await
                .map_err(step_err)?;
            placement::forget_use(store, &step.tier, step.node.as_deref(), &step.prefix)
                .await
                .map_err(step_err)?;
            if let Some(c) = &step.checkpoint {
                let place = if step.copy_to.is_some() {
                    CheckpointPlace::Demoted
                } else {
                    CheckpointPlace::Expired
                };
                self.p().state.place_checkpoint(
                    &step.project,
                    &c.run,
                    c.step,
                    place,
                    step.copy_to.as_deref(),
                )?;
            }
            self.p().state.forget(&step).await?;
            info!(tier = %step.tier, prefix = %step.prefix, reason = %step.reason, "replica removed");
            report
                .removed
                .push((step.tier.clone(), step.prefix.clone()));
        }
        Ok(())
    }

    /// Takes the replica's use record into `withdrawing` (`stagehand_bus::placement`) before
    /// anything of the removal is visible: read, look at the holds, compare-and-set on what
    /// was read, look at the holds again (those the catalogue lists, and the requests the
    /// record says were served, which it may not have folded yet). `false`: the replica stays
    /// (held, or a request was answered from it meanwhile), and the step is forgotten — the
    /// next pass decides again.
    async fn take_use(&self, step: &Step, report: &mut PassReport) -> Result<bool, PassError> {
        let store = &self.p().placement;
        let seen = placement::read_use(store, &step.tier, step.node.as_deref(), &step.prefix)
            .await
            .map_err(step_err)?;
        // A job may have asked for it since the pass looked.
        if step.checkpoint.is_none() && self.held_again(step).await? {
            self.stays(step, "a job asked for the replica meanwhile")
                .await?;
            report.deferred += 1;
            return Ok(false);
        }
        let Some(taken) = placement::begin_withdraw(
            store,
            &step.tier,
            step.node.as_deref(),
            &step.prefix,
            &seen,
            &step.reason,
        )
        .await
        .map_err(step_err)?
        else {
            info!(prefix = %step.prefix, "a request was answered from the replica meanwhile; the replica stays");
            self.p().state.forget(step).await?;
            report.deferred += 1;
            return Ok(false);
        };
        if (step.checkpoint.is_none() && self.held_again(step).await?)
            || self.served_live(step, &taken.served).await?
        {
            self.stays(step, "a job holds the replica").await?;
            report.deferred += 1;
            return Ok(false);
        }
        Ok(true)
    }

    /// The step is given up and its replica stays: a record an earlier run of this step
    /// took is given back.
    async fn stays(&self, step: &Step, why: &str) -> Result<(), PassError> {
        placement::end_withdraw(
            &self.p().placement,
            &step.tier,
            step.node.as_deref(),
            &step.prefix,
        )
        .await
        .map_err(step_err)?;
        info!(prefix = %step.prefix, "{why}; the replica stays");
        self.p().state.forget(step).await?;
        Ok(())
    }

    /// Whether any of the requests a replica was handed to is live, or not folded by the
    /// catalogue yet (so not known to be released).
    async fn served_live(&self, step: &Step, served: &[String]) -> Result<bool, PassError> {
        for id in served {
            match self.p().catalogue.stage_request(&step.project, id).await {
                Ok(s) => {
                    if s.holds_at(OffsetDateTime::now_utc()) {
                        return Ok(true);
                    }
                }
                Err(e) if e.is_not_found() => return Ok(true),
                Err(e) => return Err(e.into()),
            }
        }
        Ok(false)
    }

    /// Whether a live stage holds the step's replica now.
    async fn held_again(&self, step: &Step) -> Result<bool, PassError> {
        let placed = Placed {
            project: step.project.clone(),
            dataset: step.dataset.clone(),
            version: step.version.clone(),
            prefix: step.prefix.clone(),
            files: step.files,
            bytes: step.bytes,
            made_at: None,
            durable_elsewhere: true,
            verified_by: None,
        };
        let holds = view::holds(
            &self.p().catalogue,
            &placed,
            &step.tier,
            step.node.as_deref(),
        )
        .await?;
        Ok(!holds.live_jobs.is_empty())
    }

    /// Copies a checkpoint (its inline file list) to `target` at the checkpoint class, proven
    /// by reading it back, and announces it with `checkpoint.demoted` and the rule.
    async fn demote_checkpoint(
        &self,
        step: &Step,
        c: &CheckpointStep,
        src: &Tier,
        target: &str,
    ) -> Result<(), PassError> {
        let Some(dst) = self.p().tiers.get(target) else {
            return Err(step_err(format!("target tier {target} is not open")));
        };
        let manifest = self.checkpoint_manifest(step, c).await?;
        let set = SetCopy {
            src_prefix: step.prefix.clone(),
            dst_prefix: step.prefix.clone(),
            opts: CopyOptions {
                priority: CHECKPOINT_PRIORITY,
                trust_recorded_hash: false,
                verify_destination: COPY_DOWN_VERIFY,
                expected_hash_unknown: false,
            },
            chunk_files: 0,
            totals: Some((manifest.files(), manifest.bytes())),
        };
        self.copy_checkpoint(step, c, src, dst, &set, &manifest)
            .await?;
        let demoted = Event::request(
            EventId::for_fact(&step.project, &step.id, &format!("demoted:{target}")),
            step.project.clone(),
            Body::CheckpointDemoted(CheckpointDemoted {
                run: c.run.clone(),
                step: c.step,
                from: Location {
                    tier: step.tier.clone(),
                    prefix: step.prefix.clone(),
                },
                to: Location {
                    tier: target.to_owned(),
                    prefix: step.prefix.clone(),
                },
                total_bytes: step.bytes,
                rule: Some(c.rule.clone()),
            }),
        );
        self.p().bus.publish(&demoted).await.map_err(step_err)?;
        info!(run = %c.run, step = c.step, target, "checkpoint demoted and verified");
        Ok(())
    }

    /// The set copy of a checkpoint's listed files, published on `dst` (a set already there
    /// counts only once every file of it verified; otherwise it is replaced).
    async fn copy_checkpoint(
        &self,
        c_step: &Step,
        c: &CheckpointStep,
        src: &Tier,
        dst: &Tier,
        set: &SetCopy,
        manifest: &Manifest,
    ) -> Result<(), PassError> {
        let progress = Progress::new();
        let cancel = self.p().shutdown.child_token();
        // A list that ends early is caught before anything is published.
        let (files, listed) = manifest.file_stream(4096);
        let staged = self
            .p()
            .mover
            .stage_set(src, dst, set, files, &progress, &cancel, |_| {})
            .await
            .map_err(step_err)?;
        if let Some(e) = listed.take_error() {
            return Err(step_err(format!(
                "reading the file list of checkpoint {} step {} ({}): {e}",
                c.run, c.step, c_step.prefix
            )));
        }
        staged.publish().await.map_err(step_err)?;
        Ok(())
    }

    /// Whether the checkpoint's folder `folder` (its own, or its hidden name after the rename)
    /// must stay: another live step's folder overlaps it, or it holds files its commit does
    /// not list (a rank that wrote after the commit). Then `checkpoint.held` says so (its id
    /// follows from what was found, so a pass finding the same says it once) and nothing of
    /// the folder is removed.
    async fn held(
        &self,
        step: &Step,
        c: &CheckpointStep,
        posix: &stagehand_mover::PosixTier,
        folder: &str,
    ) -> Result<bool, PassError> {
        let decision = match &step.copy_to {
            Some(t) => format!("demote to {t} ({})", c.rule),
            None => format!("expire ({})", c.rule),
        };
        let note = self.note_of(step, c)?;
        // The steps the catalogue holds (in stream order, the recorder's) and those noted
        // here: a folder overlapping either's is not removed.
        let cataloguer = self
            .p()
            .catalogue
            .checkpoints_overlapping(&step.project, &note.committed.location.prefix)
            .await?
            .into_iter()
            .find(|r| (r.run.as_str(), r.step) != (c.run.as_str(), c.step))
            .map(|r| (r.run, r.step, r.location.prefix));
        let noted = self
            .overlapping_note(&step.project, &note.committed)?
            .map(|n| {
                (
                    n.committed.run,
                    n.committed.step,
                    n.committed.location.prefix,
                )
            });
        let (reason, unlisted, total) = if let Some((run, other, prefix)) = cataloguer.or(noted) {
            let reason = format!(
                "the folder overlaps the folder of run {run} step {other} ({prefix}): it is left \
                 whole, so that the other step's files are never removed with it"
            );
            (reason, Vec::new(), 0)
        } else {
            let manifest = self.checkpoint_manifest(step, c).await?;
            let (p, rel) = (posix.clone(), folder.to_owned());
            let mut unlisted = tokio::task::spawn_blocking(move || {
                let Some(found) = p.list_files(&rel).map_err(step_err)? else {
                    return Ok(Vec::new());
                };
                let mut found: HashSet<String> = found.into_iter().collect();
                for f in manifest.entries() {
                    found.remove(&f.map_err(step_err)?.path);
                }
                Ok::<_, PassError>(found.into_iter().collect::<Vec<_>>())
            })
            .await
            .map_err(step_err)??;
            if unlisted.is_empty() {
                return Ok(false);
            }
            unlisted.sort();
            let total = unlisted.len() as u64;
            unlisted.truncate(CheckpointHeld::MAX_LISTED);
            let reason = format!(
                "the folder holds {total} file(s) its commit does not list (written after the \
                 commit?): it is left whole; move or delete them (or commit them as a step of \
                 their own elsewhere), and the next pass carries the decision out"
            );
            (reason, unlisted, total)
        };
        let what = format!("{reason}|{}", unlisted.join("\n"));
        let held = Event::request(
            EventId::for_fact(
                &step.project,
                &EventId::for_checkpoint(&step.project, &c.run, c.step),
                &format!(
                    "held:{}:{}",
                    step.tier,
                    EventId::for_content(&[what.as_bytes()])
                ),
            ),
            step.project.clone(),
            Body::CheckpointHeld(CheckpointHeld {
                run: c.run.clone(),
                step: c.step,
                location: Location {
                    tier: step.tier.clone(),
                    prefix: step.prefix.clone(),
                },
                decision: decision.clone(),
                reason: reason.clone(),
                unlisted: unlisted.clone(),
                unlisted_total: total,
            }),
        );
        self.p().bus.publish(&held).await.map_err(step_err)?;
        tracing::error!(run = %c.run, step = c.step, tier = %step.tier, prefix = %step.prefix, %decision, %reason, unlisted = ?unlisted, "checkpoint held: its folder is left whole");
        Ok(true)
    }

    /// The noted commit of a checkpoint step.
    fn note_of(&self, step: &Step, c: &CheckpointStep) -> Result<CheckpointNote, PassError> {
        self.p()
            .state
            .runs()?
            .into_iter()
            .flatten()
            .find(|n| {
                n.project == step.project && n.committed.run == c.run && n.committed.step == c.step
            })
            .ok_or_else(|| step_err(format!("checkpoint {} step {} is not noted", c.run, c.step)))
    }

    /// A checkpoint's file list: inline in its commit, or by reference in the project's upload
    /// bucket (where `stagehand checkpoint commit` puts a large one), fetched and verified.
    async fn checkpoint_manifest(
        &self,
        step: &Step,
        c: &CheckpointStep,
    ) -> Result<Manifest, PassError> {
        let note = self.note_of(step, c)?;
        // Its file list: inline, or by reference in the project's upload bucket (where
        // `stagehand checkpoint commit` puts a large one), fetched and verified first.
        let committed = &note.committed;
        let source = match &committed.manifest {
            None => ManifestSource::Inline(committed.files.clone()),
            Some(reference) => ManifestSource::Stored {
                bucket: stagehand_schemas::subject::manifest_bucket_for(
                    &Body::CheckpointCommitted(committed.clone()),
                    &step.project,
                ),
                reference: reference.clone(),
            },
        };
        let spool = Spool::in_dir(self.p().spool_dir.clone());
        source
            .open(self.p().bus.jetstream(), &spool)
            .await
            .map_err(|e| {
                step_err(format!(
                    "the file list of checkpoint {} step {}: {e}",
                    c.run, c.step
                ))
            })
    }

    /// Copies the replica to `target`, proven by reading it back, and announces it with
    /// `replica.created`. A set already there counts as the copy only once every file of it
    /// verified against the version's list (hashes, not names); otherwise the mover replaces
    /// it with a verified copy in one atomic publish ([`Mover::stage_set`]).
    async fn copy_down(&self, step: &Step, src: &Tier, target: &str) -> Result<(), PassError> {
        let Some(dst) = self.p().tiers.get(target) else {
            return Err(step_err(format!("target tier {target} is not open")));
        };
        let spool = Spool::in_dir(self.p().spool_dir.clone());
        let mut builder = ManifestBuilder::new(&spool);
        let pages = self.p().catalogue.all_files(
            Some(step.project.clone()),
            step.dataset.clone(),
            step.version.clone(),
            stagehand_catalogue::MAX_PAGE,
            None,
        );
        let mut pages = std::pin::pin!(pages);
        while let Some(file) = pages.next().await {
            builder.push(&file?).map_err(step_err)?;
        }
        let manifest = builder.finish().map_err(step_err)?;
        // A list that is not the version's whole list would publish part of it.
        if manifest.digest() != step.version {
            return Err(step_err(format!(
                "the catalogue's file list of {} hashes to {}: not copying it down",
                step.prefix,
                manifest.digest()
            )));
        }
        // A list that ends early is caught below, before anything is published.
        let (files, listed) = manifest.file_stream(4096);
        let set = SetCopy {
            src_prefix: step.prefix.clone(),
            dst_prefix: step.prefix.clone(),
            opts: CopyOptions {
                priority: COPY_DOWN_PRIORITY,
                trust_recorded_hash: false,
                verify_destination: COPY_DOWN_VERIFY,
                expected_hash_unknown: false,
            },
            chunk_files: 0,
            totals: Some((manifest.files(), manifest.bytes())),
        };
        let progress = Progress::new();
        let cancel = self.p().shutdown.child_token();
        let staged = self
            .p()
            .mover
            .stage_set(src, dst, &set, files, &progress, &cancel, |_| {})
            .await
            .map_err(step_err)?;
        if let Some(e) = listed.take_error() {
            return Err(step_err(format!(
                "reading the file list of {}: {e}",
                step.prefix
            )));
        }
        staged.publish().await.map_err(step_err)?;
        let created = Event::request(
            EventId::for_fact(&step.project, &step.id, &format!("replica:{target}")),
            step.project.clone(),
            Body::ReplicaCreated(ReplicaCreated {
                dataset: step.dataset.clone(),
                version: step.version.clone(),
                location: Location {
                    tier: target.to_owned(),
                    prefix: step.prefix.clone(),
                },
                files: step.files,
                total_bytes: step.bytes,
                verified_by: COPY_DOWN_VERIFY.as_str().into(),
                node: None,
            }),
        );
        self.p().bus.publish(&created).await.map_err(step_err)?;
        info!(prefix = %step.prefix, target, "copied down and verified");
        Ok(())
    }

    /// Waits (bounded) until the readiness key of the step's replica is absent or not ready.
    async fn withdrawn(&self, step: &Step) -> Result<bool, PassError> {
        let key = kv_key(&ReadinessKey {
            project: step.project.clone(),
            dataset: step.dataset.clone(),
            version: step.version.clone(),
            tier: step.tier.clone(),
            node: step.node.clone(),
        });
        let not_ready = |e: &kv::Entry| {
            e.operation != kv::Operation::Put
                || serde_json::from_slice::<serde_json::Value>(&e.value)
                    .ok()
                    .and_then(|v| v.get("ready").and_then(|r| r.as_bool()))
                    != Some(true)
        };
        let bucket = &self.p().readiness;
        let mut watch = bucket.watch_with_history(&key).await.map_err(step_err)?;
        match bucket.entry(&key).await.map_err(step_err)? {
            None => return Ok(true),
            Some(e) if not_ready(&e) => return Ok(true),
            Some(_) => {}
        }
        let waited = tokio::time::timeout(WITHDRAW_WAIT, async {
            while let Some(e) = watch.next().await {
                match e {
                    Ok(e) if not_ready(&e) => return true,
                    Ok(_) => {}
                    Err(e) => {
                        warn!(error = %e, "watching readiness");
                        return false;
                    }
                }
            }
            false
        })
        .await;
        Ok(waited.unwrap_or(false))
    }
}

/// Removes a folder beneath a posix tier, confined, off the async threads.
async fn remove_tree(posix: &stagehand_mover::PosixTier, rel: &str) -> Result<(), PassError> {
    let (p, rel) = (posix.clone(), rel.to_owned());
    tokio::task::spawn_blocking(move || p.remove_tree(&rel))
        .await
        .map_err(step_err)?
        .map_err(step_err)?;
    Ok(())
}

impl From<PassError> for HandlerError {
    fn from(e: PassError) -> Self {
        HandlerError::retryable(e.to_string())
    }
}
