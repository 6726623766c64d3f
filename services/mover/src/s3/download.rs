//! s3 → posix: parallel ranged GETs streamed into a temp file, hashed in order on the way,
//! proven against the file reference, then published atomically.
//!
//! An object of at most one part (every small file) costs one request: a plain GET whose
//! response carries the size, ETag and recorded SHA-256 a HEAD would have given, checked before
//! any byte is written. The temp file is created, hashed into and written in one blocking step
//! per megabyte, so a small file costs one hop to the blocking pool.
//!
//! Larger objects: a HEAD for the size and ETag, then ranges that complete out of order while
//! SHA-256 must see bytes in order. Each range streams its chunks both to disk (at their
//! offsets) and into its own channel; one hashing thread drains the channels range by range. A
//! range may only start once a slot of the reorder window is free, and a slot is freed when the
//! hasher has finished its range, so at most `window` ranges of data are ever held in memory,
//! and the file is never read back. Every ranged GET carries `If-Match` with the HEAD's ETag,
//! so an object replaced in the middle is `SourceChanged`, never a file of mixed versions.

use std::sync::Arc;

use bytes::Bytes;
use sha2::{Digest, Sha256};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::task::JoinSet;

use super::errors::{chain, map_sdk_error};
use super::{ObjectInfo, S3Tier, SHA256_METADATA_KEY, expected_sha};
use crate::error::{ErrorKind, Side, TransferError};
use crate::posix::{AtomicFile, PendingRename, PosixTier};
use crate::transfer::{
    CopyOptions, CopyOutcome, FileRef, Progress, ReadLimit, SkipReason, VerifyMode,
};

/// Ranges of one object held (in flight or waiting for the hasher) at once.
const MAX_WINDOW: usize = 8;
/// Chunks are gathered to about this many bytes before one positioned write.
const WRITE_BATCH: usize = 1 << 20;

/// Copies `file` from the S3 tier to the posix tier and publishes it durably (`fdatasync`,
/// rename without replace, directory `fsync`).
pub async fn download(
    src: &S3Tier,
    dst: &PosixTier,
    file: &FileRef,
    opts: &CopyOptions,
    progress: &Progress,
) -> Result<CopyOutcome, TransferError> {
    let (outcome, pending) = fetch(src, dst, file, opts, progress).await?;
    if let Some(atomic) = pending {
        let rel = file.path.clone();
        let tier = dst.name().to_owned();
        tokio::task::spawn_blocking(move || atomic.commit())
            .await
            .map_err(|e| join_error(&tier, &rel, Side::Destination, e))??;
    }
    Ok(outcome)
}

/// Like [`download`] but leaves the verified temp file unpublished, for the caller to publish
/// with many others in one [`PosixTier::commit_batch`] (one `syncfs` instead of one `fdatasync`
/// per file). `None` when the outcome is a skip.
pub async fn download_pending(
    src: &S3Tier,
    dst: &PosixTier,
    file: &FileRef,
    opts: &CopyOptions,
    progress: &Progress,
) -> Result<(CopyOutcome, Option<PendingRename>), TransferError> {
    let (outcome, pending) = fetch(src, dst, file, opts, progress).await?;
    Ok((outcome, pending.map(AtomicFile::into_pending)))
}

fn join_error(tier: &str, rel: &str, side: Side, e: tokio::task::JoinError) -> TransferError {
    TransferError::new(
        ErrorKind::Io,
        side,
        tier,
        rel,
        format!("transfer task failed: {e}"),
    )
}

/// Downloads and verifies into a temp file; returns it unpublished (None when skipped).
async fn fetch(
    src: &S3Tier,
    dst: &PosixTier,
    file: &FileRef,
    opts: &CopyOptions,
    progress: &Progress,
) -> Result<(CopyOutcome, Option<AtomicFile>), TransferError> {
    let rel = file.path.as_str();
    src.key_for(rel, Side::Source)?;
    dst.check_path(rel, Side::Destination)?;
    let expected = expected_sha(file, opts);

    // An object of at most one part takes one GET and nothing else: its size, ETag and
    // recorded hash arrive with the response. A destination already there needs the object's
    // facts before any byte moves (to skip or refuse it), so that rare case takes the HEAD path.
    let part = src.config().part_size_for(file.size);
    if file.size <= part && dst.stat(rel)?.is_none() {
        let (outcome, atomic) = fetch_single(src, dst, file, opts, &expected, progress).await?;
        return Ok((outcome, Some(atomic)));
    }

    let info = src.stat_side(rel, Side::Source).await?.ok_or_else(|| {
        src.site(Side::Source, rel).error(
            ErrorKind::NotFound,
            format!(
                "no object s3://{}/{} at {}",
                src.bucket(),
                src.key_unchecked(rel),
                src.endpoint()
            ),
        )
    })?;
    check_facts(
        src,
        file,
        Some(info.size),
        &expected,
        info.sha256_meta.as_deref(),
    )?;

    if let Some(skip) = existing_destination(src, dst, file, opts, &expected, &info).await? {
        return Ok((skip, None));
    }

    let dst_owned = dst.clone();
    let rel_owned = rel.to_owned();
    let size = info.size;
    let atomic = tokio::task::spawn_blocking(move || dst_owned.create_atomic(&rel_owned, size))
        .await
        .map_err(|e| join_error(dst.name(), rel, Side::Destination, e))??;
    let atomic = Arc::new(atomic);

    let part = src.config().part_size_for(size);
    let ranged = size > part;
    let (got_size, got_sha) = fetch_ranges(src, rel, &info, part, atomic.clone(), progress).await?;

    let atomic = Arc::try_unwrap(atomic).map_err(|_| {
        TransferError::new(
            ErrorKind::Io,
            Side::Destination,
            dst.name(),
            rel,
            "a range writer outlived its download",
        )
    })?;
    let received = Received {
        size: got_size,
        sha256: got_sha,
    };
    let atomic = prove(
        src,
        dst,
        file,
        opts,
        &expected,
        info.sha256_meta.as_deref(),
        atomic,
        &received,
    )
    .await?;
    let outcome = CopyOutcome::Copied {
        bytes: received.size,
        sha256: received.sha256,
        engine: if ranged { "s3-ranged-get" } else { "s3-get" },
    };
    Ok((outcome, Some(atomic)))
}

/// Refuses an object whose size or recorded SHA-256 (as far as known before its bytes are
/// read) contradicts the file reference.
fn check_facts(
    src: &S3Tier,
    file: &FileRef,
    size: Option<u64>,
    expected: &Option<String>,
    recorded: Option<&str>,
) -> Result<(), TransferError> {
    let rel = file.path.as_str();
    if let Some(size) = size
        && size != file.size
    {
        return Err(src.site(Side::Source, rel).error(
            ErrorKind::SizeMismatch,
            format!(
                "object is {size} bytes, the file reference says {}",
                file.size
            ),
        ));
    }
    if let (Some(want), Some(recorded)) = (expected, recorded)
        && want != recorded
    {
        return Err(src.site(Side::Source, rel).error(
            ErrorKind::ChecksumMismatch,
            format!("object's recorded sha256 is {recorded}, the file reference says {want}"),
        ));
    }
    Ok(())
}

/// What a download received: its size and the SHA-256 of the bytes written.
struct Received {
    size: u64,
    sha256: String,
}

/// Proves the temp file before it may be published: the size the file reference names, the
/// SHA-256 it names (or, when the caller has none, the one recorded with the object), and with
/// [`VerifyMode::ReadBack`] the bytes read back from disk.
#[allow(clippy::too_many_arguments)]
async fn prove(
    src: &S3Tier,
    dst: &PosixTier,
    file: &FileRef,
    opts: &CopyOptions,
    expected: &Option<String>,
    recorded: Option<&str>,
    atomic: AtomicFile,
    got: &Received,
) -> Result<AtomicFile, TransferError> {
    let rel = file.path.as_str();
    if got.size != file.size {
        return Err(src.site(Side::Source, rel).error(
            ErrorKind::SizeMismatch,
            format!(
                "read {} bytes, the file reference says {}",
                got.size, file.size
            ),
        ));
    }
    let (want, whose) = match (expected, recorded) {
        (Some(want), _) => (Some(want.as_str()), "the file reference says"),
        (None, Some(recorded)) => (Some(recorded), "the object's recorded sha256 is"),
        (None, None) => (None, ""),
    };
    if let Some(want) = want
        && want != got.sha256
    {
        return Err(src.site(Side::Source, rel).error(
            ErrorKind::ChecksumMismatch,
            format!(
                "object hashes to {}, {whose} {want}; nothing was published",
                got.sha256
            ),
        ));
    }
    if opts.verify_destination != VerifyMode::ReadBack {
        return Ok(atomic);
    }
    let (atomic, written) = tokio::task::spawn_blocking(move || {
        let written = atomic.hash_written();
        (atomic, written)
    })
    .await
    .map_err(|e| join_error(dst.name(), rel, Side::Destination, e))?;
    let written = written?;
    if written.sha256 != got.sha256 || written.size != got.size {
        return Err(TransferError::new(
            ErrorKind::ChecksumMismatch,
            Side::Destination,
            dst.name(),
            rel,
            format!(
                "read back {} bytes hashing to {}, wrote {}",
                written.size, written.sha256, got.sha256
            ),
        ));
    }
    Ok(atomic)
}

/// The temp file and the hash of what was written to it, moved as one into each blocking
/// write so the hasher sees the very bytes that are written, in order.
struct SingleSink {
    atomic: Option<AtomicFile>,
    hasher: Sha256,
    written: u64,
}

/// An object of at most one part in one GET, without a HEAD: the response's `Content-Length`
/// and `x-amz-meta-sha256` are checked against the file reference before any byte is written,
/// and one GET response is one version of the object, so no `If-Match` is needed. The temp
/// file is created, hashed into and written in one blocking step per [`WRITE_BATCH`] (one
/// step in all for a small file).
async fn fetch_single(
    src: &S3Tier,
    dst: &PosixTier,
    file: &FileRef,
    opts: &CopyOptions,
    expected: &Option<String>,
    progress: &Progress,
) -> Result<(CopyOutcome, AtomicFile), TransferError> {
    let rel = file.path.as_str();
    let site = src.site(Side::Source, rel);
    let key = src.key_unchecked(rel);
    let mut slot = Some(src.request_slot().await);
    let response = src
        .client()
        .get_object()
        .bucket(src.bucket())
        .key(&key)
        .send()
        .await
        .map_err(|e| map_sdk_error("GetObject", site, e))?;
    let recorded = response
        .metadata()
        .and_then(|m| m.get(SHA256_METADATA_KEY))
        .map(|s| s.to_ascii_lowercase());
    let announced = response
        .content_length()
        .and_then(|n| u64::try_from(n).ok());
    check_facts(src, file, announced, expected, recorded.as_deref())?;

    let mut body = response.body;
    let mut sink = Some(SingleSink {
        atomic: None,
        hasher: Sha256::new(),
        written: 0,
    });
    let mut batch: Vec<Bytes> = Vec::new();
    let mut batch_len = 0usize;
    loop {
        let chunk = body.try_next().await.map_err(|e| {
            site.error(
                ErrorKind::ObjectStore,
                format!(
                    "reading the body of s3://{}/{key} from {}: {}",
                    src.bucket(),
                    src.endpoint(),
                    chain(&e)
                ),
            )
            .with_source(e)
        })?;
        let end = chunk.is_none();
        if end {
            // The request is over: its slot serves another file while this one is written.
            drop(slot.take());
        }
        if let Some(chunk) = chunk {
            let so_far = sink.as_ref().map_or(0, |s| s.written) + (batch_len + chunk.len()) as u64;
            if so_far > file.size {
                return Err(site.error(
                    ErrorKind::SizeMismatch,
                    format!(
                        "object returned more than the {} bytes the file reference says",
                        file.size
                    ),
                ));
            }
            batch_len += chunk.len();
            batch.push(chunk);
        }
        let first = sink.as_ref().is_some_and(|s| s.atomic.is_none());
        if batch_len >= WRITE_BATCH || (end && (batch_len > 0 || first)) {
            let mut state = sink.take().expect("the sink is back after every write");
            let chunks = std::mem::take(&mut batch);
            let (dst_owned, rel_owned) = (dst.clone(), rel.to_owned());
            let size = file.size;
            let state = tokio::task::spawn_blocking(move || {
                if state.atomic.is_none() {
                    state.atomic = Some(dst_owned.create_atomic(&rel_owned, size)?);
                }
                let atomic = state.atomic.as_ref().expect("created above");
                for chunk in chunks {
                    state.hasher.update(&chunk);
                    atomic.write_all_at(&chunk, state.written)?;
                    state.written += chunk.len() as u64;
                }
                Ok::<SingleSink, TransferError>(state)
            })
            .await
            .map_err(|e| join_error(dst.name(), rel, Side::Destination, e))??;
            sink = Some(state);
            progress.add_bytes(batch_len as u64);
            batch_len = 0;
        }
        if end {
            break;
        }
    }
    let sink = sink.expect("the sink is back after every write");
    let atomic = sink
        .atomic
        .expect("the end of the body creates the temp file");
    let received = Received {
        size: sink.written,
        sha256: hex::encode(sink.hasher.finalize()),
    };
    let atomic = prove(
        src,
        dst,
        file,
        opts,
        expected,
        recorded.as_deref(),
        atomic,
        &received,
    )
    .await?;
    let outcome = CopyOutcome::Copied {
        bytes: received.size,
        sha256: received.sha256,
        engine: "s3-get",
    };
    Ok((outcome, atomic))
}

/// Decides what to do about a file already at the destination: skip it when it provably (or,
/// when the policy trusts recorded hashes, by size) holds the bytes, refuse when it holds others.
async fn existing_destination(
    src: &S3Tier,
    dst: &PosixTier,
    file: &FileRef,
    opts: &CopyOptions,
    expected: &Option<String>,
    info: &ObjectInfo,
) -> Result<Option<CopyOutcome>, TransferError> {
    let rel = file.path.as_str();
    let Some(existing) = dst.stat(rel)? else {
        return Ok(None);
    };
    let conflict = |why: String| {
        TransferError::new(
            ErrorKind::DestinationConflict,
            Side::Destination,
            dst.name(),
            rel,
            why,
        )
    };
    if existing != info.size {
        return Err(conflict(format!(
            "a {existing}-byte file is already there; the object is {} bytes",
            info.size
        )));
    }
    let want = match (expected, &info.sha256_meta) {
        (Some(want), _) => want.clone(),
        (None, Some(recorded)) => recorded.clone(),
        (None, None) => {
            src.hash_object(
                rel,
                Side::Source,
                info.etag.as_deref(),
                ReadLimit::default(),
            )
            .await?
            .sha256
        }
    };
    if opts.trust_recorded_hash && expected.is_some() {
        return Ok(Some(CopyOutcome::Skipped {
            reason: SkipReason::AlreadyPresentTrusted,
            sha256: want,
        }));
    }
    let dst_owned = dst.clone();
    let rel_owned = rel.to_owned();
    let digest = tokio::task::spawn_blocking(move || {
        dst_owned.hash_file_side(&rel_owned, Side::Destination)
    })
    .await
    .map_err(|e| join_error(dst.name(), rel, Side::Destination, e))??;
    if digest.sha256 == want {
        Ok(Some(CopyOutcome::Skipped {
            reason: SkipReason::AlreadyPresentVerified,
            sha256: want,
        }))
    } else {
        Err(conflict(format!(
            "a file hashing to {} is already there; the object hashes to {want}",
            digest.sha256
        )))
    }
}

/// Streams the object in `part`-sized ranges into `atomic`, returning the size and SHA-256 of
/// what was received (hashed in order).
async fn fetch_ranges(
    src: &S3Tier,
    rel: &str,
    info: &ObjectInfo,
    part: u64,
    atomic: Arc<AtomicFile>,
    progress: &Progress,
) -> Result<(u64, String), TransferError> {
    let size = info.size;
    let ranges: Vec<(u64, u64)> = if size <= part {
        vec![(0, size)]
    } else {
        (0..size.div_ceil(part))
            .map(|i| (i * part, part.min(size - i * part)))
            .collect()
    };
    let whole = ranges.len() == 1;
    let window = Arc::new(Semaphore::new(
        src.config()
            .concurrency
            .clamp(1, MAX_WINDOW)
            .min(ranges.len()),
    ));

    let (order_tx, order_rx) =
        std::sync::mpsc::channel::<(mpsc::UnboundedReceiver<Bytes>, OwnedSemaphorePermit)>();
    let hasher = tokio::task::spawn_blocking(move || {
        let mut hasher = Sha256::new();
        let mut hashed = 0u64;
        for (mut range, slot) in order_rx {
            while let Some(chunk) = range.blocking_recv() {
                hashed += chunk.len() as u64;
                hasher.update(&chunk);
            }
            drop(slot);
        }
        (hashed, hex::encode(hasher.finalize()))
    });

    let mut tasks: JoinSet<Result<(), TransferError>> = JoinSet::new();
    let mut failure: Option<TransferError> = None;
    for (offset, len) in ranges {
        let slot = window
            .clone()
            .acquire_owned()
            .await
            .expect("the window semaphore is never closed");
        while let Some(done) = tasks.try_join_next() {
            if let Err(e) = flatten(done, src, rel) {
                failure.get_or_insert(e);
            }
        }
        if failure.is_some() {
            break;
        }
        if offset > 0
            && let Some(hook) = src.range_hook()
        {
            hook(rel, offset).await;
        }
        let (tx, rx) = mpsc::unbounded_channel();
        if order_tx.send((rx, slot)).is_err() {
            break;
        }
        let job = RangeJob {
            src: src.clone(),
            rel: rel.to_owned(),
            etag: info.etag.clone(),
            offset,
            len,
            whole,
            atomic: atomic.clone(),
            progress: progress.clone(),
        };
        tasks.spawn(job.run(tx));
    }
    drop(order_tx);
    while let Some(done) = tasks.join_next().await {
        if let Err(e) = flatten(done, src, rel) {
            if failure.is_none() {
                tasks.abort_all();
            }
            failure.get_or_insert(e);
        }
    }
    let hashed = hasher
        .await
        .map_err(|e| join_error(src.name(), rel, Side::Source, e));
    if let Some(e) = failure {
        return Err(e);
    }
    hashed
}

fn flatten(
    done: Result<Result<(), TransferError>, tokio::task::JoinError>,
    src: &S3Tier,
    rel: &str,
) -> Result<(), TransferError> {
    match done {
        Ok(r) => r,
        Err(e) if e.is_cancelled() => Ok(()),
        Err(e) => Err(join_error(src.name(), rel, Side::Source, e)),
    }
}

/// One ranged GET streamed to its offset in the temp file and to the hasher.
struct RangeJob {
    src: S3Tier,
    rel: String,
    etag: Option<String>,
    offset: u64,
    len: u64,
    /// The range is the whole object: no `Range` header.
    whole: bool,
    atomic: Arc<AtomicFile>,
    progress: Progress,
}

impl RangeJob {
    async fn run(self, hash_tx: mpsc::UnboundedSender<Bytes>) -> Result<(), TransferError> {
        let site = self.src.site(Side::Source, &self.rel);
        let key = self.src.key_unchecked(&self.rel);
        let _slot = self.src.request_slot().await;
        let mut request = self
            .src
            .client()
            .get_object()
            .bucket(self.src.bucket())
            .key(&key)
            .set_if_match(self.etag.clone());
        if !self.whole {
            request = request.range(format!(
                "bytes={}-{}",
                self.offset,
                self.offset + self.len - 1
            ));
        }
        let response = request
            .send()
            .await
            .map_err(|e| map_sdk_error("GetObject", site, e))?;
        if let (Some(want), Some(got)) = (&self.etag, response.e_tag())
            && want != got
        {
            return Err(site.error(
                ErrorKind::SourceChanged,
                format!("object's ETag changed from {want} to {got} during the download"),
            ));
        }
        let mut body = response.body;
        let mut at = self.offset;
        let mut batch: Vec<Bytes> = Vec::new();
        let mut batch_len = 0usize;
        loop {
            let chunk = body.try_next().await.map_err(|e| {
                site.error(
                    ErrorKind::ObjectStore,
                    format!(
                        "reading bytes {}.. of s3://{}/{key} from {}: {}",
                        at + batch_len as u64,
                        self.src.bucket(),
                        self.src.endpoint(),
                        chain(&e)
                    ),
                )
                .with_source(e)
            })?;
            let end = chunk.is_none();
            if let Some(chunk) = chunk {
                if chunk.is_empty() {
                    continue;
                }
                if (at - self.offset) + (batch_len + chunk.len()) as u64 > self.len {
                    return Err(site.error(
                        ErrorKind::SourceChanged,
                        format!(
                            "range at {} returned more than its {} bytes",
                            self.offset, self.len
                        ),
                    ));
                }
                // The hasher gets the very bytes that are written.
                let _ = hash_tx.send(chunk.clone());
                batch_len += chunk.len();
                batch.push(chunk);
            }
            if batch_len >= WRITE_BATCH || (end && batch_len > 0) {
                let atomic = self.atomic.clone();
                let chunks = std::mem::take(&mut batch);
                let start = at;
                tokio::task::spawn_blocking(move || {
                    let mut offset = start;
                    for chunk in chunks {
                        atomic.write_all_at(&chunk, offset)?;
                        offset += chunk.len() as u64;
                    }
                    Ok::<(), TransferError>(())
                })
                .await
                .map_err(|e| site.error(ErrorKind::Io, format!("write task failed: {e}")))??;
                at += batch_len as u64;
                self.progress.add_bytes(batch_len as u64);
                batch_len = 0;
            }
            if end {
                break;
            }
        }
        if at - self.offset != self.len {
            return Err(site.error(
                ErrorKind::SourceChanged,
                format!(
                    "range at {} ended after {} of its {} bytes",
                    self.offset,
                    at - self.offset,
                    self.len
                ),
            ));
        }
        Ok(())
    }
}
