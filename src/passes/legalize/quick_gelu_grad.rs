//! `QuickGeluGrad(dY, X; alpha = 1.702) -> dX`, the gradient of
//! `QuickGelu(X) = X * sigmoid(alpha * X)`:
//!
//! ```text
//! v = alpha * X,  s = sigmoid(v)
//! dX = dY * s * (1 + v * (1 - s))
//! ```

use super::Lowering;
use crate::ir::NodeId;
use crate::passes::PassError;

pub(super) fn lower(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    let (dy, x) = (l.input(node, 0)?, l.input(node, 1)?);
    let alpha = l.float_attr(node, "alpha", 1.702)?;
    let t = l.float_type(node, dy)?;
    let alpha = l.scalar("quick_gelu_alpha", t, alpha as f64);
    let one = l.scalar("one", t, 1.0);
    let v = l.op("Mul", &[x, alpha], vec![], "quick_gelu_v");
    let s = l.op("Sigmoid", &[v], vec![], "quick_gelu_s");
    let one_minus_s = l.op("Sub", &[one, s], vec![], "quick_gelu_1ms");
    let v_1ms = l.op("Mul", &[v, one_minus_s], vec![], "quick_gelu_v_1ms");
    let inner = l.op("Add", &[one, v_1ms], vec![], "quick_gelu_inner");
    let slope = l.op("Mul", &[s, inner], vec![], "quick_gelu_slope");
    let dx = l.op("Mul", &[dy, slope], vec![], "quick_gelu_dx");
    l.replace(node, 0, dx);
    Ok(())
}
