//! The shipped policies load, and every kind of mistake is refused with an error that names
//! the file, the key and what is wrong.

use std::path::{Path, PathBuf};

use stagehand_policy::{Policies, PolicyError, SuffixVerdict, TierKind, TierRole};
use stagehand_schemas::Retryable;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn shipped() -> PathBuf {
    repo_root().join("policies")
}

/// A copy of the shipped policies in a temp dir, with `edit` applied to one file's text.
fn with_edit(file: &str, edit: impl FnOnce(String) -> String) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("policies");
    std::fs::create_dir(&dir).unwrap();
    for entry in std::fs::read_dir(shipped()).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
    }
    let path = dir.join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_default();
    std::fs::write(&path, edit(text)).unwrap();
    (tmp, dir)
}

/// Loads `dir` expecting an `Invalid` error about `file` and `key` whose message contains
/// `needle`; returns the error's display form.
fn expect_invalid(dir: &Path, file: &str, key: &str, needle: &str) -> String {
    let home = dir.parent().unwrap().join("home");
    let err = Policies::load_dir_with_home(dir, &home).expect_err("must be refused");
    let text = err.to_string();
    match &err {
        PolicyError::Invalid {
            file: f,
            key: k,
            message,
            ..
        } => {
            assert_eq!(f, &dir.join(file), "{text}");
            assert_eq!(k, key, "{text}");
            assert!(
                message.contains(needle),
                "message {message:?} lacks {needle:?}"
            );
        }
        other => panic!("expected an Invalid error, got {other:?}"),
    }
    assert!(text.contains(file) && text.contains(key), "{text}");
    assert!(!err.is_retryable());
    text
}

#[test]
fn shipped_policies_load_and_resolve_relative_roots_against_home() {
    let home = tempfile::tempdir().unwrap();
    let policies = Policies::load_dir_with_home(shipped(), home.path()).unwrap();
    let source = policies.tier("source").unwrap();
    assert_eq!(source.role, TierRole::Source);
    assert_eq!(
        source.kind,
        TierKind::Posix {
            root: home.path().join("tiers/source")
        }
    );
    let hot = policies.tier("hot").unwrap();
    let limits = hot.limits.as_ref().unwrap();
    assert_eq!(limits.capacity, 100 << 30);
    assert_eq!(limits.quota_for("lab-a"), Some(50 << 30));
    let backup = policies.tier("backup").unwrap();
    assert_eq!(
        backup.protects,
        vec!["source".to_string(), "capacity".to_string()]
    );
    assert!(policies.tier("capacity").unwrap().limits.is_none());

    let validation = policies.validation();
    assert_eq!(validation.max_entries, 20_000_000);
    assert_eq!(
        validation.suffix_verdict("x/setup.EXE"),
        SuffixVerdict::Denied(".exe".into())
    );
    assert!(!validation.allow_hidden);

    // The later services' policies are parsed and validated too.
    assert!(policies.packing().unwrap().enabled);
    assert_eq!(policies.promotion().unwrap().default_tier, "hot");
    assert_eq!(policies.demotion().unwrap().target, "capacity");
    assert_eq!(policies.retention().unwrap().checkpoints.keep_last, 5);
    let offload = policies.retention().unwrap().offload.as_ref().unwrap();
    assert_eq!(offload.verify, stagehand_policy::VerifyMode::HashedInFlight);
    assert_eq!(policies.backup().unwrap().target, "backup");
    let priorities = policies.priorities().unwrap();
    assert!(
        priorities
            .class(stagehand_policy::PriorityClass::Checkpoint)
            .weight
            > priorities
                .class(stagehand_policy::PriorityClass::Backup)
                .weight
    );
}

#[test]
fn every_shipped_policy_file_has_a_comment_on_each_key() {
    // A key line must directly follow a comment line, or be named in the file's comments
    // (the header of tiers.toml documents the keys every tier table repeats).
    for entry in std::fs::read_dir(shipped()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "toml") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let comments: String = text
            .lines()
            .filter(|l| l.trim_start().starts_with('#'))
            .collect::<Vec<_>>()
            .join("\n");
        let mut previous_is_comment = false;
        for line in text.lines() {
            let trimmed = line.trim_start();
            let is_comment = trimmed.starts_with('#');
            if let (false, Some((key, _))) = (is_comment, trimmed.split_once('=')) {
                let key = key.trim();
                assert!(
                    previous_is_comment
                        || comments.contains(&format!("{key} "))
                        || key == "default",
                    "{}: key `{key}` is not documented by a comment",
                    path.display()
                );
            }
            previous_is_comment = is_comment;
        }
    }
}

#[test]
fn every_toml_under_deploy_parses() {
    let deploy = repo_root().join("deploy");
    let mut stack = vec![deploy];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        if dir.join("tiers.toml").exists() {
            let home = tempfile::tempdir().unwrap();
            Policies::load_dir_with_home(&dir, home.path())
                .unwrap_or_else(|e| panic!("policy folder {}: {e}", dir.display()));
        }
        for entry in entries {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "toml") {
                let text = std::fs::read_to_string(&path).unwrap();
                text.parse::<toml::Table>()
                    .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            }
        }
    }
}

#[test]
fn unknown_key_is_named_with_its_line() {
    let (_tmp, dir) = with_edit("tiers.toml", |t| {
        t.replace(
            "[tiers.capacity]\n",
            "[tiers.capacity]\ncolour = \"blue\"\n",
        )
    });
    let text = expect_invalid(&dir, "tiers.toml", "tiers.capacity.colour", "unknown field");
    assert!(text.contains("tiers.toml:"), "line number missing: {text}");
}

#[test]
fn backup_sharing_a_failure_domain_is_refused() {
    let (_tmp, dir) = with_edit("tiers.toml", |t| {
        t.replace(
            "failure_domain = \"backup-site\"",
            "failure_domain = \"capacity-store\"",
        )
    });
    expect_invalid(
        &dir,
        "tiers.toml",
        "tiers.backup.failure_domain",
        "shares failure domain \"capacity-store\" with tier \"capacity\"",
    );
}

#[test]
fn backup_protecting_an_undeclared_tier_is_refused() {
    let (_tmp, dir) = with_edit("tiers.toml", |t| {
        t.replace(
            "protects = [\"source\", \"capacity\"]",
            "protects = [\"archive\"]",
        )
    });
    expect_invalid(&dir, "tiers.toml", "tiers.backup.protects", "\"archive\"");
}

#[test]
fn default_protection_covers_every_other_tier() {
    // Without `protects`, the backup protects hot too, so sharing hot's domain is an error.
    let (_tmp, dir) = with_edit("tiers.toml", |t| {
        t.replace("protects = [\"source\", \"capacity\"]\n", "")
            .replace(
                "failure_domain = \"backup-site\"",
                "failure_domain = \"hot-fs\"",
            )
    });
    expect_invalid(&dir, "tiers.toml", "tiers.backup.failure_domain", "\"hot\"");
}

#[test]
fn watermarks_out_of_order_are_refused() {
    let (_tmp, dir) = with_edit("tiers.toml", |t| {
        t.replace("low_watermark = 0.70", "low_watermark = 0.95")
    });
    expect_invalid(
        &dir,
        "tiers.toml",
        "tiers.hot.low_watermark",
        "below high_watermark",
    );
}

#[test]
fn bounded_tier_without_capacity_is_refused() {
    let (_tmp, dir) = with_edit("tiers.toml", |t| t.replace("capacity = \"100 GiB\"\n", ""));
    expect_invalid(&dir, "tiers.toml", "tiers.hot.capacity", "needs `capacity`");
}

#[test]
fn capacity_on_an_unbounded_tier_is_refused() {
    let (_tmp, dir) = with_edit("tiers.toml", |t| {
        t.replace(
            "root = \"tiers/capacity\"",
            "root = \"tiers/capacity\"\ncapacity = \"1 TiB\"",
        )
    });
    expect_invalid(
        &dir,
        "tiers.toml",
        "tiers.capacity.capacity",
        "only to hot and local",
    );
}

#[test]
fn quota_over_capacity_is_refused() {
    let (_tmp, dir) = with_edit("tiers.toml", |t| {
        t.replace(
            "default = \"50 GiB\"",
            "default = \"50 GiB\"\nlab-a = \"1 TiB\"",
        )
    });
    expect_invalid(
        &dir,
        "tiers.toml",
        "tiers.hot.quotas.lab-a",
        "larger than the tier's capacity",
    );
}

#[test]
fn posix_tier_needs_a_root_and_refuses_s3_keys() {
    let (_tmp, dir) = with_edit("tiers.toml", |t| t.replace("root = \"tiers/source\"\n", ""));
    expect_invalid(&dir, "tiers.toml", "tiers.source.root", "needs `root`");
    let (_tmp, dir) = with_edit("tiers.toml", |t| {
        t.replace(
            "root = \"tiers/source\"",
            "root = \"tiers/source\"\nbucket = \"raw\"",
        )
    });
    expect_invalid(
        &dir,
        "tiers.toml",
        "tiers.source.bucket",
        "only to s3 tiers",
    );
}

#[test]
fn nested_tier_roots_are_refused() {
    let (_tmp, dir) = with_edit("tiers.toml", |t| {
        t.replace("root = \"tiers/local\"", "root = \"tiers/hot/local\"")
    });
    expect_invalid(
        &dir,
        "tiers.toml",
        "tiers.local.root",
        "overlaps the root of tier \"hot\"",
    );
}

#[test]
fn s3_tiers_are_typed_and_checked_by_the_mover_rules() {
    let s3 = "\n[tiers.archive]\nkind = \"s3\"\nrole = \"capacity\"\nfailure_domain = \"object-store\"\n\
              endpoint = \"http://127.0.0.1:8333\"\nallow_plaintext = true\nbucket = \"stagehand-archive\"\nprefix = \"v1\"\n\
              region = \"eu-west-1\"\npart_size = \"8 MiB\"\n";
    let (tmp, dir) = with_edit("tiers.toml", |t| t + s3);
    let policies = Policies::load_dir_with_home(&dir, tmp.path()).unwrap();
    let archive = policies.tier("archive").unwrap();
    let TierKind::S3(config) = &archive.kind else {
        panic!("not s3: {archive:?}")
    };
    assert_eq!(config.bucket, "stagehand-archive");
    assert_eq!(config.prefix, "v1");
    assert_eq!(config.region, "eu-west-1");
    assert_eq!(config.endpoint.as_deref(), Some("http://127.0.0.1:8333"));
    assert_eq!(config.part_size, 8 << 20);
    assert_eq!(archive.location(), "s3://stagehand-archive/v1");

    let (_tmp, dir) = with_edit("tiers.toml", |t| t + &s3.replace("stagehand-archive", "ab"));
    expect_invalid(&dir, "tiers.toml", "tiers.archive.bucket", "bucket");
    let (_tmp, dir) = with_edit("tiers.toml", |t| {
        t + &s3.replace("kind = \"s3\"", "kind = \"nfs\"")
    });
    expect_invalid(&dir, "tiers.toml", "tiers.archive.kind", "unknown variant");
}

/// An `http://` endpoint sends bytes and signed requests in the clear: refused at load, naming
/// the file, the tier and the key, unless the tier says `allow_plaintext = true`; https needs
/// nothing, and a posix tier takes no such key.
#[test]
fn a_plaintext_s3_endpoint_needs_allow_plaintext() {
    let s3 = "\n[tiers.archive]\nkind = \"s3\"\nrole = \"capacity\"\nfailure_domain = \"object-store\"\n\
              endpoint = \"http://127.0.0.1:8333\"\nbucket = \"stagehand-archive\"\n";
    let (_tmp, dir) = with_edit("tiers.toml", |t| t + s3);
    expect_invalid(
        &dir,
        "tiers.toml",
        "tiers.archive.endpoint",
        "set `allow_plaintext = true` on tier archive",
    );
    let (_tmp, dir) = with_edit("tiers.toml", |t| t + &s3.replace("http://", "HTTP://"));
    expect_invalid(
        &dir,
        "tiers.toml",
        "tiers.archive.endpoint",
        "plaintext http",
    );
    let (tmp, dir) = with_edit("tiers.toml", |t| t + s3 + "allow_plaintext = true\n");
    Policies::load_dir_with_home(&dir, tmp.path()).unwrap();
    let (tmp, dir) = with_edit("tiers.toml", |t| t + &s3.replace("http://", "https://"));
    Policies::load_dir_with_home(&dir, tmp.path()).unwrap();
    let (_tmp, dir) = with_edit("tiers.toml", |t| {
        t.replace("[tiers.local]", "[tiers.local]\nallow_plaintext = true")
    });
    expect_invalid(
        &dir,
        "tiers.toml",
        "tiers.local.allow_plaintext",
        "s3 tiers",
    );
}

#[test]
fn bad_tier_name_is_refused() {
    let (_tmp, dir) = with_edit("tiers.toml", |t| {
        t.replace("[tiers.local]", "[tiers.Local]")
    });
    expect_invalid(&dir, "tiers.toml", "tiers.Local", "[a-z0-9_-]");
}

#[test]
fn validation_errors_name_their_key() {
    let (_tmp, dir) = with_edit("validation.toml", |t| {
        t.replace("max_file_size = \"64 GiB\"", "max_file_size = \"64 gigs\"")
    });
    expect_invalid(&dir, "validation.toml", "max_file_size", "unknown unit");
    let (_tmp, dir) = with_edit("validation.toml", |t| {
        t.replace("max_entries = 20_000_000", "max_entries = 0")
    });
    expect_invalid(&dir, "validation.toml", "max_entries", "at least 1");
    let (_tmp, dir) = with_edit("validation.toml", |t| {
        t.replace("allowed_suffixes = []", "allowed_suffixes = [\"jpg\"]")
    });
    expect_invalid(
        &dir,
        "validation.toml",
        "allowed_suffixes",
        "must start with `.`",
    );
    let (_tmp, dir) = with_edit("validation.toml", |t| {
        t.replace("allowed_suffixes = []", "allowed_suffixes = [\".EXE\"]")
    });
    expect_invalid(
        &dir,
        "validation.toml",
        "denied_suffixes",
        "both allowed and denied",
    );
    let (_tmp, dir) = with_edit("validation.toml", |t| {
        t.replace("allow_hidden = false\n", "")
    });
    expect_invalid(
        &dir,
        "validation.toml",
        "(top level)",
        "missing field `allow_hidden`",
    );
}

#[test]
fn object_lock_holds_s3_backups_only_and_for_a_bounded_time() {
    let (_tmp, dir) = with_edit("backup.toml", |t| {
        format!("{t}\n[object_lock]\nmode = \"compliance\"\ndays = 30\n")
    });
    expect_invalid(&dir, "backup.toml", "object_lock", "posix tier");
    let (_tmp, dir) = with_edit("backup.toml", |t| {
        format!("{t}\n[object_lock]\nmode = \"forever\"\ndays = 30\n")
    });
    expect_invalid(&dir, "backup.toml", "object_lock.mode", "unknown variant");
    let s3_backup = |t: String| {
        t.replace(
            "kind = \"posix\"\nrole = \"backup\"\nfailure_domain = \"backup-site\"\nroot = \"tiers/backup\"",
            "kind = \"s3\"\nrole = \"backup\"\nfailure_domain = \"backup-site\"\nendpoint = \"http://127.0.0.1:8333\"\nallow_plaintext = true\nbucket = \"stagehand-backup\"",
        )
    };
    let (_tmp, dir) = with_edit("tiers.toml", s3_backup);
    let backup = dir.join("backup.toml");
    let text = std::fs::read_to_string(&backup).unwrap();
    std::fs::write(
        &backup,
        format!("{text}\n[object_lock]\nmode = \"governance\"\ndays = 0\n"),
    )
    .unwrap();
    expect_invalid(
        &dir,
        "backup.toml",
        "object_lock.days",
        "between 1 and 36500",
    );
    std::fs::write(
        &backup,
        format!("{text}\n[object_lock]\nmode = \"governance\"\ndays = 7\n"),
    )
    .unwrap();
    let home = dir.parent().unwrap().join("home");
    let policies = Policies::load_dir_with_home(&dir, &home).unwrap();
    let lock = policies.backup().unwrap().object_lock.unwrap();
    assert_eq!(
        (lock.mode, lock.days),
        (stagehand_policy::RetentionMode::Governance, 7)
    );
    assert_eq!(
        policies.backup().unwrap().verify,
        stagehand_policy::VerifyMode::ReadBack
    );
}

/// Guards node failure's interval: `agent_silent_after` is read with the one duration grammar,
/// a node agent beats four times within it (at most every 10 s), and one too short to get a
/// few beats in is refused naming the key.
#[test]
fn agent_silent_after_sets_the_beat_and_is_bounded() {
    let (_tmp, dir) = with_edit("promotion.toml", |t| {
        t.replace("agent_silent_after = \"2m\"", "agent_silent_after = \"8s\"")
    });
    let home = dir.parent().unwrap().join("home");
    let policies = Policies::load_dir_with_home(&dir, &home).unwrap();
    let promotion = policies.promotion().unwrap();
    assert_eq!(
        promotion.agent_silent_after,
        std::time::Duration::from_secs(8)
    );
    assert_eq!(
        promotion.agent_beat_every(),
        std::time::Duration::from_secs(2)
    );
    let (_tmp, dir) = with_edit("promotion.toml", |t| {
        t.replace("agent_silent_after = \"2m\"", "agent_silent_after = \"1s\"")
    });
    expect_invalid(&dir, "promotion.toml", "agent_silent_after", "at least 2s");
}

#[test]
fn later_policies_check_their_tier_references() {
    let (_tmp, dir) = with_edit("promotion.toml", |t| {
        t.replace("default_tier = \"hot\"", "default_tier = \"capacity\"")
    });
    expect_invalid(&dir, "promotion.toml", "default_tier", "role \"capacity\"");
    let (_tmp, dir) = with_edit("promotion.toml", |t| {
        t.replace("local_sources = [\"hot\"", "local_sources = [\"local\"")
    });
    expect_invalid(&dir, "promotion.toml", "local_sources", "role \"local\"");
    let (_tmp, dir) = with_edit("promotion.toml", |t| t.replace("\"ckpt-*\"", "\"ck*pt\""));
    expect_invalid(&dir, "promotion.toml", "checkpoint_datasets", "single `*`");
    let (_tmp, dir) = with_edit("backup.toml", |t| {
        t.replace("target = \"backup\"", "target = \"tape\"")
    });
    expect_invalid(&dir, "backup.toml", "target", "does not declare");
    let (_tmp, dir) = with_edit("retention.toml", |t| {
        t.replace("hot_keep_last = 2", "hot_keep_last = 9")
    });
    expect_invalid(
        &dir,
        "retention.toml",
        "checkpoints.hot_keep_last",
        "more than keep_last",
    );
    let (_tmp, dir) = with_edit("retention.toml", |t| {
        t.replace("hot_keep_last = 2", "hot_keep_last = 0")
    });
    expect_invalid(
        &dir,
        "retention.toml",
        "checkpoints.hot_keep_last",
        "must be at least 1",
    );
    let (_tmp, dir) = with_edit("demotion.toml", |t| {
        t.replace("check_every = \"5m\"", "check_every = \"5 minutes\"")
    });
    expect_invalid(&dir, "demotion.toml", "check_every", "unknown unit");
    let (_tmp, dir) = with_edit("demotion.toml", |t| {
        t.replace("max_concurrent = 8", "max_concurrent = 0")
    });
    expect_invalid(&dir, "demotion.toml", "max_concurrent", "at least 1");
    let (_tmp, dir) = with_edit("packing.toml", |t| {
        t.replace("shard_size = \"1 GiB\"", "shard_size = \"4 KiB\"")
    });
    expect_invalid(&dir, "packing.toml", "shard_size", "below the minimum");
    let (_tmp, dir) = with_edit("priorities.toml", |t| {
        t.replace("[classes.stage]\nweight = 4\n", "")
    });
    expect_invalid(&dir, "priorities.toml", "classes.stage", "every class");
    let (_tmp, dir) = with_edit("priorities.toml", |t| {
        t.replace("[classes.ingest]", "[classes.bulk]")
    });
    expect_invalid(&dir, "priorities.toml", "classes.bulk", "unknown variant");
}

#[test]
fn an_offload_is_hashed_in_flight_unless_its_policy_asks_for_a_read_back() {
    use stagehand_policy::VerifyMode;
    let verify_of = |text: fn(String) -> String| {
        let (_tmp, dir) = with_edit("retention.toml", text);
        let home = dir.parent().unwrap().join("home");
        let policies = Policies::load_dir_with_home(&dir, &home).unwrap();
        policies
            .retention()
            .unwrap()
            .offload
            .as_ref()
            .unwrap()
            .verify
    };
    let without = verify_of(|t| {
        t.lines()
            .filter(|l| !l.starts_with("verify ="))
            .collect::<Vec<_>>()
            .join("\n")
    });
    assert_eq!(without, VerifyMode::HashedInFlight);
    let read_back =
        verify_of(|t| t.replace("verify = \"hashed-in-flight\"", "verify = \"read-back\""));
    assert_eq!(read_back, VerifyMode::ReadBack);
    let (_tmp, dir) = with_edit("retention.toml", |t| {
        t.replace("verify = \"hashed-in-flight\"", "verify = \"trust-me\"")
    });
    let home = dir.parent().unwrap().join("home");
    let err = Policies::load_dir_with_home(&dir, &home).expect_err("an unknown mode");
    assert!(err.to_string().contains("retention.toml"), "{err}");
}

#[test]
fn missing_and_unknown_files_are_named() {
    let (_tmp, dir) = with_edit("tier.toml", |_| "x = 1\n".into());
    let err = Policies::load_dir(&dir).unwrap_err();
    assert!(matches!(err, PolicyError::UnknownFile { .. }), "{err}");
    assert!(err.to_string().contains("tier.toml"), "{err}");

    let (_tmp, dir) = with_edit("validation.toml", |t| t);
    std::fs::remove_file(dir.join("validation.toml")).unwrap();
    let err = Policies::load_dir(&dir).unwrap_err();
    assert!(matches!(err, PolicyError::Missing { .. }), "{err}");
    assert_eq!(err.file(), dir.join("validation.toml"));

    // An optional file may be absent: its policy is then unset.
    let (tmp, dir) = with_edit("backup.toml", |t| t);
    std::fs::remove_file(dir.join("backup.toml")).unwrap();
    let policies = Policies::load_dir_with_home(&dir, tmp.path()).unwrap();
    assert!(policies.backup().is_none());

    let err = Policies::load_dir("/nonexistent/policies").unwrap_err();
    assert!(matches!(err, PolicyError::ReadDir { .. }), "{err}");
}

#[test]
fn toml_syntax_errors_point_at_the_line() {
    let (_tmp, dir) = with_edit("validation.toml", |t| {
        t.replace("max_entries = 20_000_000", "max_entries = = 1")
    });
    let err = Policies::load_dir(&dir).unwrap_err();
    let PolicyError::Invalid { line, key, .. } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(key, "max_entries");
    let expected = std::fs::read_to_string(dir.join("validation.toml"))
        .unwrap()
        .lines()
        .position(|l| l.starts_with("max_entries"))
        .unwrap()
        + 1;
    assert_eq!(*line, Some(expected), "{err}");
}

#[test]
fn posix_tiers_open_through_the_mover() {
    let home = tempfile::tempdir().unwrap();
    let policies = Policies::load_dir_with_home(shipped(), home.path()).unwrap();
    let source = policies.tier("source").unwrap();
    let err = source.open().expect_err("root does not exist yet");
    assert!(err.to_string().contains("source"), "{err}");
    source.create_root().unwrap();
    let tier = source.open().unwrap();
    assert_eq!(tier.name(), "source");
}

/// The packing policy selects by its thresholds and projects, and a dataset's own table wins
/// over both; a dataset's settings replace the file's key by key.
#[test]
fn packing_selects_by_thresholds_and_dataset_tables() {
    use stagehand_policy::{IncompletePolicy, NotPacked};
    let (_tmp, dir) = with_edit("packing.toml", |t| {
        t.replace("projects = []", "projects = [\"vision-lab\"]")
            .replace("require_extensions = []", "require_extensions = [\"jpg\"]")
            + "\n[datasets.\"audio/speech\"]\npack = true\nseed = 7\nshard_size = \"256 MiB\"\nincomplete = \"exclude\"\n\n[datasets.\"vision-lab/private\"]\npack = false\n"
    });
    let home = dir.parent().unwrap().join("home");
    let policies = Policies::load_dir_with_home(&dir, &home).unwrap();
    let p = policies.packing().unwrap();

    let packing = p
        .packing_for("vision-lab", "street", 20_000, 20_000 * 100_000)
        .unwrap();
    assert_eq!(packing.seed, 0);
    assert_eq!(packing.shard_size, 1 << 30);
    assert_eq!(packing.require_extensions, ["jpg"]);
    assert_eq!(packing.incomplete, IncompletePolicy::Abort);
    assert_eq!(packing.target_tier, "capacity");

    assert_eq!(
        p.packing_for("vision-lab", "street", 9_999, 1),
        Err(NotPacked::TooFewFiles {
            files: 9_999,
            min: 10_000
        })
    );
    assert!(matches!(
        p.packing_for("vision-lab", "street", 20_000, 20_000 * (5 << 20)),
        Err(NotPacked::FilesTooLarge { .. })
    ));
    assert_eq!(
        p.packing_for("other-lab", "street", 20_000, 1),
        Err(NotPacked::ProjectNotSelected("other-lab".into()))
    );
    assert_eq!(
        p.packing_for("vision-lab", "private", 20_000, 1),
        Err(NotPacked::Excluded)
    );
    // Listed with pack = true: packed although its project is not selected and it is small.
    let speech = p.packing_for("audio", "speech", 3, 3 << 30).unwrap();
    assert_eq!(
        (speech.seed, speech.shard_size, speech.incomplete),
        (7, 256 << 20, IncompletePolicy::Exclude)
    );
    assert_eq!(speech.require_extensions, ["jpg"]);
}

#[test]
fn packing_mistakes_are_named() {
    let (_tmp, dir) = with_edit("packing.toml", |t| {
        t.replace("require_extensions = []", "require_extensions = [\".jpg\"]")
    });
    expect_invalid(&dir, "packing.toml", "require_extensions", "leading dot");
    let (_tmp, dir) = with_edit("packing.toml", |t| {
        t.replace("require_extensions = []", "require_extensions = [\"JPG\"]")
    });
    expect_invalid(&dir, "packing.toml", "require_extensions", "lowercase");
    let (_tmp, dir) = with_edit("packing.toml", |t| {
        t.replace("incomplete = \"abort\"", "incomplete = \"ignore\"")
    });
    expect_invalid(&dir, "packing.toml", "incomplete", "unknown variant");
    let (_tmp, dir) = with_edit("packing.toml", |t| {
        t.replace("projects = []", "projects = [\"Vision Lab\"]")
    });
    expect_invalid(&dir, "packing.toml", "projects", "not a project name");
    let (_tmp, dir) = with_edit("packing.toml", |t| {
        t + "\n[datasets.\"no-slash\"]\nseed = 1\n"
    });
    expect_invalid(
        &dir,
        "packing.toml",
        "datasets.no-slash",
        "<project>/<dataset>",
    );
    let (_tmp, dir) = with_edit("packing.toml", |t| {
        t + "\n[datasets.\"lab/cats\"]\nshard_size = \"1 KiB\"\n"
    });
    expect_invalid(
        &dir,
        "packing.toml",
        "datasets.lab/cats.shard_size",
        "below the minimum",
    );
    let (_tmp, dir) = with_edit("packing.toml", |t| {
        t + "\n[datasets.\"lab/cats\"]\nsead = 1\n"
    });
    expect_invalid(
        &dir,
        "packing.toml",
        "datasets.lab/cats.sead",
        "unknown field",
    );
}

/// Each project's group: looked up on this host when the policies load (a group that does not
/// exist is refused naming `groups.<project>`), a numeric gid taken as given, and given to the
/// project's sets on posix hot and local tiers only, read-only (files 0440, folders 0550).
#[test]
fn project_groups_are_checked_at_load_and_apply_to_hot_and_local_tiers_only() {
    let (_tmp, dir) = with_edit("tiers.toml", |t| {
        format!("{t}\n[groups]\nlab-a = \"root\"\nlab-b = 4242\nlab-c = \"4343\"\n")
    });
    let home = dir.parent().unwrap().join("home");
    let policies = Policies::load_dir_with_home(&dir, &home).unwrap();
    let hot = policies.tier("hot").unwrap();
    let access = |tier: &str, project: &str| policies.tier(tier).unwrap().set_access(project);
    assert_eq!(
        hot.set_access("lab-a"),
        Some(stagehand_mover::SetAccess {
            file_mode: 0o440,
            dir_mode: 0o550,
            gid: Some(0)
        })
    );
    assert_eq!(access("local", "lab-b").and_then(|a| a.gid), Some(4242));
    assert_eq!(access("hot", "lab-c").and_then(|a| a.gid), Some(4343));
    // A project without a group: read-only all the same, the writer's own group.
    assert_eq!(
        access("hot", "other").map(|a| (a.file_mode, a.gid)),
        Some((0o440, None))
    );
    for tier in ["source", "capacity", "backup"] {
        assert_eq!(access(tier, "lab-a"), None, "{tier}");
    }

    let (_tmp, dir) = with_edit("tiers.toml", |t| {
        format!("{t}\n[groups]\nlab-a = \"no-such-group-stagehand\"\n")
    });
    let text = expect_invalid(
        &dir,
        "tiers.toml",
        "groups.lab-a",
        "group \"no-such-group-stagehand\" does not exist on this host",
    );
    assert!(text.contains("groupadd"), "{text}");
    let (_tmp, dir) = with_edit("tiers.toml", |t| {
        format!("{t}\n[groups]\n\"Lab A\" = \"root\"\n")
    });
    expect_invalid(&dir, "tiers.toml", "groups.Lab A", "is not a project name");
}

#[test]
fn shipped_scrub_policy_sets_a_period_per_tier_and_a_budget() {
    let home = tempfile::tempdir().unwrap();
    let policies = Policies::load_dir_with_home(shipped(), home.path()).unwrap();
    let scrub = policies.scrub().expect("scrub.toml is shipped");
    let day = std::time::Duration::from_secs(86_400);
    assert_eq!(scrub.period_of("hot"), Some(7 * day));
    assert_eq!(scrub.period_of("capacity"), Some(30 * day));
    assert_eq!(scrub.period_of("backup"), Some(90 * day));
    assert_eq!(scrub.period_of("source"), None);
    assert_eq!(scrub.budget.bytes_per_second.bytes(), 200 << 20);
    assert_eq!(scrub.budget.files_per_second, 2000);
    assert_eq!(scrub.budget.parallel_files, 4);
    assert_eq!(scrub.check_every, std::time::Duration::from_secs(600));
    assert_eq!(scrub.audit.quarantine_after, 7 * day);
    assert!((scrub.audit.stop_above_fraction - 0.2).abs() < 1e-9);
}

#[test]
fn scrub_policy_mistakes_are_named() {
    let (_tmp, dir) = with_edit("scrub.toml", |t| t.replace("hot = \"7d\"", "tape = \"7d\""));
    expect_invalid(&dir, "scrub.toml", "period.tape", "does not declare");
    let (_tmp, dir) = with_edit("scrub.toml", |t| {
        t.replace("capacity = \"30d\"", "capacity = \"30 days\"")
    });
    expect_invalid(&dir, "scrub.toml", "period.capacity", "unit");
    let (_tmp, dir) = with_edit("scrub.toml", |t| {
        t.replace("backup = \"90d\"", "backup = \"0s\"")
    });
    expect_invalid(&dir, "scrub.toml", "period.backup", "longer than 0");
    let (_tmp, dir) = with_edit("scrub.toml", |t| {
        t.replace("bytes_per_second = \"200 MiB\"", "bytes_per_second = 0")
    });
    expect_invalid(&dir, "scrub.toml", "budget.bytes_per_second", "more than 0");
    let (_tmp, dir) = with_edit("scrub.toml", |t| {
        t.replace("files_per_second = 2000", "files_per_second = 0")
    });
    expect_invalid(&dir, "scrub.toml", "budget.files_per_second", "more than 0");
    for bad in ["0", "65"] {
        let (_tmp, dir) = with_edit("scrub.toml", |t| {
            t.replace("parallel_files = 4", &format!("parallel_files = {bad}"))
        });
        expect_invalid(&dir, "scrub.toml", "budget.parallel_files", "1 to 64");
    }
    // Without the key, the scrub reads the default number of files at once.
    let (_tmp, dir) = with_edit("scrub.toml", |t| {
        let edited = t.replace("parallel_files = 4\n", "");
        assert_ne!(edited, t, "the shipped scrub.toml sets parallel_files");
        edited
    });
    let home = tempfile::tempdir().unwrap();
    let policies = Policies::load_dir_with_home(&dir, home.path()).unwrap();
    let scrub = policies.scrub().expect("scrub.toml is there");
    assert_eq!(
        scrub.budget.parallel_files,
        stagehand_policy::DEFAULT_SCRUB_PARALLEL_FILES
    );
    let (_tmp, dir) = with_edit("scrub.toml", |t| {
        t.replace(
            "files_per_second = 2000",
            "files_per_second = 2000\nfiles_per_hour = 1",
        )
    });
    expect_invalid(&dir, "scrub.toml", "budget.files_per_hour", "unknown field");
    let (_tmp, dir) = with_edit("scrub.toml", |t| {
        t.replace("quarantine_after = \"7d\"", "quarantine_after = \"7 days\"")
    });
    expect_invalid(&dir, "scrub.toml", "audit.quarantine_after", "unit");
    let (_tmp, dir) = with_edit("scrub.toml", |t| {
        t.replace("stop_above_fraction = 0.2", "stop_above_fraction = 20.0")
    });
    expect_invalid(&dir, "scrub.toml", "audit.stop_above_fraction", "0 to 1");
}

/// `check_dir` (`stagehand policy check`) finds every broken file, not only the first, and
/// says of each what a service at start says: its first error is `load_dir`'s error.
#[test]
fn check_dir_reports_every_broken_file_with_the_errors_a_service_starts_with() {
    let home = tempfile::tempdir().unwrap();
    assert!(
        Policies::check_dir(shipped(), home.path()).is_empty(),
        "{:?}",
        Policies::check_dir(shipped(), home.path())
    );
    let (_tmp, dir) = with_edit("validation.toml", |t| format!("{t}\nno_such_key = 1\n"));
    std::fs::write(
        dir.join("demotion.toml"),
        std::fs::read_to_string(dir.join("demotion.toml")).unwrap() + "\nmisspelt = true\n",
    )
    .unwrap();
    std::fs::write(dir.join("promotoin.toml"), "").unwrap();
    std::fs::write(
        dir.join("scrub.toml"),
        std::fs::read_to_string(dir.join("scrub.toml")).unwrap() + "\nperiod_of_tape = 1\n",
    )
    .unwrap();
    let errors = Policies::check_dir(&dir, home.path());
    let texts: Vec<String> = errors.iter().map(ToString::to_string).collect();
    assert_eq!(errors.len(), 4, "{texts:#?}");
    assert!(
        texts[3].contains("scrub.toml") && texts[3].contains("period_of_tape"),
        "{texts:#?}"
    );
    assert!(texts[0].contains("promotoin.toml"), "{texts:#?}");
    assert!(
        texts[1].contains("validation.toml") && texts[1].contains("no_such_key"),
        "{texts:#?}"
    );
    assert!(
        texts[2].contains("demotion.toml") && texts[2].contains("misspelt"),
        "{texts:#?}"
    );
    let first = Policies::load_dir_with_home(&dir, home.path()).unwrap_err();
    assert_eq!(first.to_string(), texts[0]);
    std::fs::remove_file(dir.join("promotoin.toml")).unwrap();
    let first = Policies::load_dir_with_home(&dir, home.path()).unwrap_err();
    assert_eq!(
        first.to_string(),
        Policies::check_dir(&dir, home.path())[0].to_string()
    );
}
