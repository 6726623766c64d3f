//! A lasting failure of the catalogue store stops the recorder loudly, and loses nothing.
//!
//! The real `stagehand-catalogue-recorder` binary runs with its store on a tmpfs of a few MiB
//! (mounting needs root), which the test fills to the last byte. A fact that arrives then
//! cannot be committed: the recorder must exit non-zero naming the failure and the store's
//! file — never retry the fact until it is dead-lettered, which would leave the catalogue
//! without it for good. Restarted with space back, it folds the fact.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use stagehand_bus::{Bus, BusConfig};
use stagehand_catalogue::{Answer, Catalogue, Query};
use stagehand_catalogue_recorder::Store;
use stagehand_schemas::*;
use stagehand_testkit::{NatsServer, Tmpfs, wait_until};

const WAIT: Duration = Duration::from_secs(60);

/// A `dataset.validated` of `n` files listed inline: enough entries that folding it needs
/// fresh pages in the store.
fn validated(dataset: &str, n: u32) -> Event {
    let files: Vec<FileRef> = (0..n)
        .map(|i| {
            FileRef::new(
                format!("train/{dataset}-{i:07}.bin"),
                u64::from(i),
                sha256_hex(format!("{dataset}{i}").as_bytes()),
            )
        })
        .collect();
    let source = Location {
        tier: "source".into(),
        prefix: format!("lab-a/{dataset}"),
    };
    let request = Event::request(
        EventId::new(format!("req-{dataset}")).unwrap(),
        "lab-a",
        Body::IngestRequested(IngestRequested {
            dataset: dataset.into(),
            source: source.clone(),
            files: files.clone(),
            manifest: None,
            requested_by: "alice".into(),
            labels: vec![],
        }),
    );
    request.caused(
        "validated",
        Body::DatasetValidated(DatasetValidated {
            dataset: dataset.into(),
            version: version_digest(&files),
            source,
            total_bytes: total_bytes(&files),
            files,
            manifest: None,
            requested_by: "alice".into(),
            request_id: request.id.clone(),
            labels: vec![],
        }),
    )
}

/// The recorder binary with `config`, its log in `log`.
fn recorder(config: &Path, log: &Path) -> Child {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_stagehand-catalogue-recorder"));
    cmd.arg("--config")
        .arg(config)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap());
    for var in stagehand_bus::env::ALL {
        cmd.env_remove(var);
    }
    cmd.spawn().unwrap()
}

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The datasets the recorder answers with, by name.
async fn datasets(catalogue: &Catalogue) -> Vec<String> {
    match catalogue
        .ask(&Query::Datasets {
            project: None,
            limit: None,
            after: None,
        })
        .await
    {
        Ok(Answer::Datasets { datasets, .. }) => datasets.into_iter().map(|d| d.dataset).collect(),
        _ => Vec::new(),
    }
}

async fn dead_letters(bus: &Bus) -> u64 {
    let mut s = bus
        .jetstream()
        .get_stream(subject::DEAD_LETTERS.name)
        .await
        .unwrap();
    s.info().await.unwrap().state.messages
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_under_the_store_stops_the_recorder_and_the_fact_folds_after_a_restart() {
    let nats = NatsServer::start();
    let bus = Bus::connect(&BusConfig::new(nats.url())).await.unwrap();
    bus.provision().await.unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let disk = Tmpfs::mount(tmp.path().join("disk"), "8m");
    let store_path = disk.path().join("catalogue.redb");
    let config = tmp.path().join("catalogue-recorder.toml");
    // One attempt per fact: were a store failure counted as an attempt of the fact, the fact
    // would be dead-lettered at once (as it is on any fact's last attempt).
    std::fs::write(
        &config,
        format!(
            "[bus]\nservers = [\"{}\"]\nclient_name = \"catalogue-recorder\"\n\n\
             [worker]\nmax_attempts = 1\nshutdown_deadline = \"5s\"\n\
             retry = {{ initial = \"100ms\", max = \"200ms\", factor = 2.0, jitter = 0.0 }}\n\n\
             [service]\nstore_path = \"{}\"\nledger_dir = \"{}\"\n",
            nats.url(),
            store_path.display(),
            tmp.path().join("ledger").display(),
        ),
    )
    .unwrap();
    let catalogue = Catalogue::new(bus.client().clone()).with_timeout(Duration::from_secs(5));

    let log = tmp.path().join("first.log");
    let mut first = Killed(recorder(&config, &log));
    bus.publish(&validated("before", 10)).await.unwrap();
    wait_until(WAIT, "the first fact folded", || async {
        datasets(&catalogue).await == ["before"]
    })
    .await
    .unwrap();

    disk.fill();
    bus.publish(&validated("during", 2000)).await.unwrap();
    let status = {
        let child = &mut first.0;
        let mut exited = None;
        wait_until(WAIT, "the recorder to stop on its full disk", || {
            exited = child.try_wait().unwrap();
            std::future::ready(exited.is_some())
        })
        .await
        .unwrap_or_else(|e| {
            panic!(
                "{e}; its log:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            )
        });
        exited.unwrap()
    };
    let said = std::fs::read_to_string(&log).unwrap();
    assert_eq!(status.code(), Some(1), "exit non-zero; log:\n{said}");
    assert_eq!(
        dead_letters(&bus).await,
        0,
        "nothing dead-lettered:\n{said}"
    );
    // The line the service exits with (`catalogue-recorder: …`, printed once its runner has
    // stopped; the NATS client may still log its connection closing after it).
    let exit_line = said
        .lines()
        .rfind(|l| l.starts_with("catalogue-recorder: "))
        .unwrap_or_default();
    assert!(
        exit_line.contains(&store_path.display().to_string())
            && exit_line.contains("No space left on device"),
        "the exit names the store's file and the failure:\n{said}"
    );

    disk.free();
    let log = tmp.path().join("second.log");
    let second = Killed(recorder(&config, &log));
    wait_until(WAIT, "the fact folded after the restart", || async {
        datasets(&catalogue).await == ["before", "during"]
    })
    .await
    .unwrap_or_else(|e| {
        panic!(
            "{e}; its log:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        )
    });
    drop(second);
    assert_eq!(dead_letters(&bus).await, 0);
    let store = Store::open(&store_path).unwrap();
    assert_eq!(
        store.problem_count().unwrap(),
        0,
        "no fact listed as a problem"
    );
}
