//! Bounded growth: records from before a cutoff removed, oldest first, in bounded batches,
//! through the index by time.

use redb::{Database, ReadableTable};
use time::OffsetDateTime;

use super::Ledger;
use super::error::LedgerError;
use super::schema::{ATTEMPTS, BY_TIME, DEAD_LETTERS, OUTCOMES, Tag, micros};

impl Ledger {
    /// Removes, oldest first, at most `limit` outcomes, dead letters and attempt histories
    /// recorded before `cutoff`, and returns how many it removed. The worker calls this on a
    /// timer with `cutoff` = now − `ledger_retention`; pass the clock you want.
    pub fn prune_before(&self, cutoff: OffsetDateTime, limit: usize) -> Result<u64, LedgerError> {
        let db = self.db()?;
        prune(&db, micros(cutoff), limit).map_err(|e| self.write_err("pruning", e))
    }
}

pub(super) fn prune(db: &Database, cutoff: u64, limit: usize) -> Result<u64, redb::Error> {
    let txn = db.begin_write()?;
    let removed = {
        let mut outcomes = txn.open_table(OUTCOMES)?;
        let mut dead = txn.open_table(DEAD_LETTERS)?;
        let mut attempts = txn.open_table(ATTEMPTS)?;
        let mut by_time = txn.open_table(BY_TIME)?;
        prune_in(
            &mut outcomes,
            &mut dead,
            &mut attempts,
            &mut by_time,
            cutoff,
            limit,
        )?
    };
    txn.commit()?;
    Ok(removed)
}

pub(super) fn prune_in(
    outcomes: &mut redb::Table<&str, &[u8]>,
    dead: &mut redb::Table<&str, &[u8]>,
    attempts: &mut redb::Table<&str, &[u8]>,
    by_time: &mut redb::Table<(u64, &str), ()>,
    cutoff: u64,
    limit: usize,
) -> Result<u64, redb::Error> {
    let old: Vec<(u64, String)> = by_time
        .range(..(cutoff, ""))?
        .take(limit)
        .map(|e| e.map(|(k, _)| (k.value().0, k.value().1.to_owned())))
        .collect::<Result<_, _>>()?;
    for (at, tagged) in &old {
        match Tag::split(tagged) {
            Some((Tag::Outcome, key)) => drop(outcomes.remove(key)?),
            Some((Tag::DeadLetter, key)) => drop(dead.remove(key)?),
            Some((Tag::Attempts, key)) => drop(attempts.remove(key)?),
            None => {}
        }
        by_time.remove((*at, tagged.as_str()))?;
    }
    Ok(old.len() as u64)
}
