//! The gradient of `Y = LogSoftmax(X)` in terms of its output:
//!
//! ```text
//! dX = dY - exp(Y) * ReduceSum(dY, axes, keepdims)
//! ```
//!
//! - `LogSoftmaxGrad_13(dY, Y; axis = -1)` (LogSoftmax from opset 13): `axes = [axis]`.
//! - `LogSoftmaxGrad(dY, Y; axis = 1)` (before opset 13, input coerced to 2-D at `axis`):
//!   `axes = [axis, rank)`.

use super::Lowering;
use crate::ir::emit::Emit;
use crate::ir::NodeId;
use crate::passes::PassError;

pub(super) fn lower(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    let axis = l.int_attr(node, "axis", -1)?;
    log_softmax_grad(l, node, &[axis])
}

pub(super) fn lower_v1(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    let axis = l.int_attr(node, "axis", 1)?;
    let y = l.input(node, 1)?;
    let axes = l.trailing_axes(node, axis, y)?;
    log_softmax_grad(l, node, &axes)
}

fn log_softmax_grad(l: &mut Lowering<'_, '_>, node: NodeId, axes: &[i64]) -> Result<(), PassError> {
    let (dy, y) = (l.input(node, 0)?, l.input(node, 1)?);
    let sum = l.reduce("ReduceSum", dy, axes, true, "log_softmax_sum");
    let prob = l.op("Exp", &[y], vec![], "log_softmax_prob");
    let share = l.op("Mul", &[prob, sum], vec![], "log_softmax_share");
    let dx = l.op("Sub", &[dy, share], vec![], "log_softmax_dx");
    l.replace(node, 0, dx);
    Ok(())
}
