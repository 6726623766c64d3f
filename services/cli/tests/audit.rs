//! `stagehand audit TIER` as a real process against a real nats-server, the real recorder and
//! the S3 server: a planted stray folder and an old staging leftover are reported (and
//! quarantined intact with `--quarantine` once past the grace, on posix and on S3), a deleted
//! replica is reported lost and announced with `replica.damaged` (`found_by` `audit`), a
//! promotion in flight (a stage requested whose staging folder exists) is not reported, and
//! stray data above the threshold stops the audit with nothing moved.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use stagehand_catalogue::{ReplicaState, StageState};
use stagehand_schemas::{
    Body, DatasetValidated, Event, EventId, FileRef, Location, ReplicaCreated, sha256_hex,
    version_digest,
};
use stagehand_testkit::{
    PolicyFiles, S3Server, Stack, StageRequest, TierSpec, VALIDATION, backdate, pattern_bytes,
    stored_facts, wait_until,
};

const WAIT: Duration = Duration::from_secs(30);
const PROJECT: &str = "lab-a";
/// Each placed version: three files of this many bytes.
const FILE: usize = 64 * 1024;

/// `scrub.toml` with `[audit]` as given.
fn scrub_toml(audit: &str) -> String {
    format!(
        "[period]\nhot = \"7d\"\n\n[budget]\nbytes_per_second = \"1 GiB\"\nfiles_per_second = 1000\n\n[audit]\n{audit}\n"
    )
}

/// The stack: posix source and hot tiers, capacity posix or on the S3 server's `bucket`, the
/// recorder, and `scrub.toml` with `[audit]` as given.
async fn stack(s3: Option<(&S3Server, &str)>, audit: &str) -> Stack {
    let capacity = match s3 {
        None => TierSpec::posix("capacity", "cap"),
        Some((s3, bucket)) => TierSpec::s3("capacity", "cap", s3, bucket),
    };
    Stack::builder()
        .tier("source", TierSpec::posix("source", "lab"))
        .tier("capacity", capacity)
        .tier(
            "hot",
            TierSpec::posix("hot", "hot")
                .capacity("1 GiB")
                .watermarks(0.9, 0.8),
        )
        .policies(
            PolicyFiles::new()
                .validation(VALIDATION)
                .file("scrub.toml", scrub_toml(audit)),
        )
        .recorder()
        .start()
        .await
}

/// A version of `dataset` (three files from `seed`): validated on capacity (its files put
/// there, on the S3 server when `s3` is given, unless `absent`) and, when `hot`, copied to hot
/// as the promoter leaves it. Returns (version, prefix).
async fn place(
    stack: &Stack,
    s3: Option<(&S3Server, &str)>,
    dataset: &str,
    seed: u8,
    hot: bool,
    absent: bool,
) -> (String, String) {
    let files: Vec<(String, Vec<u8>)> = (0..3u8)
        .map(|i| (format!("part-{i:02}.bin"), pattern_bytes(seed + i, FILE)))
        .collect();
    let refs: Vec<FileRef> = files
        .iter()
        .map(|(p, b)| FileRef::new(p.as_str(), b.len() as u64, sha256_hex(b)))
        .collect();
    let version = version_digest(&refs);
    let prefix = format!("{PROJECT}/{dataset}/{version}");
    for (name, bytes) in &files {
        if !absent {
            match s3 {
                Some((s3, bucket)) => s3
                    .put_object(bucket, &format!("{prefix}/{name}"), bytes)
                    .unwrap(),
                None => write(&stack.tier("capacity").join(&prefix).join(name), bytes),
            }
        }
        if hot {
            write(&stack.tier("hot").join(&prefix).join(name), bytes);
        }
    }
    let total: u64 = refs.iter().map(|f| f.size).sum();
    let ingest = EventId::for_ingest(PROJECT, dataset, &version);
    stack
        .publish(&Event::request(
            EventId::derive(&ingest, "validated"),
            PROJECT,
            Body::DatasetValidated(DatasetValidated {
                dataset: dataset.into(),
                version: version.clone(),
                source: Location {
                    tier: "capacity".into(),
                    prefix: prefix.clone(),
                },
                files: refs,
                manifest: None,
                total_bytes: total,
                requested_by: "test".into(),
                request_id: ingest.clone(),
                labels: vec![],
            }),
        ))
        .await;
    if hot {
        stack
            .publish(&Event::request(
                EventId::derive(&ingest, "replica:hot"),
                PROJECT,
                Body::ReplicaCreated(ReplicaCreated {
                    dataset: dataset.into(),
                    version: version.clone(),
                    location: Location {
                        tier: "hot".into(),
                        prefix: prefix.clone(),
                    },
                    files: 3,
                    total_bytes: total,
                    verified_by: "read-back".into(),
                    node: None,
                }),
            ))
            .await;
    }
    let tiers: &[&str] = if hot {
        &["capacity", "hot"]
    } else {
        &["capacity"]
    };
    wait_until(WAIT, "the recorder to list the copies", || async {
        stack
            .catalogue()
            .version(Some(PROJECT), dataset, &version)
            .await
            .is_ok_and(|v| {
                tiers.iter().all(|t| {
                    v.replicas
                        .iter()
                        .any(|r| &r.tier == t && r.state == ReplicaState::Present)
                })
            })
    })
    .await
    .unwrap();
    (version, prefix)
}

fn write(path: &Path, bytes: &[u8]) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, bytes).unwrap();
}

/// `stagehand audit <args> --json`: its exit code and its object.
fn audit_json(stack: &Stack, env: &[(&str, &str)], args: &[&str]) -> (i32, serde_json::Value) {
    let (code, stdout, stderr) = audit(stack, env, &[args, &["--json"]].concat());
    let json = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("exit {code}: {e}: {stdout}\n{stderr}"));
    (code, json)
}

/// `stagehand audit <args>`: its exit code, stdout and stderr.
fn audit(stack: &Stack, env: &[(&str, &str)], args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_stagehand"))
        .arg("audit")
        .args(args)
        .arg("--policies")
        .arg(&stack.policies)
        .args(["--nats", &stack.nats.url()])
        .envs(env.iter().copied())
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The stray entries' paths and kinds, and the lost replicas' prefixes.
fn found(report: &serde_json::Value) -> (Vec<(String, String)>, Vec<String>) {
    let stray = report["stray"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["path"].as_str().unwrap().to_owned(),
                s["kind"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let lost = report["lost"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["prefix"].as_str().unwrap().to_owned())
        .collect();
    (stray, lost)
}

/// Guards issue 16's audit test: a planted stray folder and an old staging leftover are
/// reported per project with their bytes, a deleted hot replica is reported lost and
/// announced with `replica.damaged` (`found_by` `audit`, every file `missing`), which the
/// catalogue folds (readiness withdrawn); a promotion in flight — a stage requested whose
/// staging folder exists on hot — is not reported; the capacity tier, whole, is clean (exit 0).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_planted_stray_folder_and_a_deleted_replica_are_reported_and_a_promotion_in_flight_is_not()
 {
    // One of two versions lost is half the tier: above the default threshold, which
    // `a_tier_that_lists_empty_stops_the_audit_and_announces_nothing_lost` guards.
    let stack = stack(None, "stop_above_fraction = 0.6").await;
    let (_, kept) = place(&stack, None, "cats", 1, true, false).await;
    let (lost_version, lost) = place(&stack, None, "dogs", 11, true, false).await;
    // A promotion in flight: version of "birds" requested on hot, its staging folder there.
    let (birds, _) = place(&stack, None, "birds", 21, false, false).await;
    stack
        .publish(&StageRequest::new(PROJECT, "birds", &birds, "hot", "job-1").event())
        .await;
    write(
        &stack
            .tier("hot")
            .join(format!("{PROJECT}/birds/.{birds}.stagehand-set-h1-42"))
            .join("part-00.bin"),
        &[7u8; 5000],
    );
    wait_until(WAIT, "the stage request recorded pending", || async {
        stack
            .catalogue()
            .open_stages(StageState::Pending, &[], None, None)
            .await
            .is_ok_and(|(page, _)| page.items.iter().any(|s| s.dataset == "birds"))
    })
    .await
    .unwrap();
    // A stray folder no replica claims, and a staging leftover two days old beside a version.
    write(
        &stack.tier("hot").join(format!("{PROJECT}/strays/x/a.bin")),
        &[1u8; 1000],
    );
    let leftover = format!("{PROJECT}/cats/.{}.stagehand-set-h9-1", "e".repeat(64));
    write(
        &stack.tier("hot").join(&leftover).join("b.bin"),
        &[2u8; 300],
    );
    backdate(&stack.tier("hot").join(&leftover), 2);
    std::fs::remove_dir_all(stack.tier("hot").join(&lost)).unwrap();

    let (code, report) = audit_json(&stack, &[], &["hot"]);
    assert_eq!(code, 1, "{report:#}");
    let (stray, lost_found) = found(&report);
    assert_eq!(
        stray,
        vec![
            (leftover.clone(), "staging".to_owned()),
            (format!("{PROJECT}/strays"), "folder".to_owned()),
        ],
        "{report:#}"
    );
    assert_eq!(lost_found, vec![lost.clone()], "{report:#}");
    assert_eq!(report["stray_bytes"], 1300);
    assert_eq!(report["stopped"], false);
    assert!(report["in_flight"].as_u64().unwrap() >= 1, "{report:#}");
    let (first, second) = (
        report["window"][0].as_u64().unwrap(),
        report["window"][1].as_u64().unwrap(),
    );
    assert!(first > 0 && first <= second, "{report:#}");
    assert!(stack.tier("hot").join(format!("{PROJECT}/strays")).exists());
    assert!(stack.tier("hot").join(&kept).exists());

    let damaged: Vec<_> = stored_facts(stack.bus.jetstream(), "replica.damaged")
        .await
        .into_iter()
        .filter_map(|e| match e.body {
            Body::ReplicaDamaged(d) => Some(d),
            _ => None,
        })
        .collect();
    assert_eq!(damaged.len(), 1, "{damaged:?}");
    let d = &damaged[0];
    assert_eq!(
        (
            d.found_by.as_str(),
            d.location.tier.as_str(),
            d.location.prefix.as_str()
        ),
        ("audit", "hot", lost.as_str())
    );
    assert_eq!(d.version, lost_version);
    assert_eq!(d.damaged_total, 3);
    assert!(d.files.iter().all(|f| f.how == "missing"), "{d:?}");
    wait_until(
        WAIT,
        "the catalogue to mark the lost replica damaged",
        || async {
            stack
                .catalogue()
                .version(Some(PROJECT), "dogs", &lost_version)
                .await
                .is_ok_and(|v| {
                    v.replicas
                        .iter()
                        .any(|r| r.tier == "hot" && r.state == ReplicaState::Damaged)
                })
        },
    )
    .await
    .unwrap();

    // The table: one line for the project. The damaged replica still claims its folder, so
    // it is not lost again (and not announced twice).
    let (code, text, stderr) = audit(&stack, &[], &["hot"]);
    assert_eq!(code, 1, "{text}\n{stderr}");
    let line = text
        .lines()
        .find(|l| l.starts_with(PROJECT))
        .unwrap_or_else(|| panic!("{text}"));
    let cols: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(cols[..2], [PROJECT, "2"], "{text}");
    assert_eq!(cols.last(), Some(&"0"), "{text}");
    assert!(text.contains(&format!("{PROJECT}/strays")), "{text}");

    // Everything catalogued on capacity is there, and nothing else: clean.
    let (code, report) = audit_json(&stack, &[], &["capacity"]);
    assert_eq!(code, 0, "{report:#}");
    assert_eq!(found(&report), (vec![], vec![]));
    stack.stop().await;
}

/// Guards the quarantine: with `quarantine_after = "0s"`, `--quarantine` renames a stray
/// folder into `<root>/.stagehand-quarantine/<date>/<path>` with every byte intact, and the
/// next audit finds nothing (the quarantine folder is not audited).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn quarantine_moves_stray_data_intact_after_the_grace() {
    let stack = stack(None, "quarantine_after = \"0s\"\nstop_above_fraction = 1.0").await;
    place(&stack, None, "cats", 1, true, false).await;
    let stray = stack.tier("hot").join(format!("{PROJECT}/strays"));
    let bytes = pattern_bytes(5, 4000);
    write(&stray.join("deep/c.bin"), &bytes);

    let (code, report) = audit_json(&stack, &[], &["hot", "--quarantine"]);
    assert_eq!(code, 1, "{report:#}");
    let to = report["stray"][0]["quarantined_to"]
        .as_str()
        .unwrap_or_else(|| panic!("{report:#}"));
    let date = time::OffsetDateTime::now_utc().date().to_string();
    assert!(
        [
            format!(".stagehand-quarantine/{date}/{PROJECT}/strays"),
            // The audit may have run on the day before the check.
            format!(
                ".stagehand-quarantine/{}/{PROJECT}/strays",
                (time::OffsetDateTime::now_utc() - time::Duration::days(1)).date()
            ),
        ]
        .contains(&to.to_owned()),
        "{to}"
    );
    assert!(!stray.exists());
    let moved = stack.tier("hot").join(to).join("deep/c.bin");
    assert_eq!(std::fs::read(&moved).unwrap(), bytes);

    let (code, report) = audit_json(&stack, &[], &["hot"]);
    assert_eq!(code, 0, "{report:#}");
    assert_eq!(found(&report), (vec![], vec![]));
    stack.stop().await;
}

/// Guards the threshold: stray bytes above `stop_above_fraction` of the tier's catalogued
/// bytes stop the audit (exit 2, `stopped`), and nothing is quarantined though asked and past
/// the grace.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stray_data_above_the_threshold_stops_the_audit_and_moves_nothing() {
    let stack = stack(None, "quarantine_after = \"0s\"\nstop_above_fraction = 0.2").await;
    place(&stack, None, "cats", 1, true, false).await;
    // 3 × 64 KiB catalogued; 100 KiB stray is above 20 %.
    let stray = stack.tier("hot").join(format!("{PROJECT}/strays/big.bin"));
    write(&stray, &pattern_bytes(3, 100 * 1024));

    let (code, report) = audit_json(&stack, &[], &["hot", "--quarantine"]);
    assert_eq!(code, 2, "{report:#}");
    assert_eq!(report["stopped"], true);
    assert_eq!(report["catalogued_bytes"], 3 * FILE as u64);
    assert!(report["stray"][0]["quarantined_to"].is_null(), "{report:#}");
    assert!(stray.exists());
    assert!(!stack.tier("hot").join(".stagehand-quarantine").exists());
    let (code, text, _) = audit(&stack, &[], &["hot"]);
    assert_eq!(code, 2);
    assert!(text.contains("a person must look"), "{text}");
    stack.stop().await;
}

/// Guards the threshold's other side: a root that lists empty (a filesystem not mounted, an
/// audit run on the wrong node) makes every copy look lost. The audit stops (exit 2) and
/// announces none of them: no `replica.damaged`, so no readiness withdrawn and no repair
/// sent onto the wrong disk.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tier_that_lists_empty_stops_the_audit_and_announces_nothing_lost() {
    let stack = stack(None, "").await;
    let (_, cats) = place(&stack, None, "cats", 1, true, false).await;
    let (_, dogs) = place(&stack, None, "dogs", 11, true, false).await;
    std::fs::remove_dir_all(stack.tier("hot").join(PROJECT)).unwrap();

    let (code, report) = audit_json(&stack, &[], &["hot"]);
    assert_eq!(code, 2, "{report:#}");
    assert_eq!(report["stopped"], true);
    let (_, lost) = found(&report);
    assert_eq!(lost, vec![cats, dogs], "{report:#}");
    assert!(
        report["lost"]
            .as_array()
            .unwrap()
            .iter()
            .all(|l| l["damaged_fact"].is_null()),
        "{report:#}"
    );
    assert!(
        stored_facts(stack.bus.jetstream(), "replica.damaged")
            .await
            .is_empty()
    );
    let (code, text, _) = audit(&stack, &[], &["hot"]);
    assert_eq!(code, 2);
    assert!(text.contains("not announced (stopped)"), "{text}");
    stack.stop().await;
}

/// Guards the audit of an S3 tier (the S3 server): a stray object beneath a project's folder
/// is reported with its bytes, a catalogued replica with no objects is lost and announced.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_s3_tier_reports_a_stray_object_and_a_lost_replica() {
    let s3 = tokio::task::spawn_blocking(S3Server::shared).await.unwrap();
    let bucket = s3.unique_bucket("audit");
    let at = Some((s3, bucket.as_str()));
    let stack = stack(at, "stop_above_fraction = 0.6").await;
    let (_, kept) = place(&stack, at, "cats", 1, false, false).await;
    let (_, lost) = place(&stack, at, "dogs", 11, false, true).await;
    s3.put_object(&bucket, &format!("{PROJECT}/strays/x/a.bin"), &[1u8; 700])
        .unwrap();
    // An object inside a replica's folder is the replica's (the scrub judges its contents).
    s3.put_object(&bucket, &format!("{kept}/extra.bin"), &[1u8; 10])
        .unwrap();

    let env = s3.client_env();
    let (code, report) = audit_json(&stack, &env, &["capacity"]);
    assert_eq!(code, 1, "{report:#}");
    assert_eq!(
        found(&report),
        (
            vec![(format!("{PROJECT}/strays"), "folder".to_owned())],
            vec![lost.clone()]
        ),
        "{report:#}"
    );
    assert_eq!(report["stray"][0]["bytes"], 700);
    let damaged = stored_facts(stack.bus.jetstream(), "replica.damaged").await;
    assert_eq!(damaged.len(), 1);
    stack.stop().await;
}

/// Guards the quarantine on S3, which has no rename: with `--quarantine` past the grace, each
/// stray object is moved to `.stagehand-quarantine/<date>/<key>` with its bytes intact and is
/// gone from its old key; the replica's objects stay; the next audit finds nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_s3_tier_quarantines_stray_objects_intact_after_the_grace() {
    let s3 = tokio::task::spawn_blocking(S3Server::shared).await.unwrap();
    let bucket = s3.unique_bucket("quarantine");
    let at = Some((s3, bucket.as_str()));
    let stack = stack(at, "quarantine_after = \"0s\"\nstop_above_fraction = 1.0").await;
    let (_, kept) = place(&stack, at, "cats", 1, false, false).await;
    let stray = [
        (format!("{PROJECT}/strays/x/a.bin"), pattern_bytes(7, 700)),
        (format!("{PROJECT}/strays/b.bin"), pattern_bytes(8, 3000)),
    ];
    for (key, bytes) in &stray {
        s3.put_object(&bucket, key, bytes).unwrap();
    }

    let env = s3.client_env();
    let (code, report) = audit_json(&stack, &env, &["capacity", "--quarantine"]);
    assert_eq!(code, 1, "{report:#}");
    let to = report["stray"][0]["quarantined_to"]
        .as_str()
        .unwrap_or_else(|| panic!("{report:#}"));
    let date = to
        .strip_prefix(".stagehand-quarantine/")
        .and_then(|rest| rest.strip_suffix(&format!("/{PROJECT}/strays")))
        .unwrap_or_else(|| panic!("{to}"));
    for (key, bytes) in &stray {
        let moved = format!(".stagehand-quarantine/{date}/{key}");
        assert_eq!(&s3.get_object(&bucket, &moved).unwrap(), bytes, "{moved}");
        assert!(s3.get_object(&bucket, key).is_err(), "{key} still there");
    }

    let (code, report) = audit_json(&stack, &env, &["capacity"]);
    assert_eq!(code, 0, "{report:#}");
    assert_eq!(found(&report), (vec![], vec![]));
    assert_eq!(
        s3.get_object(&bucket, &format!("{kept}/part-00.bin"))
            .unwrap(),
        pattern_bytes(1, FILE),
        "the replica's objects stay"
    );
    stack.stop().await;
}
