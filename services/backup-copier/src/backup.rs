//! Backing up: one selected fact in (`dataset.validated`, `dataset.prepared`,
//! `checkpoint.committed`), one `backup.completed` out.
//!
//! For each fact the policy selects, the copier opens the fact's manifest (verified against
//! its digest), refuses a source in the backup tier's failure domain, copies the files and the
//! manifest as one set onto the backup tier (staged, proven by the policy's `verify`, published
//! whole: a posix folder renamed into place, or an S3 prefix with its completion marker
//! written last), checks the Object Lock hold on S3, and publishes
//! `backup.completed`. A backup already present is not copied again; a killed copy is resumed.

use std::sync::Arc;

use async_nats::jetstream;
use stagehand_bus::{Handler, HandlerError, WorkContext};
use stagehand_manifest::{ManifestError, open_manifest};
use stagehand_mover::{Priority, Progress};
use stagehand_schemas::{BackupCompleted, Body, Event, Location};
use tracing::info;

use crate::copier::Copier;
use crate::error::BackupError;
use crate::layout::{MANIFEST_NAME, selected, set_prefix};
use stagehand_schemas::Retryable;

/// The step of a `backup.completed` fact's id: `backup:<backup tier>`.
pub fn backup_step(tier: &str) -> String {
    format!("backup:{tier}")
}

/// The backup copier as a worker-runtime handler.
pub struct Backups {
    pub(crate) copier: Arc<Copier>,
    pub(crate) js: jetstream::Context,
}

impl Backups {
    pub fn new(copier: Arc<Copier>, js: jetstream::Context) -> Self {
        Backups { copier, js }
    }

    /// The facts backing up `event` causes: one `backup.completed`, or none when the policy
    /// does not select the event.
    pub async fn back_up(
        &self,
        event: &Event,
        cancel: &stagehand_mover::CancellationToken,
    ) -> Result<Vec<Event>, BackupError> {
        let copier = &self.copier;
        let Some(what) = selected(copier.policy(), event) else {
            return Ok(vec![]);
        };
        let (source_policy, source) = copier.tier(&what.source.tier)?;
        copier.check_failure_domain(&source_policy)?;
        let manifest = open_manifest(&self.js, event, &copier.spool)
            .await?
            .ok_or_else(|| BackupError::Refused(format!("{} carries no manifest", event.kind())))?;
        let version = match &what.version {
            Some(v) if v != manifest.digest() => {
                return Err(BackupError::Refused(format!(
                    "the fact names version {v} but its manifest's digest is {}",
                    manifest.digest()
                )));
            }
            Some(v) => v.clone(),
            None => manifest.digest().to_owned(),
        };
        let prefix = set_prefix(&what.project, &what.dataset, &version)?;
        let (m, name) = (manifest.clone(), MANIFEST_NAME);
        // Entries are in path order: the search stops at the first path past the name.
        // A manifest that cannot be read is that error, not "no clash".
        let clash = tokio::task::spawn_blocking(move || -> Result<bool, ManifestError> {
            for entry in m.entries() {
                let entry = entry?;
                if entry.path.as_bytes() >= name.as_bytes() {
                    return Ok(entry.path == name);
                }
            }
            Ok(false)
        })
        .await
        .map_err(|e| BackupError::Refused(format!("the manifest check stopped: {e}")))??;
        if clash {
            return Err(BackupError::Refused(format!(
                "version {version} holds a file named {MANIFEST_NAME} at its root, the name its backup keeps its manifest under"
            )));
        }
        let backup = copier.backup.clone();
        // Two facts of one version (two uploads of the same bytes) are one set: this process
        // stages it once at a time.
        let _one_at_a_time = copier.lock_set(&copier.target().name, &prefix).await;
        let progress = Progress::new();
        let report = copier
            .copy_version(
                (&source, &what.source.prefix),
                (&backup, &prefix),
                &manifest,
                true,
                copier.policy().verify,
                Priority::Backup,
                &progress,
                cancel,
            )
            .await?;
        copier.check_locked(&prefix).await?;
        info!(
            event_id = %event.id,
            project = %what.project,
            dataset = %what.dataset,
            %version,
            step = ?what.step,
            from = %what.source.tier,
            to = %copier.target().name,
            prefix = %prefix,
            files = manifest.files(),
            copied = report.copied,
            skipped = report.skipped,
            existed = report.existed,
            resumed = report.resumed,
            engine = report.engine,
            "backed up"
        );
        Ok(vec![event.caused(
            &backup_step(&copier.target().name),
            Body::BackupCompleted(BackupCompleted {
                dataset: what.dataset,
                version,
                location: Location {
                    tier: copier.target().name.clone(),
                    prefix,
                },
                files: manifest.files(),
                total_bytes: manifest.bytes(),
            }),
        )])
    }
}

impl Handler for Backups {
    async fn handle(&self, event: &Event, ctx: &WorkContext) -> Result<Vec<Event>, HandlerError> {
        self.back_up(event, ctx.shutdown()).await.map_err(|e| {
            if e.is_retryable() {
                tracing::warn!(event_id = %event.id, error = %e, "backup failed; it will be retried");
            } else {
                tracing::error!(event_id = %event.id, error = %e, "backup refused; dead-lettered for on-call");
            }
            HandlerError::from(e)
        })
    }
}
