//! `stagehand backup status` and `stagehand restore D@V --to TIER`.
//!
//! `backup status` asks the catalogue (`backup_status`, page by page) and shows, per version:
//! whether a backup tier holds a copy, when it was made, when it was last drilled and what the
//! drill found. A version is *flagged* when nothing protects it, when its backup was never
//! drilled, or when its last drill failed — the three states in which nobody knows it can be
//! restored. `--check` exits 1 when any version is flagged (for monitoring).
//!
//! `restore` runs the backup copier's restore in this process (the policies name the tiers and
//! their credentials come from the environment, as for every command that moves bytes): the
//! version's manifest is read from the backup and checked against the catalogue's digest,
//! every file is copied and proven, the set appears whole on the target tier, and a
//! `replica.created` there is recorded.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::Serialize;
use stagehand_backup_copier::{Copier, RestoreReport, RestoreRequest};
use stagehand_bus::Bus;
use stagehand_catalogue::time::human;
use stagehand_catalogue::{
    Catalogue, Drill, MAX_PAGE, ReplicaRecord, ReplicaState, VersionBackups,
};
use stagehand_mover::{CancellationToken, MoverConfig, Progress};
use stagehand_schemas::Retryable;

/// Why a version is flagged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Flag {
    /// No backup tier holds a present copy.
    NotProtected,
    /// Its backup was never drilled.
    NeverDrilled,
    /// Its last drill failed.
    DrillFailed,
}

impl Flag {
    fn text(self) -> &'static str {
        match self {
            Flag::NotProtected => "not protected",
            Flag::NeverDrilled => "never drilled",
            Flag::DrillFailed => "drill failed",
        }
    }
}

/// One line of `backup status`: a version and what protects it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VersionStatus {
    pub project: String,
    pub dataset: String,
    pub version: String,
    pub files: u64,
    pub total_bytes: u64,
    pub protected: bool,
    /// The backup tier of the copy shown: the most recently drilled present one, else the one
    /// held damaged by its failed drill.
    pub backup_tier: Option<String>,
    #[serde(with = "stagehand_catalogue::time::utc::option")]
    pub last_backup: Option<time::OffsetDateTime>,
    pub last_drill: Option<Drill>,
    pub flag: Option<Flag>,
}

/// What `backup status` shows of one version.
pub fn version_status(v: &VersionBackups) -> VersionStatus {
    let present: Vec<&ReplicaRecord> = v
        .backups
        .iter()
        .filter(|r| r.state == ReplicaState::Present)
        .collect();
    // The copy that tells the most: drilled most recently, else backed up most recently.
    let shown = present
        .iter()
        .max_by_key(|r| {
            (
                r.last_drill.as_ref().map(|d| d.stamp.clone()),
                r.copied.clone(),
            )
        })
        .copied();
    // With no present copy, one the catalogue holds damaged because its drill failed tells
    // more than "not protected": it is why, and its page is the drill's.
    let failed_drill = (v.backups.iter())
        .filter(|r| r.state == ReplicaState::Damaged)
        .filter(|r| r.last_drill.as_ref().is_some_and(|d| !d.ok))
        .max_by_key(|r| r.last_drill.as_ref().map(|d| d.stamp.clone()));
    let told = shown.or(failed_drill);
    let last_drill = told.and_then(|r| r.last_drill.clone());
    let flag = match (shown, &last_drill) {
        (None, Some(_)) => Some(Flag::DrillFailed),
        (None, None) => Some(Flag::NotProtected),
        (Some(_), None) => Some(Flag::NeverDrilled),
        (Some(_), Some(d)) if !d.ok => Some(Flag::DrillFailed),
        _ => None,
    };
    VersionStatus {
        project: v.project.clone(),
        dataset: v.dataset.clone(),
        version: v.version.clone(),
        files: v.files,
        total_bytes: v.total_bytes,
        protected: shown.is_some(),
        backup_tier: told.map(|r| r.tier.clone()),
        last_backup: present
            .iter()
            .filter_map(|r| r.copied.as_ref().map(|s| s.at))
            .max(),
        last_drill,
        flag,
    }
}

fn drill_text(d: &Option<Drill>) -> String {
    match d {
        None => "-".into(),
        Some(d) if d.ok => format!("verified ({} files)", d.sampled_files),
        Some(d) => {
            let first = d
                .problems
                .first()
                .map(|p| format!("{} {}", p.code, p.path.as_deref().unwrap_or("(no path)")))
                .unwrap_or_default();
            let more = d.problems.len().saturating_sub(1);
            if more > 0 {
                format!("FAILED: {first} (+{more} more)")
            } else {
                format!("FAILED: {first}")
            }
        }
    }
}

/// Options of `backup status`.
#[derive(Debug, Clone, Default)]
pub struct StatusOptions {
    pub project: Option<String>,
    /// Only copies on this backup tier count.
    pub tier: Option<String>,
    /// Only flagged versions are shown.
    pub flagged_only: bool,
    pub json: bool,
}

/// How many versions `backup status` showed, and how many were flagged.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StatusSummary {
    pub versions: u64,
    pub protected: u64,
    pub flagged: u64,
}

/// Prints every version's backup status, page by page (memory stays one page).
pub async fn status(
    catalogue: &Catalogue,
    opts: &StatusOptions,
    out: &mut dyn Write,
) -> anyhow::Result<StatusSummary> {
    let mut summary = StatusSummary::default();
    let mut after: Option<String> = None;
    if !opts.json {
        writeln!(
            out,
            "{:<44} {:<9} {:<20} {:<20} RESULT",
            "VERSION", "PROTECTED", "LAST BACKUP", "LAST DRILL"
        )?;
    }
    loop {
        let page = catalogue
            .backup_status(
                opts.project.as_deref(),
                opts.tier.as_deref(),
                false,
                Some(MAX_PAGE),
                after.as_deref(),
            )
            .await
            .context("asking the catalogue for backup status")?;
        for v in &page.items {
            let s = version_status(v);
            summary.versions += 1;
            summary.protected += u64::from(s.protected);
            summary.flagged += u64::from(s.flag.is_some());
            if opts.flagged_only && s.flag.is_none() {
                continue;
            }
            if opts.json {
                serde_json::to_writer(&mut *out, &s)?;
                writeln!(out)?;
                continue;
            }
            writeln!(
                out,
                "{:<44} {:<9} {:<20} {:<20} {}{}",
                format!(
                    "{}/{}@{}",
                    s.project,
                    s.dataset,
                    &s.version[..s.version.len().min(16)]
                ),
                if s.protected { "yes" } else { "NO" },
                s.last_backup.map(human).unwrap_or_else(|| "-".into()),
                s.last_drill
                    .as_ref()
                    .map(|d| human(d.stamp.at))
                    .unwrap_or_else(|| "never".into()),
                drill_text(&s.last_drill),
                s.flag
                    .map(|f| format!("  << FLAGGED: {}", f.text()))
                    .unwrap_or_default(),
            )?;
        }
        match page.next {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    if !opts.json {
        writeln!(
            out,
            "{} versions: {} protected, {} flagged",
            summary.versions, summary.protected, summary.flagged
        )?;
    }
    Ok(summary)
}

/// Options of `restore`.
#[derive(Debug, Clone)]
pub struct RestoreOptions {
    pub request: RestoreRequest,
    pub policies: PathBuf,
}

/// Restores a version from its backup (see the module docs); the scratch folder it needs is
/// made under the system's temp folder and removed afterwards.
pub async fn restore(
    bus: &Bus,
    catalogue: &Catalogue,
    opts: &RestoreOptions,
) -> anyhow::Result<RestoreReport> {
    let policies = stagehand_policy::Policies::load_dir(&opts.policies)
        .with_context(|| format!("loading policies from {}", opts.policies.display()))?;
    let scratch = std::env::temp_dir().join(format!("stagehand-restore-{}", std::process::id()));
    let copier = Copier::open(policies, &scratch, MoverConfig::default())?;
    let cancel = CancellationToken::new();
    let stop = cancel.clone();
    let ctrl_c = tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            stop.cancel();
        }
    });
    let restored = copier
        .restore(bus, catalogue, &opts.request, &Progress::new(), &cancel)
        .await;
    ctrl_c.abort();
    remove_scratch(&scratch);
    Ok(restored?)
}

/// Whether a failed restore is the answer "no" — the backup is damaged, missing or refused by
/// the rules, so the same restore would fail again — rather than a fault to retry: exit 1
/// instead of the exit code of an error.
pub fn restore_refused(err: &anyhow::Error) -> bool {
    err.downcast_ref::<stagehand_backup_copier::BackupError>()
        .is_some_and(|e| !e.is_retryable())
}

fn remove_scratch(dir: &Path) {
    if let Err(e) = std::fs::remove_dir_all(dir)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(dir = %dir.display(), error = %e, "could not remove the restore's scratch folder");
    }
}

/// What `restore` prints.
pub fn restore_text(r: &RestoreReport) -> String {
    format!(
        "restored {}/{}@{} from {}:{} to {}:{}\n  {} files, {} bytes, verified by {}{}\n  recorded replica.created {}\n",
        r.project,
        r.dataset,
        r.version,
        r.from.tier,
        r.from.prefix,
        r.to.tier,
        r.to.prefix,
        r.files,
        r.bytes,
        r.verified_by,
        if r.existed {
            " (already there: nothing copied)".to_owned()
        } else if r.skipped > 0 {
            format!(
                " ({} copied, {} already there from an earlier run)",
                r.copied, r.skipped
            )
        } else {
            String::new()
        },
        r.fact_id
    )
}

#[cfg(test)]
mod tests {
    use stagehand_catalogue::Stamp;
    use stagehand_schemas::{EventId, Problem};
    use time::macros::datetime;

    use super::*;

    fn replica(tier: &str, drill: Option<bool>) -> ReplicaRecord {
        let stamp = |at| Stamp {
            at,
            event_id: EventId::new("e").unwrap(),
        };
        ReplicaRecord {
            project: "lab-a".into(),
            dataset: "cats".into(),
            version: "a".repeat(64),
            tier: tier.into(),
            node: None,
            prefix: "lab-a/cats/a".into(),
            state: ReplicaState::Present,
            reason: None,
            stamp: Some(stamp(datetime!(2026-12-01 06:00 UTC))),
            files: 2,
            total_bytes: 3,
            verified_by: Some("backup".into()),
            backup: true,
            copied: Some(stamp(datetime!(2026-12-01 06:00 UTC))),
            last_drill: drill.map(|ok| Drill {
                ok,
                sampled_files: 2,
                problems: if ok {
                    vec![]
                } else {
                    vec![Problem::new("checksum_mismatch", Some("b.bin"), "bad")]
                },
                stamp: stamp(datetime!(2026-12-01 07:00 UTC)),
            }),
            last_verified: None,
            last_repaired: None,
        }
    }

    fn version(backups: Vec<ReplicaRecord>) -> VersionBackups {
        VersionBackups {
            project: "lab-a".into(),
            dataset: "cats".into(),
            version: "a".repeat(64),
            files: 2,
            total_bytes: 3,
            recorded: true,
            backups,
        }
    }

    #[test]
    fn unprotected_undrilled_and_failed_versions_are_flagged() {
        assert_eq!(
            version_status(&version(vec![])).flag,
            Some(Flag::NotProtected)
        );
        let never = version_status(&version(vec![replica("backup", None)]));
        assert_eq!(never.flag, Some(Flag::NeverDrilled));
        assert!(never.protected);
        let failed = version_status(&version(vec![replica("backup", Some(false))]));
        assert_eq!(failed.flag, Some(Flag::DrillFailed));
        assert_eq!(
            drill_text(&failed.last_drill),
            "FAILED: checksum_mismatch b.bin"
        );
        let ok = version_status(&version(vec![replica("backup", Some(true))]));
        assert_eq!(ok.flag, None);
        assert_eq!(drill_text(&ok.last_drill), "verified (2 files)");
        let mut removed = replica("backup", Some(true));
        removed.state = ReplicaState::Removed;
        assert_eq!(
            version_status(&version(vec![removed])).flag,
            Some(Flag::NotProtected),
            "a removed copy protects nothing"
        );
        // The catalogue holds a backup whose drill failed damaged: not a protection, and
        // flagged for its drill, with what the drill found.
        let mut damaged = replica("backup", Some(false));
        damaged.state = ReplicaState::Damaged;
        let failed = version_status(&version(vec![damaged.clone()]));
        assert_eq!(failed.flag, Some(Flag::DrillFailed));
        assert!(!failed.protected);
        assert_eq!(failed.backup_tier.as_deref(), Some("backup"));
        assert_eq!(
            drill_text(&failed.last_drill),
            "FAILED: checksum_mismatch b.bin"
        );
        damaged.last_drill = None;
        assert_eq!(
            version_status(&version(vec![damaged])).flag,
            Some(Flag::NotProtected),
            "a copy damaged otherwise protects nothing"
        );
    }
}
