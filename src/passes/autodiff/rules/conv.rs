//! Convolution: `Y = Conv(X, W, B)` with any strides, pads, dilations and groups.
//!
//! ```text
//! dB = ReduceSum(dY, all axes but 1)
//! dX = ConvTranspose(dY, W)  with the forward geometry
//! dW = correlation of X with dY (stride and dilation swap roles)
//! ```
//!
//! All three come from one `ConvGrad(dY, X, W)` carrying the forward attributes, the op
//! ONNX Runtime's gradient builder emits; its lowering (`passes/legalize/conv_grad.rs`)
//! picks the standard-op formulation per case and computes only the outputs in use.
//!
//! Transposed convolution: `Y = ConvTranspose(X, W, B)`, W `[C_in, C_out/G, k..]`, is the
//! adjoint of `Z ↦ Conv(Z, W)` with the same strides, pads, dilations and groups (that Conv
//! maps C_out channels to C_in with the same W, read as `[M = C_in, C/G = C_out/G, k..]`):
//! per spatial axis `Y[o, s·i + d·k - b] += X[c, i] · W[c, o, k]`, the rows past the pads
//! cropped, `output_padding` r rows at the end that no X reaches. So
//!
//! ```text
//! dB = ReduceSum(dY, all axes but 1)
//! dX = Conv(dY, W; strides s, pads [b, e], dilations d, group G)
//!      (its output has (Y + b + e - span) div s + 1 = X rows: Y + b + e - span = s(X-1) + r,
//!       r < s; the rows it reads are exactly the rows the forward wrote, pads are zeros)
//! dW[c, o, k] = Σ_n,i X[n, c, i] · dY[n, o, s·i + d·k - b]
//!      = the weight gradient of that Conv with input dY and output gradient X:
//!        output 1 of ConvGrad(X, dY, W) with the forward geometry
//! ```
//!
//! Not covered (an error naming the node): `auto_pad` SAME_*, an `output_shape` attribute
//! (both leave the split of the padding to the implementation), `output_padding` >= stride.

use super::{wanted, Grad, InputGrads};
use crate::ir::emit::Emit;
use crate::ir::{NodeId, ValueId};
use crate::passes::PassError;

const CONV_ATTRS: &[&str] = &[
    "auto_pad",
    "dilations",
    "group",
    "kernel_shape",
    "pads",
    "strides",
];

fn grad_hints(cx: &Grad<'_>, node: NodeId, none: &str) -> Vec<String> {
    (0..3)
        .map(|i| match cx.opt_input(node, i) {
            Some(v) => format!("{}_grad", cx.model().name(v)),
            None => none.to_string(),
        })
        .collect()
}

pub fn conv(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let dy = cx.dy(node, dys, 0)?;
    let (x, w) = (cx.input(node, 0)?, cx.input(node, 1)?);
    let attrs = cx.attrs_of(node, CONV_ATTRS);
    let hints = grad_hints(cx, node, "conv_bias_grad");
    let hint_refs: Vec<&str> = hints.iter().map(String::as_str).collect();
    let g = cx.ort_op("ConvGrad", &[Some(dy), Some(x), Some(w)], &hint_refs, attrs);
    let mut out = vec![None; wants.len()];
    // ConvGrad has three outputs (dX, dW, dB); Conv has no fourth input to want.
    for (slot, want) in wants.iter().enumerate().take(3) {
        if *want {
            let like = cx.input(node, slot)?;
            out[slot] = Some(cx.output_like(g, slot, like));
        }
    }
    Ok(out)
}

pub fn conv_transpose(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let dy = cx.dy(node, dys, 0)?;
    let (x, w) = (cx.input(node, 0)?, cx.input(node, 1)?);
    let auto_pad = cx.string_attr(node, "auto_pad")?.unwrap_or_default();
    if !matches!(auto_pad.as_str(), "" | "NOTSET" | "VALID") {
        return Err(cx.error(
            node,
            format!("attribute 'auto_pad' = {auto_pad} is not supported by the gradient rule (give explicit pads)"),
        ));
    }
    if cx.ints_attr(node, "output_shape")?.is_some() {
        return Err(cx.error(
            node,
            "attribute 'output_shape' is not supported by the gradient rule (give pads and output_padding)".into(),
        ));
    }
    let rank = cx.need_rank(node, x)?;
    let Some(spatial) = rank.checked_sub(2).filter(|s| *s > 0) else {
        return Err(cx.error(
            node,
            format!(
                "'{}' has rank {rank}; ConvTranspose needs at least one spatial axis",
                cx.model().name(x)
            ),
        ));
    };
    let per_axis = |cx: &Grad<'_>, name: &str, default: i64| -> Result<Vec<i64>, PassError> {
        match cx.ints_attr(node, name)? {
            None => Ok(vec![default; spatial]),
            Some(v) if v.len() == spatial => Ok(v),
            Some(v) => Err(cx.error(
                node,
                format!("attribute '{name}' = {v:?} does not have one value per spatial axis ({spatial})"),
            )),
        }
    };
    let strides = per_axis(cx, "strides", 1)?;
    let output_padding = per_axis(cx, "output_padding", 0)?;
    if let Some(i) = (0..spatial).find(|i| output_padding[*i] >= strides[*i]) {
        return Err(cx.error(
            node,
            format!(
                "output_padding {} >= stride {} on spatial axis {i} is not supported by the gradient rule",
                output_padding[i], strides[i]
            ),
        ));
    }
    let attrs = cx.attrs_of(node, CONV_ATTRS);
    let hints = grad_hints(cx, node, "conv_transpose_bias_grad");
    let mut out = vec![None; wants.len()];
    if wanted(wants, 0) {
        let dx = cx.op_like("Conv", &[dy, w], attrs.clone(), &hints[0], x);
        out[0] = Some(dx);
    }
    if wanted(wants, 1) {
        // Outputs 0 and 2 of this ConvGrad stay unused; its lowering builds only dW.
        let unused = [
            format!("{}_unused_dx", hints[1]),
            format!("{}_unused_db", hints[1]),
        ];
        let g = cx.ort_op(
            "ConvGrad",
            &[Some(x), Some(dy), Some(w)],
            &[&unused[0], &hints[1], &unused[1]],
            attrs,
        );
        let dw = cx.output_like(g, 1, w);
        out[1] = Some(dw);
    }
    if wanted(wants, 2) {
        let b = cx.input(node, 2)?;
        let axes: Vec<i64> = std::iter::once(0).chain(2..rank as i64).collect();
        let db = cx.reduce("ReduceSum", dy, &axes, false, &hints[2]);
        let f = cx.facts(b);
        cx.shapes.set(db, f);
        out[2] = Some(db);
    }
    Ok(out)
}
