//! Backups end to end as `stagehand up` runs them, against a real nats-server: a folder
//! ingested and validated is backed up and its drill verified; `stagehand restore D@V --to
//! capacity` restores it, verified and recorded; one byte flipped in the backup makes the next
//! drill fail with that file named, `stagehand backup status` flags it (and `--check` exits 1),
//! and a restore from the damaged backup is refused. The commands run as the real binary.

use std::path::Path;
use std::process::{Command, Output};
use std::time::Duration;

use stagehand::ingest::{IngestOptions, Outcome, ingest};
use stagehand::up::{Stack, UpOptions, write_default_policies};
use stagehand_bus::{Bus, BusConfig};
use stagehand_catalogue::{Catalogue, ReplicaState};
use stagehand_testkit::{NatsServer, wait_for};

const WAIT: Duration = Duration::from_secs(60);

fn stagehand(url: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_stagehand"))
        .args(args)
        .env("STAGEHAND_NATS_URL", url)
        .output()
        .unwrap()
}

fn status_lines(url: &str) -> Vec<serde_json::Value> {
    let out = stagehand(url, &["backup", "status", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn write_folder(dir: &Path) {
    for i in 0..6 {
        let sub = dir.join(format!("shard-{}", i % 2));
        std::fs::create_dir_all(&sub).unwrap();
        std::fs::write(
            sub.join(format!("{i:03}.jpg")),
            format!("image {i} ").repeat(300 + i),
        )
        .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_is_drilled_restored_and_a_corrupt_byte_is_flagged_by_backup_status()
-> anyhow::Result<()> {
    let nats = NatsServer::start();
    let url = nats.url();
    let home = tempfile::tempdir()?;
    let policies = home.path().join("policies");
    write_default_policies(&policies, home.path())?;
    // Drill every second (the shipped policy drills daily).
    let backup_toml = std::fs::read_to_string(policies.join("backup.toml"))?
        .replace("drill_every = \"24h\"", "drill_every = \"1s\"");
    std::fs::write(policies.join("backup.toml"), backup_toml)?;
    let stack = Stack::start(UpOptions {
        home: home.path().to_owned(),
        nats: Some(BusConfig::new(&url)),
        port: 0,
        policies: Some(policies.clone()),
    })
    .await?;
    stack.ready(WAIT).await?;
    let bus = Bus::connect(&BusConfig::new(&url)).await?;

    let folder = tempfile::tempdir()?;
    write_folder(folder.path());
    let report = ingest(
        &bus,
        &IngestOptions {
            source: folder.path().to_string_lossy().into_owned(),
            in_place: false,
            project: "lab-a".into(),
            dataset: "street".into(),
            tier: "source".into(),
            policies: policies.clone(),
            requested_by: "alice".into(),
            labels: vec![],
            manifest: None,
            wait: Some(WAIT),
            progress: false,
            clock_skew: stagehand::ingest::CLOCK_SKEW,
            spool: None,
        },
    )
    .await?;
    let Some(Outcome::Validated(validated)) = &report.outcome else {
        anyhow::bail!("not validated: {:?}", report.outcome)
    };
    let version = validated.version.clone();
    let placed: Vec<stagehand_schemas::FileRef> =
        report.manifest.entries().collect::<Result<_, _>>()?;
    let target = format!("street@{}", &version[..12]);

    // Backed up and drilled: `backup status` shows it protected and verified.
    let line = wait_for(WAIT, "the version backed up and drilled", || async {
        status_lines(&url)
            .into_iter()
            .find(|l| l["version"] == version.as_str() && l["last_drill"]["ok"] == true)
    })
    .await?;
    assert_eq!(line["protected"], true);
    assert_eq!(line["backup_tier"], "backup");
    assert_eq!(line["flag"], serde_json::Value::Null);
    assert_eq!(line["last_drill"]["sampled_files"], 6);
    let check = stagehand(&url, &["backup", "status", "--check"]);
    assert_eq!(
        check.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&check.stdout)
    );

    // A real restore onto the capacity tier.
    let policies_arg = policies.display().to_string();
    let out = stagehand(
        &url,
        &[
            "restore",
            &target,
            "--to",
            "capacity",
            "--policies",
            &policies_arg,
        ],
    );
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        said.contains("6 files") && said.contains("verified by read-back"),
        "{said}"
    );
    let restored = home
        .path()
        .join("tiers/capacity/lab-a/street")
        .join(&version);
    for f in &placed {
        let bytes = std::fs::read(restored.join(&f.path))?;
        assert_eq!(
            stagehand_schemas::sha256_hex(&bytes),
            f.sha256,
            "{}",
            f.path
        );
    }
    let catalogue = Catalogue::new(bus.client().clone());
    wait_for(WAIT, "the restored replica in the catalogue", || async {
        let v = catalogue.version(None, "street", &version).await.ok()?;
        v.replicas
            .into_iter()
            .find(|r| r.tier == "capacity" && r.state == ReplicaState::Present)
    })
    .await?;

    // One byte flips in the backup: the next drill fails, naming the file; status flags it.
    let victim = &placed[3].path;
    let file = home
        .path()
        .join("tiers/backup/lab-a/street")
        .join(&version)
        .join(victim);
    let mut bytes = std::fs::read(&file)?;
    bytes[100] ^= 0x20;
    std::fs::write(&file, &bytes)?;
    let line = wait_for(WAIT, "the failed drill in backup status", || async {
        status_lines(&url)
            .into_iter()
            .find(|l| l["version"] == version.as_str() && l["last_drill"]["ok"] == false)
    })
    .await?;
    assert_eq!(line["flag"], "drill_failed");
    assert_eq!(line["last_drill"]["problems"][0]["path"], victim.as_str());
    assert_eq!(
        line["last_drill"]["problems"][0]["code"],
        "checksum_mismatch"
    );
    let text = stagehand(&url, &["backup", "status"]);
    let shown = String::from_utf8_lossy(&text.stdout);
    assert!(
        shown.contains(&format!("FAILED: checksum_mismatch {victim}"))
            && shown.contains("FLAGGED: drill failed"),
        "{shown}"
    );
    let flagged = stagehand(&url, &["backup", "status", "--check", "--flagged"]);
    assert_eq!(
        flagged.status.code(),
        Some(1),
        "--check exits 1 on a flagged version"
    );

    // A restore from the damaged backup is refused, naming the file; nothing appears.
    let out = stagehand(
        &url,
        &[
            "restore",
            &target,
            "--to",
            "hot",
            "--policies",
            &policies_arg,
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains(victim.as_str()), "{err}");
    assert!(
        !home
            .path()
            .join("tiers/hot/lab-a/street")
            .join(&version)
            .exists()
    );

    // Arguments are checked before anything connects.
    let bad = stagehand(
        "nats://127.0.0.1:1",
        &["restore", "street@abc", "--to", "hot"],
    );
    assert_eq!(bad.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("8 or more hex characters"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
    stack.stop().await?;
    Ok(())
}
