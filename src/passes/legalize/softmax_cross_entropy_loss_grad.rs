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
//! The one-hot is never built: `ScatterElements(p, label, GatherElements(p, label) - 1)` along
//! axis 1 subtracts it (bit for bit as `Sub(p, OneHot(label))`, 5x faster), an ignored label
//! replaced by class 0 first (its dL is 0, so any class is harmless; an index outside [0, C)
//! fails there).

use super::util::{INT32, INT64};
use super::Lowering;
use crate::ir::builder::attr_int;
use crate::ir::emit::Emit;
use crate::ir::{NodeId, ValueId};
use crate::passes::PassError;

pub(super) fn lower(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    let (dy, log_prob, label) = (l.input(node, 0)?, l.input(node, 1)?, l.input(node, 2)?);
    let weight = l.optional_input(node, 3);
    let (reduction, ignore, label_type) =
        super::softmax_cross_entropy_loss::loss_attributes(l, node, label)?;
    let t = l.float_type(node, log_prob)?;
    let ignored = ignore.map(|i| IgnoredLabels::of(l, label, label_type, i));

    // dL: the gradient reaching each sample's loss, shaped to broadcast over the classes.
    let d_loss = if weight.is_none() && ignored.is_none() {
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
        let w = sample_weights(l, label, weight, ignored, t);
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

    // d_logits = (softmax - onehot(label)) * dL. Subtracting the one-hot is subtracting 1
    // at each sample's label and 0 elsewhere (x - 0 = x exactly): gather those
    // probabilities, subtract 1, scatter them back into a copy of softmax. The same float32
    // operation on the same elements as OneHot + Sub, so the same bits, at 0.35 ms instead of
    // 1.9 for the GPT's [512, 1024] (ONNX Runtime 1.31.1's OneHot writes its output element
    // by element; benches/README.md, "Run Q").
    //
    // An ignored label may lie outside [0, C) (PyTorch pads with -100), where Gather- and
    // ScatterElements fail; its dL is 0, so any class is harmless: the safe label's class 0.
    let safe_label = ignored.map_or(label, |i| i.safe_label);
    // The class axis is 1: each sample's label index, [N, 1, d1..].
    let index = l.unsqueeze(safe_label, &[1], "sce_label_index");
    let prob = l.op("Exp", &[log_prob], vec![], "sce_prob");
    let at_label = l.op(
        "GatherElements",
        &[prob, index],
        vec![attr_int("axis", 1)],
        "sce_prob_at_label",
    );
    let one = l.scalar("one", t, 1.0);
    let at_label_minus_one = l.op("Sub", &[at_label, one], vec![], "sce_prob_at_label_m1");
    let residual = l.op(
        "ScatterElements",
        &[prob, index, at_label_minus_one],
        vec![attr_int("axis", 1)],
        "sce_residual",
    );
    let d_logits = l.op("Mul", &[residual, d_loss], vec![], "sce_dlogits");
    l.replace(node, 0, d_logits);
    Ok(())
}

/// The samples whose label is `ignore_index`, and the labels with those replaced by class 0:
/// an ignored label may lie outside [0, C), where a gather or scatter must not read it. Made
/// once per lowering; the loss and its gradient, and the weights, read the same two values.
#[derive(Clone, Copy)]
pub(super) struct IgnoredLabels {
    pub mask: ValueId,
    pub safe_label: ValueId,
}

impl IgnoredLabels {
    pub fn of(l: &mut Lowering<'_, '_>, label: ValueId, label_type: i32, ignore: i64) -> Self {
        let ignore = int_scalar(l, "ignore_index", label_type, ignore);
        let mask = l.op("Equal", &[label, ignore], vec![], "sce_ignored");
        let class_zero = int_scalar(l, "label_zero", label_type, 0);
        let safe_label = l.op(
            "Where",
            &[mask, class_zero, label],
            vec![],
            "sce_safe_label",
        );
        IgnoredLabels { mask, safe_label }
    }
}

/// w: each sample's class weight (1 without weights), 0 where its label is ignored.
pub(super) fn sample_weights(
    l: &mut Lowering<'_, '_>,
    label: ValueId,
    weight: Option<ValueId>,
    ignored: Option<IgnoredLabels>,
    t: i32,
) -> ValueId {
    let zero = l.scalar("zero", t, 0.0);
    match (weight, ignored) {
        (None, Some(ignored)) => {
            let one = l.scalar("one", t, 1.0);
            l.op("Where", &[ignored.mask, zero, one], vec![], "sce_w")
        }
        (Some(weight), None) => l.op("Gather", &[weight, label], vec![], "sce_w"),
        (Some(weight), Some(ignored)) => {
            let class_w = l.op(
                "Gather",
                &[weight, ignored.safe_label],
                vec![],
                "sce_class_w",
            );
            l.op("Where", &[ignored.mask, zero, class_w], vec![], "sce_w")
        }
        (None, None) => unreachable!("the unweighted, unignored case needs no per-sample weights"),
    }
}

/// A scalar of integer type `elem` (int64 or int32).
pub(super) fn int_scalar(l: &mut Lowering<'_, '_>, hint: &str, elem: i32, value: i64) -> ValueId {
    let elem = if elem == INT32 { INT32 } else { INT64 };
    l.constant(hint, crate::ir::emit::scalar_tensor(elem, value as f64))
}
