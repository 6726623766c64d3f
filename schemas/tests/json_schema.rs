//! The committed JSON Schemas under `schemas/json/` are exactly what the Rust types generate.
//!
//! Run with `STAGEHAND_BLESS=1` to rewrite them after a deliberate contract change (and review
//! the diff: only added optional fields are compatible).

use std::path::PathBuf;

use stagehand_schemas::{ALL_KINDS, json_schema};

fn json_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("json")
}

fn bless() -> bool {
    std::env::var_os("STAGEHAND_BLESS").is_some_and(|v| v == "1")
}

#[test]
fn committed_schemas_match_the_rust_types() {
    let dir = json_dir();
    let mut stale = Vec::new();
    for (name, schema) in json_schema::all() {
        let generated = serde_json::to_string_pretty(&schema).unwrap() + "\n";
        let path = dir.join(&name);
        if bless() {
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(&path, &generated).unwrap();
            continue;
        }
        match std::fs::read_to_string(&path) {
            Ok(committed) if committed == generated => {}
            Ok(_) => stale.push(format!("{name} differs from the generated schema")),
            Err(e) => stale.push(format!("{name}: {e}")),
        }
    }
    assert!(
        stale.is_empty(),
        "schemas/json is out of date (rerun with STAGEHAND_BLESS=1 and review the diff):\n{}",
        stale.join("\n")
    );
}

#[test]
fn there_is_no_schema_file_without_a_kind() {
    let mut expected: Vec<String> = ALL_KINDS
        .iter()
        .map(|k| json_schema::file_name(k))
        .collect();
    expected.push("envelope.json".into());
    expected.sort();
    let mut found: Vec<String> = std::fs::read_dir(json_dir())
        .unwrap()
        .map(|entry| entry.unwrap().file_name().into_string().unwrap())
        .collect();
    found.sort();
    assert_eq!(found, expected);
}

#[test]
fn every_kind_has_a_schema_and_nothing_else_does() {
    for kind in ALL_KINDS {
        let schema = json_schema::for_kind(kind).expect(kind);
        assert_eq!(schema["properties"]["kind"]["const"], *kind);
        assert_eq!(schema["additionalProperties"], true);
    }
    assert!(json_schema::for_kind("ingest.request").is_none());
}
