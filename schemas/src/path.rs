//! The path rules every manifest entry and every tier key obeys.
//!
//! A manifest path names a file *relative to a tier root*. It is checked lexically here,
//! before anything touches a filesystem or an object store; the mover then opens it with
//! `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` so that a symlink planted on the tier
//! cannot lead outside it either. Both checks are needed: the lexical one gives a clear
//! reason to the uploader, the kernel one closes races and links.

use std::fmt;

/// The longest relative path accepted, in bytes (Linux `PATH_MAX`).
pub const MAX_PATH_BYTES: usize = 4096;
/// The longest single component accepted, in bytes (Linux `NAME_MAX`).
pub const MAX_COMPONENT_BYTES: usize = 255;

/// Why a path is not an acceptable relative path beneath a tier root.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PathError {
    #[error("path is empty")]
    Empty,
    #[error("path {0:?} is absolute; manifest paths are relative to the tier root")]
    Absolute(String),
    #[error("path {0:?} contains a NUL byte")]
    Nul(String),
    #[error("path {0:?} contains a `..` component")]
    ParentComponent(String),
    #[error("path {0:?} is not normalised (empty or `.` component, or a trailing slash)")]
    NotNormalised(String),
    #[error(
        "path {0:?} contains a backslash, which is refused to keep keys identical on posix and S3"
    )]
    Backslash(String),
    #[error("path {path:?} is {len} bytes, over the limit of {MAX_PATH_BYTES}")]
    TooLong { path: String, len: usize },
    #[error(
        "path {path:?} has a component of {len} bytes, over the limit of {MAX_COMPONENT_BYTES}"
    )]
    ComponentTooLong { path: String, len: usize },
    #[error("path {0:?} contains a control character")]
    Control(String),
}

/// Whether two folders (relative, normalised paths) are the same folder or one lies beneath
/// the other: what makes two checkpoint steps overlap, so that removing one would remove
/// (part of) the other. `a/b` and `a/bc` do not overlap.
pub fn folders_overlap(a: &str, b: &str) -> bool {
    let beneath = |inner: &str, outer: &str| {
        inner
            .strip_prefix(outer)
            .is_some_and(|rest| rest.starts_with('/'))
    };
    a == b || beneath(a, b) || beneath(b, a)
}

/// Checks that `path` is a relative, normalised path of plain components.
///
/// Accepted: `a`, `a/b.bin`, `shards/000001.tar`. Refused: ``, `/a`, `a/../b`, `./a`,
/// `a//b`, `a/`, `a\b`, anything with NUL or another control character.
pub fn check_relative_path(path: &str) -> Result<(), PathError> {
    if path.is_empty() {
        return Err(PathError::Empty);
    }
    if path.contains('\0') {
        return Err(PathError::Nul(path.to_owned()));
    }
    if path.starts_with('/') {
        return Err(PathError::Absolute(path.to_owned()));
    }
    if path.len() > MAX_PATH_BYTES {
        return Err(PathError::TooLong {
            path: path.to_owned(),
            len: path.len(),
        });
    }
    if path.contains('\\') {
        return Err(PathError::Backslash(path.to_owned()));
    }
    if path.chars().any(char::is_control) {
        return Err(PathError::Control(path.to_owned()));
    }
    for component in path.split('/') {
        match component {
            ".." => return Err(PathError::ParentComponent(path.to_owned())),
            "" | "." => return Err(PathError::NotNormalised(path.to_owned())),
            c if c.len() > MAX_COMPONENT_BYTES => {
                return Err(PathError::ComponentTooLong {
                    path: path.to_owned(),
                    len: c.len(),
                });
            }
            _ => {}
        }
    }
    Ok(())
}

/// A path that passed [`check_relative_path`].
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RelPath(String);

impl RelPath {
    pub fn new(path: impl Into<String>) -> Result<Self, PathError> {
        let path = path.into();
        check_relative_path(&path)?;
        Ok(Self(path))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The parent directory, if the path has one (`a/b/c` → `a/b`).
    pub fn parent(&self) -> Option<&str> {
        self.0.rsplit_once('/').map(|(parent, _)| parent)
    }

    pub fn into_string(self) -> String {
        self.0
    }
}

impl fmt::Debug for RelPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for RelPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for RelPath {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folders_overlap_when_equal_or_nested_not_when_they_share_a_name_start() {
        assert!(folders_overlap("p/run/step-1", "p/run/step-1"));
        assert!(folders_overlap("p/run/step-1", "p/run/step-1/inner"));
        assert!(folders_overlap("p/run/step-1/inner", "p/run/step-1"));
        assert!(!folders_overlap("p/run/step-1", "p/run/step-10"));
        assert!(!folders_overlap("p/run/step-10", "p/run/step-1"));
        assert!(!folders_overlap("p/run/a", "p/run/b"));
    }

    #[test]
    fn accepts_plain_relative_paths() {
        for ok in [
            "a",
            "a/b.bin",
            "shards/000001.tar",
            "with space/ünïcode",
            "..a/b..",
            ".hidden",
        ] {
            assert_eq!(check_relative_path(ok), Ok(()), "{ok}");
        }
    }

    /// A path and a check that the error it gets is the expected one.
    type Case = (&'static str, fn(&PathError) -> bool);

    #[test]
    fn refuses_every_escape_and_unnormalised_form() {
        let cases: &[Case] = &[
            ("", |e| matches!(e, PathError::Empty)),
            ("/etc/passwd", |e| matches!(e, PathError::Absolute(_))),
            ("../x", |e| matches!(e, PathError::ParentComponent(_))),
            ("a/../../x", |e| matches!(e, PathError::ParentComponent(_))),
            ("a/..", |e| matches!(e, PathError::ParentComponent(_))),
            ("./a", |e| matches!(e, PathError::NotNormalised(_))),
            ("a//b", |e| matches!(e, PathError::NotNormalised(_))),
            ("a/", |e| matches!(e, PathError::NotNormalised(_))),
            ("a\0b", |e| matches!(e, PathError::Nul(_))),
            ("a\\..\\b", |e| matches!(e, PathError::Backslash(_))),
            ("a\nb", |e| matches!(e, PathError::Control(_))),
        ];
        for (path, expected) in cases {
            let err = check_relative_path(path).expect_err(path);
            assert!(expected(&err), "{path:?} gave {err:?}");
        }
        let long = "a".repeat(MAX_COMPONENT_BYTES + 1);
        assert!(matches!(
            check_relative_path(&long),
            Err(PathError::ComponentTooLong { .. })
        ));
        let too_long = ["abc"; 2000].join("/");
        assert!(matches!(
            check_relative_path(&too_long),
            Err(PathError::TooLong { .. })
        ));
    }

    #[test]
    fn parent_is_the_directory_part() {
        assert_eq!(RelPath::new("a/b/c").unwrap().parent(), Some("a/b"));
        assert_eq!(RelPath::new("c").unwrap().parent(), None);
    }
}
