//! The checks themselves, as functions over a request, the validation policy, one manifest
//! entry at a time and what reading each file showed. Nothing here touches NATS or a
//! filesystem, so every rule is tested directly.
//!
//! Validation runs in three steps. The *request* step ([`request_problems`]) looks only at
//! what the request says: the source tier, the source prefix (a path beneath the tier root,
//! and beneath the project's own `<project>/` prefix), and the declared entry count and byte
//! total against the policy's bounds. Any problem there rejects the request before its
//! manifest is opened or any file is read. The *entry* step ([`EntryChecks`]) judges each
//! manifest entry as the entries stream past in path order: path rules, duplicates (equal
//! paths are adjacent in path order, so remembering the previous path is enough), hash form,
//! size and suffix rules. It decides which entries are worth reading. The *read* step
//! ([`compare`]) compares what reading an entry showed with what was declared. Every problem
//! of the entry and read steps is reported; none stops the others from being found.

use stagehand_mover::FileDigest;
use stagehand_policy::{SuffixVerdict, TierRole, ValidationPolicy};
use stagehand_schemas::{FileRef, Location, Problem, check_relative_path, is_sha256_hex, layout};

/// Stable problem codes: the contract's (`stagehand_schemas::problem::code`).
pub use stagehand_schemas::problem::code;

fn problem(code: &str, path: Option<&str>, detail: impl Into<String>) -> Problem {
    Problem::new(code, path, detail)
}

/// What the source tier's policy says, as far as the request step needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceTier {
    /// Declared with role `source`: readable.
    Usable,
    /// Not declared in `tiers.toml`.
    Unknown,
    /// Declared with another role.
    WrongRole(TierRole),
}

/// What a request declares about its manifest, before the manifest is opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Declared {
    /// Entries the manifest lists (the reference's count, or the inline list's length).
    pub files: u64,
    /// The sum of the entries' sizes.
    pub bytes: u64,
}

/// The request step: every problem with the request as a whole. When this is not empty the
/// request is rejected on what it says alone: its manifest is not opened and no file is read
/// (a dataset over its bounds is not fetched; a prefix outside the project is not touched).
pub fn request_problems(
    project: &str,
    source: &Location,
    declared: Declared,
    policy: &ValidationPolicy,
    tier: SourceTier,
) -> Vec<Problem> {
    let mut problems = Vec::new();
    match tier {
        SourceTier::Usable => {}
        SourceTier::Unknown => problems.push(problem(
            code::UNKNOWN_TIER,
            None,
            format!(
                "source tier {:?} is not declared in tiers.toml",
                source.tier
            ),
        )),
        SourceTier::WrongRole(role) => problems.push(problem(
            code::UNKNOWN_TIER,
            None,
            format!(
                "tier {:?} has role {:?}; ingest reads only from tiers with role \"source\"",
                source.tier,
                role.as_str()
            ),
        )),
    }
    let prefix = source.prefix.as_str();
    let prefix_ok = match check_relative_path(prefix) {
        Ok(()) => true,
        // An empty prefix is the whole tier: not a path problem, but never within a project.
        Err(_) if prefix.is_empty() => true,
        Err(e) => {
            problems.push(problem(
                code::PATH_RULE,
                Some(prefix),
                format!("source prefix: {e}"),
            ));
            false
        }
    };
    // The one location rule (`stagehand_schemas::layout`), as every consumer applies it.
    if prefix_ok && let Err(why) = layout::check_prefix_in_project(project, prefix) {
        problems.push(problem(
            code::OUTSIDE_PROJECT,
            (!prefix.is_empty()).then_some(prefix),
            format!(
                "the source prefix {prefix:?} is not beneath the project's own prefix {project:?}/ on the tier ({why}); nothing was read"
            ),
        ));
    }
    if declared.files > policy.max_entries {
        problems.push(problem(
            code::TOO_MANY_ENTRIES,
            None,
            format!(
                "the manifest lists {} entries, over the limit of {} (validation.max_entries); no file was read",
                declared.files, policy.max_entries
            ),
        ));
    }
    if declared.bytes > policy.max_total_bytes {
        problems.push(problem(
            code::TOO_LARGE,
            None,
            format!(
                "the manifest declares {} bytes in all, over the limit of {} (validation.max_total_bytes); no file was read",
                declared.bytes, policy.max_total_bytes
            ),
        ));
    }
    problems
}

/// What the entry step says about one entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Judged {
    /// Problems found without reading.
    pub problems: Vec<Problem>,
    /// Whether the entry is read and compared.
    pub read: bool,
}

/// The entry step over a manifest's entries in path order. Holds only the previous path:
/// duplicates are adjacent in path order, so memory does not grow with the file count.
#[derive(Debug)]
pub struct EntryChecks<'a> {
    policy: &'a ValidationPolicy,
    /// The last distinct path and its 1-based line in the manifest.
    previous: Option<(String, u64)>,
    line: u64,
}

impl<'a> EntryChecks<'a> {
    pub fn new(policy: &'a ValidationPolicy) -> Self {
        EntryChecks {
            policy,
            previous: None,
            line: 0,
        }
    }

    /// Judges the next entry. Entries must come in path order (the manifest's order), else
    /// a duplicate that is not adjacent goes unnoticed.
    pub fn check(&mut self, file: &FileRef) -> Judged {
        self.line += 1;
        let policy = self.policy;
        let path = file.path.as_str();
        let shown = Some(path);
        let mut problems = Vec::new();
        let mut read = true;
        if let Err(e) = check_relative_path(path) {
            problems.push(problem(code::PATH_RULE, shown, e.to_string()));
            // Never hand a refused path to a tier, even though the tier would refuse it too.
            read = false;
        } else if !policy.allow_hidden && ValidationPolicy::is_hidden(path) {
            problems.push(problem(
                code::PATH_RULE,
                shown,
                "hidden file or folder (a name starting with `.`), refused by validation.allow_hidden = false",
            ));
        }
        match &self.previous {
            Some((previous, first)) if previous == path => {
                problems.push(problem(
                    code::DUPLICATE_PATH,
                    shown,
                    format!(
                        "listed again at line {} of the manifest; first at line {first}",
                        self.line
                    ),
                ));
                read = false;
            }
            _ => self.previous = Some((path.to_owned(), self.line)),
        }
        if !is_sha256_hex(&file.sha256) {
            problems.push(problem(
                code::BAD_SHA256,
                shown,
                format!(
                    "sha256 {:?} is not 64 lowercase hex characters",
                    file.sha256
                ),
            ));
        }
        if file.size > policy.max_file_size {
            problems.push(problem(
                code::TOO_LARGE,
                shown,
                format!(
                    "declared size {} bytes is over the limit of {} (validation.max_file_size)",
                    file.size, policy.max_file_size
                ),
            ));
            read = false;
        }
        match policy.suffix_verdict(path) {
            SuffixVerdict::Allowed => {}
            SuffixVerdict::Denied(suffix) => problems.push(problem(
                code::SUFFIX_DENIED,
                shown,
                format!("suffix {suffix:?} is denied by validation.denied_suffixes"),
            )),
            SuffixVerdict::NotAllowed => problems.push(problem(
                code::SUFFIX_NOT_ALLOWED,
                shown,
                format!(
                    "the file name ends with none of validation.allowed_suffixes ({})",
                    policy.allowed_suffixes.join(", ")
                ),
            )),
        }
        Judged { problems, read }
    }
}

/// What reading one file on the source tier showed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Observed {
    /// Read to the end (never more than one byte past its declared size): its size and hash.
    Digest(FileDigest),
    /// Its size, found before reading, is not the declared one: not read. The detail says
    /// both sizes.
    SizeDiffers(String),
    /// Its size, found before reading, is over the policy's `max_file_size`: not read.
    TooLarge(String),
    /// Nothing at that path.
    Missing,
    /// Something other than a regular file (a directory, FIFO, socket or device), found
    /// without reading from it. The detail says what it is.
    NotAFile(String),
    /// A symlink on the way, or a path that leaves the tier root. The detail says which.
    Escapes(String),
    /// The prefix and path joined are longer than the tier takes (PATH_MAX on posix, 1024
    /// bytes for an S3 key).
    PathTooLong(String),
    /// Present but cannot be read, for a reason a retry will not fix (permissions, an object
    /// the store refuses).
    Unreadable(String),
}

/// The tier-relative path of a manifest entry: the request's prefix joined with its path.
pub fn tier_path(prefix: &str, path: &str) -> String {
    if prefix.is_empty() {
        path.to_owned()
    } else {
        format!("{prefix}/{path}")
    }
}

/// The problems with one read entry.
pub fn compare(file: &FileRef, observed: &Observed, policy: &ValidationPolicy) -> Vec<Problem> {
    let shown = Some(file.path.as_str());
    match observed {
        Observed::Digest(digest) => {
            let mut problems = Vec::new();
            // The size is checked before reading, so this is a file that changed while it
            // was read (grown past its declared size, or shrunk).
            if digest.size != file.size {
                problems.push(problem(
                    code::SIZE_MISMATCH,
                    shown,
                    format!(
                        "declared {} bytes, read {} (the file changed while it was read)",
                        file.size, digest.size
                    ),
                ));
                if digest.size > policy.max_file_size {
                    problems.push(problem(
                        code::TOO_LARGE,
                        shown,
                        format!(
                            "read {} bytes, over the limit of {} (validation.max_file_size)",
                            digest.size, policy.max_file_size
                        ),
                    ));
                }
            }
            // A malformed declared hash is already reported as bad_sha256.
            if is_sha256_hex(&file.sha256) && digest.sha256 != file.sha256 {
                problems.push(problem(
                    code::CHECKSUM_MISMATCH,
                    shown,
                    format!("declared sha256 {}, found {}", file.sha256, digest.sha256),
                ));
            }
            problems
        }
        Observed::SizeDiffers(detail) => vec![problem(code::SIZE_MISMATCH, shown, detail.clone())],
        Observed::TooLarge(detail) => vec![problem(code::TOO_LARGE, shown, detail.clone())],
        Observed::Missing => vec![problem(
            code::MISSING,
            shown,
            "no file at this path on the source tier",
        )],
        Observed::NotAFile(detail) => vec![problem(code::NOT_A_FILE, shown, detail.clone())],
        Observed::Escapes(detail) => vec![problem(
            code::SYMLINK_ESCAPE,
            shown,
            format!("a symlink is on the way or the path leaves the tier root: {detail}"),
        )],
        Observed::PathTooLong(detail) => vec![problem(code::PATH_RULE, shown, detail.clone())],
        Observed::Unreadable(detail) => vec![problem(code::UNREADABLE, shown, detail.clone())],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagehand_schemas::sha256_hex;

    fn policy() -> ValidationPolicy {
        ValidationPolicy {
            max_file_size: 1000,
            max_entries: 10,
            max_total_bytes: 5000,
            allowed_suffixes: vec![],
            denied_suffixes: vec![".exe".into()],
            allow_hidden: false,
        }
    }

    fn source(prefix: &str) -> Location {
        Location {
            tier: "source".into(),
            prefix: prefix.into(),
        }
    }

    fn good(path: &str) -> FileRef {
        FileRef::new(path, 3, sha256_hex(b"abc"))
    }

    fn codes(problems: &[Problem]) -> Vec<(String, Option<String>)> {
        problems
            .iter()
            .map(|p| (p.code.clone(), p.path.clone()))
            .collect()
    }

    fn pair(code: &str, path: &str) -> (String, Option<String>) {
        (code.to_owned(), Some(path.to_owned()))
    }

    /// Runs the entry step over `files` in the order given; returns every problem and the
    /// indices of the entries to read.
    fn judge_all(files: &[FileRef], policy: &ValidationPolicy) -> (Vec<Problem>, Vec<usize>) {
        let mut checks = EntryChecks::new(policy);
        let mut problems = Vec::new();
        let mut read = Vec::new();
        for (i, f) in files.iter().enumerate() {
            let judged = checks.check(f);
            problems.extend(judged.problems);
            if judged.read {
                read.push(i);
            }
        }
        (problems, read)
    }

    const FEW: Declared = Declared { files: 2, bytes: 6 };

    #[test]
    fn a_clean_request_and_manifest_have_no_problems_and_read_everything() {
        assert!(
            request_problems(
                "lab",
                &source("lab/up/1"),
                FEW,
                &policy(),
                SourceTier::Usable
            )
            .is_empty()
        );
        let (problems, read) = judge_all(&[good("a"), good("b/c.bin")], &policy());
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(read, vec![0, 1]);
    }

    #[test]
    fn every_entry_problem_is_listed_with_its_path() {
        // In path order, as a manifest streams them.
        let files = vec![
            good(".git/config"),
            good("../x"),
            good("/etc/passwd"),
            FileRef::new("huge", 1001, sha256_hex(b"x")),
            good("ok"),
            good("ok"),
            good("ok"),
            good("tool.EXE"),
            FileRef::new("upper", 3, "ABC"),
        ];
        let (problems, read) = judge_all(&files, &policy());
        assert_eq!(
            codes(&problems),
            vec![
                pair("path_rule", ".git/config"),
                pair("path_rule", "../x"),
                pair("path_rule", "/etc/passwd"),
                pair("too_large", "huge"),
                pair("duplicate_path", "ok"),
                pair("duplicate_path", "ok"),
                pair("suffix_denied", "tool.EXE"),
                pair("bad_sha256", "upper"),
            ]
        );
        // Both copies of a duplicate point at the first.
        assert!(problems[4].detail.contains("line 6") && problems[4].detail.contains("line 5"));
        assert!(problems[5].detail.contains("line 7") && problems[5].detail.contains("line 5"));
        // Refused paths, the repeated "ok"s and the oversized file are not read; the rest are.
        assert_eq!(read, vec![0, 4, 7, 8]);
    }

    #[test]
    fn allow_list_applies_to_file_names() {
        let mut p = policy();
        p.allowed_suffixes = vec![".jpg".into()];
        let (problems, _) = judge_all(&[good("a.jpg"), good("b.png")], &p);
        assert_eq!(codes(&problems), vec![pair("suffix_not_allowed", "b.png")]);
    }

    #[test]
    fn declared_bounds_reject_the_request_before_anything_is_read() {
        let many = Declared {
            files: 11,
            bytes: 33,
        };
        let problems =
            request_problems("lab", &source("lab/x"), many, &policy(), SourceTier::Usable);
        assert_eq!(
            codes(&problems),
            vec![("too_many_entries".to_owned(), None)]
        );
        assert!(problems[0].detail.contains("11 entries"));

        let heavy = Declared {
            files: 6,
            bytes: 5400,
        };
        let problems = request_problems(
            "lab",
            &source("lab/x"),
            heavy,
            &policy(),
            SourceTier::Usable,
        );
        assert_eq!(codes(&problems), vec![("too_large".to_owned(), None)]);
    }

    #[test]
    fn unknown_or_wrong_tier_and_bad_prefix_are_reported() {
        let unknown =
            request_problems("lab", &source("lab/a"), FEW, &policy(), SourceTier::Unknown);
        assert_eq!(codes(&unknown), vec![("unknown_tier".to_owned(), None)]);
        let role = request_problems(
            "lab",
            &source("lab/a"),
            FEW,
            &policy(),
            SourceTier::WrongRole(TierRole::Hot),
        );
        assert!(role[0].detail.contains("\"hot\""));
        let bad = request_problems(
            "lab",
            &source("../elsewhere"),
            FEW,
            &policy(),
            SourceTier::Usable,
        );
        assert_eq!(codes(&bad), vec![pair("path_rule", "../elsewhere")]);
    }

    /// Issue 6 item 5: a request may only name paths beneath its own project's prefix.
    #[test]
    fn a_prefix_outside_the_project_is_outside_project() {
        // The bare project folder holds all of the project's data: no one upload is all of it.
        for outside in ["lab-b/data", "labx/data", "la", "", "data/lab", "lab"] {
            let problems =
                request_problems("lab", &source(outside), FEW, &policy(), SourceTier::Usable);
            assert_eq!(
                codes(&problems),
                if outside.is_empty() {
                    vec![("outside_project".to_owned(), None)]
                } else {
                    vec![pair("outside_project", outside)]
                },
                "{outside:?}"
            );
        }
        for inside in ["lab/data", "lab/a/b/c"] {
            let problems =
                request_problems("lab", &source(inside), FEW, &policy(), SourceTier::Usable);
            assert!(problems.is_empty(), "{inside:?}: {problems:?}");
        }
    }

    #[test]
    fn comparing_reports_size_hash_absence_and_what_was_not_read() {
        let p = policy();
        let file = good("a");
        let same = Observed::Digest(FileDigest {
            size: 3,
            sha256: sha256_hex(b"abc"),
        });
        assert!(compare(&file, &same, &p).is_empty());
        let other = Observed::Digest(FileDigest {
            size: 3,
            sha256: sha256_hex(b"abd"),
        });
        assert_eq!(
            codes(&compare(&file, &other, &p)),
            vec![pair("checksum_mismatch", "a")]
        );
        let grew = Observed::Digest(FileDigest {
            size: 2000,
            sha256: sha256_hex(b"abc"),
        });
        assert_eq!(
            codes(&compare(&file, &grew, &p)),
            vec![pair("size_mismatch", "a"), pair("too_large", "a")]
        );
        for (observed, want) in [
            (Observed::SizeDiffers("4 bytes".into()), "size_mismatch"),
            (Observed::TooLarge("2 GiB".into()), "too_large"),
            (Observed::Missing, "missing"),
            (Observed::NotAFile("a FIFO".into()), "not_a_file"),
            (Observed::Escapes("ELOOP".into()), "symlink_escape"),
            (Observed::PathTooLong("4100 bytes".into()), "path_rule"),
            (Observed::Unreadable("EACCES".into()), "unreadable"),
        ] {
            assert_eq!(codes(&compare(&file, &observed, &p)), vec![pair(want, "a")]);
        }
    }

    #[test]
    fn tier_paths_join_the_prefix() {
        assert_eq!(tier_path("", "a/b"), "a/b");
        assert_eq!(tier_path("up/1", "a/b"), "up/1/a/b");
    }
}
