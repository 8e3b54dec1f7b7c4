//! A third specialisation of a split step, for the first micro-step of a window.
//!
//! After an apply (and at the start of training) every accumulator is zero, so the first
//! micro-step of a window need not read it: `acc' = acc + g` is `g`. The accumulate
//! specialisation reads and adds anyway, one full pass over two gradient-sized buffers and a
//! write of a third. This one writes the gradient itself as the accumulator's next value:
//!
//! - `Add(acc, g)` (either order): the node goes; `g`'s producer writes the output's name
//!   directly (an `Identity` where `g` has no producer of its own to rename);
//! - `Gemm(A, B, acc)` with `beta = 1` (the accumulation folded into the weight gradient's
//!   Gemm by `grad-accum`): the `C` input goes, so the Gemm writes `alpha A B` alone.
//!
//! Any other use of an accumulator leaves that accumulator read as before. The accumulator
//! stays a graph input (fed, unread), so the host feeds the same values to every
//! specialisation. Exact: `0 + g` is `g` (up to the sign of a zero gradient).
//!
//! On ONNX Runtime's CPU a weight gradient written so becomes an `AccumulateProduct` that
//! overwrites (`passes::fuse::accumulate_product`), which a trainer may keep until the
//! window's sum (`engine::deferred_products`).

use crate::ir::builder::NodeAttributes;
use crate::ir::{BodyId, Model, NodeId, NodeSpec, Use, ValueDef, ValueId};
use crate::split::Specialised;
use crate::state::Manifest;
use crate::state::Role;

/// The accumulate specialisation without its reads of the (zero) accumulators; `None` when
/// no accumulator is read in a way this can drop.
pub fn window_start(accumulate: &Specialised, manifest: &Manifest) -> Option<Specialised> {
    let mut model = Model::from_proto(accumulate.model.clone());
    let mut changed = 0;
    for entry in manifest
        .state
        .iter()
        .filter(|e| e.role == Role::Accumulator)
    {
        let Some(acc) = model.lookup(BodyId::MAIN, &entry.input) else {
            continue;
        };
        if drop_read(&mut model, acc) {
            changed += 1;
        }
    }
    (changed > 0).then(|| Specialised {
        model: model.to_proto(),
        unchanged: accumulate.unchanged.clone(),
    })
}

/// Drops the one read of `acc`, if it is one this knows: a node of the main graph reading
/// it once, nothing else reading it (no other node, no subgraph).
fn drop_read(model: &mut Model, acc: ValueId) -> bool {
    let in_main = |model: &Model, u: &Use| match *u {
        Use::Node { node, .. } => model.node(node).body == BodyId::MAIN,
        Use::Output { body, .. } => body == BodyId::MAIN,
    };
    let uses = model.uses(acc);
    if uses.iter().any(|u| !in_main(model, u)) {
        return false;
    }
    let readers: Vec<(NodeId, usize)> = uses
        .iter()
        .filter_map(|u| match *u {
            Use::Node { node, slot } => Some((node, slot)),
            Use::Output { .. } => None,
        })
        .collect();
    let [(node, slot)] = readers[..] else {
        return false;
    };
    let n = model.node(node);
    if n.outputs.len() != 1 {
        return false;
    }
    let Some(out) = n.outputs[0] else {
        return false;
    };
    let standard = crate::ir::normalize_domain(n.proto.domain()).is_empty();
    match n.proto.op_type() {
        "Add" if standard && n.inputs.len() == 2 => {
            let Some(other) = n.inputs[1 - slot] else {
                return false;
            };
            let at = model.main().nodes.iter().position(|m| *m == node);
            let carrier = other_carrier(model, other, out, at);
            model.replace_value(out, carrier);
            model
                .remove_node(node)
                .expect("the Add's output was handed on");
            true
        }
        "Gemm" if standard && n.inputs.len() == 3 && slot == 2 => {
            // A beta of another type is not 1 either.
            let beta = n.proto.attr_float("beta").map(|b| b.unwrap_or(1.0));
            if beta != Ok(1.0) {
                return false;
            }
            model.set_input(node, 2, None);
            model.node_mut(node).inputs.truncate(2);
            true
        }
        _ => false,
    }
}

/// The value that takes the place of `out` (the dropped `Add`'s output): `value` itself
/// when a node of the main graph computes it and it is not a graph output already (it then
/// takes `out`'s name), else an `Identity` of it, placed where the `Add` was (`at`).
fn other_carrier(model: &mut Model, value: ValueId, out: ValueId, at: Option<usize>) -> ValueId {
    let produced = matches!(model.value(value).def, ValueDef::Node { .. });
    let is_output = model
        .uses(value)
        .iter()
        .any(|u| matches!(u, Use::Output { .. }));
    if produced && !is_output {
        return value;
    }
    let hint = format!("{}.first", model.name(out));
    let identity = model.add_node(
        BodyId::MAIN,
        NodeSpec {
            op_type: "Identity",
            domain: "",
            inputs: &[Some(value)],
            output_hints: &[&hint],
            attributes: Vec::new(),
            name_hint: Some(&hint),
            pass: None,
        },
    );
    // At the Add's place in the node list, so the export keeps its order.
    if let Some(at) = at {
        let nodes = &mut model.body_mut(BodyId::MAIN).nodes;
        let id = nodes.pop().expect("the Identity was just added");
        nodes.insert(at, id);
    }
    model.output(identity, 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every accumulator of the shipped MLP's step is read once, by its `Add`; the first
    /// micro-step's graph reads none and writes each gradient as the accumulator's output.
    #[test]
    fn the_first_micro_step_reads_no_accumulator() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("graphs/mlp_ce_adamw");
        let graph = crate::signature::open(&dir, &Default::default()).unwrap();
        let step = crate::step::build_step(
            graph,
            "grad-accum(steps=4),optimizer(lr=0.01),legalize-ort,dce",
            false,
        )
        .unwrap();
        let model = step.model.to_proto();
        let manifest = Manifest::from_model(&model).unwrap();
        let split = crate::split::split_step(&model, &manifest)
            .unwrap()
            .unwrap();
        let start = window_start(&split.accumulate, &manifest).unwrap();
        assert_eq!(start.unchanged, split.accumulate.unchanged);
        let g = start.model.graph.as_ref().unwrap();
        let accumulators: Vec<_> = manifest
            .state
            .iter()
            .filter(|e| e.role == Role::Accumulator)
            .collect();
        assert_eq!(accumulators.len(), 4);
        for e in accumulators {
            assert!(
                !g.node.iter().any(|n| n.input.contains(&e.input)),
                "{} is still read",
                e.input
            );
            assert!(g.output.iter().any(|o| o.name() == e.output));
            // Still an input: the host feeds every specialisation the same state.
            assert!(g.input.iter().any(|i| i.name() == e.input));
        }
        let reads =
            |g: &crate::proto::GraphProto| g.node.iter().filter(|n| n.op_type() == "Add").count();
        let accumulate = split.accumulate.model.graph.as_ref().unwrap();
        assert_eq!(
            reads(accumulate) - reads(g),
            4,
            "one Add fewer per parameter"
        );
    }
}
