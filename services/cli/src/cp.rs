//! `stagehand cp SRC DST`: the arguments, the progress bar and the printed summary of the
//! mover's recursive copy ([`stagehand_mover::cp::run_cp`]), which does the work.
//!
//! The mover's option types (engine, priority class, verification mode) are plain enums with
//! one definition each in the mover; clap sees them through [`Choice`], a wrapper that lists
//! their names, so the mover itself never depends on clap.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Duration;

use clap::builder::PossibleValue;
use stagehand_mover::cp::{CpOptions, CpSummary, run_cp};
use stagehand_mover::{EngineChoice, Priority, Progress, VerifyMode};

/// A mover enum as a command-line value: its names are the mover's own (`as_str`; the
/// engine's `io_uring` is written `io-uring`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Choice<T>(pub T);

/// The mover enums `stagehand cp` takes on its command line.
pub trait ChoiceEnum: Copy + Send + Sync + 'static {
    /// Every value, in the order help shows them.
    fn all() -> &'static [Choice<Self>];
    fn name(self) -> &'static str;
}

macro_rules! choice_enum {
    ($t:ty, [$($v:expr),+ $(,)?]) => {
        choice_enum!($t, [$($v),+], |v: $t| v.as_str());
    };
    ($t:ty, [$($v:expr),+ $(,)?], $name:expr) => {
        impl ChoiceEnum for $t {
            fn all() -> &'static [Choice<Self>] {
                &[$(Choice($v)),+]
            }
            fn name(self) -> &'static str {
                $name(self)
            }
        }
    };
}

choice_enum!(
    Priority,
    [
        Priority::Checkpoint,
        Priority::Stage,
        Priority::Ingest,
        Priority::Backup
    ]
);
choice_enum!(
    VerifyMode,
    [VerifyMode::HashedInFlight, VerifyMode::ReadBack]
);
choice_enum!(
    EngineChoice,
    [
        EngineChoice::Auto,
        EngineChoice::IoUring,
        EngineChoice::Pread
    ],
    // Config files say `io_uring`; a command line says `io-uring`.
    |v: EngineChoice| match v {
        EngineChoice::IoUring => "io-uring",
        other => other.as_str(),
    }
);

impl<T: ChoiceEnum> clap::ValueEnum for Choice<T> {
    fn value_variants<'a>() -> &'a [Self] {
        T::all()
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        Some(PossibleValue::new(self.0.name()))
    }
}

/// Arguments of `stagehand cp`.
#[derive(Debug, Clone, clap::Args)]
pub struct CpArgs {
    /// Source: a local file or directory, or s3://bucket/prefix.
    pub src: String,
    /// Destination: a local directory (or file name for a single file), or s3://bucket/prefix.
    pub dst: String,
    /// Copy a directory (or S3 prefix) and everything beneath it.
    #[arg(short, long)]
    pub recursive: bool,
    /// Publish the whole tree at once: DST appears complete or not at all, and a rerun after
    /// a crash resumes where the killed copy stopped. A DST that already exists is left as it
    /// is and every file reported skipped (the rerun of a copy that finished).
    #[arg(long)]
    pub atomic: bool,
    /// Copy exactly the entries of this manifest (lines `path<TAB>size<TAB>sha256`, paths
    /// relative to SRC) and verify each against it.
    #[arg(long, value_name = "FILE")]
    pub manifest: Option<PathBuf>,
    /// Print the summary as JSON.
    #[arg(long)]
    pub json: bool,
    /// posix → posix engine.
    #[arg(long, value_enum, default_value_t = Choice(EngineChoice::Auto))]
    pub engine: Choice<EngineChoice>,
    /// Files in flight at once.
    #[arg(long, default_value_t = CpOptions::default().concurrency)]
    pub concurrency: usize,
    /// With --manifest: trust its hashes for files already at the destination with the right
    /// size, and allow reflink / copy_file_range without hashing the source.
    #[arg(long)]
    pub trust_recorded_hash: bool,
    /// What proves the landed bytes: the hash taken while copying, or a second read of them.
    #[arg(long, value_enum, default_value_t = Choice(VerifyMode::HashedInFlight))]
    pub verify: Choice<VerifyMode>,
    /// The same as --verify read-back.
    #[arg(long, conflicts_with = "verify")]
    pub read_back: bool,
    /// Limit reads to this many bytes per second: a size such as 64K, 100M, 2G (powers of
    /// 1024), 100 MB (powers of 1000) or 1048576.
    #[arg(long, value_name = "RATE", value_parser = parse_rate)]
    pub bwlimit: Option<u64>,
    /// Publish every file with its own fdatasync and directory fsync instead of in batches.
    #[arg(long)]
    pub durable_each: bool,
    /// Priority class of the copies.
    #[arg(long, value_enum, default_value_t = Choice(Priority::Ingest))]
    pub priority: Choice<Priority>,
    /// Never show a progress bar (it is shown only when stderr is a terminal).
    #[arg(long)]
    pub quiet: bool,
}

/// `--bwlimit`: a size in the one grammar (`64K` is 64 KiB, as it always was), above zero.
fn parse_rate(s: &str) -> Result<u64, String> {
    match crate::args::size("--bwlimit", s) {
        Ok(0) => Err(format!("--bwlimit {s:?}: a rate must be above zero")),
        Ok(rate) => Ok(rate),
        Err(e) => Err(e.0),
    }
}

impl CpArgs {
    /// The mover's options these arguments describe.
    pub fn options(&self) -> CpOptions {
        CpOptions {
            src: self.src.clone(),
            dst: self.dst.clone(),
            recursive: self.recursive,
            manifest: self.manifest.clone(),
            engine: self.engine.0,
            concurrency: self.concurrency.max(1),
            trust_recorded_hash: self.trust_recorded_hash,
            verify: if self.read_back {
                VerifyMode::ReadBack
            } else {
                self.verify.0
            },
            bytes_per_second: self.bwlimit,
            durable_each: self.durable_each,
            priority: self.priority.0,
            atomic: self.atomic,
        }
    }
}

/// Runs `stagehand cp`: copies with a progress bar on a terminal, prints the summary (text or
/// JSON) to stdout and returns it; the caller exits with [`CpSummary::exit_code`].
pub async fn run(args: &CpArgs) -> anyhow::Result<CpSummary> {
    let progress = Progress::new();
    let bar = (!args.quiet && !args.json && std::io::stderr().is_terminal())
        .then(|| start_bar(progress.clone()));
    let result = run_cp(&args.options(), &progress).await;
    if let Some((bar, ticker)) = bar {
        ticker.abort();
        bar.finish_and_clear();
    }
    let summary = result?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
    } else {
        print!("{}", summary.to_text());
    }
    Ok(summary)
}

fn start_bar(progress: Progress) -> (indicatif::ProgressBar, tokio::task::JoinHandle<()>) {
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:30} {bytes}/{total_bytes} {binary_bytes_per_sec} ETA {eta} {msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let b = bar.clone();
    let ticker = tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        loop {
            tick.tick().await;
            b.set_length(progress.bytes_total());
            b.set_position(progress.bytes_done());
            b.set_message(format!(
                "{}/{} files",
                progress.files_done(),
                progress.files_total()
            ));
        }
    });
    (bar, ticker)
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: CpArgs,
    }

    fn parse(list: &[&str]) -> CpArgs {
        let mut v = vec!["stagehand-cp"];
        v.extend_from_slice(list);
        Cli::try_parse_from(v).unwrap().args
    }

    /// The mover's names are what the command line takes, so policy files, `--priority` and
    /// `--verify` spell every value the same way.
    #[test]
    fn cp_arguments_map_to_the_movers_options() {
        let o = parse(&[
            "a",
            "b",
            "-r",
            "--atomic",
            "--engine",
            "io-uring",
            "--priority",
            "checkpoint",
            "--verify",
            "read-back",
            "--bwlimit",
            "64M",
        ])
        .options();
        assert_eq!(
            (o.engine, o.priority, o.verify, o.bytes_per_second),
            (
                EngineChoice::IoUring,
                Priority::Checkpoint,
                VerifyMode::ReadBack,
                Some(64 << 20)
            )
        );
        assert!(o.recursive && o.atomic);
        let d = parse(&["a", "b"]).options();
        assert_eq!(
            (d.engine, d.priority, d.verify),
            (
                EngineChoice::Auto,
                Priority::Ingest,
                VerifyMode::HashedInFlight
            )
        );
        assert_eq!(
            parse(&["a", "b", "--read-back"]).options().verify,
            VerifyMode::ReadBack
        );
        for p in Priority::ALL {
            assert_eq!(parse(&["a", "b", "--priority", p.as_str()]).priority.0, p);
        }
        assert!(Cli::try_parse_from(["x", "a", "b", "--priority", "urgent"]).is_err());
    }

    /// `--bwlimit` reads sizes in the grammar policies use; what scripts wrote before (a bare
    /// count, or one letter K, M, G in either case: powers of 1024) means what it meant.
    #[test]
    fn bwlimit_takes_the_one_size_grammar_and_keeps_old_spellings() {
        let rate = |r: &str| {
            parse(&["a", "b", "--bwlimit", r])
                .options()
                .bytes_per_second
        };
        assert_eq!(rate("1048576"), Some(1 << 20));
        assert_eq!(rate("64K"), Some(64 << 10));
        assert_eq!(rate("2g"), Some(2 << 30));
        assert_eq!(rate("64 KiB"), Some(64 << 10));
        assert_eq!(rate("100 MB"), Some(100_000_000));
        for (bad, says) in [
            ("0", "above zero"),
            ("fast", "is not a number"),
            ("10 gigs", "unknown unit"),
        ] {
            let err = match Cli::try_parse_from(["x", "a", "b", "--bwlimit", bad]) {
                Ok(_) => panic!("--bwlimit {bad} was taken"),
                Err(e) => e.to_string(),
            };
            assert!(
                err.contains("--bwlimit") && err.contains(says),
                "{bad}: {err}"
            );
        }
    }
}
