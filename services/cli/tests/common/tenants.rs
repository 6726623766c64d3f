//! Two tenants on one Stagehand, for the hostile-tenant tests: a real nats-server with the
//! shipped accounts config extended to a second project, [`VICTIM`] (its users and the
//! services' grants on its upload bucket), every service of `stagehand up` running in-process
//! as its own NATS user, posix tiers under a temporary home.
//!
//! The victim does what a project does — ingests a dataset, commits a checkpoint, stages the
//! version for a job and releases it — each step through the code path its command runs, as
//! its own users (`uploader-labb`, `trainer-labb`, the shared `scheduler`). A test first
//! [`Plan`]s the victim's next round (its names, hence every id it will use, are public), lets
//! the attacker publish, then plays the round ([`Tenants::victim_round`]) and checks what the
//! attacker could read ([`Tenants::leaks`]) and what it could change ([`KvSnapshot`]).
//!
//! The services run on a runtime of their own, so one stack can serve every test of a binary
//! ([`Tenants::shared`]) while each test runs on its own runtime; a test whose attack could
//! break the stack for everyone else starts its own ([`Tenants::start`]).

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use futures::StreamExt;
use stagehand::ingest::{IngestOptions, IngestReport, Outcome};
use stagehand::stage::{
    RequestOptions, STAGES_BUCKET, Stage, StageState, StageStatus, WaitOutcome,
};
use stagehand::up::{SERVICES, UpEnv};
use stagehand_bus::{Bus, BusConfig, CancellationToken};
use stagehand_catalogue::{Answer, Query, Readiness, ReadinessKey};
use stagehand_schemas::{Body, Event, EventId, FileRef, sha256_hex, version_digest};
use stagehand_testkit::{
    NatsServer, accounts_conf_with_projects, user_url, wait_for, with_test_host_limits,
};

/// The project whose data the attacker goes after.
pub const VICTIM: &str = "labb";

/// The attacking project: the one the shipped accounts config declares.
pub const ATTACKER: &str = stagehand_testkit::SHIPPED_PROJECT;

/// Bound on each step of the victim's round (an ingest of two small files, a stage of them):
/// ample for a loaded machine, and what a suppressed step costs before it is reported.
pub const STEP: Duration = Duration::from_secs(45);

/// The shared stack's bound on a catalogue answer.
const ASK: Duration = Duration::from_secs(10);

/// The NATS user and the role (the password variable's name) of a project's uploader.
pub fn uploader(project: &str) -> (String, String) {
    (
        format!("uploader-{project}"),
        format!("UPLOADER_{}", project.to_ascii_uppercase()),
    )
}

/// The NATS user and role of a project's training jobs.
pub fn trainer(project: &str) -> (String, String) {
    (
        format!("trainer-{project}"),
        format!("TRAINER_{}", project.to_ascii_uppercase()),
    )
}

/// The NATS user and role of the shared scheduler.
pub fn scheduler() -> (String, String) {
    ("scheduler".into(), "SCHEDULER".into())
}

/// The NATS user and role of a project's own scheduler (the Kubernetes init containers of its
/// namespace).
pub fn project_scheduler(project: &str) -> (String, String) {
    (
        format!("scheduler-{project}"),
        format!("SCHEDULER_{}", project.to_ascii_uppercase()),
    )
}

/// The role of a service's user: its name in capitals, `-` as `_`.
fn service_role(service: &str) -> String {
    service.to_ascii_uppercase().replace('-', "_")
}

/// Stagehand with two tenants. Dropping it stops the services and the server.
pub struct Tenants {
    pub server: NatsServer,
    pub home: tempfile::TempDir,
    pub policies: PathBuf,
    /// The accounts config the server runs with.
    pub accounts: String,
    stop: CancellationToken,
    runtime: Option<tokio::runtime::Runtime>,
    services: Vec<(&'static str, tokio::task::JoinHandle<anyhow::Result<()>>)>,
}

impl Drop for Tenants {
    fn drop(&mut self) {
        self.stop.cancel();
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

static SHARED: tokio::sync::OnceCell<Tenants> = tokio::sync::OnceCell::const_new();

impl Tenants {
    /// The stack every test of this binary shares, started by the first that asks.
    pub async fn shared() -> &'static Tenants {
        SHARED
            .get_or_init(|| async {
                Tenants::start()
                    .await
                    .unwrap_or_else(|e| panic!("starting the two-tenant stack: {e:#}"))
            })
            .await
    }

    /// A stack of its own, for a test whose attack, if it succeeds, breaks Stagehand for
    /// every project (a bucket key overwritten).
    pub async fn start() -> anyhow::Result<Tenants> {
        Tenants::start_declaring(&[VICTIM]).await
    }

    /// A stack whose accounts config declares `declared` besides the shipped project, each
    /// provisioned. [`VICTIM`]'s passwords are set all the same, so that a test may declare
    /// it later ([`Tenants::declare`]), as an operator adds a project.
    pub async fn start_declaring(declared: &[&str]) -> anyhow::Result<Tenants> {
        let _ = tracing_subscriber::fmt()
            .with_env_filter("warn")
            .with_test_writer()
            .try_init();
        let accounts = accounts_conf_with_projects(declared);
        let server = NatsServer::builder()
            .shipped_accounts_with_projects(declared)
            .role_passwords(&accounts_conf_with_projects(&[VICTIM]))
            .start();
        let home = tempfile::Builder::new()
            .prefix("stagehand-tenants-")
            .tempdir()?;
        std::fs::set_permissions(home.path(), std::fs::Permissions::from_mode(0o755))?;
        let policies = home.path().join("policies");
        stagehand::up::write_default_policies(&policies, home.path())?;
        let loaded = stagehand_policy::Policies::load_dir_with_home(&policies, home.path())?;
        for tier in loaded.tiers().values() {
            tier.create_root()
                .with_context(|| format!("creating the root of tier {}", tier.name))?;
        }
        // The operator provisions, both projects' upload buckets included, with the command
        // an operator runs.
        let operator = user_url(&server, "operator", "OPERATOR");
        let mut provision = vec!["provision", "--project", ATTACKER];
        for project in declared {
            provision.extend(["--project", project]);
        }
        let out = stagehand(&operator, &provision)?;
        ensure!(out.status.success(), "provision: {}", said(&out));

        // Each service as its own user, checking rather than managing streams, as the shipped
        // service configurations run them.
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("tenants-services")
            .enable_all()
            .build()?;
        let stop = CancellationToken::new();
        let services = {
            let _entered = runtime.enter();
            SERVICES
                .iter()
                .map(|(name, start)| {
                    let mut bus = BusConfig::new(user_url(&server, name, &service_role(name)));
                    bus.provision = false;
                    let env = UpEnv {
                        home: home.path().to_owned(),
                        policies: policies.clone(),
                        bus,
                    };
                    (*name, start(&env, stop.clone()))
                })
                .collect()
        };
        let tenants = Tenants {
            server,
            home,
            policies,
            accounts,
            stop,
            runtime: Some(runtime),
            services,
        };
        let bus = tenants.operator().await?;
        wait_for(Duration::from_secs(90), "the catalogue to answer", || {
            let client = bus.client().clone();
            async move {
                let q = Query::DeadLetters {
                    limit: Some(1),
                    after: None,
                };
                stagehand_catalogue::ask(&client, &q, Duration::from_millis(500))
                    .await
                    .ok()
            }
        })
        .await
        .map_err(|e| anyhow::anyhow!("{e}; {}", tenants.health()))?;
        Ok(tenants)
    }

    /// Declares `projects` besides the shipped one in the server's accounts config and has the
    /// server reload it, as step 1 of runbooks/new-project.md says; an error the server logged
    /// while reloading is returned.
    pub fn declare(&mut self, projects: &[&str]) -> anyhow::Result<()> {
        let accounts = accounts_conf_with_projects(projects);
        self.server
            .reload_config_text(&with_test_host_limits(&accounts))
            .map_err(|e| anyhow::anyhow!("declaring projects {projects:?}: {e}"))?;
        self.accounts = accounts;
        Ok(())
    }

    /// The services that stopped (each stops only on an error), for failure messages.
    pub fn health(&self) -> String {
        let stopped: Vec<&str> = self
            .services
            .iter()
            .filter(|(_, task)| task.is_finished())
            .map(|(name, _)| *name)
            .collect();
        if stopped.is_empty() {
            "every service runs".into()
        } else {
            format!("stopped: {}", stopped.join(", "))
        }
    }

    /// A URL that connects as `user`.
    pub fn url(&self, (user, role): &(String, String)) -> String {
        user_url(&self.server, user, role)
    }

    /// A connection as `user`, which checks rather than manages streams.
    pub async fn bus_as(&self, who: &(String, String)) -> anyhow::Result<Bus> {
        let mut cfg = BusConfig::new(self.url(who));
        cfg.provision = false;
        cfg.connect_timeout = Duration::from_secs(10);
        Ok(Bus::connect(&cfg).await?)
    }

    /// The operator's connection: it may read everything.
    pub async fn operator(&self) -> anyhow::Result<Bus> {
        self.bus_as(&("operator".into(), "OPERATOR".into())).await
    }

    /// The root of a tier.
    pub fn tier(&self, name: &str) -> PathBuf {
        self.home.path().join("tiers").join(name)
    }

    /// The catalogue's answer to `query`, asked as the operator.
    pub async fn ask(&self, bus: &Bus, query: &Query) -> anyhow::Result<Answer> {
        Ok(stagehand_catalogue::ask(bus.client(), query, ASK).await?)
    }

    /// Runs `stagehand checkpoint commit` as `project`'s training jobs.
    pub fn commit_checkpoint(
        &self,
        project: &str,
        run: &str,
        step: u64,
        dir: &Path,
    ) -> anyhow::Result<Output> {
        stagehand(
            &self.url(&trainer(project)),
            &[
                "checkpoint",
                "commit",
                "--project",
                project,
                "--run",
                run,
                "--step",
                &step.to_string(),
                "--policies",
                self.policies.to_str().context("a UTF-8 home")?,
                "--complete",
                "--json",
                dir.to_str().context("a UTF-8 home")?,
            ],
        )
    }

    /// What `stagehand ingest --wait` does, as `project`'s uploader: places `files` on the
    /// source tier, publishes the request and waits for the verdict.
    pub async fn ingest(
        &self,
        project: &str,
        dataset: &str,
        files: &[(String, Vec<u8>)],
    ) -> anyhow::Result<IngestReport> {
        let folder = tempfile::tempdir()?;
        for (path, bytes) in files {
            let at = folder.path().join(path);
            std::fs::create_dir_all(at.parent().context("a file has a folder")?)?;
            std::fs::write(at, bytes)?;
        }
        let who = uploader(project);
        let bus = self.bus_as(&who).await?;
        let opts = IngestOptions {
            source: folder
                .path()
                .to_str()
                .context("a UTF-8 temp path")?
                .to_owned(),
            in_place: false,
            project: project.into(),
            dataset: dataset.into(),
            tier: "source".into(),
            policies: self.policies.clone(),
            requested_by: who.0,
            labels: Vec::new(),
            manifest: None,
            wait: Some(STEP),
            progress: false,
            clock_skew: stagehand::ingest::CLOCK_SKEW,
            spool: None,
        };
        stagehand::ingest::ingest(&bus, &opts).await
    }

    /// Asks, as the shared scheduler, for `stage` and waits for its answer within [`STEP`].
    pub async fn stage(
        &self,
        stage: &Stage,
        deadline: Option<Duration>,
    ) -> anyhow::Result<WaitOutcome> {
        let bus = self.bus_as(&scheduler()).await?;
        let opts = RequestOptions {
            requested_by: "scheduler".into(),
            deadline: deadline.map(|d| stagehand_schemas::event::now() + d),
            ..Default::default()
        };
        stagehand::stage::request(&bus, stage, &opts).await?;
        stagehand::stage::wait(&bus, stage, STEP).await
    }

    /// The status the recorder keeps for `stage`, once it satisfies `pred` (within [`STEP`]).
    pub async fn stage_status_where(
        &self,
        stage: &Stage,
        what: &str,
        pred: impl Fn(&StageStatus) -> bool,
    ) -> anyhow::Result<StageStatus> {
        let bus = self.operator().await?;
        let kv = bus.jetstream().get_key_value(STAGES_BUCKET).await?;
        let key = stage.status_key();
        let last = std::sync::Mutex::new(None);
        let found = wait_for(STEP, what, || async {
            let value = kv.get(key.clone()).await.ok().flatten()?;
            let status: StageStatus = serde_json::from_slice(&value).ok()?;
            let hit = pred(&status).then(|| status.clone());
            *last.lock().unwrap_or_else(|p| p.into_inner()) = Some(status);
            hit
        })
        .await;
        found.map_err(|e| {
            let last = last.lock().unwrap_or_else(|p| p.into_inner()).clone();
            anyhow::anyhow!("{e}; its last status: {last:?}")
        })
    }

    /// The victim's round: its next ingest is validated and catalogued, its next checkpoint
    /// committed and catalogued, its next stage request becomes ready with its own bytes and
    /// its release releases, and every fact of the round is in the facts stream and folded.
    pub async fn victim_round(&self, plan: &Plan) -> anyhow::Result<()> {
        let operator = self.operator().await?;
        // The ingest: validated, under the version its bytes name.
        let report = self
            .ingest(VICTIM, &plan.dataset, &plan.files)
            .await
            .context("the victim's ingest")?;
        match &report.outcome {
            Some(Outcome::Validated(v)) if v.version == plan.version => {}
            other => bail!(
                "the victim's ingest of {} (request {}) was not validated: outcome {other:?} \
                 (stored as new: {})",
                plan.dataset,
                report.request.id,
                report.published_new
            ),
        }
        self.catalogued(&operator, plan).await?;

        // A checkpoint of its run.
        let dir = self
            .tier("hot")
            .join(VICTIM)
            .join("runs")
            .join(&plan.run)
            .join(format!("step-{}", plan.step));
        std::fs::create_dir_all(&dir)?;
        for (path, bytes) in &plan.checkpoint_files {
            std::fs::write(dir.join(path), bytes)?;
        }
        let out = self.commit_checkpoint(VICTIM, &plan.run, plan.step, &dir)?;
        ensure!(
            out.status.success(),
            "the victim's checkpoint commit: {}",
            said(&out)
        );
        let run = plan.run.clone();
        let step = plan.step;
        wait_for(STEP, "the victim's checkpoint in the catalogue", || async {
            let q = Query::Checkpoints {
                project: VICTIM.into(),
                run: run.clone(),
                limit: None,
                after: None,
            };
            match self.ask(&operator, &q).await.ok()? {
                Answer::Checkpoints { checkpoints, .. } => {
                    checkpoints.iter().any(|c| c.step == step).then_some(())
                }
                _ => None,
            }
        })
        .await
        .with_context(|| {
            format!(
                "checkpoint {} step {step} of the victim (fact {})",
                plan.run,
                plan.checkpoint_id()
            )
        })?;

        // The stage: ready, with its own bytes; then released.
        let stage = plan.stage();
        let outcome = self.stage(&stage, None).await?;
        let WaitOutcome::Ready(status) = &outcome else {
            bail!(
                "the victim's stage request {} for {}@{} on hot was not served: {outcome:?}",
                stage.request_id(),
                plan.dataset,
                &plan.version[..16]
            );
        };
        let path = PathBuf::from(status.path.clone().context("a ready stage has a path")?);
        for (rel, bytes) in &plan.files {
            let got = std::fs::read(path.join(rel))
                .with_context(|| format!("{} in the victim's staged folder", rel))?;
            ensure!(
                got == *bytes,
                "{rel} staged for the victim differs from what it ingested"
            );
        }
        let bus = self.bus_as(&scheduler()).await?;
        stagehand::stage::release(&bus, &stage).await?;
        self.stage_status_where(&stage, "the victim's stage to be released", |s| {
            s.state == StageState::Released
        })
        .await
        .with_context(|| format!("the victim's release {}", stage.release_id()))?;
        // The round ends settled: the readiness the recorder mirrors shows no job holding it.
        let key = stagehand_catalogue::kv_key(&ReadinessKey {
            project: VICTIM.into(),
            dataset: plan.dataset.clone(),
            version: plan.version.clone(),
            tier: "hot".into(),
            node: None,
        });
        let kv = operator
            .jetstream()
            .get_key_value(stagehand_catalogue::READINESS_BUCKET)
            .await?;
        wait_for(
            STEP,
            "the victim's readiness to show the release",
            || async {
                let value = kv.get(key.clone()).await.ok().flatten()?;
                let readiness: Readiness = serde_json::from_slice(&value).ok()?;
                (readiness.jobs.holding() == 0).then_some(())
            },
        )
        .await?;

        self.all_folded(&operator, plan).await
    }

    /// The victim's version is in the catalogue.
    async fn catalogued(&self, operator: &Bus, plan: &Plan) -> anyhow::Result<()> {
        let q = Query::Version {
            project: Some(VICTIM.into()),
            dataset: plan.dataset.clone(),
            version: plan.version.clone(),
            limit: None,
        };
        let last = std::sync::Mutex::new(None);
        let found = wait_for(STEP, "the victim's version in the catalogue", || async {
            let answer = self.ask(operator, &q).await.ok()?;
            let hit = matches!(answer, Answer::Version(_)).then_some(());
            *last.lock().unwrap_or_else(|p| p.into_inner()) = Some(answer);
            hit
        })
        .await;
        found.map_err(|e| {
            let last = last.lock().unwrap_or_else(|p| p.into_inner()).clone();
            anyhow::anyhow!(
                "the victim was told {}@{} was validated (fact {}), but the catalogue does not \
                 have it: {e}; it answers {last:?}",
                plan.dataset,
                &plan.version[..16],
                plan.validated_id()
            )
        })
    }

    /// Every fact of the victim's round is in the facts stream (none suppressed as a
    /// duplicate) and folded into the catalogue (none skipped as already applied).
    async fn all_folded(&self, operator: &Bus, plan: &Plan) -> anyhow::Result<()> {
        let facts = facts_of(operator, &format!("stagehand.fact.*.*.{VICTIM}")).await?;
        let ours: Vec<&Event> = facts.iter().filter(|e| plan.concerns(e)).collect();
        let ids: BTreeSet<&EventId> = ours.iter().map(|e| &e.id).collect();
        for (what, id) in plan.fact_ids() {
            ensure!(
                ids.contains(&id),
                "the victim's {what} fact {id} is not in the facts stream (stored: {ids:?})"
            );
        }
        for event in ours {
            let folded = match &event.body {
                Body::DatasetValidated(v) => matches!(
                    self.ask(
                        operator,
                        &Query::Version {
                            project: Some(VICTIM.into()),
                            dataset: v.dataset.clone(),
                            version: v.version.clone(),
                            limit: None,
                        },
                    )
                    .await?,
                    Answer::Version(_)
                ),
                Body::CheckpointCommitted(c) => match self
                    .ask(
                        operator,
                        &Query::Checkpoints {
                            project: VICTIM.into(),
                            run: c.run.clone(),
                            limit: None,
                            after: None,
                        },
                    )
                    .await?
                {
                    Answer::Checkpoints { checkpoints, .. } => {
                        checkpoints.iter().any(|k| k.step == c.step)
                    }
                    _ => false,
                },
                Body::StageReady(_) | Body::StageFailed(_) | Body::StagePending(_) => {
                    let request_id = event.causation_id.clone().context("a stage fact's cause")?;
                    matches!(
                        self.ask(
                            operator,
                            &Query::StageRequest {
                                project: VICTIM.into(),
                                request_id: request_id.to_string(),
                            },
                        )
                        .await?,
                        Answer::StageRequest { .. }
                    )
                }
                _ => true,
            };
            ensure!(
                folded,
                "the victim's {} fact {} is in the facts stream but not in the catalogue",
                event.kind(),
                event.id
            );
        }
        Ok(())
    }

    /// What the attacking project can read that holds any of the victim's data: its hot and
    /// local folders (files with the victim's bytes), its stage statuses, its rejections and
    /// quarantine reports (the victim's sizes or hashes). Each finding is one line.
    pub async fn leaks(&self, victim_files: &[(String, Vec<u8>)]) -> anyhow::Result<Vec<String>> {
        let secrets: BTreeSet<String> = victim_files.iter().map(|(_, b)| sha256_hex(b)).collect();
        let sizes: BTreeSet<String> = victim_files
            .iter()
            .map(|(_, b)| b.len().to_string())
            .collect();
        let mut found = Vec::new();
        // Bytes: any file in the attacker's folders on the tiers it stages onto.
        for tier in ["hot", "local", "capacity"] {
            let root = self.tier(tier).join(ATTACKER);
            for entry in walkdir::WalkDir::new(&root).into_iter().flatten() {
                if !entry.file_type().is_file() {
                    continue;
                }
                let bytes = std::fs::read(entry.path()).unwrap_or_default();
                if secrets.contains(&sha256_hex(&bytes)) {
                    found.push(format!(
                        "{} holds the victim's bytes",
                        entry.path().display()
                    ));
                }
            }
        }
        // Words: what the attacker is told.
        let mut texts: Vec<(String, String)> = Vec::new();
        let operator = self.operator().await?;
        let kv = operator.jetstream().get_key_value(STAGES_BUCKET).await?;
        let mut keys = kv.keys().await?;
        while let Some(key) = keys.next().await {
            let key = key?;
            if !key.starts_with(&format!("{ATTACKER}.")) {
                continue;
            }
            if let Some(value) = kv.get(key.clone()).await? {
                texts.push((
                    format!("the attacker's stage status {key}"),
                    String::from_utf8_lossy(&value).into_owned(),
                ));
            }
        }
        for event in facts_of(&operator, &format!("stagehand.fact.*.*.{ATTACKER}")).await? {
            if matches!(
                event.body,
                Body::DatasetRejected(_) | Body::StageFailed(_) | Body::RestoreFailed(_)
            ) {
                texts.push((
                    format!("the attacker's {} fact {}", event.kind(), event.id),
                    format!("{:?}", event.body),
                ));
            }
        }
        let reports = self
            .tier("source")
            .join(".stagehand/quarantine")
            .join(ATTACKER);
        for entry in walkdir::WalkDir::new(&reports).into_iter().flatten() {
            if entry.file_type().is_file() {
                texts.push((
                    format!("quarantine report {}", entry.path().display()),
                    std::fs::read_to_string(entry.path()).unwrap_or_default(),
                ));
            }
        }
        for (what, text) in texts {
            let hashes: Vec<&String> = secrets.iter().filter(|h| text.contains(&h[..12])).collect();
            if !hashes.is_empty() {
                found.push(format!(
                    "{what} names the victim's hashes {hashes:?}: {text}"
                ));
            }
            // Whole numbers only: a run of digits inside a hex id or hash (a request id
            // `7dbf10e2178ab…`) is no size, nor is a timestamp's year (`2026-12-03T…`).
            let text_without_times = without_timestamps(&text);
            let words: BTreeSet<&str> = text_without_times
                .split(|c: char| !c.is_ascii_alphanumeric())
                .filter(|w| !w.is_empty() && w.bytes().all(|b| b.is_ascii_digit()))
                .collect();
            let named: Vec<&String> = sizes
                .iter()
                .filter(|s| words.contains(s.as_str()))
                .collect();
            if !named.is_empty() {
                found.push(format!("{what} names the victim's sizes {named:?}: {text}"));
            }
        }
        Ok(found)
    }

    /// A fold problem or dead letter that names `id` and says which rule refused it, in
    /// words a person would search for (`outside`, `project`).
    pub async fn refusal_of(&self, id: &EventId) -> anyhow::Result<Option<String>> {
        let operator = self.operator().await?;
        let mut after = None;
        loop {
            let q = Query::Problems {
                limit: None,
                after: after.clone(),
            };
            let Answer::Problems { problems, next, .. } = self.ask(&operator, &q).await? else {
                break;
            };
            for p in problems {
                if p.event_id == *id && names_the_rule(&p.detail) {
                    return Ok(Some(format!("fold problem: {}", p.detail)));
                }
            }
            match next {
                Some(n) => after = Some(n),
                None => break,
            }
        }
        for letter in dead_letters(&operator).await? {
            let Body::DeadLetter(dead) = &letter.body else {
                continue;
            };
            let errors: Vec<&str> = dead.errors.iter().map(|a| a.error.as_str()).collect();
            if dead.original_id.as_ref() == Some(id) && errors.iter().any(|e| names_the_rule(e)) {
                return Ok(Some(format!(
                    "dead letter of {}: {}",
                    dead.service,
                    errors.join("; ")
                )));
            }
        }
        Ok(None)
    }
}

/// Whether a refusal says which rule it applied.
fn names_the_rule(text: &str) -> bool {
    let lower = text.to_lowercase();
    lower.contains("outside") || lower.contains("project")
}

/// The victim's next round, planned before the attack: every name and id it will use follows
/// from public names and its bytes.
#[derive(Debug, Clone)]
pub struct Plan {
    pub dataset: String,
    pub files: Vec<(String, Vec<u8>)>,
    pub version: String,
    pub job: String,
    pub run: String,
    pub step: u64,
    pub checkpoint_files: Vec<(String, Vec<u8>)>,
}

impl Plan {
    /// A round of its own for `tag` (unique within the binary): a dataset of two files with
    /// their own bytes and sizes, a job, a run.
    pub fn new(tag: &str) -> Plan {
        let salt = stagehand_testkit::unique_name(tag);
        let bytes = |what: &str, len: usize| {
            let line = format!("{VICTIM}'s private {what} of {salt}\n");
            line.repeat(len / line.len() + 1).into_bytes()[..len].to_vec()
        };
        // Sizes no other number in a reason is likely to equal.
        let n = salt.bytes().map(u64::from).sum::<u64>() as usize % 500;
        let files = vec![
            ("images/0001.bin".to_string(), bytes("image", 4099 + n)),
            ("labels.csv".to_string(), bytes("labels", 1733 + n)),
        ];
        let refs: Vec<FileRef> = files
            .iter()
            .map(|(p, b)| FileRef::new(p.clone(), b.len() as u64, sha256_hex(b)))
            .collect();
        Plan {
            dataset: format!("{tag}-data"),
            version: version_digest(&refs),
            files,
            job: format!("{tag}-job"),
            run: format!("{tag}-run"),
            step: 100,
            checkpoint_files: vec![("model.bin".to_string(), bytes("weights", 2311 + n))],
        }
    }

    /// The file refs of the dataset, as its manifest lists them.
    pub fn refs(&self) -> Vec<FileRef> {
        self.files
            .iter()
            .map(|(p, b)| FileRef::new(p.clone(), b.len() as u64, sha256_hex(b)))
            .collect()
    }

    /// Every file of the victim's round: the dataset's and the checkpoint's.
    pub fn all_files(&self) -> Vec<(String, Vec<u8>)> {
        self.files
            .iter()
            .chain(&self.checkpoint_files)
            .cloned()
            .collect()
    }

    /// Where `stagehand ingest` places the dataset on the source tier.
    pub fn source_prefix(&self) -> String {
        format!("{VICTIM}/{}/{}", self.dataset, &self.version[..16])
    }

    pub fn ingest_id(&self) -> EventId {
        EventId::for_ingest(VICTIM, &self.dataset, &self.version)
    }

    pub fn validated_id(&self) -> EventId {
        EventId::for_fact(VICTIM, &self.ingest_id(), "validated")
    }

    pub fn stage(&self) -> Stage {
        Stage {
            project: VICTIM.into(),
            dataset: self.dataset.clone(),
            version: self.version.clone(),
            tier: "hot".into(),
            job: self.job.clone(),
            node: None,
        }
    }

    pub fn checkpoint_id(&self) -> EventId {
        EventId::for_checkpoint(VICTIM, &self.run, self.step)
    }

    /// The facts the round must leave in the stream: (what, id).
    pub fn fact_ids(&self) -> Vec<(&'static str, EventId)> {
        let stage = self.stage().request_id();
        vec![
            ("dataset.validated", self.validated_id()),
            ("checkpoint.committed", self.checkpoint_id()),
            ("stage.ready", EventId::for_fact(VICTIM, &stage, "ready")),
            (
                "replica.created",
                EventId::for_fact(VICTIM, &stage, "replica:hot"),
            ),
        ]
    }

    /// Every id the round will publish, requests and facts, with the (project, kind) it is
    /// published as: what an attacker borrows.
    pub fn ids(&self) -> Vec<(&'static str, EventId)> {
        let stage = self.stage();
        let mut ids = vec![
            ("ingest.requested", self.ingest_id()),
            ("stage.requested", stage.request_id()),
            ("stage.released", stage.release_id()),
        ];
        ids.extend(self.fact_ids());
        ids
    }

    /// Whether `event` is a fact of this round.
    fn concerns(&self, event: &Event) -> bool {
        match &event.body {
            Body::CheckpointCommitted(c) => c.run == self.run,
            body => body.dataset() == Some(self.dataset.as_str()),
        }
    }
}

/// Every event stored on `filter` in the facts stream, oldest first. Fact kinds are two
/// tokens: a project's facts are `stagehand.fact.*.*.<project>`.
pub async fn facts_of(bus: &Bus, filter: &str) -> anyhow::Result<Vec<Event>> {
    stored(bus, "STAGEHAND_FACTS", filter).await
}

/// Every dead letter stored, oldest first.
pub async fn dead_letters(bus: &Bus) -> anyhow::Result<Vec<Event>> {
    stored(bus, "STAGEHAND_DEAD_LETTERS", "stagehand.dlq.>").await
}

async fn stored(bus: &Bus, stream: &str, filter: &str) -> anyhow::Result<Vec<Event>> {
    let messages = stagehand_testkit::stored_messages(bus.jetstream(), stream, filter)
        .await
        .map_err(|e| anyhow::anyhow!("reading {stream}: {e}"))?;
    // What an attacker stored may not decode: it is no event of anyone's.
    Ok(messages.iter().filter_map(|m| m.event().ok()).collect())
}

/// Keys of Stagehand's KV buckets (readiness, stage statuses, the promoter's reservations and
/// use records) with each one's revision and value, to compare before and after an attack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvSnapshot(pub BTreeMap<(String, String), (u64, Vec<u8>)>);

/// The buckets an attacker must not reach into.
pub const GUARDED_BUCKETS: &[&str] = &[
    stagehand_catalogue::READINESS_BUCKET,
    STAGES_BUCKET,
    stagehand_bus::PROMOTER_BUCKET,
];

impl KvSnapshot {
    /// Every key of [`GUARDED_BUCKETS`], read as the operator.
    pub async fn take(bus: &Bus) -> anyhow::Result<KvSnapshot> {
        let mut all = BTreeMap::new();
        for bucket in GUARDED_BUCKETS {
            let kv = bus.jetstream().get_key_value(*bucket).await?;
            let mut keys = kv.keys().await?;
            let mut names = Vec::new();
            while let Some(key) = keys.next().await {
                names.push(key?);
            }
            for key in names {
                if let Some(entry) = kv.entry(key.clone()).await? {
                    all.insert(
                        (bucket.to_string(), key),
                        (entry.revision, entry.value.to_vec()),
                    );
                }
            }
        }
        Ok(KvSnapshot(all))
    }

    /// Keys that differ from `before` (added, removed or rewritten), other than those
    /// `allowed` admits (what the attacker's own requests may change), each with its value.
    pub fn changed_since(
        &self,
        before: &KvSnapshot,
        allowed: impl Fn(&str, &str) -> bool,
    ) -> Vec<String> {
        let keys: BTreeSet<&(String, String)> = self.0.keys().chain(before.0.keys()).collect();
        keys.into_iter()
            .filter(|(bucket, key)| !allowed(bucket, key))
            .filter_map(|k| {
                let (old, new) = (before.0.get(k), self.0.get(k));
                (old.map(|o| o.0) != new.map(|n| n.0)).then(|| {
                    format!(
                        "{}/{}: {:?} -> {:?}",
                        k.0,
                        k.1,
                        old.map(|o| String::from_utf8_lossy(&o.1).into_owned()),
                        new.map(|n| String::from_utf8_lossy(&n.1).into_owned())
                    )
                })
            })
            .collect()
    }
}

/// Runs the real `stagehand` binary as the user of `url`, nothing else of the caller's NATS
/// environment.
pub fn stagehand(url: &str, args: &[&str]) -> anyhow::Result<Output> {
    Ok(stagehand_command(url, args).output()?)
}

/// The real `stagehand` binary with `args`, as the user of `url` and nothing else of the
/// caller's NATS environment, for a test to add its own variables to.
pub fn stagehand_command(url: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_stagehand"));
    cmd.args(args).stdin(Stdio::null());
    for var in stagehand_bus::env::ALL {
        cmd.env_remove(var);
    }
    cmd.env("STAGEHAND_NATS_URL", url);
    cmd
}

/// A command's output, both streams.
pub fn said(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `text` with every RFC 3339 date or date-time (`2026-12-03`, `2026-12-03T08:11:33.18Z`)
/// blanked out, so that a time stamp's numbers are not read as sizes.
fn without_timestamps(text: &str) -> String {
    let bytes = text.as_bytes();
    let is_date = |at: usize| {
        let d = |i: usize| bytes.get(at + i).is_some_and(u8::is_ascii_digit);
        let dash = |i: usize| bytes.get(at + i) == Some(&b'-');
        (0..4).all(d) && dash(4) && d(5) && d(6) && dash(7) && d(8) && d(9)
    };
    let mut out = String::with_capacity(text.len());
    let mut at = 0;
    while at < bytes.len() {
        if is_date(at) && (at == 0 || !bytes[at - 1].is_ascii_alphanumeric()) {
            // The date, and a time after it: digits and `-:T.Z+`.
            let mut end = at + 10;
            while end < bytes.len()
                && (bytes[end].is_ascii_digit() || b"-:T.Z+".contains(&bytes[end]))
            {
                end += 1;
            }
            out.push(' ');
            at = end;
        } else {
            let c = text[at..]
                .chars()
                .next()
                .expect("a char at a char boundary");
            out.push(c);
            at += c.len_utf8();
        }
    }
    out
}
