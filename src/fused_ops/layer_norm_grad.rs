//! Layer normalisation's gradient over the last axis as one pass, what the fused
//! `LayerNormGrad` operator computes. The legalize lowering of `LayerNormalizationGrad`
//! (`passes/legalize/layer_norm_grad.rs`) writes it as thirteen standard ops, each a pass
//! over the activation (on the GPT at B 8, [8, 64, 256]: 40-90 µs each, nine layers):
//!
//! ```text
//! LayerNormGrad(dY, X, scale, mean, inv_std) -> (dX, dScale, dBias)
//! x̂ = (X - mean) · inv_std      b = (dY · scale) · inv_std      c = b · x̂
//! dX = (b - mean_N(b)) - x̂ · mean_N(c)                            mean_N over a row
//! dScale = Σ_rows dY · x̂        dBias = Σ_rows dY
//! ```
//!
//! Each elementwise step is the lowering's float32 operation in its order; the sums are
//! not ONNX Runtime's (a row's in 16 interleaved chains, the rows' in blocks of [`ROWS`]
//! added in order), so the result is within their rounding of the standard ops, not bit for bit. It
//! does not depend on the number of threads: the blocks are fixed, and their partial sums
//! are added in block order.

/// The layer-norm gradient on onnx-ga's kernel (see the module's comment).
pub const LAYER_NORM_GRAD: &str = "LayerNormGrad";

/// Input slots of [`LAYER_NORM_GRAD`]; outputs dX, dScale, dBias in that order.
pub mod layer_norm_grad_slot {
    pub const DY: usize = 0;
    pub const X: usize = 1;
    pub const SCALE: usize = 2;
    pub const MEAN: usize = 3;
    pub const INV_STD: usize = 4;
    pub const COUNT: usize = 5;
}

/// Rows whose column sums one task makes (a fixed partition, whatever the threads).
pub const ROWS: usize = 32;

/// The interleaved chains of a row's sums.
const LANES: usize = 16;

/// One block of rows of `dy` and `x` (row length `scale.len()`, one `mean` and `inv_std` a
/// row): their `dx`, and this block's sums of `dY · x̂` and `dY` over its rows into
/// `dscale` and `dbias` (overwritten).
pub fn layer_norm_grad_rows(
    (dy, x, scale): (&[f32], &[f32], &[f32]),
    (mean, inv_std): (&[f32], &[f32]),
    dx: &mut [f32],
    (dscale, dbias): (&mut [f32], &mut [f32]),
) {
    with_widest_vectors!(rows_portable(
        (dy, x, scale),
        (mean, inv_std),
        dx,
        (dscale, dbias)
    ))
}

#[inline(always)]
fn rows_portable(
    (dy, x, scale): (&[f32], &[f32], &[f32]),
    (mean, inv_std): (&[f32], &[f32]),
    dx: &mut [f32],
    (dscale, dbias): (&mut [f32], &mut [f32]),
) {
    let n = scale.len();
    let (dscale, dbias) = (&mut dscale[..n], &mut dbias[..n]);
    dscale.fill(0.0);
    dbias.fill(0.0);
    if n == 0 {
        return;
    }
    let count = n as f32;
    let rows = dy
        .chunks_exact(n)
        .zip(x.chunks_exact(n))
        .zip(dx.chunks_exact_mut(n));
    for (((dy, x), dx), (&mean, &inv_std)) in rows.zip(mean.iter().zip(inv_std)) {
        let xhat = |x: f32| (x - mean) * inv_std;
        let b = |dy: f32, scale: f32| (dy * scale) * inv_std;
        // The row's sums in LANES interleaved chains (one vector's worth), added in lane
        // order at the end: one chain would wait on each addition's latency.
        let (mut lanes_b, mut lanes_c) = ([0f32; LANES], [0f32; LANES]);
        let blocks = dy
            .chunks_exact(LANES)
            .zip(x.chunks_exact(LANES))
            .zip(scale.chunks_exact(LANES));
        for ((dy, x), scale) in blocks {
            for l in 0..LANES {
                let bl = b(dy[l], scale[l]);
                lanes_b[l] += bl;
                lanes_c[l] += bl * xhat(x[l]);
            }
        }
        let whole = n - n % LANES;
        let tail = dy[whole..].iter().zip(&x[whole..]).zip(&scale[whole..]);
        for (l, ((&dy, &x), &scale)) in tail.enumerate() {
            let bl = b(dy, scale);
            lanes_b[l] += bl;
            lanes_c[l] += bl * xhat(x);
        }
        let sum = |lanes: [f32; LANES]| lanes.iter().fold(0f32, |s, v| s + v);
        let (mean_b, mean_c) = (sum(lanes_b) / count, sum(lanes_c) / count);
        let each = dx.iter_mut().zip(dy).zip(x).zip(scale);
        for ((((dx, &dy), &x), &scale), (ds, db)) in
            each.zip(dscale.iter_mut().zip(dbias.iter_mut()))
        {
            let xi = xhat(x);
            *dx = (b(dy, scale) - mean_b) - xi * mean_c;
            *ds += dy * xi;
            *db += dy;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against the formula in float64 on a few rows, to float32 rounding.
    #[test]
    fn rows_are_the_layer_norm_gradient() {
        let (rows, n) = (5usize, 37usize);
        let f = |i: usize, k: f32| ((i * 7919 % 97) as f32 / 97.0 - 0.5) * k;
        let dy: Vec<f32> = (0..rows * n).map(|i| f(i, 2.0)).collect();
        let x: Vec<f32> = (0..rows * n).map(|i| f(i + 13, 3.0)).collect();
        let scale: Vec<f32> = (0..n).map(|i| 1.0 + f(i + 5, 0.5)).collect();
        let mean: Vec<f32> = (0..rows)
            .map(|r| x[r * n..(r + 1) * n].iter().sum::<f32>() / n as f32)
            .collect();
        let inv_std: Vec<f32> = (0..rows)
            .map(|r| {
                let row = &x[r * n..(r + 1) * n];
                let var = row.iter().map(|v| (v - mean[r]).powi(2)).sum::<f32>() / n as f32;
                1.0 / (var + 1e-5).sqrt()
            })
            .collect();
        let mut dx = vec![0f32; rows * n];
        let (mut dscale, mut dbias) = (vec![9f32; n], vec![9f32; n]);
        layer_norm_grad_rows(
            (&dy, &x, &scale),
            (&mean, &inv_std),
            &mut dx,
            (&mut dscale, &mut dbias),
        );
        let g = |v: &[f32], i: usize| v[i] as f64;
        let (mut want_scale, mut want_bias) = (vec![0f64; n], vec![0f64; n]);
        for r in 0..rows {
            let (m, s) = (mean[r] as f64, inv_std[r] as f64);
            let at = |i: usize| r * n + i;
            let xhat = |i: usize| (g(&x, at(i)) - m) * s;
            let b = |i: usize| g(&dy, at(i)) * g(&scale, i) * s;
            let mean_b = (0..n).map(b).sum::<f64>() / n as f64;
            let mean_c = (0..n).map(|i| b(i) * xhat(i)).sum::<f64>() / n as f64;
            for i in 0..n {
                let want = b(i) - mean_b - xhat(i) * mean_c;
                assert!((g(&dx, at(i)) - want).abs() < 1e-5, "dx[{r}, {i}]");
                want_scale[i] += g(&dy, at(i)) * xhat(i);
                want_bias[i] += g(&dy, at(i));
            }
        }
        for i in 0..n {
            assert!(
                (dscale[i] as f64 - want_scale[i]).abs() < 1e-5,
                "dscale[{i}]"
            );
            assert!((dbias[i] as f64 - want_bias[i]).abs() < 1e-5, "dbias[{i}]");
        }
    }
}
