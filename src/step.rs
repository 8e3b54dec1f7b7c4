//! Building the training step: run the pipeline over a training graph, give every state
//! input its initial value, and record the state manifest in the model's metadata.

use serde::{Deserialize, Serialize};

use crate::ir::{verify, BodyId, Model};
use crate::passes::{PassContext, PassError, PassReport, Pipeline};
use crate::proto::{ModelProto, StringStringEntryProto};
use crate::signature::TrainingGraph;
use crate::state::{self, StateEntry};

#[derive(Debug, thiserror::Error)]
pub enum StepError {
    #[error(transparent)]
    Pass(#[from] PassError),
    #[error("parameter '{0}' has no initial value: the graph has no initializer for it and there is no checkpoint (an ONNX Runtime training_model.onnx keeps its parameters in the checkpoint: pass the artifacts folder that holds training_model.onnx, checkpoint and optimizer_model.onnx)")]
    NoInitialValue(String),
    #[error(transparent)]
    Verify(#[from] verify::VerifyErrors),
    #[error("{0}")]
    NotAStep(String),
}

/// What a host needs to drive a rewritten step, read from (and written to) its metadata.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub state: Vec<StateEntry>,
    pub data_inputs: Vec<String>,
    pub loss: String,
    pub pipeline: String,
    pub version: String,
    /// When the step's apply region is an `If`: what decides its branch.
    pub apply: Option<state::ApplyTrigger>,
    /// The float scalar input holding the learning rate (a host may schedule it).
    pub learning_rate: Option<String>,
}

impl Manifest {
    /// Reads the manifest of a rewritten step model.
    pub fn from_model(model: &ModelProto) -> Result<Manifest, StepError> {
        let get = |key: &str| {
            model
                .metadata_props
                .iter()
                .find(|p| p.key() == key)
                .map(|p| p.value().to_string())
                .ok_or_else(|| StepError::NotAStep(format!("metadata '{key}' is missing: not a step graph written by `onnx-ga rewrite`")))
        };
        let json = |key: &str, text: String| {
            StepError::NotAStep(format!("metadata '{key}' is not valid: {text}"))
        };
        if let Ok(branch) = get(state::SPECIALISATION_KEY) {
            return Err(StepError::NotAStep(format!(
                "this is the '{branch}' specialisation of a step (written by `rewrite --split` \
                 for hosts of their own); train or inspect the step itself"
            )));
        }
        let state_text = get(state::STATE_KEY)?;
        let data_text = get(state::DATA_INPUTS_KEY)?;
        let manifest = Manifest {
            state: serde_json::from_str(&state_text)
                .map_err(|e| json(state::STATE_KEY, e.to_string()))?,
            data_inputs: serde_json::from_str(&data_text)
                .map_err(|e| json(state::DATA_INPUTS_KEY, e.to_string()))?,
            loss: get(state::LOSS_KEY)?,
            pipeline: get(state::PIPELINE_KEY).unwrap_or_default(),
            version: get(state::VERSION_KEY).unwrap_or_default(),
            apply: match get(state::APPLY_KEY) {
                Ok(text) => Some(
                    serde_json::from_str(&text)
                        .map_err(|e| json(state::APPLY_KEY, e.to_string()))?,
                ),
                Err(_) => None,
            },
            learning_rate: get(state::LEARNING_RATE_KEY).ok(),
        };
        if manifest.state.is_empty() {
            return Err(StepError::NotAStep(format!(
                "metadata '{}' lists no state (no parameters, no counters): there is nothing \
                 to train",
                state::STATE_KEY
            )));
        }
        // Every name the manifest gives is the graph's: a host feeds and reads them. (A
        // header without its graph, e.g. `ir::Model::header`, has nothing to check.)
        if let Some(graph) = model.graph.as_ref() {
            let inputs: std::collections::HashSet<&str> =
                graph.input.iter().map(|i| i.name()).collect();
            let outputs: std::collections::HashSet<&str> =
                graph.output.iter().map(|o| o.name()).collect();
            let missing = |what: &str, name: &str, side: &str| {
                StepError::NotAStep(format!(
                    "metadata '{}': {what} '{name}' is not a graph {side} of the step",
                    state::STATE_KEY
                ))
            };
            for e in &manifest.state {
                if !inputs.contains(e.input.as_str()) {
                    return Err(missing("state input", &e.input, "input"));
                }
                if !outputs.contains(e.output.as_str()) {
                    return Err(missing("state output", &e.output, "output"));
                }
            }
            for d in &manifest.data_inputs {
                if !inputs.contains(d.as_str()) {
                    return Err(missing("data input", d, "input"));
                }
            }
            crate::split::check_apply_region(model, &manifest).map_err(StepError::NotAStep)?;
        }
        Ok(manifest)
    }

    /// The manifest as metadata entries (key, value), in a fixed order.
    pub fn metadata(&self) -> Vec<StringStringEntryProto> {
        let mut entries = vec![
            (
                state::STATE_KEY,
                serde_json::to_string(&self.state).expect("state serializes"),
            ),
            (
                state::DATA_INPUTS_KEY,
                serde_json::to_string(&self.data_inputs).expect("names serialize"),
            ),
            (state::LOSS_KEY, self.loss.clone()),
            (state::PIPELINE_KEY, self.pipeline.clone()),
            (state::VERSION_KEY, self.version.clone()),
        ];
        if let Some(trigger) = &self.apply {
            let trigger = serde_json::to_string(trigger).expect("trigger serializes");
            entries.push((state::APPLY_KEY, trigger));
        }
        if let Some(name) = &self.learning_rate {
            entries.push((state::LEARNING_RATE_KEY, name.clone()));
        }
        entries
            .into_iter()
            .map(|(key, value)| StringStringEntryProto {
                key: Some(key.into()),
                value: Some(value),
            })
            .collect()
    }

    /// Replaces the model's `onnx_ga.*` metadata with this manifest.
    fn write(&self, model: &mut Model) {
        let props = &mut model.header.metadata_props;
        props.retain(|p| !p.key().starts_with(state::KEY_PREFIX));
        props.extend(self.metadata());
    }
}

/// A rewritten training step.
pub struct Step {
    pub model: Model,
    pub manifest: Manifest,
    pub reports: Vec<(String, PassReport)>,
    /// Every setting of every pass, resolved (also in the metadata, `onnx_ga.recipe`).
    pub recipe: crate::recipe::Recipe,
}

/// Runs `spec` over `graph` and finishes the step model.
pub fn build_step(graph: TrainingGraph, spec: &str, verify_each: bool) -> Result<Step, StepError> {
    let TrainingGraph {
        mut model,
        mut signature,
        checkpoint,
        ..
    } = graph;
    let mut pipeline = Pipeline::parse(spec)?;
    pipeline.verify_each |= verify_each;
    let (reports, state, region, sections) = {
        let mut cx = PassContext::new(&mut signature, checkpoint.as_ref());
        let reports = pipeline.run(&mut model, &mut cx)?;
        (
            reports,
            std::mem::take(&mut cx.state),
            cx.apply.take(),
            std::mem::take(&mut cx.recipe),
        )
    };
    let recipe = crate::recipe::Recipe::from_run(sections, &crate::passes::parse_spec(spec)?);
    let learning_rate = region
        .as_ref()
        .and_then(|r| r.learning_rate)
        .map(|v| model.name(v).to_string());
    let apply = region.and_then(|r| {
        Some(state::ApplyTrigger {
            node: model.node(r.if_node?).proto.name().to_string(),
            steps: model.name(r.window_size?).to_string(),
            flush: model.name(r.flush?).to_string(),
        })
    });

    // Initial values: the checkpoint's, else the graph's own initializer.
    for p in &signature.params {
        let Some(v) = model.lookup(BodyId::MAIN, &p.name) else {
            continue;
        };
        match checkpoint.as_ref().and_then(|c| c.parameter(&p.name)) {
            Some(t) => model.set_initializer(v, t.to_tensor_proto()),
            None if model.initializer(v).is_some() => {}
            None => return Err(StepError::NoInitialValue(p.name.clone())),
        }
    }

    let manifest = Manifest {
        state,
        data_inputs: signature
            .data_inputs
            .iter()
            .map(|d| d.name.clone())
            .collect(),
        loss: signature.loss.clone(),
        pipeline: pipeline.spec(),
        version: env!("CARGO_PKG_VERSION").to_string(),
        apply,
        learning_rate,
    };
    manifest.write(&mut model);
    model.header.metadata_props.push(StringStringEntryProto {
        key: Some(crate::recipe::RECIPE_KEY.into()),
        value: Some(serde_json::to_string(&recipe).expect("the recipe serializes")),
    });
    verify::verify(&model)?;
    Ok(Step {
        model,
        manifest,
        reports,
        recipe,
    })
}
