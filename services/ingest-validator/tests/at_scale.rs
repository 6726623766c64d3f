//! The validator at dataset sizes an inline manifest cannot carry, against a real nats-server:
//! a manifest of 50,000 files by reference validated as one version with progress a
//! subscriber sees; 20,000 problems rejected in an event under the wire bound with a report
//! on the tier that lists every one; duplicates found in the sorted stream of a stored
//! manifest.

mod common;

use std::time::Duration;

use common::*;
use stagehand_ingest_validator::{PHASE_HASHING, report_path};
use stagehand_manifest::ManifestStore;
use stagehand_schemas::problem::MAX_LISTED_PROBLEMS;
use stagehand_schemas::subject::MANIFEST_BUCKET;
use stagehand_schemas::{Body, EventId, FileRef, sha256_hex, wire};
use stagehand_testkit::wait_for;

/// Writes `n` small files in 100 folders beneath `prefix` and returns their entries.
fn small_files(root: &std::path::Path, prefix: &str, n: usize) -> Vec<FileRef> {
    for d in 0..100 {
        std::fs::create_dir_all(root.join(prefix).join(format!("{d:03}"))).unwrap();
    }
    (0..n)
        .map(|i| {
            let path = format!("{:03}/{i:06}.bin", i % 100);
            let bytes = format!("file {i} of the dataset");
            std::fs::write(root.join(prefix).join(&path), bytes.as_bytes()).unwrap();
            FileRef::new(path, bytes.len() as u64, sha256_hex(bytes.as_bytes()))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manifest_of_50_000_files_by_reference_validates_as_one_version_with_progress() {
    const N: usize = 50_000;
    let h = Harness::start().await;
    let prefix = "lab-a/big/1";
    let files = small_files(&h.source_root, prefix, N);
    let bytes: u64 = files.iter().map(|f| f.size).sum();
    let reference = h.upload_manifest(PROJECT, &files).await;
    assert_eq!(reference.files, N as u64);
    let progress = h.watch_progress("big-1").await;
    h.bus
        .publish(&request_in(
            PROJECT,
            "big-1",
            prefix,
            vec![],
            Some(reference.clone()),
        ))
        .await
        .unwrap();

    let fact = fact_for(&h.js, "big-1").await;
    let Body::DatasetValidated(v) = &fact.body else {
        panic!("expected dataset.validated, got {fact:?}")
    };
    assert_eq!(
        v.version, reference.digest,
        "one version: the manifest's digest"
    );
    assert!(v.files.is_empty(), "too large to travel inline");
    assert_eq!(v.manifest.as_ref(), Some(&reference));
    assert_eq!(v.total_bytes, bytes);
    assert!(fact_bytes_for(&h.js, "big-1").await < 4096);
    // The verified manifest is in the services' bucket, under the version.
    let catalogue = ManifestStore::open(&h.js, MANIFEST_BUCKET).await.unwrap();
    assert!(catalogue.contains(&reference.digest).await.unwrap());

    // A subscriber saw the validation progress, up to every file and byte.
    let seen = wait_for(TIMEOUT, "the last progress message", || async {
        let seen = progress.lock().unwrap().clone();
        seen.last()
            .is_some_and(|p| p.files_done == N as u64)
            .then_some(seen)
    })
    .await
    .unwrap();
    assert!(seen.len() >= 2, "at least the start and the end: {seen:?}");
    for p in &seen {
        assert_eq!(p.request_id.as_str(), "big-1");
        assert_eq!(p.service, "ingest-validator");
        assert_eq!(p.phase, PHASE_HASHING);
        assert_eq!((p.files_total, p.bytes_total), (N as u64, bytes));
    }
    assert_eq!(seen[0].files_done, 0);
    assert!(seen.windows(2).all(|w| w[0].files_done <= w[1].files_done));
    assert_eq!(seen.last().unwrap().bytes_done, bytes);
    let stats = h.stop().await;
    assert_eq!((stats.handled, stats.retried), (1, 0), "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_thousand_missing_files_are_rejected_under_the_event_bound_and_the_report_lists_every_one()
 {
    const N: usize = 20_000;
    let h = Harness::start().await;
    let prefix = "lab-a/nothing/1";
    std::fs::create_dir_all(h.source_root.join(prefix)).unwrap();
    // Long paths, so that listing every problem would be megabytes.
    let files: Vec<FileRef> = (0..N)
        .map(|i| {
            FileRef::new(
                format!("{}/{i:06}.jpg", "deep-folder-name".repeat(12)),
                1,
                sha256_hex(i.to_string().as_bytes()),
            )
        })
        .collect();
    let reference = h.upload_manifest(PROJECT, &files).await;
    h.bus
        .publish(&request_in(
            PROJECT,
            "none-1",
            prefix,
            vec![],
            Some(reference.clone()),
        ))
        .await
        .unwrap();

    let fact = fact_for(&h.js, "none-1").await;
    let rejected = rejection(&fact);
    assert_eq!(rejected.problems_total, Some(N as u64));
    assert_eq!(
        rejected.problem_counts,
        vec![("missing".to_owned(), N as u64)]
    );
    assert_eq!(rejected.declared_version, reference.digest);
    assert!(rejected.problems.len() <= MAX_LISTED_PROBLEMS);
    assert_eq!(rejected.problems.last().unwrap().code, "truncated");
    let encoded = fact_bytes_for(&h.js, "none-1").await;
    assert!(encoded < wire::MAX_EVENT_BYTES, "{encoded} bytes");

    // The report on the tier lists every problem, in path order.
    let rel = report_path(PROJECT, &EventId::new("none-1").unwrap());
    assert!(rejected.quarantine.as_deref().unwrap().contains(&rel));
    let report = std::fs::read(h.source_root.join(&rel)).unwrap();
    let listed = report_problems(&report);
    let want: Vec<(String, Option<String>)> = sorted(files)
        .into_iter()
        .map(|f| ("missing".to_owned(), Some(f.path)))
        .collect();
    assert_eq!(listed.len(), N);
    assert_eq!(listed, want);
    let summary = report_lines(&report).pop().unwrap();
    assert_eq!(summary["kind"], "summary");
    assert_eq!(summary["problems_total"], N as u64);
    h.stop().await;
}

/// Duplicates in a manifest are adjacent once it is in path order: the stream finds every
/// one without a set of the paths seen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_in_a_stored_manifest_are_found_in_its_sorted_stream() {
    let h = Harness::start().await;
    let prefix = "lab-a/dups/1";
    let unique = small_files(&h.source_root, prefix, 3000);
    // Every 500th entry listed twice more, the copies pushed far from the original.
    let copies: Vec<FileRef> = unique.iter().step_by(500).cloned().collect();
    let mut all = copies.clone();
    all.extend(unique.iter().cloned());
    all.extend(copies.iter().cloned());
    let reference = h.upload_manifest(PROJECT, &all).await;
    assert_eq!(reference.files, 3012);
    h.bus
        .publish(&request_in(
            PROJECT,
            "dups-1",
            prefix,
            vec![],
            Some(reference),
        ))
        .await
        .unwrap();
    let fact = wait_for(Duration::from_secs(30), "the rejection", || async {
        facts_caused_by(&h.js, "dups-1").await.into_iter().next()
    })
    .await
    .unwrap();
    let want: Vec<(String, Option<String>)> = sorted(copies)
        .into_iter()
        .flat_map(|f| {
            let problem = ("duplicate_path".to_owned(), Some(f.path));
            [problem.clone(), problem]
        })
        .collect();
    assert_eq!(problems_of(&fact), want);
    assert_eq!(rejection(&fact).problems_total, Some(12));
    h.stop().await;
}
