//! Facts about operators, one table each: which ones only ONNX Runtime's (deprecated)
//! training build has, and which `com.microsoft` contrib ops the standard build runs.

/// Ops that ONNX Runtime's training tooling emits (the gradient builder, the optimizer and
/// accumulation graphs of on-device training, the training graph transformers, ORTModule)
/// and that the standard ONNX Runtime 1.31.1 build does not register: each was checked by
/// loading a one-node model into a standard 1.31.1 session. Sources: onnxruntime's
/// `orttraining/orttraining/core/graph/gradient_builder.cc`, `gradient_builder_base.cc`
/// and `training_op_defs.cc`. docs/legalize-ops.md lists them with the forward op each
/// comes from and whether `legalize-ort` lowers it.
const TRAINING_ONLY: &[(&str, &str)] = &[
    // Activation gradients.
    ("com.microsoft", "ReluGrad"),
    ("com.microsoft", "SigmoidGrad"),
    ("com.microsoft", "TanhGrad"),
    ("com.microsoft", "LeakyReluGrad"),
    ("com.microsoft", "GeluGrad"),
    ("com.microsoft", "FastGeluGrad"),
    ("com.microsoft", "BiasGeluGrad_dX"),
    ("com.microsoft", "BiasFastGeluGrad_dX"),
    ("com.microsoft", "QuickGeluGrad"),
    // Softmax and losses.
    ("com.microsoft", "SoftmaxGrad"),
    ("com.microsoft", "SoftmaxGrad_13"),
    ("com.microsoft", "LogSoftmaxGrad"),
    ("com.microsoft", "LogSoftmaxGrad_13"),
    ("com.microsoft", "SoftmaxCrossEntropyLossGrad"),
    ("com.microsoft", "SoftmaxCrossEntropyLossInternal"),
    ("com.microsoft", "SoftmaxCrossEntropyLossInternalGrad"),
    ("com.microsoft", "NegativeLogLikelihoodLossInternal"),
    ("com.microsoft", "NegativeLogLikelihoodLossInternal2"),
    ("com.microsoft", "SoftmaxCrossEntropy"),
    ("com.microsoft", "SoftmaxCrossEntropyGrad"),
    ("", "SparseSoftmaxCrossEntropy"),
    ("", "SparseSoftmaxCrossEntropyGrad"),
    ("com.microsoft", "BiasSoftmaxDropout"),
    ("com.microsoft", "SoftmaxDropoutGrad"),
    // Normalisation.
    ("com.microsoft", "LayerNormalizationGrad"),
    ("com.microsoft", "SimplifiedLayerNormalizationGrad"),
    ("com.microsoft", "InvertibleLayerNormalizationGrad"),
    ("com.microsoft", "BatchNormInternal"),
    ("com.microsoft", "BatchNormalizationGrad"),
    // Convolution and pooling.
    ("com.microsoft", "ConvGrad"),
    ("com.microsoft", "ConvTransposeGrad"),
    ("", "MaxPoolGrad"),
    ("", "AveragePoolGrad"),
    ("com.microsoft", "ResizeGrad"),
    // Dropout.
    ("com.microsoft", "DropoutGrad"),
    ("com.microsoft", "BitmaskDropoutGrad"),
    ("com.microsoft", "BiasDropout"),
    ("com.microsoft", "BitmaskDropout"),
    // Gather, slice, split, concat.
    ("com.microsoft", "GatherGrad"),
    ("com.microsoft", "GatherElementsGrad"),
    ("com.microsoft", "GatherNDGrad"),
    ("com.microsoft", "ShrunkenGather"),
    ("com.microsoft", "SliceGrad"),
    ("com.microsoft", "ConcatTraining"),
    ("com.microsoft", "SplitTraining"),
    ("com.microsoft", "PadAndUnflatten"),
    ("com.microsoft", "FlattenAndUnpad"),
    // Arithmetic, reductions, broadcasting.
    ("com.microsoft", "Scale"),
    ("com.microsoft", "DivGrad"),
    ("com.microsoft", "ReduceSumTraining"),
    ("com.microsoft", "BroadcastGradientArgs"),
    ("com.microsoft", "ScaledSum"),
    ("com.microsoft", "BatchScale"),
    ("com.microsoft", "View"),
    // Recurrent nets, quantisation-aware training.
    ("com.microsoft", "LSTMTraining"),
    ("com.microsoft", "LSTMGrad"),
    ("com.microsoft", "GRUTraining"),
    ("com.microsoft", "GRUGrad"),
    ("com.microsoft", "FakeQuant"),
    ("com.microsoft", "FakeQuantGrad"),
    // Accumulation and optimizers.
    ("com.microsoft", "InPlaceAccumulatorV2"),
    ("com.microsoft", "InPlaceAccumulator"),
    ("com.microsoft", "ZeroGradient"),
    ("com.microsoft", "AdamWOptimizer"),
    ("com.microsoft", "SGDOptimizerV2"),
    ("com.microsoft", "AdamOptimizer"),
    ("com.microsoft", "SGDOptimizer"),
    ("com.microsoft", "LambOptimizer"),
    ("com.microsoft", "InplaceClipGradNorm"),
    ("com.microsoft", "ReduceAllL2"),
    ("com.microsoft", "IsFinite"),
    ("com.microsoft", "All"),
    ("com.microsoft", "MixedPrecisionScale"),
    // Distributed training, ORTModule, control.
    ("com.microsoft", "NcclAllReduce"),
    ("com.microsoft", "NcclAllGather"),
    ("com.microsoft", "NcclReduceScatter"),
    ("com.microsoft", "Send"),
    ("com.microsoft", "Recv"),
    ("com.microsoft", "MegatronF"),
    ("com.microsoft", "MegatronG"),
    ("com.microsoft", "YieldOp"),
    ("com.microsoft", "PythonOp"),
    ("com.microsoft", "PythonOpGrad"),
    ("com.microsoft", "Group"),
    ("com.microsoft", "PassThrough"),
    ("com.microsoft", "RecordEvent"),
    ("com.microsoft", "WaitEvent"),
    ("org.pytorch.aten", "ATen"),
];

/// True when standard (non-training) ONNX Runtime cannot run `domain::op_type`.
pub fn is_training_only(domain: &str, op_type: &str) -> bool {
    let domain = crate::ir::normalize_domain(domain);
    TRAINING_ONLY
        .iter()
        .any(|(d, o)| *d == domain && *o == op_type)
}

/// `com.microsoft` contrib ops that the standard ONNX Runtime 1.31.1 build runs on the CPU:
/// each was checked by loading a one-node model (tests/op_facts.rs re-checks them).
/// Measured absent there, though ORT's training graphs may hold them: `LayerNormalization`,
/// `SimplifiedLayerNormalization` and `SoftmaxCrossEntropyLoss` (ORT registers them in the
/// default domain only), `BiasDropout`, `BitmaskDropout` and `Rfft` (no CPU kernel).
pub const STANDARD_CONTRIB: &[&str] = &[
    "FusedMatMul",
    "Gelu",
    "FastGelu",
    "BiasGelu",
    "QuickGelu",
    "SkipLayerNormalization",
    "Trilu",
    "Range",
    "Inverse",
    "FusedConv",
    "TransposeMatMul",
    // Their CPU kernels exist (a one-node model reaches the kernel's own checks); their
    // inputs are too particular for the one-node test.
    "FusedGemm",
    "Attention",
    "MultiHeadAttention",
];

/// True when standard ONNX Runtime registers `com.microsoft::op_type` with a CPU kernel.
pub fn is_standard_contrib(op_type: &str) -> bool {
    STANDARD_CONTRIB.contains(&op_type)
}
