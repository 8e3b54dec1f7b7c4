//! `CumSum(X, axis; exclusive, reverse) -> Y` of integers, lowered for tract
//! (`lower-for-tract` only; ONNX Runtime runs it):
//!
//! ```text
//! Y = Cast(CumSum(Cast(X, float64), axis; exclusive, reverse), type of X)
//! ```
//!
//! Why: tract-onnx 0.23 folds integer tensors computed from shapes as symbolic dims (TDim)
//! while it analyses the graph, and its CumSum cannot evaluate those ("TDim is not a
//! number"). Hugging Face's masks build one: transformers 5's `find_packed_sequence_indices`
//! takes a CumSum of `position_ids[1:] - position_ids[:-1] != 1`, with the positions a
//! `Range` over the sequence length (hf_llama, hf_gpt2). In float64 the sum is no dim, and
//! it is exact: every int32 is, and an int64 sum is while its partial sums stay below 2^53
//! in magnitude (positions, counts and mask offsets are far below).

use super::util::elem_type;
use super::Lowering;
use crate::ir::builder::attr_int;
use crate::ir::{Model, NodeId};
use crate::passes::PassError;
use crate::proto::tensor_proto::DataType;

/// Whether `node` is a default-domain CumSum of integers.
pub fn is_integer_cumsum(model: &Model, node: NodeId) -> bool {
    let n = model.node(node);
    let integer = [
        DataType::Int32,
        DataType::Int64,
        DataType::Uint32,
        DataType::Uint64,
    ]
    .map(|t| t as i32);
    n.proto.op_type() == "CumSum"
        && crate::ir::normalize_domain(n.proto.domain()).is_empty()
        && n.inputs
            .first()
            .copied()
            .flatten()
            .and_then(|x| elem_type(model, x))
            .is_some_and(|e| integer.contains(&e))
}

pub fn lower(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    let (x, axis) = (l.input(node, 0)?, l.input(node, 1)?);
    let integer = l.elem_type(x).unwrap_or(DataType::Int64 as i32);
    let exclusive = l.int_attr(node, "exclusive", 0)?;
    let reverse = l.int_attr(node, "reverse", 0)?;
    let wide = l.cast(x, DataType::Double as i32, "cumsum_in_f64");
    let sum = l.op(
        "CumSum",
        &[wide, axis],
        vec![
            attr_int("exclusive", exclusive),
            attr_int("reverse", reverse),
        ],
        "cumsum_f64",
    );
    let y = l.op(
        "Cast",
        &[sum],
        vec![attr_int("to", integer as i64)],
        "cumsum",
    );
    l.replace(node, 0, y);
    Ok(())
}
