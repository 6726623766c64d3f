//! Property tests: the decoder never panics on any input, and the version digest depends on
//! exactly the manifest's content (not its order).

mod common;

use std::collections::BTreeMap;

use proptest::prelude::*;
use stagehand_schemas::{ALL_KINDS, EventId, FileRef, version_digest, wire};

/// The encoding of every example event: the seeds that mutations start from.
fn seeds() -> Vec<Vec<u8>> {
    common::all_examples()
        .iter()
        .map(|event| wire::encode(event).unwrap())
        .collect()
}

/// One way of damaging a message.
#[derive(Debug, Clone)]
enum Mutation {
    Set { at: usize, byte: u8 },
    Insert { at: usize, bytes: Vec<u8> },
    Remove { at: usize, len: usize },
    Truncate { at: usize },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<usize>(), any::<u8>()).prop_map(|(at, byte)| Mutation::Set { at, byte }),
        2 => (any::<usize>(), proptest::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
        2 => (any::<usize>(), 1..64usize).prop_map(|(at, len)| Mutation::Remove { at, len }),
        1 => any::<usize>().prop_map(|at| Mutation::Truncate { at }),
    ]
}

fn apply(bytes: &mut Vec<u8>, mutation: &Mutation) {
    if bytes.is_empty() {
        return;
    }
    match mutation {
        Mutation::Set { at, byte } => {
            let at = at % bytes.len();
            bytes[at] = *byte;
        }
        Mutation::Insert { at, bytes: new } => {
            let at = at % (bytes.len() + 1);
            bytes.splice(at..at, new.iter().copied());
        }
        Mutation::Remove { at, len } => {
            let at = at % bytes.len();
            let end = (at + len).min(bytes.len());
            bytes.drain(at..end);
        }
        Mutation::Truncate { at } => bytes.truncate(at % bytes.len()),
    }
}

/// Whatever `decode` accepts, it accepts again after re-encoding, unchanged.
fn accepted_events_are_stable(bytes: &[u8]) -> Result<(), TestCaseError> {
    if let Ok(event) = wire::decode(bytes) {
        let again = wire::encode(&event).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(wire::decode(&again).ok(), Some(event));
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        accepted_events_are_stable(&bytes)?;
    }

    #[test]
    fn arbitrary_bytes_behind_a_map_marker_never_panic(
        marker in prop_oneof![0x80u8..=0x8f, Just(0xde), Just(0xdf)],
        rest in proptest::collection::vec(any::<u8>(), 0..2048),
    ) {
        let mut bytes = vec![marker];
        bytes.extend(rest);
        accepted_events_are_stable(&bytes)?;
    }

    #[test]
    fn mutated_events_never_panic(
        seed in 0..ALL_KINDS.len(),
        mutations in proptest::collection::vec(mutation(), 1..6),
    ) {
        let mut bytes = seeds().swap_remove(seed);
        for m in &mutations {
            apply(&mut bytes, m);
        }
        accepted_events_are_stable(&bytes)?;
    }
}

/// A manifest with distinct, valid paths.
fn manifest() -> impl Strategy<Value = Vec<FileRef>> {
    let path = "[a-zA-Z0-9_.-]{1,12}(/[a-zA-Z0-9_.-]{1,12}){0,3}";
    let hash = "[0-9a-f]{64}";
    proptest::collection::btree_map(path, (any::<u64>(), hash), 1..40).prop_map(
        |entries: BTreeMap<String, (u64, String)>| {
            entries
                .into_iter()
                .map(|(path, (size, sha))| FileRef::new(path, size, sha))
                .collect()
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn version_digest_ignores_listing_order(
        (files, shuffled) in manifest().prop_flat_map(|files| {
            let shuffled = Just(files.clone()).prop_shuffle();
            (Just(files), shuffled)
        })
    ) {
        prop_assert_eq!(version_digest(&files), version_digest(&shuffled));
    }

    #[test]
    fn version_digest_changes_with_any_path_size_or_hash(
        files in manifest(),
        index in any::<prop::sample::Index>(),
        change in 0..3u8,
        suffix in "[a-z0-9]{1,4}",
    ) {
        let before = version_digest(&files);
        let mut changed = files.clone();
        let i = index.index(changed.len());
        match change {
            0 => {
                let path = format!("{}{suffix}", changed[i].path);
                prop_assume!(!files.iter().any(|f| f.path == path));
                changed[i].path = path;
            }
            1 => changed[i].size = changed[i].size.wrapping_add(1),
            _ => {
                let first = if changed[i].sha256.starts_with('0') { "1" } else { "0" };
                changed[i].sha256.replace_range(0..1, first);
            }
        }
        prop_assert_ne!(before, version_digest(&changed));
    }

    #[test]
    fn dropping_or_adding_a_file_changes_the_digest(files in manifest()) {
        prop_assert_ne!(version_digest(&files), version_digest(&files[1..]));
    }

    #[test]
    fn derived_ids_are_valid_producer_ids(cause in "[A-Za-z0-9._:-]{1,128}", step in ".*", project in "[a-z0-9_-]{1,64}") {
        let cause = EventId::new(cause).unwrap();
        for derived in [EventId::derive(&cause, &step), EventId::for_fact(&project, &cause, &step)] {
            prop_assert!(EventId::new(derived.as_str()).is_ok());
            prop_assert_eq!(derived.as_str().len(), 32);
        }
    }
}
