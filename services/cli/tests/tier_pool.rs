//! `stagehand tier pool` as a real process against a real nats-server and the real recorder,
//! with a hot tier on a filesystem of its own (a tmpfs; mounting needs root, as in CI).
//! Issue "Slurm pool ignores the filesystem's own free space": a pool's free space was the
//! policy capacity less what the promoter reserved, so Slurm staged in jobs the filesystem
//! could not hold once others had filled it.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use stagehand_bus::placement::{self, Reservations};
use stagehand_bus::{Bus, BusConfig, CancellationToken};
use stagehand_testkit::{NatsServer, Tmpfs, wait_until};

const MIB: u64 = 1 << 20;
/// The hot tier's policy capacity: 1 EiB, far beyond any disk.
const EIB: u64 = 1 << 60;

/// hot: 1 EiB by policy at `hot`; warm: 1 MiB by policy at a root this host does not have
/// (and the source tier every policy folder declares, beside them).
fn policies(dir: &Path, hot: &Path, warm: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("tiers.toml"),
        format!(
            "[tiers.source]\nkind = \"posix\"\nrole = \"source\"\nfailure_domain = \"lab\"\nroot = \"{}\"\n\n\
             [tiers.hot]\nkind = \"posix\"\nrole = \"hot\"\nfailure_domain = \"hot\"\nroot = \"{}\"\n\
             capacity = \"1024 PiB\"\nhigh_watermark = 0.85\nlow_watermark = 0.5\n\n\
             [tiers.warm]\nkind = \"posix\"\nrole = \"hot\"\nfailure_domain = \"warm\"\nroot = \"{}\"\n\
             capacity = \"1 MiB\"\nhigh_watermark = 0.85\nlow_watermark = 0.5\n",
            dir.with_file_name("source").display(),
            hot.display(),
            warm.display()
        ),
    )
    .unwrap();
    std::fs::write(
        dir.join("validation.toml"),
        "max_file_size = \"1 GiB\"\nmax_entries = 1000\nmax_total_bytes = \"1 GiB\"\nallowed_suffixes = []\ndenied_suffixes = []\nallow_hidden = false\n",
    )
    .unwrap();
}

/// Runs `stagehand tier pool hot warm --slurm <file>` (with `--json` or not); returns stdout.
fn pool(nats: &NatsServer, policies: &Path, file: &Path, json: bool) -> String {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_stagehand"));
    cmd.args(["tier", "pool", "hot", "warm", "--policies"])
        .arg(policies)
        .arg("--slurm")
        .arg(file)
        .args(["--nats", &nats.url()]);
    if json {
        cmd.arg("--json");
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// A hot tier of 1 EiB by policy on an 8 MiB filesystem, 3 MiB of it others' files: its pool
/// is 5 MiB free — what the filesystem can take, not the policy — and says so (`fs_available`).
/// Once the promoter has reserved all but 1 MiB of the policy's room, that is the smaller
/// figure and the pool's. A tier whose root this host does not have keeps the policy's figure.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pool_is_never_larger_than_its_filesystem_can_take() {
    let nats = NatsServer::start();
    let tmp = tempfile::tempdir().unwrap();
    let policy_dir = tmp.path().join("policies");
    let warm = tmp.path().join("tiers/warm-not-mounted-here");
    let disk = Tmpfs::mount(tmp.path().join("tiers/hot"), "8m");
    policies(&policy_dir, disk.path(), &warm);
    std::fs::write(disk.path().join("others.bin"), vec![1u8; 3 * MIB as usize]).unwrap();
    let bus = Bus::connect(&BusConfig::new(nats.url())).await.unwrap();
    bus.provision().await.unwrap();
    // The promoter's bucket, as a promoter provisions it at start.
    let store = bus.provision_kv(&stagehand_bus::PROMOTER).await.unwrap();
    let stop = CancellationToken::new();
    let recorder = stagehand_catalogue_recorder::config(&nats.url(), tmp.path().join("recorder"));
    let recorder = tokio::spawn(stagehand_catalogue_recorder::run(recorder, stop.clone()));
    let catalogue = stagehand_catalogue::Catalogue::new(bus.client().clone());
    wait_until(
        Duration::from_secs(30),
        "the recorder to answer",
        || async { catalogue.tier_usage(None).await.is_ok() },
    )
    .await
    .unwrap();
    let file = tmp.path().join("pools");

    let pools: serde_json::Value =
        serde_json::from_str(&pool(&nats, &policy_dir, &file, true)).unwrap();
    let (hot, warm) = (&pools[0], &pools[1]);
    assert_eq!(hot["tier"], "hot");
    assert_eq!(
        (hot["capacity"].as_u64(), hot["reserved"].as_u64()),
        (Some(EIB), Some(0))
    );
    assert_eq!(hot["fs_available"].as_u64(), Some(5 * MIB), "{hot}");
    assert_eq!(hot["free"].as_u64(), Some(5 * MIB), "{hot}");
    assert_eq!(warm["tier"], "warm");
    assert!(warm["fs_available"].is_null(), "{warm}");
    assert_eq!(warm["free"].as_u64(), Some(MIB), "{warm}");
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(
        text.ends_with(&format!(
            "\npool hot {EIB} {}\npool warm {MIB} {MIB}\n",
            5 * MIB
        )),
        "{text}"
    );

    // The promoter's room shrinks below the filesystem's: the pool follows it.
    let read = placement::reservations(&store, "hot", None).await.unwrap();
    let mut reserved = Reservations::default();
    reserved.replicas.insert("lab/big/v1".into(), EIB - MIB);
    assert!(
        placement::write_reservations(&store, "hot", None, &reserved, read.revision)
            .await
            .unwrap()
    );
    let text = pool(&nats, &policy_dir, &file, false);
    assert!(
        text.contains(", filesystem available 5.0 MiB, free 1.0 MiB\n"),
        "{text}"
    );
    assert!(
        text.contains("warm: capacity 1.0 MiB, held 0 B, reserved 0 B, filesystem available not measured here, free 1.0 MiB\n"),
        "{text}"
    );
    let file_text = std::fs::read_to_string(&file).unwrap();
    assert!(
        file_text.contains(&format!("\npool hot {EIB} {MIB}\n")),
        "{file_text}"
    );

    stop.cancel();
    tokio::time::timeout(Duration::from_secs(30), recorder)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    drop(disk);
}
