//! The first slice end to end against a real nats-server: `stagehand ingest` → the ingest
//! validator → the catalogue recorder, with both services running in-process as `stagehand up`
//! runs them; a corrupted upload rejected with every reason; the same ingest run 50 times; and
//! the on-call commands of the runbooks (`stagehand dlq list|replay`, `stagehand catalogue`)
//! run as the real binary.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::Context;
use stagehand::ingest::{IngestOptions, Outcome, ingest};
use stagehand::up::{Stack, UpOptions};
use stagehand_bus::{Bus, BusConfig};
use stagehand_catalogue::{Answer, DatasetDetail, Query, ask};
use stagehand_schemas::{FileRef, sha256_hex, subject, version_digest};
use stagehand_testkit::{NatsServer, wait_for, wait_until};

const WAIT: Duration = Duration::from_secs(60);

fn write_sample(dir: &Path, files: usize) {
    for i in 0..files {
        let sub = dir.join(format!("part-{}", i % 4));
        std::fs::create_dir_all(&sub).unwrap();
        std::fs::write(
            sub.join(format!("{i:05}.bin")),
            format!("sample {i}\n").repeat(i + 1),
        )
        .unwrap();
    }
}

fn options(stack: &Stack, folder: &Path, dataset: &str) -> IngestOptions {
    IngestOptions {
        source: folder.to_str().expect("a UTF-8 temp path").to_owned(),
        in_place: false,
        project: "lab-a".into(),
        dataset: dataset.into(),
        tier: "source".into(),
        policies: stack.env.policies.clone(),
        requested_by: "alice".into(),
        labels: vec![],
        manifest: None,
        wait: Some(WAIT),
        progress: false,
        clock_skew: stagehand::ingest::CLOCK_SKEW,
        spool: None,
    }
}

async fn dataset(client: &async_nats::Client, name: &str) -> Option<DatasetDetail> {
    let q = Query::Dataset {
        project: Some("lab-a".into()),
        dataset: name.into(),
        limit: None,
    };
    match ask(client, &q, Duration::from_secs(5)).await {
        Ok(Answer::Dataset(d)) => Some(d),
        _ => None,
    }
}

/// Runs the real `stagehand` binary and returns its stdout; fails on a non-zero exit.
fn stagehand(url: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_stagehand"))
        .args(args)
        .env("STAGEHAND_NATS_URL", url)
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "stagehand {args:?} exited {}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?)
}

async fn count_on(bus: &Bus, stream: &str, subject: &str) -> anyhow::Result<u64> {
    let s = bus.jetstream().get_stream(stream).await?;
    let info = s.info_with_subjects(subject).await?;
    use futures::TryStreamExt;
    let subjects: std::collections::HashMap<String, usize> = info.try_collect().await?;
    Ok(subjects.values().map(|n| *n as u64).sum())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ingest_validate_catalogue_reject_and_dedup() -> anyhow::Result<()> {
    let nats = NatsServer::start();
    let home = tempfile::tempdir()?;
    let stack = Stack::start(UpOptions {
        home: home.path().to_owned(),
        nats: Some(stagehand_bus::BusConfig::new(nats.url())),
        port: 0,
        policies: None,
    })
    .await?;
    stack.ready(WAIT).await?;
    let bus = Bus::connect(&BusConfig::new(nats.url())).await?;
    let client = bus.client().clone();

    // A good upload: validated, catalogued with the right digest and file count.
    let sample = tempfile::tempdir()?;
    write_sample(sample.path(), 120);
    let report = ingest(&bus, &options(&stack, sample.path(), "sample")).await?;
    let Some(Outcome::Validated(validated)) = &report.outcome else {
        anyhow::bail!("sample not validated: {:?}", report.outcome)
    };
    let report_files: Vec<FileRef> = report.manifest.entries().collect::<Result<_, _>>()?;
    let digest = version_digest(&report_files);
    assert_eq!(validated.version, digest);
    assert_eq!(report_files.len(), 120);
    let detail = wait_for(WAIT, "the sample in the catalogue", || async {
        dataset(&client, "sample")
            .await
            .filter(|d| !d.versions.is_empty())
    })
    .await?;
    assert_eq!(detail.versions.len(), 1);
    assert_eq!(detail.versions[0].version, digest);
    assert_eq!(detail.versions[0].file_count, 120);
    assert!(detail.replicas.iter().any(|r| r.tier == "source"));

    // The same ingest 50 times: one request, one validation, one catalogue version.
    for _ in 0..49 {
        let mut opts = options(&stack, sample.path(), "sample");
        opts.wait = None;
        let again = ingest(&bus, &opts).await?;
        assert_eq!(again.request.id, report.request.id);
        assert!(!again.published_new, "a re-run is the same request");
    }
    let validated_subject = "stagehand.fact.dataset.validated.lab-a";
    assert_eq!(
        count_on(&bus, subject::FACTS.name, validated_subject).await?,
        1
    );
    assert_eq!(
        count_on(
            &bus,
            subject::REQUESTS.name,
            "stagehand.req.ingest.requested.lab-a"
        )
        .await?,
        1
    );
    let detail = dataset(&client, "sample").await.context("sample")?;
    assert_eq!(detail.versions.len(), 1);
    assert_eq!(detail.versions[0].request_count, 1);

    // A corrupted upload: wrong hash, wrong size, a `../` path, a missing file.
    let bad = tempfile::tempdir()?;
    std::fs::write(bad.path().join("a.bin"), b"aaaa")?;
    std::fs::write(bad.path().join("b.bin"), b"bbbb")?;
    let manifest = bad.path().join("../bad-manifest.tsv");
    std::fs::write(
        &manifest,
        format!(
            "a.bin\t4\t{}\nb.bin\t5\t{}\n../evil\t1\t{}\nmissing.bin\t3\t{}\n",
            sha256_hex(b"not a"),
            sha256_hex(b"bbbb"),
            sha256_hex(b"x"),
            sha256_hex(b"abc"),
        ),
    )?;
    let mut opts = options(&stack, bad.path(), "bad");
    opts.manifest = Some(manifest.clone());
    let report = ingest(&bus, &opts).await?;
    let Some(Outcome::Rejected(rejected)) = &report.outcome else {
        anyhow::bail!("corrupted upload not rejected: {:?}", report.outcome)
    };
    let codes: Vec<&str> = rejected.problems.iter().map(|p| p.code.as_str()).collect();
    for code in ["checksum_mismatch", "size_mismatch", "path_rule", "missing"] {
        assert!(codes.contains(&code), "{code} missing from {codes:?}");
    }
    let bad_detail = wait_for(WAIT, "the rejection in the catalogue", || async {
        dataset(&client, "bad")
            .await
            .filter(|d| !d.rejections.is_empty())
    })
    .await?;
    assert!(bad_detail.versions.is_empty());
    assert_eq!(bad_detail.rejections[0].problems, rejected.problems);

    // The binary's catalogue commands, as the runbooks use them.
    let text = stagehand(&nats.url(), &["catalogue", "show", "bad"])?;
    assert!(
        text.contains("checksum_mismatch") && text.contains("../evil"),
        "{text}"
    );
    // `--json` streams one line per file, every file of the version, in path order.
    let json = stagehand(
        &nats.url(),
        &[
            "catalogue",
            "show",
            &format!("sample@{}", &digest[..8]),
            "--json",
        ],
    )?;
    let lines: Vec<FileRef> = json
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    let mut placed = report_files.clone();
    placed.sort_by(|a, b| a.path.as_bytes().cmp(b.path.as_bytes()));
    assert_eq!(lines, placed);
    // A page, the next page, and one file's entry.
    let text = stagehand(
        &nats.url(),
        &[
            "catalogue",
            "show",
            &format!("sample@{}", &digest[..8]),
            "--limit",
            "100",
        ],
    )?;
    assert_eq!(
        text.lines()
            .filter(|l| l.starts_with("    ") && l.contains('\t'))
            .count(),
        100
    );
    assert!(
        text.contains(&format!(
            "more: stagehand catalogue show sample@{} --limit 100 --after {}",
            &digest[..12],
            placed[99].path
        )),
        "{text}"
    );
    let text = stagehand(
        &nats.url(),
        &[
            "catalogue",
            "show",
            &format!("sample@{}", &digest[..8]),
            "--after",
            &placed[99].path,
        ],
    )?;
    assert_eq!(
        text.lines()
            .filter(|l| l.starts_with("    ") && l.contains('\t'))
            .count(),
        20
    );
    let text = stagehand(
        &nats.url(),
        &[
            "catalogue",
            "show",
            &format!("sample@{}", &digest[..8]),
            "--path",
            &placed[7].path,
        ],
    )?;
    assert_eq!(
        text,
        format!(
            "{}\t{}\t{}\n",
            placed[7].path, placed[7].size, placed[7].sha256
        )
    );
    let text = stagehand(&nats.url(), &["catalogue", "datasets"])?;
    assert!(text.contains("sample") && text.contains("bad"), "{text}");
    // The rebuild runbook's check: nothing the catalogue could not fold.
    let text = stagehand(&nats.url(), &["catalogue", "problems"])?;
    assert!(
        text.starts_with("0 facts the catalogue could not fold\n"),
        "{text}"
    );

    // A poison message is dead-lettered; the runbook's list and replay commands work on it.
    bus.jetstream()
        .publish("stagehand.req.ingest.requested.lab-a", "not msgpack".into())
        .await?
        .await?;
    let listed = wait_for(
        WAIT,
        "the poison message in the dead-letter stream",
        || async {
            let out = stagehand(
                &nats.url(),
                &["dlq", "list", "--service", "ingest-validator", "--json"],
            )
            .ok()?;
            let items: Vec<serde_json::Value> = serde_json::from_str(&out).ok()?;
            (items.len() == 1).then_some(items)
        },
    )
    .await?;
    let seq = listed[0]["sequence"].as_u64().context("sequence")?;
    let out = stagehand(&nats.url(), &["dlq", "replay", &seq.to_string()])?;
    assert!(
        out.contains("stagehand.req.ingest.requested.lab-a"),
        "{out}"
    );
    // Replayed, it is handled again — and, still poison, dead-lettered again. (The promoter's
    // uploads consumer reads the same subject and dead-letters its own copies.)
    wait_until(WAIT, "the replayed message dead-lettered again", || async {
        stagehand(
            &nats.url(),
            &["dlq", "list", "--service", "ingest-validator", "--json"],
        )
        .ok()
        .and_then(|out| serde_json::from_str::<Vec<serde_json::Value>>(&out).ok())
        .is_some_and(|items| items.len() == 2)
    })
    .await?;
    wait_until(WAIT, "the catalogue to count both dead letters", || async {
        matches!(
            ask(&client, &Query::DeadLetters { limit: None, after: None }, Duration::from_secs(5)).await,
            Ok(Answer::DeadLetters { services, .. }) if services.iter().any(|s| s.service == "ingest-validator" && s.count == 2)
        )
    })
    .await?;

    stack.stop().await?;
    Ok(())
}
