//! Manifests stored in and fetched from a real nats-server's Object Store: round trips of
//! every size, and what a reader does with an object that is not what it claims to be; the
//! same for the side data (piece hashes) of large files.

use async_nats::jetstream;
use futures::StreamExt;
use stagehand_manifest::{
    BucketOptions, ManifestBuilder, ManifestErrorKind, ManifestSource, ManifestStore, Spool,
    inline_or_stored, open_manifest,
};
use stagehand_schemas::Retryable;
use stagehand_schemas::manifest::{INLINE_MANIFEST_MAX_BYTES, canonical_bytes};
use stagehand_schemas::pieces::{PIECE_BYTES, PieceHashes};
use stagehand_schemas::subject::{MANIFEST_BUCKET, upload_manifest_bucket};
use stagehand_schemas::{
    Body, DatasetValidated, Event, EventId, FileRef, IngestRequested, Location, ManifestRef,
    sha256_hex, version_digest,
};
use stagehand_testkit::NatsServer;

async fn js(nats: &NatsServer) -> jetstream::Context {
    jetstream::new(async_nats::connect(nats.url()).await.unwrap())
}

fn files(n: usize) -> Vec<FileRef> {
    (0..n)
        .map(|i| {
            FileRef::new(
                format!("train/{:03}/{i:08}.jpg", (i * 37) % 101),
                (i as u64) * 13,
                sha256_hex(i.to_string().as_bytes()),
            )
        })
        .collect()
}

fn build(files: &[FileRef], spool: &Spool) -> stagehand_manifest::Manifest {
    let mut builder = ManifestBuilder::with_run_bytes(spool, 1 << 20);
    for f in files {
        builder.push(f).unwrap();
    }
    builder.finish().unwrap()
}

fn ingest(project: &str, files: Vec<FileRef>, manifest: Option<ManifestRef>) -> Event {
    Event::request(
        EventId::new("req-1").unwrap(),
        project,
        Body::IngestRequested(IngestRequested {
            dataset: "cats".into(),
            source: Location {
                tier: "source".into(),
                prefix: format!("{project}/cats/1"),
            },
            files,
            manifest,
            requested_by: "alice".into(),
            labels: vec![],
        }),
    )
}

#[tokio::test]
async fn a_large_manifest_round_trips_through_the_store_by_reference() {
    let nats = NatsServer::start();
    let js = js(&nats).await;
    let dir = tempfile::tempdir().unwrap();
    let spool = Spool {
        dir: dir.path().to_owned(),
        in_memory_below: 64 * 1024,
    };
    // 60,000 entries: about 5 MB of lines, well over the inline bound and the memory spool.
    let all = files(60_000);
    let manifest = build(&all, &spool);
    assert!(!manifest.fits_inline());
    let uploads = ManifestStore::uploads(&js, "lab-a", BucketOptions::default())
        .await
        .unwrap();
    assert_eq!(uploads.bucket(), upload_manifest_bucket("lab-a"));
    let (inline, reference) = inline_or_stored(&manifest, &uploads).await.unwrap();
    assert!(inline.is_empty());
    let reference = reference.unwrap();
    assert_eq!(reference.digest, version_digest(&all));
    assert_eq!(reference.files, 60_000);
    // Putting it again is a no-op (content addressing), and the bucket holds one object.
    uploads.put(&manifest).await.unwrap();
    assert_eq!(
        uploads.list().await.unwrap(),
        vec![reference.digest.clone()]
    );

    let event = ingest("lab-a", vec![], Some(reference.clone()));
    let fetched = open_manifest(&js, &event, &spool).await.unwrap().unwrap();
    assert_eq!(fetched.digest(), reference.digest);
    let mut sorted = all.clone();
    sorted.sort_by(|a, b| a.path.as_bytes().cmp(b.path.as_bytes()));
    let mut chunks = std::pin::pin!(fetched.chunks(7000));
    let mut back = Vec::new();
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk.unwrap();
        assert!(chunk.len() <= 7000);
        back.extend(chunk);
    }
    assert_eq!(back, sorted);
}

#[tokio::test]
async fn a_small_manifest_travels_inline_and_opens_without_the_store() {
    let nats = NatsServer::start();
    let js = js(&nats).await;
    let few = files(10);
    let manifest = build(&few, &Spool::default());
    assert!(manifest.fits_inline());
    let store = ManifestStore::catalogue(&js, BucketOptions::default())
        .await
        .unwrap();
    let (inline, reference) = inline_or_stored(&manifest, &store).await.unwrap();
    assert_eq!(reference, None);
    assert_eq!(inline.len(), 10);
    assert!(store.list().await.unwrap().is_empty(), "nothing stored");
    let event = ingest("lab-a", inline, None);
    let opened = open_manifest(&js, &event, &Spool::default())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(opened.digest(), version_digest(&few));
}

#[tokio::test]
async fn the_inline_bound_is_where_the_contract_puts_it() {
    // Entries just over the bound must go by reference.
    let sha = sha256_hex(b"x");
    let mut entries = Vec::new();
    let mut len = 0u64;
    let mut i = 0;
    while len <= INLINE_MANIFEST_MAX_BYTES {
        let f = FileRef::new(format!("f{i:07}"), 1, sha.clone());
        len += f.manifest_line().len() as u64;
        entries.push(f);
        i += 1;
    }
    let over = stagehand_manifest::Manifest::from_entries(entries.clone());
    assert!(!over.fits_inline());
    entries.pop();
    let under = stagehand_manifest::Manifest::from_entries(entries);
    assert!(under.fits_inline());
}

#[tokio::test]
async fn an_object_that_is_not_its_digest_is_refused_and_a_missing_one_is_retryable() {
    let nats = NatsServer::start();
    let js = js(&nats).await;
    let uploads = ManifestStore::uploads(&js, "lab-a", BucketOptions::default())
        .await
        .unwrap();
    let good = files(100);
    let digest = version_digest(&good);
    let reference = ManifestRef {
        digest: digest.clone(),
        files: 100,
        bytes: good.iter().map(|f| f.size).sum(),
    };
    // Missing: retryable (the uploader may still be putting it).
    let err = uploads
        .fetch(&reference, &Spool::default())
        .await
        .unwrap_err();
    assert_eq!(err.kind, ManifestErrorKind::NotFound);
    assert!(err.is_retryable());
    assert!(err.to_string().contains(&digest), "{err}");

    // A hostile object under the good digest's name: other entries (within the declared
    // counts: more than declared is refused sooner, see the test below).
    let mut tampered = good.clone();
    tampered[5].size -= 1;
    let mut bytes = canonical_bytes(&tampered);
    uploads
        .object_store()
        .put(digest.as_str(), &mut bytes.as_slice())
        .await
        .unwrap();
    let err = uploads
        .fetch(&reference, &Spool::default())
        .await
        .unwrap_err();
    assert_eq!(err.kind, ManifestErrorKind::Mismatch, "{err}");
    assert!(!err.is_retryable());
    assert!(err.to_string().contains("hash to"), "{err}");

    // Garbage under the name: refused as a mismatch (not merely malformed).
    bytes = b"not\ta manifest\n".to_vec();
    uploads
        .object_store()
        .put(digest.as_str(), &mut bytes.as_slice())
        .await
        .unwrap();
    let err = uploads
        .fetch(&reference, &Spool::default())
        .await
        .unwrap_err();
    assert_eq!(err.kind, ManifestErrorKind::Mismatch, "{err}");

    // Bytes that are their digest but not canonical (out of order): malformed, with the line.
    let mut unsorted = canonical_bytes(&good[..3]);
    let first_line_end = unsorted.iter().position(|&b| b == b'\n').unwrap() + 1;
    unsorted.rotate_left(first_line_end);
    let unsorted_digest = sha256_hex(&unsorted);
    uploads
        .object_store()
        .put(unsorted_digest.as_str(), &mut unsorted.as_slice())
        .await
        .unwrap();
    let err = uploads
        .fetch(
            &ManifestRef {
                digest: unsorted_digest,
                files: 3,
                bytes: good[..3].iter().map(|f| f.size).sum(),
            },
            &Spool::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(err.kind, ManifestErrorKind::Malformed, "{err}");
    assert!(err.line.is_some());
    assert!(err.to_string().contains("not sorted"), "{err}");

    // The right bytes with the wrong counts in the reference: a mismatch naming both.
    let mut right = canonical_bytes(&good);
    uploads
        .object_store()
        .put(digest.as_str(), &mut right.as_slice())
        .await
        .unwrap();
    let lying = ManifestRef {
        files: 99,
        ..reference.clone()
    };
    let err = uploads.fetch(&lying, &Spool::default()).await.unwrap_err();
    assert_eq!(err.kind, ManifestErrorKind::Mismatch);
    assert!(err.to_string().contains("99"), "{err}");
    right.clear();
    let ok = uploads.fetch(&reference, &Spool::default()).await.unwrap();
    assert_eq!(ok.files(), 100);
}

#[tokio::test]
async fn an_event_cannot_point_a_reader_at_another_projects_manifests() {
    let nats = NatsServer::start();
    let js = js(&nats).await;
    let secret = files(5);
    let manifest = build(&secret, &Spool::default());
    let theirs = ManifestStore::uploads(&js, "lab-b", BucketOptions::default())
        .await
        .unwrap();
    let reference = theirs.put(&manifest).await.unwrap();
    // lab-a's request names lab-b's digest: the reader looks in lab-a's bucket only.
    let event = ingest("lab-a", vec![], Some(reference.clone()));
    assert_eq!(
        ManifestSource::of(&event).unwrap(),
        Some(ManifestSource::Stored {
            bucket: upload_manifest_bucket("lab-a"),
            reference: reference.clone(),
        })
    );
    let err = open_manifest(&js, &event, &Spool::default())
        .await
        .unwrap_err();
    assert_eq!(err.kind, ManifestErrorKind::NotFound, "{err}");

    // A fact's reference is always into the services' bucket.
    let fact = event.caused(
        "validated",
        Body::DatasetValidated(DatasetValidated {
            dataset: "cats".into(),
            version: reference.digest.clone(),
            source: Location {
                tier: "source".into(),
                prefix: "lab-a/cats/1".into(),
            },
            files: vec![],
            manifest: Some(reference.clone()),
            total_bytes: reference.bytes,
            requested_by: "alice".into(),
            request_id: event.id.clone(),
            labels: vec![],
        }),
    );
    assert!(matches!(
        ManifestSource::of(&fact).unwrap(),
        Some(ManifestSource::Stored { bucket, .. }) if bucket == MANIFEST_BUCKET
    ));
}

#[test]
fn an_event_with_both_inline_files_and_a_reference_is_refused() {
    let few = files(2);
    let reference = ManifestRef {
        digest: version_digest(&few),
        files: 2,
        bytes: 13,
    };
    let event = ingest("lab-a", few, Some(reference));
    let err = ManifestSource::of(&event).unwrap_err();
    assert_eq!(err.kind, ManifestErrorKind::Invalid);
}

/// An object far larger than any manifest of the declared file count could be is refused from
/// its stored size, before a byte of it is read or spooled; one within that size but holding
/// more entries (or more bytes of files) than the reference declares is refused at the first
/// entry too many, not after spooling it all.
#[tokio::test]
async fn an_object_larger_than_its_reference_declares_is_refused_before_it_is_spooled() {
    let nats = NatsServer::start();
    let js = js(&nats).await;
    let uploads = ManifestStore::uploads(&js, "lab-a", BucketOptions::default())
        .await
        .unwrap();
    let declared = files(100);
    let reference = ManifestRef {
        digest: version_digest(&declared),
        files: 100,
        bytes: declared.iter().map(|f| f.size).sum(),
    };
    // 20,000 canonical lines (about 1.9 MB) under the declared digest's name.
    let mut huge = canonical_bytes(&files(20_000));
    uploads
        .object_store()
        .put(reference.digest.as_str(), &mut huge.as_slice())
        .await
        .unwrap();
    huge.clear();
    let err = uploads
        .fetch(&reference, &Spool::default())
        .await
        .unwrap_err();
    assert_eq!(err.kind, ManifestErrorKind::Mismatch, "{err}");
    assert!(!err.is_retryable());
    assert!(
        err.to_string()
            .contains("more than a manifest of 100 files can be"),
        "{err}"
    );
    assert_eq!(err.line, None, "refused before reading a line: {err}");

    // Within the size bound of 10 files, but 300 entries: refused at entry 11.
    let ten = ManifestRef {
        digest: version_digest(&declared[..10]),
        files: 10,
        bytes: u64::MAX,
    };
    let more = canonical_bytes(&files(300));
    uploads
        .object_store()
        .put(ten.digest.as_str(), &mut more.as_slice())
        .await
        .unwrap();
    let err = uploads.fetch(&ten, &Spool::default()).await.unwrap_err();
    assert_eq!(err.kind, ManifestErrorKind::Mismatch, "{err}");
    assert!(err.to_string().contains("more than the 10 files"), "{err}");
    assert_eq!(err.line, Some(11), "{err}");

    // The same entries, with the declared bytes of files exceeded before the count is.
    let small = ManifestRef {
        bytes: 1000,
        files: 300,
        ..ten.clone()
    };
    let err = uploads.fetch(&small, &Spool::default()).await.unwrap_err();
    assert_eq!(err.kind, ManifestErrorKind::Mismatch, "{err}");
    assert!(
        err.to_string().contains("more than the 1000 bytes"),
        "{err}"
    );
    assert!(err.line.is_some_and(|l| l < 300), "{err}");
}

/// Side data round-trips by the file's SHA-256, is put once, is absent for a file nobody
/// hashed, and an object under its name that is not exactly that file's pieces is refused.
#[tokio::test]
async fn piece_hashes_round_trip_and_an_object_that_is_not_the_files_pieces_is_malformed() {
    let nats = NatsServer::start();
    let js = js(&nats).await;
    let store = ManifestStore::catalogue(&js, BucketOptions::default())
        .await
        .unwrap();
    let bytes: Vec<u8> = (0..2 * PIECE_BYTES + 123)
        .map(|i| (i * 31 + i / 8191) as u8)
        .collect();
    let size = bytes.len() as u64;
    let sha = sha256_hex(&bytes);
    let pieces = PieceHashes::of(&bytes);
    assert_eq!(pieces.pieces.len(), 3);

    assert_eq!(store.pieces(&sha, size).await.unwrap(), None, "nothing yet");
    store.put_pieces(&sha, &pieces).await.unwrap();
    assert_eq!(
        store.pieces(&sha, size).await.unwrap(),
        Some(pieces.clone())
    );
    let name = PieceHashes::object_name(&sha);
    let first = store.object_store().info(&name).await.unwrap().nuid;
    // Content addressing: a second put (even of other hashes) leaves the stored object alone.
    let other = PieceHashes::of(&bytes[..bytes.len() - 1]);
    store.put_pieces(&sha, &other).await.unwrap();
    assert_eq!(
        store.object_store().info(&name).await.unwrap().nuid,
        first,
        "the second put stored nothing"
    );
    assert_eq!(
        store.pieces(&sha, size).await.unwrap(),
        Some(pieces.clone())
    );
    assert_eq!(store.list().await.unwrap(), vec![name.clone()]);

    // Another file's SHA-256: nothing stored for it.
    assert_eq!(
        store.pieces(&sha256_hex(b"other"), size).await.unwrap(),
        None
    );

    // Planted under the name: one hash short (the right size and header, the wrong count) …
    let text = String::from_utf8(pieces.to_bytes()).unwrap();
    let short: String = text.lines().take(3).map(|l| format!("{l}\n")).collect();
    // … the side data of a file of another size …
    let resized = PieceHashes::of(&bytes[..bytes.len() - 200]).to_bytes();
    // … and garbage.
    for (case, planted) in [
        ("one hash short", short.into_bytes()),
        ("another size", resized),
        ("garbage", b"not side data\n".to_vec()),
    ] {
        store
            .object_store()
            .put(name.as_str(), &mut planted.as_slice())
            .await
            .unwrap();
        let err = store.pieces(&sha, size).await.unwrap_err();
        assert_eq!(err.kind, ManifestErrorKind::Malformed, "{case}: {err}");
        assert!(!err.is_retryable(), "{case}");
        assert!(err.to_string().contains(&name), "{case}: {err}");
    }
    // More bytes than a file of this size can have side data: refused unread.
    let huge = vec![b'0'; PieceHashes::max_bytes(size) as usize + 1];
    store
        .object_store()
        .put(name.as_str(), &mut huge.as_slice())
        .await
        .unwrap();
    let err = store.pieces(&sha, size).await.unwrap_err();
    assert_eq!(err.kind, ManifestErrorKind::Malformed, "{err}");
    assert!(err.to_string().contains("refused unread"), "{err}");
}
