//! Gradient ops that sum many terms, lowered in float32 when they meet half-precision values
//! (a model stored in half precision: `autodiff`'s `half_model`):
//!
//! ```text
//! dX, dW = ConvGrad(dY, X, W)        (float16)
//!   ->  dX32, dW32 = ConvGrad(Cast(dY), Cast(X), Cast(W))  (float32, then lowered)
//!       dX = Cast(dX32, to = float16), dW = Cast(dW32, to = float16)
//! ```
//!
//! The weight gradient of a convolution sums over the batch and every position, the
//! gradient of an embedding (GatherGrad) adds the rows of repeated indices with a
//! `ScatterND(reduction = add)`, and MaxPool's scatters each window's gradient to its maximum
//! with a `ScatterElements(reduction = add)`: in half, such sums lose their digits, which is why PyTorch's
//! autocast and the `precision` pass keep them float32, and ONNX Runtime's CPU provider has
//! no float16 scatter that adds at all (the run fails). The node's float inputs are cast to
//! float32 before it, its outputs back to their type after it (their readers and names stay),
//! and the lowering then sees float32.

use crate::ir::builder::{attr_int, Builder, NodeAttributes};
use crate::ir::{Model, NodeId, Use};
use crate::proto::elem::FLOAT;

use super::util::elem_type;

/// The ORT gradient ops lowered in float32, by (domain, op): ORT registers MaxPoolGrad, whose
/// lowering scatters the gradient back to each window's maximum, in the default domain.
const SUMMING: &[(&str, &str)] = &[
    ("com.microsoft", "ConvGrad"),
    ("com.microsoft", "GatherGrad"),
    ("com.microsoft", "GatherElementsGrad"),
    ("com.microsoft", "GatherNDGrad"),
    ("", "MaxPoolGrad"),
];

fn is_half(elem: Option<i32>) -> bool {
    elem.is_some_and(crate::passes::autodiff::half_model::is_half)
}

/// Whether `node` is a summing gradient op, or a scatter that adds (the gradient rules of
/// gathers and slices with steps, a Loop's sequence gradient), with a half-precision input.
pub fn takes(model: &Model, node: NodeId) -> bool {
    let n = model.node(node);
    let (domain, op) = (
        crate::ir::normalize_domain(n.proto.domain()),
        n.proto.op_type(),
    );
    let adds = domain.is_empty()
        && matches!(op, "ScatterND" | "ScatterElements")
        && n.proto
            .attr_string("reduction")
            .ok()
            .flatten()
            .is_some_and(|r| r != "none");
    (adds || SUMMING.contains(&(domain, op)))
        && n.inputs
            .iter()
            .flatten()
            .any(|v| is_half(elem_type(model, *v)))
}

/// Casts `node`'s half inputs to float32 and its half outputs back (see the module
/// comment); returns the nodes added.
pub fn widen(model: &mut Model, node: NodeId, stamp: &'static str) -> usize {
    let body = model.node(node).body;
    let inputs: Vec<(usize, crate::ir::ValueId)> = model
        .node(node)
        .inputs
        .iter()
        .enumerate()
        .filter_map(|(slot, v)| v.map(|v| (slot, v)))
        .filter(|(_, v)| is_half(elem_type(model, *v)))
        .collect();
    let outputs: Vec<(crate::ir::ValueId, i32)> = model
        .node(node)
        .outputs
        .iter()
        .flatten()
        .filter_map(|o| {
            elem_type(model, *o)
                .filter(|e| is_half(Some(*e)))
                .map(|e| (*o, e))
        })
        .collect();
    let mut b = Builder::new(model, body, stamp);
    for (slot, v) in inputs {
        let hint = format!("{}_float", b.model.name(v));
        let wide = b.op("Cast", &[v], vec![attr_int("to", FLOAT as i64)], &hint);
        b.model.set_input(node, slot, Some(wide));
        // The lowerings read shapes (a weight gradient needs W's).
        if let Some(ty) = b.model.value_type(v) {
            b.model.set_value_type(wide, with_elem(ty, FLOAT));
        }
    }
    for (o, elem) in outputs {
        let declared = b.model.value_type(o);
        let readers: Vec<Use> = b.model.uses(o).to_vec();
        let hint = format!("{}_narrow", b.model.name(o));
        let narrow = b.op("Cast", &[o], vec![attr_int("to", elem as i64)], &hint);
        for u in readers {
            match u {
                Use::Node { node, slot } => b.model.set_input(node, slot, Some(narrow)),
                Use::Output { body, index } => b.model.set_output(body, index, narrow),
            }
        }
        // The name (a parameter's gradient, a graph output) stays with the value it names.
        b.model.swap_names(o, narrow);
        if let Some(ty) = declared {
            b.model.set_value_type(o, with_elem(ty.clone(), FLOAT));
            b.model.set_value_type(narrow, ty);
        }
    }
    b.added
}

fn with_elem(mut ty: crate::proto::TypeProto, elem: i32) -> crate::proto::TypeProto {
    if let Some(crate::proto::type_proto::Value::TensorType(t)) = ty.value.as_mut() {
        t.elem_type = Some(elem);
    }
    ty
}
