//! The constants tf2onnx writes as initializers.
//!
//! tf2onnx (`producer_name` "tf2onnx") freezes a TensorFlow function: each variable and each
//! constant becomes an initializer, so a Keras layer's constants look like parameters. A
//! variable keeps the name of the op that read it (`<model>/<layer>/Conv2D/ReadVariableOp/
//! resource:0`; `.../ReadVariableOp:0` in a plain export), or, where tf2onnx's constant
//! folding reshaped it (a depthwise kernel), becomes `const_fold_opt__<n>` (a name that
//! folding also gives the scalars it computes from constants). The constants a
//! layer wrote in Python are named after the op that used them: ReLU6's bounds
//! (`re_lu/Relu6_min__14`), Rescaling's scale (`rescaling/Cast/x:0`), a Normalization
//! layer's fixed mean and deviation (`normalization/sub/y:0`, `normalization/Maximum__6`),
//! the unit scale of a BatchNormalization built with `scale=False` (`batch_normalization/
//! Const:0`: Keras has no such variable).
//!
//! tf2onnx's own optimizer folds each BatchNormalization that follows a Conv into the Conv
//! (`..._weights_fused_bn`): such a file is refused, with the export that keeps them
//! (README.md, "From Keras"), unless `--trainable` chooses what trains.
//!
//! Measured on 18 of Keras's applications (TF 2.15.1, tf2onnx 1.17,
//! graphs/forward/survey_keras.py): every trainable variable is named one of the two ways
//! above, and every other float initializer the loss reached is a constant. So, in an
//! export that names its variables by their reads, only those are candidates to train.
//! Keras's non-trainable variables (a Normalization layer's adapted mean and variance, a
//! frozen layer) are read like the trainable ones and cannot be told apart in the file:
//! `--freeze` them. An export with no such names (a TF1 graph frozen to constants) keeps the
//! general rule: every float initializer the loss reaches trains.

use crate::ir::Model;

/// The suffix tf2onnx gives a Conv's weight and bias after folding the BatchNormalization
/// that followed it into them (`<layer>/Conv2D_weights_fused_bn`, `..._bias_fused_bn`;
/// measured on its plain `from_keras` and `--saved-model` exports).
const FOLDED_BATCH_NORM: &str = "_fused_bn";

/// The initializers of a tf2onnx export that hold a Conv with a BatchNormalization folded
/// into it: inference arithmetic, not the network Keras trains (no batch statistics, the
/// scale and shift gone).
pub fn folded_batch_norms(model: &Model) -> Vec<String> {
    if model.header.producer_name() != PRODUCER {
        return Vec::new();
    }
    model
        .main()
        .initializers
        .iter()
        .map(|(v, _)| model.name(*v))
        .filter(|n| n.ends_with(FOLDED_BATCH_NORM))
        .map(str::to_string)
        .collect()
}

pub const PRODUCER: &str = "tf2onnx";
const READ: &str = "ReadVariableOp";
const FOLDED: &str = "const_fold_opt__";

/// tf2onnx's naming, when `model` is such an export and names its variables by their reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tf2onnxNames;

impl Tf2onnxNames {
    pub fn of(model: &Model) -> Option<Tf2onnxNames> {
        let main = model.main();
        (model.header.producer_name() == PRODUCER
            && main
                .initializers
                .iter()
                .any(|(v, _)| model.name(*v).contains(READ)))
        .then_some(Tf2onnxNames)
    }

    /// Whether the initializer `name` of shape `dims` may hold a variable (else it is a
    /// constant). Folding also makes scalars out of constant arithmetic
    /// (hard-sigmoid's `x / 6 + 0.5` in MobileNetV3); no folded variable had one element.
    pub fn is_variable(self, name: &str, dims: &[i64]) -> bool {
        let one_element = dims.iter().all(|d| *d == 1);
        name.contains(READ) || (name.starts_with(FOLDED) && !one_element)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variables_are_named_by_their_reads_or_folds() {
        let names = Tf2onnxNames;
        assert!(names.is_variable("m/conv1/Conv2D/ReadVariableOp/resource:0", &[8, 3, 3, 3]));
        assert!(names.is_variable("m/scale/ReadVariableOp/resource:0", &[]));
        assert!(names.is_variable(
            "StatefulPartitionedCall/m/dense/BiasAdd/ReadVariableOp:0",
            &[4]
        ));
        assert!(names.is_variable("const_fold_opt__362", &[8, 1, 3, 3]));
        assert!(!names.is_variable("const_fold_opt__910", &[1]));
        assert!(!names.is_variable("mobilenetv2_0.35_32/Conv1_relu/Relu6_max__15", &[]));
        assert!(!names.is_variable("MobilenetV3large/rescaling/Cast/x:0", &[]));
        assert!(!names.is_variable("inception_v3/batch_normalization/Const:0", &[8]));
    }
}
