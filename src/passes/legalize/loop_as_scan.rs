//! A counted `Loop` as a `Scan`, for tract (`lower-for-tract` only; ONNX Runtime runs the
//! Loop, tract-onnx 0.23 has no Loop but has Scan). The Loops this takes are the ones that
//! run exactly `M` iterations: a recurrent layer over a run-time length made into a Loop
//! (`unroll_rnn`), and every backward Loop `loop_grad` builds:
//!
//! ```text
//! Loop(M, cond, v₀…)  body (i, c, v…) -> (c', v'…, s…)    with c' = c (or true), c read by
//!                                                          nothing else, cond absent or true
//! Scan(v₀…, Range(0, M, 1); num_scan_inputs = 1)  body (v…, i) -> (v'…, s…)
//! ```
//!
//! The iteration number becomes the scan input's element (step i of `[0, 1, …, M-1]`); the
//! outputs (last carried values, stacked scan outputs) are the same. The node and its body
//! are changed in place. A Loop whose condition the body computes (TensorFlow's while loops)
//! is not taken: its trip count is not M.

use crate::ir::builder::{attr_int, tensor_i64, Builder};
use crate::ir::{tensor_type, BodyId, Model, NodeId, Use, ValueDef, ValueId};
use crate::passes::PassError;
use crate::proto::elem::INT64;

/// Whether `node` is a Loop this rewrites: `M` given, the first condition absent or a
/// constant true, the body's condition output its condition input (through Identities) or a
/// constant true, and that input read by nothing else.
pub fn takes(model: &Model, node: NodeId) -> bool {
    parts(model, node).is_some()
}

struct Parts {
    body: BodyId,
    trip_count: ValueId,
    /// The body's condition input, and the nodes between it and the condition output.
    condition: ValueId,
    forwarding: Vec<NodeId>,
}

fn parts(model: &Model, node: NodeId) -> Option<Parts> {
    if !crate::passes::autodiff::is_loop(model, node) {
        return None;
    }
    let n = model.node(node);
    let body = model.subgraph(node, "body")?;
    let trip_count = n.inputs.first().copied().flatten()?;
    if let Some(Some(first)) = n.inputs.get(1) {
        if !is_constant_true(model, *first) {
            return None;
        }
    }
    let b = model.body(body);
    let condition = b.inputs.get(1)?.0;
    let mut out = b.outputs.first()?.0;
    // The condition output, back through Identities to the condition input.
    let mut forwarding = Vec::new();
    while let Some((producer, 0)) = model.producer(out) {
        let pn = model.node(producer);
        match (pn.proto.op_type(), pn.inputs.first()) {
            ("Identity", Some(Some(x))) if pn.body == body => {
                forwarding.push(producer);
                out = *x;
            }
            _ => break,
        }
    }
    if out != condition && !is_constant_true(model, out) {
        return None;
    }
    // The condition input feeds nothing but that chain (or nothing at all).
    let only_forwarded = model.uses(condition).iter().all(|u| match u {
        Use::Node { node, .. } => forwarding.contains(node),
        Use::Output { body: b, index } => *b == body && *index == 0,
    });
    only_forwarded.then_some(Parts {
        body,
        trip_count,
        condition,
        forwarding,
    })
}

/// A bool initializer or Constant holding one `true`.
fn is_constant_true(model: &Model, v: ValueId) -> bool {
    let tensor = match model.value(v).def {
        ValueDef::Initializer { .. } => model.initializer(v).cloned(),
        ValueDef::Node { node, .. } if model.node(node).proto.op_type() == "Constant" => model
            .node(node)
            .proto
            .attribute
            .iter()
            .find(|a| a.name() == "value")
            .and_then(|a| a.t.clone()),
        _ => None,
    };
    tensor.is_some_and(|t| {
        t.data_type() == crate::proto::elem::BOOL
            && match &t.raw_data {
                Some(raw) => raw.len() == 1 && raw[0] != 0,
                None => t.int32_data.len() == 1 && t.int32_data[0] != 0,
            }
    })
}

/// Rewrites the Loop `node` (which [`takes`] took) into a Scan in place.
pub fn rewrite(model: &mut Model, node: NodeId, stamp: &'static str) -> Result<usize, PassError> {
    let Some(parts) = parts(model, node) else {
        return Ok(0);
    };
    let outer = model.node(node).body;
    let mut b = Builder::new(model, outer, stamp);
    let scalar = b.constant("scan_scalar_shape", tensor_i64(&[0], &[]));
    let steps = b.op("Reshape", &[parts.trip_count, scalar], vec![], "scan_steps");
    let zero = b.constant("scan_zero", tensor_i64(&[], &[0]));
    let one = b.constant("scan_one", tensor_i64(&[], &[1]));
    let iterations = b.op("Range", &[zero, steps, one], vec![], "scan_iterations");
    let mut added = b.added;

    // The node: Scan(v₀…, iterations).
    let carried: Vec<Option<ValueId>> = model.node(node).inputs.iter().skip(2).copied().collect();
    let slots = model.node(node).inputs.len();
    for slot in 0..slots {
        model.set_input(node, slot, None);
    }
    model.node_mut(node).inputs.clear();
    for (slot, v) in carried.iter().enumerate() {
        if let Some(v) = v {
            model.set_input_growing(node, slot, *v);
        }
    }
    model.set_input_growing(node, carried.len(), iterations);
    let proto = &mut model.node_mut(node).proto;
    proto.op_type = Some("Scan".into());
    proto.attribute.push(attr_int("num_scan_inputs", 1));

    // The body: no condition; the iteration number last, as the scan input's element.
    model.remove_output(parts.body, 0);
    for n in parts.forwarding {
        model.remove_node(n).map_err(|e| PassError::Other {
            pass: stamp.into(),
            message: format!("rewriting a Loop as a Scan: {e}"),
        })?;
    }
    model
        .remove_input(parts.condition)
        .map_err(|e| PassError::Other {
            pass: stamp.into(),
            message: format!("rewriting a Loop as a Scan: {e}"),
        })?;
    let inputs = &mut model.body_mut(parts.body).inputs;
    let iteration = inputs.remove(0);
    let iteration_number = iteration.0;
    inputs.push(iteration);
    // tract drops a Scan body's input that nothing reads, and with its only scan input gone
    // cannot type the Scan ("No scan input"); it drops a scan output nothing outside reads
    // too (a kept Loop's stack of iteration numbers, once tract has folded the Size the
    // backward reads of it). A body that computes nothing from its iteration number (a Loop
    // nested in a kept Loop's body) carries one more state, the largest iteration number
    // so far, which reads it.
    if only_returned(model, parts.body, iteration_number) {
        let carried_count = carried.len();
        let hint = "scan_iteration_seen";
        let mut b = Builder::new(model, outer, stamp);
        let start = b.constant(hint, tensor_i64(&[], &[0]));
        added += b.added;
        // The node: the state's start after the carried values, before the scan input.
        model.set_input(node, carried_count, Some(start));
        model.set_input_growing(node, carried_count + 1, iterations);
        // The body: its input before the iteration number, its next value after the
        // carried values' outputs.
        let scalar = tensor_type(INT64, &[]);
        let seen = model.add_input(parts.body, hint, scalar.clone(), None);
        let inputs = &mut model.body_mut(parts.body).inputs;
        let entry = inputs.remove(inputs.len() - 1);
        inputs.insert(carried_count, entry);
        let mut b = Builder::new(model, parts.body, stamp);
        let next = b.op("Max", &[seen, iteration_number], vec![], hint);
        added += b.added;
        model.insert_output(parts.body, carried_count, next, Some(scalar));
        for slot in 0..carried_count {
            model.ensure_node_output(node, slot, &format!("scan_out{slot}"));
        }
        model.insert_node_output(node, carried_count, hint);
    }
    open_symbolic_dims(model.body_mut(parts.body));
    Ok(added + distinct_outputs(model, parts.body, stamp))
}

/// Whether `body` computes nothing from `v`: nothing reads it, or only body outputs and
/// Identities that are body outputs.
fn only_returned(model: &Model, body: BodyId, v: ValueId) -> bool {
    model.uses(v).iter().all(|u| match u {
        Use::Output { .. } => true,
        Use::Node { node, .. } => {
            let n = model.node(*node);
            n.body == body
                && n.proto.op_type() == "Identity"
                && n.outputs.iter().flatten().all(|o| {
                    model
                        .uses(*o)
                        .iter()
                        .all(|u| matches!(u, Use::Output { body: b, .. } if *b == body))
                })
        }
    })
}

/// Gives a body output an Identity of its own where tract needs one: an output that is a
/// body input itself (a value carried on unchanged, as TensorFlow's while loops carry the
/// cell's weights: tract wants outputs distinct from inputs), and a scan output that the body
/// reads too (tract puts its stacking axis onto that value for every reader: tf2onnx's GRU
/// steps carry `Identity(h)` next to the scan output `h`). Returns the nodes added.
fn distinct_outputs(model: &mut Model, body: BodyId, stamp: &'static str) -> usize {
    let inputs: Vec<ValueId> = model.body(body).inputs.iter().map(|(v, _)| *v).collect();
    let outputs: Vec<ValueId> = model.body(body).outputs.iter().map(|(v, _)| *v).collect();
    // Carried values come first: as many as the body has inputs besides the scan input.
    let carried = inputs.len().saturating_sub(1);
    let mut b = Builder::new(model, body, stamp);
    for (index, out) in outputs.into_iter().enumerate() {
        let read_elsewhere = b.model.uses(out).iter().any(|u| match u {
            Use::Node { .. } => true,
            Use::Output {
                body: other,
                index: i,
            } => *other != body || *i != index,
        });
        if inputs.contains(&out) || (index >= carried && read_elsewhere) {
            let hint = format!("{}_out", b.model.name(out));
            let copy = b.op("Identity", &[out], vec![], &hint);
            b.model.set_output(body, index, copy);
        }
    }
    b.added
}

/// Leaves the body's named dims open: tract binds a symbol per graph, so a body input
/// declared `[unk__470, 6]` (tf2onnx names every dim it does not know) cannot unify with
/// the batch of 8 the outer graph gives it.
fn open_symbolic_dims(body: &mut crate::ir::Body) {
    use crate::proto::tensor_shape_proto::dimension::Value;
    use crate::proto::type_proto;
    let infos = body
        .inputs
        .iter_mut()
        .chain(body.outputs.iter_mut())
        .chain(body.value_info.iter_mut())
        .map(|(_, info)| info);
    for info in infos {
        let Some(type_proto::Value::TensorType(tensor)) =
            info.r#type.as_mut().and_then(|t| t.value.as_mut())
        else {
            continue;
        };
        for dim in tensor.shape.iter_mut().flat_map(|s| s.dim.iter_mut()) {
            if matches!(dim.value, Some(Value::DimParam(_))) {
                dim.value = None;
            }
        }
    }
}
