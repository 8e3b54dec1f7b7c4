//! Building the training step: run the pipeline over a training graph, give every state
//! input its initial value, and record the state manifest in the model's metadata.

use crate::ir::{verify, BodyId, Model};
use crate::passes::{PassContext, PassError, PassReport, Pipeline};
use crate::proto::StringStringEntryProto;
use crate::proto::TensorProto;
use crate::signature::TrainingGraph;
use crate::state::{self, Manifest, Role, StateEntry, StateInit};
use std::collections::BTreeMap;

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
            cx.take_window(),
            std::mem::take(&mut cx.recipe),
        )
    };
    let given = crate::passes::parse_spec(spec)?;
    let recipe = crate::recipe::Recipe::from_run(sections, given.iter().map(|o| o.iter()));
    let learning_rate = region
        .as_ref()
        .and_then(|w| w.learning_rate())
        .map(|v| model.name(v).to_string());
    let apply = region.and_then(|w| w.trigger(&model));

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

    let init = zero_state_uninitialised(&mut model, &state);

    let manifest = Manifest {
        init,
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

/// Drops the initializer of every state that starts at zeros and is not a model tensor
/// (accumulators, optimizer moments, counters, the window's sums; parameters, frozen
/// tensors and BatchNorm running statistics keep theirs: they are the model's values), and
/// returns those states, each `StateInit::Zeros`: the file stores nothing for them and a host
/// makes the zeros from the input's declared type. A state whose input type is not a
/// tensor of static shape equal to its initializer's, or whose element type a host
/// cannot make ([`zeros_supported`]), keeps its stored zeros.
fn zero_state_uninitialised(
    model: &mut Model,
    state: &[StateEntry],
) -> BTreeMap<String, StateInit> {
    let mut init = BTreeMap::new();
    for e in state {
        let model_tensor = match e.role {
            Role::Param | Role::Frozen => true,
            Role::BnStat => e.param.as_deref().is_none_or(|p| p == e.input),
            _ => false,
        };
        if model_tensor {
            continue;
        }
        let Some(v) = model.lookup(BodyId::MAIN, &e.input) else {
            continue;
        };
        let Some(t) = model.initializer(v) else {
            continue;
        };
        let declared = model
            .value_type(v)
            .as_ref()
            .and_then(state::static_tensor_type);
        let fits = declared == Some((t.data_type(), t.dims.clone()));
        if fits && zeros_supported(t.data_type()) && all_zero(t) {
            model
                .body_mut(BodyId::MAIN)
                .initializers
                .retain(|(id, _)| *id != v);
            init.insert(e.input.clone(), StateInit::Zeros);
        }
    }
    init
}

/// The element types a host of ours makes zeros of (the host tensor's).
pub fn zeros_supported(elem_type: i32) -> bool {
    use crate::proto::tensor_proto::DataType as D;
    matches!(
        D::try_from(elem_type),
        Ok(D::Float | D::Double | D::Int64 | D::Int32 | D::Bool)
    )
}

/// Whether `t` holds only zero bits (`-0.0` is not one), complete and inline.
fn all_zero(t: &TensorProto) -> bool {
    use crate::proto::tensor_proto::DataType as D;
    if t.is_external() || t.dims.iter().any(|d| *d < 0) {
        return false;
    }
    let count = t.dims.iter().product::<i64>() as usize;
    if let Some(raw) = &t.raw_data {
        let size = match D::try_from(t.data_type()) {
            Ok(D::Float | D::Int32) => 4,
            Ok(D::Double | D::Int64) => 8,
            Ok(D::Bool) => 1,
            _ => return false,
        };
        return raw.len() == count * size && raw.iter().all(|b| *b == 0);
    }
    match D::try_from(t.data_type()) {
        Ok(D::Float) => {
            t.float_data.len() == count && t.float_data.iter().all(|x| x.to_bits() == 0)
        }
        Ok(D::Double) => {
            t.double_data.len() == count && t.double_data.iter().all(|x| x.to_bits() == 0)
        }
        Ok(D::Int64) => t.int64_data.len() == count && t.int64_data.iter().all(|x| *x == 0),
        Ok(D::Int32 | D::Bool) => {
            t.int32_data.len() == count && t.int32_data.iter().all(|x| *x == 0)
        }
        _ => false,
    }
}
