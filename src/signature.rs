//! The training signature: which tensors of a gradient graph are data, loss, backward seed,
//! parameters and their gradients, and which optimizer the producer configured.
//!
//! This is the ONLY module that knows producers' naming conventions. Passes ask the
//! signature, never the names. Two producers are understood:
//!
//! - ONNX Runtime on-device-training artifacts (a folder with `training_model.onnx`,
//!   `checkpoint`, optionally `optimizer_model.onnx` and `eval_model.onnx`): parameters are
//!   graph inputs fed from the checkpoint; each trainable parameter's gradient is input 1 of
//!   a `com.microsoft::InPlaceAccumulatorV2(buffer, grad, lazy_reset_grad)`; the loss is
//!   graph output 0; the backward seed is the scalar initializer `<loss>_grad`.
//! - A plain gradient graph, with the roles given explicitly ([`ExplicitRoles`]).

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::adamw::AdamW;
use crate::checkpoint::{Checkpoint, CheckpointError};
use crate::ir::{print::type_text, Model, ValueId};
use crate::model::ModelError;
use crate::proto::{attribute_proto::AttributeType, type_proto, ModelProto, TypeProto};

pub const TRAINING_MODEL: &str = "training_model.onnx";
pub const OPTIMIZER_MODEL: &str = "optimizer_model.onnx";
pub const EVAL_MODEL: &str = "eval_model.onnx";
pub const CHECKPOINT: &str = "checkpoint";

/// The ORT accumulator op whose input 1 is a parameter's gradient.
const ORT_ACCUMULATOR: (&str, &str) = ("com.microsoft", "InPlaceAccumulatorV2");
/// ORT names the accumulation buffer of parameter `p` `p` + this suffix.
const ORT_BUFFER_SUFFIX: &str = "_grad.accumulation.buffer";
/// ORT names the backward seed of loss `l` `l` + this suffix.
const ORT_SEED_SUFFIX: &str = "_grad";

/// Why a training graph could not be opened. Every message names the file (or folder).
///
/// `Model` and `Checkpoint` show the inner error's message, which already includes its
/// cause, and deliberately report no `source()`: a caller printing the whole chain (as
/// `anyhow`'s `{:#}` does) would otherwise repeat the cause.
#[derive(Debug, thiserror::Error)]
pub enum SignatureError {
    #[error("{0}")]
    Model(ModelError),
    #[error("{0}")]
    Checkpoint(CheckpointError),
    #[error("{}: not found", path.display())]
    NotFound { path: PathBuf },
    #[error("{}: not an ONNX Runtime training artifacts folder: {TRAINING_MODEL} is missing", path.display())]
    NoTrainingModel { path: PathBuf },
    #[error("{}: is a folder, not a file", path.display())]
    NotAFile { path: PathBuf },
    #[error("{}: the artifacts folder has no '{CHECKPOINT}' file (parameters are fed from it)", path.display())]
    NoCheckpoint { path: PathBuf },
    #[error("{}: {message}", file.display())]
    Inconsistent { file: PathBuf, message: String },
}

impl From<ModelError> for SignatureError {
    fn from(e: ModelError) -> Self {
        SignatureError::Model(e)
    }
}

impl From<CheckpointError> for SignatureError {
    fn from(e: CheckpointError) -> Self {
        SignatureError::Checkpoint(e)
    }
}

fn inconsistent(file: &Path, message: String) -> SignatureError {
    SignatureError::Inconsistent {
        file: file.to_path_buf(),
        message,
    }
}

/// A named tensor with its element type and (possibly symbolic) shape.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// ONNX `TensorProto.DataType`.
    pub elem_type: i32,
    /// Dimensions as text: numbers, or symbols like `batch`, or `?`.
    pub shape: Vec<String>,
}

impl TensorInfo {
    pub fn of(name: &str, ty: Option<&TypeProto>) -> TensorInfo {
        let (elem_type, shape) = tensor_parts(ty);
        TensorInfo {
            name: name.to_string(),
            elem_type,
            shape,
        }
    }

    /// The ONNX text form of the type, e.g. `float[batch,16]`.
    pub fn type_text(&self) -> String {
        let elem = crate::ir::print::elem_type_name(self.elem_type);
        if self.shape.is_empty() {
            elem.to_string()
        } else {
            format!("{elem}[{}]", self.shape.join(","))
        }
    }
}

fn tensor_parts(ty: Option<&TypeProto>) -> (i32, Vec<String>) {
    use crate::proto::tensor_shape_proto::dimension::Value as Dim;
    match ty.and_then(|t| t.value.as_ref()) {
        Some(type_proto::Value::TensorType(t)) => {
            let shape = t
                .shape
                .as_ref()
                .map(|s| {
                    s.dim
                        .iter()
                        .map(|d| match &d.value {
                            Some(Dim::DimValue(v)) => v.to_string(),
                            Some(Dim::DimParam(p)) => p.clone(),
                            None => "?".into(),
                        })
                        .collect()
                })
                .unwrap_or_default();
            (t.elem_type(), shape)
        }
        _ => (0, Vec::new()),
    }
}

/// A parameter of the model.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Param {
    pub name: String,
    pub elem_type: i32,
    pub dims: Vec<i64>,
    pub trainable: bool,
    /// The tensor holding this parameter's gradient (trainable parameters only).
    pub grad: Option<String>,
    /// ORT's accumulation buffer input and flag output, when the producer made them.
    pub accumulation: Option<OrtAccumulation>,
}

impl Param {
    /// Elements of the parameter (0 for unknown dims, saturating for absurd ones).
    pub fn element_count(&self) -> u64 {
        self.dims
            .iter()
            .map(|d| (*d).max(0) as u64)
            .fold(1u64, u64::saturating_mul)
    }
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct OrtAccumulation {
    pub buffer_input: String,
    pub flag_output: String,
    pub node: String,
}

/// The optimizer the producer configured.
#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum OptimizerSpec {
    /// ORT `AdamWOptimizer`: m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; bias-corrected step,
    /// then decoupled weight decay (adam_mode 1) or the torch-style variant (adam_mode 0).
    Adamw {
        beta1: f32,
        beta2: f32,
        epsilon: f32,
        weight_decay: f32,
        correct_bias: bool,
        adam_mode: i64,
    },
    /// ORT `SGDOptimizerV2`: p = p - lr g.
    Sgd,
}

impl OptimizerSpec {
    /// The AdamW it configures, if it is one.
    pub fn adamw(&self) -> Option<AdamW> {
        match *self {
            OptimizerSpec::Adamw {
                beta1,
                beta2,
                epsilon,
                weight_decay,
                correct_bias,
                adam_mode,
            } => Some(AdamW {
                beta1,
                beta2,
                epsilon,
                weight_decay,
                correct_bias,
                adam_mode,
                decimal_complements: false,
            }),
            OptimizerSpec::Sgd => None,
        }
    }
}

/// The record of an AdamW read from ORT's optimizer (its attributes: [`AdamW`]).
impl From<AdamW> for OptimizerSpec {
    fn from(a: AdamW) -> Self {
        OptimizerSpec::Adamw {
            beta1: a.beta1,
            beta2: a.beta2,
            epsilon: a.epsilon,
            weight_decay: a.weight_decay,
            correct_bias: a.correct_bias,
            adam_mode: a.adam_mode,
        }
    }
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Optimizer {
    #[serde(flatten)]
    pub spec: OptimizerSpec,
    /// From the checkpoint's optimizer group, when it has one.
    pub learning_rate: Option<f32>,
    /// Optimizer steps already taken, from the checkpoint.
    pub step: Option<i64>,
    pub source: PathBuf,
}

/// Where the signature came from.
#[derive(Clone, Debug, Serialize, PartialEq)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Source {
    OrtArtifacts {
        dir: PathBuf,
        training_model: PathBuf,
        checkpoint: Option<PathBuf>,
        optimizer_model: Option<PathBuf>,
        eval_model: Option<PathBuf>,
    },
    OrtTrainingGraph {
        file: PathBuf,
    },
    Plain {
        file: PathBuf,
    },
    /// A forward model (no gradients yet): the `autodiff` pass builds its backward pass and
    /// fills in the roles (`differentiated` once it has).
    Forward {
        file: PathBuf,
        differentiated: bool,
    },
    /// A step written by `onnx-ga rewrite`: roles come from its state manifest.
    Step {
        file: PathBuf,
        pipeline: String,
        state_pairs: usize,
    },
}

#[derive(Clone, Debug, Serialize)]
pub struct TrainingSignature {
    pub source: Source,
    pub data_inputs: Vec<TensorInfo>,
    pub loss: String,
    /// The scalar initializer seeding the backward pass (dLoss/dLoss = 1).
    pub seed: Option<String>,
    pub params: Vec<Param>,
    /// ORT's boolean input that makes every accumulator reset instead of add.
    pub lazy_reset_grad: Option<String>,
    pub optimizer: Option<Optimizer>,
}

impl TrainingSignature {
    pub fn trainable(&self) -> impl Iterator<Item = &Param> {
        self.params.iter().filter(|p| p.trainable)
    }

    pub fn param(&self, name: &str) -> Option<&Param> {
        self.params.iter().find(|p| p.name == name)
    }
}

/// Roles of a plain gradient graph, given by the user.
#[derive(Clone, Debug, Default)]
pub struct ExplicitRoles {
    pub loss: Option<String>,
    pub seed: Option<String>,
    /// (parameter, gradient tensor)
    pub grads: Vec<(String, String)>,
}

/// A training graph with its signature, ready for passes.
pub struct TrainingGraph {
    pub model: Model,
    pub signature: TrainingSignature,
    /// Parameter values from the checkpoint (ORT artifacts).
    pub checkpoint: Option<Checkpoint>,
    /// The optimizer graph as read, when present.
    pub optimizer_model: Option<ModelProto>,
}

/// The parameter whose ORT accumulation buffer is named `buffer` (`p` for
/// `p_grad.accumulation.buffer`), if the name follows ORT's convention.
pub fn ort_param_of_buffer(buffer: &str) -> Option<&str> {
    buffer.strip_suffix(ORT_BUFFER_SUFFIX)
}

/// Opens an artifacts folder or a single `.onnx` file.
pub fn open(path: &Path, roles: &ExplicitRoles) -> Result<TrainingGraph, SignatureError> {
    if !path.exists() {
        return Err(SignatureError::NotFound {
            path: path.to_path_buf(),
        });
    }
    if path.is_dir() {
        open_artifacts(path)
    } else {
        open_file(path, roles)
    }
}

fn open_artifacts(dir: &Path) -> Result<TrainingGraph, SignatureError> {
    let training_path = dir.join(TRAINING_MODEL);
    if training_path.is_dir() {
        return Err(SignatureError::NotAFile {
            path: training_path,
        });
    }
    if !training_path.is_file() {
        return Err(SignatureError::NoTrainingModel {
            path: dir.to_path_buf(),
        });
    }
    let checkpoint_path = dir.join(CHECKPOINT);
    if !checkpoint_path.exists() {
        return Err(SignatureError::NoCheckpoint {
            path: dir.to_path_buf(),
        });
    }
    // ORT's checkpoint is one file; a folder there is a mistake, not "no checkpoint".
    if checkpoint_path.is_dir() {
        return Err(SignatureError::NotAFile {
            path: checkpoint_path,
        });
    }
    let model = Model::from_proto(crate::model::load_model_with_data(&training_path)?);
    let checkpoint = crate::checkpoint::read_checkpoint(&checkpoint_path)?;
    let optimizer_path = dir.join(OPTIMIZER_MODEL);
    if optimizer_path.is_dir() {
        return Err(SignatureError::NotAFile {
            path: optimizer_path,
        });
    }
    let optimizer_model = if optimizer_path.is_file() {
        Some(crate::model::load_model(&optimizer_path)?)
    } else {
        None
    };
    let eval_path = dir.join(EVAL_MODEL);

    let mut signature = ort_signature(
        &model,
        &training_path,
        Some((&checkpoint, &checkpoint_path)),
    )?;
    if let Some(opt) = &optimizer_model {
        signature.optimizer = Some(ort_optimizer(opt, &optimizer_path, Some(&checkpoint))?);
    }
    signature.source = Source::OrtArtifacts {
        dir: dir.to_path_buf(),
        training_model: training_path,
        checkpoint: Some(checkpoint_path),
        optimizer_model: optimizer_model.as_ref().map(|_| optimizer_path),
        eval_model: eval_path.is_file().then_some(eval_path),
    };
    Ok(TrainingGraph {
        model,
        signature,
        checkpoint: Some(checkpoint),
        optimizer_model,
    })
}

fn open_file(file: &Path, roles: &ExplicitRoles) -> Result<TrainingGraph, SignatureError> {
    from_model(crate::model::load_model_with_data(file)?, roles, file)
}

/// The signature of an in-memory gradient graph; `origin` names it in errors.
pub fn from_model(
    proto: ModelProto,
    roles: &ExplicitRoles,
    origin: &Path,
) -> Result<TrainingGraph, SignatureError> {
    let file = origin;
    if roles.grads.is_empty()
        && proto
            .metadata_props
            .iter()
            .any(|p| p.key() == crate::state::STATE_KEY)
    {
        return step_signature(proto, file);
    }
    let model = Model::from_proto(proto);
    let has_ort_accumulators = model.all_nodes().any(|n| is_ort_accumulator(&model, n));
    let signature = if roles.grads.is_empty() && has_ort_accumulators {
        let mut s = ort_signature(&model, file, None)?;
        s.source = Source::OrtTrainingGraph {
            file: file.to_path_buf(),
        };
        s
    } else {
        plain_signature(&model, file, roles)?
    };
    Ok(TrainingGraph {
        model,
        signature,
        checkpoint: None,
        optimizer_model: None,
    })
}

/// Whether `proto` is a forward model (neither an ORT training graph nor a written step).
pub fn is_forward_model(proto: &ModelProto) -> bool {
    let is_step = proto
        .metadata_props
        .iter()
        .any(|p| p.key() == crate::state::STATE_KEY);
    let has_ort_accumulators = proto.graph.as_ref().is_some_and(|g| {
        g.node.iter().any(|n| {
            crate::ir::normalize_domain(n.domain()) == ORT_ACCUMULATOR.0
                && n.op_type() == ORT_ACCUMULATOR.1
        })
    });
    !is_step && !has_ort_accumulators
}

/// A forward model to be differentiated by the `autodiff` pass: its inputs without
/// initializers are data; loss and parameters are for the pass to find.
pub fn forward(proto: ModelProto, origin: &Path) -> TrainingGraph {
    without_roles(
        proto,
        Source::Forward {
            file: origin.to_path_buf(),
            differentiated: false,
        },
    )
}

/// A graph with no training roles yet (a pass finds them): every input without an
/// initializer is a data input.
pub fn without_roles(proto: ModelProto, source: Source) -> TrainingGraph {
    let model = Model::from_proto(proto);
    let main = model.main();
    let data_inputs = main
        .inputs
        .iter()
        .filter(|(v, _)| model.initializer(*v).is_none())
        .map(|(v, info)| TensorInfo::of(model.name(*v), info.r#type.as_ref()))
        .collect();
    let signature = TrainingSignature {
        source,
        data_inputs,
        loss: String::new(),
        seed: None,
        params: Vec::new(),
        lazy_reset_grad: None,
        optimizer: None,
    };
    TrainingGraph {
        model,
        signature,
        checkpoint: None,
        optimizer_model: None,
    }
}

/// An artifacts folder's eval model as a forward model (`EVAL_MODEL` with the checkpoint's
/// parameter values as initializers): what autodiff differentiates in place of ONNX
/// Runtime's gradient graph, to compare the two routes on the same model.
pub struct EvalForward {
    pub graph: TrainingGraph,
    /// The eval model's first output, its loss.
    pub loss: String,
    /// The checkpoint's frozen parameters.
    pub frozen: Vec<String>,
    /// The eval model's own floating-point initializers: constants to ONNX Runtime, which
    /// autodiff would train unless frozen.
    pub constants: Vec<String>,
}

pub fn eval_model_as_forward(dir: &Path) -> Result<EvalForward, SignatureError> {
    let path = dir.join(EVAL_MODEL);
    let mut proto = crate::model::load_model(&path)?;
    let checkpoint = crate::checkpoint::read_checkpoint(&dir.join(CHECKPOINT))?;
    let missing = |what: &str| SignatureError::Inconsistent {
        file: path.clone(),
        message: format!("the eval model has no {what}"),
    };
    let graph = proto.graph.as_mut().ok_or_else(|| missing("graph"))?;
    let constants = graph
        .initializer
        .iter()
        .filter(|t| {
            use crate::proto::tensor_proto::DataType as D;
            matches!(
                D::try_from(t.data_type()),
                Ok(D::Float | D::Double | D::Float16 | D::Bfloat16)
            )
        })
        .map(|t| t.name().to_string())
        .collect();
    let mut inputs = Vec::new();
    for input in std::mem::take(&mut graph.input) {
        match checkpoint.parameter(input.name()) {
            Some(p) => {
                let mut t = p.to_tensor_proto();
                t.name = Some(input.name().to_string());
                graph.initializer.push(t);
            }
            None => inputs.push(input),
        }
    }
    graph.input = inputs;
    let loss = graph
        .output
        .first()
        .ok_or_else(|| missing("output"))?
        .name()
        .to_string();
    let frozen = checkpoint
        .parameters()
        .filter(|p| checkpoint.is_trainable(&p.name) == Some(false))
        .map(|p| p.name.clone())
        .collect();
    Ok(EvalForward {
        graph: forward(proto, &path),
        loss,
        frozen,
        constants,
    })
}

/// The signature of a rewritten step, from its state manifest: parameters are the `param`
/// (trainable) and `frozen` states. Such a graph is not rewritten again (inspect only).
fn step_signature(proto: ModelProto, file: &Path) -> Result<TrainingGraph, SignatureError> {
    let manifest = crate::state::Manifest::from_model(&proto)
        .map_err(|e| inconsistent(file, e.to_string()))?;
    let model = Model::from_proto(proto);
    let main = model.main();
    let declared = |name: &str| {
        main.inputs
            .iter()
            .find(|(v, _)| model.name(*v) == name)
            .map(|(_, info)| info.r#type.clone())
    };
    let mut data_inputs = Vec::new();
    for name in &manifest.data_inputs {
        let ty = declared(name).ok_or_else(|| {
            inconsistent(
                file,
                format!("data input '{name}' of the manifest is not a graph input"),
            )
        })?;
        data_inputs.push(TensorInfo::of(name, ty.as_ref()));
    }
    let mut params = Vec::new();
    for entry in &manifest.state {
        let trainable = match entry.role {
            crate::state::Role::Param => true,
            crate::state::Role::Frozen => false,
            _ => continue,
        };
        let ty = declared(&entry.input).ok_or_else(|| {
            inconsistent(
                file,
                format!(
                    "state '{}' of the manifest is not a graph input",
                    entry.input
                ),
            )
        })?;
        params.push(param_from_type(
            &entry.input,
            ty.as_ref(),
            trainable,
            None,
            None,
        ));
    }
    let signature = TrainingSignature {
        source: Source::Step {
            file: file.to_path_buf(),
            pipeline: manifest.pipeline.clone(),
            state_pairs: manifest.state.len(),
        },
        data_inputs,
        loss: manifest.loss.clone(),
        seed: None,
        params,
        lazy_reset_grad: None,
        optimizer: None,
    };
    Ok(TrainingGraph {
        model,
        signature,
        checkpoint: None,
        optimizer_model: None,
    })
}

fn is_ort_accumulator(model: &Model, n: crate::ir::NodeId) -> bool {
    let p = &model.node(n).proto;
    (p.domain(), p.op_type()) == ORT_ACCUMULATOR
}

/// The ORT convention, read from the training graph (and the checkpoint when given).
fn ort_signature(
    model: &Model,
    file: &Path,
    checkpoint: Option<(&Checkpoint, &Path)>,
) -> Result<TrainingSignature, SignatureError> {
    let main = model.main();
    let loss_value = main.outputs.first().map(|(v, _)| *v).ok_or_else(|| {
        inconsistent(
            file,
            "the training graph has no outputs; ORT's loss is output 0".into(),
        )
    })?;
    let loss = model.name(loss_value).to_string();
    let seed_name = format!("{loss}{ORT_SEED_SUFFIX}");
    let seed = main
        .initializers
        .iter()
        .any(|(v, _)| model.name(*v) == seed_name)
        .then_some(seed_name);

    // Trainable parameters and their gradients, from the accumulators.
    let mut accumulators = Vec::new();
    let mut lazy_reset_grad = None;
    for n in model.all_nodes().filter(|n| is_ort_accumulator(model, *n)) {
        let node = model.node(n);
        let (Some(Some(buffer)), Some(Some(grad))) = (node.inputs.first(), node.inputs.get(1))
        else {
            return Err(inconsistent(
                file,
                format!(
                    "node '{}' (InPlaceAccumulatorV2) lacks its buffer or gradient input",
                    node.proto.name()
                ),
            ));
        };
        let buffer_name = model.name(*buffer);
        let Some(param) = buffer_name.strip_suffix(ORT_BUFFER_SUFFIX) else {
            return Err(inconsistent(
                file,
                format!("node '{}': accumulation buffer '{buffer_name}' does not end in '{ORT_BUFFER_SUFFIX}', so its parameter is unknown", node.proto.name()),
            ));
        };
        if let Some(Some(reset)) = node.inputs.get(2) {
            lazy_reset_grad = Some(model.name(*reset).to_string());
        }
        let flag = node
            .outputs
            .first()
            .copied()
            .flatten()
            .map(|v| model.name(v).to_string())
            .unwrap_or_default();
        accumulators.push((
            param.to_string(),
            model.name(*grad).to_string(),
            OrtAccumulation {
                buffer_input: buffer_name.to_string(),
                flag_output: flag,
                node: node.proto.name().to_string(),
            },
        ));
    }

    let input_named = |name: &str| main.inputs.iter().find(|(v, _)| model.name(*v) == name);
    let mut params = Vec::new();
    match checkpoint {
        Some((ckpt, ckpt_path)) => {
            for (tensor, trainable) in ckpt
                .trainable
                .iter()
                .map(|t| (t, true))
                .chain(ckpt.frozen.iter().map(|t| (t, false)))
            {
                let Some((_, info)) = input_named(&tensor.name) else {
                    return Err(inconsistent(
                        ckpt_path,
                        format!(
                            "parameter '{}' is not an input of {}",
                            tensor.name,
                            file.display()
                        ),
                    ));
                };
                let (elem_type, shape) = tensor_parts(info.r#type.as_ref());
                let graph_dims: Vec<String> = shape;
                let ckpt_dims: Vec<String> = tensor.dims.iter().map(|d| d.to_string()).collect();
                if graph_dims != ckpt_dims || elem_type != tensor.data_type {
                    return Err(inconsistent(
                        ckpt_path,
                        format!(
                            "parameter '{}' is {} in the checkpoint but {} in {}",
                            tensor.name,
                            TensorInfo {
                                name: String::new(),
                                elem_type: tensor.data_type,
                                shape: ckpt_dims
                            }
                            .type_text(),
                            TensorInfo {
                                name: String::new(),
                                elem_type,
                                shape: graph_dims
                            }
                            .type_text(),
                            file.display()
                        ),
                    ));
                }
                let acc = accumulators.iter().find(|(p, _, _)| *p == tensor.name);
                if trainable && acc.is_none() {
                    return Err(inconsistent(file, format!("trainable parameter '{}' has no InPlaceAccumulatorV2, so its gradient is unknown", tensor.name)));
                }
                params.push(Param {
                    name: tensor.name.clone(),
                    elem_type: tensor.data_type,
                    dims: tensor.dims.clone(),
                    trainable,
                    grad: acc.map(|(_, g, _)| g.clone()),
                    accumulation: acc.map(|(_, _, a)| a.clone()),
                });
            }
            if let Some((p, _, _)) = accumulators
                .iter()
                .find(|(p, _, _)| !ckpt.trainable.iter().any(|t| t.name == *p))
            {
                return Err(inconsistent(ckpt_path, format!("the training graph accumulates a gradient for '{p}', which is not a trainable parameter in the checkpoint")));
            }
        }
        None => {
            // Without a checkpoint, the accumulators name the trainable parameters; frozen
            // ones cannot be told from data inputs and are left as data.
            for (param, grad, acc) in &accumulators {
                let Some((_, info)) = input_named(param) else {
                    return Err(inconsistent(
                        file,
                        format!("accumulated parameter '{param}' is not a graph input"),
                    ));
                };
                params.push(param_from_type(
                    param,
                    info.r#type.as_ref(),
                    true,
                    Some(grad.clone()),
                    Some(acc.clone()),
                ));
            }
        }
    }

    // Report parameters in graph-input order, as the producer declared them.
    let position = |name: &str| main.inputs.iter().position(|(v, _)| model.name(*v) == name);
    params.sort_by_key(|p| position(&p.name));

    let role_inputs: Vec<&str> = params
        .iter()
        .map(|p| p.name.as_str())
        .chain(
            params
                .iter()
                .filter_map(|p| p.accumulation.as_ref().map(|a| a.buffer_input.as_str())),
        )
        .chain(lazy_reset_grad.as_deref())
        .collect();
    let data_inputs = main
        .inputs
        .iter()
        .filter(|(v, _)| !role_inputs.contains(&model.name(*v)))
        .filter(|(v, _)| model.initializer(*v).is_none())
        .map(|(v, info)| TensorInfo::of(model.name(*v), info.r#type.as_ref()))
        .collect();

    Ok(TrainingSignature {
        source: Source::OrtTrainingGraph {
            file: file.to_path_buf(),
        },
        data_inputs,
        loss,
        seed,
        params,
        lazy_reset_grad,
        optimizer: None,
    })
}

fn param_from_type(
    name: &str,
    ty: Option<&TypeProto>,
    trainable: bool,
    grad: Option<String>,
    accumulation: Option<OrtAccumulation>,
) -> Param {
    let (elem_type, shape) = tensor_parts(ty);
    Param {
        name: name.to_string(),
        elem_type,
        dims: shape.iter().map(|d| d.parse().unwrap_or(-1)).collect(),
        trainable,
        grad,
        accumulation,
    }
}

/// Reads the optimizer node of ORT's `optimizer_model.onnx`.
fn ort_optimizer(
    model: &ModelProto,
    file: &Path,
    checkpoint: Option<&Checkpoint>,
) -> Result<Optimizer, SignatureError> {
    let graph = model
        .graph
        .as_ref()
        .ok_or_else(|| inconsistent(file, "no graph".into()))?;
    let known = |n: &&crate::proto::NodeProto| {
        n.domain() == "com.microsoft" && matches!(n.op_type(), "AdamWOptimizer" | "SGDOptimizerV2")
    };
    let node = graph.node.iter().find(known).ok_or_else(|| {
        let ops: std::collections::BTreeSet<String> = graph
            .node
            .iter()
            .map(|n| {
                let domain = crate::ir::normalize_domain(n.domain());
                let domain = if domain.is_empty() { "ai.onnx" } else { domain };
                format!("{domain}::{}", n.op_type())
            })
            .collect();
        let ops: Vec<String> = ops.into_iter().collect();
        inconsistent(
            file,
            if ops.is_empty() {
                "no AdamWOptimizer or SGDOptimizerV2 node (the graph has no nodes)".into()
            } else {
                format!(
                    "no AdamWOptimizer or SGDOptimizerV2 node (found: {})",
                    ops.join(", ")
                )
            },
        )
    })?;
    let float = |name: &str| -> Result<Option<f32>, SignatureError> {
        match node.attribute.iter().find(|a| a.name() == name) {
            None => Ok(None),
            Some(a) if a.r#type() == AttributeType::Float => Ok(Some(a.f())),
            Some(_) => Err(inconsistent(
                file,
                format!(
                    "node '{}' ({}): attribute '{name}' is not a float",
                    node.name(),
                    node.op_type()
                ),
            )),
        }
    };
    let int = |name: &str| -> Result<Option<i64>, SignatureError> {
        match node.attribute.iter().find(|a| a.name() == name) {
            None => Ok(None),
            Some(a) if a.r#type() == AttributeType::Int => Ok(Some(a.i())),
            Some(_) => Err(inconsistent(
                file,
                format!(
                    "node '{}' ({}): attribute '{name}' is not an int",
                    node.name(),
                    node.op_type()
                ),
            )),
        }
    };
    let spec =
        match node.op_type() {
            "AdamWOptimizer" => OptimizerSpec::from(AdamW::from_ort_attributes(
                float,
                int,
                |bias| Ok(bias != 0),
            )?),
            _ => OptimizerSpec::Sgd,
        };
    let group = checkpoint.and_then(|c| c.optimizer_groups.first());
    Ok(Optimizer {
        spec,
        learning_rate: group.map(|g| g.initial_learning_rate),
        step: group.map(|g| g.step),
        source: file.to_path_buf(),
    })
}

/// A plain gradient graph with user-given roles.
fn plain_signature(
    model: &Model,
    file: &Path,
    roles: &ExplicitRoles,
) -> Result<TrainingSignature, SignatureError> {
    let main = model.main();
    let loss = match &roles.loss {
        Some(l) => l.clone(),
        None => {
            let first_output = main
                .outputs
                .first()
                .map(|(v, _)| format!(" ('{}')", model.name(*v)))
                .unwrap_or_default();
            return Err(inconsistent(
                file,
                format!(
                    "no loss given. A forward model (what torch.onnx.export or tf2onnx write) needs --loss-fn cross-entropy|nll|mse|l1|bce-logits, applied to an output (--model-output, default the first{first_output}), or --loss NAME for a scalar loss it computes itself; a plain gradient graph needs --loss NAME and --grad PARAM=TENSOR for each parameter"
                ),
            ));
        }
    };
    let find = |name: &str| model.lookup(crate::ir::BodyId::MAIN, name);
    if find(&loss).is_none() {
        return Err(inconsistent(
            file,
            format!("--loss '{loss}' names no tensor of the graph"),
        ));
    }
    if roles.grads.is_empty() {
        return Err(inconsistent(
            file,
            "no --grad PARAM=TENSOR given: which tensors are gradients?".into(),
        ));
    }
    if let Some(seed) = &roles.seed {
        let is_init = main
            .initializers
            .iter()
            .any(|(v, _)| model.name(*v) == seed);
        if !is_init {
            return Err(inconsistent(
                file,
                format!("--seed '{seed}' is not an initializer of the graph"),
            ));
        }
    }
    let mut params = Vec::new();
    for (param, grad) in &roles.grads {
        let Some(pv) = find(param) else {
            return Err(inconsistent(
                file,
                format!("--grad {param}={grad}: no tensor named '{param}'"),
            ));
        };
        if find(grad).is_none() {
            return Err(inconsistent(
                file,
                format!("--grad {param}={grad}: no tensor named '{grad}'"),
            ));
        }
        let ty = model.value_type(pv);
        params.push(param_from_type(
            param,
            ty.as_ref(),
            true,
            Some(grad.clone()),
            None,
        ));
    }
    let is_param = |v: ValueId| params.iter().any(|p| p.name == model.name(v));
    let data_inputs = main
        .inputs
        .iter()
        .filter(|(v, _)| !is_param(*v) && model.initializer(*v).is_none())
        .map(|(v, info)| TensorInfo::of(model.name(*v), info.r#type.as_ref()))
        .collect();
    Ok(TrainingSignature {
        source: Source::Plain {
            file: file.to_path_buf(),
        },
        data_inputs,
        loss,
        seed: roles.seed.clone(),
        params,
        lazy_reset_grad: None,
        optimizer: None,
    })
}

/// The text form of an optional type, for reports.
pub fn describe_type(ty: Option<&TypeProto>) -> String {
    type_text(ty)
}
