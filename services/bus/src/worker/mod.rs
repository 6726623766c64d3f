//! The consume loop every service runs. The steps are numbered as in the crate docs and the
//! README, and each step's code says its number:
//!
//! 1. decode, and hold the event to its subject: its kind and project are the subject's, and
//!    every location it names is its project's (`stagehand_schemas::trust`; [`pull`]);
//! 2. ledger check: republish a recorded outcome ([`outcome`]);
//! 3. claim ([`outcome`], `claim.rs`);
//! 4. handle, renewing the claim with each progress ack ([`outcome`]);
//! 5. commit the outcome: the claim, then the ledger ([`outcome`]);
//! 6. publish the facts ([`outcome`]);
//! 7. ack ([`outcome`]);
//!
//! and **G**, the one give-up path every failure of every step goes through
//! ([`dead_letter`]). Around them: the durable consumer ([`consumer`]), the slots that bound
//! concurrency ([`slots`]) and the pull loop ([`pull`]); this module holds the public types,
//! [`run_worker`] and the worker's background duties (ledger pruning, the instance heartbeat).

mod consumer;
mod dead_letter;
mod outcome;
mod pull;
mod slots;

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tracing::instrument::WithSubscriber;

use async_nats::jetstream::{self, AckKind};
use opentelemetry::Context as OtelContext;
use stagehand_schemas::{Attempt, Event, EventId, Refusal};
use stagehand_telemetry::names;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::bus::Bus;
use crate::claim::Claims;
use crate::config::WorkerConfig;
use crate::error::{BusError, BusErrorKind, HandlerError};
use crate::ledger::{EventKey, Ledger, LedgerWriter};

pub use consumer::provision_consumer;

/// The header `stagehand dlq replay` sets on a replayed message: the id of the dead letter it
/// came from. The runtime starts such a message with a clean attempt history and does not let
/// a completion marker without facts (written by an older runtime for a dead letter) answer it.
pub const REPLAY_HEADER: &str = "Stagehand-Replay";

/// A service's work for one event.
pub trait Handler: Send + Sync + 'static {
    /// Does the work for one decoded event and returns the facts it caused, each with an id
    /// derived from the event (`event.caused(step, body)`), so that a retry yields the same ids.
    ///
    /// Must be idempotent: after a crash the same event can be handled again. A long handler
    /// should watch `ctx.shutdown()` and may return a retryable error to be redelivered later.
    /// The runtime drops (cancels) the handler's future when its claim is lost.
    fn handle(
        &self,
        event: &Event,
        ctx: &WorkContext,
    ) -> impl Future<Output = Result<Vec<Event>, HandlerError>> + Send;

    /// Told of an event the runtime refuses at step 1, before it is handled: its subject or a
    /// location it names breaks a rule of `stagehand_schemas::trust` (the error names it). The
    /// runtime dead-letters it right after. A handler that lists what it could not take (the
    /// catalogue recorder: a catalogue problem) records it here, reading nothing the event
    /// names. The default does nothing.
    fn refused(
        &self,
        event: &Event,
        stream_sequence: u64,
        refusal: &Refusal,
    ) -> impl Future<Output = ()> + Send {
        let _ = (event, stream_sequence, refusal);
        async {}
    }
}

/// What a handler can see of and do with the message it handles.
pub struct WorkContext {
    msg: Arc<jetstream::Message>,
    delivery: u64,
    stream_sequence: u64,
    shutdown: CancellationToken,
}

impl WorkContext {
    /// Tells the server the work is progressing, restarting its AckWait. The runtime already
    /// sends one every AckWait/3 while the handler runs; call this for finer control.
    pub async fn progress(&self) -> Result<(), BusError> {
        self.msg
            .ack_with(AckKind::Progress)
            .await
            .map_err(|e| BusError::with_source(BusErrorKind::Consume, "sending a progress ack", e))
    }

    /// The delivery count of this message: 1 for the first delivery.
    pub fn delivery(&self) -> u64 {
        self.delivery
    }

    /// The stream sequence of this message.
    pub fn stream_sequence(&self) -> u64 {
        self.stream_sequence
    }

    /// Cancelled when the worker is asked to shut down (or stops on a fatal error). In-flight
    /// work may still finish before the shutdown deadline.
    pub fn shutdown(&self) -> &CancellationToken {
        &self.shutdown
    }
}

/// Counts of what a worker did, returned when it stops. Every message pulled ends in exactly
/// one of `handled`, `replayed`, `redundant`, `retried`, `deferred`, `dead_lettered` or
/// `abandoned`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkerStats {
    /// Events handled, committed, their facts published and acked.
    pub handled: u64,
    /// Messages answered with an outcome recorded before (in the ledger or in the claim):
    /// the same facts republished, then acked (or, for a dead letter, terminated).
    pub replayed: u64,
    /// Copies acked because another message of the same event was being worked on (that
    /// message brings the outcome).
    pub redundant: u64,
    /// Failures that counted as an attempt, answered with a delayed negative ack.
    pub retried: u64,
    /// Negative acks that did not count as an attempt: the claim was held by a live owner
    /// or lost, or the worker stopped on a fatal error.
    pub deferred: u64,
    /// Messages sent to the dead-letter stream.
    pub dead_lettered: u64,
    /// Of the above, messages whose claim was held or finished by another delivery.
    pub claimed_elsewhere: u64,
    /// Messages still in flight at the shutdown deadline, left un-acked for redelivery.
    pub abandoned: u64,
    /// Ledger write transactions committed (each fsyncs).
    pub ledger_commits: u64,
    /// Ledger writes (outcomes and attempts) those transactions carried.
    pub ledger_writes: u64,
    /// Records the ledger pruned as older than `ledger_retention`.
    pub ledger_pruned: u64,
    /// Times the ledger was reopened after an I/O failure.
    pub ledger_reopens: u64,
}

/// An outcome point: a count for [`WorkerStats`] and a counter of the `metrics` facade.
struct Count {
    n: AtomicU64,
    metric: metrics::Counter,
}

impl Count {
    fn new(service: &str, outcome: &'static str) -> Count {
        Count {
            n: AtomicU64::new(0),
            metric: metrics::counter!(
                names::MESSAGES_TOTAL,
                "service" => service.to_owned(),
                "outcome" => outcome
            ),
        }
    }

    fn bump(&self) {
        self.n.fetch_add(1, Ordering::Relaxed);
        self.metric.increment(1);
    }

    fn get(&self) -> u64 {
        self.n.load(Ordering::Relaxed)
    }
}

struct Counters {
    handled: Count,
    replayed: Count,
    redundant: Count,
    retried: Count,
    deferred: Count,
    dead_lettered: Count,
    dead_letters_metric: metrics::Counter,
    claimed_elsewhere: AtomicU64,
    pruned: AtomicU64,
}

impl Counters {
    fn new(service: &str) -> Counters {
        Counters {
            handled: Count::new(service, names::outcome::DONE),
            replayed: Count::new(service, names::outcome::REPLAYED),
            redundant: Count::new(service, names::outcome::REDUNDANT),
            retried: Count::new(service, names::outcome::RETRIED),
            deferred: Count::new(service, names::outcome::DEFERRED),
            dead_lettered: Count::new(service, names::outcome::DEAD_LETTERED),
            dead_letters_metric: metrics::counter!(
                names::DEAD_LETTERS_TOTAL,
                "service" => service.to_owned()
            ),
            claimed_elsewhere: AtomicU64::new(0),
            pruned: AtomicU64::new(0),
        }
    }
}

/// A hook the runtime awaits at a fixed point of the consume loop.
pub type Hook = Arc<dyn Fn(&EventId) -> futures::future::BoxFuture<'static, ()> + Send + Sync>;

/// Points in the consume loop where a caller may run code: the seam through which crash tests
/// stop a worker process at an exact step. Services leave them empty.
#[derive(Clone, Default)]
pub struct WorkerHooks {
    /// Awaited after an event's outcome is committed (claim and ledger) and before its facts
    /// are published and the message acked.
    pub after_record: Option<Hook>,
    /// Called once the worker has its consumer, ledger and claims and starts pulling: the
    /// service runner's readiness (`/readyz`).
    pub started: Option<Arc<dyn Fn() + Send + Sync>>,
}

impl std::fmt::Debug for WorkerHooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerHooks")
            .field("after_record", &self.after_record.is_some())
            .field("started", &self.started.is_some())
            .finish()
    }
}

/// Attempt histories this process knows, for the give-up path when neither the claim nor the
/// ledger can be read. Bounded: past [`MEMORY_KEYS`] events, the oldest entries are dropped.
#[derive(Default)]
struct Memory {
    attempts: Mutex<HashMap<EventKey, Vec<Attempt>>>,
    /// Entries held, so that the common case — nothing ever failed — takes no lock.
    len: AtomicU64,
}

const MEMORY_KEYS: usize = 10_000;

impl Memory {
    fn get(&self, key: &EventKey) -> Vec<Attempt> {
        if self.len.load(Ordering::Acquire) == 0 {
            return Vec::new();
        }
        self.lock().get(key).cloned().unwrap_or_default()
    }

    fn set(&self, key: &EventKey, history: Vec<Attempt>) {
        let mut map = self.lock();
        if map.len() >= MEMORY_KEYS && !map.contains_key(key) {
            let oldest = map
                .iter()
                .min_by_key(|(_, h)| h.last().map(|a| a.at))
                .map(|(k, _)| k.clone());
            if let Some(k) = oldest {
                map.remove(&k);
            }
        }
        map.insert(key.clone(), history);
        self.len.store(map.len() as u64, Ordering::Release);
    }

    fn forget(&self, key: &EventKey) {
        if self.len.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut map = self.lock();
        map.remove(key);
        self.len.store(map.len() as u64, Ordering::Release);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<EventKey, Vec<Attempt>>> {
        self.attempts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

struct Shared<H> {
    hooks: WorkerHooks,
    bus: Bus,
    cfg: WorkerConfig,
    handler: Arc<H>,
    ledger: Ledger,
    writer: LedgerWriter,
    claims: Option<Claims>,
    counters: Counters,
    memory: Memory,
    /// Cancelled on shutdown, and when the worker stops on a fatal error.
    stop: CancellationToken,
    /// The error the worker stops on, if any.
    fatal: Arc<Mutex<Option<BusError>>>,
}

impl<H> Shared<H> {
    /// Stops the worker on `e` (the first fatal error wins): no more pulls; `run_worker`
    /// returns it.
    fn stop_fatal(&self, e: BusError) {
        stop_fatal(&self.fatal, &self.stop, e);
    }
}

fn stop_fatal(slot: &Mutex<Option<BusError>>, stop: &CancellationToken, e: BusError) {
    let mut fatal = slot
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if fatal.is_none() {
        error!(error = %e, "the worker stops");
        *fatal = Some(e);
    }
    stop.cancel();
}

/// Where a message came from.
#[derive(Debug, Clone)]
struct MsgInfo {
    stream: String,
    consumer: String,
    stream_sequence: u64,
    delivered: u64,
    /// When the stream stored it (the server's clock).
    published: time::OffsetDateTime,
}

/// One delivery being worked on: the message, where it came from, and what decoding found.
struct Delivery {
    msg: Arc<jetstream::Message>,
    info: MsgInfo,
    parent: OtelContext,
    /// The decoded event, and its ledger key; `None` for undecodable bytes. A refused event
    /// has no key: the project and id it names are the publisher's word, and its dead letter
    /// recorded under them would mark that project's true event of the same id as handled.
    event: Option<(Event, Option<EventKey>)>,
    /// The dead letter this message is a replay of (the [`REPLAY_HEADER`]).
    replay_of: Option<String>,
}

impl Delivery {
    fn key(&self) -> Option<&EventKey> {
        self.event.as_ref().and_then(|(_, k)| k.as_ref())
    }
}

/// The trace context facts are published with: the handling span's when tracing is wired to
/// OpenTelemetry, else the consumed message's, so the trace id flows either way.
fn outgoing_context(parent: &OtelContext) -> OtelContext {
    let cx = tracing::Span::current().context();
    if stagehand_telemetry::propagation::has_span(&cx) {
        cx
    } else {
        parent.clone()
    }
}

/// The instance id a worker uses when its configuration names none: the host name, the
/// service and a digest of the ledger path. Stable across restarts of the same service on
/// the same host, and distinct for two instances on one host (they cannot share a ledger
/// file, which redb locks to one process).
pub fn default_instance_id(cfg: &WorkerConfig) -> String {
    let ledger = cfg.ledger_path.to_string_lossy();
    let digest = EventId::for_content(&[ledger.as_bytes()]);
    format!("{}/{}/{}", host_name(), cfg.service, &digest.as_str()[..8])
}

/// This machine's host name (`unknown-host` when it cannot be read).
pub fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is valid for `buf.len()` bytes; gethostname writes at most that many.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "unknown-host".to_owned();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// Runs a worker until `shutdown` is cancelled, then drains in-flight work until
/// `cfg.shutdown_deadline` and returns what it did.
///
/// Provisions the durable consumer first (the streams must exist: [`Bus::provision`]).
/// Returns an error, after draining, when the worker had to stop: its ledger failed and could
/// not be reopened, a handler reported a fatal error, or another process took its instance id.
pub async fn run_worker<H: Handler>(
    bus: Bus,
    cfg: WorkerConfig,
    handler: Arc<H>,
    shutdown: CancellationToken,
) -> Result<WorkerStats, BusError> {
    run_worker_with_hooks(bus, cfg, handler, shutdown, WorkerHooks::default()).await
}

/// [`run_worker`] with [`WorkerHooks`].
pub async fn run_worker_with_hooks<H: Handler>(
    bus: Bus,
    cfg: WorkerConfig,
    handler: Arc<H>,
    shutdown: CancellationToken,
    hooks: WorkerHooks,
) -> Result<WorkerStats, BusError> {
    cfg.validate()?;
    let consumer = consumer::provision_consumer_patiently(&bus, &cfg, &shutdown).await?;
    let ledger_path = cfg.ledger_path.clone();
    let ledger = tokio::task::spawn_blocking(move || Ledger::open(ledger_path))
        .await
        .map_err(|e| BusError::with_source(BusErrorKind::Config, "opening the ledger", e))??;
    let instance = cfg
        .instance_id
        .clone()
        .unwrap_or_else(|| default_instance_id(&cfg));
    let claims = if cfg.claims {
        Some(Claims::open(&bus, &cfg.service, &instance, cfg.claim_lifetime()).await?)
    } else {
        None
    };
    let stop = shutdown.child_token();
    let fatal: Arc<Mutex<Option<BusError>>> = Arc::default();
    let (writer, writer_thread) = {
        let (fatal, stop) = (fatal.clone(), stop.clone());
        ledger.spawn_writer(Box::new(move |e: crate::ledger::LedgerError| {
            let e = BusError::with_source(
                BusErrorKind::Ledger(e.kind()),
                "the ledger failed and could not be reopened",
                e,
            );
            stop_fatal(&fatal, &stop, e);
        }))
    };
    let writer_stats = writer.stats.clone();
    let shared = Arc::new(Shared {
        hooks,
        counters: Counters::new(&cfg.service),
        // A delivery's outcome is published within its own deadline: past the ack wait the
        // message is redelivered, and the redelivery publishes the recorded outcome again.
        bus: bus.with_publish_timeout(cfg.ack_wait),
        cfg,
        handler,
        ledger,
        writer,
        claims,
        memory: Memory::default(),
        stop: stop.clone(),
        fatal: fatal.clone(),
    });
    info!(service = %shared.cfg.service, %instance, concurrency = shared.cfg.concurrency, "worker started");
    if let Some(started) = &shared.hooks.started {
        started();
    }

    let duties = tokio::spawn(background_duties(shared.clone()).with_current_subscriber());
    let abandoned = pull::pull_loop(&shared, &consumer, &stop).await;
    duties.abort();
    let _ = duties.await;

    let c = &shared.counters;
    let stats = WorkerStats {
        handled: c.handled.get(),
        replayed: c.replayed.get(),
        redundant: c.redundant.get(),
        retried: c.retried.get(),
        deferred: c.deferred.get(),
        dead_lettered: c.dead_lettered.get(),
        claimed_elsewhere: c.claimed_elsewhere.load(Ordering::Relaxed),
        abandoned,
        ledger_commits: 0,
        ledger_writes: 0,
        ledger_pruned: c.pruned.load(Ordering::Relaxed),
        ledger_reopens: shared.ledger.reopens(),
    };
    // The last task is gone, so this drops the last writer handle: the writer commits what is
    // queued and stops.
    drop(shared);
    let _ = tokio::task::spawn_blocking(move || writer_thread.join()).await;
    let stats = WorkerStats {
        ledger_commits: writer_stats.commits.load(Ordering::Relaxed),
        ledger_writes: writer_stats.writes.load(Ordering::Relaxed),
        ..stats
    };
    info!(?stats, "worker stopped");
    let failed = fatal
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .take();
    match failed {
        Some(e) => Err(e),
        None => Ok(stats),
    }
}

/// Most ledger records one pruning transaction removes.
const PRUNE_BATCH: usize = 1000;

/// Prunes the ledger every `prune_interval` (the first time one interval after start), in
/// batches of [`PRUNE_BATCH`] with a pause between them so that outcomes keep their commits;
/// and, with claims on, writes the instance's registration every AckWait, which stops the
/// worker if another process registered the same instance id.
async fn background_duties<H: Handler>(shared: Arc<Shared<H>>) {
    let cfg = &shared.cfg;
    let start = tokio::time::Instant::now();
    let mut prune = tokio::time::interval_at(start + cfg.prune_interval, cfg.prune_interval);
    prune.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut heartbeat = tokio::time::interval_at(start + cfg.ack_wait, cfg.ack_wait);
    heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shared.stop.cancelled() => return,
            _ = prune.tick() => prune_ledger(&shared).await,
            _ = heartbeat.tick(), if shared.claims.is_some() => {
                if let Some(claims) = &shared.claims {
                    match claims.server_now().await {
                        Ok(_) => {}
                        Err(e) if e.kind() == BusErrorKind::InstanceTaken => shared.stop_fatal(e),
                        Err(e) => warn!(error = %e, "instance heartbeat failed"),
                    }
                }
            }
        }
    }
}

async fn prune_ledger<H: Handler>(shared: &Shared<H>) {
    let retention =
        time::Duration::try_from(shared.cfg.ledger_retention).unwrap_or(time::Duration::MAX);
    let cutoff = stagehand_schemas::now() - retention;
    loop {
        match shared.writer.prune(cutoff, PRUNE_BATCH).await {
            Ok(n) => {
                shared.counters.pruned.fetch_add(n, Ordering::Relaxed);
                if n < PRUNE_BATCH as u64 {
                    if n > 0 {
                        info!(pruned = n, "ledger pruned");
                    }
                    return;
                }
            }
            Err(e) => {
                warn!(error = %e, "pruning the ledger failed; trying again at the next interval");
                return;
            }
        }
        tokio::select! {
            _ = shared.stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
    }
}
