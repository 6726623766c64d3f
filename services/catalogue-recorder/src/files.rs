//! A fact's file list into the store: the manifest the fact carries (inline, or by reference
//! into the services' manifest bucket, or a checkpoint's in its project's upload bucket)
//! opened through `stagehand-manifest` — verified against the version digest before any entry
//! is used — and written in chunks ([`Store::put_file_list`]). The facts with a file list are
//! `dataset.validated`, `dataset.prepared` and `checkpoint.committed` (whose version is its
//! manifest's digest).
//!
//! Memory stays bounded whatever the file count: `stagehand-manifest` spools a large manifest
//! to a local file, the store writes it a transaction's worth of chunks at a time, and only a
//! few manifests are fetched at once. A version whose list is in the store already is not
//! fetched again (a rebuild fetches each version's manifest once).

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use stagehand_bus::RetrySchedule;
use stagehand_manifest::{ManifestSource, Spool};
use stagehand_schemas::{Body, Event};
use tokio::sync::Semaphore;

use crate::error::StoreError;
use crate::fold::FoldError;
use crate::store::Store;
use stagehand_catalogue::FoldProblemCode;

/// Manifests fetched at once.
const FETCHES_AT_ONCE: usize = 2;

/// Fetches facts' manifests into the store.
#[derive(Debug, Clone)]
pub struct FileLists {
    js: jetstream::Context,
    store: Arc<Store>,
    spool: Spool,
    timeout: Duration,
    fetches: Arc<Semaphore>,
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, FoldError> + Send + 'static,
) -> Result<T, FoldError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| {
        FoldError::Store(StoreError::Redb(redb::Error::Io(std::io::Error::other(e))))
    })?
}

impl FileLists {
    /// `spool`: where large manifests are spooled while read; `timeout`: how long one fetch
    /// may take before it counts as failed (retryable).
    pub fn new(js: jetstream::Context, store: Arc<Store>, spool: Spool, timeout: Duration) -> Self {
        FileLists {
            js,
            store,
            spool,
            timeout,
            fetches: Arc::new(Semaphore::new(FETCHES_AT_ONCE)),
        }
    }

    /// Makes sure the file list of the version `event` records is in the store (nothing to do
    /// for a fact that records no version).
    pub async fn ensure(&self, event: &Event) -> Result<(), FoldError> {
        let stated = match &event.body {
            Body::DatasetValidated(p) => Some(&p.version),
            Body::DatasetPrepared(p) => Some(&p.version),
            // A checkpoint's version is its manifest's digest (it states none of its own).
            Body::CheckpointCommitted(_) => None,
            _ => return Ok(()),
        };
        let source = ManifestSource::of(event)
            .map_err(FoldError::manifest)?
            .ok_or_else(|| FoldError::malformed("the fact carries no manifest"))?;
        let version = source.digest();
        if let Some(stated) = stated
            && *stated != version
        {
            return Err(FoldError::malformed(format!(
                "version {stated} is not the digest of the fact's manifest ({version})"
            )));
        }
        let store = self.store.clone();
        let v = version.clone();
        if blocking(move || Ok(store.file_list(&v)?)).await?.is_some() {
            return Ok(());
        }
        let _permit = self
            .fetches
            .acquire()
            .await
            .map_err(|_| StoreError::WriterGone)?;
        // Another fact of the same version may have written it while this one waited.
        let store = self.store.clone();
        let v = version.clone();
        if blocking(move || Ok(store.file_list(&v)?)).await?.is_some() {
            return Ok(());
        }
        let manifest =
            match tokio::time::timeout(self.timeout, source.open(&self.js, &self.spool)).await {
                Ok(opened) => opened.map_err(FoldError::manifest)?,
                Err(_) => {
                    return Err(FoldError::Problem {
                        code: FoldProblemCode::ManifestUnreachable,
                        detail: format!(
                            "fetching the manifest of version {version} took longer than {:?}",
                            self.timeout
                        ),
                        retryable: true,
                    });
                }
            };
        let store = self.store.clone();
        blocking(move || store.put_file_list(&manifest).map(drop)).await
    }

    /// [`FileLists::ensure`], retrying a fetch that failed for a reason a retry can fix
    /// (NATS timed out) up to `attempts` times; a manifest that is not in the bucket is not
    /// waited for. What a rebuild uses: it must go on.
    pub async fn ensure_retrying(&self, event: &Event, attempts: u32) -> Result<(), FoldError> {
        let retry = RetrySchedule::exponential(Duration::from_millis(200), Duration::from_secs(5));
        let mut attempt = 1;
        loop {
            match self.ensure(event).await {
                Err(FoldError::Problem {
                    code: FoldProblemCode::ManifestUnreachable,
                    ..
                }) if attempt < attempts => {
                    tokio::time::sleep(retry.delay(u64::from(attempt))).await;
                    attempt += 1;
                }
                other => return other,
            }
        }
    }
}
