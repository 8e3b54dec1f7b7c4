//! What a `Loop` node is made of, as both ways of differentiating one read it (unrolled,
//! `unroll_loop`; as a Loop, `loop_grad`), with the checks both need.
//!
//! ONNX's Loop: inputs `M` (trip count), `cond`, and the N carried starting values; its body
//! takes (iteration number, condition, N carried) and returns (condition, N carried, K scan
//! outputs); the node's outputs are the N last carried values and the K scan outputs stacked.

use crate::ir::builder::Builder;
use std::collections::HashMap;

use crate::ir::{BodyId, Model, NodeId, NodeSpec, ValueId};
use crate::proto::type_proto;

/// What the Loop is made of.
/// Whether node `n` is a Loop (default domain).
pub fn is_loop(model: &Model, n: NodeId) -> bool {
    let p = &model.node(n).proto;
    p.op_type() == "Loop" && crate::ir::normalize_domain(p.domain()).is_empty()
}

/// Why the backward cannot recompute `body` (an If's `label`, a kept Loop's body), when it
/// cannot: a node of it, or of a body nested in it, would not compute again what the
/// forward computed. It draws random numbers (a Dropout that drops, the random ops) or
/// normalises (BatchNormalization: `normalize` puts it in its training form only in the
/// main graph, so one in a body would train on running statistics).
///
/// `draws_kept`: the forward keeps what the body's own nodes draw, so that the backward
/// reads it instead of drawing again (a kept Loop stacks it per iteration, `loop_grad`);
/// only draws nested deeper are refused.
pub fn not_recomputable(
    model: &Model,
    body: BodyId,
    label: &str,
    draws_kept: bool,
) -> Option<String> {
    let node = redrawn_in(model, body, draws_kept)?;
    let p = &model.node(node).proto;
    let which = match p.name() {
        "" => {
            let computing: Vec<&str> = model
                .node(node)
                .outputs
                .iter()
                .flatten()
                .map(|v| model.name(*v))
                .collect();
            format!("computing {}", computing.join(", "))
        }
        name => format!("'{name}'"),
    };
    let instead = match p.op_type() {
        "Dropout" => " (`--dropout off` trains without it)",
        _ => "",
    };
    Some(format!(
        "its {label} holds {} {which}: the gradient recomputes the {label}, which would draw or normalise differently from the forward{instead}",
        p.op_type()
    ))
}

/// Why [`copy_node`] cannot copy what `body` holds, when it cannot: a node with a list of
/// graphs (a `GRAPHS` attribute: no standard op has one), at any depth.
pub fn not_copied(model: &Model, body: BodyId) -> Option<String> {
    let listing = find_at_any_depth(model, body, &|n| {
        model.node(n).subgraphs.iter().any(|s| s.element.is_some())
    })?;
    let p = &model.node(listing).proto;
    Some(format!(
        "it holds {} '{}', whose attribute is a list of graphs, which is not copied",
        p.op_type(),
        p.name()
    ))
}

/// The node of `body` that would not compute again what the forward computed. At the top
/// level a draw counts only unless `draws_kept`; in the bodies nested deeper every draw
/// counts (nothing keeps theirs).
fn redrawn_in(model: &Model, body: BodyId, draws_kept: bool) -> Option<NodeId> {
    let normalises = |n: NodeId| {
        let p = &model.node(n).proto;
        crate::ir::normalize_domain(p.domain()).is_empty() && p.op_type() == "BatchNormalization"
    };
    let redraws = |n: NodeId| normalises(n) || draws(model, n);
    model.body_nodes(body).find_map(
        |n| match normalises(n) || (!draws_kept && draws(model, n)) {
            true => Some(n),
            false => model
                .node(n)
                .subgraphs
                .iter()
                .find_map(|s| find_at_any_depth(model, s.body, &redraws)),
        },
    )
}

/// Whether node `n` draws random numbers: a random op, or a Dropout that drops (its
/// `training_mode` the constant true; one that does not is the identity).
pub fn draws(model: &Model, n: NodeId) -> bool {
    let p = &model.node(n).proto;
    if !crate::ir::normalize_domain(p.domain()).is_empty() {
        return false;
    }
    match p.op_type() {
        "Dropout" => super::rules::dropout_drops(model, n),
        op => super::rules::RANDOM.contains(&op),
    }
}

/// The first node of `body`, or of a body nested in it, that `holds`.
fn find_at_any_depth(
    model: &Model,
    body: BodyId,
    holds: &dyn Fn(NodeId) -> bool,
) -> Option<NodeId> {
    model.body_nodes(body).find_map(|n| match holds(n) {
        true => Some(n),
        false => model
            .node(n)
            .subgraphs
            .iter()
            .find_map(|s| find_at_any_depth(model, s.body, holds)),
    })
}

pub struct LoopParts {
    pub body: BodyId,
    /// `M`, when given.
    pub trip_count: Option<ValueId>,
    /// The first condition, when given.
    pub condition: Option<ValueId>,
    /// The N carried starting values.
    pub initial: Vec<ValueId>,
    /// The body's inputs: iteration number, condition, N carried.
    pub body_inputs: Vec<ValueId>,
    /// The body's outputs: condition, N carried, K scan outputs.
    pub body_outputs: Vec<ValueId>,
}

impl LoopParts {
    pub fn carried(&self) -> usize {
        self.initial.len()
    }

    pub fn scans(&self) -> usize {
        self.body_outputs.len() - 1 - self.carried()
    }

    /// The Loop `n`'s parts, or why it is not a Loop either differentiation can read: its body
    /// signature off, sparse initializers in its body, a carried value that is not a tensor.
    /// (Control flow in the body is copied with it: [`copy_node`].)
    pub fn of(model: &Model, n: NodeId) -> Result<LoopParts, String> {
        let node = model.node(n);
        let body = model.subgraph(n, "body").ok_or("it has no body")?;
        let b = model.body(body);
        let body_inputs: Vec<ValueId> = b.inputs.iter().map(|(v, _)| *v).collect();
        let body_outputs: Vec<ValueId> = b.outputs.iter().map(|(v, _)| *v).collect();
        let initial: Vec<ValueId> = (2..node.inputs.len().max(2))
            .map(|i| node.inputs[i].ok_or(format!("its carried value {} is omitted", i - 2)))
            .collect::<Result<_, _>>()?;
        let carried = initial.len();
        if body_inputs.len() != 2 + carried || body_outputs.len() < 1 + carried {
            return Err(format!(
            "its body takes {} inputs and returns {} outputs for {carried} carried values (ONNX: 2 + N inputs, 1 + N + K outputs)",
            body_inputs.len(),
            body_outputs.len()
        ));
        }
        if node.outputs.len() > body_outputs.len() - 1 {
            return Err(format!(
                "it has {} outputs, its body returns {} values besides the condition",
                node.outputs.len(),
                body_outputs.len() - 1
            ));
        }
        if !b.sparse_initializers.is_empty() {
            return Err("its body holds sparse initializers".into());
        }
        if let Some(why) = not_copied(model, body) {
            return Err(why);
        }
        let not_tensor = |v: &ValueId| {
            model
                .value_type(*v)
                .is_some_and(|t| !matches!(t.value, None | Some(type_proto::Value::TensorType(_))))
        };
        if let Some(v) = body_inputs
            .iter()
            .chain(&body_outputs)
            .find(|v| not_tensor(v))
        {
            return Err(format!(
                "its body's value '{}' is not a tensor (a sequence or an optional)",
                model.name(*v)
            ));
        }
        Ok(LoopParts {
            body,
            trip_count: node.inputs.first().copied().flatten(),
            condition: node.inputs.get(1).copied().flatten(),
            initial,
            body_inputs,
            body_outputs,
        })
    }
}

/// A copy of body node `node` (op, domain, attributes, name) made by `b` in its body,
/// reading `inputs`: every value the copy makes as (original, copy), its outputs first; an
/// output the original omits stays omitted. Both differentiations copy a Loop's body this
/// way (unrolled: once per iteration; as a Loop: once, recomputed in the backward's body).
///
/// A node holding bodies (an If, a Loop) gets copies of them, each reading the copy in
/// `captured` of an outer value it reads (the outer value itself where there is none), and
/// their values are among the pairs returned, so control flow nested in a body is copied
/// with it.
pub fn copy_node(
    b: &mut Builder<'_>,
    node: NodeId,
    inputs: &[Option<ValueId>],
    captured: &HashMap<ValueId, ValueId>,
) -> Vec<(ValueId, ValueId)> {
    let original = b.model.node(node).clone();
    let p = &original.proto;
    let hints: Vec<String> = original
        .outputs
        .iter()
        .map(|o| o.map(|o| b.model.name(o).to_string()).unwrap_or_default())
        .collect();
    let hint_refs: Vec<&str> = hints.iter().map(String::as_str).collect();
    // The graph attributes are made again below, as new bodies.
    let graph_attributes: Vec<usize> = original.subgraphs.iter().map(|s| s.attribute).collect();
    let attributes = p
        .attribute
        .iter()
        .enumerate()
        .filter(|(i, _)| !graph_attributes.contains(i))
        .map(|(_, a)| a.clone())
        .collect();
    let copy = b.model.add_node(
        b.body,
        NodeSpec {
            op_type: p.op_type(),
            domain: p.domain(),
            inputs,
            output_hints: &hint_refs,
            attributes,
            name_hint: Some(p.name()),
            pass: Some(b.pass),
        },
    );
    b.added += 1;
    let mut pairs = Vec::new();
    for (slot, o) in original.outputs.iter().enumerate() {
        match o {
            Some(o) => pairs.push((*o, b.model.output(copy, slot))),
            None => b.model.node_mut(copy).outputs[slot] = None,
        }
    }
    for sub in &original.subgraphs {
        let attribute = p.attribute[sub.attribute].name().to_string();
        let body = b.model.add_subgraph(copy, &attribute);
        pairs.extend(copy_graph(b, sub.body, body, captured));
    }
    pairs
}

/// The body `from` (inputs, initializers, nodes, outputs) copied into the empty body `to`,
/// reading the copy in `captured` of each outer value it reads where there is one.
fn copy_graph(
    b: &mut Builder<'_>,
    from: BodyId,
    to: BodyId,
    captured: &HashMap<ValueId, ValueId>,
) -> Vec<(ValueId, ValueId)> {
    let mut copies = captured.clone();
    let mut made = Vec::new();
    let inputs = b.model.body(from).inputs.clone();
    for (v, info) in inputs {
        let name = b.model.name(v).to_string();
        let copy = b
            .model
            .add_input(to, &name, info.r#type.clone().unwrap_or_default(), None);
        if let Some((_, copied)) = b.model.body_mut(to).inputs.last_mut() {
            copied.r#type = info.r#type;
        }
        copies.insert(v, copy);
        made.push((v, copy));
    }
    let mut inner = Builder::new(&mut *b.model, to, b.pass);
    made.extend(copy_body(&mut inner, from, &mut copies));
    b.added += inner.added;
    let outputs = b.model.body(from).outputs.clone();
    for (v, info) in outputs {
        let copy = copies.get(&v).copied().unwrap_or(v);
        b.model.add_output(to, copy, info.r#type);
    }
    made
}

/// The nodes of `body` (a Loop's, a Scan's, an If branch) copied into the body `b` builds in,
/// its initializers too, each reading the copy of what it read where `copies` has one;
/// `copies` gains every value they compute. Returns the (original, copy) pairs made.
pub fn copy_body(
    b: &mut Builder<'_>,
    body: BodyId,
    copies: &mut HashMap<ValueId, ValueId>,
) -> Vec<(ValueId, ValueId)> {
    copy_body_by(b, body, copies, &mut |_, _, _| None)
}

/// [`copy_body`] into the body `g` builds in, each copy given its original's shape facts:
/// the backward of a kept Loop and of an If recompute their forward this way.
pub fn recompute(
    g: &mut super::rules::Grad<'_>,
    forward: BodyId,
    copies: &mut HashMap<ValueId, ValueId>,
) {
    copy_body_by(g, forward, copies, &mut |_, _, _| None);
}

/// What [`recompute_with`] makes of a node instead of a copy, given the copies of its inputs:
/// its (original, replacement) pairs, or `None` to copy it.
pub type Instead<'a, C> =
    dyn FnMut(&mut C, NodeId, &[Option<ValueId>]) -> Option<Vec<(ValueId, ValueId)>> + 'a;

/// [`recompute`], except for the nodes `instead` makes something else of (a kept Loop's
/// backward reads what the forward drew rather than drawing again).
pub fn recompute_with<'m>(
    g: &mut super::rules::Grad<'m>,
    forward: BodyId,
    copies: &mut HashMap<ValueId, ValueId>,
    instead: &mut Instead<'_, super::rules::Grad<'m>>,
) {
    copy_body_by(g, forward, copies, instead);
}

/// Where a body is copied to: a builder alone, or a gradient's builder, whose copies also
/// take their originals' shape facts.
pub trait CopyTarget<'m> {
    fn builder(&mut self) -> &mut Builder<'m>;
    /// `copy` was made of `original`.
    fn made(&mut self, _original: ValueId, _copy: ValueId) {}
}

impl<'m> CopyTarget<'m> for Builder<'m> {
    fn builder(&mut self) -> &mut Builder<'m> {
        self
    }
}

impl<'m> CopyTarget<'m> for super::rules::Grad<'m> {
    fn builder(&mut self) -> &mut Builder<'m> {
        &mut self.b
    }
    fn made(&mut self, original: ValueId, copy: ValueId) {
        let facts = self.facts(original);
        self.shapes.set(copy, facts);
    }
}

/// The one walk behind [`copy_body`], [`recompute`] and [`recompute_with`]: initializers,
/// then the nodes in order, each copied unless `instead` makes something else of it.
fn copy_body_by<'m, C: CopyTarget<'m>>(
    cx: &mut C,
    body: BodyId,
    copies: &mut HashMap<ValueId, ValueId>,
    instead: &mut Instead<'_, C>,
) -> Vec<(ValueId, ValueId)> {
    let mut made = Vec::new();
    let mut record = |cx: &mut C, copies: &mut HashMap<_, _>, pairs: Vec<(ValueId, ValueId)>| {
        for (original, copy) in pairs {
            copies.insert(original, copy);
            cx.made(original, copy);
            made.push((original, copy));
        }
    };
    let initializers = cx.builder().model.body(body).initializers.clone();
    for (v, t) in initializers {
        let b = cx.builder();
        let name = b.model.name(v).to_string();
        let copy = b.model.add_initializer(b.body, &name, t);
        record(cx, copies, vec![(v, copy)]);
    }
    for node in crate::ir::topological_order(cx.builder().model, body) {
        let inputs: Vec<Option<ValueId>> = cx
            .builder()
            .model
            .node(node)
            .inputs
            .iter()
            .map(|v| v.map(|v| copies.get(&v).copied().unwrap_or(v)))
            .collect();
        let pairs = match instead(cx, node, &inputs) {
            Some(pairs) => pairs,
            None => copy_node(cx.builder(), node, &inputs, copies),
        };
        record(cx, copies, pairs);
    }
    made
}

/// `v` as a value a node of the body `b` builds in computes (a body output must be one
/// here: an input of the body or an outer value passes through an Identity).
pub fn computed_in(b: &mut Builder<'_>, v: ValueId, hint: &str) -> ValueId {
    let here = matches!(b.model.value(v).def,
        crate::ir::ValueDef::Node { node, .. } if b.model.node(node).body == b.body);
    match here {
        true => v,
        false => b.op("Identity", &[v], vec![], hint),
    }
}

/// [`computed_in`] in the body `g` builds in, a new copy given `v`'s shape facts.
pub fn computed_here(g: &mut super::rules::Grad<'_>, v: ValueId, hint: &str) -> ValueId {
    let out = computed_in(&mut g.b, v, hint);
    if out != v {
        let facts = g.facts(v);
        g.shapes.set(out, facts);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::{
        attribute_proto::AttributeType, AttributeProto, GraphProto, ModelProto, NodeProto,
        OperatorSetIdProto, ValueInfoProto,
    };

    fn info(name: &str) -> ValueInfoProto {
        ValueInfoProto {
            name: Some(name.into()),
            ..Default::default()
        }
    }

    /// A Loop whose body holds a node of another domain with a list of graphs (`GRAPHS`):
    /// neither differentiation can copy it, and the error says so instead of writing a
    /// broken copy.
    #[test]
    fn a_body_holding_a_list_of_graphs_is_refused_by_name() {
        let listed = AttributeProto {
            name: Some("bodies".into()),
            r#type: Some(AttributeType::Graphs as i32),
            graphs: vec![GraphProto {
                name: Some("inner".into()),
                output: vec![info("a")],
                ..Default::default()
            }],
            ..Default::default()
        };
        let body = GraphProto {
            name: Some("body".into()),
            input: vec![info("i"), info("c"), info("a")],
            output: vec![info("c"), info("a_next")],
            node: vec![NodeProto {
                name: Some("listing".into()),
                op_type: Some("Custom".into()),
                domain: Some("example.org".into()),
                input: vec!["a".into()],
                output: vec!["a_next".into()],
                attribute: vec![listed],
                ..Default::default()
            }],
            ..Default::default()
        };
        let model = ModelProto {
            opset_import: vec![OperatorSetIdProto {
                domain: Some(String::new()),
                version: Some(17),
            }],
            graph: Some(GraphProto {
                name: Some("g".into()),
                input: vec![info("m"), info("a0")],
                output: vec![info("a_last")],
                node: vec![NodeProto {
                    name: Some("loop".into()),
                    op_type: Some("Loop".into()),
                    input: vec!["m".into(), String::new(), "a0".into()],
                    output: vec!["a_last".into()],
                    attribute: vec![AttributeProto {
                        name: Some("body".into()),
                        r#type: Some(AttributeType::Graph as i32),
                        g: Some(body),
                        ..Default::default()
                    }],
                    ..Default::default()
                }],
                ..Default::default()
            }),
            ..Default::default()
        };
        let model = Model::from_proto(model);
        let the_loop = model.body_nodes(BodyId::MAIN).next().expect("the Loop");
        let Err(why) = LoopParts::of(&model, the_loop) else {
            panic!("a body with a list of graphs was taken");
        };
        assert!(why.contains("Custom 'listing'"), "{why}");
        assert!(why.contains("list of graphs"), "{why}");
    }
}
