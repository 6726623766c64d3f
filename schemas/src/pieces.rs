//! Per-piece hashes of a large file: the manifest's side data.
//!
//! A manifest gives each file one SHA-256, which can be checked only once the whole file is
//! in hand. Node agents fanning a version out (`services/promoter/src/fanout`) move a file
//! larger than [`PIECE_BYTES`] in pieces, from several peers at once, and must judge each
//! piece as it arrives, so that a peer serving bad bytes is caught at the piece and named.
//! For such a file the services that hash every byte of a version (the ingest validator, the
//! resharder) also record the BLAKE3 hash of each piece, from the same read that gives the
//! file's SHA-256: piece `i` is the bytes `[i × PIECE_BYTES, min((i + 1) × PIECE_BYTES, size))`.
//!
//! Why BLAKE3 and not SHA-256, the manifest's hash: the pieces are hashed once more by the
//! service that records them, on the way of every ingest and every resharding, and again by
//! every node a slice reaches. BLAKE3 is a cryptographic hash (a peer cannot forge a slice
//! that matches) at several times SHA-256's speed per core (AVX2/AVX-512), so that extra pass
//! costs a fraction of the SHA-256 one (`loadtest/README.md`). A file's identity stays its
//! SHA-256: the piece hashes are taken from bytes whose SHA-256 the writer found, and are
//! stored under it.
//!
//! The side data is keyed by the content, not the version: the pieces of the bytes whose
//! SHA-256 is `X` are the same in every version holding them. It is stored as the object
//! [`PieceHashes::object_name`] in the services' manifest bucket, which only services that
//! verified what they write may write; its bytes ([`PieceHashes::to_bytes`]) are
//!
//! ```text
//! stagehand-pieces blake3 v1\t<piece bytes>\t<file size>\n
//! <BLAKE3 of piece 0, 64 lowercase hex>\n
//! <BLAKE3 of piece 1>\n
//! …
//! ```
//!
//! and [`PieceHashes::parse`] is their one reader, which refuses anything but exactly the
//! pieces a file of that size has.

use sha2::{Digest, Sha256};

/// The bytes of one piece. A file larger than this has side data; one of this size or less
/// is verified whole.
pub const PIECE_BYTES: u64 = 8 << 20;

const HEADER: &str = "stagehand-pieces blake3 v1";

/// The BLAKE3 hash of each piece of one file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PieceHashes {
    /// The file's size.
    pub size: u64,
    /// The BLAKE3 hash of each piece, in order.
    pub pieces: Vec<[u8; 32]>,
}

/// Why side data does not parse, or is not the side data of the file it was fetched for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PiecesError {
    #[error("the first line is not `{HEADER}<TAB>{PIECE_BYTES}<TAB><size>`")]
    Header,
    #[error("for a file of {size} bytes, {found} piece hashes where {expected} were expected")]
    Count {
        size: u64,
        expected: u64,
        found: u64,
    },
    #[error("line {line} is not 64 lowercase hex characters")]
    Hash { line: usize },
    #[error("side data of a {found}-byte file, fetched for one of {expected} bytes")]
    Size { expected: u64, found: u64 },
}

impl PieceHashes {
    /// Whether a file of `size` bytes has side data.
    pub fn wanted(size: u64) -> bool {
        size > PIECE_BYTES
    }

    /// How many pieces a file of `size` bytes has.
    pub fn count(size: u64) -> u64 {
        size.div_ceil(PIECE_BYTES)
    }

    /// The byte range of piece `i` of a file of `size` bytes.
    pub fn range(size: u64, i: u64) -> std::ops::Range<u64> {
        let start = i * PIECE_BYTES;
        start..(start + PIECE_BYTES).min(size)
    }

    /// The name of the side data of the file whose SHA-256 is `file_sha256` in the services'
    /// manifest bucket (beside the manifests, which are named by bare digests).
    pub fn object_name(file_sha256: &str) -> String {
        format!("pieces.{file_sha256}")
    }

    /// The piece hashes of `bytes` (tests, and small callers that hold a file whole).
    pub fn of(bytes: &[u8]) -> PieceHashes {
        let mut hasher = PieceHasher::new();
        hasher.update(bytes);
        hasher.finish().1
    }

    /// The side data's bytes, as in the module documentation.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = format!("{HEADER}\t{PIECE_BYTES}\t{}\n", self.size).into_bytes();
        out.reserve(self.pieces.len() * 65);
        for piece in &self.pieces {
            out.extend_from_slice(hex::encode(piece).as_bytes());
            out.push(b'\n');
        }
        out
    }

    /// The largest side data a file of `size` bytes can have, to refuse a larger object unread.
    pub fn max_bytes(size: u64) -> u64 {
        (HEADER.len() + 2 + 20 + 20 + 1) as u64 + Self::count(size) * 65
    }

    /// Reads side data fetched for a file of `size` bytes: refused unless it is exactly that
    /// file's pieces, each a well-formed hash.
    pub fn parse(bytes: &[u8], size: u64) -> Result<PieceHashes, PiecesError> {
        let text = std::str::from_utf8(bytes).map_err(|_| PiecesError::Header)?;
        let mut lines = text.split_terminator('\n');
        let header = lines.next().ok_or(PiecesError::Header)?;
        let mut fields = header.split('\t');
        let (Some(HEADER), Some(piece_bytes), Some(found), None) =
            (fields.next(), fields.next(), fields.next(), fields.next())
        else {
            return Err(PiecesError::Header);
        };
        if piece_bytes != PIECE_BYTES.to_string() {
            return Err(PiecesError::Header);
        }
        let found: u64 = found.parse().map_err(|_| PiecesError::Header)?;
        if found != size {
            return Err(PiecesError::Size {
                expected: size,
                found,
            });
        }
        let expected = Self::count(size);
        let hashes: Vec<&str> = lines.collect();
        if hashes.len() as u64 != expected {
            return Err(PiecesError::Count {
                size,
                expected,
                found: hashes.len() as u64,
            });
        }
        let mut pieces = Vec::with_capacity(hashes.len());
        for (i, line) in hashes.into_iter().enumerate() {
            let mut hash = [0u8; 32];
            if !crate::manifest::is_sha256_hex(line)
                || hex::decode_to_slice(line, &mut hash).is_err()
            {
                return Err(PiecesError::Hash { line: i + 2 });
            }
            pieces.push(hash);
        }
        Ok(PieceHashes { size, pieces })
    }
}

/// The hash of one piece, fed in order in buffers of any size: what a reader checks a slice
/// against ([`PieceHashes::pieces`]).
#[derive(Default, Clone)]
pub struct PieceDigest(blake3::Hasher);

impl PieceDigest {
    pub fn new() -> PieceDigest {
        PieceDigest::default()
    }

    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    pub fn finish(&self) -> [u8; 32] {
        self.0.finalize().into()
    }
}

/// The piece hashes of a file fed in order in buffers of any size, without its SHA-256: for a
/// writer that takes the two on different threads (the resharder hashes each shard whole on
/// one and piece by piece on the thread that waits for the disk).
#[derive(Clone, Default)]
pub struct PieceHashesBuilder {
    /// The piece being hashed and its bytes so far.
    piece: PieceDigest,
    filled: u64,
    size: u64,
    pieces: Vec<[u8; 32]>,
}

impl PieceHashesBuilder {
    pub fn new() -> PieceHashesBuilder {
        PieceHashesBuilder::default()
    }

    pub fn update(&mut self, mut bytes: &[u8]) {
        self.size += bytes.len() as u64;
        while !bytes.is_empty() {
            let room = (PIECE_BYTES - self.filled) as usize;
            let (head, rest) = bytes.split_at(room.min(bytes.len()));
            self.piece.update(head);
            self.filled += head.len() as u64;
            bytes = rest;
            if self.filled == PIECE_BYTES {
                self.pieces.push(self.piece.finish());
                self.piece = PieceDigest::new();
                self.filled = 0;
            }
        }
    }

    /// The piece hashes of the bytes fed (none when they are a piece or less: no side data).
    pub fn finish(self) -> PieceHashes {
        let mut pieces = self.pieces;
        if !PieceHashes::wanted(self.size) {
            pieces.clear();
        } else if self.filled > 0 {
            pieces.push(self.piece.finish());
        }
        PieceHashes {
            size: self.size,
            pieces,
        }
    }
}

/// A file's SHA-256 and its piece hashes from one pass over its bytes, fed in order in
/// buffers of any size. The piece hashes cost a BLAKE3 of every byte, paid only by
/// files that have side data ([`PieceHashes::wanted`]) once the file turns out larger than a
/// piece; callers that know the size beforehand skip it for smaller files
/// ([`PieceHasher::for_size`]).
#[derive(Clone)]
pub struct PieceHasher {
    whole: Sha256,
    size: u64,
    /// `None` when piece hashing is off.
    pieces: Option<PieceHashesBuilder>,
}

impl Default for PieceHasher {
    fn default() -> Self {
        Self::new()
    }
}

impl PieceHasher {
    /// Hashes the file whole and piece by piece.
    pub fn new() -> PieceHasher {
        PieceHasher {
            whole: Sha256::new(),
            size: 0,
            pieces: Some(PieceHashesBuilder::new()),
        }
    }

    /// Hashes the file whole only (its size is known to be a piece or less, or its pieces are
    /// hashed elsewhere with a [`PieceHashesBuilder`]).
    pub fn whole_only() -> PieceHasher {
        PieceHasher {
            pieces: None,
            ..PieceHasher::new()
        }
    }

    /// The hasher of a file of `size` bytes, or of a size not known yet (`None`: only its end
    /// tells whether it has side data).
    pub fn for_size(size: Option<u64>) -> PieceHasher {
        match size {
            Some(size) if !PieceHashes::wanted(size) => PieceHasher::whole_only(),
            _ => PieceHasher::new(),
        }
    }

    pub fn update(&mut self, bytes: &[u8]) {
        self.whole.update(bytes);
        self.size += bytes.len() as u64;
        if let Some(pieces) = &mut self.pieces {
            pieces.update(bytes);
        }
    }

    /// The file's SHA-256 and its piece hashes (empty pieces when it has no side data, being
    /// a piece or less, or hashed [`PieceHasher::whole_only`]).
    pub fn finish(self) -> ([u8; 32], PieceHashes) {
        let whole: [u8; 32] = self.whole.finalize().into();
        let pieces = match self.pieces {
            Some(pieces) => pieces.finish(),
            None => PieceHashes {
                size: self.size,
                pieces: Vec::new(),
            },
        };
        (whole, pieces)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(n: u64) -> Vec<u8> {
        (0..n).map(|i| (i * 7 + i / 4099) as u8).collect()
    }

    #[test]
    fn a_file_larger_than_a_piece_is_hashed_piece_by_piece_whatever_the_buffers() {
        let data = bytes(2 * PIECE_BYTES + 12345);
        let mut hasher = PieceHasher::new();
        for chunk in data.chunks(1_000_003) {
            hasher.update(chunk);
        }
        let (whole, pieces) = hasher.finish();
        assert_eq!(whole, <[u8; 32]>::from(Sha256::digest(&data)));
        let mut alone = PieceHashesBuilder::new();
        for chunk in data.chunks(4 << 20) {
            alone.update(chunk);
        }
        assert_eq!(
            alone.finish(),
            pieces,
            "the pieces hashed apart from the SHA-256"
        );
        assert_eq!(pieces.size, data.len() as u64);
        assert_eq!(pieces.pieces.len(), 3);
        for (i, piece) in pieces.pieces.iter().enumerate() {
            let range = PieceHashes::range(data.len() as u64, i as u64);
            let expected: [u8; 32] =
                blake3::hash(&data[range.start as usize..range.end as usize]).into();
            assert_eq!(piece, &expected, "piece {i}");
        }
    }

    #[test]
    fn a_file_of_a_piece_or_less_has_no_side_data() {
        for n in [0, 1, PIECE_BYTES] {
            let pieces = PieceHashes::of(&bytes(n));
            assert!(pieces.pieces.is_empty(), "{n} bytes");
            let mut alone = PieceHashesBuilder::new();
            alone.update(&bytes(n));
            assert_eq!(alone.finish(), pieces, "{n} bytes, hashed apart");
            assert!(!PieceHashes::wanted(n));
        }
        assert!(PieceHashes::wanted(PIECE_BYTES + 1));
        assert_eq!(PieceHashes::of(&bytes(PIECE_BYTES + 1)).pieces.len(), 2);
    }

    #[test]
    fn side_data_reads_back_only_for_the_file_it_was_made_for() {
        let size = PIECE_BYTES * 2 + 1;
        let pieces = PieceHashes::of(&bytes(size));
        let stored = pieces.to_bytes();
        assert!(stored.len() as u64 <= PieceHashes::max_bytes(size));
        assert_eq!(PieceHashes::parse(&stored, size), Ok(pieces.clone()));
        assert_eq!(
            PieceHashes::parse(&stored, size + 1),
            Err(PiecesError::Size {
                expected: size + 1,
                found: size
            })
        );
        let text = String::from_utf8(stored).unwrap();
        let one_short: String = text.lines().take(3).map(|l| format!("{l}\n")).collect();
        assert!(matches!(
            PieceHashes::parse(one_short.as_bytes(), size),
            Err(PiecesError::Count {
                expected: 3,
                found: 2,
                ..
            })
        ));
        let one_more = format!("{text}{}\n", "0".repeat(64));
        assert!(matches!(
            PieceHashes::parse(one_more.as_bytes(), size),
            Err(PiecesError::Count {
                expected: 3,
                found: 4,
                ..
            })
        ));
        let upper = text.replacen(
            &hex::encode(pieces.pieces[1]),
            &hex::encode_upper(pieces.pieces[1]),
            1,
        );
        assert_eq!(
            PieceHashes::parse(upper.as_bytes(), size),
            Err(PiecesError::Hash { line: 3 })
        );
        let other_cut = text.replacen(&PIECE_BYTES.to_string(), "4194304", 1);
        assert_eq!(
            PieceHashes::parse(other_cut.as_bytes(), size),
            Err(PiecesError::Header)
        );
    }
}
