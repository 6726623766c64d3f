//! A worker process killed with SIGKILL in the middle of handling, or after recording its
//! outcome but before publishing and acking, yields exactly one set of facts once a new
//! process takes over; two processes racing on one event, one killed between recording and
//! publishing, yield exactly one verdict; and an instance restarted under its own id takes
//! its claim over at once rather than after the claim's lifetime.

mod common;

use std::process::Stdio;
use std::time::Duration;

use common::*;
use stagehand_bus::Ledger;
use stagehand_testkit::wait_until;
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};

const BIN: &str = env!("CARGO_BIN_EXE_stagehand-bus-testworker");

struct Worker {
    child: Child,
    lines: Lines<BufReader<ChildStdout>>,
}

impl Worker {
    fn spawn(env: &Env, extra: &[&str]) -> Worker {
        Self::spawn_with(env, "testworker", extra)
    }

    /// A worker process with its ledger at `env.ledger(ledger)`.
    fn spawn_with(env: &Env, ledger: &str, extra: &[&str]) -> Worker {
        let mut child = Command::new(BIN)
            .args(["--url", &env.nats.url(), "--ledger"])
            .arg(env.ledger(ledger))
            .args(["--ack-wait-ms", "1500"])
            .args(extra)
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("test worker binary runs");
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        Worker { child, lines }
    }

    /// Waits for a line starting with `prefix` and returns it.
    async fn expect_line(&mut self, prefix: &str) -> String {
        let read = async {
            while let Some(line) = self.lines.next_line().await.unwrap() {
                if line.starts_with(prefix) {
                    return line;
                }
            }
            panic!("worker exited before printing {prefix:?}");
        };
        tokio::time::timeout(WAIT, read)
            .await
            .expect("worker signalled in time")
    }

    async fn sigkill(mut self) {
        self.child.start_kill().unwrap();
        let status = self.child.wait().await.unwrap();
        assert!(!status.success());
    }

    async fn terminate(mut self) {
        let pid = self.child.id().unwrap() as i32;
        // SAFETY: sending a signal to our own child process.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let status = tokio::time::timeout(WAIT, self.child.wait())
            .await
            .unwrap()
            .unwrap();
        assert!(status.success(), "worker stopped cleanly: {status}");
    }
}

async fn run_crash_case(flag: &str, signal: &str) {
    let env = Env::start().await;
    let requests: Vec<_> = (0..3)
        .map(|i| stage_request(&format!("crash-{i}")))
        .collect();
    for r in &requests {
        env.bus.publish(r).await.unwrap();
    }
    let mut doomed = Worker::spawn(&env, &[flag]);
    let line = doomed.expect_line(signal).await;
    doomed.sigkill().await;
    let victim = line.split_whitespace().nth(1).unwrap().to_owned();
    if flag == "--hang-after-record" {
        // The outcome was committed before the kill; its facts were not published.
        let ledger = Ledger::open(env.ledger("testworker")).unwrap();
        let id = stagehand_schemas::EventId::new(victim.clone()).unwrap();
        assert!(
            ledger
                .outcome("lab-a", "stage.requested", &id)
                .unwrap()
                .is_some(),
            "recorded before the kill"
        );
    }

    let survivor = Worker::spawn(&env, &[]);
    wait_until(WAIT, "three facts", || async {
        env.fact_count().await == 3
    })
    .await
    .unwrap();
    wait_until(WAIT, "every request acked", || {
        env.consumer_drained("testworker")
    })
    .await
    .unwrap();
    survivor.terminate().await;

    let facts = env.facts().await;
    assert_eq!(facts.len(), 3, "exactly one set of facts");
    for r in &requests {
        let expected = ready_fact(r);
        let matching: Vec<_> = facts
            .iter()
            .filter(|(_, _, f)| f.causation_id.as_ref() == Some(&r.id))
            .collect();
        assert_eq!(matching.len(), 1, "one fact for {}", r.id);
        assert_eq!(
            matching[0].2.id, expected.id,
            "the fact id follows from the request"
        );
    }
    let ledger = Ledger::open(env.ledger("testworker")).unwrap();
    assert_eq!(ledger.len().unwrap(), 3);
    for r in &requests {
        let outcome = ledger.outcome("lab-a", r.kind(), &r.id).unwrap().unwrap();
        let published = facts
            .iter()
            .find(|(_, _, f)| f.causation_id.as_ref() == Some(&r.id))
            .unwrap();
        assert_eq!(
            outcome.facts[0], published.2,
            "the published fact is the recorded one"
        );
    }
    // The victim's fact carries the same id the first process would have used.
    assert!(
        facts
            .iter()
            .any(|(_, _, f)| f.causation_id.as_ref().map(|c| c.as_str()) == Some(victim.as_str()))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_in_the_middle_of_handling_yields_one_set_of_facts() {
    run_crash_case("--hang-in-handler", "HANDLING").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_after_recording_before_ack_republishes_the_same_facts() {
    run_crash_case("--hang-after-record", "RECORDED").await;
}

/// Two processes race on one event, each with its own ledger and another verdict: `a`
/// commits its verdict and is killed before publishing it; `b` gets another copy. `b` must
/// publish `a`'s verdict — the first outcome — not its own, and `a`, restarted and handed a
/// third copy, republishes the same. One verdict in the facts stream, whatever the order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_racing_on_one_event_publish_exactly_one_verdict() {
    let env = Env::start().await;
    let request = stage_request("contested");
    let bytes = stagehand_schemas::wire::encode(&request).unwrap();
    let subj = stagehand_schemas::subject::subject_for(&request.body, &request.project);
    env.publish_raw(&subj, "copy-1", &[], bytes.clone()).await;
    let a_args = ["--instance", "a", "--verdict", "ready"];
    let mut a = Worker::spawn_with(&env, "a", &[&a_args[..], &["--hang-after-record"]].concat());
    a.expect_line("RECORDED").await;
    a.sigkill().await;

    env.publish_raw(&subj, "copy-2", &[], bytes.clone()).await;
    let b = Worker::spawn_with(&env, "b", &["--instance", "b", "--verdict", "failed"]);
    wait_until(WAIT, "both copies acked", || {
        env.consumer_drained("testworker")
    })
    .await
    .unwrap();
    b.terminate().await;

    let a = Worker::spawn_with(&env, "a", &a_args);
    env.publish_raw(&subj, "copy-3", &[], bytes).await;
    wait_until(WAIT, "the third copy acked", || {
        env.consumer_drained("testworker")
    })
    .await
    .unwrap();
    a.terminate().await;

    let facts = env.facts().await;
    let verdicts: Vec<_> = facts
        .iter()
        .filter(|(_, _, f)| f.causation_id.as_ref() == Some(&request.id))
        .collect();
    assert_eq!(verdicts.len(), 1, "exactly one verdict: {verdicts:?}");
    let verdict = &verdicts[0].2;
    assert_eq!(
        verdict.id,
        ready_fact(&request).id,
        "the first outcome, a's"
    );
    for ledger in ["a", "b"] {
        let recorded = Ledger::open(env.ledger(ledger))
            .unwrap()
            .outcome("lab-a", request.kind(), &request.id)
            .unwrap()
            .expect("both ledgers hold the outcome");
        assert_eq!(
            &recorded.facts,
            std::slice::from_ref(verdict),
            "{ledger}'s record"
        );
    }
}

/// Killed while handling, the worker restarts under the same instance id: its own claim is
/// taken over as soon as the message is redelivered (one AckWait), not after the claim's
/// lifetime (60 s here, longer than this test may take).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_instance_takes_over_its_own_claim_at_once() {
    let env = Env::start().await;
    let request = stage_request("in-flight");
    env.bus.publish(&request).await.unwrap();
    let args = [
        "--instance",
        "x",
        "--ack-wait-ms",
        "1000",
        "--claim-lifetime-ms",
        "60000",
    ];
    let mut doomed = Worker::spawn_with(&env, "x", &[&args[..], &["--hang-in-handler"]].concat());
    doomed.expect_line("HANDLING").await;
    doomed.sigkill().await;
    let restarted_at = std::time::Instant::now();
    let survivor = Worker::spawn_with(&env, "x", &args);
    wait_until(
        Duration::from_secs(20),
        "the fact, well before the claim could expire",
        || async { env.fact_count().await == 1 },
    )
    .await
    .unwrap();
    println!(
        "recovered {:?} after the restart (ack_wait 1 s, claim lifetime 60 s)",
        restarted_at.elapsed()
    );
    wait_until(WAIT, "acked", || env.consumer_drained("testworker"))
        .await
        .unwrap();
    survivor.terminate().await;
    assert_eq!(env.facts().await[0].2.id, ready_fact(&request).id);
}
