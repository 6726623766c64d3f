//! The demoter's scrub against the real recorder, nats-server and the S3 server: replicas due
//! under `scrub.toml` are read back whole and hashed against the catalogue's SHA-256; a
//! flipped byte is announced with `replica.damaged` (`found_by` `scrub`) and withdraws the
//! replica, every whole one with `replica.verified`, which the catalogue keeps as its last
//! verification; and a scrub killed with SIGKILL mid-pass resumes where it was.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::*;
use stagehand_catalogue::ReplicaState;
use stagehand_schemas::Body;
use stagehand_testkit::wait_until;

/// A scrub policy for the test's tiers: both scrubbed every `period`, one pass at start (the
/// clock is an hour), at most `files_per_second` files read a second.
fn scrub_toml(files_per_second: u32, period: &str) -> String {
    format!(
        "check_every = \"1h\"\n\n[period]\nhot = \"{period}\"\ncapacity = \"{period}\"\n\n\
         [budget]\nbytes_per_second = \"1 GiB\"\nfiles_per_second = {files_per_second}\n"
    )
}

/// The scrub's facts in stream order: (kind, tier, prefix, the damaged paths with how, or the
/// repaired ones with where from).
async fn scrub_facts(stack: &Stack) -> Vec<(String, String, String, Vec<(String, String)>)> {
    facts(stack.bus.jetstream(), "replica.*")
        .await
        .into_iter()
        .filter_map(|e| match e.body {
            Body::ReplicaVerified(v) => Some((
                "verified".to_owned(),
                v.location.tier,
                v.location.prefix,
                vec![],
            )),
            Body::ReplicaDamaged(d) if d.found_by == "scrub" => Some((
                "damaged".to_owned(),
                d.location.tier,
                d.location.prefix,
                d.files.into_iter().map(|f| (f.path, f.how)).collect(),
            )),
            Body::ReplicaRepaired(r) => Some((
                "repaired".to_owned(),
                r.location.tier,
                r.location.prefix,
                r.repaired
                    .into_iter()
                    .map(|path| (path, format!("from {}", r.from_tier)))
                    .collect(),
            )),
            _ => None,
        })
        .collect()
}

/// Places `n` versions of three 64 KiB files on capacity and hot, made two hours ago (so due
/// under an hour's period), and waits until the catalogue lists both copies of each.
async fn due_versions(stack: &Stack, n: u8) -> Vec<Placed> {
    let mut placed = Vec::new();
    for i in 0..n {
        let p = stack
            .place_made(&format!("scrub{i}"), (i * 11, 3, 64 * 1024), ago(120))
            .await;
        placed.push(p);
    }
    for p in &placed {
        both_copies_listed(stack, p).await;
    }
    placed
}

/// Waits until the catalogue lists `p`'s hot and capacity copies as present.
async fn both_copies_listed(stack: &Stack, p: &Placed) {
    wait_until(WAIT, "the recorder to list both copies", || async {
        stack
            .catalogue
            .version(Some(PROJECT), &p.dataset, &p.version)
            .await
            .is_ok_and(|v| {
                ["hot", "capacity"].iter().all(|t| {
                    v.replicas
                        .iter()
                        .any(|r| &r.tier == t && r.state == ReplicaState::Present)
                })
            })
    })
    .await
    .unwrap();
}

/// The state the catalogue has `p`'s copy on `tier` in, and when it was last verified.
async fn replica_on(
    stack: &Stack,
    p: &Placed,
    tier: &str,
) -> (ReplicaState, Option<time::OffsetDateTime>) {
    let v = stack
        .catalogue
        .version(Some(PROJECT), &p.dataset, &p.version)
        .await
        .unwrap();
    let r = v.replicas.iter().find(|r| r.tier == tier).unwrap();
    (r.state, r.last_verified.as_ref().map(|v| v.stamp.at))
}

/// Guards issue 16's scrub and repair on a posix capacity tier: a byte flipped in one file of
/// one capacity copy is found by reading it back (`replica.damaged`, `found_by` `scrub`, the
/// file named with `hash`), repaired from the hot copy (`replica.repaired`, the file whole
/// again, the copy present again in the catalogue); every other copy is announced verified
/// once and the catalogue records when; a second pass (every copy due again) finds nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_flipped_byte_on_a_posix_capacity_tier_is_found_repaired_and_a_second_pass_finds_nothing()
{
    let stack = Stack::start(Options::default()).await;
    std::fs::write(stack.policies.join("scrub.toml"), scrub_toml(1000, "1h")).unwrap();
    let placed = due_versions(&stack, 3).await;
    let bad = &placed[1];
    let file = stack
        .tier("capacity")
        .join(bad.prefix())
        .join(&bad.files[1].0);
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[4096] ^= 0x01;
    std::fs::write(&file, bytes).unwrap();

    let mut first = spawn(&stack, "first", &[]);
    wait_until(
        WAIT,
        "every copy read by the scrub, the damaged one repaired",
        || async { scrub_facts(&stack).await.len() == 7 },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", log_of(&stack, "first")));
    first.kill();
    let found = scrub_facts(&stack).await;
    let of = |kind: &str| -> Vec<_> { found.iter().filter(|f| f.0 == kind).collect() };
    let damaged = of("damaged");
    assert_eq!(damaged.len(), 1, "{found:?}");
    assert_eq!(
        (damaged[0].1.as_str(), damaged[0].2.as_str()),
        ("capacity", bad.prefix().as_str())
    );
    assert_eq!(
        damaged[0].3,
        vec![(bad.files[1].0.clone(), "hash".to_owned())]
    );
    let repaired = of("repaired");
    assert_eq!(repaired.len(), 1, "{found:?}");
    assert_eq!(
        (repaired[0].1.as_str(), repaired[0].2.as_str()),
        ("capacity", bad.prefix().as_str())
    );
    assert_eq!(
        repaired[0].3,
        vec![(bad.files[1].0.clone(), "from hot".to_owned())]
    );
    assert!(whole_on(&stack, "capacity", bad), "the file is whole again");
    let mut verified: Vec<(String, String)> = of("verified")
        .iter()
        .map(|f| (f.1.clone(), f.2.clone()))
        .collect();
    verified.sort();
    let mut expected: Vec<(String, String)> = placed
        .iter()
        .flat_map(|p| ["capacity", "hot"].map(|t| (t.to_owned(), p.prefix())))
        .filter(|(t, prefix)| !(t == "capacity" && prefix == &bad.prefix()))
        .collect();
    expected.sort();
    assert_eq!(verified, expected);

    wait_until(WAIT, "the catalogue to fold the scrub's facts", || async {
        let mut all = true;
        for p in &placed {
            for tier in ["capacity", "hot"] {
                let (state, last) = replica_on(&stack, p, tier).await;
                let repaired = tier == "capacity" && p.version == bad.version;
                all &= state == ReplicaState::Present && last.is_some() != repaired;
            }
        }
        all
    })
    .await
    .unwrap();

    // `stagehand scrub status`'s query: on capacity the two copies verified within the hour,
    // the repaired one (not read since its repair) the oldest unverified, nothing damaged.
    let hour_ago = time::OffsetDateTime::now_utc() - time::Duration::hours(1);
    let cap = stack
        .catalogue
        .scrub_status("capacity", hour_ago, None)
        .await
        .unwrap();
    assert_eq!(
        (cap.replicas, cap.verified_replicas, cap.damaged_total),
        (3, 2, 0)
    );
    assert_eq!(cap.repaired_replicas, 1);
    assert_eq!(cap.oldest.map(|r| r.version), Some(bad.version.clone()));
    let hot = stack
        .catalogue
        .scrub_status("hot", hour_ago, None)
        .await
        .unwrap();
    assert_eq!((hot.replicas, hot.verified_replicas), (3, 3));

    // Every copy due again: the second pass reads all six and finds them whole.
    std::fs::write(stack.policies.join("scrub.toml"), scrub_toml(1000, "1ms")).unwrap();
    let mut second = spawn(&stack, "second", &[]);
    wait_until(WAIT, "the second pass", || async {
        log_of(&stack, "second").contains("scrub pass done")
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", log_of(&stack, "second")));
    second.kill();
    let after = scrub_facts(&stack).await;
    let new: Vec<_> = after[found.len()..].to_vec();
    assert_eq!(new.len(), 6, "{new:?}");
    assert!(new.iter().all(|f| f.0 == "verified"), "{new:?}");
    stack.stop().await;
}

/// Guards the scrub of an S3 tier (the S3 server): a byte flipped in one object of a capacity
/// copy on S3 is found and named, and repaired from hot (the object whole again); the whole
/// copies are verified.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_flipped_byte_on_an_s3_capacity_tier_is_found_and_repaired_by_the_scrub() {
    let s3 = tokio::task::spawn_blocking(stagehand_testkit::S3Server::shared)
        .await
        .unwrap();
    let bucket = s3.unique_bucket("scrub");
    let stack = Stack::start(Options {
        s3_capacity: Some((s3.endpoint(), bucket.clone())),
        ..Options::default()
    })
    .await;
    std::fs::write(stack.policies.join("scrub.toml"), scrub_toml(1000, "1h")).unwrap();
    let placed = due_versions(&stack, 2).await;
    let bad = &placed[0];
    for p in &placed {
        for (name, content) in &p.files {
            let mut content = content.clone();
            if p.version == bad.version && name == &bad.files[2].0 {
                content[10] ^= 0x80;
            }
            s3.put_object(&bucket, &format!("{}/{name}", p.prefix()), &content)
                .unwrap();
        }
        // Published as the mover publishes a set on S3: its completion marker last.
        s3.put_object(
            &bucket,
            &format!("{}/.stagehand-set-complete", p.prefix()),
            b"",
        )
        .unwrap();
    }
    let env = s3.client_env();
    let mut demoter = spawn(&stack, "s3-scrub", &env);
    wait_until(
        WAIT,
        "every copy read by the scrub, the damaged one repaired",
        || async { scrub_facts(&stack).await.len() == 5 },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", log_of(&stack, "s3-scrub")));
    let found = scrub_facts(&stack).await;
    let damaged: Vec<_> = found.iter().filter(|f| f.0 == "damaged").collect();
    assert_eq!(damaged.len(), 1, "{found:?}");
    assert_eq!(
        (damaged[0].1.as_str(), damaged[0].2.as_str()),
        ("capacity", bad.prefix().as_str())
    );
    assert_eq!(
        damaged[0].3,
        vec![(bad.files[2].0.clone(), "hash".to_owned())]
    );
    assert_eq!(found.iter().filter(|f| f.0 == "verified").count(), 3);
    let repaired: Vec<_> = found.iter().filter(|f| f.0 == "repaired").collect();
    assert_eq!(repaired.len(), 1, "{found:?}");
    assert_eq!(repaired[0].2, bad.prefix());
    let (name, content) = &bad.files[2];
    assert_eq!(
        &s3.get_object(&bucket, &format!("{}/{name}", bad.prefix()))
            .unwrap(),
        content
    );
    demoter.kill();
    stack.stop().await;
}

/// Guards the scrub's durable progress: the real binary, reading four files a second, is
/// killed with SIGKILL after it announced two copies verified; started again, it reads only
/// what it had not finished — every copy is announced exactly once, and the second process
/// verifies fewer copies than there are.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_scrub_killed_mid_pass_resumes_and_reports_no_replica_twice() {
    let stack = Stack::start(Options::default()).await;
    std::fs::write(stack.policies.join("scrub.toml"), scrub_toml(4, "1h")).unwrap();
    let placed = due_versions(&stack, 4).await;
    let copies = placed.len() * 2;

    let mut first = spawn(&stack, "first", &[]);
    wait_until(WAIT, "two copies verified by the first scrub", || async {
        scrub_facts(&stack).await.len() >= 2
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", log_of(&stack, "first")));
    first.kill();
    let before = scrub_facts(&stack).await.len();
    assert!(before < copies, "the pass had finished before the kill");

    let mut second = spawn(&stack, "second", &[]);
    wait_until(
        WAIT + Duration::from_secs(copies as u64 * 3 / 4 + 5),
        "every copy verified after the restart",
        || async { scrub_facts(&stack).await.len() >= copies },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", log_of(&stack, "second")));
    let found = scrub_facts(&stack).await;
    let mut per_copy: BTreeMap<(String, String), usize> = BTreeMap::new();
    for f in &found {
        assert_eq!(f.0, "verified", "{found:?}");
        *per_copy.entry((f.1.clone(), f.2.clone())).or_default() += 1;
    }
    assert_eq!(per_copy.len(), copies, "{per_copy:?}");
    assert!(per_copy.values().all(|n| *n == 1), "{per_copy:?}");
    // The restart read what was left (and at most the one copy the kill interrupted after its
    // fact was out), not the whole tier again.
    let reread = log_of(&stack, "second")
        .matches("replica verified by the scrub")
        .count();
    assert!(
        reread <= copies - before + 1,
        "{reread} re-read of {copies}"
    );
    assert!(reread < copies, "the restart started over");
    second.kill();
    stack.stop().await;
}

/// Guards "never handed out, and on-call sees it": the same file flipped in the capacity copy
/// and the hot copy of a version leaves no verified replica to repair from — the capacity
/// copy stays damaged (the repair reads the hot file, finds it does not verify either, and
/// copies nothing), and `scrub status`'s query lists it with the lost file named.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_damaged_copy_with_no_verified_copy_anywhere_stays_damaged_with_its_lost_file_named() {
    let stack = Stack::start(Options::default()).await;
    std::fs::write(stack.policies.join("scrub.toml"), scrub_toml(1000, "1h")).unwrap();
    let placed = due_versions(&stack, 1).await;
    let lost = &placed[0];
    for tier in ["capacity", "hot"] {
        let file = stack.tier(tier).join(lost.prefix()).join(&lost.files[0].0);
        let mut bytes = std::fs::read(&file).unwrap();
        bytes[7] ^= 0x10;
        std::fs::write(&file, bytes).unwrap();
    }
    let mut demoter = spawn(&stack, "lost", &[]);
    wait_until(WAIT, "the pass", || async {
        log_of(&stack, "lost").contains("scrub pass done")
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", log_of(&stack, "lost")));
    demoter.kill();
    let found = scrub_facts(&stack).await;
    assert_eq!(
        found.iter().filter(|f| f.0 == "damaged").count(),
        2,
        "{found:?}"
    );
    assert!(found.iter().all(|f| f.0 == "damaged"), "{found:?}");
    let bytes = std::fs::read(
        stack
            .tier("capacity")
            .join(lost.prefix())
            .join(&lost.files[0].0),
    );
    assert_ne!(
        bytes.unwrap(),
        lost.files[0].1,
        "nothing was copied over it"
    );
    wait_until(
        WAIT,
        "the catalogue to list the capacity copy damaged",
        || async {
            let hour_ago = time::OffsetDateTime::now_utc() - time::Duration::hours(1);
            stack
                .catalogue
                .scrub_status("capacity", hour_ago, None)
                .await
                .is_ok_and(|s| {
                    s.damaged_total == 1
                        && s.damaged[0].version == lost.version
                        && s.damaged[0]
                            .reason
                            .as_deref()
                            .is_some_and(|r| r.contains(&format!("{} hash", lost.files[0].0)))
                })
        },
    )
    .await
    .unwrap();
    assert!(log_of(&stack, "lost").contains("no verified replica to repair it from"));
    stack.stop().await;
}

/// Guards issue 16's lost replicas "repaired as in 3": a capacity copy whose folder is gone is
/// found lost by the audit (`stagehand_demoter::audit`), announced `replica.damaged`
/// (`found_by` `audit`); the scrub, though no copy is due, repairs it from the hot copy
/// (`replica.repaired`, every file whole again, the copy present in the catalogue).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_copy_the_audit_found_lost_is_repaired_by_the_next_scrub_pass() {
    let stack = Stack::start(Options::default()).await;
    std::fs::write(stack.policies.join("scrub.toml"), scrub_toml(1000, "30d")).unwrap();
    let placed = due_versions(&stack, 1).await;
    let p = &placed[0];
    std::fs::remove_dir_all(stack.tier("capacity").join(p.prefix())).unwrap();

    let policies = stagehand_policy::Policies::load_dir(&stack.policies).unwrap();
    let capacity = policies.tiers()["capacity"]
        .open_for(&stagehand_policy::Opening::read())
        .await
        .unwrap();
    // The tier's only copy lost is all of it: above any threshold but the whole tier, which
    // an audit stops at (the CLI's audit tests guard that).
    let policy = stagehand_policy::AuditPolicy {
        stop_above_fraction: 1.0,
        ..Default::default()
    };
    let opts = stagehand_demoter::audit::AuditOptions::new("capacity", policy);
    let report = stagehand_demoter::audit::audit(&stack.bus, &stack.catalogue, &capacity, &opts)
        .await
        .unwrap();
    let lost: Vec<&str> = report.lost.iter().map(|l| l.prefix.as_str()).collect();
    assert_eq!(lost, vec![p.prefix().as_str()], "{report:?}");
    assert!(report.stray.is_empty(), "{report:?}");
    wait_until(WAIT, "the catalogue to list the copy damaged", || async {
        replica_on(&stack, p, "capacity").await.0 == ReplicaState::Damaged
    })
    .await
    .unwrap();

    let mut demoter = spawn(&stack, "repair", &[]);
    wait_until(WAIT, "the lost copy repaired", || async {
        scrub_facts(&stack)
            .await
            .iter()
            .any(|f| f.0 == "repaired" && f.1 == "capacity")
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", log_of(&stack, "repair")));
    demoter.kill();
    assert!(whole_on(&stack, "capacity", p), "every file is back");
    let found = scrub_facts(&stack).await;
    assert!(
        found
            .iter()
            .all(|f| f.0 == "repaired" && f.3[0].1 == "from hot"),
        "{found:?}"
    );
    wait_until(WAIT, "the catalogue to list the copy present", || async {
        replica_on(&stack, p, "capacity").await.0 == ReplicaState::Present
    })
    .await
    .unwrap();
    stack.stop().await;
}

/// Guards the scrub reading several files of a replica at once (`[budget] parallel_files`):
/// among forty files of a capacity copy, read eight at a time, one flipped, one cut short and
/// one removed are exactly the three the scrub names (each with how, in the list's order
/// whatever order the reads finished in) and the repair copies back; the hot copy verifies.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn several_damaged_files_among_many_read_in_parallel_are_exactly_those_named() {
    let stack = Stack::start(Options::default()).await;
    let toml = scrub_toml(1000, "1h") + "parallel_files = 8\n";
    std::fs::write(stack.policies.join("scrub.toml"), toml).unwrap();
    let p = stack.place_made("parallel", (7, 40, 4096), ago(120)).await;
    both_copies_listed(&stack, &p).await;
    let on_capacity = |i: usize| stack.tier("capacity").join(p.prefix()).join(&p.files[i].0);
    let mut flipped = std::fs::read(on_capacity(5)).unwrap();
    flipped[100] ^= 0x04;
    std::fs::write(on_capacity(5), flipped).unwrap();
    std::fs::write(on_capacity(17), &p.files[17].1[..1000]).unwrap();
    std::fs::remove_file(on_capacity(31)).unwrap();

    let mut demoter = spawn(&stack, "parallel", &[]);
    wait_until(
        WAIT,
        "both copies read by the scrub, the damaged one repaired",
        || async { scrub_facts(&stack).await.len() == 3 },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", log_of(&stack, "parallel")));
    demoter.kill();
    let found = scrub_facts(&stack).await;
    let damaged: Vec<_> = found.iter().filter(|f| f.0 == "damaged").collect();
    assert_eq!(damaged.len(), 1, "{found:?}");
    assert_eq!(
        (damaged[0].1.as_str(), damaged[0].2.as_str()),
        ("capacity", p.prefix().as_str())
    );
    let named = |i: usize, how: &str| (p.files[i].0.clone(), how.to_owned());
    assert_eq!(
        damaged[0].3,
        vec![named(5, "hash"), named(17, "size"), named(31, "missing")]
    );
    // The file cut short is reported with the size listed and the size found.
    let cut = facts(stack.bus.jetstream(), "replica.damaged")
        .await
        .into_iter()
        .find_map(|e| match e.body {
            Body::ReplicaDamaged(d) => d.files.into_iter().find(|f| f.how == "size"),
            _ => None,
        })
        .expect("a replica.damaged naming a size mismatch");
    assert_eq!(
        (cut.expected_size, cut.found_size),
        (Some(p.files[17].1.len() as u64), Some(1000))
    );
    let repaired: Vec<_> = found.iter().filter(|f| f.0 == "repaired").collect();
    assert_eq!(repaired.len(), 1, "{found:?}");
    let verified: Vec<_> = found.iter().filter(|f| f.0 == "verified").collect();
    assert_eq!(verified.len(), 1, "{found:?}");
    assert_eq!(verified[0].1, "hot");
    assert!(
        whole_on(&stack, "capacity", &p),
        "every file is whole again"
    );
    stack.stop().await;
}

/// Guards the read's result not depending on the order parallel reads finish in: with three
/// times as many damaged files as `replica.damaged` lists, of sizes that make later files
/// finish first, read sixteen at a time, the files named are the first the list names (as a
/// read of one file after another names them) and every damaged one is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_parallel_read_names_the_first_damaged_files_in_list_order() {
    use stagehand_demoter::scrub::{Read, ReadBudget, read_replica};
    use stagehand_schemas::{FileRef, ReplicaDamaged, sha256_hex};

    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("r")).unwrap();
    let n = ReplicaDamaged::MAX_LISTED * 3;
    let mut files = Vec::new();
    for i in 0..n {
        let path = format!("f{i:03}.bin");
        // Larger first: the later, smaller files are read before the first ones finish.
        let content = vec![i as u8; (n - i) * 4096];
        std::fs::write(dir.path().join("r").join(&path), &content).unwrap();
        // Every third file whole, the others listed with a hash they do not have.
        let sha = if i % 3 == 0 {
            sha256_hex(&content)
        } else {
            sha256_hex(b"another content")
        };
        files.push(FileRef::new(path, content.len() as u64, sha));
    }
    let tier = stagehand_mover::Tier::from(
        stagehand_mover::PosixTier::open("scrubbed", dir.path()).unwrap(),
    );
    let budget = ReadBudget::unlimited(std::num::NonZeroUsize::new(16).unwrap());
    let scheduler = stagehand_mover::Scheduler::new(16);
    let list = futures::stream::iter(
        files
            .iter()
            .cloned()
            .map(Ok::<_, stagehand_catalogue::CatalogueError>),
    );
    let read = read_replica(&tier, "scrubbed", "r", list, &budget, &scheduler, None)
        .await
        .unwrap();
    let Read::Damaged {
        files: read_files,
        damaged,
        total,
        ..
    } = read
    else {
        panic!("the damaged files were not found: {read:?}");
    };
    assert_eq!(read_files, n as u64);
    assert_eq!(total, (n - n.div_ceil(3)) as u64);
    let expected: Vec<(String, String)> = (files.iter().enumerate())
        .filter(|(i, _)| i % 3 != 0)
        .map(|(_, f)| (f.path.clone(), "hash".to_owned()))
        .take(ReplicaDamaged::MAX_LISTED)
        .collect();
    let named: Vec<(String, String)> = damaged.into_iter().map(|f| (f.path, f.how)).collect();
    assert_eq!(named, expected);
}
