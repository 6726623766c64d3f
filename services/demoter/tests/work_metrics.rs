//! The demoter's part of the work metrics (issue 18 item 2), against a real nats-server, the
//! real catalogue recorder and posix tiers: each pass sets the hot tier's capacity, Stagehand's
//! bytes on it, the bytes counted against the watermarks, the bytes live stages hold, its high
//! watermark, and each project's bytes. One test per process, so the process-wide gauges are
//! this test's alone.

mod common;

use common::*;
use stagehand_telemetry::names;
use stagehand_testkit::wait_until;

use stagehand_testkit::scrape_sample as sample;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pass_sets_the_tiers_fill_and_its_projects_use() {
    let handle = stagehand_telemetry::metrics::install();
    let mut stack = Stack::start(Options::default()).await;
    // Two versions of 2 MiB each, below the watermark; one held by a live job.
    let held = stack.place("owls", 1, 2, MIB, true).await;
    let free = stack.place("bats", 2, 2, MIB, true).await;
    stack.stage(&held, "job-1", ago(5)).await;
    stack.recorded(&held, 1, 0).await;
    stack.recorded(&free, 0, 0).await;
    stack.run_demoter();

    let mib = MIB as f64;
    let tier = r#"tier="hot""#;
    wait_until(WAIT, "a pass to set the hot tier's fill", || async {
        sample(&handle.render(), names::TIER_USED_BYTES, tier) == Some(4.0 * mib)
    })
    .await
    .unwrap();
    let scrape = handle.render();
    let capacity = sample(&scrape, names::TIER_CAPACITY_BYTES, tier).unwrap();
    assert!(capacity > 4.0 * mib, "{scrape}");
    let counted = sample(&scrape, names::TIER_COUNTED_BYTES, tier).unwrap();
    assert!(counted >= 4.0 * mib, "{scrape}");
    assert_eq!(
        sample(&scrape, names::TIER_HELD_BYTES, tier),
        Some(2.0 * mib),
        "{scrape}"
    );
    assert_eq!(
        sample(&scrape, names::TIER_HIGH_WATERMARK_RATIO, tier),
        Some(0.85),
        "{scrape}"
    );
    assert_eq!(
        sample(
            &scrape,
            names::PROJECT_USED_BYTES,
            &format!(r#"tier="hot",project="{PROJECT}""#)
        ),
        Some(4.0 * mib),
        "{scrape}"
    );
    stack.stop().await;
}
