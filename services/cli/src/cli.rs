//! The command line: clap definitions and the dispatch to each command's module.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};
use stagehand_bus::{Bus, BusConfig};
use stagehand_telemetry::names;
use stagehand_telemetry::propagation::has_span;
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::args::{self, UsageError};
use crate::ingest::{IngestOptions, Outcome};
use crate::stage::{RequestOptions, Stage, StatusFilter};

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
    /// A file holding the password of the user `--nats` names without one
    /// (`nats://scheduler@host:4222`): no password on the command line or in the environment.
    /// Refused when group or others may read it.
    #[arg(
        long,
        global = true,
        env = stagehand_bus::env::NATS_PASSWORD_FILE,
        conflicts_with_all = ["creds", "nkey"]
    )]
    pub password_file: Option<PathBuf>,
    /// A PEM bundle of CAs to trust for the servers' TLS certificates.
    #[arg(long, global = true, env = stagehand_bus::env::NATS_TLS_CA)]
    pub tls_ca: Option<PathBuf>,
    /// The subject prefix of reply inboxes (default `_INBOX_<user>` for a URL with a user):
    /// set it to the prefix your NATS user may read when it authenticates with creds or NKey.
    #[arg(long, global = true, env = "STAGEHAND_NATS_INBOX_PREFIX")]
    pub inbox_prefix: Option<String>,
    /// How long a command keeps trying to reach NATS before it gives up with one line (exit
    /// 69): 500ms, 10s, 1m.
    #[arg(long, global = true, default_value = "10s", value_parser = parse_connect_timeout)]
    pub connect_timeout: Duration,
    /// How long a command keeps trying to store what it publishes (a request, a release, a
    /// commit) while the stream cannot answer — a JetStream leader being elected after a node
    /// was lost — before it gives up with one line (exit 69): 500ms, 10s, 1m. `ingest --wait`
    /// tries for as long as its --timeout leaves.
    #[arg(long, global = true, default_value = "60s", value_parser = parse_publish_timeout)]
    pub publish_timeout: Duration,
}

fn parse_publish_timeout(s: &str) -> Result<Duration, String> {
    args::duration("--publish-timeout", s).map_err(|e| e.0)
}

fn parse_connect_timeout(s: &str) -> Result<Duration, String> {
    args::duration("--connect-timeout", s).map_err(|e| e.0)
}

fn parse_ingest_timeout(s: &str) -> Result<Duration, String> {
    args::duration("--timeout", s).map_err(|e| e.0)
}

impl Connection {
    /// The connection as a [`BusConfig`], giving up on the first connection after `timeout`.
    pub fn bus_config(&self, timeout: Duration) -> BusConfig {
        BusConfig {
            creds_file: self.creds.clone(),
            nkey_seed_file: self.nkey.clone(),
            password_file: self.password_file.clone(),
            tls_ca: self.tls_ca.clone(),
            inbox_prefix: self.inbox_prefix.clone(),
            connect_timeout: timeout,
            publish_timeout: self.publish_timeout,
            ..BusConfig::new(&self.nats)
        }
    }
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Place a folder on the source tier (or register data already on a source tier) and ask
    /// for it to be validated and catalogued.
    Ingest(IngestArgs),
    /// Ask the catalogue.
    #[command(subcommand)]
    Catalogue(CatalogueCommand),
    /// Backups: what is protected, and what the restore drills found.
    #[command(subcommand)]
    Backup(BackupCommand),
    /// Restore a version from its backup onto a tier, verified, and record it there.
    Restore(RestoreArgs),
    /// Dead letters: list them, replay one.
    #[command(subcommand)]
    Dlq(DlqCommand),
    /// The tiers: how full the bounded ones are.
    #[command(subcommand)]
    Tier(TierCommand),
    /// Kubernetes: the controller removing Stagehand's pod scheduling gates.
    #[command(subcommand)]
    K8s(K8sCommand),
    /// The scrub: how much of each tier was read back and verified within its period, and
    /// the damage found.
    #[command(subcommand)]
    Scrub(ScrubCommand),
    /// Stray and lost data on one tier, per project: what is on storage beneath the tier's
    /// project folders compared with the catalogue, read before and after the listing so a
    /// copy in flight is never counted stray. Stray: folders and files no replica claims and
    /// no pending stage or young staging folder explains (never deleted; with --quarantine,
    /// renamed into `<root>/.stagehand-quarantine/<date>/` once untouched for scrub.toml's
    /// `[audit] quarantine_after`, on a posix tier). Lost: replicas catalogued present whose
    /// folder is absent; each is announced with `replica.damaged` (found_by `audit`), which
    /// withdraws its readiness. With --json, one JSON object: `tier`, `node`, `window` (the
    /// facts stream's last sequence at each reading), `catalogued_bytes`, `stray_bytes`,
    /// `in_flight`, `stopped`, `stray` (each `project`, `path`, `kind`, `files`, `bytes`,
    /// `modified`, `quarantined_to`) and `lost` (each `project`, `dataset`, `version`,
    /// `prefix`, `node`, `damaged_fact`). Exit 0 when nothing is stray or lost, 1 when
    /// something is, 2 when stray bytes exceed `[audit] stop_above_fraction` of the tier's
    /// catalogued bytes (nothing quarantined: a person must look).
    Audit(AuditArgs),
    /// One view for on-call: services alive (heartbeats), consumers' backlog, stages pending
    /// or failed across projects, dead letters waiting, tiers above their high watermark,
    /// quotas above 90 %, damaged copies, failed or overdue restore drills, catalogue
    /// problems. Each thing that needs a person names what to run. Exit 0 when nothing does,
    /// 1 when something does. With --serve ADDR, the same view as a read-only web page.
    Status(StatusArgs),
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
    ///
    /// Per-tenant bounds (schemas/README.md): every request subject
    /// `stagehand.req.<kind>.<project>` keeps at most 250,000 requests and refuses the next
    /// (`max_msgs_per_subject`, discard new per subject); every project's upload bucket holds
    /// at most 4 GiB of manifests and refuses a put past it.
    Provision {
        /// Replicas of every stream and bucket (default: what the cluster can hold).
        #[arg(long)]
        replicas: Option<usize>,
        /// Also the upload bucket of this project (`stagehand_uploads_<project>`, at most 4 GiB),
        /// in which its uploaders put manifests: their NATS users may not create it. Repeatable.
        #[arg(long = "project", value_name = "PROJECT")]
        projects: Vec<String>,
    },
    /// Policies: check a folder of policy files before the services are started with it.
    #[command(subcommand)]
    Policy(PolicyCommand),
    /// The NATS accounts config (`deploy/nats/accounts.conf`): users for new nodes.
    #[command(subcommand)]
    Accounts(AccountsCommand),
    /// Get a dataset version onto a tier for a job, wait for it, see why it waits, release it:
    /// what scheduler plugins call. Exit codes: 0 done (wait: ready), 1 failed, 2 timed out,
    /// 64 bad argument, 69 NATS unreachable, 70 other error.
    #[command(subcommand)]
    Stage(StageCommand),
    /// Write the man pages and shell completions generated from this command line's own
    /// definition under DIR (`deploy/package.sh` ships them).
    #[command(hide = true)]
    GenerateDocs {
        /// Where to write `man/man1/*.1` and `completions/`.
        #[arg(long)]
        out: PathBuf,
    },
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    /// The policy folder, for the tiers' watermarks, quotas and damaged copies and the restore
    /// drills' interval (default: Stagehand's home's `policies`, when it exists; without one,
    /// those are not checked).
    #[arg(long)]
    pub policies: Option<PathBuf>,
    /// A service whose heartbeat is older than this is silent: 30s, 1m.
    #[arg(long, default_value = "1m", value_parser = parse_status_duration)]
    pub silent_after: Duration,
    /// A consumer whose oldest unacknowledged message is older than this is stuck.
    #[arg(long, default_value = "10m", value_parser = parse_status_duration)]
    pub backlog_after: Duration,
    /// A stage request pending unchanged for longer than this is stuck.
    #[arg(long, default_value = "30m", value_parser = parse_status_duration)]
    pub stuck_after: Duration,
    /// One JSON object (its shape: `stagehand_cli::status::Report`, in the CLI docs); with
    /// --actions, one JSON array of `stagehand_catalogue::OperatorActionRecord`, newest first.
    #[arg(long)]
    pub json: bool,
    /// List every operator action instead (stage cancels, dead letters discarded or
    /// replayed): who, what, on what, when and why, newest first. Exit 0.
    #[arg(long, conflicts_with = "serve")]
    pub actions: bool,
    /// Serve the same view, read-only, on ADDR (`127.0.0.1:8090`; port 0 picks a free one)
    /// until Ctrl-C or SIGTERM: `GET /` one HTML page that reloads itself (what needs a person
    /// first, each with its command and runbook page, then tiers, stages, restore drills),
    /// `GET /status.json` the JSON object. Prints the page's URL once it listens. Exit 0.
    #[arg(long, value_name = "ADDR", conflicts_with = "json")]
    pub serve: Option<std::net::SocketAddr>,
    /// With --serve: how often the page reloads itself.
    #[arg(long, default_value = "10s", value_parser = parse_status_duration, requires = "serve")]
    pub refresh: Duration,
}

fn parse_status_duration(s: &str) -> Result<Duration, String> {
    args::duration("duration", s).map_err(|e| e.0)
}

#[derive(Debug, Subcommand)]
pub enum StageCommand {
    /// Ask for DATASET@VERSION on a tier for a job; prints the request id once the server
    /// stored the request. The id follows from the arguments, so asking again is the same
    /// request.
    Request(StageRequestArgs),
    /// Wait for a requested stage: exit 0 when ready (prints the path), 1 when failed (prints
    /// the reason), 2 when the timeout passes first (prints the last state and reason).
    Wait(StageWaitArgs),
    /// What is pending, copying, ready or failed, and why: every stage of a job (`J`), of a
    /// dataset version (`D@V`), or of the project.
    Status(StageStatusArgs),
    /// The job no longer needs the staged data; prints the release id once stored.
    Release(StageReleaseArgs),
    /// The operator stops a stage: a pending or copying one fails with `cancelled by <who>:
    /// <reason>` (its copy stopped unless another job waits for the version, its space and
    /// quota given back), a ready one is released. Recorded as an
    /// operator action (`stagehand status --actions`). Needs Stagehand's operator user; a
    /// project ends its own jobs' stages with `stage release`, which its scheduler user may
    /// publish for that project alone.
    Cancel(StageCancelArgs),
    /// Release the stages still held whose job the scheduler no longer runs (a teardown that
    /// never ran): asks Slurm (`squeue`, then `sacct`) or Kubernetes (the pods) about the jobs
    /// of held stages; prints one line per stage released. A scheduler that cannot be asked
    /// releases nothing (exit 69). Run it periodically (`deploy/systemd`).
    Reconcile(StageReconcileArgs),
    /// Which nodes hold a usable (complete, verified, not damaged) copy of DATASET@VERSION on a
    /// node-local tier: one line per node with its tier, bytes and last verification, then
    /// the nodes whose copy is damaged or being repaired, as not usable. Exit 0 when a node
    /// holds one, 3 when none does (or the project has no such version).
    Where(StageWhereArgs),
}

#[derive(Debug, Args)]
pub struct StageWhereArgs {
    /// DATASET@VERSION; VERSION is a digest or a unique prefix of 12 or more hex characters.
    pub target: String,
    /// The project whose version it is: [a-z0-9_-].
    #[arg(long, env = "STAGEHAND_PROJECT")]
    pub project: Option<String>,
    /// Only this node-local tier; default every one.
    #[arg(long)]
    pub tier: Option<String>,
    /// One JSON object: `{project, dataset, version, nodes: [...], unusable: [...]}`
    /// (`stagehand::stage::Whereabouts`).
    #[arg(long, conflicts_with = "hostlist")]
    pub json: bool,
    /// Only the nodes holding a usable copy, comma separated (nothing when none does): what
    /// Slurm's `--nodelist`/`--exclude` and a Kubernetes node affinity take.
    #[arg(long)]
    pub hostlist: bool,
}

#[derive(Debug, Args)]
pub struct StageReconcileArgs {
    /// Whose jobs the stages are.
    #[arg(long, value_parser = ["slurm", "kubernetes"])]
    pub scheduler: String,
    /// Slurm: the prefix the hooks give Slurm job ids (`STAGEHAND_JOB_PREFIX` of
    /// `stagehand-slurm.conf`); stages of other job ids are left alone.
    #[arg(long, env = "STAGEHAND_JOB_PREFIX", default_value = "slurm-")]
    pub job_prefix: String,
    /// Only the stages of this project (repeatable); default every project.
    #[arg(long = "project", value_name = "PROJECT")]
    pub projects: Vec<String>,
    /// Say which stages would be released, and release none.
    #[arg(long)]
    pub dry_run: bool,
    /// Print the stages released as JSON.
    #[arg(long)]
    pub json: bool,
}

/// Which stage: the arguments its request id is derived from.
#[derive(Debug, Args)]
pub struct StageTargetArgs {
    /// DATASET@VERSION; VERSION is a digest or a unique prefix of 12 or more hex characters.
    pub target: String,
    #[command(flatten)]
    pub place: StagePlaceArgs,
}

#[derive(Debug, Args)]
pub struct StageRequestArgs {
    #[command(flatten)]
    pub stage: StageTargetArgs,
    /// When the job stops waiting: a duration from now (30m, 2h) or an RFC 3339 time; default
    /// the promotion policy's.
    #[arg(long)]
    pub deadline: Option<String>,
    /// When the job's hold on the data ends at the latest if it is never released (a lost
    /// job, a teardown that failed): a duration from now — the job's time limit plus the time
    /// it may still queue — or an RFC 3339 time. Default: held until released.
    #[arg(long)]
    pub hold_until: Option<String>,
    /// Which form of the dataset.
    #[arg(long, value_parser = ["raw", "prepared"])]
    pub form: Option<String>,
    /// Who asks; default `$USER`.
    #[arg(long)]
    pub by: Option<String>,
    /// The bytes the job declared for this version (a Slurm job's `capacity=`): the request is
    /// refused, and nothing published, when the catalogue says the version is larger.
    #[arg(long, value_name = "BYTES")]
    pub declared_size: Option<u64>,
    /// Print the request id, stream sequence and whether it was a duplicate as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct StageWaitArgs {
    #[command(flatten)]
    pub stage: StageTargetArgs,
    /// How long to wait (90, 90s, 30m, 1h); 0 looks once.
    #[arg(long, default_value = "1h")]
    pub timeout: String,
    /// Print the stage's status as JSON (null when none was recorded yet).
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct StageStatusArgs {
    /// A job id, or DATASET@VERSION; default every stage of the project.
    pub target: Option<String>,
    /// The project whose stages to list: [a-z0-9_-].
    #[arg(long, env = "STAGEHAND_PROJECT")]
    pub project: Option<String>,
    /// One JSON array of the stages' statuses (`stagehand_catalogue::StageStatus`).
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct StageCancelArgs {
    #[command(flatten)]
    pub stage: StageTargetArgs,
    /// Why (required): waiters see `cancelled by <who>: <why>`, and the operator action
    /// records it.
    #[arg(long)]
    pub reason: String,
    /// One JSON object (`stagehand::stage::Cancelled`).
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct StageReleaseArgs {
    #[command(flatten)]
    pub stage: StageTargetArgs,
    /// One JSON object: the release's id, stream, sequence and whether it was a duplicate.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum K8sCommand {
    /// Removes the scheduling gate `stagehand.io/<dataset>` of each pod labelled
    /// `stagehand.io/gated=true` once the stage it names is ready (asking for the stage first),
    /// writing the path into the annotation `stagehand.io/path.<dataset>`; a failed stage keeps
    /// the gate and its reason goes into `stagehand.io/stage-failed` (deploy/k8s/README.md).
    Gates {
        /// Only this namespace (a Role there suffices); default every namespace.
        #[arg(long)]
        namespace: Option<String>,
        /// Time between two passes over the gated pods.
        #[arg(long, default_value = "5s")]
        every: String,
        /// One pass, then exit.
        #[arg(long)]
        once: bool,
        /// The API server (`https://host:port`, or `http://` through a local proxy); default
        /// the cluster this runs in, with its service account's token and CA.
        #[arg(long)]
        api_server: Option<String>,
        /// A file holding the bearer token for --api-server.
        #[arg(long)]
        token_file: Option<PathBuf>,
        /// The CA bundle of an https --api-server.
        #[arg(long)]
        api_ca: Option<PathBuf>,
        /// Who asks for the stages; default `$USER`.
        #[arg(long)]
        by: Option<String>,
    },
}

#[derive(Debug, Subcommand)]
pub enum TierCommand {
    /// Per hot and local tier: capacity, bytes used by Stagehand and by others, watermarks,
    /// bytes live stages hold, and each project's share.
    Usage {
        /// Only this tier.
        tier: Option<String>,
        /// Policy folder; default `$STAGEHAND_HOME/policies` (`./.stagehand/policies`).
        #[arg(long)]
        policies: Option<PathBuf>,
        /// One JSON array of the tiers' rows.
        #[arg(long)]
        json: bool,
    },
    /// Writes the tiers' figures as Slurm burst-buffer pools for `burst_buffer.lua`'s
    /// `slurm_bb_pools` (deploy/slurm/README.md, "Pools"): per tier its capacity and its free
    /// space, what the promoter would still reserve for a copy: the capacity less every replica
    /// reserved on the tier, held by a live stage or not (an unheld one stays until the demoter
    /// removes it above the high watermark), and no more than the tier's filesystem can still
    /// take (statvfs of its root: others' files count) when this host mounts it; where the
    /// root does not open here (a controller that does not mount the tier), the first figure
    /// alone. Each project's quota on the tier and what it has reserved there follow, from
    /// which the hook reports the project's share as pool `<tier>.<project>`. Written whole (a
    /// temporary file renamed), readable by all; run it every few seconds (a timer).
    Pool {
        /// The tiers to report (each a bounded tier of the policies).
        #[arg(required = true)]
        tiers: Vec<String>,
        /// Policy folder; default `$STAGEHAND_HOME/policies` (`./.stagehand/policies`).
        #[arg(long)]
        policies: Option<PathBuf>,
        /// The file to write (stagehand-slurm.conf's STAGEHAND_POOL_FILE).
        #[arg(long, value_name = "FILE")]
        slurm: PathBuf,
        /// Print one JSON array of the pools (with `fs_available`, the filesystem's figure,
        /// null where this host cannot measure it) instead of a line per tier.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Args)]
pub struct IngestArgs {
    /// What to ingest: a local folder (copied onto --tier), a folder already beneath a posix
    /// source tier's root, or `s3://bucket/prefix` inside an s3 source tier (both registered
    /// where they are, without a copy; the prefix must be beneath the project's own).
    pub source: String,
    /// Project (tenant) the dataset belongs to: [a-z0-9_-].
    #[arg(long, env = "STAGEHAND_PROJECT")]
    pub project: String,
    /// Dataset name.
    #[arg(long)]
    pub dataset: String,
    /// The posix tier a local folder is copied onto (declared in the policies).
    #[arg(long, default_value = "source")]
    pub tier: String,
    /// Insist that the folder is already beneath a posix source tier's root and register it
    /// there (such a folder is detected without it too).
    #[arg(long)]
    pub in_place: bool,
    /// Policy folder; default `$STAGEHAND_HOME/policies` (`./.stagehand/policies`).
    #[arg(long)]
    pub policies: Option<PathBuf>,
    /// Who is uploading; default `$USER`.
    #[arg(long)]
    pub by: Option<String>,
    /// A label `key=value` (repeatable).
    #[arg(long = "label", value_parser = parse_label)]
    pub labels: Vec<(String, String)>,
    /// Declare the manifest (`path<TAB>size<TAB>sha256` lines, any order, any size) instead
    /// of measuring it; the validator judges it against the files. A copied folder is still
    /// placed under the prefix its measured digest names.
    #[arg(long)]
    pub manifest: Option<PathBuf>,
    /// Wait for the validator's answer and print it; exit 1 when rejected.
    #[arg(long)]
    pub wait: bool,
    /// How long `--wait` waits: a duration such as 5m or 1h; a bare number is seconds.
    #[arg(long, default_value = "5m", value_parser = parse_ingest_timeout)]
    pub timeout: Duration,
    /// How many milliseconds the validator's clock may lag this machine's: with `--wait`, a
    /// rejection older than this run's request by more than that is an earlier run's recorded
    /// answer, and the request is asked again as its next attempt.
    #[arg(long, default_value_t = crate::ingest::CLOCK_SKEW.as_millis() as u64)]
    pub clock_skew_ms: u64,
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
        /// One JSON object: `{"datasets": [...], "next": cursor or null}`.
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
        /// JSON. `D`: one object (the dataset). `D@V`: one JSON line per file of the whole
        /// version (after `--after`), streamed, so that a version of millions of files never
        /// sits in memory. `D@V --path`: one object (`{"version", "file"}`).
        #[arg(long)]
        json: bool,
        /// Where the versions come from: each raw version, the versions prepared from it, and
        /// their replicas per tier (`D`: every raw version, `--after` a raw version's digest;
        /// `D@V`: the lineage of that version).
        #[arg(long, conflicts_with = "path")]
        lineage: bool,
    },
    /// Dead letters counted per service.
    DeadLetters {
        /// One JSON object: `{"services": [...], "next": cursor or null}`.
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
        /// One JSON object: `{"problems": [...], "total", "next": cursor or null}`.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Args)]
pub struct AuditArgs {
    /// The tier to audit (a name in tiers.toml).
    pub tier: String,
    /// On a node-local tier: the node whose copies this machine sees at the tier's root.
    #[arg(long)]
    pub node: Option<String>,
    /// Rename stray entries untouched for `[audit] quarantine_after` into the tier's
    /// quarantine folder (posix tiers; never a deletion).
    #[arg(long)]
    pub quarantine: bool,
    /// Policy folder; default `$STAGEHAND_HOME/policies` (`./.stagehand/policies`).
    #[arg(long)]
    pub policies: Option<PathBuf>,
    /// Print the report as one JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Subcommand)]
pub enum ScrubCommand {
    /// Per tier `scrub.toml` names: coverage (bytes verified within the tier's period / bytes
    /// catalogued), rate, the copy longest unverified, the damaged copies. Exit 1 while a copy
    /// is damaged and not repaired.
    Status {
        /// Policy folder; default `$STAGEHAND_HOME/policies` (`./.stagehand/policies`).
        #[arg(long)]
        policies: Option<PathBuf>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum BackupCommand {
    /// Per version: protected or not, last backup, last drill and its result. Versions nothing
    /// protects, never drilled, or whose last drill failed are flagged.
    Status {
        #[arg(long)]
        project: Option<String>,
        /// Only copies on this backup tier count.
        #[arg(long)]
        tier: Option<String>,
        /// Show only flagged versions.
        #[arg(long)]
        flagged: bool,
        /// Exit 1 when any version is flagged.
        #[arg(long)]
        check: bool,
        /// One JSON line per version.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Args)]
pub struct RestoreArgs {
    /// `DATASET@VERSION` (a unique prefix of 8 or more characters of the digest).
    pub target: String,
    /// The tier to restore onto (declared in the policies; not a backup tier).
    #[arg(long)]
    pub to: String,
    /// Needed only when several projects have a dataset of that name.
    #[arg(long)]
    pub project: Option<String>,
    /// Policy folder; default `$STAGEHAND_HOME/policies` (`./.stagehand/policies`).
    #[arg(long)]
    pub policies: Option<PathBuf>,
    /// One JSON object: the restore's report.
    #[arg(long)]
    pub json: bool,
}

impl RestoreArgs {
    /// The request, checked before anything connects.
    /// The restore asked for, its arguments checked before anything connects.
    fn request(&self) -> Result<stagehand_backup_copier::RestoreRequest, UsageError> {
        let (dataset, version) = crate::catalogue::parse_target(&self.target);
        let Some(version) = version else {
            return Err(UsageError(format!(
                "restore needs DATASET@VERSION, got {:?}",
                self.target
            )));
        };
        if args::query_version(&version.to_ascii_lowercase()).is_err() {
            return Err(UsageError(format!(
                "version {version:?} must be {} or more hex characters of the digest",
                stagehand_schemas::layout::MIN_QUERY_VERSION_PREFIX
            )));
        }
        args::dataset("DATASET", &dataset)?;
        if let Some(project) = &self.project {
            args::project("--project", project)?;
        }
        Ok(stagehand_backup_copier::RestoreRequest {
            project: self.project.clone(),
            dataset,
            version: version.to_ascii_lowercase(),
            to: self.to.clone(),
        })
    }
}

#[derive(Debug, Subcommand)]
pub enum DlqCommand {
    /// List dead letters, oldest first.
    List {
        /// Only this service's dead letters.
        #[arg(long)]
        service: Option<String>,
        /// One JSON array of the dead letters (`stagehand::dlq::Listed`), oldest first.
        #[arg(long)]
        json: bool,
    },
    /// Republish the message a dead letter carries to its original subject: one (SEQ), or
    /// every dead letter of a service that came since a time and still waits (--service S
    /// --since T; never replayed, never discarded). A discarded dead letter is never replayed.
    /// Each replay is recorded as an operator action (`stagehand status --actions`).
    Replay {
        /// The dead letter's sequence (from `dlq list`).
        #[arg(
            required_unless_present = "service",
            conflicts_with_all = ["service", "since", "dry_run"]
        )]
        sequence: Option<u64>,
        /// Replay every waiting dead letter of this service (with --since).
        #[arg(long, requires = "since")]
        service: Option<String>,
        /// Only dead letters that came at or after this time: RFC 3339
        /// (`2026-12-01T08:00:00Z`) or a duration ago (`2h`, `30m`).
        #[arg(long, requires = "service", value_parser = parse_since)]
        since: Option<time::OffsetDateTime>,
        /// List what would be replayed; replay nothing.
        #[arg(long)]
        dry_run: bool,
        /// Why, recorded with each replay.
        #[arg(long, default_value = "")]
        reason: String,
        /// One JSON object (`stagehand::dlq::Replayed`, or `BulkReplayed` with --service).
        #[arg(long)]
        json: bool,
    },
    /// Mark a dead letter as settled without replaying it: it no longer waits (nor counts in
    /// `stagehand_dead_letters_waiting`) and is never replayed afterwards. Recorded as an
    /// operator action with who and why.
    Discard {
        /// The dead letter's sequence (from `dlq list`).
        sequence: u64,
        /// Why it is discarded (required; kept with the record).
        #[arg(long)]
        reason: String,
        /// One JSON object (`stagehand::dlq::Discarded`).
        #[arg(long)]
        json: bool,
    },
}

/// `--since`: an RFC 3339 time, or a duration before now.
fn parse_since(s: &str) -> Result<time::OffsetDateTime, String> {
    if let Ok(at) = time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339) {
        return Ok(at);
    }
    let ago = args::duration("--since", s).map_err(|_| {
        format!(
            "{s:?} is neither an RFC 3339 time (2026-12-01T08:00:00Z) nor a duration ago (2h, 30m)"
        )
    })?;
    Ok(time::OffsetDateTime::now_utc() - ago)
}

#[derive(Debug, Subcommand)]
pub enum PolicyCommand {
    /// Parse and validate every policy file in DIR with the code the services run at start,
    /// connecting to nothing. Prints every problem, one per line, as a service would refuse
    /// to start with it, and exits 78; exits 0 when every file is valid.
    Check {
        /// The policy folder (`tiers.toml`, `validation.toml`, …).
        dir: PathBuf,
    },
}

#[derive(Debug, Subcommand)]
pub enum AccountsCommand {
    /// Print FILE (an accounts config of the shipped shape) with a NATS user of its own for
    /// each NODE: the permissions block `NODE_GPU_01` and the user line of `node-gpu-01`
    /// copied with the node's name (deploy/README.md, "Adding a node"), so that the node's
    /// promoter agent and demoter state nothing about another node or a shared tier. Connects
    /// to nothing; write the output over FILE, set `STAGEHAND_NATS_NODE_<N>_PASSWORD` in the
    /// server's environment and reload it (`nats-server --signal reload`). A node name that is
    /// no subject token (a Kubernetes node's DNS name) is written as its token. Exits 78 when
    /// FILE is not of the shipped shape or already has a node's user.
    AddNode {
        /// The accounts config to extend.
        #[arg(long, default_value = "deploy/nats/accounts.conf")]
        file: PathBuf,
        /// The nodes (`[service] node` of their promoter agent and demoter).
        #[arg(required = true)]
        nodes: Vec<String>,
    },
    /// Print FILE (an accounts config of the shipped shape) with the tenants of each PROJECT:
    /// its uploader's, training jobs' and Kubernetes init containers' users and permissions
    /// and its account, copied from project `demo`'s, its upload bucket in the services'
    /// grants, and its account in the exports every project shares (deploy/README.md, "Adding
    /// a project", step 1). Connects to nothing; write the output over FILE, set the new
    /// users' `STAGEHAND_NATS_<ROLE>_<P>_PASSWORD` in the server's environment, reload it,
    /// then run `stagehand provision --project P`. Exits 64 for a name that is no project
    /// name, 78 when FILE is not of the shipped shape or already has a project's users.
    AddProject {
        /// The accounts config to extend.
        #[arg(long, default_value = "deploy/nats/accounts.conf")]
        file: PathBuf,
        /// The projects (lower case, as in their subjects).
        #[arg(required = true)]
        projects: Vec<String>,
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
    /// Where to serve Prometheus's `GET /metrics` (and `/healthz`, `/readyz`) for every service
    /// `up` runs, each series labelled with its service.
    #[arg(long, value_name = "ADDR", default_value = crate::up::DEFAULT_METRICS)]
    pub metrics: std::net::SocketAddr,
}

/// The policies in `dir` (default: Stagehand's home's), the bus and a catalogue client on it:
/// what the commands that report per declared tier (`tier usage`, `scrub status`, `audit`)
/// read.
async fn policies_and_catalogue(
    dir: Option<PathBuf>,
    connection: &Connection,
) -> anyhow::Result<(
    stagehand_policy::Policies,
    stagehand_catalogue::Catalogue,
    Bus,
)> {
    let dir = dir.unwrap_or_else(default_policies);
    let policies = stagehand_policy::Policies::load_dir(&dir)
        .with_context(|| format!("reading the policies in {}", dir.display()))?;
    let bus = connect(connection).await?;
    let catalogue = stagehand_catalogue::Catalogue::new(bus.client().clone())
        .with_timeout(crate::catalogue::TIMEOUT);
    Ok((policies, catalogue, bus))
}

fn default_policies() -> PathBuf {
    stagehand_policy::stagehand_home().join("policies")
}

/// Connects within `--connect-timeout`: quiet retries, then one line (exit 69).
pub(crate) async fn connect(connection: &Connection) -> anyhow::Result<Bus> {
    let cfg = connection.bus_config(connection.connect_timeout);
    args::connect(&cfg, connection.connect_timeout).await
}

/// The policy folder a command checks against: the one given (which must exist), else the
/// default one when it exists.
fn policies_for_check(given: Option<&Path>) -> Result<Option<PathBuf>, UsageError> {
    match given {
        Some(dir) => {
            args::folder("--policies", dir)?;
            Ok(Some(dir.to_owned()))
        }
        None => Ok(Some(default_policies()).filter(|d| d.is_dir())),
    }
}

/// Checks a stage's arguments: names, version form, and — when policies are at hand — that
/// the tier is a hot or local tier and that `--node` is given exactly for a local one.
fn stage_from(a: &StageTargetArgs) -> Result<Stage, UsageError> {
    let (dataset, version) = args::dataset_at_version("DATASET@VERSION", &a.target)?;
    stage_at(dataset, version, &a.place)
}

/// Where a stage goes and for whom: `stage request|wait|release`'s and `checkpoint
/// restore`'s options besides the data.
#[derive(Debug, Args)]
pub struct StagePlaceArgs {
    /// The tier to stage onto (a hot or local tier of the policies).
    #[arg(long)]
    pub tier: String,
    /// The scheduler's job id (e.g. `slurm-<cluster>-<job id>`, or a pod uid).
    #[arg(long)]
    pub job: String,
    /// The node, for a node-local tier (and only then).
    #[arg(long)]
    pub node: Option<String>,
    /// Project (tenant): [a-z0-9_-].
    #[arg(long, env = "STAGEHAND_PROJECT")]
    pub project: Option<String>,
    /// Policy folder used to check that the tier exists and whether it needs --node; default
    /// `$STAGEHAND_HOME/policies` when present (without policies, the promoter judges).
    #[arg(long)]
    pub policies: Option<PathBuf>,
}

/// The stage of `dataset@version` at `a`'s place, its arguments checked (project, tier, job,
/// node iff the tier is node-local) before anything connects; the version is the caller's
/// to check.
pub(crate) fn stage_at(
    dataset: String,
    version: String,
    a: &StagePlaceArgs,
) -> Result<Stage, UsageError> {
    let project = a
        .project
        .clone()
        .ok_or_else(|| UsageError("--project (or STAGEHAND_PROJECT) is required".to_owned()))?;
    args::project("--project", &project)?;
    args::tier("--tier", &a.tier)?;
    args::job("--job", &a.job)?;
    if let Some(node) = &a.node {
        args::node("--node", node)?;
    }
    if let Some(dir) = policies_for_check(a.policies.as_deref())? {
        use stagehand_policy::TierRole;
        let policies = stagehand_policy::Policies::load_dir(&dir)
            .map_err(|e| UsageError(format!("policies in {}: {e}", dir.display())))?;
        let tier = policies.tier(&a.tier).ok_or_else(|| {
            UsageError(format!(
                "--tier {:?} is not declared in {}",
                a.tier,
                dir.display()
            ))
        })?;
        match (tier.role, &a.node) {
            (TierRole::Local, None) => {
                return Err(UsageError(format!(
                    "--node is required: tier {:?} is node-local",
                    a.tier
                )));
            }
            (TierRole::Hot, Some(_)) => {
                return Err(UsageError(format!(
                    "--node is only for node-local tiers; tier {:?} is shared (hot)",
                    a.tier
                )));
            }
            (TierRole::Local | TierRole::Hot, _) => {}
            (role, _) => {
                return Err(UsageError(format!(
                    "--tier {:?} is a {role:?} tier; stages go to hot or local tiers",
                    a.tier
                )));
            }
        }
    }
    Ok(Stage {
        project,
        dataset,
        version,
        tier: a.tier.clone(),
        job: a.job.clone(),
        node: a.node.clone(),
    })
}

pub(crate) fn who(by: Option<String>) -> String {
    by.or_else(|| std::env::var("USER").ok())
        .unwrap_or_else(|| "unknown".into())
}

/// Checks `ingest`'s arguments before anything connects or reads the folder.
fn check_ingest(a: &IngestArgs) -> Result<PathBuf, UsageError> {
    // An `s3://` source is checked against the tiers once the policies are read; a folder
    // must exist before anything connects.
    if !a.source.starts_with("s3://") {
        args::folder("source folder", Path::new(&a.source))?;
    }
    args::project("--project", &a.project)?;
    args::dataset("--dataset", &a.dataset)?;
    args::tier("--tier", &a.tier)?;
    if let Some(manifest) = &a.manifest {
        args::file("--manifest", manifest)?;
    }
    if let Some((key, _)) = a.labels.iter().find(|(k, _)| k.is_empty()) {
        return Err(UsageError(format!(
            "--label {key:?}=...: a label needs a key"
        )));
    }
    let policies = a.policies.clone().unwrap_or_else(default_policies);
    args::folder("--policies", &policies).map_err(|e| {
        if a.policies.is_none() {
            UsageError(format!(
                "{e} (the default policy folder; run `stagehand up` once, or give --policies)"
            ))
        } else {
            e
        }
    })?;
    Ok(policies)
}

async fn run_stage(connection: &Connection, cmd: StageCommand) -> anyhow::Result<i32> {
    match cmd {
        StageCommand::Request(a) => {
            let stage = stage_from(&a.stage)?;
            let now = stagehand_schemas::event::now();
            let deadline = a
                .deadline
                .as_deref()
                .map(|d| args::deadline("--deadline", d, now))
                .transpose()?;
            let hold_until = a
                .hold_until
                .as_deref()
                .map(|d| args::deadline("--hold-until", d, now))
                .transpose()?;
            let opts = RequestOptions {
                requested_by: who(a.by),
                deadline,
                hold_until,
                form: a.form,
            };
            let bus = connect(connection).await?;
            if let Some(declared) = a.declared_size {
                crate::stage::check_declared_size(&bus, &stage, declared).await?;
            }
            let published = crate::stage::request(&bus, &stage, &opts).await?;
            if a.json {
                println!("{}", serde_json::to_string_pretty(&published)?);
            } else {
                println!("{}", published.id);
            }
            Ok(0)
        }
        StageCommand::Wait(a) => {
            let stage = stage_from(&a.stage)?;
            let timeout = args::duration("--timeout", &a.timeout)?;
            let bus = connect(connection).await?;
            let outcome = crate::stage::wait(&bus, &stage, timeout).await?;
            if a.json {
                let status = match &outcome {
                    crate::stage::WaitOutcome::Ready(s)
                    | crate::stage::WaitOutcome::Failed(s)
                    | crate::stage::WaitOutcome::TimedOut(Some(s)) => Some(s),
                    crate::stage::WaitOutcome::TimedOut(None) => None,
                };
                println!("{}", serde_json::to_string_pretty(&status)?);
            } else {
                println!("{}", outcome.text(&stage));
            }
            Ok(outcome.exit_code())
        }
        StageCommand::Status(a) => {
            let (mut job, mut dataset_version) = (None, None);
            match a.target.as_deref() {
                Some(t) if t.contains('@') => {
                    dataset_version = Some(args::dataset_at_version("D@V", t)?);
                }
                Some(j) => {
                    args::job("J", j)?;
                    job = Some(j.to_owned());
                }
                None => {}
            }
            let project = a.project.clone().ok_or_else(|| {
                UsageError("--project (or STAGEHAND_PROJECT) is required".to_owned())
            })?;
            args::project("--project", &project)?;
            let filter = StatusFilter {
                project,
                job,
                dataset_version,
            };
            let bus = connect(connection).await?;
            let items = crate::stage::status(&bus, &filter).await?;
            if a.json {
                println!("{}", serde_json::to_string_pretty(&items)?);
            } else {
                print!("{}", crate::stage::status_text(&items));
            }
            Ok(0)
        }
        StageCommand::Release(a) => {
            let stage = stage_from(&a.stage)?;
            let bus = connect(connection).await?;
            let published = crate::stage::release(&bus, &stage).await?;
            if a.json {
                println!("{}", serde_json::to_string_pretty(&published)?);
            } else {
                println!("{}", published.id);
            }
            Ok(0)
        }
        StageCommand::Cancel(a) => {
            let stage = stage_from(&a.stage)?;
            let bus = connect(connection).await?;
            let c = crate::stage::cancel(&bus, &stage, &crate::dlq::operator(), &a.reason).await?;
            if a.json {
                println!("{}", serde_json::to_string_pretty(&c)?);
            } else {
                match c.done {
                    "nothing" => println!(
                        "stage request {} had already {}; nothing to cancel",
                        c.request_id, c.was
                    ),
                    "released" => println!(
                        "stage request {} was ready: released ({})",
                        c.request_id, c.reason
                    ),
                    _ => println!(
                        "stage request {} was {}: its promoter fails it ({})",
                        c.request_id, c.was, c.reason
                    ),
                }
            }
            Ok(0)
        }
        StageCommand::Where(a) => {
            let (dataset, version) = args::dataset_at_version("DATASET@VERSION", &a.target)?;
            let project = a.project.clone().ok_or_else(|| {
                UsageError("--project (or STAGEHAND_PROJECT) is required".to_owned())
            })?;
            args::project("--project", &project)?;
            if let Some(tier) = &a.tier {
                args::tier("--tier", tier)?;
            }
            let query = crate::stage::WhereQuery {
                project,
                dataset,
                version,
                tier: a.tier,
            };
            let bus = connect(connection).await?;
            let found = crate::stage::cached_on(&bus, &query).await?;
            if a.json {
                println!("{}", serde_json::to_string_pretty(&found)?);
            } else if a.hostlist {
                let hosts = found.hostlist();
                if !hosts.is_empty() {
                    println!("{hosts}");
                }
            } else {
                print!("{}", found.text());
            }
            Ok(found.exit_code())
        }
        StageCommand::Reconcile(a) => {
            for p in &a.projects {
                args::project("--project", p)?;
            }
            let scheduler = match a.scheduler.as_str() {
                "slurm" => {
                    args::job("--job-prefix", &a.job_prefix)?;
                    crate::reconcile::Scheduler::Slurm {
                        job_prefix: a.job_prefix,
                    }
                }
                _ => crate::reconcile::Scheduler::Kubernetes,
            };
            let bus = connect(connection).await?;
            let released =
                crate::reconcile::reconcile(&bus, &scheduler, &a.projects, a.dry_run).await?;
            if a.json {
                println!("{}", serde_json::to_string_pretty(&released)?);
            } else {
                let verb = if a.dry_run {
                    "would release"
                } else {
                    "released"
                };
                for r in &released {
                    println!("{verb} {}", r.line());
                }
            }
            Ok(0)
        }
    }
}

/// Checks `catalogue`'s arguments.
fn check_catalogue(cmd: &CatalogueCommand) -> Result<(), UsageError> {
    let limit = |n: u32| {
        if (1..=stagehand_catalogue::MAX_PAGE).contains(&n) {
            Ok(())
        } else {
            Err(UsageError(format!(
                "--limit {n}: a page holds 1 to {} entries",
                stagehand_catalogue::MAX_PAGE
            )))
        }
    };
    match cmd {
        CatalogueCommand::Datasets {
            project, limit: n, ..
        } => {
            if let Some(p) = project {
                args::project("--project", p)?;
            }
            limit(*n)?;
        }
        CatalogueCommand::Show {
            target,
            project,
            limit: n,
            ..
        } => {
            if let Some(p) = project {
                args::project("--project", p)?;
            }
            limit(*n)?;
            let (dataset, version) = match target.split_once('@') {
                Some((d, v)) => (d, Some(v)),
                None => (target.as_str(), None),
            };
            args::dataset("D[@VERSION]", dataset)?;
            if let Some(v) = version {
                let min = stagehand_schemas::layout::MIN_QUERY_VERSION_PREFIX;
                if args::query_version(v).is_err() {
                    return Err(UsageError(format!(
                        "D@VERSION {target:?}: VERSION is {min}-64 lowercase hex characters (a digest or a unique prefix)"
                    )));
                }
            }
        }
        CatalogueCommand::Problems { limit: n, .. } => limit(*n)?,
        CatalogueCommand::DeadLetters { .. } => {}
    }
    Ok(())
}

/// Runs a parsed command; returns the exit code.
///
/// Every command but `up` (which sets up telemetry for itself and for each service it runs)
/// logs like a command whose stdout is its answer ([`args::init_logs`]) and runs inside one
/// span, `stagehand <command>`: the root of what it publishes, exported when
/// `OTEL_EXPORTER_OTLP_ENDPOINT` is set, and the child of the caller's `TRACEPARENT` when there
/// is one, so that a workflow's commands join its trace.
pub async fn run(cli: Cli) -> anyhow::Result<i32> {
    if matches!(cli.command, Command::Up(_)) {
        return run_command(cli).await;
    }
    // Dropped after the command's span closed: flushes the spans before the process exits.
    let _telemetry = args::init_logs();
    let span = command_span(&cli.command);
    run_command(cli).instrument(span).await
}

/// The span a command runs in, under the trace context of the process's environment.
fn command_span(command: &Command) -> tracing::Span {
    let span = tracing::info_span!(
        names::SPAN_COMMAND,
        otel.name = %format!("stagehand {}", command_name(command)),
    );
    let parent = stagehand_telemetry::env_context();
    if has_span(&parent) {
        let _ = span.set_parent(parent);
    }
    span
}

/// The command as typed (`ingest`, `stage request`), naming its span.
fn command_name(command: &Command) -> &'static str {
    match command {
        Command::Ingest(_) => "ingest",
        Command::Catalogue(_) => "catalogue",
        Command::Backup(_) => "backup",
        Command::Restore(_) => "restore",
        Command::Dlq(_) => "dlq",
        Command::Tier(_) => "tier",
        Command::K8s(_) => "k8s gates",
        Command::Scrub(_) => "scrub",
        Command::Audit(_) => "audit",
        Command::Status(_) => "status",
        Command::Checkpoint(_) => "checkpoint",
        Command::Cp(_) => "cp",
        Command::Up(_) => "up",
        Command::Provision { .. } => "provision",
        Command::Policy(_) => "policy",
        Command::Accounts(_) => "accounts",
        Command::Stage(StageCommand::Request(_)) => "stage request",
        Command::Stage(StageCommand::Wait(_)) => "stage wait",
        Command::Stage(StageCommand::Status(_)) => "stage status",
        Command::Stage(StageCommand::Release(_)) => "stage release",
        Command::Stage(StageCommand::Cancel(_)) => "stage cancel",
        Command::Stage(StageCommand::Reconcile(_)) => "stage reconcile",
        Command::Stage(StageCommand::Where(_)) => "stage where",
        Command::GenerateDocs { .. } => "generate-docs",
    }
}

/// `stagehand accounts <command>`: prints `file` extended by `recipe` for `names`; exit 78
/// (nothing printed) when the file does not take it.
fn extend_accounts(
    command: &str,
    file: &std::path::Path,
    names: &[String],
    recipe: fn(&str, &[&str]) -> Result<String, stagehand_bus::accounts::RecipeError>,
) -> anyhow::Result<i32> {
    let text =
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    match recipe(&text, &names) {
        Ok(extended) => {
            print!("{extended}");
            Ok(0)
        }
        Err(e) => {
            eprintln!("stagehand accounts {command}: {}: {e}", file.display());
            Ok(78)
        }
    }
}

async fn run_command(cli: Cli) -> anyhow::Result<i32> {
    match cli.command {
        Command::GenerateDocs { out } => {
            let generated = crate::docs::generate(&out)?;
            println!(
                "{} man pages and {} completion scripts under {}",
                generated.man_pages.len(),
                generated.completions.len(),
                out.display()
            );
            Ok(0)
        }
        Command::Policy(PolicyCommand::Check { dir }) => {
            let checked = crate::policy::check(&dir, &stagehand_policy::stagehand_home());
            let (text, code) = crate::policy::report(&dir, &checked);
            if code == 0 {
                print!("{text}");
            } else {
                eprint!("{text}");
            }
            Ok(code)
        }
        Command::Accounts(AccountsCommand::AddNode { file, nodes }) => extend_accounts(
            "add-node",
            &file,
            &nodes,
            stagehand_bus::accounts::with_node_users,
        ),
        Command::Accounts(AccountsCommand::AddProject { file, projects }) => {
            for p in &projects {
                stagehand_schemas::layout::check_project(p)
                    .map_err(|e| args::UsageError(format!("project {p:?}: {e}")))?;
            }
            extend_accounts(
                "add-project",
                &file,
                &projects,
                stagehand_bus::accounts::with_project_users,
            )
        }
        Command::Up(args) => {
            let _telemetry = stagehand_telemetry::init(crate::up::UP_SERVICE)?;
            crate::up::run(
                crate::up::UpOptions {
                    home: args.home,
                    nats: args
                        .external_nats
                        .then(|| cli.connection.bus_config(Duration::from_secs(20))),
                    port: args.port,
                    policies: args.policies,
                },
                args.metrics,
            )
            .await?;
            Ok(0)
        }
        Command::Checkpoint(cmd) => crate::checkpoint::run(&cli.connection, cmd).await,
        Command::Cp(args) => Ok(crate::cp::run(&args).await?.exit_code()),
        Command::Stage(cmd) => run_stage(&cli.connection, cmd).await,
        Command::Ingest(args) => {
            let policies = check_ingest(&args)?;
            let bus = connect(&cli.connection).await?;
            let opts = IngestOptions {
                source: args.source,
                in_place: args.in_place,
                project: args.project,
                dataset: args.dataset,
                tier: args.tier,
                policies,
                requested_by: who(args.by),
                labels: args.labels,
                manifest: args.manifest,
                wait: args.wait.then_some(args.timeout),
                progress: std::io::stderr().is_terminal(),
                clock_skew: Duration::from_millis(args.clock_skew_ms),
                spool: None,
            };
            let report = crate::ingest::ingest(&bus, &opts).await?;
            let rejected = matches!(report.outcome, Some(Outcome::Rejected(_)));
            if args.json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&crate::ingest::report_json(&report))?
                );
            } else {
                println!("{}", report.request.id);
                eprint!("{}", crate::ingest::report_text(&report));
                if let Some(outcome) = &report.outcome {
                    print!("{}", crate::ingest::outcome_text(outcome));
                }
            }
            Ok(i32::from(rejected))
        }
        Command::Tier(TierCommand::Usage {
            tier,
            policies,
            json,
        }) => {
            let (policies, catalogue, _) =
                policies_and_catalogue(policies, &cli.connection).await?;
            let stdout = std::io::stdout();
            let mut out = std::io::BufWriter::new(stdout.lock());
            crate::tier::usage(&catalogue, &policies, tier.as_deref(), json, &mut out).await?;
            std::io::Write::flush(&mut out)?;
            Ok(0)
        }
        Command::K8s(K8sCommand::Gates {
            namespace,
            every,
            once,
            api_server,
            token_file,
            api_ca,
            by,
        }) => {
            let every = args::duration("--every", &every)?;
            let kube = match api_server {
                Some(url) => crate::kube::Kube::new(&url, token_file, api_ca.as_deref())?,
                None => crate::kube::Kube::in_cluster()?,
            };
            let bus = connect(&cli.connection).await?;
            let by = who(by);
            loop {
                crate::gates::pass(&bus, &kube, namespace.as_deref(), &by).await?;
                if once {
                    return Ok(0);
                }
                tokio::time::sleep(every).await;
            }
        }
        Command::Tier(TierCommand::Pool {
            tiers,
            policies,
            slurm,
            json,
        }) => {
            let (policies, catalogue, bus) =
                policies_and_catalogue(policies, &cli.connection).await?;
            let promoter = bus
                .jetstream()
                .get_key_value(stagehand_bus::PROMOTER_BUCKET)
                .await
                .map_err(|e| {
                    crate::args::Unreachable(format!(
                        "KV bucket {} is not there ({e}): is the promoter running?",
                        stagehand_bus::PROMOTER_BUCKET
                    ))
                })?;
            let pools = crate::tier::pools(&catalogue, &promoter, &policies, &tiers).await?;
            crate::tier::write_slurm_pools(&slurm, &pools, time::OffsetDateTime::now_utc())?;
            if json {
                println!("{}", serde_json::to_string_pretty(&pools)?);
                return Ok(0);
            }
            for p in &pools {
                println!(
                    "{}: capacity {}, held {}, reserved {}, filesystem available {}, free {}",
                    p.tier,
                    crate::tier::size(p.capacity),
                    crate::tier::size(p.held),
                    crate::tier::size(p.reserved),
                    p.fs_available
                        .map_or("not measured here".into(), crate::tier::size),
                    crate::tier::size(p.free)
                );
                for q in &p.quotas {
                    println!(
                        "  {}.{}: quota {}, reserved {}",
                        p.tier,
                        q.project,
                        crate::tier::size(q.quota),
                        crate::tier::size(q.reserved)
                    );
                }
            }
            Ok(0)
        }
        Command::Scrub(ScrubCommand::Status { policies, json }) => {
            let (policies, catalogue, _) =
                policies_and_catalogue(policies, &cli.connection).await?;
            let stdout = std::io::stdout();
            let mut out = std::io::BufWriter::new(stdout.lock());
            let damage = crate::scrub::status(&catalogue, &policies, json, &mut out).await?;
            std::io::Write::flush(&mut out)?;
            Ok(i32::from(damage))
        }
        Command::Audit(a) => {
            let (policies, catalogue, bus) =
                policies_and_catalogue(a.policies, &cli.connection).await?;
            let stdout = std::io::stdout();
            let mut out = std::io::BufWriter::new(stdout.lock());
            let code = crate::audit::run(
                &bus,
                &catalogue,
                &policies,
                (&a.tier, a.node.as_deref()),
                a.quarantine,
                a.json,
                &mut out,
            )
            .await?;
            std::io::Write::flush(&mut out)?;
            Ok(code)
        }
        Command::Status(a) => {
            // A page's reload is counted in whole seconds.
            if a.serve.is_some() && a.refresh < Duration::from_secs(1) {
                return Err(
                    args::UsageError(format!("--refresh {:?}: at least 1s", a.refresh)).into(),
                );
            }
            let policies = policies_for_check(a.policies.as_deref())?;
            let bus = connect(&cli.connection).await?;
            let catalogue = stagehand_catalogue::Catalogue::new(bus.client().clone())
                .with_timeout(crate::catalogue::TIMEOUT);
            if a.actions {
                let actions = crate::status::actions(&catalogue).await?;
                let stdout = std::io::stdout();
                let mut out = std::io::BufWriter::new(stdout.lock());
                if a.json {
                    serde_json::to_writer_pretty(&mut out, &actions)?;
                    std::io::Write::write_all(&mut out, b"\n")?;
                } else {
                    crate::status::actions_text(&actions, &mut out)?;
                }
                std::io::Write::flush(&mut out)?;
                return Ok(0);
            }
            let opts = crate::status::StatusOptions {
                policies,
                silent_after: a.silent_after,
                backlog_after: a.backlog_after,
                stuck_after: a.stuck_after,
            };
            if let Some(addr) = a.serve {
                crate::status::page::run(addr, bus, catalogue, opts, a.refresh).await?;
                return Ok(0);
            }
            let report = crate::status::gather(&bus, &catalogue, &opts).await?;
            let stdout = std::io::stdout();
            let mut out = std::io::BufWriter::new(stdout.lock());
            if a.json {
                serde_json::to_writer_pretty(&mut out, &report)?;
                std::io::Write::write_all(&mut out, b"\n")?;
            } else {
                crate::status::text(&report, &mut out)?;
            }
            std::io::Write::flush(&mut out)?;
            Ok(i32::from(report.needs_person))
        }
        Command::Catalogue(cmd) => {
            check_catalogue(&cmd)?;
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
                    lineage,
                } => {
                    let opts = crate::catalogue::ShowOptions {
                        project,
                        limit: Some(limit),
                        after,
                        path,
                        json,
                        lineage,
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
            if replicas.is_some_and(|n| !(1..=5).contains(&n)) {
                return Err(UsageError(format!(
                    "--replicas {}: a stream has 1 to 5 replicas",
                    replicas.unwrap_or_default()
                ))
                .into());
            }
            for project in &projects {
                args::project("--project", project)?;
            }
            let timeout = cli.connection.connect_timeout;
            let mut cfg = cli.connection.bus_config(timeout);
            cfg.replicas = replicas;
            let bus = args::connect(&cfg, timeout).await?;
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
        Command::Backup(BackupCommand::Status {
            project,
            tier,
            flagged,
            check,
            json,
        }) => {
            let bus = connect(&cli.connection).await?;
            let catalogue = stagehand_catalogue::Catalogue::new(bus.client().clone())
                .with_timeout(crate::catalogue::TIMEOUT);
            let opts = crate::backup::StatusOptions {
                project,
                tier,
                flagged_only: flagged,
                json,
            };
            let stdout = std::io::stdout();
            let mut out = std::io::BufWriter::new(stdout.lock());
            let summary = crate::backup::status(&catalogue, &opts, &mut out).await?;
            std::io::Write::flush(&mut out)?;
            Ok(i32::from(check && summary.flagged > 0))
        }
        Command::Restore(args) => {
            let request = args.request()?;
            let policies = args.policies.clone().unwrap_or_else(default_policies);
            if !policies.join("tiers.toml").exists() {
                anyhow::bail!(
                    "no tiers.toml in {} (give --policies DIR)",
                    policies.display()
                );
            }
            let bus = connect(&cli.connection).await?;
            let catalogue = stagehand_catalogue::Catalogue::new(bus.client().clone())
                .with_timeout(crate::catalogue::TIMEOUT);
            let opts = crate::backup::RestoreOptions { request, policies };
            let report = match crate::backup::restore(&bus, &catalogue, &opts).await {
                Ok(report) => report,
                Err(e) if crate::backup::restore_refused(&e) => {
                    eprintln!("{}", args::error_line(&e));
                    return Ok(1);
                }
                Err(e) => return Err(e),
            };
            if args.json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", crate::backup::restore_text(&report));
            }
            Ok(0)
        }
        Command::Dlq(cmd) => {
            if let DlqCommand::List {
                service: Some(service),
                ..
            }
            | DlqCommand::Replay {
                service: Some(service),
                ..
            } = &cmd
                && !stagehand_schemas::subject::is_subject_token(service)
            {
                return Err(UsageError(format!(
                    "--service {service:?}: a service name is 1-64 characters of [a-z0-9_-]"
                ))
                .into());
            }
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
                DlqCommand::Replay {
                    sequence: None,
                    service: Some(service),
                    since: Some(since),
                    dry_run,
                    reason,
                    json,
                } => {
                    let by = crate::dlq::operator();
                    let r = crate::dlq::replay_since(&bus, &service, since, dry_run, &by, &reason)
                        .await?;
                    if json {
                        println!("{}", serde_json::to_string_pretty(&r)?);
                    } else {
                        print!("{}", crate::dlq::bulk_text(&r));
                    }
                    if !r.refused.is_empty() {
                        return Ok(1);
                    }
                }
                DlqCommand::Replay {
                    sequence: Some(sequence),
                    reason,
                    json,
                    ..
                } => {
                    let r = crate::dlq::replay_because(
                        &bus,
                        sequence,
                        &crate::dlq::operator(),
                        &reason,
                    )
                    .await?;
                    if json {
                        println!("{}", serde_json::to_string_pretty(&r)?);
                    } else {
                        println!(
                            "replayed dead letter {} to {} as {} ({} sequence {})",
                            r.sequence, r.subject, r.msg_id, r.stream, r.stream_sequence
                        );
                        if !r.dropped_headers.is_empty() {
                            println!(
                                "headers not set by Stagehand, not replayed: {}",
                                r.dropped_headers.join(", ")
                            );
                        }
                    }
                }
                DlqCommand::Replay { .. } => {
                    return Err(UsageError(
                        "dlq replay takes SEQ, or --service S --since T".into(),
                    )
                    .into());
                }
                DlqCommand::Discard {
                    sequence,
                    reason,
                    json,
                } => {
                    let d = crate::dlq::discard(&bus, sequence, &crate::dlq::operator(), &reason)
                        .await?;
                    if json {
                        println!("{}", serde_json::to_string_pretty(&d)?);
                    } else if d.newly {
                        println!(
                            "discarded dead letter {} of {} ({}): {}",
                            d.sequence, d.service, d.by, d.reason
                        );
                    } else {
                        println!(
                            "dead letter {} of {} was discarded before, by {}: {}",
                            d.sequence, d.service, d.by, d.reason
                        );
                    }
                }
            }
            Ok(0)
        }
    }
}

/// A clap error as one line (its first paragraph, without the usage and tips that follow).
pub fn clap_error_line(err: &clap::Error) -> String {
    let text = err.render().to_string();
    let first = text.split("\n\n").next().unwrap_or_default();
    let line = first.split_whitespace().collect::<Vec<_>>().join(" ");
    let line = line.strip_prefix("error: ").unwrap_or(&line);
    format!("stagehand: {line}")
}
