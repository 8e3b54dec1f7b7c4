//! A while loop that counts up to a bound, as a counted `Loop` (`lower-for-tract` only, before
//! [`super::loop_as_scan`] makes counted Loops Scans: tract-onnx 0.23 has no Loop).
//!
//! TensorFlow's while loops come out of tf2onnx without `M`, the body computing the
//! condition: a counter `v`, carried from `v₀` and stepped by one, compared with a bound `u`
//! the body does not change (Keras's recurrent layers over a run-time length:
//! `Less(Cast(t + 1), Cast(T))`):
//!
//! ```text
//! Loop("", Less(c(v₀), c(u₀)), …, v₀, …, u₀, …)      c: the same Casts on both sides (or none)
//!   body (i, cond, …, v, …, u, …) -> (Less(c(v'), c(u)), …, v' = v + 1, …, u, …)
//! ```
//!
//! Iteration k runs while `v₀ + k < u₀`, so there are `N = max(0, u₀ - v₀)` of them:
//!
//! ```text
//! Loop(N, "", …)   body (i, cond, …) -> (cond, …)         (M given: min(M, N))
//! ```
//!
//! The bound may also be a value of an enclosing graph, read by the body directly. Counter
//! and bound must be integers; through Casts to floating point the comparison is the same
//! for counts below 2²⁴ (a float's exact integers), far beyond any sequence a loop steps
//! through. The body's comparison, now unread, is removed with what only it read.

use crate::ir::builder::{attr_int, tensor_i64, Builder, NodeAttributes};
use crate::ir::{BodyId, Model, NodeId, ValueDef, ValueId};
use crate::passes::autodiff::shapes::constant_tensor;
use crate::passes::PassError;
use crate::proto::elem::{DOUBLE, FLOAT, INT32, INT64};

/// What makes a while loop a counted one.
struct Counting {
    body: BodyId,
    /// The counter as the body reads it, and its next value `v + 1`.
    counter: ValueId,
    next: ValueId,
    /// The counter's start, a Loop input.
    start: ValueId,
    /// The bound's value before the first iteration: a Loop input, or an outer value.
    bound: ValueId,
}

/// Whether `node` is a while loop this rewrites.
pub fn takes(model: &Model, node: NodeId) -> bool {
    counting(model, node).is_some()
}

fn counting(model: &Model, node: NodeId) -> Option<Counting> {
    if !crate::passes::autodiff::is_loop(model, node) {
        return None;
    }
    let n = model.node(node);
    let body = model.subgraph(node, "body")?;
    let outer = n.body;
    let first = n.inputs.get(1).copied().flatten()?;
    let b = model.body(body);
    let condition_out = model.forwarded(b.outputs.first()?.0, body);
    let (next, limit) = less(model, condition_out, body)?;
    let (next, casts) = uncast(model, next, body);
    let (limit, limit_casts) = uncast(model, limit, body);
    if casts != limit_casts {
        return None;
    }
    // v' = v + 1, v' carried as slot k, v the body's input for slot k.
    let slot = (1..b.outputs.len()).find(|s| model.forwarded(b.outputs[*s].0, body) == next)?;
    let counter = b.inputs.get(slot + 1)?.0;
    let counter_is_output = model
        .uses(counter)
        .iter()
        .any(|u| matches!(u, crate::ir::Use::Output { .. }));
    if counter_is_output || !steps_by_one(model, next, counter, body) {
        return None;
    }
    let start = n.inputs.get(slot + 1).copied().flatten()?;
    // The bound: a carried value the body passes on unchanged, or an outer value.
    let bound = match b.inputs.iter().position(|(v, ..)| *v == limit) {
        Some(input) if input >= 2 => {
            let passed_on = b
                .outputs
                .get(input - 1)
                .is_some_and(|(out, ..)| model.forwarded(*out, body) == limit);
            if !passed_on {
                return None;
            }
            n.inputs.get(input).copied().flatten()?
        }
        Some(_) => return None,
        None if model.defining_body(limit) != body => limit,
        None => return None,
    };
    if !is_integer(model, start) || !is_integer(model, bound) {
        return None;
    }
    // The first condition: the same comparison of the start with the bound.
    let (first_counter, first_limit) = less(model, model.forwarded(first, outer), outer)?;
    let (first_limit, first_limit_casts) = uncast(model, first_limit, outer);
    if first_limit != bound || first_limit_casts != casts {
        return None;
    }
    let (first_counter, first_casts) = uncast(model, first_counter, outer);
    let same_start = (first_counter == start && first_casts == casts)
        || same_constant(model, first_counter, start);
    same_start.then_some(Counting {
        body,
        counter,
        next,
        start,
        bound,
    })
}

/// `(a, b)` of `v = Less(a, b)` in `body`.
fn less(model: &Model, v: ValueId, body: BodyId) -> Option<(ValueId, ValueId)> {
    let (node, _) = model.producer(v)?;
    let n = model.node(node);
    if n.body != body || n.proto.op_type() != "Less" || !n.proto.domain().is_empty() {
        return None;
    }
    Some((
        n.inputs.first().copied().flatten()?,
        n.inputs.get(1).copied().flatten()?,
    ))
}

/// `v` without the Casts (to the types that keep a count exact) in front of it in `body`,
/// and their target types, innermost first.
fn uncast(model: &Model, mut v: ValueId, body: BodyId) -> (ValueId, Vec<i64>) {
    let mut casts = Vec::new();
    while let Some((node, _)) = model.producer(v) {
        let n = model.node(node);
        let to = n.proto.attr_int("to").ok().flatten();
        match (n.proto.op_type(), to, n.inputs.first()) {
            ("Cast", Some(to), Some(Some(x)))
                if n.body == body
                    && n.proto.domain().is_empty()
                    && matches!(to as i32, FLOAT | DOUBLE | INT32 | INT64) =>
            {
                casts.push(to);
                v = *x;
            }
            _ => break,
        }
    }
    casts.reverse();
    (v, casts)
}

/// Whether `next` is `Add(counter, 1)` (either order) in `body`.
fn steps_by_one(model: &Model, next: ValueId, counter: ValueId, body: BodyId) -> bool {
    let Some((node, _)) = model.producer(next) else {
        return false;
    };
    let n = model.node(node);
    if n.body != body || n.proto.op_type() != "Add" || !n.proto.domain().is_empty() {
        return false;
    }
    let (Some(Some(a)), Some(Some(b))) = (n.inputs.first(), n.inputs.get(1)) else {
        return false;
    };
    let one = |v: ValueId| scalar(model, v) == Some(1.0);
    (*a == counter && one(*b)) || (*b == counter && one(*a))
}

fn scalar(model: &Model, v: ValueId) -> Option<f64> {
    constant_tensor(model, v).and_then(crate::ir::emit::tensor_scalar)
}

/// Two one-element constants holding the same integer (tf2onnx folds `Cast(v₀)` of a
/// constant start into a constant of the cast type).
fn same_constant(model: &Model, a: ValueId, b: ValueId) -> bool {
    matches!((scalar(model, a), scalar(model, b)), (Some(x), Some(y)) if x == y && x.fract() == 0.0)
}

fn is_integer(model: &Model, v: ValueId) -> bool {
    matches!(super::util::elem_type(model, v), Some(INT32) | Some(INT64))
}

/// Rewrites the while loop `node` (which [`takes`] took) into a counted Loop; returns the
/// nodes added.
pub fn rewrite(model: &mut Model, node: NodeId, stamp: &'static str) -> Result<usize, PassError> {
    let Some(c) = counting(model, node) else {
        return Ok(0);
    };
    let outer = model.node(node).body;
    let given = model.node(node).inputs.first().copied().flatten();
    let mut b = Builder::new(model, outer, stamp);
    // N = max(0, u₀ - v₀), as an int64 scalar (min(M, N) with M given).
    let to_i64 = vec![attr_int("to", INT64 as i64)];
    let bound = b.op("Cast", &[c.bound], to_i64.clone(), "while_bound");
    let start = b.op("Cast", &[c.start], to_i64, "while_start");
    let difference = b.op("Sub", &[bound, start], vec![], "while_remaining");
    let scalar_shape = b.constant("while_scalar_shape", tensor_i64(&[0], &[]));
    let difference = b.op(
        "Reshape",
        &[difference, scalar_shape],
        vec![],
        "while_remaining",
    );
    let zero = b.constant("while_zero", tensor_i64(&[], &[0]));
    let mut trips = b.op("Max", &[difference, zero], vec![], "while_trip_count");
    if let Some(m) = given {
        let m = b.op("Reshape", &[m, scalar_shape], vec![], "while_max_trips");
        trips = b.op("Min", &[m, trips], vec![], "while_trip_count");
    }
    let mut added = b.added;
    let first = model.node(node).inputs.get(1).copied().flatten();
    model.set_input(node, 0, Some(trips));
    model.set_input(node, 1, None);
    if let Some(first) = first {
        remove_unread(model, first, outer, stamp)?;
    }

    // The body passes its condition through, and reads the counter as v₀ + i: tract drops
    // a Scan's scan input that nothing reads (the iteration number, here), and then has
    // none to count with.
    let condition_in = model.body(c.body).inputs[1].0;
    let iteration = model.body(c.body).inputs[0].0;
    let counter_elem = super::util::elem_type(model, c.start).unwrap_or(INT64);
    let start_value = scalar(model, c.start);
    let mut inner = Builder::new(model, c.body, stamp);
    let passed = inner.op("Identity", &[condition_in], vec![], "cond_passed");
    let mut count = inner.op(
        "Cast",
        &[iteration],
        vec![attr_int("to", counter_elem as i64)],
        "while_count",
    );
    if start_value != Some(0.0) {
        count = inner.op("Add", &[c.start, count], vec![], "while_count");
    }
    added += inner.added;
    // The step `v + 1` still reads v: tract also drops a state nothing reads, and then
    // counts its states wrong.
    let increment = model.producer(c.next).map(|(n, _)| n);
    for u in model.uses(c.counter).to_vec() {
        if let crate::ir::Use::Node { node, slot } = u {
            if Some(node) != increment {
                model.set_input(node, slot, Some(count));
            }
        }
    }
    let old = model.body(c.body).outputs[0].0;
    model.set_output(c.body, 0, passed);
    remove_unread(model, old, c.body, stamp)?;
    Ok(added)
}

/// Removes the node making `v` in `body` when nothing reads `v` any more, and so on up its
/// inputs (the body's comparison and its Casts; the counter stays, carried).
fn remove_unread(
    model: &mut Model,
    v: ValueId,
    body: BodyId,
    stamp: &'static str,
) -> Result<(), PassError> {
    let mut pending = vec![v];
    while let Some(v) = pending.pop() {
        let ValueDef::Node { node, .. } = model.value(v).def else {
            continue;
        };
        let n = model.node(node);
        let unread = n
            .outputs
            .iter()
            .flatten()
            .all(|o| model.uses(*o).is_empty());
        if n.body != body || n.removed || !unread {
            continue;
        }
        let inputs: Vec<ValueId> = n.inputs.iter().flatten().copied().collect();
        model.remove_node(node).map_err(|e| PassError::Other {
            pass: stamp.into(),
            message: format!("making a while loop a counted Loop: {e}"),
        })?;
        pending.extend(inputs);
    }
    Ok(())
}
