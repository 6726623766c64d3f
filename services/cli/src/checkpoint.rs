//! `stagehand checkpoint …`: a training job announces its checkpoints, and people see what
//! retention keeps.
//!
//! `commit` recognises a complete checkpoint of the common formats on a posix tier (the run
//! wrote it there, normally the hot tier) and refuses an incomplete one with the reason before
//! anything is published; it hashes every file through the mover's bounded, confined reads
//! and publishes `checkpoint.committed` with the manifest inline, or by reference in the
//! project's upload bucket when it is larger than the contract's inline bound. The fact's id
//! follows from (project, run, step) ([`EventId::for_checkpoint`]), so committing a step again
//! is the same fact: the stream's duplicate window drops it and the catalogue folds it once.
//! A re-commit within the window whose files, tags or place differ from the stored commit is
//! refused, naming what differs (the first commit stands); after the window (an hour) the
//! catalogue still keeps the first, since it folds each fact id once.
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
//! `list` shows a run's checkpoints from the catalogue (step, tags, state, tiers, the rule of
//! the latest demotion or expiry) and, when `retention.toml` is at hand, what retention decides
//! for each now ([`stagehand_policy::retention::decide`]).
//!
//! `restore` brings a checkpoint back onto a hot (or node-local) tier: the step asked for, or
//! the newest not expired. Each committed checkpoint is the version (its manifest's digest) of
//! the dataset `ckpt-<run>` in the catalogue, with its replicas where it was committed and
//! where retention demoted it, so `restore` is a stage request of that version through
//! [`crate::stage::request`] and [`crate::stage::wait`], and prints the staged folder as
//! `stagehand stage wait` does (a checkpoint still where its run committed it, on the tier
//! asked for, is not copied: its folder there is printed). The stage is the job's (`--job`)
//! until `stagehand stage release ckpt-<run>@<digest> --tier T --job J` releases it.
//!
//! Exit codes: 0 done, 1 refused (an incomplete checkpoint, a file that cannot be read as it
//! was listed; for `restore`, no such step, expired, or the stage failed), 2 `restore` timed
//! out, 64 a bad argument, 69 NATS unreachable.

use std::io::Write;
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use clap::{Args, Subcommand};
use futures::{StreamExt, TryStreamExt};
use stagehand_bus::Bus;
use stagehand_catalogue::{Catalogue, CheckpointRecord, CheckpointState, checkpoint_dataset};
use stagehand_manifest::{BucketOptions, ManifestBuilder, ManifestStore, Spool};
use stagehand_mover::{ReadLimit, Tier};
use stagehand_policy::retention::{CommittedCheckpoint, Placement, RetentionDecision};
use stagehand_schemas::{Body, CheckpointCommitted, Event, EventId, FileRef, Location};

use crate::args::{EX_SOFTWARE, EX_UNAVAILABLE, EX_USAGE};
use crate::cli::Connection;
use crate::stage::{RequestOptions, Stage, WaitOutcome};
use stagehand_schemas::Retryable;

/// Exit code of a refused checkpoint.
pub const EXIT_REFUSED: i32 = 1;

/// Files hashed at once.
const HASH_AT_ONCE: usize = 4;

#[derive(Debug, Subcommand)]
pub enum CheckpointCommand {
    /// Announce a complete checkpoint: recognise its format, hash its files, publish
    /// `checkpoint.committed` (the same step again is the same fact).
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

/// The formats `commit` recognises.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Format {
    /// torch.distributed.checkpoint (also Lightning's sharded checkpoints).
    Dcp,
    Orbax,
    /// DeepSpeed; the tag `latest` names.
    DeepSpeed {
        tag: String,
    },
    /// NeMo 2 (`context/` and `weights/`).
    NeMo,
    /// A directory the writer says is finished (`--complete`).
    Plain,
}

impl Format {
    pub fn name(&self) -> &'static str {
        match self {
            Format::Dcp => "torch.distributed.checkpoint",
            Format::Orbax => "orbax",
            Format::DeepSpeed { .. } => "deepspeed",
            Format::NeMo => "nemo",
            Format::Plain => "directory",
        }
    }
}

/// A checkpoint found complete: its format and the directory to commit (for DeepSpeed given
/// its save directory, the tag directory).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recognised {
    pub format: Format,
    pub dir: PathBuf,
}

/// The names directly in `dir`.
fn names(dir: &Path) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for entry in
        std::fs::read_dir(dir).map_err(|e| format!("cannot read {}: {e}", dir.display()))?
    {
        let entry = entry.map_err(|e| format!("cannot read {}: {e}", dir.display()))?;
        out.push(entry.file_name().to_string_lossy().into_owned());
    }
    out.sort();
    Ok(out)
}

const ORBAX_TMP: &str = ".orbax-checkpoint-tmp";
const NEMO_UNFINISHED: &str = "-unfinished";

fn is_deepspeed_file(name: &str) -> bool {
    (name.starts_with("mp_rank_") && name.ends_with("_model_states.pt"))
        || name.ends_with("_optim_states.pt")
}

/// Recognises the checkpoint at `dir` (an existing directory, canonical) or says why it is
/// not complete. `complete`: the writer vouches for a directory of no recognised format.
pub fn recognise(dir: &Path, complete: bool) -> Result<Recognised, String> {
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let shown = dir.display();
    // NeMo's marker sits beside the checkpoint while it is written, whatever the format inside.
    if name.ends_with(NEMO_UNFINISHED) {
        return Err(format!(
            "{shown} is NeMo's \"-unfinished\" marker, not a checkpoint"
        ));
    }
    let marker = dir.with_file_name(format!("{name}{NEMO_UNFINISHED}"));
    if std::fs::symlink_metadata(&marker).is_ok() {
        return Err(format!(
            "NeMo: the marker {} exists: the save has not finished",
            marker.display()
        ));
    }
    if name.contains(ORBAX_TMP) {
        return Err(format!(
            "Orbax: {shown} still has its temporary name ({ORBAX_TMP}): Orbax renames it when the \
             save is committed"
        ));
    }
    let entries = names(dir)?;
    let has = |n: &str| entries.iter().any(|e| e == n);

    // DeepSpeed: the save directory, whose `latest` names the tag directory.
    if has("latest") && dir.join("latest").is_file() {
        let tag = std::fs::read_to_string(dir.join("latest"))
            .map_err(|e| format!("DeepSpeed: cannot read {shown}/latest: {e}"))?
            .trim()
            .to_owned();
        if tag.is_empty() || tag.contains('/') || tag == "." || tag == ".." {
            return Err(format!(
                "DeepSpeed: {shown}/latest holds {tag:?}, not a tag directory name"
            ));
        }
        let tag_dir = dir.join(&tag);
        if !tag_dir.is_dir() {
            return Err(format!(
                "DeepSpeed: {shown}/latest names tag {tag:?}, but {} is missing",
                tag_dir.display()
            ));
        }
        return Ok(Recognised {
            format: Format::DeepSpeed { tag },
            dir: tag_dir,
        });
    }
    // DeepSpeed: a tag directory, complete once its save directory's `latest` names it.
    if entries.iter().any(|e| is_deepspeed_file(e)) {
        let latest = dir.with_file_name("latest");
        return match std::fs::read_to_string(&latest) {
            Ok(tag) if tag.trim() == name => Ok(Recognised {
                format: Format::DeepSpeed { tag: name },
                dir: dir.to_owned(),
            }),
            Ok(tag) => Err(format!(
                "DeepSpeed: {} names tag {:?}, not {name:?}: commit the save directory to commit \
                 the tag it names",
                latest.display(),
                tag.trim()
            )),
            Err(_) => Err(format!(
                "DeepSpeed: {} is missing (DeepSpeed writes it after the tag's files): the save \
                 has not finished",
                latest.display()
            )),
        };
    }
    // Orbax: the committed directory and its marker; no item under a temporary name.
    let orbax_items = entries.iter().any(|e| {
        let item = dir.join(e);
        item.is_dir() && (item.join("_METADATA").is_file() || item.join("manifest.ocdbt").is_file())
    });
    if let Some(tmp) = entries.iter().find(|e| e.contains(ORBAX_TMP)) {
        return Err(format!(
            "Orbax: {shown}/{tmp} still has its temporary name ({ORBAX_TMP}): the save has not \
             finished"
        ));
    }
    if has("commit_success.txt") || has("_CHECKPOINT_METADATA") {
        return Ok(Recognised {
            format: Format::Orbax,
            dir: dir.to_owned(),
        });
    }
    if orbax_items {
        return Err(format!(
            "Orbax: {shown} has no commit marker (commit_success.txt or _CHECKPOINT_METADATA): \
             the save has not finished"
        ));
    }
    // torch.distributed.checkpoint: `.metadata` is written last.
    if has(".metadata") {
        return Ok(Recognised {
            format: Format::Dcp,
            dir: dir.to_owned(),
        });
    }
    if has(".metadata.tmp") || entries.iter().any(|e| e.ends_with(".distcp")) {
        return Err(format!(
            "torch.distributed.checkpoint: {shown} has no .metadata (written last, renamed from \
             .metadata.tmp): the save has not finished"
        ));
    }
    // NeMo 2: context/ and weights/, and no marker (checked above).
    if dir.join("context").is_dir() && dir.join("weights").is_dir() {
        return Ok(Recognised {
            format: Format::NeMo,
            dir: dir.to_owned(),
        });
    }
    if entries.is_empty() {
        return Err(format!("{shown} is empty"));
    }
    if complete {
        return Ok(Recognised {
            format: Format::Plain,
            dir: dir.to_owned(),
        });
    }
    Err(format!(
        "{shown} is in no checkpoint format recognised here (torch.distributed.checkpoint \
         .metadata, Orbax commit marker, DeepSpeed latest, NeMo context/ and weights/); if its \
         writer has finished it, commit it with --complete"
    ))
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
        })
    }
}

fn default_policies() -> PathBuf {
    stagehand_policy::stagehand_home().join("policies")
}

fn check_project(project: &str) -> Result<(), CheckpointError> {
    if !stagehand_schemas::subject::is_subject_token(project) {
        return Err(usage(format!(
            "project {project:?} must be 1-64 characters of [a-z0-9_-]"
        )));
    }
    Ok(())
}

fn check_run(run: &str) -> Result<(), CheckpointError> {
    crate::ingest::check_name("run", run).map_err(|e| usage(e.to_string()))?;
    // The run's checkpoints are versions of the dataset `ckpt-<run>`, which must be a name too.
    crate::args::dataset("run", &checkpoint_dataset(run)).map_err(|_| {
        usage(format!(
            "run {run:?} is too long: its checkpoints' dataset {:?} must be at most 128 characters",
            checkpoint_dataset(run)
        ))
    })
}

/// A checkpoint recognised and hashed, ready to announce.
#[derive(Debug, Clone)]
pub struct Prepared {
    pub format: Format,
    /// The checkpoint's folder on its tier.
    pub location: Location,
    /// Every file, measured, in path order.
    pub files: Vec<FileRef>,
    pub total_bytes: u64,
}

/// Recognises and hashes the checkpoint (no NATS needed): bad arguments are
/// [`CheckpointError::Usage`], an incomplete checkpoint or an unreadable file
/// [`CheckpointError::Refused`].
pub async fn prepare(opts: &CommitOptions) -> Result<Prepared, CheckpointError> {
    let policies = stagehand_policy::Policies::load_dir(&opts.policies)
        .map_err(|e| usage(format!("policies {}: {e}", opts.policies.display())))?;
    let tier_policy = policies.tier(&opts.tier).ok_or_else(|| {
        usage(format!(
            "tier {:?} is not declared in {}",
            opts.tier,
            opts.policies.display()
        ))
    })?;
    let Tier::Posix(tier) = tier_policy
        .open()
        .map_err(|e| usage(format!("tier {:?}: {e}", opts.tier)))?
    else {
        return Err(usage(format!(
            "tier {:?} is not a posix tier; checkpoints are committed where the run wrote them",
            opts.tier
        )));
    };
    let root = tier
        .root()
        .canonicalize()
        .map_err(|e| usage(format!("tier {:?} root: {e}", opts.tier)))?;
    let given = opts
        .path
        .canonicalize()
        .map_err(|e| usage(format!("{}: {e}", opts.path.display())))?;
    if !given.is_dir() {
        return Err(usage(format!(
            "{} is not a directory: a checkpoint is committed as its directory",
            opts.path.display()
        )));
    }
    let recognised = recognise(&given, opts.complete).map_err(refused)?;
    let prefix = prefix_in(&root, &recognised.dir, &opts.project).map_err(|e| {
        usage(format!(
            "{e} (tier {:?} has its root at {})",
            opts.tier,
            root.display()
        ))
    })?;

    let dir = recognised.dir.clone();
    let listed = tokio::task::spawn_blocking(move || crate::ingest::walk::list(&dir))
        .await
        .map_err(|e| CheckpointError::Other(e.into()))?
        .map_err(|e| refused(format!("{e:#}")))?;
    let tier = Tier::Posix(tier);
    let files: Vec<FileRef> = futures::stream::iter(listed)
        .map(|f| {
            let (tier, rel) = (&tier, format!("{prefix}/{}", f.path));
            async move {
                let digest = tier
                    .hash_file_bounded(&rel, ReadLimit::declared(f.size, None))
                    .await
                    .map_err(|e| refused(format!("{}: {e}", f.path)))?;
                Ok::<_, CheckpointError>(FileRef::new(f.path, digest.size, digest.sha256))
            }
        })
        .buffered(HASH_AT_ONCE)
        .try_collect()
        .await?;
    let total_bytes = files.iter().map(|f| f.size).sum();
    Ok(Prepared {
        format: recognised.format,
        location: Location {
            tier: opts.tier.clone(),
            prefix,
        },
        files,
        total_bytes,
    })
}

/// The prefix of `dir` beneath the tier `root`, which must start with the project's folder.
fn prefix_in(root: &Path, dir: &Path, project: &str) -> Result<String, String> {
    let rel = dir
        .strip_prefix(root)
        .map_err(|_| format!("{} is not beneath the tier's root", dir.display()))?;
    let parts: Vec<&str> = rel
        .components()
        .map(|c| match c {
            Component::Normal(p) => p.to_str().ok_or(()),
            _ => Err(()),
        })
        .collect::<Result<_, _>>()
        .map_err(|_| {
            format!(
                "{} is not a UTF-8 path beneath the tier's root",
                dir.display()
            )
        })?;
    if parts.len() < 2 || parts[0] != project {
        return Err(format!(
            "{} is not inside project {project:?}'s folder <root>/{project}/ on the tier",
            dir.display()
        ));
    }
    let prefix = parts.join("/");
    stagehand_schemas::check_relative_path(&prefix).map_err(|e| format!("{prefix}: {e}"))?;
    Ok(prefix)
}

/// What `commit` published.
#[derive(Debug, Clone)]
pub struct Committed {
    pub event: Event,
    pub format: Format,
    pub files: usize,
    pub total_bytes: u64,
    /// The manifest's digest when it went by reference.
    pub manifest_digest: Option<String>,
    /// The step was committed before (the same fact id): nothing new was stored.
    pub duplicate: bool,
}

/// The `checkpoint.committed` fact of a prepared checkpoint, its manifest inline or by
/// reference to the project's upload bucket (put there first).
pub async fn publish(
    bus: &Bus,
    opts: &CommitOptions,
    prepared: Prepared,
) -> Result<Committed, CheckpointError> {
    let spool = Spool::default();
    let entries = prepared.files.clone();
    let manifest = tokio::task::spawn_blocking(move || {
        let mut builder = ManifestBuilder::new(&spool);
        for f in &entries {
            builder.push(f)?;
        }
        builder.finish()
    })
    .await
    .map_err(|e| CheckpointError::Other(e.into()))?
    .map_err(|e| refused(e.to_string()))?;
    let (files, reference) = match manifest
        .inline_entries()
        .map_err(|e| CheckpointError::Other(e.into()))?
    {
        Some(files) => (files, None),
        None => {
            let options = BucketOptions {
                replicas: bus.replicas(),
            };
            let store = ManifestStore::uploads(bus.jetstream(), &opts.project, options)
                .await
                .map_err(|e| unavailable_or_other(e.is_retryable(), e.into()))?;
            let reference = store
                .put(&manifest)
                .await
                .map_err(|e| unavailable_or_other(e.is_retryable(), e.into()))?;
            (Vec::new(), Some(reference))
        }
    };
    let manifest_digest = reference.as_ref().map(|r| r.digest.clone());
    let event = Event::request(
        EventId::for_checkpoint(&opts.project, &opts.run, opts.step),
        opts.project.as_str(),
        Body::CheckpointCommitted(CheckpointCommitted {
            run: opts.run.clone(),
            step: opts.step,
            location: prepared.location,
            files,
            manifest: reference,
            total_bytes: prepared.total_bytes,
            tags: opts.tags.clone(),
        }),
    );
    let ack = bus
        .publish(&event)
        .await
        .map_err(|e| unavailable_or_other(e.is_retryable(), e.into()))?;
    if ack.duplicate {
        same_as_earlier(bus, &ack, &event).await?;
    }
    Ok(Committed {
        event,
        format: prepared.format,
        files: prepared.files.len(),
        total_bytes: prepared.total_bytes,
        manifest_digest,
        duplicate: ack.duplicate,
    })
}

/// A commit the duplicate window dropped must be the commit stored first: a step saved again
/// with other files (a run restarted from an earlier checkpoint) or other tags would otherwise
/// vanish without a word. The stored fact is the one at the sequence the duplicate's ack
/// names, which the bus has proven to be this step's commit (`stagehand_bus::dedup`); it is
/// read as the last commit on the project's subject (a direct get by subject: all a project's
/// training-job user may read). When it cannot be read the commit stands as a duplicate.
async fn same_as_earlier(
    bus: &Bus,
    ack: &stagehand_bus::PublishAck,
    event: &Event,
) -> Result<(), CheckpointError> {
    let subject = stagehand_schemas::subject::subject_for(&event.body, &event.project);
    let stored = async {
        let message = bus
            .stored_message(ack, &subject)
            .await
            .ok_or_else(|| anyhow::anyhow!("the stored commit could not be read"))?;
        anyhow::Ok(stagehand_schemas::wire::decode(&message.payload)?)
    };
    let earlier = match stored.await {
        Ok(earlier) => earlier,
        Err(e) => {
            tracing::debug!(error = %e, "the earlier commit could not be read to compare");
            return Ok(());
        }
    };
    if earlier.id != event.id {
        return Ok(());
    }
    let (Body::CheckpointCommitted(first), Body::CheckpointCommitted(now)) =
        (&earlier.body, &event.body)
    else {
        return Ok(());
    };
    if first == now {
        return Ok(());
    }
    let what = if first.location != now.location {
        format!("at {}:{}", first.location.tier, first.location.prefix)
    } else if first.tags != now.tags {
        format!("with tags [{}]", first.tags.join(", "))
    } else {
        format!("with other files ({} bytes)", first.total_bytes)
    };
    Err(refused(format!(
        "step {} of run {} was committed before {what}; that commit stands (one fact per \
         project, run and step): commit this save under another step or run",
        now.step, now.run
    )))
}

fn unavailable_or_other(retryable: bool, e: anyhow::Error) -> CheckpointError {
    if retryable {
        CheckpointError::Unavailable(e)
    } else {
        CheckpointError::Other(e)
    }
}

/// Recognises, hashes and publishes: `stagehand checkpoint commit`.
pub async fn commit(
    connection: &Connection,
    opts: &CommitOptions,
) -> Result<Committed, CheckpointError> {
    let prepared = prepare(opts).await?;
    let bus = crate::cli::connect(connection)
        .await
        .map_err(CheckpointError::Unavailable)?;
    publish(&bus, opts, prepared).await
}

/// One line of `checkpoint list`: the catalogue's record and what retention decides now.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ListedCheckpoint {
    pub step: u64,
    pub tags: Vec<String>,
    pub state: CheckpointState,
    pub tiers: Vec<String>,
    /// The rule of the latest demotion or expiry carried out.
    pub rule: Option<String>,
    /// What retention decides for it now (`None` without `retention.toml`, or once expired).
    pub retention: Option<Decision>,
    pub total_bytes: u64,
}

/// Retention's decision, as listed.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Decision {
    /// `hot`, `demote`, `expire`.
    pub placement: &'static str,
    /// The tier a demotion goes to.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tier: Option<String>,
    pub rule: String,
    /// Every keep rule that holds.
    pub kept_by: Vec<String>,
}

impl From<&RetentionDecision> for Decision {
    fn from(d: &RetentionDecision) -> Self {
        let (placement, tier) = match &d.placement {
            Placement::Hot => ("hot", None),
            Placement::Demote { tier } => ("demote", Some(tier.clone())),
            Placement::Expire => ("expire", None),
        };
        Decision {
            placement,
            tier,
            rule: d.rule.to_string(),
            kept_by: d.kept_by.iter().map(ToString::to_string).collect(),
        }
    }
}

/// Joins the catalogue's records of a run with retention's decisions over its live ones.
pub fn listing(
    records: &[CheckpointRecord],
    retention: Option<&stagehand_policy::CheckpointRetention>,
) -> Vec<ListedCheckpoint> {
    let live: Vec<CommittedCheckpoint> = records
        .iter()
        .filter(|r| r.state != CheckpointState::Expired)
        .map(|r| CommittedCheckpoint {
            step: r.step,
            tags: r.tags.clone(),
            committed_at: r.committed.as_ref().map(|s| s.at),
        })
        .collect();
    let decisions = retention.map(|p| p.decide(&live)).unwrap_or_default();
    records
        .iter()
        .map(|r| ListedCheckpoint {
            step: r.step,
            tags: r.tags.clone(),
            state: r.state,
            tiers: r.tiers().into_iter().map(str::to_owned).collect(),
            rule: r.rule.clone(),
            retention: decisions
                .iter()
                .find(|d| d.step == r.step)
                .map(Decision::from),
            total_bytes: r.total_bytes,
        })
        .collect()
}

fn state_name(state: CheckpointState) -> &'static str {
    match state {
        CheckpointState::Committed => "committed",
        CheckpointState::Demoted => "demoted",
        CheckpointState::Expired => "expired",
    }
}

/// The text of `checkpoint list`.
pub fn list_text(
    run: &str,
    items: &[ListedCheckpoint],
    out: &mut dyn Write,
) -> std::io::Result<()> {
    if items.is_empty() {
        return writeln!(out, "no checkpoints of run {run} in the catalogue");
    }
    writeln!(
        out,
        "{:>10}  {:<16} {:<10} {:<12} {:<16} RETENTION NOW",
        "STEP", "TAGS", "STATE", "TIERS", "RULE"
    )?;
    for c in items {
        let tags = if c.tags.is_empty() {
            "-".to_owned()
        } else {
            c.tags.join(",")
        };
        let tiers = if c.tiers.is_empty() {
            "-".to_owned()
        } else {
            c.tiers.join(",")
        };
        let now = match &c.retention {
            None => "-".to_owned(),
            Some(d) => {
                let place = match &d.tier {
                    Some(tier) => format!("{} to {tier}", d.placement),
                    None => d.placement.to_owned(),
                };
                let also: Vec<&String> = d.kept_by.iter().filter(|r| **r != d.rule).collect();
                if also.is_empty() {
                    format!("{place} ({})", d.rule)
                } else {
                    let also: Vec<&str> = also.iter().map(|s| s.as_str()).collect();
                    format!("{place} ({}; also {})", d.rule, also.join(", "))
                }
            }
        };
        writeln!(
            out,
            "{:>10}  {:<16} {:<10} {:<12} {:<16} {now}",
            c.step,
            tags,
            state_name(c.state),
            tiers,
            c.rule.as_deref().unwrap_or("-"),
        )?;
    }
    Ok(())
}

/// How long `list` waits for the catalogue's answer to each page.
const LIST_TIMEOUT: Duration = Duration::from_secs(10);

/// `stagehand checkpoint list`: the run's checkpoints from the catalogue.
pub async fn list(
    connection: &Connection,
    args: &ListArgs,
) -> Result<Vec<ListedCheckpoint>, CheckpointError> {
    let project = args
        .project
        .clone()
        .ok_or_else(|| usage("--project (or STAGEHAND_PROJECT) is required"))?;
    check_project(&project)?;
    check_run(&args.run)?;
    let dir = args.policies.clone().unwrap_or_else(default_policies);
    let policies = match (&args.policies, dir.join("tiers.toml").exists()) {
        (None, false) => None,
        _ => Some(
            stagehand_policy::Policies::load_dir(&dir)
                .map_err(|e| usage(format!("policies {}: {e}", dir.display())))?,
        ),
    };
    let bus = crate::cli::connect(connection)
        .await
        .map_err(CheckpointError::Unavailable)?;
    let catalogue = Catalogue::new(bus.client().clone()).with_timeout(LIST_TIMEOUT);
    let records = catalogue
        .all_checkpoints(&project, &args.run)
        .await
        .map_err(|e| unavailable_or_other(e.is_retryable(), e.into()))?;
    let retention = policies
        .as_ref()
        .and_then(|p| p.retention())
        .map(|r| &r.checkpoints);
    Ok(listing(&records, retention))
}

/// The checkpoint `restore` stages: step `step` of the run, or the newest not expired; one
/// that expired, or whose commit the catalogue has not folded (no digest), is refused.
pub fn restorable<'a>(
    run: &str,
    records: &'a [CheckpointRecord],
    step: Option<u64>,
) -> Result<(&'a CheckpointRecord, String), CheckpointError> {
    let live = |r: &&CheckpointRecord| r.state != CheckpointState::Expired;
    let record = match step {
        Some(step) => records.iter().find(|r| r.step == step).ok_or_else(|| {
            refused(format!(
                "run {run} has no checkpoint of step {step} in the catalogue"
            ))
        })?,
        None => records
            .iter()
            .filter(live)
            .max_by_key(|r| r.step)
            .ok_or_else(|| refused(format!("run {run} has no checkpoint that is not expired")))?,
    };
    if record.state == CheckpointState::Expired {
        return Err(refused(format!(
            "step {} of run {run} expired ({}); nothing is left to restore",
            record.step,
            record.rule.as_deref().unwrap_or("retention")
        )));
    }
    let digest = record.digest.clone().ok_or_else(|| {
        refused(format!(
            "step {} of run {run}: the catalogue has not recorded its commit yet; try again",
            record.step
        ))
    })?;
    Ok((record, digest))
}

/// How `restore` brought a checkpoint back.
#[derive(Debug)]
pub enum Restored {
    /// Staged onto the tier: the stage and how its wait ended.
    Staged(Box<(Stage, WaitOutcome)>),
    /// Still where the run committed it, on the tier asked for: its folder there.
    InPlace(PathBuf),
}

/// The folder of a checkpoint still where its run committed it, on the shared tier `tier`.
fn in_place(
    record: &CheckpointRecord,
    place: &crate::cli::StagePlaceArgs,
) -> Result<Option<PathBuf>, CheckpointError> {
    let on_tier = record.state == CheckpointState::Committed
        && record.location.tier == place.tier
        && place.node.is_none();
    if !on_tier {
        return Ok(None);
    }
    let dir = place.policies.clone().unwrap_or_else(default_policies);
    let policies = stagehand_policy::Policies::load_dir(&dir)
        .map_err(|e| usage(format!("policies {}: {e}", dir.display())))?;
    let tier = policies
        .tier(&place.tier)
        .and_then(|t| t.open().ok())
        .ok_or_else(|| {
            usage(format!(
                "tier {:?} cannot be opened from {}",
                place.tier,
                dir.display()
            ))
        })?;
    let Tier::Posix(tier) = tier else {
        return Err(usage(format!("tier {:?} is not a posix tier", place.tier)));
    };
    Ok(Some(tier.root().join(&record.location.prefix)))
}

/// `stagehand checkpoint restore`: finds the step's version, then (unless it is still on the
/// tier where the run committed it) requests and waits for its stage with `stagehand stage`'s
/// own calls.
pub async fn restore(
    connection: &Connection,
    args: &RestoreArgs,
) -> Result<Restored, CheckpointError> {
    check_run(&args.run)?;
    let step = args
        .step
        .as_deref()
        .map(|s| {
            s.parse::<u64>()
                .map_err(|_| usage(format!("--step {s:?}: expected a whole number")))
        })
        .transpose()?;
    let timeout = crate::args::duration("--timeout", &args.timeout).map_err(|e| usage(e.0))?;
    // The version is found in the catalogue; everything else is checked before connecting.
    let mut stage = crate::cli::stage_at(checkpoint_dataset(&args.run), String::new(), &args.place)
        .map_err(|e| usage(e.0))?;
    let bus = crate::cli::connect(connection)
        .await
        .map_err(CheckpointError::Unavailable)?;
    let catalogue = Catalogue::new(bus.client().clone()).with_timeout(LIST_TIMEOUT);
    let records = catalogue
        .all_checkpoints(&stage.project, &args.run)
        .await
        .map_err(|e| unavailable_or_other(e.is_retryable(), e.into()))?;
    let (record, digest) = restorable(&args.run, &records, step)?;
    // Not demoted yet: it is where the run wrote it, which is the tier asked for.
    if let Some(path) = in_place(record, &args.place)? {
        return Ok(Restored::InPlace(path));
    }
    stage.version = digest;
    let opts = RequestOptions {
        requested_by: crate::cli::who(None),
        deadline: None,
        hold_until: None,
        form: None,
    };
    crate::stage::request(&bus, &stage, &opts)
        .await
        .map_err(CheckpointError::Unavailable)?;
    let outcome = crate::stage::wait(&bus, &stage, timeout)
        .await
        .map_err(CheckpointError::Unavailable)?;
    Ok(Restored::Staged(Box::new((stage, outcome))))
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

#[cfg(test)]
mod tests {
    use super::*;

    fn dir_with(files: &[&str]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for f in files {
            let path = dir.path().join(f);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, f.as_bytes()).unwrap();
        }
        dir
    }

    fn format_of(dir: &Path, complete: bool) -> Result<Format, String> {
        recognise(&dir.canonicalize().unwrap(), complete).map(|r| r.format)
    }

    #[test]
    fn dcp_is_complete_with_metadata_only() {
        let done = dir_with(&["__0_0.distcp", "__1_0.distcp", ".metadata"]);
        assert_eq!(format_of(done.path(), false), Ok(Format::Dcp));
        let half = dir_with(&["__0_0.distcp", ".metadata.tmp"]);
        let err = format_of(half.path(), true).unwrap_err();
        assert!(
            err.contains("torch.distributed.checkpoint") && err.contains("no .metadata"),
            "{err}"
        );
    }

    #[test]
    fn nemo_marker_refuses_whatever_is_inside() {
        let parent = tempfile::tempdir().unwrap();
        let ckpt = parent.path().join("step=100");
        std::fs::create_dir_all(ckpt.join("context")).unwrap();
        std::fs::create_dir_all(ckpt.join("weights")).unwrap();
        std::fs::write(ckpt.join("weights/.metadata"), b"m").unwrap();
        std::fs::write(parent.path().join("step=100-unfinished"), b"").unwrap();
        let err = format_of(&ckpt, true).unwrap_err();
        assert!(
            err.contains("NeMo") && err.contains("step=100-unfinished"),
            "{err}"
        );
        std::fs::remove_file(parent.path().join("step=100-unfinished")).unwrap();
        assert_eq!(format_of(&ckpt, false), Ok(Format::NeMo));
        let marker = parent.path().join("x-unfinished");
        std::fs::create_dir(&marker).unwrap();
        assert!(format_of(&marker, true).unwrap_err().contains("marker"));
    }

    #[test]
    fn orbax_needs_its_final_name_and_a_marker() {
        let parent = tempfile::tempdir().unwrap();
        let tmp = parent.path().join("100.orbax-checkpoint-tmp-1733");
        std::fs::create_dir_all(tmp.join("state")).unwrap();
        std::fs::write(tmp.join("state/_METADATA"), b"{}").unwrap();
        assert!(
            format_of(&tmp, true)
                .unwrap_err()
                .contains("temporary name")
        );
        let done = parent.path().join("100");
        std::fs::rename(&tmp, &done).unwrap();
        let err = format_of(&done, true).unwrap_err();
        assert!(err.contains("no commit marker"), "{err}");
        std::fs::write(done.join("_CHECKPOINT_METADATA"), b"{}").unwrap();
        assert_eq!(format_of(&done, false), Ok(Format::Orbax));
        std::fs::create_dir(done.join("extra.orbax-checkpoint-tmp-9")).unwrap();
        assert!(
            format_of(&done, false)
                .unwrap_err()
                .contains("extra.orbax-checkpoint-tmp-9")
        );
    }

    #[test]
    fn deepspeed_commits_the_tag_latest_names() {
        let save = dir_with(&[
            "global_step100/mp_rank_00_model_states.pt",
            "global_step200/mp_rank_00_model_states.pt",
        ]);
        let tag_dir = save.path().join("global_step200");
        let err = format_of(&tag_dir, true).unwrap_err();
        assert!(err.contains("latest") && err.contains("missing"), "{err}");
        std::fs::write(save.path().join("latest"), "global_step200\n").unwrap();
        let r = recognise(&save.path().canonicalize().unwrap(), false).unwrap();
        assert_eq!(
            r.format,
            Format::DeepSpeed {
                tag: "global_step200".into()
            }
        );
        assert_eq!(r.dir, tag_dir.canonicalize().unwrap());
        assert!(matches!(
            format_of(&tag_dir, false),
            Ok(Format::DeepSpeed { .. })
        ));
        let err = format_of(&save.path().join("global_step100"), false).unwrap_err();
        assert!(err.contains("names tag \"global_step200\""), "{err}");
        std::fs::write(save.path().join("latest"), "global_step300").unwrap();
        let err = format_of(save.path(), false).unwrap_err();
        assert!(
            err.contains("global_step300") && err.contains("missing"),
            "{err}"
        );
    }

    #[test]
    fn a_plain_directory_needs_complete() {
        let plain = dir_with(&["model.safetensors", "config.json"]);
        assert!(
            format_of(plain.path(), false)
                .unwrap_err()
                .contains("--complete")
        );
        assert_eq!(format_of(plain.path(), true), Ok(Format::Plain));
        let empty = tempfile::tempdir().unwrap();
        assert!(format_of(empty.path(), true).unwrap_err().contains("empty"));
    }

    #[test]
    fn prefixes_stay_in_the_project_folder() {
        let root = Path::new("/t/hot");
        assert_eq!(
            prefix_in(root, Path::new("/t/hot/lab-a/runs/r1/step-5"), "lab-a"),
            Ok("lab-a/runs/r1/step-5".to_owned())
        );
        assert!(prefix_in(root, Path::new("/t/hot/lab-b/r1"), "lab-a").is_err());
        assert!(prefix_in(root, Path::new("/t/hot/lab-a"), "lab-a").is_err());
        assert!(prefix_in(root, Path::new("/t/other/lab-a/x"), "lab-a").is_err());
    }
}
