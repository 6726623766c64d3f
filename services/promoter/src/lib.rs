//! The promoter: answers scheduler stage requests by putting a verified copy of a dataset
//! version on the requested tier and saying where it is.
//!
//! For each `stage.requested` (the contract of `STAGING.md`) it resolves the version through
//! the catalogue (a unique prefix of 12 or more hex characters will do), picks a verified
//! replica on a source tier in the order of `promotion.toml`, and copies it with the mover's
//! set copy to `<project>/<dataset>/<full version>/` on the target tier — staged hidden,
//! verified per the policy (`read-back` or `hashed-in-flight`), published by one rename — then
//! publishes `replica.created` and `stage.ready` with the absolute path. A version already on
//! the tier is ready at once; fifty requests for one version make one copy. A request for a
//! version not validated (or prepared) yet waits, visibly (`stage.pending` with what it waits
//! for and why), in the promoter's own redb state, and is answered when the fact arrives or
//! fails when its deadline passes. Failures say what a person can do: an unknown dataset, a
//! rejected version (with the rejection's problems), an ambiguous prefix (with the
//! candidates), a damaged source file (named), a full tier, an exceeded quota.
//!
//! One binary, two roles: the shared promoter (every `hot` tier request), and, with
//! `node = "<name>"` in `[service]`, the agent of that node, which answers the requests for
//! that node's `local` tier from the hot tier (`promotion.toml`'s `local_sources`).
//!
//! It runs three workers and a clock in one task group:
//!
//! | task | consumer | what |
//! | --- | --- | --- |
//! | `requests` | `promoter` (shared by every instance; a node agent: `promoter-node-<node>`) | `stage.requested`, `stage.released` (a node agent: those addressed to its node) |
//! | `facts` | `promoter-facts-<instance>` (one per instance) | `dataset.validated`, `dataset.prepared`, `dataset.rejected`, `replica.created`, `replica.removed`, `replica.repaired`: wake the requests this instance holds; `replica.damaged` of a copy it writes that a job holds: repaired now (`promoter/repair.rs`) |
//! | `ingests` | `promoter-ingests-<instance>` | `ingest.requested`: an upload in progress makes a request for it wait instead of fail |
//! | `offloads` | `promoter-offload-<node>` (a node agent only) | `checkpoint.part.committed` of its node: the part copied to the offload tier; `checkpoint.committed`: this node's parts of the step removed from its local tier (`promoter/leave_node.rs`) |
//! | `steps` | `promoter-steps` (the shared promoter, shared by its instances) | `checkpoint.part.offloaded`: the step committed once every part is offloaded — one catalogue question per part, however many nodes |
//! | `clock` | — | `promotion.toml`'s `recheck_every`, and every deadline as it comes |
//! | `reconciler` | — | at start and every `reconcile_every`: space reserved with no live request and no replica is given back |
//! | `fanout` | — | a node agent with `[service.fanout]` only: serves the pieces of versions it stages to the other nodes' agents ([`fanout`]) |
//! | `liveness` | — | a node agent only: its node's liveness record every `agent_beat_every`, and its copies the catalogue holds unreachable re-checked by fingerprint (`promoter/liveness.rs`) |
//!
//! Several instances share the requests consumer (the runtime's claims keep each message to
//! one); the copy of one version to one tier is leased in the KV bucket
//! [`stagehand_bus::PROMOTER_BUCKET`] so it is done once across instances, and space is reserved there with a
//! compare-and-set ([`kv`]).

pub mod fanout;
pub mod kv;
mod promoter;
pub mod resolve;
mod reuse;
pub mod state;

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;
use stagehand_bus::runner::{
    self, Context, InvalidKey, ServiceConfig, ServiceError, ServiceSettings,
};
use stagehand_bus::{
    BusError, CancellationToken, Handler, HandlerError, RetrySchedule, WorkContext, WorkerConfig,
};
use stagehand_catalogue::Catalogue;
use stagehand_manifest::Spool;
use stagehand_mover::{Mover, MoverConfig, TransferError};
use stagehand_policy::{Opening, Policies, PolicyError, TierRole};
use stagehand_schemas::{Event, Retryable, subject};

pub use promoter::{
    Parts, Promoter, STEP_FAILED, STEP_READY, step_pending, step_repaired, step_replica,
    step_returned,
};
pub use reuse::step_damaged;

/// The service name: its shared durable consumer, its dead-letter subject, its metric label.
pub const SERVICE: &str = "promoter";

/// The promoter's own settings: the `[service]` table of its configuration file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// The policy folder (`tiers.toml`, `promotion.toml`, …).
    pub policies_dir: PathBuf,
    /// Where the promoter keeps its state and ledgers.
    pub state_dir: PathBuf,
    /// Run as the agent of this node: answer the stage requests for the `local` tier that
    /// name it, and no others. Absent: the shared promoter (every `hot` request).
    #[serde(default)]
    pub node: Option<String>,
    /// This instance's name, unique among running promoters (its own facts consumer and copy
    /// leases carry it). Default: the host name; `node-<node>` for a node agent.
    #[serde(default)]
    pub instance: Option<String>,
    /// How often a copy publishes its progress (`"1s"`).
    #[serde(
        default = "defaults::progress_every",
        with = "stagehand_config::duration"
    )]
    pub progress_every: Duration,
    /// How long a copy lease lasts without renewal before another instance takes the copy
    /// over (`"30s"`).
    #[serde(
        default = "defaults::lease_lifetime",
        with = "stagehand_config::duration"
    )]
    pub lease_lifetime: Duration,
    /// How long to wait for the catalogue's answers (`"10s"`).
    #[serde(
        default = "defaults::catalogue_timeout",
        with = "stagehand_config::duration"
    )]
    pub catalogue_timeout: Duration,
    /// The mover's tunables (engine, concurrency, block size, bandwidth limit).
    #[serde(default)]
    pub mover: MoverConfig,
    /// A node agent only: fetch pieces of a version from the other nodes' agents staging it
    /// too, and serve them this node's (`[service.fanout]`, [`fanout`]). Absent: every node
    /// reads the whole version from the shared tier.
    #[serde(default)]
    pub fanout: Option<fanout::FanoutSettings>,
}

mod defaults {
    use std::time::Duration;
    pub fn progress_every() -> Duration {
        Duration::from_secs(1)
    }
    pub fn lease_lifetime() -> Duration {
        Duration::from_secs(30)
    }
    pub fn catalogue_timeout() -> Duration {
        Duration::from_secs(10)
    }
}

/// The whole configuration: `[bus]`, `[worker]`, `[telemetry]` and [`Settings`] as `[service]`.
pub type Config = ServiceConfig<Settings>;

impl Settings {
    /// Settings with every tunable at its default.
    pub fn new(policies_dir: impl Into<PathBuf>, state_dir: impl Into<PathBuf>) -> Self {
        Self {
            policies_dir: policies_dir.into(),
            state_dir: state_dir.into(),
            node: None,
            instance: None,
            progress_every: defaults::progress_every(),
            lease_lifetime: defaults::lease_lifetime(),
            catalogue_timeout: defaults::catalogue_timeout(),
            mover: MoverConfig::default(),
            fanout: None,
        }
    }

    /// Settings for a one-machine stack under `home` (`stagehand up`).
    pub fn dev(home: &std::path::Path, policies_dir: &std::path::Path) -> Self {
        Self::new(policies_dir, home.join("state").join(SERVICE))
    }

    /// This instance's name: `instance`, else `node-<node>` for a node agent, else the host name.
    pub fn instance_name(&self) -> String {
        let name = match (&self.instance, &self.node) {
            (Some(instance), _) => instance.clone(),
            // One agent per node: named by its node, so that its consumers and heartbeat are
            // the ones its node's NATS user is granted (`NODE_<N>` in accounts.conf).
            (None, Some(node)) => stagehand_bus::accounts::node_user(node),
            (None, None) => stagehand_bus::host_name(),
        };
        // A consumer name and a KV key token.
        name.chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                    c.to_ascii_lowercase()
                } else {
                    '-'
                }
            })
            .collect()
    }

    /// The requests consumer: shared by every shared promoter; one per node agent.
    pub fn requests_consumer(&self) -> String {
        match &self.node {
            Some(node) => format!("{SERVICE}-node-{}", subject::node_token(node)),
            None => SERVICE.to_owned(),
        }
    }

    /// The requests worker with the promoter's defaults, before the `[worker]` table's:
    /// `stage.requested` and `stage.released` on [`Settings::requests_consumer`] — for a node
    /// agent, only those addressed to its node (their subjects name it), so a wave of N
    /// nodes' requests is not handed to every one of N agents.
    pub fn requests_worker(&self) -> WorkerConfig {
        let consumer = self.requests_consumer();
        let kinds = ["stage.requested", "stage.released"];
        let mut cfg = match &self.node {
            None => self.worker(&consumer, subject::REQUESTS.name, &kinds),
            Some(node) => {
                let mut cfg = self.worker(&consumer, subject::REQUESTS.name, &[]);
                cfg.filter_subjects = kinds
                    .iter()
                    .map(|kind| subject::node_kind_filter(subject::REQ, kind, node))
                    .collect();
                cfg
            }
        };
        // Copies run inside the handler of the request that asked (progress acks keep it),
        // so handler slots are more than copy slots: a ready-at-once answer never waits for
        // a copy.
        cfg.concurrency = 16;
        // A node agent is the only instance on its node: no claims needed for its consumer.
        cfg.claims = self.node.is_none();
        // A request is retried while the catalogue catches up with a fact this promoter saw,
        // or a copy lease changes hands: often, and soon, before it could be given up on.
        cfg.max_deliver = 50;
        cfg.retry = soon();
        cfg
    }

    /// The facts worker with the promoter's defaults, on this instance's own consumer (every
    /// instance sees every fact): what wakes the requests it holds.
    pub fn facts_worker(&self) -> WorkerConfig {
        let consumer = format!("{SERVICE}-facts-{}", self.instance_name());
        let kinds = [
            "dataset.validated",
            "dataset.prepared",
            "dataset.rejected",
            "replica.created",
            "replica.removed",
            // A copy this instance writes found damaged: repaired now if a job holds it
            // (`promoter/repair.rs`); a repaired one wakes who waited for the repair.
            "replica.damaged",
            "replica.repaired",
            // An operator's cancel of a stage (`stagehand stage cancel`).
            "operator.action",
        ];
        let mut cfg = self.worker(&consumer, subject::FACTS.name, &kinds);
        // A node agent takes its own node's facts and the shared tiers', not every other
        // node's replicas: N agents staging at once are N deliveries each, not N².
        if let Some(node) = &self.node {
            cfg.filter_subjects = (kinds.iter())
                .flat_map(|kind| subject::node_filters(subject::FACT, kind, node))
                .collect();
        }
        cfg.concurrency = 16;
        // A fact the catalogue has not folded yet is retried soon, and often enough to
        // outlast a slow recorder; the clock is the backstop after that.
        cfg.max_deliver = 30;
        cfg.retry = soon();
        cfg
    }

    /// The ingests worker, on this instance's own consumer: an upload in progress makes a
    /// request for it wait instead of fail.
    pub fn ingests_worker(&self) -> WorkerConfig {
        let consumer = format!("{SERVICE}-ingests-{}", self.instance_name());
        self.worker(&consumer, subject::REQUESTS.name, &["ingest.requested"])
    }

    /// A node agent's offloads worker, on its own consumer: this node's checkpoint part
    /// commits (copied off the node; its consumer's filter names this node, so no other
    /// node's part reaches it) and every step's commit (this node's parts of it leave the
    /// node). `None` for the shared promoter.
    pub fn offloads_worker(&self) -> Option<WorkerConfig> {
        let node = self.node.as_ref()?;
        let consumer = format!("{SERVICE}-offload-{}", subject::node_token(node));
        let mut cfg = self.worker(&consumer, subject::FACTS.name, &["checkpoint.committed"]);
        cfg.filter_subjects.push(subject::node_kind_filter(
            subject::FACT,
            "checkpoint.part.committed",
            node,
        ));
        cfg.concurrency = 4;
        // An offload waits for space on a bounded offload tier before it copies, and a step's
        // commit for the catalogue to fold it before its parts leave the node.
        Some(checkpoint_part_retries(cfg))
    }

    /// The shared promoter's steps worker, on one consumer its instances share: each
    /// `checkpoint.part.offloaded`, once the catalogue has folded it, may complete its step.
    /// Answered once, not by every node's agent: a step of N parts costs N catalogue questions,
    /// not N², and completes whether or not the node that offloaded last is still up.
    /// `None` for a node agent.
    pub fn steps_worker(&self) -> Option<WorkerConfig> {
        if self.node.is_some() {
            return None;
        }
        let consumer = format!("{SERVICE}-steps");
        let mut cfg = self.worker(
            &consumer,
            subject::FACTS.name,
            &["checkpoint.part.offloaded"],
        );
        cfg.concurrency = 4;
        cfg.claims = true;
        // Retried until the catalogue folds the offload.
        Some(checkpoint_part_retries(cfg))
    }

    /// A worker of `consumer` on `stream` for `kinds`, its ledger beside the state.
    fn worker(&self, consumer: &str, stream: &str, kinds: &[&str]) -> WorkerConfig {
        let class = if stream == subject::FACTS.name {
            "fact"
        } else {
            "req"
        };
        WorkerConfig::new(
            consumer,
            stream,
            kinds
                .iter()
                .map(|k| subject::kind_filter(class, k))
                .collect(),
            self.state_dir.join(format!("{consumer}.redb")),
        )
    }
}

/// Attempts of a checkpoint part fact before it is dead-lettered: all the runtime keeps.
const OFFLOAD_ATTEMPTS: u32 = stagehand_bus::ledger::MAX_ATTEMPTS_KEPT as u32;

/// `cfg` retrying a checkpoint part fact for as long as it may have to wait (the catalogue to
/// fold a fact, soon; space on the offload tier, long after): every attempt the runtime keeps,
/// backing off to 5 min — about 8 hours before a part still waiting is dead-lettered;
/// `stagehand status` shows it late long before.
fn checkpoint_part_retries(mut cfg: WorkerConfig) -> WorkerConfig {
    cfg.max_attempts = OFFLOAD_ATTEMPTS;
    cfg.max_deliver = i64::from(OFFLOAD_ATTEMPTS) + 1;
    cfg.retry = RetrySchedule {
        max: Duration::from_secs(300),
        ..soon()
    };
    cfg
}

/// Retries for what the promoter waits on to catch up (the catalogue, a copy lease): from
/// 200 ms to 10 s.
fn soon() -> RetrySchedule {
    RetrySchedule {
        initial: Duration::from_millis(200),
        max: Duration::from_secs(10),
        ..RetrySchedule::default()
    }
}

impl ServiceSettings for Settings {
    /// A node agent's heartbeat is its own, beside the shared promoter's and the other
    /// agents' on the same host: [`Settings::instance_name`].
    fn instance(&self) -> Option<String> {
        (self.instance.is_some() || self.node.is_some()).then(|| self.instance_name())
    }

    fn validate(&self) -> Result<(), InvalidKey> {
        if self.policies_dir.as_os_str().is_empty() {
            return Err(InvalidKey::new(
                "policies_dir",
                "must name the policy folder",
            ));
        }
        if let Some(node) = &self.node
            && (node.is_empty() || node.len() > 64)
        {
            return Err(InvalidKey::new(
                "node",
                "must be a node name of 1-64 characters",
            ));
        }
        if let Some(i) = &self.instance
            && (i.is_empty() || i.len() > 64)
        {
            return Err(InvalidKey::new(
                "instance",
                "must be a name of 1-64 characters",
            ));
        }
        if let Some(f) = &self.fanout {
            if self.node.is_none() {
                return Err(InvalidKey::new(
                    "fanout",
                    "only a node agent (node = \"...\") fans versions out",
                ));
            }
            if let Err(e) = f.advertised() {
                return Err(InvalidKey::new("fanout", e.to_string()));
            }
            if f.parallel == 0 || f.claim_patience.is_zero() {
                return Err(InvalidKey::new(
                    "fanout",
                    "parallel and claim_patience must be more than 0",
                ));
            }
        }
        for (key, d) in [
            ("progress_every", self.progress_every),
            ("lease_lifetime", self.lease_lifetime),
            ("catalogue_timeout", self.catalogue_timeout),
        ] {
            if d.is_zero() {
                return Err(InvalidKey::new(key, "must be longer than 0"));
            }
        }
        Ok(())
    }
}

/// A configuration for running the promoter in-process against `nats_url` (tests,
/// `stagehand up`): every other table at its defaults.
pub fn config(
    nats_url: &str,
    policies_dir: impl Into<PathBuf>,
    state_dir: impl Into<PathBuf>,
) -> Config {
    ServiceConfig::in_process(SERVICE, nats_url, Settings::new(policies_dir, state_dir))
}

/// Why the promoter could not start or stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PromoterError {
    /// A policy file is wrong, or `promotion.toml`, which the promoter needs, is absent.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    #[error(transparent)]
    State(#[from] state::StateError),
    #[error("starting the mover: {0}")]
    Mover(#[source] Box<TransferError>),
    /// `[service.fanout]` is wrong, or its address cannot be listened on.
    #[error(transparent)]
    Fanout(#[from] fanout::FanoutError),
    #[error(transparent)]
    Bus(#[from] BusError),
    /// The state folder, one of its tasks, or the runner (configuration, metrics endpoint).
    #[error(transparent)]
    Service(#[from] ServiceError),
}

impl Retryable for PromoterError {
    /// Whether starting again unchanged can succeed.
    fn is_retryable(&self) -> bool {
        match self {
            PromoterError::Policy(_) | PromoterError::Mover(_) => false,
            PromoterError::Fanout(e) => e.is_retryable(),
            PromoterError::State(e) => e.is_retryable(),
            PromoterError::Bus(e) => e.is_retryable(),
            PromoterError::Service(e) => e.is_retryable(),
        }
    }
}

/// Runs the promoter through the service runner until `shutdown` is cancelled.
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), PromoterError> {
    runner::run(SERVICE, config, shutdown, serve)
        .await
        .map_err(runner::RunError::into_service_error)
}

/// What the runner calls (the binary's `main`): the three workers, the clock and the
/// reconciler over one [`Promoter`], until shutdown.
pub async fn serve(ctx: Context<Settings>) -> Result<(), PromoterError> {
    let requests = ctx.worker(ctx.settings.requests_worker());
    let facts = ctx.own_worker(ctx.settings.facts_worker())?;
    let ingests = ctx.own_worker(ctx.settings.ingests_worker())?;
    let mut tasks = ctx.tasks();
    let token = tasks.shutdown().clone();
    let (promoter, serving) = open(&ctx, [&facts, &ingests], token.clone()).await?;
    if let Some(serving) = serving {
        tasks.spawn("fanout", serving);
    }
    let worker = |cfg, handler| ctx.run_worker_until(cfg, handler, token.clone());
    tasks.spawn(
        "requests",
        worker(requests, Handlers::Requests(promoter.clone())),
    );
    tasks.spawn("facts", worker(facts, Handlers::Facts(promoter.clone())));
    tasks.spawn(
        "ingests",
        worker(ingests, Handlers::Facts(promoter.clone())),
    );
    if let Some(offloads) = ctx.settings.offloads_worker() {
        let offloads = ctx.own_worker(offloads)?;
        tasks.spawn(
            "offloads",
            worker(offloads, Handlers::Offloads(promoter.clone())),
        );
    }
    if let Some(steps) = ctx.settings.steps_worker() {
        let steps = ctx.worker(steps);
        tasks.spawn("steps", worker(steps, Handlers::Offloads(promoter.clone())));
    }
    tasks.spawn("clock", promoter.clone().clock());
    tasks.spawn("liveness", promoter.clone().liveness());
    tasks.spawn("reconciler", promoter.reconciler());
    Ok(ctx.join(tasks).await?)
}

/// The promoter of `ctx`'s settings: its policies, the tiers (those it writes created and
/// swept), its state, its copy leases, its mover; `watched` are the workers whose consumers
/// wake the requests it holds, `shutdown` stops its copies.
async fn open(
    ctx: &Context<Settings>,
    watched: [&WorkerConfig; 2],
    shutdown: CancellationToken,
) -> Result<(Promoter, Option<fanout::Serving>), PromoterError> {
    let s = &ctx.settings;
    let policies = Policies::load_dir(&s.policies_dir)?;
    let promotion = (policies.promotion().cloned())
        .ok_or_else(|| policies.needed("promotion.toml", SERVICE))?;
    // The tiers it writes are created, and swept of dead writers' temporaries (a dead copy's
    // young staging folder is kept for the resume); the others must exist.
    let tiers = policies
        .open_tiers(|tier| match tier.role {
            TierRole::Hot | TierRole::Local => Some(Opening::write().creating_root()),
            _ => Some(Opening::read()),
        })
        .await;
    let spool_dir = s.state_dir.join("spool");
    runner::create_state_dirs([s.state_dir.as_path(), &spool_dir])?;
    let instance = s.instance_name();
    let consumer = s.requests_consumer();
    let state = state::State::open(&s.state_dir.join(format!("{consumer}-state.redb")))?;
    let bucket = ctx.bus.provision_kv(&stagehand_bus::PROMOTER).await?;
    let mover = Mover::new(s.mover.clone()).map_err(|e| PromoterError::Mover(Box::new(e)))?;
    let (fanout, serving) = match (&s.fanout, &s.node) {
        (Some(settings), Some(node)) => {
            let board = ctx.bus.provision_kv(&stagehand_bus::SWARMS).await?;
            let (f, serving) =
                fanout::Fanout::bind(settings, node, board, ctx.bus.clone(), shutdown.clone())
                    .await?;
            (Some(f), Some(serving))
        }
        _ => (None, None),
    };
    tracing::info!(%instance, node = s.node.as_deref().unwrap_or("-"), consumer = %consumer, "promoter ready");
    let promoter = Promoter::new(Parts {
        bus: ctx.bus.clone(),
        catalogue: Catalogue::new(ctx.bus.client().clone()).with_timeout(s.catalogue_timeout),
        policies,
        promotion,
        tiers,
        node: s.node.clone(),
        state,
        coordination: kv::Coordination::new(bucket, &instance, s.lease_lifetime),
        mover,
        spool: Spool::in_dir(spool_dir),
        progress_every: s.progress_every,
        shutdown,
        // (stream, consumer) of each: the stream's name as the schemas declare it.
        watched: watched
            .iter()
            .filter_map(|w| {
                let stream = subject::STREAMS.iter().find(|st| st.name == w.stream)?;
                Some((stream.name, w.service.clone()))
            })
            .collect(),
        fanout,
    });
    Ok((promoter, serving))
}

/// The handlers of the promoter's workers.
enum Handlers {
    /// The requests consumer's: stage requests and releases.
    Requests(Promoter),
    /// The facts and ingests consumers': what wakes a request that waits.
    Facts(Promoter),
    /// A node agent's offloads consumer: checkpoint parts.
    Offloads(Promoter),
}

impl Handler for Handlers {
    async fn handle(&self, event: &Event, ctx: &WorkContext) -> Result<Vec<Event>, HandlerError> {
        match self {
            Handlers::Requests(p) => p.on_request(event, Some(ctx)).await,
            Handlers::Facts(p) => p.on_fact(event, Some(ctx)).await,
            Handlers::Offloads(p) => p.on_part(event, Some(ctx)).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(node: Option<&str>) -> Settings {
        let mut s = Settings::dev(std::path::Path::new("/h"), std::path::Path::new("/p"));
        s.node = node.map(str::to_owned);
        s
    }

    fn consumes(cfg: &WorkerConfig, kind: &str) -> bool {
        cfg.filter_subjects
            .contains(&subject::kind_filter("fact", kind))
    }

    /// Guards the cost of a step at scale: the offloads of a step's parts are answered once,
    /// on one consumer the shared promoter's instances share, never by every node's agent
    /// (N parts would cost each of N agents N catalogue questions).
    #[test]
    fn a_steps_offloads_are_the_shared_promoters_to_answer_once() {
        let shared = settings(None);
        let steps = shared
            .steps_worker()
            .expect("the shared promoter's steps worker");
        assert_eq!(steps.service, "promoter-steps");
        assert!(steps.claims, "its instances share the consumer");
        assert!(consumes(&steps, "checkpoint.part.offloaded"));
        assert!(shared.offloads_worker().is_none());

        let agent = settings(Some("gpu-17"));
        assert!(agent.steps_worker().is_none());
        let offloads = agent
            .offloads_worker()
            .expect("a node agent's offloads worker");
        assert!(consumes(&offloads, "checkpoint.committed"));
        assert!(!consumes(&offloads, "checkpoint.part.offloaded"));
        // Its node's stage requests and releases only; the shared promoter every one.
        let request =
            |node: Option<&str>| subject::event_subject("req", "stage.requested", node, "lab-a");
        let (mine, shared_requests) = (agent.requests_worker(), shared.requests_worker());
        let takes = |cfg: &WorkerConfig, subject: &str| {
            cfg.filter_subjects
                .iter()
                .any(|filter| subject::subject_matches(filter, subject))
        };
        assert!(takes(&mine, &request(Some("gpu-17"))));
        assert!(!takes(&mine, &request(Some("gpu-18"))));
        assert!(!takes(&mine, &request(None)));
        for node in [Some("gpu-17"), Some("gpu-18"), None] {
            assert!(takes(&shared_requests, &request(node)), "{node:?}");
        }
        // Its own node's parts, and no other node's.
        let part_of = |node: &str| {
            subject::node_kind_subject("fact", "checkpoint.part.committed", node, "lab-a")
        };
        let hears = |subject: &str| {
            offloads
                .filter_subjects
                .iter()
                .any(|filter| subject::subject_matches(filter, subject))
        };
        assert!(hears(&part_of("gpu-17")));
        assert!(!hears(&part_of("gpu-18")));
        // Its own node's replicas and the shared tiers', never another node's; the shared
        // promoter every one.
        let replica =
            |node: Option<&str>| subject::event_subject("fact", "replica.created", node, "lab-a");
        let (mine, every) = (agent.facts_worker(), shared.facts_worker());
        assert!(takes(&mine, &replica(Some("gpu-17"))));
        assert!(takes(&mine, &replica(None)));
        assert!(!takes(&mine, &replica(Some("gpu-18"))));
        for node in [Some("gpu-17"), Some("gpu-18"), None] {
            assert!(takes(&every, &replica(node)), "{node:?}");
        }
        // Both wait as long for the catalogue: every attempt the runtime keeps.
        assert_eq!(steps.max_attempts, OFFLOAD_ATTEMPTS);
        assert_eq!(offloads.max_attempts, OFFLOAD_ATTEMPTS);
    }
}
