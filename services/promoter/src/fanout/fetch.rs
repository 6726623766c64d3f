//! Fetching a piece from a peer: one `GET` (see `serve`), its body split at the manifest's
//! file boundaries, each file hashed as it is written beside its final name in the staging
//! folder and renamed into place only when its SHA-256 is the manifest's. A file that does not
//! verify names the peer that served it; a body cut short, a refusal or silence only make
//! this node ask elsewhere. A slice of a large file ([`fetch_slice`]) is written into its
//! file's temp file as it arrives and hashed meanwhile; it counts only once its piece hash
//! (BLAKE3) is the side data's.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::{Request, StatusCode, header};
use hyper_util::rt::TokioIo;
use sha2::{Digest, Sha256};
use stagehand_mover::{PosixTier, TransferError};
use stagehand_schemas::manifest::FileRef;
use stagehand_schemas::pieces::PieceDigest;
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use super::assembly::SliceLanding;
use super::auth::AgentKey;
use super::tls::AgentTls;

/// An HTTP/1.1 client connection over `io`, driven by a task of its own.
async fn handshake<I>(
    io: I,
) -> Result<
    (
        hyper::client::conn::http1::SendRequest<Empty<Bytes>>,
        tokio::task::JoinHandle<()>,
    ),
    hyper::Error,
>
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(io)).await?;
    let driving = tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok((sender, driving))
}

/// Longest wait for a peer to accept a connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest silence of a peer mid-piece (a frozen or dying node) before this node asks another.
const SILENCE_TIMEOUT: Duration = Duration::from_secs(20);

/// Why a piece did not come from a peer.
#[derive(Debug)]
pub enum FetchError {
    /// The peer could not give it (unreachable, refused, busy, gone silent, the body cut
    /// short): ask another holder, or the shared tier.
    Unavailable(String),
    /// The peer's bytes of `file` did not verify: drop the peer from the swarm.
    Spoiled { file: String, why: String },
    /// This node's own tier failed (full disk, I/O error): the copy fails with it.
    Local(TransferError),
}

/// A peer's answer to a piece request, its body still to read.
struct Answer {
    response: hyper::Response<hyper::body::Incoming>,
    /// The connection's task, ended when the answer is dropped or read.
    driving: tokio::task::JoinHandle<()>,
}

impl Drop for Answer {
    fn drop(&mut self) {
        self.driving.abort();
    }
}

/// Asks the peer at `addr` for piece `n` of `swarm`: its answer, once it said 200.
async fn ask(
    addr: &str,
    key: &AgentKey,
    tls: Option<&AgentTls>,
    swarm: &str,
    n: usize,
) -> Result<Answer, FetchError> {
    let unavailable = |what: &str, e: &dyn std::fmt::Display| {
        FetchError::Unavailable(format!("peer {addr}: {what}: {e}"))
    };
    let stream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr))
        .await
        .map_err(|e| unavailable("connect", &e))?
        .map_err(|e| unavailable("connect", &e))?;
    let (mut sender, driving) = match tls {
        None => handshake(stream).await,
        Some(tls) => {
            let name = tls
                .name_for(addr)
                .map_err(|e| unavailable("its TLS name", &e))?;
            let stream = tokio::time::timeout(CONNECT_TIMEOUT, tls.connector.connect(name, stream))
                .await
                .map_err(|e| unavailable("TLS handshake", &e))?
                .map_err(|e| unavailable("TLS handshake", &e))?;
            handshake(stream).await
        }
    }
    .map_err(|e| unavailable("handshake", &e))?;
    let path = format!("/v1/swarms/{swarm}/pieces/{n}");
    let req = Request::get(&path)
        .header(header::HOST, addr)
        .header(header::AUTHORIZATION, key.sign("GET", &path))
        .body(Empty::<Bytes>::new())
        .map_err(|e| unavailable("request", &e))?;
    let answered = tokio::time::timeout(SILENCE_TIMEOUT, sender.send_request(req)).await;
    let answer = Answer {
        response: answered
            .map_err(|e| unavailable("answer", &e))?
            .map_err(|e| unavailable("answer", &e))?,
        driving,
    };
    if answer.response.status() != StatusCode::OK {
        return Err(FetchError::Unavailable(format!(
            "peer {addr} answered {} for piece {n}",
            answer.response.status()
        )));
    }
    Ok(answer)
}

/// Fetches piece `n` of `swarm`, the `len` bytes at `offset` of a large file whose piece hash is
/// `hash`, from the peer at `addr` into `landing` (its file's temp file), hashing them as
/// they are written: `Ok` once they verified. Bytes that do not verify are the peer's fault;
/// they are written over when the slice comes from elsewhere.
#[allow(clippy::too_many_arguments)]
pub async fn fetch_slice(
    addr: &str,
    key: &AgentKey,
    tls: Option<&AgentTls>,
    swarm: &str,
    n: usize,
    landing: SliceLanding,
    (path, offset, len): (&str, u64, u64),
    hash: [u8; 32],
) -> Result<(), FetchError> {
    let answer = ask(addr, key, tls, swarm, n).await?;
    let file = path.to_owned();
    let write = move |mut rx: mpsc::Receiver<Bytes>| {
        let mut hasher = PieceDigest::new();
        let mut written = 0u64;
        while let Some(chunk) = rx.blocking_recv() {
            if written + chunk.len() as u64 > len {
                return Err(FetchError::Spoiled {
                    file,
                    why: format!("piece {n} went on past its {len} bytes"),
                });
            }
            hasher.update(&chunk);
            landing
                .write_at(&chunk, offset + written)
                .map_err(FetchError::Local)?;
            written += chunk.len() as u64;
        }
        if written < len {
            return Err(FetchError::Unavailable(format!(
                "the body ended after {written} of its {len} bytes"
            )));
        }
        let found = hasher.finish();
        if found != hash {
            return Err(FetchError::Spoiled {
                file,
                why: format!(
                    "piece {n} hashes to {}, the side data says {}",
                    hex::encode(found),
                    hex::encode(hash)
                ),
            });
        }
        Ok(())
    };
    receive(answer, addr, n, write).await
}

/// Fetches piece `n` of `swarm` from the peer at `addr` into `staging`: the files' bytes.
#[allow(clippy::too_many_arguments)]
pub async fn fetch(
    addr: &str,
    key: &AgentKey,
    tls: Option<&AgentTls>,
    swarm: &str,
    n: usize,
    files: Vec<FileRef>,
    staging: PosixTier,
    read_back: bool,
) -> Result<u64, FetchError> {
    let answer = ask(addr, key, tls, swarm, n).await?;
    receive(answer, addr, n, move |rx| {
        write_piece(&staging, &files, rx, read_back)
    })
    .await
}

/// Reads the body of `answer` (piece `n` from the peer at `addr`) into `write`, run on a
/// blocking thread with the body's chunks as they come: `write`'s answer, unless the body was
/// cut short, which only makes this node ask elsewhere. Bytes that did not verify are the
/// peer's fault even if the body was cut after them.
async fn receive<T: Send + 'static>(
    mut answer: Answer,
    addr: &str,
    n: usize,
    write: impl FnOnce(mpsc::Receiver<Bytes>) -> Result<T, FetchError> + Send + 'static,
) -> Result<T, FetchError> {
    let (tx, rx) = mpsc::channel::<Bytes>(8);
    let writer = tokio::task::spawn_blocking(move || write(rx));
    let mut cut = None;
    loop {
        match tokio::time::timeout(SILENCE_TIMEOUT, answer.response.body_mut().frame()).await {
            Err(_) => {
                cut = Some(format!("silent for {SILENCE_TIMEOUT:?}"));
                break;
            }
            Ok(None) => break,
            Ok(Some(Err(e))) => {
                cut = Some(e.to_string());
                break;
            }
            Ok(Some(Ok(frame))) => {
                if let Ok(data) = frame.into_data()
                    && tx.send(data).await.is_err()
                {
                    // The writer stopped: its answer says why.
                    break;
                }
            }
        }
    }
    drop(tx);
    drop(answer);
    let written = writer
        .await
        .map_err(|e| FetchError::Unavailable(format!("writing piece {n}: {e}")))?;
    match (written, cut) {
        (Err(e @ FetchError::Spoiled { .. }), _) | (Err(e @ FetchError::Local(_)), _) => Err(e),
        (Err(FetchError::Unavailable(short)), Some(cut)) => Err(FetchError::Unavailable(format!(
            "peer {addr}: piece {n} cut short ({cut}): {short}"
        ))),
        (Err(FetchError::Unavailable(short)), None) => Err(FetchError::Unavailable(format!(
            "peer {addr}: piece {n}: {short}"
        ))),
        (Ok(_), Some(cut)) => Err(FetchError::Unavailable(format!(
            "peer {addr}: piece {n}: {cut}"
        ))),
        (Ok(written), None) => Ok(written),
    }
}

/// Writes the piece's files from the body's chunks: each beside its final name, hashed as
/// written, renamed in (one batch, made durable) only when every file verified. A file already
/// in the folder with its size (a resumed staging folder) is not written again, but its bytes
/// from the peer are still checked. Blocking.
fn write_piece(
    staging: &PosixTier,
    files: &[FileRef],
    mut rx: mpsc::Receiver<Bytes>,
    read_back: bool,
) -> Result<u64, FetchError> {
    let mut pending = Vec::with_capacity(files.len());
    let mut buf = Bytes::new();
    let mut total = 0u64;
    for file in files {
        let present = staging
            .stat(&file.path)
            .map_err(FetchError::Local)?
            .is_some_and(|size| size == file.size);
        let landing = match present {
            true => None,
            false => Some(
                staging
                    .create_atomic(&file.path, file.size)
                    .map_err(FetchError::Local)?,
            ),
        };
        let mut hasher = Sha256::new();
        let mut written = 0u64;
        while written < file.size {
            if buf.is_empty() {
                buf = rx.blocking_recv().ok_or_else(|| {
                    FetchError::Unavailable(format!(
                        "the body ended in {} after {written} of its {} bytes",
                        file.path, file.size
                    ))
                })?;
            }
            let take = buf.len().min((file.size - written) as usize);
            let chunk = buf.split_to(take);
            hasher.update(&chunk);
            if let Some(landing) = &landing {
                landing
                    .write_all_at(&chunk, written)
                    .map_err(FetchError::Local)?;
            }
            written += take as u64;
        }
        let sha = hex::encode(hasher.finalize());
        if sha != file.sha256 {
            return Err(FetchError::Spoiled {
                file: file.path.clone(),
                why: format!("hashes to {sha}, the manifest says {}", file.sha256),
            });
        }
        if let Some(landing) = landing {
            if read_back {
                let there = landing.hash_written().map_err(FetchError::Local)?;
                if there.sha256 != file.sha256 {
                    return Err(FetchError::Local(TransferError::new(
                        stagehand_mover::ErrorKind::ChecksumMismatch,
                        stagehand_mover::Side::Destination,
                        staging.name(),
                        &file.path,
                        format!(
                            "read back it hashes to {}, the bytes written hashed to {}",
                            there.sha256, file.sha256
                        ),
                    )));
                }
            }
            pending.push(landing.into_pending());
        }
        total += file.size;
    }
    if !buf.is_empty() || rx.blocking_recv().is_some() {
        return Err(FetchError::Spoiled {
            file: files.last().map(|f| f.path.clone()).unwrap_or_default(),
            why: "the piece went on past its last file's bytes".into(),
        });
    }
    for committed in staging.commit_batch(pending) {
        committed.map_err(FetchError::Local)?;
    }
    Ok(total)
}
