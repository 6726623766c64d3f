//! A version cut into pieces: the unit one node reads from the shared tier, announces, and
//! serves to its peers. Every node cuts the same file list the same way, so a piece number
//! means the same bytes on every node without a word exchanged; the swarm's name carries a
//! digest of the cut ([`layout`]), so nodes that cut differently never share a swarm.
//!
//! A piece is either a run of consecutive files of the manifest (its path order) of at most
//! [`PIECE_BYTES`] and [`PIECE_FILES`] files, each verified against its own SHA-256 from the
//! manifest as it arrives; or one [`PIECE_BYTES`] slice of a file larger than that, verified
//! against the slice's hash from the manifest's side data (`stagehand_schemas::pieces`: BLAKE3).
//! Either way the bytes that do not verify name the peer that served them. A large file
//! without side data (a version validated before side data was written) is a piece alone,
//! verified whole.

use std::collections::HashMap;
use std::ops::Range;

use sha2::{Digest, Sha256};
use stagehand_schemas::manifest::FileRef;
pub use stagehand_schemas::pieces::PIECE_BYTES;
use stagehand_schemas::pieces::PieceHashes;

/// The most files one piece holds: one request and one batch commit each.
pub const PIECE_FILES: usize = 256;

/// One piece: the manifest entries `files` (indices into the version's list) and their bytes,
/// or the slice `slice` of the one file `files` names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    pub files: Range<usize>,
    pub bytes: u64,
    pub slice: Option<Slice>,
}

/// A piece of one large file: its `bytes` from `offset`, whose piece hash (BLAKE3) is `hash`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slice {
    pub offset: u64,
    pub hash: [u8; 32],
}

impl Piece {
    /// The byte range of its file a slice covers.
    pub fn range(&self) -> Option<Range<u64>> {
        self.slice.as_ref().map(|s| s.offset..s.offset + self.bytes)
    }
}

/// Cuts `files` (in manifest order) into pieces; `side` holds the piece hashes of the large
/// files that have them, by index into `files`.
pub fn cut(files: &[FileRef], side: &HashMap<usize, PieceHashes>) -> Vec<Piece> {
    let mut pieces = Vec::new();
    let mut start = 0;
    let mut bytes = 0u64;
    for (i, file) in files.iter().enumerate() {
        let sliced = side.get(&i).filter(|h| h.size == file.size);
        let full = i > start
            && (sliced.is_some() || bytes + file.size > PIECE_BYTES || i - start >= PIECE_FILES);
        if full {
            pieces.push(Piece {
                files: start..i,
                bytes,
                slice: None,
            });
            start = i;
            bytes = 0;
        }
        if let Some(hashes) = sliced {
            for (n, hash) in hashes.pieces.iter().enumerate() {
                let range = PieceHashes::range(file.size, n as u64);
                pieces.push(Piece {
                    files: i..i + 1,
                    bytes: range.end - range.start,
                    slice: Some(Slice {
                        offset: range.start,
                        hash: *hash,
                    }),
                });
            }
            start = i + 1;
            continue;
        }
        bytes += file.size;
    }
    if start < files.len() {
        pieces.push(Piece {
            files: start..files.len(),
            bytes,
            slice: None,
        });
    }
    pieces
}

/// A digest of how `pieces` cut the version: part of the swarm's name.
pub fn layout(pieces: &[Piece]) -> String {
    let mut h = Sha256::new();
    h.update(format!("pieces:{PIECE_BYTES}:{PIECE_FILES}\n").as_bytes());
    for piece in pieces {
        h.update(format!("{}..{}", piece.files.start, piece.files.end).as_bytes());
        if let Some(slice) = &piece.slice {
            h.update(format!("@{}+{}:", slice.offset, piece.bytes).as_bytes());
            h.update(slice.hash);
        }
        h.update(b"\n");
    }
    hex::encode(&h.finalize()[..16])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(size: u64) -> FileRef {
        FileRef {
            path: "f".into(),
            size,
            sha256: "0".repeat(64),
        }
    }

    #[test]
    fn small_files_are_grouped_up_to_the_byte_and_file_bounds() {
        let files: Vec<FileRef> = (0..600).map(|_| file(1024)).collect();
        let pieces = cut(&files, &HashMap::new());
        assert_eq!(
            pieces.iter().map(|p| p.files.len()).collect::<Vec<_>>(),
            [256, 256, 88]
        );
        let files: Vec<FileRef> = (0..5).map(|_| file(3 << 20)).collect();
        let pieces = cut(&files, &HashMap::new());
        assert_eq!(
            pieces.iter().map(|p| p.files.clone()).collect::<Vec<_>>(),
            [0..2, 2..4, 4..5]
        );
        assert_eq!(pieces[0].bytes, 6 << 20);
    }

    #[test]
    fn a_file_larger_than_a_piece_is_a_piece_alone_and_every_file_is_in_exactly_one() {
        let files = vec![file(10), file(100 << 20), file(10), file(0), file(9 << 20)];
        let pieces = cut(&files, &HashMap::new());
        assert_eq!(
            pieces.iter().map(|p| p.files.clone()).collect::<Vec<_>>(),
            [0..1, 1..2, 2..4, 4..5]
        );
        let covered: Vec<usize> = pieces.iter().flat_map(|p| p.files.clone()).collect();
        assert_eq!(covered, (0..files.len()).collect::<Vec<_>>());
        assert_eq!(cut(&[], &HashMap::new()), Vec::<Piece>::new());
    }

    #[test]
    fn a_large_file_with_side_data_is_cut_into_slices_and_the_cut_names_the_swarm() {
        let size = 2 * PIECE_BYTES + 5;
        let hashes = PieceHashes {
            size,
            pieces: vec![[1; 32], [2; 32], [3; 32]],
        };
        let files = vec![file(10), file(size), file(10), file(size)];
        let side = HashMap::from([(1, hashes.clone())]);
        let pieces = cut(&files, &side);
        assert_eq!(
            pieces
                .iter()
                .map(|p| (p.files.clone(), p.range()))
                .collect::<Vec<_>>(),
            [
                (0..1, None),
                (1..2, Some(0..PIECE_BYTES)),
                (1..2, Some(PIECE_BYTES..2 * PIECE_BYTES)),
                (1..2, Some(2 * PIECE_BYTES..size)),
                (2..3, None),
                (3..4, None),
            ],
            "file 3 has no side data: a piece alone, verified whole"
        );
        assert_eq!(pieces[3].slice.as_ref().unwrap().hash, [3; 32]);
        let whole = cut(&files, &HashMap::new());
        assert_ne!(layout(&pieces), layout(&whole));
        assert_eq!(layout(&pieces), layout(&cut(&files, &side)));
        let wrong_size = HashMap::from([(
            1,
            PieceHashes {
                size: size + 1,
                ..hashes
            },
        )]);
        assert_eq!(
            cut(&files, &wrong_size),
            whole,
            "side data of another size is not used"
        );
    }
}
