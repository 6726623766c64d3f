//! Subjects and streams: where each event is published and kept.
//!
//! Subjects are `stagehand.<class>.<kind>.<project>` where `class` is `req` for requests,
//! `fact` for facts and `dlq` for dead letters, e.g. `stagehand.req.ingest.requested.lab-a` and
//! `stagehand.fact.dataset.validated.lab-a`. The project is the last token so that NATS
//! permissions can confine an uploader to `stagehand.req.ingest.requested.<its project>`.
//! Dead letters are the exception: `stagehand.dlq.dead.letter.<service>`.
//!
//! An event about a node's local tier names that node in its subject, before the project:
//! `stagehand.fact.checkpoint.part.committed.<node>.<project>`. A checkpoint part's facts and a
//! node marked unreachable always name one ([`NODE_ROUTED`]); a stage request, answer or
//! release and a replica fact name one when the event does (a job's `local` tier,
//! [`NODE_ADDRESSED`]), and keep `<kind>.<project>` otherwise. So each node's agent subscribes
//! to its own node's events alone ([`node_kind_filter`]) beside the shared ones: a wave of N
//! nodes' requests, answers and copies is N deliveries, not N² (every agent handed every
//! node's events, to ack them unread); the shared services read both shapes ([`kind_filter`]).
//! And a node's credentials can be confined to its own node's subjects.

use std::time::Duration;

use crate::event::Body;

/// Prefix of every Stagehand subject.
pub const ROOT: &str = "stagehand";

/// The class token of request subjects: `stagehand.req.<kind>.<project>`.
pub const REQ: &str = "req";
/// The class token of fact subjects: `stagehand.fact.<kind>.<project>`.
pub const FACT: &str = "fact";
/// The class token of dead-letter subjects: `stagehand.dlq.dead.letter.<service>`.
pub const DLQ: &str = "dlq";

/// Whether `s` can be a single subject token naming a project or service: 1–64 of `[a-z0-9_-]`.
pub fn is_subject_token(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'_' | b'-'))
}

/// The kinds whose subjects name a node before the project (see the module documentation).
pub const NODE_ROUTED: &[&str] = &[
    "checkpoint.part.committed",
    "checkpoint.part.offloaded",
    "checkpoint.part.removed",
    "replica.unreachable",
];

/// Whether events of `kind` are published on subjects that name a node ([`NODE_ROUTED`]).
pub fn routed_by_node(kind: &str) -> bool {
    NODE_ROUTED.contains(&kind)
}

/// The kinds whose subjects name a node before the project when the event names one (a stage
/// request, answer or release, or a replica, on a node's `local` tier), and only then.
pub const NODE_ADDRESSED: &[&str] = &[
    "stage.requested",
    "stage.released",
    "stage.pending",
    "stage.ready",
    "stage.failed",
    "replica.created",
    "replica.removed",
    "replica.damaged",
    "replica.verified",
    "replica.repaired",
];

/// Whether events of `kind` may be published on subjects that name a node: always
/// ([`NODE_ROUTED`]) or when they name one ([`NODE_ADDRESSED`]).
pub fn may_name_node(kind: &str) -> bool {
    routed_by_node(kind) || NODE_ADDRESSED.contains(&kind)
}

/// The subject token naming `node`: the name itself when it is one ([`is_subject_token`]: a
/// Slurm node name such as `gpu-07`); otherwise (a Kubernetes node's DNS name holds dots) its
/// characters outside a token's made `-`, lowercased and shortened, then `-` and 16 hex of the
/// name's SHA-256 — so that two names never share a token by the rewriting alone.
pub fn node_token(node: &str) -> String {
    if is_subject_token(node) {
        return node.to_owned();
    }
    use sha2::{Digest, Sha256};
    let readable: String = node
        .chars()
        .map(|c| c.to_ascii_lowercase())
        .map(|c| {
            if c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-' {
                c
            } else {
                '-'
            }
        })
        .take(47)
        .collect();
    let digest = hex::encode(Sha256::digest(node.as_bytes()));
    format!("{readable}-{}", &digest[..16])
}

/// The subject an event of this body and project is published on.
///
/// A dead letter is the one exception: its last token is the service that gave up
/// ([`dead_letter_subject`]), since the message it carries may not have decoded far enough to
/// name a project, and on-call replays dead letters service by service.
pub fn subject_for(body: &Body, project: &str) -> String {
    let class = match body {
        Body::DeadLetter(dead) => return dead_letter_subject(&dead.service),
        Body::DeadLetterReplayed(replay) => return replayed_subject(&replay.service),
        b if b.is_request() => REQ,
        _ => FACT,
    };
    let node = body.node().filter(|_| may_name_node(body.kind()));
    event_subject(class, body.kind(), node, project)
}

/// The subject of one kind about `node`'s local tier ([`node_kind_subject`]), or about none
/// ([`kind_subject`]): where an event of that kind, node and project travels, e.g. what a wait
/// for a stage's answer subscribes to.
pub fn event_subject(class: &str, kind: &str, node: Option<&str>, project: &str) -> String {
    match node {
        Some(node) => node_kind_subject(class, kind, node, project),
        None => kind_subject(class, kind, project),
    }
}

/// The subject of one kind naming a node ([`may_name_node`]), one node and one project, e.g.
/// `stagehand.fact.checkpoint.part.committed.gpu-07.lab-a`.
pub fn node_kind_subject(class: &str, kind: &str, node: &str, project: &str) -> String {
    format!("{ROOT}.{class}.{kind}.{}.{project}", node_token(node))
}

/// The subject filter for one kind naming a node, of one node, across all projects: what that
/// node's agent subscribes to, e.g. `stagehand.fact.checkpoint.part.committed.gpu-07.*`.
pub fn node_kind_filter(class: &str, kind: &str, node: &str) -> String {
    format!("{ROOT}.{class}.{kind}.{}.*", node_token(node))
}

/// The subject filters for one kind that one node's services take (its agent, its demoter):
/// the events of that kind about `node`'s local tier, and those naming no node (about a shared
/// tier: the copy a local stage waits for is made on the hot tier), never another node's. A
/// kind that never names a node gives [`kind_filter`] alone. The filters never overlap, as a
/// consumer's several filters must not.
pub fn node_filters(class: &str, kind: &str, node: &str) -> Vec<String> {
    if routed_by_node(kind) {
        return vec![node_kind_filter(class, kind, node)];
    }
    if NODE_ADDRESSED.contains(&kind) {
        return vec![
            format!("{ROOT}.{class}.{kind}.*"),
            node_kind_filter(class, kind, node),
        ];
    }
    vec![kind_filter(class, kind)]
}

/// The subject of one kind in one project, e.g. `stagehand.fact.dataset.validated.lab-a`
/// (`class` is [`REQ`] or [`FACT`]): what a producer of that kind publishes on and a reader of
/// one project's answers subscribes to.
pub fn kind_subject(class: &str, kind: &str, project: &str) -> String {
    format!("{ROOT}.{class}.{kind}.{project}")
}

/// The subject filter for one kind across all projects, e.g. `stagehand.req.ingest.requested.*`
/// (and every node, for a kind [`routed_by_node`]: `….checkpoint.part.committed.*.*`; with a
/// node or without, for a kind [`NODE_ADDRESSED`]: `stagehand.req.stage.requested.>`).
pub fn kind_filter(class: &str, kind: &str) -> String {
    if routed_by_node(kind) {
        return format!("{ROOT}.{class}.{kind}.*.*");
    }
    if NODE_ADDRESSED.contains(&kind) {
        return format!("{ROOT}.{class}.{kind}.>");
    }
    format!("{ROOT}.{class}.{kind}.*")
}

/// The subject filter for every subject of one class, e.g. `stagehand.fact.>`: what a stream
/// holds and a replay of all facts or dead letters reads.
pub fn class_filter(class: &str) -> String {
    format!("{ROOT}.{class}.>")
}

/// Whether `subject` (or a subject prefix) lies beneath [`ROOT`]: `stagehand.…`.
pub fn is_under_root(subject: &str) -> bool {
    subject
        .strip_prefix(ROOT)
        .is_some_and(|rest| rest.starts_with('.'))
}

/// The class token of a Stagehand subject (`req`, `fact`, `dlq`, `progress`, …); `None` for a
/// subject outside [`ROOT`] or with nothing after its class.
pub fn class_of_subject(subject: &str) -> Option<&str> {
    let rest = subject.strip_prefix(ROOT)?.strip_prefix('.')?;
    let (class, _) = rest.split_once('.')?;
    Some(class)
}

/// Whether `subject` is a request or fact subject (`stagehand.req.…`, `stagehand.fact.…`): the
/// subjects that name a project and carry work or facts, as opposed to dead letters.
pub fn is_event_subject(subject: &str) -> bool {
    matches!(class_of_subject(subject), Some(REQ | FACT))
}

/// How long a stream keeps messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retention {
    /// Keep by limits (age, bytes): a replayable log.
    Limits,
    /// Remove each message once acked by its one consumer.
    WorkQueue,
}

/// A stream Stagehand declares. The bus turns these into JetStream configurations and applies
/// changes to existing streams.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamSpec {
    pub name: &'static str,
    pub subjects: &'static [&'static str],
    pub retention: Retention,
    /// Zero means unlimited.
    pub max_age: Duration,
    /// Zero means unlimited.
    pub max_bytes: u64,
    /// Most messages kept per subject, zero for unlimited. When set, a publish past it is
    /// refused (JetStream's `discard: new` with `discard_new_per_subject`, nats-server ≥ 2.9.2):
    /// a flood on one subject is turned away rather than old, unconsumed messages dropped.
    pub max_msgs_per_subject: i64,
    pub max_msg_size: u32,
    /// Window in which a repeated `Nats-Msg-Id` is dropped. Longer than any publisher's retry.
    pub duplicate_window: Duration,
}

const HOUR: Duration = Duration::from_secs(3600);
const DAY: Duration = Duration::from_secs(24 * 3600);

/// Most requests of one kind one project may have in [`REQUESTS`] at once (the stream keeps
/// them 30 days): each request subject `stagehand.req.<kind>.<project>` holds at most this
/// many, and a publish past it is refused — one tenant's flood can neither fill the server's
/// storage (it bounds a project's requests to this many of at most 512 KiB per kind) nor push
/// out other requests. About 8,000 a day for 30 days; the runtime benchmark publishes 100,000
/// on one subject.
pub const REQUEST_MAX_MSGS_PER_SUBJECT: i64 = 250_000;

/// Requests: ingest, stage, release. A replayable log (limits), consumed by durable consumers
/// with subject filters, kept 30 days so on-call can replay.
pub const REQUESTS: StreamSpec = StreamSpec {
    name: "STAGEHAND_REQUESTS",
    subjects: &["stagehand.req.>"],
    retention: Retention::Limits,
    max_age: Duration::from_secs(30 * 24 * 3600),
    max_bytes: 0,
    max_msgs_per_subject: REQUEST_MAX_MSGS_PER_SUBJECT,
    max_msg_size: crate::wire::MAX_EVENT_BYTES as u32,
    duplicate_window: HOUR,
};

/// Facts: the event log the catalogue is folded from. Never aged out: it is the source of truth
/// from which every catalogue is rebuilt.
pub const FACTS: StreamSpec = StreamSpec {
    name: "STAGEHAND_FACTS",
    subjects: &["stagehand.fact.>"],
    retention: Retention::Limits,
    max_age: Duration::ZERO,
    max_bytes: 0,
    max_msgs_per_subject: 0,
    max_msg_size: crate::wire::MAX_EVENT_BYTES as u32,
    duplicate_window: HOUR,
};

/// Dead letters, one subject per service: `stagehand.dlq.dead.letter.<service>`. Kept 90 days.
pub const DEAD_LETTERS: StreamSpec = StreamSpec {
    name: "STAGEHAND_DEAD_LETTERS",
    subjects: &["stagehand.dlq.>"],
    retention: Retention::Limits,
    max_age: Duration::from_secs(90 * 24 * 3600),
    max_bytes: 0,
    max_msgs_per_subject: 0,
    // A dead letter carries the original message plus its error history.
    max_msg_size: crate::wire::MAX_DEAD_LETTER_BYTES as u32,
    duplicate_window: DAY,
};

/// Every stream Stagehand declares.
pub const STREAMS: &[StreamSpec] = &[REQUESTS, FACTS, DEAD_LETTERS];

/// Whether `subject` matches the NATS subject filter `filter`: `*` matches one token, a
/// trailing `>` one or more.
pub fn subject_matches(filter: &str, subject: &str) -> bool {
    let mut subject_tokens = subject.split('.');
    for token in filter.split('.') {
        match (token, subject_tokens.next()) {
            (">", Some(_)) => return true,
            ("*", Some(_)) => {}
            (t, Some(s)) if t == s => {}
            _ => return false,
        }
    }
    subject_tokens.next().is_none()
}

/// The dead-letter subject of a service.
pub fn dead_letter_subject(service: &str) -> String {
    format!("{ROOT}.{DLQ}.dead.letter.{service}")
}

/// The subject on which replays of a service's dead letters are recorded.
pub fn replayed_subject(service: &str) -> String {
    format!("{ROOT}.{DLQ}.replayed.{service}")
}

/// The project token of a request or fact subject (`stagehand.req.<kind>.<project>`,
/// `stagehand.fact.<kind>.<project>`); `None` for other subjects. An event whose envelope
/// `project` differs from it was published on another project's subject.
pub fn project_of_subject(subject: &str) -> Option<&str> {
    if !is_event_subject(subject) {
        return None;
    }
    // Past `stagehand.<class>.`: `<kind>.<project>`, the kind itself holding dots.
    let kind_and_project = subject.splitn(3, '.').nth(2)?;
    let (_, project) = kind_and_project.rsplit_once('.')?;
    is_subject_token(project).then_some(project)
}

/// The JetStream Object Store bucket that holds the manifests of validated and prepared
/// versions, written only by Stagehand's services (after verifying them), read by every
/// service and the catalogue. Object name: the version digest.
pub const MANIFEST_BUCKET: &str = "stagehand_manifests";

/// The Object Store bucket in which a project's uploaders put the manifests their requests
/// reference (`stagehand_uploads_<project>`). One bucket per project, so that NATS
/// permissions confine an uploader to its own project's manifests. Object name: the declared
/// digest.
pub fn upload_manifest_bucket(project: &str) -> String {
    format!("stagehand_uploads_{project}")
}

/// How long a project's upload bucket keeps a manifest: as long as the requests stream keeps
/// the request that references it, so a replayed request still finds it.
pub const UPLOAD_MAX_AGE: Duration = REQUESTS.max_age;

/// A JetStream Object Store bucket Stagehand declares (its stream is `OBJ_<bucket>`): created,
/// and its drift corrected, by the bus like a stream (`stagehand provision`), or by the first
/// writer where its NATS user may create streams.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectBucketSpec {
    /// The bucket name.
    pub bucket: std::borrow::Cow<'static, str>,
    /// What the bucket holds, shown in `nats object ls`.
    pub description: &'static str,
    /// How long an object is kept (zero: for ever).
    pub max_age: Duration,
    /// Most bytes the bucket holds, zero for unlimited; a put past it is refused (Object Store
    /// buckets discard new).
    pub max_bytes: u64,
}

impl ObjectBucketSpec {
    /// The name of the bucket's stream.
    pub fn stream_name(&self) -> String {
        format!("OBJ_{}", self.bucket)
    }

    /// [`ObjectBucketSpec::max_bytes`] as a JetStream stream configuration takes it (-1 for
    /// unlimited).
    pub fn stream_max_bytes(&self) -> i64 {
        if self.max_bytes == 0 {
            -1
        } else {
            i64::try_from(self.max_bytes).unwrap_or(i64::MAX)
        }
    }
}

/// The services' manifest bucket [`MANIFEST_BUCKET`]: kept for ever, since the catalogue is
/// rebuilt from the facts log and the manifests it references.
pub const MANIFESTS: ObjectBucketSpec = ObjectBucketSpec {
    bucket: std::borrow::Cow::Borrowed(MANIFEST_BUCKET),
    description: "Stagehand: manifests of validated and prepared dataset versions, by digest",
    max_age: Duration::ZERO,
    max_bytes: 0,
};

/// Most bytes of manifests one project's upload bucket holds (for [`UPLOAD_MAX_AGE`]), so that
/// one uploader cannot fill the account's storage: 4 GiB, about 40 uploads of a million files
/// (a manifest is about 100 bytes a file) or one of 40 million.
pub const UPLOAD_BUCKET_MAX_BYTES: u64 = 4 << 30;

/// A project's upload bucket ([`upload_manifest_bucket`]), kept [`UPLOAD_MAX_AGE`], holding at
/// most [`UPLOAD_BUCKET_MAX_BYTES`].
pub fn upload_bucket_spec(project: &str) -> ObjectBucketSpec {
    ObjectBucketSpec {
        bucket: std::borrow::Cow::Owned(upload_manifest_bucket(project)),
        description: "Stagehand: manifests uploaders put for their ingest requests, by declared digest",
        max_age: UPLOAD_MAX_AGE,
        max_bytes: UPLOAD_BUCKET_MAX_BYTES,
    }
}

/// The bucket a manifest reference in `body` (an event of `project`) points into: the
/// project's upload bucket for what uploaders and training jobs publish (`ingest.requested`,
/// `checkpoint.committed`), the services' manifest bucket for every other fact.
pub fn manifest_bucket_for(body: &Body, project: &str) -> String {
    match body {
        Body::IngestRequested(_) | Body::CheckpointCommitted(_) => upload_manifest_bucket(project),
        _ => MANIFEST_BUCKET.to_owned(),
    }
}

/// Request/reply subject on which the catalogue recorder answers queries.
pub const CATALOGUE_QUERY: &str = "stagehand.catalogue.query";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_are_built_and_read_by_class() {
        assert_eq!(
            kind_subject(FACT, "dataset.validated", "lab-a"),
            "stagehand.fact.dataset.validated.lab-a"
        );
        assert_eq!(class_filter(FACT), FACTS.subjects[0]);
        assert_eq!(class_filter(REQ), REQUESTS.subjects[0]);
        assert_eq!(class_filter(DLQ), DEAD_LETTERS.subjects[0]);
        assert_eq!(
            kind_filter(REQ, "ingest.requested"),
            "stagehand.req.ingest.requested.*"
        );
        assert_eq!(
            kind_filter(REQ, "stage.requested"),
            "stagehand.req.stage.requested.>"
        );
        assert_eq!(
            class_of_subject("stagehand.dlq.dead.letter.promoter"),
            Some(DLQ)
        );
        assert_eq!(class_of_subject("stagehand"), None);
        assert_eq!(class_of_subject("stagehand.req"), None);
        assert!(is_under_root("stagehand.x") && !is_under_root("stagehandx.y"));
        assert_eq!(class_of_subject("stagehandx.req.a.b"), None);
        assert_eq!(class_of_subject("other.req.a.b"), None);
        assert!(is_event_subject("stagehand.req.stage.requested.lab-a"));
        assert!(is_event_subject("stagehand.fact.stage.ready.lab-a"));
        assert!(!is_event_subject(&dead_letter_subject("promoter")));
        assert!(!is_event_subject(
            "stagehand.progress.stage.requested.lab-a.00"
        ));
        assert_eq!(
            project_of_subject("stagehand.req.stage.requested.lab-a"),
            Some("lab-a")
        );
        assert_eq!(project_of_subject("stagehand.req.lab-a"), None);
        assert_eq!(project_of_subject("stagehand.fact.x.Lab"), None);
        assert_eq!(project_of_subject(&dead_letter_subject("promoter")), None);
    }

    #[test]
    fn a_checkpoint_parts_subject_names_its_node_before_its_project() {
        let subject = node_kind_subject(FACT, "checkpoint.part.committed", "gpu-07", "lab-a");
        assert_eq!(
            subject,
            "stagehand.fact.checkpoint.part.committed.gpu-07.lab-a"
        );
        assert_eq!(project_of_subject(&subject), Some("lab-a"));
        let mine = node_kind_filter(FACT, "checkpoint.part.committed", "gpu-07");
        assert!(subject_matches(&mine, &subject));
        let theirs = node_kind_filter(FACT, "checkpoint.part.committed", "gpu-08");
        assert!(!subject_matches(&theirs, &subject));
        assert!(subject_matches(
            &kind_filter(FACT, "checkpoint.part.committed"),
            &subject
        ));
        assert!(!subject_matches(
            &kind_filter(FACT, "checkpoint.committed"),
            &subject
        ));
        for kind in NODE_ROUTED {
            assert!(crate::event::ALL_KINDS.contains(kind), "{kind}");
        }
    }

    #[test]
    fn a_stage_request_names_its_node_only_when_it_has_one() {
        let filter = kind_filter(REQ, "stage.requested");
        for node in [Some("gpu-07"), None] {
            let subject = match node {
                Some(n) => node_kind_subject(REQ, "stage.requested", n, "lab-a"),
                None => kind_subject(REQ, "stage.requested", "lab-a"),
            };
            assert!(subject_matches(&filter, &subject), "{subject}");
            assert_eq!(project_of_subject(&subject), Some("lab-a"));
        }
        assert!(may_name_node("stage.released") && !routed_by_node("stage.released"));
        assert!(!subject_matches(
            &node_kind_filter(REQ, "stage.requested", "gpu-07"),
            &kind_subject(REQ, "stage.requested", "lab-a")
        ));
    }

    #[test]
    fn a_nodes_services_take_their_own_nodes_events_and_the_shared_ones_only() {
        use crate::event::ALL_KINDS;
        let mine = |kind: &str, subject: &str| {
            node_filters(FACT, kind, "gpu-07")
                .iter()
                .filter(|f| subject_matches(f, subject))
                .count()
        };
        for kind in ALL_KINDS.iter().filter(|k| may_name_node(k)) {
            let own = node_kind_subject(FACT, kind, "gpu-07", "lab-a");
            let other = node_kind_subject(FACT, kind, "gpu-08", "lab-a");
            let shared = kind_subject(FACT, kind, "lab-a");
            assert_eq!(mine(kind, &own), 1, "{kind}: its own node's, by one filter");
            assert_eq!(mine(kind, &other), 0, "{kind}: never another node's");
            let expected = usize::from(!routed_by_node(kind));
            assert_eq!(mine(kind, &shared), expected, "{kind}: the shared ones");
            assert!(subject_matches(&kind_filter(FACT, kind), &own), "{kind}");
        }
        assert_eq!(
            node_filters(FACT, "dataset.validated", "gpu-07"),
            vec![kind_filter(FACT, "dataset.validated")]
        );
    }

    #[test]
    fn a_node_name_that_is_no_token_gets_one_of_its_own() {
        assert_eq!(node_token("gpu-07"), "gpu-07");
        let dns = node_token("ip-10-0-0-1.ec2.internal");
        assert!(is_subject_token(&dns), "{dns}");
        assert!(dns.starts_with("ip-10-0-0-1-ec2-internal-"), "{dns}");
        // Names that the rewriting alone would merge stay apart.
        assert_ne!(node_token("a.b"), node_token("a-b"));
        assert_ne!(node_token("a.b"), node_token("a_b"));
        assert_ne!(node_token("A"), node_token("a"));
        let long = "n".repeat(200);
        assert!(is_subject_token(&node_token(&long)));
        assert_ne!(node_token(&long), node_token(&"n".repeat(201)));
    }
}
