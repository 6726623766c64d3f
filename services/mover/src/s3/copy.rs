//! s3 → s3: a server-side copy when both tiers are on one endpoint (`CopyObject`, or
//! `UploadPartCopy` parts above S3's 5 GiB single-copy limit), otherwise the object is streamed
//! from one endpoint into a multipart upload on the other. Either way the copy is proven: the
//! source is checked against the file reference first (its recorded hash, or one streamed hash
//! when it has none), the copy is pinned to the source's ETag so a replacement in between is
//! `SourceChanged`, and the destination's size and recorded hash are checked afterwards.

use aws_sdk_s3::types::{CompletedMultipartUpload, CompletedPart, MetadataDirective};

use super::config::MAX_PART_SIZE;
use super::errors::map_sdk_error;
use super::upload::{PartReader, abort_upload, existing_object, send_object};
use super::{S3Tier, SHA256_METADATA_KEY, expected_sha};
use crate::error::{ErrorKind, Side, TransferError};
use crate::transfer::{CopyOptions, CopyOutcome, FileRef, Progress, ReadLimit};

/// Copies `file` between two S3 tiers.
pub async fn copy_within(
    src: &S3Tier,
    dst: &S3Tier,
    file: &FileRef,
    opts: &CopyOptions,
    progress: &Progress,
) -> Result<CopyOutcome, TransferError> {
    let rel = file.path.as_str();
    let src_key = src.key_for(rel, Side::Source)?;
    let dst_key = dst.key_for(rel, Side::Destination)?;
    let src_site = src.site(Side::Source, rel);
    let info = src.stat_side(rel, Side::Source).await?.ok_or_else(|| {
        src_site.error(
            ErrorKind::NotFound,
            format!(
                "no object s3://{}/{src_key} at {}",
                src.bucket(),
                src.endpoint()
            ),
        )
    })?;
    if info.size != file.size {
        return Err(src_site.error(
            ErrorKind::SizeMismatch,
            format!(
                "object is {} bytes, the file reference says {}",
                info.size, file.size
            ),
        ));
    }

    // Establish the hash the copy must carry: the recorded one when trusted, else hash once.
    let expected = expected_sha(file, opts);
    let proven = match (&expected, &info.sha256_meta) {
        (Some(want), Some(recorded)) if want != recorded => {
            return Err(src_site.error(
                ErrorKind::ChecksumMismatch,
                format!("object's recorded sha256 is {recorded}, the file reference says {want}"),
            ));
        }
        (_, Some(recorded)) => recorded.clone(),
        (_, None) => {
            let digest = src
                .hash_object(
                    rel,
                    Side::Source,
                    info.etag.as_deref(),
                    ReadLimit::default(),
                )
                .await?;
            if let Some(want) = &expected
                && *want != digest.sha256
            {
                return Err(src_site.error(
                    ErrorKind::ChecksumMismatch,
                    format!(
                        "object hashes to {}, the file reference says {want}",
                        digest.sha256
                    ),
                ));
            }
            digest.sha256
        }
    };

    if let Some(existing) = dst.stat(rel).await?
        && let Some(skip) =
            existing_object(dst, rel, info.size, Some(&proven), opts, existing).await?
    {
        return Ok(skip);
    }

    if !src.same_endpoint(dst) {
        let response = {
            let _slot = src.request_slot().await;
            src.client()
                .get_object()
                .bucket(src.bucket())
                .key(&src_key)
                .set_if_match(info.etag.clone())
                .send()
                .await
                .map_err(|e| map_sdk_error("GetObject", src_site, e))?
        };
        let reader = PartReader::Stream {
            body: response.body,
            site_tier: src.name().to_owned(),
            rel: rel.to_owned(),
            leftover: bytes::Bytes::new(),
        };
        return send_object(dst, rel, info.size, Some(proven), reader, progress).await;
    }

    let copy_source = format!("{}/{}", src.bucket(), encode_key(&src_key));
    let dst_site = dst.site(Side::Destination, rel);
    let engine = if info.size <= MAX_PART_SIZE {
        let _slot = dst.request_slot().await;
        let mut request = dst
            .client()
            .copy_object()
            .bucket(dst.bucket())
            .key(&dst_key)
            .copy_source(&copy_source)
            .metadata_directive(MetadataDirective::Replace)
            .metadata(SHA256_METADATA_KEY, &proven);
        if let Some(etag) = &info.etag {
            request = request.copy_source_if_match(etag);
        }
        request
            .send()
            .await
            .map_err(|e| map_sdk_error("CopyObject", dst_site, e))?;
        "s3-server-copy"
    } else {
        copy_in_parts(
            src,
            dst,
            rel,
            &copy_source,
            &dst_key,
            info.size,
            info.etag.as_deref(),
            Some(&proven),
        )
        .await?;
        "s3-server-part-copy"
    };
    progress.add_bytes(info.size);

    let landed = dst.stat(rel).await?.ok_or_else(|| {
        dst_site.error(
            ErrorKind::ObjectStore,
            "the copied object is not there after the copy",
        )
    })?;
    if landed.size != info.size || landed.sha256_meta.as_deref() != Some(proven.as_str()) {
        return Err(dst_site.error(
            ErrorKind::ChecksumMismatch,
            format!(
                "after the copy the object is {} bytes recording sha256 {:?}; expected {} bytes and {proven}",
                landed.size, landed.sha256_meta, info.size
            ),
        ));
    }
    Ok(CopyOutcome::Copied {
        bytes: info.size,
        sha256: proven,
        engine,
    })
}

/// A key as it goes into `x-amz-copy-source`: percent-encoded, with `/` kept.
pub(super) fn encode_key(key: &str) -> String {
    let mut out = String::with_capacity(key.len());
    for b in key.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'/' | b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// `UploadPartCopy` for objects above the single-copy limit; the new object records `sha`
/// (when the source recorded none, neither does the copy).
#[allow(clippy::too_many_arguments)]
pub(super) async fn copy_in_parts(
    src: &S3Tier,
    dst: &S3Tier,
    rel: &str,
    copy_source: &str,
    dst_key: &str,
    size: u64,
    etag: Option<&str>,
    sha: Option<&str>,
) -> Result<(), TransferError> {
    let site = dst.site(Side::Destination, rel);
    let upload_id = {
        let _slot = dst.request_slot().await;
        dst.client()
            .create_multipart_upload()
            .bucket(dst.bucket())
            .key(dst_key)
            .set_metadata(sha.map(|sha| [(SHA256_METADATA_KEY.to_owned(), sha.to_owned())].into()))
            .send()
            .await
            .map_err(|e| map_sdk_error("CreateMultipartUpload", site, e))?
            .upload_id()
            .map(str::to_owned)
            .ok_or_else(|| site.error(ErrorKind::ObjectStore, "no upload id returned"))?
    };
    let part = dst.config().part_size_for(size).max(MAX_PART_SIZE / 5);
    let count = size.div_ceil(part);
    let mut tasks = tokio::task::JoinSet::new();
    for index in 0..count {
        let (dst, src_name) = (dst.clone(), src.name().to_owned());
        let (copy_source, dst_key, upload_id, rel) = (
            copy_source.to_owned(),
            dst_key.to_owned(),
            upload_id.clone(),
            rel.to_owned(),
        );
        let etag = etag.map(str::to_owned);
        let start = index * part;
        let end = (start + part).min(size) - 1;
        tasks.spawn(async move {
            let _slot = dst.request_slot().await;
            let copied = dst
                .client()
                .upload_part_copy()
                .bucket(dst.bucket())
                .key(&dst_key)
                .upload_id(&upload_id)
                .part_number(index as i32 + 1)
                .copy_source(&copy_source)
                .copy_source_range(format!("bytes={start}-{end}"))
                .set_copy_source_if_match(etag)
                .send()
                .await
                .map_err(|e| {
                    map_sdk_error("UploadPartCopy", dst.site(Side::Destination, &rel), e)
                })?;
            let _ = src_name;
            Ok::<_, TransferError>(
                CompletedPart::builder()
                    .part_number(index as i32 + 1)
                    .set_e_tag(
                        copied
                            .copy_part_result()
                            .and_then(|r| r.e_tag())
                            .map(str::to_owned),
                    )
                    .build(),
            )
        });
    }
    let mut parts = Vec::with_capacity(count as usize);
    let mut failure = None;
    while let Some(done) = tasks.join_next().await {
        match done {
            Ok(Ok(p)) => parts.push(p),
            Ok(Err(e)) => {
                tasks.abort_all();
                failure.get_or_insert(e);
            }
            Err(e) if e.is_cancelled() => {}
            Err(e) => {
                failure.get_or_insert(
                    site.error(ErrorKind::Io, format!("part copy task failed: {e}")),
                );
            }
        }
    }
    if let Some(e) = failure {
        abort_upload(dst, rel, dst_key, &upload_id).await;
        return Err(e);
    }
    parts.sort_by_key(|p| p.part_number());
    let completed = {
        let _slot = dst.request_slot().await;
        dst.client()
            .complete_multipart_upload()
            .bucket(dst.bucket())
            .key(dst_key)
            .upload_id(&upload_id)
            .multipart_upload(
                CompletedMultipartUpload::builder()
                    .set_parts(Some(parts))
                    .build(),
            )
            .send()
            .await
    };
    if let Err(e) = completed {
        abort_upload(dst, rel, dst_key, &upload_id).await;
        return Err(map_sdk_error("CompleteMultipartUpload", site, e));
    }
    Ok(())
}
