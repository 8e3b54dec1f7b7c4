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
//!   not): `Gemm`/`MatMul` with transposes, and the exact GELU from `Erf`;
//! - `MaxUnpool` (what `legalize-ort` makes of MaxPoolGrad when pooling windows do not
//!   overlap; tract has no MaxUnpool): a `ScatterElements` into zeros of the output shape;
//! - float16 `Gemm` (after the above, so a Gemm that `FusedMatMul` became is included):
//!   tract expands Gemm with float32 `alpha` and `beta` constants, so a half Gemm with a bias
//!   (or `alpha` ≠ 1) fails to type ("expected F16 got F32"); lowered to `Transpose`,
//!   `MatMul`, and `Mul`/`Add` by float16 constants (`legalize/gemm_half.rs`). Float32 Gemms
//!   stay (tract handles them), and with them fp16 steps (`precision(dtype=fp16)`) run on
//!   tract in half, Gemms included; tract has no bfloat16.
//!
//! Anything else of `com.microsoft` is an error naming the node. The pass runs at the end of
//! a `rewrite --engine tract` pipeline, and `train --engine tract` applies it in memory to a
//! step written for ONNX Runtime ([`lower_model`]), so one step file serves both engines.

use super::legalize::{self, LegalizeOrt};
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
            max_unpool: true,
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
        lower(model, &mut cx.state, cx.apply.as_ref())
    }
}

/// The pass's work: `legalize-ort`'s lowerings, then the float16 Gemms (among them those that
/// a float16 `FusedMatMul` became).
fn lower(
    model: &mut Model,
    state: &mut Vec<crate::state::StateEntry>,
    apply: Option<&crate::passes::apply::ApplyRegion>,
) -> Result<PassReport, PassError> {
    let mut report = LowerForTract::lowerings().lower_model(model, PASS, state, apply)?;
    let gemms = legalize::lower_half_gemms(model, PASS)?;
    report.changed |= gemms.changed;
    report.added += gemms.added;
    report.removed += gemms.removed;
    Ok(report)
}

/// Whether tract lacks an op of this domain and type that the pass lowers (or that nothing
/// can lower: any other `com.microsoft` op). `Gemm` is not among them: tract lacks only its
/// float16 form, which [`needs_lowering`] looks for.
pub fn tract_lacks(domain: &str, op_type: &str) -> bool {
    match crate::ir::normalize_domain(domain) {
        "" => matches!(
            op_type,
            "SoftmaxCrossEntropyLoss"
                | "NegativeLogLikelihoodLoss"
                | "BatchNormalization"
                | "MaxUnpool"
        ),
        "com.microsoft" => true,
        _ => false,
    }
}

/// Whether `model` (its subgraphs included) holds an op that tract lacks, or a float16
/// `Gemm`.
pub fn needs_lowering(model: &ModelProto) -> bool {
    fn graph_has(g: &crate::proto::GraphProto, f: fn(&crate::proto::NodeProto) -> bool) -> bool {
        g.node.iter().any(|n| {
            f(n) || n.attribute.iter().any(|a| {
                a.g.as_ref().is_some_and(|s| graph_has(s, f))
                    || a.graphs.iter().any(|s| graph_has(s, f))
            })
        })
    }
    let Some(g) = model.graph.as_ref() else {
        return false;
    };
    if graph_has(g, |n| tract_lacks(n.domain(), n.op_type())) {
        return true;
    }
    // A Gemm's element type may need a walk up its producers: ask the IR, only when there
    // is a Gemm at all.
    if !graph_has(g, |n| {
        n.op_type() == "Gemm" && crate::ir::normalize_domain(n.domain()).is_empty()
    }) {
        return false;
    }
    let ir = Model::from_proto(model.clone());
    let mut nodes = ir.all_nodes();
    nodes.any(|n| legalize::is_half_gemm(&ir, n))
}

/// `model` with the ops tract lacks lowered, its inputs, outputs and metadata untouched.
pub fn lower_model(model: &ModelProto) -> Result<ModelProto, PassError> {
    let mut ir = Model::from_proto(model.clone());
    let mut state = Vec::new();
    lower(&mut ir, &mut state, None)?;
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
