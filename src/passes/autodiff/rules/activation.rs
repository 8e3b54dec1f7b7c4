//! Activations. Where a function's derivative is cheapest in terms of its output, the rule
//! reads Y (no recomputation of the forward); ReLU, Sigmoid, Tanh, LeakyReLU and GELU use
//! ONNX Runtime's gradient ops, whose lowerings (`passes/legalize/*_grad.rs`) hold the math.
//!
//! ```text
//! Relu         dX = dY * (Y > 0)                       ReluGrad(dY, Y)
//! Sigmoid      dX = dY * Y * (1 - Y)                   SigmoidGrad(dY, Y)
//! Tanh         dX = dY * (1 - Y²)                      TanhGrad(dY, Y)
//! LeakyRelu    dX = dY * (Y > 0 ? 1 : alpha)           LeakyReluGrad(dY, Y)
//! Gelu         dX = dY * (Phi(X) + X phi(X))           GeluGrad(dY, X); tanh form: FastGeluGrad
//! Elu          dX = dY * (X > 0 ? 1 : Y + alpha)
//! HardSigmoid  dX = dY * (0 < Y < 1 ? alpha : 0)
//! HardSwish    dX = dY * (X < -3 ? 0 : X > 3 ? 1 : X/3 + 1/2)      (PyTorch's convention at ±3)
//! Softplus     dX = dY * sigmoid(X)
//! Clip         dX = dY * (min <= X <= max)             (both bounds inclusive, as PyTorch)
//! Softsign     dX = dY / (1 + |X|)²
//! Selu         dX = dY * (X > 0 ? gamma : Y + alpha gamma)
//! Celu         dX = dY * (X > 0 ? 1 : Y / alpha + 1)
//! ThresholdedRelu  dX = dY * (X > alpha)
//! Shrink       dX = dY * (X < -lambd or X > lambd)
//! Mish         dX = dY * (t + X sigmoid(X) (1 - t²)),   t = tanh(softplus(X))
//! Swish        dX = dY * (s + alpha X s (1 - s)),        s = sigmoid(alpha X)   (opset 24)
//! PRelu        dX = dY * (X > 0 ? 1 : slope)           dslope = dY * (X > 0 ? 0 : X), summed
//!                                                      back to the slope's shape
//! ```
//!
//! At a kink (X = 0, or X = ±lambd, or X = alpha) the rules take the derivative from the
//! side PyTorch takes: the side that is not the `X > 0` branch.

use super::{wanted, Grad, InputGrads, UnaryParts};
use crate::ir::builder::attr_float;
use crate::ir::{NodeId, ValueId};
use crate::passes::PassError;

/// `Op(dY, input)` of ONNX Runtime's training vocabulary, lowered by legalize-ort.
fn ort_grad(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    op: &str,
    with_x: bool,
    attrs: Vec<crate::proto::AttributeProto>,
) -> Result<InputGrads, PassError> {
    let UnaryParts { dy, x, y, hint } = cx.unary_parts(node, dys)?;
    let arg = if with_x { x } else { y };
    let n = cx.ort_op(op, &[Some(dy), Some(arg)], &[&hint], attrs);
    let dx = cx.output_like(n, 0, x);
    Ok(vec![Some(dx)])
}

pub fn relu(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    ort_grad(cx, node, dys, "ReluGrad", false, vec![])
}

pub fn sigmoid(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    ort_grad(cx, node, dys, "SigmoidGrad", false, vec![])
}

pub fn tanh(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    ort_grad(cx, node, dys, "TanhGrad", false, vec![])
}

pub fn leaky_relu(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    let alpha = cx.float_attr(node, "alpha", 0.01)?;
    if alpha <= 0.0 {
        // LeakyReluGrad reads the sign of Y, which is the sign of X only for alpha > 0.
        return Err(cx.error(
            node,
            format!("attribute 'alpha' = {alpha}: the gradient rule needs alpha > 0"),
        ));
    }
    ort_grad(
        cx,
        node,
        dys,
        "LeakyReluGrad",
        false,
        vec![attr_float("alpha", alpha)],
    )
}

pub fn gelu(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    let approximate = cx
        .string_attr(node, "approximate")?
        .unwrap_or_else(|| "none".into());
    match approximate.as_str() {
        "none" => ort_grad(cx, node, dys, "GeluGrad", true, vec![]),
        "tanh" => ort_grad(cx, node, dys, "FastGeluGrad", true, vec![]),
        other => Err(cx.error(
            node,
            format!("attribute 'approximate' = '{other}' is not supported"),
        )),
    }
}

pub fn elu(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    let alpha = cx.float_attr(node, "alpha", 1.0)? as f64;
    cx.by_slope(node, dys, |cx, x, y, h| {
        let zero = cx.scalar_like(node, x, 0.0)?;
        let one = cx.scalar_like(node, x, 1.0)?;
        let a = cx.scalar_like(node, x, alpha)?;
        let pos = cx.op("Greater", &[x, zero], vec![], h);
        let neg_slope = cx.op_like("Add", &[y, a], vec![], h, x);
        Ok(cx.op_like("Where", &[pos, one, neg_slope], vec![], h, x))
    })
}

pub fn hard_sigmoid(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    let alpha = cx.float_attr(node, "alpha", 0.2)? as f64;
    cx.by_slope(node, dys, |cx, x, y, h| {
        let zero = cx.scalar_like(node, x, 0.0)?;
        let one = cx.scalar_like(node, x, 1.0)?;
        let a = cx.scalar_like(node, x, alpha)?;
        let above = cx.op("Greater", &[y, zero], vec![], h);
        let below = cx.op("Less", &[y, one], vec![], h);
        let inside = cx.op("And", &[above, below], vec![], h);
        Ok(cx.op_like("Where", &[inside, a, zero], vec![], h, x))
    })
}

pub fn hard_swish(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    cx.by_slope(node, dys, |cx, x, _, h| {
        let zero = cx.scalar_like(node, x, 0.0)?;
        let one = cx.scalar_like(node, x, 1.0)?;
        let three = cx.scalar_like(node, x, 3.0)?;
        let minus_three = cx.scalar_like(node, x, -3.0)?;
        let third = cx.scalar_like(node, x, 1.0 / 3.0)?;
        let half = cx.scalar_like(node, x, 0.5)?;
        let x3 = cx.op_like("Mul", &[x, third], vec![], h, x);
        let mid = cx.op_like("Add", &[x3, half], vec![], h, x);
        let high = cx.op("Greater", &[x, three], vec![], h);
        let upper = cx.op_like("Where", &[high, one, mid], vec![], h, x);
        let low = cx.op("Less", &[x, minus_three], vec![], h);
        Ok(cx.op_like("Where", &[low, zero, upper], vec![], h, x))
    })
}

pub fn softplus(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    cx.by_slope(node, dys, |cx, x, _, h| {
        Ok(cx.op_like("Sigmoid", &[x], vec![], h, x))
    })
}

/// Y = min(max(X, lo), hi). dX flows where lo <= X <= hi (a tie gives X the gradient, as
/// torch's clamp does); a bound takes the summed dY of the elements it set: lo where
/// X < lo <= hi, hi where max(X, lo) > hi (when lo > hi, every element is hi). A learnable
/// bound is rare (PACT's clipping level); constant bounds never ask for their gradient.
pub fn clip(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let UnaryParts { dy, x, hint: h, .. } = cx.unary_parts(node, dys)?;
    let y = cx.forward_output(node, 0)?;
    // Opset < 11 has the bounds as attributes.
    let (lo, hi) = if cx.opset() < 11 {
        let lo = cx.float_attr(node, "min", f32::MIN)? as f64;
        let hi = cx.float_attr(node, "max", f32::MAX)? as f64;
        (
            Some(cx.scalar_like(node, x, lo)?),
            Some(cx.scalar_like(node, x, hi)?),
        )
    } else {
        (cx.opt_input(node, 1), cx.opt_input(node, 2))
    };
    let mut inside: Option<ValueId> = None;
    if let Some(lo) = lo {
        inside = Some(cx.op("GreaterOrEqual", &[x, lo], vec![], &h));
    }
    if let Some(hi) = hi {
        let le = cx.op("LessOrEqual", &[x, hi], vec![], &h);
        inside = Some(match inside {
            Some(i) => cx.op("And", &[i, le], vec![], &h),
            None => le,
        });
    }
    let Some(inside) = inside else {
        return Ok(vec![Some(dy)]);
    };
    let zero = cx.scalar_like(node, x, 0.0)?;
    let mut out = vec![None; wants.len()];
    out[0] = Some(cx.op_like("Where", &[inside, dy, zero], vec![], &h, x));
    if let (Some(lo), true) = (lo, wanted(wants, 1)) {
        let mut set_by_lo = cx.op("Less", &[x, lo], vec![], &h);
        if let Some(hi) = hi {
            let ordered = cx.op("LessOrEqual", &[lo, hi], vec![], &h);
            set_by_lo = cx.op("And", &[set_by_lo, ordered], vec![], &h);
        }
        let masked = cx.op_like("Where", &[set_by_lo, dy, zero], vec![], &h, x);
        out[1] = Some(cx.unbroadcast(node, masked, y, lo)?);
    }
    if let (Some(hi), true) = (hi, wanted(wants, 2)) {
        let raised = match lo {
            Some(lo) => cx.op_like("Max", &[x, lo], vec![], &h, x),
            None => x,
        };
        let set_by_hi = cx.op("Greater", &[raised, hi], vec![], &h);
        let masked = cx.op_like("Where", &[set_by_hi, dy, zero], vec![], &h, x);
        out[2] = Some(cx.unbroadcast(node, masked, y, hi)?);
    }
    Ok(out)
}

pub fn softsign(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    let UnaryParts { dy, x, hint: h, .. } = cx.unary_parts(node, dys)?;
    let one = cx.scalar_like(node, x, 1.0)?;
    let a = cx.op_like("Abs", &[x], vec![], &h, x);
    let d = cx.op_like("Add", &[a, one], vec![], &h, x);
    let d2 = cx.op_like("Mul", &[d, d], vec![], &h, x);
    Ok(vec![Some(cx.op_like("Div", &[dy, d2], vec![], &h, x))])
}

/// ONNX's defaults for Selu (the float32 values of the constants in Klambauer et al.).
const SELU_ALPHA: f32 = 1.673_263_2;
const SELU_GAMMA: f32 = 1.050_701;

pub fn selu(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    let alpha = cx.float_attr(node, "alpha", SELU_ALPHA)? as f64;
    let gamma = cx.float_attr(node, "gamma", SELU_GAMMA)? as f64;
    cx.by_slope(node, dys, |cx, x, y, h| {
        let zero = cx.scalar_like(node, x, 0.0)?;
        let g = cx.scalar_like(node, x, gamma)?;
        let ag = cx.scalar_like(node, x, alpha * gamma)?;
        let pos = cx.op("Greater", &[x, zero], vec![], h);
        let neg_slope = cx.op_like("Add", &[y, ag], vec![], h, x);
        Ok(cx.op_like("Where", &[pos, g, neg_slope], vec![], h, x))
    })
}

pub fn celu(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    let alpha = cx.float_attr(node, "alpha", 1.0)? as f64;
    if alpha == 0.0 {
        return Err(cx.error(node, "attribute 'alpha' = 0: Celu is undefined".into()));
    }
    cx.by_slope(node, dys, |cx, x, y, h| {
        let zero = cx.scalar_like(node, x, 0.0)?;
        let one = cx.scalar_like(node, x, 1.0)?;
        let a = cx.scalar_like(node, x, alpha)?;
        let pos = cx.op("Greater", &[x, zero], vec![], h);
        let q = cx.op_like("Div", &[y, a], vec![], h, x);
        let neg_slope = cx.op_like("Add", &[q, one], vec![], h, x);
        Ok(cx.op_like("Where", &[pos, one, neg_slope], vec![], h, x))
    })
}

/// `dX = dY` where `pass` holds, else 0.
fn pass_where(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    pass: impl FnOnce(&mut Grad<'_>, ValueId, &str) -> Result<ValueId, PassError>,
) -> Result<InputGrads, PassError> {
    let UnaryParts { dy, x, hint: h, .. } = cx.unary_parts(node, dys)?;
    let keep = pass(cx, x, &h)?;
    let zero = cx.scalar_like(node, x, 0.0)?;
    Ok(vec![Some(cx.op_like(
        "Where",
        &[keep, dy, zero],
        vec![],
        &h,
        x,
    ))])
}

pub fn thresholded_relu(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    let alpha = cx.float_attr(node, "alpha", 1.0)? as f64;
    pass_where(cx, node, dys, |cx, x, h| {
        let a = cx.scalar_like(node, x, alpha)?;
        Ok(cx.op("Greater", &[x, a], vec![], h))
    })
}

pub fn shrink(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    let lambd = cx.float_attr(node, "lambd", 0.5)? as f64;
    pass_where(cx, node, dys, |cx, x, h| {
        let hi = cx.scalar_like(node, x, lambd)?;
        let lo = cx.scalar_like(node, x, -lambd)?;
        let above = cx.op("Greater", &[x, hi], vec![], h);
        let below = cx.op("Less", &[x, lo], vec![], h);
        Ok(cx.op("Or", &[above, below], vec![], h))
    })
}

pub fn mish(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    cx.by_slope(node, dys, |cx, x, _, h| {
        // Y = X t, so t = Y / X, but not at X = 0: recompute t.
        let sp = cx.op_like("Softplus", &[x], vec![], h, x);
        let t = cx.op_like("Tanh", &[sp], vec![], h, x);
        let one = cx.scalar_like(node, x, 1.0)?;
        let t2 = cx.op_like("Mul", &[t, t], vec![], h, x);
        let sech2 = cx.op_like("Sub", &[one, t2], vec![], h, x);
        let s = cx.op_like("Sigmoid", &[x], vec![], h, x);
        let xs = cx.op_like("Mul", &[x, s], vec![], h, x);
        let tail = cx.op_like("Mul", &[xs, sech2], vec![], h, x);
        Ok(cx.op_like("Add", &[t, tail], vec![], h, x))
    })
}

pub fn swish(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    let alpha = cx.float_attr(node, "alpha", 1.0)? as f64;
    cx.by_slope(node, dys, |cx, x, _, h| {
        // Y = X s, so s = Y / X, but not at X = 0: recompute s.
        let a = cx.scalar_like(node, x, alpha)?;
        let ax = cx.op_like("Mul", &[a, x], vec![], h, x);
        let s = cx.op_like("Sigmoid", &[ax], vec![], h, x);
        let one = cx.scalar_like(node, x, 1.0)?;
        let rest = cx.op_like("Sub", &[one, s], vec![], h, x);
        let axs = cx.op_like("Mul", &[ax, s], vec![], h, x);
        let tail = cx.op_like("Mul", &[axs, rest], vec![], h, x);
        Ok(cx.op_like("Add", &[s, tail], vec![], h, x))
    })
}

pub fn prelu(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let UnaryParts { dy, x, y, hint: h } = cx.unary_parts(node, dys)?;
    let slope = cx.input(node, 1)?;
    let zero = cx.scalar_like(node, x, 0.0)?;
    let pos = cx.op("Greater", &[x, zero], vec![], &h);
    let mut out = vec![None, None];
    if wanted(wants, 0) {
        let scaled = cx.op_like("Mul", &[dy, slope], vec![], &h, y);
        out[0] = Some(cx.op_like("Where", &[pos, dy, scaled], vec![], &h, x));
    }
    if wanted(wants, 1) {
        let hs = format!("{}_grad", cx.model().name(slope));
        let dyx = cx.op_like("Mul", &[dy, x], vec![], &hs, y);
        let g = cx.op_like("Where", &[pos, zero, dyx], vec![], &hs, y);
        out[1] = Some(cx.unbroadcast(node, g, y, slope)?);
    }
    Ok(out)
}
