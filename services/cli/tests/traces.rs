//! One trace from `stagehand ingest` to a staged copy that is ready, as an OTLP receiver sees
//! it: `stagehand up` runs every service as a real process with `OTEL_EXPORTER_OTLP_ENDPOINT`
//! set, the real `stagehand ingest --wait`, `stagehand stage request` and `stagehand stage wait`
//! run with the same endpoint and the `TRACEPARENT` of a workflow, and an OTLP/gRPC trace
//! receiver in this test (the `TraceService` of `opentelemetry-proto` on tonic: no collector is
//! installable here) collects what they export. The workflow's trace must hold the spans of the
//! command, the ingest validator, the catalogue recorder and the promoter, each under its own
//! `service.name`, joined into one tree.

mod up_child;

use std::collections::{BTreeSet, HashMap};
use std::net::TcpListener as StdListener;
use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, ensure};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use stagehand_testkit::wait_for;
use up_child::Up;

/// Bound on start-up, on each command, and on the spans arriving.
const WAIT: Duration = Duration::from_secs(90);

/// The workflow the commands run in: its trace id and the span id of its (unexported) root.
const TRACE_ID: &str = "5a6e7d0c1b2a39485766a5b4c3d2e1f0";
const ROOT_SPAN: &str = "0f1e2d3c4b5a6978";

/// One span as the receiver got it.
#[derive(Debug, Clone)]
struct Received {
    service: String,
    name: String,
    trace_id: String,
    span_id: String,
    parent: String,
}

/// The OTLP/gRPC trace receiver: keeps every span it is sent.
#[derive(Clone, Default)]
struct Receiver(Arc<Mutex<Vec<Received>>>);

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut got = Vec::new();
        for resource_spans in request.into_inner().resource_spans {
            let service = resource_spans
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|kv| kv.key == "service.name")
                .and_then(|kv| match kv.value.as_ref()?.value.as_ref()? {
                    Value::StringValue(s) => Some(s.clone()),
                    _ => None,
                })
                .unwrap_or_default();
            for span in resource_spans.scope_spans.into_iter().flat_map(|s| s.spans) {
                got.push(Received {
                    service: service.clone(),
                    name: span.name,
                    trace_id: hex::encode(span.trace_id),
                    span_id: hex::encode(span.span_id),
                    parent: hex::encode(span.parent_span_id),
                });
            }
        }
        self.0.lock().expect("receiver lock").extend(got);
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

impl Receiver {
    /// Starts the receiver on a free loopback port; returns its endpoint URL.
    async fn start(&self) -> anyhow::Result<String> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let service = TraceServiceServer::new(self.clone());
        tokio::spawn(tonic::transport::Server::builder().serve_with_incoming(
            service,
            tonic::transport::server::TcpIncoming::from(listener),
        ));
        Ok(format!("http://{addr}"))
    }

    /// The spans of `trace_id` received so far.
    fn trace(&self, trace_id: &str) -> Vec<Received> {
        let spans = self.0.lock().expect("receiver lock");
        spans
            .iter()
            .filter(|s| s.trace_id == trace_id)
            .cloned()
            .collect()
    }
}

/// What a complete trace lacks: services without a span, and spans whose parent is neither a
/// received span nor the workflow's root. Empty when complete.
fn missing(spans: &[Received], services: &[&str]) -> Vec<String> {
    let ids: BTreeSet<&str> = spans.iter().map(|s| s.span_id.as_str()).collect();
    let mut missing: Vec<String> = services
        .iter()
        .filter(|svc| !spans.iter().any(|s| s.service == **svc))
        .map(|svc| format!("no span of service {svc}"))
        .collect();
    missing.extend(
        spans
            .iter()
            .filter(|s| s.parent != ROOT_SPAN && !ids.contains(s.parent.as_str()))
            .map(|s| {
                format!(
                    "{} span {:?} has parent {:?}, which is not in the trace",
                    s.service, s.name, s.parent
                )
            }),
    );
    missing
}

/// Whether some span of `service` descends from the span named `command`.
fn descends(spans: &[Received], service: &str, command: &str) -> bool {
    let by_id: HashMap<&str, &Received> = spans.iter().map(|s| (s.span_id.as_str(), s)).collect();
    spans.iter().filter(|s| s.service == service).any(|s| {
        let mut at = by_id.get(s.parent.as_str());
        // Bounded: a cycle in what was received must fail the test, not hang it.
        for _ in 0..spans.len() {
            match at {
                Some(p) if p.name == command => return true,
                Some(p) => at = by_id.get(p.parent.as_str()),
                None => return false,
            }
        }
        false
    })
}

/// Runs the real `stagehand` in the workflow's trace, exporting to `endpoint`; its stdout.
fn stagehand(url: &str, home: &Path, endpoint: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_stagehand"))
        .args(args)
        .env("STAGEHAND_NATS_URL", url)
        .env("STAGEHAND_HOME", home)
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        .env("TRACEPARENT", format!("00-{TRACE_ID}-{ROOT_SPAN}-01"))
        .output()?;
    ensure!(
        out.status.success(),
        "stagehand {args:?} exited {}: {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_runs_from_ingest_through_validation_catalogue_and_staging_to_ready()
-> anyhow::Result<()> {
    let receiver = Receiver::default();
    let endpoint = receiver.start().await?;
    let dir = tempfile::tempdir()?;
    let home = dir.path().join("home");
    let stderr = dir.path().join("up.stderr");
    let port = StdListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let url = format!("nats://127.0.0.1:{port}");
    let mut up = Up::start(
        &home,
        port,
        stderr,
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            // Batches leave every 100 ms rather than every 5 s: the spans arrive while the
            // services run, without stopping them.
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ],
    )?;
    up.wait_up().await?;

    let folder = dir.path().join("upload");
    std::fs::create_dir_all(&folder)?;
    std::fs::write(folder.join("labels.csv"), b"id,label\n1,cat\n2,dog\n")?;
    std::fs::write(folder.join("0001.bin"), vec![7u8; 4096])?;
    let policies = home.join("policies");
    let path = |p: &Path| p.to_str().context("utf-8 path").map(str::to_owned);
    let out = stagehand(
        &url,
        &home,
        &endpoint,
        &[
            "ingest",
            &path(&folder)?,
            "--project",
            "lab",
            "--dataset",
            "traced",
            "--policies",
            &path(&policies)?,
            "--wait",
            "--timeout",
            "60",
            "--json",
        ],
    )?;
    let report: serde_json::Value = serde_json::from_str(&out).context(out.clone())?;
    let version = report["outcome"]["validated"]["version"]
        .as_str()
        .with_context(|| format!("not validated: {report:#}"))?
        .to_owned();
    let stage = [
        format!("traced@{version}"),
        "--tier".into(),
        "hot".into(),
        "--job".into(),
        "train-1".into(),
        "--project".into(),
        "lab".into(),
    ];
    let stage: Vec<&str> = stage.iter().map(String::as_str).collect();
    stagehand(
        &url,
        &home,
        &endpoint,
        &[&["stage", "request"], &stage[..]].concat(),
    )?;
    stagehand(
        &url,
        &home,
        &endpoint,
        &[&["stage", "wait"], &stage[..], &["--timeout", "60"]].concat(),
    )?;

    let services = [
        stagehand::args::COMMAND_SERVICE,
        stagehand_ingest_validator::SERVICE,
        stagehand_catalogue_recorder::SERVICE,
        stagehand_promoter::SERVICE,
    ];
    // Parents end after their children, so a trace is whole only once nothing is missing.
    let whole = wait_for(WAIT, "the workflow's trace to be whole", || {
        let spans = receiver.trace(TRACE_ID);
        let complete = missing(&spans, &services).is_empty()
            && descends(
                &spans,
                stagehand_promoter::SERVICE,
                "stagehand stage request",
            );
        async move { complete.then_some(()) }
    })
    .await;
    let spans = receiver.trace(TRACE_ID);
    let summary: Vec<String> = spans
        .iter()
        .map(|s| format!("{} {} {}<-{}", s.service, s.name, s.span_id, s.parent))
        .collect();
    ensure!(
        whole.is_ok(),
        "trace {TRACE_ID} is not whole: {:#?}\nreceived:\n{}",
        missing(&spans, &services),
        summary.join("\n")
    );
    let summary = summary.join("\n");
    for (service, command) in [
        (stagehand_ingest_validator::SERVICE, "stagehand ingest"),
        (stagehand_catalogue_recorder::SERVICE, "stagehand ingest"),
        (stagehand_promoter::SERVICE, "stagehand stage request"),
        (
            stagehand_catalogue_recorder::SERVICE,
            "stagehand stage request",
        ),
    ] {
        ensure!(
            descends(&spans, service, command),
            "no span of {service} under `{command}`:\n{summary}"
        );
    }
    ensure!(
        spans
            .iter()
            .any(|s| s.name == "stagehand stage wait" && s.parent == ROOT_SPAN),
        "`stagehand stage wait` is not in the workflow's trace:\n{summary}"
    );
    Ok(())
}
