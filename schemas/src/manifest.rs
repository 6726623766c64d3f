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
