//! The Stagehand worker runtime: the one consume loop every service runs on NATS JetStream.
//!
//! A service implements [`Handler`] and calls [`run_worker`]. For each message the runtime
//!
//! 1. **decodes** it ([`stagehand_schemas::wire::decode`]); undecodable bytes or an unknown
//!    kind are dead-lettered at once, with the original bytes and headers;
//! 2. **checks the ledger** (the service's redb file): an event finished before has its
//!    recorded facts republished — the same bytes, the same ids — and is acked;
//! 3. **claims** the event id in the `stagehand_claims` KV bucket, so that two instances never
//!    both do the work (see `claim.rs`);
//! 4. **handles** it, sending a progress ack every AckWait/3 while the handler runs;
//! 5. **records** the outcome in the ledger — one writer thread, many outcomes per commit;
//! 6. **publishes** the facts with `Nats-Msg-Id` = fact id, waiting for every PubAck;
//! 7. **acks** with a double ack (the server confirms).
//!
//! A retryable error becomes a negative ack with a delay from [`RetrySchedule`]; a permanent
//! one, or the last allowed delivery, becomes a [`stagehand_schemas::DeadLetter`] on
//! `stagehand.dlq.dead.letter.<service>` and a `Term`. Nothing is acked before its outcome is
//! durable, and an outcome, once committed, is what every later delivery republishes.
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

mod bus;
mod claim;
mod config;
mod error;
pub mod ledger;
pub mod runner;
mod worker;

pub use bus::{
    Bus, CLAIMS, CLAIMS_BUCKET, CLAIMS_MAX_AGE, KV_BUCKETS, KvSpec, MSG_ID_HEADER, PublishAck,
    READINESS, READINESS_BUCKET, STAGES, STAGES_BUCKET, stream_config,
};
pub use config::{
    BusConfig, RetrySchedule, WorkerConfig, duration_str, env, redact_text, redact_url,
    split_servers,
};
pub use error::{BusError, HandlerError};
pub use ledger::{Ledger, LedgerError, Outcome};
pub use worker::{
    Handler, Hook, WorkContext, WorkerHooks, WorkerStats, provision_consumer, run_worker,
    run_worker_with_hooks,
};

pub use tokio_util::sync::CancellationToken;
