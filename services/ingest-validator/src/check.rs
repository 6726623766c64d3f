//! The checks themselves, as functions over a manifest, the validation policy and what
//! reading each file showed. Nothing here touches NATS or a filesystem, so every rule is
//! tested directly.
//!
//! Validation runs in two passes. The *static* pass looks only at the request: path rules,
//! duplicates, hash form, size and suffix rules, manifest bounds, the source tier. It decides
//! which entries are worth reading. The *read* pass hashes those entries on the source tier
//! and compares what is there with what was declared. Every problem from both passes is
//! reported; none stops the others from being found, except that a manifest over its bounds
//! (or naming no usable tier) is not read at all.

use std::collections::HashMap;

use stagehand_mover::FileDigest;
use stagehand_policy::{SuffixVerdict, TierRole, ValidationPolicy};
use stagehand_schemas::{FileRef, IngestRequested, Problem, check_relative_path, is_sha256_hex};

/// Stable problem codes: the contract's (`stagehand_schemas::problem::code`).
pub use stagehand_schemas::problem::code;

fn problem(code: &str, path: Option<&str>, detail: impl Into<String>) -> Problem {
    Problem {
        code: code.to_owned(),
        path: path.map(str::to_owned),
        detail: detail.into(),
    }
}

/// What the static pass found: the problems, and which manifest entries to read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Problems found without reading, in manifest order (request-wide ones first).
    pub problems: Vec<Problem>,
    /// Indices into the manifest of the entries to read and compare.
    pub to_read: Vec<usize>,
}

/// What the source tier's policy says, as far as the static pass needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceTier {
    /// Declared with role `source`: readable.
    Usable,
    /// Not declared in `tiers.toml`.
    Unknown,
    /// Declared with another role.
    WrongRole(TierRole),
}

/// The static pass over a request.
pub fn plan(request: &IngestRequested, policy: &ValidationPolicy, tier: SourceTier) -> Plan {
    let mut problems = Vec::new();
    // When false, nothing is read: the request is rejected on what it says alone.
    let mut readable = true;
    let files = &request.files;

    match tier {
        SourceTier::Usable => {}
        SourceTier::Unknown => {
            readable = false;
            problems.push(problem(
                code::UNKNOWN_TIER,
                None,
                format!(
                    "source tier {:?} is not declared in tiers.toml",
                    request.source.tier
                ),
            ));
        }
        SourceTier::WrongRole(role) => {
            readable = false;
            problems.push(problem(
                code::UNKNOWN_TIER,
                None,
                format!(
                    "tier {:?} has role {:?}; ingest reads only from tiers with role \"source\"",
                    request.source.tier,
                    role.as_str()
                ),
            ));
        }
    }
    if !request.source.prefix.is_empty()
        && let Err(e) = check_relative_path(&request.source.prefix)
    {
        readable = false;
        problems.push(problem(
            code::PATH_RULE,
            Some(&request.source.prefix),
            format!("source prefix: {e}"),
        ));
    }
    if files.len() as u64 > policy.max_entries {
        readable = false;
        problems.push(problem(
            code::TOO_MANY_ENTRIES,
            None,
            format!(
                "the manifest lists {} entries, over the limit of {} (validation.max_entries); split the dataset; no file was read",
                files.len(),
                policy.max_entries
            ),
        ));
    }
    let total = files.iter().fold(0u64, |sum, f| sum.saturating_add(f.size));
    if total > policy.max_total_bytes {
        readable = false;
        problems.push(problem(
            code::TOO_LARGE,
            None,
            format!(
                "the manifest declares {total} bytes in all, over the limit of {} (validation.max_total_bytes); no file was read",
                policy.max_total_bytes
            ),
        ));
    }

    let mut seen: HashMap<&str, usize> = HashMap::with_capacity(files.len());
    let mut to_read = Vec::with_capacity(files.len());
    for (index, file) in files.iter().enumerate() {
        let path = file.path.as_str();
        let shown = Some(path);
        let mut read_it = readable;
        if let Err(e) = check_relative_path(path) {
            problems.push(problem(code::PATH_RULE, shown, e.to_string()));
            // Never hand a refused path to a tier, even though the tier would refuse it too.
            read_it = false;
        } else if !policy.allow_hidden && ValidationPolicy::is_hidden(path) {
            problems.push(problem(
                code::PATH_RULE,
                shown,
                "hidden file or folder (a name starting with `.`), refused by validation.allow_hidden = false",
            ));
        }
        match seen.get(path) {
            Some(first) => {
                problems.push(problem(
                    code::DUPLICATE_PATH,
                    shown,
                    format!("listed again at entry {index}; first at entry {first}"),
                ));
                read_it = false;
            }
            None => {
                seen.insert(path, index);
            }
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
            read_it = false;
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
        if read_it {
            to_read.push(index);
        }
    }
    Plan { problems, to_read }
}

/// What reading one file on the source tier showed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Observed {
    /// Read to the end: its size and hash.
    Digest(FileDigest),
    /// Nothing at that path.
    Missing,
    /// Something other than a regular file (a directory, a device, a socket).
    NotAFile,
    /// A symlink on the way, or a path that leaves the tier root. The detail says which.
    Escapes(String),
    /// Present but cannot be read, for a reason a retry will not fix (permissions).
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
            if digest.size != file.size {
                problems.push(problem(
                    code::SIZE_MISMATCH,
                    shown,
                    format!("declared {} bytes, found {}", file.size, digest.size),
                ));
                if digest.size > policy.max_file_size {
                    problems.push(problem(
                        code::TOO_LARGE,
                        shown,
                        format!(
                            "found {} bytes, over the limit of {} (validation.max_file_size)",
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
        Observed::Missing => vec![problem(
            code::MISSING,
            shown,
            "no file at this path on the source tier",
        )],
        Observed::NotAFile => vec![problem(
            code::NOT_A_FILE,
            shown,
            "not a regular file (a directory or special file is at this path)",
        )],
        Observed::Escapes(detail) => vec![problem(
            code::SYMLINK_ESCAPE,
            shown,
            format!("a symlink is on the way or the path leaves the tier root: {detail}"),
        )],
        Observed::Unreadable(detail) => vec![problem(code::UNREADABLE, shown, detail.clone())],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagehand_schemas::{Location, sha256_hex};

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

    fn request(files: Vec<FileRef>) -> IngestRequested {
        IngestRequested {
            dataset: "d".into(),
            source: Location {
                tier: "source".into(),
                prefix: "up/1".into(),
            },
            files,
            manifest: None,
            requested_by: "alice".into(),
            labels: vec![],
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

    #[test]
    fn a_clean_manifest_has_no_problems_and_reads_everything() {
        let planned = plan(
            &request(vec![good("a"), good("b/c.bin")]),
            &policy(),
            SourceTier::Usable,
        );
        assert!(planned.problems.is_empty(), "{:?}", planned.problems);
        assert_eq!(planned.to_read, vec![0, 1]);
    }

    #[test]
    fn every_static_problem_is_listed_with_its_path() {
        let files = vec![
            good("../x"),
            good("/etc/passwd"),
            good("a\0b"),
            good("ok"),
            good("ok"),
            FileRef::new("upper", 3, "ABC"),
            FileRef::new("huge", 1001, sha256_hex(b"x")),
            good("tool.EXE"),
            good(".git/config"),
        ];
        let planned = plan(&request(files), &policy(), SourceTier::Usable);
        assert_eq!(
            codes(&planned.problems),
            vec![
                pair("path_rule", "../x"),
                pair("path_rule", "/etc/passwd"),
                pair("path_rule", "a\0b"),
                pair("duplicate_path", "ok"),
                pair("bad_sha256", "upper"),
                pair("too_large", "huge"),
                pair("suffix_denied", "tool.EXE"),
                pair("path_rule", ".git/config"),
            ]
        );
        // Refused paths, the second "ok" and the oversized file are not read; the rest are.
        assert_eq!(planned.to_read, vec![3, 5, 7, 8]);
    }

    #[test]
    fn allow_list_applies_to_file_names() {
        let mut p = policy();
        p.allowed_suffixes = vec![".jpg".into()];
        let planned = plan(
            &request(vec![good("a.jpg"), good("b.png")]),
            &p,
            SourceTier::Usable,
        );
        assert_eq!(
            codes(&planned.problems),
            vec![pair("suffix_not_allowed", "b.png")]
        );
    }

    #[test]
    fn manifest_bounds_reject_without_reading() {
        let files: Vec<FileRef> = (0..11).map(|i| good(&format!("f{i}"))).collect();
        let planned = plan(&request(files), &policy(), SourceTier::Usable);
        assert_eq!(planned.problems[0].code, "too_many_entries");
        assert!(planned.problems[0].detail.contains("11 entries"));
        assert!(planned.to_read.is_empty());

        let files = vec![FileRef::new("a", 900, sha256_hex(b"")); 6]
            .into_iter()
            .enumerate()
            .map(|(i, mut f)| {
                f.path = format!("f{i}");
                f
            })
            .collect();
        let planned = plan(&request(files), &policy(), SourceTier::Usable);
        assert_eq!(
            codes(&planned.problems),
            vec![("too_large".to_owned(), None)]
        );
        assert!(planned.to_read.is_empty());
    }

    #[test]
    fn unknown_or_wrong_tier_and_bad_prefix_are_reported() {
        let plan_unknown = plan(&request(vec![good("a")]), &policy(), SourceTier::Unknown);
        assert_eq!(plan_unknown.problems[0].code, "unknown_tier");
        assert!(plan_unknown.to_read.is_empty());
        let plan_role = plan(
            &request(vec![good("a")]),
            &policy(),
            SourceTier::WrongRole(TierRole::Hot),
        );
        assert!(plan_role.problems[0].detail.contains("\"hot\""));
        let mut req = request(vec![good("a")]);
        req.source.prefix = "../elsewhere".into();
        let plan_prefix = plan(&req, &policy(), SourceTier::Usable);
        assert_eq!(
            codes(&plan_prefix.problems),
            vec![pair("path_rule", "../elsewhere")]
        );
        assert!(plan_prefix.to_read.is_empty());
    }

    #[test]
    fn comparing_reports_size_hash_and_absence() {
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
        let longer = Observed::Digest(FileDigest {
            size: 2000,
            sha256: sha256_hex(b"abc"),
        });
        assert_eq!(
            codes(&compare(&file, &longer, &p)),
            vec![pair("size_mismatch", "a"), pair("too_large", "a")]
        );
        assert_eq!(
            codes(&compare(&file, &Observed::Missing, &p)),
            vec![pair("missing", "a")]
        );
        assert_eq!(
            codes(&compare(&file, &Observed::NotAFile, &p)),
            vec![pair("not_a_file", "a")]
        );
        assert_eq!(
            codes(&compare(&file, &Observed::Escapes("ELOOP".into()), &p)),
            vec![pair("symlink_escape", "a")]
        );
        assert_eq!(
            codes(&compare(&file, &Observed::Unreadable("EACCES".into()), &p)),
            vec![pair("unreadable", "a")]
        );
    }

    #[test]
    fn tier_paths_join_the_prefix() {
        assert_eq!(tier_path("", "a/b"), "a/b");
        assert_eq!(tier_path("up/1", "a/b"), "up/1/a/b");
    }
}
