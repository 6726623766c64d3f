//! The backup copier under the shipped permissions: against a real nats-server running
//! `deploy/nats/accounts.conf`, provisioned by the operator, the copier runs as its own user
//! `backup-copier` (checking rather than managing streams) next to the recorder as its own
//! user. A validated dataset whose manifest travels by reference (put by the validator's user
//! in the services' bucket) is backed up and verified, drilled on the clock (the catalogue
//! asked, the drill claimed, `restore.verified` published), and a source in the backup tier's
//! failure domain is dead-lettered — each step needing one of its grants, none of them
//! refused.

mod common;

use std::time::Duration;

use common::*;
use futures::StreamExt;
use stagehand_bus::{Bus, BusConfig, CancellationToken};
use stagehand_catalogue::Catalogue;
use stagehand_manifest::{BucketOptions, Manifest, ManifestStore};
use stagehand_schemas::{Body, subject, wire};
use stagehand_testkit::{NatsServer, user_url};

/// A connection as `user`, checking rather than managing streams (the shipped configs').
async fn bus_as(server: &NatsServer, user: &str, role: &str) -> anyhow::Result<Bus> {
    let mut cfg = BusConfig::new(user_url(server, user, role));
    cfg.provision = false;
    Ok(Bus::connect(&cfg).await?)
}

/// Files of the by-reference version: enough that its manifest spans several Object Store
/// chunks, few enough to copy in a moment.
const FILES: usize = 300;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_copier_backs_up_drills_and_dead_letters_as_its_own_user() -> anyhow::Result<()> {
    let server = NatsServer::builder().shipped_accounts().start();
    let operator = Bus::connect(&BusConfig::new(user_url(&server, "operator", "OPERATOR"))).await?;
    operator.provision().await?;

    let (_tmp, root) = tmp_root();
    let policies = root.join("policies");
    // The hot tier shares the backup tier's failure domain (it does not claim to protect it).
    write_policies(
        &policies,
        &tiers_toml(&root, "backup-site", &posix_backup(&root)),
        &backup_toml("1s", ""),
    );

    let stop = CancellationToken::new();
    let mut recorder = stagehand_catalogue_recorder::config(
        &user_url(&server, "catalogue-recorder", "CATALOGUE_RECORDER"),
        root.join("state/catalogue"),
    );
    recorder.bus.provision = false;
    let recorder = tokio::spawn(stagehand_catalogue_recorder::run(recorder, stop.clone()));
    let mut copier = stagehand_backup_copier::config(
        &user_url(&server, "backup-copier", "BACKUP_COPIER"),
        &policies,
        root.join("state/copier"),
    );
    copier.bus.provision = false;
    copier.service.drill_check = Duration::from_millis(100);
    let copier = tokio::spawn(stagehand_backup_copier::run(copier, stop.clone()));

    let client = operator.client();
    let mut completed = client
        .subscribe(subject::kind_filter("fact", "backup.completed"))
        .await?;
    let mut verified = client
        .subscribe(subject::kind_filter("fact", "restore.verified"))
        .await?;
    let mut dead = client
        .subscribe(subject::dead_letter_subject("backup-copier"))
        .await?;

    // The validator's user puts the manifest in the services' bucket and publishes the fact.
    let files = sample_files(FILES, 100);
    let named: Vec<(&str, Vec<u8>)> = files.iter().map(|(p, b)| (p.as_str(), b.clone())).collect();
    let refs = write_files(&root.join("source/lab-a/cats/up1"), &named);
    let manifest = Manifest::from_entries(refs.clone());
    let validator = bus_as(&server, "ingest-validator", "INGEST_VALIDATOR").await?;
    let reference = ManifestStore::catalogue(validator.jetstream(), BucketOptions::default())
        .await?
        .put(&manifest)
        .await?;
    let mut fact = validated("cats", "lab-a/cats/up1", refs);
    let Body::DatasetValidated(v) = &mut fact.body else {
        unreachable!()
    };
    v.files.clear();
    v.manifest = Some(reference.clone());
    let version = v.version.clone();
    assert_eq!(reference.digest, version);
    validator.publish(&fact).await?;

    // Backed up, every file, from the manifest it read by reference.
    let msg = tokio::time::timeout(WAIT, completed.next())
        .await?
        .expect("a backup.completed");
    let Body::BackupCompleted(done) = wire::decode(&msg.payload)?.body else {
        panic!("not a backup.completed");
    };
    assert_eq!(
        (done.version.as_str(), done.files),
        (version.as_str(), FILES as u64)
    );
    let set = root.join("backup").join(&done.location.prefix);
    for (path, bytes) in &files {
        assert_eq!(&std::fs::read(set.join(path))?, bytes, "{path}");
    }

    // Drilled on the clock: the catalogue asked, the period claimed, the verdict published.
    let msg = tokio::time::timeout(WAIT, verified.next())
        .await?
        .expect("a restore.verified");
    let Body::RestoreVerified(drilled) = wire::decode(&msg.payload)?.body else {
        panic!("not a restore.verified");
    };
    // A sample: the policy's budget is 64 files (backup_toml), the version holds 300.
    assert_eq!(
        (drilled.version.as_str(), drilled.sampled_files),
        (version.as_str(), 64)
    );

    // A checkpoint on the hot tier, in the backup's failure domain: dead-lettered at once.
    let ckpt = write_files(
        &root.join("hot/lab-a/runs/r1/5"),
        &[("w.pt", b"w".repeat(64))],
    );
    operator
        .publish(&checkpoint(
            "r1",
            5,
            "hot",
            "lab-a/runs/r1/5",
            ckpt,
            &["keep"],
        ))
        .await?;
    let letter = tokio::time::timeout(WAIT, dead.next())
        .await?
        .expect("a dead letter");
    let Body::DeadLetter(letter) = wire::decode(&letter.payload)?.body else {
        panic!("not a dead letter");
    };
    assert_eq!(letter.errors.len(), 1, "refused at once");
    assert!(
        letter.errors[0].error.contains("failure domain"),
        "{:?}",
        letter.errors
    );

    // The catalogue, as the operator sees it: protected and drilled.
    let catalogue = Catalogue::new(client.clone()).with_timeout(Duration::from_secs(5));
    let status = stagehand_testkit::wait_for(WAIT, "the drill in the catalogue", || async {
        let page = catalogue
            .backup_status(Some(PROJECT), None, true, None, None)
            .await
            .ok()?;
        let drilled = page.items.iter().any(|v| {
            v.on("backup")
                .and_then(|r| r.last_drill.as_ref())
                .is_some_and(|d| d.ok)
        });
        drilled.then_some(page.items)
    })
    .await?;
    assert_eq!(status.len(), 1, "one protected version: {status:#?}");
    assert_eq!(status[0].version, version);
    assert!(
        validator.permission_violations().is_empty(),
        "{:?}",
        validator.permission_violations()
    );

    stop.cancel();
    copier.await??;
    recorder.await??;
    Ok(())
}
