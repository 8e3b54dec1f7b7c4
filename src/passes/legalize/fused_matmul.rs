//! `com.microsoft::FusedMatMul(A, B; alpha = 1, transA = 0, transB = 0, transBatchA = 0,
//! transBatchB = 0) -> Y` (lowered only with `legalize-ort(fused-matmul=true)`: standard ORT
//! has this op, other engines may not):
//!
//! ```text
//! Y = alpha * op(A) @ op(B)        op transposes the last two axes when trans is set
//! ```
//!
//! Two matrices become one `Gemm` (which has `alpha` and both transposes). Otherwise:
//! `Transpose` of the last two axes where asked, `MatMul`, and a `Mul` by alpha when it is
//! not 1 (standard ORT fuses `Transpose + MatMul` back into FusedMatMul by itself). The
//! batch-transposing variants (`transBatchA/B`) are not lowered.

use super::Lowering;
use crate::ir::builder::{attr_float, attr_int, attr_ints};
use crate::ir::{NodeId, ValueId};
use crate::passes::PassError;

pub(super) fn lower(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    let (a, b) = (l.input(node, 0)?, l.input(node, 1)?);
    let alpha = l.float_attr(node, "alpha", 1.0)?;
    let mut trans = [false; 2];
    for (i, name) in ["transA", "transB"].into_iter().enumerate() {
        trans[i] = match l.int_attr(node, name, 0)? {
            0 => false,
            1 => true,
            other => return Err(l.unsupported(node, name, format!("value {other}"))),
        };
    }
    for name in ["transBatchA", "transBatchB"] {
        let value = l.int_attr(node, name, 0)?;
        if value != 0 {
            return Err(l.unsupported(node, name, format!("value {value} (batch transposition)")));
        }
    }
    let y = if l.rank(a) == Some(2) && l.rank(b) == Some(2) {
        l.op(
            "Gemm",
            &[a, b],
            vec![
                attr_float("alpha", alpha),
                attr_int("transA", trans[0] as i64),
                attr_int("transB", trans[1] as i64),
            ],
            "fused_matmul",
        )
    } else {
        let a = transpose_last_two(l, node, a, trans[0], "transA")?;
        let b = transpose_last_two(l, node, b, trans[1], "transB")?;
        let product = l.op("MatMul", &[a, b], vec![], "fused_matmul");
        if alpha == 1.0 {
            product
        } else {
            let t = l.float_type(node, product)?;
            let alpha = l.scalar("alpha", t, alpha as f64);
            l.op("Mul", &[product, alpha], vec![], "fused_matmul_scaled")
        }
    };
    l.replace(node, 0, y);
    Ok(())
}

fn transpose_last_two(
    l: &mut Lowering<'_, '_>,
    node: NodeId,
    x: ValueId,
    trans: bool,
    attr: &str,
) -> Result<ValueId, PassError> {
    if !trans {
        return Ok(x);
    }
    let rank = match l.rank(x) {
        Some(r) if r >= 2 => r,
        Some(r) => return Err(l.unsupported(node, attr, format!("1 on a rank-{r} input"))),
        None => {
            return Err(l.unsupported(
                node,
                attr,
                format!(
                    "1 on '{}', whose rank the model does not declare",
                    l.model().name(x)
                ),
            ))
        }
    };
    let mut perm: Vec<i64> = (0..rank as i64).collect();
    perm.swap(rank - 2, rank - 1);
    Ok(l.op(
        "Transpose",
        &[x],
        vec![attr_ints("perm", &perm)],
        "fused_matmul_t",
    ))
}
