//! A `Loop` whose trip count is known before the run, unrolled into the graph that holds it,
//! so that the autodiff differentiates its iterations with the rules it has and no
//! control-flow gradient is needed. TensorFlow's while loops come out of tf2onnx this way
//! (Keras's SimpleRNN and GRU: a Loop without `M` whose condition compares a counter with
//! the sequence length, `Less(Cast(t + 1), Cast(12))`).
//!
//! ONNX's semantics, with `v` the N loop-carried values and `s` the K scan outputs:
//!
//! ```text
//! i = 0, c = cond, v = v₀
//! while (M absent or i < M) and (cond absent or c):
//!     c, v, sᵢ = body(i, c, v)
//!     i = i + 1
//! outputs: v, and each scan output stacked on a new axis 0: [s₀, s₁, ...]
//! ```
//!
//! The trip count comes from evaluating, iteration by iteration, the one-element integer
//! and boolean values the body computes from constants, the iteration number and what it
//! carries (the counter, the condition: [`Scalar`]); `M`, the first condition and the
//! carried starting values must be such values of the enclosing graph. Then every other
//! body node is copied once per iteration, reading the copies of the iteration before for
//! the carried values, and the evaluated scalars as constants; each scan output becomes the
//! Concat of its copies unsqueezed on axis 0. Floating-point nodes are always copied: a
//! float the body carries may be a parameter, and its gradient must flow. A body's
//! Identity is not copied: what reads it reads its input.
//!
//! A Gather of an outer value at a constant position on axis 0 (TensorFlow's TensorArray
//! read, one time step per iteration) becomes one output of one Split of that value,
//! squeezed: its gradient is then one Concat, where T Gathers' gradients would be T
//! scatters into zeros of the whole sequence. A MatMul of such a step by a weight that
//! every iteration reads (a cell's input kernel) becomes a step of one MatMul of the whole
//! sequence: `Split(X · W)[t]` for `X[t] · W`, one product forward and one per gradient
//! instead of T each.
//!
//! Not unrolled (the Loop stays, `loop_grad` differentiates it, and the report names the
//! reason, [`why_not`]): a trip count or condition computed at run time, more than
//! [`MAX_TRIP_COUNT`] iterations, a body holding control flow itself, no iteration at all
//! with scan outputs (their shape is unknown).

use std::collections::HashMap;

use crate::ir::builder::{attr_int, attr_ints, Builder, NodeAttributes};
use crate::ir::emit::{axes_as_input, scalar_bytes, tensor_scalar, Emit};
use crate::ir::{topological_order, BodyId, Model, NodeId, ValueDef, ValueId};
use crate::passes::PassError;
use crate::proto::elem::{BFLOAT16, BOOL, DOUBLE, FLOAT, FLOAT16, INT64};
use crate::proto::TensorProto;

use super::loop_parts::{copy_node, LoopParts};
use super::rules::node_error;
use super::shapes::{constant_ints, constant_tensor, known_ints, Shapes};

/// The most iterations unrolled: each is a copy of the body in the file and in the
/// gradient (a sequence of 4096 steps is beyond what a recurrent layer is trained on).
pub const MAX_TRIP_COUNT: usize = 4096;

/// How far up the enclosing graph a scalar is evaluated.
const DEPTH: usize = 16;

/// A one-element value known before the run: its ONNX element type, its rank (every dim is
/// 1) and its value (exact for the integers and booleans a loop counts with).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Scalar {
    elem: i32,
    rank: usize,
    value: f64,
}

impl Scalar {
    fn of_tensor(t: &TensorProto) -> Option<Scalar> {
        Some(Scalar {
            elem: t.data_type(),
            rank: t.dims.len(),
            value: tensor_scalar(t)?,
        })
    }

    fn tensor(self) -> TensorProto {
        let bytes = match self.elem {
            BOOL => vec![(self.value != 0.0) as u8],
            e => scalar_bytes(e, self.value).unwrap_or_default(),
        };
        TensorProto {
            data_type: Some(self.elem),
            dims: vec![1; self.rank],
            raw_data: Some(bytes),
            ..Default::default()
        }
    }

    fn truth(self) -> bool {
        self.value != 0.0
    }

    /// `value` as element type `elem` would hold it.
    fn of(elem: i32, rank: usize, value: f64) -> Scalar {
        let value = match elem {
            BOOL => (value != 0.0) as u8 as f64,
            FLOAT | FLOAT16 | BFLOAT16 => value as f32 as f64,
            DOUBLE => value,
            _ => value.trunc(),
        };
        Scalar { elem, rank, value }
    }
}

use crate::ir::is_float_elem as is_float;

/// The value of a node's output, for the ops loop counters and conditions are made of;
/// `None` for any other op. Its inputs' values come from `value`, asked only for an op it
/// computes (a walk up through anything else could visit a whole network's DAG).
fn evaluate(
    model: &Model,
    node: NodeId,
    value: &dyn Fn(ValueId) -> Option<Scalar>,
) -> Option<Scalar> {
    let n = model.node(node);
    let p = &n.proto;
    if !p.domain().is_empty() && p.domain() != "ai.onnx" {
        return None;
    }
    let input = |i: usize| n.inputs.get(i).copied().flatten().and_then(value);
    let compare = |f: fn(f64, f64) -> bool| -> Option<Scalar> {
        let (a, b) = (input(0)?, input(1)?);
        Some(Scalar::of(
            BOOL,
            a.rank.max(b.rank),
            f(a.value, b.value) as u8 as f64,
        ))
    };
    let arithmetic = |f: fn(f64, f64) -> f64| -> Option<Scalar> {
        let (a, b) = (input(0)?, input(1)?);
        (a.elem == b.elem).then(|| Scalar::of(a.elem, a.rank.max(b.rank), f(a.value, b.value)))
    };
    let unary = |f: &dyn Fn(Scalar) -> Scalar| input(0).map(f);
    match p.op_type() {
        "Constant" => Scalar::of_tensor(constant_tensor(model, n.outputs.first().copied()??)?),
        "Identity" => input(0),
        "Add" => arithmetic(|x, y| x + y),
        "Sub" => arithmetic(|x, y| x - y),
        "Mul" => arithmetic(|x, y| x * y),
        // Integer division truncates (ONNX Runtime's kernels divide in C++).
        "Div" => arithmetic(|x, y| x / y).filter(|v| v.value.is_finite()),
        "Min" => arithmetic(f64::min),
        "Max" => arithmetic(f64::max),
        "Neg" => unary(&|a| Scalar::of(a.elem, a.rank, -a.value)),
        "Abs" => unary(&|a| Scalar::of(a.elem, a.rank, a.value.abs())),
        "Not" => unary(&|a| Scalar::of(BOOL, a.rank, !a.truth() as u8 as f64)),
        "And" => compare(|x, y| x != 0.0 && y != 0.0),
        "Or" => compare(|x, y| x != 0.0 || y != 0.0),
        "Xor" => compare(|x, y| (x != 0.0) != (y != 0.0)),
        "Less" => compare(|x, y| x < y),
        "LessOrEqual" => compare(|x, y| x <= y),
        "Greater" => compare(|x, y| x > y),
        "GreaterOrEqual" => compare(|x, y| x >= y),
        "Equal" => compare(|x, y| x == y),
        "Cast" => {
            let to = p.attr_int("to").ok().flatten()? as i32;
            unary(&|a| Scalar::of(to, a.rank, a.value))
        }
        "Squeeze" => unary(&|a| Scalar { rank: 0, ..a }),
        "Unsqueeze" => {
            let axes = match p.attr_ints("axes").ok().flatten() {
                Some(axes) => axes.len(),
                None => constant_ints(model, n.inputs.get(1).copied().flatten()?)?.len(),
            };
            unary(&|a| Scalar {
                rank: a.rank + axes,
                ..a
            })
        }
        "Reshape" => {
            let target = constant_ints(model, n.inputs.get(1).copied().flatten()?)?;
            unary(&|a| Scalar {
                rank: target.len(),
                ..a
            })
        }
        _ => None,
    }
}

/// The value of `v` of the enclosing graphs where it is known before the run: a constant,
/// one of the ops of [`evaluate`] on such values, `depth` nodes up, or an element of a shape
/// whose dims `shapes` knows (tf2onnx compares the counter with `Shape(x)[0]` where Keras
/// lost the static sequence length).
fn outer_scalar(model: &Model, shapes: &Shapes, v: ValueId, depth: usize) -> Option<Scalar> {
    if let Some(t) = constant_tensor(model, v) {
        return Scalar::of_tensor(t);
    }
    let (node, _) = model.producer(v)?;
    if depth == 0 || !model.node(node).subgraphs.is_empty() {
        return None;
    }
    evaluate(model, node, &|i| outer_scalar(model, shapes, i, depth - 1)).or_else(|| {
        let facts = shapes.get(v);
        match known_ints(model, shapes, v)?.as_slice() {
            [value] => Some(Scalar::of(
                facts.elem.unwrap_or(INT64),
                facts.rank().unwrap_or(1),
                *value as f64,
            )),
            _ => None,
        }
    })
}

/// What the Loop is made of.
struct Parts {
    anatomy: LoopParts,
    /// The body's nodes in topological order.
    order: Vec<NodeId>,
    /// The scalars, where known, of the enclosing graphs' values the Loop and its body read
    /// (evaluated once: they are the same in every iteration).
    outer: HashMap<ValueId, Scalar>,
}

impl Parts {
    fn outer_scalar(&self, v: ValueId) -> Option<Scalar> {
        self.outer.get(&v).copied()
    }

    fn is_local(&self, model: &Model, v: ValueId) -> bool {
        let body = self.anatomy.body;
        match model.value(v).def {
            ValueDef::Node { node, .. } => model.node(node).body == body,
            ValueDef::Input { body: b } => b == body,
            _ => false,
        }
    }
}

fn parts(model: &Model, shapes: &Shapes, node: NodeId) -> Result<Parts, String> {
    let anatomy = LoopParts::of(model, node)?;
    let order = topological_order(model, anatomy.body);
    let mut parts = Parts {
        anatomy,
        order,
        outer: HashMap::new(),
    };
    let read: Vec<ValueId> = model
        .node(node)
        .inputs
        .iter()
        .chain(parts.order.iter().flat_map(|i| &model.node(*i).inputs))
        .flatten()
        .copied()
        .chain(parts.anatomy.body_outputs.iter().copied())
        .filter(|v| !parts.is_local(model, *v))
        .collect();
    for v in read {
        if let Some(s) = outer_scalar(model, shapes, v, DEPTH) {
            parts.outer.insert(v, s);
        }
    }
    Ok(parts)
}

/// A body value's scalar in an iteration whose local scalars are `known`.
fn scalar_in(
    model: &Model,
    parts: &Parts,
    known: &HashMap<ValueId, Scalar>,
    v: ValueId,
) -> Option<Scalar> {
    match parts.is_local(model, v) {
        true => known.get(&v).copied(),
        false => parts.outer_scalar(v),
    }
}

/// One iteration's known scalars: its number `i`, its condition `c`, the carried values
/// known before the run, and the body values computed from those and constants.
fn iteration_scalars(
    model: &Model,
    parts: &Parts,
    i: usize,
    c: Option<Scalar>,
    carried: &[Option<Scalar>],
) -> HashMap<ValueId, Scalar> {
    let mut known = HashMap::new();
    known.insert(parts.anatomy.body_inputs[0], Scalar::of(INT64, 0, i as f64));
    // Without a condition input the body reads true (it loops on the trip count alone).
    known.insert(
        parts.anatomy.body_inputs[1],
        c.unwrap_or(Scalar::of(BOOL, 0, 1.0)),
    );
    for (k, s) in carried.iter().enumerate() {
        if let Some(s) = s {
            known.insert(parts.anatomy.body_inputs[2 + k], *s);
        }
    }
    for &node in &parts.order {
        let outputs = &model.node(node).outputs;
        let value = evaluate(model, node, &|v| scalar_in(model, parts, &known, v));
        if let (Some(s), [Some(out)]) = (value, outputs.as_slice()) {
            known.insert(*out, s);
        }
    }
    known
}

/// The known scalars of every iteration the Loop runs (how many: the trip count), or why
/// the trip count is not known before the run.
fn iterations(model: &Model, parts: &Parts) -> Result<Vec<HashMap<ValueId, Scalar>>, String> {
    let limit = match parts.anatomy.trip_count {
        Some(m) => {
            let s = parts.outer_scalar(m).ok_or_else(|| {
                format!(
                    "its trip count M ('{}') is computed at run time",
                    model.name(m)
                )
            })?;
            Some(s.value.max(0.0) as usize)
        }
        None => None,
    };
    let mut c = match parts.anatomy.condition {
        Some(c) => Some(parts.outer_scalar(c).ok_or_else(|| {
            format!(
                "its first condition ('{}') is computed at run time",
                model.name(c)
            )
        })?),
        None => None,
    };
    if limit.is_none() && c.is_none() {
        return Err("it has neither a trip count nor a condition (it never ends)".into());
    }
    let mut carried: Vec<Option<Scalar>> = parts
        .anatomy
        .initial
        .iter()
        .map(|v| parts.outer_scalar(*v))
        .collect();
    let mut iterations = Vec::new();
    loop {
        let i = iterations.len();
        if limit.is_some_and(|m| i >= m) || c.is_some_and(|c| !c.truth()) {
            return Ok(iterations);
        }
        if i == MAX_TRIP_COUNT {
            return Err(format!(
                "it runs more than {MAX_TRIP_COUNT} iterations, each a copy of its body once unrolled"
            ));
        }
        let known = iteration_scalars(model, parts, i, c, &carried);
        if c.is_some() {
            let out = parts.anatomy.body_outputs[0];
            c = Some(scalar_in(model, parts, &known, out).ok_or_else(|| {
                format!(
                    "its condition ('{}') depends on values computed at run time",
                    model.name(out)
                )
            })?);
        }
        carried = (0..parts.anatomy.carried())
            .map(|k| scalar_in(model, parts, &known, parts.anatomy.body_outputs[1 + k]))
            .collect();
        iterations.push(known);
    }
}

/// Why the Loop `node` is not unrolled, when it is not (for the autodiff's report).
pub fn why_not(model: &Model, node: NodeId) -> Option<String> {
    let shapes = Shapes::infer(model);
    let parts = match parts(model, &shapes, node) {
        Ok(p) => p,
        Err(e) => return Some(e),
    };
    let scans = parts.anatomy.body_outputs.len() - 1 - parts.anatomy.carried();
    match iterations(model, &parts) {
        Err(e) => Some(e),
        Ok(i) if i.is_empty() && scans > 0 => {
            Some("it runs no iteration, so its scan outputs have no shape".into())
        }
        Ok(_) => None,
    }
}

/// Unrolls the Loop `node` into the main graph and returns its trip count; `None` (nothing
/// changed) when it cannot be unrolled ([`why_not`] says why).
pub fn unroll(
    model: &mut Model,
    node: NodeId,
    shapes: &Shapes,
    pass: &'static str,
) -> Result<Option<usize>, PassError> {
    let Ok(parts) = parts(model, shapes, node) else {
        return Ok(None);
    };
    let Ok(iterations) = iterations(model, &parts) else {
        return Ok(None);
    };
    let carried_count = parts.anatomy.carried();
    let scans = parts.anatomy.body_outputs.len() - 1 - carried_count;
    if iterations.is_empty() && scans > 0 {
        return Ok(None);
    }
    hoist_initializers(model, parts.anatomy.body);
    let loop_outputs = model.node(node).outputs.clone();
    let loop_name = model.node(node).proto.name().to_string();
    let first_copy = NodeId(model.nodes.len() as u32);
    let mut unrolled = Unrolled {
        b: Builder::new(model, BodyId::MAIN, pass),
        parts: &parts,
        shapes,
        loop_name,
        first_copy,
        split_of: HashMap::new(),
        step_reads: HashMap::new(),
        projections: HashMap::new(),
    };

    // Each carried value's graph value between iterations; none while it is a scalar the
    // body computed from constants (made a constant where something reads it).
    let mut carried: Vec<Option<ValueId>> =
        parts.anatomy.initial.iter().copied().map(Some).collect();
    let mut scanned: Vec<Vec<ValueId>> = vec![Vec::new(); scans];
    let mut copies: HashMap<ValueId, ValueId> = HashMap::new();
    for known in &iterations {
        copies.clear();
        unrolled.step_reads.clear();
        for (k, v) in carried.iter().enumerate() {
            if let Some(v) = v {
                copies.insert(parts.anatomy.body_inputs[2 + k], *v);
            }
        }
        for &n in &parts.order {
            unrolled.copy(n, known, &mut copies)?;
        }
        for (k, scan) in scanned.iter_mut().enumerate() {
            let out = parts.anatomy.body_outputs[1 + carried_count + k];
            scan.push(unrolled.read(out, known, &copies)?);
        }
        carried = parts.anatomy.body_outputs[1..=carried_count]
            .iter()
            .map(|out| match parts.is_local(unrolled.b.model, *out) {
                true => copies.get(out).copied(),
                false => Some(*out),
            })
            .collect();
    }

    // The Loop's outputs: the last carried values, then each scan output stacked.
    let mut replacements = Vec::new();
    for (k, out) in loop_outputs.iter().enumerate() {
        let Some(out) = *out else { continue };
        let new = match (k < carried_count, carried.get(k).copied().flatten()) {
            (true, Some(v)) => v,
            (true, None) => {
                // A scalar of the last iteration (there was one: the value is not the
                // starting value).
                let last = iterations.last().ok_or_else(|| {
                    unrolled.error("internal: a carried scalar without an iteration".into())
                })?;
                unrolled.read(parts.anatomy.body_outputs[1 + k], last, &copies)?
            }
            (false, _) => {
                let hint = unrolled.b.model.name(out).to_string();
                let steps: Vec<ValueId> = scanned[k - carried_count]
                    .iter()
                    .map(|v| unrolled.b.unsqueeze(*v, &[0], &hint))
                    .collect();
                match steps.as_slice() {
                    [one] => *one,
                    _ => unrolled
                        .b
                        .op("Concat", &steps, vec![attr_int("axis", 0)], &hint),
                }
            }
        };
        replacements.push((out, new));
    }
    for (old, new) in replacements {
        if !model.uses(old).is_empty() {
            model.replace_value(old, new);
        }
    }
    model.discard_body(parts.anatomy.body);
    model
        .remove_node(node)
        .map_err(|e| node_error(model, node, format!("could not replace the node: {e}")))?;
    Ok(Some(iterations.len()))
}

/// The body's initializers move to the main graph, where the copies read them; renamed
/// where another value holds the name (tf2onnx gives sibling loop bodies the same names).
fn hoist_initializers(model: &mut Model, body: BodyId) {
    let moved = std::mem::take(&mut model.body_mut(body).initializers);
    for (v, mut t) in moved {
        let name = model.name(v).to_string();
        let clash = (0..model.values.len() as u32)
            .map(ValueId)
            .any(|other| other != v && model.name(other) == name);
        if clash {
            let fresh = model.names.fresh(&name);
            model.values[v.0 as usize].name = fresh.clone();
            t.name = Some(fresh);
        }
        model.values[v.0 as usize].def = ValueDef::Initializer { body: BodyId::MAIN };
        model.body_mut(BodyId::MAIN).initializers.push((v, t));
    }
}

/// The copying of one Loop's iterations into the main graph.
struct Unrolled<'m, 'p> {
    b: Builder<'m>,
    parts: &'p Parts,
    shapes: &'p Shapes,
    loop_name: String,
    /// An outer value read one step per iteration: its Split's outputs, squeezed where read.
    split_of: HashMap<ValueId, (NodeId, Vec<Option<ValueId>>)>,
    /// This iteration's time-step reads: body value -> (outer X, step t, steps T), emitted
    /// (as a Split output) only where something reads the step itself.
    step_reads: HashMap<ValueId, (ValueId, i64, i64)>,
    /// `MatMul(X, W)` over every step at once, by (X, W).
    projections: HashMap<(ValueId, ValueId), ValueId>,
    /// The first node the unrolling made: a value from a node before it is the same in
    /// every iteration.
    first_copy: NodeId,
}

impl Unrolled<'_, '_> {
    fn error(&self, message: String) -> PassError {
        PassError::Node {
            pass: super::PASS.into(),
            node: self.loop_name.clone(),
            op: "Loop".into(),
            message,
        }
    }

    /// Body value `v` (or an outer one) as this iteration's copies read it: the outer value
    /// itself, its time step, its copy, or its scalar as a constant.
    fn read(
        &mut self,
        v: ValueId,
        known: &HashMap<ValueId, Scalar>,
        copies: &HashMap<ValueId, ValueId>,
    ) -> Result<ValueId, PassError> {
        if !self.parts.is_local(self.b.model, v) {
            return Ok(v);
        }
        if let Some(&(x, t, steps)) = self.step_reads.get(&v) {
            return Ok(self.step(x, t, steps));
        }
        if let Some(copy) = copies.get(&v) {
            return Ok(*copy);
        }
        let scalar = known.get(&v).ok_or_else(|| {
            self.error(format!(
                "internal: body value '{}' was neither copied nor evaluated",
                self.b.model.name(v)
            ))
        })?;
        let hint = self.b.model.name(v).to_string();
        Ok(self.b.constant(&hint, scalar.tensor()))
    }

    /// Whether `v` is the same in every iteration: no copy made it.
    fn invariant(&self, v: ValueId) -> bool {
        self.b
            .model
            .producer(v)
            .is_none_or(|(n, _)| n.0 < self.first_copy.0)
    }

    /// Copies body node `n` for this iteration, unless its outputs are integer or boolean
    /// scalars known before the run.
    fn copy(
        &mut self,
        n: NodeId,
        known: &HashMap<ValueId, Scalar>,
        copies: &mut HashMap<ValueId, ValueId>,
    ) -> Result<(), PassError> {
        let node = self.b.model.node(n).clone();
        let outputs: Vec<ValueId> = node.outputs.iter().flatten().copied().collect();
        if outputs
            .iter()
            .all(|o| known.get(o).is_some_and(|s| !is_float(s.elem)))
        {
            return Ok(());
        }
        let p = &node.proto;
        let default_domain = p.domain().is_empty() || p.domain() == "ai.onnx";
        if let [out] = outputs.as_slice() {
            if let Some(read) = self.time_step(&node, known) {
                self.step_reads.insert(*out, read);
                return Ok(());
            }
            // A time step's projection by a weight every iteration reads (TensorFlow's
            // cells multiply each step's input by the kernel): one MatMul of the whole
            // sequence, split, whose gradient is one MatMul too.
            if let (true, "MatMul", [Some(a), Some(w)]) =
                (default_domain, p.op_type(), node.inputs.as_slice())
            {
                if let Some(&(x, t, steps)) = self.step_reads.get(a) {
                    let w = self.read(*w, known, copies)?;
                    if self.invariant(w) && self.shapes.get(w).rank() == Some(2) {
                        let projected = match self.projections.get(&(x, w)) {
                            Some(p) => *p,
                            None => {
                                let hint = format!("{}_projected", self.b.model.name(x));
                                let p = self.b.op("MatMul", &[x, w], vec![], &hint);
                                self.projections.insert((x, w), p);
                                p
                            }
                        };
                        let step = self.step(projected, t, steps);
                        copies.insert(*out, step);
                        return Ok(());
                    }
                }
            }
        }
        // A body's Identity (tf2onnx writes one per TensorFlow Identity) forwards its input:
        // the copies read that directly.
        if p.op_type() == "Identity" && default_domain {
            if let (Some(Some(x)), [y]) = (node.inputs.first(), outputs.as_slice()) {
                let forwarded = self.read(*x, known, copies)?;
                copies.insert(*y, forwarded);
                return Ok(());
            }
        }
        let mut inputs = Vec::with_capacity(node.inputs.len());
        for v in &node.inputs {
            inputs.push(match v {
                Some(v) => Some(self.read(*v, known, copies)?),
                None => None,
            });
        }
        // An If or Loop in the body reads this iteration's copies too.
        let mut captured = HashMap::new();
        for sub in &node.subgraphs {
            for v in self.b.model.captures(sub.body) {
                let copy = self.read(v, known, copies)?;
                captured.insert(v, copy);
            }
        }
        for (original, copy) in copy_node(&mut self.b, n, &inputs, &captured) {
            if let Some(ty) = self.b.model.value_type(original) {
                self.b.model.set_value_type(copy, ty);
            }
            copies.insert(original, copy);
        }
        Ok(())
    }

    /// `Gather(X, t)` of an outer X at a known position t on axis 0 of T: (X, t, T); `None`
    /// where the node is not that.
    fn time_step(
        &self,
        node: &crate::ir::Node,
        known: &HashMap<ValueId, Scalar>,
    ) -> Option<(ValueId, i64, i64)> {
        let p = &node.proto;
        if p.op_type() != "Gather" || !(p.domain().is_empty() || p.domain() == "ai.onnx") {
            return None;
        }
        let (Some(Some(x)), Some(Some(index))) = (node.inputs.first(), node.inputs.get(1)) else {
            return None;
        };
        if self.parts.is_local(self.b.model, *x) {
            return None;
        }
        let t = known
            .get(index)
            .filter(|s| s.rank == 0 && !is_float(s.elem))?;
        let facts = self.shapes.get(*x);
        let rank = facts.rank()?;
        let steps = facts.dims.as_ref()?.first()?.known()?;
        let axis = p.attr_int("axis").ok().flatten().unwrap_or(0);
        let t = if t.value < 0.0 {
            t.value as i64 + steps
        } else {
            t.value as i64
        };
        ((axis == 0 || axis == -(rank as i64)) && (0..steps).contains(&t) && steps >= 2)
            .then_some((*x, t, steps))
    }

    /// Step t of the T along axis 0 of `x`: output t of one Split of `x`, squeezed (the
    /// Split and each Squeeze made once).
    fn step(&mut self, x: ValueId, t: i64, steps: i64) -> ValueId {
        let h = self.b.model.name(x).to_string();
        if !self.split_of.contains_key(&x) {
            let ones = vec![1; steps as usize];
            let hints: Vec<String> = (0..steps).map(|_| h.clone()).collect();
            let hint_refs: Vec<&str> = hints.iter().map(String::as_str).collect();
            let split = match self.b.opset() >= 13 {
                true => {
                    let sizes = self.b.ints("split", &ones);
                    self.b.node(
                        "Split",
                        "",
                        &[Some(x), Some(sizes)],
                        &hint_refs,
                        vec![attr_int("axis", 0)],
                    )
                }
                false => self.b.node(
                    "Split",
                    "",
                    &[Some(x)],
                    &hint_refs,
                    vec![attr_int("axis", 0), attr_ints("split", &ones)],
                ),
            };
            self.split_of.insert(x, (split, vec![None; steps as usize]));
        }
        let (split, squeezed) = &self.split_of[&x];
        if let Some(v) = squeezed[t as usize] {
            return v;
        }
        let piece = self.b.model.output(*split, t as usize);
        let v = match axes_as_input("Squeeze", self.b.opset()) {
            true => {
                let axes = self.b.axes(&[0]);
                self.b.op("Squeeze", &[piece, axes], vec![], &h)
            }
            false => self
                .b
                .op("Squeeze", &[piece], vec![attr_ints("axes", &[0])], &h),
        };
        if let Some(entry) = self.split_of.get_mut(&x) {
            entry.1[t as usize] = Some(v);
        }
        v
    }
}
