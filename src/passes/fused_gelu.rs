//! The exact GELU's forward on onnx-ga's `Gelu` kernel, in memory, for an ONNX Runtime
//! session: the five elementwise ops a forward model exports for `y = (x · (1 + erf(x / f)))
//! · h` become one node with two outputs, y and A = 1 + erf(x / f), which the gradient reads
//! ([`crate::fused_ops`] has what it computes). The step file is never rewritten: it stays
//! standard ONNX. Bit-identical: the kernel runs the same float32 operations in their
//! order, and ONNX Runtime's own `Erf`.
//!
//! ```text
//! u = Div(x, f)    e = Erf(u)    A = Add(e, one)    xA = Mul(x, A)    y = Mul(xA, h)
//! ```
//!
//! Matched: that chain in the main graph, each `Add` and `Mul` in either operand order,
//! `f`, `one` and `h` one-element float32 constants (so x is float32 too), u, e and xA read
//! only inside it; A may be read anywhere (it becomes the node's second output). Runs after
//! [`super::fused_gelu_grad`], which needs the forward's `Div`, `Erf` and `Add` as nodes to
//! find its gradient, and leaves u read by the `Erf` alone.

use super::fused_gelu_grad::{binary, main_op, scalar, unary, with_scalar};
use crate::fused_ops::{gelu_forward_slot, DOMAIN, GELU};
use crate::ir::builder::Builder;
use crate::ir::{BodyId, Model, NodeId, ValueId};
use crate::proto::ModelProto;

pub const PASS: &str = "fused-gelu";

/// A session's model with its GELU forwards on the fused kernel.
pub struct Rewritten {
    pub model: ModelProto,
    /// GELU forwards rewritten.
    pub gelus: usize,
}

/// `model` with every GELU forward the module's pattern matches on `Gelu`; `None` when none
/// is.
pub fn rewrite(model: &ModelProto) -> Result<Option<Rewritten>, super::PassError> {
    if !super::has_op(model, "Erf") {
        return Ok(None);
    }
    let mut ir = Model::from_proto(model.clone());
    let found: Vec<(NodeId, Found)> = ir
        .body_nodes(BodyId::MAIN)
        .filter_map(|n| gelu_forward(&ir, n).map(|found| (n, found)))
        .collect();
    if found.is_empty() {
        return Ok(None);
    }
    for (mul, found) in &found {
        let y = ir.output(*mul, 0);
        let hints = [
            format!("{}.fused", ir.name(y)),
            format!("{}.fused", ir.name(found.a)),
        ];
        let node = Builder::new(&mut ir, BodyId::MAIN, PASS).node(
            GELU,
            DOMAIN,
            &found.inputs.map(Some),
            &[&hints[0], &hints[1]],
            vec![],
        );
        let (fused_y, fused_a) = (
            ir.output(node, gelu_forward_slot::Y),
            ir.output(node, gelu_forward_slot::A),
        );
        ir.replace_value(y, fused_y);
        ir.replace_value(found.a, fused_a);
    }
    Ok(Some(Rewritten {
        model: super::finish_in_memory(ir, PASS)?,
        gelus: found.len(),
    }))
}

/// A GELU forward: the kernel's inputs ([`gelu_forward_slot`]) and the `Add`'s output A.
struct Found {
    inputs: [ValueId; gelu_forward_slot::COUNT],
    a: ValueId,
}

/// The chain of the module's comment ending at the `Mul` `mul`.
fn gelu_forward(model: &Model, mul: NodeId) -> Option<Found> {
    if !main_op(model, mul, "Mul", 2) {
        return None;
    }
    let ins = [
        super::fuse::input(model, mul, 0)?,
        super::fuse::input(model, mul, 1)?,
    ];
    // y = Mul(xA, h), xA = Mul(x, A), in either order.
    let (xa, half) = with_scalar(model, ins)?;
    let (_, xa_ins) = binary(model, xa, "Mul", mul)?;
    // A = Add(e, one): A may have other readers, so its node is found by its producer.
    let adds = [(xa_ins[0], xa_ins[1]), (xa_ins[1], xa_ins[0])];
    let (x, a, add, (e, one)) = adds.into_iter().find_map(|(x, a)| {
        let (add, 0) = model.producer(a)? else {
            return None;
        };
        let is_add = main_op(model, add, "Add", 2);
        let add_ins = [
            super::fuse::input(model, add, 0)?,
            super::fuse::input(model, add, 1)?,
        ];
        is_add.then_some(())?;
        Some((x, a, add, with_scalar(model, add_ins)?))
    })?;
    let (erf, u) = unary(model, e, "Erf", add)?;
    let (_, [dividend, divisor]) = binary(model, u, "Div", erf)?;
    if dividend != x || !scalar(model, divisor) || x == a {
        return None;
    }
    let mut inputs = [x; gelu_forward_slot::COUNT];
    inputs[gelu_forward_slot::DIVISOR] = divisor;
    inputs[gelu_forward_slot::ONE] = one;
    inputs[gelu_forward_slot::HALF] = half;
    Some(Found { inputs, a })
}
