//! The `stagehand` command: ingest, catalogue queries, backup status and restores, dead letters,
//! `cp`, and `up` — Stagehand on one machine.
//!
//! The binary only parses arguments ([`cli::Cli`]) and calls [`cli::run`]; each command's logic
//! is a module here, so the tests drive the same code paths the command runs.

pub mod backup;
pub mod catalogue;
pub mod cli;
pub mod cp;
pub mod dlq;
pub mod ingest;
pub mod up;
