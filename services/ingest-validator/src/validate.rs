//! One request, validated: the static pass, then every planned file read concurrently (with a
//! bound), then the verdict.

use std::future::Future;
use std::time::{Duration, Instant};

use futures::StreamExt;
use stagehand_mover::TransferError;
use stagehand_policy::ValidationPolicy;
use stagehand_schemas::{IngestRequested, Problem};

use crate::check::{self, Observed, SourceTier};
use crate::source::SourceFiles;

/// How far the read pass has got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadProgress {
    pub files_done: u64,
    pub files_total: u64,
    pub bytes_done: u64,
}

/// The outcome of validating one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Every file is present, as declared, and within policy.
    Valid,
    /// Every problem found, request-wide ones first, then per entry in manifest order.
    Invalid(Vec<Problem>),
}

/// Validates `request`. `source` is `None` when the tier is not usable (the static pass then
/// reports why). `progress` is awaited at most every `progress_every` while files are read.
///
/// `Err` means a retry can help (the tier is unreachable, an I/O error): nothing is decided.
pub async fn validate<S, P, F>(
    request: &IngestRequested,
    policy: &ValidationPolicy,
    tier: SourceTier,
    source: Option<&S>,
    read_concurrency: usize,
    progress_every: Duration,
    mut progress: P,
) -> Result<Verdict, TransferError>
where
    S: SourceFiles,
    P: FnMut(ReadProgress) -> F,
    F: Future<Output = ()>,
{
    let plan = check::plan(request, policy, tier);
    let mut problems = plan.problems;
    if let Some(source) = source.filter(|_| !plan.to_read.is_empty()) {
        let prefix = request.source.prefix.as_str();
        let reads = futures::stream::iter(plan.to_read.iter().copied())
            .map(|index| {
                let rel = check::tier_path(prefix, &request.files[index].path);
                async move { (index, source.observe(&rel).await) }
            })
            .buffer_unordered(read_concurrency.max(1));
        futures::pin_mut!(reads);
        let mut observed: Vec<(usize, Observed)> = Vec::with_capacity(plan.to_read.len());
        let mut status = ReadProgress {
            files_done: 0,
            files_total: plan.to_read.len() as u64,
            bytes_done: 0,
        };
        let mut last_progress = Instant::now();
        while let Some((index, result)) = reads.next().await {
            let seen = result?;
            status.files_done += 1;
            if let Observed::Digest(d) = &seen {
                status.bytes_done += d.size;
            }
            observed.push((index, seen));
            if last_progress.elapsed() >= progress_every {
                progress(status).await;
                last_progress = Instant::now();
            }
        }
        // Report in manifest order whatever order the reads finished in.
        observed.sort_by_key(|(index, _)| *index);
        for (index, seen) in &observed {
            problems.extend(check::compare(&request.files[*index], seen, policy));
        }
    }
    Ok(if problems.is_empty() {
        Verdict::Valid
    } else {
        Verdict::Invalid(problems)
    })
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::Mutex;

    use stagehand_mover::{ErrorKind, FileDigest, Side};
    use stagehand_schemas::{FileRef, Location, sha256_hex};

    use super::*;

    /// An in-memory tier: path → observation, or an error for every read.
    struct Fake {
        files: HashMap<String, Observed>,
        fail: Option<ErrorKind>,
        markers: Mutex<Vec<String>>,
    }

    impl SourceFiles for Fake {
        async fn observe(&self, rel: &str) -> Result<Observed, TransferError> {
            if let Some(kind) = self.fail {
                return Err(TransferError::new(kind, Side::Source, "fake", rel, "down"));
            }
            Ok(self.files.get(rel).cloned().unwrap_or(Observed::Missing))
        }
        async fn write_marker(&self, rel: &str, _bytes: Vec<u8>) -> Result<(), TransferError> {
            self.markers.lock().unwrap().push(rel.to_owned());
            Ok(())
        }
        fn describe(&self, rel: &str) -> String {
            rel.to_owned()
        }
    }

    fn policy() -> ValidationPolicy {
        ValidationPolicy {
            max_file_size: 1 << 20,
            max_entries: 100,
            max_total_bytes: 1 << 30,
            allowed_suffixes: vec![],
            denied_suffixes: vec![],
            allow_hidden: false,
        }
    }

    fn digest(bytes: &[u8]) -> Observed {
        Observed::Digest(FileDigest {
            size: bytes.len() as u64,
            sha256: sha256_hex(bytes),
        })
    }

    fn request(files: Vec<FileRef>) -> IngestRequested {
        IngestRequested {
            dataset: "d".into(),
            source: Location {
                tier: "source".into(),
                prefix: "up".into(),
            },
            files,
            manifest: None,
            requested_by: "alice".into(),
            labels: vec![],
        }
    }

    async fn run(fake: &Fake, req: &IngestRequested) -> Result<Verdict, TransferError> {
        validate(
            req,
            &policy(),
            SourceTier::Usable,
            Some(fake),
            3,
            Duration::ZERO,
            |_| async {},
        )
        .await
    }

    #[tokio::test]
    async fn valid_when_every_file_matches() {
        let fake = Fake {
            files: HashMap::from([
                ("up/a".to_owned(), digest(b"abc")),
                ("up/b/c".to_owned(), digest(b"")),
            ]),
            fail: None,
            markers: Mutex::default(),
        };
        let req = request(vec![
            FileRef::new("a", 3, sha256_hex(b"abc")),
            FileRef::new("b/c", 0, sha256_hex(b"")),
        ]);
        assert_eq!(run(&fake, &req).await.unwrap(), Verdict::Valid);
    }

    #[tokio::test]
    async fn every_read_problem_is_listed_in_manifest_order() {
        let fake = Fake {
            files: HashMap::from([
                ("up/short".to_owned(), digest(b"ab")),
                ("up/wrong".to_owned(), digest(b"xyz")),
                ("up/dir".to_owned(), Observed::NotAFile),
            ]),
            fail: None,
            markers: Mutex::default(),
        };
        let sha = sha256_hex(b"abc");
        let req = request(vec![
            FileRef::new("short", 3, &sha),
            FileRef::new("gone", 3, &sha),
            FileRef::new("wrong", 3, &sha),
            FileRef::new("dir", 3, &sha),
            FileRef::new("../x", 3, &sha),
        ]);
        let Verdict::Invalid(problems) = run(&fake, &req).await.unwrap() else {
            panic!("must be invalid")
        };
        let got: Vec<(&str, &str)> = problems
            .iter()
            .map(|p| (p.code.as_str(), p.path.as_deref().unwrap()))
            .collect();
        assert_eq!(
            got,
            vec![
                ("path_rule", "../x"),
                ("size_mismatch", "short"),
                ("checksum_mismatch", "short"),
                ("missing", "gone"),
                ("checksum_mismatch", "wrong"),
                ("not_a_file", "dir"),
            ]
        );
    }

    #[tokio::test]
    async fn an_unreachable_tier_decides_nothing() {
        let fake = Fake {
            files: HashMap::new(),
            fail: Some(ErrorKind::Unreachable),
            markers: Mutex::default(),
        };
        let req = request(vec![FileRef::new("a", 3, sha256_hex(b"abc"))]);
        let err = run(&fake, &req).await.unwrap_err();
        assert!(err.is_retryable());
    }

    #[tokio::test]
    async fn progress_is_reported_while_reading() {
        let fake = Fake {
            files: (0..10)
                .map(|i| (format!("up/f{i}"), digest(b"abc")))
                .collect(),
            fail: None,
            markers: Mutex::default(),
        };
        let req = request(
            (0..10)
                .map(|i| FileRef::new(format!("f{i}"), 3, sha256_hex(b"abc")))
                .collect(),
        );
        let seen = Mutex::new(Vec::new());
        let verdict = validate(
            &req,
            &policy(),
            SourceTier::Usable,
            Some(&fake),
            2,
            Duration::ZERO,
            |p| {
                seen.lock().unwrap().push(p);
                async {}
            },
        )
        .await
        .unwrap();
        assert_eq!(verdict, Verdict::Valid);
        let seen = seen.into_inner().unwrap();
        assert_eq!(seen.len(), 10);
        assert_eq!(
            seen.last().copied(),
            Some(ReadProgress {
                files_done: 10,
                files_total: 10,
                bytes_done: 30
            })
        );
    }
}
