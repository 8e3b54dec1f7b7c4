//! Scatters and the gather they are the transpose of.
//!
//! `Y = ScatterElements(X, I, U, axis)` writes `U[j]` at position `I[j]` (along `axis`) of a
//! copy of X; `ScatterND(X, I, U)` writes the slices `U[j]` at the index tuples `I[j]`.
//! Each updated position of Y came from an update, every other one from X:
//!
//! - `reduction = none`: `dX = dY` with the written positions zeroed (the same scatter of
//!   zeros into dY), `dU = gather(dY, I)`. ONNX leaves duplicate indices undefined here, so
//!   each written position has one update.
//! - `reduction = add`: `Y = X + scatter_add(U)`, so `dX = dY` and `dU = gather(dY, I)`.
//! - `mul`, `max`, `min`: refused by name (their derivative reads the other updates).
//!
//! `Y = GatherND(X, I)` (batch_dims 0) reads slices of X at the tuples `I[j]`; its
//! gradient adds each `dY[j]` back at `I[j]`: `dX = ScatterND(zeros(X), I, dY, add)`, since
//! a tuple may repeat.

use super::{wanted, Grad, InputGrads};
use crate::ir::builder::attr_string;
use crate::ir::{NodeId, ValueId};
use crate::passes::PassError;

fn hint(cx: &Grad<'_>, x: ValueId) -> String {
    format!("{}_grad", cx.model().name(x))
}

/// `none` or `add`, else an error naming the reduction.
fn reduction(cx: &Grad<'_>, node: NodeId) -> Result<&'static str, PassError> {
    match cx.string_attr(node, "reduction")?.as_deref() {
        None | Some("none") => Ok("none"),
        Some("add") => Ok("add"),
        Some(other) => Err(cx.error(
            node,
            format!(
                "reduction '{other}' has no gradient rule (its derivative depends on the other \
                 updates at the same position); none and add do"
            ),
        )),
    }
}

/// The scatter rules: `gather` is how the updates' gradient reads dY (GatherElements with
/// the node's axis, or GatherND).
fn scatter(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
    gather: &str,
) -> Result<InputGrads, PassError> {
    let reduction = reduction(cx, node)?;
    let dy = cx.dy(node, dys, 0)?;
    let (x, indices, updates) = (cx.input(node, 0)?, cx.input(node, 1)?, cx.input(node, 2)?);
    let axis = cx.attrs_of(node, &["axis"]);
    let mut grads = vec![None; wants.len()];
    if wanted(wants, 0) {
        grads[0] = Some(match reduction {
            "add" => dy,
            _ => {
                let h = hint(cx, x);
                let zeros = cx.zeros_like(node, updates, &format!("{h}_zeros"))?;
                let op = cx.model().node(node).proto.op_type().to_string();
                cx.op_like(&op, &[dy, indices, zeros], axis.clone(), &h, x)
            }
        });
    }
    if wanted(wants, 2) {
        let h = hint(cx, updates);
        grads[2] = Some(cx.op_like(gather, &[dy, indices], axis, &h, updates));
    }
    Ok(grads)
}

pub fn scatter_elements(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    scatter(cx, node, dys, wants, "GatherElements")
}

pub fn scatter_nd(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    scatter(cx, node, dys, wants, "GatherND")
}

pub fn gather_nd(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let batch_dims = cx.int_attr(node, "batch_dims", 0)?;
    if batch_dims != 0 {
        return Err(cx.error(
            node,
            format!("batch_dims = {batch_dims} has no gradient rule (0 has)"),
        ));
    }
    // Repeated tuples add up: ScatterND's `reduction` exists from opset 16.
    if cx.opset() < 16 {
        return Err(cx.error(
            node,
            format!(
                "the gradient adds slices with ScatterND(reduction='add'), which needs opset 16; \
                 the model imports opset {}",
                cx.opset()
            ),
        ));
    }
    let (x, indices) = (cx.input(node, 0)?, cx.input(node, 1)?);
    let h = hint(cx, x);
    let zeros = cx.zeros_like(node, x, &format!("{h}_zeros"))?;
    let dy = cx.dy(node, dys, 0)?;
    let dx = cx.op_like(
        "ScatterND",
        &[zeros, indices, dy],
        vec![attr_string("reduction", "add")],
        &h,
        x,
    );
    let mut grads = vec![None; wants.len().max(1)];
    grads[0] = Some(dx);
    Ok(grads)
}
