//! In-place state updates: which of a session's state outputs the engine may write into
//! the buffer of the state's own input, so that a micro-step reads and writes each state
//! once instead of reading one buffer and writing a fresh one. ONNX Runtime never writes
//! into a graph input by itself; the session binds such an output to the input's buffer
//! (`engine::ort::OrtSession::run_held`), as ONNX Runtime's training API updates its
//! gradients and optimizer state in place.
//!
//! Why: on the 1.9M-parameter MLP the value semantics cost a second buffer per state, and the
//! working set (parameters, gradients, old and new accumulators) no longer fits the 32 MiB
//! L3 between runs (benches/README.md, "Run H").
//!
//! A pair (state input s, its next value s') is updated in place when either
//!
//! - s' is an output of one of onnx-ga's fused kernels ([`crate::fused_ops`]) that reads s at
//!   the matching slot, every other reader of s runs before that kernel (an ancestor, or
//!   made one by an ordering input: [`plan`]), and the kernel has the gate ([`gate`]): a micro-step the
//!   host discards (a non-finite loss under `OnNonFinite::Stop`/`Skip`) leaves s untouched,
//!   with nothing to put back. All of a kernel's states go in place, or none of them.
//! - s is an accumulator the session does not read at all (the window-start specialisation,
//!   which writes the window's first gradient over whatever the buffer held), when the
//!   caller says so: a discarded window start leaves the step counter at the window's start,
//!   where the accumulators are never read; of any size: the binding kept across runs
//!   writes them with no kernel and no work per run (at 8K parameters the window start
//!   went from 1.18 to 1.07x the floor with its four small accumulators in place).
//!
//! In both, s' leaves the graph once, s is not itself an output, and both have one static
//! shape.

use std::collections::BTreeSet;

use crate::fused_ops::{
    accumulate_product_slot, accumulate_slot, adamw_slot, sgd_slot, ACCUMULATE_GRAD,
    ACCUMULATE_PRODUCT, ADAMW_UPDATE, DOMAIN, KEEP_NONFINITE, SGD_UPDATE,
};
use crate::ir::builder::{attr_int, tensor_bool, Builder};
use crate::ir::{tensor_type, BodyId, Model, NodeId, Use, ValueId};
use crate::proto::elem;
use crate::state::Manifest;

use super::{static_float32_shape, PASS};

/// The states of one session updated in place, by the names of their input and output.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InPlacePlan {
    pub pairs: Vec<(String, String)>,
    /// The gate's input ([`KEEP_NONFINITE`] or a fresh name derived from it), when the
    /// session has one: the host feeds it each run.
    pub keep_input: Option<String>,
}

/// The least elements a session's in-place states must hold in all for the trainer to bind
/// them (1 Mi elements, 4 MiB). Binding is per state and per run (an `IoBinding`, each input
/// and output bound by name: a few µs apiece), while in place saves in proportion to the
/// bytes: the ResNet-8s (78K parameters; at most ~300K elements in place per session) ran
/// faster apart in run J (B 8 7.30 vs 7.59 ms, B 32 24.4 vs 25.2), the MLP (1.9M) and the
/// GPT (3.7M) gain or break even in place.
pub const MIN_SESSION_ELEMENTS: i64 = 1 << 20;

/// The elements `plan`'s states hold in all (their declared static shapes in `model`).
pub fn elements(model: &Model, plan: &InPlacePlan) -> i64 {
    plan.pairs
        .iter()
        .filter_map(|(input, _)| model.lookup(BodyId::MAIN, input))
        .filter_map(|v| super::static_float32_shape(model, v))
        .map(|dims| dims.iter().product::<i64>())
        .sum()
}

/// For one fused operator: its (state input slot, output slot) pairs, its gate's slot and
/// the first of its ordering slots.
type StateSlots = (Vec<(usize, usize)>, usize, usize);

fn state_slots(op: &str, inputs: &[Option<ValueId>]) -> Option<StateSlots> {
    match op {
        ADAMW_UPDATE => Some((
            vec![
                (adamw_slot::PARAM, 0),
                (adamw_slot::M, 1),
                (adamw_slot::V, 2),
            ],
            adamw_slot::KEEP,
            adamw_slot::AFTER,
        )),
        SGD_UPDATE => {
            let mut pairs = vec![(sgd_slot::PARAM, 0)];
            // A momentum buffer only with momentum (else the slot is omitted or absent).
            if inputs.get(sgd_slot::BUF).is_some_and(Option::is_some) {
                pairs.push((sgd_slot::BUF, 1));
            }
            Some((pairs, sgd_slot::KEEP, sgd_slot::AFTER))
        }
        ACCUMULATE_GRAD => Some((
            vec![(accumulate_slot::ACC, 0)],
            accumulate_slot::KEEP,
            accumulate_slot::AFTER,
        )),
        ACCUMULATE_PRODUCT => Some((
            vec![(accumulate_product_slot::ACC, 0)],
            accumulate_product_slot::KEEP,
            accumulate_product_slot::AFTER,
        )),
        _ => None,
    }
}

/// The fused nodes of the main graph.
fn fused_nodes(model: &Model) -> Vec<NodeId> {
    model
        .body_nodes(BodyId::MAIN)
        .filter(|&n| {
            let p = &model.node(n).proto;
            p.domain() == DOMAIN && state_slots(p.op_type(), &[]).is_some()
        })
        .collect()
}

/// Gives every fused node of the main graph its gate ([`crate::fused_ops::keeps`]): the
/// step's loss, and `k`, a new bool input (default true: a host that does not feed it keeps
/// every update). Returns `k`'s name; `None` (and nothing changed) when there is no fused
/// node or no loss output.
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
    // The kernels read a float32 loss; a float16 or bfloat16 one converts exactly,
    // non-finite values included.
    let declared = model.value_type(loss).and_then(|t| t.tensor_elem());
    let loss = match declared {
        Some(e) if e != elem::FLOAT => Builder::new(model, BodyId::MAIN, PASS).op(
            "Cast",
            &[loss],
            vec![attr_int("to", i64::from(elem::FLOAT))],
            "ga.loss_float",
        ),
        _ => loss,
    };
    for n in nodes {
        let op = model.node(n).proto.op_type().to_string();
        if let Some((_, slot, _)) = state_slots(&op, &model.node(n).inputs) {
            model.set_input_growing(n, slot, k);
            model.set_input_growing(n, crate::fused_ops::loss_slot(slot), loss);
        }
    }
    Some(model.name(k).to_string())
}

/// The pairs of `model` (a session of the step `manifest` describes) to update in place;
/// `unread_accumulators`: whether accumulators the session does not read go in place too,
/// whatever their size (only for the window-start specialisation: see the module's
/// comment). A state that
/// nodes other than its kernel's ancestors also read (a layer's weight, which the backward
/// reads again for the gradient of the layer below) goes in place once the kernel is
/// ordered after them: each such reader's first output becomes one of the kernel's
/// ordering inputs (`fused_ops`' `AFTER` slots, which it does not read). A reader that
/// itself depends on the kernel would read the new value: then the kernel's states stay
/// apart.
pub fn plan(
    model: &mut Model,
    manifest: &Manifest,
    keep_input: Option<String>,
    unread_accumulators: bool,
) -> InPlacePlan {
    let outputs = model.graph_outputs();
    let inputs = model.graph_inputs();
    let leaves_once = |v: ValueId| outputs.iter().filter(|&&o| o == v).count() == 1;
    let mut pairs = Vec::new();
    for n in fused_nodes(model) {
        let node = model.node(n);
        let Some((slots, keep_slot, after_slot)) = state_slots(node.proto.op_type(), &node.inputs)
        else {
            continue;
        };
        if node.inputs.get(keep_slot).copied().flatten().is_none() {
            continue;
        }
        let (ancestors, descendants) = (ancestors(model, n), descendants(model, n));
        let mut kernel_pairs = Vec::new();
        let mut after: Vec<ValueId> = Vec::new();
        for &(in_slot, out_slot) in &slots {
            let (Some(s), Some(Some(next))) =
                (node.inputs[in_slot], node.outputs.get(out_slot).copied())
            else {
                break;
            };
            let is_pair = manifest
                .state
                .iter()
                .any(|e| e.input == model.name(s) && e.output == model.name(next));
            if !is_pair
                || !inputs.contains(&s)
                || !leaves_once(next)
                || !same_static_shape(model, s, next)
            {
                break;
            }
            let Some(readers) = readers_through_derived_values(model, s) else {
                break;
            };
            let mut readers_ok = true;
            for (r, slot) in readers {
                match r {
                    r if r == n => readers_ok &= slot == Some(in_slot),
                    r if ancestors.contains(&r) => {}
                    r if model.node(r).body == BodyId::MAIN && !descendants.contains(&r) => {
                        match ran_after(model, r, n, &descendants) {
                            Some(o) if !after.contains(&o) => after.push(o),
                            Some(_) => {}
                            None => readers_ok = false,
                        }
                    }
                    _ => readers_ok = false,
                }
            }
            if !readers_ok {
                break;
            }
            kernel_pairs.push((model.name(s).to_string(), model.name(next).to_string()));
        }
        if kernel_pairs.len() == slots.len() {
            pairs.extend(kernel_pairs);
            for (i, v) in after.into_iter().enumerate() {
                model.set_input_growing(n, after_slot + i, v);
            }
        }
    }
    if unread_accumulators {
        for (s, next) in super::accumulators(model, manifest) {
            let unread = model.uses(s).is_empty();
            let made_here = model.producer(next).is_some();
            if unread
                && made_here
                && leaves_once(next)
                && !outputs.contains(&s)
                && same_static_shape(model, s, next)
            {
                pairs.push((model.name(s).to_string(), model.name(next).to_string()));
            }
        }
    }
    InPlacePlan { pairs, keep_input }
}

/// The nodes that read `s`, each with the slot it reads `s` at when it reads it directly,
/// counting the readers of every value computed from `s` and constants alone (a view of it,
/// `Transpose(s)`, `Mul(s, scale)`, `Cast(s)`, ...) as readers of `s`. Why: ONNX Runtime
/// gives some of those outputs the input's own buffer (Reshape, Squeeze, Identity), and its
/// graph optimizer folds others into their readers (a weight's Transpose into the MatMuls
/// that read it, a scale into a MatMul), which then read `s` itself, ordered by nothing
/// else. `None` when such a value leaves the graph.
fn readers_through_derived_values(
    model: &Model,
    s: ValueId,
) -> Option<Vec<(NodeId, Option<usize>)>> {
    let is_constant = |v: ValueId| {
        model.initializer(v).is_some() && !model.graph_inputs().contains(&v)
            || model
                .producer(v)
                .is_some_and(|(p, _)| model.node(p).proto.op_type() == "Constant")
    };
    let mut derived: BTreeSet<ValueId> = BTreeSet::from([s]);
    let mut readers: Vec<(NodeId, Option<usize>)> = Vec::new();
    let mut queue = vec![s];
    while let Some(v) = queue.pop() {
        for u in model.uses(v) {
            let Use::Node { node, slot } = *u else {
                return None;
            };
            if !readers.iter().any(|(r, _)| *r == node) || v == s {
                readers.push((node, (v == s).then_some(slot)));
            }
            let of_s_alone = model.node(node).subgraphs.is_empty()
                && model
                    .node(node)
                    .inputs
                    .iter()
                    .flatten()
                    .all(|&i| derived.contains(&i) || is_constant(i));
            if of_s_alone {
                for &o in model.node(node).outputs.iter().flatten() {
                    if derived.insert(o) {
                        queue.push(o);
                    }
                }
            }
        }
    }
    Some(readers)
}

/// A value that exists only once `r` has run, for kernel `n` to wait on: the first output of
/// another fused kernel downstream of `r` (a state's next value, which lives to the end of
/// the run anyway), else `r`'s own first output (which waiting keeps alive longer: an
/// activation, measured at +80 MiB on the ResNet-8 with BatchNorm at B 32). Never one that
/// depends on `n` (`descendants`): that would make a cycle.
fn ran_after(
    model: &Model,
    r: NodeId,
    n: NodeId,
    descendants: &BTreeSet<NodeId>,
) -> Option<ValueId> {
    let mut seen = BTreeSet::from([r]);
    let mut queue = std::collections::VecDeque::from([r]);
    while let Some(m) = queue.pop_front() {
        if m != r && m != n && !descendants.contains(&m) && model.node(m).proto.domain() == DOMAIN {
            if let Some(&o) = model.node(m).outputs.iter().flatten().next() {
                return Some(o);
            }
        }
        for top in main_readers(model, m) {
            if seen.insert(top) {
                queue.push_back(top);
            }
        }
    }
    model.node(r).outputs.iter().flatten().next().copied()
}

/// The main-graph nodes that read an output of `m` (a node inside a subgraph counts as the
/// main-graph node that owns its body), once per read.
fn main_readers(model: &Model, m: NodeId) -> impl Iterator<Item = NodeId> + '_ {
    model
        .node(m)
        .outputs
        .iter()
        .flatten()
        .flat_map(move |v| model.uses(*v))
        .filter_map(move |u| match u {
            Use::Node { node, .. } => Some(main_node_of(model, *node)),
            _ => None,
        })
}

/// Every main-graph node that reads an output of `n`, directly or not (a node inside a
/// subgraph counts as the main-graph node that owns its body).
fn descendants(model: &Model, n: NodeId) -> BTreeSet<NodeId> {
    let mut seen = BTreeSet::new();
    let mut stack = vec![n];
    while let Some(m) = stack.pop() {
        for top in main_readers(model, m) {
            if seen.insert(top) {
                stack.push(top);
            }
        }
    }
    seen
}

/// The main-graph node that `n` is, or whose subgraph holds it.
fn main_node_of(model: &Model, mut n: NodeId) -> NodeId {
    while let Some(owner) = model.body(model.node(n).body).owner {
        n = owner;
    }
    n
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
    matches!(
        (static_float32_shape(model, a), static_float32_shape(model, b)),
        (Some(x), Some(y)) if x == y
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fused_ops::accumulate_slot;

    /// `AccumulateGrad(acc, g) -> acc2` beside a loss of `loss_type`; the model and its
    /// manifest (only the loss is read).
    fn accumulation_beside_a_loss(loss_type: &str) -> (Model, Manifest) {
        let text = format!(
            "<ir_version: 8, opset_import: [\"\" : 17, \"{DOMAIN}\" : 1]>\n\
             g (float[4] acc, float[4] g, {loss_type} x) => (float[4] acc2, {loss_type} loss) {{\n\
               loss = Identity(x)\n\
               acc2 = {DOMAIN}.AccumulateGrad(acc, g)\n\
             }}"
        );
        let proto = crate::ir::text::parse_model(&text).unwrap_or_else(|e| panic!("{e}"));
        let manifest = Manifest {
            state: Vec::new(),
            data_inputs: Vec::new(),
            loss: "loss".to_string(),
            pipeline: String::new(),
            version: String::new(),
            apply: None,
            learning_rate: None,
            init: Default::default(),
        };
        (Model::from_proto(proto), manifest)
    }

    /// The gate's two inputs as the kernel gets them: the host's `keep`, and the loss as
    /// float32 (converted once where the step's loss is not).
    #[test]
    fn the_gate_gives_the_kernels_the_host_keep_and_a_float32_loss() {
        for (loss_type, cast) in [("float", false), ("float16", true), ("bfloat16", true)] {
            let (mut model, manifest) = accumulation_beside_a_loss(loss_type);
            let k = gate(&mut model, &manifest).expect("a gate");
            assert_eq!(k, KEEP_NONFINITE);
            let node = fused_nodes(&model)[0];
            let inputs = &model.node(node).inputs;
            let name = |slot: usize| inputs[slot].map(|v| model.name(v).to_string());
            assert_eq!(name(accumulate_slot::KEEP).as_deref(), Some(KEEP_NONFINITE));
            let loss = inputs[accumulate_slot::LOSS].expect("the loss");
            match model.producer(loss) {
                Some((p, _)) if cast => {
                    let p = &model.node(p);
                    assert_eq!(p.proto.op_type(), "Cast", "{loss_type}");
                    let to = p.proto.attribute.iter().find(|a| a.name() == "to");
                    assert_eq!(to.map(|a| a.i()), Some(i64::from(elem::FLOAT)));
                    assert_eq!(p.inputs[0].map(|v| model.name(v)), Some("loss"));
                }
                _ => assert!(!cast && model.name(loss) == "loss", "{loss_type}"),
            }
        }
    }
}
