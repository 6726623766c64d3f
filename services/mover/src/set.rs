//! Copying a whole set of files (a dataset version, a shard set, a checkpoint) from a prefix on
//! one tier to a prefix on another, published all at once: a reader sees all of it under the
//! final name or nothing.
//!
//! **posix destination.** The set is staged in a hidden folder beside the final one,
//! `<parent>/.<name>.stagehand-set-<owner>` (the owner token of [`crate::owner`]), created
//! with `mkdirat` through confined directory handles. Files are copied into it in bounded
//! chunks (the file list is a stream and may be millions long; at most one chunk is held),
//! each proven and published inside the staging folder like any copy. When the last chunk is
//! in, one `syncfs` makes every file and folder durable, then the staging folder is renamed to
//! the final name with `renameat2(RENAME_NOREPLACE)` between confined handles of the two
//! parents, and both parents are `fsync`ed. A symlink planted anywhere on the way is refused
//! (`RESOLVE_NO_SYMLINKS`), never followed.
//!
//! **Resume.** A rerun of the same set (same destination prefix) after a crash adopts the
//! staging folder of the dead run (renamed to its own owner name, so two reruns cannot both
//! take it; a live run's folder is never touched) and copies only what is not already there
//! and verified: files the dead run finished are skipped (hashed again unless
//! `trust_recorded_hash`), its half-written temp file is removed. A staging folder whose
//! writer died and that nobody resumes is removed by [`crate::PosixTier::sweep_stale`] once
//! older than its [`crate::SweepOptions::keep_sets_for`].
//!
//! **Found in place.** A set already under its final name is never taken on its name: every
//! listed file of it is hashed where it is, and the ones that do not verify are replaced (the
//! replacement staged beside it, verified files hard-linked in, then swapped in with one
//! `renameat2(RENAME_EXCHANGE)`; on S3 the marker withdrawn first and written last).
//!
//! **S3 destination.** S3 has no rename, so the closest honest equivalent: every object is
//! written at its final key and is itself atomic (complete or absent); when every object of
//! the set is in and verified, a completion marker object [`SET_COMPLETE_MARKER`] is written
//! last beneath the prefix. Readers treat the prefix as present only when the marker exists
//! ([`crate::Tier::set_present`]); a rerun skips objects already there with the right size and
//! hash. Objects of a set that never completes stay visible to a plain listing (without a
//! marker) until a caller removes them.
//!
//! Who calls it: ingest (a local folder → the source tier, hashes unknown → measured, and the
//! final name, the version digest, known only at the end: [`StagedSet::publish_as`]), the
//! promoter (capacity or source → hot or local, hashes known, verified by the policy's
//! [`crate::VerifyMode`]), the demoter and the backup copier (hot → capacity or backup), the
//! resharder (new shard files). Progress goes to the caller's [`Progress`] (files and bytes,
//! for progress acks and an ETA), cancellation through a [`CancellationToken`].

use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use stagehand_schemas::Retryable;
use tokio_util::sync::CancellationToken;

use crate::error::{ErrorKind, Side, TransferError};
use crate::fingerprint::Listed;
use crate::mover::Mover;
use crate::owner::{Liveness, Owner};
use crate::posix::{PRIVATE_DIR_MODE, PosixTier, Temporary, parse_temporary, staging_name};
use crate::s3::S3Tier;
use crate::tier::Tier;
use crate::transfer::{CopyOptions, CopyOutcome, FileRef, Progress};

/// The object written last beneath an S3 set's prefix: the set is complete only when it
/// exists. It holds `{"files": N, "bytes": B}` as JSON.
pub const SET_COMPLETE_MARKER: &str = ".stagehand-set-complete";

/// What set to copy, and how.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SetCopy {
    /// Prefix of the files on the source tier (tier-relative, `""` for its root); each
    /// [`FileRef::path`] is relative to it.
    pub src_prefix: String,
    /// The final prefix on the destination tier (tier-relative, not empty). On posix it is
    /// a folder that appears whole; on S3 the prefix its completion marker is written under.
    pub dst_prefix: String,
    /// How each file is copied and proven (priority, verification, trusted hashes).
    pub opts: CopyOptions,
    /// Files read from the stream and copied per chunk (memory is bounded by one chunk);
    /// 0 takes the mover's [`crate::MoverConfig::batch_files`].
    pub chunk_files: usize,
    /// The set's file count and bytes when the caller knows them up front (from a manifest's
    /// header): announced to [`Progress`] at once, so an ETA is right from the start.
    /// `None` announces each chunk as it is read.
    pub totals: Option<(u64, u64)>,
}

/// What a set copy did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetReport {
    /// The prefix the set is visible under.
    pub prefix: String,
    /// Files in the set (as read from the stream); 0 when it was already present.
    pub files: u64,
    /// Files whose bytes this run moved.
    pub copied: u64,
    /// Files already in the staging folder (or at their S3 key) and verified: not copied.
    pub skipped: u64,
    /// Bytes this run moved.
    pub bytes_copied: u64,
    /// The set was already present under the final prefix: nothing was published by this
    /// call (and, when found before staging, nothing was read).
    pub existed: bool,
    /// The staging folder of an earlier, dead run was adopted and completed.
    pub resumed: bool,
    /// Files of a set found in place that did not verify (wrong bytes, wrong size, missing)
    /// and were replaced by verified copies; 0 when the set was staged afresh or every file
    /// found verified.
    pub replaced: u64,
    /// Entries of a set found in place that its list does not name (stray files and folders):
    /// removed with the replacement's exchange of folders (posix) or deleted (S3); 0 when the
    /// set was staged afresh.
    pub strays: u64,
    /// The set's fingerprint as published (`crate::fingerprint`): taken after its modes and
    /// group were applied, or — for a set found in place that verified whole — before its
    /// files were hashed. `None` when nothing was verified under that name by this call (a
    /// content-addressed name found taken by [`StagedSet::publish_as`]) or the walk failed:
    /// unknown, which a reuse verifies by hash.
    pub fingerprint: Option<crate::Fingerprint>,
    /// What moved the bytes (`io_uring`, `pread`, `s3-upload`, ...).
    pub engine: &'static str,
    pub elapsed: Duration,
}

/// A set whose every file is in place and durable in its staging area, not yet visible.
/// Dropping it publishes nothing and keeps the staging folder for a resume.
#[derive(Debug)]
#[must_use = "a staged set is invisible until it is published"]
pub struct StagedSet {
    staging: Staging,
    /// Where files of the set go before it is published (the staging folder on posix, the
    /// final prefix on S3).
    tier: Option<Tier>,
    report: SetReport,
    started: Instant,
}

#[derive(Debug)]
enum Staging {
    /// posix: the staging folder's tier-relative path on `tier`; `replace`: it replaces a
    /// set found in place that did not verify (published by exchanging the two folders).
    Posix {
        tier: PosixTier,
        rel: String,
        replace: bool,
    },
    /// S3: objects were written at their final keys beneath `tier`'s `prefix`.
    S3 { tier: S3Tier, prefix: String },
    /// The set was found present before anything was staged.
    Present,
}

fn cancelled(tier: &str, path: &str) -> TransferError {
    TransferError::new(
        ErrorKind::Cancelled,
        Side::Destination,
        tier,
        path,
        "the set copy was cancelled; nothing was published, the staging folder is kept for a resume",
    )
}

async fn blocking<T: Send + 'static>(
    tier: &str,
    rel: &str,
    f: impl FnOnce() -> Result<T, TransferError> + Send + 'static,
) -> Result<T, TransferError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| {
        TransferError::new(
            ErrorKind::Io,
            Side::Destination,
            tier,
            rel,
            format!("set task failed: {e}"),
        )
    })?
}

fn split(rel: &str) -> (&str, &str) {
    rel.rsplit_once('/').unwrap_or(("", rel))
}

fn join(parent: &str, name: &str) -> String {
    if parent.is_empty() {
        name.to_owned()
    } else {
        format!("{parent}/{name}")
    }
}

/// Whether something is at `rel` on the posix tier as a directory (`false` when absent).
fn posix_dir_present(tier: &PosixTier, rel: &str) -> Result<bool, TransferError> {
    match tier.beneath(rel, false) {
        Ok(_) => Ok(true),
        Err(e) if e.kind == ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

/// Creates (or adopts from a dead run) the staging folder for `final_rel`; returns its
/// tier-relative path and whether it was adopted.
fn prepare_posix_staging(
    tier: &PosixTier,
    final_rel: &str,
) -> Result<(String, bool), TransferError> {
    let (parent, name) = split(final_rel);
    let ours = join(parent, &staging_name(name, &Owner::current()));
    // The parent is created confined; the listing finds a dead run's staging folder.
    tier.beneath(parent, true)?;
    let wanted = staging_name(name, &Owner::current());
    let mut adopted = false;
    for entry in tier.list_dir(parent)? {
        if entry == wanted {
            // This process staged the same set before (an earlier call that failed): resume.
            adopted = true;
            break;
        }
        let Some(Temporary::Set { owner, .. }) = parse_temporary(&entry) else {
            continue;
        };
        // The same final name (as cut to fit NAME_MAX), written by someone else.
        let same_set = staging_name(name, &owner) == entry;
        if same_set && owner.liveness() == Liveness::Dead {
            // Renamed to our own name first: a second rerun racing for it loses the rename
            // (the folder is gone from under its old name) and stages afresh.
            let taken = match tier.rename_dir_noreplace(&join(parent, &entry), &ours) {
                Ok(moved) => moved,
                Err(e) if e.kind == ErrorKind::NotFound => false,
                Err(e) => return Err(e),
            };
            if taken {
                tracing::info!(
                    tier = tier.name(),
                    from = entry,
                    to = ours,
                    "resuming the staging folder of a dead run"
                );
                adopted = true;
                break;
            }
        }
    }
    Ok((ours, adopted))
}

impl Mover {
    /// Copies the set `files` (a stream, read in chunks of [`SetCopy::chunk_files`]) from
    /// `set.src_prefix` on `src` to `set.dst_prefix` on `dst` and publishes it atomically
    /// (see the module docs): [`Mover::stage_set`] then [`StagedSet::publish`].
    #[allow(clippy::too_many_arguments)]
    pub async fn copy_set<S, F>(
        &self,
        src: &Tier,
        dst: &Tier,
        set: &SetCopy,
        files: S,
        progress: &Progress,
        cancel: &CancellationToken,
        on_file: F,
    ) -> Result<SetReport, TransferError>
    where
        S: Stream<Item = FileRef> + Unpin,
        F: FnMut(&FileRef),
    {
        self.stage_set(src, dst, set, files, progress, cancel, on_file)
            .await?
            .publish()
            .await
    }

    /// Copies every file of the set into its hidden staging area, but publishes nothing: the
    /// caller then [`StagedSet::publish`]es it (or, when the final name is known only now,
    /// [`StagedSet::publish_as`]), which makes it durable first. With an empty stream this
    /// only creates the staging area, for a caller that writes the set's files itself
    /// ([`StagedSet::staging_tier`]). `on_file` is called once per file
    /// in stream order, with its path, size and proven SHA-256, as each chunk completes (an
    /// ingest builds its manifest from these without holding them all).
    ///
    /// When `set.dst_prefix` is already present (a posix folder, an S3 prefix with its
    /// marker) every listed file of it is read and hashed where it is: all verified, nothing
    /// is published and the report says `existed`; otherwise the ones that did not verify are
    /// replaced by verified copies, published by [`StagedSet::publish`] in one exchange of
    /// folders (posix) or with the marker last (S3), and the report counts them as `replaced`. The first file that fails ends
    /// the set with that file's error (its kind, side and path); files of the same chunk that
    /// landed stay in the staging folder for a resume, nothing is published. Cancelling
    /// `cancel` ends it with [`ErrorKind::Cancelled`] the same way.
    #[allow(clippy::too_many_arguments)]
    pub async fn stage_set<S, F>(
        &self,
        src: &Tier,
        dst: &Tier,
        set: &SetCopy,
        mut files: S,
        progress: &Progress,
        cancel: &CancellationToken,
        mut on_file: F,
    ) -> Result<StagedSet, TransferError>
    where
        S: Stream<Item = FileRef> + Unpin,
        F: FnMut(&FileRef),
    {
        let started = Instant::now();
        let final_rel = set.dst_prefix.as_str();
        if final_rel.is_empty() {
            return Err(TransferError::new(
                ErrorKind::Config,
                Side::Destination,
                dst.name(),
                "",
                "a set needs a destination prefix to appear under",
            ));
        }
        let mut report = SetReport {
            prefix: final_rel.to_owned(),
            files: 0,
            copied: 0,
            skipped: 0,
            bytes_copied: 0,
            existed: false,
            resumed: false,
            replaced: 0,
            strays: 0,
            fingerprint: None,
            engine: self.path_name(src, dst),
            elapsed: Duration::ZERO,
        };
        if dst.set_present(final_rel).await? {
            return self
                .verify_present(src, dst, set, files, progress, cancel, on_file, report)
                .await
                .map(|(staging, tier, report)| StagedSet {
                    staging,
                    tier,
                    report,
                    started,
                });
        }
        let (staging, stage_tier) = match dst {
            Tier::Posix(p) => {
                let (p2, f) = (p.clone(), final_rel.to_owned());
                let (rel, adopted) =
                    blocking(p.name(), final_rel, move || prepare_posix_staging(&p2, &f)).await?;
                report.resumed = adopted;
                let (p2, r) = (p.clone(), rel.clone());
                let tier = blocking(p.name(), &rel, move || {
                    let staging = p2.beneath(&r, true)?;
                    if adopted {
                        // A run killed after making the set read-only, just before its rename.
                        p2.make_tree_writable(staging.root_fd(), &r)?;
                    }
                    if p2.access().is_some() {
                        // Private while it is filled: what is written inside is reachable by
                        // nobody else before the set gets its own modes and group.
                        rustix::fs::fchmod(
                            staging.root_fd(),
                            rustix::fs::Mode::from_raw_mode(PRIVATE_DIR_MODE),
                        )
                        .map_err(|e| {
                            TransferError::from_errno(
                                e,
                                Side::Destination,
                                p2.name(),
                                &r,
                                "make the staging folder private",
                            )
                        })?;
                    }
                    Ok(staging)
                })
                .await?;
                (
                    Staging::Posix {
                        tier: p.clone(),
                        rel,
                        replace: false,
                    },
                    Tier::Posix(tier),
                )
            }
            Tier::S3(s) => (
                Staging::S3 {
                    tier: s.clone(),
                    prefix: final_rel.to_owned(),
                },
                Tier::S3(s.beneath(final_rel)?),
            ),
        };
        let src_tier = src.beneath(&set.src_prefix)?;
        if let Some((n, bytes)) = set.totals {
            progress.add_total(n, bytes);
        }
        let chunk_files = match set.chunk_files {
            0 => self.config().batch_files.max(1),
            n => n,
        };
        loop {
            if cancel.is_cancelled() {
                return Err(cancelled(dst.name(), final_rel));
            }
            let mut chunk = Vec::with_capacity(chunk_files.min(1 << 16));
            while chunk.len() < chunk_files {
                let next = tokio::select! {
                    next = files.next() => next,
                    _ = cancel.cancelled() => return Err(cancelled(dst.name(), final_rel)),
                };
                match next {
                    Some(f) => chunk.push(f),
                    None => break,
                }
            }
            if chunk.is_empty() {
                break;
            }
            if set.totals.is_none() {
                progress.add_total(chunk.len() as u64, chunk.iter().map(|f| f.size).sum());
            }
            let batch = tokio::select! {
                batch = self.copy_batch(&src_tier, &stage_tier, &chunk, &set.opts, progress) => batch,
                _ = cancel.cancelled() => return Err(cancelled(dst.name(), final_rel)),
            };
            report.files += chunk.len() as u64;
            let mut first_error = None;
            let mut failed = 0u64;
            for (file, result) in chunk.iter().zip(batch.results) {
                match result.result {
                    Ok(outcome) => {
                        let sha = match &outcome {
                            CopyOutcome::Copied { bytes, sha256, .. } => {
                                report.copied += 1;
                                report.bytes_copied += bytes;
                                sha256
                            }
                            CopyOutcome::Skipped { sha256, .. } => {
                                report.skipped += 1;
                                sha256
                            }
                        };
                        on_file(&FileRef::new(file.path.clone(), file.size, sha.clone()));
                    }
                    Err(e) => {
                        failed += 1;
                        first_error.get_or_insert(e);
                    }
                }
            }
            if let Some(mut e) = first_error {
                e.detail = format!(
                    "{} ({failed} file(s) of the set failed in this chunk; nothing was published under {final_rel:?})",
                    e.detail
                );
                return Err(e);
            }
        }

        Ok(StagedSet {
            staging,
            tier: Some(stage_tier),
            report,
            started,
        })
    }
}

impl Mover {
    /// A set found in place counts as the copy only once every file of it verified against
    /// the list (size and SHA-256 read from its bytes, never taken from its name or a marker).
    /// Each file that does not verify is replaced by a copy from the source proven like any
    /// other: on posix the replacement is staged beside the set (its verified files hard-linked
    /// in, the others copied) and published by exchanging the two folders in one rename, so a
    /// reader finds the old set or the new one whole; on S3 the completion marker is withdrawn
    /// first (the set is not present while it is repaired), each object that did not verify is
    /// written again, and [`StagedSet::publish`] writes the marker. When every file verified,
    /// nothing is published and the report says `existed`.
    #[allow(clippy::too_many_arguments)]
    async fn verify_present<S, F>(
        &self,
        src: &Tier,
        dst: &Tier,
        set: &SetCopy,
        mut files: S,
        progress: &Progress,
        cancel: &CancellationToken,
        mut on_file: F,
        mut report: SetReport,
    ) -> Result<(Staging, Option<Tier>, SetReport), TransferError>
    where
        S: Stream<Item = FileRef> + Unpin,
        F: FnMut(&FileRef),
    {
        let final_rel = set.dst_prefix.as_str();
        // What is there, before a byte is read: the entries the list does not name are
        // strays, and when every file verifies this is the fingerprint to record.
        let walked = dst.fingerprint(final_rel).await?;
        let mut listed = Listed::new(&walked);
        let found = dst.beneath(final_rel)?;
        let src_tier = src.beneath(&set.src_prefix)?;
        // posix: the replacement's staging folder, made at once (every verified file is linked
        // into it as it is checked, so that it is whole if any file turns out wrong).
        let posix_staging = match (dst, &found) {
            (Tier::Posix(p), Tier::Posix(_)) => {
                let (p2, f) = (p.clone(), final_rel.to_owned());
                let (rel, adopted) =
                    blocking(p.name(), final_rel, move || prepare_posix_staging(&p2, &f)).await?;
                report.resumed = adopted;
                let (p2, r) = (p.clone(), rel.clone());
                let tier = blocking(p.name(), &rel, move || p2.beneath(&r, true)).await?;
                Some((p.clone(), rel, tier))
            }
            _ => None,
        };
        if let Some((n, bytes)) = set.totals {
            progress.add_total(n, bytes);
        }
        let chunk_files = match set.chunk_files {
            0 => self.config().batch_files.max(1),
            n => n,
        };
        loop {
            let mut chunk = Vec::with_capacity(chunk_files.min(1 << 16));
            while chunk.len() < chunk_files {
                let next = tokio::select! {
                    next = files.next() => next,
                    _ = cancel.cancelled() => return Err(cancelled(dst.name(), final_rel)),
                };
                match next {
                    Some(f) => chunk.push(f),
                    None => break,
                }
            }
            if chunk.is_empty() {
                break;
            }
            if set.totals.is_none() {
                progress.add_total(chunk.len() as u64, chunk.iter().map(|f| f.size).sum());
            }
            report.files += chunk.len() as u64;
            // Each file with the SHA-256 it verified as, or `None` when it is not the one listed.
            let checked: Vec<(FileRef, Result<Option<String>, TransferError>)> =
                futures::stream::iter(chunk)
                    .map(|f| {
                        let (found, src_tier) = (&found, &src_tier);
                        async move {
                            let limit = crate::ReadLimit::declared(f.size, None);
                            // A list without hashes (`stagehand cp` with no manifest): the file
                            // found must hash as its source does, which is read for it.
                            let listed = if f.sha256.is_empty() {
                                match src_tier.hash_file_bounded(&f.path, limit).await {
                                    Ok(d) => d.sha256,
                                    Err(e) => return (f, Err(e)),
                                }
                            } else {
                                f.sha256.clone()
                            };
                            let verdict = match found.hash_file_bounded(&f.path, limit).await {
                                Ok(d) => {
                                    Ok((d.size == f.size && d.sha256 == listed).then_some(listed))
                                }
                                // Wrong size, missing, not a file: this file is not the one
                                // listed. A failure to read at all says nothing about it.
                                Err(e) if !e.is_retryable() => Ok(None),
                                Err(e) => Err(e),
                            };
                            (f, verdict)
                        }
                    })
                    .buffered(self.config().concurrency.max(1))
                    .collect()
                    .await;
            let mut wrong = Vec::new();
            for (f, verdict) in checked {
                listed.mark(&f.path);
                if let Some(sha256) = verdict? {
                    if let (Some((_, _, staging)), Tier::Posix(from)) = (&posix_staging, &found) {
                        let (to, from, rel) = (staging.clone(), from.clone(), f.path.clone());
                        blocking(staging.name(), &f.path, move || to.link_from(&from, &rel))
                            .await?;
                    }
                    report.skipped += 1;
                    progress.add_bytes(f.size);
                    progress.file_skipped();
                    on_file(&FileRef::new(f.path.clone(), f.size, sha256));
                } else {
                    wrong.push(f);
                }
            }
            if wrong.is_empty() {
                continue;
            }
            if report.replaced == 0
                && let Tier::S3(s3) = &found
            {
                // Not present while it is repaired: no reader takes part of it for the whole.
                s3.delete(SET_COMPLETE_MARKER).await?;
            }
            report.replaced += wrong.len() as u64;
            tracing::warn!(
                tier = dst.name(),
                prefix = final_rel,
                files = wrong.len(),
                "a set found in place holds files that do not verify; replacing them with verified copies"
            );
            let into = match (&posix_staging, &found) {
                (Some((_, _, staging)), _) => Tier::Posix(staging.clone()),
                (None, Tier::S3(s3)) => {
                    for f in &wrong {
                        s3.delete(&f.path).await?;
                    }
                    found.clone()
                }
                (None, Tier::Posix(_)) => unreachable!("a posix set is staged beside it"),
            };
            let batch = tokio::select! {
                batch = self.copy_batch(&src_tier, &into, &wrong, &set.opts, progress) => batch,
                _ = cancel.cancelled() => return Err(cancelled(dst.name(), final_rel)),
            };
            for (file, result) in wrong.iter().zip(batch.results) {
                match result.result? {
                    CopyOutcome::Copied { bytes, sha256, .. } => {
                        report.copied += 1;
                        report.bytes_copied += bytes;
                        on_file(&FileRef::new(file.path.clone(), file.size, sha256));
                    }
                    CopyOutcome::Skipped { sha256, .. } => {
                        report.skipped += 1;
                        on_file(&FileRef::new(file.path.clone(), file.size, sha256));
                    }
                }
            }
        }
        let strays: Vec<String> = listed.strays().map(str::to_owned).collect();
        drop(listed);
        if !strays.is_empty() {
            tracing::warn!(
                tier = dst.name(),
                prefix = final_rel,
                strays = strays.len(),
                first = strays[0].as_str(),
                "a set found in place holds entries its list does not name; they go with the replacement"
            );
            report.strays = strays.len() as u64;
            if let Tier::S3(s3) = &found {
                if report.replaced == 0 {
                    s3.delete(SET_COMPLETE_MARKER).await?;
                }
                for stray in &strays {
                    s3.delete(stray).await?;
                }
            }
        }
        // Strays make the set another than listed: on posix the replacement (every listed
        // file, linked or copied, and nothing else) takes its place; on S3 they were deleted
        // and the marker is written again.
        let renewed = report.replaced + report.strays;
        if renewed == 0 {
            report.fingerprint = Some(walked);
        }
        match (posix_staging, renewed) {
            (Some((tier, rel, _)), 0) => {
                // Every file verified where it is: the links are not needed.
                let (t, r) = (tier.clone(), rel.clone());
                blocking(tier.name(), &rel, move || t.remove_tree(&r)).await?;
                report.existed = true;
                Ok((Staging::Present, None, report))
            }
            (None, 0) => {
                report.existed = true;
                Ok((Staging::Present, None, report))
            }
            (Some((tier, rel, staging)), _) => Ok((
                Staging::Posix {
                    tier,
                    rel,
                    replace: true,
                },
                Some(Tier::Posix(staging)),
                report,
            )),
            (None, _) => match found {
                Tier::S3(s3) => Ok((
                    Staging::S3 {
                        tier: match dst {
                            Tier::S3(d) => d.clone(),
                            Tier::Posix(_) => unreachable!("found beneath an S3 tier"),
                        },
                        prefix: final_rel.to_owned(),
                    },
                    Some(Tier::S3(s3)),
                    report,
                )),
                Tier::Posix(_) => unreachable!("a posix set is staged beside it"),
            },
        }
    }
}

impl StagedSet {
    /// What has been staged so far (published nothing yet).
    pub fn report(&self) -> &SetReport {
        &self.report
    }

    /// The tier the set's files are staged in — the hidden staging folder on posix (paths
    /// relative to the set), the final prefix on S3 — for callers that write new files into
    /// the set rather than copy them (the resharder's shards: [`Tier::write_small`] or
    /// [`crate::PosixTier::create_atomic`]); they are published with the rest. `None` when
    /// the set was already present.
    pub fn staging_tier(&self) -> Option<&Tier> {
        self.tier.as_ref()
    }

    /// The staging folder's tier-relative path (posix), for logs and tests.
    pub fn staging_path(&self) -> Option<&str> {
        match &self.staging {
            Staging::Posix { rel, .. } => Some(rel),
            _ => None,
        }
    }

    /// Publishes the set under the prefix it was staged for.
    pub async fn publish(self) -> Result<SetReport, TransferError> {
        let prefix = self.report.prefix.clone();
        self.publish_as(&prefix).await
    }

    /// Publishes the set under `prefix` (on posix any tier-relative folder, created confined;
    /// on S3 only the prefix it was staged for, since objects cannot be renamed). When
    /// something is already there, the staged copy is removed and the report says `existed`
    /// (the same content under a content-addressed name).
    pub async fn publish_as(mut self, prefix: &str) -> Result<SetReport, TransferError> {
        self.report.prefix = prefix.to_owned();
        match std::mem::replace(&mut self.staging, Staging::Present) {
            Staging::Present => {}
            Staging::Posix { tier, rel, replace } => {
                let (t, from, to) = (tier.clone(), rel.clone(), prefix.to_owned());
                let moved = blocking(tier.name(), prefix, move || {
                    // The set's files and folders get their modes and group while the staging
                    // folder is still private, so nothing is ever visible with wider rights.
                    let staged = match t.access() {
                        Some(access) => {
                            let staged = t.beneath(&from, false)?;
                            t.apply_access(staged.root_fd(), &from, &access, false)?;
                            Some((staged, access))
                        }
                        None => None,
                    };
                    // One flush for the whole set (copied and written files alike): every
                    // file's data and every folder created in the staging area, with their
                    // modes, are durable before the name that makes them visible is.
                    rustix::fs::syncfs(t.root_fd()).map_err(|e| {
                        TransferError::from_errno(e, Side::Destination, t.name(), &from, "syncfs")
                    })?;
                    // The verified set takes the place of the one that did not verify in one
                    // rename; the old one, now under the staging name, goes.
                    if replace && t.exchange_dirs(&from, &to)? {
                        t.remove_tree(&from)?;
                        if let Some((staged, access)) = &staged {
                            // The replacement's own folder was private while it was filled.
                            t.set_dir_mode(staged.root_fd(), &to, access)?;
                        }
                        return Ok(true);
                    }
                    let moved = t.rename_dir_noreplace(&from, &to)?;
                    if !moved {
                        t.remove_tree(&from)?;
                    } else if let Some((staged, access)) = staged {
                        // Private (0700) until here: read-only for the group from now on.
                        t.set_dir_mode(staged.root_fd(), &to, &access)?;
                        rustix::fs::fsync(staged.root_fd()).map_err(|e| {
                            TransferError::from_errno(e, Side::Destination, t.name(), &to, "fsync")
                        })?;
                    }
                    Ok(moved)
                })
                .await?;
                self.report.existed = !moved;
                if moved {
                    self.report.fingerprint =
                        fingerprint_published(&Tier::Posix(tier), prefix).await;
                }
            }
            Staging::S3 {
                tier,
                prefix: staged,
            } => {
                if staged != prefix {
                    return Err(TransferError::new(
                        ErrorKind::Config,
                        Side::Destination,
                        tier.name(),
                        prefix,
                        format!(
                            "an S3 set is written at its final keys ({staged:?}) and cannot be published under another prefix"
                        ),
                    ));
                }
                let marker = serde_json::json!({
                    "files": self.report.files,
                    "bytes": self.report.bytes_copied,
                })
                .to_string();
                tier.put_small(&join(prefix, SET_COMPLETE_MARKER), marker.into_bytes())
                    .await?;
                self.report.fingerprint = fingerprint_published(&Tier::S3(tier), prefix).await;
            }
        }
        self.report.elapsed = self.started.elapsed();
        Ok(self.report)
    }

    /// Removes the staging folder (posix) and what is in it: for a set that will not be
    /// retried. Returns what was removed.
    pub async fn abandon(self) -> Result<crate::SweepReport, TransferError> {
        match self.staging {
            Staging::Posix { tier, rel, .. } => {
                let t = tier.clone();
                let r = rel.clone();
                blocking(tier.name(), &rel, move || t.remove_tree(&r)).await
            }
            _ => Ok(crate::SweepReport::default()),
        }
    }
}

/// The fingerprint of a set just published; `None` (unknown: a reuse verifies it by hash)
/// when the walk fails, since the set itself is published and durable.
async fn fingerprint_published(tier: &Tier, prefix: &str) -> Option<crate::Fingerprint> {
    match tier.fingerprint(prefix).await {
        Ok(print) => Some(print),
        Err(e) => {
            tracing::warn!(tier = tier.name(), prefix, error = %e, "the published set's fingerprint could not be taken; its next reuse verifies it by hash");
            None
        }
    }
}

impl Tier {
    /// Whether a set published with [`Mover::copy_set`] is present under `prefix`: on posix
    /// the folder exists (it only ever appears whole), on S3 its completion marker exists.
    pub async fn set_present(&self, prefix: &str) -> Result<bool, TransferError> {
        match self {
            Tier::Posix(p) => {
                let (p2, r) = (p.clone(), prefix.to_owned());
                blocking(p.name(), prefix, move || posix_dir_present(&p2, &r)).await
            }
            Tier::S3(s) => Ok(s.stat(&join(prefix, SET_COMPLETE_MARKER)).await?.is_some()),
        }
    }
}
