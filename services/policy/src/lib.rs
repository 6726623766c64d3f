//! Stagehand's policies: the TOML files under `policies/`, parsed into typed, validated structs.
//!
//! Every file is read with unknown keys refused and then checked as a whole (watermarks in
//! order, backup tiers in their own failure domain, tier references that exist with the right
//! role). Every error names the file, the key and what is wrong, so a service refuses to start
//! with a message an operator can act on.
//!
//! | file | required | used by |
//! | --- | --- | --- |
//! | `tiers.toml` | yes | every service |
//! | `validation.toml` | yes | ingest validator |
//! | `packing.toml` | no | resharder |
//! | `promotion.toml` | no | promoter |
//! | `demotion.toml` | no | demoter |
//! | `retention.toml` | no | demoter |
//! | `backup.toml` | no | backup copier |
//! | `priorities.toml` | no | mover scheduling |
//!
//! A relative posix tier root resolves against `$STAGEHAND_HOME`, or `<cwd>/.stagehand` when
//! that is unset.
//!
//! ```no_run
//! let policies = stagehand_policy::Policies::load_dir("policies")?;
//! let source = policies.tier("source").expect("declared");
//! println!("{} is a {} tier", source.name, source.role.as_str());
//! println!("max entries: {}", policies.validation().max_entries);
//! # Ok::<(), stagehand_policy::PolicyError>(())
//! ```

mod error;
mod open;
mod pipeline;
pub mod retention;
mod tiers;
mod validation;

use std::path::{Path, PathBuf};

pub use error::PolicyError;
pub use open::{Opening, TierError, sweep_stale};
pub use pipeline::{
    BackupPolicy, BackupSelect, CheckpointRetention, ClassPolicy, DEFAULT_DEMOTION_CONCURRENCY,
    DatasetPacking, DemotionPolicy, Expiry, IncompletePolicy, MIN_SHARD_SIZE, NotPacked,
    ObjectLockPolicy, Packing, PackingPolicy, PriorityClass, PriorityPolicy, PromotionPolicy,
    RetentionMode, RetentionPolicy, ShardLayout, VerifyMode,
};
/// Sizes in policy files follow the one grammar of `stagehand-config` (its README).
pub use stagehand_config::ByteSize;
pub use tiers::{
    DEFAULT_HIGH_WATERMARK, DEFAULT_LOW_WATERMARK, TierKind, TierLimits, TierPolicy, TierRole,
    Tiers,
};
pub use validation::{SuffixVerdict, ValidationPolicy};

use error::Source;
use stagehand_mover::{PosixTier, Tier, TransferError, s3::S3Tier};

/// The environment variable naming the directory relative posix roots resolve against.
pub const HOME_ENV: &str = "STAGEHAND_HOME";

/// The file names `load_dir` knows, required ones first.
pub const POLICY_FILES: &[&str] = &[
    "tiers.toml",
    "validation.toml",
    "packing.toml",
    "promotion.toml",
    "demotion.toml",
    "retention.toml",
    "backup.toml",
    "priorities.toml",
];
const REQUIRED: usize = 2;

/// Every policy, validated. A policy whose file is absent is `None`: its service refuses to
/// start, and nothing else is affected.
#[derive(Debug, Clone)]
pub struct Policies {
    dir: PathBuf,
    home: PathBuf,
    tiers: Tiers,
    validation: ValidationPolicy,
    packing: Option<PackingPolicy>,
    promotion: Option<PromotionPolicy>,
    demotion: Option<DemotionPolicy>,
    retention: Option<RetentionPolicy>,
    backup: Option<BackupPolicy>,
    priorities: Option<PriorityPolicy>,
}

/// The directory relative posix roots resolve against: `$STAGEHAND_HOME`, else
/// `<cwd>/.stagehand`.
pub fn stagehand_home() -> PathBuf {
    match std::env::var_os(HOME_ENV) {
        Some(home) if !home.is_empty() => PathBuf::from(home),
        _ => std::env::current_dir()
            .unwrap_or_else(|_| PathBuf::from("."))
            .join(".stagehand"),
    }
}

impl Policies {
    /// Loads and validates every policy file in `dir`, resolving relative posix roots against
    /// [`stagehand_home`].
    pub fn load_dir(dir: impl AsRef<Path>) -> Result<Policies, PolicyError> {
        Self::load_dir_with_home(dir, stagehand_home())
    }

    /// Like [`Policies::load_dir`], with relative posix roots resolved against `home`.
    pub fn load_dir_with_home(
        dir: impl AsRef<Path>,
        home: impl AsRef<Path>,
    ) -> Result<Policies, PolicyError> {
        let dir = dir.as_ref();
        let home = absolute(home.as_ref());
        let entries = std::fs::read_dir(dir).map_err(|source| PolicyError::ReadDir {
            dir: dir.to_owned(),
            source,
        })?;
        for entry in entries {
            let entry = entry.map_err(|source| PolicyError::ReadDir {
                dir: dir.to_owned(),
                source,
            })?;
            let name = entry.file_name();
            let name = name.to_string_lossy();
            // A misspelt file name would otherwise silently leave a policy unset.
            if name.ends_with(".toml") && !POLICY_FILES.contains(&name.as_ref()) {
                return Err(PolicyError::UnknownFile {
                    file: entry.path(),
                    known: POLICY_FILES.join(", "),
                });
            }
        }

        let mut texts: Vec<(PathBuf, Option<String>)> = Vec::new();
        for (index, name) in POLICY_FILES.iter().enumerate() {
            let file = dir.join(name);
            match std::fs::read_to_string(&file) {
                Ok(text) => texts.push((file, Some(text))),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound && index >= REQUIRED => {
                    texts.push((file, None));
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Err(PolicyError::Missing { file });
                }
                Err(source) => return Err(PolicyError::ReadFile { file, source }),
            }
        }
        let source = |i: usize| {
            texts[i].1.as_deref().map(|text| Source {
                file: &texts[i].0,
                text,
            })
        };
        let required = |i: usize| {
            source(i).ok_or_else(|| PolicyError::Missing {
                file: texts[i].0.clone(),
            })
        };

        let tiers = tiers::parse(&required(0)?, &home)?;
        let validation = validation::parse(&required(1)?)?;
        let packing = source(2)
            .map(|s| pipeline::parse_packing(&s, &tiers))
            .transpose()?;
        let promotion = source(3)
            .map(|s| pipeline::parse_promotion(&s, &tiers))
            .transpose()?;
        let demotion = source(4)
            .map(|s| pipeline::parse_demotion(&s, &tiers))
            .transpose()?;
        let retention = source(5)
            .map(|s| pipeline::parse_retention(&s, &tiers))
            .transpose()?;
        let backup = source(6)
            .map(|s| pipeline::parse_backup(&s, &tiers))
            .transpose()?;
        let priorities = source(7)
            .map(|s| pipeline::parse_priorities(&s))
            .transpose()?;
        Ok(Policies {
            dir: dir.to_owned(),
            home,
            tiers,
            validation,
            packing,
            promotion,
            demotion,
            retention,
            backup,
            priorities,
        })
    }

    /// The directory the policies were loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The directory relative posix roots were resolved against.
    pub fn home(&self) -> &Path {
        &self.home
    }

    pub fn tiers(&self) -> &Tiers {
        &self.tiers
    }

    pub fn tier(&self, name: &str) -> Option<&TierPolicy> {
        self.tiers.get(name)
    }

    pub fn validation(&self) -> &ValidationPolicy {
        &self.validation
    }

    pub fn packing(&self) -> Option<&PackingPolicy> {
        self.packing.as_ref()
    }

    pub fn promotion(&self) -> Option<&PromotionPolicy> {
        self.promotion.as_ref()
    }

    pub fn demotion(&self) -> Option<&DemotionPolicy> {
        self.demotion.as_ref()
    }

    pub fn retention(&self) -> Option<&RetentionPolicy> {
        self.retention.as_ref()
    }

    pub fn backup(&self) -> Option<&BackupPolicy> {
        self.backup.as_ref()
    }

    pub fn priorities(&self) -> Option<&PriorityPolicy> {
        self.priorities.as_ref()
    }

    /// The error for a policy `file` (`"packing.toml"`) that is optional here but that
    /// `service` cannot run without.
    pub fn needed(&self, file: &str, service: &str) -> PolicyError {
        PolicyError::Needed {
            file: self.dir.join(file),
            service: service.to_owned(),
        }
    }
}

impl TierPolicy {
    /// Opens the tier through the mover. A posix root must exist (see
    /// [`TierPolicy::create_root`]); an S3 tier's client is built without a request, so an
    /// unreachable endpoint shows on first use, as a retryable error.
    pub fn open(&self) -> Result<Tier, TransferError> {
        match &self.kind {
            TierKind::Posix { root } => PosixTier::open(&self.name, root).map(Tier::Posix),
            TierKind::S3(config) => S3Tier::connect(&self.name, config.clone()).map(Tier::S3),
        }
    }

    /// Creates a posix tier's root directory (and its parents) if missing; nothing for S3.
    pub fn create_root(&self) -> std::io::Result<()> {
        match &self.kind {
            TierKind::Posix { root } => std::fs::create_dir_all(root),
            TierKind::S3(_) => Ok(()),
        }
    }

    /// A short form of where the tier is, for logs: its root or `s3://bucket/prefix`.
    pub fn location(&self) -> String {
        match &self.kind {
            TierKind::Posix { root } => root.display().to_string(),
            TierKind::S3(config) if config.prefix.is_empty() => format!("s3://{}", config.bucket),
            TierKind::S3(config) => format!("s3://{}/{}", config.bucket, config.prefix),
        }
    }
}

fn absolute(path: &Path) -> PathBuf {
    if path.is_absolute() {
        path.to_owned()
    } else {
        std::env::current_dir()
            .unwrap_or_else(|_| PathBuf::from("."))
            .join(path)
    }
}
