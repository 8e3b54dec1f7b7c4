//! Stride-1 convolution weight gradients on onnx-ga's `ConvWeightGrad` kernel, in memory,
//! for an ONNX Runtime session: what `passes/legalize/conv_grad.rs` writes for one group,
//!
//! ```text
//! ReduceSum(MatMul(Reshape(cols, [0, 1, C·kk, -1]),
//!                  Transpose(Reshape(dY, [0, 1, M, -1]), perm [0, 1, 3, 2])), axes [0])
//!   cols = Conv(X, Tile(I, [C, 1, 1, 1]); group C, stride 1)     (the unfolding)
//! ```
//!
//! becomes `ConvWeightGrad(X, dY)` with the unfolding's window ([`crate::fused_ops`] has
//! what it computes): the taps are never written to memory. The step file is never
//! rewritten: it stays standard ONNX. Within float32 rounding, not bit-identical (the
//! kernel sums in another order).
//!
//! Runs before `passes::fused_im2col`, which takes the unfoldings left: strided ones, and
//! any whose product this does not match.

use super::autodiff::shapes::{constant_ints, Shapes};
use super::fuse::{input, is_op, read_only_by};
use super::fused_im2col::{unfolding, Unfolding};
use crate::fused_ops::{CONV_WEIGHT_GRAD, DOMAIN};
use crate::ir::builder::{attr_ints, Builder, NodeAttributes};
use crate::ir::{normalize_domain, BodyId, Model, NodeId, ValueId};
use crate::proto::ModelProto;

pub const PASS: &str = "fused-conv-weight-grad";

/// A session's model with its weight gradients on the fused kernel.
pub struct Rewritten {
    pub model: ModelProto,
    /// Weight gradients rewritten.
    pub weight_grads: usize,
}

/// `model` with every weight gradient the module's pattern matches on `ConvWeightGrad`;
/// `None` when none is.
pub fn rewrite(model: &ModelProto) -> Result<Option<Rewritten>, super::PassError> {
    let has_conv = model
        .graph
        .as_ref()
        .is_some_and(|g| g.node.iter().any(|n| n.op_type() == "Conv"));
    if !has_conv {
        return Ok(None);
    }
    let mut ir = Model::from_proto(model.clone());
    let shapes = Shapes::infer(&ir);
    let found: Vec<(NodeId, WeightGrad)> = ir
        .body_nodes(BodyId::MAIN)
        .filter_map(|n| weight_grad(&ir, &shapes, n).map(|w| (n, w)))
        .collect();
    if found.is_empty() {
        return Ok(None);
    }
    for (reduce, w) in &found {
        let summed = ir.output(*reduce, 0);
        let hint = format!("{}.fused", ir.name(summed));
        let u = &w.unfolding;
        let attrs = vec![
            attr_ints("kernel_shape", &u.kernel),
            attr_ints("pads", &u.pads),
            attr_ints("dilations", &u.dilations),
        ];
        let node = Builder::new(&mut ir, BodyId::MAIN, PASS).node(
            CONV_WEIGHT_GRAD,
            DOMAIN,
            &[Some(u.x), Some(w.dy)],
            &[&hint],
            attrs,
        );
        let fused = ir.output(node, 0);
        ir.replace_value(summed, fused);
    }
    Ok(Some(Rewritten {
        model: super::finish_in_memory(ir, PASS)?,
        weight_grads: found.len(),
    }))
}

/// One matched weight gradient: the unfolding it reads X through, and dY.
struct WeightGrad {
    unfolding: Unfolding,
    dy: ValueId,
}

/// The pattern of the module's comment, ending at `reduce`.
fn weight_grad(model: &Model, shapes: &Shapes, reduce: NodeId) -> Option<WeightGrad> {
    let per_image = summed_over_images(model, reduce)?;
    let (matmul, 0) = model.producer(per_image)? else {
        return None;
    };
    if !is_op(model, matmul, "MatMul", 2) || !read_only_by(model, per_image, &[reduce]) {
        return None;
    }
    let (cols, rows) = reshaped_to_one_group(model, input(model, matmul, 0)?)?;
    let dy_t = input(model, matmul, 1)?;
    let (transpose, 0) = model.producer(dy_t)? else {
        return None;
    };
    let t = model.node(transpose);
    let transposed = t.proto.op_type() == "Transpose"
        && normalize_domain(t.proto.domain()).is_empty()
        && t.inputs.len() == 1
        && super::only_attributes(&t.proto, &["perm"])
        && t.proto.attr_ints("perm").ok()?.as_deref() == Some(&[0, 1, 3, 2][..]);
    if !transposed {
        return None;
    }
    let (dy, _) = reshaped_to_one_group(model, input(model, transpose, 0)?)?;
    let (conv, 0) = model.producer(cols)? else {
        return None;
    };
    let unfolding = unfolding(model, shapes, conv)?;
    let group = model.node(conv).proto.attr_int("group").ok()?.unwrap_or(1);
    let taps: i64 = unfolding.kernel.iter().product();
    let stride_one = unfolding.strides.iter().all(|&s| s == 1);
    let known_rank = shapes.get(dy).rank().is_none_or(|r| r == 4);
    (stride_one && known_rank && rows == group * taps).then_some(WeightGrad { unfolding, dy })
}

/// `ReduceSum(v, axes [0], keepdims 0)` (axes as input or attribute): `v`.
fn summed_over_images(model: &Model, reduce: NodeId) -> Option<ValueId> {
    let node = model.node(reduce);
    let standard = node.proto.op_type() == "ReduceSum"
        && normalize_domain(node.proto.domain()).is_empty()
        && node.body == BodyId::MAIN
        && node.outputs.len() == 1
        && super::only_attributes(&node.proto, &["keepdims", "axes"])
        && node.proto.attr_int("keepdims").ok()? == Some(0);
    if !standard {
        return None;
    }
    let axes = match (node.inputs.len(), node.proto.attr_ints("axes").ok()?) {
        (1, Some(axes)) => axes,
        (2, None) => constant_ints(model, input(model, reduce, 1)?)?,
        _ => return None,
    };
    (axes == [0]).then(|| input(model, reduce, 0)).flatten()
}

/// `Reshape(v, [0, 1, rows, -1])`: `(v, rows)`.
fn reshaped_to_one_group(model: &Model, reshaped: ValueId) -> Option<(ValueId, i64)> {
    let (reshape, 0) = model.producer(reshaped)? else {
        return None;
    };
    if !is_op(model, reshape, "Reshape", 2) || model.node(reshape).body != BodyId::MAIN {
        return None;
    }
    match constant_ints(model, input(model, reshape, 1)?)?[..] {
        [0, 1, rows, -1] if rows > 0 => Some((input(model, reshape, 0)?, rows)),
        _ => None,
    }
}
