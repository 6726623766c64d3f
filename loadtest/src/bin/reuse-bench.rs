//! The fingerprint check of an already-staged version (`loadtest/reuse/bench.sh` runs it
//! beside `find -printf '%s %T@ %C@ %i'` over the same tree): what a promoter does before it
//! hands a replica out again, timed on its own.
//!
//! - `make --dir D --files N [--bytes B]`: N files of B bytes in folders of 1,000 under D (once).
//! - `record --dir D --out F`: walks D and writes its encoded fingerprint to F.
//! - `check --dir D --recorded F`: reads F, walks D again, compares; prints one JSON object
//!   (seconds for the whole check, of which the walk; entries; differences; the encoding's
//!   bytes).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::{Parser, Subcommand};
use stagehand_mover::{Fingerprint, PosixTier, walk_posix};

#[derive(Debug, Parser)]
struct Args {
    #[command(subcommand)]
    what: What,
}

#[derive(Debug, Subcommand)]
enum What {
    Make {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long)]
        files: usize,
        #[arg(long, default_value_t = 0)]
        bytes: usize,
    },
    Record {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long)]
        out: PathBuf,
    },
    Check {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long)]
        recorded: PathBuf,
    },
}

/// The tier is the folder's parent and the set its last component, as a promoter sees it.
fn tier_of(dir: &std::path::Path) -> anyhow::Result<(PosixTier, String)> {
    let parent = dir.parent().context("the set needs a parent folder")?;
    let name = dir
        .file_name()
        .and_then(|n| n.to_str())
        .context("the set's folder name is not UTF-8")?;
    Ok((PosixTier::open("bench", parent)?, name.to_owned()))
}

fn main() -> anyhow::Result<()> {
    match Args::parse().what {
        What::Make { dir, files, bytes } => {
            let content = vec![7u8; bytes];
            for i in 0..files {
                let folder = dir.join(format!("d{:04}", i / 1000));
                if i % 1000 == 0 {
                    std::fs::create_dir_all(&folder)?;
                }
                std::fs::write(folder.join(format!("f{i:07}.bin")), &content)?;
            }
        }
        What::Record { dir, out } => {
            let (tier, set) = tier_of(&dir)?;
            let print = walk_posix(&tier, &set)?;
            std::fs::write(&out, print.encode())?;
            println!(
                "{}",
                serde_json::json!({"entries": print.entries().len(), "encoded_bytes": std::fs::metadata(&out)?.len()})
            );
        }
        What::Check { dir, recorded } => {
            let started = Instant::now();
            let (tier, set) = tier_of(&dir)?;
            let bytes = std::fs::read(&recorded)?;
            let recorded = Fingerprint::decode(&bytes)?;
            let walk_started = Instant::now();
            let found = walk_posix(&tier, &set)?;
            let walk = walk_started.elapsed();
            let differences = recorded.compare(&found);
            println!(
                "{}",
                serde_json::json!({
                    "seconds": started.elapsed().as_secs_f64(),
                    "walk_seconds": walk.as_secs_f64(),
                    "entries": found.entries().len(),
                    "differences": differences.len(),
                    "encoded_bytes": bytes.len(),
                })
            );
        }
    }
    Ok(())
}
