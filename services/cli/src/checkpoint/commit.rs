//! `commit`: a complete checkpoint hashed and announced as `checkpoint.committed`, refused
//! when it is not its own folder or differs from the commit stored first. A part on a
//! node-local tier is not hashed: its files are stamped (size, mtime, ctime, inode, no byte
//! read) and announced as `checkpoint.part.committed`; the node's agent hashes each file once,
//! as it copies it off the node, and refuses a file whose stamp moved.

use std::path::{Component, Path};
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use stagehand_bus::Bus;
use stagehand_catalogue::Catalogue;
use stagehand_manifest::{BucketOptions, ManifestBuilder, ManifestStore, Spool};
use stagehand_mover::{ReadLimit, Tier};
use stagehand_schemas::Retryable;
use stagehand_schemas::{
    Body, CheckpointCommitted, CheckpointPartCommitted, Event, EventId, FileRef, FileStamp,
    Location, layout,
};

use crate::cli::Connection;

use super::args::{CommitOptions, PartOf};
use super::format::{Format, recognise};
use super::{CheckpointError, refused, usage};

/// Files hashed at once.
const HASH_AT_ONCE: usize = 4;

/// A checkpoint recognised and measured, ready to announce.
#[derive(Debug, Clone)]
pub struct Prepared {
    pub format: Format,
    /// The checkpoint's folder on its tier.
    pub location: Location,
    /// Every file, hashed, in path order (a whole checkpoint; empty for a part).
    pub files: Vec<FileRef>,
    /// Every file, stamped, in path order (a part on a node-local tier; empty otherwise).
    pub stamps: Vec<FileStamp>,
    pub total_bytes: u64,
}

impl Prepared {
    /// Files listed, hashed or stamped.
    pub fn count(&self) -> usize {
        self.files.len() + self.stamps.len()
    }
}

/// Recognises and measures the checkpoint (no NATS needed): a whole checkpoint's files hashed,
/// a part's stamped. Bad arguments are [`CheckpointError::Usage`], an incomplete checkpoint or
/// an unreadable file [`CheckpointError::Refused`].
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
    let local = tier_policy.role == stagehand_policy::TierRole::Local;
    check_part_folder(opts, local, &prefix)?;

    let dir = recognised.dir.clone();
    let listed = tokio::task::spawn_blocking(move || crate::ingest::walk::list(&dir))
        .await
        .map_err(|e| CheckpointError::Other(e.into()))?
        .map_err(|e| refused(format!("{e:#}")))?;
    let tier = Tier::Posix(tier);
    let (files, stamps) = match opts.part {
        Some(_) => (Vec::new(), stamp(&tier, &prefix, listed).await?),
        None => (hash(&tier, &prefix, listed).await?, Vec::new()),
    };
    let total_bytes = files
        .iter()
        .map(|f| f.size)
        .chain(stamps.iter().map(|f| f.size))
        .sum();
    Ok(Prepared {
        format: recognised.format,
        location: Location {
            tier: opts.tier.clone(),
            prefix,
        },
        files,
        stamps,
        total_bytes,
    })
}

/// Every listed file of the folder `prefix`, hashed.
async fn hash(
    tier: &Tier,
    prefix: &str,
    listed: Vec<FileRef>,
) -> Result<Vec<FileRef>, CheckpointError> {
    futures::stream::iter(listed)
        .map(|f| {
            let rel = format!("{prefix}/{}", f.path);
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
        .await
}

/// Every listed file of the folder `prefix`, stamped by one metadata walk (the mover's
/// fingerprint): no byte of data read, so a part's commit costs no more than its files'
/// `statx`, whatever their size. A listed file the walk finds no regular file at (replaced
/// between the listing and the walk) is refused.
async fn stamp(
    tier: &Tier,
    prefix: &str,
    listed: Vec<FileRef>,
) -> Result<Vec<FileStamp>, CheckpointError> {
    let walked = tier
        .fingerprint(prefix)
        .await
        .map_err(|e| refused(format!("{prefix}: {e}")))?;
    listed
        .into_iter()
        .map(|f| {
            walked.file_stamp(&f.path).ok_or_else(|| {
                refused(format!(
                    "{}: no longer a regular file of the part; nothing committed",
                    f.path
                ))
            })
        })
        .collect()
}

/// A commit on a node-local tier is a part of its step, in exactly the part's folder
/// (`layout::checkpoint_part_folder`): the node's agent offloads that folder and nothing
/// else. A part names a node-local tier.
fn check_part_folder(
    opts: &CommitOptions,
    local: bool,
    prefix: &str,
) -> Result<(), CheckpointError> {
    match (&opts.part, local) {
        (None, false) => Ok(()),
        (None, true) => Err(usage(format!(
            "tier {:?} is node-local: a checkpoint there is committed as a part of its step \
             (--node, --part, --parts), offloaded before it counts",
            opts.tier
        ))),
        (Some(_), false) => Err(usage(format!(
            "--node/--part/--parts commit a part on a node-local tier; tier {:?} is not one",
            opts.tier
        ))),
        (Some(part), true) => {
            let folder = layout::checkpoint_part_folder(
                &opts.project,
                &stagehand_catalogue::checkpoint_dataset(&opts.run),
                opts.step,
                part.part,
            );
            if prefix == folder {
                Ok(())
            } else {
                Err(usage(format!(
                    "part {} of step {} of run {} is committed from its folder <root>/{folder}, \
                     not <root>/{prefix}",
                    part.part, opts.step, opts.run
                )))
            }
        }
    }
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
    let prefix = parts.join("/");
    layout::check_prefix_in_project(project, &prefix).map_err(|why| {
        format!(
            "{} is not inside project {project:?}'s folder <root>/{project}/ on the tier: {why}",
            dir.display()
        )
    })?;
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
            let put = || store.put(&manifest);
            let reference = crate::args::through_election(
                bus.publish_timeout(),
                stagehand_manifest::ManifestError::is_retryable,
                put,
            )
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

pub(super) fn unavailable_or_other(retryable: bool, e: anyhow::Error) -> CheckpointError {
    if retryable {
        CheckpointError::Unavailable(e)
    } else {
        CheckpointError::Other(e)
    }
}

/// Recognises, measures and publishes: `stagehand checkpoint commit`.
pub async fn commit(
    connection: &Connection,
    opts: &CommitOptions,
) -> Result<Committed, CheckpointError> {
    let prepared = prepare(opts).await?;
    let bus = crate::cli::connect(connection)
        .await
        .map_err(CheckpointError::Unavailable)?;
    if let Some(part) = &opts.part {
        return publish_part(&bus, opts, part, prepared).await;
    }
    own_folder(&bus, opts, &prepared.location).await?;
    publish(&bus, opts, prepared).await
}

/// The `checkpoint.part.committed` fact of a prepared part, its files inline (a part's list
/// must fit: split the step into more parts otherwise). Returns once the fact is stored: the
/// commit the training job waits for; the node's agent offloads it afterwards.
pub async fn publish_part(
    bus: &Bus,
    opts: &CommitOptions,
    part: &PartOf,
    prepared: Prepared,
) -> Result<Committed, CheckpointError> {
    // The agent's offload lists the same files with their SHA-256: the part must fit that.
    let listed: usize = prepared
        .stamps
        .iter()
        .map(|f| f.path.len() + 64 + 24)
        .chain(
            prepared
                .files
                .iter()
                .map(|f| f.path.len() + f.sha256.len() + 24),
        )
        .sum();
    if listed as u64 > stagehand_schemas::INLINE_MANIFEST_MAX_BYTES {
        return Err(refused(format!(
            "part {} lists {} files, more than a part's commit carries inline ({} bytes of \
             manifest lines): commit the step in more parts",
            part.part,
            prepared.count(),
            stagehand_schemas::INLINE_MANIFEST_MAX_BYTES
        )));
    }
    let files = prepared.count();
    let event = Event::request(
        EventId::for_checkpoint_part(&opts.project, &opts.run, opts.step, part.part),
        opts.project.as_str(),
        Body::CheckpointPartCommitted(CheckpointPartCommitted {
            run: opts.run.clone(),
            step: opts.step,
            part: part.part,
            parts: part.parts,
            node: part.node.clone(),
            location: prepared.location,
            files: prepared.files.clone(),
            stamps: prepared.stamps.clone(),
            total_bytes: prepared.total_bytes,
            tags: opts.tags.clone(),
        }),
    );
    let ack = bus
        .publish(&event)
        .await
        .map_err(|e| unavailable_or_other(e.is_retryable(), e.into()))?;
    Ok(Committed {
        files,
        event,
        format: prepared.format,
        total_bytes: prepared.total_bytes,
        manifest_digest: None,
        duplicate: ack.duplicate,
    })
}

/// How long a commit waits for the catalogue's answer on overlapping steps: a user without the
/// right to ask gets none at all, so a short wait, not the client's default.
const OVERLAP_TIMEOUT: Duration = Duration::from_secs(2);

/// A step is one folder of its own: one that is, contains or lies in the folder of another
/// live step of the project (of any run) is refused, naming both, so that removing one step
/// never removes the other's files. The catalogue answers which steps overlap; a user without
/// the right to ask it (a training job's, in the shipped accounts) or a catalogue that does not
/// answer leaves the check to the recorder, which refuses such a commit when it folds it.
async fn own_folder(
    bus: &Bus,
    opts: &CommitOptions,
    location: &Location,
) -> Result<(), CheckpointError> {
    let catalogue = Catalogue::new(bus.client().clone()).with_timeout(OVERLAP_TIMEOUT);
    let overlapping = match catalogue
        .checkpoints_overlapping(&opts.project, &location.prefix)
        .await
    {
        Ok(found) => found,
        Err(e) => {
            eprintln!(
                "stagehand checkpoint: note: the catalogue was not asked whether {}:{} overlaps \
                 another step ({e}); the catalogue recorder refuses the commit if it does",
                location.tier, location.prefix
            );
            return Ok(());
        }
    };
    let other = overlapping
        .iter()
        .find(|r| (r.run.as_str(), r.step) != (opts.run.as_str(), opts.step));
    match other {
        None => Ok(()),
        Some(other) => Err(refused(format!(
            "step {} of run {} at {}:{} overlaps step {} of run {} at {}:{} (the same folder, one \
             inside the other): a step is one folder of its own, so that removing one never \
             removes the other; save this step in a folder of its own",
            opts.step,
            opts.run,
            location.tier,
            location.prefix,
            other.step,
            other.run,
            other.location.tier,
            other.location.prefix
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
