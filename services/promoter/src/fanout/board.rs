//! The swarm's board in the KV bucket [`stagehand_bus::SWARMS_BUCKET`]: one bucket for every
//! version being fanned out, a key per fact, each written by the node it is about.
//!
//! - `swarm.<swarm>.claim.<piece>`: the node reading that piece from the shared tier. Created
//!   (never overwritten) by the first node to want it; renewed by its reader while it reads, so
//!   a claim left unrenewed for the swarm's patience belongs to a dead or stuck node and is
//!   taken over with a compare-and-set on the revision seen.
//! - `swarm.<swarm>.have.<piece>.<node>`: that node holds the piece, every file verified
//!   against the manifest, and serves it at the address the value names.
//! - `swarm.<swarm>.bad.<node>.<by>`: `node` served `by` bytes that did not verify. Written by
//!   `by`, the member that caught it, naming the file; `by` stops asking it, and every member
//!   does once [`REPORTS_TO_DROP`] members have caught it (one report could be a lie).
//!
//! Every key a node writes but a claim ends in its own name, and a node's NATS user may write
//! only those (`deploy/nats/accounts.conf`, `NODE_GPU_01`): a node cannot announce pieces for
//! another, withdraw another's, or report in another's name. A claim is anyone's to take over,
//! so a node could hold claims it never reads; a claim held by one node longer than its piece
//! could take at [`SLOWEST_CLAIMED_READ`] is read past ([`ClaimSeen::overheld`]), so such a node
//! costs its peers time, never a copy that does not finish.
//!
//! Patience is measured on this node's clock from when it saw a claim's revision, never from a
//! time another node wrote: nodes' clocks need not agree.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::kv::{self, Operation};
use bytes::Bytes;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use stagehand_bus::runner::consumer_token;
use tokio::sync::Notify;
use tracing::warn;

/// A board operation that failed (NATS unreachable, the bucket missing): the copy is retried.
#[derive(Debug, thiserror::Error)]
#[error("fan-out board {bucket}, key {key}: {detail}", bucket = stagehand_bus::SWARMS_BUCKET)]
pub struct BoardError {
    pub key: String,
    pub detail: String,
}

fn board_err(key: &str, e: impl std::fmt::Display) -> BoardError {
    BoardError {
        key: key.to_owned(),
        detail: e.to_string(),
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct ClaimValue {
    node: String,
}

#[derive(Debug, Serialize, Deserialize)]
struct HaveValue {
    addr: String,
}

/// Why a node was dropped from a swarm: the file it served and what was wrong with it. Who
/// caught it is the report's key ([`BadKey`]), which only that node may write.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Spoiled {
    pub file: String,
    pub why: String,
}

/// A report's key, `swarm.<swarm>.bad.<node>.<by>`: `node` served `by` bytes that did not
/// verify.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BadKey<'k> {
    pub swarm: &'k str,
    pub node: &'k str,
    pub by: &'k str,
}

impl<'k> BadKey<'k> {
    /// The report `key` names, or `None` for any other key of the board.
    pub fn parse(key: &'k str) -> Option<BadKey<'k>> {
        let mut parts = key.split('.');
        match (
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
        ) {
            (Some("swarm"), Some(swarm), Some("bad"), Some(node), Some(by), None) => {
                Some(BadKey { swarm, node, by })
            }
            _ => None,
        }
    }

    /// The key itself.
    pub fn key(&self) -> String {
        format!("swarm.{}.bad.{}.{}", self.swarm, self.node, self.by)
    }

    /// The pattern of every report naming node token `node`, on any swarm, by anyone.
    pub fn naming(node: &str) -> String {
        format!("swarm.*.bad.{node}.*")
    }
}

/// The slowest rate a node reading a claimed piece from the shared tier is waited for
/// (bytes/s), beyond the swarm's patience: a claim held longer than its piece takes at this
/// rate is read past by its peers, renewed or not.
pub const SLOWEST_CLAIMED_READ: u64 = 4 << 20;

/// Takes back every `have` key naming `node`, on every swarm: run as the node's agent starts,
/// when it serves nothing yet (what it held before it stopped is not registered again), so that
/// peers are not sent to ask it for pieces it no longer serves. Returns how many it took back.
pub async fn withdraw_everything_held(store: &kv::Store, node: &str) -> Result<usize, BoardError> {
    let pattern = format!("swarm.*.have.*.{}", consumer_token(node));
    let subjects = format!("{}{pattern}", store.prefix);
    let mut listed = store
        .stream
        .info_with_subjects(&subjects)
        .await
        .map_err(|e| board_err(&pattern, e))?;
    let mut keys = Vec::new();
    while let Some((subject, _)) = listed
        .next()
        .await
        .transpose()
        .map_err(|e| board_err(&pattern, e))?
    {
        if let Some(key) = subject.strip_prefix(&store.prefix) {
            keys.push(key.to_owned());
        }
    }
    let mut withdrawn = 0;
    for key in keys {
        // A subject lists a key's delete marker too: only a live announcement is taken back.
        let live = store
            .entry(key.as_str())
            .await
            .map_err(|e| board_err(&key, e))?;
        if live.is_some_and(|e| e.operation == Operation::Put) {
            store.delete(&key).await.map_err(|e| board_err(&key, e))?;
            withdrawn += 1;
        }
    }
    Ok(withdrawn)
}

/// Announces that `node` holds every piece `0..pieces` of `swarm`, served at `addr`: a replica
/// published here before this agent started, which it serves again ([`super::Fanout::serve_published`]).
pub async fn announce_all(
    store: &kv::Store,
    swarm: &str,
    node: &str,
    pieces: usize,
    addr: &str,
) -> Result<(), BoardError> {
    let me = consumer_token(node);
    let value: Bytes = have_value(addr);
    for piece in 0..pieces {
        let key = have_key(swarm, &me, piece);
        store
            .put(&key, value.clone())
            .await
            .map_err(|e| board_err(&key, e))?;
    }
    Ok(())
}

/// The key saying node token `me` holds `piece` of `swarm`.
fn have_key(swarm: &str, me: &str, piece: usize) -> String {
    format!("swarm.{swarm}.have.{piece}.{me}")
}

/// Its value: where the holder serves the piece.
fn have_value(addr: &str) -> Bytes {
    serde_json::to_vec(&HaveValue {
        addr: addr.to_owned(),
    })
    .expect("a holder serializes")
    .into()
}

/// A claim as this node saw it.
#[derive(Debug, Clone)]
pub struct ClaimSeen {
    pub node: String,
    pub revision: u64,
    /// When this node saw this revision: the claim is stale once it is older than the
    /// swarm's patience.
    pub seen: Instant,
    /// When this node first saw `node` holding it, across its renewals.
    pub held_since: Instant,
}

impl ClaimSeen {
    /// Whether its node has held it, renewed or not, longer than a read of `bytes` takes at
    /// [`SLOWEST_CLAIMED_READ`] after `patience`: a node that claims and never reads.
    pub fn overheld(&self, now: Instant, patience: Duration, bytes: u64) -> bool {
        let reading = Duration::from_secs_f64(bytes as f64 / SLOWEST_CLAIMED_READ as f64);
        now.duration_since(self.held_since) >= patience * 2 + reading
    }
}

/// What this node knows of the swarm, kept current by the board's watch.
#[derive(Debug, Default)]
pub struct View {
    pub claims: HashMap<usize, ClaimSeen>,
    /// Per piece: holder node → the address it serves at.
    pub holders: HashMap<usize, BTreeMap<String, String>>,
    /// Per node reported for serving bytes that did not verify: the nodes that caught it.
    pub bad: HashMap<String, HashSet<String>>,
    /// The watch ended: what this node knows is no longer current.
    pub broken: Option<String>,
}

/// How many members must have caught a node serving bad bytes before a member that did not
/// catch it itself stops asking it. One report could be a lie: any node may write a report in
/// its own name, and a node's credentials taken could drop every honest peer from every swarm
/// with one each. A member always stops asking a node it caught itself, and every member
/// verifies every byte whoever serves it, so a node that really serves bad bytes costs each
/// member at most one piece fetched again until two members have caught it.
pub const REPORTS_TO_DROP: usize = 2;

impl View {
    /// Whether the member `me` leaves `node` out: it caught `node` itself, or
    /// [`REPORTS_TO_DROP`] members did.
    pub fn dropped(&self, node: &str, me: &str) -> bool {
        self.bad
            .get(node)
            .is_some_and(|by| by.contains(me) || by.len() >= REPORTS_TO_DROP)
    }
}

/// One node's seat on one swarm's board.
pub struct Board {
    store: kv::Store,
    swarm: String,
    /// This node's key token.
    me: String,
    view: Arc<Mutex<View>>,
    changed: Arc<Notify>,
    watching: tokio::task::JoinHandle<()>,
}

impl Drop for Board {
    fn drop(&mut self) {
        self.watching.abort();
    }
}

impl Board {
    /// Takes this node's seat: the board as it stands, then every change, from one watch.
    pub async fn join(store: kv::Store, swarm: &str, node: &str) -> Result<Board, BoardError> {
        let filter = format!("swarm.{swarm}.>");
        let mut watch = store
            .watch_with_history(&filter)
            .await
            .map_err(|e| board_err(&filter, e))?;
        let view = Arc::new(Mutex::new(View::default()));
        let changed = Arc::new(Notify::new());
        let prefix = format!("swarm.{swarm}.");
        let watching = tokio::spawn({
            let (view, changed) = (view.clone(), changed.clone());
            async move {
                let broken = loop {
                    match watch.next().await {
                        Some(Ok(entry)) => {
                            if let Some(rest) = entry.key.strip_prefix(&prefix) {
                                apply(&mut lock(&view), rest, &entry);
                            }
                            changed.notify_one();
                        }
                        Some(Err(e)) => break e.to_string(),
                        None => break "the watch ended".to_owned(),
                    }
                };
                lock(&view).broken = Some(broken);
                changed.notify_one();
            }
        });
        Ok(Board {
            store,
            swarm: swarm.to_owned(),
            me: consumer_token(node),
            view,
            changed,
            watching,
        })
    }

    /// This node's key token (how the board names it).
    pub fn me(&self) -> &str {
        &self.me
    }

    /// The board as this node knows it now.
    pub fn view(&self) -> std::sync::MutexGuard<'_, View> {
        lock(&self.view)
    }

    /// Waits until the board changes or `at_most` passes.
    pub async fn changed(&self, at_most: Duration) {
        let _ = tokio::time::timeout(at_most, self.changed.notified()).await;
    }

    fn key(&self, what: &str) -> String {
        format!("swarm.{}.{what}", self.swarm)
    }

    fn value(&self) -> Bytes {
        serde_json::to_vec(&ClaimValue {
            node: self.me.clone(),
        })
        .expect("a claim serializes")
        .into()
    }

    /// Claims `piece` for reading from the shared tier: its revision when this node won it,
    /// `None` when another node claimed it first.
    pub async fn claim(&self, piece: usize) -> Result<Option<u64>, BoardError> {
        let key = self.key(&format!("claim.{piece}"));
        match self.store.create(&key, self.value()).await {
            Ok(rev) => Ok(Some(rev)),
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => Ok(None),
            Err(e) => Err(board_err(&key, e)),
        }
    }

    /// Takes over a claim last seen at `revision` (its node dead, stuck, or dropped): the new
    /// revision, or `None` when someone changed it meanwhile.
    pub async fn take_over(&self, piece: usize, revision: u64) -> Result<Option<u64>, BoardError> {
        let key = self.key(&format!("claim.{piece}"));
        match self.store.update(&key, self.value(), revision).await {
            Ok(rev) => Ok(Some(rev)),
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => Ok(None),
            Err(e) => Err(board_err(&key, e)),
        }
    }

    /// What renews this node's claim of `piece` while it reads it (see [`Renewer::holding`]).
    pub fn renewer(&self, piece: usize) -> Renewer {
        Renewer {
            store: self.store.clone(),
            key: self.key(&format!("claim.{piece}")),
            value: self.value(),
        }
    }

    /// Says this node holds `piece`, verified, served at `addr`.
    pub async fn announce(&self, piece: usize, addr: &str) -> Result<(), BoardError> {
        let key = have_key(&self.swarm, &self.me, piece);
        self.store
            .put(&key, have_value(addr))
            .await
            .map(drop)
            .map_err(|e| board_err(&key, e))
    }

    /// Takes back this node's word on `pieces` (its staging folder was discarded).
    pub async fn withdraw(&self, pieces: impl IntoIterator<Item = usize>) {
        for piece in pieces {
            let key = have_key(&self.swarm, &self.me, piece);
            if let Err(e) = self.store.delete(&key).await {
                warn!(error = %e, %key, "a piece this node no longer holds is still announced; its peers find it gone and read elsewhere");
            }
        }
    }

    /// Drops `node` from the swarm for this member, and reports it to the others.
    pub async fn spoiled(&self, node: &str, why: &Spoiled) -> Result<(), BoardError> {
        let key = BadKey {
            swarm: &self.swarm,
            node,
            by: &self.me,
        }
        .key();
        let value = serde_json::to_vec(why).expect("a report serializes");
        (lock(&self.view).bad.entry(node.to_owned()).or_default()).insert(self.me.clone());
        self.store
            .put(&key, value.into())
            .await
            .map(drop)
            .map_err(|e| board_err(&key, e))
    }
}

/// Renews one claim of this node while its piece is read.
pub struct Renewer {
    store: kv::Store,
    key: String,
    value: Bytes,
}

impl Renewer {
    /// Runs `work`, renewing the claim (held at `revision`) every `every` meanwhile, so that
    /// peers see its reader alive. A renewal refused (the claim taken over: this node looked
    /// dead) or failed only stops the renewals: the piece is read all the same.
    pub async fn holding<T>(
        self,
        mut revision: u64,
        every: Duration,
        work: impl std::future::Future<Output = T>,
    ) -> T {
        tokio::pin!(work);
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        let mut renewing = true;
        loop {
            tokio::select! {
                done = &mut work => return done,
                _ = tick.tick(), if renewing => {
                    match self.store.update(&self.key, self.value.clone(), revision).await {
                        Ok(rev) => revision = rev,
                        Err(e) => {
                            warn!(error = %e, key = %self.key, "fan-out: a claim could not be renewed; peers may read the piece too");
                            renewing = false;
                        }
                    }
                }
            }
        }
    }
}

fn lock(view: &Mutex<View>) -> std::sync::MutexGuard<'_, View> {
    view.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Folds one board entry (`rest` is its key after `swarm.<swarm>.`) into `view`.
fn apply(view: &mut View, rest: &str, entry: &kv::Entry) {
    let gone = matches!(entry.operation, Operation::Delete | Operation::Purge);
    let mut parts = rest.split('.');
    match (parts.next(), parts.next(), parts.next()) {
        (Some("claim"), Some(piece), None) => {
            let Ok(piece) = piece.parse() else { return };
            if gone {
                view.claims.remove(&piece);
                return;
            }
            let Ok(claim) = serde_json::from_slice::<ClaimValue>(&entry.value) else {
                return;
            };
            let now = Instant::now();
            let held_since = match view.claims.get(&piece) {
                Some(seen) if seen.node == claim.node => seen.held_since,
                _ => now,
            };
            view.claims.insert(
                piece,
                ClaimSeen {
                    node: claim.node,
                    revision: entry.revision,
                    seen: now,
                    held_since,
                },
            );
        }
        (Some("have"), Some(piece), Some(node)) => {
            let Ok(piece) = piece.parse() else { return };
            let holders = view.holders.entry(piece).or_default();
            if gone {
                holders.remove(node);
                return;
            }
            if let Ok(have) = serde_json::from_slice::<HaveValue>(&entry.value) {
                holders.insert(node.to_owned(), have.addr);
            }
        }
        (Some("bad"), Some(node), Some(by)) if !gone => {
            (view.bad.entry(node.to_owned()).or_default()).insert(by.to_owned());
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A member leaves out a node it caught itself at once, and a node another caught only
    /// once a second member has caught it too: one node's word drops nobody for the others.
    #[test]
    fn one_report_drops_a_node_for_its_reporter_alone_and_two_for_everyone() {
        let mut view = View::default();
        let report = |view: &mut View, node: &str, by: &str| {
            (view.bad.entry(node.to_owned()).or_default()).insert(by.to_owned());
        };
        assert!(!view.dropped("n1", "n2"));
        report(&mut view, "n1", "n3");
        assert!(view.dropped("n1", "n3"), "its reporter leaves it out");
        assert!(
            !view.dropped("n1", "n2"),
            "one report is not enough for the others"
        );
        report(&mut view, "n1", "n3");
        assert!(
            !view.dropped("n1", "n2"),
            "the same reporter twice is one report"
        );
        report(&mut view, "n1", "n4");
        assert!(view.dropped("n1", "n2"), "two members caught it");
        assert!(!view.dropped("n5", "n2"), "another node is untouched");
    }

    #[test]
    fn a_report_key_names_its_swarm_node_and_reporter() {
        let key = BadKey {
            swarm: "s",
            node: "n1",
            by: "n2",
        };
        assert_eq!(key.key(), "swarm.s.bad.n1.n2");
        assert_eq!(BadKey::parse(&key.key()), Some(key));
        for other in [
            "swarm.s.bad.n1",
            "swarm.s.have.0.n1",
            "swarm.s.bad.n1.n2.x",
            "x.s.bad.n1.n2",
        ] {
            assert_eq!(BadKey::parse(other), None, "{other}");
        }
    }
}
