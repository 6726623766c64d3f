//! posix → s3 (and the streamed half of a cross-endpoint s3 → s3): the source is read once,
//! hashed in order on the way, and sent as one PUT or as a multipart upload with parallel parts.
//!
//! The whole-object SHA-256 goes into the object's metadata (`x-amz-meta-sha256`); each PUT and
//! each part also carries `x-amz-checksum-sha256` so the server refuses bytes that changed on
//! the wire. A multipart upload is completed only when the whole-file hash matches what the
//! transfer must prove, and aborted on any failure, so no partial object ever becomes visible
//! and no upload is left dangling.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use aws_sdk_s3::primitives::ByteStream;
use aws_sdk_s3::types::{ChecksumAlgorithm, CompletedMultipartUpload, CompletedPart};
use bytes::{Bytes, BytesMut};
use sha2::{Digest, Sha256};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use super::errors::{Site, chain, map_sdk_error};
use super::{S3Tier, SHA256_METADATA_KEY, expected_sha, sha256_base64, sha256_hex_to_base64};
use crate::error::{ErrorKind, Side, TransferError};
use crate::posix::PosixTier;
use crate::transfer::{CopyOptions, CopyOutcome, FileRef, Progress, ReadLimit, SkipReason};

/// Parts of one upload held in memory (being read, hashed or sent) at once.
const MAX_WINDOW: usize = 8;

/// Copies `file` from the posix tier to the S3 tier.
pub async fn upload(
    src: &PosixTier,
    dst: &S3Tier,
    file: &FileRef,
    opts: &CopyOptions,
    progress: &Progress,
) -> Result<CopyOutcome, TransferError> {
    let rel = file.path.as_str();
    dst.key_for(rel, Side::Destination)?;
    let src_owned = src.clone();
    let rel_owned = rel.to_owned();
    let handle = tokio::task::spawn_blocking(move || {
        let handle = src_owned.open_read(&rel_owned)?;
        let size = handle
            .metadata()
            .map_err(|e| {
                TransferError::from_io(e, Side::Source, src_owned.name(), &rel_owned, "fstat")
            })?
            .len();
        Ok::<_, TransferError>((handle, size))
    })
    .await
    .map_err(|e| join_error(src.name(), rel, Side::Source, e))??;
    let (handle, size) = handle;
    if size != file.size {
        return Err(TransferError::new(
            ErrorKind::SizeMismatch,
            Side::Source,
            src.name(),
            rel,
            format!(
                "file is {size} bytes, the file reference says {}",
                file.size
            ),
        ));
    }
    let handle = Arc::new(handle);
    let source_name = src.name().to_owned();

    let mut expected = expected_sha(file, opts);
    let multipart = size > dst.config().multipart_threshold;
    let existing = dst.stat(rel).await?;
    if expected.is_none() && (multipart || existing.is_some()) {
        // Without a recorded hash, the metadata of a multipart object (set when the upload
        // starts) and the comparison with an existing object both need the hash first.
        let h = handle.clone();
        let digest = tokio::task::spawn_blocking(move || crate::posix::hash_open_file(&h))
            .await
            .map_err(|e| join_error(src.name(), rel, Side::Source, e))?
            .map_err(|e| TransferError::from_io(e, Side::Source, src.name(), rel, "read"))?;
        expected = Some(digest.sha256);
    }
    if let Some(existing) = existing
        && let Some(skip) =
            existing_object(dst, rel, size, expected.as_deref(), opts, existing).await?
    {
        return Ok(skip);
    }

    let reader = PartReader::File {
        file: handle,
        tier: source_name,
        rel: rel.to_owned(),
        offset: 0,
    };
    send_object(dst, rel, size, expected, reader, progress).await
}

/// Skip, or refuse, when an object is already under the key.
pub(crate) async fn existing_object(
    dst: &S3Tier,
    rel: &str,
    size: u64,
    expected: Option<&str>,
    opts: &CopyOptions,
    existing: super::ObjectInfo,
) -> Result<Option<CopyOutcome>, TransferError> {
    let conflict = |why: String| {
        dst.site(Side::Destination, rel)
            .error(ErrorKind::DestinationConflict, why)
    };
    let Some(want) = expected else {
        return Ok(None);
    };
    if existing.size != size {
        return Err(conflict(format!(
            "an object of {} bytes is already there; the source is {size} bytes",
            existing.size
        )));
    }
    if opts.trust_recorded_hash && existing.sha256_meta.as_deref() == Some(want) {
        return Ok(Some(CopyOutcome::Skipped {
            reason: SkipReason::AlreadyPresentTrusted,
            sha256: want.to_owned(),
        }));
    }
    let digest = dst
        .hash_object(
            rel,
            Side::Destination,
            existing.etag.as_deref(),
            ReadLimit::default(),
        )
        .await?;
    if digest.sha256 == want && digest.size == size {
        Ok(Some(CopyOutcome::Skipped {
            reason: SkipReason::AlreadyPresentVerified,
            sha256: want.to_owned(),
        }))
    } else {
        Err(conflict(format!(
            "an object hashing to {} is already there; the source hashes to {want}",
            digest.sha256
        )))
    }
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

/// Where the bytes of an upload come from, read strictly in order.
pub(crate) enum PartReader {
    File {
        file: Arc<File>,
        tier: String,
        rel: String,
        offset: u64,
    },
    /// A GET body from another endpoint (cross-endpoint s3 → s3).
    Stream {
        body: ByteStream,
        site_tier: String,
        rel: String,
        leftover: Bytes,
    },
}

impl PartReader {
    /// Reads exactly `len` bytes (fewer is an error: the source shrank) and feeds them to
    /// `hasher` on a blocking thread, returning both.
    async fn read_part(
        &mut self,
        len: usize,
        mut hasher: Sha256,
    ) -> Result<(Bytes, Sha256), TransferError> {
        match self {
            PartReader::File {
                file,
                tier,
                rel,
                offset,
            } => {
                let file = file.clone();
                let at = *offset;
                let (tier2, rel2) = (tier.clone(), rel.clone());
                let out = tokio::task::spawn_blocking(move || {
                    let mut buf = vec![0u8; len];
                    let mut filled = 0;
                    while filled < len {
                        match file.read_at(&mut buf[filled..], at + filled as u64) {
                            Ok(0) => {
                                return Err(TransferError::new(
                                    ErrorKind::SourceChanged,
                                    Side::Source,
                                    &tier2,
                                    &rel2,
                                    format!(
                                        "file ended at {} bytes while being read",
                                        at + filled as u64
                                    ),
                                ));
                            }
                            Ok(n) => filled += n,
                            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                            Err(e) => {
                                return Err(TransferError::from_io(
                                    e,
                                    Side::Source,
                                    &tier2,
                                    &rel2,
                                    "read",
                                ));
                            }
                        }
                    }
                    hasher.update(&buf);
                    Ok((Bytes::from(buf), hasher))
                })
                .await
                .map_err(|e| join_error(tier, rel, Side::Source, e))??;
                *offset += len as u64;
                Ok(out)
            }
            PartReader::Stream {
                body,
                site_tier,
                rel,
                leftover,
            } => {
                let mut buf = BytesMut::with_capacity(len);
                while buf.len() < len {
                    if leftover.is_empty() {
                        match body.try_next().await {
                            Ok(Some(chunk)) => *leftover = chunk,
                            Ok(None) => {
                                return Err(TransferError::new(
                                    ErrorKind::SourceChanged,
                                    Side::Source,
                                    site_tier.as_str(),
                                    rel.as_str(),
                                    "object ended early while being read",
                                ));
                            }
                            Err(e) => {
                                return Err(TransferError::new(
                                    ErrorKind::ObjectStore,
                                    Side::Source,
                                    site_tier.as_str(),
                                    rel.as_str(),
                                    format!("reading the source object: {}", chain(&e)),
                                )
                                .with_source(e));
                            }
                        }
                    }
                    let take = (len - buf.len()).min(leftover.len());
                    buf.extend_from_slice(&leftover.split_to(take));
                }
                let data = buf.freeze();
                let hashed = data.clone();
                let hasher = tokio::task::spawn_blocking(move || {
                    hasher.update(&hashed);
                    hasher
                })
                .await
                .map_err(|e| join_error(site_tier, rel, Side::Source, e))?;
                Ok((data, hasher))
            }
        }
    }

    /// After the last part: the source must hold nothing more.
    async fn check_exhausted(&mut self) -> Result<(), TransferError> {
        let (grew, tier, rel) = match self {
            PartReader::File {
                file,
                tier,
                rel,
                offset,
            } => {
                let file = file.clone();
                let at = *offset;
                let grew = tokio::task::spawn_blocking(move || {
                    let mut probe = [0u8; 1];
                    file.read_at(&mut probe, at).map(|n| n > 0).unwrap_or(false)
                })
                .await
                .unwrap_or(false);
                (grew, tier.as_str(), rel.as_str())
            }
            PartReader::Stream {
                body,
                site_tier,
                rel,
                leftover,
            } => {
                let grew = !leftover.is_empty()
                    || matches!(body.try_next().await, Ok(Some(c)) if !c.is_empty());
                (grew, site_tier.as_str(), rel.as_str())
            }
        };
        if grew {
            return Err(TransferError::new(
                ErrorKind::SourceChanged,
                Side::Source,
                tier,
                rel,
                "the source grew while it was being read",
            ));
        }
        Ok(())
    }
}

/// Sends `size` bytes from `reader` to `rel` on `dst`, proving them against `expected` (when
/// given) before the object becomes visible. Returns the outcome with the proven hash.
pub(crate) async fn send_object(
    dst: &S3Tier,
    rel: &str,
    size: u64,
    expected: Option<String>,
    mut reader: PartReader,
    progress: &Progress,
) -> Result<CopyOutcome, TransferError> {
    let key = dst.key_for(rel, Side::Destination)?;
    let site = dst.site(Side::Destination, rel);
    if size <= dst.config().multipart_threshold {
        let (data, hasher) = reader.read_part(size as usize, Sha256::new()).await?;
        reader.check_exhausted().await?;
        let sha = hex::encode(hasher.finalize());
        prove(site, &sha, expected.as_deref())?;
        let mut request = dst
            .client()
            .put_object()
            .bucket(dst.bucket())
            .key(&key)
            .content_length(size as i64)
            .metadata(SHA256_METADATA_KEY, &sha);
        if dst.config().send_checksums {
            request = request.checksum_sha256(sha256_hex_to_base64(&sha).unwrap_or_default());
        }
        let _slot = dst.request_slot().await;
        request
            .body(ByteStream::from(data))
            .send()
            .await
            .map_err(|e| map_sdk_error("PutObject", site, e))?;
        progress.add_bytes(size);
        return Ok(CopyOutcome::Copied {
            bytes: size,
            sha256: sha,
            engine: "s3-put",
        });
    }

    let Some(expected) = expected else {
        return Err(site.error(
            ErrorKind::Config,
            "a multipart upload needs the whole-object hash before it starts",
        ));
    };
    let upload_id = {
        let mut request = dst
            .client()
            .create_multipart_upload()
            .bucket(dst.bucket())
            .key(&key)
            .metadata(SHA256_METADATA_KEY, &expected);
        if dst.config().send_checksums {
            request = request.checksum_algorithm(ChecksumAlgorithm::Sha256);
        }
        let _slot = dst.request_slot().await;
        let created = request
            .send()
            .await
            .map_err(|e| map_sdk_error("CreateMultipartUpload", site, e))?;
        created.upload_id().map(str::to_owned).ok_or_else(|| {
            site.error(
                ErrorKind::ObjectStore,
                "CreateMultipartUpload returned no upload id",
            )
        })?
    };
    let result = send_parts(
        dst,
        rel,
        &key,
        &upload_id,
        size,
        &expected,
        &mut reader,
        progress,
    )
    .await;
    match result {
        Ok(()) => Ok(CopyOutcome::Copied {
            bytes: size,
            sha256: expected,
            engine: "s3-multipart",
        }),
        Err(e) => {
            abort_upload(dst, rel, &key, &upload_id).await;
            Err(e)
        }
    }
}

/// Aborts a multipart upload; a failure to abort is logged (the original error matters more).
pub(crate) async fn abort_upload(dst: &S3Tier, rel: &str, key: &str, upload_id: &str) {
    let _slot = dst.request_slot().await;
    if let Err(e) = dst
        .client()
        .abort_multipart_upload()
        .bucket(dst.bucket())
        .key(key)
        .upload_id(upload_id)
        .send()
        .await
    {
        let e = map_sdk_error("AbortMultipartUpload", dst.site(Side::Destination, rel), e);
        tracing::warn!(tier = dst.name(), path = rel, upload_id, error = %e, "could not abort a failed multipart upload");
    }
}

fn prove(site: Site<'_>, got: &str, expected: Option<&str>) -> Result<(), TransferError> {
    match expected {
        Some(want) if want != got => Err(TransferError::new(
            ErrorKind::ChecksumMismatch,
            Side::Source,
            site.tier,
            site.path,
            format!(
                "source hashes to {got}, the file reference says {want}; no object was written"
            ),
        )),
        _ => Ok(()),
    }
}

#[allow(clippy::too_many_arguments)]
async fn send_parts(
    dst: &S3Tier,
    rel: &str,
    key: &str,
    upload_id: &str,
    size: u64,
    expected: &str,
    reader: &mut PartReader,
    progress: &Progress,
) -> Result<(), TransferError> {
    let site = dst.site(Side::Destination, rel);
    let part_size = dst.config().part_size_for(size);
    let count = size.div_ceil(part_size);
    let window = Arc::new(Semaphore::new(
        dst.config()
            .concurrency
            .clamp(1, MAX_WINDOW)
            .min(count as usize),
    ));
    let mut tasks: JoinSet<Result<CompletedPart, TransferError>> = JoinSet::new();
    let mut parts = Vec::with_capacity(count as usize);
    let mut hasher = Sha256::new();
    for index in 0..count {
        let slot = window
            .clone()
            .acquire_owned()
            .await
            .expect("the window semaphore is never closed");
        while let Some(done) = tasks.try_join_next() {
            parts.push(flatten(done, site)?);
        }
        let len = part_size.min(size - index * part_size) as usize;
        let (data, next) = reader.read_part(len, hasher).await?;
        hasher = next;
        let dst = dst.clone();
        let key = key.to_owned();
        let upload_id = upload_id.to_owned();
        let rel = rel.to_owned();
        let progress = progress.clone();
        let number = index as i32 + 1;
        tasks.spawn(async move {
            let _window = slot;
            let checksum = if dst.config().send_checksums {
                let hashed = data.clone();
                Some(
                    tokio::task::spawn_blocking(move || sha256_base64(&hashed))
                        .await
                        .map_err(|e| join_error(dst.name(), &rel, Side::Destination, e))?,
                )
            } else {
                None
            };
            let _slot = dst.request_slot().await;
            let sent = dst
                .client()
                .upload_part()
                .bucket(dst.bucket())
                .key(&key)
                .upload_id(&upload_id)
                .part_number(number)
                .content_length(len as i64)
                .set_checksum_sha256(checksum.clone())
                .body(ByteStream::from(data))
                .send()
                .await
                .map_err(|e| map_sdk_error("UploadPart", dst.site(Side::Destination, &rel), e))?;
            progress.add_bytes(len as u64);
            Ok(CompletedPart::builder()
                .part_number(number)
                .set_e_tag(sent.e_tag().map(str::to_owned))
                .set_checksum_sha256(checksum)
                .build())
        });
    }
    reader.check_exhausted().await?;
    while let Some(done) = tasks.join_next().await {
        parts.push(flatten(done, site)?);
    }
    let whole = hex::encode(hasher.finalize());
    if whole != expected {
        return Err(TransferError::new(
            ErrorKind::ChecksumMismatch,
            Side::Source,
            site.tier,
            rel,
            format!(
                "source hashes to {whole}, expected {expected}; the multipart upload was aborted"
            ),
        ));
    }
    parts.sort_by_key(|p| p.part_number());
    let _slot = dst.request_slot().await;
    dst.client()
        .complete_multipart_upload()
        .bucket(dst.bucket())
        .key(key)
        .upload_id(upload_id)
        .multipart_upload(
            CompletedMultipartUpload::builder()
                .set_parts(Some(parts))
                .build(),
        )
        .send()
        .await
        .map_err(|e| map_sdk_error("CompleteMultipartUpload", site, e))?;
    Ok(())
}

fn flatten<T>(
    done: Result<Result<T, TransferError>, tokio::task::JoinError>,
    site: Site<'_>,
) -> Result<T, TransferError> {
    done.map_err(|e| site.error(ErrorKind::Io, format!("part task failed: {e}")))?
}
