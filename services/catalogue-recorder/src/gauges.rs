//! The recorder's gauges of what it folds: the dead letters of each service that wait for a
//! person (`stagehand_dead_letters_waiting`).
//!
//! The recorder is the one part that sees every dead letter and every replay (and discard),
//! and it already keeps their difference per service in its store (`dead_letters_waiting`),
//! so the gauge is read from there: after each fold that can change it, and once at start, so
//! that a restarted recorder reports the count its store holds rather than nothing.

use redb::ReadableTable;

use crate::error::StoreError;
use crate::store::{DEAD_LETTERS_WAITING, Store};

/// Sets `stagehand_dead_letters_waiting{service}` for every service the store has counted.
/// One row per service: cheap enough to read whole after each dead-letter fold.
pub(crate) fn report_dead_letters_waiting(store: &Store) -> Result<(), StoreError> {
    let txn = store.reader()?;
    let table = txn.open_table(DEAD_LETTERS_WAITING)?;
    for row in table.iter()? {
        let (service, waiting) = row?;
        stagehand_telemetry::work::dead_letters_waiting(service.value(), waiting.value());
    }
    Ok(())
}
