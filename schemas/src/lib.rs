//! The Stagehand event contract: event types, their wire format, ids, subjects and streams.
//!
//! Every service and every producer outside Rust follows this crate. The JSON Schemas and
//! examples under `schemas/json/` and `schemas/examples/` are the same contract for Python,
//! Go or Lua producers; tests keep them in step with these types. `schemas/README.md` is the
//! contract in prose: subjects, streams, headers, id rules, the version digest, compatibility.
//!
//! Two modules hold the rules every crate shares rather than restates: [`layout`] (names, the
//! folders of versions, uploads and staging sets, and the location rule) and [`trust`] (which
//! role may state which kind, and the checks a consumer applies to an event against its subject
//! before reading anything it names).
//!
//! The `json-schema` feature adds the `json_schema` module, which generates those schemas
//! from the types.
//!
//! ```
//! use stagehand_schemas::{Body, Event, EventId, FileRef, IngestRequested, Location, wire};
//!
//! let files = vec![FileRef::new("a.txt", 3, stagehand_schemas::sha256_hex(b"abc"))];
//! let request = Event::request(
//!     EventId::new("upload-1").unwrap(),
//!     "lab-a",
//!     Body::IngestRequested(IngestRequested {
//!         dataset: "cats".into(),
//!         source: Location { tier: "source".into(), prefix: "lab-a/cats".into() },
//!         files,
//!         manifest: None,
//!         requested_by: "alice".into(),
//!         labels: vec![],
//!     }),
//! );
//! let bytes = wire::encode(&request).unwrap();
//! assert_eq!(wire::decode(&bytes).unwrap(), request);
//! ```

pub mod event;
pub mod id;
#[cfg(feature = "json-schema")]
pub mod json_schema;
pub mod layout;
pub mod manifest;
pub mod path;
pub mod pieces;
pub mod problem;
pub mod progress;
pub mod retryable;
pub mod subject;
pub mod trust;
pub mod wire;

pub use event::*;
pub use id::{BadEventId, EventId};
pub use manifest::{
    FileRef, FileRefError, INLINE_MANIFEST_MAX_BYTES, ManifestRef, is_sha256_hex, sha256_hex,
    total_bytes, version_digest,
};
pub use path::{PathError, RelPath, check_relative_path, folders_overlap};
pub use problem::Problem;
pub use retryable::Retryable;
pub use trust::{Refusal, Role};
