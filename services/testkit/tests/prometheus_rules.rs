//! The shipped Prometheus files under `deploy/prometheus/` (issue 18 item 3): the config and
//! rules pass `promtool check`, the alerts' unit tests pass `promtool test rules`, every alert
//! names its runbook page, and the rules and the Grafana dashboard name only metrics Stagehand
//! exports (`stagehand_telemetry::names::ALL`) or series the recording rules define, in
//! queries Prometheus parses.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_yaml_ng::Value;
use stagehand_telemetry::names;
use stagehand_testkit::{promtool_binary, repo_root};

fn dir() -> PathBuf {
    repo_root().join("deploy/prometheus")
}

fn promtool(args: &[&str], cwd: &Path) -> String {
    let out = Command::new(promtool_binary())
        .args(args)
        .current_dir(cwd)
        .output()
        .expect("run promtool");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?}:\n{text}");
    text
}

fn yaml(name: &str) -> Value {
    let text = std::fs::read_to_string(dir().join(name)).unwrap();
    serde_yaml_ng::from_str(&text).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// Every rule of a rules file.
fn rules(name: &str) -> Vec<Value> {
    yaml(name)["groups"]
        .as_sequence()
        .unwrap_or_else(|| panic!("{name}: no groups"))
        .iter()
        .flat_map(|g| g["rules"].as_sequence().cloned().unwrap_or_default())
        .collect()
}

fn text(v: &Value) -> &str {
    v.as_str().unwrap_or_default()
}

/// The names of series a query reads: identifiers that start with `stagehand_` or
/// `stagehand:` (label values such as `job="stagehand"` are skipped with the quotes).
fn series_named(expr: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    let mut in_quote = false;
    let mut word = String::new();
    for c in expr.chars().chain(std::iter::once(' ')) {
        if c == '"' {
            in_quote = !in_quote;
        }
        if !in_quote && (c.is_ascii_alphanumeric() || c == '_' || c == ':') {
            word.push(c);
            continue;
        }
        if word.starts_with("stagehand_") || word.starts_with("stagehand:") {
            found.insert(word.clone());
        }
        word.clear();
    }
    found
}

/// Whether `series` is exported by a service: a name of [`names::ALL`], or a histogram's
/// `_bucket`, `_count` or `_sum` series.
fn exported(series: &str) -> bool {
    names::ALL.contains(&series)
        || ["_bucket", "_count", "_sum"].iter().any(|suffix| {
            series
                .strip_suffix(suffix)
                .is_some_and(|base| names::ALL.contains(&base))
        })
}

fn recorded() -> BTreeSet<String> {
    rules("recording.rules.yml")
        .iter()
        .map(|r| text(&r["record"]).to_owned())
        .collect()
}

/// Every query of the dashboard: (panel title, expression).
fn dashboard_queries() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(dir().join("dashboard.json")).unwrap();
    let dash: serde_json::Value = serde_json::from_str(&text).expect("dashboard.json parses");
    let panels = dash["panels"].as_array().expect("dashboard panels");
    assert!(!panels.is_empty());
    panels
        .iter()
        .flat_map(|p| {
            let title = p["title"].as_str().unwrap_or_default().to_owned();
            p["targets"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .into_iter()
                .map(move |t| (title.clone(), t["expr"].as_str().unwrap_or("").to_owned()))
        })
        .collect()
}

#[test]
fn the_shipped_config_and_rules_pass_promtool_check() {
    let out = promtool(&["check", "config", "prometheus.yml"], &dir());
    assert!(out.contains("2 rule files found"), "{out}");
}

#[test]
fn the_alert_unit_tests_pass() {
    promtool(&["test", "rules", "alerts.test.yml"], &dir());
}

#[test]
fn every_alert_is_unit_tested_and_names_its_runbook_page() {
    let alerts = rules("alerts.rules.yml");
    let names: BTreeSet<&str> = alerts.iter().map(|a| text(&a["alert"])).collect();
    for wanted in [
        "StagehandStageStuck",
        "StagehandDeadLettersWaiting",
        "StagehandBacklogGrowing",
        "StagehandServiceSilent",
        "StagehandTierAboveWatermark",
        "StagehandQuotaNearlyFull",
        "StagehandDrillFailed",
        "StagehandDrillOverdue",
        "StagehandScrubBehind",
    ] {
        assert!(names.contains(wanted), "{wanted} missing: {names:?}");
    }
    let tests = std::fs::read_to_string(dir().join("alerts.test.yml")).unwrap();
    for alert in &alerts {
        let name = text(&alert["alert"]);
        assert!(
            tests.contains(&format!("alertname: {name}\n")),
            "{name} has no unit test in alerts.test.yml"
        );
        let url = text(&alert["annotations"]["runbook_url"]);
        let page = url
            .strip_prefix("runbooks/")
            .and_then(|p| p.strip_suffix(".md"))
            .unwrap_or_else(|| panic!("{name}: runbook_url {url:?} is no runbooks/<page>.md"));
        assert!(
            !page.is_empty()
                && page
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'),
            "{name}: runbook page {page:?}"
        );
        assert!(
            ["page", "ticket"].contains(&text(&alert["labels"]["severity"])),
            "{name}: severity"
        );
        assert!(!text(&alert["annotations"]["summary"]).is_empty(), "{name}");
    }
}

#[test]
fn rules_and_dashboard_name_only_metrics_that_exist() {
    let recorded = recorded();
    let mut exprs: Vec<(String, String)> = rules("recording.rules.yml")
        .into_iter()
        .chain(rules("alerts.rules.yml"))
        .map(|r| {
            let what = format!("{}{}", text(&r["record"]), text(&r["alert"]));
            (what, text(&r["expr"]).to_owned())
        })
        .collect();
    exprs.extend(dashboard_queries());
    let mut unknown = Vec::new();
    for (what, expr) in &exprs {
        assert!(!expr.trim().is_empty(), "{what}: an empty query");
        for series in series_named(expr) {
            if !exported(&series) && !recorded.contains(&series) {
                unknown.push(format!("{what}: {series}"));
            }
        }
    }
    assert!(unknown.is_empty(), "series nothing exports: {unknown:#?}");
    // The check itself: a name no service exports is caught.
    assert!(!exported("stagehand_scrub_behind_seconds"));
    assert!(exported("stagehand_stage_ready_seconds_bucket"));
}

#[test]
fn every_dashboard_query_parses() {
    // promtool parses a query only inside a rule: each becomes a recording rule of its own.
    let mut file = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, (_, expr)) in dashboard_queries().iter().enumerate() {
        let quoted = serde_json::to_string(expr).unwrap();
        file.push_str(&format!(
            "      - record: dashboard:query_{i}\n        expr: {quoted}\n"
        ));
    }
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("dashboard.rules.yml"), file).unwrap();
    let out = promtool(&["check", "rules", "dashboard.rules.yml"], tmp.path());
    assert!(out.contains("SUCCESS"), "{out}");
}
