//! A stage request racing a removal, interleaved deterministically: the real demoter binary
//! stops itself (`SIGSTOP`, the seam `STAGEHAND_DEMOTER_STOP_BEFORE_RENAME`) right before it
//! renames a replica away — every check made, the readiness withdrawn, the folder still whole
//! — and a job asks the real promoter for that version then. The promoter must not answer it
//! from the folder about to vanish (the replica's use record, `stagehand_bus::placement`, is
//! withdrawing): it waits, and once the removal has finished stages the version afresh. So a
//! request answered ready always finds its path complete, and the tier's reservation lists the
//! new copy (the removal gave the old one's space back only after the folder was gone).

mod common;

use common::*;
use stagehand_catalogue::StageState;
use stagehand_schemas::EventId;
use stagehand_testkit::wait_until;

/// Whether the process is stopped (state `T` in `/proc/<pid>/stat`).
fn stopped(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .and_then(|(_, rest)| rest.trim_start().chars().next())
        })
        == Some('T')
}

/// Guards the race of a stage request with a removal: asked while the demoter is between its
/// last look at the holds and its rename, the request is not answered ready from the replica
/// (before the use record it was, and the rename then took the folder from under the job);
/// it waits for the removal, is staged afresh, and its path is whole when it is ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_racing_a_removal_is_answered_ready_only_with_its_path_complete() {
    let mut stack = Stack::start(Options {
        idle_after: "1h",
        ..Options::default()
    })
    .await;
    // Idle on hot, a verified copy on capacity (no copy down: the removal comes at once).
    let p = stack.place("race", 5, 3, 64 * 1024, true).await;
    stack.stage(&p, "early", ago(300)).await;
    stack.release(&p, "early", ago(200)).await;
    stack.recorded(&p, 1, 1).await;
    stack.run_promoter();

    let mut demoter = spawn(
        &stack,
        "racer",
        &[(stagehand_demoter::STOP_BEFORE_RENAME_ENV, "1")],
    );
    let pid = demoter.child().id();
    wait_until(WAIT, "the demoter to stop before its rename", || async {
        stopped(pid)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", log_of(&stack, "racer")));
    // The removal is announced and the readiness withdrawn; the folder is still whole.
    assert!(
        whole_on(&stack, "hot", &p),
        "{:?}\n{}",
        list(&stack.tier("hot").join(p.prefix())),
        log_of(&stack, "racer")
    );
    assert!(!is_ready(&stack.readiness().await, &hot_key(&p)).await);
    assert_eq!(removed_from_hot(stack.bus.jetstream()).await.len(), 1);

    // A job asks now: the promoter must not hand out the replica being removed.
    stack.stage(&p, "late", ago(0)).await;
    let id = EventId::for_stage(PROJECT, "late", &p.dataset, &p.version, "hot", None);
    let status = stagehand_testkit::wait_for(WAIT, "the late request answered", || async {
        stack
            .catalogue
            .stage_request(PROJECT, id.as_str())
            .await
            .ok()
            .filter(|s| s.state != StageState::Pending || s.waiting_for.is_some())
    })
    .await
    .unwrap();
    assert_eq!(
        (status.state, status.waiting_for.as_deref()),
        (StageState::Pending, Some("copy")),
        "answered from a replica being removed: {status:?}"
    );
    assert!(
        status
            .reason
            .as_deref()
            .is_some_and(|r| r.contains("being removed")),
        "{status:?}"
    );

    // The demoter goes on: rename, delete, space given back, record deleted; the promoter
    // then copies the version afresh from capacity.
    rustix::process::kill_process(
        rustix::process::Pid::from_child(demoter.child()),
        rustix::process::Signal::CONT,
    )
    .unwrap();
    let ready = stagehand_testkit::wait_for(WAIT, "the late request ready", || async {
        stack
            .catalogue
            .stage_request(PROJECT, id.as_str())
            .await
            .ok()
            .filter(|s| s.state == StageState::Ready)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", log_of(&stack, "racer")));
    let path = ready.path.clone().expect("a ready path");
    assert_eq!(
        std::path::PathBuf::from(&path),
        stack.tier("hot").join(p.prefix())
    );
    assert!(whole_on(&stack, "hot", &p), "{path} is not whole");
    let facts = replica_facts(stack.bus.jetstream()).await;
    let count = |kind: &str| {
        facts
            .iter()
            .filter(|(k, t, v, _)| k == kind && t == "hot" && v == &p.version)
            .count()
    };
    assert_eq!(
        (count("created"), count("removed")),
        (2, 1),
        "placed, removed once, copied again: {facts:?}"
    );

    // The tier's reservation lists the fresh copy, and its use record serves the request.
    let store = stack
        .bus
        .jetstream()
        .get_key_value(stagehand_bus::PROMOTER_BUCKET)
        .await
        .unwrap();
    let reserved = stagehand_bus::placement::reservations(&store, "hot", None)
        .await
        .unwrap()
        .value
        .unwrap_or_default();
    let bytes: u64 = p.files.iter().map(|(_, b)| b.len() as u64).sum();
    assert_eq!(reserved.replicas.get(&p.prefix()), Some(&bytes));
    let used = stagehand_bus::placement::read_use(&store, "hot", None, &p.prefix())
        .await
        .unwrap()
        .value
        .expect("a use record");
    assert_eq!(used.state, stagehand_bus::placement::UseState::Serving);
    // (The promoter also answers the early request, released long ago, when it reads it.)
    assert!(
        used.served.iter().any(|s| s == id.as_str()),
        "{:?}",
        used.served
    );

    demoter.kill();
    stack.stop().await;
}
