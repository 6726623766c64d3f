//! The copier's tiers and the moves everything else is made of: a version's files (and, for a
//! backup, its manifest) copied from one tier to another as one verified, atomic set, and the
//! manifest read back from a backup (verified against the version digest).

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use futures::{StreamExt, TryStreamExt};
use stagehand_bus::runner;
use stagehand_manifest::{DEFAULT_CHUNK, Manifest, ManifestError, Spool};
use stagehand_mover::{
    CancellationToken, CopyOptions, ErrorKind, FileRef, Mover, MoverConfig, PosixTier, Priority,
    Progress, ReadLimit, SetCopy, SetReport, Side, Tier, TransferError, VerifyMode,
};
use stagehand_policy::{BackupPolicy, Policies, TierError, TierPolicy, TierRole, sweep_stale};

use crate::error::BackupError;
use crate::layout::{MANIFEST_NAME, manifest_path};

/// Reads of objects checked at once when an S3 set is read back.
const READ_BACK_AT_ONCE: usize = 8;

/// The backup tier, the tiers copied from and to, the mover and the scratch folder.
pub struct Copier {
    pub(crate) policies: Policies,
    pub(crate) policy: BackupPolicy,
    /// The backup tier's policy and the tier itself.
    pub(crate) target: TierPolicy,
    pub(crate) backup: Tier,
    pub(crate) mover: Mover,
    /// Where drills restore to and manifests pass through (a posix folder on local disk).
    pub(crate) scratch: PosixTier,
    pub(crate) spool: Spool,
    /// Other tiers, opened on first use.
    opened: Mutex<HashMap<String, Tier>>,
    /// One lock per backup set being written by this process ([`Copier::lock_set`]).
    sets: Mutex<HashMap<String, Weak<tokio::sync::Mutex<()>>>>,
}

impl std::fmt::Debug for Copier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Copier")
            .field("target", &self.target.name)
            .field("scratch", &self.scratch.root())
            .finish()
    }
}

/// A name for a scratch folder no other task of this process uses.
fn scratch_name(what: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!(
        "{what}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

impl Copier {
    /// Opens the backup tier `policies`' backup policy names (its posix root created if
    /// missing) and the scratch folder (created if missing). Refuses policies without
    /// `backup.toml`.
    pub fn open(
        policies: Policies,
        scratch_dir: &Path,
        mover: MoverConfig,
    ) -> Result<Copier, BackupError> {
        let policy = policies
            .backup()
            .cloned()
            .ok_or_else(|| policies.needed("backup.toml", crate::SERVICE))?;
        // The policy crate checked that the target exists with role backup.
        let target = policies
            .tier(&policy.target)
            .cloned()
            .ok_or_else(|| BackupError::Refused(format!("no tier {:?}", policy.target)))?;
        let backup = target.open_creating_root()?;
        let spool_dir = scratch_dir.join("spool");
        runner::create_state_dirs([scratch_dir, &spool_dir])?;
        let scratch = PosixTier::open("scratch", scratch_dir).map_err(BackupError::Transfer)?;
        let mover = Mover::new(mover).map_err(BackupError::Transfer)?;
        Ok(Copier {
            policies,
            policy,
            target,
            backup,
            mover,
            scratch,
            spool: Spool::in_dir(spool_dir),
            opened: Mutex::new(HashMap::new()),
            sets: Mutex::new(HashMap::new()),
        })
    }

    /// The backup policy.
    pub fn policy(&self) -> &BackupPolicy {
        &self.policy
    }

    /// The backup tier's policy.
    pub fn target(&self) -> &TierPolicy {
        &self.target
    }

    /// Removes what killed runs left on the posix tiers this copier writes (the backup tier
    /// when it is posix, and the scratch folder), and every scratch folder of a dead drill.
    pub async fn sweep(&self) -> Result<(), BackupError> {
        sweep_stale(&self.scratch, "").await;
        if let Tier::Posix(p) = &self.backup {
            sweep_stale(p, "").await;
        }
        // Drill folders and manifests in transit are never resumed: whatever is there belongs
        // to a run that is over (this process has just started).
        let scratch = self.scratch.clone();
        tokio::task::spawn_blocking(move || -> Result<(), TransferError> {
            for dir in ["drills", "manifests"] {
                match scratch.remove_tree(dir) {
                    Err(e) if e.kind != ErrorKind::NotFound => return Err(e),
                    _ => {}
                }
            }
            Ok(())
        })
        .await
        .map_err(|e| BackupError::Refused(format!("sweep task failed: {e}")))??;
        Ok(())
    }

    /// A declared tier and the tier itself, opened on first use.
    pub(crate) fn tier(&self, name: &str) -> Result<(TierPolicy, Tier), BackupError> {
        let policy = self.policies.tier(name).cloned().ok_or_else(|| {
            BackupError::Refused(format!(
                "tier {name:?} is not declared in {}/tiers.toml",
                self.policies.dir().display()
            ))
        })?;
        if name == self.target.name {
            return Ok((policy, self.backup.clone()));
        }
        let mut opened = self.opened.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(tier) = opened.get(name) {
            return Ok((policy, tier.clone()));
        }
        let tier = policy.open().map_err(|e| TierError::new(&policy, e))?;
        opened.insert(name.to_owned(), tier.clone());
        Ok((policy, tier))
    }

    /// Waits until no other task of this process writes the set `prefix` on `tier`, and holds
    /// it until the guard is dropped. Every task of a process stages a set in the same staging
    /// folder (its name is the process's owner token), so two at once would write the same
    /// files.
    pub(crate) async fn lock_set(
        &self,
        tier: &str,
        prefix: &str,
    ) -> tokio::sync::OwnedMutexGuard<()> {
        let key = format!("{tier}\0{prefix}");
        let lock = {
            let mut sets = self.sets.lock().unwrap_or_else(|p| p.into_inner());
            sets.retain(|_, held| held.strong_count() > 0);
            match sets.get(&key).and_then(Weak::upgrade) {
                Some(lock) => lock,
                None => {
                    let lock = Arc::new(tokio::sync::Mutex::new(()));
                    sets.insert(key, Arc::downgrade(&lock));
                    lock
                }
            }
        };
        lock.lock_owned().await
    }

    /// Refuses a copy from `source` to the backup tier when both are in one failure domain
    /// (one event could lose both), or when the source is itself a backup tier.
    pub(crate) fn check_failure_domain(&self, source: &TierPolicy) -> Result<(), BackupError> {
        if source.role == TierRole::Backup {
            return Err(BackupError::Refused(format!(
                "tier {:?} is a backup tier; the backup copier protects the tiers data lives on, not other backups",
                source.name
            )));
        }
        if source.failure_domain == self.target.failure_domain {
            return Err(BackupError::Refused(format!(
                "refusing to back up from tier {:?} to backup tier {:?}: both are in failure domain {:?}, so one event could lose the data and its backup together",
                source.name, self.target.name, self.target.failure_domain
            )));
        }
        Ok(())
    }

    /// Writes `manifest`'s canonical bytes as [`MANIFEST_NAME`] at the root of `dst` (a set's
    /// staging tier), through a scratch file and the mover, proven like any copy. A manifest
    /// already there with the same bytes (a resumed set) is left as it is.
    async fn write_manifest(&self, manifest: &Manifest, dst: &Tier) -> Result<(), BackupError> {
        let dir = format!("manifests/{}", scratch_name("out"));
        let scratch = self.scratch.clone();
        let (m, file_rel) = (manifest.clone(), format!("{dir}/{MANIFEST_NAME}"));
        let len = tokio::task::spawn_blocking(move || write_canonical(&scratch, &file_rel, &m))
            .await
            .map_err(|e| BackupError::Refused(format!("manifest task failed: {e}")))??;
        let copied = async {
            let src = Tier::Posix(self.scratch.beneath(&dir, false)?);
            let file = FileRef::new(MANIFEST_NAME, len, manifest.digest());
            let opts = CopyOptions {
                priority: Priority::Backup,
                verify_destination: self.policy.verify,
                ..CopyOptions::default()
            };
            self.mover.copy(&src, dst, &file, &opts).await
        }
        .await;
        self.remove_scratch(&dir).await;
        copied?;
        Ok(())
    }

    /// Reads the manifest inside the backup at `set_prefix` on `tier` into the spool and
    /// checks it is the manifest of `version` (its bytes hash to the digest, every line is
    /// canonical). A missing manifest is [`ErrorKind::NotFound`].
    pub(crate) async fn read_manifest(
        &self,
        tier: &Tier,
        set_prefix: &str,
        version: &str,
    ) -> Result<Manifest, BackupError> {
        let rel = manifest_path(set_prefix);
        let size = match tier {
            Tier::Posix(p) => {
                let (p, r) = (p.clone(), rel.clone());
                tokio::task::spawn_blocking(move || p.stat(&r))
                    .await
                    .map_err(|e| BackupError::Refused(format!("stat task failed: {e}")))??
            }
            Tier::S3(s) => s.stat(&rel).await?.map(|info| info.size),
        };
        let Some(size) = size else {
            return Err(TransferError::new(
                ErrorKind::NotFound,
                Side::Source,
                tier.name(),
                &rel,
                "the backup holds no manifest",
            )
            .into());
        };
        let dir = format!("manifests/{}", scratch_name("in"));
        let read = async {
            let dst = Tier::Posix(self.scratch.beneath(&dir, true)?);
            let file = FileRef::new(rel.clone(), size, version);
            let opts = CopyOptions {
                priority: Priority::Backup,
                ..CopyOptions::default()
            };
            // The copy proves the bytes hash to the version digest; parsing proves the rest.
            self.mover.copy(tier, &dst, &file, &opts).await?;
            let (scratch, path, what, version, spool) = (
                self.scratch.clone(),
                format!("{dir}/{rel}"),
                format!("{}:{rel}", tier.name()),
                version.to_owned(),
                self.spool.clone(),
            );
            tokio::task::spawn_blocking(move || -> Result<Manifest, BackupError> {
                let file = scratch.open_read(&path)?;
                Ok(Manifest::from_canonical(
                    &what,
                    std::io::BufReader::new(file),
                    &version,
                    &spool,
                )?)
            })
            .await
            .map_err(|e| BackupError::Refused(format!("manifest task failed: {e}")))?
        }
        .await;
        self.remove_scratch(&dir).await;
        read
    }

    /// Copies `manifest`'s files from `src_prefix` on `src` to `dst_prefix` on `dst` and
    /// publishes them as one set (with the manifest itself as [`MANIFEST_NAME`] when
    /// `with_manifest`): staged, every file proven (`verify`; on S3 with `read-back` every
    /// object is read again and hashed before the completion marker is written), then made
    /// visible at once. An error leaves nothing under `dst_prefix` (on S3: no completion
    /// marker) and what was staged for a rerun to resume.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn copy_version(
        &self,
        (src, src_prefix): (&Tier, &str),
        (dst, dst_prefix): (&Tier, &str),
        manifest: &Manifest,
        with_manifest: bool,
        verify: VerifyMode,
        priority: Priority,
        progress: &Progress,
        cancel: &CancellationToken,
    ) -> Result<SetReport, BackupError> {
        let failed: Arc<Mutex<Option<ManifestError>>> = Arc::default();
        let files = entries(manifest, failed.clone());
        let set = SetCopy {
            src_prefix: src_prefix.to_owned(),
            dst_prefix: dst_prefix.to_owned(),
            opts: CopyOptions {
                priority,
                verify_destination: verify,
                ..CopyOptions::default()
            },
            chunk_files: 0,
            totals: Some((manifest.files(), manifest.bytes())),
        };
        let staged = self
            .mover
            .stage_set(src, dst, &set, files, progress, cancel, |_| {})
            .await?;
        if let Some(e) = failed.lock().unwrap_or_else(|p| p.into_inner()).take() {
            // The list ended early: publishing would make a part look like the whole.
            return Err(e.into());
        }
        let report = staged.report().clone();
        if !report.existed && report.files != manifest.files() {
            return Err(BackupError::Refused(format!(
                "{} of {} files of {} were staged; not published",
                report.files,
                manifest.files(),
                manifest.digest()
            )));
        }
        if let Some(staging) = staged.staging_tier() {
            if with_manifest {
                self.write_manifest(manifest, staging).await?;
            }
            if verify == VerifyMode::ReadBack && matches!(staging, Tier::S3(_)) {
                read_back(staging, manifest, with_manifest).await?;
            }
        }
        Ok(staged.publish().await?)
    }

    async fn remove_scratch(&self, dir: &str) {
        let (scratch, dir) = (self.scratch.clone(), dir.to_owned());
        let removed = tokio::task::spawn_blocking(move || scratch.remove_tree(&dir)).await;
        if let Ok(Err(e)) = removed {
            tracing::warn!(error = %e, "could not remove a scratch folder; the next start sweeps it");
        }
    }
}

/// A manifest's entries as the stream a set copy reads, chunk by chunk; a manifest that fails
/// to read ends the stream and leaves its error in `failed`.
fn entries(
    manifest: &Manifest,
    failed: Arc<Mutex<Option<ManifestError>>>,
) -> impl futures::Stream<Item = FileRef> + Unpin + Send + 'static {
    manifest
        .chunks(DEFAULT_CHUNK)
        .map(move |chunk| match chunk {
            Ok(files) => Ok(files),
            Err(e) => {
                *failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                Err(())
            }
        })
        .take_while(|c| futures::future::ready(c.is_ok()))
        .map(|c| futures::stream::iter(c.unwrap_or_default()))
        .flatten()
        // A set copy may ask again after the end; the manifest's chunks must not be.
        .fuse()
        .boxed()
}

/// Reads every object of an S3 set again (the manifest object too, `with_manifest`) and
/// checks its size and SHA-256 against the manifest: what proves the bytes the server stored,
/// beyond the checksums it checked on upload.
pub(crate) async fn read_back(
    tier: &Tier,
    manifest: &Manifest,
    with_manifest: bool,
) -> Result<(), BackupError> {
    if with_manifest {
        let got = tier
            .hash_file_bounded(
                MANIFEST_NAME,
                ReadLimit::declared(manifest.canonical_len(), None),
            )
            .await?;
        if got.sha256 != manifest.digest() {
            return Err(TransferError::new(
                ErrorKind::ChecksumMismatch,
                Side::Destination,
                tier.name(),
                MANIFEST_NAME,
                format!(
                    "read back, the manifest hashes to {}, not to the version {}",
                    got.sha256,
                    manifest.digest()
                ),
            )
            .into());
        }
    }
    manifest
        .chunks(DEFAULT_CHUNK)
        .map_err(BackupError::from)
        .map_ok(|files| futures::stream::iter(files.into_iter().map(Ok::<_, BackupError>)))
        .try_flatten()
        .map_ok(|file| async move {
            let got = tier
                .hash_file_bounded(&file.path, ReadLimit::declared(file.size, None))
                .await?;
            if got.sha256 != file.sha256 {
                return Err(TransferError::new(
                    ErrorKind::ChecksumMismatch,
                    Side::Destination,
                    tier.name(),
                    &file.path,
                    format!(
                        "read back, the object hashes to {}, the manifest says {}",
                        got.sha256, file.sha256
                    ),
                )
                .into());
            }
            Ok(())
        })
        .try_buffer_unordered(READ_BACK_AT_ONCE)
        .try_collect::<()>()
        .await
}

/// Writes `manifest`'s canonical bytes to a new file at `rel` on `scratch`, durably; returns
/// their length. Blocking.
fn write_canonical(
    scratch: &PosixTier,
    rel: &str,
    manifest: &Manifest,
) -> Result<u64, BackupError> {
    let file = scratch.create_atomic(rel, manifest.canonical_len())?;
    let len = manifest.write_canonical_at(file.file())?;
    file.commit()?;
    Ok(len)
}
