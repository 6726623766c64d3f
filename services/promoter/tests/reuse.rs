//! Checked before reuse (issue 16, item 1; issue 19, item 5 for the promoter's "already on the
//! tier" answer): a version staged onto hot for one job, released, then damaged three ways in
//! its folder — one byte of one file flipped, one file deleted, a stray file added. A second job
//! asks for the same version on the same tier. Before the fix `stage.ready` came at once with
//! the damaged folder; now the replica is withdrawn first (`replica.damaged`, naming each path
//! and how), repaired through the mover's verified, atomic replacement, recorded again
//! (`replica.created`), and only then is the second job told ready — with byte-exact data.
//! Real nats-server, the real catalogue recorder, the real promoter, posix tiers.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use common::*;
use stagehand_bus::placement;
use stagehand_catalogue::{Readiness, ReadinessKey, kv_key};
use stagehand_schemas::{Body, Event, subject};
use stagehand_testkit::wait_for;

fn files() -> Vec<(&'static str, Vec<u8>)> {
    vec![
        ("train/0001.jpg", bytes(1, 20_000)),
        ("train/0002.jpg", bytes(2, 50_000)),
        ("train/deep/0003.jpg", bytes(3, 7_000)),
        ("labels.csv", b"id,label\n1,cat\n2,dog\n".to_vec()),
    ]
}

/// Every file beneath `set`, relative, sorted.
fn tree(set: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut todo = vec![set.to_owned()];
    while let Some(dir) = todo.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                todo.push(p);
            } else {
                out.push(p.strip_prefix(set).unwrap().display().to_string());
            }
        }
    }
    out.sort();
    out
}

/// Makes a read-only staged file or folder writable, as a careless job or an administrator
/// would before writing there.
fn writable(p: &Path) {
    let mode = std::fs::metadata(p).unwrap().permissions().mode();
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode | 0o200)).unwrap();
}

fn damage_three_ways(set: &Path) {
    writable(set);
    writable(&set.join("train"));
    writable(&set.join("train/deep"));
    let flipped = set.join("train/0002.jpg");
    writable(&flipped);
    let mut b = std::fs::read(&flipped).unwrap();
    b[1234] ^= 0x40;
    std::fs::write(&flipped, b).unwrap();
    std::fs::remove_file(set.join("train/deep/0003.jpg")).unwrap();
    std::fs::write(set.join("notes.txt"), b"scratch a job left behind").unwrap();
}

async fn all_facts(js: &async_nats::jetstream::Context) -> Vec<Event> {
    stagehand_testkit::stored_events(js, subject::FACTS.name, "stagehand.fact.>".to_owned())
        .await
        .unwrap()
}

async fn ready_of(stack: &Stack, request: &Event) -> Event {
    let js = stack.bus.jetstream().clone();
    wait_for(WAIT, "stage.ready", || async {
        answers(&js, "stage.ready", &request.id).await.pop()
    })
    .await
    .unwrap()
}

async fn readiness(stack: &Stack, version: &str) -> Option<Readiness> {
    let kv = stack
        .bus
        .jetstream()
        .get_key_value(stagehand_catalogue::READINESS_BUCKET)
        .await
        .ok()?;
    let key = kv_key(&ReadinessKey {
        project: PROJECT.into(),
        dataset: "cats".into(),
        version: version.into(),
        tier: "hot".into(),
        node: None,
    });
    let value = kv.get(key).await.ok()??;
    serde_json::from_slice(&value).ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_released_replica_damaged_three_ways_is_withdrawn_and_repaired_before_a_second_job_gets_it()
 {
    let mut stack = Stack::start().await;
    stack.run_promoter(stack.promoter_config("a"));
    let files = files();
    let (prefix, refs) = stack.put_files("capacity", "cats", "v1", &files);
    let version = stack.validated("cats", "capacity", &prefix, &refs).await;
    let js = stack.bus.jetstream().clone();

    let first = stage_request("cats", &version, "hot", "job-1", None, None);
    stack.publish(&first).await;
    let set = std::path::PathBuf::from(ready_path(&ready_of(&stack, &first).await));
    stack
        .publish(&stage_release("cats", &version, "hot", "job-1"))
        .await;
    damage_three_ways(&set);

    let second = stage_request("cats", &version, "hot", "job-2", None, None);
    stack.publish(&second).await;
    let ready = ready_of(&stack, &second).await;
    assert_eq!(std::path::PathBuf::from(ready_path(&ready)), set);

    // Byte-exact: every listed file with its bytes, and nothing else.
    let mut want: Vec<String> = files.iter().map(|(p, _)| (*p).to_owned()).collect();
    want.sort();
    assert_eq!(tree(&set), want);
    for (path, bytes) in &files {
        assert_eq!(&std::fs::read(set.join(path)).unwrap(), bytes, "{path}");
    }

    // Withdrawn first: the damage is stated, naming each path and how, before the repair's
    // replica.created and the second job's stage.ready.
    let stored = all_facts(&js).await;
    let at = |pred: &dyn Fn(&Event) -> bool| stored.iter().position(pred);
    let damaged_at = at(&|e| matches!(&e.body, Body::ReplicaDamaged(_))).expect("replica.damaged");
    let Body::ReplicaDamaged(damaged) = &stored[damaged_at].body else {
        unreachable!()
    };
    assert_eq!(damaged.found_by, "fingerprint");
    assert_eq!(damaged.location.prefix, format!("{PROJECT}/cats/{version}"));
    let how: Vec<(&str, &str)> = damaged
        .files
        .iter()
        .map(|f| (f.path.as_str(), f.how.as_str()))
        .collect();
    for expected in [
        ("train/0002.jpg", "modified"),
        ("train/deep/0003.jpg", "missing"),
        ("notes.txt", "stray"),
    ] {
        assert!(how.contains(&expected), "{expected:?} not in {how:?}");
    }
    assert_eq!(damaged.damaged_total as usize, damaged.files.len());
    let repaired_at = stored
        .iter()
        .rposition(|e| matches!(&e.body, Body::ReplicaCreated(_)))
        .unwrap();
    let ready_at = at(&|e| e.id == ready.id).unwrap();
    assert!(
        damaged_at < repaired_at && repaired_at < ready_at,
        "{damaged_at} {repaired_at} {ready_at}"
    );
    let waited = answers(&js, "stage.pending", &second.id).await;
    assert!(
        waited.iter().any(|e| matches!(&e.body,
            Body::StagePending(p) if p.reason.contains("found damaged"))),
        "the second job is told why it waits: {waited:?}"
    );

    // The catalogue has it ready again, from the repaired replica.
    wait_for(WAIT, "readiness ready again", || async {
        readiness(&stack, &version).await.filter(|r| r.ready)
    })
    .await
    .unwrap();

    // The repair recorded a fresh fingerprint: a third job is answered from it at once, no
    // damage stated again.
    let third = stage_request("cats", &version, "hot", "job-3", None, None);
    stack.publish(&third).await;
    ready_of(&stack, &third).await;
    let damaged_facts = facts(&js, "replica.damaged").await;
    assert_eq!(damaged_facts.len(), 1);
    stack.stop().await;
}

/// A replica with no recorded fingerprint (staged before fingerprints, or the record lost) is
/// never trusted: it is verified by hash, and a flipped byte under an unchanged size and mtime
/// is found (`found_by` `hash`), withdrawn and repaired before the job is told ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_without_a_fingerprint_is_verified_by_hash_before_reuse() {
    let mut stack = Stack::start().await;
    stack.run_promoter(stack.promoter_config("a"));
    let files = files();
    let (prefix, refs) = stack.put_files("capacity", "cats", "v1", &files);
    let version = stack.validated("cats", "capacity", &prefix, &refs).await;
    let js = stack.bus.jetstream().clone();
    let first = stage_request("cats", &version, "hot", "job-1", None, None);
    stack.publish(&first).await;
    let set = std::path::PathBuf::from(ready_path(&ready_of(&stack, &first).await));

    let store = js
        .get_key_value(stagehand_bus::PROMOTER_BUCKET)
        .await
        .unwrap();
    let replica = format!("{PROJECT}/cats/{version}");
    assert!(
        placement::fingerprint(&store, "hot", None, &replica)
            .await
            .unwrap()
            .is_some(),
        "the copy recorded its fingerprint"
    );
    placement::forget_fingerprint(&store, "hot", None, &replica)
        .await
        .unwrap();
    // Same size, same mtime: only the bytes tell.
    let path = set.join("labels.csv");
    let mtime = std::fs::metadata(&path).unwrap().modified().unwrap();
    writable(&path);
    let mut b = std::fs::read(&path).unwrap();
    b[3] ^= 0x01;
    std::fs::write(&path, b).unwrap();
    std::fs::File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_modified(mtime)
        .unwrap();

    let second = stage_request("cats", &version, "hot", "job-2", None, None);
    stack.publish(&second).await;
    ready_of(&stack, &second).await;
    assert_eq!(std::fs::read(&path).unwrap(), files[3].1);
    let damaged = facts(&js, "replica.damaged").await;
    assert_eq!(damaged.len(), 1);
    let Body::ReplicaDamaged(d) = &damaged[0].body else {
        unreachable!()
    };
    assert_eq!(d.found_by, "hash");
    assert_eq!(
        d.files
            .iter()
            .map(|f| (f.path.as_str(), f.how.as_str()))
            .collect::<Vec<_>>(),
        vec![("labels.csv", "hash")]
    );
    assert!(
        placement::fingerprint(&store, "hot", None, &replica)
            .await
            .unwrap()
            .is_some(),
        "the repair recorded a fingerprint again"
    );
    stack.stop().await;
}

/// Bytes can rot under unchanged metadata, where no fingerprint sees them. A replica the
/// catalogue holds damaged — here stated by a scrub — is verified by hash and repaired before
/// it is handed out again, even though its fingerprint matches the folder as it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_recorded_damaged_is_verified_by_hash_even_when_its_fingerprint_matches() {
    let mut stack = Stack::start().await;
    stack.run_promoter(stack.promoter_config("a"));
    let files = files();
    let (prefix, refs) = stack.put_files("capacity", "cats", "v1", &files);
    let version = stack.validated("cats", "capacity", &prefix, &refs).await;
    let js = stack.bus.jetstream().clone();
    let first = stage_request("cats", &version, "hot", "job-1", None, None);
    stack.publish(&first).await;
    let set = std::path::PathBuf::from(ready_path(&ready_of(&stack, &first).await));
    stack
        .publish(&stage_release("cats", &version, "hot", "job-1"))
        .await;

    let path = set.join("train/0001.jpg");
    writable(&path);
    let mut b = std::fs::read(&path).unwrap();
    b[99] ^= 0x08;
    std::fs::write(&path, b).unwrap();
    // The rot as a failing disk leaves it: the recorded fingerprint is the folder as it is now.
    let replica = format!("{PROJECT}/cats/{version}");
    let hot = stagehand_mover::Tier::Posix(
        stagehand_mover::PosixTier::open("hot", stack.tier("hot")).unwrap(),
    );
    let now = hot.fingerprint(&replica).await.unwrap();
    let store = js
        .get_key_value(stagehand_bus::PROMOTER_BUCKET)
        .await
        .unwrap();
    placement::put_fingerprint(&store, "hot", None, &replica, &now.encode())
        .await
        .unwrap();

    let scrub = Event::request(
        stagehand_schemas::EventId::for_content(&[b"scrub", replica.as_bytes()]),
        PROJECT,
        Body::ReplicaDamaged(stagehand_schemas::ReplicaDamaged {
            dataset: "cats".into(),
            version: version.clone(),
            location: stagehand_schemas::Location {
                tier: "hot".into(),
                prefix: replica.clone(),
            },
            node: None,
            found_by: "scrub".into(),
            files: vec![stagehand_schemas::DamagedFile {
                path: "train/0001.jpg".into(),
                how: "hash".into(),
                expected_size: None,
                found_size: None,
            }],
            damaged_total: 1,
            reason: "read back by a scrub".into(),
        }),
    );
    stack.publish(&scrub).await;
    wait_for(WAIT, "readiness withdrawn", || async {
        readiness(&stack, &version).await.filter(|r| !r.ready)
    })
    .await
    .unwrap();

    let second = stage_request("cats", &version, "hot", "job-2", None, None);
    stack.publish(&second).await;
    let ready = ready_of(&stack, &second).await;
    assert_eq!(std::fs::read(&path).unwrap(), files[0].1);
    let stored = all_facts(&js).await;
    let damaged_at = stored.iter().position(|e| e.id == scrub.id).unwrap();
    let ready_at = stored.iter().position(|e| e.id == ready.id).unwrap();
    assert!(
        stored[damaged_at..ready_at]
            .iter()
            .any(|e| matches!(&e.body, Body::ReplicaCreated(c) if c.location.tier == "hot")),
        "the repair's replica.created comes between the damage and the answer"
    );
    wait_for(WAIT, "readiness ready again", || async {
        readiness(&stack, &version).await.filter(|r| r.ready)
    })
    .await
    .unwrap();
    stack.stop().await;
}

/// `replica.damaged` of the hot copy of `version`, as the scrub states it: `path` read back
/// and not hashing to its SHA-256. `n` tells two damages of the same copy apart.
fn scrubbed_damaged(version: &str, path: &str, n: u8) -> Event {
    let replica = format!("{PROJECT}/cats/{version}");
    Event::request(
        stagehand_schemas::EventId::for_content(&[b"scrub", replica.as_bytes(), &[n]]),
        PROJECT,
        Body::ReplicaDamaged(stagehand_schemas::ReplicaDamaged {
            dataset: "cats".into(),
            version: version.to_owned(),
            location: stagehand_schemas::Location {
                tier: "hot".into(),
                prefix: replica,
            },
            node: None,
            found_by: "scrub".into(),
            files: vec![stagehand_schemas::DamagedFile {
                path: path.into(),
                how: "hash".into(),
                expected_size: None,
                found_size: None,
            }],
            damaged_total: 1,
            reason: "read back by a scrub".into(),
        }),
    )
}

/// Flips one byte of `path` in place.
fn flip_byte(path: &Path, at: usize) {
    writable(path);
    let mut b = std::fs::read(path).unwrap();
    b[at] ^= 0x08;
    std::fs::write(path, b).unwrap();
}

/// Every `replica.repaired` of a hot copy stored so far.
async fn hot_repairs(
    js: &async_nats::jetstream::Context,
) -> Vec<stagehand_schemas::ReplicaRepaired> {
    all_facts(js)
        .await
        .into_iter()
        .filter_map(|e| match e.body {
            Body::ReplicaRepaired(r) if r.location.tier == "hot" => Some(r),
            _ => None,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_damaged_copy_a_job_holds_is_repaired_at_once_and_one_nobody_holds_waits_for_a_request() {
    let mut stack = Stack::start().await;
    stack.run_promoter(stack.promoter_config("a"));
    let files = files();
    let (prefix, refs) = stack.put_files("capacity", "cats", "v1", &files);
    let version = stack.validated("cats", "capacity", &prefix, &refs).await;
    let js = stack.bus.jetstream().clone();
    let held = stage_request("cats", &version, "hot", "job-1", None, None);
    stack.publish(&held).await;
    let set = std::path::PathBuf::from(ready_path(&ready_of(&stack, &held).await));

    // job-1 still holds the copy when the scrub finds a file rotted: with no new request, the
    // promoter repairs it from capacity and readiness returns.
    let rotted = set.join("train/0002.jpg");
    flip_byte(&rotted, 4321);
    stack
        .publish(&scrubbed_damaged(&version, "train/0002.jpg", 1))
        .await;
    let repaired = wait_for(WAIT, "replica.repaired of the held copy", || async {
        hot_repairs(&js).await.pop()
    })
    .await
    .unwrap();
    assert_eq!(repaired.from_tier, "capacity");
    assert_eq!(repaired.repaired, vec!["train/0002.jpg".to_owned()]);
    assert_eq!(
        repaired.repaired_total, 1,
        "only the damaged file is copied"
    );
    assert_eq!(std::fs::read(&rotted).unwrap(), files[1].1);
    assert_eq!(tree(&set), {
        let mut names: Vec<String> = files.iter().map(|(n, _)| n.to_string()).collect();
        names.sort();
        names
    });
    wait_for(WAIT, "readiness ready again", || async {
        readiness(&stack, &version).await.filter(|r| r.ready)
    })
    .await
    .unwrap();

    // Released, the copy rots again: nobody holds it, so it is left withdrawn (no hot bytes
    // spent on a version nobody asked for again) until a request repairs it on its way.
    stack
        .publish(&stage_release("cats", &version, "hot", "job-1"))
        .await;
    let catalogue = stagehand_catalogue::Catalogue::new(stack.bus.client().clone());
    let placed = stagehand_catalogue::views::Placed {
        project: PROJECT.into(),
        dataset: "cats".into(),
        version: version.clone(),
        prefix: format!("{PROJECT}/cats/{version}"),
        files: files.len() as u64,
        bytes: 0,
        made_at: None,
        durable_elsewhere: false,
        shared_elsewhere: false,
        verified_by: None,
        last_verified: None,
    };
    wait_for(WAIT, "job-1's release folded", || async {
        let holds = stagehand_catalogue::views::holds(&catalogue, &placed, "hot", None).await;
        holds.ok().filter(|h| h.live_jobs.is_empty())
    })
    .await
    .unwrap();
    flip_byte(&rotted, 17);
    stack
        .publish(&scrubbed_damaged(&version, "train/0002.jpg", 2))
        .await;
    let facts_consumer = "promoter-facts-a";
    wait_for(WAIT, "the promoter handled the second damage", || async {
        let facts = js.get_stream(subject::FACTS.name).await.ok()?;
        let info = facts.consumer_info(facts_consumer).await.ok()?;
        (info.num_pending == 0 && info.num_ack_pending == 0).then_some(())
    })
    .await
    .unwrap();
    assert_eq!(
        hot_repairs(&js).await.len(),
        1,
        "a copy nobody holds is not repaired"
    );
    assert_ne!(std::fs::read(&rotted).unwrap(), files[1].1);
    let next = stage_request("cats", &version, "hot", "job-2", None, None);
    stack.publish(&next).await;
    ready_of(&stack, &next).await;
    assert_eq!(std::fs::read(&rotted).unwrap(), files[1].1);
    stack.stop().await;
}
