//! Engines that run ONNX graphs: ONNX Runtime through the `ort` crate.

pub mod ort;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Runtime(#[from] crate::runtime::RuntimeError),
    #[error("ONNX Runtime: {context}: {message}")]
    Ort { context: String, message: String },
    #[error("input '{name}': {message}")]
    Input { name: String, message: String },
    #[error("output '{name}': {message}")]
    Output { name: String, message: String },
}
