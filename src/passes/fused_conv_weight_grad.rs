//! A convolution's weight gradient on onnx-ga's `ConvWeightGrad` kernel, in memory, for an
//! ONNX Runtime session: the three nodes `passes/legalize/conv_grad.rs` writes for it once
//! `passes::fused_im2col` put the unfolding on `Im2Col`,
//!
//! ```text
//! ReduceSum(MatMul(Reshape(Im2Col(X), [0, 1, C·kh·kw, -1]),
//!                  Transpose(Reshape(dY, [0, 1, M, -1]), [0, 1, 3, 2])), axes [0], keepdims 0)
//! ```
//!
//! become `ConvWeightGrad(X, dY)` with the unfolding's window ([`crate::fused_ops`] has
//! what it computes). The step file is never rewritten: it stays
//! standard ONNX. Bit-identical: the same columns, the same GEMM per image, the same order
//! of the sum over the images.
//!
//! Why: the three nodes write every image's columns and every image's product to memory
//! and read them back; the kernel keeps one image's columns in cache at a time
//! (benches/README.md, "Run AF").
//!
//! Matched, in sessions of one thread ([`MAX_THREADS`]): that chain in the main graph, one
//! group (the Reshapes' 1), each intermediate read only by the next node, X's channels and
//! dY's known to be the Reshapes' `C` and `M` (facts from the model before onnx-ga's
//! operators, as `passes::fused_leading_sum` reads them), and an image's columns of at
//! least [`MIN_IMAGE_COLUMNS`] elements. A 1×1 kernel without stride or padding has no
//! unfolding (the product reads X itself) and is left alone.

use super::autodiff::shapes::{constant_ints, Facts};
use super::fuse::input;
use super::made_by;
use crate::fused_ops::{CONV_WEIGHT_GRAD, DOMAIN, IM2COL};
use crate::ir::builder::{Builder, NodeAttributes};
use crate::ir::{normalize_domain, BodyId, Model, NodeId, ValueId};
use crate::proto::{AttributeProto, ModelProto};

pub const PASS: &str = "fused-conv-weight-grad";

/// The most session threads for which the pass rewrites. On two threads the three nodes
/// share the work better (each node split its own way; the kernel splits X's channels),
/// and the kernel measured 0.94-1.42x their time (benches/README.md, "Run AF").
pub const MAX_THREADS: usize = 1;

/// The fewest elements in one image's columns for which the pass rewrites (the default of
/// `SessionOptions::conv_weight_grad_min_columns`). Small columns of the whole batch stay
/// in cache between the three nodes anyway, and the kernel's per-image GEMM calls then
/// save nothing. One thread, B 32, the ResNet-8's geometries (per image, per channel half
/// where the lowering halves them), kernel / three nodes on a quiet machine and with the
/// memory bus contended (benches/README.md, "Run AF"): a 1x1 shortcut (4 K elements)
/// 1.04-1.07x and 1.02x; 64 channels at 8x8 (18 K) 1.01-1.09x and 0.73-0.78x; a
/// downsampling of 32 channels (18 K) 0.98-0.99x and 0.70-0.76x; 32 channels at 16x16 (37
/// K) 0.94-0.95x and 0.63-0.73x; 16 at 32x32 (74 K) 0.82-0.85x and 0.79-0.83x.
pub const MIN_IMAGE_COLUMNS: i64 = 1 << 14;

/// A session's model with its weight gradients on the fused kernel.
pub struct Rewritten {
    pub model: ModelProto,
    /// Weight gradients rewritten (one per channel slice the lowering made).
    pub weight_grads: usize,
}

/// `model` with every weight gradient the module's pattern matches on `ConvWeightGrad`;
/// `None` when none is, or when `threads` (the session's) is above [`MAX_THREADS`].
/// `facts_from`: the same model before onnx-ga's operators replaced some of its nodes.
/// `min_columns`: the fewest elements in an image's columns ([`MIN_IMAGE_COLUMNS`]).
pub fn rewrite(
    model: &ModelProto,
    facts_from: &super::FactsBefore<'_>,
    threads: usize,
    min_columns: i64,
) -> Result<Option<Rewritten>, super::PassError> {
    if threads > MAX_THREADS || !super::has_op(model, IM2COL) {
        return Ok(None);
    }
    let mut ir = Model::from_proto(model.clone());
    let session_facts = super::SessionFacts::new(facts_from, &ir);
    let facts = |v: ValueId| session_facts.get(&ir, v);
    let found: Vec<(NodeId, WeightGrad)> = ir
        .body_nodes(BodyId::MAIN)
        .filter_map(|n| weight_grad(&ir, n, &facts, min_columns).map(|g| (n, g)))
        .collect();
    if found.is_empty() {
        return Ok(None);
    }
    for (sum, g) in &found {
        let y = ir.output(*sum, 0);
        let hint = format!("{}.fused", ir.name(y));
        let node = Builder::new(&mut ir, BodyId::MAIN, PASS).node(
            CONV_WEIGHT_GRAD,
            DOMAIN,
            &[Some(g.x), Some(g.dy)],
            &[&hint],
            g.window.clone(),
        );
        ir.place_after(node, *sum);
        let fused = ir.output(node, 0);
        ir.replace_value(y, fused);
    }
    Ok(Some(Rewritten {
        model: super::finish_in_memory(ir, PASS)?,
        weight_grads: found.len(),
    }))
}

/// One matched weight gradient: the convolution's input, its output gradient, and the
/// unfolding's window attributes.
struct WeightGrad {
    x: ValueId,
    dy: ValueId,
    window: Vec<AttributeProto>,
}

/// The only node reading `v`, when it is the standard `op_type` of the main graph.
fn sole_reader(model: &Model, v: ValueId, op_type: &str) -> bool {
    let [crate::ir::Use::Node { node, .. }] = model.uses(v) else {
        return false;
    };
    let node = model.node(*node);
    node.body == BodyId::MAIN
        && node.proto.op_type() == op_type
        && normalize_domain(node.proto.domain()).is_empty()
}

/// `Reshape(v, [0, 1, size, -1])` at `node`: `(v, size)`.
fn grouped_reshape(model: &Model, node: NodeId) -> Option<(ValueId, i64)> {
    let p = &model.node(node).proto;
    if p.attr_int("allowzero").ok()?.unwrap_or(0) != 0 {
        return None;
    }
    match constant_ints(model, input(model, node, 1)?)?[..] {
        [0, 1, size, -1] if size > 0 => Some((input(model, node, 0)?, size)),
        _ => None,
    }
}

fn weight_grad(
    model: &Model,
    sum: NodeId,
    facts: &dyn Fn(ValueId) -> Facts,
    min_columns: i64,
) -> Option<WeightGrad> {
    let node = model.node(sum);
    let p = &node.proto;
    if node.body != BodyId::MAIN
        || p.op_type() != "ReduceSum"
        || !normalize_domain(p.domain()).is_empty()
        || !super::only_attributes(p, &["axes", "keepdims", "noop_with_empty_axes"])
        || p.attr_int("keepdims").ok()?.unwrap_or(1) != 0
    {
        return None;
    }
    let axes = match input(model, sum, 1) {
        Some(axes) => constant_ints(model, axes)?,
        None => p.attr_ints("axes").ok()??,
    };
    if axes != [0] {
        return None;
    }
    // ReduceSum <- MatMul(cols, dY_t)
    let per_image = input(model, sum, 0)?;
    let product = made_by(model, per_image, "MatMul")?;
    if !sole_reader(model, per_image, "ReduceSum") {
        return None;
    }
    let (cols, dy_t) = (input(model, product, 0)?, input(model, product, 1)?);
    // cols <- Reshape(Im2Col(X), [0, 1, rows, -1])
    let (unfolded, rows) = grouped_reshape(model, made_by(model, cols, "Reshape")?)?;
    if !sole_reader(model, cols, "MatMul") || !sole_reader(model, unfolded, "Reshape") {
        return None;
    }
    let (im2col, 0) = model.producer(unfolded)? else {
        return None;
    };
    let unfolding = model.node(im2col);
    if unfolding.proto.op_type() != IM2COL
        || normalize_domain(unfolding.proto.domain()) != DOMAIN
        || unfolding.body != BodyId::MAIN
    {
        return None;
    }
    let x = input(model, im2col, 0)?;
    // dY_t <- Transpose(Reshape(dY, [0, 1, M, -1]), [0, 1, 3, 2])
    let transpose = made_by(model, dy_t, "Transpose")?;
    if model.node(transpose).proto.attr_ints("perm").ok()?? != [0, 1, 3, 2] {
        return None;
    }
    let (dy, m) = grouped_reshape(
        model,
        made_by(model, input(model, transpose, 0)?, "Reshape")?,
    )?;
    // The Reshapes make one group only when the channels are what they say.
    let window: Vec<AttributeProto> = ["kernel_shape", "strides", "pads", "dilations"]
        .iter()
        .map(|name| {
            unfolding
                .proto
                .attribute
                .iter()
                .find(|a| a.name() == *name)
                .cloned()
        })
        .collect::<Option<_>>()?;
    let taps: i64 = unfolding
        .proto
        .attr_ints("kernel_shape")
        .ok()??
        .iter()
        .product();
    let dim = |v: ValueId, axis: usize| {
        let f = facts(v);
        (f.rank() == Some(4))
            .then(|| f.dims.as_ref()?.get(axis)?.known())
            .flatten()
    };
    let fits = dim(x, 1)?.checked_mul(taps) == Some(rows) && dim(dy, 1)? == m;
    // An image's columns: C·kh·kw rows of Ho·Wo (dY's plane, the unfolding's output).
    let columns = rows.checked_mul(dim(dy, 2)?)?.checked_mul(dim(dy, 3)?)?;
    (fits && columns >= min_columns).then_some(WeightGrad { x, dy, window })
}
