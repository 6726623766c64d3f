//! Kubernetes scheduling gates: a pod created with the gate `stagehand.io/<dataset>` in
//! `spec.schedulingGates` is not scheduled until the gate is removed (gates are GA since
//! Kubernetes 1.30; set at creation, removable only). `stagehand k8s gates` asks for each gated
//! pod's stage and removes the gate once the stage is ready, so the pod holds no node while its
//! data is copied; a failed stage keeps the gate and writes the reason into the pod's annotation
//! [`FAILED_ANNOTATION`].
//!
//! This module decides, from the pods and the stages' status (what `stagehand stage wait`
//! reads: [`crate::stage::wait`]); the API server is talked to by [`crate::kube`]. A pod names
//! its stage as the init-container pattern does (`deploy/k8s/stage-pod.yaml`): annotations
//! `stagehand.io/project`, `stagehand.io/dataset`, `stagehand.io/version`, `stagehand.io/tier`
//! and optionally `stagehand.io/hold`; the gate's name after the prefix is the dataset, and the
//! pod's uid is the job id the stage's ids derive from (the same request an init container of
//! that pod would make). Only shared tiers: a gated pod has no node yet.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{Value, json};

use crate::stage::{RequestOptions, Stage, WaitOutcome};

/// The prefix of Stagehand's gates; the rest of the gate's name is the dataset.
pub const GATE_PREFIX: &str = "stagehand.io/";

/// The annotation a failed stage's reason is written to (the gate stays).
pub const FAILED_ANNOTATION: &str = "stagehand.io/stage-failed";

/// The annotation the path of a ready dataset is written to: `stagehand.io/path.<dataset>`.
pub fn path_annotation(dataset: &str) -> String {
    format!("stagehand.io/path.{dataset}")
}

/// The label a gated pod carries so the controller lists only such pods (a label selector; no
/// field selector reaches `spec.schedulingGates`).
pub const GATED_LABEL: &str = "stagehand.io/gated";

/// A pod as the controller sees it: who it is, its annotations and its scheduling gates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatedPod {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub annotations: BTreeMap<String, String>,
    /// `spec.schedulingGates[*].name`, in order (a JSON patch names a gate by its index).
    pub gates: Vec<String>,
}

impl GatedPod {
    /// The pod of an API server's Pod object; `None` when it lacks a namespace, name or uid.
    pub fn from_api(pod: &Value) -> Option<GatedPod> {
        let meta = pod.get("metadata")?;
        let text = |v: &Value, k: &str| v.get(k).and_then(Value::as_str).map(str::to_owned);
        let annotations = meta
            .get("annotations")
            .and_then(Value::as_object)
            .map(|m| {
                m.iter()
                    .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned())))
                    .collect()
            })
            .unwrap_or_default();
        let gates = pod
            .pointer("/spec/schedulingGates")
            .and_then(Value::as_array)
            .map(|gates| gates.iter().filter_map(|g| text(g, "name")).collect())
            .unwrap_or_default();
        Some(GatedPod {
            namespace: text(meta, "namespace")?,
            name: text(meta, "name")?,
            uid: text(meta, "uid")?,
            annotations,
            gates,
        })
    }

    /// The pod's Stagehand gates.
    pub fn stagehand_gates(&self) -> impl Iterator<Item = &str> {
        self.gates
            .iter()
            .map(String::as_str)
            .filter(|g| g.starts_with(GATE_PREFIX))
    }

    fn annotation(&self, key: &str) -> Result<&str, String> {
        self.annotations
            .get(key)
            .map(String::as_str)
            .filter(|v| !v.is_empty())
            .ok_or_else(|| format!("annotation {key} is missing"))
    }

    /// The stage `gate` waits for, or what is wrong with the pod's annotations.
    pub fn stage_for(&self, gate: &str) -> Result<Stage, String> {
        let dataset = gate.strip_prefix(GATE_PREFIX).unwrap_or(gate);
        let named = self.annotation("stagehand.io/dataset")?;
        if named != dataset {
            return Err(format!(
                "gate {gate} names dataset {dataset:?} but annotation stagehand.io/dataset is {named:?}"
            ));
        }
        Ok(Stage {
            project: self.annotation("stagehand.io/project")?.to_owned(),
            dataset: dataset.to_owned(),
            version: self.annotation("stagehand.io/version")?.to_owned(),
            tier: self.annotation("stagehand.io/tier")?.to_owned(),
            job: self.uid.clone(),
            node: None,
        })
    }
}

/// What to do with one gate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// The stage is ready at `path`: remove the gate, and say the path in the annotation
    /// [`path_annotation`] (which the pod's containers may read through the downward API).
    Remove { gate: String, path: String },
    /// Not yet: what the stage waits for.
    Wait { gate: String, why: String },
    /// The stage failed: keep the gate, say why on the pod.
    Failed { gate: String, reason: String },
    /// The pod does not say what it needs: keep the gate, say why on the pod.
    Invalid { gate: String, problem: String },
}

/// Decides each of the pod's Stagehand gates from its stage's status now, asking for the stage
/// first when it has none (the same request every time: its id derives from the pod's uid, so
/// asking again is a duplicate the requests stream drops).
pub async fn decide(
    bus: &stagehand_bus::Bus,
    pod: &GatedPod,
    requested_by: &str,
) -> anyhow::Result<Vec<Decision>> {
    let mut decisions = Vec::new();
    for gate in pod.stagehand_gates() {
        let gate = gate.to_owned();
        let stage = match pod.stage_for(&gate) {
            Ok(stage) => stage,
            Err(problem) => {
                decisions.push(Decision::Invalid { gate, problem });
                continue;
            }
        };
        let mut outcome = crate::stage::wait(bus, &stage, Duration::ZERO).await?;
        if outcome == WaitOutcome::TimedOut(None) {
            // No status yet: not asked for, or asked a moment ago (the same request again,
            // which the requests stream drops as a duplicate).
            let hold_until = match pod.annotations.get("stagehand.io/hold") {
                Some(hold) => {
                    let now = stagehand_schemas::event::now();
                    match crate::args::deadline("stagehand.io/hold", hold, now) {
                        Ok(at) => Some(at),
                        Err(e) => {
                            decisions.push(Decision::Invalid {
                                gate,
                                problem: e.to_string(),
                            });
                            continue;
                        }
                    }
                }
                None => None,
            };
            let opts = RequestOptions {
                requested_by: requested_by.to_owned(),
                hold_until,
                ..RequestOptions::default()
            };
            crate::stage::request(bus, &stage, &opts).await?;
            outcome = crate::stage::wait(bus, &stage, Duration::ZERO).await?;
        }
        let text = outcome.text(&stage);
        decisions.push(match outcome {
            WaitOutcome::Ready(_) => Decision::Remove { gate, path: text },
            WaitOutcome::Failed(_) => Decision::Failed { gate, reason: text },
            WaitOutcome::TimedOut(_) => Decision::Wait { gate, why: text },
        });
    }
    Ok(decisions)
}

/// The JSON patch (RFC 6902) carrying out `decisions` on `pod`, or `None` when there is nothing
/// to change. A ready dataset's path goes into its [`path_annotation`] first, so a container
/// started once the gate is gone finds it. Each gate removed is named by its index and guarded
/// by a `test` of its name, so a patch racing another change to the gates fails whole rather
/// than removing someone else's gate; indices are removed highest first so each stays valid. A
/// failed or invalid gate's reason goes into [`FAILED_ANNOTATION`] when it says something new.
pub fn patch(pod: &GatedPod, decisions: &[Decision]) -> Option<Value> {
    let mut ops = Vec::new();
    let mut annotations = pod.annotations.clone();
    let mut annotate = |ops: &mut Vec<Value>, key: String, value: String| {
        if annotations.get(&key) == Some(&value) {
            return;
        }
        // An `add` on a pod without annotations needs the map first.
        if annotations.is_empty() {
            ops.push(json!({"op": "add", "path": "/metadata/annotations", "value": {}}));
        }
        // `~1` is `/` in a JSON pointer.
        let pointer = format!(
            "/metadata/annotations/{}",
            key.replace('~', "~0").replace('/', "~1")
        );
        ops.push(json!({"op": "add", "path": pointer, "value": value}));
        annotations.insert(key, value);
    };
    let mut removed = Vec::new();
    for d in decisions {
        if let Decision::Remove { gate, path } = d
            && let Some(i) = pod.gates.iter().position(|g| g == gate)
        {
            let dataset = gate.strip_prefix(GATE_PREFIX).unwrap_or(gate);
            annotate(&mut ops, path_annotation(dataset), path.clone());
            removed.push(i);
        }
    }
    removed.sort_unstable_by(|a, b| b.cmp(a));
    for i in removed {
        ops.push(json!({"op": "test", "path": format!("/spec/schedulingGates/{i}/name"), "value": pod.gates[i]}));
        ops.push(json!({"op": "remove", "path": format!("/spec/schedulingGates/{i}")}));
    }
    let reasons: Vec<String> = decisions
        .iter()
        .filter_map(|d| match d {
            Decision::Failed { gate, reason } => Some(format!("{gate}: {reason}")),
            Decision::Invalid { gate, problem } => Some(format!("{gate}: {problem}")),
            _ => None,
        })
        .collect();
    if !reasons.is_empty() {
        annotate(&mut ops, FAILED_ANNOTATION.to_owned(), reasons.join("; "));
    }
    (!ops.is_empty()).then_some(Value::Array(ops))
}

/// One pass of `stagehand k8s gates`: every gated pod's gates decided and the patch applied,
/// one line printed per change. A pod that cannot be decided or patched is said on stderr and
/// left for the next pass; NATS out of reach ends the pass with the error.
pub async fn pass(
    bus: &stagehand_bus::Bus,
    kube: &crate::kube::Kube,
    namespace: Option<&str>,
    requested_by: &str,
) -> anyhow::Result<()> {
    for pod in kube.gated_pods(namespace).await? {
        let decisions = match decide(bus, &pod, requested_by).await {
            Ok(decisions) => decisions,
            Err(e) if crate::args::exit_code(&e) == crate::args::EX_UNAVAILABLE => return Err(e),
            Err(e) => {
                eprintln!(
                    "{}/{}: {}",
                    pod.namespace,
                    pod.name,
                    crate::args::error_line(&e)
                );
                continue;
            }
        };
        let Some(patch) = patch(&pod, &decisions) else {
            continue;
        };
        match kube.patch_pod(&pod, &patch).await {
            Ok(()) => {
                for d in &decisions {
                    match d {
                        Decision::Remove { gate, path } => {
                            println!("{}/{}: removed {gate} ({path})", pod.namespace, pod.name)
                        }
                        Decision::Failed { gate, reason } => {
                            println!("{}/{}: kept {gate}: {reason}", pod.namespace, pod.name)
                        }
                        Decision::Invalid { gate, problem } => {
                            println!("{}/{}: kept {gate}: {problem}", pod.namespace, pod.name)
                        }
                        Decision::Wait { .. } => {}
                    }
                }
            }
            Err(e) => eprintln!("{}/{}: {e:#}", pod.namespace, pod.name),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(gates: &[&str], annotations: &[(&str, &str)]) -> GatedPod {
        GatedPod {
            namespace: "lab".into(),
            name: "train-1".into(),
            uid: "0b6f5a9e".into(),
            annotations: annotations
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            gates: gates.iter().map(|g| g.to_string()).collect(),
        }
    }

    #[test]
    fn only_the_ready_gate_is_removed_guarded_by_its_name() {
        let p = pod(&["example.com/quota", "stagehand.io/cats"], &[("a", "b")]);
        let patch = patch(
            &p,
            &[Decision::Remove {
                gate: "stagehand.io/cats".into(),
                path: "/data/tiers/hot/lab/cats/3f2a".into(),
            }],
        )
        .unwrap();
        assert_eq!(
            patch,
            json!([
                {"op": "add", "path": "/metadata/annotations/stagehand.io~1path.cats", "value": "/data/tiers/hot/lab/cats/3f2a"},
                {"op": "test", "path": "/spec/schedulingGates/1/name", "value": "stagehand.io/cats"},
                {"op": "remove", "path": "/spec/schedulingGates/1"}
            ])
        );
    }

    #[test]
    fn a_failed_stage_keeps_its_gate_and_is_said_once() {
        let decisions = [Decision::Failed {
            gate: "stagehand.io/cats".into(),
            reason: "dataset lab/cats is not in the catalogue".into(),
        }];
        let p = pod(&["stagehand.io/cats"], &[]);
        let patch = patch(&p, &decisions).unwrap();
        assert_eq!(
            patch[0],
            json!({"op": "add", "path": "/metadata/annotations", "value": {}})
        );
        assert_eq!(
            patch[1],
            json!({"op": "add", "path": "/metadata/annotations/stagehand.io~1stage-failed",
                   "value": "stagehand.io/cats: dataset lab/cats is not in the catalogue"})
        );
        let said = pod(
            &["stagehand.io/cats"],
            &[(
                FAILED_ANNOTATION,
                "stagehand.io/cats: dataset lab/cats is not in the catalogue",
            )],
        );
        assert_eq!(super::patch(&said, &decisions), None);
    }

    #[test]
    fn a_gate_naming_another_dataset_than_the_annotation_is_refused() {
        let p = pod(&["stagehand.io/dogs"], &[("stagehand.io/dataset", "cats")]);
        let err = p.stage_for("stagehand.io/dogs").unwrap_err();
        assert!(
            err.contains("annotation stagehand.io/dataset is \"cats\""),
            "{err}"
        );
    }
}
