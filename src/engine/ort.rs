//! ONNX Runtime sessions over our host tensors.

use std::borrow::Cow;

use ::ort::session::{builder::GraphOptimizationLevel, Session, SessionInputValue};
use ::ort::value::{Tensor as OrtTensor, TensorElementType, TensorRef, ValueType};

use super::EngineError;
use crate::data::Tensor;
use crate::proto::ModelProto;

fn ort_err(context: &str) -> impl Fn(::ort::Error) -> EngineError + '_ {
    move |e| EngineError::Ort {
        context: context.to_string(),
        message: e.to_string(),
    }
}

#[derive(Clone, Debug)]
pub struct SessionOptions {
    /// Intra-op threads; 0 lets ONNX Runtime choose.
    pub threads: usize,
    /// Graph optimizations (on by default; tests of exact kernels may turn them off).
    pub optimize: bool,
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions {
            threads: 1,
            optimize: true,
        }
    }
}

/// One ONNX Runtime session on the CPU.
pub struct OrtSession {
    session: Session,
    pub input_names: Vec<String>,
    pub output_names: Vec<String>,
}

impl OrtSession {
    pub fn new(model: &ModelProto, options: &SessionOptions) -> Result<OrtSession, EngineError> {
        let bytes = crate::model::encode_model(model);
        Self::from_bytes(&bytes, options)
    }

    pub fn from_bytes(bytes: &[u8], options: &SessionOptions) -> Result<OrtSession, EngineError> {
        let mut builder = crate::runtime::session_builder()?;
        if options.threads > 0 {
            builder = builder
                .with_intra_threads(options.threads)
                .map_err(|e| ort_err("threads")(e.into()))?;
        }
        let level = if options.optimize {
            GraphOptimizationLevel::All
        } else {
            GraphOptimizationLevel::Disable
        };
        builder = builder
            .with_optimization_level(level)
            .map_err(|e| ort_err("optimization level")(e.into()))?;
        let session = builder
            .commit_from_memory(bytes)
            .map_err(ort_err("loading the model"))?;
        let input_names = session
            .inputs()
            .iter()
            .map(|i| i.name().to_string())
            .collect();
        let output_names = session
            .outputs()
            .iter()
            .map(|o| o.name().to_string())
            .collect();
        Ok(OrtSession {
            session,
            input_names,
            output_names,
        })
    }

    /// Runs the model once; returns every output by name, in the model's output order.
    pub fn run(
        &mut self,
        inputs: &[(&str, &Tensor)],
    ) -> Result<Vec<(String, Tensor)>, EngineError> {
        let mut feeds: Vec<(Cow<'_, str>, SessionInputValue<'_>)> =
            Vec::with_capacity(inputs.len());
        for (name, tensor) in inputs {
            feeds.push((Cow::Owned(name.to_string()), to_ort(name, tensor)?));
        }
        let outputs = self.session.run(feeds).map_err(ort_err("run"))?;
        let mut result = Vec::with_capacity(outputs.len());
        for (name, value) in outputs.iter() {
            result.push((name.to_string(), from_ort(name, &value)?));
        }
        Ok(result)
    }
}

/// The tensor as a session input. Contiguous host arrays (all of ours in practice) are
/// lent to ONNX Runtime without a copy; anything else is copied into standard layout.
fn to_ort<'a>(name: &str, tensor: &'a Tensor) -> Result<SessionInputValue<'a>, EngineError> {
    let err = |e: ::ort::Error| EngineError::Input {
        name: name.to_string(),
        message: e.to_string(),
    };
    macro_rules! lend {
        ($a:expr) => {
            if $a.is_standard_layout() {
                SessionInputValue::from(TensorRef::from_array_view($a).map_err(err)?.into_dyn())
            } else {
                SessionInputValue::from(
                    OrtTensor::from_array($a.as_standard_layout().into_owned())
                        .map_err(err)?
                        .into_dyn(),
                )
            }
        };
    }
    Ok(match tensor {
        Tensor::F32(a) => lend!(a),
        Tensor::F64(a) => lend!(a),
        Tensor::I64(a) => lend!(a),
        Tensor::I32(a) => lend!(a),
        Tensor::Bool(a) => lend!(a),
    })
}

fn from_ort(name: &str, value: &::ort::value::DynValueRef<'_>) -> Result<Tensor, EngineError> {
    let err = |e: ::ort::Error| EngineError::Output {
        name: name.to_string(),
        message: e.to_string(),
    };
    let ty = match value.dtype() {
        ValueType::Tensor { ty, .. } => *ty,
        other => {
            return Err(EngineError::Output {
                name: name.to_string(),
                message: format!("is a {other:?}, not a tensor"),
            })
        }
    };
    Ok(match ty {
        TensorElementType::Float32 => {
            Tensor::F32(value.try_extract_array::<f32>().map_err(err)?.to_owned())
        }
        TensorElementType::Float64 => {
            Tensor::F64(value.try_extract_array::<f64>().map_err(err)?.to_owned())
        }
        TensorElementType::Int64 => {
            Tensor::I64(value.try_extract_array::<i64>().map_err(err)?.to_owned())
        }
        TensorElementType::Int32 => {
            Tensor::I32(value.try_extract_array::<i32>().map_err(err)?.to_owned())
        }
        TensorElementType::Bool => {
            Tensor::Bool(value.try_extract_array::<bool>().map_err(err)?.to_owned())
        }
        other => {
            return Err(EngineError::Output {
                name: name.to_string(),
                message: format!("element type {other:?} is not supported on the host"),
            })
        }
    })
}
