//! `tiers.toml`: the named places data lives, their kind, role, failure domain and limits.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use stagehand_mover::SetAccess;
use stagehand_mover::s3::S3Config;

use crate::error::{PolicyError, Source};
use stagehand_config::ByteSize;

/// What a tier is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TierRole {
    /// Where raw uploads land; the ingest validator reads from here.
    Source,
    /// Durable, warm storage for validated and prepared versions.
    Capacity,
    /// The shared fast tier jobs read from.
    Hot,
    /// Node-local NVMe.
    Local,
    /// Independent recovery copies.
    Backup,
}

impl TierRole {
    pub fn as_str(self) -> &'static str {
        match self {
            TierRole::Source => "source",
            TierRole::Capacity => "capacity",
            TierRole::Hot => "hot",
            TierRole::Local => "local",
            TierRole::Backup => "backup",
        }
    }

    /// Hot and local tiers are bounded: they have a capacity, watermarks and quotas.
    pub fn is_bounded(self) -> bool {
        matches!(self, TierRole::Hot | TierRole::Local)
    }
}

/// Where a tier's bytes are.
#[derive(Debug, Clone, PartialEq)]
pub enum TierKind {
    /// A directory tree; `root` is absolute (a relative root in the file was resolved against
    /// `$STAGEHAND_HOME`).
    Posix { root: PathBuf },
    /// A bucket and prefix on an S3 endpoint.
    S3(S3Config),
}

/// Capacity, watermarks and quotas of a hot or local tier.
#[derive(Debug, Clone, PartialEq)]
pub struct TierLimits {
    /// Bytes Stagehand may place on the tier.
    pub capacity: u64,
    /// Fraction of `capacity` above which the demoter starts moving replicas down.
    pub high_watermark: f64,
    /// Fraction of `capacity` the demoter brings usage back down to.
    pub low_watermark: f64,
    /// Quota of a project not named in `quotas`; `None` means bounded only by capacity.
    pub default_quota: Option<u64>,
    /// Bytes each named project may hold on the tier.
    pub quotas: BTreeMap<String, u64>,
}

impl TierLimits {
    /// The quota that applies to `project`, if any.
    pub fn quota_for(&self, project: &str) -> Option<u64> {
        self.quotas.get(project).copied().or(self.default_quota)
    }

    pub fn high_watermark_bytes(&self) -> u64 {
        (self.capacity as f64 * self.high_watermark) as u64
    }

    pub fn low_watermark_bytes(&self) -> u64 {
        (self.capacity as f64 * self.low_watermark) as u64
    }
}

/// One tier, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct TierPolicy {
    pub name: String,
    pub kind: TierKind,
    pub role: TierRole,
    /// Tiers in the same failure domain can be lost together.
    pub failure_domain: String,
    /// Present exactly for hot and local tiers.
    pub limits: Option<TierLimits>,
    /// For a backup tier: the tiers it protects. Empty for other roles.
    pub protects: Vec<String>,
    /// For a posix hot or local tier: each project's group (by gid), from the file's
    /// `[groups]` table; what [`TierPolicy::set_access`] gives a project's staged sets. Empty
    /// for other tiers.
    pub groups: BTreeMap<String, u32>,
}

impl TierPolicy {
    /// Who may read a set of `project` published on this tier: on a posix hot or local tier —
    /// where jobs of every project read — read-only and readable by the project's group only
    /// (files 0440, folders 0550, the group of `[groups]`, or the writer's own when the project
    /// has none, so that only the services read it); `None` elsewhere. Source and capacity are
    /// read by the services alone (and uploaders' copies land on source as the uploader's
    /// files), backup by the backup copier; jobs never read them, and S3 tiers have no modes.
    pub fn set_access(&self, project: &str) -> Option<SetAccess> {
        let posix = matches!(self.kind, TierKind::Posix { .. });
        (posix && self.role.is_bounded())
            .then(|| SetAccess::read_only(self.groups.get(project).copied()))
    }
}

/// All tiers by name.
pub type Tiers = BTreeMap<String, TierPolicy>;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawTiersFile {
    tiers: BTreeMap<String, RawTier>,
    /// Each project's group: a name on this host or a numeric gid.
    #[serde(default)]
    groups: BTreeMap<String, RawGroup>,
}

/// A project's group as written: `"lab-a-data"` or `1234` (or `"1234"`).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum RawGroup {
    Gid(u32),
    Name(String),
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "lowercase")]
enum RawKind {
    Posix,
    S3,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTier {
    kind: RawKind,
    role: TierRole,
    failure_domain: String,
    // posix
    root: Option<PathBuf>,
    // s3
    endpoint: Option<String>,
    bucket: Option<String>,
    prefix: Option<String>,
    region: Option<String>,
    path_style: Option<bool>,
    profile: Option<String>,
    part_size: Option<ByteSize>,
    concurrency: Option<usize>,
    send_checksums: Option<bool>,
    allow_plaintext: Option<bool>,
    // hot / local
    capacity: Option<ByteSize>,
    high_watermark: Option<f64>,
    low_watermark: Option<f64>,
    quotas: Option<BTreeMap<String, ByteSize>>,
    // backup
    protects: Option<Vec<String>>,
}

/// Default watermarks when a bounded tier does not set them.
pub const DEFAULT_HIGH_WATERMARK: f64 = 0.85;
pub const DEFAULT_LOW_WATERMARK: f64 = 0.70;

pub(crate) fn parse(src: &Source<'_>, home: &Path) -> Result<Tiers, PolicyError> {
    let raw: RawTiersFile = src.parse()?;
    if raw.tiers.is_empty() {
        return Err(src.invalid("tiers", "no tier is declared"));
    }
    let mut tiers = Tiers::new();
    for (name, tier) in raw.tiers {
        let parsed = parse_tier(src, home, &name, tier)?;
        tiers.insert(name, parsed);
    }
    if !tiers.values().any(|t| t.role == TierRole::Source) {
        return Err(src.invalid(
            "tiers",
            "no tier has role \"source\"; ingest needs one to read uploads from",
        ));
    }
    check_roots_disjoint(src, &tiers)?;
    check_backups(src, &mut tiers)?;
    let groups = parse_groups(src, raw.groups)?;
    for tier in tiers.values_mut() {
        if tier.role.is_bounded() && matches!(tier.kind, TierKind::Posix { .. }) {
            tier.groups = groups.clone();
        }
    }
    Ok(tiers)
}

/// The `[groups]` table: each key a project name, each value a group that exists on this host
/// (resolved to its gid now, so a typo stops the service at start, not a copy later) or a
/// numeric gid, taken as given (a directory service may know it by number only).
fn parse_groups(
    src: &Source<'_>,
    raw: BTreeMap<String, RawGroup>,
) -> Result<BTreeMap<String, u32>, PolicyError> {
    let mut groups = BTreeMap::new();
    for (project, group) in raw {
        let key = format!("groups.{project}");
        if !stagehand_schemas::subject::is_subject_token(&project) {
            return Err(src.invalid(
                key,
                format!("{project:?} is not a project name (1-64 characters of [a-z0-9_-])"),
            ));
        }
        let gid = match group {
            RawGroup::Gid(gid) => gid,
            RawGroup::Name(name)
                if !name.is_empty() && name.bytes().all(|b| b.is_ascii_digit()) =>
            {
                name.parse().map_err(|_| {
                    src.invalid(
                        key.as_str(),
                        format!("{name:?} is not a gid (0-4294967295)"),
                    )
                })?
            }
            RawGroup::Name(name) => match gid_of(&name) {
                Ok(Some(gid)) => gid,
                Ok(None) => {
                    return Err(src.invalid(
                        key,
                        format!(
                            "group {name:?} does not exist on this host (`getent group {name}`): \
                             create it (`groupadd {name}`) or give its numeric gid"
                        ),
                    ));
                }
                Err(e) => {
                    return Err(src.invalid(key, format!("cannot look up group {name:?}: {e}")));
                }
            },
        };
        groups.insert(project, gid);
    }
    Ok(groups)
}

/// The gid of the group `name` on this host (through NSS: `/etc/group`, LDAP, …), `None` when
/// there is none.
fn gid_of(name: &str) -> std::io::Result<Option<u32>> {
    let Ok(cname) = std::ffi::CString::new(name) else {
        return Ok(None);
    };
    let mut buf = vec![0 as libc::c_char; 16 * 1024];
    loop {
        // SAFETY: an all-zero `group` is a valid value of this plain C struct.
        let mut group: libc::group = unsafe { std::mem::zeroed() };
        let mut found: *mut libc::group = std::ptr::null_mut();
        // SAFETY: every pointer is to a live value of the type the call expects; `buf` is
        // `buf.len()` bytes long and outlives the call; the result is read only through
        // `group`'s `gr_gid`, which holds no pointer into `buf`.
        let rc = unsafe {
            libc::getgrnam_r(
                cname.as_ptr(),
                &mut group,
                buf.as_mut_ptr(),
                buf.len(),
                &mut found,
            )
        };
        match rc {
            0 if found.is_null() => return Ok(None),
            0 => return Ok(Some(group.gr_gid)),
            libc::ERANGE if buf.len() < (1 << 24) => buf.resize(buf.len() * 4, 0),
            libc::ENOENT | libc::ESRCH | libc::EBADF | libc::EPERM => return Ok(None),
            e => return Err(std::io::Error::from_raw_os_error(e)),
        }
    }
}

fn parse_tier(
    src: &Source<'_>,
    home: &Path,
    name: &str,
    raw: RawTier,
) -> Result<TierPolicy, PolicyError> {
    let key = |field: &str| format!("tiers.{name}.{field}");
    if !stagehand_schemas::subject::is_subject_token(name) {
        return Err(src.invalid(
            format!("tiers.{name}"),
            format!("tier name {name:?} must be 1-64 characters of [a-z0-9_-]"),
        ));
    }
    if raw.failure_domain.trim().is_empty() {
        return Err(src.invalid(key("failure_domain"), "must not be empty"));
    }
    let refuse = |present: bool, field: &str, applies: &str| {
        if present {
            Err(src.invalid(key(field), format!("`{field}` applies only to {applies}")))
        } else {
            Ok(())
        }
    };

    let kind = match raw.kind {
        RawKind::Posix => {
            for (present, field) in [
                (raw.endpoint.is_some(), "endpoint"),
                (raw.bucket.is_some(), "bucket"),
                (raw.prefix.is_some(), "prefix"),
                (raw.region.is_some(), "region"),
                (raw.path_style.is_some(), "path_style"),
                (raw.profile.is_some(), "profile"),
                (raw.part_size.is_some(), "part_size"),
                (raw.concurrency.is_some(), "concurrency"),
                (raw.send_checksums.is_some(), "send_checksums"),
                (raw.allow_plaintext.is_some(), "allow_plaintext"),
            ] {
                refuse(present, field, "s3 tiers")?;
            }
            let root = raw
                .root
                .ok_or_else(|| src.invalid(key("root"), "a posix tier needs `root`"))?;
            if root.as_os_str().is_empty() {
                return Err(src.invalid(key("root"), "must not be empty"));
            }
            TierKind::Posix {
                root: if root.is_absolute() {
                    root
                } else {
                    home.join(root)
                },
            }
        }
        RawKind::S3 => {
            refuse(raw.root.is_some(), "root", "posix tiers")?;
            let bucket = raw
                .bucket
                .ok_or_else(|| src.invalid(key("bucket"), "an s3 tier needs `bucket`"))?;
            let mut config = S3Config::new(bucket, raw.prefix.unwrap_or_default());
            // Bytes and signed requests travel unencrypted over http://: only where the tier
            // says the network is trusted.
            if let Some(endpoint) = &raw.endpoint
                && endpoint
                    .get(..7)
                    .is_some_and(|scheme| scheme.eq_ignore_ascii_case("http://"))
                && raw.allow_plaintext != Some(true)
            {
                return Err(src.invalid(
                    key("endpoint"),
                    format!(
                        "{endpoint:?} is plaintext http: use https://, or set \
                         `allow_plaintext = true` on tier {name} for a network you trust"
                    ),
                ));
            }
            config.endpoint = raw.endpoint;
            if let Some(region) = raw.region {
                config.region = region;
            }
            if let Some(path_style) = raw.path_style {
                config.path_style = path_style;
            }
            config.profile = raw.profile;
            if let Some(part_size) = raw.part_size {
                config.part_size = part_size.bytes();
                config.multipart_threshold = part_size.bytes();
            }
            if let Some(concurrency) = raw.concurrency {
                config.concurrency = concurrency;
            }
            if let Some(send_checksums) = raw.send_checksums {
                config.send_checksums = send_checksums;
            }
            // The mover's own check names the field in `path`.
            config
                .validate(name)
                .map_err(|err| src.invalid(key(&err.path), err.detail))?;
            TierKind::S3(config)
        }
    };

    let limits = if raw.role.is_bounded() {
        let capacity = raw.capacity.ok_or_else(|| {
            src.invalid(
                key("capacity"),
                format!("a {} tier needs `capacity`", raw.role.as_str()),
            )
        })?;
        if capacity.bytes() == 0 {
            return Err(src.invalid(key("capacity"), "must be more than 0 bytes"));
        }
        let high = raw.high_watermark.unwrap_or(DEFAULT_HIGH_WATERMARK);
        let low = raw.low_watermark.unwrap_or(DEFAULT_LOW_WATERMARK);
        if high.is_nan() || high <= 0.0 || high > 1.0 {
            return Err(src.invalid(
                key("high_watermark"),
                format!("must be a fraction in (0, 1], got {high}"),
            ));
        }
        if low.is_nan() || low <= 0.0 || low >= high {
            return Err(src.invalid(
                key("low_watermark"),
                format!("must be a fraction above 0 and below high_watermark ({high}), got {low}"),
            ));
        }
        let mut default_quota = None;
        let mut quotas = BTreeMap::new();
        for (project, quota) in raw.quotas.unwrap_or_default() {
            let quota_key = key(&format!("quotas.{project}"));
            if quota.bytes() > capacity.bytes() {
                return Err(src.invalid(
                    quota_key,
                    format!("quota {quota} is larger than the tier's capacity {capacity}"),
                ));
            }
            if project == "default" {
                default_quota = Some(quota.bytes());
            } else if stagehand_schemas::subject::is_subject_token(&project) {
                quotas.insert(project, quota.bytes());
            } else {
                return Err(src.invalid(
                    quota_key,
                    format!("{project:?} is not a project name (1-64 characters of [a-z0-9_-]) nor \"default\""),
                ));
            }
        }
        Some(TierLimits {
            capacity: capacity.bytes(),
            high_watermark: high,
            low_watermark: low,
            default_quota,
            quotas,
        })
    } else {
        let applies = "hot and local tiers";
        refuse(raw.capacity.is_some(), "capacity", applies)?;
        refuse(raw.high_watermark.is_some(), "high_watermark", applies)?;
        refuse(raw.low_watermark.is_some(), "low_watermark", applies)?;
        refuse(raw.quotas.is_some(), "quotas", applies)?;
        None
    };

    if raw.role != TierRole::Backup {
        refuse(raw.protects.is_some(), "protects", "backup tiers")?;
    }
    Ok(TierPolicy {
        name: name.to_owned(),
        kind,
        role: raw.role,
        failure_domain: raw.failure_domain,
        limits,
        // Filled in by `check_backups` (the default needs every tier).
        protects: raw.protects.unwrap_or_default(),
        // Filled in from the file's `[groups]` once every tier is known.
        groups: BTreeMap::new(),
    })
}

/// Two posix tiers must not share or nest their roots: one tier's writes would appear in the
/// other's namespace.
fn check_roots_disjoint(src: &Source<'_>, tiers: &Tiers) -> Result<(), PolicyError> {
    let roots: Vec<(&str, &Path)> = tiers
        .values()
        .filter_map(|t| match &t.kind {
            TierKind::Posix { root } => Some((t.name.as_str(), root.as_path())),
            TierKind::S3(_) => None,
        })
        .collect();
    for (i, (name, root)) in roots.iter().enumerate() {
        for (other, other_root) in &roots[i + 1..] {
            if root.starts_with(other_root) || other_root.starts_with(root) {
                return Err(src.invalid(
                    format!("tiers.{other}.root"),
                    format!(
                        "{} overlaps the root of tier {name:?} ({}); tier roots must be disjoint",
                        other_root.display(),
                        root.display()
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// A backup tier protects the tiers it names (by default every tier that is not a backup), and
/// must not share a failure domain with any of them.
fn check_backups(src: &Source<'_>, tiers: &mut Tiers) -> Result<(), PolicyError> {
    let all_protectable: Vec<String> = tiers
        .values()
        .filter(|t| t.role != TierRole::Backup)
        .map(|t| t.name.clone())
        .collect();
    let backups: Vec<String> = tiers
        .values()
        .filter(|t| t.role == TierRole::Backup)
        .map(|t| t.name.clone())
        .collect();
    for backup in backups {
        let explicit = !tiers[&backup].protects.is_empty();
        let protects = if explicit {
            tiers[&backup].protects.clone()
        } else {
            all_protectable.clone()
        };
        let domain = tiers[&backup].failure_domain.clone();
        for protected in &protects {
            let Some(tier) = tiers.get(protected) else {
                return Err(src.invalid(
                    format!("tiers.{backup}.protects"),
                    format!("names tier {protected:?}, which is not declared"),
                ));
            };
            if tier.role == TierRole::Backup {
                return Err(src.invalid(
                    format!("tiers.{backup}.protects"),
                    format!("names {protected:?}, itself a backup tier"),
                ));
            }
            if tier.failure_domain == domain {
                return Err(src.invalid(
                    format!("tiers.{backup}.failure_domain"),
                    format!(
                        "backup tier {backup:?} shares failure domain {domain:?} with tier {protected:?} it protects; \
                         a backup must survive the loss of what it protects"
                    ),
                ));
            }
        }
        if let Some(tier) = tiers.get_mut(&backup) {
            tier.protects = protects;
        }
    }
    Ok(())
}
