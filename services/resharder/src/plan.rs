//! From the members in the seeded order to samples placed in shards, and the problems the
//! packing policy judges.
//!
//! The sorted members ([`crate::sort`]) arrive with each sample's members adjacent. The
//! planner groups them, checks each sample against the policy's required extensions (case
//! does not matter: the `webdataset` readers lowercase extensions, so `a.JPG` and `a.jpg` are
//! also the same member twice, which no reader can take), applies the policy to an
//! incomplete sample, and places samples in shards: a shard is closed before the sample
//! that would take it past the target size, so no sample is ever split across shards.
//!
//! Every problem is written, one JSON line each, to a [`ProblemLog`] (an unnamed temporary
//! file, so millions of problems cost no memory); the first few are kept for messages and
//! every one is counted per code. Whatever the policy, the log is deterministic: problems
//! of files without a sample in path order, then those of samples in the seeded order.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, BufWriter, Seek, SeekFrom, Write};
use std::path::Path;

use serde::Serialize;
use stagehand_policy::IncompletePolicy;

use crate::sort::Member;

/// Problem codes of a derivation.
pub mod code {
    /// A file the WebDataset readers would not place in any sample (no extension, a name
    /// starting with a dot, an empty extension, a metadata name).
    pub const NO_SAMPLE_KEY: &str = "no_sample_key";
    /// A sample without an extension the policy requires.
    pub const MISSING_EXTENSION: &str = "missing_extension";
    /// Two members of one sample whose extensions differ only in case.
    pub const DUPLICATE_EXTENSION: &str = "duplicate_extension";
}

/// Problems kept in memory for messages; the log holds all of them.
pub const LISTED_PROBLEMS: usize = 20;

/// One problem of a derivation: a line of `incomplete.jsonl` (or of the abort report).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SampleProblem {
    pub code: &'static str,
    /// The sample key (none for a file that has no sample).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// The raw paths concerned.
    pub paths: Vec<String>,
    /// What is wrong, for a person.
    pub detail: String,
    /// What the policy did: `aborted`, `packed` (warn) or `excluded`.
    pub action: &'static str,
}

/// Every problem of a derivation, streamed to a temporary file.
#[derive(Debug)]
pub struct ProblemLog {
    file: BufWriter<File>,
    counts: BTreeMap<&'static str, u64>,
    first: Vec<SampleProblem>,
    total: u64,
    bytes: u64,
}

impl ProblemLog {
    pub fn new(dir: &Path) -> io::Result<ProblemLog> {
        Ok(ProblemLog {
            file: BufWriter::new(tempfile::tempfile_in(dir)?),
            counts: BTreeMap::new(),
            first: Vec::new(),
            total: 0,
            bytes: 0,
        })
    }

    pub fn add(&mut self, problem: SampleProblem) -> io::Result<()> {
        let mut line = serde_json::to_vec(&problem).map_err(io::Error::other)?;
        line.push(b'\n');
        self.file.write_all(&line)?;
        self.bytes += line.len() as u64;
        *self.counts.entry(problem.code).or_default() += 1;
        self.total += 1;
        if self.first.len() < LISTED_PROBLEMS {
            self.first.push(problem);
        }
        Ok(())
    }

    pub fn total(&self) -> u64 {
        self.total
    }

    pub fn is_empty(&self) -> bool {
        self.total == 0
    }

    /// Problems per code, in code order.
    pub fn counts(&self) -> &BTreeMap<&'static str, u64> {
        &self.counts
    }

    /// The first [`LISTED_PROBLEMS`] problems.
    pub fn first(&self) -> &[SampleProblem] {
        &self.first
    }

    /// The log's lines from the start, and their length in bytes.
    pub fn into_file(self) -> io::Result<(File, u64)> {
        let mut file = self.file.into_inner().map_err(|e| e.into_error())?;
        file.seek(SeekFrom::Start(0))?;
        Ok((file, self.bytes))
    }

    /// "3 problems (missing_extension: 2, no_sample_key: 1), e.g. …": for errors and logs.
    pub fn summary(&self) -> String {
        let counts: Vec<String> = self
            .counts
            .iter()
            .map(|(code, n)| format!("{code}: {n}"))
            .collect();
        let examples: Vec<String> = self
            .first
            .iter()
            .take(5)
            .map(|p| match &p.key {
                Some(key) => format!("{key}: {}", p.detail),
                None => format!("{}: {}", p.paths.join(", "), p.detail),
            })
            .collect();
        format!(
            "{} problem(s) ({}); first: {}",
            self.total,
            counts.join(", "),
            examples.join("; ")
        )
    }
}

/// A sample: its key and its members in path order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sample {
    pub key: String,
    pub members: Vec<Member>,
}

impl Sample {
    /// Bytes the sample takes in a tar shard (headers, GNU long-name entries, padding).
    pub fn tar_bytes(&self) -> u64 {
        self.members.iter().map(member_tar_bytes).sum()
    }

    pub fn data_bytes(&self) -> u64 {
        self.members.iter().map(|m| m.size).sum()
    }
}

/// Bytes one member takes in a tar: its header, a GNU long-name entry when the name does not
/// fit the header's 100 bytes, its data padded to 512.
pub fn member_tar_bytes(m: &Member) -> u64 {
    let long_name = if m.path.len() >= 100 {
        512 + (m.path.len() as u64 + 1).next_multiple_of(512)
    } else {
        0
    };
    long_name + 512 + m.size.next_multiple_of(512)
}

/// The end of a tar archive: two zero blocks.
pub const TAR_END: u64 = 1024;

/// What the policy asks of each sample.
#[derive(Debug, Clone)]
pub struct Rules {
    pub require_extensions: Vec<String>,
    pub incomplete: IncompletePolicy,
    pub shard_size: u64,
}

/// What the planner decided for one sample.
#[derive(Debug, PartialEq, Eq)]
pub enum Placed {
    /// Pack it into shard `shard` (0-based, in order).
    Pack { shard: u32, sample: Sample },
    /// Left out by the policy (listed in the log).
    Excluded,
    /// The policy aborts: listed, and nothing more is packed.
    Aborted,
}

/// Groups sorted members into samples and places them (see the module docs).
pub struct Planner {
    rules: Rules,
    shard: u32,
    /// Tar bytes of the shard being filled (without its end blocks).
    filled: u64,
    /// Samples packed so far.
    pub packed: u64,
    /// Whether the policy aborted (a problem was found under `incomplete = "abort"`).
    pub aborted: bool,
}

impl Planner {
    pub fn new(rules: Rules) -> Planner {
        Planner {
            rules,
            shard: 0,
            filled: 0,
            packed: 0,
            aborted: false,
        }
    }

    /// Shards begun so far.
    pub fn shards(&self) -> u32 {
        if self.packed == 0 { 0 } else { self.shard + 1 }
    }

    fn action(&self) -> &'static str {
        match self.rules.incomplete {
            IncompletePolicy::Abort => "aborted",
            IncompletePolicy::Warn => "packed",
            IncompletePolicy::Exclude => "excluded",
        }
    }

    /// Records a file that belongs to no sample (found before sorting).
    pub fn no_sample(&mut self, path: &str, log: &mut ProblemLog) -> io::Result<()> {
        log.add(SampleProblem {
            code: code::NO_SAMPLE_KEY,
            key: None,
            paths: vec![path.to_owned()],
            detail: "no WebDataset sample key (a name without an extension, starting with a dot, or a metadata name): a reader could not read it as a member".into(),
            action: match self.rules.incomplete {
                // A file without a key cannot be packed even when warned about.
                IncompletePolicy::Warn | IncompletePolicy::Exclude => "excluded",
                IncompletePolicy::Abort => "aborted",
            },
        })?;
        if self.rules.incomplete == IncompletePolicy::Abort {
            self.aborted = true;
        }
        Ok(())
    }

    /// Judges one complete sample and places it.
    pub fn place(&mut self, sample: Sample, log: &mut ProblemLog) -> io::Result<Placed> {
        let problems = self.judge(&sample);
        let mut packable = true;
        for problem in problems {
            log.add(problem)?;
            match self.rules.incomplete {
                IncompletePolicy::Abort => self.aborted = true,
                IncompletePolicy::Exclude => packable = false,
                IncompletePolicy::Warn => {}
            }
        }
        // A sample whose members no reader can tell apart is never packed.
        if has_case_duplicates(&sample) {
            packable = false;
        }
        if self.aborted {
            return Ok(Placed::Aborted);
        }
        if !packable {
            return Ok(Placed::Excluded);
        }
        let size = sample.tar_bytes();
        if self.packed > 0
            && self.filled > 0
            && self.filled + size + TAR_END > self.rules.shard_size
        {
            self.shard += 1;
            self.filled = 0;
        }
        self.filled += size;
        self.packed += 1;
        Ok(Placed::Pack {
            shard: self.shard,
            sample,
        })
    }

    fn judge(&self, sample: &Sample) -> Vec<SampleProblem> {
        let mut problems = Vec::new();
        let exts: Vec<String> = sample
            .members
            .iter()
            .map(|m| m.ext().to_lowercase())
            .collect();
        let paths = || sample.members.iter().map(|m| m.path.clone()).collect();
        let missing: Vec<&str> = self
            .rules
            .require_extensions
            .iter()
            .filter(|want| !exts.iter().any(|e| e == *want))
            .map(String::as_str)
            .collect();
        if !missing.is_empty() {
            problems.push(SampleProblem {
                code: code::MISSING_EXTENSION,
                key: Some(sample.key.clone()),
                paths: paths(),
                detail: format!("the sample has no {}", missing.join(", ")),
                action: self.action(),
            });
        }
        if has_case_duplicates(sample) {
            problems.push(SampleProblem {
                code: code::DUPLICATE_EXTENSION,
                key: Some(sample.key.clone()),
                paths: paths(),
                detail: "two members have extensions that differ only in case; WebDataset readers lowercase extensions and could not tell them apart".into(),
                action: match self.rules.incomplete {
                    IncompletePolicy::Abort => "aborted",
                    _ => "excluded",
                },
            });
        }
        problems
    }
}

fn has_case_duplicates(sample: &Sample) -> bool {
    let mut exts: Vec<String> = sample
        .members
        .iter()
        .map(|m| m.ext().to_lowercase())
        .collect();
    exts.sort();
    exts.windows(2).any(|w| w[0] == w[1])
}

/// Groups adjacent members of the same key into samples.
pub struct Grouper {
    current: Option<Sample>,
}

impl Grouper {
    pub fn new() -> Grouper {
        Grouper { current: None }
    }

    /// Adds the next member in order; returns the sample it completes, if any.
    pub fn push(&mut self, member: Member) -> Option<Sample> {
        match &mut self.current {
            Some(sample) if sample.key == member.key() => {
                sample.members.push(member);
                None
            }
            _ => {
                let next = Sample {
                    key: member.key().to_owned(),
                    members: vec![member],
                };
                self.current.replace(next)
            }
        }
    }

    /// The last sample.
    pub fn finish(self) -> Option<Sample> {
        self.current
    }
}

impl Default for Grouper {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::{order_hash, split_key};

    fn member(path: &str, size: u64) -> Member {
        let (key, _) = split_key(path).unwrap();
        Member {
            order: order_hash(0, key),
            path: path.into(),
            key_len: key.len(),
            size,
            sha256: "0".repeat(64),
        }
    }

    fn sample(key: &str, exts: &[&str], size: u64) -> Sample {
        Sample {
            key: key.into(),
            members: exts
                .iter()
                .map(|e| member(&format!("{key}.{e}"), size))
                .collect(),
        }
    }

    fn rules(incomplete: IncompletePolicy, shard_size: u64) -> Rules {
        Rules {
            require_extensions: vec!["cls".into(), "jpg".into()],
            incomplete,
            shard_size,
        }
    }

    #[test]
    fn adjacent_members_of_a_key_form_one_sample() {
        let mut g = Grouper::new();
        assert_eq!(g.push(member("a.cls", 1)), None);
        assert_eq!(g.push(member("a.jpg", 1)), None);
        let a = g.push(member("b.jpg", 1)).unwrap();
        assert_eq!(a.key, "a");
        assert_eq!(a.members.len(), 2);
        assert_eq!(g.finish().unwrap().key, "b");
    }

    /// Shards close before the sample that would overflow them; a sample is never split, and
    /// one larger than a shard gets a shard of its own.
    #[test]
    fn shards_close_before_the_sample_that_would_overflow_them() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = ProblemLog::new(dir.path()).unwrap();
        // Each sample: 2 members × (512 header + 1024 data) = 3072 tar bytes.
        let mut p = Planner::new(rules(IncompletePolicy::Abort, 3 * 3072 + TAR_END));
        let mut shards = Vec::new();
        for i in 0..7 {
            match p
                .place(sample(&format!("k{i}"), &["cls", "jpg"], 1000), &mut log)
                .unwrap()
            {
                Placed::Pack { shard, .. } => shards.push(shard),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(shards, [0, 0, 0, 1, 1, 1, 2]);
        let big = p
            .place(sample("big", &["cls", "jpg"], 100_000), &mut log)
            .unwrap();
        assert!(matches!(big, Placed::Pack { shard: 3, .. }), "{big:?}");
        let after = p.place(sample("z", &["cls", "jpg"], 1), &mut log).unwrap();
        assert!(matches!(after, Placed::Pack { shard: 4, .. }), "{after:?}");
        assert_eq!(p.shards(), 5);
        assert!(log.is_empty());
    }

    #[test]
    fn incomplete_samples_follow_the_policy() {
        let dir = tempfile::tempdir().unwrap();
        for (policy, want) in [
            (IncompletePolicy::Abort, "aborted"),
            (IncompletePolicy::Warn, "packed"),
            (IncompletePolicy::Exclude, "excluded"),
        ] {
            let mut log = ProblemLog::new(dir.path()).unwrap();
            let mut p = Planner::new(rules(policy, 1 << 20));
            let placed = p.place(sample("a", &["jpg"], 10), &mut log).unwrap();
            match policy {
                IncompletePolicy::Abort => assert_eq!(placed, Placed::Aborted),
                IncompletePolicy::Warn => assert!(matches!(placed, Placed::Pack { .. })),
                IncompletePolicy::Exclude => assert_eq!(placed, Placed::Excluded),
            }
            assert_eq!(log.total(), 1);
            assert_eq!(log.first()[0].code, code::MISSING_EXTENSION);
            assert_eq!(log.first()[0].action, want);
            assert_eq!(log.first()[0].detail, "the sample has no cls");
            // Complete samples are packed unless the policy aborted.
            let next = p.place(sample("b", &["cls", "jpg"], 10), &mut log).unwrap();
            assert_eq!(
                matches!(next, Placed::Pack { .. }),
                policy != IncompletePolicy::Abort
            );
        }
    }

    #[test]
    fn extensions_that_differ_only_in_case_are_never_packed() {
        let dir = tempfile::tempdir().unwrap();
        let mut log = ProblemLog::new(dir.path()).unwrap();
        let mut p = Planner::new(rules(IncompletePolicy::Warn, 1 << 20));
        let placed = p
            .place(sample("a", &["JPG", "cls", "jpg"], 10), &mut log)
            .unwrap();
        assert_eq!(placed, Placed::Excluded);
        assert_eq!(log.counts().get(code::DUPLICATE_EXTENSION), Some(&1));
    }
}
