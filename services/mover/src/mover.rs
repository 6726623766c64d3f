//! The [`Mover`]: picks the path for each pair of tiers, checks what is already there, runs
//! the engine, proves the result and publishes it atomically.
//!
//! What proves the bytes on posix → posix:
//! - the source is hashed from the very buffers that are written, and the hash must equal the
//!   [`FileRef`]'s (or, without a recorded hash, becomes the proven hash);
//! - the source's size, mtime and ctime are compared before and after (a change in between is
//!   `SourceChanged`: the hash might describe a mix of old and new bytes);
//! - with [`VerifyMode::ReadBack`] the temp file is read back and hashed before rename;
//! - with `trust_recorded_hash` and a recorded hash, the bytes may move by `FICLONE` or
//!   `copy_file_range` without being read by us: the recorded hash (proven at ingest) and the
//!   unchanged size and times of the source stand for them.

use std::fs::File;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde::Deserialize;

use crate::engine::{Engine, EngineChoice, EngineError, EngineParams, copy_blocks};
use crate::error::{ErrorKind, Side, TransferError};
use crate::posix::{AtomicFile, CommitMode, PendingRename, PosixTier};
use crate::sched::{RateLimiter, Scheduler};
use crate::tier::Tier;
use crate::transfer::{
    CopyOptions, CopyOutcome, EMPTY_SHA256, FileRef, Progress, SkipReason, VerifyMode,
};

/// Files at least this large are published individually even in [`CommitMode::Batched`].
const BATCH_BELOW: u64 = 1 << 20;
/// Small files copied inline go to a blocking thread in groups of this many.
const INLINE_GROUP: usize = 32;
/// Block size of the inline path.
const INLINE_BLOCK: usize = 256 << 10;
/// What [`CopyOutcome::Copied::engine`] says for a file copied inline.
pub(crate) const INLINE_ENGINE: &str = "inline";

/// How the mover runs. Every field has a default suited to a small machine.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MoverConfig {
    /// posix → posix engine: `auto` (io_uring when available), `io_uring` or `pread`.
    pub engine: EngineChoice,
    /// Files in flight at once in [`Mover::copy_all`] (and transfer slots of the scheduler).
    pub concurrency: usize,
    /// Bytes per read/write block.
    pub block_size: usize,
    /// Blocks in flight in the io_uring engine (registered buffers).
    pub buffers: usize,
    /// Hashing threads of the io_uring engine; 0 means one per CPU. Each file is hashed on
    /// one of them from start to end (SHA-256 is sequential), and files in flight together
    /// go to the least busy one, so a multi-file copy hashes on every core while a single
    /// file runs at one core's SHA-256 rate.
    pub hash_threads: usize,
    /// Worker threads of the pread engine.
    pub pread_threads: usize,
    /// How a batch's files are made durable (see [`CommitMode`]).
    pub commit_mode: CommitMode,
    /// Files published per batch commit in [`CommitMode::Batched`].
    pub batch_files: usize,
    /// Optional limit on bytes read per second across all posix → posix transfers.
    pub bytes_per_second: Option<u64>,
    /// In [`Mover::copy_all`], posix → posix files smaller than this are copied inline: one
    /// blocking thread opens, reads, hashes, writes and checks a group of them in a row, with
    /// the same proofs as the engine, instead of handing each few-KiB file across four
    /// threads (context switches, not bytes, are what limits small files). 0 turns it off.
    pub inline_below: u64,
    /// Groups of small files copied inline at once; 0 means twice the number of CPUs. Raise
    /// it for a high-latency (network) filesystem.
    pub inline_threads: usize,
    /// Write files of 1 MiB and more with `O_DIRECT` (io_uring engine) where the filesystem
    /// allows: no second copy through the page cache and no gigabytes of dirty pages for the
    /// final `fdatasync` to wait on. Off, every write goes through the page cache.
    pub direct_writes: bool,
    /// Read files of 1 MiB and more with `O_DIRECT` (io_uring engine) when the page cache
    /// holds less than half of them: a cold source (a capacity tier's version, a replica
    /// written long ago) goes from the device straight into the registered buffers instead
    /// of through the kernel's read-ahead and a copy out of the cache. A cached file is read
    /// from memory as before. Off, every read goes through the page cache.
    pub direct_reads: bool,
}

impl Default for MoverConfig {
    fn default() -> Self {
        MoverConfig {
            engine: EngineChoice::Auto,
            concurrency: 64,
            block_size: 1 << 20,
            buffers: 16,
            hash_threads: 0,
            pread_threads: 2,
            commit_mode: CommitMode::Batched,
            batch_files: 4096,
            bytes_per_second: None,
            inline_below: 128 << 10,
            inline_threads: 0,
            direct_writes: true,
            direct_reads: true,
        }
    }
}

/// One file's result in a batch.
#[derive(Debug)]
pub struct FileResult {
    pub path: String,
    pub result: Result<CopyOutcome, TransferError>,
}

/// What a batch did.
#[derive(Debug)]
pub struct BatchReport {
    /// One entry per file asked for, in the order asked.
    pub results: Vec<FileResult>,
    pub files_copied: u64,
    pub files_skipped: u64,
    pub files_failed: u64,
    pub bytes_copied: u64,
    /// The engine that moved posix → posix bytes (or the S3 path's name); files below
    /// [`MoverConfig::inline_below`] say `inline` in their own outcome.
    pub engine: &'static str,
    pub elapsed: Duration,
}

impl BatchReport {
    pub fn failures(&self) -> impl Iterator<Item = (&str, &TransferError)> {
        self.results
            .iter()
            .filter_map(|r| r.result.as_ref().err().map(|e| (r.path.as_str(), e)))
    }
}

/// Moves files between tiers. Cheap to share by reference; one per process is enough.
pub struct Mover {
    engine: Arc<Engine>,
    sched: Scheduler,
    config: MoverConfig,
    limiter: Option<Arc<RateLimiter>>,
}

impl std::fmt::Debug for Mover {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mover")
            .field("engine", &self.engine.name())
            .field("config", &self.config)
            .finish()
    }
}

/// A source opened and checked, with its destination temp file ready.
struct Prepared {
    src: File,
    before: SourceStamp,
    atomic: AtomicFile,
    size: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SourceStamp {
    size: u64,
    mtime: (i64, u64),
    ctime: (i64, u64),
}

fn stamp(file: &File) -> std::io::Result<SourceStamp> {
    let st = rustix::fs::fstat(file.as_fd())?;
    Ok(SourceStamp {
        size: st.st_size as u64,
        mtime: (st.st_mtime as i64, st.st_mtime_nsec as u64),
        ctime: (st.st_ctime as i64, st.st_ctime_nsec as u64),
    })
}

enum Step {
    Done(CopyOutcome),
    Copy(Box<Prepared>),
}

impl Mover {
    /// Starts the engine (probing io_uring for `auto`) and the scheduler.
    pub fn new(config: MoverConfig) -> Result<Mover, TransferError> {
        let limiter = config
            .bytes_per_second
            .map(|r| Arc::new(RateLimiter::new(r)));
        let params = EngineParams {
            block_size: config.block_size.clamp(4096, 64 << 20),
            buffers: config.buffers.max(2),
            threads: config.pread_threads.max(1),
            direct_writes: config.direct_writes,
            direct_reads: config.direct_reads,
            hash_threads: match config.hash_threads {
                0 => std::thread::available_parallelism().map_or(2, |n| n.get()),
                n => n,
            },
        };
        let engine = Engine::start(config.engine, params, limiter.clone()).map_err(|e| {
            TransferError::new(
                ErrorKind::Config,
                Side::Source,
                "",
                "",
                format!("starting the {:?} engine: {e}", config.engine),
            )
            .with_source(e)
        })?;
        Ok(Mover {
            engine: Arc::new(engine),
            sched: Scheduler::new(config.concurrency.max(1)),
            config,
            limiter,
        })
    }

    /// The posix → posix engine that runs: `io_uring` or `pread`.
    pub fn engine_name(&self) -> &'static str {
        self.engine.name()
    }

    pub fn config(&self) -> &MoverConfig {
        &self.config
    }

    /// The scheduler whose slots every transfer takes (shared with callers that want to
    /// reserve a slot for their own work).
    pub fn scheduler(&self) -> &Scheduler {
        &self.sched
    }

    /// Copies one file and publishes it durably before returning.
    pub async fn copy(
        &self,
        src: &Tier,
        dst: &Tier,
        file: &FileRef,
        opts: &CopyOptions,
    ) -> Result<CopyOutcome, TransferError> {
        let _permit = self.sched.acquire(opts.priority).await;
        let progress = Progress::new();
        let started = Instant::now();
        let outcome = match (src, dst) {
            (Tier::Posix(s), Tier::Posix(d)) => {
                // Durable mode publishes before returning, so there is never a pending rename.
                let (outcome, _) = self
                    .copy_posix(s, d, file, &file.path, opts, &progress, CommitMode::Durable)
                    .await?;
                outcome
            }
            (Tier::S3(s), Tier::Posix(d)) => {
                crate::s3::download(s, d, file, opts, &progress).await?
            }
            (Tier::Posix(s), Tier::S3(d)) => crate::s3::upload(s, d, file, opts, &progress).await?,
            (Tier::S3(s), Tier::S3(d)) => {
                crate::s3::copy_within(s, d, file, opts, &progress).await?
            }
        };
        if let CopyOutcome::Copied { bytes, .. } = &outcome {
            record_moved(src, dst, opts, 1, *bytes, started.elapsed());
        }
        Ok(outcome)
    }

    /// Copies every file, `concurrency` at a time, and reports each result. Files published
    /// in [`CommitMode::Batched`] are durable when this returns.
    pub async fn copy_all(
        &self,
        src: &Tier,
        dst: &Tier,
        files: &[FileRef],
        opts: &CopyOptions,
        progress: &Progress,
    ) -> BatchReport {
        progress.add_total(files.len() as u64, files.iter().map(|f| f.size).sum());
        self.copy_batch(src, dst, files, opts, progress).await
    }

    /// [`Mover::copy_all`] without announcing the files to `progress` (the caller did).
    pub(crate) async fn copy_batch(
        &self,
        src: &Tier,
        dst: &Tier,
        files: &[FileRef],
        opts: &CopyOptions,
        progress: &Progress,
    ) -> BatchReport {
        let started = Instant::now();
        if let Tier::Posix(d) = dst {
            d.forget_dirs();
        }
        let mode = self.config.commit_mode;
        let mut results: Vec<Option<Result<CopyOutcome, TransferError>>> =
            (0..files.len()).map(|_| None).collect();
        // A batch's commit (two `syncfs` and its renames) runs while the next batch copies.
        let mut committing: Option<Committing> = None;
        for (chunk_no, chunk) in files.chunks(self.config.batch_files.max(1)).enumerate() {
            let base = chunk_no * self.config.batch_files.max(1);
            let mut pending: Vec<(usize, CopyOutcome, PendingRename)> = Vec::new();
            let posix_pair = matches!((src, dst), (Tier::Posix(_), Tier::Posix(_)));
            let (small, other): (Vec<usize>, Vec<usize>) = (0..chunk.len())
                .partition(|&i| posix_pair && chunk[i].size < self.config.inline_below);
            let groups: Vec<Vec<usize>> = small.chunks(INLINE_GROUP).map(<[_]>::to_vec).collect();
            let inline = futures::stream::iter(groups)
                .map(|group| async move {
                    let _permit = self.sched.acquire(opts.priority).await;
                    let files: Vec<(usize, FileRef)> = group
                        .into_iter()
                        .map(|i| (base + i, chunk[i].clone()))
                        .collect();
                    self.copy_inline_group(src, dst, files, opts, progress, mode)
                        .await
                })
                .buffer_unordered(self.inline_threads());
            let engine = futures::stream::iter(other)
                .map(|i| async move {
                    let _permit = self.sched.acquire(opts.priority).await;
                    let r = self
                        .copy_one(src, dst, &chunk[i], opts, progress, mode)
                        .await;
                    vec![(base + i, r)]
                })
                .buffer_unordered(self.config.concurrency.max(1));
            let mut stream =
                futures::stream::select(inline, engine).flat_map(futures::stream::iter);
            while let Some((i, r)) = stream.next().await {
                match r {
                    Ok((outcome, Some(p))) => pending.push((i, outcome, p)),
                    Ok((outcome, None)) => {
                        if matches!(outcome, CopyOutcome::Skipped { .. }) {
                            progress.file_skipped();
                        } else {
                            progress.file_done();
                        }
                        results[i] = Some(Ok(outcome));
                    }
                    Err(e) => {
                        progress.file_failed();
                        results[i] = Some(Err(e));
                    }
                }
            }
            drop(stream);
            // The previous batch's commit ran while this batch was copied; it is settled
            // before this batch's starts, so commits stay in order and one at a time.
            if let Some(c) = committing.take() {
                settle(c, dst, files, progress, &mut results).await;
            }
            if !pending.is_empty() {
                let Tier::Posix(d) = dst else {
                    unreachable!("only posix destinations batch their renames")
                };
                let (idx, rest): (Vec<usize>, Vec<(CopyOutcome, PendingRename)>) =
                    pending.into_iter().map(|(i, o, p)| (i, (o, p))).unzip();
                let (outcomes, renames): (Vec<CopyOutcome>, Vec<PendingRename>) =
                    rest.into_iter().unzip();
                let d = d.clone();
                committing = Some(Committing {
                    idx,
                    outcomes,
                    task: tokio::task::spawn_blocking(move || d.commit_batch(renames)),
                });
            }
        }
        if let Some(c) = committing.take() {
            settle(c, dst, files, progress, &mut results).await;
        }
        let results: Vec<FileResult> = files
            .iter()
            .zip(results)
            .map(|(f, r)| FileResult {
                path: f.path.clone(),
                result: r.unwrap_or_else(|| {
                    Err(TransferError::new(
                        ErrorKind::Cancelled,
                        Side::Source,
                        src.name(),
                        &f.path,
                        "not attempted",
                    ))
                }),
            })
            .collect();
        let mut report = BatchReport {
            files_copied: 0,
            files_skipped: 0,
            files_failed: 0,
            bytes_copied: 0,
            engine: self.path_name(src, dst),
            elapsed: started.elapsed(),
            results,
        };
        for r in &report.results {
            match &r.result {
                Ok(CopyOutcome::Copied { bytes, .. }) => {
                    report.files_copied += 1;
                    report.bytes_copied += bytes;
                }
                Ok(CopyOutcome::Skipped { .. }) => report.files_skipped += 1,
                Err(_) => report.files_failed += 1,
            }
        }
        record_moved(
            src,
            dst,
            opts,
            report.files_copied,
            report.bytes_copied,
            report.elapsed,
        );
        report
    }

    /// The name reported for what moves bytes between `src` and `dst`.
    pub fn path_name(&self, src: &Tier, dst: &Tier) -> &'static str {
        match (src, dst) {
            (Tier::Posix(_), Tier::Posix(_)) => self.engine.name(),
            (Tier::S3(_), Tier::Posix(_)) => "s3-download",
            (Tier::Posix(_), Tier::S3(_)) => "s3-upload",
            (Tier::S3(_), Tier::S3(_)) => "s3-copy",
        }
    }

    async fn copy_one(
        &self,
        src: &Tier,
        dst: &Tier,
        file: &FileRef,
        opts: &CopyOptions,
        progress: &Progress,
        mode: CommitMode,
    ) -> Result<(CopyOutcome, Option<PendingRename>), TransferError> {
        match (src, dst) {
            (Tier::Posix(s), Tier::Posix(d)) => {
                // Large files are published one by one as they finish: their fdatasync is
                // small next to their data, and a crash then loses at most the files in flight.
                let mode = if file.size >= BATCH_BELOW {
                    CommitMode::Durable
                } else {
                    mode
                };
                self.copy_posix(s, d, file, &file.path, opts, progress, mode)
                    .await
            }
            (Tier::S3(s), Tier::Posix(d)) => {
                if mode == CommitMode::Batched {
                    crate::s3::download_pending(s, d, file, opts, progress).await
                } else {
                    crate::s3::download(s, d, file, opts, progress)
                        .await
                        .map(|o| (o, None))
                }
            }
            (Tier::Posix(s), Tier::S3(d)) => crate::s3::upload(s, d, file, opts, progress)
                .await
                .map(|o| (o, None)),
            (Tier::S3(s), Tier::S3(d)) => crate::s3::copy_within(s, d, file, opts, progress)
                .await
                .map(|o| (o, None)),
        }
    }

    /// posix → posix. With `CommitMode::Durable` the file is published before returning;
    /// with `Batched` the pending rename is handed back.
    #[allow(clippy::too_many_arguments)]
    async fn copy_posix(
        &self,
        src: &PosixTier,
        dst: &PosixTier,
        file: &FileRef,
        dst_rel: &str,
        opts: &CopyOptions,
        progress: &Progress,
        mode: CommitMode,
    ) -> Result<(CopyOutcome, Option<PendingRename>), TransferError> {
        let (s, d, f, o, r) = (
            src.clone(),
            dst.clone(),
            file.clone(),
            opts.clone(),
            dst_rel.to_owned(),
        );
        let step = blocking(src, &file.path, move || prepare(&s, &d, &f, &r, &o)).await?;
        let prep = match step {
            Step::Done(outcome) => return Ok((outcome, None)),
            Step::Copy(p) => *p,
        };
        let expected = (!opts.expected_hash_unknown).then(|| file.sha256.clone());
        let (sha, engine_name) = if prep.size == 0 {
            (EMPTY_SHA256.to_owned(), self.engine.name())
        } else if opts.trust_recorded_hash && expected.is_some() {
            let (s_file, d_file) = (
                dup(&prep.src, src, file, Side::Source)?,
                dup(prep.atomic.file(), dst, file, Side::Destination)?,
            );
            let size = prep.size;
            match blocking(src, &file.path, move || {
                Ok(kernel_copy(&s_file, &d_file, size))
            })
            .await?
            {
                KernelCopy::Done(name) => {
                    progress.add_bytes(size);
                    (expected.clone().expect("checked above"), name)
                }
                KernelCopy::Unsupported => self.run_engine(&prep, src, dst, file, progress).await?,
                KernelCopy::Failed(e) => {
                    return Err(TransferError::from_io(
                        e,
                        Side::Destination,
                        dst.name(),
                        &file.path,
                        "copy_file_range",
                    ));
                }
            }
        } else {
            self.run_engine(&prep, src, dst, file, progress).await?
        };
        let (s, d, f, o, r) = (
            src.clone(),
            dst.clone(),
            file.clone(),
            opts.clone(),
            dst_rel.to_owned(),
        );
        blocking(src, &file.path, move || {
            finish(&s, &d, &f, &r, &o, prep, sha, engine_name, mode)
        })
        .await
    }

    /// posix → posix under a new name (`cp dir/a other/b`), published durably.
    pub(crate) async fn copy_posix_renamed(
        &self,
        src: &PosixTier,
        dst: &PosixTier,
        file: &FileRef,
        dst_rel: &str,
        opts: &CopyOptions,
        progress: &Progress,
    ) -> Result<CopyOutcome, TransferError> {
        let _permit = self.sched.acquire(opts.priority).await;
        let (outcome, _) = self
            .copy_posix(src, dst, file, dst_rel, opts, progress, CommitMode::Durable)
            .await?;
        Ok(outcome)
    }

    fn inline_threads(&self) -> usize {
        match self.config.inline_threads {
            0 => std::thread::available_parallelism().map_or(2, |n| n.get() * 2),
            n => n,
        }
    }

    /// Copies a group of small posix files one after another on one blocking thread.
    async fn copy_inline_group(
        &self,
        src: &Tier,
        dst: &Tier,
        files: Vec<(usize, FileRef)>,
        opts: &CopyOptions,
        progress: &Progress,
        mode: CommitMode,
    ) -> Vec<(
        usize,
        Result<(CopyOutcome, Option<PendingRename>), TransferError>,
    )> {
        let (Tier::Posix(s), Tier::Posix(d)) = (src, dst) else {
            unreachable!("only posix pairs are copied inline")
        };
        let names: Vec<(usize, String)> = files.iter().map(|(i, f)| (*i, f.path.clone())).collect();
        let (s, d, o, p, l) = (
            s.clone(),
            d.clone(),
            opts.clone(),
            progress.clone(),
            self.limiter.clone(),
        );
        let task = tokio::task::spawn_blocking(move || {
            let mut buf = vec![0u8; INLINE_BLOCK];
            files
                .into_iter()
                .map(|(i, f)| {
                    let r = copy_posix_inline(&s, &d, &f, &o, &p, mode, l.as_deref(), &mut buf);
                    (i, r)
                })
                .collect::<Vec<_>>()
        });
        match task.await {
            Ok(results) => results,
            Err(e) => names
                .into_iter()
                .map(|(i, path)| {
                    (
                        i,
                        Err(TransferError::new(
                            ErrorKind::Io,
                            Side::Source,
                            src.name(),
                            &path,
                            format!("transfer task failed: {e}"),
                        )),
                    )
                })
                .collect(),
        }
    }

    async fn run_engine(
        &self,
        prep: &Prepared,
        src: &PosixTier,
        dst: &PosixTier,
        file: &FileRef,
        progress: &Progress,
    ) -> Result<(String, &'static str), TransferError> {
        let s_file = dup(&prep.src, src, file, Side::Source)?;
        let d_file = dup(prep.atomic.file(), dst, file, Side::Destination)?;
        match self
            .engine
            .run(s_file, d_file, prep.size, progress.clone())
            .await
        {
            Ok(sha) => Ok((sha, self.engine.name())),
            Err(e) => Err(engine_error(e, prep.size, src, dst, file)),
        }
    }
}

/// Names the side, tier and path of an engine's failure.
fn engine_error(
    e: EngineError,
    size: u64,
    src: &PosixTier,
    dst: &PosixTier,
    file: &FileRef,
) -> TransferError {
    match e {
        EngineError::Read(e) => {
            TransferError::from_io(e, Side::Source, src.name(), &file.path, "read")
        }
        EngineError::Write(e) => {
            TransferError::from_io(e, Side::Destination, dst.name(), &file.path, "write")
        }
        EngineError::SourceShort { at } => TransferError::new(
            ErrorKind::SourceChanged,
            Side::Source,
            src.name(),
            &file.path,
            format!(
                "the source ended at byte {at}, before the {size} bytes it had when the copy started"
            ),
        ),
        EngineError::Stopped => TransferError::new(
            ErrorKind::Io,
            Side::Source,
            src.name(),
            &file.path,
            "the copy engine stopped",
        ),
    }
}

/// posix → posix on the calling (blocking) thread: the same prepare, proofs and publish as
/// [`Mover::copy_posix`], with the bytes moved by [`copy_blocks`].
#[allow(clippy::too_many_arguments)]
fn copy_posix_inline(
    src: &PosixTier,
    dst: &PosixTier,
    file: &FileRef,
    opts: &CopyOptions,
    progress: &Progress,
    mode: CommitMode,
    limiter: Option<&RateLimiter>,
    buf: &mut [u8],
) -> Result<(CopyOutcome, Option<PendingRename>), TransferError> {
    let prep = match prepare(src, dst, file, &file.path, opts)? {
        Step::Done(outcome) => return Ok((outcome, None)),
        Step::Copy(p) => *p,
    };
    let mut moved = None;
    if prep.size == 0 {
        moved = Some((EMPTY_SHA256.to_owned(), INLINE_ENGINE));
    } else if opts.trust_recorded_hash && !opts.expected_hash_unknown {
        match kernel_copy(&prep.src, prep.atomic.file(), prep.size) {
            KernelCopy::Done(name) => {
                progress.add_bytes(prep.size);
                moved = Some((file.sha256.clone(), name));
            }
            KernelCopy::Unsupported => {}
            KernelCopy::Failed(e) => {
                return Err(TransferError::from_io(
                    e,
                    Side::Destination,
                    dst.name(),
                    &file.path,
                    "copy_file_range",
                ));
            }
        }
    }
    let (sha, engine) = match moved {
        Some(m) => m,
        None => {
            let sha = copy_blocks(
                &prep.src,
                prep.atomic.file(),
                prep.size,
                buf,
                progress,
                limiter,
            )
            .map_err(|e| engine_error(e, prep.size, src, dst, file))?;
            (sha, INLINE_ENGINE)
        }
    };
    finish(src, dst, file, &file.path, opts, prep, sha, engine, mode)
}

/// A batch whose renames are being made durable on a blocking thread.
struct Committing {
    idx: Vec<usize>,
    outcomes: Vec<CopyOutcome>,
    task: tokio::task::JoinHandle<Vec<Result<(), TransferError>>>,
}

/// Waits for a batch's commit and records each file's result.
async fn settle(
    c: Committing,
    dst: &Tier,
    files: &[FileRef],
    progress: &Progress,
    results: &mut [Option<Result<CopyOutcome, TransferError>>],
) {
    match c.task.await {
        Ok(committed) => {
            for ((i, outcome), r) in c.idx.into_iter().zip(c.outcomes).zip(committed) {
                match r {
                    Ok(()) => {
                        progress.file_done();
                        results[i] = Some(Ok(outcome));
                    }
                    Err(e) => {
                        progress.file_failed();
                        results[i] = Some(Err(e));
                    }
                }
            }
        }
        Err(e) => {
            for i in c.idx {
                progress.file_failed();
                results[i] = Some(Err(TransferError::new(
                    ErrorKind::Io,
                    Side::Destination,
                    dst.name(),
                    &files[i].path,
                    format!("batch commit task failed: {e}"),
                )));
            }
        }
    }
}

fn dup(f: &File, tier: &PosixTier, file: &FileRef, side: Side) -> Result<File, TransferError> {
    f.try_clone()
        .map_err(|e| TransferError::from_io(e, side, tier.name(), &file.path, "dup"))
}

async fn blocking<T: Send + 'static>(
    tier: &PosixTier,
    rel: &str,
    f: impl FnOnce() -> Result<T, TransferError> + Send + 'static,
) -> Result<T, TransferError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| {
        TransferError::new(
            ErrorKind::Io,
            Side::Source,
            tier.name(),
            rel,
            format!("transfer task failed: {e}"),
        )
    })?
}

/// Opens and checks the source, decides whether the destination already holds the file, and
/// creates the temp file when a copy is needed.
fn prepare(
    src: &PosixTier,
    dst: &PosixTier,
    file: &FileRef,
    dst_rel: &str,
    opts: &CopyOptions,
) -> Result<Step, TransferError> {
    dst.check_path(dst_rel, Side::Destination)?;
    let known = !opts.expected_hash_unknown;
    if known && !stagehand_schemas::is_sha256_hex(&file.sha256) {
        return Err(TransferError::new(
            ErrorKind::Config,
            Side::Source,
            src.name(),
            &file.path,
            format!(
                "recorded sha256 {:?} is not 64 lowercase hex characters",
                file.sha256
            ),
        ));
    }
    let src_file = src.open_read(&file.path)?;
    let before = stamp(&src_file)
        .map_err(|e| TransferError::from_io(e, Side::Source, src.name(), &file.path, "fstat"))?;
    if known && before.size != file.size {
        return Err(TransferError::new(
            ErrorKind::SizeMismatch,
            Side::Source,
            src.name(),
            &file.path,
            format!(
                "the source holds {} bytes, the manifest says {}",
                before.size, file.size
            ),
        ));
    }
    if let Some(existing) = dst.stat(dst_rel)? {
        if existing != before.size {
            return Err(TransferError::new(
                ErrorKind::DestinationConflict,
                Side::Destination,
                dst.name(),
                dst_rel,
                format!(
                    "a different file is already there ({existing} bytes, the source has {})",
                    before.size
                ),
            ));
        }
        if known && opts.trust_recorded_hash {
            return Ok(Step::Done(CopyOutcome::Skipped {
                reason: SkipReason::AlreadyPresentTrusted,
                sha256: file.sha256.clone(),
            }));
        }
        let there = dst.hash_file_side(dst_rel, Side::Destination)?;
        let wanted = if known {
            file.sha256.clone()
        } else {
            crate::posix::hash_open_file(&src_file)
                .map_err(|e| {
                    TransferError::from_io(e, Side::Source, src.name(), &file.path, "read")
                })?
                .sha256
        };
        if there.sha256 == wanted {
            return Ok(Step::Done(CopyOutcome::Skipped {
                reason: SkipReason::AlreadyPresentVerified,
                sha256: wanted,
            }));
        }
        return Err(TransferError::new(
            ErrorKind::DestinationConflict,
            Side::Destination,
            dst.name(),
            dst_rel,
            format!(
                "a different file of the same size is already there (sha256 {}, expected {wanted})",
                there.sha256
            ),
        ));
    }
    let atomic = dst.create_atomic(dst_rel, before.size)?;
    Ok(Step::Copy(Box::new(Prepared {
        src: src_file,
        before,
        atomic,
        size: before.size,
    })))
}

enum KernelCopy {
    Done(&'static str),
    Unsupported,
    Failed(std::io::Error),
}

/// `FICLONE` (shares extents on btrfs/XFS), else `copy_file_range` (in-kernel copy, server-side
/// on NFS), else the caller's engine.
fn kernel_copy(src: &File, dst: &File, size: u64) -> KernelCopy {
    if rustix::fs::ioctl_ficlone(dst, src).is_ok() {
        return KernelCopy::Done("reflink");
    }
    let mut off_in = 0u64;
    let mut off_out = 0u64;
    while off_in < size {
        let want = (size - off_in).min(1 << 30) as usize;
        match rustix::fs::copy_file_range(src, Some(&mut off_in), dst, Some(&mut off_out), want) {
            Ok(0) => {
                return KernelCopy::Failed(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("source ended at byte {off_in} of {size}"),
                ));
            }
            Ok(_) => {}
            Err(e)
                if off_in == 0
                    && matches!(
                        e,
                        rustix::io::Errno::XDEV
                            | rustix::io::Errno::OPNOTSUPP
                            | rustix::io::Errno::NOSYS
                            | rustix::io::Errno::INVAL
                    ) =>
            {
                return KernelCopy::Unsupported;
            }
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return KernelCopy::Failed(e.into()),
        }
    }
    KernelCopy::Done("copy_file_range")
}

/// Proves the copy (source unchanged, hash as expected, read-back if asked) and publishes it.
#[allow(clippy::too_many_arguments)]
fn finish(
    src: &PosixTier,
    dst: &PosixTier,
    file: &FileRef,
    dst_rel: &str,
    opts: &CopyOptions,
    prep: Prepared,
    sha: String,
    engine: &'static str,
    mode: CommitMode,
) -> Result<(CopyOutcome, Option<PendingRename>), TransferError> {
    let after = stamp(&prep.src)
        .map_err(|e| TransferError::from_io(e, Side::Source, src.name(), &file.path, "fstat"))?;
    if after != prep.before {
        return Err(TransferError::new(
            ErrorKind::SourceChanged,
            Side::Source,
            src.name(),
            &file.path,
            format!(
                "the source changed while it was copied (size {} → {}, mtime or ctime moved); nothing was published",
                prep.before.size, after.size
            ),
        ));
    }
    if !opts.expected_hash_unknown && sha != file.sha256 {
        return Err(TransferError::new(
            ErrorKind::ChecksumMismatch,
            Side::Source,
            src.name(),
            &file.path,
            format!(
                "read bytes hash to {sha}, the manifest says {}; nothing was published",
                file.sha256
            ),
        ));
    }
    let landed = stamp(prep.atomic.file())
        .map_err(|e| TransferError::from_io(e, Side::Destination, dst.name(), dst_rel, "fstat"))?;
    if landed.size != prep.size {
        return Err(TransferError::new(
            ErrorKind::SizeMismatch,
            Side::Destination,
            dst.name(),
            dst_rel,
            format!("{} bytes landed, {} were copied", landed.size, prep.size),
        ));
    }
    if opts.verify_destination == VerifyMode::ReadBack {
        let back = prep.atomic.hash_written()?;
        if back.sha256 != sha {
            return Err(TransferError::new(
                ErrorKind::ChecksumMismatch,
                Side::Destination,
                dst.name(),
                dst_rel,
                format!(
                    "read back as {}, written as {sha}; nothing was published",
                    back.sha256
                ),
            ));
        }
    }
    let outcome = CopyOutcome::Copied {
        bytes: prep.size,
        sha256: sha,
        engine,
    };
    drop(prep.src);
    match mode {
        CommitMode::Durable => {
            prep.atomic.commit()?;
            Ok((outcome, None))
        }
        CommitMode::Batched => Ok((outcome, Some(prep.atomic.into_pending()))),
    }
}

/// Counts a finished copy in the work metrics ([`stagehand_telemetry::work::moved`]): the
/// tiers by their names (declared in `tiers.toml`, a bounded set) and the priority class.
fn record_moved(
    src: &Tier,
    dst: &Tier,
    opts: &CopyOptions,
    files: u64,
    bytes: u64,
    elapsed: Duration,
) {
    stagehand_telemetry::work::moved(
        src.name(),
        dst.name(),
        opts.priority.as_str(),
        files,
        bytes,
        elapsed,
    );
}
