//! `Dropout(X, ratio?, training_mode = true) -> Y, mask?`, lowered for tract
//! (`lower-for-tract` only): tract-onnx 0.23 runs Dropout in inference mode alone ("Dropout
//! in training mode with a non-zero ratio is not supported"), so a step that trains with
//! dropout drew nothing there. Written as the draw it is:
//!
//! ```text
//! U    = RandomUniformLike(X)                     uniform on [0, 1), X's type
//! mask = GreaterOrEqual(U, ratio)                 kept with probability 1 - ratio
//! Y    = Cast(mask) · X / keep                    keep = 1 - ratio (0.5 when absent)
//! ```
//!
//! as ONNX Runtime's kernel draws and computes it (`mask = u >= ratio`, `mask · X / (1.0f -
//! ratio)`: keep in float32 whatever X's type, so a float64 step agrees with ONNX Runtime's
//! to rounding, and with the backward's recomputation in a kept Loop). The mask output,
//! which the backward reads (`DropoutGrad`, or a kept Loop's stack), is this one, so the
//! gradient uses what the forward drew. A Dropout that does not drop (no training mode, or
//! it false) is left: tract runs it as the identity. The draw's node gets a name ending in
//! "Like": tract 0.23 tells `RandomUniformLike` from `RandomUniform` by the node's name,
//! not its op (`lower_for_tract`'s `name_random_likes`). A Dropout's `seed` becomes the
//! draw's.

use super::util::constant_scalar;
use super::Lowering;
use crate::ir::builder::{attr_float, attr_int};
use crate::ir::{Model, NodeId};
use crate::passes::PassError;
use crate::proto::tensor_proto::DataType;

/// Whether `node` is a default-domain Dropout that drops (`training_mode` the constant true).
pub fn is_drawing_dropout(model: &Model, node: NodeId) -> bool {
    let p = &model.node(node).proto;
    p.op_type() == "Dropout"
        && crate::ir::normalize_domain(p.domain()).is_empty()
        && crate::passes::autodiff::rules::dropout_drops(model, node)
}

pub fn lower(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    let x = l.input(node, 0)?;
    let t = l.float_type(node, x)?;
    let ratio = l.optional_input(node, 1);
    let mut draw = vec![
        attr_int("dtype", t as i64),
        attr_float("low", 0.0),
        attr_float("high", 1.0),
    ];
    // A seeded Dropout (the model's, or `train --draw-seed`'s) stays seeded: the draw's
    // seed is a float, so the int is taken below 2^24, where float32 holds it exactly.
    let seed = l
        .model()
        .node(node)
        .proto
        .attribute
        .iter()
        .find(|a| a.name() == "seed");
    if let Some(seed) = seed.and_then(|a| a.i) {
        draw.push(attr_float("seed", seed.rem_euclid(1 << 24) as f32));
    }
    let uniform = l.op("RandomUniformLike", &[x], draw, "dropout_uniform");
    // The ratio in X's type for the comparison, and keep = 1 - ratio as the kernel makes
    // it: in float32, whatever the types, then in X's type.
    let float = DataType::Float as i32;
    let (ratio_t, keep) = match ratio.map(|r| (r, constant_scalar(l.model(), r))) {
        None => (
            l.scalar("dropout_ratio", t, 0.5),
            l.scalar("dropout_keep", t, 0.5),
        ),
        Some((_, Some(r))) => {
            let r = r as f32;
            (
                l.scalar("dropout_ratio", t, r as f64),
                l.scalar("dropout_keep", t, (1.0 - r) as f64),
            )
        }
        Some((r, None)) => {
            let one = l.scalar("one", float, 1.0);
            let r32 = l.cast(r, float, "dropout_ratio");
            let keep = l.op("Sub", &[one, r32], vec![], "dropout_keep");
            (
                l.cast(r, t, "dropout_ratio"),
                l.cast(keep, t, "dropout_keep"),
            )
        }
    };
    let mask = l.op(
        "GreaterOrEqual",
        &[uniform, ratio_t],
        vec![],
        "dropout_mask",
    );
    let kept = l.cast(mask, t, "dropout_kept");
    let masked = l.op("Mul", &[kept, x], vec![], "dropout_masked");
    let y = l.op("Div", &[masked, keep], vec![], "dropout_y");
    l.replace(node, 0, y);
    l.replace(node, 1, mask);
    Ok(())
}
