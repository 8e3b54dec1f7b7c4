//! `GeluGrad(dY, X) -> dX`, the gradient of the exact `Gelu(X) = X * Phi(X)`, with Phi the
//! standard normal CDF and phi its density:
//!
//! ```text
//! dX = dY * (Phi(X) + X * phi(X))
//!    = dY * (0.5 * (1 + erf(X / sqrt 2)) + X * exp(-X^2 / 2) / sqrt(2 pi))
//! ```
//!
//! `BiasGeluGrad_dX(dY, X, B) -> dX` is the same at `X + B` (the gradient of
//! `BiasGelu(X, B) = Gelu(X + B)` with respect to `X`).
//!
//! The nodes follow ORT's own kernel term by term (`x * sqrt(1/2)` inside erf, the density
//! as `x * alpha * exp(-0.5 * x * x)`), so the results agree to rounding.

use std::f64::consts::{FRAC_1_SQRT_2, FRAC_2_SQRT_PI};

use super::Lowering;
use crate::ir::{NodeId, ValueId};
use crate::passes::PassError;

pub(super) fn lower(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    let (dy, x) = (l.input(node, 0)?, l.input(node, 1)?);
    let t = l.float_type(node, dy)?;
    let dx = gelu_grad(l, dy, x, t);
    l.replace(node, 0, dx);
    Ok(())
}

pub(super) fn lower_bias(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    let (dy, x, bias) = (l.input(node, 0)?, l.input(node, 1)?, l.input(node, 2)?);
    let t = l.float_type(node, dy)?;
    let xb = l.op("Add", &[x, bias], vec![], "gelu_x_plus_b");
    let dx = gelu_grad(l, dy, xb, t);
    l.replace(node, 0, dx);
    Ok(())
}

/// `dY * (Phi(x) + x * phi(x))` in element type `t`.
fn gelu_grad(l: &mut Lowering<'_, '_>, dy: ValueId, x: ValueId, t: i32) -> ValueId {
    // Phi(x) = 0.5 * (1 + erf(x * sqrt(1/2)))
    let sqrt_half = l.scalar("sqrt_half", t, FRAC_1_SQRT_2);
    let one = l.scalar("one", t, 1.0);
    let half = l.scalar("half", t, 0.5);
    let erf_arg = l.op("Mul", &[x, sqrt_half], vec![], "gelu_erf_arg");
    let erf = l.op("Erf", &[erf_arg], vec![], "gelu_erf");
    let erf_1 = l.op("Add", &[erf, one], vec![], "gelu_erf_1");
    let cdf = l.op("Mul", &[half, erf_1], vec![], "gelu_cdf");
    // x * phi(x) = x * (1 / sqrt(2 pi)) * exp(-0.5 * x * x)
    let alpha = l.scalar("inv_sqrt_2pi", t, FRAC_2_SQRT_PI * FRAC_1_SQRT_2 * 0.5);
    let minus_half = l.scalar("minus_half", t, -0.5);
    let alpha_x = l.op("Mul", &[x, alpha], vec![], "gelu_alpha_x");
    let minus_half_x = l.op("Mul", &[minus_half, x], vec![], "gelu_mhalf_x");
    let exp_arg = l.op("Mul", &[minus_half_x, x], vec![], "gelu_exp_arg");
    let exp = l.op("Exp", &[exp_arg], vec![], "gelu_exp");
    let x_pdf = l.op("Mul", &[alpha_x, exp], vec![], "gelu_x_pdf");
    let slope = l.op("Add", &[cdf, x_pdf], vec![], "gelu_slope");
    l.op("Mul", &[dy, slope], vec![], "gelu_dx")
}
