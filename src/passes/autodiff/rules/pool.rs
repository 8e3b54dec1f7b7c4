//! Pooling.
//!
//! ```text
//! MaxPool            dX = scatter-add of dY to the positions the forward picked
//!                         MaxPoolGrad(dY, Indices), Indices = the forward's second output
//! AveragePool        dX = ConvTranspose(dY / divisor, ones per channel; the forward geometry)
//!                         (every window spreads its gradient evenly over what it divided
//!                         by; a constant 1/|k| kernel when every window divides by |k|)
//! GlobalAveragePool  dX = Expand(dY, shape(X)) / (H·W)
//! ```

use super::{Grad, InputGrads};
use crate::ir::builder::{attr_int, attr_ints};
use crate::ir::{NodeId, ValueId};
use crate::passes::PassError;
use crate::proto::tensor_proto::DataType;

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
    if strides.len() != spatial
        || pads.len() != 2 * spatial
        || strides.iter().any(|s| *s < 1)
        || kernel.iter().any(|k| *k < 1)
        || pads.iter().any(|p| *p < 0)
    {
        return Err(cx.error(
            node,
            format!("attributes 'kernel_shape' = {kernel:?}, 'strides' = {strides:?} and 'pads' = {pads:?} do not fit a {spatial}-D kernel"),
        ));
    }
    let auto_pad = cx.string_attr(node, "auto_pad")?.unwrap_or_default();
    if !matches!(auto_pad.as_str(), "" | "NOTSET" | "VALID") {
        return Err(cx.error(
            node,
            format!("attribute 'auto_pad' = {auto_pad} is not supported by the gradient rule"),
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
    let ceil_mode = cx.int_attr(node, "ceil_mode", 0)? != 0;
    let count_include_pad = cx.int_attr(node, "count_include_pad", 0)? != 0;
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
    let sizes: Option<Vec<i64>> = dims[2..].iter().copied().collect();
    let (Some(c), Some(sizes)) = (dims.get(1).copied().flatten(), sizes) else {
        return Err(cx.error(
            node,
            format!(
                "the channel and spatial dims of '{}' must be known",
                cx.model().name(x)
            ),
        ));
    };
    let axes: Vec<PoolAxis> = (0..spatial)
        .map(|i| {
            PoolAxis::new(
                sizes[i],
                kernel[i],
                strides[i],
                (pads[i], pads[i + spatial]),
                ceil_mode,
            )
        })
        .collect::<Option<_>>()
        .ok_or_else(|| {
            cx.error(
                node,
                format!(
                    "the pooling windows of '{}' ({sizes:?}) are empty",
                    cx.model().name(x)
                ),
            )
        })?;
    let kernel_elements = axes.iter().map(|a| a.kernel).fold(c, i64::saturating_mul);
    let windows = axes.iter().map(|a| a.outputs).fold(1, i64::saturating_mul);
    if kernel_elements.max(windows) > super::MAX_CONSTANT_ELEMENTS {
        return Err(cx.error(
            node,
            format!(
                "its gradient's constants would hold {} elements (the {c} channels' kernels {kernel_elements}, the windows {windows}), more than {}",
                kernel_elements.max(windows),
                super::MAX_CONSTANT_ELEMENTS
            ),
        ));
    }
    let hint = format!("{}_grad", cx.model().name(x));
    // Every window divides by its full kernel: one constant 1/|k| kernel spreads dY back.
    let uniform = axes.iter().all(|a| {
        a.overhang() == 0 && (0..a.outputs).all(|o| a.divisor(o, count_include_pad) == a.kernel)
    });
    let (spread, scaled_dy) = if uniform {
        (
            1.0 / axes.iter().map(|a| a.kernel).product::<i64>() as f64,
            dy,
        )
    } else {
        // Windows of their own size (cut at the input by count_include_pad = 0, or at the
        // padded input by a ceil_mode window running past it): dY / divisor first, per
        // output position, then a kernel of ones spreads it.
        let out: Vec<i64> = axes.iter().map(|a| a.outputs).collect();
        let mut inverse = vec![1.0f64; out.iter().product::<i64>() as usize];
        for (flat, value) in inverse.iter_mut().enumerate() {
            let mut rest = flat as i64;
            for (i, a) in axes.iter().enumerate().rev() {
                let o = rest % out[i];
                rest /= out[i];
                // Only pads as wide as the kernel leave a window on padding alone (ONNX
                // Runtime refuses to load those); no division by zero for such a file.
                match a.divisor(o, count_include_pad) {
                    d if d > 0 => *value /= d as f64,
                    _ => {
                        return Err(cx.error(
                            node,
                            format!("window {o} of axis {} covers none of the input (pads {:?} against kernel {})", i + 2, a.pads, a.kernel),
                        ))
                    }
                }
            }
        }
        let shape = [&[1, 1][..], &out[..]].concat();
        let divisor = match elem {
            e if e == DataType::Double as i32 => cx.constant(
                &format!("{hint}_window_inverse"),
                crate::ir::builder::tensor_f64(&shape, &inverse),
            ),
            _ => cx.constant(
                &format!("{hint}_window_inverse"),
                crate::ir::builder::tensor_f32(
                    &shape,
                    &inverse.iter().map(|v| *v as f32).collect::<Vec<_>>(),
                ),
            ),
        };
        let scaled = cx.op_like(
            "Mul",
            &[dy, divisor],
            vec![],
            &format!("{hint}_per_window"),
            dy,
        );
        (1.0, scaled)
    };
    let kernel: Vec<i64> = axes.iter().map(|a| a.kernel).collect();
    let weight_len = (c * kernel.iter().product::<i64>()) as usize;
    let weight_shape = [&[c, 1][..], &kernel[..]].concat();
    // In the input's type: ConvTranspose takes one type (a half model's pooling is half).
    let weight = match crate::ir::emit::scalar_bytes(elem, spread) {
        Some(one) => crate::proto::TensorProto {
            dims: weight_shape.clone(),
            data_type: Some(elem),
            raw_data: Some(one.repeat(weight_len)),
            ..Default::default()
        },
        None => crate::ir::builder::tensor_f32(&weight_shape, &vec![spread as f32; weight_len]),
    };
    let w =
        cx.b.model
            .add_initializer(cx.b.body, &format!("{hint}_spread"), weight);
    // The transposed convolution's pads cut what it spreads outside the input: the padding,
    // and the part of a ceil_mode window that runs past it.
    let transposed_pads: Vec<i64> = axes
        .iter()
        .map(|a| a.pads.0)
        .chain(axes.iter().map(|a| a.pads.1 + a.overhang()))
        .collect();
    let output_padding: Vec<i64> = axes.iter().map(PoolAxis::uncovered).collect();
    let mut attrs = vec![
        attr_ints("kernel_shape", &kernel),
        attr_ints("strides", &strides),
        attr_ints("pads", &transposed_pads),
        attr_int("group", c),
    ];
    if output_padding.iter().any(|p| *p != 0) {
        attrs.push(attr_ints("output_padding", &output_padding));
    }
    let dx = cx.op_like("ConvTranspose", &[scaled_dy, w], attrs, &hint, x);
    Ok(vec![Some(dx)])
}

/// One spatial axis of an AveragePool: where its windows sit and what each divides by.
struct PoolAxis {
    size: i64,
    /// The kernel, cut to the padded input when one window covers it all (a global pool
    /// written as AveragePool with a kernel larger than the input, as EfficientNet's
    /// `AvgPool2d(1280, ceil_mode=True)` is).
    kernel: i64,
    stride: i64,
    pads: (i64, i64),
    outputs: i64,
}

impl PoolAxis {
    /// None when the axis has no window (`shapes::pool_windows` counts them).
    fn new(
        size: i64,
        kernel: i64,
        stride: i64,
        pads: (i64, i64),
        ceil_mode: bool,
    ) -> Option<PoolAxis> {
        let outputs =
            crate::passes::autodiff::shapes::pool_windows(size, kernel, stride, pads, ceil_mode)?;
        let padded = size + pads.0 + pads.1; // pool_windows checked that it fits
        let kernel = if outputs == 1 {
            kernel.min(padded)
        } else {
            kernel
        };
        Some(PoolAxis {
            size,
            kernel,
            stride,
            pads,
            outputs,
        })
    }

    /// What the window at output `o` divides by: the positions it covers of the padded input
    /// (count_include_pad = 1) or of the input itself.
    fn divisor(&self, o: i64, count_include_pad: bool) -> i64 {
        let start = o * self.stride - self.pads.0;
        let end = (start + self.kernel).min(self.size + self.pads.1);
        match count_include_pad {
            true => end - start,
            false => end.min(self.size) - start.max(0),
        }
    }

    /// How far the last window runs past the padded input (ceil_mode).
    fn overhang(&self) -> i64 {
        ((self.outputs - 1) * self.stride + self.kernel - (self.size + self.pads.0 + self.pads.1))
            .max(0)
    }

    /// The input positions after the last window (floor mode with a stride that does not
    /// divide the span): the transposed convolution's output_padding, to reach the size.
    fn uncovered(&self) -> i64 {
        (self.size + self.pads.0 + self.pads.1 - ((self.outputs - 1) * self.stride + self.kernel))
            .max(0)
    }
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
