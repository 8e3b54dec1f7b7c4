//! `LeakyReluGrad(dY, Y; alpha = 0.01) -> dX`, the gradient of `Y = LeakyRelu(X)` in terms
//! of its output (positive exactly where `X` is):
//!
//! ```text
//! dX = dY * (Y > 0 ? 1 : alpha)
//! ```
//!
//! The slope is selected between two shared scalars, so the `Where` broadcasts constants
//! and only `Mul` touches `dY`.

use super::Lowering;
use crate::ir::NodeId;
use crate::passes::PassError;

pub(super) fn lower(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    let (dy, y) = (l.input(node, 0)?, l.input(node, 1)?);
    let alpha = l.float_attr(node, "alpha", 0.01)?;
    let t = l.float_type(node, dy)?;
    let zero = l.scalar("zero", t, 0.0);
    let one = l.scalar("one", t, 1.0);
    let alpha = l.scalar("alpha", t, alpha as f64);
    let positive = l.op("Greater", &[y, zero], vec![], "leaky_active");
    let slope = l.op("Where", &[positive, one, alpha], vec![], "leaky_slope");
    let dx = l.op("Mul", &[dy, slope], vec![], "leaky_dx");
    l.replace(node, 0, dx);
    Ok(())
}
