//! A test's policy folder, written by a builder: the tiers of `tiers.toml` ([`TierSpec`], posix
//! or S3, with the keys a test sets) and the other policy files, as text a test chooses or as
//! the shipped `policies/` has them.

use std::path::{Path, PathBuf};

use crate::S3Server;

/// A validation policy that lets every test's files through but `.exe`, with room for a
/// hundred thousand files.
pub const VALIDATION: &str = r#"
max_file_size = "1 GiB"
max_entries = 100000
max_total_bytes = "10 GiB"
allowed_suffixes = []
denied_suffixes = [".exe"]
allow_hidden = false
"#;

/// One tier of `tiers.toml`: its kind, role and failure domain, then what a test sets.
#[derive(Debug, Clone)]
pub struct TierSpec {
    posix: bool,
    root: Option<PathBuf>,
    /// `key = value` lines, values as TOML, in the order set.
    lines: Vec<String>,
    quotas: Option<String>,
}

impl TierSpec {
    /// A posix tier. Its root is set with [`root`](Self::root), or by the
    /// [`Stack`](crate::Stack) (`<root>/tiers/<name>`) when left unset.
    pub fn posix(role: &str, failure_domain: &str) -> TierSpec {
        TierSpec {
            posix: true,
            root: None,
            lines: vec![
                "kind = \"posix\"".into(),
                format!("role = \"{role}\""),
                format!("failure_domain = \"{failure_domain}\""),
            ],
            quotas: None,
        }
    }

    /// An S3 tier on `s3`'s plaintext endpoint: `bucket` from its root, region `us-east-1`.
    pub fn s3(role: &str, failure_domain: &str, s3: &S3Server, bucket: &str) -> TierSpec {
        TierSpec::s3_at(role, failure_domain, &s3.endpoint(), bucket)
    }

    /// [`TierSpec::s3`] on any endpoint.
    pub fn s3_at(role: &str, failure_domain: &str, endpoint: &str, bucket: &str) -> TierSpec {
        TierSpec {
            posix: false,
            root: None,
            lines: vec![
                "kind = \"s3\"".into(),
                format!("endpoint = \"{endpoint}\""),
                "allow_plaintext = true".into(),
                format!("bucket = \"{bucket}\""),
                "prefix = \"\"".into(),
                "region = \"us-east-1\"".into(),
                format!("role = \"{role}\""),
                format!("failure_domain = \"{failure_domain}\""),
            ],
            quotas: None,
        }
    }

    /// A posix tier's root: absolute, or relative as a policy may have it.
    pub fn root(mut self, root: impl Into<PathBuf>) -> TierSpec {
        self.root = Some(root.into());
        self
    }

    /// The tier's `capacity` (`"1 GiB"`).
    pub fn capacity(self, capacity: &str) -> TierSpec {
        self.set("capacity", &format!("\"{capacity}\""))
    }

    /// The tier's `high_watermark` and `low_watermark`.
    pub fn watermarks(self, high: f64, low: f64) -> TierSpec {
        self.set("high_watermark", &high.to_string())
            .set("low_watermark", &low.to_string())
    }

    /// The lines of the tier's `[tiers.<name>.quotas]` table (`default = "100 MiB"`).
    pub fn quotas(mut self, lines: &str) -> TierSpec {
        self.quotas = Some(lines.to_owned());
        self
    }

    /// Any other key, its value written as TOML (`"[\"source\"]"`, `"true"`).
    pub fn set(mut self, key: &str, value: &str) -> TierSpec {
        self.lines.push(format!("{key} = {value}"));
        self
    }

    /// Whether the tier is a posix one.
    pub fn is_posix(&self) -> bool {
        self.posix
    }

    /// The posix root set, if any.
    pub fn root_path(&self) -> Option<&Path> {
        self.root.as_deref()
    }
}

/// The files of a policy folder, written by [`write`](Self::write).
#[derive(Debug, Clone, Default)]
pub struct PolicyFiles {
    tiers: Vec<(String, TierSpec)>,
    /// Other lines of `tiers.toml` after the tiers (a `[groups]` table, say).
    tiers_tail: String,
    files: Vec<(String, String)>,
}

impl PolicyFiles {
    pub fn new() -> PolicyFiles {
        PolicyFiles::default()
    }

    /// Declares tier `name` (replacing one declared before under that name).
    pub fn tier(mut self, name: &str, spec: TierSpec) -> PolicyFiles {
        self.tiers.retain(|(n, _)| n != name);
        self.tiers.push((name.to_owned(), spec));
        self
    }

    /// Lines appended to `tiers.toml` after the tiers.
    pub fn tiers_tail(mut self, text: &str) -> PolicyFiles {
        self.tiers_tail.push_str(text);
        self
    }

    /// The policy file `name` (`promotion.toml`) with `text` (replacing one set before).
    pub fn file(mut self, name: &str, text: impl Into<String>) -> PolicyFiles {
        self.files.retain(|(n, _)| n != name);
        self.files.push((name.to_owned(), text.into()));
        self
    }

    /// `validation.toml` with `text`.
    pub fn validation(self, text: &str) -> PolicyFiles {
        self.file("validation.toml", text)
    }

    /// The policy file `name` as the repository's `policies/` ships it.
    pub fn shipped(self, name: &str) -> PolicyFiles {
        let path = crate::repo_root().join("policies").join(name);
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        self.file(name, text)
    }

    /// The tiers declared, in order.
    pub fn tiers(&self) -> impl Iterator<Item = (&str, &TierSpec)> {
        self.tiers.iter().map(|(n, s)| (n.as_str(), s))
    }

    /// Sets the root of every posix tier without one: `root(name)`.
    pub fn default_roots(mut self, root: impl Fn(&str) -> PathBuf) -> PolicyFiles {
        for (name, spec) in &mut self.tiers {
            if spec.posix && spec.root.is_none() {
                spec.root = Some(root(name));
            }
        }
        self
    }

    /// The text of `tiers.toml`. Panics when a posix tier has no root.
    pub fn tiers_toml(&self) -> String {
        let mut out = String::new();
        for (name, spec) in &self.tiers {
            out.push_str(&format!("[tiers.{name}]\n"));
            for line in &spec.lines {
                out.push_str(line);
                out.push('\n');
            }
            if spec.posix {
                let root = spec
                    .root
                    .as_ref()
                    .unwrap_or_else(|| panic!("posix tier `{name}` has no root"));
                out.push_str(&format!("root = \"{}\"\n", root.display()));
            }
            if let Some(quotas) = &spec.quotas {
                out.push_str(&format!("\n[tiers.{name}.quotas]\n{quotas}\n"));
            }
            out.push('\n');
        }
        out.push_str(&self.tiers_tail);
        out
    }

    /// Writes `tiers.toml` (when tiers are declared) and the other files into `dir`, creating
    /// it and every absolute posix root, as `stagehand up` or a mount would have them.
    /// Panics on a failed write, naming the file.
    pub fn write(&self, dir: &Path) {
        std::fs::create_dir_all(dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
        for (_, spec) in &self.tiers {
            if let Some(root) = spec.root.as_ref().filter(|r| r.is_absolute()) {
                std::fs::create_dir_all(root)
                    .unwrap_or_else(|e| panic!("creating {}: {e}", root.display()));
            }
        }
        let mut files = self.files.clone();
        if !self.tiers.is_empty() {
            files.push(("tiers.toml".into(), self.tiers_toml()));
        }
        for (name, text) in files {
            let path = dir.join(name);
            std::fs::write(&path, text)
                .unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
        }
    }
}
