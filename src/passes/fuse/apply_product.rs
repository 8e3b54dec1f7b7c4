//! An apply's own weight gradient made inside its optimizer update: a fused
//! [`AdamWUpdate`](crate::fused_ops::ADAMW_UPDATE) or [`SgdUpdate`](crate::fused_ops::SGD_UPDATE)
//! whose addend (the applying micro-step's gradient, added to the window's sum) is a
//! product `Aᵀ·B`, read by that node alone, takes `A` and `B` instead (its `ADDEND_A` and
//! `ADDEND_B` inputs) and the node making the product goes.
//!
//! Why: the standard ops write that gradient (a weight's size) and the update reads it back
//! beside the accumulator. With the small `k` of a micro-batch, each of the update's tasks
//! makes its rows of the product as it updates them (`engine::ort_ops`), so the gradient is
//! neither written nor read from memory: two passes over the weight's bytes fewer per
//! apply. The product's chains and the addition are the standard ops' (`fused_ops::product`),
//! so the bits are too; where `k` is past the kernel's, ONNX Runtime's `Gemm` makes it as
//! before.
//!
//! Matched: an update of the main graph with its `GRAD_ADDEND` given and read by nothing
//! else, the parameter of a declared static float32 shape of rank 2, and the addend made by
//! one of the product forms [`super::accumulate_product`] takes (a `Gemm` with `transA = 1`,
//! `MatMul(Transpose(A), B)`, `Transpose(Gemm(P, Q))`), neither operand one of the update's
//! own inputs.

use super::accumulate_product::product_operands;
use super::{float32_or_unknown, input, static_float32_shape};
use crate::fused_ops::{adamw_slot, sgd_slot, ADAMW_UPDATE, DOMAIN, SGD_UPDATE};
use crate::ir::{normalize_domain, BodyId, Model, NodeId, Use};

/// Gives every matched update its addend's operands; returns how many.
pub fn fuse_apply_products(model: &mut Model) -> usize {
    let mut shapes = None;
    let updates: Vec<(NodeId, [usize; 3])> = model
        .all_nodes()
        .filter_map(|n| Some((n, addend_slots(model, n)?)))
        .collect();
    let mut fused = 0;
    for (node, [addend_slot, a_slot, b_slot]) in updates {
        let Some(addend) = input(model, node, addend_slot) else {
            continue;
        };
        let only_here = matches!(model.uses(addend),
            [Use::Node { node: n, slot }] if *n == node && *slot == addend_slot);
        let param = input(model, node, 0);
        let matrix = param
            .and_then(|p| static_float32_shape(model, p))
            .is_some_and(|dims| dims.len() == 2);
        if !only_here || !matrix {
            continue;
        }
        let Some((a, b)) = product_operands(model, &mut shapes, addend) else {
            continue;
        };
        // An operand the update also reads as a state (a weight in its own gradient's
        // product) would be read by its tasks while they write it in place.
        let own_input = |v| model.node(node).inputs.contains(&Some(v));
        let float32 = float32_or_unknown(model, a) && float32_or_unknown(model, b);
        if !float32 || own_input(a) || own_input(b) {
            continue;
        }
        model.set_input(node, addend_slot, None);
        model.set_input_growing(node, a_slot, a);
        model.set_input_growing(node, b_slot, b);
        fused += 1;
    }
    fused
}

/// `[GRAD_ADDEND, ADDEND_A, ADDEND_B]` of a fused update of the main graph.
fn addend_slots(model: &Model, n: NodeId) -> Option<[usize; 3]> {
    let node = model.node(n);
    let ours = normalize_domain(node.proto.domain()) == DOMAIN && node.body == BodyId::MAIN;
    match node.proto.op_type() {
        ADAMW_UPDATE if ours => Some([
            adamw_slot::GRAD_ADDEND,
            adamw_slot::ADDEND_A,
            adamw_slot::ADDEND_B,
        ]),
        SGD_UPDATE if ours => Some([
            sgd_slot::GRAD_ADDEND,
            sgd_slot::ADDEND_A,
            sgd_slot::ADDEND_B,
        ]),
        _ => None,
    }
}
