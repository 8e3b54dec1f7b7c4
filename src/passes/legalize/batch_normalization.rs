//! `BatchNormalization(X, scale, B, mean, var; epsilon = 1e-5, training_mode = 0) -> Y` in
//! inference mode (lowered only with `legalize-ort(batch-norm=true)`: a standard op, but
//! tract runs it only when scale, B, mean and var are constants, and in our steps they are
//! parameters or computed), with ONNX Runtime's kernel's order of operations:
//!
//! ```text
//! g     = scale / sqrt(var + epsilon)            per channel, [C]
//! shift = B - mean * g
//! Y     = X * g + shift                          g and shift broadcast over axis 1
//! ```
//!
//! The per-channel affine that the other BatchNorm lowerings emit (mean 0, var 1, epsilon 0)
//! comes out exact: g = scale and shift = B. Training mode (running statistics as outputs)
//! is not lowered.

use super::Lowering;
use crate::ir::builder::{attr_int, attr_tensor, tensor_i64};
use crate::ir::emit::Emit;
use crate::ir::{NodeId, ValueId};
use crate::passes::PassError;

pub(super) fn lower(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    let training_mode = l.int_attr(node, "training_mode", 0)?;
    if training_mode != 0 {
        return Err(l.unsupported(node, "training_mode", format!("{training_mode}")));
    }
    if l.int_attr(node, "spatial", 1)? != 1 {
        return Err(l.unsupported(node, "spatial", "0".into()));
    }
    for slot in 1..5 {
        if l.used_output(node, slot).is_some() {
            return Err(super::node_error(
                l.model(),
                node,
                format!("output {slot} (a training-mode output) is not supported by the lowering"),
            ));
        }
    }
    let x = l.input(node, 0)?;
    let (scale, bias) = (l.input(node, 1)?, l.input(node, 2)?);
    let (mean, var) = (l.input(node, 3)?, l.input(node, 4)?);
    let epsilon = l.float_attr(node, "epsilon", 1e-5)?;
    let t = l.float_type(node, x)?;
    let var_eps = if epsilon == 0.0 {
        var
    } else {
        let eps = l.scalar("epsilon", t, epsilon as f64);
        l.op("Add", &[var, eps], vec![], "bn_var_eps")
    };
    let std = l.op("Sqrt", &[var_eps], vec![], "bn_std");
    let g = l.op("Div", &[scale, std], vec![], "bn_g");
    let mean_g = l.op("Mul", &[mean, g], vec![], "bn_mean_g");
    let shift = l.op("Sub", &[bias, mean_g], vec![], "bn_shift");
    let g = per_channel(l, g, x, "bn_g_c");
    let shift = per_channel(l, shift, x, "bn_shift_c");
    let scaled = l.op("Mul", &[x, g], vec![], "bn_scaled");
    let y = l.op("Add", &[scaled, shift], vec![], "bn");
    l.replace(node, 0, y);
    Ok(())
}

/// `v` [C] shaped [C, 1, ..] to broadcast along axis 1 of `x`: by `Unsqueeze` when the
/// rank of `x` is declared, else by a `Reshape` to `[C] ++ ones(rank - 2)` from its shape.
fn per_channel(l: &mut Lowering<'_, '_>, v: ValueId, x: ValueId, hint: &str) -> ValueId {
    match l.rank(x) {
        Some(2) => v,
        Some(rank) => {
            let axes: Vec<i64> = (1..rank as i64 - 1).collect();
            l.unsqueeze(v, &axes, hint)
        }
        None => {
            let shape = l.op("Shape", &[x], vec![], "bn_x_shape");
            let (one, two) = (l.int64s("one_i64", &[1]), l.int64s("two_i64", &[2]));
            let end = l.int64s("end_i64", &[i64::MAX]);
            let channels = l.op("Slice", &[shape, one, two], vec![], "bn_channels");
            let spatial = l.op("Slice", &[shape, two, end], vec![], "bn_spatial");
            let spatial_rank = l.op("Shape", &[spatial], vec![], "bn_spatial_rank");
            let ones = l.op(
                "ConstantOfShape",
                &[spatial_rank],
                vec![attr_tensor("value", tensor_i64(&[1], &[1]))],
                "bn_ones",
            );
            let target = l.op(
                "Concat",
                &[channels, ones],
                vec![attr_int("axis", 0)],
                "bn_c_shape",
            );
            l.op("Reshape", &[v, target], vec![], hint)
        }
    }
}
