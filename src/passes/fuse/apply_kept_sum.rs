//! An apply's optimizer update that may make its window's gradient sum itself: each fused
//! [`AdamWUpdate`](crate::fused_ops::ADAMW_UPDATE) or [`SgdUpdate`](crate::fused_ops::SGD_UPDATE)
//! whose gradient is an accumulator, read by that node alone, is told which accumulator it
//! reads (its `accumulator` attribute, [`PRODUCT_ACCUMULATOR`]).
//!
//! Why: a trainer that keeps a window's weight gradients as their operands
//! (`engine::deferred_products`) had its last accumulating micro-step add them all into the
//! accumulator, which the apply then read back. With the attribute, that micro-step keeps
//! its product too and the apply's kernel adds the kept products to the accumulator's rows
//! as it reads them, in the order the standard ops add them: the accumulator is neither
//! written by the micro-step before the apply nor read from memory by the apply.
//!
//! Matched only where nothing else reads the accumulator: adaptive gradient clipping and
//! loss scaling read the window's gradient whole (its norms, its finiteness) before the
//! update, and a sum instead of the mean or Adam's L2 decay add to it first, so there the
//! sum is made before the apply, as before.

use crate::fused_ops::{
    adamw_slot, sgd_slot, ADAMW_UPDATE, DOMAIN, PRODUCT_ACCUMULATOR, SGD_UPDATE,
};
use crate::ir::builder::attr_string;
use crate::ir::{normalize_domain, BodyId, Model, Use};

/// Names the accumulator of every matched update; returns how many.
pub fn name_kept_sums(model: &mut Model, manifest: &crate::state::Manifest) -> usize {
    let mut named = 0;
    for entry in manifest
        .state
        .iter()
        .filter(|e| e.role == crate::state::Role::Accumulator)
    {
        let Some(acc) = model.lookup(BodyId::MAIN, &entry.input) else {
            continue;
        };
        // A weight's gradient: the kept products' accumulators are two-dimensional.
        let matrix = super::static_float32_shape(model, acc).is_some_and(|dims| dims.len() == 2);
        let (node, slot) = match model.uses(acc) {
            [Use::Node { node, slot }] => (*node, *slot),
            _ => continue,
        };
        let proto = &model.node(node).proto;
        let gradient_of_update = match proto.op_type() {
            ADAMW_UPDATE => slot == adamw_slot::GRAD,
            SGD_UPDATE => slot == sgd_slot::GRAD,
            _ => false,
        };
        let update = gradient_of_update
            && normalize_domain(proto.domain()) == DOMAIN
            && model.node(node).body == BodyId::MAIN;
        if !matrix || !update {
            continue;
        }
        let attributes = &mut model.node_mut(node).proto.attribute;
        attributes.retain(|a| a.name() != PRODUCT_ACCUMULATOR);
        attributes.push(attr_string(PRODUCT_ACCUMULATOR, &entry.input));
        named += 1;
    }
    named
}
