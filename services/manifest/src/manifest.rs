//! [`Manifest`]: a version's file list whose digest has been checked, and its entries in
//! path order.
//!
//! A manifest is held either as the entries themselves (an inline manifest from an event:
//! small by the contract's bound) or as canonical manifest bytes in a spool — in memory when
//! small, else in an unnamed temporary file that disappears with the last handle. Reading the
//! entries never needs more memory than one chunk of them, whatever the file count.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use sha2::{Digest, Sha256};
use stagehand_schemas::manifest::{INLINE_MANIFEST_MAX_BYTES, canonical_len, parse_line};
use stagehand_schemas::{FileRef, ManifestRef, total_bytes, version_digest};

use crate::error::{ManifestError, ManifestErrorKind};

/// The longest manifest line accepted: a path of the contract's maximum (4096 bytes) with a
/// size and a hash fits many times over; anything longer is not a manifest.
pub const MAX_LINE_BYTES: usize = 64 * 1024;

/// The longest line a valid entry can have: a path of at most
/// [`stagehand_schemas::path::MAX_PATH_BYTES`], a size of at most 20 digits, a SHA-256 in hex,
/// two tabs and the newline. Longer lines parse, but name a path no reader accepts.
pub const MAX_ENTRY_LINE_BYTES: u64 = stagehand_schemas::path::MAX_PATH_BYTES as u64 + 20 + 64 + 3;

/// The most bytes a manifest of `files` valid entries can be: what a fetch reads at most
/// before refusing an object named by a reference that declares `files`.
pub fn max_manifest_bytes(files: u64) -> u64 {
    files.saturating_mul(MAX_ENTRY_LINE_BYTES)
}

/// Canonical bytes at most this large are spooled in memory; larger ones go to a file.
pub const IN_MEMORY_BELOW: u64 = 8 * 1024 * 1024;

/// Entries handed out per chunk by [`Manifest::chunks`].
pub const DEFAULT_CHUNK: usize = 4096;

/// Where manifests too large for memory are spooled while they are read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spool {
    /// A directory on a local disk with room for the largest manifest (about 100 bytes per
    /// file: 1.4 GB for 14 million files).
    pub dir: PathBuf,
    /// Canonical bytes at most this large stay in memory.
    pub in_memory_below: u64,
}

impl Default for Spool {
    fn default() -> Self {
        Spool {
            dir: std::env::temp_dir(),
            in_memory_below: IN_MEMORY_BELOW,
        }
    }
}

impl Spool {
    pub fn in_dir(dir: impl Into<PathBuf>) -> Spool {
        Spool {
            dir: dir.into(),
            ..Spool::default()
        }
    }
}

#[derive(Debug, Clone)]
enum Held {
    /// The entries of an inline manifest, sorted by path bytes (stable for duplicates).
    Entries(Arc<Vec<FileRef>>),
    /// Canonical manifest bytes.
    Memory(Bytes),
    /// Canonical manifest bytes in an unnamed temporary file.
    File(Arc<File>, u64),
}

/// A manifest whose bytes hash to its digest, with its entry count and byte total. Cheap to
/// clone; the spool is shared.
#[derive(Debug, Clone)]
pub struct Manifest {
    digest: String,
    files: u64,
    bytes: u64,
    held: Held,
}

impl Manifest {
    /// The manifest of inline entries (an event's `files`), in any order. Nothing is judged:
    /// bad paths are the validator's to report.
    pub fn from_entries(mut files: Vec<FileRef>) -> Manifest {
        let digest = version_digest(&files);
        files.sort_by(|a, b| a.path.as_bytes().cmp(b.path.as_bytes()));
        Manifest {
            digest,
            files: files.len() as u64,
            bytes: total_bytes(&files),
            held: Held::Entries(Arc::new(files)),
        }
    }

    /// The version digest: the SHA-256 of the canonical manifest bytes.
    pub fn digest(&self) -> &str {
        &self.digest
    }

    /// Number of entries.
    pub fn files(&self) -> u64 {
        self.files
    }

    /// Sum of the entries' sizes.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The reference an event carries for this manifest once it is stored.
    pub fn reference(&self) -> ManifestRef {
        ManifestRef {
            digest: self.digest.clone(),
            files: self.files,
            bytes: self.bytes,
        }
    }

    /// The length of the canonical manifest bytes.
    pub fn canonical_len(&self) -> u64 {
        match &self.held {
            Held::Entries(files) => canonical_len(files),
            Held::Memory(bytes) => bytes.len() as u64,
            Held::File(_, len) => *len,
        }
    }

    /// Whether the contract lets this manifest travel inline in an event
    /// ([`INLINE_MANIFEST_MAX_BYTES`]).
    pub fn fits_inline(&self) -> bool {
        self.canonical_len() <= INLINE_MANIFEST_MAX_BYTES
    }

    /// The entries, for an event's inline `files`, when [`Manifest::fits_inline`]; `None`
    /// otherwise (the event must carry [`Manifest::reference`]).
    pub fn inline_entries(&self) -> Result<Option<Vec<FileRef>>, ManifestError> {
        if !self.fits_inline() {
            return Ok(None);
        }
        self.entries().collect::<Result<Vec<_>, _>>().map(Some)
    }

    /// The entries in path order. Blocking reads for a spooled manifest: on an async runtime,
    /// use [`Manifest::chunks`] or call this from a blocking thread.
    pub fn entries(&self) -> Entries {
        let inner = match &self.held {
            Held::Entries(files) => EntriesInner::Listed(files.clone(), 0),
            Held::Memory(bytes) => {
                EntriesInner::Lines(Box::new(BufReader::new(ReadAt::Memory(bytes.clone(), 0))))
            }
            Held::File(file, _) => EntriesInner::Lines(Box::new(BufReader::with_capacity(
                256 * 1024,
                ReadAt::File(file.clone(), 0),
            ))),
        };
        Entries {
            inner,
            line: 0,
            buf: Vec::new(),
            what: self.digest.clone(),
        }
    }

    /// Writes the canonical manifest bytes into `file` from offset 0, in 1 MiB writes (memory
    /// stays bounded whatever the manifest's size); returns how many bytes. Blocking.
    pub fn write_canonical_at(&self, file: &File) -> Result<u64, ManifestError> {
        const CHUNK: usize = 1 << 20;
        let io = |e: std::io::Error| {
            ManifestError::new(ManifestErrorKind::Io, &self.digest, format!("writing: {e}"))
        };
        let mut buf: Vec<u8> = Vec::with_capacity(CHUNK);
        let mut offset = 0u64;
        for entry in self.entries() {
            buf.extend_from_slice(entry?.manifest_line().as_bytes());
            if buf.len() >= CHUNK {
                file.write_all_at(&buf, offset).map_err(io)?;
                offset += buf.len() as u64;
                buf.clear();
            }
        }
        file.write_all_at(&buf, offset).map_err(io)?;
        Ok(offset + buf.len() as u64)
    }

    /// The entries in path order, `chunk` at a time, read on a blocking thread: memory stays
    /// bounded by the chunk whatever the manifest's size.
    pub fn chunks(
        &self,
        chunk: usize,
    ) -> impl futures::Stream<Item = Result<Vec<FileRef>, ManifestError>> + Send + 'static {
        let chunk = chunk.max(1);
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Vec<FileRef>, ManifestError>>(2);
        let manifest = self.clone();
        tokio::task::spawn_blocking(move || {
            let mut batch = Vec::with_capacity(chunk);
            for entry in manifest.entries() {
                match entry {
                    Ok(file) => {
                        batch.push(file);
                        if batch.len() == chunk {
                            let full = std::mem::replace(&mut batch, Vec::with_capacity(chunk));
                            if tx.blocking_send(Ok(full)).is_err() {
                                return;
                            }
                        }
                    }
                    Err(e) => {
                        let _ = tx.blocking_send(Err(e));
                        return;
                    }
                }
            }
            if !batch.is_empty() {
                let _ = tx.blocking_send(Ok(batch));
            }
        });
        futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|r| (r, rx)) })
    }

    /// The entries as one stream of files, `chunk` read at a time (see [`Manifest::chunks`]),
    /// for a copy that takes a stream of [`FileRef`]s: a list that fails to read ends the
    /// stream early, and the error is kept in the returned [`ListEnd`]. A caller checks it
    /// before publishing what it copied — an early end would publish part of a version.
    pub fn file_stream(
        &self,
        chunk: usize,
    ) -> (
        impl futures::Stream<Item = FileRef> + Send + Unpin + 'static,
        ListEnd,
    ) {
        use futures::StreamExt;
        let end = ListEnd::default();
        let seen = end.clone();
        let files = self
            .chunks(chunk)
            .fuse()
            .scan((), move |_, chunk| {
                futures::future::ready(match chunk {
                    Ok(files) => Some(futures::stream::iter(files)),
                    Err(e) => {
                        *seen.0.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                        None
                    }
                })
            })
            .flatten()
            // A copy may ask again after the end: a fused stream keeps answering `None`.
            .fuse()
            .boxed();
        (files, end)
    }

    /// The canonical manifest bytes, for storing the manifest: an async reader over the spool
    /// (or, for inline entries, over bytes built from them).
    pub(crate) fn canonical_reader(
        &self,
    ) -> Result<Box<dyn tokio::io::AsyncRead + Unpin + Send>, ManifestError> {
        Ok(match &self.held {
            Held::Entries(files) => {
                let mut out = Vec::with_capacity(canonical_len(files) as usize);
                for file in files.iter() {
                    out.extend_from_slice(file.manifest_line().as_bytes());
                }
                Box::new(std::io::Cursor::new(out))
            }
            Held::Memory(bytes) => Box::new(std::io::Cursor::new(bytes.clone())),
            Held::File(file, _) => {
                // A new descriptor with its own offset: every other reader of the spool uses
                // positioned reads, so moving this one's offset disturbs nobody.
                let mut own = file
                    .try_clone()
                    .map_err(|e| ManifestError::io(Path::new(&self.digest), e))?;
                std::io::Seek::seek(&mut own, std::io::SeekFrom::Start(0))
                    .map_err(|e| ManifestError::io(Path::new(&self.digest), e))?;
                Box::new(tokio::fs::File::from_std(own))
            }
        })
    }

    /// Reads canonical manifest bytes (sorted lines, as stored) from `reader` into a spool,
    /// checking every line; `expected` is the digest they must hash to. Blocking.
    pub fn from_canonical(
        what: &str,
        mut reader: impl Read,
        expected: &str,
        spool: &Spool,
    ) -> Result<Manifest, ManifestError> {
        let mut checker = LineChecker::new(what);
        let mut writer = SpoolWriter::new(spool);
        let mut buf = vec![0u8; 256 * 1024];
        loop {
            let n = reader
                .read(&mut buf)
                .map_err(|e| ManifestError::io(Path::new(what), e))?;
            if n == 0 {
                break;
            }
            checker.update(&buf[..n])?;
            writer.write(&buf[..n])?;
        }
        let checked = checker.finish()?;
        if checked.digest != expected {
            return Err(ManifestError::new(
                ManifestErrorKind::Mismatch,
                what,
                format!(
                    "the bytes hash to {}, not to the expected digest {expected}",
                    checked.digest
                ),
            ));
        }
        Ok(Manifest::from_spool(writer.finish(), checked))
    }

    pub(crate) fn from_spool(spooled: Spooled, checked: Checked) -> Manifest {
        Manifest {
            digest: checked.digest,
            files: checked.files,
            bytes: checked.bytes,
            held: match spooled {
                Spooled::Memory(bytes) => Held::Memory(Bytes::from(bytes)),
                Spooled::File(file, len) => Held::File(Arc::new(file), len),
            },
        }
    }
}

/// Reads from a shared spool at its own offset (a cloned fd would share the offset).
enum ReadAt {
    Memory(Bytes, usize),
    File(Arc<File>, u64),
}

impl Read for ReadAt {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            ReadAt::Memory(bytes, pos) => {
                let rest = &bytes[(*pos).min(bytes.len())..];
                let n = rest.len().min(buf.len());
                buf[..n].copy_from_slice(&rest[..n]);
                *pos += n;
                Ok(n)
            }
            ReadAt::File(file, pos) => {
                let n = file.read_at(buf, *pos)?;
                *pos += n as u64;
                Ok(n)
            }
        }
    }
}

enum EntriesInner {
    Listed(Arc<Vec<FileRef>>, usize),
    Lines(Box<BufReader<ReadAt>>),
}

/// How the stream of [`Manifest::file_stream`] ended: the read error that cut it short, if any.
#[derive(Debug, Clone, Default)]
pub struct ListEnd(Arc<std::sync::Mutex<Option<ManifestError>>>);

impl ListEnd {
    /// The error that ended the list early (taken: a second call answers `None`).
    pub fn take_error(&self) -> Option<ManifestError> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

/// The entries of a [`Manifest`] in path order.
pub struct Entries {
    inner: EntriesInner,
    line: u64,
    buf: Vec<u8>,
    what: String,
}

impl Iterator for Entries {
    type Item = Result<FileRef, ManifestError>;

    fn next(&mut self) -> Option<Self::Item> {
        match &mut self.inner {
            EntriesInner::Listed(files, i) => {
                let file = files.get(*i)?.clone();
                *i += 1;
                Some(Ok(file))
            }
            EntriesInner::Lines(reader) => {
                self.buf.clear();
                self.line += 1;
                match reader.read_until(b'\n', &mut self.buf) {
                    Ok(0) => None,
                    Ok(_) => {
                        // The spool was checked line by line when it was written; a line that
                        // fails now means the spool file was damaged underneath us.
                        let line = self.buf.strip_suffix(b"\n").unwrap_or(&self.buf);
                        Some(parse_line(line).map_err(|e| {
                            ManifestError::malformed(&self.what, self.line, e.to_string())
                        }))
                    }
                    Err(e) => Some(Err(ManifestError::new(
                        ManifestErrorKind::Io,
                        self.what.clone(),
                        format!("reading the spooled manifest: {e}"),
                    )
                    .with_source(e))),
                }
            }
        }
    }
}

/// What [`LineChecker`] found over a whole manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Checked {
    pub digest: String,
    pub files: u64,
    pub bytes: u64,
}

/// Checks canonical manifest bytes as they stream past, in any chunking: each line parses,
/// none is longer than [`MAX_LINE_BYTES`], paths never decrease (equal ones — duplicates —
/// are the validator's to report), the last line ends in `\n`. Hashes everything.
pub(crate) struct LineChecker {
    what: String,
    hasher: Sha256,
    partial: Vec<u8>,
    previous_path: Vec<u8>,
    line: u64,
    files: u64,
    bytes: u64,
    /// At most this many entries and bytes of files (what a reference declares).
    limits: (u64, u64),
}

impl LineChecker {
    pub fn new(what: impl Into<String>) -> LineChecker {
        LineChecker {
            what: what.into(),
            hasher: Sha256::new(),
            partial: Vec::new(),
            previous_path: Vec::new(),
            line: 0,
            files: 0,
            bytes: 0,
            limits: (u64::MAX, u64::MAX),
        }
    }

    /// A checker that refuses, at the entry that crosses it, more than `files` entries or
    /// entries of more than `bytes` in all: a reference declares both.
    pub fn bounded(what: impl Into<String>, files: u64, bytes: u64) -> LineChecker {
        LineChecker {
            limits: (files, bytes),
            ..LineChecker::new(what)
        }
    }

    pub fn update(&mut self, mut chunk: &[u8]) -> Result<(), ManifestError> {
        self.hasher.update(chunk);
        while let Some(end) = chunk.iter().position(|&b| b == b'\n') {
            let (head, rest) = chunk.split_at(end);
            if self.partial.is_empty() {
                self.line_done(head)?;
            } else {
                self.partial.extend_from_slice(head);
                let line = std::mem::take(&mut self.partial);
                self.line_done(&line)?;
            }
            chunk = &rest[1..];
        }
        self.partial.extend_from_slice(chunk);
        if self.partial.len() > MAX_LINE_BYTES {
            return Err(ManifestError::malformed(
                &self.what,
                self.line + 1,
                format!("a line longer than {MAX_LINE_BYTES} bytes"),
            ));
        }
        Ok(())
    }

    fn line_done(&mut self, line: &[u8]) -> Result<(), ManifestError> {
        self.line += 1;
        if line.len() > MAX_LINE_BYTES {
            return Err(ManifestError::malformed(
                &self.what,
                self.line,
                format!("a line longer than {MAX_LINE_BYTES} bytes"),
            ));
        }
        let file = parse_line(line)
            .map_err(|e| ManifestError::malformed(&self.what, self.line, e.to_string()))?;
        let path = file.path.as_bytes();
        if self.files > 0 && path < self.previous_path.as_slice() {
            return Err(ManifestError::malformed(
                &self.what,
                self.line,
                format!(
                    "entries are not sorted by path: {:?} follows {:?}",
                    file.path,
                    String::from_utf8_lossy(&self.previous_path)
                ),
            ));
        }
        self.previous_path.clear();
        self.previous_path.extend_from_slice(path);
        self.files += 1;
        self.bytes = self.bytes.saturating_add(file.size);
        let (files, bytes) = self.limits;
        if self.files > files {
            return Err(ManifestError::exceeds(
                &self.what,
                self.line,
                format!("more than the {files} files the reference declares"),
            ));
        }
        if self.bytes > bytes {
            return Err(ManifestError::exceeds(
                &self.what,
                self.line,
                format!("entries of more than the {bytes} bytes the reference declares"),
            ));
        }
        Ok(())
    }

    pub fn finish(self) -> Result<Checked, ManifestError> {
        if !self.partial.is_empty() {
            return Err(ManifestError::malformed(
                &self.what,
                self.line + 1,
                "the last line does not end with a newline",
            ));
        }
        Ok(Checked {
            digest: hex::encode(self.hasher.finalize()),
            files: self.files,
            bytes: self.bytes,
        })
    }
}

/// Canonical bytes being written to a spool: memory up to a bound, then an unnamed file.
pub(crate) enum Spooled {
    Memory(Vec<u8>),
    File(File, u64),
}

pub(crate) struct SpoolWriter {
    spool: Spool,
    state: Spooled,
}

impl SpoolWriter {
    pub fn new(spool: &Spool) -> SpoolWriter {
        SpoolWriter {
            spool: spool.clone(),
            state: Spooled::Memory(Vec::new()),
        }
    }

    pub fn write(&mut self, chunk: &[u8]) -> Result<(), ManifestError> {
        if let Spooled::Memory(bytes) = &mut self.state {
            if (bytes.len() + chunk.len()) as u64 <= self.spool.in_memory_below {
                bytes.extend_from_slice(chunk);
                return Ok(());
            }
            let file = tempfile::tempfile_in(&self.spool.dir)
                .map_err(|e| ManifestError::spool(&self.spool.dir, e))?;
            file.write_all_at(bytes, 0)
                .map_err(|e| ManifestError::spool(&self.spool.dir, e))?;
            let len = bytes.len() as u64;
            self.state = Spooled::File(file, len);
        }
        if let Spooled::File(file, len) = &mut self.state {
            file.write_all_at(chunk, *len)
                .map_err(|e| ManifestError::spool(&self.spool.dir, e))?;
            *len += chunk.len() as u64;
        }
        Ok(())
    }

    pub fn finish(self) -> Spooled {
        self.state
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagehand_schemas::sha256_hex;

    fn sha(s: &str) -> String {
        sha256_hex(s.as_bytes())
    }

    #[test]
    fn checker_accepts_canonical_bytes_in_any_chunking() {
        let files = vec![
            FileRef::new("b/1", 3, sha("x")),
            FileRef::new("a", 0, sha("")),
            FileRef::new("b/0", 7, sha("y")),
        ];
        let canonical = stagehand_schemas::manifest::canonical_bytes(&files);
        for step in [1, 2, 7, 64, canonical.len()] {
            let mut checker = LineChecker::new("t");
            for chunk in canonical.chunks(step) {
                checker.update(chunk).unwrap();
            }
            let checked = checker.finish().unwrap();
            assert_eq!(checked.digest, version_digest(&files));
            assert_eq!((checked.files, checked.bytes), (3, 10));
        }
    }

    #[test]
    fn checker_names_the_line_of_each_defect() {
        let s = sha("x");
        let cases: &[(String, u64, &str)] = &[
            (format!("b\t1\t{s}\na\t1\t{s}\n"), 2, "not sorted"),
            (format!("a\t1\t{s}\nb\tone\t{s}\n"), 2, "size"),
            (format!("a\t1\t{s}"), 1, "newline"),
            (format!("a\t1\t{s}\n\n"), 2, "field"),
            (
                format!("{}\t1\t{s}\n", "p".repeat(MAX_LINE_BYTES + 1)),
                1,
                "longer",
            ),
        ];
        for (text, line, words) in cases {
            let mut checker = LineChecker::new("t");
            let err = checker
                .update(text.as_bytes())
                .and_then(|()| checker.finish().map(|_| ()))
                .unwrap_err();
            assert_eq!(err.kind, ManifestErrorKind::Malformed, "{text:?}");
            assert_eq!(err.line, Some(*line), "{text:?}: {err}");
            assert!(err.to_string().contains(words), "{text:?}: {err}");
        }
    }

    #[test]
    fn duplicates_are_left_for_the_validator() {
        let s = sha("x");
        let mut checker = LineChecker::new("t");
        checker
            .update(format!("a\t1\t{s}\na\t1\t{s}\n").as_bytes())
            .unwrap();
        assert_eq!(checker.finish().unwrap().files, 2);
    }

    #[test]
    fn a_spool_moves_to_a_file_past_its_memory_bound_and_reads_back_the_same() {
        let dir = tempfile::tempdir().unwrap();
        let spool = Spool {
            dir: dir.path().to_owned(),
            in_memory_below: 100,
        };
        let files: Vec<FileRef> = (0..500)
            .map(|i| FileRef::new(format!("f{i:05}"), i, sha(&i.to_string())))
            .collect();
        let canonical = stagehand_schemas::manifest::canonical_bytes(&files);
        let manifest =
            Manifest::from_canonical("t", canonical.as_slice(), &version_digest(&files), &spool)
                .unwrap();
        assert!(matches!(manifest.held, Held::File(..)));
        let wrong = Manifest::from_canonical("t", canonical.as_slice(), &"0".repeat(64), &spool);
        assert_eq!(wrong.unwrap_err().kind, ManifestErrorKind::Mismatch);
        let back: Vec<FileRef> = manifest.entries().map(Result::unwrap).collect();
        assert_eq!(back, files);
        assert_eq!(manifest.canonical_len(), canonical.len() as u64);
        // Two readers at once do not disturb each other's position.
        let mut a = manifest.entries();
        let mut b = manifest.entries();
        assert_eq!(a.next().unwrap().unwrap(), b.next().unwrap().unwrap());
        assert_eq!(a.next().unwrap().unwrap(), files[1]);
    }

    #[test]
    fn inline_entries_keep_their_duplicates_in_listed_order() {
        let m = Manifest::from_entries(vec![
            FileRef::new("b", 1, sha("1")),
            FileRef::new("a", 2, sha("2")),
            FileRef::new("b", 3, sha("3")),
        ]);
        let sizes: Vec<u64> = m.entries().map(|e| e.unwrap().size).collect();
        assert_eq!(sizes, vec![2, 1, 3]);
        assert_eq!(m.files(), 3);
        assert_eq!(m.bytes(), 6);
    }
}
