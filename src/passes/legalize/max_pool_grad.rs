//! `MaxPoolGrad(dY, Indices) -> dX` (default domain, as ONNX Runtime registers it): every
//! element of dY goes to the element of X its window picked. `Indices` is the forward
//! MaxPool's second output: flat positions over all of X (`N·C·H·W`).
//!
//! ```text
//! dX = zeros(shape(X));  dX.flat[Indices.flat] += dY.flat
//!    = Reshape(ScatterElements(zeros[|X|], Reshape(Indices, [-1]), Reshape(dY, [-1]),
//!                              reduction=add), shape(X))
//! ```
//!
//! Overlapping windows (kernel > stride) can pick the same element, hence the adding
//! scatter. When no two windows overlap (every axis: `k <= s`, no dilation, no ceil_mode,
//! explicit or no padding), the indices are distinct and `MaxUnpool(dY, Indices, shape(X))`
//! is the same scatter in one node.
//!
//! The shape of X: `Shape(X)` of the MaxPool that produced `Indices` (a constant when X's
//! shape is fully declared); without that MaxPool in the graph, dX's declared shape, which
//! is also all that ONNX Runtime's kernel goes by.

use super::util::{dims, scatter_flat, ScatterNames};
use super::{node_error, Lowering};
use crate::ir::builder::{attr_int, attr_ints};
use crate::ir::{NodeId, ValueId};
use crate::passes::PassError;

pub(super) fn lower(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    let dy = l.input(node, 0)?;
    let indices = l.input(node, 1)?;
    if l.used_output(node, 0).is_none() {
        return Ok(());
    }
    let shape = x_shape(l, node, indices)?;

    let dx = if windows_are_disjoint(l, node)? {
        let mut attrs = vec![attr_ints(
            "kernel_shape",
            &l.ints_attr(node, "kernel_shape")?.unwrap_or_default(),
        )];
        for name in ["strides", "pads"] {
            if let Some(v) = l.ints_attr(node, name)? {
                attrs.push(attr_ints(name, &v));
            }
        }
        l.op("MaxUnpool", &[dy, indices, shape.value], attrs, "dX")
    } else {
        if l.onnx_opset() < 16 {
            return Err(l.unsupported(
                node,
                "kernel_shape",
                format!(
                    "overlapping windows in a model of default-domain opset {} (the adding scatter, ScatterElements reduction=add, needs opset 16)",
                    l.onnx_opset()
                ),
            ));
        }
        let elem = l.float_type(node, dy)?;
        let flat = l.int64s("flat", &[-1]);
        let size = match shape.size {
            Some(n) => l.int64s("size", &[n]),
            None => l.op(
                "ReduceProd",
                &[shape.value],
                vec![attr_int("keepdims", 1)],
                "size",
            ),
        };
        let names = ScatterNames {
            zeros: "zeros",
            indices: "indices_flat",
            values: "dY_flat",
            result: "dX_flat",
        };
        let scattered = scatter_flat(l, elem, flat, size, indices, dy, true, names);
        l.op("Reshape", &[scattered, shape.value], vec![], "dX")
    };
    l.replace(node, 0, dx);
    Ok(())
}

/// X's shape as a value, and its element count when static.
struct XShape {
    value: ValueId,
    size: Option<i64>,
}

fn x_shape(l: &mut Lowering<'_, '_>, node: NodeId, indices: ValueId) -> Result<XShape, PassError> {
    let model = l.model();
    let pool_input = model.producer(indices).and_then(|(pool, slot)| {
        let p = &model.node(pool).proto;
        (slot == 1
            && p.op_type() == "MaxPool"
            && crate::ir::normalize_domain(p.domain()).is_empty())
        .then(|| model.node(pool).inputs.first().copied().flatten())
        .flatten()
    });
    let static_dims =
        |v: ValueId| dims(model, v).and_then(|d| d.into_iter().collect::<Option<Vec<i64>>>());
    let declared = pool_input.and_then(static_dims).or_else(|| {
        let dx = model.node(node).outputs.first().copied().flatten()?;
        static_dims(dx)
    });
    match (declared, pool_input) {
        (Some(d), _) => Ok(XShape { size: Some(d.iter().product()), value: l.int64s("x_shape", &d) }),
        (None, Some(x)) => Ok(XShape { value: l.op("Shape", &[x], vec![], "x_shape"), size: None }),
        (None, None) => Err(node_error(
            l.model(),
            node,
            "the shape of X is unknown: Indices does not come from a MaxPool in this graph and dX's shape is not declared".into(),
        )),
    }
}

/// True when no element of X lies in two windows: each axis `k <= s` without dilation,
/// ceil_mode or auto_pad `SAME_*` (MaxUnpool takes no such attributes).
fn windows_are_disjoint(l: &Lowering<'_, '_>, node: NodeId) -> Result<bool, PassError> {
    let Some(kernel) = l.ints_attr(node, "kernel_shape")? else {
        return Err(l.unsupported(node, "kernel_shape", "an absent kernel_shape".into()));
    };
    let strides = l
        .ints_attr(node, "strides")?
        .unwrap_or_else(|| vec![1; kernel.len()]);
    let dilated = l
        .ints_attr(node, "dilations")?
        .is_some_and(|d| d.iter().any(|x| *x != 1));
    let auto_pad = l.string_attr(node, "auto_pad")?.unwrap_or_default();
    Ok(kernel.len() == strides.len()
        && kernel.iter().zip(&strides).all(|(k, s)| k <= s)
        && !dilated
        && l.int_attr(node, "ceil_mode", 0)? == 0
        && matches!(auto_pad.as_str(), "" | "NOTSET" | "VALID"))
}
