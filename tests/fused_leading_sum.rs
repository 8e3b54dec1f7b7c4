//! Sums over leading axes on onnx-ga's `LeadingSum` kernel (src/passes/fused_leading_sum.rs,
//! applied by every CPU session with `SessionOptions::fused_leading_sum`): the kernel's sums
//! are ONNX Runtime's own `ReduceSum`'s bit for bit, on one thread and two, for the shapes
//! backward graphs sum (a bias gradient over `[B, T]`, a convolution's per-image weight
//! gradients over the images), and within float32 rounding of float64; the sums it must
//! leave alone are left alone; a model whose gradients sum that way trains bit-identically
//! with the kernel and without, for each optimizer and what surrounds it. Every case checks
//! how many sums were rewritten, so that none can pass by running ReduceSum twice.

use crate::common::{ort_available, pattern_tensor as tensor, Side};
use onnx_ga::data::Tensor;
use onnx_ga::engine::ort::{OrtSession, SessionOptions};
use onnx_ga::proto::ModelProto;

/// `y = ReduceSum(x)` with `sum` its attributes and axes operand, `x` declared `x_type`.
fn sum_graph(opset: i64, x_type: &str, sum: &str) -> ModelProto {
    let text = format!(
        r#"<ir_version: 8, opset_import: ["" : {opset}]>
sums ({x_type} x) => (float y)
{{
  {sum}
}}
"#
    );
    onnx_ga::ir::text::parse_model(&text).unwrap_or_else(|e| panic!("{e}"))
}

/// The graph's `y` and how many sums the session put on the kernel.
fn run(graph: &ModelProto, x: &Tensor, fused: bool, threads: usize) -> (usize, Tensor) {
    let options = SessionOptions {
        fused_leading_sum: fused,
        threads,
        ..SessionOptions::default()
    };
    let mut s = OrtSession::new(graph, &options).unwrap_or_else(|e| panic!("{e}"));
    let out = s.run(&[("x", x)]).unwrap_or_else(|e| panic!("{e}"));
    let y = out.into_iter().find(|(name, _)| name == "y").expect("y").1;
    (s.fused_leading_sums(), y)
}

fn bits(t: &Tensor) -> (Vec<usize>, Vec<u32>) {
    let a = t.as_f32().expect("float32");
    (a.shape().to_vec(), a.iter().map(|v| v.to_bits()).collect())
}

/// Σ over the first `leading` axes of `x`, in float64.
fn reference(x: &Tensor, leading: usize) -> Vec<f64> {
    let a = x.as_f32().expect("float32");
    let rows: usize = a.shape()[..leading].iter().product();
    let columns = a.len() / rows.max(1);
    let flat: Vec<f32> = a.iter().copied().collect();
    (0..columns)
        .map(|c| (0..rows).map(|r| flat[r * columns + c] as f64).sum())
        .collect()
}

#[test]
fn the_kernel_sums_as_onnx_runtime_does_bit_for_bit() {
    if !ort_available() {
        return;
    }
    let axes = |a: &str| {
        format!(
            "axes = Constant <value = int64[{}] {{{a}}}> ()",
            a.split(',').count()
        )
    };
    // (opset, x's type, the sum, x's dims, leading axes summed)
    let cases: Vec<(i64, &str, String, Vec<usize>, usize)> = vec![
        // A convolution's per-image weight gradients, summed over a symbolic batch.
        (
            17,
            "float[N,1,72,16]",
            format!("{}\n  y = ReduceSum <keepdims = 0> (x, axes)", axes("0")),
            vec![32, 1, 72, 16],
            1,
        ),
        // A bias gradient over [B, T], the axes negative; and the same kept.
        (
            17,
            "float[B,T,96]",
            format!(
                "{}\n  y = ReduceSum <keepdims = 0> (x, axes)",
                axes("-3,-2")
            ),
            vec![8, 17, 96],
            2,
        ),
        (
            17,
            "float[8,17,96]",
            format!("{}\n  y = ReduceSum (x, axes)", axes("1,0")),
            vec![8, 17, 96],
            2,
        ),
        // Wider than two tasks of 512 columns; fewer rows than columns.
        (
            17,
            "float[6,1300]",
            format!("{}\n  y = ReduceSum <keepdims = 0> (x, axes)", axes("0")),
            vec![6, 1300],
            1,
        ),
        // Before opset 13: the axes an attribute.
        (
            11,
            "float[5,3,7]",
            "y = ReduceSum <axes = [0], keepdims = 0> (x)".to_string(),
            vec![5, 3, 7],
            1,
        ),
    ];
    for (opset, x_type, sum, dims, leading) in cases {
        let graph = sum_graph(opset, x_type, &sum);
        let x = tensor(&dims, 5);
        let want = reference(&x, leading);
        for threads in [1, 2] {
            let (rewritten, fused) = run(&graph, &x, true, threads);
            let (untouched, plain) = run(&graph, &x, false, threads);
            assert_eq!((rewritten, untouched), (1, 0), "{x_type} {sum}: rewritten");
            assert_eq!(
                bits(&fused),
                bits(&plain),
                "{x_type} {sum}, {threads} threads"
            );
            let got = fused.as_f32().expect("float32");
            let scale = want.iter().fold(1e-30f64, |a, v| a.max(v.abs()));
            for (g, w) in got.iter().zip(&want) {
                assert!(
                    (*g as f64 - w).abs() / scale < 1e-6,
                    "{x_type} {sum}: {g} vs {w}"
                );
            }
            assert_eq!(got.len(), want.len(), "{x_type} {sum}: elements");
        }
    }
}

#[test]
fn sums_that_are_not_over_leading_axes_are_left_as_written() {
    if !ort_available() {
        return;
    }
    let cases = [
        // A middle axis; the batch and the spatial axes (a convolution's bias gradient); an
        // integer sum; no axes (every axis, by default); every axis named (ONNX Runtime
        // adds those in Eigen's order, not row by row).
        "axes = Constant <value = int64[1] {1}> ()\n  y = ReduceSum (x, axes)",
        "axes = Constant <value = int64[3] {0, 1, 2}> ()\n  y = ReduceSum <keepdims = 0> (x, axes)",
        "axes = Constant <value = int64[2] {0, 2}> ()\n  y = ReduceSum (x, axes)",
        "i = Cast <to = 7> (x)\n  axes = Constant <value = int64[1] {0}> ()\n  s = ReduceSum (i, axes)\n  y = Cast <to = 1> (s)",
        "y = ReduceSum (x)",
    ];
    let x = tensor(&[3, 4, 5], 2);
    for sum in cases {
        let graph = sum_graph(17, "float[3,4,5]", sum);
        let (rewritten, fused) = run(&graph, &x, true, 1);
        let (_, plain) = run(&graph, &x, false, 1);
        assert_eq!(rewritten, 0, "{sum}: rewritten");
        assert_eq!(bits(&fused), bits(&plain), "{sum}: as written");
    }
}

/// A convolution and a linear layer on its flattened output, a cross-entropy over 8
/// classes: the step for `middle`. Its gradients sum over leading axes twice: the
/// convolution's per-image weight gradients over the images, the linear layer's bias
/// gradient over the batch.
fn model_step(middle: &str) -> ModelProto {
    let text = r#"<ir_version: 8, opset_import: ["" : 17]>
conv_linear (float[N,2,6,6] x, int64[N] labels) => (float loss)
{
  c = Conv <kernel_shape = [3, 3]> (x, w1, b1)
  a = Relu (c)
  f = Flatten (a)
  p = MatMul (f, w2)
  logits = Add (p, b2)
  loss = SoftmaxCrossEntropyLoss <reduction = "mean"> (logits, labels)
}
"#;
    let mut model = onnx_ga::ir::text::parse_model(text).unwrap();
    let graph = model.graph.as_mut().unwrap();
    crate::common::push_parameters(
        graph,
        &[
            ("w1", &[3, 2, 3, 3], 31, 0.5),
            ("b1", &[3], 32, 0.1),
            ("w2", &[48, 8], 33, 0.3),
            ("b2", &[8], 34, 0.1),
        ],
    );
    crate::common::ort_step(model, "conv_linear.onnx", middle)
}

/// The model trained 8 windows with its sums on the kernel and on ReduceSum, for each
/// optimizer with what surrounds it: the same losses and states, bit for bit.
#[test]
fn a_model_trains_bit_identically_with_its_sums_on_the_kernel() {
    if !ort_available() {
        return;
    }
    let side = |fused: bool| Side {
        session: SessionOptions {
            fused_leading_sum: fused,
            ..SessionOptions::default()
        },
        perturbed: false,
    };
    let (fused, plain) = (side(true), side(false));
    let data = crate::common::labelled_data(&[16, 2, 6, 6], 5, 8);
    // Two sums in each of the three sessions that differentiate.
    crate::common::trains_bit_identically(
        model_step,
        (&data, 16),
        [&fused, &plain],
        |t| t.fused_leading_sums(),
        6,
    );
}
