//! Span field and metric names, in one place so logs, traces and dashboards agree.
//!
//! Label values must stay bounded: a service, stream, kind or outcome, never an event id or a
//! path (those go in span fields, which are not aggregated).

/// Span and log field: the event id being handled.
pub const EVENT_ID: &str = "event_id";
/// Span and log field: the event kind (`ingest.requested`, …).
pub const KIND: &str = "kind";
/// Span and log field: the project (tenant).
pub const PROJECT: &str = "project";
/// Span and log field: the dataset, when the event concerns one.
pub const DATASET: &str = "dataset";
/// Span and log field: the delivery count of the message (1 for the first).
pub const DELIVERY: &str = "delivery";
/// Span and log field: the stream sequence of the message.
pub const STREAM_SEQUENCE: &str = "stream_sequence";
/// Span and log field: the service (durable consumer) handling the message.
pub const SERVICE: &str = "service";

/// Name of the span opened for every consumed message.
pub const SPAN_HANDLE_MESSAGE: &str = "handle_message";

/// Counter: messages whose handling finished, labelled by `outcome`.
pub const MESSAGES_TOTAL: &str = "stagehand_messages_total";
/// Counter: ledger write transactions committed.
pub const LEDGER_COMMITS_TOTAL: &str = "stagehand_ledger_commits_total";
/// Counter: messages sent to the dead-letter stream.
pub const DEAD_LETTERS_TOTAL: &str = "stagehand_dead_letters_total";
/// Counter: publishes acknowledged as duplicates of a message that is not theirs (another
/// subject or event under the same `Nats-Msg-Id`, or one that could not be read), published
/// again under a fresh id; labelled by `stream`.
pub const PUBLISHES_SHADOWED_TOTAL: &str = "stagehand_publishes_shadowed_total";
/// Counter: catalogue queries refused because their reply subject is no inbox of the
/// configured prefixes; labelled by `service`.
pub const QUERIES_REFUSED_TOTAL: &str = "stagehand_queries_refused_total";

/// Outcome label values for [`MESSAGES_TOTAL`].
pub mod outcome {
    pub const DONE: &str = "done";
    pub const REPLAYED: &str = "replayed";
    /// A copy acked because another message of the same event was being worked on.
    pub const REDUNDANT: &str = "redundant";
    pub const RETRIED: &str = "retried";
    pub const DEAD_LETTERED: &str = "dead_lettered";
    /// Negatively acked without counting an attempt: the claim was held by a live owner or
    /// lost, or the worker stopped on a fatal error.
    pub const DEFERRED: &str = "deferred";
}

/// Gauge: 1 while a service runs, labelled by `service` and `version` (the crate version).
pub const SERVICE_INFO: &str = "stagehand_service_info";
/// Counter: handler calls finished, labelled by `service` and `result` ([`result`]).
pub const HANDLER_CALLS_TOTAL: &str = "stagehand_handler_calls_total";
/// Histogram (seconds): how long a handler took for one event, labelled by `service`.
pub const HANDLER_SECONDS: &str = "stagehand_handler_seconds";
/// Counter: tasks of a service (its worker, query server, clock) that stopped with an error,
/// labelled by `service` and `task` (the task's fixed name).
pub const TASK_FAILURES_TOTAL: &str = "stagehand_task_failures_total";

/// Label keys of the metrics above.
pub mod label {
    pub const SERVICE: &str = "service";
    pub const VERSION: &str = "version";
    pub const RESULT: &str = "result";
    pub const TASK: &str = "task";
    pub const OUTCOME: &str = "outcome";
    pub const STREAM: &str = "stream";
}

/// Result label values for [`HANDLER_CALLS_TOTAL`].
pub mod result {
    pub const OK: &str = "ok";
    pub const RETRYABLE: &str = "retryable";
    pub const PERMANENT: &str = "permanent";
}
