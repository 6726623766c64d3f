//! `stagehand dlq discard` and the bulk `dlq replay --service S --since T [--dry-run]` (issue
//! 18 item 6) as the built binary, against a real nats-server and the real catalogue
//! recorder: a discarded dead letter no longer waits (the recorder's count and
//! `stagehand_dead_letters_waiting`'s source drop), is never replayed afterwards — alone or in
//! bulk — and a second discard changes nothing; the bulk replay takes only the waiting dead
//! letters of its service since the time given; every discard and replay is an operator
//! action that `stagehand status --actions` lists, newest first.

use std::process::{Command, Output};
use std::time::Duration;

use anyhow::{Context, ensure};
use serde_json::Value;
use stagehand::dlq;
use stagehand_bus::{Bus, BusConfig, CancellationToken, runner};
use stagehand_catalogue::{Answer, Catalogue, Query};
use stagehand_ingest_validator::{SERVICE, Settings};
use stagehand_schemas::{Body, Event, EventId, subject};
use stagehand_testkit::{NatsServer, wait_for};

const WAIT: Duration = Duration::from_secs(30);
const OPERATOR: &str = "oncall-ana";

fn stagehand(url: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_stagehand"))
        .args(["--nats", url])
        .args(args)
        .env("STAGEHAND_OPERATOR", OPERATOR)
        .env("STAGEHAND_HOME", "/nonexistent-stagehand-home")
        .output()
        .expect("run stagehand")
}

fn said(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A dead letter of the validator for the message at `at` of the requests stream, published
/// as the validator's runtime does; returns its sequence in the dead-letter stream.
async fn dead_letter(bus: &Bus, at: u64) -> u64 {
    let id = EventId::for_dead_letter(subject::REQUESTS.name, SERVICE, at);
    let dead = Event {
        id: id.clone(),
        schema: stagehand_schemas::SCHEMA_VERSION,
        occurred_at: stagehand_schemas::now(),
        project: "laba".into(),
        correlation_id: id,
        causation_id: None,
        body: Body::DeadLetter(stagehand_schemas::DeadLetter {
            service: SERVICE.into(),
            stream: subject::REQUESTS.name.into(),
            consumer: SERVICE.into(),
            stream_sequence: at,
            subject: "stagehand.req.ingest.requested.laba".into(),
            delivered: 1,
            original: b"\xc1 undecodable".to_vec(),
            headers: vec![],
            errors: vec![],
            original_id: None,
        }),
    };
    bus.publish(&dead).await.unwrap().sequence
}

/// (dead letters counted, waiting) for the validator, as the recorder answers.
async fn counted(catalogue: &Catalogue) -> Option<(u64, u64)> {
    let Ok(Answer::DeadLetters { services, .. }) = catalogue
        .ask(&Query::DeadLetters {
            limit: None,
            after: None,
        })
        .await
    else {
        return None;
    };
    services
        .into_iter()
        .find(|s| s.service == SERVICE)
        .map(|s| (s.count, s.waiting.unwrap_or(s.count)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_discarded_dead_letter_stops_waiting_and_is_never_replayed() -> anyhow::Result<()> {
    let nats = NatsServer::start();
    let url = nats.url();
    let bus = Bus::connect(&BusConfig::new(&url)).await?;
    bus.provision().await?;
    // The validator's durable consumer, as its runtime declares it: what a replay checks.
    let cfg = Settings::new(
        std::path::Path::new("/nonexistent"),
        std::path::Path::new("/nonexistent"),
    )
    .worker_config();
    stagehand_bus::provision_consumer(&bus, &cfg).await?;
    let dir = tempfile::tempdir()?;
    let shutdown = CancellationToken::new();
    let recorder = tokio::spawn(stagehand_catalogue_recorder::serve(runner::Context::new(
        stagehand_catalogue_recorder::SERVICE,
        stagehand_catalogue_recorder::Settings::under(dir.path()),
        bus.clone(),
        shutdown.clone(),
    )));
    let catalogue = Catalogue::new(bus.client().clone()).with_timeout(Duration::from_secs(5));

    let (first, second, third) = (
        dead_letter(&bus, 1).await,
        dead_letter(&bus, 2).await,
        dead_letter(&bus, 3).await,
    );
    wait_for(WAIT, "three dead letters waiting", || async {
        (counted(&catalogue).await == Some((3, 3))).then_some(())
    })
    .await?;

    // Discard the first: it stops waiting.
    let out = stagehand(
        &url,
        &[
            "dlq",
            "discard",
            &first.to_string(),
            "--reason",
            "the lab withdrew the upload",
            "--json",
        ],
    );
    ensure!(out.status.success(), "{}", said(&out));
    let discarded: Value = serde_json::from_slice(&out.stdout)?;
    ensure!(
        discarded["newly"] == true && discarded["by"] == OPERATOR,
        "{discarded}"
    );
    wait_for(WAIT, "the discarded one to stop waiting", || async {
        (counted(&catalogue).await == Some((3, 2))).then_some(())
    })
    .await?;
    // A second discard changes nothing and says who discarded it.
    let again = dlq::discard(&bus, first, "someone-else", "again").await?;
    ensure!(!again.newly && again.by == OPERATOR, "{again:?}");
    // Never replayed afterwards, alone …
    let out = stagehand(&url, &["dlq", "replay", &first.to_string()]);
    ensure!(
        !out.status.success() && said(&out).contains("discarded"),
        "{}",
        said(&out)
    );
    // … or in bulk: the dry run lists the two that wait, the replay replays only them.
    let dry = bulk_replay(&url, &["--dry-run"])?;
    ensure!(sequences(&dry, "selected")? == [second, third], "{dry}");
    ensure!(
        dry["replayed"].as_array().is_some_and(Vec::is_empty),
        "{dry}"
    );
    // A time after every dead letter selects none.
    let later = time::OffsetDateTime::now_utc() + time::Duration::minutes(5);
    let none = dlq::replay_since(&bus, SERVICE, later, true, OPERATOR, "").await?;
    ensure!(none.selected.is_empty(), "{none:?}");

    let bulk = bulk_replay(&url, &["--reason", "the source tier is back"])?;
    ensure!(sequences(&bulk, "replayed")? == [second, third], "{bulk}");
    wait_for(WAIT, "nothing waiting", || async {
        (counted(&catalogue).await == Some((3, 0))).then_some(())
    })
    .await?;
    // Nothing waits any more: a second bulk replay selects nothing.
    let rest = dlq::replay_since(
        &bus,
        SERVICE,
        time::OffsetDateTime::UNIX_EPOCH,
        false,
        OPERATOR,
        "",
    )
    .await?;
    ensure!(
        rest.selected.is_empty() && rest.replayed.is_empty(),
        "{rest:?}"
    );

    // Every action listed, newest first: two replays, then the discard.
    let listed = wait_for(WAIT, "three operator actions listed", || async {
        let out = stagehand(&url, &["status", "--actions", "--json"]);
        let list: Value = serde_json::from_slice(&out.stdout).ok()?;
        let list = list.as_array()?.clone();
        (list.len() == 3).then_some(list)
    })
    .await?;
    let kinds: Vec<&str> = listed.iter().filter_map(|a| a["action"].as_str()).collect();
    ensure!(
        kinds == ["dlq.replay", "dlq.replay", "dlq.discard"],
        "{listed:?}"
    );
    let discard = &listed[2];
    ensure!(
        discard["by"] == OPERATOR
            && discard["reason"] == "the lab withdrew the upload"
            && discard["service"] == SERVICE
            && discard["dead_letter_sequence"] == first
            && discard["project"] == "laba",
        "{discard}"
    );
    ensure!(
        listed[0]["reason"] == "the source tier is back",
        "{listed:?}"
    );
    let text = stagehand(&url, &["status", "--actions"]);
    ensure!(
        text.status.success() && said(&text).contains("the lab withdrew the upload"),
        "{}",
        said(&text)
    );

    shutdown.cancel();
    recorder.await??;
    Ok(())
}

/// `stagehand dlq replay --service SERVICE --since 1h --json` with `extra`, as the operator
/// runs it; its JSON answer.
fn bulk_replay(url: &str, extra: &[&str]) -> anyhow::Result<Value> {
    let mut args = vec![
        "dlq",
        "replay",
        "--service",
        SERVICE,
        "--since",
        "1h",
        "--json",
    ];
    args.extend_from_slice(extra);
    let out = stagehand(url, &args);
    ensure!(out.status.success(), "{}", said(&out));
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// The stream sequences of the dead letters listed under `key` of a bulk replay's answer.
fn sequences(answer: &Value, key: &str) -> anyhow::Result<Vec<u64>> {
    Ok(answer[key]
        .as_array()
        .with_context(|| format!("{key} in {answer}"))?
        .iter()
        .filter_map(|l| l["sequence"].as_u64())
        .collect())
}
