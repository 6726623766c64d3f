//! A version's file list in the store: entries in path order, cut into chunks of at most
//! [`CHUNK_ENTRIES`] entries or about [`CHUNK_BYTES`] bytes, each chunk one redb row keyed by
//! (version digest, its first path). A version of 14 million files is ~14,000 rows of ~60 KiB,
//! written in bounded memory and read one chunk at a time: a page of files, or one file's
//! entry, costs one range lookup and the decoding of a chunk or two.
//!
//! A chunk is `0x01` then, per entry: varint length of the prefix shared with the previous
//! path, varint length of the rest, the rest's bytes, varint size, the 32 bytes of the SHA-256.
//! Paths strictly increase (raw bytes, the manifest's order). Decoding checks all of that, so
//! a damaged chunk is an error naming what is wrong, never a panic or a wrong answer.

use stagehand_schemas::FileRef;

/// Most entries in one chunk.
pub const CHUNK_ENTRIES: usize = 1024;

/// A chunk is cut once it holds this many bytes.
pub const CHUNK_BYTES: usize = 60 * 1024;

const FORMAT: u8 = 1;

/// Why a chunk could not be made or read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChunkError {
    /// An entry that cannot be stored: paths out of order or repeated, a hash that is not 64
    /// hex characters.
    #[error("file list entry {path:?}: {reason}")]
    BadEntry { path: String, reason: &'static str },
    /// Stored bytes that do not decode.
    #[error("damaged file chunk: {0}")]
    Damaged(&'static str),
}

/// Builds one chunk.
#[derive(Debug, Default)]
pub struct ChunkBuilder {
    buf: Vec<u8>,
    entries: usize,
    first: String,
    prev: String,
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn hex_to_bytes(hex: &str) -> Option<[u8; 32]> {
    let bytes = hex.as_bytes();
    if bytes.len() != 64 {
        return None;
    }
    let nibble = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    let mut out = [0u8; 32];
    for (i, pair) in bytes.chunks_exact(2).enumerate() {
        out[i] = nibble(pair[0])? << 4 | nibble(pair[1])?;
    }
    Some(out)
}

impl ChunkBuilder {
    /// An empty chunk whose entries must all sort after `prev` (the last path of the chunk
    /// before it; empty for the first).
    pub fn after(prev: String) -> Self {
        ChunkBuilder {
            prev,
            ..Default::default()
        }
    }

    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }

    /// Whether the chunk is full and must be finished before another entry is pushed.
    pub fn is_full(&self) -> bool {
        self.entries >= CHUNK_ENTRIES || self.buf.len() >= CHUNK_BYTES
    }

    /// Appends `file`, which must sort after every path pushed before (in this chunk and the
    /// ones before it).
    pub fn push(&mut self, file: &FileRef) -> Result<(), ChunkError> {
        let bad = |reason| ChunkError::BadEntry {
            path: file.path.clone(),
            reason,
        };
        let started = self.entries > 0 || !self.prev.is_empty();
        if started && file.path.as_bytes() <= self.prev.as_bytes() {
            return Err(bad(
                "paths must strictly increase (a repeated or unsorted path)",
            ));
        }
        let sha =
            hex_to_bytes(&file.sha256).ok_or_else(|| bad("sha256 is not 64 lowercase hex"))?;
        if self.buf.is_empty() {
            self.buf.push(FORMAT);
        }
        let shared = if self.entries == 0 {
            // A chunk decodes on its own: its first path is whole.
            self.first = file.path.clone();
            0
        } else {
            self.prev
                .bytes()
                .zip(file.path.bytes())
                .take_while(|(a, b)| a == b)
                .count()
        };
        let rest = &file.path.as_bytes()[shared..];
        put_varint(&mut self.buf, shared as u64);
        put_varint(&mut self.buf, rest.len() as u64);
        self.buf.extend_from_slice(rest);
        put_varint(&mut self.buf, file.size);
        self.buf.extend_from_slice(&sha);
        self.entries += 1;
        self.prev.clone_from(&file.path);
        Ok(())
    }

    /// The chunk's key path (its first) and bytes, and a builder for the next chunk.
    pub fn finish(self) -> ((String, Vec<u8>), ChunkBuilder) {
        let next = ChunkBuilder::after(self.prev);
        ((self.first, self.buf), next)
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn varint(&mut self) -> Result<u64, ChunkError> {
        let mut v: u64 = 0;
        for shift in (0..64).step_by(7) {
            let b = *self
                .bytes
                .get(self.at)
                .ok_or(ChunkError::Damaged("cut inside a number"))?;
            self.at += 1;
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(ChunkError::Damaged("a number longer than 64 bits"))
    }

    fn take(&mut self, n: usize) -> Result<&[u8], ChunkError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or(ChunkError::Damaged("cut inside an entry"))?;
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// The entries of a chunk, in path order.
pub fn decode(bytes: &[u8]) -> Result<Vec<FileRef>, ChunkError> {
    let Some((&format, body)) = bytes.split_first() else {
        return Err(ChunkError::Damaged("empty"));
    };
    if format != FORMAT {
        return Err(ChunkError::Damaged("unknown chunk format"));
    }
    let mut r = Reader { bytes: body, at: 0 };
    let mut out: Vec<FileRef> = Vec::new();
    let mut path: Vec<u8> = Vec::new();
    while r.at < body.len() {
        let shared = r.varint()? as usize;
        if shared > path.len() || (out.is_empty() && shared != 0) {
            return Err(ChunkError::Damaged(
                "a shared prefix longer than the path before",
            ));
        }
        let len = r.varint()? as usize;
        let rest = r.take(len)?;
        let mut next = Vec::with_capacity(shared + len);
        next.extend_from_slice(&path[..shared]);
        next.extend_from_slice(rest);
        if !out.is_empty() && next <= path {
            return Err(ChunkError::Damaged("paths out of order"));
        }
        let size = r.varint()?;
        let sha = r.take(32)?;
        let mut hex = String::with_capacity(64);
        for b in sha {
            hex.push(HEX[usize::from(b >> 4)] as char);
            hex.push(HEX[usize::from(b & 15)] as char);
        }
        let text = String::from_utf8(next.clone())
            .map_err(|_| ChunkError::Damaged("a path that is not UTF-8"))?;
        out.push(FileRef::new(text, size, hex));
        path = next;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use stagehand_schemas::sha256_hex;

    use super::*;

    fn files(n: usize) -> Vec<FileRef> {
        let mut v: Vec<FileRef> = (0..n)
            .map(|i| {
                FileRef::new(
                    format!("train/{:05}/ünï-{i}.jpg", i / 10),
                    i as u64 * 1000,
                    sha256_hex(&i.to_le_bytes()),
                )
            })
            .collect();
        v.sort_by(|a, b| a.path.as_bytes().cmp(b.path.as_bytes()));
        v
    }

    fn chunked(files: &[FileRef]) -> Vec<(String, Vec<u8>)> {
        let mut out = Vec::new();
        let mut b = ChunkBuilder::default();
        for f in files {
            if b.is_full() {
                let (chunk, next) = b.finish();
                out.push(chunk);
                b = next;
            }
            b.push(f).unwrap();
        }
        if !b.is_empty() {
            out.push(b.finish().0);
        }
        out
    }

    #[test]
    fn chunks_round_trip_in_order() {
        let all = files(3000);
        let chunks = chunked(&all);
        assert_eq!(chunks.len(), 3, "cut at {CHUNK_ENTRIES} entries");
        let mut back = Vec::new();
        for (first, bytes) in &chunks {
            let entries = decode(bytes).unwrap();
            assert_eq!(&entries[0].path, first);
            back.extend(entries);
        }
        assert_eq!(back, all);
    }

    #[test]
    fn repeated_or_unsorted_paths_and_bad_hashes_are_refused() {
        let f = |p: &str| FileRef::new(p, 1, sha256_hex(p.as_bytes()));
        let mut b = ChunkBuilder::default();
        b.push(&f("b")).unwrap();
        assert!(b.push(&f("b")).is_err());
        assert!(b.push(&f("a")).is_err());
        let mut next = ChunkBuilder::after("b".into());
        assert!(next.push(&f("a")).is_err(), "order holds across chunks");
        assert!(b.push(&FileRef::new("c", 1, "XYZ")).is_err());
    }

    #[test]
    fn damaged_bytes_are_errors_not_panics() {
        let (_, bytes) = chunked(&files(50)).remove(0);
        for cut in 0..bytes.len() {
            let _ = decode(&bytes[..cut]);
        }
        let mut flipped = bytes.clone();
        for i in 1..flipped.len() {
            flipped[i] ^= 0xff;
            let _ = decode(&flipped);
            flipped[i] ^= 0xff;
        }
        assert!(decode(&[]).is_err());
        assert!(decode(&[9, 0]).is_err());
        assert!(decode(&bytes[..bytes.len() - 1]).is_err());
    }
}
