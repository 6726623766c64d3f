//! Per-tenant bounds that `stagehand provision` sets, against a real nats-server: each request
//! subject (`stagehand.req.<kind>.<project>`) keeps a bounded number of requests and refuses
//! the next one rather than dropping an old, unconsumed one; each project's upload bucket holds
//! a bounded number of bytes. A refused publish or upload is one line from the CLI naming the
//! limit.
//!
//! The shipped limits are large (250,000 requests per subject, 4 GiB per upload bucket); to
//! reach them in a test, the test lowers them on the server after checking what provision set.

use std::path::Path;
use std::process::{Command, Output};

use async_nats::jetstream::stream::DiscardPolicy;
use stagehand_schemas::subject::{
    REQUEST_MAX_MSGS_PER_SUBJECT, REQUESTS, UPLOAD_BUCKET_MAX_BYTES, upload_bucket_spec,
};
use stagehand_testkit::NatsServer;

fn stagehand(url: &str, home: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_stagehand"))
        .args(["--nats", url])
        .args(args)
        .env("STAGEHAND_HOME", home)
        .env_remove("STAGEHAND_PROJECT")
        .output()
        .unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

async fn requests_on(js: &async_nats::jetstream::Context, subject: &str) -> u64 {
    use futures::StreamExt;
    let stream = js.get_stream(REQUESTS.name).await.unwrap();
    let mut subjects = stream.info_with_subjects(subject).await.unwrap();
    let mut n = 0;
    while let Some(entry) = subjects.next().await {
        let (name, count) = entry.unwrap();
        if name == subject {
            n = count as u64;
        }
    }
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provision_bounds_each_projects_requests_and_uploads_and_the_cli_names_the_limit() {
    let nats = NatsServer::start();
    let url = nats.url();
    let home = tempfile::tempdir().unwrap();
    let js = async_nats::jetstream::new(async_nats::connect(&url).await.unwrap());
    // A requests stream as an earlier release created it (no per-subject bound, discard old):
    // provision brings it to the declared bounds in place.
    js.create_stream(async_nats::jetstream::stream::Config {
        name: REQUESTS.name.into(),
        subjects: REQUESTS.subjects.iter().map(|s| (*s).to_owned()).collect(),
        max_age: REQUESTS.max_age,
        ..Default::default()
    })
    .await
    .unwrap();
    let out = stagehand(&url, home.path(), &["provision", "--project", "demo"]);
    assert!(out.status.success(), "{}", stderr(&out));

    // What provision set.
    let mut requests = js.get_stream(REQUESTS.name).await.unwrap();
    let config = requests.info().await.unwrap().config.clone();
    assert_eq!(
        config.max_messages_per_subject,
        REQUEST_MAX_MSGS_PER_SUBJECT
    );
    assert_eq!(config.discard, DiscardPolicy::New);
    assert!(config.discard_new_per_subject);
    let uploads = upload_bucket_spec("demo");
    let mut bucket = js.get_stream(uploads.stream_name()).await.unwrap();
    let bucket_config = bucket.info().await.unwrap().config.clone();
    assert_eq!(bucket_config.max_bytes as u64, UPLOAD_BUCKET_MAX_BYTES);

    // Requests: a subject at its bound refuses the next one and keeps the ones it holds.
    js.update_stream(async_nats::jetstream::stream::Config {
        max_messages_per_subject: 2,
        ..config.clone()
    })
    .await
    .unwrap();
    let digest = "ab".repeat(32);
    let target = format!("cats@{digest}");
    for job in ["j1", "j2"] {
        let out = stagehand(
            &url,
            home.path(),
            &[
                "stage",
                "request",
                &target,
                "--tier",
                "hot",
                "--job",
                job,
                "--project",
                "demo",
            ],
        );
        assert!(out.status.success(), "{}", stderr(&out));
    }
    let out = stagehand(
        &url,
        home.path(),
        &[
            "stage",
            "request",
            &target,
            "--tier",
            "hot",
            "--job",
            "j3",
            "--project",
            "demo",
        ],
    );
    let said = stderr(&out);
    assert!(!out.status.success());
    assert_eq!(said.lines().count(), 1, "one line: {said}");
    assert!(
        said.contains("stagehand.req.stage.requested.demo")
            && said.contains("max_msgs_per_subject")
            && said.contains("refused"),
        "names the subject and the limit: {said}"
    );
    assert_eq!(
        requests_on(&js, "stagehand.req.stage.requested.demo").await,
        2,
        "the requests held are kept, the new one refused"
    );
    // Another project's subject is not affected.
    let out = stagehand(
        &url,
        home.path(),
        &[
            "stage",
            "request",
            &target,
            "--tier",
            "hot",
            "--job",
            "j1",
            "--project",
            "other",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));

    // Uploads: a manifest that does not fit the project's bucket is refused, naming it.
    js.update_stream(async_nats::jetstream::stream::Config {
        max_bytes: 64 * 1024,
        ..bucket_config
    })
    .await
    .unwrap();
    let policies = home.path().join("policies");
    stagehand::up::write_default_policies(&policies, home.path()).unwrap();
    std::fs::create_dir_all(home.path().join("tiers/source")).unwrap();
    let folder = tempfile::tempdir().unwrap();
    // 4,000 files: a manifest of about 340 KB, past the inline bound, so it is uploaded.
    for i in 0..4000 {
        let dir = folder.path().join(format!("d{:02}", i % 30));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(format!("file-{i:05}.bin")), i.to_string()).unwrap();
    }
    let out = stagehand(
        &url,
        home.path(),
        &[
            "ingest",
            folder.path().to_str().unwrap(),
            "--project",
            "demo",
            "--dataset",
            "many",
            "--policies",
            policies.to_str().unwrap(),
        ],
    );
    let said = stderr(&out);
    assert!(!out.status.success(), "{said}");
    let last = said.lines().last().unwrap_or_default();
    assert!(
        last.contains("stagehand_uploads_demo") && last.contains("max_bytes"),
        "names the bucket and its limit: {said}"
    );
    assert_eq!(
        requests_on(&js, "stagehand.req.ingest.requested.demo").await,
        0,
        "no request for a manifest that was not stored"
    );
}
