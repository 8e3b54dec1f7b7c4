//! Reductions over `axes` (an attribute or a constant input, by opset). With `keepdims = 0`
//! the gradient first gets the reduced axes back as size 1 (`dY_k`), then broadcasts:
//!
//! ```text
//! ReduceSum         dX = Expand(dY_k, shape(X))
//! ReduceMean        dX = Expand(dY_k / n, shape(X))          n = elements per reduced group
//! ReduceSumSquare   dX = 2 X · dY_k
//! ReduceL2          dX = X · dY_k / Y_k
//! ReduceMax / Min   dX = dY_k / c · (X == Y_k)               c = how many tie for the extreme
//! ReduceLogSumExp   dX = dY_k · exp(X - Y_k)                 (the softmax of X over the axes)
//! ReduceLogSum      dX = dY_k · exp(-Y_k)                    (1 / the group's sum)
//! ReduceL1          dX = dY_k · sign(X)
//! GlobalMaxPool     ReduceMax over the spatial axes, kept
//! ReduceProd        dX = dY_k · (product of the group's other elements), without dividing
//!                   by X: with z zeros in the group and P the product of its nonzero
//!                   elements, that is P / X where z = 0, P at the zero where z = 1, else 0
//! ```
//!
//! Ties of ReduceMax/Min share the gradient evenly, as PyTorch's `amax`/`amin` do.

use super::{Grad, InputGrads, UnaryParts};
use crate::ir::builder::attr_int;
use crate::ir::emit::Emit;
use crate::ir::{NodeId, ValueId};
use crate::passes::PassError;

/// The reduced axes (non-negative) and whether the output kept them; `None` when the node
/// reduces nothing (`noop_with_empty_axes` with no axes).
fn reduced_axes(
    cx: &Grad<'_>,
    node: NodeId,
    x: ValueId,
) -> Result<Option<(Vec<i64>, bool)>, PassError> {
    let rank = cx.need_rank(node, x)? as i64;
    let keep = cx.int_attr(node, "keepdims", 1)? != 0;
    let axes = match cx.ints_attr(node, "axes")? {
        Some(a) => Some(a),
        None => match cx.opt_input(node, 1) {
            Some(v) => Some(
                super::super::shapes::constant_ints(cx.model(), v).ok_or_else(|| {
                    cx.error(
                        node,
                        format!("the axes input '{}' is not a constant", cx.model().name(v)),
                    )
                })?,
            ),
            None => None,
        },
    };
    let axes = match axes {
        Some(a) if !a.is_empty() => a,
        _ if cx.int_attr(node, "noop_with_empty_axes", 0)? != 0 => return Ok(None),
        _ => (0..rank).collect(),
    };
    let mut axes: Vec<i64> = axes
        .iter()
        .map(|a| if *a < 0 { a + rank } else { *a })
        .collect();
    if let Some(bad) = axes.iter().find(|a| **a < 0 || **a >= rank) {
        return Err(cx.error(node, format!("axis {bad} is out of range for rank {rank}")));
    }
    axes.sort_unstable();
    Ok(Some((axes, keep)))
}

/// dY and Y with the reduced axes present (size 1).
fn kept(
    cx: &mut Grad<'_>,
    dy: ValueId,
    y: ValueId,
    axes: &[i64],
    keep: bool,
    hint: &str,
) -> (ValueId, ValueId) {
    if keep {
        (dy, y)
    } else {
        (cx.unsqueeze(dy, axes, hint), cx.unsqueeze(y, axes, hint))
    }
}

/// The reduced axes and keepdims (`reduced_axes`).
type Reduced = Option<(Vec<i64>, bool)>;

fn setup(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
) -> Result<(UnaryParts, Reduced), PassError> {
    let p = cx.unary_parts(node, dys)?;
    let axes = reduced_axes(cx, node, p.x)?;
    Ok((p, axes))
}

/// dY and Y with the reduced axes kept (size 1), X, and the hint: what the rules that read
/// Y start from.
struct Kept {
    dyk: ValueId,
    x: ValueId,
    yk: ValueId,
    hint: String,
}

fn setup_kept(cx: &mut Grad<'_>, node: NodeId, dys: &[Option<ValueId>]) -> Result<Kept, PassError> {
    let (UnaryParts { dy, x, y, hint }, axes) = setup(cx, node, dys)?;
    let (dyk, yk) = match axes {
        None => (dy, y),
        Some((axes, keep)) => kept(cx, dy, y, &axes, keep, &hint),
    };
    Ok(Kept { dyk, x, yk, hint })
}

pub fn reduce_sum(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let (UnaryParts { dy, x, y, hint: h }, axes) = setup(cx, node, dys)?;
    let mut out = vec![None; wants.len()];
    out[0] = Some(match axes {
        None => dy,
        Some((axes, keep)) => {
            let (dyk, _) = kept(cx, dy, y, &axes, keep, &h);
            cx.expand_to(dyk, x, &h)
        }
    });
    Ok(out)
}

pub fn reduce_mean(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let (UnaryParts { dy, x, y, hint: h }, axes) = setup(cx, node, dys)?;
    let mut out = vec![None; wants.len()];
    out[0] = Some(match axes {
        None => dy,
        Some((axes, keep)) => {
            let elem = cx.elem(node, x)?;
            let dims = cx.facts(x).dims.unwrap_or_default();
            let count: Option<i64> = axes
                .iter()
                .map(|a| dims.get(*a as usize).and_then(|d| d.known()))
                .product();
            let n = match count {
                Some(c) => cx.scalar(elem, c as f64),
                None => {
                    let sx = cx.op("Size", &[x], vec![], &h);
                    let sy = cx.op("Size", &[y], vec![], &h);
                    let q = cx.op("Div", &[sx, sy], vec![], &h);
                    cx.op("Cast", &[q], vec![attr_int("to", elem as i64)], &h)
                }
            };
            let (dyk, _) = kept(cx, dy, y, &axes, keep, &h);
            let scaled = cx.op("Div", &[dyk, n], vec![], &h);
            cx.expand_to(scaled, x, &h)
        }
    });
    Ok(out)
}

pub fn reduce_sum_square(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let (UnaryParts { dy, x, y, hint: h }, axes) = setup(cx, node, dys)?;
    let two = cx.scalar_like(node, x, 2.0)?;
    let x2 = cx.op_like("Mul", &[x, two], vec![], &h, x);
    let dyk = match axes {
        None => dy,
        Some((axes, keep)) => kept(cx, dy, y, &axes, keep, &h).0,
    };
    let mut out = vec![None; wants.len()];
    out[0] = Some(cx.op_like("Mul", &[x2, dyk], vec![], &h, x));
    Ok(out)
}

pub fn reduce_l2(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let Kept {
        dyk,
        x,
        yk,
        hint: h,
    } = setup_kept(cx, node, dys)?;
    let q = cx.op("Div", &[dyk, yk], vec![], &h);
    let mut out = vec![None; wants.len()];
    out[0] = Some(cx.op_like("Mul", &[x, q], vec![], &h, x));
    Ok(out)
}

pub fn reduce_max_min(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let (parts, axes) = setup(cx, node, dys)?;
    let mut out = vec![None; wants.len()];
    out[0] = Some(match axes {
        None => parts.dy,
        Some((axes, keep)) => extreme(cx, node, parts, &axes, keep)?,
    });
    Ok(out)
}

/// The gradient of a maximum or minimum over `axes`, shared by the ties.
fn extreme(
    cx: &mut Grad<'_>,
    node: NodeId,
    UnaryParts { dy, x, y, hint: h }: UnaryParts,
    axes: &[i64],
    keep: bool,
) -> Result<ValueId, PassError> {
    let elem = cx.elem(node, x)?;
    let (dyk, yk) = kept(cx, dy, y, axes, keep, &h);
    let hit = cx.op("Equal", &[x, yk], vec![], &h);
    let mask = cx.op_like("Cast", &[hit], vec![attr_int("to", elem as i64)], &h, x);
    let ties = cx.reduce("ReduceSum", mask, axes, true, &h);
    let share = cx.op("Div", &[dyk, ties], vec![], &h);
    Ok(cx.op_like("Mul", &[mask, share], vec![], &h, x))
}

pub fn global_max_pool(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    let parts = cx.unary_parts(node, dys)?;
    let rank = cx.need_rank(node, parts.x)? as i64;
    let spatial: Vec<i64> = (2..rank).collect();
    Ok(vec![Some(extreme(cx, node, parts, &spatial, true)?)])
}

pub fn reduce_log_sum_exp(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let Kept {
        dyk,
        x,
        yk,
        hint: h,
    } = setup_kept(cx, node, dys)?;
    let centred = cx.op_like("Sub", &[x, yk], vec![], &h, x);
    let weights = cx.op_like("Exp", &[centred], vec![], &h, x);
    let mut out = vec![None; wants.len()];
    out[0] = Some(cx.op_like("Mul", &[weights, dyk], vec![], &h, x));
    Ok(out)
}

pub fn reduce_log_sum(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let Kept {
        dyk,
        x,
        yk,
        hint: h,
    } = setup_kept(cx, node, dys)?;
    let minus = cx.op("Neg", &[yk], vec![], &h);
    let inverse_sum = cx.op("Exp", &[minus], vec![], &h);
    let per_group = cx.op("Mul", &[dyk, inverse_sum], vec![], &h);
    let mut out = vec![None; wants.len()];
    out[0] = Some(cx.expand_to(per_group, x, &h));
    Ok(out)
}

pub fn reduce_l1(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let (UnaryParts { dy, x, y, hint: h }, axes) = setup(cx, node, dys)?;
    let dyk = match axes {
        None => dy,
        Some((axes, keep)) => kept(cx, dy, y, &axes, keep, &h).0,
    };
    let sign = cx.op_like("Sign", &[x], vec![], &h, x);
    let mut out = vec![None; wants.len()];
    out[0] = Some(cx.op_like("Mul", &[sign, dyk], vec![], &h, x));
    Ok(out)
}

pub fn reduce_prod(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let (UnaryParts { dy, x, y, hint: h }, axes) = setup(cx, node, dys)?;
    let mut out = vec![None; wants.len()];
    let Some((axes, keep)) = axes else {
        out[0] = Some(dy);
        return Ok(out);
    };
    let elem = cx.elem(node, x)?;
    let (zero, one) = (cx.scalar(elem, 0.0), cx.scalar(elem, 1.0));
    let is_zero = cx.op("Equal", &[x, zero], vec![], &h);
    // X with its zeros replaced by 1: its group products are P, and it divides safely.
    let safe = cx.op("Where", &[is_zero, one, x], vec![], &h);
    let product = cx.reduce("ReduceProd", safe, &axes, true, &h);
    let zeros_as_ones = cx.op("Cast", &[is_zero], vec![attr_int("to", elem as i64)], &h);
    let zeros = cx.reduce("ReduceSum", zeros_as_ones, &axes, true, &h);
    let others_if_none = cx.op("Div", &[product, safe], vec![], &h);
    let no_zero = cx.op("Equal", &[zeros, zero], vec![], &h);
    let one_zero = cx.op("Equal", &[zeros, one], vec![], &h);
    let the_zero = cx.op("And", &[one_zero, is_zero], vec![], &h);
    let at_the_zero = cx.op("Where", &[the_zero, product, zero], vec![], &h);
    let others = cx.op("Where", &[no_zero, others_if_none, at_the_zero], vec![], &h);
    let (dyk, _) = kept(cx, dy, y, &axes, keep, &h);
    out[0] = Some(cx.op_like("Mul", &[others, dyk], vec![], &h, x));
    Ok(out)
}
