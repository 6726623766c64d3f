//! The demoter against a real nats-server, the real catalogue recorder and posix tiers:
//! watermarks drained in least-recently-staged order, held replicas untouched, the last
//! verified copy copied down before it is removed, and readers that never see the readiness
//! bucket and the tier disagree.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use common::*;
use stagehand_schemas::Body;
use stagehand_testkit::{wait_for, wait_until};

/// Guards the watermark rule and the last-copy rule together: a hot tier at 100 % of its
/// capacity (high 85 %, low 50 %) loses exactly the least recently staged unheld replicas
/// until it is at or below 50 %; the held one (older than all of them) stays; the one whose
/// only verified copy is on hot is copied to capacity, read back and announced before its
/// removal.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_hot_tier_is_drained_to_its_low_watermark_least_recently_staged_first_and_held_replicas_stay()
 {
    let mut stack = Stack::start(Options::default()).await;
    let js = stack.bus.jetstream().clone();
    // Five versions of 2 MiB each fill the 10 MiB tier.
    let mut placed = Vec::new();
    for (i, durable) in [true, true, false, true, true].into_iter().enumerate() {
        placed.push(
            stack
                .place(&format!("ds{i}"), i as u8 * 16, 2, MIB, durable)
                .await,
        );
    }
    // Staged and released in the order 1, 0, 2, 3, 4 (minutes ago); ds1 is still held by its
    // job, and is the least recently staged of all.
    let order = [1usize, 0, 2, 3, 4];
    for (rank, &i) in order.iter().enumerate() {
        let minutes = 50 - 10 * rank as i64;
        stack
            .stage(&placed[i], &format!("job-{i}"), ago(minutes + 5))
            .await;
        if i != 1 {
            stack
                .release(&placed[i], &format!("job-{i}"), ago(minutes))
                .await;
        }
    }
    for (i, p) in placed.iter().enumerate() {
        stack.recorded(p, 1, usize::from(i != 1)).await;
    }

    stack.run_demoter();
    // 10 MiB → ds0 (8) → ds2 (6) → ds3 (4 ≤ 5): three removals, then it stops. The three
    // are chosen in that order and carried at once, so their facts may come in any order.
    let mut expected: Vec<String> = [0, 2, 3]
        .iter()
        .map(|&i| placed[i].version.clone())
        .collect();
    expected.sort();
    wait_until(WAIT, "three replicas removed from hot", || async {
        removed_from_hot(&js).await.len() >= 3
            && [0, 2, 3]
                .iter()
                .all(|&i| !stack.tier("hot").join(placed[i].prefix()).exists())
    })
    .await
    .unwrap();
    let mut removed = removed_from_hot(&js).await;
    removed.sort();
    assert_eq!(removed, expected);

    let facts = replica_facts(&js).await;
    for (_, _, _, reason) in facts.iter().filter(|(k, _, _, _)| k == "removed") {
        assert!(reason.starts_with("watermark: tier hot"), "{reason}");
    }
    // ds2's only verified copy was on hot: copied down (and announced) before its removal.
    let ds2 = &placed[2].version;
    let created = facts
        .iter()
        .position(|(k, t, v, _)| k == "created" && t == "capacity" && v == ds2)
        .expect("replica.created on capacity for ds2");
    let removed = facts
        .iter()
        .position(|(k, t, v, _)| k == "removed" && t == "hot" && v == ds2)
        .unwrap();
    assert!(created < removed, "{facts:?}");
    assert!(whole_on(&stack, "capacity", &placed[2]));
    // No other version needed a copy down.
    assert_eq!(
        facts
            .iter()
            .filter(|(k, t, _, _)| k == "created" && t == "capacity")
            .count(),
        1
    );
    // The held one and the newest stay, whole; the removed ones leave nothing behind.
    for i in [1, 4] {
        assert!(whole_on(&stack, "hot", &placed[i]), "ds{i}");
    }
    for i in [0, 2, 3] {
        assert_eq!(
            list(&stack.tier("hot").join(format!("{PROJECT}/ds{i}"))),
            Vec::<String>::new()
        );
    }
    let bucket = stack.readiness().await;
    assert!(is_ready(&bucket, &hot_key(&placed[1])).await);
    for i in [0, 2, 3] {
        assert!(!is_ready(&bucket, &hot_key(&placed[i])).await, "ds{i}");
    }
    stack.stop().await;
}

/// Guards the hold rule: two jobs staged the same version and one released it; the other still
/// holds it, so however idle it looks it stays. An unheld version that went idle later is
/// removed in the same pass (so the pass did look at the held one).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_released_stage_another_live_job_still_holds_is_not_removed() {
    let mut stack = Stack::start(Options {
        idle_after: "1h",
        ..Options::default()
    })
    .await;
    let js = stack.bus.jetstream().clone();
    let shared = stack.place("shared", 1, 1, 4096, true).await;
    let free = stack.place("free", 2, 1, 4096, true).await;
    stack.stage(&shared, "job-a", ago(240)).await;
    stack.stage(&shared, "job-b", ago(240)).await;
    stack.release(&shared, "job-b", ago(180)).await;
    stack.stage(&free, "job-c", ago(150)).await;
    stack.release(&free, "job-c", ago(120)).await;
    stack.recorded(&shared, 2, 1).await;
    stack.recorded(&free, 1, 1).await;

    stack.run_demoter();
    wait_until(WAIT, "the idle unheld replica removed", || async {
        !removed_from_hot(&js).await.is_empty() && !stack.tier("hot").join(free.prefix()).exists()
    })
    .await
    .unwrap();
    assert_eq!(removed_from_hot(&js).await, vec![free.version.clone()]);
    let (_, _, _, reason) = replica_facts(&js)
        .await
        .into_iter()
        .find(|(k, _, _, _)| k == "removed")
        .unwrap();
    assert!(reason.starts_with("idle: "), "{reason}");
    assert!(whole_on(&stack, "hot", &shared));
    assert!(is_ready(&stack.readiness().await, &hot_key(&shared)).await);
    stack.stop().await;
}

/// Guards the job-lifetime rule: a stage never released holds its replica only until its
/// `hold_until` (the job's lifetime): one whose lifetime ended is demoted like any idle
/// replica, one whose job may still run stays, though both look equally idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stage_past_its_jobs_lifetime_no_longer_holds_its_replica() {
    let mut stack = Stack::start(Options {
        idle_after: "1h",
        ..Options::default()
    })
    .await;
    let js = stack.bus.jetstream().clone();
    let lapsed = stack.place("lapsed", 1, 1, 4096, true).await;
    let living = stack.place("living", 2, 1, 4096, true).await;
    let in_a_day = time::OffsetDateTime::now_utc() + time::Duration::days(1);
    stack
        .stage_until(&lapsed, "job-lost", ago(240), Some(ago(60)))
        .await;
    stack
        .stage_until(&living, "job-long", ago(240), Some(in_a_day))
        .await;
    stack.recorded(&lapsed, 1, 0).await;
    stack.recorded(&living, 1, 0).await;

    stack.run_demoter();
    wait_until(
        WAIT,
        "the replica whose job's lifetime ended removed",
        || async {
            !removed_from_hot(&js).await.is_empty()
                && !stack.tier("hot").join(lapsed.prefix()).exists()
        },
    )
    .await
    .unwrap();
    assert_eq!(removed_from_hot(&js).await, vec![lapsed.version.clone()]);
    assert!(whole_on(&stack, "hot", &living));
    assert!(is_ready(&stack.readiness().await, &hot_key(&living)).await);
    stack.stop().await;
}

/// Guards removal atomicity for readers: while every replica on the tier is demoted, a reader
/// that reads the readiness key, then the folder, then the key again never finds the key
/// `ready` after finding the folder gone (the folder leaves only after readiness is withdrawn).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn readers_never_see_readiness_and_the_path_disagree_while_demotion_runs() {
    let mut stack = Stack::start(Options {
        idle_after: "1h",
        ..Options::default()
    })
    .await;
    let js = stack.bus.jetstream().clone();
    let mut placed = Vec::new();
    for i in 0..4u8 {
        let p = stack
            .place(&format!("read{i}"), i, 8, 64 * 1024, i % 2 == 0)
            .await;
        stack.stage(&p, "job", ago(200)).await;
        stack.release(&p, "job", ago(100 + i64::from(i))).await;
        placed.push(p);
    }
    for p in &placed {
        stack.recorded(p, 1, 1).await;
    }
    let bucket = stack.readiness().await;
    let done = Arc::new(AtomicBool::new(false));
    let seen_ready = Arc::new(AtomicUsize::new(0));
    let mut readers = Vec::new();
    for p in placed.clone() {
        let (bucket, done, seen_ready) = (bucket.clone(), done.clone(), seen_ready.clone());
        let dir = stack.tier("hot").join(p.prefix());
        let files: Vec<String> = p.files.iter().map(|(n, _)| n.clone()).collect();
        readers.push(tokio::spawn(async move {
            let key = hot_key(&p);
            let (mut ready_seen, mut gone_seen, mut reads) = (false, false, 0u64);
            loop {
                // The round that starts after `done` is set sees the end state.
                let stop = done.load(Ordering::SeqCst);
                let before = is_ready(&bucket, &key).await;
                let listing = list(&dir);
                let after = is_ready(&bucket, &key).await;
                reads += 1;
                if after {
                    assert!(
                        before && listing == files,
                        "{key}: readiness ready but the folder holds {listing:?} (read {reads})"
                    );
                }
                if before && after && !ready_seen {
                    ready_seen = true;
                    seen_ready.fetch_add(1, Ordering::SeqCst);
                }
                gone_seen |= !before && !after && listing.is_empty();
                if stop {
                    break;
                }
            }
            (ready_seen, gone_seen)
        }));
    }
    // Every reader has seen its replica ready before the demoter starts.
    wait_until(WAIT, "every reader to see its replica ready", || async {
        seen_ready.load(Ordering::SeqCst) == placed.len()
    })
    .await
    .unwrap();
    stack.run_demoter();
    wait_until(WAIT, "every replica removed from hot", || async {
        removed_from_hot(&js).await.len() == placed.len()
            && placed
                .iter()
                .all(|p| !stack.tier("hot").join(p.prefix()).exists())
            && {
                let mut gone = true;
                for p in &placed {
                    gone &= !is_ready(&bucket, &hot_key(p)).await;
                }
                gone
            }
    })
    .await
    .unwrap();
    // One more round of reads sees every replica gone from both.
    done.store(true, Ordering::SeqCst);
    for r in readers {
        let (ready_seen, gone_seen) = r.await.unwrap();
        assert!(ready_seen);
        assert!(gone_seen);
    }
    stack.stop().await;
}

/// Guards the demoter's NATS rights (deploy/nats/accounts.conf): connected as its own user,
/// with the recorder as its own, it asks the catalogue, copies down and announces the copy,
/// watches readiness and announces the removal — every step it needs is granted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_demoter_works_with_its_own_nats_user_only() {
    let mut stack = Stack::start(Options {
        idle_after: "1h",
        accounts: true,
        ..Options::default()
    })
    .await;
    let js = stack.bus.jetstream().clone();
    let only_on_hot = stack.place("rights", 3, 2, 4096, false).await;
    stack.stage(&only_on_hot, "job", ago(120)).await;
    stack.release(&only_on_hot, "job", ago(90)).await;
    stack.recorded(&only_on_hot, 1, 1).await;
    stack.run_demoter();
    wait_until(WAIT, "the replica copied down and removed", || async {
        removed_from_hot(&js).await.len() == 1
            && !stack.tier("hot").join(only_on_hot.prefix()).exists()
    })
    .await
    .unwrap();
    assert!(whole_on(&stack, "capacity", &only_on_hot));
    assert!(!is_ready(&stack.readiness().await, &hot_key(&only_on_hot)).await);
    stack.stop().await;
}

/// A node's word is no durable copy: a `replica.created` on capacity naming node n1 (all a
/// node's user may state is on its own node's subjects, so a compromised node can publish this)
/// does not spare the only verified copy, on hot, its copy down: it is copied to capacity and
/// announced there before it is removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_capacity_copy_stated_by_a_node_is_no_durable_copy() {
    let mut stack = Stack::start(Options {
        idle_after: "1h",
        ..Options::default()
    })
    .await;
    let js = stack.bus.jetstream().clone();
    let p = stack.place("forged", 9, 3, 4096, false).await;
    stack.stage(&p, "job", ago(120)).await;
    stack.release(&p, "job", ago(90)).await;
    stack.recorded(&p, 1, 1).await;
    let forged = stagehand_schemas::Event::request(
        stagehand_schemas::EventId::random(),
        PROJECT,
        Body::ReplicaCreated(stagehand_schemas::ReplicaCreated {
            dataset: p.dataset.clone(),
            version: p.version.clone(),
            location: stagehand_schemas::Location {
                tier: "capacity".into(),
                prefix: p.prefix(),
            },
            files: 3,
            total_bytes: 3 * 4096,
            verified_by: "read-back".into(),
            node: Some("n1".into()),
        }),
    );
    stack.publish(&forged).await;
    wait_until(WAIT, "the node's word folded", || async {
        stack
            .catalogue
            .version(Some(PROJECT), &p.dataset, &p.version)
            .await
            .is_ok_and(|v| {
                (v.replicas.iter()).any(|r| r.tier == "capacity" && r.node.as_deref() == Some("n1"))
            })
    })
    .await
    .unwrap();
    stack.run_demoter();
    wait_until(WAIT, "the replica removed from hot", || async {
        removed_from_hot(&js).await.len() == 1 && !stack.tier("hot").join(p.prefix()).exists()
    })
    .await
    .unwrap();
    assert!(whole_on(&stack, "capacity", &p), "copied down first");
    let facts = replica_facts(&js).await;
    let created = (facts.iter())
        .filter(|(k, t, v, _)| k == "created" && t == "capacity" && v == &p.version)
        .count();
    assert_eq!(created, 2, "the node's word, then the demoter's copy down");
    stack.stop().await;
}

/// Guards issue 19's trusted copy-down: the capacity folder of a replica whose only verified
/// copy is on hot is already there, and stale — two files with other bytes of the same size,
/// one missing. It is not taken for the copy: every file is checked against the version's
/// list (hashes, not names), the wrong ones are replaced by verified copies published in one
/// exchange of folders, and the hot copy goes only after `replica.created` on capacity.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_damaged_folder_already_on_capacity_is_replaced_before_the_hot_copy_goes() {
    let mut stack = Stack::start(Options {
        idle_after: "1h",
        ..Options::default()
    })
    .await;
    let js = stack.bus.jetstream().clone();
    let p = stack.place("stale", 5, 8, 4096, false).await;
    let found = stack.tier("capacity").join(p.prefix());
    std::fs::create_dir_all(&found).unwrap();
    for (i, (name, bytes)) in p.files.iter().enumerate() {
        let mut bytes = bytes.clone();
        match i {
            2 | 5 => bytes[100] ^= 0xff,
            7 => continue,
            _ => {}
        }
        std::fs::write(found.join(name), bytes).unwrap();
    }
    stack.stage(&p, "job", ago(120)).await;
    stack.release(&p, "job", ago(90)).await;
    stack.recorded(&p, 1, 1).await;
    stack.run_demoter();
    wait_until(WAIT, "the replica removed from hot", || async {
        removed_from_hot(&js).await.len() == 1 && !stack.tier("hot").join(p.prefix()).exists()
    })
    .await
    .unwrap();
    assert!(whole_on(&stack, "capacity", &p), "{:?}", list(&found));
    let facts = replica_facts(&js).await;
    let created = facts
        .iter()
        .position(|(k, t, v, _)| k == "created" && t == "capacity" && v == &p.version)
        .expect("replica.created on capacity");
    let removed = facts
        .iter()
        .position(|(k, t, _, _)| k == "removed" && t == "hot")
        .unwrap();
    assert!(created < removed);
    // Nothing of the stale folder or the staging is left beside it.
    assert_eq!(
        list(found.parent().unwrap()),
        vec![p.version.clone()],
        "only the verified set"
    );
    stack.stop().await;
}

/// Checked before reuse, the copy down's source: the only verified copy of a version is on hot,
/// and one byte of one of its files was flipped after its job released it. The copy down reads
/// it against the manifest: nothing is copied down or removed, and `replica.damaged` (found by
/// hash, naming the file) withdraws its readiness at once, so no job is told it is ready while
/// the demotion waits for a stage request to repair it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_damaged_hot_copy_is_withdrawn_and_never_copied_down() {
    let mut stack = Stack::start(Options {
        idle_after: "1h",
        ..Options::default()
    })
    .await;
    let js = stack.bus.jetstream().clone();
    let p = stack.place("rotten", 6, 6, 4096, false).await;
    stack.stage(&p, "job", ago(120)).await;
    stack.release(&p, "job", ago(90)).await;
    stack.recorded(&p, 1, 1).await;
    let (name, bytes) = &p.files[3];
    let mut flipped = bytes.clone();
    flipped[7] ^= 0x10;
    std::fs::write(stack.tier("hot").join(p.prefix()).join(name), flipped).unwrap();
    stack.run_demoter();
    let damaged = wait_for(WAIT, "replica.damaged for the hot copy", || async {
        facts(&js, "replica.damaged")
            .await
            .into_iter()
            .find_map(|e| match e.body {
                Body::ReplicaDamaged(d) if d.location.tier == "hot" => Some(d),
                _ => None,
            })
    })
    .await
    .unwrap();
    assert_eq!(damaged.found_by, "hash");
    assert_eq!(
        damaged
            .files
            .iter()
            .map(|f| (f.path.as_str(), f.how.as_str()))
            .collect::<Vec<_>>(),
        vec![(name.as_str(), "hash")]
    );
    let readiness = stack.readiness().await;
    wait_until(WAIT, "readiness withdrawn", || async {
        !is_ready(&readiness, &hot_key(&p)).await
    })
    .await
    .unwrap();
    assert!(stack.tier("hot").join(p.prefix()).join(name).exists());
    let copied = replica_facts(&js)
        .await
        .into_iter()
        .any(|(k, t, _, _)| (k == "created" && t == "capacity") || k == "removed");
    assert!(!copied, "nothing copied down, nothing removed");
    assert!(!stack.tier("capacity").join(p.prefix()).exists());
    stack.stop().await;
}
