//! The exact (erf) GELU's forward as one node, what the fused `Gelu` operator computes. A
//! forward model exports GELU as five elementwise ops over the activation, each a full pass
//! (on the GPT at B 8, [8, 64, 1024]: 0.23-0.40 ms each, 1.5 ms a layer):
//!
//! ```text
//! Gelu(x, f, one, h) -> (y, A)      u = x / f;  e = erf(u);  A = e + one;  y = (x · A) · h
//! ```
//!
//! `A`, the forward's `Add`, is an output too: the gradient reads it (`GeluGrad`). Each step
//! is the graph's own float32 operation in its order, and `erf` is ONNX Runtime's own `Erf`
//! kernel, run from inside the fused one on each chunk while it is in cache: the same bits
//! as the five ops, with one pass over x, A and y instead of eleven.

/// The GELU forward on onnx-ga's kernel (see the module's comment).
pub const GELU: &str = "Gelu";

/// Input slots of [`GELU`]; the scalars are one-element float32 tensors.
pub mod gelu_forward_slot {
    pub const X: usize = 0;
    /// The divisor `f` of `u = x / f` (√2).
    pub const DIVISOR: usize = 1;
    /// The addend `one` of `A = erf(u) + one`.
    pub const ONE: usize = 2;
    /// The factor `h` of `y = (x · A) · h` (½).
    pub const HALF: usize = 3;
    pub const COUNT: usize = 4;
    /// Output slots: `y`, then `A`.
    pub const Y: usize = 0;
    pub const A: usize = 1;
}

/// The scalars of one [`GELU`]: `f`, `one` and `h` of the module's comment.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GeluScalars {
    pub divisor: f32,
    pub one: f32,
    pub half: f32,
}

/// `u = x / f` into `u` (equal lengths): the forward's `Div`.
pub fn gelu_quotient(s: &GeluScalars, x: &[f32], u: &mut [f32]) {
    with_widest_vectors!(quotient_portable(s, x, u))
}

#[inline(always)]
fn quotient_portable(s: &GeluScalars, x: &[f32], u: &mut [f32]) {
    let n = x.len().min(u.len());
    for (u, x) in u[..n].iter_mut().zip(&x[..n]) {
        *u = *x / s.divisor;
    }
}

/// From `e = erf(u)` in `a`: `A = e + one` in place and `y = (x · A) · h` (equal lengths):
/// the forward's `Add` and its two `Mul`s.
pub fn gelu_tail(s: &GeluScalars, x: &[f32], a: &mut [f32], y: &mut [f32]) {
    with_widest_vectors!(tail_portable(s, x, a, y))
}

#[inline(always)]
fn tail_portable(s: &GeluScalars, x: &[f32], a: &mut [f32], y: &mut [f32]) {
    let n = x.len().min(a.len()).min(y.len());
    let (x, a, y) = (&x[..n], &mut a[..n], &mut y[..n]);
    for i in 0..n {
        let plus_one = a[i] + s.one;
        a[i] = plus_one;
        y[i] = (x[i] * plus_one) * s.half;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each step is the one float32 operation of its standard op, element by element, for
    /// every length around the vector widths (tails included) and non-finite values.
    #[test]
    fn quotient_and_tail_are_the_standard_ops() {
        let s = GeluScalars {
            divisor: std::f32::consts::SQRT_2,
            one: 1.0,
            half: 0.5,
        };
        for n in [0usize, 1, 7, 8, 15, 16, 17, 33, 64, 100] {
            let mut x: Vec<f32> = (0..n).map(|i| (i as f32 - 40.0) * 0.173).collect();
            if n > 3 {
                x[1] = f32::NAN;
                x[2] = f32::INFINITY;
                x[3] = -0.0;
            }
            let mut u = vec![0f32; n];
            gelu_quotient(&s, &x, &mut u);
            // A stand-in for erf: any values, the tail only adds and multiplies.
            let e: Vec<f32> = u.iter().map(|v| (v * 0.37).sin()).collect();
            let (mut a, mut y) = (e.clone(), vec![0f32; n]);
            gelu_tail(&s, &x, &mut a, &mut y);
            for i in 0..n {
                let want_u = x[i] / s.divisor;
                let want_a = e[i] + s.one;
                let want_y = (x[i] * want_a) * s.half;
                assert_eq!(u[i].to_bits(), want_u.to_bits(), "u[{i}] of {n}");
                assert_eq!(a[i].to_bits(), want_a.to_bits(), "a[{i}] of {n}");
                assert_eq!(y[i].to_bits(), want_y.to_bits(), "y[{i}] of {n}");
            }
        }
    }
}
