//! Placing a local folder on a posix tier: walked, copied and hashed in one pass, published
//! atomically under the prefix its *measured* digest names.
//!
//! The walk streams into the mover's set copy ([`Mover::stage_set`]), which copies each chunk
//! of files into a hidden staging folder beside the versions (created with `mkdirat` through
//! confined directory handles), hashing every byte as it copies it; each proven file's
//! SHA-256 goes to the manifest builder as it lands. Nothing is held per file beyond the
//! builder's bounded run. When the last file is in, the manifest's digest is known and the
//! staging folder is renamed (`renameat2(RENAME_NOREPLACE)` between confined handles) to
//! `<project>/<dataset>/<first 16 hex of the digest>` ([`StagedSet::publish_as`]). A reader
//! never sees a partial version; the same bytes placed twice are one version (the second copy
//! is removed and the placement says it existed).
//!
//! **Temporaries.** Each run stages in a folder of its own,
//! `<project>/<dataset>/.upload-<run>.stagehand-set-<owner>` (the owner token names this
//! process, so it can be proven dead). A run that fails removes its own staging folder; a run
//! killed outright leaves it, and the next ingest into the same dataset removes it at start
//! ([`PosixTier::sweep_stale_entries`]: only folders whose writer is provably dead, so a live
//! upload beside it is never touched). A rerun does not resume the dead run's copy: with the
//! hashes unknown, checking a file already staged costs a read of both copies, no less than
//! copying it again.

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use futures::StreamExt;
use stagehand_manifest::{Manifest, Spool};
use stagehand_mover::{
    CancellationToken, CopyOptions, Mover, MoverConfig, PosixTier, Priority, Progress, SetCopy,
    SetReport, StagedSet, SweepOptions, SweepReport, Tier,
};
use stagehand_schemas::{EventId, layout};

use super::manifest::BuilderThread;
use super::walk::{self, WalkOptions};

/// Where an upload was placed and what it holds.
#[derive(Debug)]
pub struct Placed {
    /// The version's prefix on the tier: `<project>/<dataset>/<first 16 hex of the digest>`.
    pub prefix: String,
    /// The manifest measured while copying (its digest names the prefix).
    pub manifest: Manifest,
    /// What the set copy did; `existed` when the same version was there already.
    pub report: SetReport,
    /// Stale temporaries of dead earlier runs removed at start.
    pub swept: SweepReport,
}

/// Copies `folder` onto `tier` as one version of `dataset` (see the module docs). `progress`
/// counts files and bytes copied (its totals grow as the walk finds files).
pub async fn place(
    tier: &PosixTier,
    folder: &Path,
    project: &str,
    dataset: &str,
    spool: &Spool,
    progress: &Progress,
) -> anyhow::Result<Placed> {
    let dir = layout::dataset_folder(project, dataset);
    let swept = {
        let (t, d) = (tier.clone(), dir.clone());
        tokio::task::spawn_blocking(move || {
            t.sweep_stale_entries(
                &d,
                SweepOptions {
                    keep_sets_for: Duration::ZERO,
                },
            )
        })
        .await?
        .with_context(|| {
            format!(
                "removing stale temporaries in {dir} on tier {}",
                tier.name()
            )
        })?
    };
    let upload = Tier::Posix(
        PosixTier::open("upload", folder)
            .with_context(|| format!("cannot open folder {}", folder.display()))?,
    );
    let run = format!("upload-{}", EventId::random());
    let set = SetCopy {
        src_prefix: String::new(),
        dst_prefix: format!("{dir}/{run}"),
        opts: CopyOptions {
            priority: Priority::Ingest,
            expected_hash_unknown: true,
            ..CopyOptions::default()
        },
        chunk_files: 0,
        totals: None,
    };
    let mover = Mover::new(MoverConfig::default())?;
    let builder = BuilderThread::start(spool)?;
    let walk = walk::start(folder, WalkOptions::default())?;
    let files = futures::stream::unfold(walk.files, |mut rx| async move {
        rx.recv().await.map(|f| (f, rx))
    })
    .fuse();
    let staged = mover
        .stage_set(
            &upload,
            &Tier::Posix(tier.clone()),
            &set,
            Box::pin(files),
            progress,
            &CancellationToken::new(),
            |file| builder.push(file.clone()),
        )
        .await;
    let walked = walk.done.await.context("the folder walk failed")?;
    let staged = match (staged, walked) {
        (Ok(staged), Ok(_)) => staged,
        (Ok(staged), Err(walk_error)) => {
            // The walk stopped early: what was staged is not the folder.
            discard(staged).await;
            return Err(walk_error);
        }
        (Err(copy_error), _) => {
            remove_run_staging(tier, &dir, &run).await;
            return Err(copy_error).with_context(|| {
                format!("cannot place {} on tier {}", folder.display(), tier.name())
            });
        }
    };
    let manifest = match builder.finish().await {
        Ok(manifest) => manifest,
        Err(e) => {
            discard(staged).await;
            return Err(e);
        }
    };
    let prefix = layout::upload_folder(project, dataset, manifest.digest());
    let report = staged
        .publish_as(&prefix)
        .await
        .with_context(|| format!("cannot publish {prefix} on tier {}", tier.name()))?;
    Ok(Placed {
        prefix,
        manifest,
        report,
        swept,
    })
}

/// Removes a staged set that will not be published.
async fn discard(staged: StagedSet) {
    if let Err(e) = staged.abandon().await {
        tracing::warn!(error = %e, "cannot remove the staging folder of a failed upload; the next ingest of this dataset removes it");
    }
}

/// Removes this run's staging folder after a failed copy (the mover keeps it for a resume,
/// which ingest does not do). Its name starts with `layout::staging_folder_prefix(run)`, and
/// `run` is unique to this process.
async fn remove_run_staging(tier: &PosixTier, dir: &str, run: &str) {
    let (t, d, mark) = (
        tier.clone(),
        dir.to_owned(),
        layout::staging_folder_prefix(run),
    );
    let removed = tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
        for name in t.list_dir(&d)? {
            if name.starts_with(&mark) {
                t.remove_tree(&format!("{d}/{name}"))?;
            }
        }
        Ok(())
    })
    .await;
    if !matches!(removed, Ok(Ok(()))) {
        tracing::warn!(
            "cannot remove the staging folder of a failed upload; the next ingest of this dataset removes it"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn folder_of(n: usize) -> tempfile::TempDir {
        let folder = tempfile::tempdir().unwrap();
        std::fs::create_dir(folder.path().join("sub")).unwrap();
        for i in 0..n {
            let dir = if i % 2 == 0 { "" } else { "sub/" };
            std::fs::write(
                folder.path().join(format!("{dir}f{i}")),
                vec![i as u8; 1000 + i],
            )
            .unwrap();
        }
        folder
    }

    fn entries(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        names
    }

    #[tokio::test]
    async fn placing_twice_is_one_version_named_by_the_measured_digest() {
        let folder = folder_of(20);
        let root = tempfile::tempdir().unwrap();
        let tier = PosixTier::open("source", root.path()).unwrap();
        let spool = Spool::default();
        let a = place(&tier, folder.path(), "p", "d", &spool, &Progress::new())
            .await
            .unwrap();
        let b = place(&tier, folder.path(), "p", "d", &spool, &Progress::new())
            .await
            .unwrap();
        assert!(!a.report.existed && b.report.existed);
        assert_eq!(a.prefix, b.prefix);
        assert_eq!(a.manifest.digest(), b.manifest.digest());
        assert_eq!(a.prefix, format!("p/d/{}", &a.manifest.digest()[..16]));
        assert_eq!(a.manifest.files(), 20);
        assert_eq!(
            entries(&root.path().join("p/d")),
            vec![a.manifest.digest()[..16].to_owned()],
            "no staging folder left"
        );
        let f3 = a
            .manifest
            .entries()
            .map(Result::unwrap)
            .find(|f| f.path == "sub/f3")
            .unwrap();
        assert_eq!(f3.sha256, stagehand_schemas::sha256_hex(&[3u8; 1003]));
        assert_eq!(
            std::fs::read(root.path().join(&a.prefix).join("sub/f3")).unwrap(),
            vec![3u8; 1003]
        );
    }

    /// Issue 6 item 9: staging folders are created confined; a symlink planted where the
    /// dataset's folder would be is refused, and nothing is written through it.
    #[tokio::test]
    async fn a_symlink_planted_in_the_tier_is_not_followed() {
        let folder = folder_of(3);
        let root = tempfile::tempdir().unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        std::fs::create_dir(root.path().join("p")).unwrap();
        std::os::unix::fs::symlink(elsewhere.path(), root.path().join("p/d")).unwrap();
        let tier = PosixTier::open("source", root.path()).unwrap();
        let err = place(
            &tier,
            folder.path(),
            "p",
            "d",
            &Spool::default(),
            &Progress::new(),
        )
        .await
        .unwrap_err();
        assert!(
            format!("{err:#}").to_lowercase().contains("symlink")
                || format!("{err:#}").contains("refused"),
            "{err:#}"
        );
        assert!(
            entries(elsewhere.path()).is_empty(),
            "nothing written through the link"
        );
    }

    #[tokio::test]
    async fn a_failed_copy_leaves_no_staging_folder() {
        let folder = folder_of(4);
        let root = tempfile::tempdir().unwrap();
        let tier = PosixTier::open("source", root.path()).unwrap();
        // A file the copy cannot read (mode 000; the tests may run as root, who reads anyway,
        // so a FIFO swapped in after the walk would be the other way): a FIFO the walk refuses.
        rustix::fs::mkfifoat(
            rustix::fs::CWD,
            folder.path().join("sub/pipe"),
            rustix::fs::Mode::from_raw_mode(0o600),
        )
        .unwrap();
        let err = place(
            &tier,
            folder.path(),
            "p",
            "d",
            &Spool::default(),
            &Progress::new(),
        )
        .await
        .unwrap_err();
        assert!(
            format!("{err:#}").contains("neither a regular file"),
            "{err:#}"
        );
        assert!(
            entries(&root.path().join("p/d")).is_empty(),
            "{:?}",
            entries(&root.path().join("p/d"))
        );
    }
}
