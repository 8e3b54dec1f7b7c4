//! A transposed convolution, ONNX Runtime's `ConvTranspose` against the batched product and
//! onnx-ga's `Col2Im` fold (src/passes/fused_col2im.rs), one session of the one node each,
//! on 1 and 2 threads: the ResNet-8's downsampling data gradient (3x3, stride 2) and a
//! decoder's upsampling (4x4, stride 2, with its bias) at B 8 and 32. One thread is a
//! check that the pass leaves such sessions alone (both columns are `ConvTranspose`). The
//! columns alternate in blocks of 20 runs, each block in a fresh session (two sessions'
//! spinning pools alive at once take each other's cores), three blocks each; prints the
//! median run in ms. Read two-thread numbers with the machine's core-to-core state
//! (`realistic-bench --bench --c2c`; benches/README.md, "Run AC").
//!
//! `cargo bench --bench col2im` (with `--bench`; `cargo test --all-targets` runs it
//! without, and then it only checks one small case on two threads).

use std::time::Instant;

use onnx_ga::data::Tensor;
use onnx_ga::engine::ort::{OrtSession, SessionOptions};

/// `y = ConvTranspose(dy, w, bias)` of `m` to `c` channels, `hi` x `hi` up by `stride`.
fn transposed_model(
    m: usize,
    c: usize,
    hi: usize,
    k: usize,
    stride: usize,
) -> onnx_ga::proto::ModelProto {
    // An output padding for odd kernels, so that the output is exactly `hi · stride` wide.
    let padding = if k % 2 == 1 { stride - 1 } else { 0 };
    let text = format!(
        r#"<ir_version: 8, opset_import: ["" : 17]>
t (float[N,{m},{hi},{hi}] dy, float[{m},{c},{k},{k}] w, float[{c}] bias) => (float y)
{{
  y = ConvTranspose <strides = [{stride}, {stride}], pads = [1, 1, 1, 1], output_padding = [{padding}, {padding}]> (dy, w, bias)
}}
"#
    );
    onnx_ga::ir::text::parse_model(&text).expect("the transposed convolution's model parses")
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
        eprintln!("col2im: ONNX Runtime not found; nothing measured");
        return;
    }
    // (batch, M, C, Hi, kernel): the ResNet-8's 32 -> 16 channel data gradient, a decoder's.
    let cases: &[(usize, usize, usize, usize, usize)] = if bench {
        &[
            (32, 32, 16, 16, 3),
            (8, 32, 16, 16, 3),
            (32, 64, 32, 16, 4),
            (8, 64, 32, 8, 4),
        ]
    } else {
        &[(2, 8, 4, 4, 3)]
    };
    let (blocks, runs) = if bench { (3, 20) } else { (1, 2) };
    let threads: &[usize] = if bench { &[1, 2] } else { &[2] };
    for &(b, m, c, hi, k) in cases {
        let model = transposed_model(m, c, hi, k, 2);
        let (dy, w, bias) = (
            pattern(&[b, m, hi, hi]),
            pattern(&[m, c, k, k]),
            pattern(&[c]),
        );
        let feeds = [("dy", &dy), ("w", &w), ("bias", &bias)];
        for &t in threads {
            let mut ms = [Vec::new(), Vec::new()];
            let mut outputs: [Option<Tensor>; 2] = [None, None];
            for _ in 0..blocks {
                for (column, fused) in [true, false].into_iter().enumerate() {
                    let options = SessionOptions {
                        fused_col2im: fused,
                        threads: t,
                        ..SessionOptions::default()
                    };
                    let mut s = OrtSession::new(&model, &options).expect("session");
                    let expected = usize::from(fused && t > 1);
                    assert_eq!(s.fused_foldings(), expected, "folded");
                    for _ in 0..5 {
                        s.run(&feeds).expect("run");
                    }
                    for _ in 0..runs {
                        let start = Instant::now();
                        let out = s.run(&feeds).expect("run");
                        ms[column].push(start.elapsed().as_secs_f64() * 1e3);
                        outputs[column] = out.into_iter().next().map(|(_, y)| y);
                    }
                }
            }
            // The same bits, or the timing compares different computations.
            assert_eq!(outputs[0], outputs[1], "Col2Im and ConvTranspose differ");
            for v in ms.iter_mut() {
                v.sort_by(f64::total_cmp);
            }
            let [folded, plain] = [&ms[0], &ms[1]].map(|v| v[v.len() / 2]);
            println!(
                "B {b}, {m} -> {c} channels, {hi} -> {} wide, {k}x{k}, {t} thread(s): Col2Im {folded:.3} ms, ConvTranspose {plain:.3} ms ({:.2}x)",
                2 * hi,
                folded / plain
            );
        }
    }
}
