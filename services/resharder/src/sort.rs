//! The shuffle's external sort: every member of a raw version, put in the seeded order of its
//! sample ([`crate::sample::order_hash`]), in memory bounded by a constant whatever the file
//! count.
//!
//! Members are gathered until a run's budget is reached, sorted by (order hash, key, path)
//! and spilled to an unnamed temporary file in a small binary form; at the end the runs are
//! merged. The sort key makes the members of one sample adjacent (same hash, same key),
//! samples follow in the seeded order, and a sample's members follow in path order, i.e. by
//! extension. Only keys, paths, sizes and hashes are sorted — never file bytes.

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;
use std::fs::File;
use std::io::{self, BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// Bytes of members a run holds before it is sorted and spilled (about 300,000 members of a
/// typical path length).
pub const DEFAULT_RUN_BYTES: usize = 64 * 1024 * 1024;

/// Per-member bookkeeping counted against the run budget besides its strings.
const RECORD_OVERHEAD: usize = 64;

/// One member of a raw version, with its place in the seeded order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// [`crate::sample::order_hash`] of its sample key.
    pub order: u64,
    /// The raw path (the tar member name).
    pub path: String,
    /// Length of the sample key: `path[..key_len]` is the key, `path[key_len + 1..]` the
    /// extension.
    pub key_len: usize,
    pub size: u64,
    pub sha256: String,
}

impl Member {
    pub fn key(&self) -> &str {
        &self.path[..self.key_len]
    }

    pub fn ext(&self) -> &str {
        &self.path[self.key_len + 1..]
    }

    fn sort_cmp(&self, other: &Member) -> Ordering {
        self.order
            .cmp(&other.order)
            .then_with(|| self.key().as_bytes().cmp(other.key().as_bytes()))
            .then_with(|| self.path.as_bytes().cmp(other.path.as_bytes()))
    }

    fn write_to(&self, out: &mut impl Write) -> io::Result<()> {
        out.write_all(&self.order.to_be_bytes())?;
        out.write_all(&(self.path.len() as u32).to_be_bytes())?;
        out.write_all(&(self.key_len as u32).to_be_bytes())?;
        out.write_all(&self.size.to_be_bytes())?;
        out.write_all(&(self.sha256.len() as u32).to_be_bytes())?;
        out.write_all(self.path.as_bytes())?;
        out.write_all(self.sha256.as_bytes())
    }

    /// The next member of a run, `None` at its end.
    fn read_from(input: &mut impl Read) -> io::Result<Option<Member>> {
        let mut head = [0u8; 28];
        match input.read_exact(&mut head[..1]) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(e),
        }
        input.read_exact(&mut head[1..])?;
        let u64_at = |i: usize| u64::from_be_bytes(head[i..i + 8].try_into().expect("8 bytes"));
        let u32_at =
            |i: usize| u32::from_be_bytes(head[i..i + 4].try_into().expect("4 bytes")) as usize;
        let (order, path_len, key_len, size, sha_len) =
            (u64_at(0), u32_at(8), u32_at(12), u64_at(16), u32_at(24));
        let mut strings = vec![0u8; path_len + sha_len];
        input.read_exact(&mut strings)?;
        let sha = strings.split_off(path_len);
        let bad = |_| io::Error::new(io::ErrorKind::InvalidData, "a sort run is not UTF-8");
        Ok(Some(Member {
            order,
            path: String::from_utf8(strings).map_err(bad)?,
            key_len,
            size,
            sha256: String::from_utf8(sha).map_err(bad)?,
        }))
    }
}

/// Why the sort failed: its temporary files could not be written or read.
#[derive(Debug, thiserror::Error)]
#[error("sorting the shuffle in {}: {source}", dir.display())]
pub struct SortError {
    pub dir: PathBuf,
    #[source]
    pub source: io::Error,
}

/// Gathers members in any order; [`Sorter::finish`] hands them back in the seeded order.
pub struct Sorter {
    dir: PathBuf,
    run_bytes: usize,
    run: Vec<Member>,
    used: usize,
    runs: Vec<File>,
    pushed: u64,
}

impl Sorter {
    /// A sorter spilling to `dir` once `run_bytes` of members are held.
    pub fn new(dir: &Path, run_bytes: usize) -> Sorter {
        Sorter {
            dir: dir.to_owned(),
            run_bytes: run_bytes.max(1),
            run: Vec::new(),
            used: 0,
            runs: Vec::new(),
            pushed: 0,
        }
    }

    fn err(&self, source: io::Error) -> SortError {
        SortError {
            dir: self.dir.clone(),
            source,
        }
    }

    pub fn push(&mut self, member: Member) -> Result<(), SortError> {
        self.used += member.path.len() + member.sha256.len() + RECORD_OVERHEAD;
        self.run.push(member);
        self.pushed += 1;
        if self.used >= self.run_bytes {
            self.spill()?;
        }
        Ok(())
    }

    /// Members pushed so far.
    pub fn len(&self) -> u64 {
        self.pushed
    }

    pub fn is_empty(&self) -> bool {
        self.pushed == 0
    }

    /// Runs spilled to disk so far.
    pub fn spilled_runs(&self) -> usize {
        self.runs.len()
    }

    fn spill(&mut self) -> Result<(), SortError> {
        if self.run.is_empty() {
            return Ok(());
        }
        self.run.sort_unstable_by(Member::sort_cmp);
        let file = tempfile::tempfile_in(&self.dir).map_err(|e| self.err(e))?;
        {
            let mut out = BufWriter::with_capacity(1 << 20, &file);
            for member in &self.run {
                member.write_to(&mut out).map_err(|e| self.err(e))?;
            }
            out.flush().map_err(|e| self.err(e))?;
        }
        self.runs.push(file);
        self.run.clear();
        self.used = 0;
        Ok(())
    }

    /// The members in the seeded order. Blocking.
    pub fn finish(mut self) -> Result<Sorted, SortError> {
        if self.runs.is_empty() {
            self.run.sort_unstable_by(Member::sort_cmp);
            return Ok(Sorted {
                inner: SortedInner::Memory(std::mem::take(&mut self.run).into_iter()),
                dir: self.dir,
            });
        }
        self.spill()?;
        let mut readers = Vec::with_capacity(self.runs.len());
        for mut run in std::mem::take(&mut self.runs) {
            run.seek(SeekFrom::Start(0)).map_err(|e| self.err(e))?;
            readers.push(BufReader::with_capacity(64 * 1024, run));
        }
        let mut heads = BinaryHeap::with_capacity(readers.len());
        for (run, reader) in readers.iter_mut().enumerate() {
            if let Some(member) = Member::read_from(reader).map_err(|e| self.err(e))? {
                heads.push(Reverse(Head { member, run }));
            }
        }
        Ok(Sorted {
            inner: SortedInner::Merge { readers, heads },
            dir: self.dir,
        })
    }
}

/// The head of one run in the merge (ties go to the earlier run, so the merge is stable).
struct Head {
    member: Member,
    run: usize,
}

impl PartialEq for Head {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Head {}

impl PartialOrd for Head {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Head {
    fn cmp(&self, other: &Self) -> Ordering {
        self.member
            .sort_cmp(&other.member)
            .then(self.run.cmp(&other.run))
    }
}

enum SortedInner {
    Memory(std::vec::IntoIter<Member>),
    Merge {
        readers: Vec<BufReader<File>>,
        heads: BinaryHeap<Reverse<Head>>,
    },
}

/// Members in the seeded order (an iterator; blocking reads from the runs).
pub struct Sorted {
    inner: SortedInner,
    dir: PathBuf,
}

impl Iterator for Sorted {
    type Item = Result<Member, SortError>;

    fn next(&mut self) -> Option<Self::Item> {
        match &mut self.inner {
            SortedInner::Memory(members) => members.next().map(Ok),
            SortedInner::Merge { readers, heads } => {
                let Reverse(Head { member, run }) = heads.pop()?;
                match Member::read_from(&mut readers[run]) {
                    Ok(Some(next)) => heads.push(Reverse(Head { member: next, run })),
                    Ok(None) => {}
                    Err(source) => {
                        return Some(Err(SortError {
                            dir: self.dir.clone(),
                            source,
                        }));
                    }
                }
                Some(Ok(member))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::{order_hash, split_key};

    fn member(seed: u64, path: &str, size: u64) -> Member {
        let (key, _) = split_key(path).unwrap();
        Member {
            order: order_hash(seed, key),
            path: path.to_owned(),
            key_len: key.len(),
            size,
            sha256: format!("{size:064x}"),
        }
    }

    fn members(n: usize) -> Vec<Member> {
        (0..n)
            .flat_map(|i| {
                ["cls", "jpg", "json"]
                    .into_iter()
                    .map(move |ext| member(3, &format!("d{}/{i:06}.{ext}", i % 7), i as u64))
            })
            .collect()
    }

    /// Spilled runs must merge to exactly the order one in-memory sort gives, with every
    /// sample's members adjacent.
    #[test]
    fn spilled_runs_merge_to_the_in_memory_order() {
        let dir = tempfile::tempdir().unwrap();
        let all = members(3000);
        let mut one = Sorter::new(dir.path(), usize::MAX);
        let mut many = Sorter::new(dir.path(), 4096);
        for m in all.iter().rev() {
            one.push(m.clone()).unwrap();
            many.push(m.clone()).unwrap();
        }
        assert!(many.spilled_runs() > 50, "{} runs", many.spilled_runs());
        assert_eq!(one.spilled_runs(), 0);
        let a: Vec<Member> = one.finish().unwrap().map(Result::unwrap).collect();
        let b: Vec<Member> = many.finish().unwrap().map(Result::unwrap).collect();
        assert_eq!(a.len(), 9000);
        assert_eq!(a, b);
        let mut expected = all;
        expected.sort_by(|x, y| (x.order, x.key(), &x.path).cmp(&(y.order, y.key(), &y.path)));
        assert_eq!(a, expected);
        // Members of a sample are adjacent and in extension order.
        for w in a.chunks(3) {
            assert!(w.iter().all(|m| m.key() == w[0].key()));
            assert_eq!(
                w.iter().map(Member::ext).collect::<Vec<_>>(),
                ["cls", "jpg", "json"]
            );
        }
    }
}
