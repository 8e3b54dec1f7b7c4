//! Softmax and LogSoftmax, differentiated through their outputs:
//!
//! ```text
//! Y = Softmax(X)      dX = Y * (dY - Σ_axis dY * Y)        SoftmaxGrad_13(dY, Y; axis)
//! Y = LogSoftmax(X)   dX = dY - exp(Y) * Σ_axis dY         LogSoftmaxGrad_13(dY, Y; axis)
//! ```
//!
//! Before opset 13 both ops normalise the input coerced to 2-D at `axis` (default 1);
//! the version-1 gradient ops (`SoftmaxGrad`, `LogSoftmaxGrad`) have that meaning.

use super::{Grad, InputGrads};
use crate::ir::builder::attr_int;
use crate::ir::{NodeId, ValueId};
use crate::passes::PassError;

fn through_output(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    op13: &str,
    op1: &str,
) -> Result<InputGrads, PassError> {
    let super::UnaryParts { dy, x, y, hint } = cx.unary_parts(node, dys)?;
    let (op, default_axis) = if cx.opset() >= 13 {
        (op13, -1)
    } else {
        (op1, 1)
    };
    let axis = cx.int_attr(node, "axis", default_axis)?;
    let g = cx.ort_op(
        op,
        &[Some(dy), Some(y)],
        &[&hint],
        vec![attr_int("axis", axis)],
    );
    let dx = cx.output_like(g, 0, x);
    Ok(vec![Some(dx)])
}

pub fn softmax(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    through_output(cx, node, dys, "SoftmaxGrad_13", "SoftmaxGrad")
}

pub fn log_softmax(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    through_output(cx, node, dys, "LogSoftmaxGrad_13", "LogSoftmaxGrad")
}
