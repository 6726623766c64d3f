//! What every command checks before it connects, how it connects, and how its errors become
//! exit codes and one line on stderr.
//!
//! Scheduler hooks call the CLI with deadlines, so a bad argument must fail at once with one
//! line naming it ([`UsageError`], exit [`EX_USAGE`]), and an unreachable NATS must fail after a
//! bounded wait, also with one line ([`Unreachable`], exit [`EX_UNAVAILABLE`]): never a retry
//! loop that prints a warning per attempt. Retries are logged at debug level; logs are coloured
//! only when stderr is a terminal ([`init_logs`]).

use std::io::IsTerminal;
use std::path::Path;
use std::time::{Duration, Instant};

use stagehand_bus::{Bus, BusConfig};
use stagehand_schemas::layout;
use stagehand_schemas::subject::is_subject_token;
use time::OffsetDateTime;

/// Exit code of a bad argument (sysexits' `EX_USAGE`).
pub const EX_USAGE: i32 = 64;
/// Exit code when NATS (or a bucket the command reads) cannot be reached (`EX_UNAVAILABLE`).
pub const EX_UNAVAILABLE: i32 = 69;
/// Exit code of any other error (`EX_SOFTWARE`): distinct from the answers a command gives
/// with 0, 1, 2 and 3 (`stage wait`: ready, failed, timed out; `stage where`: 3, no node holds
/// a usable copy).
pub const EX_SOFTWARE: i32 = 70;

/// A command-line argument is wrong; the message names it and says what is expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// The server (or something on it the command needs) could not be reached in time.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Unreachable(pub String);

fn usage(msg: String) -> UsageError {
    UsageError(msg)
}

/// The exit code for an error a command returned.
pub fn exit_code(err: &anyhow::Error) -> i32 {
    if err.downcast_ref::<UsageError>().is_some() {
        EX_USAGE
    } else if err.downcast_ref::<Unreachable>().is_some()
        || err
            .downcast_ref::<stagehand_bus::BusError>()
            .is_some_and(|e| e.kind() == stagehand_bus::BusErrorKind::Unavailable)
    {
        // A stream that did not answer within the command's time is NATS out of reach too.
        EX_UNAVAILABLE
    } else {
        EX_SOFTWARE
    }
}

/// The one line a failed command prints on stderr: the error and its causes, joined.
pub fn error_line(err: &anyhow::Error) -> String {
    let text = match bound_reached(err) {
        Some(why) => format!("stagehand: {err}: {why}"),
        None => format!("stagehand: {err:#}"),
    };
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// When the server refused a publish or an upload because a per-project bound that
/// `stagehand provision` sets is reached (schemas/README.md, *Subjects and streams*): what was
/// refused and which bound, in place of the server's and the client's layers of wording.
fn bound_reached(err: &anyhow::Error) -> Option<String> {
    // The server's description of its refusal (JetStream error code 10077), which the Object
    // Store client passes on as text only.
    let refusal = err.chain().map(ToString::to_string).find(|text| {
        text.contains("maximum messages per subject exceeded")
            || text.contains("maximum bytes exceeded")
    })?;
    if refusal.contains("maximum messages per subject exceeded") {
        let subject = err
            .chain()
            .find_map(|c| c.downcast_ref::<stagehand_bus::BusError>())
            .and_then(|b| b.what().strip_prefix("could not publish to "))
            .unwrap_or("its request subject");
        return Some(format!(
            "refused: {subject} holds as many requests as a project may keep of one kind              (max_msgs_per_subject of {}, set by `stagehand provision`; requests leave it after              30 days)",
            stagehand_schemas::subject::REQUESTS.name
        ));
    }
    if refusal.contains("maximum bytes exceeded") {
        let bucket = err
            .chain()
            .find_map(|c| c.downcast_ref::<stagehand_manifest::ManifestError>())
            .and_then(|m| m.what.strip_prefix("manifest "))
            .and_then(|what| what.split('/').next())
            .unwrap_or("the project's upload bucket");
        return Some(format!(
            "refused: {bucket} is full (the max_bytes `stagehand provision` sets on a project's              upload bucket: {} bytes unless changed; manifests leave it after 30 days)",
            stagehand_schemas::subject::UPLOAD_BUCKET_MAX_BYTES
        ));
    }
    None
}

/// Logging for a command whose stdout is its answer: warnings and errors on stderr
/// (`RUST_LOG` overrides), with colour only when stderr is a terminal and `NO_COLOR` is unset.
/// Its spans are exported over OTLP under `service.name` `stagehand` when
/// `OTEL_EXPORTER_OTLP_ENDPOINT` is set; the guard returned flushes them when dropped.
///
/// The bus logs each failed connection attempt as a warning, which is right for a service
/// starting up but noise for a hook with a deadline: here those lines count as debug level,
/// shown only when `RUST_LOG` asks for debug.
pub fn init_logs() -> Option<stagehand_telemetry::TelemetryGuard> {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::{EnvFilter, Layer, filter};

    let env_filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    let debug_wanted = env_filter
        .max_level_hint()
        .is_some_and(|max| max >= tracing::level_filters::LevelFilter::DEBUG);
    let retries = filter::filter_fn(move |meta| debug_wanted || !is_connect_retry(meta));
    let logs = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(colour_on_stderr())
        .with_filter(env_filter)
        .with_filter(retries);
    let subscriber = tracing_subscriber::registry().with(logs);
    // Telemetry must not fail the command it observes: an exporter that cannot be built is
    // a warning, and the command runs without it.
    let (export, failed) = match stagehand_telemetry::export_layer(COMMAND_SERVICE) {
        Ok(export) => (export, None),
        Err(e) => (None, Some(e)),
    };
    let (export, guard) = export.unzip();
    let _ = subscriber.with(export).try_init();
    if let Some(e) = failed {
        tracing::warn!(error = %e, "spans of this command are not exported");
    }
    guard
}

/// The `service.name` of the spans a command exports.
pub const COMMAND_SERVICE: &str = "stagehand";

/// The bus's "connecting to NATS failed; retrying" event (a warning with a `delay`), and what
/// the NATS client's connector says about a failed attempt (an error when something that is
/// not a client port answers, such as a cluster's route port): the command's one line says
/// why it gave up.
fn is_connect_retry(meta: &tracing::Metadata<'_>) -> bool {
    (meta.target().starts_with("stagehand_bus")
        && *meta.level() == tracing::Level::WARN
        && meta.fields().field("delay").is_some())
        || meta.target().starts_with("async_nats::connector")
}

/// Whether stderr takes ANSI colour codes.
pub fn colour_on_stderr() -> bool {
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// Runs `step` again while its error `passes` — a stream without a leader while a cluster
/// elects one — with backoff, for at most `budget` in all: how a command rides out an election
/// on a write that is not a plain publish (a manifest put into an upload bucket, which is
/// content-addressed, so a second put is harmless). Plain publishes ride it out in the bus.
pub async fn through_election<T, E, F, Fut>(
    budget: Duration,
    passes: impl Fn(&E) -> bool,
    step: F,
) -> Result<T, E>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    use backon::Retryable;
    let deadline = tokio::time::Instant::now() + budget;
    step.retry(
        stagehand_bus::RetrySchedule::exponential(
            Duration::from_millis(100),
            Duration::from_secs(2),
        )
        .with_jitter(0.5)
        .delays(),
    )
    .when(|e| passes(e) && tokio::time::Instant::now() < deadline)
    // No pause runs past the budget.
    .adjust(|_, pause| {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        pause.map(|p| p.min(left)).filter(|p| !p.is_zero())
    })
    .await
}

/// Connects within `timeout` in all (the bus retries until then); after that, one
/// [`Unreachable`] error naming the server and the last failure. Refused credentials fail at
/// once, as [`Unreachable`] too (nothing here can mend them).
pub async fn connect(cfg: &BusConfig, timeout: Duration) -> anyhow::Result<Bus> {
    let started = Instant::now();
    let bounded = BusConfig {
        connect_timeout: timeout,
        ..cfg.clone()
    };
    match Bus::connect(&bounded).await {
        // The CLI acts as a tenant (an uploader, a scheduler, a training job): it may read only
        // its own subjects, so a duplicate ack is proven by those alone.
        Ok(bus) => Ok(bus.reading_own_subjects_only()),
        Err(e) => match e.kind() {
            stagehand_bus::BusErrorKind::Unauthorized => Err(Unreachable(e.to_string()).into()),
            stagehand_bus::BusErrorKind::Connect => Err(Unreachable(format!(
                "cannot reach NATS at {} within {:.1} s (is `stagehand up` running?): {e}",
                cfg.servers_display(),
                started.elapsed().as_secs_f64()
            ))
            .into()),
            _ => Err(e.into()),
        },
    }
}

/// A project (tenant) name (`stagehand_schemas::layout::check_project`).
pub fn project(arg: &str, name: &str) -> Result<(), UsageError> {
    layout::check_project(name).map_err(|e| usage(format!("{arg} {name:?}: {e}")))
}

/// A dataset name (`stagehand_schemas::layout::check_dataset_name`).
pub fn dataset(arg: &str, name: &str) -> Result<(), UsageError> {
    layout::check_dataset_name(name).map_err(|e| usage(format!("{arg} {name:?}: {e}")))
}

/// A version in an event: a digest or a unique prefix of at least
/// [`layout::MIN_VERSION_PREFIX`] (`stagehand_schemas::layout::check_version_prefix`).
pub fn version(arg: &str, v: &str) -> Result<(), UsageError> {
    layout::check_version_prefix(v, layout::MIN_VERSION_PREFIX)
        .map_err(|e| usage(format!("{arg} {v:?}: {e}")))
}

/// A version in a catalogue query: a digest or a prefix of at least
/// [`layout::MIN_QUERY_VERSION_PREFIX`].
pub fn query_version(v: &str) -> Result<(), layout::NameError> {
    layout::check_version_prefix(v, layout::MIN_QUERY_VERSION_PREFIX)
}

/// A tier name as the policies declare it.
pub fn tier(arg: &str, name: &str) -> Result<(), UsageError> {
    if is_subject_token(name) {
        Ok(())
    } else {
        Err(usage(format!(
            "{arg} {name:?}: a tier name is 1-64 characters of [a-z0-9_-]"
        )))
    }
}

/// A node name (a short host name): one token of a readiness key.
pub fn node(arg: &str, name: &str) -> Result<(), UsageError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(usage(format!(
            "{arg} {name:?}: a node name is 1-64 characters of [A-Za-z0-9_-]"
        )))
    }
}

/// A scheduler's job id (Slurm job id with a cluster prefix, Kubernetes pod uid).
pub fn job(arg: &str, id: &str) -> Result<(), UsageError> {
    let ok = !id.is_empty()
        && id.len() <= 128
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b':'));
    if ok {
        Ok(())
    } else {
        Err(usage(format!(
            "{arg} {id:?}: a job id is 1-128 characters of [A-Za-z0-9._:-]"
        )))
    }
}

/// `DATASET@VERSION`, each part checked.
pub fn dataset_at_version(arg: &str, s: &str) -> Result<(String, String), UsageError> {
    let Some((d, v)) = s.split_once('@') else {
        return Err(usage(format!(
            "{arg} {s:?}: expected DATASET@VERSION (a version digest or a prefix of 12 or more hex characters)"
        )));
    };
    let whole = |e: UsageError| usage(format!("{arg} {s:?}: {}", e.0));
    dataset("dataset", d).map_err(whole)?;
    version("version", v).map_err(whole)?;
    Ok((d.to_owned(), v.to_owned()))
}

/// A duration flag in the one grammar of `stagehand-config` (`500ms`, `90s`, `30m`, `2h`, `1d`,
/// `2w`); a bare number is seconds.
pub fn duration(arg: &str, s: &str) -> Result<Duration, UsageError> {
    stagehand_config::parse_duration_arg(s).map_err(|e| usage(format!("{arg} {s:?}: {e}")))
}

/// A size flag in the one grammar of `stagehand-config` (`1048576`, `64K`, `100 MiB`, `2 GB`).
pub fn size(arg: &str, s: &str) -> Result<u64, UsageError> {
    stagehand_config::parse_size(s).map_err(|e| usage(format!("{arg} {s:?}: {e}")))
}

/// A deadline: a duration from `now` (`30m`) or an RFC 3339 time, which must be in the future.
pub fn deadline(arg: &str, s: &str, now: OffsetDateTime) -> Result<OffsetDateTime, UsageError> {
    if s.starts_with(|c: char| c.is_ascii_digit()) && !s.contains('-') {
        return Ok(now + duration(arg, s)?);
    }
    let at = OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339).map_err(
        |_| {
            usage(format!(
                "{arg} {s:?}: expected a duration (30m, 2h) or an RFC 3339 time (2026-12-01T18:00:00Z)"
            ))
        },
    )?;
    if at <= now {
        return Err(usage(format!("{arg} {s:?} is in the past")));
    }
    Ok(at)
}

/// A folder that must exist.
pub fn folder(arg: &str, path: &Path) -> Result<(), UsageError> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(usage(format!("{arg} {}: not a folder", path.display()))),
        Err(e) => Err(usage(format!("{arg} {}: {e}", path.display()))),
    }
}

/// A file that must exist and be readable.
pub fn file(arg: &str, path: &Path) -> Result<(), UsageError> {
    match std::fs::File::open(path) {
        Ok(f) if f.metadata().map(|m| m.is_file()).unwrap_or(false) => Ok(()),
        Ok(_) => Err(usage(format!("{arg} {}: not a file", path.display()))),
        Err(e) => Err(usage(format!("{arg} {}: {e}", path.display()))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use time::macros::datetime;

    #[test]
    fn names_and_versions() {
        assert!(project("--project", "lab-a_1").is_ok());
        for bad in ["", "Lab", "a.b", "a b", &"x".repeat(65)] {
            assert!(project("--project", bad).is_err(), "{bad:?}");
        }
        assert!(dataset("D", "imagenet-1k_v2.0").is_ok());
        for bad in ["", ".hidden", "a/b", "a@b", &"x".repeat(129)] {
            assert!(dataset("D", bad).is_err(), "{bad:?}");
        }
        assert!(version("V", "0123456789ab").is_ok());
        assert!(version("V", &"f".repeat(64)).is_ok());
        for bad in [
            "0123456789a",
            "0123456789AB",
            "0123456789ag",
            &"f".repeat(65),
        ] {
            assert!(version("V", bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            dataset_at_version("D@V", "ds@0123456789abcdef").unwrap(),
            ("ds".to_owned(), "0123456789abcdef".to_owned())
        );
        let e = dataset_at_version("D@V", "ds").unwrap_err();
        assert!(e.0.contains("expected DATASET@VERSION"), "{e}");
        assert!(node("--node", "gpu-001").is_ok());
        assert!(node("--node", "gpu.001").is_err());
        assert!(job("--job", "slurm-c1-12345").is_ok());
        assert!(job("--job", "a b").is_err());
    }

    #[test]
    fn durations_and_deadlines() {
        assert_eq!(duration("T", "90").unwrap(), Duration::from_secs(90));
        assert_eq!(duration("T", "500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(duration("T", "30m").unwrap(), Duration::from_secs(1800));
        assert_eq!(duration("T", "1d").unwrap(), Duration::from_secs(86400));
        // Weeks, as policies write them: one grammar for flags and files.
        assert_eq!(
            duration("T", "2w").unwrap(),
            Duration::from_secs(14 * 86400)
        );
        for bad in ["", "m", "1.5s", "10y", "-1s", "99999999999999999999d"] {
            assert!(duration("T", bad).is_err(), "{bad:?}");
        }
        let e = duration("--timeout", "10 years").unwrap_err();
        assert!(
            e.0.starts_with("--timeout \"10 years\": duration \"10 years\" has unknown unit"),
            "{e}"
        );
        assert_eq!(size("--bwlimit", "64K").unwrap(), 64 << 10);
        assert!(
            size("--bwlimit", "fast")
                .unwrap_err()
                .0
                .starts_with("--bwlimit \"fast\": size")
        );
        let now = datetime!(2026-12-01 10:00 UTC);
        assert_eq!(
            deadline("--deadline", "2h", now).unwrap(),
            datetime!(2026-12-01 12:00 UTC)
        );
        assert_eq!(
            deadline("--deadline", "2026-12-01T18:00:00Z", now).unwrap(),
            datetime!(2026-12-01 18:00 UTC)
        );
        let past = deadline("--deadline", "2026-12-01T09:00:00Z", now).unwrap_err();
        assert!(past.0.contains("in the past"), "{past}");
        assert!(deadline("--deadline", "tomorrow", now).is_err());
    }

    #[test]
    fn exit_codes_follow_the_error_kind() {
        assert_eq!(exit_code(&UsageError("x".into()).into()), EX_USAGE);
        assert_eq!(exit_code(&Unreachable("x".into()).into()), EX_UNAVAILABLE);
        assert_eq!(exit_code(&anyhow::anyhow!("x")), EX_SOFTWARE);
        let e = anyhow::Error::from(UsageError("bad\nthing".into())).context("while checking");
        assert_eq!(exit_code(&e), EX_USAGE);
        assert_eq!(error_line(&e), "stagehand: while checking: bad thing");
    }
}
