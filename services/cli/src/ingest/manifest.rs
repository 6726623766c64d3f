//! An ingest's manifest, built off the async runtime in memory bounded by a constant.
//!
//! Entries come one by one — from the mover as each file is proven, from the in-place hasher,
//! or from the lines of a declared manifest file — and go into a
//! [`stagehand_manifest::ManifestBuilder`] (an external sort) owned by a thread of its own, so
//! that the builder's occasional sort-and-spill of a run never stalls the copy.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::sync::mpsc::{SyncSender, sync_channel};

use anyhow::{Context, bail};
use stagehand_manifest::{MAX_LINE_BYTES, Manifest, ManifestBuilder, Spool};
use stagehand_schemas::FileRef;
use stagehand_schemas::manifest::parse_line;

/// Bytes of manifest lines the builder sorts in memory before spilling a run: about 300,000
/// entries; what bounds the CLI's memory for a manifest of any size.
pub const RUN_BYTES: usize = 32 << 20;

/// Entries queued for the builder thread.
const QUEUE: usize = 1 << 15;

/// A [`ManifestBuilder`] on its own thread.
pub struct BuilderThread {
    tx: SyncSender<FileRef>,
    handle: std::thread::JoinHandle<Result<Manifest, stagehand_manifest::ManifestError>>,
}

impl BuilderThread {
    pub fn start(spool: &Spool) -> anyhow::Result<BuilderThread> {
        let (tx, rx) = sync_channel::<FileRef>(QUEUE);
        let spool = spool.clone();
        let handle = std::thread::Builder::new()
            .name("manifest-builder".into())
            .spawn(move || {
                let mut builder = ManifestBuilder::with_run_bytes(&spool, RUN_BYTES);
                for file in rx {
                    builder.push(&file)?;
                }
                builder.finish()
            })
            .context("starting the manifest builder thread")?;
        Ok(BuilderThread { tx, handle })
    }

    /// Queues one entry. When the builder has failed, the entry is dropped and
    /// [`BuilderThread::finish`] reports the builder's error.
    pub fn push(&self, file: FileRef) {
        let _ = self.tx.send(file);
    }

    /// A sender for code that pushes from another thread.
    pub fn sender(&self) -> SyncSender<FileRef> {
        self.tx.clone()
    }

    /// Waits for the canonical manifest of everything pushed.
    pub async fn finish(self) -> anyhow::Result<Manifest> {
        let BuilderThread { tx, handle } = self;
        drop(tx);
        let manifest = tokio::task::spawn_blocking(move || handle.join())
            .await
            .context("waiting for the manifest builder")?
            .map_err(|_| anyhow::anyhow!("the manifest builder thread panicked"))?;
        Ok(manifest?)
    }
}

/// Reads a declared manifest file — `path<TAB>size<TAB>sha256` lines in any order, parsed with
/// the contract's one line parser — into a canonical manifest. Blank lines are ignored; a line
/// that does not parse is an error naming the file and line. Entries are taken as declared
/// (even a bad path or hash): judging them is the validator's job. Blocking.
pub fn read_declared(path: &Path, spool: &Spool) -> anyhow::Result<Manifest> {
    let file =
        File::open(path).with_context(|| format!("cannot read manifest {}", path.display()))?;
    let mut reader = BufReader::with_capacity(1 << 20, file);
    let mut builder = ManifestBuilder::with_run_bytes(spool, RUN_BYTES);
    let mut line = Vec::with_capacity(256);
    let mut number = 0u64;
    loop {
        line.clear();
        let n = (&mut reader)
            .take(MAX_LINE_BYTES as u64 + 2)
            .read_until(b'\n', &mut line)
            .with_context(|| format!("reading manifest {}", path.display()))?;
        if n == 0 {
            break;
        }
        number += 1;
        if line.last() == Some(&b'\n') {
            line.pop();
        } else if line.len() > MAX_LINE_BYTES {
            bail!(
                "{}:{number}: a line longer than {MAX_LINE_BYTES} bytes",
                path.display()
            );
        }
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let entry = parse_line(&line).with_context(|| format!("{}:{number}", path.display()))?;
        builder
            .push(&entry)
            .with_context(|| format!("{}:{number}", path.display()))?;
    }
    builder
        .finish()
        .with_context(|| format!("manifest {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use stagehand_schemas::{sha256_hex, version_digest};

    #[test]
    fn a_declared_manifest_in_any_order_is_its_canonical_digest() {
        let dir = tempfile::tempdir().unwrap();
        let files = vec![
            FileRef::new("b/2.bin", 2, sha256_hex(b"bb")),
            FileRef::new("a.txt", 1, sha256_hex(b"a")),
        ];
        let text = format!("{}\n{}", files[0].manifest_line(), files[1].manifest_line());
        std::fs::write(dir.path().join("m.tsv"), text).unwrap();
        let manifest = read_declared(&dir.path().join("m.tsv"), &Spool::default()).unwrap();
        assert_eq!(manifest.digest(), version_digest(&files));
        assert_eq!((manifest.files(), manifest.bytes()), (2, 3));
    }

    #[test]
    fn a_bad_line_names_the_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.tsv");
        std::fs::write(&path, format!("a\t1\t{}\nb\tone\tx\n", sha256_hex(b"a"))).unwrap();
        let err = format!("{:#}", read_declared(&path, &Spool::default()).unwrap_err());
        assert!(
            err.contains("m.tsv:2") && err.contains("size \"one\""),
            "{err}"
        );
    }

    #[tokio::test]
    async fn the_builder_thread_sorts_what_it_is_given() {
        let builder = BuilderThread::start(&Spool::default()).unwrap();
        let files: Vec<FileRef> = (0..1000)
            .rev()
            .map(|i| FileRef::new(format!("f{i:04}"), i, sha256_hex(&i.to_be_bytes())))
            .collect();
        for f in &files {
            builder.push(f.clone());
        }
        let manifest = builder.finish().await.unwrap();
        assert_eq!(manifest.digest(), version_digest(&files));
        assert_eq!(manifest.files(), 1000);
    }
}
