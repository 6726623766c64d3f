//! `stagehand checkpoint …`: a training job announces its checkpoints, and people see what
//! retention keeps.
//!
//! `commit` recognises a complete checkpoint of the common formats on a posix tier (the run
//! wrote it there, normally the hot tier) and refuses an incomplete one with the reason before
//! anything is published; it hashes every file through the mover's bounded, confined reads
//! and publishes `checkpoint.committed` with the manifest inline, or by reference in the
//! project's upload bucket when it is larger than the contract's inline bound. The fact's id
//! follows from (project, run, step) ([`EventId::for_checkpoint`](stagehand_schemas::EventId::for_checkpoint)), so committing a step again
//! is the same fact: the stream's duplicate window drops it and the catalogue folds it once.
//! A re-commit within the window whose files, tags or place differ from the stored commit is
//! refused, naming what differs (the first commit stands); after the window (an hour) the
//! catalogue still keeps the first, since it folds each fact id once. A step is one folder of
//! its own: a folder that is, contains or lies in the folder of another live step of the
//! project (any run) is refused naming both (the catalogue says which steps overlap; without
//! the right to ask it, the recorder refuses the commit when it folds it).
//!
//! A part of a step on a node-local tier (`--node`, `--part`, `--parts`) is not hashed: its
//! files are stamped (size, mtime, ctime, inode, one metadata walk through the mover's
//! fingerprint, no byte read) and announced as `checkpoint.part.committed`, so the commit a
//! training loop waits for costs the same whatever the part's size. The node's agent reads
//! each file once, hashing it as it copies it off the node, refuses the part if a stamp moved
//! since the commit, and states the SHA-256 in `checkpoint.part.offloaded`: the hashes the
//! step's `checkpoint.committed` lists and a restore verifies.
//!
//! When is a checkpoint complete (`/work/shared/SCHEDULERS.md`):
//!
//! | format | complete when | refused when |
//! | --- | --- | --- |
//! | torch.distributed.checkpoint | `.metadata` exists (renamed from `.metadata.tmp` last) | `.distcp` shards without `.metadata` |
//! | Orbax | the directory has its final name and `commit_success.txt` or `_CHECKPOINT_METADATA` | a `.orbax-checkpoint-tmp` name (its own or an item's), or no marker |
//! | DeepSpeed | `<save_dir>/latest` names the tag directory (PATH may be either) | no `latest`, or it names another tag or a missing one |
//! | NeMo 2 | no `<ckpt>-unfinished` marker beside it | the marker exists (checked for every format) |
//! | any other directory | `--complete` says the writer finished it | without `--complete` |
//!
//! On a node-local tier (`--tier local --node N --part I --parts K`) a commit is one node's
//! part of its step, in exactly its folder `<root>/<project>/ckpt-<run>/step-<S>/part-<I>`
//! (`stagehand_schemas::layout::checkpoint_part_folder`): it publishes
//! `checkpoint.part.committed` with the part's files inline and returns once the fact is
//! stored. The node's agent offloads the part to `retention.toml`'s `[offload] tier`; the step
//! becomes the run's latest only when every part is offloaded (`services/promoter`,
//! "Checkpoints offloaded"). Until then `list` shows it `at risk`, naming the parts still on
//! node NVMe only, their nodes and bytes; past `[offload] deadline`, `offload late` (and
//! `stagehand status --policies DIR` lists it as a finding).
//!
//! `list` shows a run's checkpoints from the catalogue (step, tags, state, tiers, the rule of
//! the latest demotion or expiry) and, when `retention.toml` is at hand, what retention decides
//! for each now ([`stagehand_policy::retention::decide`]); under a step the demoter left whole
//! (`checkpoint.held`: files its commit does not list, or an overlapping step), a `held:` line
//! with the decision, the reason and the unlisted files.
//!
//! `restore` brings a checkpoint back onto a hot (or node-local) tier: the step asked for, or
//! the newest not expired. Each committed checkpoint is the version (its manifest's digest) of
//! the dataset `ckpt-<run>` in the catalogue, with its replicas where it was committed and
//! where retention demoted it, so `restore` is a stage request of that version through
//! [`crate::stage::request`] and [`crate::stage::wait`], and prints the staged folder as
//! `stagehand stage wait` does (a checkpoint still where its run committed it, on the tier
//! asked for, is not copied: its folder there is printed). A folder is printed only when it
//! is there and holds every committed file with its committed size (sizes, not hashes: reading
//! a checkpoint of hundreds of GiB to print its path is not a restore's job); otherwise
//! `restore` is refused (exit 1) naming what is missing. The stage is the job's (`--job`)
//! until `stagehand stage release ckpt-<run>@<digest> --tier T --job J` releases it.
//!
//! Exit codes: 0 done, 1 refused (an incomplete checkpoint, a file that cannot be read as it
//! was listed; for `restore`, no such step, expired, or the stage failed), 2 `restore` timed
//! out, 64 a bad argument, 69 NATS unreachable.

use std::io::Write;

use stagehand_schemas::Body;

use crate::args::{EX_SOFTWARE, EX_UNAVAILABLE, EX_USAGE};
use crate::cli::Connection;
use crate::stage::WaitOutcome;

mod args;
mod commit;
mod format;
mod list;
mod restore;

pub use args::{CheckpointCommand, CommitArgs, CommitOptions, ListArgs, RestoreArgs};
pub use commit::{Committed, Prepared, commit, prepare, publish};
pub use format::{Format, Recognised, recognise};
pub use list::{
    Decision, ListedCheckpoint, ListedState, PartOnNode, StepOffload, list, list_text, listing,
    listing_with_parts,
};
pub use restore::{Restored, restorable, restore, whole_at};

/// Exit code of a refused checkpoint.
pub const EXIT_REFUSED: i32 = 1;

/// Why a checkpoint command did not do its work, and its exit code.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// A bad argument (exit 64).
    #[error("{0}")]
    Usage(String),
    /// The checkpoint is refused (exit 1): incomplete, or its files not as listed.
    #[error("refused: {0}")]
    Refused(String),
    /// NATS (or the catalogue on it) could not be reached (exit 69).
    #[error("{0:#}")]
    Unavailable(anyhow::Error),
    /// Anything else (exit 70, as every command's other errors).
    #[error("{0:#}")]
    Other(anyhow::Error),
}

impl CheckpointError {
    pub fn exit_code(&self) -> i32 {
        match self {
            CheckpointError::Usage(_) => EX_USAGE,
            CheckpointError::Refused(_) => EXIT_REFUSED,
            CheckpointError::Unavailable(_) => EX_UNAVAILABLE,
            CheckpointError::Other(_) => EX_SOFTWARE,
        }
    }
}

fn usage(msg: impl Into<String>) -> CheckpointError {
    CheckpointError::Usage(msg.into())
}

fn refused(msg: impl Into<String>) -> CheckpointError {
    CheckpointError::Refused(msg.into())
}

/// Runs a `stagehand checkpoint` command, printing its answer; returns the exit code.
pub async fn run(connection: &Connection, cmd: CheckpointCommand) -> anyhow::Result<i32> {
    let result = match cmd {
        CheckpointCommand::Commit(args) => match CommitOptions::from_args(&args) {
            Err(e) => Err(e),
            Ok(opts) => commit(connection, &opts).await.map(|c| {
                print_committed(&opts, &c, args.json);
            }),
        },
        CheckpointCommand::List(args) => list(connection, &args).await.and_then(|items| {
            let stdout = std::io::stdout();
            let mut out = std::io::BufWriter::new(stdout.lock());
            let written = if args.json {
                serde_json::to_writer_pretty(&mut out, &items)
                    .map_err(std::io::Error::other)
                    .and_then(|()| writeln!(out))
            } else {
                list_text(&args.run, &items, &mut out)
            };
            written
                .and_then(|()| out.flush())
                .map_err(|e| CheckpointError::Other(e.into()))
        }),
        CheckpointCommand::Restore(args) => {
            return match restore(connection, &args).await {
                Ok(Restored::InPlace(path)) => {
                    if args.json {
                        let out = serde_json::json!({ "state": "in_place", "path": path });
                        println!("{}", serde_json::to_string_pretty(&out)?);
                    } else {
                        println!("{}", path.display());
                    }
                    Ok(0)
                }
                Ok(Restored::Staged(staged)) => {
                    let (stage, outcome) = *staged;
                    if args.json {
                        let status = match &outcome {
                            WaitOutcome::Ready(s)
                            | WaitOutcome::Failed(s)
                            | WaitOutcome::TimedOut(Some(s)) => Some(s),
                            WaitOutcome::TimedOut(None) => None,
                        };
                        println!("{}", serde_json::to_string_pretty(&status)?);
                    } else {
                        println!("{}", outcome.text(&stage));
                    }
                    Ok(outcome.exit_code())
                }
                Err(e) => {
                    eprintln!("stagehand checkpoint: {e}");
                    Ok(e.exit_code())
                }
            };
        }
    };
    match result {
        Ok(()) => Ok(0),
        Err(e) => {
            eprintln!("stagehand checkpoint: {e}");
            Ok(e.exit_code())
        }
    }
}

fn print_committed(opts: &CommitOptions, c: &Committed, json: bool) {
    if let Body::CheckpointPartCommitted(fact) = &c.event.body {
        return print_part_committed(opts, c, fact, json);
    }
    let Body::CheckpointCommitted(fact) = &c.event.body else {
        unreachable!("commit publishes checkpoint.committed")
    };
    if json {
        let out = serde_json::json!({
            "id": c.event.id,
            "project": opts.project,
            "run": fact.run,
            "step": fact.step,
            "format": c.format.name(),
            "location": fact.location,
            "files": c.files,
            "total_bytes": c.total_bytes,
            "manifest": c.manifest_digest,
            "tags": fact.tags,
            "duplicate": c.duplicate,
        });
        println!("{}", serde_json::to_string_pretty(&out).unwrap_or_default());
        return;
    }
    println!("{}", c.event.id);
    eprintln!(
        "committed step {} of run {} ({}): {} files, {} bytes at {}:{}, manifest {}{}",
        fact.step,
        fact.run,
        c.format.name(),
        c.files,
        c.total_bytes,
        fact.location.tier,
        fact.location.prefix,
        match &c.manifest_digest {
            Some(d) => format!("by reference ({d})"),
            None => "inline".to_owned(),
        },
        if c.duplicate {
            " (this step was committed before: the same fact)"
        } else {
            ""
        }
    );
}

fn print_part_committed(
    opts: &CommitOptions,
    c: &Committed,
    fact: &stagehand_schemas::CheckpointPartCommitted,
    json: bool,
) {
    if json {
        let out = serde_json::json!({
            "id": c.event.id,
            "project": opts.project,
            "run": fact.run,
            "step": fact.step,
            "part": fact.part,
            "parts": fact.parts,
            "node": fact.node,
            "format": c.format.name(),
            "location": fact.location,
            "files": c.files,
            "total_bytes": c.total_bytes,
            "tags": fact.tags,
            "duplicate": c.duplicate,
        });
        println!("{}", serde_json::to_string_pretty(&out).unwrap_or_default());
        return;
    }
    println!("{}", c.event.id);
    eprintln!(
        "committed part {} of {} of step {} of run {} on node {} ({}): {} files, {} bytes at \
         {}:{}; the step counts once every part is offloaded{}",
        fact.part,
        fact.parts,
        fact.step,
        fact.run,
        fact.node,
        c.format.name(),
        c.files,
        c.total_bytes,
        fact.location.tier,
        fact.location.prefix,
        if c.duplicate {
            " (this part was committed before: the same fact)"
        } else {
            ""
        }
    );
}
