//! The catalogue's redb file and its single writer.
//!
//! Three tables: `records` (key → JSON bytes, see [`crate::fold`] for the keys), `applied`
//! (event ids already folded) and `meta` (whether the store is complete). Values are stored as
//! plain bytes and decoded by the recorder, because redb's `Value::from_bytes` cannot fail and a
//! damaged value must become an error, not a panic.
//!
//! A store is *complete* once a replay of the facts stream into it finished. A store that is
//! missing, or was left incomplete by a crash during its rebuild, is rebuilt on start.
//!
//! Writes go through one [`Writer`] thread that folds every event waiting in its queue in one
//! transaction and one commit, so a burst of facts costs one fsync, not one per fact.

use std::path::{Path, PathBuf};

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use stagehand_schemas::Event;
use tokio::sync::{mpsc, oneshot};

use crate::error::StoreError;
use crate::fold::{self, TierKey, View};

const RECORDS: TableDefinition<&str, &[u8]> = TableDefinition::new("records");
const APPLIED: TableDefinition<&str, ()> = TableDefinition::new("applied");
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
/// Meta key: the facts stream sequence through which a rebuild replayed; present once complete.
const COMPLETE: &str = "complete_through";

/// The most events folded in one commit.
pub const MAX_BATCH: usize = 512;

/// The catalogue store.
pub struct Store {
    db: Database,
    path: PathBuf,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("path", &self.path).finish()
    }
}

struct TxView<'t> {
    records: redb::Table<'t, &'static str, &'static [u8]>,
    applied: redb::Table<'t, &'static str, ()>,
}

impl View for TxView<'_> {
    fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        Ok(self.records.get(key)?.map(|v| v.value().to_vec()))
    }
    fn put(&mut self, key: &str, value: Vec<u8>) -> Result<(), StoreError> {
        self.records.insert(key, value.as_slice())?;
        Ok(())
    }
    fn applied(&self, event_id: &str) -> Result<bool, StoreError> {
        Ok(self.applied.get(event_id)?.is_some())
    }
    fn mark_applied(&mut self, event_id: &str) -> Result<(), StoreError> {
        self.applied.insert(event_id, ())?;
        Ok(())
    }
}

impl Store {
    /// Opens the store at `path`, creating it (and its parent directory) if missing.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        let path = path.as_ref().to_path_buf();
        if let Some(parent) = path.parent()
            && !parent.as_os_str().is_empty()
        {
            std::fs::create_dir_all(parent).map_err(|e| StoreError::Redb(e.into()))?;
        }
        let db = Database::create(&path)?;
        let txn = db.begin_write()?;
        txn.open_table(RECORDS)?;
        txn.open_table(APPLIED)?;
        txn.open_table(META)?;
        txn.commit()?;
        Ok(Self { db, path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether a rebuild completed into this store (or it was marked complete when created
    /// empty against an empty stream).
    pub fn is_complete(&self) -> Result<bool, StoreError> {
        let txn = self.db.begin_read()?;
        let meta = txn.open_table(META)?;
        Ok(meta.get(COMPLETE)?.is_some())
    }

    /// Records that a rebuild replayed the facts stream through `sequence`.
    pub fn mark_complete(&self, sequence: u64) -> Result<(), StoreError> {
        let txn = self.db.begin_write()?;
        txn.open_table(META)?.insert(COMPLETE, sequence)?;
        txn.commit()?;
        Ok(())
    }

    /// Folds `events` in one transaction and one commit. Returns the tiers whose readiness
    /// to re-mirror (deduplicated).
    pub fn apply_batch(&self, events: &[Event]) -> Result<Vec<TierKey>, StoreError> {
        let txn = self.db.begin_write()?;
        {
            let mut view = TxView {
                records: txn.open_table(RECORDS)?,
                applied: txn.open_table(APPLIED)?,
            };
            for event in events {
                fold::apply(&mut view, event)?;
            }
        }
        txn.commit()?;
        let mut touched: Vec<TierKey> = events.iter().filter_map(fold::touched).collect();
        touched.sort();
        touched.dedup();
        Ok(touched)
    }

    /// One record's bytes.
    pub fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let txn = self.db.begin_read()?;
        let records = txn.open_table(RECORDS)?;
        Ok(records.get(key)?.map(|v| v.value().to_vec()))
    }

    /// Every record whose key starts with `prefix`, in key order.
    pub fn scan(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        let txn = self.db.begin_read()?;
        let records = txn.open_table(RECORDS)?;
        let mut out = Vec::new();
        for item in records.range::<&str>(prefix..)? {
            let (k, v) = item?;
            if !k.value().starts_with(prefix) {
                break;
            }
            out.push((k.value().to_owned(), v.value().to_vec()));
        }
        Ok(out)
    }

    /// The whole catalogue: every record and every applied event id, in key order. Two
    /// catalogues folded from the same facts have equal dumps.
    pub fn dump(&self) -> Result<Dump, StoreError> {
        let txn = self.db.begin_read()?;
        let records = txn
            .open_table(RECORDS)?
            .iter()?
            .map(|item| {
                let (k, v) = item?;
                Ok((k.value().to_owned(), v.value().to_vec()))
            })
            .collect::<Result<Vec<_>, redb::StorageError>>()?;
        let applied = txn
            .open_table(APPLIED)?
            .iter()?
            .map(|item| Ok(item?.0.value().to_owned()))
            .collect::<Result<Vec<_>, redb::StorageError>>()?;
        Ok(Dump { records, applied })
    }
}

/// A full copy of a catalogue, for comparing two of them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dump {
    pub records: Vec<(String, Vec<u8>)>,
    pub applied: Vec<String>,
}

/// The writer's thread, to wait for once every [`Writer`] is dropped.
#[derive(Debug)]
pub struct WriterThread(std::thread::JoinHandle<()>);

impl WriterThread {
    /// Waits for the writer thread to end.
    pub fn join(self) {
        let _ = self.0.join();
    }
}

type Job = (Event, oneshot::Sender<Result<Vec<TierKey>, StoreError>>);

/// The store's single writer: a thread that folds queued events in batches.
#[derive(Clone, Debug)]
pub struct Writer {
    tx: mpsc::Sender<Job>,
}

impl Writer {
    /// Starts the writer thread over `store`. It stops when every `Writer` clone is dropped;
    /// [`WriterThread::join`] waits for that (and so for its hold on the store to end).
    pub fn start(store: std::sync::Arc<Store>) -> (Self, WriterThread) {
        let (tx, mut rx) = mpsc::channel::<Job>(MAX_BATCH * 2);
        let thread = std::thread::Builder::new()
            .name("catalogue-writer".into())
            .spawn(move || {
                while let Some(first) = rx.blocking_recv() {
                    let mut jobs = vec![first];
                    while jobs.len() < MAX_BATCH {
                        match rx.try_recv() {
                            Ok(job) => jobs.push(job),
                            Err(_) => break,
                        }
                    }
                    let events: Vec<Event> = jobs.iter().map(|(e, _)| e.clone()).collect();
                    match store.apply_batch(&events) {
                        Ok(_) => {
                            for (event, reply) in jobs {
                                let touched = fold::touched(&event).into_iter().collect();
                                let _ = reply.send(Ok(touched));
                            }
                        }
                        Err(batch_error) => {
                            // One bad event must not fail its neighbours: retry each alone so
                            // only the culprit gets the error.
                            tracing::warn!(error = %batch_error, events = jobs.len(), "batch failed; folding one by one");
                            for (event, reply) in jobs {
                                let _ = reply.send(store.apply_batch(std::slice::from_ref(&event)));
                            }
                        }
                    }
                }
            })
            .expect("spawning the catalogue writer thread");
        (Self { tx }, WriterThread(thread))
    }

    /// Folds one event; returns once it is committed, with the tier it touched.
    pub async fn apply(&self, event: Event) -> Result<Vec<TierKey>, StoreError> {
        let (reply, done) = oneshot::channel();
        self.tx
            .send((event, reply))
            .await
            .map_err(|_| StoreError::WriterGone)?;
        done.await.map_err(|_| StoreError::WriterGone)?
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::fold::tests::{rejected, replica, validated};

    #[tokio::test]
    async fn writer_batches_and_is_idempotent() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(Store::open(dir.path().join("c.redb")).unwrap());
        let (writer, _thread) = Writer::start(store.clone());
        let events = [validated(1), rejected(2), replica(1, false), validated(1)];
        let results =
            futures::future::join_all(events.iter().cloned().map(|e| writer.apply(e))).await;
        for r in results {
            r.unwrap();
        }
        let dump = store.dump().unwrap();
        assert_eq!(dump.applied.len(), 3, "the duplicate is applied once");

        let other = Store::open(dir.path().join("d.redb")).unwrap();
        other.apply_batch(&events[..3]).unwrap();
        assert_eq!(other.dump().unwrap(), dump);
    }

    #[test]
    fn a_corrupt_record_is_reported_with_its_key() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().join("c.redb")).unwrap();
        store.apply_batch(&[validated(1)]).unwrap();
        {
            let txn = store.db.begin_write().unwrap();
            txn.open_table(RECORDS)
                .unwrap()
                .insert(fold::key('D', &["lab-a", "cats"]).as_str(), &b"{bad"[..])
                .unwrap();
            txn.commit().unwrap();
        }
        let err = store.apply_batch(&[validated(3)]).unwrap_err();
        assert!(
            matches!(&err, StoreError::Corrupt { key, .. } if key == "D/lab-a/cats"),
            "{err}"
        );
        assert!(!err.is_retryable());
    }

    #[test]
    fn completeness_survives_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.redb");
        let store = Store::open(&path).unwrap();
        assert!(!store.is_complete().unwrap());
        store.mark_complete(7).unwrap();
        drop(store);
        assert!(Store::open(&path).unwrap().is_complete().unwrap());
    }
}
