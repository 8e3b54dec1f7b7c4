//! `LayerNormalizationGrad(dY, X, scale, mean, inv_std; axis = -1) -> dX, dScale, dBias`,
//! the gradient of `Y = scale * xhat + bias`, `xhat = (X - mean) * inv_std`, normalised over
//! the axes `[axis, rank)` (`mean` and `inv_std` keep those axes with size 1):
//!
//! ```text
//! B      = dY * scale * inv_std
//! dX     = B - mean_N(B) - xhat * mean_N(B * xhat)        mean_N over the normalised axes
//! dScale = sum_L(dY * xhat)                               sum_L over the leading axes
//! dBias  = sum_L(dY)
//! ```
//!
//! `SimplifiedLayerNormalizationGrad(dY, X, scale, inv_std; axis = -1) -> dX, dScale` is the
//! same for RMS normalisation (`xhat = X * inv_std`, no mean, no bias): its dX has no
//! `mean_N(B)` term.
//!
//! Each output is computed only when it is used. The normalised axes are written negative
//! when `axis` is (no rank needed); the leading axes need the rank of X. When X, dY or the
//! statistics differ in element type (mixed precision), the math runs in the statistics'
//! type, as in ORT's kernel, and results are cast back.

use super::util::FLOAT;
use super::Lowering;
use crate::ir::emit::Emit;
use crate::ir::{NodeId, ValueId};
use crate::passes::PassError;

pub(super) fn lower(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    let mean = l.input(node, 3)?;
    let inv_std = l.input(node, 4)?;
    layer_norm_grad(l, node, Some(mean), inv_std)
}

pub(super) fn lower_simplified(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    let inv_std = l.input(node, 3)?;
    layer_norm_grad(l, node, None, inv_std)
}

/// The gradient of layer normalisation (`mean` given) or RMS normalisation (`mean` None).
fn layer_norm_grad(
    l: &mut Lowering<'_, '_>,
    node: NodeId,
    mean: Option<ValueId>,
    inv_std: ValueId,
) -> Result<(), PassError> {
    let dy = l.input(node, 0)?;
    let x = l.input(node, 1)?;
    let scale = l.input(node, 2)?;
    let axis = l.int_attr(node, "axis", -1)?;
    let (want_dx, want_dscale, want_dbias) = (
        l.used_output(node, 0),
        l.used_output(node, 1),
        l.used_output(node, 2),
    );

    let norm_axes = l.trailing_axes(node, axis, x)?;
    let lead_axes = if want_dscale.is_some() || want_dbias.is_some() {
        let rank = l.rank(x).or_else(|| l.rank(dy)).ok_or_else(|| {
            super::node_error(
                l.model(),
                node,
                "dScale and dBias reduce over X's leading axes, which needs the rank of X; the model does not declare it".into(),
            )
        })? as i64;
        let first_norm = if axis < 0 { axis + rank } else { axis };
        if let Some(r) = l.rank(scale) {
            if r as i64 != rank - first_norm {
                return Err(l.unsupported(
                    node,
                    "axis",
                    format!(
                        "{axis} with a rank-{r} scale (expected the normalised shape, rank {})",
                        rank - first_norm
                    ),
                ));
            }
        }
        (0..first_norm).collect::<Vec<_>>()
    } else {
        Vec::new()
    };

    // Compute in the statistics' type U; cast inputs of other types to it.
    let u = l.elem_type(inv_std).unwrap_or(FLOAT);
    let x_type = l.elem_type(x).unwrap_or(u);
    let v_type = l.elem_type(dy).unwrap_or(u);
    let dy_u = l.cast(dy, u, "ln_dy");
    let x_u = l.cast(x, u, "ln_x");

    let xhat = if want_dx.is_some() || want_dscale.is_some() {
        let centered = match mean {
            Some(mean) => l.op("Sub", &[x_u, mean], vec![], "ln_centered"),
            None => x_u,
        };
        Some(l.op("Mul", &[centered, inv_std], vec![], "ln_xhat"))
    } else {
        None
    };

    if let (Some(_), Some(xhat)) = (want_dx, xhat) {
        let scale_u = l.cast(scale, u, "ln_scale");
        let g = l.op("Mul", &[dy_u, scale_u], vec![], "ln_g");
        let b = l.op("Mul", &[g, inv_std], vec![], "ln_b");
        let c = l.op("Mul", &[b, xhat], vec![], "ln_c");
        let mean_c = l.reduce("ReduceMean", c, &norm_axes, true, "ln_mean_c");
        let xhat_mean_c = l.op("Mul", &[xhat, mean_c], vec![], "ln_xhat_mean_c");
        let b_centered = if mean.is_some() {
            let mean_b = l.reduce("ReduceMean", b, &norm_axes, true, "ln_mean_b");
            l.op("Sub", &[b, mean_b], vec![], "ln_b_centered")
        } else {
            b
        };
        let dx = l.op("Sub", &[b_centered, xhat_mean_c], vec![], "ln_dx");
        let dx = l.cast(dx, x_type, "ln_dx_t");
        l.replace(node, 0, dx);
    }
    if let (Some(_), Some(xhat)) = (want_dscale, xhat) {
        let dy_xhat = l.op("Mul", &[dy_u, xhat], vec![], "ln_dy_xhat");
        let dscale = sum_leading(l, dy_xhat, &lead_axes, "ln_dscale");
        let dscale = l.cast(dscale, v_type, "ln_dscale_t");
        l.replace(node, 1, dscale);
    }
    if want_dbias.is_some() {
        let dbias = sum_leading(l, dy_u, &lead_axes, "ln_dbias");
        let dbias = l.cast(dbias, v_type, "ln_dbias_t");
        l.replace(node, 2, dbias);
    }
    Ok(())
}

/// The sum over the leading axes. With none (`axis = 0`) there is nothing to sum (and an
/// empty axes list would make ReduceSum sum everything): a copy, so the output stays a value
/// of its own.
fn sum_leading(l: &mut Lowering<'_, '_>, v: ValueId, axes: &[i64], hint: &str) -> ValueId {
    if axes.is_empty() {
        l.op("Identity", &[v], vec![], hint)
    } else {
        l.reduce("ReduceSum", v, axes, false, hint)
    }
}
