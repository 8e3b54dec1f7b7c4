//! The loss appended to a model output `Y` with a new labels input `T`, as the frameworks
//! define them (PyTorch's `nn.*Loss` with its defaults):
//!
//! ```text
//! cross-entropy  L = SoftmaxCrossEntropyLoss(Y, T; ignore_index, reduction)    T int64 classes
//! nll            L = NegativeLogLikelihoodLoss(Y, T; ignore_index, reduction)  Y log-probabilities
//! mse            L = mean((Y - T)²)
//! l1             L = mean(|Y - T|)
//! bce-logits     L = mean(max(Y, 0) - Y·T + log(1 + exp(-|Y|)))               (the stable form)
//! ```
//!
//! (`sum` replaces every mean by a sum.) The classes sit on `class_axis` of `Y` (default the
//! last): `[N, C]` classifiers and `[B, T, V]` language models both work. ONNX's loss ops read
//! the classes on axis 1, so a last-axis `[B, T, V]` is viewed as `[B·T, V]` (a Reshape, no
//! copy) with labels `[B·T]`, and any other axis is transposed to 1.

use super::rules::node_error;
use super::shapes::{Dim, Shapes};
use crate::ir::builder::{attr_int, attr_ints, attr_string, Builder};
use crate::ir::{BodyId, Model, ValueId};
use crate::passes::PassError;
use crate::proto::tensor_proto::DataType;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LossFn {
    CrossEntropy,
    Nll,
    Mse,
    L1,
    BceLogits,
}

impl LossFn {
    pub fn parse(s: &str) -> Option<LossFn> {
        Some(match s {
            "cross-entropy" => LossFn::CrossEntropy,
            "nll" => LossFn::Nll,
            "mse" => LossFn::Mse,
            "l1" => LossFn::L1,
            "bce-logits" => LossFn::BceLogits,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            LossFn::CrossEntropy => "cross-entropy",
            LossFn::Nll => "nll",
            LossFn::Mse => "mse",
            LossFn::L1 => "l1",
            LossFn::BceLogits => "bce-logits",
        }
    }

    /// Whether the labels are class indices (cross-entropy, nll), not targets like `Y`.
    pub fn takes_classes(self) -> bool {
        matches!(self, LossFn::CrossEntropy | LossFn::Nll)
    }
}

value_enum!(
    LossFn: LossFn::CrossEntropy,
    LossFn::Nll,
    LossFn::Mse,
    LossFn::L1,
    LossFn::BceLogits,
);

#[derive(Clone, Debug, PartialEq)]
pub struct LossSpec {
    pub function: LossFn,
    /// The model output the loss reads (default: the first output).
    pub output: Option<String>,
    pub labels: String,
    pub class_axis: i64,
    pub ignore_index: Option<i64>,
    pub sum: bool,
}

fn pass_error(message: String) -> PassError {
    PassError::Other {
        pass: super::PASS.into(),
        message,
    }
}

/// Appends the loss; returns (loss value, labels input).
pub fn append(
    model: &mut Model,
    spec: &LossSpec,
    shapes: &Shapes,
) -> Result<(ValueId, ValueId), PassError> {
    let main = BodyId::MAIN;
    let output =
        match &spec.output {
            Some(name) => model.lookup(main, name).ok_or_else(|| {
                pass_error(format!(
                "--model-output: '{name}' names no tensor of the model (the output the loss reads)"
            ))
            })?,
            None => model.graph_outputs().first().copied().ok_or_else(|| {
                pass_error("the model has no outputs to apply --loss-fn to".into())
            })?,
        };
    let y_name = model.name(output).to_string();
    let facts = shapes.get(output);
    let elem = facts.elem.ok_or_else(|| {
        pass_error(format!(
            "output '{y_name}': its element type is not declared"
        ))
    })?;
    if !matches!(elem, x if x == DataType::Float as i32 || x == DataType::Double as i32 || x == DataType::Float16 as i32 || x == DataType::Bfloat16 as i32)
    {
        return Err(pass_error(format!(
            "output '{y_name}' is {}, not a floating-point tensor: --loss-fn {} needs float scores",
            crate::ir::print::elem_type_name(elem),
            spec.function.as_str()
        )));
    }
    let dims = facts
        .dims
        .clone()
        .ok_or_else(|| pass_error(format!("output '{y_name}': its rank is not declared")))?;
    let rank = dims.len() as i64;
    let class_axis = if spec.class_axis < 0 {
        spec.class_axis + rank
    } else {
        spec.class_axis
    };
    if spec.function.takes_classes() && (rank < 2 || class_axis < 0 || class_axis >= rank) {
        return Err(pass_error(format!(
            "--class-axis {} does not fit output '{y_name}' of rank {rank} (cross-entropy needs [N, C, ...] scores)",
            spec.class_axis
        )));
    }
    // The labels: int64 classes of Y's shape without the class axis, or targets like Y.
    let (label_elem, label_dims): (i32, Vec<Dim>) = if spec.function.takes_classes() {
        let d = dims
            .iter()
            .enumerate()
            .filter(|(i, _)| *i as i64 != class_axis)
            .map(|(_, d)| d.clone())
            .collect();
        (DataType::Int64 as i32, d)
    } else if super::half_model::is_half(elem) {
        // Targets like Y, in float32 like the loss (below) and the host's data.
        (DataType::Float as i32, dims.clone())
    } else {
        (elem, dims.clone())
    };
    let labels = match model.lookup(main, &spec.labels) {
        Some(v) if model.main().inputs.iter().any(|(i, _)| *i == v) => {
            let lf = shapes.get(v);
            if lf.elem.is_some_and(|e| e != label_elem) {
                return Err(pass_error(format!(
                    "labels input '{}' is {}, but --loss-fn {} wants {}",
                    spec.labels,
                    crate::ir::print::elem_type_name(lf.elem.unwrap_or(0)),
                    spec.function.as_str(),
                    crate::ir::print::elem_type_name(label_elem)
                )));
            }
            v
        }
        Some(_) => {
            return Err(pass_error(format!(
                "--labels '{}' is already the name of a tensor of the model that is not an input; choose another name",
                spec.labels
            )))
        }
        None => {
            let ty = super::shapes::type_of(label_elem, &label_dims);
            model.add_input(main, &spec.labels, ty, None)
        }
    };
    let mut b = Builder::new(model, main, super::PASS);
    // Half scores (a model stored in half precision, `half_model`): the loss in float32,
    // as PyTorch's autocast computes it (a mean over a batch in half loses the digits).
    let output = match super::half_model::is_half(elem) {
        true => b.op(
            "Cast",
            &[output],
            vec![attr_int("to", DataType::Float as i64)],
            &format!("{y_name}_float"),
        ),
        false => output,
    };
    let reduction = if spec.sum { "sum" } else { "mean" };
    let opset = b.model.opset("").unwrap_or(13);
    let loss = match spec.function {
        LossFn::CrossEntropy | LossFn::Nll => {
            let (scores, labels2) =
                classes_on_axis_1(&mut b, output, labels, &dims, class_axis, opset)?;
            // ONNX's own loss ops: their gradient rules, their lowerings for tract, and
            // grad-accum's label count (normalize=weighted) each know them.
            let op = if spec.function == LossFn::CrossEntropy {
                "SoftmaxCrossEntropyLoss"
            } else {
                "NegativeLogLikelihoodLoss"
            };
            let mut attrs = vec![attr_string("reduction", reduction)];
            if let Some(i) = spec.ignore_index {
                attrs.push(attr_int("ignore_index", i));
            }
            let n = b.node(op, "", &[Some(scores), Some(labels2)], &["loss"], attrs);
            b.model.output(n, 0)
        }
        LossFn::Mse | LossFn::L1 => {
            let d = b.op("Sub", &[output, labels], vec![], "loss_diff");
            let e = if spec.function == LossFn::Mse {
                b.op("Mul", &[d, d], vec![], "loss_sq")
            } else {
                b.op("Abs", &[d], vec![], "loss_abs")
            };
            reduce_all(&mut b, e, spec.sum)
        }
        LossFn::BceLogits => {
            let relu = b.op("Relu", &[output], vec![], "bce_relu");
            let yt = b.op("Mul", &[output, labels], vec![], "bce_yt");
            let abs = b.op("Abs", &[output], vec![], "bce_abs");
            let neg = b.op("Neg", &[abs], vec![], "bce_neg_abs");
            let sp = b.op("Softplus", &[neg], vec![], "bce_softplus");
            let d = b.op("Sub", &[relu, yt], vec![], "bce_lin");
            let e = b.op("Add", &[d, sp], vec![], "bce_elem");
            reduce_all(&mut b, e, spec.sum)
        }
    };
    Ok((loss, labels))
}

/// Scores with the classes on axis 1 and labels to match.
fn classes_on_axis_1(
    b: &mut Builder<'_>,
    y: ValueId,
    labels: ValueId,
    dims: &[Dim],
    class_axis: i64,
    opset: i64,
) -> Result<(ValueId, ValueId), PassError> {
    let rank = dims.len() as i64;
    if class_axis == 1 {
        return Ok((y, labels));
    }
    if class_axis == rank - 1 {
        // [.., C] -> [M, C], labels [..] -> [M]: views, no data moves.
        let c = dims[class_axis as usize].known().ok_or_else(|| {
            pass_error(format!(
                "the class axis of '{}' has no static size; cross-entropy on the last axis needs it",
                b.model.name(y)
            ))
        })?;
        let shape = b.ints("scores_2d", &[-1, c]);
        let flat = b.ints("labels_1d", &[-1]);
        let y2 = b.op("Reshape", &[y, shape], vec![], "scores_2d");
        let l2 = b.op("Reshape", &[labels, flat], vec![], "labels_1d");
        return Ok((y2, l2));
    }
    let _ = opset;
    let mut perm: Vec<i64> = (0..rank).filter(|a| *a != class_axis).collect();
    perm.insert(1, class_axis);
    let t = b.op(
        "Transpose",
        &[y],
        vec![attr_ints("perm", &perm)],
        "scores_classes_axis1",
    );
    Ok((t, labels))
}

fn reduce_all(b: &mut Builder<'_>, x: ValueId, sum: bool) -> ValueId {
    let op = if sum { "ReduceSum" } else { "ReduceMean" };
    b.op(op, &[x], vec![attr_int("keepdims", 0)], "loss")
}

/// The loss the model already computes (`--loss NAME`): a scalar float tensor.
pub fn existing(model: &Model, name: &str, shapes: &Shapes) -> Result<ValueId, PassError> {
    let v = model
        .lookup(BodyId::MAIN, name)
        .ok_or_else(|| pass_error(format!("--loss '{name}' names no tensor of the model")))?;
    let f = shapes.get(v);
    let float = f.elem.is_some_and(|e| {
        e == DataType::Float as i32
            || e == DataType::Double as i32
            || e == DataType::Float16 as i32
            || e == DataType::Bfloat16 as i32
    });
    if !float {
        return Err(pass_error(format!(
            "--loss '{name}' is {}, not a floating-point tensor",
            f.elem
                .map(crate::ir::print::elem_type_name)
                .unwrap_or("of unknown type")
        )));
    }
    if let Some(d) = &f.dims {
        if d.iter().any(|d| *d != Dim::Known(1)) {
            return Err(pass_error(format!(
                "--loss '{name}' has shape [{}]: a loss must be a scalar (reduce it, or use --loss-fn on the model output)",
                d.iter().map(Dim::to_string).collect::<Vec<_>>().join(", ")
            )));
        }
    }
    let _ = node_error;
    Ok(v)
}
