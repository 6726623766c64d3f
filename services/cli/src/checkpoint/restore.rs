//! `restore`: a checkpoint brought back onto a hot (or node-local) tier as a stage request of
//! its version, its folder printed only when every committed file is there.

use std::path::{Path, PathBuf};

use futures::TryStreamExt;
use stagehand_catalogue::{Catalogue, CheckpointRecord, CheckpointState, checkpoint_dataset};
use stagehand_mover::Tier;
use stagehand_schemas::FileRef;
use stagehand_schemas::Retryable;

use crate::cli::Connection;
use crate::stage::{RequestOptions, Stage, WaitOutcome};

use super::args::{RestoreArgs, check_run, default_policies};
use super::commit::unavailable_or_other;
use super::list::LIST_TIMEOUT;
use super::{CheckpointError, refused, usage};

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

/// Refuses a step committed in parts that is not committed whole yet, naming what is still on
/// node NVMe only: it is never half-restored.
async fn incomplete(
    catalogue: &Catalogue,
    project: &str,
    run: &str,
    step: u64,
) -> Result<(), CheckpointError> {
    let parts = catalogue
        .checkpoint_parts(project, run, Some(step))
        .await
        .unwrap_or_default();
    let Some(found) = stagehand_catalogue::StepParts::of(&parts)
        .into_iter()
        .next()
    else {
        return Ok(());
    };
    let on_node: Vec<String> = found
        .on_node
        .iter()
        .map(|(part, node)| format!("part {part} on {node}"))
        .collect();
    Err(refused(format!(
        "step {step} of run {run} is incomplete: {} of {} parts offloaded{}; it is not restored \
         (without --step the latest complete step is)",
        found.offloaded,
        found.parts,
        if on_node.is_empty() {
            String::new()
        } else {
            format!(", on node NVMe only: {}", on_node.join(", "))
        }
    )))
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

/// Whether the folder `dir` holds every file of `files` with its size (what `restore` checks
/// before it prints a folder: never a path that is not there, or a folder a file is missing
/// from or cut short in). Sizes, not hashes: the copy was verified when it was made, and a
/// restore must not read a checkpoint of hundreds of GiB to print its path.
pub fn whole_at(dir: &Path, files: &[FileRef]) -> Result<(), String> {
    if !dir.is_dir() {
        return Err(format!("{} is not there", dir.display()));
    }
    for f in files {
        let path = dir.join(&f.path);
        match std::fs::symlink_metadata(&path) {
            Ok(m) if m.is_file() && m.len() == f.size => {}
            Ok(m) if m.is_file() => {
                return Err(format!(
                    "{} holds {} bytes, committed with {}",
                    path.display(),
                    m.len(),
                    f.size
                ));
            }
            Ok(_) => return Err(format!("{} is not a regular file", path.display())),
            Err(e) => return Err(format!("{}: {e}", path.display())),
        }
    }
    Ok(())
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
    if let Some(step) = step
        && !records.iter().any(|r| r.step == step)
    {
        incomplete(&catalogue, &stage.project, &args.run, step).await?;
    }
    let (record, digest) = restorable(&args.run, &records, step)?;
    // Not demoted yet: it is where the run wrote it, which is the tier asked for.
    let files = || async {
        catalogue
            .all_files(
                Some(stage.project.clone()),
                checkpoint_dataset(&args.run),
                digest.clone(),
                stagehand_catalogue::MAX_PAGE,
                None,
            )
            .try_collect::<Vec<FileRef>>()
            .await
            .map_err(|e| unavailable_or_other(e.is_retryable(), e.into()))
    };
    if let Some(path) = in_place(record, &args.place)? {
        whole_at(&path, &files().await?).map_err(|why| {
            refused(format!(
                "step {} of run {} was committed at {}:{}, but {why}: not restored",
                record.step, args.run, record.location.tier, record.location.prefix
            ))
        })?;
        return Ok(Restored::InPlace(path));
    }
    stage.version = digest.clone();
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
    // A shared tier's folder is where this command runs too: it must be whole to be printed.
    if let (WaitOutcome::Ready(status), None) = (&outcome, &args.place.node)
        && let Some(path) = &status.path
    {
        whole_at(Path::new(path), &files().await?).map_err(|why| {
            refused(format!(
                "step {} of run {} was staged, but {why}: not restored",
                record.step, args.run
            ))
        })?;
    }
    Ok(Restored::Staged(Box::new((stage, outcome))))
}
