//! Matrix products.
//!
//! ```text
//! Y = A @ B                dA = dY @ Bᵀ             dB = Aᵀ @ dY     (batch axes unbroadcast)
//! Y = α op(A) op(B) + β C  (Gemm, op = identity or transpose by transA / transB)
//!   transA=0: dA = α dY op(B)ᵀ         transA=1: dA = α op(B) dYᵀ
//!   transB=0: dB = α op(A)ᵀ dY         transB=1: dB = α dYᵀ op(A)
//!   dC = β dY, summed back to C's shape
//! ```
//!
//! Every transpose is a Gemm flag, never a copy. A MatMul whose right operand is a matrix
//! (a Linear layer: `[.., K] @ [K, N]`) is differentiated on the flattened `[-1, K]` view, so
//! dB is one Gemm with `transA = 1` however many leading axes A has, and dA one Gemm with
//! `transB = 1` reshaped back (Reshape moves no data).
//!
//! For the accumulation pass: every weight gradient here is the output of a Gemm without a
//! C input, so `acc + dW` can be folded into that Gemm as `C = acc, beta = 1`.

use super::{wanted, Grad, InputGrads};
use crate::ir::builder::{attr_float, attr_int, attr_ints};
use crate::ir::{NodeId, ValueId};
use crate::passes::PassError;

fn gemm(
    cx: &mut Grad<'_>,
    a: ValueId,
    b: ValueId,
    trans_a: bool,
    trans_b: bool,
    alpha: f32,
    hint: &str,
) -> ValueId {
    let mut attrs = Vec::new();
    if trans_a {
        attrs.push(attr_int("transA", 1));
    }
    if trans_b {
        attrs.push(attr_int("transB", 1));
    }
    if alpha != 1.0 {
        attrs.push(attr_float("alpha", alpha));
    }
    cx.op("Gemm", &[a, b], attrs, hint)
}

pub fn matmul(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let dy = cx.dy(node, dys, 0)?;
    let (a, b) = (cx.input(node, 0)?, cx.input(node, 1)?);
    let y = cx.forward_output(node, 0)?;
    let (ra, rb) = (cx.need_rank(node, a)?, cx.need_rank(node, b)?);
    if ra < 2 || rb < 2 {
        return Err(cx.error(
            node,
            format!("a one-dimensional MatMul operand is not supported by the gradient rule ('{}' has rank {ra}, '{}' rank {rb})", cx.model().name(a), cx.model().name(b)),
        ));
    }
    let (ha, hb) = (
        format!("{}_grad", cx.model().name(a)),
        format!("{}_grad", cx.model().name(b)),
    );
    let mut out = vec![None, None];
    if rb == 2 {
        let bd = cx.facts(b).static_dims();
        let (k, n) = match bd.as_deref() {
            Some([k, n]) => (*k, *n),
            _ if ra == 2 => (-1, -1),
            _ => {
                return Err(cx.error(
                    node,
                    format!("the dims of '{}' are not known", cx.model().name(b)),
                ))
            }
        };
        let (a2, dy2) = if ra == 2 {
            (a, dy)
        } else {
            let shape_k = cx.ints(&[-1, k]);
            let shape_n = cx.ints(&[-1, n]);
            let a2 = cx.op("Reshape", &[a, shape_k], vec![], &ha);
            let dy2 = cx.op("Reshape", &[dy, shape_n], vec![], &hb);
            (a2, dy2)
        };
        if wanted(wants, 0) {
            let g = gemm(cx, dy2, b, false, true, 1.0, &ha);
            out[0] = Some(if ra == 2 {
                let f = cx.facts(a);
                cx.shapes.set(g, f);
                g
            } else {
                let shape = cx.shape_of(a);
                cx.op_like("Reshape", &[g, shape], vec![], &ha, a)
            });
        }
        if wanted(wants, 1) {
            let g = gemm(cx, a2, dy2, true, false, 1.0, &hb);
            let f = cx.facts(b);
            cx.shapes.set(g, f);
            out[1] = Some(g);
        }
        return Ok(out);
    }
    // Batched: transpose the last two axes of the other operand.
    let swap = |r: usize| -> Vec<i64> {
        let mut p: Vec<i64> = (0..r as i64).collect();
        p.swap(r - 1, r - 2);
        p
    };
    if wanted(wants, 0) {
        let bt = cx.op("Transpose", &[b], vec![attr_ints("perm", &swap(rb))], &ha);
        let g = cx.op("MatMul", &[dy, bt], vec![], &ha);
        // The product has y's batch axes and a's matrix axes (its rows are y's, by a name
        // the facts may not share; its columns K, not y's N).
        let mut facts = cx.facts(y);
        if let (Some(d), Some(ad)) = (facts.dims.as_mut(), cx.facts(a).dims) {
            let (r, ra) = (d.len(), ad.len());
            if r >= 1 && ra >= 1 {
                d[r - 1] = ad[ra - 1].clone();
            }
            if r >= 2 && ra >= 2 {
                d[r - 2] = ad[ra - 2].clone();
            }
        }
        cx.shapes.set(g, facts);
        // Its batch axes are the broadcast of a's and b's (both have two matrix axes, so
        // they align); its matrix axes are a's own.
        out[0] = Some(cx.unbroadcast_from(node, g, g, a, Some(&[b]))?);
    }
    if wanted(wants, 1) {
        let at = cx.op("Transpose", &[a], vec![attr_ints("perm", &swap(ra))], &hb);
        let g = cx.op("MatMul", &[at, dy], vec![], &hb);
        // The product has y's batch axes and b's matrix axes.
        let mut facts = cx.facts(y);
        if let (Some(d), Some(bd)) = (facts.dims.as_mut(), cx.facts(b).dims) {
            // Both ranks are at least 2 (checked above for b; y's is the larger of the two)
            // unless a declared type says otherwise, and then the facts are left as they are.
            let (r, rb) = (d.len(), bd.len());
            if r >= 2 && rb >= 2 {
                d[r - 2] = bd[rb - 2].clone();
                d[r - 1] = bd[rb - 1].clone();
            }
        }
        cx.shapes.set(g, facts);
        out[1] = Some(cx.unbroadcast_from(node, g, g, b, Some(&[a]))?);
    }
    Ok(out)
}

pub fn gemm_rule(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let dy = cx.dy(node, dys, 0)?;
    let (a, b) = (cx.input(node, 0)?, cx.input(node, 1)?);
    let y = cx.forward_output(node, 0)?;
    let alpha = cx.float_attr(node, "alpha", 1.0)?;
    let beta = cx.float_attr(node, "beta", 1.0)?;
    let ta = cx.int_attr(node, "transA", 0)? != 0;
    let tb = cx.int_attr(node, "transB", 0)? != 0;
    let mut out = vec![None; wants.len()];
    if wanted(wants, 0) {
        let h = format!("{}_grad", cx.model().name(a));
        let g = if !ta {
            gemm(cx, dy, b, false, !tb, alpha, &h)
        } else {
            gemm(cx, b, dy, tb, true, alpha, &h)
        };
        let f = cx.facts(a);
        cx.shapes.set(g, f);
        out[0] = Some(g);
    }
    if wanted(wants, 1) {
        let h = format!("{}_grad", cx.model().name(b));
        let g = if !tb {
            gemm(cx, a, dy, !ta, false, alpha, &h)
        } else {
            gemm(cx, dy, a, true, ta, alpha, &h)
        };
        let f = cx.facts(b);
        cx.shapes.set(g, f);
        out[1] = Some(g);
    }
    if wanted(wants, 2) {
        let c = cx.input(node, 2)?;
        let h = format!("{}_grad", cx.model().name(c));
        let scaled = if beta == 1.0 {
            dy
        } else {
            let k = cx.scalar_like(node, y, beta as f64)?;
            cx.op_like("Mul", &[dy, k], vec![], &h, y)
        };
        // A and B are not broadcast with C: only C's own dims tell.
        out[2] = Some(cx.unbroadcast_from(node, scaled, y, c, None)?);
    }
    Ok(out)
}
