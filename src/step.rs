//! Building the training step: run the pipeline over a training graph, give every state
//! input its initial value, and record the state manifest in the model's metadata.

use crate::ir::{verify, BodyId, Model};
use crate::passes::{PassContext, PassError, PassReport, Pipeline};
use crate::proto::StringStringEntryProto;
use crate::signature::TrainingGraph;
use crate::state::{self, Manifest};

#[derive(Debug, thiserror::Error)]
pub enum StepError {
    #[error(transparent)]
    Pass(#[from] PassError),
    #[error("parameter '{0}' has no initial value: the graph has no initializer for it and there is no checkpoint (an ONNX Runtime training_model.onnx keeps its parameters in the checkpoint: pass the artifacts folder that holds training_model.onnx, checkpoint and optimizer_model.onnx)")]
    NoInitialValue(String),
    #[error(transparent)]
    Verify(#[from] verify::VerifyErrors),
    #[error(transparent)]
    NotAStep(#[from] crate::state::NotAStep),
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
    let given = crate::passes::parse_spec(spec)?;
    let recipe = crate::recipe::Recipe::from_run(sections, given.iter().map(|o| o.iter()));
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
    manifest.write_into(&mut model.header.metadata_props);
    model.header.metadata_props.push(StringStringEntryProto {
        key: Some(crate::recipe::RECIPE_KEY.into()),
        value: Some(serde_json::to_string(&recipe).expect("the recipe serializes")),
    });
    state::verify_step(&model)?;
    Ok(Step {
        model,
        manifest,
        reports,
        recipe,
    })
}
