//! The ledger's tables and records: what a fresh file is given, how a stored outcome is
//! encoded, and how a schema-1 ledger is migrated at open.

use std::path::Path;

use redb::{Database, ReadableTable, TableDefinition, TableHandle};
use serde::{Deserialize, Serialize};
use stagehand_schemas::{Attempt, EventId, wire};
use time::OffsetDateTime;

use super::RecordedBytes;
use super::error::{LedgerError, LedgerErrorKind};
use super::key::earlier_key;

/// Outcome of each finished event, by [`EventKey`].
pub(super) const OUTCOMES: TableDefinition<&str, &[u8]> = TableDefinition::new("outcomes_v2");
/// Dead letters published, by dead-letter id.
pub(super) const DEAD_LETTERS: TableDefinition<&str, &[u8]> =
    TableDefinition::new("dead_letters_v2");
/// Failed attempts of events not finished yet, by [`EventKey`].
pub(super) const ATTEMPTS: TableDefinition<&str, &[u8]> = TableDefinition::new("attempts_v2");
/// (recorded at, µs since the epoch; tagged key) → (): what pruning walks, oldest first. The
/// tag says which table the key is in ([`Tag`]).
pub(super) const BY_TIME: TableDefinition<(u64, &str), ()> = TableDefinition::new("by_time_v2");
/// The ledger's identity, so that a reopen can tell its own file from a replaced one.
pub(super) const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");
pub(super) const LEDGER_ID: &str = "ledger_id";
/// Meta key: since when (µs since the epoch, big-endian) keys name the event's kind. A record
/// under an earlier key answers only for messages stored before then ([`EventKey`]).
pub(super) const KINDS_SINCE: &str = "kinds_since";

/// Schema-1 tables (keyed by bare event id), migrated into the scoped ones at open.
pub(super) const OUTCOMES_V1: TableDefinition<&str, &[u8]> = TableDefinition::new("outcomes");
pub(super) const ATTEMPTS_V1: TableDefinition<&str, &[u8]> = TableDefinition::new("attempts");

/// Which table a [`BY_TIME`] entry points into: the first byte of its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Tag {
    Outcome,
    DeadLetter,
    Attempts,
}

impl Tag {
    fn prefix(self) -> &'static str {
        match self {
            Tag::Outcome => "o:",
            Tag::DeadLetter => "d:",
            Tag::Attempts => "a:",
        }
    }

    pub(super) fn tagged(self, key: &str) -> String {
        format!("{}{key}", self.prefix())
    }

    pub(super) fn split(tagged: &str) -> Option<(Tag, &str)> {
        [Tag::Outcome, Tag::DeadLetter, Tag::Attempts]
            .into_iter()
            .find_map(|t| tagged.strip_prefix(t.prefix()).map(|k| (t, k)))
    }
}

pub(super) fn micros(t: OffsetDateTime) -> u64 {
    u64::try_from(t.unix_timestamp_nanos() / 1_000).unwrap_or(0)
}

/// What the ledger stores for a finished event or a dead letter.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) struct StoredOutcome {
    /// Facts as published, wire-encoded.
    pub(super) facts: Vec<serde_bytes::ByteBuf>,
    /// The dead letter as published, wire-encoded.
    #[serde(default)]
    pub(super) dead_letter: Option<serde_bytes::ByteBuf>,
    #[serde(default)]
    pub(super) permanent_error: Option<String>,
    #[serde(default)]
    pub(super) attempts: Vec<Attempt>,
    #[serde(with = "time::serde::rfc3339")]
    pub(super) recorded_at: OffsetDateTime,
}

impl From<StoredOutcome> for RecordedBytes {
    fn from(s: StoredOutcome) -> Self {
        RecordedBytes {
            facts: s
                .facts
                .into_iter()
                .map(serde_bytes::ByteBuf::into_vec)
                .collect(),
            dead_letter: s.dead_letter.map(serde_bytes::ByteBuf::into_vec),
        }
    }
}

/// Creates the tables of a fresh ledger and returns its id (writing one if missing) and since
/// when its keys name the kind (noting it now for a ledger of earlier keys, 0 for a new one).
pub(super) fn init(db: &Database) -> Result<(Vec<u8>, u64), redb::Error> {
    let txn = db.begin_write()?;
    // A file without tables is a new ledger: none of its keys will be of the earlier form.
    let fresh = txn.list_tables()?.next().is_none();
    let id = {
        txn.open_table(OUTCOMES)?;
        txn.open_table(DEAD_LETTERS)?;
        txn.open_table(ATTEMPTS)?;
        txn.open_table(BY_TIME)?;
        let mut meta = txn.open_table(META)?;
        let existing = meta.get(LEDGER_ID)?.map(|v| v.value().to_vec());
        match existing {
            Some(id) => id,
            None => {
                let id = uuid::Uuid::new_v4().as_bytes().to_vec();
                meta.insert(LEDGER_ID, id.as_slice())?;
                id
            }
        }
    };
    let kinds_since = {
        let mut meta = txn.open_table(META)?;
        let noted = meta
            .get(KINDS_SINCE)?
            .and_then(|v| <[u8; 8]>::try_from(v.value()).ok())
            .map(u64::from_be_bytes);
        match noted {
            Some(since) => since,
            None => {
                let since = if fresh {
                    0
                } else {
                    micros(stagehand_schemas::now())
                };
                meta.insert(KINDS_SINCE, since.to_be_bytes().as_slice())?;
                since
            }
        }
    };
    txn.commit()?;
    Ok((id, kinds_since))
}

/// Moves schema-1 outcomes (keyed by bare event id) to project-scoped keys: the project comes
/// from the recorded facts, a dead letter moves to the dead-letter table under its own id, and
/// an outcome without facts (its project unknown) is dropped — a later copy of that event is
/// worked on again. Schema-1 attempt histories are dropped. Returns how many records moved.
pub(super) fn migrate_v1(db: &Database) -> Result<u64, redb::Error> {
    let txn = db.begin_write()?;
    let names: Vec<String> = txn.list_tables()?.map(|t| t.name().to_owned()).collect();
    if !names
        .iter()
        .any(|n| n == OUTCOMES_V1.name() || n == ATTEMPTS_V1.name())
    {
        return Ok(0);
    }
    let mut moved = 0;
    if names.iter().any(|n| n == OUTCOMES_V1.name()) {
        let legacy = txn.open_table(OUTCOMES_V1)?;
        let mut outcomes = txn.open_table(OUTCOMES)?;
        let mut dead = txn.open_table(DEAD_LETTERS)?;
        let mut by_time = txn.open_table(BY_TIME)?;
        for entry in legacy.iter()? {
            let (k, v) = entry?;
            let Ok(stored) = rmp_serde::from_slice::<StoredOutcome>(v.value()) else {
                continue;
            };
            let at = micros(stored.recorded_at);
            if let Some(dl) = stored
                .dead_letter
                .as_deref()
                .and_then(|b| wire::decode(b).ok())
            {
                dead.insert(dl.id.as_str(), v.value())?;
                by_time.insert((at, Tag::DeadLetter.tagged(dl.id.as_str()).as_str()), ())?;
                moved += 1;
            } else if let Some(first) = stored.facts.first().and_then(|b| wire::decode(b).ok())
                && let Ok(id) = EventId::new(k.value())
            {
                // The kind of the event is not recorded: the key of the ledgers that followed,
                // consulted for messages stored before kinds were part of keys.
                let key = earlier_key(&first.project, &id);
                outcomes.insert(key.as_str(), v.value())?;
                by_time.insert((at, Tag::Outcome.tagged(key.as_str()).as_str()), ())?;
                moved += 1;
            }
        }
    }
    if names.iter().any(|n| n == OUTCOMES_V1.name()) {
        txn.delete_table(OUTCOMES_V1)?;
    }
    if names.iter().any(|n| n == ATTEMPTS_V1.name()) {
        txn.delete_table(ATTEMPTS_V1)?;
    }
    txn.commit()?;
    Ok(moved)
}

pub(super) fn decode_stored(
    path: &Path,
    key: &str,
    bytes: &[u8],
) -> Result<StoredOutcome, LedgerError> {
    rmp_serde::from_slice(bytes).map_err(|e| {
        LedgerError::caused(
            LedgerErrorKind::Corrupt,
            path,
            format!("record {key} does not decode"),
            e,
        )
    })
}

pub(super) fn decode_attempts(
    path: &Path,
    key: &str,
    bytes: &[u8],
) -> Result<Vec<Attempt>, LedgerError> {
    rmp_serde::from_slice(bytes).map_err(|e| {
        LedgerError::caused(
            LedgerErrorKind::Corrupt,
            path,
            format!("attempts of {key} do not decode"),
            e,
        )
    })
}
