//! The ReLU gradient on onnx-ga's `ReluGrad` kernel, in memory, for an ONNX Runtime
//! session: `Mul(dY, Cast(Greater(Y, 0), to float))`, the lowering of
//! `passes/legalize/relu_grad.rs`, becomes `ReluGrad(dY, Y)`: one pass instead of three,
//! and no masks ([`crate::fused_ops`] has what it computes). The step file is never
//! rewritten: it stays standard ONNX. Bit-identical: the kernel makes the same product.
//!
//! Matched: the types need no facts, the graph's validity gives them (the mask is cast to
//! float32 and multiplies dY, and Greater compares Y with a float32 zero). A ReLU's
//! gradient has Y's shape; where a model's own mask broadcasts, the kernel broadcasts as
//! the Mul did. A mask something else also reads keeps its nodes.

use super::autodiff::shapes::constant_f32;
use crate::fused_ops::{DOMAIN, RELU_GRAD};
use crate::ir::builder::{Builder, NodeAttributes};
use crate::ir::{normalize_domain, BodyId, Model, NodeId, ValueId};
use crate::proto::{tensor_proto::DataType, ModelProto};

pub const PASS: &str = "fused-relu-grad";

/// A session's model with its ReLU gradients on the fused kernel.
pub struct Rewritten {
    pub model: ModelProto,
    /// ReLU gradients rewritten.
    pub relu_grads: usize,
}

/// `model` with every ReLU gradient the module's pattern matches on `ReluGrad`; `None`
/// when none is.
pub fn rewrite(model: &ModelProto) -> Result<Option<Rewritten>, super::PassError> {
    if !super::has_op(model, "Greater") {
        return Ok(None);
    }
    let mut ir = Model::from_proto(model.clone());
    let found: Vec<(NodeId, ValueId, ValueId)> = ir
        .body_nodes(BodyId::MAIN)
        .filter_map(|n| masked_product(&ir, n).map(|(dy, y)| (n, dy, y)))
        .collect();
    if found.is_empty() {
        return Ok(None);
    }
    for &(mul, dy, y) in &found {
        let dx = ir.output(mul, 0);
        let hint = format!("{}.fused", ir.name(dx));
        let node = Builder::new(&mut ir, BodyId::MAIN, PASS).node(
            RELU_GRAD,
            DOMAIN,
            &[Some(dy), Some(y)],
            &[&hint],
            vec![],
        );
        let fused = ir.output(node, 0);
        ir.replace_value(dx, fused);
    }
    Ok(Some(Rewritten {
        model: super::finish_in_memory(ir, PASS)?,
        relu_grads: found.len(),
    }))
}

/// `Mul(dY, Cast(Greater(Y, 0), to float))`: `(dY, Y)`.
fn masked_product(model: &Model, mul: NodeId) -> Option<(ValueId, ValueId)> {
    let dy = standard(model, mul, "Mul", 2)?;
    let mask = model.node(mul).inputs[1]?;
    let (cast, 0) = model.producer(mask)? else {
        return None;
    };
    standard(model, cast, "Cast", 1)?;
    if model.node(cast).proto.attr_int("to").ok()? != Some(DataType::Float as i64) {
        return None;
    }
    let (greater, 0) = model.producer(model.node(cast).inputs[0]?)? else {
        return None;
    };
    let y = standard(model, greater, "Greater", 2)?;
    let zero = model.node(greater).inputs[1]?;
    (constant_f32(model, zero) == Some(0.0)).then_some((dy, y))
}

/// The node's first input when it is `op` of the standard domain in the main graph, with
/// `arity` inputs all present and one output.
fn standard(model: &Model, n: NodeId, op: &str, arity: usize) -> Option<ValueId> {
    let node = model.node(n);
    let ok = node.proto.op_type() == op
        && normalize_domain(node.proto.domain()).is_empty()
        && node.body == BodyId::MAIN
        && node.inputs.len() == arity
        && node.inputs.iter().all(Option::is_some)
        && node.outputs.len() == 1;
    ok.then(|| node.inputs[0]).flatten()
}
