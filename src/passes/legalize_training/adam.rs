//! `ai.onnx.preview.training::Adam(R, T, X1..Xn, G1..Gn, V1..Vn, H1..Hn) ->
//! (X1_new..Xn_new, V1_new..Vn_new, H1_new..Hn_new)`: one Adam step for each tensor X,
//! with its gradient G, its averaged gradient V and averaged squared gradient H. With
//! `α = alpha` (0.9), `β = beta` (0.999), `ε = epsilon` (1e-6), `λ = norm_coefficient` (0)
//! and `λ' = norm_coefficient_post` (0), per the spec:
//!
//! ```text
//! g     = λ X + G                         (gradient of ½ λ ‖X‖²)
//! V_new = α V + (1-α) g
//! H_new = β H + (1-β) (g g)
//! r     = T > 0 ? R √(1-β^T) / (1-α^T) : R
//! X_new = (1-λ') (X - r (V_new / (√H_new + ε)))
//! ```
//!
//! `r` is one scalar per node, computed in double and rounded once to the tensors' type;
//! at `T = 0` its bias-corrected branch is 0/0, which the select discards. Terms with
//! `λ = 0` or `λ' = 0` are not emitted.

use super::{Lowering, PerType, DOUBLE};
use crate::ir::{NodeId, ValueId};
use crate::passes::PassError;

const ATTRIBUTES: &[&str] = &[
    "alpha",
    "beta",
    "epsilon",
    "norm_coefficient",
    "norm_coefficient_post",
];

pub(super) fn lower(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    l.only_attributes(node, ATTRIBUTES)?;
    let alpha = l.float_attr(node, "alpha")?.unwrap_or(0.9) as f64;
    let beta = l.float_attr(node, "beta")?.unwrap_or(0.999) as f64;
    let epsilon = l.float_attr(node, "epsilon")?.unwrap_or(1e-6) as f64;
    let norm = l.float_attr(node, "norm_coefficient")?.unwrap_or(0.0) as f64;
    let norm_post = l.float_attr(node, "norm_coefficient_post")?.unwrap_or(0.0) as f64;
    let ops = l.optimizer_operands(node, &["X", "G", "V", "H"], &["X", "V", "H"])?;

    // r in double: R √(1-β^T) / (1-α^T) after the first step, else R.
    let mut rate_double: Option<ValueId> = None;
    let mut rate = PerType::default();

    for i in 0..ops.count {
        let [want_x, want_v, want_h] = [0, 1, 2].map(|role| ops.used(role, i));
        if !(want_x || want_v || want_h) {
            continue;
        }
        let elem = l.tensor_type(node, &ops, i)?;
        let [x, g, v, h] = [0, 1, 2, 3].map(|role| ops.input(role, i));
        let name = l.name(x);

        // g = λ X + G
        let g = if norm != 0.0 {
            let lambda = l.scalar("norm_coefficient", elem, norm);
            let decay = l.op("Mul", &[x, lambda], vec![], &format!("{name}.decay"));
            l.op("Add", &[decay, g], vec![], &format!("{name}.grad"))
        } else {
            g
        };
        // V_new = α V + (1-α) g
        let v_new = (want_x || want_v).then(|| {
            let a = l.scalar("alpha", elem, alpha);
            let one_minus_a = l.scalar("one_minus_alpha", elem, 1.0 - alpha);
            let kept = l.op("Mul", &[v, a], vec![], &format!("{name}.V"));
            let added = l.op("Mul", &[g, one_minus_a], vec![], &format!("{name}.V"));
            l.op("Add", &[kept, added], vec![], &format!("{name}.V_new"))
        });
        // H_new = β H + (1-β) (g g)
        let h_new = (want_x || want_h).then(|| {
            let b = l.scalar("beta", elem, beta);
            let one_minus_b = l.scalar("one_minus_beta", elem, 1.0 - beta);
            let kept = l.op("Mul", &[h, b], vec![], &format!("{name}.H"));
            let square = l.op("Mul", &[g, g], vec![], &format!("{name}.H"));
            let added = l.op("Mul", &[square, one_minus_b], vec![], &format!("{name}.H"));
            l.op("Add", &[kept, added], vec![], &format!("{name}.H_new"))
        });
        if let (true, Some(v_new), Some(h_new)) = (want_x, v_new, h_new) {
            // X_new = (1-λ') (X - r (V_new / (√H_new + ε)))
            let r = rate.get(l, elem, |l, elem| {
                let r =
                    *rate_double.get_or_insert_with(|| learning_rate(l, ops.r, ops.t, alpha, beta));
                l.convert(r, DOUBLE, elem, "R_adjusted")
            });
            let eps = l.scalar("epsilon", elem, epsilon);
            let root = l.op("Sqrt", &[h_new], vec![], &format!("{name}.H_sqrt"));
            let denom = l.op("Add", &[root, eps], vec![], &format!("{name}.H_sqrt"));
            let direction = l.op("Div", &[v_new, denom], vec![], &format!("{name}.step"));
            let step = l.op("Mul", &[r, direction], vec![], &format!("{name}.step"));
            let mut x_new = l.op("Sub", &[x, step], vec![], &format!("{name}.X_new"));
            if norm_post != 0.0 {
                let keep = l.scalar("one_minus_norm_coefficient_post", elem, 1.0 - norm_post);
                x_new = l.op("Mul", &[keep, x_new], vec![], &format!("{name}.X_final"));
            }
            l.replace(node, ops.slot(0, i), x_new);
        }
        if let (true, Some(v_new)) = (want_v, v_new) {
            l.replace(node, ops.slot(1, i), v_new);
        }
        if let (true, Some(h_new)) = (want_h, h_new) {
            l.replace(node, ops.slot(2, i), h_new);
        }
    }
    Ok(())
}

/// `T > 0 ? R √(1-β^T) / (1-α^T) : R`, in double.
fn learning_rate(
    l: &mut Lowering<'_, '_>,
    r: ValueId,
    t: ValueId,
    alpha: f64,
    beta: f64,
) -> ValueId {
    let r = l.scalar_of(r, "R_scalar");
    let t = l.scalar_of(t, "T_scalar");
    let r = l.cast(r, DOUBLE, "R_double");
    let t_double = l.cast(t, DOUBLE, "T_double");
    let one = l.scalar("one", DOUBLE, 1.0);
    let a = l.scalar("alpha", DOUBLE, alpha);
    let b = l.scalar("beta", DOUBLE, beta);
    let a_t = l.op("Pow", &[a, t_double], vec![], "alpha_pow_T");
    let b_t = l.op("Pow", &[b, t_double], vec![], "beta_pow_T");
    let a_correction = l.op("Sub", &[one, a_t], vec![], "one_minus_alpha_pow_T");
    let b_correction = l.op("Sub", &[one, b_t], vec![], "one_minus_beta_pow_T");
    let root = l.op("Sqrt", &[b_correction], vec![], "sqrt_one_minus_beta_pow_T");
    let scaled = l.op("Mul", &[r, root], vec![], "R_bias_corrected");
    let corrected = l.op("Div", &[scaled, a_correction], vec![], "R_bias_corrected");
    let later = l.after_first_step(t);
    l.op("Where", &[later, corrected, r], vec![], "R_adjusted")
}
