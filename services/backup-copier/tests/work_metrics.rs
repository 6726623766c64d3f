//! The backup copier's part of the work metrics (issue 18 item 2), in-process against a real
//! nats-server and catalogue recorder and posix tiers: drills on the clock count their
//! verdicts and set the backup tier's drill gauges, and one flipped byte in the backup shows
//! as a failed version (what `StagehandDrillFailed` alerts on). One test per process, so the
//! process-wide metrics are this test's alone.

mod common;

use common::*;
use stagehand_schemas::Body;
use stagehand_telemetry::names;
use stagehand_testkit::wait_until;

use stagehand_testkit::scrape_sample as sample;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drills_count_verdicts_and_a_corrupt_backup_shows_a_failed_version() -> anyhow::Result<()> {
    let handle = stagehand_telemetry::metrics::install();
    let (_tmp, root) = tmp_root();
    let policies = root.join("policies");
    write_policies(
        &policies,
        &tiers_toml(&root, "hot-fs", &posix_backup(&root)),
        &backup_toml("1s", ""),
    );
    let mut stack = Stack::start().await;
    stack.start_copier(&policies, &root.join("state/copier"));
    let files = sample_files(3, 3000);
    let refs = write_files(
        &root.join("source/lab-a/cats/up1"),
        &files
            .iter()
            .map(|(p, b)| (p.as_str(), b.clone()))
            .collect::<Vec<_>>(),
    );
    let fact = validated("cats", "lab-a/cats/up1", refs);
    let Body::DatasetValidated(v) = &fact.body else {
        unreachable!()
    };
    let version = v.version.clone();
    stack.bus.publish(&fact).await?;

    let tier = r#"tier="backup""#;
    let verified = r#"tier="backup",outcome="verified""#;
    let failed = r#"tier="backup",outcome="failed""#;
    wait_until(WAIT, "a verified drill counted", || async {
        let scrape = handle.render();
        sample(&scrape, names::DRILLS_TOTAL, verified).is_some_and(|n| n >= 1.0)
            && sample(&scrape, names::DRILL_NEVER_VERSIONS, tier) == Some(0.0)
    })
    .await?;
    let scrape = handle.render();
    assert_eq!(
        sample(&scrape, names::BACKUP_PROTECTED_VERSIONS, tier),
        Some(1.0),
        "{scrape}"
    );
    assert_eq!(
        sample(&scrape, names::DRILL_FAILED_VERSIONS, tier),
        Some(0.0),
        "{scrape}"
    );
    assert_eq!(
        sample(&scrape, names::DRILL_INTERVAL_SECONDS, tier),
        Some(1.0),
        "{scrape}"
    );
    let last = sample(&scrape, names::DRILL_LAST_TIMESTAMP_SECONDS, tier).unwrap();
    let now = time::OffsetDateTime::now_utc().unix_timestamp() as f64;
    assert!(last > now - 600.0 && last <= now + 1.0, "{last} vs {now}");
    assert_eq!(
        sample(&scrape, names::DRILLS_TOTAL, failed),
        None,
        "{scrape}"
    );

    // One byte of one file in the backup flips: the next drill fails, and says so.
    let replica = format!("lab-a/cats/{version}");
    let victim = root.join("backup").join(&replica).join(&files[0].0);
    let mut bytes = std::fs::read(&victim)?;
    bytes[100] ^= 0x01;
    std::fs::write(&victim, &bytes)?;
    wait_until(WAIT, "the failed drill counted", || async {
        let scrape = handle.render();
        sample(&scrape, names::DRILLS_TOTAL, failed).is_some_and(|n| n >= 1.0)
            && sample(&scrape, names::DRILL_FAILED_VERSIONS, tier) == Some(1.0)
    })
    .await?;
    stack.stop().await;
    Ok(())
}
