//! Gradients of the gather family: scatter-add the output gradient into zeros of the input's
//! shape (repeated indices add up, as an embedding's gradient must).
//!
//! ```text
//! GatherGrad(shape, I, dY; axis)          dX = zeros(shape); dX[.., I[j], ..] += dY[.., j, ..]
//! GatherElementsGrad(dY, shape, I; axis)  dX = ScatterElements(zeros(shape), I, dY, axis, add)
//! GatherNDGrad(shape, I, dY; batch_dims=0) dX = ScatterND(zeros(shape), I, dY, add)
//! ```
//!
//! `GatherGrad` on axis 0 (embeddings) is a `ScatterND` with the indices given a trailing
//! axis; on another axis, with one-dimensional indices, a `ScatterElements` with the indices
//! broadcast along the gathered axis. Scatter with `reduction = "add"` needs opset 16.

use super::Lowering;
use crate::ir::builder::{attr_int, attr_string, attr_tensor};
use crate::ir::emit::Emit;
use crate::ir::{NodeId, ValueId};
use crate::passes::PassError;
use crate::proto::TensorProto;

/// `ConstantOfShape(shape)` filled with zeros of element type `t`.
fn zeros(l: &mut Lowering<'_, '_>, shape: ValueId, t: i32) -> ValueId {
    let zero = TensorProto {
        dims: vec![1],
        data_type: Some(t),
        raw_data: Some(vec![0; super::util::elem_size(t)]),
        ..Default::default()
    };
    l.op(
        "ConstantOfShape",
        &[shape],
        vec![attr_tensor("value", zero)],
        "grad_zeros",
    )
}

fn require_opset_16(l: &Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    if l.onnx_opset() < 16 {
        return Err(super::node_error(
            l.model(),
            node,
            format!(
                "lowering needs ScatterND/ScatterElements with reduction='add' (opset 16); the model imports opset {}",
                l.onnx_opset()
            ),
        ));
    }
    Ok(())
}

fn int64_indices(l: &mut Lowering<'_, '_>, indices: ValueId) -> ValueId {
    l.cast(indices, super::util::INT64, "grad_indices")
}

pub(super) fn lower(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    require_opset_16(l, node)?;
    let (shape, indices, dy) = (l.input(node, 0)?, l.input(node, 1)?, l.input(node, 2)?);
    let t = l.float_type(node, dy)?;
    let axis = l.int_attr(node, "axis", 0)?;
    // The rank of the gathered input: rank(dY) - rank(I) + 1.
    let data_rank = match (l.rank(dy), l.rank(indices)) {
        (Some(d), Some(i)) => Some(d as i64 - i as i64 + 1),
        _ => None,
    };
    let axis = match (axis, data_rank) {
        (a, Some(r)) if a < 0 => a + r,
        (a, _) => a,
    };
    let indices = int64_indices(l, indices);
    let zeros = zeros(l, shape, t);
    let dx = if axis == 0 {
        let nd_indices = l.unsqueeze(indices, &[-1], "grad_nd_indices");
        l.op(
            "ScatterND",
            &[zeros, nd_indices, dy],
            vec![attr_string("reduction", "add")],
            "gather_dx",
        )
    } else {
        let (Some(1), Some(r)) = (l.rank(indices), data_rank) else {
            return Err(l.unsupported(
                node,
                "axis",
                format!("{axis} with indices of rank other than 1 (or of unknown rank)"),
            ));
        };
        if axis < 0 || axis >= r {
            return Err(l.unsupported(node, "axis", format!("{axis} for a rank-{r} input")));
        }
        // I of shape [q] as [1, .., q, .., 1], then broadcast to dY's shape.
        let mut view = vec![1i64; r as usize];
        view[axis as usize] = -1;
        let view = l.int64s("gather_index_view", &view);
        let column = l.op("Reshape", &[indices, view], vec![], "gather_index_column");
        let dy_shape = l.op("Shape", &[dy], vec![], "gather_dy_shape");
        let spread = l.op("Expand", &[column, dy_shape], vec![], "gather_index_spread");
        l.op(
            "ScatterElements",
            &[zeros, spread, dy],
            vec![attr_int("axis", axis), attr_string("reduction", "add")],
            "gather_dx",
        )
    };
    l.replace(node, 0, dx);
    Ok(())
}

pub(super) fn lower_elements(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    require_opset_16(l, node)?;
    let (dy, shape, indices) = (l.input(node, 0)?, l.input(node, 1)?, l.input(node, 2)?);
    let t = l.float_type(node, dy)?;
    let axis = l.int_attr(node, "axis", 0)?;
    let zeros = zeros(l, shape, t);
    let dx = l.op(
        "ScatterElements",
        &[zeros, indices, dy],
        vec![attr_int("axis", axis), attr_string("reduction", "add")],
        "gather_elements_dx",
    );
    l.replace(node, 0, dx);
    Ok(())
}

pub(super) fn lower_nd(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    require_opset_16(l, node)?;
    let batch_dims = l.int_attr(node, "batch_dims", 0)?;
    if batch_dims != 0 {
        return Err(l.unsupported(node, "batch_dims", format!("value {batch_dims}")));
    }
    let (shape, indices, dy) = (l.input(node, 0)?, l.input(node, 1)?, l.input(node, 2)?);
    let t = l.float_type(node, dy)?;
    let zeros = zeros(l, shape, t);
    let indices = int64_indices(l, indices);
    let dx = l.op(
        "ScatterND",
        &[zeros, indices, dy],
        vec![attr_string("reduction", "add")],
        "gather_nd_dx",
    );
    l.replace(node, 0, dx);
    Ok(())
}
