//! Golden bytes: `schemas/fixtures/v<N>/<kind>.msgpack` were encoded once, by a writer of
//! schema N, and are never rewritten. Every future reader must keep decoding them to the events
//! beside them (`fixtures/v<N>/<kind>.json`), which is what "old events keep decoding" means in
//! practice (a stored facts stream is years of these).
//!
//! The current schema's fixtures are the examples (`schemas/examples/<kind>.json`), encoded.
//! `STAGEHAND_BLESS=1` writes a fixture of the current schema only where none exists (for a
//! newly added kind, or the first run of a new schema version, which also copies the example
//! beside it). To change an existing fixture is to break compatibility: delete it by hand and
//! say so.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::*;
use serde::de::IgnoredAny;
use stagehand_schemas::{ALL_KINDS, Event, SCHEMA_VERSION, wire};

fn version_dir(version: u32) -> PathBuf {
    crate_dir().join("fixtures").join(format!("v{version}"))
}

/// The golden (bytes, expected event JSON) pairs of one schema version, by kind.
fn fixtures(version: u32) -> Vec<(String, PathBuf, PathBuf)> {
    let dir = version_dir(version);
    let mut out: Vec<(String, PathBuf, PathBuf)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|e| e == "msgpack"))
        .map(|path| {
            let kind = path.file_stem().unwrap().to_string_lossy().into_owned();
            let json = dir.join(format!("{kind}.json"));
            (kind, path, json)
        })
        .collect();
    out.sort();
    out
}

fn read_event(path: &Path) -> Event {
    serde_json::from_value(read_json(path))
        .unwrap_or_else(|e| panic!("{} does not decode as an Event: {e}", path.display()))
}

#[test]
fn current_schema_has_a_fixture_for_every_kind() {
    let dir = version_dir(SCHEMA_VERSION);
    for kind in ALL_KINDS {
        let bytes = dir.join(format!("{kind}.msgpack"));
        if !bytes.exists() && bless() {
            std::fs::create_dir_all(&dir).unwrap();
            let example = example_event(kind);
            assert_eq!(example.schema, SCHEMA_VERSION, "examples/{kind}.json");
            std::fs::write(&bytes, wire::encode(&example).unwrap()).unwrap();
            std::fs::copy(
                crate_dir().join("examples").join(format!("{kind}.json")),
                dir.join(format!("{kind}.json")),
            )
            .unwrap();
        }
        assert!(
            bytes.exists(),
            "fixtures/v{SCHEMA_VERSION}/{kind}.msgpack is missing (STAGEHAND_BLESS=1 writes it)"
        );
    }
    // The current fixtures are the examples: an example edited after its fixture was written
    // changes what the contract documents, which is a new schema version, not an edit.
    for (kind, _, json) in fixtures(SCHEMA_VERSION) {
        assert_eq!(
            read_event(&json),
            example_event(&kind),
            "examples/{kind}.json differs from fixtures/v{SCHEMA_VERSION}/{kind}.json"
        );
    }
}

#[test]
fn golden_bytes_of_every_schema_version_keep_decoding() {
    let mut problems = Vec::new();
    let mut checked = 0;
    for version in 1..=SCHEMA_VERSION {
        for (kind, bytes, json) in fixtures(version) {
            let expected = read_event(&json);
            assert_eq!(expected.schema, version, "{}", json.display());
            match wire::decode(&std::fs::read(&bytes).unwrap()) {
                Ok(event) if event == expected => checked += 1,
                Ok(event) => problems.push(format!(
                    "fixtures/v{version}/{kind}.msgpack decodes to\n{event:#?}\nnot\n{expected:#?}"
                )),
                Err(e) => problems.push(format!(
                    "fixtures/v{version}/{kind}.msgpack no longer decodes: {e}"
                )),
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    // Schema 1 had 17 kinds; every later version has a fixture for each of its kinds.
    assert!(checked >= 17 + ALL_KINDS.len(), "only {checked} fixtures");
}

#[test]
fn golden_bytes_are_maps_with_field_names() {
    for version in 1..=SCHEMA_VERSION {
        for (kind, bytes, _) in fixtures(version) {
            let bytes = std::fs::read(bytes).unwrap();
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
                    "fixtures/v{version}/{kind}.msgpack lacks `{field}`"
                );
            }
        }
    }
}
