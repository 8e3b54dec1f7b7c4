//! The constants tf2onnx writes as initializers.
//!
//! tf2onnx (`producer_name` "tf2onnx") freezes a TensorFlow function: each variable and each
//! constant becomes an initializer, so a Keras layer's constants look like parameters.
//! Variables keep a name derived from the op that read them, in many forms:
//! `<model>/<layer>/Conv2D/ReadVariableOp/resource:0` (`.../ReadVariableOp:0` in a plain
//! export), `const_fold_opt__<n>` where tf2onnx's constant folding reshaped one (a depthwise
//! kernel, a Conv1D bias), `<layer>/Conv1D/ExpandDims_1__<n>` (a Conv1D kernel),
//! `embedding/embedding_lookup/<n>:0`, `W0__<n>`/`R0__<n>`/`B0__<n>` (an LSTM's, its gates
//! reordered). So variables cannot be told by name; two kinds of constant can:
//!
//! - **One element, no variable read in the name**: what a layer wrote in Python as a
//!   number: ReLU6's bounds (`re_lu/Relu6_min__14`), Rescaling's scale and offset
//!   (`rescaling/Cast/x:0`), hard-sigmoid's scalars (folded: `const_fold_opt__<n>`), swish's
//!   `beta:0`, an epsilon.
//! - **A TensorFlow constant op** (`.../Const:0`, `.../Const_<n>:0`) or a binary op's
//!   constant operand (`.../sub/y:0`, `.../mul/x:0`): the unit scale of a
//!   `BatchNormalization(scale=False)` (`batch_normalization/Const:0`: Keras has no such
//!   variable), a fixed Normalization's mean (`normalization/sub/y:0`).
//!
//! Measured on 18 of Keras's applications and 6 models of Keras's other layers (TF 2.15.1,
//! tf2onnx 1.17, graphs/forward/survey_keras.py): no trainable variable is named either way,
//! and the only untrainable tensor left to train is a Normalization layer's deviation,
//! which tf2onnx folds to `normalization/Maximum__6` (3 values in ResNetRS and the
//! EfficientNets): `--freeze` it. Keras's non-trainable variables (a frozen layer, an
//! adapted Normalization's mean and variance) are read like trainable ones and cannot be
//! told apart in the file: `--freeze` them. (A Keras recurrent layer's one bias, written as
//! ONNX's two with the recurrent half zeros, is `unroll_rnn`'s to handle.)
//!
//! tf2onnx's own optimizer folds each BatchNormalization that follows a Conv into the Conv
//! (`..._weights_fused_bn`): such a file is refused, with the export that keeps them
//! (README.md, "From Keras"), unless `--trainable` chooses what trains.

use crate::ir::Model;

pub const PRODUCER: &str = "tf2onnx";
const READ: &str = "ReadVariableOp";

/// The suffix tf2onnx gives a Conv's weight and bias after folding the BatchNormalization
/// that followed it into them (`<layer>/Conv2D_weights_fused_bn`, `..._bias_fused_bn`;
/// measured on its plain `from_keras` and `--saved-model` exports).
const FOLDED_BATCH_NORM: &str = "_fused_bn";

/// The initializers of a tf2onnx export that hold a Conv with a BatchNormalization folded
/// into it: inference arithmetic, not the network Keras trains (no batch statistics, the
/// scale and shift gone).
pub fn folded_batch_norms(model: &Model) -> Vec<String> {
    if !exported_by_tf2onnx(model) {
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

/// Whether tf2onnx wrote `model`.
pub fn exported_by_tf2onnx(model: &Model) -> bool {
    model.header.producer_name() == PRODUCER
}

/// Whether the initializer `name` of shape `dims` in a tf2onnx export is one of its
/// constants (else it may hold a variable and trains by the general rule).
pub fn is_constant(name: &str, dims: &[i64]) -> bool {
    if name.contains(READ) {
        return false;
    }
    let one_element = dims.iter().all(|d| *d == 1);
    let op = name.strip_suffix(":0").unwrap_or(name);
    let last = op.rsplit('/').next().unwrap_or(op);
    let constant_op = last == "Const"
        || last
            .strip_prefix("Const_")
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
    let operand = name.ends_with(":0") && (last == "x" || last == "y");
    one_element || constant_op || operand
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_are_python_numbers_and_tensorflow_constant_ops() {
        // Variables, in the forms the survey met.
        for (name, dims) in [
            (
                "m/conv1/Conv2D/ReadVariableOp/resource:0",
                &[8, 3, 3, 3][..],
            ),
            ("m/scale/ReadVariableOp/resource:0", &[]),
            (
                "StatefulPartitionedCall/m/dense/BiasAdd/ReadVariableOp:0",
                &[4],
            ),
            ("const_fold_opt__362", &[8, 1, 3, 3]),
            ("conv1d/conv1d/Conv1D/ExpandDims_1__6", &[8, 4, 1, 3]),
            ("lstm/embedding/embedding_lookup/1032:0", &[32, 16]),
            ("W0__26", &[1, 64, 16]),
            ("B0__28", &[1, 128]),
        ] {
            assert!(!is_constant(name, dims), "{name}");
        }
        // Constants.
        for (name, dims) in [
            ("const_fold_opt__910", &[1][..]),
            ("mobilenetv2_0.35_32/Conv1_relu/Relu6_max__15", &[]),
            ("MobilenetV3large/rescaling/Cast/x:0", &[]),
            ("inception_v3/batch_normalization/Const:0", &[8]),
            ("m/bn/Const_3:0", &[8]),
            ("resnet-rs-50/normalization/sub/y:0", &[3]),
        ] {
            assert!(is_constant(name, dims), "{name}");
        }
        // Not a constant op's name.
        assert!(!is_constant("m/Constant_scale:0", &[8]));
        assert!(!is_constant("m/layer/y_proj:0", &[8]));
    }
}
