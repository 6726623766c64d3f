//! The S3 tier: a bucket and a key prefix on an S3-compatible endpoint (AWS, SeaweedFS, MinIO,
//! Ceph RGW), and the transfers to, from and within it.
//!
//! - s3 → posix ([`download`]): an object of at most one part is one GET (size, ETag and
//!   recorded SHA-256 from its response, no HEAD). A larger one is parallel ranged GETs (one part
//!   per range, a bounded number in flight), each streamed chunk by chunk into a temp file at its
//!   offset; the file is hashed in order from the same chunks as contiguous ranges complete (a
//!   reorder window of ranges bounds the memory held). Size and SHA-256 (the file reference's,
//!   else the one recorded with the object) are checked before the temp file is published. Every
//!   ranged GET carries `If-Match` with the ETag seen first, so an object replaced mid-download
//!   is `SourceChanged`, not a mixed file.
//! - posix → s3 ([`upload`]): one PUT with `x-amz-checksum-sha256` below the multipart threshold,
//!   otherwise a multipart upload with parallel parts, each with its own SHA-256 checksum. The
//!   source is read once and hashed on the way; the whole-object SHA-256 is stored in metadata
//!   (`x-amz-meta-sha256`) because S3 keeps only a composite checksum for multipart objects. A
//!   multipart upload whose whole-file hash does not match is aborted, never completed.
//! - s3 → s3 ([`copy_within`]): server-side `CopyObject` (`UploadPartCopy` above 5 GiB) when
//!   both tiers are on the same endpoint, streamed through otherwise; then verified.
//!
//! Keys are `prefix/rel` with `rel` checked by [`check_relative_path`]. Credentials come from the
//! environment or a named profile, never from events. The SDK retries each request (standard
//! mode); nothing here retries on top of it.

mod client;
mod config;
mod copy;
mod download;
mod errors;
mod lock;
mod rename;
mod upload;

use std::sync::Arc;

use bytes::Bytes;
use futures::future::BoxFuture;
use sha2::{Digest, Sha256};
use stagehand_schemas::check_relative_path;
use stagehand_schemas::pieces::{PieceHasher, PieceHashes};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::{ErrorKind, Side, TransferError};
use crate::transfer::{FileDigest, PiecedDigest, ReadLimit};

pub use config::{MAX_PART_SIZE, MAX_PARTS, MIN_PART_SIZE, S3Config};
pub use copy::copy_within;
pub use download::{download, download_pending};
pub use lock::{BucketLock, DefaultRetention, ObjectRetention, RetentionMode};
pub use rename::{Renamed, rename_object};
pub use upload::upload;

use errors::{Site, map_sdk_error};

/// The longest object key S3 accepts, in bytes of UTF-8.
pub const MAX_KEY_LEN: usize = 1024;

/// The metadata key (sent as `x-amz-meta-sha256`) holding the object's whole SHA-256 in hex.
pub const SHA256_METADATA_KEY: &str = "sha256";

/// What a HEAD says about an object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectInfo {
    pub size: u64,
    /// The SHA-256 recorded in the object's metadata when it was written, if any.
    pub sha256_meta: Option<String>,
    /// The ETag, used to detect a replacement while the object is read.
    pub etag: Option<String>,
}

/// One page of an S3 listing ([`S3Tier::list_page`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ListPage {
    /// Keys relative to the tier root, with their sizes, in key order.
    pub objects: Vec<(String, u64)>,
    /// The continuation token of the next page; `None` after the last.
    pub next: Option<String>,
}

/// A listed object as [`S3Tier::list_stamped_page`] gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedObject {
    /// The key relative to the tier root.
    pub rel: String,
    pub size: u64,
    /// The ETag: what pins a later copy or delete to these bytes.
    pub etag: String,
    /// When the object was last written.
    pub modified: crate::fingerprint::Time,
}

/// An S3 tier, cheap to clone (clones share the client and the request limit).
#[derive(Clone)]
pub struct S3Tier {
    inner: Arc<Inner>,
}

struct Inner {
    name: String,
    config: S3Config,
    client: aws_sdk_s3::Client,
    /// The endpoint as shown in errors (`default AWS endpoint` when none is set).
    endpoint: String,
    /// Requests in flight against this tier, shared by every transfer using it.
    requests: Arc<Semaphore>,
    /// The fault-injection seam of [`S3Tier::with_range_hook`]; `None` outside tests.
    range_hook: Option<RangeHook>,
}

/// Called with the tier-relative path and the range's offset before each ranged GET of a
/// download after its first; the download waits for the returned future.
pub type RangeHook = Arc<dyn Fn(&str, u64) -> BoxFuture<'static, ()> + Send + Sync>;

impl std::fmt::Debug for S3Tier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("S3Tier")
            .field("name", &self.inner.name)
            .field("endpoint", &self.inner.endpoint)
            .field("bucket", &self.inner.config.bucket)
            .field("prefix", &self.inner.config.prefix)
            .finish()
    }
}

impl S3Tier {
    /// Builds the tier's client. Credentials are resolved lazily, on the first request, from
    /// the `AWS_*` environment or from `config.profile`.
    pub fn connect(name: impl Into<String>, config: S3Config) -> Result<S3Tier, TransferError> {
        let name = name.into();
        config.validate(&name)?;
        let client = client::build(&config, client::Credentials::EnvOrProfile)?;
        Ok(Self::from_parts(name, config, client))
    }

    /// Like [`S3Tier::connect`] with explicit static credentials (for embedding the mover where
    /// credentials come from a secret store rather than the process environment).
    pub fn connect_with_keys(
        name: impl Into<String>,
        config: S3Config,
        access_key_id: &str,
        secret_access_key: &str,
    ) -> Result<S3Tier, TransferError> {
        let name = name.into();
        config.validate(&name)?;
        let client = client::build(
            &config,
            client::Credentials::Static {
                access_key_id: access_key_id.to_owned(),
                secret_access_key: secret_access_key.to_owned(),
            },
        )?;
        Ok(Self::from_parts(name, config, client))
    }

    /// A tier on `bucket`/`prefix` with the endpoint from `STAGEHAND_S3_ENDPOINT` or
    /// `AWS_ENDPOINT_URL` (AWS when neither is set), the region from `AWS_REGION` (default
    /// `us-east-1`), the profile from `AWS_PROFILE`, credentials from the environment, and
    /// optionally `STAGEHAND_S3_CONCURRENCY` (requests in flight) and `STAGEHAND_S3_PART_SIZE`
    /// (bytes per part and multipart threshold).
    pub fn from_env(
        name: impl Into<String>,
        bucket: impl Into<String>,
        prefix: impl Into<String>,
    ) -> Result<S3Tier, TransferError> {
        let mut config = S3Config::new(bucket, prefix);
        config.endpoint = [
            "STAGEHAND_S3_ENDPOINT",
            "AWS_ENDPOINT_URL_S3",
            "AWS_ENDPOINT_URL",
        ]
        .iter()
        .find_map(|var| std::env::var(var).ok().filter(|v| !v.is_empty()));
        if let Some(region) = std::env::var("AWS_REGION")
            .ok()
            .or_else(|| std::env::var("AWS_DEFAULT_REGION").ok())
            .filter(|r| !r.is_empty())
        {
            config.region = region;
        }
        config.profile = std::env::var("AWS_PROFILE").ok().filter(|p| !p.is_empty());
        let name = name.into();
        let number = |var: &str| -> Result<Option<u64>, TransferError> {
            match std::env::var(var) {
                Ok(v) if !v.is_empty() => v.parse().map(Some).map_err(|_| {
                    TransferError::new(
                        ErrorKind::Config,
                        Side::Source,
                        name.as_str(),
                        var,
                        format!("{var}={v:?} is not a whole number"),
                    )
                }),
                _ => Ok(None),
            }
        };
        if let Some(n) = number("STAGEHAND_S3_CONCURRENCY")? {
            config.concurrency = n as usize;
        }
        if let Some(n) = number("STAGEHAND_S3_PART_SIZE")? {
            config.part_size = n;
            config.multipart_threshold = n;
        }
        Self::connect(name, config)
    }

    fn from_parts(name: String, config: S3Config, client: aws_sdk_s3::Client) -> S3Tier {
        let endpoint = config
            .endpoint
            .clone()
            .unwrap_or_else(|| format!("default AWS endpoint ({})", config.region));
        let requests = Arc::new(Semaphore::new(config.concurrency));
        S3Tier {
            inner: Arc::new(Inner {
                name,
                config,
                client,
                endpoint,
                requests,
                range_hook: None,
            }),
        }
    }

    /// The same tier (same client and request limit) with a seam for fault tests: `hook` runs
    /// between the ranges of a ranged download, after the first range has started and before
    /// each later range's GET, so a test can change the object in the middle of a download
    /// deterministically. Production code never sets it.
    #[doc(hidden)]
    pub fn with_range_hook(&self, hook: RangeHook) -> S3Tier {
        S3Tier {
            inner: Arc::new(Inner {
                name: self.inner.name.clone(),
                config: self.inner.config.clone(),
                client: self.inner.client.clone(),
                endpoint: self.inner.endpoint.clone(),
                requests: self.inner.requests.clone(),
                range_hook: Some(hook),
            }),
        }
    }

    /// The same tier (same client and request limit) rooted at `rel` beneath this one's
    /// prefix; `""` is this tier.
    pub fn beneath(&self, rel: &str) -> Result<S3Tier, TransferError> {
        if rel.is_empty() {
            return Ok(self.clone());
        }
        let prefix = self.key_for(rel, Side::Source)?;
        let mut config = self.inner.config.clone();
        config.prefix = prefix;
        Ok(S3Tier {
            inner: Arc::new(Inner {
                name: self.inner.name.clone(),
                config,
                client: self.inner.client.clone(),
                endpoint: self.inner.endpoint.clone(),
                requests: self.inner.requests.clone(),
                range_hook: self.inner.range_hook.clone(),
            }),
        })
    }

    pub(crate) fn range_hook(&self) -> Option<&RangeHook> {
        self.inner.range_hook.as_ref()
    }

    pub fn name(&self) -> &str {
        &self.inner.name
    }

    pub fn bucket(&self) -> &str {
        &self.inner.config.bucket
    }

    pub fn prefix(&self) -> &str {
        &self.inner.config.prefix
    }

    pub fn endpoint(&self) -> &str {
        &self.inner.endpoint
    }

    pub fn config(&self) -> &S3Config {
        &self.inner.config
    }

    /// The underlying SDK client (for inspection and administration, e.g. creating buckets).
    pub fn client(&self) -> &aws_sdk_s3::Client {
        &self.inner.client
    }

    /// The object key for the tier-relative path `rel`, refusing `..`, absolute paths, NUL and
    /// anything else that is not a normalised relative path.
    pub fn key_for(&self, rel: &str, side: Side) -> Result<String, TransferError> {
        check_relative_path(rel).map_err(|e| {
            TransferError::new(
                ErrorKind::PathRefused,
                side,
                self.name(),
                rel.replace('\0', "\\0"),
                format!("refused as an S3 key: {e}"),
            )
        })?;
        let key = self.key_unchecked(rel);
        if key.len() > MAX_KEY_LEN {
            return Err(TransferError::new(
                ErrorKind::PathRefused,
                side,
                self.name(),
                rel,
                format!(
                    "the object key would be {} bytes long; S3 keys are at most {MAX_KEY_LEN} bytes",
                    key.len()
                ),
            ));
        }
        Ok(key)
    }

    fn key_unchecked(&self, rel: &str) -> String {
        if self.prefix().is_empty() {
            rel.to_owned()
        } else {
            format!("{}/{rel}", self.prefix())
        }
    }

    pub(crate) fn site<'a>(&'a self, side: Side, path: &'a str) -> Site<'a> {
        Site {
            tier: self.name(),
            endpoint: self.endpoint(),
            bucket: self.bucket(),
            side,
            path,
        }
    }

    /// Waits for a request slot on this tier. Hold it for one request only, never while
    /// waiting for another, so concurrent transfers cannot deadlock on the limit.
    pub(crate) async fn request_slot(&self) -> OwnedSemaphorePermit {
        self.inner
            .requests
            .clone()
            .acquire_owned()
            .await
            .expect("the request semaphore is never closed")
    }

    /// The object's size, recorded SHA-256 and ETag, or `None` when no object has that key.
    pub async fn stat(&self, rel: &str) -> Result<Option<ObjectInfo>, TransferError> {
        self.stat_side(rel, Side::Destination).await
    }

    pub(crate) async fn stat_side(
        &self,
        rel: &str,
        side: Side,
    ) -> Result<Option<ObjectInfo>, TransferError> {
        let key = self.key_for(rel, side)?;
        let _slot = self.request_slot().await;
        match self
            .client()
            .head_object()
            .bucket(self.bucket())
            .key(&key)
            .send()
            .await
        {
            Ok(head) => Ok(Some(ObjectInfo {
                size: head.content_length().unwrap_or(0).max(0) as u64,
                sha256_meta: head
                    .metadata()
                    .and_then(|m| m.get(SHA256_METADATA_KEY))
                    .map(|s| s.to_ascii_lowercase()),
                etag: head.e_tag().map(str::to_owned),
            })),
            Err(err) => {
                let err = map_sdk_error("HeadObject", self.site(side, rel), err);
                if err.kind == ErrorKind::NotFound {
                    Ok(None)
                } else {
                    Err(err)
                }
            }
        }
    }

    /// Every object beneath `prefix` (tier-relative; empty for the whole tier), as keys relative
    /// to the tier root with their sizes, sorted by key. Directory markers (`dir/`) are left out;
    /// a key that is not a valid relative path is an error naming it. Holds the whole listing:
    /// for prefixes of millions of objects, page through [`S3Tier::list_page`] instead.
    pub async fn list(&self, prefix: &str) -> Result<Vec<(String, u64)>, TransferError> {
        let mut out = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let page = self.list_page(prefix, token.take()).await?;
            out.extend(page.objects);
            match page.next {
                Some(next) => token = Some(next),
                None => break,
            }
        }
        out.sort();
        Ok(out)
    }

    /// One page (at most 1,000 keys, in key order) of the objects beneath `prefix`, as
    /// [`S3Tier::list`] gives them, and the continuation token of the next page (`None` after
    /// the last). Start with `token = None`; memory is one page whatever the prefix holds.
    pub async fn list_page(
        &self,
        prefix: &str,
        token: Option<String>,
    ) -> Result<ListPage, TransferError> {
        let (objects, next) = self.list_stamped_page(prefix, token).await?;
        Ok(ListPage {
            objects: objects.into_iter().map(|o| (o.rel, o.size)).collect(),
            next,
        })
    }

    /// One page of the objects beneath `prefix`, as [`S3Tier::list_page`] gives them, with each
    /// object's ETag and last-modified time (what a set's fingerprint records,
    /// `crate::fingerprint`, and what the audit ages stray data by).
    pub async fn list_stamped_page(
        &self,
        prefix: &str,
        token: Option<String>,
    ) -> Result<(Vec<ListedObject>, Option<String>), TransferError> {
        let list_prefix = match (self.prefix().is_empty(), prefix.is_empty()) {
            (true, true) => String::new(),
            (true, false) => format!("{prefix}/"),
            (false, true) => format!("{}/", self.prefix()),
            (false, false) => format!("{}/{prefix}/", self.prefix()),
        };
        if !prefix.is_empty() {
            self.key_for(prefix, Side::Source)?;
        }
        let strip = if self.prefix().is_empty() {
            0
        } else {
            self.prefix().len() + 1
        };
        let page = {
            let _slot = self.request_slot().await;
            self.client()
                .list_objects_v2()
                .bucket(self.bucket())
                .prefix(&list_prefix)
                .set_continuation_token(token)
                .send()
                .await
                .map_err(|e| map_sdk_error("ListObjectsV2", self.site(Side::Source, prefix), e))?
        };
        let mut objects = Vec::with_capacity(page.contents().len());
        for object in page.contents() {
            let Some(key) = object.key() else { continue };
            let rel = &key[strip.min(key.len())..];
            if rel.ends_with('/') && object.size().unwrap_or(0) == 0 {
                continue;
            }
            check_relative_path(rel).map_err(|e| {
                TransferError::new(
                    ErrorKind::PathRefused,
                    Side::Source,
                    self.name(),
                    rel,
                    format!("listed key {key:?} is not a relative path Stagehand accepts: {e}"),
                )
            })?;
            let modified = object
                .last_modified()
                .map(|t| crate::fingerprint::Time {
                    secs: t.secs(),
                    nanos: t.subsec_nanos(),
                })
                .unwrap_or_default();
            objects.push(ListedObject {
                rel: rel.to_owned(),
                size: object.size().unwrap_or(0).max(0) as u64,
                etag: object.e_tag().unwrap_or_default().to_owned(),
                modified,
            });
        }
        let next = match page.next_continuation_token() {
            Some(next) if page.is_truncated().unwrap_or(false) => Some(next.to_owned()),
            _ => None,
        };
        Ok((objects, next))
    }

    /// Streams the whole object and hashes it (on a blocking thread, so the runtime keeps
    /// serving other transfers while SHA-256 runs).
    pub async fn hash_file(&self, rel: &str) -> Result<FileDigest, TransferError> {
        self.hash_object(rel, Side::Source, None, ReadLimit::default())
            .await
    }

    /// Hashes the object at `rel` within `limit`: the GET response's `Content-Length` is
    /// checked against the declared and maximum sizes before any byte of the body is read,
    /// and reading stops one byte past the declared size. A refusal about this one object
    /// (4xx) is permanent ([`ErrorKind::ObjectRefused`], `NotFound`, `PermissionDenied`);
    /// unreachable endpoints, timeouts and 5xx stay retryable.
    pub async fn hash_file_bounded(
        &self,
        rel: &str,
        limit: ReadLimit,
    ) -> Result<FileDigest, TransferError> {
        self.hash_object(rel, Side::Source, None, limit).await
    }

    /// [`S3Tier::hash_file_bounded`], with the piece hashes of an object declared larger than
    /// a piece taken in the same read.
    pub async fn hash_file_pieces(
        &self,
        rel: &str,
        limit: ReadLimit,
    ) -> Result<PiecedDigest, TransferError> {
        let (digest, pieces) = self
            .hash_object_with(rel, Side::Source, None, limit, limit.piece_hasher())
            .await?;
        Ok(PiecedDigest::new(digest, pieces))
    }

    pub(crate) async fn hash_object(
        &self,
        rel: &str,
        side: Side,
        if_match: Option<&str>,
        limit: ReadLimit,
    ) -> Result<FileDigest, TransferError> {
        self.hash_object_with(rel, side, if_match, limit, PieceHasher::whole_only())
            .await
            .map(|(digest, _)| digest)
    }

    async fn hash_object_with(
        &self,
        rel: &str,
        side: Side,
        if_match: Option<&str>,
        limit: ReadLimit,
        mut hasher: PieceHasher,
    ) -> Result<(FileDigest, PieceHashes), TransferError> {
        let key = self.key_for(rel, side)?;
        let _slot = self.request_slot().await;
        let response = self
            .client()
            .get_object()
            .bucket(self.bucket())
            .key(&key)
            .set_if_match(if_match.map(str::to_owned))
            .send()
            .await
            .map_err(|e| map_sdk_error("GetObject", self.site(side, rel), e))?;
        if let Some(length) = response.content_length() {
            limit
                .check_size(length.max(0) as u64)
                .map_err(|(kind, detail)| self.site(side, rel).error(kind, detail))?;
        }
        let cap = limit.read_cap();
        let mut body = response.body;
        // Chunks go to a blocking thread for hashing; the bounded channel keeps at most a few
        // MiB in memory when hashing is slower than the network.
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Bytes>(64);
        let hashing = tokio::task::spawn_blocking(move || {
            let mut size = 0u64;
            while let Some(chunk) = rx.blocking_recv() {
                size += chunk.len() as u64;
                hasher.update(&chunk);
            }
            let (whole, pieces) = hasher.finish();
            let digest = FileDigest {
                size,
                sha256: hex::encode(whole),
            };
            (digest, pieces)
        });
        let mut taken = 0u64;
        while taken < cap {
            match body.try_next().await {
                Ok(Some(mut chunk)) => {
                    let room = cap - taken;
                    if chunk.len() as u64 > room {
                        chunk.truncate(room as usize);
                    }
                    taken += chunk.len() as u64;
                    if tx.send(chunk).await.is_err() {
                        break;
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    return Err(self
                        .site(side, rel)
                        .error(
                            ErrorKind::ObjectStore,
                            format!(
                                "reading the body of {key:?} from {}: {}",
                                self.endpoint(),
                                errors::chain(&e)
                            ),
                        )
                        .with_source(e));
                }
            }
        }
        drop(tx);
        let (digest, pieces) = hashing.await.map_err(|e| {
            self.site(side, rel)
                .error(ErrorKind::Io, format!("hashing task failed: {e}"))
        })?;
        limit
            .check_read(digest.size)
            .map_err(|(kind, detail)| self.site(side, rel).error(kind, detail))?;
        Ok((digest, pieces))
    }

    /// The bytes `range` of the object at `rel`, in one ranged GET (a fan-out's piece of a
    /// large file). Fewer or more bytes than the range holds is [`ErrorKind::SizeMismatch`].
    pub async fn read_range(
        &self,
        rel: &str,
        range: std::ops::Range<u64>,
    ) -> Result<Vec<u8>, TransferError> {
        let key = self.key_for(rel, Side::Source)?;
        let want = range.end.saturating_sub(range.start);
        if want == 0 {
            return Ok(Vec::new());
        }
        let _slot = self.request_slot().await;
        let response = self
            .client()
            .get_object()
            .bucket(self.bucket())
            .key(&key)
            .range(format!("bytes={}-{}", range.start, range.end - 1))
            .send()
            .await
            .map_err(|e| map_sdk_error("GetObject", self.site(Side::Source, rel), e))?;
        let mut body = response.body;
        let mut out = Vec::with_capacity(want as usize);
        loop {
            match body.try_next().await {
                Ok(Some(chunk)) => {
                    out.extend_from_slice(&chunk);
                    if out.len() as u64 > want {
                        break;
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    return Err(self
                        .site(Side::Source, rel)
                        .error(
                            ErrorKind::ObjectStore,
                            format!(
                                "reading bytes {range:?} of {key:?} from {}: {}",
                                self.endpoint(),
                                errors::chain(&e)
                            ),
                        )
                        .with_source(e));
                }
            }
        }
        if out.len() as u64 != want {
            return Err(self.site(Side::Source, rel).error(
                ErrorKind::SizeMismatch,
                format!(
                    "bytes {range:?}: the store returned {} bytes, not {want}",
                    out.len()
                ),
            ));
        }
        Ok(out)
    }

    /// Writes a small object (a marker, an index) in one PUT with its SHA-256 checked by the
    /// server and recorded in metadata. S3 makes it visible only once complete.
    pub async fn put_small(&self, rel: &str, bytes: Vec<u8>) -> Result<(), TransferError> {
        let key = self.key_for(rel, Side::Destination)?;
        let sha_hex = stagehand_schemas::sha256_hex(&bytes);
        let mut put = self
            .client()
            .put_object()
            .bucket(self.bucket())
            .key(&key)
            .metadata(SHA256_METADATA_KEY, &sha_hex);
        if self.config().send_checksums {
            put = put.checksum_sha256(sha256_base64(&bytes));
        }
        let _slot = self.request_slot().await;
        put.body(aws_sdk_s3::primitives::ByteStream::from(bytes))
            .send()
            .await
            .map(|_| ())
            .map_err(|err| map_sdk_error("PutObject", self.site(Side::Destination, rel), err))
    }

    /// Deletes the object at `rel` (absent already is fine): a set found in place with an
    /// object that did not verify has that object replaced ([`crate::Mover::stage_set`]).
    pub async fn delete(&self, rel: &str) -> Result<(), TransferError> {
        let key = self.key_for(rel, Side::Destination)?;
        let _slot = self.request_slot().await;
        match self
            .client()
            .delete_object()
            .bucket(self.bucket())
            .key(&key)
            .send()
            .await
        {
            Ok(_) => Ok(()),
            Err(err) => {
                let err = map_sdk_error("DeleteObject", self.site(Side::Destination, rel), err);
                if err.kind == ErrorKind::NotFound {
                    Ok(())
                } else {
                    Err(err)
                }
            }
        }
    }

    /// Creates the tier's bucket when it does not exist yet (for setting up a new tier).
    pub async fn create_bucket_if_missing(&self) -> Result<(), TransferError> {
        let _slot = self.request_slot().await;
        match self
            .client()
            .head_bucket()
            .bucket(self.bucket())
            .send()
            .await
        {
            Ok(_) => return Ok(()),
            Err(err) => {
                let err = map_sdk_error("HeadBucket", self.site(Side::Destination, ""), err);
                if err.kind != ErrorKind::NotFound {
                    return Err(err);
                }
            }
        }
        match self
            .client()
            .create_bucket()
            .bucket(self.bucket())
            .send()
            .await
        {
            Ok(_) => Ok(()),
            Err(err) => {
                let owned = err
                    .as_service_error()
                    .map(|e| e.is_bucket_already_owned_by_you() || e.is_bucket_already_exists())
                    .unwrap_or(false);
                if owned {
                    Ok(())
                } else {
                    Err(map_sdk_error(
                        "CreateBucket",
                        self.site(Side::Destination, ""),
                        err,
                    ))
                }
            }
        }
    }

    /// Whether `other` talks to the same endpoint with the same client settings, so a
    /// server-side copy between the two is possible.
    pub(crate) fn same_endpoint(&self, other: &S3Tier) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
            || (self.inner.config.endpoint == other.inner.config.endpoint
                && self.inner.config.region == other.inner.config.region
                && self.inner.config.profile == other.inner.config.profile)
    }
}

/// The SHA-256 the transfer must prove: the FileRef's, unless the caller said it has none.
pub(crate) fn expected_sha(
    file: &crate::transfer::FileRef,
    opts: &crate::transfer::CopyOptions,
) -> Option<String> {
    (!opts.expected_hash_unknown).then(|| file.sha256.to_ascii_lowercase())
}

/// Lowercase hex SHA-256 → the base64 form S3's checksum headers use.
pub(crate) fn sha256_hex_to_base64(hex_digest: &str) -> Option<String> {
    use base64::Engine;
    let raw = hex::decode(hex_digest).ok()?;
    Some(base64::engine::general_purpose::STANDARD.encode(raw))
}

pub(crate) fn sha256_base64(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(Sha256::digest(bytes))
}
