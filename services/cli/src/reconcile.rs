//! `stagehand stage reconcile --scheduler slurm|kubernetes`: releases the stages still held
//! whose job the scheduler no longer runs, so their data stops being held for ever.
//!
//! A job's stages are released by its own end (Slurm's `slurm_bb_job_teardown`, a pod's owner).
//! When that never happens — on Slurm 22.05 a `scancel` during stage-in can race the teardown,
//! and slurmctld kills the teardown script and never retries it — the stage stays held, with no
//! time limit on 22.05. Run periodically (a systemd timer, `deploy/systemd`), this lists the
//! stages still held (`stagehand_stages`, every project or the ones named), asks the scheduler
//! about their jobs, and releases those whose job has ended or is gone, with a reason that says
//! who released it and why (the stage's status shows it).
//!
//! - **Slurm**: the job ids the hooks write are
//!   `<STAGEHAND_JOB_PREFIX><Slurm job id>[.r<N>][.a<N>]` (`deploy/slurm/burst_buffer.lua`);
//!   stages of other ids are not this cluster's and are left alone. `squeue` (every state, so
//!   recently finished jobs show with their end state) says which jobs slurmctld knows; a job
//!   it does not know is asked of `sacct` for how it ended.
//!   A job pending, running or in any other live state keeps its stages.
//! - **Kubernetes**: the init container's job id is the pod's uid (`deploy/k8s`); `kubectl get
//!   pods --all-namespaces` lists the pods there are. A pod that is `Succeeded` or `Failed`, or
//!   no longer exists, releases its stages.
//!
//! A scheduler that cannot be asked (the command fails or is missing) is "do nothing": no stage
//! is released on a guess, and the command exits 69.

use std::collections::BTreeMap;
use std::process::Command;

use anyhow::Context as _;
use serde::Serialize;
use stagehand_bus::Bus;
use stagehand_schemas::{Body, Event, EventId, StageReleased};

use crate::args::Unreachable;
use crate::stage::StageStatus;

/// Which scheduler's jobs the stages belong to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scheduler {
    /// Job ids `<job_prefix><Slurm job id>[.r<N>][.a<N>]`.
    Slurm { job_prefix: String },
    /// Job ids are pod uids.
    Kubernetes,
}

impl Scheduler {
    fn name(&self) -> &'static str {
        match self {
            Scheduler::Slurm { .. } => "Slurm",
            Scheduler::Kubernetes => "Kubernetes",
        }
    }
}

/// What the scheduler says about a job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fate {
    /// It still runs (or waits): its stages stay.
    Live,
    /// It ended or is gone, for this reason: its stages are released.
    Ended(String),
}

/// The Slurm job id a stage's job id names, if it is one of this cluster's
/// (`<prefix><digits>`, optionally `.r<restarts>`, then optionally `.a<attempt>`: the run of a
/// job requeued N times, and the attempt asked after a stage of it failed).
pub fn slurm_job(prefix: &str, job: &str) -> Option<u64> {
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let rest = job.strip_prefix(prefix)?;
    let rest = match rest.rsplit_once(".a") {
        Some((run, attempt)) if digits(attempt) => run,
        Some(_) => return None,
        None => rest,
    };
    let id = match rest.split_once(".r") {
        Some((id, restarts)) if digits(restarts) => id,
        Some(_) => return None,
        None => rest,
    };
    digits(id).then(|| id.parse().ok()).flatten()
}

/// Job id → state from `squeue -h -a -t all -o '%A|%T'` (or `sacct -n -P -X -o JobIDRaw,State`,
/// whose state may carry a suffix such as `CANCELLED by 0`): lines that do not parse are
/// skipped.
pub fn parse_job_states(out: &str) -> BTreeMap<u64, String> {
    out.lines()
        .filter_map(|line| {
            let (id, state) = line.trim().split_once('|')?;
            let id = id.trim().parse().ok()?;
            let state = state.split_whitespace().next()?.trim_end_matches('+');
            Some((id, state.to_owned()))
        })
        .collect()
}

/// Whether a Slurm job state is an end: the job will never run (again) in this run.
pub fn slurm_state_ended(state: &str) -> bool {
    matches!(
        state,
        "BOOT_FAIL"
            | "CANCELLED"
            | "COMPLETED"
            | "DEADLINE"
            | "FAILED"
            | "NODE_FAIL"
            | "OUT_OF_MEMORY"
            | "PREEMPTED"
            | "REVOKED"
            | "TIMEOUT"
    )
}

/// The fate of Slurm job `job` from what `squeue` listed and, for a job it did not list, what
/// `sacct` said (`None`: accounting could not be asked).
pub fn slurm_fate(
    job: u64,
    squeue: &BTreeMap<u64, String>,
    sacct: Option<&BTreeMap<u64, String>>,
) -> Fate {
    if let Some(state) = squeue.get(&job) {
        return if slurm_state_ended(state) {
            Fate::Ended(format!("Slurm job {job} is {state}"))
        } else {
            Fate::Live
        };
    }
    // slurmctld knows every job that is pending or running: one it does not know has ended.
    match sacct.and_then(|s| s.get(&job)) {
        Some(state) if !slurm_state_ended(state) => Fate::Ended(format!(
            "Slurm job {job} is gone from slurmctld (accounting last recorded {state})"
        )),
        Some(state) => Fate::Ended(format!("Slurm job {job} ended {state}")),
        None => Fate::Ended(format!("Slurm job {job} is unknown to slurmctld")),
    }
}

/// Whether `job` is a pod uid (a lowercase RFC 4122 UUID, as `metadata.uid`).
pub fn is_pod_uid(job: &str) -> bool {
    let parts: Vec<&str> = job.split('-').collect();
    parts.len() == 5
        && parts
            .iter()
            .zip([8, 4, 4, 4, 12])
            .all(|(p, n)| p.len() == n && p.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
}

/// Pod uid → phase from `kubectl get pods --all-namespaces -o jsonpath=…` lines
/// `<uid>\t<phase>\t<namespace>/<name>`: lines that do not parse are skipped.
pub fn parse_pods(out: &str) -> BTreeMap<String, (String, String)> {
    out.lines()
        .filter_map(|line| {
            let mut fields = line.trim().split('\t');
            let uid = fields.next()?.trim();
            let phase = fields.next()?.trim();
            let name = fields.next().unwrap_or("").trim();
            is_pod_uid(uid).then(|| (uid.to_owned(), (phase.to_owned(), name.to_owned())))
        })
        .collect()
}

/// The fate of the pod with uid `uid` from the pods listed.
pub fn pod_fate(uid: &str, pods: &BTreeMap<String, (String, String)>) -> Fate {
    match pods.get(uid) {
        Some((phase, name)) if phase == "Succeeded" || phase == "Failed" => {
            Fate::Ended(format!("pod {name} ({uid}) is {phase}"))
        }
        Some(_) => Fate::Live,
        None => Fate::Ended(format!("pod {uid} no longer exists")),
    }
}

/// Runs a scheduler command; its stdout, or why the scheduler cannot be asked.
fn ask(program: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .map_err(|e| format!("{program}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{program} {}: exit {:?}: {}",
            args.join(" "),
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The fate of each job of `jobs` (stage job ids) the scheduler knows to be this cluster's;
/// an `Err` when the scheduler cannot be asked.
fn fates(scheduler: &Scheduler, jobs: &[&str]) -> Result<BTreeMap<String, Fate>, String> {
    let mut out = BTreeMap::new();
    match scheduler {
        Scheduler::Slurm { job_prefix } => {
            let ids: BTreeMap<&str, u64> = jobs
                .iter()
                .filter_map(|j| slurm_job(job_prefix, j).map(|id| (*j, id)))
                .collect();
            if ids.is_empty() {
                return Ok(out);
            }
            let squeue =
                parse_job_states(&ask("squeue", &["-h", "-a", "-t", "all", "-o", "%A|%T"])?);
            let unknown: Vec<String> = ids
                .values()
                .filter(|id| !squeue.contains_key(id))
                .map(u64::to_string)
                .collect();
            let sacct = if unknown.is_empty() {
                None
            } else {
                let list = unknown.join(",");
                // Without accounting (no slurmdbd) the job's absence from slurmctld decides.
                ask(
                    "sacct",
                    &["-n", "-P", "-X", "-j", &list, "-o", "JobIDRaw,State"],
                )
                .ok()
                .map(|o| parse_job_states(&o))
            };
            for (job, id) in ids {
                out.insert(job.to_owned(), slurm_fate(id, &squeue, sacct.as_ref()));
            }
        }
        Scheduler::Kubernetes => {
            let uids: Vec<&str> = jobs.iter().copied().filter(|j| is_pod_uid(j)).collect();
            if uids.is_empty() {
                return Ok(out);
            }
            let pods = parse_pods(&ask(
                "kubectl",
                &[
                    "get",
                    "pods",
                    "--all-namespaces",
                    "-o",
                    "jsonpath={range .items[*]}{.metadata.uid}{\"\\t\"}{.status.phase}{\"\\t\"}{.metadata.namespace}/{.metadata.name}{\"\\n\"}{end}",
                ],
            )?);
            for uid in uids {
                out.insert(uid.to_owned(), pod_fate(uid, &pods));
            }
        }
    }
    Ok(out)
}

/// Every stage still held now, of the projects named (all when none).
pub async fn held(bus: &Bus, projects: &[String]) -> anyhow::Result<Vec<StageStatus>> {
    let mut stored = Vec::new();
    if projects.is_empty() {
        stored = crate::stage::stored_statuses(bus, None).await?;
    }
    for project in projects {
        stored.extend(crate::stage::stored_statuses(bus, Some(project)).await?);
    }
    let now = stagehand_schemas::event::now();
    let mut found: Vec<StageStatus> = stored.into_iter().filter(|s| s.holds_at(now)).collect();
    found.sort_by(|a, b| (&a.project, &a.job_id).cmp(&(&b.project, &b.job_id)));
    Ok(found)
}

/// One stage the reconciler released (or, with `dry_run`, would release).
#[derive(Debug, Clone, Serialize)]
pub struct Released {
    pub project: String,
    pub dataset: String,
    pub version: String,
    pub tier: String,
    pub node: Option<String>,
    pub job_id: String,
    pub request_id: EventId,
    pub reason: String,
}

impl Released {
    /// One line for a person.
    pub fn line(&self) -> String {
        let node = self
            .node
            .as_deref()
            .map(|n| format!(" on node {n}"))
            .unwrap_or_default();
        format!(
            "{}/{}@{} on {}{node} for job {}: {}",
            self.project, self.dataset, self.version, self.tier, self.job_id, self.reason
        )
    }
}

/// The release a reconciler publishes for a stage: the request's own words for the stage (so
/// it names the same request), and an id of its own, derived from the request's, so that it is
/// never taken for the job's teardown release (which may still come) nor dropped as one.
pub fn release_event(status: &StageStatus, reason: &str) -> Event {
    Event::request(
        EventId::derive(&status.request_id, "release:reconciled"),
        status.project.clone(),
        Body::StageReleased(StageReleased {
            dataset: status.dataset.clone(),
            version: status.version.clone(),
            tier: status.tier.clone(),
            job_id: status.job_id.clone(),
            node: status.node.clone(),
            reason: Some(reason.to_owned()),
        }),
    )
}

/// Who the reconciler is, for the reason a release carries.
fn who(scheduler: &Scheduler) -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_else(|_| "this host".into());
    format!(
        "released by `stagehand stage reconcile --scheduler {}` on {host}",
        scheduler.name().to_lowercase()
    )
}

/// Releases every held stage of `projects` whose job the scheduler says has ended; with
/// `dry_run` only says which. An `Err` of [`Unreachable`] when the scheduler cannot be asked
/// (then nothing is released).
pub async fn reconcile(
    bus: &Bus,
    scheduler: &Scheduler,
    projects: &[String],
    dry_run: bool,
) -> anyhow::Result<Vec<Released>> {
    let stages = held(bus, projects).await?;
    let jobs: Vec<&str> = stages.iter().map(|s| s.job_id.as_str()).collect();
    let scheduler_ = scheduler.clone();
    let jobs_owned: Vec<String> = jobs.iter().map(|j| (*j).to_owned()).collect();
    let fates = tokio::task::spawn_blocking(move || {
        let jobs: Vec<&str> = jobs_owned.iter().map(String::as_str).collect();
        fates(&scheduler_, &jobs)
    })
    .await
    .context("asking the scheduler")?
    .map_err(|why| {
        anyhow::Error::from(Unreachable(format!(
            "{} cannot be asked about the jobs of held stages, so none is released: {why}",
            scheduler.name()
        )))
    })?;
    let by = who(scheduler);
    let mut released = Vec::new();
    for status in &stages {
        let Some(Fate::Ended(why)) = fates.get(&status.job_id) else {
            continue;
        };
        let reason = format!("{by}: {why}, and its stages were never released");
        if !dry_run {
            bus.publish(&release_event(status, &reason))
                .await
                .with_context(|| {
                    format!(
                        "publishing the release of {}/{}@{} for job {}",
                        status.project, status.dataset, status.version, status.job_id
                    )
                })?;
        }
        released.push(Released {
            project: status.project.clone(),
            dataset: status.dataset.clone(),
            version: status.version.clone(),
            tier: status.tier.clone(),
            node: status.node.clone(),
            job_id: status.job_id.clone(),
            request_id: status.request_id.clone(),
            reason,
        });
    }
    Ok(released)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slurm_job_ids_are_parsed_from_this_clusters_prefix_only() {
        assert_eq!(slurm_job("slurm-", "slurm-42"), Some(42));
        assert_eq!(slurm_job("slurm-", "slurm-42.r3"), Some(42));
        assert_eq!(slurm_job("slurm-a-", "slurm-b-42"), None);
        assert_eq!(slurm_job("slurm-", "slurm-"), None);
        assert_eq!(slurm_job("slurm-", "slurm-42.r"), None);
        assert_eq!(slurm_job("slurm-", "slurm-42.a2"), Some(42));
        assert_eq!(slurm_job("slurm-", "slurm-42.r3.a1"), Some(42));
        assert_eq!(slurm_job("slurm-", "slurm-42.a1.r3"), None);
        assert_eq!(slurm_job("slurm-", "slurm-42.a"), None);
        assert_eq!(slurm_job("slurm-", "slurm-4x2"), None);
        assert_eq!(
            slurm_job("slurm-", "9c6b2a52-1f0e-4c4a-9d7a-0b1c2d3e4f50"),
            None
        );
    }

    #[test]
    fn squeue_and_sacct_lines_are_read_with_their_states() {
        let states = parse_job_states("12|PENDING\n13|CANCELLED by 0\n 14|COMPLETED+\nnoise\n");
        assert_eq!(states.get(&12).map(String::as_str), Some("PENDING"));
        assert_eq!(states.get(&13).map(String::as_str), Some("CANCELLED"));
        assert_eq!(states.get(&14).map(String::as_str), Some("COMPLETED"));
        assert_eq!(states.len(), 3);
    }

    #[test]
    fn a_slurm_job_keeps_its_stages_while_it_lives_and_releases_them_once_ended_or_gone() {
        let squeue = parse_job_states("1|PENDING\n2|RUNNING\n3|CANCELLED\n4|COMPLETING\n");
        let sacct = parse_job_states("5|TIMEOUT\n6|RUNNING\n");
        assert_eq!(slurm_fate(1, &squeue, Some(&sacct)), Fate::Live);
        assert_eq!(slurm_fate(2, &squeue, Some(&sacct)), Fate::Live);
        assert_eq!(slurm_fate(4, &squeue, Some(&sacct)), Fate::Live);
        assert!(matches!(slurm_fate(3, &squeue, None), Fate::Ended(w) if w.contains("CANCELLED")));
        assert!(
            matches!(slurm_fate(5, &squeue, Some(&sacct)), Fate::Ended(w) if w.contains("TIMEOUT"))
        );
        assert!(
            matches!(slurm_fate(6, &squeue, Some(&sacct)), Fate::Ended(w) if w.contains("gone from slurmctld"))
        );
        assert!(
            matches!(slurm_fate(7, &squeue, None), Fate::Ended(w) if w.contains("unknown to slurmctld"))
        );
    }

    #[test]
    fn pod_uids_and_phases_are_read_and_decide() {
        let live = "9c6b2a52-1f0e-4c4a-9d7a-0b1c2d3e4f50";
        let done = "0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d";
        let failed = "11111111-2222-4333-8444-555555555555";
        assert!(is_pod_uid(live));
        assert!(!is_pod_uid("slurm-42"));
        assert!(!is_pod_uid("9C6B2A52-1F0E-4C4A-9D7A-0B1C2D3E4F50"));
        let pods = parse_pods(&format!(
            "{live}\tRunning\tlab/train-0\n{done}\tSucceeded\tlab/train-1\n{failed}\tFailed\tlab/train-2\nbad line\n"
        ));
        assert_eq!(pods.len(), 3);
        assert_eq!(pod_fate(live, &pods), Fate::Live);
        assert!(
            matches!(pod_fate(done, &pods), Fate::Ended(w) if w.contains("lab/train-1") && w.contains("Succeeded"))
        );
        assert!(matches!(pod_fate(failed, &pods), Fate::Ended(w) if w.contains("Failed")));
        assert!(matches!(
            pod_fate("22222222-2222-4333-8444-555555555555", &pods),
            Fate::Ended(w) if w.contains("no longer exists")
        ));
    }

    #[test]
    fn a_reconciler_release_names_the_request_and_says_why() {
        let status: StageStatus = serde_json::from_value(serde_json::json!({
            "request_id": "r1",
            "project": "lab",
            "dataset": "cats",
            "version": "5f2c9a0e11b34d7a",
            "resolved_version": null,
            "tier": "hot",
            "node": null,
            "job_id": "slurm-42",
            "state": "pending",
            "updated_at": "2026-12-01T00:00:00Z",
        }))
        .unwrap();
        let event = release_event(&status, "because");
        let Body::StageReleased(r) = &event.body else {
            panic!("{event:?}")
        };
        assert_eq!(r.version, "5f2c9a0e11b34d7a");
        assert_eq!(r.job_id, "slurm-42");
        assert_eq!(r.reason.as_deref(), Some("because"));
        assert!(r.names_version("5f2c9a0e11b34d7a"));
        assert_ne!(
            event.id,
            EventId::for_stage_release("lab", "slurm-42", "cats", "5f2c9a0e11b34d7a", "hot", None)
        );
    }
}
