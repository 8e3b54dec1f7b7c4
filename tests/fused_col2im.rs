//! Transposed convolutions as one batched product and onnx-ga's `Col2Im` kernel
//! (src/passes/fused_col2im.rs, applied by CPU sessions of two threads or more with
//! `SessionOptions::fused_col2im`): the result is ONNX Runtime's own `ConvTranspose`'s bit
//! for bit, on two threads and against one, for the strided data gradients' geometries
//! (the ResNet's downsampling and its 1x1 shortcut, uneven pads, dilation, unequal strides,
//! a symbolic batch) and for a decoder's upsampling with its bias, and within float32
//! rounding of the float64 definition; what the pass
//! must leave alone is left alone; a model with a strided convolution under another trains
//! bit-identically with the kernel and without, for each optimizer and what surrounds it.
//! Every case checks how many convolutions were rewritten, so that none can pass by
//! running `ConvTranspose` twice.

use crate::common::{ort_available, pattern_tensor as tensor, Side};
use onnx_ga::data::Tensor;
use onnx_ga::engine::ort::{OrtSession, SessionOptions};
use onnx_ga::proto::ModelProto;

/// `y = ConvTranspose <attrs> (dy, w)`, dy declared `dy_type`, w `[m, c, kh, kw]`.
fn transposed_graph(dy_type: &str, w: [usize; 4], attrs: &str) -> ModelProto {
    let [m, c, kh, kw] = w;
    let text = format!(
        r#"<ir_version: 8, opset_import: ["" : 17]>
transposed ({dy_type} dy, float[{m},{c},{kh},{kw}] w) => (float y)
{{
  y = ConvTranspose <{attrs}> (dy, w)
}}
"#
    );
    onnx_ga::ir::text::parse_model(&text).unwrap_or_else(|e| panic!("{e}"))
}

/// The graph's `y` and how many transposed convolutions the session folded on `Col2Im`.
fn run(graph: &ModelProto, feeds: [&Tensor; 2], fused: bool, threads: usize) -> (usize, Tensor) {
    let options = SessionOptions {
        fused_col2im: fused,
        threads,
        ..SessionOptions::default()
    };
    let mut s = OrtSession::new(graph, &options).unwrap_or_else(|e| panic!("{e}"));
    let out = s
        .run(&[("dy", feeds[0]), ("w", feeds[1])])
        .unwrap_or_else(|e| panic!("{e}"));
    let y = out.into_iter().find(|(name, _)| name == "y").expect("y").1;
    (s.fused_foldings(), y)
}

fn bits(t: &Tensor) -> (Vec<usize>, Vec<u32>) {
    let a = t.as_f32().expect("float32");
    (a.shape().to_vec(), a.iter().map(|v| v.to_bits()).collect())
}

/// One case's geometry: strides, pads `[t, l, b, r]`, dilations, output padding.
#[derive(Clone, Copy, Debug)]
struct Geometry {
    strides: [usize; 2],
    pads: [usize; 4],
    dilations: [usize; 2],
    output_padding: [usize; 2],
}

impl Geometry {
    fn attributes(&self) -> String {
        let list = |v: &[usize]| {
            v.iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        };
        format!(
            "strides = [{}], pads = [{}], dilations = [{}], output_padding = [{}]",
            list(&self.strides),
            list(&self.pads),
            list(&self.dilations),
            list(&self.output_padding)
        )
    }

    /// ONNX's ConvTranspose of `dy` `[n, m, hi, wi]` by `w` `[m, c, kh, kw]` plus `bias`
    /// `[c]`, in float64.
    fn reference(&self, dy: &Tensor, w: &Tensor, bias: Option<&[f32]>) -> (Vec<usize>, Vec<f64>) {
        let (dy, w) = (dy.as_f32().unwrap(), w.as_f32().unwrap());
        let (&[n, m, hi, wi], &[_, c, kh, kw]) = (dy.shape(), w.shape()) else {
            panic!("rank 4");
        };
        let [sh, sw] = self.strides;
        let [dh, dw] = self.dilations;
        let [t, l, b, r] = self.pads;
        let h = sh * (hi - 1) + self.output_padding[0] + (kh - 1) * dh + 1 - t - b;
        let wd = sw * (wi - 1) + self.output_padding[1] + (kw - 1) * dw + 1 - l - r;
        let mut y: Vec<f64> = (0..n * c * h * wd)
            .map(|e| bias.map_or(0.0, |b| b[(e / (h * wd)) % c] as f64))
            .collect();
        for (i_n, i_m, y_in, x_in, o_c, i, j) in reference_terms(n, m, hi, wi, c, kh, kw) {
            let oy = (y_in * sh + i * dh) as isize - t as isize;
            let ox = (x_in * sw + j * dw) as isize - l as isize;
            if (0..h as isize).contains(&oy) && (0..wd as isize).contains(&ox) {
                y[((i_n * c + o_c) * h + oy as usize) * wd + ox as usize] +=
                    dy[[i_n, i_m, y_in, x_in]] as f64 * w[[i_m, o_c, i, j]] as f64;
            }
        }
        (vec![n, c, h, wd], y)
    }
}

/// Every index of the reference's sum, in one iterator.
fn reference_terms(
    n: usize,
    m: usize,
    hi: usize,
    wi: usize,
    c: usize,
    kh: usize,
    kw: usize,
) -> impl Iterator<Item = (usize, usize, usize, usize, usize, usize, usize)> {
    (0..n).flat_map(move |a| {
        (0..m).flat_map(move |b| {
            (0..hi).flat_map(move |y| {
                (0..wi).flat_map(move |x| {
                    (0..c).flat_map(move |o| {
                        (0..kh).flat_map(move |i| (0..kw).map(move |j| (a, b, y, x, o, i, j)))
                    })
                })
            })
        })
    })
}

/// One case: dy's declared type, dy's dims, w's dims, the geometry, and whether a bias is
/// added.
type Case = (&'static str, [usize; 4], [usize; 4], Geometry, bool);

#[test]
fn the_folding_gives_conv_transposes_bits() {
    if !ort_available() {
        return;
    }
    let g = |strides, pads, dilations, output_padding| Geometry {
        strides,
        pads,
        dilations,
        output_padding,
    };
    let cases: Vec<Case> = vec![
        // The ResNet-8's downsampling data gradient, a symbolic batch, several tasks of
        // whole planes (6 x 24 planes of 32 x 32).
        (
            "float[N,32,16,16]",
            [6, 32, 16, 16],
            [32, 24, 3, 3],
            g([2, 2], [1, 1, 1, 1], [1, 1], [1, 1]),
            false,
        ),
        // Its 1x1 shortcut.
        (
            "float[N,16,8,8]",
            [3, 16, 8, 8],
            [16, 8, 1, 1],
            g([2, 2], [0, 0, 0, 0], [1, 1], [1, 1]),
            false,
        ),
        // Uneven pads, dilation, a stride of 3 with an output padding of 2.
        (
            "float[2,5,4,6]",
            [2, 5, 4, 6],
            [5, 3, 3, 2],
            g([3, 2], [2, 0, 1, 1], [2, 1], [2, 1]),
            false,
        ),
        // Unequal strides, a wide kernel, no pads.
        (
            "float[2,4,5,3]",
            [2, 4, 5, 3],
            [4, 2, 2, 4],
            g([1, 3], [0, 0, 0, 0], [1, 1], [0, 0]),
            false,
        ),
        // Stride 1 with few channels (not a blocked-kernel convolution).
        (
            "float[2,3,7,7]",
            [2, 3, 7, 7],
            [3, 5, 3, 3],
            g([1, 1], [1, 1, 1, 1], [1, 1], [0, 0]),
            false,
        ),
        // A decoder's upsampling, 4x4 kernel at stride 2, with its bias.
        (
            "float[N,8,5,5]",
            [2, 8, 5, 5],
            [8, 6, 4, 4],
            g([2, 2], [1, 1, 1, 1], [1, 1], [0, 0]),
            true,
        ),
    ];
    for (dy_type, dy_dims, w_dims, geometry, biased) in cases {
        let mut graph = transposed_graph(dy_type, w_dims, &geometry.attributes());
        let bias: Vec<f32> = (0..w_dims[1]).map(|c| 0.25 - 0.125 * c as f32).collect();
        if biased {
            let g = graph.graph.as_mut().unwrap();
            g.node[0].input.push("bias".into());
            crate::common::push_initializer(g, "bias", &[w_dims[1] as i64], &bias);
        }
        let (dy, w) = (tensor(&dy_dims, 3), tensor(&w_dims, 4));
        let what = format!("{dy_type} * {w_dims:?} {geometry:?} (bias {biased})");
        let (rewritten, fused) = run(&graph, [&dy, &w], true, 2);
        let (untouched, plain) = run(&graph, [&dy, &w], false, 2);
        let (on_one_thread, one) = run(&graph, [&dy, &w], true, 1);
        assert_eq!(
            (rewritten, untouched, on_one_thread),
            (1, 0, 0),
            "{what}: rewritten"
        );
        assert_eq!(bits(&fused), bits(&plain), "{what}: two threads");
        assert_eq!(bits(&fused), bits(&one), "{what}: against one thread");
        let (dims, want) = geometry.reference(&dy, &w, biased.then_some(&bias[..]));
        let got = fused.as_f32().expect("float32");
        assert_eq!(got.shape(), &dims[..], "{what}: shape");
        let scale = want.iter().fold(1e-30f64, |a, v| a.max(v.abs()));
        for (k, (g, e)) in got.iter().zip(&want).enumerate() {
            assert!(
                (*g as f64 - e).abs() / scale < 1e-6,
                "{what}: element {k}: {g} vs {e}"
            );
        }
    }
}

#[test]
fn transposed_convolutions_it_does_not_fold_are_left_as_written() {
    if !ort_available() {
        return;
    }
    // (w's dims, attributes): two groups; automatic pads; an explicit output shape.
    let cases: [([usize; 4], &str); 3] = [
        ([4, 2, 3, 3], "strides = [2, 2], group = 2"),
        ([4, 3, 3, 3], "strides = [2, 2], auto_pad = \"SAME_UPPER\""),
        ([4, 3, 3, 3], "strides = [2, 2], output_shape = [10, 10]"),
    ];
    let dy = tensor(&[2, 4, 5, 5], 3);
    for (w_dims, attrs) in cases {
        let graph = transposed_graph("float[2,4,5,5]", w_dims, attrs);
        let w = tensor(&w_dims, 4);
        let (rewritten, fused) = run(&graph, [&dy, &w], true, 2);
        let (_, plain) = run(&graph, [&dy, &w], false, 2);
        assert_eq!(rewritten, 0, "{attrs}: rewritten");
        assert_eq!(bits(&fused), bits(&plain), "{attrs}: as written");
    }
}

/// Two convolutions, the second of stride 2 (so its data gradient is a strided
/// `ConvTranspose`), and a linear layer over 8 classes: the step for `middle`. Three
/// channels keep the first off the blocked kernels.
pub(crate) fn model_step(middle: &str) -> ModelProto {
    let text = r#"<ir_version: 8, opset_import: ["" : 17]>
strided (float[N,2,8,8] x, int64[N] labels) => (float loss)
{
  c1 = Conv <kernel_shape = [3, 3], pads = [1, 1, 1, 1]> (x, w1, b1)
  a1 = Relu (c1)
  c2 = Conv <kernel_shape = [3, 3], pads = [1, 1, 1, 1], strides = [2, 2]> (a1, w2, b2)
  a2 = Relu (c2)
  f = Flatten (a2)
  p = MatMul (f, w3)
  logits = Add (p, b3)
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
            ("w2", &[4, 3, 3, 3], 35, 0.4),
            ("b2", &[4], 36, 0.1),
            ("w3", &[64, 8], 33, 0.3),
            ("b3", &[8], 34, 0.1),
        ],
    );
    crate::common::ort_step(model, "strided.onnx", middle)
}

/// The model trained 8 windows on two threads with its strided data gradient folded by
/// `Col2Im` and on `ConvTranspose`, for each optimizer with what surrounds it: the same
/// losses and states, bit for bit.
#[test]
fn a_model_trains_bit_identically_with_its_transposed_convolution_folded() {
    if !ort_available() {
        return;
    }
    let side = |fused: bool| Side {
        session: SessionOptions {
            fused_col2im: fused,
            threads: 2,
            ..SessionOptions::default()
        },
        perturbed: false,
    };
    let (fused, plain) = (side(true), side(false));
    let data = crate::common::labelled_data(&[16, 2, 8, 8], 5, 8);
    // One in each of the three sessions that differentiate.
    crate::common::trains_bit_identically(
        model_step,
        (&data, 16),
        [&fused, &plain],
        |t| t.fused_foldings(),
        3,
    );
}
