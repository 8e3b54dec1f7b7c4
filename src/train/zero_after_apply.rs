//! The apply need not write the zeros that the next window's first micro-step overwrites.
//!
//! The apply specialisation ends a window by setting every accumulator to zero
//! (`ConstantOfShape`): a full write of the gradients' bytes per window, into fresh buffers,
//! and for a small model one node per parameter. When the window-start specialisation
//! exists ([`super::window_start`]), the next micro-step writes the accumulators it does not
//! read: those zeros are never read. [`drop_zeroing`] takes them out of the apply; the
//! trainer then keeps the last window's sums in those buffers and counts them as zero, and
//! writes real zeros only before a run that would read them (an apply right after an apply:
//! K = 1, a flush) and in the state it hands out ([`zero_fill`]).

use std::collections::BTreeSet;

use crate::data::Tensor;
use crate::ir::{BodyId, Model, Use};
use crate::split::Specialised;
use crate::state::{Manifest, Role};

/// The accumulators `start` (the window-start specialisation) writes without reading: they
/// are graph inputs no node reads, and it has their next value as an output.
pub fn written_unread(start: &Specialised, manifest: &Manifest) -> BTreeSet<String> {
    let model = Model::from_proto(start.model.clone());
    let outputs: BTreeSet<&str> = model
        .graph_outputs()
        .into_iter()
        .map(|v| model.name(v))
        .collect();
    manifest
        .state
        .iter()
        .filter(|e| e.role == Role::Accumulator && outputs.contains(e.output.as_str()))
        .filter(|e| match model.lookup(BodyId::MAIN, &e.input) {
            Some(v) => model.uses(v).is_empty(),
            None => true,
        })
        .map(|e| e.input.clone())
        .collect()
}

/// `apply` without the outputs that set the `candidates` accumulators to zero (a
/// `ConstantOfShape` of a zero, or of no value, which is a float zero), dead code removed;
/// and the accumulators so dropped. Others stay as they are.
pub fn drop_zeroing(
    apply: &Specialised,
    manifest: &Manifest,
    candidates: &BTreeSet<String>,
) -> (Specialised, BTreeSet<String>) {
    let mut model = Model::from_proto(apply.model.clone());
    let mut dropped = BTreeSet::new();
    for entry in manifest
        .state
        .iter()
        .filter(|e| e.role == Role::Accumulator && candidates.contains(&e.input))
    {
        let Some(next) = model.lookup(BodyId::MAIN, &entry.output) else {
            continue;
        };
        let Some((node, _)) = model.producer(next) else {
            continue;
        };
        if !is_zeros(&model, node) {
            continue;
        }
        // Its only use: the graph output (a zero read elsewhere keeps it).
        let [Use::Output { body, index }] = model.uses(next)[..] else {
            continue;
        };
        if body != BodyId::MAIN {
            continue;
        }
        model.remove_output(BodyId::MAIN, index);
        dropped.insert(entry.input.clone());
    }
    if dropped.is_empty() {
        return (apply.clone(), dropped);
    }
    crate::passes::dce::eliminate_dead_code(&mut model);
    let mut unchanged = apply.unchanged.clone();
    unchanged.extend(dropped.iter().cloned());
    (
        Specialised {
            model: model.to_proto(),
            unchanged,
        },
        dropped,
    )
}

/// Whether `node` is a standard `ConstantOfShape` whose every element is zero.
fn is_zeros(model: &Model, node: crate::ir::NodeId) -> bool {
    let n = model.node(node);
    if n.proto.op_type() != "ConstantOfShape"
        || !crate::ir::normalize_domain(n.proto.domain()).is_empty()
    {
        return false;
    }
    let Some(value) = n.proto.attribute.iter().find(|a| a.name() == "value") else {
        return true;
    };
    let Some(t) = value.t.as_ref() else {
        return false;
    };
    match Tensor::from_tensor_proto(t) {
        Ok(Tensor::F32(a)) => a.iter().all(|v| *v == 0.0),
        Ok(Tensor::F64(a)) => a.iter().all(|v| *v == 0.0),
        _ => false,
    }
}

/// Sets every element of `t` to zero, in place; `false` for a tensor that is no float.
pub fn zero_fill(t: &mut Tensor) -> bool {
    match t {
        Tensor::F32(a) => a.fill(0.0),
        Tensor::F64(a) => a.fill(0.0),
        _ => return false,
    }
    true
}
