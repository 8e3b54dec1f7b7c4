//! Scatters and the gather they are the transpose of.
//!
//! `Y = ScatterElements(X, I, U, axis)` writes `U[j]` at position `I[j]` (along `axis`) of a
//! copy of X; `ScatterND(X, I, U)` writes the slices `U[j]` at the index tuples `I[j]`.
//! Each updated position of Y came from an update, every other one from X:
//!
//! - `reduction = none`: `dX = dY` with the written positions zeroed (the same scatter of
//!   zeros into dY), `dU = gather(dY, I)`. ONNX leaves duplicate indices undefined here, so
//!   each written position has one update.
//! - `reduction = add`: `Y = X + scatter_add(U)`, so `dX = dY` and `dU = gather(dY, I)`.
//! - `max`, `min`: each position of Y is the largest (smallest) of X there and the updates
//!   written there; its gradient goes to those equal to it, split evenly among ties (as
//!   torch's `scatter_reduce` with `amax`/`amin` and `include_self`):
//!   `count = [X = Y] + scatter_add([U = gather(Y, I)])`, `dX = dY / count · [X = Y]`,
//!   `dU = gather(dY / count, I) · [U = gather(Y, I)]`.
//! - `mul`: `Y = X · Π U` at each written position. `dX = dY · scatter_mul(1, U)`; an
//!   update's gradient is `dY · X · Π` of the other updates there, computed without
//!   dividing by an update that may be zero: with `P = scatter_mul(X, U or 1 where U = 0)`
//!   and `z` the number of zero updates at a position, `dU = gather(dY · P, I) / U` where
//!   `U ≠ 0` and `z = 0`, `gather(dY · P, I)` where `U = 0` and `z = 1`, else 0.
//!
//! `Y = GatherND(X, I)` (batch_dims 0) reads slices of X at the tuples `I[j]`; its
//! gradient adds each `dY[j]` back at `I[j]`: `dX = ScatterND(zeros(X), I, dY, add)`, since
//! a tuple may repeat. With `batch_dims = b` the tuples index within each of the first b
//! axes' positions, which is GatherND with those positions written in front of each tuple:
//! `I' = [p₀, …, p_{b-1}, I[p…]]`, the same scatter of dY at `I'` (ScatterND has no
//! batch_dims).

use super::{wanted, Grad, InputGrads};
use crate::ir::builder::{attr_int, attr_string};
use crate::ir::{NodeId, ValueId};
use crate::passes::PassError;
use crate::proto::elem::INT64;

fn hint(cx: &Grad<'_>, x: ValueId) -> String {
    format!("{}_grad", cx.model().name(x))
}

/// `none`, `add`, `mul`, `max` or `min`, else an error naming the reduction.
fn reduction(cx: &Grad<'_>, node: NodeId) -> Result<&'static str, PassError> {
    match cx.string_attr(node, "reduction")?.as_deref() {
        None | Some("none") => Ok("none"),
        Some("add") => Ok("add"),
        Some("mul") => Ok("mul"),
        Some("max") => Ok("max"),
        Some("min") => Ok("min"),
        Some(other) => Err(cx.error(
            node,
            format!("reduction '{other}' is not one of none, add, mul, max, min"),
        )),
    }
}

/// The scatter rules: `gather` is how the updates' gradient reads dY (GatherElements with
/// the node's axis, or GatherND).
fn scatter(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
    gather: &str,
) -> Result<InputGrads, PassError> {
    let reduction = reduction(cx, node)?;
    let dy = cx.dy(node, dys, 0)?;
    let (x, indices, updates) = (cx.input(node, 0)?, cx.input(node, 1)?, cx.input(node, 2)?);
    let axis = cx.attrs_of(node, &["axis"]);
    match reduction {
        "max" | "min" => return extremum(cx, node, dy, wants, gather),
        "mul" => return product(cx, node, dy, wants, gather),
        _ => {}
    }
    let mut grads = vec![None; wants.len()];
    if wanted(wants, 0) {
        grads[0] = Some(match reduction {
            "add" => dy,
            _ => {
                let h = hint(cx, x);
                let zeros = cx.zeros_like(node, updates, &format!("{h}_zeros"))?;
                let op = cx.model().node(node).proto.op_type().to_string();
                cx.op_like(&op, &[dy, indices, zeros], axis.clone(), &h, x)
            }
        });
    }
    if wanted(wants, 2) {
        let h = hint(cx, updates);
        grads[2] = Some(cx.op_like(gather, &[dy, indices], axis, &h, updates));
    }
    Ok(grads)
}

/// The gradient of a scatter with `reduction = max` or `min` (see the module docs): to
/// the values equal to the result, split evenly among ties.
fn extremum(
    cx: &mut Grad<'_>,
    node: NodeId,
    dy: ValueId,
    wants: &[bool],
    gather: &str,
) -> Result<InputGrads, PassError> {
    let (x, indices, updates) = (cx.input(node, 0)?, cx.input(node, 1)?, cx.input(node, 2)?);
    let y = cx.model().output(node, 0);
    let axis = cx.attrs_of(node, &["axis"]);
    let op = cx.model().node(node).proto.op_type().to_string();
    let elem = cx.elem(node, x)?;
    let (hx, hu) = (hint(cx, x), hint(cx, updates));
    let cast = vec![attr_int("to", elem as i64)];
    let x_is = cx.op("Equal", &[x, y], vec![], &format!("{hx}_is_extremum"));
    let x_is = cx.op_like(
        "Cast",
        &[x_is],
        cast.clone(),
        &format!("{hx}_is_extremum"),
        x,
    );
    let y_at_u = cx.op_like(
        gather,
        &[y, indices],
        axis.clone(),
        &format!("{hu}_result"),
        updates,
    );
    let u_is = cx.op(
        "Equal",
        &[updates, y_at_u],
        vec![],
        &format!("{hu}_is_extremum"),
    );
    let u_is = cx.op_like("Cast", &[u_is], cast, &format!("{hu}_is_extremum"), updates);
    let zeros = cx.zeros_like(node, x, &format!("{hx}_zeros"))?;
    let mut add = axis.clone();
    add.push(attr_string("reduction", "add"));
    let u_ties = cx.op_like(&op, &[zeros, indices, u_is], add, &format!("{hx}_ties"), x);
    let count = cx.op_like("Add", &[x_is, u_ties], vec![], &format!("{hx}_ties"), x);
    let share = cx.op_like("Div", &[dy, count], vec![], &format!("{hx}_share"), x);
    let mut grads = vec![None; wants.len()];
    if wanted(wants, 0) {
        grads[0] = Some(cx.op_like("Mul", &[share, x_is], vec![], &hx, x));
    }
    if wanted(wants, 2) {
        let shared = cx.op_like(
            gather,
            &[share, indices],
            axis,
            &format!("{hu}_share"),
            updates,
        );
        grads[2] = Some(cx.op_like("Mul", &[shared, u_is], vec![], &hu, updates));
    }
    Ok(grads)
}

/// The gradient of a scatter with `reduction = mul` (see the module docs).
fn product(
    cx: &mut Grad<'_>,
    node: NodeId,
    dy: ValueId,
    wants: &[bool],
    gather: &str,
) -> Result<InputGrads, PassError> {
    let (x, indices, updates) = (cx.input(node, 0)?, cx.input(node, 1)?, cx.input(node, 2)?);
    let axis = cx.attrs_of(node, &["axis"]);
    let op = cx.model().node(node).proto.op_type().to_string();
    let (hx, hu) = (hint(cx, x), hint(cx, updates));
    let with = |reduction: &str| {
        let mut a = axis.clone();
        a.push(attr_string("reduction", reduction));
        a
    };
    let (zero, one) = (cx.scalar_like(node, x, 0.0)?, cx.scalar_like(node, x, 1.0)?);
    let mut grads = vec![None; wants.len()];
    if wanted(wants, 0) {
        let zeros = cx.zeros_like(node, x, &format!("{hx}_zeros"))?;
        let ones = cx.op_like("Add", &[zeros, one], vec![], &format!("{hx}_ones"), x);
        let factor = cx.op_like(
            &op,
            &[ones, indices, updates],
            with("mul"),
            &format!("{hx}_factor"),
            x,
        );
        grads[0] = Some(cx.op_like("Mul", &[dy, factor], vec![], &hx, x));
    }
    if wanted(wants, 2) {
        let is_zero = cx.op("Equal", &[updates, zero], vec![], &format!("{hu}_is_zero"));
        let nonzero = cx.op_like(
            "Where",
            &[is_zero, one, updates],
            vec![],
            &format!("{hu}_nonzero"),
            updates,
        );
        let product = cx.op_like(
            &op,
            &[x, indices, nonzero],
            with("mul"),
            &format!("{hu}_product"),
            x,
        );
        let elem = cx.elem(node, x)?;
        let zero_count = cx.op_like(
            "Cast",
            &[is_zero],
            vec![attr_int("to", elem as i64)],
            &format!("{hu}_zero_count"),
            updates,
        );
        let zeros = cx.zeros_like(node, x, &format!("{hx}_zeros"))?;
        let zeros_at = cx.op_like(
            &op,
            &[zeros, indices, zero_count],
            with("add"),
            &format!("{hu}_zeros_at"),
            x,
        );
        let weighted = cx.op_like("Mul", &[dy, product], vec![], &format!("{hu}_weighted"), x);
        let weighted = cx.op_like(
            gather,
            &[weighted, indices],
            axis.clone(),
            &format!("{hu}_weighted"),
            updates,
        );
        let zeros_here = cx.op_like(
            gather,
            &[zeros_at, indices],
            axis,
            &format!("{hu}_zeros_here"),
            updates,
        );
        // U ≠ 0: the others' product is P / U, and zero where another update is zero.
        let divided = cx.op_like(
            "Div",
            &[weighted, nonzero],
            vec![],
            &format!("{hu}_divided"),
            updates,
        );
        let none_zero = cx.op(
            "Equal",
            &[zeros_here, zero],
            vec![],
            &format!("{hu}_none_zero"),
        );
        let if_nonzero = cx.op_like(
            "Where",
            &[none_zero, divided, zero],
            vec![],
            &format!("{hu}_if_nonzero"),
            updates,
        );
        // U = 0: the others' product is P itself when U is the only zero there.
        let only_zero = cx.op(
            "Equal",
            &[zeros_here, one],
            vec![],
            &format!("{hu}_only_zero"),
        );
        let if_zero = cx.op_like(
            "Where",
            &[only_zero, weighted, zero],
            vec![],
            &format!("{hu}_if_zero"),
            updates,
        );
        grads[2] = Some(cx.op_like(
            "Where",
            &[is_zero, if_zero, if_nonzero],
            vec![],
            &hu,
            updates,
        ));
    }
    Ok(grads)
}

pub fn scatter_elements(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    scatter(cx, node, dys, wants, "GatherElements")
}

pub fn scatter_nd(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    scatter(cx, node, dys, wants, "GatherND")
}

pub fn gather_nd(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let batch_dims = cx.int_attr(node, "batch_dims", 0)?;
    // Repeated tuples add up: ScatterND's `reduction` exists from opset 16.
    if cx.opset() < 16 {
        return Err(cx.error(
            node,
            format!(
                "the gradient adds slices with ScatterND(reduction='add'), which needs opset 16; \
                 the model imports opset {}",
                cx.opset()
            ),
        ));
    }
    let (x, indices) = (cx.input(node, 0)?, cx.input(node, 1)?);
    let indices = match batch_dims {
        0 => indices,
        b => with_batch_positions(cx, node, indices, b)?,
    };
    let h = hint(cx, x);
    let zeros = cx.zeros_like(node, x, &format!("{h}_zeros"))?;
    let dy = cx.dy(node, dys, 0)?;
    let dx = cx.op_like(
        "ScatterND",
        &[zeros, indices, dy],
        vec![attr_string("reduction", "add")],
        &h,
        x,
    );
    let mut grads = vec![None; wants.len().max(1)];
    grads[0] = Some(dx);
    Ok(grads)
}

/// The tuples `indices` of a GatherND with `batch_dims = b`, each with the positions of its
/// first `b` axes written in front (`[r-1 axes…, b + k]` from `[r-1 axes…, k]`): what a
/// GatherND without batch_dims reads the same slices with.
fn with_batch_positions(
    cx: &mut Grad<'_>,
    node: NodeId,
    indices: ValueId,
    b: i64,
) -> Result<ValueId, PassError> {
    let Some(rank) = cx.facts(indices).rank() else {
        return Err(cx.error(
            node,
            format!(
                "batch_dims = {b}: the gradient needs the rank of the indices, which is not known"
            ),
        ));
    };
    let rank = rank as i64;
    if b < 0 || b >= rank {
        return Err(cx.error(
            node,
            format!(
                "batch_dims = {b} is outside 0..{} (the indices' rank less one)",
                rank - 1
            ),
        ));
    }
    let name = cx.model().name(indices).to_string();
    let shape = cx.shape_of(indices);
    // Each position grid is the shape of the tuples' axes with one coordinate.
    let (start, end) = (cx.ints(&[0]), cx.ints(&[rank - 1]));
    let leading = cx.op(
        "Slice",
        &[shape, start, end],
        vec![],
        &format!("{name}_axes"),
    );
    let one = cx.ints(&[1]);
    let grid = cx.op(
        "Concat",
        &[leading, one],
        vec![attr_int("axis", 0)],
        &format!("{name}_grid"),
    );
    let (zero, step) = (cx.scalar(INT64, 0.0), cx.scalar(INT64, 1.0));
    let mut parts = Vec::new();
    for axis in 0..b {
        let at = cx.scalar(INT64, axis as f64);
        let size = cx.op(
            "Gather",
            &[shape, at],
            vec![],
            &format!("{name}_size{axis}"),
        );
        let positions = cx.op(
            "Range",
            &[zero, size, step],
            vec![],
            &format!("{name}_at{axis}"),
        );
        let mut along: Vec<i64> = vec![1; rank as usize];
        along[axis as usize] = -1;
        let along = cx.ints(&along);
        let column = cx.op(
            "Reshape",
            &[positions, along],
            vec![],
            &format!("{name}_at{axis}"),
        );
        parts.push(cx.op(
            "Expand",
            &[column, grid],
            vec![],
            &format!("{name}_at{axis}"),
        ));
    }
    parts.push(indices);
    Ok(cx.op(
        "Concat",
        &parts,
        vec![attr_int("axis", -1)],
        &format!("{name}_with_batch"),
    ))
}
