//! The metrics of the work itself: one small function per thing that happened (bytes moved,
//! a stage answered, a tier surveyed, a drill's verdict, an ingest verdict, a consumer's
//! backlog), called by the service at the point where it happened. The names and label keys
//! live in [`crate::names`]; this module is where values are turned into bounded labels, so a
//! service's instrumentation is one call and no service spells a metric name itself.
//!
//! Gauges of a set that can shrink (stages by state, projects on a tier) are set to 0 for the
//! label sets a newer report no longer has, rather than left at their last value.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use crate::names::{self, label, outcome};

/// Copies smaller than this are not observed in [`names::COPY_THROUGHPUT`]: their time is
/// mostly the `fsync` that makes them durable, not the transfer.
pub const THROUGHPUT_MIN_BYTES: u64 = 1 << 20;

/// Bucket bounds (bytes per second) of [`names::COPY_THROUGHPUT`]: 1 MiB/s to 16 GiB/s.
pub const THROUGHPUT_BUCKETS: &[f64] = &[
    1_048_576.0,
    4_194_304.0,
    16_777_216.0,
    67_108_864.0,
    134_217_728.0,
    268_435_456.0,
    536_870_912.0,
    1_073_741_824.0,
    2_147_483_648.0,
    4_294_967_296.0,
    8_589_934_592.0,
    17_179_869_184.0,
];

/// Bucket bounds (seconds) of [`names::STAGE_READY_SECONDS`]: an already-staged version is
/// answered in milliseconds, a large copy or a wait for validation takes hours.
pub const STAGE_BUCKETS: &[f64] = &[
    0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 7200.0, 21600.0,
];

/// Records one finished copy: `files` files and `bytes` bytes moved and proven from tier
/// `from_tier` to `to_tier` in priority class `class`, taking `elapsed`.
pub fn moved(
    from_tier: &str,
    to_tier: &str,
    class: &'static str,
    files: u64,
    bytes: u64,
    elapsed: Duration,
) {
    if files == 0 && bytes == 0 {
        return;
    }
    let labels = [
        (label::FROM_TIER, from_tier.to_owned()),
        (label::TO_TIER, to_tier.to_owned()),
        (label::CLASS, class.to_owned()),
    ];
    metrics::counter!(names::BYTES_MOVED_TOTAL, &labels).increment(bytes);
    metrics::counter!(names::FILES_MOVED_TOTAL, &labels).increment(files);
    let secs = elapsed.as_secs_f64();
    if bytes >= THROUGHPUT_MIN_BYTES && secs > 0.0 {
        metrics::histogram!(names::COPY_THROUGHPUT, &labels).record(bytes as f64 / secs);
    }
}

/// Records a stage request's answer on `tier`: ready or failed, `waited` after the request.
pub fn stage_answered(tier: &str, ready: bool, waited: Duration) {
    let outcome = if ready {
        outcome::READY
    } else {
        outcome::FAILED
    };
    metrics::histogram!(
        names::STAGE_READY_SECONDS,
        label::TIER => tier.to_owned(),
        label::OUTCOME => outcome
    )
    .record(waited.as_secs_f64());
}

/// The bounded `waiting_for` label of a stage: the promoter's stable words, `other` for any
/// word it does not know (a fact from a newer promoter), `none` when it waits for nothing.
pub fn waiting_label(waiting_for: Option<&str>) -> &'static str {
    match waiting_for {
        None | Some("") => "none",
        Some("validation") => "validation",
        Some("preparation") => "preparation",
        Some("quota") => "quota",
        Some("copy") => "copy",
        Some(_) => "other",
    }
}

/// The bounded `state` label of a stage.
pub fn stage_state_label(state: &str) -> &'static str {
    match state {
        "pending" => "pending",
        "copying" => "copying",
        "ready" => "ready",
        "failed" => "failed",
        "released" => "released",
        _ => "other",
    }
}

/// The labels of one [`names::STAGES`] series: tier, state and what the stages wait for.
pub type StageKey = (String, &'static str, &'static str);

/// Stages by (tier, state, waiting_for): what [`stages`] takes.
pub type StageCounts = BTreeMap<StageKey, u64>;

/// Sets [`names::STAGES`] to `counts`; label sets counted before and absent now go to 0.
pub fn stages(counts: &StageCounts) {
    static SEEN: OnceLock<Mutex<BTreeSet<StageKey>>> = OnceLock::new();
    let mut seen = SEEN
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    for key in seen.iter() {
        if !counts.contains_key(key) {
            stage_gauge(key).set(0.0);
        }
    }
    for (key, n) in counts {
        stage_gauge(key).set(*n as f64);
        seen.insert(key.clone());
    }
}

fn stage_gauge((tier, state, waiting): &StageKey) -> metrics::Gauge {
    metrics::gauge!(
        names::STAGES,
        label::TIER => tier.clone(),
        label::STATE => *state,
        label::WAITING_FOR => *waiting
    )
}

/// What a survey of one bounded tier found: [`tier_fill`] takes it.
#[derive(Debug, Clone, PartialEq)]
pub struct TierFill {
    pub tier: String,
    pub capacity: u64,
    /// Bytes of Stagehand's replicas.
    pub used: u64,
    /// What the watermarks are compared with.
    pub counted: u64,
    /// Bytes live stages hold.
    pub held: u64,
    /// The high watermark, a fraction of `capacity`.
    pub high_watermark: f64,
    /// Per project: bytes used and its quota (none: bounded by capacity only).
    pub projects: Vec<(String, u64, Option<u64>)>,
}

/// Sets the tier's gauges and its projects'; a project no longer on the tier goes to 0.
pub fn tier_fill(fill: &TierFill) {
    let tier = || (label::TIER, fill.tier.clone());
    metrics::gauge!(names::TIER_CAPACITY_BYTES, &[tier()]).set(fill.capacity as f64);
    metrics::gauge!(names::TIER_USED_BYTES, &[tier()]).set(fill.used as f64);
    metrics::gauge!(names::TIER_COUNTED_BYTES, &[tier()]).set(fill.counted as f64);
    metrics::gauge!(names::TIER_HELD_BYTES, &[tier()]).set(fill.held as f64);
    metrics::gauge!(names::TIER_HIGH_WATERMARK_RATIO, &[tier()]).set(fill.high_watermark);
    static SEEN: OnceLock<Mutex<BTreeSet<(String, String)>>> = OnceLock::new();
    let mut seen = SEEN
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let now: BTreeSet<(String, String)> = fill
        .projects
        .iter()
        .map(|(p, _, _)| (fill.tier.clone(), p.clone()))
        .collect();
    for (t, p) in seen.iter().filter(|(t, _)| *t == fill.tier) {
        if !now.contains(&(t.clone(), p.clone())) {
            project_gauge(names::PROJECT_USED_BYTES, t, p).set(0.0);
        }
    }
    for (project, used, quota) in &fill.projects {
        project_gauge(names::PROJECT_USED_BYTES, &fill.tier, project).set(*used as f64);
        if let Some(q) = quota {
            project_gauge(names::PROJECT_QUOTA_BYTES, &fill.tier, project).set(*q as f64);
        }
    }
    seen.extend(now);
}

fn project_gauge(name: &'static str, tier: &str, project: &str) -> metrics::Gauge {
    metrics::gauge!(
        name,
        label::TIER => tier.to_owned(),
        label::PROJECT => project.to_owned()
    )
}

/// Sets the backlog gauges of `consumer` (of `service`): messages not yet delivered, delivered
/// and not acked, and redelivered and not acked.
pub fn consumer_backlog(
    service: &str,
    consumer: &str,
    pending: u64,
    ack_pending: u64,
    redelivered: u64,
) {
    let labels = [
        (label::SERVICE, service.to_owned()),
        (label::CONSUMER, consumer.to_owned()),
    ];
    metrics::gauge!(names::CONSUMER_PENDING_MESSAGES, &labels).set(pending as f64);
    metrics::gauge!(names::CONSUMER_ACK_PENDING_MESSAGES, &labels).set(ack_pending as f64);
    metrics::gauge!(names::CONSUMER_REDELIVERED_MESSAGES, &labels).set(redelivered as f64);
}

/// Sets the dead letters of `service` that wait for a person.
pub fn dead_letters_waiting(service: &str, waiting: u64) {
    metrics::gauge!(names::DEAD_LETTERS_WAITING, label::SERVICE => service.to_owned())
        .set(waiting as f64);
}

/// Records a drill's verdict on one version held on backup tier `tier`.
pub fn drill_verdict(tier: &str, verified: bool) {
    let outcome = if verified {
        outcome::VERIFIED
    } else {
        outcome::FAILED
    };
    metrics::counter!(
        names::DRILLS_TOTAL,
        label::TIER => tier.to_owned(),
        label::OUTCOME => outcome
    )
    .increment(1);
}

/// What the versions protected on one backup tier look like to the drill clock.
#[derive(Debug, Clone, PartialEq)]
pub struct DrillSurvey {
    pub tier: String,
    /// Versions with a present copy on the tier.
    pub protected: u64,
    /// Of those, never drilled.
    pub never: u64,
    /// Of those, whose last drill failed.
    pub failed: u64,
    /// When the newest drill ran (Unix seconds), if any has.
    pub last_drill_unix: Option<f64>,
    /// `backup.toml`'s `drill_every`.
    pub interval: Duration,
}

/// Sets the drill gauges of a backup tier.
pub fn drill_survey(s: &DrillSurvey) {
    let tier = || (label::TIER, s.tier.clone());
    metrics::gauge!(names::BACKUP_PROTECTED_VERSIONS, &[tier()]).set(s.protected as f64);
    metrics::gauge!(names::DRILL_NEVER_VERSIONS, &[tier()]).set(s.never as f64);
    metrics::gauge!(names::DRILL_FAILED_VERSIONS, &[tier()]).set(s.failed as f64);
    metrics::gauge!(names::DRILL_LAST_TIMESTAMP_SECONDS, &[tier()])
        .set(s.last_drill_unix.unwrap_or(0.0));
    metrics::gauge!(names::DRILL_INTERVAL_SECONDS, &[tier()]).set(s.interval.as_secs_f64());
}

/// What the scrub found reading one replica back whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScrubOutcome {
    Verified,
    Repaired,
    /// Damaged, with nothing to repair it from.
    Damaged,
    /// Not read to the end (an unreachable tier, a read error): read again at the next pass.
    Failed,
}

/// Records one replica the scrub read on `tier`: what it found and the bytes it hashed.
pub fn scrubbed(tier: &str, found: ScrubOutcome, bytes: u64) {
    let outcome = match found {
        ScrubOutcome::Verified => outcome::VERIFIED,
        ScrubOutcome::Repaired => outcome::REPAIRED,
        ScrubOutcome::Damaged => outcome::DAMAGED,
        ScrubOutcome::Failed => outcome::FAILED,
    };
    metrics::counter!(
        names::SCRUB_REPLICAS_TOTAL,
        label::TIER => tier.to_owned(),
        label::OUTCOME => outcome
    )
    .increment(1);
    if bytes > 0 {
        metrics::counter!(names::SCRUB_BYTES_TOTAL, label::TIER => tier.to_owned())
            .increment(bytes);
    }
}

/// Sets how many replicas on `tier` are not verified within its scrub period.
pub fn scrub_overdue(tier: &str, replicas: u64) {
    metrics::gauge!(names::SCRUB_OVERDUE_REPLICAS, label::TIER => tier.to_owned())
        .set(replicas as f64);
}

/// Records the validator's verdict on one ingest request.
pub fn ingest_verdict(validated: bool) {
    let outcome = if validated {
        outcome::VALIDATED
    } else {
        outcome::REJECTED
    };
    metrics::counter!(names::INGEST_VERDICTS_TOTAL, label::OUTCOME => outcome).increment(1);
}

/// Describes every metric of this module to the recorder (help text and unit).
pub(crate) fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(
        names::BYTES_MOVED_TOTAL,
        Unit::Bytes,
        "Bytes moved and proven, by from_tier, to_tier and priority class"
    );
    describe_counter!(
        names::FILES_MOVED_TOTAL,
        "Files moved and proven, by from_tier, to_tier and priority class"
    );
    describe_histogram!(
        names::COPY_THROUGHPUT,
        "Throughput of one copy of at least 1 MiB (bytes per second), by from_tier, to_tier and class"
    );
    describe_histogram!(
        names::STAGE_READY_SECONDS,
        Unit::Seconds,
        "Time from a stage request to its answer, by tier and outcome (ready, failed)"
    );
    describe_gauge!(
        names::STAGES,
        "Stage requests by tier, state and what they wait for (released ones not counted)"
    );
    describe_gauge!(
        names::TIER_CAPACITY_BYTES,
        Unit::Bytes,
        "Bytes Stagehand may place on a bounded tier"
    );
    describe_gauge!(
        names::TIER_USED_BYTES,
        Unit::Bytes,
        "Bytes of Stagehand's replicas on a bounded tier"
    );
    describe_gauge!(
        names::TIER_COUNTED_BYTES,
        Unit::Bytes,
        "Usage the demoter compares with the watermarks"
    );
    describe_gauge!(
        names::TIER_HELD_BYTES,
        Unit::Bytes,
        "Bytes of replicas live stages hold on a bounded tier"
    );
    describe_gauge!(
        names::TIER_HIGH_WATERMARK_RATIO,
        "The tier's high watermark, a fraction of its capacity"
    );
    describe_gauge!(
        names::PROJECT_USED_BYTES,
        Unit::Bytes,
        "Bytes of one project's replicas on a bounded tier"
    );
    describe_gauge!(
        names::PROJECT_QUOTA_BYTES,
        Unit::Bytes,
        "A project's quota on a bounded tier"
    );
    describe_gauge!(
        names::CONSUMER_PENDING_MESSAGES,
        "Messages of a durable consumer not yet delivered"
    );
    describe_gauge!(
        names::CONSUMER_ACK_PENDING_MESSAGES,
        "Messages delivered to a consumer and not yet acked"
    );
    describe_gauge!(
        names::CONSUMER_REDELIVERED_MESSAGES,
        "Messages delivered more than once and not yet acked"
    );
    describe_gauge!(
        names::DEAD_LETTERS_WAITING,
        "Dead letters of a service not replayed"
    );
    describe_counter!(
        names::DRILLS_TOTAL,
        "Restore drill verdicts on a version, by backup tier and outcome (verified, failed)"
    );
    describe_gauge!(
        names::BACKUP_PROTECTED_VERSIONS,
        "Versions with a present copy on a backup tier"
    );
    describe_gauge!(
        names::DRILL_NEVER_VERSIONS,
        "Protected versions never drilled"
    );
    describe_gauge!(
        names::DRILL_FAILED_VERSIONS,
        "Protected versions whose last drill failed"
    );
    describe_gauge!(
        names::DRILL_LAST_TIMESTAMP_SECONDS,
        Unit::Seconds,
        "When the newest drill on a backup tier ran (Unix time; 0: never)"
    );
    describe_gauge!(
        names::DRILL_INTERVAL_SECONDS,
        Unit::Seconds,
        "How often backup.toml asks for a drill"
    );
    describe_counter!(
        names::INGEST_VERDICTS_TOTAL,
        "Ingest requests the validator reached a verdict on, by outcome (validated, rejected)"
    );
}

/// Where a fanned-out piece came from (the label of [`names::FANOUT_BYTES_TOTAL`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FanoutSource {
    /// The shared tier.
    Shared,
    /// Another node's agent.
    Peer,
}

/// Records `bytes` of a fanned-out version read and verified from `from`.
pub fn fanout_read(from: FanoutSource, bytes: u64) {
    let source = match from {
        FanoutSource::Shared => names::source::SHARED,
        FanoutSource::Peer => names::source::PEER,
    };
    metrics::counter!(names::FANOUT_BYTES_TOTAL, label::SOURCE => source).increment(bytes);
}

/// Records `bytes` served to a peer.
pub fn fanout_served(bytes: u64) {
    metrics::counter!(names::FANOUT_SERVED_BYTES_TOTAL).increment(bytes);
}

/// Records a peer dropped from a swarm for serving bytes that did not verify.
pub fn fanout_peer_dropped() {
    metrics::counter!(names::FANOUT_PEERS_DROPPED_TOTAL).increment(1);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(scrape: &str, head: &str) -> Option<f64> {
        scrape
            .lines()
            .find_map(|l| l.strip_prefix(head)?.strip_prefix(' '))
            .map(|v| v.parse().unwrap())
    }

    #[test]
    fn every_metric_name_is_distinct_and_stagehands() {
        let set: BTreeSet<&str> = names::ALL.iter().copied().collect();
        assert_eq!(set.len(), names::ALL.len(), "a name is listed twice");
        assert!(names::ALL.iter().all(|n| n.starts_with("stagehand_")));
    }

    #[test]
    fn stages_no_longer_reported_go_to_zero() {
        let handle = crate::metrics::install();
        let key = |state| {
            (
                "unit-stages".to_owned(),
                state,
                waiting_label(Some("quota")),
            )
        };
        stages(&StageCounts::from([
            (key("pending"), 2),
            (key("copying"), 1),
        ]));
        stages(&StageCounts::from([(key("copying"), 3)]));
        let scrape = handle.render();
        let head = |state: &str| {
            format!(r#"stagehand_stages{{tier="unit-stages",state="{state}",waiting_for="quota"}}"#)
        };
        assert_eq!(sample(&scrape, &head("pending")), Some(0.0), "{scrape}");
        assert_eq!(sample(&scrape, &head("copying")), Some(3.0), "{scrape}");
    }

    #[test]
    fn a_project_gone_from_a_tier_goes_to_zero_and_other_tiers_keep_theirs() {
        let handle = crate::metrics::install();
        let fill = |tier: &str, projects: Vec<(String, u64, Option<u64>)>| TierFill {
            tier: tier.into(),
            capacity: 1000,
            used: 600,
            counted: 700,
            held: 100,
            high_watermark: 0.9,
            projects,
        };
        tier_fill(&fill("unit-a", vec![("p1".into(), 400, Some(500))]));
        tier_fill(&fill("unit-b", vec![("p1".into(), 50, None)]));
        tier_fill(&fill("unit-a", vec![("p2".into(), 600, None)]));
        let scrape = handle.render();
        let used = |tier: &str, p: &str| {
            format!(r#"stagehand_project_used_bytes{{tier="{tier}",project="{p}"}}"#)
        };
        assert_eq!(
            sample(&scrape, &used("unit-a", "p1")),
            Some(0.0),
            "{scrape}"
        );
        assert_eq!(
            sample(&scrape, &used("unit-a", "p2")),
            Some(600.0),
            "{scrape}"
        );
        assert_eq!(
            sample(&scrape, &used("unit-b", "p1")),
            Some(50.0),
            "{scrape}"
        );
        assert_eq!(
            sample(&scrape, r#"stagehand_tier_counted_bytes{tier="unit-a"}"#),
            Some(700.0),
            "{scrape}"
        );
    }

    #[test]
    fn unknown_words_map_to_bounded_labels() {
        assert_eq!(waiting_label(None), "none");
        assert_eq!(waiting_label(Some("a new reason")), "other");
        assert_eq!(stage_state_label("weird"), "other");
    }
}
