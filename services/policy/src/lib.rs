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
//! | `scrub.toml` | no | demoter (its scrub duty) |
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
mod scrub;
mod tiers;
mod validation;

use std::path::{Path, PathBuf};

pub use error::PolicyError;
pub use open::{Opening, TierError, sweep_stale};
pub use pipeline::{
    BackupPolicy, BackupSelect, CheckpointOffload, CheckpointRetention, ClassPolicy,
    DEFAULT_DEMOTION_CONCURRENCY, DatasetPacking, DemotionPolicy, Expiry, IncompletePolicy,
    MIN_SHARD_SIZE, NotPacked, ObjectLockPolicy, Packing, PackingPolicy, PriorityClass,
    PriorityPolicy, PromotionPolicy, RetentionMode, RetentionPolicy, ShardLayout, VerifyMode,
};
pub use scrub::{
    AuditPolicy, DEFAULT_QUARANTINE_AFTER, DEFAULT_SCRUB_CHECK_EVERY, DEFAULT_SCRUB_PARALLEL_FILES,
    DEFAULT_STOP_ABOVE_FRACTION, MAX_SCRUB_PARALLEL_FILES, ScrubBudget, ScrubPolicy,
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
    "scrub.toml",
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
    scrub: Option<ScrubPolicy>,
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

    /// Like [`Policies::load_dir`], with relative posix roots resolved against `home`; the
    /// error is the first of [`Policies::check_dir`]'s.
    pub fn load_dir_with_home(
        dir: impl AsRef<Path>,
        home: impl AsRef<Path>,
    ) -> Result<Policies, PolicyError> {
        Self::read(dir.as_ref(), home.as_ref()).map_err(|mut errors| errors.remove(0))
    }

    /// Every problem of the policy files in `dir`, each the error a service would refuse to
    /// start with (`stagehand policy check`): the reading of [`Policies::load_dir_with_home`],
    /// which reports the first, carried on past it — every unknown file name, every
    /// unreadable or missing required file, and each file parsed on its own (the files that
    /// refer to tiers only when `tiers.toml` parsed). Empty when `load_dir_with_home` would
    /// load the folder. Nothing is created or opened beyond the files themselves.
    pub fn check_dir(dir: impl AsRef<Path>, home: impl AsRef<Path>) -> Vec<PolicyError> {
        Self::read(dir.as_ref(), home.as_ref())
            .err()
            .unwrap_or_default()
    }

    /// Reads and parses every policy file in `dir`: the policies, or every error found, in
    /// the order a reader meets them (unknown file names, then each file in
    /// [`POLICY_FILES`] order: reading it, then parsing it). Never empty when `Err`.
    fn read(dir: &Path, home: &Path) -> Result<Policies, Vec<PolicyError>> {
        let home = absolute(home);
        let read_dir = |source| {
            vec![PolicyError::ReadDir {
                dir: dir.to_owned(),
                source,
            }]
        };
        let mut names = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(read_dir)? {
            let entry = entry.map_err(read_dir)?;
            names.push((
                entry.file_name().to_string_lossy().into_owned(),
                entry.path(),
            ));
        }
        names.sort();
        let mut errors = Vec::new();
        for (name, path) in names {
            // A misspelt file name would otherwise silently leave a policy unset.
            if name.ends_with(".toml") && !POLICY_FILES.contains(&name.as_str()) {
                errors.push(PolicyError::UnknownFile {
                    file: path,
                    known: POLICY_FILES.join(", "),
                });
            }
        }
        let mut texts: Vec<(PathBuf, Option<String>)> = Vec::new();
        for (index, name) in POLICY_FILES.iter().enumerate() {
            let file = dir.join(name);
            let text = match std::fs::read_to_string(&file) {
                Ok(text) => Some(text),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound && index >= REQUIRED => None,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    errors.push(PolicyError::Missing { file: file.clone() });
                    None
                }
                Err(source) => {
                    errors.push(PolicyError::ReadFile {
                        file: file.clone(),
                        source,
                    });
                    None
                }
            };
            texts.push((file, text));
        }
        let source = |i: usize| {
            texts[i].1.as_deref().map(|text| Source {
                file: &texts[i].0,
                text,
            })
        };
        // Each file parsed on its own; an error is kept and the next file parsed still.
        fn keep<T>(
            errors: &mut Vec<PolicyError>,
            parsed: Option<Result<T, PolicyError>>,
        ) -> Option<T> {
            match parsed? {
                Ok(policy) => Some(policy),
                Err(e) => {
                    errors.push(e);
                    None
                }
            }
        }
        let tiers = keep(&mut errors, source(0).map(|s| tiers::parse(&s, &home)));
        let validation = keep(&mut errors, source(1).map(|s| validation::parse(&s)));
        let (mut packing, mut promotion, mut demotion, mut retention, mut backup, mut scrub) =
            (None, None, None, None, None, None);
        if let Some(tiers) = &tiers {
            packing = keep(
                &mut errors,
                source(2).map(|s| pipeline::parse_packing(&s, tiers)),
            );
            promotion = keep(
                &mut errors,
                source(3).map(|s| pipeline::parse_promotion(&s, tiers)),
            );
            demotion = keep(
                &mut errors,
                source(4).map(|s| pipeline::parse_demotion(&s, tiers)),
            );
            retention = keep(
                &mut errors,
                source(5).map(|s| pipeline::parse_retention(&s, tiers)),
            );
            backup = keep(
                &mut errors,
                source(6).map(|s| pipeline::parse_backup(&s, tiers)),
            );
        }
        let priorities = keep(
            &mut errors,
            source(7).map(|s| pipeline::parse_priorities(&s)),
        );
        if let Some(tiers) = &tiers {
            scrub = keep(
                &mut errors,
                source(8).map(|s| scrub::parse_scrub(&s, tiers)),
            );
        }
        match (tiers, validation) {
            (Some(tiers), Some(validation)) if errors.is_empty() => Ok(Policies {
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
                scrub,
            }),
            _ => Err(errors),
        }
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

    pub fn scrub(&self) -> Option<&ScrubPolicy> {
        self.scrub.as_ref()
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
