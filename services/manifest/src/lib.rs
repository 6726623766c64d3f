//! A dataset version's file list: built, stored, fetched, verified, iterated — the one API
//! through which every Stagehand service and the CLI read and write manifests.
//!
//! A manifest's canonical bytes are the sorted `path\tsize\tsha256\n` lines the version digest
//! is defined over (`stagehand_schemas::manifest`), so the SHA-256 of a stored manifest *is*
//! the version digest. Large manifests travel by reference ([`stagehand_schemas::ManifestRef`])
//! as JetStream Object Store objects named by their digest ([`ManifestStore`]); small ones may
//! travel inline in their event. Either way a reader gets a [`Manifest`] only after its bytes
//! were hashed and found to be the digest, its counts the declared ones and every line
//! canonical — and iterates its entries in path order in bounded memory, whatever the file
//! count (spooled to a local file beyond [`IN_MEMORY_BELOW`]). A fetch never spools more than
//! the reference declares: an object larger than a manifest of the declared file count can be
//! ([`max_manifest_bytes`]) is refused unread, and reading stops at the first entry past the
//! declared count or byte total.
//!
//! - [`ManifestBuilder`]: entries in any order → a canonical manifest (external merge sort).
//! - [`ManifestStore`]: the upload buckets (`stagehand_uploads_<project>`) and the services'
//!   bucket (`stagehand_manifests`); `put`, `fetch` (verified), `contains`.
//! - [`ManifestSource`] / [`open_manifest`]: the manifest an event carries, opened.
//!
//! ```no_run
//! # async fn demo(js: async_nats::jetstream::Context, event: stagehand_schemas::Event)
//! # -> Result<(), stagehand_manifest::ManifestError> {
//! use futures::StreamExt;
//! use stagehand_manifest::{Spool, open_manifest};
//!
//! if let Some(manifest) = open_manifest(&js, &event, &Spool::default()).await? {
//!     println!("{} files, {} bytes, version {}", manifest.files(), manifest.bytes(), manifest.digest());
//!     let mut chunks = std::pin::pin!(manifest.chunks(4096));
//!     while let Some(chunk) = chunks.next().await {
//!         for file in chunk? {
//!             let _ = (file.path, file.size, file.sha256);
//!         }
//!     }
//! }
//! # Ok(()) }
//! ```

mod builder;
mod error;
mod manifest;
mod source;
mod store;

pub use builder::{DEFAULT_RUN_BYTES, ManifestBuilder};
pub use error::{ManifestError, ManifestErrorKind};
pub use manifest::{
    DEFAULT_CHUNK, Entries, IN_MEMORY_BELOW, ListEnd, MAX_ENTRY_LINE_BYTES, MAX_LINE_BYTES,
    Manifest, Spool, max_manifest_bytes,
};
pub use source::{ManifestSource, inline_or_stored, open_manifest};
pub use store::{BucketOptions, CHUNK_BYTES, ManifestStore, UPLOAD_MAX_AGE};
