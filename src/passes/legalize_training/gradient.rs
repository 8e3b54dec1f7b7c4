//! `ai.onnx.preview.training::Gradient(inputs) -> (dy/dx for x in xs)`, attributes `xs`,
//! `zs` (names of the differentiated graph's independent tensors) and `y` (the tensor
//! differentiated): the partial derivatives of `y` with respect to each tensor of `xs`,
//! evaluated at the node's inputs (the values of `xs` then `zs`).
//!
//! Lowering it means building the backward pass in standard ops: onnx-ga's reverse-mode
//! autodiff (`src/autodiff/`). Until that is wired in here, the op is an error naming the
//! node and what it differentiates.

use super::Lowering;
use crate::ir::builder::NodeAttributes;
use crate::ir::NodeId;
use crate::passes::PassError;

pub(super) fn lower_gradient(l: &mut Lowering<'_, '_>, node: NodeId) -> Result<(), PassError> {
    let proto = &l.model().node(node).proto;
    let y = proto
        .attr_string("y")
        .ok()
        .flatten()
        .unwrap_or_else(|| "?".into());
    let xs = proto
        .attr("xs")
        .map(|a| {
            a.strings
                .iter()
                .map(|s| String::from_utf8_lossy(s).into_owned())
                .collect::<Vec<_>>()
                .join(", ")
        })
        .unwrap_or_default();
    Err(l.error(
        node,
        format!(
            "Gradient (of '{y}' with respect to [{xs}]) needs onnx-ga's autodiff to build its \
             backward pass in standard ops, and the autodiff is not wired into legalize-training yet"
        ),
    ))
}
