//! The trained model out: a model (a plain forward model whose parameters are initializers,
//! or ONNX Runtime's `eval_model.onnx`, whose parameters are graph inputs) with every tensor
//! the training state holds a value for set to that value.
//!
//! A state file (`--save-state`, `.npz` or `.safetensors`) is keyed by state input names;
//! for parameters and BatchNorm running statistics those are the model's own initializer
//! names, so the match is by name. Entries that are not model tensors (accumulators,
//! moments, counters, the window's BatchNorm sums) match nothing and are left out.
//!
//! - An initializer with a state value keeps its name, dims, data type, doc string and
//!   metadata; its data becomes the state's, little-endian in `raw_data` (the typed data
//!   fields and any external-data reference are cleared).
//! - A graph input with a state value and no initializer (ORT's eval model) becomes an
//!   initializer and stops being a graph input (below IR version 4, where every initializer
//!   must also be an input, it stays one).
//! - Every match is checked: the data type must be equal (or the initializer float16 or
//!   bfloat16 and the value its float32 master, which is rounded to it), and the shape equal to the
//!   initializer's dims or to the input's declared dims (a symbolic dimension takes any
//!   size). A mismatch is an error naming the tensor, both types and shapes and the files,
//!   and nothing is returned, so nothing is written.
//! - With the step's manifest ([`ExportSources::manifest`]) the roles are known: only
//!   `param`, `frozen` and the BatchNorm running statistics themselves are model tensors,
//!   and a `param` or running statistic the model lacks is an error (the model is not the
//!   one that was trained). Without it, a state none of whose entries matches is an error.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use crate::data::Tensor;
use crate::ir::print::elem_type_name;
use crate::proto::{type_proto, ModelProto, TensorProto, TypeProto};
use crate::state::Manifest;
use crate::state::Role;

#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    #[error(
        "tensor '{name}': the model {} has {model}, but {state_file} holds {state}",
        model_file.display()
    )]
    Mismatch {
        name: String,
        model_file: PathBuf,
        /// "the state FILE" (or "the state" when no file was named).
        state_file: String,
        model: String,
        state: String,
    },
    #[error(
        "{state_file} holds {role} '{name}', but the model {} has no initializer or graph input of that name: is it the model that was trained?",
        model_file.display()
    )]
    MissingParam {
        name: String,
        role: String,
        model_file: PathBuf,
        state_file: String,
    },
    #[error(
        "{state_file} has no value for the step's {role} '{name}': is it the state of that step?"
    )]
    StateLacks {
        name: String,
        role: String,
        state_file: String,
    },
    #[error(
        "none of the {count} tensors of {state_file} names an initializer or graph input of the model {}: is it the state of another model?",
        model_file.display()
    )]
    NothingMatches {
        count: usize,
        model_file: PathBuf,
        state_file: String,
    },
    #[error(
        "tensor '{name}': {state_file} holds {count} NaN or infinite values (of {elements}): a model with them computes NaN; export a state saved before training diverged"
    )]
    NotFinite {
        name: String,
        state_file: String,
        count: usize,
        elements: usize,
    },
    #[error("{}: {message}", model_file.display())]
    Model {
        model_file: PathBuf,
        message: String,
    },
}

/// What [`export_trained`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ExportReport {
    /// Initializers whose data was replaced by the state's.
    pub replaced: Vec<String>,
    /// Graph inputs that became initializers.
    pub converted: Vec<String>,
    /// Initializers of the model the state has no value for (constants, or tensors that
    /// were not trained): left as they were.
    pub constants: Vec<String>,
    /// State entries that are not model tensors (accumulators, moments, counters, ...).
    pub not_in_model: Vec<String>,
    /// Graph inputs without a value that remain inputs (the model's data inputs).
    pub inputs: Vec<String>,
}

impl ExportReport {
    /// How many tensors of the model were set.
    pub fn set(&self) -> usize {
        self.replaced.len() + self.converted.len()
    }
}

/// Where the model and the state came from (for the errors), and the step manifest that
/// gives the state's roles, if known.
#[derive(Clone, Copy, Debug)]
pub struct ExportSources<'a> {
    pub model_file: &'a Path,
    pub state_file: Option<&'a Path>,
    pub manifest: Option<&'a Manifest>,
    /// State entries left unread because they name no tensor of the model (accumulators,
    /// moments: [`crate::data::read_state_only`]): reported with the others not in it.
    pub unread_state: &'a [String],
}

/// What a state entry of the step is to the model it came from.
pub(crate) enum ModelTensor {
    /// A tensor of the model that the state must hold (its role, for the errors).
    Required(&'static str),
    /// A tensor of the model the state may hold (a frozen one).
    Optional,
}

/// Whether a state entry is a model tensor: parameters and BatchNorm running statistics
/// must be in the state, frozen tensors may; accumulators, moments, counters and the
/// window's BatchNorm sums are not model tensors.
pub(crate) fn model_tensor(e: &crate::state::StateEntry) -> Option<ModelTensor> {
    match e.role {
        Role::Param => Some(ModelTensor::Required("parameter")),
        Role::BnStat if e.param.as_deref().is_none_or(|p| p == e.input) => {
            Some(ModelTensor::Required("BatchNorm statistic"))
        }
        Role::Frozen => Some(ModelTensor::Optional),
        _ => None,
    }
}

/// The state entries an export of `model` can use, by name: those that name one of its
/// initializers or graph inputs, and those the step's manifest says must be there (its
/// model tensors, [`model_tensor`], so that a missing one is reported as missing from the
/// model). What else a state holds (accumulators, moments, counters)
/// need not be read ([`crate::data::read_state_only`]).
pub fn state_to_read(model: &ModelProto, manifest: Option<&Manifest>) -> Vec<String> {
    let mut names: Vec<String> = model
        .graph
        .iter()
        .flat_map(|g| {
            let initializers = g.initializer.iter().map(|t| t.name());
            initializers.chain(g.input.iter().map(|i| i.name()))
        })
        .map(str::to_string)
        .collect();
    if let Some(m) = manifest {
        names.extend(
            m.state
                .iter()
                .filter(|e| model_tensor(e).is_some())
                .map(|e| e.input.clone()),
        );
    }
    names.sort();
    names.dedup();
    names
}

/// Sets every initializer or graph input of `model` that `state` holds a value for (see
/// the module docs); `origin` names the model file in errors.
pub fn export_trained(
    model: ModelProto,
    state: &BTreeMap<String, Tensor>,
    origin: &Path,
) -> Result<(ModelProto, ExportReport), ExportError> {
    export_trained_with(
        model,
        state,
        &ExportSources {
            model_file: origin,
            state_file: None,
            manifest: None,
            unread_state: &[],
        },
    )
}

/// [`export_trained`] with the state file's name and the step manifest.
pub fn export_trained_with(
    mut model: ModelProto,
    state: &BTreeMap<String, Tensor>,
    sources: &ExportSources<'_>,
) -> Result<(ModelProto, ExportReport), ExportError> {
    let state_file = match sources.state_file {
        Some(p) => format!("the state {}", p.display()),
        None => "the state".to_string(),
    };
    let model_file = sources.model_file.to_path_buf();
    let keep_inputs = model.ir_version.is_some_and(|v| v < 4);
    let graph = model.graph.as_mut().ok_or_else(|| ExportError::Model {
        model_file: model_file.clone(),
        message: "the model has no graph".into(),
    })?;

    // Which state entries may be model tensors, and which must be.
    let (candidates, required): (BTreeSet<&str>, BTreeMap<&str, &'static str>) =
        match sources.manifest {
            None => (state.keys().map(String::as_str).collect(), BTreeMap::new()),
            Some(manifest) => {
                let mut candidates = BTreeSet::new();
                let mut required = BTreeMap::new();
                for e in &manifest.state {
                    match model_tensor(e) {
                        Some(ModelTensor::Required(role)) => {
                            required.insert(e.input.as_str(), role);
                        }
                        Some(ModelTensor::Optional) => {}
                        None => continue,
                    }
                    if state.contains_key(&e.input) {
                        candidates.insert(e.input.as_str());
                    }
                }
                (candidates, required)
            }
        };
    for (name, role) in &required {
        if !state.contains_key(*name) {
            return Err(ExportError::StateLacks {
                name: name.to_string(),
                role: role.to_string(),
                state_file,
            });
        }
    }

    let mismatch = |name: &str, model: String, value: &Tensor| ExportError::Mismatch {
        name: name.to_string(),
        model_file: model_file.clone(),
        state_file: state_file.clone(),
        model,
        state: describe(
            value.elem_type(),
            &value
                .shape()
                .iter()
                .map(|d| Some(*d as i64))
                .collect::<Vec<_>>(),
        ),
    };

    // Check everything first, then change: an error leaves nothing half done (and the
    // caller writes nothing).
    let mut report = ExportReport::default();
    let initializers: BTreeSet<String> = graph
        .initializer
        .iter()
        .map(|t| t.name().to_string())
        .collect();
    for init in &graph.initializer {
        let Some(value) = candidates
            .contains(init.name())
            .then(|| &state[init.name()])
        else {
            report.constants.push(init.name().to_string());
            continue;
        };
        let dims: Vec<Option<i64>> = init.dims.iter().map(|d| Some(*d)).collect();
        let type_ok = init.data_type() == value.elem_type() || master_of_half(init, value);
        if !type_ok || !same_shape(&dims, value.shape(), false) {
            return Err(mismatch(
                init.name(),
                describe(init.data_type(), &dims),
                value,
            ));
        }
        report.replaced.push(init.name().to_string());
    }
    for input in &graph.input {
        let name = input.name();
        if initializers.contains(name) {
            continue;
        }
        let Some(value) = candidates.contains(name).then(|| &state[name]) else {
            report.inputs.push(name.to_string());
            continue;
        };
        let (elem_type, dims) = declared(input.r#type.as_ref());
        let type_ok = elem_type.is_none_or(|t| t == value.elem_type());
        let shape_ok = dims
            .as_ref()
            .is_none_or(|d| same_shape(d, value.shape(), true));
        if !type_ok || !shape_ok {
            let model = match (elem_type, &dims) {
                (Some(t), Some(d)) => describe(t, d),
                (Some(t), None) => format!("{} (no shape)", elem_type_name(t)),
                (None, _) => "an input that is not a tensor".to_string(),
            };
            return Err(mismatch(name, format!("graph input {model}"), value));
        }
        report.converted.push(name.to_string());
    }
    let in_model: BTreeSet<&str> = report
        .replaced
        .iter()
        .chain(&report.converted)
        .map(String::as_str)
        .collect();
    // `train` never saves such a state; a file made or edited elsewhere may hold one.
    for name in &in_model {
        let value = &state[*name];
        let count = value.non_finite_count();
        if count > 0 {
            return Err(ExportError::NotFinite {
                name: name.to_string(),
                state_file,
                count,
                elements: value.shape().iter().product(),
            });
        }
    }
    for (name, role) in &required {
        if !in_model.contains(name) {
            return Err(ExportError::MissingParam {
                name: name.to_string(),
                role: role.to_string(),
                model_file: model_file.clone(),
                state_file: state_file.clone(),
            });
        }
    }
    report.not_in_model = state
        .keys()
        .filter(|k| !in_model.contains(k.as_str()))
        .chain(sources.unread_state)
        .cloned()
        .collect();
    report.not_in_model.sort();
    if in_model.is_empty() {
        return Err(ExportError::NothingMatches {
            count: state.len() + sources.unread_state.len(),
            model_file,
            state_file,
        });
    }

    for init in graph.initializer.iter_mut() {
        if in_model.contains(init.name()) {
            set_data(init, &state[init.name()]);
        }
    }
    for name in &report.converted {
        graph.initializer.push(state[name].to_tensor_proto(name));
    }
    if !keep_inputs {
        let converted: BTreeSet<&str> = report.converted.iter().map(String::as_str).collect();
        graph.input.retain(|i| !converted.contains(i.name()));
    }
    Ok((model, report))
}

/// Whether `value` is the float32 master of the half-precision initializer `init` (a model
/// stored in half precision trains float32 masters: `autodiff`'s `half_model`).
fn master_of_half(init: &TensorProto, value: &Tensor) -> bool {
    use crate::proto::elem::{BFLOAT16, FLOAT16};
    matches!(init.data_type(), FLOAT16 | BFLOAT16) && value.as_f32().is_some()
}

/// Replaces an initializer's data with `value`'s (same name, dims and type, checked by the
/// caller; a float32 master of a half initializer rounded to its type, to nearest even),
/// little-endian in `raw_data`.
fn set_data(init: &mut TensorProto, value: &Tensor) {
    use crate::proto::elem::FLOAT16;
    init.raw_data = match value.as_f32().filter(|_| master_of_half(init, value)) {
        Some(values) => Some(
            values
                .iter()
                .flat_map(|x| match init.data_type() {
                    FLOAT16 => half::f16::from_f32(*x).to_le_bytes(),
                    _ => half::bf16::from_f32(*x).to_le_bytes(),
                })
                .collect(),
        ),
        None => value.to_tensor_proto(init.name()).raw_data,
    };
    init.float_data.clear();
    init.int32_data.clear();
    init.string_data.clear();
    init.int64_data.clear();
    init.double_data.clear();
    init.uint64_data.clear();
    init.external_data.clear();
    init.data_location = None;
    init.segment = None;
}

/// A graph input's declared element type and dims (`None` dims for a symbolic or unknown
/// dimension; `None` altogether when the shape is not declared).
fn declared(ty: Option<&TypeProto>) -> (Option<i32>, Option<Vec<Option<i64>>>) {
    use crate::proto::tensor_shape_proto::dimension::Value as Dim;
    match ty.and_then(|t| t.value.as_ref()) {
        Some(type_proto::Value::TensorType(t)) => (
            Some(t.elem_type()),
            t.shape.as_ref().map(|s| {
                s.dim
                    .iter()
                    .map(|d| match d.value {
                        Some(Dim::DimValue(v)) => Some(v),
                        _ => None,
                    })
                    .collect()
            }),
        ),
        _ => (None, None),
    }
}

/// Whether `shape` fits `dims`; a `None` dim fits any size when `symbolic` allows it.
fn same_shape(dims: &[Option<i64>], shape: &[usize], symbolic: bool) -> bool {
    dims.len() == shape.len()
        && dims.iter().zip(shape).all(|(d, s)| match d {
            Some(d) => *d == *s as i64,
            None => symbolic,
        })
}

/// `float [32, 16]`, with `?` for a symbolic dimension.
fn describe(elem_type: i32, dims: &[Option<i64>]) -> String {
    let dims: Vec<String> = dims
        .iter()
        .map(|d| d.map_or("?".to_string(), |d| d.to_string()))
        .collect();
    format!("{} [{}]", elem_type_name(elem_type), dims.join(", "))
}

/// Reads a model for export with its external data inlined, and the external data files it
/// refers to (so that an output data file can be checked against them).
pub fn load_model_for_export(
    path: &Path,
) -> Result<(ModelProto, Vec<PathBuf>), crate::model::ModelError> {
    use crate::model::{for_each_tensor_mut, load_external_data, load_model};
    let mut model = load_model(path)?;
    let dir = crate::atomic::parent_dir(path);
    let mut files = BTreeSet::new();
    for_each_tensor_mut(&mut model, false, &mut |t, _| {
        if t.is_external() {
            if let Some(entry) = t.external_data.iter().find(|e| e.key() == "location") {
                files.insert(dir.join(entry.value()));
            }
        }
        Ok::<(), std::convert::Infallible>(())
    })
    .unwrap_or_else(|e| match e {});
    if !files.is_empty() {
        load_external_data(&mut model, &dir)?;
    }
    Ok((model, files.into_iter().collect()))
}
