//! Raw versions on an S3 source tier. The derivation reads members with positional reads from
//! posix files on its own threads, so a version whose raw bytes are objects is first copied
//! into the resharder's spool by the mover (ranged GETs, every object hashed on the way and
//! checked against the manifest, as any copy off S3 is), then derived from there, and the
//! fetched folder removed when the derivation ends, whatever its outcome. The derivation
//! hashes every member again as it packs it: the checksum chain is checked on the bytes that
//! go into the shards. The spool must hold the largest raw version packed from S3.

use std::path::{Path, PathBuf};

use stagehand_bus::HandlerError;
use stagehand_manifest::Manifest;
use stagehand_mover::{
    CancellationToken, CopyOptions, Mover, PosixTier, Priority, Progress, SetCopy, Tier, VerifyMode,
};
use tracing::{info, warn};

/// Where fetched raw versions live beneath the spool; emptied at start-up (what is in it was
/// left by a killed run and is fetched again).
pub(crate) fn fetch_root(spool_dir: &Path) -> PathBuf {
    spool_dir.join("fetched")
}

/// The folder a raw version is fetched into: a posix tier rooted in the spool, the version's
/// files beneath it.
pub(crate) struct Fetched {
    dir: PathBuf,
    tier: PosixTier,
}

impl Fetched {
    /// The fetched version's files, as the derivation's source.
    pub(crate) fn tier(&self) -> &PosixTier {
        &self.tier
    }

    /// Removes the fetched folder; a failure is only warned about (the next start-up empties
    /// the fetch root).
    pub(crate) async fn remove(self) {
        let dir = self.dir.clone();
        match tokio::task::spawn_blocking(move || std::fs::remove_dir_all(&dir)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                warn!(dir = %self.dir.display(), error = %e, "could not remove a fetched raw version")
            }
            Err(e) => {
                warn!(dir = %self.dir.display(), error = %e, "could not remove a fetched raw version")
            }
        }
    }
}

/// Copies the version `manifest` lists from `prefix` on the S3 tier `src` into
/// `root/<name>`, every object checked against its recorded size and SHA-256.
pub(crate) async fn fetch(
    mover: &Mover,
    src: &Tier,
    prefix: &str,
    manifest: &Manifest,
    root: &Path,
    name: &str,
    cancel: &CancellationToken,
) -> Result<Fetched, HandlerError> {
    let dir = root.join(name);
    let (d, r) = (dir.clone(), root.to_owned());
    let made = tokio::task::spawn_blocking(move || -> std::io::Result<()> {
        // What a dead run fetched is not trusted to be whole: fetched afresh.
        match std::fs::remove_dir_all(&d) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        std::fs::create_dir_all(&r)?;
        std::fs::create_dir(&d)
    })
    .await
    .map_err(|e| HandlerError::retryable(format!("preparing the fetch folder: {e}")))?;
    made.map_err(|e| {
        HandlerError::retryable(format!("creating the fetch folder {}: {e}", dir.display()))
    })?;
    let scratch = PosixTier::open("fetched", &dir).map_err(HandlerError::from)?;
    let set = SetCopy {
        src_prefix: prefix.to_owned(),
        dst_prefix: "raw".to_owned(),
        opts: CopyOptions {
            priority: Priority::Ingest,
            trust_recorded_hash: false,
            verify_destination: VerifyMode::HashedInFlight,
            expected_hash_unknown: false,
        },
        chunk_files: 0,
        totals: Some((manifest.files(), manifest.bytes())),
    };
    let (files, listed) = manifest.file_stream(4096);
    let copied = mover
        .copy_set(
            src,
            &Tier::Posix(scratch.clone()),
            &set,
            files,
            &Progress::new(),
            cancel,
            |_| {},
        )
        .await;
    let tier = match (copied, listed.take_error()) {
        (Ok(report), None) => {
            info!(
                prefix,
                files = report.files,
                bytes = report.bytes_copied,
                "fetched the raw version from S3"
            );
            scratch.beneath("raw", false).map_err(HandlerError::from)
        }
        (_, Some(e)) => Err(HandlerError::from(e)),
        (Err(e), None) => Err(HandlerError::from(e)),
    };
    match tier {
        Ok(tier) => Ok(Fetched { dir, tier }),
        Err(e) => {
            Fetched { dir, tier: scratch }.remove().await;
            Err(e)
        }
    }
}
