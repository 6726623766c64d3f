//! One group-commit writer for Stagehand's redb stores, and the typed error of their files.
//!
//! A redb commit is durable when it returns, and each commit pays its own flush. A store whose
//! writes arrive from many tasks at once therefore hands them to one writer thread, which takes
//! the first write waiting and every other one queued meanwhile (up to a bound) and applies
//! them in one transaction: one flush for the batch, where each write alone would pay its own.
//! Each waiter is answered only after that commit returned, with its own outcome; a failed
//! commit fails every write it held (the batch is all or nothing), each waiter holding the one
//! cause in an [`Arc`](std::sync::Arc). The queue is bounded: a submitter finding it full waits
//! for room, so a store that cannot keep up slows its callers instead of growing.
//!
//! The store supplies what a batch means (`apply`: open one write transaction, apply every
//! write, commit) and, if it can repair itself, what to do after a failed batch
//! ([`Builder::on_failure`]); this crate supplies the queue, the batching and the answers. A
//! store that counts its commits does so in `apply`, which runs once per batch.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! use stagehand_store::CommitError;
//!
//! let (writer, thread) = stagehand_store::writer("example")
//!     .max_batch(64)
//!     .queue(128)
//!     .spawn(|batch: &[u32]| {
//!         // one transaction for the whole batch, committed here
//!         if batch.contains(&0) {
//!             return Err("zero is refused");
//!         }
//!         Ok(batch.iter().map(|n| n * 2).collect())
//!     })
//!     .unwrap();
//! assert_eq!(writer.submit(21).await.unwrap(), 42);
//! assert!(matches!(writer.submit(0).await, Err(CommitError::Failed(cause)) if *cause == "zero is refused"));
//! drop(writer);
//! thread.join();
//! # }
//! ```
//!
//! [`open_redb`] opens (or makes whole, then opens) a store's file, so that a kill while a
//! file is being created never leaves one that no later start can open.
//!
//! [`StateError`] is the failure of a service's own state file (the promoter's, the
//! demoter's): redb's error, a record that does not decode, a failed batch, a stopped writer,
//! each classified retryable or permanent through [`stagehand_schemas::Retryable`].

mod error;
mod file;
mod writer;

pub use error::{CommitError, StateError, create_state_file, redb_is_transient};
pub use file::open_redb;
pub use writer::{Builder, GroupWriter, WriterThread, writer};

/// For [`from_redb!`] in the stores that use it.
#[doc(hidden)]
pub use redb as __redb;
