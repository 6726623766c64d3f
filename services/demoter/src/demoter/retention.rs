//! Checkpoint retention: the decisions for every noted run carried out — a checkpoint
//! demoted or expired, its folder kept whole while anything else is in it.

use std::collections::HashSet;

use stagehand_manifest::Manifest;
use stagehand_manifest::{ManifestSource, Spool};
use stagehand_mover::{CopyOptions, Priority, Progress, SetCopy, Tier};
use stagehand_policy::TierRole;
use stagehand_policy::retention::{CommittedCheckpoint, Placement};
use stagehand_schemas::{
    Body, CheckpointCommitted, CheckpointDemoted, CheckpointHeld, Event, EventId, Location,
    folders_overlap,
};
use time::OffsetDateTime;
use tracing::{info, warn};

use crate::state::{CheckpointNote, CheckpointPlace, CheckpointStep, Phase, Step};

use super::{COPY_DOWN_VERIFY, Demoter, PassError, PassReport, step_err};

/// The mover's class for checkpoint demotions: never starved by bulk stages.
pub const CHECKPOINT_PRIORITY: Priority = Priority::Checkpoint;

impl Demoter {
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
    pub(super) async fn checkpoints(&self, report: &mut PassReport) -> Result<(), PassError> {
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

    /// Copies a checkpoint (its inline file list) to `target` at the checkpoint class, proven
    /// by reading it back, and announces it with `checkpoint.demoted` and the rule.
    pub(super) async fn demote_checkpoint(
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
    pub(super) async fn held(
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
}
