//! tract sessions over our host tensors: pure Rust (tract-onnx), no native library.
//!
//! tract turns every graph input that has an initializer into a constant, but our step
//! models keep their state (and `ga.flush`, the learning rate, K) in initializer-backed
//! inputs that the host overrides. So the session strips those initializers, makes every
//! graph input a source, and feeds an input's initializer as its default when a run does
//! not name it (what ONNX Runtime does). tract plans for concrete shapes: a plan is
//! optimised at the first run with the shapes of its inputs, and kept for those shapes (the
//! micro-batch size is fixed per run, so there is usually one; uneven micro-batches get
//! one each).

use std::collections::HashMap;
use std::sync::Arc;

use tract_onnx::prelude::{
    DatumType, Framework, InferenceFact, InferenceModel, InferenceModelExt, IntoRunnable, TValue,
    Tensor as TractTensor, TypedModel, TypedRunnableModel, TypedSimpleState,
};
use tract_onnx::tract_hir::ops::unimpl::UnimplementedOp;

use super::ort::SessionOptions;
use super::EngineError;
use crate::data::Tensor;
use crate::proto::ModelProto;

fn tract_err(context: impl Into<String>) -> impl FnOnce(anyhow::Error) -> EngineError {
    let context = context.into();
    move |e| EngineError::Tract {
        context,
        message: format!("{e:#}"),
    }
}

/// A runnable plan for one set of input shapes, with its reusable run state.
struct Plan {
    state: TypedSimpleState,
}

/// One tract model, planned per set of input shapes.
pub struct TractSession {
    model: InferenceModel,
    optimize: bool,
    pub input_names: Vec<String>,
    pub output_names: Vec<String>,
    /// The initializer of an initializer-backed input: fed when a run does not name it.
    defaults: Vec<Option<Tensor>>,
    plans: HashMap<Vec<(DatumType, Vec<usize>)>, Plan>,
}

impl TractSession {
    /// Parses `model` for tract. Ops tract lacks are an error here, naming them (lower them
    /// first with [`crate::passes::lower_for_tract::lower_model`]).
    pub fn new(model: &ModelProto, options: &SessionOptions) -> Result<TractSession, EngineError> {
        let graph = model.graph.as_ref().ok_or_else(|| EngineError::Tract {
            context: "loading the model".into(),
            message: "the model has no graph".into(),
        })?;
        let input_names: Vec<String> = graph.input.iter().map(|i| i.name().to_string()).collect();
        let output_names: Vec<String> = graph.output.iter().map(|o| o.name().to_string()).collect();
        let mut defaults = Vec::with_capacity(input_names.len());
        let mut stripped = model.clone();
        let g = stripped.graph.as_mut().expect("checked above");
        for name in &input_names {
            match g.initializer.iter().position(|t| t.name() == name) {
                Some(i) => {
                    let init = g.initializer.remove(i);
                    let value =
                        Tensor::from_tensor_proto(&init).map_err(|m| EngineError::Input {
                            name: name.clone(),
                            message: format!("its initializer: {m}"),
                        })?;
                    defaults.push(Some(value));
                }
                None => defaults.push(None),
            }
        }
        // tract types an If by its then branch and names every If node "If" (tract_ifs).
        super::tract_ifs::ifs_for_tract(&mut stripped);
        let bytes = crate::model::encode_model(&stripped);
        if let Some(message) = crate::model::too_large_to_parse(bytes.len()) {
            return Err(EngineError::Tract {
                context: "reading the model".into(),
                message,
            });
        }
        // value_info names symbolic dims (`batch`) that the concrete input shapes of a plan
        // would contradict; tract infers every intermediate fact itself.
        let onnx = tract_onnx::onnx().with_ignore_value_info(true);
        let proto = onnx
            .proto_model_for_read(&mut &bytes[..])
            .map_err(tract_err("reading the model"))?;
        let parsed = onnx
            .model_for_proto_model(&proto)
            .map_err(tract_err("loading the model"))?;
        let missing: Vec<String> = parsed
            .nodes()
            .iter()
            .filter(|n| n.op_is::<UnimplementedOp>())
            .map(|n| format!("{} ({})", n.name, n.op.name()))
            .collect();
        if !missing.is_empty() {
            return Err(EngineError::Tract {
                context: "loading the model".into(),
                message: format!("tract has no implementation of: {}", missing.join(", ")),
            });
        }
        if parsed.inputs.len() != input_names.len() {
            return Err(EngineError::Tract {
                context: "loading the model".into(),
                message: format!(
                    "tract sees {} inputs, the model declares {}",
                    parsed.inputs.len(),
                    input_names.len()
                ),
            });
        }
        Ok(TractSession {
            model: parsed,
            optimize: options.optimize,
            input_names,
            output_names,
            defaults,
            plans: HashMap::new(),
        })
    }

    /// Runs the model once; returns every output by name, in the model's output order.
    /// Inputs not named take their initializer's value.
    pub fn run(
        &mut self,
        inputs: &[(&str, &Tensor)],
    ) -> Result<Vec<(String, Tensor)>, EngineError> {
        let mut values: Vec<TractTensor> = Vec::with_capacity(self.input_names.len());
        for (name, default) in self.input_names.iter().zip(&self.defaults) {
            let tensor = match inputs.iter().find(|(n, _)| n == name) {
                Some((_, t)) => *t,
                None => default.as_ref().ok_or_else(|| EngineError::Input {
                    name: name.clone(),
                    message: "not fed, and the model gives it no initializer".into(),
                })?,
            };
            values.push(to_tract(name, tensor)?);
        }
        if let Some((name, _)) = inputs
            .iter()
            .find(|(n, _)| !self.input_names.iter().any(|i| i == n))
        {
            return Err(EngineError::Input {
                name: name.to_string(),
                message: "is not an input of the model".into(),
            });
        }
        let key: Vec<(DatumType, Vec<usize>)> = values
            .iter()
            .map(|t| (t.datum_type(), t.shape().to_vec()))
            .collect();
        if !self.plans.contains_key(&key) {
            let plan = guarded("planning", || self.plan(&values))??;
            self.plans.insert(key.clone(), plan);
        }
        let plan = self.plans.get_mut(&key).expect("inserted above");
        let outputs = match guarded("run", || {
            plan.state
                .run(values.into_iter().map(TValue::from).collect())
        }) {
            Ok(outputs) => outputs.map_err(tract_err("run"))?,
            Err(e) => {
                // A plan that panicked mid-run may hold half-updated state: never reuse it.
                self.plans.remove(&key);
                return Err(e);
            }
        };
        if outputs.len() != self.output_names.len() {
            return Err(EngineError::Tract {
                context: "run".into(),
                message: format!(
                    "{} outputs, the model declares {}",
                    outputs.len(),
                    self.output_names.len()
                ),
            });
        }
        self.output_names
            .iter()
            .zip(outputs)
            .map(|(name, value)| Ok((name.clone(), from_tract(name, &value)?)))
            .collect()
    }

    /// Types and optimises the model for the shapes of `values`.
    fn plan(&self, values: &[TractTensor]) -> Result<Plan, EngineError> {
        let shapes = || {
            self.input_names
                .iter()
                .zip(values)
                .filter(|(_, v)| v.rank() > 0)
                .map(|(n, v)| format!("{n}: {:?}", v.shape()))
                .take(4)
                .collect::<Vec<_>>()
                .join(", ")
        };
        let context = || format!("planning for input shapes {} ...", shapes());
        let mut model = self.model.clone();
        for (i, v) in values.iter().enumerate() {
            model
                .set_input_fact(i, InferenceFact::dt_shape_from_tensor(v))
                .map_err(tract_err(context()))?;
        }
        let typed = model
            .into_typed()
            .map(scans_start_from_their_inputs)
            .and_then(|m| match self.optimize {
                true => m.into_optimized(),
                false => m.into_decluttered(),
            })
            .map_err(tract_err(context()))?;
        let runnable: Arc<TypedRunnableModel> =
            typed.into_runnable().map_err(tract_err(context()))?;
        let state = runnable.spawn().map_err(tract_err(context()))?;
        Ok(Plan { state })
    }
}

/// ONNX's Scan starts every run from the initial states its inputs give. tract's, built
/// for streaming, carries its states over from one run of a plan to the next unless told to
/// reset them every turn; the plans here are kept and run once per micro-step, so a Loop made
/// a Scan (`lower-for-tract`) would start its second micro-step where the first ended.
fn scans_start_from_their_inputs(mut model: TypedModel) -> TypedModel {
    use tract_onnx::tract_core::ops::scan::Scan;
    for node in model.nodes_mut() {
        if let Some(scan) = node.op_as::<Scan>() {
            let mut scan = scan.clone();
            scan.reset_every_turn = true;
            scan.body = scans_start_from_their_inputs(scan.body);
            node.op = Box::new(scan);
        }
    }
    model
}

thread_local! {
    /// Set while tract runs on this thread under [`guarded`]: its panics are reported as
    /// errors, so the panic hook stays quiet for them.
    static GUARDED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` (tract code), turning a panic inside tract (an index out of bounds, a division
/// by zero on data it did not expect) into an error instead of a crash of the process. The
/// host checks what it can before a run ([`crate::index_check`]); this is the net below.
fn guarded<T>(context: &str, f: impl FnOnce() -> T) -> Result<T, EngineError> {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !GUARDED.with(|g| g.get()) {
                previous(info);
            }
        }));
    });
    GUARDED.with(|g| g.set(true));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    GUARDED.with(|g| g.set(false));
    result.map_err(|payload| {
        let message = payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "no message".into());
        EngineError::Tract {
            context: context.into(),
            message: format!(
                "tract failed on this input ({message}); check the data against the model (index ranges, empty axes)"
            ),
        }
    })
}

fn to_tract(name: &str, tensor: &Tensor) -> Result<TractTensor, EngineError> {
    fn convert<T: tract_onnx::prelude::Datum + Copy>(
        a: &ndarray::ArrayD<T>,
    ) -> anyhow::Result<TractTensor> {
        let standard = a.as_standard_layout();
        let slice = standard.as_slice().expect("standard layout is contiguous");
        TractTensor::from_shape(a.shape(), slice)
    }
    match tensor {
        Tensor::F32(a) => convert(a),
        Tensor::F64(a) => convert(a),
        Tensor::I64(a) => convert(a),
        Tensor::I32(a) => convert(a),
        Tensor::Bool(a) => convert(a),
    }
    .map_err(|e| EngineError::Input {
        name: name.to_string(),
        message: e.to_string(),
    })
}

fn from_tract(name: &str, value: &TractTensor) -> Result<Tensor, EngineError> {
    fn convert<T: tract_onnx::prelude::Datum>(
        v: &TractTensor,
    ) -> anyhow::Result<ndarray::ArrayD<T>> {
        Ok(v.to_plain_array_view::<T>()?.to_owned())
    }
    let err = |e: anyhow::Error| EngineError::Output {
        name: name.to_string(),
        message: e.to_string(),
    };
    Ok(match value.datum_type() {
        DatumType::F32 => Tensor::F32(convert(value).map_err(err)?),
        DatumType::F64 => Tensor::F64(convert(value).map_err(err)?),
        DatumType::I64 => Tensor::I64(convert(value).map_err(err)?),
        DatumType::I32 => Tensor::I32(convert(value).map_err(err)?),
        DatumType::Bool => Tensor::Bool(convert(value).map_err(err)?),
        other => {
            return Err(EngineError::Output {
                name: name.to_string(),
                message: format!("element type {other:?} is not supported on the host"),
            })
        }
    })
}
