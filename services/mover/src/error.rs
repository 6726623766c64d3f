//! What can go wrong moving a file, said with what, where, and whether a retry can help.

use stagehand_schemas::Retryable;
use std::fmt;

/// Which side of a transfer an error happened on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Source,
    Destination,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Source => "source",
            Side::Destination => "destination",
        })
    }
}

/// The kind of a transfer failure. Callers branch on this, never on message text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The path is not a confined relative path (`..`, absolute, NUL, symlink escape).
    PathRefused,
    /// The source file or object does not exist.
    NotFound,
    /// The bytes read do not hash to the expected SHA-256.
    ChecksumMismatch,
    /// The size differs from the expected size (found from `fstat`, HEAD or the GET's
    /// `Content-Length` before any byte is read, or when a file grew while it was read).
    SizeMismatch,
    /// The path names something other than a regular file or object: a directory, FIFO,
    /// socket or device. Found without reading from it (a FIFO is opened non-blocking).
    NotAFile,
    /// The file is larger than the caller's maximum file size; found before any byte is read.
    TooLarge,
    /// The object store refused a request about this one object (an HTTP 4xx other than
    /// 404, 403, 412 and 429: a bad key, an invalid range, ...). Permanent and about that
    /// object only; other objects of the same tier are unaffected.
    ObjectRefused,
    /// The source changed while it was being copied.
    SourceChanged,
    /// The destination filesystem or bucket is full (ENOSPC, EDQUOT).
    NoSpace,
    /// Permission denied (EACCES, EPERM, S3 403).
    PermissionDenied,
    /// The endpoint could not be reached (connect refused, DNS, timeout).
    Unreachable,
    /// The endpoint asked us to slow down (S3 503 SlowDown, 429).
    Throttled,
    /// The destination already holds different bytes under that name.
    DestinationConflict,
    /// The transfer was cancelled by its caller.
    Cancelled,
    /// Any other I/O error.
    Io,
    /// Any other object-store error.
    ObjectStore,
    /// The tier configuration is invalid.
    Config,
}

impl Retryable for ErrorKind {
    /// Whether trying the same transfer again later can succeed without anyone changing anything.
    fn is_retryable(&self) -> bool {
        matches!(
            self,
            ErrorKind::Unreachable
                | ErrorKind::Throttled
                | ErrorKind::SourceChanged
                | ErrorKind::Io
                | ErrorKind::ObjectStore
                | ErrorKind::NoSpace
        )
    }
}

/// A failed transfer step: what went wrong, on which tier and path, and why.
#[derive(Debug, thiserror::Error)]
#[error("{kind:?} on {side} tier {tier:?} at {path:?}: {detail}")]
pub struct TransferError {
    pub kind: ErrorKind,
    pub side: Side,
    /// The tier's name (or a display form of its root when it has no name).
    pub tier: String,
    /// The relative path or key concerned.
    pub path: String,
    pub detail: String,
    #[source]
    pub source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
}

impl TransferError {
    pub fn new(
        kind: ErrorKind,
        side: Side,
        tier: impl Into<String>,
        path: impl Into<String>,
        detail: impl Into<String>,
    ) -> Self {
        Self {
            kind,
            side,
            tier: tier.into(),
            path: path.into(),
            detail: detail.into(),
            source: None,
        }
    }

    pub fn with_source(mut self, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.source = Some(Box::new(source));
        self
    }
}

impl Retryable for TransferError {
    fn is_retryable(&self) -> bool {
        self.kind.is_retryable()
    }
}

/// The kind for an OS error number. ELOOP and EXDEV only arise from confined opens
/// (`openat2` with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV`) and mean a
/// path that tried to leave its tier or follow a link; ENAMETOOLONG is a path or component
/// over PATH_MAX / NAME_MAX: all three are about that one path, never worth a retry.
pub fn kind_for_errno(errno: i32) -> ErrorKind {
    match errno {
        libc::ENOSPC | libc::EDQUOT => ErrorKind::NoSpace,
        libc::EACCES | libc::EPERM | libc::EROFS => ErrorKind::PermissionDenied,
        libc::ENOENT | libc::ENOTDIR => ErrorKind::NotFound,
        libc::ELOOP | libc::EXDEV | libc::ENAMETOOLONG => ErrorKind::PathRefused,
        // open(2) of a socket, or of a device with no driver behind it.
        libc::ENXIO | libc::ENODEV => ErrorKind::NotAFile,
        libc::EEXIST => ErrorKind::DestinationConflict,
        _ => ErrorKind::Io,
    }
}

impl TransferError {
    /// An OS error on `side`, classified by its errno.
    pub fn from_io(
        err: std::io::Error,
        side: Side,
        tier: impl Into<String>,
        path: impl Into<String>,
        what: &str,
    ) -> Self {
        let kind = err.raw_os_error().map_or(ErrorKind::Io, kind_for_errno);
        let detail = match kind {
            ErrorKind::PathRefused => {
                format!(
                    "{what}: refused, the path leaves the tier root or crosses a symlink ({err})"
                )
            }
            _ => format!("{what}: {err}"),
        };
        TransferError::new(kind, side, tier, path, detail).with_source(err)
    }

    /// A rustix errno on `side`, classified.
    pub fn from_errno(
        err: rustix::io::Errno,
        side: Side,
        tier: impl Into<String>,
        path: impl Into<String>,
        what: &str,
    ) -> Self {
        Self::from_io(std::io::Error::from(err), side, tier, path, what)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_mapping() {
        assert_eq!(kind_for_errno(libc::ENOSPC), ErrorKind::NoSpace);
        assert_eq!(kind_for_errno(libc::EDQUOT), ErrorKind::NoSpace);
        assert_eq!(kind_for_errno(libc::EACCES), ErrorKind::PermissionDenied);
        assert_eq!(kind_for_errno(libc::EPERM), ErrorKind::PermissionDenied);
        assert_eq!(kind_for_errno(libc::ENOENT), ErrorKind::NotFound);
        assert_eq!(kind_for_errno(libc::ELOOP), ErrorKind::PathRefused);
        assert_eq!(kind_for_errno(libc::EXDEV), ErrorKind::PathRefused);
        assert_eq!(kind_for_errno(libc::ENAMETOOLONG), ErrorKind::PathRefused);
        assert_eq!(kind_for_errno(libc::ENXIO), ErrorKind::NotAFile);
        assert_eq!(kind_for_errno(libc::EIO), ErrorKind::Io);
    }

    #[test]
    fn error_names_tier_and_path() {
        let e = TransferError::from_io(
            std::io::Error::from_raw_os_error(libc::ENOSPC),
            Side::Destination,
            "scratch",
            "a/b.bin",
            "write",
        );
        let text = e.to_string();
        assert!(
            text.contains("scratch") && text.contains("a/b.bin") && text.contains("NoSpace"),
            "{text}"
        );
        assert!(e.is_retryable());
    }
}
