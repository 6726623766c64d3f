//! Fan-out: node agents staging the same version onto their `local` tiers read it from the
//! shared tier about once between them, and the rest from each other.
//!
//! Every agent cuts the version's file list into the same pieces ([`pieces`]): runs of small
//! files, and slices of a large file whose per-piece hashes the manifest's side data holds
//! ([`side_data`]), put together in the staging folder as they arrive (`assembly.rs`) and
//! served from there before the whole file is in hand. Coordination
//! is through NATS, on the swarm's board (`board.rs`): an agent claims a piece before reading
//! it from the shared tier (so two agents do not read the same piece), announces each piece
//! it holds, and asks a holder for any piece another agent announced (`fetch.rs`, served by
//! `serve.rs` over HTTP, each request signed with the agents' secret, `auth.rs`). Every file of
//! a run is verified against the manifest's SHA-256, and every slice of a large file against
//! its piece hash from the side data, before it counts, whoever served it (the piece hashes
//! were taken from the bytes whose SHA-256 the manifest names, and are stored under it); a
//! peer whose bytes do not verify is dropped from the swarm by the member that caught it and
//! reported (its `bad` key, a warning naming the file, `stagehand_fanout_peers_dropped_total`);
//! every member drops it once two have caught it (`board::REPORTS_TO_DROP`: one report could be
//! a lie).
//!
//! What a dead node costs its peers: the pieces it was serving (asked of another holder or
//! read from the shared tier) and the pieces it had claimed and not announced (taken over
//! once its claim goes unrenewed for the swarm's patience). Nothing it wrote reaches another
//! node unverified.
//!
//! The copy around it is the promoter's usual one: space reserved under the copy lease, a
//! copy slot, the set staged hidden and published by one rename (`promoter/copying.rs`); fan-out
//! only decides where each file's bytes come from.

mod assembly;
mod auth;
mod board;
mod fetch;
pub mod pieces;
mod reported;
mod serve;
mod tls;

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use stagehand_manifest::{ManifestError, ManifestErrorKind, ManifestStore};
use stagehand_mover::{
    BatchReport, CopyOptions, ErrorKind, Mover, PosixTier, Progress, Side, Tier, TransferError,
    VerifyMode,
};
use stagehand_schemas::manifest::FileRef;
use stagehand_schemas::pieces::{PieceDigest, PieceHashes};
use stagehand_telemetry::work::{FanoutSource, fanout_peer_dropped, fanout_read};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use assembly::Assemblies;
use auth::AgentKey;
use board::Board;
use fetch::FetchError;
use pieces::Piece;
use serve::Registry;

pub use board::{BadKey, BoardError, Spoiled};
pub use serve::ReplicaAt;
pub use tls::FanoutTls;

/// A node agent's `[service.fanout]` table.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FanoutSettings {
    /// Where this agent serves pieces to its peers (`"10.0.4.17:7700"`).
    pub listen: SocketAddr,
    /// What its peers dial (`"gpu-17.cluster:7700"`); default: `listen`, which then must name
    /// an address, not `0.0.0.0`.
    #[serde(default)]
    pub advertise: Option<String>,
    /// The agents' shared secret (at least 16 characters), in a file nobody but the agent's
    /// user may read. It signs every piece request (HMAC-SHA256) and is never sent.
    pub token_file: PathBuf,
    /// How long a piece another agent claimed may go without news (its reader renews the
    /// claim while it reads) before this agent reads it from the shared tier itself (`"30s"`).
    #[serde(
        default = "default_claim_patience",
        with = "stagehand_config::duration"
    )]
    pub claim_patience: Duration,
    /// Pieces fetched or read at once (4).
    #[serde(default = "default_parallel")]
    pub parallel: usize,
    /// Mutual TLS between agents (`[service.fanout.tls]`); absent: plain HTTP, for a private
    /// network only.
    #[serde(default)]
    pub tls: Option<FanoutTls>,
}

fn default_claim_patience() -> Duration {
    Duration::from_secs(30)
}

fn default_parallel() -> usize {
    4
}

/// Why fan-out could not start.
#[derive(Debug, thiserror::Error)]
pub enum FanoutError {
    #[error("[service.fanout] {0}")]
    Config(String),
    #[error("fan-out: cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    /// The board could not be read or written as the agent started (NATS away).
    #[error("fan-out: {0}")]
    Board(#[from] board::BoardError),
}

impl FanoutError {
    /// Whether starting again unchanged can succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(self, FanoutError::Board(_))
    }
}

impl FanoutSettings {
    /// The address peers dial.
    pub fn advertised(&self) -> Result<String, FanoutError> {
        match &self.advertise {
            Some(a) if !a.is_empty() => Ok(a.clone()),
            Some(_) => Err(FanoutError::Config("advertise must not be empty".into())),
            None if self.listen.ip().is_unspecified() => Err(FanoutError::Config(format!(
                "listen = \"{}\" is every address: set advertise to the one peers dial",
                self.listen
            ))),
            None => Ok(self.listen.to_string()),
        }
    }
}

/// Reads the agents' secret from `path`: refused when others may read it, or too short to
/// be a secret.
fn read_key(path: &Path) -> Result<AgentKey, FanoutError> {
    use std::os::unix::fs::PermissionsExt;
    let bad = |why: String| FanoutError::Config(format!("token_file {}: {why}", path.display()));
    let meta = std::fs::metadata(path).map_err(|e| bad(e.to_string()))?;
    if meta.permissions().mode() & 0o077 != 0 {
        return Err(bad(format!(
            "mode {:o} lets others read the agents' secret; chmod 600 it",
            meta.permissions().mode() & 0o777
        )));
    }
    let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
    let secret = text.trim();
    if secret.len() < 16 || secret.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(bad(
            "must hold one token of at least 16 visible characters".into()
        ));
    }
    Ok(AgentKey::new(secret))
}

/// A node agent's fan-out: its piece server and its seat on every swarm it joins.
pub struct Fanout {
    node: String,
    advertise: String,
    key: AgentKey,
    tls: Option<tls::AgentTls>,
    store: async_nats::jetstream::kv::Store,
    registry: Arc<Registry>,
    patience: Duration,
    parallel: usize,
}

/// The piece server and the watch for reports naming this node: a task beside the agent's
/// workers (its end before shutdown ends the service, to be restarted by its supervisor).
pub type Serving = std::pin::Pin<
    Box<
        dyn std::future::Future<Output = Result<(), Box<dyn std::error::Error + Send + Sync>>>
            + Send,
    >,
>;

impl Fanout {
    /// Binds the piece server of `node`'s agent; the returned future serves until `shutdown`.
    pub async fn bind(
        settings: &FanoutSettings,
        node: &str,
        store: async_nats::jetstream::kv::Store,
        bus: stagehand_bus::Bus,
        shutdown: CancellationToken,
    ) -> Result<(Fanout, Serving), FanoutError> {
        let advertise = settings.advertised()?;
        let key = read_key(&settings.token_file)?;
        let withdrawn = board::withdraw_everything_held(&store, node).await?;
        if withdrawn > 0 {
            info!(
                withdrawn,
                "fan-out: pieces announced before this agent's restart taken back"
            );
        }
        let tls = settings.tls.as_ref().map(FanoutTls::load).transpose()?;
        let listener = tokio::net::TcpListener::bind(settings.listen)
            .await
            .map_err(|source| FanoutError::Listen {
                addr: settings.listen,
                source,
            })?;
        let registry = Arc::new(Registry::default());
        let server = serve::serve(
            listener,
            registry.clone(),
            auth::Gate::new(key.clone()),
            tls.as_ref().map(|t| t.acceptor.clone()),
            shutdown.clone(),
        );
        let reports = reported::watch(store.clone(), registry.clone(), bus, node.to_owned());
        let serving: Serving = Box::pin(async move {
            tokio::select! {
                served = server => served.map_err(|never| match never {}),
                watched = reports => match watched {
                    Ok(()) if shutdown.is_cancelled() => Ok(()),
                    Ok(()) => Err("the watch for reports of bad bytes ended".into()),
                    Err(e) => Err(format!("watching for reports of bad bytes: {e}").into()),
                },
                _ = shutdown.cancelled() => Ok(()),
            }
        });
        info!(listen = %settings.listen, %advertise, tls = tls.is_some(), "fan-out: serving pieces to peers");
        Ok((
            Fanout {
                node: node.to_owned(),
                advertise,
                key,
                tls,
                store,
                registry,
                patience: settings.claim_patience,
                parallel: settings.parallel,
            },
            serving,
        ))
    }

    /// What names the swarm of every node staging `version` of `project`'s `dataset` onto
    /// `tier`: the first part of the swarm's name ([`Fanout::swarm_of`]).
    pub fn swarm(tier: &str, project: &str, dataset: &str, version: &str) -> String {
        let mut h = Sha256::new();
        for part in [tier, project, dataset, version] {
            h.update(part.as_bytes());
            h.update([0]);
        }
        hex::encode(&h.finalize()[..16])
    }

    /// The swarm of the copies named `base` ([`Fanout::swarm`]) that cut the version into
    /// `pieces`: `base` followed by a digest of the cut ([`pieces::layout`]). Agents that cut
    /// differently (a rolling upgrade, or one that found no side data) are in different
    /// swarms, never asking each other for a piece by a number that means other bytes to the
    /// one asked; the name still starts with the version's part, which is how `stagehand
    /// status` tells the version of a swarm.
    pub fn swarm_of(base: &str, pieces: &[Piece]) -> String {
        format!("{base}{}", &pieces::layout(pieces)[..16])
    }

    /// Fills `job.staging` with every file of `job.files`, from peers where they hold a piece
    /// and from `job.src` (the shared tier beneath the version's prefix) otherwise, each file
    /// or slice verified. The pieces are served to peers from here meanwhile, and after
    /// [`Fanout::published`] (given the swarm [`Filled::swarm`] names) from the published
    /// folder.
    pub async fn fill(&self, mut job: Fill<'_>) -> Result<Filled, TransferError> {
        let pieces: Arc<[Piece]> = pieces::cut(&job.files, &job.side).into();
        job.swarm = Fanout::swarm_of(&job.swarm, &pieces);
        let assemblies = Arc::new(Assemblies::new(job.staging.clone(), &pieces));
        let holding = self.registry.hold(
            &job.swarm,
            job.files.clone(),
            pieces.clone(),
            assemblies.clone(),
            job.staging.clone(),
        );
        let board = Board::join(self.store.clone(), &job.swarm, &self.node)
            .await
            .map_err(|e| board_failed(&job, e))?;
        let mut run = Run {
            fanout: self,
            job: &job,
            board: &board,
            pieces: &pieces,
            assemblies: &assemblies,
            todo: rotated(pieces.len(), board.me()),
            cooling: HashMap::new(),
            failures: HashMap::new(),
            asking: HashMap::new(),
            filled: Filled {
                swarm: job.swarm.clone(),
                ..Filled::default()
            },
        };
        let filled = run.go(&holding).await;
        if filled.is_err() {
            // Whatever this node holds goes with its staging folder, unless the copy resumes
            // it; peers asking meanwhile read elsewhere.
            board.withdraw(holding.held()).await;
            self.registry.forget(&job.swarm);
        }
        filled
    }

    /// Whether this agent serves a swarm of the copies named `base` ([`Fanout::swarm`]).
    pub fn serves(&self, base: &str) -> bool {
        self.registry.serves(base)
    }

    /// Serves a replica published on this node before — found intact before it is handed out
    /// again — to the peers of its swarm: every piece held, from `folder`, and announced. An
    /// agent that restarted since it staged the replica serves nothing it held before
    /// ([`Fanout::bind`] took its word back); a node joining the swarm later then fetches
    /// from it again instead of the shared tier. Peers verify every byte it serves, as ever.
    pub async fn serve_published(
        &self,
        base: &str,
        files: Arc<[FileRef]>,
        side: &HashMap<usize, PieceHashes>,
        folder: PosixTier,
        replica: ReplicaAt,
    ) -> Result<String, BoardError> {
        let pieces: Arc<[Piece]> = pieces::cut(&files, side).into();
        let swarm = Fanout::swarm_of(base, &pieces);
        let count = pieces.len();
        let assemblies = Arc::new(Assemblies::new(folder.clone(), &pieces));
        let holding = self
            .registry
            .hold(&swarm, files, pieces, assemblies, folder.clone());
        holding.moved_to(folder, replica);
        for piece in 0..count {
            holding.holds(piece);
        }
        board::announce_all(&self.store, &swarm, &self.node, count, &self.advertise).await?;
        Ok(swarm)
    }

    /// The swarm's pieces are in the published folder `folder` now, the replica `replica`.
    pub fn published(&self, swarm: &str, folder: PosixTier, replica: ReplicaAt) {
        if let Some(h) = self.registry.get(swarm) {
            h.moved_to(folder, replica);
        }
    }
}

/// One fan-out copy.
pub struct Fill<'a> {
    /// What names the swarm ([`Fanout::swarm`]).
    pub swarm: String,
    pub files: Arc<[FileRef]>,
    /// The piece hashes of the large files that have them, by index into `files`
    /// ([`side_data`]).
    pub side: HashMap<usize, PieceHashes>,
    /// The shared tier, beneath the version's folder.
    pub src: &'a Tier,
    /// The staging folder on this node's local tier.
    pub staging: &'a PosixTier,
    pub mover: &'a Mover,
    pub opts: CopyOptions,
    pub progress: &'a Progress,
    pub stop: &'a CancellationToken,
}

/// Where the bytes of a fan-out came from.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Filled {
    /// The swarm the copy was in: its pieces are served under it.
    pub swarm: String,
    pub shared_bytes: u64,
    pub peer_bytes: u64,
    pub pieces_from_peers: u64,
    pub pieces_from_shared: u64,
    pub peers_dropped: u64,
}

/// What to do next with a piece.
enum Step {
    /// Ask the holder `node` at `addr`.
    Peer { node: String, addr: String },
    /// Read it from the shared tier, holding its claim at this revision (none: read without a
    /// claim, every holder having failed it).
    Shared { claim: Option<u64> },
}

/// How one piece ended.
enum Ended {
    /// The piece's bytes are here; `files` of its files are complete (a slice completes its
    /// file or none).
    Held {
        bytes: u64,
        from: FanoutSource,
        files: u64,
    },
    PeerFailed {
        node: String,
        error: FetchError,
    },
    Failed(TransferError),
}

struct Run<'r, 'a> {
    fanout: &'r Fanout,
    job: &'r Fill<'a>,
    board: &'r Board,
    pieces: &'r Arc<[Piece]>,
    assemblies: &'r Arc<Assemblies>,
    /// Pieces not held yet and not being fetched, in the order this node takes them.
    todo: VecDeque<usize>,
    /// (piece, peer) pairs that failed lately: not asked again before the instant.
    cooling: HashMap<(usize, String), Instant>,
    /// Failed attempts per piece: past [`GIVE_UP_ON_PEERS`], read from the shared tier.
    failures: HashMap<usize, u32>,
    /// Pieces being fetched from each peer now.
    asking: HashMap<String, usize>,
    filled: Filled,
}

/// A piece whose holders failed this many times is read from the shared tier, claim or not.
const GIVE_UP_ON_PEERS: u32 = 4;

/// Each node starts at its own place in the piece list, so that nodes starting together claim
/// different pieces first.
fn rotated(n: usize, me: &str) -> VecDeque<usize> {
    if n == 0 {
        return VecDeque::new();
    }
    let h = Sha256::digest(me.as_bytes());
    let start = (u64::from_be_bytes(h[..8].try_into().expect("8 bytes")) % n as u64) as usize;
    (start..n).chain(0..start).collect()
}

fn board_failed(job: &Fill<'_>, e: BoardError) -> TransferError {
    TransferError::new(
        ErrorKind::Io,
        Side::Source,
        job.staging.name(),
        "",
        format!("fan-out board unreachable: {e}"),
    )
}

impl<'r, 'a> Run<'r, 'a> {
    async fn go(&mut self, holding: &serve::Holding) -> Result<Filled, TransferError> {
        let total: u64 = self.pieces.iter().map(|p| p.bytes).sum();
        self.job
            .progress
            .add_total(self.job.files.len() as u64, total);
        self.resumed(holding).await?;
        let mut running: FuturesUnordered<BoxFuture<'r, (usize, Ended)>> = FuturesUnordered::new();
        let recheck = (self.fanout.patience / 4).max(Duration::from_millis(100));
        loop {
            if self.job.stop.is_cancelled() {
                return Err(cancelled(self.job));
            }
            if let Some(why) = self.board.view().broken.clone() {
                return Err(board_failed(
                    self.job,
                    BoardError {
                        key: format!("swarm.{}.>", self.job.swarm),
                        detail: why,
                    },
                ));
            }
            while running.len() < self.fanout.parallel {
                let Some((piece, step)) =
                    self.next().await.map_err(|e| board_failed(self.job, e))?
                else {
                    break;
                };
                running.push(self.start(piece, step));
            }
            if self.todo.is_empty() && running.is_empty() {
                break;
            }
            tokio::select! {
                Some((piece, ended)) = running.next() => self.ended(holding, piece, ended).await?,
                _ = self.board.changed(recheck) => {}
                _ = self.job.stop.cancelled() => return Err(cancelled(self.job)),
            }
        }
        info!(
            swarm = %self.job.swarm,
            from_shared = self.filled.pieces_from_shared,
            from_peers = self.filled.pieces_from_peers,
            shared_bytes = self.filled.shared_bytes,
            peer_bytes = self.filled.peer_bytes,
            "fan-out: every piece held"
        );
        Ok(self.filled.clone())
    }

    /// Holds the slices of every sliced file already in the staging folder under its name
    /// (a resumed copy): such a file was renamed in only once every slice verified.
    async fn resumed(&mut self, holding: &serve::Holding) -> Result<(), TransferError> {
        let sliced: Vec<usize> = {
            let mut v: Vec<usize> = self
                .pieces
                .iter()
                .filter(|p| p.slice.is_some())
                .map(|p| p.files.start)
                .collect();
            v.dedup();
            v
        };
        if sliced.is_empty() {
            return Ok(());
        }
        let (staging, files) = (self.job.staging.clone(), self.job.files.clone());
        let present = tokio::task::spawn_blocking(move || {
            let mut present = std::collections::HashSet::new();
            for i in sliced {
                if staging.stat(&files[i].path)? == Some(files[i].size) {
                    present.insert(i);
                }
            }
            Ok::<_, TransferError>(present)
        })
        .await
        .map_err(|e| {
            TransferError::new(
                ErrorKind::Io,
                Side::Destination,
                self.job.staging.name(),
                "",
                format!("stat task failed: {e}"),
            )
        })??;
        if present.is_empty() {
            return Ok(());
        }
        let pieces = self.pieces.clone();
        let held: Vec<usize> = self
            .todo
            .iter()
            .copied()
            .filter(|&n| pieces[n].slice.is_some() && present.contains(&pieces[n].files.start))
            .collect();
        self.todo.retain(|n| !held.contains(n));
        for n in held {
            holding.holds(n);
            self.job.progress.add_bytes(pieces[n].bytes);
            if let Err(e) = self.board.announce(n, &self.fanout.advertise).await {
                warn!(error = %e, piece = n, "fan-out: a piece held here was not announced");
            }
        }
        for _ in &present {
            self.job.progress.file_done();
        }
        Ok(())
    }

    /// The next piece to start and how: one a peer holds first, then one nobody claimed, then
    /// one whose claim went stale, then one whose claim was held past any read of it; `None`
    /// when every piece left is being read by a live peer.
    async fn next(&mut self) -> Result<Option<(usize, Step)>, BoardError> {
        let now = Instant::now();
        self.cooling.retain(|_, until| *until > now);
        let me = self.board.me().to_owned();
        // Decided on a snapshot of the board; the claims are then made on the board itself.
        let (peer, unclaimed, stale, overheld) = {
            let view = self.board.view();
            let mut peer = None;
            let mut unclaimed = Vec::new();
            let mut stale = Vec::new();
            let mut overheld = Vec::new();
            for (at, &piece) in self.todo.iter().enumerate() {
                let holders = view.holders.get(&piece);
                let usable = holders.into_iter().flatten().filter(|(node, _)| {
                    **node != me
                        && !view.dropped(node, &me)
                        && !self.cooling.contains_key(&(piece, (*node).clone()))
                });
                // The least-asked holder, so that a piece's early holders are not all asked.
                if let Some((node, addr)) =
                    usable.min_by_key(|(node, _)| self.asking.get(*node).copied().unwrap_or(0))
                {
                    peer = Some((at, node.clone(), addr.clone()));
                    break;
                }
                if self.failures.get(&piece).copied().unwrap_or(0) >= GIVE_UP_ON_PEERS {
                    stale.push((at, None));
                    continue;
                }
                match view.claims.get(&piece) {
                    None => unclaimed.push(at),
                    Some(c)
                        if c.node == me
                            || view.dropped(&c.node, &me)
                            || now.duration_since(c.seen) >= self.fanout.patience =>
                    {
                        stale.push((at, Some(c.revision)))
                    }
                    // Renewed all along but never announced: read past it, taking the claim
                    // over if its holder lets it go, and read all the same if not.
                    Some(c) if c.overheld(now, self.fanout.patience, self.pieces[piece].bytes) => {
                        overheld.push((at, c.revision))
                    }
                    Some(_) => {}
                }
            }
            (peer, unclaimed, stale, overheld)
        };
        if let Some((at, node, addr)) = peer {
            let piece = self.todo.remove(at).expect("an index of todo");
            return Ok(Some((piece, Step::Peer { node, addr })));
        }
        for at in unclaimed {
            let piece = self.todo[at];
            if let Some(rev) = self.board.claim(piece).await? {
                self.todo.remove(at);
                return Ok(Some((piece, Step::Shared { claim: Some(rev) })));
            }
        }
        for (at, revision) in stale {
            let piece = self.todo[at];
            let claim = match revision {
                None => None,
                Some(rev) => match self.board.take_over(piece, rev).await? {
                    Some(rev) => Some(rev),
                    // Renewed or taken meanwhile: its reader is alive.
                    None => continue,
                },
            };
            self.todo.remove(at);
            return Ok(Some((piece, Step::Shared { claim })));
        }
        if let Some(&(at, revision)) = overheld.first() {
            let piece = self.todo[at];
            let claim = self.board.take_over(piece, revision).await?;
            if claim.is_none() {
                warn!(
                    piece,
                    "fan-out: a claim held past any read of its piece was not let go; reading the piece from the shared tier all the same"
                );
            }
            self.todo.remove(at);
            return Ok(Some((piece, Step::Shared { claim })));
        }
        Ok(None)
    }

    /// The piece's copy, as a future of its own: from the peer, or from the shared tier
    /// renewing its claim meanwhile.
    fn start(&mut self, piece: usize, step: Step) -> BoxFuture<'r, (usize, Ended)> {
        if self.pieces[piece].slice.is_some() {
            return self.start_slice(piece, step);
        }
        let job: &'r Fill<'a> = self.job;
        let files: Vec<FileRef> = job.files[self.pieces[piece].files.clone()].to_vec();
        match step {
            Step::Peer { node, addr } => {
                *self.asking.entry(node.clone()).or_default() += 1;
                let (key, tls) = (&self.fanout.key, self.fanout.tls.as_ref());
                let read_back = job.opts.verify_destination == VerifyMode::ReadBack;
                let files_in_piece = files.len() as u64;
                Box::pin(async move {
                    let fetched = fetch::fetch(
                        &addr,
                        key,
                        tls,
                        &job.swarm,
                        piece,
                        files,
                        job.staging.clone(),
                        read_back,
                    )
                    .await;
                    let ended = match fetched {
                        Ok(bytes) => Ended::Held {
                            bytes,
                            from: FanoutSource::Peer,
                            files: files_in_piece,
                        },
                        Err(error) => Ended::PeerFailed { node, error },
                    };
                    (piece, ended)
                })
            }
            Step::Shared { claim } => {
                let renewer = claim.map(|rev| (self.board.renewer(piece), rev));
                let every = (self.fanout.patience / 3).max(Duration::from_millis(100));
                Box::pin(async move {
                    let staging = Tier::Posix(job.staging.clone());
                    let progress = Progress::new();
                    let copy = job
                        .mover
                        .copy_all(job.src, &staging, &files, &job.opts, &progress);
                    let batch = match renewer {
                        None => copy.await,
                        Some((renewer, rev)) => renewer.holding(rev, every, copy).await,
                    };
                    (piece, read_shared(batch))
                })
            }
        }
    }

    /// A slice's copy: its bytes from the peer or the shared tier written into its file's
    /// temp file as they come and hashed meanwhile, held once they verified against the side
    /// data's hash.
    fn start_slice(&mut self, piece: usize, step: Step) -> BoxFuture<'r, (usize, Ended)> {
        let job: &'r Fill<'a> = self.job;
        let p = &self.pieces[piece];
        let index = p.files.start;
        let file = job.files[index].clone();
        let slice = p.slice.clone().expect("a slice");
        let (len, range) = (p.bytes, p.range().expect("a slice"));
        let assemblies = self.assemblies.clone();
        let read_back = job.opts.verify_destination == VerifyMode::ReadBack;
        let failed = move |what: &str, e: &dyn std::fmt::Display| {
            TransferError::new(
                ErrorKind::Io,
                Side::Destination,
                job.staging.name(),
                &job.files[index].path,
                format!("{what} task failed: {e}"),
            )
        };
        // Counts the verified slice: the file completes with its last.
        let written = move |from: FanoutSource| {
            let (assemblies, file) = (assemblies.clone(), file.clone());
            async move {
                let counted = tokio::task::spawn_blocking(move || {
                    assemblies.slice_written(index, &file, read_back)
                })
                .await;
                match counted {
                    Ok(Ok(complete)) => Ended::Held {
                        bytes: len,
                        from,
                        files: u64::from(complete),
                    },
                    Ok(Err(e)) => Ended::Failed(e),
                    Err(e) => Ended::Failed(failed("writing", &e)),
                }
            }
        };
        let landing = match self.assemblies.landing(index, &job.files[index]) {
            Ok(landing) => landing,
            Err(e) => return Box::pin(async move { (piece, Ended::Failed(e)) }),
        };
        let path = job.files[index].path.clone();
        match step {
            Step::Peer { node, addr } => {
                *self.asking.entry(node.clone()).or_default() += 1;
                let (key, tls) = (&self.fanout.key, self.fanout.tls.as_ref());
                Box::pin(async move {
                    let fetched = fetch::fetch_slice(
                        &addr,
                        key,
                        tls,
                        &job.swarm,
                        piece,
                        landing,
                        (&path, slice.offset, len),
                        slice.hash,
                    )
                    .await;
                    let ended = match fetched {
                        Ok(()) => written(FanoutSource::Peer).await,
                        Err(error) => Ended::PeerFailed { node, error },
                    };
                    (piece, ended)
                })
            }
            Step::Shared { claim } => {
                let renewer = claim.map(|rev| (self.board.renewer(piece), rev));
                let every = (self.fanout.patience / 3).max(Duration::from_millis(100));
                Box::pin(async move {
                    let read = async {
                        // A copy slot of the copy's class, as the mover takes for a whole file.
                        let _permit = job.mover.scheduler().acquire(job.opts.priority).await;
                        // An S3 tier's range comes in one ranged GET, awaited here; a posix
                        // tier's is read on the blocking thread that writes it.
                        let bytes = match job.src {
                            Tier::S3(_) => {
                                SliceBytes::Fetched(job.src.read_range(&path, range.clone()).await?)
                            }
                            Tier::Posix(tier) => SliceBytes::Read(tier.clone()),
                        };
                        let tier = job.src.name().to_owned();
                        let copied = tokio::task::spawn_blocking(move || {
                            copy_slice(bytes, (&tier, &path, range), slice.hash, &landing)
                        });
                        match copied.await {
                            Ok(Ok(())) => Ok(()),
                            Ok(Err(e)) => Err(e),
                            Err(e) => Err(failed("reading", &e)),
                        }
                    };
                    let read = match renewer {
                        None => read.await,
                        Some((renewer, rev)) => renewer.holding(rev, every, read).await,
                    };
                    let ended = match read {
                        Ok(()) => written(FanoutSource::Shared).await,
                        Err(e) => Ended::Failed(e),
                    };
                    (piece, ended)
                })
            }
        }
    }

    async fn ended(
        &mut self,
        holding: &serve::Holding,
        piece: usize,
        ended: Ended,
    ) -> Result<(), TransferError> {
        match ended {
            Ended::Held { bytes, from, files } => {
                holding.holds(piece);
                fanout_read(from, bytes);
                match from {
                    FanoutSource::Shared => {
                        self.filled.pieces_from_shared += 1;
                        self.filled.shared_bytes += bytes;
                    }
                    FanoutSource::Peer => {
                        self.filled.pieces_from_peers += 1;
                        self.filled.peer_bytes += bytes;
                    }
                }
                for _ in 0..files {
                    self.job.progress.file_done();
                }
                self.job.progress.add_bytes(self.pieces[piece].bytes);
                if let Err(e) = self.board.announce(piece, &self.fanout.advertise).await {
                    // Held and served all the same; peers that do not hear of it read it
                    // elsewhere.
                    warn!(error = %e, piece, "fan-out: a piece held here was not announced");
                }
                Ok(())
            }
            Ended::Failed(e) => Err(e),
            Ended::PeerFailed { node, error } => {
                if let Some(n) = self.asking.get_mut(&node) {
                    *n = n.saturating_sub(1);
                }
                *self.failures.entry(piece).or_default() += 1;
                self.todo.push_back(piece);
                match error {
                    FetchError::Local(e) => Err(e),
                    FetchError::Unavailable(why) => {
                        warn!(peer = %node, piece, %why, "fan-out: a peer could not give a piece; asking elsewhere");
                        self.cooling
                            .insert((piece, node), Instant::now() + Duration::from_secs(1));
                        Ok(())
                    }
                    FetchError::Spoiled { file, why } => {
                        warn!(peer = %node, piece, %file, %why, "fan-out: a peer served bytes that do not verify; dropped from the swarm");
                        fanout_peer_dropped();
                        self.filled.peers_dropped += 1;
                        let report = Spoiled { file, why };
                        self.board
                            .spoiled(&node, &report)
                            .await
                            .map_err(|e| board_failed(self.job, e))
                    }
                }
            }
        }
    }
}

/// Where a slice's bytes come from on the shared tier: read from a posix tier, or fetched
/// already (an S3 tier's one ranged GET).
enum SliceBytes {
    Read(PosixTier),
    Fetched(Vec<u8>),
}

/// Copies the bytes `range` of `path` on the shared tier `tier` into `landing` (the same range
/// of its file's temp file), hashing them as they pass; `Ok` once their piece hash is `hash`.
/// Blocking: a posix tier is read a MiB at a time through one reused buffer.
fn copy_slice(
    bytes: SliceBytes,
    (tier, path, range): (&str, &str, std::ops::Range<u64>),
    hash: [u8; 32],
    landing: &assembly::SliceLanding,
) -> Result<(), TransferError> {
    let mut hasher = PieceDigest::new();
    match bytes {
        SliceBytes::Fetched(bytes) => {
            hasher.update(&bytes);
            landing.write_at(&bytes, range.start)?;
        }
        SliceBytes::Read(posix) => {
            let file = posix.open_read(path)?;
            let mut buf = vec![0u8; SLICE_CHUNK.min((range.end - range.start) as usize)];
            let mut at = range.start;
            while at < range.end {
                let want = buf.len().min((range.end - at) as usize);
                posix.read_exact_at(&file, path, &mut buf[..want], at)?;
                hasher.update(&buf[..want]);
                landing.write_at(&buf[..want], at)?;
                at += want as u64;
            }
        }
    }
    let found = hasher.finish();
    if found != hash {
        return Err(TransferError::new(
            ErrorKind::ChecksumMismatch,
            Side::Source,
            tier,
            path,
            format!(
                "bytes {range:?} hash to {}, the side data says {}",
                hex::encode(found),
                hex::encode(hash)
            ),
        ));
    }
    Ok(())
}

/// How much of a slice read from a posix shared tier is read and written at a time.
const SLICE_CHUNK: usize = 1 << 20;

/// Side data objects asked for at once.
const SIDE_DATA_AT_ONCE: usize = 16;

/// The side data of every file of `files` larger than a piece, by index: where a file has
/// none (a version validated before side data was written) it is fanned out whole, and so it
/// is where its side data does not read (logged: the file is still verified whole).
pub async fn side_data(
    js: &async_nats::jetstream::Context,
    files: &[FileRef],
) -> Result<HashMap<usize, PieceHashes>, ManifestError> {
    let mut side = HashMap::new();
    if !files.iter().any(|f| PieceHashes::wanted(f.size)) {
        return Ok(side);
    }
    let store = match ManifestStore::open(js, stagehand_schemas::subject::MANIFEST_BUCKET).await {
        Ok(store) => store,
        Err(e) if e.kind == ManifestErrorKind::NotFound => return Ok(side),
        Err(e) => return Err(e),
    };
    // Asked several at a time: a version of many large files is one question per file.
    let wanted: Vec<(usize, FileRef)> = files
        .iter()
        .enumerate()
        .filter(|(_, f)| PieceHashes::wanted(f.size))
        .map(|(i, f)| (i, f.clone()))
        .collect();
    let mut asked = futures::stream::iter(wanted)
        .map(|(i, file)| {
            let store = store.clone();
            async move {
                let found = store.pieces(&file.sha256, file.size).await;
                (i, file, found)
            }
        })
        .buffer_unordered(SIDE_DATA_AT_ONCE);
    while let Some((i, file, found)) = asked.next().await {
        match found {
            Ok(Some(hashes)) => {
                side.insert(i, hashes);
            }
            Ok(None) => {}
            Err(e) if e.kind == ManifestErrorKind::Malformed => {
                warn!(file = %file.path, error = %e, "fan-out: side data unreadable; the file moves whole");
            }
            Err(e) => return Err(e),
        }
    }
    Ok(side)
}

/// How a piece read from the shared tier ended: every file copied or found verified.
fn read_shared(batch: BatchReport) -> Ended {
    let mut bytes = 0;
    let files = batch.results.len() as u64;
    for result in batch.results {
        match result.result {
            Ok(outcome) => bytes += outcome.bytes(),
            Err(e) => return Ended::Failed(e),
        }
    }
    Ended::Held {
        bytes,
        from: FanoutSource::Shared,
        files,
    }
}

fn cancelled(job: &Fill<'_>) -> TransferError {
    TransferError::new(
        ErrorKind::Cancelled,
        Side::Destination,
        job.staging.name(),
        "",
        "the fan-out was cancelled; the staging folder is kept for a resume",
    )
}
