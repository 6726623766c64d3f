//! One derivation: a raw version's files in, the files of its prepared version out, written
//! into a staging folder — in memory bounded by a constant whatever the dataset's size, with
//! every core at work.
//!
//! Three kinds of thread run at once:
//!
//! 1. **The planner** reads the raw manifest in path order, puts every member into the
//!    shuffle's external sort ([`crate::sort`]), then reads the sorted members back, groups
//!    them into samples, judges each against the policy and places it in a shard
//!    ([`crate::plan`]). It sends samples in batches of bounded bytes. No file byte passes
//!    through it.
//! 2. **Readers** (`read_threads` of them) take batches in turn, read every member from the
//!    source tier (confined, regular files only, the declared size checked before reading),
//!    hash it and compare with the manifest. A member above `stream_above` is not held in
//!    memory: the writer streams it and proves it the same way.
//! 3. **The writer** (the calling thread) puts the read batches back in plan order and
//!    frames each sample into its shard ([`crate::shard`]); **the sink** (a hasher thread
//!    and a disk thread) hashes the shard's bytes, writes them directly (`O_DIRECT`) where
//!    the filesystem allows, and makes each finished shard and its index durable inside the
//!    staging folder while the writer frames the next.
//!
//! Every file of the prepared version larger than a piece (its shards, in practice) has its
//! piece hashes taken as the sink hashes it, and handed to [`Job::keep_pieces`] once it is
//! committed, one file at a time: the caller stores this side data as the files come, so
//! none of it is held for the end.
//!
//! Batches in flight are bounded by a window of tokens the writer hands back as it finishes
//! each, so a slow reader cannot make the others pile up read bytes. The first failure stops
//! every thread and is what the derivation reports (a hash mismatch names its path); anything
//! already written stays in the staging folder, invisible, for the caller to remove.

use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, Mutex};

use serde::Serialize;
use sha2::{Digest, Sha256};
use stagehand_manifest::{Manifest, ManifestError};
use stagehand_mover::{CancellationToken, PosixTier, RateLimiter, TransferError};
use stagehand_policy::Packing;
use stagehand_schemas::FileRef;

use crate::plan::{Grouper, Placed, Planner, ProblemLog, Rules, Sample};
use crate::sample::{SHUFFLE_RULE, order_hash, split_key};
use crate::shard::{
    Bytes, KeepPieces, ShardError, ShardWriter, Sink, copy_file, write_file, write_shards,
};
use crate::sort::{Member, SortError, Sorter};
use stagehand_schemas::Retryable;

/// The file of a prepared version that describes it.
pub const PREPARED_FILE: &str = "prepared.json";
/// The file of a prepared version listing its incomplete samples (when it has any).
pub const INCOMPLETE_FILE: &str = "incomplete.jsonl";

/// How a derivation uses the machine.
#[derive(Debug, Clone)]
pub struct Tuning {
    /// Reader threads.
    pub read_threads: usize,
    /// Bytes of member data per batch handed to a reader.
    pub batch_bytes: u64,
    /// Batches read ahead of the writer (read, or being read, and not yet written).
    pub window: usize,
    /// Members larger than this are streamed by the writer rather than held in memory.
    pub stream_above: u64,
    /// Bytes of members the shuffle's sort holds before spilling a run.
    pub sort_run_bytes: usize,
    /// Where the sort's runs and the problem log go (unnamed temporary files).
    pub spool_dir: PathBuf,
    /// A bound on bytes read from the source per second.
    pub limiter: Option<Arc<RateLimiter>>,
}

/// What to derive.
pub struct Job<'a> {
    /// The raw version's files, beneath its prefix.
    pub source: &'a PosixTier,
    /// Where the prepared version's files are written (the set's staging folder).
    pub staging: &'a PosixTier,
    /// The raw version's manifest, verified.
    pub manifest: &'a Manifest,
    pub packing: &'a Packing,
    pub tuning: &'a Tuning,
    pub cancel: &'a CancellationToken,
    /// Takes the side data of each file written that is larger than a piece, once committed.
    pub keep_pieces: &'a KeepPieces<'a>,
}

/// What a derivation wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Derived {
    /// The prepared version's files (relative to its folder), in no particular order.
    pub files: Vec<FileRef>,
    pub shards: u32,
    pub samples: u64,
    pub members: u64,
    /// Bytes of the raw members packed.
    pub member_bytes: u64,
    /// Problems listed in `incomplete.jsonl` (warned or excluded).
    pub incomplete: u64,
}

/// Why a derivation failed.
#[derive(Debug, thiserror::Error)]
pub enum DeriveError {
    /// A member's bytes on the source are not those the upload recorded.
    #[error(
        "{path}: the source bytes hash to {found}, the raw version's manifest says {expected}; the derivation stops and publishes nothing"
    )]
    ChecksumMismatch {
        path: String,
        expected: String,
        found: String,
    },
    /// A member is no longer the size the upload recorded.
    #[error(
        "{path}: the source file is {found} bytes, the raw version's manifest says {expected}; the derivation stops and publishes nothing"
    )]
    SizeChanged {
        path: String,
        expected: u64,
        found: u64,
    },
    /// Reading the source or writing the staging folder failed.
    #[error(transparent)]
    Tier(#[from] TransferError),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    Sort(#[from] SortError),
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    /// The side data of a file written could not be handed on: whoever stores it stopped.
    #[error("the piece hashes of {file} could not be handed on to be stored")]
    SideData { file: String },
    /// The policy says abort and samples are incomplete: every problem is in `log`.
    #[error("incomplete samples under incomplete = \"abort\": {}", log.summary())]
    Incomplete { log: Box<ProblemLog> },
    /// Nothing is left to pack (every sample excluded, or an empty version).
    #[error("no sample to pack ({excluded} problem(s) excluded what there was)")]
    NothingToPack { excluded: u64 },
    #[error("the derivation was cancelled; nothing was published")]
    Cancelled,
    /// This thread stopped because another failed (never reported: the other's error is).
    #[error("stopped")]
    Stopped,
    /// A thread of the derivation ended without saying why.
    #[error("internal error: {0}")]
    Internal(String),
}

impl Retryable for DeriveError {
    /// Whether deriving again later can succeed (a tier or disk briefly failing, a shutdown),
    /// as opposed to a problem of the data or the policy.
    fn is_retryable(&self) -> bool {
        match self {
            DeriveError::ChecksumMismatch { .. }
            | DeriveError::SizeChanged { .. }
            | DeriveError::Incomplete { .. }
            | DeriveError::NothingToPack { .. }
            | DeriveError::Internal(_) => false,
            DeriveError::Tier(e) => e.is_retryable(),
            DeriveError::Manifest(e) => e.is_retryable(),
            DeriveError::Io { .. }
            | DeriveError::SideData { .. }
            | DeriveError::Sort(_)
            | DeriveError::Cancelled
            | DeriveError::Stopped => true,
        }
    }
}

impl From<ShardError> for DeriveError {
    fn from(e: ShardError) -> Self {
        match e {
            ShardError::Tier(e) => DeriveError::Tier(e),
            ShardError::Io { file, source } => DeriveError::Io {
                what: format!("writing {file}"),
                source,
            },
            ShardError::Mismatch {
                path,
                expected,
                found,
            } => DeriveError::ChecksumMismatch {
                path,
                expected,
                found,
            },
            ShardError::Abandoned(n) => {
                DeriveError::Internal(format!("shard {n} was left unfinished"))
            }
            ShardError::SideData { file } => DeriveError::SideData { file },
        }
    }
}

fn io_err(what: &str) -> impl FnOnce(io::Error) -> DeriveError + '_ {
    move |source| DeriveError::Io {
        what: what.to_owned(),
        source,
    }
}

/// `prepared.json`: what the version is and how it was made. Deterministic (no time, host or
/// dataset name), so it is part of what makes the same input and seed the same version.
#[derive(Debug, Serialize)]
struct PreparedDoc<'a> {
    layout: &'a str,
    derived_from: &'a str,
    seed: u64,
    shuffle: &'a str,
    shard_size: u64,
    shards: u32,
    shard_pattern: String,
    samples: u64,
    members: u64,
    member_bytes: u64,
    require_extensions: &'a [String],
    incomplete_policy: &'a str,
    incomplete: u64,
}

/// A batch of samples for the readers, numbered in plan order.
struct Batch {
    seq: u64,
    samples: Vec<(u32, Sample)>,
}

/// A member's bytes as a reader hands them over.
enum Data {
    Loaded(Vec<u8>),
    /// Left for the writer to stream (too large to hold).
    Stream,
}

struct ReadBatch {
    seq: u64,
    samples: Vec<(u32, Sample, Vec<Data>)>,
}

/// What stops every thread: the first real failure (later ones are its echo: a closed
/// channel), or the policy aborting (which stops the readers and the writer but not the
/// planner, which goes on to find every problem).
#[derive(Default)]
struct Halt {
    halted: AtomicBool,
    failed: AtomicBool,
    error: Mutex<Option<DeriveError>>,
}

impl Halt {
    /// Stops everything; `e` is what the derivation reports unless an earlier failure is.
    fn fail(&self, e: DeriveError) {
        if !matches!(e, DeriveError::Stopped) {
            let mut slot = self.error.lock().unwrap_or_else(|p| p.into_inner());
            if slot.is_none() {
                *slot = Some(e);
            }
            self.failed.store(true, Ordering::SeqCst);
        }
        self.stop();
    }

    /// Stops the readers and the writer.
    fn stop(&self) {
        self.halted.store(true, Ordering::SeqCst);
    }

    fn halted(&self) -> bool {
        self.halted.load(Ordering::SeqCst)
    }

    /// Whether a thread failed (not merely the policy aborting).
    fn failed(&self) -> bool {
        self.failed.load(Ordering::SeqCst)
    }

    fn take(&self) -> Option<DeriveError> {
        self.error.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

/// Runs one thread's work, turning its own failure into the halt.
fn guarded<T>(halt: &Halt, work: impl FnOnce() -> Result<T, DeriveError>) -> Option<T> {
    match work() {
        Ok(v) => Some(v),
        Err(e) => {
            halt.fail(e);
            None
        }
    }
}

/// What the planner found, for the writer's last step.
struct PlanOutcome {
    log: ProblemLog,
    aborted: bool,
    packed: u64,
    shards: u32,
}

/// Derives the prepared version of `job.manifest` into `job.staging` (blocking; see the
/// module docs). Nothing is published: the caller makes the staging folder visible.
pub fn derive(job: &Job<'_>) -> Result<Derived, DeriveError> {
    let tuning = job.tuning;
    let halt = Halt::default();
    let readers = tuning.read_threads.max(1);
    let (batch_tx, batch_rx) = sync_channel::<Batch>(1);
    let batch_rx = Arc::new(Mutex::new(batch_rx));
    let (read_tx, read_rx) = sync_channel::<ReadBatch>(readers + 1);
    let window = tuning.window.max(readers + 1);
    let (token_tx, token_rx) = sync_channel::<()>(window);
    for _ in 0..window {
        token_tx
            .send(())
            .map_err(|_| DeriveError::Internal("the token window".into()))?;
    }

    let (plan, written) = std::thread::scope(|scope| {
        let halt = &halt;
        let planner = scope.spawn(move || guarded(halt, || plan(job, batch_tx, token_rx, halt)));
        for _ in 0..readers {
            let rx = batch_rx.clone();
            let tx = read_tx.clone();
            scope.spawn(move || guarded(halt, || read_loop(job, &rx, &tx, halt)));
        }
        drop(batch_rx);
        drop(read_tx);
        let written = guarded(halt, || write_all(job, &read_rx, &token_tx, halt));
        // The writer is done: a planner waiting for a token must see the window close.
        drop(token_tx);
        drop(read_rx);
        let plan = planner.join().unwrap_or_else(|_| {
            halt.fail(DeriveError::Internal("the planner panicked".into()));
            None
        });
        (plan, written)
    });

    if let Some(e) = halt.take() {
        return Err(e);
    }
    if job.cancel.is_cancelled() {
        return Err(DeriveError::Cancelled);
    }
    let Some(plan) = plan else {
        return Err(DeriveError::Internal(
            "the planner stopped without an error".into(),
        ));
    };
    if plan.aborted {
        return Err(DeriveError::Incomplete {
            log: Box::new(plan.log),
        });
    }
    let Some(mut written) = written else {
        return Err(DeriveError::Internal(
            "the writer stopped without an error".into(),
        ));
    };
    if plan.packed == 0 {
        return Err(DeriveError::NothingToPack {
            excluded: plan.log.total(),
        });
    }
    if written.samples != plan.packed || written.shards != plan.shards {
        return Err(DeriveError::Internal(format!(
            "planned {} samples in {} shards, wrote {} in {}",
            plan.packed, plan.shards, written.samples, written.shards
        )));
    }
    let incomplete = plan.log.total();
    if incomplete > 0 {
        let (mut file, len) = plan
            .log
            .into_file()
            .map_err(io_err("reading the problem log"))?;
        let (size, sha) = copy_file(
            job.staging,
            INCOMPLETE_FILE,
            &mut file,
            len,
            job.keep_pieces,
        )?;
        written.files.push(FileRef::new(INCOMPLETE_FILE, size, sha));
    }
    let packing = job.packing;
    let doc = PreparedDoc {
        layout: packing.layout.as_str(),
        derived_from: job.manifest.digest(),
        seed: packing.seed,
        shuffle: SHUFFLE_RULE,
        shard_size: packing.shard_size,
        shards: written.shards,
        shard_pattern: format!(
            "shard-{{000000..{:06}}}.tar",
            written.shards.saturating_sub(1)
        ),
        samples: written.samples,
        members: written.members,
        member_bytes: written.member_bytes,
        require_extensions: &packing.require_extensions,
        incomplete_policy: packing.incomplete.as_str(),
        incomplete,
    };
    let mut bytes = serde_json::to_vec_pretty(&doc).map_err(|e| DeriveError::Io {
        what: format!("encoding {PREPARED_FILE}"),
        source: io::Error::other(e),
    })?;
    bytes.push(b'\n');
    let (size, sha) = write_file(job.staging, PREPARED_FILE, &bytes, job.keep_pieces)?;
    written.files.push(FileRef::new(PREPARED_FILE, size, sha));
    Ok(Derived {
        files: written.files,
        shards: written.shards,
        samples: written.samples,
        members: written.members,
        member_bytes: written.member_bytes,
        incomplete,
    })
}

/// The planner thread (see the module docs).
fn plan(
    job: &Job<'_>,
    batch_tx: SyncSender<Batch>,
    token_rx: Receiver<()>,
    halt: &Halt,
) -> Result<PlanOutcome, DeriveError> {
    let tuning = job.tuning;
    let packing = job.packing;
    let dir = &tuning.spool_dir;
    let mut log = ProblemLog::new(dir).map_err(io_err("creating the problem log"))?;
    let mut planner = Planner::new(Rules {
        require_extensions: packing.require_extensions.clone(),
        incomplete: packing.incomplete,
        shard_size: packing.shard_size,
    });
    // Not `halted`: the policy aborting stops the others, while this goes on to list every
    // problem.
    let stopped = || halt.failed() || job.cancel.is_cancelled();

    // Pass 1: the manifest in path order into the shuffle's sort.
    let mut sorter = Sorter::new(dir, tuning.sort_run_bytes);
    for (i, entry) in job.manifest.entries().enumerate() {
        if i % 4096 == 0 && stopped() {
            return Err(DeriveError::Stopped);
        }
        let file = entry?;
        match split_key(&file.path) {
            None => planner
                .no_sample(&file.path, &mut log)
                .map_err(io_err("writing the problem log"))?,
            Some((key, _)) => {
                let member = Member {
                    order: order_hash(packing.seed, key),
                    key_len: key.len(),
                    path: file.path,
                    size: file.size,
                    sha256: file.sha256,
                };
                sorter.push(member)?;
            }
        }
    }

    // Pass 2: samples in the seeded order, placed and sent to the readers in batches.
    let mut batch = Batch {
        seq: 0,
        samples: Vec::new(),
    };
    let mut batch_bytes = 0u64;
    let mut seq = 0u64;
    let send = |batch: Batch| -> Result<(), DeriveError> {
        // A token per batch in flight; none comes back once the writer has stopped.
        token_rx.recv().map_err(|_| DeriveError::Stopped)?;
        batch_tx.send(batch).map_err(|_| DeriveError::Stopped)
    };
    let mut place = |sample: Sample,
                     planner: &mut Planner,
                     log: &mut ProblemLog,
                     batch: &mut Batch,
                     batch_bytes: &mut u64|
     -> Result<(), DeriveError> {
        match planner
            .place(sample, log)
            .map_err(io_err("writing the problem log"))?
        {
            Placed::Pack { shard, sample } => {
                *batch_bytes += sample.data_bytes();
                batch.samples.push((shard, sample));
                if *batch_bytes >= tuning.batch_bytes || batch.samples.len() >= 4096 {
                    seq += 1;
                    let full = std::mem::replace(
                        batch,
                        Batch {
                            seq,
                            samples: Vec::new(),
                        },
                    );
                    *batch_bytes = 0;
                    send(full)?;
                }
            }
            Placed::Excluded => {}
            Placed::Aborted => {
                // Every problem is still looked for; nothing more is read or written.
                halt.stop();
                batch.samples.clear();
                *batch_bytes = 0;
            }
        }
        Ok(())
    };
    let mut grouper = Grouper::new();
    for (i, member) in sorter.finish()?.enumerate() {
        if i % 4096 == 0 && stopped() {
            return Err(DeriveError::Stopped);
        }
        if let Some(sample) = grouper.push(member?) {
            place(sample, &mut planner, &mut log, &mut batch, &mut batch_bytes)?;
        }
    }
    if let Some(sample) = grouper.finish() {
        place(sample, &mut planner, &mut log, &mut batch, &mut batch_bytes)?;
    }
    if !batch.samples.is_empty() && !planner.aborted {
        send(batch)?;
    }
    Ok(PlanOutcome {
        aborted: planner.aborted,
        packed: planner.packed,
        shards: planner.shards(),
        log,
    })
}

/// A reader thread: batches in, proven bytes out.
fn read_loop(
    job: &Job<'_>,
    rx: &Mutex<Receiver<Batch>>,
    tx: &SyncSender<ReadBatch>,
    halt: &Halt,
) -> Result<(), DeriveError> {
    loop {
        let batch = {
            let rx = rx.lock().unwrap_or_else(|p| p.into_inner());
            rx.recv()
        };
        let Ok(batch) = batch else { return Ok(()) };
        if halt.halted() || job.cancel.is_cancelled() {
            return Err(DeriveError::Stopped);
        }
        let read = read_batch(job, batch)?;
        if tx.send(read).is_err() {
            return Err(DeriveError::Stopped);
        }
    }
}

fn read_batch(job: &Job<'_>, batch: Batch) -> Result<ReadBatch, DeriveError> {
    let mut samples = Vec::with_capacity(batch.samples.len());
    for (shard, sample) in batch.samples {
        let mut data = Vec::with_capacity(sample.members.len());
        for member in &sample.members {
            if member.size > job.tuning.stream_above {
                data.push(Data::Stream);
            } else {
                data.push(Data::Loaded(read_member(job, member)?));
            }
        }
        samples.push((shard, sample, data));
    }
    Ok(ReadBatch {
        seq: batch.seq,
        samples,
    })
}

/// Opens a member on the source (confined, a regular file) and checks its size.
fn open_member(job: &Job<'_>, member: &Member) -> Result<File, DeriveError> {
    let file = job.source.open_read(&member.path)?;
    let found = file
        .metadata()
        .map_err(|e| DeriveError::Io {
            what: format!("stat {}", member.path),
            source: e,
        })?
        .len();
    if found != member.size {
        return Err(DeriveError::SizeChanged {
            path: member.path.clone(),
            expected: member.size,
            found,
        });
    }
    if let Some(limiter) = &job.tuning.limiter {
        limiter.take_blocking(member.size);
    }
    Ok(file)
}

/// Reads a member whole, hashes it and compares with the manifest.
fn read_member(job: &Job<'_>, member: &Member) -> Result<Vec<u8>, DeriveError> {
    let file = open_member(job, member)?;
    let mut buf = vec![0u8; member.size as usize];
    let mut done = 0usize;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], done as u64) {
            Ok(0) => {
                return Err(DeriveError::SizeChanged {
                    path: member.path.clone(),
                    expected: member.size,
                    found: done as u64,
                });
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                return Err(DeriveError::Io {
                    what: format!("reading {} on the source", member.path),
                    source: e,
                });
            }
        }
    }
    let found = hex::encode(Sha256::digest(&buf));
    if found != member.sha256 {
        return Err(DeriveError::ChecksumMismatch {
            path: member.path.clone(),
            expected: member.sha256.clone(),
            found,
        });
    }
    Ok(buf)
}

/// What the writer wrote.
struct Written {
    files: Vec<FileRef>,
    shards: u32,
    samples: u64,
    members: u64,
    member_bytes: u64,
}

/// The writer: read batches back in plan order, framed into shards while the sink's threads
/// hash, write and commit them ([`write_shards`]).
fn write_all(
    job: &Job<'_>,
    rx: &Receiver<ReadBatch>,
    tokens: &SyncSender<()>,
    halt: &Halt,
) -> Result<Written, DeriveError> {
    let (mut written, shards) = write_shards(
        job.staging,
        job.packing.shard_size,
        job.keep_pieces,
        |sink| frame_all(job, sink, rx, tokens, halt),
    )?;
    written.shards = shards.len() as u32;
    for shard in shards {
        for (name, size, sha) in shard {
            written.files.push(FileRef::new(name, size, sha));
        }
    }
    Ok(written)
}

fn frame_all(
    job: &Job<'_>,
    sink: &Sink,
    rx: &Receiver<ReadBatch>,
    tokens: &SyncSender<()>,
    halt: &Halt,
) -> Result<Written, DeriveError> {
    let mut written = Written {
        files: Vec::new(),
        shards: 0,
        samples: 0,
        members: 0,
        member_bytes: 0,
    };
    let mut pending: BTreeMap<u64, ReadBatch> = BTreeMap::new();
    let mut next = 0u64;
    let mut shard: Option<ShardWriter> = None;
    for read in rx.iter() {
        pending.insert(read.seq, read);
        while let Some(read) = pending.remove(&next) {
            for (number, sample, data) in read.samples {
                if halt.halted() || job.cancel.is_cancelled() {
                    return Err(DeriveError::Stopped);
                }
                if shard.as_ref().is_none_or(|s| s.number != number) {
                    if let Some(done) = shard.take() {
                        done.finish()?;
                    }
                    shard = Some(ShardWriter::create(sink, number)?);
                }
                let writer = shard.as_mut().expect("a shard is open");
                let mut members = Vec::with_capacity(sample.members.len());
                for (member, d) in sample.members.iter().zip(&data) {
                    let bytes = match d {
                        Data::Loaded(bytes) => Bytes::Loaded(bytes),
                        Data::Stream => Bytes::Stream(Box::new(open_member(job, member)?)),
                    };
                    members.push((member, bytes));
                }
                writer.add_sample(&sample.key, members)?;
                written.samples += 1;
                written.members += sample.members.len() as u64;
                written.member_bytes += sample.data_bytes();
            }
            next += 1;
            // The batch is written: one more may be read.
            let _ = tokens.send(());
        }
    }
    if halt.halted() {
        return Err(DeriveError::Stopped);
    }
    if let Some(done) = shard.take() {
        done.finish()?;
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use stagehand_policy::{IncompletePolicy, ShardLayout};
    use stagehand_schemas::sha256_hex;

    use super::*;

    fn tuning(
        spool: &Path,
        read_threads: usize,
        batch_bytes: u64,
        sort_run_bytes: usize,
    ) -> Tuning {
        Tuning {
            read_threads,
            batch_bytes,
            window: 2 * read_threads + 2,
            stream_above: 16 << 20,
            sort_run_bytes,
            spool_dir: spool.to_owned(),
            limiter: None,
        }
    }

    fn packing(incomplete: IncompletePolicy) -> Packing {
        Packing {
            layout: ShardLayout::Webdataset,
            seed: 3,
            shard_size: 1 << 20,
            require_extensions: vec!["cls".into()],
            incomplete,
            target_tier: "capacity".into(),
        }
    }

    /// `n` samples `s/NNNNN` of a `.bin` (a few hundred bytes) and a `.cls`, on disk.
    fn source(root: &Path, n: usize) -> Manifest {
        let mut files = Vec::new();
        for i in 0..n {
            let mut put = |path: String, data: Vec<u8>| {
                let full = root.join(&path);
                std::fs::create_dir_all(full.parent().unwrap()).unwrap();
                std::fs::write(&full, &data).unwrap();
                files.push(FileRef::new(path, data.len() as u64, sha256_hex(&data)));
            };
            put(
                format!("s/{i:05}.bin"),
                vec![(i % 251) as u8; 100 + i % 400],
            );
            put(format!("s/{i:05}.cls"), (i % 10).to_string().into_bytes());
        }
        Manifest::from_entries(files)
    }

    fn run(
        src: &Path,
        out: &Path,
        manifest: &Manifest,
        packing: &Packing,
        tuning: &Tuning,
    ) -> Result<Derived, DeriveError> {
        std::fs::create_dir_all(out).unwrap();
        let source = PosixTier::open("source", src).unwrap();
        let staging = PosixTier::open("capacity", out).unwrap();
        derive(&Job {
            source: &source,
            staging: &staging,
            manifest,
            packing,
            tuning,
            cancel: &CancellationToken::new(),
            keep_pieces: &|_, _| Ok(()),
        })
    }

    /// The bytes of a prepared version must not depend on how the work was spread: reader
    /// threads, batch sizes and the sort's spilled runs change timing, never output.
    #[test]
    fn the_output_does_not_depend_on_threads_batches_or_sort_runs() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        let manifest = source(&src, 500);
        let p = Packing {
            shard_size: 256 << 10,
            ..packing(IncompletePolicy::Abort)
        };
        let one = run(
            &src,
            &dir.path().join("one"),
            &manifest,
            &p,
            &tuning(dir.path(), 1, 1 << 30, usize::MAX),
        )
        .unwrap();
        let many = run(
            &src,
            &dir.path().join("many"),
            &manifest,
            &p,
            &tuning(dir.path(), 4, 64 << 10, 16 << 10),
        )
        .unwrap();
        assert_eq!(one.samples, 500);
        assert!(one.shards >= 2, "{} shards", one.shards);
        let mut a = one.files.clone();
        let mut b = many.files.clone();
        a.sort_by(|x, y| x.path.cmp(&y.path));
        b.sort_by(|x, y| x.path.cmp(&y.path));
        assert_eq!(a, b);
    }

    /// Guards "abort with every problem": problems far apart in a large version (beyond the
    /// planner's periodic stop checks) are all listed, and nothing is read or packed. A file
    /// without a sample comes first in path order, so the policy aborts before any member is
    /// sent to a reader: the manifest's files need not exist.
    #[test]
    fn abort_lists_every_problem_of_a_large_version() {
        let dir = tempfile::tempdir().unwrap();
        let missing = |i: usize| i % 1000 == 7;
        let mut files = vec![FileRef::new("README", 1, sha256_hex(b"x"))];
        for i in 0..9000 {
            files.push(FileRef::new(format!("s/{i:05}.bin"), 1, sha256_hex(b"b")));
            if !missing(i) {
                files.push(FileRef::new(format!("s/{i:05}.cls"), 1, sha256_hex(b"c")));
            }
        }
        let manifest = Manifest::from_entries(files);
        let err = run(
            dir.path(),
            &dir.path().join("out"),
            &manifest,
            &packing(IncompletePolicy::Abort),
            &tuning(dir.path(), 2, 64 << 10, 256 << 10),
        )
        .unwrap_err();
        let DeriveError::Incomplete { log } = err else {
            panic!("{err}")
        };
        assert_eq!(log.total(), 10);
        assert_eq!(log.counts().get("missing_extension"), Some(&9));
        assert_eq!(log.counts().get("no_sample_key"), Some(&1));
        let (mut file, _) = log.into_file().unwrap();
        let mut text = String::new();
        std::io::Read::read_to_string(&mut file, &mut text).unwrap();
        let mut keys: Vec<String> = text
            .lines()
            .skip(1)
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["key"]
                    .as_str()
                    .unwrap()
                    .to_owned()
            })
            .collect();
        keys.sort();
        let want: Vec<String> = (0..9000)
            .filter(|&i| missing(i))
            .map(|i| format!("s/{i:05}"))
            .collect();
        assert_eq!(keys, want);
        assert!(names_in(&dir.path().join("out")).is_empty());
    }

    fn names_in(dir: &Path) -> Vec<String> {
        std::fs::read_dir(dir)
            .map(|d| {
                d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    }
}
