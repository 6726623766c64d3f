//! Span field and metric names, in one place so logs, traces and dashboards agree.
//!
//! Label values must stay bounded: a service, stream, kind or outcome, never an event id or a
//! path (those go in span fields, which are not aggregated).
//!
//! The metrics of the work itself (bytes moved, stage latency, tier fill, backlog, dead
//! letters, drills, ingest verdicts) are labelled by tier, priority class, service, state and
//! outcome only. Tier names and priority classes are declared by the operator in `policies/`
//! (`tiers.toml`, `priorities.toml`), so they are a small fixed set. The one exception is
//! [`PROJECT_USED_BYTES`] and [`PROJECT_QUOTA_BYTES`], labelled by `project`: projects are
//! tenants the operator declares (each its NATS users in `deploy/nats/accounts.conf` and its
//! quotas in `tiers.toml`); an event naming any other project is refused before it is
//! handled, so the set stays as small as the operator made it. No metric is labelled by
//! dataset, version, path, job or event id: those are span fields.
//!
//! [`ALL`] lists every metric name; the shipped alert rules and dashboard
//! (`deploy/prometheus/`) are checked to name only these.

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
/// Name of the span a `stagehand` command runs in (exported as `stagehand <command>`).
pub const SPAN_COMMAND: &str = "command";

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

/// Outcome label values for [`MESSAGES_TOTAL`] and the metrics of the work.
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
    /// A stage request answered ready ([`super::STAGE_READY_SECONDS`]).
    pub const READY: &str = "ready";
    /// A stage request answered failed, or a drill that found a problem.
    pub const FAILED: &str = "failed";
    /// A drill that restored and verified every sampled byte ([`super::DRILLS_TOTAL`]).
    pub const VERIFIED: &str = "verified";
    /// An ingest verdict ([`super::INGEST_VERDICTS_TOTAL`]).
    pub const VALIDATED: &str = "validated";
    pub const REJECTED: &str = "rejected";
    /// A replica the scrub found damaged and repaired ([`super::SCRUB_REPLICAS_TOTAL`]).
    pub const REPAIRED: &str = "repaired";
    /// A replica the scrub found damaged with nothing to repair it from.
    pub const DAMAGED: &str = "damaged";
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

/// Counter: bytes moved and proven by the mover, labelled by `from_tier`, `to_tier` and
/// `class` (the priority class: checkpoint, stage, ingest, backup). Files skipped because a
/// verified copy was already there move no bytes and are not counted.
pub const BYTES_MOVED_TOTAL: &str = "stagehand_bytes_moved_total";
/// Counter: files moved and proven by the mover, labelled like [`BYTES_MOVED_TOTAL`].
pub const FILES_MOVED_TOTAL: &str = "stagehand_files_moved_total";
/// Histogram (bytes per second): the throughput of one copy (a file, or a batch of a set) of
/// at least [`crate::work::THROUGHPUT_MIN_BYTES`], labelled like [`BYTES_MOVED_TOTAL`];
/// smaller copies are counted in bytes and files but not here, their time being mostly
/// `fsync`.
pub const COPY_THROUGHPUT: &str = "stagehand_copy_throughput_bytes_per_second";
/// Histogram (seconds): from a stage request (its `occurred_at`) to its answer, labelled by
/// `tier` and `outcome` ([`outcome::READY`] or [`outcome::FAILED`]).
pub const STAGE_READY_SECONDS: &str = "stagehand_stage_ready_seconds";
/// Gauge: stage requests a promoter has not answered yet, by `tier`, `state` (`copying` while
/// waiting for a copy, else `pending`) and `waiting_for` (validation, preparation, copy; `other`
/// for a reason a newer promoter adds). Answered requests are counted in
/// [`STAGE_READY_SECONDS`].
pub const STAGES: &str = "stagehand_stages";
/// Gauge: the bytes Stagehand may place on a bounded tier (`tiers.toml`'s capacity), by `tier`.
pub const TIER_CAPACITY_BYTES: &str = "stagehand_tier_capacity_bytes";
/// Gauge: the bytes of Stagehand's replicas on a bounded tier, by `tier`.
pub const TIER_USED_BYTES: &str = "stagehand_tier_used_bytes";
/// Gauge: the usage the demoter compares with the watermarks (Stagehand's bytes plus the part
/// of its budget others' files made unusable), by `tier`.
pub const TIER_COUNTED_BYTES: &str = "stagehand_tier_counted_bytes";
/// Gauge: the bytes of replicas a live stage holds on a bounded tier, by `tier`.
pub const TIER_HELD_BYTES: &str = "stagehand_tier_held_bytes";
/// Gauge: the tier's high watermark as a fraction of its capacity, by `tier`.
pub const TIER_HIGH_WATERMARK_RATIO: &str = "stagehand_tier_high_watermark_ratio";
/// Gauge: the bytes of one project's replicas on a bounded tier, by `tier` and `project`
/// (projects are operator-declared: see the module docs).
pub const PROJECT_USED_BYTES: &str = "stagehand_project_used_bytes";
/// Gauge: a project's quota on a bounded tier, by `tier` and `project`; absent for a project
/// bounded only by the tier's capacity.
pub const PROJECT_QUOTA_BYTES: &str = "stagehand_project_quota_bytes";
/// Gauge: messages of a service's durable consumer not yet delivered, by `service` and
/// `consumer`.
pub const CONSUMER_PENDING_MESSAGES: &str = "stagehand_consumer_pending_messages";
/// Gauge: messages delivered to a consumer and not yet acked, by `service` and `consumer`.
pub const CONSUMER_ACK_PENDING_MESSAGES: &str = "stagehand_consumer_ack_pending_messages";
/// Gauge: messages of a consumer delivered more than once and not yet acked, by `service`
/// and `consumer`.
pub const CONSUMER_REDELIVERED_MESSAGES: &str = "stagehand_consumer_redelivered_messages";
/// Gauge: dead letters of a service that wait for a person: those in the dead-letter stream
/// less the replays recorded there, by `service`.
pub const DEAD_LETTERS_WAITING: &str = "stagehand_dead_letters_waiting";
/// Counter: restore drills' verdicts on a version, by backup `tier` and `outcome`
/// ([`outcome::VERIFIED`] or [`outcome::FAILED`]).
pub const DRILLS_TOTAL: &str = "stagehand_drills_total";
/// Gauge: versions with a present copy on a backup tier, by `tier`.
pub const BACKUP_PROTECTED_VERSIONS: &str = "stagehand_backup_protected_versions";
/// Gauge: protected versions never drilled, by backup `tier`.
pub const DRILL_NEVER_VERSIONS: &str = "stagehand_drill_never_versions";
/// Gauge: protected versions whose last drill failed, by backup `tier`.
pub const DRILL_FAILED_VERSIONS: &str = "stagehand_drill_failed_versions";
/// Gauge: when the newest drill on a backup tier ran (Unix seconds; 0 when none has), by
/// `tier`.
pub const DRILL_LAST_TIMESTAMP_SECONDS: &str = "stagehand_drill_last_timestamp_seconds";
/// Gauge: how often `backup.toml` asks for a drill (`drill_every`, seconds), by backup `tier`.
pub const DRILL_INTERVAL_SECONDS: &str = "stagehand_drill_interval_seconds";
/// Counter: replicas the scrub read back whole, by `tier` and `outcome`
/// ([`outcome::VERIFIED`], [`outcome::REPAIRED`], [`outcome::DAMAGED`]: found damaged and not
/// repaired, [`outcome::FAILED`]: could not be read, tried again at the next pass).
pub const SCRUB_REPLICAS_TOTAL: &str = "stagehand_scrub_replicas_total";
/// Counter: bytes the scrub read back and hashed, by `tier`.
pub const SCRUB_BYTES_TOTAL: &str = "stagehand_scrub_bytes_total";
/// Gauge: replicas on a tier not verified within its scrub period (`scrub.toml`), by `tier`:
/// set when a pass starts (what is due) and when it ends (what it left due). Never 0 for
/// hours means the scrub is behind its period.
pub const SCRUB_OVERDUE_REPLICAS: &str = "stagehand_scrub_overdue_replicas";
/// Counter: ingest requests the validator reached a verdict on, by `outcome`
/// ([`outcome::VALIDATED`] or [`outcome::REJECTED`]).
pub const INGEST_VERDICTS_TOTAL: &str = "stagehand_ingest_verdicts_total";
/// Counter: bytes a node agent fanning a version out to nodes read and verified, by `source`
/// ([`source::SHARED`]: from the shared tier; [`source::PEER`]: from another node's agent).
pub const FANOUT_BYTES_TOTAL: &str = "stagehand_fanout_bytes_total";
/// Counter: bytes a node agent served to its peers.
pub const FANOUT_SERVED_BYTES_TOTAL: &str = "stagehand_fanout_served_bytes_total";
/// Counter: peers a node agent dropped from a swarm for serving bytes that did not verify.
pub const FANOUT_PEERS_DROPPED_TOTAL: &str = "stagehand_fanout_peers_dropped_total";

/// Every metric a Stagehand service exports (the names above).
pub const ALL: &[&str] = &[
    MESSAGES_TOTAL,
    LEDGER_COMMITS_TOTAL,
    DEAD_LETTERS_TOTAL,
    PUBLISHES_SHADOWED_TOTAL,
    QUERIES_REFUSED_TOTAL,
    SERVICE_INFO,
    HANDLER_CALLS_TOTAL,
    HANDLER_SECONDS,
    TASK_FAILURES_TOTAL,
    BYTES_MOVED_TOTAL,
    FILES_MOVED_TOTAL,
    COPY_THROUGHPUT,
    STAGE_READY_SECONDS,
    STAGES,
    TIER_CAPACITY_BYTES,
    TIER_USED_BYTES,
    TIER_COUNTED_BYTES,
    TIER_HELD_BYTES,
    TIER_HIGH_WATERMARK_RATIO,
    PROJECT_USED_BYTES,
    PROJECT_QUOTA_BYTES,
    CONSUMER_PENDING_MESSAGES,
    CONSUMER_ACK_PENDING_MESSAGES,
    CONSUMER_REDELIVERED_MESSAGES,
    DEAD_LETTERS_WAITING,
    DRILLS_TOTAL,
    BACKUP_PROTECTED_VERSIONS,
    DRILL_NEVER_VERSIONS,
    DRILL_FAILED_VERSIONS,
    DRILL_LAST_TIMESTAMP_SECONDS,
    DRILL_INTERVAL_SECONDS,
    INGEST_VERDICTS_TOTAL,
    SCRUB_REPLICAS_TOTAL,
    SCRUB_BYTES_TOTAL,
    SCRUB_OVERDUE_REPLICAS,
    FANOUT_BYTES_TOTAL,
    FANOUT_SERVED_BYTES_TOTAL,
    FANOUT_PEERS_DROPPED_TOTAL,
];

/// Label keys of the metrics above.
pub mod label {
    pub const SERVICE: &str = "service";
    pub const VERSION: &str = "version";
    pub const RESULT: &str = "result";
    pub const TASK: &str = "task";
    pub const OUTCOME: &str = "outcome";
    pub const STREAM: &str = "stream";
    pub const FROM_TIER: &str = "from_tier";
    pub const TO_TIER: &str = "to_tier";
    pub const CLASS: &str = "class";
    pub const TIER: &str = "tier";
    pub const PROJECT: &str = "project";
    pub const STATE: &str = "state";
    pub const WAITING_FOR: &str = "waiting_for";
    pub const CONSUMER: &str = "consumer";
    pub const SOURCE: &str = "source";
}

/// Source label values for [`FANOUT_BYTES_TOTAL`].
pub mod source {
    /// The shared tier a version is fanned out from.
    pub const SHARED: &str = "shared";
    /// Another node's agent.
    pub const PEER: &str = "peer";
}

/// Result label values for [`HANDLER_CALLS_TOTAL`].
pub mod result {
    pub const OK: &str = "ok";
    pub const RETRYABLE: &str = "retryable";
    pub const PERMANENT: &str = "permanent";
}
