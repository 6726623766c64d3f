//! Where things live on a tier, and what a name may be: the one home of every layout rule.
//!
//! Tiers are shared by projects, and every service, the CLI and every producer outside Rust
//! must agree on the same few rules, or a rule checked in one place is bypassed in another:
//!
//! - **names**: a project ([`check_project`]), a dataset ([`check_dataset_name`]), a version
//!   digest ([`check_version`]) or a version prefix ([`check_version_prefix`]);
//! - **folders**: a project's versions live in `<project>/<dataset>/<version>`
//!   ([`version_folder`]; an upload placed by `stagehand ingest` under the first
//!   [`UPLOAD_FOLDER_HEX`] hex characters of its digest, [`upload_folder`]); the mover stages a
//!   set in a hidden folder beside its final name ([`staging_folder_name`]);
//! - **the location rule** ([`check_location`]): a location belongs to project `P` if and only
//!   if its prefix lies strictly beneath `P/`.
//!
//! Every folder built here is byte-identical to what earlier releases wrote, so tiers written
//! then stay valid. Checks are lexical, before anything touches a filesystem or an object
//! store; the mover's confined opens (`openat2(RESOLVE_BENEATH)`) close links and races.

use crate::event::Location;
use crate::manifest::is_sha256_hex;
use crate::path::{PathError, check_relative_path};
use crate::subject::is_subject_token;

/// The shortest version prefix an event may carry where the contract allows a prefix
/// (`stage.requested`, `stage.released`, `stage.failed`, `stage.pending`). A scheduler's prefix
/// is recorded and acted on (a copy, a hold, a release matched to it), so it must stay unique
/// as a dataset gains versions: 12 hex characters (48 bits).
pub const MIN_VERSION_PREFIX: usize = 12;

/// The shortest version prefix a catalogue query accepts (`stagehand catalogue show D@V`,
/// `stagehand restore`). A query only reads: an ambiguous prefix is answered `ambiguous`,
/// naming the candidates, and a person types it, so 8 characters are enough there. Events
/// keep [`MIN_VERSION_PREFIX`].
pub const MIN_QUERY_VERSION_PREFIX: usize = 8;

/// The name of the canonical manifest kept inside every set on a backup tier, beside the
/// version's files: it makes a backup restorable and verifiable on its own (its SHA-256 is the
/// version digest). Written by the backup copier, and again by the demoter's scrub when it
/// repairs a backup.
pub const BACKUP_MANIFEST_NAME: &str = ".stagehand-manifest";

/// The longest dataset name, in bytes.
pub const MAX_DATASET_NAME: usize = 128;

/// How many hex characters of its digest name an upload's folder ([`upload_folder`]).
pub const UPLOAD_FOLDER_HEX: usize = 16;

/// What marks the hidden folder a set is staged in: `.<name>.stagehand-set-<owner>`.
pub const STAGING_MARK: &str = ".stagehand-set-";

/// The longest part of a final name kept in a temporary's name, in bytes, so that a
/// temporary's prefix and suffix keep it under `NAME_MAX` (255).
pub const MAX_STEM_BYTES: usize = 160;

/// Why a name is not acceptable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NameError {
    #[error("project {0:?} is not a project name: 1-64 characters of [a-z0-9_-]")]
    Project(String),
    #[error(
        "dataset {0:?} is not a dataset name: 1-128 characters of [A-Za-z0-9._-], not starting with '.'"
    )]
    Dataset(String),
    #[error("version {0:?} is not a version digest: 64 lowercase hex characters")]
    Version(String),
    #[error(
        "version {version:?} is not a version digest or a unique prefix of one: {min}-64 lowercase hex characters"
    )]
    VersionPrefix { version: String, min: usize },
}

/// A project (tenant) name: a subject token, 1-64 characters of `[a-z0-9_-]`. It is the last
/// token of every subject of the project and the first folder of every location it owns.
pub fn check_project(name: &str) -> Result<(), NameError> {
    if is_subject_token(name) {
        Ok(())
    } else {
        Err(NameError::Project(name.to_owned()))
    }
}

/// A dataset name: 1-128 characters of `[A-Za-z0-9._-]`, not starting with `.` (hidden names
/// are the mover's temporaries). It is one folder on every tier and one key of the catalogue,
/// and a checkpoint run's dataset (`ckpt-<run>`) must be one too.
pub fn check_dataset_name(name: &str) -> Result<(), NameError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_DATASET_NAME
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(NameError::Dataset(name.to_owned()))
    }
}

/// A full version digest: 64 lowercase hex characters.
pub fn check_version(version: &str) -> Result<(), NameError> {
    if is_sha256_hex(version) {
        Ok(())
    } else {
        Err(NameError::Version(version.to_owned()))
    }
}

/// A version digest or a prefix of one: `min` to 64 lowercase hex characters. Events use
/// [`MIN_VERSION_PREFIX`], catalogue queries [`MIN_QUERY_VERSION_PREFIX`].
pub fn check_version_prefix(version: &str, min: usize) -> Result<(), NameError> {
    let ok = (min..=64).contains(&version.len())
        && version
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    if ok {
        Ok(())
    } else {
        Err(NameError::VersionPrefix {
            version: version.to_owned(),
            min,
        })
    }
}

/// The folder of a project's dataset: `<project>/<dataset>`. Its versions, and the staging
/// folders of uploads into it, live beneath it.
pub fn dataset_folder(project: &str, dataset: &str) -> String {
    format!("{project}/{dataset}")
}

/// The folder of one version of a dataset on a tier: `<project>/<dataset>/<version>`. Where
/// the promoter stages a version, the resharder writes a prepared one and the backup copier
/// publishes a backup set (a checkpoint's backup under its run's name as `dataset`).
pub fn version_folder(project: &str, dataset: &str, version: &str) -> String {
    format!("{project}/{dataset}/{version}")
}

/// [`version_folder`] after checking each part: a project name, a dataset name and a full
/// digest, so that the folder is exactly three components beneath the tier root.
pub fn checked_version_folder(
    project: &str,
    dataset: &str,
    version: &str,
) -> Result<String, NameError> {
    check_project(project)?;
    check_dataset_name(dataset)?;
    check_version(version)?;
    Ok(version_folder(project, dataset, version))
}

/// The most parts one checkpoint step committed on node-local tiers may have.
pub const MAX_CHECKPOINT_PARTS: u32 = 4096;

/// The folder of one step of a checkpoint run committed in parts: `<project>/<dataset>/step-<step>`,
/// `dataset` the run's (`ckpt-<run>`, `stagehand_catalogue::checkpoint_dataset`). On a node's
/// local tier each node writes its part beneath it; on the offload tier the step's parts are
/// gathered beneath it and the step is committed there.
pub fn checkpoint_step_folder(project: &str, dataset: &str, step: u64) -> String {
    format!("{}/step-{step}", dataset_folder(project, dataset))
}

/// The folder of one part of a checkpoint step, the same on the node's local tier (where the
/// training job writes it) and on the offload tier (where the node's agent copies it):
/// `<project>/<dataset>/step-<step>/part-<part>`.
pub fn checkpoint_part_folder(project: &str, dataset: &str, step: u64, part: u32) -> String {
    format!(
        "{}/{}",
        checkpoint_step_folder(project, dataset, step),
        checkpoint_part_name(part)
    )
}

/// The name of a part's folder within its step's folder: `part-<part>`.
pub fn checkpoint_part_name(part: u32) -> String {
    format!("part-{part}")
}

/// The folder `stagehand ingest` places a local folder's upload in:
/// `<project>/<dataset>/<first 16 hex of the digest>`.
pub fn upload_folder(project: &str, dataset: &str, digest: &str) -> String {
    let short = digest.get(..UPLOAD_FOLDER_HEX).unwrap_or(digest);
    format!("{}/{short}", dataset_folder(project, dataset))
}

/// The folder the resharder derives a prepared version in before it knows its digest:
/// `<project>/<dataset>/prepare-<derived_from>-<seed>`, fixed by what is derived so that the
/// retry of a killed run finds (and clears) what it left.
pub fn prepare_folder(project: &str, dataset: &str, derived_from: &str, seed: u64) -> String {
    format!("{project}/{dataset}/{PREPARE_MARK}{derived_from}-{seed}")
}

/// The hidden folder beneath a posix tier's root that `stagehand audit` moves stray data into
/// (never deleting it): `.stagehand-quarantine/<date>/<path as it was>`. Not a project name,
/// so no location can ever lie beneath it.
pub const QUARANTINE_FOLDER: &str = ".stagehand-quarantine";

/// Where stray data found at `path` (tier-relative) is quarantined on `date` (`YYYY-MM-DD`).
pub fn quarantine_path(date: &str, path: &str) -> String {
    format!("{QUARANTINE_FOLDER}/{date}/{path}")
}

/// Whether a folder name (one path component) is one the resharder derives a prepared
/// version in ([`prepare_folder`]): work in flight until its digest is known.
pub fn is_prepare_folder_name(name: &str) -> bool {
    name.starts_with(PREPARE_MARK)
}

/// What starts the name of a folder the resharder prepares a version in.
pub const PREPARE_MARK: &str = "prepare-";

/// What every temporary a Stagehand writer leaves beside a final name carries: a temp file
/// `.<stem>.stagehand-<owner>-<n>.tmp` (the mover's) or a staging folder
/// `.<stem>.stagehand-set-<owner>` ([`STAGING_MARK`]).
pub const TEMPORARY_MARK: &str = ".stagehand-";

/// Whether a name (one path component) is a writer's temporary: a hidden name carrying
/// [`TEMPORARY_MARK`] (a staging folder is one, [`is_staging_folder_name`]).
pub fn is_temporary_name(name: &str) -> bool {
    name.starts_with('.') && name.contains(TEMPORARY_MARK)
}

/// The part of a final name a temporary's name keeps: at most [`MAX_STEM_BYTES`], cut at a
/// character boundary.
pub fn name_stem(name: &str) -> &str {
    let mut cut = name.len().min(MAX_STEM_BYTES);
    while !name.is_char_boundary(cut) {
        cut -= 1;
    }
    &name[..cut]
}

/// The hidden name a folder gets, beside it, before its bytes are deleted
/// (`<parent>/.<name>.stagehand-removed`): one rename takes the whole folder out of sight, and
/// a removal interrupted after it is finished by whoever removes that folder next.
pub fn removal_folder(prefix: &str) -> String {
    match prefix.rsplit_once('/') {
        Some((parent, name)) => format!("{parent}/.{name}.stagehand-removed"),
        None => format!(".{prefix}.stagehand-removed"),
    }
}

/// What every staging folder of a set bound for the final name `name` starts with, whoever
/// staged it: `.<stem>.stagehand-set-`. Removing a failed copy's staging folders lists the
/// parent folder for this.
pub fn staging_folder_prefix(name: &str) -> String {
    format!(".{}{STAGING_MARK}", name_stem(name))
}

/// The hidden folder in which the writer `owner_token` (the mover's owner token) stages a set
/// bound for the final name `name`: `.<stem>.stagehand-set-<owner>`.
pub fn staging_folder_name(name: &str, owner_token: &str) -> String {
    format!("{}{owner_token}", staging_folder_prefix(name))
}

/// Whether a folder name (one path component) is a set's staging folder.
pub fn is_staging_folder_name(name: &str) -> bool {
    name.starts_with('.') && name.contains(STAGING_MARK)
}

/// Why a location's prefix does not belong to a project.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Outside {
    #[error("it is the tier's root, which every project shares")]
    TierRoot,
    #[error(
        "it is the project's folder itself, which holds all of the project's data; a location names one thing beneath it"
    )]
    ProjectFolder,
    #[error("its first folder is not the project's")]
    OtherFolder,
    #[error("it is not a normalised relative path: {0}")]
    NotNormalised(PathError),
    #[error("the project name is not a project name")]
    BadProject,
}

/// A location that does not belong to the project of the event naming it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "location {tier}:{prefix:?} is not beneath project {project:?}'s folder {project}/ on the tier: {why}"
)]
pub struct LocationError {
    pub project: String,
    pub tier: String,
    pub prefix: String,
    pub why: Outside,
}

/// Whether the tier-relative `prefix` lies beneath project `project`'s folder: it passes the
/// path rules (relative, no `..`, `.` or empty component, no backslash or control character)
/// and its first component is the project, followed by at least one more. The bare project
/// folder `P` is refused: it holds every dataset, checkpoint and upload of the project, and a
/// location is something a service may copy into or remove (a checkpoint's folder is removed
/// when it is demoted), so one event must never address all of it. The test is lexical and
/// exact: `labb2/x` and `labb/../demo/x` are not beneath `labb/`.
pub fn check_prefix_in_project(project: &str, prefix: &str) -> Result<(), Outside> {
    if !is_subject_token(project) {
        return Err(Outside::BadProject);
    }
    if prefix.is_empty() {
        return Err(Outside::TierRoot);
    }
    check_relative_path(prefix).map_err(Outside::NotNormalised)?;
    match prefix.split_once('/') {
        Some((first, _)) if first == project => Ok(()),
        None if prefix == project => Err(Outside::ProjectFolder),
        _ => Err(Outside::OtherFolder),
    }
}

/// The location rule: `location` belongs to `project` (see [`check_prefix_in_project`]).
pub fn check_location(project: &str, location: &Location) -> Result<(), LocationError> {
    check_prefix_in_project(project, &location.prefix).map_err(|why| LocationError {
        project: project.to_owned(),
        tier: location.tier.clone(),
        prefix: location.prefix.clone(),
        why,
    })
}

impl Location {
    /// Whether this location belongs to `project` ([`check_location`]).
    pub fn belongs_to(&self, project: &str) -> bool {
        check_prefix_in_project(project, &self.prefix).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folders_are_what_earlier_releases_wrote() {
        let v = "9b1113d91ed7d577d691a0db720deed643e8c2e8ba309248926fde45a132ddfe";
        assert_eq!(
            version_folder("vision-lab", "cats", v),
            format!("vision-lab/cats/{v}")
        );
        assert_eq!(
            checked_version_folder("vision-lab", "cats", v).unwrap(),
            version_folder("vision-lab", "cats", v)
        );
        assert_eq!(
            upload_folder("vision-lab", "cats", v),
            "vision-lab/cats/9b1113d91ed7d577"
        );
        assert_eq!(dataset_folder("p", "d"), "p/d");
        assert_eq!(
            prepare_folder("p", "d", "abc", 7),
            "p/d/prepare-abc-7".to_owned()
        );
        assert_eq!(staging_folder_name("v1", "h-1"), ".v1.stagehand-set-h-1");
        assert_eq!(staging_folder_prefix("v1"), ".v1.stagehand-set-");
        assert!(is_staging_folder_name(".v1.stagehand-set-h-1"));
        assert!(!is_staging_folder_name("v1.stagehand-set-h-1"));
        assert!(is_temporary_name(".v1.stagehand-set-h-1"));
        assert!(is_temporary_name(".part-00.bin.stagehand-h-1-0.tmp"));
        assert!(!is_temporary_name("v1"));
        assert!(is_prepare_folder_name("prepare-abc-7"));
        assert_eq!(
            quarantine_path("2026-12-02", "p/d/x"),
            ".stagehand-quarantine/2026-12-02/p/d/x"
        );
        assert!(check_project(QUARANTINE_FOLDER).is_err());
    }

    #[test]
    fn a_long_name_is_cut_in_staging_names_at_a_character_boundary() {
        let long = "é".repeat(200);
        let stem = name_stem(&long);
        assert!(stem.len() <= MAX_STEM_BYTES && long.starts_with(stem));
        assert_eq!(stem.len(), MAX_STEM_BYTES);
        let name = staging_folder_name(&long, "owner");
        assert!(name.len() <= 255, "{}", name.len());
        assert!(name.starts_with(&staging_folder_prefix(&long)));
    }

    #[test]
    fn checked_folders_refuse_each_bad_part() {
        let v = "a".repeat(64);
        assert!(matches!(
            checked_version_folder("Lab", "cats", &v),
            Err(NameError::Project(_))
        ));
        for dataset in ["", "a/b", "..", ".hidden", "a b", &"x".repeat(129)] {
            assert!(
                matches!(
                    checked_version_folder("lab", dataset, &v),
                    Err(NameError::Dataset(_))
                ),
                "{dataset:?}"
            );
        }
        assert!(matches!(
            checked_version_folder("lab", "cats", "abc"),
            Err(NameError::Version(_))
        ));
    }

    #[test]
    fn version_prefixes_have_a_floor_and_are_lowercase_hex() {
        assert!(check_version_prefix(&"a".repeat(12), MIN_VERSION_PREFIX).is_ok());
        assert!(check_version_prefix(&"a".repeat(11), MIN_VERSION_PREFIX).is_err());
        assert!(check_version_prefix(&"a".repeat(8), MIN_QUERY_VERSION_PREFIX).is_ok());
        assert!(check_version_prefix(&"a".repeat(65), MIN_VERSION_PREFIX).is_err());
        assert!(check_version_prefix(&"A".repeat(12), MIN_VERSION_PREFIX).is_err());
        assert!(check_version_prefix(&"g".repeat(12), MIN_VERSION_PREFIX).is_err());
    }

    #[test]
    fn checkpoint_parts_lie_in_their_step_folder() {
        assert_eq!(
            checkpoint_part_folder("lab", "ckpt-r1", 2, 3),
            "lab/ckpt-r1/step-2/part-3"
        );
        assert_eq!(
            checkpoint_step_folder("lab", "ckpt-r1", 2),
            "lab/ckpt-r1/step-2"
        );
    }

    #[test]
    fn the_location_rule() {
        for inside in [
            "labb/x",
            "labb/a/b/c",
            "labb/ünïcode",
            "labb/..x",
            "labb/.hidden",
        ] {
            assert_eq!(check_prefix_in_project("labb", inside), Ok(()), "{inside}");
        }
        let cases: &[(&str, Outside)] = &[
            ("", Outside::TierRoot),
            ("labb", Outside::ProjectFolder),
            ("labb2/x", Outside::OtherFolder),
            ("lab/x", Outside::OtherFolder),
            ("demo/x", Outside::OtherFolder),
            ("x/labb/y", Outside::OtherFolder),
        ];
        for (prefix, why) in cases {
            assert_eq!(
                check_prefix_in_project("labb", prefix).as_ref(),
                Err(why),
                "{prefix}"
            );
        }
        for escape in [
            "labb/../demo/x",
            "labb/..",
            "/labb/x",
            "labb//x",
            "labb/./x",
            "labb/",
            "./labb/x",
            "labb\\x",
            "labb/x\n",
        ] {
            assert!(
                matches!(
                    check_prefix_in_project("labb", escape),
                    Err(Outside::NotNormalised(_))
                ),
                "{escape:?}"
            );
        }
        assert_eq!(check_prefix_in_project("", "x/y"), Err(Outside::BadProject));
        let err = check_location(
            "demo",
            &Location {
                tier: "source".into(),
                prefix: "labb/run/7".into(),
            },
        )
        .unwrap_err();
        let text = err.to_string();
        assert!(text.contains("source:\"labb/run/7\""), "{text}");
        assert!(text.contains("\"demo\""), "{text}");
    }
}
