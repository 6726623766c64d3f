//! The arguments of `stagehand checkpoint …`, and `commit`'s validated into [`CommitOptions`].

use std::path::PathBuf;

use clap::{Args, Subcommand};
use stagehand_catalogue::checkpoint_dataset;
use stagehand_schemas::layout;

use super::{CheckpointError, usage};

#[derive(Debug, Subcommand)]
pub enum CheckpointCommand {
    /// Announce a complete checkpoint: recognise its format, hash its files, publish
    /// `checkpoint.committed` (the same step again is the same fact). A part on a node-local
    /// tier is stamped, not hashed (no byte read): its node's agent hashes it as it offloads it.
    Commit(CommitArgs),
    /// A run's checkpoints: step, tags, tier(s), and why each is kept or expired.
    List(ListArgs),
    /// Bring a checkpoint back onto a hot (or node-local) tier: a stage request for its
    /// version of `ckpt-<run>`, waited for like `stagehand stage wait` (prints the path).
    Restore(RestoreArgs),
}

#[derive(Debug, Args)]
pub struct CommitArgs {
    /// Training run name: [A-Za-z0-9._-], 1-128 characters.
    #[arg(long)]
    pub run: String,
    /// Training step of the checkpoint.
    #[arg(long)]
    pub step: String,
    /// The checkpoint's directory, beneath the tier's root and the project's folder there
    /// (`<root>/<project>/...`). For DeepSpeed, the save directory (its `latest` tag is
    /// committed) or the tag directory.
    pub path: PathBuf,
    /// A tag retention honours (`best`, `keep`, `release`); repeatable.
    #[arg(long = "tag")]
    pub tags: Vec<String>,
    /// The writer finished this directory: commit it even though it is in no format
    /// recognised here (never overrides the refusal of a recognised, incomplete one).
    #[arg(long)]
    pub complete: bool,
    /// Project (tenant) of the run: [a-z0-9_-].
    #[arg(long, env = "STAGEHAND_PROJECT")]
    pub project: Option<String>,
    /// The posix tier holding the checkpoint.
    #[arg(long, default_value = "hot")]
    pub tier: String,
    /// With a node-local `--tier`: the node whose NVMe holds this part (its agent offloads
    /// it). The step is committed in `--parts` parts, one per node.
    #[arg(long)]
    pub node: Option<String>,
    /// With a node-local `--tier`: this part's index, 0 to `--parts` - 1. Its folder is
    /// `<tier root>/<project>/ckpt-<run>/step-<step>/part-<part>`.
    #[arg(long)]
    pub part: Option<String>,
    /// With a node-local `--tier`: how many parts the step has (the step counts once all
    /// are offloaded).
    #[arg(long)]
    pub parts: Option<String>,
    /// Policy folder; default `$STAGEHAND_HOME/policies` (`./.stagehand/policies`).
    #[arg(long)]
    pub policies: Option<PathBuf>,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct ListArgs {
    /// Training run name.
    pub run: String,
    /// Project (tenant) of the run.
    #[arg(long, env = "STAGEHAND_PROJECT")]
    pub project: Option<String>,
    /// Policy folder whose `retention.toml` says what retention decides now; default
    /// `$STAGEHAND_HOME/policies`, skipped when absent.
    #[arg(long)]
    pub policies: Option<PathBuf>,
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct RestoreArgs {
    /// Training run name.
    pub run: String,
    /// The step to restore; default the newest one not expired.
    #[arg(long)]
    pub step: Option<String>,
    #[command(flatten)]
    pub place: crate::cli::StagePlaceArgs,
    /// How long to wait for it (90, 90s, 30m, 1h); 0 looks once.
    #[arg(long, default_value = "1h")]
    pub timeout: String,
    /// Print the stage's status as JSON.
    #[arg(long)]
    pub json: bool,
}

/// What `commit` was asked.
#[derive(Debug, Clone)]
pub struct CommitOptions {
    pub project: String,
    pub run: String,
    pub step: u64,
    pub path: PathBuf,
    pub tags: Vec<String>,
    pub complete: bool,
    pub tier: String,
    pub policies: PathBuf,
    /// A part of a step committed on a node-local tier.
    pub part: Option<PartOf>,
}

/// Which part of a step a commit on a node-local tier is, and on which node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartOf {
    pub node: String,
    pub part: u32,
    pub parts: u32,
}

impl PartOf {
    fn from_args(args: &CommitArgs) -> Result<Option<PartOf>, CheckpointError> {
        let (node, part, parts) = match (&args.node, &args.part, &args.parts) {
            (None, None, None) => return Ok(None),
            (Some(node), Some(part), Some(parts)) => (node, part, parts),
            _ => {
                return Err(usage(
                    "--node, --part and --parts go together: a part of a step on a node-local tier",
                ));
            }
        };
        if node.is_empty() || node.len() > 64 {
            return Err(usage(format!(
                "--node {node:?} must be a node name of 1-64 characters"
            )));
        }
        let number = |flag: &str, v: &str| {
            v.parse::<u32>()
                .map_err(|_| usage(format!("{flag} {v:?} is not a whole number")))
        };
        let (part, parts) = (number("--part", part)?, number("--parts", parts)?);
        if parts == 0 || parts > layout::MAX_CHECKPOINT_PARTS || part >= parts {
            return Err(usage(format!(
                "--part {part} --parts {parts}: parts must be 1-{} and part below it",
                layout::MAX_CHECKPOINT_PARTS
            )));
        }
        Ok(Some(PartOf {
            node: node.clone(),
            part,
            parts,
        }))
    }
}

impl CommitOptions {
    /// Checks the arguments that need no file system.
    pub fn from_args(args: &CommitArgs) -> Result<CommitOptions, CheckpointError> {
        let project = args
            .project
            .clone()
            .ok_or_else(|| usage("--project (or STAGEHAND_PROJECT) is required"))?;
        check_project(&project)?;
        check_run(&args.run)?;
        let step = args
            .step
            .parse()
            .map_err(|_| usage(format!("--step {:?} is not a step number", args.step)))?;
        for tag in &args.tags {
            if tag.is_empty()
                || tag.len() > 64
                || !tag
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
            {
                return Err(usage(format!(
                    "--tag {tag:?} must be 1-64 characters of [A-Za-z0-9._-]"
                )));
            }
        }
        Ok(CommitOptions {
            project,
            run: args.run.clone(),
            step,
            path: args.path.clone(),
            tags: args.tags.clone(),
            complete: args.complete,
            tier: args.tier.clone(),
            policies: args.policies.clone().unwrap_or_else(default_policies),
            part: PartOf::from_args(args)?,
        })
    }
}

pub(super) fn default_policies() -> PathBuf {
    stagehand_policy::stagehand_home().join("policies")
}

pub(super) fn check_project(project: &str) -> Result<(), CheckpointError> {
    layout::check_project(project).map_err(|e| usage(e.to_string()))
}

pub(super) fn check_run(run: &str) -> Result<(), CheckpointError> {
    layout::check_dataset_name(run).map_err(|e| usage(format!("run: {e}")))?;
    // The run's checkpoints are versions of the dataset `ckpt-<run>`, which must be a name too.
    layout::check_dataset_name(&checkpoint_dataset(run)).map_err(|_| {
        usage(format!(
            "run {run:?} is too long: its checkpoints' dataset {:?} must be at most 128 characters",
            checkpoint_dataset(run)
        ))
    })
}
