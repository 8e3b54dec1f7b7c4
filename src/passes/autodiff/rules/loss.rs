//! Loss ops of ONNX's own vocabulary:
//!
//! ```text
//! L = SoftmaxCrossEntropyLoss(S, label, w?)   log_prob = LogSoftmax(S, axis 1)
//!   dS = (exp(log_prob) - onehot(label)) · w[label] · dL / Σ w     (mean; ignored rows 0)
//! ```
//!
//! `SoftmaxCrossEntropyLossGrad` (lowered by legalize-ort) holds the formula; the forward's
//! optional `log_prob` output is switched on so the backward reuses it.
//!
//! ```text
//! L = NegativeLogLikelihoodLoss(X, label, w?)   X: log-probabilities [N, C, d..]
//!   v[n, d..]  = ignored ? 0 : (w ? w[label] : 1)          ignored: label == ignore_index
//!   dℓ[n, d..] = mean: v · dL / Σ v    sum: v · dL    none: v · dL[n, d..]
//!   dX         = -onehot(label, axis 1) · dℓ       (a scatter of -dℓ into zeros)
//! ```
//!
//! A mean over nothing (every label ignored, or weights summing to 0) is NaN forward, as
//! ONNX defines it; its gradient is 0 (PyTorch's `nll_loss` backward skips ignored targets,
//! and every v is 0), never NaN.

use super::{Grad, InputGrads};
use crate::ir::builder::{attr_int, NodeAttributes};
use crate::ir::emit::Emit;
use crate::ir::{NodeId, ValueId};
use crate::passes::PassError;
use crate::proto::elem::{INT32, INT64};

pub fn softmax_cross_entropy(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let Some(dy) = dys.first().copied().flatten() else {
        return Err(cx.error(
            node,
            "the gradient through the log_prob output is not supported".into(),
        ));
    };
    if dys.get(1).copied().flatten().is_some() {
        return Err(cx.error(
            node,
            "the gradient through the log_prob output is not supported".into(),
        ));
    }
    if wants.iter().skip(1).any(|w| *w) {
        return Err(cx.error(
            node,
            "the gradient with respect to the class weights is not supported".into(),
        ));
    }
    let scores = cx.input(node, 0)?;
    let labels = cx.input(node, 1)?;
    let weights = cx.opt_input(node, 2);
    let loss = cx.model().name(cx.forward_output(node, 0)?).to_string();
    let log_prob =
        cx.b.model
            .ensure_node_output(node, 1, &format!("{loss}_log_prob"));
    // log_prob has the scores' shape and element type; without the fact, the lowering of
    // the gradient op cannot tell its float type (a float64 model got float32 constants).
    let f = cx.facts(scores);
    cx.shapes.set(log_prob, f);
    let attrs = cx.attrs_of(node, &["reduction", "ignore_index"]);
    let h = format!("{}_grad", cx.model().name(scores));
    let g = cx.ort_op(
        "SoftmaxCrossEntropyLossGrad",
        &[Some(dy), Some(log_prob), Some(labels), weights],
        &[&h],
        attrs,
    );
    let v = cx.output_like(g, 0, scores);
    let mut out = vec![None; wants.len()];
    out[0] = Some(v);
    Ok(out)
}

pub fn negative_log_likelihood(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    if wants.iter().skip(1).any(|w| *w) {
        return Err(cx.error(
            node,
            "the gradient with respect to the class weights is not supported".into(),
        ));
    }
    let dy = cx.dy(node, dys, 0)?;
    let x = cx.input(node, 0)?;
    let label = cx.input(node, 1)?;
    let weight = cx.opt_input(node, 2);
    let t = cx.elem(node, x)?;
    let label_type = cx.elem(node, label)?;
    let reduction = cx
        .string_attr(node, "reduction")?
        .unwrap_or_else(|| "mean".into());
    if !matches!(reduction.as_str(), "mean" | "sum" | "none") {
        return Err(cx.error(
            node,
            format!("reduction '{reduction}' is not one of mean, sum, none"),
        ));
    }
    let ignore_index = cx.model().node(node).proto.attr_int("ignore_index");
    let ignore_index = ignore_index.map_err(|m| cx.error(node, m))?;
    let h = format!("{}_grad", cx.model().name(x));

    // Each sample's weight v (None: every v is 1) and a label safe to scatter at: an ignored
    // label may lie outside [0, C) (PyTorch pads with -100); its v is 0, so class 0 is
    // harmless.
    let zero = cx.scalar(t, 0.0);
    let one = cx.scalar(t, 1.0);
    let (ignored, safe_label) = match ignore_index {
        Some(i) => {
            let ignore = int_scalar(cx, label_type, i);
            let class_zero = int_scalar(cx, label_type, 0);
            let ignored = cx.equal(label, ignore, &format!("{h}_ignored"));
            let safe = cx.select(ignored, class_zero, label, &format!("{h}_safe_label"));
            (Some(ignored), safe)
        }
        None => (None, label),
    };
    let class_weight =
        weight.map(|w| cx.op("Gather", &[w, safe_label], vec![], &format!("{h}_class_w")));
    let v = match (ignored, class_weight) {
        (None, None) => None,
        (None, Some(cw)) => Some(cw),
        (Some(ig), None) => Some(cx.select(ig, zero, one, &format!("{h}_v"))),
        (Some(ig), Some(cw)) => Some(cx.select(ig, zero, cw, &format!("{h}_v"))),
    };

    // dℓ: the gradient reaching each sample's term.
    let d_term = match reduction.as_str() {
        "mean" => {
            let denom = match v {
                None => {
                    let count = cx.op("Size", &[label], vec![], &format!("{h}_count"));
                    cx.cast_to(count, t, &format!("{h}_count_f"))
                }
                Some(v) => {
                    let total = cx.reduce("ReduceSum", v, &[], false, &format!("{h}_v_sum"));
                    let empty = cx.equal(total, zero, &format!("{h}_v_sum_zero"));
                    cx.select(empty, one, total, &format!("{h}_denom"))
                }
            };
            let dy_mean = cx.div(dy, denom, &format!("{h}_dy_mean"));
            match v {
                None => dy_mean,
                Some(v) => cx.mul(v, dy_mean, &format!("{h}_dterm")),
            }
        }
        _ => match v {
            None => dy,
            Some(v) => cx.mul(v, dy, &format!("{h}_dterm")),
        },
    };
    // -dℓ at each sample's label, shaped like the labels (a scalar dℓ spread over them).
    let neg = cx.neg(d_term, &format!("{h}_neg_dterm"));
    let label_shape = cx.shape_of(label);
    let neg = cx.op(
        "Expand",
        &[neg, label_shape],
        vec![],
        &format!("{h}_at_label"),
    );
    let index = cx.unsqueeze(safe_label, &[1], &format!("{h}_label_index"));
    let values = cx.unsqueeze(neg, &[1], &format!("{h}_label_values"));
    let zeros = cx.zeros_like(node, x, &format!("{h}_zeros"))?;
    let dx = cx.op_like(
        "ScatterElements",
        &[zeros, index, values],
        vec![attr_int("axis", 1)],
        &h,
        x,
    );
    let mut out = vec![None; wants.len()];
    out[0] = Some(dx);
    Ok(out)
}

/// A scalar of the labels' integer type (int64 or int32).
fn int_scalar(cx: &mut Grad<'_>, elem: i32, value: i64) -> ValueId {
    let elem = if elem == INT32 { INT32 } else { INT64 };
    let hint = format!("label_{}", value.to_string().replace('-', "m"));
    cx.constant(&hint, crate::ir::emit::scalar_tensor(elem, value as f64))
}
