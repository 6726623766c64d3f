//! Turning the SDK's errors into [`TransferError`]s that say what, where and whether a retry can
//! help. Callers branch on [`ErrorKind`]; the server's code and message go into the detail.

use std::error::Error as StdError;

use aws_sdk_s3::config::http::HttpResponse;
use aws_sdk_s3::error::{ProvideErrorMetadata, SdkError};

use crate::error::{ErrorKind, Side, TransferError};

/// Where an S3 request went: enough to name it in an error.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Site<'a> {
    pub tier: &'a str,
    pub endpoint: &'a str,
    pub bucket: &'a str,
    pub side: Side,
    /// The tier-relative path (the key without the tier's prefix).
    pub path: &'a str,
}

impl Site<'_> {
    pub fn error(&self, kind: ErrorKind, detail: impl Into<String>) -> TransferError {
        TransferError::new(kind, self.side, self.tier, self.path, detail)
    }
}

/// Maps an SDK error for `operation` on `site` to a [`TransferError`].
pub(crate) fn map_sdk_error<E>(
    operation: &str,
    site: Site<'_>,
    err: SdkError<E, HttpResponse>,
) -> TransferError
where
    E: ProvideErrorMetadata + StdError + Send + Sync + 'static,
{
    let at = format!("{operation} s3://{}/… at {}", site.bucket, site.endpoint);
    let (kind, detail) = match &err {
        SdkError::ServiceError(service) => {
            let status = service.raw().status().as_u16();
            let code = service.err().code().unwrap_or("");
            let message = service.err().message().unwrap_or("");
            let kind = kind_for_status(status, code);
            (
                kind,
                format!("{at}: HTTP {status} {code} {message}")
                    .trim_end()
                    .to_owned(),
            )
        }
        SdkError::TimeoutError(_) => (
            ErrorKind::Unreachable,
            format!("{at}: timed out: {}", chain(&err)),
        ),
        SdkError::DispatchFailure(_) if no_credentials(&err) => (
            ErrorKind::PermissionDenied,
            format!("{at}: no credentials to sign with: {}", chain(&err)),
        ),
        SdkError::DispatchFailure(_) => (
            ErrorKind::Unreachable,
            format!("{at}: could not reach the endpoint: {}", chain(&err)),
        ),
        SdkError::ResponseError(response) => {
            let status = response.raw().status().as_u16();
            (
                kind_for_status(status, ""),
                format!("{at}: unreadable response (HTTP {status}): {}", chain(&err)),
            )
        }
        SdkError::ConstructionFailure(_) => (
            ErrorKind::Config,
            format!("{at}: request could not be built: {}", chain(&err)),
        ),
        _ => (ErrorKind::ObjectStore, format!("{at}: {}", chain(&err))),
    };
    site.error(kind, detail).with_source(err)
}

/// Whether the request never left because no credentials could be loaded (none in the
/// environment, a profile that is not there or is malformed): the SDK reports it as a dispatch
/// failure, but the endpoint was never tried and no retry mends it.
fn no_credentials(err: &(dyn StdError + 'static)) -> bool {
    use aws_credential_types::provider::error::CredentialsError;
    let mut source = Some(err);
    while let Some(e) = source {
        if let Some(c) = e.downcast_ref::<CredentialsError>() {
            return matches!(
                c,
                CredentialsError::CredentialsNotLoaded(_)
                    | CredentialsError::InvalidConfiguration(_)
            );
        }
        source = e.source();
    }
    false
}

/// The kind for an HTTP status and S3 error code.
pub(crate) fn kind_for_status(status: u16, code: &str) -> ErrorKind {
    match (status, code) {
        (_, "NoSuchKey" | "NoSuchBucket" | "NoSuchUpload") | (404, _) => ErrorKind::NotFound,
        (_, "AccessDenied" | "InvalidAccessKeyId" | "SignatureDoesNotMatch") | (401 | 403, _) => {
            ErrorKind::PermissionDenied
        }
        (_, "SlowDown" | "Throttling" | "ThrottlingException" | "RequestLimitExceeded")
        | (429 | 503, _) => ErrorKind::Throttled,
        // If-Match on a ranged GET failed: the object was replaced while we read it.
        (412, _) | (_, "PreconditionFailed") => ErrorKind::SourceChanged,
        (_, "BadDigest" | "XAmzContentSHA256Mismatch" | "InvalidDigest") => {
            ErrorKind::ChecksumMismatch
        }
        (_, "EntityTooLarge" | "QuotaExceeded") | (507, _) => ErrorKind::NoSpace,
        // Request timeout and conflicting concurrent operations: a retry can succeed.
        (408, _) => ErrorKind::Unreachable,
        (409, _) => ErrorKind::ObjectStore,
        // Any other 4xx is the server refusing this request about this object (a bad key, an
        // invalid argument or range): permanent, and that object's problem only.
        (400..=499, _) => ErrorKind::ObjectRefused,
        _ => ErrorKind::ObjectStore,
    }
}

/// An error and its sources on one line, so the root cause (`Connection refused`) is visible.
pub(crate) fn chain(err: &dyn StdError) -> String {
    let mut out = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = cause.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagehand_schemas::Retryable;

    #[test]
    fn statuses_and_codes_map_to_kinds() {
        assert_eq!(kind_for_status(404, ""), ErrorKind::NotFound);
        assert_eq!(kind_for_status(400, "NoSuchKey"), ErrorKind::NotFound);
        assert_eq!(
            kind_for_status(403, "AccessDenied"),
            ErrorKind::PermissionDenied
        );
        assert_eq!(kind_for_status(503, "SlowDown"), ErrorKind::Throttled);
        assert_eq!(kind_for_status(429, ""), ErrorKind::Throttled);
        assert_eq!(kind_for_status(412, ""), ErrorKind::SourceChanged);
        assert_eq!(
            kind_for_status(400, "BadDigest"),
            ErrorKind::ChecksumMismatch
        );
        assert_eq!(
            kind_for_status(500, "InternalError"),
            ErrorKind::ObjectStore
        );
        assert_eq!(
            kind_for_status(400, "InvalidArgument"),
            ErrorKind::ObjectRefused
        );
        assert_eq!(
            kind_for_status(400, "KeyTooLongError"),
            ErrorKind::ObjectRefused
        );
        assert_eq!(
            kind_for_status(416, "InvalidRange"),
            ErrorKind::ObjectRefused
        );
        assert!(!kind_for_status(400, "").is_retryable());
        assert!(kind_for_status(408, "").is_retryable());
        assert!(kind_for_status(503, "").is_retryable());
        assert!(!kind_for_status(403, "").is_retryable());
    }
}
