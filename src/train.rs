//! The training loop over a rewritten step: one engine run per micro-batch, the state
//! outputs fed back as the next run's state inputs.

use std::collections::BTreeMap;
use std::path::Path;

use crate::data::Tensor;
use crate::engine::ort::SessionOptions;
use crate::engine::{Engine, EngineError, EngineKind};
use crate::proto::{type_proto, ModelProto};
use crate::step::{Manifest, StepError};

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Step(#[from] StepError),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Data(#[from] crate::data::DataError),
    #[error("{}: {message}", file.display())]
    BadData {
        file: std::path::PathBuf,
        message: String,
    },
    #[error("{}: {message}", file.display())]
    BadState {
        file: std::path::PathBuf,
        message: String,
    },
    #[error("{0}")]
    Model(String),
}

/// Metrics of one micro-step.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct StepMetrics {
    pub step: u64,
    pub loss: f32,
    pub applied: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scale: Option<f32>,
}

/// A data input's declared element type and shape (for checking the data file).
#[derive(Clone, Debug)]
struct InputDecl {
    elem_type: i32,
    /// `None` for a symbolic dimension.
    dims: Vec<Option<i64>>,
}

pub struct Trainer {
    session: Engine,
    pub manifest: Manifest,
    /// Current value of every state input, by input name.
    state: BTreeMap<String, Tensor>,
    data_decls: BTreeMap<String, InputDecl>,
    /// Micro-steps run so far.
    pub steps_done: u64,
}

impl Trainer {
    /// A trainer on ONNX Runtime.
    pub fn new(model: &ModelProto, options: &SessionOptions) -> Result<Trainer, TrainError> {
        Self::with_engine(model, EngineKind::Ort, options)
    }

    /// A trainer on the given engine (`Auto` is resolved by [`EngineKind::resolve`]). The
    /// state loop, metrics and state files are the same on every engine.
    pub fn with_engine(
        model: &ModelProto,
        engine: EngineKind,
        options: &SessionOptions,
    ) -> Result<Trainer, TrainError> {
        let manifest = Manifest::from_model(model)?;
        let graph = model
            .graph
            .as_ref()
            .ok_or_else(|| TrainError::Model("the model has no graph".into()))?;
        let mut state = BTreeMap::new();
        for entry in &manifest.state {
            let init = graph
                .initializer
                .iter()
                .find(|t| t.name() == entry.input)
                .ok_or_else(|| {
                    TrainError::Model(format!(
                        "state input '{}' has no initializer holding its initial value",
                        entry.input
                    ))
                })?;
            let value = Tensor::from_tensor_proto(init)
                .map_err(|m| TrainError::Model(format!("state '{}': {m}", entry.input)))?;
            state.insert(entry.input.clone(), value);
        }
        let mut data_decls = BTreeMap::new();
        for name in &manifest.data_inputs {
            let info = graph
                .input
                .iter()
                .find(|i| i.name() == name)
                .ok_or_else(|| {
                    TrainError::Model(format!("data input '{name}' is not a graph input"))
                })?;
            data_decls.insert(name.clone(), decl(info.r#type.as_ref()));
        }
        let session = Engine::new(engine, model, options)?;
        Ok(Trainer {
            session,
            manifest,
            state,
            data_decls,
            steps_done: 0,
        })
    }

    /// The engine that runs the steps.
    pub fn engine(&self) -> EngineKind {
        self.session.kind()
    }

    /// The current state, by state input name.
    pub fn state(&self) -> &BTreeMap<String, Tensor> {
        &self.state
    }

    /// Replaces the state with values read from an `.npz` written by [`save_state`].
    pub fn load_state(&mut self, path: &Path) -> Result<(), TrainError> {
        let loaded = crate::data::read_npz(path)?;
        let bad = |message: String| TrainError::BadState {
            file: path.to_path_buf(),
            message,
        };
        for (name, current) in &self.state {
            let value = loaded
                .get(name)
                .ok_or_else(|| bad(format!("state '{name}' is missing")))?;
            if value.elem_type() != current.elem_type() || value.shape() != current.shape() {
                return Err(bad(format!(
                    "state '{name}' is {} {:?} in the file but the model wants {} {:?}",
                    crate::ir::print::elem_type_name(value.elem_type()),
                    value.shape(),
                    crate::ir::print::elem_type_name(current.elem_type()),
                    current.shape()
                )));
            }
        }
        if let Some(extra) = loaded.keys().find(|k| !self.state.contains_key(*k)) {
            return Err(bad(format!("'{extra}' is not a state of this model")));
        }
        self.state = loaded;
        Ok(())
    }

    /// Writes every state tensor under its state input name, atomically.
    pub fn save_state(&self, path: &Path) -> Result<(), TrainError> {
        crate::data::write_npz(path, self.state.iter().map(|(k, v)| (k.as_str(), v)))?;
        Ok(())
    }

    /// Checks a data file against the model's data inputs: every input present, element
    /// types equal, trailing dimensions equal, the same number of samples in each.
    pub fn check_data(
        &self,
        data: &BTreeMap<String, Tensor>,
        file: &Path,
    ) -> Result<usize, TrainError> {
        let bad = |message: String| TrainError::BadData {
            file: file.to_path_buf(),
            message,
        };
        let mut samples = None;
        for (name, decl) in &self.data_decls {
            let t = data.get(name).ok_or_else(|| {
                bad(format!(
                    "no array named '{name}' (the model's data inputs: {})",
                    self.manifest.data_inputs.join(", ")
                ))
            })?;
            if t.elem_type() != decl.elem_type {
                return Err(bad(format!(
                    "array '{name}' is {} but the model's input is {}",
                    crate::ir::print::elem_type_name(t.elem_type()),
                    crate::ir::print::elem_type_name(decl.elem_type)
                )));
            }
            let shape = t.shape();
            if shape.len() != decl.dims.len() || shape.is_empty() {
                return Err(bad(format!(
                    "array '{name}' has shape {shape:?}; the model's input has rank {}",
                    decl.dims.len()
                )));
            }
            for (axis, (have, want)) in shape.iter().zip(&decl.dims).enumerate().skip(1) {
                if let Some(want) = want {
                    if *have as i64 != *want {
                        return Err(bad(format!(
                            "array '{name}' has shape {shape:?}; axis {axis} must be {want}"
                        )));
                    }
                }
            }
            match samples {
                None => samples = Some(shape[0]),
                Some(n) if n != shape[0] => {
                    return Err(bad(format!(
                        "array '{name}' has {} samples, others have {n}",
                        shape[0]
                    )));
                }
                _ => {}
            }
        }
        let n = samples.unwrap_or(0);
        if n == 0 {
            return Err(bad("the data holds no samples".into()));
        }
        Ok(n)
    }

    /// Runs one micro-step on `batch` (one tensor per data input). `flush` forces the
    /// window to apply now.
    pub fn step(
        &mut self,
        batch: &BTreeMap<String, Tensor>,
        flush: bool,
    ) -> Result<StepMetrics, TrainError> {
        let flush_value = Tensor::Bool(ndarray::arr0(true).into_dyn());
        let mut feeds: Vec<(&str, &Tensor)> =
            Vec::with_capacity(batch.len() + self.state.len() + 1);
        for name in &self.manifest.data_inputs {
            let t = batch
                .get(name)
                .ok_or_else(|| TrainError::Model(format!("batch lacks data input '{name}'")))?;
            feeds.push((name, t));
        }
        for (name, value) in &self.state {
            feeds.push((name, value));
        }
        if flush {
            feeds.push(("ga.flush", &flush_value));
        }
        let outputs = self.session.run(&feeds)?;
        let mut by_name: BTreeMap<String, Tensor> = outputs.into_iter().collect();
        for entry in &self.manifest.state {
            let next = by_name.remove(&entry.output).ok_or_else(|| {
                TrainError::Model(format!(
                    "the run did not produce state output '{}'",
                    entry.output
                ))
            })?;
            self.state.insert(entry.input.clone(), next);
        }
        let loss = scalar_f32(by_name.get(&self.manifest.loss)).ok_or_else(|| {
            TrainError::Model(format!(
                "loss output '{}' missing or not a float scalar",
                self.manifest.loss
            ))
        })?;
        let applied = match by_name.get("ga.applied") {
            Some(Tensor::Bool(a)) => a.iter().next().copied().unwrap_or(false),
            _ => false,
        };
        let scale = self
            .manifest
            .state
            .iter()
            .find(|e| e.role == crate::state::Role::LossScale)
            .and_then(|e| scalar_f32(self.state.get(&e.input)));
        self.steps_done += 1;
        Ok(StepMetrics {
            step: self.steps_done,
            loss,
            applied,
            scale,
        })
    }
}

fn scalar_f32(t: Option<&Tensor>) -> Option<f32> {
    match t? {
        Tensor::F32(a) if a.len() == 1 => a.iter().next().copied(),
        _ => None,
    }
}

fn decl(ty: Option<&crate::proto::TypeProto>) -> InputDecl {
    use crate::proto::tensor_shape_proto::dimension::Value as Dim;
    match ty.and_then(|t| t.value.as_ref()) {
        Some(type_proto::Value::TensorType(t)) => InputDecl {
            elem_type: t.elem_type(),
            dims: t
                .shape
                .as_ref()
                .map(|s| {
                    s.dim
                        .iter()
                        .map(|d| match d.value {
                            Some(Dim::DimValue(v)) => Some(v),
                            _ => None,
                        })
                        .collect()
                })
                .unwrap_or_default(),
        },
        _ => InputDecl {
            elem_type: 0,
            dims: Vec::new(),
        },
    }
}

/// Micro-step `i` takes samples `[i*B, (i+1)*B)` of the data, wrapping around.
pub fn micro_batch(
    data: &BTreeMap<String, Tensor>,
    samples: usize,
    batch: usize,
    step: u64,
) -> BTreeMap<String, Tensor> {
    let start = ((step % samples as u64) as usize * (batch % samples)) % samples;
    let rows: Vec<usize> = (0..batch).map(|j| (start + j) % samples).collect();
    data.iter()
        .map(|(k, v)| (k.clone(), v.rows(&rows)))
        .collect()
}
