//! onnx-ga's own fused operators: what each computes, its domain, name and input slots. The
//! exported step never contains them (it stays standard ONNX, so any host runs it); an engine
//! that has their kernels swaps a recognised standard-op subgraph for one node in memory
//! (`passes::fuse`, the ONNX Runtime kernels in `engine::ort_ops`). This module is the
//! one place both sides read: the rewrite for the slots, the kernel for the arithmetic.

/// The operator domain of the fused operators (never written to a file).
pub const DOMAIN: &str = "ai.onnx_ga";
pub const DOMAIN_VERSION: i64 = 1;

/// `AdamWUpdate(p, g, m, v, alpha, one_minus_alpha, beta, one_minus_beta, epsilon, lr,
/// [a], [c], [lr_wd], [g_addend], [g_divisor]) -> (p', m', v')`: one parameter's AdamW
/// step, element by element, in the order of operations of the standard-op lowering
/// (`passes::legalize::adamw_optimizer::lower_adamw_for_params`), so that float32 results
/// are bit-identical to it:
///
/// ```text
/// g = (g + g_addend) / g_divisor   (each when given: the window's accumulated gradient,
///                                   its sum and mean folded in instead of two more passes)
/// m' = m·α + g·(1-α)               v' = v·β + (g·(1-β))·g
/// adam_mode 1: δ = (m'·lr) / (√v' + ε);         p' = p - δ, then with lr_wd: p' - p'·lr_wd
/// adam_mode 0: δ = (m'·lr) / ((√(v'/c) + ε)·a); p' = (p - p·lr_wd) - δ   (a, c required)
/// ```
///
/// `lr` is the learning rate the elementwise chain multiplies by: in mode 1 already scaled
/// by the bias corrections (`lr·√c/a`, a scalar the graph computes once per step).
pub const ADAMW_UPDATE: &str = "AdamWUpdate";

/// Input slots of [`ADAMW_UPDATE`]; every scalar is a one-element float32 tensor.
pub mod adamw_slot {
    pub const PARAM: usize = 0;
    pub const GRAD: usize = 1;
    pub const M: usize = 2;
    pub const V: usize = 3;
    pub const ALPHA: usize = 4;
    pub const ONE_MINUS_ALPHA: usize = 5;
    pub const BETA: usize = 6;
    pub const ONE_MINUS_BETA: usize = 7;
    pub const EPSILON: usize = 8;
    pub const LR: usize = 9;
    /// Bias correction 1 - α^t (mode 0 only).
    pub const A: usize = 10;
    /// Bias correction 1 - β^t (mode 0 only).
    pub const C: usize = 11;
    /// lr · weight decay (optional: absent means no decoupled decay).
    pub const LR_WD: usize = 12;
    /// Added to the gradient first (optional; same size).
    pub const GRAD_ADDEND: usize = 13;
    /// The gradient is divided by it, after the addend (optional scalar).
    pub const GRAD_DIVISOR: usize = 14;
    pub const COUNT: usize = 15;
}

/// The scalars of one [`ADAMW_UPDATE`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWScalars {
    pub alpha: f32,
    pub one_minus_alpha: f32,
    pub beta: f32,
    pub one_minus_beta: f32,
    pub epsilon: f32,
    pub lr: f32,
    /// Mode 0: `Some((a, c))`, the bias corrections; mode 1: `None`.
    pub corrections: Option<(f32, f32)>,
    pub lr_wd: Option<f32>,
    /// The gradient is divided by it before the update (see [`adamw_update`]).
    pub divisor: Option<f32>,
}

/// The operands of [`adamw_update`]: parameter, gradient, its addend, the two moments.
pub type AdamWOperands<'a> = (
    &'a [f32],
    &'a [f32],
    Option<&'a [f32]>,
    &'a [f32],
    &'a [f32],
);
/// Where [`adamw_update`] writes: parameter, first and second moment.
pub type AdamWOutputs<'a> = (&'a mut [f32], &'a mut [f32], &'a mut [f32]);

/// One AdamW step over `p`, `g` (plus `addend`), `m`, `v` (equal lengths) into `p_out`,
/// `m_out`, `v_out`. Each line is one standard op of the lowering, rounded to float32 where
/// it is: Rust does not contract `a * b + c` into a fused multiply-add, so neither does this.
pub fn adamw_update(
    s: &AdamWScalars,
    (p, g, addend, m, v): AdamWOperands<'_>,
    (p_out, m_out, v_out): AdamWOutputs<'_>,
) {
    let n = p.len();
    assert!(
        [
            g.len(),
            m.len(),
            v.len(),
            p_out.len(),
            m_out.len(),
            v_out.len()
        ]
        .iter()
        .chain(addend.map(<[f32]>::len).as_ref())
        .all(|&l| l == n),
        "AdamWUpdate: operands of different lengths"
    );
    // One loop per variant, each monomorphised so that it vectorises (the slices cut to
    // `n` let the compiler drop the bounds checks).
    let outs = (p_out, m_out, v_out);
    let (g, addend) = (&g[..n], addend.map(|d| &d[..n]));
    match (addend, s.divisor) {
        (None, None) => update_with(s, |i| g[i], (p, m, v), outs),
        (None, Some(k)) => update_with(s, |i| g[i] / k, (p, m, v), outs),
        (Some(d), None) => update_with(s, |i| g[i] + d[i], (p, m, v), outs),
        (Some(d), Some(k)) => update_with(s, |i| (g[i] + d[i]) / k, (p, m, v), outs),
    }
}

/// The update with gradient element `grad(i)`.
#[inline(always)]
fn update_with(
    s: &AdamWScalars,
    grad: impl Fn(usize) -> f32,
    (p, m, v): (&[f32], &[f32], &[f32]),
    (p_out, m_out, v_out): AdamWOutputs<'_>,
) {
    let n = p.len();
    let (m, v) = (&m[..n], &v[..n]);
    let (p_out, m_out, v_out) = (&mut p_out[..n], &mut m_out[..n], &mut v_out[..n]);
    match (s.corrections, s.lr_wd) {
        (None, None) => {
            for i in 0..n {
                let (m1, v1) = moments(s, grad(i), m[i], v[i]);
                let delta = (m1 * s.lr) / (v1.sqrt() + s.epsilon);
                p_out[i] = p[i] - delta;
                m_out[i] = m1;
                v_out[i] = v1;
            }
        }
        (None, Some(k)) => {
            for i in 0..n {
                let (m1, v1) = moments(s, grad(i), m[i], v[i]);
                let delta = (m1 * s.lr) / (v1.sqrt() + s.epsilon);
                let stepped = p[i] - delta;
                p_out[i] = stepped - stepped * k;
                m_out[i] = m1;
                v_out[i] = v1;
            }
        }
        (Some((a, c)), None) => {
            for i in 0..n {
                let (m1, v1) = moments(s, grad(i), m[i], v[i]);
                let denom = ((v1 / c).sqrt() + s.epsilon) * a;
                p_out[i] = p[i] - (m1 * s.lr) / denom;
                m_out[i] = m1;
                v_out[i] = v1;
            }
        }
        (Some((a, c)), Some(k)) => {
            for i in 0..n {
                let (m1, v1) = moments(s, grad(i), m[i], v[i]);
                let decayed = p[i] - p[i] * k;
                let denom = ((v1 / c).sqrt() + s.epsilon) * a;
                p_out[i] = decayed - (m1 * s.lr) / denom;
                m_out[i] = m1;
                v_out[i] = v1;
            }
        }
    }
}

/// m' = m·α + g·(1-α),  v' = v·β + (g·(1-β))·g.
#[inline(always)]
fn moments(s: &AdamWScalars, g: f32, m: f32, v: f32) -> (f32, f32) {
    let m1 = m * s.alpha + g * s.one_minus_alpha;
    let v1 = v * s.beta + (g * s.one_minus_beta) * g;
    (m1, v1)
}

/// `SgdUpdate(p, g, lr, [buf], [mu], [wd], [g_addend], [g_divisor]) -> (p', [buf'])`,
/// attribute `nesterov` (0 or 1): one parameter's SGD step in the optimizer pass's order of
/// operations (`passes::optimizer`, bit-identical in float32):
///
/// ```text
/// g = (g + g_addend) / g_divisor    (each when given, as for AdamWUpdate)
/// with wd:       g = g + p·wd       (L2)
/// with buf, mu:  buf' = buf·mu + g;  d = nesterov ? g + buf'·mu : buf'     (else d = g)
/// p' = p - lr·d
/// ```
pub const SGD_UPDATE: &str = "SgdUpdate";

/// Input slots of [`SGD_UPDATE`]; scalars are one-element float32 tensors.
pub mod sgd_slot {
    pub const PARAM: usize = 0;
    pub const GRAD: usize = 1;
    pub const LR: usize = 2;
    /// The momentum buffer (optional; with it, `MU` too and a second output).
    pub const BUF: usize = 3;
    pub const MU: usize = 4;
    /// L2 weight decay (optional).
    pub const WD: usize = 5;
    pub const GRAD_ADDEND: usize = 6;
    pub const GRAD_DIVISOR: usize = 7;
    pub const COUNT: usize = 8;
}

/// The scalars of one [`SGD_UPDATE`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdScalars {
    pub lr: f32,
    /// `Some((mu, nesterov))` with a momentum buffer.
    pub momentum: Option<(f32, bool)>,
    pub wd: Option<f32>,
    pub divisor: Option<f32>,
}

/// The operands of [`sgd_update`]: parameter, gradient, its addend, the momentum buffer.
pub type SgdOperands<'a> = (&'a [f32], &'a [f32], Option<&'a [f32]>, Option<&'a [f32]>);

/// One SGD step over `p`, `g` (plus `addend`) and the momentum buffer `buf` when there is
/// one, into `p_out` and `buf_out`.
pub fn sgd_update(
    s: &SgdScalars,
    (p, g, addend, buf): SgdOperands<'_>,
    (p_out, buf_out): (&mut [f32], Option<&mut [f32]>),
) {
    let n = p.len();
    assert!(
        [g.len(), p_out.len()]
            .iter()
            .chain(addend.map(<[f32]>::len).as_ref())
            .chain(buf.map(<[f32]>::len).as_ref())
            .all(|&l| l == n)
            && buf.is_some() == buf_out.is_some()
            && buf.is_some() == s.momentum.is_some(),
        "SgdUpdate: operands of different lengths, or a buffer without its momentum"
    );
    let (g, addend) = (&g[..n], addend.map(|d| &d[..n]));
    let outs = (p_out, buf, buf_out);
    match (addend, s.divisor) {
        (None, None) => sgd_with(s, |i| g[i], p, outs),
        (None, Some(k)) => sgd_with(s, |i| g[i] / k, p, outs),
        (Some(d), None) => sgd_with(s, |i| g[i] + d[i], p, outs),
        (Some(d), Some(k)) => sgd_with(s, |i| (g[i] + d[i]) / k, p, outs),
    }
}

#[inline(always)]
fn sgd_with(
    s: &SgdScalars,
    grad: impl Fn(usize) -> f32,
    p: &[f32],
    (p_out, buf, buf_out): (&mut [f32], Option<&[f32]>, Option<&mut [f32]>),
) {
    match s.wd {
        // L2 as its own monomorphised gradient, so that each loop below stays branch-free
        // and vectorises (a branch on wd inside the loop kept it scalar: 8x slower).
        Some(wd) => sgd_loops(s, |i| grad(i) + p[i] * wd, p, (p_out, buf, buf_out)),
        None => sgd_loops(s, grad, p, (p_out, buf, buf_out)),
    }
}

#[inline(always)]
fn sgd_loops(
    s: &SgdScalars,
    grad: impl Fn(usize) -> f32,
    p: &[f32],
    (p_out, buf, buf_out): (&mut [f32], Option<&[f32]>, Option<&mut [f32]>),
) {
    let n = p.len();
    let p_out = &mut p_out[..n];
    let lr = s.lr;
    match (s.momentum, buf, buf_out) {
        (Some((mu, true)), Some(buf), Some(buf_out)) => {
            let (buf, buf_out) = (&buf[..n], &mut buf_out[..n]);
            for i in 0..n {
                let g = grad(i);
                let b = buf[i] * mu + g;
                p_out[i] = p[i] - lr * (g + b * mu);
                buf_out[i] = b;
            }
        }
        (Some((mu, false)), Some(buf), Some(buf_out)) => {
            let (buf, buf_out) = (&buf[..n], &mut buf_out[..n]);
            for i in 0..n {
                let b = buf[i] * mu + grad(i);
                p_out[i] = p[i] - lr * b;
                buf_out[i] = b;
            }
        }
        _ => {
            for i in 0..n {
                p_out[i] = p[i] - lr * grad(i);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The closed form in float64 agrees with the float32 update to float32 rounding.
    #[test]
    fn adamw_update_is_adamw() {
        let s = AdamWScalars {
            alpha: 0.9,
            one_minus_alpha: 1.0 - 0.9,
            beta: 0.999,
            one_minus_beta: 1.0 - 0.999,
            epsilon: 1e-8,
            lr: 1e-3,
            corrections: Some((1.0 - 0.9f32.powi(3), 1.0 - 0.999f32.powi(3))),
            lr_wd: Some(1e-3 * 1e-2),
            divisor: None,
        };
        let (p, g, m, v) = (
            [0.5f32, -1.5],
            [0.25f32, 3.0],
            [0.1f32, -0.2],
            [0.01f32, 0.5],
        );
        let (mut po, mut mo, mut vo) = ([0f32; 2], [0f32; 2], [0f32; 2]);
        adamw_update(&s, (&p, &g, None, &m, &v), (&mut po, &mut mo, &mut vo));
        for i in 0..2 {
            let f = |x: f32| x as f64;
            let m1 = f(m[i]) * f(s.alpha) + f(g[i]) * f(s.one_minus_alpha);
            let v1 = f(v[i]) * f(s.beta) + f(g[i]) * f(g[i]) * f(s.one_minus_beta);
            let (a, c) = s.corrections.map(|(a, c)| (f(a), f(c))).unwrap();
            let p1 = f(p[i]) * (1.0 - f(s.lr_wd.unwrap()))
                - f(s.lr) * m1 / (a * ((v1 / c).sqrt() + f(s.epsilon)));
            for (got, want) in [(po[i], p1), (mo[i], m1), (vo[i], v1)] {
                assert!(
                    (f(got) - want).abs() <= 4.0 * f32::EPSILON as f64 * want.abs(),
                    "{got} vs {want}"
                );
            }
        }
    }

    /// Nesterov with L2 and the mean folded in, against the closed form in float64.
    #[test]
    fn sgd_update_is_nesterov() {
        let s = SgdScalars {
            lr: 0.1,
            momentum: Some((0.9, true)),
            wd: Some(0.01),
            divisor: Some(4.0),
        };
        let (p, g, d, buf) = (
            [1.0f32, -2.0],
            [0.5f32, 1.5],
            [0.25f32, -0.5],
            [0.1f32, 0.2],
        );
        let (mut po, mut bo) = ([0f32; 2], [0f32; 2]);
        sgd_update(&s, (&p, &g, Some(&d), Some(&buf)), (&mut po, Some(&mut bo)));
        for i in 0..2 {
            let f = |x: f32| x as f64;
            let grad = (f(g[i]) + f(d[i])) / 4.0 + f(p[i]) * f(0.01);
            let b = f(buf[i]) * f(0.9) + grad;
            let p1 = f(p[i]) - f(0.1) * (grad + b * f(0.9));
            for (got, want) in [(po[i], p1), (bo[i], b)] {
                assert!((f(got) - want).abs() <= 4.0 * f32::EPSILON as f64 * want.abs().max(1.0));
            }
        }
    }
}
