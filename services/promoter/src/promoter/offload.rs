//! Checkpoint parts offloaded off the node (a node agent only): a training job commits its
//! node's part of a step on the node's local tier (`checkpoint.part.committed`); this node's
//! agent copies it, at the checkpoint priority, verified as `[offload] verify` says (hashed in
//! flight as shipped; the copy is read back before the part leaves its node: `leave_node`),
//! published by one rename, to the offload tier of `retention.toml` (`[offload] tier`) under
//! the same part folder, and states
//! `checkpoint.part.offloaded`. The shared promoter answers each `checkpoint.part.offloaded`
//! once (its `steps` worker, on one consumer its instances share): once the catalogue shows
//! that part offloaded, and every part of its step too, the step's `checkpoint.committed` is
//! published — all parts' files under the step's folder on the offload tier, each part a
//! subfolder — which makes it the run's latest. Its id is the step's
//! (`EventId::for_checkpoint`) and its content follows from the catalogue's records alone, so
//! two answers that both publish it (a redelivery, two offloads answered at once) store it
//! once. Not every node's agent: a step of N parts would cost N² catalogue questions.
//!
//! Why no part is missed: an offload is answered only once the catalogue has folded it, so
//! whichever offload the catalogue folds last is answered seeing every part offloaded,
//! whatever order the stream or the recorder took them in.

use futures::stream;
use stagehand_bus::{HandlerError, WorkContext};
use stagehand_catalogue::{CheckpointPartRecord, StepParts, checkpoint_dataset};
use stagehand_mover::{
    Change, CopyOptions, ErrorKind, Fingerprint, Priority, Progress, SetCopy, Side, Tier,
    TransferError,
};
use stagehand_policy::{CheckpointOffload, TierRole};
use stagehand_schemas::{
    Body, CheckpointCommitted, CheckpointPartCommitted, CheckpointPartOffloaded, Event, EventId,
    FileRef, INLINE_MANIFEST_MAX_BYTES, Location, Retryable, layout,
};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::{Promoter, retry};
use crate::kv::{LeaseState, Refused};

/// The fact-id step of a part's `checkpoint.part.offloaded`.
pub const STEP_OFFLOADED: &str = "offloaded";

fn refuse(why: String) -> HandlerError {
    HandlerError::permanent(why)
}

impl Promoter {
    /// A checkpoint part fact: a commit on this node's local tier is offloaded (a node
    /// agent); an offload (of any node) may complete its step (the shared promoter); a step's
    /// commit sends this node's parts of it off the node (`leave_node`, a node agent).
    pub async fn on_part(
        &self,
        event: &Event,
        ctx: Option<&WorkContext>,
    ) -> Result<Vec<Event>, HandlerError> {
        match &event.body {
            Body::CheckpointPartCommitted(p) if Some(p.node.as_str()) == self.node() => {
                Ok(vec![self.offload(event, p, ctx).await?])
            }
            Body::CheckpointPartOffloaded(p) => self.complete_step(event, p).await,
            Body::CheckpointCommitted(c) => self.parts_leave_node(event, c).await,
            _ => Ok(Vec::new()),
        }
    }

    /// `retention.toml`'s `[offload]`: the offload tier and how a copy onto it is proven.
    fn offload_policy(&self) -> Result<&CheckpointOffload, HandlerError> {
        self.p()
            .policies
            .retention()
            .and_then(|r| r.offload.as_ref())
            .ok_or_else(|| {
                retry(
                    "retention.toml has no [offload] table: checkpoint parts on node-local \
                     tiers are not offloaded",
                )
            })
    }

    /// Refuses a part that is not exactly its step's part folder on a local tier: a tenant
    /// names its own project's folder (the consumer checked that), and here nothing but the
    /// one folder the layout gives that part, on this node's own local tier.
    fn check_part(&self, event: &Event, p: &CheckpointPartCommitted) -> Result<(), HandlerError> {
        let what = || {
            format!(
                "checkpoint part {} of step {} of run {}",
                p.part, p.step, p.run
            )
        };
        if p.parts == 0 || p.parts > layout::MAX_CHECKPOINT_PARTS || p.part >= p.parts {
            return Err(refuse(format!(
                "{}: part {} of {} parts is not a part (parts 1-{}, part below parts)",
                what(),
                p.part,
                p.parts,
                layout::MAX_CHECKPOINT_PARTS
            )));
        }
        if !p.files.is_empty() && !p.stamps.is_empty() {
            return Err(refuse(format!(
                "{}: lists its files twice, hashed (`files`) and stamped (`stamps`); a part \
                 lists them one way; nothing copied",
                what()
            )));
        }
        let local = self
            .tier_policy(&p.location.tier)
            .is_some_and(|t| t.role == TierRole::Local);
        if !local {
            return Err(refuse(format!(
                "{}: tier {:?} is not a node-local tier; a part is offloaded from its node's \
                 local tier only",
                what(),
                p.location.tier
            )));
        }
        layout::check_dataset_name(&checkpoint_dataset(&p.run))
            .map_err(|e| refuse(format!("{}: run: {e}", what())))?;
        let folder = layout::checkpoint_part_folder(
            &event.project,
            &checkpoint_dataset(&p.run),
            p.step,
            p.part,
        );
        if p.location.prefix != folder {
            return Err(refuse(format!(
                "{}: folder {:?} is not the part's folder {folder:?}; nothing copied",
                what(),
                p.location.prefix
            )));
        }
        Ok(())
    }

    /// Copies the part to the offload tier under the same folder, verified, and states it.
    /// Again (a redelivery): the set found published is verified in place, nothing copied.
    async fn offload(
        &self,
        event: &Event,
        p: &CheckpointPartCommitted,
        ctx: Option<&WorkContext>,
    ) -> Result<Event, HandlerError> {
        self.check_part(event, p)?;
        let policy = self.offload_policy()?;
        let (to_tier, verify) = (policy.tier.clone(), policy.verify);
        let (Some(src), Some(dst)) = (
            self.p().tiers.get(&p.location.tier),
            self.p().tiers.get(&to_tier),
        ) else {
            return Err(retry(format!(
                "tier {:?} or {to_tier:?} is not open on node {}",
                p.location.tier,
                self.node().unwrap_or("-")
            )));
        };
        // A part committed by its files' stamps is hashed here, as it is copied (one read of
        // each file); one committed with hashes is verified against them.
        let stamped = (!p.stamps.is_empty()).then(|| Fingerprint::of_file_stamps(&p.stamps));
        let listed: Vec<FileRef> = match stamped {
            Some(_) => p
                .stamps
                .iter()
                .map(|f| FileRef::new(f.path.clone(), f.size, String::new()))
                .collect(),
            None => p.files.clone(),
        };
        let set = SetCopy {
            src_prefix: p.location.prefix.clone(),
            dst_prefix: p.location.prefix.clone(),
            opts: CopyOptions {
                priority: Priority::Checkpoint,
                trust_recorded_hash: false,
                verify_destination: verify,
                expected_hash_unknown: stamped.is_some(),
            },
            chunk_files: 0,
            totals: Some((listed.len() as u64, p.total_bytes)),
        };
        let progress = Progress::new();
        let stop = match ctx {
            Some(ctx) => ctx.shutdown().child_token(),
            None => self.p().shutdown.child_token(),
        };
        // A bounded tier's space is reserved first, under the part's copy lease (the lease the
        // shared promoter's reconciler respects), and given back however the copy ends.
        let bounded = self
            .tier_policy(&to_tier)
            .is_some_and(|t| t.limits.is_some());
        let mut lease = match bounded {
            true => Some(self.reserve_offload(event, p, dst, &to_tier).await?),
            false => None,
        };
        let _slot = self.inner.slots.acquire(Priority::Checkpoint).await;
        let mut hashed = Vec::with_capacity(listed.len());
        let copy = async {
            // Stamps checked before any byte is read and again once every file is staged,
            // before it is published: what is copied is the part as committed, or nothing.
            if let Some(recorded) = &stamped {
                unchanged_since_commit(src, &p.location.prefix, recorded).await?;
            }
            let staged = self
                .p()
                .mover
                .stage_set(
                    src,
                    dst,
                    &set,
                    stream::iter(listed),
                    &progress,
                    &stop,
                    |f| hashed.push(f.clone()),
                )
                .await?;
            if let Some(recorded) = &stamped
                && let Err(e) = unchanged_since_commit(src, &p.location.prefix, recorded).await
            {
                if let Err(left) = staged.abandon().await {
                    warn!(error = %left, "the refused part's staging folder was not removed; the sweep removes it");
                }
                return Err(e);
            }
            staged.publish().await
        };
        let copied = self
            .renewing(
                &to_tier,
                &p.location.prefix,
                &event.id,
                &mut lease,
                &stop,
                copy,
            )
            .await;
        if let Some(revision) = lease {
            self.unreserve_offload(&to_tier, &p.location.prefix, revision)
                .await;
        }
        // A part is what its commit says: bytes or stamps that differ are a refusal, which a
        // retry would not change (a file changed after its commit is not that part).
        let copied = copied.map_err(|e| match e.kind {
            ErrorKind::ChecksumMismatch
            | ErrorKind::SourceChanged
            | ErrorKind::SizeMismatch
            | ErrorKind::NotFound
            | ErrorKind::NotAFile => refuse(format!(
                "checkpoint part {} of step {} of run {} on node {}: {e}; not offloaded",
                p.part, p.step, p.run, p.node
            )),
            _ if e.is_retryable() || e.kind == ErrorKind::Cancelled => retry(e),
            _ => refuse(e.to_string()),
        })?;
        info!(run = %p.run, step = p.step, part = p.part, tier = %to_tier, copied = copied.copied, existed = copied.existed, "checkpoint part offloaded");
        Ok(event.caused(
            STEP_OFFLOADED,
            Body::CheckpointPartOffloaded(CheckpointPartOffloaded {
                run: p.run.clone(),
                step: p.step,
                part: p.part,
                parts: p.parts,
                node: p.node.clone(),
                from: p.location.clone(),
                location: Location {
                    tier: to_tier,
                    prefix: p.location.prefix.clone(),
                },
                files: hashed.len() as u64,
                total_bytes: p.total_bytes,
                hashed,
            }),
        ))
    }

    /// Takes the part's copy lease on the offload tier and reserves the part's bytes there
    /// (quota, capacity and the filesystem's room, as a stage copy does); returns the lease's
    /// revision. A tier that cannot fit the part is a retry, never a failure: the offload
    /// waits for space, and `stagehand status` says why once it is late.
    async fn reserve_offload(
        &self,
        event: &Event,
        p: &CheckpointPartCommitted,
        dst: &Tier,
        to_tier: &str,
    ) -> Result<u64, HandlerError> {
        let coord = &self.p().coordination;
        let prefix = &p.location.prefix;
        let revision = match coord
            .lease(to_tier, None, prefix, event.id.as_str())
            .await
            .map_err(retry)?
        {
            LeaseState::Owned(revision) => revision,
            LeaseState::Held { instance, .. } => {
                return Err(retry(format!(
                    "{prefix} on tier {to_tier} is leased by {instance}; the offload waits"
                )));
            }
        };
        let limits = self.limits_of_copy(dst, to_tier, &event.project).await;
        // What the copy writes: its files' sizes (each checked as it is copied), not the
        // total the commit states, which its writer could understate.
        let bytes = p.listed().iter().map(|(_, size)| size).sum();
        let why = match coord
            .reserve(to_tier, None, &event.project, prefix, bytes, limits)
            .await
        {
            Ok(Ok(())) => return Ok(revision),
            Ok(Err(refused)) => offload_refused(p, bytes, to_tier, &refused),
            Err(e) => e.to_string(),
        };
        if let Err(e) = coord.end_lease(to_tier, None, prefix, revision).await {
            debug!(error = %e, "offload's copy lease not ended; it ages out");
        }
        warn!(run = %p.run, step = p.step, part = p.part, tier = %to_tier, "{why}");
        Err(retry(why))
    }

    /// Gives back an offload's reservation and its copy lease: an offloaded part is a
    /// checkpoint's, which the promoter's stage accounting does not hold (a failed one
    /// leaves nothing).
    async fn unreserve_offload(&self, to_tier: &str, prefix: &str, revision: u64) {
        let coord = &self.p().coordination;
        if let Err(e) = coord.release(to_tier, None, prefix).await {
            warn!(error = %e, %prefix, tier = %to_tier, "offload's reservation not given back; the reconciler gives it back");
        }
        if let Err(e) = coord.end_lease(to_tier, None, prefix, revision).await {
            debug!(error = %e, "offload's copy lease not ended; it ages out");
        }
    }

    /// Runs `copy`, renewing the copy lease (`lease`: its revision; `None`, none held) every
    /// third of its lifetime; a lease lost stops the copy (`stop`), so that the reservation
    /// it guarded is never counted for a copy nobody leases.
    pub(super) async fn renewing<T>(
        &self,
        to_tier: &str,
        prefix: &str,
        holder: &EventId,
        lease: &mut Option<u64>,
        stop: &CancellationToken,
        copy: impl std::future::Future<Output = T>,
    ) -> T {
        let Some(revision) = lease.as_mut() else {
            return copy.await;
        };
        tokio::pin!(copy);
        let every = self.p().coordination.lease_lifetime() / 3;
        loop {
            tokio::select! {
                done = &mut copy => return done,
                _ = tokio::time::sleep(every) => {
                    match self.p().coordination.renew(to_tier, None, prefix, holder.as_str(), *revision).await {
                        Ok(rev) => *revision = rev,
                        Err(e) => {
                            warn!(error = %e, %prefix, "offload's copy lease lost; stopping the copy");
                            stop.cancel();
                        }
                    }
                }
            }
        }
    }

    /// The step's `checkpoint.committed` once the catalogue shows this offload and every
    /// other part of the step offloaded; nothing while a part is still on its node.
    async fn complete_step(
        &self,
        event: &Event,
        p: &CheckpointPartOffloaded,
    ) -> Result<Vec<Event>, HandlerError> {
        let parts = self
            .p()
            .catalogue
            .checkpoint_parts(&event.project, &p.run, Some(p.step))
            .await
            .map_err(retry)?;
        let folded = parts.iter().any(|r| r.part == p.part && r.is_offloaded());
        if !folded {
            return Err(retry(format!(
                "the catalogue has not folded the offload of part {} of step {} of run {} yet",
                p.part, p.step, p.run
            )));
        }
        let step = StepParts::of(&parts);
        if !step.first().is_some_and(StepParts::complete) {
            return Ok(Vec::new());
        }
        Ok(vec![step_committed(
            &event.project,
            &p.run,
            p.step,
            &parts,
        )?])
    }
}

/// Refuses a part whose files on the node are not as its commit stamped them
/// (`recorded`): the first file that differs is named, with how.
async fn unchanged_since_commit(
    tier: &Tier,
    prefix: &str,
    recorded: &Fingerprint,
) -> Result<(), TransferError> {
    let found = tier.fingerprint(prefix).await?;
    let differences = recorded.compare_files(&found);
    let Some(first) = differences.first() else {
        return Ok(());
    };
    let how = match &first.change {
        Change::Missing => "is gone".to_owned(),
        Change::Size { expected, found } => {
            format!("holds {found} bytes, committed with {expected}")
        }
        Change::Kind => "is no longer a regular file".to_owned(),
        _ => "was rewritten, touched or replaced (its mtime, ctime or inode moved)".to_owned(),
    };
    Err(TransferError::new(
        ErrorKind::SourceChanged,
        Side::Source,
        tier.name(),
        format!("{prefix}/{}", first.path),
        format!(
            "{} {how} since the part was committed ({} file(s) of the part changed); the part \
             is not offloaded: commit the step again",
            first.path,
            differences.len()
        ),
    ))
}

/// Why the offload tier cannot take a part of `bytes` (what was asked for) now, for the log
/// and the retry.
fn offload_refused(
    p: &CheckpointPartCommitted,
    bytes: u64,
    to_tier: &str,
    refused: &Refused,
) -> String {
    let what = format!(
        "checkpoint part {} of step {} of run {} ({bytes} bytes)",
        p.part, p.step, p.run
    );
    match refused {
        Refused::Full { used, capacity } => format!(
            "offload tier {to_tier} cannot fit {what}: {used} of its {capacity} bytes are \
             reserved; the offload waits for space"
        ),
        Refused::Quota { used, quota } => format!(
            "offload tier {to_tier} cannot fit {what}: the project holds {used} bytes of its \
             {quota}-byte quota; the offload waits for space"
        ),
        Refused::NoRoom(room) => format!(
            "offload tier {to_tier} cannot fit {what}: its filesystem can take {} more bytes \
             ({} available, {} of them promised to copies still running or queued); the \
             offload waits for space",
            room.free(),
            room.available,
            room.unwritten
        ),
        Refused::Withdrawing => {
            format!("offload tier {to_tier}: {what}'s folder is being removed; the offload waits")
        }
    }
}

/// The whole step's commit from its parts' records (every one offloaded): the step's folder on
/// the offload tier, each part's files under `part-<i>/`, the tags of every part; stamped
/// with the newest offload, so that every agent builds the same fact.
pub fn step_committed(
    project: &str,
    run: &str,
    step: u64,
    parts: &[CheckpointPartRecord],
) -> Result<Event, HandlerError> {
    let mut tiers = parts.iter().filter_map(|r| r.offloaded_to.as_ref());
    let tier = tiers
        .next()
        .map(|l| l.tier.clone())
        .ok_or_else(|| retry("no part offloaded"))?;
    if parts
        .iter()
        .any(|r| r.offloaded_to.as_ref().is_none_or(|l| l.tier != tier))
    {
        return Err(refuse(format!(
            "the parts of step {step} of run {run} were offloaded to different tiers; the step \
             is not committed"
        )));
    }
    // Each part's files with their SHA-256: its commit's, or its offload's for a part
    // committed by stamps. A restore verifies against these, so none may be missing.
    if let Some(r) = parts.iter().find(|r| r.files.is_empty()) {
        return Err(retry(format!(
            "the catalogue holds no files of part {} of step {step} of run {run} yet",
            r.part
        )));
    }
    if let Some((r, f)) = parts
        .iter()
        .flat_map(|r| r.files.iter().map(move |f| (r, f)))
        .find(|(_, f)| !stagehand_schemas::is_sha256_hex(&f.sha256))
    {
        return Err(refuse(format!(
            "part {} of step {step} of run {run}: {} has no SHA-256 (its offload stated none); \
             the step is not committed",
            r.part, f.path
        )));
    }
    let mut files: Vec<FileRef> = parts
        .iter()
        .flat_map(|r| {
            let dir = layout::checkpoint_part_name(r.part);
            r.files
                .iter()
                .map(move |f| FileRef::new(format!("{dir}/{}", f.path), f.size, f.sha256.clone()))
        })
        .collect();
    files.sort_by(|a, b| a.path.cmp(&b.path));
    let listed: usize = files.iter().map(|f| f.path.len() + 64 + 24).sum();
    if listed as u64 > INLINE_MANIFEST_MAX_BYTES {
        return Err(refuse(format!(
            "step {step} of run {run}: its parts list {} files, too many to commit inline; \
             the step is not committed",
            files.len()
        )));
    }
    let mut tags: Vec<String> = parts.iter().flat_map(|r| r.tags.clone()).collect();
    tags.sort();
    tags.dedup();
    let mut commit = Event::request(
        EventId::for_checkpoint(project, run, step),
        project,
        Body::CheckpointCommitted(CheckpointCommitted {
            run: run.to_owned(),
            step,
            location: Location {
                tier,
                prefix: layout::checkpoint_step_folder(project, &checkpoint_dataset(run), step),
            },
            total_bytes: files.iter().map(|f| f.size).sum(),
            files,
            manifest: None,
            tags,
        }),
    );
    if let Some(at) = parts
        .iter()
        .filter_map(|r| r.offloaded.as_ref())
        .map(|s| s.at)
        .max()
    {
        commit.occurred_at = at;
    }
    Ok(commit)
}
