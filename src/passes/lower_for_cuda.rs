//! What ONNX Runtime's CUDA provider has no kernel for in our steps, lowered to standard ops
//! it has, so that those nodes do not run on the CPU with copies around them every
//! micro-step. Applied in memory by [`crate::engine::ort::OrtSession`] for `--device cuda`
//! only; the step file keeps its standard form.
//!
//! Measured with onnxruntime-gpu 1.31.1 (its verbose log, `scripts/gpu-check.sh`'s probe):
//!
//! - `SoftmaxCrossEntropyLoss` and `NegativeLogLikelihoodLoss` have no CUDA kernel in any
//!   precision. On the CPU, the loss of a language model copies its logits, `[tokens,
//!   vocabulary]`, to the host and its log-probabilities back at every micro-step. Lowered
//!   by `legalize-ort`'s lowerings (`LogSoftmax`, `GatherElements`, reductions, with ONNX's
//!   weights and `ignore_index`), as for tract.
//! - `MaxUnpool` (what `legalize-ort` makes of MaxPool's gradient when the windows do not
//!   overlap) has none either: a `ScatterElements` into zeros, as for tract.
//!
//! Left to the CPU here: `Mish`, and `CastLike`, which the autodiff's normalisation already
//! turns into `Cast` where the type it copies is known (the dynamo exporter casts scalar
//! constants like an activation).

use std::borrow::Cow;

use super::legalize::LegalizeOrt;
use super::PassError;
use crate::proto::{GraphProto, ModelProto, NodeProto};

pub const PASS: &str = "lower-for-cuda";

/// Whether the CUDA provider lacks `op_type` of `domain`, and this pass lowers it.
fn cuda_lacks(node: &NodeProto) -> bool {
    crate::ir::normalize_domain(node.domain()).is_empty()
        && matches!(
            node.op_type(),
            "SoftmaxCrossEntropyLoss" | "NegativeLogLikelihoodLoss" | "MaxUnpool"
        )
}

fn graph_has(g: &GraphProto) -> bool {
    g.node.iter().any(|n| {
        cuda_lacks(n)
            || n.attribute
                .iter()
                .any(|a| a.g.as_ref().is_some_and(graph_has) || a.graphs.iter().any(graph_has))
    })
}

/// `model` with the ops above lowered (borrowed unchanged when it has none), its inputs,
/// outputs and metadata untouched.
pub fn prepare(model: &ModelProto) -> Result<Cow<'_, ModelProto>, PassError> {
    if !model.graph.as_ref().is_some_and(graph_has) {
        return Ok(Cow::Borrowed(model));
    }
    let lowerings = LegalizeOrt {
        sce: true,
        nll: true,
        max_unpool: true,
        ..LegalizeOrt::default()
    };
    let lowered = super::lowered_in_memory(model, PASS, |ir, state| {
        lowerings.lower_model(ir, PASS, state, None).map(|_| ())
    })?;
    Ok(Cow::Owned(lowered))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A torch MLP's step (autodiff, cross-entropy): its SoftmaxCrossEntropyLoss is
    /// lowered, the graph's interface does not change, and a model without such ops comes
    /// back as it is.
    #[test]
    fn lowers_the_loss_and_leaves_the_rest() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let path = root.join("graphs/forward/torch_mlp/dynamo.onnx");
        let graph = crate::signature::forward(crate::model::load_model(&path).unwrap(), &path);
        let step = crate::step::build_step(
            graph,
            "autodiff(loss_fn=cross-entropy),grad-accum(steps=2),optimizer(kind=sgd,lr=0.1),legalize-ort",
            false,
        )
        .unwrap();
        let model = step.model.to_proto();
        let ops = |m: &ModelProto| -> Vec<String> {
            let g = m.graph.as_ref().unwrap();
            g.node.iter().map(|n| n.op_type().to_string()).collect()
        };
        assert!(ops(&model).iter().any(|o| o == "SoftmaxCrossEntropyLoss"));
        let lowered = prepare(&model).unwrap();
        assert!(matches!(lowered, Cow::Owned(_)));
        let after = ops(&lowered);
        assert!(
            !after.iter().any(|o| o == "SoftmaxCrossEntropyLoss"),
            "{after:?}"
        );
        assert!(after.iter().any(|o| o == "LogSoftmax"), "{after:?}");
        let (g0, g1) = (
            model.graph.as_ref().unwrap(),
            lowered.graph.as_ref().unwrap(),
        );
        assert_eq!(g1.input, g0.input, "inputs untouched");
        assert_eq!(g1.output, g0.output, "outputs untouched");
        assert!(
            matches!(prepare(&lowered).unwrap(), Cow::Borrowed(_)),
            "nothing left"
        );
    }
}
