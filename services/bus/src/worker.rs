//! The consume loop every service runs: decode → ledger check → claim → handle → record →
//! publish facts → ack, with retries, dead letters, bounded concurrency and a shutdown
//! deadline. See the crate docs for the guarantees.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_nats::jetstream::consumer::{self, PullConsumer, pull};
use async_nats::jetstream::{self, AckKind};
use bytes::Bytes;
use futures::{FutureExt, StreamExt};
use opentelemetry::Context as OtelContext;
use stagehand_schemas::subject::dead_letter_subject;
use stagehand_schemas::{Attempt, Body, DeadLetter, Event, EventId, wire};
use stagehand_telemetry::{extract_context, names, propagation::has_span};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, error, info, info_span, warn};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::bus::{Bus, headers_for, prepare};
use crate::claim::{Claim, Claims};
use crate::config::WorkerConfig;
use crate::error::{BusError, HandlerError};
use crate::ledger::{Ledger, LedgerWriter, RecordedBytes};

/// A service's work for one event.
pub trait Handler: Send + Sync + 'static {
    /// Does the work for one decoded event and returns the facts it caused, each with an id
    /// derived from the event (`event.caused(step, body)`), so that a retry yields the same ids.
    ///
    /// Must be idempotent: after a crash the same event can be handled again. A long handler
    /// should watch `ctx.shutdown()` and may return a retryable error to be redelivered later.
    fn handle(
        &self,
        event: &Event,
        ctx: &WorkContext,
    ) -> impl Future<Output = Result<Vec<Event>, HandlerError>> + Send;
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
            .map_err(|e| BusError::Consume {
                consumer: String::new(),
                detail: format!("progress ack: {e}"),
            })
    }

    /// The delivery count of this message: 1 for the first delivery.
    pub fn delivery(&self) -> u64 {
        self.delivery
    }

    /// The stream sequence of this message.
    pub fn stream_sequence(&self) -> u64 {
        self.stream_sequence
    }

    /// Cancelled when the worker is asked to shut down. In-flight work may still finish
    /// before the shutdown deadline.
    pub fn shutdown(&self) -> &CancellationToken {
        &self.shutdown
    }
}

/// Counts of what a worker did, returned when it stops.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkerStats {
    /// Events handled, recorded, their facts published and acked.
    pub handled: u64,
    /// Redeliveries of finished events: recorded facts republished, then acked.
    pub replayed: u64,
    /// Retryable failures answered with a delayed negative ack.
    pub retried: u64,
    /// Messages sent to the dead-letter stream.
    pub dead_lettered: u64,
    /// Messages another instance had claimed or finished.
    pub claimed_elsewhere: u64,
    /// Messages still in flight at the shutdown deadline, left un-acked for redelivery.
    pub abandoned: u64,
    /// Ledger write transactions committed (each fsyncs).
    pub ledger_commits: u64,
    /// Ledger writes (outcomes and attempts) those transactions carried.
    pub ledger_writes: u64,
}

#[derive(Default)]
struct Counters {
    handled: AtomicU64,
    replayed: AtomicU64,
    retried: AtomicU64,
    dead_lettered: AtomicU64,
    claimed_elsewhere: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// A hook the runtime awaits at a fixed point of the consume loop.
pub type Hook = Arc<dyn Fn(&EventId) -> futures::future::BoxFuture<'static, ()> + Send + Sync>;

/// Points in the consume loop where a caller may run code: the seam through which crash tests
/// stop a worker process at an exact step. Services leave them empty.
#[derive(Clone, Default)]
pub struct WorkerHooks {
    /// Awaited after an event's outcome is committed to the ledger and before its facts are
    /// published and the message acked.
    pub after_record: Option<Hook>,
}

impl std::fmt::Debug for WorkerHooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerHooks")
            .field("after_record", &self.after_record.is_some())
            .finish()
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
    shutdown: CancellationToken,
}

/// Where a message came from.
#[derive(Debug, Clone)]
struct MsgInfo {
    stream: String,
    consumer: String,
    stream_sequence: u64,
    delivered: u64,
}

/// Creates the durable pull consumer of `cfg`, or updates it where its configuration drifted
/// (ack wait, max deliveries, filter subjects, max ack pending).
pub async fn provision_consumer(bus: &Bus, cfg: &WorkerConfig) -> Result<PullConsumer, BusError> {
    let perr = |detail: String| BusError::Provision {
        what: format!("consumer {} on stream {}", cfg.service, cfg.stream),
        detail,
    };
    let stream = bus
        .jetstream()
        .get_stream(&cfg.stream)
        .await
        .map_err(|e| perr(e.to_string()))?;
    let wanted = consumer_config(cfg);
    match stream.consumer_info(&cfg.service).await {
        Ok(info) => {
            let have = &info.config;
            let drifted = have.ack_wait != wanted.ack_wait
                || have.max_deliver != wanted.max_deliver
                || have.max_ack_pending != wanted.max_ack_pending
                || effective_filters(&have.filter_subject, &have.filter_subjects)
                    != effective_filters(&wanted.filter_subject, &wanted.filter_subjects);
            if drifted {
                info!(consumer = %cfg.service, "consumer configuration drifted; updating");
                stream
                    .update_consumer(wanted)
                    .await
                    .map_err(|e| perr(e.to_string()))
            } else {
                stream
                    .get_consumer(&cfg.service)
                    .await
                    .map_err(|e| perr(e.to_string()))
            }
        }
        Err(e) if e.kind() == jetstream::context::ConsumerInfoErrorKind::NotFound => {
            info!(consumer = %cfg.service, stream = %cfg.stream, "creating consumer");
            stream
                .create_consumer(wanted)
                .await
                .map_err(|e| perr(e.to_string()))
        }
        Err(e) => Err(perr(e.to_string())),
    }
}

fn consumer_config(cfg: &WorkerConfig) -> pull::Config {
    // One filter goes in `filter_subject`, which every server version honours.
    let (filter_subject, filter_subjects) = match cfg.filter_subjects.as_slice() {
        [one] => (one.clone(), Vec::new()),
        many => (String::new(), many.to_vec()),
    };
    pull::Config {
        durable_name: Some(cfg.service.clone()),
        description: Some(format!("Stagehand service {}", cfg.service)),
        ack_policy: consumer::AckPolicy::Explicit,
        deliver_policy: consumer::DeliverPolicy::All,
        ack_wait: cfg.ack_wait,
        max_deliver: cfg.max_deliver,
        filter_subject,
        filter_subjects,
        max_ack_pending: i64::try_from(in_flight_window(cfg)).unwrap_or(i64::MAX),
        ..Default::default()
    }
}

fn effective_filters(one: &str, many: &[String]) -> Vec<String> {
    let mut v: Vec<String> = if many.is_empty() {
        if one.is_empty() {
            Vec::new()
        } else {
            vec![one.to_owned()]
        }
    } else {
        many.to_vec()
    };
    v.sort();
    v
}

/// Runs a worker until `shutdown` is cancelled, then drains in-flight work until
/// `cfg.shutdown_deadline` and returns what it did.
///
/// Provisions the durable consumer first (the streams must exist: [`Bus::provision`]).
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
    let consumer = provision_consumer(&bus, &cfg).await?;
    let ledger_path = cfg.ledger_path.clone();
    let ledger = tokio::task::spawn_blocking(move || Ledger::open(ledger_path))
        .await
        .map_err(|e| BusError::Config {
            key: "ledger_path",
            reason: e.to_string(),
        })??;
    let claims = if cfg.claims {
        let owner = format!("{}:{}", cfg.service, uuid::Uuid::new_v4().simple());
        Some(Claims::open(&bus, &cfg.service, owner, cfg.ack_wait * 2).await?)
    } else {
        None
    };
    let (writer, writer_thread) = ledger.spawn_writer();
    let writer_stats = writer.stats.clone();
    let shared = Arc::new(Shared {
        hooks,
        bus,
        cfg,
        handler,
        ledger,
        writer,
        claims,
        counters: Counters::default(),
        shutdown: shutdown.clone(),
    });
    info!(service = %shared.cfg.service, concurrency = shared.cfg.concurrency, "worker started");

    let abandoned = pull_loop(&shared, &consumer, &shutdown).await;

    let stats = WorkerStats {
        handled: shared.counters.handled.load(Ordering::Relaxed),
        replayed: shared.counters.replayed.load(Ordering::Relaxed),
        retried: shared.counters.retried.load(Ordering::Relaxed),
        dead_lettered: shared.counters.dead_lettered.load(Ordering::Relaxed),
        claimed_elsewhere: shared.counters.claimed_elsewhere.load(Ordering::Relaxed),
        abandoned,
        ledger_commits: 0,
        ledger_writes: 0,
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
    Ok(stats)
}

/// Two kinds of slot bound a worker. A *handler* slot is held while the handler runs
/// (`concurrency` of them); an *in-flight* slot is held from the pull until the ack (as many as
/// the consumer's `max_ack_pending`, 2 × `concurrency`). A message that has finished its work
/// waits for its ledger commit and its acks without keeping a handler from starting, so the
/// fsync latency of the shared commit does not cap throughput at `concurrency` / latency.
struct Slots {
    handlers: Arc<Semaphore>,
    in_flight: Arc<Semaphore>,
}

/// The permits one pull holds: as many of each kind as messages asked for.
struct PullPermits {
    handlers: OwnedSemaphorePermit,
    in_flight: OwnedSemaphorePermit,
}

impl Slots {
    fn new(cfg: &WorkerConfig) -> Slots {
        Slots {
            handlers: Arc::new(Semaphore::new(cfg.concurrency)),
            in_flight: Arc::new(Semaphore::new(in_flight_window(cfg))),
        }
    }

    fn free(&self) -> usize {
        self.handlers
            .available_permits()
            .min(self.in_flight.available_permits())
    }

    /// Waits until at least one message can be pulled, then takes every free pair of slots.
    /// While work is in flight it waits up to 2 ms for `low_water` pairs, so that pulls are
    /// not one message at a time. `None` once the semaphores are closed.
    async fn acquire(&self, busy: bool, low_water: usize) -> Option<PullPermits> {
        let mut permits = PullPermits {
            handlers: self.handlers.clone().acquire_owned().await.ok()?,
            in_flight: self.in_flight.clone().acquire_owned().await.ok()?,
        };
        if busy && 1 + self.free() < low_water {
            let want = u32::try_from(low_water - 1).unwrap_or(u32::MAX);
            let more = async {
                let h = self.handlers.clone().acquire_many_owned(want).await.ok()?;
                let f = self.in_flight.clone().acquire_many_owned(want).await.ok()?;
                Some((h, f))
            };
            if let Ok(Some((h, f))) = tokio::time::timeout(Duration::from_millis(2), more).await {
                permits.handlers.merge(h);
                permits.in_flight.merge(f);
            }
        }
        let free = u32::try_from(self.free()).unwrap_or(u32::MAX);
        if free > 0
            && let (Ok(h), Ok(f)) = (
                self.handlers.clone().try_acquire_many_owned(free),
                self.in_flight.clone().try_acquire_many_owned(free),
            )
        {
            permits.handlers.merge(h);
            permits.in_flight.merge(f);
        }
        // Give back what the other kind cannot match.
        let n = permits
            .handlers
            .num_permits()
            .min(permits.in_flight.num_permits());
        let _ = permits.handlers.split(permits.handlers.num_permits() - n);
        let _ = permits.in_flight.split(permits.in_flight.num_permits() - n);
        Some(permits)
    }
}

/// Messages pulled and not yet acked: the consumer's `max_ack_pending`.
fn in_flight_window(cfg: &WorkerConfig) -> usize {
    cfg.concurrency.saturating_mul(2)
}

/// Pulls as many messages as there are free slots and runs each in its own task; on shutdown
/// drains until the deadline. Returns how many tasks were abandoned at the deadline.
async fn pull_loop<H: Handler>(
    shared: &Arc<Shared<H>>,
    consumer: &PullConsumer,
    shutdown: &CancellationToken,
) -> u64 {
    let cfg = &shared.cfg;
    let slots = Slots::new(cfg);
    let low_water = (cfg.concurrency / 4).max(1);
    let mut tasks: JoinSet<()> = JoinSet::new();
    let mut pull_failures: u32 = 0;
    'pull: loop {
        while let Some(done) = tasks.try_join_next() {
            report_join(done);
        }
        let mut pool = tokio::select! {
            biased;
            _ = shutdown.cancelled() => break 'pull,
            p = slots.acquire(!tasks.is_empty(), low_water) => match p {
                Some(p) => p,
                None => break 'pull,
            },
        };
        let wanted = pool.handlers.num_permits();
        let batch = consumer
            .batch()
            .max_messages(wanted)
            .expires(cfg.pull_expires)
            .messages()
            .await;
        let mut batch = match batch {
            Ok(b) => {
                pull_failures = 0;
                b
            }
            Err(e) => {
                pull_failures = pull_failures.saturating_add(1);
                let delay = cfg
                    .retry
                    .delay(u64::from(pull_failures))
                    .min(Duration::from_secs(5));
                warn!(error = %e, ?delay, "pull request failed; retrying");
                drop(pool);
                tokio::select! {
                    _ = shutdown.cancelled() => break 'pull,
                    _ = tokio::time::sleep(delay) => continue 'pull,
                }
            }
        };
        loop {
            let next = tokio::select! {
                biased;
                _ = shutdown.cancelled() => break 'pull,
                m = batch.next() => m,
            };
            match next {
                None => break,
                Some(Err(e)) => {
                    debug!(error = %e, "pull batch ended");
                    break;
                }
                Some(Ok(msg)) => {
                    let (Some(handler_slot), Some(in_flight)) =
                        (pool.handlers.split(1), pool.in_flight.split(1))
                    else {
                        // The server sent more than asked for; leave it for redelivery.
                        warn!("pull batch delivered more messages than requested");
                        break;
                    };
                    let shared = shared.clone();
                    // Boxed: the task's future is large, and tokio moves an unboxed future
                    // several times on its way into the task; a box moves once.
                    tasks.spawn(Box::pin(async move {
                        process(&shared, msg, handler_slot).await;
                        drop(in_flight);
                    }));
                }
            }
        }
    }
    info!(
        in_flight = tasks.len(),
        "shutting down: no more pulls, draining in-flight work"
    );
    let deadline = tokio::time::sleep(cfg.shutdown_deadline);
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            _ = &mut deadline => {
                let abandoned = tasks.len() as u64;
                if abandoned > 0 {
                    warn!(abandoned, "shutdown deadline passed; leaving in-flight messages un-acked for redelivery");
                }
                tasks.abort_all();
                while tasks.join_next().await.is_some() {}
                return abandoned;
            }
            done = tasks.join_next() => match done {
                Some(done) => report_join(done),
                None => return 0,
            },
        }
    }
}

fn report_join(done: Result<(), tokio::task::JoinError>) {
    if let Err(e) = done
        && e.is_panic()
    {
        error!("message task panicked outside the handler: {e}");
    }
}

fn msg_info(msg: &jetstream::Message) -> Option<MsgInfo> {
    let info = msg.info().ok()?;
    Some(MsgInfo {
        stream: info.stream.to_owned(),
        consumer: info.consumer.to_owned(),
        stream_sequence: info.stream_sequence,
        delivered: u64::try_from(info.delivered).unwrap_or(1).max(1),
    })
}

/// Handles one message. `handler_slot` is given back as soon as the handler has returned.
async fn process<H: Handler>(
    shared: &Arc<Shared<H>>,
    msg: jetstream::Message,
    handler_slot: OwnedSemaphorePermit,
) {
    let Some(info) = msg_info(&msg) else {
        warn!(subject = %msg.subject, "message without JetStream metadata; ignoring");
        return;
    };
    let msg = Arc::new(msg);
    let parent = extract_context(msg.headers.as_ref());
    match wire::decode(&msg.payload) {
        Err(e) => {
            let span = info_span!(
                names::SPAN_HANDLE_MESSAGE,
                service = %shared.cfg.service,
                stream_sequence = info.stream_sequence,
                delivery = info.delivered,
            );
            if has_span(&parent) {
                let _ = span.set_parent(parent.clone());
            }
            let attempt = Attempt {
                delivery: info.delivered,
                at: stagehand_schemas::now(),
                error: format!("undecodable message on {}: {e}", msg.subject),
                permanent: true,
            };
            warn!(parent: &span, error = %attempt.error, "dead-lettering undecodable message");
            drop(handler_slot);
            Box::pin(
                shared
                    .dead_letter(&msg, &info, None, vec![attempt], &parent)
                    .instrument(span),
            )
            .await;
        }
        Ok(event) => {
            let span = info_span!(
                names::SPAN_HANDLE_MESSAGE,
                event_id = %event.id,
                kind = event.kind(),
                project = %event.project,
                dataset = event.body.dataset().unwrap_or(""),
                delivery = info.delivered,
                stream_sequence = info.stream_sequence,
                service = %shared.cfg.service,
            );
            if has_span(&parent) {
                let _ = span.set_parent(parent.clone());
            }
            shared
                .process_event(msg, info, event, parent, handler_slot)
                .instrument(span)
                .await;
        }
    }
}

/// The trace context facts are published with: the handling span's when tracing is wired to
/// OpenTelemetry, else the consumed message's, so the trace id flows either way.
fn outgoing_context(parent: &OtelContext) -> OtelContext {
    let cx = tracing::Span::current().context();
    if has_span(&cx) { cx } else { parent.clone() }
}

impl<H: Handler> Shared<H> {
    async fn process_event(
        self: &Arc<Self>,
        msg: Arc<jetstream::Message>,
        info: MsgInfo,
        event: Event,
        parent: OtelContext,
        handler_slot: OwnedSemaphorePermit,
    ) {
        // 1. Finished already? Republish exactly what was recorded.
        match self.ledger.recorded_bytes(event.id.as_str()) {
            // Boxed, like the other uncommon paths, to keep the per-message future small.
            Ok(Some(recorded)) => return Box::pin(self.replay(&msg, recorded, &parent)).await,
            Ok(None) => {}
            Err(e) => return self.nak(&msg, &info, &format!("ledger read: {e}")).await,
        }
        // 2. Claim it, so that no other instance works on the same event id.
        let mut claim_rev = None;
        if let Some(claims) = &self.claims {
            match claims.claim(&event.id, info.stream_sequence).await {
                Ok(Claim::Owned(rev)) => claim_rev = Some(rev),
                Ok(Claim::Done) => {
                    debug!("another instance finished this event; acking");
                    bump(&self.counters.claimed_elsewhere);
                    return self.ack(&msg, AckKind::Ack).await;
                }
                Ok(Claim::HeldElsewhere) => {
                    bump(&self.counters.claimed_elsewhere);
                    return self.nak(&msg, &info, "claimed by another instance").await;
                }
                Err(e) => return self.nak(&msg, &info, &e.to_string()).await,
            }
        }
        // 3. Do the work, keeping the message (and the claim) alive while it runs.
        let ctx = WorkContext {
            msg: msg.clone(),
            delivery: info.delivered,
            stream_sequence: info.stream_sequence,
            shutdown: self.shutdown.clone(),
        };
        let result = {
            let work = AssertUnwindSafe(self.handler.handle(&event, &ctx)).catch_unwind();
            tokio::pin!(work);
            // A handler that finishes on its first poll needs no progress timer: arming one
            // per message costs more than a quick handler does.
            match futures::poll!(&mut work) {
                std::task::Poll::Ready(r) => r,
                std::task::Poll::Pending => {
                    let period = self.cfg.ack_wait / 3;
                    let mut ticker =
                        tokio::time::interval_at(tokio::time::Instant::now() + period, period);
                    loop {
                        tokio::select! {
                            r = &mut work => break r,
                            _ = ticker.tick() => {
                                if let Err(e) = msg.ack_with(AckKind::Progress).await {
                                    warn!(error = %e, "progress ack failed");
                                }
                                if let (Some(claims), Some(rev)) = (&self.claims, claim_rev) {
                                    match claims.renew(&event.id, info.stream_sequence, rev).await {
                                        Ok(new) => claim_rev = Some(new),
                                        Err(e) => warn!(error = %e, "claim renewal failed"),
                                    }
                                }
                            }
                        }
                    }
                }
            }
        };
        let result = result.unwrap_or_else(|panic| {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "non-string panic".into());
            Err(HandlerError::retryable(format!("handler panicked: {what}")))
        });
        drop(handler_slot);
        match result {
            Ok(facts) => self.finish(&msg, &info, &event, facts, &parent).await,
            Err(e) => Box::pin(self.failed(&msg, &info, &event, e, claim_rev, &parent)).await,
        }
    }

    /// 4–6. Record the outcome, publish the facts, ack.
    async fn finish(
        &self,
        msg: &jetstream::Message,
        info: &MsgInfo,
        event: &Event,
        facts: Vec<Event>,
        parent: &OtelContext,
    ) {
        let cx = outgoing_context(parent);
        let mut prepared = Vec::with_capacity(facts.len());
        for fact in &facts {
            match prepare(fact, &cx) {
                Ok(p) => prepared.push(p),
                Err(e) => {
                    // A fact that cannot be encoded will not encode next time either.
                    let err =
                        HandlerError::permanent(format!("fact {} is unpublishable: {e}", fact.id));
                    return self.failed(msg, info, event, err, None, parent).await;
                }
            }
        }
        let bytes: Vec<Vec<u8>> = prepared.iter().map(|(_, _, b)| b.to_vec()).collect();
        if let Err(e) = self
            .writer
            .record_outcome(event.id.as_str(), bytes, None, None)
            .await
        {
            return self
                .nak(msg, info, &format!("recording outcome: {e}"))
                .await;
        }
        // The outcome is durable: from here a crash or error leads to a replay of these facts.
        if let Some(hook) = &self.hooks.after_record {
            hook(&event.id).await;
        }
        let publishes = prepared.into_iter().map(|(subject, headers, payload)| {
            self.bus.publish_prepared(subject, headers, payload)
        });
        for r in futures::future::join_all(publishes).await {
            if let Err(e) = r {
                return self.nak(msg, info, &format!("publishing facts: {e}")).await;
            }
        }
        // The done marker and the ack are independent (either may fail without harm, see
        // `mark_done`); sending both at once saves a round trip.
        tokio::join!(self.mark_done(&event.id), self.ack(msg, AckKind::Ack));
        bump(&self.counters.handled);
        debug!(facts = facts.len(), "handled");
    }

    async fn failed(
        &self,
        msg: &jetstream::Message,
        info: &MsgInfo,
        event: &Event,
        err: HandlerError,
        claim_rev: Option<u64>,
        parent: &OtelContext,
    ) {
        let attempt = Attempt {
            delivery: info.delivered,
            at: stagehand_schemas::now(),
            error: err.to_string(),
            permanent: err.is_permanent(),
        };
        let exhausted = info.delivered >= u64::try_from(self.cfg.max_deliver).unwrap_or(u64::MAX);
        if err.is_permanent() || exhausted {
            let mut history = match self.ledger.attempts(&event.id) {
                Ok(h) => h,
                Err(e) => {
                    warn!(error = %e, "could not read attempt history; dead-lettering with this attempt only");
                    Vec::new()
                }
            };
            history.retain(|a| a.delivery != attempt.delivery);
            history.push(attempt);
            warn!(error = %err, permanent = err.is_permanent(), "giving up; dead-lettering");
            return self
                .dead_letter(msg, info, Some(event), history, parent)
                .await;
        }
        info!(error = %err, "retryable failure");
        if let Err(e) = self.writer.record_attempt(event.id.as_str(), attempt).await {
            warn!(error = %e, "could not record the failed attempt");
        }
        if let (Some(claims), Some(rev)) = (&self.claims, claim_rev)
            && let Err(e) = claims.release(&event.id, rev).await
        {
            warn!(error = %e, "could not release claim");
        }
        self.nak(msg, info, &err.to_string()).await;
    }

    /// Records and publishes a dead letter for the message, then terminates it.
    async fn dead_letter(
        &self,
        msg: &jetstream::Message,
        info: &MsgInfo,
        event: Option<&Event>,
        errors: Vec<Attempt>,
        parent: &OtelContext,
    ) {
        let dl = dead_letter_event(&self.cfg.service, info, msg, event, errors);
        // An undecodable message has no event id: its outcome is keyed by the dead letter's id,
        // which follows from the stream sequence, so a redelivery finds it too.
        let key = event.map_or_else(|| dl.id.clone(), |e| e.id.clone());
        match self.ledger.recorded_bytes(key.as_str()) {
            Ok(Some(recorded)) => return self.replay(msg, recorded, parent).await,
            Ok(None) => {}
            Err(e) => return self.nak(msg, info, &format!("ledger read: {e}")).await,
        }
        let bytes = match wire::encode(&dl) {
            Ok(b) => b,
            Err(e) => {
                error!(error = %e, "dead letter cannot be encoded; terminating the message without one");
                return self.ack(msg, AckKind::Term).await;
            }
        };
        let last_error = match &dl.body {
            Body::DeadLetter(d) => d.errors.last().map(|a| a.error.clone()),
            _ => None,
        };
        if let Err(e) = self
            .writer
            .record_outcome(key.as_str(), Vec::new(), Some(bytes.clone()), last_error)
            .await
        {
            return self
                .nak(msg, info, &format!("recording dead letter: {e}"))
                .await;
        }
        let cx = outgoing_context(parent);
        if let Err(e) = self
            .bus
            .publish_prepared(
                dead_letter_subject(&self.cfg.service),
                headers_for(dl.id.as_str(), &cx),
                Bytes::from(bytes),
            )
            .await
        {
            return self
                .nak(msg, info, &format!("publishing dead letter: {e}"))
                .await;
        }
        if let Some(e) = event {
            self.mark_done(&e.id).await;
        }
        self.ack(msg, AckKind::Term).await;
        bump(&self.counters.dead_lettered);
    }

    /// Republishes a recorded outcome (same bytes, same ids) and acks.
    async fn replay(
        &self,
        msg: &jetstream::Message,
        recorded: RecordedBytes,
        parent: &OtelContext,
    ) {
        let cx = outgoing_context(parent);
        let mut out = Vec::new();
        for bytes in &recorded.facts {
            match wire::decode(bytes) {
                Ok(fact) => out.push((
                    stagehand_schemas::subject::subject_for(&fact.body, &fact.project),
                    headers_for(fact.id.as_str(), &cx),
                    Bytes::from(bytes.clone()),
                )),
                Err(e) => error!(error = %e, "recorded fact no longer decodes; not republished"),
            }
        }
        if let Some(bytes) = &recorded.dead_letter
            && let Ok(dl) = wire::decode(bytes)
        {
            let service = match &dl.body {
                Body::DeadLetter(d) => d.service.clone(),
                _ => self.cfg.service.clone(),
            };
            out.push((
                dead_letter_subject(&service),
                headers_for(dl.id.as_str(), &cx),
                Bytes::from(bytes.clone()),
            ));
        }
        let publishes = out
            .into_iter()
            .map(|(s, h, p)| self.bus.publish_prepared(s, h, p));
        for r in futures::future::join_all(publishes).await {
            if let Err(e) = r {
                let info = msg_info(msg).unwrap_or(MsgInfo {
                    stream: String::new(),
                    consumer: String::new(),
                    stream_sequence: 0,
                    delivered: 1,
                });
                return self
                    .nak(msg, &info, &format!("republishing recorded facts: {e}"))
                    .await;
            }
        }
        let kind = if recorded.dead_letter.is_some() {
            AckKind::Term
        } else {
            AckKind::Ack
        };
        self.ack(msg, kind).await;
        bump(&self.counters.replayed);
        debug!("replayed recorded outcome");
    }

    async fn mark_done(&self, id: &EventId) {
        if let Some(claims) = &self.claims
            && let Err(e) = claims.done(id).await
        {
            // Harmless: the claim ages out, and the ledger and the duplicate window still hold.
            warn!(error = %e, "could not mark claim done");
        }
    }

    async fn ack(&self, msg: &jetstream::Message, kind: AckKind) {
        if let Err(e) = msg.double_ack_with(kind).await {
            // The outcome is recorded: a redelivery republishes it and acks again.
            warn!(error = %e, "ack not confirmed; the message may be redelivered and replayed");
        }
    }

    async fn nak(&self, msg: &jetstream::Message, info: &MsgInfo, why: &str) {
        let delay = self.cfg.retry.delay(info.delivered);
        debug!(?delay, why, "negative ack");
        bump(&self.counters.retried);
        if let Err(e) = msg.ack_with(AckKind::Nak(Some(delay))).await {
            warn!(error = %e, "negative ack failed; the server redelivers after AckWait");
        }
    }
}

/// The dead-letter event for a message: id derived from stream, consumer and sequence.
fn dead_letter_event(
    service: &str,
    info: &MsgInfo,
    msg: &jetstream::Message,
    event: Option<&Event>,
    errors: Vec<Attempt>,
) -> Event {
    let id = EventId::for_content(&[
        b"dead-letter",
        info.stream.as_bytes(),
        info.consumer.as_bytes(),
        &info.stream_sequence.to_be_bytes(),
    ]);
    let mut headers: Vec<(String, String)> = msg
        .headers
        .iter()
        .flat_map(|h| h.iter())
        .flat_map(|(name, values)| {
            let name: &str = name.as_ref();
            values
                .iter()
                .map(move |v| (name.to_owned(), v.as_str().to_owned()))
        })
        .collect();
    headers.sort();
    Event {
        id: id.clone(),
        schema: stagehand_schemas::SCHEMA_VERSION,
        occurred_at: stagehand_schemas::now(),
        project: event.map_or_else(|| "unknown".to_owned(), |e| e.project.clone()),
        correlation_id: event.map_or(id, |e| e.correlation_id.clone()),
        causation_id: event.map(|e| e.id.clone()),
        body: Body::DeadLetter(DeadLetter {
            service: service.to_owned(),
            stream: info.stream.clone(),
            consumer: info.consumer.clone(),
            stream_sequence: info.stream_sequence,
            subject: msg.subject.to_string(),
            delivered: info.delivered,
            original: msg.payload.to_vec(),
            headers,
            errors,
            original_id: event.map(|e| e.id.clone()),
        }),
    }
}
