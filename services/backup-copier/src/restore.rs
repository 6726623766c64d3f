//! A real restore: a version copied back from the backup tier onto a tier data is used from,
//! verified, and recorded as a `replica.created` there (what `stagehand restore D@V --to TIER`
//! runs).
//!
//! The version is looked up in the catalogue (a unique prefix will do), and so is its copy on
//! a backup tier. Its manifest is restored from inside the backup and must hash to the version
//! digest; the files are then copied as one set to `<project>/<dataset>/<version>` on the
//! target tier (the promoter's layout), every file proven against the manifest (the policy's
//! `verify`), and published whole — nothing is visible there until all of it is. A rerun after
//! a failure resumes; a version already restored there is recorded again without a copy.
//! The `replica.created` fact's id is derived from the backup's `backup.completed` id and the
//! target tier, so restoring the same backup to the same tier twice records it once.

use stagehand_bus::Bus;
use stagehand_catalogue::{Catalogue, ReplicaRecord, ReplicaState, VersionBackups};
use stagehand_mover::{CancellationToken, Priority, Progress};
use stagehand_policy::TierRole;
use stagehand_schemas::{Body, Event, EventId, Location, ReplicaCreated, SCHEMA_VERSION};

use crate::copier::Copier;
use crate::error::BackupError;
use crate::layout::set_prefix;

/// What to restore, and where to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestoreRequest {
    /// Needed when several projects have a dataset of that name.
    pub project: Option<String>,
    pub dataset: String,
    /// A version digest or a unique prefix of one.
    pub version: String,
    /// The tier to restore onto (any tier but a backup tier).
    pub to: String,
}

/// What a restore did.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct RestoreReport {
    pub project: String,
    pub dataset: String,
    pub version: String,
    /// The backup restored from.
    pub from: Location,
    /// Where the version is now.
    pub to: Location,
    pub files: u64,
    pub bytes: u64,
    /// Files this run copied, and files a killed earlier run had already copied and proven.
    pub copied: u64,
    pub skipped: u64,
    /// The version was already restored there: nothing was copied.
    pub existed: bool,
    /// How the copy was proven (`read-back` or `hashed-in-flight`).
    pub verified_by: String,
    /// The `replica.created` fact recorded.
    pub fact_id: EventId,
}

/// The step of a restore's `replica.created` id: `restore:<tier>`.
pub fn restore_step(tier: &str) -> String {
    format!("restore:{tier}")
}

impl Copier {
    /// Restores `request` (see the module docs) and records it; `progress` follows the copy.
    pub async fn restore(
        &self,
        bus: &Bus,
        catalogue: &Catalogue,
        request: &RestoreRequest,
        progress: &Progress,
        cancel: &CancellationToken,
    ) -> Result<RestoreReport, BackupError> {
        let to_policy = self.policies.tier(&request.to).cloned().ok_or_else(|| {
            BackupError::NotFound(format!(
                "no tier {:?} in {}/tiers.toml",
                request.to,
                self.policies.dir().display()
            ))
        })?;
        if to_policy.role == TierRole::Backup {
            return Err(BackupError::Refused(format!(
                "tier {:?} is a backup tier; restore onto a tier data is used from",
                request.to
            )));
        }
        let (version, backup) = self.find_backup(catalogue, request).await?;
        let (_, from) = self.tier(&backup.tier)?;
        let (_, to) = self.tier(&request.to)?;
        // Restored onto a hot tier, a version is readable by its project's group only, as
        // the promoter stages it.
        let to = to.with_access(to_policy.set_access(&version.project));
        let manifest = self
            .read_manifest(&from, &backup.prefix, &version.version)
            .await?;
        let prefix = set_prefix(&version.project, &version.dataset, &version.version)?;
        let _one_at_a_time = self.lock_set(&request.to, &prefix).await;
        let verify = self.policy.verify;
        let report = self
            .copy_version(
                (&from, &backup.prefix),
                (&to, &prefix),
                &manifest,
                false,
                verify,
                Priority::Stage,
                progress,
                cancel,
            )
            .await?;
        let to_location = Location {
            tier: request.to.clone(),
            prefix,
        };
        let backup_event = backup.copied.as_ref().map(|s| s.event_id.clone());
        let fact = restored_fact(&version, backup_event, &to_location, verify.as_str());
        bus.publish(&fact).await?;
        tracing::info!(
            project = %version.project,
            dataset = %version.dataset,
            version = %version.version,
            from = %backup.tier,
            to = %request.to,
            files = manifest.files(),
            copied = report.copied,
            existed = report.existed,
            "restored from backup"
        );
        Ok(RestoreReport {
            project: version.project.clone(),
            dataset: version.dataset.clone(),
            version: version.version.clone(),
            from: Location {
                tier: backup.tier.clone(),
                prefix: backup.prefix.clone(),
            },
            to: to_location,
            files: manifest.files(),
            bytes: manifest.bytes(),
            copied: report.copied,
            skipped: report.skipped,
            existed: report.existed,
            verified_by: verify.as_str().to_owned(),
            fact_id: fact.id,
        })
    }

    /// The version `request` names and its present copy on a backup tier (this copier's own
    /// backup tier when it holds one).
    async fn find_backup(
        &self,
        catalogue: &Catalogue,
        request: &RestoreRequest,
    ) -> Result<(VersionBackups, ReplicaRecord), BackupError> {
        let version = match catalogue
            .version(
                request.project.as_deref(),
                &request.dataset,
                &request.version,
            )
            .await
        {
            Ok(detail) => VersionBackups {
                project: detail.version.project.clone(),
                dataset: detail.version.dataset.clone(),
                version: detail.version.version.clone(),
                files: detail.version.file_count,
                total_bytes: detail.version.total_bytes,
                recorded: true,
                backups: detail.replicas.into_iter().filter(|r| r.backup).collect(),
            },
            // A checkpoint's backup has no version record: look among the backups.
            Err(e) if e.is_not_found() => self.find_unrecorded(catalogue, request).await?,
            Err(e) => return Err(e.into()),
        };
        let present = |r: &&ReplicaRecord| r.backup && r.state == ReplicaState::Present;
        let backup = version
            .backups
            .iter()
            .filter(present)
            .find(|r| r.tier == self.target.name)
            .or_else(|| version.backups.iter().find(present))
            .cloned()
            .ok_or_else(|| {
                // A copy held damaged (its drill or a scrub found it so) is no copy to restore
                // from, and says why.
                let damaged: Vec<String> = (version.backups.iter())
                    .filter(|r| r.state == ReplicaState::Damaged)
                    .map(|r| {
                        format!(
                            "on {}: {}",
                            r.tier,
                            r.reason.as_deref().unwrap_or("damaged")
                        )
                    })
                    .collect();
                let why = if damaged.is_empty() {
                    String::new()
                } else {
                    format!(" that verifies (its backup {})", damaged.join("; "))
                };
                BackupError::NotFound(format!(
                    "{}/{}@{} has no copy on a backup tier{why}",
                    version.project, version.dataset, version.version
                ))
            })?;
        Ok((version, backup))
    }

    async fn find_unrecorded(
        &self,
        catalogue: &Catalogue,
        request: &RestoreRequest,
    ) -> Result<VersionBackups, BackupError> {
        let mut found = Vec::new();
        let mut after: Option<String> = None;
        loop {
            let page = catalogue
                .backup_status(
                    request.project.as_deref(),
                    None,
                    true,
                    Some(1000),
                    after.as_deref(),
                )
                .await?;
            found.extend(page.items.into_iter().filter(|v| {
                v.dataset == request.dataset && v.version.starts_with(&request.version)
            }));
            match page.next {
                Some(n) if found.len() < 2 => after = Some(n),
                _ => break,
            }
        }
        match found.len() {
            1 => Ok(found.remove(0)),
            0 => Err(BackupError::NotFound(format!(
                "no version {:?} of {:?} in the catalogue",
                request.version, request.dataset
            ))),
            _ => Err(BackupError::Refused(format!(
                "version prefix {:?} matches several backups of {:?}; give more characters or --project",
                request.version, request.dataset
            ))),
        }
    }
}

fn restored_fact(
    version: &VersionBackups,
    backup_event: Option<EventId>,
    to: &Location,
    verified_by: &str,
) -> Event {
    // Without the backup's fact (never the case for a backup the copier made), the restore is
    // its own chain.
    let cause = backup_event.unwrap_or_else(|| {
        EventId::for_content(&[
            b"restore",
            version.project.as_bytes(),
            version.dataset.as_bytes(),
            version.version.as_bytes(),
        ])
    });
    Event {
        id: EventId::for_fact(&version.project, &cause, &restore_step(&to.tier)),
        schema: SCHEMA_VERSION,
        occurred_at: stagehand_schemas::now(),
        project: version.project.clone(),
        correlation_id: cause.clone(),
        causation_id: Some(cause),
        body: Body::ReplicaCreated(ReplicaCreated {
            dataset: version.dataset.clone(),
            version: version.version.clone(),
            location: to.clone(),
            files: version.files,
            total_bytes: version.total_bytes,
            verified_by: verified_by.to_owned(),
            // A restore goes to a shared tier (capacity, hot), never to one node's.
            node: None,
        }),
    }
}
