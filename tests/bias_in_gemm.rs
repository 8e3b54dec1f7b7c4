//! A linear layer's bias added inside its product (src/passes/bias_in_gemm.rs, applied by
//! every CPU session with `SessionOptions::bias_in_gemm`): `Add(MatMul(A[.., K], W), b)` on
//! one `Gemm` between two Reshapes gives the layer and its gradients within float32
//! rounding of float64 and of the standard ops; the cases the pass must leave alone are
//! left alone; a model of such layers trains within 1e-6 of the standard ops for each
//! optimizer and what surrounds it. Every case checks how many layers were rewritten, so
//! that none can pass by running the standard ops twice.

use std::collections::BTreeMap;
use std::path::Path;

use crate::common::{ort_available, pattern, pattern_tensor as tensor, Side};
use onnx_ga::data::Tensor;
use onnx_ga::engine::ort::{OrtSession, SessionOptions};
use onnx_ga::proto::ModelProto;

/// `loss = Σ y² · r` with `y = MatMul(x, w) + b`, `x` declared `x_type`, w `[K, N]` and b
/// `[N]` parameters: its gradient graph (`loss`, `w_grad`, `b_grad`; the gradient at y,
/// 2 y r, carries y into both). `other_reader` adds the
/// product times r to the sum, so that the `Add` is not its only reader.
fn gradient_graph(
    x_type: &str,
    y_type: &str,
    k: usize,
    n: usize,
    other_reader: bool,
) -> ModelProto {
    let sum = if other_reader {
        "q = Mul (p, r)\n  z = Add (yry, q)"
    } else {
        "z = Identity (yry)"
    };
    let text = format!(
        r#"<ir_version: 8, opset_import: ["" : 17]>
linear ({x_type} x, {y_type} r) => (float loss)
{{
  p = MatMul (x, w)
  y = Add (p, b)
  yr = Mul (y, r)
  yry = Mul (yr, y)
  {sum}
  loss = ReduceSum <keepdims = 0> (z)
}}
"#
    );
    let mut model = onnx_ga::ir::text::parse_model(&text).unwrap();
    let graph = model.graph.as_mut().unwrap();
    for (name, dims, seed) in [
        ("w", vec![k as i64, n as i64], 11),
        ("b", vec![n as i64], 12),
    ] {
        let len = dims.iter().product::<i64>() as usize;
        crate::common::push_initializer(graph, name, &dims, &pattern(len, seed));
    }
    let mut forward = onnx_ga::signature::forward(model, Path::new("linear.onnx"));
    forward.signature.loss = "loss".into();
    onnx_ga::step::build_step(forward, "autodiff(loss=loss),legalize-ort,dce", true)
        .unwrap_or_else(|e| panic!("{e}"))
        .model
        .to_proto()
}

fn floats(t: &Tensor) -> Vec<f32> {
    t.as_f32().expect("float32").iter().copied().collect()
}

/// loss, w_grad and b_grad in float64 from the definition, rows of `k` in `x`.
fn reference(x: &[f32], r: &[f32], w: &[f32], b: &[f32], k: usize, n: usize) -> [Vec<f64>; 3] {
    let rows = x.len() / k;
    let (mut loss, mut dw, mut db) = (0f64, vec![0f64; k * n], vec![0f64; n]);
    for row in 0..rows {
        for j in 0..n {
            let dot: f64 = (0..k)
                .map(|i| x[row * k + i] as f64 * w[i * n + j] as f64)
                .sum();
            let y = dot + b[j] as f64;
            loss += y * y * r[row * n + j] as f64;
            let g = 2.0 * y * r[row * n + j] as f64;
            db[j] += g;
            for i in 0..k {
                dw[i * n + j] += x[row * k + i] as f64 * g;
            }
        }
    }
    [vec![loss], dw, db]
}

/// A pattern of `dims` in [0.25, 0.75].
fn positive(dims: &[usize], seed: usize) -> Tensor {
    let n = dims.iter().product();
    let values = pattern(n, seed).iter().map(|v| v.abs() + 0.25).collect();
    Tensor::F32(ndarray::ArrayD::from_shape_vec(dims.to_vec(), values).unwrap())
}

fn run(
    graph: &ModelProto,
    feeds: &[(&str, &Tensor)],
    rewrite: bool,
) -> (usize, BTreeMap<String, Vec<f32>>) {
    let options = SessionOptions {
        bias_in_gemm: rewrite,
        ..SessionOptions::default()
    };
    let mut s = OrtSession::new(graph, &options).unwrap();
    let outputs = s
        .run(feeds)
        .unwrap()
        .into_iter()
        .map(|(name, t)| (name, floats(&t)))
        .collect();
    (s.biases_in_gemm(), outputs)
}

#[test]
fn a_bias_added_inside_the_product_is_the_linear_layer() {
    if !ort_available() {
        return;
    }
    // [B, T, K] with every axis known, the batch a symbol (the target shape's -1), two
    // symbols (the shape read at run time), four axes, and K over MLAS's blocks of the
    // inner axis.
    let cases: [(&[usize], &str, usize); 5] = [
        (&[2, 3, 4], "float[2,3,4]", 5),
        (&[3, 5, 16], "float[B,5,16]", 7),
        (&[3, 5, 16], "float[B,T,16]", 7),
        (&[2, 2, 3, 8], "float[2,2,3,8]", 6),
        (&[2, 16, 1024], "float[2,16,1024]", 64),
    ];
    for (dims, x_type, n) in cases {
        let k = *dims.last().unwrap();
        let mut y_dims = dims.to_vec();
        *y_dims.last_mut().unwrap() = n;
        let y_type = x_type.replace(&format!(",{k}]"), &format!(",{n}]"));
        let graph = gradient_graph(x_type, &y_type, k, n, false);
        // r > 0: the loss is a sum of positive terms, so its relative rounding is small.
        let (x, r) = (tensor(dims, 4), positive(&y_dims, 3));
        let feeds = [("x", &x), ("r", &r)];
        let (rewritten, fused) = run(&graph, &feeds, true);
        let (untouched, plain) = run(&graph, &feeds, false);
        assert_eq!((rewritten, untouched), (1, 0), "{dims:?}: rewritten");
        let want = reference(
            &floats(&x),
            &floats(&r),
            &pattern(k * n, 11),
            &pattern(n, 12),
            k,
            n,
        );
        for (name, want) in ["loss", "w_grad", "b_grad"].into_iter().zip(&want) {
            let scale = want.iter().fold(1e-30f64, |a, v| a.max(v.abs()));
            let gap = |got: &[f32]| {
                assert_eq!(got.len(), want.len(), "{dims:?}, {name}: elements");
                got.iter()
                    .zip(want)
                    .map(|(g, w)| (*g as f64 - w).abs() / scale)
                    .fold(0f64, f64::max)
            };
            let key = |m: &BTreeMap<String, Vec<f32>>| {
                m.get(name)
                    .cloned()
                    .unwrap_or_else(|| panic!("{name} not in {:?}", m.keys()))
            };
            let (inside, apart) = (gap(&key(&fused)), gap(&key(&plain)));
            assert!(
                inside < 2e-6 && apart < 2e-6,
                "{dims:?}, {name}: bias inside {inside:e}, apart {apart:e} from float64"
            );
        }
    }
}

#[test]
fn what_the_pass_cannot_rewrite_is_left_as_written() {
    if !ort_available() {
        return;
    }
    // A matrix (ONNX Runtime fuses that itself), and a product something else reads (the
    // Add's output is not its only use).
    let cases = [
        ("float[6,4]", "float[6,5]", false, &[6usize, 4][..]),
        ("float[2,3,4]", "float[2,3,5]", true, &[2, 3, 4]),
    ];
    for (x_type, y_type, other_reader, dims) in cases {
        let graph = gradient_graph(x_type, y_type, 4, 5, other_reader);
        let mut y_dims = dims.to_vec();
        *y_dims.last_mut().unwrap() = 5;
        let (x, r) = (tensor(dims, 4), tensor(&y_dims, 3));
        let feeds = [("x", &x), ("r", &r)];
        let (rewritten, fused) = run(&graph, &feeds, true);
        let (_, plain) = run(&graph, &feeds, false);
        assert_eq!(
            rewritten, 0,
            "{x_type}, other reader {other_reader}: rewritten"
        );
        assert_eq!(
            fused, plain,
            "{x_type}, other reader {other_reader}: as written"
        );
    }
}

/// Two linear layers on `[N, 4, 16]` sequences, a cross-entropy over each position's 8
/// classes: the step for `middle`.
fn model_step(middle: &str) -> ModelProto {
    let text = r#"<ir_version: 8, opset_import: ["" : 17]>
seq_mlp (float[N,4,16] x, int64[N,4] labels) => (float loss)
{
  p1 = MatMul (x, w1)
  h = Add (p1, b1)
  a = Relu (h)
  p2 = MatMul (a, w2)
  y = Add (b2, p2)
  logits = Transpose <perm = [0, 2, 1]> (y)
  loss = SoftmaxCrossEntropyLoss <reduction = "mean"> (logits, labels)
}
"#;
    let mut model = onnx_ga::ir::text::parse_model(text).unwrap();
    let graph = model.graph.as_mut().unwrap();
    crate::common::push_parameters(
        graph,
        &[
            ("w1", &[16, 32], 21, 0.6),
            ("b1", &[32], 22, 0.2),
            ("w2", &[32, 8], 23, 0.5),
            ("b2", &[8], 24, 0.1),
        ],
    );
    crate::common::ort_step(model, "seq_mlp.onnx", middle)
}

/// The model trained 8 windows with the biases inside their products and apart, for each
/// optimizer with what surrounds it: the losses and every state within 1e-6 relative.
#[test]
fn a_model_of_linear_layers_trains_with_biases_inside_within_rounding() {
    if !ort_available() {
        return;
    }
    let side = |rewrite: bool| Side {
        session: SessionOptions {
            bias_in_gemm: rewrite,
            ..SessionOptions::default()
        },
        perturbed: false,
    };
    let (inside, apart) = (side(true), side(false));
    let data = BTreeMap::from([
        ("x".to_string(), tensor(&[16, 4, 16], 5)),
        (
            "labels".to_string(),
            Tensor::I64(
                ndarray::ArrayD::from_shape_vec(
                    vec![16, 4],
                    (0..64).map(|i| (i * 5) % 8).collect(),
                )
                .unwrap(),
            ),
        ),
    ]);
    // Two layers in each of the three sessions.
    crate::common::trains_within_rounding(
        &crate::common::OPTIMIZERS,
        model_step,
        (&data, 16),
        [&inside, &apart],
        onnx_ga::train::Trainer::biases_in_gemm,
        6,
    );
}
