//! The policies of the services after validation: packing, promotion, demotion, retention,
//! backup and priority classes.
//!
//! They are parsed and validated at start-up like the others (so a mistake is caught the day it
//! is written, not the day the service that reads it ships), including their references to
//! tiers. The resharder acts on the packing policy, the backup copier on [`BackupPolicy`];
//! checkpoint retention's decisions are in [`crate::retention`].

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;

use crate::error::{PolicyError, Source};
use crate::tiers::{TierRole, Tiers};
use stagehand_config::{ByteSize, duration};

/// Checks that `tier` is declared and has one of `roles`.
fn check_tier_ref(
    src: &Source<'_>,
    tiers: &Tiers,
    key: &str,
    tier: &str,
    roles: &[TierRole],
) -> Result<(), PolicyError> {
    let Some(found) = tiers.get(tier) else {
        return Err(src.invalid(
            key,
            format!("names tier {tier:?}, which tiers.toml does not declare"),
        ));
    };
    if !roles.contains(&found.role) {
        let wanted: Vec<&str> = roles.iter().map(|r| r.as_str()).collect();
        return Err(src.invalid(
            key,
            format!(
                "tier {tier:?} has role {:?}; this needs a tier with role {}",
                found.role.as_str(),
                wanted.join(" or ")
            ),
        ));
    }
    Ok(())
}

/// Shard layouts the resharder can write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ShardLayout {
    /// Tar shards, samples grouped by basename (WebDataset).
    Webdataset,
}

impl ShardLayout {
    /// The name events and the catalogue use (`dataset.prepared`'s `layout`).
    pub fn as_str(self) -> &'static str {
        match self {
            ShardLayout::Webdataset => "webdataset",
        }
    }
}

/// What the resharder does with a sample that lacks an extension the policy requires (or
/// with a file that cannot be part of any sample).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IncompletePolicy {
    /// The derivation fails, listing every problem; nothing is published.
    #[default]
    Abort,
    /// The sample is packed as it is; the problem is logged and listed in the version.
    Warn,
    /// The sample is left out and listed in the version.
    Exclude,
}

impl IncompletePolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            IncompletePolicy::Abort => "abort",
            IncompletePolicy::Warn => "warn",
            IncompletePolicy::Exclude => "exclude",
        }
    }
}

/// `packing.toml`: when and how validated datasets of many small files are packed into shards.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PackingPolicy {
    /// Whether any dataset is packed.
    pub enabled: bool,
    /// Pack only datasets with at least this many files.
    pub min_files: u64,
    /// Pack only datasets whose mean file size is at most this.
    pub max_mean_file_size: ByteSize,
    /// Target size of one shard.
    pub shard_size: ByteSize,
    pub layout: ShardLayout,
    /// Seed of the shuffle of samples across shards.
    pub seed: u64,
    /// Tier the shards are written to.
    pub target_tier: String,
    /// Projects whose datasets the thresholds select; empty means every project.
    #[serde(default)]
    pub projects: Vec<String>,
    /// Extensions (without the dot, lowercase) every sample must have; empty requires none.
    #[serde(default)]
    pub require_extensions: Vec<String>,
    /// What happens to an incomplete sample.
    #[serde(default)]
    pub incomplete: IncompletePolicy,
    /// Settings of single datasets, keyed `<project>/<dataset>`.
    #[serde(default)]
    pub datasets: BTreeMap<String, DatasetPacking>,
}

/// `[datasets."<project>/<dataset>"]` in `packing.toml`: one dataset's own settings; each key
/// left out follows the file's.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatasetPacking {
    /// `true`: packed whatever `projects`, `min_files` and `max_mean_file_size` say;
    /// `false`: never packed. Absent: those keys decide.
    #[serde(default)]
    pub pack: Option<bool>,
    /// The shuffle seed.
    #[serde(default)]
    pub seed: Option<u64>,
    /// Target size of one shard.
    #[serde(default)]
    pub shard_size: Option<ByteSize>,
    /// Extensions every sample must have.
    #[serde(default)]
    pub require_extensions: Option<Vec<String>>,
    /// What happens to an incomplete sample.
    #[serde(default)]
    pub incomplete: Option<IncompletePolicy>,
}

/// How one dataset version is packed: [`PackingPolicy::packing_for`] with the dataset's own
/// settings applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packing {
    pub layout: ShardLayout,
    pub seed: u64,
    /// Target shard size in bytes.
    pub shard_size: u64,
    /// Lowercase extensions, sorted, without duplicates.
    pub require_extensions: Vec<String>,
    pub incomplete: IncompletePolicy,
    pub target_tier: String,
}

/// Why a dataset version is not packed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotPacked {
    #[error("packing is disabled (packing.toml: enabled = false)")]
    Disabled,
    #[error("packing.toml sets pack = false for this dataset")]
    Excluded,
    #[error("project {0:?} is not among packing.toml's projects")]
    ProjectNotSelected(String),
    #[error("{files} files, fewer than min_files ({min})")]
    TooFewFiles { files: u64, min: u64 },
    #[error("mean file size {mean} bytes is above max_mean_file_size ({max})")]
    FilesTooLarge { mean: u64, max: ByteSize },
}

impl PackingPolicy {
    /// How the version of `project`/`dataset` with `files` files of `bytes` bytes in all is
    /// packed, or why it is not.
    pub fn packing_for(
        &self,
        project: &str,
        dataset: &str,
        files: u64,
        bytes: u64,
    ) -> Result<Packing, NotPacked> {
        if !self.enabled {
            return Err(NotPacked::Disabled);
        }
        let own = self.datasets.get(&format!("{project}/{dataset}"));
        match own.and_then(|d| d.pack) {
            Some(false) => return Err(NotPacked::Excluded),
            Some(true) => {}
            None => {
                if !self.projects.is_empty() && !self.projects.iter().any(|p| p == project) {
                    return Err(NotPacked::ProjectNotSelected(project.to_owned()));
                }
                if files < self.min_files || files == 0 {
                    return Err(NotPacked::TooFewFiles {
                        files,
                        min: self.min_files,
                    });
                }
                let mean = bytes / files;
                if mean > self.max_mean_file_size.bytes() {
                    return Err(NotPacked::FilesTooLarge {
                        mean,
                        max: self.max_mean_file_size,
                    });
                }
            }
        }
        let own = own.cloned().unwrap_or_default();
        let mut require_extensions = own
            .require_extensions
            .unwrap_or_else(|| self.require_extensions.clone());
        require_extensions.sort();
        require_extensions.dedup();
        Ok(Packing {
            layout: self.layout,
            seed: own.seed.unwrap_or(self.seed),
            shard_size: own.shard_size.unwrap_or(self.shard_size).bytes(),
            require_extensions,
            incomplete: own.incomplete.unwrap_or(self.incomplete),
            target_tier: self.target_tier.clone(),
        })
    }
}

/// The smallest shard a policy may ask for.
pub const MIN_SHARD_SIZE: u64 = 1 << 20;

fn check_extensions(src: &Source<'_>, key: &str, exts: &[String]) -> Result<(), PolicyError> {
    for ext in exts {
        let problem = if ext.is_empty() {
            Some("an extension cannot be empty")
        } else if ext.starts_with('.') {
            Some("write extensions without the leading dot (\"jpg\", not \".jpg\")")
        } else if ext.contains('/') || ext.chars().any(char::is_control) {
            Some("an extension cannot hold a slash or a control character")
        } else if ext.chars().any(char::is_uppercase) {
            Some("write extensions in lowercase; files match them whatever their case")
        } else {
            None
        };
        if let Some(problem) = problem {
            return Err(src.invalid(key, format!("{ext:?}: {problem}")));
        }
    }
    Ok(())
}

/// How a copy onto a hot or local tier is proven: the mover's one definition
/// (`"read-back"` or `"hashed-in-flight"`).
pub use stagehand_mover::VerifyMode;

/// `promotion.toml`: where stage requests copy data from and to, how many copies run at once,
/// how long a request may wait, and how a copy is proven.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PromotionPolicy {
    /// Tier a stage request without an explicit tier goes to.
    pub default_tier: String,
    /// Tiers a replica is copied from onto a `hot` tier, in order of preference.
    pub sources: Vec<String>,
    /// Tiers a node agent copies from onto a `local` tier, in order of preference (the hot
    /// tier first, usually). Default: `sources`.
    #[serde(default)]
    pub local_sources: Vec<String>,
    /// Copies run at once by one promoter process (a node agent's included).
    pub max_concurrent: u32,
    /// Deadline of a stage request that sets none.
    #[serde(with = "duration")]
    pub default_deadline: Duration,
    /// How the copied bytes are proven on the target tier.
    pub verify: VerifyMode,
    /// How often waiting requests are checked again and deadlines enforced (the policy clock;
    /// facts wake a waiting request at once, the clock is the backstop). Default 30 s.
    #[serde(default = "default_recheck_every", with = "duration")]
    pub recheck_every: Duration,
    /// How often the promoter reconciles the space reserved on its tiers with the live
    /// requests and the replicas there (and once at start): a reservation with neither is
    /// released, its hidden staging folder removed. Default 5 min.
    #[serde(default = "default_reconcile_every", with = "duration")]
    pub reconcile_every: Duration,
    /// How long a node's agent (the promoter run with `node`) may write no liveness record
    /// before the demoter marks that node's local copies unreachable (handed to no job, not
    /// counted in the tier's usage or quota) until the agent is back and has re-checked them.
    /// The agent writes its record every quarter of this (at most every 10 s). Default 2 min;
    /// at least 2 s.
    #[serde(default = "default_agent_silent_after", with = "duration")]
    pub agent_silent_after: Duration,
    /// Dataset names staged at the `checkpoint` priority class instead of `stage`, so that a
    /// checkpoint restore is not starved by bulk stages: exact names, or a prefix ending in
    /// `*` (`"ckpt-*"`).
    #[serde(default)]
    pub checkpoint_datasets: Vec<String>,
}

fn default_recheck_every() -> Duration {
    Duration::from_secs(30)
}

fn default_reconcile_every() -> Duration {
    Duration::from_secs(300)
}

fn default_agent_silent_after() -> Duration {
    Duration::from_secs(120)
}

/// The shortest `agent_silent_after`: a node must get a few beats in before it is judged.
const MIN_AGENT_SILENT_AFTER: Duration = Duration::from_secs(2);

/// The longest time between two liveness records of a node's agent.
const MAX_AGENT_BEAT: Duration = Duration::from_secs(10);

impl PromotionPolicy {
    /// How often a node's agent writes its liveness record: a quarter of
    /// `agent_silent_after`, at most every 10 s, so that a node is judged silent only after
    /// several records in a row were not written.
    pub fn agent_beat_every(&self) -> Duration {
        (self.agent_silent_after / 4).min(MAX_AGENT_BEAT)
    }

    /// The tiers a copy onto a tier of `role` reads from, in order of preference.
    pub fn sources_for(&self, role: TierRole) -> &[String] {
        if role == TierRole::Local && !self.local_sources.is_empty() {
            &self.local_sources
        } else {
            &self.sources
        }
    }

    /// The transfer class a stage of `dataset` runs at.
    pub fn priority_for(&self, dataset: &str) -> PriorityClass {
        let urgent =
            self.checkpoint_datasets
                .iter()
                .any(|pattern| match pattern.strip_suffix('*') {
                    Some(prefix) => dataset.starts_with(prefix),
                    None => dataset == pattern,
                });
        if urgent {
            PriorityClass::Checkpoint
        } else {
            PriorityClass::Stage
        }
    }
}

/// `demotion.toml`: when released replicas move down.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DemotionPolicy {
    /// A replica no live stage holds and unused this long is demoted.
    #[serde(with = "duration")]
    pub idle_after: Duration,
    /// How often the demoter checks idle time and watermarks.
    #[serde(with = "duration")]
    pub check_every: Duration,
    /// Where a demoted replica goes when no other verified copy exists.
    pub target: String,
    /// Demotion steps one demoter carries at once (each its own copy down, announcement and
    /// removal); at least 1. Default [`DEFAULT_DEMOTION_CONCURRENCY`].
    #[serde(default = "default_demotion_concurrency")]
    pub max_concurrent: u32,
}

/// Demotion steps carried at once when `demotion.toml` sets no `max_concurrent`: enough to
/// overlap one step's round trips and flushes with the others' copies, few enough that a
/// background drain does not crowd a tier's disks.
pub const DEFAULT_DEMOTION_CONCURRENCY: u32 = 8;

fn default_demotion_concurrency() -> u32 {
    DEFAULT_DEMOTION_CONCURRENCY
}

/// `retention.toml`: which checkpoints are kept, and when unused replicas expire.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetentionPolicy {
    pub checkpoints: CheckpointRetention,
    pub expiry: Expiry,
    /// Checkpoints committed in parts on node-local tiers: where each node's agent offloads
    /// its part, and by when. Absent: such parts are not offloaded, and their steps never
    /// become a run's latest.
    #[serde(default)]
    pub offload: Option<CheckpointOffload>,
}

/// `[offload]` of `retention.toml`: a checkpoint step committed on node-local NVMe counts
/// only once every part is off the node.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointOffload {
    /// The tier parts are copied to (role `hot` or `capacity`); the step is committed there.
    pub tier: String,
    /// A part not offloaded this long after its commit is late: a visible failure
    /// (`stagehand checkpoint list`).
    #[serde(with = "duration")]
    pub deadline: Duration,
    /// Whether a part stays on its node's local tier once its step is committed whole (false,
    /// the default: each node's agent removes its own parts then, to free the NVMe for the
    /// next step; true leaves them to the run).
    #[serde(default)]
    pub keep_on_node: bool,
    /// How a part's copy off the node is proven before its step counts: `hashed-in-flight`
    /// (the default: every byte hashed as it is read from the node and checked against the
    /// part's commit, the copy made durable, and the step latest at the copy's speed) or
    /// `read-back` (the copy also read back from the offload tier and hashed first). Either
    /// way a part leaves its node only once its agent has read the copy back and found it
    /// whole, just before removing the part (copying again from the node any file that does
    /// not verify or is missing).
    #[serde(default = "default_offload_verify")]
    pub verify: VerifyMode,
}

fn default_offload_verify() -> VerifyMode {
    VerifyMode::HashedInFlight
}

/// Checkpoint retention of one training run.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointRetention {
    /// The newest N checkpoints are kept.
    pub keep_last: u32,
    /// Every checkpoint whose step is a multiple of this is kept; 0 keeps none this way.
    pub keep_every: u64,
    /// Checkpoints carrying any of these tags are kept.
    pub keep_tagged: Vec<String>,
    /// Of the kept checkpoints, how many newest stay on the hot tier; older ones are demoted.
    /// At least 1, at most `keep_last`.
    pub hot_keep_last: u32,
    /// Tier older checkpoints are demoted to.
    pub demote_to: String,
}

/// Expiry of replicas on bounded tiers.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Expiry {
    /// A replica on a hot or local tier not staged for this long is removed (never the last
    /// verified copy of a version).
    #[serde(with = "duration")]
    pub unstaged_replica_after: Duration,
}

/// Facts a backup policy can select.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum BackupSelect {
    #[serde(rename = "dataset.validated")]
    DatasetValidated,
    #[serde(rename = "dataset.prepared")]
    DatasetPrepared,
    #[serde(rename = "checkpoint.committed")]
    CheckpointCommitted,
}

impl BackupSelect {
    /// The event kind, as written on the wire (`dataset.validated`, ...).
    pub fn kind(self) -> &'static str {
        match self {
            BackupSelect::DatasetValidated => "dataset.validated",
            BackupSelect::DatasetPrepared => "dataset.prepared",
            BackupSelect::CheckpointCommitted => "checkpoint.committed",
        }
    }
}

/// `backup.toml`: what is copied to the backup tier, how it is proven and held there, and
/// how often restores are drilled.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackupPolicy {
    /// The backup tier.
    pub target: String,
    /// Facts whose data is backed up.
    pub select: Vec<BackupSelect>,
    /// Projects backed up; empty means every project.
    pub projects: Vec<String>,
    /// Checkpoints are backed up only with one of these tags; empty means every checkpoint.
    pub checkpoint_tags: Vec<String>,
    /// How a copy onto the backup tier is proven before it is published: `read-back` (every
    /// file, or object, read again from the backup tier and hashed) or `hashed-in-flight`.
    #[serde(default = "default_backup_verify")]
    pub verify: VerifyMode,
    /// S3 backup tiers only: every object the copier writes is held under S3 Object Lock.
    #[serde(default)]
    pub object_lock: Option<ObjectLockPolicy>,
    /// How often a restore drill runs.
    #[serde(with = "duration")]
    pub drill_every: Duration,
    /// Files read back per drill.
    pub drill_sample_files: u32,
    /// Upper bound on bytes read back per drill.
    pub drill_sample_bytes: ByteSize,
}

fn default_backup_verify() -> VerifyMode {
    VerifyMode::ReadBack
}

/// How an S3 Object Lock retention holds each object: the mover's one definition
/// (`"governance"` or `"compliance"`).
pub use stagehand_mover::s3::RetentionMode;

/// `backup.toml`'s `[object_lock]`: the retention the S3 backup bucket gives every object
/// version written to it (its default retention, set by the backup copier at start-up).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ObjectLockPolicy {
    /// `compliance` (nobody may delete a version or shorten its hold) or `governance` (users
    /// with the bypass right may).
    pub mode: RetentionMode,
    /// Days each object version is held from its write; 1 to 36500.
    pub days: u32,
}

/// A bandwidth class of transfers: the mover's one definition of the classes, named in
/// lowercase in `priorities.toml` (`[classes.checkpoint]` ...).
pub use stagehand_mover::Priority as PriorityClass;

/// One class's share of bandwidth.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassPolicy {
    /// Relative weight when classes compete (1-1000).
    pub weight: u32,
    /// Bytes per second this class may use; absent means unlimited.
    #[serde(default)]
    pub max_bytes_per_sec: Option<ByteSize>,
}

/// `priorities.toml`: the transfer classes and their weights.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PriorityPolicy {
    pub classes: BTreeMap<PriorityClass, ClassPolicy>,
}

impl PriorityPolicy {
    pub fn class(&self, class: PriorityClass) -> &ClassPolicy {
        // Every class is present: `parse_priorities` refuses a file that misses one.
        &self.classes[&class]
    }
}

pub(crate) fn parse_packing(src: &Source<'_>, tiers: &Tiers) -> Result<PackingPolicy, PolicyError> {
    let p: PackingPolicy = src.parse()?;
    if p.shard_size.bytes() < MIN_SHARD_SIZE {
        return Err(src.invalid(
            "shard_size",
            format!("{} is below the minimum of 1 MiB", p.shard_size),
        ));
    }
    if p.max_mean_file_size.bytes() == 0 {
        return Err(src.invalid("max_mean_file_size", "must be more than 0 bytes"));
    }
    check_tier_ref(
        src,
        tiers,
        "target_tier",
        &p.target_tier,
        &[TierRole::Capacity, TierRole::Source],
    )?;
    if let Some(bad) = p
        .projects
        .iter()
        .find(|p| !stagehand_schemas::subject::is_subject_token(p))
    {
        return Err(src.invalid(
            "projects",
            format!("{bad:?} is not a project name (1-64 characters of [a-z0-9_-])"),
        ));
    }
    check_extensions(src, "require_extensions", &p.require_extensions)?;
    for (name, own) in &p.datasets {
        let key = |field: &str| format!("datasets.{name}.{field}");
        let valid_name = name.split_once('/').is_some_and(|(project, dataset)| {
            stagehand_schemas::subject::is_subject_token(project)
                && !dataset.is_empty()
                && !dataset.contains('/')
        });
        if !valid_name {
            return Err(src.invalid(
                format!("datasets.{name}"),
                "a dataset is named \"<project>/<dataset>\"",
            ));
        }
        if let Some(size) = own.shard_size
            && size.bytes() < MIN_SHARD_SIZE
        {
            return Err(src.invalid(
                key("shard_size"),
                format!("{size} is below the minimum of 1 MiB"),
            ));
        }
        if let Some(exts) = &own.require_extensions {
            check_extensions(src, &key("require_extensions"), exts)?;
        }
    }
    Ok(p)
}

pub(crate) fn parse_promotion(
    src: &Source<'_>,
    tiers: &Tiers,
) -> Result<PromotionPolicy, PolicyError> {
    let p: PromotionPolicy = src.parse()?;
    check_tier_ref(
        src,
        tiers,
        "default_tier",
        &p.default_tier,
        &[TierRole::Hot, TierRole::Local],
    )?;
    if p.sources.is_empty() {
        return Err(src.invalid("sources", "must name at least one tier to copy from"));
    }
    for source in &p.sources {
        check_tier_ref(
            src,
            tiers,
            "sources",
            source,
            &[TierRole::Capacity, TierRole::Source, TierRole::Backup],
        )?;
    }
    for source in &p.local_sources {
        check_tier_ref(
            src,
            tiers,
            "local_sources",
            source,
            &[
                TierRole::Hot,
                TierRole::Capacity,
                TierRole::Source,
                TierRole::Backup,
            ],
        )?;
    }
    if p.max_concurrent == 0 {
        return Err(src.invalid("max_concurrent", "must be at least 1"));
    }
    if p.default_deadline.is_zero() {
        return Err(src.invalid("default_deadline", "must be longer than 0"));
    }
    if p.recheck_every.is_zero() {
        return Err(src.invalid("recheck_every", "must be longer than 0"));
    }
    if p.reconcile_every.is_zero() {
        return Err(src.invalid("reconcile_every", "must be longer than 0"));
    }
    if p.agent_silent_after < MIN_AGENT_SILENT_AFTER {
        return Err(src.invalid(
            "agent_silent_after",
            format!(
                "must be at least {}s (the agent writes its liveness record every quarter of it)",
                MIN_AGENT_SILENT_AFTER.as_secs()
            ),
        ));
    }
    if let Some(bad) = p
        .checkpoint_datasets
        .iter()
        .find(|d| d.is_empty() || d.trim_end_matches('*').contains('*'))
    {
        return Err(src.invalid(
            "checkpoint_datasets",
            format!("{bad:?} is not a dataset name or a prefix ending in a single `*`"),
        ));
    }
    Ok(p)
}

pub(crate) fn parse_demotion(
    src: &Source<'_>,
    tiers: &Tiers,
) -> Result<DemotionPolicy, PolicyError> {
    let p: DemotionPolicy = src.parse()?;
    if p.check_every.is_zero() {
        return Err(src.invalid("check_every", "must be longer than 0"));
    }
    if p.max_concurrent == 0 {
        return Err(src.invalid("max_concurrent", "must be at least 1"));
    }
    check_tier_ref(src, tiers, "target", &p.target, &[TierRole::Capacity])?;
    Ok(p)
}

pub(crate) fn parse_retention(
    src: &Source<'_>,
    tiers: &Tiers,
) -> Result<RetentionPolicy, PolicyError> {
    let p: RetentionPolicy = src.parse()?;
    let c = &p.checkpoints;
    if c.keep_last == 0 {
        return Err(src.invalid(
            "checkpoints.keep_last",
            "must be at least 1: the newest checkpoint is never expired",
        ));
    }
    if c.hot_keep_last == 0 {
        return Err(src.invalid(
            "checkpoints.hot_keep_last",
            "must be at least 1: the newest checkpoint stays on hot, a run resumes from it",
        ));
    }
    if c.hot_keep_last > c.keep_last {
        return Err(src.invalid(
            "checkpoints.hot_keep_last",
            format!(
                "{} is more than keep_last ({})",
                c.hot_keep_last, c.keep_last
            ),
        ));
    }
    check_tier_ref(
        src,
        tiers,
        "checkpoints.demote_to",
        &c.demote_to,
        &[TierRole::Capacity],
    )?;
    if p.expiry.unstaged_replica_after.is_zero() {
        return Err(src.invalid("expiry.unstaged_replica_after", "must be longer than 0"));
    }
    if let Some(offload) = &p.offload {
        check_tier_ref(
            src,
            tiers,
            "offload.tier",
            &offload.tier,
            &[TierRole::Hot, TierRole::Capacity],
        )?;
        if offload.deadline.is_zero() {
            return Err(src.invalid("offload.deadline", "must be longer than 0"));
        }
    }
    Ok(p)
}

pub(crate) fn parse_backup(src: &Source<'_>, tiers: &Tiers) -> Result<BackupPolicy, PolicyError> {
    let p: BackupPolicy = src.parse()?;
    check_tier_ref(src, tiers, "target", &p.target, &[TierRole::Backup])?;
    if p.select.is_empty() {
        return Err(src.invalid("select", "must select at least one kind of fact"));
    }
    if let Some(bad) = p
        .projects
        .iter()
        .find(|p| !stagehand_schemas::subject::is_subject_token(p))
    {
        return Err(src.invalid(
            "projects",
            format!("{bad:?} is not a project name (1-64 characters of [a-z0-9_-])"),
        ));
    }
    if p.drill_every.is_zero() {
        return Err(src.invalid("drill_every", "must be longer than 0"));
    }
    if p.drill_sample_files == 0 {
        return Err(src.invalid("drill_sample_files", "must be at least 1"));
    }
    if p.drill_sample_bytes.bytes() == 0 {
        return Err(src.invalid("drill_sample_bytes", "must be more than 0 bytes"));
    }
    if let Some(lock) = &p.object_lock {
        if !(1..=36_500).contains(&lock.days) {
            return Err(src.invalid(
                "object_lock.days",
                format!("{} is not between 1 and 36500", lock.days),
            ));
        }
        // check_tier_ref above found the target.
        if let Some(tier) = tiers.get(&p.target)
            && !matches!(tier.kind, crate::tiers::TierKind::S3(_))
        {
            return Err(src.invalid(
                "object_lock",
                format!(
                    "tier {:?} is a posix tier; Object Lock holds objects of an S3 backup tier only",
                    p.target
                ),
            ));
        }
    }
    Ok(p)
}

pub(crate) fn parse_priorities(src: &Source<'_>) -> Result<PriorityPolicy, PolicyError> {
    let p: PriorityPolicy = src.parse()?;
    for class in PriorityClass::ALL {
        let Some(policy) = p.classes.get(&class) else {
            return Err(src.invalid(
                format!("classes.{}", class.as_str()),
                "every class (checkpoint, stage, ingest, backup) must be declared",
            ));
        };
        if !(1..=1000).contains(&policy.weight) {
            return Err(src.invalid(
                format!("classes.{}.weight", class.as_str()),
                format!("must be between 1 and 1000, got {}", policy.weight),
            ));
        }
        if policy.max_bytes_per_sec.is_some_and(|b| b.bytes() == 0) {
            return Err(src.invalid(
                format!("classes.{}.max_bytes_per_sec", class.as_str()),
                "must be more than 0; leave it out for no limit",
            ));
        }
    }
    Ok(p)
}

#[cfg(test)]
mod promotion_tests {
    use super::*;

    fn policy(checkpoint_datasets: &[&str]) -> PromotionPolicy {
        PromotionPolicy {
            default_tier: "hot".into(),
            sources: vec!["capacity".into()],
            local_sources: vec!["hot".into(), "capacity".into()],
            max_concurrent: 2,
            default_deadline: Duration::from_secs(60),
            verify: VerifyMode::ReadBack,
            recheck_every: Duration::from_secs(30),
            reconcile_every: Duration::from_secs(300),
            agent_silent_after: Duration::from_secs(120),
            checkpoint_datasets: checkpoint_datasets.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn checkpoint_datasets_get_the_checkpoint_class_and_the_rest_stage() {
        let p = policy(&["ckpt-*", "restore-me"]);
        assert_eq!(p.priority_for("ckpt-run7"), PriorityClass::Checkpoint);
        assert_eq!(p.priority_for("restore-me"), PriorityClass::Checkpoint);
        assert_eq!(p.priority_for("restore-me-too"), PriorityClass::Stage);
        assert_eq!(p.priority_for("imagenet"), PriorityClass::Stage);
    }

    #[test]
    fn local_tiers_copy_from_their_own_sources() {
        let p = policy(&[]);
        assert_eq!(p.sources_for(TierRole::Local), ["hot", "capacity"]);
        assert_eq!(p.sources_for(TierRole::Hot), ["capacity"]);
        let mut no_local = p.clone();
        no_local.local_sources.clear();
        assert_eq!(no_local.sources_for(TierRole::Local), ["capacity"]);
    }
}
