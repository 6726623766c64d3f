//! Large files put together from their slices in the staging folder.
//!
//! A file cut into slices (`pieces.rs`) lands in one temp file beside its final name, each
//! slice written at its offset as its bytes arrive and hashed meanwhile; it counts as held
//! only once its hash is the side data's, whoever served it (a slice that does not verify
//! is written again, from elsewhere). The temp file is served to peers slice by slice, held
//! ones only, while the rest arrive: a node passes on what it holds before it holds the
//! whole file. When its last slice is written
//! the file is complete and verified piece by piece — read back and hashed whole first when
//! the copy asks for a read-back — and is renamed in under its name, made durable.

use std::collections::HashMap;
use std::fs::File;
use std::sync::{Arc, Mutex};

use stagehand_mover::{AtomicFile, ErrorKind, PosixTier, Side, TransferError};
use stagehand_schemas::manifest::FileRef;

use super::pieces::Piece;

/// The sliced files of one fan-out copy still being put together.
pub struct Assemblies {
    staging: PosixTier,
    /// Per file index: slices not yet written.
    slices: HashMap<usize, usize>,
    open: Mutex<HashMap<usize, Arc<Assembly>>>,
}

struct Assembly {
    landing: Mutex<Option<AtomicFile>>,
    /// The temp file, for writing slices (at their own offsets, so concurrently) and serving
    /// the held ones.
    file: Arc<File>,
    left: Mutex<usize>,
}

/// Where the bytes of one slice of a file being put together are written, as they arrive.
pub struct SliceLanding {
    assembly: Arc<Assembly>,
    staging: PosixTier,
    path: String,
}

impl SliceLanding {
    /// Writes `bytes` at `offset` of the file. Blocking.
    pub fn write_at(&self, bytes: &[u8], offset: u64) -> Result<(), TransferError> {
        use std::os::unix::fs::FileExt;
        self.assembly.file.write_all_at(bytes, offset).map_err(|e| {
            TransferError::from_io(
                e,
                Side::Destination,
                self.staging.name(),
                &self.path,
                "write",
            )
        })
    }
}

impl Assemblies {
    /// The sliced files among `pieces`, to be put together in `staging`.
    pub fn new(staging: PosixTier, pieces: &[Piece]) -> Assemblies {
        let mut slices = HashMap::new();
        for piece in pieces.iter().filter(|p| p.slice.is_some()) {
            *slices.entry(piece.files.start).or_default() += 1;
        }
        Assemblies {
            staging,
            slices,
            open: Mutex::new(HashMap::new()),
        }
    }

    /// The temp file of file `index`, begun if need be, to write a slice into.
    pub fn landing(&self, index: usize, file: &FileRef) -> Result<SliceLanding, TransferError> {
        Ok(SliceLanding {
            assembly: self.assembly(index, file)?,
            staging: self.staging.clone(),
            path: file.path.clone(),
        })
    }

    /// One more slice of file `index` is written and verified. Returns whether it was the last:
    /// the file is then complete, checked whole when `read_back`, and in place under its name.
    /// Blocking.
    pub fn slice_written(
        &self,
        index: usize,
        file: &FileRef,
        read_back: bool,
    ) -> Result<bool, TransferError> {
        let assembly = self.assembly(index, file)?;
        let last = {
            let mut left = lock(&assembly.left);
            *left = left.saturating_sub(1);
            *left == 0
        };
        if !last {
            return Ok(false);
        }
        let landing = lock(&assembly.landing)
            .take()
            .ok_or_else(|| self.local(file, "its last slice was written twice"))?;
        if read_back {
            let there = landing.hash_written()?;
            if there.sha256 != file.sha256 || there.size != file.size {
                return Err(TransferError::new(
                    ErrorKind::ChecksumMismatch,
                    Side::Destination,
                    self.staging.name(),
                    &file.path,
                    format!(
                        "read back, its {} bytes hash to {}; every slice written verified, the manifest says {}",
                        there.size, there.sha256, file.sha256
                    ),
                ));
            }
        }
        landing.commit()?;
        // Renamed first, then forgotten: a peer's request finds the temp file or the named one.
        lock(&self.open).remove(&index);
        Ok(true)
    }

    /// The temp file of file `index` while it is put together; `None` once it is in place
    /// under its name (or not begun).
    pub fn reader(&self, index: usize) -> Option<Arc<File>> {
        lock(&self.open).get(&index).map(|a| a.file.clone())
    }

    fn assembly(&self, index: usize, file: &FileRef) -> Result<Arc<Assembly>, TransferError> {
        let mut open = lock(&self.open);
        if let Some(a) = open.get(&index) {
            return Ok(a.clone());
        }
        let Some(&slices) = self.slices.get(&index) else {
            return Err(self.local(file, "a slice of a file that is not cut into slices"));
        };
        let landing = self.staging.create_atomic(&file.path, file.size)?;
        let handle = landing.file().try_clone().map_err(|e| {
            TransferError::from_io(
                e,
                Side::Destination,
                self.staging.name(),
                &file.path,
                "open for writing slices",
            )
        })?;
        let assembly = Arc::new(Assembly {
            landing: Mutex::new(Some(landing)),
            file: Arc::new(handle),
            left: Mutex::new(slices),
        });
        open.insert(index, assembly.clone());
        Ok(assembly)
    }

    fn local(&self, file: &FileRef, why: &str) -> TransferError {
        TransferError::new(
            ErrorKind::Io,
            Side::Destination,
            self.staging.name(),
            &file.path,
            why,
        )
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::os::unix::fs::FileExt;

    use stagehand_schemas::pieces::{PIECE_BYTES, PieceHashes};

    use super::*;
    use crate::fanout::pieces;

    fn big() -> Vec<u8> {
        (0..2 * PIECE_BYTES + 4321)
            .map(|i| (i * 31 + i / 8191) as u8)
            .collect()
    }

    fn sliced(file: &FileRef, bytes: &[u8]) -> Vec<Piece> {
        let side = HashMap::from([(0, PieceHashes::of(bytes))]);
        pieces::cut(std::slice::from_ref(file), &side)
    }

    /// Writes a verified slice whole and counts it.
    fn write(
        assemblies: &Assemblies,
        file: &FileRef,
        offset: u64,
        bytes: &[u8],
    ) -> Result<bool, TransferError> {
        assemblies.landing(0, file)?.write_at(bytes, offset)?;
        assemblies.slice_written(0, file, true)
    }

    fn slice_of<'b>(bytes: &'b [u8], piece: &Piece) -> &'b [u8] {
        let r = piece.range().unwrap();
        &bytes[r.start as usize..r.end as usize]
    }

    #[test]
    fn a_file_is_served_slice_by_slice_while_put_together_and_named_only_once_whole() {
        let dir = tempfile::tempdir().unwrap();
        let staging = PosixTier::open("local", dir.path()).unwrap();
        let bytes = big();
        let file = FileRef::new(
            "w/shard.bin",
            bytes.len() as u64,
            stagehand_schemas::sha256_hex(&bytes),
        );
        let pieces = sliced(&file, &bytes);
        assert_eq!(pieces.len(), 3);
        let assemblies = Assemblies::new(staging, &pieces);
        assert!(assemblies.reader(0).is_none(), "nothing begun");
        // The last slice first: served from the temp file at once; the name is not there yet.
        let done = write(
            &assemblies,
            &file,
            pieces[2].range().unwrap().start,
            slice_of(&bytes, &pieces[2]),
        )
        .unwrap();
        assert!(!done);
        let reader = assemblies.reader(0).expect("the temp file is served");
        let mut served = vec![0u8; pieces[2].bytes as usize];
        reader
            .read_exact_at(&mut served, pieces[2].range().unwrap().start)
            .unwrap();
        assert!(served == slice_of(&bytes, &pieces[2]));
        assert!(!dir.path().join("w/shard.bin").exists());
        for piece in &pieces[..2] {
            let done = write(
                &assemblies,
                &file,
                piece.range().unwrap().start,
                slice_of(&bytes, piece),
            )
            .unwrap();
            assert_eq!(done, piece == &pieces[1]);
        }
        assert!(std::fs::read(dir.path().join("w/shard.bin")).unwrap() == bytes);
        assert!(
            assemblies.reader(0).is_none(),
            "served under its name from now on"
        );
        let left: Vec<_> = std::fs::read_dir(dir.path().join("w"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, ["shard.bin"], "no temp file left");
    }

    #[test]
    fn a_file_that_does_not_read_back_whole_is_not_named() {
        let dir = tempfile::tempdir().unwrap();
        let staging = PosixTier::open("local", dir.path()).unwrap();
        let bytes = big();
        // Slices that verified, of a file the manifest hashes otherwise: the read-back catches it.
        let file = FileRef::new("shard.bin", bytes.len() as u64, "0".repeat(64));
        let pieces = sliced(&file, &bytes);
        let assemblies = Assemblies::new(staging, &pieces);
        let mut last = None;
        for piece in &pieces {
            last = Some(write(
                &assemblies,
                &file,
                piece.range().unwrap().start,
                slice_of(&bytes, piece),
            ));
        }
        let err = last.unwrap().unwrap_err();
        assert_eq!(err.kind, ErrorKind::ChecksumMismatch, "{err}");
        assert!(
            std::fs::read_dir(dir.path()).unwrap().next().is_none(),
            "nothing left: {err}"
        );
    }
}
