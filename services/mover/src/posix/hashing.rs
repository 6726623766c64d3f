//! Hashing an open file: through the page cache, or with `O_DIRECT` when the file is mostly
//! out of it (so a large verify does not evict what jobs read), never past a cap.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

use rustix::fs::OFlags;
use sha2::{Digest, Sha256};
use stagehand_schemas::pieces::{PieceHasher, PieceHashes};

use crate::transfer::FileDigest;

/// Block size of the plain hashing reader.
const HASH_BLOCK: usize = 1 << 20;

/// Hashes a whole open file with positioned reads (the file offset is left alone).
pub(crate) fn hash_open_file(file: &File) -> io::Result<FileDigest> {
    hash_open_file_capped(file, u64::MAX)
}

/// Hashes an open file from offset 0 up to its end or `cap` bytes, whichever comes first.
fn hash_open_file_capped(file: &File, cap: u64) -> io::Result<FileDigest> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; HASH_BLOCK.min(usize::try_from(cap).unwrap_or(usize::MAX).max(1))];
    let mut offset = 0u64;
    while offset < cap {
        let want = (cap - offset).min(buf.len() as u64) as usize;
        let n = match file.read_at(&mut buf[..want], offset) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        hasher.update(&buf[..n]);
        offset += n as u64;
    }
    Ok(FileDigest {
        size: offset,
        sha256: hex::encode(hasher.finalize()),
    })
}

/// Offset, length and buffer-address alignment of a direct (`O_DIRECT`) read or write: the
/// largest logical block size in common use.
pub const DIRECT_ALIGN: usize = 4096;

/// [`hash_open_file_capped`] for a file this call may switch to `O_DIRECT` (its caller opened
/// it for this read alone): each block is first read from the page cache only
/// (`preadv2(RWF_NOWAIT)`); from the first block the cache does not hold, the rest is read
/// with `O_DIRECT`. A file written with direct writes (the mover's large copies), or evicted,
/// is then read from the device into the hashing buffer in one step, instead of through the
/// kernel's read-ahead into the page cache and copied out again, which costs as much CPU as
/// the hash itself when memory is full of cache and halves the rate on two cores; a cached
/// file is still read from memory. A filesystem without direct reads (or without
/// `RWF_NOWAIT`) is read as before. No more than `cap` bytes are hashed either way. A direct
/// read's unaligned end is read directly too, rounded up to the block: the kernel stops it at
/// the end of the file, and what lies past `cap` is read but not hashed. A tier of small files
/// so costs one trip to the device per file, not a second one through the cache for its last
/// block (`loadtest/scrub/README.md`).
pub(super) fn hash_uncached_file_capped(file: &File, cap: u64) -> io::Result<FileDigest> {
    hash_uncached_file_pieces(file, cap, PieceHasher::whole_only(), ReadFrom::CacheFirst)
        .map(|(digest, _)| digest)
}

/// Where a hash of an open file takes its bytes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadFrom {
    /// The page cache where it holds the file, the device (`O_DIRECT`) from the first block it
    /// does not: what a copy's read-back and a validation want, the cheapest read of the bytes
    /// the next reader gets.
    CacheFirst,
    /// The device alone (`O_DIRECT` from the first byte, where the filesystem takes it): what a
    /// scrub wants. It verifies what the disk holds, not a cached copy of it that hides rot
    /// until it is evicted, and it leaves the cache to jobs.
    Device,
}

/// [`hash_uncached_file_capped`] through `hasher`: with [`PieceHasher::new`], the piece hashes
/// of a file larger than a piece come from the same read as its SHA-256 (the validator's side
/// data).
pub(super) fn hash_uncached_file_pieces(
    file: &File,
    cap: u64,
    hasher: PieceHasher,
    from: ReadFrom,
) -> io::Result<(FileDigest, PieceHashes)> {
    thread_local! {
        /// This thread's hashing buffer, kept from one file to the next: a tier of small
        /// files is hashed one file after another on the same few threads, and a fresh zeroed
        /// buffer for each file cost a tenth of the scrub's rate (`loadtest/scrub/README.md`).
        static BUFFER: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    let block = HASH_BLOCK.min(usize::try_from(cap).unwrap_or(usize::MAX).max(1));
    let room = block.next_multiple_of(DIRECT_ALIGN);
    BUFFER.with_borrow_mut(|raw| {
        if raw.len() < room + DIRECT_ALIGN {
            *raw = vec![0u8; room + DIRECT_ALIGN];
        }
        let start = raw.as_ptr().align_offset(DIRECT_ALIGN);
        hash_through(file, cap, hasher, from, &mut raw[start..start + room])
    })
}

/// [`hash_uncached_file_pieces`] through `buf`, aligned for direct reads: its length is the
/// block read at once.
fn hash_through(
    file: &File,
    cap: u64,
    mut hasher: PieceHasher,
    from: ReadFrom,
    buf: &mut [u8],
) -> io::Result<(FileDigest, PieceHashes)> {
    use rustix::io::{Errno, ReadWriteFlags};
    let block = buf.len();
    let mut offset = 0u64;
    // Whether blocks are probed in the cache first; off once the device is read directly, or
    // when the kernel has no RWF_NOWAIT. A probe of a block the cache does not hold starts the
    // kernel's read-ahead of it before it answers EAGAIN, so the device would be read twice:
    // for a file `cachestat` says is mostly out of the cache (or a read from the device), the
    // device is read directly from the first block, with no probe.
    let mut probe =
        from == ReadFrom::CacheFirst && !mostly_uncached(file, cap.min(file.metadata()?.len()));
    // Whether the file is open `O_DIRECT` (only ever switched on, once).
    let mut direct = !probe && set_direct(file, true).is_ok();
    // Whether a direct read stopped inside a block: only the end of the file does that.
    let mut at_end = false;
    while offset < cap && !at_end {
        let want = (cap - offset).min(block as u64) as usize;
        let direct_ok = offset.is_multiple_of(DIRECT_ALIGN as u64);
        let mut n = None;
        if probe && !direct {
            match rustix::io::preadv2(
                file,
                &mut [io::IoSliceMut::new(&mut buf[..want])],
                offset,
                ReadWriteFlags::NOWAIT,
            ) {
                Ok(read) => n = Some(read),
                Err(Errno::INTR) => continue,
                // Not (all) in the page cache: read the rest from the device.
                Err(Errno::AGAIN) => {
                    probe = false;
                    direct = set_direct(file, true).is_ok();
                }
                // No RWF_NOWAIT here: plain reads.
                Err(Errno::OPNOTSUPP | Errno::INVAL) => probe = false,
                Err(e) => return Err(e.into()),
            }
        }
        let n = match n {
            Some(n) => n,
            None if direct && direct_ok => {
                let rounded = want.next_multiple_of(DIRECT_ALIGN);
                match rustix::io::pread(file, &mut buf[..rounded], offset) {
                    Ok(n) => {
                        at_end = !n.is_multiple_of(DIRECT_ALIGN);
                        // Past `cap` (a file longer than asked): read, not hashed.
                        n.min(want)
                    }
                    Err(Errno::INTR) => continue,
                    // A direct read the filesystem refuses after all: buffered from here on.
                    Err(Errno::INVAL) => {
                        set_direct(file, false)?;
                        direct = false;
                        continue;
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            None => {
                if direct {
                    // An unaligned offset (a short read before the end): through the cache.
                    set_direct(file, false)?;
                    direct = false;
                }
                match file.read_at(&mut buf[..want], offset) {
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(e),
                }
            }
        };
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        offset += n as u64;
    }
    let (whole, pieces) = hasher.finish();
    Ok((
        FileDigest {
            size: offset,
            sha256: hex::encode(whole),
        },
        pieces,
    ))
}

/// Whether the page cache holds less than half of the first `len` bytes of `file`, asked
/// with `cachestat(2)` (Linux 6.5): one call, no data read. `false` when the kernel cannot
/// say (older, or the call refused), so a caller keeps to buffered reads.
pub(crate) fn mostly_uncached(file: &File, len: u64) -> bool {
    use std::os::fd::AsRawFd;
    /// `struct cachestat_range` of the kernel's uapi.
    #[repr(C)]
    struct CachestatRange {
        off: u64,
        len: u64,
    }
    /// `struct cachestat` of the kernel's uapi (pages).
    #[repr(C)]
    #[derive(Default)]
    struct Cachestat {
        nr_cache: u64,
        nr_dirty: u64,
        nr_writeback: u64,
        nr_evicted: u64,
        nr_recently_evicted: u64,
    }
    /// The system call's number: new calls share one number on every architecture.
    const SYS_CACHESTAT: libc::c_long = 451;
    if len == 0 {
        return false;
    }
    let range = CachestatRange { off: 0, len };
    let mut stat = Cachestat::default();
    // SAFETY: both pointers are to live values of the layouts the kernel expects; the call
    // writes only `stat`.
    let rc = unsafe {
        libc::syscall(
            SYS_CACHESTAT,
            file.as_raw_fd(),
            &range as *const CachestatRange,
            &mut stat as *mut Cachestat,
            0u32,
        )
    };
    let pages = len.div_ceil(DIRECT_ALIGN as u64);
    // Dirty pages would be written back before a direct read of them: those files stay buffered.
    rc == 0 && stat.nr_dirty == 0 && stat.nr_cache * 2 < pages
}

/// Turns `O_DIRECT` on or off for the open file description behind `file`; turning it on
/// fails on a filesystem that does not take it (the file stays as it was).
pub(crate) fn set_direct(file: &File, on: bool) -> io::Result<()> {
    let flags = rustix::fs::fcntl_getfl(file)?;
    let new = if on {
        flags | OFlags::DIRECT
    } else {
        flags - OFlags::DIRECT
    };
    if new != flags {
        rustix::fs::fcntl_setfl(file, new)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_capped_hash_reads_no_further_than_its_cap() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, b"0123456789").unwrap();
        let file = File::open(&path).unwrap();
        let d = hash_open_file_capped(&file, 4).unwrap();
        assert_eq!(d.size, 4);
        assert_eq!(d.sha256, stagehand_schemas::manifest::sha256_hex(b"0123"));
        assert_eq!(hash_open_file(&file).unwrap().size, 10);
    }

    /// The validator's reader: a file out of the page cache (read with `O_DIRECT`), partly in
    /// it, or wholly in it hashes to its bytes, its unaligned end included, and a cap is
    /// honoured to the byte.
    #[test]
    fn an_uncached_file_hashes_to_its_bytes_within_its_cap() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let body: Vec<u8> = (0..(3 * HASH_BLOCK + 12345))
            .map(|i| (i * 7 + i / 4096) as u8)
            .collect();
        std::fs::write(&path, &body).unwrap();
        let evict = |from: u64| {
            let file = File::open(&path).unwrap();
            file.sync_all().unwrap();
            rustix::fs::fadvise(&file, from, None, rustix::fs::Advice::DontNeed).unwrap();
        };
        let sha = stagehand_schemas::manifest::sha256_hex;
        for (evicted_from, cap) in [
            (0, u64::MAX),
            (HASH_BLOCK as u64, u64::MAX),
            (0, body.len() as u64 + 1),
            (0, 2 * HASH_BLOCK as u64 + 4097),
            (0, 100),
        ] {
            evict(evicted_from);
            let file = File::open(&path).unwrap();
            let d = hash_uncached_file_capped(&file, cap).unwrap();
            let expect = &body[..body.len().min(usize::try_from(cap).unwrap_or(usize::MAX))];
            assert_eq!(d.size, expect.len() as u64, "cap {cap}");
            assert_eq!(
                d.sha256,
                sha(expect),
                "cap {cap}, evicted from {evicted_from}"
            );
        }
        // Cached: the same answer.
        let file = File::open(&path).unwrap();
        assert_eq!(
            hash_uncached_file_capped(&file, u64::MAX).unwrap().sha256,
            sha(&body)
        );
        // The scrub's case: a file smaller than a block, out of the cache, read with the cap
        // one past its declared size; and the same file declared one byte shorter (it grew).
        let small = dir.path().join("small");
        std::fs::write(&small, &body[..107_374]).unwrap();
        for (cap, hashed) in [(107_375, 107_374), (107_374, 107_374), (107_373, 107_373)] {
            let file = File::open(&small).unwrap();
            file.sync_all().unwrap();
            rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::DontNeed).unwrap();
            let d = hash_uncached_file_capped(&file, cap).unwrap();
            assert_eq!(d.size, hashed, "cap {cap}");
            assert_eq!(d.sha256, sha(&body[..hashed as usize]), "cap {cap}");
        }
    }

    /// A file out of the page cache is read from the device once, and stays out of the cache:
    /// a probe of the cache (`RWF_NOWAIT`) would start the kernel's read-ahead of the file
    /// before answering that it is not there, so a small file was read twice, once into the
    /// cache and once directly (half a scrub's rate over small files, and the jobs' cache
    /// filled with what the scrub read). Both ways of reading: cache first, and the scrub's
    /// device alone.
    #[test]
    fn a_file_out_of_the_cache_is_read_from_the_device_once_and_left_out_of_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("small");
        let body: Vec<u8> = (0..107_374u32).map(|i| (i * 31 + i / 4096) as u8).collect();
        std::fs::write(&path, &body).unwrap();
        let len = body.len() as u64;
        let evicted = || {
            let file = File::open(&path).unwrap();
            file.sync_all().unwrap();
            rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::DontNeed).unwrap();
            file
        };
        if !mostly_uncached(&evicted(), len) {
            // No cachestat(2) (Linux < 6.5), or the filesystem keeps its pages: nothing here
            // can tell where the bytes came from.
            eprintln!("the page cache cannot be observed here; nothing to check");
            return;
        }
        for from in [ReadFrom::CacheFirst, ReadFrom::Device] {
            let file = evicted();
            let (d, _) =
                hash_uncached_file_pieces(&file, len + 1, PieceHasher::whole_only(), from).unwrap();
            assert_eq!(d.size, len);
            assert_eq!(d.sha256, stagehand_schemas::manifest::sha256_hex(&body));
            assert!(
                mostly_uncached(&file, len),
                "{from:?}: hashing brought the file into the page cache"
            );
        }
        // Read from the device while it is cached: the same bytes.
        let file = File::open(&path).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), body);
        let (d, _) =
            hash_uncached_file_pieces(&file, len + 1, PieceHasher::whole_only(), ReadFrom::Device)
                .unwrap();
        assert_eq!(d.sha256, stagehand_schemas::manifest::sha256_hex(&body));
    }

    /// Guards the io_uring engine's choice of direct reads: a file evicted from the page
    /// cache is mostly uncached, the same file read back into it is not, and a file with
    /// dirty pages never is (a direct read would have to write them back first).
    #[test]
    fn a_file_out_of_the_page_cache_is_mostly_uncached_and_a_read_one_is_not() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let body = vec![7u8; 4 << 20];
        std::fs::write(&path, &body).unwrap();
        let file = File::open(&path).unwrap();
        let len = body.len() as u64;
        assert!(
            !mostly_uncached(&file, len),
            "just written: dirty or cached"
        );
        file.sync_all().unwrap();
        rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::DontNeed).unwrap();
        assert!(mostly_uncached(&file, len), "evicted");
        std::io::copy(&mut &file, &mut std::io::sink()).unwrap();
        assert!(!mostly_uncached(&file, len), "read back into the cache");
        assert!(!mostly_uncached(&file, 0), "nothing to read");
    }
}
