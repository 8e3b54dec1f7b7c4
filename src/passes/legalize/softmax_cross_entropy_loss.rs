//! The forward losses `SoftmaxCrossEntropyLoss(scores, labels, weights?; reduction = "mean",
//! ignore_index?) -> loss, log_prob?` and `NegativeLogLikelihoodLoss(log_prob, labels,
//! weights?; reduction = "mean", ignore_index?) -> loss` (lowered only with
//! `legalize-ort(sce=true)` / `(nll=true)`: standard ONNX ops that ONNX Runtime has but tract
//! does not), scores [N, C, d1..], labels [N, d1..]:
//!
//! ```text
//! log_prob    = LogSoftmax(scores, axis 1)                  (SoftmaxCrossEntropyLoss only)
//! w[n, d..]   = ignored ? 0 : (weights ? weights[label] : 1)    ignored: label == ignore_index
//! l[n, d..]   = -log_prob[n, label[n, d..], d..] * w[n, d..]
//! loss        = none: l    sum: sum(l)    mean: sum(l) / sum(w)  (mean(l) when every w is 1)
//! ```
//!
//! This is the ONNX definition, also where it is 0 / 0: a mean over nothing (every label
//! ignored, or weights summing to 0) is NaN, as in ONNX's reference and ONNX Runtime's
//! kernel (measured; the gradient's kernel, and so its lowering, gives 0 there instead).
//! An ignored label may lie outside [0, C): it is replaced by class 0 before the gather,
//! and its term is zeroed by w.

use super::softmax_cross_entropy_loss_grad::{sample_weights, IgnoredLabels};
use super::util::{INT32, INT64};
use super::Lowering;
use crate::ir::builder::{attr_int, attr_ints};
use crate::ir::emit::Emit;
use crate::ir::{NodeId, ValueId};
use crate::passes::PassError;

/// `SoftmaxCrossEntropyLoss`: `LogSoftmax` over the classes, then the NLL below.
pub(super) fn lower(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    let scores = l.input(node, 0)?;
    let log_prob = log_softmax_axis1(l, node, scores)?;
    nll(l, node, log_prob)?;
    l.replace(node, 1, log_prob);
    Ok(())
}

/// `NegativeLogLikelihoodLoss`: input 0 already holds log-probabilities.
pub(super) fn lower_nll(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    let log_prob = l.input(node, 0)?;
    nll(l, node, log_prob)
}

/// `LogSoftmax` along axis 1. From opset 13 the op normalises one axis; before, it flattens
/// the input to 2-D at `axis`, which is axis 1 alone only for rank 2: other ranks move the
/// classes last first.
fn log_softmax_axis1(
    l: &mut Lowering<'_, '_>,
    node: NodeId,
    scores: ValueId,
) -> Result<ValueId, PassError> {
    let rank = l.rank(scores);
    if l.onnx_opset() >= 13 || rank == Some(2) {
        return Ok(l.op(
            "LogSoftmax",
            &[scores],
            vec![attr_int("axis", 1)],
            "sce_log_prob",
        ));
    }
    let Some(rank) = rank else {
        return Err(super::node_error(
            l.model(),
            node,
            format!(
                "the rank of '{}' is not declared (needed below opset 13)",
                l.model().name(scores)
            ),
        ));
    };
    let rank = rank as i64;
    // [N, C, d1..] -> [N, d1.., C], LogSoftmax over the last axis, and back.
    let to_last: Vec<i64> = std::iter::once(0)
        .chain(2..rank)
        .chain(std::iter::once(1))
        .collect();
    let back: Vec<i64> = std::iter::once(0)
        .chain(std::iter::once(rank - 1))
        .chain(1..rank - 1)
        .collect();
    let moved = l.op(
        "Transpose",
        &[scores],
        vec![attr_ints("perm", &to_last)],
        "sce_classes_last",
    );
    let lp = l.op(
        "LogSoftmax",
        &[moved],
        vec![attr_int("axis", rank - 1)],
        "sce_log_prob_last",
    );
    Ok(l.op(
        "Transpose",
        &[lp],
        vec![attr_ints("perm", &back)],
        "sce_log_prob",
    ))
}

/// What the loss ops and `SoftmaxCrossEntropyLossGrad` read alike: `reduction` (mean, sum
/// or none), `ignore_index` when the attribute is set, and the label's type (int64 or int32,
/// else an error).
pub(super) fn loss_attributes(
    l: &mut Lowering<'_, '_>,
    node: NodeId,
    label: ValueId,
) -> Result<(String, Option<i64>, i32), PassError> {
    let reduction = l
        .string_attr(node, "reduction")?
        .unwrap_or_else(|| "mean".into());
    if !matches!(reduction.as_str(), "mean" | "sum" | "none") {
        return Err(l.unsupported(node, "reduction", format!("\"{reduction}\"")));
    }
    let has_ignore = l
        .model()
        .node(node)
        .proto
        .attribute
        .iter()
        .any(|a| a.name() == "ignore_index");
    let ignore_index = has_ignore
        .then(|| l.int_attr(node, "ignore_index", -1))
        .transpose()?;
    let label_type = l.elem_type(label).unwrap_or(INT64);
    if label_type != INT64 && label_type != INT32 {
        return Err(super::node_error(
            l.model(),
            node,
            "label must be int64 or int32".into(),
        ));
    }
    Ok((reduction, ignore_index, label_type))
}

/// Output 0 of `node` (either loss op): the weighted negative log-likelihood of `log_prob`.
fn nll(l: &mut Lowering<'_, '_>, node: NodeId, log_prob: ValueId) -> Result<(), PassError> {
    let label = l.input(node, 1)?;
    let weight = l.optional_input(node, 2);
    let (reduction, ignore_index, label_type) = loss_attributes(l, node, label)?;
    let t = l.float_type(node, log_prob)?;

    // The label to gather at: an ignored one may be out of range, so it reads class 0.
    let ignored = ignore_index.map(|i| IgnoredLabels::of(l, label, label_type, i));
    let gather_label = ignored.map_or(label, |i| i.safe_label);
    let index = l.cast(gather_label, INT64, "sce_label_i64");
    let index = l.unsqueeze(index, &[1], "sce_label_n1");
    let picked = l.op(
        "GatherElements",
        &[log_prob, index],
        vec![attr_int("axis", 1)],
        "sce_picked",
    );
    let picked = if crate::ir::emit::axes_as_input("Squeeze", l.onnx_opset()) {
        let axes = l.int64s("axes_1", &[1]);
        l.op("Squeeze", &[picked, axes], vec![], "sce_picked_n")
    } else {
        l.op(
            "Squeeze",
            &[picked],
            vec![attr_ints("axes", &[1])],
            "sce_picked_n",
        )
    };
    let neg = l.op("Neg", &[picked], vec![], "sce_nll");

    let keep0 = || vec![attr_int("keepdims", 0)];
    let loss = if weight.is_none() && ignore_index.is_none() {
        match reduction.as_str() {
            "mean" => l.op("ReduceMean", &[neg], keep0(), "sce_loss"),
            "sum" => l.op("ReduceSum", &[neg], keep0(), "sce_loss"),
            _ => neg,
        }
    } else {
        let w = sample_weights(l, label, weight, ignored, t);
        let weighted = l.op("Mul", &[neg, w], vec![], "sce_weighted");
        match reduction.as_str() {
            "mean" => {
                let total = l.op("ReduceSum", &[weighted], keep0(), "sce_loss_sum");
                let w_sum = l.op("ReduceSum", &[w], keep0(), "sce_w_sum");
                l.op("Div", &[total, w_sum], vec![], "sce_loss")
            }
            "sum" => l.op("ReduceSum", &[weighted], keep0(), "sce_loss"),
            _ => weighted,
        }
    };
    l.replace(node, 0, loss);
    Ok(())
}
