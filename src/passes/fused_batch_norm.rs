//! Training-mode BatchNorm on onnx-ga's fused CPU kernels, in memory, for an ONNX Runtime
//! session: the standard-op lowering of each layer's forward (`BatchNormInternal`,
//! `passes/legalize/batch_norm_internal.rs`) becomes one `BatchNormTrain` node, that of its
//! backward (`BatchNormalizationGrad`, `passes/legalize/batch_norm_grad.rs`) one
//! `BatchNormGrad` ([`crate::fused_ops`] has what they compute). The step file is never
//! rewritten: it stays standard ONNX.
//!
//! Why: the lowerings are some 15 and 20 nodes a layer, eight full passes over the
//! activation forward and ten backward, with a dispatch each; the kernels make two passes
//! each way, channels split over the intra-op pool. On the ResNet-8 with BatchNorm at B 8
//! that was the floor's largest cost after the convolutions (benches/README.md).
//!
//! What is matched, by structure and in the operand order the lowerings write (ranks 3 and
//! more, the spatial axes reduced; `n` the elements per channel, a constant when shapes are
//! static, else `Cast(Div(Size(X), Size(scale)))`):
//!
//! ```text
//! forward   m = ReduceMean(X, [0, 2..], keep)          mean = Reshape(m, [-1])
//!           var = Div(ReduceSum(ReduceSumSquare(Sub(X, m), [2..]), [0]), n)
//!           inv_std = Sqrt(Reciprocal(Add(var, ε)))    g = Mul(inv_std, scale)
//!           Y = BatchNormalization(X, g, Sub(B, Mul(mean, g)), 0, 1; epsilon 0)
//! backward  x̂ = Mul(Sub(X, Reshape(mean)), Reshape(inv_std))       k = Mul(scale, inv_std)
//!           dBias = ReduceSum(dY, [0, 2..])              dScale = ReduceSum(Mul(dY, x̂), [0, 2..])
//!           dX = Sub(BatchNormalization(dY, k, Neg(Mul(k, Div(dBias, n))), 0, 1; epsilon 0),
//!                    Mul(x̂, Reshape(Mul(k, Div(dScale, n)))))
//! ```
//!
//! The fused node's outputs replace the values the lowering's outputs were (Y, mean, var,
//! inv_std; dX, dScale, dBias); the nodes only they read are then dead and removed. A
//! matched value something else reads too keeps its node, so the rewrite never changes what
//! the graph computes. float32 only (the kernels'); anything else is left as written.
//!
//! In-place updates stay ordered: a layer's scale is updated from its dScale, which the
//! fused backward makes from the fused forward's outputs, so both fused nodes run before
//! the update that reads its gradient ([`super::fuse::in_place`]).

use super::autodiff::shapes::{constant_f32, constant_ints, constant_tensor, Shapes};
use super::fuse::{input, is_op};
use super::made_by;
use crate::fused_ops::{BATCH_NORM_GRAD, BATCH_NORM_TRAIN, DOMAIN};
use crate::ir::builder::{attr_float, Builder, NodeAttributes};
use crate::ir::{normalize_domain, BodyId, Model, NodeId, ValueId};
use crate::proto::{tensor_proto::DataType, ModelProto};

pub const PASS: &str = "fused-batch-norm";

/// A session's model with its BatchNorm layers on the fused kernels.
pub struct Rewritten {
    pub model: ModelProto,
    /// Forward layers fused (`BatchNormTrain`).
    pub forward: usize,
    /// Backward layers fused (`BatchNormGrad`).
    pub backward: usize,
}

/// `model` with every BatchNorm lowering the module's patterns match on the fused kernels;
/// `None` when none is.
pub fn rewrite(model: &ModelProto) -> Result<Option<Rewritten>, super::PassError> {
    if !super::has_op(model, "BatchNormalization") {
        return Ok(None);
    }
    let mut ir = Model::from_proto(model.clone());
    let shapes = Shapes::infer(&ir);
    let affines: Vec<NodeId> = ir
        .body_nodes(BodyId::MAIN)
        .filter(|&n| affine_inputs(&ir, n).is_some())
        .collect();
    let forwards: Vec<Forward> = affines
        .iter()
        .filter_map(|&n| match_forward(&ir, &shapes, n))
        .collect();
    let backwards: Vec<Backward> = affines
        .iter()
        .filter_map(|&n| match_backward(&ir, &shapes, n))
        .collect();
    if forwards.is_empty() && backwards.is_empty() {
        return Ok(None);
    }
    // The backwards first: each reads its forward's mean and inv_std, values the forward's
    // fusion then replaces, its readers with them; made after, a backward would read the
    // values as matched, and keep the forward's standard ops alive for them.
    for b in &backwards {
        let hints = [b.dx, b.dscale, b.dbias].map(|v| format!("{}.fused", ir.name(v)));
        let hints: Vec<&str> = hints.iter().map(String::as_str).collect();
        let inputs = [b.dy, b.x, b.scale, b.mean, b.inv_std].map(Some);
        let node = Builder::new(&mut ir, BodyId::MAIN, PASS).node(
            BATCH_NORM_GRAD,
            DOMAIN,
            &inputs,
            &hints,
            vec![],
        );
        for (slot, old) in [b.dx, b.dscale, b.dbias].into_iter().enumerate() {
            let new = ir.output(node, slot);
            ir.replace_value(old, new);
        }
    }
    for f in &forwards {
        let hints = [f.y, f.mean, f.var, f.inv_std].map(|v| format!("{}.fused", ir.name(v)));
        let hints: Vec<&str> = hints.iter().map(String::as_str).collect();
        let node = Builder::new(&mut ir, BodyId::MAIN, PASS).node(
            BATCH_NORM_TRAIN,
            DOMAIN,
            &[Some(f.x), Some(f.scale), Some(f.bias)],
            &hints,
            vec![attr_float("epsilon", f.epsilon)],
        );
        for (slot, old) in [f.y, f.mean, f.var, f.inv_std].into_iter().enumerate() {
            let new = ir.output(node, slot);
            ir.replace_value(old, new);
        }
    }
    Ok(Some(Rewritten {
        model: super::finish_in_memory(ir, PASS)?,
        forward: forwards.len(),
        backward: backwards.len(),
    }))
}

/// One matched forward: its operands and the four values it replaces.
struct Forward {
    x: ValueId,
    scale: ValueId,
    bias: ValueId,
    epsilon: f32,
    y: ValueId,
    mean: ValueId,
    var: ValueId,
    inv_std: ValueId,
}

/// One matched backward: its operands and the three values it replaces.
struct Backward {
    dy: ValueId,
    x: ValueId,
    scale: ValueId,
    mean: ValueId,
    inv_std: ValueId,
    dx: ValueId,
    dscale: ValueId,
    dbias: ValueId,
}

/// `Y = BatchNormalization(x, a, b, 0, 1; epsilon 0)` (inference mode), the lowerings'
/// per-channel affine `x · a + b`: `(x, a, b)`.
fn affine_inputs(model: &Model, n: NodeId) -> Option<(ValueId, ValueId, ValueId)> {
    let node = model.node(n);
    let standard = node.proto.op_type() == "BatchNormalization"
        && normalize_domain(node.proto.domain()).is_empty()
        && node.outputs.len() == 1
        && node.inputs.len() == 5;
    if !standard || node.proto.attr_float("epsilon").ok()? != Some(0.0) {
        return None;
    }
    if !super::only_attributes(&node.proto, &["epsilon", "momentum", "training_mode"]) {
        return None;
    }
    if node.proto.attr_int("training_mode").ok()?.unwrap_or(0) != 0 {
        return None;
    }
    let [x, a, b, zeros, ones] = [0, 1, 2, 3, 4].map(|slot| node.inputs[slot]);
    if !(filled_with(model, zeros?, 0.0) && filled_with(model, ones?, 1.0)) {
        return None;
    }
    Some((x?, a?, b?))
}

fn match_forward(model: &Model, shapes: &Shapes, bn: NodeId) -> Option<Forward> {
    let (x, gain, shift) = affine_inputs(model, bn)?;
    let (inv_std, scale) = operands(model, gain, "Mul")?;
    let recip = single_operand(model, inv_std, "Sqrt")?;
    let shifted = single_operand(model, recip, "Reciprocal")?;
    let (var, eps) = operands(model, shifted, "Add")?;
    let epsilon = constant_f32(model, eps)?;
    let (squares, n) = operands(model, var, "Div")?;
    let (per_image, batch_axes) = reduced(model, squares, "ReduceSum", false)?;
    let (centered, spatial) = reduced(model, per_image, "ReduceSumSquare", false)?;
    let rank = spatial.len() + 2;
    if batch_axes != [0] || spatial != (2..rank as i64).collect::<Vec<_>>() {
        return None;
    }
    let (x2, kept_mean) = operands(model, centered, "Sub")?;
    let (x3, mean_axes) = reduced(model, kept_mean, "ReduceMean", true)?;
    if x2 != x || x3 != x || mean_axes != stat_axes(rank) {
        return None;
    }
    let (bias, product) = operands(model, shift, "Sub")?;
    let (mean, gain2) = operands(model, product, "Mul")?;
    let (kept_mean2, flat) = operands(model, mean, "Reshape")?;
    if gain2 != gain || kept_mean2 != kept_mean || constant_ints(model, flat)? != [-1] {
        return None;
    }
    let fits = float32_or_unknown(shapes, x, rank)
        && float32(shapes, scale, 1)
        && float32(shapes, bias, 1);
    if !fits || !is_count(model, shapes, n, x, scale) {
        return None;
    }
    Some(Forward {
        x,
        scale,
        bias,
        epsilon,
        y: model.output(bn, 0),
        mean,
        var,
        inv_std,
    })
}

fn match_backward(model: &Model, shapes: &Shapes, bn: NodeId) -> Option<Backward> {
    let (dy, k, shift) = affine_inputs(model, bn)?;
    let scaled = model.output(bn, 0);
    // dX = Sub(scaled, along): the affine's only reader.
    let [crate::ir::Use::Node { node: sub, slot: 0 }] = model.uses(scaled) else {
        return None;
    };
    let sub = *sub;
    if !is_op(model, sub, "Sub", 2) {
        return None;
    }
    let along = input(model, sub, 1)?;
    let (scale, inv_std) = operands(model, k, "Mul")?;
    let shift_product = single_operand(model, shift, "Neg")?;
    let (k2, mean_dy) = operands(model, shift_product, "Mul")?;
    let (dbias, n) = operands(model, mean_dy, "Div")?;
    let (dy2, bias_axes) = reduced(model, dbias, "ReduceSum", false)?;
    let (x_hat, slope_c) = operands(model, along, "Mul")?;
    let (slope, slope_shape) = operands(model, slope_c, "Reshape")?;
    let (k3, mean_dy_x_hat) = operands(model, slope, "Mul")?;
    let (dscale, n2) = operands(model, mean_dy_x_hat, "Div")?;
    let (dy_x_hat, scale_axes) = reduced(model, dscale, "ReduceSum", false)?;
    let (dy3, x_hat2) = operands(model, dy_x_hat, "Mul")?;
    let (centered, inv_std_c) = operands(model, x_hat, "Mul")?;
    let (x, mean_c) = operands(model, centered, "Sub")?;
    let (mean, mean_shape) = operands(model, mean_c, "Reshape")?;
    let (inv_std2, inv_std_shape) = operands(model, inv_std_c, "Reshape")?;
    let rank = bias_axes.len() + 1;
    if rank < 3 {
        return None;
    }
    let channel_shape: Vec<i64> = std::iter::once(-1)
        .chain(std::iter::repeat_n(1, rank - 2))
        .collect();
    let same = k2 == k
        && k3 == k
        && n2 == n
        && dy2 == dy
        && dy3 == dy
        && x_hat2 == x_hat
        && inv_std2 == inv_std
        && bias_axes == stat_axes(rank)
        && scale_axes == bias_axes;
    let shaped = [slope_shape, mean_shape, inv_std_shape]
        .iter()
        .all(|&s| constant_ints(model, s).as_deref() == Some(channel_shape.as_slice()));
    let fits = float32_or_unknown(shapes, x, rank)
        && float32_or_unknown(shapes, dy, rank)
        && float32(shapes, scale, 1)
        && [mean, inv_std]
            .iter()
            .all(|&v| float32_or_unknown(shapes, v, 1));
    if !(same && shaped && fits && is_count(model, shapes, n, dy, scale)) {
        return None;
    }
    Some(Backward {
        dy,
        x,
        scale,
        mean,
        inv_std,
        dx: model.output(sub, 0),
        dscale,
        dbias,
    })
}

/// `[0, 2, .., rank)`: every axis but the channels'.
fn stat_axes(rank: usize) -> Vec<i64> {
    std::iter::once(0).chain(2..rank as i64).collect()
}

/// `v = op(a, b)`, a binary op without attributes: `(a, b)`.
pub(super) fn operands(model: &Model, v: ValueId, op: &str) -> Option<(ValueId, ValueId)> {
    let n = made_by(model, v, op)?;
    is_op(model, n, op, 2).then_some((input(model, n, 0)?, input(model, n, 1)?))
}

/// `v = op(a)`, a unary op without attributes: `a`.
fn single_operand(model: &Model, v: ValueId, op: &str) -> Option<ValueId> {
    let n = made_by(model, v, op)?;
    is_op(model, n, op, 1).then(|| input(model, n, 0))?
}

/// `v = op(x)` reducing the constant axes it has (attribute or input) with `keepdims` as
/// given and nothing else: `(x, axes)`.
pub(super) fn reduced(
    model: &Model,
    v: ValueId,
    op: &str,
    keepdims: bool,
) -> Option<(ValueId, Vec<i64>)> {
    reduction(model, made_by(model, v, op)?, keepdims)
}

/// The input and axes of the reduction node `n` (its op checked by the caller): constant
/// axes (attribute or input), `keepdims` as given, no other attribute.
pub(super) fn reduction(model: &Model, n: NodeId, keepdims: bool) -> Option<(ValueId, Vec<i64>)> {
    let node = model.node(n);
    if !super::only_attributes(&node.proto, &["axes", "keepdims"]) {
        return None;
    }
    if node.proto.attr_int("keepdims").ok()?.unwrap_or(1) != keepdims as i64 {
        return None;
    }
    let axes = match (node.proto.attr_ints("axes").ok()?, input(model, n, 1)) {
        (Some(axes), None) => axes,
        (None, Some(axes)) => constant_ints(model, axes)?,
        _ => return None,
    };
    Some((input(model, n, 0)?, axes))
}

/// `v` is float32 of rank `rank` (or of unknown rank).
fn float32(shapes: &Shapes, v: ValueId, rank: usize) -> bool {
    let f = shapes.get(v);
    f.elem == Some(DataType::Float as i32) && f.rank().is_none_or(|r| r == rank)
}

/// `v` is float32 or of unknown type, of rank `rank` or unknown rank: an activation or a
/// gradient the lowering multiplies with a float32 per-channel value, so of its type.
fn float32_or_unknown(shapes: &Shapes, v: ValueId, rank: usize) -> bool {
    let f = shapes.get(v);
    f.elem.is_none_or(|e| e == DataType::Float as i32) && f.rank().is_none_or(|r| r == rank)
}

/// `v` is a constant float32 tensor of `value` everywhere.
fn filled_with(model: &Model, v: ValueId, value: f32) -> bool {
    constant_tensor(model, v)
        .and_then(|t| crate::data::Tensor::from_tensor_proto(t).ok())
        .is_some_and(|t| t.as_f32().is_some_and(|a| a.iter().all(|&x| x == value)))
}

/// `n` is the elements per channel of `t`: the constant its static shape gives, or
/// `Cast(Div(Size(t), Size(scale)))` to float.
fn is_count(model: &Model, shapes: &Shapes, n: ValueId, t: ValueId, scale: ValueId) -> bool {
    if let Some(value) = constant_f32(model, n) {
        let dims = shapes.get(t).static_dims();
        return dims.is_some_and(|d| {
            d.len() >= 2 && d[1] > 0 && (d.iter().product::<i64>() / d[1]) as f32 == value
        });
    }
    let Some(cast) = made_by(model, n, "Cast") else {
        return false;
    };
    let node = model.node(cast);
    if node.proto.attr_int("to").ok().flatten() != Some(DataType::Float as i64) {
        return false;
    }
    let Some(quotient) = input(model, cast, 0) else {
        return false;
    };
    let size_of = |v: ValueId| single_operand(model, v, "Size");
    operands(model, quotient, "Div").is_some_and(|(total, channels)| {
        size_of(total) == Some(t) && size_of(channels) == Some(scale)
    })
}
