//! The Stagehand catalogue as its users see it: the queries it answers over NATS
//! request/reply, the shape of its answers and records, the readiness record schedulers read
//! from the `stagehand_readiness` KV bucket, and a client ([`ask`], [`Catalogue`]).
//!
//! Services, scheduler tools and the CLI depend on this crate, never on the recorder (and its
//! store). A query is a JSON [`Query`] sent to `stagehand.catalogue.query`; recorders answer in
//! the queue group [`QUEUE_GROUP`] with one JSON [`Answer`] of at most [`MAX_ANSWER_BYTES`].
//! Lists are pages (`limit`, `after` → `next`), so an answer stays bounded however large the
//! catalogue: a version of 14 million files is read page by page ([`Catalogue::all_files`]).
//! [`survey`] and [`views`] are the read-only survey of a bounded tier built on these queries:
//! the demoter acts on it and `stagehand tier usage` shows it.
//!
//! ```text
//! {"query":"datasets","limit":2}                 → {"answer":"datasets","datasets":[…],"next":"lab-a/cats"}
//! {"query":"version","dataset":"cats","version":"3f2a9c01"}
//!                                                → {"answer":"version","version":{…},"replicas":[…],"replicas_next":null}
//! {"query":"files","dataset":"cats","version":"3f2a9c01","limit":100,"after":"train/0099.jpg"}
//!                                                → {"answer":"files","version":"3f2a9c01…","files":[…],"next":"train/0199.jpg"}
//! {"query":"stage_requests","project":"lab-a","job_id":"4815162"}
//!                                                → {"answer":"stage_requests","stages":[{"state":"copying",…}],"next":null}
//! {"query":"lineage","dataset":"cats"}         → {"answer":"lineage","lineage":[{"version":{…},"replicas":[…],"derived":[…]}],"next":null}
//! {"query":"checkpoints","project":"lab-a","run":"r1","limit":2}
//!                                                → {"answer":"checkpoints","checkpoints":[{"step":100,"state":"demoted","location":{"tier":"capacity",…},"rule":"keep_every",…},…],"next":"200"}
//! {"query":"file","dataset":"cats","version":"3f2a9c01","path":"labels.csv"}
//!                                                → {"answer":"file","version":"3f2a…","file":{"path":…,"size":…,"sha256":…}}
//! {"query":"backup_status","project":"lab-a","tier":"backup","protected_only":true}
//!                                                → {"answer":"backup_status","versions":[{"version":…,"backups":[…]}],"next":null}
//! ```
//! A failed query answers `{"answer":"error","code":"not_found"|"ambiguous"|"bad_query"|
//! "internal","message":"…"}`. Times are RFC 3339 in UTC.
//!
//! ```no_run
//! # async fn demo(nats: async_nats::Client) -> Result<(), stagehand_catalogue::CatalogueError> {
//! use futures::TryStreamExt;
//! use stagehand_catalogue::Catalogue;
//!
//! let catalogue = Catalogue::new(nats);
//! let version = catalogue.version(Some("lab-a"), "cats", "3f2a9c01").await?;
//! let files = catalogue.all_files(Some("lab-a".into()), "cats".into(), version.version.version, 1000, None);
//! let mut files = std::pin::pin!(files);
//! while let Some(file) = files.try_next().await? {
//!     println!("{}\t{}\t{}", file.path, file.size, file.sha256);
//! }
//! # Ok(()) }
//! ```

mod client;
mod query;
mod readiness;
mod records;
pub mod survey;
pub mod time;
pub mod views;

pub use client::{AskError, Catalogue, CatalogueError, FilesPage, Page, ask};
pub use query::{
    Answer, DEFAULT_DETAIL, DEFAULT_PAGE, DatasetDetail, ErrorCode, LineageNode, MAX_ANSWER_BYTES,
    MAX_CHECKPOINT_PARTS, MAX_DETAIL, MAX_PAGE, MIN_VERSION_PREFIX, QUEUE_GROUP, Query,
    VersionDetail, cursor,
};
pub use readiness::{
    BUCKET as READINESS_BUCKET, CopyProgress, JobCounts, Readiness, ReadinessKey, ReadinessState,
    kv_key,
};
pub use records::*;
