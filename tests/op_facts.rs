//! The op facts of `onnx_ga::ops` against the ONNX Runtime the tests use (1.31.1): every
//! contrib op `STANDARD_CONTRIB` lists has a schema and a CPU kernel (a one-node model
//! loads, or reaches the kernel's own checks), and the contrib ops its comment says are
//! absent are refused for want of a schema or a kernel. A newer ONNX Runtime that changes
//! either fails here instead of in a user's run.

use crate::common;

use onnx_ga::engine::ort::{OrtSession, SessionOptions};
use onnx_ga::proto::{
    tensor_proto::DataType, type_proto, GraphProto, ModelProto, NodeProto, OperatorSetIdProto,
    TypeProto, ValueInfoProto,
};

fn float(name: &str) -> ValueInfoProto {
    ValueInfoProto {
        name: Some(name.into()),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: Some(DataType::Float as i32),
                shape: None,
            })),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A model of one `com.microsoft::op` node with `inputs` float inputs and one output.
fn one_node(op: &str, inputs: usize) -> ModelProto {
    let names: Vec<String> = (0..inputs).map(|i| format!("x{i}")).collect();
    ModelProto {
        ir_version: Some(8),
        opset_import: vec![
            OperatorSetIdProto {
                domain: Some(String::new()),
                version: Some(17),
            },
            OperatorSetIdProto {
                domain: Some("com.microsoft".into()),
                version: Some(1),
            },
        ],
        graph: Some(GraphProto {
            name: Some("g".into()),
            node: vec![NodeProto {
                op_type: Some(op.into()),
                domain: Some("com.microsoft".into()),
                input: names.clone(),
                output: vec!["y".into()],
                ..Default::default()
            }],
            input: names.iter().map(|n| float(n)).collect(),
            output: vec![float("y")],
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// What ONNX Runtime says of the op: `Ok` when some one-node model of it (1 to 3 inputs)
/// loads, else an error: one that says the schema or the kernel is missing when any does
/// (a wrong input count or type says nothing about either).
fn load(op: &str) -> Result<(), String> {
    let mut errors = Vec::new();
    for inputs in 1..=3 {
        match OrtSession::new(&one_node(op, inputs), &SessionOptions::default()) {
            Ok(_) => return Ok(()),
            Err(e) => errors.push(e.to_string()),
        }
    }
    let last = errors.last().cloned().unwrap_or_default();
    Err(errors.into_iter().find(|e| missing(e)).unwrap_or(last))
}

fn missing(error: &str) -> bool {
    error.contains("is not a registered function/op")
        || error.contains("Could not find an implementation")
}

#[test]
fn standard_contrib_ops_have_a_schema_and_a_cpu_kernel() {
    if !common::ort_available() {
        return;
    }
    let wrong: Vec<String> = onnx_ga::ops::STANDARD_CONTRIB
        .iter()
        .filter_map(|op| match load(op) {
            Err(e) if missing(&e) => Some(format!("{op}: {e}")),
            _ => None,
        })
        .collect();
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn contrib_ops_measured_absent_are_refused() {
    if !common::ort_available() {
        return;
    }
    for op in [
        "LayerNormalization",
        "SimplifiedLayerNormalization",
        "SoftmaxCrossEntropyLoss",
        "BiasDropout",
        "BitmaskDropout",
        "Rfft",
    ] {
        assert!(!onnx_ga::ops::is_standard_contrib(op), "{op}");
        match load(op) {
            Err(e) => assert!(missing(&e), "{op}: refused for another reason: {e}"),
            Ok(()) => panic!("{op} loads in standard ONNX Runtime: update onnx_ga::ops"),
        }
    }
}
