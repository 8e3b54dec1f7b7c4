//! The exact GELU's gradient on onnx-ga's `GeluGrad` kernel, in memory, for an ONNX Runtime
//! session: the ten elementwise ops our autodiff writes for `y = (x · (1 + erf(x / s))) · h`
//! become one node ([`crate::fused_ops`] has what it computes). The step file is never
//! rewritten: it stays standard ONNX.
//!
//! ```text
//! g = Mul(G, h)                    dX_a = Mul(g, A)          dA = Mul(g, x)
//! e = Exp(Neg(Mul(u, u)))          c = Mul(e, k)             d = Mul(dA, c)
//! dX = Add(dX_a, Div(d, s))        (u = x / s, A = 1 + erf(u): the forward's values)
//! ```
//!
//! Matched: that subgraph in the main graph, each product in either operand order, `h`, `k`
//! and `s` one-element float32 constants, every intermediate read only inside it; `u` and
//! `A` the forward's `Div(x, f)` (f a scalar) and `Add(Erf(u), scalar)`, so of x's shape, and
//! G not known to differ from it (the kernel refuses other shapes at run time). The kernel
//! computes exactly those operations in that order, u recomputed as the forward's `Div`;
//! only `Exp` is its own.

use super::autodiff::shapes::{constant_f32, Dim, Facts, Shapes};
use super::fuse::{input, is_op, read_only_by};
use crate::fused_ops::{gelu_slot, DOMAIN, GELU_GRAD};
use crate::ir::builder::Builder;
use crate::ir::{BodyId, Model, NodeId, ValueId};
use crate::proto::ModelProto;

pub const PASS: &str = "fused-gelu-grad";

/// A session's model with its GELU gradients on the fused kernel.
pub struct Rewritten {
    pub model: ModelProto,
    /// GELU gradients rewritten.
    pub gelu_grads: usize,
}

/// `model` with every GELU gradient the module's pattern matches on `GeluGrad`; `None` when
/// none is.
pub fn rewrite(model: &ModelProto) -> Result<Option<Rewritten>, super::PassError> {
    if !super::has_op(model, "Exp") {
        return Ok(None);
    }
    let mut ir = Model::from_proto(model.clone());
    let shapes = Shapes::infer(&ir);
    let found: Vec<(NodeId, [ValueId; gelu_slot::COUNT])> = ir
        .body_nodes(BodyId::MAIN)
        .filter_map(|n| gelu_gradient(&ir, &shapes, n).map(|inputs| (n, inputs)))
        .collect();
    if found.is_empty() {
        return Ok(None);
    }
    for (add, inputs) in &found {
        let dx = ir.output(*add, 0);
        let hint = format!("{}.fused", ir.name(dx));
        let inputs = inputs.map(Some);
        let node = Builder::new(&mut ir, BodyId::MAIN, PASS).node(
            GELU_GRAD,
            DOMAIN,
            &inputs,
            &[&hint],
            vec![],
        );
        let fused = ir.output(node, 0);
        ir.replace_value(dx, fused);
    }
    Ok(Some(Rewritten {
        model: super::finish_in_memory(ir, PASS)?,
        gelu_grads: found.len(),
    }))
}

/// The node of `op` (standard, no attributes, `arity` present inputs, one output, main
/// graph) that makes `v`, read only by `reader`.
fn only_for(model: &Model, v: ValueId, op: &str, arity: usize, reader: NodeId) -> Option<NodeId> {
    let (n, 0) = model.producer(v)? else {
        return None;
    };
    (main_op(model, n, op, arity) && read_only_by(model, v, &[reader])).then_some(n)
}

/// `n` is `op` ([`is_op`]) in the main graph.
pub(super) fn main_op(model: &Model, n: NodeId, op: &str, arity: usize) -> bool {
    is_op(model, n, op, arity) && model.node(n).body == BodyId::MAIN
}

/// [`only_for`] a two-input op: the node and its inputs.
pub(super) fn binary(
    model: &Model,
    v: ValueId,
    op: &str,
    reader: NodeId,
) -> Option<(NodeId, [ValueId; 2])> {
    let n = only_for(model, v, op, 2, reader)?;
    Some((n, [input(model, n, 0)?, input(model, n, 1)?]))
}

/// [`only_for`] a one-input op: the node and its input.
pub(super) fn unary(
    model: &Model,
    v: ValueId,
    op: &str,
    reader: NodeId,
) -> Option<(NodeId, ValueId)> {
    let n = only_for(model, v, op, 1, reader)?;
    Some((n, input(model, n, 0)?))
}

/// `v` is a one-element float32 constant.
pub(super) fn scalar(model: &Model, v: ValueId) -> bool {
    constant_f32(model, v).is_some()
}

/// `[a, b]` with the constant scalar second, when one of them is one.
pub(super) fn with_scalar(model: &Model, [a, b]: [ValueId; 2]) -> Option<(ValueId, ValueId)> {
    match (scalar(model, a), scalar(model, b)) {
        (_, true) => Some((a, b)),
        (true, false) => Some((b, a)),
        _ => None,
    }
}

/// The pattern of the module's comment, ending at the `Add` `add`: the kernel's inputs
/// ([`gelu_slot`]).
fn gelu_gradient(
    model: &Model,
    shapes: &Shapes,
    add: NodeId,
) -> Option<[ValueId; gelu_slot::COUNT]> {
    if !main_op(model, add, "Add", 2) {
        return None;
    }
    let (p, q) = (input(model, add, 0)?, input(model, add, 1)?);
    // dX = Add(dX_a, Div(d, s)), in either order.
    let ((div, [d, s]), dx_a) = match binary(model, q, "Div", add) {
        Some(found) => (found, p),
        None => (binary(model, p, "Div", add)?, q),
    };
    if !scalar(model, s) {
        return None;
    }
    let (mul_a, [a0, a1]) = binary(model, dx_a, "Mul", add)?;
    // d = Mul(dA, c), c = Mul(e, k), e = Exp(Neg(Mul(u, u))).
    let (mul_d, [d0, d1]) = binary(model, d, "Mul", div)?;
    let slope = |c: ValueId| -> Option<(ValueId, ValueId)> {
        let (mul_c, c_ins) = binary(model, c, "Mul", mul_d)?;
        let (e, k) = with_scalar(model, c_ins)?;
        let (exp, n) = unary(model, e, "Exp", mul_c)?;
        let (neg, sq) = unary(model, n, "Neg", exp)?;
        let (_, [u, u2]) = binary(model, sq, "Mul", neg)?;
        (u == u2).then_some((u, k))
    };
    let ((u, k), da) = match slope(d1) {
        Some(found) => (found, d0),
        None => (slope(d0)?, d1),
    };
    // dA = Mul(g, x) and dX_a = Mul(g, A), one g = Mul(G, h) read by both.
    let (mul_da, [da0, da1]) = binary(model, da, "Mul", mul_d)?;
    let (g, x, a) =
        [(da0, da1), (da1, da0)]
            .into_iter()
            .find_map(|(g, x)| match (a0 == g, a1 == g) {
                (true, _) => Some((g, x, a1)),
                (_, true) => Some((g, x, a0)),
                _ => None,
            })?;
    let mul_g = super::fuse::made_by(model, g, "Mul", BodyId::MAIN)?;
    if !read_only_by(model, g, &[mul_a, mul_da]) {
        return None;
    }
    let (upstream, h) = with_scalar(model, [input(model, mul_g, 0)?, input(model, mul_g, 1)?])?;
    // u and A have x's shape by construction (u = Div(x, scalar), A = Add(Erf(u), scalar));
    // G, y's gradient, must not be known to differ from it (the kernel checks it at run
    // time too).
    let forward_divisor = forward_values(model, x, u, a)?;
    if !compatible(&shapes.get(upstream), &shapes.get(x)) {
        return None;
    }
    let mut inputs = [x; gelu_slot::COUNT];
    inputs[gelu_slot::G] = upstream;
    inputs[gelu_slot::A] = a;
    inputs[gelu_slot::HALF] = h;
    inputs[gelu_slot::K] = k;
    inputs[gelu_slot::SQRT2] = s;
    inputs[gelu_slot::FORWARD_SQRT2] = forward_divisor;
    Some(inputs)
}

/// The inputs of the two-input node of `op` in the main graph that makes `v`.
fn made_by(model: &Model, v: ValueId, op: &str) -> Option<[ValueId; 2]> {
    let n = super::fuse::made_by(model, v, op, BodyId::MAIN)?;
    Some([input(model, n, 0)?, input(model, n, 1)?])
}

/// `u = Div(x, f)` and `a = Add(Erf(u), scalar)`, f a scalar: the forward GELU's own values,
/// of x's shape; returns f.
fn forward_values(model: &Model, x: ValueId, u: ValueId, a: ValueId) -> Option<ValueId> {
    let divisor = made_by(model, u, "Div")
        .filter(|[p, q]| *p == x && scalar(model, *q))
        .map(|[_, q]| q);
    let erf_plus_one = made_by(model, a, "Add")
        .and_then(|ins| with_scalar(model, ins))
        .and_then(|(e, _)| model.producer(e))
        .is_some_and(|(erf, _)| main_op(model, erf, "Erf", 1) && input(model, erf, 0) == Some(u));
    divisor.filter(|_| erf_plus_one)
}

/// Float32 both, same rank, no dimension known to differ.
fn compatible(a: &Facts, b: &Facts) -> bool {
    let float = |e: Option<i32>| e == Some(crate::proto::tensor_proto::DataType::Float as i32);
    match (&a.dims, &b.dims) {
        (Some(da), Some(db)) => {
            float(a.elem)
                && float(b.elem)
                && da.len() == db.len()
                && da.iter().zip(db).all(|(p, q)| match (p, q) {
                    (Dim::Known(p), Dim::Known(q)) => p == q,
                    _ => true,
                })
        }
        _ => false,
    }
}
