//! The resharder as a worker-runtime handler: one `dataset.validated` in, nothing (not
//! selected) or one `dataset.prepared` out.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use async_nats::jetstream;
use stagehand_bus::runner::{self, ServiceError};
use stagehand_bus::{Bus, Handler, HandlerError, WorkContext};
use stagehand_manifest::{
    BucketOptions, ManifestBuilder, ManifestError, ManifestSource, ManifestStore, Spool,
    inline_or_stored,
};
use stagehand_mover::{
    CancellationToken, EngineChoice, Mover, MoverConfig, Progress, RateLimiter, SetCopy, StagedSet,
    Tier,
};
use stagehand_policy::{
    IncompletePolicy, Opening, Packing, PackingPolicy, Policies, TierError, TierRole,
};
use stagehand_schemas::pieces::PieceHashes;
use stagehand_schemas::{
    Body, DatasetPrepared, DatasetValidated, Event, EventId, FileRef, Location, layout,
};
use tracing::{info, warn};

use crate::derive::{DeriveError, Job, Tuning, derive};
use crate::shard::ShardError;
use crate::{ReshardError, Settings};

/// The fact-id step of `dataset.prepared` (see `stagehand_schemas::id`).
pub const STEP_PREPARED: &str = "prepared";

/// Where the full list of problems of an aborted derivation goes, beneath the target tier's
/// root (the dead letter names it).
pub fn problem_report_path(project: &str, event: &EventId) -> String {
    format!(".stagehand/resharder/{project}/{event}.problems.jsonl")
}

/// Side data (a shard's SHA-256 and piece hashes) handed from the derivation and waiting to be
/// stored, at most: a few KiB each.
const SIDE_DATA_QUEUE: usize = 16;

/// Stores the side data of the shards as the derivation commits them, until it ends. On a
/// failure the derivation is stopped (its next hand-over fails, and `cancel` stops the rest)
/// and the failure is returned: a retryable one, as NATS failures are.
async fn store_pieces(
    store: &ManifestStore,
    mut pieces: tokio::sync::mpsc::Receiver<(String, PieceHashes)>,
    cancel: &CancellationToken,
) -> Result<(), ManifestError> {
    while let Some((sha256, hashes)) = pieces.recv().await {
        if let Err(e) = store.put_pieces(&sha256, &hashes).await {
            pieces.close();
            cancel.cancel();
            return Err(e);
        }
    }
    Ok(())
}

/// Packs validated versions the packing policy selects.
pub struct Resharder {
    packing: PackingPolicy,
    /// Every declared tier's role, and the opened tier for source tiers.
    sources: HashMap<String, (TierRole, Option<Tier>)>,
    target: Tier,
    mover: Mover,
    js: jetstream::Context,
    replicas: usize,
    tuning: Tuning,
    spool: Spool,
    /// Where raw versions on S3 source tiers are fetched to (see [`crate::fetch`]).
    fetch_root: std::path::PathBuf,
    /// Derivations of the same set in this process run one after another (they would share
    /// one staging folder).
    busy: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl Resharder {
    /// Loads the policies, opens the source tiers and the target tier, and removes what
    /// killed writers left on the target tier (their staging folders stay for their retry).
    pub async fn open(settings: &Settings, bus: &Bus) -> Result<Resharder, ReshardError> {
        let policies = Policies::load_dir(&settings.policies_dir)?;
        let Some(packing) = policies.packing().cloned() else {
            return Err(policies.needed("packing.toml", crate::SERVICE).into());
        };
        let sources = policies.open_sources(&Opening::read()).await?;
        let Some(target_policy) = policies.tier(&packing.target_tier) else {
            // The policy crate checks that it is declared; this is its second line.
            return Err(ReshardError::Target {
                tier: packing.target_tier.clone(),
                reason: "is not declared in tiers.toml".into(),
            });
        };
        let target = match target_policy.open_for(&Opening::write()).await? {
            Tier::Posix(p) => p,
            Tier::S3(_) => {
                return Err(ReshardError::Target {
                    tier: packing.target_tier.clone(),
                    reason: "is an s3 tier; the resharder writes shards to posix tiers only (copy them to S3 afterwards with the mover)".into(),
                });
            }
        };
        runner::create_state_dirs([settings.state_dir.as_path(), &settings.spool_dir()])?;
        // Versions a killed run was fetching from S3 are fetched afresh.
        let fetch_root = crate::fetch::fetch_root(&settings.spool_dir());
        match std::fs::remove_dir_all(&fetch_root) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(ServiceError::StateDir {
                    path: fetch_root,
                    source,
                }
                .into());
            }
        }
        let mover = Mover::new(MoverConfig {
            // Only the set's staging and publishing run through the mover; the shards are
            // written by the derivation's own threads.
            engine: EngineChoice::Pread,
            pread_threads: 1,
            hash_threads: 1,
            ..MoverConfig::default()
        })
        .map_err(|e| TierError::new(target_policy, e))?;
        let tuning = Tuning {
            read_threads: settings.read_threads,
            batch_bytes: settings.batch_bytes.bytes(),
            window: 2 * settings.read_threads + 2,
            stream_above: settings.stream_above.bytes(),
            sort_run_bytes: usize::try_from(settings.sort_memory.bytes()).unwrap_or(usize::MAX),
            spool_dir: settings.spool_dir(),
            limiter: settings
                .max_read_bytes_per_sec
                .map(|b| Arc::new(RateLimiter::new(b.bytes()))),
        };
        info!(
            enabled = packing.enabled,
            min_files = packing.min_files,
            target = %packing.target_tier,
            target_root = %target.root().display(),
            "resharder ready"
        );
        Ok(Resharder {
            packing,
            sources,
            target: Tier::Posix(target),
            mover,
            js: bus.jetstream().clone(),
            replicas: bus.replicas(),
            tuning,
            spool: Spool::in_dir(settings.spool_dir()),
            fetch_root,
            busy: Mutex::new(HashMap::new()),
        })
    }

    /// The raw version's source tier.
    fn source(&self, location: &Location) -> Result<&Tier, HandlerError> {
        match self.sources.get(&location.tier) {
            Some((TierRole::Source, Some(tier))) => Ok(tier),
            Some((role, _)) => Err(HandlerError::permanent(format!(
                "the raw version names tier {:?}, whose role is {}, not source",
                location.tier,
                role.as_str()
            ))),
            None => Err(HandlerError::permanent(format!(
                "the raw version names tier {:?}, which tiers.toml does not declare",
                location.tier
            ))),
        }
    }

    fn lock_for(&self, key: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut busy = self.busy.lock().unwrap_or_else(|p| p.into_inner());
        busy.retain(|_, lock| Arc::strong_count(lock) > 1);
        busy.entry(key.to_owned()).or_default().clone()
    }

    /// Creates the staging folder of a set, clearing what a dead run left in it first.
    async fn stage(&self, prefix: &str) -> Result<StagedSet, HandlerError> {
        let set = SetCopy {
            src_prefix: String::new(),
            dst_prefix: prefix.to_owned(),
            ..SetCopy::default()
        };
        let progress = Progress::new();
        let cancel = CancellationToken::new();
        for _ in 0..2 {
            let staged = self
                .mover
                .stage_set(
                    &self.target,
                    &self.target,
                    &set,
                    futures::stream::empty(),
                    &progress,
                    &cancel,
                    |_| {},
                )
                .await
                .map_err(HandlerError::from)?;
            if !staged.report().resumed {
                return Ok(staged);
            }
            // The shards a dead run left are not trusted to be this run's: derive afresh.
            let removed = staged.abandon().await.map_err(HandlerError::from)?;
            info!(
                prefix,
                files = removed.files_removed,
                "cleared the staging folder a killed derivation left"
            );
        }
        Err(HandlerError::retryable(format!(
            "the staging folder of {prefix} kept being taken over"
        )))
    }

    /// Packs the version, or says why it is not packed.
    async fn prepare(
        &self,
        event: &Event,
        v: &DatasetValidated,
        packing: Packing,
        ctx: &WorkContext,
    ) -> Result<Vec<Event>, HandlerError> {
        let source_tier = self.source(&v.source)?;
        let manifest = match ManifestSource::of(event).map_err(HandlerError::from)? {
            Some(m) => m
                .open(&self.js, &self.spool)
                .await
                .map_err(HandlerError::from)?,
            None => {
                return Err(HandlerError::permanent(
                    "dataset.validated carries no manifest",
                ));
            }
        };
        if manifest.digest() != v.version {
            return Err(HandlerError::permanent(format!(
                "the manifest's digest {} is not the version {} the fact names",
                manifest.digest(),
                v.version
            )));
        }
        let project = event.project.as_str();
        let staging = layout::prepare_folder(project, &v.dataset, &v.version, packing.seed);
        let lock = self.lock_for(&staging);
        let _guard = lock.lock().await;
        let cancel = ctx.shutdown().child_token();
        let (source, fetched) = match source_tier {
            Tier::Posix(p) => (
                p.beneath(&v.source.prefix, false)
                    .map_err(HandlerError::from)?,
                None,
            ),
            Tier::S3(_) => {
                let name = staging.replace('/', "-");
                let fetched = crate::fetch::fetch(
                    &self.mover,
                    source_tier,
                    &v.source.prefix,
                    &manifest,
                    &self.fetch_root,
                    &name,
                    &cancel,
                )
                .await?;
                (fetched.tier().clone(), Some(fetched))
            }
        };
        let staged = match self.stage(&staging).await {
            Ok(staged) => staged,
            Err(e) => {
                if let Some(fetched) = fetched {
                    fetched.remove().await;
                }
                return Err(e);
            }
        };
        let Some(Tier::Posix(stage_tier)) = staged.staging_tier().cloned() else {
            return Err(HandlerError::permanent(
                "the target tier gave no posix staging folder",
            ));
        };
        // The shard manifest goes there, and the side data of the shards as each is written.
        let store = match self.catalogue().await {
            Ok(store) => store,
            Err(e) => {
                if let Some(fetched) = fetched {
                    fetched.remove().await;
                }
                self.abandon(staged, &staging).await;
                return Err(HandlerError::from(e));
            }
        };
        let (pieces_tx, pieces_rx) = tokio::sync::mpsc::channel(SIDE_DATA_QUEUE);
        let derivation = {
            let (manifest, packing, tuning) =
                (manifest.clone(), packing.clone(), self.tuning.clone());
            let cancel = cancel.clone();
            let stop = cancel.clone().drop_guard();
            async move {
                // The handler's future dropped (a shutdown) stops the derivation.
                let _stop = stop;
                tokio::task::spawn_blocking(move || {
                    // The disk thread blocks here while the queue is full: the side data
                    // waiting to be stored stays bounded.
                    let keep_pieces = move |file: &FileRef, pieces: PieceHashes| {
                        pieces_tx
                            .blocking_send((file.sha256.clone(), pieces))
                            .map_err(|_| ShardError::SideData {
                                file: file.path.clone(),
                            })
                    };
                    derive(&Job {
                        source: &source,
                        staging: &stage_tier,
                        manifest: &manifest,
                        packing: &packing,
                        tuning: &tuning,
                        cancel: &cancel,
                        keep_pieces: &keep_pieces,
                    })
                })
                .await
                .unwrap_or_else(|e| {
                    Err(DeriveError::Internal(format!(
                        "the derivation panicked: {e}"
                    )))
                })
            }
        };
        let (result, stored) = tokio::join!(derivation, store_pieces(&store, pieces_rx, &cancel));
        if let Some(fetched) = fetched {
            fetched.remove().await;
        }
        let derived = match (result, stored) {
            (Ok(derived), Ok(())) => derived,
            // The derivation stopped because the side data could not be stored: that is why.
            (_, Err(e)) => {
                self.abandon(staged, &staging).await;
                warn!(event_id = %event.id, error = %e, "the side data of a shard could not be stored; the derivation will be retried");
                return Err(HandlerError::from(e));
            }
            (Err(e), Ok(())) => {
                self.abandon(staged, &staging).await;
                return Err(self.failed(event, e).await);
            }
        };

        // The derived version: its manifest's digest names it and its folder.
        let files = derived.files.clone();
        let spool = self.spool.clone();
        let built = tokio::task::spawn_blocking(move || {
            let mut builder = ManifestBuilder::new(&spool);
            for f in &files {
                builder.push(f)?;
            }
            builder.finish()
        })
        .await
        .map_err(|e| HandlerError::retryable(format!("building the shard manifest: {e}")))?
        .map_err(HandlerError::from)?;
        let version = built.digest().to_owned();
        let prefix = layout::version_folder(project, &v.dataset, &version);
        let report = staged
            .publish_as(&prefix)
            .await
            .map_err(HandlerError::from)?;
        let (inline, reference) = inline_or_stored(&built, &store)
            .await
            .map_err(HandlerError::from)?;
        info!(
            event_id = %event.id,
            dataset = %v.dataset,
            derived_from = %v.version,
            %version,
            shards = derived.shards,
            samples = derived.samples,
            members = derived.members,
            bytes = derived.member_bytes,
            incomplete = derived.incomplete,
            existed = report.existed,
            "prepared"
        );
        if derived.incomplete > 0 && packing.incomplete == IncompletePolicy::Warn {
            warn!(dataset = %v.dataset, %version, problems = derived.incomplete, "packed with incomplete samples; see incomplete.jsonl in the version");
        }
        Ok(vec![event.caused(
            STEP_PREPARED,
            Body::DatasetPrepared(DatasetPrepared {
                dataset: v.dataset.clone(),
                version,
                derived_from: v.version.clone(),
                location: Location {
                    tier: self.packing.target_tier.clone(),
                    prefix,
                },
                files: inline,
                manifest: reference,
                total_bytes: built.bytes(),
                layout: packing.layout.as_str().to_owned(),
                samples: derived.samples,
                seed: packing.seed,
            }),
        )])
    }

    /// The services' manifest bucket.
    async fn catalogue(&self) -> Result<ManifestStore, ManifestError> {
        ManifestStore::catalogue(
            &self.js,
            BucketOptions {
                replicas: self.replicas,
            },
        )
        .await
    }

    /// Removes the staging folder of a derivation that failed.
    async fn abandon(&self, staged: StagedSet, prefix: &str) {
        if let Err(cleanup) = staged.abandon().await {
            warn!(error = %cleanup, prefix, "could not remove the staging folder; the start-up sweep will");
        }
    }

    /// The handler error of a failed derivation; an aborted one first leaves its full
    /// problem list on the target tier.
    async fn failed(&self, event: &Event, e: DeriveError) -> HandlerError {
        let DeriveError::Incomplete { log } = e else {
            warn!(event_id = %event.id, error = %e, "derivation failed");
            return HandlerError::from(e);
        };
        let summary = log.summary();
        let rel = problem_report_path(&event.project, &event.id);
        let Tier::Posix(target) = &self.target else {
            return HandlerError::permanent(summary);
        };
        let target = target.clone();
        let at = format!("{}:{rel}", self.packing.target_tier);
        let written = tokio::task::spawn_blocking(move || -> Result<(), String> {
            let (mut file, len) = log.into_file().map_err(|e| e.to_string())?;
            let (parent, name) = rel.rsplit_once('/').expect("the report path has folders");
            let dir = target.beneath(parent, true).map_err(|e| e.to_string())?;
            // The report is no file of a version: it has no side data.
            match crate::shard::copy_file(&dir, name, &mut file, len, &|_, _| Ok(())) {
                Ok(_) => Ok(()),
                // The same event aborted before (a replay): the report is the same.
                Err(crate::shard::ShardError::Tier(t))
                    if t.kind == stagehand_mover::ErrorKind::DestinationConflict =>
                {
                    Ok(())
                }
                Err(e) => Err(e.to_string()),
            }
        })
        .await
        .unwrap_or_else(|e| Err(e.to_string()));
        let report = match written {
            Ok(()) => format!("every problem: {at}"),
            Err(e) => format!("the full list could not be written to {at}: {e}"),
        };
        warn!(event_id = %event.id, problems = %summary, %report, "derivation aborted: incomplete samples");
        HandlerError::permanent(format!(
            "incomplete samples under incomplete = \"abort\": {summary}; {report}"
        ))
    }
}

impl Handler for Resharder {
    async fn handle(&self, event: &Event, ctx: &WorkContext) -> Result<Vec<Event>, HandlerError> {
        let Body::DatasetValidated(v) = &event.body else {
            return Err(HandlerError::permanent(format!(
                "the resharder handles dataset.validated, not {}",
                event.kind()
            )));
        };
        let (files, bytes) = match &v.manifest {
            Some(m) => (m.files, m.bytes),
            None => (v.files.len() as u64, v.total_bytes),
        };
        match self
            .packing
            .packing_for(&event.project, &v.dataset, files, bytes)
        {
            // Boxed: the derivation's future is deep, and the runtime nests it further.
            Ok(packing) => Box::pin(self.prepare(event, v, packing, ctx)).await,
            Err(why) => {
                info!(event_id = %event.id, project = %event.project, dataset = %v.dataset, version = %v.version, reason = %why, "not packed");
                Ok(Vec::new())
            }
        }
    }
}
