//! The progress bars `stagehand ingest` draws on a terminal (never into a pipe or a file): one
//! for placing or hashing the files, fed by the mover's live counters, and one for the
//! validation, fed by the validator's `WorkProgress` messages.

use std::time::Duration;

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use stagehand_mover::Progress;
use stagehand_schemas::progress::WorkProgress;

const TEMPLATE: &str = "{prefix:>10} {bar:32} {bytes:>10}/{total_bytes:<10} {binary_bytes_per_sec:>12} {msg} eta {eta}";

/// The bars of one ingest; hidden unless `visible` (stderr is a terminal).
#[derive(Clone)]
pub struct Bars {
    multi: MultiProgress,
}

impl Bars {
    pub fn new(visible: bool) -> Bars {
        let target = if visible {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        };
        Bars {
            multi: MultiProgress::with_draw_target(target),
        }
    }

    fn bar(&self, prefix: &'static str) -> ProgressBar {
        let bar = self.multi.add(ProgressBar::new(0));
        bar.set_style(ProgressStyle::with_template(TEMPLATE).expect("a valid progress template"));
        bar.set_prefix(prefix);
        bar
    }

    /// A bar that follows `progress` (files and bytes done of what is known so far) until
    /// [`Ticker::finish`].
    pub fn follow(&self, prefix: &'static str, progress: &Progress) -> Ticker {
        let bar = self.bar(prefix);
        let (b, p) = (bar.clone(), progress.clone());
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(200));
            loop {
                tick.tick().await;
                b.set_length(p.bytes_total().max(p.bytes_done()));
                b.set_position(p.bytes_done());
                b.set_message(format!("{}/{} files", p.files_done(), p.files_total()));
            }
        });
        Ticker { bar, task }
    }

    /// A bar for the validation of a request, moved by [`ValidationBar::update`].
    pub fn validation(&self) -> ValidationBar {
        let bar = self.bar("validating");
        bar.set_message("waiting for the validator");
        ValidationBar { bar }
    }
}

/// A bar that follows a [`Progress`].
pub struct Ticker {
    bar: ProgressBar,
    task: tokio::task::JoinHandle<()>,
}

impl Ticker {
    pub fn finish(self) {
        self.task.abort();
        self.bar.finish_and_clear();
    }
}

/// The validation's bar.
pub struct ValidationBar {
    bar: ProgressBar,
}

impl ValidationBar {
    pub fn update(&self, p: &WorkProgress) {
        self.bar.set_length(p.bytes_total);
        self.bar.set_position(p.bytes_done);
        self.bar.set_message(format!(
            "{}/{} files {}",
            p.files_done, p.files_total, p.phase
        ));
    }

    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
