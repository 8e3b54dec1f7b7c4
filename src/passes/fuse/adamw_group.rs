//! The fused AdamW updates of a session as one [`AdamWUpdates`](crate::fused_ops::ADAMW_UPDATES)
//! node: one dispatch for every parameter that shares the update's scalars, instead of one
//! per parameter and, for the flat group of small parameters the optimizer pass writes,
//! instead of `Concat`s in and `Split`s out.
//!
//! Why: at small sizes a step costs its dispatches, not its bytes. The apply of the scale
//! bench's 8K-parameter MLP ran three `AdamWUpdate`s, four `Concat`s and three `Split`s
//! around 8320 elements (benches/README.md, "Scaling with model size").
//!
//! Two rewrites, each exact (the kernels are elementwise, so which buffer holds an element
//! does not change its value):
//!
//! 1. **Unflatten.** An `AdamWUpdate` whose parameter, gradient and moments are `Concat`s
//!    (axis 0) of the same members, and whose three outputs are each read only by a `Split`
//!    (axis 0) cutting them into those members' sizes, becomes one `AdamWUpdate` per member
//!    with the same scalars. A member's gradient that is the window's mean `(acc + d) / K`
//!    folds into its update ([`super::gradient_prologue`]), as for a parameter updated alone.
//!    The parameters' sizes must be declared and the `Split`s cut at them, or it is left
//!    alone.
//! 2. **Group.** The `AdamWUpdate`s of one body that read the same scalar values (the same
//!    value, not an equal one), with or without an addend alike, and neither gated nor
//!    ordered ([`super::in_place`]), become one `AdamWUpdates`. A group where one member's
//!    inputs depend on another's outputs is left as it is (one node could not run both).
//!
//! Only sessions that update nothing in place get it ([`super::prepare`]): those are the
//! small ones, where dispatches are what costs.

use std::collections::{BTreeMap, HashSet};

use super::{gradient_prologue, input, static_float32_shape, PASS};
use crate::fused_ops::{adamw_group_slot, adamw_slot, ADAMW_UPDATE, ADAMW_UPDATES, DOMAIN};
use crate::ir::builder::{attr_int, Builder};
use crate::ir::{normalize_domain, BodyId, Model, NodeId, Use, ValueId};

/// Unflattens and groups the fused AdamW updates of `model`; returns how many updates went
/// into `AdamWUpdates` nodes.
pub fn group_adamw(model: &mut Model) -> usize {
    unflatten_all(model);
    let mut groups: BTreeMap<GroupKey, Vec<NodeId>> = BTreeMap::new();
    for node in fused_updates(model) {
        let n = model.node(node);
        let groupable = n.inputs.len() <= adamw_slot::COUNT
            && input(model, node, adamw_slot::KEEP).is_none()
            && input(model, node, adamw_slot::LOSS).is_none()
            && n.outputs.len() == 3;
        if !groupable {
            continue;
        }
        let scalars = adamw_group_slot::FROM_SINGLE
            .iter()
            .map(|&slot| input(model, node, slot))
            .collect();
        let addend = input(model, node, adamw_slot::GRAD_ADDEND).is_some();
        groups
            .entry((n.body, scalars, addend))
            .or_default()
            .push(node);
    }
    let mut grouped = 0;
    for ((body, scalars, addends), members) in groups {
        if members.len() < 2 || !independent(model, &members) {
            continue;
        }
        let mut inputs = scalars;
        for &m in &members {
            let slots = [adamw_slot::PARAM, adamw_slot::GRAD]
                .into_iter()
                .chain(addends.then_some(adamw_slot::GRAD_ADDEND))
                .chain([adamw_slot::M, adamw_slot::V]);
            inputs.extend(slots.map(|slot| input(model, m, slot)));
        }
        let hints: Vec<String> = members
            .iter()
            .flat_map(|&m| (0..3).map(move |k| (m, k)))
            .map(|(m, k)| format!("{}.grouped", model.name(model.output(m, k))))
            .collect();
        let hints: Vec<&str> = hints.iter().map(String::as_str).collect();
        let attributes = vec![
            attr_int("members", members.len() as i64),
            attr_int("addends", addends as i64),
        ];
        let node = Builder::new(model, body, PASS).node(
            ADAMW_UPDATES,
            DOMAIN,
            &inputs,
            &hints,
            attributes,
        );
        for (k, &m) in members.iter().enumerate() {
            for slot in 0..3 {
                let (old, new) = (model.output(m, slot), model.output(node, 3 * k + slot));
                model.replace_value(old, new);
            }
        }
        grouped += members.len();
    }
    grouped
}

/// Rewrite 1 on every fused AdamW update of `model` that updates a flat group.
pub fn unflatten_all(model: &mut Model) {
    // The nodes the fused updates replaced still read their outputs until they go.
    super::super::dce::eliminate_dead_code(model);
    let flat: Vec<NodeId> = fused_updates(model).collect();
    for node in flat {
        unflatten(model, node);
    }
    super::super::dce::eliminate_dead_code(model);
}

/// What the members of one `AdamWUpdates` share: their body, their scalar inputs (by
/// [`adamw_group_slot::FROM_SINGLE`]) and whether each has an addend.
type GroupKey = (BodyId, Vec<Option<ValueId>>, bool);

fn fused_updates(model: &Model) -> impl Iterator<Item = NodeId> + '_ {
    model.all_nodes().filter(|&n| {
        let p = &model.node(n).proto;
        p.op_type() == ADAMW_UPDATE && normalize_domain(p.domain()) == DOMAIN
    })
}

/// Rewrite 1 on `node`, when it is a flat group's update.
fn unflatten(model: &mut Model, node: NodeId) {
    let Some(flat) = FlatGroup::of(model, node) else {
        return;
    };
    let body = model.node(node).body;
    let fixed: Vec<Option<ValueId>> = (0..adamw_slot::COUNT)
        .map(|slot| input(model, node, slot))
        .collect();
    for (k, member) in flat.members.iter().enumerate() {
        let mut inputs = fixed.clone();
        let [param, grad, m, v] = member.inputs;
        inputs[adamw_slot::PARAM] = Some(param);
        inputs[adamw_slot::M] = Some(m);
        inputs[adamw_slot::V] = Some(v);
        inputs[adamw_slot::GRAD] = Some(grad);
        let rank = static_float32_shape(model, param).map_or(0, |d| d.len());
        if let Some((x, addend, divisor)) =
            gradient_prologue(model, grad, &member.grad_readers, rank)
        {
            inputs[adamw_slot::GRAD] = Some(x);
            inputs[adamw_slot::GRAD_ADDEND] = addend;
            inputs[adamw_slot::GRAD_DIVISOR] = Some(divisor);
        }
        let replaced: Vec<ValueId> = match member.reshaped_back {
            Some(values) => values.to_vec(),
            None => flat.splits.iter().map(|&s| model.output(s, k)).collect(),
        };
        let hints: Vec<String> = replaced
            .iter()
            .map(|&v| format!("{}.fused", model.name(v)))
            .collect();
        let hints: Vec<&str> = hints.iter().map(String::as_str).collect();
        let update =
            Builder::new(model, body, PASS).node(ADAMW_UPDATE, DOMAIN, &inputs, &hints, vec![]);
        for (slot, old) in replaced.into_iter().enumerate() {
            let new = model.output(update, slot);
            model.replace_value(old, new);
        }
    }
}

/// A fused update of a flat group: its members, in `Concat` order, and the `Split`s of its
/// three outputs.
struct FlatGroup {
    members: Vec<Member>,
    splits: [NodeId; 3],
}

/// One parameter of a flat group.
struct Member {
    /// Parameter, gradient and moments: the `Concat`s' operands, or what their
    /// `Reshape(x, [-1])` flattened (any shape: the kernel reads elements, and writes its
    /// outputs in its parameter's shape).
    inputs: [ValueId; 4],
    /// The nodes reading the gradient taken: the `Concat`, or the `Reshape` flattening it.
    grad_readers: Vec<NodeId>,
    /// When the parameter is taken in its own shape: the outputs of the `Reshape`s that
    /// give each `Split` piece that shape back, which the member's outputs replace.
    reshaped_back: Option<[ValueId; 3]>,
}

impl FlatGroup {
    fn of(model: &Model, node: NodeId) -> Option<FlatGroup> {
        // A gradient folded into the update (or an addend, a gate, an ordering input) means
        // this is not how the optimizer pass writes a flat group.
        let unfolded = [
            adamw_slot::GRAD_ADDEND,
            adamw_slot::GRAD_DIVISOR,
            adamw_slot::KEEP,
            adamw_slot::LOSS,
        ]
        .iter()
        .all(|&slot| input(model, node, slot).is_none())
            && model.node(node).inputs.len() <= adamw_slot::COUNT;
        if !unfolded {
            return None;
        }
        let body = model.node(node).body;
        let slots = [
            adamw_slot::PARAM,
            adamw_slot::GRAD,
            adamw_slot::M,
            adamw_slot::V,
        ];
        let mut concats = Vec::with_capacity(4);
        for slot in slots {
            let concat = concat_axis0(model, input(model, node, slot)?, body)?;
            let parts: Vec<ValueId> = model
                .node(concat)
                .inputs
                .iter()
                .copied()
                .collect::<Option<_>>()?;
            concats.push((concat, parts));
        }
        let count = concats[0].1.len();
        if concats.iter().any(|(_, parts)| parts.len() != count) {
            return None;
        }
        let mut splits = Vec::with_capacity(3);
        for slot in 0..3 {
            let split = split_of(model, model.output(node, slot), body)?;
            if model.node(split).outputs.len() != count {
                return None;
            }
            splits.push(split);
        }
        let cut =
            crate::passes::autodiff::shapes::constant_ints(model, input(model, splits[0], 1)?)?;
        if splits
            .iter()
            .any(|&s| input(model, s, 1) != input(model, splits[0], 1))
        {
            return None;
        }
        let mut members = Vec::with_capacity(count);
        for k in 0..count {
            // The parameter's size must be declared and be where the Splits cut; another
            // slot's member of unknown size is checked by the kernel, which fails a member
            // whose gradient or moments differ from its parameter in size (so a layout that
            // differs cannot pass).
            let flat_param = concats[0].1[k];
            let dims = |v: ValueId| static_float32_shape(model, v);
            let back = |x: ValueId| -> Option<(ValueId, [ValueId; 3])> {
                let want = dims(x)?;
                let mut outputs = [x; 3];
                for (slot, &s) in splits.iter().enumerate() {
                    let (to, output) = reshaped_back(model, model.output(s, k))?;
                    if to != want {
                        return None;
                    }
                    outputs[slot] = output;
                }
                Some((x, outputs))
            };
            let unflat = flattened(model, flat_param).and_then(|(x, _)| back(x));
            let param = unflat.map_or(flat_param, |(x, _)| x);
            let reshaped_back = unflat.map(|(_, outputs)| outputs);
            let size: i64 = dims(param)?.iter().product();
            if cut.get(k) != Some(&size) {
                return None;
            }
            let take = |j: usize| {
                let part = concats[j].1[k];
                flattened(model, part).unwrap_or((part, concats[j].0))
            };
            let (grad, grad_reader) = take(1);
            members.push(Member {
                inputs: [param, grad, take(2).0, take(3).0],
                grad_readers: vec![grad_reader],
                reshaped_back,
            });
        }
        if cut.len() != count {
            return None;
        }
        Some(FlatGroup {
            members,
            splits: splits.try_into().ok()?,
        })
    }
}

/// `x` and the node when `v` is `Reshape(x, [-1])`.
fn flattened(model: &Model, v: ValueId) -> Option<(ValueId, NodeId)> {
    let (n, _) = model.producer(v)?;
    let shape = input(model, n, 1)?;
    let flat = plain_reshape(model, n)
        && crate::passes::autodiff::shapes::constant_ints(model, shape)? == [-1];
    flat.then(|| Some((input(model, n, 0)?, n))).flatten()
}

/// When the one reader of `piece` is a `Reshape` to constant dims: those dims and its output.
fn reshaped_back(model: &Model, piece: ValueId) -> Option<(Vec<i64>, ValueId)> {
    let [Use::Node { node, slot: 0 }] = model.uses(piece) else {
        return None;
    };
    if !plain_reshape(model, *node) {
        return None;
    }
    let dims = crate::passes::autodiff::shapes::constant_ints(model, input(model, *node, 1)?)?;
    // Dims written out in full (no 0 or -1 to resolve against the piece).
    dims.iter()
        .all(|&d| d > 0)
        .then(|| (dims, model.output(*node, 0)))
}

/// The `Concat` (axis 0) in `body` that makes `v`.
fn concat_axis0(model: &Model, v: ValueId, body: BodyId) -> Option<NodeId> {
    let (n, _) = model.producer(v)?;
    (standard(model, n, "Concat") && axis0(model, n) && model.node(n).body == body).then_some(n)
}

/// The one `Split` (axis 0, sizes as its second input) reading `v`, and nothing else.
fn split_of(model: &Model, v: ValueId, body: BodyId) -> Option<NodeId> {
    let [Use::Node { node, slot: 0 }] = model.uses(v) else {
        return None;
    };
    let n = model.node(*node);
    (standard(model, *node, "Split")
        && axis0(model, *node)
        && n.inputs.len() == 2
        && n.body == body)
        .then_some(*node)
}

/// Node `n` is `op` of the standard domain.
fn standard(model: &Model, n: NodeId, op: &str) -> bool {
    let p = &model.node(n).proto;
    p.op_type() == op && normalize_domain(p.domain()).is_empty()
}

/// Node `n`'s one attribute is `axis = 0`.
fn axis0(model: &Model, n: NodeId) -> bool {
    let a = &model.node(n).proto.attribute;
    a.len() == 1 && a[0].name() == "axis" && a[0].i() == 0
}

/// Node `n` is a standard `Reshape` that does not copy zeros from its input's shape.
fn plain_reshape(model: &Model, n: NodeId) -> bool {
    let allowzero = |a: &crate::proto::AttributeProto| a.name() == "allowzero" && a.i() != 0;
    standard(model, n, "Reshape") && !model.node(n).proto.attribute.iter().any(allowzero)
}

/// No member reads, however indirectly, what another member makes.
fn independent(model: &Model, members: &[NodeId]) -> bool {
    let mut reached: HashSet<NodeId> = HashSet::new();
    let mut stack: Vec<NodeId> = members.to_vec();
    while let Some(n) = stack.pop() {
        for &out in model.node(n).outputs.iter().flatten() {
            for u in model.uses(out) {
                if let Use::Node { node, .. } = u {
                    if reached.insert(*node) {
                        stack.push(*node);
                    }
                }
            }
        }
    }
    members.iter().all(|m| !reached.contains(m))
}
