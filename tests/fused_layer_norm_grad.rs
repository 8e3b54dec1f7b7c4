//! Layer normalisation's gradient on onnx-ga's `LayerNormGrad` kernel
//! (src/passes/fused_layer_norm_grad.rs, applied by every CPU session with
//! `SessionOptions::fused_layer_norm_grad`): the gradient graph of a `LayerNormalization`
//! through our autodiff and the legalize lowering gives dX, dScale and dBias within float32
//! rounding of the derivative in float64 and of the standard ops, the same bits on 1 and 2
//! threads; a model with layer norms trains within 1e-6 of the standard ops for each
//! optimizer and what surrounds it. Every case checks how many gradients went onto the
//! kernel, so that none can pass by running the standard ops twice.

use std::collections::BTreeMap;
use std::path::Path;

use crate::common::{ort_available, pattern, pattern_tensor as tensor, Side};
use onnx_ga::data::Tensor;
use onnx_ga::engine::ort::{OrtSession, SessionOptions};
use onnx_ga::proto::ModelProto;

/// `loss = Σ LayerNorm(x · s; gamma, beta) · r` over the last axis of `dims`, s, gamma and
/// beta parameters: its gradient graph (s_grad, gamma_grad, beta_grad).
fn gradient_graph(dims: &[usize]) -> ModelProto {
    let d = crate::common::dims_text(dims);
    let text = format!(
        r#"<ir_version: 8, opset_import: ["" : 17]>
ln (float[{d}] x, float[{d}] r) => (float loss)
{{
  h = Mul (x, s)
  y = LayerNormalization <axis = -1, epsilon = 1e-5> (h, gamma, beta)
  yr = Mul (y, r)
  loss = ReduceSum <keepdims = 0> (yr)
}}
"#
    );
    let mut model = onnx_ga::ir::text::parse_model(&text).unwrap();
    let graph = model.graph.as_mut().unwrap();
    let n: usize = dims.iter().product();
    let c = *dims.last().unwrap();
    let s_dims: Vec<i64> = dims.iter().map(|&v| v as i64).collect();
    for (name, dims, values) in [
        ("s", s_dims, vec![1.5; n]),
        (
            "gamma",
            vec![c as i64],
            pattern(c, 7).iter().map(|v| 1.0 + v).collect(),
        ),
        ("beta", vec![c as i64], pattern(c, 8)),
    ] {
        crate::common::push_initializer(graph, name, &dims, &values);
    }
    let mut forward = onnx_ga::signature::forward(model, Path::new("ln.onnx"));
    forward.signature.loss = "loss".into();
    onnx_ga::step::build_step(forward, "autodiff(loss=loss),legalize-ort,dce", true)
        .unwrap_or_else(|e| panic!("{e}"))
        .model
        .to_proto()
}

fn floats(t: &Tensor) -> Vec<f32> {
    t.as_f32().expect("float32").iter().copied().collect()
}

/// The three gradients in float64 from the definition: rows of the last axis.
fn reference(x: &[f32], r: &[f32], gamma: &[f32], c: usize) -> [Vec<f64>; 3] {
    let (mut ds, mut dgamma, mut dbeta) = (vec![0f64; x.len()], vec![0f64; c], vec![0f64; c]);
    for (row, (x, r)) in x.chunks(c).zip(r.chunks(c)).enumerate() {
        let h: Vec<f64> = x.iter().map(|v| *v as f64 * 1.5).collect();
        let mean = h.iter().sum::<f64>() / c as f64;
        let var = h.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / c as f64;
        let inv = 1.0 / (var + 1e-5).sqrt();
        let xhat: Vec<f64> = h.iter().map(|v| (v - mean) * inv).collect();
        let g: Vec<f64> = (0..c).map(|i| r[i] as f64 * gamma[i] as f64).collect();
        let mean_g = g.iter().sum::<f64>() / c as f64;
        let mean_gx = (0..c).map(|i| g[i] * xhat[i]).sum::<f64>() / c as f64;
        for i in 0..c {
            let dh = inv * (g[i] - mean_g - xhat[i] * mean_gx);
            ds[row * c + i] = dh * x[i] as f64;
            dgamma[i] += r[i] as f64 * xhat[i];
            dbeta[i] += r[i] as f64;
        }
    }
    [ds, dgamma, dbeta]
}

#[test]
fn layer_norm_gradients_on_the_kernel_are_the_derivative() {
    if !ort_available() {
        return;
    }
    for dims in [vec![3, 5], vec![2, 7, 33], vec![8, 64, 256], vec![4, 1]] {
        let graph = gradient_graph(&dims);
        let c = *dims.last().unwrap();
        let (x, r) = (tensor(&dims, 4), tensor(&dims, 3));
        let feeds = [("x", &x), ("r", &r)];
        let run = |fused: bool, threads: usize| {
            let options = SessionOptions {
                fused_layer_norm_grad: fused,
                threads,
                ..SessionOptions::default()
            };
            let mut s = OrtSession::new(&graph, &options).unwrap();
            assert_eq!(
                s.fused_layer_norm_grads(),
                fused as usize,
                "{dims:?}: rewritten"
            );
            s.run(&feeds)
                .unwrap()
                .into_iter()
                .map(|(name, t)| (name, floats(&t)))
                .collect::<BTreeMap<_, _>>()
        };
        let (fused, plain) = (run(true, 1), run(false, 1));
        // The same bits on two threads: the kernel's sums do not depend on them.
        assert_eq!(fused, run(true, 2), "{dims:?}: 1 and 2 threads");
        assert_eq!(
            fused["loss"], plain["loss"],
            "{dims:?}: the forward is untouched"
        );
        let gamma: Vec<f32> = pattern(c, 7).iter().map(|v| 1.0 + v).collect();
        let want = reference(&floats(&x), &floats(&r), &gamma, c);
        for (name, want) in ["s_grad", "gamma_grad", "beta_grad"].into_iter().zip(&want) {
            let scale = want.iter().fold(1e-30f64, |a, v| a.max(v.abs()));
            let gap = |got: &[f32]| {
                got.iter()
                    .zip(want)
                    .map(|(g, w)| (*g as f64 - w).abs() / scale)
                    .fold(0f64, f64::max)
            };
            let (kernel, standard) = (gap(&fused[name]), gap(&plain[name]));
            assert!(
                kernel < 2e-6 && standard < 2e-6,
                "{dims:?}, {name}: kernel {kernel:e}, standard ops {standard:e} from the derivative"
            );
        }
    }
}

/// Two linear layers around a layer norm, the step for `middle`.
fn model_step(middle: &str) -> ModelProto {
    let text = r#"<ir_version: 8, opset_import: ["" : 17]>
ln_mlp (float[N,16] x, int64[N] labels) => (float loss)
{
  h = Gemm <transB = 1> (x, w1, b1)
  n = LayerNormalization <axis = -1> (h, gamma, beta)
  a = Relu (n)
  logits = Gemm <transB = 1> (a, w2, b2)
  loss = SoftmaxCrossEntropyLoss <reduction = "mean"> (logits, labels)
}
"#;
    let mut model = onnx_ga::ir::text::parse_model(text).unwrap();
    let graph = model.graph.as_mut().unwrap();
    for (name, dims, seed, scale, shift) in [
        ("w1", vec![32i64, 16], 21, 0.6f32, 0.0f32),
        ("b1", vec![32], 22, 0.2, 0.0),
        ("gamma", vec![32], 25, 0.3, 1.0),
        ("beta", vec![32], 26, 0.1, 0.0),
        ("w2", vec![10, 32], 23, 0.5, 0.0),
        ("b2", vec![10], 24, 0.1, 0.0),
    ] {
        let n: i64 = dims.iter().product();
        let v: Vec<f32> = pattern(n as usize, seed)
            .iter()
            .map(|v| v * scale + shift)
            .collect();
        crate::common::push_initializer(graph, name, &dims, &v);
    }
    crate::common::ort_step(model, "ln_mlp.onnx", middle)
}

/// The model trained 8 windows with the kernel and on the standard ops, for each optimizer
/// with what surrounds it: the losses and every state within 1e-6 relative (states: largest
/// difference over the tensor's largest magnitude).
#[test]
fn a_model_with_layer_norm_trains_on_the_kernel_within_rounding() {
    if !ort_available() {
        return;
    }
    let side = |fused: bool| Side {
        session: SessionOptions {
            fused_layer_norm_grad: fused,
            ..SessionOptions::default()
        },
        perturbed: false,
    };
    let (fused, plain) = (side(true), side(false));
    let data = BTreeMap::from([
        ("x".to_string(), tensor(&[16, 16], 5)),
        (
            "labels".to_string(),
            Tensor::I64(
                ndarray::ArrayD::from_shape_vec(vec![16], (0..16).map(|i| i % 10).collect())
                    .unwrap(),
            ),
        ),
    ]);
    // One layer norm in each of the three sessions.
    crate::common::trains_within_rounding(
        &crate::common::OPTIMIZERS,
        model_step,
        (&data, 16),
        [&fused, &plain],
        onnx_ga::train::Trainer::fused_layer_norm_grads,
        3,
    );
}
