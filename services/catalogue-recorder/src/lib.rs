//! The catalogue recorder: folds every fact into the catalogue, answers queries, and mirrors
//! readiness for schedulers.
//!
//! The catalogue is event-sourced. The facts stream is the log; this crate's redb file is a
//! view of it that any recorder can rebuild by replaying the stream ([`replay`]). The fold
//! ([`fold::apply`]) is pure over a key → bytes view and idempotent by event id, and every record
//! keeps the newest fact's stamp, so live consumption with redeliveries and a replay give equal
//! catalogues.
//!
//! ```
//! use stagehand_catalogue_recorder::{Query, Store, answer};
//!
//! let dir = tempfile::tempdir().unwrap();
//! let store = Store::open(dir.path().join("catalogue.redb")).unwrap();
//! let datasets = answer(&store, &Query::Datasets { project: None });
//! assert!(matches!(datasets, stagehand_catalogue_recorder::Answer::Datasets { datasets } if datasets.is_empty()));
//! ```

mod error;
pub mod fold;
pub mod model;
mod query;
pub mod readiness;
mod replay;
mod service;
mod store;

pub use error::{RecorderError, StoreError};
pub use fold::TierKey;
pub use model::*;
pub use query::{
    Answer, AskError, ErrorCode, MIN_VERSION_PREFIX, QUEUE_GROUP, Query, answer, ask,
    serve as serve_queries, tier_readiness,
};
pub use replay::{Replayed, replay};
pub use service::{
    Config, RecorderConfig, RecorderStats, SERVICE, config, rebuild_if_needed, run, serve,
};
pub use store::{Dump, MAX_BATCH, Store, Writer, WriterThread};
