//! The Stagehand worker runtime: the one consume loop every service runs on NATS JetStream.
//!
//! A service implements [`Handler`] and calls [`run_worker`]. For each message the runtime
//! runs these steps (the same numbers are used in the README and in the code's comments):
//!
//! 1. **decode** it ([`stagehand_schemas::wire::decode`]) and check that the envelope's
//!    `project` is the project token of the request or fact subject it came on; undecodable
//!    bytes, an unknown kind or another project's subject are dead-lettered at once;
//! 2. **check the ledger** (the service's redb file, keyed by project *and* event id): an event
//!    finished before has its recorded facts republished — the same bytes, the same ids — and
//!    is acked;
//! 3. **claim** the event in the `stagehand_claims` KV bucket, so that two deliveries never
//!    both do the work; a claim found `done` carries the first outcome, which is republished;
//! 4. **handle** it, sending a progress ack and renewing the claim every AckWait/3; a claim
//!    lost meanwhile cancels the handler;
//! 5. **commit** the outcome: a compare-and-set of the claim to `done` with the facts (the
//!    commit point across instances), then the ledger — one writer thread, many outcomes per
//!    commit, the first outcome recorded wins;
//! 6. **publish** the facts of that first outcome with `Nats-Msg-Id` = fact id, waiting for
//!    every PubAck;
//! 7. **ack** with a double ack (the server confirms).
//!
//! Every failure of every step goes through **G**, the one give-up path: a failure that counts
//! (the handler's, or the ledger's, the claims bucket's, a publish) is retried with a delayed
//! negative ack from [`RetrySchedule`] until `max_attempts`; one that does not count (another
//! delivery holds the claim) waits out the claim without cost; a permanent failure, the last
//! attempt, or the consumer's `max_deliver` ceiling becomes a [`stagehand_schemas::DeadLetter`]
//! on `stagehand.dlq.dead.letter.<service>` with the attempt history, and a `Term`. Nothing
//! is acked before its outcome is durable, and an outcome, once committed, is what every later
//! delivery republishes. A ledger that fails and cannot be reopened, or a handler's
//! [`HandlerError::fatal`], stops the worker with an error.
//!
//! ```no_run
//! use std::sync::Arc;
//! use stagehand_bus::{Bus, BusConfig, Handler, HandlerError, WorkContext, WorkerConfig, run_worker};
//! use stagehand_schemas::{Event, subject};
//!
//! struct Echo;
//! impl Handler for Echo {
//!     async fn handle(&self, event: &Event, _ctx: &WorkContext) -> Result<Vec<Event>, HandlerError> {
//!         Ok(vec![event.caused("echoed", event.body.clone())])
//!     }
//! }
//!
//! # async fn run() -> Result<(), stagehand_bus::BusError> {
//! let bus = Bus::connect(&BusConfig::default()).await?;
//! bus.provision().await?;
//! let cfg = WorkerConfig::new(
//!     "echo",
//!     subject::REQUESTS.name,
//!     vec![subject::kind_filter("req", "stage.released")],
//!     "/var/lib/stagehand/echo.redb",
//! );
//! let stats = run_worker(bus, cfg, Arc::new(Echo), tokio_util::sync::CancellationToken::new()).await?;
//! # Ok(()) }
//! ```

pub mod accounts;
mod bus;
mod claim;
mod config;
mod dedup;
mod error;
pub mod ledger;
pub mod placement;
mod retry;
pub mod runner;
mod worker;

pub use bus::{
    Bus, CLAIMS, CLAIMS_BUCKET, CLAIMS_MAX_AGE, HEARTBEATS, HEARTBEATS_BUCKET, KV_BUCKETS, KvSpec,
    MSG_ID_HEADER, OBJECT_BUCKETS, PROMOTER, PROMOTER_BUCKET, PublishAck, READINESS,
    READINESS_BUCKET, SERVICE_KV_BUCKETS, STAGES, STAGES_BUCKET, SWARMS, SWARMS_BUCKET,
    bucket_missing, stream_config, stream_missing,
};
pub use claim::{Claim, Claims, Commit, Lease, LeaseError};
pub use config::{
    BusConfig, DEFAULT_PUBLISH_TIMEOUT, DEFAULT_SHUTDOWN_DEADLINE, WorkerConfig, env, redact_text,
    redact_url, split_servers,
};
pub use dedup::msg_id_for;
pub use error::{BoxError, BusError, BusErrorKind, HandlerError};
pub use ledger::{EventKey, Ledger, LedgerError, LedgerErrorKind, Outcome};
pub use retry::{Delays, RetrySchedule};
pub use worker::{
    Handler, Hook, REPLAY_HEADER, WorkContext, WorkerHooks, WorkerStats, default_instance_id,
    host_name, provision_consumer, run_worker, run_worker_with_hooks,
};

pub use tokio_util::sync::CancellationToken;
