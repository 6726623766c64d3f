//! Writing one shard: a tar archive in the WebDataset layout with deterministic headers, and
//! its index.
//!
//! Every header is a GNU header whose only varying fields are the member's name and size:
//! mode `0644`, uid and gid 0, no user or group name, mtime 0, regular file. Names longer
//! than the header's 100 bytes get a GNU long-name entry (`././@LongLink`), itself fixed in
//! every field but its length. So the same members in the same order always give the same
//! bytes, whoever packs them, on whatever machine, at whatever time.
//!
//! The index (`shard-NNNNNN.index.jsonl`) has one JSON line per sample, in shard order:
//! `{"key":"train/0001","members":[{"path":"train/0001.cls","offset":1536,"size":2,"sha256":"…"},…]}`
//! where `offset` is where the member's bytes start in the shard, `size` their length and
//! `sha256` the raw file's hash from the upload — re-checked against the bytes read before the
//! member was written. Any reader can check any member at any hop with one ranged read.

use std::fs::File;
use std::io::{self, BufWriter, Read, Write};

use serde::Serialize;
use sha2::{Digest, Sha256};
use stagehand_mover::{AtomicFile, PosixTier, TransferError};

use crate::sort::Member;

/// The name of shard `n` (0-based) of a prepared version.
pub fn shard_name(n: u32) -> String {
    format!("shard-{n:06}.tar")
}

/// The name of the index of shard `n`.
pub fn index_name(n: u32) -> String {
    format!("shard-{n:06}.index.jsonl")
}

/// The deterministic header of a member of `size` bytes (the name is set when it is
/// appended).
pub fn member_header(size: u64) -> tar::Header {
    let mut header = tar::Header::new_gnu();
    header.set_entry_type(tar::EntryType::Regular);
    header.set_size(size);
    header.set_mode(0o644);
    header.set_uid(0);
    header.set_gid(0);
    header.set_mtime(0);
    header
}

/// A writer that counts and hashes what passes through it.
pub struct HashingWriter<W> {
    inner: W,
    hasher: Sha256,
    written: u64,
}

impl<W: Write> HashingWriter<W> {
    pub fn new(inner: W) -> Self {
        HashingWriter {
            inner,
            hasher: Sha256::new(),
            written: 0,
        }
    }

    pub fn written(&self) -> u64 {
        self.written
    }

    /// The inner writer, the bytes written and their SHA-256 (hex).
    pub fn finish(self) -> (W, u64, String) {
        (
            self.inner,
            self.written,
            hex::encode(self.hasher.finalize()),
        )
    }
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.written += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// A reader that hashes what passes through it and refuses to end early: reading fewer
/// than `expected` bytes is an `UnexpectedEof` error (a tar entry must be exactly as long
/// as its header says).
pub struct HashingReader<R> {
    inner: io::Take<R>,
    hasher: Sha256,
    read: u64,
    expected: u64,
}

impl<R: Read> HashingReader<R> {
    pub fn new(inner: R, expected: u64) -> Self {
        HashingReader {
            inner: inner.take(expected),
            hasher: Sha256::new(),
            read: 0,
            expected,
        }
    }

    /// The SHA-256 (hex) of what was read.
    pub fn finish(self) -> String {
        hex::encode(self.hasher.finalize())
    }
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if n == 0 && self.read < self.expected && !buf.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "the file ended after {} of its {} bytes",
                    self.read, self.expected
                ),
            ));
        }
        self.hasher.update(&buf[..n]);
        self.read += n as u64;
        Ok(n)
    }
}

/// One member of an index line.
#[derive(Debug, Serialize)]
struct IndexMember<'a> {
    path: &'a str,
    offset: u64,
    size: u64,
    sha256: &'a str,
}

/// One line of a shard index: a sample.
#[derive(Debug, Serialize)]
struct IndexLine<'a> {
    key: &'a str,
    members: Vec<IndexMember<'a>>,
}

/// What a member's bytes are when it reaches the writer.
pub enum Bytes<'a> {
    /// Read and proven by a reader thread.
    Loaded(&'a [u8]),
    /// Too large to hold: streamed from here, hashed on the way, proven after.
    Stream(Box<dyn Read + 'a>),
}

/// Why writing a shard failed.
#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    #[error(transparent)]
    Tier(#[from] TransferError),
    #[error("writing {file}: {source}")]
    Io {
        file: String,
        #[source]
        source: io::Error,
    },
    /// A streamed member's bytes were not what the manifest says.
    #[error("{path}: read {found}, the manifest says {expected}")]
    Mismatch {
        path: String,
        expected: String,
        found: String,
    },
}

/// A shard being written into the staging folder, with its index.
pub struct ShardWriter {
    pub number: u32,
    tar_file: AtomicFile,
    tar: tar::Builder<HashingWriter<BufWriter<File>>>,
    index_file: AtomicFile,
    index: HashingWriter<BufWriter<File>>,
    pub samples: u64,
    pub members: u64,
}

fn own_handle(file: &AtomicFile) -> Result<File, ShardError> {
    file.file().try_clone().map_err(|source| ShardError::Io {
        file: file.rel().to_owned(),
        source,
    })
}

impl ShardWriter {
    /// Creates shard `number` and its index (temp files, invisible until [`Self::finish`]).
    pub fn create(staging: &PosixTier, number: u32, size_hint: u64) -> Result<Self, ShardError> {
        let tar_file = staging.create_atomic(&shard_name(number), size_hint)?;
        let index_file = staging.create_atomic(&index_name(number), 0)?;
        let tar = tar::Builder::new(HashingWriter::new(BufWriter::with_capacity(
            1 << 20,
            own_handle(&tar_file)?,
        )));
        let index = HashingWriter::new(BufWriter::with_capacity(
            256 << 10,
            own_handle(&index_file)?,
        ));
        Ok(ShardWriter {
            number,
            tar_file,
            tar,
            index_file,
            index,
            samples: 0,
            members: 0,
        })
    }

    fn tar_err(&self, source: io::Error) -> ShardError {
        ShardError::Io {
            file: self.tar_file.rel().to_owned(),
            source,
        }
    }

    /// Appends one sample: each member (in the order given) and its index line.
    pub fn add_sample<'a>(
        &mut self,
        key: &str,
        members: impl IntoIterator<Item = (&'a Member, Bytes<'a>)>,
    ) -> Result<(), ShardError> {
        let mut line = IndexLine {
            key,
            members: Vec::new(),
        };
        for (member, bytes) in members {
            let mut header = member_header(member.size);
            match bytes {
                Bytes::Loaded(data) => self
                    .tar
                    .append_data(&mut header, &member.path, data)
                    .map_err(|e| self.tar_err(e))?,
                Bytes::Stream(reader) => {
                    let mut reader = HashingReader::new(reader, member.size);
                    self.tar
                        .append_data(&mut header, &member.path, &mut reader)
                        .map_err(|e| self.tar_err(e))?;
                    let found = reader.finish();
                    if found != member.sha256 {
                        return Err(ShardError::Mismatch {
                            path: member.path.clone(),
                            expected: member.sha256.clone(),
                            found,
                        });
                    }
                }
            }
            let end = self.tar.get_ref().written();
            line.members.push(IndexMember {
                path: &member.path,
                offset: end - member.size.next_multiple_of(512),
                size: member.size,
                sha256: &member.sha256,
            });
            self.members += 1;
        }
        serde_json::to_writer(&mut self.index, &line).map_err(|e| ShardError::Io {
            file: self.index_file.rel().to_owned(),
            source: io::Error::other(e),
        })?;
        self.index
            .write_all(b"\n")
            .map_err(|source| ShardError::Io {
                file: self.index_file.rel().to_owned(),
                source,
            })?;
        self.samples += 1;
        Ok(())
    }

    /// Ends the archive, makes both files durable and visible inside the staging folder, and
    /// returns (name, size, SHA-256) of the shard and of its index.
    pub fn finish(self) -> Result<[(String, u64, String); 2], ShardError> {
        let ShardWriter {
            number,
            tar_file,
            tar,
            index_file,
            index,
            ..
        } = self;
        let io_err = |file: &AtomicFile| {
            let file = file.rel().to_owned();
            move |source: io::Error| ShardError::Io { file, source }
        };
        let hashing = tar.into_inner().map_err(io_err(&tar_file))?;
        let (mut buf, tar_bytes, tar_sha) = hashing.finish();
        buf.flush().map_err(io_err(&tar_file))?;
        drop(buf);
        let (mut buf, index_bytes, index_sha) = index.finish();
        buf.flush().map_err(io_err(&index_file))?;
        drop(buf);
        tar_file.commit()?;
        index_file.commit()?;
        Ok([
            (shard_name(number), tar_bytes, tar_sha),
            (index_name(number), index_bytes, index_sha),
        ])
    }
}

/// Writes a small file of the version (`prepared.json`) into the staging folder; returns its
/// size and SHA-256.
pub fn write_file(
    staging: &PosixTier,
    name: &str,
    bytes: &[u8],
) -> Result<(u64, String), ShardError> {
    let file = staging.create_atomic(name, bytes.len() as u64)?;
    file.write_all_at(bytes, 0)?;
    file.commit()?;
    Ok((bytes.len() as u64, hex::encode(Sha256::digest(bytes))))
}

/// Copies `len` bytes from `from` into a new file `name` of the staging folder; returns its
/// size and SHA-256.
pub fn copy_file(
    staging: &PosixTier,
    name: &str,
    from: &mut File,
    len: u64,
) -> Result<(u64, String), ShardError> {
    let file = staging.create_atomic(name, len)?;
    let mut out = HashingWriter::new(BufWriter::new(own_handle(&file)?));
    let io_err = |source| ShardError::Io {
        file: name.to_owned(),
        source,
    };
    io::copy(&mut from.take(len), &mut out).map_err(io_err)?;
    let (mut buf, written, sha) = out.finish();
    buf.flush().map_err(io_err)?;
    drop(buf);
    file.commit()?;
    Ok((written, sha))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(path: &str, data: &[u8]) -> Member {
        let (key, _) = crate::sample::split_key(path).unwrap();
        Member {
            order: 0,
            path: path.into(),
            key_len: key.len(),
            size: data.len() as u64,
            sha256: hex::encode(Sha256::digest(data)),
        }
    }

    /// Two writers of the same members, at different times and places, give the same bytes;
    /// the index offsets point at each member's bytes; a long name round-trips through a
    /// standard reader (the `tar` crate's).
    #[test]
    fn shards_are_deterministic_and_their_index_points_at_each_member() {
        let long = format!("{}/x.bin", "d".repeat(150));
        let files: Vec<(String, Vec<u8>)> = vec![
            ("a/0001.cls".into(), b"7".to_vec()),
            ("a/0001.jpg".into(), vec![0xAB; 1000]),
            (long.clone(), vec![1, 2, 3]),
        ];
        let mut shas = Vec::new();
        for _ in 0..2 {
            let dir = tempfile::tempdir().unwrap();
            let tier = PosixTier::open("t", dir.path()).unwrap();
            let mut w = ShardWriter::create(&tier, 3, 0).unwrap();
            let members: Vec<Member> = files.iter().map(|(p, d)| member(p, d)).collect();
            w.add_sample(
                "a/0001",
                members[..2]
                    .iter()
                    .zip(&files[..2])
                    .map(|(m, (_, d))| (m, Bytes::Loaded(d))),
            )
            .unwrap();
            w.add_sample(
                long.trim_end_matches(".bin"),
                [(&members[2], Bytes::Stream(Box::new(&files[2].1[..])))],
            )
            .unwrap();
            let [(name, size, sha), (index, ..)] = w.finish().unwrap();
            assert_eq!(name, "shard-000003.tar");
            let bytes = std::fs::read(dir.path().join(&name)).unwrap();
            assert_eq!(bytes.len() as u64, size);
            assert_eq!(hex::encode(Sha256::digest(&bytes)), sha);
            // The index's offsets and hashes.
            let lines = std::fs::read_to_string(dir.path().join(index)).unwrap();
            let mut seen = 0;
            for line in lines.lines() {
                let v: serde_json::Value = serde_json::from_str(line).unwrap();
                for m in v["members"].as_array().unwrap() {
                    let (off, len) = (m["offset"].as_u64().unwrap(), m["size"].as_u64().unwrap());
                    let data = &bytes[off as usize..(off + len) as usize];
                    assert_eq!(hex::encode(Sha256::digest(data)), m["sha256"]);
                    seen += 1;
                }
            }
            assert_eq!(seen, 3);
            // A standard reader sees the names, sizes and fixed header fields.
            let mut archive = tar::Archive::new(&bytes[..]);
            let mut names = Vec::new();
            for entry in archive.entries().unwrap() {
                let mut entry = entry.unwrap();
                let h = entry.header().clone();
                assert_eq!(
                    (h.mtime().unwrap(), h.uid().unwrap(), h.gid().unwrap()),
                    (0, 0, 0)
                );
                assert_eq!(h.mode().unwrap(), 0o644);
                let mut data = Vec::new();
                entry.read_to_end(&mut data).unwrap();
                names.push((entry.path().unwrap().to_string_lossy().into_owned(), data));
            }
            assert_eq!(names, files);
            shas.push(sha);
        }
        assert_eq!(shas[0], shas[1]);
    }

    /// A streamed member whose bytes are not the manifest's fails the shard with its path.
    #[test]
    fn a_streamed_member_that_does_not_match_fails_with_its_path() {
        let dir = tempfile::tempdir().unwrap();
        let tier = PosixTier::open("t", dir.path()).unwrap();
        let mut w = ShardWriter::create(&tier, 0, 0).unwrap();
        let m = member("k.bin", b"expected");
        let err = w
            .add_sample("k", [(&m, Bytes::Stream(Box::new(&b"tampered"[..])))])
            .unwrap_err();
        assert!(
            matches!(&err, ShardError::Mismatch { path, .. } if path == "k.bin"),
            "{err}"
        );
        drop(w);
        // Nothing is left under a real name.
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| !n.starts_with('.'))
            .collect();
        assert!(names.is_empty(), "{names:?}");
    }
}
