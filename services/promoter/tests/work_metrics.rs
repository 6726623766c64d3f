//! The promoter's part of the work metrics (issue 18 item 2), against a real nats-server and
//! real posix tiers: each stage request's first answer is observed once in the request→ready
//! histogram by tier and outcome, a request still waiting is counted by what it waits for
//! until it is answered, and the copies made count its bytes from capacity to hot in
//! the stage class. One test per process, so the process-wide counts are this test's alone.

mod common;

use common::*;
use stagehand_telemetry::names;
use stagehand_testkit::{wait_for, wait_until};

use stagehand_testkit::scrape_sample as sample;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stage_answers_and_the_copy_behind_them_are_counted() {
    let handle = stagehand_telemetry::metrics::install();
    let mut stack = Stack::start().await;
    stack.run_promoter(stack.promoter_config("a"));
    let files = [("a.bin", bytes(1, 70_000)), ("b.bin", bytes(2, 30_000))];
    let (prefix, refs) = stack.put_files("capacity", "owls", "v1", &files);
    let version = stack.validated("owls", "capacity", &prefix, &refs).await;
    let js = stack.bus.jetstream().clone();

    // A copy, then a request answered at once, then one that fails.
    for job in ["job-1", "job-2"] {
        let request = stage_request("owls", &version, "hot", job, None, None);
        stack.publish(&request).await;
        wait_for(WAIT, "stage.ready", || async {
            answers(&js, "stage.ready", &request.id).await.pop()
        })
        .await
        .unwrap();
    }
    let unknown = stage_request("nope", "0123456789abcdef", "hot", "job-3", None, None);
    stack.publish(&unknown).await;
    wait_for(WAIT, "stage.failed", || async {
        answers(&js, "stage.failed", &unknown.id).await.pop()
    })
    .await
    .unwrap();

    // A request waiting for validation is counted as pending until its answer.
    let files = [("c.bin", bytes(7, 5000))];
    let (prefix, refs) = stack.put_files("capacity", "birds", "v1", &files);
    let birds = stagehand_schemas::version_digest(&refs);
    stack
        .ingest_requested("birds", "capacity", &prefix, &refs)
        .await;
    settled(&js, "a").await;
    let waiting = stage_request("birds", &birds[..16], "hot", "job-w", None, None);
    stack.publish(&waiting).await;
    let pending = r#"tier="hot",state="pending",waiting_for="validation""#;
    wait_until(WAIT, "the waiting request counted", || async {
        sample(&handle.render(), names::STAGES, pending) == Some(1.0)
    })
    .await
    .unwrap();
    stack.validated("birds", "capacity", &prefix, &refs).await;
    wait_for(WAIT, "stage.ready after validation", || async {
        answers(&js, "stage.ready", &waiting.id).await.pop()
    })
    .await
    .unwrap();
    wait_until(WAIT, "the answered request no longer counted", || async {
        sample(&handle.render(), names::STAGES, pending) == Some(0.0)
    })
    .await
    .unwrap();

    let count = format!("{}_count", names::STAGE_READY_SECONDS);
    let scrape = handle.render();
    assert_eq!(
        sample(&scrape, &count, r#"tier="hot",outcome="ready""#),
        Some(3.0),
        "{scrape}"
    );
    assert_eq!(
        sample(&scrape, &count, r#"tier="hot",outcome="failed""#),
        Some(1.0),
        "{scrape}"
    );
    let pair = r#"from_tier="capacity",to_tier="hot",class="stage""#;
    assert_eq!(
        sample(&scrape, names::BYTES_MOVED_TOTAL, pair),
        Some(105_000.0),
        "{scrape}"
    );
    assert_eq!(
        sample(&scrape, names::FILES_MOVED_TOTAL, pair),
        Some(3.0),
        "{scrape}"
    );
    stack.stop().await;
}
