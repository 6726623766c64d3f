//! A worker process killed with SIGKILL in the middle of handling, or after recording its
//! outcome but before publishing and acking, yields exactly one set of facts once a new
//! process takes over.

mod common;

use std::process::Stdio;

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
        let mut child = Command::new(BIN)
            .args(["--url", &env.nats.url(), "--ledger"])
            .arg(env.ledger("testworker"))
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
            ledger.outcome("lab-a", &id).unwrap().is_some(),
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
        let outcome = ledger.outcome("lab-a", &r.id).unwrap().unwrap();
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
