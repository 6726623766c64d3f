//! [`ManifestBuilder`]: entries in any order in, a canonical [`Manifest`] out, in memory
//! bounded by a constant whatever the file count.
//!
//! An external merge sort: entries are gathered as manifest lines until a run's budget is
//! reached, sorted by path bytes and written to an unnamed temporary file; at the end the
//! runs are merged (ties broken by run order, so duplicates keep the order they were pushed
//! in, as [`stagehand_schemas::version_digest`] does) into the canonical bytes, which are
//! checked and hashed on their way into the spool.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Seek, SeekFrom, Write};

use stagehand_schemas::FileRef;

use crate::error::{ManifestError, ManifestErrorKind};
use crate::manifest::{LineChecker, Manifest, Spool, SpoolWriter};

/// Bytes of manifest lines a run holds before it is sorted and spilled (about 600,000
/// entries of a typical path length).
pub const DEFAULT_RUN_BYTES: usize = 64 * 1024 * 1024;

/// Builds a canonical manifest from entries pushed in any order.
///
/// ```
/// use stagehand_manifest::{ManifestBuilder, Spool};
/// use stagehand_schemas::{FileRef, sha256_hex, version_digest};
///
/// let files = vec![
///     FileRef::new("b.txt", 1, sha256_hex(b"b")),
///     FileRef::new("a.txt", 1, sha256_hex(b"a")),
/// ];
/// let mut builder = ManifestBuilder::new(&Spool::default());
/// for f in &files {
///     builder.push(f).unwrap();
/// }
/// let manifest = builder.finish().unwrap();
/// assert_eq!(manifest.digest(), version_digest(&files));
/// ```
pub struct ManifestBuilder {
    spool: Spool,
    run_bytes: usize,
    /// The current run: lines (each ending in `\n`) and where each starts.
    lines: Vec<u8>,
    starts: Vec<usize>,
    runs: Vec<File>,
}

impl ManifestBuilder {
    pub fn new(spool: &Spool) -> ManifestBuilder {
        ManifestBuilder::with_run_bytes(spool, DEFAULT_RUN_BYTES)
    }

    /// A builder whose runs hold `run_bytes` of lines before spilling (tests use a tiny one).
    pub fn with_run_bytes(spool: &Spool, run_bytes: usize) -> ManifestBuilder {
        ManifestBuilder {
            spool: spool.clone(),
            run_bytes: run_bytes.max(1),
            lines: Vec::new(),
            starts: Vec::new(),
            runs: Vec::new(),
        }
    }

    /// Adds one entry. A path holding a tab, a newline or a carriage return cannot be a
    /// manifest line and is refused.
    pub fn push(&mut self, file: &FileRef) -> Result<(), ManifestError> {
        if file
            .path
            .bytes()
            .any(|b| matches!(b, b'\t' | b'\n' | b'\r'))
        {
            return Err(ManifestError::new(
                ManifestErrorKind::Invalid,
                format!("manifest entry {:?}", file.path),
                "a path holding a tab or a line break cannot be written as a manifest line",
            ));
        }
        if file
            .sha256
            .bytes()
            .any(|b| matches!(b, b'\t' | b'\n' | b'\r'))
        {
            return Err(ManifestError::new(
                ManifestErrorKind::Invalid,
                format!("manifest entry {:?}", file.path),
                "a hash holding a tab or a line break cannot be written as a manifest line",
            ));
        }
        self.starts.push(self.lines.len());
        self.lines
            .extend_from_slice(file.manifest_line().as_bytes());
        if self.lines.len() >= self.run_bytes {
            self.spill()?;
        }
        Ok(())
    }

    /// Entries pushed so far.
    pub fn len(&self) -> usize {
        self.starts.len() + self.runs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.starts.is_empty() && self.runs.is_empty()
    }

    fn sorted_run(&self) -> Vec<&[u8]> {
        let mut lines: Vec<&[u8]> = self
            .starts
            .iter()
            .enumerate()
            .map(|(i, &start)| {
                let end = self.starts.get(i + 1).copied().unwrap_or(self.lines.len());
                &self.lines[start..end]
            })
            .collect();
        // Stable, by path bytes (the line up to its first tab).
        lines.sort_by(|a, b| path_of(a).cmp(path_of(b)));
        lines
    }

    fn spill(&mut self) -> Result<(), ManifestError> {
        if self.starts.is_empty() {
            return Ok(());
        }
        let file = tempfile::tempfile_in(&self.spool.dir)
            .map_err(|e| ManifestError::spool(&self.spool.dir, e))?;
        {
            let mut out = BufWriter::with_capacity(1 << 20, &file);
            for line in self.sorted_run() {
                out.write_all(line)
                    .map_err(|e| ManifestError::spool(&self.spool.dir, e))?;
            }
            out.flush()
                .map_err(|e| ManifestError::spool(&self.spool.dir, e))?;
        }
        self.runs.push(file);
        self.lines.clear();
        self.starts.clear();
        Ok(())
    }

    /// Merges everything pushed into the canonical manifest. Blocking: on an async runtime,
    /// call it from a blocking thread.
    pub fn finish(mut self) -> Result<Manifest, ManifestError> {
        let mut checker = LineChecker::new("built manifest");
        let mut writer = SpoolWriter::new(&self.spool);
        if self.runs.is_empty() {
            for line in self.sorted_run() {
                checker.update(line)?;
                writer.write(line)?;
            }
        } else {
            self.spill()?;
            let dir = self.spool.dir.clone();
            let mut readers: Vec<BufReader<File>> = Vec::with_capacity(self.runs.len());
            for mut run in self.runs.drain(..) {
                run.seek(SeekFrom::Start(0))
                    .map_err(|e| ManifestError::spool(&dir, e))?;
                readers.push(BufReader::with_capacity(256 * 1024, run));
            }
            // Heads of every run; the smallest path first, the earlier run on ties.
            let mut heads: BinaryHeap<Reverse<RunHead>> = BinaryHeap::new();
            let next_line =
                |reader: &mut BufReader<File>| -> Result<Option<Vec<u8>>, ManifestError> {
                    let mut line = Vec::new();
                    match reader.read_until(b'\n', &mut line) {
                        Ok(0) => Ok(None),
                        Ok(_) => Ok(Some(line)),
                        Err(e) => Err(ManifestError::spool(&dir, e)),
                    }
                };
            for (run, reader) in readers.iter_mut().enumerate() {
                if let Some(line) = next_line(reader)? {
                    heads.push(Reverse((path_of(&line).to_vec(), run, line)));
                }
            }
            while let Some(Reverse((_, run, line))) = heads.pop() {
                checker.update(&line)?;
                writer.write(&line)?;
                if let Some(next) = next_line(&mut readers[run])? {
                    heads.push(Reverse((path_of(&next).to_vec(), run, next)));
                }
            }
        }
        let checked = checker.finish()?;
        Ok(Manifest::from_spool(writer.finish(), checked))
    }
}

/// The next line of a run in the merge: its path, the run it came from (ties go to the earlier
/// run), and the line itself.
type RunHead = (Vec<u8>, usize, Vec<u8>);

fn path_of(line: &[u8]) -> &[u8] {
    let end = line.iter().position(|&b| b == b'\t').unwrap_or(line.len());
    &line[..end]
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagehand_schemas::{sha256_hex, version_digest};

    fn files(n: usize) -> Vec<FileRef> {
        // A scrambled order with duplicates of some paths.
        (0..n)
            .map(|i| {
                let k = (i * 7919) % n;
                FileRef::new(
                    format!("d{}/f{}", k % 13, k / 2),
                    i as u64,
                    sha256_hex(i.to_string().as_bytes()),
                )
            })
            .collect()
    }

    #[test]
    fn spilled_runs_merge_to_the_same_manifest_as_one_run() {
        let dir = tempfile::tempdir().unwrap();
        let spool = Spool {
            dir: dir.path().to_owned(),
            in_memory_below: 1024,
        };
        let files = files(5000);
        let mut one = ManifestBuilder::new(&spool);
        let mut many = ManifestBuilder::with_run_bytes(&spool, 4096);
        for f in &files {
            one.push(f).unwrap();
            many.push(f).unwrap();
        }
        assert!(many.runs.len() > 50, "{} runs", many.runs.len());
        let one = one.finish().unwrap();
        let many = many.finish().unwrap();
        assert_eq!(one.digest(), version_digest(&files));
        assert_eq!(many.digest(), version_digest(&files));
        let a: Vec<FileRef> = one.entries().map(Result::unwrap).collect();
        let b: Vec<FileRef> = many.entries().map(Result::unwrap).collect();
        assert_eq!(a, b);
        assert_eq!(a.len(), 5000);
        assert_eq!(many.files(), 5000);
    }

    #[test]
    fn an_empty_manifest_is_the_empty_digest() {
        let m = ManifestBuilder::new(&Spool::default()).finish().unwrap();
        assert_eq!(m.digest(), version_digest(&[]));
        assert_eq!(m.files(), 0);
    }

    #[test]
    fn a_path_that_cannot_be_a_line_is_refused() {
        let mut b = ManifestBuilder::new(&Spool::default());
        let err = b
            .push(&FileRef::new("a\nb", 1, sha256_hex(b"x")))
            .unwrap_err();
        assert_eq!(err.kind, ManifestErrorKind::Invalid);
    }
}
