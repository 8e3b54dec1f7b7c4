//! `SoftmaxCrossEntropyLossGrad(dY, log_prob, label, weight?; reduction = "mean",
//! ignore_index?) -> d_logits`, the gradient of `SoftmaxCrossEntropyLoss` with respect to
//! its logits, given the log-probabilities `log_prob` [N, C, d1..] its forward computed:
//!
//! ```text
//! w[n, d..]   = ignored ? 0 : (weight ? weight[label] : 1)      ignored: label == ignore_index
//! dL[n, d..]  = mean: w * (dY / sum(w))    sum: w * dY    none: w * dY[n, d..]
//! d_logits    = (exp(log_prob) - onehot(label, axis 1)) * dL[n, 1, d..]
//! ```
//!
//! As ORT's kernel does, a mean over nothing (every label ignored, or weights summing to 0)
//! leaves dY undivided, so its rows come out 0, never NaN.
//!
//! Without weights and `ignore_index`, every w is 1 and dL a scalar (`dY / N*d1*..` for the
//! mean): no per-sample tensor is built, 4 to 7 nodes in all. One deliberate difference: the
//! training build's kernel ignores label -1 even without the attribute (its default,
//! measured), but the ONNX op defines labels only in [0, C) then, and the forward loss that
//! a standard runtime computes in the same graph (ONNX's function body) takes -1 as class
//! C-1. The lowering follows the ONNX definition, so loss and gradient stay consistent.
//!
//! The one-hot is `OneHot(label, C, [0, 1], axis = 1)`, an ignored label replaced by class 0
//! first (its dL is 0, so any class is harmless; an index outside [0, C) makes tract panic).

use super::util::{dims, INT32, INT64};
use super::Lowering;
use crate::ir::builder::{attr_int, tensor_i64};
use crate::ir::emit::Emit;
use crate::ir::{NodeId, ValueId};
use crate::passes::PassError;
use crate::proto::TensorProto;

pub(super) fn lower(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    let (dy, log_prob, label) = (l.input(node, 0)?, l.input(node, 1)?, l.input(node, 2)?);
    let weight = l.optional_input(node, 3);
    let (reduction, ignore, label_type) =
        super::softmax_cross_entropy_loss::loss_attributes(l, node, label)?;
    let (has_ignore, ignore_index) = (ignore.is_some(), ignore.unwrap_or(-1));
    let t = l.float_type(node, log_prob)?;

    // dL: the gradient reaching each sample's loss, shaped to broadcast over the classes.
    let d_loss = if weight.is_none() && !has_ignore {
        // Every w is 1: a scalar for mean and sum.
        match reduction.as_str() {
            "mean" => {
                let count = l.op("Size", &[label], vec![], "sce_count");
                let count = l.cast(count, t, "sce_count_f");
                l.op("Div", &[dy, count], vec![], "sce_dy_mean")
            }
            "sum" => dy,
            _ => l.unsqueeze(dy, &[1], "sce_dloss_n1"),
        }
    } else {
        let w = sample_weights(
            l,
            label,
            label_type,
            weight,
            has_ignore.then_some(ignore_index),
            t,
        );
        let d_loss = match reduction.as_str() {
            "mean" => {
                let total = l.op(
                    "ReduceSum",
                    &[w],
                    vec![attr_int("keepdims", 0)],
                    "sce_w_sum",
                );
                let one = l.scalar("one", t, 1.0);
                let denom = if weight.is_none() {
                    // A count of 0/1 weights: max(count, 1) changes only the all-ignored
                    // case, where every w is 0 anyway.
                    l.op("Max", &[total, one], vec![], "sce_count")
                } else {
                    let zero = l.scalar("zero", t, 0.0);
                    let is_zero = l.op("Equal", &[total, zero], vec![], "sce_w_sum_zero");
                    l.op("Where", &[is_zero, one, total], vec![], "sce_denom")
                };
                let dy_mean = l.op("Div", &[dy, denom], vec![], "sce_dy_mean");
                l.op("Mul", &[w, dy_mean], vec![], "sce_dloss")
            }
            _ => l.op("Mul", &[w, dy], vec![], "sce_dloss"),
        };
        l.unsqueeze(d_loss, &[1], "sce_dloss_n1")
    };

    // d_logits = (softmax - onehot(label)) * dL
    let depth = match dims(l.model(), log_prob).and_then(|d| d.get(1).copied().flatten()) {
        Some(c) => l.int64s("num_classes", &[c]),
        None if l.onnx_opset() >= 15 => l.op(
            "Shape",
            &[log_prob],
            vec![attr_int("start", 1), attr_int("end", 2)],
            "sce_num_classes",
        ),
        None => {
            let shape = l.op("Shape", &[log_prob], vec![], "sce_shape");
            let (one_i, two_i) = (l.int64s("one_i64", &[1]), l.int64s("two_i64", &[2]));
            l.op("Slice", &[shape, one_i, two_i], vec![], "sce_num_classes")
        }
    };
    let off_on = {
        let mut raw = super::util::float_bytes(t, 0.0).unwrap_or_default();
        raw.extend(super::util::float_bytes(t, 1.0).unwrap_or_default());
        l.constant(
            "off_on",
            TensorProto {
                dims: vec![2],
                data_type: Some(t),
                raw_data: Some(raw),
                ..Default::default()
            },
        )
    };
    // An ignored label may lie outside [0, C) (PyTorch pads with -100): ORT's OneHot gives
    // it a row of zeros, but tract indexes out of bounds and panics. Its dL is 0, so the
    // one-hot of class 0 is as good: take that.
    let one_hot_label = if has_ignore {
        let ignore = int_scalar(l, "ignore_index", label_type, ignore_index);
        let ignored = l.op("Equal", &[label, ignore], vec![], "sce_onehot_ignored");
        let label_zero = int_scalar(l, "label_zero", label_type, 0);
        l.op(
            "Where",
            &[ignored, label_zero, label],
            vec![],
            "sce_onehot_label",
        )
    } else {
        label
    };
    // ORT's OneHot kernels take int32 indices only with an int32 depth: index in int64.
    let label_i64 = l.cast(one_hot_label, INT64, "sce_label_i64");
    let onehot = l.op(
        "OneHot",
        &[label_i64, depth, off_on],
        vec![attr_int("axis", 1)],
        "sce_onehot",
    );
    let prob = l.op("Exp", &[log_prob], vec![], "sce_prob");
    let residual = l.op("Sub", &[prob, onehot], vec![], "sce_residual");
    let d_logits = l.op("Mul", &[residual, d_loss], vec![], "sce_dlogits");
    l.replace(node, 0, d_logits);
    Ok(())
}

/// w: each sample's class weight (1 without weights), 0 where its label is ignored.
pub(super) fn sample_weights(
    l: &mut Lowering<'_, '_>,
    label: ValueId,
    label_type: i32,
    weight: Option<ValueId>,
    ignore_index: Option<i64>,
    t: i32,
) -> ValueId {
    let ignored = ignore_index.map(|i| {
        let ignore = int_scalar(l, "ignore_index", label_type, i);
        l.op("Equal", &[label, ignore], vec![], "sce_ignored")
    });
    let zero = l.scalar("zero", t, 0.0);
    match (weight, ignored) {
        (None, Some(ignored)) => {
            let one = l.scalar("one", t, 1.0);
            l.op("Where", &[ignored, zero, one], vec![], "sce_w")
        }
        (Some(weight), None) => l.op("Gather", &[weight, label], vec![], "sce_w"),
        (Some(weight), Some(ignored)) => {
            // Gather must not see an out-of-range ignored label: look up class 0 instead.
            let label_zero = int_scalar(l, "label_zero", label_type, 0);
            let safe = l.op(
                "Where",
                &[ignored, label_zero, label],
                vec![],
                "sce_safe_label",
            );
            let class_w = l.op("Gather", &[weight, safe], vec![], "sce_class_w");
            l.op("Where", &[ignored, zero, class_w], vec![], "sce_w")
        }
        (None, None) => unreachable!("the unweighted, unignored case needs no per-sample weights"),
    }
}

/// A scalar of integer type `elem` (int64 or int32).
pub(super) fn int_scalar(l: &mut Lowering<'_, '_>, hint: &str, elem: i32, value: i64) -> ValueId {
    let tensor = if elem == INT32 {
        TensorProto {
            data_type: Some(INT32),
            raw_data: Some((value as i32).to_le_bytes().to_vec()),
            ..Default::default()
        }
    } else {
        tensor_i64(&[], &[value])
    };
    l.constant(hint, tensor)
}
