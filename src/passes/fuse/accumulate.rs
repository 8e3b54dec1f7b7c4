//! The window's gradient sum, `acc' = Add(acc, d)` for each accumulator as grad-accum writes
//! it, as one [`AccumulateGrad`](crate::fused_ops::ACCUMULATE_GRAD) node: the same sum
//! (bit-identical), but a kernel that can write into `acc`'s own buffer ([`super::in_place`]),
//! where `Add` always writes a fresh one.
//!
//! Matched: an accumulator's next value made by `Add` of the accumulator itself and a
//! gradient of its exact shape (either operand order: float addition commutes), the
//! accumulator read by nothing else, whatever its size. A small one too: left a standard
//! `Add`, it is a fresh buffer every run, which the session's kept binding binds again as
//! the next run's input (~2.5 µs a `BindInput` at two threads) beside the `Add`'s own
//! dispatch, more than the kernel's dispatch in place (the MLP's four small accumulators
//! at B 8, two threads, and the GPT's at B 4: their accumulating micro-steps 2-3% faster
//! fused; benches/README.md, "Run AK"). A session is in place in ONNX Runtime only at 1 Mi
//! elements or more (`in_place::MIN_SESSION_ELEMENTS`); below, the host adds them
//! ([`super::host`]).

use super::{accumulators, static_float32_shape, PASS};
use crate::fused_ops::{accumulate_slot, ACCUMULATE_GRAD, DOMAIN};
use crate::ir::builder::Builder;
use crate::ir::{BodyId, Model, ValueId};
use crate::state::Manifest;

/// Fuses every accumulation of the main graph; returns how many.
pub fn fuse_accumulate(model: &mut Model, manifest: &Manifest) -> usize {
    let mut fused = 0;
    for (acc, next) in accumulators(model, manifest) {
        let Some(grad) = matched(model, acc, next) else {
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
fn matched(model: &Model, acc: ValueId, next: ValueId) -> Option<ValueId> {
    let (_, grad) = super::accumulation(model, (acc, next))?;
    // An undeclared gradient is taken: grad-accum adds each parameter's gradient, of the
    // parameter's shape, and the kernel checks the sizes (an error, never a broadcast).
    let acc_shape = static_float32_shape(model, acc);
    let grad_ok =
        model.value_type(grad).is_none() || static_float32_shape(model, grad) == acc_shape;
    grad_ok.then_some(grad)
}
