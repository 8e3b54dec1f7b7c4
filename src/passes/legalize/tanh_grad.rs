//! `TanhGrad(dY, Y) -> dX`, the gradient of `Y = Tanh(X)` in terms of its output:
//!
//! ```text
//! dX = dY * (1 - Y^2)
//! ```

use super::Lowering;
use crate::ir::NodeId;
use crate::passes::PassError;

pub(super) fn lower(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    let (dy, y) = (l.input(node, 0)?, l.input(node, 1)?);
    let t = l.float_type(node, dy)?;
    let one = l.scalar("one", t, 1.0);
    let y2 = l.op("Mul", &[y, y], vec![], "tanh_y2");
    let slope = l.op("Sub", &[one, y2], vec![], "tanh_slope");
    let dx = l.op("Mul", &[dy, slope], vec![], "tanh_dx");
    l.replace(node, 0, dx);
    Ok(())
}
