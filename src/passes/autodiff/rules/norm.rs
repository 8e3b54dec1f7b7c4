//! Normalisations, differentiated with the statistics their forward saved.
//!
//! ```text
//! LayerNormalization   Y = scale · x̂ + B,  x̂ = (X - mean) · inv_std over the axes [axis, rank)
//!   B' = dY · scale · inv_std
//!   dX = B' - mean_N(B') - x̂ · mean_N(B' · x̂);   dScale = Σ_L dY · x̂;   dB = Σ_L dY
//! BatchNorm (training)  the same per channel over all axes but 1:
//!   dX = k (dY - Σ dY / n - x̂ · Σ(dY · x̂) / n),  k = scale · inv_std
//! ```
//!
//! The forward's optional statistics outputs (LayerNormalization's `Mean`, `InvStdDev`;
//! BatchNormInternal's saved mean and inverse deviation) are switched on so the backward
//! reuses them instead of recomputing; `LayerNormalizationGrad` and
//! `BatchNormalizationGrad` (lowered by legalize-ort) hold the formulas above.
//! A forward BatchNormalization reaches this rule as BatchNormInternal: the normalisation
//! step of the autodiff turns every BatchNorm into its training form first.

use super::{Grad, InputGrads};
use crate::ir::{NodeId, ValueId};
use crate::passes::PassError;

fn grads_out(
    cx: &mut Grad<'_>,
    node: NodeId,
    g: NodeId,
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let mut out = vec![None; wants.len()];
    for slot in 0..3.min(wants.len()) {
        if wants[slot] {
            let v = cx.output(g, slot);
            let like = cx.input(node, slot)?;
            let f = cx.facts(like);
            cx.shapes.set(v, f);
            out[slot] = Some(v);
        }
    }
    if wants.iter().skip(3).any(|w| *w) {
        return Err(cx.error(
            node,
            "the gradient with respect to running statistics is not defined".into(),
        ));
    }
    Ok(out)
}

fn hints(cx: &Grad<'_>, node: NodeId) -> Vec<String> {
    (0..3)
        .map(|i| match cx.opt_input(node, i) {
            Some(v) => format!("{}_grad", cx.model().name(v)),
            None => "norm_bias_grad".into(),
        })
        .collect()
}

pub fn layer_norm(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let dy = dys[0].expect("a gradient for the output");
    if dys.iter().skip(1).any(Option::is_some) {
        return Err(cx.error(
            node,
            "the gradient through LayerNormalization's Mean or InvStdDev output is not supported"
                .into(),
        ));
    }
    let (x, scale) = (cx.input(node, 0)?, cx.input(node, 1)?);
    let y = cx.model().name(cx.output(node, 0)).to_string();
    let mean = cx.b.model.ensure_node_output(node, 1, &format!("{y}_mean"));
    let inv_std =
        cx.b.model
            .ensure_node_output(node, 2, &format!("{y}_inv_std"));
    let attrs = cx.attrs_of(node, &["axis"]);
    let h = hints(cx, node);
    let h: Vec<&str> = h.iter().map(String::as_str).collect();
    let g = cx.ort_op(
        "LayerNormalizationGrad",
        &[Some(dy), Some(x), Some(scale), Some(mean), Some(inv_std)],
        &h,
        attrs,
    );
    grads_out(cx, node, g, wants)
}

pub fn batch_norm_internal(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let dy = dys[0].expect("a gradient for the output");
    if dys.iter().skip(1).any(Option::is_some) {
        return Err(cx.error(
            node,
            "the gradient through BatchNorm's statistics outputs is not supported".into(),
        ));
    }
    let (x, scale) = (cx.input(node, 0)?, cx.input(node, 1)?);
    let y = cx.model().name(cx.output(node, 0)).to_string();
    let saved_mean =
        cx.b.model
            .ensure_node_output(node, 3, &format!("{y}_saved_mean"));
    let saved_inv_std =
        cx.b.model
            .ensure_node_output(node, 4, &format!("{y}_saved_inv_std"));
    let h = hints(cx, node);
    let h: Vec<&str> = h.iter().map(String::as_str).collect();
    let g = cx.ort_op(
        "BatchNormalizationGrad",
        &[
            Some(dy),
            Some(x),
            Some(scale),
            Some(saved_mean),
            Some(saved_inv_std),
        ],
        &h,
        vec![],
    );
    grads_out(cx, node, g, wants)
}
