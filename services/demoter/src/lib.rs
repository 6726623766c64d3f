//! The demoter: keeps hot tiers under their watermarks by moving replicas down, and never
//! loses data doing it.
//!
//! Its rules, in the order of safety they are applied:
//!
//! 1. a replica a live stage holds (requested and not released, per the catalogue's stage
//!    requests) is never removed — looked at when the pass chooses, right before the removal is
//!    announced, and right before the rename (a hold found then undoes the removal);
//! 2. the last verified copy is never removed: when no durable tier (capacity, backup) holds a
//!    verified copy of the version, the replica is first copied down to `demotion.toml`'s
//!    `target` with the mover's set copy (background class, read back) and announced with
//!    `replica.created`; copy and removal are one recorded step ([`state`]) that survives a
//!    crash anywhere between them;
//! 3. above a tier's `high_watermark` the least recently staged replicas (of projects over
//!    their quota first) are demoted until usage is at its `low_watermark`; an unheld replica
//!    unused for `idle_after` is demoted anyway, and one not staged for `retention.toml`'s
//!    `unstaged_replica_after` expires;
//! 4. removal is atomic for readers: `replica.removed` (with the reason) first, the catalogue's
//!    readiness withdrawn, then the folder renamed out of the namespace in one `renameat2`,
//!    then deleted.
//!
//! Usage is what the catalogue lists as present on the tier plus, from `statfs`, the part of
//! the tier's capacity others' bytes have made unusable ([`plan`]).
//!
//! | task | consumer | what |
//! | --- | --- | --- |
//! | `requests` | `demoter` on the requests stream | `stage.released`: a replica may have become free |
//! | `facts` | `demoter` on the facts stream | `replica.created`, `replica.removed`, `checkpoint.committed`: usage changed |
//! | `clock` | — | a pass at start, every `check_every`, and whenever a consumer asks |
//! | `scrub` | — | with `scrub.toml`: every replica re-read and hashed within its tier's period ([`scrub`]) |
//! | `nodes` | — | the shared demoter, with local tiers and `promotion.toml`: a node whose agent is silent past `agent_silent_after` has its copies marked unreachable ([`nodes`]) |
//!
//! One shared demoter runs per deployment (its consumers are not shared). A node's demoter
//! (`node = "<name>"` in `[service]`, beside that node's promoter agent) keeps the node's
//! `local` tiers under their watermarks by the same rules: it sees only the replicas the
//! catalogue keys by (tier, that node), withdraws their per-node readiness, publishes its facts
//! with the node, and has consumers of its own (`demoter-node-<node>`). It copies nothing down:
//! it removes a node's copy only while a shared tier holds a verified one, so it runs as its
//! node's own NATS user, which states nothing about a shared tier. Steps run
//! `demotion.toml`'s `max_concurrent` at a time, each recorded on its own.

pub mod audit;
mod damage;
pub mod demoter;
pub mod nodes;
pub mod plan;
pub mod scrub;
pub mod scrub_state;
pub mod state;

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;
use stagehand_bus::runner::{
    self, Context, InvalidKey, ServiceConfig, ServiceError, ServiceSettings,
};
use stagehand_bus::{
    BusError, CancellationToken, Claims, Handler, HandlerError, WorkContext, WorkerConfig,
    default_instance_id,
};
use stagehand_catalogue::Catalogue;
use stagehand_mover::{Mover, MoverConfig, TransferError};
use stagehand_policy::{Opening, Policies, PolicyError, TierRole};
use stagehand_schemas::{Event, subject};

pub use demoter::{Demoter, Parts, PassError, PassReport};
pub use scrub::{ScrubError, ScrubParts, ScrubReport, Scrubber};
use stagehand_schemas::Retryable;
pub use state::Phase;

/// The service name: its consumers' prefix, its dead-letter subject, its metric label.
pub const SERVICE: &str = "demoter";

/// The fault-test seam: `copied-down`, `withdrawn` or `renamed` makes the demoter stop, still
/// running, right after recording that phase of its first step, so a test can kill it there.
pub const HALT_AFTER_ENV: &str = "STAGEHAND_DEMOTER_HALT_AFTER";

/// A test seam: set (to anything), the process stops itself with `SIGSTOP` right before it
/// renames a replica out of the namespace, every check made, until it is sent `SIGCONT`.
pub const STOP_BEFORE_RENAME_ENV: &str = "STAGEHAND_DEMOTER_STOP_BEFORE_RENAME";

/// The demoter's own settings: the `[service]` table of its configuration file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// The policy folder (`tiers.toml`, `demotion.toml`, `retention.toml`, …).
    pub policies_dir: PathBuf,
    /// Where the demoter keeps its state and ledgers.
    pub state_dir: PathBuf,
    /// How long to wait for the catalogue's answers (`"10s"`).
    #[serde(
        default = "default_catalogue_timeout",
        with = "stagehand_config::duration"
    )]
    pub catalogue_timeout: Duration,
    /// The mover's tunables (a `bytes_per_second` limit keeps copies down in the background).
    #[serde(default)]
    pub mover: MoverConfig,
    /// Run as the demoter of this node (the name its promoter agent has, the `node` of its
    /// replicas' facts): keep the node's `local` tiers under their watermarks, demoting only
    /// this node's replicas there, and nothing on the shared tiers. Unset: the shared demoter
    /// (hot tiers and checkpoint retention), one per deployment.
    #[serde(default)]
    pub node: Option<String>,
}

fn default_catalogue_timeout() -> Duration {
    Duration::from_secs(10)
}

/// The whole configuration: `[bus]`, `[worker]`, `[telemetry]` and [`Settings`] as `[service]`.
pub type Config = ServiceConfig<Settings>;

impl Settings {
    pub fn new(policies_dir: impl Into<PathBuf>, state_dir: impl Into<PathBuf>) -> Self {
        Self {
            policies_dir: policies_dir.into(),
            state_dir: state_dir.into(),
            catalogue_timeout: default_catalogue_timeout(),
            mover: MoverConfig::default(),
            node: None,
        }
    }

    /// Settings for a one-machine stack under `home` (`stagehand up`).
    pub fn dev(home: &std::path::Path, policies_dir: &std::path::Path) -> Self {
        Self::new(policies_dir, home.join("state").join(SERVICE))
    }
}

impl Settings {
    /// The name of this demoter's consumers: `demoter` for the shared one, one per node's
    /// demoter (`demoter-node-<node>`), since each must see every fact.
    pub fn consumer(&self) -> String {
        match &self.node {
            Some(node) => format!("{SERVICE}-node-{}", subject::node_token(node)),
            None => SERVICE.to_owned(),
        }
    }

    /// The service name the scrub claims its reads under (`stagehand_bus::Claims`): the
    /// shared demoter's [`scrub::SCRUB_CLAIMS_SERVICE`]; a node's demoter's beneath its own
    /// consumer's name, the only claims its node's user may write (`NODE_<N>` in
    /// accounts.conf).
    pub fn scrub_claims_service(&self) -> String {
        match &self.node {
            Some(_) => format!("{}.scrub", self.consumer()),
            None => scrub::SCRUB_CLAIMS_SERVICE.to_owned(),
        }
    }

    /// The releases worker with the demoter's defaults, before the `[worker]` table's:
    /// `stage.released` on the requests stream, under [`Settings::consumer`] (the names
    /// `deploy/nats/accounts.conf` grants), with a ledger of its own. A node's demoter keeps
    /// only its node's local tier, so it takes only the releases addressed to its node (their
    /// subjects name it): a release elsewhere wakes no node's sweep.
    pub fn requests_worker(&self) -> WorkerConfig {
        let filter = match &self.node {
            Some(node) => subject::node_kind_filter(subject::REQ, "stage.released", node),
            None => subject::kind_filter(subject::REQ, "stage.released"),
        };
        let mut cfg = WorkerConfig::new(
            self.consumer(),
            subject::REQUESTS.name,
            vec![filter],
            self.state_dir.join("demoter-requests.redb"),
        );
        // One demoter per deployment (and per node): nothing to claim against.
        cfg.claims = false;
        cfg
    }

    /// The facts worker with the demoter's defaults: what changes a tier's usage, and, for
    /// the shared demoter (retention is its), checkpoint commits.
    pub fn facts_worker(&self) -> WorkerConfig {
        let kinds = ["replica.created", "replica.removed", "checkpoint.committed"];
        let mut cfg = WorkerConfig::new(
            self.consumer(),
            subject::FACTS.name,
            // A node's demoter keeps its node's local tier: its own node's replicas alone.
            match &self.node {
                None => (kinds.iter())
                    .map(|k| subject::kind_filter(subject::FACT, k))
                    .collect(),
                Some(node) => (kinds.iter())
                    .filter(|k| **k != "checkpoint.committed")
                    .map(|k| subject::node_kind_filter(subject::FACT, k, node))
                    .collect(),
            },
            self.state_dir.join("demoter-facts.redb"),
        );
        cfg.claims = false;
        cfg
    }
}

impl ServiceSettings for Settings {
    /// A node's demoter is `node-<node>`, as its node's promoter agent is: the heartbeat key
    /// its node's user is granted (`demoter.node-<node>`), beside the shared demoter's.
    fn instance(&self) -> Option<String> {
        (self.node.as_deref()).map(stagehand_bus::accounts::node_user)
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
        if self.catalogue_timeout.is_zero() {
            return Err(InvalidKey::new(
                "catalogue_timeout",
                "must be longer than 0",
            ));
        }
        Ok(())
    }
}

/// A configuration for running the demoter in-process against `nats_url` (tests,
/// `stagehand up`).
pub fn config(
    nats_url: &str,
    policies_dir: impl Into<PathBuf>,
    state_dir: impl Into<PathBuf>,
) -> Config {
    ServiceConfig::in_process(SERVICE, nats_url, Settings::new(policies_dir, state_dir))
}

/// Why the demoter could not start or stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DemoterError {
    /// A policy file is wrong, or `demotion.toml`, which the demoter needs, is absent.
    #[error(transparent)]
    Policy(#[from] PolicyError),
    #[error("{HALT_AFTER_ENV}={value:?}: expected copied-down, withdrawn or renamed")]
    BadHalt { value: String },
    #[error(transparent)]
    State(#[from] state::StateError),
    #[error("starting the mover: {0}")]
    Mover(#[source] Box<TransferError>),
    /// The scrub's own state file (apart from the demotion steps' file) failed.
    #[error("scrub state: {0}")]
    ScrubState(#[source] scrub_state::ScrubStateError),
    #[error(transparent)]
    Pass(#[from] PassError),
    #[error(transparent)]
    Bus(#[from] BusError),
    /// The state folder, one of its tasks, or the runner (configuration, metrics endpoint).
    #[error(transparent)]
    Service(#[from] ServiceError),
}

impl Retryable for DemoterError {
    /// Whether starting again unchanged can succeed.
    fn is_retryable(&self) -> bool {
        match self {
            DemoterError::Policy(_) | DemoterError::BadHalt { .. } | DemoterError::Mover(_) => {
                false
            }
            DemoterError::State(e) | DemoterError::ScrubState(e) => e.is_retryable(),
            DemoterError::Pass(e) => e.is_retryable(),
            DemoterError::Bus(e) => e.is_retryable(),
            DemoterError::Service(e) => e.is_retryable(),
        }
    }
}

/// Runs the demoter through the service runner until `shutdown` is cancelled.
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), DemoterError> {
    runner::run(SERVICE, config, shutdown, serve)
        .await
        .map_err(runner::RunError::into_service_error)
}

fn halt_after() -> Result<Option<Phase>, DemoterError> {
    match std::env::var(HALT_AFTER_ENV) {
        Err(_) => Ok(None),
        Ok(v) => match v.as_str() {
            "copied-down" => Ok(Some(Phase::CopiedDown)),
            "withdrawn" => Ok(Some(Phase::Withdrawn)),
            "renamed" => Ok(Some(Phase::Renamed)),
            _ => Err(DemoterError::BadHalt { value: v }),
        },
    }
}

/// What the runner calls (the binary's `main`): the two workers and the clock over one
/// [`Demoter`], and the scrub when `scrub.toml` is there, until shutdown.
pub async fn serve(ctx: Context<Settings>) -> Result<(), DemoterError> {
    let requests = ctx.worker(ctx.settings.requests_worker());
    let facts = ctx.worker(ctx.settings.facts_worker());
    let mut tasks = ctx.tasks();
    let token = tasks.shutdown().clone();
    let instance = (requests.instance_id.clone()).unwrap_or_else(|| default_instance_id(&requests));
    let (demoter, scrubber, watch) = open(&ctx, token.clone(), &instance).await?;
    tasks.spawn(
        "requests",
        ctx.run_worker_until(requests, Wakes(demoter.clone()), token.clone()),
    );
    tasks.spawn(
        "facts",
        ctx.run_worker_until(facts, Wakes(demoter.clone()), token),
    );
    tasks.spawn("clock", demoter.clock());
    if let Some(scrubber) = scrubber {
        tasks.spawn("scrub", scrubber.run());
    }
    if let Some(watch) = watch {
        tasks.spawn("nodes", watch.run());
    }
    Ok(ctx.join(tasks).await?)
}

/// The demoter of `ctx`'s settings: its policies, the tiers it keeps and copies to (those it
/// writes swept), its state, the readiness and placement buckets, its mover; and its scrub
/// (as `instance` in the claims), when `scrub.toml` is there; and, for the shared demoter with
/// local tiers and `promotion.toml`, the watch of node agents ([`nodes`]). `shutdown` stops
/// them all.
async fn open(
    ctx: &Context<Settings>,
    shutdown: CancellationToken,
    instance: &str,
) -> Result<(Demoter, Option<Scrubber>, Option<nodes::NodeWatch>), DemoterError> {
    let s = &ctx.settings;
    let policies = Policies::load_dir(&s.policies_dir)?;
    let demotion =
        (policies.demotion().cloned()).ok_or_else(|| policies.needed("demotion.toml", SERVICE))?;
    let halt_after = halt_after()?;
    // The bounded tiers this demoter keeps under their watermarks: a node's demoter its node's
    // local tiers, the shared one the hot tiers; either opens the durable tiers it copies to.
    // Those it writes (its copies down, its removals) are swept of dead writers'
    // temporaries; the shared capacity tier by the shared demoter only.
    let demoted = match s.node {
        Some(_) => TierRole::Local,
        None => TierRole::Hot,
    };
    let tiers = policies
        .open_tiers(|tier| match tier.role {
            TierRole::Hot | TierRole::Local if tier.role != demoted => {
                tracing::info!(tier = %tier.name, node = s.node.as_deref().unwrap_or("-"), "tier not demoted by this demoter");
                None
            }
            role if role == demoted || (s.node.is_none() && role == TierRole::Capacity) => {
                Some(Opening::write())
            }
            _ => Some(Opening::read()),
        })
        .await;
    let spool_dir = s.state_dir.join("spool");
    runner::create_state_dirs([s.state_dir.as_path(), &spool_dir])?;
    let state = state::State::open(&s.state_dir.join("demoter-state.redb"))?;
    let readiness = ctx.bus.provision_kv(&stagehand_bus::READINESS).await?;
    let placement = ctx.bus.provision_kv(&stagehand_bus::PROMOTER).await?;
    let mover = Mover::new(s.mover.clone()).map_err(|e| DemoterError::Mover(Box::new(e)))?;
    let mover = std::sync::Arc::new(mover);
    let catalogue = Catalogue::new(ctx.bus.client().clone()).with_timeout(s.catalogue_timeout);
    let scrubber = match policies.scrub() {
        None => None,
        Some(policy) => {
            // A node's demoter reads its node's copies on the local tiers; the shared one
            // every other tier the policy names.
            let scrubbed: HashMap<String, stagehand_mover::Tier> = tiers
                .iter()
                .filter(|(name, _)| {
                    policy.period.contains_key(*name)
                        && policies
                            .tier(name)
                            .is_some_and(|t| (t.role == TierRole::Local) == s.node.is_some())
                })
                .map(|(name, tier)| (name.clone(), tier.clone()))
                .collect();
            ctx.bus.provision_kv(&stagehand_bus::CLAIMS).await?;
            let claims = Claims::open(
                &ctx.bus,
                &s.scrub_claims_service(),
                instance,
                scrub::CLAIM_LIFETIME,
            )
            .await?;
            let scrub_state = scrub_state::ScrubState::open(&s.state_dir.join("scrub-state.redb"))
                .map_err(DemoterError::ScrubState)?;
            tracing::info!(tiers = ?scrubbed.keys().collect::<Vec<_>>(), "scrub ready");
            Some(Scrubber::new(ScrubParts {
                bus: ctx.bus.clone(),
                catalogue: catalogue.clone(),
                policy: policy.clone(),
                tiers: scrubbed,
                node: s.node.clone(),
                state: scrub_state,
                claims,
                mover: mover.clone(),
                sources: tiers.clone(),
                repairable: (policy.period.keys())
                    .filter(|name| {
                        policies.tier(name).is_some_and(|t| {
                            matches!(t.role, TierRole::Capacity | TierRole::Backup)
                        })
                    })
                    .cloned()
                    .collect(),
                backups: (policy.period.keys())
                    .filter(|name| {
                        policies
                            .tier(name)
                            .is_some_and(|t| t.role == TierRole::Backup)
                    })
                    .cloned()
                    .collect(),
                spool_dir: spool_dir.clone(),
                shutdown: shutdown.clone(),
            }))
        }
    };
    // A node's demoter goes down with its node: the shared one watches the nodes.
    let watch = match s.node {
        Some(_) => None,
        None => nodes::NodeWatch::of(
            &policies,
            (ctx.bus.clone(), catalogue.clone(), placement.clone()),
            shutdown.clone(),
        ),
    };
    tracing::info!(node = s.node.as_deref().unwrap_or("-"), consumer = %s.consumer(), "demoter ready");
    let demoter = Demoter::new(Parts {
        bus: ctx.bus.clone(),
        catalogue,
        policies,
        demotion,
        tiers,
        state,
        mover,
        spool_dir,
        readiness,
        placement,
        halt_after,
        node: s.node.clone(),
        stop_before_rename: std::env::var_os(STOP_BEFORE_RENAME_ENV).is_some(),
        shutdown,
    });
    Ok((demoter, scrubber, watch))
}

/// The consumers' handler: a checkpoint commit is noted for retention, and a fact or release
/// that can change what to demote asks the clock for a pass (a wake-up is never lost: one
/// stored while a pass runs starts the next).
struct Wakes(Demoter);

impl Handler for Wakes {
    async fn handle(&self, event: &Event, _ctx: &WorkContext) -> Result<Vec<Event>, HandlerError> {
        // Noting a fact fails only when the state store does: not the fact's fault, so it is
        // tried again rather than classified by the error.
        self.0.on_event(event).map_err(HandlerError::retryable)?;
        Ok(Vec::new())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A node's demoter is woken by its own node's releases and replicas only; the shared one
    /// by every one, with a node or without.
    #[test]
    fn a_nodes_demoter_takes_its_own_nodes_releases_and_replicas_only() {
        let takes = |s: &Settings, subject: &str| {
            s.requests_worker()
                .filter_subjects
                .iter()
                .any(|f| subject::subject_matches(f, subject))
        };
        let release = |node: Option<&str>| {
            subject::event_subject(subject::REQ, "stage.released", node, "lab-a")
        };
        let shared = Settings::new("p", "s");
        let mut node = shared.clone();
        node.node = Some("gpu-07".into());
        assert!(takes(&node, &release(Some("gpu-07"))));
        assert!(!takes(&node, &release(Some("gpu-08"))));
        assert!(!takes(&node, &release(None)));
        for n in [Some("gpu-07"), Some("gpu-08"), None] {
            assert!(takes(&shared, &release(n)), "{n:?}");
        }
        // Its usage: its own node's replicas alone; the shared demoter's every replica.
        let hears = |s: &Settings, subject: &str| {
            s.facts_worker()
                .filter_subjects
                .iter()
                .any(|f| subject::subject_matches(f, subject))
        };
        for kind in ["replica.created", "replica.removed"] {
            let replica =
                |node: Option<&str>| subject::event_subject(subject::FACT, kind, node, "lab-a");
            assert!(hears(&node, &replica(Some("gpu-07"))), "{kind}");
            assert!(!hears(&node, &replica(Some("gpu-08"))), "{kind}");
            assert!(!hears(&node, &replica(None)), "{kind}");
            for n in [Some("gpu-07"), Some("gpu-08"), None] {
                assert!(hears(&shared, &replica(n)), "{kind} {n:?}");
            }
        }
    }
}
