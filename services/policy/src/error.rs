//! Policy errors, each naming the file, the key and what is wrong.

use std::path::{Path, PathBuf};

use stagehand_config::{key_at, line_of};
use stagehand_schemas::Retryable;

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
    /// A policy file that is optional in general but that this service cannot run without.
    #[error("{}: missing, and the {service} needs it (see policies/ for an example)", file.display())]
    Needed { file: PathBuf, service: String },
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
    /// The file concerned.
    pub fn file(&self) -> &Path {
        match self {
            PolicyError::ReadDir { dir, .. } => dir,
            PolicyError::ReadFile { file, .. }
            | PolicyError::Missing { file }
            | PolicyError::Needed { file, .. }
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

impl Retryable for PolicyError {
    /// Always false: a policy file does not fix itself.
    fn is_retryable(&self) -> bool {
        false
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
