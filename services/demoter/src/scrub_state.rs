//! The scrub's own progress, in its redb file (`<state_dir>/scrub-state.redb`, apart from the
//! demotion steps' file): the last time this demoter read each replica back, and what it
//! found. Written after the replica's fact is published, so a scrub killed anywhere starts
//! again where it was: a replica recorded here within its tier's period is not read again,
//! and one read but not recorded is read again and its fact (the same id) dropped as a
//! duplicate by the stream.
//!
//! | table | key | value |
//! | --- | --- | --- |
//! | `scrubbed` | (tier, node or `""`, prefix) | [`Scrubbed`] (JSON) |

use std::path::Path;
use std::sync::Arc;

use redb::{Database, ReadableDatabase, TableDefinition};
use serde::{Deserialize, Serialize};
use stagehand_store::GroupWriter;
use time::OffsetDateTime;

const SCRUBBED: TableDefinition<(&str, &str, &str), &[u8]> = TableDefinition::new("scrubbed");

/// Writes committed together at most: a pass records one replica at a time, so a batch is
/// small; the bound only keeps a burst from one huge transaction.
const MAX_BATCH: usize = 256;

/// The writer's name (its thread is `scrub-state-writer`).
const WRITER: &str = "scrub-state";

/// What one read of a replica found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Scrubbed {
    /// When the read finished.
    #[serde(with = "time::serde::rfc3339")]
    pub at: OffsetDateTime,
    /// Every file hashed to its listed SHA-256 (`replica.verified` published); else
    /// `replica.damaged` was.
    pub verified: bool,
    pub files: u64,
    pub bytes: u64,
}

/// A failure of the scrub's state store: the scrub stops (its passes cannot be resumed
/// correctly without it). Typed, and classified, in [`stagehand_store`].
pub use stagehand_store::StateError as ScrubStateError;

/// One replica's record, to write.
struct Write {
    tier: String,
    node: String,
    prefix: String,
    value: Vec<u8>,
}

/// The scrub's state store. Clones share one database and one writer.
#[derive(Clone)]
pub struct ScrubState {
    // Dropped in this order: the last writer closes the queue, then the guard waits for the
    // thread (and its handle on the database) to end, so the file can be opened again at once.
    writer: GroupWriter<Write, (), ScrubStateError>,
    _thread: Arc<JoinOnDrop>,
    db: Arc<Database>,
}

/// Waits for the writer thread when the last handle on the store goes.
struct JoinOnDrop(Option<stagehand_store::WriterThread>);

impl Drop for JoinOnDrop {
    fn drop(&mut self) {
        if let Some(t) = self.0.take() {
            t.join();
        }
    }
}

impl ScrubState {
    /// Opens (or creates) the store at `path`.
    pub fn open(path: &Path) -> Result<ScrubState, ScrubStateError> {
        let db = stagehand_store::create_state_file(path)?;
        let txn = db.begin_write()?;
        txn.open_table(SCRUBBED)?;
        txn.commit()?;
        let db = Arc::new(db);
        let writer_db = db.clone();
        let (writer, thread) = stagehand_store::writer(WRITER)
            .max_batch(MAX_BATCH)
            .spawn(move |batch: &[Write]| {
                let txn = writer_db.begin_write()?;
                {
                    let mut table = txn.open_table(SCRUBBED)?;
                    for w in batch {
                        table.insert(
                            (w.tier.as_str(), w.node.as_str(), w.prefix.as_str()),
                            w.value.as_slice(),
                        )?;
                    }
                }
                txn.commit()?;
                Ok(vec![(); batch.len()])
            })
            .map_err(|source| ScrubStateError::Spawn {
                name: WRITER,
                source,
            })?;
        Ok(ScrubState {
            writer,
            _thread: Arc::new(JoinOnDrop(Some(thread))),
            db,
        })
    }

    /// What this demoter last found reading the replica at `prefix` on `tier` (`node`'s copy
    /// on a node-local tier).
    pub fn last(
        &self,
        tier: &str,
        node: Option<&str>,
        prefix: &str,
    ) -> Result<Option<Scrubbed>, ScrubStateError> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(SCRUBBED)?;
        let Some(v) = table.get((tier, node.unwrap_or(""), prefix))? else {
            return Ok(None);
        };
        serde_json::from_slice(v.value())
            .map(Some)
            .map_err(|e| ScrubStateError::decode(format!("scrubbed {tier}/{prefix}"), e))
    }

    /// Records what reading the replica found; returns once it is durable.
    pub async fn record(
        &self,
        tier: &str,
        node: Option<&str>,
        prefix: &str,
        scrubbed: &Scrubbed,
    ) -> Result<(), ScrubStateError> {
        let value = serde_json::to_vec(scrubbed)
            .map_err(|e| ScrubStateError::encode(format!("scrubbed {tier}/{prefix}"), e))?;
        let write = Write {
            tier: tier.to_owned(),
            node: node.unwrap_or("").to_owned(),
            prefix: prefix.to_owned(),
            value,
        };
        Ok(self.writer.submit(write).await?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_recorded_read_is_found_again_after_the_store_is_reopened() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("scrub-state.redb");
        let at = OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap();
        let read = Scrubbed {
            at,
            verified: true,
            files: 3,
            bytes: 300,
        };
        {
            let s = ScrubState::open(&path).unwrap();
            s.record("capacity", None, "p/d/v", &read).await.unwrap();
            assert_eq!(s.last("capacity", Some("n1"), "p/d/v").unwrap(), None);
        }
        let s = ScrubState::open(&path).unwrap();
        assert_eq!(s.last("capacity", None, "p/d/v").unwrap(), Some(read));
        assert_eq!(s.last("hot", None, "p/d/v").unwrap(), None);
    }
}
