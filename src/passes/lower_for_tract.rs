//! `lower-for-tract`: lowers what tract-onnx (0.23) cannot run in our step graphs to
//! standard ops it has, reusing `legalize-ort`'s lowerings:
//!
//! - `SoftmaxCrossEntropyLoss` and `NegativeLogLikelihoodLoss` (forward): tract parses them
//!   but cannot type them ("Operator can not be made a TypedOp"); lowered to `LogSoftmax`,
//!   `GatherElements` and reductions with ONNX's semantics (weights, `ignore_index`);
//! - `BatchNormalization` (inference mode): tract runs it only with constant scale, bias,
//!   mean and variance, and in our steps they are parameters, or computed (the per-channel
//!   affine of the BatchNorm lowerings); lowered to `Mul` and `Add` per channel;
//! - `com.microsoft` `FusedMatMul` and `Gelu` (standard ONNX Runtime has them, tract does
//!   not): `Gemm`/`MatMul` with transposes, and the exact GELU from `Erf`.
//!
//! Anything else of `com.microsoft` is an error naming the node. The pass runs at the end of
//! a `rewrite --engine tract` pipeline, and `train --engine tract` applies it in memory to a
//! step written for ONNX Runtime ([`lower_model`]), so one step file serves both engines.

use super::legalize::LegalizeOrt;
use super::{Pass, PassContext, PassError, PassReport};
use crate::ir::Model;
use crate::proto::ModelProto;

pub const PASS: &str = "lower-for-tract";

#[derive(Clone, Debug, Default)]
pub struct LowerForTract;

impl LowerForTract {
    fn lowerings() -> LegalizeOrt {
        LegalizeOrt {
            fused_matmul: true,
            gelu: true,
            batch_norm: true,
            sce: true,
            nll: true,
        }
    }
}

impl Pass for LowerForTract {
    fn name(&self) -> &'static str {
        PASS
    }

    fn run(
        &mut self,
        model: &mut Model,
        cx: &mut PassContext<'_>,
    ) -> Result<PassReport, PassError> {
        Self::lowerings().lower_model(model, PASS, &mut cx.state, cx.apply.as_ref())
    }
}

/// Whether tract lacks an op of this domain and type that the pass lowers (or that nothing
/// can lower: any other `com.microsoft` op).
pub fn tract_lacks(domain: &str, op_type: &str) -> bool {
    match crate::ir::normalize_domain(domain) {
        "" => matches!(
            op_type,
            "SoftmaxCrossEntropyLoss" | "NegativeLogLikelihoodLoss" | "BatchNormalization"
        ),
        "com.microsoft" => true,
        _ => false,
    }
}

/// Whether `model` (its subgraphs included) holds an op that tract lacks.
pub fn needs_lowering(model: &ModelProto) -> bool {
    fn graph_needs(g: &crate::proto::GraphProto) -> bool {
        g.node.iter().any(|n| {
            tract_lacks(n.domain(), n.op_type())
                || n.attribute.iter().any(|a| {
                    a.g.as_ref().is_some_and(graph_needs) || a.graphs.iter().any(graph_needs)
                })
        })
    }
    model.graph.as_ref().is_some_and(graph_needs)
}

/// `model` with the ops tract lacks lowered, its inputs, outputs and metadata untouched.
pub fn lower_model(model: &ModelProto) -> Result<ModelProto, PassError> {
    let mut ir = Model::from_proto(model.clone());
    let mut state = Vec::new();
    LowerForTract::lowerings().lower_model(&mut ir, PASS, &mut state, None)?;
    if !state.is_empty() {
        return Err(PassError::Other {
            pass: PASS.into(),
            message: "the model still holds training-only ops: rewrite it first".into(),
        });
    }
    crate::ir::verify::verify(&ir).map_err(|errors| PassError::Verify {
        pass: PASS.into(),
        errors,
    })?;
    Ok(ir.to_proto())
}
