//! Configuration of the connection and of a worker, with defaults and validation.

use std::path::PathBuf;
use std::time::Duration;

use rand::Rng;
use serde::{Deserialize, Serialize};

use crate::error::BusError;

/// How to reach NATS.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BusConfig {
    /// Server URL(s), comma separated, e.g. `nats://127.0.0.1:4222`.
    pub url: String,
    /// A `.creds` file (user JWT and NKey seed) for this service's NATS user.
    pub creds_file: Option<PathBuf>,
    /// A PEM file of CA certificates to trust for the server's TLS certificate.
    pub tls_ca: Option<PathBuf>,
    /// Refuse to talk to a server without TLS.
    pub tls_required: bool,
    /// The connection name servers show in monitoring (`connz`).
    pub client_name: String,
    /// Replicas of each stream Stagehand declares: 1 on one machine, 3 on a three-node cluster.
    pub replicas: usize,
    /// How long to keep trying the first connection before giving up.
    #[serde(with = "duration_str")]
    pub connect_timeout: Duration,
}

impl Default for BusConfig {
    fn default() -> Self {
        Self {
            url: "nats://127.0.0.1:4222".into(),
            creds_file: None,
            tls_ca: None,
            tls_required: false,
            client_name: "stagehand".into(),
            replicas: 1,
            connect_timeout: Duration::from_secs(30),
        }
    }
}

impl BusConfig {
    /// A default configuration for `url`.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            ..Self::default()
        }
    }
}

/// Negative-ack delays: exponential from `initial`, times `factor` per delivery, capped at
/// `max`, with up to `jitter` of each delay taken off at random so that many messages failing
/// together do not all come back at once.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetrySchedule {
    /// Delay after the first failed delivery.
    #[serde(with = "duration_str")]
    pub initial: Duration,
    /// Longest delay.
    #[serde(with = "duration_str")]
    pub max: Duration,
    /// Growth per delivery (≥ 1).
    pub factor: f64,
    /// Fraction (0–1) of each delay that may be removed at random.
    pub jitter: f64,
}

impl Default for RetrySchedule {
    fn default() -> Self {
        Self {
            initial: Duration::from_secs(1),
            max: Duration::from_secs(300),
            factor: 2.0,
            jitter: 0.2,
        }
    }
}

impl RetrySchedule {
    /// The delay before redelivering a message whose delivery number `delivery` (1-based)
    /// failed.
    pub fn delay(&self, delivery: u64) -> Duration {
        let base = self.base_delay(delivery);
        if self.jitter <= 0.0 {
            return base;
        }
        let cut = rand::rng().random_range(0.0..=self.jitter.min(1.0));
        base.mul_f64(1.0 - cut)
    }

    /// The delay without jitter.
    pub fn base_delay(&self, delivery: u64) -> Duration {
        let exp = delivery.saturating_sub(1).min(64) as i32;
        let secs = self.initial.as_secs_f64() * self.factor.max(1.0).powi(exp);
        if !secs.is_finite() || secs >= self.max.as_secs_f64() {
            self.max
        } else {
            Duration::from_secs_f64(secs)
        }
    }
}

/// One worker: which consumer it is, where its ledger lives, and how it paces work.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfig {
    /// The service name: the durable consumer's name and the dead-letter subject's last token.
    pub service: String,
    /// The stream consumed, e.g. `STAGEHAND_REQUESTS`.
    pub stream: String,
    /// Subjects of that stream this service consumes, e.g. `stagehand.req.ingest.requested.*`.
    pub filter_subjects: Vec<String>,
    /// The service's redb file (ledger).
    pub ledger_path: PathBuf,
    /// This instance's stable identity: an instance restarting under the same id takes over
    /// its own claims at once instead of waiting for them to expire. Default: host name,
    /// service and a digest of `ledger_path` (see `default_instance_id`). Two processes must
    /// never share one; a worker that finds its id registered by another process stops.
    #[serde(default)]
    pub instance_id: Option<String>,
    /// Most messages handled at once; the worker pulls only as many as it has free slots.
    #[serde(default = "defaults::concurrency")]
    pub concurrency: usize,
    /// Failed attempts (handler errors, and ledger, claim or publish failures) before an
    /// event is dead-lettered. Waiting for another instance's claim does not count.
    #[serde(default = "defaults::max_attempts")]
    pub max_attempts: u32,
    /// The consumer's `max_deliver`: a high safety ceiling on deliveries of any kind. At this
    /// delivery the runtime dead-letters without running the handler. Must exceed
    /// `max_attempts`.
    #[serde(default = "defaults::max_deliver")]
    pub max_deliver: i64,
    /// How long the server waits for an ack before redelivering; progress acks restart it.
    #[serde(default = "defaults::ack_wait", with = "duration_str")]
    pub ack_wait: Duration,
    /// How long a claim not renewed stays valid before another instance may take it over
    /// (judged by the server's clock). Default: 2 × `ack_wait`.
    #[serde(default, with = "duration_str::option")]
    pub claim_lifetime: Option<Duration>,
    /// Delays of negative acks after retryable failures.
    #[serde(default)]
    pub retry: RetrySchedule,
    /// After shutdown is asked for, how long in-flight work may take to finish and be recorded.
    #[serde(default = "defaults::shutdown_deadline", with = "duration_str")]
    pub shutdown_deadline: Duration,
    /// Claim each event in the `stagehand_claims` KV bucket before working on it, so that two
    /// instances never do the same work (needed when several instances share a consumer).
    #[serde(default = "defaults::claims")]
    pub claims: bool,
    /// How long a pull request waits on the server for messages before it is renewed.
    #[serde(default = "defaults::pull_expires", with = "duration_str")]
    pub pull_expires: Duration,
    /// How long the ledger keeps an outcome: past the requests stream's retention plus its
    /// duplicate window, no copy of the event can still arrive within either.
    #[serde(default = "defaults::ledger_retention", with = "duration_str")]
    pub ledger_retention: Duration,
    /// How often the ledger is pruned of outcomes older than `ledger_retention`.
    #[serde(default = "defaults::prune_interval", with = "duration_str")]
    pub prune_interval: Duration,
}

mod defaults {
    use std::time::Duration;
    pub fn concurrency() -> usize {
        32
    }
    pub fn max_attempts() -> u32 {
        8
    }
    pub fn max_deliver() -> i64 {
        1000
    }
    pub fn ack_wait() -> Duration {
        Duration::from_secs(30)
    }
    pub fn shutdown_deadline() -> Duration {
        Duration::from_secs(20)
    }
    pub fn claims() -> bool {
        true
    }
    pub fn pull_expires() -> Duration {
        Duration::from_secs(5)
    }
    pub fn ledger_retention() -> Duration {
        let requests = stagehand_schemas::subject::REQUESTS;
        requests.max_age + requests.duplicate_window
    }
    pub fn prune_interval() -> Duration {
        Duration::from_secs(3600)
    }
}

impl WorkerConfig {
    /// A configuration with every tunable at its default.
    pub fn new(
        service: impl Into<String>,
        stream: impl Into<String>,
        filter_subjects: Vec<String>,
        ledger_path: impl Into<PathBuf>,
    ) -> Self {
        Self {
            service: service.into(),
            stream: stream.into(),
            filter_subjects,
            ledger_path: ledger_path.into(),
            instance_id: None,
            concurrency: defaults::concurrency(),
            max_attempts: defaults::max_attempts(),
            max_deliver: defaults::max_deliver(),
            ack_wait: defaults::ack_wait(),
            claim_lifetime: None,
            retry: RetrySchedule::default(),
            shutdown_deadline: defaults::shutdown_deadline(),
            claims: defaults::claims(),
            pull_expires: defaults::pull_expires(),
            ledger_retention: defaults::ledger_retention(),
            prune_interval: defaults::prune_interval(),
        }
    }

    /// How long a claim not renewed stays valid: `claim_lifetime`, or 2 × `ack_wait`.
    pub fn claim_lifetime(&self) -> Duration {
        self.claim_lifetime.unwrap_or(self.ack_wait * 2)
    }

    /// Checks the values against what the runtime and the server accept.
    pub fn validate(&self) -> Result<(), BusError> {
        let bad = |key, reason: String| Err(BusError::config(key, reason));
        if !stagehand_schemas::subject::is_subject_token(&self.service) {
            return bad(
                "service",
                format!("{:?} must be 1-64 characters of [a-z0-9_-]", self.service),
            );
        }
        if self.stream.is_empty() {
            return bad("stream", "must name a stream".into());
        }
        if self.filter_subjects.is_empty() {
            return bad("filter_subjects", "must list at least one subject".into());
        }
        if self
            .instance_id
            .as_ref()
            .is_some_and(|id| id.is_empty() || id.len() > 256)
        {
            return bad("instance_id", "must be 1-256 characters".into());
        }
        if self.concurrency == 0 || self.concurrency > 10_000 {
            return bad(
                "concurrency",
                format!("{} is not in 1..=10000", self.concurrency),
            );
        }
        let kept = crate::ledger::MAX_ATTEMPTS_KEPT;
        if self.max_attempts < 1 || self.max_attempts as usize > kept {
            return bad(
                "max_attempts",
                format!("{} is not in 1..={kept}", self.max_attempts),
            );
        }
        if self.max_deliver <= i64::from(self.max_attempts) {
            return bad(
                "max_deliver",
                format!(
                    "{} must exceed max_attempts ({}): it is the ceiling on deliveries that did not count as attempts",
                    self.max_deliver, self.max_attempts
                ),
            );
        }
        if self.ack_wait < Duration::from_secs(1) {
            return bad(
                "ack_wait",
                format!("{:?} is under one second", self.ack_wait),
            );
        }
        if self.claim_lifetime() < self.ack_wait {
            return bad(
                "claim_lifetime",
                format!(
                    "{:?} is under ack_wait ({:?}): a claim must outlive the redelivery of its message",
                    self.claim_lifetime(),
                    self.ack_wait
                ),
            );
        }
        if self.pull_expires < Duration::from_millis(100) {
            return bad(
                "pull_expires",
                format!("{:?} is under 100ms", self.pull_expires),
            );
        }
        if self.prune_interval < Duration::from_millis(100) {
            return bad(
                "prune_interval",
                format!("{:?} is under 100ms", self.prune_interval),
            );
        }
        let factor_ok = self.retry.factor.is_finite() && self.retry.factor >= 1.0;
        if !factor_ok || !(0.0..=1.0).contains(&self.retry.jitter) {
            return bad(
                "retry",
                "factor must be >= 1 and jitter within 0..=1".into(),
            );
        }
        Ok(())
    }
}

/// Durations in configuration files as `"250ms"`, `"30s"`, `"5m"` or `"1h"`.
pub mod duration_str {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        if d.subsec_millis() != 0 || d.as_secs() == 0 {
            s.serialize_str(&format!("{}ms", d.as_millis()))
        } else {
            s.serialize_str(&format!("{}s", d.as_secs()))
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let text = String::deserialize(d)?;
        parse(&text).map_err(serde::de::Error::custom)
    }

    /// Parses `"250ms"`, `"30s"`, `"5m"`, `"1h"`.
    pub fn parse(text: &str) -> Result<Duration, String> {
        let t = text.trim();
        let split = t
            .find(|c: char| !c.is_ascii_digit())
            .ok_or_else(|| format!("duration {text:?} needs a unit (ms, s, m, h)"))?;
        let (num, unit) = t.split_at(split);
        let n: u64 = num
            .parse()
            .map_err(|_| format!("duration {text:?} must start with a whole number"))?;
        let ms = match unit {
            "ms" => Some(n),
            "s" => n.checked_mul(1000),
            "m" => n.checked_mul(60_000),
            "h" => n.checked_mul(3_600_000),
            _ => {
                return Err(format!(
                    "duration {text:?} has unknown unit {unit:?} (ms, s, m, h)"
                ));
            }
        };
        ms.map(Duration::from_millis)
            .ok_or_else(|| format!("duration {text:?} is too long"))
    }

    /// `Option<Duration>` in the same notation; absent means `None`.
    pub mod option {
        use std::time::Duration;

        use serde::{Deserialize, Deserializer, Serializer};

        pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
            match d {
                Some(d) => super::serialize(d, s),
                None => s.serialize_none(),
            }
        }

        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
            match Option::<String>::deserialize(d)? {
                Some(text) => super::parse(&text)
                    .map(Some)
                    .map_err(serde::de::Error::custom),
                None => Ok(None),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_grows_caps_and_jitters_down() {
        let s = RetrySchedule {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(1),
            factor: 2.0,
            jitter: 0.5,
        };
        assert_eq!(s.base_delay(1), Duration::from_millis(100));
        assert_eq!(s.base_delay(3), Duration::from_millis(400));
        assert_eq!(s.base_delay(10), Duration::from_secs(1));
        assert_eq!(s.base_delay(u64::MAX), Duration::from_secs(1));
        for d in 1..10 {
            let j = s.delay(d);
            assert!(j <= s.base_delay(d) && j >= s.base_delay(d) / 2, "{j:?}");
        }
    }

    #[test]
    fn durations_parse_with_units_and_reject_garbage() {
        assert_eq!(
            duration_str::parse("250ms").unwrap(),
            Duration::from_millis(250)
        );
        assert_eq!(duration_str::parse("5m").unwrap(), Duration::from_secs(300));
        assert!(duration_str::parse("5").unwrap_err().contains("unit"));
        assert!(
            duration_str::parse("5d")
                .unwrap_err()
                .contains("unknown unit")
        );
    }

    #[test]
    fn worker_config_rejects_bad_values_by_key() {
        let mut c = WorkerConfig::new("ingest-validator", "S", vec!["a.*".into()], "/tmp/x.redb");
        c.validate().unwrap();
        c.concurrency = 0;
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("concurrency")
        );
        c.concurrency = 4;
        c.service = "Bad Name".into();
        assert!(c.validate().unwrap_err().to_string().contains("service"));
    }

    #[test]
    fn unknown_config_keys_are_refused() {
        let err = toml_like_json(r#"{"url":"nats://x:4222","colour":"red"}"#);
        assert!(err.contains("colour"), "{err}");
    }

    fn toml_like_json(text: &str) -> String {
        serde_json::from_str::<BusConfig>(text)
            .unwrap_err()
            .to_string()
    }
}
