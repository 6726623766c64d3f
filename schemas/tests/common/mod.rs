//! Helpers shared by the integration tests: where the committed contract files are, and
//! loading the example events.

#![allow(dead_code)]

use std::path::PathBuf;

use serde_json::Value;
use stagehand_schemas::{ALL_KINDS, Event};

/// The crate's folder in the checkout the test runs in: `CARGO_MANIFEST_DIR` as cargo and
/// nextest set it for the test process, else as it was at build time. A test binary built
/// from another checkout into a shared target folder (and judged fresh by cargo) then still
/// reads this checkout's contract files, not the other's.
pub fn crate_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

/// Whether `STAGEHAND_BLESS=1` asks the test to write what it would otherwise compare.
pub fn bless() -> bool {
    std::env::var_os("STAGEHAND_BLESS").is_some_and(|v| v == "1")
}

pub fn read_json(path: &std::path::Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The example document of `kind`, as JSON.
pub fn example_json(kind: &str) -> Value {
    read_json(&crate_dir().join("examples").join(format!("{kind}.json")))
}

/// The example event of `kind`, decoded the way a Rust reader of JSON would.
pub fn example_event(kind: &str) -> Event {
    serde_json::from_value(example_json(kind))
        .unwrap_or_else(|e| panic!("examples/{kind}.json does not decode as an Event: {e}"))
}

/// Every example event, in `ALL_KINDS` order.
pub fn all_examples() -> Vec<Event> {
    ALL_KINDS.iter().map(|kind| example_event(kind)).collect()
}

/// The schema document of `kind` (or `envelope`).
pub fn schema_json(name: &str) -> Value {
    read_json(&crate_dir().join("json").join(format!("{name}.json")))
}

/// A compiled validator for a committed schema, checking formats (date-time) too. Builds
/// offline: the 2020-12 meta-schemas are bundled and `$ref`s are all local.
pub fn validator(name: &str) -> jsonschema::Validator {
    jsonschema::options()
        .with_draft(jsonschema::Draft::Draft202012)
        .should_validate_formats(true)
        .build(&schema_json(name))
        .unwrap_or_else(|e| panic!("json/{name}.json does not compile: {e}"))
}

/// Every validation error of `instance` against `name`, as text.
pub fn schema_errors(name: &str, instance: &Value) -> Vec<String> {
    validator(name)
        .iter_errors(instance)
        .map(|e| format!("{} at {}", e, e.instance_path()))
        .collect()
}
