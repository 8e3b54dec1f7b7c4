//! `FastGeluGrad(dY, X) -> dX`, the gradient of the tanh approximation
//! `FastGelu(X) = 0.5 * X * (1 + tanh(u))`, `u = a * (X + g * X^3)`, `a = sqrt(2 / pi)`,
//! `g = 0.044715`:
//!
//! ```text
//! dX = dY * (0.5 * (1 + t) + 0.5 * (1 - t^2) * (a X + 3 a g X^3)),   t = tanh(u)
//!    = dY * s * (1 + r * (2a X + 6 a g X^3)),   s = (1 + t) / 2 = 1 / (1 + e^-2u),
//!                                               r = (1 - t) / 2 = 1 / (1 + e^2u)
//! ```
//!
//! `BiasFastGeluGrad_dX(dY, X, B) -> dX` is the same at `X + B`.
//!
//! Why the second form: ORT 1.31's `Tanh` kernel is a fast approximation, and `1 - t^2`
//! magnifies its error where |t| nears 1; written with `Tanh` the lowering was up to 3.7e-6
//! off the exact value on [-8, 8], the training build's kernel 2.2e-7. With `Exp` (accurate
//! in ORT) and both halves `s`, `r` computed directly (neither is `1 - ` the other, so
//! neither cancels; `e^2u` overflowing to inf just makes `r` 0), it is 1.9e-7 off
//! (measured, float32).

use std::f64::consts::{FRAC_1_SQRT_2, FRAC_2_SQRT_PI};

use super::Lowering;
use crate::ir::{NodeId, ValueId};
use crate::passes::PassError;

pub(super) fn lower(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    let (dy, x) = (l.input(node, 0)?, l.input(node, 1)?);
    let t = l.float_type(node, dy)?;
    let dx = fast_gelu_grad(l, dy, x, t);
    l.replace(node, 0, dx);
    Ok(())
}

pub(super) fn lower_bias(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    let (dy, x, bias) = (l.input(node, 0)?, l.input(node, 1)?, l.input(node, 2)?);
    let t = l.float_type(node, dy)?;
    let xb = l.op("Add", &[x, bias], vec![], "fast_gelu_x_plus_b");
    let dx = fast_gelu_grad(l, dy, xb, t);
    l.replace(node, 0, dx);
    Ok(())
}

fn fast_gelu_grad(l: &mut Lowering<'_, '_>, dy: ValueId, x: ValueId, t: i32) -> ValueId {
    let a = FRAC_2_SQRT_PI * FRAC_1_SQRT_2;
    let g = 0.044715f32 as f64;
    let gamma = l.scalar("fast_gelu_gamma", t, g);
    let two_a = l.scalar("fast_gelu_2a", t, 2.0 * a);
    let minus_two_a = l.scalar("fast_gelu_m2a", t, -2.0 * a);
    let six_a_g = l.scalar("fast_gelu_6ag", t, 6.0 * a * g);
    let one = l.scalar("one", t, 1.0);
    // inner = x + g x^3, so u = a * inner
    let x2 = l.op("Mul", &[x, x], vec![], "fast_gelu_x2");
    let x3 = l.op("Mul", &[x, x2], vec![], "fast_gelu_x3");
    let g_x3 = l.op("Mul", &[gamma, x3], vec![], "fast_gelu_g_x3");
    let inner = l.op("Add", &[x, g_x3], vec![], "fast_gelu_inner");
    // s = 1 / (1 + e^-2u), r = 1 / (1 + e^2u)
    let minus_two_u = l.op("Mul", &[inner, minus_two_a], vec![], "fast_gelu_m2u");
    let e_minus = l.op("Exp", &[minus_two_u], vec![], "fast_gelu_exp_m2u");
    let s_denom = l.op("Add", &[e_minus, one], vec![], "fast_gelu_s_denom");
    let s = l.op("Reciprocal", &[s_denom], vec![], "fast_gelu_s");
    let two_u = l.op("Mul", &[inner, two_a], vec![], "fast_gelu_2u");
    let e_plus = l.op("Exp", &[two_u], vec![], "fast_gelu_exp_2u");
    let r_denom = l.op("Add", &[e_plus, one], vec![], "fast_gelu_r_denom");
    let r = l.op("Reciprocal", &[r_denom], vec![], "fast_gelu_r");
    // dX = dY * s * (1 + r * (2a x + 6ag x^3))
    let lin = l.op("Mul", &[two_a, x], vec![], "fast_gelu_2a_x");
    let cub = l.op("Mul", &[six_a_g, x3], vec![], "fast_gelu_6ag_x3");
    let x_du = l.op("Add", &[lin, cub], vec![], "fast_gelu_2x_du");
    let r_x_du = l.op("Mul", &[r, x_du], vec![], "fast_gelu_r_x_du");
    let inner2 = l.op("Add", &[r_x_du, one], vec![], "fast_gelu_1_r_x_du");
    let slope = l.op("Mul", &[s, inner2], vec![], "fast_gelu_slope");
    l.op("Mul", &[dy, slope], vec![], "fast_gelu_dx")
}
