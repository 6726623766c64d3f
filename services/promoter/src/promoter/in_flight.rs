//! What this process is doing right now: the copies running here and the requests being
//! moved on, each held by a guard that lets go when dropped, whatever happened.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use crate::state::RequestRecord;
use stagehand_schemas::EventId;

use super::Promoter;

/// Removes a key from a set when dropped.
pub(super) struct Held<'a, T: std::hash::Hash + Eq + Clone> {
    set: &'a Mutex<HashSet<T>>,
    key: T,
}

impl<'a, T: std::hash::Hash + Eq + Clone> Held<'a, T> {
    pub(super) fn take(set: &'a Mutex<HashSet<T>>, key: T) -> Option<Held<'a, T>> {
        let mut s = set.lock().unwrap_or_else(|p| p.into_inner());
        s.insert(key.clone()).then(|| Held { set, key })
    }
}

impl<T: std::hash::Hash + Eq + Clone> Drop for Held<'_, T> {
    fn drop(&mut self) {
        self.set
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.key);
    }
}

/// A request: its project and its id (another project's request may carry the same id).
pub(super) type RequestKey = (String, EventId);

pub(super) fn request_key(record: &RequestRecord) -> RequestKey {
    (record.event.project.clone(), record.event.id.clone())
}

/// A request this process is moving on; dropped (whatever happened) it is free again.
pub(super) struct Active<'a> {
    map: &'a Mutex<HashMap<RequestKey, bool>>,
    id: RequestKey,
}

impl<'a> Active<'a> {
    /// Marks `id` active, or, when it already is, asks its driver to look again.
    pub(super) fn take(
        map: &'a Mutex<HashMap<RequestKey, bool>>,
        id: &RequestKey,
    ) -> Option<Active<'a>> {
        let mut m = map.lock().unwrap_or_else(|p| p.into_inner());
        match m.get_mut(id) {
            Some(again) => {
                *again = true;
                None
            }
            None => {
                m.insert(id.clone(), false);
                Some(Active {
                    map,
                    id: id.clone(),
                })
            }
        }
    }

    /// Whether another driver asked for `id` since it was taken (clearing the mark).
    pub(super) fn asked_again(map: &Mutex<HashMap<RequestKey, bool>>, id: &RequestKey) -> bool {
        let mut m = map.lock().unwrap_or_else(|p| p.into_inner());
        m.get_mut(id)
            .is_some_and(|again| std::mem::replace(again, false))
    }
}

impl Drop for Active<'_> {
    fn drop(&mut self) {
        self.map
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.id);
    }
}

impl Promoter {
    /// The key of a copy of `prefix` onto `tier` (and `node`) in the in-process copy table.
    pub(super) fn copy_key(tier: &str, node: Option<&str>, prefix: &str) -> String {
        format!("{tier}|{}|{prefix}", node.unwrap_or(""))
    }
}
