//! `Scale(X, s; scale_down = 0) -> Y`: multiplies by (or, with `scale_down`, divides by) the
//! one-element tensor `s`, which may be an integer (ORT's ReduceMean and GlobalAveragePool
//! gradients divide by an int64 element count):
//!
//! ```text
//! Y = scale_down ? X / s : X * s        (s cast to X's element type)
//! ```
//!
//! A constant `s` is folded into one float scalar (for `scale_down`, its reciprocal rounded
//! once, as ORT's kernel does); otherwise `s` is cast at run time, a one-element cast.

use super::util::{constant_scalar, dims};
use super::Lowering;
use crate::ir::NodeId;
use crate::passes::PassError;

pub(super) fn lower(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    let (x, s) = (l.input(node, 0)?, l.input(node, 1)?);
    let down = match l.int_attr(node, "scale_down", 0)? {
        0 => false,
        1 => true,
        other => return Err(l.unsupported(node, "scale_down", format!("value {other}"))),
    };
    let t = l.float_type(node, x)?;
    let y = if let Some(value) = constant_scalar(l.model(), s) {
        // ORT: float scale = (float)s; x * (scale_down ? 1 / scale : scale).
        let value = value as f32;
        let factor = if down { 1.0 / value } else { value };
        let factor = l.scalar("scale", t, factor as f64);
        l.op("Mul", &[x, factor], vec![], "scaled")
    } else {
        let mut s_t = l.cast(s, t, "scale");
        // Y has X's shape: a one-element `s` of higher rank than X must not broadcast X up.
        let s_rank = dims(l.model(), s).map(|d| d.len()).unwrap_or(0);
        if s_rank > 0 && l.rank(x).is_none_or(|r| r < s_rank) {
            let scalar_shape = l.int64s("scalar_shape", &[]);
            s_t = l.op("Reshape", &[s_t, scalar_shape], vec![], "scale_scalar");
        }
        l.op(
            if down { "Div" } else { "Mul" },
            &[x, s_t],
            vec![],
            "scaled",
        )
    };
    l.replace(node, 0, y);
    Ok(())
}
