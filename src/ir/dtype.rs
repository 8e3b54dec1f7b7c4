//! The element type of an op's output from its inputs' and attributes': one table for every
//! pass that infers types where a graph does not declare them (`legalize-ort`'s lowerings
//! walking up producers, the `precision` pass propagating float16). Each caller says how it
//! knows an input's type (`input(slot)`) and, for `If`, a branch output's
//! (`branch_output(slot)`).
//!
//! The rules are ONNX's type constraints for the ops our steps hold: fixed result types
//! (shapes and indices int64, comparisons bool), types from an attribute (`Cast`'s `to`,
//! `Constant`'s value, the random ops' `dtype`), from another input (`CastLike`, `OneHot`'s
//! values, `Where`'s branches, the gather-gradient family's updates), and otherwise the type
//! of input 0, which every elementwise op, reduction, normalisation and loss shares with its
//! floating outputs.

use crate::proto::elem::{BOOL, FLOAT, INT32, INT64, STRING};
use crate::proto::{AttributeProto, NodeProto};

/// The element type of output `slot` of `node`, or `None` when the rule needs an input type
/// the caller does not know (or the op makes no such output).
pub fn output_elem(
    node: &NodeProto,
    slot: usize,
    input: impl Fn(usize) -> Option<i32>,
    branch_output: impl Fn(usize) -> Option<i32>,
) -> Option<i32> {
    let attr = |name: &str| attr(node, name);
    let dtype = |default: Option<i32>| attr("dtype").map(|a| a.i() as i32).or(default);
    match (node.op_type(), slot) {
        ("Cast", 0) => attr("to").map(|a| a.i() as i32),
        ("CastLike", 0) => input(1),
        ("Shape" | "Size" | "NonZero" | "ArgMax" | "ArgMin", 0) => Some(INT64),
        ("TopK" | "MaxPool", 1) => Some(INT64),
        ("Unique", s) if s > 0 => Some(INT64),
        ("Dropout", 1) => Some(BOOL),
        (
            "Equal" | "Greater" | "GreaterOrEqual" | "Less" | "LessOrEqual" | "Not" | "And" | "Or"
            | "Xor" | "IsNaN" | "IsInf",
            0,
        ) => Some(BOOL),
        ("Constant", 0) => constant_elem(node),
        ("ConstantOfShape", 0) => Some(
            attr("value")
                .and_then(|a| a.t.as_ref())
                .map(|t| t.data_type())
                .unwrap_or(FLOAT),
        ),
        ("OneHot", 0) => input(2),
        ("Where", 0) => input(1).or_else(|| input(2)),
        ("RandomNormal" | "RandomUniform", 0) => dtype(Some(FLOAT)),
        ("RandomNormalLike" | "RandomUniformLike" | "EyeLike" | "Bernoulli", 0) => dtype(input(0)),
        ("Multinomial", 0) => dtype(Some(INT32)),
        ("If", s) => branch_output(s),
        // Training ops (com.microsoft): output 0 has the type of the updates (input 2) for
        // the gather-gradient family; the in-place accumulator's output 0 is its flag.
        ("GatherGrad" | "GatherNDGrad", 0) => input(2),
        ("InPlaceAccumulatorV2", 0) => Some(BOOL),
        // LayerNormalization's mean and inverse deviation are of its `stash_type` (float by
        // default, whatever X is); BatchNormalization's running statistics of the input
        // statistics they update.
        ("LayerNormalization", 1 | 2) => Some(attr("stash_type").map_or(FLOAT, |a| a.i() as i32)),
        ("BatchNormalization", 1) => input(3),
        ("BatchNormalization", 2) => input(4),
        // Every output of these has input 0's type.
        ("Split" | "SoftmaxCrossEntropyLoss" | "NegativeLogLikelihoodLoss", _) => input(0),
        (_, 0) => input(0),
        _ => None,
    }
}

fn attr<'p>(node: &'p NodeProto, name: &str) -> Option<&'p AttributeProto> {
    node.attribute.iter().find(|a| a.name() == name)
}

/// The element type a `Constant` node produces.
pub fn constant_elem(node: &NodeProto) -> Option<i32> {
    node.attribute.iter().find_map(|a| match a.name() {
        "value" => a.t.as_ref().map(|t| t.data_type()),
        "sparse_value" => a
            .sparse_tensor
            .as_ref()
            .and_then(|s| s.values.as_ref())
            .map(|t| t.data_type()),
        "value_float" | "value_floats" => Some(FLOAT),
        "value_int" | "value_ints" => Some(INT64),
        "value_string" | "value_strings" => Some(STRING),
        _ => None,
    })
}
