//! Where the ledger keeps an event: its key, scoped by project, kind and id.

use stagehand_schemas::{Event, EventId};
use time::OffsetDateTime;

use super::schema::micros;

/// Where the ledger keeps an event: `<project>/<kind>/<event id>`. Project tokens are
/// `[a-z0-9_-]`, kinds `[a-z.]` and ids `[A-Za-z0-9._:-]`, so no two (project, kind, id)
/// triples share a key: an event of one kind (a training job's checkpoint commit) can never
/// answer for another kind's with the same id (the validator's verdict of the same project).
///
/// Ledgers written before kinds were part of the key keyed an event `<project>/<event id>`.
/// Such a record still answers for a message the stream stored before this ledger began
/// scoping by kind (see [`Ledger::open`](super::Ledger::open)), never for a later one: an event finished before the
/// upgrade is not done twice, and nothing published after it can borrow an old record.
#[derive(Debug, Clone)]
pub struct EventKey {
    key: String,
    /// The key an earlier ledger used, and when the stream stored the message (µs since the
    /// epoch, the server's clock).
    pub(super) earlier: Option<(String, u64)>,
}

impl EventKey {
    pub fn new(project: &str, kind: &str, id: &EventId) -> Self {
        Self {
            key: format!("{project}/{kind}/{id}"),
            earlier: None,
        }
    }

    /// The key of `event` as delivered in a message the stream stored at `stored_at`.
    pub(crate) fn of_message(event: &Event, stored_at: OffsetDateTime) -> Self {
        Self {
            earlier: Some((earlier_key(&event.project, &event.id), micros(stored_at))),
            ..Self::new(&event.project, event.kind(), &event.id)
        }
    }

    pub fn as_str(&self) -> &str {
        &self.key
    }
}

/// The key ledgers written before kind-scoped keys gave `project`'s event `id`.
pub(super) fn earlier_key(project: &str, id: &EventId) -> String {
    format!("{project}/{id}")
}

impl PartialEq for EventKey {
    fn eq(&self, other: &Self) -> bool {
        self.key == other.key
    }
}

impl Eq for EventKey {}

impl std::hash::Hash for EventKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.key.hash(state);
    }
}

impl std::fmt::Display for EventKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.key)
    }
}
