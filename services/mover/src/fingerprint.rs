//! A replica's fingerprint: the metadata of every file and folder of a published set, taken by a
//! walk that reads no data — posix: type, size, mtime, ctime and inode of each entry, through
//! `getdents` and `statx` spread over a few threads (a folder's entries are stat-ed in batches
//! on every thread, so one flat folder of a million files is walked in parallel too); S3:
//! size, ETag and last-modified of each object, from the listing.
//!
//! It is taken when a set is published, after its modes and group were applied (a `chmod`
//! moves ctime), and compared before the replica is handed out again ([`Fingerprint::compare`]):
//! a file missing, added, resized, rewritten, made writable or replaced shows as a
//! [`Difference`], and the replica is verified by hash or repaired before anyone uses it. It
//! says nothing about bytes that changed under unchanged metadata (a failing disk): that is
//! what re-reading them is for. [`Mover::check_set`] is that re-read for a set whose
//! fingerprint is unknown: every listed file hashed where it is, and anything the list does
//! not name reported as stray.
//!
//! The encoding ([`Fingerprint::encode`]) is compact and self-checking: paths front-coded in
//! path order, times and inodes as deltas, a SHA-256 of the rest at its head; a fingerprint
//! that does not decode is *unknown*, never trusted.

use std::collections::VecDeque;
use std::ffi::CString;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Condvar, Mutex};

use futures::{Stream, StreamExt};
use rustix::fs::{AtFlags, FileType, Mode, OFlags, StatxFlags};
use sha2::{Digest, Sha256};
use stagehand_schemas::FileStamp;

use crate::error::{ErrorKind, Side, TransferError};
use crate::mover::Mover;
use crate::posix::{PosixTier, resolve};
use crate::set::SET_COMPLETE_MARKER;
use crate::tier::Tier;
use crate::transfer::{FileRef, ReadLimit};

/// A point in time as a filesystem or object store gives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Time {
    pub secs: i64,
    pub nanos: u32,
}

/// What the walk found at one path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stamp {
    /// A regular file on a posix tier.
    File {
        size: u64,
        mtime: Time,
        ctime: Time,
        ino: u64,
    },
    /// A folder on a posix tier (the set's own folder is the path `""`).
    Dir { mtime: Time, ctime: Time, ino: u64 },
    /// Anything else on a posix tier (a symlink, FIFO, socket, device): never part of a set.
    Other { ctime: Time, ino: u64 },
    /// An object on an S3 tier.
    Object {
        size: u64,
        etag: String,
        modified: Time,
    },
}

impl Stamp {
    fn size(&self) -> Option<u64> {
        match self {
            Stamp::File { size, .. } | Stamp::Object { size, .. } => Some(*size),
            _ => None,
        }
    }

    fn is_dir(&self) -> bool {
        matches!(self, Stamp::Dir { .. })
    }

    fn tag(&self) -> u8 {
        match self {
            Stamp::File { .. } => 1,
            Stamp::Dir { .. } => 2,
            Stamp::Other { .. } => 3,
            Stamp::Object { .. } => 4,
        }
    }
}

/// One path of a set (relative to the set's prefix) and what was found there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub path: String,
    pub stamp: Stamp,
}

/// The metadata of every entry of a set, in path order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Fingerprint {
    entries: Vec<Entry>,
}

/// How one path of a set differs from what was recorded or listed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// Listed or recorded, and not there.
    Missing,
    /// There, and neither listed nor recorded.
    Stray,
    /// Another size than recorded or listed.
    Size { expected: u64, found: u64 },
    /// Its bytes do not hash to the listed SHA-256 ([`Mover::check_set`]).
    Hash,
    /// Same size, other metadata (mtime, ctime, inode, ETag, last-modified): rewritten,
    /// touched, made writable or replaced.
    Modified,
    /// Another kind of entry (a folder where a file was, a symlink, …).
    Kind,
}

impl Change {
    /// The word a `replica.damaged` fact carries for it.
    pub fn as_str(&self) -> &'static str {
        match self {
            Change::Missing => "missing",
            Change::Stray => "stray",
            Change::Size { .. } => "size",
            Change::Hash => "hash",
            Change::Modified => "modified",
            Change::Kind => "kind",
        }
    }
}

/// One path that differs, and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Difference {
    pub path: String,
    pub change: Change,
}

/// A recorded fingerprint that does not decode: treated as unknown.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("fingerprint does not decode at byte {at}: {what}")]
pub struct FingerprintError {
    pub at: usize,
    pub what: &'static str,
}

const MAGIC: &[u8; 4] = b"SHFP";
const FORMAT: u8 = 1;

impl Fingerprint {
    /// A fingerprint of these entries (sorted here by path).
    pub fn from_entries(mut entries: Vec<Entry>) -> Fingerprint {
        entries.sort_unstable_by(|a, b| a.path.cmp(&b.path));
        Fingerprint { entries }
    }

    /// Every entry, in path order.
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// Regular files (posix) or objects (S3) in it.
    pub fn files(&self) -> usize {
        self.entries
            .iter()
            .filter(|e| matches!(e.stamp, Stamp::File { .. } | Stamp::Object { .. }))
            .count()
    }

    /// The fingerprint a checkpoint part's commit recorded: each listed file's stamp, and
    /// nothing else (no folders), for [`Fingerprint::compare_files`].
    pub fn of_file_stamps(stamps: &[FileStamp]) -> Fingerprint {
        let time = |secs, nanos| Time { secs, nanos };
        Fingerprint::from_entries(
            stamps
                .iter()
                .map(|f| Entry {
                    path: f.path.clone(),
                    stamp: Stamp::File {
                        size: f.size,
                        mtime: time(f.mtime_secs, f.mtime_nanos),
                        ctime: time(f.ctime_secs, f.ctime_nanos),
                        ino: f.inode,
                    },
                })
                .collect(),
        )
    }

    /// The stamp of the regular file at `path` (relative to the set), as a checkpoint part's
    /// commit records it; `None` when the walk found no regular file there.
    pub fn file_stamp(&self, path: &str) -> Option<FileStamp> {
        match &self.entries[self.find(path)?].stamp {
            Stamp::File {
                size,
                mtime,
                ctime,
                ino,
            } => Some(FileStamp {
                path: path.to_owned(),
                size: *size,
                mtime_secs: mtime.secs,
                mtime_nanos: mtime.nanos,
                ctime_secs: ctime.secs,
                ctime_nanos: ctime.nanos,
                inode: *ino,
            }),
            _ => None,
        }
    }

    /// What differs between the paths this (recorded) fingerprint names and the same paths in
    /// `found`, in path order: entries of `found` it does not name (folders, files written
    /// beside them) are not looked at.
    pub fn compare_files(&self, found: &Fingerprint) -> Vec<Difference> {
        let mut out = self.compare(found);
        out.retain(|d| d.change != Change::Stray);
        out
    }

    fn find(&self, path: &str) -> Option<usize> {
        self.entries
            .binary_search_by(|e| e.path.as_str().cmp(path))
            .ok()
    }

    /// What differs between this (recorded) fingerprint and `found`, in path order: nothing
    /// when the set is as it was recorded.
    pub fn compare(&self, found: &Fingerprint) -> Vec<Difference> {
        let (mut a, mut b) = (
            self.entries.iter().peekable(),
            found.entries.iter().peekable(),
        );
        let mut out = Vec::new();
        loop {
            let (path, change) = match (a.peek(), b.peek()) {
                (None, None) => return out,
                (Some(r), None) => (r.path.clone(), Some(Change::Missing)),
                (None, Some(f)) => (f.path.clone(), Some(Change::Stray)),
                (Some(r), Some(f)) => match r.path.cmp(&f.path) {
                    std::cmp::Ordering::Less => (r.path.clone(), Some(Change::Missing)),
                    std::cmp::Ordering::Greater => (f.path.clone(), Some(Change::Stray)),
                    std::cmp::Ordering::Equal => (r.path.clone(), differs(&r.stamp, &f.stamp)),
                },
            };
            match &change {
                Some(Change::Missing) => {
                    a.next();
                }
                Some(Change::Stray) => {
                    b.next();
                }
                _ => {
                    a.next();
                    b.next();
                }
            }
            if let Some(change) = change {
                out.push(Difference { path, change });
            }
        }
    }

    /// The compact, self-checking encoding: `SHFP`, a format byte, the SHA-256 of the body,
    /// then the body (entry count; per entry the path front-coded against the previous one,
    /// a type tag and its fields as LEB128, times and inodes as zigzag deltas).
    pub fn encode(&self) -> Vec<u8> {
        let mut body = Vec::with_capacity(16 + self.entries.len() * 24);
        put_uvar(&mut body, self.entries.len() as u64);
        let mut prev_path: &str = "";
        let (mut prev_secs, mut prev_ino) = (0i64, 0u64);
        for e in &self.entries {
            let shared = common_prefix(prev_path.as_bytes(), e.path.as_bytes());
            put_uvar(&mut body, shared as u64);
            let suffix = &e.path.as_bytes()[shared..];
            put_uvar(&mut body, suffix.len() as u64);
            body.extend_from_slice(suffix);
            prev_path = &e.path;
            body.push(e.stamp.tag());
            let time = |body: &mut Vec<u8>, t: Time, base: i64| {
                put_ivar(body, t.secs.wrapping_sub(base));
                put_uvar(body, u64::from(t.nanos));
            };
            match &e.stamp {
                Stamp::File {
                    size,
                    mtime,
                    ctime,
                    ino,
                } => {
                    put_uvar(&mut body, *size);
                    time(&mut body, *mtime, prev_secs);
                    time(&mut body, *ctime, mtime.secs);
                    put_ivar(&mut body, (*ino as i64).wrapping_sub(prev_ino as i64));
                    (prev_secs, prev_ino) = (mtime.secs, *ino);
                }
                Stamp::Dir { mtime, ctime, ino } => {
                    time(&mut body, *mtime, prev_secs);
                    time(&mut body, *ctime, mtime.secs);
                    put_ivar(&mut body, (*ino as i64).wrapping_sub(prev_ino as i64));
                    (prev_secs, prev_ino) = (mtime.secs, *ino);
                }
                Stamp::Other { ctime, ino } => {
                    time(&mut body, *ctime, prev_secs);
                    put_ivar(&mut body, (*ino as i64).wrapping_sub(prev_ino as i64));
                    (prev_secs, prev_ino) = (ctime.secs, *ino);
                }
                Stamp::Object {
                    size,
                    etag,
                    modified,
                } => {
                    put_uvar(&mut body, *size);
                    put_uvar(&mut body, etag.len() as u64);
                    body.extend_from_slice(etag.as_bytes());
                    time(&mut body, *modified, prev_secs);
                    prev_secs = modified.secs;
                }
            }
        }
        let mut out = Vec::with_capacity(body.len() + 37);
        out.extend_from_slice(MAGIC);
        out.push(FORMAT);
        out.extend_from_slice(&Sha256::digest(&body));
        out.extend_from_slice(&body);
        out
    }

    /// Reads [`Fingerprint::encode`]'s bytes back; anything else is an error (the fingerprint
    /// is then unknown).
    pub fn decode(bytes: &[u8]) -> Result<Fingerprint, FingerprintError> {
        let bad = |at: usize, what: &'static str| FingerprintError { at, what };
        if bytes.len() < 37 || &bytes[..4] != MAGIC {
            return Err(bad(0, "not a Stagehand fingerprint"));
        }
        if bytes[4] != FORMAT {
            return Err(bad(4, "an unknown format"));
        }
        let body = &bytes[37..];
        if Sha256::digest(body).as_slice() != &bytes[5..37] {
            return Err(bad(5, "its checksum does not match"));
        }
        let mut r = Reader { bytes: body, at: 0 };
        let count = r.uvar()?;
        let mut entries = Vec::with_capacity(count.min(1 << 24) as usize);
        let mut path = Vec::<u8>::new();
        let (mut prev_secs, mut prev_ino) = (0i64, 0u64);
        for _ in 0..count {
            let shared = r.uvar()? as usize;
            if shared > path.len() {
                return Err(bad(
                    r.at + 37,
                    "a path shares more than the previous one has",
                ));
            }
            path.truncate(shared);
            let len = r.uvar()? as usize;
            path.extend_from_slice(r.take(len)?);
            let text = std::str::from_utf8(&path)
                .map_err(|_| bad(r.at + 37, "a path is not UTF-8"))?
                .to_owned();
            let tag = r.take(1)?[0];
            let stamp = match tag {
                1 | 2 => {
                    let size = if tag == 1 { r.uvar()? } else { 0 };
                    let mtime = r.time(prev_secs)?;
                    let ctime = r.time(mtime.secs)?;
                    let ino = (prev_ino as i64).wrapping_add(r.ivar()?) as u64;
                    (prev_secs, prev_ino) = (mtime.secs, ino);
                    if tag == 1 {
                        Stamp::File {
                            size,
                            mtime,
                            ctime,
                            ino,
                        }
                    } else {
                        Stamp::Dir { mtime, ctime, ino }
                    }
                }
                3 => {
                    let ctime = r.time(prev_secs)?;
                    let ino = (prev_ino as i64).wrapping_add(r.ivar()?) as u64;
                    (prev_secs, prev_ino) = (ctime.secs, ino);
                    Stamp::Other { ctime, ino }
                }
                4 => {
                    let size = r.uvar()?;
                    let len = r.uvar()? as usize;
                    let at = r.at + 37;
                    let etag = std::str::from_utf8(r.take(len)?)
                        .map_err(|_| bad(at, "an ETag is not UTF-8"))?
                        .to_owned();
                    let modified = r.time(prev_secs)?;
                    prev_secs = modified.secs;
                    Stamp::Object {
                        size,
                        etag,
                        modified,
                    }
                }
                _ => return Err(bad(r.at + 37, "an unknown entry type")),
            };
            entries.push(Entry { path: text, stamp });
        }
        if r.at != body.len() {
            return Err(bad(r.at + 37, "bytes after the last entry"));
        }
        if entries.windows(2).any(|w| w[0].path >= w[1].path) {
            return Err(bad(37, "entries out of path order"));
        }
        Ok(Fingerprint { entries })
    }
}

/// How a recorded stamp and a found one differ, if they do.
fn differs(recorded: &Stamp, found: &Stamp) -> Option<Change> {
    if recorded == found {
        return None;
    }
    if recorded.tag() != found.tag() {
        return Some(Change::Kind);
    }
    match (recorded.size(), found.size()) {
        (Some(expected), Some(found)) if expected != found => {
            Some(Change::Size { expected, found })
        }
        _ => Some(Change::Modified),
    }
}

fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

fn put_uvar(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_ivar(out: &mut Vec<u8>, v: i64) {
    put_uvar(out, ((v << 1) ^ (v >> 63)) as u64);
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], FingerprintError> {
        let end = self.at.checked_add(n).filter(|e| *e <= self.bytes.len());
        let Some(end) = end else {
            return Err(FingerprintError {
                at: self.at + 37,
                what: "it ends inside an entry",
            });
        };
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn uvar(&mut self) -> Result<u64, FingerprintError> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.take(1)?[0];
            v |= u64::from(b & 0x7f) << shift;
            if b < 0x80 {
                return Ok(v);
            }
        }
        Err(FingerprintError {
            at: self.at + 37,
            what: "a number longer than 64 bits",
        })
    }

    fn ivar(&mut self) -> Result<i64, FingerprintError> {
        let u = self.uvar()?;
        Ok(((u >> 1) as i64) ^ -((u & 1) as i64))
    }

    fn time(&mut self, base: i64) -> Result<Time, FingerprintError> {
        let secs = base.wrapping_add(self.ivar()?);
        let nanos = u32::try_from(self.uvar()?).map_err(|_| FingerprintError {
            at: self.at + 37,
            what: "nanoseconds out of range",
        })?;
        Ok(Time { secs, nanos })
    }
}

/// Threads of one posix walk: statx is CPU-bound on a warm cache and waits on the disk on a
/// cold one, so a few more than the cores keep both busy.
fn walk_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
        .clamp(2, 8)
        * 2
}

/// Names stat-ed per job: small enough that a flat folder spreads over every thread, large
/// enough that the queue's lock is not what limits it.
const STAT_BATCH: usize = 256;

enum Job {
    /// Read a folder's names (`getdents`) and queue them for `statx` in batches.
    List { fd: Arc<OwnedFd>, rel: Arc<str> },
    /// `statx` these names of one folder; queue each sub-folder to be listed.
    Stat {
        dir: Arc<OwnedFd>,
        rel: Arc<str>,
        names: Vec<CString>,
    },
}

#[derive(Default)]
struct Work {
    jobs: VecDeque<Job>,
    busy: usize,
    error: Option<TransferError>,
}

struct Walk<'a> {
    tier: &'a PosixTier,
    prefix: &'a str,
    work: Mutex<Work>,
    wake: Condvar,
}

fn stamp_of(st: &rustix::fs::Statx) -> Stamp {
    let t = |ts: rustix::fs::StatxTimestamp| Time {
        secs: ts.tv_sec,
        nanos: ts.tv_nsec,
    };
    let ino = st.stx_ino;
    match FileType::from_raw_mode(u32::from(st.stx_mode)) {
        FileType::RegularFile => Stamp::File {
            size: st.stx_size,
            mtime: t(st.stx_mtime),
            ctime: t(st.stx_ctime),
            ino,
        },
        FileType::Directory => Stamp::Dir {
            mtime: t(st.stx_mtime),
            ctime: t(st.stx_ctime),
            ino,
        },
        _ => Stamp::Other {
            ctime: t(st.stx_ctime),
            ino,
        },
    }
}

const STATX_MASK: StatxFlags = StatxFlags::TYPE
    .union(StatxFlags::SIZE)
    .union(StatxFlags::MTIME)
    .union(StatxFlags::CTIME)
    .union(StatxFlags::INO);

fn join(rel: &str, name: &str) -> String {
    if rel.is_empty() {
        name.to_owned()
    } else {
        format!("{rel}/{name}")
    }
}

impl Walk<'_> {
    fn err(&self, e: rustix::io::Errno, rel: &str, what: &str) -> TransferError {
        TransferError::from_errno(
            e,
            Side::Destination,
            self.tier.name(),
            join(self.prefix, rel),
            what,
        )
    }

    fn push(&self, job: Job) {
        let mut w = self.work.lock().unwrap_or_else(|p| p.into_inner());
        w.jobs.push_back(job);
        drop(w);
        self.wake.notify_one();
    }

    fn run(&self, job: Job, out: &mut Vec<Entry>) -> Result<(), TransferError> {
        match job {
            Job::List { fd, rel } => {
                let mut dir = rustix::fs::Dir::read_from(&*fd)
                    .map_err(|e| self.err(e, &rel, "read directory"))?;
                let mut names = Vec::with_capacity(STAT_BATCH);
                while let Some(entry) = dir.read() {
                    let entry = entry.map_err(|e| self.err(e, &rel, "read directory"))?;
                    let name = entry.file_name();
                    if name == c"." || name == c".." {
                        continue;
                    }
                    names.push(name.to_owned());
                    if names.len() == STAT_BATCH {
                        let names = std::mem::replace(&mut names, Vec::with_capacity(STAT_BATCH));
                        self.push(Job::Stat {
                            dir: fd.clone(),
                            rel: rel.clone(),
                            names,
                        });
                    }
                }
                if !names.is_empty() {
                    // The last batch on this thread: it is warm with this folder.
                    self.run(
                        Job::Stat {
                            dir: fd,
                            rel,
                            names,
                        },
                        out,
                    )?;
                }
                Ok(())
            }
            Job::Stat { dir, rel, names } => {
                for name in names {
                    let st = match rustix::fs::statx(
                        &*dir,
                        &name,
                        AtFlags::SYMLINK_NOFOLLOW,
                        STATX_MASK,
                    ) {
                        Ok(st) => st,
                        // Gone since it was listed: it is not there.
                        Err(rustix::io::Errno::NOENT) => continue,
                        Err(e) => {
                            let n = name.to_string_lossy();
                            return Err(self.err(e, &join(&rel, &n), "statx"));
                        }
                    };
                    let path = join(&rel, &name.to_string_lossy());
                    let stamp = stamp_of(&st);
                    if stamp.is_dir() {
                        let fd = rustix::fs::openat2(
                            &*dir,
                            &name,
                            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
                            Mode::empty(),
                            resolve(),
                        )
                        .map_err(|e| self.err(e, &path, "open directory"))?;
                        self.push(Job::List {
                            fd: Arc::new(fd),
                            rel: Arc::from(path.as_str()),
                        });
                    }
                    out.push(Entry { path, stamp });
                }
                Ok(())
            }
        }
    }

    fn worker(&self) -> Vec<Entry> {
        let mut out = Vec::new();
        loop {
            let job = {
                let mut w = self.work.lock().unwrap_or_else(|p| p.into_inner());
                loop {
                    if w.error.is_some() {
                        return out;
                    }
                    if let Some(job) = w.jobs.pop_front() {
                        w.busy += 1;
                        break job;
                    }
                    if w.busy == 0 {
                        return out;
                    }
                    w = self.wake.wait(w).unwrap_or_else(|p| p.into_inner());
                }
            };
            let result = self.run(job, &mut out);
            let mut w = self.work.lock().unwrap_or_else(|p| p.into_inner());
            w.busy -= 1;
            if let Err(e) = result {
                w.error.get_or_insert(e);
            }
            let done = w.error.is_some() || (w.busy == 0 && w.jobs.is_empty());
            drop(w);
            if done {
                self.wake.notify_all();
            }
        }
    }
}

/// The fingerprint of the folder `prefix` on a posix tier (blocking: run it off the runtime).
/// `NotFound` when there is no folder there.
pub fn walk_posix(tier: &PosixTier, prefix: &str) -> Result<Fingerprint, TransferError> {
    tier.check_path(prefix, Side::Destination)?;
    let root = rustix::fs::openat2(
        tier.root_fd(),
        prefix,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
        resolve(),
    )
    .map_err(|e| {
        TransferError::from_errno(e, Side::Destination, tier.name(), prefix, "open directory")
    })?;
    let st = rustix::fs::statx(&root, c"", AtFlags::EMPTY_PATH, STATX_MASK).map_err(|e| {
        TransferError::from_errno(e, Side::Destination, tier.name(), prefix, "statx")
    })?;
    let walk = Walk {
        tier,
        prefix,
        work: Mutex::new(Work::default()),
        wake: Condvar::new(),
    };
    walk.push(Job::List {
        fd: Arc::new(root),
        rel: Arc::from(""),
    });
    let mut entries = vec![Entry {
        path: String::new(),
        stamp: stamp_of(&st),
    }];
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..walk_threads())
            .map(|_| s.spawn(|| walk.worker()))
            .collect();
        for h in handles {
            if let Ok(found) = h.join() {
                entries.extend(found);
            }
        }
    });
    if let Some(e) = walk
        .work
        .into_inner()
        .unwrap_or_else(|p| p.into_inner())
        .error
    {
        return Err(e);
    }
    Ok(Fingerprint::from_entries(entries))
}

impl Tier {
    /// The fingerprint of the set at `prefix` as it is now (a metadata walk, no data read):
    /// posix, every entry beneath the folder (the folder itself as `""`); S3, every object
    /// beneath the prefix but the set's completion marker.
    pub async fn fingerprint(&self, prefix: &str) -> Result<Fingerprint, TransferError> {
        match self {
            Tier::Posix(p) => {
                let (p, rel) = (p.clone(), prefix.to_owned());
                let name = p.name().to_owned();
                tokio::task::spawn_blocking(move || walk_posix(&p, &rel))
                    .await
                    .map_err(|e| {
                        TransferError::new(
                            ErrorKind::Io,
                            Side::Destination,
                            name,
                            prefix,
                            format!("fingerprint walk failed: {e}"),
                        )
                    })?
            }
            Tier::S3(s) => {
                let mut entries = Vec::new();
                let mut token = None;
                let strip = prefix.len() + usize::from(!prefix.is_empty());
                loop {
                    let page = s.list_stamped_page(prefix, token.take()).await?;
                    for object in page.0 {
                        let path = object.rel.get(strip..).unwrap_or_default();
                        if path == SET_COMPLETE_MARKER || path.is_empty() {
                            continue;
                        }
                        entries.push(Entry {
                            path: path.to_owned(),
                            stamp: Stamp::Object {
                                size: object.size,
                                etag: object.etag,
                                modified: object.modified,
                            },
                        });
                    }
                    match page.1 {
                        Some(next) => token = Some(next),
                        None => break,
                    }
                }
                Ok(Fingerprint::from_entries(entries))
            }
        }
    }
}

/// What [`Mover::check_set`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetCheck {
    /// The set's fingerprint, taken before any byte was read: when nothing differs it is the
    /// one to record (a change made while the files were hashed shows at the next compare).
    pub fingerprint: Fingerprint,
    /// Every listed file that is missing, of another size or kind, or does not hash to its
    /// SHA-256, and every entry the list does not name, in the order found.
    pub differences: Vec<Difference>,
    /// Files listed and checked.
    pub files: u64,
}

/// Marks, in a fingerprint, the paths a file list names (and their folders), to find what it
/// does not name.
pub(crate) struct Listed<'a> {
    print: &'a Fingerprint,
    marked: Vec<bool>,
}

impl<'a> Listed<'a> {
    pub(crate) fn new(print: &'a Fingerprint) -> Listed<'a> {
        let mut marked = vec![false; print.entries.len()];
        // The set's own folder is the set.
        if let Some(i) = print.find("") {
            marked[i] = true;
        }
        Listed { print, marked }
    }

    /// Marks a listed file and every folder above it.
    pub(crate) fn mark(&mut self, path: &str) {
        let mut p = path;
        loop {
            match self.print.find(p) {
                Some(i) if self.marked[i] => return,
                Some(i) => self.marked[i] = true,
                None => {}
            }
            match p.rsplit_once('/') {
                Some((parent, _)) => p = parent,
                None => return,
            }
        }
    }

    /// Every entry no listed path marked: what the list does not name.
    pub(crate) fn strays(&self) -> impl Iterator<Item = &'a str> + '_ {
        self.print
            .entries
            .iter()
            .zip(&self.marked)
            .filter(|(_, m)| !**m)
            .map(|(e, _)| e.path.as_str())
    }
}

impl Mover {
    /// Verifies the set at `prefix` on `tier` against its file list without changing anything:
    /// the fingerprint first (a metadata walk), then every listed file hashed where it is
    /// (size and SHA-256 from its bytes), then what the walk found that the list does not
    /// name. What a reuse runs when no fingerprint was recorded: unknown is never trusted.
    pub async fn check_set<S>(
        &self,
        tier: &Tier,
        prefix: &str,
        mut files: S,
    ) -> Result<SetCheck, TransferError>
    where
        S: Stream<Item = FileRef> + Unpin,
    {
        let fingerprint = tier.fingerprint(prefix).await?;
        let found = tier.beneath(prefix)?;
        let mut listed = Listed::new(&fingerprint);
        let mut differences = Vec::new();
        let mut count = 0u64;
        let chunk_files = self.config().batch_files.max(1);
        loop {
            let mut chunk = Vec::with_capacity(chunk_files.min(1 << 16));
            while chunk.len() < chunk_files {
                match files.next().await {
                    Some(f) => chunk.push(f),
                    None => break,
                }
            }
            if chunk.is_empty() {
                break;
            }
            count += chunk.len() as u64;
            let checked: Vec<(FileRef, Result<Option<Change>, TransferError>)> =
                futures::stream::iter(chunk)
                    .map(|f| {
                        let found = &found;
                        async move {
                            let limit = ReadLimit::declared(f.size, None);
                            let verdict = match found.hash_file_bounded(&f.path, limit).await {
                                Ok(d) if d.size != f.size => Ok(Some(Change::Size {
                                    expected: f.size,
                                    found: d.size,
                                })),
                                Ok(d) if d.sha256 != f.sha256 => Ok(Some(Change::Hash)),
                                Ok(_) => Ok(None),
                                Err(e) => match e.kind {
                                    ErrorKind::NotFound => Ok(Some(Change::Missing)),
                                    ErrorKind::NotAFile => Ok(Some(Change::Kind)),
                                    ErrorKind::SizeMismatch | ErrorKind::TooLarge => {
                                        Ok(Some(Change::Size {
                                            expected: f.size,
                                            found: u64::MAX,
                                        }))
                                    }
                                    ErrorKind::ChecksumMismatch => Ok(Some(Change::Hash)),
                                    _ => Err(e),
                                },
                            };
                            (f, verdict)
                        }
                    })
                    .buffered(self.config().concurrency.max(1))
                    .collect()
                    .await;
            for (f, verdict) in checked {
                let change = verdict?;
                // Listed, whatever state it is in: neither it nor its folders are strays.
                listed.mark(&f.path);
                if let Some(mut change) = change {
                    // The size the walk saw, where the read stopped before counting it.
                    if let Change::Size { found, .. } = &mut change
                        && *found == u64::MAX
                    {
                        *found = fingerprint
                            .find(&f.path)
                            .and_then(|i| fingerprint.entries[i].stamp.size())
                            .unwrap_or(0);
                    }
                    differences.push(Difference {
                        path: f.path,
                        change,
                    });
                }
            }
        }
        differences.extend(listed.strays().map(|p| Difference {
            path: p.to_owned(),
            change: Change::Stray,
        }));
        Ok(SetCheck {
            fingerprint,
            differences,
            files: count,
        })
    }
}
