//! Layer normalisation's gradient on onnx-ga's `LayerNormGrad` kernel, in memory, for an
//! ONNX Runtime session: the thirteen standard ops the legalize lowering of
//! `LayerNormalizationGrad` writes (`passes/legalize/layer_norm_grad.rs`) become one node
//! ([`crate::fused_ops`] has what it computes). The step file is never rewritten: it stays
//! standard ONNX. Within the rounding of the sums, not bit for bit: the kernel sums a row,
//! and the rows, in its own order.
//!
//! Why: each of the thirteen is a pass over the activation with a dispatch; on the GPT at
//! B 8 the nine layers' gradients were 5% of the floor (benches/README.md, "Run Y").
//!
//! Matched, float32, normalised over the last axis, in the operand order the lowering
//! writes:
//!
//! ```text
//! x̂ = Mul(Sub(X, mean), inv_std)       b = Mul(Mul(dY, scale), inv_std)
//! dX = Sub(Sub(b, ReduceMean(b, [-1], keep)), Mul(x̂, ReduceMean(Mul(b, x̂), [-1], keep)))
//! dScale = ReduceSum(Mul(dY, x̂), leading axes)      dBias = ReduceSum(dY, leading axes)
//! ```
//!
//! dScale and dBias are taken when the graph has them (their sums over every axis but the
//! last). The fused node's outputs replace the values the lowering's outputs were; a
//! matched value something else reads too keeps its node, so the rewrite never changes
//! what the graph computes.

use super::autodiff::shapes::Shapes;
use super::fuse::{input, is_op};
use super::fused_batch_norm::{operands, reduced, reduction};
use crate::fused_ops::{layer_norm_grad_slot, DOMAIN, LAYER_NORM_GRAD};
use crate::ir::builder::Builder;
use crate::ir::{normalize_domain, BodyId, Model, NodeId, Use, ValueId};
use crate::proto::{tensor_proto::DataType, ModelProto};

pub const PASS: &str = "fused-layer-norm-grad";

/// A session's model with its layer-norm gradients on the fused kernel.
pub struct Rewritten {
    pub model: ModelProto,
    /// Layer-norm gradients rewritten.
    pub layer_norm_grads: usize,
}

/// One matched gradient: the kernel's inputs and the values its outputs replace.
struct Found {
    inputs: [ValueId; layer_norm_grad_slot::COUNT],
    dx: ValueId,
    dscale: Option<ValueId>,
    dbias: Option<ValueId>,
}

/// `model` with every layer-norm gradient the module's pattern matches on `LayerNormGrad`;
/// `None` when none is.
pub fn rewrite(model: &ModelProto) -> Result<Option<Rewritten>, super::PassError> {
    if !super::has_op(model, "ReduceMean") {
        return Ok(None);
    }
    let mut ir = Model::from_proto(model.clone());
    let shapes = Shapes::infer(&ir);
    let found: Vec<Found> = ir
        .body_nodes(BodyId::MAIN)
        .filter_map(|n| layer_norm_gradient(&ir, &shapes, n))
        .collect();
    if found.is_empty() {
        return Ok(None);
    }
    for f in &found {
        let hints = [f.dx, f.dscale.unwrap_or(f.dx), f.dbias.unwrap_or(f.dx)]
            .map(|v| format!("{}.fused", ir.name(v)));
        let node = Builder::new(&mut ir, BodyId::MAIN, PASS).node(
            LAYER_NORM_GRAD,
            DOMAIN,
            &f.inputs.map(Some),
            &[
                &hints[0],
                &format!("{}.scale", hints[1]),
                &format!("{}.bias", hints[2]),
            ],
            vec![],
        );
        let replaced = [Some(f.dx), f.dscale, f.dbias];
        for (slot, old) in replaced.into_iter().enumerate() {
            if let Some(old) = old {
                let new = ir.output(node, slot);
                ir.replace_value(old, new);
            }
        }
    }
    Ok(Some(Rewritten {
        model: super::finish_in_memory(ir, PASS)?,
        layer_norm_grads: found.len(),
    }))
}

/// `v = ReduceMean(x)` over the last axis of x (rank `rank`), keeping it: `x`.
fn row_mean(model: &Model, v: ValueId, rank: usize) -> Option<ValueId> {
    let (x, axes) = reduced(model, v, "ReduceMean", true)?;
    (axes == [-1] || axes == [rank as i64 - 1]).then_some(x)
}

/// The output of a `ReduceSum` reading `v` over every axis but the last (of `rank`), not
/// keeping them.
fn leading_sum(model: &Model, v: ValueId, rank: usize) -> Option<ValueId> {
    let leading: Vec<i64> = (0..rank as i64 - 1).collect();
    model.uses(v).iter().find_map(|u| match u {
        Use::Node { node, slot: 0 } if model.node(*node).proto.op_type() == "ReduceSum" => {
            let plain = normalize_domain(model.node(*node).proto.domain()).is_empty();
            let (_, axes) = reduction(model, *node, false).filter(|_| plain)?;
            (axes == leading && !leading.is_empty()).then(|| model.output(*node, 0))
        }
        _ => None,
    })
}

/// The pattern of the module's comment ending at the `Sub` `sub` (dX).
fn layer_norm_gradient(model: &Model, shapes: &Shapes, sub: NodeId) -> Option<Found> {
    if !is_op(model, sub, "Sub", 2) || model.node(sub).body != BodyId::MAIN {
        return None;
    }
    let dx = model.output(sub, 0);
    let (b_centered, xhat_mean_c) = (input(model, sub, 0)?, input(model, sub, 1)?);
    let (b, mean_b) = operands(model, b_centered, "Sub")?;
    let (xhat, mean_c) = operands(model, xhat_mean_c, "Mul")?;
    let (g, inv_std) = operands(model, b, "Mul")?;
    let (dy, scale) = operands(model, g, "Mul")?;
    let (centered, inv_std_again) = operands(model, xhat, "Mul")?;
    let (x, mean) = operands(model, centered, "Sub")?;
    let x_facts = shapes.get(x);
    let rank = x_facts.rank()?;
    // X float32; the others are too where known (the lowering's Mul and Sub make them
    // of X's type; the statistics' type may not be declared in a specialised session).
    let float = |v: ValueId| shapes.get(v).elem == Some(DataType::Float as i32);
    let float_or_unknown = |v: ValueId| {
        shapes
            .get(v)
            .elem
            .is_none_or(|e| e == DataType::Float as i32)
    };
    let typed = float(x) && [dy, scale, mean, inv_std].into_iter().all(float_or_unknown);
    // The kernel takes a scale of one axis, the last: a declared parameter's shape.
    let scale_rank = shapes.get(scale).rank();
    if inv_std_again != inv_std || !typed || rank < 2 || scale_rank != Some(1) {
        return None;
    }
    if row_mean(model, mean_b, rank)? != b {
        return None;
    }
    let c = row_mean(model, mean_c, rank)?;
    if operands(model, c, "Mul")? != (b, xhat) {
        return None;
    }
    // dScale: a ReduceSum of Mul(dY, x̂); dBias: one of dY.
    let dscale = model.uses(xhat).iter().find_map(|u| match u {
        Use::Node { node, slot: 1 } if is_op(model, *node, "Mul", 2) => {
            let product = model.output(*node, 0);
            (input(model, *node, 0) == Some(dy)).then_some(())?;
            leading_sum(model, product, rank)
        }
        _ => None,
    });
    let dbias = leading_sum(model, dy, rank);
    let mut inputs = [dy; layer_norm_grad_slot::COUNT];
    inputs[layer_norm_grad_slot::X] = x;
    inputs[layer_norm_grad_slot::SCALE] = scale;
    inputs[layer_norm_grad_slot::MEAN] = mean;
    inputs[layer_norm_grad_slot::INV_STD] = inv_std;
    Some(Found {
        inputs,
        dx,
        dscale,
        dbias,
    })
}
