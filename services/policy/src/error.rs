//! Policy errors, each naming the file, the key and what is wrong.

use std::path::{Path, PathBuf};

/// Why the policies could not be loaded. Every error is permanent: the files must be fixed,
/// and loading them again unchanged gives the same answer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PolicyError {
    #[error("cannot read policy directory {}: {source}", dir.display())]
    ReadDir {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot read policy file {}: {source}", file.display())]
    ReadFile {
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: required policy file is missing", file.display())]
    Missing { file: PathBuf },
    #[error("{}: not a known policy file (known: {known})", file.display())]
    UnknownFile { file: PathBuf, known: String },
    #[error("{}{}: `{key}`: {message}", file.display(), line.map(|l| format!(":{l}")).unwrap_or_default())]
    Invalid {
        file: PathBuf,
        /// Dotted key path, e.g. `tiers.hot.high_watermark`; the table itself when the
        /// problem is a missing key.
        key: String,
        /// 1-based line of the key, where it could be found.
        line: Option<usize>,
        message: String,
    },
}

impl PolicyError {
    /// Always false: a policy file does not fix itself.
    pub fn is_retryable(&self) -> bool {
        false
    }

    /// The file concerned.
    pub fn file(&self) -> &Path {
        match self {
            PolicyError::ReadDir { dir, .. } => dir,
            PolicyError::ReadFile { file, .. }
            | PolicyError::Missing { file }
            | PolicyError::UnknownFile { file, .. }
            | PolicyError::Invalid { file, .. } => file,
        }
    }

    /// The dotted key concerned, for [`PolicyError::Invalid`].
    pub fn key(&self) -> Option<&str> {
        match self {
            PolicyError::Invalid { key, .. } => Some(key),
            _ => None,
        }
    }
}

/// One policy file's text, to parse it and to point errors at its keys.
pub(crate) struct Source<'a> {
    pub file: &'a Path,
    pub text: &'a str,
}

impl Source<'_> {
    /// Deserialises the whole file, turning a TOML or type error into [`PolicyError::Invalid`]
    /// with the key found at the error's position.
    pub fn parse<T: serde::de::DeserializeOwned>(&self) -> Result<T, PolicyError> {
        toml::from_str(self.text).map_err(|err| {
            let (key, line) = match err.span() {
                Some(span) => key_at(self.text, span.start),
                None => (String::new(), None),
            };
            PolicyError::Invalid {
                file: self.file.to_owned(),
                key: if key.is_empty() {
                    "(top level)".to_owned()
                } else {
                    key
                },
                line,
                message: err.message().trim().to_owned(),
            }
        })
    }

    /// An error about `key`, pointing at its line when the key is written in the file.
    pub fn invalid(&self, key: impl Into<String>, message: impl Into<String>) -> PolicyError {
        let key = key.into();
        PolicyError::Invalid {
            file: self.file.to_owned(),
            line: line_of(self.text, &key),
            key,
            message: message.into(),
        }
    }
}

/// Each line's dotted key path: the table header it is under plus its own key.
fn line_keys(text: &str) -> impl Iterator<Item = (usize, usize, String)> + '_ {
    let mut table = String::new();
    let mut offset = 0;
    text.split_inclusive('\n')
        .enumerate()
        .map(move |(index, raw)| {
            let start = offset;
            offset += raw.len();
            let line = raw.trim();
            let key = if let Some(header) = line.strip_prefix('[') {
                let header = header.trim_start_matches('[');
                let end = header.find(']').unwrap_or(header.len());
                table = normalise_key(&header[..end]);
                table.clone()
            } else if !line.starts_with('#')
                && let Some((key, _)) = line.split_once('=')
            {
                let key = normalise_key(key);
                if table.is_empty() {
                    key
                } else {
                    format!("{table}.{key}")
                }
            } else {
                table.clone()
            };
            (start, index + 1, key)
        })
}

/// `a . "b-c"` → `a.b-c`.
fn normalise_key(key: &str) -> String {
    key.split('.')
        .map(|part| part.trim().trim_matches('"').trim_matches('\''))
        .collect::<Vec<_>>()
        .join(".")
}

/// The key path and line at byte `pos`.
fn key_at(text: &str, pos: usize) -> (String, Option<usize>) {
    let mut found = (String::new(), None);
    for (start, line, key) in line_keys(text) {
        if start > pos {
            break;
        }
        found = (key, Some(line));
    }
    found
}

/// The line where `key` is written (or its table opens), if anywhere.
fn line_of(text: &str, key: &str) -> Option<usize> {
    let mut table_line = None;
    for (_, line, found) in line_keys(text) {
        if found == key {
            return Some(line);
        }
        if table_line.is_none() && key.starts_with(&format!("{found}.")) && !found.is_empty() {
            table_line = Some(line);
        }
    }
    table_line
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# comment\ntop = 1\n\n[tiers.hot]\nkind = \"posix\"\n\"high_watermark\" = 2\n[tiers.hot.quotas]\nlab-a = 3\n";

    #[test]
    fn keys_follow_table_headers() {
        assert_eq!(line_of(TEXT, "top"), Some(2));
        assert_eq!(line_of(TEXT, "tiers.hot"), Some(4));
        assert_eq!(line_of(TEXT, "tiers.hot.high_watermark"), Some(6));
        assert_eq!(line_of(TEXT, "tiers.hot.quotas.lab-a"), Some(8));
        // A key not written falls back to the first table that contains it.
        assert_eq!(line_of(TEXT, "tiers.hot.root"), Some(4));
        let pos = TEXT.find("lab-a").unwrap();
        assert_eq!(
            key_at(TEXT, pos),
            ("tiers.hot.quotas.lab-a".into(), Some(8))
        );
    }
}
