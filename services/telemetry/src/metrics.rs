//! Prometheus metrics: one process-wide recorder behind the `metrics` facade, and a small
//! scrape endpoint that serves `GET /metrics` and the probes a supervisor asks: `GET /healthz`
//! (the process answers) and `GET /readyz` (the service is ready for work, by a [`Readiness`]
//! check its runner gives).
//!
//! Every metric name comes from [`crate::names`]; label values stay bounded (a service, an
//! outcome), never an id or a path. The recorder is installed once per process ([`install`]),
//! so the services `stagehand up` runs side by side share it and tell themselves apart by
//! their `service` label. The endpoint is plain HTTP/1.1 on tokio: a scrape is one short
//! request, and serving it here keeps a whole HTTP server stack out of every service's build.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::net::{TcpListener, TcpStream};

use crate::names;

/// Bucket bounds (seconds) of the duration histograms.
const SECONDS_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0,
];
/// How often histogram data is folded (the exporter's upkeep).
const UPKEEP_EVERY: Duration = Duration::from_secs(5);

/// The process-wide Prometheus recorder, installed on first use.
///
/// Installing fails only when another `metrics` recorder was installed first by code outside
/// Stagehand; the handle then renders this recorder's (empty) registry, and a warning says so.
pub fn install() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        let recorder = PrometheusBuilder::new()
            .set_buckets(SECONDS_BUCKETS)
            .and_then(|b| {
                b.set_buckets_for_metric(
                    Matcher::Full(names::COPY_THROUGHPUT.into()),
                    crate::work::THROUGHPUT_BUCKETS,
                )
            })
            .and_then(|b| {
                b.set_buckets_for_metric(
                    Matcher::Full(names::STAGE_READY_SECONDS.into()),
                    crate::work::STAGE_BUCKETS,
                )
            })
            .expect("the bucket lists are not empty")
            .build_recorder();
        let handle = recorder.handle();
        if metrics::set_global_recorder(recorder).is_err() {
            tracing::warn!("another metrics recorder is installed; /metrics will be empty");
        }
        describe();
        handle
    })
}

fn describe() {
    metrics::describe_gauge!(
        names::SERVICE_INFO,
        "1 while the service runs; labels: service, version"
    );
    metrics::describe_counter!(
        names::HANDLER_CALLS_TOTAL,
        "Handler calls finished, by service and result (ok, retryable, permanent)"
    );
    metrics::describe_histogram!(
        names::HANDLER_SECONDS,
        metrics::Unit::Seconds,
        "Time a handler took for one event, by service"
    );
    metrics::describe_counter!(
        names::TASK_FAILURES_TOTAL,
        "Tasks of a service that stopped with an error, by service and task"
    );
    crate::work::describe();
}

/// What `GET /readyz` answers: `Ok` when the service is ready for work, else why it is not
/// (one line, shown in the 503's body).
pub type Readiness = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

/// The scrape endpoint: a bound listener that serves the process-wide registry and the
/// health probes.
pub struct MetricsEndpoint {
    listener: TcpListener,
    handle: &'static PrometheusHandle,
    readiness: Option<Readiness>,
}

impl std::fmt::Debug for MetricsEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsEndpoint")
            .field("listener", &self.listener)
            .field("readiness", &self.readiness.is_some())
            .finish()
    }
}

impl MetricsEndpoint {
    /// Binds `addr` (port 0 picks a free port) and installs the recorder.
    pub async fn bind(addr: SocketAddr) -> std::io::Result<MetricsEndpoint> {
        let listener = TcpListener::bind(addr).await?;
        Ok(MetricsEndpoint {
            listener,
            handle: install(),
            readiness: None,
        })
    }

    /// Answers `GET /readyz` with `check` (without one, ready whenever the process answers).
    pub fn with_readiness(mut self, check: Readiness) -> MetricsEndpoint {
        self.readiness = Some(check);
        self
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Serves scrapes until `shutdown` completes.
    pub async fn serve(self, shutdown: impl Future<Output = ()>) {
        let mut upkeep = tokio::time::interval(UPKEEP_EVERY);
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                _ = &mut shutdown => break,
                _ = upkeep.tick() => self.handle.run_upkeep(),
                accepted = self.listener.accept() => match accepted {
                    Ok((stream, _)) => {
                        let handle = self.handle;
                        let readiness = self.readiness.clone();
                        tokio::spawn(async move {
                            if let Err(e) = respond(stream, handle, readiness.as_ref()).await {
                                tracing::debug!(error = %e, "metrics scrape failed");
                            }
                        });
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "metrics endpoint: accept failed");
                        // Out of descriptors or similar: do not spin on the error.
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                },
            }
        }
    }
}

/// Answers one HTTP request: `GET /metrics` gets the registry in the text exposition format,
/// `GET /healthz` 200 (liveness: the process and its runtime answer; never NATS, so that an
/// outage of the bus does not get every service restarted), `GET /readyz` 200 or 503 with the
/// reason (readiness).
async fn respond(
    mut stream: TcpStream,
    handle: &PrometheusHandle,
    readiness: Option<&Readiness>,
) -> std::io::Result<()> {
    let head = crate::http::read_head(&mut stream).await?;
    let (status, content_type, body) = match (head.method.as_str(), head.path.as_str()) {
        ("GET", "/metrics") => (
            "200 OK",
            "text/plain; version=0.0.4; charset=utf-8",
            handle.render(),
        ),
        ("GET", "/healthz") => ("200 OK", "text/plain", "ok\n".into()),
        ("GET", "/readyz") => match readiness.map_or(Ok(()), |check| check()) {
            Ok(()) => ("200 OK", "text/plain", "ready\n".into()),
            Err(why) => (
                "503 Service Unavailable",
                "text/plain",
                format!("not ready: {why}\n"),
            ),
        },
        ("GET", _) => (
            "404 Not Found",
            "text/plain",
            "only /metrics, /healthz and /readyz here\n".into(),
        ),
        _ => (
            "405 Method Not Allowed",
            "text/plain",
            "GET /metrics\n".into(),
        ),
    };
    crate::http::respond(&mut stream, status, content_type, "", &body).await
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    async fn get(addr: SocketAddr, request: &str) -> String {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(request.as_bytes()).await.unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test]
    async fn the_endpoint_serves_recorded_metrics_and_refuses_other_paths() {
        let endpoint = MetricsEndpoint::bind("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        let addr = endpoint.local_addr().unwrap();
        let stop = tokio::sync::Notify::new();
        let server = endpoint.serve(stop.notified());
        let client = async {
            metrics::counter!(names::HANDLER_CALLS_TOTAL, "service" => "unit-test", "result" => "ok")
                .increment(3);
            let ok = get(addr, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await;
            assert!(ok.starts_with("HTTP/1.1 200 OK"), "{ok}");
            assert!(
                ok.contains(r#"stagehand_handler_calls_total{service="unit-test",result="ok"} 3"#),
                "{ok}"
            );
            let live = get(addr, "GET /healthz HTTP/1.1\r\n\r\n").await;
            assert!(
                live.starts_with("HTTP/1.1 200 OK") && live.ends_with("ok\n"),
                "{live}"
            );
            let ready = get(addr, "GET /readyz HTTP/1.1\r\n\r\n").await;
            assert!(ready.starts_with("HTTP/1.1 200 OK"), "{ready}");
            let missing = get(addr, "GET /other HTTP/1.1\r\n\r\n").await;
            assert!(missing.starts_with("HTTP/1.1 404"), "{missing}");
            let post = get(addr, "POST /metrics HTTP/1.1\r\n\r\n").await;
            assert!(post.starts_with("HTTP/1.1 405"), "{post}");
            stop.notify_one();
        };
        tokio::join!(server, client);
    }

    #[tokio::test]
    async fn readyz_answers_the_services_check_and_healthz_does_not() {
        let ready = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = ready.clone();
        let endpoint = MetricsEndpoint::bind("127.0.0.1:0".parse().unwrap())
            .await
            .unwrap()
            .with_readiness(Arc::new(move || {
                if flag.load(std::sync::atomic::Ordering::SeqCst) {
                    Ok(())
                } else {
                    Err("connecting to NATS".into())
                }
            }));
        let addr = endpoint.local_addr().unwrap();
        let stop = tokio::sync::Notify::new();
        let server = endpoint.serve(stop.notified());
        let client = async {
            let waiting = get(addr, "GET /readyz HTTP/1.1\r\n\r\n").await;
            assert!(
                waiting.starts_with("HTTP/1.1 503")
                    && waiting.ends_with("not ready: connecting to NATS\n"),
                "{waiting}"
            );
            let live = get(addr, "GET /healthz HTTP/1.1\r\n\r\n").await;
            assert!(live.starts_with("HTTP/1.1 200 OK"), "{live}");
            ready.store(true, std::sync::atomic::Ordering::SeqCst);
            let now = get(addr, "GET /readyz HTTP/1.1\r\n\r\n").await;
            assert!(
                now.starts_with("HTTP/1.1 200 OK") && now.ends_with("ready\n"),
                "{now}"
            );
            stop.notify_one();
        };
        tokio::join!(server, client);
    }
}
