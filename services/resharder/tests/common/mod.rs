//! What the resharder's tests share: policies on temp posix tiers, raw versions on the source
//! tier, `dataset.validated` facts published as the validator publishes them, and readers of
//! the facts and dead letters the resharder leaves (through the testkit's stream reader and
//! service process).

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use async_nats::jetstream;
use sha2::{Digest, Sha256};
use stagehand_bus::Bus;
use stagehand_manifest::{BucketOptions, Manifest, ManifestStore, Spool, open_manifest};
use stagehand_schemas::{Body, DatasetPrepared, Event, EventId, FileRef, Location, subject};
#[allow(unused_imports)] // each test binary uses part of this
pub use stagehand_testkit::list_dir as names;
use stagehand_testkit::{
    PolicyFiles, ServiceProcess, StoredMessage, TierSpec, facts_caused_by, put_files,
    stored_messages, validated_fact, wait_for,
};

pub const TIMEOUT: Duration = Duration::from_secs(60);
pub const PROJECT: &str = "lab";

/// Writes `tiers.toml` (a posix source and capacity tier), `validation.toml` and
/// `packing.toml` (`packing`) into `dir`.
pub fn write_policies(dir: &Path, source: &Path, capacity: &Path, packing: &str) {
    PolicyFiles::new()
        .tier("source", TierSpec::posix("source", "lab").root(source))
        .tier("capacity", TierSpec::posix("capacity", "store").root(capacity))
        .validation(
            "max_file_size = \"1 GiB\"\nmax_entries = 1000000\nmax_total_bytes = \"100 GiB\"\nallowed_suffixes = []\ndenied_suffixes = []\nallow_hidden = true\n",
        )
        .file("packing.toml", packing)
        .write(dir);
}

/// A packing policy: the shipped keys with small thresholds, then `extra` (dataset tables).
pub fn packing(shard_size: &str, extra: &str) -> String {
    format!(
        "enabled = true\nmin_files = 5\nmax_mean_file_size = \"4 MiB\"\nshard_size = \"{shard_size}\"\nlayout = \"webdataset\"\nseed = 0\ntarget_tier = \"capacity\"\n{extra}"
    )
}

/// A deterministic pseudo-random byte string (xorshift), `len` long.
pub fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// `n` samples `train/NNNN` with a `.jpg` (1–12 KiB), a `.cls` and a `.json`: (path, bytes).
pub fn image_samples(n: usize) -> Vec<(String, Vec<u8>)> {
    let mut files = Vec::new();
    for i in 0..n {
        let key = format!("train/{i:04}");
        files.push((
            format!("{key}.jpg"),
            bytes(i as u64, 1024 + (i * 7919) % (11 * 1024)),
        ));
        files.push((format!("{key}.cls"), format!("{}", i % 10).into_bytes()));
        files.push((
            format!("{key}.json"),
            format!("{{\"id\":{i},\"w\":{}}}", 100 + i).into_bytes(),
        ));
    }
    files
}

/// Writes `files` beneath `root/prefix` and returns their manifest entries.
pub fn place(root: &Path, prefix: &str, files: &[(String, Vec<u8>)]) -> Vec<FileRef> {
    put_files(&root.join(prefix), files)
}

/// Publishes the `dataset.validated` the validator would for `files` at `prefix`: inline, or
/// with `by_reference` its manifest put in the services' bucket first.
pub async fn publish_validated(
    bus: &Bus,
    id: &str,
    dataset: &str,
    prefix: &str,
    files: Vec<FileRef>,
    by_reference: bool,
) -> Event {
    publish_validated_on(bus, id, dataset, "source", prefix, files, by_reference).await
}

/// [`publish_validated`] for a raw version on the source tier `tier`.
pub async fn publish_validated_on(
    bus: &Bus,
    id: &str,
    dataset: &str,
    tier: &str,
    prefix: &str,
    files: Vec<FileRef>,
    by_reference: bool,
) -> Event {
    let manifest = if by_reference {
        let store = ManifestStore::catalogue(bus.jetstream(), BucketOptions::default())
            .await
            .unwrap();
        Some(
            store
                .put(&Manifest::from_entries(files.clone()))
                .await
                .unwrap(),
        )
    } else {
        None
    };
    let event = validated_fact(
        PROJECT,
        EventId::new(format!("{id}-request")).unwrap(),
        dataset,
        Location {
            tier: tier.into(),
            prefix: prefix.into(),
        },
        &files,
        manifest,
    );
    bus.publish(&event).await.unwrap();
    event
}

/// Every message of a stream, in order.
pub async fn stream_messages(js: &jetstream::Context, stream: &str) -> Vec<StoredMessage> {
    stored_messages(js, stream, "").await.unwrap()
}

/// The facts caused by `cause`.
pub async fn facts_of(js: &jetstream::Context, cause: &EventId) -> Vec<Event> {
    facts_caused_by(js, cause).await
}

/// Waits for the `dataset.prepared` caused by `cause`.
pub async fn prepared(js: &jetstream::Context, cause: &Event) -> (Event, DatasetPrepared) {
    wait_for(
        TIMEOUT,
        &format!("dataset.prepared of {}", cause.id),
        || async {
            facts_of(js, &cause.id)
                .await
                .into_iter()
                .find_map(|e| match &e.body {
                    Body::DatasetPrepared(p) => Some((e.clone(), p.clone())),
                    _ => None,
                })
        },
    )
    .await
    .unwrap()
}

/// Waits for the resharder's dead letter of `cause` and returns its last error.
pub async fn dead_letter(js: &jetstream::Context, cause: &EventId) -> String {
    wait_for(TIMEOUT, &format!("a dead letter of {cause}"), || async {
        stored_messages(
            js,
            subject::DEAD_LETTERS.name,
            subject::dead_letter_subject("resharder"),
        )
        .await
        .unwrap()
        .iter()
        .filter_map(|m| m.event().ok())
        .find_map(|e: Event| match e.body {
            Body::DeadLetter(d) if d.original_id.as_ref() == Some(cause) => {
                d.errors.last().map(|a| a.error.clone())
            }
            _ => None,
        })
    })
    .await
    .unwrap()
}

/// The prepared version's manifest entries, opened (and verified) as every reader opens them.
pub async fn prepared_files(js: &jetstream::Context, fact: &Event) -> Vec<FileRef> {
    let dir = tempfile::tempdir().unwrap();
    let manifest = open_manifest(js, fact, &Spool::in_dir(dir.path()))
        .await
        .unwrap()
        .unwrap();
    manifest.entries().map(Result::unwrap).collect()
}

/// One member of a shard as read back with a standard tar reader.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadMember {
    pub shard: String,
    pub path: String,
    pub data: Vec<u8>,
}

/// Every shard of a prepared version at `dir`, in shard order, read with the `tar` crate;
/// checks each index line against the shard bytes (offset, size, SHA-256).
pub fn read_shards(dir: &Path) -> Vec<ReadMember> {
    let mut shards: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "tar"))
        .collect();
    shards.sort();
    let mut out = Vec::new();
    for shard in shards {
        let bytes = std::fs::read(&shard).unwrap();
        let name = shard.file_name().unwrap().to_string_lossy().into_owned();
        let mut archive = tar::Archive::new(&bytes[..]);
        let mut members = Vec::new();
        for entry in archive.entries().unwrap() {
            let mut entry = entry.unwrap();
            let path = entry.path().unwrap().to_string_lossy().into_owned();
            let mut data = Vec::new();
            std::io::Read::read_to_end(&mut entry, &mut data).unwrap();
            members.push(ReadMember {
                shard: name.clone(),
                path,
                data,
            });
        }
        // The index lists the same members, pointing at their bytes.
        let index = std::fs::read_to_string(shard.with_extension("index.jsonl")).unwrap();
        let mut listed = Vec::new();
        for line in index.lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            for m in v["members"].as_array().unwrap() {
                let (off, len) = (m["offset"].as_u64().unwrap(), m["size"].as_u64().unwrap());
                let data = &bytes[off as usize..(off + len) as usize];
                assert_eq!(
                    hex::encode(Sha256::digest(data)),
                    m["sha256"].as_str().unwrap()
                );
                let path = m["path"].as_str().unwrap().to_owned();
                assert!(path.starts_with(v["key"].as_str().unwrap()));
                listed.push(path);
            }
        }
        assert_eq!(
            listed,
            members.iter().map(|m| m.path.clone()).collect::<Vec<_>>()
        );
        out.extend(members);
    }
    out
}

/// The sample keys in the seeded order the resharder promises, computed here from the
/// documented rule: by the first 8 bytes of SHA-256("stagehand/shuffle/v1\0" ++ seed ++ key),
/// then by key.
pub fn seeded_order(keys: &[String], seed: u64) -> Vec<String> {
    let mut keyed: Vec<(u64, String)> = keys
        .iter()
        .map(|k| {
            let mut h = Sha256::new();
            h.update(b"stagehand/shuffle/v1\0");
            h.update(seed.to_be_bytes());
            h.update(k.as_bytes());
            (
                u64::from_be_bytes(h.finalize()[..8].try_into().unwrap()),
                k.clone(),
            )
        })
        .collect();
    keyed.sort();
    keyed.into_iter().map(|(_, k)| k).collect()
}

/// The `stagehand-resharder` binary with `config` and `env`, its Stagehand environment
/// cleared, its log in `log`; killed and reaped when dropped.
pub fn spawn_resharder(config: &Path, log: &Path, env: &[(&str, &str)]) -> ServiceProcess {
    let env: Vec<(&str, &str)> = [("RUST_LOG", "info")]
        .into_iter()
        .chain(env.iter().copied())
        .collect();
    ServiceProcess::spawn(env!("CARGO_BIN_EXE_stagehand-resharder"), config, log, &env)
}

/// The resharder's configuration file: `nats`, the policies and state folders, two read
/// threads, and `limit` as its read rate limit.
pub fn write_config(path: &Path, nats: &str, policies: &Path, state: &Path, limit: Option<&str>) {
    std::fs::write(
        path,
        format!(
            "[bus]\nservers = [\"{nats}\"]\n\n[worker]\nack_wait = \"2s\"\nmax_attempts = 5\n\n[service]\npolicies_dir = \"{}\"\nstate_dir = \"{}\"\nread_threads = 2\n{}",
            policies.display(),
            state.display(),
            limit
                .map(|l| format!("max_read_bytes_per_sec = \"{l}\"\n"))
                .unwrap_or_default()
        ),
    )
    .unwrap();
}
