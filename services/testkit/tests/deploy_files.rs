//! Every configuration file under `deploy/` is checked: the NATS configs parse with the server
//! that runs them, every service configuration under `deploy/config/` parses and validates as
//! its service reads it and binds its metrics to a port of its own (every service may run on
//! one host), and the systemd units name binaries this workspace builds with a shipped
//! configuration file.

use std::path::PathBuf;
use std::process::Command;

use stagehand_testkit::{TestCa, accounts_roles, nats_server_binary, repo_root};

fn files(dir: &str, suffix: &str) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(repo_root().join(dir))
        .unwrap_or_else(|e| panic!("read {dir}: {e}"))
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.to_string_lossy().ends_with(suffix))
        .collect();
    found.sort();
    found
}

/// The password variables accounts.conf reads.
fn password_vars() -> Vec<String> {
    accounts_roles()
        .iter()
        .map(|role| format!("STAGEHAND_NATS_{role}_PASSWORD"))
        .collect()
}

/// `nats-server -t` of a shipped config, its TLS certificates a test CA's (the shipped ones
/// live in /etc/stagehand/nats, which the server opens to check them).
fn check_config(path: &PathBuf, vars: &[String]) -> std::process::Output {
    let ca = TestCa::new("Stagehand deploy-files CA");
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    let text = std::fs::read_to_string(path).expect("read a shipped config");
    let text = if text.contains(stagehand_testkit::DEPLOY_TLS_DIR) {
        ca.shipped_nats_config(&name)
    } else {
        text
    };
    let copy = ca.dir().join(&name);
    std::fs::write(&copy, text).expect("write the config under test");
    let mut cmd = Command::new(nats_server_binary());
    cmd.arg("-t").arg("-c").arg(&copy);
    for v in vars {
        cmd.env(v, "test-password");
    }
    cmd.output().expect("run nats-server -t")
}

#[test]
fn every_nats_config_is_valid() {
    let confs = files("deploy/nats", ".conf");
    let names: Vec<_> = confs
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    for wanted in [
        "accounts.conf",
        "single.conf",
        "cluster-1.conf",
        "cluster-2.conf",
        "cluster-3.conf",
    ] {
        assert!(
            names.iter().any(|n| n == wanted),
            "deploy/nats/{wanted} missing: {names:?}"
        );
    }
    let vars = password_vars();
    assert_eq!(vars.len(), 13, "{vars:?}");
    for conf in &confs {
        let out = check_config(conf, &vars);
        assert!(
            out.status.success(),
            "{}: {}{}",
            conf.display(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn a_missing_password_variable_stops_the_server() {
    let vars = password_vars();
    let (missing, rest) = vars.split_first().unwrap();
    let out = check_config(&repo_root().join("deploy/nats/single.conf"), rest);
    assert!(!out.status.success());
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(said.contains(missing.as_str()), "{said}");
}

/// Parses one service configuration the way the service's binary does (unknown keys refused,
/// every table validated); no `STAGEHAND_NATS_*` variables apply. Returns where it serves
/// its metrics.
type Check = fn(&std::path::Path, &str) -> Result<Option<std::net::SocketAddr>, String>;

fn check<S: stagehand_bus::runner::ServiceSettings>(
    path: &std::path::Path,
    text: &str,
) -> Result<Option<std::net::SocketAddr>, String> {
    stagehand_bus::runner::ServiceConfig::<S>::parse(path, text, |_| None)
        .map(|config| config.telemetry.metrics_listen)
        .map_err(|e| e.to_string())
}

/// Every service whose configuration `deploy/config/` ships: `<service>.toml`.
const SERVICE_CONFIGS: &[(&str, Check)] = &[
    (
        stagehand_ingest_validator::SERVICE,
        check::<stagehand_ingest_validator::Settings>,
    ),
    (
        stagehand_backup_copier::SERVICE,
        check::<stagehand_backup_copier::Settings>,
    ),
    (
        stagehand_catalogue_recorder::SERVICE,
        check::<stagehand_catalogue_recorder::Settings>,
    ),
    (
        stagehand_resharder::SERVICE,
        check::<stagehand_resharder::Settings>,
    ),
    (
        stagehand_promoter::SERVICE,
        check::<stagehand_promoter::Settings>,
    ),
    (
        stagehand_demoter::SERVICE,
        check::<stagehand_demoter::Settings>,
    ),
];

#[test]
fn every_service_config_parses_and_validates() {
    let shipped = files("deploy/config", ".toml");
    let names: Vec<String> = shipped
        .iter()
        .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    for (service, _) in SERVICE_CONFIGS {
        assert!(
            names.iter().any(|n| n == service),
            "deploy/config/{service}.toml missing: {names:?}"
        );
    }
    for (path, name) in shipped.iter().zip(&names) {
        let (_, check) = SERVICE_CONFIGS
            .iter()
            .find(|(service, _)| service == name)
            .unwrap_or_else(|| panic!("{}: no service of that name", path.display()));
        let text = std::fs::read_to_string(path).unwrap();
        check(path, &text).unwrap_or_else(|e| panic!("{e}"));
        // A key the service does not know is refused, naming the file and the key.
        let wrong = text.replacen("[bus]\n", "[bus]\ncolour = \"red\"\n", 1);
        let err = check(path, &wrong).unwrap_err();
        assert!(
            err.contains(&path.display().to_string()) && err.contains("`bus.colour`"),
            "{err}"
        );
    }
}

/// `[telemetry] metrics_listen` of one shipped service configuration, read as its service
/// reads it.
fn metrics_listen(path: &std::path::Path) -> std::net::SocketAddr {
    let service = path.file_stem().unwrap().to_string_lossy();
    let (_, check) = SERVICE_CONFIGS
        .iter()
        .find(|(name, _)| *name == service)
        .unwrap_or_else(|| panic!("{}: no service of that name", path.display()));
    let text = std::fs::read_to_string(path).unwrap();
    check(path, &text)
        .unwrap_or_else(|e| panic!("{e}"))
        .unwrap_or_else(|| panic!("{}: no [telemetry] metrics_listen", path.display()))
}

/// On one host every service runs beside the others (the systemd units): two that bind the
/// same metrics port leave the second one exiting 78, which systemd does not restart.
#[test]
fn every_service_config_binds_its_own_metrics_port() {
    let mut seen: Vec<(u16, PathBuf)> = Vec::new();
    for path in files("deploy/config", ".toml") {
        let port = metrics_listen(&path).port();
        assert_ne!(
            port,
            0,
            "{}: a fixed port, for Prometheus to find",
            path.display()
        );
        if let Some((_, other)) = seen.iter().find(|(p, _)| *p == port) {
            panic!(
                "{} and {} both bind metrics port {port}",
                other.display(),
                path.display()
            );
        }
        seen.push((port, path));
    }
    assert_eq!(seen.len(), SERVICE_CONFIGS.len(), "{seen:?}");
}

#[test]
fn systemd_units_run_binaries_of_this_workspace() {
    let units = files("deploy/systemd", ".service");
    assert!(units.len() >= 3, "{units:?}");
    for unit in units {
        let text = std::fs::read_to_string(&unit).unwrap();
        for section in ["[Unit]", "[Service]", "[Install]"] {
            assert!(text.contains(section), "{}: no {section}", unit.display());
        }
        let exec = text
            .lines()
            .find_map(|l| l.strip_prefix("ExecStart="))
            .unwrap_or_else(|| panic!("{}: no ExecStart", unit.display()));
        let program = exec.split_whitespace().next().unwrap();
        let name = program.rsplit('/').next().unwrap();
        if name == "nats-server" {
            let conf = exec.split_whitespace().last().unwrap();
            let conf_name = conf.rsplit('/').next().unwrap();
            assert!(
                repo_root().join("deploy/nats").join(conf_name).is_file(),
                "{}: {conf} is not a shipped config",
                unit.display()
            );
            continue;
        }
        if name == "stagehand" {
            // A periodic CLI run (the stage reconciler): a oneshot started by its timer.
            let cli = std::fs::read_to_string(repo_root().join("services/cli/Cargo.toml")).unwrap();
            assert!(cli.contains("name = \"stagehand\""), "{}", unit.display());
            assert!(
                text.contains("Type=oneshot")
                    && unit.with_extension("timer").is_file()
                    && exec.split_whitespace().nth(1).is_some(),
                "{}: a CLI unit is a oneshot with a timer beside it and a verb",
                unit.display()
            );
            continue;
        }
        let crate_dir = repo_root()
            .join("services")
            .join(name.strip_prefix("stagehand-").unwrap_or(name));
        let manifest = std::fs::read_to_string(crate_dir.join("Cargo.toml"))
            .unwrap_or_else(|e| panic!("{}: no crate for {name}: {e}", unit.display()));
        assert!(
            manifest.contains(&format!("name = \"{name}\""))
                && crate_dir.join("src/main.rs").is_file(),
            "{}: {name} is not a binary of services/",
            unit.display()
        );
        // A service reads its configuration file, one deploy/config/ ships.
        let args: Vec<&str> = exec.split_whitespace().collect();
        let config = args
            .windows(2)
            .find(|w| w[0] == "--config")
            .map(|w| w[1])
            .unwrap_or_else(|| panic!("{}: {name} without --config", unit.display()));
        let service = name.strip_prefix("stagehand-").unwrap_or(name);
        assert_eq!(
            config.rsplit('/').next(),
            Some(format!("{service}.toml").as_str()),
            "{}: {config}",
            unit.display()
        );
        assert!(
            repo_root()
                .join("deploy/config")
                .join(format!("{service}.toml"))
                .is_file(),
            "{}: deploy/config/{service}.toml is not shipped",
            unit.display()
        );
        // The header tells the operator where Prometheus finds the service: the config's port.
        let shipped = repo_root()
            .join("deploy/config")
            .join(format!("{service}.toml"));
        let said = text
            .lines()
            .find_map(|l| l.split_once("metrics_listen (").map(|(_, rest)| rest))
            .and_then(|rest| rest.split_whitespace().next())
            .unwrap_or_else(|| panic!("{}: the header names no metrics address", unit.display()));
        assert_eq!(
            said,
            metrics_listen(&shipped).to_string(),
            "{}: the header's metrics address is not {}'s",
            unit.display(),
            shipped.display()
        );
        assert!(
            text.contains("RestartPreventExitStatus=78"),
            "{}: a configuration error (exit 78) must not be restarted in a loop",
            unit.display()
        );
    }
}

/// `deploy/prometheus/prometheus.yml` scrapes exactly the metrics ports the shipped service
/// configurations bind: a service added or moved without its scrape target would go unwatched.
#[test]
fn the_shipped_prometheus_config_scrapes_every_service() {
    let path = repo_root().join("deploy/prometheus/prometheus.yml");
    let text = std::fs::read_to_string(&path).unwrap();
    let config: serde_yaml_ng::Value = serde_yaml_ng::from_str(&text).unwrap();
    let jobs = config["scrape_configs"].as_sequence().unwrap();
    let job = jobs
        .iter()
        .find(|j| j["job_name"] == "stagehand")
        .unwrap_or_else(|| panic!("{}: no job stagehand", path.display()));
    let mut scraped: Vec<String> = job["static_configs"]
        .as_sequence()
        .unwrap()
        .iter()
        .flat_map(|c| c["targets"].as_sequence().cloned().unwrap_or_default())
        .map(|t| t.as_str().unwrap().to_owned())
        .collect();
    scraped.sort();
    let mut bound: Vec<String> = files("deploy/config", ".toml")
        .iter()
        .map(|p| metrics_listen(p).to_string())
        .collect();
    bound.sort();
    assert_eq!(scraped, bound, "{}", path.display());
}
