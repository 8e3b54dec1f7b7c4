//! A sum over leading axes, ONNX Runtime's `ReduceSum` against onnx-ga's `LeadingSum`
//! kernel (src/passes/fused_leading_sum.rs): one session of the single sum each, at the
//! shapes the realistic models' backward graphs sum (the GPT's bias gradients over
//! `[B·T]`, the ResNet-8's per-image weight gradients over 32 images, the GPT's position
//! embedding over 8), on 1 and 2 threads, with X in cache (the same X each run) and out of
//! it (64 different X in turn, 32-128 MiB). Prints the 10% quantile of a whole run in ms
//! (the session's own overhead, ~6 µs, included in both). The two columns alternate run
//! by run, so a drifting machine moves both (benches/README.md, "Run AA").
//!
//! `cargo bench --bench leading_sum` (with `--bench`; `cargo test --all-targets` runs it
//! without, and then it only checks one small shape on one thread).

use onnx_ga::data::Tensor;
use onnx_ga::engine::ort::{OrtSession, SessionOptions};

fn sum_model(rows: usize, columns: usize) -> onnx_ga::proto::ModelProto {
    let text = format!(
        "<ir_version: 8, opset_import: [\"\" : 17]>\n\
         g (float[{rows},{columns}] x) => (float[{columns}] y) {{\n\
         \x20 axes = Constant <value = int64[1] {{0}}> ()\n\
         \x20 y = ReduceSum <keepdims = 0> (x, axes)\n}}\n"
    );
    onnx_ga::ir::text::parse_model(&text).expect("the sum's model parses")
}

fn main() {
    let bench = std::env::args().any(|a| a == "--bench");
    if onnx_ga::runtime::require_onnxruntime_for_tests().is_none() {
        eprintln!("leading_sum: ONNX Runtime not found; nothing measured");
        return;
    }
    let shapes: &[(usize, usize)] = if bench {
        &[
            (512, 1024),
            (512, 768),
            (512, 256),
            (32, 18432),
            (32, 4608),
            (8, 16384),
        ]
    } else {
        &[(4, 40)]
    };
    let threads: &[usize] = if bench { &[1, 2] } else { &[1] };
    let (runs, distinct) = if bench { (400, 64) } else { (3, 2) };
    println!("| X | threads | in cache: ReduceSum / LeadingSum, ms | from memory: ReduceSum / LeadingSum, ms |\n|---|--:|---|---|");
    for &t in threads {
        for &(rows, columns) in shapes {
            let model = sum_model(rows, columns);
            let xs: Vec<Tensor> = (0..distinct)
                .map(|k| {
                    Tensor::F32(ndarray::ArrayD::from_shape_fn(vec![rows, columns], |i| {
                        ((i[0] * 7 + i[1] * 3 + k) % 1000) as f32 * 1e-3
                    }))
                })
                .collect();
            let mut sessions: Vec<OrtSession> = [false, true]
                .into_iter()
                .map(|fused| {
                    let options = SessionOptions {
                        threads: t,
                        fused_leading_sum: fused,
                        ..SessionOptions::default()
                    };
                    let s = OrtSession::new(&model, &options).expect("session");
                    assert_eq!(s.fused_leading_sums(), fused as usize);
                    s
                })
                .collect();
            let mut cells = Vec::new();
            for cold in [false, true] {
                let mut times = [Vec::new(), Vec::new()];
                for i in 0..runs {
                    for (which, s) in sessions.iter_mut().enumerate() {
                        // From memory: the other column read this X half the cycle ago.
                        let x = &xs[if cold {
                            (i + which * distinct / 2) % distinct
                        } else {
                            0
                        }];
                        let start = std::time::Instant::now();
                        let out = s.run(&[("x", x)]).expect("run");
                        times[which].push(start.elapsed().as_secs_f64() * 1e3);
                        std::hint::black_box(out);
                    }
                }
                let q10 = |t: &mut Vec<f64>| {
                    t.sort_by(f64::total_cmp);
                    t[t.len() / 10]
                };
                let [a, b] = &mut times;
                cells.push(format!("{:.3} / {:.3}", q10(a), q10(b)));
            }
            println!(
                "| [{rows}, {columns}] | {t} | {} | {} |",
                cells[0], cells[1]
            );
        }
    }
}
