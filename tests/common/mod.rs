//! Helpers shared by integration tests: ONNX Runtime availability, running models, comparing
//! tensors with stated tolerances.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use onnx_ga::data::Tensor;
use onnx_ga::engine::ort::{OrtSession, SessionOptions};
use onnx_ga::proto::ModelProto;

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// True when ONNX Runtime is available; under CI=true a missing library fails the test.
pub fn ort_available() -> bool {
    onnx_ga::runtime::require_onnxruntime_for_tests().is_some()
}

/// Runs `model` once on ONNX Runtime (one thread) and returns its outputs by name.
pub fn run_ort(model: &ModelProto, inputs: &BTreeMap<String, Tensor>) -> BTreeMap<String, Tensor> {
    let mut session = OrtSession::new(model, &SessionOptions::default())
        .unwrap_or_else(|e| panic!("session: {e}"));
    let feeds: Vec<(&str, &Tensor)> = session
        .input_names
        .iter()
        .filter_map(|n| inputs.get_key_value(n))
        .map(|(n, t)| (n.as_str(), t))
        .collect();
    session
        .run(&feeds)
        .unwrap_or_else(|e| panic!("run: {e}"))
        .into_iter()
        .collect()
}

pub fn read_npz(path: &Path) -> BTreeMap<String, Tensor> {
    onnx_ga::data::read_npz(path).unwrap_or_else(|e| panic!("{e}"))
}

/// Asserts |a - b| <= atol + rtol * |b| elementwise, with a message naming the tensor and
/// the worst element.
pub fn assert_close(name: &str, actual: &Tensor, expected: &Tensor, rtol: f64, atol: f64) {
    assert_eq!(actual.shape(), expected.shape(), "{name}: shape");
    let (a, b): (Vec<f64>, Vec<f64>) = match (actual, expected) {
        (Tensor::F32(a), Tensor::F32(b)) => (
            a.iter().map(|v| *v as f64).collect(),
            b.iter().map(|v| *v as f64).collect(),
        ),
        (Tensor::F64(a), Tensor::F64(b)) => {
            (a.iter().copied().collect(), b.iter().copied().collect())
        }
        (Tensor::I64(a), Tensor::I64(b)) => (
            a.iter().map(|v| *v as f64).collect(),
            b.iter().map(|v| *v as f64).collect(),
        ),
        (Tensor::Bool(a), Tensor::Bool(b)) => (
            a.iter().map(|v| *v as u8 as f64).collect(),
            b.iter().map(|v| *v as u8 as f64).collect(),
        ),
        _ => panic!("{name}: element types differ: {actual:?} vs {expected:?}"),
    };
    let mut worst: Option<(usize, f64, f64, f64)> = None;
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        let excess = (x - y).abs() - (atol + rtol * y.abs());
        if (excess.is_nan() || excess > 0.0)
            && worst.is_none_or(|w| excess > w.3 || excess.is_nan())
        {
            worst = Some((i, *x, *y, excess));
        }
    }
    if let Some((i, x, y, _)) = worst {
        panic!("{name}: element {i}: got {x:e}, expected {y:e} (|diff| {:e}, rtol {rtol:e}, atol {atol:e})", (x - y).abs());
    }
}
