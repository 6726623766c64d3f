//! `stagehand tier usage` as a real process against a real nats-server and the real recorder:
//! a hot tier filled past its high watermark shows Stagehand's bytes, others' bytes, the held
//! bytes and each project's share exactly; after the demoter drains it, the same command shows
//! it at its low watermark.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use stagehand_bus::{Bus, BusConfig, CancellationToken};
use stagehand_catalogue::{Catalogue, ReplicaState};
use stagehand_schemas::{
    Body, DatasetValidated, Event, EventId, FileRef, Location, ReplicaCreated, StageReleased,
    StageRequested, sha256_hex, version_digest,
};
use stagehand_testkit::{NatsServer, wait_until};

const WAIT: Duration = Duration::from_secs(30);
const MIB: u64 = 1 << 20;

fn policies(dir: &Path, root: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("tiers.toml"),
        format!(
            "[tiers.source]\nkind = \"posix\"\nrole = \"source\"\nfailure_domain = \"lab\"\nroot = \"{}\"\n\n\
             [tiers.capacity]\nkind = \"posix\"\nrole = \"capacity\"\nfailure_domain = \"cap\"\nroot = \"{}\"\n\n\
             [tiers.hot]\nkind = \"posix\"\nrole = \"hot\"\nfailure_domain = \"hot\"\nroot = \"{}\"\n\
             capacity = \"10 MiB\"\nhigh_watermark = 0.85\nlow_watermark = 0.5\n\n\
             [tiers.hot.quotas]\ndefault = \"8 MiB\"\n",
            root.join("source").display(),
            root.join("capacity").display(),
            root.join("hot").display()
        ),
    )
    .unwrap();
    std::fs::write(
        dir.join("validation.toml"),
        "max_file_size = \"1 GiB\"\nmax_entries = 1000\nmax_total_bytes = \"1 GiB\"\nallowed_suffixes = []\ndenied_suffixes = []\nallow_hidden = false\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("demotion.toml"),
        "idle_after = \"1d\"\ncheck_every = \"1h\"\ntarget = \"capacity\"\n",
    )
    .unwrap();
}

/// A 2 MiB version of `project/dataset` on hot (and capacity), announced as the promoter and
/// the validator would; staged by `job` (released unless `held`).
async fn place(
    bus: &Bus,
    root: &Path,
    project: &str,
    dataset: &str,
    held: bool,
    minutes: i64,
) -> String {
    let body: Vec<u8> = (0..2 * MIB)
        .map(|i| (i % 251) as u8 ^ dataset.len() as u8)
        .collect();
    let refs = vec![FileRef::new(
        "data.bin",
        body.len() as u64,
        sha256_hex(&body),
    )];
    let version = version_digest(&refs);
    let prefix = format!("{project}/{dataset}/{version}");
    for tier in ["capacity", "hot"] {
        let dir = root.join(tier).join(&prefix);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("data.bin"), &body).unwrap();
    }
    let ingest = EventId::for_ingest(project, dataset, &version);
    let location = |tier: &str| Location {
        tier: tier.into(),
        prefix: prefix.clone(),
    };
    let events = [
        Event::request(
            EventId::derive(&ingest, "validated"),
            project,
            Body::DatasetValidated(DatasetValidated {
                dataset: dataset.into(),
                version: version.clone(),
                source: location("capacity"),
                files: refs.clone(),
                manifest: None,
                total_bytes: 2 * MIB,
                requested_by: "test".into(),
                request_id: ingest.clone(),
                labels: vec![],
            }),
        ),
        Event::request(
            EventId::derive(&ingest, "replica:hot"),
            project,
            Body::ReplicaCreated(ReplicaCreated {
                dataset: dataset.into(),
                version: version.clone(),
                location: location("hot"),
                files: 1,
                total_bytes: 2 * MIB,
                verified_by: "read-back".into(),
                node: None,
            }),
        ),
    ];
    for e in &events {
        bus.publish(e).await.unwrap();
    }
    let at = time::OffsetDateTime::now_utc() - time::Duration::minutes(minutes);
    let mut request = Event::request(
        EventId::for_stage(project, "job", dataset, &version, "hot", None),
        project,
        Body::StageRequested(StageRequested {
            dataset: dataset.into(),
            version: version.clone(),
            tier: "hot".into(),
            job_id: "job".into(),
            requested_by: "slurm".into(),
            deadline: None,
            node: None,
            form: None,
            hold_until: None,
        }),
    );
    request.occurred_at = at;
    bus.publish(&request).await.unwrap();
    if !held {
        let mut release = Event::request(
            EventId::for_stage_release(project, "job", dataset, &version, "hot", None),
            project,
            Body::StageReleased(StageReleased {
                dataset: dataset.into(),
                version: version.clone(),
                tier: "hot".into(),
                job_id: "job".into(),
                node: None,
                reason: None,
            }),
        );
        release.occurred_at = at + time::Duration::minutes(1);
        bus.publish(&release).await.unwrap();
    }
    let catalogue = Catalogue::new(bus.client().clone());
    wait_until(WAIT, "the recorder to fold the placement", || async {
        let Ok(v) = catalogue.version(Some(project), dataset, &version).await else {
            return false;
        };
        let Ok(s) = catalogue
            .stage_requests(project, None, Some(dataset), Some(&version), None)
            .await
        else {
            return false;
        };
        v.replicas
            .iter()
            .any(|r| r.tier == "hot" && r.state == ReplicaState::Present)
            && s.items.len() == 1
            && (held || s.items[0].state == stagehand_catalogue::StageState::Released)
    })
    .await
    .unwrap();
    version
}

/// `stagehand catalogue show D@V` as text.
fn show(nats: &NatsServer, project: &str, dataset: &str, version: &str) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_stagehand"))
        .args(["catalogue", "show", &format!("{dataset}@{version}")])
        .args(["--project", project, "--nats", &nats.url()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn usage(nats: &NatsServer, policies: &Path) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_stagehand"))
        .args(["tier", "usage", "hot", "--json", "--policies"])
        .arg(policies)
        .args(["--nats", &nats.url()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    rows[0].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tier_usage_shows_a_hot_tier_filling_and_the_demoter_draining_it() {
    let nats = NatsServer::start();
    let tmp = tempfile::tempdir().unwrap();
    let tiers = tmp.path().join("tiers");
    let policy_dir = tmp.path().join("policies");
    policies(&policy_dir, &tiers);
    let bus = Bus::connect(&BusConfig::new(nats.url())).await.unwrap();
    bus.provision().await.unwrap();
    let stop = CancellationToken::new();
    let recorder = stagehand_catalogue_recorder::config(&nats.url(), tmp.path().join("recorder"));
    let recorder = tokio::spawn(stagehand_catalogue_recorder::run(recorder, stop.clone()));

    // lab-a: three versions, one held by its job; lab-b: two. 10 MiB in all: 100 %.
    let a0 = place(&bus, &tiers, "lab-a", "a0", true, 60).await;
    place(&bus, &tiers, "lab-a", "a1", false, 50).await;
    place(&bus, &tiers, "lab-a", "a2", false, 40).await;
    place(&bus, &tiers, "lab-b", "b0", false, 30).await;
    let b1 = place(&bus, &tiers, "lab-b", "b1", false, 20).await;

    let before = usage(&nats, &policy_dir);
    assert_eq!(before["tier"], "hot");
    assert_eq!(before["capacity"], 10 * MIB);
    assert_eq!(before["used_by_stagehand"], 10 * MIB);
    assert_eq!(before["held"], 2 * MIB);
    assert_eq!(before["replicas"], 5);
    assert_eq!(before["high_watermark"], 0.85);
    assert!(before["used_by_others"].is_u64(), "{before}");
    let projects = before["projects"].as_array().unwrap();
    assert_eq!(projects.len(), 2);
    assert_eq!(projects[0]["project"], "lab-a");
    assert_eq!(projects[0]["used"], 6 * MIB);
    assert_eq!(projects[0]["held"], 2 * MIB);
    assert_eq!(projects[0]["quota"], 8 * MIB);
    assert_eq!(projects[1]["used"], 4 * MIB);

    let demoter =
        stagehand_demoter::config(&nats.url(), &policy_dir, tmp.path().join("state/demoter"));
    let demoter = tokio::spawn(stagehand_demoter::run(demoter, stop.clone()));
    // 10 MiB → a1 (8) → a2 (6) → b0 (4 ≤ 5 MiB): the held a0 and the newest b1 stay.
    wait_until(WAIT, "the demoter to drain the tier", || async {
        usage(&nats, &policy_dir)["used_by_stagehand"] == 4 * MIB
    })
    .await
    .unwrap();
    let after = usage(&nats, &policy_dir);
    assert_eq!(after["replicas"], 2);
    assert_eq!(after["held"], 2 * MIB);
    let projects = after["projects"].as_array().unwrap();
    assert_eq!(projects[0]["used"], 2 * MIB);
    assert_eq!(projects[1]["used"], 2 * MIB);

    // `catalogue show D@V` says why each replica stays: a0's hot replica is held by its job's
    // live stage request, b1's by none (it stays because the tier is at its low watermark).
    let held = show(&nats, "lab-a", "a0", &a0);
    let hot = held
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("hot "))
        .nth(1)
        .unwrap_or_default();
    assert!(hot.trim_start().starts_with("held by job job ("), "{held}");
    let id = EventId::for_stage("lab-a", "job", "a0", &a0, "hot", None);
    assert!(hot.contains(&format!("request {id})")), "{held}");
    let unheld = show(&nats, "lab-b", "b1", &b1);
    assert!(unheld.contains("      held by no live stage"), "{unheld}");

    // The text form names the tier and its watermarks.
    let text = Command::new(env!("CARGO_BIN_EXE_stagehand"))
        .args(["tier", "usage", "--policies"])
        .arg(&policy_dir)
        .args(["--nats", &nats.url()])
        .output()
        .unwrap();
    let text = String::from_utf8(text.stdout).unwrap();
    assert!(
        text.starts_with("hot (hot): capacity 10.0 MiB, used by Stagehand 4.0 MiB (40.0 %)"),
        "{text}"
    );
    assert!(text.contains("watermarks 85 % / 50 %"), "{text}");

    stop.cancel();
    demoter.await.unwrap().unwrap();
    recorder.await.unwrap().unwrap();
}
