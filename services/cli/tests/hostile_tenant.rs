//! A hostile tenant against the shipped accounts and the real services (issue 19, *Tests*):
//! project `demo`'s uploader and training jobs, and the shared `scheduler`, publish on every
//! subject the accounts config grants them — read from the config, so a grant added there is
//! tried here — events that name project `labb`'s datasets, versions, ids (computed from public
//! names, as anyone can), prefixes and paths, with forged `Nats-Msg-Id` headers. After each
//! attack, `labb`'s next round must go through untouched: its ingest validated and catalogued,
//! its checkpoint committed and catalogued, its stage request ready with its own bytes and its
//! release released, every fact of it stored and folded; and nothing the attacker can read
//! holds a byte, size or hash of `labb`'s data.
//!
//! One stack serves every test here ([`Tenants::shared`]); each test has its own names. The
//! attacks with crafted reply subjects, which can break the stack for every project, are in
//! `hostile_replies.rs`, one stack per test.
//!
//! Each numbered defect of the issue that concerns tenants has its own test, named for it.

mod common;

use std::time::Duration;

use anyhow::{Context, bail, ensure};
use common::attacks::{Attacker, Landed, addressed, forge, stream_subjects};
use common::tenants::{
    ATTACKER, Plan, STEP, Tenants, VICTIM, facts_of, scheduler, trainer, uploader,
};
use serde_json::json;
use stagehand::stage::{Stage, WaitOutcome};
use stagehand_catalogue::{Answer, Query, checkpoint_dataset};
use stagehand_schemas::{Event, EventId, FileRef, sha256_hex, version_digest};
use stagehand_testkit::{publish_allowed, wait_for};

/// Publishes, as `who`, on every request and fact subject its role is granted, events naming
/// the victim's `plan` under every id the plan will use: once with that id as the event id and
/// the Nats-Msg-Id, once as the event id of an event of the victim's project (the subject's
/// project stays the one granted) under a fresh Nats-Msg-Id. On the victim's own subjects (the
/// shared scheduler's), ids of that subject's kind are left out: asking for and releasing the
/// victim's stages is the scheduler's job, and which jobs it may act for is Slurm's mapping.
async fn attack_every_subject(
    tenants: &Tenants,
    who: (String, String),
    plan: &Plan,
) -> anyhow::Result<Vec<String>> {
    let granted = publish_allowed(&tenants.accounts, &who.1);
    ensure!(!granted.is_empty(), "{} has no publish grants", who.1);
    let mut attacker = Attacker::connect(tenants, who.clone()).await?;
    let mut tried = 0;
    for subject in &granted {
        let Some(targets) = stream_subjects(subject) else {
            continue;
        };
        for (subject, project, kind) in targets {
            for (id_kind, id) in plan.ids() {
                if project == VICTIM && id_kind == kind {
                    continue;
                }
                let forged = forge(&kind, &project, &id, plan, &who.0).with_context(|| {
                    format!(
                        "{} may publish {subject}, a kind this suite cannot forge yet: teach \
                         `forge` the kind {kind}",
                        who.0
                    )
                })?;
                let forged = addressed(forged, &subject);
                attacker.publish(&subject, &forged, id.as_str()).await;
                if project != VICTIM {
                    let mut foreign = forged.clone();
                    foreign.project = VICTIM.into();
                    attacker
                        .publish(&subject, &foreign, EventId::random().as_str())
                        .await;
                }
                tried += 1;
            }
        }
    }
    ensure!(
        tried > 0,
        "{} is granted no request or fact subject: {granted:?}",
        who.0
    );
    Ok(attacker.log)
}

/// Nothing of the victim's round changed, leaked or disappeared after an attack whose
/// publishes `log` lists.
async fn victim_unharmed(tenants: &Tenants, plan: &Plan, log: &[String]) -> anyhow::Result<()> {
    let attacks = log.join("\n  ");
    // Nothing of the round exists before it is played: the attack made no stage, readiness or
    // placement of the victim's names, and wrote nothing under the victim's folders.
    let bus = tenants.operator().await?;
    let snapshot = common::tenants::KvSnapshot::take(&bus).await?;
    let status_key = plan.stage().status_key();
    let placed = format!("{VICTIM}/{}/", plan.dataset);
    let use_key = stagehand_bus::placement::use_key(
        "hot",
        None,
        &format!("{VICTIM}/{}/{}", plan.dataset, plan.version),
    );
    let made: Vec<String> = snapshot
        .0
        .iter()
        // The attacker's own keys (`demo.…`) may name whatever it asked for.
        .filter(|((_, key), _)| !key.starts_with(&format!("{ATTACKER}.")))
        .filter(|((_, key), (_, value))| {
            *key == status_key
                || *key == use_key
                || key.contains(&plan.dataset)
                || String::from_utf8_lossy(value).contains(&placed)
        })
        .map(|((b, k), (_, v))| format!("{b}/{k} = {}", String::from_utf8_lossy(v)))
        .collect();
    ensure!(
        made.is_empty(),
        "the attack made the victim's keys {made:?}; attacks:\n  {attacks}"
    );
    for tier in ["source", "hot", "capacity", "local"] {
        let root = tenants.tier(tier).join(VICTIM);
        for entry in walkdir::WalkDir::new(&root).into_iter().flatten() {
            let path = entry.path().to_string_lossy().into_owned();
            ensure!(
                !path.contains(&plan.dataset) && !path.contains(&plan.run),
                "the attack wrote {path} among the victim's files; attacks:\n  {attacks}"
            );
        }
    }
    tenants
        .victim_round(plan)
        .await
        .with_context(|| format!("after the attacks:\n  {attacks}"))?;
    let leaks = tenants.leaks(&plan.all_files()).await?;
    ensure!(
        leaks.is_empty(),
        "the attacker can read the victim's data:\n  {}\nattacks:\n  {attacks}",
        leaks.join("\n  ")
    );
    Ok(())
}

/// The sweep for one attacking role: every subject it may publish, every id of the victim's
/// next round, then that round.
async fn sweep(who: (String, String), tag: &str) -> anyhow::Result<()> {
    let tenants = Tenants::shared().await;
    let plan = Plan::new(tag);
    let log = attack_every_subject(tenants, who, &plan).await?;
    victim_unharmed(tenants, &plan, &log).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_subject_another_projects_uploader_may_publish_leaves_the_victim_untouched()
-> anyhow::Result<()> {
    sweep(uploader(ATTACKER), "sweep-up").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_subject_another_projects_training_job_may_publish_leaves_the_victim_untouched()
-> anyhow::Result<()> {
    sweep(trainer(ATTACKER), "sweep-tr").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_subject_the_shared_scheduler_may_publish_leaves_the_victim_untouched()
-> anyhow::Result<()> {
    sweep(scheduler(), "sweep-sch").await
}

/// Refused today: an uploader's request whose source lies in another project's prefix, with
/// that project's true manifest, is rejected without reading a byte there or writing beside
/// it, and what the attacker is told names none of the victim's sizes or hashes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ingest_request_located_in_another_projects_prefix_reads_and_writes_nothing_there()
-> anyhow::Result<()> {
    let tenants = Tenants::shared().await;
    let placed = Plan::new("loc-placed");
    tenants.victim_round(&placed).await?;
    let mut attacker = Attacker::connect(tenants, uploader(ATTACKER)).await?;
    let id = EventId::random();
    let event = forge("ingest.requested", ATTACKER, &id, &placed, "uploader-demo")
        .context("an ingest request")?;
    let subject = format!("stagehand.req.ingest.requested.{ATTACKER}");
    let landed = attacker.publish(&subject, &event, id.as_str()).await;
    ensure!(matches!(landed, Landed::Stored(_)), "{landed:?}");
    let bus = tenants.operator().await?;
    let rejected = wait_for(STEP, "the attacker's request to be answered", || async {
        let facts = facts_of(&bus, &format!("stagehand.fact.*.*.{ATTACKER}"))
            .await
            .ok()?;
        facts
            .into_iter()
            .find(|e| e.causation_id.as_ref() == Some(&id))
    })
    .await?;
    ensure!(
        rejected.kind() == "dataset.rejected",
        "a request located in {VICTIM}'s prefix was answered {rejected:?}"
    );
    ensure!(
        format!("{:?}", rejected.body)
            .to_lowercase()
            .contains("project"),
        "the rejection names the rule: {rejected:?}"
    );
    let leaks = tenants.leaks(&placed.all_files()).await?;
    ensure!(leaks.is_empty(), "{}", leaks.join("\n"));
    // Nothing written beside the victim's upload.
    let root = tenants.tier("source").join(placed.source_prefix());
    let mut there: Vec<String> = walkdir::WalkDir::new(&root)
        .into_iter()
        .flatten()
        .filter(|e| e.file_type().is_file())
        .map(|e| {
            e.path()
                .strip_prefix(&root)
                .map(|p| p.display().to_string())
        })
        .collect::<Result<_, _>>()?;
    there.sort();
    ensure!(
        there == ["images/0001.bin", "labels.csv"],
        "the victim's upload folder now holds {there:?}"
    );
    tenants.victim_round(&Plan::new("loc-next")).await
}

/// Refused today: an event of the victim's project published on the attacker's own subject
/// is dead-lettered as travelling on another project's subject, naming the rule, and nothing
/// of the victim's round changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_of_another_project_on_the_attackers_own_subject_is_dead_lettered()
-> anyhow::Result<()> {
    let tenants = Tenants::shared().await;
    let plan = Plan::new("foreign");
    let mut letters = Vec::new();
    for (who, kind, class) in [
        (uploader(ATTACKER), "ingest.requested", "req"),
        (trainer(ATTACKER), "checkpoint.committed", "fact"),
        (scheduler(), "stage.requested", "req"),
    ] {
        let mut attacker = Attacker::connect(tenants, who.clone()).await?;
        let id = EventId::random();
        let event = forge(kind, VICTIM, &id, &plan, &who.0).context("forge")?;
        let subject = format!("stagehand.{class}.{kind}.{ATTACKER}");
        let landed = attacker.publish(&subject, &event, id.as_str()).await;
        ensure!(matches!(landed, Landed::Stored(_)), "{subject}: {landed:?}");
        letters.push(id);
    }
    for id in &letters {
        let refusal = wait_for(STEP, "a dead letter naming the rule", || async {
            tenants.refusal_of(id).await.ok().flatten()
        })
        .await
        .with_context(|| format!("event {id}"))?;
        // Refused, naming the rule: dead-lettered by the service that consumed it, and listed
        // by the catalogue as a problem when it is a fact the recorder consumes.
        ensure!(
            refusal.contains("dead letter") || refusal.contains("fold problem"),
            "{refusal}"
        );
    }
    victim_unharmed(tenants, &plan, &[]).await
}

/// Refused today: what the attacker may ask JetStream directly (its project's verdicts and
/// commits, its upload bucket) never answers with the victim's data, whatever the request
/// names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_jetstream_api_an_attacker_may_use_never_answers_with_the_victims_data()
-> anyhow::Result<()> {
    let tenants = Tenants::shared().await;
    let plan = Plan::new("api");
    tenants.victim_round(&plan).await?;
    let secrets: Vec<String> = plan
        .all_files()
        .iter()
        .map(|(_, b)| sha256_hex(b)[..12].to_owned())
        .chain([plan.version[..16].to_owned(), plan.dataset.clone()])
        .collect();
    let mut asked = 0;
    for who in [uploader(ATTACKER), trainer(ATTACKER)] {
        let bus = tenants.bus_as(&who).await?;
        for granted in publish_allowed(&tenants.accounts, &who.1) {
            if !granted.starts_with("$JS.API.") {
                continue;
            }
            let subject = granted.replace('>', "probe").replace('*', VICTIM);
            for payload in [
                json!({}),
                json!({"last_by_subj": format!("stagehand.fact.dataset.validated.{VICTIM}")}),
                json!({"last_by_subj": format!("stagehand.fact.checkpoint.committed.{VICTIM}")}),
                json!({"seq": 1}),
                json!({"next_by_subj": "stagehand.fact.>", "seq": 1}),
            ] {
                let answer = tokio::time::timeout(
                    Duration::from_secs(5),
                    bus.client()
                        .request(subject.clone(), payload.to_string().into()),
                )
                .await;
                asked += 1;
                let Ok(Ok(answer)) = answer else { continue };
                let text = format!(
                    "{:?} {}",
                    answer.headers,
                    String::from_utf8_lossy(&answer.payload)
                );
                for secret in &secrets {
                    ensure!(
                        !text.contains(secret.as_str()),
                        "{} asked {subject} with {payload} and was told the victim's {secret}: {text}",
                        who.0
                    );
                }
            }
        }
    }
    ensure!(asked > 0, "no JetStream API grant was tried");
    Ok(())
}

/// Defect 1: a training job's checkpoint located in another project's prefix. Today the
/// recorder folds it, the promoter reads the victim's files for it, a stage request answers
/// with the victim's true size and hash, and once the commit matches, copies the victim's bytes
/// into the attacker's hot folder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defect_1_a_trainers_checkpoint_located_in_another_projects_prefix_is_not_folded_read_or_copied()
-> anyhow::Result<()> {
    let tenants = Tenants::shared().await;
    let placed = Plan::new("steal");
    tenants.victim_round(&placed).await?;
    let trainer_bus = tenants.bus_as(&trainer(ATTACKER)).await?;
    let run = stagehand_testkit::unique_name("steal-run");
    let mut committed = Vec::new();
    // First a guess (one byte per file), then what the victim's files really are.
    let guessed: Vec<FileRef> = placed
        .refs()
        .iter()
        .map(|f| FileRef::new(f.path.clone(), 1, sha256_hex(b"x")))
        .collect();
    for (step, files) in [(1u64, guessed), (2, placed.refs())] {
        let fact = Event {
            id: EventId::for_checkpoint(ATTACKER, &run, step),
            schema: stagehand_schemas::event::SCHEMA_VERSION,
            occurred_at: stagehand_schemas::event::now(),
            project: ATTACKER.into(),
            correlation_id: EventId::for_checkpoint(ATTACKER, &run, step),
            causation_id: None,
            body: stagehand_schemas::Body::CheckpointCommitted(
                stagehand_schemas::CheckpointCommitted {
                    run: run.clone(),
                    step,
                    location: stagehand_schemas::Location {
                        tier: "source".into(),
                        prefix: placed.source_prefix(),
                    },
                    total_bytes: files.iter().map(|f| f.size).sum(),
                    files: files.clone(),
                    manifest: None,
                    tags: Vec::new(),
                },
            ),
        };
        trainer_bus
            .publish(&fact)
            .await
            .context("the trainer may publish its project's commits")?;
        let stage = Stage {
            project: ATTACKER.into(),
            dataset: checkpoint_dataset(&run),
            version: version_digest(&files),
            tier: "hot".into(),
            job: format!("{run}-job-{step}"),
            node: None,
        };
        // A deadline, so that a request the catalogue never answers still ends.
        let outcome = tenants.stage(&stage, Some(Duration::from_secs(20))).await?;
        committed.push((fact.id, outcome));
    }
    let leaks = tenants.leaks(&placed.all_files()).await?;
    ensure!(
        leaks.is_empty(),
        "a checkpoint committed by {ATTACKER} in {VICTIM}'s prefix let it read {VICTIM}'s data:\n  {}\nstages: {committed:#?}",
        leaks.join("\n  ")
    );
    for (id, outcome) in &committed {
        ensure!(
            !matches!(outcome, WaitOutcome::Ready(_)),
            "a stage of the checkpoint {id} located in {VICTIM}'s prefix was made ready: {outcome:?}"
        );
        let refusal = tenants.refusal_of(id).await?;
        ensure!(
            refusal.is_some(),
            "the checkpoint {id} located in {VICTIM}'s prefix was folded with no fold problem or \
             dead letter naming the rule"
        );
    }
    // The victim's data and its next round are untouched.
    tenants.victim_round(&Plan::new("steal-next")).await
}

/// The victim's version of `plan`, ingested and staged, so that an attack can aim at its next
/// stage or release.
async fn ingested(tenants: &Tenants, plan: &Plan) -> anyhow::Result<()> {
    let report = tenants.ingest(VICTIM, &plan.dataset, &plan.files).await?;
    ensure!(
        matches!(
            report.outcome,
            Some(stagehand::ingest::Outcome::Validated(_))
        ),
        "the victim's ingest: {:?}",
        report.outcome
    );
    Ok(())
}

/// Publishes, as the attacker's uploader, a request of its own project under `msg_id`.
async fn borrow_id_as_uploader(tenants: &Tenants, msg_id: &EventId) -> anyhow::Result<Vec<String>> {
    let mut attacker = Attacker::connect(tenants, uploader(ATTACKER)).await?;
    let own = Plan::new("borrower");
    let event = forge("ingest.requested", ATTACKER, msg_id, &own, "uploader-demo")
        .context("an ingest request")?;
    let landed = attacker
        .publish(
            &format!("stagehand.req.ingest.requested.{ATTACKER}"),
            &event,
            msg_id.as_str(),
        )
        .await;
    ensure!(matches!(landed, Landed::Stored(_)), "{landed:?}");
    Ok(attacker.log)
}

/// Defect 2, the request: the attacker's uploader publishes a request of its own under the id
/// of the victim's next stage request. Today the requests stream drops the victim's request
/// as a duplicate and its job waits for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defect_2_a_stage_request_id_borrowed_by_another_project_does_not_suppress_the_request()
-> anyhow::Result<()> {
    let tenants = Tenants::shared().await;
    let plan = Plan::new("sup-req");
    ingested(tenants, &plan).await?;
    let log = borrow_id_as_uploader(tenants, &plan.stage().request_id()).await?;
    let outcome = tenants.stage(&plan.stage(), None).await?;
    ensure!(
        matches!(outcome, WaitOutcome::Ready(_)),
        "the victim's stage request {} was not served after {ATTACKER} borrowed its id: \
         {outcome:?}\n  {}",
        plan.stage().request_id(),
        log.join("\n  ")
    );
    Ok(())
}

/// Defect 2, the release: the attacker's uploader publishes under the id of the victim's next
/// release. Today the victim's release is dropped as a duplicate and the stage stays held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defect_2_a_release_id_borrowed_by_another_project_does_not_suppress_the_release()
-> anyhow::Result<()> {
    let tenants = Tenants::shared().await;
    let plan = Plan::new("sup-rel");
    ingested(tenants, &plan).await?;
    let stage = plan.stage();
    let outcome = tenants.stage(&stage, None).await?;
    ensure!(matches!(outcome, WaitOutcome::Ready(_)), "{outcome:?}");
    let log = borrow_id_as_uploader(tenants, &stage.release_id()).await?;
    let bus = tenants.bus_as(&scheduler()).await?;
    stagehand::stage::release(&bus, &stage).await?;
    tenants
        .stage_status_where(&stage, "the victim's stage to be released", |s| {
            s.state == stagehand::stage::StageState::Released
        })
        .await
        .with_context(|| {
            format!(
                "the victim's release {} after {ATTACKER} borrowed its id:\n  {}",
                stage.release_id(),
                log.join("\n  ")
            )
        })?;
    Ok(())
}

/// Defect 2, a fact through the stream's duplicate window: the attacker's training job commits
/// a checkpoint of its own whose Nats-Msg-Id is the id of the victim's next `dataset.validated`.
/// Today the facts stream drops the validator's fact: the uploader is never answered and the
/// catalogue never has the version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defect_2_a_fact_id_borrowed_through_the_duplicate_window_does_not_suppress_the_fact()
-> anyhow::Result<()> {
    let tenants = Tenants::shared().await;
    let plan = Plan::new("sup-win");
    let mut attacker = Attacker::connect(tenants, trainer(ATTACKER)).await?;
    let own = Plan::new("borrower-win");
    let own_id = EventId::for_checkpoint(ATTACKER, &own.run, own.step);
    let mut fact = forge(
        "checkpoint.committed",
        ATTACKER,
        &own_id,
        &own,
        "trainer-demo",
    )
    .context("a commit")?;
    // Its own files, in its own prefix: nothing wrong with it but the borrowed Nats-Msg-Id.
    set_own_location(&mut fact);
    let landed = attacker
        .publish(
            &format!("stagehand.fact.checkpoint.committed.{ATTACKER}"),
            &fact,
            plan.validated_id().as_str(),
        )
        .await;
    ensure!(matches!(landed, Landed::Stored(_)), "{landed:?}");
    victim_unharmed(tenants, &plan, &attacker.log).await
}

/// Defect 2, a fact through the recorder's applied table: the attacker's training job commits a
/// checkpoint whose event id is the id of the victim's next `dataset.validated` (under a
/// Nats-Msg-Id of its own, so the stream keeps both). Today the recorder folds the attacker's
/// first and skips the victim's for ever: the uploader was told "validated", the catalogue
/// says not found.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defect_2_a_fact_id_borrowed_through_the_recorders_applied_table_does_not_suppress_the_fact()
-> anyhow::Result<()> {
    let tenants = Tenants::shared().await;
    let plan = Plan::new("sup-app");
    let mut attacker = Attacker::connect(tenants, trainer(ATTACKER)).await?;
    let own = Plan::new("borrower-app");
    let mut fact = forge(
        "checkpoint.committed",
        ATTACKER,
        &plan.validated_id(),
        &own,
        "trainer-demo",
    )
    .context("a commit")?;
    set_own_location(&mut fact);
    let landed = attacker
        .publish(
            &format!("stagehand.fact.checkpoint.committed.{ATTACKER}"),
            &fact,
            EventId::for_checkpoint(ATTACKER, &own.run, own.step).as_str(),
        )
        .await;
    ensure!(matches!(landed, Landed::Stored(_)), "{landed:?}");
    // The recorder has folded the attacker's commit before the victim's fact exists.
    let operator = tenants.operator().await?;
    wait_for(STEP, "the attacker's commit in the catalogue", || async {
        let q = Query::Checkpoints {
            project: ATTACKER.into(),
            run: own.run.clone(),
            limit: None,
            after: None,
        };
        match tenants.ask(&operator, &q).await.ok()? {
            Answer::Checkpoints { checkpoints, .. } => (!checkpoints.is_empty()).then_some(()),
            _ => None,
        }
    })
    .await?;
    victim_unharmed(tenants, &plan, &attacker.log).await
}

/// Moves a forged commit into the attacker's own prefix on the hot tier.
fn set_own_location(fact: &mut Event) {
    if let stagehand_schemas::Body::CheckpointCommitted(c) = &mut fact.body {
        c.location = stagehand_schemas::Location {
            tier: "hot".into(),
            prefix: format!("{ATTACKER}/runs/{}/step-{}", c.run, c.step),
        };
    }
}

#[test]
fn every_attacking_role_is_granted_a_subject_the_sweep_can_forge() -> anyhow::Result<()> {
    let text = stagehand_testkit::accounts_conf_with_projects(&[VICTIM]);
    let plan = Plan::new("grants");
    for who in [uploader(ATTACKER), trainer(ATTACKER), scheduler()] {
        let subjects: Vec<(String, String, String)> = publish_allowed(&text, &who.1)
            .iter()
            .filter_map(|s| stream_subjects(s))
            .flatten()
            .collect();
        if subjects.is_empty() {
            bail!("{} is granted no request or fact subject", who.0);
        }
        for (subject, project, kind) in subjects {
            let id = EventId::random();
            let event = forge(&kind, &project, &id, &plan, &who.0)
                .with_context(|| format!("{subject}: cannot forge {kind}"))?;
            ensure!(event.kind() == kind, "{subject}: forged {}", event.kind());
        }
    }
    Ok(())
}
