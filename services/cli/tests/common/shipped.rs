//! What Stagehand ships: the binaries the workspace builds for operators, by the rule
//! `deploy/package.sh binaries` follows (a `[[bin]]` of `services/*/Cargo.toml`, or the package
//! of a crate with a `src/main.rs` and none), read here from the manifests themselves so that
//! the script, the Dockerfile and the manifests are each checked against the workspace.

use std::collections::BTreeSet;
use std::process::Command;

use anyhow::{Context, ensure};

/// The binaries the workspace builds for operators: each crate's `[[bin]]` names, or its
/// package name when it has a `src/main.rs` and no `[[bin]]`.
pub fn workspace_binaries() -> anyhow::Result<BTreeSet<String>> {
    let mut bins = BTreeSet::new();
    let services = stagehand_testkit::repo_root().join("services");
    for entry in std::fs::read_dir(&services)? {
        let crate_dir = entry?.path();
        let manifest = crate_dir.join("Cargo.toml");
        let Ok(text) = std::fs::read_to_string(&manifest) else {
            continue;
        };
        let doc: toml::Value = toml::from_str(&text)?;
        let declared = doc.get("bin").and_then(|b| b.as_array());
        for bin in declared.into_iter().flatten() {
            if let Some(name) = bin.get("name").and_then(|n| n.as_str()) {
                bins.insert(name.to_owned());
            }
        }
        if declared.is_none() && crate_dir.join("src/main.rs").is_file() {
            let package = doc.get("package").and_then(|p| p.get("name"));
            if let Some(name) = package.and_then(|n| n.as_str()) {
                bins.insert(name.to_owned());
            }
        }
    }
    Ok(bins)
}

/// What `deploy/package.sh binaries` says ships.
pub fn package_binaries() -> anyhow::Result<BTreeSet<String>> {
    let out = Command::new(stagehand_testkit::repo_root().join("deploy/package.sh"))
        .arg("binaries")
        .output()
        .context("running deploy/package.sh binaries")?;
    ensure!(
        out.status.success(),
        "deploy/package.sh binaries: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?
        .lines()
        .map(str::to_owned)
        .collect())
}
