//! Copying a version onto the requested tier: space reserved under the copy's lease, a copy
//! slot held, the verified file list fetched, every file staged hidden and the set published
//! by one rename, progress reported as it goes.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use stagehand_bus::placement::{self, Served, UseState};
use stagehand_bus::{HandlerError, WorkContext};
use stagehand_manifest::{Manifest, ManifestBuilder, ManifestErrorKind, ManifestStore};
use stagehand_mover::{CopyOptions, ErrorKind, FileRef, Progress, SetCopy, Tier, TransferError};
use stagehand_policy::TierRole;
use stagehand_schemas::Retryable;
use stagehand_schemas::layout;
use stagehand_schemas::pieces::PieceHashes;
use stagehand_schemas::progress::{WorkProgress, progress_subject};
use stagehand_schemas::subject::MANIFEST_BUCKET;
use stagehand_schemas::{
    Body, Event, EventId, Location, ManifestRef, ReplicaCreated, StageRequested,
};
use time::OffsetDateTime;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::fanout::{Fanout, Fill, ReplicaAt};
use crate::kv::{FsRoom, LeaseState, Limits, Refused};
use crate::resolve::Plan;
use crate::reuse::Reuse;
use crate::state::{RequestRecord, WaitGuard, WaitingFor};

use super::clock::deadline_reason;
use super::in_flight::{Held, request_key};
use super::{FAILED_COPY_REMEMBERED, Promoter, retry, step_replica};

/// What a copy is for and where it goes: a stage request's copy, or the repair of a damaged
/// copy this promoter made (`promoter/repair.rs`), which no request asked for.
pub(super) struct CopyFor<'a> {
    pub project: &'a str,
    pub dataset: &'a str,
    pub tier: &'a str,
    pub node: Option<&'a str>,
    /// Who holds the copy's lease: the request's id, or the damage fact's.
    pub holder: &'a EventId,
    /// The request whose progress the copy reports (to its waiters and the copy book);
    /// none for a repair.
    pub request: Option<&'a RequestRecord>,
}

impl<'a> CopyFor<'a> {
    pub fn request(record: &'a RequestRecord, request: &'a StageRequested) -> CopyFor<'a> {
        CopyFor {
            project: &record.event.project,
            dataset: &request.dataset,
            tier: &request.tier,
            node: request.node.as_deref(),
            holder: &record.event.id,
            request: Some(record),
        }
    }
}

impl Promoter {
    pub(super) fn limits(&self, tier: &str, project: &str) -> Limits {
        let limits = self.tier_policy(tier).and_then(|t| t.limits.as_ref());
        Limits {
            capacity: limits.map_or(u64::MAX, |l| l.capacity),
            quota: limits.and_then(|l| l.quota_for(project)),
            filesystem: None,
        }
    }

    /// [`Promoter::limits`] of a new copy onto `dst` (tier `tier`): the policy's, and on a
    /// posix tier the room its filesystem has left — what it can still take
    /// ([`stagehand_mover::PosixTier::available_bytes`]) less what this process's copies onto
    /// the tier, queued or running, have still to write. A filesystem that reports no size, or
    /// that cannot be measured (logged), leaves the copy to the policy alone, as on S3; a full
    /// one still stops it then (`ENOSPC`: the request fails, retryable).
    pub(super) async fn limits_of_copy(&self, dst: &Tier, tier: &str, project: &str) -> Limits {
        let limits = self.limits(tier, project);
        let Tier::Posix(posix) = dst else {
            return limits;
        };
        let posix = posix.clone();
        // `statvfs` of a network filesystem can take its time: off the runtime's threads.
        let measured = tokio::task::spawn_blocking(move || posix.available_bytes())
            .await
            .map_err(|e| e.to_string())
            .and_then(|r| r.map_err(|e| e.to_string()));
        let available = match measured {
            Ok(Some(available)) => available,
            Ok(None) => return limits,
            Err(error) => {
                warn!(%error, %tier, "the tier's filesystem could not be measured; the copy is admitted by the policy alone");
                return limits;
            }
        };
        Limits {
            filesystem: Some(FsRoom {
                available,
                unwritten: self.inner.book.unwritten_onto(tier),
            }),
            ..limits
        }
    }

    /// The version is resolved: ready at once if it is on the tier, else copied once.
    pub(super) async fn stage(
        &self,
        record: &RequestRecord,
        request: &StageRequested,
        plan: Plan,
        ctx: Option<&WorkContext>,
    ) -> Result<Vec<Event>, HandlerError> {
        let project = record.event.project.as_str();
        let node = request.node.as_deref();
        let Some(dst) = self.p().tiers.get(&request.tier) else {
            return self
                .fail(
                    record,
                    format!("tier {:?} is not open", request.tier),
                    false,
                )
                .await;
        };
        let prefix = layout::version_folder(project, &request.dataset, &plan.version);
        let limits = self.limits(&request.tier, project);
        // A replica the demoter is removing is neither handed out nor copied over until the
        // removal has finished (its space is given back then, not before).
        let withdrawing =
            placement::read_use(self.p().coordination.store(), &request.tier, node, &prefix)
                .await
                .map_err(retry)?
                .value
                .filter(|u| u.state == UseState::Withdrawing);
        if let Some(u) = withdrawing {
            return self
                .wait_for_removal(record, &plan.version, request, u.reason)
                .await;
        }
        // Checked before reuse (`crate::reuse`): a replica that is not what was verified is
        // withdrawn and takes the copy path below, which verifies and repairs it.
        if dst.set_present(&prefix).await.map_err(retry)?
            && let Reuse::Intact = self
                .check_before_reuse(record, request, &plan, dst, &prefix)
                .await?
        {
            if let Served::Withdrawing { reason } = self.serve(record, request, &prefix).await? {
                return self
                    .wait_for_removal(record, &plan.version, request, reason)
                    .await;
            }
            // Placed before (by this request's copy, another's, another instance's): it
            // already holds its reservation, which this makes sure of (a no-op then).
            if let Ok(Err(refused)) = self
                .p()
                .coordination
                .reserve(&request.tier, node, project, &prefix, plan.bytes, limits)
                .await
            {
                warn!(?refused, %prefix, "a replica already on the tier holds no reservation and does not fit one");
            }
            let answered = self
                .ready(record, request, &plan.version, dst, &prefix, None)
                .await;
            // After the answer: the job's readiness never waits for the swarm.
            self.serve_again(project, request, &plan, dst, &prefix)
                .await;
            return answered;
        }
        let Some((src_tier, src_prefix)) = plan.sources.first().cloned() else {
            return self
                .fail(
                    record,
                    format!(
                        "version {} of dataset {:?} has no verified replica on any tier stage copies from ({}); restore one there first",
                        plan.version,
                        request.dataset,
                        self.p()
                            .promotion
                            .sources_for(self.tier_policy(&request.tier).map_or(TierRole::Hot, |t| t.role))
                            .join(", ")
                    ),
                    true,
                )
                .await;
        };
        let copy_key = Self::copy_key(&request.tier, node, &prefix);
        let recent_failure = {
            let mut failed = self.inner.failed.lock().unwrap_or_else(|p| p.into_inner());
            failed.retain(|_, (_, _, at)| at.elapsed() < FAILED_COPY_REMEMBERED);
            failed.get(&copy_key).cloned()
        };
        if let Some((reason, retryable, _)) = recent_failure {
            return self.fail(record, reason, retryable).await;
        }
        let Some(_copying) = Held::take(&self.inner.copies, copy_key.clone()) else {
            let reason = format!(
                "version {} is being copied onto tier {} for another request; this one is answered when that copy is published",
                plan.version, request.tier
            );
            let guard = WaitGuard::Replica {
                tier: request.tier.clone(),
                prefix: prefix.clone(),
            };
            return self.wait(record, WaitingFor::Copy, reason, guard).await;
        };
        let coord = &self.p().coordination;
        let lease = coord
            .lease(&request.tier, node, &prefix, record.event.id.as_str())
            .await
            .map_err(retry)?;
        let mut revision = match lease {
            LeaseState::Owned(rev) => rev,
            LeaseState::Held {
                instance,
                request_id,
            } => {
                let reason = format!(
                    "version {} is being copied onto tier {} by promoter {instance} (request {request_id}); this one is answered when that copy is published",
                    plan.version, request.tier
                );
                let guard = WaitGuard::Replica {
                    tier: request.tier.clone(),
                    prefix: prefix.clone(),
                };
                return self.wait(record, WaitingFor::Copy, reason, guard).await;
            }
        };
        let result = self
            .copy_owned(
                record,
                request,
                &plan,
                dst,
                &prefix,
                &src_tier,
                &src_prefix,
                &mut revision,
                ctx,
            )
            .await;
        if let Err(e) = coord
            .end_lease(&request.tier, node, &prefix, revision)
            .await
        {
            debug!(error = %e, "copy lease not ended; it ages out");
        }
        let facts = result?;
        let failed = facts.iter().find_map(|f| match &f.body {
            Body::StageFailed(failed) => Some((failed.reason.clone(), failed.retryable)),
            _ => None,
        });
        match failed {
            // A damaged source (not retryable) fails every request the same way; a full tier
            // or quota may have room for the next one.
            Some((reason, retryable)) if !retryable => {
                self.inner
                    .failed
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(copy_key, (reason, retryable, Instant::now()));
                self.wake_dataset(project, &request.dataset, None);
            }
            Some(_) => self.wake_dataset(project, &request.dataset, None),
            // Requests of this dataset waiting for this copy (here) can be answered now.
            None => self.wake_dataset(project, &request.dataset, Some((&request.tier, &prefix))),
        }
        Ok(facts)
    }

    /// Reserves space and copies the version under an owned lease.
    #[allow(clippy::too_many_arguments)]
    async fn copy_owned(
        &self,
        record: &RequestRecord,
        request: &StageRequested,
        plan: &Plan,
        dst: &Tier,
        prefix: &str,
        src_tier: &str,
        src_prefix: &str,
        revision: &mut u64,
        ctx: Option<&WorkContext>,
    ) -> Result<Vec<Event>, HandlerError> {
        let project = record.event.project.as_str();
        let node = request.node.as_deref();
        let coord = &self.p().coordination;
        let place = match node {
            Some(n) => format!("tier {} on node {n}", request.tier),
            None => format!("tier {}", request.tier),
        };
        self.p()
            .state
            .note_reserved(&record.event.project, &record.event.id, prefix)?;
        // Measured just before the reservation, which is made only if it fits.
        let limits = self.limits_of_copy(dst, &request.tier, project).await;
        match coord
            .reserve(&request.tier, node, project, prefix, plan.bytes, limits)
            .await
            .map_err(retry)?
        {
            Ok(()) => {}
            Err(Refused::Withdrawing) => {
                // Found gone with its space not given back yet: the demoter is removing it.
                return self
                    .wait_for_removal(record, &plan.version, request, None)
                    .await;
            }
            Err(Refused::Quota { used, quota }) => {
                return self
                    .fail(
                        record,
                        format!(
                            "quota exceeded: project {project:?} holds {used} bytes of its {quota}-byte quota on {place}, and version {} needs {} more; release finished stages or raise the quota in tiers.toml",
                            plan.version, plan.bytes
                        ),
                        true,
                    )
                    .await;
            }
            Err(Refused::Full { used, capacity }) => {
                return self
                    .fail(
                        record,
                        format!(
                            "{place} is full: {used} of its {capacity} bytes are reserved, and version {} needs {}; release finished stages or wait for the demoter",
                            plan.version, plan.bytes
                        ),
                        true,
                    )
                    .await;
            }
            Err(Refused::NoRoom(room)) => {
                return self
                    .fail(
                        record,
                        no_room(&place, &plan.version, plan.bytes, room),
                        true,
                    )
                    .await;
            }
        }
        // Recorded as copying, so that after a crash the clock takes the copy up again.
        let reason = format!("copying version {} from tier {src_tier}", plan.version);
        self.p().state.wait(
            &record.event.project,
            &record.event.id,
            WaitingFor::Copy,
            &reason,
            &WaitGuard::None,
        )?;
        // From here the copy is this request's: an operator's cancel of the request stops it,
        // queued or running, unless another request waits for the same replica.
        let cancel = self.p().shutdown.child_token();
        let booked = self.inner.book.enter(
            request_key(record),
            &plan.version,
            cancel.clone(),
            (src_tier, &request.tier),
            plan.bytes,
        );
        let ticket = self.inner.slots.enqueue(plan.priority);
        tokio::pin!(ticket);
        let _slot = match futures::poll!(&mut ticket) {
            std::task::Poll::Ready(permit) => permit,
            std::task::Poll::Pending => {
                // The estimate travels beside the reason, so that whoever shows it says
                // how long is left as of when it is read.
                let estimate = self.inner.book.estimate(&booked, OffsetDateTime::now_utc());
                let reason = format!(
                    "waiting for one of {} copy slots (class {})",
                    self.p().promotion.max_concurrent,
                    plan.priority
                );
                let fact = self.pending_fact(record, WaitingFor::Copy, &reason, estimate);
                self.emit(std::slice::from_ref(&fact)).await?;
                let held = self
                    .hold(
                        ticket,
                        &request.tier,
                        node,
                        prefix,
                        record,
                        revision,
                        &cancel,
                        ctx,
                    )
                    .await?;
                let Some(permit) = held else {
                    // The deadline passed while queued, or the request was cancelled: nothing
                    // of it stays on the tier.
                    discard_staging(dst, prefix).await;
                    let _ = coord.release(&request.tier, node, prefix).await;
                    if cancel.is_cancelled() {
                        self.wake_dataset(project, &request.dataset, None);
                        return cancelled_copy();
                    }
                    return self
                        .fail(
                            record,
                            deadline_reason(record, WaitingFor::Copy, &reason),
                            true,
                        )
                        .await;
                };
                permit
            }
        };
        let copy_started = Instant::now();
        let outcome = Box::pin(self.run_copy(
            &CopyFor::request(record, request),
            plan,
            dst,
            prefix,
            (src_tier, src_prefix),
            revision,
            &cancel,
            ctx,
        ))
        .await;
        drop(booked);
        match outcome {
            Ok(report) => {
                // From the copy's start to its publication: the time a request waits for it.
                self.inner.book.measured(
                    src_tier,
                    &request.tier,
                    report.bytes_copied,
                    copy_started.elapsed(),
                );
                info!(request = %record.event.id, %prefix, copied = report.copied, skipped = report.skipped, bytes = report.bytes_copied, resumed = report.resumed, existed = report.existed, engine = report.engine, elapsed = ?report.elapsed, "version copied and published");
                // Also when it was found in place and verified (a repair, or a copy that
                // raced this one): the catalogue may hold it withdrawn until told again.
                let replica = Some(record.event.caused(
                    &step_replica(&request.tier, node),
                    Body::ReplicaCreated(ReplicaCreated {
                        dataset: request.dataset.clone(),
                        version: plan.version.clone(),
                        location: Location {
                            tier: request.tier.clone(),
                            prefix: prefix.to_owned(),
                        },
                        files: plan.files,
                        total_bytes: plan.bytes,
                        verified_by: self.p().promotion.verify.as_str().into(),
                        node: node.map(str::to_owned),
                    }),
                ));
                if self.answered_meanwhile(record)? {
                    // Cancelled while the copy went on for another request that waits for it:
                    // the replica is announced on its own (the cancel's answer stands), and the
                    // waiting requests are answered from it.
                    let replica: Vec<Event> = replica.into_iter().collect();
                    self.emit(&replica).await?;
                    return Ok(replica);
                }
                if let Served::Withdrawing { reason } = self.serve(record, request, prefix).await? {
                    return self
                        .wait_for_removal(record, &plan.version, request, reason)
                        .await;
                }
                self.ready(record, request, &plan.version, dst, prefix, replica)
                    .await
            }
            Err(CopyFailed::Retry(_))
                if cancel.is_cancelled() && !self.p().shutdown.is_cancelled() =>
            {
                // Stopped by an operator's cancel (`stop_cancelled_copy`): nobody waits for this
                // replica, so nothing of it stays on the tier and its space is given back now.
                discard_staging(dst, prefix).await;
                let _ = coord.release(&request.tier, node, prefix).await;
                info!(request = %record.event.id, %prefix, "copy stopped: its request was cancelled; staging folder removed, space given back");
                // A request that came to wait for this copy after the cancel looked copies it.
                self.wake_dataset(project, &request.dataset, None);
                cancelled_copy()
            }
            Err(CopyFailed::Retry(e)) => Err(e),
            Err(CopyFailed::Fail { reason, retryable }) => {
                // Nothing of a copy that will not be retried stays on the tier, hidden or not.
                discard_staging(dst, prefix).await;
                let _ = coord.release(&request.tier, node, prefix).await;
                self.fail(record, reason, retryable).await
            }
        }
    }

    /// Waits for a copy slot, keeping the lease and the message alive; `None` once the
    /// request's deadline passes first, or `cancel` is (an operator cancelled the request).
    #[allow(clippy::too_many_arguments)]
    async fn hold<F: std::future::Future<Output = stagehand_mover::Permit> + Unpin>(
        &self,
        mut ticket: F,
        tier: &str,
        node: Option<&str>,
        prefix: &str,
        record: &RequestRecord,
        revision: &mut u64,
        cancel: &CancellationToken,
        ctx: Option<&WorkContext>,
    ) -> Result<Option<stagehand_mover::Permit>, HandlerError> {
        let period = self.p().coordination.lease_lifetime() / 3;
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        let left =
            Duration::try_from(record.deadline - OffsetDateTime::now_utc()).unwrap_or_default();
        let deadline = tokio::time::sleep(left);
        tokio::pin!(deadline);
        loop {
            tokio::select! {
                permit = &mut ticket => return Ok(Some(permit)),
                _ = &mut deadline => return Ok(None),
                _ = tick.tick() => {
                    *revision = self.p().coordination
                        .renew(tier, node, prefix, record.event.id.as_str(), *revision)
                        .await
                        .map_err(|e| retry(format!("copy lease lost while waiting for a slot: {e}")))?;
                    if let Some(ctx) = ctx && let Err(e) = ctx.progress().await {
                        debug!(error = %e, "progress ack failed");
                    }
                }
                // `cancel` is a child of the shutdown token: shutting down is told apart.
                _ = cancel.cancelled() => {
                    if self.p().shutdown.is_cancelled() {
                        return Err(retry("shutting down"));
                    }
                    return Ok(None);
                }
            }
        }
    }

    /// A replica on this node's local tier, found intact and handed out again, is served to
    /// its swarm's peers unless this agent serves it already (a node agent with fan-out on; an
    /// agent restarted since it staged the replica serves nothing it held before until it has
    /// checked it: see [`Fanout::serve_published`] and `serve_held`).
    async fn serve_again(
        &self,
        project: &str,
        request: &StageRequested,
        plan: &Plan,
        dst: &Tier,
        prefix: &str,
    ) {
        let replica = ReplicaAt {
            project: project.to_owned(),
            dataset: request.dataset.clone(),
            version: plan.version.clone(),
            tier: request.tier.clone(),
            prefix: prefix.to_owned(),
        };
        let reference = ManifestRef {
            digest: plan.version.clone(),
            files: plan.files,
            bytes: plan.bytes,
        };
        self.serve_replica(dst, replica, &reference).await;
    }

    /// Serves `replica`, found intact on this node's local tier `dst`, to its swarm's peers
    /// unless this agent serves it already. Best effort: a failure (its manifest or side data
    /// unreadable) is logged, and costs the peers only reading those pieces from the shared
    /// tier instead.
    pub(crate) async fn serve_replica(
        &self,
        dst: &Tier,
        replica: ReplicaAt,
        reference: &ManifestRef,
    ) {
        let (Some(fanout), Tier::Posix(_)) = (&self.p().fanout, dst) else {
            return;
        };
        let base = Fanout::swarm(
            &replica.tier,
            &replica.project,
            &replica.dataset,
            &replica.version,
        );
        if fanout.serves(&base) {
            return;
        }
        let prefix = replica.prefix.clone();
        let served = async {
            let manifest = self
                .manifest_of(&replica.project, &replica.dataset, reference)
                .await
                .map_err(|e| match e {
                    CopyFailed::Retry(e) => e.to_string(),
                    CopyFailed::Fail { reason, .. } => reason,
                })?;
            let (files, side) = self
                .pieces_listing(&manifest)
                .await
                .map_err(|e| e.to_string())?;
            let Ok(Tier::Posix(folder)) = dst.beneath(&prefix) else {
                return Err(format!("{prefix} is no folder of a posix tier"));
            };
            fanout
                .serve_published(&base, files, &side, folder, replica)
                .await
                .map_err(|e| e.to_string())
        };
        match served.await {
            Ok(swarm) => {
                info!(%swarm, %prefix, "fan-out: a replica staged here before is served to its peers again")
            }
            Err(error) => {
                warn!(%error, %prefix, "fan-out: a replica staged here before is not served to peers; they read it from the shared tier")
            }
        }
    }

    /// What the fan-out cuts a version into pieces by: every entry of `manifest`, in order, and
    /// the side data of those larger than a piece ([`crate::fanout::side_data`]).
    async fn pieces_listing(
        &self,
        manifest: &Manifest,
    ) -> Result<(Arc<[FileRef]>, HashMap<usize, PieceHashes>), stagehand_manifest::ManifestError>
    {
        let files = manifest_entries(manifest).await?;
        let side = crate::fanout::side_data(self.p().bus.jetstream(), &files).await?;
        Ok((files, side))
    }

    /// The version's verified file list: from the services' manifest bucket, or (a version
    /// small enough to travel inline) the catalogue's pages, checked against the digest.
    pub(crate) async fn manifest(
        &self,
        project: &str,
        dataset: &str,
        plan: &Plan,
    ) -> Result<Manifest, CopyFailed> {
        let reference = ManifestRef {
            digest: plan.version.clone(),
            files: plan.files,
            bytes: plan.bytes,
        };
        self.manifest_of(project, dataset, &reference).await
    }

    /// [`manifest`](Self::manifest) of the version `reference` names.
    pub(crate) async fn manifest_of(
        &self,
        project: &str,
        dataset: &str,
        reference: &ManifestRef,
    ) -> Result<Manifest, CopyFailed> {
        let js = self.p().bus.jetstream();
        let stored = match ManifestStore::open(js, MANIFEST_BUCKET).await {
            Ok(store) => store.fetch(reference, &self.p().spool).await,
            Err(e) => Err(e),
        };
        match stored {
            Ok(m) => return Ok(m),
            Err(e) if e.kind == ManifestErrorKind::NotFound => {}
            Err(e) if e.is_retryable() => return Err(CopyFailed::Retry(retry(e))),
            Err(e) => {
                return Err(CopyFailed::Fail {
                    reason: format!(
                        "the manifest of version {} is damaged: {e}",
                        reference.digest
                    ),
                    retryable: false,
                });
            }
        }
        let pages = self.p().catalogue.all_files(
            Some(project.to_owned()),
            dataset.to_owned(),
            reference.digest.clone(),
            stagehand_catalogue::MAX_PAGE,
            None,
        );
        let mut pages = std::pin::pin!(pages);
        let mut builder = ManifestBuilder::new(&self.p().spool);
        while let Some(file) = pages.next().await {
            let file = file.map_err(|e| CopyFailed::Retry(retry(e)))?;
            builder
                .push(&file)
                .map_err(|e| CopyFailed::Retry(retry(e)))?;
        }
        let manifest = builder.finish().map_err(|e| CopyFailed::Retry(retry(e)))?;
        if manifest.digest() != reference.digest || manifest.files() != reference.files {
            return Err(CopyFailed::Fail {
                reason: format!(
                    "the catalogue's file list of version {} hashes to {} ({} files, {} expected): the catalogue is damaged; rebuild it",
                    reference.digest,
                    manifest.digest(),
                    manifest.files(),
                    reference.files
                ),
                retryable: false,
            });
        }
        Ok(manifest)
    }

    /// Stages every file under the hidden staging folder, then publishes the set, reporting
    /// progress about once a second and renewing the lease.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn run_copy(
        &self,
        job: &CopyFor<'_>,
        plan: &Plan,
        dst: &Tier,
        prefix: &str,
        (src_tier, src_prefix): (&str, &str),
        revision: &mut u64,
        cancel: &CancellationToken,
        ctx: Option<&WorkContext>,
    ) -> Result<stagehand_mover::SetReport, CopyFailed> {
        let project = job.project;
        let Some(src) = self.p().tiers.get(src_tier) else {
            return Err(CopyFailed::Fail {
                reason: format!("source tier {src_tier:?} is not open"),
                retryable: false,
            });
        };
        let manifest = self.manifest(project, job.dataset, plan).await?;
        // Jobs of every project read a hot or local tier: the set is published read-only and
        // readable by its project's group only (tiers.toml `[groups]`).
        let dst = &dst.with_access(
            self.tier_policy(job.tier)
                .and_then(|t| t.set_access(project)),
        );
        // Several nodes staging the same version read it from the shared tier about once
        // between them: the files come from their agents where they hold them (`crate::fanout`).
        let fanning = match (&self.p().fanout, dst) {
            (Some(f), Tier::Posix(_))
                if !dst
                    .set_present(prefix)
                    .await
                    .map_err(|e| self.copy_error(src_tier, e))? =>
            {
                Some((
                    f,
                    Fanout::swarm(job.tier, project, job.dataset, &plan.version),
                ))
            }
            _ => None,
        };
        // The list is read once: streamed to the set copy, or whole for the fan-out's pieces.
        // A streamed list that ends early is caught below, before anything is published.
        let (listing, listed) = match &fanning {
            None => {
                let (files, listed) = manifest.file_stream(4096);
                (Listing::Streamed(files), Some(listed))
            }
            Some((fanout, swarm)) => {
                let (files, side) = self
                    .pieces_listing(&manifest)
                    .await
                    .map_err(|e| manifest_failed(plan, e))?;
                (
                    Listing::Fanned {
                        fanout,
                        swarm: swarm.clone(),
                        files,
                        side,
                    },
                    None,
                )
            }
        };
        let set = SetCopy {
            src_prefix: src_prefix.to_owned(),
            dst_prefix: prefix.to_owned(),
            opts: CopyOptions {
                priority: plan.priority,
                trust_recorded_hash: false,
                verify_destination: self.p().promotion.verify,
                expected_hash_unknown: false,
            },
            chunk_files: 0,
            totals: Some((plan.files, plan.bytes)),
        };
        let progress = Progress::new();
        // A lost lease stops this copy only (its staging folder kept for whoever holds the
        // lease now); `cancel`, the operator's, stops it too.
        let stop = cancel.child_token();
        let node = job.node;
        let mover = &self.p().mover;
        let staging = async {
            let (fanout, swarm, files, side) = match listing {
                Listing::Streamed(files) => {
                    return mover
                        .stage_set(src, dst, &set, files, &progress, &stop, |_| {})
                        .await
                        .map(|staged| (staged, None));
                }
                Listing::Fanned {
                    fanout,
                    swarm,
                    files,
                    side,
                } => (fanout, swarm, files, side),
            };
            // The staging folder alone (made, or a dead run's adopted); the fan-out fills it.
            let only_folder = SetCopy {
                totals: None,
                ..set.clone()
            };
            let staged = mover
                .stage_set(
                    src,
                    dst,
                    &only_folder,
                    futures::stream::empty(),
                    &progress,
                    &stop,
                    |_| {},
                )
                .await?;
            let Some(Tier::Posix(area)) = staged.staging_tier() else {
                return Err(TransferError::new(
                    ErrorKind::Config,
                    stagehand_mover::Side::Destination,
                    dst.name(),
                    prefix,
                    "a posix set has no staging folder",
                ));
            };
            let job = Fill {
                swarm,
                files,
                side,
                src: &src.beneath(src_prefix)?,
                staging: area,
                mover,
                opts: set.opts.clone(),
                progress: &progress,
                stop: &stop,
            };
            let filled = fanout.fill(job).await?;
            Ok((staged, Some(filled.swarm)))
        };
        tokio::pin!(staging);
        let started = Instant::now();
        let lease_every = self.p().coordination.lease_lifetime() / 3;
        let mut last_renew = Instant::now();
        let mut tick = tokio::time::interval(self.p().progress_every);
        tick.tick().await;
        let reported = job.request.map(|record| {
            let subject = progress_subject(
                "stage.requested",
                record.event.body.node(),
                project,
                &record.event.id,
            );
            (record, subject)
        });
        let staged = loop {
            tokio::select! {
                r = &mut staging => break r,
                _ = tick.tick() => {
                    if let Some((record, subject)) = &reported {
                        self.inner.book.progressed(&request_key(record), progress.bytes_done());
                        self.report(subject, &record.event.id, &progress, started).await;
                    }
                    if let Some(ctx) = ctx && let Err(e) = ctx.progress().await {
                        debug!(error = %e, "progress ack failed");
                    }
                    if last_renew.elapsed() >= lease_every {
                        match self.p().coordination.renew(job.tier, node, prefix, job.holder.as_str(), *revision).await {
                            Ok(rev) => { *revision = rev; last_renew = Instant::now(); }
                            Err(e) => {
                                warn!(error = %e, %prefix, "copy lease lost; stopping this copy (its staging folder is kept)");
                                stop.cancel();
                            }
                        }
                    }
                }
            }
        };
        let (staged, swarm) = staged.map_err(|e| self.copy_error(src_tier, e))?;
        if let Some(e) = listed.and_then(|l| l.take_error()) {
            // The list ended early: publishing now would publish part of the version.
            return Err(manifest_failed(plan, e));
        }
        if let Some((record, subject)) = &reported {
            self.report(subject, &record.event.id, &progress, started)
                .await;
        }
        let report = staged
            .publish()
            .await
            .map_err(|e| self.copy_error(src_tier, e))?;
        if let (Some((fanout, _)), Some(swarm)) = (&fanning, &swarm)
            && let Ok(Tier::Posix(published)) = dst.beneath(prefix)
        {
            let replica = ReplicaAt {
                project: project.to_owned(),
                dataset: job.dataset.to_owned(),
                version: plan.version.clone(),
                tier: job.tier.to_owned(),
                prefix: prefix.to_owned(),
            };
            fanout.published(swarm, published, replica);
        }
        crate::reuse::record(
            self.p().coordination.store(),
            (job.tier, node),
            prefix,
            &report,
        )
        .await;
        Ok(report)
    }

    fn copy_error(&self, src_tier: &str, e: TransferError) -> CopyFailed {
        match e.kind {
            ErrorKind::NoSpace => CopyFailed::Fail {
                reason: format!("tier {} is full: {}", e.tier, e.detail),
                retryable: true,
            },
            ErrorKind::ChecksumMismatch
            | ErrorKind::SizeMismatch
            | ErrorKind::NotFound
            | ErrorKind::NotAFile
                if e.side == stagehand_mover::Side::Source =>
            {
                CopyFailed::Fail {
                    reason: format!(
                        "the replica on source tier {src_tier} is damaged: file {:?}: {}; nothing was published on the target tier (on-call: restore that replica)",
                        e.path, e.detail
                    ),
                    retryable: false,
                }
            }
            _ if e.is_retryable() || e.kind == ErrorKind::Cancelled => CopyFailed::Retry(retry(
                format!("copy interrupted (its staging folder is kept for a resume): {e}"),
            )),
            _ => CopyFailed::Fail {
                reason: format!("copying failed: {e}"),
                retryable: false,
            },
        }
    }

    async fn report(&self, subject: &str, id: &EventId, progress: &Progress, started: Instant) {
        let done = progress.bytes_done();
        let total = progress.bytes_total();
        let secs = started.elapsed().as_secs_f64();
        let eta = (done > 0 && secs > 0.0)
            .then(|| ((total.saturating_sub(done)) as f64 / (done as f64 / secs)).ceil() as u64);
        let p = WorkProgress {
            request_id: id.clone(),
            service: crate::SERVICE.into(),
            phase: "copying".into(),
            files_done: progress.files_done(),
            files_total: progress.files_total(),
            bytes_done: done,
            bytes_total: total,
            eta_seconds: eta,
        };
        if let Err(e) = self
            .p()
            .bus
            .client()
            .publish(subject.to_owned(), p.encode().into())
            .await
        {
            debug!(error = %e, "progress not published");
        }
    }
}

/// How a copy ended when it did not publish.
pub(crate) enum CopyFailed {
    /// Try again later; the staging folder stays for a resume.
    Retry(HandlerError),
    /// Answer `stage.failed`.
    Fail { reason: String, retryable: bool },
}

impl From<CopyFailed> for HandlerError {
    fn from(c: CopyFailed) -> Self {
        match c {
            CopyFailed::Retry(e) => e,
            CopyFailed::Fail { reason, .. } => HandlerError::permanent(reason),
        }
    }
}

/// Removes the staging folders of the set bound for `prefix` on a posix tier (called under
/// the set's copy lease, so no live copy of it is anywhere). The listing reads the folder
/// beneath the tier's root; the removal goes through the tier's confined handles.
pub(super) async fn discard_staging(tier: &Tier, prefix: &str) {
    let Tier::Posix(p) = tier else { return };
    let Some((parent, name)) = prefix.rsplit_once('/') else {
        return;
    };
    let (p, parent, mark) = (
        p.clone(),
        parent.to_owned(),
        layout::staging_folder_prefix(name),
    );
    let removed = tokio::task::spawn_blocking(move || {
        let Ok(entries) = std::fs::read_dir(p.root().join(&parent)) else {
            return;
        };
        for entry in entries.flatten() {
            let entry = entry.file_name().to_string_lossy().into_owned();
            if entry.starts_with(&mark)
                && let Err(e) = p.remove_tree(&format!("{parent}/{entry}"))
            {
                warn!(error = %e, "could not remove a failed copy's staging folder");
            }
        }
    })
    .await;
    if let Err(e) = removed {
        warn!(error = %e, "staging clean-up task failed");
    }
}

/// How a copy gets its file list: streamed to the set copy, or read whole for a fan-out, whose
/// pieces are numbered runs of it.
enum Listing<'f, S> {
    Streamed(S),
    Fanned {
        fanout: &'f Fanout,
        swarm: String,
        files: Arc<[FileRef]>,
        side: HashMap<usize, PieceHashes>,
    },
}

/// Every entry of `manifest`, in order.
async fn manifest_entries(
    manifest: &Manifest,
) -> Result<Arc<[FileRef]>, stagehand_manifest::ManifestError> {
    let manifest = manifest.clone();
    let digest = manifest.digest().to_owned();
    tokio::task::spawn_blocking(move || manifest.entries().collect::<Result<Vec<_>, _>>())
        .await
        .unwrap_or_else(|e| {
            Err(stagehand_manifest::ManifestError::new(
                ManifestErrorKind::Io,
                &digest,
                format!("reading task failed: {e}"),
            ))
        })
        .map(Into::into)
}

/// A manifest that could not be read whole: read again later, or the version is damaged.
fn manifest_failed(plan: &Plan, e: stagehand_manifest::ManifestError) -> CopyFailed {
    if e.is_retryable() {
        CopyFailed::Retry(retry(e))
    } else {
        CopyFailed::Fail {
            reason: format!("the manifest of version {} is damaged: {e}", plan.version),
            retryable: false,
        }
    }
}

/// Why a copy of `bytes` of `version` onto `place` was refused for its filesystem's room
/// ([`Refused::NoRoom`]): a sentence for the request's `stage.failed`, as a full tier's.
fn no_room(place: &str, version: &str, bytes: u64, room: FsRoom) -> String {
    let has = if room.unwritten == 0 {
        format!("{} bytes available", room.available)
    } else {
        format!(
            "{} bytes available, {} of them promised to copies onto it still running or queued",
            room.available, room.unwritten
        )
    };
    format!(
        "{place} is full: its filesystem has {has}, and version {version} needs {bytes}; \
         others' files there count too: free space on the filesystem or wait for the demoter"
    )
}

/// What a copy stopped by its request's cancel returns: no facts (the cancel's answer was
/// published when it was given). An empty answer also keeps the cancel out of the failed-copy
/// memory that answers other requests of the version.
fn cancelled_copy() -> Result<Vec<Event>, HandlerError> {
    Ok(Vec::new())
}
