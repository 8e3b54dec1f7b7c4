//! The gradient of `Y = Softmax(X)` in terms of its output:
//!
//! ```text
//! dX = Y * (dY - ReduceSum(dY * Y, axes, keepdims))
//! ```
//!
//! - `SoftmaxGrad_13(dY, Y; axis = -1)` (Softmax from opset 13): `axes = [axis]`.
//! - `SoftmaxGrad(dY, Y; axis = 1)` (Softmax before opset 13, which normalises the input
//!   coerced to 2-D at `axis`): `axes = [axis, rank)`.

use super::Lowering;
use crate::ir::emit::Emit;
use crate::ir::{NodeId, ValueId};
use crate::passes::PassError;

pub(super) fn lower(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    let axis = l.int_attr(node, "axis", -1)?;
    softmax_grad(l, node, &[axis])
}

pub(super) fn lower_v1(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    let axis = l.int_attr(node, "axis", 1)?;
    let y = l.input(node, 1)?;
    let axes = l.trailing_axes(node, axis, y)?;
    softmax_grad(l, node, &axes)
}

fn softmax_grad(l: &mut Lowering<'_, '_>, node: NodeId, axes: &[i64]) -> Result<(), PassError> {
    let (dy, y): (ValueId, ValueId) = (l.input(node, 0)?, l.input(node, 1)?);
    let dy_y = l.op("Mul", &[dy, y], vec![], "softmax_dy_y");
    let dot = l.reduce("ReduceSum", dy_y, axes, true, "softmax_dot");
    let centered = l.op("Sub", &[dy, dot], vec![], "softmax_centered");
    let dx = l.op("Mul", &[y, centered], vec![], "softmax_dx");
    l.replace(node, 0, dx);
    Ok(())
}
