//! `Gemm(A, B, C?; alpha = 1, beta = 1, transA = 0, transB = 0) -> Y` in float16, lowered
//! for tract (`lower-for-tract` only; `legalize-ort` never runs it, every other runtime
//! handles a half Gemm):
//!
//! ```text
//! Y = alpha * op(A) @ op(B) + beta * C        op transposes when trans is set
//! ```
//!
//! Why: tract-onnx 0.23 expands `Gemm` itself into the product, a `Mul` by `alpha` when it is
//! not 1, and `beta * C` whenever C is present (even for beta = 1), with `alpha` and `beta`
//! as float32 constants. In a float16 Gemm that mixes F16 and F32 and the model fails to
//! type ("Output mismatch ... expected F16 got F32"). Here the Gemm becomes `Transpose`
//! (perm `[1, 0]`) where `transA`/`transB` ask, `MatMul`, a `Mul` by `alpha` only when it is
//! not 1, and `Add` of C (times `beta` only when it is not 1) only when C is present and
//! beta is not 0; every constant is a float16 scalar, so no node mixes types, and tract runs
//! the product with its half MatMul.
//!
//! Only float16 Gemms are lowered: tract types float32 Gemms itself (its own expansion is
//! then exactly this one), and it has no bfloat16 type at all. `alpha` and `beta` are rounded
//! to float16 (exact for 1, 0.5, powers of two and the like); `beta = 0` drops C, as tract and
//! ONNX Runtime do (ONNX's formula would propagate a NaN or an infinity of C).

use super::util::{elem_type, FLOAT16};
use super::Lowering;
use crate::ir::builder::attr_ints;
use crate::ir::{Model, NodeId, ValueId};
use crate::passes::PassError;

/// Whether `node` is a standard `Gemm` computing in float16 (any of its inputs or its output
/// is known to be float16; an unknown type is taken for float32, which tract handles).
pub fn is_half_gemm(model: &Model, node: NodeId) -> bool {
    let n = model.node(node);
    if n.proto.op_type() != "Gemm" || !crate::ir::normalize_domain(n.proto.domain()).is_empty() {
        return false;
    }
    n.inputs
        .iter()
        .flatten()
        .chain(n.outputs.first().into_iter().flatten())
        .any(|v| elem_type(model, *v) == Some(FLOAT16))
}

pub fn lower(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    let (a, b) = (l.input(node, 0)?, l.input(node, 1)?);
    let c = l.optional_input(node, 2);
    let alpha = l.float_attr(node, "alpha", 1.0)?;
    let beta = l.float_attr(node, "beta", 1.0)?;
    let a = transpose(l, node, a, "transA")?;
    let b = transpose(l, node, b, "transB")?;
    let t = FLOAT16;
    let mut y = l.op("MatMul", &[a, b], vec![], "gemm");
    if alpha != 1.0 {
        let alpha = l.scalar("alpha", t, alpha as f64);
        y = l.op("Mul", &[y, alpha], vec![], "gemm_scaled");
    }
    if let Some(c) = c.filter(|_| beta != 0.0) {
        let c = if beta == 1.0 {
            c
        } else {
            let beta = l.scalar("beta", t, beta as f64);
            l.op("Mul", &[c, beta], vec![], "gemm_beta_c")
        };
        y = l.op("Add", &[y, c], vec![], "gemm_bias");
    }
    l.replace(node, 0, y);
    Ok(())
}

/// `x` transposed (Gemm's operands are matrices) when attribute `attr` is 1.
fn transpose(
    l: &mut Lowering<'_, '_>,
    node: NodeId,
    x: ValueId,
    attr: &str,
) -> Result<ValueId, PassError> {
    match l.int_attr(node, attr, 0)? {
        0 => Ok(x),
        1 => Ok(l.op(
            "Transpose",
            &[x],
            vec![attr_ints("perm", &[1, 0])],
            "gemm_t",
        )),
        other => Err(l.unsupported(node, attr, format!("value {other}"))),
    }
}
