//! Optimizer updates and accumulations the host runs after the session, in place on the
//! trainer's state.
//!
//! A session whose every in-place state ([`super::in_place`]) is a parameter or moment of a
//! fused `AdamWUpdate` or `SgdUpdate`, or an accumulator of an `AccumulateGrad`, and small
//! ([`MAX_ELEMENTS`]), gives those nodes to the host: they leave the model, whatever they
//! read that the session computes (the gradient) becomes an output of it, and after the run
//! the engine computes the update with the same kernel (`engine::host_updates`,
//! [`crate::fused_ops`]), writing into the state's own buffer.
//!
//! Why: at small sizes the update costs its dispatch, not its arithmetic. In ONNX Runtime a
//! fused node reads every operand through the C API, allocates its outputs, and the run
//! hands each new state back to be wrapped, and the old one released: at 8K parameters the
//! applying micro-step cost 1.8x the floor, of which the arithmetic is a fifth
//! (benches/README.md, "Run U"). On the host the same update reads its operands where they
//! already are.
//!
//! The host runs the update after the whole session, so every other reader of a state has
//! read it by then: the ordering inputs the plan added are dropped with the node. The gate
//! ([`super::in_place::gate`]) still decides, from the same operands (the loss, returned
//! anyway, and the host's own `keep` input): a micro-step the host discards leaves the
//! state untouched.

use crate::data::Tensor;
use crate::fused_ops::{
    accumulate_slot, adamw_slot, sgd_slot, ACCUMULATE_GRAD, ADAMW_UPDATE, DOMAIN, SGD_UPDATE,
};
use crate::ir::{BodyId, Model, NodeId, Use, ValueId};

use super::InPlacePlan;

/// The most elements a session's in-place states may hold for the host to update them
/// (1 Mi, as [`super::in_place::MIN_SESSION_ELEMENTS`]: the sessions that would otherwise
/// run apart). Above it the session keeps its kernels, bound in place: there an
/// accumulation runs right after the backward made its gradient, still in cache, where the
/// host's runs after the whole session (the 3.7M-parameter GPT at B 4, one thread: 2.3%
/// slower with its accumulators on the host), and ONNX Runtime's pool parallelises the
/// kernels, where the host runs on one thread (a thread of the host's own beside that
/// pool, which spins after a run, made the 2M-parameter apply 2.8x slower at two threads).
/// Below it, one thread and the floor's own session win (benches/README.md, "Run U").
pub const MAX_ELEMENTS: i64 = 1 << 20;

/// Which kernel a host update runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostOp {
    AdamW,
    Sgd {
        nesterov: bool,
    },
    /// The window's gradient sum, `acc += g`.
    Accumulate,
}

/// Where a host update reads one operand.
#[derive(Clone, Debug, PartialEq)]
pub enum Operand {
    /// A value fixed in the model (an initializer or a `Constant`).
    Constant(Tensor),
    /// An input of the session, fed by the host (or one of the states themselves); its
    /// default when the host feeds none.
    Input {
        name: String,
        default: Option<Tensor>,
    },
    /// A value the session computes, returned as this output.
    Output(String),
}

/// One update for the host: the kernel, its operands by the fused operator's input slots
/// (before the ordering slots), and the states it updates in place, named by their inputs,
/// in the order of its outputs.
#[derive(Clone, Debug, PartialEq)]
pub struct HostUpdate {
    pub op: HostOp,
    pub operands: Vec<Option<Operand>>,
    pub writes: Vec<String>,
}

/// What [`peel`] made of a session.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HostUpdates {
    pub updates: Vec<HostUpdate>,
    /// Outputs added for the host alone: the engine reads them and does not return them.
    pub added_outputs: Vec<String>,
}

/// Takes the fused updates of `plan`'s states out of `model` (as the plan left it: the
/// ordering inputs it added go with the nodes) when every pair of the plan is a state such
/// an update writes; `None` otherwise, when `model` is to be dropped (the caller peels a
/// copy).
pub fn peel(model: &mut Model, plan: &InPlacePlan) -> Option<HostUpdates> {
    if plan.pairs.is_empty() {
        return None;
    }
    // The state (by its input) whose next value `v` is, when the plan puts it in place.
    let state_of = |model: &Model, v: ValueId| {
        let next = model.name(v);
        plan.pairs
            .iter()
            .find(|(_, o)| o == next)
            .map(|(input, _)| input.clone())
    };
    let mut nodes = Vec::new();
    let mut covered = 0;
    for n in model.body_nodes(BodyId::MAIN).collect::<Vec<_>>() {
        let Some((op, state_slots, after)) = kernel_of(model, n) else {
            continue;
        };
        let outputs: Vec<ValueId> = state_slots
            .iter()
            .filter_map(|&(_, out)| model.node(n).outputs.get(out).copied().flatten())
            .collect();
        let writes: Vec<String> = outputs.iter().filter_map(|&o| state_of(model, o)).collect();
        // Each next value only leaves the graph, or orders another update (which goes to
        // the host too, or the whole peel is off): nothing in the session reads it.
        let only_leaves = |o: &ValueId| {
            model.uses(*o).iter().all(|u| match *u {
                Use::Output { .. } => true,
                Use::Node { node, slot } => {
                    kernel_of(model, node).is_some_and(|(_, _, after)| slot >= after)
                }
            })
        };
        if writes.len() != state_slots.len() || !outputs.iter().all(only_leaves) {
            continue;
        }
        covered += writes.len();
        nodes.push((n, op, state_slots, after, writes));
    }
    if covered != plan.pairs.len() {
        return None;
    }
    // Run after the session, the updates need no ordering inputs.
    for &(n, _, _, after, _) in &nodes {
        for slot in after..model.node(n).inputs.len() {
            model.set_input(n, slot, None);
        }
    }
    let mut peeled = HostUpdates::default();
    let outputs = model.graph_outputs();
    for (n, op, state_slots, after, writes) in nodes {
        let inputs: Vec<Option<ValueId>> = model.node(n).inputs.clone();
        let mut operands = Vec::with_capacity(after);
        for v in inputs.iter().take(after) {
            operands.push(v.map(|v| operand(model, v, &outputs, &mut peeled.added_outputs)));
        }
        peeled.updates.push(HostUpdate {
            op,
            operands,
            writes,
        });
        // The node's outputs leave the graph (the host writes them in place), then the node.
        for &(_, out) in &state_slots {
            let v = model.output(n, out);
            while let Some(index) = model.graph_outputs().iter().position(|&o| o == v) {
                model.remove_output(BodyId::MAIN, index);
            }
        }
        // Its outputs are read by nothing now (checked above), so this cannot fail; if it
        // did, the caller drops the half-peeled copy.
        model.remove_node(n).ok()?;
    }
    Some(peeled)
}

/// A fused update the host can run: its op, its (state input, output) slots and the first
/// of its ordering slots.
type Kernel = (HostOp, Vec<(usize, usize)>, usize);

fn kernel_of(model: &Model, n: NodeId) -> Option<Kernel> {
    let node = model.node(n);
    if node.proto.domain() != DOMAIN {
        return None;
    }
    match node.proto.op_type() {
        ADAMW_UPDATE => Some((
            HostOp::AdamW,
            vec![
                (adamw_slot::PARAM, 0),
                (adamw_slot::M, 1),
                (adamw_slot::V, 2),
            ],
            adamw_slot::AFTER,
        )),
        SGD_UPDATE => {
            let nesterov = node
                .proto
                .attribute
                .iter()
                .any(|a| a.name() == "nesterov" && a.i() == 1);
            let mut slots = vec![(sgd_slot::PARAM, 0)];
            if node.inputs.get(sgd_slot::BUF).is_some_and(Option::is_some) {
                slots.push((sgd_slot::BUF, 1));
            }
            Some((HostOp::Sgd { nesterov }, slots, sgd_slot::AFTER))
        }
        ACCUMULATE_GRAD => Some((
            HostOp::Accumulate,
            vec![(accumulate_slot::ACC, 0)],
            accumulate_slot::AFTER,
        )),
        _ => None,
    }
}

/// Where the host finds `v`: a constant, an input, or a value the session must return
/// (added to the outputs once, and to `added` when it was not one already).
fn operand(model: &mut Model, v: ValueId, outputs: &[ValueId], added: &mut Vec<String>) -> Operand {
    let name = model.name(v).to_string();
    if model.graph_inputs().contains(&v) {
        let default = model
            .initializer(v)
            .and_then(|t| Tensor::from_tensor_proto(t).ok());
        return Operand::Input { name, default };
    }
    let constant = model.initializer(v).cloned().or_else(|| {
        let (p, _) = model.producer(v)?;
        let node = &model.node(p).proto;
        (node.op_type() == "Constant")
            .then(|| node.attribute.iter().find(|a| a.name() == "value"))
            .flatten()
            .and_then(|a| a.t.clone())
    });
    if let Some(tensor) = constant.and_then(|t| Tensor::from_tensor_proto(&t).ok()) {
        return Operand::Constant(tensor);
    }
    if !outputs.contains(&v) && !added.contains(&name) {
        let ty = model.value_type(v);
        model.add_output(BodyId::MAIN, v, ty);
        added.push(name.clone());
    }
    Operand::Output(name)
}
