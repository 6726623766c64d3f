//! `stagehand status`: one view for on-call. It gathers, from the bus and the catalogue:
//!
//! - **services**: each instance's heartbeat (`stagehand_heartbeats`, kept by the service
//!   runner): silent past [`StatusOptions::silent_after`], failed, or restarted
//!   [`CRASH_LOOP_STARTS`] times within [`CRASH_LOOP_WINDOW`];
//! - **consumers**: every durable on the request, fact and dead-letter streams — backlog,
//!   messages in flight, redeliveries and the age of the oldest unacknowledged message;
//! - **stages**: pending (copying included) and failed stage requests across every project the
//!   caller may see, counted, the oldest pending and newest failed listed with their reason;
//! - **dead letters** per service that still wait (not replayed);
//! - **tiers** above their high watermark and projects above 90 % of their quota (when the
//!   policies are at hand), nodes whose agent is silent (their local copies unreachable:
//!   `runbooks/node-lost.md`), and the facts the catalogue could not fold;
//! - **the scrub** behind its period on a tier ([`scrub_behind`]: `runbooks/scrub-behind.md`)
//!   and **S3 tiers** that do not answer a HEAD request in this shell's credentials
//!   (`runbooks/s3-tier-unreachable.md`);
//! - **fan-out**: nodes a fan-out dropped for serving bytes that did not verify, until their
//!   own copy is read whole again (`runbooks/fanout-peer-dropped.md`);
//! - **NATS**: the cluster's own health as JetStream reports it (each stream's replicas): a node
//!   whose replicas are offline or behind, a stream with no leader
//!   (`runbooks/nats-node-lost.md`).
//!
//! `--actions` lists instead every operator action the catalogue keeps (`operator.action`
//! facts: stages cancelled, dead letters discarded or replayed), newest first ([`actions`]).
//!
//! `--serve ADDR` serves the same view as one HTML page that reloads itself, and as JSON
//! ([`page`]).
//!
//! Each of these that needs a person is a [`Finding`] naming the command or runbook page to
//! run. The exit code is 0 when there is none, 1 when there is one. It reads no file lists
//! and no stage record beyond one page, so it stays fast on a large installation
//! (`loadtest/status/bench.sh`).

pub mod page;

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use futures::TryStreamExt;
use serde::Serialize;
use stagehand_bus::Bus;
use stagehand_bus::runner::Heartbeat;
use stagehand_catalogue::{Catalogue, OpenStageCounts, StageState, StageStatus};
use stagehand_schemas::subject::{DEAD_LETTERS, FACTS, REQUESTS};
use time::OffsetDateTime;

/// Starts within [`CRASH_LOOP_WINDOW`] from which an instance counts as crash-looping.
pub const CRASH_LOOP_STARTS: usize = 3;
/// The window in which [`CRASH_LOOP_STARTS`] starts make a crash loop.
pub const CRASH_LOOP_WINDOW: Duration = Duration::from_secs(10 * 60);
/// The share of a quota above which a project needs a person.
pub const QUOTA_SHARE: f64 = 0.9;
/// How many stages of each kind the view lists (all are counted).
const LISTED: u32 = 20;

/// What `status` looks at and when something counts as needing a person.
#[derive(Debug, Clone)]
pub struct StatusOptions {
    /// The policy folder, for tiers' watermarks and quotas; none: tiers are not checked.
    pub policies: Option<PathBuf>,
    /// A heartbeat older than this (and not ended) is a silent service.
    pub silent_after: Duration,
    /// An unacknowledged message older than this is a stuck consumer.
    pub backlog_after: Duration,
    /// A stage request pending (or copying) unchanged for longer than this is stuck.
    pub stuck_after: Duration,
}

/// Something that needs a person: what, where, and what to run.
#[derive(Debug, Clone, Serialize)]
pub struct Finding {
    /// `service`, `consumer`, `stage`, `dead_letters`, `tier`, `quota`, `replica`, `scrub`,
    /// `node`, `fanout`, `drill`, `checkpoint`, `catalogue` or `nats`.
    pub area: &'static str,
    /// What it is about: a service instance, a consumer, a stage request, a tier.
    pub subject: String,
    /// What is wrong, with its age or size.
    pub detail: String,
    /// The command or runbook page (`runbooks/<page>.md`) to run.
    pub run: String,
}

/// One service instance as its heartbeat shows it.
#[derive(Debug, Clone, Serialize)]
pub struct ServiceLine {
    pub service: String,
    pub instance: String,
    pub version: String,
    pub host: String,
    /// `alive`, `silent`, `stopped`, `failed` or `restarting`.
    pub state: &'static str,
    #[serde(with = "time::serde::rfc3339")]
    pub started_at: OffsetDateTime,
    pub beat_seconds_ago: i64,
    pub progress_seconds_ago: Option<i64>,
    pub handled: u64,
    pub restarts: u64,
    pub unclean_stops: u64,
    pub error: Option<String>,
}

/// One durable consumer's backlog.
#[derive(Debug, Clone, Serialize)]
pub struct ConsumerLine {
    pub stream: String,
    pub consumer: String,
    pub pending: u64,
    pub ack_pending: u64,
    pub redelivered: u64,
    /// Age of the oldest message not yet acknowledged; none when nothing waits or it is gone.
    pub oldest_seconds: Option<i64>,
}

/// Open stage requests: all counted, some listed.
#[derive(Debug, Clone, Serialize)]
pub struct StageLines {
    pub counts: OpenStageCounts,
    /// Pending ones, oldest change first.
    pub pending: Vec<StageStatus>,
    /// Failed ones, newest first.
    pub failed: Vec<StageStatus>,
}

/// Dead letters of one service.
#[derive(Debug, Clone, Serialize)]
pub struct DeadLetterLine {
    pub service: String,
    pub count: u64,
    pub waiting: u64,
}

/// A bounded tier's use against its watermark.
#[derive(Debug, Clone, Serialize)]
pub struct TierLine {
    pub tier: String,
    pub capacity: u64,
    pub counted: u64,
    pub high_watermark: f64,
}

/// The copies of one tier found damaged (by the scrub, the check before reuse or a copy down)
/// and not repaired yet.
#[derive(Debug, Clone, Serialize)]
pub struct DamagedLine {
    pub tier: String,
    pub damaged: u64,
}

/// Backed-up versions whose restore drill failed, or that no drill has verified within two
/// drill intervals (`backup.toml`'s `drill_every`) of their backup.
#[derive(Debug, Clone, Serialize)]
pub struct DrillLines {
    pub versions: u64,
    pub failed: u64,
    pub overdue: u64,
}

/// The whole view, `--json`'s object.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Whether anything needs a person (exit 1).
    pub needs_person: bool,
    pub findings: Vec<Finding>,
    pub services: Vec<ServiceLine>,
    pub consumers: Vec<ConsumerLine>,
    pub stages: StageLines,
    pub dead_letters: Vec<DeadLetterLine>,
    /// Bounded tiers; empty when no policies were at hand.
    pub tiers: Vec<TierLine>,
    /// Damaged copies per tier (withdrawn from readiness, not repaired yet); empty when no
    /// policies were at hand.
    pub damaged: Vec<DamagedLine>,
    /// Restore drills of the backups; none without policies or a `backup.toml`.
    pub drills: Option<DrillLines>,
    /// Facts the catalogue could not fold.
    pub problems: u64,
    /// What this view does not check, and where to look instead.
    pub not_checked: Vec<String>,
}

fn seconds(d: Duration) -> i64 {
    i64::try_from(d.as_secs()).unwrap_or(i64::MAX)
}

fn age(since: OffsetDateTime, now: OffsetDateTime) -> i64 {
    (now - since).whole_seconds()
}

/// Seconds as on-call reads them: 45s, 12m, 3h, 2d.
pub fn human_age(s: i64) -> String {
    match s {
        s if s < 120 => format!("{s}s"),
        s if s < 7200 => format!("{}m", s / 60),
        s if s < 172_800 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86_400),
    }
}

/// Gathers the view.
pub async fn gather(
    bus: &Bus,
    catalogue: &Catalogue,
    opts: &StatusOptions,
) -> anyhow::Result<Report> {
    let now = OffsetDateTime::now_utc();
    let mut findings = Vec::new();
    let services = services(bus, opts, now, &mut findings).await?;
    let consumers = consumers(bus, opts, now, &mut findings).await?;
    let mut unprobed = Vec::new();
    if let Err(e) = nats_cluster(bus, &mut findings).await {
        unprobed.push(format!("the NATS cluster's replicas: {e:#}"));
    }
    let stages = stages(catalogue, opts, now, &mut findings).await?;
    let dead_letters = dead_letters(catalogue, &mut findings).await?;
    let (_, problems) = catalogue
        .problems(Some(1), None)
        .await
        .context("the catalogue's problems")?;
    if problems > 0 {
        findings.push(Finding {
            area: "catalogue",
            subject: "catalogue-recorder".into(),
            detail: format!("{problems} facts could not be folded"),
            run: "stagehand catalogue problems (runbooks/catalogue-problems.md)".into(),
        });
    }
    let policies = match &opts.policies {
        Some(dir) => Some(
            stagehand_policy::Policies::load_dir(dir)
                .with_context(|| format!("reading the policies in {}", dir.display()))?,
        ),
        None => None,
    };
    let (mut tier_lines, mut damaged, mut drill_lines) = (Vec::new(), Vec::new(), None);
    if let Some(policies) = &policies {
        tier_lines = tiers(catalogue, policies, &mut findings).await?;
        damaged = damage(catalogue, policies, now, &mut findings).await?;
        unreachable_s3_tiers(policies, &mut findings, &mut unprobed).await;
        unreachable_nodes(catalogue, policies, &mut findings).await?;
        if let Err(e) = dropped_peers(bus, catalogue, policies, now, &mut findings).await {
            unprobed.push(format!("nodes dropped from a fan-out: {e:#}"));
        }
        drill_lines = drills(catalogue, policies, now, &mut findings).await?;
        offloads(bus, catalogue, policies, now, &mut findings).await?;
    }
    let mut not_checked =
        vec!["versions no backup protects yet: stagehand backup status --check".to_owned()];
    if policies.is_none() {
        not_checked.push(
            "tiers, quotas, damaged copies and restore drills: no policies (give --policies DIR)"
                .into(),
        );
    } else if drill_lines.is_none() {
        not_checked.push("restore drills: no backup.toml".into());
    }
    not_checked.extend(unprobed);
    Ok(Report {
        needs_person: !findings.is_empty(),
        findings,
        services,
        consumers,
        stages,
        dead_letters,
        tiers: tier_lines,
        damaged,
        drills: drill_lines,
        problems,
        not_checked,
    })
}

async fn services(
    bus: &Bus,
    opts: &StatusOptions,
    now: OffsetDateTime,
    findings: &mut Vec<Finding>,
) -> anyhow::Result<Vec<ServiceLine>> {
    let store = bus
        .jetstream()
        .get_key_value(stagehand_bus::HEARTBEATS_BUCKET)
        .await
        .with_context(|| {
            format!(
                "the heartbeat bucket {} (run `stagehand provision`)",
                stagehand_bus::HEARTBEATS_BUCKET
            )
        })?;
    let keys: Vec<String> = store
        .keys()
        .await
        .context("the heartbeats' keys")?
        .try_collect()
        .await
        .context("the heartbeats' keys")?;
    let mut out = Vec::new();
    for key in keys {
        let Some(bytes) = store.get(&key).await.context("a heartbeat")? else {
            continue;
        };
        let beat: Heartbeat = match serde_json::from_slice(&bytes) {
            Ok(beat) => beat,
            Err(e) => {
                findings.push(Finding {
                    area: "service",
                    subject: key.clone(),
                    detail: format!("its heartbeat does not read: {e}"),
                    run: "runbooks/service-silent.md".into(),
                });
                continue;
            }
        };
        let beat_ago = age(beat.beat_at, now);
        let restarting = beat.starts_within(CRASH_LOOP_WINDOW, now) >= CRASH_LOOP_STARTS;
        let state = if beat.failed_at.is_some() {
            "failed"
        } else if beat.stopped_at.is_some() {
            "stopped"
        } else if beat_ago > seconds(opts.silent_after) {
            "silent"
        } else if restarting {
            "restarting"
        } else {
            "alive"
        };
        let subject = format!("{} on {}", beat.service, beat.instance);
        let detail = match state {
            "failed" => Some(format!(
                "failed {} ago: {}",
                human_age(beat.failed_at.map_or(0, |t| age(t, now))),
                beat.error.as_deref().unwrap_or("no error kept")
            )),
            "silent" => Some(format!(
                "silent for {} (beats every {}s)",
                human_age(beat_ago),
                beat.every_seconds
            )),
            "restarting" => Some(format!(
                "started {} times in {} ({} unclean stops in all)",
                beat.starts_within(CRASH_LOOP_WINDOW, now),
                human_age(seconds(CRASH_LOOP_WINDOW)),
                beat.unclean_stops
            )),
            _ => None,
        };
        if let Some(detail) = detail {
            findings.push(Finding {
                area: "service",
                subject,
                detail,
                run: format!(
                    "journalctl -u stagehand-{} on {} (runbooks/service-silent.md)",
                    beat.service, beat.host
                ),
            });
        }
        out.push(ServiceLine {
            service: beat.service.clone(),
            instance: beat.instance.clone(),
            version: beat.version.clone(),
            host: beat.host.clone(),
            state,
            started_at: beat.started_at,
            beat_seconds_ago: beat_ago,
            progress_seconds_ago: beat.last_progress_at.map(|t| age(t, now)),
            handled: beat.handled,
            restarts: beat.starts.saturating_sub(1),
            unclean_stops: beat.unclean_stops,
            error: beat.error.clone(),
        });
    }
    Ok(out)
}

async fn consumers(
    bus: &Bus,
    opts: &StatusOptions,
    now: OffsetDateTime,
    findings: &mut Vec<Finding>,
) -> anyhow::Result<Vec<ConsumerLine>> {
    let mut out = Vec::new();
    for spec in [REQUESTS, FACTS, DEAD_LETTERS] {
        let stream = bus
            .jetstream()
            .get_stream(spec.name)
            .await
            .with_context(|| format!("the stream {}", spec.name))?;
        let names: Vec<String> = stream
            .consumer_names()
            .try_collect()
            .await
            .with_context(|| format!("the consumers of {}", spec.name))?;
        for name in names {
            let info = match stream.consumer_info(&name).await {
                Ok(info) => info,
                // Deleted between the listing and now (an ordered consumer of a reader).
                Err(_) => continue,
            };
            if info.config.durable_name.is_none() {
                continue;
            }
            let waiting = info.num_pending > 0 || info.num_ack_pending > 0;
            let oldest_seconds = if waiting {
                oldest_waiting(&stream, &info)
                    .await
                    .map(|m| age(m.time, now))
            } else {
                None
            };
            let line = ConsumerLine {
                stream: spec.name.to_owned(),
                consumer: name.clone(),
                pending: info.num_pending,
                ack_pending: info.num_ack_pending as u64,
                redelivered: info.num_redelivered as u64,
                oldest_seconds,
            };
            if let Some(oldest) = oldest_seconds.filter(|s| *s > seconds(opts.backlog_after)) {
                findings.push(Finding {
                    area: "consumer",
                    subject: format!("{} on {}", name, spec.name),
                    detail: format!(
                        "{} waiting, {} in flight, {} redelivered; the oldest for {}",
                        line.pending,
                        line.ack_pending,
                        line.redelivered,
                        human_age(oldest)
                    ),
                    run: "runbooks/backlog-growing.md".into(),
                });
            }
            out.push(line);
        }
    }
    Ok(out)
}

/// The subjects a consumer reads: its filter subject(s), or every subject of its stream.
fn filter_subjects(config: &async_nats::jetstream::consumer::Config) -> Vec<String> {
    let mut subjects: Vec<String> = (config.filter_subjects.iter())
        .chain(std::iter::once(&config.filter_subject))
        .filter(|s| !s.is_empty())
        .cloned()
        .collect();
    if subjects.is_empty() {
        subjects.push(">".into());
    }
    subjects
}

/// The oldest message a consumer has not acknowledged: the first one after its ack floor of
/// its own filter subjects (the earliest over them when it has several). The message right
/// after the floor may be of another subject of the stream, perhaps much older, which the
/// consumer never reads. `None` when none is left (deleted, or the stream's limits dropped it).
/// One direct get per filter subject (`next_by_subj`), answered by any replica.
pub async fn oldest_waiting(
    stream: &async_nats::jetstream::stream::Stream,
    info: &async_nats::jetstream::consumer::Info,
) -> Option<async_nats::jetstream::message::StreamMessage> {
    let after_floor = info.ack_floor.stream_sequence + 1;
    let mut oldest: Option<async_nats::jetstream::message::StreamMessage> = None;
    for subject in filter_subjects(&info.config) {
        let Ok(m) = stream
            .direct_get_next_for_subject(subject, Some(after_floor))
            .await
        else {
            continue;
        };
        if oldest.as_ref().is_none_or(|o| m.sequence < o.sequence) {
            oldest = Some(m);
        }
    }
    oldest
}

fn stage_subject(s: &StageStatus) -> String {
    format!(
        "{}/{}@{} on {}{} for job {}",
        s.project,
        s.dataset,
        s.version.get(..12).unwrap_or(&s.version),
        s.tier,
        s.node
            .as_deref()
            .map(|n| format!(":{n}"))
            .unwrap_or_default(),
        s.job_id
    )
}

fn stage_command(s: &StageStatus) -> String {
    format!(
        "stagehand stage status --project {} {}",
        s.project, s.job_id
    )
}

async fn stages(
    catalogue: &Catalogue,
    opts: &StatusOptions,
    now: OffsetDateTime,
    findings: &mut Vec<Finding>,
) -> anyhow::Result<StageLines> {
    let (pending, counts) = catalogue
        .open_stages(StageState::Pending, &[], Some(LISTED), None)
        .await
        .context("the pending stages")?;
    let (failed, _) = catalogue
        .open_stages(StageState::Failed, &[], Some(LISTED), None)
        .await
        .context("the failed stages")?;
    for s in &failed.items {
        findings.push(Finding {
            area: "stage",
            subject: stage_subject(s),
            detail: format!(
                "failed {} ago: {}",
                human_age(age(s.updated_at, now)),
                s.reason.as_deref().unwrap_or("no reason given")
            ),
            run: format!("{} (runbooks/stage-failed.md)", stage_command(s)),
        });
    }
    for s in &pending.items {
        let waited = age(s.updated_at, now);
        if waited > seconds(opts.stuck_after) {
            findings.push(Finding {
                area: "stage",
                subject: stage_subject(s),
                detail: format!(
                    "{} for {}: {}",
                    if s.progress.is_some() {
                        "copying"
                    } else {
                        "pending"
                    },
                    human_age(waited),
                    s.reason
                        .as_deref()
                        .or(s.waiting_for.as_deref())
                        .unwrap_or("no reason given")
                ),
                run: format!("{} (runbooks/stage-stuck.md)", stage_command(s)),
            });
        }
    }
    Ok(StageLines {
        counts,
        pending: pending.items,
        failed: failed.items,
    })
}

async fn dead_letters(
    catalogue: &Catalogue,
    findings: &mut Vec<Finding>,
) -> anyhow::Result<Vec<DeadLetterLine>> {
    let answer = catalogue
        .ask(&stagehand_catalogue::Query::DeadLetters {
            limit: Some(stagehand_catalogue::MAX_PAGE),
            after: None,
        })
        .await
        .context("the dead letters")?;
    let stagehand_catalogue::Answer::DeadLetters { services, .. } = answer else {
        anyhow::bail!("the catalogue answered something else than dead letters");
    };
    let mut out = Vec::new();
    for s in services {
        // A recorder that does not fold replays: every dead letter counts as waiting.
        let waiting = s.waiting.unwrap_or(s.count);
        if waiting > 0 {
            findings.push(Finding {
                area: "dead_letters",
                subject: s.service.clone(),
                detail: format!("{waiting} dead letters wait ({} in all)", s.count),
                run: format!(
                    "stagehand dlq list --service {} (runbooks/dead-letters-waiting.md)",
                    s.service
                ),
            });
        }
        out.push(DeadLetterLine {
            service: s.service,
            count: s.count,
            waiting,
        });
    }
    Ok(out)
}

/// Bounded tiers against their high watermark and projects against their quota: one catalogue
/// question (bytes per tier, node and project, as the demoter counts them) and `statfs` of a
/// posix tier's root for what others use — the demoter's arithmetic
/// ([`stagehand_demoter::plan::TierUsage`]) without its per-replica holds, which status does
/// not need. A node-local tier is counted per node, without `statfs` (its disks are elsewhere).
async fn tiers(
    catalogue: &Catalogue,
    policies: &stagehand_policy::Policies,
    findings: &mut Vec<Finding>,
) -> anyhow::Result<Vec<TierLine>> {
    use stagehand_catalogue::survey::{FsUsage, TierUsage};
    use std::collections::BTreeMap;
    let usage = catalogue
        .tier_usage(None)
        .await
        .context("the tiers' usage")?;
    let mut out = Vec::new();
    for tier in policies.tiers().values() {
        let Some(limits) = &tier.limits else {
            continue;
        };
        // (node or "") → (placed bytes, per project bytes)
        let mut places: BTreeMap<String, (u64, BTreeMap<String, u64>)> = BTreeMap::new();
        for u in usage.iter().filter(|u| u.tier == tier.name) {
            let place = places
                .entry(u.node.clone().unwrap_or_default())
                .or_default();
            place.0 += u.bytes;
            *place.1.entry(u.project.clone()).or_default() += u.bytes;
        }
        if places.is_empty() {
            places.insert(String::new(), Default::default());
        }
        for (node, (placed, projects)) in places {
            let fs = match (&tier.kind, node.is_empty()) {
                (stagehand_policy::TierKind::Posix { root }, true) => FsUsage::at(root),
                _ => None,
            };
            let counted = TierUsage {
                capacity: limits.capacity,
                placed,
                fs,
            }
            .counted();
            let name = if node.is_empty() {
                tier.name.clone()
            } else {
                format!("{}:{node}", tier.name)
            };
            let capacity = limits.capacity.max(1) as f64;
            if counted as f64 > limits.high_watermark * capacity {
                findings.push(Finding {
                    area: "tier",
                    subject: name.clone(),
                    detail: format!(
                        "{:.1} % used, above its high watermark of {:.0} %",
                        100.0 * counted as f64 / capacity,
                        100.0 * limits.high_watermark
                    ),
                    run: format!(
                        "stagehand tier usage {} (runbooks/tier-above-watermark.md)",
                        tier.name
                    ),
                });
            }
            for (project, used) in projects {
                if let Some(quota) = limits.quota_for(&project)
                    && used as f64 > QUOTA_SHARE * quota.max(1) as f64
                {
                    findings.push(Finding {
                        area: "quota",
                        subject: format!("{project} on {name}"),
                        detail: format!(
                            "{:.1} % of its quota used",
                            100.0 * used as f64 / quota.max(1) as f64
                        ),
                        run: format!(
                            "stagehand tier usage {} (runbooks/quota-nearly-full.md)",
                            tier.name
                        ),
                    });
                }
            }
            out.push(TierLine {
                tier: name,
                capacity: limits.capacity,
                counted,
                high_watermark: limits.high_watermark,
            });
        }
    }
    Ok(out)
}

/// Copies withdrawn as damaged on each declared tier: each needs a repair, and one the scrub
/// could not make needs a person. One bounded catalogue question per tier.
async fn damage(
    catalogue: &Catalogue,
    policies: &stagehand_policy::Policies,
    now: OffsetDateTime,
    findings: &mut Vec<Finding>,
) -> anyhow::Result<Vec<DamagedLine>> {
    let mut out = Vec::new();
    let scrub = policies.scrub();
    for tier in policies.tiers().keys() {
        // A scrubbed tier is asked for what was verified within its period too (one question).
        let period = scrub.and_then(|p| p.period.get(tier).map(|d| (*d, p.check_every)));
        let since = period.map_or(now, |(period, _)| {
            now - time::Duration::try_from(period).unwrap_or(time::Duration::MAX)
        });
        let s = catalogue
            .scrub_status(tier, since, Some(LISTED))
            .await
            .with_context(|| format!("the damaged copies on tier {tier}"))?;
        if let Some((period, check_every)) = period {
            findings.extend(scrub_behind(&s, period, check_every, now));
        }
        for r in &s.damaged {
            let node = r
                .node
                .as_deref()
                .map(|n| format!(" on {n}"))
                .unwrap_or_default();
            findings.push(Finding {
                area: "replica",
                subject: format!(
                    "{}/{}@{} on {tier}{node}",
                    r.project,
                    r.dataset,
                    &r.version[..r.version.len().min(12)]
                ),
                detail: r.reason.clone().unwrap_or_else(|| "damaged".into()),
                run: format!(
                    "stagehand catalogue show {}@{} --project {} (runbooks/replica-damaged.md)",
                    r.dataset,
                    &r.version[..r.version.len().min(12)],
                    r.project
                ),
            });
        }
        if s.damaged_total > s.damaged.len() as u64 {
            findings.push(Finding {
                area: "replica",
                subject: tier.clone(),
                detail: format!(
                    "{} more damaged copies",
                    s.damaged_total - s.damaged.len() as u64
                ),
                run: "stagehand scrub status (runbooks/replica-damaged.md)".into(),
            });
        }
        if s.damaged_total > 0 {
            out.push(DamagedLine {
                tier: tier.clone(),
                damaged: s.damaged_total,
            });
        }
    }
    Ok(out)
}

/// The scrub is behind on a tier when its oldest copy went unverified (since its last
/// verification, else its making: the catalogue's `oldest`) longer than the tier's period plus
/// two of the scrub's `check_every`: a copy falls due at its period, and a scrub keeping up
/// finds it at its next look and reads it before the one after. The finding says the tier's
/// coverage (its bytes verified within the period) and the oldest copy.
pub fn scrub_behind(
    s: &stagehand_catalogue::TierScrub,
    period: Duration,
    check_every: Duration,
    now: OffsetDateTime,
) -> Option<Finding> {
    let oldest = s.oldest.as_ref()?;
    let since = oldest.unverified_since()?;
    let waited = age(since, now);
    if waited <= seconds(period.saturating_add(check_every.saturating_mul(2))) {
        return None;
    }
    let coverage = match s.bytes {
        0 => 1.0,
        bytes => s.verified_bytes as f64 / bytes as f64,
    };
    let copy = format!(
        "{}/{}@{}{}",
        oldest.project,
        oldest.dataset,
        oldest.version.get(..12).unwrap_or(&oldest.version),
        (oldest.node.as_deref())
            .map(|n| format!(" on {n}"))
            .unwrap_or_default()
    );
    let last = match oldest.last_verified {
        Some(_) => format!("last verified {} ago", human_age(waited)),
        None => format!("never verified, made {} ago", human_age(waited)),
    };
    Some(Finding {
        area: "scrub",
        subject: s.tier.clone(),
        detail: format!(
            "scrub behind on tier {}: coverage {:.1} % of period {}; oldest {copy}, {last}",
            s.tier,
            100.0 * coverage,
            stagehand_config::format_duration(period)
        ),
        run: format!("stagehand scrub status (runbooks/{SCRUB_BEHIND_RUNBOOK})"),
    })
}

/// The runbook page of a tier whose scrub is behind its period.
pub const SCRUB_BEHIND_RUNBOOK: &str = "scrub-behind.md";
/// The runbook page of an S3 tier that does not answer.
pub const S3_TIER_UNREACHABLE_RUNBOOK: &str = "s3-tier-unreachable.md";
/// How long status waits for an S3 tier's answer: the SDK's own retries of a black-holed
/// endpoint would take 20 s.
pub const S3_PROBE_TIMEOUT: Duration = Duration::from_secs(5);
/// The key an S3 tier is probed with (a HEAD of it: no object needs to exist).
const S3_PROBE_KEY: &str = "stagehand-status-probe";

/// Every S3 tier, probed at once with one HEAD request in this shell's credentials (the
/// services' `AWS_*` environment, or the tier's `profile`): one that cannot be reached (no
/// connection, DNS, no answer within [`S3_PROBE_TIMEOUT`]) is a finding. One that answers with
/// another error (refused credentials, most often those of this shell rather than the
/// services') is said in `unprobed`, not as a finding: the services may well reach it.
async fn unreachable_s3_tiers(
    policies: &stagehand_policy::Policies,
    findings: &mut Vec<Finding>,
    unprobed: &mut Vec<String>,
) {
    use stagehand_mover::{ErrorKind, Tier};
    let probes = (policies.tiers().values())
        .filter(|t| matches!(t.kind, stagehand_policy::TierKind::S3(_)))
        .map(|t| async move {
            let answer = match t.open() {
                Ok(Tier::S3(s3)) => {
                    match tokio::time::timeout(S3_PROBE_TIMEOUT, s3.stat(S3_PROBE_KEY)).await {
                        Ok(Ok(_)) => Ok(()),
                        Ok(Err(e)) => Err((e.kind == ErrorKind::Unreachable, e.to_string())),
                        Err(_) => Err((
                            true,
                            format!(
                                "no answer from {} within {}s",
                                t.location(),
                                S3_PROBE_TIMEOUT.as_secs()
                            ),
                        )),
                    }
                }
                Ok(Tier::Posix(_)) => Ok(()),
                Err(e) => Err((false, e.to_string())),
            };
            (t.name.clone(), answer)
        });
    for (tier, answer) in futures::future::join_all(probes).await {
        match answer {
            Ok(()) => {}
            Err((true, error)) => findings.push(Finding {
                area: "tier",
                subject: tier.clone(),
                detail: format!("tier {tier} unreachable: {error}"),
                run: format!("stagehand dlq list (runbooks/{S3_TIER_UNREACHABLE_RUNBOOK})"),
            }),
            Err((false, error)) => {
                unprobed.push(format!("whether S3 tier {tier} answers: {error}"));
            }
        }
    }
}

/// Checkpoint steps committed on node-local tiers whose part stayed on its node past
/// `retention.toml`'s `[offload] deadline`: each a finding (a step never completing is a run
/// that cannot resume from it). When the offload tier is bounded, the promoter's reservations
/// on it say whether it can take the bytes still on the nodes: if not, the finding says so
/// (the agents retry until it can).
async fn offloads(
    bus: &Bus,
    catalogue: &Catalogue,
    policies: &stagehand_policy::Policies,
    now: OffsetDateTime,
    findings: &mut Vec<Finding>,
) -> anyhow::Result<()> {
    let Some(offload) = policies.retention().and_then(|r| r.offload.as_ref()) else {
        return Ok(());
    };
    let deadline = offload.deadline;
    let room = offload_room(bus, policies, &offload.tier).await;
    for (name, tier) in policies.tiers() {
        if tier.role != stagehand_policy::TierRole::Local {
            continue;
        }
        let parts = catalogue
            .checkpoint_parts_on(name, None)
            .await
            .with_context(|| format!("the checkpoint parts on tier {name}"))?;
        findings.extend(late_offloads(&parts, deadline, now, room.as_ref()));
    }
    Ok(())
}

/// The space the promoter would reserve now on a bounded offload tier: what a part's offload
/// needs before it copies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OffloadRoom {
    pub tier: String,
    pub free: u64,
    pub capacity: u64,
}

/// The room on `tier` from the promoter's reservations; `None` for an unbounded tier, or when
/// the promoter's bucket cannot be read (the finding then says nothing of space).
async fn offload_room(
    bus: &Bus,
    policies: &stagehand_policy::Policies,
    tier: &str,
) -> Option<OffloadRoom> {
    let capacity = policies.tiers().get(tier)?.limits.as_ref()?.capacity;
    let store = (bus.jetstream())
        .get_key_value(stagehand_bus::PROMOTER_BUCKET)
        .await
        .ok()?;
    let reserved = stagehand_bus::placement::reservations(&store, tier, None)
        .await
        .ok()?;
    Some(OffloadRoom {
        tier: tier.to_owned(),
        free: reserved.value.unwrap_or_default().free(capacity),
        capacity,
    })
}

/// Nodes whose agent went silent past `agent_silent_after`: their copies on each node-local
/// tier are unreachable (`replica.unreachable`), one finding per (tier, node) with how many
/// copies and bytes, and since when. One catalogue question per local tier.
async fn unreachable_nodes(
    catalogue: &Catalogue,
    policies: &stagehand_policy::Policies,
    findings: &mut Vec<Finding>,
) -> anyhow::Result<()> {
    use stagehand_catalogue::ReplicaState;
    let local = (policies.tiers().values()).filter(|t| t.role == stagehand_policy::TierRole::Local);
    for tier in local {
        let copies = catalogue
            .replicas_on(&tier.name, None, Some(ReplicaState::Unreachable))
            .await
            .with_context(|| format!("the unreachable copies on tier {}", tier.name))?;
        let mut by_node = std::collections::BTreeMap::<&str, (u64, u64, Option<&str>)>::new();
        for r in &copies {
            let Some(node) = r.node.as_deref() else {
                continue;
            };
            let e = by_node.entry(node).or_default();
            e.0 += 1;
            e.1 += r.total_bytes;
            e.2 = e.2.or(r.reason.as_deref());
        }
        for (node, (count, bytes, reason)) in by_node {
            findings.push(Finding {
                area: "node",
                subject: format!("{node} (tier {})", tier.name),
                detail: format!(
                    "{count} copies ({}) unreachable — {}",
                    crate::tier::size(bytes),
                    reason.unwrap_or("its agent is silent")
                ),
                run: format!(
                    "start the node's agent, or take the node out (runbooks/{NODE_LOST_RUNBOOK})"
                ),
            });
        }
    }
    Ok(())
}

/// The runbook page of a NATS node lost or cut off from the others.
pub const NATS_NODE_LOST_RUNBOOK: &str = "nats-node-lost.md";

/// How long a replica may go unheard, not current, before it counts as behind: a follower
/// catching up on a burst of writes is briefly not current while its leader still hears it.
pub const NATS_REPLICA_SILENT: Duration = Duration::from_secs(10);

/// How many streams a NATS finding names before it says how many more.
const STREAMS_NAMED: usize = 4;

/// The NATS cluster's own health, as JetStream reports it: one listing of the account's
/// stream names (the meta layer's) and one of their states (for which the meta leader asks
/// each stream's leader). A node holding replicas that are offline, or not current and unheard
/// for [`NATS_REPLICA_SILENT`], is one finding naming its streams; a stream with no leader, or
/// whose leader did not answer the listing, is one finding of its own: its replicas have lost
/// their majority and nothing moves on it. A single server has no replicas: nothing to say.
async fn nats_cluster(bus: &Bus, findings: &mut Vec<Finding>) -> anyhow::Result<()> {
    let js = bus.jetstream();
    let names: Vec<String> = (js.stream_names())
        .try_collect()
        .await
        .context("the streams' names")?;
    let states: Vec<async_nats::jetstream::stream::Info> = (js.streams())
        .try_collect()
        .await
        .context("the streams' states")?;
    findings.extend(cluster_findings(
        &names,
        states
            .iter()
            .map(|s| (s.config.name.as_str(), s.cluster.as_ref())),
    ));
    Ok(())
}

/// [`nats_cluster`]'s findings from the stream names and the states listed.
fn cluster_findings<'a>(
    names: &[String],
    listed: impl IntoIterator<
        Item = (
            &'a str,
            Option<&'a async_nats::jetstream::stream::ClusterInfo>,
        ),
    >,
) -> Vec<Finding> {
    let run = format!("runbooks/{NATS_NODE_LOST_RUNBOOK}");
    let mut behind: std::collections::BTreeMap<&str, Vec<&str>> = Default::default();
    let mut leaderless = Vec::new();
    let mut answered = std::collections::BTreeSet::new();
    for (stream, cluster) in listed {
        answered.insert(stream);
        let Some(cluster) = cluster else {
            continue;
        };
        if cluster.leader.as_deref().is_none_or(str::is_empty) {
            leaderless.push((stream, "it has no leader"));
            continue;
        }
        for peer in &cluster.replicas {
            if peer.offline || (!peer.current && peer.active >= NATS_REPLICA_SILENT) {
                behind.entry(peer.name.as_str()).or_default().push(stream);
            }
        }
    }
    leaderless.extend(
        (names.iter().map(String::as_str))
            .filter(|n| !answered.contains(n))
            .map(|n| (n, "its leader did not answer")),
    );
    let mut out: Vec<Finding> = (behind.into_iter())
        .map(|(node, streams)| {
            let named = streams.iter().take(STREAMS_NAMED).copied();
            let mut list = named.collect::<Vec<_>>().join(", ");
            if streams.len() > STREAMS_NAMED {
                list.push_str(&format!(" and {} more", streams.len() - STREAMS_NAMED));
            }
            Finding {
                area: "nats",
                subject: format!("NATS node {}", printable(node)),
                detail: format!(
                    "its replicas of {} streams are offline or behind: {list}",
                    streams.len()
                ),
                run: run.clone(),
            }
        })
        .collect();
    out.extend(leaderless.into_iter().map(|(stream, why)| Finding {
        area: "nats",
        subject: format!("stream {stream}"),
        detail: format!(
            "{why}: its replicas have lost their majority (a second node lost or cut off), and nothing moves on it"
        ),
        run: run.clone(),
    }));
    out
}

/// The runbook page of a node that served bytes that did not verify in a fan-out.
pub const FANOUT_PEER_DROPPED_RUNBOOK: &str = "fanout-peer-dropped.md";

/// `text` without control characters: a report on the board is written by a node agent, and
/// reaches on-call's terminal and page.
fn printable(text: &str) -> String {
    text.chars().filter(|c| !c.is_control()).collect()
}

/// Nodes that served bytes that did not verify in a fan-out: each report on the board a
/// finding until that node's own copy of the version is read whole again after the report (a
/// scrub, a repair, or a copy made anew: `last_verified`, `last_repaired` or `copied`); the
/// board forgets a swarm a day after (its bucket's `max_age`). The swarm is matched to the
/// version by the agents' own naming (a swarm's name starts with
/// [`stagehand_promoter::fanout::Fanout::swarm`]) against
/// the node's copies on the node-local tiers: one catalogue question per reported node and
/// local tier. No bucket (no node agent ever fanned out): nothing to say.
async fn dropped_peers(
    bus: &Bus,
    catalogue: &Catalogue,
    policies: &stagehand_policy::Policies,
    now: OffsetDateTime,
    findings: &mut Vec<Finding>,
) -> anyhow::Result<()> {
    use stagehand_promoter::fanout::{BadKey, Fanout};
    let store = match bus
        .jetstream()
        .get_key_value(stagehand_bus::SWARMS_BUCKET)
        .await
    {
        Ok(store) => store,
        Err(e) if stagehand_bus::bucket_missing(&e) => return Ok(()),
        Err(e) => return Err(e).context("the fan-out board"),
    };
    let keys: Vec<String> = (store.keys().await.context("the fan-out board's keys")?)
        .try_collect()
        .await
        .context("the fan-out board's keys")?;
    let local: Vec<&str> = (policies.tiers().values())
        .filter(|t| t.role == stagehand_policy::TierRole::Local)
        .map(|t| t.name.as_str())
        .collect();
    for key in keys {
        let Some(BadKey {
            swarm,
            node,
            by: caught_by,
        }) = BadKey::parse(&key)
        else {
            continue;
        };
        let Some(entry) = store.entry(&key).await.context("a fan-out report")? else {
            continue;
        };
        let Ok(report) =
            serde_json::from_slice::<stagehand_promoter::fanout::Spoiled>(&entry.value)
        else {
            continue;
        };
        let mut copy = None;
        for tier in &local {
            let copies = catalogue
                .replicas_on(tier, Some(node), None)
                .await
                .with_context(|| format!("the copies of node {node} on tier {tier}"))?;
            copy = copy.or(copies.into_iter().find(|r| {
                swarm.starts_with(&Fanout::swarm(&r.tier, &r.project, &r.dataset, &r.version))
            }));
        }
        let read_again = copy.as_ref().is_some_and(|r| {
            [
                r.last_verified.as_ref().map(|v| v.stamp.at),
                r.last_repaired.as_ref().map(|v| v.stamp.at),
                r.copied.as_ref().map(|c| c.at),
            ]
            .into_iter()
            .flatten()
            .any(|at| at > entry.created)
        });
        if read_again {
            continue;
        }
        let (version, run) = match &copy {
            Some(r) => {
                let short = r.version.get(..12).unwrap_or(&r.version);
                (
                    format!(
                        " ({}/{}@{short} on {}, its copy {})",
                        r.project,
                        r.dataset,
                        r.tier,
                        format!("{:?}", r.state).to_lowercase()
                    ),
                    format!(
                        "stagehand catalogue show {}@{short} --project {} (runbooks/{FANOUT_PEER_DROPPED_RUNBOOK})",
                        r.dataset, r.project
                    ),
                )
            }
            None => (
                " (no copy of it on that node in the catalogue)".to_owned(),
                format!("runbooks/{FANOUT_PEER_DROPPED_RUNBOOK}"),
            ),
        };
        findings.push(Finding {
            area: "fanout",
            subject: node.to_owned(),
            detail: format!(
                "node {node} served bad bytes in swarm {swarm}{version}: {}: {} (caught by {}, {} ago)",
                printable(&report.file),
                printable(&report.why),
                printable(caught_by),
                human_age(age(entry.created, now))
            ),
            run,
        });
    }
    Ok(())
}

/// The findings of the steps of `parts` whose offload is late.
pub fn late_offloads(
    parts: &[stagehand_catalogue::CheckpointPartRecord],
    deadline: Duration,
    now: OffsetDateTime,
    room: Option<&OffloadRoom>,
) -> Vec<Finding> {
    let mut runs: std::collections::BTreeMap<(&str, &str), Vec<_>> = Default::default();
    for p in parts {
        runs.entry((p.project.as_str(), p.run.as_str()))
            .or_default()
            .push(p.clone());
    }
    let mut out = Vec::new();
    for ((project, run), parts) in runs {
        for step in stagehand_catalogue::StepParts::of(&parts) {
            if !step.late(deadline, now) {
                continue;
            }
            let on: Vec<String> = step
                .on_node
                .iter()
                .map(|(part, node)| format!("part {part} on {node}"))
                .collect();
            // The largest part still on a node: the one a full tier keeps waiting longest.
            let largest = (parts.iter())
                .filter(|p| p.step == step.step && !p.is_offloaded())
                .map(|p| p.total_bytes)
                .max()
                .unwrap_or(0);
            let why = match room {
                Some(r) if largest > r.free => format!(
                    " — offload tier {} cannot fit it: {} free of {} bytes, a part needs {}; \
                     the agents retry as space frees (release finished stages, or raise its \
                     capacity in tiers.toml)",
                    r.tier, r.free, r.capacity, largest
                ),
                _ => String::new(),
            };
            out.push(Finding {
                area: "checkpoint",
                subject: format!("{project}/{run} step {}", step.step),
                detail: format!(
                    "offload late: {} of {} parts offloaded; on node NVMe only: {}{why}",
                    step.offloaded,
                    step.parts,
                    on.join(", ")
                ),
                run: format!("stagehand checkpoint list {run} --project {project}"),
            });
        }
    }
    out
}

/// The runbook page of a node whose agent is silent.
pub const NODE_LOST_RUNBOOK: &str = "node-lost.md";

/// Restore drills (`backup status`'s rule, [`crate::backup::version_status`]): a version
/// whose last drill failed needs a person; so does one backed up two drill intervals ago and
/// never drilled since (one interval is the copier's normal wait). Versions are read in
/// pages; at most [`LISTED`] of each kind become findings, all are counted.
async fn drills(
    catalogue: &Catalogue,
    policies: &stagehand_policy::Policies,
    now: OffsetDateTime,
    findings: &mut Vec<Finding>,
) -> anyhow::Result<Option<DrillLines>> {
    use crate::backup::{Flag, version_status};
    let Some(backup) = policies.backup() else {
        return Ok(None);
    };
    let grace = time::Duration::try_from(2 * backup.drill_every).unwrap_or(time::Duration::MAX);
    let mut lines = DrillLines {
        versions: 0,
        failed: 0,
        overdue: 0,
    };
    let mut after: Option<String> = None;
    loop {
        let page = catalogue
            .backup_status(
                None,
                None,
                true,
                Some(stagehand_catalogue::MAX_PAGE),
                after.as_deref(),
            )
            .await
            .context("the restore drills")?;
        for v in &page.items {
            let s = version_status(v);
            lines.versions += 1;
            let (count, run, what) = match (s.flag, s.last_backup) {
                (Some(Flag::DrillFailed), _) => (
                    &mut lines.failed,
                    "stagehand backup status --check (runbooks/drill-failed.md)",
                    "its last restore drill failed".to_owned(),
                ),
                (Some(Flag::NeverDrilled), Some(at)) if now - at > grace => (
                    &mut lines.overdue,
                    "stagehand backup status --check (runbooks/drill-overdue.md)",
                    format!(
                        "backed up {} ago and never drilled",
                        human_age(age(at, now))
                    ),
                ),
                _ => continue,
            };
            *count += 1;
            if *count <= u64::from(LISTED) {
                findings.push(Finding {
                    area: "drill",
                    subject: format!(
                        "{}/{}@{} on {}",
                        s.project,
                        s.dataset,
                        &s.version[..s.version.len().min(12)],
                        s.backup_tier.as_deref().unwrap_or("?")
                    ),
                    detail: what,
                    run: run.into(),
                });
            }
        }
        match page.next {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    Ok(Some(lines))
}

/// The human view: what needs a person first, each with what to run, then the summary.
pub fn text(r: &Report, out: &mut impl Write) -> std::io::Result<()> {
    if r.findings.is_empty() {
        writeln!(out, "nothing needs a person")?;
    } else {
        writeln!(out, "{} things need a person:", r.findings.len())?;
        for f in &r.findings {
            writeln!(out, "  {:<12} {}: {}", f.area, f.subject, f.detail)?;
            writeln!(out, "  {:<12} run: {}", "", f.run)?;
        }
    }
    writeln!(out, "services:")?;
    for s in &r.services {
        writeln!(
            out,
            "  {:<20} {:<16} {:<10} v{} on {}, beat {} ago, {} handled, {} restarts",
            s.service,
            s.instance,
            s.state,
            s.version,
            s.host,
            human_age(s.beat_seconds_ago),
            s.handled,
            s.restarts
        )?;
    }
    writeln!(out, "consumers:")?;
    for c in &r.consumers {
        writeln!(
            out,
            "  {:<24} {:<20} {} waiting, {} in flight, {} redelivered{}",
            c.stream,
            c.consumer,
            c.pending,
            c.ack_pending,
            c.redelivered,
            c.oldest_seconds
                .map(|s| format!(", oldest {}", human_age(s)))
                .unwrap_or_default()
        )?;
    }
    let c = r.stages.counts;
    writeln!(
        out,
        "stages: {} pending ({} copying), {} failed",
        c.pending, c.copying, c.failed
    )?;
    let waiting: u64 = r.dead_letters.iter().map(|d| d.waiting).sum();
    writeln!(out, "dead letters waiting: {waiting}")?;
    for t in &r.tiers {
        writeln!(
            out,
            "tier {}: {:.1} % used (high watermark {:.0} %)",
            t.tier,
            100.0 * t.counted as f64 / t.capacity.max(1) as f64,
            100.0 * t.high_watermark
        )?;
    }
    for d in &r.damaged {
        writeln!(out, "tier {}: {} damaged copies", d.tier, d.damaged)?;
    }
    if let Some(d) = &r.drills {
        writeln!(
            out,
            "restore drills: {} backed-up versions, {} failed, {} overdue",
            d.versions, d.failed, d.overdue
        )?;
    }
    writeln!(out, "catalogue problems: {}", r.problems)?;
    for n in &r.not_checked {
        writeln!(out, "not checked here: {n}")?;
    }
    Ok(())
}

/// Every operator action the catalogue keeps, newest first (`stagehand status --actions`).
pub async fn actions(
    catalogue: &Catalogue,
) -> anyhow::Result<Vec<stagehand_catalogue::OperatorActionRecord>> {
    let mut out = Vec::new();
    let mut after = None;
    loop {
        let answer = catalogue
            .ask(&stagehand_catalogue::Query::OperatorActions {
                limit: Some(stagehand_catalogue::MAX_PAGE),
                after: after.take(),
            })
            .await
            .context("the operator actions")?;
        let stagehand_catalogue::Answer::OperatorActions { actions, next } = answer else {
            anyhow::bail!("the catalogue answered something else than operator actions");
        };
        out.extend(actions);
        match next {
            Some(n) => after = Some(n),
            None => return Ok(out),
        }
    }
}

/// The text of `status --actions`: one line per action, newest first.
pub fn actions_text(
    actions: &[stagehand_catalogue::OperatorActionRecord],
    out: &mut impl Write,
) -> std::io::Result<()> {
    if actions.is_empty() {
        return writeln!(out, "no operator actions recorded");
    }
    writeln!(
        out,
        "{:<25} {:<18} {:<24} {:<16} {:<40} WHY",
        "WHEN", "ACTION", "BY", "PROJECT", "TARGET"
    )?;
    for a in actions {
        let at = a
            .stamp
            .at
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap_or_default();
        writeln!(
            out,
            "{at:<25} {:<18} {:<24} {:<16} {:<40} {}",
            a.action,
            a.by,
            a.project,
            a.target,
            if a.reason.is_empty() {
                "-"
            } else {
                a.reason.as_str()
            }
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_checkpoint_part_on_its_node_past_the_deadline_is_a_finding() {
        let now = OffsetDateTime::now_utc();
        let part = |part: u32, node: &str, minutes_ago: i64, offloaded: bool| {
            let stamp = stagehand_catalogue::Stamp {
                at: now - time::Duration::minutes(minutes_ago),
                event_id: stagehand_schemas::EventId::new(format!("e-{part}")).unwrap(),
            };
            stagehand_catalogue::CheckpointPartRecord {
                project: "lab".into(),
                run: "llm".into(),
                step: 7,
                part,
                parts: 2,
                node: node.into(),
                location: stagehand_schemas::Location {
                    tier: "local".into(),
                    prefix: format!("lab/ckpt-llm/step-7/part-{part}"),
                },
                files: vec![],
                total_bytes: 1,
                tags: vec![],
                committed: Some(stamp.clone()),
                offloaded_to: None,
                offloaded: offloaded.then_some(stamp),
                removed: None,
            }
        };
        let parts = [part(0, "n0", 40, true), part(1, "n1", 40, false)];
        let late = late_offloads(&parts, Duration::from_secs(15 * 60), now, None);
        assert_eq!(late.len(), 1);
        assert_eq!(late[0].subject, "lab/llm step 7");
        assert!(
            late[0].detail.contains("part 1 on n1") && !late[0].detail.contains("cannot fit"),
            "{}",
            late[0].detail
        );
        assert!(late_offloads(&parts, Duration::from_secs(3600), now, None).is_empty());
        // A bounded offload tier without room for the part says so.
        let full = OffloadRoom {
            tier: "hot".into(),
            free: 0,
            capacity: 10,
        };
        let late = late_offloads(&parts, Duration::from_secs(15 * 60), now, Some(&full));
        assert!(
            late[0].detail.contains("offload tier hot cannot fit it"),
            "{}",
            late[0].detail
        );
        let roomy = OffloadRoom { free: 10, ..full };
        let late = late_offloads(&parts, Duration::from_secs(15 * 60), now, Some(&roomy));
        assert!(!late[0].detail.contains("cannot fit"), "{}", late[0].detail);
    }

    /// The scrub is behind once its oldest copy waited past the period and two looks; the
    /// finding says the coverage and names the page.
    #[test]
    fn a_copy_unverified_past_its_period_and_two_looks_is_the_scrub_behind() {
        let now = OffsetDateTime::now_utc();
        let stamp = |seconds_ago: i64| stagehand_catalogue::Stamp {
            at: now - time::Duration::seconds(seconds_ago),
            event_id: stagehand_schemas::EventId::new(format!("e-{seconds_ago}")).unwrap(),
        };
        let copy = |made: i64, verified: Option<i64>| stagehand_catalogue::ReplicaRecord {
            project: "lab".into(),
            dataset: "owls".into(),
            version: "ab".repeat(32),
            tier: "source".into(),
            node: None,
            prefix: "lab/owls".into(),
            state: stagehand_catalogue::ReplicaState::Present,
            reason: None,
            stamp: Some(stamp(made)),
            files: 5,
            total_bytes: 100,
            verified_by: None,
            backup: false,
            copied: Some(stamp(made)),
            last_drill: None,
            last_verified: verified.map(|v| stagehand_catalogue::Verification {
                files: 5,
                total_bytes: 100,
                verified_by: "scrub".into(),
                stamp: stamp(v),
            }),
            last_repaired: None,
        };
        let tier = |oldest| stagehand_catalogue::TierScrub {
            tier: "source".into(),
            replicas: 2,
            bytes: 200,
            verified_replicas: 1,
            verified_bytes: 100,
            oldest: Some(oldest),
            damaged: vec![],
            damaged_total: 0,
            repaired_replicas: 0,
        };
        let (period, look) = (Duration::from_secs(60), Duration::from_secs(10));
        // Within the period and two looks: keeping up.
        assert!(scrub_behind(&tier(copy(3600, Some(75))), period, look, now).is_none());
        let behind = scrub_behind(&tier(copy(3600, Some(90))), period, look, now).unwrap();
        assert_eq!(behind.subject, "source");
        assert!(
            behind
                .detail
                .starts_with("scrub behind on tier source: coverage 50.0 % of period 1m;"),
            "{}",
            behind.detail
        );
        assert!(
            behind.run.contains("runbooks/scrub-behind.md"),
            "{}",
            behind.run
        );
        // Never verified: aged from its making.
        let never = scrub_behind(&tier(copy(90, None)), period, look, now).unwrap();
        assert!(never.detail.contains("never verified"), "{}", never.detail);
        assert!(scrub_behind(&tier(copy(30, None)), period, look, now).is_none());
    }

    /// A node whose replicas are offline or unheard is one finding naming its streams; a
    /// replica briefly not current while heard is not; a stream without a leader, or missing
    /// from the listing, is a finding of its own; a single server says nothing.
    #[test]
    fn a_nats_node_whose_replicas_are_behind_is_one_finding() {
        use async_nats::jetstream::stream::ClusterInfo;
        let cluster = |leader: Option<&str>, replicas: serde_json::Value| -> ClusterInfo {
            serde_json::from_value(serde_json::json!({
                "name": "stagehand", "leader": leader, "replicas": replicas
            }))
            .unwrap()
        };
        let secs = |s: u64| s * 1_000_000_000;
        let lost = serde_json::json!([
            {"name": "n2", "current": true, "active": secs(0), "offline": false},
            {"name": "n3", "current": false, "active": secs(30), "offline": true}
        ]);
        let busy = serde_json::json!([
            {"name": "n2", "current": false, "active": secs(1), "offline": false},
            {"name": "n3", "current": false, "active": secs(12), "offline": false}
        ]);
        let (facts, requests, kv) = (
            cluster(Some("n1"), lost.clone()),
            cluster(Some("n2"), busy),
            cluster(None, lost),
        );
        let single = cluster(Some("n1"), serde_json::json!([]));
        let names: Vec<String> = ["FACTS", "REQUESTS", "KV_claims", "OBJ_gone", "SOLO"]
            .map(String::from)
            .to_vec();
        let found = cluster_findings(
            &names,
            [
                ("FACTS", Some(&facts)),
                ("REQUESTS", Some(&requests)),
                ("KV_claims", Some(&kv)),
                ("SOLO", Some(&single)),
            ],
        );
        let said: Vec<(String, String)> = (found.iter())
            .map(|f| (f.subject.clone(), f.detail.clone()))
            .collect();
        assert_eq!(found.len(), 3, "{said:?}");
        assert_eq!(found[0].subject, "NATS node n3");
        assert!(
            found[0].detail.contains("of 2 streams")
                && found[0].detail.ends_with("FACTS, REQUESTS"),
            "{said:?}"
        );
        assert_eq!(found[1].subject, "stream KV_claims");
        assert!(found[1].detail.starts_with("it has no leader"), "{said:?}");
        assert_eq!(found[2].subject, "stream OBJ_gone");
        assert!(
            found[2].detail.starts_with("its leader did not answer"),
            "{said:?}"
        );
        assert!(
            found
                .iter()
                .all(|f| f.area == "nats" && f.run == "runbooks/nats-node-lost.md")
        );
        // A single server, and a cluster all current: nothing.
        assert!(cluster_findings(&names[4..], [("SOLO", Some(&single))]).is_empty());
    }

    /// A fan-out report reaches the terminal without the escapes an agent could put in it.
    #[test]
    fn a_fan_out_report_is_printed_without_control_characters() {
        assert_eq!(printable("part/1.bin\x1b[2J\n\r"), "part/1.bin[2J");
    }

    #[test]
    fn ages_read_as_on_call_reads_them() {
        assert_eq!(human_age(45), "45s");
        assert_eq!(human_age(12 * 60), "12m");
        assert_eq!(human_age(3 * 3600), "3h");
        assert_eq!(human_age(3 * 86_400), "3d");
    }
}
