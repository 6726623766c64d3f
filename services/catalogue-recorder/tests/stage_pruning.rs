//! The running recorder prunes stage records that hold nothing once its `stage_retention` has
//! passed, on its own timer, and keeps the rest: against a real nats-server, with the stage
//! requests, the promoter's facts and the releases published as schedulers and the promoter
//! publish them.

use std::time::Duration;

use stagehand_bus::runner;
use stagehand_bus::{Bus, BusConfig, CancellationToken};
use stagehand_catalogue::{Answer, Catalogue, Query, StageState};
use stagehand_catalogue_recorder::{SERVICE, Settings, serve};
use stagehand_schemas::*;
use stagehand_testkit::{NatsServer, wait_until};

const WAIT: Duration = Duration::from_secs(60);

/// A stage of `job` that happened `days` ago: requested, ready, and released when `released`.
fn stage(job: &str, days: i64, released: bool) -> Vec<Event> {
    let version = "c".repeat(64);
    let id = EventId::for_stage("lab-a", job, "cats", &version, "hot", None);
    let mut request = Event::request(
        id.clone(),
        "lab-a",
        Body::StageRequested(StageRequested {
            dataset: "cats".into(),
            version: version.clone(),
            tier: "hot".into(),
            job_id: job.into(),
            requested_by: "slurm".into(),
            deadline: None,
            node: None,
            form: None,
            hold_until: None,
        }),
    );
    request.occurred_at -= ::time::Duration::days(days);
    let mut ready = request.caused(
        "ready",
        Body::StageReady(StageReady {
            dataset: "cats".into(),
            version: version.clone(),
            location: Location {
                tier: "hot".into(),
                prefix: format!("lab-a/cats/{version}"),
            },
            job_id: job.into(),
            request_id: id,
            node: None,
            path: None,
        }),
    );
    ready.occurred_at = request.occurred_at + ::time::Duration::seconds(1);
    let mut events = vec![request, ready];
    if released {
        let mut release = Event::request(
            EventId::for_stage_release("lab-a", job, "cats", &version, "hot", None),
            "lab-a",
            Body::StageReleased(StageReleased {
                dataset: "cats".into(),
                version,
                tier: "hot".into(),
                job_id: job.into(),
                node: None,
                reason: None,
            }),
        );
        release.occurred_at = events[0].occurred_at + ::time::Duration::seconds(2);
        events.push(release);
    }
    events
}

/// The states of `job`'s stages as the recorder answers them.
async fn stages_of(catalogue: &Catalogue, job: &str) -> Option<Vec<StageState>> {
    match catalogue
        .ask(&Query::StageRequests {
            project: "lab-a".into(),
            job_id: Some(job.into()),
            dataset: None,
            version: None,
            limit: None,
            after: None,
        })
        .await
    {
        Ok(Answer::StageRequests { stages, .. }) => {
            Some(stages.into_iter().map(|s| s.state).collect())
        }
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_recorder_prunes_stages_that_held_nothing_for_its_retention() {
    let nats = NatsServer::start();
    let bus = Bus::connect(&BusConfig::new(nats.url())).await.unwrap();
    bus.provision().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let start = |interval: Duration| {
        let mut settings = Settings::under(dir.path());
        settings.stage_retention = Duration::from_secs(7 * 24 * 3600);
        settings.stage_prune_interval = interval;
        let shutdown = CancellationToken::new();
        let recorder = tokio::spawn(serve(runner::Context::new(
            SERVICE,
            settings,
            bus.clone(),
            shutdown.clone(),
        )));
        (shutdown, recorder)
    };
    let catalogue = Catalogue::new(bus.client().clone()).with_timeout(Duration::from_secs(5));

    // First a recorder that does not prune yet: every stage is folded.
    let (shutdown, recorder) = start(Duration::from_secs(3600));
    for event in [
        stage("old-released", 30, true),
        stage("old-held", 30, false),
        stage("recent-released", 1, true),
    ]
    .concat()
    {
        bus.publish(&event).await.unwrap();
    }
    wait_until(WAIT, "every stage folded", || async {
        stages_of(&catalogue, "old-released").await == Some(vec![StageState::Released])
            && stages_of(&catalogue, "old-held").await == Some(vec![StageState::Ready])
            && stages_of(&catalogue, "recent-released").await == Some(vec![StageState::Released])
    })
    .await
    .unwrap();
    shutdown.cancel();
    recorder.await.unwrap().unwrap();

    // Restarted with a short interval: the old release goes, on the recorder's own timer.
    let (shutdown, recorder) = start(Duration::from_millis(200));
    wait_until(WAIT, "the old released stage pruned", || async {
        stages_of(&catalogue, "old-released").await == Some(vec![])
    })
    .await
    .unwrap();
    assert_eq!(
        stages_of(&catalogue, "old-held").await,
        Some(vec![StageState::Ready]),
        "a stage that still holds its replica is kept, however old"
    );
    assert_eq!(
        stages_of(&catalogue, "recent-released").await,
        Some(vec![StageState::Released])
    );
    shutdown.cancel();
    recorder.await.unwrap().unwrap();
}
