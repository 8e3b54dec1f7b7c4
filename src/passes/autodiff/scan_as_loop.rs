//! A `Scan` of the forward model as the `Loop` it is, before the Loops are unrolled
//! (`unroll_loop`, where the sequence length is known) or differentiated as Loops
//! (`loop_grad`): no rule of its own is needed.
//!
//! ONNX's Scan (opset 9 on), with N state variables, M scan inputs and K scan outputs:
//!
//! ```text
//! S…, Y… = Scan(s₀…, X…)   body (s…, x…) -> (s'…, y…)
//!   x_k = step t of X_k along scan_input_axes[k], t counting down where
//!         scan_input_directions[k] = 1; Y_k stacks the steps' y_k along
//!         scan_output_axes[k], in reverse where scan_output_directions[k] = 1
//! ```
//!
//! becomes, with `T` the length of X₀'s scan axis:
//!
//! ```text
//! X'_k = X_k with its scan axis moved first (Transpose)
//! S…, Z… = Loop(T, -, s₀…)  body (i, c, s…):  x_k = Gather(X'_k, i or T - 1 - i)
//!                                             s'…, y… = the Scan body's nodes
//!                                             -> (c, s'…, y…)
//! Y_k = Z_k, reversed on axis 0 (Gather at T-1…0) where its direction is 1, its axis 0
//!       moved to scan_output_axes[k] (Transpose) where that is not 0
//! ```
//!
//! Not rewritten (an error naming the node): opset 8's Scan (its first input is the batch's
//! sequence lengths), attributes that do not match the inputs, a scan axis other than 0
//! on a value whose rank is not known. Control flow in the body moves into the Loop's body
//! with it; a Scan in a body is rewritten in that body.

use std::collections::HashMap;

use crate::ir::builder::{attr_int, attr_ints, tensor_i64, Builder, NodeAttributes};
use crate::ir::{tensor_type, Model, NodeId, ValueId};
use crate::passes::PassError;
use crate::proto::elem::{BOOL, INT64};

use super::loop_parts::{computed_in, copy_body};
use super::rules::node_error;
use super::shapes::{type_of_facts, Shapes};

/// Whether an op of the default domain is a Scan (`normalize`'s selector).
pub fn is_scan(op: &str) -> bool {
    op == "Scan"
}

/// The Scan `node` replaced by a Loop (see the module docs).
pub fn rewrite(
    model: &mut Model,
    node: NodeId,
    shapes: &Shapes,
    pass: &'static str,
) -> Result<(), PassError> {
    let fail = |model: &Model, message: String| node_error(model, node, message);
    if model.opset("").unwrap_or(1) < 9 {
        return Err(fail(
            model,
            "Scan before opset 9 (its first input is the sequence lengths) is not supported".into(),
        ));
    }
    let Some(body) = model.subgraph(node, "body") else {
        return Err(fail(model, "it has no body".into()));
    };
    if let Some(why) = super::loop_parts::not_copied(model, body) {
        return Err(fail(model, format!("its body: {why}")));
    }
    let n = model.node(node).clone();
    let p = &n.proto;
    // The body the Scan is in (the main graph, or a body where control flow nests).
    let home = n.body;
    let scans = p
        .attr_int("num_scan_inputs")
        .ok()
        .flatten()
        .and_then(|m| usize::try_from(m).ok())
        .ok_or_else(|| fail(model, "num_scan_inputs is required".into()))?;
    let inputs: Vec<ValueId> = n
        .inputs
        .iter()
        .map(|v| v.ok_or_else(|| fail(model, "an input is absent".into())))
        .collect::<Result<_, _>>()?;
    let body_inputs: Vec<ValueId> = model.body(body).inputs.iter().map(|(v, _)| *v).collect();
    let body_outputs: Vec<ValueId> = model.body(body).outputs.iter().map(|(v, _)| *v).collect();
    if scans == 0 || scans > inputs.len() || body_inputs.len() != inputs.len() {
        return Err(fail(
            model,
            format!(
                "{} inputs, {scans} of them scanned, for a body of {} inputs",
                inputs.len(),
                body_inputs.len()
            ),
        ));
    }
    let states = inputs.len() - scans;
    if body_outputs.len() < states || n.outputs.len() != body_outputs.len() {
        return Err(fail(
            model,
            format!(
                "{} outputs for a body of {} outputs and {states} states",
                n.outputs.len(),
                body_outputs.len()
            ),
        ));
    }
    let outs = body_outputs.len() - states;
    let list = |name: &str, len: usize, default: i64| -> Result<Vec<i64>, PassError> {
        match p.attr_ints(name).ok().flatten() {
            None => Ok(vec![default; len]),
            Some(v) if v.len() == len => Ok(v),
            Some(v) => Err(fail(
                model,
                format!("{name} has {} entries for {len}", v.len()),
            )),
        }
    };
    let in_axes = list("scan_input_axes", scans, 0)?;
    let in_reversed = list("scan_input_directions", scans, 0)?;
    let out_axes = list("scan_output_axes", outs, 0)?;
    let out_reversed = list("scan_output_directions", outs, 0)?;
    let scanned = &inputs[states..];
    // Each axis in [0, rank): negative ones count from the rank.
    let axis_in = |axis: i64, rank: Option<usize>, what: String| -> Result<i64, PassError> {
        match (axis, rank) {
            (a, _) if a >= 0 && rank.is_none_or(|r| (a as usize) < r) => Ok(a),
            (a, Some(r)) if a < 0 && a + (r as i64) >= 0 => Ok(a + r as i64),
            _ => Err(fail(
                model,
                format!("{what}: axis {axis} of an unknown or smaller rank"),
            )),
        }
    };
    let in_axes: Vec<i64> = in_axes
        .iter()
        .zip(scanned)
        .map(|(a, x)| {
            axis_in(
                *a,
                shapes.get(*x).rank(),
                format!("scan input '{}'", model.name(*x)),
            )
        })
        .collect::<Result<_, _>>()?;
    let out_ranks: Vec<Option<usize>> = body_outputs[states..]
        .iter()
        .map(|y| {
            shapes
                .get(*y)
                .rank()
                .or_else(|| declared_rank(model, *y))
                .map(|r| r + 1)
        })
        .collect();
    let out_axes: Vec<i64> = out_axes
        .iter()
        .zip(&out_ranks)
        .zip(&n.outputs[states..])
        .map(|((a, r), y)| {
            let name = y.map(|y| model.name(y).to_string()).unwrap_or_default();
            match (*a, r) {
                (0, _) => Ok(0),
                (a, None) => Err(fail(
                    model,
                    format!("scan output '{name}': axis {a} of a rank not known"),
                )),
                (a, Some(r)) => axis_in(a, Some(*r), format!("scan output '{name}'")),
            }
        })
        .collect::<Result<_, _>>()?;

    let label = match p.name() {
        "" => "scan".to_string(),
        name => name.to_string(),
    };
    let in_ranks: Vec<Option<usize>> = scanned.iter().map(|x| shapes.get(*x).rank()).collect();
    let mut b = Builder::new(model, home, pass);
    // Each scan input with its scan axis first, so that a step is a Gather on axis 0 (what
    // the unrolling splits and a kept Loop's gradient scatters).
    let mut firsts = Vec::new();
    for (k, x) in scanned.iter().enumerate() {
        let first = match (in_axes[k], in_ranks[k]) {
            (0, _) => *x,
            (a, Some(rank)) => {
                let mut perm: Vec<i64> = (0..rank as i64).filter(|d| *d != a).collect();
                perm.insert(0, a);
                let hint = format!("{}_steps_first", b.model.name(*x));
                b.op("Transpose", &[*x], vec![attr_ints("perm", &perm)], &hint)
            }
            (a, None) => {
                let name = b.model.name(*x).to_string();
                return Err(node_error(
                    b.model,
                    node,
                    format!("scan input '{name}': axis {a} of a rank not known"),
                ));
            }
        };
        firsts.push(first);
    }
    // T: the length of the first scan input's axis.
    let shape = b.op("Shape", &[firsts[0]], vec![], &format!("{label}_shape"));
    let axis = b
        .model
        .add_initializer(home, &format!("{label}_axis"), tensor_i64(&[], &[0]));
    let steps = b.op("Gather", &[shape, axis], vec![], &format!("{label}_steps"));
    let hints: Vec<String> = n
        .outputs
        .iter()
        .enumerate()
        .map(|(slot, o)| match o {
            Some(o) if slot >= states => format!("{}_stacked", b.model.name(*o)),
            Some(o) => b.model.name(*o).to_string(),
            None => format!("{label}_out{slot}"),
        })
        .collect();
    let hint_refs: Vec<&str> = hints.iter().map(String::as_str).collect();
    let mut loop_inputs = vec![Some(steps), None];
    loop_inputs.extend(inputs[..states].iter().map(|v| Some(*v)));
    let the_loop = b.node("Loop", "", &loop_inputs, &hint_refs, vec![]);
    let loop_body = b.model.add_subgraph(the_loop, "body");

    // The Loop's body: its inputs, the steps of the scan inputs, the Scan body's nodes.
    let mut b = Builder::new(model, loop_body, pass);
    let i = b
        .model
        .add_input(loop_body, "i", tensor_type(INT64, &[]), None);
    let c = b
        .model
        .add_input(loop_body, "cond", tensor_type(BOOL, &[]), None);
    let mut copies: HashMap<ValueId, ValueId> = HashMap::new();
    for (k, v) in body_inputs[..states].iter().enumerate() {
        let ty = b
            .model
            .value_type(*v)
            .or_else(|| type_of_facts(&shapes.get(inputs[k])))
            .unwrap_or_default();
        let name = b.model.name(*v).to_string();
        let s = b.model.add_input(loop_body, &name, ty, None);
        copies.insert(*v, s);
    }
    let one = b
        .model
        .add_initializer(loop_body, &format!("{label}_one"), tensor_i64(&[], &[1]));
    for (k, x) in firsts.iter().enumerate() {
        let step = match in_reversed[k] {
            0 => i,
            _ => {
                let last = b.op("Sub", &[steps, one], vec![], &format!("{label}_last"));
                b.op("Sub", &[last, i], vec![], &format!("{label}_back"))
            }
        };
        let hint = b.model.name(body_inputs[states + k]).to_string();
        let x_t = b.op("Gather", &[*x, step], vec![], &hint);
        copies.insert(body_inputs[states + k], x_t);
    }
    copy_body(&mut b, body, &mut copies);
    let cond_out = b.op("Identity", &[c], vec![], "cond_out");
    b.model
        .add_output(loop_body, cond_out, Some(tensor_type(BOOL, &[])));
    for y in &body_outputs {
        let copy = copies.get(y).copied().unwrap_or(*y);
        let hint = format!("{}_out", b.model.name(*y));
        let out = computed_in(&mut b, copy, &hint);
        let ty = b.model.value_type(*y);
        b.model.add_output(loop_body, out, ty);
    }

    // The Scan's outputs from the Loop's: its states as they are, each scan output reversed
    // and its axis moved where the Scan says.
    let mut b = Builder::new(model, home, pass);
    let mut replacements = Vec::new();
    for (slot, out) in n.outputs.iter().enumerate() {
        let Some(out) = out else { continue };
        let mut v = b.model.output(the_loop, slot);
        if slot >= states {
            let k = slot - states;
            let name = b.model.name(*out).to_string();
            if out_reversed[k] != 0 {
                // Gathered at T - 1, ..., 0 (a Slice with step -1 would need T before the
                // run for its gradient).
                let minus_one = b.model.add_initializer(
                    home,
                    &format!("{name}_minus_one"),
                    tensor_i64(&[], &[-1]),
                );
                let last = b.op("Add", &[steps, minus_one], vec![], &format!("{name}_last"));
                let order = b.op(
                    "Range",
                    &[last, minus_one, minus_one],
                    vec![],
                    &format!("{name}_backwards"),
                );
                v = b.op(
                    "Gather",
                    &[v, order],
                    vec![attr_int("axis", 0)],
                    &format!("{name}_reversed"),
                );
            }
            if let (a @ 1.., Some(rank)) = (out_axes[k], out_ranks[k]) {
                let a = a as usize;
                let mut perm: Vec<i64> = (1..rank as i64).collect();
                perm.insert(a, 0);
                v = b.op(
                    "Transpose",
                    &[v],
                    vec![attr_ints("perm", &perm)],
                    &format!("{name}_on_axis"),
                );
            }
        }
        replacements.push((*out, v));
    }
    for (old, new) in replacements {
        model.replace_value(old, new);
    }
    model.discard_body(body);
    model
        .remove_node(node)
        .map_err(|e| node_error(model, node, format!("could not replace the node: {e}")))
}

/// The rank a value's declared type gives.
fn declared_rank(model: &Model, v: ValueId) -> Option<usize> {
    model.value_type(v)?.tensor_dims().map(|d| d.len())
}
