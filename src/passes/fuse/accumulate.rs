//! The window's gradient sum, `acc' = Add(acc, d)` for each accumulator as grad-accum writes
//! it, as one [`AccumulateGrad`](crate::fused_ops::ACCUMULATE_GRAD) node: the same sum
//! (bit-identical), but a kernel that can write into `acc`'s own buffer ([`super::in_place`]),
//! where `Add` always writes a fresh one.
//!
//! Matched: an accumulator's next value made by `Add` of the accumulator itself and a
//! gradient of its exact shape (either operand order: float addition commutes), the
//! accumulator read by nothing else, of at least the elements the caller asks for
//! ([`MIN_ELEMENTS`] in the trainer).

use super::{accumulators, static_float32_shape, PASS};
use crate::fused_ops::{accumulate_slot, ACCUMULATE_GRAD, DOMAIN};
use crate::ir::builder::Builder;
use crate::ir::{BodyId, Model, ValueId};
use crate::state::Manifest;

/// The smallest accumulator fused, and the smallest the window start writes in place (a
/// binding of its own costs a run more than it saves there). Below it the standard `Add` is
/// faster: ONNX Runtime dispatches a custom kernel in ~4.5 µs (its inputs and outputs are
/// wrapped and queried through the C API) against ~1 µs for its own `Add`, and in place
/// saves nothing worth that at 64 KiB (the ResNet-8 BN's 29 accumulators, 78 K parameters:
/// 0.131 ms per micro-step as kernels, ORT's profiler).
pub const MIN_ELEMENTS: i64 = 16384;

/// Fuses every accumulation of the main graph of `min_elements` or more; returns how many.
pub fn fuse_accumulate(model: &mut Model, manifest: &Manifest, min_elements: i64) -> usize {
    let mut fused = 0;
    for (acc, next) in accumulators(model, manifest) {
        let Some(grad) = matched(model, acc, next, min_elements) else {
            continue;
        };
        let mut inputs = vec![None; accumulate_slot::COUNT];
        inputs[accumulate_slot::ACC] = Some(acc);
        inputs[accumulate_slot::GRAD] = Some(grad);
        let hint = format!("{}.fused", model.name(next));
        let node = Builder::new(model, BodyId::MAIN, PASS).node(
            ACCUMULATE_GRAD,
            DOMAIN,
            &inputs,
            &[&hint],
            Vec::new(),
        );
        let new = model.output(node, 0);
        model.replace_value(next, new);
        fused += 1;
    }
    fused
}

/// The gradient `d` of the window's sum `next = Add(acc, d)` ([`super::accumulation`]), `d`
/// of `acc`'s declared static float32 shape (or undeclared).
fn matched(model: &Model, acc: ValueId, next: ValueId, min_elements: i64) -> Option<ValueId> {
    let (_, grad) = super::accumulation(model, (acc, next), min_elements)?;
    // An undeclared gradient is taken: grad-accum adds each parameter's gradient, of the
    // parameter's shape, and the kernel checks the sizes (an error, never a broadcast).
    let acc_shape = static_float32_shape(model, acc);
    let grad_ok =
        model.value_type(grad).is_none() || static_float32_shape(model, grad) == acc_shape;
    grad_ok.then_some(grad)
}
