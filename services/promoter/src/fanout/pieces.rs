//! A version cut into pieces: the unit one node reads from the shared tier, announces, and
//! serves to its peers. Every node cuts the same file list the same way, so a piece number
//! means the same files on every node without a word exchanged.
//!
//! A piece is a run of consecutive files of the manifest (its path order) of at most
//! [`PIECE_BYTES`] and [`PIECE_FILES`] files, or one file larger than that alone. Each file of
//! a piece is verified against its own SHA-256 from the manifest as it arrives, so a piece
//! needs no hash of its own: the file that does not verify names the bytes, and the peer that
//! served them.

use std::ops::Range;

use stagehand_schemas::manifest::FileRef;

/// The most bytes of small files one piece holds: large enough that a piece costs one request
/// and one batch of renames, small enough that eight nodes have several pieces each of a
/// version of a few hundred MiB to read from the shared tier.
pub const PIECE_BYTES: u64 = 8 << 20;

/// The most files one piece holds: one request and one batch commit each.
pub const PIECE_FILES: usize = 256;

/// One piece: the manifest entries `files` (indices into the version's list) and their bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    pub files: Range<usize>,
    pub bytes: u64,
}

/// Cuts `files` (in manifest order) into pieces.
pub fn cut(files: &[FileRef]) -> Vec<Piece> {
    let mut pieces = Vec::new();
    let mut start = 0;
    let mut bytes = 0u64;
    for (i, file) in files.iter().enumerate() {
        let full = i > start && (bytes + file.size > PIECE_BYTES || i - start >= PIECE_FILES);
        if full {
            pieces.push(Piece {
                files: start..i,
                bytes,
            });
            start = i;
            bytes = 0;
        }
        bytes += file.size;
    }
    if start < files.len() {
        pieces.push(Piece {
            files: start..files.len(),
            bytes,
        });
    }
    pieces
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
        let pieces = cut(&files);
        assert_eq!(
            pieces.iter().map(|p| p.files.len()).collect::<Vec<_>>(),
            [256, 256, 88]
        );
        let files: Vec<FileRef> = (0..5).map(|_| file(3 << 20)).collect();
        let pieces = cut(&files);
        assert_eq!(
            pieces.iter().map(|p| p.files.clone()).collect::<Vec<_>>(),
            [0..2, 2..4, 4..5]
        );
        assert_eq!(pieces[0].bytes, 6 << 20);
    }

    #[test]
    fn a_file_larger_than_a_piece_is_a_piece_alone_and_every_file_is_in_exactly_one() {
        let files = vec![file(10), file(100 << 20), file(10), file(0), file(9 << 20)];
        let pieces = cut(&files);
        assert_eq!(
            pieces.iter().map(|p| p.files.clone()).collect::<Vec<_>>(),
            [0..1, 1..2, 2..4, 4..5]
        );
        let covered: Vec<usize> = pieces.iter().flat_map(|p| p.files.clone()).collect();
        assert_eq!(covered, (0..files.len()).collect::<Vec<_>>());
        assert_eq!(cut(&[]), Vec::<Piece>::new());
    }
}
