//! Walking a folder as a stream of files, in memory bounded by a constant.
//!
//! The walk runs on a blocking thread and hands each regular file (its path relative to the
//! folder and its size) through a bounded channel, so a folder of millions of files is never
//! held: the consumer (the mover's set copy, or the in-place hasher) takes them as they come.
//! Directories are read in the order the filesystem gives (no per-directory sort, which would
//! hold a whole directory's names); the manifest builder sorts.
//!
//! What the walk refuses or skips, each for a reason a person can act on:
//! - a symlink that resolves outside the folder is refused (its target is not the uploader's
//!   to publish); one that stays inside is skipped with a note (its target is ingested under
//!   its own path, and the validator's confined reads never follow links);
//! - a FIFO, socket or device is refused (not a file; reading one could block);
//! - a name that is not UTF-8, or not a path the contract accepts, is refused;
//! - Stagehand's own temporaries (a killed copy's hidden temp file, a set's staging folder)
//!   are skipped when walking a tier in place: they are nobody's data.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use stagehand_mover::EMPTY_SHA256;
use stagehand_mover::posix::is_temp_name;
use stagehand_schemas::layout::is_staging_folder_name;
use stagehand_schemas::{FileRef, check_relative_path};
use tokio::sync::mpsc;

/// Files in flight between the walk and its consumer.
const CHANNEL_FILES: usize = 8192;

/// What the walk found, once it ended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WalkSummary {
    pub files: u64,
    pub bytes: u64,
    /// Symlinks inside the folder, skipped.
    pub links_skipped: u64,
    /// Stagehand temporaries skipped (in-place walks only).
    pub temporaries_skipped: u64,
}

/// A walk in progress: files arrive on `files`; `done` says how it ended. A walk that failed
/// closes the channel early, so a consumer must always check `done` before trusting that it
/// saw every file.
pub struct Walk {
    pub files: mpsc::Receiver<FileRef>,
    pub done: tokio::task::JoinHandle<anyhow::Result<WalkSummary>>,
}

/// Options of a walk.
#[derive(Debug, Clone, Default)]
pub struct WalkOptions {
    /// Skip Stagehand's temporaries (a tier walked in place) instead of refusing nothing.
    pub skip_temporaries: bool,
}

/// Starts walking `folder` (which must be a folder). Each file is sent as a [`FileRef`] with
/// its size and a placeholder hash (the empty input's): hashes are measured by the consumer.
pub fn start(folder: &Path, opts: WalkOptions) -> anyhow::Result<Walk> {
    let root = folder
        .canonicalize()
        .with_context(|| format!("cannot open folder {}", folder.display()))?;
    if !root.is_dir() {
        bail!("{} is not a folder", folder.display());
    }
    let (tx, rx) = mpsc::channel(CHANNEL_FILES);
    let shown = folder.to_owned();
    let done = tokio::task::spawn_blocking(move || {
        walk(&root, &shown, &opts, |f| tx.blocking_send(f).is_ok())
    });
    Ok(Walk { files: rx, done })
}

/// Every file of a small folder (a checkpoint's directory), walked on this thread with the
/// same refusals, in path order; sizes as [`start`] gives them, hashes the placeholder. Holds
/// every entry: a folder of any size goes through [`start`].
pub fn list(folder: &Path) -> anyhow::Result<Vec<FileRef>> {
    let root = folder
        .canonicalize()
        .with_context(|| format!("cannot open folder {}", folder.display()))?;
    if !root.is_dir() {
        bail!("{} is not a folder", folder.display());
    }
    let mut files = Vec::new();
    walk(&root, folder, &WalkOptions::default(), |f| {
        files.push(f);
        true
    })?;
    files.sort_by(|a, b| a.path.as_bytes().cmp(b.path.as_bytes()));
    Ok(files)
}

/// Walks `root` (shown as `shown` in messages), handing each file to `sink` until it returns
/// false (its consumer stopped).
fn walk(
    root: &Path,
    shown: &Path,
    opts: &WalkOptions,
    mut sink: impl FnMut(FileRef) -> bool,
) -> anyhow::Result<WalkSummary> {
    let mut summary = WalkSummary::default();
    let mut entries = walkdir::WalkDir::new(root).follow_links(false).into_iter();
    while let Some(entry) = entries.next() {
        let entry = entry.with_context(|| format!("walking {}", shown.display()))?;
        if entry.depth() == 0 {
            continue;
        }
        let name = entry.file_name().to_string_lossy();
        if opts.skip_temporaries && (is_temp_name(&name) || is_staging_folder_name(&name)) {
            summary.temporaries_skipped += 1;
            if entry.file_type().is_dir() {
                entries.skip_current_dir();
            }
            continue;
        }
        let rel = relative(root, entry.path())?;
        let kind = entry.file_type();
        if kind.is_symlink() {
            let target = std::fs::canonicalize(entry.path())
                .with_context(|| format!("symlink {rel} is dangling"))?;
            if !target.starts_with(root) {
                bail!(
                    "symlink {rel} points to {}, outside {}: refused",
                    target.display(),
                    shown.display()
                );
            }
            summary.links_skipped += 1;
            continue;
        }
        if kind.is_dir() {
            continue;
        }
        if !kind.is_file() {
            bail!("{rel} is neither a regular file nor a folder: refused");
        }
        check_relative_path(&rel)
            .with_context(|| format!("file {rel} cannot be a manifest path"))?;
        let size = entry
            .metadata()
            .with_context(|| format!("stat {rel}"))?
            .len();
        summary.files += 1;
        summary.bytes += size;
        if !sink(FileRef::new(rel, size, EMPTY_SHA256)) {
            // The consumer stopped (it failed); its error is the one to report.
            break;
        }
    }
    if summary.files == 0 {
        bail!("{} holds no files to ingest", shown.display());
    }
    if summary.links_skipped > 0 {
        eprintln!(
            "note: {} symlink(s) inside {} skipped; their targets are ingested under their own paths",
            summary.links_skipped,
            shown.display()
        );
    }
    Ok(summary)
}

/// `path` relative to `root`, `/`-separated and UTF-8.
fn relative(root: &Path, path: &Path) -> anyhow::Result<String> {
    let rel: PathBuf = path
        .strip_prefix(root)
        .expect("walkdir yields paths beneath its root")
        .to_owned();
    rel.to_str()
        .map(str::to_owned)
        .with_context(|| format!("{} is not valid UTF-8", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn collect(
        folder: &Path,
        opts: WalkOptions,
    ) -> anyhow::Result<(Vec<FileRef>, WalkSummary)> {
        let mut walk = start(folder, opts)?;
        let mut files = Vec::new();
        while let Some(f) = walk.files.recv().await {
            files.push(f);
        }
        let summary = walk.done.await??;
        files.sort_by(|a, b| a.path.cmp(&b.path));
        Ok((files, summary))
    }

    #[tokio::test]
    async fn a_symlink_that_leaves_the_folder_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("secret"), b"x").unwrap();
        std::fs::write(dir.path().join("a.txt"), b"a").unwrap();
        std::os::unix::fs::symlink(outside.path().join("secret"), dir.path().join("link")).unwrap();
        let err = collect(dir.path(), WalkOptions::default())
            .await
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("symlink link points to") && err.contains("refused"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn files_are_listed_and_inner_symlinks_skipped() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        std::fs::write(dir.path().join("sub/b.bin"), b"bb").unwrap();
        std::fs::write(dir.path().join("a.txt"), b"a").unwrap();
        std::os::unix::fs::symlink(dir.path().join("a.txt"), dir.path().join("alias")).unwrap();
        let (files, summary) = collect(dir.path(), WalkOptions::default()).await.unwrap();
        let listed: Vec<(&str, u64)> = files.iter().map(|f| (f.path.as_str(), f.size)).collect();
        assert_eq!(listed, vec![("a.txt", 1), ("sub/b.bin", 2)]);
        assert_eq!(
            summary,
            WalkSummary {
                files: 2,
                bytes: 3,
                links_skipped: 1,
                temporaries_skipped: 0
            }
        );
    }

    #[tokio::test]
    async fn a_fifo_is_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.txt"), b"a").unwrap();
        rustix::fs::mkfifoat(
            rustix::fs::CWD,
            dir.path().join("pipe"),
            rustix::fs::Mode::from_raw_mode(0o600),
        )
        .unwrap();
        let err = collect(dir.path(), WalkOptions::default())
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("pipe is neither a regular file"), "{err}");
    }

    #[tokio::test]
    async fn temporaries_are_skipped_in_place_only() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.txt"), b"a").unwrap();
        std::fs::write(dir.path().join(".b.stagehand-x-1.tmp"), b"partial").unwrap();
        std::fs::create_dir(dir.path().join(".v.stagehand-set-x")).unwrap();
        std::fs::write(dir.path().join(".v.stagehand-set-x/c"), b"c").unwrap();
        let (files, summary) = collect(
            dir.path(),
            WalkOptions {
                skip_temporaries: true,
            },
        )
        .await
        .unwrap();
        assert_eq!(files.len(), 1, "{files:?}");
        assert_eq!(summary.temporaries_skipped, 2);
        let (files, _) = collect(dir.path(), WalkOptions::default()).await.unwrap();
        assert_eq!(files.len(), 3, "{files:?}");
    }
}
