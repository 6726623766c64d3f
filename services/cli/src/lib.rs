//! The `stagehand` command: ingest, catalogue queries, checkpoints, backup status and restores,
//! dead letters, `status` for on-call, `cp`, `up` — Stagehand on one machine — and `stage`, what scheduler plugins call.
//!
//! The binary only parses arguments ([`cli::Cli`]) and calls [`cli::run`]; each command's logic
//! is a module here, so the tests drive the same code paths the command runs.

pub mod args;
pub mod audit;
pub mod backup;
pub mod catalogue;
pub mod checkpoint;
pub mod cli;
pub mod cp;
pub mod dlq;
pub mod docs;
pub mod gates;
pub mod ingest;
pub mod kube;
pub mod policy;
pub mod reconcile;
pub mod scrub;
pub mod stage;
pub mod status;
pub mod tier;
pub mod up;
