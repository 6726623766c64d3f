//! The posix → posix data engines: read each block once, hash it, write it from the same
//! buffer. Two engines with the same semantics: io_uring (preferred) and `pread`/`pwrite`
//! (where io_uring is unavailable: an old kernel, `kernel.io_uring_disabled`, or a seccomp
//! profile that blocks it). Which one runs is decided once at start by creating a ring and
//! completing a NOP on it.

mod pread;
mod uring;

pub(crate) use pread::copy_blocks;

use std::fs::File;
use std::io;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::sched::RateLimiter;
use crate::transfer::Progress;

/// Which engine to use for posix → posix copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EngineChoice {
    /// io_uring when the probe succeeds, otherwise pread.
    #[default]
    Auto,
    /// io_uring, or fail at start when it is unavailable.
    IoUring,
    /// `pread`/`pwrite` worker threads.
    Pread,
}

impl EngineChoice {
    /// Every choice, the default first.
    pub const ALL: [EngineChoice; 3] = [
        EngineChoice::Auto,
        EngineChoice::IoUring,
        EngineChoice::Pread,
    ];

    /// The name configs use (`io_uring`); the command line spells it with a dash.
    pub fn as_str(self) -> &'static str {
        match self {
            EngineChoice::Auto => "auto",
            EngineChoice::IoUring => "io_uring",
            EngineChoice::Pread => "pread",
        }
    }
}

/// Sizes shared by both engines.
#[derive(Debug, Clone, Copy)]
pub(crate) struct EngineParams {
    pub block_size: usize,
    pub buffers: usize,
    pub threads: usize,
    /// Write large files with `O_DIRECT` where the filesystem allows (io_uring engine).
    pub direct_writes: bool,
    /// Read large, mostly uncached files with `O_DIRECT` (io_uring engine).
    pub direct_reads: bool,
    /// Hashing threads of the io_uring engine.
    pub hash_threads: usize,
}

/// One file's data to move: `size` bytes from `src` to `dst`, both at offset 0.
pub(crate) struct Job {
    pub src: File,
    pub dst: File,
    pub size: u64,
    pub progress: Progress,
    pub reply: tokio::sync::oneshot::Sender<Result<String, EngineError>>,
}

/// Why an engine could not move a file; the caller adds tier and path.
#[derive(Debug)]
pub(crate) enum EngineError {
    Read(io::Error),
    Write(io::Error),
    /// The source ended before the size it had when the copy started.
    SourceShort {
        at: u64,
    },
    /// The engine's thread is gone.
    Stopped,
}

pub(crate) enum Engine {
    Uring(uring::UringEngine),
    Pread(pread::PreadEngine),
}

impl Engine {
    /// Starts the engine `choice` names; `Auto` probes io_uring first.
    pub fn start(
        choice: EngineChoice,
        params: EngineParams,
        limiter: Option<Arc<RateLimiter>>,
    ) -> io::Result<Engine> {
        match choice {
            EngineChoice::Pread => Ok(Engine::Pread(pread::PreadEngine::start(params, limiter))),
            EngineChoice::IoUring => Ok(Engine::Uring(uring::UringEngine::start(params, limiter)?)),
            EngineChoice::Auto => match uring::probe() {
                Ok(()) => match uring::UringEngine::start(params, limiter.clone()) {
                    Ok(e) => Ok(Engine::Uring(e)),
                    Err(e) => {
                        tracing::warn!(error = %e, "io_uring probe passed but the engine did not start; using pread");
                        Ok(Engine::Pread(pread::PreadEngine::start(params, limiter)))
                    }
                },
                Err(e) => {
                    tracing::info!(error = %e, "io_uring unavailable; using the pread engine");
                    Ok(Engine::Pread(pread::PreadEngine::start(params, limiter)))
                }
            },
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Engine::Uring(_) => "io_uring",
            Engine::Pread(_) => "pread",
        }
    }

    /// Moves one file's bytes and returns their SHA-256 (lowercase hex).
    pub async fn run(
        &self,
        src: File,
        dst: File,
        size: u64,
        progress: Progress,
    ) -> Result<String, EngineError> {
        let (reply, rx) = tokio::sync::oneshot::channel();
        let job = Job {
            src,
            dst,
            size,
            progress,
            reply,
        };
        match self {
            Engine::Uring(e) => e.submit(job)?,
            Engine::Pread(e) => e.submit(job)?,
        }
        rx.await.map_err(|_| EngineError::Stopped)?
    }
}
