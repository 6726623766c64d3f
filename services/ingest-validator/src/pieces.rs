//! Side data: the piece hashes of every file read that is larger than a piece.
//!
//! Node agents fanning a version out move such a file in pieces from several peers and judge
//! each piece as it arrives (`stagehand_schemas::pieces`). The validator reads every byte of
//! every upload anyway, so the piece hashes come from the same read as the file's SHA-256
//! ([`stagehand_mover::Tier::hash_file_pieces`]) and are stored, keyed by the SHA-256 *found*,
//! as soon as that file's read ends: before any verdict is published, and without holding
//! them for the end, so memory does not grow with the file count. They are true of those
//! bytes whatever the request's verdict. A failure to store them fails the request as a
//! retryable error, like any other NATS failure.

use std::future::Future;

use async_nats::jetstream;
use stagehand_manifest::{BucketOptions, ManifestError, ManifestStore};
use stagehand_schemas::pieces::PieceHashes;
use tokio::sync::OnceCell;

/// Where side data goes: the services' manifest bucket ([`Catalogue`]); tests may record it.
pub trait PieceStore: Send + Sync {
    /// Stores `pieces`, the side data of the file whose SHA-256 is `file_sha256` (a no-op
    /// when it is there already).
    fn put_pieces(
        &self,
        file_sha256: &str,
        pieces: &PieceHashes,
    ) -> impl Future<Output = Result<(), ManifestError>> + Send;
}

/// The services' manifest bucket `stagehand_manifests`, opened (or created) on first use: a
/// version whose manifest travels inline and whose files are all a piece or smaller needs no
/// bucket (nor the rights to one).
pub struct Catalogue {
    js: jetstream::Context,
    replicas: usize,
    store: OnceCell<ManifestStore>,
}

impl Catalogue {
    pub fn new(js: jetstream::Context, replicas: usize) -> Catalogue {
        Catalogue {
            js,
            replicas: replicas.max(1),
            store: OnceCell::new(),
        }
    }

    /// The bucket, opened once.
    pub async fn store(&self) -> Result<&ManifestStore, ManifestError> {
        self.store
            .get_or_try_init(|| {
                ManifestStore::catalogue(
                    &self.js,
                    BucketOptions {
                        replicas: self.replicas,
                    },
                )
            })
            .await
    }
}

impl PieceStore for Catalogue {
    async fn put_pieces(
        &self,
        file_sha256: &str,
        pieces: &PieceHashes,
    ) -> Result<(), ManifestError> {
        self.store().await?.put_pieces(file_sha256, pieces).await
    }
}
