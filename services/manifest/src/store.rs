//! [`ManifestStore`]: manifests as JetStream Object Store objects named by their digest.
//!
//! Two kinds of bucket (names in `stagehand_schemas::subject`): each project's upload bucket
//! `stagehand_uploads_<project>`, where uploaders put the manifests their requests reference,
//! and the services' bucket `stagehand_manifests`, which holds the manifest of every validated
//! or prepared version and which only services write, after verifying what they write. Object
//! Store buckets are JetStream streams: replicated with the cluster, no other component.
//!
//! An object's name is the digest it claims to have; nothing fetched is trusted until its
//! bytes hash to that digest, its counts match the reference and every line is canonical.

use async_nats::jetstream::{self, object_store};
use futures::StreamExt;
use sha2::{Digest, Sha256};
use stagehand_schemas::ManifestRef;
use stagehand_schemas::pieces::PieceHashes;
use stagehand_schemas::subject::{MANIFESTS, ObjectBucketSpec, upload_bucket_spec};
use tokio::io::AsyncReadExt;
use tracing::debug;

use crate::error::{ManifestError, ManifestErrorKind};
use crate::manifest::{LineChecker, Manifest, Spool, SpoolWriter, max_manifest_bytes};

/// Object Store chunk size: large enough that a manifest of millions of entries is a few
/// thousand chunks, well under nats-server's default `max_payload`.
pub const CHUNK_BYTES: usize = 256 * 1024;

pub use stagehand_schemas::subject::UPLOAD_MAX_AGE;

/// How a bucket is created when it does not exist yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketOptions {
    /// Stream replicas (1 on one server, 3 on a three-node cluster).
    pub replicas: usize,
}

impl Default for BucketOptions {
    fn default() -> Self {
        BucketOptions { replicas: 1 }
    }
}

/// One manifest bucket.
#[derive(Clone)]
pub struct ManifestStore {
    bucket: String,
    store: object_store::ObjectStore,
}

impl std::fmt::Debug for ManifestStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ManifestStore")
            .field("bucket", &self.bucket)
            .finish()
    }
}

fn nats_err(what: String, e: impl std::error::Error + Send + Sync + 'static) -> ManifestError {
    ManifestError::new(ManifestErrorKind::Nats, what, e.to_string()).with_source(e)
}

impl ManifestStore {
    /// The services' bucket of verified manifests, created if missing.
    pub async fn catalogue(
        js: &jetstream::Context,
        options: BucketOptions,
    ) -> Result<ManifestStore, ManifestError> {
        Self::open_or_create(js, &MANIFESTS, options).await
    }

    /// A project's upload bucket, created if missing (an uploader's first upload).
    pub async fn uploads(
        js: &jetstream::Context,
        project: &str,
        options: BucketOptions,
    ) -> Result<ManifestStore, ManifestError> {
        Self::open_or_create(js, &upload_bucket_spec(project), options).await
    }

    /// An existing bucket; [`ManifestErrorKind::NotFound`] when there is none (nothing was
    /// ever put in it).
    pub async fn open(
        js: &jetstream::Context,
        bucket: &str,
    ) -> Result<ManifestStore, ManifestError> {
        match js.get_object_store(bucket).await {
            Ok(store) => Ok(ManifestStore {
                bucket: bucket.to_owned(),
                store,
            }),
            Err(e) if is_missing_stream(&e) => Err(ManifestError::new(
                ManifestErrorKind::NotFound,
                format!("manifest bucket {bucket}"),
                "no such bucket: no manifest was ever put in it",
            )
            .with_source(e)),
            Err(e) => Err(nats_err(format!("manifest bucket {bucket}"), e)),
        }
    }

    async fn open_or_create(
        js: &jetstream::Context,
        spec: &ObjectBucketSpec,
        options: BucketOptions,
    ) -> Result<ManifestStore, ManifestError> {
        let bucket: &str = &spec.bucket;
        match Self::open(js, bucket).await {
            Ok(store) => return Ok(store),
            Err(e) if e.kind == ManifestErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let created = js
            .create_object_store(object_store::Config {
                bucket: bucket.to_owned(),
                description: Some(spec.description.to_owned()),
                max_age: spec.max_age,
                max_bytes: spec.stream_max_bytes(),
                num_replicas: options.replicas.max(1),
                storage: jetstream::stream::StorageType::File,
                ..Default::default()
            })
            .await;
        match created {
            Ok(store) => Ok(ManifestStore {
                bucket: bucket.to_owned(),
                store,
            }),
            // Another process may have created it first; if not, this user may not create
            // streams (a restricted NATS user: an operator creates the bucket).
            Err(create) => match Self::open(js, bucket).await {
                Err(e) if e.kind == ManifestErrorKind::NotFound => Err(ManifestError::new(
                    ManifestErrorKind::NotFound,
                    format!("manifest bucket {bucket}"),
                    format!(
                        "there is no such bucket and it could not be created ({create}); where \
                         NATS users may not create streams an operator creates it with \
                         `stagehand provision` (a project's upload bucket: `--project <project>`)"
                    ),
                )
                .with_source(create)),
                opened => opened,
            },
        }
    }

    pub fn bucket(&self) -> &str {
        &self.bucket
    }

    fn what(&self, digest: &str) -> String {
        format!("manifest {}/{digest}", self.bucket)
    }

    /// Whether the bucket holds an object named `digest` whose own recorded SHA-256 is
    /// `digest` (the store hashes what it was given).
    pub async fn contains(&self, digest: &str) -> Result<bool, ManifestError> {
        match self.store.info(digest).await {
            Ok(info) if !info.deleted => Ok(info
                .digest
                .as_deref()
                .is_some_and(|d| store_digest_is(d, digest))),
            Ok(_) => Ok(false),
            Err(e) if e.kind() == object_store::InfoErrorKind::NotFound => Ok(false),
            Err(e) => Err(nats_err(self.what(digest), e)),
        }
    }

    /// Stores `manifest` under its digest, unless an object of that digest is there already
    /// (content addressing: it holds the same bytes). Returns the reference.
    pub async fn put(&self, manifest: &Manifest) -> Result<ManifestRef, ManifestError> {
        let digest = manifest.digest().to_owned();
        if self.contains(&digest).await? {
            debug!(bucket = %self.bucket, %digest, "manifest already stored");
            return Ok(manifest.reference());
        }
        let mut reader = manifest.canonical_reader()?;
        let meta = object_store::ObjectMetadata {
            name: digest.clone(),
            description: Some(format!(
                "{} entries, {} bytes",
                manifest.files(),
                manifest.bytes()
            )),
            chunk_size: Some(CHUNK_BYTES),
            ..Default::default()
        };
        let info = self
            .store
            .put(meta, &mut reader)
            .await
            .map_err(|e| nats_err(self.what(&digest), e))?;
        if !info
            .digest
            .as_deref()
            .is_some_and(|d| store_digest_is(d, &digest))
        {
            return Err(ManifestError::new(
                ManifestErrorKind::Mismatch,
                self.what(&digest),
                format!(
                    "the store recorded digest {:?} for what was put",
                    info.digest
                ),
            ));
        }
        Ok(manifest.reference())
    }

    /// Fetches the manifest `reference` names, spooling it, and checks it before returning:
    /// its bytes hash to the digest, its counts are the reference's, every line is canonical.
    ///
    /// Nothing larger than the reference declares is spooled: an object whose stored size is
    /// more than a manifest of the declared file count can be ([`max_manifest_bytes`]) is
    /// refused before it is read, and reading stops at the first entry past the declared file
    /// count or byte total.
    pub async fn fetch(
        &self,
        reference: &ManifestRef,
        spool: &Spool,
    ) -> Result<Manifest, ManifestError> {
        let what = self.what(&reference.digest);
        let mut object = match self.store.get(&reference.digest).await {
            Ok(object) => object,
            Err(e) if e.kind() == object_store::GetErrorKind::NotFound => {
                return Err(ManifestError::new(
                    ManifestErrorKind::NotFound,
                    what,
                    "no such object in the bucket",
                )
                .with_source(e));
            }
            Err(e) => return Err(nats_err(what, e)),
        };
        let limit = max_manifest_bytes(reference.files);
        let stored = object.info().size as u64;
        if stored > limit {
            return Err(ManifestError::new(
                ManifestErrorKind::Mismatch,
                what,
                format!(
                    "the object is {stored} bytes, more than a manifest of {} files can be ({limit} bytes): refused unread",
                    reference.files
                ),
            ));
        }
        let mut read = 0u64;
        let mut checker = LineChecker::bounded(what.clone(), reference.files, reference.bytes);
        let mut writer = SpoolWriter::new(spool);
        let mut hasher = Sha256::new();
        let mut buf = vec![0u8; CHUNK_BYTES];
        loop {
            let n = match object.read(&mut buf).await {
                Ok(n) => n,
                // The client checks the store's own digest at the end and reports a mismatch
                // as invalid data (its other read failures are NATS's): a damaged object.
                Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                    return Err(ManifestError::new(
                        ManifestErrorKind::Mismatch,
                        what,
                        format!("the object does not match its stored digest: {e}"),
                    ));
                }
                Err(e) => return Err(nats_err(what, e)),
            };
            if n == 0 {
                break;
            }
            read += n as u64;
            if read > limit {
                // The stored size said otherwise: the object changed under the reader.
                return Err(ManifestError::new(
                    ManifestErrorKind::Mismatch,
                    what,
                    format!(
                        "more than {limit} bytes read, more than a manifest of {} files can be",
                        reference.files
                    ),
                ));
            }
            hasher.update(&buf[..n]);
            // Lines are judged as they come, so that a huge object of garbage is not spooled
            // to its end first; nothing is returned before the digest is compared.
            if let Err(e) = checker.update(&buf[..n]) {
                if e.kind == ManifestErrorKind::Mismatch {
                    // More than declared: refused now, whatever the rest holds.
                    return Err(e);
                }
                return Err(self
                    .mismatch_or(reference, &mut object, hasher, buf, e)
                    .await);
            }
            writer.write(&buf[..n])?;
        }
        let digest = hex::encode(hasher.finalize());
        if digest != reference.digest {
            return Err(ManifestError::new(
                ManifestErrorKind::Mismatch,
                what,
                format!(
                    "the object's bytes hash to {digest}, not to the digest {} it is named by",
                    reference.digest
                ),
            ));
        }
        let checked = checker.finish()?;
        if (checked.files, checked.bytes) != (reference.files, reference.bytes) {
            return Err(ManifestError::new(
                ManifestErrorKind::Mismatch,
                what,
                format!(
                    "the manifest lists {} files of {} bytes, but the reference says {} files of {} bytes",
                    checked.files, checked.bytes, reference.files, reference.bytes
                ),
            ));
        }
        Ok(Manifest::from_spool(writer.finish(), checked))
    }

    /// A malformed line was found part-way: when the object's bytes do not even hash to the
    /// digest, that is the better answer (the object is not the manifest asked for at all),
    /// so the rest is read (hashed, not spooled) to tell the two apart.
    async fn mismatch_or(
        &self,
        reference: &ManifestRef,
        object: &mut object_store::Object,
        mut hasher: Sha256,
        mut buf: Vec<u8>,
        malformed: ManifestError,
    ) -> ManifestError {
        loop {
            match object.read(&mut buf).await {
                Ok(0) => break,
                Ok(n) => hasher.update(&buf[..n]),
                Err(_) => return malformed,
            }
        }
        let digest = hex::encode(hasher.finalize());
        if digest == reference.digest {
            malformed
        } else {
            ManifestError::new(
                ManifestErrorKind::Mismatch,
                self.what(&reference.digest),
                format!(
                    "the object's bytes hash to {digest}, not to the digest it is named by (and are not canonical manifest lines: {})",
                    malformed.detail
                ),
            )
        }
    }

    /// Stores `pieces`, the side data of the file whose SHA-256 is `file_sha256`
    /// ([`PieceHashes::object_name`]), unless it is there already (it is a function of the
    /// file's bytes). Only a service that hashed those bytes itself may call this: readers
    /// judge pieces by it.
    pub async fn put_pieces(
        &self,
        file_sha256: &str,
        pieces: &PieceHashes,
    ) -> Result<(), ManifestError> {
        let name = PieceHashes::object_name(file_sha256);
        let what = format!("piece hashes {}/{name}", self.bucket);
        match self.store.info(&name).await {
            Ok(info) if !info.deleted => return Ok(()),
            Ok(_) => {}
            Err(e) if e.kind() == object_store::InfoErrorKind::NotFound => {}
            Err(e) => return Err(nats_err(what, e)),
        }
        let bytes = pieces.to_bytes();
        let meta = object_store::ObjectMetadata {
            name,
            description: Some(format!(
                "{} pieces of a {}-byte file",
                pieces.pieces.len(),
                pieces.size
            )),
            chunk_size: Some(CHUNK_BYTES),
            ..Default::default()
        };
        self.store
            .put(meta, &mut bytes.as_slice())
            .await
            .map_err(|e| nats_err(what, e))?;
        Ok(())
    }

    /// The side data of the file whose SHA-256 is `file_sha256` and size `size`: `None` when
    /// none was stored (a version validated before side data existed). An object that is not
    /// exactly that file's pieces is [`ManifestErrorKind::Malformed`], read no further than
    /// such side data can be long.
    pub async fn pieces(
        &self,
        file_sha256: &str,
        size: u64,
    ) -> Result<Option<PieceHashes>, ManifestError> {
        let name = PieceHashes::object_name(file_sha256);
        let what = format!("piece hashes {}/{name}", self.bucket);
        let mut object = match self.store.get(&name).await {
            Ok(object) => object,
            Err(e) if e.kind() == object_store::GetErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(nats_err(what, e)),
        };
        let limit = PieceHashes::max_bytes(size);
        if object.info().size as u64 > limit {
            return Err(ManifestError::new(
                ManifestErrorKind::Malformed,
                what,
                format!(
                    "{} bytes, more than the side data of a {size}-byte file can be ({limit}): refused unread",
                    object.info().size
                ),
            ));
        }
        let mut bytes = Vec::with_capacity(object.info().size);
        // The client checks the store's own digest of the object at its end.
        (&mut object)
            .take(limit + 1)
            .read_to_end(&mut bytes)
            .await
            .map_err(|e| nats_err(what.clone(), e))?;
        PieceHashes::parse(&bytes, size)
            .map(Some)
            .map_err(|e| ManifestError::new(ManifestErrorKind::Malformed, what, e.to_string()))
    }

    /// Names of every object in the bucket (tests and operators; a listing, not a scan of
    /// contents).
    pub async fn list(&self) -> Result<Vec<String>, ManifestError> {
        let mut list = self
            .store
            .list()
            .await
            .map_err(|e| nats_err(format!("manifest bucket {}", self.bucket), e))?;
        let mut names = Vec::new();
        while let Some(info) = list.next().await {
            let info = info.map_err(|e| nats_err(format!("manifest bucket {}", self.bucket), e))?;
            if !info.deleted {
                names.push(info.name);
            }
        }
        names.sort();
        Ok(names)
    }

    /// The underlying Object Store (tests use it to plant hostile objects).
    pub fn object_store(&self) -> &object_store::ObjectStore {
        &self.store
    }
}

/// Whether the store's digest string (`SHA-256=<base64url>`) is the hex `digest`.
fn store_digest_is(store_digest: &str, digest: &str) -> bool {
    use base64::Engine as _;
    let Some(encoded) = store_digest.strip_prefix("SHA-256=") else {
        return false;
    };
    let encoded = encoded.trim_end_matches('=');
    base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(encoded)
        .is_ok_and(|bytes| hex::encode(bytes) == digest)
}

fn is_missing_stream(e: &jetstream::context::ObjectStoreError) -> bool {
    use std::error::Error as _;
    e.source()
        .and_then(|s| s.downcast_ref::<jetstream::context::GetStreamError>())
        .is_some_and(|g| {
            matches!(g.kind(), jetstream::context::GetStreamErrorKind::JetStream(js)
                if js.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND)
        })
}
