//! Facts about operators: which ones only ONNX Runtime's (deprecated) training build has.

/// Ops emitted by ONNX Runtime's training tooling (gradient builder, optimizers, loss
/// blocks) that the standard ONNX Runtime 1.31 build does not register. The first 14 were
/// measured on our generated graphs (DESIGN.md section 6); the rest come from ORT's
/// training op definitions.
const TRAINING_ONLY: &[(&str, &str)] = &[
    ("com.microsoft", "InPlaceAccumulatorV2"),
    ("com.microsoft", "ReluGrad"),
    ("com.microsoft", "SigmoidGrad"),
    ("com.microsoft", "GeluGrad"),
    ("com.microsoft", "SoftmaxGrad_13"),
    ("com.microsoft", "Scale"),
    ("com.microsoft", "SoftmaxCrossEntropyLossGrad"),
    ("com.microsoft", "LayerNormalizationGrad"),
    ("com.microsoft", "ConvGrad"),
    ("com.microsoft", "BatchNormInternal"),
    ("com.microsoft", "BatchNormalizationGrad"),
    ("com.microsoft", "AdamWOptimizer"),
    ("com.microsoft", "SGDOptimizerV2"),
    ("", "MaxPoolGrad"),
    ("", "AveragePoolGrad"),
    ("com.microsoft", "InPlaceAccumulator"),
    ("com.microsoft", "ZeroGradient"),
    ("com.microsoft", "TanhGrad"),
    ("com.microsoft", "FastGeluGrad"),
    ("com.microsoft", "BiasGeluGrad_dX"),
    ("com.microsoft", "BiasFastGeluGrad_dX"),
    ("com.microsoft", "QuickGeluGrad"),
    ("com.microsoft", "LeakyReluGrad"),
    ("com.microsoft", "SoftmaxGrad"),
    ("com.microsoft", "LogSoftmaxGrad"),
    ("com.microsoft", "LogSoftmaxGrad_13"),
    ("com.microsoft", "SoftmaxCrossEntropyLossInternal"),
    ("com.microsoft", "SoftmaxCrossEntropyLossInternalGrad"),
    ("com.microsoft", "SoftmaxCrossEntropyGrad"),
    ("com.microsoft", "SparseSoftmaxCrossEntropyGrad"),
    ("com.microsoft", "ConvTransposeGrad"),
    ("com.microsoft", "SimplifiedLayerNormalizationGrad"),
    ("com.microsoft", "InvertibleLayerNormalizationGrad"),
    ("com.microsoft", "DropoutGrad"),
    ("com.microsoft", "BitmaskDropoutGrad"),
    ("com.microsoft", "GatherGrad"),
    ("com.microsoft", "GatherElementsGrad"),
    ("com.microsoft", "GatherNDGrad"),
    ("com.microsoft", "ReduceSumTraining"),
    ("com.microsoft", "SliceGrad"),
    ("com.microsoft", "SplitTraining"),
    ("com.microsoft", "ConcatTraining"),
    ("com.microsoft", "BroadcastGradientArgs"),
    ("com.microsoft", "AdamOptimizer"),
    ("com.microsoft", "SGDOptimizer"),
    ("com.microsoft", "LambOptimizer"),
    ("com.microsoft", "InplaceClipGradNorm"),
    ("com.microsoft", "YieldOp"),
    ("com.microsoft", "PythonOp"),
    ("com.microsoft", "PythonOpGrad"),
];

/// True when standard (non-training) ONNX Runtime cannot run `domain::op_type`.
pub fn is_training_only(domain: &str, op_type: &str) -> bool {
    let domain = crate::ir::normalize_domain(domain);
    TRAINING_ONLY
        .iter()
        .any(|(d, o)| *d == domain && *o == op_type)
}
