//! The promoter's work: a stage request moved as far as it can go now — failed, waiting,
//! ready at once, or copied and then ready — by whichever of its three drivers gets to it
//! first: the request's own message, a fact that wakes it, or the policy clock.
//!
//! Every answer is a fact with an id derived from the request (`pending:<waiting_for>`,
//! `ready`, `failed`, `replica:<tier>[:<node>]`), recorded in the state store before it is published,
//! so any driver may publish it again without harm (the duplicate window drops the copy).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use stagehand_bus::{Bus, HandlerError};
use stagehand_catalogue::Catalogue;
use stagehand_manifest::Spool;
use stagehand_mover::{Mover, Scheduler, Tier};
use stagehand_policy::{Policies, PromotionPolicy, TierPolicy, TierRole};
use stagehand_schemas::{Body, Event, StageRequested};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::kv::Coordination;
use crate::state::{State, WaitingFor};

mod clock;
mod copying;
mod estimate;
mod in_flight;
mod leave_node;
mod liveness;
mod offload;
mod repair;
mod requests;
mod reservations;

pub(crate) use copying::CopyFailed;
pub use liveness::step_returned;
pub use repair::step_repaired;

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
    /// A node agent with `[service.fanout]`: its piece server and swarm seats.
    pub fanout: Option<crate::fanout::Fanout>,
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
    /// The copies queued and running here per pair of tiers (with what stops each, for a
    /// cancel), and each pair's throughput.
    book: estimate::CopyBook,
    /// Copies running in this process, by (tier, node, prefix).
    copies: Mutex<HashSet<String>>,
    /// Requests being moved on in this process right now, and whether another driver asked
    /// for it meanwhile (then the one moving it looks again when it is done: no wake-up is
    /// lost to a request being busy).
    active: Mutex<HashMap<in_flight::RequestKey, bool>>,
    /// Copies that failed for good here lately, by copy key: the requests that waited for
    /// them get the same answer instead of each copying the same damaged source again.
    failed: Mutex<HashMap<String, (String, bool, Instant)>>,
    /// Tells the clock a new wait (with perhaps an earlier deadline) was recorded.
    clock: Notify,
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
                book: estimate::CopyBook::default(),
                copies: Mutex::default(),
                active: Mutex::default(),
                failed: Mutex::default(),
                clock: Notify::new(),
            }),
        }
    }

    pub(crate) fn p(&self) -> &Parts {
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

    pub(crate) async fn emit(&self, facts: &[Event]) -> Result<(), HandlerError> {
        for fact in facts {
            self.p()
                .bus
                .publish(fact)
                .await
                .map_err(|e| retry(format!("publishing {}: {e}", fact.kind())))?;
        }
        Ok(())
    }
}
