//! Trigonometric and hyperbolic functions and their inverses. Each derivative is a closed
//! form in X, or in Y where that saves recomputing the function:
//!
//! ```text
//! Sin    dX = dY · cos X              Sinh   dX = dY · cosh X
//! Cos    dX = -dY · sin X             Cosh   dX = dY · sinh X
//! Tan    dX = dY · (1 + Y²)
//! Asin   dX = dY / sqrt(1 - X²)       Asinh  dX = dY / sqrt(X² + 1)
//! Acos   dX = -dY / sqrt(1 - X²)      Acosh  dX = dY / sqrt(X² - 1)
//! Atan   dX = dY / (1 + X²)           Atanh  dX = dY / (1 - X²)
//! ```
//!
//! At the ends of a domain (|X| = 1 for Asin, Acos and Atanh, X = 1 for Acosh) the
//! derivative is infinite, as in PyTorch.

use super::{Grad, InputGrads};
use crate::ir::{NodeId, ValueId};
use crate::passes::PassError;

/// `dX = sign · dY / g(X)`.
fn over(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    negate: bool,
    g: impl FnOnce(&mut Grad<'_>, ValueId, &str) -> Result<ValueId, PassError>,
) -> Result<InputGrads, PassError> {
    let p = cx.unary_parts(node, dys)?;
    let h = p.hint.as_str();
    let denominator = g(cx, p.x, h)?;
    let q = cx.op_like("Div", &[p.dy, denominator], vec![], h, p.x);
    let dx = if negate {
        cx.op_like("Neg", &[q], vec![], h, p.x)
    } else {
        q
    };
    Ok(vec![Some(dx)])
}

/// `c + X²`, or `c - X²`.
fn square_plus(
    cx: &mut Grad<'_>,
    node: NodeId,
    x: ValueId,
    c: f64,
    subtract_square: bool,
    h: &str,
) -> Result<ValueId, PassError> {
    let x2 = cx.op_like("Mul", &[x, x], vec![], h, x);
    let c = cx.scalar_like(node, x, c)?;
    let op = if subtract_square { "Sub" } else { "Add" };
    Ok(cx.op_like(op, &[c, x2], vec![], h, x))
}

/// `sqrt(c ± X²)`.
fn root_of_square_plus(
    cx: &mut Grad<'_>,
    node: NodeId,
    x: ValueId,
    c: f64,
    subtract_square: bool,
    h: &str,
) -> Result<ValueId, PassError> {
    let d = square_plus(cx, node, x, c, subtract_square, h)?;
    Ok(cx.op_like("Sqrt", &[d], vec![], h, x))
}

pub fn sin(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    cx.by_slope(node, dys, |cx, x, _, h| {
        Ok(cx.op_like("Cos", &[x], vec![], h, x))
    })
}

pub fn cos(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    cx.by_slope(node, dys, |cx, x, _, h| {
        let s = cx.op_like("Sin", &[x], vec![], h, x);
        Ok(cx.op_like("Neg", &[s], vec![], h, x))
    })
}

pub fn tan(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    cx.by_slope(node, dys, |cx, _, y, h| {
        square_plus(cx, node, y, 1.0, false, h)
    })
}

pub fn sinh(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    cx.by_slope(node, dys, |cx, x, _, h| {
        Ok(cx.op_like("Cosh", &[x], vec![], h, x))
    })
}

pub fn cosh(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    cx.by_slope(node, dys, |cx, x, _, h| {
        Ok(cx.op_like("Sinh", &[x], vec![], h, x))
    })
}

pub fn asin(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    over(cx, node, dys, false, |cx, x, h| {
        root_of_square_plus(cx, node, x, 1.0, true, h)
    })
}

pub fn acos(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    over(cx, node, dys, true, |cx, x, h| {
        root_of_square_plus(cx, node, x, 1.0, true, h)
    })
}

pub fn atan(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    over(cx, node, dys, false, |cx, x, h| {
        square_plus(cx, node, x, 1.0, false, h)
    })
}

pub fn asinh(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    over(cx, node, dys, false, |cx, x, h| {
        root_of_square_plus(cx, node, x, 1.0, false, h)
    })
}

pub fn acosh(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    over(cx, node, dys, false, |cx, x, h| {
        root_of_square_plus(cx, node, x, -1.0, false, h)
    })
}

pub fn atanh(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    over(cx, node, dys, false, |cx, x, h| {
        square_plus(cx, node, x, 1.0, true, h)
    })
}
