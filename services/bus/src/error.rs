//! Errors of the bus and of handlers, each able to say whether retrying can help.
//!
//! [`BusError`] follows the `Error<Kind>` shape of async-nats: a small [`BusErrorKind`] that
//! callers branch on (and that decides [`BusError::is_retryable`]), a sentence saying what was
//! being done, and the cause kept as the error's `source` — a NATS error stays a NATS error,
//! never a string.

use stagehand_schemas::Retryable;
use std::fmt;

/// A cause of any type, as kept in [`BusError`] and [`HandlerError`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What failed, for callers to branch on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum BusErrorKind {
    /// NATS could not be reached in time (down, timed out, DNS, I/O).
    Connect,
    /// The server refused the credentials (a wrong password, an unknown key, an authorization
    /// violation), or the TLS setup or a server URL is wrong. Retrying unchanged fails again.
    Unauthorized,
    /// A configuration value is invalid.
    Config,
    /// Creating or updating a stream, consumer or bucket failed.
    Provision,
    /// A stream exists with another retention policy than the declared one; retention is
    /// fixed at creation, so it must be migrated by hand.
    RetentionMismatch,
    /// Publishing failed, or the stream did not acknowledge.
    Publish,
    /// The stream did not answer a publish within the caller's time: no responders, no
    /// stream found on a clustered server, or no acknowledgement, on every try. What a stream
    /// without a leader looks like (a node lost, an election past its budget); the same
    /// publish later may succeed.
    Unavailable,
    /// An event could not be encoded (too large, invalid field).
    Encode,
    /// Pulling or acknowledging messages failed.
    Consume,
    /// The claims bucket could not be read or written.
    Claim,
    /// The ledger failed; its own kind says whether that may pass.
    Ledger(crate::ledger::LedgerErrorKind),
    /// Another process registered this worker's instance id (two instances configured alike).
    InstanceTaken,
    /// A handler reported that the service cannot work at all ([`HandlerError::fatal`]).
    HandlerFatal,
}

impl Retryable for BusErrorKind {
    /// Whether the same operation may succeed later (a server down, a timeout) rather than
    /// failing again for the same reason (bad configuration, a stream of the wrong kind).
    fn is_retryable(&self) -> bool {
        match self {
            BusErrorKind::Connect
            | BusErrorKind::Provision
            | BusErrorKind::Publish
            | BusErrorKind::Unavailable
            | BusErrorKind::Consume
            | BusErrorKind::Claim
            // A supervisor restarting the service is the retry for a fatal handler error and
            // for a ledger that could not be reopened: the restart reopens it.
            | BusErrorKind::HandlerFatal
            | BusErrorKind::Ledger(crate::ledger::LedgerErrorKind::Failed) => true,
            BusErrorKind::Unauthorized
            | BusErrorKind::Config
            | BusErrorKind::RetentionMismatch
            | BusErrorKind::Encode
            | BusErrorKind::InstanceTaken => false,
            BusErrorKind::Ledger(kind) => kind.is_retryable(),
        }
    }
}

/// What went wrong talking to NATS, provisioning, claiming, or keeping the ledger.
pub struct BusError {
    kind: BusErrorKind,
    what: String,
    source: Option<BoxError>,
    /// For a configuration error: the key and what is wrong with it.
    config: Option<(String, String)>,
}

impl BusError {
    /// An error of `kind`; `what` says what was being done ("publishing to …").
    pub fn new(kind: BusErrorKind, what: impl Into<String>) -> Self {
        Self {
            kind,
            what: what.into(),
            source: None,
            config: None,
        }
    }

    /// An error of `kind` caused by `source`.
    pub fn with_source(
        kind: BusErrorKind,
        what: impl Into<String>,
        source: impl Into<BoxError>,
    ) -> Self {
        Self {
            kind,
            what: what.into(),
            source: Some(source.into()),
            config: None,
        }
    }

    /// An invalid configuration value: names the key and what is wrong with it.
    pub fn config(key: &str, reason: impl fmt::Display) -> Self {
        let reason = reason.to_string();
        Self {
            config: Some((key.to_owned(), reason.clone())),
            ..Self::new(
                BusErrorKind::Config,
                format!("bus configuration is invalid: {key}: {reason}"),
            )
        }
    }

    /// For a configuration error, the key (`replicas`, `concurrency`, …) and what is wrong
    /// with it, so that a caller can name the key in its own file.
    pub fn config_key(&self) -> Option<(&str, &str)> {
        self.config.as_ref().map(|(k, r)| (k.as_str(), r.as_str()))
    }

    pub fn kind(&self) -> BusErrorKind {
        self.kind
    }

    /// What was being done (`could not publish to <subject>`), without the causes.
    pub fn what(&self) -> &str {
        &self.what
    }
}

impl Retryable for BusError {
    /// Whether the same operation may succeed later; follows from the kind.
    fn is_retryable(&self) -> bool {
        self.kind.is_retryable()
    }
}

impl fmt::Display for BusError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.what)?;
        write_chain(f, std::error::Error::source(self))
    }
}

impl fmt::Debug for BusError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BusError")
            .field("kind", &self.kind)
            .field("what", &self.what)
            .field("source", &self.source)
            .finish()
    }
}

impl std::error::Error for BusError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

impl From<crate::ledger::LedgerError> for BusError {
    fn from(e: crate::ledger::LedgerError) -> Self {
        BusError::with_source(BusErrorKind::Ledger(e.kind()), "ledger", e)
    }
}

/// Writes `: cause` for every error in the chain starting at `first`, so that a log line
/// carries the whole story while `source()` still hands out the typed causes.
fn write_chain(
    f: &mut fmt::Formatter<'_>,
    first: Option<&(dyn std::error::Error + 'static)>,
) -> fmt::Result {
    let mut cause = first;
    while let Some(c) = cause {
        write!(f, ": {c}")?;
        cause = c.source();
    }
    Ok(())
}

/// How the runtime treats a [`HandlerError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    Retryable,
    Permanent,
    Fatal,
}

/// Why a handler could not finish an event. The runtime retries a retryable error later (a
/// negative ack with a delay), dead-letters a permanent one at once, and stops the worker on
/// a fatal one.
pub struct HandlerError {
    class: Class,
    source: BoxError,
}

impl HandlerError {
    /// Trying again later may succeed (a tier offline, a timeout, a busy server).
    pub fn retryable(source: impl Into<BoxError>) -> Self {
        Self {
            class: Class::Retryable,
            source: source.into(),
        }
    }

    /// Trying again cannot help (the event asks for something impossible).
    pub fn permanent(source: impl Into<BoxError>) -> Self {
        Self {
            class: Class::Permanent,
            source: source.into(),
        }
    }

    /// The service cannot work on anything (its own store failed): the event is not at fault.
    /// The runtime leaves the message for redelivery without counting an attempt, stops the
    /// worker, and `run_worker` returns the error, so that the supervisor restarts the service.
    pub fn fatal(source: impl Into<BoxError>) -> Self {
        Self {
            class: Class::Fatal,
            source: source.into(),
        }
    }

    pub fn is_permanent(&self) -> bool {
        self.class == Class::Permanent
    }

    pub fn is_retryable(&self) -> bool {
        self.class == Class::Retryable
    }

    pub fn is_fatal(&self) -> bool {
        self.class == Class::Fatal
    }

    /// The error, for the worker to return when it stops on it.
    pub(crate) fn into_source(self) -> BoxError {
        self.source
    }
}

/// The runtime's reading of a [`Retryable`] error: retryable, or permanent. A handler returns
/// such an error with `?` (or `HandlerError::from`) instead of deciding again which it is.
impl<E> From<E> for HandlerError
where
    E: Retryable + std::error::Error + Send + Sync + 'static,
{
    fn from(e: E) -> Self {
        if e.is_retryable() {
            Self::retryable(e)
        } else {
            Self::permanent(e)
        }
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.source, f)?;
        let mut next = self.source.source();
        while let Some(cause) = next {
            write!(f, ": {cause}")?;
            next = cause.source();
        }
        Ok(())
    }
}

impl fmt::Debug for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HandlerError")
            .field("class", &self.class)
            .field("error", &self.to_string())
            .finish()
    }
}

impl std::error::Error for HandlerError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(self.source.as_ref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handler_error_keeps_class_and_chain() {
        let io = std::io::Error::new(std::io::ErrorKind::TimedOut, "tier offline");
        let e = HandlerError::retryable(io);
        assert!(e.is_retryable() && !e.is_permanent() && !e.is_fatal());
        assert_eq!(e.to_string(), "tier offline");
        let e = HandlerError::permanent("manifest names ../x");
        assert!(e.is_permanent());
        assert_eq!(e.to_string(), "manifest names ../x");
        assert!(HandlerError::fatal("store failed").is_fatal());
    }

    #[test]
    fn bus_error_keeps_its_cause_and_says_retryable_from_its_kind() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset by peer");
        let e = BusError::with_source(BusErrorKind::Publish, "publishing to stagehand.fact.x", io);
        assert_eq!(e.kind(), BusErrorKind::Publish);
        assert!(e.is_retryable());
        assert_eq!(
            e.to_string(),
            "publishing to stagehand.fact.x: reset by peer"
        );
        let source = std::error::Error::source(&e).expect("the cause is kept");
        assert!(source.downcast_ref::<std::io::Error>().is_some());
        let e = BusError::config("concurrency", "0 is not in 1..=10000");
        assert_eq!(e.kind(), BusErrorKind::Config);
        assert!(!e.is_retryable());
        assert!(e.to_string().contains("concurrency"));
        assert_eq!(
            e.config_key(),
            Some(("concurrency", "0 is not in 1..=10000"))
        );
    }
}
