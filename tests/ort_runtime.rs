//! Loads ONNX Runtime through `onnx_ga::runtime` and runs small models built in memory with the
//! crate's prost types, checking outputs against closed-form results.
//!
//! Without ONNX Runtime these tests print why and pass (skip), unless `CI=true`, where they fail;
//! see `onnx_ga::runtime::require_onnxruntime_for_tests`. Get the library with
//! `bash scripts/install-ort.sh`.

use onnx_ga::proto::{
    attribute_proto::AttributeType, tensor_proto::DataType, tensor_shape_proto, type_proto,
    AttributeProto, GraphProto, ModelProto, NodeProto, OperatorSetIdProto, TensorProto,
    TensorShapeProto, TypeProto, ValueInfoProto,
};
use onnx_ga::runtime;
use ort::value::Tensor;
use prost::Message;

fn float_value_info(name: &str, dims: &[i64]) -> ValueInfoProto {
    ValueInfoProto {
        name: Some(name.to_string()),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: Some(DataType::Float as i32),
                shape: Some(TensorShapeProto {
                    dim: dims
                        .iter()
                        .map(|&d| tensor_shape_proto::Dimension {
                            value: Some(tensor_shape_proto::dimension::Value::DimValue(d)),
                            ..Default::default()
                        })
                        .collect(),
                }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn node(
    op_type: &str,
    inputs: &[&str],
    outputs: &[&str],
    attribute: Vec<AttributeProto>,
) -> NodeProto {
    NodeProto {
        op_type: Some(op_type.to_string()),
        name: Some(format!("{op_type}_0")),
        input: inputs.iter().map(|s| s.to_string()).collect(),
        output: outputs.iter().map(|s| s.to_string()).collect(),
        attribute,
        ..Default::default()
    }
}

fn model(graph: GraphProto) -> Vec<u8> {
    ModelProto {
        ir_version: Some(10),
        opset_import: vec![OperatorSetIdProto {
            domain: Some(String::new()),
            version: Some(21),
        }],
        producer_name: Some("onnx-ga tests".to_string()),
        graph: Some(graph),
        ..Default::default()
    }
    .encode_to_vec()
}

fn run_f32(
    model_bytes: &[u8],
    inputs: Vec<(&'static str, Vec<i64>, Vec<f32>)>,
    output: &str,
) -> (Vec<i64>, Vec<f32>) {
    let mut session = runtime::session_builder()
        .expect("session builder")
        .commit_from_memory(model_bytes)
        .expect("ONNX Runtime rejected the test model");
    let mut values = Vec::new();
    for (name, shape, data) in inputs {
        values.push((
            name,
            Tensor::from_array((shape, data)).expect("input tensor"),
        ));
    }
    let outputs = session
        .run(
            values
                .into_iter()
                .map(|(n, t)| (n, ort::session::SessionInputValue::from(t)))
                .collect::<Vec<_>>(),
        )
        .expect("session run");
    let (shape, data) = outputs[output]
        .try_extract_tensor::<f32>()
        .expect("float output");
    (shape.to_vec(), data.to_vec())
}

#[test]
fn add_two_float_inputs() {
    let Some(lib) = runtime::require_onnxruntime_for_tests() else {
        return;
    };
    eprintln!("ONNX Runtime: {}", lib.display());

    let bytes = model(GraphProto {
        name: Some("add".to_string()),
        node: vec![node("Add", &["a", "b"], &["y"], vec![])],
        input: vec![
            float_value_info("a", &[2, 3]),
            float_value_info("b", &[2, 3]),
        ],
        output: vec![float_value_info("y", &[2, 3])],
        ..Default::default()
    });
    let a: Vec<f32> = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
    let b: Vec<f32> = vec![0.5, -1.0, 10.0, 0.25, -6.0, 100.0];
    let (shape, y) = run_f32(
        &bytes,
        vec![("a", vec![2, 3], a.clone()), ("b", vec![2, 3], b.clone())],
        "y",
    );

    assert_eq!(shape, vec![2, 3]);
    let expect: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
    assert_eq!(y, expect, "Add is exact for these values");
}

/// Gemm with a raw_data initializer, a float_data bias and attributes:
/// Y = alpha * A · Bᵀ + beta * C.
#[test]
fn gemm_with_initializers_and_attributes() {
    let Some(_lib) = runtime::require_onnxruntime_for_tests() else {
        return;
    };

    let (m, k, n) = (2usize, 3usize, 4usize);
    let (alpha, beta) = (0.5f32, 2.0f32);
    let a: Vec<f32> = (0..m * k).map(|i| i as f32 - 2.0).collect();
    let b: Vec<f32> = (0..n * k).map(|i| (i as f32) * 0.25 - 1.0).collect(); // [n, k], used transposed
    let c: Vec<f32> = vec![1.0, -1.0, 0.5, 3.0]; // [n], broadcast over rows

    let b_init = TensorProto {
        name: Some("B".to_string()),
        dims: vec![n as i64, k as i64],
        data_type: Some(DataType::Float as i32),
        raw_data: Some(b.iter().flat_map(|x| x.to_le_bytes()).collect()),
        ..Default::default()
    };
    let c_init = TensorProto {
        name: Some("C".to_string()),
        dims: vec![n as i64],
        data_type: Some(DataType::Float as i32),
        float_data: c.clone(),
        ..Default::default()
    };
    let float_attr = |name: &str, f: f32| AttributeProto {
        name: Some(name.to_string()),
        r#type: Some(AttributeType::Float as i32),
        f: Some(f),
        ..Default::default()
    };
    let trans_b = AttributeProto {
        name: Some("transB".to_string()),
        r#type: Some(AttributeType::Int as i32),
        i: Some(1),
        ..Default::default()
    };
    let bytes = model(GraphProto {
        name: Some("gemm".to_string()),
        node: vec![node(
            "Gemm",
            &["A", "B", "C"],
            &["Y"],
            vec![
                float_attr("alpha", alpha),
                float_attr("beta", beta),
                trans_b,
            ],
        )],
        initializer: vec![b_init, c_init],
        input: vec![float_value_info("A", &[m as i64, k as i64])],
        output: vec![float_value_info("Y", &[m as i64, n as i64])],
        ..Default::default()
    });

    let (shape, y) = run_f32(
        &bytes,
        vec![("A", vec![m as i64, k as i64], a.clone())],
        "Y",
    );
    assert_eq!(shape, vec![m as i64, n as i64]);
    for i in 0..m {
        for j in 0..n {
            let dot: f32 = (0..k).map(|p| a[i * k + p] * b[j * k + p]).sum();
            let expect = alpha * dot + beta * c[j];
            let got = y[i * n + j];
            assert!(
                (got - expect).abs() <= 1e-5 * expect.abs().max(1.0),
                "Y[{i},{j}] = {got}, expected {expect}"
            );
        }
    }
}

#[test]
fn version_is_at_least_1_31() {
    let Some(_lib) = runtime::require_onnxruntime_for_tests() else {
        return;
    };
    let info = runtime::onnxruntime_build_info().expect("build info");
    eprintln!("{info}");
    let version = runtime::onnxruntime_version()
        .expect("runtime")
        .expect("a version in the build info or file name");
    eprintln!("ONNX Runtime version {version}");
    let mut parts = version.split('.').map(|p| p.parse::<u32>().unwrap());
    let (major, minor) = (parts.next().unwrap(), parts.next().unwrap());
    assert!(
        major > 1 || (major == 1 && minor >= 31),
        "ort api-31 needs ONNX Runtime >= 1.31, got {version}"
    );
    // Idempotent: a second init returns the same library.
    assert_eq!(runtime::init_onnxruntime().unwrap(), _lib);
}
