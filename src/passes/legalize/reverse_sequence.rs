//! `ReverseSequence(X, lens; batch_axis, time_axis) -> Y`, lowered for tract
//! (`lower-for-tract` only; ONNX Runtime runs it, tract-onnx 0.23 has no kernel). tf2onnx
//! writes it for a Keras Bidirectional layer's backward direction, and its gradient is
//! another one.
//!
//! Each batch entry `b` has its first `lens[b]` time steps reversed, the rest kept: a gather
//! along the time axis at
//!
//! ```text
//! j[t, b] = t < lens[b] ? lens[b] - 1 - t : t          (t over Range(0, T))
//! X3 = Reshape(X, [0, 0, -1])                          time and batch first or second,
//!                                                      every other axis flattened
//! Y  = Reshape(GatherElements(X3, Expand(Unsqueeze(j, 2), Shape(X3)), axis = time_axis),
//!              Shape(X))
//! ```
//!
//! with `j` laid out [T, B] for time_axis 0 and [B, T] for time_axis 1 (ONNX allows only
//! those two layouts).

use super::Lowering;
use crate::ir::builder::{attr_int, tensor_i64};
use crate::ir::emit::Emit;
use crate::ir::{Model, NodeId};
use crate::passes::PassError;
use crate::proto::tensor_proto::DataType;

/// Whether `node` is a default-domain ReverseSequence.
pub fn is_reverse_sequence(model: &Model, node: NodeId) -> bool {
    let p = &model.node(node).proto;
    p.op_type() == "ReverseSequence" && crate::ir::normalize_domain(p.domain()).is_empty()
}

pub fn lower(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    let (x, lens) = (l.input(node, 0)?, l.input(node, 1)?);
    let time_axis = l.int_attr(node, "time_axis", 0)?;
    let batch_axis = l.int_attr(node, "batch_axis", 1)?;
    if !matches!((time_axis, batch_axis), (0, 1) | (1, 0)) {
        return Err(l.unsupported(
            node,
            "time_axis",
            format!("time_axis {time_axis} with batch_axis {batch_axis} (ONNX: 0 and 1)"),
        ));
    }
    let int64 = DataType::Int64 as i32;
    let lens = l.cast(lens, int64, "reverse_lens");
    let shape = l.op("Shape", &[x], vec![], "reverse_shape");
    let axis = l.constant("reverse_time_axis", tensor_i64(&[], &[time_axis]));
    let steps_count = l.op("Gather", &[shape, axis], vec![], "reverse_steps");
    let (zero, one) = (
        l.constant("reverse_zero", tensor_i64(&[], &[0])),
        l.constant("reverse_one", tensor_i64(&[], &[1])),
    );
    let steps = l.op("Range", &[zero, steps_count, one], vec![], "reverse_t");
    // t along the time axis of j, lens along its batch axis.
    let steps = l.b.unsqueeze(steps, &[batch_axis], "reverse_t");
    let lens = l.b.unsqueeze(lens, &[time_axis], "reverse_lens");
    let inside = l.op("Less", &[steps, lens], vec![], "reverse_inside");
    let last = l.op("Sub", &[lens, one], vec![], "reverse_last");
    let mirrored = l.op("Sub", &[last, steps], vec![], "reverse_mirrored");
    let j = l.op("Where", &[inside, mirrored, steps], vec![], "reverse_index");
    let flat = l.int64s("reverse_flat", &[0, 0, -1]);
    let x3 = l.op("Reshape", &[x, flat], vec![], "reverse_x3");
    let shape3 = l.op("Shape", &[x3], vec![], "reverse_shape3");
    let j3 = l.b.unsqueeze(j, &[2], "reverse_index");
    let index = l.op("Expand", &[j3, shape3], vec![], "reverse_index");
    let y3 = l.op(
        "GatherElements",
        &[x3, index],
        vec![attr_int("axis", time_axis)],
        "reversed",
    );
    let y = l.op("Reshape", &[y3, shape], vec![], "reversed");
    l.replace(node, 0, y);
    Ok(())
}
