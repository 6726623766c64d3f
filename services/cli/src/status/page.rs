//! `stagehand status --serve ADDR`: the on-call view ([`super::gather`]) as one read-only HTML
//! page that reloads itself, for a wall screen or a browser tab left open.
//!
//! `GET /` renders the same [`Report`] `stagehand status` prints, as one self-contained page
//! (inline CSS, no script, no external asset): what needs a person first, each with the command
//! and runbook page to run, then tiers, stages, restore drills, services, consumers and dead
//! letters. `GET /status.json` answers `status --json`'s object. Anything else is 404 (405 for
//! another method): nothing here changes anything.
//!
//! The view is gathered again per request, but at most once per [`CACHE_FOR`]: a wall of
//! screens reloading together, or a refresh storm, asks NATS and the catalogue once. Every
//! string is escaped into the page: dataset names, job ids and reasons come from tenants.
//!
//! The server is plain HTTP/1.1 on tokio, as the services' metrics endpoint
//! (`stagehand_telemetry::metrics`): one short request per connection, no web framework.

use std::fmt::Write as _;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use stagehand_bus::Bus;
use stagehand_catalogue::{Catalogue, StageState, StageStatus};
use time::OffsetDateTime;
use tokio::net::{TcpListener, TcpStream};

use super::{Report, StatusOptions, human_age};

/// How long one gathered view answers requests before the next request gathers it again.
pub const CACHE_FOR: Duration = Duration::from_secs(2);

/// The status page: a bound listener and what it needs to gather the view.
pub struct StatusPage {
    listener: TcpListener,
    view: Arc<View>,
}

impl std::fmt::Debug for StatusPage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StatusPage")
            .field("listener", &self.listener)
            .field("refresh", &self.view.refresh)
            .finish()
    }
}

struct View {
    bus: Bus,
    catalogue: Catalogue,
    opts: StatusOptions,
    refresh: Duration,
    /// The last view gathered. An async mutex held while gathering on purpose: requests that
    /// arrive meanwhile wait for that one gathering instead of starting their own.
    cache: tokio::sync::Mutex<Option<Gathered>>,
}

/// One gathering: when, and the view or why there is none.
#[derive(Clone)]
struct Gathered {
    fresh_until: Instant,
    at: OffsetDateTime,
    report: Result<Arc<Report>, String>,
}

impl StatusPage {
    /// Binds `addr` (port 0 picks a free port). The page asks browsers to reload it every
    /// `refresh`.
    pub async fn bind(
        addr: SocketAddr,
        bus: Bus,
        catalogue: Catalogue,
        opts: StatusOptions,
        refresh: Duration,
    ) -> std::io::Result<StatusPage> {
        let listener = TcpListener::bind(addr).await?;
        Ok(StatusPage {
            listener,
            view: Arc::new(View {
                bus,
                catalogue,
                opts,
                refresh,
                cache: tokio::sync::Mutex::new(None),
            }),
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Serves the page until `shutdown` completes. Requests in progress are dropped then:
    /// there is nothing to finish for a read-only view.
    pub async fn serve(self, shutdown: impl Future<Output = ()>) {
        tokio::pin!(shutdown);
        let mut requests = tokio::task::JoinSet::new();
        loop {
            tokio::select! {
                _ = &mut shutdown => break,
                // Reap finished requests so that the set does not grow with every one served.
                Some(_) = requests.join_next(), if !requests.is_empty() => {}
                accepted = self.listener.accept() => match accepted {
                    Ok((stream, _)) => {
                        let view = self.view.clone();
                        requests.spawn(async move {
                            if let Err(e) = respond(stream, &view).await {
                                tracing::debug!(error = %e, "status page: a request failed");
                            }
                        });
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "status page: accept failed");
                        // Out of descriptors or similar: do not spin on the error.
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                },
            }
        }
        requests.shutdown().await;
    }
}

/// `stagehand status --serve ADDR`: binds, prints the page's URL on stdout (a script or test
/// reads the port from it when ADDR's is 0), and serves until Ctrl-C or SIGTERM.
pub async fn run(
    addr: SocketAddr,
    bus: Bus,
    catalogue: Catalogue,
    opts: StatusOptions,
    refresh: Duration,
) -> anyhow::Result<()> {
    use anyhow::Context as _;
    use tokio::signal::unix::{SignalKind, signal};
    // Listen for the stop signals before printing the URL: a stop right after it must end the
    // server cleanly, not kill it with the default action.
    let mut interrupt = signal(SignalKind::interrupt()).context("installing the Ctrl-C handler")?;
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let page = StatusPage::bind(addr, bus, catalogue, opts, refresh)
        .await
        .with_context(|| format!("listening on {addr} for the status page"))?;
    let bound = page.local_addr().context("the status page's address")?;
    {
        use std::io::Write as _;
        let mut out = std::io::stdout().lock();
        writeln!(out, "status page: http://{bound}/ (Ctrl-C to stop)")?;
        out.flush()?;
    }
    page.serve(async {
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = term.recv() => {}
        }
    })
    .await;
    Ok(())
}

impl View {
    /// The cached view, or a new one when it is older than [`CACHE_FOR`].
    async fn current(&self) -> Gathered {
        let mut cache = self.cache.lock().await;
        if let Some(g) = cache.as_ref().filter(|g| Instant::now() < g.fresh_until) {
            return g.clone();
        }
        let report = super::gather(&self.bus, &self.catalogue, &self.opts)
            .await
            .map(Arc::new)
            .map_err(|e| format!("{e:#}"));
        if let Err(e) = &report {
            tracing::warn!(error = %e, "status page: gathering the view failed");
        }
        let g = Gathered {
            fresh_until: Instant::now() + CACHE_FOR,
            at: OffsetDateTime::now_utc(),
            report,
        };
        *cache = Some(g.clone());
        g
    }
}

/// Answers one request: `GET /` the page, `GET /status.json` the JSON view; 503 with the
/// reason when the view could not be gathered (the page still reloads itself, so it recovers
/// on its own once NATS or the catalogue answers again).
async fn respond(mut stream: TcpStream, view: &View) -> std::io::Result<()> {
    let head = stagehand_telemetry::http::read_head(&mut stream).await?;
    const HTML: &str = "text/html; charset=utf-8";
    const JSON: &str = "application/json";
    const TEXT: &str = "text/plain; charset=utf-8";
    let (status, content_type, body) = match (head.method.as_str(), head.path.as_str()) {
        ("GET", "/") => {
            let g = view.current().await;
            match &g.report {
                Ok(report) => ("200 OK", HTML, html(report, g.at, view.refresh)),
                Err(e) => (
                    "503 Service Unavailable",
                    HTML,
                    error_html(e, g.at, view.refresh),
                ),
            }
        }
        ("GET", "/status.json") => {
            let g = view.current().await;
            match &g.report {
                Ok(report) => match serde_json::to_string_pretty(report.as_ref()) {
                    Ok(json) => ("200 OK", JSON, json + "\n"),
                    Err(e) => (
                        "500 Internal Server Error",
                        TEXT,
                        format!("the view does not encode: {e}\n"),
                    ),
                },
                Err(e) => (
                    "503 Service Unavailable",
                    JSON,
                    serde_json::json!({ "error": e }).to_string() + "\n",
                ),
            }
        }
        ("GET", _) => (
            "404 Not Found",
            TEXT,
            "only / and /status.json here\n".into(),
        ),
        _ => (
            "405 Method Not Allowed",
            TEXT,
            "read-only: GET / or /status.json\n".into(),
        ),
    };
    // No script runs and nothing loads from elsewhere, whatever a tenant's string holds.
    stagehand_telemetry::http::respond(
        &mut stream,
        status,
        content_type,
        "Cache-Control: no-store\r\nX-Content-Type-Options: nosniff\r\n\
         Content-Security-Policy: default-src 'none'; style-src 'unsafe-inline'\r\n",
        &body,
    )
    .await
}

/// `s` escaped for HTML text and attribute values.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// A finding's `run` as (command, runbook page): `cmd (runbooks/page.md)` gives both, a bare
/// `runbooks/page.md` only the page, anything else only the command.
fn command_and_runbook(run: &str) -> (&str, &str) {
    if let Some(open) = run.rfind(" (runbooks/")
        && run.ends_with(".md)")
    {
        return (&run[..open], &run[open + 2..run.len() - 1]);
    }
    if run.starts_with("runbooks/") && run.ends_with(".md") {
        return ("", run);
    }
    (run, "")
}

const STYLE: &str = "\
body{font:15px/1.4 system-ui,sans-serif;margin:0 1.5em 2em;color:#1d232a;background:#f6f7f9}\
header{display:flex;align-items:baseline;gap:1.5em;border-bottom:1px solid #ccd}\
h1{font-size:1.4em;margin:.6em 0}h2{font-size:1.15em;margin:1.2em 0 .4em}\
.as-of{color:#556}\
section{margin-top:.5em}\
table{border-collapse:collapse;width:100%;background:#fff}\
th,td{text-align:left;padding:.3em .6em;border-bottom:1px solid #e3e5ea;vertical-align:top}\
th{font-weight:600;background:#eef0f4}\
code{font:13px ui-monospace,monospace;overflow-wrap:anywhere}\
.alert h2{color:#a3151b}.alert table{border-left:4px solid #c62828}\
.ok h2{color:#1b6e2a}\
.bad{color:#a3151b;font-weight:600}.muted{color:#667}\
ul{margin:.2em 0;padding-left:1.2em}";

/// The view as one HTML page: what needs a person first, then tiers, stages and drills, then
/// the services, consumers and dead letters behind them.
pub fn html(r: &Report, at: OffsetDateTime, refresh: Duration) -> String {
    let mut p = String::with_capacity(16 * 1024);
    let title = if r.findings.is_empty() {
        "Stagehand: nothing needs a person".to_owned()
    } else {
        format!("Stagehand: {} need a person", r.findings.len())
    };
    open_page(&mut p, &title, at, refresh);
    findings(&mut p, r);
    tiers(&mut p, r);
    stages(&mut p, r);
    drills(&mut p, r);
    services(&mut p, r);
    consumers(&mut p, r);
    dead_letters(&mut p, r);
    p.push_str("<section id=\"catalogue\"><h2>Catalogue</h2>");
    let _ = write!(p, "<p>{} facts could not be folded</p>", r.problems);
    if !r.not_checked.is_empty() {
        p.push_str("<p class=\"muted\">Not checked here:</p><ul>");
        for n in &r.not_checked {
            let _ = write!(p, "<li>{}</li>", escape(n));
        }
        p.push_str("</ul>");
    }
    p.push_str("</section></body></html>\n");
    p
}

/// The page when the view could not be gathered: why, and it keeps reloading.
pub fn error_html(error: &str, at: OffsetDateTime, refresh: Duration) -> String {
    let mut p = String::new();
    open_page(&mut p, "Stagehand: status unknown", at, refresh);
    let _ = writeln!(
        p,
        "<section id=\"needs-person\" class=\"alert\"><h2>The view could not be gathered</h2>\
         <p><code>{}</code></p><p>Is NATS reachable and the catalogue recorder running? \
         See runbooks/service-silent.md.</p></section></body></html>",
        escape(error)
    );
    p
}

fn open_page(p: &mut String, title: &str, at: OffsetDateTime, refresh: Duration) {
    let refresh = refresh.as_secs().max(1);
    let _ = write!(
        p,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta http-equiv=\"refresh\" content=\"{refresh}\">\
         <meta name=\"viewport\" content=\"width=device-width\">\
         <title>{}</title><style>{STYLE}</style></head><body>\
         <header><h1>Stagehand status</h1><span class=\"as-of\">as of {:02}:{:02}:{:02} UTC \
         {}, reloads every {refresh} s</span></header>",
        escape(title),
        at.hour(),
        at.minute(),
        at.second(),
        at.date(),
    );
}

fn findings(p: &mut String, r: &Report) {
    if r.findings.is_empty() {
        p.push_str(
            "<section id=\"needs-person\" class=\"ok\"><h2>Nothing needs a person</h2></section>",
        );
        return;
    }
    let _ = write!(
        p,
        "<section id=\"needs-person\" class=\"alert\"><h2>{} {} a person</h2><table>\
         <thead><tr><th>Area</th><th>What</th><th>Why</th><th>Run</th><th>Runbook</th></tr></thead><tbody>",
        r.findings.len(),
        if r.findings.len() == 1 {
            "thing needs"
        } else {
            "things need"
        }
    );
    for f in &r.findings {
        let (command, runbook) = command_and_runbook(&f.run);
        let _ = write!(
            p,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td><code>{}</code></td><td><code>{}</code></td></tr>",
            escape(f.area),
            escape(&f.subject),
            escape(&f.detail),
            escape(command),
            escape(runbook)
        );
    }
    p.push_str("</tbody></table></section>");
}

fn percent(part: u64, whole: u64) -> f64 {
    100.0 * part as f64 / whole.max(1) as f64
}

fn tiers(p: &mut String, r: &Report) {
    p.push_str("<section id=\"tiers\"><h2>Tiers</h2>");
    if r.tiers.is_empty() && r.damaged.is_empty() {
        p.push_str("<p class=\"muted\">no bounded tier (or no policies)</p></section>");
        return;
    }
    p.push_str(
        "<table><thead><tr><th>Tier</th><th>Used</th><th>High watermark</th><th>Capacity</th>\
         <th>Damaged copies</th></tr></thead><tbody>",
    );
    for t in &r.tiers {
        let used = percent(t.counted, t.capacity);
        let above = t.counted as f64 > t.high_watermark * t.capacity.max(1) as f64;
        let damaged = r
            .damaged
            .iter()
            .find(|d| d.tier == t.tier)
            .map_or(0, |d| d.damaged);
        let _ = write!(
            p,
            "<tr><td>{}</td><td{}>{used:.1} %</td><td>{:.0} %</td><td>{}</td><td>{damaged}</td></tr>",
            escape(&t.tier),
            if above { " class=\"bad\"" } else { "" },
            100.0 * t.high_watermark,
            crate::tier::size(t.capacity),
        );
    }
    // Damaged copies on tiers without limits have no line above.
    for d in r
        .damaged
        .iter()
        .filter(|d| r.tiers.iter().all(|t| t.tier != d.tier))
    {
        let _ = write!(
            p,
            "<tr><td>{}</td><td></td><td></td><td></td><td class=\"bad\">{}</td></tr>",
            escape(&d.tier),
            d.damaged
        );
    }
    p.push_str("</tbody></table></section>");
}

/// As `status` words it: a pending request the promoter reports progress on is copying.
fn state_word(s: &StageStatus) -> &'static str {
    match s.state {
        StageState::Pending if s.progress.is_some() => "copying",
        StageState::Pending => "pending",
        StageState::Copying => "copying",
        StageState::Ready => "ready",
        StageState::Failed => "failed",
        StageState::Released => "released",
    }
}

fn stage_rows(p: &mut String, items: &[StageStatus], now: OffsetDateTime) {
    for s in items {
        let _ = write!(
            p,
            "<tr><td>{}</td><td>{}/{}@{}</td><td>{}{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            escape(&s.job_id),
            escape(&s.project),
            escape(&s.dataset),
            escape(s.version.get(..12).unwrap_or(&s.version)),
            escape(&s.tier),
            s.node
                .as_deref()
                .map(|n| format!(":{}", escape(n)))
                .unwrap_or_default(),
            escape(s.waiting_for.as_deref().unwrap_or("")),
            state_word(s),
            human_age((now - s.updated_at).whole_seconds()),
            escape(s.reason.as_deref().unwrap_or("")),
        );
    }
}

fn stages(p: &mut String, r: &Report) {
    let c = r.stages.counts;
    let _ = write!(
        p,
        "<section id=\"stages\"><h2>Stages</h2><p>{} pending ({} copying), {} failed</p>",
        c.pending, c.copying, c.failed
    );
    if !r.stages.pending.is_empty() || !r.stages.failed.is_empty() {
        p.push_str(
            "<table><thead><tr><th>Job</th><th>Dataset</th><th>Tier</th><th>Waiting for</th>\
             <th>State</th><th>Unchanged for</th><th>Reason</th></tr></thead><tbody>",
        );
        let now = OffsetDateTime::now_utc();
        stage_rows(p, &r.stages.pending, now);
        stage_rows(p, &r.stages.failed, now);
        p.push_str("</tbody></table>");
    }
    p.push_str("</section>");
}

fn drills(p: &mut String, r: &Report) {
    p.push_str("<section id=\"drills\"><h2>Restore drills</h2>");
    match &r.drills {
        Some(d) => {
            let _ = write!(
                p,
                "<p>{} backed-up versions, <span{}>{} failed</span>, <span{}>{} overdue</span></p>",
                d.versions,
                if d.failed > 0 { " class=\"bad\"" } else { "" },
                d.failed,
                if d.overdue > 0 { " class=\"bad\"" } else { "" },
                d.overdue
            );
        }
        None => p.push_str("<p class=\"muted\">not checked (no policies or no backup.toml)</p>"),
    }
    p.push_str("</section>");
}

fn services(p: &mut String, r: &Report) {
    p.push_str(
        "<section id=\"services\"><h2>Services</h2><table><thead><tr><th>Service</th>\
         <th>Instance</th><th>State</th><th>Version</th><th>Host</th><th>Beat</th><th>Handled</th>\
         <th>Restarts</th></tr></thead><tbody>",
    );
    for s in &r.services {
        let _ = write!(
            p,
            "<tr><td>{}</td><td>{}</td><td{}>{}</td><td>{}</td><td>{}</td><td>{} ago</td><td>{}</td><td>{}</td></tr>",
            escape(&s.service),
            escape(&s.instance),
            if s.state == "alive" || s.state == "stopped" {
                ""
            } else {
                " class=\"bad\""
            },
            s.state,
            escape(&s.version),
            escape(&s.host),
            human_age(s.beat_seconds_ago),
            s.handled,
            s.restarts
        );
    }
    p.push_str("</tbody></table></section>");
}

fn consumers(p: &mut String, r: &Report) {
    p.push_str(
        "<section id=\"consumers\"><h2>Consumers</h2><table><thead><tr><th>Stream</th>\
         <th>Consumer</th><th>Waiting</th><th>In flight</th><th>Redelivered</th><th>Oldest</th>\
         </tr></thead><tbody>",
    );
    for c in &r.consumers {
        let _ = write!(
            p,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            escape(&c.stream),
            escape(&c.consumer),
            c.pending,
            c.ack_pending,
            c.redelivered,
            c.oldest_seconds.map(human_age).unwrap_or_default()
        );
    }
    p.push_str("</tbody></table></section>");
}

fn dead_letters(p: &mut String, r: &Report) {
    let waiting: u64 = r.dead_letters.iter().map(|d| d.waiting).sum();
    let _ = write!(
        p,
        "<section id=\"dead-letters\"><h2>Dead letters</h2><p>{waiting} waiting</p>"
    );
    if !r.dead_letters.is_empty() {
        p.push_str(
            "<table><thead><tr><th>Service</th><th>Waiting</th><th>In all</th></tr></thead><tbody>",
        );
        for d in &r.dead_letters {
            let _ = write!(
                p,
                "<tr><td>{}</td><td>{}</td><td>{}</td></tr>",
                escape(&d.service),
                d.waiting,
                d.count
            );
        }
        p.push_str("</tbody></table>");
    }
    p.push_str("</section>");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::status::{DrillLines, Finding, StageLines, TierLine};

    const EVIL: &str = "<script>alert('x')</script>&\"";

    fn report() -> Report {
        Report {
            needs_person: true,
            findings: vec![Finding {
                area: "stage",
                subject: format!("lab/{EVIL}@0123 on hot for job j"),
                detail: format!("pending for 2h: {EVIL}"),
                run: "stagehand stage status --project lab j (runbooks/stage-stuck.md)".into(),
            }],
            services: vec![],
            consumers: vec![],
            stages: StageLines {
                counts: Default::default(),
                pending: vec![],
                failed: vec![],
            },
            dead_letters: vec![],
            tiers: vec![TierLine {
                tier: EVIL.into(),
                capacity: 100,
                counted: 90,
                high_watermark: 0.85,
            }],
            damaged: vec![],
            drills: Some(DrillLines {
                versions: 3,
                failed: 1,
                overdue: 0,
            }),
            problems: 0,
            not_checked: vec![EVIL.into()],
        }
    }

    #[test]
    fn every_string_is_escaped() {
        let page = html(
            &report(),
            OffsetDateTime::UNIX_EPOCH,
            Duration::from_secs(7),
        );
        assert!(!page.contains("<script"), "{page}");
        assert!(!page.contains("alert('x')"), "{page}");
        assert!(
            page.contains("&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;&amp;&quot;"),
            "{page}"
        );
        assert!(page.contains("<meta http-equiv=\"refresh\" content=\"7\">"));
        let error = error_html(EVIL, OffsetDateTime::UNIX_EPOCH, Duration::from_secs(7));
        assert!(!error.contains("<script"), "{error}");
    }

    #[test]
    fn what_needs_a_person_comes_first_with_its_command_and_runbook() {
        let page = html(
            &report(),
            OffsetDateTime::UNIX_EPOCH,
            Duration::from_secs(10),
        );
        let at = |what: &str| page.find(what).unwrap_or_else(|| panic!("{what}: {page}"));
        assert!(at("id=\"needs-person\"") < at("id=\"tiers\""));
        assert!(at("id=\"tiers\"") < at("id=\"stages\""));
        assert!(at("id=\"stages\"") < at("id=\"drills\""));
        assert!(page.contains(
            "<code>stagehand stage status --project lab j</code></td><td><code>runbooks/stage-stuck.md</code>"
        ));
    }

    #[test]
    fn a_run_splits_into_command_and_runbook() {
        assert_eq!(
            command_and_runbook(
                "stagehand dlq list --service x (runbooks/dead-letters-waiting.md)"
            ),
            (
                "stagehand dlq list --service x",
                "runbooks/dead-letters-waiting.md"
            )
        );
        assert_eq!(
            command_and_runbook("runbooks/backlog-growing.md"),
            ("", "runbooks/backlog-growing.md")
        );
        assert_eq!(
            command_and_runbook("stagehand stage status --project lab j"),
            ("stagehand stage status --project lab j", "")
        );
    }
}
