//! The demoter's binary killed with SIGKILL inside a demotion step — after the copy down and
//! before the removal, and after the rename and before the delete — and started again: every
//! version ends fully on hot or fully gone from it, the readiness bucket agrees, and a verified
//! copy exists on capacity. The kill points are reached through the fault seam
//! `STAGEHAND_DEMOTER_HALT_AFTER`, which stops the process right after it records that phase.

mod common;

use common::*;
use stagehand_testkit::wait_until;

/// Places `n` idle versions whose only verified copy is on hot (the demoter must copy each
/// down first), released a minute apart, oldest first; returns them.
async fn idle_versions_only_on_hot(stack: &Stack, n: u8) -> Vec<Placed> {
    let mut placed = Vec::new();
    for i in 0..n {
        let p = stack
            .place(&format!("crash{i}"), i * 7, 4, 256 * 1024, false)
            .await;
        stack.stage(&p, "job", ago(300)).await;
        stack.release(&p, "job", ago(200 - i64::from(i))).await;
        placed.push(p);
    }
    for p in &placed {
        stack.recorded(p, 1, 1).await;
    }
    placed
}

async fn wait_for_log(stack: &Stack, name: &str, line: &str) {
    let what = format!("{line:?} in the log of demoter {name}");
    wait_until(WAIT, &what, || async { log_of(stack, name).contains(line) })
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", log_of(stack, name)));
}

/// After a restart every version is gone from hot (no hidden folder either), whole on
/// capacity with one `replica.created` and one `replica.removed` each, and not ready on hot.
async fn end_state(stack: &Stack, placed: &[Placed], name: &str) {
    let js = stack.bus.jetstream().clone();
    wait_until(WAIT, "every version demoted after the restart", || async {
        removed_from_hot(&js).await.len() == placed.len()
            && placed.iter().all(|p| {
                list(&stack.tier("hot").join(format!("{PROJECT}/{}", p.dataset))).is_empty()
            })
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", log_of(stack, name)));
    let facts = replica_facts(&js).await;
    let bucket = stack.readiness().await;
    for p in placed {
        assert!(whole_on(stack, "capacity", p), "{}", p.dataset);
        let count = |kind: &str, tier: &str| {
            facts
                .iter()
                .filter(|(k, t, v, _)| k == kind && t == tier && v == &p.version)
                .count()
        };
        assert_eq!(count("created", "capacity"), 1, "{facts:?}");
        assert_eq!(count("removed", "hot"), 1, "{facts:?}");
        assert!(!is_ready(&bucket, &hot_key(p)).await);
    }
}

/// Kills the halted first demoter, starts a second and waits for [`end_state`], then stops
/// everything.
async fn restarted_after_kill(stack: Stack, mut first: ServiceProcess, placed: &[Placed]) {
    first.kill();
    let mut second = spawn(&stack, "second", &[]);
    end_state(&stack, placed, "second").await;
    second.kill();
    stack.stop().await;
}

/// Guards "copy down, then remove" as one recorded step: killed after the copy down is
/// recorded, the replica is whole on both tiers and still ready on hot; the restarted demoter
/// removes it without copying again or announcing it twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killed_between_the_copy_down_and_the_removal_the_restart_finishes_the_step() {
    let stack = Stack::start(Options {
        idle_after: "1h",
        // One step at a time: the kill point is the first version's.
        max_concurrent: 1,
        ..Options::default()
    })
    .await;
    let placed = idle_versions_only_on_hot(&stack, 2).await;
    let first = spawn(
        &stack,
        "first",
        &[(stagehand_demoter::HALT_AFTER_ENV, "copied-down")],
    );
    wait_for_log(&stack, "first", "demoter halted after copied-down").await;
    // The first version (least recently staged) is copied down, and nothing was removed yet.
    let p = &placed[0];
    assert!(whole_on(&stack, "capacity", p));
    assert!(whole_on(&stack, "hot", p));
    assert!(whole_on(&stack, "hot", &placed[1]));
    assert!(is_ready(&stack.readiness().await, &hot_key(p)).await);
    assert!(removed_from_hot(stack.bus.jetstream()).await.is_empty());
    restarted_after_kill(stack, first, &placed).await;
}

/// Guards "rename out of the namespace, then delete": killed after the rename is recorded, the
/// version is already gone from its path and not ready (its bytes sit in the hidden folder);
/// the restarted demoter deletes them and goes on with the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killed_between_the_rename_and_the_delete_the_restart_leaves_nothing_behind() {
    let stack = Stack::start(Options {
        idle_after: "1h",
        // One step at a time: the kill point is the first version's.
        max_concurrent: 1,
        ..Options::default()
    })
    .await;
    let placed = idle_versions_only_on_hot(&stack, 2).await;
    let first = spawn(
        &stack,
        "first",
        &[(stagehand_demoter::HALT_AFTER_ENV, "renamed")],
    );
    wait_for_log(&stack, "first", "demoter halted after renamed").await;
    let p = &placed[0];
    let parent = stack.tier("hot").join(format!("{PROJECT}/{}", p.dataset));
    assert_eq!(
        list(&parent),
        vec![format!(".{}.stagehand-removed", p.version)]
    );
    assert!(!is_ready(&stack.readiness().await, &hot_key(p)).await);
    assert!(whole_on(&stack, "capacity", p));
    assert!(whole_on(&stack, "hot", &placed[1]));
    assert_eq!(
        removed_from_hot(stack.bus.jetstream()).await,
        vec![p.version.clone()]
    );
    restarted_after_kill(stack, first, &placed).await;
}

/// Guards steps carried at once: with `max_concurrent = 3` and six idle versions, the first
/// three steps each halt right after their rename (their folders hidden, their readiness
/// withdrawn) and the other three have not begun; killed there, the restarted demoter
/// finishes the three, demotes the rest, and every version ends whole on capacity, gone from
/// hot, announced created and removed exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killed_with_several_steps_under_way_the_restart_finishes_each_once() {
    let stack = Stack::start(Options {
        idle_after: "1h",
        max_concurrent: 3,
        ..Options::default()
    })
    .await;
    let placed = idle_versions_only_on_hot(&stack, 6).await;
    let first = spawn(
        &stack,
        "first",
        &[(stagehand_demoter::HALT_AFTER_ENV, "renamed")],
    );
    let halted = || {
        log_of(&stack, "first")
            .matches("demoter halted after renamed")
            .count()
    };
    wait_until(WAIT, "three steps halted after their rename", || async {
        halted() == 3
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", log_of(&stack, "first")));
    let hidden: Vec<&Placed> = placed
        .iter()
        .filter(|p| {
            list(&stack.tier("hot").join(format!("{PROJECT}/{}", p.dataset)))
                == vec![format!(".{}.stagehand-removed", p.version)]
        })
        .collect();
    assert_eq!(hidden.len(), 3, "{}", log_of(&stack, "first"));
    // The three under way are the three least recently staged; the rest are untouched.
    for p in &placed[..3] {
        assert!(
            hidden.iter().any(|h| h.version == p.version),
            "{}",
            p.dataset
        );
        assert!(whole_on(&stack, "capacity", p));
    }
    for p in &placed[3..] {
        assert!(whole_on(&stack, "hot", p));
    }
    assert_eq!(removed_from_hot(stack.bus.jetstream()).await.len(), 3);
    restarted_after_kill(stack, first, &placed).await;
}

/// Guards a stage request racing a removal: the demoter is stopped right after the replica's
/// readiness was withdrawn (folder still whole), a job asks for it, and the restarted demoter
/// finds the hold before the rename — it undoes the removal (announces the replica again), so
/// the folder stays whole and the readiness becomes ready again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_job_that_asks_while_the_replica_is_withdrawn_keeps_it() {
    let stack = Stack::start(Options {
        idle_after: "1h",
        ..Options::default()
    })
    .await;
    let p = stack.place("raced", 5, 2, 64 * 1024, true).await;
    stack.stage(&p, "job-old", ago(120)).await;
    stack.release(&p, "job-old", ago(90)).await;
    stack.recorded(&p, 1, 1).await;
    let mut first = spawn(
        &stack,
        "first",
        &[(stagehand_demoter::HALT_AFTER_ENV, "withdrawn")],
    );
    wait_for_log(&stack, "first", "demoter halted after withdrawn").await;
    let bucket = stack.readiness().await;
    assert!(!is_ready(&bucket, &hot_key(&p)).await);
    assert!(whole_on(&stack, "hot", &p));
    first.kill();

    stack.stage(&p, "job-new", ago(0)).await;
    stack.recorded_requests(&p, 2, 1).await;
    let mut second = spawn(&stack, "second", &[]);
    wait_until(WAIT, "the replica announced again and ready", || async {
        is_ready(&bucket, &hot_key(&p)).await
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", log_of(&stack, "second")));
    assert!(whole_on(&stack, "hot", &p));
    let parent = stack.tier("hot").join(format!("{PROJECT}/{}", p.dataset));
    assert_eq!(list(&parent), vec![p.version.clone()]);
    // The replica is announced again before the demoter logs why: the line may follow.
    wait_for_log(&stack, "second", "removal undone").await;
    second.kill();
    stack.stop().await;
}
