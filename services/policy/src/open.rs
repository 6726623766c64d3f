//! Opening the tiers a service uses, at its start: one way for every service. The roots a
//! service alone fills are created, what dead writers left on the tiers it writes is swept
//! away before it writes there, and a tier that cannot be opened is named with its location.

use std::collections::HashMap;

use stagehand_mover::{PosixTier, Side, SweepOptions, Tier, TransferError};
use stagehand_schemas::Retryable;

use crate::{Policies, TierPolicy, TierRole};

/// What a service does to a tier it opens at start ([`TierPolicy::open_for`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Opening {
    /// Create a missing posix root rather than fail: only for a tier the service fills and
    /// is the one to create (the promoter's hot and local tiers, the backup tier), so that a
    /// filesystem that is not mounted is never filled beneath its mount point.
    pub create_root: bool,
    /// Sweep this prefix (`""`: the whole tier) of a posix tier: remove the temporaries of
    /// dead writers, and their staging folders once too old to be resumed
    /// (`PosixTier::sweep_stale`). For the tiers the service writes, so that a tier's usage
    /// never counts invisible garbage.
    pub sweep: Option<String>,
}

impl Opening {
    /// Opened as it is: a tier the service only reads.
    pub fn read() -> Self {
        Self::default()
    }

    /// Opened and swept as a whole: a tier the service writes.
    pub fn write() -> Self {
        Self::read().sweeping("")
    }

    /// Swept beneath `prefix` only (the validator's quarantine reports on a source tier).
    pub fn sweeping(mut self, prefix: &str) -> Self {
        self.sweep = Some(prefix.to_owned());
        self
    }

    /// With the posix root created when missing.
    pub fn creating_root(mut self) -> Self {
        self.create_root = true;
        self
    }
}

/// A tier a service needs could not be opened (or its root created) at start.
#[derive(Debug, thiserror::Error)]
#[error("cannot open tier {tier:?} at {location}: {source}")]
pub struct TierError {
    /// The tier's name in `tiers.toml`.
    pub tier: String,
    /// Its root or `s3://bucket/prefix`.
    pub location: String,
    #[source]
    pub source: Box<TransferError>,
}

impl TierError {
    /// `source` met opening `tier`.
    pub fn new(tier: &TierPolicy, source: TransferError) -> Self {
        TierError {
            tier: tier.name.clone(),
            location: tier.location(),
            source: Box::new(source),
        }
    }
}

impl Retryable for TierError {
    /// Whether opening it again unchanged can succeed (the mover's classification).
    fn is_retryable(&self) -> bool {
        self.source.is_retryable()
    }
}

impl TierPolicy {
    /// Opens the tier the way `opening` says. The sweep runs off the async runtime (it walks
    /// the tier); a sweep that fails is logged and the tier is opened all the same: garbage
    /// left for the next start is no reason not to serve.
    pub async fn open_for(&self, opening: &Opening) -> Result<Tier, TierError> {
        let tier = match opening.create_root {
            true => self.open_creating_root()?,
            false => self.open().map_err(|e| TierError::new(self, e))?,
        };
        if let (Tier::Posix(posix), Some(prefix)) = (&tier, &opening.sweep) {
            sweep_stale(posix, prefix).await;
        }
        Ok(tier)
    }
}

impl TierPolicy {
    /// Opens the tier, its posix root created first if missing (see
    /// [`Opening::create_root`]); no sweep.
    pub fn open_creating_root(&self) -> Result<Tier, TierError> {
        self.create_root().map_err(|e| {
            let what = "creating the root";
            TierError::new(
                self,
                TransferError::from_io(e, Side::Destination, &self.name, "", what),
            )
        })?;
        self.open().map_err(|e| TierError::new(self, e))
    }
}

/// Sweeps `prefix` of `tier` as a service does at start (see [`Opening::sweep`]), off the
/// async runtime; a failure is logged, not returned. For a posix folder that is not a
/// declared tier (the backup copier's scratch folder).
pub async fn sweep_stale(tier: &PosixTier, prefix: &str) {
    let (posix, at) = (tier.clone(), prefix.to_owned());
    let swept =
        tokio::task::spawn_blocking(move || posix.sweep_stale(&at, SweepOptions::default())).await;
    let error = match swept {
        Ok(Ok(report)) => {
            tracing::debug!(
                tier = tier.name(),
                prefix,
                ?report,
                "swept stale temporaries"
            );
            return;
        }
        Ok(Err(e)) => e.to_string(),
        Err(e) => e.to_string(),
    };
    tracing::warn!(tier = tier.name(), prefix, %error, "sweeping stale temporaries failed; left for the next start");
}

impl Policies {
    /// The declared tiers `how` gives an [`Opening`] for, opened; one that cannot be is
    /// logged and left out, and what needs it fails when it asks (the promoter's and the
    /// demoter's tiers: one unreachable tier must not stop the work on the others).
    pub async fn open_tiers(
        &self,
        how: impl Fn(&TierPolicy) -> Option<Opening>,
    ) -> HashMap<String, Tier> {
        let mut opened = HashMap::new();
        for (name, tier) in self.tiers() {
            let Some(opening) = how(tier) else { continue };
            match tier.open_for(&opening).await {
                Ok(t) => {
                    opened.insert(name.clone(), t);
                }
                Err(e) => {
                    tracing::warn!(tier = %name, error = %e, "tier not opened; work that needs it fails")
                }
            }
        }
        opened
    }

    /// Every declared tier's role, with the `source` tiers opened the way `opening` says: what
    /// a service reading uploads needs (the ingest validator, the resharder). A source tier
    /// that cannot be opened is an error: there would be nothing to read.
    pub async fn open_sources(
        &self,
        opening: &Opening,
    ) -> Result<HashMap<String, (TierRole, Option<Tier>)>, TierError> {
        let mut tiers = HashMap::new();
        for (name, tier) in self.tiers() {
            let opened = match tier.role {
                TierRole::Source => Some(tier.open_for(opening).await?),
                _ => None,
            };
            tiers.insert(name.clone(), (tier.role, opened));
        }
        Ok(tiers)
    }
}
