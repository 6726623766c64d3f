//! The copies this process has queued and running, per pair of tiers, and the throughput
//! recent copies of each pair measured: from them a copy that must wait for a slot is told
//! the bytes queued ahead of it and when it should be ready (`stage.pending`'s
//! [`ReadyEstimate`]). Before the first copy of a pair is measured there is no estimate: the
//! request is told so rather than given an invented figure. The book also keeps what stops
//! each copy, so that an operator's cancel of its request can ([`CopyBook::copy_of`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::Duration;

use stagehand_schemas::ReadyEstimate;
use time::OffsetDateTime;
use tokio_util::sync::CancellationToken;

use super::in_flight::RequestKey;

/// The weight of the newest copy in a pair's moving throughput: recent copies count most
/// (the tier's load changes), one odd copy does not replace the figure.
const NEWEST_WEIGHT: f64 = 0.3;

/// (source tier, target tier).
type Pair = (String, String);

/// One copy entered, in the order copies were entered.
#[derive(Debug)]
struct Entry {
    request: RequestKey,
    /// The version copied.
    version: String,
    /// Stops the copy, queued or running.
    cancel: CancellationToken,
    pair: Pair,
    bytes: u64,
    /// Bytes its running copy has moved so far (0 while queued).
    done: u64,
}

#[derive(Debug, Default)]
struct Book {
    next: u64,
    entries: BTreeMap<u64, Entry>,
    /// Bytes a second per pair, a moving figure over its recent copies.
    rates: HashMap<Pair, f64>,
}

/// What the promoter knows of its copies per pair of tiers. Clones are not needed: it lives
/// in the promoter's shared state.
#[derive(Debug, Default)]
pub(super) struct CopyBook {
    book: Mutex<Book>,
}

/// A copy's place in the [`CopyBook`]: it leaves the book when dropped, whatever happened.
pub(super) struct Booked<'a> {
    book: &'a CopyBook,
    seq: u64,
}

impl Drop for Booked<'_> {
    fn drop(&mut self) {
        self.book.lock().entries.remove(&self.seq);
    }
}

impl CopyBook {
    fn lock(&self) -> std::sync::MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Enters a copy of `bytes` of `version` from `from` to `to` for `request`, stopped by
    /// `cancel`, behind every copy entered before it.
    pub(super) fn enter(
        &self,
        request: RequestKey,
        version: &str,
        cancel: CancellationToken,
        (from, to): (&str, &str),
        bytes: u64,
    ) -> Booked<'_> {
        let mut book = self.lock();
        let seq = book.next;
        book.next += 1;
        book.entries.insert(
            seq,
            Entry {
                request,
                version: version.to_owned(),
                cancel,
                pair: (from.to_owned(), to.to_owned()),
                bytes,
                done: 0,
            },
        );
        Booked { book: self, seq }
    }

    /// The version and the cancel token of the copy `request` drives here, queued or running.
    pub(super) fn copy_of(&self, request: &RequestKey) -> Option<(String, CancellationToken)> {
        let book = self.lock();
        book.entries
            .values()
            .find(|e| &e.request == request)
            .map(|e| (e.version.clone(), e.cancel.clone()))
    }

    /// Notes how far `request`'s running copy has got.
    pub(super) fn progressed(&self, request: &RequestKey, done: u64) {
        let mut book = self.lock();
        if let Some(entry) = book.entries.values_mut().find(|e| &e.request == request) {
            entry.done = done;
        }
    }

    /// Bytes the copies entered onto tier `to` (queued or running) have still to write: what
    /// they reserved and the tier's filesystem does not count as used yet. A running copy's
    /// progress is noted every `progress_every`, so this errs on the high side.
    pub(super) fn unwritten_onto(&self, to: &str) -> u64 {
        let book = self.lock();
        book.entries
            .values()
            .filter(|e| e.pair.1 == to)
            .map(|e| e.bytes.saturating_sub(e.done))
            .fold(0, u64::saturating_add)
    }

    /// Folds a finished copy of `bytes` moved in `elapsed` into its pair's throughput. A copy
    /// that moved nothing (found in place, resumed whole) says nothing of the throughput.
    pub(super) fn measured(&self, from: &str, to: &str, bytes: u64, elapsed: Duration) {
        let secs = elapsed.as_secs_f64();
        if bytes == 0 || secs <= 0.0 {
            return;
        }
        let rate = bytes as f64 / secs;
        let mut book = self.lock();
        book.rates
            .entry((from.to_owned(), to.to_owned()))
            .and_modify(|r| *r = NEWEST_WEIGHT * rate + (1.0 - NEWEST_WEIGHT) * *r)
            .or_insert(rate);
    }

    /// The estimate of the copy `booked` as of `now`: the bytes still to copy of the copies
    /// of its pair entered before it (running or queued) and, once the pair was measured,
    /// when it should be ready with those going first.
    pub(super) fn estimate(
        &self,
        booked: &Booked<'_>,
        now: OffsetDateTime,
    ) -> Option<ReadyEstimate> {
        let book = self.lock();
        let mine = book.entries.get(&booked.seq)?;
        let (mut bytes_ahead, mut copies_ahead) = (0u64, 0u64);
        for entry in book.entries.range(..booked.seq).map(|(_, e)| e) {
            if entry.pair == mine.pair {
                bytes_ahead = bytes_ahead.saturating_add(entry.bytes.saturating_sub(entry.done));
                copies_ahead += 1;
            }
        }
        let rate = book.rates.get(&mine.pair).copied().filter(|r| *r >= 1.0);
        let ready_at = rate.map(|r| {
            let secs = (bytes_ahead.saturating_add(mine.bytes) as f64 / r).ceil();
            now + time::Duration::seconds_f64(secs.min(i64::MAX as f64 / 2.0))
        });
        Some(ReadyEstimate {
            from_tier: mine.pair.0.clone(),
            to_tier: mine.pair.1.clone(),
            bytes_ahead,
            copies_ahead,
            bytes: mine.bytes,
            bytes_per_second: rate.map(|r| r.round() as u64),
            ready_at,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagehand_schemas::EventId;

    fn key(n: &str) -> RequestKey {
        ("lab".into(), EventId::new(n).unwrap())
    }

    #[test]
    fn no_estimate_before_the_pair_is_measured_then_the_bytes_ahead_at_its_rate() {
        let book = CopyBook::default();
        let now = OffsetDateTime::UNIX_EPOCH;
        let running = book.enter(
            key("a"),
            "v",
            CancellationToken::new(),
            ("capacity", "hot"),
            1000,
        );
        let _other_pair = book.enter(
            key("b"),
            "v",
            CancellationToken::new(),
            ("source", "hot"),
            5000,
        );
        let queued = book.enter(
            key("c"),
            "v",
            CancellationToken::new(),
            ("capacity", "hot"),
            500,
        );
        book.progressed(&key("a"), 400);
        let first = book.estimate(&queued, now).unwrap();
        assert_eq!(
            (first.bytes_ahead, first.copies_ahead, first.bytes),
            (600, 1, 500)
        );
        assert_eq!((first.bytes_per_second, first.ready_at), (None, None));
        assert!(
            first.describe(now).contains("no estimate yet"),
            "{}",
            first.describe(now)
        );

        book.measured("capacity", "hot", 1000, Duration::from_secs(10));
        let second = book.estimate(&queued, now).unwrap();
        assert_eq!(second.bytes_per_second, Some(100));
        // 600 ahead and its own 500 at 100 bytes a second.
        assert_eq!(second.ready_at, Some(now + time::Duration::seconds(11)));
        book.measured("capacity", "hot", 2000, Duration::from_secs(10));
        assert_eq!(
            book.estimate(&queued, now).unwrap().bytes_per_second,
            Some(130)
        );

        drop(running);
        let alone = book.estimate(&queued, now).unwrap();
        assert_eq!((alone.bytes_ahead, alone.copies_ahead), (0, 0));
    }

    /// What the filesystem admission subtracts: every copy onto the tier from any source,
    /// queued or running, less what it moved; a copy that left the book counts no more.
    #[test]
    fn unwritten_bytes_are_what_the_copies_onto_a_tier_have_still_to_write() {
        let book = CopyBook::default();
        let running = book.enter(
            key("a"),
            "v",
            CancellationToken::new(),
            ("capacity", "hot"),
            1000,
        );
        let _queued = book.enter(
            key("b"),
            "v",
            CancellationToken::new(),
            ("source", "hot"),
            500,
        );
        let _elsewhere = book.enter(
            key("c"),
            "v",
            CancellationToken::new(),
            ("hot", "local"),
            7000,
        );
        assert_eq!(book.unwritten_onto("hot"), 1500);
        book.progressed(&key("a"), 400);
        assert_eq!(book.unwritten_onto("hot"), 1100);
        drop(running);
        assert_eq!(book.unwritten_onto("hot"), 500);
        assert_eq!(book.unwritten_onto("capacity"), 0);
    }

    #[test]
    fn a_copy_that_moved_nothing_is_no_measurement() {
        let book = CopyBook::default();
        book.measured("capacity", "hot", 0, Duration::from_secs(3));
        book.measured("capacity", "hot", 10, Duration::ZERO);
        let queued = book.enter(
            key("a"),
            "v",
            CancellationToken::new(),
            ("capacity", "hot"),
            10,
        );
        let estimate = book.estimate(&queued, OffsetDateTime::UNIX_EPOCH).unwrap();
        assert_eq!(estimate.bytes_per_second, None);
    }
}
