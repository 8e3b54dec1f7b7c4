//! `ai.onnx.preview.training::Adagrad(R, T, X1..Xn, G1..Gn, H1..Hn) ->
//! (X1_new..Xn_new, H1_new..Hn_new)`: one ADAGRAD step for each tensor X, with its
//! gradient G and accumulated squared gradient H. With `d = decay_factor` (0),
//! `ε = epsilon` (1e-6) and `λ = norm_coefficient` (0), per the spec:
//!
//! ```text
//! r     = R / (1 + T d)
//! g     = λ X + G                         (gradient of ½ λ ‖X‖²)
//! H_new = H + g g
//! X_new = X - (r g) / (√H_new + ε)
//! ```
//!
//! `r` is one scalar per node, computed in double and rounded once to the tensors' type;
//! with `d = 0` it is `R` itself, and with `λ = 0` no regularization term is emitted.

use super::{Lowering, PerType, DOUBLE};
use crate::ir::{NodeId, ValueId};
use crate::passes::PassError;

const ATTRIBUTES: &[&str] = &["decay_factor", "epsilon", "norm_coefficient"];

pub(super) fn lower(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    l.only_attributes(node, ATTRIBUTES)?;
    let decay = l.float_attr(node, "decay_factor")?.unwrap_or(0.0) as f64;
    let epsilon = l.float_attr(node, "epsilon")?.unwrap_or(1e-6) as f64;
    let norm = l.float_attr(node, "norm_coefficient")?.unwrap_or(0.0) as f64;
    let ops = l.optimizer_operands(node, &["X", "G", "H"], &["X", "H"])?;

    let mut rate_double: Option<ValueId> = None;
    let mut rate = PerType::default();

    for i in 0..ops.count {
        let [want_x, want_h] = [0, 1].map(|role| ops.used(role, i));
        if !(want_x || want_h) {
            continue;
        }
        let elem = l.tensor_type(node, &ops, i)?;
        let [x, g, h] = [0, 1, 2].map(|role| ops.input(role, i));
        let name = l.name(x);

        // g = λ X + G
        let g = if norm != 0.0 {
            let lambda = l.scalar("norm_coefficient", elem, norm);
            let decayed = l.op("Mul", &[x, lambda], vec![], &format!("{name}.decay"));
            l.op("Add", &[decayed, g], vec![], &format!("{name}.grad"))
        } else {
            g
        };
        // H_new = H + g g
        let square = l.op("Mul", &[g, g], vec![], &format!("{name}.H"));
        let h_new = l.op("Add", &[h, square], vec![], &format!("{name}.H_new"));
        if want_x {
            // X_new = X - (r g) / (√H_new + ε)
            let r = rate.get(l, elem, |l, elem| {
                if decay == 0.0 {
                    let r = l.scalar_of(ops.r, "R_scalar");
                    return l.cast(r, elem, "R_adjusted");
                }
                let r = *rate_double.get_or_insert_with(|| learning_rate(l, ops.r, ops.t, decay));
                l.convert(r, DOUBLE, elem, "R_adjusted")
            });
            let eps = l.scalar("epsilon", elem, epsilon);
            let root = l.op("Sqrt", &[h_new], vec![], &format!("{name}.H_sqrt"));
            let denom = l.op("Add", &[root, eps], vec![], &format!("{name}.H_sqrt"));
            let scaled = l.op("Mul", &[r, g], vec![], &format!("{name}.step"));
            let step = l.op("Div", &[scaled, denom], vec![], &format!("{name}.step"));
            let x_new = l.op("Sub", &[x, step], vec![], &format!("{name}.X_new"));
            l.replace(node, ops.slot(0, i), x_new);
        }
        if want_h {
            l.replace(node, ops.slot(1, i), h_new);
        }
    }
    Ok(())
}

/// `R / (1 + T d)`, in double.
fn learning_rate(l: &mut Lowering<'_, '_>, r: ValueId, t: ValueId, decay: f64) -> ValueId {
    let r = l.scalar_of(r, "R_scalar");
    let t = l.scalar_of(t, "T_scalar");
    let r = l.cast(r, DOUBLE, "R_double");
    let t = l.cast(t, DOUBLE, "T_double");
    let d = l.scalar("decay_factor", DOUBLE, decay);
    let one = l.scalar("one", DOUBLE, 1.0);
    let decayed = l.op("Mul", &[t, d], vec![], "T_decay");
    let divisor = l.op("Add", &[one, decayed], vec![], "R_divisor");
    l.op("Div", &[r, divisor], vec![], "R_adjusted")
}
