//! `SigmoidGrad(dY, Y) -> dX`, the gradient of `Y = Sigmoid(X)` in terms of its output:
//!
//! ```text
//! dX = dY * Y * (1 - Y)
//! ```

use super::Lowering;
use crate::ir::NodeId;
use crate::passes::PassError;

pub(super) fn lower(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    let (dy, y) = (l.input(node, 0)?, l.input(node, 1)?);
    let t = l.float_type(node, dy)?;
    let one = l.scalar("one", t, 1.0);
    let one_minus_y = l.op("Sub", &[one, y], vec![], "sigmoid_1my");
    let slope = l.op("Mul", &[y, one_minus_y], vec![], "sigmoid_slope");
    let dx = l.op("Mul", &[dy, slope], vec![], "sigmoid_dx");
    l.replace(node, 0, dx);
    Ok(())
}
