//! A weight gradient made inside its accumulator: `acc' = Add(acc, Aᵀ·B)` as one
//! [`AccumulateProduct`](crate::fused_ops::ACCUMULATE_PRODUCT) node, which at a small
//! micro-batch adds the product into `acc`'s own buffer without writing the gradient, and
//! otherwise has ONNX Runtime's `Gemm` make it and adds it: the standard ops' bits either
//! way (`fused_ops::product`).
//!
//! The node names its accumulator (the state input) in its `accumulator` attribute, under
//! which a trainer may keep its products until the window needs them
//! (`engine::deferred_products`).
//!
//! In the window-start specialisation (`train::window_start`) the accumulator is not read:
//! its next value is the product itself, `acc' = Aᵀ·B`. That product becomes the same node
//! with `overwrites = 1` (its accumulator input given, for the in-place plan, and not read),
//! so that a trainer may keep a window's first weight gradient too: matched for an
//! accumulator read by nothing, of a declared static float32 shape, whose next value is
//! made by one of the forms below and read by nothing but the graph's output.
//!
//! Matched, for an accumulator read only by that `Add` (either operand order) and of a
//! declared static float32 shape, the gradient read by nothing else and made by
//!
//! - `Gemm(A, B)` with `transA = 1`, `transB = 0`, `alpha = 1` and no C (the weight gradient
//!   our autodiff writes for `Gemm`, and PyTorch's `Linear`),
//! - `MatMul(Transpose(A), B)`, `A` and `B` of rank 2 as declared or derived
//!   (`autodiff::shapes`), the transpose's `perm` absent or `[1, 0]` (a rank-2 `MatMul`'s
//!   weight gradient), or
//! - `Transpose(Gemm(P, Q))`, the `Gemm` as above and read only there, its `perm` absent or
//!   `[1, 0]`: `Qᵀ·P` (the weight gradient of `MatMul(X, Wᵀ)` as PyTorch exports a
//!   transposed weight, the GPT's). The products are the same numbers, the chains the same
//!   order; with large `k` ONNX Runtime's `Gemm` then runs with its operands swapped, whose
//!   K blocking does not depend on M and N (measured equal at `k` 200-1000, 1 and 2
//!   threads).

use super::{accumulators, float32_or_unknown, input, static_float32_shape, PASS};
use crate::fused_ops::{
    accumulate_product_slot, ACCUMULATE_PRODUCT, DOMAIN, PRODUCT_ACCUMULATOR, PRODUCT_OVERWRITES,
};
use crate::ir::builder::{attr_int, attr_string, Builder};
use crate::ir::{normalize_domain, BodyId, Model, NodeId, Use, ValueId};
use crate::passes::autodiff::shapes::Shapes;

/// Fuses every matched accumulation of the main graph; returns how many.
pub fn fuse_accumulate_products(model: &mut Model, manifest: &crate::state::Manifest) -> usize {
    let mut fused = 0;
    // Ranks are derived only when a `MatMul` form asks for them, once.
    let mut shapes = None;
    for (acc, next) in accumulators(model, manifest) {
        let (a, b, overwrites) = match matched(model, &mut shapes, (acc, next)) {
            Some((a, b)) => (a, b, false),
            None => match first_product(model, &mut shapes, (acc, next)) {
                Some((a, b)) => (a, b, true),
                None => continue,
            },
        };
        let mut inputs = vec![None; accumulate_product_slot::COUNT];
        inputs[accumulate_product_slot::ACC] = Some(acc);
        inputs[accumulate_product_slot::A] = Some(a);
        inputs[accumulate_product_slot::B] = Some(b);
        let mut attributes = vec![attr_string(PRODUCT_ACCUMULATOR, model.name(acc))];
        if overwrites {
            attributes.push(attr_int(PRODUCT_OVERWRITES, 1));
        }
        let hint = format!("{}.fused", model.name(next));
        let product = format!("{}.product", model.name(next));
        let node = Builder::new(model, BodyId::MAIN, PASS).node(
            ACCUMULATE_PRODUCT,
            DOMAIN,
            &inputs,
            &[&hint, &product],
            attributes,
        );
        let new = model.output(node, 0);
        model.replace_value(next, new);
        fused += 1;
    }
    fused
}

/// `(A, B)` when `next = Add(acc, Aᵀ·B)` ([`super::accumulation`]) as the module's comment
/// says, the product read only there.
fn matched(
    model: &Model,
    shapes: &mut Option<Shapes>,
    (acc, next): (ValueId, ValueId),
) -> Option<(ValueId, ValueId)> {
    let (add, gradient) = super::accumulation(model, (acc, next))?;
    if !matches!(model.uses(gradient), [Use::Node { node, .. }] if *node == add) {
        return None;
    }
    let (a, b) = product_operands(model, shapes, gradient)?;
    (float32_or_unknown(model, a) && float32_or_unknown(model, b)).then_some((a, b))
}

/// `(A, B)` when `next = Aᵀ·B` is a window start's accumulator value as the module's
/// comment says: `acc` read by nothing, `next` by nothing but the graph's output.
fn first_product(
    model: &Model,
    shapes: &mut Option<Shapes>,
    (acc, next): (ValueId, ValueId),
) -> Option<(ValueId, ValueId)> {
    let unread = model.uses(acc).is_empty() && static_float32_shape(model, acc).is_some();
    let only_output =
        matches!(model.uses(next), [Use::Output { body, .. }] if *body == BodyId::MAIN);
    if !unread || !only_output {
        return None;
    }
    let (a, b) = product_operands(model, shapes, next)?;
    (float32_or_unknown(model, a) && float32_or_unknown(model, b)).then_some((a, b))
}

/// `(A, B)` when `v = Aᵀ·B` by one of the forms of the module's comment.
pub(super) fn product_operands(
    model: &Model,
    shapes: &mut Option<Shapes>,
    v: ValueId,
) -> Option<(ValueId, ValueId)> {
    let (n, _) = model.producer(v)?;
    if let Some(operands) = gemm_operands(model, n) {
        return Some(operands);
    }
    let transposed_input = |n: NodeId| {
        let perm_ok = model
            .node(n)
            .proto
            .attribute
            .iter()
            .all(|attr| attr.name() == "perm" && attr.ints == [1, 0]);
        (standard(model, n, "Transpose", 1, 1) && perm_ok).then(|| input(model, n, 0))?
    };
    // (Pᵀ·Q)ᵀ = Qᵀ·P, the Gemm read by nothing else.
    if let Some(g) = transposed_input(n) {
        let (gemm, _) = model.producer(g)?;
        let (p, q) = gemm_operands(model, gemm)?;
        let only_transposed = matches!(model.uses(g), [Use::Node { node, .. }] if *node == n);
        return only_transposed.then_some((q, p));
    }
    if !standard(model, n, "MatMul", 2, 2) || !model.node(n).proto.attribute.is_empty() {
        return None;
    }
    let (transposed, b) = (input(model, n, 0)?, input(model, n, 1)?);
    let a = transposed_input(model.producer(transposed)?.0)?;
    let shapes = shapes.get_or_insert_with(|| Shapes::infer(model));
    let rank_two = |v: ValueId| shapes.get(v).rank() == Some(2);
    (rank_two(a) && rank_two(b)).then_some((a, b))
}

/// `(A, B)` of `Gemm(A, B)` when `n` is one that computes `Aᵀ·B`.
fn gemm_operands(model: &Model, n: NodeId) -> Option<(ValueId, ValueId)> {
    // A Gemm's C may be named empty (absent).
    let no_c = model.node(n).inputs.get(2).is_none_or(Option::is_none);
    let gemm = standard(model, n, "Gemm", 2, 3) && no_c && gemm_is_transposed_a_product(model, n);
    gemm.then(|| Some((input(model, n, 0)?, input(model, n, 1)?)))?
}

/// `Gemm` with `transA = 1`, and `transB`, `alpha` and `beta` (the last unread without C)
/// at most at their defaults otherwise.
fn gemm_is_transposed_a_product(model: &Model, n: NodeId) -> bool {
    let mut trans_a = false;
    for attr in &model.node(n).proto.attribute {
        let ok = match attr.name() {
            "transA" => {
                trans_a = attr.i() == 1;
                trans_a
            }
            "transB" => attr.i() == 0,
            "alpha" => attr.f() == 1.0,
            "beta" => true,
            _ => false,
        };
        if !ok {
            return false;
        }
    }
    trans_a
}

/// A standard-domain node of `op` in the main graph whose first `given` inputs are given,
/// with at most `slots` inputs, and one output (attributes are checked by the caller).
fn standard(model: &Model, n: NodeId, op: &str, given: usize, slots: usize) -> bool {
    let node = model.node(n);
    node.proto.op_type() == op
        && normalize_domain(node.proto.domain()).is_empty()
        && node.body == BodyId::MAIN
        && (given..=slots).contains(&node.inputs.len())
        && node.inputs[..given].iter().all(Option::is_some)
        && node.outputs.len() == 1
}
