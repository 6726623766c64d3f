//! `validation.toml`: what an ingest request may contain.

use serde::Deserialize;

use crate::error::{PolicyError, Source};
use stagehand_config::ByteSize;

/// The rules the ingest validator applies to every manifest, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidationPolicy {
    /// Largest single file accepted, in bytes.
    pub max_file_size: u64,
    /// Most manifest entries accepted in one request.
    pub max_entries: u64,
    /// Largest dataset accepted (sum of file sizes), in bytes.
    pub max_total_bytes: u64,
    /// If not empty, a file name must end with one of these (lowercase, each starting with `.`).
    pub allowed_suffixes: Vec<String>,
    /// A file name ending with one of these is refused (lowercase, each starting with `.`).
    pub denied_suffixes: Vec<String>,
    /// Whether a path may have a component starting with `.`.
    pub allow_hidden: bool,
}

/// What the suffix rules say about one path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SuffixVerdict {
    Allowed,
    /// The file name ends with this denied suffix.
    Denied(String),
    /// An allow list exists and the file name matches none of it.
    NotAllowed,
}

impl ValidationPolicy {
    /// Applies the suffix rules to the file name of `path`, ignoring ASCII case. When both
    /// lists match (`.gz` allowed, `.tar.gz` denied), the denial wins.
    pub fn suffix_verdict(&self, path: &str) -> SuffixVerdict {
        let name = path.rsplit('/').next().unwrap_or(path).to_ascii_lowercase();
        if let Some(denied) = self
            .denied_suffixes
            .iter()
            .find(|s| name.ends_with(s.as_str()))
        {
            return SuffixVerdict::Denied(denied.clone());
        }
        if self.allowed_suffixes.is_empty()
            || self
                .allowed_suffixes
                .iter()
                .any(|s| name.ends_with(s.as_str()))
        {
            SuffixVerdict::Allowed
        } else {
            SuffixVerdict::NotAllowed
        }
    }

    /// Whether any component of `path` is hidden (starts with `.`).
    pub fn is_hidden(path: &str) -> bool {
        path.split('/').any(|c| c.starts_with('.'))
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawValidation {
    max_file_size: ByteSize,
    max_entries: u64,
    max_total_bytes: ByteSize,
    #[serde(default)]
    allowed_suffixes: Vec<String>,
    #[serde(default)]
    denied_suffixes: Vec<String>,
    allow_hidden: bool,
}

pub(crate) fn parse(src: &Source<'_>) -> Result<ValidationPolicy, PolicyError> {
    let raw: RawValidation = src.parse()?;
    if raw.max_file_size.bytes() == 0 {
        return Err(src.invalid("max_file_size", "must be more than 0 bytes"));
    }
    if raw.max_entries == 0 {
        return Err(src.invalid("max_entries", "must be at least 1"));
    }
    if raw.max_total_bytes.bytes() == 0 {
        return Err(src.invalid("max_total_bytes", "must be more than 0 bytes"));
    }
    let suffixes = |key: &str, list: Vec<String>| -> Result<Vec<String>, PolicyError> {
        list.into_iter()
            .map(|s| {
                if s.len() < 2 || !s.starts_with('.') || s.contains('/') || s.contains('\0') {
                    Err(src.invalid(
                        key,
                        format!("suffix {s:?} must start with `.`, have at least one more character and contain no `/`"),
                    ))
                } else {
                    Ok(s.to_ascii_lowercase())
                }
            })
            .collect()
    };
    let allowed_suffixes = suffixes("allowed_suffixes", raw.allowed_suffixes)?;
    let denied_suffixes = suffixes("denied_suffixes", raw.denied_suffixes)?;
    if let Some(both) = allowed_suffixes
        .iter()
        .find(|s| denied_suffixes.contains(s))
    {
        return Err(src.invalid(
            "denied_suffixes",
            format!("suffix {both:?} is both allowed and denied"),
        ));
    }
    Ok(ValidationPolicy {
        max_file_size: raw.max_file_size.bytes(),
        max_entries: raw.max_entries,
        max_total_bytes: raw.max_total_bytes.bytes(),
        allowed_suffixes,
        denied_suffixes,
        allow_hidden: raw.allow_hidden,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(allowed: &[&str], denied: &[&str]) -> ValidationPolicy {
        ValidationPolicy {
            max_file_size: 1,
            max_entries: 1,
            max_total_bytes: 1,
            allowed_suffixes: allowed.iter().map(|s| s.to_string()).collect(),
            denied_suffixes: denied.iter().map(|s| s.to_string()).collect(),
            allow_hidden: false,
        }
    }

    #[test]
    fn suffix_rules_ignore_case_and_deny_wins() {
        let p = policy(&[], &[".exe"]);
        assert_eq!(
            p.suffix_verdict("a/b.EXE"),
            SuffixVerdict::Denied(".exe".into())
        );
        assert_eq!(p.suffix_verdict("a/b.jpg"), SuffixVerdict::Allowed);
        let p = policy(&[".jpg", ".tar.gz"], &[".exe"]);
        assert_eq!(p.suffix_verdict("x.tar.gz"), SuffixVerdict::Allowed);
        assert_eq!(p.suffix_verdict("x.gz"), SuffixVerdict::NotAllowed);
        assert_eq!(
            p.suffix_verdict("x.jpg.exe"),
            SuffixVerdict::Denied(".exe".into())
        );
        // Only the file name counts, not directory names.
        assert_eq!(p.suffix_verdict("d.jpg/readme"), SuffixVerdict::NotAllowed);
    }

    #[test]
    fn hidden_means_any_component() {
        assert!(ValidationPolicy::is_hidden(".git/config"));
        assert!(ValidationPolicy::is_hidden("a/.DS_Store"));
        assert!(!ValidationPolicy::is_hidden("a/b.c"));
    }
}
