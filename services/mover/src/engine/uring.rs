//! The io_uring engine: one ring thread that owns the ring and a set of registered buffers,
//! and one hashing thread per core.
//!
//! For each block: `ReadFixed` into a free registered buffer; when it completes, the ring
//! thread submits the `WriteFixed` of that same buffer and hands the buffer to the file's
//! hashing thread at once, so hashing block N overlaps reading N+1.. and writing N; a buffer
//! is reused when both its write and its hash are done. Each file is assigned to the least
//! busy hashing thread when it arrives and hashed there in offset order (reads may complete
//! out of order; SHA-256 of one file is sequential). Blocks of several files are in flight
//! together, round robin, so a multi-file copy hashes on every core at once from the same
//! buffers it writes — one read per byte, no copy. Reads are submitted `IOSQE_ASYNC`, so the
//! kernel's copy out of the page cache runs on io_uring's workers beside the hashers instead
//! of serially on the ring thread. Jobs arrive over a channel; an eventfd
//! read kept pending in the ring wakes the ring thread for new jobs and for buffers the
//! hashers return.
//!
//! Files of at least [`DIRECT_FROM`] bytes are written with `O_DIRECT` (when
//! [`EngineParams::direct_writes`] is on and the filesystem accepts it): the registered buffers
//! go to the device by DMA, so a large copy neither copies every byte a second time into the
//! page cache nor leaves gigabytes of dirty pages for `fdatasync` (and dirty-page throttling)
//! to wait on; `fdatasync` at publish then only flushes metadata and the device cache.
//! Measured on a 4 GiB file, buffered writes cost 3–4× the CPU of the hash (page-cache copy,
//! writeback, throttled writers); direct writes keep the copy within a few percent of the
//! single-core hash rate. The destination is sized up front so direct writes overwrite the
//! preallocated extents instead of extending the file (an extending direct write takes the
//! inode lock exclusively and runs one at a time). A final block whose length is not a
//! multiple of [`DIRECT_ALIGN`] is written through the page cache once every direct write of
//! the file is done. A direct write the filesystem refuses (`EINVAL`) is retried buffered.
//!
//! Sources of at least [`DIRECT_FROM`] bytes that the page cache holds less than half of
//! (`cachestat(2)`, when [`EngineParams::direct_reads`] is on) are read with `O_DIRECT`: the
//! device fills the registered buffers by DMA instead of the kernel's read-ahead filling the
//! cache and a worker copying out of it. Each read is rounded up to [`DIRECT_ALIGN`] (the
//! buffers are multiples of it; the file's end makes the last one short, as expected). A
//! cached source is read from memory as before, and a direct read the filesystem refuses is
//! retried buffered.
//!
//! A byte-rate limit delays the reads of the job that is over budget (a ring timeout wakes
//! the thread when its time comes); the ring thread never sleeps, so other jobs' writes,
//! hashes and replies keep flowing.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::mpsc::{self, TryRecvError};
use std::time::{Duration, Instant};

use io_uring::{IoUring, opcode, squeue, types};
use sha2::{Digest, Sha256};

use super::{EngineError, EngineParams, Job};
use crate::posix::{DIRECT_ALIGN, mostly_uncached, set_direct};
use crate::sched::RateLimiter;

const OP_READ: u64 = 1;
const OP_WRITE: u64 = 2;
const OP_WAKE: u64 = 3;
const OP_TIMER: u64 = 4;
const BUF_ALIGN: usize = 4096;
/// Files at least this large are written with `O_DIRECT` (see the module docs).
pub(crate) const DIRECT_FROM: u64 = 1 << 20;

/// Prepares a job's destination for direct writes; `false` when it stays buffered.
fn start_direct(job: &Job) -> bool {
    if set_direct(&job.dst, true).is_err() {
        return false;
    }
    // Sized up front: direct writes then overwrite preallocated space instead of extending
    // the file. A failed copy never publishes the temp file, so the zeros it may hold beyond
    // what was written are never seen as data.
    if rustix::fs::ftruncate(&job.dst, job.size).is_err() {
        let _ = set_direct(&job.dst, false);
        return false;
    }
    true
}

/// Checks that a ring can be created and completes a NOP (a seccomp filter or
/// `kernel.io_uring_disabled` makes one of the two fail).
pub(crate) fn probe() -> io::Result<()> {
    let mut ring: IoUring = IoUring::new(2)?;
    let nop = opcode::Nop::new().build().user_data(42);
    // SAFETY: a NOP references no memory.
    unsafe {
        ring.submission()
            .push(&nop)
            .map_err(|_| io::Error::other("submission queue full"))?;
    }
    ring.submit_and_wait(1)?;
    let cqe = ring
        .completion()
        .next()
        .ok_or_else(|| io::Error::other("no completion for the probe NOP"))?;
    if cqe.user_data() != 42 || cqe.result() < 0 {
        return Err(io::Error::from_raw_os_error(-cqe.result()));
    }
    Ok(())
}

fn new_eventfd() -> io::Result<OwnedFd> {
    // SAFETY: plain syscall; the fd is owned on success.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh, valid descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn wake(fd: &OwnedFd) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a valid u64 to an eventfd.
    unsafe {
        libc::write(fd.as_raw_fd(), (&one as *const u64).cast(), 8);
    }
}

pub(crate) struct UringEngine {
    tx: Option<mpsc::Sender<Job>>,
    wake: Arc<OwnedFd>,
}

impl UringEngine {
    pub fn start(
        params: EngineParams,
        limiter: Option<Arc<RateLimiter>>,
    ) -> io::Result<UringEngine> {
        let nbufs = params.buffers.clamp(2, 1024);
        let entries = (nbufs as u32 + 3).next_power_of_two();
        // Not SINGLE_ISSUER: the ring is created here and driven from the ring thread.
        let ring: IoUring = IoUring::new(entries)?;
        let bufs = Buffers::new(nbufs, params.block_size)?;
        let hash_threads = params.hash_threads.max(1);
        // SAFETY: the iovecs point into `bufs`, which lives as long as the ring thread that
        // owns the ring (it is dropped after the ring).
        unsafe { ring.submitter().register_buffers(&bufs.iovecs())? };
        let wake_fd = Arc::new(new_eventfd()?);
        let (tx, rx) = mpsc::channel::<Job>();
        let thread_wake = wake_fd.clone();
        std::thread::Builder::new()
            .name("stagehand-uring".into())
            .spawn(move || {
                let mut ring_thread =
                    RingThread::new(ring, bufs, rx, thread_wake, limiter, params, hash_threads);
                ring_thread.run();
            })?;
        Ok(UringEngine {
            tx: Some(tx),
            wake: wake_fd,
        })
    }

    pub fn submit(&self, job: Job) -> Result<(), EngineError> {
        self.tx
            .as_ref()
            .ok_or(EngineError::Stopped)?
            .send(job)
            .map_err(|_| EngineError::Stopped)?;
        wake(&self.wake);
        Ok(())
    }
}

impl Drop for UringEngine {
    fn drop(&mut self) {
        // Closing the channel and waking the thread lets it finish its jobs and exit.
        self.tx.take();
        wake(&self.wake);
    }
}

/// One aligned allocation cut into `count` blocks of `size` bytes.
struct Buffers {
    ptr: *mut u8,
    count: usize,
    size: usize,
    layout: std::alloc::Layout,
}

// SAFETY: the allocation is plain memory; access is coordinated by buffer ownership states.
unsafe impl Send for Buffers {}

impl Buffers {
    fn new(count: usize, size: usize) -> io::Result<Buffers> {
        let size = size.max(DIRECT_ALIGN).next_multiple_of(DIRECT_ALIGN);
        let layout = std::alloc::Layout::from_size_align(count * size, BUF_ALIGN)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        // SAFETY: layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(io::Error::from(io::ErrorKind::OutOfMemory));
        }
        Ok(Buffers {
            ptr,
            count,
            size,
            layout,
        })
    }

    fn ptr(&self, i: usize) -> *mut u8 {
        // SAFETY: i < count, so the offset is within the allocation.
        unsafe { self.ptr.add(i * self.size) }
    }

    fn iovecs(&self) -> Vec<libc::iovec> {
        (0..self.count)
            .map(|i| libc::iovec {
                iov_base: self.ptr(i).cast(),
                iov_len: self.size,
            })
            .collect()
    }
}

impl Drop for Buffers {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

/// A block handed to the hashing thread.
struct BlockPtr(*const u8);
// SAFETY: the ring thread does not reuse the buffer until the hasher hands it back.
unsafe impl Send for BlockPtr {}

enum HashMsg {
    Start {
        job: u64,
        size: u64,
    },
    Block {
        job: u64,
        off: u64,
        buf: usize,
        ptr: BlockPtr,
        len: usize,
    },
    Abort {
        job: u64,
    },
}

enum HashDone {
    Hashed { buf: usize },
    Digest { job: u64, hex: String },
}

fn hasher_main(rx: mpsc::Receiver<HashMsg>, tx: mpsc::Sender<HashDone>, wake_fd: Arc<OwnedFd>) {
    struct State {
        hasher: Sha256,
        next: u64,
        size: u64,
        pending: BTreeMap<u64, (usize, BlockPtr, usize)>,
    }
    let mut jobs: HashMap<u64, State> = HashMap::new();
    let handle = |msg: HashMsg, jobs: &mut HashMap<u64, State>| match msg {
        HashMsg::Start { job, size } => {
            jobs.insert(
                job,
                State {
                    hasher: Sha256::new(),
                    next: 0,
                    size,
                    pending: BTreeMap::new(),
                },
            );
        }
        HashMsg::Block {
            job,
            off,
            buf,
            ptr,
            len,
        } => {
            let Some(state) = jobs.get_mut(&job) else {
                let _ = tx.send(HashDone::Hashed { buf });
                return;
            };
            state.pending.insert(off, (buf, ptr, len));
            while let Some((buf, ptr, len)) = state.pending.remove(&state.next) {
                // SAFETY: the ring thread filled `len` bytes at `ptr` and does not touch the
                // buffer (except the in-flight write, which only reads it) until `Hashed`.
                let block = unsafe { std::slice::from_raw_parts(ptr.0, len) };
                state.hasher.update(block);
                state.next += len as u64;
                let _ = tx.send(HashDone::Hashed { buf });
            }
            if state.next >= state.size
                && let Some(state) = jobs.remove(&job)
            {
                let _ = tx.send(HashDone::Digest {
                    job,
                    hex: hex::encode(state.hasher.finalize()),
                });
            }
        }
        HashMsg::Abort { job } => {
            if let Some(state) = jobs.remove(&job) {
                for (_, (buf, _, _)) in state.pending {
                    let _ = tx.send(HashDone::Hashed { buf });
                }
            }
        }
    };
    while let Ok(msg) = rx.recv() {
        handle(msg, &mut jobs);
        // Drain what is queued before waking the ring thread: one wake per burst.
        while let Ok(msg) = rx.try_recv() {
            handle(msg, &mut jobs);
        }
        wake(&wake_fd);
    }
}

struct Active {
    job: Job,
    next_off: u64,
    held: usize,
    error: Option<EngineError>,
    digest: Option<String>,
    /// Whether the destination is open with `O_DIRECT` now.
    direct: bool,
    /// Whether the source is read with `O_DIRECT` now.
    src_direct: bool,
    /// Writes submitted and not yet completed.
    writes_pending: usize,
    /// An unaligned final block waiting for the direct writes to finish.
    tail: Option<usize>,
    /// Under a byte-rate limit: the next block is paid for and may be read from this instant.
    paid_until: Option<Instant>,
    /// The hashing thread this file's blocks go to.
    hasher: usize,
}

#[derive(Clone, Copy, Default)]
struct BufState {
    job: u64,
    off: u64,
    len: usize,
    written: usize,
    write_pending: bool,
    hash_pending: bool,
    /// Whether this block's read was submitted with the source in `O_DIRECT`.
    read_direct: bool,
}

struct RingThread {
    ring: IoUring,
    bufs: Buffers,
    states: Vec<BufState>,
    free: Vec<usize>,
    jobs_rx: mpsc::Receiver<Job>,
    jobs_closed: bool,
    wake_fd: Arc<OwnedFd>,
    wake_buf: Box<u64>,
    wake_pending: bool,
    /// One channel per hashing thread; a file is hashed on one of them, from start to end.
    hash_txs: Vec<mpsc::Sender<HashMsg>>,
    /// Files being hashed on each hashing thread (a new file goes to the least busy).
    hasher_load: Vec<usize>,
    done_rx: mpsc::Receiver<HashDone>,
    active: HashMap<u64, Active>,
    order: Vec<u64>,
    rr: usize,
    next_id: u64,
    limiter: Option<Arc<RateLimiter>>,
    direct_writes: bool,
    direct_reads: bool,
    /// The pending ring timeout that wakes the thread for a rate-limited job, and when.
    timer: Option<Instant>,
    timer_spec: Box<types::Timespec>,
}

impl RingThread {
    fn new(
        ring: IoUring,
        bufs: Buffers,
        jobs_rx: mpsc::Receiver<Job>,
        wake_fd: Arc<OwnedFd>,
        limiter: Option<Arc<RateLimiter>>,
        params: EngineParams,
        hash_threads: usize,
    ) -> RingThread {
        let (done_tx, done_rx) = mpsc::channel();
        let hash_txs: Vec<mpsc::Sender<HashMsg>> = (0..hash_threads.max(1))
            .map(|i| {
                let (hash_tx, hash_rx) = mpsc::channel();
                let (done_tx, hasher_wake) = (done_tx.clone(), wake_fd.clone());
                std::thread::Builder::new()
                    .name(format!("stagehand-hash-{i}"))
                    .spawn(move || hasher_main(hash_rx, done_tx, hasher_wake))
                    .expect("spawning a hashing thread");
                hash_tx
            })
            .collect();
        drop(done_tx);
        let count = bufs.count;
        RingThread {
            ring,
            bufs,
            states: vec![BufState::default(); count],
            free: (0..count).rev().collect(),
            jobs_rx,
            jobs_closed: false,
            wake_fd,
            wake_buf: Box::new(0),
            wake_pending: false,
            hasher_load: vec![0; hash_txs.len()],
            hash_txs,
            done_rx,
            active: HashMap::new(),
            order: Vec::new(),
            rr: 0,
            next_id: 1,
            limiter,
            direct_writes: params.direct_writes,
            direct_reads: params.direct_reads,
            timer: None,
            timer_spec: Box::new(types::Timespec::new()),
        }
    }

    fn hash_send(&self, hasher: usize, msg: HashMsg) {
        if let Some(tx) = self.hash_txs.get(hasher) {
            let _ = tx.send(msg);
        }
    }

    fn run(&mut self) {
        loop {
            self.intake();
            while let Ok(done) = self.done_rx.try_recv() {
                self.on_hash_done(done);
            }
            self.finish_jobs();
            if self.jobs_closed && self.active.is_empty() {
                break;
            }
            self.schedule_reads();
            if !self.wake_pending {
                self.push_wake();
            }
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e)
                    if e.raw_os_error() == Some(libc::EINTR)
                        || e.raw_os_error() == Some(libc::EBUSY) => {}
                Err(e) => {
                    self.fail_all(e);
                    break;
                }
            }
            let cqes: Vec<(u64, i32)> = self
                .ring
                .completion()
                .map(|c| (c.user_data(), c.result()))
                .collect();
            for (data, res) in cqes {
                self.on_completion(data, res);
            }
        }
        self.shutdown();
    }

    /// Lets the pending eventfd read complete before the ring (and `wake_buf`) go away.
    fn shutdown(&mut self) {
        self.hash_txs.clear();
        if self.timer.is_some() {
            // A rate-limited job that failed may leave its timer behind: cancel it rather
            // than wait for it.
            let cancel = opcode::TimeoutRemove::new(OP_TIMER << 32)
                .build()
                .user_data(OP_TIMER << 32 | 1);
            self.push(&cancel);
        }
        while self.wake_pending || self.timer.is_some() {
            wake(&self.wake_fd);
            if self.ring.submit_and_wait(1).is_err() {
                break;
            }
            let cqes: Vec<u64> = self.ring.completion().map(|c| c.user_data()).collect();
            for d in cqes {
                match (d >> 32, d & 0xffff_ffff) {
                    (OP_WAKE, _) => self.wake_pending = false,
                    (OP_TIMER, 0) => self.timer = None,
                    _ => {}
                }
            }
        }
    }

    fn fail_all(&mut self, e: io::Error) {
        tracing::error!(error = %e, "io_uring submit failed; failing the engine's jobs");
        for (_, a) in self.active.drain() {
            let _ = a.job.reply.send(Err(EngineError::Read(io::Error::new(
                e.kind(),
                e.to_string(),
            ))));
        }
    }

    fn intake(&mut self) {
        loop {
            match self.jobs_rx.try_recv() {
                Ok(job) => {
                    let id = self.next_id;
                    self.next_id += 1;
                    let direct =
                        self.direct_writes && job.size >= DIRECT_FROM && start_direct(&job);
                    let src_direct = self.direct_reads
                        && job.size >= DIRECT_FROM
                        && mostly_uncached(&job.src, job.size)
                        && set_direct(&job.src, true).is_ok();
                    // The least busy hashing thread takes the whole file (SHA-256 of one
                    // file is sequential; files in flight together spread over the cores).
                    let hasher = (0..self.hasher_load.len())
                        .min_by_key(|&h| self.hasher_load[h])
                        .unwrap_or(0);
                    if let Some(load) = self.hasher_load.get_mut(hasher) {
                        *load += 1;
                    }
                    self.hash_send(
                        hasher,
                        HashMsg::Start {
                            job: id,
                            size: job.size,
                        },
                    );
                    self.active.insert(
                        id,
                        Active {
                            job,
                            next_off: 0,
                            held: 0,
                            error: None,
                            digest: None,
                            direct,
                            src_direct,
                            writes_pending: 0,
                            tail: None,
                            paid_until: None,
                            hasher,
                        },
                    );
                    self.order.push(id);
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    self.jobs_closed = true;
                    break;
                }
            }
        }
    }

    fn push_wake(&mut self) {
        let sqe = opcode::Read::new(
            types::Fd(self.wake_fd.as_raw_fd()),
            (&mut *self.wake_buf as *mut u64).cast(),
            8,
        )
        .build()
        .user_data(OP_WAKE << 32);
        // SAFETY: wake_buf lives in self, which outlives the ring's use of it (see shutdown).
        if unsafe { self.ring.submission().push(&sqe) }.is_ok() {
            self.wake_pending = true;
        }
    }

    fn schedule_reads(&mut self) {
        let block = self.bufs.size as u64;
        let now = Instant::now();
        let mut wake_at: Option<Instant> = None;
        while !self.free.is_empty() && !self.order.is_empty() {
            // Round robin over files that still have blocks to read and are within budget.
            let mut picked = None;
            for step in 0..self.order.len() {
                let idx = (self.rr + step) % self.order.len();
                let id = self.order[idx];
                let Some(a) = self.active.get_mut(&id) else {
                    continue;
                };
                if a.error.is_some() || a.next_off >= a.job.size {
                    continue;
                }
                if let Some(limiter) = &self.limiter {
                    let at = match a.paid_until {
                        Some(at) => at,
                        None => {
                            let len = (a.job.size - a.next_off).min(block);
                            let at = now + limiter.reserve_at(len, now);
                            a.paid_until = Some(at);
                            at
                        }
                    };
                    if at > now {
                        wake_at = Some(wake_at.map_or(at, |w| w.min(at)));
                        continue;
                    }
                    a.paid_until = None;
                }
                picked = Some((idx, id));
                break;
            }
            let Some((idx, id)) = picked else { break };
            self.rr = idx + 1;
            let buf = self.free.pop().expect("checked non-empty");
            let a = self.active.get_mut(&id).expect("picked from active");
            let len = (a.job.size - a.next_off).min(block) as usize;
            let off = a.next_off;
            a.next_off += len as u64;
            a.held += 1;
            self.states[buf] = BufState {
                job: id,
                off,
                len,
                written: 0,
                write_pending: false,
                hash_pending: false,
                read_direct: false,
            };
            self.push_read(buf);
        }
        // Drop finished files from the round-robin order.
        let active = &self.active;
        self.order.retain(|id| {
            active
                .get(id)
                .is_some_and(|a| a.error.is_none() && a.next_off < a.job.size)
        });
        if self.rr > self.order.len() {
            self.rr = 0;
        }
        // One timer at a time: reservations are handed out in time order, so the pending
        // one is never later than a newer job's; when it fires the loop looks again.
        if let Some(at) = wake_at
            && self.timer.is_none()
        {
            self.arm_timer(at.saturating_duration_since(now));
            self.timer = Some(at);
        }
    }

    /// Wakes the ring thread after `after` (a rate-limited job's next block).
    fn arm_timer(&mut self, after: Duration) {
        *self.timer_spec = types::Timespec::new()
            .sec(after.as_secs())
            .nsec(after.subsec_nanos().max(1));
        let sqe = opcode::Timeout::new(&*self.timer_spec)
            .build()
            .user_data(OP_TIMER << 32);
        // SAFETY: the timespec is read when the timeout is submitted and lives in self.
        self.push(&sqe);
    }

    /// Pushes one submission; the queue is sized for every buffer plus the wake read and the
    /// timer, so after a submit there is always room.
    fn push(&mut self, sqe: &io_uring::squeue::Entry) {
        // SAFETY: callers guarantee the memory and fds the entry references outlive it.
        if unsafe { self.ring.submission().push(sqe) }.is_err() {
            let _ = self.ring.submit();
            // SAFETY: as above.
            unsafe { self.ring.submission().push(sqe) }
                .expect("submission queue has room after submit");
        }
    }

    fn push_write(&mut self, buf: usize) {
        let st = self.states[buf];
        let a = self
            .active
            .get_mut(&st.job)
            .expect("a buffer's job is active");
        a.writes_pending += 1;
        let fd = a.job.dst.as_raw_fd();
        // SAFETY: written < len <= buffer size.
        let ptr = unsafe { self.bufs.ptr(buf).add(st.written) };
        let sqe =
            opcode::WriteFixed::new(types::Fd(fd), ptr, (st.len - st.written) as u32, buf as u16)
                .offset(st.off + st.written as u64)
                .build()
                .user_data(OP_WRITE << 32 | buf as u64);
        // SAFETY: the buffer stays untouched until the write completes; the fd stays open.
        self.push(&sqe);
        self.states[buf].write_pending = true;
    }

    /// Writes a direct job's unaligned final block once its direct writes are done, through
    /// the page cache.
    fn write_tail_when_ready(&mut self, id: u64) {
        let Some(a) = self.active.get_mut(&id) else {
            return;
        };
        if a.writes_pending > 0 || a.error.is_some() {
            return;
        }
        let Some(buf) = a.tail.take() else { return };
        if let Err(e) = set_direct(&a.job.dst, false) {
            self.states[buf].write_pending = false;
            self.fail(id, EngineError::Write(e));
            self.release(buf);
            return;
        }
        a.direct = false;
        self.push_write(buf);
    }

    fn fail(&mut self, id: u64, err: EngineError) {
        if let Some(a) = self.active.get_mut(&id)
            && a.error.is_none()
        {
            a.error = Some(err);
            let tail = a.tail.take();
            if let Some(tx) = self.hash_txs.get(a.hasher) {
                let _ = tx.send(HashMsg::Abort { job: id });
            }
            if let Some(buf) = tail {
                self.states[buf].write_pending = false;
                self.release(buf);
            }
        }
    }

    fn release(&mut self, buf: usize) {
        let st = self.states[buf];
        if st.write_pending || st.hash_pending {
            return;
        }
        if let Some(a) = self.active.get_mut(&st.job) {
            a.held -= 1;
        }
        self.free.push(buf);
    }

    /// Submits the read of the block `states[buf]` describes.
    fn push_read(&mut self, buf: usize) {
        let st = self.states[buf];
        let Some(a) = self.active.get(&st.job) else {
            self.release(buf);
            return;
        };
        let direct = a.src_direct;
        let (len, flags) = if direct {
            // Rounded up to the alignment (within the buffer): the file's end shortens the
            // last read to exactly its bytes. The device completes it without a worker.
            (
                st.len.next_multiple_of(DIRECT_ALIGN),
                squeue::Flags::empty(),
            )
        } else {
            // Punted to io_uring's worker threads: a read from the page cache would otherwise
            // complete inline, the ring thread copying every block itself while the hashers
            // wait for it (measured: 1.3 of 2 cores busy on 4 files; with workers copying in
            // parallel the hashers keep both cores).
            (st.len, squeue::Flags::ASYNC)
        };
        let sqe = opcode::ReadFixed::new(
            types::Fd(a.job.src.as_raw_fd()),
            self.bufs.ptr(buf),
            len as u32,
            buf as u16,
        )
        .offset(st.off)
        .build()
        .flags(flags)
        .user_data(OP_READ << 32 | buf as u64);
        self.states[buf].read_direct = direct;
        // SAFETY: the buffer is registered, owned by this read until it completes, and
        // the source fd stays open while its job is active.
        self.push(&sqe);
    }

    fn on_completion(&mut self, data: u64, res: i32) {
        let op = data >> 32;
        let buf = (data & 0xffff_ffff) as usize;
        match op {
            OP_WAKE => self.wake_pending = false,
            OP_READ => {
                let st = self.states[buf];
                let errored = self.active.get(&st.job).is_none_or(|a| a.error.is_some());
                if res == -libc::EINVAL
                    && st.read_direct
                    && !errored
                    && let Some(a) = self.active.get_mut(&st.job)
                {
                    // The filesystem or device refuses this direct read: this block (and any
                    // other refused one in flight) and the rest of the file are read through
                    // the page cache.
                    let switched = if a.src_direct {
                        a.src_direct = false;
                        set_direct(&a.job.src, false)
                    } else {
                        Ok(())
                    };
                    match switched {
                        Ok(()) => self.push_read(buf),
                        Err(e) => {
                            self.fail(st.job, EngineError::Read(e));
                            self.release(buf);
                        }
                    }
                    return;
                }
                if res < 0 {
                    self.fail(
                        st.job,
                        EngineError::Read(io::Error::from_raw_os_error(-res)),
                    );
                    self.release(buf);
                } else if (res as usize) < st.len {
                    self.fail(
                        st.job,
                        EngineError::SourceShort {
                            at: st.off + res as u64,
                        },
                    );
                    self.release(buf);
                } else if errored {
                    self.release(buf);
                } else {
                    // Handed to the hasher first: a failure below then finds it accounted for.
                    self.states[buf].hash_pending = true;
                    let hasher = self.active.get(&st.job).map_or(0, |a| a.hasher);
                    self.hash_send(
                        hasher,
                        HashMsg::Block {
                            job: st.job,
                            off: st.off,
                            buf,
                            ptr: BlockPtr(self.bufs.ptr(buf)),
                            len: st.len,
                        },
                    );
                    let direct = self.active.get(&st.job).is_some_and(|a| a.direct);
                    if direct && !st.len.is_multiple_of(DIRECT_ALIGN) {
                        // Held as if writing, so the buffer is not reused before the tail lands.
                        self.states[buf].write_pending = true;
                        if let Some(a) = self.active.get_mut(&st.job) {
                            a.tail = Some(buf);
                        }
                        self.write_tail_when_ready(st.job);
                    } else {
                        self.push_write(buf);
                    }
                }
            }
            OP_WRITE => {
                let st = self.states[buf];
                self.states[buf].write_pending = false;
                let Some(a) = self.active.get_mut(&st.job) else {
                    self.release(buf);
                    return;
                };
                a.writes_pending -= 1;
                if res == -libc::EINVAL && a.direct && a.error.is_none() {
                    // The filesystem or device refuses this direct write (alignment, or no
                    // direct I/O after all): the rest of the file goes through the page cache.
                    tracing::debug!("direct write refused; writing this file buffered");
                    if let Err(e) = set_direct(&a.job.dst, false) {
                        self.fail(st.job, EngineError::Write(e));
                        self.release(buf);
                        return;
                    }
                    a.direct = false;
                    self.push_write(buf);
                    return;
                }
                if res < 0 {
                    self.fail(
                        st.job,
                        EngineError::Write(io::Error::from_raw_os_error(-res)),
                    );
                } else if res == 0 {
                    self.fail(
                        st.job,
                        EngineError::Write(io::Error::from(io::ErrorKind::WriteZero)),
                    );
                } else {
                    let written = st.written + res as usize;
                    self.states[buf].written = written;
                    let errored = self.active.get(&st.job).is_none_or(|a| a.error.is_some());
                    if written < st.len && !errored {
                        // A short write is continued from where it stopped, never ignored.
                        self.push_write(buf);
                        return;
                    }
                    if written == st.len
                        && let Some(a) = self.active.get(&st.job)
                    {
                        a.job.progress.add_bytes(st.len as u64);
                    }
                }
                self.release(buf);
                self.write_tail_when_ready(st.job);
            }
            OP_TIMER if buf == 0 => self.timer = None,
            _ => {}
        }
    }

    fn on_hash_done(&mut self, done: HashDone) {
        match done {
            HashDone::Hashed { buf } => {
                self.states[buf].hash_pending = false;
                self.release(buf);
            }
            HashDone::Digest { job, hex } => {
                if let Some(a) = self.active.get_mut(&job) {
                    a.digest = Some(hex);
                }
            }
        }
    }

    fn finish_jobs(&mut self) {
        let done: Vec<u64> = self
            .active
            .iter()
            .filter(|(_, a)| {
                a.held == 0
                    && (a.error.is_some() || (a.next_off >= a.job.size && a.digest.is_some()))
            })
            .map(|(id, _)| *id)
            .collect();
        for id in done {
            let mut a = self.active.remove(&id).expect("listed above");
            if let Some(load) = self.hasher_load.get_mut(a.hasher) {
                *load = load.saturating_sub(1);
            }
            if a.direct
                && let Err(e) = set_direct(&a.job.dst, false)
                && a.error.is_none()
            {
                // The temp file is read back through ordinary buffers after this.
                a.error = Some(EngineError::Write(e));
            }
            let result = match (a.error, a.digest) {
                (Some(e), _) => Err(e),
                (None, Some(d)) => Ok(d),
                (None, None) => Err(EngineError::Stopped),
            };
            let _ = a.job.reply.send(result);
        }
    }
}
