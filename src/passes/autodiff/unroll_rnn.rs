//! Recurrent layers unrolled into their cell equations, so that the autodiff differentiates
//! them with the rules it has (MatMul, Add, Mul, Sigmoid, Tanh, Relu, Slice, Concat, ...)
//! and no recurrent backward op is needed. The batch may be dynamic.
//!
//! Per direction `d` (ONNX's equations; `⊙` elementwise, `W`, `R`, `B`, `P` the node's
//! weights for `d`, gates in ONNX's order, `f`, `g`, `h` the node's activations):
//!
//! ```text
//! XW = X · Wᵀ + Wb (+ Rb)             one MatMul over every time step
//! LSTM (gates i o f c)  i = f(XWi + H·Riᵀ + Pi ⊙ C)      f' = f(XWf + H·Rfᵀ + Pf ⊙ C)
//!                       c̃ = g(XWc + H·Rcᵀ)              C' = f' ⊙ C + i ⊙ c̃
//!                       o = f(XWo + H·Roᵀ + Po ⊙ C')     H' = o ⊙ h(C')
//! GRU (gates z r h)     z = f(XWz + H·Rzᵀ + Rbz)         r = f(XWr + H·Rrᵀ + Rbr)
//!                       h̃ = g(XWh + (r ⊙ H)·Rhᵀ + Rbh)          linear_before_reset = 0
//!                       h̃ = g(XWh + r ⊙ (H·Rhᵀ + Rbh))          linear_before_reset = 1
//!                       H' = (1 - z) ⊙ h̃ + z ⊙ H
//! RNN                   H' = f(XW + H·Rᵀ)
//! ```
//!
//! Without `initial_h` (`initial_c`) the first cell's state is zero, and its terms are left
//! out rather than computed from zeros. The reverse direction runs the time steps backwards.
//! Outputs: `Y` stacks every step's H in time order, `Y_h` (`Y_c`) is the last cell's.
//!
//! A sequence length known only at run time (or `--loops keep`, from opset 16) makes one
//! `Loop` per direction instead, the cell once in its body, its states carried and every H
//! a scan output; `loop_grad` differentiates it.
//!
//! Not supported (a clear error naming the node): `sequence_lens`, `clip`,
//! `input_forget`, `layout` = 1 (which ONNX Runtime's kernels refuse as well), activations
//! other than Sigmoid, Tanh and Relu, a run-time sequence length before opset 16, opsets
//! before 10.

use crate::ir::builder::{attr_int, attr_ints, attr_tensor, Builder, NodeAttributes};
use crate::ir::emit::Emit;
use crate::ir::{BodyId, Model, NodeId, ValueId};
use crate::passes::PassError;
use crate::proto::elem::{BOOL, INT64};

use super::normalize::LoopMode;
use super::rules::node_error;
use super::shapes::{type_of, Dim, Shapes};

#[derive(Clone, Copy, PartialEq, Eq)]
enum Cell {
    Lstm,
    Gru { linear_before_reset: bool },
    Rnn,
}

impl Cell {
    fn gates(self) -> i64 {
        match self {
            Cell::Lstm => 4,
            Cell::Gru { .. } => 3,
            Cell::Rnn => 1,
        }
    }

    fn default_activations(self) -> &'static [&'static str] {
        match self {
            Cell::Lstm => &["Sigmoid", "Tanh", "Tanh"],
            Cell::Gru { .. } => &["Sigmoid", "Tanh"],
            Cell::Rnn => &["Tanh"],
        }
    }
}

/// Whether `op` (default domain) is a recurrent layer this module unrolls.
pub fn is_recurrent(op: &str) -> bool {
    matches!(op, "LSTM" | "GRU" | "RNN")
}

/// What one direction's cells read.
struct Direction {
    /// `[S, N, G·H]`: X · Wᵀ plus the biases that add outside the recurrence.
    xw: ValueId,
    /// `[1, H, G·H]`.
    r_t: ValueId,
    /// `[1, G·H]`, the recurrent bias where it must stay with the recurrent term (GRU).
    rb: Option<ValueId>,
    /// `[1, 3H]` peepholes (LSTM).
    p: Option<ValueId>,
    /// `[1, N, H]` initial states.
    h0: Option<ValueId>,
    c0: Option<ValueId>,
    activations: Vec<String>,
    reverse: bool,
}

pub fn unroll(
    model: &mut Model,
    node: NodeId,
    shapes: &Shapes,
    loops: LoopMode,
    pass: &'static str,
) -> Result<(), PassError> {
    let err = |model: &Model, m: String| node_error(model, node, m);
    let n = model.node(node).clone();
    let p = &n.proto;
    let cell = match p.op_type() {
        "LSTM" => Cell::Lstm,
        "GRU" => Cell::Gru {
            linear_before_reset: p
                .attr_int("linear_before_reset")
                .map_err(|e| err(model, e))?
                .unwrap_or(0)
                != 0,
        },
        _ => Cell::Rnn,
    };
    let opset = model.opset("").unwrap_or(1);
    if opset < 10 {
        return Err(err(model, format!("unrolling a recurrent layer needs opset 10 or later (Slice with inputs); this model has {opset}")));
    }
    let hidden = p
        .attr_int("hidden_size")
        .map_err(|e| err(model, e))?
        .filter(|h| *h > 0)
        .ok_or_else(|| err(model, "attribute 'hidden_size' is missing".into()))?;
    let direction = p
        .attr_string("direction")
        .map_err(|e| err(model, e))?
        .unwrap_or_else(|| "forward".into());
    let reverse_flags: Vec<bool> = match direction.as_str() {
        "forward" => vec![false],
        "reverse" => vec![true],
        "bidirectional" => vec![false, true],
        other => return Err(err(model, format!("direction '{other}' is not supported"))),
    };
    // ONNX Runtime's recurrent kernels refuse layout 1 (batch first) too.
    if p.attr_int("layout")
        .map_err(|e| err(model, e))?
        .unwrap_or(0)
        != 0
    {
        return Err(err(
            model,
            "layout = 1 (batch first) is not supported".into(),
        ));
    }
    if p.attr("clip").is_some() {
        return Err(err(model, "attribute 'clip' is not supported".into()));
    }
    if p.attr_int("input_forget")
        .map_err(|e| err(model, e))?
        .unwrap_or(0)
        != 0
    {
        return Err(err(model, "input_forget = 1 is not supported".into()));
    }
    let per_direction = cell.default_activations().len();
    let activations: Vec<String> = match p.attr_strings("activations").map_err(|e| err(model, e))? {
        Some(a) => a,
        None => reverse_flags
            .iter()
            .flat_map(|_| cell.default_activations().iter().map(|s| s.to_string()))
            .collect(),
    };
    if activations.len() != per_direction * reverse_flags.len() {
        return Err(err(
            model,
            format!(
                "{} activations for {} direction(s); expected {per_direction} each",
                activations.len(),
                reverse_flags.len()
            ),
        ));
    }
    if let Some(bad) = activations
        .iter()
        .find(|a| !matches!(a.as_str(), "Sigmoid" | "Tanh" | "Relu"))
    {
        return Err(err(
            model,
            format!("activation '{bad}' is not supported (Sigmoid, Tanh, Relu are)"),
        ));
    }
    if p.attr("activation_alpha").is_some() || p.attr("activation_beta").is_some() {
        return Err(err(model, "activation_alpha/beta are not supported".into()));
    }
    let input = |i: usize| n.inputs.get(i).copied().flatten();
    let x = input(0).ok_or_else(|| err(model, "input X is absent".into()))?;
    let w = input(1).ok_or_else(|| err(model, "input W is absent".into()))?;
    let r = input(2).ok_or_else(|| err(model, "input R is absent".into()))?;
    if input(4).is_some() {
        return Err(err(
            model,
            "input sequence_lens is not supported (sequences of one length only)".into(),
        ));
    }
    let seq_axis = 0;
    let x_facts = shapes.get(x);
    let batch = x_facts
        .dims
        .as_ref()
        .and_then(|d| d.get(1).cloned())
        .unwrap_or(Dim::Unknown);
    let known_steps = x_facts
        .dims
        .as_ref()
        .and_then(|d| d.get(seq_axis).and_then(|d| d.known()));
    if known_steps == Some(0) {
        return Err(err(model, "the layer has no time steps".into()));
    }
    // Unrolled where the length is known (unless `--loops keep`), else one Loop per
    // direction over the steps the input has at run time. A Loop reads step t of the
    // sequence with a Gather, whose gradient needs opset 16 (scatters that add): before it,
    // a known length is unrolled even with `--loops keep`.
    let loops_possible = opset >= 16;
    let steps = known_steps.filter(|_| loops == LoopMode::Unroll || !loops_possible);
    if steps.is_none() && !loops_possible {
        return Err(err(
            model,
            format!(
                "the sequence length of '{}' is known only at run time, so the layer becomes a Loop over its steps, whose gradient needs opset 16 (ScatterND adding each step's gradient); this model imports opset {opset}",
                model.name(x)
            ),
        ));
    }
    let elem = x_facts.elem.ok_or_else(|| {
        err(
            model,
            format!("the element type of '{}' is not known", model.name(x)),
        )
    })?;
    let hint = n
        .outputs
        .iter()
        .flatten()
        .next()
        .map(|v| model.name(*v).to_string())
        .unwrap_or_else(|| "rnn".into());

    // The inputs' dims as the operator defines them, declared where the model leaves them
    // open (exporters compute W, R and B by reordering the framework's gates): the cells'
    // slices need them.
    if let Some(elem) = x_facts.elem {
        let dirs = Dim::Known(reverse_flags.len() as i64);
        let gh = Dim::Known(cell.gates() * hidden);
        let input_size = x_facts
            .dims
            .as_ref()
            .and_then(|d| d.get(2).cloned())
            .unwrap_or(Dim::Unknown);
        let state = [dirs.clone(), batch.clone(), Dim::Known(hidden)];
        let specs: [(Option<ValueId>, Vec<Dim>); 6] = [
            (Some(w), vec![dirs.clone(), gh.clone(), input_size]),
            (Some(r), vec![dirs.clone(), gh, Dim::Known(hidden)]),
            (
                input(3),
                vec![dirs.clone(), Dim::Known(2 * cell.gates() * hidden)],
            ),
            (input(5), state.to_vec()),
            (input(6).filter(|_| cell == Cell::Lstm), state.to_vec()),
            (
                input(7).filter(|_| cell == Cell::Lstm),
                vec![dirs, Dim::Known(3 * hidden)],
            ),
        ];
        for (v, dims) in specs {
            if let Some(v) = v.filter(|v| model.value_type(*v).is_none()) {
                model.set_value_type(v, type_of(elem, &dims));
            }
        }
    }

    let gh = cell.gates() * hidden;
    let bias = input(3);
    let single_bias = bias.is_some_and(|v| keras_single_bias(model, v, gh));
    let mut b = Builder::new(model, BodyId::MAIN, pass);
    let h = hint.as_str();
    // X is [S, N, I]; initial states [dirs, N, H].
    let (h0_all, c0_all) = (input(5), input(6));
    let peepholes = if cell == Cell::Lstm { input(7) } else { None };

    let mut ys = Vec::new();
    let mut step_values = Vec::new();
    let mut last_h = Vec::new();
    let mut last_c = Vec::new();
    for (d, reverse) in reverse_flags.iter().enumerate() {
        // Direction d's weights and states keep their leading axis (size 1): they
        // broadcast against [S, N, ..] and [1, N, ..] alike, and a Slice's gradient is a
        // Pad (a Gather's would need opset 16's scatter-add).
        let pick = |b: &mut Builder<'_>, v: ValueId| slice_axis(b, v, 0, d as i64, d as i64 + 1, h);
        let wd = pick(&mut b, w);
        let w_t = b.op("Transpose", &[wd], vec![attr_ints("perm", &[0, 2, 1])], h);
        let rd = pick(&mut b, r);
        let r_t = b.op("Transpose", &[rd], vec![attr_ints("perm", &[0, 2, 1])], h);
        let mut xw = b.op("MatMul", &[x, w_t], vec![], h);
        let mut rb = None;
        if let Some(bias) = bias {
            let bd = pick(&mut b, bias);
            let wb = slice_last(&mut b, bd, 0, gh, h);
            let rbd = slice_last(&mut b, bd, gh, 2 * gh, h);
            match cell {
                _ if single_bias => xw = b.op("Add", &[xw, wb], vec![], h),
                Cell::Gru { .. } => {
                    xw = b.op("Add", &[xw, wb], vec![], h);
                    rb = Some(rbd);
                }
                _ => {
                    let both = b.op("Add", &[wb, rbd], vec![], h);
                    xw = b.op("Add", &[xw, both], vec![], h);
                }
            }
        }
        let dir = Direction {
            xw,
            r_t,
            rb,
            p: peepholes.map(|p| pick(&mut b, p)),
            h0: h0_all.map(|v| pick(&mut b, v)),
            c0: c0_all.map(|v| pick(&mut b, v)),
            activations: activations[d * per_direction..(d + 1) * per_direction].to_vec(),
            reverse: *reverse,
        };
        let Some(steps) = steps else {
            let (y, hn, cn) = loop_direction(&mut b, cell, &dir, x, elem, &batch, hidden, h);
            ys.push(y);
            last_h.push(hn);
            last_c.extend(cn);
            continue;
        };
        let Some((hs, hn, cn)) = run_direction(&mut b, cell, &dir, steps, hidden, h) else {
            return Err(node_error(
                b.model,
                node,
                "the layer has no time steps".into(),
            ));
        };
        step_values.extend(hs.iter().copied());
        step_values.extend(cn);
        // Y for this direction: [S, 1, N, H], the steps ([1, N, H] each) in time order.
        let stacked: Vec<ValueId> = hs.iter().map(|v| b.unsqueeze(*v, &[1], h)).collect();
        ys.push(concat(&mut b, &stacked, 0, h));
        last_h.push(hn);
        last_c.extend(cn);
    }
    let y = concat(&mut b, &ys, 1, h);
    let y_h = concat(&mut b, &last_h, 0, h);
    let y_c = (!last_c.is_empty()).then(|| concat(&mut b, &last_c, 0, h));
    // Declared: the shape facts cannot always follow the exporter's weight arithmetic,
    // and a stacked layer needs its sequence length.
    {
        let s = known_steps.map_or(Dim::Unknown, Dim::Known);
        let (n, hd) = (batch.clone(), Dim::Known(hidden));
        let dirs = Dim::Known(reverse_flags.len() as i64);
        let state = [dirs.clone(), n.clone(), hd.clone()];
        model.set_value_type(y, type_of(elem, &[s, dirs, n.clone(), hd.clone()]));
        model.set_value_type(y_h, type_of(elem, &state));
        if let Some(c) = y_c {
            model.set_value_type(c, type_of(elem, &state));
        }
        for v in step_values {
            model.set_value_type(v, type_of(elem, &[Dim::Known(1), n.clone(), hd.clone()]));
        }
    }
    let news = [Some(y), Some(y_h), y_c];
    for (slot, old) in n.outputs.iter().enumerate() {
        if let (Some(old), Some(Some(new))) = (old, news.get(slot)) {
            model.replace_value(*old, *new);
        }
    }
    model
        .remove_node(node)
        .map_err(|e| node_error(model, node, format!("could not replace the node: {e}")))
}

fn slice_axis(
    b: &mut Builder<'_>,
    v: ValueId,
    axis: i64,
    start: i64,
    end: i64,
    h: &str,
) -> ValueId {
    let starts = b.ints("starts", &[start]);
    let ends = b.ints("ends", &[end]);
    let axes = b.ints("axes", &[axis]);
    b.op("Slice", &[v, starts, ends, axes], vec![], h)
}

fn slice_last(b: &mut Builder<'_>, v: ValueId, start: i64, end: i64, h: &str) -> ValueId {
    slice_axis(b, v, -1, start, end, h)
}

fn concat(b: &mut Builder<'_>, parts: &[ValueId], axis: i64, h: &str) -> ValueId {
    if parts.len() == 1 {
        return parts[0];
    }
    b.op("Concat", parts, vec![attr_int("axis", axis)], h)
}

fn activate(b: &mut Builder<'_>, op: &str, x: ValueId, h: &str) -> ValueId {
    b.op(op, &[x], vec![], h)
}

/// The cells of one direction: H at every step (time order), the last H and C.
fn run_direction(
    b: &mut Builder<'_>,
    cell: Cell,
    dir: &Direction,
    steps: i64,
    hidden: i64,
    h: &str,
) -> Option<(Vec<ValueId>, ValueId, Option<ValueId>)> {
    let order: Vec<i64> = if dir.reverse {
        (0..steps).rev().collect()
    } else {
        (0..steps).collect()
    };
    let (mut state_h, mut state_c) = (dir.h0, dir.c0);
    let mut hs = vec![None; steps as usize];
    for t in order {
        let xw_t = slice_axis(b, dir.xw, 0, t, t + 1, h);
        let (new_h, new_c) = cell_step(b, cell, dir, xw_t, state_h, state_c, hidden, h);
        hs[t as usize] = Some(new_h);
        state_h = Some(new_h);
        state_c = new_c.or(state_c);
    }
    let hs: Vec<ValueId> = hs.into_iter().flatten().collect();
    // `None` only for zero steps, which `unroll` refuses before.
    let last = state_h?;
    Some((hs, last, if cell == Cell::Lstm { state_c } else { None }))
}

/// One direction as a Loop over the time steps, for a sequence length known only at run
/// time (or `--loops keep`): the cell once, in the Loop's body, reading step t of X·Wᵀ;
/// its states carried (zeros where the layer has none: the same arithmetic as leaving
/// their terms out), every H a scan output. Returns Y for the direction ([S, 1, N, H], in
/// time order), the last H and C. Its gradient is `loop_grad`'s.
#[allow(clippy::too_many_arguments)]
fn loop_direction(
    b: &mut Builder<'_>,
    cell: Cell,
    dir: &Direction,
    x: ValueId,
    elem: i32,
    batch: &Dim,
    hidden: i64,
    h: &str,
) -> (ValueId, ValueId, Option<ValueId>) {
    let shape = b.op("Shape", &[x], vec![], h);
    let first = b.scalar_i64("zero", 0);
    let steps = b.op("Gather", &[shape, first], vec![], &format!("{h}_steps"));
    let one = b.scalar_i64("one", 1);
    let last = b.op("Sub", &[steps, one], vec![], h);
    let lstm = cell == Cell::Lstm;
    let zeros = |b: &mut Builder<'_>| {
        let n = slice_axis(b, shape, 0, 1, 2, h);
        let lead = b.ints("one", &[1]);
        let width = b.ints("hidden", &[hidden]);
        let dims = b.op("Concat", &[lead, n, width], vec![attr_int("axis", 0)], h);
        let zero = crate::ir::emit::scalar_tensor(elem, 0.0);
        let zero = crate::proto::TensorProto {
            dims: vec![1],
            ..zero
        };
        b.op(
            "ConstantOfShape",
            &[dims],
            vec![attr_tensor("value", zero)],
            h,
        )
    };
    let h0 = match dir.h0 {
        Some(v) => v,
        None => zeros(b),
    };
    let c0 = match (lstm, dir.c0) {
        (false, _) => None,
        (true, Some(v)) => Some(v),
        (true, None) => Some(zeros(b)),
    };
    let mut inputs = vec![Some(steps), None, Some(h0)];
    let mut hints = vec![format!("{h}_last_h")];
    if let Some(c0) = c0 {
        inputs.push(Some(c0));
        hints.push(format!("{h}_last_c"));
    }
    hints.push(format!("{h}_y"));
    let hint_refs: Vec<&str> = hints.iter().map(String::as_str).collect();
    let node = b.node("Loop", "", &inputs, &hint_refs, vec![]);
    let body = b.model.add_subgraph(node, "body");
    let state_ty = super::shapes::type_of_facts(&super::shapes::Facts {
        elem: Some(elem),
        dims: Some(vec![Dim::Known(1), batch.clone(), Dim::Known(hidden)]),
    })
    .unwrap_or_default();
    {
        let model = &mut *b.model;
        let i = model.add_input(body, "i", crate::ir::tensor_type(INT64, &[]), None);
        let cond = model.add_input(body, "cond", crate::ir::tensor_type(BOOL, &[]), None);
        let state_h = model.add_input(body, &format!("{h}_h"), state_ty.clone(), None);
        let state_c = c0.map(|_| model.add_input(body, &format!("{h}_c"), state_ty.clone(), None));
        let mut lb = Builder::new(model, body, b.pass);
        let t = match dir.reverse {
            true => lb.op("Sub", &[last, i], vec![], "t"),
            false => i,
        };
        let x_t = lb.op("Gather", &[dir.xw, t], vec![], h);
        let xw_t = lb.unsqueeze(x_t, &[0], h);
        let (new_h, new_c) = cell_step(&mut lb, cell, dir, xw_t, Some(state_h), state_c, hidden, h);
        let cond_out = lb.op("Identity", &[cond], vec![], "cond_out");
        let each_h = lb.op("Identity", &[new_h], vec![], h);
        lb.model
            .add_output(body, cond_out, Some(crate::ir::tensor_type(BOOL, &[])));
        lb.model.add_output(body, new_h, Some(state_ty.clone()));
        if let Some(c) = new_c {
            lb.model.add_output(body, c, Some(state_ty.clone()));
        }
        lb.model.add_output(body, each_h, Some(state_ty.clone()));
    }
    let last_h = b.model.output(node, 0);
    let last_c = c0.map(|_| b.model.output(node, 1));
    let mut y = b.model.output(node, if lstm { 2 } else { 1 });
    if dir.reverse {
        // The scan output is in the order of the iterations, backwards in time.
        let steps_1 = b.unsqueeze(steps, &[0], h);
        let n = slice_axis(b, shape, 0, 1, 2, h);
        let lens = b.op("Expand", &[steps_1, n], vec![], h);
        let squeezed = match crate::ir::emit::axes_as_input("Squeeze", b.opset()) {
            true => {
                let axes = b.axes(&[1]);
                b.op("Squeeze", &[y, axes], vec![], h)
            }
            false => b.op("Squeeze", &[y], vec![attr_ints("axes", &[1])], h),
        };
        let forward = b.op(
            "ReverseSequence",
            &[squeezed, lens],
            vec![attr_int("batch_axis", 1), attr_int("time_axis", 0)],
            h,
        );
        y = b.unsqueeze(forward, &[1], h);
    }
    (y, last_h, last_c)
}

/// One cell: the new H (and C) from this step's `xw_t` [1, N, G·H] and the states before
/// it (`None`: zero, whose terms are left out).
#[allow(clippy::too_many_arguments)]
fn cell_step(
    b: &mut Builder<'_>,
    cell: Cell,
    dir: &Direction,
    xw_t: ValueId,
    state_h: Option<ValueId>,
    state_c: Option<ValueId>,
    hidden: i64,
    h: &str,
) -> (ValueId, Option<ValueId>) {
    let gate =
        |b: &mut Builder<'_>, v: ValueId, k: i64| slice_last(b, v, k * hidden, (k + 1) * hidden, h);
    let act = |k: usize| dir.activations[k].as_str();
    let recurrent = state_h.map(|hp| b.op("MatMul", &[hp, dir.r_t], vec![], h));
    match cell {
        Cell::Lstm => {
            let pre = match recurrent {
                Some(r) => b.op("Add", &[xw_t, r], vec![], h),
                None => xw_t,
            };
            let peep =
                |b: &mut Builder<'_>, k: i64, c: Option<ValueId>, v: ValueId| match (dir.p, c) {
                    (Some(p), Some(c)) => {
                        let pk = slice_last(b, p, k * hidden, (k + 1) * hidden, h);
                        let pc = b.op("Mul", &[pk, c], vec![], h);
                        b.op("Add", &[v, pc], vec![], h)
                    }
                    _ => v,
                };
            // ONNX's LSTM gate order: i, o, f, c; peepholes i, o, f.
            let (pi, po, pf, pc) = (
                gate(b, pre, 0),
                gate(b, pre, 1),
                gate(b, pre, 2),
                gate(b, pre, 3),
            );
            let pi = peep(b, 0, state_c, pi);
            let i = activate(b, act(0), pi, h);
            let c_tilde = activate(b, act(1), pc, h);
            let ic = b.op("Mul", &[i, c_tilde], vec![], h);
            let c = match state_c {
                Some(cp) => {
                    let pf = peep(b, 2, Some(cp), pf);
                    let f = activate(b, act(0), pf, h);
                    let fc = b.op("Mul", &[f, cp], vec![], h);
                    b.op("Add", &[fc, ic], vec![], h)
                }
                None => ic,
            };
            let po = peep(b, 1, Some(c), po);
            let o = activate(b, act(0), po, h);
            let hc = activate(b, act(2), c, h);
            (b.op("Mul", &[o, hc], vec![], h), Some(c))
        }
        Cell::Gru {
            linear_before_reset,
        } => {
            // The recurrent term with its bias (zero state: the bias alone).
            let rec = match (recurrent, dir.rb) {
                (Some(r), Some(rb)) => Some(b.op("Add", &[r, rb], vec![], h)),
                (Some(r), None) => Some(r),
                (None, rb) => rb,
            };
            let (xz, xr, xh) = (gate(b, xw_t, 0), gate(b, xw_t, 1), gate(b, xw_t, 2));
            let with = |b: &mut Builder<'_>, x: ValueId, k: i64| match rec {
                Some(rec) => {
                    let rk = gate(b, rec, k);
                    b.op("Add", &[x, rk], vec![], h)
                }
                None => x,
            };
            let zs = with(b, xz, 0);
            let z = activate(b, act(0), zs, h);
            let rs = with(b, xr, 1);
            let rg = activate(b, act(0), rs, h);
            let hidden_term = if linear_before_reset {
                rec.map(|rec| {
                    let rh = gate(b, rec, 2);
                    b.op("Mul", &[rg, rh], vec![], h)
                })
            } else {
                let reset = state_h.map(|hp| {
                    let rhp = b.op("Mul", &[rg, hp], vec![], h);
                    let rh_t = slice_last(b, dir.r_t, 2 * hidden, 3 * hidden, h);
                    b.op("MatMul", &[rhp, rh_t], vec![], h)
                });
                let rbh = dir
                    .rb
                    .map(|rb| slice_last(b, rb, 2 * hidden, 3 * hidden, h));
                match (reset, rbh) {
                    (Some(a), Some(c)) => Some(b.op("Add", &[a, c], vec![], h)),
                    (a, c) => a.or(c),
                }
            };
            let hs_pre = match hidden_term {
                Some(t) => b.op("Add", &[xh, t], vec![], h),
                None => xh,
            };
            let h_tilde = activate(b, act(1), hs_pre, h);
            // H' = h̃ - z ⊙ h̃ + z ⊙ H = (1 - z) ⊙ h̃ + z ⊙ H.
            let zh = b.op("Mul", &[z, h_tilde], vec![], h);
            let mut out = b.op("Sub", &[h_tilde, zh], vec![], h);
            if let Some(hp) = state_h {
                let zp = b.op("Mul", &[z, hp], vec![], h);
                out = b.op("Add", &[out, zp], vec![], h);
            }
            (out, None)
        }
        Cell::Rnn => {
            let pre = match recurrent {
                Some(r) => b.op("Add", &[xw_t, r], vec![], h),
                None => xw_t,
            };
            (activate(b, act(0), pre, h), None)
        }
    }
}

/// Whether `bias` is a Keras layer's one bias as tf2onnx writes it: `B = [Wb, Rb]` with the
/// recurrent half `Rb` all zeros (Keras's LSTM, SimpleRNN and reset_after=False GRU have one
/// bias; ONNX's layers two). Both halves add into the same gates, so training both would
/// move the Keras bias twice per step; such a layer adds `Wb` alone and `Rb` gets no gradient
/// (it stays zero, and the forward is the same). A torch export's `b_hh` is a parameter of
/// its own, zero or not: only tf2onnx's files are read so.
fn keras_single_bias(model: &Model, bias: ValueId, gates_hidden: i64) -> bool {
    if !super::tf2onnx_constants::exported_by_tf2onnx(model) {
        return false;
    }
    let Some(t) = model
        .initializer(bias)
        .and_then(|t| crate::data::Tensor::from_tensor_proto(t).ok())
    else {
        return false;
    };
    let Some(values) = t.as_f32() else {
        return false;
    };
    let per_direction = 2 * gates_hidden as usize;
    per_direction > 0
        && values.len() % per_direction == 0
        && values.as_slice().is_some_and(|v| {
            v.chunks(per_direction)
                .all(|d| d[per_direction / 2..].iter().all(|x| *x == 0.0))
        })
}
