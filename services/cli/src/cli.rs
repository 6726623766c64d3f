//! The command line: clap definitions and the dispatch to each command's module.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use stagehand_bus::{Bus, BusConfig};

use crate::ingest::{IngestOptions, Outcome};

/// Stagehand: datasets between the storage tiers of a GPU cluster, on NATS JetStream events,
/// with one catalogue.
#[derive(Debug, Parser)]
#[command(name = "stagehand", version, about)]
pub struct Cli {
    #[command(flatten)]
    pub connection: Connection,
    #[command(subcommand)]
    pub command: Command,
}

/// How every command reaches NATS: the same knobs, and the same environment variables, as the
/// `[bus]` table of the services (`STAGEHAND_NATS_*`).
#[derive(Debug, Clone, Args)]
pub struct Connection {
    /// NATS server URL(s), comma separated; `nats://user:password@host:4222` for password
    /// users (the password is never printed).
    #[arg(
        long,
        global = true,
        env = stagehand_bus::env::NATS_URL,
        default_value = "nats://127.0.0.1:4222",
        hide_env_values = true
    )]
    pub nats: String,
    /// A `.creds` file (user JWT and NKey seed).
    #[arg(long, global = true, env = stagehand_bus::env::NATS_CREDS)]
    pub creds: Option<PathBuf>,
    /// A file holding an NKey seed (`SU...`).
    #[arg(long, global = true, env = stagehand_bus::env::NATS_NKEY, conflicts_with = "creds")]
    pub nkey: Option<PathBuf>,
    /// A PEM bundle of CAs to trust for the servers' TLS certificates.
    #[arg(long, global = true, env = stagehand_bus::env::NATS_TLS_CA)]
    pub tls_ca: Option<PathBuf>,
    /// The subject prefix of reply inboxes (default `_INBOX_<user>` for a URL with a user):
    /// set it to the prefix your NATS user may read when it authenticates with creds or NKey.
    #[arg(long, global = true, env = "STAGEHAND_NATS_INBOX_PREFIX")]
    pub inbox_prefix: Option<String>,
}

impl Connection {
    /// The connection as a [`BusConfig`], giving up on the first connection after `timeout`.
    pub fn bus_config(&self, timeout: Duration) -> BusConfig {
        BusConfig {
            creds_file: self.creds.clone(),
            nkey_seed_file: self.nkey.clone(),
            tls_ca: self.tls_ca.clone(),
            inbox_prefix: self.inbox_prefix.clone(),
            connect_timeout: timeout,
            ..BusConfig::new(&self.nats)
        }
    }
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Place a folder on the source tier and ask for it to be validated and catalogued.
    Ingest(IngestArgs),
    /// Ask the catalogue.
    #[command(subcommand)]
    Catalogue(CatalogueCommand),
    /// Dead letters: list them, replay one.
    #[command(subcommand)]
    Dlq(DlqCommand),
    /// Training checkpoints: commit one (announce it to retention), list a run's.
    #[command(subcommand)]
    Checkpoint(crate::checkpoint::CheckpointCommand),
    /// Copy files between local folders and S3, verified (the mover).
    Cp(crate::cp::CpArgs),
    /// Run Stagehand on this machine: nats-server, policies, posix tiers and every service,
    /// until Ctrl-C.
    Up(UpArgs),
    /// Create Stagehand's streams, KV buckets and the services' manifest bucket, or correct
    /// their drift (replicas, limits): what an operator runs once for services whose users may
    /// not manage streams, and again for each new project (`--project`).
    Provision {
        /// Replicas of every stream and bucket (default: what the cluster can hold).
        #[arg(long)]
        replicas: Option<usize>,
        /// Also the upload bucket of this project (`stagehand_uploads_<project>`), in which its
        /// uploaders put manifests: their NATS users may not create it. Repeatable.
        #[arg(long = "project", value_name = "PROJECT")]
        projects: Vec<String>,
    },
}

#[derive(Debug, Args)]
pub struct IngestArgs {
    /// The folder to ingest.
    pub folder: PathBuf,
    /// Project (tenant) the dataset belongs to: [a-z0-9_-].
    #[arg(long, env = "STAGEHAND_PROJECT")]
    pub project: String,
    /// Dataset name.
    #[arg(long)]
    pub dataset: String,
    /// The tier to place the files on (declared in the policies).
    #[arg(long, default_value = "source")]
    pub tier: String,
    /// Policy folder; default `$STAGEHAND_HOME/policies` (`./.stagehand/policies`).
    #[arg(long)]
    pub policies: Option<PathBuf>,
    /// Who is uploading; default `$USER`.
    #[arg(long)]
    pub by: Option<String>,
    /// A label `key=value` (repeatable).
    #[arg(long = "label", value_parser = parse_label)]
    pub labels: Vec<(String, String)>,
    /// Declare the manifest (`path<TAB>size<TAB>sha256` lines) instead of measuring it.
    #[arg(long)]
    pub manifest: Option<PathBuf>,
    /// Wait for the validator's answer and print it; exit 1 when rejected.
    #[arg(long)]
    pub wait: bool,
    /// How long `--wait` waits, in seconds.
    #[arg(long, default_value_t = 300)]
    pub timeout: u64,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

fn parse_label(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| format!("label {s:?} must be key=value"))
}

#[derive(Debug, Subcommand)]
pub enum CatalogueCommand {
    /// Datasets (of a project), a page at a time.
    Datasets {
        #[arg(long)]
        project: Option<String>,
        /// Datasets per page.
        #[arg(long, default_value_t = 100)]
        limit: u32,
        /// Datasets after this cursor (`<project>/<dataset>`, printed at the end of a page).
        #[arg(long)]
        after: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// A dataset (`D`: versions, replicas, states, rejections) or a version (`D@VERSION`: its
    /// replicas and a page of its files; VERSION may be a unique prefix of 8 or more
    /// characters).
    Show {
        target: String,
        /// Needed only when several projects have a dataset of that name.
        #[arg(long)]
        project: Option<String>,
        /// Files per page (`D@V`), or versions and rejections listed (`D`).
        #[arg(long, default_value_t = 100)]
        limit: u32,
        /// Files after this path (`D@V`).
        #[arg(long)]
        after: Option<String>,
        /// Only this file's entry (`D@V`).
        #[arg(long)]
        path: Option<String>,
        /// JSON; for `D@V`, one line per file for the whole version (after `--after`).
        #[arg(long)]
        json: bool,
    },
    /// Dead letters counted per service.
    DeadLetters {
        #[arg(long)]
        json: bool,
    },
    /// Facts the catalogue could not fold (a manifest gone or damaged, a fact that contradicts
    /// itself), a page at a time.
    Problems {
        #[arg(long, default_value_t = 100)]
        limit: u32,
        /// Problems after this event id.
        #[arg(long)]
        after: Option<String>,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum DlqCommand {
    /// List dead letters, oldest first.
    List {
        /// Only this service's dead letters.
        #[arg(long)]
        service: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Republish the message a dead letter carries to its original subject.
    Replay {
        /// The dead letter's sequence (from `dlq list`).
        sequence: u64,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Args)]
pub struct UpArgs {
    /// Where data, tiers, policies and state live.
    #[arg(long, env = "STAGEHAND_HOME", default_value = ".stagehand")]
    pub home: PathBuf,
    /// Port of the nats-server `up` starts (ignored with --external-nats).
    #[arg(long, default_value_t = 4222)]
    pub port: u16,
    /// Use the server at --nats instead of starting one.
    #[arg(long)]
    pub external_nats: bool,
    /// Policy folder (default: `<home>/policies`, written with the defaults when missing).
    #[arg(long)]
    pub policies: Option<PathBuf>,
}

fn default_policies() -> PathBuf {
    stagehand_policy::stagehand_home().join("policies")
}

pub(crate) async fn connect(connection: &Connection) -> anyhow::Result<Bus> {
    let cfg = connection.bus_config(Duration::from_secs(5));
    Bus::connect(&cfg).await.with_context(|| {
        format!(
            "connecting to NATS at {} (is `stagehand up` running?)",
            cfg.servers_display()
        )
    })
}

/// Runs a parsed command; returns the exit code.
pub async fn run(cli: Cli) -> anyhow::Result<i32> {
    match cli.command {
        Command::Up(args) => {
            let _telemetry = stagehand_telemetry::init("stagehand")?;
            crate::up::run(crate::up::UpOptions {
                home: args.home,
                nats: args
                    .external_nats
                    .then(|| cli.connection.bus_config(Duration::from_secs(20))),
                port: args.port,
                policies: args.policies,
            })
            .await?;
            Ok(0)
        }
        Command::Checkpoint(cmd) => {
            quiet_logs();
            crate::checkpoint::run(&cli.connection, cmd).await
        }
        Command::Cp(args) => {
            quiet_logs();
            Ok(crate::cp::run(&args).await?.exit_code())
        }
        Command::Ingest(args) => {
            quiet_logs();
            let bus = connect(&cli.connection).await?;
            let opts = IngestOptions {
                folder: args.folder,
                project: args.project,
                dataset: args.dataset,
                tier: args.tier,
                policies: args.policies.unwrap_or_else(default_policies),
                requested_by: args
                    .by
                    .or_else(|| std::env::var("USER").ok())
                    .unwrap_or_else(|| "unknown".into()),
                labels: args.labels,
                manifest: args.manifest,
                wait: args.wait.then(|| Duration::from_secs(args.timeout)),
                progress: std::io::stderr().is_terminal(),
            };
            let report = crate::ingest::ingest(&bus, &opts).await?;
            let rejected = matches!(report.outcome, Some(Outcome::Rejected(_)));
            if args.json {
                let outcome = match &report.outcome {
                    Some(Outcome::Validated(v)) => serde_json::json!({"validated": v}),
                    Some(Outcome::Rejected(r)) => serde_json::json!({"rejected": r}),
                    None => serde_json::Value::Null,
                };
                let out = serde_json::json!({
                    "request_id": report.request.id,
                    "prefix": report.placed.prefix,
                    "files": report.placed.files.len(),
                    "duplicate": !report.published_new,
                    "outcome": outcome,
                });
                println!("{}", serde_json::to_string_pretty(&out)?);
            } else {
                println!("{}", report.request.id);
                eprintln!(
                    "placed {} files under {} on tier {}{}",
                    report.placed.files.len(),
                    report.placed.prefix,
                    opts.tier,
                    if report.published_new {
                        ""
                    } else {
                        " (same request as an earlier run)"
                    }
                );
                if let Some(outcome) = &report.outcome {
                    print!("{}", crate::ingest::outcome_text(outcome));
                }
            }
            Ok(i32::from(rejected))
        }
        Command::Catalogue(cmd) => {
            quiet_logs();
            let bus = connect(&cli.connection).await?;
            let catalogue = stagehand_catalogue::Catalogue::new(bus.client().clone())
                .with_timeout(crate::catalogue::TIMEOUT);
            let stdout = std::io::stdout();
            let mut out = std::io::BufWriter::new(stdout.lock());
            match cmd {
                CatalogueCommand::Datasets {
                    project,
                    limit,
                    after,
                    json,
                } => {
                    crate::catalogue::datasets(
                        &catalogue,
                        project.as_deref(),
                        Some(limit),
                        after.as_deref(),
                        json,
                        &mut out,
                    )
                    .await?
                }
                CatalogueCommand::Show {
                    target,
                    project,
                    limit,
                    after,
                    path,
                    json,
                } => {
                    let opts = crate::catalogue::ShowOptions {
                        project,
                        limit: Some(limit),
                        after,
                        path,
                        json,
                    };
                    crate::catalogue::show(&catalogue, &target, &opts, &mut out).await?
                }
                CatalogueCommand::DeadLetters { json } => {
                    crate::catalogue::dead_letters(&catalogue, json, &mut out).await?
                }
                CatalogueCommand::Problems { limit, after, json } => {
                    crate::catalogue::problems(
                        &catalogue,
                        Some(limit),
                        after.as_deref(),
                        json,
                        &mut out,
                    )
                    .await?
                }
            }
            std::io::Write::flush(&mut out)?;
            Ok(0)
        }
        Command::Provision { replicas, projects } => {
            quiet_logs();
            for project in &projects {
                if !stagehand_schemas::subject::is_subject_token(project) {
                    anyhow::bail!("project {project:?} must be 1-64 characters of [a-z0-9_-]");
                }
            }
            let mut cfg = cli.connection.bus_config(Duration::from_secs(5));
            cfg.replicas = replicas;
            let bus = Bus::connect(&cfg)
                .await
                .with_context(|| format!("connecting to NATS at {}", cfg.servers_display()))?;
            bus.provision().await?;
            // The buckets of one service each (the promoter's reservations and leases).
            for spec in stagehand_bus::SERVICE_KV_BUCKETS {
                bus.provision_kv(spec).await?;
            }
            let mut objects: Vec<String> = stagehand_bus::OBJECT_BUCKETS
                .iter()
                .map(|b| b.bucket.to_string())
                .collect();
            for project in &projects {
                let spec = stagehand_schemas::subject::upload_bucket_spec(project);
                bus.provision_object_bucket(&spec).await?;
                objects.push(spec.bucket.to_string());
            }
            let streams: Vec<&str> = stagehand_schemas::subject::STREAMS
                .iter()
                .map(|s| s.name)
                .collect();
            let buckets: Vec<&str> = stagehand_bus::KV_BUCKETS
                .iter()
                .chain(stagehand_bus::SERVICE_KV_BUCKETS)
                .map(|b| b.bucket)
                .collect();
            println!(
                "provisioned streams {}, KV buckets {} and Object Store buckets {} with {} \
                 replica(s) on {}",
                streams.join(", "),
                buckets.join(", "),
                objects.join(", "),
                bus.replicas(),
                bus.servers()
            );
            Ok(0)
        }
        Command::Dlq(cmd) => {
            quiet_logs();
            let bus = connect(&cli.connection).await?;
            match cmd {
                DlqCommand::List { service, json } => {
                    let items = crate::dlq::list(&bus, service.as_deref()).await?;
                    if json {
                        println!("{}", serde_json::to_string_pretty(&items)?);
                    } else {
                        print!("{}", crate::dlq::list_text(&items));
                    }
                }
                DlqCommand::Replay { sequence, json } => {
                    let r = crate::dlq::replay(&bus, sequence).await?;
                    if json {
                        println!("{}", serde_json::to_string_pretty(&r)?);
                    } else {
                        println!(
                            "replayed dead letter {} to {} as {} ({} sequence {})",
                            r.sequence, r.subject, r.msg_id, r.stream, r.stream_sequence
                        );
                    }
                }
            }
            Ok(0)
        }
    }
}

/// Warnings and errors only, on stderr: a command's stdout is its answer.
fn quiet_logs() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour codes only for a person at a terminal, not in a plugin's captured output.
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
}
