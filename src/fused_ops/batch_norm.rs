//! Training-mode BatchNorm, forward and backward, one channel at a time: what the two fused
//! operators compute. They replace the standard-op lowerings of `BatchNormInternal` and
//! `BatchNormalizationGrad` (`passes::legalize::batch_norm_internal`, `batch_norm_grad`),
//! about 15 and 20 nodes per layer, eight and ten passes over the activation, with two and
//! two (`passes::fused_batch_norm` finds them).
//!
//! Per channel c over its `n = N · |spatial|` elements (X viewed as `[N, C, plane]`):
//!
//! ```text
//! BatchNormTrain(X, scale, B; epsilon) -> (Y, mean, var, inv_std)
//!   mean = Σ x / n          var = Σ (x - mean)² / n   (biased)    inv_std = sqrt(1 / (var + ε))
//!   Y = x · g + (B - mean · g),  g = inv_std · scale     (the lowering's affine, bit for bit)
//! BatchNormGrad(dY, X, scale, mean, inv_std) -> (dX, dScale, dBias)
//!   x̂ = (x - mean) · inv_std    dBias = Σ dY    dScale = Σ dY · x̂
//!   dX = (dY · k - k · dBias / n) - x̂ · (k · dScale / n),   k = scale · inv_std
//! ```
//!
//! Each line is the lowering's, in its order of operations, except the sums: they run in
//! float32 over 32 lanes within a plane and in float64 across planes, and the variance
//! combines per-plane means and squared deviations (Chan et al.'s pairwise update) instead
//! of centring by the batch mean first, so X is read once for the statistics and once for
//! Y. So the results are within float32 rounding of the standard ops, not bit-identical
//! (tests/fused_batch_norm.rs bounds them against the definition in float64).

/// BatchNorm in training mode on onnx-ga's kernel (see the module's comment).
pub const BATCH_NORM_TRAIN: &str = "BatchNormTrain";
/// The gradients of [`BATCH_NORM_TRAIN`], from its saved mean and inverse deviation.
pub const BATCH_NORM_GRAD: &str = "BatchNormGrad";

/// A tensor of rank 2 or more viewed as `[images, channels, plane]`, the plane being the
/// product of the spatial axes (1 at rank 2): channel c of image i is the contiguous run
/// at `(i · channels + c) · plane`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchNormLayout {
    pub images: usize,
    pub channels: usize,
    pub plane: usize,
}

impl BatchNormLayout {
    /// `None` below rank 2 or with a negative dimension.
    pub fn of(dims: &[i64]) -> Option<BatchNormLayout> {
        let dims: Vec<usize> = dims
            .iter()
            .map(|&d| usize::try_from(d).ok())
            .collect::<Option<_>>()?;
        match dims.as_slice() {
            [images, channels, spatial @ ..] => Some(BatchNormLayout {
                images: *images,
                channels: *channels,
                plane: spatial.iter().product(),
            }),
            _ => None,
        }
    }

    pub fn len(&self) -> usize {
        self.images * self.channels * self.plane
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Elements per channel, `n`.
    pub fn per_channel(&self) -> usize {
        self.images * self.plane
    }

    /// Channel `c`'s planes in `x`, image by image.
    pub fn planes<'a>(&self, x: &'a [f32], c: usize) -> Vec<&'a [f32]> {
        (0..self.images)
            .map(|i| {
                let start = (i * self.channels + c) * self.plane;
                &x[start..start + self.plane]
            })
            .collect()
    }
}

/// One channel's batch statistics, as [`BATCH_NORM_TRAIN`] outputs them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ChannelStats {
    pub mean: f32,
    pub var: f32,
    pub inv_std: f32,
}

/// The forward of one channel: its statistics, and `y = x · g + shift` written over its
/// planes (`x` and `y` the same planes of the input and the output).
pub fn batch_norm_train_channel(
    x: &[&[f32]],
    y: &mut [&mut [f32]],
    scale: f32,
    bias: f32,
    epsilon: f32,
) -> ChannelStats {
    with_widest_vectors!(train_channel(x, y, scale, bias, epsilon))
}

#[inline(always)]
fn train_channel(
    x: &[&[f32]],
    y: &mut [&mut [f32]],
    scale: f32,
    bias: f32,
    epsilon: f32,
) -> ChannelStats {
    // Chan et al.: (count, mean, sum of squared deviations) merged plane by plane.
    let (mut count, mut mean, mut m2) = (0f64, 0f64, 0f64);
    for plane in x {
        let len = plane.len() as f64;
        if plane.is_empty() {
            continue;
        }
        // The plane was just read for its sum: its deviations come from the cache.
        let plane_mean = (lane_sum(plane, |v| v) / len) as f32;
        let (residual, squares) = lane_sum2(plane, plane, |v, _| {
            let d = v - plane_mean;
            (d, d * d)
        });
        let exact_mean = plane_mean as f64 + residual / len;
        let plane_m2 = squares - residual * residual / len;
        let total = count + len;
        let delta = exact_mean - mean;
        mean += delta * len / total;
        m2 += plane_m2 + delta * delta * count * len / total;
        count = total;
    }
    // An empty channel divides 0 by 0, as the standard ops do.
    let (mean, var) = if count > 0.0 {
        (mean as f32, (m2.max(0.0) / count) as f32)
    } else {
        (f32::NAN, f32::NAN)
    };
    let inv_std = (1.0 / (var + epsilon)).sqrt();
    let gain = inv_std * scale;
    let shift = bias - mean * gain;
    for (x, y) in x.iter().zip(y.iter_mut()) {
        for (out, &v) in y.iter_mut().zip(x.iter()) {
            *out = v * gain + shift;
        }
    }
    ChannelStats { mean, var, inv_std }
}

/// The backward of one channel: writes dX over its planes, returns `(dScale, dBias)`.
pub fn batch_norm_grad_channel(
    dy: &[&[f32]],
    x: &[&[f32]],
    dx: &mut [&mut [f32]],
    scale: f32,
    mean: f32,
    inv_std: f32,
) -> (f32, f32) {
    with_widest_vectors!(grad_channel(dy, x, dx, scale, mean, inv_std))
}

#[inline(always)]
fn grad_channel(
    dy: &[&[f32]],
    x: &[&[f32]],
    dx: &mut [&mut [f32]],
    scale: f32,
    mean: f32,
    inv_std: f32,
) -> (f32, f32) {
    let x_hat = |v: f32| (v - mean) * inv_std;
    let (mut sum_dy, mut sum_dy_x_hat, mut count) = (0f64, 0f64, 0usize);
    for (g, v) in dy.iter().zip(x) {
        let (a, b) = lane_sum2(g, v, |g, v| (g, g * x_hat(v)));
        sum_dy += a;
        sum_dy_x_hat += b;
        count += g.len().min(v.len());
    }
    let (dbias, dscale) = (sum_dy as f32, sum_dy_x_hat as f32);
    let n = count as f32;
    let k = scale * inv_std;
    let shift = -(k * (dbias / n));
    let slope = k * (dscale / n);
    for ((g, v), out) in dy.iter().zip(x).zip(dx.iter_mut()) {
        for ((out, &g), &v) in out.iter_mut().zip(g.iter()).zip(v.iter()) {
            *out = (g * k + shift) - x_hat(v) * slope;
        }
    }
    (dscale, dbias)
}

/// Lanes of the partial sums: two AVX-512 registers (four AVX2 ones), enough independent
/// additions to hide their latency.
const LANES: usize = 32;

/// `Σ f(x_i)` in float32 lanes, the lanes and the tail added in float64.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // l indexes the lanes and the chunk at once
fn lane_sum(x: &[f32], f: impl Fn(f32) -> f32) -> f64 {
    let mut lanes = [0f32; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for chunk in &mut chunks {
        for l in 0..LANES {
            lanes[l] += f(chunk[l]);
        }
    }
    let tail: f64 = chunks.remainder().iter().map(|&v| f(v) as f64).sum();
    lanes.iter().map(|&l| l as f64).sum::<f64>() + tail
}

/// `(Σ f(a_i, b_i).0, Σ f(a_i, b_i).1)` over the common length, as [`lane_sum`].
#[inline(always)]
#[allow(clippy::needless_range_loop)] // l indexes four arrays at once
fn lane_sum2(a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> (f32, f32)) -> (f64, f64) {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let (mut first, mut second) = ([0f32; LANES], [0f32; LANES]);
    let whole = n - n % LANES;
    for start in (0..whole).step_by(LANES) {
        let (a, b) = (&a[start..start + LANES], &b[start..start + LANES]);
        for l in 0..LANES {
            let (p, q) = f(a[l], b[l]);
            first[l] += p;
            second[l] += q;
        }
    }
    let (mut s, mut t) = (0f64, 0f64);
    for i in whole..n {
        let (p, q) = f(a[i], b[i]);
        s += p as f64;
        t += q as f64;
    }
    let total = |lanes: [f32; LANES]| lanes.iter().map(|&l| l as f64).sum::<f64>();
    (total(first) + s, total(second) + t)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values around `offset`, spread about ±0.5.
    fn values(n: usize, seed: usize, offset: f32) -> Vec<f32> {
        (0..n)
            .map(|i| offset + (((i * 7919 + seed * 104729) % 2001) as f32 / 1000.0 - 1.0) * 0.5)
            .collect()
    }

    /// Forward and backward of one channel against the definition in float64, with a large
    /// offset (the single-pass variance would lose it) and planes of odd lengths.
    #[test]
    fn one_channel_agrees_with_the_definition() {
        for (offset, plane) in [(0.0f32, 37usize), (100.0, 64), (-3.0, 1)] {
            let images = 5;
            let x: Vec<Vec<f32>> = (0..images).map(|i| values(plane, i, offset)).collect();
            let g: Vec<Vec<f32>> = (0..images).map(|i| values(plane, i + 9, 0.1)).collect();
            let xs: Vec<&[f32]> = x.iter().map(Vec::as_slice).collect();
            let gs: Vec<&[f32]> = g.iter().map(Vec::as_slice).collect();
            let (scale, bias, eps) = (1.5f32, -0.25f32, 1e-5f32);
            let mut y = vec![vec![0f32; plane]; images];
            let mut ys: Vec<&mut [f32]> = y.iter_mut().map(Vec::as_mut_slice).collect();
            let stats = batch_norm_train_channel(&xs, &mut ys, scale, bias, eps);

            let all: Vec<f64> = x.iter().flatten().map(|&v| v as f64).collect();
            let n = all.len() as f64;
            let mean = all.iter().sum::<f64>() / n;
            let var = all.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
            let inv_std = 1.0 / (var + eps as f64).sqrt();
            let close = |got: f32, want: f64, scale: f64| {
                assert!(
                    (got as f64 - want).abs() <= 4e-7 * scale.max(1e-30),
                    "offset {offset}, plane {plane}: {got} vs {want}"
                )
            };
            close(stats.mean, mean, mean.abs().max(1.0));
            close(stats.var, var, var);
            close(stats.inv_std, inv_std, inv_std);
            for (yi, xi) in y.iter().flatten().zip(&all) {
                let want = (xi - mean) * inv_std * scale as f64 + bias as f64;
                // y's rounding is that of x · g, g and x of the offset's size.
                close(*yi, want, 4.0 * (offset.abs() as f64 * inv_std).max(1.0));
            }

            let mut dx = vec![vec![0f32; plane]; images];
            let mut dxs: Vec<&mut [f32]> = dx.iter_mut().map(Vec::as_mut_slice).collect();
            let (dscale, dbias) =
                batch_norm_grad_channel(&gs, &xs, &mut dxs, scale, stats.mean, stats.inv_std);
            let gall: Vec<f64> = g.iter().flatten().map(|&v| v as f64).collect();
            let xh: Vec<f64> = all.iter().map(|v| (v - mean) * inv_std).collect();
            let want_dbias: f64 = gall.iter().sum();
            let want_dscale: f64 = gall.iter().zip(&xh).map(|(g, h)| g * h).sum();
            close(dbias, want_dbias, gall.iter().map(|g| g.abs()).sum());
            // The saved statistics carry float32 rounding; the offset amplifies it in x̂.
            let amplify = 1.0 + offset.abs() as f64 * inv_std;
            close(
                dscale,
                want_dscale,
                8.0 * amplify * gall.iter().map(|g| g.abs()).sum::<f64>(),
            );
            let k = scale as f64 * inv_std;
            for ((d, g), h) in dx.iter().flatten().zip(&gall).zip(&xh) {
                let want = k * (g - want_dbias / n - h * want_dscale / n);
                close(*d, want, 8.0 * amplify * k);
            }
        }
    }

    #[test]
    fn layout_views_the_spatial_axes_as_one_plane() {
        let l = BatchNormLayout::of(&[2, 3, 4, 5]).unwrap();
        assert_eq!(
            (l.images, l.channels, l.plane, l.per_channel()),
            (2, 3, 20, 40)
        );
        assert_eq!(BatchNormLayout::of(&[4, 6]).unwrap().plane, 1);
        assert_eq!(BatchNormLayout::of(&[4]), None);
        let x: Vec<f32> = (0..l.len()).map(|i| i as f32).collect();
        let planes = l.planes(&x, 1);
        assert_eq!((planes[0][0], planes[1][0]), (20.0, 80.0));
    }
}
