//! What the backup copier's tests share: policies with tiers under a temp dir, the shared
//! stack (stagehand_testkit::Stack: a real nats-server and the catalogue recorder
//! in-process), facts published as the validator and a training job would publish them, and
//! the catalogue's view of backups.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use std::ops::Deref;

use stagehand_catalogue::{Catalogue, VersionBackups};
use stagehand_schemas::{
    Body, CheckpointCommitted, Event, EventId, FileRef, Location, version_digest,
};
use stagehand_testkit::{PolicyFiles, put_files, validated_fact, wait_for};

pub const WAIT: Duration = Duration::from_secs(60);
pub const PROJECT: &str = "lab-a";

/// Tiers: a posix source, a posix hot tier in `hot_domain`, a posix capacity tier, and the
/// backup tier (`backup_tier`: a `[tiers.backup]` body; [`posix_backup`] by default).
pub fn tiers_toml(root: &Path, hot_domain: &str, backup_tier: &str) -> String {
    format!(
        r#"[tiers.source]
kind = "posix"
role = "source"
failure_domain = "lab-uploads"
root = "{root}/source"

[tiers.capacity]
kind = "posix"
role = "capacity"
failure_domain = "capacity-store"
root = "{root}/capacity"

[tiers.hot]
kind = "posix"
role = "hot"
failure_domain = "{hot_domain}"
root = "{root}/hot"
capacity = "1 GiB"

[tiers.backup]
{backup_tier}
"#,
        root = root.display()
    )
}

/// A posix backup tier under `root` protecting the source and capacity tiers.
pub fn posix_backup(root: &Path) -> String {
    format!(
        "kind = \"posix\"\nrole = \"backup\"\nfailure_domain = \"backup-site\"\nroot = \"{}/backup\"\nprotects = [\"source\", \"capacity\"]\n",
        root.display()
    )
}

/// A backup policy drilling every `drill_every`, whole versions of up to 64 files.
pub fn backup_toml(drill_every: &str, extra: &str) -> String {
    format!(
        "target = \"backup\"\nselect = [\"dataset.validated\", \"checkpoint.committed\"]\nprojects = []\ncheckpoint_tags = [\"keep\"]\nverify = \"read-back\"\ndrill_every = \"{drill_every}\"\ndrill_sample_files = 64\ndrill_sample_bytes = \"64 MiB\"\n{extra}"
    )
}

/// Writes a policy folder: `tiers`, the shipped validation policy and `backup`.
pub fn write_policies(dir: &Path, tiers: &str, backup: &str) {
    // The posix tier roots exist, as `stagehand up` or a mount makes them.
    let root = dir.parent().unwrap();
    for tier in ["source", "capacity", "hot"] {
        std::fs::create_dir_all(root.join(tier)).unwrap();
    }
    PolicyFiles::new()
        .file("tiers.toml", tiers)
        .shipped("validation.toml")
        .file("backup.toml", backup)
        .write(dir);
}

/// Writes `files` under `dir` and returns their references (paths relative to `dir`).
pub fn write_files(dir: &Path, files: &[(&str, Vec<u8>)]) -> Vec<FileRef> {
    put_files(dir, files)
}

/// `n` files of `size` bytes each, different in every byte position.
pub fn sample_files(n: usize, size: usize) -> Vec<(String, Vec<u8>)> {
    (0..n)
        .map(|i| {
            let bytes = (0..size)
                .map(|j| ((i * 31 + j * 7) % 251) as u8)
                .collect::<Vec<u8>>();
            (format!("part-{}/{i:04}.bin", i % 3), bytes)
        })
        .collect()
}

/// A `dataset.validated` for files already on the source tier under `prefix`, as the ingest
/// validator publishes it (manifest inline).
pub fn validated(dataset: &str, prefix: &str, files: Vec<FileRef>) -> Event {
    let version = version_digest(&files);
    validated_fact(
        PROJECT,
        EventId::for_ingest(PROJECT, dataset, &version),
        dataset,
        Location {
            tier: "source".into(),
            prefix: prefix.into(),
        },
        &files,
        None,
    )
}

/// A `checkpoint.committed` for files on `tier` under `prefix`, as a training job's hook
/// publishes it.
pub fn checkpoint(
    run: &str,
    step: u64,
    tier: &str,
    prefix: &str,
    files: Vec<FileRef>,
    tags: &[&str],
) -> Event {
    Event::request(
        EventId::new(format!("ckpt-{run}-{step}")).unwrap(),
        PROJECT,
        Body::CheckpointCommitted(CheckpointCommitted {
            run: run.into(),
            step,
            location: Location {
                tier: tier.into(),
                prefix: prefix.into(),
            },
            total_bytes: files.iter().map(|f| f.size).sum(),
            files,
            manifest: None,
            tags: tags.iter().map(|t| (*t).to_owned()).collect(),
        }),
    )
}

/// The shared stack with the catalogue recorder running; the copier is started on it.
pub struct Stack {
    kit: stagehand_testkit::Stack,
    pub catalogue: Catalogue,
}

impl Deref for Stack {
    type Target = stagehand_testkit::Stack;
    fn deref(&self) -> &Self::Target {
        &self.kit
    }
}

impl Stack {
    pub async fn start() -> Stack {
        let kit = stagehand_testkit::Stack::builder().recorder().start().await;
        let catalogue = kit.catalogue();
        Stack { kit, catalogue }
    }

    /// Runs the backup copier in-process with `policies`, state under `state`, the drill clock
    /// looking every 100 ms.
    pub fn start_copier(&mut self, policies: &Path, state: &Path) {
        let mut config = stagehand_backup_copier::config(&self.nats.url(), policies, state);
        config.service.drill_check = Duration::from_millis(100);
        self.kit.run(stagehand_backup_copier::SERVICE, |token| {
            stagehand_backup_copier::run(config, token)
        });
    }

    /// The catalogue's backup status of `dataset`'s version `version`.
    pub async fn status(&self, dataset: &str, version: &str) -> Option<VersionBackups> {
        let page = self
            .catalogue
            .backup_status(Some(PROJECT), None, false, Some(1000), None)
            .await
            .ok()?;
        page.items
            .into_iter()
            .find(|v| v.dataset == dataset && v.version == version)
    }

    /// Waits until the catalogue shows `check` of `dataset@version`'s backup status.
    pub async fn wait_status(
        &self,
        what: &str,
        dataset: &str,
        version: &str,
        check: impl Fn(&VersionBackups) -> bool,
    ) -> VersionBackups {
        wait_for(WAIT, what, || async {
            self.status(dataset, version).await.filter(|s| check(s))
        })
        .await
        .unwrap()
    }

    pub async fn stop(self) {
        self.kit.stop().await;
    }
}

/// The version's copy on the tier `backup`, whatever its state (a drill that fails holds it
/// damaged).
pub fn backup_copy(v: &VersionBackups) -> Option<&stagehand_catalogue::ReplicaRecord> {
    v.backups.iter().find(|r| r.tier == "backup")
}

/// The files beneath `dir`, relative, sorted; hidden staging folders and temp files included.
pub fn listing(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    fn walk(base: &Path, dir: &Path, out: &mut Vec<String>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            let path = e.path();
            if path.is_dir() {
                out.push(format!("{}/", path.strip_prefix(base).unwrap().display()));
                walk(base, &path, out);
            } else {
                out.push(path.strip_prefix(base).unwrap().display().to_string());
            }
        }
    }
    walk(dir, dir, &mut out);
    out.sort();
    out
}

pub fn tmp_root() -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().to_owned();
    (tmp, root)
}
