//! Convolutions' weight gradients on onnx-ga's `ConvWeightGrad` kernel
//! (src/passes/fused_conv_weight_grad.rs, applied by one-thread CPU sessions with
//! `SessionOptions::fused_conv_weight_grad` where an image's columns are large): the
//! unfolding, per-image product and sum over the images in one kernel give the bits of the
//! three nodes they replace at every geometry the unfolding takes, and lie within float32
//! rounding of the float64 definition; a residual network and a strided one train bit for
//! bit alike with the kernel and without; two-thread sessions and small columns are left as
//! written. Every case checks how many gradients went onto the kernel, so that none can
//! pass by leaving them as written.

use std::collections::BTreeMap;

use crate::common::{ort_available, pattern_tensor as tensor, Side};
use crate::fused_im2col::gradient_graph;
use onnx_ga::data::Tensor;
use onnx_ga::engine::ort::{OrtSession, SessionOptions};

/// The kernel on (every size of columns, so that small graphs exercise it) or off.
fn options(fused: bool) -> SessionOptions {
    SessionOptions {
        fused_conv_weight_grad: fused,
        conv_weight_grad_min_columns: 0,
        ..SessionOptions::default()
    }
}

/// One case: x, w, the Conv's attributes, y, and how many weight gradients the kernel
/// takes (the lowering computes a 3x3 one over 16 channels or more on two halves).
type Case = ([usize; 4], [usize; 4], &'static str, [usize; 4], usize);

const CASES: [Case; 8] = [
    // The ResNet's 3x3 over two channel halves, and a batch of 5.
    (
        [5, 16, 10, 10],
        [8, 16, 3, 3],
        "pads = [1,1,1,1]",
        [5, 8, 10, 10],
        2,
    ),
    // Its downsampling, and its 1x1 strided shortcut.
    (
        [2, 4, 9, 11],
        [6, 4, 3, 3],
        "pads = [1,1,1,1], strides = [2,2]",
        [2, 6, 5, 6],
        1,
    ),
    (
        [3, 6, 8, 8],
        [5, 6, 1, 1],
        "strides = [2,2]",
        [3, 5, 4, 4],
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
    // More channels than a GEMM's row block, on planes of 32 (long rows).
    (
        [2, 24, 32, 32],
        [12, 24, 3, 3],
        "pads = [1,1,1,1], strides = [2,2]",
        [2, 12, 16, 16],
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

/// `w_grad` of `loss = Σ Conv(x, w) · r` in float64: `Σ_n,y,x r[n, m, y, x] · x[n, c, y·sh +
/// i·dh - t, x·sw + j·dw - l]`, with the Conv attributes parsed from `attrs`.
fn reference(x: &Tensor, r: &Tensor, w: [usize; 4], attrs: &str) -> Vec<f64> {
    let list = |name: &str, default: Vec<usize>| -> Vec<usize> {
        let Some(at) = attrs.find(&format!("{name} = [")) else {
            return default;
        };
        let rest = &attrs[at + name.len() + 4..];
        rest[..rest.find(']').unwrap()]
            .split(',')
            .map(|v| v.trim().parse().unwrap())
            .collect()
    };
    let (strides, pads, dilations) = (
        list("strides", vec![1, 1]),
        list("pads", vec![0; 4]),
        list("dilations", vec![1, 1]),
    );
    let (x, r) = (x.as_f32().unwrap(), r.as_f32().unwrap());
    let (&[n, c, h, wd], &[_, m, ho, wo]) = (x.shape(), r.shape()) else {
        panic!("rank 4");
    };
    let [_, _, kh, kw] = w;
    let mut dw = vec![0f64; m * c * kh * kw];
    for (img, o, y, xo) in (0..n).flat_map(|a| {
        (0..m).flat_map(move |b| (0..ho).flat_map(move |y| (0..wo).map(move |x| (a, b, y, x))))
    }) {
        let g = r[[img, o, y, xo]] as f64;
        for (ch, i, j) in
            (0..c).flat_map(|ch| (0..kh).flat_map(move |i| (0..kw).map(move |j| (ch, i, j))))
        {
            let iy = (y * strides[0] + i * dilations[0]) as isize - pads[0] as isize;
            let ix = (xo * strides[1] + j * dilations[1]) as isize - pads[1] as isize;
            if (0..h as isize).contains(&iy) && (0..wd as isize).contains(&ix) {
                dw[((o * c + ch) * kh + i) * kw + j] +=
                    g * x[[img, ch, iy as usize, ix as usize]] as f64;
            }
        }
    }
    dw
}

#[test]
fn weight_gradients_on_the_kernel_give_the_same_bits() {
    if !ort_available() {
        return;
    }
    for (x, w, attrs, y, weight_grads) in CASES {
        let graph = gradient_graph(x, w, attrs, y);
        let inputs = [("x", tensor(&x, 1)), ("r", tensor(&y, 2))];
        let feeds: Vec<(&str, &Tensor)> = inputs.iter().map(|(k, v)| (*k, v)).collect();
        for threads in [1, 2] {
            let run = |fused: bool| {
                let mut s = OrtSession::new(
                    &graph,
                    &SessionOptions {
                        threads,
                        ..options(fused)
                    },
                )
                .unwrap();
                // Two-thread sessions keep the three nodes (the pass's MAX_THREADS).
                let expected = if fused && threads == 1 {
                    weight_grads
                } else {
                    0
                };
                assert_eq!(s.fused_conv_weight_grads(), expected, "{attrs}: rewritten");
                s.run(&feeds)
                    .unwrap()
                    .into_iter()
                    .collect::<BTreeMap<_, _>>()
            };
            let (fused, plain) = (run(true), run(false));
            assert_eq!(fused, plain, "{attrs}, {threads} thread(s)");
            let got = fused["w_grad"].as_f32().expect("float32");
            let want = reference(&inputs[0].1, &inputs[1].1, w, attrs);
            let scale = want.iter().fold(0f64, |a, v| a.max(v.abs())).max(1e-30);
            for (k, (g, r)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (*g as f64 - r).abs() <= 2e-6 * scale,
                    "{attrs}: w_grad[{k}] {g} against {r}"
                );
            }
        }
    }
}

/// A residual network (its 3x3 gradients over channel halves, a strided one) trained 8
/// windows with AdamW behind AGC, on one thread and two: bit for bit as the three nodes.
#[test]
fn a_residual_network_trains_bit_identically_on_the_kernel() {
    if !ort_available() {
        return;
    }
    let step = crate::nchwc_conv::residual_step(crate::fused_im2col::AGC_ADAMW);
    let session = OrtSession::new(&step, &options(true)).unwrap();
    assert_eq!(session.fused_conv_weight_grads(), 5);
    drop(session);
    crate::fused_im2col::trains_bit_identically(&step, options);
}

/// A model with a strided convolution under another trained 8 windows, for each optimizer
/// with what surrounds it: the same losses and states, bit for bit.
#[test]
fn a_model_trains_bit_identically_with_its_weight_gradients_on_the_kernel() {
    if !ort_available() {
        return;
    }
    let side = |fused: bool| Side {
        session: options(fused),
        perturbed: false,
    };
    let (fused, plain) = (side(true), side(false));
    let data = crate::common::labelled_data(&[16, 2, 8, 8], 5, 8);
    // Both convolutions' in each of the three sessions that differentiate.
    crate::common::trains_bit_identically(
        crate::fused_col2im::model_step,
        (&data, 16),
        [&fused, &plain],
        |t| t.fused_conv_weight_grads(),
        6,
    );
}

/// With the default options: a 3x3 gradient over 16 channels at 32x32 (74 K elements in an
/// image's columns per channel half) and one over 64 channels at 8x8 (18 K) go onto the
/// kernel on one thread, not on two; a strided 1x1 over 16 channels (4 K) stays as written.
#[test]
fn the_kernel_takes_large_columns_on_one_thread_only() {
    if !ort_available() {
        return;
    }
    let cases: [Case; 3] = [
        (
            [2, 16, 32, 32],
            [16, 16, 3, 3],
            "pads = [1,1,1,1]",
            [2, 16, 32, 32],
            2,
        ),
        (
            [2, 64, 8, 8],
            [64, 64, 3, 3],
            "pads = [1,1,1,1]",
            [2, 64, 8, 8],
            2,
        ),
        (
            [2, 16, 32, 32],
            [32, 16, 1, 1],
            "strides = [2,2]",
            [2, 32, 16, 16],
            0,
        ),
    ];
    for (x, w, attrs, y, weight_grads) in cases {
        let graph = gradient_graph(x, w, attrs, y);
        for threads in [1, 2] {
            let options = SessionOptions {
                threads,
                ..SessionOptions::default()
            };
            let session = OrtSession::new(&graph, &options).unwrap();
            let expected = if threads == 1 { weight_grads } else { 0 };
            assert_eq!(
                session.fused_conv_weight_grads(),
                expected,
                "{x:?}, {threads} thread(s)"
            );
        }
    }
}
