//! The promoter's work: a stage request moved as far as it can go now — failed, waiting,
//! ready at once, or copied and then ready — by whichever of its three drivers gets to it
//! first: the request's own message, a fact that wakes it, or the policy clock.
//!
//! Every answer is a fact with an id derived from the request (`pending:<waiting_for>`,
//! `ready`, `failed`, `replica:<tier>[:<node>]`), recorded in the state store before it is published,
//! so any driver may publish it again without harm (the duplicate window drops the copy).

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use stagehand_bus::placement::{self, Served, UseState};
use stagehand_bus::{Bus, HandlerError, WorkContext};
use stagehand_catalogue::Catalogue;
use stagehand_manifest::{Manifest, ManifestBuilder, ManifestErrorKind, ManifestStore, Spool};
use stagehand_mover::{
    CopyOptions, ErrorKind, Mover, Progress, Scheduler, SetCopy, Tier, TransferError,
};
use stagehand_policy::{Policies, PromotionPolicy, TierPolicy, TierRole};
use stagehand_schemas::layout;
use stagehand_schemas::progress::{WorkProgress, progress_subject};
use stagehand_schemas::subject::MANIFEST_BUCKET;
use stagehand_schemas::{
    Body, Event, EventId, Location, ManifestRef, ReplicaCreated, StageFailed, StagePending,
    StageReady, StageRequested,
};
use time::OffsetDateTime;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::kv::{Coordination, LeaseState, Limits, Refused};
use crate::resolve::{self, Decision, Plan};
use crate::state::{
    FactNote, IngestNote, RequestRecord, Seen, Standing, State, WaitGuard, WaitingFor,
};

/// How long a copy that failed for good answers the requests that waited for it.
const FAILED_COPY_REMEMBERED: Duration = Duration::from_secs(60);

/// The fact-id steps.
pub const STEP_READY: &str = "ready";
pub const STEP_FAILED: &str = "failed";

/// The step of a `stage.pending` fact for what the request waits for.
pub fn step_pending(waiting_for: WaitingFor) -> String {
    format!("pending:{}", waiting_for.as_str())
}

/// The step of a `replica.created` fact for a tier (and node).
pub fn step_replica(tier: &str, node: Option<&str>) -> String {
    match node {
        Some(n) => format!("replica:{tier}:{n}"),
        None => format!("replica:{tier}"),
    }
}

/// What the promoter needs, built once at start.
pub struct Parts {
    pub bus: Bus,
    pub catalogue: Catalogue,
    pub policies: Policies,
    pub promotion: PromotionPolicy,
    /// Every declared tier, opened.
    pub tiers: HashMap<String, Tier>,
    pub node: Option<String>,
    pub state: State,
    pub coordination: Coordination,
    pub mover: Mover,
    pub spool: Spool,
    pub progress_every: Duration,
    pub shutdown: CancellationToken,
    /// This instance's consumers of facts and uploads, (stream, durable name): what it has
    /// seen of versions and uploads in flight is complete up to now only once both have
    /// handled everything stored.
    pub watched: Vec<(&'static str, String)>,
}

/// The promoter. Clones share everything.
#[derive(Clone)]
pub struct Promoter {
    inner: Arc<Inner>,
}

struct Inner {
    parts: Parts,
    /// Copy slots (`max_concurrent`), granted by priority class.
    slots: Scheduler,
    /// Copies running in this process, by (tier, node, prefix).
    copies: Mutex<HashSet<String>>,
    /// Requests being moved on in this process right now, and whether another driver asked
    /// for it meanwhile (then the one moving it looks again when it is done: no wake-up is
    /// lost to a request being busy).
    active: Mutex<HashMap<RequestKey, bool>>,
    /// Copies that failed for good here lately, by copy key: the requests that waited for
    /// them get the same answer instead of each copying the same damaged source again.
    failed: Mutex<HashMap<String, (String, bool, Instant)>>,
    /// Tells the clock a new wait (with perhaps an earlier deadline) was recorded.
    clock: Notify,
}

/// Removes a key from a set when dropped.
struct Held<'a, T: std::hash::Hash + Eq + Clone> {
    set: &'a Mutex<HashSet<T>>,
    key: T,
}

impl<'a, T: std::hash::Hash + Eq + Clone> Held<'a, T> {
    fn take(set: &'a Mutex<HashSet<T>>, key: T) -> Option<Held<'a, T>> {
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
type RequestKey = (String, EventId);

fn request_key(record: &RequestRecord) -> RequestKey {
    (record.event.project.clone(), record.event.id.clone())
}

/// A request this process is moving on; dropped (whatever happened) it is free again.
struct Active<'a> {
    map: &'a Mutex<HashMap<RequestKey, bool>>,
    id: RequestKey,
}

impl<'a> Active<'a> {
    /// Marks `id` active, or, when it already is, asks its driver to look again.
    fn take(map: &'a Mutex<HashMap<RequestKey, bool>>, id: &RequestKey) -> Option<Active<'a>> {
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
    fn asked_again(map: &Mutex<HashMap<RequestKey, bool>>, id: &RequestKey) -> bool {
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

/// A failure that asking again later can fix (the catalogue or NATS did not answer, a tier
/// was unreachable, the catalogue lags a fact): the message is retried, the clock looks again.
fn retry(why: impl std::fmt::Display) -> HandlerError {
    HandlerError::retryable(why.to_string())
}

fn stage_request(event: &Event) -> Option<&StageRequested> {
    match &event.body {
        Body::StageRequested(r) => Some(r),
        _ => None,
    }
}

impl Promoter {
    pub fn new(parts: Parts) -> Promoter {
        let slots = Scheduler::new(parts.promotion.max_concurrent as usize);
        Promoter {
            inner: Arc::new(Inner {
                parts,
                slots,
                copies: Mutex::default(),
                active: Mutex::default(),
                failed: Mutex::default(),
                clock: Notify::new(),
            }),
        }
    }

    fn p(&self) -> &Parts {
        &self.inner.parts
    }

    /// Whether this instance's consumers of facts and uploads have handled and acked every
    /// message stored so far (false while one cannot be asked, or does not exist yet).
    async fn caught_up(&self) -> bool {
        let js = self.p().bus.jetstream();
        for (stream, consumer) in &self.p().watched {
            let Ok(stream) = js.get_stream(*stream).await else {
                return false;
            };
            match stream.clone().consumer_info(consumer.as_str()).await {
                Ok(info) if info.num_pending == 0 && info.num_ack_pending == 0 => {}
                _ => return false,
            }
        }
        true
    }

    /// The node this promoter is the agent of, if it is one.
    pub fn node(&self) -> Option<&str> {
        self.p().node.as_deref()
    }

    fn tier_policy(&self, name: &str) -> Option<&TierPolicy> {
        self.p().policies.tier(name)
    }

    /// Whether this promoter answers requests for `tier` on `node`: the shared promoter
    /// answers every tier but `local` ones (unknown tiers included, to say so); a node agent
    /// answers its own node's `local` requests only.
    pub fn answers(&self, tier: &str, node: Option<&str>) -> bool {
        let local = self
            .tier_policy(tier)
            .is_some_and(|t| t.role == TierRole::Local);
        match self.node() {
            None => !local,
            Some(mine) => local && node == Some(mine),
        }
    }

    /// Handles a `stage.requested` or `stage.released` message.
    pub async fn on_request(
        &self,
        event: &Event,
        ctx: Option<&WorkContext>,
    ) -> Result<Vec<Event>, HandlerError> {
        match &event.body {
            Body::StageRequested(r) => {
                if !self.answers(&r.tier, r.node.as_deref()) {
                    return Ok(Vec::new());
                }
                let deadline = r.deadline.unwrap_or_else(|| {
                    stagehand_schemas::now()
                        + time::Duration::try_from(self.p().promotion.default_deadline)
                            .unwrap_or(time::Duration::HOUR)
                });
                let record = self.p().state.accept(RequestRecord {
                    event: event.clone(),
                    deadline,
                    standing: Standing::Waiting {
                        waiting_for: WaitingFor::Copy,
                        reason: "received".into(),
                    },
                    answer: Vec::new(),
                    reserved: None,
                })?;
                self.advance(record, ctx).await
            }
            Body::StageReleased(r) => {
                if !self.answers(&r.tier, r.node.as_deref()) {
                    return Ok(Vec::new());
                }
                let exact = EventId::for_stage(
                    &event.project,
                    &r.job_id,
                    &r.dataset,
                    &r.version,
                    &r.tier,
                    r.node.as_deref(),
                );
                // The request the release names however either spelled the version. A
                // replica stays on the tier until the demoter reclaims it; the release only
                // ends the request (a waiting one stops waiting) and gives back the space of a
                // copy it reserved and never placed.
                for id in self.p().state.released_by(&event.project, &exact, r)? {
                    if let Some(record) = self.p().state.finish(
                        &event.project,
                        &id,
                        Standing::Released,
                        Vec::new(),
                    )? {
                        info!(request = %id, release = %event.id, "stage released");
                        self.give_back(&record, "its job released it").await;
                    }
                }
                Ok(Vec::new())
            }
            other => Err(HandlerError::permanent(format!(
                "the promoter's request consumer handles stage.requested and stage.released, not {}",
                other.kind()
            ))),
        }
    }

    /// Handles a fact (or an ingest request) that may wake waiting requests.
    pub async fn on_fact(
        &self,
        event: &Event,
        ctx: Option<&WorkContext>,
    ) -> Result<Vec<Event>, HandlerError> {
        let project = event.project.clone();
        let note = match &event.body {
            Body::DatasetValidated(p) => FactNote {
                project,
                dataset: p.dataset.clone(),
                seen: vec![(p.version.clone(), Seen::VALIDATED)],
                replica: None,
                ingest: Some(IngestNote::Answered {
                    request: p.request_id.to_string(),
                }),
            },
            Body::DatasetPrepared(p) => FactNote {
                project,
                dataset: p.dataset.clone(),
                seen: vec![
                    (p.version.clone(), Seen::PREPARED),
                    (p.derived_from.clone(), Seen::HAS_PREPARED),
                ],
                replica: None,
                ingest: None,
            },
            Body::DatasetRejected(p) => FactNote {
                project,
                dataset: p.dataset.clone(),
                seen: vec![(p.declared_version.clone(), Seen::REJECTED)],
                replica: None,
                ingest: Some(IngestNote::Answered {
                    request: p.request_id.to_string(),
                }),
            },
            Body::ReplicaCreated(p) => FactNote {
                project,
                dataset: p.dataset.clone(),
                replica: self
                    .follows(&p.location.tier, p.node.as_deref())
                    .then(|| (p.location.tier.clone(), p.location.prefix.clone(), true)),
                ..FactNote::default()
            },
            Body::ReplicaRemoved(p) => {
                let node = p.node.as_deref();
                let follows = self.follows(&p.location.tier, node);
                if follows && node.is_some() && self.node() == node {
                    // The space it held is free again once the folder is gone (that node's
                    // agent sees it). The demoter gives back the space it marked itself
                    // (`stagehand_bus::placement`); this gives back an unmarked one, and only
                    // when no copy and no live request of this node holds it — never a
                    // reservation a new copy made since.
                    self.reclaim(
                        &p.location.tier,
                        node,
                        &p.location.prefix,
                        "replica.removed names it",
                    )
                    .await?;
                }
                FactNote {
                    project,
                    dataset: p.dataset.clone(),
                    replica: follows
                        .then(|| (p.location.tier.clone(), p.location.prefix.clone(), false)),
                    ..FactNote::default()
                }
            }
            Body::IngestRequested(p) => {
                let declared = match stagehand_manifest::ManifestSource::of(event) {
                    Ok(Some(source)) => source.digest(),
                    // A malformed request is the validator's to reject; nothing to note.
                    _ => return Ok(Vec::new()),
                };
                FactNote {
                    project,
                    dataset: p.dataset.clone(),
                    ingest: Some(IngestNote::Asked {
                        request: event.id.to_string(),
                        declared,
                    }),
                    ..FactNote::default()
                }
            }
            _ => return Ok(Vec::new()),
        };
        let woken = self.p().state.note(&note)?;
        if woken.requests.is_empty() {
            return Ok(Vec::new());
        }
        debug!(fact = %event.id, woken = woken.requests.len(), "fact wakes waiting requests");
        let project = event.project.as_str();
        let runs = woken.requests.iter().map(|id| async move {
            match self.p().state.request(project, id)? {
                Some(record) => Box::pin(self.advance(record, ctx)).await,
                None => Ok(Vec::new()),
            }
        });
        let mut facts = Vec::new();
        let mut first_error = None;
        for r in futures::future::join_all(runs).await {
            match r {
                Ok(f) => facts.extend(f),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(facts),
        }
    }

    /// Whether `tier` is a shared bounded tier (hot): one whose replicas are told apart by
    /// tier and prefix alone.
    fn shared(&self, tier: &str) -> bool {
        self.tier_policy(tier)
            .is_some_and(|t| t.role == TierRole::Hot)
    }

    /// Whether this instance keeps track of the replicas a fact names on `tier` (on `node`):
    /// every instance those of the shared tiers (a node agent copies from them), a node agent
    /// those of its own node's `local` tier, which is the only copy there it may use.
    fn follows(&self, tier: &str, node: Option<&str>) -> bool {
        match node {
            None => self.shared(tier),
            Some(n) => {
                self.node() == Some(n)
                    && self
                        .tier_policy(tier)
                        .is_some_and(|t| t.role == TierRole::Local)
            }
        }
    }

    /// Moves one request on as far as it can go now; returns the facts it published. A
    /// request another driver is moving on right now is marked to be looked at again by it.
    pub async fn advance(
        &self,
        record: RequestRecord,
        ctx: Option<&WorkContext>,
    ) -> Result<Vec<Event>, HandlerError> {
        if record.standing.is_final() {
            return Ok(record.answer);
        }
        let id = request_key(&record);
        let Some(_active) = Active::take(&self.inner.active, &id) else {
            return Ok(Vec::new());
        };
        let mut record = record;
        loop {
            let result = self.advance_once(record, ctx).await;
            if !Active::asked_again(&self.inner.active, &id) {
                return result;
            }
            match self.p().state.request(&id.0, &id.1) {
                Ok(Some(next)) if !next.standing.is_final() => record = next,
                _ => return result,
            }
        }
    }

    async fn advance_once(
        &self,
        record: RequestRecord,
        ctx: Option<&WorkContext>,
    ) -> Result<Vec<Event>, HandlerError> {
        let Some(request) = stage_request(&record.event).cloned() else {
            return Err(HandlerError::permanent("not a stage request"));
        };
        // A request whose deadline passed (while its promoter was down, say) is not started
        // again: it fails, and gives back what it reserved.
        if OffsetDateTime::now_utc() >= record.deadline {
            return self.deadline_passed(&record).await;
        }
        if let Some(reason) = self.check(&request) {
            return self.fail(&record, reason, false).await;
        }
        let form_prepared = request.form.as_deref() == Some("prepared");
        let role = self
            .tier_policy(&request.tier)
            .map(|t| t.role)
            .unwrap_or(TierRole::Hot);
        let ingest_in_flight = self.p().state.ingest_in_flight(
            &record.event.project,
            &request.dataset,
            &request.version,
        )?;
        let cx = resolve::Context {
            catalogue: &self.p().catalogue,
            project: &record.event.project,
            dataset: &request.dataset,
            version: &request.version,
            prepared: form_prepared,
            sources: self.p().promotion.sources_for(role),
            packing: self.p().policies.packing(),
            priority: self.p().promotion.priority_for(&request.dataset),
            ingest_in_flight,
            seen: self.p().state.seen_prefix(
                &record.event.project,
                &request.dataset,
                &request.version,
            )?,
        };
        let decision = resolve::decide(&cx).await.map_err(retry)?;
        match decision {
            Decision::Fail { reason, retryable } => self.fail(&record, reason, retryable).await,
            Decision::Unknown { reason } => {
                // Looked at again once this instance has handled everything stored: the fact
                // or upload naming the version may have come in since the catalogue was asked
                // (then the next attempt finds it, or waits for it).
                let unknown = self.caught_up().await
                    && !self
                        .p()
                        .state
                        .seen_prefix(&record.event.project, &request.dataset, &request.version)?
                        .has(Seen::VALIDATED | Seen::PREPARED | Seen::REJECTED)
                    && self
                        .p()
                        .state
                        .ingest_in_flight(
                            &record.event.project,
                            &request.dataset,
                            &request.version,
                        )?
                        .is_none();
                if !unknown {
                    return Err(retry(format!(
                        "{reason} — not answered yet: this promoter has not handled every fact and upload stored so far"
                    )));
                }
                self.fail(&record, reason, true).await
            }
            Decision::Wait {
                waiting_for,
                reason,
                guard,
            } => self.wait(&record, waiting_for, reason, guard).await,
            // Boxed: the copy's future is large and deep; the common answers stay small.
            Decision::Stage(plan) => Box::pin(self.stage(&record, &request, plan, ctx)).await,
        }
    }

    /// What is wrong with a request on its face, if anything.
    fn check(&self, r: &StageRequested) -> Option<String> {
        if let Err(e) = layout::check_dataset_name(&r.dataset)
            .and_then(|()| layout::check_version_prefix(&r.version, layout::MIN_VERSION_PREFIX))
        {
            return Some(e.to_string());
        }
        let Some(tier) = self.tier_policy(&r.tier) else {
            return Some(format!("tier {:?} is not declared in tiers.toml", r.tier));
        };
        match (tier.role, &r.node) {
            (TierRole::Hot, None) | (TierRole::Local, Some(_)) => {}
            (TierRole::Local, None) => {
                return Some(format!(
                    "tier {:?} is node-local: the request must name the node",
                    r.tier
                ));
            }
            (TierRole::Hot, Some(n)) => {
                return Some(format!(
                    "tier {:?} is shared: the request must not name a node (it names {n:?})",
                    r.tier
                ));
            }
            (role, _) => {
                return Some(format!(
                    "tier {:?} has role {:?}; stage requests go to a hot or local tier",
                    r.tier,
                    role.as_str()
                ));
            }
        }
        match r.form.as_deref() {
            None | Some("raw") | Some("prepared") => None,
            Some(other) => Some(format!("form {other:?} is not one of raw, prepared")),
        }
    }

    /// Answers `stage.failed`.
    async fn fail(
        &self,
        record: &RequestRecord,
        reason: String,
        retryable: bool,
    ) -> Result<Vec<Event>, HandlerError> {
        let r = stage_request(&record.event).expect("a stage request");
        info!(request = %record.event.id, dataset = %r.dataset, version = %r.version, %reason, "stage failed");
        let fact = record.event.caused(
            STEP_FAILED,
            Body::StageFailed(StageFailed {
                dataset: r.dataset.clone(),
                version: r.version.clone(),
                tier: r.tier.clone(),
                job_id: r.job_id.clone(),
                request_id: record.event.id.clone(),
                reason: reason.clone(),
                retryable,
                node: r.node.clone(),
            }),
        );
        self.answer(record, Standing::Failed { reason, retryable }, vec![fact])
            .await
    }

    /// Records a final answer, then publishes it (a request already answered keeps, and
    /// publishes again, its first answer).
    async fn answer(
        &self,
        record: &RequestRecord,
        standing: Standing,
        facts: Vec<Event>,
    ) -> Result<Vec<Event>, HandlerError> {
        let first = !record.standing.is_final();
        let stored =
            self.p()
                .state
                .finish(&record.event.project, &record.event.id, standing, facts)?;
        if first && let Some(r) = &stored {
            record_answer(r);
            // The clock recounts the requests still waiting (stagehand_stages).
            self.inner.clock.notify_one();
        }
        if let Some(r) = &stored
            && matches!(r.standing, Standing::Failed { .. } | Standing::Released)
        {
            self.give_back(r, "the request failed").await;
        }
        let stored = stored.map(|r| r.answer).unwrap_or_default();
        self.emit(&stored).await?;
        Ok(stored)
    }

    /// Gives back the space a request that ended without its replica reserved, and removes its
    /// hidden staging folder ([`Promoter::reclaim`]); a failure to is logged, and the
    /// reconciler gives it back later.
    async fn give_back(&self, record: &RequestRecord, why: &str) {
        let (Some(prefix), Some(r)) = (&record.reserved, record.stage()) else {
            return;
        };
        let why = format!("request {} ended: {why}", record.event.id);
        if let Err(e) = self.reclaim(&r.tier, r.node.as_deref(), prefix, &why).await {
            warn!(request = %record.event.id, %prefix, error = %e, "reservation not given back yet; the reconciler gives it back");
        }
    }

    /// The key of a copy of `prefix` onto `tier` (and `node`) in the in-process copy table.
    fn copy_key(tier: &str, node: Option<&str>, prefix: &str) -> String {
        format!("{tier}|{}|{prefix}", node.unwrap_or(""))
    }

    /// Gives back the space reserved for the replica at `prefix` on `tier` (and `node`) and
    /// removes its hidden staging folder, unless something still justifies them: the replica
    /// is on the tier, a copy of it runs in this process, a request of this instance still
    /// waiting (its deadline ahead) reserved it, or another instance holds its copy lease. The
    /// decision is taken under the copy lease of the prefix — the lease every reservation of
    /// an absent replica is made under — so no reserve on any instance runs meanwhile, and the
    /// release itself is a compare-and-set on the revision it read. A reservation the demoter
    /// marked is left to the demoter. Returns whether a reservation was given back.
    pub async fn reclaim(
        &self,
        tier: &str,
        node: Option<&str>,
        prefix: &str,
        why: &str,
    ) -> Result<bool, HandlerError> {
        let Some(dst) = self.p().tiers.get(tier) else {
            return Ok(false);
        };
        if dst.set_present(prefix).await.map_err(retry)? {
            return Ok(false);
        }
        let Some(_copying) = Held::take(&self.inner.copies, Self::copy_key(tier, node, prefix))
        else {
            return Ok(false);
        };
        if self
            .p()
            .state
            .reserved_by_live_request(tier, node, prefix, OffsetDateTime::now_utc())?
        {
            return Ok(false);
        }
        let coord = &self.p().coordination;
        let revision = match coord
            .lease(tier, node, prefix, RECLAIM_LEASE)
            .await
            .map_err(retry)?
        {
            LeaseState::Owned(rev) => rev,
            LeaseState::Held { .. } => return Ok(false),
        };
        let result = async {
            // Under the lease no copy of it runs anywhere: absent now, absent until it ends.
            if dst.set_present(prefix).await.map_err(retry)? {
                return Ok(false);
            }
            // The folder first: a crash in between leaves a reservation the next pass finds.
            discard_staging(dst, prefix).await;
            coord.release(tier, node, prefix).await.map_err(retry)
        }
        .await;
        if let Err(e) = coord.end_lease(tier, node, prefix, revision).await {
            debug!(error = %e, "reconciler's copy lease not ended; it ages out");
        }
        if let Ok(true) = result {
            info!(%tier, node = node.unwrap_or("-"), %prefix, %why, "reservation with no live request and no replica released; its staging folder removed");
            // A request that found the copy table taken meanwhile is looked at again now.
            let mut parts = prefix.splitn(3, '/');
            if let (Some(project), Some(dataset)) = (parts.next(), parts.next()) {
                self.wake_dataset(project, dataset, None);
            }
        }
        result
    }

    /// The tiers (and node) whose space this promoter reserves: the shared promoter's hot
    /// tiers, a node agent's own node's local tiers.
    fn bounded_places(&self) -> Vec<(String, Option<String>)> {
        let mut places: Vec<(String, Option<String>)> = self
            .p()
            .tiers
            .keys()
            .filter_map(|name| {
                let role = self.tier_policy(name)?.role;
                match (self.node(), role) {
                    (None, TierRole::Hot) => Some((name.clone(), None)),
                    (Some(n), TierRole::Local) => Some((name.clone(), Some(n.to_owned()))),
                    _ => None,
                }
            })
            .collect();
        places.sort();
        places
    }

    /// One pass of the reconciler: every reservation on this promoter's tiers with neither a
    /// live request nor a replica is given back (and logged), its staging folder removed
    /// ([`Promoter::reclaim`]); those the demoter marked are its own. Returns how many.
    pub async fn reconcile(&self) -> Result<usize, HandlerError> {
        let mut released = 0;
        for (tier, node) in self.bounded_places() {
            let (reserved, _) = self
                .p()
                .coordination
                .reservations(&tier, node.as_deref())
                .await
                .map_err(retry)?;
            for prefix in reserved.replicas.keys() {
                if self.p().shutdown.is_cancelled() {
                    return Ok(released);
                }
                if reserved.withdrawing.contains(prefix) {
                    continue;
                }
                if self
                    .reclaim(
                        &tier,
                        node.as_deref(),
                        prefix,
                        "the reconciler found no live request and no replica",
                    )
                    .await?
                {
                    released += 1;
                }
            }
        }
        Ok(released)
    }

    /// Reconciles reservations at start and every `reconcile_every` until shutdown.
    pub async fn reconciler(self) -> Result<(), HandlerError> {
        let every = self.p().promotion.reconcile_every;
        loop {
            match self.reconcile().await {
                Ok(0) => debug!("reservations reconciled: none to give back"),
                Ok(n) => info!(released = n, "reservations reconciled"),
                Err(e) => {
                    warn!(error = %e, "reconciling reservations failed; the next pass tries again")
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = self.p().shutdown.cancelled() => return Ok(()),
            }
        }
    }

    async fn emit(&self, facts: &[Event]) -> Result<(), HandlerError> {
        for fact in facts {
            self.p()
                .bus
                .publish(fact)
                .await
                .map_err(|e| retry(format!("publishing {}: {e}", fact.kind())))?;
        }
        Ok(())
    }

    /// Records a wait and answers `stage.pending`, or fails when the deadline has passed.
    async fn wait(
        &self,
        record: &RequestRecord,
        waiting_for: WaitingFor,
        reason: String,
        guard: WaitGuard,
    ) -> Result<Vec<Event>, HandlerError> {
        if OffsetDateTime::now_utc() >= record.deadline {
            return self
                .fail(record, deadline_reason(record, waiting_for, &reason), true)
                .await;
        }
        let already = matches!(&record.standing,
            Standing::Waiting { waiting_for: w, reason: r } if *w == waiting_for && *r == reason);
        if !self.p().state.wait(
            &record.event.project,
            &record.event.id,
            waiting_for,
            &reason,
            &guard,
        )? {
            return Err(retry(
                "a fact this promoter has seen ends the wait, but the catalogue does not show it yet; asking again",
            ));
        }
        self.inner.clock.notify_one();
        let fact = self.pending_fact(record, waiting_for, &reason);
        if !already {
            debug!(request = %record.event.id, waiting_for = waiting_for.as_str(), %reason, "waiting");
        }
        self.emit(std::slice::from_ref(&fact)).await?;
        Ok(vec![fact])
    }

    fn pending_fact(&self, record: &RequestRecord, waiting_for: WaitingFor, reason: &str) -> Event {
        let r = stage_request(&record.event).expect("a stage request");
        record.event.caused(
            &step_pending(waiting_for),
            Body::StagePending(StagePending {
                dataset: r.dataset.clone(),
                version: r.version.clone(),
                tier: r.tier.clone(),
                node: r.node.clone(),
                job_id: r.job_id.clone(),
                request_id: record.event.id.clone(),
                waiting_for: waiting_for.as_str().into(),
                reason: reason.to_owned(),
            }),
        )
    }

    /// The absolute path of `prefix` on a posix tier (what a job opens).
    fn path_on(tier: &Tier, prefix: &str) -> Option<PathBuf> {
        match tier {
            Tier::Posix(p) => Some(p.root().join(prefix)),
            Tier::S3(_) => None,
        }
    }

    async fn ready(
        &self,
        record: &RequestRecord,
        request: &StageRequested,
        version: &str,
        dst: &Tier,
        prefix: &str,
        replica: Option<Event>,
    ) -> Result<Vec<Event>, HandlerError> {
        let path = Self::path_on(dst, prefix).map(|p| p.display().to_string());
        let ready = record.event.caused(
            STEP_READY,
            Body::StageReady(StageReady {
                dataset: request.dataset.clone(),
                version: version.to_owned(),
                location: Location {
                    tier: request.tier.clone(),
                    prefix: prefix.to_owned(),
                },
                job_id: request.job_id.clone(),
                request_id: record.event.id.clone(),
                node: request.node.clone(),
                path: path.clone(),
            }),
        );
        let facts: Vec<Event> = replica.into_iter().chain([ready]).collect();
        info!(request = %record.event.id, dataset = %request.dataset, %version, tier = %request.tier, path = path.as_deref().unwrap_or(""), "stage ready");
        self.answer(
            record,
            Standing::Ready {
                version: version.to_owned(),
                path: path.unwrap_or_default(),
            },
            facts,
        )
        .await
    }

    /// Notes in the replica's use record that `record` is answered from it — unless the
    /// demoter is withdrawing it (`stagehand_bus::placement`): a compare-and-set, so a
    /// withdrawal that read the record before this fails and looks at the holds again.
    async fn serve(
        &self,
        record: &RequestRecord,
        request: &StageRequested,
        prefix: &str,
    ) -> Result<Served, HandlerError> {
        placement::serve(
            self.p().coordination.store(),
            &request.tier,
            request.node.as_deref(),
            prefix,
            record.event.id.as_str(),
        )
        .await
        .map_err(retry)
    }

    /// A request for a replica being removed waits until the removal has finished (the clock
    /// looks again every `recheck_every`), then stages the version afresh.
    async fn wait_for_removal(
        &self,
        record: &RequestRecord,
        version: &str,
        request: &StageRequested,
        why: Option<String>,
    ) -> Result<Vec<Event>, HandlerError> {
        let reason = format!(
            "version {version} is being removed from tier {} ({}); it is staged again once the removal has finished",
            request.tier,
            why.as_deref().unwrap_or("demoted")
        );
        self.wait(record, WaitingFor::Copy, reason, WaitGuard::None)
            .await
    }

    fn limits(&self, tier: &str, project: &str) -> Limits {
        let limits = self.tier_policy(tier).and_then(|t| t.limits.as_ref());
        Limits {
            capacity: limits.map_or(u64::MAX, |l| l.capacity),
            quota: limits.and_then(|l| l.quota_for(project)),
        }
    }

    /// The version is resolved: ready at once if it is on the tier, else copied once.
    async fn stage(
        &self,
        record: &RequestRecord,
        request: &StageRequested,
        plan: Plan,
        ctx: Option<&WorkContext>,
    ) -> Result<Vec<Event>, HandlerError> {
        let project = record.event.project.as_str();
        let node = request.node.as_deref();
        let Some(dst) = self.p().tiers.get(&request.tier) else {
            return self
                .fail(
                    record,
                    format!("tier {:?} is not open", request.tier),
                    false,
                )
                .await;
        };
        let prefix = layout::version_folder(project, &request.dataset, &plan.version);
        let limits = self.limits(&request.tier, project);
        // A replica the demoter is removing is neither handed out nor copied over until the
        // removal has finished (its space is given back then, not before).
        let withdrawing =
            placement::read_use(self.p().coordination.store(), &request.tier, node, &prefix)
                .await
                .map_err(retry)?
                .value
                .filter(|u| u.state == UseState::Withdrawing);
        if let Some(u) = withdrawing {
            return self
                .wait_for_removal(record, &plan.version, request, u.reason)
                .await;
        }
        if dst.set_present(&prefix).await.map_err(retry)? {
            if let Served::Withdrawing { reason } = self.serve(record, request, &prefix).await? {
                return self
                    .wait_for_removal(record, &plan.version, request, reason)
                    .await;
            }
            // Placed before (by this request's copy, another's, another instance's): it
            // already holds its reservation, which this makes sure of (a no-op then).
            if let Ok(Err(refused)) = self
                .p()
                .coordination
                .reserve(&request.tier, node, project, &prefix, plan.bytes, limits)
                .await
            {
                warn!(?refused, %prefix, "a replica already on the tier holds no reservation and does not fit one");
            }
            return self
                .ready(record, request, &plan.version, dst, &prefix, None)
                .await;
        }
        let Some((src_tier, src_prefix)) = plan.sources.first().cloned() else {
            return self
                .fail(
                    record,
                    format!(
                        "version {} of dataset {:?} has no verified replica on any tier stage copies from ({}); restore one there first",
                        plan.version,
                        request.dataset,
                        self.p()
                            .promotion
                            .sources_for(self.tier_policy(&request.tier).map_or(TierRole::Hot, |t| t.role))
                            .join(", ")
                    ),
                    true,
                )
                .await;
        };
        let copy_key = Self::copy_key(&request.tier, node, &prefix);
        let recent_failure = {
            let mut failed = self.inner.failed.lock().unwrap_or_else(|p| p.into_inner());
            failed.retain(|_, (_, _, at)| at.elapsed() < FAILED_COPY_REMEMBERED);
            failed.get(&copy_key).cloned()
        };
        if let Some((reason, retryable, _)) = recent_failure {
            return self.fail(record, reason, retryable).await;
        }
        let Some(_copying) = Held::take(&self.inner.copies, copy_key.clone()) else {
            let reason = format!(
                "version {} is being copied onto tier {} for another request; this one is answered when that copy is published",
                plan.version, request.tier
            );
            let guard = WaitGuard::Replica {
                tier: request.tier.clone(),
                prefix: prefix.clone(),
            };
            return self.wait(record, WaitingFor::Copy, reason, guard).await;
        };
        let coord = &self.p().coordination;
        let lease = coord
            .lease(&request.tier, node, &prefix, record.event.id.as_str())
            .await
            .map_err(retry)?;
        let mut revision = match lease {
            LeaseState::Owned(rev) => rev,
            LeaseState::Held {
                instance,
                request_id,
            } => {
                let reason = format!(
                    "version {} is being copied onto tier {} by promoter {instance} (request {request_id}); this one is answered when that copy is published",
                    plan.version, request.tier
                );
                let guard = WaitGuard::Replica {
                    tier: request.tier.clone(),
                    prefix: prefix.clone(),
                };
                return self.wait(record, WaitingFor::Copy, reason, guard).await;
            }
        };
        let result = self
            .copy_owned(
                record,
                request,
                &plan,
                dst,
                &prefix,
                &src_tier,
                &src_prefix,
                limits,
                &mut revision,
                ctx,
            )
            .await;
        if let Err(e) = coord
            .end_lease(&request.tier, node, &prefix, revision)
            .await
        {
            debug!(error = %e, "copy lease not ended; it ages out");
        }
        let facts = result?;
        let failed = facts.iter().find_map(|f| match &f.body {
            Body::StageFailed(failed) => Some((failed.reason.clone(), failed.retryable)),
            _ => None,
        });
        match failed {
            // A damaged source (not retryable) fails every request the same way; a full tier
            // or quota may have room for the next one.
            Some((reason, retryable)) if !retryable => {
                self.inner
                    .failed
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(copy_key, (reason, retryable, Instant::now()));
                self.wake_dataset(project, &request.dataset, None);
            }
            Some(_) => self.wake_dataset(project, &request.dataset, None),
            // Requests of this dataset waiting for this copy (here) can be answered now.
            None => self.wake_dataset(project, &request.dataset, Some((&request.tier, &prefix))),
        }
        Ok(facts)
    }

    /// Answers, in the background, the requests waiting on (project, dataset) after a copy.
    fn wake_dataset(&self, project: &str, dataset: &str, made: Option<(&str, &str)>) {
        let note = FactNote {
            project: project.to_owned(),
            dataset: dataset.to_owned(),
            replica: made.map(|(tier, prefix)| (tier.to_owned(), prefix.to_owned(), true)),
            ..FactNote::default()
        };
        let this = self.clone();
        tokio::spawn(async move {
            let woken = match this.p().state.note(&note) {
                Ok(w) => w,
                Err(e) => return warn!(error = %e, "cannot list the requests a copy wakes"),
            };
            for id in woken.requests {
                if let Ok(Some(record)) = this.p().state.request(&note.project, &id)
                    && let Err(e) = this.advance(record, None).await
                {
                    debug!(request = %id, error = %e, "woken request not answered yet; the clock looks again");
                }
            }
        });
    }

    /// Reserves space and copies the version under an owned lease.
    #[allow(clippy::too_many_arguments)]
    async fn copy_owned(
        &self,
        record: &RequestRecord,
        request: &StageRequested,
        plan: &Plan,
        dst: &Tier,
        prefix: &str,
        src_tier: &str,
        src_prefix: &str,
        limits: Limits,
        revision: &mut u64,
        ctx: Option<&WorkContext>,
    ) -> Result<Vec<Event>, HandlerError> {
        let project = record.event.project.as_str();
        let node = request.node.as_deref();
        let coord = &self.p().coordination;
        let place = match node {
            Some(n) => format!("tier {} on node {n}", request.tier),
            None => format!("tier {}", request.tier),
        };
        self.p()
            .state
            .note_reserved(&record.event.project, &record.event.id, prefix)?;
        match coord
            .reserve(&request.tier, node, project, prefix, plan.bytes, limits)
            .await
            .map_err(retry)?
        {
            Ok(()) => {}
            Err(Refused::Withdrawing) => {
                // Found gone with its space not given back yet: the demoter is removing it.
                return self
                    .wait_for_removal(record, &plan.version, request, None)
                    .await;
            }
            Err(Refused::Quota { used, quota }) => {
                return self
                    .fail(
                        record,
                        format!(
                            "quota exceeded: project {project:?} holds {used} bytes of its {quota}-byte quota on {place}, and version {} needs {} more; release finished stages or raise the quota in tiers.toml",
                            plan.version, plan.bytes
                        ),
                        true,
                    )
                    .await;
            }
            Err(Refused::Full { used, capacity }) => {
                return self
                    .fail(
                        record,
                        format!(
                            "{place} is full: {used} of its {capacity} bytes are reserved, and version {} needs {}; release finished stages or wait for the demoter",
                            plan.version, plan.bytes
                        ),
                        true,
                    )
                    .await;
            }
        }
        if let Some(free) = free_bytes(dst)
            && free < plan.bytes
        {
            let _ = coord.release(&request.tier, node, prefix).await;
            return self
                .fail(
                    record,
                    format!(
                        "{place} is full: its filesystem has {free} bytes free and version {} needs {}",
                        plan.version, plan.bytes
                    ),
                    true,
                )
                .await;
        }
        // Recorded as copying, so that after a crash the clock takes the copy up again.
        let reason = format!("copying version {} from tier {src_tier}", plan.version);
        self.p().state.wait(
            &record.event.project,
            &record.event.id,
            WaitingFor::Copy,
            &reason,
            &WaitGuard::None,
        )?;
        let ticket = self.inner.slots.enqueue(plan.priority);
        tokio::pin!(ticket);
        let _slot = match futures::poll!(&mut ticket) {
            std::task::Poll::Ready(permit) => permit,
            std::task::Poll::Pending => {
                let reason = format!(
                    "waiting for one of {} copy slots (class {})",
                    self.p().promotion.max_concurrent,
                    plan.priority
                );
                let fact = self.pending_fact(record, WaitingFor::Copy, &reason);
                self.emit(std::slice::from_ref(&fact)).await?;
                let held = self
                    .hold(ticket, &request.tier, node, prefix, record, revision, ctx)
                    .await?;
                let Some(permit) = held else {
                    // The deadline passed while queued: nothing of it stays on the tier.
                    discard_staging(dst, prefix).await;
                    let _ = coord.release(&request.tier, node, prefix).await;
                    return self
                        .fail(
                            record,
                            deadline_reason(record, WaitingFor::Copy, &reason),
                            true,
                        )
                        .await;
                };
                permit
            }
        };
        let outcome = Box::pin(self.run_copy(
            record, request, plan, dst, prefix, src_tier, src_prefix, revision, ctx,
        ))
        .await;
        match outcome {
            Ok(report) => {
                info!(request = %record.event.id, %prefix, copied = report.copied, skipped = report.skipped, bytes = report.bytes_copied, resumed = report.resumed, existed = report.existed, engine = report.engine, elapsed = ?report.elapsed, "version copied and published");
                let replica = (!report.existed).then(|| {
                    record.event.caused(
                        &step_replica(&request.tier, node),
                        Body::ReplicaCreated(ReplicaCreated {
                            dataset: request.dataset.clone(),
                            version: plan.version.clone(),
                            location: Location {
                                tier: request.tier.clone(),
                                prefix: prefix.to_owned(),
                            },
                            files: plan.files,
                            total_bytes: plan.bytes,
                            verified_by: self.p().promotion.verify.as_str().into(),
                            node: node.map(str::to_owned),
                        }),
                    )
                });
                if let Served::Withdrawing { reason } = self.serve(record, request, prefix).await? {
                    return self
                        .wait_for_removal(record, &plan.version, request, reason)
                        .await;
                }
                self.ready(record, request, &plan.version, dst, prefix, replica)
                    .await
            }
            Err(CopyFailed::Retry(e)) => Err(e),
            Err(CopyFailed::Fail { reason, retryable }) => {
                // Nothing of a copy that will not be retried stays on the tier, hidden or not.
                discard_staging(dst, prefix).await;
                let _ = coord.release(&request.tier, node, prefix).await;
                self.fail(record, reason, retryable).await
            }
        }
    }

    /// Waits for a copy slot, keeping the lease and the message alive; `None` once the
    /// request's deadline passes first.
    #[allow(clippy::too_many_arguments)]
    async fn hold<F: std::future::Future<Output = stagehand_mover::Permit> + Unpin>(
        &self,
        mut ticket: F,
        tier: &str,
        node: Option<&str>,
        prefix: &str,
        record: &RequestRecord,
        revision: &mut u64,
        ctx: Option<&WorkContext>,
    ) -> Result<Option<stagehand_mover::Permit>, HandlerError> {
        let period = self.p().coordination.lease_lifetime() / 3;
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        let left =
            Duration::try_from(record.deadline - OffsetDateTime::now_utc()).unwrap_or_default();
        let deadline = tokio::time::sleep(left);
        tokio::pin!(deadline);
        loop {
            tokio::select! {
                permit = &mut ticket => return Ok(Some(permit)),
                _ = &mut deadline => return Ok(None),
                _ = tick.tick() => {
                    *revision = self.p().coordination
                        .renew(tier, node, prefix, record.event.id.as_str(), *revision)
                        .await
                        .map_err(|e| retry(format!("copy lease lost while waiting for a slot: {e}")))?;
                    if let Some(ctx) = ctx && let Err(e) = ctx.progress().await {
                        debug!(error = %e, "progress ack failed");
                    }
                }
                _ = self.p().shutdown.cancelled() => return Err(retry("shutting down")),
            }
        }
    }

    /// The version's verified file list: from the services' manifest bucket, or (a version
    /// small enough to travel inline) the catalogue's pages, checked against the digest.
    async fn manifest(
        &self,
        project: &str,
        dataset: &str,
        plan: &Plan,
    ) -> Result<Manifest, CopyFailed> {
        let reference = ManifestRef {
            digest: plan.version.clone(),
            files: plan.files,
            bytes: plan.bytes,
        };
        let js = self.p().bus.jetstream();
        let stored = match ManifestStore::open(js, MANIFEST_BUCKET).await {
            Ok(store) => store.fetch(&reference, &self.p().spool).await,
            Err(e) => Err(e),
        };
        match stored {
            Ok(m) => return Ok(m),
            Err(e) if e.kind == ManifestErrorKind::NotFound => {}
            Err(e) if e.is_retryable() => return Err(CopyFailed::Retry(retry(e))),
            Err(e) => {
                return Err(CopyFailed::Fail {
                    reason: format!("the manifest of version {} is damaged: {e}", plan.version),
                    retryable: false,
                });
            }
        }
        let pages = self.p().catalogue.all_files(
            Some(project.to_owned()),
            dataset.to_owned(),
            plan.version.clone(),
            stagehand_catalogue::MAX_PAGE,
            None,
        );
        let mut pages = std::pin::pin!(pages);
        let mut builder = ManifestBuilder::new(&self.p().spool);
        while let Some(file) = pages.next().await {
            let file = file.map_err(|e| CopyFailed::Retry(retry(e)))?;
            builder
                .push(&file)
                .map_err(|e| CopyFailed::Retry(retry(e)))?;
        }
        let manifest = builder.finish().map_err(|e| CopyFailed::Retry(retry(e)))?;
        if manifest.digest() != plan.version || manifest.files() != plan.files {
            return Err(CopyFailed::Fail {
                reason: format!(
                    "the catalogue's file list of version {} hashes to {} ({} files, {} expected): the catalogue is damaged; rebuild it",
                    plan.version,
                    manifest.digest(),
                    manifest.files(),
                    plan.files
                ),
                retryable: false,
            });
        }
        Ok(manifest)
    }

    /// Stages every file under the hidden staging folder, then publishes the set, reporting
    /// progress about once a second and renewing the lease.
    #[allow(clippy::too_many_arguments)]
    async fn run_copy(
        &self,
        record: &RequestRecord,
        request: &StageRequested,
        plan: &Plan,
        dst: &Tier,
        prefix: &str,
        src_tier: &str,
        src_prefix: &str,
        revision: &mut u64,
        ctx: Option<&WorkContext>,
    ) -> Result<stagehand_mover::SetReport, CopyFailed> {
        let project = record.event.project.as_str();
        let Some(src) = self.p().tiers.get(src_tier) else {
            return Err(CopyFailed::Fail {
                reason: format!("source tier {src_tier:?} is not open"),
                retryable: false,
            });
        };
        let manifest = self.manifest(project, &request.dataset, plan).await?;
        // Jobs of every project read a hot or local tier: the set is published read-only and
        // readable by its project's group only (tiers.toml `[groups]`).
        let dst = &dst.with_access(
            self.tier_policy(&request.tier)
                .and_then(|t| t.set_access(project)),
        );
        // A list that ends early is caught below, before anything is published.
        let (files, listed) = manifest.file_stream(4096);
        let set = SetCopy {
            src_prefix: src_prefix.to_owned(),
            dst_prefix: prefix.to_owned(),
            opts: CopyOptions {
                priority: plan.priority,
                trust_recorded_hash: false,
                verify_destination: self.p().promotion.verify,
                expected_hash_unknown: false,
            },
            chunk_files: 0,
            totals: Some((plan.files, plan.bytes)),
        };
        let progress = Progress::new();
        let cancel = self.p().shutdown.child_token();
        let node = request.node.as_deref();
        let mover = &self.p().mover;
        let staging = async {
            let staged = mover
                .stage_set(src, dst, &set, files, &progress, &cancel, |_| {})
                .await?;
            Ok::<_, TransferError>(staged)
        };
        tokio::pin!(staging);
        let started = Instant::now();
        let lease_every = self.p().coordination.lease_lifetime() / 3;
        let mut last_renew = Instant::now();
        let mut tick = tokio::time::interval(self.p().progress_every);
        tick.tick().await;
        let subject = progress_subject("stage.requested", project, &record.event.id);
        let staged = loop {
            tokio::select! {
                r = &mut staging => break r,
                _ = tick.tick() => {
                    self.report(&subject, &record.event.id, &progress, started).await;
                    if let Some(ctx) = ctx && let Err(e) = ctx.progress().await {
                        debug!(error = %e, "progress ack failed");
                    }
                    if last_renew.elapsed() >= lease_every {
                        match self.p().coordination.renew(&request.tier, node, prefix, record.event.id.as_str(), *revision).await {
                            Ok(rev) => { *revision = rev; last_renew = Instant::now(); }
                            Err(e) => {
                                warn!(error = %e, %prefix, "copy lease lost; stopping this copy (its staging folder is kept)");
                                cancel.cancel();
                            }
                        }
                    }
                }
            }
        };
        let staged = staged.map_err(|e| self.copy_error(src_tier, e))?;
        if let Some(e) = listed.take_error() {
            // The list ended early: publishing now would publish part of the version.
            return Err(if e.is_retryable() {
                CopyFailed::Retry(retry(e))
            } else {
                CopyFailed::Fail {
                    reason: format!("the manifest of version {} is damaged: {e}", plan.version),
                    retryable: false,
                }
            });
        }
        self.report(&subject, &record.event.id, &progress, started)
            .await;
        let report = staged
            .publish()
            .await
            .map_err(|e| self.copy_error(src_tier, e))?;
        Ok(report)
    }

    fn copy_error(&self, src_tier: &str, e: TransferError) -> CopyFailed {
        match e.kind {
            ErrorKind::NoSpace => CopyFailed::Fail {
                reason: format!("tier {} is full: {}", e.tier, e.detail),
                retryable: true,
            },
            ErrorKind::ChecksumMismatch
            | ErrorKind::SizeMismatch
            | ErrorKind::NotFound
            | ErrorKind::NotAFile
                if e.side == stagehand_mover::Side::Source =>
            {
                CopyFailed::Fail {
                    reason: format!(
                        "the replica on source tier {src_tier} is damaged: file {:?}: {}; nothing was published on the target tier (on-call: restore that replica)",
                        e.path, e.detail
                    ),
                    retryable: false,
                }
            }
            _ if e.is_retryable() || e.kind == ErrorKind::Cancelled => CopyFailed::Retry(retry(
                format!("copy interrupted (its staging folder is kept for a resume): {e}"),
            )),
            _ => CopyFailed::Fail {
                reason: format!("copying failed: {e}"),
                retryable: false,
            },
        }
    }

    async fn report(&self, subject: &str, id: &EventId, progress: &Progress, started: Instant) {
        let done = progress.bytes_done();
        let total = progress.bytes_total();
        let secs = started.elapsed().as_secs_f64();
        let eta = (done > 0 && secs > 0.0)
            .then(|| ((total.saturating_sub(done)) as f64 / (done as f64 / secs)).ceil() as u64);
        let p = WorkProgress {
            request_id: id.clone(),
            service: crate::SERVICE.into(),
            phase: "copying".into(),
            files_done: progress.files_done(),
            files_total: progress.files_total(),
            bytes_done: done,
            bytes_total: total,
            eta_seconds: eta,
        };
        if let Err(e) = self
            .p()
            .bus
            .client()
            .publish(subject.to_owned(), p.encode().into())
            .await
        {
            debug!(error = %e, "progress not published");
        }
    }

    /// The policy clock: looks again at every waiting request every `recheck_every` (at once
    /// on start, which takes up copies a crash interrupted), and answers each request whose
    /// deadline passes as it passes. Runs until shutdown.
    pub async fn clock(self) -> Result<(), HandlerError> {
        let every = self.p().promotion.recheck_every;
        let mut next_sweep = tokio::time::Instant::now();
        loop {
            let waiting = self.p().state.waiting()?;
            record_waiting(&waiting);
            let sweep = tokio::time::Instant::now() >= next_sweep;
            if sweep {
                next_sweep = tokio::time::Instant::now() + every;
            }
            let now = OffsetDateTime::now_utc();
            let mut next = next_sweep;
            for record in waiting {
                if self.p().shutdown.is_cancelled() {
                    return Ok(());
                }
                let due = record.deadline <= now;
                if !due {
                    if let Ok(d) = Duration::try_from(record.deadline - now) {
                        next = next.min(tokio::time::Instant::now() + d);
                    }
                    if !sweep {
                        continue;
                    }
                }
                let this = self.clone();
                // Each on its own task: a copy taken up again must not hold the clock.
                tokio::spawn(async move {
                    let id = record.event.id.clone();
                    let r = if due {
                        this.expire(record).await
                    } else {
                        this.advance(record, None).await
                    };
                    if let Err(e) = r {
                        debug!(request = %id, error = %e, "waiting request not answered yet");
                    }
                });
            }
            tokio::select! {
                _ = tokio::time::sleep_until(next) => {}
                _ = self.inner.clock.notified() => {}
                _ = self.p().shutdown.cancelled() => return Ok(()),
            }
        }
    }

    /// Answers a request whose deadline passed while it waited (one being copied here right
    /// now is left to its copy).
    async fn expire(&self, record: RequestRecord) -> Result<Vec<Event>, HandlerError> {
        let Some(_active) = Active::take(&self.inner.active, &request_key(&record)) else {
            return Ok(Vec::new());
        };
        self.deadline_passed(&record).await
    }

    /// Answers a request whose deadline has passed with what it was waiting for.
    async fn deadline_passed(&self, record: &RequestRecord) -> Result<Vec<Event>, HandlerError> {
        let Standing::Waiting {
            waiting_for,
            reason,
        } = &record.standing
        else {
            return Ok(record.answer.clone());
        };
        let reason = deadline_reason(record, *waiting_for, reason);
        self.fail(record, reason, true).await
    }
}

/// The lease holder named while the reconciler decides about a reservation.
const RECLAIM_LEASE: &str = "reconcile";

/// Why a request failed at its deadline: the deadline and what it waited for.
fn deadline_reason(record: &RequestRecord, waiting_for: WaitingFor, reason: &str) -> String {
    let deadline = record
        .deadline
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default();
    format!(
        "the deadline {deadline} passed while waiting for {}: {reason}",
        waiting_for.as_str()
    )
}

/// How a copy ended when it did not publish.
enum CopyFailed {
    /// Try again later; the staging folder stays for a resume.
    Retry(HandlerError),
    /// Answer `stage.failed`.
    Fail { reason: String, retryable: bool },
}

impl From<CopyFailed> for HandlerError {
    fn from(c: CopyFailed) -> Self {
        match c {
            CopyFailed::Retry(e) => e,
            CopyFailed::Fail { reason, .. } => HandlerError::permanent(reason),
        }
    }
}

/// Removes the staging folders of the set bound for `prefix` on a posix tier (called under
/// the set's copy lease, so no live copy of it is anywhere). The listing reads the folder
/// beneath the tier's root; the removal goes through the tier's confined handles.
async fn discard_staging(tier: &Tier, prefix: &str) {
    let Tier::Posix(p) = tier else { return };
    let Some((parent, name)) = prefix.rsplit_once('/') else {
        return;
    };
    let (p, parent, mark) = (
        p.clone(),
        parent.to_owned(),
        layout::staging_folder_prefix(name),
    );
    let removed = tokio::task::spawn_blocking(move || {
        let Ok(entries) = std::fs::read_dir(p.root().join(&parent)) else {
            return;
        };
        for entry in entries.flatten() {
            let entry = entry.file_name().to_string_lossy().into_owned();
            if entry.starts_with(&mark)
                && let Err(e) = p.remove_tree(&format!("{parent}/{entry}"))
            {
                warn!(error = %e, "could not remove a failed copy's staging folder");
            }
        }
    })
    .await;
    if let Err(e) = removed {
        warn!(error = %e, "staging clean-up task failed");
    }
}

/// Bytes free on a posix tier's filesystem, if it can tell.
fn free_bytes(tier: &Tier) -> Option<u64> {
    match tier {
        Tier::Posix(p) => rustix::fs::fstatvfs(p.root_fd())
            .ok()
            .map(|s| s.f_bavail.saturating_mul(s.f_frsize)),
        Tier::S3(_) => None,
    }
}

/// Counts a stage request's first answer, ready or failed, in the work metrics
/// ([`stagehand_telemetry::work::stage_answered`]): its tier and the time since it was asked.
fn record_answer(record: &RequestRecord) {
    let ready = match record.standing {
        Standing::Ready { .. } => true,
        Standing::Failed { .. } => false,
        Standing::Waiting { .. } | Standing::Released => return,
    };
    let Some(request) = record.stage() else {
        return;
    };
    let asked = record.event.occurred_at;
    let waited = (time::OffsetDateTime::now_utc() - asked)
        .try_into()
        .unwrap_or_default();
    stagehand_telemetry::work::stage_answered(&request.tier, ready, waited);
}

/// Sets the requests this promoter has not answered yet in the work metrics
/// ([`stagehand_telemetry::work::stages`]), by tier, state (`copying` while waiting for a
/// copy, else `pending`) and what they wait for.
fn record_waiting(waiting: &[RequestRecord]) {
    let mut counts = stagehand_telemetry::work::StageCounts::new();
    for record in waiting {
        let (Some(request), Standing::Waiting { waiting_for, .. }) =
            (record.stage(), &record.standing)
        else {
            continue;
        };
        let state = match waiting_for {
            WaitingFor::Copy => "copying",
            _ => "pending",
        };
        let waits = stagehand_telemetry::work::waiting_label(Some(waiting_for.as_str()));
        *counts
            .entry((request.tier.clone(), state, waits))
            .or_default() += 1;
    }
    stagehand_telemetry::work::stages(&counts);
}
