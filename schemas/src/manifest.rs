//! File references, manifests and the dataset version digest.
//!
//! A dataset version is content-addressed. Its digest is defined as:
//!
//! ```text
//! digest = lowercase_hex(SHA-256( concat over entries sorted by path bytes of
//!              path ++ "\t" ++ decimal(size) ++ "\t" ++ lowercase_hex(sha256) ++ "\n" ))
//! ```
//!
//! Sorting is by the raw UTF-8 bytes of `path` (so `B` < `a` and `a/b` < `a0`). Sizes are
//! plain base-10 without leading zeros. Every line, the last included, ends with `\n`. An
//! empty manifest has the digest of the empty string. The same bytes under the same names are
//! the same version, whatever order the uploader listed them in.
//!
//! Those sorted lines are also the manifest's *canonical bytes*: stored as an object, a
//! manifest is exactly them, so the object's SHA-256 is the version digest and any reader can
//! check a fetched manifest against the version before trusting a line ([`ManifestRef`]).
//! [`parse_line`] is the one parser of a manifest line, for canonical objects and for the
//! manifests people write by hand alike.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::path::{PathError, check_relative_path};

/// One file: where it is beneath a tier root, how big it is, and what it hashes to.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
pub struct FileRef {
    /// Relative, normalised path beneath the tier root (see [`crate::path`]).
    #[cfg_attr(feature = "json-schema", schemars(length(min = 1, max = crate::path::MAX_PATH_BYTES)))]
    pub path: String,
    /// Size in bytes.
    pub size: u64,
    /// SHA-256 of the content, 64 lowercase hex characters.
    #[cfg_attr(
        feature = "json-schema",
        schemars(pattern(crate::json_schema::SHA256_PATTERN))
    )]
    pub sha256: String,
}

/// Why a file reference is malformed (before any byte is read).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FileRefError {
    #[error(transparent)]
    Path(#[from] PathError),
    #[error("sha256 {0:?} is not 64 lowercase hex characters")]
    BadSha256(String),
}

impl FileRef {
    pub fn new(path: impl Into<String>, size: u64, sha256: impl Into<String>) -> Self {
        Self {
            path: path.into(),
            size,
            sha256: sha256.into(),
        }
    }

    /// Checks the path rules and the hash form.
    pub fn check(&self) -> Result<(), FileRefError> {
        check_relative_path(&self.path)?;
        if !is_sha256_hex(&self.sha256) {
            return Err(FileRefError::BadSha256(self.sha256.clone()));
        }
        Ok(())
    }

    /// This entry's manifest line, `path\tsize\tsha256\n`.
    pub fn manifest_line(&self) -> String {
        format!("{}\t{}\t{}\n", self.path, self.size, self.sha256)
    }
}

/// The most bytes of manifest lines an event may carry inline (`files`); a larger manifest
/// travels by reference ([`ManifestRef`]). Producers refuse to inline more.
pub const INLINE_MANIFEST_MAX_BYTES: u64 = 256 * 1024;

/// A manifest by reference: the canonical manifest bytes (sorted `path\tsize\tsha256\n`
/// lines) are an object named by `digest` in a manifest bucket, and `digest` is their SHA-256,
/// which is the version digest. Which bucket follows from the event
/// ([`crate::subject::manifest_bucket_for`]), never from the event's own say, so that no event
/// can point a reader at another project's objects.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "json-schema", derive(schemars::JsonSchema))]
pub struct ManifestRef {
    /// SHA-256 of the manifest object: the (declared, for a request) version digest.
    #[cfg_attr(
        feature = "json-schema",
        schemars(pattern(crate::json_schema::SHA256_PATTERN))
    )]
    pub digest: String,
    /// Number of entries (lines).
    pub files: u64,
    /// Sum of the entries' sizes.
    pub bytes: u64,
}

/// Why a manifest line does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LineError {
    #[error("expected path<TAB>size<TAB>sha256, found {fields} tab-separated field(s)")]
    Fields { fields: usize },
    #[error("size {0:?} is not a base-10 number without leading zeros")]
    Size(String),
    #[error("the line is not valid UTF-8")]
    Utf8,
}

/// Parses one manifest line (without its `\n`; a trailing `\r` is not allowed): `path`,
/// `size` and `sha256` separated by single tabs. The path and hash are taken as written —
/// judging them ([`FileRef::check`]) is the validator's job, so that a bad entry becomes a
/// problem naming it, not an unreadable manifest.
pub fn parse_line(line: &[u8]) -> Result<FileRef, LineError> {
    let text = std::str::from_utf8(line).map_err(|_| LineError::Utf8)?;
    let mut parts = text.split('\t');
    let (Some(path), Some(size), Some(sha), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(LineError::Fields {
            fields: text.split('\t').count(),
        });
    };
    let canonical_number = !size.is_empty()
        && size.bytes().all(|b| b.is_ascii_digit())
        && (size == "0" || !size.starts_with('0'));
    let size: u64 = match canonical_number.then(|| size.parse().ok()).flatten() {
        Some(n) => n,
        None => return Err(LineError::Size(size.to_owned())),
    };
    Ok(FileRef::new(path, size, sha))
}

/// The canonical manifest bytes of `files`: their lines sorted by path bytes.
pub fn canonical_bytes(files: &[FileRef]) -> Vec<u8> {
    let mut sorted: Vec<&FileRef> = files.iter().collect();
    sorted.sort_by(|a, b| a.path.as_bytes().cmp(b.path.as_bytes()));
    let mut out = Vec::with_capacity(files.iter().map(|f| f.path.len() + 88).sum());
    for file in sorted {
        out.extend_from_slice(file.manifest_line().as_bytes());
    }
    out
}

/// The length of `files`' canonical manifest bytes, to compare with
/// [`INLINE_MANIFEST_MAX_BYTES`] without building them.
pub fn canonical_len(files: &[FileRef]) -> u64 {
    files
        .iter()
        .map(|f| (f.path.len() + 1 + decimal_len(f.size) + 1 + f.sha256.len() + 1) as u64)
        .sum()
}

fn decimal_len(n: u64) -> usize {
    n.checked_ilog10().map_or(1, |d| d as usize + 1)
}

/// Whether `s` is exactly 64 lowercase hex characters.
pub fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// SHA-256 of `bytes` as lowercase hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// The version digest of a manifest, as defined in the module documentation.
pub fn version_digest(files: &[FileRef]) -> String {
    let mut sorted: Vec<&FileRef> = files.iter().collect();
    sorted.sort_by(|a, b| a.path.as_bytes().cmp(b.path.as_bytes()));
    let mut hasher = Sha256::new();
    for file in sorted {
        hasher.update(file.manifest_line().as_bytes());
    }
    hex::encode(hasher.finalize())
}

/// Total bytes of a manifest.
pub fn total_bytes(files: &[FileRef]) -> u64 {
    files.iter().map(|f| f.size).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    const EMPTY_SHA: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

    #[test]
    fn empty_manifest_digest_is_sha256_of_nothing() {
        assert_eq!(version_digest(&[]), EMPTY_SHA);
    }

    #[test]
    fn digest_is_sha256_of_sorted_lines() {
        let a = FileRef::new("a.txt", 3, sha256_hex(b"abc"));
        let b = FileRef::new("B/c.bin", 0, EMPTY_SHA);
        // By bytes, "B/c.bin" < "a.txt".
        let expected = sha256_hex(
            format!(
                "B/c.bin\t0\t{EMPTY_SHA}\na.txt\t3\t{}\n",
                sha256_hex(b"abc")
            )
            .as_bytes(),
        );
        assert_eq!(version_digest(&[a.clone(), b.clone()]), expected);
        assert_eq!(
            version_digest(&[b, a]),
            expected,
            "order of listing must not matter"
        );
    }

    #[test]
    fn digest_is_pinned() {
        // A fixed vector, computed independently (Python hashlib): if this changes, every
        // recorded version id changes with it.
        let files = [
            FileRef::new("train/0001.jpg", 5, sha256_hex(b"hello")),
            FileRef::new("labels.csv", 0, EMPTY_SHA),
        ];
        assert_eq!(
            version_digest(&files),
            "62a5d72b12e05973548dc641bb57e6b0b9f73a5aea0c39e7163c4fc0d5af4684"
        );
    }

    #[test]
    fn canonical_bytes_hash_to_the_version_digest() {
        let files = [
            FileRef::new("train/0001.jpg", 5, sha256_hex(b"hello")),
            FileRef::new("labels.csv", 0, EMPTY_SHA),
        ];
        let bytes = canonical_bytes(&files);
        assert_eq!(sha256_hex(&bytes), version_digest(&files));
        assert_eq!(canonical_len(&files), bytes.len() as u64);
    }

    #[test]
    fn lines_parse_strictly() {
        let sha = sha256_hex(b"x");
        assert_eq!(
            parse_line(format!("a/b\t10\t{sha}").as_bytes()).unwrap(),
            FileRef::new("a/b", 10, &sha)
        );
        assert_eq!(
            parse_line(format!("../x\t0\t{sha}").as_bytes())
                .unwrap()
                .path,
            "../x",
            "paths are judged by the validator, not the parser"
        );
        for bad in ["a\t010\tx", "a\t-1\tx", "a\t\tx", "a\t1 \tx"] {
            assert!(
                matches!(parse_line(bad.as_bytes()), Err(LineError::Size(_))),
                "{bad:?}"
            );
        }
        // A carriage return stays in the hash field, which the validator reports as bad_sha256.
        assert_eq!(parse_line(b"a\t1\tx\r").unwrap().sha256, "x\r");
        assert_eq!(parse_line(b"a\t1"), Err(LineError::Fields { fields: 2 }));
        assert_eq!(
            parse_line(b"a\t1\tx\ty"),
            Err(LineError::Fields { fields: 4 })
        );
        assert_eq!(parse_line(b"\xff\t1\tx"), Err(LineError::Utf8));
    }

    #[test]
    fn file_ref_check_names_the_problem() {
        assert!(FileRef::new("ok", 1, EMPTY_SHA).check().is_ok());
        assert!(matches!(
            FileRef::new("../x", 1, EMPTY_SHA).check(),
            Err(FileRefError::Path(PathError::ParentComponent(_)))
        ));
        assert!(matches!(
            FileRef::new("ok", 1, EMPTY_SHA.to_uppercase()).check(),
            Err(FileRefError::BadSha256(_))
        ));
    }
}
