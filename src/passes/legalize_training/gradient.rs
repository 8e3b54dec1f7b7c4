//! `ai.onnx.preview.training::Gradient(inputs) -> (dy/dx for x in xs)`, attributes `xs`,
//! `zs` (names of the differentiated graph's independent tensors) and `y` (the tensor
//! differentiated): the partial derivatives of `y` with respect to each tensor of `xs`,
//! evaluated at the node's inputs (the values of `xs` then `zs`).
//!
//! ```text
//! dy/dx_i = backward(y, seed = ones like y)   for each x_i in xs
//! ```
//!
//! Built by onnx-ga's reverse-mode autodiff (`passes/autodiff`), in standard ops. The
//! node's inputs must be the tensors `xs` and `zs` name (the layout of the ONNX examples:
//! the gradient at the graph's current values); `y` must depend on them in the graph.

use super::Lowering;
use crate::ir::builder::{attr_tensor, NodeAttributes};
use crate::ir::{BodyId, NodeId};
use crate::passes::autodiff::shapes::Shapes;
use crate::passes::PassError;
use crate::proto::TensorProto;

fn strings(l: &Lowering<'_, '_>, node: NodeId, name: &str) -> Vec<String> {
    l.model()
        .node(node)
        .proto
        .attr(name)
        .map(|a| {
            a.strings
                .iter()
                .map(|s| String::from_utf8_lossy(s).into_owned())
                .collect()
        })
        .unwrap_or_default()
}

pub(super) fn lower_gradient(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    let y_name = l
        .model()
        .node(node)
        .proto
        .attr_string("y")
        .map_err(|m| l.error(node, m))?
        .ok_or_else(|| l.error(node, "required attribute 'y' is missing".into()))?;
    let xs = strings(l, node, "xs");
    let zs = strings(l, node, "zs");
    if xs.is_empty() {
        return Err(l.error(node, "attribute 'xs' names no tensor".into()));
    }
    let main = BodyId::MAIN;
    let find = |l: &Lowering<'_, '_>, name: &str| {
        l.model()
            .lookup(main, name)
            .ok_or_else(|| l.error(node, format!("'{name}' names no tensor of the graph")))
    };
    let y = find(l, &y_name)?;
    let x_values = xs
        .iter()
        .map(|n| find(l, n))
        .collect::<Result<Vec<_>, _>>()?;
    // The node is evaluated at its inputs; we support them being the named tensors.
    let inputs: Vec<_> = l.model().node(node).inputs.clone();
    let expected: Vec<_> = xs
        .iter()
        .chain(&zs)
        .map(|n| l.model().lookup(main, n))
        .collect();
    if inputs.len() != expected.len() || inputs.iter().zip(&expected).any(|(i, e)| i != e) {
        return Err(l.error(
            node,
            "the inputs must be the tensors named by 'xs' then 'zs' (other evaluation points are not supported)".into(),
        ));
    }
    let model = &mut *l.b.model;
    let mut shapes = Shapes::infer(model);
    let elem = shapes.get(y).elem.ok_or_else(|| {
        crate::passes::autodiff::rules::node_error(
            model,
            node,
            format!("the type of '{y_name}' is unknown"),
        )
    })?;
    // Seed: ones shaped like y.
    let mut b = crate::ir::builder::Builder::new(model, main, crate::passes::autodiff::PASS);
    let shape = b.op("Shape", &[y], vec![], &format!("{y_name}_shape"));
    let one = TensorProto {
        data_type: Some(elem),
        dims: vec![1],
        raw_data: Some(match elem {
            11 => 1f64.to_le_bytes().to_vec(),
            _ => 1f32.to_le_bytes().to_vec(),
        }),
        ..Default::default()
    };
    let seed = b.op(
        "ConstantOfShape",
        &[shape],
        vec![attr_tensor("value", one)],
        &format!("{y_name}_grad_seed"),
    );
    let f = shapes.get(y);
    shapes.set(seed, f);
    let grads = crate::passes::autodiff::backward(model, &mut shapes, y, seed, &x_values)?;
    for (slot, g) in grads.into_iter().enumerate() {
        if let Some(Some(out)) = model.node(node).outputs.get(slot).copied() {
            model.replace_value(out, g);
        }
    }
    crate::passes::autodiff::lower_gradient_ops(model)
}
