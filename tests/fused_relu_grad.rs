//! The ReLU gradients on onnx-ga's `ReluGrad` kernel (src/passes/fused_relu_grad.rs, applied
//! by every CPU session with `SessionOptions::fused_relu_grad`): a ReLU's gradient graph
//! gives the same bits with the kernel as with the standard ops it replaces, a mask that
//! broadcasts is left alone, and a step trains bit for bit alike. Every case checks how many
//! gradients went onto the kernel.

use std::collections::BTreeMap;
use std::path::Path;

use crate::common::ort_available;
use crate::fused_im2col::{trains_bit_identically, AGC_ADAMW};
use crate::nchwc_conv::residual_step;
use onnx_ga::data::Tensor;
use onnx_ga::engine::ort::{OrtSession, SessionOptions};
use onnx_ga::proto::ModelProto;

fn options(fused: bool) -> SessionOptions {
    SessionOptions {
        fused_relu_grad: fused,
        ..SessionOptions::default()
    }
}

use crate::common::pattern_tensor as tensor;

/// `body` between `x`, `r` (both of `shape`) and the loss, through our autodiff with p
/// (of `p_dims`) the parameter.
fn gradient_graph(shape: &str, p_dims: &[i64], body: &str) -> ModelProto {
    let text = format!(
        r#"<ir_version: 8, opset_import: ["" : 17]>
relu (float[{shape}] x, float[{shape}] r) => (float loss)
{{
{body}
  loss = ReduceSum <keepdims = 0> (yr)
}}
"#
    );
    let mut model = onnx_ga::ir::text::parse_model(&text).unwrap();
    let n: i64 = p_dims.iter().product();
    let v: Vec<f32> = (0..n).map(|i| (i % 7) as f32 * 0.1 - 0.3).collect();
    let mut t = onnx_ga::ir::builder::tensor_f32(p_dims, &v);
    t.name = Some("p".into());
    model.graph.as_mut().unwrap().initializer.push(t);
    let mut forward = onnx_ga::signature::forward(model, Path::new("relu.onnx"));
    forward.signature.loss = "loss".into();
    onnx_ga::step::build_step(forward, "autodiff(loss=loss),legalize-ort,dce", true)
        .unwrap_or_else(|e| panic!("{body}: {e}"))
        .model
        .to_proto()
}

fn run(
    graph: &ModelProto,
    inputs: &[(&str, Tensor)],
    fused: bool,
    expected: usize,
) -> BTreeMap<String, Tensor> {
    let mut s = OrtSession::new(graph, &options(fused)).unwrap();
    assert_eq!(s.fused_relu_grads(), if fused { expected } else { 0 });
    let feeds: Vec<(&str, &Tensor)> = inputs.iter().map(|(k, v)| (*k, v)).collect();
    s.run(&feeds).unwrap().into_iter().collect()
}

#[test]
fn relu_gradients_on_the_kernel_give_the_same_bits() {
    if !ort_available() {
        return;
    }
    let relu = "  xp = Add (x, p)\n  y = Relu (xp)\n  yr = Mul (y, r)";
    for (shape, dims) in [
        ("N,6,5,7", [3usize, 6, 5, 7].as_slice()),
        ("N,33", [4usize, 33].as_slice()),
    ] {
        let p_dims: Vec<i64> = dims.iter().map(|&d| d as i64).collect();
        let graph = gradient_graph(shape, &p_dims, relu);
        let inputs = [("x", tensor(dims, 1)), ("r", tensor(dims, 2))];
        let (fused, plain) = (
            run(&graph, &inputs, true, 1),
            run(&graph, &inputs, false, 1),
        );
        assert!(fused.contains_key("p_grad"));
        assert_eq!(fused, plain, "{shape}");
    }
}

/// Masks a model makes itself, broadcast against the other operand both ways: the kernel
/// broadcasts as the Mul did, the same bits.
#[test]
fn a_broadcast_mask_gives_the_same_bits() {
    if !ort_available() {
        return;
    }
    let body = "  zero = Constant <value = float {0}> ()\n  \
                xp = Mul (x, p)\n  \
                rr = ReduceMean <axes = [0], keepdims = 1> (r)\n  \
                pos_small = Greater (rr, zero)\n  \
                small = Cast <to = 1> (pos_small)\n  \
                masked = Mul (xp, small)\n  \
                xs = ReduceMean <axes = [0], keepdims = 1> (xp)\n  \
                pos_large = Greater (r, zero)\n  \
                large = Cast <to = 1> (pos_large)\n  \
                spread = Mul (xs, large)\n  \
                yr = Add (masked, spread)";
    let graph = gradient_graph("4,5", &[5], body);
    let inputs = [("x", tensor(&[4, 5], 1)), ("r", tensor(&[4, 5], 2))];
    // Both forward products, and both of their gradients with respect to xp and xs,
    // which multiply by the same masks.
    let fused = run(&graph, &inputs, true, 4);
    assert_eq!(fused, run(&graph, &inputs, false, 0));
}

#[test]
fn a_step_trains_bit_identically_on_the_kernel() {
    if !ort_available() {
        return;
    }
    let step = residual_step(AGC_ADAMW);
    // The three ReLUs' gradients (the last one's too: the pool's gradient reaches it).
    assert_eq!(
        OrtSession::new(&step, &options(true))
            .unwrap()
            .fused_relu_grads(),
        3
    );
    trains_bit_identically(&step, options);
}
