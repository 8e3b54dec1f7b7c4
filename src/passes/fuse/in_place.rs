//! In-place state updates: which of a session's state outputs the engine may write into
//! the buffer of the state's own input, so that a micro-step reads and writes each state
//! once instead of reading one buffer and writing a fresh one. ONNX Runtime never writes
//! into a graph input by itself; the session binds such an output to the input's buffer
//! (`engine::ort::OrtSession::run_held`), as ONNX Runtime's training API updates its
//! gradients and optimizer state in place.
//!
//! Why: on the 1.9M-parameter MLP the value semantics cost a second buffer per state, and the
//! working set (parameters, gradients, old and new accumulators) no longer fits the 32 MiB
//! L3 between runs (benches/README.md, "In-place updates").
//!
//! A pair (state input s, its next value s') is updated in place when either
//!
//! - s' is an output of one of onnx-ga's fused kernels ([`crate::fused_ops`]) that reads s at
//!   the matching slot, every other reader of s is an ancestor of that kernel (so it has read
//!   s before the kernel writes), and the kernel has the gate ([`gate`]): a micro-step the
//!   host discards (a non-finite loss under `OnNonFinite::Stop`/`Skip`) leaves s untouched,
//!   with nothing to put back. All of a kernel's states go in place, or none of them.
//! - s is an accumulator the session does not read at all (the window-start specialisation,
//!   which writes the window's first gradient over whatever the buffer held), when the
//!   caller says so: a discarded window start leaves the step counter at the window's start,
//!   where the accumulators are never read.
//!
//! In both, s' leaves the graph once, s is not itself an output, and both have one static
//! shape.

use std::collections::BTreeSet;

use crate::fused_ops::{
    accumulate_slot, adamw_slot, sgd_slot, ACCUMULATE_GRAD, ADAMW_UPDATE, DOMAIN, KEEP_NONFINITE,
    SGD_UPDATE,
};
use crate::ir::builder::{tensor_bool, Builder};
use crate::ir::{tensor_type, BodyId, Model, NodeId, Use, ValueId};
use crate::proto::{elem, DeclaredDim};
use crate::state::{Manifest, Role};

use super::PASS;

/// The states of one session updated in place, by the names of their input and output.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InPlacePlan {
    pub pairs: Vec<(String, String)>,
    /// The gate's input ([`KEEP_NONFINITE`] or a fresh name derived from it), when the
    /// session has one: the host feeds it each run.
    pub keep_input: Option<String>,
}

/// For one fused operator: its (state input slot, output slot) pairs and its gate's slot.
fn state_slots(op: &str, inputs: usize) -> Option<(Vec<(usize, usize)>, usize)> {
    match op {
        ADAMW_UPDATE => Some((
            vec![
                (adamw_slot::PARAM, 0),
                (adamw_slot::M, 1),
                (adamw_slot::V, 2),
            ],
            adamw_slot::KEEP,
        )),
        SGD_UPDATE => {
            let mut pairs = vec![(sgd_slot::PARAM, 0)];
            if inputs > sgd_slot::BUF {
                pairs.push((sgd_slot::BUF, 1));
            }
            Some((pairs, sgd_slot::KEEP))
        }
        ACCUMULATE_GRAD => Some((vec![(accumulate_slot::ACC, 0)], accumulate_slot::KEEP)),
        _ => None,
    }
}

/// The fused nodes of the main graph.
fn fused_nodes(model: &Model) -> Vec<NodeId> {
    model
        .body_nodes(BodyId::MAIN)
        .filter(|&n| {
            let p = &model.node(n).proto;
            p.domain() == DOMAIN && state_slots(p.op_type(), 0).is_some()
        })
        .collect()
}

/// Gives every fused node of the main graph the gate `keep = Or(loss is finite, k)`, `k` a
/// new bool input (default true: a host that does not feed it keeps every update). Returns
/// `k`'s name; `None` (and nothing changed) when there is no fused node or no loss output.
pub fn gate(model: &mut Model, manifest: &Manifest) -> Option<String> {
    let nodes = fused_nodes(model);
    let loss = model.lookup(BodyId::MAIN, &manifest.loss)?;
    if nodes.is_empty() {
        return None;
    }
    let k = model.add_input(
        BodyId::MAIN,
        KEEP_NONFINITE,
        tensor_type(elem::BOOL, &[]),
        Some(tensor_bool(&[], &[true])),
    );
    let mut b = Builder::new(model, BodyId::MAIN, PASS);
    // ONNX has no IsFinite: finite = Not(Or(IsNaN, IsInf)).
    let nan = b.op("IsNaN", &[loss], vec![], "ga.loss_nan");
    let inf = b.op("IsInf", &[loss], vec![], "ga.loss_inf");
    let bad = b.op("Or", &[nan, inf], vec![], "ga.loss_not_finite");
    let finite = b.op("Not", &[bad], vec![], "ga.loss_finite");
    let keep = b.op("Or", &[finite, k], vec![], "ga.keep");
    for n in nodes {
        let op = model.node(n).proto.op_type().to_string();
        if let Some((_, slot)) = state_slots(&op, model.node(n).inputs.len()) {
            model.set_input_growing(n, slot, keep);
        }
    }
    Some(model.name(k).to_string())
}

/// The pairs of `model` (a session of the step `manifest` describes) to update in place;
/// `unread_accumulators`: whether accumulators the session does not read go in place too
/// (only for the window-start specialisation: see the module's comment).
pub fn plan(
    model: &Model,
    manifest: &Manifest,
    keep_input: Option<String>,
    unread_accumulators: bool,
) -> InPlacePlan {
    let outputs = model.graph_outputs();
    let leaves_once = |v: ValueId| outputs.iter().filter(|&&o| o == v).count() == 1;
    let is_output = |v: ValueId| outputs.contains(&v);
    let mut pairs = Vec::new();
    for n in fused_nodes(model) {
        let node = model.node(n);
        let Some((slots, keep_slot)) = state_slots(node.proto.op_type(), node.inputs.len()) else {
            continue;
        };
        if node.inputs.get(keep_slot).copied().flatten().is_none() {
            continue;
        }
        let ancestors = ancestors(model, n);
        let mut kernel_pairs = Vec::new();
        for (in_slot, out_slot) in slots {
            let (Some(s), Some(Some(next))) =
                (node.inputs[in_slot], node.outputs.get(out_slot).copied())
            else {
                break;
            };
            let pair = manifest
                .state
                .iter()
                .find(|e| e.input == model.name(s) && e.output == model.name(next));
            let readers_done = model.uses(s).iter().all(|u| match u {
                Use::Node { node: r, slot } => {
                    (*r == n && *slot == in_slot) || ancestors.contains(r)
                }
                Use::Output { .. } => false,
            });
            if pair.is_none()
                || !model.graph_inputs().contains(&s)
                || !leaves_once(next)
                || !readers_done
                || !same_static_shape(model, s, next)
            {
                break;
            }
            kernel_pairs.push((model.name(s).to_string(), model.name(next).to_string()));
        }
        if kernel_pairs.len()
            == state_slots(node.proto.op_type(), node.inputs.len()).map_or(0, |(s, _)| s.len())
        {
            pairs.extend(kernel_pairs);
        }
    }
    if unread_accumulators {
        for e in manifest
            .state
            .iter()
            .filter(|e| e.role == Role::Accumulator)
        {
            let (Some(s), Some(next)) = (
                model.lookup(BodyId::MAIN, &e.input),
                model.lookup(BodyId::MAIN, &e.output),
            ) else {
                continue;
            };
            let unread = model.uses(s).is_empty();
            let made_here = model.producer(next).is_some();
            if unread
                && made_here
                && leaves_once(next)
                && !is_output(s)
                && same_static_shape(model, s, next)
            {
                pairs.push((e.input.clone(), e.output.clone()));
            }
        }
    }
    InPlacePlan { pairs, keep_input }
}

/// Every main-graph node whose output `n` reads, directly or not. A node with a subgraph
/// is not looked into: what its body reads is left out (a reader there is then not an
/// ancestor, which only makes the plan leave a pair out).
fn ancestors(model: &Model, n: NodeId) -> BTreeSet<NodeId> {
    let mut seen = BTreeSet::new();
    let mut stack = vec![n];
    while let Some(m) = stack.pop() {
        for v in model.node(m).inputs.iter().flatten() {
            if let Some((p, _)) = model.producer(*v) {
                if model.node(p).body == BodyId::MAIN && seen.insert(p) {
                    stack.push(p);
                }
            }
        }
    }
    seen
}

/// Both declared float32 with the same fully known shape.
fn same_static_shape(model: &Model, a: ValueId, b: ValueId) -> bool {
    let shape = |v: ValueId| {
        let ty = model.value_type(v)?;
        if ty.tensor_elem()? != elem::FLOAT {
            return None;
        }
        let dims = ty.tensor_dims()?;
        dims.iter()
            .map(|d| match d {
                DeclaredDim::Known(k) => Some(*k),
                _ => None,
            })
            .collect::<Option<Vec<i64>>>()
    };
    matches!((shape(a), shape(b)), (Some(x), Some(y)) if x == y)
}
