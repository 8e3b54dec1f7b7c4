//! The gradient of a `Loop` that stays a Loop (its trip count or condition is known only
//! at run time: a sequence of any length, a while loop on data; `unroll_loop` unrolls the
//! others): a second Loop that runs the iterations backwards.
//!
//! ```text
//! forward    v_N, S = Loop(M, c, v_0)      body (i, c, v) -> (c', v', s)
//!            W: the outer values the body reads
//! kept       the forward Loop also stacks what each iteration starts from:
//!            I = [0, 1, .., N-1], V = [v_0, .., v_{N-1}] (C, the conditions, if the body reads them;
//!            no stack of a value the body passes on unchanged, a TensorFlow cell's weights)
//! backward   dv_0, dW = Loop(Size(I), true, dv_N, 0)
//!              body (j, _, dv, gW):   t = N - 1 - j
//!                v', s = body(t, C[t], V[t])                      recomputed
//!                dv_t, dW_t = (dv, dS[t]) · ∂(v', s)/∂(v, W)      the body's gradient, by the rules
//!                -> (true, dv_t, gW + dW_t)
//! ```
//!
//! What is kept per iteration is what it carried in (an RNN's hidden state, as PyTorch's
//! autograd keeps a cell's inputs), not the body's intermediates: those are recomputed, one
//! more forward of the body per iteration. The gradients of the float carried values flow
//! through every iteration; those of the outer values the body reads (a cell's weights, a
//! whole input sequence read one step per iteration) are summed over the iterations.
//!
//! Control flow in the body (an If, a Loop) is recomputed with it and differentiated by the
//! same sweep (`if_grad`, this module again).
//!
//! What an iteration draws (a Dropout's mask, a random op's values) the forward Loop stacks
//! as well, and the recomputation reads it instead of drawing again: `Y = mask[t] · X / (1 -
//! ratio)` for a Dropout, whose gradient the `Mul` and `Div` rules give.
//!
//! Not differentiated (the error says why): draws nested deeper (in an If or a Loop of the
//! body: recomputed with their body, they would draw again), BatchNormalization in the body,
//! sparse initializers in it, carried values that are not tensors (sequences, optionals).

use std::collections::{HashMap, HashSet};

use crate::ir::builder::{tensor_bool, Builder, NodeAttributes};
use crate::ir::emit::Emit;
use crate::ir::{topological_order, Model, NodeId, ValueId};
use crate::passes::PassError;
use crate::proto::elem::{BOOL, FLOAT, INT32, INT64};

use super::loop_parts::{computed_here, draws, not_recomputable, recompute_with, LoopParts};
use super::rules::Grad;
use super::shapes::{stacked, type_of_facts, Facts};
use super::{is_float, PASS};

/// Why the Loop `n` has no gradient here, when it has none.
pub fn why_not(model: &Model, n: NodeId) -> Option<String> {
    match LoopParts::of(model, n) {
        Ok(parts) => not_recomputable(model, parts.body, "body", true),
        Err(why) => Some(why),
    }
}

/// The stacks the forward Loop keeps for the backward: the iteration numbers (their count is
/// the trip count), and per iteration what the body reads of its carried values and
/// condition.
struct Kept {
    iterations: ValueId,
    carried: Vec<CarriedRead>,
    condition: Option<ValueId>,
    /// What the body's own nodes drew, per iteration, where the recomputation reads it.
    drawn: HashMap<NodeId, Drawn>,
}

/// What a node of the body drew, stacked by the forward Loop: the backward reads iteration
/// t's draw instead of drawing again.
#[derive(Clone, Copy)]
enum Drawn {
    /// A Dropout's mask: the recomputation multiplies by it, scaled as the Dropout scales.
    Mask(ValueId),
    /// A random op's output.
    Values(ValueId),
}

/// How the backward reads what an iteration carried in.
#[derive(Clone, Copy)]
enum CarriedRead {
    /// The recomputation does not read it.
    Unread,
    /// Step t of this stack.
    Stacked(ValueId),
    /// This value: the body passes it on unchanged (TensorFlow's while loops carry a
    /// cell's weights), so every iteration starts from the Loop's starting value.
    Same(ValueId),
}

/// The gradient contributions of the Loop `n` (the gradients `dys` reach its outputs), as
/// (value, contribution) pairs: its carried starting values and the outer values its body
/// reads, those of them that `depends` on a parameter.
pub fn gradients(
    cx: &mut Grad<'_>,
    n: NodeId,
    dys: &[Option<ValueId>],
    depends: &dyn Fn(ValueId) -> bool,
) -> Result<Vec<(ValueId, ValueId)>, PassError> {
    let parts = LoopParts::of(cx.model(), n).map_err(|why| cx.error(n, why))?;
    let loop_name = match cx.model().node(n).proto.name() {
        "" => "loop".to_string(),
        name => name.to_string(),
    };
    let carried = parts.carried();
    let float: Vec<bool> = (0..carried)
        .map(|k| {
            cx.facts(parts.body_inputs[2 + k])
                .elem
                .is_some_and(is_float)
        })
        .collect();
    let wanted: Vec<ValueId> = cx
        .model()
        .captures(parts.body)
        .into_iter()
        .filter(|w| cx.facts(*w).elem.is_some_and(is_float) && depends(*w))
        .collect();
    if !float.contains(&true) && wanted.is_empty() {
        return Ok(Vec::new());
    }
    // An outer sequence the body reads one step per iteration gets its gradient by one
    // scatter of the steps' gradients; the other outer values by sums carried along.
    let step_reads = step_reads(cx, &parts, &wanted);
    let captured: Vec<ValueId> = wanted
        .iter()
        .copied()
        .filter(|w| !step_reads.iter().any(|r| r.x == *w))
        .collect();
    let kept = keep(cx, n, &parts);

    // The backward Loop's trip count and condition, in the enclosing body.
    let count = cx.op(
        "Size",
        &[kept.iterations],
        vec![],
        &format!("{loop_name}_trips"),
    );
    cx.shapes.set(count, scalar_facts(INT64));
    let one = cx.scalar(INT64, 1.0);
    let last = cx.op("Sub", &[count, one], vec![], &format!("{loop_name}_last"));
    cx.shapes.set(last, scalar_facts(INT64));
    let yes = cx.constant("true", tensor_bool(&[], &[true]));

    // What it carries: the gradients of the float carried values (from those of the
    // Loop's last values, zeros where none reaches them), and the sums of the outer
    // values' gradients (from zeros).
    let mut inputs = vec![Some(count), Some(yes)];
    let mut hints = Vec::new();
    let mut flowing = Vec::new();
    for k in (0..carried).filter(|k| float[*k]) {
        let last_value = cx.model().output(n, k);
        let start = match dys.get(k).copied().flatten() {
            Some(d) => d,
            None => {
                let hint = format!("{}_grad", cx.model().name(last_value));
                cx.zeros_like(n, last_value, &hint)?
            }
        };
        inputs.push(Some(start));
        hints.push(format!("{}_grad", cx.model().name(parts.initial[k])));
        flowing.push(k);
    }
    for w in &captured {
        let hint = format!("{}_grad", cx.model().name(*w));
        let zeros = cx.zeros_like(n, *w, &format!("{hint}_zero"))?;
        inputs.push(Some(zeros));
        hints.push(hint);
    }
    let hint_refs: Vec<&str> = hints.iter().map(String::as_str).collect();
    let back = cx.b.node("Loop", "", &inputs, &hint_refs, vec![]);
    let back_body = cx.b.model.add_subgraph(back, "body");
    for (slot, like) in flowing
        .iter()
        .map(|k| parts.initial[*k])
        .chain(captured.iter().copied())
        .enumerate()
    {
        let out = cx.model().output(back, slot);
        let facts = cx.facts(like);
        cx.shapes.set(out, facts);
    }

    let scan_grads: Vec<Option<ValueId>> = (0..parts.scans())
        .map(|m| dys.get(carried + m).copied().flatten())
        .collect();
    let step = Step {
        parts: &parts,
        kept: &kept,
        last,
        flowing: &flowing,
        captured: &captured,
        step_reads: &step_reads,
        scan_grads: &scan_grads,
    };
    let mut inner = Grad::new(
        Builder::new(&mut *cx.b.model, back_body, PASS),
        &mut *cx.shapes,
    );
    step.build(&mut inner, n)?;

    // Each step read's gradients, stacked (in the backward's order) with the positions
    // read: one ScatterND adds them into zeros of the sequence.
    let mut scattered = Vec::new();
    for read in &step_reads {
        let x_name = cx.model().name(read.x).to_string();
        let steps =
            cx.b.model
                .add_node_output(back, &format!("{x_name}_step_grads"));
        let positions = cx.b.model.add_node_output(back, &format!("{x_name}_steps"));
        let zeros = cx.zeros_like(n, read.x, &format!("{x_name}_grad_zero"))?;
        let grad = cx.op_like(
            "ScatterND",
            &[zeros, positions, steps],
            vec![crate::ir::builder::attr_string("reduction", "add")],
            &format!("{x_name}_grad"),
            read.x,
        );
        scattered.push((read.x, grad));
    }

    let mut contributions = Vec::new();
    for (slot, k) in flowing.iter().enumerate() {
        let v0 = parts.initial[*k];
        if depends(v0) {
            contributions.push((v0, cx.model().output(back, slot)));
        }
    }
    for (i, w) in captured.iter().enumerate() {
        contributions.push((*w, cx.model().output(back, flowing.len() + i)));
    }
    contributions.extend(scattered);
    Ok(contributions)
}

/// A body node `Gather(X, i)` of an outer float sequence X at a scalar position the body
/// computes (TensorFlow's TensorArray read: one time step per iteration), on axis 0.
struct StepRead {
    gather: NodeId,
    x: ValueId,
    index: ValueId,
}

/// The step reads of the `wanted` outer values that the body reads only so (needs
/// ScatterND's `reduction`, opset 16).
fn step_reads(cx: &Grad<'_>, parts: &LoopParts, wanted: &[ValueId]) -> Vec<StepRead> {
    let model = cx.model();
    if model.opset("").unwrap_or(1) < 16 {
        return Vec::new();
    }
    let as_step_read = |node: NodeId| -> Option<StepRead> {
        let n = model.node(node);
        let p = &n.proto;
        if !(p.domain().is_empty() || p.domain() == "ai.onnx") || p.op_type() != "Gather" {
            return None;
        }
        let (Some(Some(x)), Some(Some(index))) = (n.inputs.first(), n.inputs.get(1)) else {
            return None;
        };
        let axis = p.attr_int("axis").ok().flatten().unwrap_or(0);
        let rank = cx.facts(*x).rank()? as i64;
        let index_facts = cx.facts(*index);
        let scalar_int = index_facts.rank() == Some(0)
            && index_facts.elem.is_some_and(|e| e == INT64 || e == INT32);
        ((axis == 0 || axis == -rank) && scalar_int && n.body == parts.body).then_some(StepRead {
            gather: node,
            x: *x,
            index: *index,
        })
    };
    let mut reads = Vec::new();
    for x in wanted {
        let uses: Vec<NodeId> = model
            .uses(*x)
            .iter()
            .filter_map(|u| match u {
                crate::ir::Use::Node { node, .. }
                    if model.is_within(model.node(*node).body, parts.body) =>
                {
                    Some(*node)
                }
                _ => None,
            })
            .collect();
        let as_reads: Vec<StepRead> = uses.iter().filter_map(|u| as_step_read(*u)).collect();
        if !uses.is_empty() && as_reads.len() == uses.len() {
            reads.extend(as_reads);
        }
    }
    reads
}

fn scalar_facts(elem: i32) -> Facts {
    Facts {
        elem: Some(elem),
        dims: Some(Vec::new()),
    }
}

/// Makes the forward Loop `n` stack what the backward reads (new scan outputs after its
/// own).
fn keep(cx: &mut Grad<'_>, n: NodeId, parts: &LoopParts) -> Kept {
    // Every output slot the body gives a value is made present, so that the new ones line
    // up with the body's new outputs.
    for slot in 0..parts.body_outputs.len() - 1 {
        let hint = format!("{}_out{slot}", cx.model().node(n).proto.name());
        cx.b.model.ensure_node_output(n, slot, &hint);
    }
    let stack = |cx: &mut Grad<'_>, v: ValueId| -> ValueId {
        let name = cx.model().name(v).to_string();
        let facts = cx.facts(v);
        let each = Builder::new(&mut *cx.b.model, parts.body, PASS).op(
            "Identity",
            &[v],
            vec![],
            &format!("{name}_kept"),
        );
        cx.shapes.set(each, facts.clone());
        cx.b.model
            .add_output(parts.body, each, type_of_facts(&facts));
        let all = cx.b.model.add_node_output(n, &format!("{name}_stacked"));
        cx.shapes.set(all, stacked(&facts));
        all
    };
    // What the recomputation reads: the body values its float outputs depend on.
    let mut needed: HashSet<ValueId> = parts.body_outputs[1..]
        .iter()
        .copied()
        .filter(|v| cx.facts(*v).elem.is_some_and(is_float))
        .collect();
    // (What an If or a Loop in the body reads inside its own bodies counts as its input.)
    for node in topological_order(cx.model(), parts.body).into_iter().rev() {
        let model = cx.model();
        let node = model.node(node);
        if node.outputs.iter().flatten().any(|o| needed.contains(o)) {
            needed.extend(node.inputs.iter().flatten().copied());
            needed.extend(node.subgraphs.iter().flat_map(|s| model.captures(s.body)));
        }
    }
    let read = |_: &Grad<'_>, v: ValueId| needed.contains(&v);
    let iterations = stack(cx, parts.body_inputs[0]);
    let condition = match read(cx, parts.body_inputs[1]) {
        true => Some(stack(cx, parts.body_inputs[1])),
        false => None,
    };
    let carried = (0..parts.carried())
        .map(|k| {
            let v = parts.body_inputs[2 + k];
            match (read(cx, v), passed_on(cx.model(), parts, k)) {
                (false, _) => CarriedRead::Unread,
                (true, true) => CarriedRead::Same(parts.initial[k]),
                (true, false) => CarriedRead::Stacked(stack(cx, v)),
            }
        })
        .collect();
    // What the body's own nodes draw and the recomputation reads: a Dropout's mask (the
    // forward returns it), a random op's values.
    let mut drawn = HashMap::new();
    let draws_read: Vec<NodeId> = cx
        .model()
        .body_nodes(parts.body)
        .filter(|d| draws(cx.model(), *d))
        .filter(|d| {
            cx.model()
                .node(*d)
                .outputs
                .iter()
                .flatten()
                .any(|o| needed.contains(o))
        })
        .collect();
    for d in draws_read {
        let first = cx.model().output(d, 0);
        let kept = match cx.model().node(d).proto.op_type() {
            "Dropout" => {
                let hint = format!("{}_mask", cx.model().name(first));
                let mask = cx.b.model.ensure_node_output(d, 1, &hint);
                let dims = cx.facts(first).dims;
                cx.shapes.set(
                    mask,
                    Facts {
                        elem: Some(BOOL),
                        dims,
                    },
                );
                Drawn::Mask(stack(cx, mask))
            }
            _ => Drawn::Values(stack(cx, first)),
        };
        drawn.insert(d, kept);
    }
    Kept {
        iterations,
        carried,
        condition,
        drawn,
    }
}

/// What the recomputation makes of the draw `node` (whose inputs' copies are `inputs`):
/// iteration `t` of what the forward drew, as (original, replacement) pairs.
fn read_drawn(
    g: &mut Grad<'_>,
    node: NodeId,
    inputs: &[Option<ValueId>],
    drawn: Drawn,
    t: ValueId,
) -> Result<Vec<(ValueId, ValueId)>, PassError> {
    let first = g.model().output(node, 0);
    let hint = g.model().name(first).to_string();
    let stack = match drawn {
        Drawn::Values(stack) | Drawn::Mask(stack) => stack,
    };
    let like = match drawn {
        Drawn::Values(_) => first,
        Drawn::Mask(_) => g.model().output(node, 1),
    };
    let at_t = g.op_like(
        "Gather",
        &[stack, t],
        vec![],
        &format!("{hint}_drawn"),
        like,
    );
    let Drawn::Mask(_) = drawn else {
        return Ok(vec![(first, at_t)]);
    };
    // Dropout: Y = mask · X / (1 - ratio) (ratio 0.5 when absent), as ONNX Runtime's kernel
    // computes it: 1 - ratio in float32 whatever the types, the division in X's type.
    let x = inputs
        .first()
        .copied()
        .flatten()
        .ok_or_else(|| g.error(node, "its input is absent".into()))?;
    let elem = g.elem(node, first)?;
    let cast = |g: &mut Grad<'_>, v: ValueId, elem: i32, hint: &str| {
        let facts = Facts {
            elem: Some(elem),
            ..g.facts(v)
        };
        let to = vec![crate::ir::builder::attr_int("to", elem as i64)];
        let cast = g.op("Cast", &[v], to, hint);
        g.shapes.set(cast, facts);
        cast
    };
    let keep = match inputs.get(1).copied().flatten() {
        None => g.scalar(elem, 0.5),
        Some(ratio) => {
            let ratio = cast(g, ratio, FLOAT, &format!("{hint}_ratio"));
            let one = g.scalar(FLOAT, 1.0);
            let keep = g.op_like("Sub", &[one, ratio], vec![], &format!("{hint}_keep"), ratio);
            cast(g, keep, elem, &format!("{hint}_keep"))
        }
    };
    let kept = cast(g, at_t, elem, &format!("{hint}_kept"));
    let masked = g.op_like("Mul", &[kept, x], vec![], &format!("{hint}_masked"), first);
    let y = g.op_like("Div", &[masked, keep], vec![], &hint, first);
    Ok(vec![(first, y), (like, at_t)])
}

/// Whether the body passes carried value `k` on unchanged (its output is its input, through
/// Identities).
fn passed_on(model: &Model, parts: &LoopParts, k: usize) -> bool {
    model.forwarded(parts.body_outputs[1 + k], parts.body) == parts.body_inputs[2 + k]
}

/// One backward iteration: the body of the backward Loop.
struct Step<'p> {
    parts: &'p LoopParts,
    kept: &'p Kept,
    /// N - 1, in the enclosing body.
    last: ValueId,
    /// The carried values whose gradients flow (their indices).
    flowing: &'p [usize],
    /// The outer values whose gradients are summed.
    captured: &'p [ValueId],
    /// The outer sequences read one step per iteration.
    step_reads: &'p [StepRead],
    /// The gradients reaching the Loop's scan outputs (stacked), where one does.
    scan_grads: &'p [Option<ValueId>],
}

impl Step<'_> {
    fn build(&self, g: &mut Grad<'_>, n: NodeId) -> Result<(), PassError> {
        let body = g.b.body;
        let input = |g: &mut Grad<'_>, hint: &str, facts: Facts| -> ValueId {
            let ty = type_of_facts(&facts).unwrap_or_default();
            let v = g.b.model.add_input(body, hint, ty, None);
            g.shapes.set(v, facts);
            v
        };
        let j = input(g, "j", scalar_facts(INT64));
        let condition = input(g, "cond", scalar_facts(BOOL));
        let mut flowing_in = Vec::new();
        for k in self.flowing {
            let v = self.parts.body_inputs[2 + k];
            let hint = format!("{}_grad", g.model().name(v));
            let facts = g.facts(v);
            flowing_in.push(input(g, &hint, facts));
        }
        let mut sums_in = Vec::new();
        for w in self.captured {
            let hint = format!("{}_grad_sum", g.model().name(*w));
            let facts = g.facts(*w);
            sums_in.push(input(g, &hint, facts));
        }

        // This iteration: t = I[N - 1 - j] (= N - 1 - j), and what the forward's iteration t
        // started from. Read from the stack of iteration numbers, not computed from its
        // size alone: tract folds a `Size` whose count it knows and then drops the stack, and
        // with it the forward Scan's only scan input when its body reads nothing else of
        // the iteration number ("Scan: No scan input"; a TensorFlow while loop counts with
        // its own counter).
        let position = g.op("Sub", &[self.last, j], vec![], "t_position");
        g.shapes.set(position, scalar_facts(INT64));
        let t = g.op("Gather", &[self.kept.iterations, position], vec![], "t");
        g.shapes.set(t, scalar_facts(INT64));
        let mut copies: HashMap<ValueId, ValueId> = HashMap::new();
        copies.insert(self.parts.body_inputs[0], t);
        let at_t = |g: &mut Grad<'_>, stack: ValueId, like: ValueId| -> ValueId {
            let hint = g.model().name(like).to_string();
            g.op_like("Gather", &[stack, t], vec![], &hint, like)
        };
        if let Some(c) = self.kept.condition {
            let v = at_t(g, c, self.parts.body_inputs[1]);
            copies.insert(self.parts.body_inputs[1], v);
        }
        for (k, kept) in self.kept.carried.iter().enumerate() {
            let like = self.parts.body_inputs[2 + k];
            match kept {
                CarriedRead::Unread => {}
                CarriedRead::Stacked(stack) => {
                    let v = at_t(g, *stack, like);
                    copies.insert(like, v);
                }
                CarriedRead::Same(start) => {
                    // Its own value here, so that its gradient is told from that of the
                    // outer value itself (which the body may read too).
                    let hint = g.model().name(like).to_string();
                    let v = g.op_like("Identity", &[*start], vec![], &hint, like);
                    copies.insert(like, v);
                }
            }
        }
        let drawn = &self.kept.drawn;
        let mut failed = None;
        recompute_with(g, self.parts.body, &mut copies, &mut |g, node, inputs| {
            let kept = *drawn.get(&node)?;
            read_drawn(g, node, inputs, kept, t)
                .map_err(|e| failed = Some(e))
                .ok()
        });
        if let Some(e) = failed {
            return Err(e);
        }

        // The seeds: the carried gradients at the iteration's end, the scan outputs'
        // gradients at step t.
        let copy_of = |v: ValueId| copies.get(&v).copied().unwrap_or(v);
        let mut seeds = Vec::new();
        for (k, d) in self.flowing.iter().zip(&flowing_in) {
            seeds.push((copy_of(self.parts.body_outputs[1 + k]), *d));
        }
        let carried = self.parts.carried();
        for (m, d) in self.scan_grads.iter().enumerate() {
            let Some(d) = d else { continue };
            let out = self.parts.body_outputs[1 + carried + m];
            if !g.facts(out).elem.is_some_and(is_float) {
                continue;
            }
            let d_t = at_t(g, *d, out);
            seeds.push((copy_of(out), d_t));
        }
        let starts: Vec<Option<ValueId>> = self
            .flowing
            .iter()
            .map(|k| copies.get(&self.parts.body_inputs[2 + k]).copied())
            .collect();
        let mut targets: Vec<ValueId> = starts.iter().flatten().copied().collect();
        targets.extend(self.captured.iter().copied());
        let steps_read: Vec<ValueId> = self
            .step_reads
            .iter()
            .map(|r| copy_of(g.model().output(r.gather, 0)))
            .collect();
        targets.extend(steps_read.iter().copied());
        let sums = super::sweep(g, &seeds, &targets)?;
        let mut sums = sums.into_iter();

        // Outputs: the condition, each carried value's gradient at the iteration's start
        // (zeros where the body does not read it or nothing reaches it), the sums.
        let cond_out = g.op("Identity", &[condition], vec![], "cond_out");
        g.b.model
            .add_output(body, cond_out, type_of_facts(&scalar_facts(BOOL)));
        for ((k, start), d_in) in self.flowing.iter().zip(&starts).zip(&flowing_in) {
            let like = self.parts.body_inputs[2 + k];
            let grad = match start {
                Some(_) => sums.next().flatten(),
                None => None,
            };
            let hint = format!("{}_grad_prev", g.model().name(like));
            let out = match grad {
                Some(gr) => computed_here(g, gr, &hint),
                None => g.zeros_like(n, *d_in, &hint)?,
            };
            let facts = g.facts(like);
            g.b.model.add_output(body, out, type_of_facts(&facts));
        }
        for (w, sum_in) in self.captured.iter().zip(&sums_in) {
            let hint = format!("{}_grad_sum_next", g.model().name(*w));
            let out = match sums.next().flatten() {
                Some(gw) => g.op_like("Add", &[*sum_in, gw], vec![], &hint, *w),
                None => g.op_like("Identity", &[*sum_in], vec![], &hint, *w),
            };
            let facts = g.facts(*w);
            g.b.model.add_output(body, out, type_of_facts(&facts));
        }
        // Scan outputs: each step read's gradient (zeros where none reaches it) and the
        // position read, as ScatterND's one-element index.
        for (read, step) in self.step_reads.iter().zip(&steps_read) {
            let hint = format!("{}_grad", g.model().name(*step));
            let grad = match sums.next().flatten() {
                Some(gr) => computed_here(g, gr, &hint),
                None => g.zeros_like(n, *step, &hint)?,
            };
            let facts = g.facts(*step);
            g.b.model.add_output(body, grad, type_of_facts(&facts));
            let mut position = copy_of(read.index);
            if g.facts(position).elem != Some(INT64) {
                position = g.op(
                    "Cast",
                    &[position],
                    vec![crate::ir::builder::attr_int("to", INT64 as i64)],
                    "position",
                );
            }
            let position = g.unsqueeze(position, &[0], "position");
            let facts = Facts {
                elem: Some(INT64),
                dims: Some(vec![super::shapes::Dim::Known(1)]),
            };
            g.shapes.set(position, facts.clone());
            g.b.model.add_output(body, position, type_of_facts(&facts));
        }
        Ok(())
    }
}
