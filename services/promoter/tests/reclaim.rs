//! Quota and space come back: every way a stage request ends without its replica — its
//! deadline passing while its promoter is down, its deadline passing while it is queued for a
//! copy slot, a reservation nobody holds any more — gives back the space it reserved and
//! removes its hidden staging folder; the demoter's removal and a promoter's reserve of the
//! same replica cannot undo each other; and a release names its request however either
//! spelled the version.

mod common;

use async_nats::jetstream::kv;
use common::*;
use stagehand_bus::placement::{self, Reservations};
use stagehand_catalogue::{Catalogue, StageState};
use stagehand_promoter::kv::{Coordination, Limits, Refused};
use stagehand_schemas::{Body, Event, EventId, StageReleased};
use stagehand_testkit::{wait_for, wait_until};

const MIB: usize = 1 << 20;

async fn bucket(stack: &Stack) -> kv::Store {
    stack
        .bus
        .jetstream()
        .get_key_value(stagehand_bus::PROMOTER_BUCKET)
        .await
        .unwrap()
}

/// The reservations of the hot tier as stored now.
async fn hot_reservations(store: &kv::Store) -> Reservations {
    placement::reservations(store, "hot", None)
        .await
        .unwrap()
        .value
        .unwrap_or_default()
}

/// The hidden staging folders under a dataset's folder on a tier.
fn staging_folders(dir: &std::path::Path) -> Vec<String> {
    list(dir)
        .into_iter()
        .filter(|e| e.starts_with('.') && e.contains("stagehand-set"))
        .collect()
}

/// Bytes of every file under `dir`, hidden ones included.
fn bytes_under(dir: &std::path::Path) -> u64 {
    let mut total = 0;
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let meta = entry.metadata().unwrap();
        total += if meta.is_dir() {
            bytes_under(&entry.path())
        } else {
            meta.len()
        };
    }
    total
}

/// `n` files of 1 MiB each.
fn mebibytes(seed: u8, n: usize) -> Vec<(String, Vec<u8>)> {
    (0..n)
        .map(|i| (format!("part-{i:02}.bin"), bytes(seed ^ i as u8, MIB)))
        .collect()
}

fn borrowed(files: &[(String, Vec<u8>)]) -> Vec<(&str, Vec<u8>)> {
    files.iter().map(|(p, b)| (p.as_str(), b.clone())).collect()
}

/// The crash path of the issue: a request being copied, its promoter killed, its deadline
/// passing while it is down. After the restart the request fails, its reservation is given
/// back, its hidden staging folder is gone, the tier's usage agrees with what is on it, and a
/// request that fits the quota is accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_deadline_passing_while_the_promoter_is_down_gives_space_and_staging_back() {
    let stack = Stack::start_with(Options {
        hot_quotas: "default = \"16 MiB\"",
        ..Options::default()
    })
    .await;
    let js = stack.bus.jetstream().clone();
    let store = bucket(&stack).await;
    let big = mebibytes(1, 12);
    let (prefix, refs) = stack.put_files("capacity", "big", "v1", &borrowed(&big));
    let version = stack.validated("big", "capacity", &prefix, &refs).await;
    let small = mebibytes(2, 8);
    let (small_prefix, small_refs) = stack.put_files("capacity", "small", "v1", &borrowed(&small));
    let small_version = stack
        .validated("small", "capacity", &small_prefix, &small_refs)
        .await;
    let parent = stack.tier("hot").join(format!("{PROJECT}/big"));
    let replica = format!("{PROJECT}/big/{version}");

    // 2 MiB/s: six seconds for the set, killed once a few files are staged.
    let mut first = spawn(&stack, "first", Some(2 << 20), &[]);
    let deadline = stagehand_schemas::now() + time::Duration::seconds(6);
    let request = stage_request("big", &version, "hot", "job-big", None, Some(deadline));
    stack.publish(&request).await;
    wait_until(WAIT, "a few files staged", || async {
        staging_folders(&parent)
            .iter()
            .any(|s| list(&parent.join(s)).len() >= 2)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", log_of(&stack, "first")));
    first.kill();
    assert!(
        hot_reservations(&store)
            .await
            .replicas
            .contains_key(&replica),
        "the killed copy held its reservation"
    );
    wait_until(WAIT, "the deadline to pass", || async {
        stagehand_schemas::now() > deadline
    })
    .await
    .unwrap();

    let mut second = spawn(&stack, "second", None, &[]);
    let failed = wait_for(WAIT, "stage.failed after the restart", || async {
        answers(&js, "stage.failed", &request.id).await.pop()
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", log_of(&stack, "second")));
    let (reason, _) = failed_reason(&failed);
    assert!(reason.contains("deadline"), "{reason}");
    wait_until(WAIT, "the reservation given back", || async {
        !hot_reservations(&store)
            .await
            .replicas
            .contains_key(&replica)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", log_of(&stack, "second")));
    wait_until(WAIT, "the staging folder removed", || async {
        staging_folders(&parent).is_empty()
    })
    .await
    .unwrap();
    // The tier's usage agrees with what is on it: nothing reserved, nothing there.
    assert_eq!(hot_reservations(&store).await.used_by(PROJECT), 0);
    assert_eq!(bytes_under(&stack.tier("hot").join(PROJECT)), 0);
    assert!(answers(&js, "stage.ready", &request.id).await.is_empty());

    // 8 MiB fits the 16 MiB quota only if the 12 MiB came back.
    let fits = stage_request("small", &small_version, "hot", "job-small", None, None);
    stack.publish(&fits).await;
    let ready = wait_for(WAIT, "the request that fits ready", || async {
        answers(&js, "stage.ready", &fits.id).await.pop()
    })
    .await
    .unwrap_or_else(|e| {
        let failed = futures::executor::block_on(answers(&js, "stage.failed", &fits.id));
        panic!("{e}: {failed:?}\n{}", log_of(&stack, "second"))
    });
    assert_eq!(
        ready_path(&ready),
        stack
            .tier("hot")
            .join(format!("{PROJECT}/small/{small_version}"))
            .display()
            .to_string()
    );
    second.kill();
    stack.stop().await;
}

/// A request queued for a copy slot whose deadline passes fails then, and gives back the space
/// it reserved, instead of copying after its deadline once a slot frees.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_deadline_passing_while_queued_for_a_copy_slot_gives_the_space_back() {
    let mut stack = Stack::start().await;
    let promotion = stack.policies.join("promotion.toml");
    let policy = std::fs::read_to_string(&promotion).unwrap();
    std::fs::write(
        &promotion,
        policy.replace("max_concurrent = 4", "max_concurrent = 1"),
    )
    .unwrap();
    let mut config = stack.promoter_config("a");
    // 1 MiB/s: the first copy holds the only slot for about six seconds.
    config.service.mover.bytes_per_second = Some(MIB as u64);
    stack.run_promoter(config);
    let js = stack.bus.jetstream().clone();
    let store = bucket(&stack).await;
    let slow = mebibytes(3, 6);
    let (slow_prefix, slow_refs) = stack.put_files("capacity", "slow", "v1", &borrowed(&slow));
    let slow_version = stack
        .validated("slow", "capacity", &slow_prefix, &slow_refs)
        .await;
    let queued = [("q.bin", bytes(4, 4096))];
    let (queued_prefix, queued_refs) = stack.put_files("capacity", "queued", "v1", &queued);
    let queued_version = stack
        .validated("queued", "capacity", &queued_prefix, &queued_refs)
        .await;
    settled(&js, "a").await;

    let first = stage_request("slow", &slow_version, "hot", "job-slow", None, None);
    stack.publish(&first).await;
    let slow_parent = stack.tier("hot").join(format!("{PROJECT}/slow"));
    wait_until(WAIT, "the first copy under way", || async {
        !staging_folders(&slow_parent).is_empty()
    })
    .await
    .unwrap();
    let deadline = stagehand_schemas::now() + time::Duration::seconds(2);
    let second = stage_request(
        "queued",
        &queued_version,
        "hot",
        "job-queued",
        None,
        Some(deadline),
    );
    stack.publish(&second).await;
    let failed = wait_for(
        WAIT,
        "the queued request failed at its deadline",
        || async { answers(&js, "stage.failed", &second.id).await.pop() },
    )
    .await
    .unwrap();
    let (reason, retryable) = failed_reason(&failed);
    assert!(
        reason.contains("deadline") && reason.contains("copy slot"),
        "{reason}"
    );
    assert!(retryable);
    let queued_replica = format!("{PROJECT}/queued/{queued_version}");
    assert!(
        !hot_reservations(&store)
            .await
            .replicas
            .contains_key(&queued_replica),
        "the queued request's reservation is given back when it fails"
    );
    // The copy that held the slot is not disturbed.
    wait_for(WAIT, "the first copy ready", || async {
        answers(&js, "stage.ready", &first.id).await.pop()
    })
    .await
    .unwrap();
    assert!(answers(&js, "stage.ready", &second.id).await.is_empty());
    assert!(!stack.tier("hot").join(&queued_replica).exists());
    assert!(staging_folders(&stack.tier("hot").join(format!("{PROJECT}/queued"))).is_empty());
    stack.stop().await;
}

/// At start the promoter reconciles the space reserved on its tiers: a reservation with no
/// live request and no replica is given back and its staging folder removed; one whose
/// replica is on the tier, one whose copy lease a live instance holds, and one the demoter is
/// removing are kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_reconciler_gives_back_only_space_nothing_holds() {
    let mut stack = Stack::start().await;
    let store = bucket(&stack).await;
    let v = |c: char| c.to_string().repeat(64);
    let orphan = format!("{PROJECT}/zz-orphan/{}", v('a'));
    let placed = format!("{PROJECT}/placed/{}", v('b'));
    let leased = format!("{PROJECT}/leased/{}", v('c'));
    let removing = format!("{PROJECT}/removing/{}", v('d'));
    let mut reserved = Reservations::default();
    for p in [&orphan, &placed, &leased, &removing] {
        reserved.replicas.insert(p.clone(), 40 << 20);
    }
    reserved.withdrawing.insert(removing.clone());
    assert!(
        placement::write_reservations(&store, "hot", None, &reserved, None)
            .await
            .unwrap()
    );
    // What a promoter killed mid-copy leaves: a hidden staging folder with a file in it.
    let orphan_parent = stack.tier("hot").join(format!("{PROJECT}/zz-orphan"));
    let staging = orphan_parent.join(format!(".{}.stagehand-set-dead", v('a')));
    std::fs::create_dir_all(&staging).unwrap();
    std::fs::write(staging.join("part-00.bin"), bytes(5, 4096)).unwrap();
    // A replica on the tier.
    let placed_dir = stack.tier("hot").join(&placed);
    std::fs::create_dir_all(&placed_dir).unwrap();
    std::fs::write(placed_dir.join("a.bin"), bytes(6, 4096)).unwrap();
    // A copy another live instance is making.
    let lease_key = format!(
        "copy.{}.{}",
        placement::place("hot", None),
        placement::prefix_hash(&leased)
    );
    store
        .put(
            lease_key,
            serde_json::to_vec(&serde_json::json!({
                "instance": "other",
                "owner": "other:1",
                "request_id": "r-other",
            }))
            .unwrap()
            .into(),
        )
        .await
        .unwrap();

    let mut config = stack.promoter_config("a");
    // The other instance's lease stays live for the whole test.
    config.service.lease_lifetime = std::time::Duration::from_secs(120);
    stack.run_promoter(config);
    // The pass goes in prefix order: once the last one is given back, the others are decided.
    wait_until(WAIT, "the orphaned reservation given back", || async {
        !hot_reservations(&store)
            .await
            .replicas
            .contains_key(&orphan)
    })
    .await
    .unwrap();
    assert!(
        staging_folders(&orphan_parent).is_empty(),
        "staging removed"
    );
    let left = hot_reservations(&store).await;
    assert_eq!(
        left.replicas.keys().cloned().collect::<Vec<_>>(),
        vec![leased.clone(), placed.clone(), removing.clone()]
    );
    assert!(left.withdrawing.contains(&removing), "still the demoter's");
    assert!(placed_dir.join("a.bin").exists());
    stack.stop().await;
}

/// The demoter's give-back and a promoter's reserve of the same replica: while the demoter
/// removes it, a reserve is refused (the request waits) instead of riding on space about to
/// be given back; a reserver cannot give back space the demoter marked; and once the removal
/// is over, a reservation made afresh is not given back when the demoter runs its last step
/// again after a crash. An undone removal unmarks the space.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_removal_and_a_reserve_of_the_same_replica_do_not_undo_each_other() {
    let stack = Stack::start().await;
    let store = bucket(&stack).await;
    let coord = Coordination::new(store.clone(), "a", std::time::Duration::from_secs(30));
    let limits = Limits {
        capacity: 1 << 30,
        quota: Some(100 << 20),
        filesystem: None,
    };
    let prefix = format!("{PROJECT}/cats/{}", "e".repeat(64));
    let reserve = || coord.reserve("hot", None, PROJECT, &prefix, 1 << 20, limits);
    assert_eq!(reserve().await.unwrap(), Ok(()));

    // The demoter takes the use record: the space is marked with it.
    let seen = placement::read_use(&store, "hot", None, &prefix)
        .await
        .unwrap();
    assert!(
        placement::begin_withdraw(&store, "hot", None, &prefix, &seen, "idle")
            .await
            .unwrap()
            .is_some()
    );
    assert!(hot_reservations(&store).await.withdrawing.contains(&prefix));
    // A promoter that finds the folder gone does not ride on the listed space.
    assert_eq!(reserve().await.unwrap(), Err(Refused::Withdrawing));
    // Nor gives back what the removal will.
    assert!(!coord.release("hot", None, &prefix).await.unwrap());
    assert!(
        hot_reservations(&store)
            .await
            .replicas
            .contains_key(&prefix)
    );

    // The folder is gone: the demoter gives the space back and forgets the record.
    assert!(
        placement::release_removed(&store, "hot", None, &prefix)
            .await
            .unwrap()
    );
    placement::forget_use(&store, "hot", None, &prefix)
        .await
        .unwrap();
    // A new copy reserves afresh ...
    assert_eq!(reserve().await.unwrap(), Ok(()));
    // ... and the demoter's last step, run again after a crash, leaves it alone.
    assert!(
        !placement::release_removed(&store, "hot", None, &prefix)
            .await
            .unwrap()
    );
    let now = hot_reservations(&store).await;
    assert_eq!(now.replicas.get(&prefix), Some(&(1 << 20)));
    assert!(now.withdrawing.is_empty());

    // An undone removal gives the space back to the replica, unmarked.
    let seen = placement::read_use(&store, "hot", None, &prefix)
        .await
        .unwrap();
    placement::begin_withdraw(&store, "hot", None, &prefix, &seen, "idle")
        .await
        .unwrap()
        .unwrap();
    placement::end_withdraw(&store, "hot", None, &prefix)
        .await
        .unwrap();
    assert!(hot_reservations(&store).await.withdrawing.is_empty());
    assert_eq!(reserve().await.unwrap(), Ok(()));
    stack.stop().await;
}

/// A release of the stage written with a unique prefix ends the request written with the full
/// digest, and the other way round: in the promoter (the request stops waiting, and is not
/// answered when the version is validated) and in the catalogue (its status is released).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_release_names_its_request_however_the_version_was_written() {
    let mut stack = Stack::start().await;
    stack.run_promoter(stack.promoter_config("a"));
    let js = stack.bus.jetstream().clone();
    let files = [("a.bin", bytes(11, 100))];
    let (prefix, refs) = stack.put_files("capacity", "yaks", "v1", &files);
    let version = stagehand_schemas::version_digest(&refs);
    stack
        .ingest_requested("yaks", "capacity", &prefix, &refs)
        .await;
    settled(&js, "a").await;
    let short = &version[..16];
    // (requested as, released as, job)
    let cases = [
        (version.as_str(), short, "job-full"),
        (short, version.as_str(), "job-prefix"),
    ];
    let mut requests = Vec::new();
    for (asked, _, job) in cases {
        let request = stage_request("yaks", asked, "hot", job, None, None);
        stack.publish(&request).await;
        requests.push(request);
    }
    let bystander = stage_request("yaks", &version, "hot", "job-other", None, None);
    stack.publish(&bystander).await;
    for request in requests.iter().chain([&bystander]) {
        wait_until(WAIT, "the request waiting", || async {
            !answers(&js, "stage.pending", &request.id).await.is_empty()
        })
        .await
        .unwrap();
    }
    for (_, released, job) in cases {
        stack
            .publish(&stage_release("yaks", released, "hot", job))
            .await;
    }
    let catalogue = Catalogue::new(stack.bus.client().clone());
    for request in &requests {
        wait_until(WAIT, "the catalogue shows the request released", || async {
            catalogue
                .stage_request(PROJECT, request.id.as_str())
                .await
                .is_ok_and(|s| s.state == StageState::Released)
        })
        .await
        .unwrap();
    }
    wait_until(WAIT, "the releases handled", || async {
        drained(
            &js,
            stagehand_schemas::subject::REQUESTS.name,
            &["promoter"],
        )
        .await
    })
    .await
    .unwrap();
    stack.validated("yaks", "capacity", &prefix, &refs).await;
    wait_for(WAIT, "the bystander ready", || async {
        answers(&js, "stage.ready", &bystander.id).await.pop()
    })
    .await
    .unwrap();
    for request in &requests {
        assert!(
            answers(&js, "stage.ready", &request.id).await.is_empty(),
            "a released request is not answered"
        );
    }
    // No separate record was made for either spelling of the release.
    for (asked, released, job) in cases {
        let other = EventId::for_stage(PROJECT, job, "yaks", released, "hot", None);
        assert_ne!(asked, released);
        assert!(
            catalogue
                .stage_request(PROJECT, other.as_str())
                .await
                .is_err_and(|e| e.is_not_found()),
            "{job}: no record of its own for the release"
        );
    }
    stack.stop().await;
}

/// A release that carries a reason (a reconciler's) shows it in the stage's status.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_release_with_a_reason_shows_it() {
    let stack = Stack::start().await;
    let version = "f".repeat(64);
    let request = stage_request("owls", &version, "hot", "job-r", None, None);
    stack.publish(&request).await;
    let release = Event::request(
        EventId::derive(&request.id, "reconciled"),
        PROJECT,
        Body::StageReleased(StageReleased {
            dataset: "owls".into(),
            version: version.clone(),
            tier: "hot".into(),
            job_id: "job-r".into(),
            node: None,
            reason: Some("job-r is gone from its scheduler".into()),
        }),
    );
    stack.publish(&release).await;
    let catalogue = Catalogue::new(stack.bus.client().clone());
    let status = wait_for(WAIT, "the release folded", || async {
        catalogue
            .stage_request(PROJECT, request.id.as_str())
            .await
            .ok()
            .filter(|s| s.state == StageState::Released)
    })
    .await
    .unwrap();
    assert_eq!(
        status.reason.as_deref(),
        Some("job-r is gone from its scheduler")
    );
    stack.stop().await;
}
