//! One recorded step carrying a replica off a tier, phase by phase: copied down, its use
//! taken, withdrawn from the catalogue, renamed out of the namespace, deleted.

use std::time::Duration;

use async_nats::jetstream::kv;
use futures::StreamExt;
use stagehand_bus::placement;
use stagehand_catalogue::views::{self as view, Placed};
use stagehand_catalogue::{ReadinessKey, kv_key};
use stagehand_manifest::{ManifestBuilder, Spool};
use stagehand_mover::{CopyOptions, Priority, Progress, SetCopy, Tier, VerifyMode};
use stagehand_schemas::{
    Body, CheckpointExpired, Event, EventId, Location, ReplicaCreated, ReplicaRemoved,
};
use time::OffsetDateTime;
use tracing::{info, warn};

use crate::STOP_BEFORE_RENAME_ENV;
use crate::state::{CheckpointPlace, Phase, Step};

use super::{Demoter, PassError, PassReport, step_err};

/// How the copy down is proven: read back before it is published, since it is about to become
/// the only copy on a durable tier.
pub const COPY_DOWN_VERIFY: VerifyMode = VerifyMode::ReadBack;

/// The mover's class for demotion copies: the background one.
pub const COPY_DOWN_PRIORITY: Priority = Priority::Backup;

/// How long a step waits for the catalogue to withdraw a replica's readiness before it is left
/// for the next pass.
const WITHDRAW_WAIT: Duration = Duration::from_secs(30);

impl Demoter {
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
    pub(super) async fn carry(
        &self,
        mut step: Step,
        report: &mut PassReport,
    ) -> Result<(), PassError> {
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
        if step.phase == Phase::Planned && step.node.is_some() && step.copy_to.is_some() {
            // Recorded by an earlier demoter, which copied a node's last copy down itself: a
            // node's demoter states nothing about a shared tier now, so the replica stays.
            warn!(prefix = %step.prefix, node = step.node.as_deref().unwrap_or("-"), "a step that would copy a node's replica down is dropped; the replica stays");
            self.p().state.forget(&step).await?;
            report.kept_last_copies += 1;
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
        let hidden = stagehand_schemas::layout::removal_folder(&step.prefix);
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
            shared_elsewhere: true,
            verified_by: None,
            last_verified: None,
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

    /// Copies the replica to `target`, proven by reading it back, and announces it with
    /// `replica.created`. A set already there counts as the copy only once every file of it
    /// verified against the version's list (hashes, not names); otherwise the mover replaces
    /// it with a verified copy in one atomic publish ([`Mover::stage_set`]).
    pub(super) async fn copy_down(
        &self,
        step: &Step,
        src: &Tier,
        target: &str,
    ) -> Result<(), PassError> {
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
        let staged = match self
            .p()
            .mover
            .stage_set(src, dst, &set, files, &progress, &cancel, |_| {})
            .await
        {
            Ok(staged) => staged,
            Err(e) => return Err(crate::damage::copy_down_failed(&self.p().bus, step, e).await),
        };
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
    pub(super) async fn withdrawn(&self, step: &Step) -> Result<bool, PassError> {
        let key = kv_key(&ReadinessKey {
            project: step.project.clone(),
            dataset: step.dataset.clone(),
            version: step.version.clone(),
            tier: step.tier.clone(),
            node: step.node.clone(),
        });
        let not_ready = |put: bool, value: &[u8]| {
            !put || serde_json::from_slice::<serde_json::Value>(value)
                .ok()
                .and_then(|v| v.get("ready").and_then(|r| r.as_bool()))
                != Some(true)
        };
        let bucket = &self.p().readiness;
        match bucket.entry(&key).await.map_err(step_err)? {
            None => return Ok(true),
            Some(e) if not_ready(e.operation == kv::Operation::Put, &e.value) => return Ok(true),
            Some(_) => {}
        }
        // Still ready: watched from its latest value on, so a withdrawal made since the read
        // above is the watch's first message, never missed.
        let mut watch = watch_key(&self.p().bus, bucket, &key).await?;
        let waited = tokio::time::timeout(WITHDRAW_WAIT, async {
            while let Some(m) = watch.next().await {
                match m {
                    Ok(m) if not_ready(is_put(&m), &m.payload) => return true,
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

/// The values of `key` in `bucket`, its latest first, on an ordered consumer named for this
/// watch. Its create request's subject names the consumer and the key's subject
/// (`$JS.API.CONSUMER.CREATE.<stream>.<name>.<subject>`), so a node's user can be granted the
/// watch of its own node's readiness keys alone (`NODE_<N>` in accounts.conf); the kv watch
/// asks on `….CREATE.<stream>`, which names no key.
async fn watch_key(
    bus: &stagehand_bus::Bus,
    bucket: &kv::Store,
    key: &str,
) -> Result<async_nats::jetstream::consumer::push::Ordered, PassError> {
    use async_nats::jetstream::consumer::{DeliverPolicy, push::OrderedConfig};
    let started = OffsetDateTime::now_utc().unix_timestamp_nanos().to_string();
    let name = EventId::for_content(&[b"withdrawn", key.as_bytes(), started.as_bytes()]);
    let consumer = bucket
        .stream
        .create_consumer(OrderedConfig {
            name: Some(format!("withdrawn-{}", &name.as_str()[..16])),
            deliver_subject: bus.client().new_inbox(),
            filter_subject: format!("{}{key}", bucket.prefix),
            deliver_policy: DeliverPolicy::LastPerSubject,
            ..Default::default()
        })
        .await
        .map_err(step_err)?;
    consumer.messages().await.map_err(step_err)
}

/// Whether a message of a KV bucket's stream is a put (not a delete or purge marker).
fn is_put(m: &async_nats::jetstream::Message) -> bool {
    let op = (m.headers.as_ref()).and_then(|h| h.get("KV-Operation"));
    !op.is_some_and(|op| matches!(op.as_str(), "DEL" | "PURGE"))
}
