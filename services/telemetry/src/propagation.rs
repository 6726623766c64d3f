//! W3C trace context over NATS headers.
//!
//! A consumed event's `traceparent` header becomes the parent of the span that handles it, and
//! the facts published inside that span carry the span's context on, so one trace follows a
//! request through every service. The propagator is used directly rather than through the
//! global one, so propagation works even where [`crate::init`] was not called.

use async_nats::HeaderMap;
use opentelemetry::Context;
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TraceContextExt;
use opentelemetry_sdk::propagation::TraceContextPropagator;

/// The header carrying the W3C trace parent.
pub const TRACEPARENT: &str = "traceparent";

/// Writes propagation fields into NATS headers.
pub struct HeaderInjector<'a>(pub &'a mut HeaderMap);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0.insert(key, value.as_str());
    }
}

/// Reads propagation fields from NATS headers.
pub struct HeaderExtractor<'a>(pub &'a HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(|v| v.as_str())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.iter().map(|(k, _)| k.as_ref()).collect()
    }
}

/// The trace context carried by `headers` (an empty context when there is none).
pub fn extract_context(headers: Option<&HeaderMap>) -> Context {
    match headers {
        Some(h) => TraceContextPropagator::new().extract(&HeaderExtractor(h)),
        None => Context::new(),
    }
}

/// Writes `cx`'s span context into `headers`; does nothing when `cx` has no valid span.
pub fn inject_context(cx: &Context, headers: &mut HeaderMap) {
    if cx.span().span_context().is_valid() {
        TraceContextPropagator::new().inject_context(cx, &mut HeaderInjector(headers));
    }
}

/// The environment variable a caller sets to make a command's span a child of its own: the
/// carrier OpenTelemetry specifies for processes (a value in `traceparent`'s format).
pub const TRACEPARENT_ENV: &str = "TRACEPARENT";
/// Its companion carrying vendor trace state.
pub const TRACESTATE_ENV: &str = "TRACESTATE";

/// Reads propagation fields from the process environment (`traceparent` from `TRACEPARENT`).
struct EnvExtractor(Vec<(&'static str, String)>);

impl Extractor for EnvExtractor {
    fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(key))
            .map(|(_, v)| v.as_str())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.iter().map(|(k, _)| *k).collect()
    }
}

/// The trace context the process was started in: `TRACEPARENT` (and `TRACESTATE`), as a
/// workflow sets them so that the commands it runs (`stagehand ingest`, then `stagehand stage
/// request` for the job that reads the data) join its trace. An empty context when unset or
/// not a valid trace parent.
pub fn env_context() -> Context {
    context_from_vars(|var| std::env::var(var).ok())
}

/// The trace context in the variables `var` reads ([`env_context`] with the environment).
fn context_from_vars(var: impl Fn(&str) -> Option<String>) -> Context {
    let fields = [
        (TRACEPARENT, TRACEPARENT_ENV),
        ("tracestate", TRACESTATE_ENV),
    ]
    .into_iter()
    .filter_map(|(key, name)| var(name).map(|v| (key, v)))
    .collect();
    TraceContextPropagator::new().extract(&EnvExtractor(fields))
}

/// Whether `cx` holds a valid remote or local span context.
pub fn has_span(cx: &Context) -> bool {
    cx.span().span_context().is_valid()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_round_trips_through_nats_headers() {
        let mut incoming = HeaderMap::new();
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        incoming.insert(TRACEPARENT, tp);
        let cx = extract_context(Some(&incoming));
        assert!(has_span(&cx));
        assert_eq!(
            cx.span().span_context().trace_id().to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        let mut outgoing = HeaderMap::new();
        inject_context(&cx, &mut outgoing);
        assert_eq!(outgoing.get(TRACEPARENT).unwrap().as_str(), tp);
    }

    #[test]
    fn a_process_joins_the_trace_in_its_traceparent_variable() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let cx = context_from_vars(|v| (v == TRACEPARENT_ENV).then(|| tp.to_owned()));
        assert!(has_span(&cx));
        let mut out = HeaderMap::new();
        inject_context(&cx, &mut out);
        assert_eq!(out.get(TRACEPARENT).unwrap().as_str(), tp);
        assert!(!has_span(&context_from_vars(|_| None)));
        assert!(!has_span(&context_from_vars(|_| Some("garbage".into()))));
    }

    #[test]
    fn no_header_means_no_context_and_nothing_injected() {
        let cx = extract_context(None);
        assert!(!has_span(&cx));
        let mut out = HeaderMap::new();
        inject_context(&cx, &mut out);
        assert!(out.get(TRACEPARENT).is_none());
        let garbage = {
            let mut h = HeaderMap::new();
            h.insert(TRACEPARENT, "not-a-traceparent");
            h
        };
        assert!(!has_span(&extract_context(Some(&garbage))));
    }
}
