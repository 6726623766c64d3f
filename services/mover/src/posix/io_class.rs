//! The kernel's I/O class of the thread reading for a mover class: a read in the background
//! class ([`Priority::Backup`]: the scrub) is made in the idle I/O class, which the block
//! layer's schedulers (mq-deadline, BFQ) serve only while no other class waits, with aging so
//! it is never starved for good. The mover's own [`crate::Scheduler`] orders the classes within
//! one process; this orders them across processes, so a scrub in the demoter yields the disk to
//! a stage in the promoter. A device without such a scheduler (`none`) ignores it.

use crate::Priority;

/// `IOPRIO_WHO_PROCESS`: with `who` 0, the calling thread.
const IOPRIO_WHO_PROCESS: libc::c_int = 1;
/// `IOPRIO_CLASS_IDLE`, shifted into place (`IOPRIO_PRIO_VALUE(IOPRIO_CLASS_IDLE, 0)`).
const IOPRIO_IDLE: libc::c_int = 3 << 13;

/// The calling thread's I/O class while it reads for a mover class; the class it had before is
/// given back when dropped, so a thread of a shared pool leaves as it came.
pub(crate) struct IoClass {
    previous: Option<libc::c_int>,
}

impl IoClass {
    /// Enters the I/O class of `priority` for the calling thread: the idle class for the
    /// background class, none other changed. Best effort: a kernel that refuses it leaves the
    /// thread as it was.
    pub(crate) fn enter(priority: Priority) -> IoClass {
        if priority != Priority::Backup {
            return IoClass { previous: None };
        }
        // SAFETY: ioprio_get and ioprio_set take integers only and touch no memory of ours.
        let previous = unsafe { libc::syscall(libc::SYS_ioprio_get, IOPRIO_WHO_PROCESS, 0) };
        let Ok(previous) = libc::c_int::try_from(previous) else {
            return IoClass { previous: None };
        };
        if previous < 0 {
            return IoClass { previous: None };
        }
        // SAFETY: as above.
        let set =
            unsafe { libc::syscall(libc::SYS_ioprio_set, IOPRIO_WHO_PROCESS, 0, IOPRIO_IDLE) };
        IoClass {
            previous: (set == 0).then_some(previous),
        }
    }
}

impl Drop for IoClass {
    fn drop(&mut self) {
        if let Some(previous) = self.previous {
            // SAFETY: as in `enter`. Going back to the class it had is always allowed: it is
            // not the real-time class, which only a privileged thread could have set.
            unsafe { libc::syscall(libc::SYS_ioprio_set, IOPRIO_WHO_PROCESS, 0, previous) };
        }
    }
}

/// The calling thread's I/O priority value, as the kernel reports it.
#[cfg(test)]
fn current() -> libc::c_long {
    // SAFETY: as in `IoClass::enter`.
    unsafe { libc::syscall(libc::SYS_ioprio_get, IOPRIO_WHO_PROCESS, 0) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The background class reads in the idle class and gives the thread back as it was;
    /// every other class leaves the thread alone.
    #[test]
    fn the_background_class_reads_idle_and_the_thread_is_given_back() {
        std::thread::spawn(|| {
            let before = current();
            {
                let _idle = IoClass::enter(Priority::Backup);
                assert_eq!(current(), libc::c_long::from(IOPRIO_IDLE));
            }
            assert_eq!(current(), before);
            for priority in [Priority::Checkpoint, Priority::Stage, Priority::Ingest] {
                let _same = IoClass::enter(priority);
                assert_eq!(current(), before, "{priority:?}");
            }
        })
        .join()
        .unwrap();
    }
}
