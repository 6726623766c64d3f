//! Format recognition: whether a folder holds a complete checkpoint of a known format, and
//! which folder to commit (the table in the module docs above).

use std::path::{Path, PathBuf};

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
pub(super) fn names(dir: &Path) -> Result<Vec<String>, String> {
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
}
