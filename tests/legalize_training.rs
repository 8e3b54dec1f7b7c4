//! `legalize-training`: ONNX's own training ops (`ai.onnx.preview.training` Adam, Adagrad,
//! Momentum) lowered to standard ops and run on standard ONNX Runtime.
//!
//! - The onnx package's backend test cases (corpus/generated/node/test_adam, ...: build it
//!   with scripts/fetch-corpus.sh), through the library and through `onnx-ga rewrite
//!   --pipeline legalize-training`, against their expected outputs.
//! - Hand-built nodes for what those cases leave out (they all run at T = 0): bias
//!   correction, learning-rate decay, post-update regularisation, `[1]`-shaped R and T,
//!   double tensors with a float R, unused outputs, against the spec's formulas in f64.
//! - Bad nodes: each an error naming the node, the op and what is wrong.

use crate::common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::{ort_available, root, run_ort};
use ndarray::{ArrayD, IxDyn};
use onnx_ga::data::Tensor;
use onnx_ga::ir::builder::{attr_float, attr_string};
use onnx_ga::ir::tensor_type;
use onnx_ga::passes::legalize_training::{open_for_pipeline, DOMAIN};
use onnx_ga::proto::{
    AttributeProto, GraphProto, ModelProto, NodeProto, OperatorSetIdProto, TensorProto,
    ValueInfoProto,
};
use onnx_ga::signature::ExplicitRoles;
use prost::Message;

const RTOL: f64 = 1e-6;
const ATOL: f64 = 1e-7;

const FLOAT: i32 = 1;
const INT64: i32 = 7;
const DOUBLE: i32 = 11;

// ---- the backend test cases ------------------------------------------------------------

/// corpus/generated/node/`name` with its data set, or `None` (a skip that says so) when the
/// corpus is not built; under CI=true a missing corpus fails.
fn corpus_case(name: &str) -> Option<PathBuf> {
    // Node cases live under node/, the model cases (test_gradient_of_*) under simple/.
    let kind = if name.starts_with("test_gradient_of") {
        "simple"
    } else {
        "node"
    };
    let dir = root().join("corpus/generated").join(kind).join(name);
    let data = dir.join("test_data_set_0");
    if dir.join("model.onnx").is_file() && data.is_dir() {
        return Some(dir);
    }
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "{} is missing under CI=true: run scripts/fetch-corpus.sh (FORCE=1 for a corpus \
         built before it wrote the data sets)",
        data.display()
    );
    eprintln!(
        "SKIPPED: {} not found (run scripts/fetch-corpus.sh)",
        data.display()
    );
    None
}

/// The `input_*.pb` (or `output_*.pb`) tensors of a test data set, by their names, in order.
fn read_pbs(dir: &Path, prefix: &str) -> Vec<(String, Tensor)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with(prefix))
        .collect();
    files.sort_by_key(|p| {
        let stem = p.file_stem().unwrap().to_string_lossy().into_owned();
        stem[prefix.len()..].parse::<usize>().unwrap()
    });
    assert!(!files.is_empty(), "no {prefix}*.pb in {}", dir.display());
    files
        .iter()
        .map(|p| {
            let t = TensorProto::decode(std::fs::read(p).unwrap().as_slice()).unwrap();
            let tensor =
                Tensor::from_tensor_proto(&t).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (t.name().to_string(), tensor)
        })
        .collect()
}

/// The model through `open_for_pipeline` and `build_step` with `legalize-training`, as
/// `rewrite` runs it (verifying after the pass).
fn lower_file(path: &Path) -> ModelProto {
    let graph = open_for_pipeline(path, &ExplicitRoles::default(), "legalize-training")
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    onnx_ga::step::build_step(graph, "legalize-training", true)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .model
        .to_proto()
}

/// Only default-domain nodes are left, and the training domain is no longer imported.
fn assert_standard(model: &ModelProto) {
    let graph = model.graph.as_ref().unwrap();
    for n in &graph.node {
        assert!(
            n.domain().is_empty() || n.domain() == "ai.onnx",
            "node '{}' ({}::{}) left after legalize-training",
            n.name(),
            n.domain(),
            n.op_type()
        );
    }
    assert!(
        !model.opset_import.iter().any(|o| o.domain() == DOMAIN),
        "the {DOMAIN} opset import is still declared"
    );
    assert!(model
        .opset_import
        .iter()
        .any(|o| o.domain().is_empty() && o.version() >= 9));
}

/// Max |diff| and max |diff| / |expected| over every element.
fn errors(actual: &Tensor, expected: &Tensor) -> (f64, f64) {
    let values = |t: &Tensor| -> Vec<f64> {
        match t {
            Tensor::F32(a) => a.iter().map(|v| *v as f64).collect(),
            Tensor::F64(a) => a.iter().copied().collect(),
            other => panic!("not a float tensor: {other:?}"),
        }
    };
    let (a, b) = (values(actual), values(expected));
    a.iter().zip(&b).fold((0.0, 0.0), |(abs, rel), (x, y)| {
        let d = (x - y).abs();
        (
            f64::max(abs, d),
            f64::max(rel, d / y.abs().max(f64::MIN_POSITIVE)),
        )
    })
}

/// Runs `model` on the data set's inputs; every expected output within RTOL/ATOL, same
/// names, shapes and types. Prints the max errors.
fn check_outputs(case: &str, model: &ModelProto, data: &Path) {
    let inputs: BTreeMap<String, Tensor> = read_pbs(data, "input_").into_iter().collect();
    let expected = read_pbs(data, "output_");
    let outputs = run_ort(model, &inputs);
    assert_eq!(
        outputs.len(),
        expected.len(),
        "{case}: outputs {:?}",
        outputs.keys().collect::<Vec<_>>()
    );
    let (mut abs, mut rel) = (0.0f64, 0.0f64);
    for (name, want) in &expected {
        let got = outputs
            .get(name)
            .unwrap_or_else(|| panic!("{case}: no output '{name}'"));
        common::assert_close(&format!("{case}: {name}"), got, want, RTOL, ATOL);
        let (a, r) = errors(got, want);
        abs = abs.max(a);
        rel = rel.max(r);
    }
    eprintln!("{case}: max |diff| {abs:e}, max relative {rel:e}");
}

fn backend_case(name: &str) {
    let Some(dir) = corpus_case(name) else { return };
    let lowered = lower_file(&dir.join("model.onnx"));
    assert_standard(&lowered);
    // Same interface as the original.
    let original = onnx_ga::model::load_model(&dir.join("model.onnx")).unwrap();
    let names = |m: &ModelProto, inputs: bool| -> Vec<String> {
        let g = m.graph.as_ref().unwrap();
        let list = if inputs { &g.input } else { &g.output };
        list.iter().map(|v| v.name().to_string()).collect()
    };
    assert_eq!(names(&lowered, true), names(&original, true));
    assert_eq!(names(&lowered, false), names(&original, false));
    if !ort_available() {
        return;
    }
    check_outputs(name, &lowered, &dir.join("test_data_set_0"));
}

#[test]
fn adam() {
    backend_case("test_adam");
}

#[test]
fn adam_multiple() {
    backend_case("test_adam_multiple");
}

#[test]
fn adagrad() {
    backend_case("test_adagrad");
}

#[test]
fn adagrad_multiple() {
    backend_case("test_adagrad_multiple");
}

#[test]
fn momentum() {
    backend_case("test_momentum");
}

#[test]
fn momentum_multiple() {
    backend_case("test_momentum_multiple");
}

#[test]
fn nesterov_momentum() {
    backend_case("test_nesterov_momentum");
}

// ---- the rewrite CLI -------------------------------------------------------------------

/// `onnx-ga rewrite corpus/.../model.onnx --pipeline legalize-training -o OUT.onnx`, then OUT
/// on ONNX Runtime against the expected outputs.
fn cli_case(name: &str) {
    let Some(dir) = corpus_case(name) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("lowered.onnx");
    let run = Command::new(env!("CARGO_BIN_EXE_onnx-ga"))
        .arg("rewrite")
        .arg(dir.join("model.onnx"))
        .args(["--pipeline", "legalize-training", "-o"])
        .arg(&out)
        .output()
        .expect("run onnx-ga");
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{name}: rewrite failed:\n{stderr}");
    assert!(stderr.contains("legalize-training: changed"), "{stderr}");
    let lowered = onnx_ga::model::load_model(&out).unwrap();
    assert_standard(&lowered);
    if !ort_available() {
        return;
    }
    check_outputs(
        &format!("{name} (cli)"),
        &lowered,
        &dir.join("test_data_set_0"),
    );
}

#[test]
fn cli_adam() {
    cli_case("test_adam_multiple");
}

#[test]
fn cli_adagrad() {
    cli_case("test_adagrad_multiple");
}

#[test]
fn cli_momentum() {
    cli_case("test_nesterov_momentum");
}

// ---- hand-built nodes against the spec's formulas ----------------------------------------

/// A one-node model: `op` of the training domain over `inputs` (name, type, dims), with
/// `outputs` (name, type, dims) as graph outputs; `node_outputs` lists the node's outputs
/// ("" for an omitted one), which may include values that are not graph outputs.
fn one_node(
    op: &str,
    attributes: Vec<AttributeProto>,
    inputs: &[(&str, i32, &[i64])],
    node_outputs: &[&str],
    outputs: &[(&str, i32, &[i64])],
) -> ModelProto {
    let info = |(name, elem, dims): &(&str, i32, &[i64])| ValueInfoProto {
        name: Some(name.to_string()),
        r#type: Some(tensor_type(*elem, dims)),
        ..Default::default()
    };
    ModelProto {
        ir_version: Some(8),
        opset_import: vec![
            OperatorSetIdProto {
                domain: Some(String::new()),
                version: Some(17),
            },
            OperatorSetIdProto {
                domain: Some(DOMAIN.into()),
                version: Some(1),
            },
        ],
        graph: Some(GraphProto {
            name: Some(format!("one_{op}")),
            node: vec![NodeProto {
                name: Some(format!("the_{op}")),
                op_type: Some(op.into()),
                domain: Some(DOMAIN.into()),
                input: inputs.iter().map(|i| i.0.to_string()).collect(),
                output: node_outputs.iter().map(|o| o.to_string()).collect(),
                attribute: attributes,
                ..Default::default()
            }],
            input: inputs.iter().map(info).collect(),
            output: outputs.iter().map(info).collect(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn lower_proto(model: &ModelProto) -> Result<ModelProto, String> {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("model.onnx");
    onnx_ga::model::save_model(model, &path).unwrap();
    let graph = open_for_pipeline(&path, &ExplicitRoles::default(), "legalize-training")
        .map_err(|e| e.to_string())?;
    onnx_ga::step::build_step(graph, "legalize-training", true)
        .map(|s| s.model.to_proto())
        .map_err(|e| e.to_string())
}

fn f32s(dims: &[usize], v: &[f64]) -> Tensor {
    Tensor::F32(ArrayD::from_shape_vec(IxDyn(dims), v.iter().map(|x| *x as f32).collect()).unwrap())
}

fn f64s(dims: &[usize], v: &[f64]) -> Tensor {
    Tensor::F64(ArrayD::from_shape_vec(IxDyn(dims), v.to_vec()).unwrap())
}

fn i64s(dims: &[usize], v: &[i64]) -> Tensor {
    Tensor::I64(ArrayD::from_shape_vec(IxDyn(dims), v.to_vec()).unwrap())
}

/// The values of a float tensor in f64 (f32 values exactly).
fn values(t: &Tensor) -> Vec<f64> {
    match t {
        Tensor::F32(a) => a.iter().map(|v| *v as f64).collect(),
        Tensor::F64(a) => a.iter().copied().collect(),
        other => panic!("not a float tensor: {other:?}"),
    }
}

/// An attribute's value as the node stores it (f32), in f64.
fn f(v: f32) -> f64 {
    v as f64
}

/// Runs the lowered `model` on `feeds` and compares each named output to `expected`.
fn run_and_compare(
    case: &str,
    model: &ModelProto,
    feeds: &[(&str, Tensor)],
    expected: &[(&str, Tensor)],
    rtol: f64,
    atol: f64,
) {
    let lowered = lower_proto(model).unwrap_or_else(|e| panic!("{case}: {e}"));
    assert_standard(&lowered);
    if !ort_available() {
        return;
    }
    let feeds: BTreeMap<String, Tensor> = feeds
        .iter()
        .map(|(n, t)| (n.to_string(), t.clone()))
        .collect();
    let outputs = run_ort(&lowered, &feeds);
    let (mut abs, mut rel) = (0.0f64, 0.0f64);
    for (name, want) in expected {
        let got = outputs
            .get(*name)
            .unwrap_or_else(|| panic!("{case}: no output '{name}'"));
        common::assert_close(&format!("{case}: {name}"), got, want, rtol, atol);
        let (a, r) = errors(got, want);
        abs = abs.max(a);
        rel = rel.max(r);
    }
    eprintln!("{case}: max |diff| {abs:e}, max relative {rel:e}");
}

/// Adam after the first step (bias correction), with both regularisations, two tensors of
/// different shapes; the spec's formulas in f64 on the same f32 inputs.
#[test]
fn adam_bias_corrected_with_post_regularisation() {
    let (alpha, beta, eps, norm, post) = (0.9f32, 0.999f32, 1e-6f32, 0.01f32, 0.002f32);
    let attributes = vec![
        attr_float("alpha", alpha),
        attr_float("beta", beta),
        attr_float("epsilon", eps),
        attr_float("norm_coefficient", norm),
        attr_float("norm_coefficient_post", post),
    ];
    let inputs: &[(&str, i32, &[i64])] = &[
        ("R", FLOAT, &[]),
        ("T", INT64, &[]),
        ("X1", FLOAT, &[3]),
        ("X2", FLOAT, &[2, 2]),
        ("G1", FLOAT, &[3]),
        ("G2", FLOAT, &[2, 2]),
        ("V1", FLOAT, &[3]),
        ("V2", FLOAT, &[2, 2]),
        ("H1", FLOAT, &[3]),
        ("H2", FLOAT, &[2, 2]),
    ];
    let outs = ["X1_new", "X2_new", "V1_new", "V2_new", "H1_new", "H2_new"];
    let shapes: [&[i64]; 6] = [&[3], &[2, 2], &[3], &[2, 2], &[3], &[2, 2]];
    let outputs: Vec<(&str, i32, &[i64])> = outs
        .iter()
        .zip(shapes)
        .map(|(n, s)| (*n, FLOAT, s))
        .collect();
    let model = one_node("Adam", attributes, inputs, &outs, &outputs);

    let (r, t) = (0.05f32, 3i64);
    let tensors = [
        vec![1.5, -0.7, 2.25],
        vec![0.3, -1.1, 0.8, 4.0],
        vec![0.2, -0.35, 1.0],
        vec![-0.05, 0.4, -2.0, 0.125],
        vec![0.1, -0.02, 0.3],
        vec![0.0, 0.05, -0.4, 0.2],
        vec![0.01, 0.002, 0.5],
        vec![0.3, 0.001, 2.0, 0.04],
    ];
    let dims: [&[usize]; 2] = [&[3], &[2, 2]];
    let mut feeds = vec![("R", f32s(&[], &[r as f64])), ("T", i64s(&[], &[t]))];
    for (k, v) in tensors.iter().enumerate() {
        feeds.push((inputs[2 + k].0, f32s(dims[k % 2], v)));
    }
    let (a, b) = (f(alpha), f(beta));
    let rate = f(r) * (1.0 - b.powi(t as i32)).sqrt() / (1.0 - a.powi(t as i32));
    let mut expected = Vec::new();
    let mut news = [
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
    ];
    for i in 0..2 {
        let [x, g, v, h] = [0, 1, 2, 3].map(|role| values(&feeds[2 + role * 2 + i].1));
        for e in 0..x.len() {
            let g = f(norm) * x[e] + g[e];
            let v_new = a * v[e] + (1.0 - a) * g;
            let h_new = b * h[e] + (1.0 - b) * g * g;
            let x_new = x[e] - rate * v_new / (h_new.sqrt() + f(eps));
            news[i].push((1.0 - f(post)) * x_new);
            news[2 + i].push(v_new);
            news[4 + i].push(h_new);
        }
    }
    for (k, n) in news.iter().enumerate() {
        expected.push((outs[k], f32s(dims[k % 2], n)));
    }
    run_and_compare("adam T=3", &model, &feeds, &expected, RTOL, ATOL);
}

/// Adagrad with learning-rate decay at T = 4, R and T shaped `[1]`; only X_new is a graph
/// output (H_new is not computed).
#[test]
fn adagrad_decayed_with_rank1_scalars() {
    let (decay, eps, norm) = (0.25f32, 1e-5f32, 0.03f32);
    let attributes = vec![
        attr_float("decay_factor", decay),
        attr_float("epsilon", eps),
        attr_float("norm_coefficient", norm),
    ];
    let inputs: &[(&str, i32, &[i64])] = &[
        ("R", FLOAT, &[1]),
        ("T", INT64, &[1]),
        ("X", FLOAT, &[4]),
        ("G", FLOAT, &[4]),
        ("H", FLOAT, &[4]),
    ];
    let model = one_node(
        "Adagrad",
        attributes,
        inputs,
        &["X_new", "H_new"],
        &[("X_new", FLOAT, &[4])],
    );
    let (r, t) = (0.1f32, 4i64);
    let x = vec![1.0, -2.0, 0.5, 3.0];
    let g = vec![-1.0, 0.25, 2.0, -0.125];
    let h = vec![2.0, 0.5, 0.0, 1.0];
    let feeds = vec![
        ("R", f32s(&[1], &[r as f64])),
        ("T", i64s(&[1], &[t])),
        ("X", f32s(&[4], &x)),
        ("G", f32s(&[4], &g)),
        ("H", f32s(&[4], &h)),
    ];
    let rate = f(r) / (1.0 + t as f64 * f(decay));
    let x_new: Vec<f64> = (0..4)
        .map(|e| {
            let g = f(norm) * x[e] + g[e];
            let h_new = h[e] + g * g;
            x[e] - rate * g / (h_new.sqrt() + f(eps))
        })
        .collect();
    let lowered = lower_proto(&model).unwrap();
    let ops: Vec<&str> = lowered
        .graph
        .as_ref()
        .unwrap()
        .node
        .iter()
        .map(|n| n.op_type())
        .collect();
    assert!(
        ops.contains(&"Reshape"),
        "R and T [1] are reshaped to scalars: {ops:?}"
    );
    run_and_compare(
        "adagrad T=4 decay",
        &model,
        &feeds,
        &[("X_new", f32s(&[4], &x_new))],
        RTOL,
        ATOL,
    );
}

/// Nesterov and standard momentum on double tensors with a float R, after the first step
/// (β' = β): the lowering casts R to double; checked to 1e-12.
#[test]
fn momentum_double_tensors_after_first_step() {
    for mode in ["standard", "nesterov"] {
        let (alpha, beta, norm) = (0.9f32, 0.5f32, 0.01f32);
        let attributes = vec![
            attr_float("alpha", alpha),
            attr_float("beta", beta),
            attr_float("norm_coefficient", norm),
            attr_string("mode", mode),
        ];
        let inputs: &[(&str, i32, &[i64])] = &[
            ("R", FLOAT, &[]),
            ("T", INT64, &[]),
            ("X", DOUBLE, &[3]),
            ("G", DOUBLE, &[3]),
            ("V", DOUBLE, &[3]),
        ];
        let model = one_node(
            "Momentum",
            attributes,
            inputs,
            &["X_new", "V_new"],
            &[("X_new", DOUBLE, &[3]), ("V_new", DOUBLE, &[3])],
        );
        let r = 0.125f32;
        let x = vec![1.2, -2.8, 0.3];
        let g = vec![-0.94, 2.5, 0.01];
        let v = vec![1.7, -3.6, 0.0];
        for t in [0i64, 2] {
            let feeds = vec![
                ("R", f32s(&[], &[r as f64])),
                ("T", i64s(&[], &[t])),
                ("X", f64s(&[3], &x)),
                ("G", f64s(&[3], &g)),
                ("V", f64s(&[3], &v)),
            ];
            let b = if t > 0 { f(beta) } else { 1.0 };
            let (mut x_new, mut v_new) = (Vec::new(), Vec::new());
            for e in 0..3 {
                let g = f(norm) * x[e] + g[e];
                let vn = f(alpha) * v[e] + b * g;
                let step = if mode == "nesterov" {
                    g + f(alpha) * vn
                } else {
                    vn
                };
                x_new.push(x[e] - f(r) * step);
                v_new.push(vn);
            }
            run_and_compare(
                &format!("momentum {mode} double T={t}"),
                &model,
                &feeds,
                &[("X_new", f64s(&[3], &x_new)), ("V_new", f64s(&[3], &v_new))],
                1e-12,
                1e-12,
            );
        }
    }
}

/// Adam on double tensors with a float R at T = 1 and T = 0: checked to 1e-12.
#[test]
fn adam_double_tensors() {
    let (alpha, beta, eps) = (0.95f32, 0.85f32, 1e-2f32);
    let attributes = vec![
        attr_float("alpha", alpha),
        attr_float("beta", beta),
        attr_float("epsilon", eps),
    ];
    let inputs: &[(&str, i32, &[i64])] = &[
        ("R", FLOAT, &[]),
        ("T", INT64, &[]),
        ("X", DOUBLE, &[2]),
        ("G", DOUBLE, &[2]),
        ("V", DOUBLE, &[2]),
        ("H", DOUBLE, &[2]),
    ];
    let outs = ["X_new", "V_new", "H_new"];
    let outputs: Vec<(&str, i32, &[i64])> = outs.iter().map(|n| (*n, DOUBLE, &[2][..])).collect();
    let model = one_node("Adam", attributes, inputs, &outs, &outputs);
    let (x, g, v, h) = (
        vec![1.0, 2.0],
        vec![-1.0, -3.0],
        vec![4.0, 1.0],
        vec![1.0, 10.0],
    );
    for t in [0i64, 1] {
        let r = 0.1f32;
        let feeds = vec![
            ("R", f32s(&[], &[r as f64])),
            ("T", i64s(&[], &[t])),
            ("X", f64s(&[2], &x)),
            ("G", f64s(&[2], &g)),
            ("V", f64s(&[2], &v)),
            ("H", f64s(&[2], &h)),
        ];
        let (a, b) = (f(alpha), f(beta));
        let rate = if t > 0 {
            f(r) * (1.0 - b.powi(t as i32)).sqrt() / (1.0 - a.powi(t as i32))
        } else {
            f(r)
        };
        let mut news = [Vec::new(), Vec::new(), Vec::new()];
        for e in 0..2 {
            let v_new = a * v[e] + (1.0 - a) * g[e];
            let h_new = b * h[e] + (1.0 - b) * g[e] * g[e];
            news[0].push(x[e] - rate * v_new / (h_new.sqrt() + f(eps)));
            news[1].push(v_new);
            news[2].push(h_new);
        }
        let expected: Vec<(&str, Tensor)> = outs
            .iter()
            .zip(&news)
            .map(|(n, v)| (*n, f64s(&[2], v)))
            .collect();
        run_and_compare(
            &format!("adam double T={t}"),
            &model,
            &feeds,
            &expected,
            1e-12,
            1e-12,
        );
    }
}

// ---- bad nodes ---------------------------------------------------------------------------

fn momentum_model(attributes: Vec<AttributeProto>) -> ModelProto {
    one_node(
        "Momentum",
        attributes,
        &[
            ("R", FLOAT, &[]),
            ("T", INT64, &[]),
            ("X", FLOAT, &[2]),
            ("G", FLOAT, &[2]),
            ("V", FLOAT, &[2]),
        ],
        &["X_new", "V_new"],
        &[("X_new", FLOAT, &[2]), ("V_new", FLOAT, &[2])],
    )
}

fn momentum_attributes(mode: &str) -> Vec<AttributeProto> {
    vec![
        attr_float("alpha", 0.9),
        attr_float("beta", 0.1),
        attr_float("norm_coefficient", 0.0),
        attr_string("mode", mode),
    ]
}

fn lowering_error(model: &ModelProto) -> String {
    match lower_proto(model) {
        Ok(_) => panic!("lowering succeeded"),
        Err(e) => e,
    }
}

/// `Gradient` through onnx-ga's autodiff: the onnx backend cases (in corpus/generated/simple).
#[test]
fn gradient_of_add() {
    backend_case("test_gradient_of_add");
}

#[test]
fn gradient_of_add_and_mul() {
    backend_case("test_gradient_of_add_and_mul");
}

#[test]
fn momentum_mode_must_be_standard_or_nesterov() {
    let e = lowering_error(&momentum_model(momentum_attributes("heavy-ball")));
    assert!(
        e.contains("the_Momentum") && e.contains("'mode'") && e.contains("heavy-ball"),
        "{e}"
    );
}

#[test]
fn momentum_attributes_are_required() {
    let mut attributes = momentum_attributes("standard");
    attributes.retain(|a| a.name() != "beta");
    let e = lowering_error(&momentum_model(attributes));
    assert!(
        e.contains("the_Momentum") && e.contains("required attribute 'beta'"),
        "{e}"
    );
}

#[test]
fn unknown_attribute_is_an_error() {
    let mut attributes = momentum_attributes("standard");
    attributes.push(attr_float("weight_decay", 0.1));
    let e = lowering_error(&momentum_model(attributes));
    assert!(
        e.contains("the_Momentum") && e.contains("unknown attribute 'weight_decay'"),
        "{e}"
    );
}

#[test]
fn variadic_layout_is_checked() {
    // Adam with 7 inputs: R, T and five tensors do not split into X, G, V, H groups.
    let names = ["R", "T", "X", "G", "V", "H", "W"];
    let inputs: Vec<(&str, i32, &[i64])> = names
        .iter()
        .enumerate()
        .map(|(k, n)| (*n, if k == 1 { INT64 } else { FLOAT }, &[2][..]))
        .collect();
    let model = one_node(
        "Adam",
        vec![],
        &inputs,
        &["X_new"],
        &[("X_new", FLOAT, &[2])],
    );
    let e = lowering_error(&model);
    assert!(
        e.contains("the_Adam") && e.contains("7 inputs") && e.contains("X1..Xn"),
        "{e}"
    );
}

#[test]
fn t_must_be_int64() {
    let mut model = momentum_model(momentum_attributes("standard"));
    model.graph.as_mut().unwrap().input[1].r#type = Some(tensor_type(FLOAT, &[]));
    let e = lowering_error(&model);
    assert!(
        e.contains("the_Momentum") && e.contains("input T ('T')") && e.contains("int64"),
        "{e}"
    );
}

#[test]
fn tensor_types_must_agree() {
    let mut model = momentum_model(momentum_attributes("standard"));
    model.graph.as_mut().unwrap().input[3].r#type = Some(tensor_type(DOUBLE, &[2]));
    let e = lowering_error(&model);
    assert!(
        e.contains("the_Momentum") && e.contains("share a type"),
        "{e}"
    );
}

#[test]
fn unknown_op_of_the_domain_is_an_error() {
    let model = one_node(
        "Lamb",
        vec![],
        &[("X", FLOAT, &[2])],
        &["Y"],
        &[("Y", FLOAT, &[2])],
    );
    let e = lowering_error(&model);
    assert!(
        // Refused at load (the op schemas of the domain do not have it), naming the node
        // and what the domain has.
        e.contains("the_Lamb") && e.contains("unknown op 'Lamb'") && e.contains("Momentum"),
        "{e}"
    );
}

/// A model without training ops passes unchanged; the pass is known to the pipeline parser.
#[test]
fn plain_model_is_unchanged() {
    let mut model = momentum_model(momentum_attributes("standard"));
    let g = model.graph.as_mut().unwrap();
    g.node[0] = NodeProto {
        name: Some("sub".into()),
        op_type: Some("Sub".into()),
        input: vec!["X".into(), "G".into()],
        output: vec!["X_new".into()],
        ..Default::default()
    };
    g.output.truncate(1);
    model.opset_import.retain(|o| o.domain() != DOMAIN);
    let lowered = lower_proto(&model).unwrap();
    assert_eq!(lowered.graph.as_ref().unwrap().node.len(), 1);
    assert!(onnx_ga::passes::Pipeline::parse("legalize-training,dce").is_ok());
    assert!(onnx_ga::passes::Pipeline::parse("legalize-training(x=1)").is_err());
}
