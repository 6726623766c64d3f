//! Recursive copies between local paths and S3: what `stagehand cp` runs, as a plain library
//! call (options in, summary out, progress through a shared [`Progress`]). The command's
//! argument parsing, progress bar and printing live in the CLI crate; services never compile
//! them.
//!
//! SRC and DST are local paths or `s3://bucket/prefix` (endpoint from `STAGEHAND_S3_ENDPOINT`
//! or `AWS_ENDPOINT_URL`, credentials from the `AWS_*` environment). Without a manifest every
//! source file is hashed while it is copied and the destination is proven against that hash;
//! with a manifest exactly its entries are copied and each is verified against its recorded
//! size and SHA-256. A destination already holding the right bytes is skipped, so a rerun
//! after a crash finishes the job; temp files a killed run left behind are removed by the
//! rerun (see [`crate::posix`]).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::engine::EngineChoice;
use crate::error::{ErrorKind, Side, TransferError};
use crate::mover::{Mover, MoverConfig};
use crate::posix::{CommitMode, PosixTier, is_temp_name};
use crate::s3::S3Tier;
use crate::tier::Tier;
use crate::transfer::{CopyOptions, FileRef, Priority, Progress, VerifyMode};
use stagehand_schemas::Retryable;
use stagehand_schemas::layout::is_staging_folder_name;

/// What to copy and how: the options of `stagehand cp`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CpOptions {
    /// Source: a local file or directory, or `s3://bucket/prefix`.
    pub src: String,
    /// Destination: a local directory (or file name for a single file), or
    /// `s3://bucket/prefix`.
    pub dst: String,
    /// Copy a directory (or S3 prefix) and everything beneath it.
    pub recursive: bool,
    /// Copy exactly the entries of this manifest (lines `path<TAB>size<TAB>sha256`, paths
    /// relative to `src`) and verify each against it.
    pub manifest: Option<PathBuf>,
    /// posix → posix engine.
    pub engine: EngineChoice,
    /// Files in flight at once.
    pub concurrency: usize,
    /// With a manifest: trust its hashes for files already at the destination with the
    /// right size, and allow reflink / `copy_file_range` without hashing the source.
    pub trust_recorded_hash: bool,
    /// What proves the landed bytes.
    pub verify: VerifyMode,
    /// Limit reads to this many bytes per second.
    pub bytes_per_second: Option<u64>,
    /// Publish every file with its own `fdatasync` and directory `fsync` instead of in
    /// batches.
    pub durable_each: bool,
    /// Priority class of the copies.
    pub priority: Priority,
    /// Publish the whole tree at once (see [`Mover::copy_set`]): the destination folder
    /// appears complete or not at all (on S3: a completion marker is written last), and a
    /// rerun after a crash resumes the hidden staging folder. A destination that already
    /// exists is left as it is and every file reported skipped (the rerun of a finished copy).
    pub atomic: bool,
}

impl Default for CpOptions {
    fn default() -> Self {
        CpOptions {
            src: String::new(),
            dst: String::new(),
            recursive: false,
            manifest: None,
            engine: EngineChoice::Auto,
            concurrency: MoverConfig::default().concurrency,
            trust_recorded_hash: false,
            verify: VerifyMode::HashedInFlight,
            bytes_per_second: None,
            durable_each: false,
            priority: Priority::Ingest,
            atomic: false,
        }
    }
}

/// Why a copy could not start (a file that failed is in [`CpSummary::failures`] instead).
#[derive(Debug, thiserror::Error)]
pub enum CpError {
    /// The options do not describe a copy (a directory without `recursive`, a bad location).
    #[error("{0}")]
    Usage(String),
    /// The manifest could not be read or has a bad line.
    #[error("manifest {path}: {detail}")]
    Manifest { path: PathBuf, detail: String },
    /// A local path could not be inspected or created.
    #[error("{what} {path}: {source}")]
    Local {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A tier could not be opened or listed.
    #[error(transparent)]
    Transfer(#[from] TransferError),
}

impl Retryable for CpError {
    /// Whether running the same copy again later can succeed without anyone changing anything.
    fn is_retryable(&self) -> bool {
        match self {
            CpError::Transfer(e) => e.is_retryable(),
            CpError::Local { source, .. } => !matches!(
                source.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::PermissionDenied
            ),
            CpError::Usage(_) | CpError::Manifest { .. } => false,
        }
    }
}

fn local(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> CpError {
    let path = path.to_owned();
    move |source| CpError::Local { what, path, source }
}

/// One failed file in the summary.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CpFailure {
    pub path: String,
    pub kind: String,
    pub retryable: bool,
    pub error: String,
}

/// What a copy did.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CpSummary {
    pub files: u64,
    pub copied: u64,
    pub skipped: u64,
    pub failed: u64,
    pub bytes: u64,
    pub seconds: f64,
    pub bytes_per_second: f64,
    pub files_per_second: f64,
    pub engine: String,
    /// Stale temp files of killed copies that this run removed from the destination.
    pub stale_removed: u64,
    pub failures: Vec<CpFailure>,
}

impl CpSummary {
    /// The process exit code: 0 when every file is in place, 1 when any failed.
    pub fn exit_code(&self) -> i32 {
        i32::from(self.failed > 0)
    }

    /// The human summary (also what goes to stdout without `--json`).
    pub fn to_text(&self) -> String {
        let mut out = format!(
            "{} files: {} copied, {} skipped, {} failed; {} in {:.2} s ({}/s, {:.0} files/s); engine {}\n",
            self.files,
            self.copied,
            self.skipped,
            self.failed,
            human_bytes(self.bytes as f64),
            self.seconds,
            human_bytes(self.bytes_per_second),
            self.files_per_second,
            self.engine
        );
        for f in &self.failures {
            out.push_str(&format!("FAILED {}: {}\n", f.path, f.error));
        }
        out
    }
}

fn human_bytes(b: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.2} {}", UNITS[u])
}

enum Endpoint {
    Local(PathBuf),
    S3 { bucket: String, prefix: String },
}

fn parse_endpoint(s: &str) -> Result<Endpoint, CpError> {
    if let Some(rest) = s.strip_prefix("s3://") {
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() {
            return Err(CpError::Usage(format!(
                "{s:?}: an S3 location is s3://bucket/prefix"
            )));
        }
        Ok(Endpoint::S3 {
            bucket: bucket.to_owned(),
            prefix: prefix.trim_end_matches('/').to_owned(),
        })
    } else if s.is_empty() {
        Err(CpError::Usage("an empty path names nothing".into()))
    } else {
        Ok(Endpoint::Local(PathBuf::from(s)))
    }
}

/// Reads a manifest: one `path\tsize\tsha256` per line (the contract's one line parser,
/// [`stagehand_schemas::manifest::parse_line`]); blank lines are ignored. A copy trusts no
/// entry it cannot act on, so each is also checked ([`FileRef::check`]) and listed once.
pub fn read_manifest(path: &Path) -> Result<Vec<FileRef>, CpError> {
    let bad = |detail: String| CpError::Manifest {
        path: path.to_owned(),
        detail,
    };
    let text = std::fs::read(path).map_err(|e| bad(format!("cannot read it: {e}")))?;
    let mut files = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (n, line) in text.split(|b| *b == b'\n').enumerate() {
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let line_no = n + 1;
        let file = stagehand_schemas::manifest::parse_line(line)
            .map_err(|e| bad(format!("line {line_no}: {e}")))?;
        file.check()
            .map_err(|e| bad(format!("line {line_no}: {e}")))?;
        if !seen.insert(file.path.clone()) {
            return Err(bad(format!(
                "line {line_no}: {:?} is listed twice",
                file.path
            )));
        }
        files.push(file);
    }
    Ok(files)
}

/// Walks a local directory: every regular file beneath it (symlinks are listed too, so the
/// confined open refuses them by name instead of silently skipping them).
fn walk_local(root: &Path) -> Result<Vec<FileRef>, CpError> {
    let mut files = Vec::new();
    for entry in walkdir::WalkDir::new(root)
        .follow_links(false)
        .sort_by_file_name()
        .into_iter()
        // A set being staged inside the source is not part of it.
        .filter_entry(|e| !is_staging_folder_name(&e.file_name().to_string_lossy()))
    {
        let entry = entry.map_err(|e| CpError::Local {
            what: "walking",
            path: root.to_owned(),
            source: e.into(),
        })?;
        if entry.file_type().is_dir() {
            continue;
        }
        if is_temp_name(&entry.file_name().to_string_lossy()) {
            continue;
        }
        let rel = entry
            .path()
            .strip_prefix(root)
            .map_err(|_| CpError::Usage(format!("walked outside {}", root.display())))?;
        let rel = rel
            .to_str()
            .ok_or_else(|| {
                CpError::Usage(format!("{} is not valid UTF-8", entry.path().display()))
            })?
            .to_owned();
        let size = if entry.file_type().is_file() {
            entry.metadata().map(|m| m.len()).unwrap_or(0)
        } else {
            0
        };
        files.push(FileRef::new(rel, size, String::new()));
    }
    Ok(files)
}

fn utf8_name(path: &Path) -> Result<String, CpError> {
    path.file_name()
        .and_then(|n| n.to_str())
        .map(str::to_owned)
        .ok_or_else(|| CpError::Usage(format!("{} has no UTF-8 file name", path.display())))
}

fn parent_or_dot(path: &Path) -> &Path {
    path.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// Runs a copy and returns what it did; `progress` moves as bytes land (a progress bar reads
/// it). A file that fails is in the summary; `Err` means the copy could not start.
pub async fn run_cp(opts: &CpOptions, progress: &Progress) -> Result<CpSummary, CpError> {
    let src_ep = parse_endpoint(&opts.src)?;
    let dst_ep = parse_endpoint(&opts.dst)?;
    let manifest = match &opts.manifest {
        Some(p) => Some(read_manifest(p)?),
        None => None,
    };

    // Work out the source tier and the relative paths to copy.
    let (src, mut files, single_name) = match &src_ep {
        Endpoint::Local(path) => {
            let meta = std::fs::metadata(path).map_err(local("source", path))?;
            if meta.is_dir() {
                if !opts.recursive && manifest.is_none() {
                    return Err(CpError::Usage(format!(
                        "{} is a directory: copy it recursively (or by a manifest)",
                        path.display()
                    )));
                }
                let tier = PosixTier::open("src", path)?;
                let files = match &manifest {
                    Some(m) => m.clone(),
                    None => walk_local(path)?,
                };
                (Tier::Posix(tier), files, None)
            } else {
                if manifest.is_some() {
                    return Err(CpError::Usage(
                        "a manifest needs the source to be the directory its paths are relative to"
                            .into(),
                    ));
                }
                let name = utf8_name(path)?;
                let tier = PosixTier::open("src", parent_or_dot(path))?;
                (
                    Tier::Posix(tier),
                    vec![FileRef::new(name.clone(), meta.len(), String::new())],
                    Some(name),
                )
            }
        }
        Endpoint::S3 { bucket, prefix } => {
            if opts.recursive || manifest.is_some() {
                let tier = S3Tier::from_env("src", bucket.clone(), prefix.clone())?;
                let files = match &manifest {
                    Some(m) => m.clone(),
                    None => tier
                        .list("")
                        .await?
                        .into_iter()
                        .map(|(rel, size)| FileRef::new(rel, size, String::new()))
                        .collect(),
                };
                (Tier::S3(tier), files, None)
            } else {
                let (parent, name) = prefix.rsplit_once('/').unwrap_or(("", prefix.as_str()));
                if name.is_empty() {
                    return Err(CpError::Usage(format!(
                        "{}: name an object, or copy recursively",
                        opts.src
                    )));
                }
                let tier = S3Tier::from_env("src", bucket.clone(), parent)?;
                let size = tier
                    .stat_side(name, Side::Source)
                    .await?
                    .ok_or_else(|| CpError::Usage(format!("{} does not exist", opts.src)))?
                    .size;
                (
                    Tier::S3(tier),
                    vec![FileRef::new(name, size, String::new())],
                    Some(name.to_owned()),
                )
            }
        }
    };

    if opts.atomic {
        if single_name.is_some() {
            return Err(CpError::Usage(
                "an atomic copy publishes a directory or prefix; a single file is atomic anyway"
                    .into(),
            ));
        }
        return copy_tree_atomic(opts, &src, &dst_ep, files, manifest.is_some(), progress).await;
    }

    // The destination tier; a single file may be renamed like `cp a b`.
    let dst = match &dst_ep {
        Endpoint::Local(path) => {
            let root = match &single_name {
                Some(_) if !path.is_dir() && !opts.dst.ends_with('/') => {
                    files[0].path = utf8_name(path)?;
                    parent_or_dot(path).to_owned()
                }
                _ => path.clone(),
            };
            // The destination root is the caller's own path (not a shared tier's), created as
            // `mkdir -p` would; everything beneath it is created confined.
            std::fs::create_dir_all(&root).map_err(local("creating destination", &root))?;
            Tier::Posix(PosixTier::open("dst", &root)?)
        }
        Endpoint::S3 { bucket, prefix } => {
            Tier::S3(S3Tier::from_env("dst", bucket.clone(), prefix.clone())?)
        }
    };
    // A renamed single file: the source keeps its own name.
    let src_names: Option<String> = single_name.filter(|n| *n != files[0].path);

    let copy = copy_options(opts, manifest.is_some());
    let mover = mover_for(opts)?;

    let report = if let Some(src_name) = src_names {
        // `cp dir/a other/b`: the source is read under its own name, published as `b`.
        copy_renamed(&mover, &src, &dst, &src_name, &files[0], &copy, progress).await
    } else {
        mover.copy_all(&src, &dst, &files, &copy, progress).await
    };

    let secs = report.elapsed.as_secs_f64().max(1e-9);
    Ok(CpSummary {
        files: report.results.len() as u64,
        copied: report.files_copied,
        skipped: report.files_skipped,
        failed: report.files_failed,
        bytes: report.bytes_copied,
        seconds: secs,
        bytes_per_second: report.bytes_copied as f64 / secs,
        files_per_second: (report.files_copied + report.files_skipped) as f64 / secs,
        engine: report.engine.to_owned(),
        stale_removed: match &dst {
            Tier::Posix(d) => d.stale_removed().files_removed,
            Tier::S3(_) => 0,
        },
        failures: report
            .failures()
            .map(|(path, e)| CpFailure {
                path: path.to_owned(),
                kind: format!("{:?}", e.kind),
                retryable: e.is_retryable(),
                error: e.to_string(),
            })
            .collect(),
    })
}

fn copy_options(opts: &CpOptions, have_manifest: bool) -> CopyOptions {
    CopyOptions {
        priority: opts.priority,
        trust_recorded_hash: opts.trust_recorded_hash && have_manifest,
        verify_destination: opts.verify,
        expected_hash_unknown: !have_manifest,
    }
}

fn mover_for(opts: &CpOptions) -> Result<Mover, TransferError> {
    Mover::new(MoverConfig {
        engine: opts.engine,
        concurrency: opts.concurrency.max(1),
        commit_mode: if opts.durable_each {
            CommitMode::Durable
        } else {
            CommitMode::Batched
        },
        bytes_per_second: opts.bytes_per_second,
        ..MoverConfig::default()
    })
}

/// `cp --atomic`: the tree goes through [`Mover::copy_set`] and appears under the
/// destination's name only when all of it is there.
async fn copy_tree_atomic(
    opts: &CpOptions,
    src: &Tier,
    dst_ep: &Endpoint,
    files: Vec<FileRef>,
    have_manifest: bool,
    progress: &Progress,
) -> Result<CpSummary, CpError> {
    let (dst, name) = match dst_ep {
        Endpoint::Local(path) => {
            let name = utf8_name(path)?;
            let parent = parent_or_dot(path);
            std::fs::create_dir_all(parent).map_err(local("creating destination", parent))?;
            (Tier::Posix(PosixTier::open("dst", parent)?), name)
        }
        Endpoint::S3 { bucket, prefix } => {
            let (parent, name) = prefix.rsplit_once('/').unwrap_or(("", prefix.as_str()));
            if name.is_empty() {
                return Err(CpError::Usage(
                    "an atomic copy to S3 needs a prefix to publish under (s3://bucket/name)"
                        .into(),
                ));
            }
            (
                Tier::S3(S3Tier::from_env("dst", bucket.clone(), parent)?),
                name.to_owned(),
            )
        }
    };
    let mover = mover_for(opts)?;
    let set = crate::set::SetCopy {
        src_prefix: String::new(),
        dst_prefix: name,
        opts: copy_options(opts, have_manifest),
        chunk_files: 0,
        totals: Some((files.len() as u64, files.iter().map(|f| f.size).sum())),
    };
    let count = files.len() as u64;
    let started = std::time::Instant::now();
    let result = mover
        .copy_set(
            src,
            &dst,
            &set,
            futures::stream::iter(files),
            progress,
            &tokio_util::sync::CancellationToken::new(),
            |_| {},
        )
        .await;
    let secs = started.elapsed().as_secs_f64().max(1e-9);
    let engine = mover.path_name(src, &dst).to_owned();
    Ok(match result {
        Ok(r) => CpSummary {
            files: count,
            copied: r.copied,
            skipped: if r.existed { count } else { r.skipped },
            failed: 0,
            bytes: r.bytes_copied,
            seconds: secs,
            bytes_per_second: r.bytes_copied as f64 / secs,
            files_per_second: (r.copied + r.skipped) as f64 / secs,
            engine,
            stale_removed: 0,
            failures: Vec::new(),
        },
        Err(e) => CpSummary {
            files: count,
            copied: 0,
            skipped: 0,
            failed: 1,
            bytes: 0,
            seconds: secs,
            bytes_per_second: 0.0,
            files_per_second: 0.0,
            engine,
            stale_removed: 0,
            failures: vec![CpFailure {
                path: e.path.clone(),
                kind: format!("{:?}", e.kind),
                retryable: e.is_retryable(),
                error: e.to_string(),
            }],
        },
    })
}

/// Copies one file whose destination name differs from its source name.
async fn copy_renamed(
    mover: &Mover,
    src: &Tier,
    dst: &Tier,
    src_name: &str,
    dst_file: &FileRef,
    opts: &CopyOptions,
    progress: &Progress,
) -> crate::mover::BatchReport {
    let started = std::time::Instant::now();
    progress.add_total(1, dst_file.size);
    let file = FileRef::new(src_name, dst_file.size, dst_file.sha256.clone());
    let result = match (src, dst) {
        (Tier::Posix(s), Tier::Posix(d)) => {
            mover
                .copy_posix_renamed(s, d, &file, &dst_file.path, opts, progress)
                .await
        }
        _ => Err(TransferError::new(
            ErrorKind::Config,
            Side::Destination,
            dst.name(),
            &dst_file.path,
            "copying a single object under a new name is supported between local paths only; name a destination directory",
        )),
    };
    match &result {
        Ok(crate::transfer::CopyOutcome::Skipped { .. }) => progress.file_skipped(),
        Ok(_) => progress.file_done(),
        Err(_) => progress.file_failed(),
    }
    let (copied, skipped, failed, bytes) = match &result {
        Ok(crate::transfer::CopyOutcome::Copied { bytes, .. }) => (1, 0, 0, *bytes),
        Ok(crate::transfer::CopyOutcome::Skipped { .. }) => (0, 1, 0, 0),
        Err(_) => (0, 0, 1, 0),
    };
    crate::mover::BatchReport {
        results: vec![crate::mover::FileResult {
            path: dst_file.path.clone(),
            result,
        }],
        files_copied: copied,
        files_skipped: skipped,
        files_failed: failed,
        bytes_copied: bytes,
        engine: mover.path_name(src, dst),
        elapsed: started.elapsed(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manifest_lines_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.tsv");
        let sha = crate::transfer::EMPTY_SHA256;
        std::fs::write(&p, format!("a/b\t0\t{sha}\n\nc\t0\t{sha}\n")).unwrap();
        assert_eq!(read_manifest(&p).unwrap().len(), 2);
        std::fs::write(&p, format!("../x\t0\t{sha}\n")).unwrap();
        let e = read_manifest(&p).unwrap_err();
        assert!(e.to_string().contains("line 1"), "{e}");
        std::fs::write(&p, format!("a\t0\t{sha}\na\t0\t{sha}\n")).unwrap();
        assert!(read_manifest(&p).unwrap_err().to_string().contains("twice"));
    }
}
