//! A convolution's weight gradient, the three nodes of the lowering (`Im2Col`, the
//! per-image `MatMul`, the sum over the images) against onnx-ga's `ConvWeightGrad`
//! (src/passes/fused_conv_weight_grad.rs), at the ResNet-8's geometries, B 8 and 32, one
//! thread (the pass leaves two-thread sessions alone: there the kernel measured 0.94-1.42x
//! the three nodes), the pass's size threshold off so that every geometry is measured. Each session runs the gradient graph of `loss = Σ Conv(x, w) · r`
//! (our autodiff, legalized): the forward convolution and dW, so the difference of the two
//! columns is the weight gradient's. The columns alternate in blocks of 20 runs, each block
//! in a fresh session, three blocks each; prints the median run in ms.
//!
//! `cargo bench --bench conv_weight_grad` (with `--bench`; `cargo test --all-targets` runs
//! it without, and then it only checks one small case).

use std::path::Path;
use std::time::Instant;

use onnx_ga::data::Tensor;
use onnx_ga::engine::ort::{OrtSession, SessionOptions};

/// The gradient graph of `loss = Σ Conv(x, w) · r`, `c` to `m` channels on `h` x `h`
/// planes, a `k` x `k` kernel with `stride` (pads `k / 2`): w's gradient as an output.
fn gradient_model(
    c: usize,
    m: usize,
    h: usize,
    k: usize,
    stride: usize,
) -> (onnx_ga::proto::ModelProto, usize) {
    let p = k / 2;
    let ho = (h + 2 * p - k) / stride + 1;
    let text = format!(
        r#"<ir_version: 8, opset_import: ["" : 17]>
conv (float[N,{c},{h},{h}] x, float[N,{m},{ho},{ho}] r) => (float loss)
{{
  y = Conv <strides = [{stride}, {stride}], pads = [{p}, {p}, {p}, {p}]> (x, w)
  yr = Mul (y, r)
  loss = ReduceSum <keepdims = 0> (yr)
}}
"#
    );
    let mut model = onnx_ga::ir::text::parse_model(&text).expect("the convolution's model parses");
    let graph = model.graph.as_mut().expect("a graph");
    let dims = [m as i64, c as i64, k as i64, k as i64];
    let n = m * c * k * k;
    let values: Vec<f32> = (0..n)
        .map(|i| ((i * 31) % 17) as f32 * 0.01 - 0.08)
        .collect();
    let mut w = onnx_ga::ir::builder::tensor_f32(&dims, &values);
    w.name = Some("w".into());
    graph.initializer.push(w);
    let mut forward = onnx_ga::signature::forward(model, Path::new("conv.onnx"));
    forward.signature.loss = "loss".into();
    let step = onnx_ga::step::build_step(forward, "autodiff(loss=loss),legalize-ort,dce", true)
        .expect("the gradient graph builds");
    (step.model.to_proto(), ho)
}

fn pattern(dims: &[usize]) -> Tensor {
    let n = dims.iter().product::<usize>();
    let values = (0..n)
        .map(|i| ((i * 7919) % 997) as f32 * 1e-3 - 0.5)
        .collect();
    Tensor::F32(ndarray::ArrayD::from_shape_vec(dims.to_vec(), values).expect("dims"))
}

fn main() {
    let bench = std::env::args().any(|a| a == "--bench");
    if onnx_ga::runtime::require_onnxruntime_for_tests().is_none() {
        eprintln!("conv_weight_grad: ONNX Runtime not found; nothing measured");
        return;
    }
    // (C, M, H, kernel, stride): the ResNet-8's 3x3s at 32, 16 and 8 wide, its two
    // downsamplings and their 1x1 shortcuts.
    let geometries: &[(usize, usize, usize, usize, usize)] = if bench {
        &[
            (16, 16, 32, 3, 1),
            (32, 32, 16, 3, 1),
            (64, 64, 8, 3, 1),
            (16, 32, 32, 3, 2),
            (32, 64, 16, 3, 2),
            (16, 32, 32, 1, 2),
        ]
    } else {
        &[(4, 6, 8, 3, 2)]
    };
    let batches: &[usize] = if bench { &[8, 32] } else { &[2] };
    let (blocks, runs) = if bench { (3, 20) } else { (1, 2) };
    for &(c, m, h, k, stride) in geometries {
        let (model, ho) = gradient_model(c, m, h, k, stride);
        for &b in batches {
            let (x, r) = (pattern(&[b, c, h, h]), pattern(&[b, m, ho, ho]));
            let feeds = [("x", &x), ("r", &r)];
            {
                let mut ms = [Vec::new(), Vec::new()];
                let mut outputs: [Vec<(String, Tensor)>; 2] = [Vec::new(), Vec::new()];
                for _ in 0..blocks {
                    for (column, fused) in [true, false].into_iter().enumerate() {
                        let options = SessionOptions {
                            fused_conv_weight_grad: fused,
                            conv_weight_grad_min_columns: 0,
                            ..SessionOptions::default()
                        };
                        let mut s = OrtSession::new(&model, &options).expect("session");
                        assert!(
                            (s.fused_conv_weight_grads() > 0) == fused,
                            "rewritten when asked"
                        );
                        for _ in 0..5 {
                            s.run(&feeds).expect("run");
                        }
                        for _ in 0..runs {
                            let start = Instant::now();
                            let out = s.run(&feeds).expect("run");
                            ms[column].push(start.elapsed().as_secs_f64() * 1e3);
                            outputs[column] = out;
                        }
                    }
                }
                // The same bits, or the timing compares different computations.
                assert_eq!(
                    outputs[0], outputs[1],
                    "the kernel and the three nodes differ"
                );
                for v in ms.iter_mut() {
                    v.sort_by(f64::total_cmp);
                }
                let [fused, plain] = [&ms[0], &ms[1]].map(|v| v[v.len() / 2]);
                println!(
                    "B {b}, {c} -> {m} channels, {h} wide, {k}x{k} stride {stride}: ConvWeightGrad {fused:.3} ms, three nodes {plain:.3} ms ({:.2}x, {:+.3} ms)",
                    fused / plain,
                    fused - plain
                );
            }
        }
    }
}
