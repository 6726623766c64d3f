//! The catalogue recorder: folds every fact into the catalogue, answers queries, and mirrors
//! readiness for schedulers.
//!
//! The catalogue is event-sourced. The facts stream is the log; this crate's redb file
//! ([`Store`], one typed table per kind of record) is a view of it that any recorder can
//! rebuild by replaying the stream ([`replay`]). The fold ([`fold::apply`], one function per
//! kind of fact) is idempotent by event id, and every record keeps the newest fact's stamp, so
//! live consumption with redeliveries and a replay give equal catalogues. A version's file list
//! is stored in chunks keyed by (version, path), fetched through `stagehand-manifest` and
//! verified first, so a version of millions of files costs nothing to hold or to page.
//!
//! Queries and answers are the client crate's ([`stagehand_catalogue`]): users of the catalogue
//! depend on that, never on this crate.
//!
//! ```
//! use stagehand_catalogue::{Answer, Query};
//! use stagehand_catalogue_recorder::{Store, answer};
//!
//! let dir = tempfile::tempdir().unwrap();
//! let store = Store::open(dir.path().join("catalogue.redb")).unwrap();
//! let datasets = answer(&store, &Query::Datasets { project: None, limit: None, after: None });
//! assert!(matches!(datasets, Answer::Datasets { datasets, next: None } if datasets.is_empty()));
//! ```

mod chunk;
mod error;
mod files;
pub mod fold;
mod gauges;
mod live;
pub mod model;
mod parts;
mod prune;
mod query;
pub mod readiness;
mod replay;
mod service;
mod stage;
mod store;

pub use chunk::{CHUNK_BYTES, CHUNK_ENTRIES};
pub use error::{RecorderError, StoreError};
pub use files::FileLists;
pub use prune::{DEFAULT_STAGE_PRUNE_INTERVAL, DEFAULT_STAGE_RETENTION, PrunePass};
pub use query::{Replies, answer, encode_answer, serve as serve_queries};
pub use replay::{MAX_REPLAY_BATCH_BYTES, Replayed, replay};
pub use service::{
    Config, DEFAULT_INBOX_PREFIXES, RecorderStats, SERVICE, Settings, config, run, serve,
};
pub use store::{Dump, FoldItem, Folded, MAX_BATCH, MAX_RECORD_BYTES, Store, Writer, WriterThread};
#[cfg(test)]
mod testing;
