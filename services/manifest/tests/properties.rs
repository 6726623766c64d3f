//! Whatever entries, in whatever order and however the builder spills: the manifest it builds
//! has the version digest of those entries, and reads back as them in path order.

use proptest::prelude::*;
use stagehand_manifest::{ManifestBuilder, Spool};
use stagehand_schemas::{FileRef, sha256_hex, version_digest};

fn entry() -> impl Strategy<Value = FileRef> {
    // Short paths over a tiny alphabet, so that prefixes and duplicates are common.
    ("[ab/]{1,6}", 0u64..1000)
        .prop_map(|(path, size)| FileRef::new(path, size, sha256_hex(size.to_string().as_bytes())))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn built_manifests_have_the_version_digest(
        files in proptest::collection::vec(entry(), 0..300),
        run_bytes in 64usize..4096,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let spool = Spool { dir: dir.path().to_owned(), in_memory_below: 512 };
        let mut builder = ManifestBuilder::with_run_bytes(&spool, run_bytes);
        for f in &files {
            builder.push(f).unwrap();
        }
        let manifest = builder.finish().unwrap();
        prop_assert_eq!(manifest.digest(), version_digest(&files));
        let mut sorted = files.clone();
        sorted.sort_by(|a, b| a.path.as_bytes().cmp(b.path.as_bytes()));
        let back: Vec<FileRef> = manifest.entries().map(Result::unwrap).collect();
        prop_assert_eq!(back, sorted);
    }
}
