//! Errors of the bus and of handlers, each able to say whether retrying can help.

use std::fmt;

/// What went wrong talking to NATS, provisioning, or keeping the ledger.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BusError {
    #[error("could not connect to NATS at {url}: {detail}")]
    Connect { url: String, detail: String },
    /// The server refused the credentials (a wrong password, an unknown key): permanent.
    #[error("NATS at {url} refused the credentials: {detail}")]
    Unauthorized { url: String, detail: String },
    #[error("bus configuration is invalid: {key}: {reason}")]
    Config { key: &'static str, reason: String },
    #[error("could not provision {what}: {detail}")]
    Provision { what: String, detail: String },
    #[error(
        "stream {stream} has retention {found:?}, but {wanted:?} is declared; retention is fixed at creation, so the stream must be migrated by hand"
    )]
    RetentionMismatch {
        stream: String,
        found: String,
        wanted: String,
    },
    #[error("could not publish to {subject}: {detail}")]
    Publish { subject: String, detail: String },
    #[error("could not encode event {id}: {detail}")]
    Encode { id: String, detail: String },
    #[error("could not pull messages from consumer {consumer}: {detail}")]
    Consume { consumer: String, detail: String },
    #[error("claims bucket: {0}")]
    Claim(String),
    #[error(transparent)]
    Ledger(#[from] crate::ledger::LedgerError),
}

impl BusError {
    /// Whether the same operation may succeed later (a server down, a timeout) rather than
    /// failing again for the same reason (bad configuration, a stream of the wrong kind).
    pub fn is_retryable(&self) -> bool {
        match self {
            BusError::Connect { .. }
            | BusError::Publish { .. }
            | BusError::Consume { .. }
            | BusError::Claim(_)
            | BusError::Provision { .. } => true,
            BusError::Config { .. }
            | BusError::Unauthorized { .. }
            | BusError::RetentionMismatch { .. }
            | BusError::Encode { .. } => false,
            BusError::Ledger(e) => e.is_retryable(),
        }
    }
}

/// Why a handler could not finish an event. The runtime retries a retryable error later (a
/// negative ack with a delay) and dead-letters a permanent one at once.
pub struct HandlerError {
    permanent: bool,
    source: Box<dyn std::error::Error + Send + Sync + 'static>,
}

impl HandlerError {
    /// Trying again later may succeed (a tier offline, a timeout, a busy server).
    pub fn retryable(
        source: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    ) -> Self {
        Self {
            permanent: false,
            source: source.into(),
        }
    }

    /// Trying again cannot help (the event asks for something impossible).
    pub fn permanent(
        source: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    ) -> Self {
        Self {
            permanent: true,
            source: source.into(),
        }
    }

    pub fn is_permanent(&self) -> bool {
        self.permanent
    }

    pub fn is_retryable(&self) -> bool {
        !self.permanent
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
            .field("permanent", &self.permanent)
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
        assert!(!e.is_permanent());
        assert_eq!(e.to_string(), "tier offline");
        let e = HandlerError::permanent("manifest names ../x");
        assert!(e.is_permanent());
        assert_eq!(e.to_string(), "manifest names ../x");
    }
}
