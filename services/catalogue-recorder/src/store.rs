//! The catalogue's redb file: one typed table per kind of record, and its single writer.
//!
//! | table | key | value |
//! | --- | --- | --- |
//! | `datasets` | (project, dataset) | [`stagehand_catalogue::DatasetRecord`] |
//! | `dataset_names` | (dataset, project) | — (which projects have a dataset of that name) |
//! | `versions` | (project, dataset, version) | [`stagehand_catalogue::VersionRecord`] |
//! | `version_order` | (project, dataset, provenance time in ns, version) | — (versions oldest first) |
//! | `version_requests` | (project, dataset, version, request id) | — |
//! | `file_lists` | version digest | [`FileListRecord`]: the list is complete |
//! | `file_chunks` | (version digest, first path) | a chunk of entries ([`crate::chunk`]) |
//! | `replicas` | (project, dataset, version, tier, node or "") | [`stagehand_catalogue::ReplicaRecord`]: one per tier, one per node on a node-local tier |
//! | `stage_requests` | (project, request id) | [`crate::model::StageRecord`]: a stage request's status; pruned with its rows below once it holds nothing for `stage_retention` (`crate::prune`) |
//! | `stages_by_job` | (project, job, request id) | — |
//! | `stages_by_version` | (project, dataset, version — the full digest once known, else as requested, request id) | — |
//! | `stage_progress` | (project, request id) | the copy's last progress (live only, not in a [`Dump`]) |
//! | `stages_open` | (0 pending or 1 failed, last change in ns, project, request id) | — (the stage requests that may need a person, oldest first: `stagehand status`) |
//! | `readiness` | (project, dataset, version, tier, node or "") | [`crate::model::ReadinessAggregate`] |
//! | `rejections` | (project, dataset, request id) | [`stagehand_catalogue::RejectionRecord`], one per request |
//! | `dead_letters` | service | [`stagehand_catalogue::DeadLetterRecord`] |
//! | `dead_letter_states` | (service, dead letter id) | 1: the dead letter was folded, 2: a replay of it was, 4: an operator discarded it; or'ed |
//! | `dead_letters_waiting` | service | dead letters folded and neither replayed nor discarded |
//! | `operator_actions` | `<20 digits: u64::MAX − µs since the epoch>.<event id>` (newest first) | [`stagehand_catalogue::OperatorActionRecord`] |
//! | `checkpoints` | (project, run, step) | [`stagehand_catalogue::CheckpointRecord`] |
//! | `checkpoint_parts` | (project, run, step, part) | [`stagehand_catalogue::CheckpointPartRecord`]: a part of a step committed on node-local tiers (`crate::parts`) |
//! | `problems` | `<project>/<kind>/<event id>` | [`stagehand_catalogue::FoldProblem`]: a fact that could not be folded |
//! | `applied_scoped` | (project, kind, event id) | — (events folded) |
//! | `applied` | event id | — (events folded by layout 4, kept by an upgraded store: see below) |
//! | `meta` | name | layout version, rebuild completion, the upgrade's stream sequences |
//!
//! File lists are keyed by digest alone: a version is content-addressed, so two datasets (or
//! projects) holding the same bytes share one list, and only a `versions` record of the asking
//! project makes it visible. Values are bytes the recorder encodes (JSON) and decodes itself,
//! because redb's `Value::from_bytes` cannot fail and a damaged value must become an error, not
//! a panic; no record may exceed [`MAX_RECORD_BYTES`], so every answer stays bounded.
//!
//! "Already applied" is scoped by project and kind as well as id, like every other
//! deduplication: a fact whose id equals another project's (or another kind's) future fact id
//! is applied under its own scope and cannot make the catalogue skip that fact.
//!
//! A store is *complete* once a replay of the facts stream into it finished; a store that is
//! missing, of another layout, or left incomplete by a crash during its rebuild is rebuilt on
//! start — except a store of layout 4, which is upgraded in place, since a rebuild would lose
//! what the streams no longer hold (stage requests older than the requests stream keeps, dead
//! letters counted before their stream aged them out). Layout 4 kept applied events by bare
//! id, which cannot be scoped after the fact; its table stays, read-only, and answers only for
//! messages stored before the upgrade ([`Store::note_upgrade_through`]: each stream's last
//! sequence when the upgraded store first started), so that nothing is folded twice and
//! nothing published after the upgrade can borrow an old entry. Metadata folds go through one [`Writer`] thread that folds every event waiting in its
//! queue in one transaction and one commit. File lists are written beside it
//! ([`Store::put_file_list`]) in transactions of bounded size without an fsync of their own:
//! the next durable commit (the fold of the fact that needs the list) makes them durable, and a
//! crash before it rolls both back together.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use redb::{
    Database, Durability, ReadTransaction, ReadableDatabase, ReadableTable, ReadableTableMetadata,
    TableDefinition, WriteTransaction,
};
use serde::Serialize;
use serde::de::DeserializeOwned;
use stagehand_catalogue::FoldProblem;
use stagehand_manifest::Manifest;
use stagehand_schemas::Event;
use stagehand_store::{CommitError, GroupWriter};

use crate::chunk::ChunkBuilder;
use crate::error::StoreError;
use crate::fold::{self, FoldError};
use crate::model::FileListRecord;
use stagehand_schemas::Retryable;

type S = &'static str;
type Bytes = &'static [u8];

pub(crate) const DATASETS: TableDefinition<(S, S), Bytes> = TableDefinition::new("datasets");
pub(crate) const DATASET_NAMES: TableDefinition<(S, S), ()> = TableDefinition::new("dataset_names");
pub(crate) const VERSIONS: TableDefinition<(S, S, S), Bytes> = TableDefinition::new("versions");
pub(crate) const VERSION_ORDER: TableDefinition<(S, S, i128, S), ()> =
    TableDefinition::new("version_order");
pub(crate) const VERSION_REQUESTS: TableDefinition<(S, S, S, S), ()> =
    TableDefinition::new("version_requests");
pub(crate) const FILE_LISTS: TableDefinition<S, Bytes> = TableDefinition::new("file_lists");
pub(crate) const FILE_CHUNKS: TableDefinition<(S, S), Bytes> = TableDefinition::new("file_chunks");
pub(crate) const REPLICAS: TableDefinition<(S, S, S, S, S), Bytes> =
    TableDefinition::new("replicas");
/// (tier, node or "", project, dataset, version) of every replica: an index, so that the
/// replicas on one tier or one node (`replicas_on`: a node agent's re-check of its copies as it
/// comes back, the demoter's pass over a node-local tier) are found without reading every
/// replica of every tier.
pub(crate) const REPLICAS_BY_PLACE: TableDefinition<(S, S, S, S, S), ()> =
    TableDefinition::new("replicas_by_place");
pub(crate) const STAGE_REQUESTS: TableDefinition<(S, S), Bytes> =
    TableDefinition::new("stage_requests");
pub(crate) const STAGES_BY_JOB: TableDefinition<(S, S, S), ()> =
    TableDefinition::new("stages_by_job");
pub(crate) const STAGES_BY_VERSION: TableDefinition<(S, S, S, S), ()> =
    TableDefinition::new("stages_by_version");
/// Releases as written, (project, job, dataset, tier, node, version as the release wrote it) →
/// the newest one's stamp and reason: applied to every request of the job they name, whichever
/// of the two is folded first.
pub(crate) const STAGE_RELEASES: TableDefinition<(S, S, S, S, S, S), Bytes> =
    TableDefinition::new("stage_releases");
/// Progress of copies as the promoter last reported it: live state, not folded from the
/// streams (progress messages are not stored), so not part of a [`Dump`] and empty after a
/// rebuild until the next report.
pub(crate) const STAGE_PROGRESS: TableDefinition<(S, S), Bytes> =
    TableDefinition::new("stage_progress");
pub(crate) const READINESS: TableDefinition<(S, S, S, S, S), Bytes> =
    TableDefinition::new("readiness");
pub(crate) const REJECTIONS: TableDefinition<(S, S, S), Bytes> = TableDefinition::new("rejections");
pub(crate) const DEAD_LETTERS: TableDefinition<S, Bytes> = TableDefinition::new("dead_letters");
/// (service, dead letter id) → [`DEAD_LETTER_FOLDED`] | [`DEAD_LETTER_REPLAYED`]: a dead letter
/// waits until a replay of it is folded, whichever of the two comes first.
pub(crate) const DEAD_LETTER_STATES: TableDefinition<(S, S), u8> =
    TableDefinition::new("dead_letter_states");
/// service → dead letters folded and not replayed.
pub(crate) const DEAD_LETTERS_WAITING: TableDefinition<S, u64> =
    TableDefinition::new("dead_letters_waiting");
/// A `dead_letter_states` flag: the dead letter was folded.
pub(crate) const DEAD_LETTER_FOLDED: u8 = 1;
/// A `dead_letter_states` flag: a replay of the dead letter was folded.
pub(crate) const DEAD_LETTER_REPLAYED: u8 = 2;
/// A `dead_letter_states` flag: an operator's discard of the dead letter was folded.
pub(crate) const DEAD_LETTER_DISCARDED: u8 = 4;
/// Every operator action, newest first (see the module docs for the key).
pub(crate) const OPERATOR_ACTIONS: TableDefinition<S, Bytes> =
    TableDefinition::new("operator_actions");
/// (state, last change in ns, project, request id) of every stage request that is pending
/// ([`crate::stage::OPEN_PENDING`]) or failed ([`crate::stage::OPEN_FAILED`]): an index, so
/// that the stages needing a person are found without reading every stage record.
pub(crate) const STAGES_OPEN: TableDefinition<(u8, i128, S, S), ()> =
    TableDefinition::new("stages_open");
pub(crate) const CHECKPOINTS: TableDefinition<(S, S, u64), Bytes> =
    TableDefinition::new("checkpoints");
pub(crate) const CHECKPOINT_PARTS: TableDefinition<(S, S, u64, u32), Bytes> =
    TableDefinition::new("checkpoint_parts");
pub(crate) const PROBLEMS: TableDefinition<S, Bytes> = TableDefinition::new("problems");
pub(crate) const APPLIED: TableDefinition<(S, S, S), ()> = TableDefinition::new("applied_scoped");
/// Layout 4's applied events, by bare id: kept by an upgraded store (see the module docs).
pub(crate) const APPLIED_BY_ID: TableDefinition<S, ()> = TableDefinition::new("applied");
const META: TableDefinition<S, u64> = TableDefinition::new("meta");

/// Meta key: the facts stream sequence through which a rebuild replayed; present once complete.
const COMPLETE: &str = "complete_through";
/// Meta key: the layout the tables follow.
const LAYOUT: &str = "layout";
/// Meta key: set (1) by the upgrade from layout 4, whose applied events by bare id are kept.
const UPGRADED_FROM_4: &str = "upgraded_from_4";
/// Meta key: set (1) by the upgrade from layout 5, which counted every dead letter folded
/// before it as waiting without knowing which of them it was: a replay naming a dead letter
/// `dead_letter_states` does not know is then taken as the replay of one counted then.
const DEAD_LETTERS_COUNTED_BEFORE: &str = "dead_letters_counted_before_upgrade";
/// Meta key prefix: `<prefix><stream>` is the stream's last sequence when an upgraded store first
/// started; layout 4's applied events answer for messages up to it only.
const UPGRADE_THROUGH: &str = "upgrade_through.";
/// This layout: typed tables, file lists in chunks, replicas per (tier, node), each committed
/// checkpoint also a version of its run's dataset, applied events and problems scoped by project
/// and kind. A store of layout 4 is upgraded in place; one of another layout is emptied and
/// rebuilt from the streams: the one-table layout of key prefixes was 1; 2 kept one replica per
/// tier and checkpoints in their own table only; 3 had either replicas per node or checkpoint
/// versions, not both; 4 kept applied events and problems by bare event id; 5 had no index of
/// open stages and counted dead letters without their replays; 6 had no index of replicas by
/// place (5 and 6 are upgraded in place as well).
const LAYOUT_VERSION: u64 = 7;

/// The most events folded in one commit by the live writer.
pub const MAX_BATCH: usize = 512;

/// The largest encoded record: several fit in any answer.
pub const MAX_RECORD_BYTES: usize = 192 * 1024;

/// File chunk bytes written per transaction by [`Store::put_file_list`].
const FILE_LIST_TXN_BYTES: usize = 16 * 1024 * 1024;

/// Decodes a stored record; `what` names it in the error.
pub(crate) fn decode<T: DeserializeOwned>(
    bytes: &[u8],
    what: impl FnOnce() -> String,
) -> Result<T, StoreError> {
    serde_json::from_slice(bytes).map_err(|e| StoreError::Corrupt {
        key: what(),
        detail: e.to_string(),
    })
}

/// Encodes a record, refusing one over [`MAX_RECORD_BYTES`].
pub(crate) fn encode<T: Serialize>(
    value: &T,
    what: impl Fn() -> String,
) -> Result<Vec<u8>, StoreError> {
    let bytes = serde_json::to_vec(value).map_err(|e| StoreError::Corrupt {
        key: what(),
        detail: format!("cannot encode: {e}"),
    })?;
    if bytes.len() > MAX_RECORD_BYTES {
        return Err(StoreError::TooLarge {
            what: what(),
            bytes: bytes.len(),
            max: MAX_RECORD_BYTES,
        });
    }
    Ok(bytes)
}

/// One event for [`Store::apply_batch`]: folded, or — when `problem` is set, because its
/// manifest could not be had — recorded as a problem instead.
#[derive(Debug, Clone)]
pub struct FoldItem {
    pub event: Event,
    /// Its sequence in the stream it came from.
    pub sequence: Option<u64>,
    pub problem: Option<FoldProblem>,
}

/// What became of one [`FoldItem`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Folded {
    /// Folded (or folded before: the fold is idempotent).
    Done,
    /// Not folded: recorded as a problem, skipped.
    Skipped {
        problem: FoldProblem,
        retryable: bool,
    },
}

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

macro_rules! for_each_table {
    ($m:ident) => {
        $m!(DATASETS);
        $m!(DATASET_NAMES);
        $m!(VERSIONS);
        $m!(VERSION_ORDER);
        $m!(VERSION_REQUESTS);
        $m!(FILE_LISTS);
        $m!(FILE_CHUNKS);
        $m!(REPLICAS);
        $m!(REPLICAS_BY_PLACE);
        $m!(STAGE_REQUESTS);
        $m!(STAGES_BY_JOB);
        $m!(STAGES_BY_VERSION);
        $m!(STAGE_RELEASES);
        $m!(READINESS);
        $m!(REJECTIONS);
        $m!(DEAD_LETTERS);
        $m!(DEAD_LETTER_STATES);
        $m!(DEAD_LETTERS_WAITING);
        $m!(OPERATOR_ACTIONS);
        $m!(STAGES_OPEN);
        $m!(CHECKPOINTS);
        $m!(CHECKPOINT_PARTS);
        $m!(PROBLEMS);
        $m!(APPLIED);
    };
}

impl Store {
    /// Opens the store at `path`, creating it (and its parent directory) if missing. A store
    /// of another layout is emptied (and so rebuilt from the streams).
    pub fn open(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        let path = path.as_ref().to_path_buf();
        if let Some(parent) = path.parent()
            && !parent.as_os_str().is_empty()
        {
            std::fs::create_dir_all(parent).map_err(|e| StoreError::Redb(e.into()))?;
        }
        let db = stagehand_store::open_redb(&path)?;
        let txn = db.begin_write()?;
        let layout = match txn.open_table(META) {
            Ok(meta) => meta.get(LAYOUT)?.map(|v| v.value()),
            Err(e) => return Err(e.into()),
        };
        if layout == Some(4) {
            upgrade_from_4(&txn)?;
            tracing::info!(store = %path.display(), "catalogue store upgraded in place from layout 4: applied events and problems scoped by project and kind");
        }
        if matches!(layout, Some(4 | 5)) {
            upgrade_from_5(&txn)?;
            tracing::info!(store = %path.display(), "catalogue store upgraded in place from layout 5: open stages indexed, dead letters counted as waiting until replayed");
        }
        if matches!(layout, Some(4..=6)) {
            upgrade_from_6(&txn)?;
            tracing::info!(store = %path.display(), "catalogue store upgraded in place from layout 6: replicas indexed by tier and node");
        } else if layout != Some(LAYOUT_VERSION) {
            let old: Vec<_> = txn.list_tables()?.collect();
            // A new file holds only the `meta` table just opened.
            if layout.is_some() || old.len() > 1 {
                tracing::warn!(store = %path.display(), ?layout, "catalogue store of another layout: emptying it to rebuild from the streams");
            }
            for table in old {
                txn.delete_table(table)?;
            }
            txn.open_table(META)?.insert(LAYOUT, LAYOUT_VERSION)?;
        }
        macro_rules! create {
            ($t:ident) => {
                txn.open_table($t)?;
            };
        }
        for_each_table!(create);
        // Progress is live state: a report from before this start may describe a copy that
        // no longer runs, so it is not shown again; the next report brings it back.
        txn.delete_table(STAGE_PROGRESS)?;
        txn.open_table(STAGE_PROGRESS)?;
        txn.commit()?;
        Ok(Self { db, path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A read transaction (queries).
    pub(crate) fn reader(&self) -> Result<ReadTransaction, StoreError> {
        Ok(self.db.begin_read()?)
    }

    /// A write transaction beside the writer's (live-only state).
    pub(crate) fn writer_txn(&self) -> Result<WriteTransaction, StoreError> {
        Ok(self.db.begin_write()?)
    }

    /// Whether this store was upgraded from layout 4 and has not yet noted the streams' last
    /// sequences ([`Store::note_upgrade_through`]): the service does so before it folds.
    pub fn upgrade_pending(&self) -> Result<bool, StoreError> {
        let txn = self.db.begin_read()?;
        let meta = txn.open_table(META)?;
        if meta.get(UPGRADED_FROM_4)?.is_none() {
            return Ok(false);
        }
        Ok(meta
            .range(UPGRADE_THROUGH..)?
            .next()
            .transpose()?
            .is_none_or(|(k, _)| !k.value().starts_with(UPGRADE_THROUGH)))
    }

    /// Notes, for a store upgraded from layout 4, each stream's last sequence now: layout 4's
    /// applied events answer for messages up to it only. Noted once; later calls change nothing.
    pub fn note_upgrade_through(&self, streams: &[(&str, u64)]) -> Result<(), StoreError> {
        let txn = self.db.begin_write()?;
        {
            let mut meta = txn.open_table(META)?;
            for (stream, last) in streams {
                let key = format!("{UPGRADE_THROUGH}{stream}");
                if meta.get(key.as_str())?.is_none() {
                    meta.insert(key.as_str(), *last)?;
                }
            }
        }
        txn.commit()?;
        Ok(())
    }

    /// Whether a rebuild completed into this store.
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

    /// The stored file list of `digest`, if it is complete.
    pub fn file_list(&self, digest: &str) -> Result<Option<FileListRecord>, StoreError> {
        let txn = self.db.begin_read()?;
        let lists = txn.open_table(FILE_LISTS)?;
        lists
            .get(digest)?
            .map(|v| decode(v.value(), || format!("file list {digest}")))
            .transpose()
    }

    /// Writes `manifest`'s entries as the file list of its digest, chunk by chunk in path
    /// order, unless that list is stored already. Blocking (it reads a spooled manifest);
    /// memory stays a transaction's worth of chunks whatever the file count.
    pub fn put_file_list(&self, manifest: &Manifest) -> Result<FileListRecord, FoldError> {
        let digest = manifest.digest();
        if let Some(done) = self.file_list(digest)? {
            return Ok(done);
        }
        let mut builder = ChunkBuilder::default();
        let mut pending: Vec<(String, Vec<u8>)> = Vec::new();
        let mut pending_bytes = 0usize;
        let mut record = FileListRecord {
            digest: digest.to_owned(),
            files: 0,
            bytes: 0,
            chunks: 0,
        };
        let flush = |pending: &mut Vec<(String, Vec<u8>)>,
                     last: Option<&FileListRecord>|
         -> Result<(), StoreError> {
            let mut txn = self.db.begin_write()?;
            // Durable with the fold that follows (see the module docs).
            txn.set_durability(Durability::None)
                .map_err(|e| StoreError::Redb(redb::Error::Io(std::io::Error::other(e))))?;
            {
                let mut chunks = txn.open_table(FILE_CHUNKS)?;
                for (first, bytes) in pending.drain(..) {
                    chunks.insert((digest, first.as_str()), bytes.as_slice())?;
                }
                if let Some(last) = last {
                    let value = encode(last, || format!("file list {digest}"))?;
                    txn.open_table(FILE_LISTS)?
                        .insert(digest, value.as_slice())?;
                }
            }
            txn.commit()?;
            Ok(())
        };
        for entry in manifest.entries() {
            let file = entry.map_err(FoldError::manifest)?;
            if builder.is_full() {
                let (chunk, next) = builder.finish();
                pending_bytes += chunk.1.len();
                pending.push(chunk);
                record.chunks += 1;
                builder = next;
                if pending_bytes >= FILE_LIST_TXN_BYTES {
                    flush(&mut pending, None)?;
                    pending_bytes = 0;
                }
            }
            builder
                .push(&file)
                .map_err(|e| FoldError::malformed(e.to_string()))?;
            record.files += 1;
            record.bytes += file.size;
        }
        if !builder.is_empty() {
            pending.push(builder.finish().0);
            record.chunks += 1;
        }
        flush(&mut pending, Some(&record))?;
        Ok(record)
    }

    /// Folds `items` in one transaction and one commit. An item whose fold fails for a reason
    /// of its own (a damaged record it needs, a record too large, a missing file list) is
    /// recorded as a problem and skipped, and the rest fold; a failure of the store itself
    /// fails the whole batch, which is then not committed.
    pub fn apply_batch(&self, items: &[FoldItem]) -> Result<Vec<Folded>, StoreError> {
        let mut skipped: BTreeMap<usize, (FoldProblem, bool)> = BTreeMap::new();
        for (i, item) in items.iter().enumerate() {
            if let Some(problem) = &item.problem {
                skipped.insert(i, (problem.clone(), true));
            }
        }
        'attempt: loop {
            let txn = self.db.begin_write()?;
            for (i, item) in items.iter().enumerate() {
                if let Some((problem, _)) = skipped.get(&i) {
                    record_problem(&txn, problem)?;
                    continue;
                }
                if already_applied(&txn, &item.event, item.sequence)? {
                    continue;
                }
                match fold::apply(&txn, &item.event) {
                    Ok(true) => {
                        txn.open_table(PROBLEMS)?
                            .remove(problem_key(&item.event).as_str())?;
                    }
                    Ok(false) => {}
                    Err(e) => match e.problem_code() {
                        Some(code) => {
                            let retryable = e.is_retryable();
                            let problem =
                                fold::problem(&item.event, item.sequence, code, e.to_string());
                            skipped.insert(i, (problem, retryable));
                            txn.abort()?;
                            continue 'attempt;
                        }
                        None => {
                            let FoldError::Store(e) = e else {
                                unreachable!("only store errors have no problem code")
                            };
                            return Err(e);
                        }
                    },
                }
            }
            txn.commit()?;
            break;
        }
        Ok((0..items.len())
            .map(|i| match skipped.remove(&i) {
                Some((problem, retryable)) => Folded::Skipped { problem, retryable },
                None => Folded::Done,
            })
            .collect())
    }

    /// The whole catalogue: every table's rows in key order. Two catalogues folded from the
    /// same facts have equal dumps.
    pub fn dump(&self) -> Result<Dump, StoreError> {
        let txn = self.db.begin_read()?;
        let mut tables = Vec::new();
        macro_rules! dump {
            ($t:ident) => {{
                let table = txn.open_table($t)?;
                let mut rows = Vec::new();
                for row in table.iter()? {
                    let (k, v) = row?;
                    rows.push(format!("{:?} = {}", k.value(), Shown(&v.value())));
                }
                tables.push((stringify!($t).to_lowercase(), rows));
            }};
        }
        for_each_table!(dump);
        Ok(Dump { tables })
    }

    /// How many facts are recorded as problems.
    pub fn problem_count(&self) -> Result<u64, StoreError> {
        let txn = self.db.begin_read()?;
        Ok(txn.open_table(PROBLEMS)?.len()?)
    }

    /// Writes raw bytes under a key of the `datasets` table (tests damage records with it).
    #[doc(hidden)]
    pub fn damage_dataset_record(
        &self,
        project: &str,
        dataset: &str,
        bytes: &[u8],
    ) -> Result<(), StoreError> {
        let txn = self.db.begin_write()?;
        txn.open_table(DATASETS)?
            .insert((project, dataset), bytes)?;
        txn.commit()?;
        Ok(())
    }
}

fn record_problem(txn: &WriteTransaction, problem: &FoldProblem) -> Result<(), StoreError> {
    let value = encode(problem, || format!("problem {}", problem.event_id))?;
    let key = scoped_key(&problem.project, &problem.kind, problem.event_id.as_str());
    txn.open_table(PROBLEMS)?
        .insert(key.as_str(), value.as_slice())?;
    Ok(())
}

/// `<project>/<kind>/<id>`: project tokens, kinds and ids hold no `/`, so no two events of
/// different scope share it.
fn scoped_key(project: &str, kind: &str, id: &str) -> String {
    format!("{project}/{kind}/{id}")
}

/// The key of `event`'s row in `problems`.
fn problem_key(event: &Event) -> String {
    scoped_key(&event.project, event.kind(), event.id.as_str())
}

/// The stream an event travels on, by the class of its subject.
fn stream_of(event: &Event) -> &'static str {
    use stagehand_schemas::subject::{self, DEAD_LETTERS, FACTS, REQUESTS};
    let subject = subject::subject_for(&event.body, &event.project);
    match subject::class_of_subject(&subject) {
        Some(subject::REQ) => REQUESTS.name,
        Some(subject::DLQ) => DEAD_LETTERS.name,
        _ => FACTS.name,
    }
}

/// Whether `event` (at `sequence` of its stream, when known) was folded before: under its own
/// scope, or — in a store upgraded from layout 4, for a message stored before the upgrade —
/// by its bare id in layout 4's table.
pub(crate) fn already_applied(
    txn: &WriteTransaction,
    event: &Event,
    sequence: Option<u64>,
) -> Result<bool, StoreError> {
    let scope = (event.project.as_str(), event.kind(), event.id.as_str());
    if txn.open_table(APPLIED)?.get(scope)?.is_some() {
        return Ok(true);
    }
    let meta = txn.open_table(META)?;
    if meta.get(UPGRADED_FROM_4)?.is_none() {
        return Ok(false);
    }
    // Until the service noted the streams' sequences, every message counts as an earlier one.
    let through = meta
        .get(format!("{UPGRADE_THROUGH}{}", stream_of(event)).as_str())?
        .map(|v| v.value());
    let earlier = match (through, sequence) {
        (Some(through), Some(sequence)) => sequence <= through,
        _ => true,
    };
    if !earlier {
        return Ok(false);
    }
    Ok(txn
        .open_table(APPLIED_BY_ID)?
        .get(event.id.as_str())?
        .is_some())
}

/// The upgrade from layout 4 within `txn`: problems move to scoped keys (their records name
/// project and kind), the applied events by bare id stay where they are for messages stored
/// before the upgrade, and every other table is kept as it is.
fn upgrade_from_4(txn: &WriteTransaction) -> Result<(), StoreError> {
    let mut problems = txn.open_table(PROBLEMS)?;
    let old: Vec<(String, Vec<u8>)> = problems
        .iter()?
        .map(|row| row.map(|(k, v)| (k.value().to_owned(), v.value().to_vec())))
        .collect::<Result<_, _>>()?;
    for (key, value) in old {
        let problem: FoldProblem = decode(&value, || format!("problem {key}"))?;
        problems.remove(key.as_str())?;
        let scoped = scoped_key(&problem.project, &problem.kind, problem.event_id.as_str());
        problems.insert(scoped.as_str(), value.as_slice())?;
    }
    drop(problems);
    let mut meta = txn.open_table(META)?;
    meta.insert(UPGRADED_FROM_4, 1)?;
    meta.insert(LAYOUT, 5)?;
    Ok(())
}

/// The upgrade from layout 5 within `txn`: every pending or failed stage request goes into
/// `stages_open`, and every dead letter counted so far is taken as waiting (layout 5 did not
/// fold replays, so which of them were replayed is not known: `dead-letters` shows them
/// waiting until each is replayed again or, replayed before, the next replay of it is folded).
fn upgrade_from_5(txn: &WriteTransaction) -> Result<(), StoreError> {
    {
        let requests = txn.open_table(STAGE_REQUESTS)?;
        let mut open = txn.open_table(STAGES_OPEN)?;
        for row in requests.iter()? {
            let (k, v) = row?;
            let (project, id) = k.value();
            let record: crate::model::StageRecord =
                decode(v.value(), || format!("stage request {project}/{id}"))?;
            if let Some((state, at)) = crate::stage::open_key(&record.status) {
                open.insert((state, at, project, id), ())?;
            }
        }
    }
    {
        let counted = txn.open_table(DEAD_LETTERS)?;
        let mut waiting = txn.open_table(DEAD_LETTERS_WAITING)?;
        for row in counted.iter()? {
            let (k, v) = row?;
            let service = k.value();
            let record: stagehand_catalogue::DeadLetterRecord =
                decode(v.value(), || format!("dead letters of {service}"))?;
            waiting.insert(service, record.count)?;
        }
    }
    let mut meta = txn.open_table(META)?;
    meta.insert(DEAD_LETTERS_COUNTED_BEFORE, 1)?;
    meta.insert(LAYOUT, 6)?;
    Ok(())
}

/// The upgrade from layout 6 within `txn`: every replica indexed by place.
fn upgrade_from_6(txn: &WriteTransaction) -> Result<(), StoreError> {
    {
        let replicas = txn.open_table(REPLICAS)?;
        let mut by_place = txn.open_table(REPLICAS_BY_PLACE)?;
        for row in replicas.iter()? {
            let (k, _) = row?;
            let (project, dataset, version, tier, node) = k.value();
            by_place.insert((tier, node, project, dataset, version), ())?;
        }
    }
    txn.open_table(META)?.insert(LAYOUT, LAYOUT_VERSION)?;
    Ok(())
}

/// Whether this store was upgraded from a layout that counted dead letters without their
/// replays (see [`DEAD_LETTERS_COUNTED_BEFORE`]).
pub(crate) fn dead_letters_counted_before_upgrade(
    txn: &WriteTransaction,
) -> Result<bool, StoreError> {
    Ok(txn
        .open_table(META)?
        .get(DEAD_LETTERS_COUNTED_BEFORE)?
        .is_some())
}

/// A stored value as a dump shows it: its text when it is text (the JSON records), else hex.
struct Shown<'a, T>(&'a T);

impl std::fmt::Display for Shown<'_, &[u8]> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match std::str::from_utf8(self.0) {
            Ok(text) => f.write_str(text),
            Err(_) => self.0.iter().try_for_each(|b| write!(f, "{b:02x}")),
        }
    }
}

/// Counts and flags (`dead_letters_waiting`, `dead_letter_states`) show as numbers.
impl std::fmt::Display for Shown<'_, u64> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl std::fmt::Display for Shown<'_, u8> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl std::fmt::Display for Shown<'_, ()> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("()")
    }
}

/// A full copy of a catalogue, for comparing two of them: per table, its rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dump {
    pub tables: Vec<(String, Vec<String>)>,
}

impl Dump {
    /// The rows of one table.
    pub fn rows(&self, table: &str) -> &[String] {
        self.tables
            .iter()
            .find(|(name, _)| name == table)
            .map(|(_, rows)| rows.as_slice())
            .unwrap_or_default()
    }
}

/// The writer's thread, to wait for once every [`Writer`] is dropped.
pub use stagehand_store::WriterThread;

/// The store's single writer of metadata ([`stagehand_store`]): folds every event queued
/// meanwhile (at most [`MAX_BATCH`]) in one commit; its queue holds two batches, and a fold
/// past that waits for room.
#[derive(Clone, Debug)]
pub struct Writer {
    queue: GroupWriter<FoldItem, Folded, StoreError>,
}

impl Writer {
    /// Starts the writer thread over `store`. It stops when every `Writer` clone is dropped;
    /// [`WriterThread::join`] waits for that (and so for its hold on the store to end).
    pub fn start(store: std::sync::Arc<Store>) -> (Self, WriterThread) {
        let (queue, thread) = stagehand_store::writer("catalogue")
            .max_batch(MAX_BATCH)
            .queue(MAX_BATCH * 2)
            .spawn(move |items: &[FoldItem]| {
                store.apply_batch(items).inspect_err(|e| {
                    tracing::warn!(error = %e, events = items.len(), "catalogue commit failed");
                })
            })
            .expect("spawning the catalogue writer thread");
        (Self { queue }, thread)
    }

    /// Folds one event (or records its problem); returns once it is committed.
    pub async fn apply(&self, item: FoldItem) -> Result<Folded, StoreError> {
        self.queue.submit(item).await.map_err(|e| match e {
            CommitError::Failed(cause) => StoreError::Batch(cause),
            CommitError::Stopped(_) => StoreError::WriterGone,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use stagehand_schemas::subject::{DEAD_LETTERS as DLQ, FACTS, REQUESTS};
    use stagehand_schemas::{Body, Event};

    use super::*;
    use crate::testing::*;

    fn fixture(name: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(name)
    }

    /// The rows of every table but the applied events, as `table\trow` lines.
    fn catalogue_rows(dump: &Dump) -> Vec<String> {
        dump.tables
            .iter()
            .filter(|(table, _)| table != "applied")
            .flat_map(|(table, rows)| rows.iter().map(move |r| format!("{table}\t{r}")))
            .collect()
    }

    fn items(events: &[Event], sequence: u64) -> Vec<FoldItem> {
        events
            .iter()
            .map(|e| FoldItem {
                event: e.clone(),
                sequence: Some(sequence),
                problem: None,
            })
            .collect()
    }

    /// A store written by layout 4 (applied events by bare id; `tests/fixtures/layout4.redb`,
    /// made by that layout's code with its dump beside it) is upgraded in place: every record
    /// of its catalogue is still there, the facts it folded are not folded again when they
    /// come back (a dead letter is not counted twice), and an event of another scope that
    /// borrows one of their ids after the upgrade is folded.
    #[test]
    fn a_layout_4_store_is_upgraded_in_place_with_its_catalogue_intact() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("catalogue.redb");
        std::fs::copy(fixture("layout4.redb"), &path).unwrap();
        let before: Vec<String> = std::fs::read_to_string(fixture("layout4.dump"))
            .unwrap()
            .lines()
            .filter(|l| !l.starts_with("applied\t"))
            .map(str::to_owned)
            .collect();
        let events: Vec<Event> = std::fs::read_to_string(fixture("layout4.events.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert!(before.iter().any(|l| l.starts_with("dead_letters\t")));
        // Upgraded through layout 5 as well: the two dead letters counted then wait (layout 5
        // did not fold replays); the fixture's stage request is ready, so none is open.
        let mut before = before;
        let at = before
            .iter()
            .rposition(|l| l.starts_with("dead_letters\t"))
            .unwrap();
        before.insert(
            at + 1,
            "dead_letters_waiting\t\"ingest-validator\" = 2".to_owned(),
        );
        // And through layout 6: every replica indexed by place, right after the replicas.
        let mut places: Vec<Vec<String>> = (before.iter())
            .filter_map(|l| l.strip_prefix("replicas\t("))
            .map(|l| {
                let key = &l[..l.find(") = ").unwrap()];
                let parts: Vec<String> = key
                    .split(", ")
                    .map(|p| p.trim_matches('"').into())
                    .collect();
                let [p, d, v, t, n] = <[String; 5]>::try_from(parts).unwrap();
                vec![t, n, p, d, v]
            })
            .collect();
        assert!(!places.is_empty(), "the fixture has replicas");
        places.sort();
        let at = before
            .iter()
            .rposition(|l| l.starts_with("replicas\t"))
            .unwrap();
        for (i, place) in places.iter().enumerate() {
            let quoted: Vec<String> = place.iter().map(|p| format!("{p:?}")).collect();
            before.insert(
                at + 1 + i,
                format!("replicas_by_place\t({}) = ()", quoted.join(", ")),
            );
        }

        let store = Store::open(&path).unwrap();
        assert_eq!(catalogue_rows(&store.dump().unwrap()), before);
        assert!(store.upgrade_pending().unwrap());
        store
            .note_upgrade_through(&[(FACTS.name, 100), (DLQ.name, 100), (REQUESTS.name, 100)])
            .unwrap();
        assert!(!store.upgrade_pending().unwrap());
        drop(store);

        // Reopened: still the current layout, still the same catalogue.
        let store = Store::open(&path).unwrap();
        assert_eq!(catalogue_rows(&store.dump().unwrap()), before);
        // The same facts delivered again (stored before the upgrade): nothing changes, and
        // the two dead letters still count two.
        let results = store.apply_batch(&items(&events, 50)).unwrap();
        assert!(results.iter().all(|r| *r == Folded::Done), "{results:?}");
        assert_eq!(catalogue_rows(&store.dump().unwrap()), before);

        // After the upgrade, another project's fact under an id layout 4 applied is folded.
        let borrowed = events
            .iter()
            .find(|e| matches!(e.body, Body::DatasetValidated(_)))
            .unwrap();
        let mut foreign = borrowed.clone();
        foreign.project = "labb".into();
        if let Body::DatasetValidated(p) = &mut foreign.body {
            p.source.prefix = "labb/cats/x".into();
        }
        fold_files(&store, &foreign);
        store.apply_batch(&items(&[foreign], 101)).unwrap();
        let rows = catalogue_rows(&store.dump().unwrap());
        assert!(
            rows.iter()
                .any(|r| r.starts_with("versions\t(\"labb\", \"cats\""))
        );
    }

    fn fold_files(store: &Store, event: &Event) {
        if let Some(stagehand_manifest::ManifestSource::Inline(files)) =
            stagehand_manifest::ManifestSource::of(event).unwrap()
        {
            store
                .put_file_list(&stagehand_manifest::Manifest::from_entries(files))
                .unwrap();
        }
    }

    /// Guards the scope of "already applied": a fact whose id equals another project's future
    /// fact id (a training job's commit carrying the id of `labb`'s next verdict) is applied
    /// under its own project and kind, and `labb`'s fact is folded when it comes.
    #[test]
    fn a_fact_borrowing_another_projects_id_does_not_make_the_catalogue_skip_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().join("c.redb")).unwrap();
        // Each beneath its own project's folder, as the location rule requires.
        let mut victim = validated(1);
        victim.project = "labb".into();
        if let Body::DatasetValidated(p) = &mut victim.body {
            p.source.prefix = "labb/cats/x".into();
        }
        let mut shadow = checkpoint_committed(1, &[], 0);
        shadow.project = "demo".into();
        shadow.id = victim.id.clone();
        if let Body::CheckpointCommitted(p) = &mut shadow.body {
            p.location.prefix = "demo/checkpoints/r1/step-1".into();
        }
        fold_files(&store, &shadow);
        fold_files(&store, &victim);
        store.apply_batch(&items(&[shadow], 1)).unwrap();
        store.apply_batch(&items(&[victim.clone()], 2)).unwrap();
        let rows = catalogue_rows(&store.dump().unwrap());
        assert!(
            rows.iter().any(|r| r.starts_with(&format!(
                "versions\t(\"labb\", \"cats\", \"{}\")",
                version_of(&victim)
            ))),
            "{rows:#?}"
        );
        // Folded once: the same fact again changes nothing.
        let dump = store.dump().unwrap();
        store.apply_batch(&items(&[victim], 3)).unwrap();
        assert_eq!(store.dump().unwrap(), dump);
    }
}
