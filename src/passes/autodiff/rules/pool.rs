//! Pooling.
//!
//! ```text
//! MaxPool            dX = scatter-add of dY to the positions the forward picked
//!                         MaxPoolGrad(dY, Indices), Indices = the forward's second output
//! AveragePool        dX = ConvTranspose(dY, 1/|k| per channel; the forward geometry)
//!                         (every window spreads its gradient evenly over its inputs)
//! GlobalAveragePool  dX = Expand(dY, shape(X)) / (H·W)
//! ```

use super::{Grad, InputGrads};
use crate::ir::builder::{attr_int, attr_ints};
use crate::ir::{NodeId, ValueId};
use crate::passes::PassError;

const POOL_ATTRS: &[&str] = &[
    "auto_pad",
    "ceil_mode",
    "dilations",
    "kernel_shape",
    "pads",
    "storage_order",
    "strides",
];

pub fn max_pool(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    // Indices (output 1) is int64 and carries no gradient: without dY the gradient is zero.
    let Some(dy) = dys.first().copied().flatten() else {
        return Ok(vec![None; wants.len()]);
    };
    let x = cx.input(node, 0)?;
    if cx.int_attr(node, "storage_order", 0)? != 0 {
        return Err(cx.error(
            node,
            "attribute 'storage_order' = 1 is not supported by the gradient rule".into(),
        ));
    }
    let y = cx.forward_output(node, 0)?;
    let hint = format!("{}_indices", cx.model().name(y));
    let indices = cx.b.model.ensure_node_output(node, 1, &hint);
    let f = cx.facts(y);
    cx.shapes.set(
        indices,
        super::super::shapes::Facts {
            elem: Some(crate::proto::tensor_proto::DataType::Int64 as i32),
            dims: f.dims,
        },
    );
    let attrs = cx.attrs_of(node, POOL_ATTRS);
    let dx_hint = format!("{}_grad", cx.model().name(x));
    let g = cx.b.node(
        "MaxPoolGrad",
        "",
        &[Some(dy), Some(indices)],
        &[&dx_hint],
        attrs,
    );
    let dx = cx.output_like(g, 0, x);
    Ok(vec![Some(dx)])
}

pub fn average_pool(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    let dy = cx.dy(node, dys, 0)?;
    let x = cx.input(node, 0)?;
    let elem = cx.elem(node, x)?;
    let kernel = cx
        .ints_attr(node, "kernel_shape")?
        .ok_or_else(|| cx.error(node, "attribute 'kernel_shape' is missing".into()))?;
    let spatial = kernel.len();
    let strides = cx.ints_attr(node, "strides")?.unwrap_or(vec![1; spatial]);
    let pads = cx.ints_attr(node, "pads")?.unwrap_or(vec![0; 2 * spatial]);
    if strides.len() != spatial || pads.len() != 2 * spatial || strides.iter().any(|s| *s < 1) {
        return Err(cx.error(
            node,
            format!("attributes 'strides' = {strides:?} and 'pads' = {pads:?} do not fit a {spatial}-D kernel"),
        ));
    }
    let auto_pad = cx.string_attr(node, "auto_pad")?.unwrap_or_default();
    if !matches!(auto_pad.as_str(), "" | "NOTSET" | "VALID") {
        return Err(cx.error(
            node,
            format!("attribute 'auto_pad' = {auto_pad} is not supported by the gradient rule"),
        ));
    }
    if cx.int_attr(node, "ceil_mode", 0)? != 0 {
        return Err(cx.error(
            node,
            "attribute 'ceil_mode' = 1 is not supported by the gradient rule".into(),
        ));
    }
    if cx
        .ints_attr(node, "dilations")?
        .is_some_and(|d| d.iter().any(|x| *x != 1))
    {
        return Err(cx.error(
            node,
            "dilated AveragePool is not supported by the gradient rule".into(),
        ));
    }
    let padded = pads.iter().any(|p| *p != 0);
    if padded && cx.int_attr(node, "count_include_pad", 0)? == 0 {
        return Err(cx.error(node, "padding with count_include_pad = 0 (a divisor per window) is not supported by the gradient rule".into()));
    }
    // Only C and the spatial dims matter; the batch may be symbolic.
    let dims: Vec<Option<i64>> = match cx.facts(x).dims.as_ref() {
        Some(d) if d.len() == spatial + 2 => d.iter().map(|d| d.known()).collect(),
        Some(d) => {
            return Err(cx.error(
                node,
                format!(
                    "'{}' has rank {} but the kernel is {spatial}-D",
                    cx.model().name(x),
                    d.len()
                ),
            ))
        }
        None => vec![None; spatial + 2],
    };
    let (Some(c), true) = (
        dims.get(1).copied().flatten(),
        dims[2..].iter().all(Option::is_some),
    ) else {
        return Err(cx.error(
            node,
            format!(
                "the channel and spatial dims of '{}' must be known",
                cx.model().name(x)
            ),
        ));
    };
    let count: i64 = kernel.iter().product();
    let weight_len = (c * count) as usize;
    let one_over = 1.0 / count as f64;
    let weight = match elem {
        x if x == crate::proto::tensor_proto::DataType::Double as i32 => {
            crate::ir::builder::tensor_f64(
                &[&[c, 1][..], &kernel[..]].concat(),
                &vec![one_over; weight_len],
            )
        }
        _ => crate::ir::builder::tensor_f32(
            &[&[c, 1][..], &kernel[..]].concat(),
            &vec![one_over as f32; weight_len],
        ),
    };
    let hint = format!("{}_grad", cx.model().name(x));
    let w =
        cx.b.model
            .add_initializer(cx.b.body, &format!("{hint}_spread"), weight);
    let output_padding: Vec<i64> = (0..spatial)
        .map(|i| {
            let h = dims[i + 2].unwrap_or(0);
            let (b, e) = (pads[i], pads[i + spatial]);
            (h + b + e - kernel[i]).rem_euclid(strides[i])
        })
        .collect();
    let mut attrs = vec![
        attr_ints("kernel_shape", &kernel),
        attr_ints("strides", &strides),
        attr_ints("pads", &pads),
        attr_int("group", c),
    ];
    if output_padding.iter().any(|p| *p != 0) {
        attrs.push(attr_ints("output_padding", &output_padding));
    }
    let dx = cx.op_like("ConvTranspose", &[dy, w], attrs, &hint, x);
    Ok(vec![Some(dx)])
}

pub fn global_average_pool(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    _: &[bool],
) -> Result<InputGrads, PassError> {
    let dy = cx.dy(node, dys, 0)?;
    let x = cx.input(node, 0)?;
    let y = cx.forward_output(node, 0)?;
    let hint = format!("{}_grad", cx.model().name(x));
    let scale = spatial_count(cx, node, x, y, &hint)?;
    let scaled = cx.op_like("Div", &[dy, scale], vec![], &hint, y);
    Ok(vec![Some(cx.expand_to(scaled, x, &hint))])
}

/// How many elements of `x` each element of `y` reduces: a constant when the dims are
/// known, else `Size(x) / Size(y)` computed at run time.
pub fn spatial_count(
    cx: &mut Grad<'_>,
    node: NodeId,
    x: ValueId,
    y: ValueId,
    hint: &str,
) -> Result<ValueId, PassError> {
    let elem = cx.elem(node, x)?;
    let (fx, fy) = (cx.facts(x), cx.facts(y));
    if let (Some(dx), Some(dy)) = (fx.dims.as_ref(), fy.dims.as_ref()) {
        if dx.len() == dy.len() {
            let mut count = Some(1i64);
            for (a, b) in dx.iter().zip(dy) {
                if a == b {
                    continue;
                }
                count = match (count, a.known(), b.known()) {
                    (Some(c), Some(a), Some(b)) if b != 0 && a % b == 0 => Some(c * (a / b)),
                    _ => None,
                };
            }
            if let Some(c) = count {
                return Ok(cx.scalar(elem, c as f64));
            }
        }
    }
    let sx = cx.op("Size", &[x], vec![], hint);
    let sy = cx.op("Size", &[y], vec![], hint);
    let n = cx.op("Div", &[sx, sy], vec![], hint);
    Ok(cx.op("Cast", &[n], vec![attr_int("to", elem as i64)], hint))
}
