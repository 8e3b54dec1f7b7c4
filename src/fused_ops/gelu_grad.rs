//! The exact (erf) GELU's gradient as one pass, what the fused `GeluGrad` operator
//! computes. A forward model exports GELU as `y = (x · (1 + erf(x / √2))) · ½`, and our
//! autodiff differentiates it op by op (`passes/autodiff`): ten elementwise ops over the
//! activation, each a full pass (on the GPT at B 8, [8, 64, 1024]: ~0.4 ms each):
//!
//! ```text
//! GeluGrad(G, x, A, h, k, s, f) -> dX     (G: y's gradient, A = 1 + erf(x / f): the
//!                                          forward's value; h = ½, k = 2/√π, s = f = √2:
//!                                          the graph's own constants)
//! u = x / f;  g = G·h;  dX = g·A + ((g·x)·(exp(-(u·u))·k)) / s
//! ```
//!
//! Each step is the graph's own float32 operation in its order (u as the forward's `Div`
//! made it, recomputed rather than read: one pass less over memory), so the result differs
//! from the standard ops only by the exponential's rounding: [`exp`] here, ONNX Runtime's
//! `Exp` there (both within a few ulp of the true value).

/// The GELU gradient on onnx-ga's kernel (see the module's comment).
pub const GELU_GRAD: &str = "GeluGrad";

/// The scalars of one [`GELU_GRAD`]: `h`, `k`, `s`, `f` of the module's comment.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GeluGradScalars {
    pub half: f32,
    pub k: f32,
    /// The backward's divisor `s`.
    pub sqrt2: f32,
    /// The forward's divisor `f` (`u = x / f`).
    pub forward_sqrt2: f32,
}

/// Input slots of [`GELU_GRAD`]; every scalar is a one-element float32 tensor.
pub mod gelu_slot {
    pub const G: usize = 0;
    pub const X: usize = 1;
    pub const A: usize = 2;
    pub const HALF: usize = 3;
    pub const K: usize = 4;
    pub const SQRT2: usize = 5;
    pub const FORWARD_SQRT2: usize = 6;
    pub const COUNT: usize = 7;
}

/// `dx` from `g`, `x`, `a` (equal lengths; the module's formula).
pub fn gelu_grad(s: &GeluGradScalars, [g, x, a]: [&[f32]; 3], dx: &mut [f32]) {
    with_widest_vectors!(gelu_grad_portable(s, g, x, a, dx))
}

#[inline(always)]
fn gelu_grad_portable(s: &GeluGradScalars, g: &[f32], x: &[f32], a: &[f32], dx: &mut [f32]) {
    let n = dx.len().min(g.len()).min(x.len()).min(a.len());
    let (g, x, a, dx) = (&g[..n], &x[..n], &a[..n], &mut dx[..n]);
    for i in 0..n {
        let u = x[i] / s.forward_sqrt2;
        let gh = g[i] * s.half;
        let slope = exp(-(u * u)) * s.k;
        dx[i] = gh * a[i] + ((gh * x[i]) * slope) / s.sqrt2;
    }
}

/// `e^v` in float32, in a form that vectorises (no table, no call, no branch): `v = n·ln 2 +
/// r` with `|r| <= ln 2 / 2` (ln 2 in two parts, Cody and Waite), `e^r` by its Taylor
/// polynomial to degree 7 (truncation below 2e-8 relative there), times `2^n` built in the
/// exponent bits. At most 2 ulp from the true value on [-87, 88]; 0 below -87.3 (where
/// float32 has only subnormals, which this does not make), infinity above 88.7, NaN for NaN.
#[inline(always)]
pub fn exp(v: f32) -> f32 {
    const LOG2_E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let clamped = v.clamp(-87.336_55, 88.722_83);
    // Round to nearest by the 1.5·2^23 shift: |n| < 2^22, so the sum's low mantissa bits
    // are n itself, read as an integer without a float-to-int conversion (which Rust
    // saturates element by element).
    const SHIFT: f32 = 12_582_912.0;
    let shifted = clamped * LOG2_E + SHIFT;
    let n = shifted - SHIFT;
    let n_int = (shifted.to_bits() as i32).wrapping_sub(SHIFT.to_bits() as i32);
    let r = (clamped - n * LN2_HI) - n * LN2_LO;
    let mut p = 1.0 / 5040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    // 2^n for n in [-126, 128): 2^128 is reached below as 2^127 · 2.
    let scale = f32::from_bits(((n_int.min(127) + 127) as u32) << 23);
    let e = p * scale * if n_int > 127 { 2.0 } else { 1.0 };
    if v.is_nan() {
        v
    } else if v < -87.336_55 {
        0.0
    } else if v > 88.722_83 {
        f32::INFINITY
    } else {
        e
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Within 2 ulp of the float64 exponential over float32's range, and the edges.
    #[test]
    fn exp_is_within_two_ulp() {
        let mut worst = 0f64;
        let mut v = -87.3f32;
        while v < 88.7 {
            let got = exp(v) as f64;
            let want = (v as f64).exp();
            let ulp = (want as f32).abs() as f64 * f32::EPSILON as f64;
            worst = worst.max((got - want).abs() / ulp.max(f64::MIN_POSITIVE));
            v += 0.000_97;
        }
        assert!(worst <= 2.0, "{worst} ulp");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
    }

    /// Against the derivative of GELU in float64, through the graph's own intermediates.
    #[test]
    fn gelu_grad_is_the_derivative() {
        let s = GeluGradScalars {
            half: 0.5,
            k: std::f32::consts::FRAC_2_SQRT_PI,
            sqrt2: std::f32::consts::SQRT_2,
            forward_sqrt2: std::f32::consts::SQRT_2,
        };
        let x: Vec<f32> = (0..2001).map(|i| (i as f32 - 1000.0) / 166.0).collect();
        let g: Vec<f32> = (0..2001).map(|i| ((i % 7) as f32 - 3.0) / 2.0).collect();
        let u: Vec<f32> = x.iter().map(|x| x / s.sqrt2).collect();
        // 1 + erf(u) from float64's erf (Abramowitz-Stegun 7.1.26 is too coarse here).
        let erf = |z: f64| {
            // Maclaurin's series, summed in float64: within 1e-8 on the |z| < 4.3 used here.
            let t = z.abs();
            let mut sum = 0f64;
            let mut term = t;
            let mut k = 0f64;
            while term.abs() > 1e-17 * sum.abs().max(1e-300) && k < 200.0 {
                sum += term / (2.0 * k + 1.0);
                k += 1.0;
                term *= -t * t / k;
            }
            (2.0 / std::f64::consts::PI.sqrt() * sum).clamp(-1.0, 1.0) * z.signum()
        };
        let a: Vec<f32> = u.iter().map(|&u| (1.0 + erf(u as f64)) as f32).collect();
        let mut dx = vec![f32::NAN; x.len()];
        gelu_grad(&s, [&g, &x, &a], &mut dx);
        for i in 0..x.len() {
            let xv = x[i] as f64;
            let phi = 0.5 * (1.0 + erf(xv / std::f64::consts::SQRT_2));
            let density = (-xv * xv / 2.0).exp() / (2.0 * std::f64::consts::PI).sqrt();
            let want = g[i] as f64 * (phi + xv * density);
            let scale = (g[i] as f64).abs().max(1e-30);
            assert!(
                (dx[i] as f64 - want).abs() <= 4e-7 * scale.max(want.abs()),
                "x = {}: {} vs {want}",
                x[i],
                dx[i]
            );
        }
    }
}
