//! Loss ops of ONNX's own vocabulary:
//!
//! ```text
//! L = SoftmaxCrossEntropyLoss(S, label, w?)   log_prob = LogSoftmax(S, axis 1)
//!   dS = (exp(log_prob) - onehot(label)) · w[label] · dL / Σ w     (mean; ignored rows 0)
//! ```
//!
//! `SoftmaxCrossEntropyLossGrad` (lowered by legalize-ort) holds the formula; the forward's
//! optional `log_prob` output is switched on so the backward reuses it.

use super::{Grad, InputGrads};
use crate::ir::{NodeId, ValueId};
use crate::passes::PassError;

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
