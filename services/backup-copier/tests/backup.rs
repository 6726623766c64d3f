//! The backup copier in-process against a real nats-server and catalogue recorder, posix
//! tiers: a validated dataset and a tagged checkpoint backed up and verified, drilled, restored
//! for real; one corrupted byte in the backup failing the next drill with that file named (and
//! a restore from it refused with nothing visible); a source in the backup tier's failure
//! domain refused at run time, and a backup tier sharing one refused at start-up.

mod common;

use common::*;
use futures::StreamExt;
use stagehand_backup_copier::{BackupError, RestoreRequest, Settings, open};
use stagehand_catalogue::ReplicaState;
use stagehand_mover::{CancellationToken, Progress};
use stagehand_policy::PolicyError;
use stagehand_schemas::{Body, sha256_hex, subject, wire};
use stagehand_testkit::wait_for;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_verifies_drills_restores_and_a_corrupt_byte_fails_the_next_drill()
-> anyhow::Result<()> {
    let (_tmp, root) = tmp_root();
    let policies = root.join("policies");
    write_policies(
        &policies,
        &tiers_toml(&root, "hot-fs", &posix_backup(&root)),
        &backup_toml("1s", ""),
    );
    let mut stack = Stack::start().await;
    stack.start_copier(&policies, &root.join("state/copier"));

    // A validated dataset of 5 files and a checkpoint tagged `keep` on the hot tier.
    let files = sample_files(5, 3000);
    let refs = write_files(
        &root.join("source/lab-a/cats/up1"),
        &files
            .iter()
            .map(|(p, b)| (p.as_str(), b.clone()))
            .collect::<Vec<_>>(),
    );
    let fact = validated("cats", "lab-a/cats/up1", refs.clone());
    let Body::DatasetValidated(v) = &fact.body else {
        unreachable!()
    };
    let version = v.version.clone();
    let ckpt_refs = write_files(
        &root.join("hot/lab-a/runs/r1/100"),
        &[
            ("model.pt", b"weights".repeat(100)),
            ("opt.pt", b"moments".to_vec()),
        ],
    );
    let ckpt = checkpoint(
        "r1",
        100,
        "hot",
        "lab-a/runs/r1/100",
        ckpt_refs.clone(),
        &["keep"],
    );
    let ckpt_version = stagehand_schemas::version_digest(&ckpt_refs);
    let untagged = checkpoint("r1", 200, "hot", "lab-a/runs/r1/100", ckpt_refs, &["best"]);
    stack.bus.publish(&fact).await?;
    stack.bus.publish(&ckpt).await?;
    stack.bus.publish(&untagged).await?;

    // Backed up, then drilled and verified, on the clock.
    let status = stack
        .wait_status("the dataset backed up and drilled", "cats", &version, |s| {
            s.on("backup")
                .and_then(|r| r.last_drill.as_ref())
                .is_some_and(|d| d.ok)
        })
        .await;
    let replica = status.on("backup").unwrap();
    assert_eq!(replica.prefix, format!("lab-a/cats/{version}"));
    assert_eq!((replica.files, replica.total_bytes), (5, 15_000));
    assert_eq!(replica.last_drill.as_ref().unwrap().sampled_files, 5);
    let backup_dir = root.join("backup").join(&replica.prefix);
    for (path, bytes) in &files {
        assert_eq!(&std::fs::read(backup_dir.join(path))?, bytes, "{path}");
    }
    let manifest = std::fs::read(backup_dir.join(".stagehand-manifest"))?;
    assert_eq!(
        sha256_hex(&manifest),
        version,
        "the manifest is the version"
    );
    let ckpt_status = stack
        .wait_status("the checkpoint backed up", "r1", &ckpt_version, |s| {
            s.is_protected()
        })
        .await;
    assert!(!ckpt_status.recorded, "a checkpoint has no version record");
    assert_eq!(
        ckpt_status.on("backup").unwrap().prefix,
        format!("lab-a/r1/{ckpt_version}")
    );
    // The untagged checkpoint (same bytes, step 200) was not selected: one backup of r1 only.
    let all = stack
        .catalogue
        .backup_status(Some(PROJECT), None, true, None, None)
        .await?;
    assert_eq!(all.items.len(), 2, "{:#?}", all.items);

    // A real restore onto the capacity tier: verified, published whole, recorded.
    let restorer = open(&Settings::new(&policies, root.join("state/restore")))?;
    let request = RestoreRequest {
        project: None,
        dataset: "cats".into(),
        version: version[..12].into(),
        to: "capacity".into(),
    };
    let cancel = CancellationToken::new();
    let report = restorer
        .restore(
            &stack.bus,
            &stack.catalogue,
            &request,
            &Progress::new(),
            &cancel,
        )
        .await?;
    assert_eq!((report.files, report.copied, report.existed), (5, 5, false));
    assert_eq!(report.verified_by, "read-back");
    let restored = root.join("capacity").join(&report.to.prefix);
    for (path, bytes) in &files {
        assert_eq!(&std::fs::read(restored.join(path))?, bytes, "{path}");
    }
    assert!(
        !restored.join(".stagehand-manifest").exists(),
        "a restore holds the dataset's files only"
    );
    wait_for(WAIT, "the restored replica in the catalogue", || async {
        let v = stack.catalogue.version(None, "cats", &version).await.ok()?;
        v.replicas
            .into_iter()
            .find(|r| r.tier == "capacity" && r.state == ReplicaState::Present)
            .filter(|r| r.verified_by.as_deref() == Some("read-back") && !r.backup)
    })
    .await?;
    let again = restorer
        .restore(
            &stack.bus,
            &stack.catalogue,
            &request,
            &Progress::new(),
            &cancel,
        )
        .await?;
    assert!(again.existed, "restored already: nothing copied");
    assert_eq!(again.fact_id, report.fact_id, "recorded once");

    // One byte of one file in the backup flips: the next drill fails naming that file.
    let victim = "part-1/0001.bin";
    let mut bytes = std::fs::read(backup_dir.join(victim))?;
    bytes[1234] ^= 0x01;
    std::fs::write(backup_dir.join(victim), &bytes)?;
    let failed = stack
        .wait_status(
            "the drill after the corruption failed",
            "cats",
            &version,
            |s| {
                backup_copy(s).is_some_and(|r| {
                    r.state == ReplicaState::Damaged && r.last_drill.as_ref().is_some_and(|d| !d.ok)
                })
            },
        )
        .await;
    // The catalogue holds the backup damaged: no longer a copy to rely on.
    assert_eq!(failed.on("backup"), None);
    let drill = backup_copy(&failed).unwrap().last_drill.clone().unwrap();
    assert_eq!(drill.problems.len(), 1, "{:#?}", drill.problems);
    assert_eq!(drill.problems[0].code, "checksum_mismatch");
    assert_eq!(drill.problems[0].path.as_deref(), Some(victim));

    // A restore from the damaged backup is refused, and nothing appears on the target.
    let onto_hot = RestoreRequest {
        to: "hot".into(),
        ..request.clone()
    };
    let err = restorer
        .restore(
            &stack.bus,
            &stack.catalogue,
            &onto_hot,
            &Progress::new(),
            &cancel,
        )
        .await
        .expect_err("a corrupt backup must not be restored");
    assert!(err.to_string().contains(victim), "{err}");
    assert!(!root.join("hot").join(&report.to.prefix).exists());
    assert!(
        !listing(&root.join("hot/lab-a/cats"))
            .iter()
            .any(|p| !p.starts_with('.')),
        "only a hidden staging folder may be left"
    );
    stack.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_in_the_backup_tiers_failure_domain_is_refused_at_run_time() -> anyhow::Result<()>
{
    let (_tmp, root) = tmp_root();
    let policies = root.join("policies");
    // The hot tier shares the backup's failure domain; the backup does not claim to protect
    // it, so the policies load — but a copy from hot would land in the same domain.
    write_policies(
        &policies,
        &tiers_toml(&root, "backup-site", &posix_backup(&root)),
        &backup_toml("1h", ""),
    );
    let mut stack = Stack::start().await;
    let mut dead = stack
        .bus
        .client()
        .subscribe(subject::dead_letter_subject("backup-copier"))
        .await?;
    stack.start_copier(&policies, &root.join("state/copier"));
    let refs = write_files(
        &root.join("hot/lab-a/runs/r1/5"),
        &[("w.pt", b"w".repeat(64))],
    );
    stack
        .bus
        .publish(&checkpoint(
            "r1",
            5,
            "hot",
            "lab-a/runs/r1/5",
            refs,
            &["keep"],
        ))
        .await?;
    let letter = tokio::time::timeout(WAIT, dead.next())
        .await?
        .expect("a dead letter");
    let Body::DeadLetter(letter) = wire::decode(&letter.payload)?.body else {
        panic!("not a dead letter");
    };
    assert_eq!(letter.errors.len(), 1, "refused at once, not retried");
    let error = &letter.errors[0];
    assert!(error.permanent);
    assert!(
        error.error.contains("failure domain \"backup-site\""),
        "{}",
        error.error
    );
    assert_eq!(
        listing(&root.join("backup")),
        Vec::<String>::new(),
        "nothing copied"
    );
    stack.stop().await;
    Ok(())
}

#[test]
fn a_backup_tier_sharing_a_failure_domain_is_refused_at_start_up() {
    let (_tmp, root) = tmp_root();
    let policies = root.join("policies");
    let same = posix_backup(&root).replace("backup-site", "capacity-store");
    write_policies(
        &policies,
        &tiers_toml(&root, "hot-fs", &same),
        &backup_toml("1h", ""),
    );
    let err = open(&Settings::new(&policies, root.join("state"))).expect_err("must refuse");
    let text = err.to_string();
    match err {
        BackupError::Policy(PolicyError::Invalid { key, .. }) => {
            assert_eq!(key, "tiers.backup.failure_domain", "{text}");
        }
        other => panic!("not a policy error: {other}"),
    }
    assert!(
        text.contains("tiers.toml:"),
        "names the file and line: {text}"
    );
    assert!(
        text.contains("shares failure domain \"capacity-store\" with tier \"capacity\""),
        "{text}"
    );
}

/// Two uploads of the same bytes (two requests, one version) validated at once are one backup
/// set: both facts get their `backup.completed` (neither is dead-lettered) and the set is
/// written whole once (this process stages a set one task at a time).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_facts_of_one_version_at_once_make_one_backup() -> anyhow::Result<()> {
    let (_tmp, root) = tmp_root();
    let policies = root.join("policies");
    write_policies(
        &policies,
        &tiers_toml(&root, "hot-fs", &posix_backup(&root)),
        &backup_toml("1h", ""),
    );
    let mut stack = Stack::start().await;
    let mut completed = stack
        .bus
        .client()
        .subscribe(subject::kind_filter("fact", "backup.completed"))
        .await?;
    stack.start_copier(&policies, &root.join("state/copier"));
    let files = sample_files(40, 40_000);
    let named: Vec<(&str, Vec<u8>)> = files.iter().map(|(p, b)| (p.as_str(), b.clone())).collect();
    let a = write_files(&root.join("source/lab-a/cats/a"), &named);
    let b = write_files(&root.join("source/lab-a/cats/b"), &named);
    // Same version, different requests (the second upload is its own request).
    let first = validated("cats", "lab-a/cats/a", a);
    let mut second = validated("cats", "lab-a/cats/b", b);
    second.id = stagehand_schemas::EventId::new("validated-second-upload")?;
    stack.bus.publish(&first).await?;
    stack.bus.publish(&second).await?;
    let mut prefixes = Vec::new();
    for _ in 0..2 {
        let msg = tokio::time::timeout(WAIT, completed.next())
            .await?
            .expect("a backup.completed");
        let Body::BackupCompleted(done) = wire::decode(&msg.payload)?.body else {
            panic!("not a backup.completed");
        };
        prefixes.push(done.location.prefix);
    }
    assert_eq!(prefixes[0], prefixes[1], "one set");
    let set = root.join("backup").join(&prefixes[0]);
    for (path, bytes) in &files {
        assert_eq!(&std::fs::read(set.join(path))?, bytes, "{path}");
    }
    let hidden: Vec<String> = listing(&root.join("backup/lab-a/cats"))
        .into_iter()
        .filter(|p| p.starts_with('.'))
        .collect();
    assert!(hidden.is_empty(), "no staging folder left: {hidden:?}");
    stack.stop().await;
    Ok(())
}
