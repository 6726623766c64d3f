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
//!   `runbooks/node-lost.md`), and the facts the catalogue could not fold.
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
    /// `service`, `consumer`, `stage`, `dead_letters`, `tier`, `quota`, `replica`, `node`,
    /// `drill`, `checkpoint` or `catalogue`.
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
        unreachable_nodes(catalogue, policies, &mut findings).await?;
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
                // The first message not acknowledged follows the ack floor; one that is gone
                // (deleted, or not of this consumer's subjects) leaves the age unknown.
                stream
                    .get_raw_message(info.ack_floor.stream_sequence + 1)
                    .await
                    .ok()
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
            run: stage_command(s),
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
                (stagehand_policy::TierKind::Posix { root }, true) => {
                    rustix::fs::statvfs(root).ok().map(|s| FsUsage {
                        total: s.f_blocks.saturating_mul(s.f_frsize),
                        avail: s.f_bavail.saturating_mul(s.f_frsize),
                    })
                }
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
    for tier in policies.tiers().keys() {
        let s = catalogue
            .scrub_status(tier, now, Some(LISTED))
            .await
            .with_context(|| format!("the damaged copies on tier {tier}"))?;
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

    #[test]
    fn ages_read_as_on_call_reads_them() {
        assert_eq!(human_age(45), "45s");
        assert_eq!(human_age(12 * 60), "12m");
        assert_eq!(human_age(3 * 3600), "3h");
        assert_eq!(human_age(3 * 86_400), "3d");
    }
}
