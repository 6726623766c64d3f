//! Heartbeats: every running service instance keeps one key in the KV bucket
//! `stagehand_heartbeats` ([`crate::HEARTBEATS`]), `<service>.<instance>`, rewritten every
//! [`EVERY`] by the service runner — one place, whatever the service — so that `stagehand
//! status` can tell a service that is alive from one that went silent, stopped, or keeps being
//! restarted.
//!
//! A [`Heartbeat`] carries the version, host, process id and start time of the instance, when
//! it last beat, when it last made progress (a message handled by one of its workers, or a pass
//! of a clock that calls [`Progress::note`]) and how many messages it handled. Restarts are
//! knowable because the key outlives the process: at start the runner reads the key it is
//! about to write, counts this start, keeps the times of the last [`RECENT_STARTS`] starts (a
//! crash loop is many starts in a few minutes), and counts a start whose predecessor never
//! wrote its stop (killed, or died without unwinding) as an unclean stop. A clean stop writes
//! `stopped_at`; a service that failed writes `failed_at` and its error.
//!
//! The instance is `[worker] instance_id` when set, else the one the service's settings name
//! (`ServiceSettings::instance`: a promoter node agent's is `node-<node>`), else the host
//! name: two instances of one service on one host must differ there, or they share a key (and
//! look like one instance restarting). Who may read: only Stagehand's own account (the operator, `stagehand
//! status`); each service's user may write and read its own keys only, and no tenant or
//! scheduler account imports the bucket (`deploy/nats/accounts.conf`). A heartbeat that cannot
//! be written is logged and the service carries on: liveness reporting must never stop work.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;
use tracing::instrument::WithSubscriber;

use async_nats::jetstream::kv;
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use tokio_util::sync::CancellationToken;

use crate::bus::{Bus, HEARTBEATS_BUCKET};

/// How often an instance rewrites its heartbeat.
pub const EVERY: Duration = Duration::from_secs(10);

/// How many start times a heartbeat keeps (newest last).
pub const RECENT_STARTS: usize = 8;

/// The longest error text a heartbeat carries.
const ERROR_BYTES: usize = 512;

/// How long the runner waits for the last heartbeat (the stop) to be written.
const LAST_WRITE: Duration = Duration::from_secs(3);

/// One service instance's heartbeat: the value of its key, JSON.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    pub service: String,
    pub instance: String,
    /// The service's version (its crate's).
    pub version: String,
    pub host: String,
    pub pid: u32,
    /// When this run of the instance started.
    #[serde(with = "time::serde::rfc3339")]
    pub started_at: OffsetDateTime,
    /// When the heartbeat was last written.
    #[serde(with = "time::serde::rfc3339")]
    pub beat_at: OffsetDateTime,
    /// Seconds between beats: an instance is silent once several have gone by unwritten.
    pub every_seconds: u64,
    /// When the instance last made progress: a message handled, a clock's pass.
    #[serde(default, with = "time::serde::rfc3339::option")]
    pub last_progress_at: Option<OffsetDateTime>,
    /// Messages handled in this run.
    #[serde(default)]
    pub handled: u64,
    /// Times this instance started, this run included (restarts: one less).
    #[serde(default)]
    pub starts: u64,
    /// The last [`RECENT_STARTS`] start times, newest last.
    #[serde(default, with = "rfc3339_list")]
    pub recent_starts: Vec<OffsetDateTime>,
    /// Starts that found the previous run had neither stopped nor failed: it was killed.
    #[serde(default)]
    pub unclean_stops: u64,
    /// Set when this run stopped cleanly.
    #[serde(default, with = "time::serde::rfc3339::option")]
    pub stopped_at: Option<OffsetDateTime>,
    /// Set when this run stopped with an error, with the error.
    #[serde(default, with = "time::serde::rfc3339::option")]
    pub failed_at: Option<OffsetDateTime>,
    #[serde(default)]
    pub error: Option<String>,
}

impl Heartbeat {
    /// Whether the run this heartbeat describes has ended (cleanly or not).
    pub fn ended(&self) -> bool {
        self.stopped_at.is_some() || self.failed_at.is_some()
    }

    /// Starts within `window` before `now`.
    pub fn starts_within(&self, window: Duration, now: OffsetDateTime) -> usize {
        let since = now - window;
        self.recent_starts.iter().filter(|t| **t >= since).count()
    }
}

/// The key of an instance's heartbeat: `<service>.<instance>`, the instance made one token.
pub fn heartbeat_key(service: &str, instance: &str) -> String {
    format!("{service}.{}", super::consumer_token(instance))
}

mod rfc3339_list {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use time::OffsetDateTime;
    use time::format_description::well_known::Rfc3339;

    pub fn serialize<S: Serializer>(list: &[OffsetDateTime], s: S) -> Result<S::Ok, S::Error> {
        let texts: Result<Vec<String>, _> = list.iter().map(|t| t.format(&Rfc3339)).collect();
        texts.map_err(serde::ser::Error::custom)?.serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<OffsetDateTime>, D::Error> {
        Vec::<String>::deserialize(d)?
            .iter()
            .map(|t| OffsetDateTime::parse(t, &Rfc3339).map_err(serde::de::Error::custom))
            .collect()
    }
}

/// What an instance has done since it started: messages handled and when it last made
/// progress. Shared by the runner's workers (every message handled counts) and whatever else
/// the service runs (a clock's pass calls [`Progress::note`]).
#[derive(Debug, Clone, Default)]
pub struct Progress {
    inner: Arc<ProgressInner>,
}

#[derive(Debug, Default)]
struct ProgressInner {
    handled: AtomicU64,
    /// Unix time in milliseconds; 0 before any progress.
    last_ms: AtomicI64,
}

impl Progress {
    /// A message was handled (whatever its outcome: the worker is not stuck).
    pub fn handled(&self) {
        self.inner.handled.fetch_add(1, Ordering::Relaxed);
        self.note();
    }

    /// The service made progress (a clock's pass, a survey).
    pub fn note(&self) {
        let ms = (OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000) as i64;
        self.inner.last_ms.store(ms, Ordering::Relaxed);
    }

    fn snapshot(&self) -> (u64, Option<OffsetDateTime>) {
        let ms = self.inner.last_ms.load(Ordering::Relaxed);
        let at = (ms > 0)
            .then(|| OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000).ok())
            .flatten();
        (self.inner.handled.load(Ordering::Relaxed), at)
    }
}

/// How a run ended, for its last heartbeat.
pub(crate) enum Ending {
    Stopped,
    Failed(String),
}

/// The heartbeat task of a running instance: [`Beating::finish`] writes its last beat.
pub(crate) struct Beating {
    stop: CancellationToken,
    ending: Arc<std::sync::Mutex<Option<Ending>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Beating {
    /// Writes the last heartbeat (stopped, or failed with its error) and ends the task.
    pub(crate) async fn finish(self, ending: Ending) {
        *self.ending.lock().unwrap_or_else(|p| p.into_inner()) = Some(ending);
        self.stop.cancel();
        if tokio::time::timeout(LAST_WRITE, self.task).await.is_err() {
            tracing::warn!("the last heartbeat was not written in time");
        }
    }
}

/// Starts beating for `service` as `instance`; `None` (after a warning) when the bucket
/// cannot be opened — the service runs on without a heartbeat.
pub(crate) async fn start(
    bus: &Bus,
    service: &'static str,
    instance: String,
    progress: Progress,
) -> Option<Beating> {
    let store = match bus.jetstream().get_key_value(HEARTBEATS_BUCKET).await {
        Ok(store) => store,
        Err(e) => {
            tracing::warn!(service, error = %e, "cannot open the heartbeat bucket {HEARTBEATS_BUCKET}; this instance will not show in `stagehand status` (run `stagehand provision`)");
            return None;
        }
    };
    let key = heartbeat_key(service, &instance);
    let previous = match store.get(&key).await {
        Ok(Some(bytes)) => serde_json::from_slice::<Heartbeat>(&bytes).ok(),
        Ok(None) => None,
        Err(e) => {
            tracing::warn!(service, key, error = %e, "cannot read the previous heartbeat; restarts are counted from this start");
            None
        }
    };
    let now = OffsetDateTime::now_utc();
    let beat = first_beat(service, instance, previous.as_ref(), now);
    put(&store, &key, &beat).await;
    let stop = CancellationToken::new();
    let ending: Arc<std::sync::Mutex<Option<Ending>>> = Arc::default();
    let task = tokio::spawn(
        beat_until(store, key, beat, progress, stop.clone(), ending.clone())
            .with_current_subscriber(),
    );
    Some(Beating { stop, ending, task })
}

/// The heartbeat of a run starting at `now`, after `previous` (the key's last value).
fn first_beat(
    service: &str,
    instance: String,
    previous: Option<&Heartbeat>,
    now: OffsetDateTime,
) -> Heartbeat {
    let mut recent_starts: Vec<OffsetDateTime> = previous
        .map(|p| p.recent_starts.clone())
        .unwrap_or_default();
    recent_starts.push(now);
    let excess = recent_starts.len().saturating_sub(RECENT_STARTS);
    recent_starts.drain(..excess);
    Heartbeat {
        service: service.to_owned(),
        instance,
        version: env!("CARGO_PKG_VERSION").to_owned(),
        host: crate::host_name(),
        pid: std::process::id(),
        started_at: now,
        beat_at: now,
        every_seconds: EVERY.as_secs(),
        last_progress_at: None,
        handled: 0,
        starts: previous.map_or(0, |p| p.starts) + 1,
        recent_starts,
        unclean_stops: previous.map_or(0, |p| p.unclean_stops + u64::from(!p.ended())),
        stopped_at: None,
        failed_at: None,
        error: None,
    }
}

async fn beat_until(
    store: kv::Store,
    key: String,
    mut beat: Heartbeat,
    progress: Progress,
    stop: CancellationToken,
    ending: Arc<std::sync::Mutex<Option<Ending>>>,
) {
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + EVERY, EVERY);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let last = tokio::select! {
            _ = stop.cancelled() => true,
            _ = ticks.tick() => false,
        };
        let (handled, at) = progress.snapshot();
        beat.handled = handled;
        beat.last_progress_at = at;
        beat.beat_at = OffsetDateTime::now_utc();
        if last {
            match ending.lock().unwrap_or_else(|p| p.into_inner()).take() {
                Some(Ending::Failed(error)) => {
                    beat.failed_at = Some(beat.beat_at);
                    beat.error = Some(cut(&error));
                }
                Some(Ending::Stopped) | None => beat.stopped_at = Some(beat.beat_at),
            }
        }
        put(&store, &key, &beat).await;
        if last {
            return;
        }
    }
}

fn cut(text: &str) -> String {
    if text.len() <= ERROR_BYTES {
        return text.to_owned();
    }
    let mut end = ERROR_BYTES;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

async fn put(store: &kv::Store, key: &str, beat: &Heartbeat) {
    let bytes = match serde_json::to_vec(beat) {
        Ok(bytes) => bytes,
        Err(e) => {
            tracing::warn!(key, error = %e, "cannot encode the heartbeat");
            return;
        }
    };
    if let Err(e) = store.put(key, bytes.into()).await {
        tracing::warn!(key, error = %e, "cannot write the heartbeat");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_start_counts_restarts_recent_starts_and_unclean_stops() {
        let t0 = time::macros::datetime!(2026-12-01 06:00:00 UTC);
        let first = first_beat("promoter", "h1".into(), None, t0);
        assert_eq!((first.starts, first.unclean_stops), (1, 0));
        assert_eq!(first.recent_starts, vec![t0]);
        // Killed: the next start finds neither a stop nor a failure.
        let second = first_beat(
            "promoter",
            "h1".into(),
            Some(&first),
            t0 + Duration::from_secs(5),
        );
        assert_eq!((second.starts, second.unclean_stops), (2, 1));
        let mut stopped = second.clone();
        stopped.stopped_at = Some(t0 + Duration::from_secs(6));
        let mut latest = first_beat(
            "promoter",
            "h1".into(),
            Some(&stopped),
            t0 + Duration::from_secs(9),
        );
        assert_eq!((latest.starts, latest.unclean_stops), (3, 1));
        for n in 0..20 {
            latest = first_beat(
                "promoter",
                "h1".into(),
                Some(&latest),
                t0 + Duration::from_secs(60 + n),
            );
        }
        assert_eq!(latest.recent_starts.len(), RECENT_STARTS);
        assert_eq!(
            latest.recent_starts.last(),
            Some(&(t0 + Duration::from_secs(79)))
        );
        assert_eq!(
            latest.starts_within(Duration::from_secs(5), t0 + Duration::from_secs(80)),
            5
        );
    }

    #[test]
    fn a_heartbeat_reads_back_as_written() {
        let mut beat = first_beat("demoter", "node-1".into(), None, OffsetDateTime::UNIX_EPOCH);
        beat.error = Some(cut(&"é".repeat(600)));
        let json = serde_json::to_vec(&beat).unwrap();
        assert_eq!(serde_json::from_slice::<Heartbeat>(&json).unwrap(), beat);
        assert!(beat.error.unwrap().len() <= ERROR_BYTES + '…'.len_utf8());
        assert_eq!(
            heartbeat_key("demoter", "gpu01.cluster"),
            "demoter.gpu01-cluster"
        );
    }
}
