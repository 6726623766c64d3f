//! Registering data already on a source tier, where it is: a folder beneath a posix source
//! tier's root, or the objects beneath a prefix of an S3 source tier. Nothing is copied.
//!
//! The files are listed as a stream (a confined walk of the folder; S3 listings a page at a
//! time) and hashed as they come, several at once (both cores on posix, the tier's request
//! concurrency on S3), through the same bounded reads the validator uses
//! ([`Tier::hash_file_bounded`]: the size listed is the size read, never a byte past it).
//! Each hash goes to the manifest builder; nothing is held per file. The validator hashes
//! every byte again before anything is trusted — the uploader's hashes are a declaration.

use std::path::Path;

use anyhow::{Context, bail};
use futures::TryStreamExt;
use stagehand_manifest::{Manifest, Spool};
use stagehand_mover::s3::S3Tier;
use stagehand_mover::{PosixTier, Progress, ReadLimit, SET_COMPLETE_MARKER, Tier};
use stagehand_schemas::FileRef;

use super::manifest::BuilderThread;
use super::walk::{self, WalkOptions};

/// Files hashed at once on a posix tier, per core.
const POSIX_PER_CORE: usize = 2;

fn join(prefix: &str, rel: &str) -> String {
    if prefix.is_empty() {
        rel.to_owned()
    } else {
        format!("{prefix}/{rel}")
    }
}

/// Hashes every file of `files` (paths relative to `prefix` on `tier`), `concurrency` at a
/// time, into a manifest.
async fn hash_into_manifest<S>(
    tier: &Tier,
    prefix: &str,
    files: S,
    concurrency: usize,
    spool: &Spool,
    progress: &Progress,
) -> anyhow::Result<Manifest>
where
    S: futures::Stream<Item = anyhow::Result<FileRef>>,
{
    let builder = BuilderThread::start(spool)?;
    let hashed = files
        .map_ok(|file| {
            progress.add_total(1, file.size);
            let rel = join(prefix, &file.path);
            async move {
                let digest = tier
                    .hash_file_bounded(&rel, ReadLimit::declared(file.size, None))
                    .await
                    .with_context(|| format!("cannot hash {rel} on tier {}", tier.name()))?;
                progress.add_bytes(digest.size);
                progress.file_done();
                Ok::<_, anyhow::Error>(FileRef::new(file.path, digest.size, digest.sha256))
            }
        })
        .try_buffer_unordered(concurrency.max(1));
    let mut hashed = std::pin::pin!(hashed);
    let mut count = 0u64;
    while let Some(file) = hashed.try_next().await? {
        builder.push(file);
        count += 1;
    }
    if count == 0 {
        bail!(
            "{} holds no files to register on tier {}",
            if prefix.is_empty() {
                "the tier root"
            } else {
                prefix
            },
            tier.name()
        );
    }
    builder.finish().await
}

/// Hashes the folder `folder`, which is `prefix` on the posix source tier `tier`. Stagehand's
/// own temporaries in it (a live or killed copy's) are skipped.
pub async fn hash_posix(
    tier: &PosixTier,
    folder: &Path,
    prefix: &str,
    spool: &Spool,
    progress: &Progress,
) -> anyhow::Result<Manifest> {
    let mut walk = walk::start(
        folder,
        WalkOptions {
            skip_temporaries: true,
        },
    )?;
    let files = futures::stream::poll_fn(move |cx| walk.files.poll_recv(cx).map(|f| f.map(Ok)));
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let manifest = hash_into_manifest(
        &Tier::Posix(tier.clone()),
        prefix,
        files,
        cores * POSIX_PER_CORE,
        spool,
        progress,
    )
    .await;
    walk.done.await.context("the folder walk failed")??;
    manifest
}

/// Lists the objects beneath `prefix` of the S3 source tier `tier` a page at a time and
/// hashes them. The completion marker of a set copied there by Stagehand is not data.
pub async fn hash_s3(
    tier: &S3Tier,
    prefix: &str,
    spool: &Spool,
    progress: &Progress,
) -> anyhow::Result<Manifest> {
    let pages = futures::stream::try_unfold(Some(None::<String>), |state| async move {
        let Some(token) = state else {
            return Ok(None);
        };
        let page = tier
            .list_page(prefix, token)
            .await
            .with_context(|| format!("listing {prefix} on tier {}", tier.name()))?;
        let next = page.next.map(Some);
        Ok::<_, anyhow::Error>(Some((page.objects, next)))
    });
    let strip = if prefix.is_empty() {
        0
    } else {
        prefix.len() + 1
    };
    let files = pages
        .map_ok(|objects| {
            futures::stream::iter(objects.into_iter().filter_map(move |(key, size)| {
                let rel = key[strip.min(key.len())..].to_owned();
                let marker =
                    rel == SET_COMPLETE_MARKER || rel.ends_with(&format!("/{SET_COMPLETE_MARKER}"));
                (!marker).then(|| Ok(FileRef::new(rel, size, stagehand_mover::EMPTY_SHA256)))
            }))
        })
        .try_flatten();
    hash_into_manifest(
        &Tier::S3(tier.clone()),
        prefix,
        files,
        tier.config().concurrency,
        spool,
        progress,
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagehand_schemas::{sha256_hex, version_digest};

    #[tokio::test]
    async fn a_folder_on_a_posix_tier_is_hashed_in_place() {
        let root = tempfile::tempdir().unwrap();
        let folder = root.path().join("lab/run-1");
        std::fs::create_dir_all(folder.join("img")).unwrap();
        let mut expected = Vec::new();
        for i in 0..50u8 {
            let body = vec![i; 100 + i as usize];
            std::fs::write(folder.join(format!("img/{i}.bin")), &body).unwrap();
            expected.push(FileRef::new(
                format!("img/{i}.bin"),
                body.len() as u64,
                sha256_hex(&body),
            ));
        }
        // A killed copy's temp file is nobody's data.
        std::fs::write(folder.join("img/.9.bin.stagehand-x-1.tmp"), b"partial").unwrap();
        let tier = PosixTier::open("source", root.path()).unwrap();
        let progress = Progress::new();
        let manifest = hash_posix(&tier, &folder, "lab/run-1", &Spool::default(), &progress)
            .await
            .unwrap();
        assert_eq!(manifest.digest(), version_digest(&expected));
        assert_eq!(progress.files_done(), 50);
    }
}
