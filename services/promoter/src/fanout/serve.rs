//! Serving pieces to peers: plain HTTP/1.1 (hyper), one route,
//! `GET /v1/swarms/<swarm>/pieces/<n>`, signed with the agents' secret (`auth.rs`),
//! answered with the piece's files one after another in manifest order (`Content-Length` their
//! sum), or the bytes of the slice of one large file it is (from the file's temp file while
//! the file is put together, `assembly.rs`). Only a piece this node announced is served — every file of it verified when it landed
//! here — and only from the folder of the swarm it was staged for, through the tier's confined
//! handles: a peer names a swarm and a piece number, never a path. The receiver verifies every
//! file against the manifest; this side does not hash again.

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::io::{self, ErrorKind};
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper::{Method, Request, Response, StatusCode, header};
use hyper_util::rt::TokioIo;
use stagehand_mover::PosixTier;
use stagehand_schemas::manifest::FileRef;
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::assembly::Assemblies;
use super::auth::Gate;
use super::pieces::Piece;

/// Swarms this node keeps serving after its own copy is published: the newest ones, so that a
/// node that joins late still finds their pieces here. Each holds its version's file list in
/// memory (about 150 bytes a file), so this bounds the agent's memory too.
const SWARMS_HELD: usize = 8;
/// Pieces served at once; a peer asking beyond that is told to come back (503) and asks
/// another holder meanwhile.
const SERVING_AT_ONCE: usize = 32;
/// How much of a file is read and sent at a time.
const CHUNK: usize = 1 << 20;

pub type Body = BoxBody<Bytes, io::Error>;

/// One swarm's pieces on this node: which it holds, and the folder they are in (the staging
/// folder while the copy runs, the published one after).
pub struct Holding {
    pub files: Arc<[FileRef]>,
    pub pieces: Arc<[Piece]>,
    /// The large files being put together from their slices.
    pub assemblies: Arc<Assemblies>,
    have: Mutex<Vec<bool>>,
    at: Mutex<PosixTier>,
    /// The replica the pieces make up, once published (served from its folder).
    published: Mutex<Option<ReplicaAt>>,
}

/// Where a published replica is, for a fact about it.
#[derive(Debug, Clone)]
pub struct ReplicaAt {
    pub project: String,
    pub dataset: String,
    pub version: String,
    pub tier: String,
    pub prefix: String,
}

impl Holding {
    /// Marks `piece` held: from now on it is served.
    pub fn holds(&self, piece: usize) {
        if let Some(h) = lock(&self.have).get_mut(piece) {
            *h = true;
        }
    }

    /// The pieces held.
    pub fn held(&self) -> Vec<usize> {
        lock(&self.have)
            .iter()
            .enumerate()
            .filter_map(|(i, h)| h.then_some(i))
            .collect()
    }

    /// The pieces are in `folder` now, the published `replica`.
    pub fn moved_to(&self, folder: PosixTier, replica: ReplicaAt) {
        *lock(&self.at) = folder;
        *lock(&self.published) = Some(replica);
    }

    /// The folder the pieces are served from.
    pub fn folder(&self) -> PosixTier {
        lock(&self.at).clone()
    }

    /// The published replica, if the set was published.
    pub fn published_replica(&self) -> Option<ReplicaAt> {
        lock(&self.published).clone()
    }
}

/// The swarms this node serves, newest last.
#[derive(Default)]
pub struct Registry {
    swarms: Mutex<Swarms>,
}

#[derive(Default)]
struct Swarms {
    by_id: HashMap<String, Arc<Holding>>,
    /// Oldest first: the first to go when more than [`SWARMS_HELD`] are held.
    order: VecDeque<String>,
}

impl Registry {
    /// Starts holding `swarm`'s pieces in `folder` (none held yet); an earlier holding of the
    /// same swarm is replaced.
    pub fn hold(
        &self,
        swarm: &str,
        files: Arc<[FileRef]>,
        pieces: Arc<[Piece]>,
        assemblies: Arc<Assemblies>,
        folder: PosixTier,
    ) -> Arc<Holding> {
        let holding = Arc::new(Holding {
            have: Mutex::new(vec![false; pieces.len()]),
            files,
            pieces,
            assemblies,
            at: Mutex::new(folder),
            published: Mutex::new(None),
        });
        let mut swarms = lock(&self.swarms);
        swarms.order.retain(|s| s != swarm);
        swarms.order.push_back(swarm.to_owned());
        swarms.by_id.insert(swarm.to_owned(), holding.clone());
        while swarms.order.len() > SWARMS_HELD {
            if let Some(old) = swarms.order.pop_front() {
                swarms.by_id.remove(&old);
            }
        }
        holding
    }

    /// Stops serving `swarm` (its folder was discarded).
    pub fn forget(&self, swarm: &str) {
        let mut swarms = lock(&self.swarms);
        swarms.by_id.remove(swarm);
        swarms.order.retain(|s| s != swarm);
    }

    /// Whether a swarm whose name starts with `base` ([`super::Fanout::swarm`]) is held: the
    /// version is served, whatever its cut.
    pub fn serves(&self, base: &str) -> bool {
        lock(&self.swarms).order.iter().any(|s| s.starts_with(base))
    }

    pub fn get(&self, swarm: &str) -> Option<Arc<Holding>> {
        lock(&self.swarms).by_id.get(swarm).cloned()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Serves pieces on `listener` until `shutdown` (through TLS with `tls`).
pub async fn serve(
    listener: TcpListener,
    registry: Arc<Registry>,
    gate: Gate,
    tls: Option<tokio_rustls::TlsAcceptor>,
    shutdown: CancellationToken,
) -> Result<(), Infallible> {
    let slots = Arc::new(Semaphore::new(SERVING_AT_ONCE));
    let gate = Arc::new(gate);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    warn!(error = %e, "fan-out: accepting a peer failed");
                    continue;
                }
            },
            _ = shutdown.cancelled() => return Ok(()),
        };
        let (registry, gate, slots, tls) =
            (registry.clone(), gate.clone(), slots.clone(), tls.clone());
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let (registry, gate, slots) = (registry.clone(), gate.clone(), slots.clone());
                async move { Ok::<_, Infallible>(answer(&registry, &gate, &slots, req)) }
            });
            let http = hyper::server::conn::http1::Builder::new();
            let served = match tls {
                None => http.serve_connection(TokioIo::new(stream), service).await,
                Some(tls) => match tls.accept(stream).await {
                    Ok(stream) => http.serve_connection(TokioIo::new(stream), service).await,
                    Err(e) => {
                        warn!(error = %e, %peer, "fan-out: a peer failed the TLS handshake");
                        return;
                    }
                },
            };
            if let Err(e) = served {
                debug!(error = %e, %peer, "fan-out: a peer's connection ended");
            }
        });
    }
}

fn plain(status: StatusCode, text: &str) -> Response<Body> {
    let mut r = Response::new(
        Full::new(Bytes::from(format!("{text}\n")))
            .map_err(|never| match never {})
            .boxed(),
    );
    *r.status_mut() = status;
    r
}

/// The route's parameters: `/v1/swarms/<swarm>/pieces/<n>`.
fn route(path: &str) -> Option<(&str, usize)> {
    let rest = path.strip_prefix("/v1/swarms/")?;
    let (swarm, rest) = rest.split_once('/')?;
    let n = rest.strip_prefix("pieces/")?.parse().ok()?;
    (!swarm.is_empty() && swarm.bytes().all(|b| b.is_ascii_hexdigit())).then_some((swarm, n))
}

fn answer(
    registry: &Registry,
    gate: &Gate,
    slots: &Arc<Semaphore>,
    req: Request<Incoming>,
) -> Response<Body> {
    let signed = req.uri().path_and_query().map_or("", |p| p.as_str());
    let authorization = req.headers().get(header::AUTHORIZATION);
    if let Err(refusal) = gate.admit(req.method().as_str(), signed, authorization) {
        return plain(StatusCode::UNAUTHORIZED, &refusal.to_string());
    }
    if req.method() != Method::GET {
        return plain(StatusCode::METHOD_NOT_ALLOWED, "only GET");
    }
    let Some((swarm, n)) = route(req.uri().path()) else {
        return plain(StatusCode::NOT_FOUND, "no such route");
    };
    let Some(holding) = registry.get(swarm) else {
        return plain(
            StatusCode::NOT_FOUND,
            "this node holds nothing of that swarm",
        );
    };
    let held = lock(&holding.have).get(n).copied().unwrap_or(false);
    let Some(piece) = holding.pieces.get(n).filter(|_| held) else {
        return plain(StatusCode::NOT_FOUND, "this node does not hold that piece");
    };
    let Ok(slot) = slots.clone().try_acquire_owned() else {
        return plain(StatusCode::SERVICE_UNAVAILABLE, "serving too many pieces");
    };
    let parts: Vec<Part> = match piece.range() {
        None => holding.files[piece.files.clone()]
            .iter()
            .map(|file| Part {
                range: 0..file.size,
                file: file.clone(),
                reader: None,
            })
            .collect(),
        Some(range) => vec![Part {
            file: holding.files[piece.files.start].clone(),
            range,
            reader: holding.assemblies.reader(piece.files.start),
        }],
    };
    let folder = lock(&holding.at).clone();
    let (tx, rx) = mpsc::channel(4);
    tokio::task::spawn_blocking(move || send_piece(&folder, &parts, &tx, slot));
    let frames = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|chunk| (chunk, rx))
    });
    let mut r = Response::new(BodyExt::boxed(StreamBody::new(frames)));
    r.headers_mut()
        .insert(header::CONTENT_LENGTH, piece.bytes.into());
    r
}

/// What a piece sends of one file: the bytes `range`, read from `reader` (a file still being
/// put together) or from the file under its name.
struct Part {
    file: FileRef,
    range: std::ops::Range<u64>,
    reader: Option<Arc<std::fs::File>>,
}

/// Reads the piece's parts in order into `tx`; a file shorter than the manifest says ends
/// the body with an error (the peer reads elsewhere).
fn send_piece(
    folder: &PosixTier,
    parts: &[Part],
    tx: &mpsc::Sender<Result<Frame<Bytes>, io::Error>>,
    _slot: OwnedSemaphorePermit,
) {
    let mut sent = 0u64;
    for part in parts {
        let file = &part.file;
        let opened = match &part.reader {
            Some(reader) => reader.clone(),
            None => match folder.open_read(&file.path) {
                Ok(f) => Arc::new(f),
                Err(e) => {
                    let _ = tx.blocking_send(Err(io::Error::other(e)));
                    return;
                }
            },
        };
        let mut offset = part.range.start;
        while offset < part.range.end {
            let want = CHUNK.min((part.range.end - offset) as usize);
            let mut buf = vec![0u8; want];
            let n = match opened.read_at(&mut buf, offset) {
                Ok(0) => {
                    let _ = tx.blocking_send(Err(io::Error::new(
                        ErrorKind::UnexpectedEof,
                        format!("{} is shorter than its {} bytes", file.path, file.size),
                    )));
                    return;
                }
                Ok(n) => n,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    let _ = tx.blocking_send(Err(e));
                    return;
                }
            };
            buf.truncate(n);
            offset += n as u64;
            if tx.blocking_send(Ok(Frame::data(Bytes::from(buf)))).is_err() {
                // The peer hung up.
                stagehand_telemetry::work::fanout_served(sent + offset - part.range.start);
                return;
            }
        }
        sent += part.range.end - part.range.start;
    }
    stagehand_telemetry::work::fanout_served(sent);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_one_route_with_a_hex_swarm_is_answered() {
        assert_eq!(route("/v1/swarms/ab12/pieces/7"), Some(("ab12", 7)));
        assert_eq!(route("/v1/swarms/../pieces/7"), None);
        assert_eq!(route("/v1/swarms/ab12/pieces/x"), None);
        assert_eq!(route("/v1/swarms//pieces/1"), None);
        assert_eq!(route("/v1/swarms/ab12/files/1"), None);
    }
}
