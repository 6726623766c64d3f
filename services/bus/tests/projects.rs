//! Projects are tenants, and a hostile producer cannot cross them through the runtime: an
//! event on another project's subject is dead-lettered as permanent without being handled,
//! and an event that reuses another project's event id is its own event — never answered
//! from the other project's ledger record or claim.

mod common;

use std::sync::Arc;

use common::*;
use stagehand_bus::{CancellationToken, Handler, HandlerError, Ledger, WorkContext, run_worker};
use stagehand_schemas::{Body, Event, Location, StageReady, subject, wire};
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
                    prefix: r.dataset.clone(),
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
