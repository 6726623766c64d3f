//! Where an event's manifest is, and opening it: the one way every service reads a version's
//! file list.

use async_nats::jetstream;
use stagehand_schemas::subject::manifest_bucket_for;
use stagehand_schemas::{Body, Event, FileRef, ManifestRef, total_bytes, version_digest};

use crate::error::{ManifestError, ManifestErrorKind};
use crate::manifest::{Manifest, Spool};
use crate::store::ManifestStore;

/// An event's manifest: inline entries, or a reference into the bucket the contract assigns
/// to that event ([`manifest_bucket_for`]: the project's upload bucket for what uploaders and
/// training jobs publish, the services' bucket for everything else).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ManifestSource {
    Inline(Vec<FileRef>),
    Stored {
        bucket: String,
        reference: ManifestRef,
    },
}

impl ManifestSource {
    /// The manifest `event` carries; `None` for kinds that carry none. An event that carries
    /// both inline entries and a reference is refused ([`ManifestErrorKind::Invalid`]).
    pub fn of(event: &Event) -> Result<Option<ManifestSource>, ManifestError> {
        let (files, reference) = match &event.body {
            Body::IngestRequested(p) => (&p.files, &p.manifest),
            Body::DatasetValidated(p) => (&p.files, &p.manifest),
            Body::DatasetPrepared(p) => (&p.files, &p.manifest),
            Body::CheckpointCommitted(p) => (&p.files, &p.manifest),
            _ => return Ok(None),
        };
        Ok(Some(match reference {
            Some(_) if !files.is_empty() => {
                return Err(ManifestError::new(
                    ManifestErrorKind::Invalid,
                    format!("{} event {}", event.kind(), event.id),
                    "the event carries both inline files and a manifest reference; it must carry one",
                ));
            }
            Some(reference) => ManifestSource::Stored {
                bucket: manifest_bucket_for(&event.body, &event.project),
                reference: reference.clone(),
            },
            None => ManifestSource::Inline(files.clone()),
        }))
    }

    /// The digest the event declares (for inline entries, the version digest over them).
    pub fn digest(&self) -> String {
        match self {
            ManifestSource::Inline(files) => version_digest(files),
            ManifestSource::Stored { reference, .. } => reference.digest.clone(),
        }
    }

    /// The entry count the event declares.
    pub fn files(&self) -> u64 {
        match self {
            ManifestSource::Inline(files) => files.len() as u64,
            ManifestSource::Stored { reference, .. } => reference.files,
        }
    }

    /// The byte total the event declares.
    pub fn bytes(&self) -> u64 {
        match self {
            ManifestSource::Inline(files) => total_bytes(files),
            ManifestSource::Stored { reference, .. } => reference.bytes,
        }
    }

    /// Opens the manifest: inline entries at once, a reference fetched and verified against
    /// its digest and counts before anything is returned.
    pub async fn open(
        &self,
        js: &jetstream::Context,
        spool: &Spool,
    ) -> Result<Manifest, ManifestError> {
        match self {
            ManifestSource::Inline(files) => Ok(Manifest::from_entries(files.clone())),
            ManifestSource::Stored { bucket, reference } => {
                ManifestStore::open(js, bucket)
                    .await?
                    .fetch(reference, spool)
                    .await
            }
        }
    }
}

/// The manifest `event` carries, opened and verified; `None` for kinds that carry none.
pub async fn open_manifest(
    js: &jetstream::Context,
    event: &Event,
    spool: &Spool,
) -> Result<Option<Manifest>, ManifestError> {
    match ManifestSource::of(event)? {
        Some(source) => source.open(js, spool).await.map(Some),
        None => Ok(None),
    }
}

/// How an event written by a service carries `manifest`: its entries inline when they fit the
/// contract's inline bound, else a reference to it in `store` (put there first).
pub async fn inline_or_stored(
    manifest: &Manifest,
    store: &ManifestStore,
) -> Result<(Vec<FileRef>, Option<ManifestRef>), ManifestError> {
    if let Some(files) = manifest.inline_entries()? {
        return Ok((files, None));
    }
    let reference = store.put(manifest).await?;
    Ok((Vec::new(), Some(reference)))
}
