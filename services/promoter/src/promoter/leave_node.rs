//! Checkpoint parts leave node NVMe once their step is durable (a node agent only): on the
//! step's `checkpoint.committed`, this node's agent removes each of its node's parts of that
//! step from the node's local tier and states `checkpoint.part.removed`, unless
//! `retention.toml`'s `[offload] keep_on_node` keeps them there.
//!
//! Why a part may go: [`removable`] holds it to the catalogue's record of the part (offloaded,
//! to the tier and folder the step's commit names) and to the commit itself (which lists every
//! file of the part under `part-<I>/` with the same size and SHA-256), and the folder on the
//! node is then checked to hold those files only, each of its listed size. A part that fails
//! any of these stays, saying why. The part's copy is then read back from the offload tier and
//! hashed against the part's commit by this agent ([`Promoter::prove_copy`]), whatever the
//! offload verified: a file that does not verify, or is not there, is copied again from the
//! node first, and a copy that cannot be proven keeps the part on its node. So the node's bytes
//! go only once their copy off the node has been read back whole by the one that deletes them —
//! not on the word of the catalogue, which an offload stated by another (a forged
//! `checkpoint.part.offloaded`, a lost copy) would make wrong. With `[offload] verify =
//! "hashed-in-flight"`, as shipped, this is the copy's only read-back, and the step became
//! latest at the copy's speed. A step demoted or expired while this agent was away is not read
//! back where it no longer is: its part goes as the step did. The folder is first renamed to its hidden removal name
//! (`layout::removal_folder`), listed again (a write in the instant before the rename is
//! caught: the folder is put back), then deleted; a removal interrupted anywhere is finished by
//! the redelivered commit, and the fact's id follows from the step and the part, so stating it
//! again (a redelivery, two agents of one node) is one fact.

use futures::stream;
use stagehand_bus::HandlerError;
use stagehand_catalogue::{CheckpointPartRecord, CheckpointState, StepParts, checkpoint_dataset};
use stagehand_mover::{
    CopyOptions, ErrorKind, PosixTier, Priority, Progress, SetCopy, Tier, VerifyMode,
};
use stagehand_policy::TierRole;
use stagehand_schemas::{
    Body, CheckpointCommitted, CheckpointPartRemoved, Event, FileRef, Location, Retryable, layout,
};
use tracing::{debug, info, warn};

use super::{Promoter, retry};
use crate::kv::LeaseState;

/// The fact-id step of a part's `checkpoint.part.removed`, derived from the step's commit.
pub fn step_part_removed(part: u32) -> String {
    format!("part-removed:{part}")
}

/// Whether `part` (its catalogue record, of project `project`) may leave its node now that
/// `commit` is the step's commit: `Ok` with its files and its verified copy, or why not.
///
/// The commit must name the step's folder, and the record must show the part committed,
/// offloaded to the commit's tier under the part's own folder, not removed yet, and every one of
/// its files listed by the commit under `part-<I>/` with the same size and SHA-256 — so the
/// bytes on the node are the bytes whose verified copy the step is.
pub fn removable<'a>(
    project: &str,
    part: &'a CheckpointPartRecord,
    commit: &CheckpointCommitted,
) -> Result<(&'a [FileRef], &'a Location), String> {
    let dataset = checkpoint_dataset(&part.run);
    let folder = layout::checkpoint_part_folder(project, &dataset, part.step, part.part);
    if (part.run.as_str(), part.step) != (commit.run.as_str(), commit.step) {
        return Err(format!(
            "the commit is of step {} of run {}, not the part's",
            commit.step, commit.run
        ));
    }
    if commit.location.prefix != layout::checkpoint_step_folder(project, &dataset, part.step) {
        return Err(format!(
            "the step's commit is at {:?}, not the step's folder",
            commit.location.prefix
        ));
    }
    if part.location.prefix != folder {
        return Err(format!(
            "its folder {:?} is not the part's folder {folder:?}",
            part.location.prefix
        ));
    }
    if part.committed.is_none() || part.files.is_empty() {
        return Err("the catalogue has not folded its commit (its files are unknown)".into());
    }
    let offloaded_to = match (&part.offloaded, &part.offloaded_to) {
        (Some(_), Some(to)) => to,
        _ => return Err("the catalogue does not show it offloaded".into()),
    };
    if offloaded_to.tier != commit.location.tier || offloaded_to.prefix != folder {
        return Err(format!(
            "it was offloaded to {}:{}, not into the step's commit on {}",
            offloaded_to.tier, offloaded_to.prefix, commit.location.tier
        ));
    }
    if part.is_removed() {
        return Err("already removed".into());
    }
    let dir = layout::checkpoint_part_name(part.part);
    let listed: Vec<&FileRef> = (commit.files.iter())
        .filter(|f| {
            f.path
                .strip_prefix(&dir)
                .is_some_and(|r| r.starts_with('/'))
        })
        .collect();
    if listed.len() != part.files.len() {
        return Err(format!(
            "the step's commit lists {} file(s) under {dir}/, its commit on the node {}",
            listed.len(),
            part.files.len()
        ));
    }
    for f in &part.files {
        let path = format!("{dir}/{}", f.path);
        if !listed
            .iter()
            .any(|c| c.path == path && c.size == f.size && c.sha256 == f.sha256)
        {
            return Err(format!(
                "{} is not in the step's commit with the same size and SHA-256",
                f.path
            ));
        }
    }
    Ok((&part.files, offloaded_to))
}

impl Promoter {
    /// A step's commit: this node's parts of it leave the node's local tier (each stated
    /// removed), unless `keep_on_node`. Nothing for a step that has no part on this node.
    pub(super) async fn parts_leave_node(
        &self,
        event: &Event,
        commit: &CheckpointCommitted,
    ) -> Result<Vec<Event>, HandlerError> {
        let Some(node) = self.node() else {
            return Ok(Vec::new());
        };
        let offload = self
            .p()
            .policies
            .retention()
            .and_then(|r| r.offload.as_ref());
        if offload.is_none_or(|o| o.keep_on_node) {
            return Ok(Vec::new());
        }
        let parts = self
            .p()
            .catalogue
            .checkpoint_parts(&event.project, &commit.run, Some(commit.step))
            .await
            .map_err(retry)?;
        // A commit stated by anyone but the agents (a trainer may state its own project's)
        // removes nothing while the catalogue shows a part of the step still on its node.
        if !StepParts::of(&parts)
            .first()
            .is_some_and(StepParts::complete)
        {
            return Ok(Vec::new());
        }
        let mine: Vec<&CheckpointPartRecord> = (parts.iter())
            .filter(|p| p.node == node && !p.is_removed())
            .collect();
        if mine.is_empty() {
            return Ok(Vec::new());
        }
        let still_there = self.step_still_committed(event, commit).await?;
        let mut facts = Vec::new();
        for part in mine {
            let (files, offloaded_to) = match removable(&event.project, part, commit) {
                Ok(found) => found,
                Err(why) => {
                    warn!(run = %part.run, step = part.step, part = part.part, %node, "checkpoint part stays on the node: {why}");
                    continue;
                }
            };
            let Some(posix) = self.own_local_tier(&part.location.tier) else {
                warn!(run = %part.run, step = part.step, part = part.part, tier = %part.location.tier, "checkpoint part stays on the node: its tier is not this node's posix local tier");
                continue;
            };
            // The copy is read back now, by the agent that deletes, before the bytes it was
            // made from go: not the catalogue's word that it was offloaded and verified. A step
            // demoted or expired since (this agent was away) is not there to read: nothing is
            // made again on a tier the catalogue no longer places it on, and the part goes as
            // its step did (copied down by the demoter, read back; or expired by retention).
            let proven = match still_there {
                true => self.prove_copy(event, part, files, offloaded_to).await?,
                false => Ok(0),
            };
            match proven {
                Ok(0) => {}
                Ok(copied) => {
                    warn!(run = %part.run, step = part.step, part = part.part, tier = %offloaded_to.tier, files = copied, "checkpoint part's copy off the node held files that did not verify when read back (or none); copied again from the node");
                }
                Err(why) => {
                    warn!(run = %part.run, step = part.step, part = part.part, %node, "checkpoint part stays on the node: {why}");
                    continue;
                }
            }
            if let Err(why) = remove_part(posix.clone(), &part.location.prefix, files).await? {
                warn!(run = %part.run, step = part.step, part = part.part, %node, "checkpoint part stays on the node: {why}");
                continue;
            }
            info!(run = %part.run, step = part.step, part = part.part, %node, bytes = part.total_bytes, "checkpoint part removed from the node");
            facts.push(part_removed(event, part, offloaded_to));
        }
        Ok(facts)
    }

    /// Whether the step of `commit` is still where the commit put it: not demoted or expired
    /// since, facts only the demoter may state (a trainer's own later commit of the step, say
    /// on another tier, does not spare the part its proof). The catalogue's record of the
    /// step; not folded yet: a retry.
    async fn step_still_committed(
        &self,
        event: &Event,
        commit: &CheckpointCommitted,
    ) -> Result<bool, HandlerError> {
        let page = (self.p().catalogue)
            .checkpoints(
                &event.project,
                &commit.run,
                Some(1),
                commit.step.checked_sub(1),
            )
            .await
            .map_err(retry)?;
        match page.items.first().filter(|c| c.step == commit.step) {
            Some(c) => Ok(c.state == CheckpointState::Committed),
            None => Err(retry(format!(
                "the catalogue has not folded the commit of step {} of run {} yet",
                commit.step, commit.run
            ))),
        }
    }

    /// Reads `part`'s copy off the node (`copy`) back and hashes every file against the part's
    /// commit (`files`); a file that does not verify is copied again from the node, itself
    /// read back, and the copy published whole at once, under the copy's lease. `Ok(Ok(n))`:
    /// the copy is proven, `n` files copied again; `Ok(Err(why))`: it is not, and the part
    /// must stay (the node's own bytes do not verify either, or the copy cannot be read).
    async fn prove_copy(
        &self,
        commit: &Event,
        part: &CheckpointPartRecord,
        files: &[FileRef],
        copy: &Location,
    ) -> Result<Result<u64, String>, HandlerError> {
        let (Some(src), Some(dst)) = (
            self.p().tiers.get(&part.location.tier),
            self.p().tiers.get(&copy.tier),
        ) else {
            return Ok(Err(format!("tier {:?} is not open here", copy.tier)));
        };
        let coord = &self.p().coordination;
        let mut lease = match coord
            .lease(&copy.tier, None, &copy.prefix, commit.id.as_str())
            .await
            .map_err(retry)?
        {
            LeaseState::Owned(revision) => Some(revision),
            LeaseState::Held { instance, .. } => {
                return Err(retry(format!(
                    "{} on tier {} is leased by {instance}; the part's removal waits",
                    copy.prefix, copy.tier
                )));
            }
        };
        let set = SetCopy {
            src_prefix: part.location.prefix.clone(),
            dst_prefix: copy.prefix.clone(),
            opts: CopyOptions {
                priority: Priority::Checkpoint,
                trust_recorded_hash: false,
                verify_destination: VerifyMode::ReadBack,
                expected_hash_unknown: false,
            },
            chunk_files: 0,
            totals: Some((files.len() as u64, part.total_bytes)),
        };
        let stop = self.p().shutdown.child_token();
        let _slot = self.inner.slots.acquire(Priority::Checkpoint).await;
        let proof = async {
            let listed = stream::iter(files.to_vec());
            (self.p().mover)
                .stage_set(src, dst, &set, listed, &Progress::new(), &stop, |_| {})
                .await?
                .publish()
                .await
        };
        let proven = self
            .renewing(
                &copy.tier,
                &copy.prefix,
                &commit.id,
                &mut lease,
                &stop,
                proof,
            )
            .await;
        if let Some(revision) = lease
            && let Err(e) = coord
                .end_lease(&copy.tier, None, &copy.prefix, revision)
                .await
        {
            debug!(error = %e, "the proof's copy lease not ended; it ages out");
        }
        match proven {
            Ok(report) => Ok(Ok(report.copied)),
            Err(e) if e.is_retryable() || e.kind == ErrorKind::Cancelled => Err(retry(e)),
            Err(e) => Ok(Err(format!(
                "its copy on {} was read back and could not be proven: {e}",
                copy.tier
            ))),
        }
    }

    /// Tier `name` when it is a `local` posix tier open here.
    fn own_local_tier(&self, name: &str) -> Option<&PosixTier> {
        let local = self
            .tier_policy(name)
            .is_some_and(|t| t.role == TierRole::Local);
        match self.p().tiers.get(name) {
            Some(Tier::Posix(posix)) if local => Some(posix),
            _ => None,
        }
    }
}

/// The fact that `part` left its node, caused by the step's commit `commit`.
fn part_removed(commit: &Event, part: &CheckpointPartRecord, offloaded_to: &Location) -> Event {
    commit.caused(
        &step_part_removed(part.part),
        Body::CheckpointPartRemoved(CheckpointPartRemoved {
            run: part.run.clone(),
            step: part.step,
            part: part.part,
            node: part.node.clone(),
            location: part.location.clone(),
            offloaded_to: offloaded_to.clone(),
            files: part.files.len() as u64,
            total_bytes: part.total_bytes,
        }),
    )
}

/// Removes the part folder `folder` from `tier` when it holds `files` only, each of its listed
/// size: `Ok(Err(why))` when it holds anything else (it stays, whole). A folder already gone is
/// removed.
async fn remove_part(
    tier: PosixTier,
    folder: &str,
    files: &[FileRef],
) -> Result<Result<(), String>, HandlerError> {
    let (folder, files) = (folder.to_owned(), files.to_vec());
    tokio::task::spawn_blocking(move || remove_part_now(&tier, &folder, &files))
        .await
        .map_err(retry)?
        .map_err(retry)
}

fn remove_part_now(
    tier: &PosixTier,
    folder: &str,
    files: &[FileRef],
) -> Result<Result<(), String>, stagehand_mover::TransferError> {
    let hidden = layout::removal_folder(folder);
    // A removal interrupted after its rename: what was checked then is finished now.
    if let Err(why) = holds_only(tier, &hidden, files)? {
        return Ok(Err(format!("{hidden}: {why}")));
    }
    if tier.list_files(&hidden)?.is_some() {
        tier.remove_tree(&hidden)?;
    }
    if tier.list_files(folder)?.is_none() {
        return Ok(Ok(()));
    }
    if let Err(why) = holds_only(tier, folder, files)? {
        return Ok(Err(why));
    }
    if !tier.rename_dir_noreplace(folder, &hidden)? {
        return Ok(Err(format!("{hidden} is taken; nothing removed")));
    }
    // A file written through a handle on the folder in the instant before the rename.
    if let Err(why) = holds_only(tier, &hidden, files)? {
        let back = tier.rename_dir_noreplace(&hidden, folder)?;
        return Ok(Err(format!(
            "{why} (seen after the rename; {})",
            if back {
                "put back"
            } else {
                "left whole under its hidden name"
            }
        )));
    }
    tier.remove_tree(&hidden)?;
    // The step's folder goes with its last part on this node (nothing else may be in it).
    if let Some((step, _)) = folder.rsplit_once('/') {
        tier.remove_dir_if_empty(step)?;
    }
    Ok(Ok(()))
}

/// Whether the folder `rel` (absent: yes) holds nothing but `files`, each of its listed size.
fn holds_only(
    tier: &PosixTier,
    rel: &str,
    files: &[FileRef],
) -> Result<Result<(), String>, stagehand_mover::TransferError> {
    let Some(found) = tier.list_files(rel)? else {
        return Ok(Ok(()));
    };
    let mut unlisted: Vec<&String> = found
        .iter()
        .filter(|p| !files.iter().any(|f| &f.path == *p))
        .collect();
    if !unlisted.is_empty() {
        unlisted.sort();
        return Ok(Err(format!(
            "the folder holds {} file(s) its commit does not list (first {:?}); it is left whole",
            unlisted.len(),
            unlisted[0]
        )));
    }
    for f in files {
        let path = format!("{rel}/{}", f.path);
        match tier.stat(&path)? {
            Some(size) if size == f.size => {}
            found => {
                return Ok(Err(format!(
                    "{} is {} on the node, {} bytes in its commit; it is left whole",
                    f.path,
                    found.map_or("missing".to_owned(), |s| format!("{s} bytes")),
                    f.size
                )));
            }
        }
    }
    Ok(Ok(()))
}

#[cfg(test)]
mod tests {
    use stagehand_catalogue::Stamp;
    use stagehand_schemas::{EventId, sha256_hex};

    use super::*;

    const PROJECT: &str = "lab";

    fn stamp(id: &str) -> Stamp {
        Stamp {
            at: stagehand_schemas::now(),
            event_id: EventId::new(id).unwrap(),
        }
    }

    fn folder(part: u32) -> String {
        layout::checkpoint_part_folder(PROJECT, "ckpt-r", 4, part)
    }

    /// Part `part` of step 4 of run `r` on node `n<part>`, committed and offloaded to hot.
    fn part(part: u32) -> CheckpointPartRecord {
        CheckpointPartRecord {
            project: PROJECT.into(),
            run: "r".into(),
            step: 4,
            part,
            parts: 2,
            node: format!("n{part}"),
            location: Location {
                tier: "local".into(),
                prefix: folder(part),
            },
            files: vec![FileRef::new("w.bin", 3, sha256_hex(&[part as u8]))],
            total_bytes: 3,
            tags: vec![],
            committed: Some(stamp("c")),
            offloaded_to: Some(Location {
                tier: "hot".into(),
                prefix: folder(part),
            }),
            offloaded: Some(stamp("o")),
            removed: None,
        }
    }

    /// The step's commit on hot, listing both parts' files.
    fn commit() -> CheckpointCommitted {
        let files: Vec<FileRef> = (0..2u32)
            .map(|i| FileRef::new(format!("part-{i}/w.bin"), 3, sha256_hex(&[i as u8])))
            .collect();
        CheckpointCommitted {
            run: "r".into(),
            step: 4,
            location: Location {
                tier: "hot".into(),
                prefix: layout::checkpoint_step_folder(PROJECT, "ckpt-r", 4),
            },
            total_bytes: 6,
            files,
            manifest: None,
            tags: vec![],
        }
    }

    #[test]
    fn an_offloaded_part_whose_files_the_commit_lists_may_go() {
        let p = part(1);
        let (files, copy) = removable(PROJECT, &p, &commit()).unwrap();
        assert_eq!(files, p.files.as_slice());
        assert_eq!(Some(copy), p.offloaded_to.as_ref());
    }

    #[test]
    fn a_part_the_catalogue_does_not_show_offloaded_stays() {
        let mut p = part(0);
        p.offloaded = None;
        let why = removable(PROJECT, &p, &commit()).unwrap_err();
        assert!(why.contains("not show it offloaded"), "{why}");
        let mut p = part(0);
        p.offloaded_to = None;
        assert!(removable(PROJECT, &p, &commit()).is_err());
    }

    #[test]
    fn a_part_offloaded_elsewhere_than_the_steps_commit_stays() {
        let mut p = part(0);
        p.offloaded_to.as_mut().unwrap().tier = "capacity".into();
        let why = removable(PROJECT, &p, &commit()).unwrap_err();
        assert!(why.contains("not into the step's commit"), "{why}");
        let mut c = commit();
        c.location.prefix = format!("{PROJECT}/ckpt-r/step-5");
        assert!(removable(PROJECT, &part(0), &c).is_err());
    }

    #[test]
    fn a_part_whose_files_differ_from_the_commit_stays() {
        // Committed on the node again after the offload: other bytes.
        let mut p = part(0);
        p.files[0].sha256 = sha256_hex(b"rewritten");
        let why = removable(PROJECT, &p, &commit()).unwrap_err();
        assert!(why.contains("w.bin"), "{why}");
        let mut p = part(0);
        p.files.push(FileRef::new("extra.bin", 1, sha256_hex(b"x")));
        assert!(removable(PROJECT, &p, &commit()).is_err());
        // A commit that leaves a part's file out.
        let mut c = commit();
        c.files.retain(|f| !f.path.starts_with("part-0/"));
        assert!(removable(PROJECT, &part(0), &c).is_err());
    }

    #[test]
    fn a_part_not_in_its_own_folder_or_of_another_step_stays() {
        let mut p = part(0);
        p.location.prefix = format!("{PROJECT}/secrets");
        assert!(removable(PROJECT, &p, &commit()).is_err());
        let mut c = commit();
        c.step = 5;
        assert!(removable(PROJECT, &part(0), &c).is_err());
        assert!(removable("other", &part(0), &commit()).is_err());
    }

    #[test]
    fn a_part_removed_already_or_never_committed_is_not_removed_again() {
        let mut p = part(0);
        p.removed = Some(stamp("r"));
        assert!(removable(PROJECT, &p, &commit()).is_err());
        let mut p = part(0);
        p.committed = None;
        p.files.clear();
        assert!(removable(PROJECT, &p, &commit()).is_err());
    }

    #[test]
    fn a_folder_holding_what_its_commit_does_not_list_stays_whole() {
        let dir = tempfile::tempdir().unwrap();
        let tier = PosixTier::open("local", dir.path()).unwrap();
        let root = dir.path().join(folder(0));
        std::fs::create_dir_all(&root).unwrap();
        std::fs::write(root.join("w.bin"), [0u8; 3]).unwrap();
        std::fs::write(root.join("later.bin"), b"written after the commit").unwrap();
        let files = part(0).files;
        let why = remove_part_now(&tier, &folder(0), &files)
            .unwrap()
            .unwrap_err();
        assert!(why.contains("later.bin"), "{why}");
        assert!(root.join("w.bin").is_file() && root.join("later.bin").is_file());

        std::fs::remove_file(root.join("later.bin")).unwrap();
        std::fs::write(root.join("w.bin"), [0u8; 5]).unwrap();
        let why = remove_part_now(&tier, &folder(0), &files)
            .unwrap()
            .unwrap_err();
        assert!(why.contains("5 bytes"), "{why}");
        assert!(root.join("w.bin").is_file());

        std::fs::write(root.join("w.bin"), [0u8; 3]).unwrap();
        remove_part_now(&tier, &folder(0), &files).unwrap().unwrap();
        assert!(!root.exists());
        assert!(!dir.path().join(layout::removal_folder(&folder(0))).exists());
        // Again (a redelivery): nothing there, nothing to do.
        remove_part_now(&tier, &folder(0), &files).unwrap().unwrap();
    }
}
