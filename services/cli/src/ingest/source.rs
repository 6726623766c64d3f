//! What `stagehand ingest` was pointed at, resolved against the tier policy: a local folder to
//! copy onto a posix tier, a folder already beneath a posix source tier's root, or objects
//! already on an S3 source tier (`s3://bucket/prefix`).
//!
//! Data already on a source tier is registered where it is, without a copy. Its prefix on the
//! tier must lie beneath the project's own (`<project>/...`), the same rule the validator
//! enforces (`outside_project`): a request can never name another project's files, so the
//! CLI refuses before listing or hashing anything.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use stagehand_mover::PosixTier;
use stagehand_mover::s3::S3Tier;
use stagehand_policy::{Policies, TierKind, TierPolicy, TierRole};
use stagehand_schemas::layout;

/// Where an ingest's files are and what is done with them.
#[derive(Debug)]
pub enum Source {
    /// A local folder, copied onto the posix tier `tier` under a content-addressed prefix.
    Copy { folder: PathBuf, tier: PosixTier },
    /// A folder beneath the posix source tier `tier`'s root, at `prefix` (tier-relative):
    /// registered in place.
    PosixInPlace {
        folder: PathBuf,
        tier: PosixTier,
        prefix: String,
    },
    /// Objects beneath `prefix` (tier-relative) of the S3 source tier `tier`: registered in
    /// place.
    S3InPlace {
        url: String,
        tier: S3Tier,
        prefix: String,
    },
}

impl Source {
    /// The tier the request names.
    pub fn tier_name(&self) -> &str {
        match self {
            Source::Copy { tier, .. } | Source::PosixInPlace { tier, .. } => tier.name(),
            Source::S3InPlace { tier, .. } => tier.name(),
        }
    }

    /// Whether the files stay where they are (no copy).
    pub fn in_place(&self) -> bool {
        !matches!(self, Source::Copy { .. })
    }

    /// The source as the user gave it, for messages.
    pub fn describe(&self) -> String {
        match self {
            Source::Copy { folder, .. } | Source::PosixInPlace { folder, .. } => {
                folder.display().to_string()
            }
            Source::S3InPlace { url, .. } => url.clone(),
        }
    }
}

/// Resolves `source` (a folder or an `s3://` URL). `copy_tier` is the posix tier a local
/// folder is copied onto; `in_place` demands that the folder already be beneath a posix
/// source tier (without it, such a folder is detected and registered in place all the same).
pub fn resolve(
    source: &str,
    in_place: bool,
    project: &str,
    copy_tier: &str,
    policies: &Policies,
    policies_dir: &Path,
) -> anyhow::Result<Source> {
    if let Some(rest) = source.strip_prefix("s3://") {
        return resolve_s3(source, rest, project, policies, policies_dir);
    }
    if source.contains("://") {
        bail!("{source:?}: only local folders and s3:// URLs can be ingested");
    }
    let folder = PathBuf::from(source);
    let real = folder
        .canonicalize()
        .with_context(|| format!("cannot open folder {}", folder.display()))?;
    if !real.is_dir() {
        bail!("{} is not a folder", folder.display());
    }
    for tier in source_tiers(policies) {
        let TierKind::Posix { root } = &tier.kind else {
            continue;
        };
        let Ok(root) = root.canonicalize() else {
            continue;
        };
        let Ok(rel) = real.strip_prefix(&root) else {
            continue;
        };
        let prefix = rel
            .to_str()
            .with_context(|| format!("{} is not valid UTF-8", rel.display()))?
            .to_owned();
        if let Err(why) = layout::check_prefix_in_project(project, &prefix) {
            bail!(
                "{} is on source tier {:?} at {prefix:?}, which is not beneath project {project:?}'s own prefix {project:?}/ on that tier ({why}): refused",
                folder.display(),
                tier.name,
            );
        }
        let tier = PosixTier::open(&tier.name, &root)
            .with_context(|| format!("opening tier {:?}", tier.name))?;
        return Ok(Source::PosixInPlace {
            folder,
            tier,
            prefix,
        });
    }
    if in_place {
        bail!(
            "--in-place: {} is not beneath the root of any posix source tier declared in {}",
            folder.display(),
            policies_dir.display()
        );
    }
    let tier_policy = policies.tier(copy_tier).with_context(|| {
        format!(
            "tier {copy_tier:?} is not declared in {}",
            policies_dir.display()
        )
    })?;
    let TierKind::Posix { root } = &tier_policy.kind else {
        bail!(
            "tier {copy_tier:?} is not a posix tier; a local folder is copied onto a posix tier (objects already on an S3 tier are registered with s3://bucket/prefix)"
        );
    };
    if root
        .canonicalize()
        .is_ok_and(|root| root.starts_with(&real))
    {
        bail!(
            "tier {copy_tier:?} lies inside {} ({}): a folder cannot be copied into itself",
            folder.display(),
            root.display()
        );
    }
    let tier = PosixTier::open(copy_tier, root)
        .with_context(|| format!("opening tier {copy_tier:?} at {}", root.display()))?;
    Ok(Source::Copy { folder, tier })
}

fn source_tiers(policies: &Policies) -> impl Iterator<Item = &TierPolicy> {
    policies
        .tiers()
        .values()
        .filter(|t| t.role == TierRole::Source)
}

fn resolve_s3(
    url: &str,
    rest: &str,
    project: &str,
    policies: &Policies,
    policies_dir: &Path,
) -> anyhow::Result<Source> {
    let (bucket, key_prefix) = rest.split_once('/').unwrap_or((rest, ""));
    let key_prefix = key_prefix.trim_matches('/');
    if bucket.is_empty() {
        bail!("{url:?}: expected s3://bucket/prefix");
    }
    let mut declared_buckets = Vec::new();
    for tier in source_tiers(policies) {
        let TierKind::S3(config) = &tier.kind else {
            continue;
        };
        declared_buckets.push(format!("s3://{}/{}", config.bucket, config.prefix));
        if config.bucket != bucket {
            continue;
        }
        let tier_prefix = config.prefix.trim_matches('/');
        let rel = if tier_prefix.is_empty() {
            key_prefix
        } else if key_prefix == tier_prefix {
            ""
        } else if let Some(rel) = key_prefix
            .strip_prefix(tier_prefix)
            .and_then(|r| r.strip_prefix('/'))
        {
            rel
        } else {
            continue;
        };
        if let Err(why) = layout::check_prefix_in_project(project, rel) {
            bail!(
                "{url} is on source tier {:?} at {rel:?}, which is not beneath project {project:?}'s own prefix {project:?}/ on that tier ({why}): refused",
                tier.name
            );
        }
        let tier_handle = S3Tier::connect(&tier.name, config.clone())
            .with_context(|| format!("opening tier {:?}", tier.name))?;
        return Ok(Source::S3InPlace {
            url: url.to_owned(),
            tier: tier_handle,
            prefix: rel.to_owned(),
        });
    }
    bail!(
        "{url} is not inside any s3 source tier declared in {} (declared: {})",
        policies_dir.display(),
        if declared_buckets.is_empty() {
            "none".to_owned()
        } else {
            declared_buckets.join(", ")
        }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The default policies under `dir` (the posix source tier at `dir/tiers/source`) and an
    /// S3 source tier `lab` on bucket `lab-drop`, prefix `incoming`.
    fn policies(dir: &Path) -> Policies {
        crate::up::write_default_policies(&dir.join("policies"), dir).unwrap();
        let mut tiers = std::fs::read_to_string(dir.join("policies/tiers.toml")).unwrap();
        tiers.push_str(
            r#"
[tiers.lab]
kind = "s3"
role = "source"
failure_domain = "lab-bucket"
endpoint = "http://127.0.0.1:1"
allow_plaintext = true
bucket = "lab-drop"
prefix = "incoming"
"#,
        );
        std::fs::write(dir.join("policies/tiers.toml"), tiers).unwrap();
        std::fs::create_dir_all(dir.join("tiers/source")).unwrap();
        Policies::load_dir_with_home(dir.join("policies"), dir).unwrap()
    }

    #[test]
    fn a_prefix_must_be_beneath_the_project() {
        for inside in ["lab/data", "lab/a/b"] {
            assert!(
                layout::check_prefix_in_project("lab", inside).is_ok(),
                "{inside}"
            );
        }
        // The bare project folder is all of the project's data, not one upload.
        for outside in ["", "lab", "labx", "labx/data", "other/lab", "la"] {
            assert!(
                layout::check_prefix_in_project("lab", outside).is_err(),
                "{outside}"
            );
        }
    }

    #[test]
    fn s3_urls_resolve_inside_a_declared_source_tier_and_project_only() {
        let dir = tempfile::tempdir().unwrap();
        let p = policies(dir.path());
        let pdir = dir.path().join("policies");
        let resolved = resolve(
            "s3://lab-drop/incoming/vision/2026/",
            false,
            "vision",
            "source",
            &p,
            &pdir,
        )
        .unwrap();
        match resolved {
            Source::S3InPlace { prefix, tier, .. } => {
                assert_eq!(prefix, "vision/2026");
                assert_eq!(tier.name(), "lab");
            }
            other => panic!("{other:?}"),
        }
        let err = resolve(
            "s3://lab-drop/incoming/other/x",
            false,
            "vision",
            "source",
            &p,
            &pdir,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("not beneath project \"vision\""), "{err}");
        let err = resolve(
            "s3://lab-drop/elsewhere/vision",
            false,
            "vision",
            "source",
            &p,
            &pdir,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("not inside any s3 source tier"), "{err}");
        let err = resolve(
            "s3://other-bucket/vision",
            false,
            "vision",
            "source",
            &p,
            &pdir,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("s3://lab-drop/incoming"), "{err}");
    }

    #[test]
    fn a_folder_beneath_a_posix_source_tier_is_registered_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let p = policies(dir.path());
        let root = dir.path().join("tiers/source");
        std::fs::create_dir_all(root.join("vision/run-1")).unwrap();
        std::fs::create_dir_all(root.join("audio/run-1")).unwrap();
        std::fs::create_dir_all(dir.path().join("elsewhere")).unwrap();
        let pdir = dir.path().join("policies");
        let here = root.join("vision/run-1");
        match resolve(here.to_str().unwrap(), false, "vision", "source", &p, &pdir).unwrap() {
            Source::PosixInPlace { prefix, .. } => assert_eq!(prefix, "vision/run-1"),
            other => panic!("{other:?}"),
        }
        let err = resolve(
            root.join("audio/run-1").to_str().unwrap(),
            true,
            "vision",
            "source",
            &p,
            &pdir,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("not beneath project \"vision\""), "{err}");
        let elsewhere = dir.path().join("elsewhere");
        let err = resolve(
            elsewhere.to_str().unwrap(),
            true,
            "vision",
            "source",
            &p,
            &pdir,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("--in-place"), "{err}");
        assert!(matches!(
            resolve(
                elsewhere.to_str().unwrap(),
                false,
                "vision",
                "source",
                &p,
                &pdir
            )
            .unwrap(),
            Source::Copy { .. }
        ));
    }
}
