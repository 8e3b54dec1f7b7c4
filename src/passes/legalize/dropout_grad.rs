//! `DropoutGrad(dY, mask, ratio?, training_mode?) -> dX`, the gradient of inverted dropout:
//!
//! ```text
//! dX = dY * mask / (1 - ratio)          (ratio = 0.5 when absent)
//! ```
//!
//! ORT's kernel applies the scale whatever `training_mode` says (measured on the 1.19.2
//! training build), so that input is ignored here too. A constant ratio folds into one
//! scalar; the mask is cast and multiplied in (ORT 1.31 runs that faster than `Where`).

use super::util::constant_scalar;
use super::Lowering;
use crate::ir::NodeId;
use crate::passes::PassError;

pub(super) fn lower(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    let (dy, mask) = (l.input(node, 0)?, l.input(node, 1)?);
    let t = l.float_type(node, dy)?;
    let ratio = l.optional_input(node, 2);
    let scale = match ratio.map(|r| (r, constant_scalar(l.model(), r))) {
        None => l.scalar("dropout_scale", t, 2.0),
        Some((_, Some(r))) => {
            let r = r as f32;
            l.scalar("dropout_scale", t, (1.0 / (1.0 - r)) as f64)
        }
        Some((r, None)) => {
            let one = l.scalar("one", t, 1.0);
            let r = l.cast(r, t, "dropout_ratio");
            let keep = l.op("Sub", &[one, r], vec![], "dropout_keep");
            // Not `Div(1, keep)`: ONNX Runtime 1.31's DivMulFusion rewrites that Div and the
            // Mul below into one Div after EliminateIdentity has removed the node making dY
            // (a Cast to dY's own type, from T5's layer norm), and the session fails to load
            // ("... is not a graph input, initializer, or output of a previous node").
            l.op("Reciprocal", &[keep], vec![], "dropout_scale")
        }
    };
    let kept = l.cast(mask, t, "dropout_mask");
    let scaled = l.op("Mul", &[dy, scale], vec![], "dropout_scaled");
    let dx = l.op("Mul", &[scaled, kept], vec![], "dropout_dx");
    l.replace(node, 0, dx);
    Ok(())
}
