//! `stagehand checkpoint` as the real binary: commits of every recognised format against a
//! real nats-server with the real services of `stagehand up` (in-process: the catalogue
//! recorder, the demoter carrying out retention, the promoter), the same step committed twice
//! as one fact, a manifest too large to inline put in the project's upload bucket, the list of
//! a run with the states the demoter left and retention's decisions, a demoted checkpoint
//! restored onto hot; and, with no server at all, the refusals of incomplete checkpoints (refused
//! before any connection is tried) and the exit codes of bad arguments and an unreachable NATS.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use stagehand::up::{Stack, UpOptions};
use stagehand_bus::{Bus, BusConfig};
use stagehand_catalogue::{Catalogue, CheckpointState};
use stagehand_schemas::{Body, EventId, FileRef, sha256_hex};
use stagehand_testkit::{NatsServer, wait_for};

const WAIT: Duration = Duration::from_secs(60);

/// A listed checkpoint: step, state, tiers, recorded rule, retention's placement and rule now.
type Row = (
    u64,
    String,
    Vec<String>,
    Option<String>,
    Option<String>,
    Option<String>,
);

/// Runs the real `stagehand` binary against `url`.
fn stagehand(url: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_stagehand"))
        .args(args)
        .env("STAGEHAND_NATS_URL", url)
        .env_remove("STAGEHAND_PROJECT")
        .output()
        .expect("the stagehand binary runs")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Runs `checkpoint commit --json` and returns its answer; fails unless it exits 0.
fn commit(url: &str, policies: &Path, step: u64, path: &Path, extra: &[&str]) -> serde_json::Value {
    let step = step.to_string();
    let mut args = vec![
        "checkpoint",
        "commit",
        "--project",
        "lab-a",
        "--run",
        "r1",
        "--step",
        &step,
        "--policies",
        policies.to_str().unwrap(),
        "--json",
    ];
    args.extend_from_slice(extra);
    args.push(path.to_str().unwrap());
    let out = stagehand(url, &args);
    assert!(
        out.status.success(),
        "commit of step {step} exited {}: {}",
        out.status,
        stderr(&out)
    );
    serde_json::from_slice(&out.stdout).expect("commit --json prints JSON")
}

fn write(dir: &Path, files: &[(&str, &[u8])]) {
    for (name, bytes) in files {
        let path = dir.join(name);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, bytes).unwrap();
    }
}

/// Every format is committed, a re-commit is the same fact, a large manifest goes by
/// reference, the recorder folds commits, demotions and expiries per run, and `list` shows
/// each step's state, tier, rule and retention's decision now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_format_commits_once_and_lists_with_its_tier_and_rule() -> anyhow::Result<()> {
    let nats = NatsServer::start();
    let home = tempfile::tempdir()?;
    let stack = Stack::start(UpOptions {
        home: home.path().to_owned(),
        nats: Some(BusConfig::new(nats.url())),
        port: 0,
        policies: None,
    })
    .await?;
    stack.ready(WAIT).await?;
    let url = nats.url();
    let policies = stack.env.policies.clone();
    let run_dir: PathBuf = home.path().join("tiers/hot/lab-a/runs/r1");

    // torch.distributed.checkpoint
    let dcp = run_dir.join("step-100");
    write(
        &dcp,
        &[
            ("__0_0.distcp", b"shard zero"),
            ("__1_0.distcp", b"shard one!"),
            (".metadata", b"dcp metadata"),
        ],
    );
    let first = commit(&url, &policies, 100, &dcp, &[]);
    assert_eq!(first["format"], "torch.distributed.checkpoint");
    assert_eq!(first["files"], 3);
    assert_eq!(first["total_bytes"], 32);
    assert_eq!(first["duplicate"], false);
    assert_eq!(first["manifest"], serde_json::Value::Null);
    assert_eq!(first["location"]["prefix"], "lab-a/runs/r1/step-100");
    assert_eq!(
        first["id"],
        EventId::for_checkpoint("lab-a", "r1", 100).to_string()
    );

    // The fact on the stream carries every file, hashed.
    let bus = Bus::connect(&BusConfig::new(&url)).await?;
    let facts = bus.jetstream().get_stream("STAGEHAND_FACTS").await?;
    let subject = "stagehand.fact.checkpoint.committed.lab-a";
    let stored = facts.get_last_raw_message_by_subject(subject).await?;
    let event = stagehand_schemas::wire::decode(&stored.payload)?;
    let Body::CheckpointCommitted(fact) = &event.body else {
        anyhow::bail!("not a commit: {event:?}")
    };
    assert_eq!(
        fact.files,
        vec![
            FileRef::new(".metadata", 12, sha256_hex(b"dcp metadata")),
            FileRef::new("__0_0.distcp", 10, sha256_hex(b"shard zero")),
            FileRef::new("__1_0.distcp", 10, sha256_hex(b"shard one!")),
        ]
    );
    assert_eq!(fact.location.tier, "hot");

    // The same step again: the same fact, dropped as a duplicate.
    let again = commit(&url, &policies, 100, &dcp, &[]);
    assert_eq!(
        (&again["id"], &again["duplicate"]),
        (&first["id"], &true.into())
    );
    // ... but the same step with other tags, or other files, is refused: the first stands.
    let dcp_path = dcp.to_str().unwrap();
    let policies_path = policies.to_str().unwrap();
    let plain_args = [
        "checkpoint",
        "commit",
        "--project",
        "lab-a",
        "--run",
        "r1",
        "--step",
        "100",
        "--policies",
        policies_path,
        dcp_path,
    ];
    let mut tagged_args = plain_args.to_vec();
    tagged_args.splice(10..10, ["--tag", "best"]);
    let out = stagehand(&url, &tagged_args);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("step 100 of run r1 was committed before with tags []"),
        "{}",
        stderr(&out)
    );
    std::fs::write(dcp.join("__1_0.distcp"), b"shard ONE!")?;
    let out = stagehand(&url, &plain_args);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("committed before with other files (32 bytes)"),
        "{}",
        stderr(&out)
    );
    std::fs::write(dcp.join("__1_0.distcp"), b"shard one!")?;

    // Orbax: the committed directory with its marker.
    let orbax = run_dir.join("orbax/200");
    write(
        &orbax,
        &[
            ("_CHECKPOINT_METADATA", b"{}"),
            ("state/_METADATA", b"{\"tree\":1}"),
            ("state/d/0000", b"array bytes"),
        ],
    );
    assert_eq!(commit(&url, &policies, 200, &orbax, &[])["format"], "orbax");

    // DeepSpeed: the save directory; the tag `latest` names is committed.
    let ds = run_dir.join("deepspeed");
    write(
        &ds,
        &[
            ("global_step300/mp_rank_00_model_states.pt", b"model"),
            (
                "global_step300/zero_pp_rank_0_mp_rank_00_optim_states.pt",
                b"optim",
            ),
            ("latest", b"global_step300\n"),
        ],
    );
    let answer = commit(&url, &policies, 300, &ds, &[]);
    assert_eq!(answer["format"], "deepspeed");
    assert_eq!(answer["files"], 2);
    assert_eq!(
        answer["location"]["prefix"],
        "lab-a/runs/r1/deepspeed/global_step300"
    );

    // NeMo 2: no -unfinished marker.
    let nemo = run_dir.join("nemo/step=400");
    write(
        &nemo,
        &[
            ("context/io.json", b"{}"),
            ("weights/.metadata", b"m"),
            ("weights/__0_0.distcp", b"w"),
        ],
    );
    assert_eq!(commit(&url, &policies, 400, &nemo, &[])["format"], "nemo");

    // A plain directory, vouched for, tagged.
    let plain = run_dir.join("step-500");
    write(
        &plain,
        &[("model.safetensors", b"weights"), ("config.json", b"{}")],
    );
    let answer = commit(
        &url,
        &policies,
        500,
        &plain,
        &["--complete", "--tag", "best"],
    );
    assert_eq!(answer["format"], "directory");
    assert_eq!(answer["tags"], serde_json::json!(["best"]));

    // A manifest over the inline bound goes by reference into the project's upload bucket.
    let many = run_dir.join("step-600");
    std::fs::create_dir_all(&many)?;
    for i in 0..3000 {
        std::fs::write(
            many.join(format!("shard-with-a-long-name-{i:05}.bin")),
            i.to_string(),
        )?;
    }
    let answer = commit(&url, &policies, 600, &many, &["--complete"]);
    assert_eq!(answer["files"], 3000);
    let digest = answer["manifest"]
        .as_str()
        .expect("a manifest by reference")
        .to_owned();
    let uploads =
        stagehand_manifest::ManifestStore::open(bus.jetstream(), "stagehand_uploads_lab-a").await?;
    assert!(uploads.contains(&digest).await?);

    // Six steps committed, the re-commit stored once.
    let info = facts.info_with_subjects(subject).await?;
    use futures::TryStreamExt;
    let counts: std::collections::HashMap<String, usize> = info.try_collect().await?;
    assert_eq!(counts.get(subject).copied(), Some(6));

    // The stack's demoter carries out retention (keep_last 5, hot_keep_last 2): the recorder
    // folds its demotions and expiry.
    let catalogue = Catalogue::new(bus.client().clone());
    wait_for(
        WAIT,
        "six checkpoints: the oldest expired, the next three demoted, the newest two on hot",
        || async {
            use CheckpointState::{Committed, Demoted, Expired};
            let all = catalogue.all_checkpoints("lab-a", "r1").await.ok()?;
            let states: Vec<CheckpointState> = all.iter().map(|c| c.state).collect();
            let settled = states == [Expired, Demoted, Demoted, Demoted, Committed, Committed];
            settled.then_some(())
        },
    )
    .await?;
    let capacity = home.path().join("tiers/capacity/lab-a/runs/r1");
    assert!(!run_dir.join("step-100").exists() && !capacity.join("step-100").exists());
    assert!(!run_dir.join("orbax/200").exists() && capacity.join("orbax/200").exists());
    assert!(run_dir.join("step-500").exists() && run_dir.join("step-600").exists());

    let out = stagehand(
        &url,
        &[
            "checkpoint",
            "list",
            "r1",
            "--project",
            "lab-a",
            "--policies",
            policies.to_str().unwrap(),
            "--json",
        ],
    );
    assert!(out.status.success(), "list: {}", stderr(&out));
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let rows: Vec<Row> = listed
        .as_array()
        .expect("a list")
        .iter()
        .map(|c| {
            let strings = |v: &serde_json::Value| -> Vec<String> {
                v.as_array()
                    .unwrap()
                    .iter()
                    .map(|s| s.as_str().unwrap().to_owned())
                    .collect()
            };
            (
                c["step"].as_u64().unwrap(),
                c["state"].as_str().unwrap().to_owned(),
                strings(&c["tiers"]),
                c["rule"].as_str().map(str::to_owned),
                c["retention"]["placement"].as_str().map(str::to_owned),
                c["retention"]["rule"].as_str().map(str::to_owned),
            )
        })
        .collect();
    let s = |v: &str| Some(v.to_owned());
    // The shipped retention: keep_last 5, hot_keep_last 2, tags keep/best/release. Of the five
    // live steps all are kept by keep_last; the newest two stay on hot.
    assert_eq!(
        rows,
        vec![
            (100, "expired".into(), vec![], s("expired"), None, None),
            (
                200,
                "demoted".into(),
                vec!["capacity".into()],
                s("keep_last"),
                s("demote"),
                s("keep_last")
            ),
            (
                300,
                "demoted".into(),
                vec!["capacity".into()],
                s("keep_last"),
                s("demote"),
                s("keep_last")
            ),
            (
                400,
                "demoted".into(),
                vec!["capacity".into()],
                s("keep_last"),
                s("demote"),
                s("keep_last")
            ),
            (
                500,
                "committed".into(),
                vec!["hot".into()],
                None,
                s("hot"),
                s("hot_keep_last")
            ),
            (
                600,
                "committed".into(),
                vec!["hot".into()],
                None,
                s("hot"),
                s("hot_keep_last")
            ),
        ]
    );
    assert_eq!(
        listed[4]["retention"]["kept_by"],
        serde_json::json!(["keep_last", "tagged:best"])
    );

    // The text form names the same.
    let out = stagehand(
        &url,
        &[
            "checkpoint",
            "list",
            "r1",
            "--project",
            "lab-a",
            "--policies",
            policies.to_str().unwrap(),
        ],
    );
    assert!(out.status.success(), "list: {}", stderr(&out));
    let text = String::from_utf8(out.stdout)?;
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 7, "{text}");
    assert!(
        lines[0].contains("STEP") && lines[0].contains("RETENTION NOW"),
        "{text}"
    );
    assert!(
        lines[2].contains("demoted")
            && lines[2].contains("capacity")
            && lines[2].contains("keep_last"),
        "{text}"
    );
    assert!(
        lines[5].contains("best")
            && lines[5].contains("hot (hot_keep_last; also keep_last, tagged:best)"),
        "{text}"
    );

    stack.stop().await?;
    Ok(())
}

/// Guards `checkpoint restore` end to end through the real services (`stagehand up`: the
/// recorder, the demoter, the promoter): three steps committed, retention (hot_keep_last 2)
/// demotes the oldest to capacity, so it is on capacity only; restoring it stages its version
/// of `ckpt-<run>` onto hot, the printed path holds every file with its committed hash; the
/// newest, still where it was committed, is printed in place; an unknown step is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_demoted_checkpoint_restores_onto_hot_with_every_hash() -> anyhow::Result<()> {
    let nats = NatsServer::start();
    let home = tempfile::tempdir()?;
    let stack = Stack::start(UpOptions {
        home: home.path().to_owned(),
        nats: Some(BusConfig::new(nats.url())),
        port: 0,
        policies: None,
    })
    .await?;
    stack.ready(WAIT).await?;
    let url = nats.url();
    let policies = stack.env.policies.clone();
    let hot = home.path().join("tiers/hot");
    let capacity = home.path().join("tiers/capacity");
    let contents = |step: u64| -> Vec<(String, Vec<u8>)> {
        vec![
            (
                "model.pt".into(),
                format!("weights of step {step}").into_bytes(),
            ),
            ("optim/state.bin".into(), vec![step as u8; 4096]),
        ]
    };
    for step in 1..=3 {
        let dir = hot.join(format!("lab-a/runs/r7/step-{step}"));
        for (name, bytes) in contents(step) {
            std::fs::create_dir_all(dir.join(&name).parent().unwrap())?;
            std::fs::write(dir.join(&name), bytes)?;
        }
        let step = step.to_string();
        let out = stagehand(
            &url,
            &[
                "checkpoint",
                "commit",
                "--project",
                "lab-a",
                "--run",
                "r7",
                "--step",
                &step,
                "--complete",
                "--policies",
                policies.to_str().unwrap(),
                dir.to_str().unwrap(),
            ],
        );
        assert!(out.status.success(), "commit {step}: {}", stderr(&out));
    }

    // Retention demotes step 1: present on capacity only, in the checkpoints and as a version.
    let bus = Bus::connect(&BusConfig::new(&url)).await?;
    let catalogue = Catalogue::new(bus.client().clone());
    let digest = wait_for(WAIT, "step 1 demoted by retention", || async {
        let records = catalogue.all_checkpoints("lab-a", "r7").await.ok()?;
        let first = records.iter().find(|r| r.step == 1)?;
        (first.state == CheckpointState::Demoted).then(|| first.digest.clone())?
    })
    .await?;
    let version = catalogue.version(Some("lab-a"), "ckpt-r7", &digest).await?;
    assert_eq!(version.version.file_count, 2);
    let mut present: Vec<&str> = version
        .replicas
        .iter()
        .filter(|r| r.state == stagehand_catalogue::ReplicaState::Present)
        .map(|r| r.tier.as_str())
        .collect();
    present.sort();
    assert_eq!(present, ["capacity"]);
    assert!(capacity.join("lab-a/runs/r7/step-1/model.pt").exists());
    // The demoter withdraws the hot replica (the catalogue says removed) before its folder
    // goes, so that no job is handed a folder being deleted: the folder follows.
    let step_1_on_hot = hot.join("lab-a/runs/r7/step-1");
    wait_for(WAIT, "step 1's folder on hot removed", || async {
        (!step_1_on_hot.exists()).then_some(())
    })
    .await?;

    // Restore it onto hot: the staged folder holds every file as committed.
    let restore = |step: Option<&str>| {
        let mut args = vec![
            "checkpoint",
            "restore",
            "r7",
            "--tier",
            "hot",
            "--job",
            "resume-1",
            "--project",
            "lab-a",
            "--policies",
            policies.to_str().unwrap(),
            "--timeout",
            "60s",
        ];
        if let Some(step) = step {
            args.extend(["--step", step]);
        }
        stagehand(&url, &args)
    };
    let out = restore(Some("1"));
    assert_eq!(out.status.code(), Some(0), "restore: {}", stderr(&out));
    let path = PathBuf::from(String::from_utf8(out.stdout)?.trim());
    assert_eq!(path, hot.join(format!("lab-a/ckpt-r7/{digest}")));
    for (name, bytes) in contents(1) {
        let landed = std::fs::read(path.join(&name))?;
        assert_eq!(sha256_hex(&landed), sha256_hex(&bytes), "{name}");
    }
    let mut landed: Vec<String> = walkdir(&path);
    landed.sort();
    assert_eq!(landed, ["model.pt", "optim/state.bin"]);

    // The newest (the default) is still where it was committed: printed in place.
    let out = restore(None);
    assert_eq!(
        out.status.code(),
        Some(0),
        "restore newest: {}",
        stderr(&out)
    );
    assert_eq!(
        PathBuf::from(String::from_utf8(out.stdout)?.trim()),
        hot.join("lab-a/runs/r7/step-3")
    );
    // A step never committed is refused, naming it.
    let out = restore(Some("9"));
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("run r7 has no checkpoint of step 9"),
        "{}",
        stderr(&out)
    );

    stack.stop().await?;
    Ok(())
}

/// The files beneath `dir`, relative, with `/` between components.
fn walkdir(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_owned()];
    while let Some(d) = todo.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let entry = entry.unwrap();
            if entry.file_type().unwrap().is_dir() {
                todo.push(entry.path());
            } else {
                let rel = entry.path().strip_prefix(dir).unwrap().to_owned();
                out.push(rel.to_string_lossy().into_owned());
            }
        }
    }
    out
}

/// Policies with a hot tier under `home`, as `stagehand up` writes them.
fn policies_in(home: &Path) -> PathBuf {
    let dir = home.join("policies");
    stagehand::up::write_default_policies(&dir, home).unwrap();
    std::fs::create_dir_all(home.join("tiers/hot/lab-a")).unwrap();
    dir
}

/// A URL where nothing listens: a command that tried to connect would exit 69.
fn nowhere() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    drop(listener);
    format!("nats://127.0.0.1:{port}")
}

fn commit_args<'a>(policies: &'a str, step: &'a str, path: &'a str) -> Vec<&'a str> {
    vec![
        "checkpoint",
        "commit",
        "--project",
        "lab-a",
        "--run",
        "r1",
        "--step",
        step,
        "--policies",
        policies,
        path,
    ]
}

/// Incomplete DCP and NeMo checkpoints are refused with their reason (exit 1) before any
/// connection is tried, as are a symlink leaving the checkpoint and a FIFO in it.
#[test]
fn incomplete_checkpoints_are_refused_with_the_reason() {
    let home = tempfile::tempdir().unwrap();
    let policies = policies_in(home.path());
    let policies = policies.to_str().unwrap();
    let url = nowhere();
    let run = home.path().join("tiers/hot/lab-a/r1");

    let dcp = run.join("step-10");
    write(&dcp, &[("__0_0.distcp", b"x"), (".metadata.tmp", b"m")]);
    let out = stagehand(&url, &commit_args(policies, "10", dcp.to_str().unwrap()));
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("refused: torch.distributed.checkpoint")
            && stderr(&out).contains("no .metadata"),
        "{}",
        stderr(&out)
    );

    let nemo = run.join("step=20");
    write(
        &nemo,
        &[("context/io.json", b"{}"), ("weights/.metadata", b"m")],
    );
    write(&run, &[("step=20-unfinished", b"")]);
    let out = stagehand(&url, &commit_args(policies, "20", nemo.to_str().unwrap()));
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("refused: NeMo") && stderr(&out).contains("step=20-unfinished"),
        "{}",
        stderr(&out)
    );

    let outside = home.path().join("secret");
    std::fs::write(&outside, b"not yours").unwrap();
    let leaky = run.join("step-30");
    write(&leaky, &[(".metadata", b"m")]);
    std::os::unix::fs::symlink(&outside, leaky.join("escape")).unwrap();
    let out = stagehand(&url, &commit_args(policies, "30", leaky.to_str().unwrap()));
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains("outside"), "{}", stderr(&out));

    let fifo_dir = run.join("step-40");
    write(&fifo_dir, &[(".metadata", b"m")]);
    let made = Command::new("mkfifo")
        .arg(fifo_dir.join("pipe"))
        .status()
        .unwrap();
    assert!(made.success());
    let out = stagehand(
        &url,
        &commit_args(policies, "40", fifo_dir.to_str().unwrap()),
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("pipe is neither a regular file"),
        "{}",
        stderr(&out)
    );
}

/// Bad arguments exit 64 naming what is wrong; a complete checkpoint with NATS unreachable
/// exits 69.
#[test]
fn bad_arguments_exit_64_and_unreachable_nats_69() {
    let home = tempfile::tempdir().unwrap();
    let policies = policies_in(home.path());
    let policies = policies.to_str().unwrap();
    let url = nowhere();
    let done = home.path().join("tiers/hot/lab-a/r1/step-10");
    write(&done, &[(".metadata", b"m"), ("__0_0.distcp", b"x")]);
    let done = done.to_str().unwrap();

    let out = stagehand(&url, &commit_args(policies, "ten", done));
    assert_eq!(out.status.code(), Some(64), "{}", stderr(&out));
    assert!(stderr(&out).contains("--step \"ten\""), "{}", stderr(&out));

    let elsewhere = home.path().join("tiers/hot/lab-b/r1/step-10");
    write(&elsewhere, &[(".metadata", b"m")]);
    let out = stagehand(
        &url,
        &commit_args(policies, "10", elsewhere.to_str().unwrap()),
    );
    assert_eq!(out.status.code(), Some(64), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("not inside project \"lab-a\""),
        "{}",
        stderr(&out)
    );

    let mut args = commit_args(policies, "10", done);
    args[3] = "Lab A";
    let out = stagehand(&url, &args);
    assert_eq!(out.status.code(), Some(64), "{}", stderr(&out));

    let mut args = commit_args(policies, "10", done);
    args.extend(["--connect-timeout", "1s"]);
    let out = stagehand(&url, &args);
    assert_eq!(out.status.code(), Some(69), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(&format!("cannot reach NATS at {url} within")),
        "{}",
        stderr(&out)
    );
}

/// Commits `dir` as step `step` of `run` (`--complete`); returns the command's output.
fn commit_plain(url: &str, policies: &Path, run: &str, step: u64, dir: &Path) -> Output {
    let step = step.to_string();
    stagehand(
        url,
        &[
            "checkpoint",
            "commit",
            "--project",
            "lab-a",
            "--run",
            run,
            "--step",
            &step,
            "--complete",
            "--policies",
            policies.to_str().unwrap(),
            dir.to_str().unwrap(),
        ],
    )
}

/// Guards issue 19's nested step: a step saved inside another live step's folder, or around
/// it, of the same run or another, is refused at commit (exit 1) naming both steps and
/// folders, and nothing is published; a step beside it (`step-100` next to `step-10`) is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_inside_or_around_another_steps_folder_is_refused_naming_both() -> anyhow::Result<()>
{
    let nats = NatsServer::start();
    let home = tempfile::tempdir()?;
    let stack = Stack::start(UpOptions {
        home: home.path().to_owned(),
        nats: Some(BusConfig::new(nats.url())),
        port: 0,
        policies: None,
    })
    .await?;
    stack.ready(WAIT).await?;
    let url = nats.url();
    let policies = stack.env.policies.clone();
    let run_dir = home.path().join("tiers/hot/lab-a/runs/r9");
    let outer = run_dir.join("step-10");
    write(&outer, &[("model.pt", b"weights of step 10")]);
    let out = commit_plain(&url, &policies, "r9", 10, &outer);
    assert!(out.status.success(), "commit 10: {}", stderr(&out));
    let bus = Bus::connect(&BusConfig::new(&url)).await?;
    let catalogue = Catalogue::new(bus.client().clone());
    wait_for(WAIT, "step 10 in the catalogue", || async {
        let records = catalogue.all_checkpoints("lab-a", "r9").await.ok()?;
        records.iter().any(|r| r.step == 10).then_some(())
    })
    .await?;

    let inner = outer.join("step-20");
    write(&inner, &[("model.pt", b"weights of step 20")]);
    let out = commit_plain(&url, &policies, "r9", 20, &inner);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(
            "step 20 of run r9 at hot:lab-a/runs/r9/step-10/step-20 overlaps step 10 of run r9 \
             at hot:lab-a/runs/r9/step-10"
        ),
        "{}",
        stderr(&out)
    );
    // Around it, from another run: refused the same way.
    let out = commit_plain(&url, &policies, "r10", 1, &run_dir);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(
            "step 1 of run r10 at hot:lab-a/runs/r9 overlaps step 10 of run r9 at \
             hot:lab-a/runs/r9/step-10"
        ),
        "{}",
        stderr(&out)
    );
    // Beside it: a folder whose name only starts the same is its own.
    let beside = run_dir.join("step-100");
    write(&beside, &[("model.pt", b"weights of step 100")]);
    let out = commit_plain(&url, &policies, "r9", 100, &beside);
    assert!(out.status.success(), "commit 100: {}", stderr(&out));

    let commits = stagehand_testkit::stored_events(
        bus.jetstream(),
        "STAGEHAND_FACTS",
        stagehand_schemas::subject::kind_filter("fact", "checkpoint.committed"),
    )
    .await
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    let steps: Vec<u64> = commits
        .iter()
        .filter_map(|e| match &e.body {
            Body::CheckpointCommitted(c) => Some(c.step),
            _ => None,
        })
        .collect();
    assert_eq!(steps, vec![10, 100], "only the steps of their own folders");
    stack.stop().await?;
    Ok(())
}

/// Guards issue 19's restore of a folder that is not there: a step still where its run
/// committed it is printed only when its folder holds every committed file with its size —
/// a file cut short, or the folder gone, is refused (exit 1) naming what is wrong, never
/// printed with exit 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restore_never_prints_a_folder_that_is_not_there() -> anyhow::Result<()> {
    let nats = NatsServer::start();
    let home = tempfile::tempdir()?;
    let stack = Stack::start(UpOptions {
        home: home.path().to_owned(),
        nats: Some(BusConfig::new(nats.url())),
        port: 0,
        policies: None,
    })
    .await?;
    stack.ready(WAIT).await?;
    let url = nats.url();
    let policies = stack.env.policies.clone();
    let dir = home.path().join("tiers/hot/lab-a/runs/r8/step-1");
    write(
        &dir,
        &[
            ("model.pt", b"weights of step 1"),
            ("optim/state.bin", &[7; 4096]),
        ],
    );
    let out = commit_plain(&url, &policies, "r8", 1, &dir);
    assert!(out.status.success(), "commit: {}", stderr(&out));
    let bus = Bus::connect(&BusConfig::new(&url)).await?;
    let catalogue = Catalogue::new(bus.client().clone());
    wait_for(WAIT, "step 1 in the catalogue", || async {
        let records = catalogue.all_checkpoints("lab-a", "r8").await.ok()?;
        records
            .iter()
            .any(|r| r.step == 1 && r.digest.is_some())
            .then_some(())
    })
    .await?;
    let restore = || {
        stagehand(
            &url,
            &[
                "checkpoint",
                "restore",
                "r8",
                "--step",
                "1",
                "--tier",
                "hot",
                "--job",
                "resume-8",
                "--project",
                "lab-a",
                "--policies",
                policies.to_str().unwrap(),
                "--timeout",
                "30s",
            ],
        )
    };
    let out = restore();
    assert_eq!(out.status.code(), Some(0), "whole: {}", stderr(&out));
    assert_eq!(PathBuf::from(String::from_utf8(out.stdout)?.trim()), dir);

    std::fs::write(dir.join("optim/state.bin"), [7; 100])?;
    let out = restore();
    assert_eq!(out.status.code(), Some(1), "cut short: {}", stderr(&out));
    assert!(
        stderr(&out).contains("state.bin holds 100 bytes, committed with 4096"),
        "{}",
        stderr(&out)
    );
    assert!(out.stdout.is_empty(), "no path printed");

    std::fs::remove_dir_all(&dir)?;
    let out = restore();
    assert_eq!(out.status.code(), Some(1), "gone: {}", stderr(&out));
    assert!(
        stderr(&out).contains("is not there: not restored"),
        "{}",
        stderr(&out)
    );
    assert!(out.stdout.is_empty(), "no path printed");
    stack.stop().await?;
    Ok(())
}
