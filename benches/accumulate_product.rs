//! The `AccumulateProduct` kernel alone (src/fused_ops/product.rs): `acc += Aᵀ·B` in place
//! on one thread, for a 1024-row accumulator at the shapes of the realistic MLP's and the
//! scale bench's weight gradients, with the accumulator in cache (the same call repeated)
//! and out of it (a 48 MiB stream written between calls, as the apply's pass over the
//! optimizer's state does between windows). Prints the minimum, the 10% quantile and the
//! median in µs. For an A/B of the kernel, build two revisions and alternate their runs
//! (benches/README.md, "Run Z").
//!
//! `cargo bench --bench accumulate_product` (with `--bench`; `cargo test --all-targets`
//! runs it without, and then it only checks one small shape).

use onnx_ga::fused_ops::{accumulate_product, Io, ProductLayout, ProductShape, PRODUCT_TASK_ROWS};
use std::time::Instant;

fn quantiles(mut t: Vec<f64>) -> String {
    t.sort_by(f64::total_cmp);
    let at = |q: f64| t[((t.len() - 1) as f64 * q) as usize];
    format!(
        "min {:.0} q0.1 {:.0} median {:.0}",
        at(0.0),
        at(0.1),
        at(0.5)
    )
}

fn main() {
    let bench = std::env::args().any(|a| a == "--bench");
    let shapes: &[(usize, usize)] = if bench {
        &[
            (784, 8),
            (784, 32),
            (784, 64),
            (1024, 8),
            (1024, 32),
            (1024, 64),
            (256, 8),
        ]
    } else {
        &[(40, 3)]
    };
    let (hot_runs, cold_runs) = if bench { (500, 100) } else { (2, 2) };
    let m = 1024;
    let mut stream = vec![1f32; if bench { 12 << 20 } else { 1024 }];
    println!(
        "| columns | k | in cache, µs | after a 48 MiB stream, µs | in the session's tasks, B packed once, µs | in those tasks, B packed per task, µs |\n|--:|--:|---|---|---|---|"
    );
    for &(n, k) in shapes {
        let shape = ProductShape { k, m, n };
        let a: Vec<f32> = (0..k * m).map(|i| (i % 7) as f32 * 0.1).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i % 5) as f32 * 0.1).collect();
        let mut acc = vec![0f32; m * n];
        let mut run = || {
            let t0 = Instant::now();
            accumulate_product(&a, &b, shape, 0, Io::InPlace([&mut acc]));
            t0.elapsed().as_secs_f64() * 1e6
        };
        let hot: Vec<f64> = (0..hot_runs).map(|_| run()).collect();
        let cold: Vec<f64> = (0..cold_runs)
            .map(|r| {
                stream.iter_mut().for_each(|x| *x += r as f32);
                run()
            })
            .collect();
        // As the operator runs it (src/engine/ort_ops.rs): tasks of whole rows of about 64 Ki
        // elements (a multiple of PRODUCT_TASK_ROWS), one after the other on one thread; B laid out
        // once for all of them in memory kept from run to run, or (as before run AI) once per
        // task.
        let rows = ((1 << 16) / n / PRODUCT_TASK_ROWS * PRODUCT_TASK_ROWS).max(1);
        let mut layout = ProductLayout::default();
        let mut tasks = |shared: bool| {
            let t0 = Instant::now();
            let operands = layout.operands(&a, &b, shape);
            for (t, piece) in acc.chunks_mut(rows * n).enumerate() {
                match shared {
                    true => operands.accumulate(t * rows, Io::InPlace([piece])),
                    false => accumulate_product(&a, &b, shape, t * rows, Io::InPlace([piece])),
                }
            }
            t0.elapsed().as_secs_f64() * 1e6
        };
        let shared: Vec<f64> = (0..hot_runs).map(|_| tasks(true)).collect();
        let per_task: Vec<f64> = (0..hot_runs).map(|_| tasks(false)).collect();
        println!(
            "| {n} | {k} | {} | {} | {} | {} |",
            quantiles(hot),
            quantiles(cold),
            quantiles(shared),
            quantiles(per_task)
        );
        // Every call added the same product: a check that the kernel ran, and on what.
        let runs = (3 * hot_runs + cold_runs) as f32;
        let want: f32 = (0..k).map(|p| a[p * m] * b[p * n]).sum::<f32>() * runs;
        assert!(
            (acc[0] - want).abs() <= 1e-3 * want.abs().max(1.0),
            "{} vs {want}",
            acc[0]
        );
    }
    kept_products(bench, &mut stream);
    std::hint::black_box(&stream);
}

/// A window's kept products (`engine::deferred_products`): `P` products of one 1024 x 1024
/// accumulator added in one pass (`accumulate_products`) against `P` passes of one product
/// each, every pass after the stream, as each micro-step finds its accumulator out of cache
/// when the products are added as they are made. Medians of cold runs, µs.
fn kept_products(bench: bool, stream: &mut [f32]) {
    use onnx_ga::fused_ops::{accumulate_products, ProductOperands, SumFrom};
    let (m, n) = if bench { (1024, 1024) } else { (40, 24) };
    let runs = if bench { 60 } else { 2 };
    println!("\n| k | P | P passes of one product, µs | one pass of P products, µs | ratio |\n|--:|--:|--:|--:|--:|");
    for k in [8usize, 16] {
        for pairs in [2usize, 3, 5] {
            let shape = ProductShape { k, m, n };
            let operands: Vec<(Vec<f32>, Vec<f32>)> = (0..pairs)
                .map(|p| {
                    let a = (0..k * m).map(|i| ((i + p) % 7) as f32 * 0.1).collect();
                    let b = (0..k * n).map(|i| ((i + 2 * p) % 5) as f32 * 0.1).collect();
                    (a, b)
                })
                .collect();
            let mut acc = vec![0f32; m * n];
            let mut layouts: Vec<ProductLayout> =
                (0..pairs).map(|_| ProductLayout::default()).collect();
            let (mut apart, mut together) = (Vec::new(), Vec::new());
            for r in 0..runs {
                let mut total = 0.0;
                for (a, b) in &operands {
                    stream.iter_mut().for_each(|x| *x += r as f32);
                    let t0 = Instant::now();
                    accumulate_product(a, b, shape, 0, Io::InPlace([&mut acc]));
                    total += t0.elapsed().as_secs_f64() * 1e6;
                }
                apart.push(total);
                stream.iter_mut().for_each(|x| *x += r as f32);
                let t0 = Instant::now();
                let laid_out: Vec<ProductOperands<'_>> = layouts
                    .iter_mut()
                    .zip(&operands)
                    .map(|(layout, (a, b))| layout.operands(a, b, shape))
                    .collect();
                accumulate_products(
                    &laid_out,
                    (0, SumFrom::Accumulator),
                    Io::InPlace([&mut acc]),
                );
                together.push(t0.elapsed().as_secs_f64() * 1e6);
            }
            let median = |mut t: Vec<f64>| {
                t.sort_by(f64::total_cmp);
                t[t.len() / 2]
            };
            let (apart, together) = (median(apart), median(together));
            println!(
                "| {k} | {pairs} | {apart:.0} | {together:.0} | {:.2} |",
                together / apart
            );
        }
    }
}
