//! `stagehand stage request|wait|status|release`: what scheduler plugins (Slurm's
//! `burst_buffer.lua` and Prolog, a Kubernetes init container) and people call to get a dataset
//! version onto a tier for a job, wait for it, see why it waits, and let it go.
//! `stagehand stage cancel` is the operator's: see [`cancel`]. `stagehand stage where` says
//! which nodes hold a usable copy of a version on a node-local tier: see [`cached_on`].
//!
//! The contract is `STAGING.md`: a request is the `stage.requested` event with the id
//! [`EventId::for_stage`] derives from (project, job, dataset, version as given, tier, node), so
//! a hook that runs twice asks the same request and JetStream's duplicate window drops the copy.
//! The answer is read from the `stagehand_stages` KV bucket the catalogue recorder keeps: key
//! `<project>.<hex of the request id>`, value a [`StageStatus`] as JSON.
//!
//! Nothing here creates a JetStream consumer. Whoever creates one names its deliver subject in
//! the request's body, which NATS permissions cannot see, so a user allowed to create consumers
//! could have the server deliver a bucket's entries onto any subject with a live subscriber
//! (another project's verdict subject included, where the facts stream stores them); schedulers
//! and tenants are allowed none (deploy/nats/accounts.conf). `wait` reads its one key by a
//! direct get by subject, which the accounts confine to the user's projects; it is woken early
//! by the promoter's `stage.ready` and `stage.failed` facts of its project (plain
//! subscriptions), and reads again every [`REREAD`] besides. `status` lists keys from the
//! bucket's stream info (the subjects it holds), never from a KV watch.

use std::time::{Duration, Instant};

use anyhow::Context;
use futures::StreamExt;
use stagehand_bus::{Bus, PublishAck};
use stagehand_schemas::subject;
use stagehand_schemas::{Body, Event, EventId, StageReleased, StageRequested};
use time::OffsetDateTime;

use crate::args::Unreachable;
use stagehand_schemas::Retryable;

pub use stagehand_catalogue::{STAGES_BUCKET, StageState, StageStatus};

/// The state as one word, as the JSON and `stage status` show it.
pub fn state_word(state: StageState) -> &'static str {
    match state {
        StageState::Pending => "pending",
        StageState::Copying => "copying",
        StageState::Ready => "ready",
        StageState::Failed => "failed",
        StageState::Released => "released",
    }
}

/// One stage: a job's need for a dataset version on a tier (and, for a node-local tier, on a
/// node). Its fields are what the request id is derived from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stage {
    pub project: String,
    pub dataset: String,
    /// The version as the job names it: a digest or a unique prefix of one.
    pub version: String,
    pub tier: String,
    pub job: String,
    pub node: Option<String>,
}

impl Stage {
    /// The id of this stage's request.
    pub fn request_id(&self) -> EventId {
        EventId::for_stage(
            &self.project,
            &self.job,
            &self.dataset,
            &self.version,
            &self.tier,
            self.node.as_deref(),
        )
    }

    /// The id of this stage's release.
    pub fn release_id(&self) -> EventId {
        EventId::for_stage_release(
            &self.project,
            &self.job,
            &self.dataset,
            &self.version,
            &self.tier,
            self.node.as_deref(),
        )
    }

    /// The key of this stage's status in [`STAGES_BUCKET`].
    /// The release of this stage, with the reason a person gave (none: its job's teardown).
    fn released(&self, reason: Option<String>) -> StageReleased {
        StageReleased {
            dataset: self.dataset.clone(),
            version: self.version.clone(),
            tier: self.tier.clone(),
            job_id: self.job.clone(),
            node: self.node.clone(),
            reason,
        }
    }

    pub fn status_key(&self) -> String {
        stagehand_catalogue::stage_kv_key(&self.project, &self.request_id())
    }

    fn describe(&self) -> String {
        let node = self
            .node
            .as_deref()
            .map(|n| format!(" on node {n}"))
            .unwrap_or_default();
        format!(
            "{}@{} on tier {}{node} for job {}",
            self.dataset, self.version, self.tier, self.job
        )
    }
}

/// What a request carries besides the stage itself.
#[derive(Debug, Clone, Default)]
pub struct RequestOptions {
    pub requested_by: String,
    pub deadline: Option<OffsetDateTime>,
    /// When the job's hold ends at the latest (`StageRequested::hold_until`).
    pub hold_until: Option<OffsetDateTime>,
    /// `raw` or `prepared`; `None` leaves the promoter's default (`raw`).
    pub form: Option<String>,
}

/// The request as published.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Published {
    pub id: EventId,
    pub stream: String,
    pub sequence: u64,
    /// The server already held this id (an earlier run of the same hook).
    pub duplicate: bool,
}

impl Published {
    fn new(id: EventId, ack: PublishAck) -> Self {
        Self {
            id,
            stream: ack.stream,
            sequence: ack.sequence,
            duplicate: ack.duplicate,
        }
    }
}

/// Publishes the stage request; returns once the requests stream stored it.
pub async fn request(bus: &Bus, stage: &Stage, opts: &RequestOptions) -> anyhow::Result<Published> {
    let id = stage.request_id();
    let event = Event::request(
        id.clone(),
        stage.project.clone(),
        Body::StageRequested(StageRequested {
            dataset: stage.dataset.clone(),
            version: stage.version.clone(),
            tier: stage.tier.clone(),
            job_id: stage.job.clone(),
            requested_by: opts.requested_by.clone(),
            deadline: opts.deadline,
            node: stage.node.clone(),
            form: opts.form.clone(),
            hold_until: opts.hold_until,
        }),
    );
    let ack = bus
        .publish(&event)
        .await
        .with_context(|| format!("publishing the request for {}", stage.describe()))?;
    Ok(Published::new(id, ack))
}

/// Refuses a stage whose version is larger than the `declared` bytes its job said it needs (a
/// Slurm job's `capacity=`, which Slurm sets aside in the tier's pool): the catalogue's size of
/// the version decides, not the job's word, so a job that declared less than its data cannot take
/// more of the pool than the scheduler counted. A version the catalogue does not know (in the
/// stage's project) passes: the promoter refuses the request with its own reason. The version is
/// resolved as every stage command resolves it (a digest or a unique prefix); a `prepared` form
/// is checked against the size of the raw version named.
pub async fn check_declared_size(bus: &Bus, stage: &Stage, declared: u64) -> anyhow::Result<()> {
    let catalogue = stagehand_catalogue::Catalogue::new(bus.client().clone())
        .with_timeout(crate::catalogue::TIMEOUT);
    let detail = match catalogue
        .version(Some(&stage.project), &stage.dataset, &stage.version)
        .await
    {
        Ok(detail) => detail,
        Err(e) if e.is_not_found() => return Ok(()),
        Err(e) => {
            let what = format!("asking the catalogue the size of {}: {e}", stage.describe());
            return Err(if e.is_retryable() {
                Unreachable(what).into()
            } else {
                anyhow::anyhow!(what)
            });
        }
    };
    let size = detail.version.total_bytes;
    anyhow::ensure!(
        size <= declared,
        "{}/{}@{} is {size} bytes, more than the {declared} bytes declared for it (capacity=): \
         declare at least {size}",
        stage.project,
        stage.dataset,
        detail.version.version,
    );
    Ok(())
}

/// Publishes the stage's release; returns once the requests stream stored it.
pub async fn release(bus: &Bus, stage: &Stage) -> anyhow::Result<Published> {
    let id = stage.release_id();
    let event = Event::request(
        id.clone(),
        stage.project.clone(),
        Body::StageReleased(stage.released(None)),
    );
    let ack = bus
        .publish(&event)
        .await
        .with_context(|| format!("publishing the release of {}", stage.describe()))?;
    Ok(Published::new(id, ack))
}

/// How a wait ended.
#[derive(Debug, Clone, PartialEq)]
pub enum WaitOutcome {
    /// The data is on the tier, complete and verified.
    Ready(StageStatus),
    /// The stage failed (or was released); the status says why.
    Failed(StageStatus),
    /// The timeout passed first; the last status seen, if the recorder wrote any.
    TimedOut(Option<StageStatus>),
}

impl WaitOutcome {
    /// `stage wait`'s exit code: 0 ready, 1 failed, 2 timed out.
    pub fn exit_code(&self) -> i32 {
        match self {
            WaitOutcome::Ready(_) => 0,
            WaitOutcome::Failed(_) => 1,
            WaitOutcome::TimedOut(_) => 2,
        }
    }

    /// What `stage wait` prints: the path, the reason, or the last state and reason.
    pub fn text(&self, stage: &Stage) -> String {
        match self {
            WaitOutcome::Ready(s) => s.path.clone().unwrap_or_default(),
            WaitOutcome::Failed(s) => match &s.reason {
                Some(reason) => reason.clone(),
                None => format!("{}: no reason recorded", state_word(s.state)),
            },
            WaitOutcome::TimedOut(Some(s)) => status_summary(s),
            WaitOutcome::TimedOut(None) => format!(
                "no status yet for request {} ({}): is the promoter running?",
                stage.request_id(),
                stage.describe()
            ),
        }
    }
}

async fn stages_bucket(bus: &Bus) -> anyhow::Result<async_nats::jetstream::kv::Store> {
    bus.jetstream()
        .get_key_value(STAGES_BUCKET)
        .await
        .map_err(|e| {
            Unreachable(format!(
                "KV bucket {STAGES_BUCKET} is not there ({e}): is the catalogue recorder running?"
            ))
            .into()
        })
}

fn decode(key: &str, value: &[u8]) -> anyhow::Result<StageStatus> {
    serde_json::from_slice(value)
        .with_context(|| format!("{STAGES_BUCKET} key {key} does not hold a stage status"))
}

/// The wait's answer when `status` ends it, else the status to keep waiting with.
fn outcome(status: StageStatus) -> Result<WaitOutcome, Box<StageStatus>> {
    match status.state {
        StageState::Ready => Ok(WaitOutcome::Ready(status)),
        StageState::Failed | StageState::Released => Ok(WaitOutcome::Failed(status)),
        StageState::Pending | StageState::Copying => Err(Box::new(status)),
    }
}

/// How long a wait goes at most without reading its stage's status again when no fact woke
/// it. A wake can be missed: the user may not read its project's stage facts (an accounts
/// config without those grants), a fact published while the connection reconnects is not
/// delivered again (core NATS), and some changes come with no fact at all (a release, a
/// catalogue rebuilt). Two seconds keeps a missed wake well inside what a job waiting for its
/// data notices — Slurm's burst buffer polls every `PollInterval` (15 s by default), a pod's
/// init container is seconds from starting anyway — while a thousand jobs waiting at once cost
/// the servers five hundred direct gets a second, each answered from the stream's index.
pub const REREAD: Duration = Duration::from_secs(2);

/// The first re-read after a fact woke the wait. The fact comes from the promoter; the
/// recorder writes the status once it has folded that fact, usually within milliseconds, so
/// the wait reads again at once and then after 10 ms, doubling up to [`REREAD`].
const CATCH_UP: Duration = Duration::from_millis(10);

/// The facts that end a stage request (the promoter publishes them on its project's subjects,
/// and its node's for a node's `local` tier): a wait reads its status again when one names its
/// request.
const ENDING_FACTS: [&str; 2] = ["stage.ready", "stage.failed"];

/// Waits until the stage is ready or failed, or `timeout` passes (zero: look once).
pub async fn wait(bus: &Bus, stage: &Stage, timeout: Duration) -> anyhow::Result<WaitOutcome> {
    wait_rereading(bus, stage, timeout, REREAD).await
}

/// [`wait`], reading the status again every `reread` when no fact wakes it.
pub async fn wait_rereading(
    bus: &Bus,
    stage: &Stage,
    timeout: Duration,
    reread: Duration,
) -> anyhow::Result<WaitOutcome> {
    let deadline = Instant::now() + timeout;
    let store = stages_bucket(bus).await?;
    let key = stage.status_key();
    if timeout.is_zero() {
        return Ok(match read(&store, &key).await? {
            Some(status) => outcome(status).unwrap_or_else(|s| WaitOutcome::TimedOut(Some(*s))),
            None => WaitOutcome::TimedOut(None),
        });
    }
    // Subscribed before the first read: a fact published after it wakes the wait.
    let mut wake = Wake::subscribe(bus, stage).await?;
    let mut last = match read(&store, &key).await? {
        Some(status) => match outcome(status) {
            Ok(done) => return Ok(done),
            Err(status) => Some(*status),
        },
        None => None,
    };
    tracing::debug!(%key, ?reread, "waiting for the stage's status: woken by its facts, read again every `reread`");
    let mut pause = reread;
    let mut next = Instant::now() + pause;
    loop {
        let timed_out = tokio::select! {
            _ = tokio::time::sleep_until(deadline.into()) => true,
            _ = tokio::time::sleep_until(next.into()) => false,
            () = wake.woken() => {
                pause = CATCH_UP;
                false
            }
        };
        match read(&store, &key).await {
            Ok(Some(status)) => match outcome(status) {
                Ok(done) => return Ok(done),
                Err(status) => last = Some(*status),
            },
            Ok(None) => last = None,
            // The next read may well answer (a server restarting, a leader being elected):
            // the timeout bounds the wait, not one read; at the timeout the last status read
            // stands.
            Err(e) => {
                tracing::warn!(%key, error = %format!("{e:#}"), "reading the stage's status failed")
            }
        }
        if timed_out {
            return Ok(WaitOutcome::TimedOut(last));
        }
        next = Instant::now() + pause;
        pause = (pause * 2).min(reread);
    }
}

/// The stage's status as stored now: a direct get of its key (by subject, which the accounts
/// confine to the user's projects); `None` while the recorder has written none, or after a
/// delete.
async fn read(
    store: &async_nats::jetstream::kv::Store,
    key: &str,
) -> anyhow::Result<Option<StageStatus>> {
    let entry = store
        .entry(key)
        .await
        .with_context(|| format!("reading {STAGES_BUCKET} key {key}"))?;
    match entry {
        Some(entry) if entry.operation == async_nats::jetstream::kv::Operation::Put => {
            Ok(Some(decode(key, &entry.value)?))
        }
        _ => Ok(None),
    }
}

/// What wakes a wait early: the facts that end its project's stage requests, live. Plain
/// subscriptions, not consumers (see the module's doc). A user that may not read them gets
/// nothing here and waits on re-reads alone.
struct Wake {
    request: EventId,
    facts: futures::stream::SelectAll<async_nats::Subscriber>,
}

impl Wake {
    async fn subscribe(bus: &Bus, stage: &Stage) -> anyhow::Result<Wake> {
        let mut subscribers = Vec::new();
        for kind in ENDING_FACTS {
            let subject =
                subject::event_subject(subject::FACT, kind, stage.node.as_deref(), &stage.project);
            subscribers.push(
                bus.client()
                    .subscribe(subject.clone())
                    .await
                    .with_context(|| format!("subscribing to {subject}"))?,
            );
        }
        Ok(Wake {
            request: stage.request_id(),
            facts: futures::stream::select_all(subscribers),
        })
    }

    /// Returns when a fact ending this wait's request arrives; never, once the subscriptions
    /// have ended.
    async fn woken(&mut self) {
        while let Some(message) = self.facts.next().await {
            let Ok(event) = stagehand_schemas::wire::decode(&message.payload) else {
                continue;
            };
            let request = match &event.body {
                Body::StageReady(ready) => &ready.request_id,
                Body::StageFailed(failed) => &failed.request_id,
                _ => continue,
            };
            if *request == self.request {
                return;
            }
        }
        std::future::pending().await
    }
}

/// Every stage status stored in [`STAGES_BUCKET`] of `project` (of every project when
/// `None`). The keys come from the bucket stream's info (the subjects it holds, listed by the
/// server), each value from a direct get: no consumer, which schedulers may not create.
pub async fn stored_statuses(bus: &Bus, project: Option<&str>) -> anyhow::Result<Vec<StageStatus>> {
    let store = stages_bucket(bus).await?;
    let filter = match project {
        Some(p) => format!("{}{p}.>", store.prefix),
        None => format!("{}>", store.prefix),
    };
    let mut subjects = store
        .stream
        .info_with_subjects(&filter)
        .await
        .with_context(|| format!("listing {STAGES_BUCKET}"))?;
    let mut keys = Vec::new();
    while let Some(subject) = subjects.next().await {
        let (subject, _) = subject.with_context(|| format!("listing {STAGES_BUCKET}"))?;
        if let Some(key) = subject.strip_prefix(store.prefix.as_str()) {
            keys.push(key.to_owned());
        }
    }
    let mut found = Vec::with_capacity(keys.len());
    for key in keys {
        if let Some(status) = read(&store, &key).await? {
            found.push(status);
        }
    }
    Ok(found)
}

/// Which stage requests `stage status` lists: a project's, of one job or of one dataset
/// version (digest or prefix), or all of them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatusFilter {
    pub project: String,
    pub job: Option<String>,
    pub dataset_version: Option<(String, String)>,
}

/// Every stage request the filter admits: of a job or a version as the catalogue lists them
/// (all pages); of the whole project from the project's keys in [`STAGES_BUCKET`] (the
/// catalogue's query needs a job or a dataset), oldest update first.
pub async fn status(bus: &Bus, filter: &StatusFilter) -> anyhow::Result<Vec<StageStatus>> {
    if filter.job.is_none() && filter.dataset_version.is_none() {
        return project_status(bus, &filter.project).await;
    }
    let catalogue = stagehand_catalogue::Catalogue::new(bus.client().clone());
    let (dataset, version) = match &filter.dataset_version {
        Some((d, v)) => (Some(d.as_str()), Some(v.as_str())),
        None => (None, None),
    };
    let mut found = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let page = catalogue
            .stage_requests(
                &filter.project,
                filter.job.as_deref(),
                dataset,
                version,
                after.as_deref(),
            )
            .await
            .map_err(|e| -> anyhow::Error {
                if e.is_retryable() {
                    Unreachable(format!("asking the catalogue for stage requests: {e}")).into()
                } else {
                    anyhow::anyhow!("asking the catalogue for stage requests: {e}")
                }
            })?;
        found.extend(page.items);
        match page.next {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    Ok(found)
}

async fn project_status(bus: &Bus, project: &str) -> anyhow::Result<Vec<StageStatus>> {
    let mut found = stored_statuses(bus, Some(project)).await?;
    found.sort_by_key(|s| s.updated_at);
    Ok(found)
}

/// One line for a person: state, what and where, and why (or how far along, or the path).
pub fn status_summary(s: &StageStatus) -> String {
    let mut line = state_word(s.state).to_owned();
    if let Some(w) = &s.waiting_for {
        line.push_str(&format!(" (waiting for {w})"));
    }
    if let Some(p) = &s.progress {
        line.push_str(&format!(
            " {}/{} files, {}/{} bytes",
            p.files_done, p.files_total, p.bytes_done, p.bytes_total
        ));
        if let Some(eta) = p.eta_seconds {
            line.push_str(&format!(", about {eta} s left"));
        }
    }
    if let Some(r) = &s.reason {
        line.push_str(&format!(": {r}"));
    }
    // As of now, not as of the fact: a scheduler polling it sees the time left shrink.
    if let Some(e) = &s.ready_estimate {
        line.push_str(&format!(
            "; {}",
            e.describe(stagehand_schemas::event::now())
        ));
    }
    if let Some(path) = &s.path {
        if s.state == StageState::Released {
            line.push_str(&format!(" (was at {path})"));
        } else {
            line.push_str(&format!(" at {path}"));
        }
    }
    if let Some(until) = s.hold_until
        && matches!(
            s.state,
            StageState::Pending | StageState::Copying | StageState::Ready
        )
    {
        let word = if s.holds_at(stagehand_schemas::event::now()) {
            "held until"
        } else {
            "hold lapsed at"
        };
        let until = until
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap_or_else(|_| until.to_string());
        line.push_str(&format!(" ({word} {until})"));
    }
    line
}

/// `stage status`'s text: one line per request.
pub fn status_text(items: &[StageStatus]) -> String {
    if items.is_empty() {
        return "no stage requests\n".to_owned();
    }
    let mut out = String::new();
    for s in items {
        let node = s
            .node
            .as_deref()
            .map(|n| format!(" node {n}"))
            .unwrap_or_default();
        out.push_str(&format!(
            "{}/{}@{} on {}{node} for job {}: {}\n",
            s.project,
            s.dataset,
            s.version,
            s.tier,
            s.job_id,
            status_summary(s),
        ));
    }
    out
}

/// What `cancel` found and did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Cancelled {
    /// The stage request's id.
    pub request_id: EventId,
    /// Its state when the cancel was asked (`pending`, `copying`, `ready`, …).
    pub was: &'static str,
    /// What was done: `failing` (the promoter fails it with the reason), `released` (a ready
    /// stage: released for its job), or `nothing` (it had already failed or been released).
    pub done: &'static str,
    /// The reason waiters see: `cancelled by <who>: <why>`.
    pub reason: String,
    /// The operator action recorded (none when nothing was done).
    pub action_id: Option<EventId>,
}

/// The id of the job's stage request of `stage`'s dataset, tier and node whose version is
/// `stage`'s written another way (one spelling a prefix of the other), from the catalogue's
/// index of the job's requests; none when there is no such request, or more than one.
async fn spelled_otherwise(bus: &Bus, stage: &Stage) -> anyhow::Result<Option<EventId>> {
    let catalogue = stagehand_catalogue::Catalogue::new(bus.client().clone());
    let (mut found, mut after) = (Vec::new(), None::<String>);
    loop {
        let page = catalogue
            .stage_requests(
                &stage.project,
                Some(&stage.job),
                Some(&stage.dataset),
                None,
                after.as_deref(),
            )
            .await
            .with_context(|| format!("the stage requests of job {}", stage.job))?;
        found.extend(page.items.into_iter().filter(|s| {
            s.tier == stage.tier
                && s.node == stage.node
                && (s.version.starts_with(&stage.version) || stage.version.starts_with(&s.version))
        }));
        match page.next {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    Ok(match found.as_slice() {
        [one] => Some(one.request_id.clone()),
        _ => None,
    })
}

/// Cancels `stage` as `by`, for `why`: a pending or copying stage is failed by its promoter
/// with the reason `cancelled by <by>: <why>` (waiters see `failed`; its reserved space and
/// quota are given back), a ready one is released for its job (as its teardown would), and one
/// already failed or released is left alone. Each cancel that does something is recorded as
/// an `operator.action` fact. Both are published as the operator: only Stagehand's operator
/// user may publish operator actions (`deploy/nats/accounts.conf`), and the promoter looks the
/// request up under the action's own project, so a cancel cannot reach another project's
/// stage.
pub async fn cancel(bus: &Bus, stage: &Stage, by: &str, why: &str) -> anyhow::Result<Cancelled> {
    if why.trim().is_empty() {
        anyhow::bail!("--reason must say why the stage is cancelled");
    }
    let store = stages_bucket(bus).await?;
    let mut request_id = stage.request_id();
    let mut status = read(&store, &stage.status_key()).await?;
    if status.is_none() {
        // The job may have written the version otherwise (a digest where this names a
        // prefix, or the other way round): its request, as the promoter's release matches it.
        if let Some(id) = spelled_otherwise(bus, stage).await? {
            status = read(
                &store,
                &stagehand_catalogue::stage_kv_key(&stage.project, &id),
            )
            .await?;
            request_id = id;
        }
    }
    let Some(status) = status else {
        anyhow::bail!(
            "no stage request of project {} for {} is recorded (see `stagehand stage status --project {}`)",
            stage.project,
            stage.describe(),
            stage.project
        );
    };
    let reason = format!("cancelled by {by}: {why}");
    let was = state_word(status.state);
    let done = match status.state {
        StageState::Failed | StageState::Released => {
            return Ok(Cancelled {
                request_id,
                was,
                done: "nothing",
                reason,
                action_id: None,
            });
        }
        StageState::Ready => "released",
        StageState::Pending | StageState::Copying => "failing",
    };
    let act = crate::dlq::action_event(
        &stage.project,
        Some(&request_id),
        &[request_id.as_str().as_bytes()],
        stagehand_schemas::OperatorAction {
            action: stagehand_schemas::action::STAGE_CANCEL.into(),
            by: by.to_owned(),
            target: format!("stage {}", stage.describe()),
            reason: why.to_owned(),
            service: None,
            dead_letter_id: None,
            dead_letter_sequence: None,
            request_id: Some(request_id.clone()),
        },
    );
    // The action first: only Stagehand's operator may state it, so a user who may release
    // stages (a scheduler) but not cancel them is refused here, before anything is released.
    bus.publish(&act)
        .await
        .with_context(|| format!("recording the cancel of {}", stage.describe()))?;
    if status.state == StageState::Ready {
        let release = Event::request(
            EventId::derive(&request_id, "release:cancelled"),
            stage.project.clone(),
            Body::StageReleased(stage.released(Some(reason.clone()))),
        );
        bus.publish(&release)
            .await
            .with_context(|| format!("publishing the release of {}", stage.describe()))?;
    }
    Ok(Cancelled {
        request_id,
        was,
        done,
        reason,
        action_id: Some(act.id),
    })
}

/// `stage where`'s exit code when no node holds a usable copy: distinct from 1 and 2, which
/// `stage wait` answers with (failed, timed out), and from the errors' 64–70.
pub const EX_NOWHERE: i32 = 3;

/// One node's copy of a version on a node-local tier, as `stage where` lists it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct NodeCopy {
    pub node: String,
    pub tier: String,
    pub files: u64,
    pub bytes: u64,
    /// Where the copy is, beneath the tier's root on that node.
    pub prefix: String,
    /// How the copy was proven when it was made (`read-back`, `hashed-in-flight`, …).
    pub verified_by: Option<String>,
    /// When a scrub last read it back whole and found it intact (`replica.verified`).
    #[serde(with = "stagehand_catalogue::time::utc::option")]
    pub last_verified: Option<OffsetDateTime>,
    /// When the copy was made (or last repaired), if the catalogue knows.
    #[serde(with = "stagehand_catalogue::time::utc::option")]
    pub made_at: Option<OffsetDateTime>,
    /// The copy's state: `present` for a usable one; `damaged` (its repair pending or under
    /// way), `unreachable` (its node's agent silent) or `staging` for one that is not.
    pub state: String,
    /// Why it is not usable, when it is not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// Where a version is cached: the nodes holding a usable copy on a node-local tier, and those
/// whose copy is there but may not be handed to a job.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Whereabouts {
    pub project: String,
    pub dataset: String,
    /// The full digest (the version as asked when the catalogue has no such version).
    pub version: String,
    /// Usable copies, by node then tier.
    pub nodes: Vec<NodeCopy>,
    /// Copies that are there but not usable (damaged, being repaired, on a node out of
    /// reach), by node then tier.
    pub unusable: Vec<NodeCopy>,
}

impl Whereabouts {
    /// 0 when some node holds a usable copy, else [`EX_NOWHERE`].
    pub fn exit_code(&self) -> i32 {
        if self.nodes.is_empty() { EX_NOWHERE } else { 0 }
    }

    /// The nodes holding a usable copy, each once, comma separated: what Slurm's
    /// `--nodelist`/`--exclude` and a Kubernetes affinity's hostname values take.
    pub fn hostlist(&self) -> String {
        let nodes: std::collections::BTreeSet<&str> =
            self.nodes.iter().map(|c| c.node.as_str()).collect();
        nodes.into_iter().collect::<Vec<_>>().join(",")
    }

    /// One line per copy, usable ones first; a line saying so when no node holds one.
    pub fn text(&self) -> String {
        use stagehand_catalogue::time::human;
        let mut out = String::new();
        let what = format!("{}/{}@{}", self.project, self.dataset, self.version);
        if self.nodes.is_empty() {
            out.push_str(&format!(
                "no node holds a usable copy of {what} on a node-local tier\n"
            ));
        } else {
            out.push_str(&format!("{what} is on:\n"));
        }
        for c in &self.nodes {
            let verified = match (c.last_verified, c.made_at) {
                (Some(at), _) => format!("last verified {}", human(at)),
                (None, Some(made)) => format!(
                    "not scrubbed yet (made {}, verified by {})",
                    human(made),
                    c.verified_by.as_deref().unwrap_or("-")
                ),
                (None, None) => "not scrubbed yet".to_owned(),
            };
            out.push_str(&format!(
                "  {:<20} {:<10} {:>14} bytes  {verified}\n",
                c.node, c.tier, c.bytes
            ));
        }
        if !self.unusable.is_empty() {
            out.push_str("not usable:\n");
        }
        for c in &self.unusable {
            // The catalogue's reason names the state (`damaged (found by scrub): …`).
            out.push_str(&format!(
                "  {:<20} {:<10} {:>14} bytes  {}\n",
                c.node,
                c.tier,
                c.bytes,
                c.reason.as_deref().unwrap_or(&c.state)
            ));
        }
        out
    }
}

/// Which copies `stage where` asks about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WhereQuery {
    pub project: String,
    pub dataset: String,
    /// A digest or a unique prefix of one (12+ hex characters).
    pub version: String,
    /// Only this node-local tier; default every one.
    pub tier: Option<String>,
}

/// The nodes holding a copy of the version on a node-local tier (a replica the catalogue
/// records with a node), from the catalogue's record of the version and its replicas, all
/// pages; the version resolved by the catalogue as every stage command's is (a digest or a
/// unique prefix). Asked within the project: a project sees its own versions only, and a
/// version it does not have is one no node holds. Usable is [`ReplicaRecord::is_usable`],
/// the one rule of the catalogue's views; a removed copy is not listed at all.
///
/// [`ReplicaRecord::is_usable`]: stagehand_catalogue::ReplicaRecord::is_usable
pub async fn cached_on(bus: &Bus, q: &WhereQuery) -> anyhow::Result<Whereabouts> {
    use stagehand_catalogue::{Answer, Query, ReplicaState};

    let catalogue = stagehand_catalogue::Catalogue::new(bus.client().clone())
        .with_timeout(crate::catalogue::TIMEOUT);
    let what = format!("{}/{}@{}", q.project, q.dataset, q.version);
    let failed = |e: stagehand_catalogue::CatalogueError| -> anyhow::Error {
        if e.is_retryable() {
            Unreachable(format!("asking the catalogue where {what} is: {e}")).into()
        } else {
            anyhow::anyhow!("asking the catalogue where {what} is: {e}")
        }
    };
    let mut found = Whereabouts {
        project: q.project.clone(),
        dataset: q.dataset.clone(),
        version: q.version.clone(),
        nodes: Vec::new(),
        unusable: Vec::new(),
    };
    let detail = match catalogue
        .version(Some(&q.project), &q.dataset, &q.version)
        .await
    {
        Ok(detail) => detail,
        Err(e) if e.is_not_found() => return Ok(found),
        Err(e) => return Err(failed(e)),
    };
    found.version = detail.version.version.clone();
    let mut replicas = detail.replicas;
    let mut next = detail.replicas_next;
    while let Some(after) = next {
        let answer = catalogue
            .ask(&Query::Replicas {
                project: Some(q.project.clone()),
                dataset: q.dataset.clone(),
                version: found.version.clone(),
                limit: None,
                after: Some(after),
            })
            .await
            .map_err(failed)?;
        let Answer::Replicas {
            replicas: more,
            next: n,
        } = answer
        else {
            anyhow::bail!("the catalogue answered a replicas query of {what} with another answer");
        };
        replicas.extend(more);
        next = n;
    }
    for r in replicas {
        let Some(node) = r.node.clone() else {
            continue;
        };
        if q.tier.as_ref().is_some_and(|t| *t != r.tier) || r.state == ReplicaState::Removed {
            continue;
        }
        let usable = r.is_usable();
        let copy = NodeCopy {
            node,
            tier: r.tier.clone(),
            files: r.files,
            bytes: r.total_bytes,
            prefix: r.prefix.clone(),
            verified_by: r.verified_by.clone(),
            last_verified: r.last_verified.as_ref().map(|v| v.stamp.at),
            made_at: r
                .last_repaired
                .as_ref()
                .map(|x| &x.stamp)
                .or(r.copied.as_ref())
                .map(|s| s.at),
            state: r.state.as_str().to_owned(),
            reason: (!usable).then(|| r.reason.clone()).flatten(),
        };
        if usable {
            found.nodes.push(copy);
        } else {
            found.unusable.push(copy);
        }
    }
    let order = |a: &NodeCopy, b: &NodeCopy| (&a.node, &a.tier).cmp(&(&b.node, &b.tier));
    found.nodes.sort_by(order);
    found.unusable.sort_by(order);
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn copy(node: &str, tier: &str) -> NodeCopy {
        NodeCopy {
            node: node.into(),
            tier: tier.into(),
            files: 2,
            bytes: 20_002,
            prefix: "lab/shards/ab".into(),
            verified_by: Some("read-back".into()),
            last_verified: None,
            made_at: None,
            state: "present".into(),
            reason: None,
        }
    }

    fn found(nodes: Vec<NodeCopy>, unusable: Vec<NodeCopy>) -> Whereabouts {
        Whereabouts {
            project: "lab".into(),
            dataset: "shards".into(),
            version: "ab".into(),
            nodes,
            unusable,
        }
    }

    #[test]
    fn the_hostlist_names_each_node_once_and_only_usable_ones() {
        let damaged = NodeCopy {
            state: "damaged".into(),
            reason: Some("damaged (found by scrub): 1 path(s)".into()),
            ..copy("gpu-03", "local")
        };
        let w = found(
            vec![
                copy("gpu-07", "local"),
                copy("gpu-07", "nvme2"),
                copy("gpu-12", "local"),
            ],
            vec![damaged],
        );
        assert_eq!(w.hostlist(), "gpu-07,gpu-12");
        assert_eq!(w.exit_code(), 0);
        let text = w.text();
        assert!(text.starts_with("lab/shards@ab is on:\n"), "{text}");
        assert!(
            text.ends_with("not usable:\n  gpu-03               local               20002 bytes  damaged (found by scrub): 1 path(s)\n"),
            "{text}"
        );
    }

    #[test]
    fn a_queued_copy_shows_what_is_ahead_and_when_it_should_be_ready() {
        let now = stagehand_schemas::event::now();
        let mut status = StageStatus {
            request_id: EventId::new("job-1.stage").unwrap(),
            project: "lab".into(),
            dataset: "shards".into(),
            version: "ab".into(),
            resolved_version: None,
            tier: "hot".into(),
            node: None,
            job_id: "1".into(),
            state: StageState::Pending,
            waiting_for: Some("copy".into()),
            reason: Some("waiting for one of 1 copy slots (class batch)".into()),
            retryable: None,
            path: None,
            progress: None,
            ready_estimate: Some(stagehand_schemas::ReadyEstimate {
                from_tier: "capacity".into(),
                to_tier: "hot".into(),
                bytes_ahead: 4000,
                copies_ahead: 2,
                bytes: 1000,
                bytes_per_second: Some(100),
                ready_at: Some(now + time::Duration::seconds(600)),
            }),
            updated_at: now,
            hold_until: None,
        };
        let line = status_summary(&status);
        assert!(
            line.contains("4000 bytes in 2 copies queued ahead on capacity -> hot; ready in about"),
            "{line}"
        );
        assert!(line.contains("at 100 bytes/s measured"), "{line}");
        let json = serde_json::to_value(&status).unwrap();
        assert_eq!(json["ready_estimate"]["bytes_ahead"], 4000, "{json}");

        if let Some(e) = status.ready_estimate.as_mut() {
            (e.bytes_per_second, e.ready_at) = (None, None);
        }
        let line = status_summary(&status);
        assert!(
            line.ends_with("; no estimate yet (no copy on that pair measured)"),
            "{line}"
        );
    }

    #[test]
    fn no_usable_copy_is_an_empty_hostlist_and_exit_3() {
        let w = found(Vec::new(), Vec::new());
        assert_eq!(w.hostlist(), "");
        assert_eq!(w.exit_code(), EX_NOWHERE);
        assert_eq!(
            w.text(),
            "no node holds a usable copy of lab/shards@ab on a node-local tier\n"
        );
    }
}
