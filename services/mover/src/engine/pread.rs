//! The fallback engine: worker threads that `pread` a block, hash it and `pwrite` it.
//! Same semantics as the io_uring engine (one read per byte, hash of the written buffer,
//! short writes continued, a source shorter than its starting size reported), fewer blocks
//! in flight.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};

use super::{EngineError, EngineParams, Job};
use crate::sched::RateLimiter;
use crate::transfer::Progress;

pub(crate) struct PreadEngine {
    tx: mpsc::Sender<Job>,
}

impl PreadEngine {
    pub fn start(params: EngineParams, limiter: Option<Arc<RateLimiter>>) -> PreadEngine {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..params.threads.max(1) {
            let rx = rx.clone();
            let limiter = limiter.clone();
            let block = params.block_size;
            std::thread::Builder::new()
                .name(format!("stagehand-pread-{i}"))
                .spawn(move || worker(&rx, block, limiter.as_deref()))
                .expect("spawning a pread worker thread");
        }
        PreadEngine { tx }
    }

    pub fn submit(&self, job: Job) -> Result<(), EngineError> {
        self.tx.send(job).map_err(|_| EngineError::Stopped)
    }
}

fn worker(rx: &Mutex<mpsc::Receiver<Job>>, block: usize, limiter: Option<&RateLimiter>) {
    let mut buf = vec![0u8; block];
    loop {
        let job = {
            let guard = rx.lock().unwrap_or_else(|p| p.into_inner());
            match guard.recv() {
                Ok(job) => job,
                Err(_) => return,
            }
        };
        let result = copy_blocks(
            &job.src,
            &job.dst,
            job.size,
            &mut buf,
            &job.progress,
            limiter,
        );
        let _ = job.reply.send(result);
    }
}

/// Copies `size` bytes from `src` to `dst` (both from offset 0) through `buf`: each block is
/// read once, hashed, then written from the same buffer in full. Returns the hex SHA-256.
/// Also the mover's inline path for small files, where handing a 4 KiB file to another
/// thread costs more than copying it.
pub(crate) fn copy_blocks(
    src: &File,
    dst: &File,
    size: u64,
    buf: &mut [u8],
    progress: &Progress,
    limiter: Option<&RateLimiter>,
) -> Result<String, EngineError> {
    let mut hasher = Sha256::new();
    let mut offset = 0u64;
    while offset < size {
        let want = (size - offset).min(buf.len() as u64) as usize;
        if let Some(l) = limiter {
            l.take_blocking(want as u64);
        }
        let mut filled = 0;
        while filled < want {
            match src.read_at(&mut buf[filled..want], offset + filled as u64) {
                Ok(0) => {
                    return Err(EngineError::SourceShort {
                        at: offset + filled as u64,
                    });
                }
                Ok(n) => filled += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(EngineError::Read(e)),
            }
        }
        hasher.update(&buf[..want]);
        dst.write_all_at(&buf[..want], offset)
            .map_err(EngineError::Write)?;
        offset += want as u64;
        progress.add_bytes(want as u64);
    }
    Ok(hex::encode(hasher.finalize()))
}
