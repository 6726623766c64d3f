//! The promoter's own state, in its redb file: every stage request it accepted and where it
//! stands, which requests wait and on what, and what the facts it has seen make true.
//!
//! | table | key | value | what for |
//! | --- | --- | --- | --- |
//! | `requests` | request id | [`RequestRecord`] (JSON) | the request, its deadline, its state, the facts that answered it |
//! | `waits` | (project, dataset, request id) | what it waits for | the requests a fact about (project, dataset) wakes |
//! | `seen` | (project, dataset, version) | [`Seen`] bits | versions validated, prepared, rejected, or with a prepared form |
//! | `replicas` | (tier, prefix) | — | shared-tier replicas made (`replica.created`) and not removed since |
//! | `ingests` | (project, dataset, ingest request id) | declared version | uploads asked for and not answered yet |
//! | `jobs` | (project, job id, request id) | — | the requests of a job, which a release names however it spells the version |
//!
//! **No lost wake-up.** A wait is recorded only in a write transaction that first checks
//! `seen` (and `replicas`) for the fact that would end it; a fact is noted, and the waits it
//! wakes listed, in one write transaction. redb runs one write transaction at a time, so either
//! the fact's transaction comes first (the wait is refused: the caller looks again) or the
//! wait's (the fact lists it). A refused wait means the promoter knows more than the catalogue
//! answered (the recorder has not folded the fact yet): the caller retries shortly.

use std::path::Path;
use std::sync::Arc;

use redb::{Database, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition};
use serde::{Deserialize, Serialize};
use stagehand_schemas::{Body, Event, EventId, StageReleased, StageRequested};
use time::OffsetDateTime;

/// Requests by [`request_key`]: their project and id.
const REQUESTS: TableDefinition<&str, &[u8]> = TableDefinition::new("requests");
const WAITS: TableDefinition<(&str, &str, &str), &str> = TableDefinition::new("waits");
const SEEN: TableDefinition<(&str, &str, &str), u8> = TableDefinition::new("seen");
const REPLICAS: TableDefinition<(&str, &str), ()> = TableDefinition::new("replicas");
const INGESTS: TableDefinition<(&str, &str, &str), &str> = TableDefinition::new("ingests");
const JOBS: TableDefinition<(&str, &str, &str), ()> = TableDefinition::new("jobs");

/// What the facts seen say about one version (bits of `seen`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Seen(pub u8);

impl Seen {
    /// `dataset.validated` named this version.
    pub const VALIDATED: u8 = 1;
    /// `dataset.prepared` named this version (a derived one).
    pub const PREPARED: u8 = 2;
    /// `dataset.rejected` declared this version.
    pub const REJECTED: u8 = 4;
    /// `dataset.prepared` derived a version from this one.
    pub const HAS_PREPARED: u8 = 8;

    pub fn has(self, bit: u8) -> bool {
        self.0 & bit != 0
    }
}

/// What a waiting request waits for: the contract's `waiting_for` words.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WaitingFor {
    /// A version the request names to be validated.
    Validation,
    /// The prepared form of a validated version.
    Preparation,
    /// A copy of the version onto the tier (by this request or another), or a copy slot.
    Copy,
}

impl WaitingFor {
    pub fn as_str(self) -> &'static str {
        match self {
            WaitingFor::Validation => "validation",
            WaitingFor::Preparation => "preparation",
            WaitingFor::Copy => "copy",
        }
    }
}

/// Where a request stands.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum Standing {
    /// Not answered yet: waiting, or being copied (`Copy`).
    Waiting {
        waiting_for: WaitingFor,
        reason: String,
    },
    /// Answered `stage.ready`.
    Ready { version: String, path: String },
    /// Answered `stage.failed`.
    Failed { reason: String, retryable: bool },
    /// Released by its job before or after it was answered.
    Released,
}

impl Standing {
    /// Whether nothing more will be done for the request.
    pub fn is_final(&self) -> bool {
        !matches!(self, Standing::Waiting { .. })
    }
}

/// One accepted stage request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    /// The `stage.requested` event as received (facts are derived from it).
    pub event: Event,
    /// When the request stops waiting: its own deadline, or the policy's default from when it
    /// was accepted.
    #[serde(with = "time::serde::rfc3339")]
    pub deadline: OffsetDateTime,
    pub standing: Standing,
    /// The facts that gave the request its final answer, republished as they are when the
    /// same request comes again.
    #[serde(default)]
    pub answer: Vec<Event>,
    /// The replica prefix whose space this request reserved for its copy (noted before the
    /// reservation is made): what a request that ends without the replica gives back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reserved: Option<String>,
}

impl RequestRecord {
    /// The stage request this record holds (every record does: only they are accepted).
    pub fn stage(&self) -> Option<&StageRequested> {
        match &self.event.body {
            Body::StageRequested(r) => Some(r),
            _ => None,
        }
    }
}

/// A failure of the state store: the service cannot go on safely. Typed and classified
/// (retryable or permanent) in [`stagehand_store`], shared with the demoter's state.
pub use stagehand_store::StateError;

/// A `requests` record that does not decode.
fn undecodable(e: serde_json::Error) -> StateError {
    StateError::decode("requests record", e)
}

/// A `requests` record that cannot be encoded.
fn unencodable(e: serde_json::Error) -> StateError {
    StateError::encode("requests record", e)
}

/// What a wait must not miss: the fact that would end it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WaitGuard {
    /// A version of `dataset` starting with `prefix` validated or prepared.
    Validated { prefix: String },
    /// A prepared form of `version`.
    Prepared { version: String },
    /// The replica at `prefix` on shared tier `tier` made (by another instance).
    Replica { tier: String, prefix: String },
    /// Nothing the facts would say (a copy slot, a copy of this instance's, a node-local copy).
    None,
}

/// The promoter's state store. Clones share one database.
#[derive(Clone)]
pub struct State {
    db: Arc<Database>,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State").finish_non_exhaustive()
    }
}

/// The facts of one event, noted: what to wake.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Woken {
    pub requests: Vec<EventId>,
}

/// A request's key in the requests table: its project and its id. The id alone is its
/// publisher's word, and another project's request may carry the same one: keyed by the id
/// alone, the first would stand for the second (which would never be served).
fn request_key(project: &str, id: &str) -> String {
    format!("{project}/{id}")
}

impl State {
    pub fn open(path: &Path) -> Result<State, StateError> {
        let db = stagehand_store::create_state_file(path)?;
        let txn = db.begin_write()?;
        {
            let mut requests = txn.open_table(REQUESTS)?;
            // A state written when requests were keyed by id alone: keyed again by project
            // and id, once.
            let mut unscoped = Vec::new();
            for row in requests.iter()? {
                let (k, v) = row?;
                if !k.value().contains('/') {
                    unscoped.push((k.value().to_owned(), v.value().to_vec()));
                }
            }
            for (id, bytes) in unscoped {
                requests.remove(id.as_str())?;
                if let Ok(record) = serde_json::from_slice::<RequestRecord>(&bytes) {
                    let key = request_key(&record.event.project, record.event.id.as_str());
                    requests.insert(key.as_str(), bytes.as_slice())?;
                }
            }
            drop(requests);
            txn.open_table(WAITS)?;
            txn.open_table(SEEN)?;
            txn.open_table(REPLICAS)?;
            txn.open_table(INGESTS)?;
            let mut jobs = txn.open_table(JOBS)?;
            // A state written before the table existed: index the requests it holds, once.
            if jobs.is_empty()? {
                let requests = txn.open_table(REQUESTS)?;
                for row in requests.iter()? {
                    let (_, v) = row?;
                    if let Ok(record) = serde_json::from_slice::<RequestRecord>(v.value())
                        && let Some(r) = record.stage()
                    {
                        jobs.insert(
                            (
                                record.event.project.as_str(),
                                r.job_id.as_str(),
                                record.event.id.as_str(),
                            ),
                            (),
                        )?;
                    }
                }
            }
        }
        txn.commit()?;
        Ok(State { db: Arc::new(db) })
    }

    pub fn request(
        &self,
        project: &str,
        id: &EventId,
    ) -> Result<Option<RequestRecord>, StateError> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(REQUESTS)?;
        match table.get(request_key(project, id.as_str()).as_str())? {
            Some(v) => serde_json::from_slice(v.value())
                .map(Some)
                .map_err(undecodable),
            None => Ok(None),
        }
    }

    /// Records a request the first time it is seen; returns the record as stored (the
    /// earlier one when it was seen before).
    pub fn accept(&self, record: RequestRecord) -> Result<RequestRecord, StateError> {
        let txn = self.db.begin_write()?;
        let key = request_key(&record.event.project, record.event.id.as_str());
        let stored = {
            let mut table = txn.open_table(REQUESTS)?;
            let existing = table
                .get(key.as_str())?
                .map(|v| serde_json::from_slice::<RequestRecord>(v.value()));
            match existing {
                Some(Ok(r)) => r,
                _ => {
                    let bytes = serde_json::to_vec(&record).map_err(unencodable)?;
                    table.insert(key.as_str(), bytes.as_slice())?;
                    if let Some(r) = record.stage() {
                        txn.open_table(JOBS)?.insert(
                            (
                                record.event.project.as_str(),
                                r.job_id.as_str(),
                                record.event.id.as_str(),
                            ),
                            (),
                        )?;
                    }
                    // Listed as waiting at once: the clock moves it on even if its message
                    // is never handled to the end.
                    if let Standing::Waiting { waiting_for, .. } = &record.standing {
                        txn.open_table(WAITS)?.insert(
                            (
                                record.event.project.as_str(),
                                dataset_of(&record).as_str(),
                                record.event.id.as_str(),
                            ),
                            waiting_for.as_str(),
                        )?;
                    }
                    record
                }
            }
        };
        txn.commit()?;
        Ok(stored)
    }

    /// Gives a request its final answer (ready, failed, released) and ends its wait. A request
    /// already final keeps its first answer, except that a release always ends it; returns the
    /// record as stored.
    pub fn finish(
        &self,
        project: &str,
        id: &EventId,
        standing: Standing,
        answer: Vec<Event>,
    ) -> Result<Option<RequestRecord>, StateError> {
        let txn = self.db.begin_write()?;
        let stored = {
            let key = request_key(project, id.as_str());
            let mut table = txn.open_table(REQUESTS)?;
            let current = table
                .get(key.as_str())?
                .map(|v| serde_json::from_slice::<RequestRecord>(v.value()))
                .transpose()
                .map_err(undecodable)?;
            let Some(mut record) = current else {
                return Ok(None);
            };
            let replace = !record.standing.is_final() || standing == Standing::Released;
            if replace && record.standing != standing {
                record.standing = standing;
                if !answer.is_empty() {
                    record.answer = answer;
                }
                let bytes = serde_json::to_vec(&record).map_err(unencodable)?;
                table.insert(key.as_str(), bytes.as_slice())?;
            }
            let (project, dataset) = (record.event.project.clone(), dataset_of(&record));
            txn.open_table(WAITS)?
                .remove((project.as_str(), dataset.as_str(), id.as_str()))?;
            record
        };
        txn.commit()?;
        Ok(Some(stored))
    }

    /// Notes that `id` is about to reserve the space of the replica at `prefix` for its copy.
    pub fn note_reserved(
        &self,
        project: &str,
        id: &EventId,
        prefix: &str,
    ) -> Result<(), StateError> {
        let txn = self.db.begin_write()?;
        {
            let key = request_key(project, id.as_str());
            let mut table = txn.open_table(REQUESTS)?;
            let current = table
                .get(key.as_str())?
                .map(|v| serde_json::from_slice::<RequestRecord>(v.value()))
                .transpose()
                .map_err(undecodable)?;
            if let Some(mut record) = current
                && record.reserved.as_deref() != Some(prefix)
            {
                record.reserved = Some(prefix.to_owned());
                let bytes = serde_json::to_vec(&record).map_err(unencodable)?;
                table.insert(key.as_str(), bytes.as_slice())?;
            }
        }
        txn.commit()?;
        Ok(())
    }

    /// Whether a request still waiting, its deadline not passed at `now`, reserved the
    /// replica at `prefix` on `tier` (and `node`): its copy will go on (or is taken up again).
    pub fn reserved_by_live_request(
        &self,
        tier: &str,
        node: Option<&str>,
        prefix: &str,
        now: OffsetDateTime,
    ) -> Result<bool, StateError> {
        Ok(self.waiting()?.iter().any(|record| {
            record.deadline > now
                && record.reserved.as_deref() == Some(prefix)
                && record
                    .stage()
                    .is_some_and(|r| r.tier == tier && r.node.as_deref() == node)
        }))
    }

    /// The requests a release names: the one its own spelling of the version derives
    /// (`exact`), and every other of the same job, dataset, tier and node whose version the
    /// release names however either was written (a unique prefix or the full digest).
    pub fn released_by(
        &self,
        project: &str,
        exact: &EventId,
        release: &StageReleased,
    ) -> Result<Vec<EventId>, StateError> {
        let txn = self.db.begin_read()?;
        let jobs = txn.open_table(JOBS)?;
        let requests = txn.open_table(REQUESTS)?;
        let mut out = Vec::new();
        for row in jobs.range((project, release.job_id.as_str(), "")..)? {
            let (k, _) = row?;
            let (p, job, id) = k.value();
            if p != project || job != release.job_id {
                break;
            }
            let Some(v) = requests.get(request_key(project, id).as_str())? else {
                continue;
            };
            let record: RequestRecord = serde_json::from_slice(v.value()).map_err(undecodable)?;
            let resolved = match &record.standing {
                Standing::Ready { version, .. } => Some(version.as_str()),
                _ => None,
            };
            let named = id == exact.as_str()
                || record.stage().is_some_and(|r| {
                    r.dataset == release.dataset
                        && r.tier == release.tier
                        && r.node == release.node
                        && (release.names_version(&r.version)
                            || resolved.is_some_and(|v| release.names_version(v)))
                });
            if named {
                out.push(record.event.id.clone());
            }
        }
        Ok(out)
    }

    /// Records that a request waits, unless a fact already seen (`guard`) would end the wait:
    /// then nothing is written and `false` comes back (look again: the catalogue lags).
    pub fn wait(
        &self,
        project: &str,
        id: &EventId,
        waiting_for: WaitingFor,
        reason: &str,
        guard: &WaitGuard,
    ) -> Result<bool, StateError> {
        let txn = self.db.begin_write()?;
        {
            let key = request_key(project, id.as_str());
            let mut table = txn.open_table(REQUESTS)?;
            let Some(mut record) = table
                .get(key.as_str())?
                .map(|v| serde_json::from_slice::<RequestRecord>(v.value()))
                .transpose()
                .map_err(undecodable)?
            else {
                return Ok(false);
            };
            if record.standing.is_final() {
                return Ok(false);
            }
            let project = record.event.project.clone();
            let dataset = dataset_of(&record);
            let ended = match guard {
                WaitGuard::Validated { prefix } => {
                    let seen = txn.open_table(SEEN)?;
                    let mut ended = false;
                    for row in
                        seen.range((project.as_str(), dataset.as_str(), prefix.as_str())..)?
                    {
                        let (k, v) = row?;
                        let (p, d, version) = k.value();
                        if p != project || d != dataset || !version.starts_with(prefix.as_str()) {
                            break;
                        }
                        if Seen(v.value()).has(Seen::VALIDATED | Seen::PREPARED) {
                            ended = true;
                            break;
                        }
                    }
                    ended
                }
                WaitGuard::Prepared { version } => txn
                    .open_table(SEEN)?
                    .get((project.as_str(), dataset.as_str(), version.as_str()))?
                    .is_some_and(|v| Seen(v.value()).has(Seen::HAS_PREPARED)),
                WaitGuard::Replica { tier, prefix } => txn
                    .open_table(REPLICAS)?
                    .get((tier.as_str(), prefix.as_str()))?
                    .is_some(),
                WaitGuard::None => false,
            };
            if ended {
                return Ok(false);
            }
            record.standing = Standing::Waiting {
                waiting_for,
                reason: reason.to_owned(),
            };
            let bytes = serde_json::to_vec(&record).map_err(unencodable)?;
            table.insert(key.as_str(), bytes.as_slice())?;
            txn.open_table(WAITS)?.insert(
                (project.as_str(), dataset.as_str(), id.as_str()),
                waiting_for.as_str(),
            )?;
        }
        txn.commit()?;
        Ok(true)
    }

    /// Notes what a fact says and lists the requests waiting on its (project, dataset), in one
    /// transaction (see the module docs).
    pub fn note(&self, note: &FactNote) -> Result<Woken, StateError> {
        let txn = self.db.begin_write()?;
        let (project, dataset) = (note.project.as_str(), note.dataset.as_str());
        {
            let mut seen = txn.open_table(SEEN)?;
            for (version, bit) in &note.seen {
                let old = seen
                    .get((project, dataset, version.as_str()))?
                    .map_or(0, |v| v.value());
                seen.insert((project, dataset, version.as_str()), old | bit)?;
            }
            let mut replicas = txn.open_table(REPLICAS)?;
            if let Some((tier, prefix, present)) = &note.replica {
                if *present {
                    replicas.insert((tier.as_str(), prefix.as_str()), ())?;
                } else {
                    replicas.remove((tier.as_str(), prefix.as_str()))?;
                }
            }
            let mut ingests = txn.open_table(INGESTS)?;
            match &note.ingest {
                Some(IngestNote::Asked { request, declared }) => {
                    ingests.insert((project, dataset, request.as_str()), declared.as_str())?;
                }
                Some(IngestNote::Answered { request }) => {
                    ingests.remove((project, dataset, request.as_str()))?;
                }
                None => {}
            }
        }
        let mut woken = Woken::default();
        {
            let waits = txn.open_table(WAITS)?;
            for row in waits.range((project, dataset, "")..)? {
                let (k, _) = row?;
                let (p, d, id) = k.value();
                if p != project || d != dataset {
                    break;
                }
                if let Ok(id) = EventId::new(id) {
                    woken.requests.push(id);
                }
            }
        }
        txn.commit()?;
        Ok(woken)
    }

    /// What the facts seen say about a version.
    pub fn seen(&self, project: &str, dataset: &str, version: &str) -> Result<Seen, StateError> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(SEEN)?;
        Ok(Seen(
            table
                .get((project, dataset, version))?
                .map_or(0, |v| v.value()),
        ))
    }

    /// What the facts seen say about every version of `dataset` starting with `prefix`
    /// (their bits together).
    pub fn seen_prefix(
        &self,
        project: &str,
        dataset: &str,
        prefix: &str,
    ) -> Result<Seen, StateError> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(SEEN)?;
        let mut bits = 0;
        for row in table.range((project, dataset, prefix)..)? {
            let (k, v) = row?;
            let (p, d, version) = k.value();
            if p != project || d != dataset || !version.starts_with(prefix) {
                break;
            }
            bits |= v.value();
        }
        Ok(Seen(bits))
    }

    /// The declared version of an upload of `dataset` asked for and not answered yet whose
    /// version starts with `prefix`, with its request id.
    pub fn ingest_in_flight(
        &self,
        project: &str,
        dataset: &str,
        prefix: &str,
    ) -> Result<Option<(String, String)>, StateError> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(INGESTS)?;
        for row in table.range((project, dataset, "")..)? {
            let (k, v) = row?;
            let (p, d, request) = k.value();
            if p != project || d != dataset {
                break;
            }
            if v.value().starts_with(prefix) {
                return Ok(Some((request.to_owned(), v.value().to_owned())));
            }
        }
        Ok(None)
    }

    /// Every request not answered yet, with its record.
    pub fn waiting(&self) -> Result<Vec<RequestRecord>, StateError> {
        let txn = self.db.begin_read()?;
        let waits = txn.open_table(WAITS)?;
        let requests = txn.open_table(REQUESTS)?;
        let mut out = Vec::new();
        for row in waits.iter()? {
            let (k, _) = row?;
            let (project, _, id) = k.value();
            if let Some(v) = requests.get(request_key(project, id).as_str())? {
                let record: RequestRecord =
                    serde_json::from_slice(v.value()).map_err(undecodable)?;
                out.push(record);
            }
        }
        Ok(out)
    }
}

/// What one fact says, for [`State::note`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FactNote {
    pub project: String,
    pub dataset: String,
    /// Versions and the [`Seen`] bits the fact sets.
    pub seen: Vec<(String, u8)>,
    /// A shared-tier replica made (`true`) or removed (`false`): (tier, prefix, present).
    pub replica: Option<(String, String, bool)>,
    pub ingest: Option<IngestNote>,
}

/// An upload asked for, or answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IngestNote {
    Asked { request: String, declared: String },
    Answered { request: String },
}

/// The dataset a stage request names.
pub fn dataset_of(record: &RequestRecord) -> String {
    record.event.body.dataset().unwrap_or_default().to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagehand_schemas::{Body, StageRequested};

    fn request(id: &str, version: &str) -> RequestRecord {
        let event = Event::request(
            EventId::new(id).unwrap(),
            "lab-a",
            Body::StageRequested(StageRequested {
                dataset: "cats".into(),
                version: version.into(),
                tier: "hot".into(),
                job_id: "j1".into(),
                requested_by: "slurm".into(),
                deadline: None,
                node: None,
                form: None,
                hold_until: None,
            }),
        );
        RequestRecord {
            event,
            deadline: stagehand_schemas::now(),
            standing: Standing::Waiting {
                waiting_for: WaitingFor::Validation,
                reason: "new".into(),
            },
            answer: vec![],
            reserved: None,
        }
    }

    #[test]
    fn two_projects_requests_with_one_id_are_two_requests() {
        let dir = tempfile::tempdir().unwrap();
        let state = State::open(&dir.path().join("s.redb")).unwrap();
        let ours = request("r1", "aaaabbbbcccc");
        let mut theirs = ours.clone();
        theirs.event.project = "lab-b".into();
        state.accept(theirs.clone()).unwrap();
        let stored = state.accept(ours.clone()).unwrap();
        assert_eq!(
            stored.event.project, "lab-a",
            "the first stood for the second"
        );
        state
            .finish("lab-b", &theirs.event.id, Standing::Released, vec![])
            .unwrap();
        let ours_now = state.request("lab-a", &ours.event.id).unwrap().unwrap();
        assert!(!ours_now.standing.is_final(), "{:?}", ours_now.standing);
        assert_eq!(state.waiting().unwrap(), vec![ours_now]);
    }

    #[test]
    fn a_wait_is_refused_once_its_fact_was_noted_and_a_fact_lists_earlier_waits() {
        let dir = tempfile::tempdir().unwrap();
        let state = State::open(&dir.path().join("s.redb")).unwrap();
        let early = request("r1", "aaaabbbbcccc");
        let late = request("r2", "aaaabbbbcccc");
        state.accept(early.clone()).unwrap();
        state.accept(late.clone()).unwrap();
        let guard = WaitGuard::Validated {
            prefix: "aaaabbbbcccc".into(),
        };
        // Recorded before the fact: the fact lists it.
        assert!(
            state
                .wait(
                    "lab-a",
                    &early.event.id,
                    WaitingFor::Validation,
                    "x",
                    &guard
                )
                .unwrap()
        );
        let woken = state
            .note(&FactNote {
                project: "lab-a".into(),
                dataset: "cats".into(),
                seen: vec![(format!("aaaabbbbcccc{}", "d".repeat(52)), Seen::VALIDATED)],
                ..Default::default()
            })
            .unwrap();
        // Both are listed: an accepted request waits from the start.
        assert_eq!(
            woken.requests,
            vec![early.event.id.clone(), late.event.id.clone()]
        );
        // Recorded after the fact: refused, so the caller looks again.
        assert!(
            !state
                .wait("lab-a", &late.event.id, WaitingFor::Validation, "x", &guard)
                .unwrap()
        );
        // A wait for another version is not refused by it.
        let other = WaitGuard::Validated {
            prefix: "ffffbbbbcccc".into(),
        };
        assert!(
            state
                .wait("lab-a", &late.event.id, WaitingFor::Validation, "x", &other)
                .unwrap()
        );
        // Finishing ends the wait: the next fact no longer lists it.
        state
            .finish("lab-a", &early.event.id, Standing::Released, vec![])
            .unwrap();
        let woken = state
            .note(&FactNote {
                project: "lab-a".into(),
                dataset: "cats".into(),
                ..Default::default()
            })
            .unwrap();
        assert_eq!(woken.requests, vec![late.event.id.clone()]);
        assert_eq!(state.waiting().unwrap().len(), 1);
    }
}
