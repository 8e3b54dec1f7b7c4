//! `ai.onnx.preview.training::Momentum(R, T, X1..Xn, G1..Gn, V1..Vn) ->
//! (X1_new..Xn_new, V1_new..Vn_new)`: one step of stochastic gradient descent with momentum
//! for each tensor X, with its gradient G and momentum V. With the required attributes
//! `α = alpha`, `β = beta`, `λ = norm_coefficient` and `mode`, per the spec:
//!
//! ```text
//! g     = λ X + G                         (gradient of ½ λ ‖X‖²)
//! β'    = T > 0 ? β : 1                   (the first step takes the whole gradient)
//! V_new = α V + β' g
//! mode "standard": X_new = X - R V_new
//! mode "nesterov": X_new = X - R (g + α V_new)
//! ```
//!
//! `β'` and `R` are rank-0 scalars of the tensors' type; with `β = 1` there is no select,
//! with `λ = 0` no regularization term. Any other `mode` is an error (the spec defines only
//! these two).

use super::{Lowering, PerType};
use crate::ir::NodeId;
use crate::passes::PassError;

const ATTRIBUTES: &[&str] = &["alpha", "beta", "mode", "norm_coefficient"];

pub(super) fn lower(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    l.only_attributes(node, ATTRIBUTES)?;
    let alpha = l.required_float(node, "alpha")? as f64;
    let beta = l.required_float(node, "beta")? as f64;
    let norm = l.required_float(node, "norm_coefficient")? as f64;
    let nesterov = match l.string_attr(node, "mode")?.as_deref() {
        Some("standard") => false,
        Some("nesterov") => true,
        Some(other) => {
            return Err(l.error(
                node,
                format!(
                    "attribute 'mode' is '{other}'; the op defines \"standard\" and \"nesterov\""
                ),
            ))
        }
        None => return Err(l.error(node, "required attribute 'mode' is missing".into())),
    };
    let ops = l.optimizer_operands(node, &["X", "G", "V"], &["X", "V"])?;

    let mut rates = PerType::default();
    let mut betas = PerType::default();

    for i in 0..ops.count {
        let [want_x, want_v] = [0, 1].map(|role| ops.used(role, i));
        if !(want_x || want_v) {
            continue;
        }
        let elem = l.tensor_type(node, &ops, i)?;
        let [x, g, v] = [0, 1, 2].map(|role| ops.input(role, i));
        let name = l.name(x);

        // g = λ X + G
        let g = if norm != 0.0 {
            let lambda = l.scalar("norm_coefficient", elem, norm);
            let decayed = l.op("Mul", &[x, lambda], vec![], &format!("{name}.decay"));
            l.op("Add", &[decayed, g], vec![], &format!("{name}.grad"))
        } else {
            g
        };
        // V_new = α V + β' g, β' = T > 0 ? β : 1
        let a = l.scalar("alpha", elem, alpha);
        let kept = l.op("Mul", &[a, v], vec![], &format!("{name}.V"));
        let added = if beta == 1.0 {
            g
        } else {
            let b = betas.get(l, elem, |l, elem| {
                let t = l.scalar_of(ops.t, "T_scalar");
                let later = l.after_first_step(t);
                let b = l.scalar("beta", elem, beta);
                let one = l.scalar("one", elem, 1.0);
                l.op("Where", &[later, b, one], vec![], "beta_adjusted")
            });
            l.op("Mul", &[b, g], vec![], &format!("{name}.V"))
        };
        let v_new = l.op("Add", &[kept, added], vec![], &format!("{name}.V_new"));
        if want_x {
            let r = rates.get(l, elem, |l, elem| {
                let r = l.scalar_of(ops.r, "R_scalar");
                l.cast(r, elem, "R_as_X")
            });
            let direction = if nesterov {
                // X_new = X - R (g + α V_new)
                let ahead = l.op("Mul", &[a, v_new], vec![], &format!("{name}.step"));
                l.op("Add", &[g, ahead], vec![], &format!("{name}.step"))
            } else {
                // X_new = X - R V_new
                v_new
            };
            let step = l.op("Mul", &[r, direction], vec![], &format!("{name}.step"));
            let x_new = l.op("Sub", &[x, step], vec![], &format!("{name}.X_new"));
            l.replace(node, ops.slot(0, i), x_new);
        }
        if want_v {
            l.replace(node, ops.slot(1, i), v_new);
        }
    }
    Ok(())
}
