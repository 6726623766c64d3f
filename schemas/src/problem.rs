//! Problems: what is wrong with an upload, a manifest or a restored copy, with stable codes.
//!
//! A problem code is part of the contract: producers, the catalogue and people's scripts
//! branch on it, so codes are only ever added, never renamed. Every code is listed in
//! [`code::ALL`].
//!
//! A dataset of millions of files can have millions of problems, but an event stays under
//! [`crate::wire::MAX_EVENT_BYTES`]. [`ProblemTally`] keeps the first problems that fit a byte
//! budget and counts every problem per code, in constant memory; the full list goes to a
//! report (the quarantine marker) that the event points at.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// One thing wrong.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
pub struct Problem {
    /// A stable machine code, one of [`code::ALL`]: `path_rule`, `missing`, `size_mismatch`,
    /// `checksum_mismatch`, `duplicate_path`, `symlink_escape`, `not_a_file`, `too_large`,
    /// `too_many_entries`, `suffix_denied`, `suffix_not_allowed`, `bad_sha256`, `unreadable`,
    /// `unknown_tier`, `outside_project`, `manifest_mismatch`, `manifest_malformed`, and
    /// `truncated` (the list was cut to fit the event size bound; the report holds all of it).
    pub code: String,
    /// The manifest path concerned, when the problem is about one file.
    #[serde(default)]
    pub path: Option<String>,
    /// What is wrong, for a person.
    pub detail: String,
}

impl Problem {
    pub fn new(code: &str, path: Option<&str>, detail: impl Into<String>) -> Problem {
        Problem {
            code: code.to_owned(),
            path: path.map(str::to_owned),
            detail: detail.into(),
        }
    }

    /// An upper bound of this problem's encoded size in an event, in bytes.
    pub fn encoded_bound(&self) -> usize {
        // Three keys, three string headers and the map header: 40 bytes is generous.
        40 + self.code.len() + self.path.as_ref().map_or(0, String::len) + self.detail.len()
    }
}

/// The problem codes.
pub mod code {
    /// A manifest path breaks the path rules (`..`, absolute, control characters, too long).
    pub const PATH_RULE: &str = "path_rule";
    /// No file at a manifest path.
    pub const MISSING: &str = "missing";
    /// The file's size differs from the manifest's.
    pub const SIZE_MISMATCH: &str = "size_mismatch";
    /// The file's SHA-256 differs from the manifest's.
    pub const CHECKSUM_MISMATCH: &str = "checksum_mismatch";
    /// Two manifest entries name the same path.
    pub const DUPLICATE_PATH: &str = "duplicate_path";
    /// A symlink on the way to a file, or one leading out of the tier.
    pub const SYMLINK_ESCAPE: &str = "symlink_escape";
    /// The path names a directory, FIFO, socket or device, not a regular file.
    pub const NOT_A_FILE: &str = "not_a_file";
    /// A file, or the whole dataset, is over the policy's size limit.
    pub const TOO_LARGE: &str = "too_large";
    /// The manifest lists more entries than the policy allows.
    pub const TOO_MANY_ENTRIES: &str = "too_many_entries";
    /// The policy denies a file's suffix.
    pub const SUFFIX_DENIED: &str = "suffix_denied";
    /// The policy allows only listed suffixes, and a file's is not one.
    pub const SUFFIX_NOT_ALLOWED: &str = "suffix_not_allowed";
    /// A manifest hash is not 64 lowercase hex characters.
    pub const BAD_SHA256: &str = "bad_sha256";
    /// The file exists but cannot be read (permissions, an object the store refuses).
    pub const UNREADABLE: &str = "unreadable";
    /// The request names a tier that is not declared, or not of the right role.
    pub const UNKNOWN_TIER: &str = "unknown_tier";
    /// The request's prefix is not beneath its project's own prefix on the tier.
    pub const OUTSIDE_PROJECT: &str = "outside_project";
    /// The manifest object's bytes do not hash to the digest the request declares, or its
    /// counts differ from the declared ones.
    pub const MANIFEST_MISMATCH: &str = "manifest_mismatch";
    /// The manifest object is not canonical manifest lines (a bad line, or out of order).
    pub const MANIFEST_MALFORMED: &str = "manifest_malformed";
    /// The list of problems was cut to fit the event bound; the report holds all of them.
    pub const TRUNCATED: &str = "truncated";

    /// Every code, in a fixed order.
    pub const ALL: &[&str] = &[
        PATH_RULE,
        MISSING,
        SIZE_MISMATCH,
        CHECKSUM_MISMATCH,
        DUPLICATE_PATH,
        SYMLINK_ESCAPE,
        NOT_A_FILE,
        TOO_LARGE,
        TOO_MANY_ENTRIES,
        SUFFIX_DENIED,
        SUFFIX_NOT_ALLOWED,
        BAD_SHA256,
        UNREADABLE,
        UNKNOWN_TIER,
        OUTSIDE_PROJECT,
        MANIFEST_MISMATCH,
        MANIFEST_MALFORMED,
        TRUNCATED,
    ];
}

/// The most problems an event lists.
pub const MAX_LISTED_PROBLEMS: usize = 100;

/// The most bytes the listed problems of one event take (their [`Problem::encoded_bound`]).
pub const MAX_LISTED_PROBLEM_BYTES: usize = 128 * 1024;

/// Collects problems in constant memory: the first that fit the event bounds
/// ([`MAX_LISTED_PROBLEMS`], [`MAX_LISTED_PROBLEM_BYTES`]), and a count per code of all.
///
/// ```
/// use stagehand_schemas::problem::{ProblemTally, code};
/// use stagehand_schemas::Problem;
///
/// let mut tally = ProblemTally::new();
/// for i in 0..1000 {
///     tally.add(Problem::new(code::MISSING, Some(&format!("f{i}")), "no such file"));
/// }
/// let (listed, counts, total) = tally.finish();
/// assert_eq!(total, 1000);
/// assert_eq!(counts, vec![("missing".to_owned(), 1000)]);
/// assert_eq!(listed.len(), 100);
/// assert_eq!(listed.last().unwrap().code, code::TRUNCATED);
/// ```
#[derive(Debug, Clone, Default)]
pub struct ProblemTally {
    listed: Vec<Problem>,
    listed_bytes: usize,
    counts: BTreeMap<String, u64>,
    total: u64,
    cut: bool,
}

impl ProblemTally {
    pub fn new() -> ProblemTally {
        ProblemTally::default()
    }

    /// Counts `problem`, and keeps it if it still fits.
    pub fn add(&mut self, problem: Problem) {
        self.total += 1;
        *self.counts.entry(problem.code.clone()).or_default() += 1;
        if self.cut {
            return;
        }
        let size = problem.encoded_bound();
        // One place is kept for the `truncated` marker.
        if self.listed.len() + 1 >= MAX_LISTED_PROBLEMS
            || self.listed_bytes + size + 512 > MAX_LISTED_PROBLEM_BYTES
        {
            self.cut = true;
            return;
        }
        self.listed_bytes += size;
        self.listed.push(problem);
    }

    /// Whether any problem was counted.
    pub fn is_empty(&self) -> bool {
        self.total == 0
    }

    /// Problems counted so far.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// The kept problems (ending with a `truncated` problem when some were cut), the count
    /// per code (sorted by code), and the total.
    pub fn finish(mut self) -> (Vec<Problem>, Vec<(String, u64)>, u64) {
        if self.cut {
            let kept = self.listed.len() as u64;
            self.listed.push(Problem::new(
                code::TRUNCATED,
                None,
                format!(
                    "{} problems in all; {kept} are listed here and the report holds every one",
                    self.total
                ),
            ));
        }
        (self.listed, self.counts.into_iter().collect(), self.total)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn few_problems_are_all_listed_without_a_marker() {
        let mut tally = ProblemTally::new();
        tally.add(Problem::new(code::MISSING, Some("a"), "gone"));
        tally.add(Problem::new(code::PATH_RULE, Some("../b"), "parent"));
        let (listed, counts, total) = tally.finish();
        assert_eq!(total, 2);
        assert_eq!(listed.len(), 2);
        assert_eq!(
            counts,
            vec![("missing".to_owned(), 1), ("path_rule".to_owned(), 1)]
        );
    }

    #[test]
    fn long_details_are_cut_by_bytes_before_the_count_bound() {
        let mut tally = ProblemTally::new();
        let long = "x".repeat(8000);
        for i in 0..50 {
            tally.add(Problem::new(
                code::CHECKSUM_MISMATCH,
                Some(&format!("p{i}")),
                &long,
            ));
        }
        let (listed, _, total) = tally.finish();
        assert_eq!(total, 50);
        let bytes: usize = listed.iter().map(Problem::encoded_bound).sum();
        assert!(bytes <= MAX_LISTED_PROBLEM_BYTES, "{bytes}");
        assert!(listed.len() < 50);
        assert_eq!(listed.last().unwrap().code, code::TRUNCATED);
    }

    #[test]
    fn every_code_is_listed_once() {
        let mut seen = std::collections::HashSet::new();
        for c in code::ALL {
            assert!(seen.insert(*c), "{c} twice");
        }
    }
}
