//! A worker process for the runtime's crash tests.
//!
//! It handles `stage.requested` events by emitting one `stage.ready` fact each, and can stop
//! dead at a chosen step so that a test can kill it there with SIGKILL:
//!
//! - `--hang-in-handler`: print `HANDLING <id>` and never finish the handler;
//! - `--hang-after-record`: print `RECORDED <id>` once the outcome is committed, and never
//!   publish or ack.
//!
//! `--verdict STEP` names the fact's step (`ready` by default), so that two processes can be
//! told apart by what they would publish; `--instance ID` and `--claim-lifetime-ms N` set the
//! worker's instance id and claim lifetime.
//!
//! Otherwise it runs until SIGTERM / Ctrl-C. Usage:
//! `stagehand-bus-testworker --url URL --ledger PATH [--ack-wait-ms N] [--claim-lifetime-ms N]
//! [--instance ID] [--verdict STEP] [--hang-in-handler | --hang-after-record]`

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use stagehand_bus::{
    Bus, BusConfig, CancellationToken, Handler, HandlerError, Hook, WorkContext, WorkerConfig,
    WorkerHooks, run_worker_with_hooks,
};
use stagehand_schemas::{Body, Event, Location, StageReady, subject};

struct Ready {
    hang: bool,
    verdict: String,
}

impl Handler for Ready {
    async fn handle(&self, event: &Event, _ctx: &WorkContext) -> Result<Vec<Event>, HandlerError> {
        let Body::StageRequested(req) = &event.body else {
            return Err(HandlerError::permanent(format!(
                "unexpected kind {}",
                event.kind()
            )));
        };
        if self.hang {
            say(&format!("HANDLING {}", event.id));
            std::future::pending::<()>().await;
        }
        Ok(vec![event.caused(
            &self.verdict,
            Body::StageReady(StageReady {
                dataset: req.dataset.clone(),
                version: req.version.clone(),
                location: Location {
                    tier: req.tier.clone(),
                    prefix: stagehand_schemas::layout::version_folder(
                        &event.project,
                        &req.dataset,
                        &req.version,
                    ),
                },
                job_id: req.job_id.clone(),
                request_id: event.id.clone(),
                node: None,
                path: None,
            }),
        )])
    }
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut url = None;
    let mut ledger = None;
    let mut ack_wait = Duration::from_secs(2);
    let mut claim_lifetime = None;
    let mut instance = None;
    let mut verdict = "ready".to_owned();
    let (mut hang_handler, mut hang_record) = (false, false);
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--url" => url = args.next(),
            "--ledger" => ledger = args.next(),
            "--ack-wait-ms" => {
                ack_wait = Duration::from_millis(
                    args.next()
                        .context("--ack-wait-ms needs a value")?
                        .parse()?,
                )
            }
            "--claim-lifetime-ms" => {
                claim_lifetime = Some(Duration::from_millis(
                    args.next()
                        .context("--claim-lifetime-ms needs a value")?
                        .parse()?,
                ))
            }
            "--instance" => instance = Some(args.next().context("--instance needs a value")?),
            "--verdict" => verdict = args.next().context("--verdict needs a value")?,
            "--hang-in-handler" => hang_handler = true,
            "--hang-after-record" => hang_record = true,
            other => bail!("unknown argument {other:?}"),
        }
    }
    let url = url.context("--url is required")?;
    let ledger = ledger.context("--ledger is required")?;
    let bus = Bus::connect(&BusConfig::new(url)).await?;
    bus.provision().await?;
    let mut cfg = WorkerConfig::new(
        "testworker",
        subject::REQUESTS.name,
        vec![subject::kind_filter("req", "stage.requested")],
        ledger,
    );
    cfg.ack_wait = ack_wait;
    cfg.claim_lifetime = claim_lifetime;
    cfg.instance_id = instance;
    cfg.retry.initial = Duration::from_millis(100);
    cfg.retry.jitter = 0.0;
    let mut hooks = WorkerHooks::default();
    if hang_record {
        let hook: Hook = Arc::new(|id| {
            say(&format!("RECORDED {id}"));
            Box::pin(std::future::pending())
        });
        hooks.after_record = Some(hook);
    }
    let shutdown = CancellationToken::new();
    let stop = shutdown.clone();
    tokio::spawn(async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("installing a SIGTERM handler");
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        stop.cancel();
    });
    say("READY");
    let stats = run_worker_with_hooks(
        bus,
        cfg,
        Arc::new(Ready {
            hang: hang_handler,
            verdict,
        }),
        shutdown,
        hooks,
    )
    .await?;
    say(&format!(
        "STOPPED handled={} replayed={}",
        stats.handled, stats.replayed
    ));
    Ok(())
}
