//! S3 Object Lock on the backup bucket: made to hold what `backup.toml`'s `[object_lock]` asks
//! at start-up, and checked on what each backup wrote.
//!
//! The copier sets the bucket's *default retention* rather than a retention per object, so
//! every object version (files, manifest, completion marker) is locked by the server at the
//! moment it is written: there is no window in which a new backup object can be deleted.

use std::time::{Duration, SystemTime};

use stagehand_mover::s3::{BucketLock, DefaultRetention};
use stagehand_mover::{SET_COMPLETE_MARKER, Tier};
use stagehand_policy::ObjectLockPolicy;

use crate::copier::Copier;
use crate::error::BackupError;
use crate::layout::manifest_path;

/// Slack allowed between the retention asked for and the one found on an object, for clock
/// differences between this host and the server.
const CLOCK_SLACK: Duration = Duration::from_secs(3600);

impl Copier {
    /// Makes the S3 backup bucket give every new object the policy's retention: checks that
    /// Object Lock is on (it can only be chosen when the bucket is created) and sets the
    /// default retention when it differs. Nothing to do without `[object_lock]`.
    pub async fn ensure_object_lock(&self) -> Result<(), BackupError> {
        let Some(want) = self.policy.object_lock else {
            return Ok(());
        };
        let Tier::S3(s3) = &self.backup else {
            // The policy crate refuses [object_lock] on a posix tier.
            return Ok(());
        };
        let refuse = |detail: String| BackupError::ObjectLock {
            tier: self.target.name.clone(),
            detail,
        };
        let wanted = DefaultRetention {
            mode: want.mode,
            days: want.days,
        };
        match s3.bucket_lock().await? {
            BucketLock::Disabled => Err(refuse(format!(
                "bucket {:?} was created without Object Lock, which backup.toml's [object_lock] needs; it cannot be turned on for an existing bucket: create the bucket with Object Lock on (aws s3api create-bucket --object-lock-enabled-for-bucket) and point the tier at it",
                s3.bucket()
            ))),
            BucketLock::Enabled { default } if default == Some(wanted) => {
                tracing::info!(tier = %self.target.name, mode = %want.mode, days = want.days, "backup bucket holds every new object under Object Lock");
                Ok(())
            }
            BucketLock::Enabled { default } => {
                s3.set_default_retention(wanted).await.map_err(|e| {
                    refuse(format!(
                        "cannot set the bucket's default retention to {} for {} days (it is {default:?}): {e}",
                        want.mode, want.days
                    ))
                })?;
                tracing::info!(tier = %self.target.name, mode = %want.mode, days = want.days, was = ?default, "set the backup bucket's default Object Lock retention");
                Ok(())
            }
        }
    }

    /// Checks that the backup published at `set_prefix` is held: its completion marker and its
    /// manifest carry the policy's retention mode until at least `days` from now (less the
    /// clock slack). Nothing to check without `[object_lock]`.
    pub(crate) async fn check_locked(&self, set_prefix: &str) -> Result<(), BackupError> {
        let (Some(want), Tier::S3(s3)) = (self.policy.object_lock, &self.backup) else {
            return Ok(());
        };
        for rel in [
            format!("{set_prefix}/{SET_COMPLETE_MARKER}"),
            manifest_path(set_prefix),
        ] {
            let held = s3.retention(&rel).await?;
            check_held(&rel, held, want, SystemTime::now()).map_err(|detail| {
                BackupError::ObjectLock {
                    tier: self.target.name.clone(),
                    detail,
                }
            })?;
        }
        Ok(())
    }
}

/// Whether `held` is the retention `want` asks for of an object written just before `now`.
fn check_held(
    rel: &str,
    held: Option<stagehand_mover::s3::ObjectRetention>,
    want: ObjectLockPolicy,
    now: SystemTime,
) -> Result<(), String> {
    let Some(held) = held else {
        return Err(format!(
            "{rel} carries no Object Lock retention: the bucket's default retention was removed since start-up"
        ));
    };
    let until = now + Duration::from_secs(u64::from(want.days) * 86_400) - CLOCK_SLACK;
    if held.mode != want.mode || held.retain_until < until {
        return Err(format!(
            "{rel} is held in {} mode until {:?}; backup.toml asks for {} for {} days",
            held.mode, held.retain_until, want.mode, want.days
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use stagehand_mover::s3::{ObjectRetention, RetentionMode};

    use super::*;

    #[test]
    fn a_hold_shorter_or_weaker_than_asked_is_refused() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000_000);
        let want = ObjectLockPolicy {
            mode: RetentionMode::Compliance,
            days: 30,
        };
        let held = |mode, days: u64| {
            Some(ObjectRetention {
                mode,
                retain_until: now + Duration::from_secs(days * 86_400),
            })
        };
        assert!(check_held("m", held(RetentionMode::Compliance, 30), want, now).is_ok());
        assert!(check_held("m", held(RetentionMode::Governance, 30), want, now).is_err());
        assert!(check_held("m", held(RetentionMode::Compliance, 29), want, now).is_err());
        assert!(check_held("m", None, want, now).is_err());
    }
}
