//! Writing one shard: a tar archive in the WebDataset layout with deterministic headers, and
//! its index.
//!
//! Every header is a GNU header whose only varying fields are the member's name and size:
//! mode `0644`, uid and gid 0, no user or group name, mtime 0, regular file. Names longer
//! than the header's 100 bytes get a GNU long-name entry (`././@LongLink`), itself fixed in
//! every field but its length. So the same members in the same order always give the same
//! bytes, whoever packs them, on whatever machine, at whatever time.
//!
//! The index (`shard-NNNNNN.index.jsonl`) has one JSON line per sample, in shard order:
//! `{"key":"train/0001","members":[{"path":"train/0001.cls","offset":1536,"size":2,"sha256":"…"},…]}`
//! where `offset` is where the member's bytes start in the shard, `size` their length and
//! `sha256` the raw file's hash from the upload — re-checked against the bytes read before the
//! member was written. Any reader can check any member at any hop with one ranged read.
//!
//! Framing, hashing and writing are three threads ([`write_shards`]): the writer frames
//! members into pooled 4 MiB chunks of tar stream and index; the hasher hashes each chunk;
//! the disk thread writes it — the tar stream with `O_DIRECT` where the filesystem takes it
//! (a shard is large and sequential, and is not read again by this process: writing it
//! through the page cache would cost a copy into the cache and the writeback's work later,
//! as much CPU as hashing it), its unaligned end and the index through the cache — and
//! commits each finished shard (`fdatasync`, rename, directory `fsync`) while the next one
//! is framed and hashed.
//!
//! Every file of the version written here that is larger than a piece (a shard, in practice)
//! also has the BLAKE3 hash of each of its pieces taken, and handed to a [`KeepPieces`] once
//! the file is committed: the side data node agents judge each piece of it by when they fan
//! the version out (`stagehand_schemas::pieces`). A shard's pieces are hashed on the disk
//! thread, as each chunk is written: that thread mostly waits for the device, while the hasher
//! thread already spends a core on the shard's SHA-256.

use std::fs::File;
use std::io::{self, BufWriter, Read, Write};
use std::os::unix::fs::FileExt;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};

use serde::Serialize;
use sha2::{Digest, Sha256};
use stagehand_mover::{AtomicFile, DIRECT_ALIGN, PosixTier, TransferError};
use stagehand_schemas::FileRef;
use stagehand_schemas::pieces::{PieceHasher, PieceHashes, PieceHashesBuilder};

use crate::sort::Member;

/// The name of shard `n` (0-based) of a prepared version.
pub fn shard_name(n: u32) -> String {
    format!("shard-{n:06}.tar")
}

/// The name of the index of shard `n`.
pub fn index_name(n: u32) -> String {
    format!("shard-{n:06}.index.jsonl")
}

/// The deterministic header of a member of `size` bytes (the name is set when it is
/// appended).
pub fn member_header(size: u64) -> tar::Header {
    let mut header = tar::Header::new_gnu();
    header.set_entry_type(tar::EntryType::Regular);
    header.set_size(size);
    header.set_mode(0o644);
    header.set_uid(0);
    header.set_gid(0);
    header.set_mtime(0);
    header
}

/// Takes the side data of a file of the version, once the file is committed: the file
/// (name, size, SHA-256) and the BLAKE3 hash of each of its pieces. Called only for a file larger
/// than a piece; an error stops the writing.
pub type KeepPieces<'a> = dyn Fn(&FileRef, PieceHashes) -> Result<(), ShardError> + Sync + 'a;

/// Hands the side data of the committed file `name` to `keep`, when it has any.
fn keep_pieces(
    keep: &KeepPieces<'_>,
    name: &str,
    size: u64,
    sha256: &str,
    pieces: PieceHashes,
) -> Result<(), ShardError> {
    if pieces.pieces.is_empty() {
        return Ok(());
    }
    keep(&FileRef::new(name, size, sha256), pieces)
}

fn digests_of(hasher: PieceHasher) -> (String, PieceHashes) {
    let (whole, pieces) = hasher.finish();
    (hex::encode(whole), pieces)
}

/// A writer that counts and hashes what passes through it (whole, and piece by piece with a
/// [`PieceHasher::new`]).
pub struct HashingWriter<W> {
    inner: W,
    hasher: PieceHasher,
    written: u64,
}

impl<W: Write> HashingWriter<W> {
    pub fn new(inner: W, hasher: PieceHasher) -> Self {
        HashingWriter {
            inner,
            hasher,
            written: 0,
        }
    }

    pub fn written(&self) -> u64 {
        self.written
    }

    /// The inner writer, the bytes written, their SHA-256 (hex) and piece hashes.
    pub fn finish(self) -> (W, u64, String, PieceHashes) {
        let (sha, pieces) = digests_of(self.hasher);
        (self.inner, self.written, sha, pieces)
    }
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.written += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// A reader that hashes what passes through it and refuses to end early: reading fewer
/// than `expected` bytes is an `UnexpectedEof` error (a tar entry must be exactly as long
/// as its header says).
pub struct HashingReader<R> {
    inner: io::Take<R>,
    hasher: Sha256,
    read: u64,
    expected: u64,
}

impl<R: Read> HashingReader<R> {
    pub fn new(inner: R, expected: u64) -> Self {
        HashingReader {
            inner: inner.take(expected),
            hasher: Sha256::new(),
            read: 0,
            expected,
        }
    }

    /// The SHA-256 (hex) of what was read.
    pub fn finish(self) -> String {
        hex::encode(self.hasher.finalize())
    }
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if n == 0 && self.read < self.expected && !buf.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "the file ended after {} of its {} bytes",
                    self.read, self.expected
                ),
            ));
        }
        self.hasher.update(&buf[..n]);
        self.read += n as u64;
        Ok(n)
    }
}

/// One member of an index line.
#[derive(Debug, Serialize)]
struct IndexMember<'a> {
    path: &'a str,
    offset: u64,
    size: u64,
    sha256: &'a str,
}

/// One line of a shard index: a sample.
#[derive(Debug, Serialize)]
struct IndexLine<'a> {
    key: &'a str,
    members: Vec<IndexMember<'a>>,
}

/// What a member's bytes are when it reaches the writer.
pub enum Bytes<'a> {
    /// Read and proven by a reader thread.
    Loaded(&'a [u8]),
    /// Too large to hold: streamed from here, hashed on the way, proven after.
    Stream(Box<dyn Read + 'a>),
}

/// Why writing a shard failed.
#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    #[error(transparent)]
    Tier(#[from] TransferError),
    #[error("writing {file}: {source}")]
    Io {
        file: String,
        #[source]
        source: io::Error,
    },
    /// A streamed member's bytes were not what the manifest says.
    #[error("{path}: read {found}, the manifest says {expected}")]
    Mismatch {
        path: String,
        expected: String,
        found: String,
    },
    /// The framing stopped before this shard was finished (its temp files are removed).
    #[error("shard {0} was left unfinished")]
    Abandoned(u32),
    /// The side data of a file written could not be handed on to be stored: whoever stores it
    /// stopped (and its own error says why).
    #[error("the piece hashes of {file} could not be handed on to be stored")]
    SideData { file: String },
}

/// Bytes of a shard's tar stream (or of its index) handed to the sink at once: a multiple
/// of [`DIRECT_ALIGN`], so every full chunk of a shard is written directly.
pub const CHUNK_BYTES: usize = 4 << 20;
/// Chunks in the pool shared by the framing writer and the sink: one being filled for the
/// tar, one for the index, the rest queued for (or being hashed or written by) the sink.
const POOL_CHUNKS: usize = 8;

/// A pooled buffer of up to [`CHUNK_BYTES`] whose bytes start at an address aligned for a
/// direct write.
struct Chunk {
    raw: Box<[u8]>,
    start: usize,
    len: usize,
}

impl Chunk {
    fn new() -> Chunk {
        let raw = vec![0u8; CHUNK_BYTES + DIRECT_ALIGN].into_boxed_slice();
        let start = raw.as_ptr().align_offset(DIRECT_ALIGN);
        Chunk { raw, start, len: 0 }
    }

    fn bytes(&self) -> &[u8] {
        &self.raw[self.start..self.start + self.len]
    }

    /// Appends as much of `data` as fits; returns how much did.
    fn push(&mut self, data: &[u8]) -> usize {
        let n = data.len().min(CHUNK_BYTES - self.len);
        let at = self.start + self.len;
        self.raw[at..at + n].copy_from_slice(&data[..n]);
        self.len += n;
        n
    }

    fn is_full(&self) -> bool {
        self.len == CHUNK_BYTES
    }

    fn clear(&mut self) {
        self.len = 0;
    }
}

/// What the framing writer asks of the sink, in order (`Op<()>`), and what the hasher passes
/// on to the disk thread (`Op<ShardDigests>`: the end of a shard carries its SHA-256s).
enum Op<End> {
    /// Shard `n` starts: create its temp files.
    Begin(u32),
    /// The next bytes of the open shard's tar stream.
    Tar(Chunk),
    /// The next bytes of the open shard's index.
    Index(Chunk),
    /// The open shard is complete: make it and its index durable and visible.
    End(End),
}

/// The SHA-256 (hex) of a finished shard's tar stream and of its index.
struct ShardDigests {
    tar: String,
    index: String,
}

/// The framing side's handle on the sink threads: where chunks go and where emptied ones
/// come back from. Chunks are recycled (a fresh multi-MiB buffer per chunk would cost a
/// page fault per 4 KiB), and the pool is the backpressure: a writer that runs ahead of the
/// disk waits for a chunk to come back.
pub struct Sink {
    ops: SyncSender<Op<()>>,
    free: Receiver<Chunk>,
}

fn sink_gone() -> io::Error {
    io::Error::new(io::ErrorKind::BrokenPipe, "the shard sink stopped")
}

impl Sink {
    fn send(&self, op: Op<()>) -> io::Result<()> {
        self.ops.send(op).map_err(|_| sink_gone())
    }

    fn chunk(&self) -> io::Result<Chunk> {
        self.free.recv().map_err(|_| sink_gone())
    }
}

/// A `Write` that fills pooled chunks and hands each full one to the sink.
struct ChunkWriter<'s> {
    sink: &'s Sink,
    buf: Chunk,
    written: u64,
    op: fn(Chunk) -> Op<()>,
}

impl<'s> ChunkWriter<'s> {
    fn new(sink: &'s Sink, op: fn(Chunk) -> Op<()>) -> io::Result<Self> {
        Ok(ChunkWriter {
            buf: sink.chunk()?,
            sink,
            written: 0,
            op,
        })
    }

    /// Bytes written so far (handed over or not).
    fn written(&self) -> u64 {
        self.written
    }

    /// Hands over what is left (even nothing: the sink returns the chunk to the pool).
    fn finish(self) -> io::Result<()> {
        self.sink.send((self.op)(self.buf))
    }
}

impl Write for ChunkWriter<'_> {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        let n = self.buf.push(data);
        self.written += n as u64;
        if self.buf.is_full() {
            let next = self.sink.chunk()?;
            let full = std::mem::replace(&mut self.buf, next);
            self.sink.send((self.op)(full))?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Shard `number` being framed: its tar stream and index go to the sink, which hashes and
/// writes them while this thread frames the next samples.
pub struct ShardWriter<'s> {
    pub number: u32,
    tar: tar::Builder<ChunkWriter<'s>>,
    index: ChunkWriter<'s>,
    pub samples: u64,
    pub members: u64,
}

impl<'s> ShardWriter<'s> {
    /// Starts shard `number` (its files stay invisible temp files until the sink commits
    /// them after [`Self::finish`]).
    pub fn create(sink: &'s Sink, number: u32) -> Result<Self, ShardError> {
        let err = |source| ShardError::Io {
            file: shard_name(number),
            source,
        };
        sink.send(Op::Begin(number)).map_err(err)?;
        Ok(ShardWriter {
            number,
            tar: tar::Builder::new(ChunkWriter::new(sink, Op::Tar).map_err(err)?),
            index: ChunkWriter::new(sink, Op::Index).map_err(err)?,
            samples: 0,
            members: 0,
        })
    }

    fn tar_err(&self, source: io::Error) -> ShardError {
        ShardError::Io {
            file: shard_name(self.number),
            source,
        }
    }

    fn index_err(&self, source: io::Error) -> ShardError {
        ShardError::Io {
            file: index_name(self.number),
            source,
        }
    }

    /// Appends one sample: each member (in the order given) and its index line.
    pub fn add_sample<'a>(
        &mut self,
        key: &str,
        members: impl IntoIterator<Item = (&'a Member, Bytes<'a>)>,
    ) -> Result<(), ShardError> {
        let mut line = IndexLine {
            key,
            members: Vec::new(),
        };
        for (member, bytes) in members {
            let mut header = member_header(member.size);
            match bytes {
                Bytes::Loaded(data) => self
                    .tar
                    .append_data(&mut header, &member.path, data)
                    .map_err(|e| self.tar_err(e))?,
                Bytes::Stream(reader) => {
                    let mut reader = HashingReader::new(reader, member.size);
                    self.tar
                        .append_data(&mut header, &member.path, &mut reader)
                        .map_err(|e| self.tar_err(e))?;
                    let found = reader.finish();
                    if found != member.sha256 {
                        return Err(ShardError::Mismatch {
                            path: member.path.clone(),
                            expected: member.sha256.clone(),
                            found,
                        });
                    }
                }
            }
            let end = self.tar.get_ref().written();
            line.members.push(IndexMember {
                path: &member.path,
                offset: end - member.size.next_multiple_of(512),
                size: member.size,
                sha256: &member.sha256,
            });
            self.members += 1;
        }
        serde_json::to_writer(&mut self.index, &line)
            .map_err(|e| self.index_err(io::Error::other(e)))?;
        self.index.write_all(b"\n").map_err(|e| self.index_err(e))?;
        self.samples += 1;
        Ok(())
    }

    /// Ends the archive and hands the shard to the sink to commit.
    pub fn finish(self) -> Result<(), ShardError> {
        let number = self.number;
        let tar_err = |source| ShardError::Io {
            file: shard_name(number),
            source,
        };
        let tar = self.tar.into_inner().map_err(tar_err)?;
        let sink = tar.sink;
        tar.finish().map_err(tar_err)?;
        self.index.finish().map_err(|source| ShardError::Io {
            file: index_name(number),
            source,
        })?;
        sink.send(Op::End(())).map_err(tar_err)
    }
}

/// A shard and its index as committed: (name, size, SHA-256) of each.
pub type ShardFiles = [(String, u64, String); 2];

/// Frames shards on the calling thread (`frame` creates a [`ShardWriter`] per shard on the
/// [`Sink`] it is given) while a hasher thread hashes their bytes and a disk thread writes
/// them into `staging` and makes each finished shard and its index durable and visible there
/// — so hashing a shard, and waiting for the disk, happen beside the framing of the next
/// samples instead of after them. The side data of each committed shard or index larger than
/// a piece goes to `keep`, from the disk thread. Returns what `frame` returned and the
/// committed shards in order.
///
/// When the sink fails, `frame`'s next hand-over fails and the sink's error is the one
/// returned; when `frame` fails, the sink removes the shard it had open.
pub fn write_shards<T, E: From<ShardError>>(
    staging: &PosixTier,
    size_hint: u64,
    keep: &KeepPieces<'_>,
    frame: impl FnOnce(&Sink) -> Result<T, E>,
) -> Result<(T, Vec<ShardFiles>), E> {
    let (ops_tx, ops_rx) = sync_channel::<Op<()>>(POOL_CHUNKS + 4);
    let (disk_tx, disk_rx) = sync_channel::<Op<ShardDigests>>(POOL_CHUNKS + 4);
    let (free_tx, free_rx) = sync_channel::<Chunk>(POOL_CHUNKS);
    for _ in 0..POOL_CHUNKS {
        // Cannot fail: the channel has room for every chunk and its receiver is alive.
        let _ = free_tx.send(Chunk::new());
    }
    std::thread::scope(|scope| {
        let hashed = scope.spawn(move || run_hasher(ops_rx, disk_tx));
        let sunk = scope.spawn(move || run_disk(staging, size_hint, keep, disk_rx, free_tx));
        let sink = Sink {
            ops: ops_tx,
            free: free_rx,
        };
        let framed = frame(&sink);
        // The sink ends once every op is handled and the sender is gone.
        drop(sink);
        let panicked = |who: &str| ShardError::Io {
            file: "the shards".into(),
            source: io::Error::other(format!("the shard {who} panicked")),
        };
        let hashed = hashed.join().unwrap_or_else(|_| Err(panicked("hasher")));
        let sunk = sunk.join().unwrap_or_else(|_| Err(panicked("disk thread")));
        match (framed, hashed, sunk) {
            (Ok(value), Ok(()), Ok(files)) => Ok((value, files)),
            // The disk thread failed first: what the hasher and the framing saw is its echo.
            (_, _, Err(e)) if !matches!(e, ShardError::Abandoned(_)) => Err(e.into()),
            (_, Err(e), _) => Err(e.into()),
            // The framing stopped: the sink merely removed what it had open.
            (Err(e), Ok(()), _) => Err(e),
            (Ok(_), Ok(()), Err(e)) => Err(e.into()),
        }
    })
}

/// The hasher thread (see [`write_shards`]): takes the SHA-256 of each shard's tar stream and
/// index as they pass, and hands every op on to the disk thread, the digests with each
/// shard's end.
fn run_hasher(ops: Receiver<Op<()>>, disk: SyncSender<Op<ShardDigests>>) -> Result<(), ShardError> {
    let (mut tar, mut index) = (Sha256::new(), Sha256::new());
    for op in ops.iter() {
        let next = match op {
            Op::Begin(number) => {
                (tar, index) = (Sha256::new(), Sha256::new());
                Op::Begin(number)
            }
            Op::Tar(chunk) => {
                tar.update(chunk.bytes());
                Op::Tar(chunk)
            }
            Op::Index(chunk) => {
                index.update(chunk.bytes());
                Op::Index(chunk)
            }
            Op::End(()) => Op::End(ShardDigests {
                tar: hex::encode(std::mem::take(&mut tar).finalize()),
                index: hex::encode(std::mem::take(&mut index).finalize()),
            }),
        };
        // The disk thread stopped (its error is the one reported).
        disk.send(next).map_err(|_| ShardError::Io {
            file: "the shards".into(),
            source: sink_gone(),
        })?;
    }
    Ok(())
}

/// The open shard, on the disk thread's side.
struct OpenShard {
    number: u32,
    tar: AtomicFile,
    tar_len: u64,
    /// Whether the tar stream is being written with `O_DIRECT`.
    direct: bool,
    /// Where writeback was last started (buffered writes: bytes before it are on their way
    /// to the disk).
    flushed_to: u64,
    index: AtomicFile,
    index_len: u64,
    /// The piece hashes of the tar stream and of the index, taken as they are written (a
    /// shard's size is known only at its end: those of a file a piece or smaller are dropped
    /// there).
    tar_pieces: PieceHashesBuilder,
    index_pieces: PieceHashesBuilder,
}

impl OpenShard {
    /// Writes the next bytes of the tar stream: directly while they are whole aligned
    /// blocks, through the cache from the first that is not (the shard's end) or when the
    /// filesystem refuses a direct write after all.
    fn write_tar(&mut self, bytes: &[u8]) -> Result<(), ShardError> {
        let mut bytes = bytes;
        if self.direct {
            let aligned = bytes.len() / DIRECT_ALIGN * DIRECT_ALIGN;
            if aligned > 0 {
                match self
                    .tar
                    .file()
                    .write_all_at(&bytes[..aligned], self.tar_len)
                {
                    Ok(()) => {
                        self.tar_len += aligned as u64;
                        bytes = &bytes[aligned..];
                    }
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
                    Err(source) => {
                        return Err(ShardError::Io {
                            file: shard_name(self.number),
                            source,
                        });
                    }
                }
            }
            if !bytes.is_empty() {
                self.tar.end_direct()?;
                self.direct = false;
                self.flushed_to = self.tar_len;
            }
        }
        if bytes.is_empty() {
            return Ok(());
        }
        self.tar.write_all_at(bytes, self.tar_len)?;
        self.tar_len += bytes.len() as u64;
        if self.tar_len - self.flushed_to >= WRITEBACK_EVERY {
            start_writeback(self.tar.file(), self.flushed_to, self.tar_len);
            self.flushed_to = self.tar_len;
        }
        Ok(())
    }
}

/// Buffered writes start writeback once this many bytes of a shard are dirty, so the disk
/// writes while the rest of the shard is framed and the commit's `fdatasync` waits only for
/// the tail.
const WRITEBACK_EVERY: u64 = 8 << 20;

/// The disk thread (see [`write_shards`]).
fn run_disk(
    staging: &PosixTier,
    size_hint: u64,
    keep: &KeepPieces<'_>,
    ops: Receiver<Op<ShardDigests>>,
    free: SyncSender<Chunk>,
) -> Result<Vec<ShardFiles>, ShardError> {
    let mut done = Vec::new();
    let mut open: Option<OpenShard> = None;
    let not_open = |what: &str| ShardError::Io {
        file: what.to_owned(),
        source: io::Error::other("bytes for a shard that was not begun"),
    };
    for op in ops.iter() {
        match op {
            Op::Begin(number) => {
                // A shard left open would be an unfinished one: removed when dropped.
                let tar = staging.create_atomic(&shard_name(number), size_hint)?;
                let direct = tar.begin_direct();
                open = Some(OpenShard {
                    number,
                    tar,
                    tar_len: 0,
                    direct,
                    flushed_to: 0,
                    index: staging.create_atomic(&index_name(number), 0)?,
                    index_len: 0,
                    tar_pieces: PieceHashesBuilder::new(),
                    index_pieces: PieceHashesBuilder::new(),
                });
            }
            Op::Tar(mut chunk) => {
                let shard = open.as_mut().ok_or_else(|| not_open("a shard"))?;
                shard.write_tar(chunk.bytes())?;
                shard.tar_pieces.update(chunk.bytes());
                chunk.clear();
                // The framing side may be gone (it stopped); the chunk is then dropped.
                let _ = free.send(chunk);
            }
            Op::Index(mut chunk) => {
                let shard = open.as_mut().ok_or_else(|| not_open("an index"))?;
                shard.index.write_all_at(chunk.bytes(), shard.index_len)?;
                shard.index_pieces.update(chunk.bytes());
                shard.index_len += chunk.len as u64;
                chunk.clear();
                let _ = free.send(chunk);
            }
            Op::End(digests) => {
                let shard = open.take().ok_or_else(|| not_open("a shard"))?;
                shard.tar.commit()?;
                shard.index.commit()?;
                let (tar_sha, index_sha) = (digests.tar, digests.index);
                let (tar, index) = (shard_name(shard.number), index_name(shard.number));
                let tar_pieces = shard.tar_pieces.finish();
                let index_pieces = shard.index_pieces.finish();
                keep_pieces(keep, &tar, shard.tar_len, &tar_sha, tar_pieces)?;
                keep_pieces(keep, &index, shard.index_len, &index_sha, index_pieces)?;
                done.push([
                    (tar, shard.tar_len, tar_sha),
                    (index, shard.index_len, index_sha),
                ]);
            }
        }
    }
    match open {
        Some(shard) => Err(ShardError::Abandoned(shard.number)),
        None => Ok(done),
    }
}

/// Asks the kernel to start writing `from..to` of `file` to the disk now, without waiting
/// for it (`sync_file_range(SYNC_FILE_RANGE_WRITE)`). Only a hint: durability still comes
/// from the commit's `fdatasync`, so a failure here (a filesystem without it) changes
/// nothing but timing.
fn start_writeback(file: &File, from: u64, to: u64) {
    use std::os::fd::AsRawFd;
    let (Ok(offset), Ok(len)) = (i64::try_from(from), i64::try_from(to - from)) else {
        return;
    };
    // SAFETY: a plain system call on an open descriptor this function borrows; it reads no
    // memory of ours.
    unsafe {
        libc::sync_file_range(file.as_raw_fd(), offset, len, libc::SYNC_FILE_RANGE_WRITE);
    }
}

fn own_handle(file: &AtomicFile) -> Result<File, ShardError> {
    file.file().try_clone().map_err(|source| ShardError::Io {
        file: file.rel().to_owned(),
        source,
    })
}

/// Writes a small file of the version (`prepared.json`) into the staging folder; returns its
/// size and SHA-256 (and hands its side data, were it larger than a piece, to `keep`).
pub fn write_file(
    staging: &PosixTier,
    name: &str,
    bytes: &[u8],
    keep: &KeepPieces<'_>,
) -> Result<(u64, String), ShardError> {
    let size = bytes.len() as u64;
    let mut hasher = PieceHasher::for_size(Some(size));
    hasher.update(bytes);
    let (sha, pieces) = digests_of(hasher);
    let file = staging.create_atomic(name, size)?;
    file.write_all_at(bytes, 0)?;
    file.commit()?;
    keep_pieces(keep, name, size, &sha, pieces)?;
    Ok((size, sha))
}

/// Copies `len` bytes from `from` into a new file `name` of the staging folder; returns its
/// size and SHA-256 (and hands its side data, when it is larger than a piece, to `keep`).
pub fn copy_file(
    staging: &PosixTier,
    name: &str,
    from: &mut File,
    len: u64,
    keep: &KeepPieces<'_>,
) -> Result<(u64, String), ShardError> {
    let file = staging.create_atomic(name, len)?;
    let mut out = HashingWriter::new(
        BufWriter::new(own_handle(&file)?),
        PieceHasher::for_size(Some(len)),
    );
    let io_err = |source| ShardError::Io {
        file: name.to_owned(),
        source,
    };
    io::copy(&mut from.take(len), &mut out).map_err(io_err)?;
    let (mut buf, written, sha, pieces) = out.finish();
    buf.flush().map_err(io_err)?;
    drop(buf);
    file.commit()?;
    keep_pieces(keep, name, written, &sha, pieces)?;
    Ok((written, sha))
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagehand_schemas::pieces::PIECE_BYTES;

    fn member(path: &str, data: &[u8]) -> Member {
        let (key, _) = crate::sample::split_key(path).unwrap();
        Member {
            order: 0,
            path: path.into(),
            key_len: key.len(),
            size: data.len() as u64,
            sha256: hex::encode(Sha256::digest(data)),
        }
    }

    /// Two writers of the same members, at different times and places, give the same bytes;
    /// the index offsets point at each member's bytes; a long name round-trips through a
    /// standard reader (the `tar` crate's).
    #[test]
    fn shards_are_deterministic_and_their_index_points_at_each_member() {
        let long = format!("{}/x.bin", "d".repeat(150));
        let files: Vec<(String, Vec<u8>)> = vec![
            ("a/0001.cls".into(), b"7".to_vec()),
            ("a/0001.jpg".into(), vec![0xAB; 1000]),
            (long.clone(), vec![1, 2, 3]),
        ];
        let mut shas = Vec::new();
        for _ in 0..2 {
            let dir = tempfile::tempdir().unwrap();
            let tier = PosixTier::open("t", dir.path()).unwrap();
            let members: Vec<Member> = files.iter().map(|(p, d)| member(p, d)).collect();
            let ((), shards) = write_shards(&tier, 0, &|_, _| Ok(()), |sink| {
                let mut w = ShardWriter::create(sink, 3)?;
                w.add_sample(
                    "a/0001",
                    members[..2]
                        .iter()
                        .zip(&files[..2])
                        .map(|(m, (_, d))| (m, Bytes::Loaded(d))),
                )?;
                w.add_sample(
                    long.trim_end_matches(".bin"),
                    [(&members[2], Bytes::Stream(Box::new(&files[2].1[..])))],
                )?;
                w.finish()
            })
            .unwrap();
            let [[(name, size, sha), (index, ..)]] = shards.try_into().unwrap();
            assert_eq!(name, "shard-000003.tar");
            let bytes = std::fs::read(dir.path().join(&name)).unwrap();
            assert_eq!(bytes.len() as u64, size);
            assert_eq!(hex::encode(Sha256::digest(&bytes)), sha);
            // The index's offsets and hashes.
            let lines = std::fs::read_to_string(dir.path().join(index)).unwrap();
            let mut seen = 0;
            for line in lines.lines() {
                let v: serde_json::Value = serde_json::from_str(line).unwrap();
                for m in v["members"].as_array().unwrap() {
                    let (off, len) = (m["offset"].as_u64().unwrap(), m["size"].as_u64().unwrap());
                    let data = &bytes[off as usize..(off + len) as usize];
                    assert_eq!(hex::encode(Sha256::digest(data)), m["sha256"]);
                    seen += 1;
                }
            }
            assert_eq!(seen, 3);
            // A standard reader sees the names, sizes and fixed header fields.
            let mut archive = tar::Archive::new(&bytes[..]);
            let mut names = Vec::new();
            for entry in archive.entries().unwrap() {
                let mut entry = entry.unwrap();
                let h = entry.header().clone();
                assert_eq!(
                    (h.mtime().unwrap(), h.uid().unwrap(), h.gid().unwrap()),
                    (0, 0, 0)
                );
                assert_eq!(h.mode().unwrap(), 0o644);
                let mut data = Vec::new();
                entry.read_to_end(&mut data).unwrap();
                names.push((entry.path().unwrap().to_string_lossy().into_owned(), data));
            }
            assert_eq!(names, files);
            shas.push(sha);
        }
        assert_eq!(shas[0], shas[1]);
    }

    /// Guards the chunked sink: shards spanning many chunks (and writeback hints) hold
    /// exactly the bytes one `tar::Builder` writes for the same members, hashed as one stream,
    /// and come back in shard order; each, larger than a piece, has its piece hashes handed on
    /// once committed, and an index (smaller) has none.
    #[test]
    fn shards_larger_than_a_chunk_are_the_bytes_of_one_tar_stream() {
        let dir = tempfile::tempdir().unwrap();
        let tier = PosixTier::open("t", dir.path()).unwrap();
        let data: Vec<(String, Vec<u8>)> = (0..60u32)
            .map(|i| {
                let bytes: Vec<u8> = (0..300_001 + i * 7).map(|b| (b ^ i) as u8).collect();
                (format!("s/{i:04}.bin"), bytes)
            })
            .collect();
        let members: Vec<Member> = data.iter().map(|(p, d)| member(p, d)).collect();
        let frame = |sink: &Sink| {
            for shard in 0..2u32 {
                let mut w = ShardWriter::create(sink, shard)?;
                for i in (shard as usize * 30)..(shard as usize * 30 + 30) {
                    let key = data[i].0.trim_end_matches(".bin");
                    w.add_sample(key, [(&members[i], Bytes::Loaded(&data[i].1))])?;
                }
                w.finish()?;
            }
            Ok::<_, ShardError>(())
        };
        let kept = std::sync::Mutex::new(Vec::new());
        let keep = |file: &FileRef, pieces: PieceHashes| {
            kept.lock().unwrap().push((file.clone(), pieces));
            Ok(())
        };
        let ((), shards) = write_shards(&tier, 0, &keep, frame).unwrap();
        assert_eq!(shards.len(), 2);
        let kept = kept.into_inner().unwrap();
        assert_eq!(kept.len(), 2, "the two shards, not their indexes");
        for (n, [(name, size, sha), (index, index_size, _)]) in shards.into_iter().enumerate() {
            assert_eq!(name, shard_name(n as u32));
            assert_eq!(index, index_name(n as u32));
            let mut want = tar::Builder::new(Vec::new());
            for (path, bytes) in &data[n * 30..n * 30 + 30] {
                let mut header = member_header(bytes.len() as u64);
                want.append_data(&mut header, path, &bytes[..]).unwrap();
            }
            let want = want.into_inner().unwrap();
            assert!(want.len() > 2 * CHUNK_BYTES, "{} bytes", want.len());
            // Whole chunks written directly, the end that is not a whole block through
            // the cache: both must be in the shard.
            assert_ne!(want.len() % DIRECT_ALIGN, 0, "{} bytes", want.len());
            let got = std::fs::read(dir.path().join(&name)).unwrap();
            assert!(got == want, "shard {n} differs from one tar stream");
            assert_eq!(size, want.len() as u64);
            assert_eq!(sha, hex::encode(Sha256::digest(&want)));
            assert!(PieceHashes::wanted(size), "{size} bytes");
            assert_eq!(kept[n].0, FileRef::new(name.clone(), size, sha.clone()));
            assert_eq!(kept[n].1, PieceHashes::of(&got));
            let lines = std::fs::read_to_string(dir.path().join(&index)).unwrap();
            assert_eq!(lines.len() as u64, index_size);
            assert_eq!(lines.lines().count(), 30);
        }
    }

    /// Side data that cannot be handed on stops the writing with that error.
    #[test]
    fn side_data_that_cannot_be_handed_on_stops_the_writing() {
        let dir = tempfile::tempdir().unwrap();
        let tier = PosixTier::open("t", dir.path()).unwrap();
        let data: Vec<u8> = (0..PIECE_BYTES + 1).map(|i| i as u8).collect();
        let m = member("big.bin", &data);
        let err = write_shards(
            &tier,
            0,
            &|file, _| {
                Err(ShardError::SideData {
                    file: file.path.clone(),
                })
            },
            |sink| {
                let mut w = ShardWriter::create(sink, 0)?;
                w.add_sample("big", [(&m, Bytes::Loaded(&data))])?;
                w.finish()
            },
        )
        .unwrap_err();
        assert!(
            matches!(&err, ShardError::SideData { file } if file == "shard-000000.tar"),
            "{err}"
        );
    }

    /// A streamed member whose bytes are not the manifest's fails the shard with its path.
    #[test]
    fn a_streamed_member_that_does_not_match_fails_with_its_path() {
        let dir = tempfile::tempdir().unwrap();
        let tier = PosixTier::open("t", dir.path()).unwrap();
        let m = member("k.bin", b"expected");
        let err = write_shards(&tier, 0, &|_, _| Ok(()), |sink| {
            let mut w = ShardWriter::create(sink, 0)?;
            w.add_sample("k", [(&m, Bytes::Stream(Box::new(&b"tampered"[..])))])?;
            w.finish()
        })
        .unwrap_err();
        assert!(
            matches!(&err, ShardError::Mismatch { path, .. } if path == "k.bin"),
            "{err}"
        );
        // Nothing is left under a real name.
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| !n.starts_with('.'))
            .collect();
        assert!(names.is_empty(), "{names:?}");
    }
}
