//! The scrub's read of a replica, timed on its own (`loadtest/scrub/bench.sh` runs it beside
//! `sha256sum -c` and `rclone check --download` over the same files): the demoter's own
//! [`stagehand_demoter::scrub::read_replica`] over a posix tier folder, its budget unlimited.
//!
//! - `make --dir D --files N --bytes B`: N files of B/N bytes each (pseudo-random, so nothing
//!   compresses or deduplicates) in folders of 1,000 under D, and beside D the replica's list
//!   (`D.list`: hash, size, path per line) and a `sha256sum` manifest (`D.sha256`, paths
//!   relative to D). Once: an existing `D.list` is kept.
//! - `big --file F --mib M`: one file of M MiB, for the disk's direct-read rate (`dd`).
//! - `scrub --dir D [--parallel P]`: reads every file of `D.list` beneath D as the scrub does
//!   (P files at once, default the policy's default); prints one JSON object (seconds, files,
//!   bytes, damaged). Exits non-zero if a file is damaged. With `--policies DIR` it keeps to
//!   that folder's `scrub.toml` budget (rates and `parallel_files`) as a running demoter
//!   does; with `--forever` it reads the replica again and again until killed, one JSON
//!   object per pass: the background a stage is timed under (`STAGE_UNDER_SCRUB`).
//! - `sha-rate [--threads T] [--seconds S]`: SHA-256 of in-memory data on T threads (default
//!   every core) with the hasher the scrub uses; prints one JSON object (bytes per second).
//! - `read --dir D [--parallel P]`: the disk's direct-read rate for the replica's own files:
//!   every file of `D.list` read whole with `O_DIRECT` into an aligned buffer, P files at once
//!   (default 16), nothing hashed; prints one JSON object (seconds, files, bytes). What the
//!   scrub would reach were hashing free: the ceiling beside `dd`'s one large file.

use std::io::{BufRead, BufWriter, Write};
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Parser, Subcommand};
use sha2::{Digest, Sha256};
use stagehand_demoter::scrub::{Read, ReadBudget, read_replica};
use stagehand_mover::{PosixTier, Scheduler, Tier};
use stagehand_schemas::FileRef;

#[derive(Debug, Parser)]
struct Args {
    #[command(subcommand)]
    what: What,
}

#[derive(Debug, Subcommand)]
enum What {
    Make {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long)]
        files: u64,
        #[arg(long)]
        bytes: u64,
    },
    Big {
        #[arg(long)]
        file: PathBuf,
        #[arg(long)]
        mib: u64,
    },
    Scrub {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long, default_value_t = stagehand_policy::DEFAULT_SCRUB_PARALLEL_FILES as usize)]
        parallel: usize,
        /// A policy folder whose `scrub.toml` budget the reads keep to (`--parallel` unused).
        #[arg(long)]
        policies: Option<PathBuf>,
        /// Read the replica again and again until killed.
        #[arg(long)]
        forever: bool,
    },
    Read {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long, default_value_t = 16)]
        parallel: usize,
        /// Hash each file as it is read and check it against the list: plain threads doing
        /// the scrub's work with none of its machinery (no runtime, no budget, no confinement).
        #[arg(long)]
        hash: bool,
    },
    ShaRate {
        #[arg(long)]
        threads: Option<usize>,
        #[arg(long, default_value_t = 3.0)]
        seconds: f64,
    },
}

/// `D` with `ext` appended to its name: where the list and the manifest of `D` are.
fn beside(dir: &Path, ext: &str) -> PathBuf {
    let mut s = dir.as_os_str().to_owned();
    s.push(ext);
    PathBuf::from(s)
}

/// xorshift64*: fast, and every file different.
struct Noise(u64);

impl Noise {
    fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            let v = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}

fn make(dir: &Path, files: u64, bytes: u64) -> anyhow::Result<()> {
    let list_path = beside(dir, ".list");
    if list_path.exists() {
        eprintln!("{} exists: the files are kept", list_path.display());
        return Ok(());
    }
    anyhow::ensure!(files > 0, "--files must be more than 0");
    let size = usize::try_from(bytes / files)?;
    let mut list = BufWriter::new(std::fs::File::create(beside(dir, ".list.partial"))?);
    let mut manifest = BufWriter::new(std::fs::File::create(beside(dir, ".sha256"))?);
    let mut noise = Noise(0x9e37_79b9_7f4a_7c15);
    let mut content = vec![0u8; size];
    for i in 0..files {
        let folder = format!("d{:04}", i / 1000);
        if i % 1000 == 0 {
            std::fs::create_dir_all(dir.join(&folder))?;
        }
        let rel = format!("{folder}/f{i:07}.bin");
        noise.fill(&mut content);
        std::fs::write(dir.join(&rel), &content).with_context(|| format!("writing {rel}"))?;
        let hash = hex(&Sha256::digest(&content));
        writeln!(list, "{hash} {size} {rel}")?;
        writeln!(manifest, "{hash}  {rel}")?;
    }
    list.flush()?;
    manifest.flush()?;
    std::fs::rename(beside(dir, ".list.partial"), list_path)?;
    Ok(())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn big(file: &Path, mib: u64) -> anyhow::Result<()> {
    if std::fs::metadata(file).is_ok_and(|m| m.len() == mib << 20) {
        return Ok(());
    }
    let mut out = BufWriter::new(std::fs::File::create(file)?);
    let mut noise = Noise(0x2545_f491_4f6c_dd1d);
    let mut block = vec![0u8; 1 << 20];
    for _ in 0..mib {
        noise.fill(&mut block);
        out.write_all(&block)?;
    }
    out.flush()?;
    out.get_ref().sync_all()?;
    Ok(())
}

/// The replica's list as the catalogue would give it.
fn read_list(dir: &Path) -> anyhow::Result<Vec<FileRef>> {
    let path = beside(dir, ".list");
    let f = std::fs::File::open(&path).with_context(|| format!("opening {}", path.display()))?;
    let mut files = Vec::new();
    for line in std::io::BufReader::new(f).lines() {
        let line = line?;
        let mut parts = line.splitn(3, ' ');
        let (Some(hash), Some(size), Some(rel)) = (parts.next(), parts.next(), parts.next()) else {
            anyhow::bail!("{}: a line is not `hash size path`: {line}", path.display());
        };
        files.push(FileRef::new(rel, size.parse()?, hash));
    }
    Ok(files)
}

async fn scrub(
    dir: &Path,
    parallel: usize,
    policies: Option<&Path>,
    forever: bool,
) -> anyhow::Result<()> {
    let parent = dir.parent().context("the replica needs a parent folder")?;
    let prefix = dir
        .file_name()
        .and_then(|n| n.to_str())
        .context("the replica's folder name is not UTF-8")?;
    let tier = Tier::from(PosixTier::open("bench", parent)?);
    let files = read_list(dir)?;
    let (budget, parallel) = match policies {
        Some(dir) => {
            let policies = stagehand_policy::Policies::load_dir(dir)
                .with_context(|| format!("reading the policies in {}", dir.display()))?;
            let scrub = (policies.scrub())
                .with_context(|| format!("{} has no scrub.toml", dir.display()))?;
            let parallel = scrub.budget.parallel_files as usize;
            (ReadBudget::new(&scrub.budget), parallel)
        }
        None => {
            let parallel = NonZeroUsize::new(parallel).context("--parallel must be more than 0")?;
            (ReadBudget::unlimited(parallel), parallel.get())
        }
    };
    // The scrub's slots are the mover's; the bench's mover has as many as the scrub reads.
    let scheduler = Scheduler::new(parallel);
    loop {
        read_once(&tier, prefix, &files, &budget, &scheduler, parallel).await?;
        if !forever {
            return Ok(());
        }
    }
}

/// One pass over the replica, printed as one JSON object.
async fn read_once(
    tier: &Tier,
    prefix: &str,
    files: &[FileRef],
    budget: &ReadBudget,
    scheduler: &Scheduler,
    parallel: usize,
) -> anyhow::Result<()> {
    let started = Instant::now();
    let list = futures::stream::iter(
        (files.iter().cloned()).map(Ok::<_, stagehand_catalogue::CatalogueError>),
    );
    let read = read_replica(tier, "bench", prefix, list, budget, scheduler, None).await?;
    let seconds = started.elapsed().as_secs_f64();
    let (files, bytes, damaged) = match &read {
        Read::Verified { files, bytes } => (*files, *bytes, 0),
        Read::Damaged {
            files,
            bytes,
            total,
            ..
        } => (*files, *bytes, *total),
    };
    println!(
        "{}",
        serde_json::json!({
            "seconds": seconds,
            "files": files,
            "bytes": bytes,
            "damaged": damaged,
            "parallel": parallel,
        })
    );
    anyhow::ensure!(damaged == 0, "{damaged} files damaged: {read:?}");
    Ok(())
}

fn sha_rate(threads: Option<usize>, seconds: f64) -> anyhow::Result<()> {
    let threads = threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, NonZeroUsize::get));
    let run_for = Duration::from_secs_f64(seconds);
    let started = Instant::now();
    let hashed: u64 = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                s.spawn(move || {
                    let mut block = vec![0u8; 1 << 20];
                    Noise(t as u64 + 1).fill(&mut block);
                    let mut done = 0u64;
                    let begun = Instant::now();
                    while begun.elapsed() < run_for {
                        // 16 MiB per file, as a large file is hashed.
                        let mut h = Sha256::new();
                        for _ in 0..16 {
                            h.update(&block);
                        }
                        std::hint::black_box(h.finalize());
                        done += 16 << 20;
                    }
                    done
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap_or(0)).sum()
    });
    let elapsed = started.elapsed().as_secs_f64();
    println!(
        "{}",
        serde_json::json!({
            "threads": threads,
            "bytes": hashed,
            "seconds": elapsed,
            "bytes_per_second": hashed as f64 / elapsed,
        })
    );
    Ok(())
}

/// Reads every file of the replica at `dir` whole with `O_DIRECT`, `parallel` at once,
/// hashing nothing (the device's rate for these files), or with `hash` each one hashed and
/// checked as it is read.
fn read_direct(dir: &Path, parallel: usize, hash: bool) -> anyhow::Result<()> {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
    const ALIGN: usize = 4096;
    anyhow::ensure!(parallel > 0, "--parallel must be more than 0");
    let files = read_list(dir)?;
    let largest = files.iter().map(|f| f.size).max().unwrap_or(0);
    let room = usize::try_from(largest)?.next_multiple_of(ALIGN).max(ALIGN);
    let (next, bytes) = (AtomicUsize::new(0), AtomicU64::new(0));
    let started = Instant::now();
    std::thread::scope(|threads| {
        let mut readers = Vec::new();
        for _ in 0..parallel {
            readers.push(threads.spawn(|| -> anyhow::Result<()> {
                let mut raw = vec![0u8; room + ALIGN];
                let start = raw.as_ptr().align_offset(ALIGN);
                let buf = &mut raw[start..start + room];
                while let Some(f) = files.get(next.fetch_add(1, Ordering::Relaxed)) {
                    let path = dir.join(&f.path);
                    let file = std::fs::OpenOptions::new()
                        .read(true)
                        .custom_flags(libc::O_DIRECT)
                        .open(&path)
                        .with_context(|| format!("opening {}", path.display()))?;
                    let n = file
                        .read_at(buf, 0)
                        .with_context(|| format!("reading {}", path.display()))?;
                    anyhow::ensure!(n as u64 == f.size, "{}: read {n} bytes", path.display());
                    if hash {
                        let got = stagehand_schemas::sha256_hex(&buf[..n]);
                        anyhow::ensure!(got == f.sha256, "{}: hashes to {got}", path.display());
                    }
                    bytes.fetch_add(n as u64, Ordering::Relaxed);
                }
                Ok(())
            }));
        }
        readers
            .into_iter()
            .try_for_each(|r| r.join().expect("a reader panicked"))
    })?;
    println!(
        "{}",
        serde_json::json!({
            "seconds": started.elapsed().as_secs_f64(),
            "files": files.len(),
            "bytes": bytes.load(Ordering::Relaxed),
            "parallel": parallel,
        })
    );
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Args::parse().what {
        What::Make { dir, files, bytes } => make(&dir, files, bytes),
        What::Big { file, mib } => big(&file, mib),
        What::Scrub {
            dir,
            parallel,
            policies,
            forever,
        } => scrub(&dir, parallel, policies.as_deref(), forever).await,
        What::Read {
            dir,
            parallel,
            hash,
        } => read_direct(&dir, parallel, hash),
        What::ShaRate { threads, seconds } => sha_rate(threads, seconds),
    }
}
