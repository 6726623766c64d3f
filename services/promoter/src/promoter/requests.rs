//! A stage request's answers: its message and the facts that wake it move it on as far as it
//! can go now — failed, waiting (`stage.pending`), or ready — each answer recorded before it
//! is published.

use std::path::PathBuf;
use tracing::instrument::WithSubscriber;

use stagehand_bus::placement::{self, Served};
use stagehand_bus::{HandlerError, WorkContext};
use stagehand_mover::Tier;
use stagehand_policy::TierRole;
use stagehand_schemas::layout;
use stagehand_schemas::{
    Body, Event, EventId, Location, ReadyEstimate, StageFailed, StagePending, StageReady,
    StageRequested,
};
use time::OffsetDateTime;
use tracing::{debug, info, warn};

use crate::resolve::{self, Decision};
use crate::state::{FactNote, IngestNote, RequestRecord, Seen, Standing, WaitGuard, WaitingFor};

use super::clock::deadline_reason;
use super::in_flight::{Active, request_key};
use super::{Promoter, STEP_FAILED, STEP_READY, retry, stage_request, step_pending};

impl Promoter {
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

    /// The note of a copy present on `location` (made or repaired): it wakes the requests of
    /// its version when this instance follows that tier (and node).
    fn present_copy(
        &self,
        project: String,
        dataset: &str,
        location: &Location,
        node: Option<&str>,
    ) -> FactNote {
        FactNote {
            project,
            dataset: dataset.to_owned(),
            replica: self
                .follows(&location.tier, node)
                .then(|| (location.tier.clone(), location.prefix.clone(), true)),
            ..FactNote::default()
        }
    }

    /// Handles a fact (or an ingest request) that may wake waiting requests.
    pub async fn on_fact(
        &self,
        event: &Event,
        ctx: Option<&WorkContext>,
    ) -> Result<Vec<Event>, HandlerError> {
        if let Body::OperatorAction(a) = &event.body {
            return self.on_operator_action(event, a).await;
        }
        if let Body::ReplicaDamaged(d) = &event.body {
            return self.on_damaged(event, d, ctx).await;
        }
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
            Body::ReplicaCreated(p) => {
                self.present_copy(project, &p.dataset, &p.location, p.node.as_deref())
            }
            // A repaired copy is present again, as a created one: the requests that waited
            // for its repair's copy are answered from it.
            Body::ReplicaRepaired(p) => {
                self.present_copy(project, &p.dataset, &p.location, p.node.as_deref())
            }
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

    /// An operator's cancel (`stagehand stage cancel`, an `operator.action` of `stage.cancel`):
    /// a request this promoter holds that still waits or copies fails with `cancelled by
    /// <who>: <why>`, its copy (queued or running) is stopped unless another request waits for
    /// the same replica ([`Promoter::stop_cancelled_copy`]), and the space it reserved is
    /// given back with the staging folder removed. The request is looked up under the action's own project — request ids are
    /// scoped by project, and only Stagehand's operator may state the action — so an action
    /// reaches no other project's request. A ready stage is the cancel's release to end, and
    /// one already answered is left as it is.
    async fn on_operator_action(
        &self,
        event: &Event,
        a: &stagehand_schemas::OperatorAction,
    ) -> Result<Vec<Event>, HandlerError> {
        let (stagehand_schemas::action::STAGE_CANCEL, Some(id)) =
            (a.action.as_str(), &a.request_id)
        else {
            return Ok(Vec::new());
        };
        let Some(record) = self.p().state.request(&event.project, id)? else {
            return Ok(Vec::new());
        };
        if record.standing.is_final() {
            return Ok(Vec::new());
        }
        let answers = record
            .stage()
            .is_some_and(|r| self.answers(&r.tier, r.node.as_deref()));
        if !answers {
            return Ok(Vec::new());
        }
        info!(request = %id, action = %event.id, by = %a.by, "stage cancelled by an operator");
        let answered = self
            .fail(
                &record,
                format!("cancelled by {}: {}", a.by, a.reason),
                false,
            )
            .await?;
        self.stop_cancelled_copy(&record)?;
        Ok(answered)
    }

    /// Stops the copy `record` drives in this process (queued for a slot or running), now
    /// that the request is cancelled — unless another live request of the same project waits
    /// for the same replica (same dataset, tier and node, a version naming this one), which
    /// the copy still serves. A stopped copy removes its staging folder and gives its space
    /// back at once.
    fn stop_cancelled_copy(&self, record: &RequestRecord) -> Result<(), HandlerError> {
        let key = request_key(record);
        let Some((version, cancel)) = self.inner.book.copy_of(&key) else {
            return Ok(());
        };
        let Some(cancelled) = record.stage() else {
            return Ok(());
        };
        let still_wanted = self.p().state.waiting()?.into_iter().find(|other| {
            other.event.project == record.event.project
                && other.event.id != record.event.id
                && other.stage().is_some_and(|r| {
                    r.dataset == cancelled.dataset
                        && r.tier == cancelled.tier
                        && r.node == cancelled.node
                        && version.starts_with(r.version.as_str())
                })
        });
        match still_wanted {
            Some(other) => {
                info!(request = %record.event.id, wanted_by = %other.event.id, "the cancelled request's copy goes on: another request waits for the same replica");
            }
            None => cancel.cancel(),
        }
        Ok(())
    }

    /// Whether `record` was answered (an operator's cancel) while its copy was queued or ran.
    pub(super) fn answered_meanwhile(&self, record: &RequestRecord) -> Result<bool, HandlerError> {
        Ok(self
            .p()
            .state
            .request(&record.event.project, &record.event.id)?
            .is_some_and(|now| now.standing.is_final()))
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
    pub(super) async fn fail(
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

    /// Records a wait and answers `stage.pending`, or fails when the deadline has passed.
    pub(super) async fn wait(
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
        let fact = self.pending_fact(record, waiting_for, &reason, None);
        if !already {
            debug!(request = %record.event.id, waiting_for = waiting_for.as_str(), %reason, "waiting");
        }
        self.emit(std::slice::from_ref(&fact)).await?;
        Ok(vec![fact])
    }

    pub(crate) fn pending_fact(
        &self,
        record: &RequestRecord,
        waiting_for: WaitingFor,
        reason: &str,
        ready_estimate: Option<ReadyEstimate>,
    ) -> Event {
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
                ready_estimate,
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

    pub(super) async fn ready(
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
    pub(super) async fn serve(
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
    pub(super) async fn wait_for_removal(
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

    /// Answers, in the background, the requests waiting on (project, dataset) after a copy.
    pub(super) fn wake_dataset(&self, project: &str, dataset: &str, made: Option<(&str, &str)>) {
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
        }
        .with_current_subscriber());
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
