//! Files a test lays down and looks at: written with their manifest entries, deterministic
//! bytes, a folder's names, and times set back as if the files had lain untouched.

use std::path::Path;
use std::time::{Duration, SystemTime};

use stagehand_schemas::{FileRef, sha256_hex};

/// Writes each `(path, bytes)` beneath `dir` (creating folders) and returns their manifest
/// entries, paths relative to `dir`, in the order given. Panics on a failed write.
pub fn put_files<P: AsRef<str>, B: AsRef<[u8]>>(dir: &Path, files: &[(P, B)]) -> Vec<FileRef> {
    files
        .iter()
        .map(|(rel, bytes)| {
            let (rel, bytes) = (rel.as_ref(), bytes.as_ref());
            let path = dir.join(rel);
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent)
                    .unwrap_or_else(|e| panic!("creating {}: {e}", parent.display()));
            }
            std::fs::write(&path, bytes)
                .unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
            FileRef::new(rel, bytes.len() as u64, sha256_hex(bytes))
        })
        .collect()
}

/// `len` deterministic bytes of a file, different for each `seed`.
pub fn pattern_bytes(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

/// The names in `dir` (one level, hidden ones included), sorted; empty when it does not exist.
pub fn list_dir(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|r| {
            r.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// Dates `path` and everything beneath it `days` back, as if nobody had touched them since
/// (what an audit's grace before quarantine reads). Panics on a path it cannot date.
pub fn backdate(path: &Path, days: u64) {
    let then = SystemTime::now() - Duration::from_secs(days * 86_400);
    if path.is_dir() {
        let entries =
            std::fs::read_dir(path).unwrap_or_else(|e| panic!("listing {}: {e}", path.display()));
        for entry in entries {
            let entry = entry.unwrap_or_else(|e| panic!("listing {}: {e}", path.display()));
            backdate(&entry.path(), days);
        }
    }
    std::fs::File::open(path)
        .and_then(|f| f.set_modified(then))
        .unwrap_or_else(|e| panic!("dating {} {days} days back: {e}", path.display()));
}
