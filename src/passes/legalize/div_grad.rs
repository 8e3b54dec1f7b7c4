//! `DivGrad(dY, A, B) -> dA?, dB?`, the gradient of `Y = A / B` (with broadcasting), which
//! ORT emits when both operands need a gradient:
//!
//! ```text
//! dA = unbroadcast_A(dY / B)
//! dB = unbroadcast_B(-(dY / B) * (A / B))          (= dY * -A / B^2)
//! ```
//!
//! `unbroadcast_T` sums over the axes along which T was broadcast to Y's shape, then
//! reshapes to T's shape. ORT finds those axes at run time (BroadcastGradientArgs); here they
//! come from the declared shapes, as ORT's gradient builder does for every other op when
//! shapes are known: an axis is summed where T has no dim or a dim of 1 and Y's dim is not
//! 1 (a symbolic Y dim against T's 1 counts as broadcast). Unknown ranks are an error.

use super::util::dims;
use super::{node_error, Lowering};
use crate::ir::emit::Emit;
use crate::ir::{NodeId, ValueId};
use crate::passes::PassError;

pub(super) fn lower(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    let (dy, a, b) = (l.input(node, 0)?, l.input(node, 1)?, l.input(node, 2)?);
    let (want_da, want_db) = (l.used_output(node, 0), l.used_output(node, 1));
    let dy_over_b = l.op("Div", &[dy, b], vec![], "div_dy_over_b");
    if want_da.is_some() {
        let da = unbroadcast(l, node, dy_over_b, dy, a)?;
        l.replace(node, 0, da);
    }
    if want_db.is_some() {
        let quotient = l.op("Div", &[a, b], vec![], "div_quotient");
        let product = l.op("Mul", &[dy_over_b, quotient], vec![], "div_dy_q_over_b");
        let pre = l.op("Neg", &[product], vec![], "div_db_full");
        let db = unbroadcast(l, node, pre, dy, b)?;
        l.replace(node, 1, db);
    }
    Ok(())
}

/// `g` (shaped like `y`) summed back to the shape of `target`.
fn unbroadcast(
    l: &mut Lowering<'_, '_>,
    node: NodeId,
    g: ValueId,
    y: ValueId,
    target: ValueId,
) -> Result<ValueId, PassError> {
    let model = l.model();
    let (Some(y_dims), Some(t_dims)) = (dims(model, y), dims(model, target)) else {
        return Err(node_error(
            model,
            node,
            format!(
                "the broadcast between '{}' and '{}' needs their ranks, which the model does not declare",
                model.name(y),
                model.name(target)
            ),
        ));
    };
    let offset = y_dims.len() as i64 - t_dims.len() as i64;
    if offset < 0 {
        return Err(node_error(
            model,
            node,
            format!("'{}' has a higher rank than dY", model.name(target)),
        ));
    }
    let axes: Vec<i64> = (0..y_dims.len() as i64)
        .filter(|&i| {
            if i < offset {
                return true;
            }
            let t = t_dims[(i - offset) as usize];
            t == Some(1) && y_dims[i as usize] != Some(1)
        })
        .collect();
    if axes.is_empty() {
        return Ok(g);
    }
    let summed = l.reduce("ReduceSum", g, &axes, true, "div_grad_sum");
    let shape = l.op("Shape", &[target], vec![], "div_grad_shape");
    Ok(l.op("Reshape", &[summed, shape], vec![], "div_grad"))
}
