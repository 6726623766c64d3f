//! The S3 tier's configuration: where the bucket is, how objects are cut into parts, and how
//! many requests may be in flight. Parsed from TOML with unknown keys refused, then validated
//! into numbers the transfer code can rely on.

use serde::Deserialize;

use crate::error::{ErrorKind, Side, TransferError};

const MIB: u64 = 1024 * 1024;
/// S3's smallest part (every part but the last).
pub const MIN_PART_SIZE: u64 = 5 * MIB;
/// S3's largest part, and the largest object one `PutObject`/`CopyObject` may write.
pub const MAX_PART_SIZE: u64 = 5 * 1024 * MIB;
/// S3's largest part count in one multipart upload.
pub const MAX_PARTS: u64 = 10_000;

/// One S3 tier: an endpoint, a bucket, and a prefix beneath which every key lives.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct S3Config {
    /// Endpoint URL (`http://127.0.0.1:8333`, `https://s3.example.org`). None means AWS's
    /// regional endpoint for `region`.
    #[serde(default)]
    pub endpoint: Option<String>,
    /// Bucket name (at least 3 characters).
    pub bucket: String,
    /// Key prefix of the tier's root inside the bucket, without a trailing slash; empty means the
    /// bucket's root. It obeys the same rules as a relative path.
    #[serde(default)]
    pub prefix: String,
    /// Region used for signing; non-AWS servers accept any fixed value.
    #[serde(default = "default_region")]
    pub region: String,
    /// Path-style addressing (`endpoint/bucket/key`), which SeaweedFS, MinIO and Ceph RGW need.
    #[serde(default = "default_true")]
    pub path_style: bool,
    /// Named profile from the shared AWS config/credentials files; credentials otherwise come from
    /// the `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` / `AWS_SESSION_TOKEN` environment.
    #[serde(default)]
    pub profile: Option<String>,
    /// Bytes per multipart part and per ranged GET (at least 5 MiB).
    #[serde(default = "default_part_size")]
    pub part_size: u64,
    /// Files larger than this go up as multipart uploads; smaller ones as one PUT.
    #[serde(default = "default_part_size")]
    pub multipart_threshold: u64,
    /// Requests in flight against this tier at once, across all transfers using it.
    #[serde(default = "default_concurrency")]
    pub concurrency: usize,
    /// Send `x-amz-checksum-sha256` with every PUT and part so the server verifies what it
    /// received. Turn off only for a server that rejects the header.
    #[serde(default = "default_true")]
    pub send_checksums: bool,
}

fn default_region() -> String {
    "us-east-1".to_owned()
}
fn default_true() -> bool {
    true
}
fn default_part_size() -> u64 {
    16 * MIB
}
fn default_concurrency() -> usize {
    16
}

impl S3Config {
    /// A configuration with every default, for `bucket` and `prefix`.
    pub fn new(bucket: impl Into<String>, prefix: impl Into<String>) -> Self {
        Self {
            endpoint: None,
            bucket: bucket.into(),
            prefix: prefix.into(),
            region: default_region(),
            path_style: true,
            profile: None,
            part_size: default_part_size(),
            multipart_threshold: default_part_size(),
            concurrency: default_concurrency(),
            send_checksums: true,
        }
    }

    /// Checks every field; the error names the tier, the field and what is wrong.
    pub fn validate(&self, tier: &str) -> Result<(), TransferError> {
        let bad = |field: &str, why: String| {
            TransferError::new(
                ErrorKind::Config,
                Side::Source,
                tier,
                field,
                format!("invalid S3 tier setting `{field}`: {why}"),
            )
        };
        if self.bucket.len() < 3
            || self.bucket.len() > 63
            || !self
                .bucket
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        {
            return Err(bad(
                "bucket",
                format!(
                    "{:?} is not a bucket name (3-63 of a-z, 0-9, '-', '.')",
                    self.bucket
                ),
            ));
        }
        if !self.prefix.is_empty() {
            stagehand_schemas::check_relative_path(&self.prefix)
                .map_err(|e| bad("prefix", e.to_string()))?;
        }
        if let Some(endpoint) = &self.endpoint
            && !(endpoint.starts_with("http://") || endpoint.starts_with("https://"))
        {
            return Err(bad(
                "endpoint",
                format!("{endpoint:?} must start with http:// or https://"),
            ));
        }
        if self.region.is_empty() {
            return Err(bad("region", "is empty".into()));
        }
        if !(MIN_PART_SIZE..=MAX_PART_SIZE).contains(&self.part_size) {
            return Err(bad(
                "part_size",
                format!(
                    "{} is outside S3's part limits {MIN_PART_SIZE}..={MAX_PART_SIZE}",
                    self.part_size
                ),
            ));
        }
        if self.multipart_threshold > MAX_PART_SIZE {
            return Err(bad(
                "multipart_threshold",
                format!(
                    "{} is over the largest single PUT, {MAX_PART_SIZE}",
                    self.multipart_threshold
                ),
            ));
        }
        if !(1..=1024).contains(&self.concurrency) {
            return Err(bad(
                "concurrency",
                format!("{} is outside 1..=1024", self.concurrency),
            ));
        }
        Ok(())
    }

    /// The part size for an object of `size` bytes: the configured size, grown (to a whole MiB)
    /// when the object would otherwise need more than S3's 10,000 parts.
    pub fn part_size_for(&self, size: u64) -> u64 {
        let needed = size.div_ceil(MAX_PARTS).div_ceil(MIB) * MIB;
        self.part_size.max(needed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_fill_in_and_unknown_keys_are_refused() {
        let config: S3Config =
            toml::from_str("bucket = \"data\"\nendpoint = \"http://127.0.0.1:1\"").unwrap();
        assert_eq!(config.part_size, 16 * MIB);
        assert!(config.path_style);
        assert_eq!(config.region, "us-east-1");
        config.validate("t").unwrap();
        let err = toml::from_str::<S3Config>("bucket = \"data\"\nbukcet = \"x\"").unwrap_err();
        assert!(err.to_string().contains("bukcet"), "{err}");
    }

    #[test]
    fn validation_names_the_field() {
        let mut config = S3Config::new("data", "../x");
        let err = config.validate("cold").unwrap_err();
        assert_eq!(err.kind, ErrorKind::Config);
        assert_eq!(err.path, "prefix");
        config.prefix = "ok/prefix".into();
        config.part_size = MIB;
        assert_eq!(config.validate("cold").unwrap_err().path, "part_size");
        config.part_size = 8 * MIB;
        config.bucket = "A".into();
        assert_eq!(config.validate("cold").unwrap_err().path, "bucket");
        config.bucket = "data".into();
        config.endpoint = Some("127.0.0.1:9000".into());
        assert_eq!(config.validate("cold").unwrap_err().path, "endpoint");
    }

    #[test]
    fn part_size_grows_to_stay_under_ten_thousand_parts() {
        let config = S3Config::new("data", "");
        assert_eq!(config.part_size_for(1 << 30), 16 * MIB);
        let huge = 1u64 << 40; // 1 TiB
        let part = config.part_size_for(huge);
        assert!(huge.div_ceil(part) <= MAX_PARTS);
        assert_eq!(part % MIB, 0);
    }
}
