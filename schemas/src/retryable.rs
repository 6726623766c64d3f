//! Whether a failure is worth trying again: the one classification every error type of
//! Stagehand gives ([`Retryable`]), and that the worker runtime applies when a handler fails
//! (`stagehand_bus::HandlerError` is built from any `Retryable` error: retried later with a
//! delayed negative ack, or dead-lettered at once).
//!
//! It lives in the crate every other one depends on, so that the mover, the manifest store, the
//! policies, the catalogue client and every service classify their errors the same way; the
//! events carry the answer too (`stage.failed`'s `retryable`, a dead letter's attempts).

/// Whether the same operation, tried again later, may succeed: a tier offline, a timeout, a
/// busy server (retryable), or an impossible request, a bad file, a refusal (permanent).
pub trait Retryable {
    fn is_retryable(&self) -> bool;
}

impl<T: Retryable + ?Sized> Retryable for Box<T> {
    fn is_retryable(&self) -> bool {
        (**self).is_retryable()
    }
}
