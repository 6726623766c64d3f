//! A rename on S3, which has none: the store copies the object to its new key itself
//! (`CopyObject`, or `UploadPartCopy` parts above the 5 GiB single-copy limit), pinned to the
//! ETag the caller listed; the copy is checked; only then is the old key deleted, pinned to
//! that ETag too. What the audit quarantines stray data with: no key is deleted whose bytes
//! are not at the new one.

use aws_sdk_s3::types::MetadataDirective;

use super::S3Tier;
use super::config::MAX_PART_SIZE;
use super::copy::{copy_in_parts, encode_key};
use super::errors::map_sdk_error;
use crate::error::{ErrorKind, Side, TransferError};
use crate::transfer::ReadLimit;

/// What [`rename_object`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renamed {
    /// The bytes are at the new key, checked, and the old key is gone.
    Moved,
    /// Something is at the new key already: nothing copied, nothing deleted.
    DestinationTaken,
}

/// Renames the object at `from` (tier-relative) to `to` on the same tier, provided it still
/// has the ETag `etag` (what a listing found). An object replaced since is
/// [`ErrorKind::SourceChanged`] and stays where it is; a replacement between the copy and the
/// delete keeps the new bytes at `from` (looked at again just before the delete, which is
/// itself pinned with `If-Match`) beside the copy at `to`.
///
/// The copy counts when it has the source's size and recorded SHA-256 and, for an object
/// written in one part, its ETag (the store's MD5 of the bytes); an object written in parts
/// has no comparable ETag, so both keys are read and hashed.
pub async fn rename_object(
    tier: &S3Tier,
    from: &str,
    to: &str,
    etag: &str,
) -> Result<Renamed, TransferError> {
    if tier.stat(to).await?.is_some() {
        return Ok(Renamed::DestinationTaken);
    }
    let site = tier.site(Side::Source, from);
    let info = tier
        .stat_side(from, Side::Source)
        .await?
        .ok_or_else(|| site.error(ErrorKind::NotFound, "the object is gone"))?;
    if info.etag.as_deref() != Some(etag) {
        return Err(site.error(
            ErrorKind::SourceChanged,
            format!(
                "its ETag is {:?} now, {etag} when it was listed: not moved",
                info.etag
            ),
        ));
    }
    let from_key = tier.key_for(from, Side::Source)?;
    let to_key = tier.key_for(to, Side::Destination)?;
    let copy_source = format!("{}/{}", tier.bucket(), encode_key(&from_key));
    let to_site = tier.site(Side::Destination, to);
    if info.size <= MAX_PART_SIZE {
        let _slot = tier.request_slot().await;
        tier.client()
            .copy_object()
            .bucket(tier.bucket())
            .key(&to_key)
            .copy_source(&copy_source)
            .copy_source_if_match(etag)
            .metadata_directive(MetadataDirective::Copy)
            .send()
            .await
            .map_err(|e| map_sdk_error("CopyObject", to_site, e))?;
    } else {
        copy_in_parts(
            tier,
            tier,
            from,
            &copy_source,
            &to_key,
            info.size,
            Some(etag),
            info.sha256_meta.as_deref(),
        )
        .await?;
    }

    let landed = tier
        .stat(to)
        .await?
        .ok_or_else(|| to_site.error(ErrorKind::ObjectStore, "the copy is not there"))?;
    let single_part = !etag.contains('-');
    let same_bytes = if landed.size != info.size || landed.sha256_meta != info.sha256_meta {
        false
    } else if single_part {
        landed.etag.as_deref() == Some(etag)
    } else {
        let limit = ReadLimit::default();
        let there = tier
            .hash_object(to, Side::Destination, landed.etag.as_deref(), limit)
            .await?;
        let here = tier
            .hash_object(from, Side::Source, Some(etag), limit)
            .await?;
        there.sha256 == here.sha256
    };
    if !same_bytes {
        return Err(to_site.error(
            ErrorKind::ChecksumMismatch,
            format!(
                "the copy of {from} is {} bytes, ETag {:?}, sha256 {:?}; the object is {} bytes, \
                 ETag {etag}, sha256 {:?}: {from} is kept",
                landed.size, landed.etag, landed.sha256_meta, info.size, info.sha256_meta
            ),
        ));
    }

    // `If-Match` on the delete keeps a rewrite made since; a store that ignores the header
    // would delete it, so the object is looked at once more first, leaving that store only
    // the instant between the two requests.
    let now = tier.stat_side(from, Side::Source).await?;
    if now.as_ref().and_then(|o| o.etag.as_deref()) != Some(etag) {
        return Err(site.error(
            ErrorKind::SourceChanged,
            format!(
                "rewritten or removed after its copy to {to} was checked (ETag {:?} now):                  kept, beside the copy",
                now.and_then(|o| o.etag)
            ),
        ));
    }
    let _slot = tier.request_slot().await;
    tier.client()
        .delete_object()
        .bucket(tier.bucket())
        .key(&from_key)
        .if_match(etag)
        .send()
        .await
        .map_err(|e| map_sdk_error("DeleteObject", site, e))?;
    Ok(Renamed::Moved)
}
