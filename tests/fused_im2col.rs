//! The weight gradients' unfoldings on onnx-ga's `Im2Col` kernel (src/passes/fused_im2col.rs,
//! applied by every CPU session with `SessionOptions::fused_im2col`): a convolution's
//! gradient graph at several geometries gives the same bits with the kernel as with the
//! grouped convolution it replaces, and a step trains bit for bit alike. Every case checks
//! how many unfoldings went onto the kernel, so that none can pass by running the
//! convolution twice.

use std::collections::BTreeMap;
use std::path::Path;

use crate::common::ort_available;
use crate::nchwc_conv::{residual_data, residual_step};
use onnx_ga::data::Tensor;
use onnx_ga::engine::ort::{OrtSession, SessionOptions};
use onnx_ga::proto::ModelProto;
use onnx_ga::train::{micro_batch, TrainOptions, Trainer};

fn options(fused: bool) -> SessionOptions {
    SessionOptions {
        fused_im2col: fused,
        ..SessionOptions::default()
    }
}

use crate::common::{pattern as values, pattern_tensor as tensor};

/// `loss = Σ Conv(x, w) · r` with the attributes given, through our autodiff: the gradient
/// graph, whose dW unfolds x.
pub(crate) fn gradient_graph(
    x: [usize; 4],
    w: [usize; 4],
    attrs: &str,
    y: [usize; 4],
) -> ModelProto {
    let dims = |d: [usize; 4]| d.map(|v| v.to_string()).join(",");
    let text = format!(
        r#"<ir_version: 8, opset_import: ["" : 17]>
conv (float[{}] x, float[{}] r) => (float loss)
{{
  y = Conv <{attrs}> (x, w)
  yr = Mul (y, r)
  loss = ReduceSum <keepdims = 0> (yr)
}}
"#,
        dims(x),
        dims(y)
    );
    let mut model = onnx_ga::ir::text::parse_model(&text).unwrap();
    let graph = model.graph.as_mut().unwrap();
    let n: usize = w.iter().product();
    let w_dims: Vec<i64> = w.iter().map(|&d| d as i64).collect();
    let mut t = onnx_ga::ir::builder::tensor_f32(&w_dims, &values(n, 7));
    t.name = Some("w".into());
    graph.initializer.push(t);
    let mut forward = onnx_ga::signature::forward(model, Path::new("conv.onnx"));
    forward.signature.loss = "loss".into();
    onnx_ga::step::build_step(forward, "autodiff(loss=loss),legalize-ort,dce", true)
        .unwrap_or_else(|e| panic!("{attrs}: {e}"))
        .model
        .to_proto()
}

#[test]
fn unfoldings_on_the_kernel_give_the_same_bits() {
    if !ort_available() {
        return;
    }
    // (x, w, attributes, y, unfoldings: the channel-sliced dW unfolds two halves)
    type Case = ([usize; 4], [usize; 4], &'static str, [usize; 4], usize);
    let cases: [Case; 6] = [
        (
            [2, 16, 10, 10],
            [8, 16, 3, 3],
            "pads = [1,1,1,1]",
            [2, 8, 10, 10],
            2,
        ),
        (
            [2, 4, 9, 11],
            [6, 4, 3, 3],
            "pads = [1,1,1,1], strides = [2,2]",
            [2, 6, 5, 6],
            1,
        ),
        (
            [1, 3, 8, 9],
            [4, 3, 3, 2],
            "pads = [2,0,1,1], strides = [1,3]",
            [1, 4, 9, 3],
            1,
        ),
        (
            [2, 2, 9, 9],
            [3, 2, 3, 3],
            "pads = [2,2,2,2], dilations = [2,2]",
            [2, 3, 9, 9],
            1,
        ),
        (
            [3, 1, 6, 7],
            [2, 1, 5, 5],
            "pads = [0,1,2,3]",
            [3, 2, 4, 7],
            1,
        ),
        // 1x1 without stride or pads: x is its own unfolding, nothing to rewrite.
        (
            [2, 4, 5, 5],
            [3, 4, 1, 1],
            "pads = [0,0,0,0]",
            [2, 3, 5, 5],
            0,
        ),
    ];
    for (x, w, attrs, y, unfoldings) in cases {
        let graph = gradient_graph(x, w, attrs, y);
        let inputs = [("x", tensor(&x, 1)), ("r", tensor(&y, 2))];
        let feeds: Vec<(&str, &Tensor)> = inputs.iter().map(|(k, v)| (*k, v)).collect();
        let run = |fused: bool| {
            let mut s = OrtSession::new(&graph, &options(fused)).unwrap();
            let expected = if fused { unfoldings } else { 0 };
            assert_eq!(s.fused_unfoldings(), expected, "{attrs}: rewritten");
            s.run(&feeds)
                .unwrap()
                .into_iter()
                .collect::<BTreeMap<_, _>>()
        };
        let (fused, plain) = (run(true), run(false));
        assert!(fused.contains_key("w_grad"), "{attrs}: {:?}", fused.keys());
        assert_eq!(fused, plain, "{attrs}");
    }
}

/// The middle of the residual step these tests train: AdamW behind AGC.
pub(crate) const AGC_ADAMW: &str =
    "grad-accum(steps=4),agc(clip=0.01,include_final=true),optimizer(kind=adamw,lr=0.01)";

/// A residual network trained 8 windows with AdamW behind AGC: bit for bit as with the
/// grouped convolutions, on one thread and two.
#[test]
fn a_step_trains_bit_identically_on_the_kernel() {
    if !ort_available() {
        return;
    }
    let step = residual_step(AGC_ADAMW);
    // The first two convolutions' weight gradients each unfold two halves of 16 channels,
    // the strided one's its whole input.
    let session = OrtSession::new(&step, &options(true)).unwrap();
    assert_eq!(session.fused_unfoldings(), 5);
    drop(session);
    trains_bit_identically(&step, options);
}

/// `step` trained 8 windows with `options(true)` and `options(false)`, on one thread and
/// two: the same losses and states, bit for bit.
pub(crate) fn trains_bit_identically(step: &ModelProto, options: fn(bool) -> SessionOptions) {
    let n = 16;
    let data = residual_data(n);
    for threads in [1, 2] {
        let trainer = |fused: bool| {
            let options = TrainOptions {
                session: SessionOptions {
                    threads,
                    ..options(fused)
                },
                ..TrainOptions::default()
            };
            Trainer::with_options(step, &options).unwrap()
        };
        let (mut fused, mut plain) = (trainer(true), trainer(false));
        for i in 0..32 {
            let batch = micro_batch(&data, n, 4, i);
            let (a, b) = (
                fused.step(&batch, false).unwrap(),
                plain.step(&batch, false).unwrap(),
            );
            assert_eq!(a, b, "{threads} thread(s), micro-step {i}");
        }
        assert_eq!(
            fused.state().unwrap(),
            plain.state().unwrap(),
            "{threads} thread(s)"
        );
    }
}
