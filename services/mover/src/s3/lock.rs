//! S3 Object Lock on a tier's bucket: whether it is on, the default retention every new object
//! gets, and the retention one object carries.
//!
//! Object Lock is chosen when a bucket is created (it turns versioning on) and cannot be
//! turned on later. Once on, a bucket's *default retention* applies to every object version
//! written after it is set, atomically with the write: there is no moment at which a new
//! object exists unprotected. In `compliance` mode no user can delete or shorten the retention
//! of a locked version before it ends; in `governance` mode a user with the bypass right can.
//! A write to a locked key adds a version and leaves the locked one in place; a delete adds a
//! delete marker. What the lock binds is the S3 API: a server's own back doors (SeaweedFS's
//! filer API, for one) are outside it.

use std::time::SystemTime;

use aws_sdk_s3::error::ProvideErrorMetadata;
use aws_sdk_s3::types::{
    DefaultRetention as SdkDefaultRetention, ObjectLockConfiguration, ObjectLockEnabled,
    ObjectLockMode, ObjectLockRetentionMode, ObjectLockRule,
};

use super::S3Tier;
use super::errors::map_sdk_error;
use crate::error::{ErrorKind, Side, TransferError};

/// How strictly a locked object version is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RetentionMode {
    /// Users with `s3:BypassGovernanceRetention` may delete the version or shorten its
    /// retention; nobody else may.
    Governance,
    /// Nobody may delete the version or shorten its retention until it ends.
    Compliance,
}

impl RetentionMode {
    pub fn as_str(self) -> &'static str {
        match self {
            RetentionMode::Governance => "governance",
            RetentionMode::Compliance => "compliance",
        }
    }

    fn sdk(self) -> ObjectLockRetentionMode {
        match self {
            RetentionMode::Governance => ObjectLockRetentionMode::Governance,
            RetentionMode::Compliance => ObjectLockRetentionMode::Compliance,
        }
    }

    fn from_sdk(mode: &ObjectLockRetentionMode) -> Option<RetentionMode> {
        match mode {
            ObjectLockRetentionMode::Governance => Some(RetentionMode::Governance),
            ObjectLockRetentionMode::Compliance => Some(RetentionMode::Compliance),
            _ => None,
        }
    }

    fn from_object(mode: &ObjectLockMode) -> Option<RetentionMode> {
        match mode {
            ObjectLockMode::Governance => Some(RetentionMode::Governance),
            ObjectLockMode::Compliance => Some(RetentionMode::Compliance),
            _ => None,
        }
    }
}

impl std::fmt::Display for RetentionMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The retention a bucket gives every object version written to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DefaultRetention {
    pub mode: RetentionMode,
    /// Days each new version is held from its write.
    pub days: u32,
}

/// Object Lock on a bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BucketLock {
    /// The bucket was created without Object Lock (it cannot be turned on later).
    Disabled,
    /// Object Lock is on; `default` is the retention new versions get, if one is set.
    Enabled { default: Option<DefaultRetention> },
}

/// The retention one object version carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ObjectRetention {
    pub mode: RetentionMode,
    pub retain_until: SystemTime,
}

fn to_system_time(t: &aws_smithy_types::DateTime) -> Option<SystemTime> {
    SystemTime::try_from(*t).ok()
}

impl S3Tier {
    /// Whether the tier's bucket has Object Lock on, and its default retention.
    pub async fn bucket_lock(&self) -> Result<BucketLock, TransferError> {
        let _slot = self.request_slot().await;
        let answer = self
            .client()
            .get_object_lock_configuration()
            .bucket(self.bucket())
            .send()
            .await;
        let config = match answer {
            Ok(out) => out.object_lock_configuration().cloned(),
            Err(err) => {
                // "Not configured" is an answer; a missing bucket is an error.
                let code = err.as_service_error().and_then(|e| e.code()).unwrap_or("");
                if code == "ObjectLockConfigurationNotFoundError" {
                    return Ok(BucketLock::Disabled);
                }
                return Err(map_sdk_error(
                    "GetObjectLockConfiguration",
                    self.site(Side::Destination, ""),
                    err,
                ));
            }
        };
        let Some(config) = config else {
            return Ok(BucketLock::Disabled);
        };
        if config.object_lock_enabled() != Some(&ObjectLockEnabled::Enabled) {
            return Ok(BucketLock::Disabled);
        }
        let default = config
            .rule()
            .and_then(|r| r.default_retention())
            .and_then(|d| {
                let mode = RetentionMode::from_sdk(d.mode()?)?;
                let days = match (d.days(), d.years()) {
                    (Some(days), _) => days,
                    (None, Some(years)) => years.saturating_mul(365),
                    (None, None) => return None,
                };
                Some(DefaultRetention {
                    mode,
                    days: u32::try_from(days).ok()?,
                })
            });
        Ok(BucketLock::Enabled { default })
    }

    /// Sets the bucket's default retention (Object Lock must be on): every object version
    /// written from now on is held `days` in `mode`. Needs the right to change the bucket's
    /// Object Lock configuration.
    pub async fn set_default_retention(
        &self,
        retention: DefaultRetention,
    ) -> Result<(), TransferError> {
        let days = i32::try_from(retention.days).map_err(|_| {
            TransferError::new(
                ErrorKind::Config,
                Side::Destination,
                self.name(),
                "",
                format!("{} days of retention is too long", retention.days),
            )
        })?;
        let config = ObjectLockConfiguration::builder()
            .object_lock_enabled(ObjectLockEnabled::Enabled)
            .rule(
                ObjectLockRule::builder()
                    .default_retention(
                        SdkDefaultRetention::builder()
                            .mode(retention.mode.sdk())
                            .days(days)
                            .build(),
                    )
                    .build(),
            )
            .build();
        let _slot = self.request_slot().await;
        self.client()
            .put_object_lock_configuration()
            .bucket(self.bucket())
            .object_lock_configuration(config)
            .send()
            .await
            .map(|_| ())
            .map_err(|err| {
                map_sdk_error(
                    "PutObjectLockConfiguration",
                    self.site(Side::Destination, ""),
                    err,
                )
            })
    }

    /// The retention the current version of the object at `rel` carries; `None` when it
    /// carries none (or the object is missing: [`ErrorKind::NotFound`]).
    pub async fn retention(&self, rel: &str) -> Result<Option<ObjectRetention>, TransferError> {
        let key = self.key_for(rel, Side::Destination)?;
        let _slot = self.request_slot().await;
        let head = self
            .client()
            .head_object()
            .bucket(self.bucket())
            .key(&key)
            .send()
            .await
            .map_err(|err| map_sdk_error("HeadObject", self.site(Side::Destination, rel), err))?;
        let mode = head.object_lock_mode().and_then(RetentionMode::from_object);
        let until = head
            .object_lock_retain_until_date()
            .and_then(to_system_time);
        Ok(match (mode, until) {
            (Some(mode), Some(retain_until)) => Some(ObjectRetention { mode, retain_until }),
            _ => None,
        })
    }
}
