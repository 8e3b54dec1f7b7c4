//! `legalize-ort` on one-op models of ConvGrad, MaxPoolGrad, BatchNormInternal,
//! BatchNormalizationGrad, AdamWOptimizer and SGDOptimizerV2: each lowered model is
//! snapshotted, verified, run on standard ONNX Runtime 1.31.1 and compared with what the
//! training build (onnxruntime-training-cpu 1.19.2) computed on the original
//! (fixtures/legalize/generate_b.py). In-place updates of the training build (BatchNorm
//! running statistics, optimizer parameters and moments) are compared through the state
//! outputs the lowering adds.
//!
//! Tolerance: 1e-6 relative or 1e-7 absolute, except where a lowering sums in another order
//! than the kernel it replaces (see `TOLERANCES`). Run with `--nocapture` to see the measured
//! errors of every case.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::common::{assert_close, ort_available, read_npz, root, run_ort};
use onnx_ga::data::Tensor;
use onnx_ga::ir::{print::print_model, verify, Model};
use onnx_ga::passes::{PassContext, PassError, Pipeline};
use onnx_ga::signature::{Source, TrainingSignature};
use onnx_ga::state::{Role, StateEntry};

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

fn legalize(mut model: Model, origin: &Path) -> Result<(Model, Vec<StateEntry>), PassError> {
    let mut signature = empty_signature(origin);
    let mut cx = PassContext::new(&mut signature, None);
    let mut pipeline = Pipeline::parse("legalize-ort")?;
    pipeline.run(&mut model, &mut cx)?;
    Ok((model, cx.state))
}

fn load_and_legalize(case: &str) -> (Model, Vec<StateEntry>) {
    let file = case_dir(case).join("model.onnx");
    let proto = onnx_ga::model::load_model(&file).unwrap_or_else(|e| panic!("{e}"));
    let (model, state) =
        legalize(Model::from_proto(proto), &file).unwrap_or_else(|e| panic!("{case}: {e}"));
    verify::verify(&model).unwrap_or_else(|e| panic!("{case}: {e}"));
    (model, state)
}

/// (rtol, atol) for `output` of `case`: 1e-6 relative or 1e-7 absolute, except for three
/// outputs compared norm-wise, |a - e| <= 1e-6 |e| + 1e-6 max|e|:
/// - ConvGrad's dB, a sum of N·OH·OW elements of dY (up to 162 here, partial sums up to ~20)
///   that ReduceSum adds in another order than the training build's per-image GEMV: the
///   float32 rounding differs by up to 2.8e-7 of max|dB| (measured), 3e-6 relative on
///   elements near zero. (dW sums per image and group like the kernel: exact, depthwise
///   within 5e-7 relative.)
/// - BatchNormInternal's Y = X·g + (B - mean·g), g = scale·inv_std, which cancels terms as
///   large as max|Y|: the batch variance is a sum whose order differs from the kernel's, and
///   its last bit moves Y by a float32 ulp of max|Y| on elements near zero (measured up to
///   1.1e-7 of max|Y|, 2.7e-5 relative).
/// - BatchNormalizationGrad's dX = k·(dY - mean(dY) - x̂·mean(dY·x̂)), a difference of terms
///   as large as max|dX|: any order of evaluation leaves errors of a few float32 ulps of
///   max|dX| on elements near zero (measured up to 1.4e-7 of max|dX|, 3.9e-6 relative).
fn tolerance(case: &str, output: &str, expected: &Tensor) -> (f64, f64) {
    let norm_wise = (case.starts_with("conv_grad_") && output == "dB")
        || (case.starts_with("bn_grad_") && output == "dX")
        || (case.starts_with("bn_internal_") && output == "Y");
    if norm_wise {
        let (_, _, largest) = errors(expected, expected);
        return (1e-6, 1e-6 * largest);
    }
    (1e-6, 1e-7)
}

/// Largest |a - e|, largest |a - e| / |e| (over elements with |e| > 1e-3), largest |e|.
fn errors(actual: &Tensor, expected: &Tensor) -> (f64, f64, f64) {
    match (actual, expected) {
        (Tensor::F32(a), Tensor::F32(e)) => {
            a.iter()
                .zip(e.iter())
                .fold((0.0, 0.0, 0.0), |(abs, rel, big), (x, y)| {
                    let d = (*x as f64 - *y as f64).abs();
                    let r = if y.abs() > 1e-3 {
                        d / (*y as f64).abs()
                    } else {
                        0.0
                    };
                    (
                        f64::max(abs, d),
                        f64::max(rel, r),
                        f64::max(big, (*y as f64).abs()),
                    )
                })
        }
        _ => (
            if actual == expected {
                0.0
            } else {
                f64::INFINITY
            },
            0.0,
            0.0,
        ),
    }
}

fn check_case(case: &str) {
    let (model, state) = load_and_legalize(case);
    let printed = print_model(&model);
    insta::assert_snapshot!(case, printed);
    for n in model.all_nodes() {
        let p = &model.node(n).proto;
        assert!(
            p.domain() != "com.microsoft",
            "{case}: {} left",
            p.op_type()
        );
        assert!(p.op_type() != "MaxPoolGrad", "{case}: MaxPoolGrad left");
    }
    assert!(
        model
            .header
            .opset_import
            .iter()
            .all(|o| o.domain() != "com.microsoft"),
        "{case}: com.microsoft still declared"
    );
    if !ort_available() {
        return;
    }
    let io = read_npz(&case_dir(case).join("io.npz"));
    let feeds: BTreeMap<String, Tensor> = io
        .iter()
        .filter_map(|(k, v)| k.strip_prefix("in/").map(|n| (n.to_string(), v.clone())))
        .collect();
    let got = run_ort(&model.to_proto(), &feeds);

    // Every output of the original model, then the next value of every state input:
    // `inplace/<input>` (BatchNorm statistics) or `out/<input>.updated` (optimizer fixtures,
    // which read the updated sequences back).
    let mut expected: Vec<(String, String, Tensor)> = io
        .iter()
        .filter_map(|(k, v)| {
            k.strip_prefix("out/")
                .map(|n| (n.to_string(), n.to_string(), v.clone()))
        })
        .collect();
    for entry in &state {
        let want = io
            .get(&format!("inplace/{}", entry.input))
            .or_else(|| io.get(&format!("out/{}.updated", entry.input)))
            .unwrap_or_else(|| panic!("{case}: no expected value for state input {}", entry.input));
        expected.push((
            format!("{} (state of {})", entry.output, entry.input),
            entry.output.clone(),
            want.clone(),
        ));
    }
    for (label, output, want) in &expected {
        let (rtol, atol) = tolerance(case, output, want);
        let actual = got
            .get(output)
            .unwrap_or_else(|| panic!("{case}: no output {output}"));
        let (abs, rel, big) = errors(actual, want);
        println!(
            "{case:28} {label:28} max abs {abs:.3e}  max rel {rel:.3e}  abs/max|e| {:.3e}",
            abs / big.max(1e-30)
        );
        assert_close(&format!("{case}: {label}"), actual, want, rtol, atol);
    }
}

macro_rules! cases {
    ($($name:ident),* $(,)?) => {
        $(#[test] fn $name() { check_case(stringify!($name)); })*
        const CASES: &[&str] = &[$(stringify!($name)),*];
    };
}

cases!(
    conv_grad_strided,
    conv_grad_strided_nopad,
    conv_grad_dilated,
    conv_grad_dilated_strided,
    conv_grad_padded,
    conv_grad_group2,
    conv_grad_depthwise,
    conv_grad_depthwise_mult,
    conv_grad_dx_only,
    conv_grad_dw_only,
    conv_grad_dw_db,
    conv_grad_1d,
    conv_grad_3d,
    conv_grad_same_upper,
    conv_grad_same_lower,
    max_pool_grad_k3s2,
    max_pool_grad_padded,
    max_pool_grad_nonsquare,
    max_pool_grad_ceil,
    max_pool_grad_k2s2,
    max_pool_grad_indices_input,
    bn_internal_nchw,
    bn_internal_nc,
    bn_internal_opset13,
    bn_grad_nchw,
    bn_grad_nc,
    bn_grad_dx_only,
    adamw_mode1_step1,
    adamw_mode1_wd_step5,
    adamw_mode1_nobias_step5,
    adamw_mode0_step1,
    adamw_mode0_wd_step5,
    adamw_signal_false,
    sgd,
    sgd_signal_true,
);

#[test]
fn state_entries_name_inputs_outputs_and_roles() {
    let (_, state) = load_and_legalize("bn_internal_nchw");
    assert_eq!(
        state,
        vec![
            StateEntry {
                input: "mean".into(),
                output: "mean.next".into(),
                role: Role::BnStat,
                param: Some("mean".into())
            },
            StateEntry {
                input: "var".into(),
                output: "var.next".into(),
                role: Role::BnStat,
                param: Some("var".into())
            },
        ]
    );
    let (_, state) = load_and_legalize("adamw_mode1_step1");
    let roles: Vec<(&str, &str, Role, Option<&str>)> = state
        .iter()
        .map(|e| {
            (
                e.input.as_str(),
                e.output.as_str(),
                e.role,
                e.param.as_deref(),
            )
        })
        .collect();
    assert_eq!(
        roles,
        vec![
            ("w", "w.next", Role::Param, None),
            ("w.m", "w.m.next", Role::Moment, Some("w")),
            ("w.v", "w.v.next", Role::Moment, Some("w")),
            ("b", "b.next", Role::Param, None),
            ("b.m", "b.m.next", Role::Moment, Some("b")),
            ("b.v", "b.v.next", Role::Moment, Some("b")),
        ]
    );
}

// ---- errors -------------------------------------------------------------------------------

/// A fixture model with one attribute of its training-only node set to `value`.
fn with_attribute(
    case: &str,
    op: &str,
    attribute: onnx_ga::proto::AttributeProto,
) -> (Model, PathBuf) {
    let file = case_dir(case).join("model.onnx");
    let mut proto = onnx_ga::model::load_model(&file).unwrap();
    let node = proto
        .graph
        .as_mut()
        .unwrap()
        .node
        .iter_mut()
        .find(|n| n.op_type() == op)
        .unwrap();
    node.attribute.retain(|a| a.name() != attribute.name());
    node.attribute.push(attribute);
    (Model::from_proto(proto), file)
}

fn error_of(model: Model, file: &Path) -> String {
    match legalize(model, file) {
        Ok(_) => panic!("the lowering accepted what it does not implement"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn unsupported_attribute_values_name_node_op_and_attribute() {
    use onnx_ga::ir::builder::{attr_int, attr_string};
    let (model, file) = with_attribute(
        "adamw_mode0_step1",
        "AdamWOptimizer",
        attr_int("correct_bias", 0),
    );
    let e = error_of(model, &file);
    assert_eq!(
        e,
        "legalize-ort: node 'optimizer' (com.microsoft::AdamWOptimizer): attribute 'correct_bias': \
         0 with adam_mode 0 (ONNX Runtime rejects it too) is not supported by the lowering"
    );
    let (model, file) = with_attribute(
        "adamw_mode1_step1",
        "AdamWOptimizer",
        attr_int("adam_mode", 2),
    );
    let e = error_of(model, &file);
    assert!(
        e.contains("'optimizer' (com.microsoft::AdamWOptimizer): attribute 'adam_mode': 2"),
        "{e}"
    );
    let (model, file) = with_attribute(
        "conv_grad_strided",
        "ConvGrad",
        attr_string("auto_pad", "SAME_MIDDLE"),
    );
    let e = error_of(model, &file);
    assert!(
        e.contains("'conv_grad' (com.microsoft::ConvGrad): attribute 'auto_pad': 'SAME_MIDDLE'"),
        "{e}"
    );
    let (model, file) = with_attribute(
        "bn_internal_nc",
        "BatchNormInternal",
        attr_int("training_mode", 0),
    );
    let e = error_of(model, &file);
    assert!(
        e.contains("'bn' (com.microsoft::BatchNormInternal): attribute 'training_mode': 0"),
        "{e}"
    );
}

#[test]
fn optimizer_sequences_given_as_graph_inputs_are_an_error_that_points_to_the_library() {
    let file = root().join("graphs/mlp_ce_adamw/optimizer_model.onnx");
    let proto = onnx_ga::model::load_model(&file).unwrap();
    let e = error_of(Model::from_proto(proto), &file);
    assert!(
        e.contains("(com.microsoft::AdamWOptimizer): sequence input 2 ('params') is a graph input"),
        "{e}"
    );
    assert!(e.contains("lower_adamw_for_params"), "{e}");
}

/// Every lowered model passes `onnx.checker.check_model(full_check=True)` (onnx 1.23.2 in
/// .venv-ort; skipped without it, except under CI=true).
#[test]
fn legalized_models_pass_the_onnx_checker() {
    let python = root().join(onnx_ga::runtime::VENV_DIR).join("bin/python");
    if !python.exists() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "{} is missing under CI",
            python.display()
        );
        eprintln!(
            "SKIPPED: {} not found (run scripts/install-ort.sh)",
            python.display()
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let files: Vec<PathBuf> = CASES
        .iter()
        .map(|case| {
            let path = dir.path().join(format!("{case}.onnx"));
            onnx_ga::model::save_model(&load_and_legalize(case).0.to_proto(), &path).unwrap();
            path
        })
        .collect();
    let check = "import sys, onnx\nfor p in sys.argv[1:]:\n    onnx.checker.check_model(p, full_check=True)\n";
    let out = std::process::Command::new(python)
        .arg("-c")
        .arg(check)
        .args(&files)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "onnx.checker rejected a model:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// ConvGrad's dW on slices of X's channels (a kernel above 1×1, stride 1, one group, at
/// least 16 channels: the lowering computes it on two halves of X's channels and
/// concatenates), against the definition `dW[m, c, i, j] = Σ_n,p,q dY[n, m, p, q] ·
/// X[n, c, p + d·i - t, q + d·j - l]` summed in float64; a strided case stays whole. Float32
/// against float64 over at most 300 terms: within 1e-5 of max|dW| (measured below 1e-6).
#[test]
fn conv_grad_dw_channel_slices() {
    struct Case {
        x: [usize; 4],
        w: [usize; 4],
        stride: usize,
        dilation: usize,
        pads: [usize; 4],
        slices: usize,
    }
    let cases = [
        Case {
            x: [3, 16, 10, 9],
            w: [4, 16, 3, 3],
            stride: 1,
            dilation: 1,
            pads: [1, 0, 1, 2],
            slices: 2,
        },
        Case {
            x: [2, 32, 8, 8],
            w: [5, 32, 3, 2],
            stride: 1,
            dilation: 2,
            pads: [2, 1, 2, 1],
            slices: 2,
        },
        Case {
            x: [2, 16, 9, 9],
            w: [4, 16, 3, 3],
            stride: 2,
            dilation: 1,
            pads: [1, 1, 1, 1],
            slices: 0,
        },
    ];
    for case in cases {
        let [n, c, h, wd] = case.x;
        let [m, _, kh, kw] = case.w;
        let (s, d) = (case.stride, case.dilation);
        let [pt, pl, pb, pr] = case.pads;
        let oh = (h + pt + pb - (kh - 1) * d - 1) / s + 1;
        let ow = (wd + pl + pr - (kw - 1) * d - 1) / s + 1;
        let dims = |v: &[usize]| {
            v.iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join(",")
        };
        let text = format!(
            "<\n ir_version: 9,\n opset_import: [\"\" : 17, \"com.microsoft\" : 1]\n>\n\
             case (float[{n},{m},{oh},{ow}] dY, float[{}] X, float[{}] W) => (float[{}] dW) {{\n\
             [conv_grad] dX, dW, dB = com.microsoft.ConvGrad <kernel_shape: ints = [{kh}, {kw}], \
             strides: ints = [{s}, {s}], dilations: ints = [{d}, {d}], pads: ints = [{pt}, {pl}, {pb}, {pr}]> (dY, X, W)\n}}\n",
            dims(&case.x),
            dims(&case.w),
            dims(&case.w),
        );
        let proto = onnx_ga::ir::text::parse_model(&text).unwrap_or_else(|e| panic!("{e}"));
        let (model, _) = legalize(Model::from_proto(proto), Path::new("slices.onnx"))
            .unwrap_or_else(|e| panic!("{e}"));
        verify::verify(&model).unwrap_or_else(|e| panic!("{e}"));
        let slices = model
            .all_nodes()
            .filter(|id| model.node(*id).proto.op_type() == "Slice")
            .count();
        assert_eq!(
            slices, case.slices,
            "{:?}: one Slice of X per channel slice",
            case.x
        );
        if !ort_available() {
            continue;
        }
        // Deterministic values in [-1, 1).
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut values = |len: usize| -> Vec<f32> {
            (0..len)
                .map(|_| {
                    state = state
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
                })
                .collect()
        };
        let x = values(n * c * h * wd);
        let dy = values(n * m * oh * ow);
        let w = values(m * c * kh * kw);
        let mut want = vec![0f64; m * c * kh * kw];
        for mo in 0..m {
            for ci in 0..c {
                for i in 0..kh {
                    for j in 0..kw {
                        let mut acc = 0f64;
                        for img in 0..n {
                            for p in 0..oh {
                                let row = (s * p + d * i) as isize - pt as isize;
                                if row < 0 || row >= h as isize {
                                    continue;
                                }
                                for q in 0..ow {
                                    let col = (s * q + d * j) as isize - pl as isize;
                                    if col < 0 || col >= wd as isize {
                                        continue;
                                    }
                                    let xv =
                                        x[((img * c + ci) * h + row as usize) * wd + col as usize];
                                    let dv = dy[((img * m + mo) * oh + p) * ow + q];
                                    acc += xv as f64 * dv as f64;
                                }
                            }
                        }
                        want[((mo * c + ci) * kh + i) * kw + j] = acc;
                    }
                }
            }
        }
        let tensor = |shape: &[usize], v: Vec<f32>| {
            Tensor::F32(ndarray::ArrayD::from_shape_vec(shape.to_vec(), v).unwrap())
        };
        let feeds: BTreeMap<String, Tensor> = [
            ("X".to_string(), tensor(&case.x, x)),
            ("dY".to_string(), tensor(&[n, m, oh, ow], dy)),
            ("W".to_string(), tensor(&case.w, w)),
        ]
        .into_iter()
        .collect();
        let got = run_ort(&model.to_proto(), &feeds);
        let largest = want.iter().fold(0f64, |a, v| a.max(v.abs()));
        let expected = tensor(&case.w, want.iter().map(|v| *v as f32).collect());
        let (abs, _, _) = errors(&got["dW"], &expected);
        println!(
            "conv_grad_dw_channel_slices {:?}: max abs {abs:.3e}, of max|dW| {:.3e}",
            case.x,
            abs / largest
        );
        assert_close("dW", &got["dW"], &expected, 0.0, 1e-5 * largest);
    }
}
