//! Projects are tenants, and a hostile producer cannot cross them through the runtime: an
//! event on another project's subject, on another kind's subject, or naming a location outside
//! its project is dead-lettered as permanent without being handled (the handler is told, so
//! that it can list it), and an event that reuses another project's event id is its own event
//! — never answered from the other project's ledger record or claim.

mod common;

use std::sync::Arc;

use common::*;
use stagehand_bus::{CancellationToken, Handler, HandlerError, Ledger, WorkContext, run_worker};
use stagehand_schemas::{
    Body, CheckpointCommitted, Event, EventId, Location, Refusal, StageReady, StageReleased,
    subject, wire,
};
use stagehand_testkit::wait_until;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_on_another_projects_subject_is_dead_lettered_as_permanent() {
    let env = Env::start().await;
    let handler = Arc::new(Emit::default());
    let token = CancellationToken::new();
    let worker = tokio::spawn(run_worker(
        env.bus.clone(),
        env.worker("svc"),
        handler.clone(),
        token.clone(),
    ));
    // Project lab-a's event, published where project lab-b's requests go.
    let intruder = stage_request("intruder");
    env.publish_raw(
        "stagehand.req.stage.requested.lab-b",
        intruder.id.as_str(),
        &[],
        wire::encode(&intruder).unwrap(),
    )
    .await;
    wait_until(WAIT, "a dead letter", || async {
        env.dead_letter_count().await == 1
    })
    .await
    .unwrap();
    wait_until(WAIT, "terminated", || env.consumer_drained("svc"))
        .await
        .unwrap();
    token.cancel();
    let stats = worker.await.unwrap().unwrap();
    assert_eq!(handler.total_calls(), 0, "never handled");
    assert_eq!((stats.dead_lettered, stats.retried), (1, 0));
    let (_, dl) = env.dead_letters().await.remove(0);
    let Body::DeadLetter(d) = dl.body else {
        panic!()
    };
    assert_eq!(d.errors.len(), 1);
    let e = &d.errors[0];
    assert!(e.permanent);
    assert!(
        e.error.contains("lab-a") && e.error.contains("lab-b"),
        "{}",
        e.error
    );
    assert_eq!(d.subject, "stagehand.req.stage.requested.lab-b");
    assert_eq!(env.fact_count().await, 0);
}

/// Emits one `stage.ready` per request, its step naming the project, so that the two
/// projects' facts get distinct ids (fact ids derive from the event id alone) and both land.
#[derive(Default)]
struct PerProject(Emit);

impl Handler for PerProject {
    async fn handle(&self, event: &Event, ctx: &WorkContext) -> Result<Vec<Event>, HandlerError> {
        self.0.handle(event, ctx).await?;
        let Body::StageRequested(r) = &event.body else {
            unreachable!()
        };
        Ok(vec![event.caused(
            &format!("ready:{}", event.project),
            Body::StageReady(StageReady {
                dataset: r.dataset.clone(),
                version: r.version.clone(),
                location: Location {
                    tier: r.tier.clone(),
                    prefix: stagehand_schemas::layout::version_folder(
                        &event.project,
                        &r.dataset,
                        &r.version,
                    ),
                },
                job_id: r.job_id.clone(),
                request_id: event.id.clone(),
                node: None,
                path: None,
            }),
        )])
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_reusing_another_projects_id_is_worked_on_as_its_own() {
    let env = Env::start().await;
    let handler = Arc::new(PerProject::default());
    let cfg = env.worker("svc");
    let token = CancellationToken::new();
    let worker = tokio::spawn(run_worker(
        env.bus.clone(),
        cfg.clone(),
        handler.clone(),
        token.clone(),
    ));
    let original = stage_request("shared-id");
    env.bus.publish(&original).await.unwrap();
    wait_until(WAIT, "lab-a's fact", || async {
        env.fact_count().await == 1
    })
    .await
    .unwrap();
    // A producer in lab-b reuses lab-a's id on its own subject, with another message id (the
    // duplicate window would drop the same one).
    let mut copycat = stage_request("shared-id");
    copycat.project = "lab-b".into();
    env.publish_raw(
        &subject::subject_for(&copycat.body, &copycat.project),
        "copycat",
        &[],
        wire::encode(&copycat).unwrap(),
    )
    .await;
    wait_until(WAIT, "lab-b's own fact", || async {
        env.fact_count().await == 2
    })
    .await
    .unwrap();
    wait_until(WAIT, "drained", || env.consumer_drained("svc"))
        .await
        .unwrap();
    token.cancel();
    let stats = worker.await.unwrap().unwrap();
    assert_eq!(
        handler.0.calls_for("shared-id"),
        2,
        "worked on once per project"
    );
    assert_eq!((stats.handled, stats.replayed), (2, 0), "{stats:?}");
    let facts = env.facts().await;
    let mut projects: Vec<_> = facts.iter().map(|(_, _, f)| f.project.clone()).collect();
    projects.sort();
    assert_eq!(projects, ["lab-a", "lab-b"]);
    let ledger = Ledger::open(&cfg.ledger_path).unwrap();
    for project in ["lab-a", "lab-b"] {
        let outcome = ledger
            .outcome(project, original.kind(), &original.id)
            .unwrap()
            .unwrap();
        assert_eq!(
            outcome.facts[0].project, project,
            "each project's own record"
        );
    }
}

/// Records what the runtime refused before handling, and counts what it handled.
#[derive(Default)]
struct Refusals {
    emit: Emit,
    refused: std::sync::Mutex<Vec<(EventId, u64, &'static str)>>,
}

impl Handler for Refusals {
    async fn handle(&self, event: &Event, ctx: &WorkContext) -> Result<Vec<Event>, HandlerError> {
        self.emit.handle(event, ctx).await
    }

    async fn refused(&self, event: &Event, stream_sequence: u64, refusal: &Refusal) {
        self.refused
            .lock()
            .unwrap()
            .push((event.id.clone(), stream_sequence, refusal.rule()));
    }
}

/// The one dead letter's single error, once there is one (and the requests consumer
/// `requests_consumer`, if given, drained).
async fn only_dead_letter_error(env: &Env, requests_consumer: Option<&str>) -> (String, String) {
    wait_until(WAIT, "a dead letter", || async {
        env.dead_letter_count().await == 1
    })
    .await
    .unwrap();
    if let Some(name) = requests_consumer {
        wait_until(WAIT, "terminated", || env.consumer_drained(name))
            .await
            .unwrap();
    }
    let (_, dl) = env.dead_letters().await.remove(0);
    let Body::DeadLetter(d) = dl.body else {
        panic!()
    };
    assert_eq!(d.errors.len(), 1);
    assert!(d.errors[0].permanent);
    (d.errors[0].error.clone(), d.subject)
}

/// Issue 19 item 1: a body of one kind published on another kind's subject (a release where
/// stage requests go) is refused at step 1 naming the rule, never handled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_on_another_kinds_subject_is_dead_lettered_naming_the_rule() {
    let env = Env::start().await;
    let handler = Arc::new(Refusals::default());
    let token = CancellationToken::new();
    let worker = tokio::spawn(run_worker(
        env.bus.clone(),
        env.worker("svc"),
        handler.clone(),
        token.clone(),
    ));
    let release = Event::request(
        EventId::new("sneaky-release").unwrap(),
        "lab-a",
        Body::StageReleased(StageReleased {
            dataset: "cats".into(),
            version: "ab".repeat(32),
            tier: "hot".into(),
            job_id: "job-1".into(),
            node: None,
            reason: None,
        }),
    );
    env.publish_raw(
        "stagehand.req.stage.requested.lab-a",
        release.id.as_str(),
        &[],
        wire::encode(&release).unwrap(),
    )
    .await;
    let (error, subject) = only_dead_letter_error(&env, Some("svc")).await;
    token.cancel();
    let stats = worker.await.unwrap().unwrap();
    assert_eq!(handler.emit.total_calls(), 0, "never handled");
    assert_eq!((stats.dead_lettered, stats.retried), (1, 0));
    assert!(error.contains("subject_kind"), "{error}");
    assert!(error.contains("\"stage.released\""), "{error}");
    assert_eq!(subject, "stagehand.req.stage.requested.lab-a");
    let refused = handler.refused.lock().unwrap().clone();
    assert_eq!(refused.len(), 1);
    assert_eq!(refused[0].2, "subject_kind");
    assert_eq!(env.fact_count().await, 0);
}

/// Issue 19 item 1: a fact naming another project's prefix (a trainer's checkpoint at
/// `lab-b/...`) is refused at step 1 naming the rule, the field and the prefix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fact_naming_another_projects_location_is_dead_lettered_naming_the_rule() {
    let env = Env::start().await;
    let handler = Arc::new(Refusals::default());
    let token = CancellationToken::new();
    let mut cfg = env.worker("checkpoints");
    cfg.stream = subject::FACTS.name.to_owned();
    cfg.filter_subjects = vec![subject::kind_filter("fact", "checkpoint.committed")];
    let worker = tokio::spawn(run_worker(
        env.bus.clone(),
        cfg,
        handler.clone(),
        token.clone(),
    ));
    let commit = Event::request(
        EventId::for_checkpoint("lab-a", "r1", 1),
        "lab-a",
        Body::CheckpointCommitted(CheckpointCommitted {
            run: "r1".into(),
            step: 1,
            location: Location {
                tier: "source".into(),
                prefix: "lab-b/private/run-7".into(),
            },
            files: vec![],
            manifest: None,
            total_bytes: 0,
            tags: vec![],
        }),
    );
    env.bus.publish(&commit).await.unwrap();
    let (error, _) = only_dead_letter_error(&env, None).await;
    token.cancel();
    let stats = worker.await.unwrap().unwrap();
    assert_eq!(handler.emit.total_calls(), 0, "never handled");
    assert_eq!(stats.dead_lettered, 1);
    for part in ["outside_project", "payload.location", "lab-b/private/run-7"] {
        assert!(error.contains(part), "{part} missing from {error}");
    }
    let refused = handler.refused.lock().unwrap().clone();
    assert_eq!(refused.len(), 1);
    assert_eq!(
        (refused[0].0.clone(), refused[0].2),
        (commit.id.clone(), "outside_project")
    );
}
