//! `stagehand cp SRC DST`: the mover as a command people run on their own.
//!
//! SRC and DST are local paths or `s3://bucket/prefix` (endpoint from `STAGEHAND_S3_ENDPOINT`
//! or `AWS_ENDPOINT_URL`, credentials from the `AWS_*` environment). Without a manifest every
//! source file is hashed while it is copied and the destination is proven against that hash;
//! with `--manifest FILE` exactly the manifest's entries are copied and each is verified
//! against its recorded size and SHA-256. A destination already holding the right bytes is
//! skipped, so a rerun after a crash finishes the job. The command's logic lives here so the
//! `stagehand` CLI and tests call the same function.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use serde::Serialize;

use crate::engine::EngineChoice;
use crate::mover::{Mover, MoverConfig};
use crate::posix::{CommitMode, PosixTier, is_temp_name};
use crate::s3::S3Tier;
use crate::tier::Tier;
use crate::transfer::{CopyOptions, FileRef, Priority, Progress, VerifyDestination};

/// Arguments of `stagehand cp`.
#[derive(Debug, Clone, clap::Args)]
pub struct CpArgs {
    /// Source: a local file or directory, or s3://bucket/prefix.
    pub src: String,
    /// Destination: a local directory (or file name for a single file), or s3://bucket/prefix.
    pub dst: String,
    /// Copy a directory (or S3 prefix) and everything beneath it.
    #[arg(short, long)]
    pub recursive: bool,
    /// Copy exactly the entries of this manifest (lines `path<TAB>size<TAB>sha256`, paths
    /// relative to SRC) and verify each against it.
    #[arg(long, value_name = "FILE")]
    pub manifest: Option<PathBuf>,
    /// Print the summary as JSON.
    #[arg(long)]
    pub json: bool,
    /// posix → posix engine.
    #[arg(long, value_enum, default_value_t = EngineChoice::Auto)]
    pub engine: EngineChoice,
    /// Files in flight at once.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// With --manifest: trust its hashes for files already at the destination with the right
    /// size, and allow reflink / copy_file_range without hashing the source.
    #[arg(long)]
    pub trust_recorded_hash: bool,
    /// Read every landed file back and hash it again before publishing it.
    #[arg(long)]
    pub read_back: bool,
    /// Limit reads to this many bytes per second (suffixes K, M, G: powers of 1024).
    #[arg(long, value_name = "RATE", value_parser = parse_bytes)]
    pub bwlimit: Option<u64>,
    /// Publish every file with its own fdatasync and directory fsync instead of in batches.
    #[arg(long)]
    pub durable_each: bool,
    /// Priority class of the copies.
    #[arg(long, value_enum, default_value_t = PriorityArg::Ingest)]
    pub priority: PriorityArg,
    /// Never show a progress bar (it is shown only when stderr is a terminal).
    #[arg(long)]
    pub quiet: bool,
}

/// [`Priority`] as a command-line value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PriorityArg {
    Checkpoint,
    Stage,
    Ingest,
    Backup,
}

impl From<PriorityArg> for Priority {
    fn from(p: PriorityArg) -> Priority {
        match p {
            PriorityArg::Checkpoint => Priority::Checkpoint,
            PriorityArg::Stage => Priority::Stage,
            PriorityArg::Ingest => Priority::Ingest,
            PriorityArg::Backup => Priority::Backup,
        }
    }
}

/// `1048576`, `64K`, `100M`, `2G`.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mult) = match s.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&s[..s.len() - 1], 1u64 << 10),
        Some('M') => (&s[..s.len() - 1], 1 << 20),
        Some('G') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a byte count like 1048576, 64K, 100M or 2G"))?;
    n.checked_mul(mult)
        .filter(|n| *n > 0)
        .ok_or_else(|| format!("{s:?} is out of range"))
}

/// One failed file in the summary.
#[derive(Debug, Clone, Serialize)]
pub struct CpFailure {
    pub path: String,
    pub kind: String,
    pub retryable: bool,
    pub error: String,
}

/// What `stagehand cp` did.
#[derive(Debug, Clone, Serialize)]
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

fn parse_endpoint(s: &str) -> anyhow::Result<Endpoint> {
    if let Some(rest) = s.strip_prefix("s3://") {
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() {
            bail!("{s:?}: an S3 location is s3://bucket/prefix");
        }
        Ok(Endpoint::S3 {
            bucket: bucket.to_owned(),
            prefix: prefix.trim_end_matches('/').to_owned(),
        })
    } else {
        Ok(Endpoint::Local(PathBuf::from(s)))
    }
}

/// Parses a manifest: one `path\tsize\tsha256` per line; blank lines are ignored.
pub fn read_manifest(path: &Path) -> anyhow::Result<Vec<FileRef>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading manifest {}", path.display()))?;
    let mut files = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("manifest {} line {}", path.display(), n + 1);
        let mut parts = line.split('\t');
        let (Some(p), Some(size), Some(sha), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            bail!(
                "{}: expected `path<TAB>size<TAB>sha256`, got {line:?}",
                at()
            );
        };
        let size: u64 = size
            .parse()
            .with_context(|| format!("{}: size {size:?} is not a number", at()))?;
        let file = FileRef::new(p, size, sha);
        file.check().with_context(at)?;
        if !seen.insert(file.path.clone()) {
            bail!("{}: {:?} is listed twice", at(), file.path);
        }
        files.push(file);
    }
    Ok(files)
}

/// Walks a local directory: every regular file beneath it (symlinks are listed too, so the
/// confined open refuses them by name instead of silently skipping them).
fn walk_local(root: &Path) -> anyhow::Result<Vec<FileRef>> {
    let mut files = Vec::new();
    for entry in walkdir::WalkDir::new(root)
        .follow_links(false)
        .sort_by_file_name()
    {
        let entry = entry.with_context(|| format!("walking {}", root.display()))?;
        if entry.file_type().is_dir() {
            continue;
        }
        if is_temp_name(&entry.file_name().to_string_lossy()) {
            continue;
        }
        let rel = entry
            .path()
            .strip_prefix(root)
            .context("walked outside the root")?;
        let rel = rel
            .to_str()
            .with_context(|| format!("{} is not valid UTF-8", entry.path().display()))?
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

/// Runs `stagehand cp`: copies, prints the summary (text or JSON) to stdout, and returns it.
/// The caller exits with [`CpSummary::exit_code`].
pub async fn run_cp(args: CpArgs) -> anyhow::Result<CpSummary> {
    let src_ep = parse_endpoint(&args.src)?;
    let dst_ep = parse_endpoint(&args.dst)?;
    let manifest = match &args.manifest {
        Some(p) => Some(read_manifest(p)?),
        None => None,
    };

    // Work out the source tier and the relative paths to copy.
    let (src, mut files, single_name) = match &src_ep {
        Endpoint::Local(path) => {
            let meta =
                std::fs::metadata(path).with_context(|| format!("source {}", path.display()))?;
            if meta.is_dir() {
                if !args.recursive && manifest.is_none() {
                    bail!(
                        "{} is a directory: use --recursive (or --manifest)",
                        path.display()
                    );
                }
                let tier = PosixTier::open("src", path)?;
                let files = match &manifest {
                    Some(m) => m.clone(),
                    None => walk_local(path)?,
                };
                (Tier::Posix(tier), files, None)
            } else {
                if manifest.is_some() {
                    bail!("--manifest needs SRC to be the directory its paths are relative to");
                }
                let parent = path
                    .parent()
                    .filter(|p| !p.as_os_str().is_empty())
                    .unwrap_or(Path::new("."));
                let name = path
                    .file_name()
                    .and_then(|n| n.to_str())
                    .with_context(|| format!("{} has no UTF-8 file name", path.display()))?
                    .to_owned();
                let tier = PosixTier::open("src", parent)?;
                (
                    Tier::Posix(tier),
                    vec![FileRef::new(name.clone(), meta.len(), String::new())],
                    Some(name),
                )
            }
        }
        Endpoint::S3 { bucket, prefix } => {
            if args.recursive || manifest.is_some() {
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
                    bail!("{}: name an object, or use --recursive", args.src);
                }
                let tier = S3Tier::from_env("src", bucket.clone(), parent)?;
                let size = tier
                    .stat_side(name, crate::error::Side::Source)
                    .await?
                    .with_context(|| format!("{} does not exist", args.src))?
                    .size;
                (
                    Tier::S3(tier),
                    vec![FileRef::new(name, size, String::new())],
                    Some(name.to_owned()),
                )
            }
        }
    };

    // The destination tier; a single file may be renamed like `cp a b`.
    let dst = match &dst_ep {
        Endpoint::Local(path) => {
            let root = match &single_name {
                Some(_) if !path.is_dir() && !args.dst.ends_with('/') => {
                    let parent = path
                        .parent()
                        .filter(|p| !p.as_os_str().is_empty())
                        .unwrap_or(Path::new("."));
                    let new_name = path
                        .file_name()
                        .and_then(|n| n.to_str())
                        .with_context(|| format!("{} has no UTF-8 file name", path.display()))?;
                    files[0].path = new_name.to_owned();
                    parent.to_owned()
                }
                _ => path.clone(),
            };
            std::fs::create_dir_all(&root)
                .with_context(|| format!("creating destination {}", root.display()))?;
            Tier::Posix(PosixTier::open("dst", &root)?)
        }
        Endpoint::S3 { bucket, prefix } => {
            Tier::S3(S3Tier::from_env("dst", bucket.clone(), prefix.clone())?)
        }
    };
    // A renamed single file: the source keeps its own name.
    let src_names: Option<String> = single_name.filter(|n| *n != files[0].path);

    let opts = CopyOptions {
        priority: args.priority.into(),
        trust_recorded_hash: args.trust_recorded_hash && manifest.is_some(),
        verify_destination: if args.read_back {
            VerifyDestination::ReadBack
        } else {
            VerifyDestination::InFlight
        },
        expected_hash_unknown: manifest.is_none(),
    };
    let mover = Mover::new(MoverConfig {
        engine: args.engine,
        concurrency: args.concurrency.max(1),
        commit_mode: if args.durable_each {
            CommitMode::Durable
        } else {
            CommitMode::Batched
        },
        bytes_per_second: args.bwlimit,
        ..MoverConfig::default()
    })?;

    let progress = Progress::new();
    let bar = (!args.quiet && !args.json && std::io::stderr().is_terminal())
        .then(|| start_bar(progress.clone()));
    let report = if let Some(src_name) = src_names {
        // `cp dir/a other/b`: the source is read under its own name, published as `b`.
        copy_renamed(&mover, &src, &dst, &src_name, &files[0], &opts, &progress).await
    } else {
        mover.copy_all(&src, &dst, &files, &opts, &progress).await
    };
    if let Some((bar, ticker)) = bar {
        ticker.abort();
        bar.finish_and_clear();
    }

    let secs = report.elapsed.as_secs_f64().max(1e-9);
    let summary = CpSummary {
        files: report.results.len() as u64,
        copied: report.files_copied,
        skipped: report.files_skipped,
        failed: report.files_failed,
        bytes: report.bytes_copied,
        seconds: secs,
        bytes_per_second: report.bytes_copied as f64 / secs,
        files_per_second: (report.files_copied + report.files_skipped) as f64 / secs,
        engine: report.engine.to_owned(),
        failures: report
            .failures()
            .map(|(path, e)| CpFailure {
                path: path.to_owned(),
                kind: format!("{:?}", e.kind),
                retryable: e.is_retryable(),
                error: e.to_string(),
            })
            .collect(),
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        print!("{}", summary.to_text());
    }
    Ok(summary)
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
        _ => Err(crate::error::TransferError::new(
            crate::error::ErrorKind::Config,
            crate::error::Side::Destination,
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

fn start_bar(progress: Progress) -> (indicatif::ProgressBar, tokio::task::JoinHandle<()>) {
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:30} {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta} {msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let b = bar.clone();
    let ticker = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        loop {
            tick.tick().await;
            b.set_length(progress.bytes_total());
            b.set_position(progress.bytes_done());
            b.set_message(format!(
                "{}/{} files",
                progress.files_done(),
                progress.files_total()
            ));
        }
    });
    (bar, ticker)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_counts_parse() {
        assert_eq!(parse_bytes("1048576"), Ok(1 << 20));
        assert_eq!(parse_bytes("64K"), Ok(64 << 10));
        assert_eq!(parse_bytes("2g"), Ok(2 << 30));
        assert!(parse_bytes("fast").is_err());
        assert!(parse_bytes("0").is_err());
    }

    #[test]
    fn manifest_lines_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.tsv");
        let sha = crate::transfer::EMPTY_SHA256;
        std::fs::write(&p, format!("a/b\t0\t{sha}\n\nc\t0\t{sha}\n")).unwrap();
        assert_eq!(read_manifest(&p).unwrap().len(), 2);
        std::fs::write(&p, format!("../x\t0\t{sha}\n")).unwrap();
        let e = read_manifest(&p).unwrap_err();
        assert!(format!("{e:#}").contains("line 1"), "{e:#}");
        std::fs::write(&p, format!("a\t0\t{sha}\na\t0\t{sha}\n")).unwrap();
        assert!(format!("{:#}", read_manifest(&p).unwrap_err()).contains("twice"));
    }
}
