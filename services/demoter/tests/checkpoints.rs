//! Checkpoint retention carried out by the demoter: a run's committed checkpoints on hot end
//! exactly where `stagehand_policy::retention::decide` puts them — the newest on hot, the
//! kept older ones verified on capacity and gone from hot, the rest gone — each move announced
//! with the rule that decided it.

mod common;

use common::*;
use stagehand_schemas::{Body, subject};
use stagehand_testkit::{drained_through, wait_until};

/// Guards the demoter's side of retention: keep_last 3, hot_keep_last 1, `best` tagged, over
/// six checkpoints (step 200 tagged): 600 stays on hot; 500 and 400 (keep_last) and 200
/// (tagged:best) are demoted to capacity; 100 and 300 expire.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_runs_checkpoints_are_kept_demoted_and_expired_as_retention_decides() {
    let mut stack = Stack::start(Options {
        checkpoints: "keep_last = 3\nkeep_every = 0\nkeep_tagged = [\"best\"]\nhot_keep_last = 1\ndemote_to = \"capacity\"",
        ..Options::default()
    })
    .await;
    let js = stack.bus.jetstream().clone();
    stack.run_demoter();
    let mut committed = Vec::new();
    for step in [100u64, 200, 300, 400, 500, 600] {
        let tags: &[&str] = if step == 200 { &["best"] } else { &[] };
        committed.push((step, stack.commit_checkpoint("run-a", step, tags).await));
    }
    let run_dir = stack.tier("hot").join(format!("{PROJECT}/ckpt/run-a"));
    let capacity_dir = stack.tier("capacity").join(format!("{PROJECT}/ckpt/run-a"));
    let kept = ["step-200", "step-400", "step-500"]
        .map(String::from)
        .to_vec();
    wait_until(WAIT, "retention carried out", || async {
        list(&run_dir) == vec!["step-600".to_owned()]
            && list(&capacity_dir) == kept
            && facts(&js, "checkpoint.expired").await.len() >= 2
    })
    .await
    .unwrap_or_else(|e| {
        panic!(
            "{e}: hot {:?}, capacity {:?}",
            list(&run_dir),
            list(&capacity_dir)
        )
    });
    // The checkpoints may be decided while the run is still arriving (300 is among the newest
    // three before 500 and 600 come): what is certain is each step's last fact and its rule.
    let mut last: std::collections::BTreeMap<u64, (String, String)> = Default::default();
    let mut demotions = std::collections::BTreeMap::<u64, usize>::new();
    let mut events = facts(&js, "checkpoint.demoted").await;
    events.extend(facts(&js, "checkpoint.expired").await);
    events.sort_by_key(|e| e.occurred_at);
    for e in events {
        match e.body {
            Body::CheckpointDemoted(d) => {
                assert_eq!(d.to.tier, "capacity");
                *demotions.entry(d.step).or_default() += 1;
                last.insert(d.step, ("demoted".into(), d.rule.unwrap_or_default()));
            }
            Body::CheckpointExpired(x) => {
                assert!(
                    last.get(&x.step).is_none_or(|(k, _)| k == "demoted"),
                    "{}",
                    x.step
                );
                last.insert(x.step, ("expired".into(), x.rule));
            }
            other => panic!("{other:?}"),
        }
    }
    let want = |k: &str, r: &str| (k.to_owned(), r.to_owned());
    // 200 moved while it was among the newest three (keep_last), or once the run was whole
    // (tagged:best): the fact carries the rule that decided when it moved.
    let rule_200 = last.get(&200).map(|(_, r)| r.clone()).unwrap_or_default();
    assert!(
        ["keep_last", "tagged:best"].contains(&rule_200.as_str()),
        "{rule_200}"
    );
    assert_eq!(
        last.into_iter().collect::<Vec<_>>(),
        vec![
            (100, want("expired", "expired")),
            (200, want("demoted", &rule_200)),
            (300, want("expired", "expired")),
            (400, want("demoted", "keep_last")),
            (500, want("demoted", "keep_last")),
        ]
    );
    assert!(demotions.values().all(|&n| n == 1), "{demotions:?}");
    for (step, placed) in &committed {
        let on_capacity = whole_on(&stack, "capacity", placed);
        assert_eq!(on_capacity, [200, 400, 500].contains(step), "step {step}");
    }
    assert!(whole_on(&stack, "hot", &committed[5].1));
    stack.stop().await;
}

/// Guards the clock's retry: a pass that stops because the catalogue does not answer (the
/// recorder not up yet) is tried again by itself — the commits that asked for it were already
/// taken, and no other fact follows — so retention is carried out once the catalogue answers,
/// long before `check_every` (1 h here).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pass_stopped_by_a_silent_catalogue_is_tried_again_without_new_facts() {
    let mut stack = Stack::start(Options {
        checkpoints: "keep_last = 1\nkeep_every = 0\nkeep_tagged = []\nhot_keep_last = 1\ndemote_to = \"capacity\"",
        recorder: false,
        ..Options::default()
    })
    .await;
    stack.run_demoter();
    for step in [1u64, 2] {
        stack.commit_checkpoint("run-r", step, &[]).await;
    }
    // The demoter took both commits (its passes find no catalogue).
    let js = stack.bus.jetstream().clone();
    wait_until(WAIT, "the demoter to take both commits", || async {
        drained_through(&js, subject::FACTS.name, "demoter")
            .await
            .is_some_and(|delivered| delivered > 0)
    })
    .await
    .unwrap();
    stack.start_recorder();
    let run_dir = stack.tier("hot").join(format!("{PROJECT}/ckpt/run-r"));
    wait_until(
        WAIT,
        "step 1 expired once the catalogue answers",
        || async {
            list(&run_dir) == vec!["step-2".to_owned()]
                && facts(&js, "checkpoint.expired").await.len() == 1
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}: hot {:?}", list(&run_dir)));
    stack.stop().await;
}

/// Guards demotion of a checkpoint committed with its file list by reference (a large one:
/// `stagehand checkpoint commit` puts its manifest in the project's upload bucket): the older
/// step is copied down whole, every file verified, announced `checkpoint.demoted`, and gone
/// from hot; the newest stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_checkpoint_listed_by_reference_is_demoted_whole() {
    let mut stack = Stack::start(Options {
        checkpoints: "keep_last = 2\nkeep_every = 0\nkeep_tagged = []\nhot_keep_last = 1\ndemote_to = \"capacity\"",
        ..Options::default()
    })
    .await;
    let older = stack.commit_checkpoint_as("run-big", 1, &[], true).await;
    let newest = stack.commit_checkpoint_as("run-big", 2, &[], true).await;
    stack.run_demoter();
    let js = stack.bus.jetstream().clone();
    let run_dir = stack.tier("hot").join(format!("{PROJECT}/ckpt/run-big"));
    wait_until(WAIT, "step 1 demoted from hot", || async {
        list(&run_dir) == vec!["step-2".to_owned()]
            && facts(&js, "checkpoint.demoted").await.len() == 1
    })
    .await
    .unwrap_or_else(|e| panic!("{e}: hot {:?}", list(&run_dir)));
    assert!(whole_on(&stack, "capacity", &older));
    assert!(whole_on(&stack, "hot", &newest));
    assert!(!whole_on(&stack, "capacity", &newest));
    stack.stop().await;
}

/// Waits until the demoter has taken (and acknowledged) at least `facts` facts, all there are.
async fn took_every_fact(js: &async_nats::jetstream::Context, facts: u64) {
    wait_until(WAIT, "the demoter to take every fact", || async {
        drained_through(js, subject::FACTS.name, "demoter")
            .await
            .is_some_and(|delivered| delivered >= facts)
    })
    .await
    .unwrap();
}

/// The `checkpoint.held` facts stored, as (step, unlisted paths, reason).
async fn held(js: &async_nats::jetstream::Context) -> Vec<(u64, Vec<String>, String)> {
    facts(js, "checkpoint.held")
        .await
        .into_iter()
        .filter_map(|e| match e.body {
            Body::CheckpointHeld(h) => Some((h.step, h.unlisted, h.reason)),
            _ => None,
        })
        .collect()
}

/// Guards issue 19's late file: a file a rank writes into a committed step's folder after
/// the commit is not in the list the demotion copies, so the demotion stops — the folder
/// stays whole on hot with the file, `checkpoint.held` names it and the catalogue keeps the
/// hold on the step — and once the file is gone the next pass demotes the step whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_file_written_after_the_commit_stops_the_demotion_and_survives() {
    let mut stack = Stack::start(Options {
        checkpoints: "keep_last = 3\nkeep_every = 0\nkeep_tagged = []\nhot_keep_last = 1\ndemote_to = \"capacity\"",
        ..Options::default()
    })
    .await;
    let js = stack.bus.jetstream().clone();
    let older = stack.commit_checkpoint("run-late", 1, &[]).await;
    let step_1 = stack.tier("hot").join(older.prefix());
    std::fs::write(
        step_1.join("late.bin"),
        b"written by a rank after the commit",
    )
    .unwrap();
    stack.commit_checkpoint("run-late", 2, &[]).await;
    stack.run_demoter();
    wait_until(WAIT, "the demotion of step 1 held", || async {
        held(&js).await.iter().any(|(step, _, _)| *step == 1)
    })
    .await
    .unwrap();
    let (_, unlisted, reason) = held(&js).await.remove(0);
    assert_eq!(unlisted, vec!["late.bin".to_owned()]);
    assert!(reason.contains("does not list"), "{reason}");
    assert_eq!(
        std::fs::read(step_1.join("late.bin")).unwrap(),
        b"written by a rank after the commit"
    );
    assert!(list(&step_1).len() == 4, "{:?}", list(&step_1));
    assert!(facts(&js, "checkpoint.demoted").await.is_empty());
    wait_until(WAIT, "the catalogue to keep the hold", || async {
        stack
            .catalogue
            .all_checkpoints(PROJECT, "run-late")
            .await
            .is_ok_and(|r| {
                r.iter().any(|c| {
                    c.step == 1
                        && c.held_now()
                            .is_some_and(|h| h.unlisted == ["late.bin"] && h.unlisted_total == 1)
                })
            })
    })
    .await
    .unwrap();

    // Moved away by its owner: the next pass (a commit asks for one) demotes step 1 whole.
    std::fs::rename(step_1.join("late.bin"), stack.root().join("late.bin")).unwrap();
    stack.commit_checkpoint("run-late", 3, &[]).await;
    wait_until(WAIT, "steps 1 and 2 demoted", || async {
        facts(&js, "checkpoint.demoted").await.len() == 2 && !step_1.exists()
    })
    .await
    .unwrap();
    assert!(whole_on(&stack, "capacity", &older));
    stack.stop().await;
}

/// Guards issue 19's nested step: a step committed inside an older step's folder is noted by
/// neither the recorder (a problem naming both) nor the demoter, and when retention expires
/// the outer step its folder is not deleted — it holds the inner step's files, which no list
/// of the outer step names — and the hold names them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_outer_steps_expiry_never_deletes_a_step_inside_it() {
    let mut stack = Stack::start(Options {
        checkpoints: "keep_last = 1\nkeep_every = 0\nkeep_tagged = []\nhot_keep_last = 1\ndemote_to = \"capacity\"",
        ..Options::default()
    })
    .await;
    let js = stack.bus.jetstream().clone();
    stack.run_demoter();
    let outer = stack.commit_checkpoint("run-n", 1, &[]).await;
    // The outer step is noted first (as the recorder folds it first, in stream order).
    took_every_fact(&js, 1).await;
    let outer_dir = stack.tier("hot").join(outer.prefix());
    let inner_prefix = format!("{}/step-2", outer.prefix());
    let inner = stack
        .commit_checkpoint_at("run-n", 2, &[], false, &inner_prefix)
        .await;
    stack.commit_checkpoint("run-n", 3, &[]).await;
    wait_until(WAIT, "the expiry of step 1 held", || async {
        held(&js).await.iter().any(|(step, _, _)| *step == 1)
    })
    .await
    .unwrap();
    let (_, unlisted, reason) = held(&js).await.remove(0);
    let mut want: Vec<String> = inner
        .files
        .iter()
        .map(|(name, _)| format!("step-2/{name}"))
        .collect();
    want.sort();
    assert_eq!(unlisted, want, "{reason}");
    for (name, bytes) in &outer.files {
        assert_eq!(
            &std::fs::read(outer_dir.join(name)).unwrap(),
            bytes,
            "{name}"
        );
    }
    for (name, bytes) in &inner.files {
        let path = outer_dir.join("step-2").join(name);
        assert_eq!(&std::fs::read(&path).unwrap(), bytes, "{}", path.display());
    }
    assert!(facts(&js, "checkpoint.expired").await.is_empty());
    // The recorder did not fold the inner commit: a problem names both steps.
    wait_until(WAIT, "the overlap listed as a problem", || async {
        stack
            .catalogue
            .problems(None, None)
            .await
            .is_ok_and(|(page, _)| {
                page.items.iter().any(|p| {
                    p.code == stagehand_catalogue::FoldProblemCode::CheckpointOverlap
                        && p.detail.contains("run-n step 2")
                        && p.detail.contains("run run-n step 1")
                })
            })
    })
    .await
    .unwrap();
    stack.stop().await;
}
