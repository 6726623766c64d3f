//! Golden bytes: `schemas/fixtures/<kind>.msgpack` were encoded once and are never rewritten.
//! Every future reader must keep decoding them to the example events, which is what "old
//! events keep decoding" means in practice (a stored facts stream is years of these).
//!
//! `STAGEHAND_BLESS=1` writes a fixture only where none exists (for a newly added kind). To
//! change an existing one is to break compatibility: delete it by hand and say so.

mod common;

use std::collections::BTreeMap;

use common::*;
use serde::de::IgnoredAny;
use stagehand_schemas::{ALL_KINDS, wire};

fn fixture_path(kind: &str) -> std::path::PathBuf {
    crate_dir().join("fixtures").join(format!("{kind}.msgpack"))
}

#[test]
fn golden_bytes_keep_decoding_to_the_examples() {
    let mut problems = Vec::new();
    for kind in ALL_KINDS {
        let path = fixture_path(kind);
        let expected = example_event(kind);
        if !path.exists() && bless() {
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, wire::encode(&expected).unwrap()).unwrap();
        }
        let bytes = match std::fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) => {
                problems.push(format!("{}: {e}", path.display()));
                continue;
            }
        };
        match wire::decode(&bytes) {
            Ok(event) if event == expected => {}
            Ok(event) => problems.push(format!(
                "fixtures/{kind}.msgpack decodes to\n{event:#?}\nnot the example\n{expected:#?}"
            )),
            Err(e) => problems.push(format!("fixtures/{kind}.msgpack no longer decodes: {e}")),
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn golden_bytes_are_maps_with_field_names() {
    for kind in ALL_KINDS {
        let bytes = std::fs::read(fixture_path(kind)).unwrap();
        assert!(matches!(bytes[0], 0x80..=0x8f | 0xde | 0xdf), "{kind}");
        // Keys only: `dead.letter` holds `bin`, which has no JSON value.
        let generic: BTreeMap<String, IgnoredAny> = rmp_serde::from_slice(&bytes).unwrap();
        for field in [
            "id",
            "kind",
            "schema",
            "occurred_at",
            "project",
            "correlation_id",
            "payload",
        ] {
            assert!(
                generic.contains_key(field),
                "fixtures/{kind}.msgpack lacks `{field}`"
            );
        }
    }
}
