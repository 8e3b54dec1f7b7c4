//! The validation loss (`train --eval-data V.npz --eval-model M.onnx`): the model as it was
//! exported for inference, with the trainer's current parameters, and the loss the step
//! was trained on, over every row of a validation set.
//!
//! Why the model file and not the step: the step's forward is in training form (BatchNorm
//! on the batch's statistics, dropout drawn), so its loss on held-out rows is not what
//! `model.eval()` computes. The eval model is the one `rewrite` differentiated (or ONNX
//! Runtime's `eval_model.onnx` beside a training graph): BatchNorm on the running
//! statistics the step trains, dropout off.
//!
//! Built once, before training ([`EvalGraph::new`]):
//!
//! - **The loss.** For a step whose `autodiff` appended a loss function (`--loss-fn`, its
//!   options recorded in the step's pipeline), the same loss is appended, reduced by a sum,
//!   so that batches combine exactly:
//!
//!   ```text
//!   validation loss = Σ_batches sum(loss) / Σ_batches counted(labels)
//!   ```
//!
//!   where `counted` is what the mean divides by: the labels other than `ignore_index`
//!   (cross-entropy, nll), or every element (mse, l1, bce-logits, whose targets are shaped
//!   like the output). That is the mean over the whole set, whatever the batch size and a
//!   last partial batch. With `reduction=sum` the step's loss is a micro-batch's sum, and the
//!   report is too: the set's sum × B / rows. A model computing its own loss
//!   (`autodiff(loss=NAME)`; a step made from a training graph, whose loss output the
//!   artifacts' eval model shares): that output, a mean per batch, weighted by rows.
//! - **The accuracy**, for a classification loss (cross-entropy, nll): the share of counted
//!   labels whose class has the highest score (`ArgMax` over the class axis, the first of
//!   equal scores as torch's `argmax`), summed per batch as a second output.
//! - **The parameters.** The state's model tensors (parameters, BatchNorm running
//!   statistics, frozen tensors) that the eval model holds become its inputs, fed at each
//!   evaluation with the trainer's current values where the engine keeps them (on ONNX
//!   Runtime, no copy). Every parameter and running statistic must be there, with the
//!   state's element type and shape: else the file is not the model that was trained.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::data::Tensor;
use crate::dataset::Dataset;
use crate::engine::ort::SessionOptions;
use crate::engine::{Engine, EngineError, EngineKind, Held};
use crate::ir::print::elem_type_name;
use crate::ir::{tensor_type, BodyId, Model};
use crate::passes::autodiff::{self, Autodiff, Objective};
use crate::proto::{type_proto, ModelProto, TypeProto};
use crate::state::Manifest;
use crate::train::Trainer;
use crate::trained::{model_tensor, ModelTensor};

#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    /// The eval model does not fit the step (a problem of the files given).
    #[error("--eval-model {}: {message}", file.display())]
    Model { file: PathBuf, message: String },
    /// The validation data does not fit the eval model.
    #[error("--eval-data {}: {message}", file.display())]
    Data { file: PathBuf, message: String },
    /// The engine refused the eval model or failed on a batch.
    #[error("evaluating --eval-model {}: {source}", file.display())]
    Engine {
        file: PathBuf,
        #[source]
        source: EngineError,
    },
}

/// How a batch's loss output adds up to the validation loss.
#[derive(Clone, Debug, PartialEq)]
enum Combine {
    /// A sum over the labels' counted elements: Σ sums / Σ counted.
    Counted {
        labels: String,
        ignore_index: Option<i64>,
    },
    /// A micro-batch's sum (`reduction=sum`): Σ sums × B / rows.
    SumPerMicroBatch,
    /// A mean per batch (the model's own loss): Σ loss × rows / Σ rows.
    Rows,
}

/// The eval model made ready: the loss its only output, the state's model tensors its
/// inputs.
pub struct EvalGraph {
    model: ModelProto,
    file: PathBuf,
    loss: String,
    combine: Combine,
    /// State inputs fed from the trainer, by name (the eval model's names are the state's).
    fed: Vec<String>,
    /// The other graph inputs: fed from the validation data.
    data_inputs: Vec<String>,
    /// The batch size every data input declares, when one does (a static first axis).
    fixed_batch: Option<usize>,
    /// The loss as the step defines it, for the notes ("cross-entropy (mean)").
    describe: String,
    /// For a classification loss: the labels input and the ignored label, which the
    /// accuracy (the model's second output, the batch's correct count) divides by.
    accuracy: Option<(String, Option<i64>)>,
}

/// What the step's `autodiff` differentiated, from the pipeline recorded in its manifest;
/// a step made without it (from a training graph) differentiated its loss output.
fn objective(manifest: &Manifest) -> Result<Objective, String> {
    let passes = crate::passes::parse_spec(&manifest.pipeline)
        .map_err(|e| format!("the step's recorded pipeline does not parse: {e}"))?;
    match passes.iter().find(|p| p.pass == autodiff::PASS) {
        Some(options) => Autodiff::from_options(options)
            .map(|a| a.objective)
            .map_err(|e| format!("the step's recorded autodiff options: {e}")),
        None => Ok(Objective::Existing(manifest.loss.clone())),
    }
}

/// The declared dims of a tensor type (`None` for a symbolic or missing dimension).
fn declared_dims(ty: &TypeProto) -> Option<Vec<Option<i64>>> {
    let Some(type_proto::Value::TensorType(t)) = &ty.value else {
        return None;
    };
    let shape = t.shape.as_ref()?;
    Some(
        shape
            .dim
            .iter()
            .map(|d| match d.value {
                Some(crate::proto::tensor_shape_proto::dimension::Value::DimValue(v)) => Some(v),
                _ => None,
            })
            .collect(),
    )
}

fn declared_elem(ty: &TypeProto) -> Option<i32> {
    match &ty.value {
        Some(type_proto::Value::TensorType(t)) => t.elem_type,
        _ => None,
    }
}

/// What the nodes added to the eval model are stamped with.
const STAMP: &str = "evaluate";

impl EvalGraph {
    /// Makes `model` (read from `file`) the eval graph of the step `trainer` trains.
    pub fn new(model: ModelProto, file: &Path, trainer: &Trainer) -> Result<EvalGraph, EvalError> {
        let bad = |message: String| EvalError::Model {
            file: file.to_path_buf(),
            message,
        };
        let manifest = &trainer.manifest;
        let objective = objective(manifest).map_err(&bad)?;
        let mut m = Model::from_proto(model);
        let main = BodyId::MAIN;
        // A model stored in half precision reads its data as float32, as the step does
        // (`autodiff::half_model`).
        autodiff::half_model::float32_inputs(&mut m, STAMP);

        // Which tensors are the state's, checked before anything is removed as unused.
        let mut fed = Vec::new();
        for entry in &manifest.state {
            let Some(kind) = model_tensor(entry) else {
                continue;
            };
            let name = &entry.input;
            let Some(v) = m
                .lookup(main, name)
                .filter(|v| m.initializer(*v).is_some() || m.graph_inputs().contains(v))
            else {
                match kind {
                    ModelTensor::Required(role) => {
                        return Err(bad(format!(
                            "the step trains {role} '{name}', but this model has no initializer or graph input of that name: is it the model that was trained?"
                        )))
                    }
                    ModelTensor::Optional => continue,
                }
            };
            let (elem, shape) = trainer
                .state
                .get(name)
                .ok_or_else(|| bad(format!("the step has no state '{name}'")))?
                .layout(name)
                .map_err(|e| bad(e.to_string()))?;
            // A half parameter the step trains as a float32 master: fed as one, read
            // through a Cast, as the step reads it.
            let half = m
                .initializer(v)
                .map(|t| t.data_type())
                .filter(|e| autodiff::half_model::is_half(*e));
            if half.is_some() && elem == crate::proto::elem::FLOAT {
                autodiff::half_model::float32_masters(&mut m, &[v], STAMP);
            }
            let ty = m.value_type(v);
            let fits = ty.as_ref().is_some_and(|ty| {
                declared_elem(ty) == Some(elem)
                    && declared_dims(ty).is_some_and(|dims| {
                        dims.len() == shape.len()
                            && dims
                                .iter()
                                .zip(&shape)
                                .all(|(d, s)| d.is_none_or(|d| d == *s as i64))
                    })
            });
            if !fits {
                let has = ty
                    .as_ref()
                    .map(|ty| {
                        format!(
                            "{} {:?}",
                            declared_elem(ty).map_or("?", elem_type_name),
                            declared_dims(ty).unwrap_or_default()
                        )
                    })
                    .unwrap_or_else(|| "no declared type".into());
                return Err(bad(format!(
                    "tensor '{name}' is {has} here, but the step trains it as {} {shape:?}",
                    elem_type_name(elem)
                )));
            }
            fed.push((v, name.clone()));
        }

        // The loss, the first output; for classes the correct predictions, the second.
        let mut correct = None;
        let float = crate::proto::tensor_proto::DataType::Float as i32;
        let (loss, loss_elem, combine, describe) = match &objective {
            Objective::LossFn(spec) => {
                let summed = autodiff::LossSpec {
                    sum: true,
                    ..spec.clone()
                };
                let scores = match &spec.output {
                    Some(name) => m.lookup(main, name),
                    None => m.graph_outputs().first().copied(),
                };
                let (loss, labels) = autodiff::append_loss(&mut m, &summed).map_err(|e| {
                    bad(format!(
                        "appending the step's loss ({}): {e}",
                        spec.function.as_str()
                    ))
                })?;
                let shapes = autodiff::shapes::Shapes::infer(&m);
                let loss_elem = shapes.get(loss).elem.unwrap_or(float);
                let rank = scores.and_then(|s| shapes.get(s).rank());
                if let (true, Some(scores), Some(rank)) =
                    (spec.function.takes_classes(), scores, rank)
                {
                    let ignored = spec.ignore_index;
                    let axis = match spec.class_axis {
                        a if a < 0 => a + rank as i64,
                        a => a,
                    };
                    let c = correct_predictions(&mut m, scores, labels, axis, ignored);
                    correct = Some((c, m.name(labels).to_string(), ignored));
                }
                let combine = match spec.sum {
                    true => Combine::SumPerMicroBatch,
                    false => Combine::Counted {
                        labels: m.name(labels).to_string(),
                        ignore_index: spec.ignore_index.filter(|_| spec.function.takes_classes()),
                    },
                };
                let reduction = if spec.sum { "sum" } else { "mean" };
                (
                    loss,
                    loss_elem,
                    combine,
                    format!("{} ({reduction})", spec.function.as_str()),
                )
            }
            Objective::Existing(name) => {
                let loss = m.lookup(main, name).ok_or_else(|| {
                    bad(format!(
                        "the step's loss is '{name}', and this model computes no tensor of that name (a model with its own loss must compute it under the same name)"
                    ))
                })?;
                let loss_elem = autodiff::shapes::Shapes::infer(&m).get(loss).elem;
                (
                    loss,
                    loss_elem.unwrap_or(float),
                    Combine::Rows,
                    format!("the model's own loss '{name}'"),
                )
            }
        };
        while !m.main().outputs.is_empty() {
            m.remove_output(main, 0);
        }
        m.add_output(main, loss, Some(tensor_type(loss_elem, &[])));
        if let Some((c, ..)) = &correct {
            m.add_output(main, *c, Some(tensor_type(float, &[])));
        }
        for (v, _) in &fed {
            m.promote_initializer_to_input(*v);
        }
        crate::passes::dce::eliminate_dead_code(&mut m);

        let fed_names: Vec<String> = fed.into_iter().map(|(_, n)| n).collect();
        let mut model = m.to_proto();
        // The state's values are fed: the file's are not needed in the session.
        if let Some(g) = model.graph.as_mut() {
            g.initializer
                .retain(|t| !fed_names.iter().any(|n| n == t.name()));
        }
        let graph = model.graph.as_ref().ok_or_else(|| bad("no graph".into()))?;
        let mut data_inputs = Vec::new();
        let mut batches = Vec::new();
        for input in &graph.input {
            let name = input.name();
            if fed_names.iter().any(|n| n == name) {
                continue;
            }
            if !manifest.data_inputs.iter().any(|d| d == name) {
                return Err(bad(format!(
                    "input '{name}' is neither a tensor the step trains nor one of its data inputs ({})",
                    manifest.data_inputs.join(", ")
                )));
            }
            if let Some(Some(n)) = input
                .r#type
                .as_ref()
                .and_then(declared_dims)
                .and_then(|d| d.first().copied())
            {
                batches.push(n);
            }
            data_inputs.push(name.to_string());
        }
        let fixed_batch = batches.iter().min().map(|n| (*n).max(1) as usize);
        Ok(EvalGraph {
            model,
            file: file.to_path_buf(),
            loss: m.name(loss).to_string(),
            combine,
            fed: fed_names,
            data_inputs,
            fixed_batch,
            describe,
            accuracy: correct.map(|(_, labels, ignored)| (labels, ignored)),
        })
    }

    /// The batch every data input of the model declares, when its first axis is fixed.
    pub fn fixed_batch(&self) -> Option<usize> {
        self.fixed_batch
    }

    /// The loss, in words ("cross-entropy (mean)").
    pub fn describe(&self) -> &str {
        &self.describe
    }

    /// The model the engine runs.
    pub fn model(&self) -> &ModelProto {
        &self.model
    }

    /// The data inputs the validation set must hold.
    pub fn data_inputs(&self) -> &[String] {
        &self.data_inputs
    }

    /// The state tensors fed from the trainer.
    pub fn fed(&self) -> &[String] {
        &self.fed
    }
}

/// How many of `labels` other than `ignore_index` have their class scored highest in
/// `scores` (classes on `axis`, counted from 0): a float scalar. The mask matters when
/// `ignore_index` names a class (0, say); the host leaves ignored labels out of the divisor.
fn correct_predictions(
    m: &mut Model,
    scores: crate::ir::ValueId,
    labels: crate::ir::ValueId,
    axis: i64,
    ignore_index: Option<i64>,
) -> crate::ir::ValueId {
    use crate::ir::builder::{attr_int, Builder};
    use crate::ir::emit::Emit;
    let mut b = Builder::new(m, BodyId::MAIN, "evaluate");
    let keep = attr_int("keepdims", 0);
    let predicted = b.op(
        "ArgMax",
        &[scores],
        vec![attr_int("axis", axis), keep],
        "eval.predicted",
    );
    let mut hit = b.op("Equal", &[predicted, labels], vec![], "eval.hit");
    if let Some(ignored) = ignore_index {
        let ignored = b.scalar_i64("eval.ignore_index", ignored);
        let is_ignored = b.op("Equal", &[labels, ignored], vec![], "eval.ignored");
        let counted = b.op("Not", &[is_ignored], vec![], "eval.counted");
        hit = b.op("And", &[hit, counted], vec![], "eval.counted_hit");
    }
    let float = crate::proto::tensor_proto::DataType::Float as i64;
    let hit = b.op("Cast", &[hit], vec![attr_int("to", float)], "eval.hit_f");
    b.reduce("ReduceSum", hit, &[], false, "eval.correct")
}

/// One evaluation's result.
#[derive(Clone, Debug, PartialEq)]
pub struct Evaluation {
    /// The validation loss (see the module docs for how batches combine).
    pub loss: f64,
    /// For a classification loss: the share of counted labels predicted right.
    pub accuracy: Option<f64>,
    /// Rows evaluated.
    pub rows: usize,
    pub batches: usize,
    pub wall: Duration,
}

/// An engine session over the eval graph.
pub struct Evaluator {
    graph: EvalGraph,
    engine: Engine,
}

impl Evaluator {
    /// A session of `kind` over `graph`, with the trainer's thread count and device; the
    /// model runs as written (none of the step's fused kernels).
    pub fn new(
        graph: EvalGraph,
        kind: EngineKind,
        options: &SessionOptions,
    ) -> Result<Evaluator, EvalError> {
        let engine_error = |source: EngineError| EvalError::Engine {
            file: graph.file.clone(),
            source,
        };
        let options = SessionOptions {
            spin: false,
            shared_pool: true,
            fused_kernels: false,
            nchwc_convs: false,
            host_scalars: false,
            host_updates: false,
            ..options.clone()
        };
        let engine = match kind.resolve().0 {
            EngineKind::Tract => {
                let prepared =
                    crate::passes::lower_for_tract::prepare(&graph.model).map_err(|e| {
                        engine_error(EngineError::Tract {
                            context: "lowering the ops tract lacks".into(),
                            message: e.to_string(),
                        })
                    })?;
                Engine::new(kind, &prepared, &options)
            }
            _ => Engine::new(kind, &graph.model, &options),
        }
        .map_err(engine_error)?;
        Ok(Evaluator { graph, engine })
    }

    pub fn graph(&self) -> &EvalGraph {
        &self.graph
    }

    /// The validation loss of `trainer`'s current state over the first `rows` rows of
    /// `data`, `batch` at a time; `micro_batch` is the step's B (for `reduction=sum`).
    pub fn evaluate(
        &mut self,
        trainer: &Trainer,
        data: &Dataset,
        data_file: &Path,
        rows: usize,
        batch: usize,
        micro_batch: usize,
    ) -> Result<Evaluation, EvalError> {
        let start = Instant::now();
        let file = &self.graph.file;
        let engine_error = |source: EngineError| EvalError::Engine {
            file: file.clone(),
            source,
        };
        let held: Vec<(&str, &Held)> = self
            .graph
            .fed
            .iter()
            .map(|name| {
                trainer
                    .state
                    .get(name)
                    .map(|h| (name.as_str(), h))
                    .ok_or_else(|| EvalError::Model {
                        file: file.clone(),
                        message: format!("the step has no state '{name}'"),
                    })
            })
            .collect::<Result<_, _>>()?;
        let (mut total, mut weight) = (0f64, 0f64);
        let (mut correct, mut counted_labels) = (0f64, 0usize);
        let mut batches = 0;
        let batch = batch.max(1);
        for first in (0..rows).step_by(batch) {
            let indices: Vec<usize> = (first..rows.min(first + batch)).collect();
            let arrays = data.rows(&indices).map_err(|e| EvalError::Data {
                file: data_file.to_path_buf(),
                message: e.to_string(),
            })?;
            let host =
                self.graph
                    .data_inputs
                    .iter()
                    .map(|name| {
                        arrays.get(name).map(|t| (name.as_str(), t)).ok_or_else(|| {
                            EvalError::Data {
                                file: data_file.to_path_buf(),
                                message: format!(
                                    "no array named '{name}' (an input of the eval model)"
                                ),
                            }
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
            let outputs = self.engine.run_held(&host, &held).map_err(engine_error)?;
            let (name, value) = outputs.first().ok_or_else(|| {
                engine_error(EngineError::Output {
                    name: self.graph.loss.clone(),
                    message: "the eval model returned no output".into(),
                })
            })?;
            let loss = value
                .read_host(name, scalar)
                .map_err(engine_error)?
                .ok_or_else(|| {
                    engine_error(EngineError::Output {
                        name: name.clone(),
                        message: "is not a float scalar".into(),
                    })
                })?;
            if let Some((labels, ignored)) = &self.graph.accuracy {
                let (name, value) = outputs.get(1).ok_or_else(|| {
                    engine_error(EngineError::Output {
                        name: "eval.correct".into(),
                        message: "the eval model returned no correct count".into(),
                    })
                })?;
                correct += value
                    .read_host(name, scalar)
                    .map_err(engine_error)?
                    .unwrap_or(f64::NAN);
                counted_labels += arrays.get(labels).map_or(0, |t| counted(t, *ignored));
            }
            match &self.graph.combine {
                Combine::Counted {
                    labels,
                    ignore_index,
                } => {
                    total += loss;
                    weight += arrays.get(labels).map_or(0, |t| counted(t, *ignore_index)) as f64;
                }
                Combine::SumPerMicroBatch => {
                    total += loss * micro_batch as f64;
                    weight += indices.len() as f64;
                }
                Combine::Rows => {
                    total += loss * indices.len() as f64;
                    weight += indices.len() as f64;
                }
            }
            batches += 1;
        }
        Ok(Evaluation {
            // No counted label (every one ignored): no loss, as torch's mean gives NaN.
            loss: if weight > 0.0 {
                total / weight
            } else {
                f64::NAN
            },
            accuracy: self
                .graph
                .accuracy
                .as_ref()
                .map(|_| correct / counted_labels.max(1) as f64),
            rows,
            batches,
            wall: start.elapsed(),
        })
    }
}

/// A one-element float tensor's value.
fn scalar(t: &Tensor) -> Option<f64> {
    match t {
        Tensor::F32(a) if a.len() == 1 => a.iter().next().map(|v| f64::from(*v)),
        Tensor::F64(a) if a.len() == 1 => a.iter().next().copied(),
        _ => None,
    }
}

/// The elements of `labels` a mean divides by: those other than `ignore_index` (class
/// labels), or all of them.
fn counted(labels: &Tensor, ignore_index: Option<i64>) -> usize {
    match (labels, ignore_index) {
        (Tensor::I64(a), Some(ignored)) => a.iter().filter(|v| **v != ignored).count(),
        (Tensor::I32(a), Some(ignored)) => a.iter().filter(|v| i64::from(**v) != ignored).count(),
        (t, _) => t.shape().iter().product(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ignored_labels_are_not_counted() {
        let labels = Tensor::I64(ndarray::arr2(&[[1, -100, 2], [-100, -100, 0]]).into_dyn());
        assert_eq!(counted(&labels, Some(-100)), 3);
        assert_eq!(counted(&labels, None), 6);
        let targets = Tensor::F32(ndarray::Array2::<f32>::zeros((4, 3)).into_dyn());
        assert_eq!(counted(&targets, Some(-100)), 12);
    }
}
