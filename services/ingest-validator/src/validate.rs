//! One request's manifest, validated as a stream in memory bounded by a constant.
//!
//! Entries arrive from `stagehand-manifest` in path order, a chunk at a time. Each is judged
//! by the entry step ([`EntryChecks`]) and, when worth reading, handed to a read task: up to
//! [`ReadOptions::concurrency`] files are read and hashed at once, each on its own task (the
//! posix reads on blocking threads), so both cores hash whether the files are large or small.
//! Results are reported in path order through a window of at most [`ReadOptions::window`]
//! entries: a slow file at the head holds back the reporting of the entries after it, never
//! the reading of the next `concurrency` ones, and memory stays bounded whatever the file
//! count. What is reported goes into [`Findings`] (the event's tally and the report on disk).
//!
//! A read task that found a file's SHA-256 and its piece hashes (a file larger than a piece)
//! stores them ([`PieceStore`]) before it ends, so every file's side data is stored before
//! the verdict, and none is held for the end.
//!
//! Along the way it measures the version: the SHA-256 over the manifest lines of what was
//! *read* (path, size and hash found), in path order. When nothing is wrong, that is the
//! version digest the validator publishes.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use sha2::{Digest, Sha256};
use stagehand_manifest::{DEFAULT_CHUNK, Manifest, ManifestError};
use stagehand_mover::{ReadLimit, TransferError};
use stagehand_policy::ValidationPolicy;
use stagehand_schemas::{FileRef, Problem};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::check::{self, EntryChecks, Observed};
use crate::pieces::PieceStore;
use crate::report::{Findings, ReportError};
use crate::source::SourceFiles;

/// How the read step runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadOptions {
    /// Files read and hashed at once.
    pub concurrency: usize,
    /// Entries judged or being read but not yet reported, at most. About 200 bytes each.
    pub window: usize,
    /// How often progress is reported while files are read.
    pub progress_every: Duration,
}

impl Default for ReadOptions {
    fn default() -> Self {
        ReadOptions {
            concurrency: 8,
            window: 16 * 1024,
            progress_every: Duration::from_secs(1),
        }
    }
}

/// How far the read step has got. `bytes_done` counts the declared size of every entry
/// judged (read, or found wrong without reading), so it reaches `bytes_total` at the end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadProgress {
    pub files_done: u64,
    pub files_total: u64,
    pub bytes_done: u64,
    pub bytes_total: u64,
    /// Since the read step started.
    pub elapsed: Duration,
}

/// What one file costs besides its bytes (opening, a stat, a task), in bytes hashed: for the
/// estimate of the time left, which weighs files and bytes together.
const PER_FILE_COST_BYTES: u64 = 64 * 1024;

impl ReadProgress {
    /// The time left at the rate so far, once anything is done.
    pub fn eta(&self) -> Option<Duration> {
        let weight =
            |files: u64, bytes: u64| (bytes as f64) + (files as f64) * (PER_FILE_COST_BYTES as f64);
        let done = weight(self.files_done, self.bytes_done);
        let total = weight(self.files_total, self.bytes_total);
        if done <= 0.0 || self.elapsed.is_zero() {
            return None;
        }
        let left = (total - done).max(0.0) / done * self.elapsed.as_secs_f64();
        Some(Duration::from_secs_f64(left))
    }
}

/// What the read step measured: the digest over the lines of what was read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Measured {
    /// SHA-256 over `path\tsize\tsha256\n` of every entry in path order, with the size and
    /// hash *found* for the entries read (the declared ones for entries not read, when
    /// there were problems and the digest means nothing).
    pub digest: String,
    pub files: u64,
    pub bytes: u64,
}

/// Why the read step could not finish. Every case is worth a retry: nothing was decided.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ValidateError {
    /// The source tier failed (unreachable, an I/O error).
    #[error(transparent)]
    Tier(#[from] TransferError),
    /// The spooled manifest could not be read back.
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    /// The report could not be spooled.
    #[error(transparent)]
    Report(#[from] ReportError),
    /// The side data of a file read could not be stored (NATS failed).
    #[error("storing the piece hashes of {path}: {source}")]
    SideData {
        path: String,
        #[source]
        source: ManifestError,
    },
    /// A read task panicked or was cancelled.
    #[error("a read task failed: {0}")]
    Task(String),
}

/// One entry between being judged and being reported.
struct Slot {
    file: FileRef,
    problems: Vec<Problem>,
    state: State,
}

enum State {
    /// Nothing to read.
    Judged,
    Reading,
    Read(Observed),
}

impl Slot {
    fn is_done(&self) -> bool {
        !matches!(self.state, State::Reading)
    }
}

/// The entries of `manifest`, in path order, and the next chunk of them.
struct EntryStream<S> {
    chunks: std::pin::Pin<Box<S>>,
    current: std::vec::IntoIter<FileRef>,
}

impl<S> EntryStream<S>
where
    S: futures::Stream<Item = Result<Vec<FileRef>, ManifestError>>,
{
    async fn next(&mut self) -> Result<Option<FileRef>, ManifestError> {
        loop {
            if let Some(file) = self.current.next() {
                return Ok(Some(file));
            }
            match self.chunks.next().await {
                Some(chunk) => self.current = chunk?.into_iter(),
                None => return Ok(None),
            }
        }
    }
}

/// Reads the file at `rel` and stores the side data the read found, keyed by the SHA-256
/// found: one read task.
async fn observe_and_keep<S: SourceFiles, K: PieceStore>(
    source: &S,
    pieces: &K,
    rel: String,
    limit: ReadLimit,
) -> Result<Observed, ValidateError> {
    let observation = source.observe(&rel, limit).await?;
    if let (Observed::Digest(found), Some(side)) = (&observation.observed, &observation.pieces) {
        pieces
            .put_pieces(&found.sha256, side)
            .await
            .map_err(|source| ValidateError::SideData { path: rel, source })?;
    }
    Ok(observation.observed)
}

/// Validates every entry of `manifest` (read beneath `prefix` on `source`), reporting every
/// problem into `findings` and storing the side data of every file read that is larger than
/// a piece into `pieces`; `progress` is awaited about every [`ReadOptions::progress_every`],
/// once at the start and once at the end.
///
/// `Err` means a retry can help (the tier is unreachable, a disk failed, side data could not
/// be stored): nothing is decided.
#[allow(clippy::too_many_arguments)]
pub async fn validate<S, K, P, F>(
    manifest: &Manifest,
    prefix: &str,
    policy: &ValidationPolicy,
    source: &Arc<S>,
    pieces: &Arc<K>,
    options: &ReadOptions,
    findings: &mut Findings,
    mut progress: P,
) -> Result<Measured, ValidateError>
where
    S: SourceFiles + 'static,
    K: PieceStore + 'static,
    P: FnMut(ReadProgress) -> F,
    F: Future<Output = ()>,
{
    let concurrency = options.concurrency.max(1);
    let window_max = options.window.max(concurrency);
    let started = Instant::now();
    let mut status = ReadProgress {
        files_done: 0,
        files_total: manifest.files(),
        bytes_done: 0,
        bytes_total: manifest.bytes(),
        elapsed: Duration::ZERO,
    };
    progress(status).await;
    let mut next_report = started + options.progress_every;

    let mut entries = EntryStream {
        chunks: Box::pin(manifest.chunks(DEFAULT_CHUNK)),
        current: Vec::new().into_iter(),
    };
    let mut exhausted = false;
    let mut checks = EntryChecks::new(policy);
    let mut window: VecDeque<Slot> = VecDeque::new();
    // The manifest index of `window[0]`, and of the next entry admitted.
    let mut base: u64 = 0;
    let mut next_index: u64 = 0;
    // Dropping the set (an error, or the handler's future dropped at shutdown) aborts every
    // read still running.
    let mut reads: JoinSet<(u64, Result<Observed, ValidateError>)> = JoinSet::new();
    let mut measured = Sha256::new();
    let mut measured_bytes = 0u64;

    loop {
        // Report every finished entry at the head, in path order.
        while window.front().is_some_and(Slot::is_done) {
            let slot = window.pop_front().expect("the front was just seen");
            base += 1;
            let Slot {
                file,
                problems,
                state,
            } = slot;
            for problem in problems {
                findings.add(problem)?;
            }
            match &state {
                State::Read(Observed::Digest(found)) => {
                    measured.update(file.path.as_bytes());
                    measured.update(format!("\t{}\t{}\n", found.size, found.sha256).as_bytes());
                    measured_bytes += found.size;
                }
                _ => measured.update(file.manifest_line().as_bytes()),
            }
            if let State::Read(observed) = &state {
                for problem in check::compare(&file, observed, policy) {
                    findings.add(problem)?;
                }
            }
            status.files_done += 1;
            status.bytes_done = status.bytes_done.saturating_add(file.size);
        }
        if Instant::now() >= next_report {
            status.elapsed = started.elapsed();
            progress(status).await;
            next_report = Instant::now() + options.progress_every;
        }
        // Admit the next entry while there is room to read it and to hold it.
        if !exhausted && window.len() < window_max && reads.len() < concurrency {
            let Some(file) = entries.next().await? else {
                exhausted = true;
                continue;
            };
            let judged = checks.check(&file);
            let state = if judged.read {
                let rel = check::tier_path(prefix, &file.path);
                let limit = ReadLimit::declared(file.size, Some(policy.max_file_size));
                let (source, pieces) = (Arc::clone(source), Arc::clone(pieces));
                let index = next_index;
                reads.spawn(async move {
                    let observed = observe_and_keep(&*source, &*pieces, rel, limit).await;
                    (index, observed)
                });
                State::Reading
            } else {
                State::Judged
            };
            window.push_back(Slot {
                file,
                problems: judged.problems,
                state,
            });
            next_index += 1;
            continue;
        }
        if window.is_empty() {
            // Nothing held and nothing to admit: every entry was reported.
            break;
        }
        // The head is being read (else it was reported above): wait for a read, or for the
        // next progress report.
        tokio::select! {
            joined = reads.join_next() => {
                let (index, result) = match joined {
                    Some(Ok(done)) => done,
                    Some(Err(e)) => return Err(ValidateError::Task(e.to_string())),
                    None => return Err(ValidateError::Task(
                        "no read is running, but the head of the window waits for one".into(),
                    )),
                };
                let observed = result?;
                let at = usize::try_from(index - base).expect("the window is small");
                window[at].state = State::Read(observed);
            }
            _ = tokio::time::sleep_until(next_report) => {}
        }
    }
    status.elapsed = started.elapsed();
    progress(status).await;
    Ok(Measured {
        digest: hex::encode(measured.finalize()),
        files: status.files_done,
        bytes: measured_bytes,
    })
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::Mutex;

    use stagehand_mover::{ErrorKind, FileDigest, Mover, Side};
    use stagehand_schemas::{EventId, Location, Retryable, sha256_hex, version_digest};

    use super::*;
    use crate::report::{ReportHeader, SpooledReport, Tallied};
    use crate::source::Observation;
    use stagehand_schemas::pieces::PieceHashes;

    /// An in-memory tier: path → observation, or an error for every read. Records the most
    /// reads seen running at once.
    #[derive(Debug, Default)]
    struct Fake {
        files: HashMap<String, Observed>,
        /// Side data the read of a path finds.
        pieces: HashMap<String, PieceHashes>,
        fail: Option<ErrorKind>,
        delay: Duration,
        running: Mutex<(usize, usize)>,
    }

    impl SourceFiles for Fake {
        async fn observe(&self, rel: &str, limit: ReadLimit) -> Result<Observation, TransferError> {
            {
                let mut r = self.running.lock().unwrap();
                r.0 += 1;
                r.1 = r.1.max(r.0);
            }
            if !self.delay.is_zero() {
                tokio::time::sleep(self.delay).await;
            }
            self.running.lock().unwrap().0 -= 1;
            if let Some(kind) = self.fail {
                return Err(TransferError::new(kind, Side::Source, "fake", rel, "down"));
            }
            let observed = match self.files.get(rel).cloned() {
                // As the mover does: a size other than the declared one is found unread.
                Some(Observed::Digest(d)) if Some(d.size) != limit.declared_size => {
                    Observed::SizeDiffers(format!("{} bytes", d.size))
                }
                Some(other) => other,
                None => Observed::Missing,
            };
            let pieces = matches!(observed, Observed::Digest(_))
                .then(|| self.pieces.get(rel).cloned())
                .flatten();
            Ok(Observation { observed, pieces })
        }
        async fn put_report(&self, _: &Mover, _: &SpooledReport) -> Result<(), TransferError> {
            Ok(())
        }
        fn describe(&self, rel: &str) -> String {
            rel.to_owned()
        }
    }

    /// Records the side data stored, or fails every put as NATS would.
    #[derive(Debug, Default)]
    struct Kept {
        stored: Mutex<Vec<(String, PieceHashes)>>,
        fail: bool,
    }

    impl PieceStore for Kept {
        async fn put_pieces(&self, sha: &str, pieces: &PieceHashes) -> Result<(), ManifestError> {
            if self.fail {
                return Err(ManifestError::new(
                    stagehand_manifest::ManifestErrorKind::Nats,
                    "piece hashes",
                    "no responders",
                ));
            }
            self.stored
                .lock()
                .unwrap()
                .push((sha.to_owned(), pieces.clone()));
            Ok(())
        }
    }

    fn policy() -> ValidationPolicy {
        ValidationPolicy {
            max_file_size: 1 << 20,
            max_entries: 100,
            max_total_bytes: 1 << 30,
            allowed_suffixes: vec![],
            denied_suffixes: vec![],
            allow_hidden: false,
        }
    }

    fn digest(bytes: &[u8]) -> Observed {
        Observed::Digest(FileDigest {
            size: bytes.len() as u64,
            sha256: sha256_hex(bytes),
        })
    }

    fn findings() -> Findings {
        Findings::new(
            ReportHeader {
                request_id: EventId::new("r").unwrap(),
                project: "p".into(),
                dataset: "d".into(),
                requested_by: "alice".into(),
                source: Location {
                    tier: "source".into(),
                    prefix: "up".into(),
                },
                declared_version: String::new(),
            },
            None,
        )
    }

    async fn run(
        fake: Fake,
        files: Vec<FileRef>,
    ) -> Result<(Measured, Tallied, Arc<Fake>), ValidateError> {
        run_keeping(fake, files, &Arc::new(Kept::default())).await
    }

    async fn run_keeping(
        fake: Fake,
        files: Vec<FileRef>,
        kept: &Arc<Kept>,
    ) -> Result<(Measured, Tallied, Arc<Fake>), ValidateError> {
        let fake = Arc::new(fake);
        let mut found = findings();
        let options = ReadOptions {
            concurrency: 3,
            ..ReadOptions::default()
        };
        let measured = validate(
            &Manifest::from_entries(files),
            "up",
            &policy(),
            &fake,
            kept,
            &options,
            &mut found,
            |_| async {},
        )
        .await?;
        let (tallied, _) = found.finish().unwrap();
        Ok((measured, tallied, fake))
    }

    fn listed(t: &Tallied) -> Vec<(&str, &str)> {
        t.listed
            .iter()
            .map(|p| (p.code.as_str(), p.path.as_deref().unwrap()))
            .collect()
    }

    #[tokio::test]
    async fn valid_when_every_file_matches_and_the_measured_digest_is_the_version() {
        let fake = Fake {
            files: HashMap::from([
                ("up/a".to_owned(), digest(b"abc")),
                ("up/b/c".to_owned(), digest(b"")),
            ]),
            ..Fake::default()
        };
        let files = vec![
            FileRef::new("b/c", 0, sha256_hex(b"")),
            FileRef::new("a", 3, sha256_hex(b"abc")),
        ];
        let (measured, tallied, _) = run(fake, files.clone()).await.unwrap();
        assert_eq!(tallied.total, 0);
        assert_eq!(measured.digest, version_digest(&files));
        assert_eq!((measured.files, measured.bytes), (2, 3));
    }

    #[tokio::test]
    async fn every_problem_is_reported_in_path_order() {
        let fake = Fake {
            files: HashMap::from([
                ("up/short".to_owned(), digest(b"ab")),
                ("up/wrong".to_owned(), digest(b"xyz")),
                (
                    "up/dir".to_owned(),
                    Observed::NotAFile("a directory".into()),
                ),
            ]),
            // Reads finish out of order; the report is in path order all the same.
            delay: Duration::from_millis(2),
            ..Fake::default()
        };
        let sha = sha256_hex(b"abc");
        let files = vec![
            FileRef::new("wrong", 3, &sha),
            FileRef::new("short", 3, &sha),
            FileRef::new("gone", 3, &sha),
            FileRef::new("dir", 3, &sha),
            FileRef::new("../x", 3, &sha),
            FileRef::new("gone", 3, &sha),
        ];
        let (_, tallied, _) = run(fake, files).await.unwrap();
        assert_eq!(
            listed(&tallied),
            vec![
                ("path_rule", "../x"),
                ("not_a_file", "dir"),
                ("missing", "gone"),
                ("duplicate_path", "gone"),
                ("size_mismatch", "short"),
                ("checksum_mismatch", "wrong"),
            ]
        );
    }

    #[tokio::test]
    async fn an_unreachable_tier_decides_nothing() {
        let fake = Fake {
            fail: Some(ErrorKind::Unreachable),
            ..Fake::default()
        };
        let err = run(fake, vec![FileRef::new("a", 3, sha256_hex(b"abc"))])
            .await
            .unwrap_err();
        assert!(matches!(err, ValidateError::Tier(e) if e.is_retryable()));
    }

    /// The side data a read found is stored under the SHA-256 found, even when that is not
    /// the declared one (it is true of those bytes), and only for files read.
    #[tokio::test]
    async fn side_data_is_stored_by_the_hash_found_as_each_read_ends() {
        let side = |n: u8| PieceHashes {
            size: 3,
            pieces: vec![[n; 32]],
        };
        let fake = Fake {
            files: HashMap::from([
                ("up/a".to_owned(), digest(b"abc")),
                ("up/b".to_owned(), digest(b"xyz")),
                ("up/c".to_owned(), digest(b"ccc")),
            ]),
            pieces: HashMap::from([
                ("up/a".to_owned(), side(1)),
                ("up/b".to_owned(), side(2)),
                ("up/gone".to_owned(), side(3)),
            ]),
            ..Fake::default()
        };
        let files = vec![
            FileRef::new("a", 3, sha256_hex(b"abc")),
            FileRef::new("b", 3, sha256_hex(b"abc")),
            FileRef::new("c", 3, sha256_hex(b"ccc")),
            FileRef::new("gone", 3, sha256_hex(b"abc")),
        ];
        let kept = Arc::new(Kept::default());
        let (_, tallied, _) = run_keeping(fake, files, &kept).await.unwrap();
        assert_eq!(tallied.total, 2, "b's checksum and gone's absence");
        let mut stored = kept.stored.lock().unwrap().clone();
        stored.sort_by(|x, y| x.1.pieces.cmp(&y.1.pieces));
        assert_eq!(
            stored,
            vec![(sha256_hex(b"abc"), side(1)), (sha256_hex(b"xyz"), side(2))]
        );
    }

    #[tokio::test]
    async fn side_data_that_cannot_be_stored_decides_nothing() {
        let fake = Fake {
            files: HashMap::from([("up/a".to_owned(), digest(b"abc"))]),
            pieces: HashMap::from([(
                "up/a".to_owned(),
                PieceHashes {
                    size: 3,
                    pieces: vec![[0; 32]],
                },
            )]),
            ..Fake::default()
        };
        let kept = Arc::new(Kept {
            fail: true,
            ..Kept::default()
        });
        let err = run_keeping(fake, vec![FileRef::new("a", 3, sha256_hex(b"abc"))], &kept)
            .await
            .unwrap_err();
        assert!(
            matches!(&err, ValidateError::SideData { path, source } if path == "up/a" && source.is_retryable()),
            "{err}"
        );
    }

    #[tokio::test]
    async fn reads_run_concurrently_up_to_the_bound() {
        let n = 40;
        let fake = Fake {
            files: (0..n)
                .map(|i| (format!("up/f{i:02}"), digest(b"abc")))
                .collect(),
            delay: Duration::from_millis(5),
            ..Fake::default()
        };
        let files = (0..n)
            .map(|i| FileRef::new(format!("f{i:02}"), 3, sha256_hex(b"abc")))
            .collect();
        let (measured, tallied, fake) = run(fake, files).await.unwrap();
        assert_eq!(tallied.total, 0);
        assert_eq!(measured.files, n as u64);
        assert_eq!(fake.running.lock().unwrap().1, 3, "the concurrency bound");
    }

    #[tokio::test]
    async fn progress_is_reported_at_the_start_while_reading_and_at_the_end() {
        let fake = Arc::new(Fake {
            files: (0..10)
                .map(|i| (format!("up/f{i}"), digest(b"abc")))
                .collect(),
            ..Fake::default()
        });
        let files = (0..10)
            .map(|i| FileRef::new(format!("f{i}"), 3, sha256_hex(b"abc")))
            .collect();
        let seen = Mutex::new(Vec::new());
        let options = ReadOptions {
            concurrency: 2,
            progress_every: Duration::ZERO,
            ..ReadOptions::default()
        };
        validate(
            &Manifest::from_entries(files),
            "up",
            &policy(),
            &fake,
            &Arc::new(Kept::default()),
            &options,
            &mut findings(),
            |p| {
                seen.lock().unwrap().push(p);
                async {}
            },
        )
        .await
        .unwrap();
        let seen = seen.into_inner().unwrap();
        let first = seen.first().unwrap();
        assert_eq!(
            (first.files_done, first.files_total, first.bytes_total),
            (0, 10, 30)
        );
        let last = seen.last().unwrap();
        assert_eq!((last.files_done, last.bytes_done), (10, 30));
        assert!(seen.windows(2).all(|w| w[0].files_done <= w[1].files_done));
        assert!(seen.len() > 2, "{seen:?}");
    }

    #[test]
    fn the_estimate_weighs_files_and_bytes() {
        let p = ReadProgress {
            files_done: 50,
            files_total: 100,
            bytes_done: 500,
            bytes_total: 1000,
            elapsed: Duration::from_secs(10),
        };
        assert_eq!(p.eta(), Some(Duration::from_secs(10)));
        assert_eq!(
            ReadProgress {
                files_done: 0,
                bytes_done: 0,
                ..p
            }
            .eta(),
            None
        );
    }
}
