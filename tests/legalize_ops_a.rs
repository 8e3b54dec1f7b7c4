//! `legalize-ort` on one-op models of the activation, softmax, loss, normalisation, scale,
//! gather, dropout and accumulator gradients (and, when asked, com.microsoft Gelu and
//! FusedMatMul): each lowered model is snapshotted, verified, run on standard ONNX Runtime
//! 1.31.1 and compared with what the training build (onnxruntime-training-cpu 1.19.2)
//! computed on the original (fixtures/legalize/generate_a.py). The in-place buffer update
//! of InPlaceAccumulatorV2 is compared through the state output the lowering adds.
//!
//! Tolerance: 1e-6 relative or 1e-7 absolute everywhere. Run with `--nocapture` to see the
//! measured error of every case.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::common::{assert_close, ort_available, read_npz, root, run_ort};
use onnx_ga::data::Tensor;
use onnx_ga::ir::{print::print_model, verify, Model};
use onnx_ga::passes::{PassContext, PassError, Pipeline};
use onnx_ga::signature::{Source, TrainingSignature};
use onnx_ga::state::{Role, StateEntry};

const LEGALIZE: &str = "legalize-ort";
const WITH_GELU: &str = "legalize-ort(gelu=true)";
const WITH_FUSED_MATMUL: &str = "legalize-ort(fused-matmul=true)";

/// (case, pipeline): every case of fixtures/legalize/generate_a.py.
const CASES: &[(&str, &str)] = &[
    ("relu_grad", LEGALIZE),
    ("sigmoid_grad", LEGALIZE),
    ("tanh_grad", LEGALIZE),
    ("leaky_relu_grad", LEGALIZE),
    ("leaky_relu_grad_default", LEGALIZE),
    ("gelu_grad", LEGALIZE),
    ("bias_gelu_grad_dx", LEGALIZE),
    ("fast_gelu_grad", LEGALIZE),
    ("bias_fast_gelu_grad_dx", LEGALIZE),
    ("quick_gelu_grad", LEGALIZE),
    ("quick_gelu_grad_alpha", LEGALIZE),
    ("gelu", WITH_GELU),
    ("softmax_grad_13_axis1", LEGALIZE),
    ("softmax_grad_13_last", LEGALIZE),
    ("softmax_grad_v1", LEGALIZE),
    ("log_softmax_grad_13_axis1", LEGALIZE),
    ("log_softmax_grad_13_last", LEGALIZE),
    ("log_softmax_grad_v1", LEGALIZE),
    ("sce_grad_mean_weight_ignore", LEGALIZE),
    ("sce_grad_sum_weight_ignore", LEGALIZE),
    ("sce_grad_none_weight_ignore", LEGALIZE),
    ("sce_grad_mean", LEGALIZE),
    ("sce_grad_sum", LEGALIZE),
    ("sce_grad_none", LEGALIZE),
    ("sce_grad_mean_weight", LEGALIZE),
    ("sce_grad_mean_all_ignored", LEGALIZE),
    ("sce_grad_mean_kdim", LEGALIZE),
    ("layer_norm_grad_last", LEGALIZE),
    ("layer_norm_grad_two_axes", LEGALIZE),
    ("layer_norm_grad_axis_m2", LEGALIZE),
    ("layer_norm_grad_dx_only", LEGALIZE),
    ("simplified_layer_norm_grad", LEGALIZE),
    ("simplified_layer_norm_grad_two_axes", LEGALIZE),
    ("scale_float", LEGALIZE),
    ("scale_int64_down", LEGALIZE),
    ("scale_float1_down", LEGALIZE),
    ("accumulate", LEGALIZE),
    ("accumulate_reset", LEGALIZE),
    ("accumulate_no_reset", LEGALIZE),
    ("gather_grad_embedding", LEGALIZE),
    ("gather_grad_axis1", LEGALIZE),
    ("gather_elements_grad", LEGALIZE),
    ("gather_nd_grad", LEGALIZE),
    ("div_grad_broadcast", LEGALIZE),
    ("div_grad_same_shape", LEGALIZE),
    ("dropout_grad", LEGALIZE),
    ("dropout_grad_default_ratio", LEGALIZE),
    ("fused_matmul_2d", WITH_FUSED_MATMUL),
    ("fused_matmul_batched", WITH_FUSED_MATMUL),
    ("fused_matmul_broadcast", WITH_FUSED_MATMUL),
];

fn case_dir(case: &str) -> PathBuf {
    root().join("fixtures/legalize").join(case)
}

fn empty_signature(file: &Path) -> TrainingSignature {
    TrainingSignature {
        source: Source::Plain {
            file: file.to_path_buf(),
        },
        data_inputs: Vec::new(),
        loss: String::new(),
        seed: None,
        params: Vec::new(),
        lazy_reset_grad: None,
        optimizer: None,
    }
}

fn legalize(
    mut model: Model,
    origin: &Path,
    spec: &str,
) -> Result<(Model, Vec<StateEntry>), PassError> {
    let mut signature = empty_signature(origin);
    let mut cx = PassContext::new(&mut signature, None);
    Pipeline::parse(spec)?.run(&mut model, &mut cx)?;
    Ok((model, cx.state))
}

fn load(case: &str) -> (Model, PathBuf) {
    let file = case_dir(case).join("model.onnx");
    let proto = onnx_ga::model::load_model(&file).unwrap_or_else(|e| panic!("{e}"));
    (Model::from_proto(proto), file)
}

/// Largest |a - e| and largest |a - e| / |e| (over elements with |e| > 1e-6).
fn errors(actual: &Tensor, expected: &Tensor) -> (f64, f64) {
    let pairs: Vec<(f64, f64)> = match (actual, expected) {
        (Tensor::F32(a), Tensor::F32(e)) => a
            .iter()
            .zip(e)
            .map(|(x, y)| (*x as f64, *y as f64))
            .collect(),
        (Tensor::F64(a), Tensor::F64(e)) => a.iter().zip(e).map(|(x, y)| (*x, *y)).collect(),
        _ => {
            return (
                if actual == expected {
                    0.0
                } else {
                    f64::INFINITY
                },
                0.0,
            )
        }
    };
    pairs.iter().fold((0.0, 0.0), |(abs, rel), (x, y)| {
        let d = (x - y).abs();
        let r = if y.abs() > 1e-6 { d / y.abs() } else { 0.0 };
        (f64::max(abs, d), f64::max(rel, r))
    })
}

fn check_case(case: &str, spec: &str, failures: &mut Vec<String>) {
    let (model, file) = load(case);
    let (model, state) = legalize(model, &file, spec).unwrap_or_else(|e| panic!("{case}: {e}"));
    verify::verify(&model).unwrap_or_else(|e| panic!("{case}: {e}"));
    insta::assert_snapshot!(case, print_model(&model));
    for n in model.all_nodes() {
        let p = &model.node(n).proto;
        assert!(
            p.domain() != "com.microsoft",
            "{case}: {} left",
            p.op_type()
        );
    }
    let domains: Vec<&str> = model
        .header
        .opset_import
        .iter()
        .map(|o| o.domain())
        .collect();
    assert_eq!(domains, [""], "{case}: declared opset domains");

    let io = read_npz(&case_dir(case).join("io.npz"));
    let feeds: BTreeMap<String, Tensor> = io
        .iter()
        .filter_map(|(k, v)| k.strip_prefix("in/").map(|n| (n.to_string(), v.clone())))
        .collect();
    // What to compare: every output of the original model, and for every input the training
    // build updated in place, the state output the lowering made for it.
    let mut expected: Vec<(String, &Tensor)> = Vec::new();
    for (key, tensor) in &io {
        if let Some(name) = key.strip_prefix("out/") {
            expected.push((name.to_string(), tensor));
        } else if let Some(input) = key.strip_prefix("inplace/") {
            let entry = state
                .iter()
                .find(|s| s.input == input)
                .unwrap_or_else(|| panic!("{case}: no state output for in-place input '{input}'"));
            assert_eq!(entry.role, Role::Accumulator, "{case}: role of {input}");
            expected.push((entry.output.clone(), tensor));
        }
    }
    if !ort_available() {
        return;
    }
    let got = run_ort(&model.to_proto(), &feeds);
    let mut report = Vec::new();
    for (name, e) in expected {
        let a = got
            .get(&name)
            .unwrap_or_else(|| panic!("{case}: no output '{name}' (outputs: {:?})", got.keys()));
        let (abs, rel) = errors(a, e);
        report.push(format!("{name}: max abs {abs:.2e}, max rel {rel:.2e}"));
        let (rtol, atol) = tolerance(case);
        let result =
            std::panic::catch_unwind(|| assert_close(&format!("{case}/{name}"), a, e, rtol, atol));
        if result.is_err() {
            failures.push(format!("{case}/{name}"));
        }
    }
    // Against the float64 statement of the math: where the training build is the less
    // exact side (see `tolerance`), this is what pins the lowering down.
    if tolerance(case) != (1e-6, 1e-7) {
        for (key, exact) in &io {
            let Some(name) = key.strip_prefix("exact/") else {
                continue;
            };
            let Tensor::F32(a) = &got[name] else {
                panic!("{case}: {name} is not float32")
            };
            let a = Tensor::F64(a.mapv(f64::from));
            let (abs, _) = errors(&a, exact);
            report.push(format!("{name} vs exact: max abs {abs:.2e}"));
            assert_close(&format!("{case}/{name} (exact)"), &a, exact, 1e-6, 2e-7);
        }
    }
    println!("{case}: {}", report.join("; "));
}

/// (rtol, atol) of `case`: 1e-6 relative or 1e-7 absolute, except for the GELU gradients.
/// There the training build's own kernels are off the exact value (float64 math on the
/// same float32 inputs, `exact/` in the fixtures) by up to 1.4e-7 (GeluGrad, its erf) and
/// 2.2e-7 (FastGeluGrad, its tanh) absolute, on outputs up to 1.8 in magnitude, whose
/// float32 spacing is 1.2e-7. The lowerings are within 1.2e-7 and 1.5e-7 of the exact value
/// (measured), so they meet the training build only within the sum: 2e-7 and 3e-7 absolute
/// (measured 1.27e-7 and 2.20e-7). For these cases the lowering is also held to the exact
/// value within 1e-6 relative or 2e-7 absolute.
fn tolerance(case: &str) -> (f64, f64) {
    match case {
        "gelu_grad" | "bias_gelu_grad_dx" => (1e-6, 2e-7),
        "fast_gelu_grad" | "bias_fast_gelu_grad_dx" => (1e-6, 3e-7),
        _ => (1e-6, 1e-7),
    }
}

#[test]
fn every_case_is_listed() {
    let listed: Vec<&str> = CASES.iter().map(|(c, _)| *c).collect();
    let script = std::fs::read_to_string(root().join("fixtures/legalize/generate_a.py")).unwrap();
    for line in script.lines() {
        let Some(rest) = line.trim_start().strip_prefix("case(\"") else {
            continue;
        };
        let name = rest.split('"').next().unwrap();
        assert!(
            listed.contains(&name),
            "case '{name}' of generate_a.py is not tested"
        );
    }
}

#[test]
fn lowered_ops_match_the_training_build() {
    let mut failures = Vec::new();
    for (case, spec) in CASES {
        check_case(case, spec, &mut failures);
    }
    assert!(failures.is_empty(), "outside tolerance: {failures:?}");
}

#[test]
fn accumulator_state_is_recorded() {
    for case in ["accumulate", "accumulate_reset", "accumulate_no_reset"] {
        let (model, file) = load(case);
        let (model, state) = legalize(model, &file, LEGALIZE).unwrap();
        assert_eq!(
            state,
            [StateEntry {
                input: "w_grad.accumulation.buffer".into(),
                output: "w_grad.accumulation.buffer.next".into(),
                role: Role::Accumulator,
                param: Some("w".into()),
            }],
            "{case}"
        );
        let outputs: Vec<&str> = model
            .graph_outputs()
            .iter()
            .map(|v| model.name(*v))
            .collect();
        assert_eq!(
            outputs,
            ["w_grad.accumulation.out", "w_grad.accumulation.buffer.next"],
            "{case}"
        );
    }
}

#[test]
fn optional_lowerings_stay_unless_asked() {
    for case in ["gelu", "fused_matmul_2d"] {
        let (model, file) = load(case);
        let (model, _) = legalize(model, &file, LEGALIZE).unwrap();
        assert!(
            model
                .all_nodes()
                .all(|n| model.node(n).proto.domain() == "com.microsoft"),
            "{case}: lowered without being asked"
        );
    }
}

#[test]
fn an_unknown_com_microsoft_op_is_an_error_naming_node_and_op() {
    let (mut model, file) = load("relu_grad");
    let node = model.all_nodes().next().unwrap();
    model.node_mut(node).proto.op_type = Some("FrobnicateGrad".into());
    let message = legalize(model, &file, LEGALIZE)
        .expect_err("an error")
        .to_string();
    assert!(message.contains("ReluGrad_0"), "{message}");
    assert!(
        message.contains("com.microsoft::FrobnicateGrad"),
        "{message}"
    );
}

#[test]
fn an_unsupported_attribute_value_is_an_error_naming_node_op_and_attribute() {
    // (case, pipeline, attribute, new value)
    let cases = [
        ("sce_grad_mean", LEGALIZE, "reduction", "max"),
        ("scale_float", LEGALIZE, "scale_down", "2"),
        (
            "fused_matmul_batched",
            WITH_FUSED_MATMUL,
            "transBatchA",
            "1",
        ),
    ];
    for (case, spec, attribute, value) in cases {
        let (mut model, file) = load(case);
        let node = model.all_nodes().next().unwrap();
        let proto = &mut model.node_mut(node).proto;
        let op = format!("com.microsoft::{}", proto.op_type());
        let node_name = proto.name().to_string();
        proto.attribute.retain(|a| a.name() != attribute);
        proto.attribute.push(match value.parse::<i64>() {
            Ok(i) => onnx_ga::ir::builder::attr_int(attribute, i),
            Err(_) => onnx_ga::ir::builder::attr_string(attribute, value),
        });
        let message = legalize(model, &file, spec)
            .expect_err("an error")
            .to_string();
        for part in [node_name.as_str(), op.as_str(), attribute, value] {
            assert!(
                message.contains(part),
                "{case}: '{part}' missing in: {message}"
            );
        }
    }
}

/// Every generated training graph (cnn_bn's ConvGrad, MaxPoolGrad and BatchNorm ops are
/// lowered in their own files; the others use SoftmaxCrossEntropyLossGrad, ReluGrad, SigmoidGrad, InPlaceAccumulatorV2, and in
/// the transformer block LayerNormalizationGrad, SoftmaxGrad_13, GeluGrad, Scale,
/// FusedMatMul), legalized alone and run on standard ONNX Runtime for one step from the
/// checkpoint with zero buffers and `lazy_reset_grad` set: the loss and every buffer's next
/// value (the parameter's gradient) match the training build's (fixtures/<model>/grads.npz)
/// within 1e-5 relative or 1e-6 absolute (issue 6's whole-graph tolerance).
#[test]
fn legalized_training_graphs_give_the_training_builds_gradients() {
    for name in [
        "mlp_ce_adamw",
        "mlp_mse_sgd",
        "bce_logits",
        "l1_loss",
        "transformer_block",
        "cnn_bn",
    ] {
        let dir = root().join("graphs").join(name);
        let graph = onnx_ga::signature::open(&dir, &onnx_ga::signature::ExplicitRoles::default())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let checkpoint = graph.checkpoint.expect("artifacts have a checkpoint");
        let mut signature = graph.signature;
        let mut model = graph.model;
        let mut cx = PassContext::new(&mut signature, None);
        Pipeline::parse(LEGALIZE)
            .unwrap()
            .run(&mut model, &mut cx)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        verify::verify(&model).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(
            model.all_nodes().all(|n| {
                let p = &model.node(n).proto;
                p.domain() != "com.microsoft"
                    || p.op_type() == "FusedMatMul"
                    || p.op_type() == "Gelu"
            }),
            "{name}: training-only ops left"
        );
        if !ort_available() {
            continue;
        }
        let reference = read_npz(&root().join("fixtures").join(name).join("grads.npz"));
        let mut feeds: BTreeMap<String, Tensor> = reference
            .iter()
            .filter_map(|(k, v)| k.strip_prefix("input/").map(|n| (n.to_string(), v.clone())))
            .collect();
        for p in checkpoint.parameters() {
            feeds.insert(p.name.clone(), Tensor::F32(p.to_array_f32().unwrap()));
        }
        // Accumulation buffers start at zero; BatchNorm statistics (bn_stat state) are
        // frozen parameters, already fed from the checkpoint.
        cx.state
            .retain(|e| e.role == onnx_ga::state::Role::Accumulator);
        for entry in &cx.state {
            let param = &feeds[entry.param.as_ref().unwrap()];
            feeds.insert(
                entry.input.clone(),
                Tensor::F32(ndarray::ArrayD::zeros(param.shape())),
            );
        }
        feeds.insert(
            "lazy_reset_grad".into(),
            Tensor::Bool(ndarray::ArrayD::from_elem(vec![1], true)),
        );
        let got = run_ort(&model.to_proto(), &feeds);
        let loss_name = model.name(model.graph_outputs()[0]).to_string();
        assert_close(
            &format!("{name}/loss"),
            &got[&loss_name],
            &reference["loss"],
            1e-5,
            1e-6,
        );
        assert_eq!(
            cx.state.len(),
            checkpoint.trainable.len(),
            "{name}: one accumulator per parameter"
        );
        let mut worst: f64 = 0.0;
        for entry in &cx.state {
            let param = entry.param.as_ref().unwrap();
            let expected = &reference[&format!("grad/{param}")];
            worst = worst.max(errors(&got[&entry.output], expected).0);
            // A conv bias feeding a BatchNorm has a mathematically zero gradient (its
            // values are rounding noise, ~1e-8): compared absolutely.
            let rtol = if name == "cnn_bn" && param == "conv.bias" {
                0.0
            } else {
                1e-5
            };
            assert_close(
                &format!("{name}/grad/{param}"),
                &got[&entry.output],
                expected,
                rtol,
                1e-6,
            );
        }
        println!(
            "{name}: loss and {} gradients match, max abs gradient error {worst:.2e}",
            cx.state.len()
        );
    }
}

/// Every lowered case passes `onnx.checker.check_model(full_check=True)` (onnx 1.23.2 in
/// `.venv-ort`, scripts/install-ort.sh); skipped without that venv unless `CI=true`.
#[test]
fn lowered_cases_pass_the_onnx_checker() {
    let python = root().join(onnx_ga::runtime::VENV_DIR).join("bin/python");
    if !python.exists() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "{} is missing under CI",
            python.display()
        );
        eprintln!("SKIPPED: {} not found", python.display());
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut files = Vec::new();
    for (case, spec) in CASES {
        let (model, file) = load(case);
        let (model, _) = legalize(model, &file, spec).unwrap_or_else(|e| panic!("{case}: {e}"));
        let path = dir.path().join(format!("{case}.onnx"));
        onnx_ga::model::save_model(&model.to_proto(), &path).unwrap();
        files.push(path);
    }
    let check = "import sys, onnx\nfor p in sys.argv[1:]:\n    onnx.checker.check_model(p, full_check=True)\n";
    let out = std::process::Command::new(python)
        .arg("-c")
        .arg(check)
        .args(&files)
        .output()
        .expect("run python");
    assert!(
        out.status.success(),
        "onnx.checker rejected a lowered case:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A dropout gradient whose ratio is computed, behind a Cast of dY to its own type (T5's
/// layer norm, exported by `torch.onnx.export(dynamo=False)` in training mode): ONNX Runtime
/// 1.31's DivMulFusion folded a `Div(1, keep)` scale into the Mul after EliminateIdentity had
/// removed that Cast, and the session failed to load ("'c' is not a graph input, initializer,
/// or output of a previous node"). The lowering scales by `Reciprocal(keep)`; the result is
/// dY * mask / (1 - ratio), computed here by hand.
#[test]
fn dropout_grad_behind_a_same_type_cast_loads_and_scales() {
    if !ort_available() {
        return;
    }
    let text = r#"
<ir_version: 8, opset_import: ["" : 17, "com.microsoft" : 1]>
g (float[2,3] dy, bool[2,3] mask, float ratio) => (float[2,3] dx) {
  c = Cast <to = 1> (dy)
  dx = com.microsoft.DropoutGrad (c, mask, ratio)
}
"#;
    let model = Model::from_proto(onnx_ga::ir::text::parse_model(text).unwrap());
    let (lowered, _) = legalize(model, Path::new("dropout_behind_cast.onnx"), LEGALIZE).unwrap();
    let dy = [0.5f32, -1.0, 2.0, 0.25, -0.75, 1.5];
    let mask = [true, false, true, true, false, true];
    let ratio = 0.2f32;
    let inputs: BTreeMap<String, Tensor> = [
        (
            "dy".to_string(),
            Tensor::F32(ndarray::ArrayD::from_shape_vec(vec![2, 3], dy.to_vec()).unwrap()),
        ),
        (
            "mask".to_string(),
            Tensor::Bool(ndarray::ArrayD::from_shape_vec(vec![2, 3], mask.to_vec()).unwrap()),
        ),
        (
            "ratio".to_string(),
            Tensor::F32(ndarray::ArrayD::from_elem(vec![], ratio)),
        ),
    ]
    .into();
    let got = run_ort(&lowered.to_proto(), &inputs);
    let expected: Vec<f32> = dy
        .iter()
        .zip(mask)
        .map(|(d, m)| if m { d / (1.0 - ratio) } else { 0.0 })
        .collect();
    assert_close(
        "dx",
        &got["dx"],
        &Tensor::F32(ndarray::ArrayD::from_shape_vec(vec![2, 3], expected).unwrap()),
        1e-6,
        0.0,
    );
}
