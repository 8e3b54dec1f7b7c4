//! The exact GELU's gradient on onnx-ga's `GeluGrad` kernel (src/passes/fused_gelu_grad.rs,
//! applied by every CPU session with `SessionOptions::fused_gelu_grad`): the gradient graph
//! of a GELU as PyTorch exports it gives dX within float32 rounding of the derivative in
//! float64, and as the standard ops give it but for the exponential's rounding; an MLP with
//! GELU trains within rounding of the standard ops for each optimizer and what surrounds it.
//! Every case checks how many GELU gradients went onto the kernel, so that none can pass by
//! running the standard ops twice.

use std::collections::BTreeMap;
use std::path::Path;

use crate::common::{ort_available, pattern_tensor as tensor, Side};
use onnx_ga::data::Tensor;
use onnx_ga::engine::ort::{OrtSession, SessionOptions};
use onnx_ga::proto::ModelProto;

fn options(fused: bool) -> SessionOptions {
    SessionOptions {
        fused_gelu_grad: fused,
        ..SessionOptions::default()
    }
}

/// GELU as `torch.nn.GELU()` exports it (`x · (1 + erf(x / √2)) · ½`).
const GELU: &str = r#"
  u = Div (h, sqrt2)
  e = Erf (u)
  a = Add (e, one)
  hx = Mul (h, a)
  y = Mul (hx, half)"#;

const CONSTANTS: &str = r#"
  sqrt2 = Constant <value = float {1.4142135}> ()
  one = Constant <value = float {1.0}> ()
  half = Constant <value = float {0.5}> ()"#;

/// `loss = Σ GELU(x · s) · r` through our autodiff, s a parameter of x's shape (all 1.5):
/// the gradient graph, whose `s_grad` is `r · GELU'(x · s) · x`.
fn gradient_graph(dims: &[usize]) -> ModelProto {
    let d = crate::common::dims_text(dims);
    let text = format!(
        r#"<ir_version: 8, opset_import: ["" : 17]>
gelu (float[{d}] x, float[{d}] r) => (float loss)
{{{CONSTANTS}
  h = Mul (x, s){GELU}
  yr = Mul (y, r)
  loss = ReduceSum <keepdims = 0> (yr)
}}
"#
    );
    let mut model = onnx_ga::ir::text::parse_model(&text).unwrap();
    let graph = model.graph.as_mut().unwrap();
    let n: usize = dims.iter().product();
    let s_dims: Vec<i64> = dims.iter().map(|&v| v as i64).collect();
    let mut t = onnx_ga::ir::builder::tensor_f32(&s_dims, &vec![1.5; n]);
    t.name = Some("s".into());
    graph.initializer.push(t);
    let mut forward = onnx_ga::signature::forward(model, Path::new("gelu.onnx"));
    forward.signature.loss = "loss".into();
    onnx_ga::step::build_step(forward, "autodiff(loss=loss),legalize-ort,dce", true)
        .unwrap_or_else(|e| panic!("{e}"))
        .model
        .to_proto()
}

fn floats(t: &Tensor) -> Vec<f32> {
    t.as_f32().expect("float32").iter().copied().collect()
}

/// erf by Maclaurin's series in float64 (within 1e-12 on |z| < 3.5, all this test uses).
fn erf(z: f64) -> f64 {
    let (mut sum, mut term, mut k) = (0f64, z, 0f64);
    while term.abs() > 1e-18 && k < 300.0 {
        sum += term / (2.0 * k + 1.0);
        k += 1.0;
        term *= -z * z / k;
    }
    2.0 / std::f64::consts::PI.sqrt() * sum
}

#[test]
fn gelu_gradients_on_the_kernel_are_the_derivative() {
    if !ort_available() {
        return;
    }
    for dims in [vec![3, 5, 7], vec![4, 1000], vec![1]] {
        let graph = gradient_graph(&dims);
        let n: usize = dims.iter().product();
        // x · s spans [-3, 3]: both tails and the kink of the derivative.
        let x: Vec<f32> = (0..n)
            .map(|i| 2.0 * (i as f32 / n.max(2) as f32 - 0.5) * 2.0)
            .collect();
        let x = Tensor::F32(ndarray::ArrayD::from_shape_vec(dims.clone(), x).unwrap());
        let r = tensor(&dims, 3);
        let feeds = [("x", &x), ("r", &r)];
        let run = |fused: bool| {
            let mut s = OrtSession::new(&graph, &options(fused)).unwrap();
            assert_eq!(s.fused_gelu_grads(), fused as usize, "{dims:?}: rewritten");
            s.run(&feeds)
                .unwrap()
                .into_iter()
                .collect::<BTreeMap<_, _>>()
        };
        let (mut fused, mut plain) = (run(true), run(false));
        let (got, standard) = (
            floats(&fused.remove("s_grad").expect("s_grad")),
            floats(&plain.remove("s_grad").expect("s_grad")),
        );
        // The loss is the same computation.
        assert_eq!(fused, plain, "{dims:?}");
        let (x, r) = (floats(&x), floats(&r));
        let want: Vec<f64> = (0..n)
            .map(|i| {
                let h = x[i] as f64 * 1.5;
                let phi = 0.5 * (1.0 + erf(h / std::f64::consts::SQRT_2));
                let density = (-h * h / 2.0).exp() / (2.0 * std::f64::consts::PI).sqrt();
                r[i] as f64 * (phi + h * density) * x[i] as f64
            })
            .collect();
        let scale = want.iter().fold(0f64, |a, v| a.max(v.abs()));
        for (name, dx) in [("kernel", &got), ("standard ops", &standard)] {
            let worst = dx
                .iter()
                .zip(&want)
                .map(|(g, w)| (*g as f64 - w).abs() / scale)
                .fold(0f64, f64::max);
            assert!(
                worst < 1e-6,
                "{dims:?}, {name}: {worst:e} from the derivative"
            );
        }
        let apart = got
            .iter()
            .zip(&standard)
            .map(|(a, b)| (a - b).abs() as f64 / scale)
            .fold(0f64, f64::max);
        assert!(
            apart < 2e-7,
            "{dims:?}: kernel and standard ops {apart:e} apart"
        );
    }
}

/// An MLP with GELU between two linear layers, the step for `middle`.
fn mlp_step(middle: &str) -> ModelProto {
    let text = format!(
        r#"<ir_version: 8, opset_import: ["" : 17]>
mlp (float[N,16] x, int64[N] labels) => (float loss)
{{{CONSTANTS}
  h = Gemm <transB = 1> (x, w1, b1){GELU}
  logits = Gemm <transB = 1> (y, w2, b2)
  loss = SoftmaxCrossEntropyLoss <reduction = "mean"> (logits, labels)
}}
"#
    );
    let mut model = onnx_ga::ir::text::parse_model(&text).unwrap();
    let graph = model.graph.as_mut().unwrap();
    crate::common::push_parameters(
        graph,
        &[
            ("w1", &[32, 16], 21, 0.6),
            ("b1", &[32], 22, 0.2),
            ("w2", &[10, 32], 23, 0.5),
            ("b2", &[10], 24, 0.1),
        ],
    );
    crate::common::ort_step(model, "mlp.onnx", middle)
}

fn mlp_data(n: usize) -> BTreeMap<String, Tensor> {
    BTreeMap::from([
        ("x".to_string(), tensor(&[n, 16], 5)),
        (
            "labels".to_string(),
            Tensor::I64(
                ndarray::ArrayD::from_shape_vec(vec![n], (0..n as i64).map(|i| i % 10).collect())
                    .unwrap(),
            ),
        ),
    ])
}

/// The MLP trained 8 windows with the kernel and on the standard ops, for each optimizer
/// with what surrounds it: the losses and every state within 1e-6 relative (states: largest
/// difference over the tensor's largest magnitude; measured at most 1.2e-7 for the losses,
/// 1.8e-7 for the states, Adam's included).
#[test]
fn an_mlp_with_gelu_trains_on_the_kernel_within_rounding() {
    if !ort_available() {
        return;
    }
    let side = |fused: bool| Side {
        session: options(fused),
        perturbed: false,
    };
    let (fused, plain) = (side(true), side(false));
    let data = mlp_data(16);
    // One GELU in each of the three sessions (accumulate, window start, apply).
    crate::common::trains_within_rounding(
        &crate::common::OPTIMIZERS,
        mlp_step,
        (&data, 16),
        [&fused, &plain],
        onnx_ga::train::Trainer::fused_gelu_grads,
        3,
    );
}

/// GELU as exported, its output y and its `Add` A both graph outputs.
fn forward_graph(dims: &[usize]) -> ModelProto {
    let d = crate::common::dims_text(dims);
    let text = format!(
        r#"<ir_version: 8, opset_import: ["" : 17]>
gelu (float[{d}] h) => (float[{d}] y, float[{d}] a)
{{{CONSTANTS}{GELU}
}}
"#
    );
    onnx_ga::ir::text::parse_model(&text).unwrap()
}

/// The GELU forward on its kernel (`SessionOptions::fused_gelu`, src/passes/fused_gelu.rs)
/// against the same session without it, bit for bit, on 1 and 2 threads, from one element
/// to many chunks of the kernel (the [8, 64, 1024] activation of the realistic bench's GPT
/// at B 8: eight chunks run by the pool's threads, each calling ONNX Runtime's `Erf`):
/// y and A over [-9, 9] with NaN, both infinities, signed zeros and subnormals among the
/// inputs; and the loss and gradient of the autodiff's graph, where the gradient's kernel
/// reads the forward kernel's A.
#[test]
fn gelu_forwards_on_the_kernel_are_the_standard_ops_bit_for_bit() {
    if !ort_available() {
        return;
    }
    let bits = |t: &Tensor| floats(t).iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
    for dims in [vec![1], vec![3, 5, 7], vec![4, 1000], vec![8, 64, 1024]] {
        let n: usize = dims.iter().product();
        let mut h: Vec<f32> = (0..n)
            .map(|i| 9.0 * (2.0 * i as f32 / n.max(2) as f32 - 1.0))
            .collect();
        let specials = [
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            -0.0,
            0.0,
            1e-40,
            -3e-39,
        ];
        for (i, v) in specials.into_iter().enumerate().filter(|(i, _)| 2 * i < n) {
            h[2 * i] = v;
        }
        let h = Tensor::F32(ndarray::ArrayD::from_shape_vec(dims.clone(), h).unwrap());
        let x = tensor(&dims, 4);
        let r = tensor(&dims, 3);
        let (forward, gradient) = (forward_graph(&dims), gradient_graph(&dims));
        for threads in [1, 2] {
            let run = |graph: &ModelProto, feeds: &[(&str, &Tensor)], fused: bool| {
                let options = SessionOptions {
                    fused_gelu: fused,
                    threads,
                    ..SessionOptions::default()
                };
                let mut s = OrtSession::new(graph, &options).unwrap();
                assert_eq!(s.fused_gelus(), fused as usize, "{dims:?}: rewritten");
                s.run(feeds).unwrap()
            };
            for (what, graph, feeds) in [
                ("forward", &forward, vec![("h", &h)]),
                ("gradient graph", &gradient, vec![("x", &x), ("r", &r)]),
            ] {
                let (fused, plain) = (run(graph, &feeds, true), run(graph, &feeds, false));
                let names = |outputs: &[(String, Tensor)]| {
                    outputs.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>()
                };
                assert_eq!(names(&fused), names(&plain), "{dims:?}: {what}'s outputs");
                assert_eq!(fused.len(), 2, "{dims:?}: {what}'s two outputs");
                for ((name, got), (_, want)) in fused.iter().zip(&plain) {
                    assert!(
                        bits(got) == bits(want),
                        "{dims:?}, {threads} threads, {what}: {name} differs"
                    );
                }
            }
        }
    }
}

/// The MLP with GELU trains bit for bit alike with its forwards on the kernel and on the
/// standard ops, 8 windows, each optimizer with what surrounds it (three sessions, one GELU
/// each).
#[test]
fn an_mlp_trains_bit_identically_with_its_gelu_forwards_on_the_kernel() {
    if !ort_available() {
        return;
    }
    let side = |fused: bool| Side {
        session: SessionOptions {
            fused_gelu: fused,
            ..SessionOptions::default()
        },
        perturbed: false,
    };
    let (fused, plain) = (side(true), side(false));
    let data = mlp_data(16);
    for optimizer in [
        "optimizer(kind=sgd,lr=0.05)",
        "optimizer(kind=adamw,lr=0.01)",
    ] {
        for around in crate::common::AROUNDS {
            let middle = format!("{around},{optimizer}");
            let step = mlp_step(&middle);
            let (loss, state) =
                crate::common::train_pair(&step, &middle, (&data, 16), [&fused, &plain], |t, k| {
                    let expected = if k == 0 { 3 } else { 0 };
                    assert_eq!(t.fused_gelus(), expected, "{middle}: rewritten");
                });
            assert_eq!((loss, state), (0.0, 0.0), "{middle}: not bit-identical");
        }
    }
}
