//! What a fact asks to protect, and where its copy lives on the backup tier.
//!
//! A version is backed up as one set, `<project>/<dataset>/<version>/`: the files at their
//! manifest paths and the version's canonical manifest as [`MANIFEST_NAME`] inside it,
//! published together (nothing of a set is visible before all of it is, its manifest
//! included). The folder is content-addressed, so the same bytes are one backup however often
//! they are uploaded, and the manifest makes the backup tier restorable and verifiable on its
//! own: its SHA-256 is the version digest, which commits to every file's size and hash, so a
//! restore needs nothing from the live platform but that digest (`stagehand cp -r --manifest`
//! can do it by hand). A checkpoint is protected the same way, as a version of a dataset named
//! after its run: `<project>/<run>/<digest of its manifest>/`.

use stagehand_policy::{BackupPolicy, BackupSelect};
use stagehand_schemas::{Body, Event, Location};

use crate::error::BackupError;

/// Something a fact asks the copier to protect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Protect {
    pub project: String,
    /// The dataset, or for a checkpoint its run.
    pub dataset: String,
    /// The version digest the fact names; for a checkpoint, `None` until its manifest is read
    /// (the checkpoint's version is its manifest's digest).
    pub version: Option<String>,
    /// Where the bytes are now.
    pub source: Location,
    /// For a checkpoint, its step (logs only).
    pub step: Option<u64>,
}

/// What `event` asks to protect under `policy`, or `None` when the policy does not select it
/// (another kind, another project, a checkpoint without a selected tag).
pub fn selected(policy: &BackupPolicy, event: &Event) -> Option<Protect> {
    let kind_selected = |k: BackupSelect| policy.select.contains(&k);
    if !policy.projects.is_empty() && !policy.projects.contains(&event.project) {
        return None;
    }
    let (dataset, version, source, step) = match &event.body {
        Body::DatasetValidated(p) if kind_selected(BackupSelect::DatasetValidated) => {
            (&p.dataset, Some(p.version.clone()), &p.source, None)
        }
        Body::DatasetPrepared(p) if kind_selected(BackupSelect::DatasetPrepared) => {
            (&p.dataset, Some(p.version.clone()), &p.location, None)
        }
        Body::CheckpointCommitted(p) if kind_selected(BackupSelect::CheckpointCommitted) => {
            let tagged = policy.checkpoint_tags.is_empty()
                || p.tags.iter().any(|t| policy.checkpoint_tags.contains(t));
            if !tagged {
                return None;
            }
            (&p.run, None, &p.location, Some(p.step))
        }
        _ => return None,
    };
    Some(Protect {
        project: event.project.clone(),
        dataset: dataset.clone(),
        version,
        source: source.clone(),
        step,
    })
}

/// The folder a version's backup is published as: `<project>/<dataset>/<version>`
/// (`stagehand_schemas::layout::checked_version_folder`). Refuses a project or dataset that is
/// not a name, or a version that is not a digest.
pub fn set_prefix(project: &str, dataset: &str, version: &str) -> Result<String, BackupError> {
    stagehand_schemas::layout::checked_version_folder(project, dataset, version).map_err(|e| {
        BackupError::Refused(format!("{e}: it cannot name a folder on the backup tier"))
    })
}

/// The name of the manifest inside a backup set. A version holding a file of that name at
/// its root cannot be backed up (refused with that reason).
pub const MANIFEST_NAME: &str = stagehand_schemas::layout::BACKUP_MANIFEST_NAME;

/// Where the canonical manifest of the backup at `set_prefix` lives: inside the set.
pub fn manifest_path(set_prefix: &str) -> String {
    format!("{set_prefix}/{MANIFEST_NAME}")
}

#[cfg(test)]
mod tests {
    use stagehand_schemas::{CheckpointCommitted, DatasetValidated, EventId};

    use super::*;

    fn policy(text: &str) -> BackupPolicy {
        toml::from_str(text).unwrap()
    }

    fn validated(project: &str) -> Event {
        Event::request(
            EventId::new("v-1").unwrap(),
            project,
            Body::DatasetValidated(DatasetValidated {
                dataset: "cats".into(),
                version: "a".repeat(64),
                source: Location {
                    tier: "source".into(),
                    prefix: format!("{project}/cats/x"),
                },
                files: vec![],
                manifest: None,
                total_bytes: 0,
                requested_by: "alice".into(),
                request_id: EventId::new("r-1").unwrap(),
                labels: vec![],
            }),
        )
    }

    fn checkpoint(tags: &[&str]) -> Event {
        Event::request(
            EventId::new("c-1").unwrap(),
            "lab-a",
            Body::CheckpointCommitted(CheckpointCommitted {
                run: "llama-7b".into(),
                step: 1000,
                location: Location {
                    tier: "hot".into(),
                    prefix: "lab-a/ckpt/1000".into(),
                },
                files: vec![],
                manifest: None,
                total_bytes: 0,
                tags: tags.iter().map(|t| (*t).to_owned()).collect(),
            }),
        )
    }

    const BASE: &str = "target = \"backup\"\ndrill_every = \"1d\"\ndrill_sample_files = 1\ndrill_sample_bytes = \"1 MiB\"\n";

    #[test]
    fn the_policy_selects_by_kind_project_and_tag() {
        let all = policy(&format!(
            "{BASE}select = [\"dataset.validated\", \"checkpoint.committed\"]\nprojects = []\ncheckpoint_tags = [\"keep\"]\n"
        ));
        let p = selected(&all, &validated("lab-a")).unwrap();
        assert_eq!(p.version.as_deref(), Some("a".repeat(64).as_str()));
        assert_eq!(p.source.tier, "source");
        assert!(selected(&all, &checkpoint(&["keep", "best"])).is_some());
        assert_eq!(selected(&all, &checkpoint(&["best"])), None);

        let one = policy(&format!(
            "{BASE}select = [\"dataset.prepared\"]\nprojects = [\"lab-b\"]\ncheckpoint_tags = []\n"
        ));
        assert_eq!(
            selected(&one, &validated("lab-b")),
            None,
            "kind not selected"
        );
        let two = policy(&format!(
            "{BASE}select = [\"dataset.validated\"]\nprojects = [\"lab-b\"]\ncheckpoint_tags = []\n"
        ));
        assert_eq!(
            selected(&two, &validated("lab-a")),
            None,
            "project not selected"
        );
        assert!(selected(&two, &validated("lab-b")).is_some());
    }

    #[test]
    fn a_backup_folder_is_content_addressed_and_confined() {
        let v = "b".repeat(64);
        assert_eq!(
            set_prefix("lab-a", "cats", &v).unwrap(),
            format!("lab-a/cats/{v}")
        );
        assert_eq!(
            manifest_path("lab-a/cats/v"),
            "lab-a/cats/v/.stagehand-manifest"
        );
        for bad in ["../x", "a/b", ".hidden", ""] {
            assert!(set_prefix("lab-a", bad, &v).is_err(), "{bad:?}");
        }
        assert!(set_prefix("Lab A", "cats", &v).is_err());
        assert!(set_prefix("lab-a", "cats", "abc").is_err());
    }
}
