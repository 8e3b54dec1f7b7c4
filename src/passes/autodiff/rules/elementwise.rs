//! Elementwise arithmetic. Every binary op broadcasts, so each input's gradient is summed
//! back to its own shape (`unbroadcast`).
//!
//! ```text
//! Y = A + B         dA = dY                 dB = dY
//! Y = A - B         dA = dY                 dB = -dY
//! Y = A * B         dA = dY * B             dB = dY * A
//! Y = A / B         dA = dY / B             dB = -dY * Y / B
//! Y = X ^ E         dX = dY * E * X^(E-1)   dE = dY * Y * log(X)
//! Y = -X            dX = -dY
//! Y = sqrt(X)       dX = dY / (2 Y)
//! Y = 1 / X         dX = -dY * Y²
//! Y = exp(X)        dX = dY * Y
//! Y = log(X)        dX = dY / X
//! Y = |X|           dX = dY * sign(X)
//! Y = erf(X)        dX = dY * 2/sqrt(pi) * exp(-X²)
//! Y = Σ Xi          dXi = dY                Y = mean(Xi): dXi = dY / n
//! Y = max/min(Xi)   dXi = dY where Xi is the first input equal to Y, else 0
//! Y = C ? A : B     dA = C ? dY : 0         dB = C ? 0 : dY
//! Y = fmod(A, B)    dA = dY                 dB = -dY * trunc(A / B) = -dY * (A - Y) / B
//! ```
//!
//! `Mod` of integers carries no gradient (integer values stop the sweep); of floats ONNX
//! requires `fmod = 1`, C's `fmod`, which is A minus a whole multiple of B: piecewise, A
//! itself plus a constant, so its derivative is not zero. `trunc(A / B)` is read back from
//! the forward's own result rather than recomputed.

use super::{wanted, Grad, InputGrads};
use crate::ir::builder::attr_int;
use crate::ir::{NodeId, ValueId};
use crate::passes::PassError;

fn name(cx: &Grad<'_>, v: ValueId) -> String {
    format!("{}_grad", cx.model().name(v))
}

/// Binary ops: the gradients of both inputs from per-input "local" gradients.
fn binary(
    cx: &mut Grad<'_>,
    node: NodeId,
    wants: &[bool],
    local: impl FnOnce(&mut Grad<'_>, usize) -> Result<ValueId, PassError>,
    local_b: impl FnOnce(&mut Grad<'_>, usize) -> Result<ValueId, PassError>,
) -> Result<InputGrads, PassError> {
    let y = cx.forward_output(node, 0)?;
    let mut out = vec![None, None];
    if wanted(wants, 0) {
        let a = cx.input(node, 0)?;
        let g = local(cx, 0)?;
        out[0] = Some(cx.unbroadcast(node, g, y, a)?);
    }
    if wanted(wants, 1) {
        let b = cx.input(node, 1)?;
        let g = local_b(cx, 1)?;
        out[1] = Some(cx.unbroadcast(node, g, y, b)?);
    }
    Ok(out)
}

pub fn add(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let dy = cx.dy(node, dys, 0)?;
    binary(cx, node, wants, |_, _| Ok(dy), |_, _| Ok(dy))
}

pub fn sub(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let dy = cx.dy(node, dys, 0)?;
    let y = cx.forward_output(node, 0)?;
    binary(
        cx,
        node,
        wants,
        |_, _| Ok(dy),
        |cx, _| {
            let hint = name(cx, cx.input(node, 1)?);
            Ok(cx.op_like("Neg", &[dy], vec![], &hint, y))
        },
    )
}

pub fn mul(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let dy = cx.dy(node, dys, 0)?;
    let y = cx.forward_output(node, 0)?;
    let (a, b) = (cx.input(node, 0)?, cx.input(node, 1)?);
    binary(
        cx,
        node,
        wants,
        |cx, _| {
            let hint = name(cx, a);
            Ok(cx.op_like("Mul", &[dy, b], vec![], &hint, y))
        },
        |cx, _| {
            let hint = name(cx, b);
            Ok(cx.op_like("Mul", &[dy, a], vec![], &hint, y))
        },
    )
}

pub fn div(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let dy = cx.dy(node, dys, 0)?;
    let y = cx.forward_output(node, 0)?;
    let (a, b) = (cx.input(node, 0)?, cx.input(node, 1)?);
    binary(
        cx,
        node,
        wants,
        |cx, _| {
            let hint = name(cx, a);
            Ok(cx.op_like("Div", &[dy, b], vec![], &hint, y))
        },
        |cx, _| {
            let hint = name(cx, b);
            let dy_y = cx.op_like("Mul", &[dy, y], vec![], &hint, y);
            let q = cx.op_like("Div", &[dy_y, b], vec![], &hint, y);
            Ok(cx.op_like("Neg", &[q], vec![], &hint, y))
        },
    )
}

pub fn pow(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let dy = cx.dy(node, dys, 0)?;
    let y = cx.forward_output(node, 0)?;
    let (x, e) = (cx.input(node, 0)?, cx.input(node, 1)?);
    let exponent = super::super::shapes::constant_tensor(cx.model(), e)
        .and_then(crate::ir::emit::tensor_scalar);
    binary(
        cx,
        node,
        wants,
        |cx, _| {
            let hint = name(cx, x);
            let x_elem = cx.elem(node, x)?;
            // X^(E-1) * E; for the common constant E = 2 that is just 2 X.
            let local = match exponent {
                Some(2.0) => {
                    let two = cx.scalar(x_elem, 2.0);
                    cx.op_like("Mul", &[x, two], vec![], &hint, x)
                }
                Some(k) => {
                    let k1 = cx.scalar(x_elem, k - 1.0);
                    let kk = cx.scalar(x_elem, k);
                    let p = cx.op_like("Pow", &[x, k1], vec![], &hint, x);
                    cx.op_like("Mul", &[p, kk], vec![], &hint, x)
                }
                None => {
                    let one = cx.scalar(x_elem, 1.0);
                    let e = if cx.elem(node, e)? == x_elem {
                        e
                    } else {
                        cx.op("Cast", &[e], vec![attr_int("to", x_elem as i64)], &hint)
                    };
                    let e1 = cx.op("Sub", &[e, one], vec![], &hint);
                    let p = cx.op_like("Pow", &[x, e1], vec![], &hint, y);
                    cx.op_like("Mul", &[p, e], vec![], &hint, y)
                }
            };
            Ok(cx.op_like("Mul", &[dy, local], vec![], &hint, y))
        },
        |cx, _| {
            let hint = name(cx, e);
            let log = cx.op_like("Log", &[x], vec![], &hint, x);
            let yl = cx.op_like("Mul", &[y, log], vec![], &hint, y);
            Ok(cx.op_like("Mul", &[dy, yl], vec![], &hint, y))
        },
    )
}

fn unary(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    local: impl FnOnce(&mut Grad<'_>, ValueId, ValueId, ValueId, &str) -> Result<ValueId, PassError>,
) -> Result<InputGrads, PassError> {
    let p = cx.unary_parts(node, dys)?;
    let dx = local(cx, p.dy, p.x, p.y, &p.hint)?;
    Ok(vec![Some(dx)])
}

pub fn neg(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    unary(cx, node, dys, |cx, dy, x, _, h| {
        Ok(cx.op_like("Neg", &[dy], vec![], h, x))
    })
}

pub fn sqrt(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    unary(cx, node, dys, |cx, dy, x, y, h| {
        let half = cx.scalar_like(node, x, 0.5)?;
        let q = cx.op_like("Div", &[dy, y], vec![], h, x);
        Ok(cx.op_like("Mul", &[q, half], vec![], h, x))
    })
}

pub fn reciprocal(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    unary(cx, node, dys, |cx, dy, x, y, h| {
        let y2 = cx.op_like("Mul", &[y, y], vec![], h, x);
        let p = cx.op_like("Mul", &[dy, y2], vec![], h, x);
        Ok(cx.op_like("Neg", &[p], vec![], h, x))
    })
}

pub fn exp(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    cx.by_slope(node, dys, |_, _, y, _| Ok(y))
}

pub fn log(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    unary(cx, node, dys, |cx, dy, x, _, h| {
        Ok(cx.op_like("Div", &[dy, x], vec![], h, x))
    })
}

pub fn abs(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    cx.by_slope(node, dys, |cx, x, _, h| {
        Ok(cx.op_like("Sign", &[x], vec![], h, x))
    })
}

pub fn erf(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    cx.by_slope(node, dys, |cx, x, _, h| {
        let k = cx.scalar_like(node, x, 2.0 / std::f64::consts::PI.sqrt())?;
        let x2 = cx.op_like("Mul", &[x, x], vec![], h, x);
        let nx2 = cx.op_like("Neg", &[x2], vec![], h, x);
        let e = cx.op_like("Exp", &[nx2], vec![], h, x);
        Ok(cx.op_like("Mul", &[e, k], vec![], h, x))
    })
}

/// Variadic `Sum` and `Mean`: every input gets dY (over n for the mean), unbroadcast.
fn variadic(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
    mean: bool,
) -> Result<InputGrads, PassError> {
    let dy = cx.dy(node, dys, 0)?;
    let y = cx.forward_output(node, 0)?;
    let n = wants.len();
    let dy = if mean {
        let k = cx.scalar_like(node, y, 1.0 / n as f64)?;
        let hint = format!("{}_grad", cx.model().name(y));
        cx.op_like("Mul", &[dy, k], vec![], &hint, y)
    } else {
        dy
    };
    let mut out = vec![None; n];
    for (i, want) in wants.iter().enumerate() {
        if *want {
            let x = cx.input(node, i)?;
            out[i] = Some(cx.unbroadcast(node, dy, y, x)?);
        }
    }
    Ok(out)
}

pub fn sum(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    variadic(cx, node, dys, wants, false)
}

pub fn mean(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    variadic(cx, node, dys, wants, true)
}

/// `Max`/`Min`: the gradient goes to the first input that equals the result (a tie gives
/// it to one input, never twice): input i takes it where it beats every earlier input
/// strictly and every later one or ties (`x_i > x_j` for j < i, `x_i >= x_j` for j > i; `<`
/// for Min). Compared with the other inputs, not with the result: ONNX Runtime's CPU
/// provider computes a float16 graph in float32 between casts and feeds a comparison the
/// unrounded float32 value where the result holds it rounded, so `Equal(x, Max(x, c))` was
/// false for equal float16 values (Hugging Face Whisper's float16 clamp: its encoder's whole
/// gradient vanished; measured).
pub fn min_max(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let dy = cx.dy(node, dys, 0)?;
    let y = cx.forward_output(node, 0)?;
    let zero = cx.scalar_like(node, y, 0.0)?;
    let (beats, ties) = match cx.model().node(node).proto.op_type() {
        "Max" => ("Greater", "GreaterOrEqual"),
        _ => ("Less", "LessOrEqual"),
    };
    let inputs: Vec<ValueId> = (0..wants.len())
        .map(|i| cx.input(node, i))
        .collect::<Result<_, _>>()?;
    let mut out = vec![None; wants.len()];
    for (i, want) in wants.iter().enumerate() {
        if !*want {
            continue;
        }
        let x = inputs[i];
        let hint = format!("{}_grad", cx.model().name(x));
        let mut taken: Option<ValueId> = None;
        for (j, other) in inputs.iter().enumerate().filter(|(j, _)| *j != i) {
            let op = if j < i { beats } else { ties };
            let hit = cx.op(op, &[x, *other], vec![], &hint);
            taken = Some(match taken {
                None => hit,
                Some(t) => cx.op("And", &[t, hit], vec![], &hint),
            });
        }
        let g = match taken {
            // One input: it is the result.
            None => cx.op_like("Identity", &[dy], vec![], &hint, y),
            Some(mask) => cx.op_like("Where", &[mask, dy, zero], vec![], &hint, y),
        };
        out[i] = Some(cx.unbroadcast(node, g, y, x)?);
    }
    Ok(out)
}

pub fn where_(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let dy = cx.dy(node, dys, 0)?;
    let y = cx.forward_output(node, 0)?;
    let c = cx.input(node, 0)?;
    let zero = cx.scalar_like(node, y, 0.0)?;
    let mut out = vec![None; 3];
    for (slot, branch) in [(1usize, true), (2, false)] {
        if wanted(wants, slot) {
            let x = cx.input(node, slot)?;
            let hint = format!("{}_grad", cx.model().name(x));
            let picked = if branch {
                cx.op_like("Where", &[c, dy, zero], vec![], &hint, y)
            } else {
                cx.op_like("Where", &[c, zero, dy], vec![], &hint, y)
            };
            out[slot] = Some(cx.unbroadcast(node, picked, y, x)?);
        }
    }
    Ok(out)
}

pub fn fmod(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    if cx.int_attr(node, "fmod", 0)? != 1 {
        return Err(cx.error(
            node,
            "Mod of floating-point values needs fmod = 1 (the ONNX rule); this node has fmod = 0"
                .into(),
        ));
    }
    let dy = cx.dy(node, dys, 0)?;
    let y = cx.forward_output(node, 0)?;
    let (a, b) = (cx.input(node, 0)?, cx.input(node, 1)?);
    binary(
        cx,
        node,
        wants,
        |_, _| Ok(dy),
        |cx, _| {
            let hint = name(cx, b);
            let whole = cx.op_like("Sub", &[a, y], vec![], &hint, y);
            let q = cx.op_like("Div", &[whole, b], vec![], &hint, y);
            let p = cx.op_like("Mul", &[dy, q], vec![], &hint, y);
            Ok(cx.op_like("Neg", &[p], vec![], &hint, y))
        },
    )
}
