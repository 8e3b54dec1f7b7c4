//! What the data must satisfy before an engine sees it, beyond element types and shapes:
//! integer data that a step uses as indices must lie in range, and no axis may be empty.
//! ONNX Runtime fails a run on an out-of-range label with an error about an unnamed node,
//! and tract panics (an out-of-bounds index, or a division by zero on an empty axis), so
//! the host checks first and names the array, the row and the node.
//!
//! The limits come from the step itself ([`index_limits`]): from every integer data input,
//! through ops that keep the values (`Cast`, `Reshape`, `Flatten`, `Squeeze`, `Unsqueeze`,
//! `Identity`), to the first node that indexes with them:
//!
//! - `SoftmaxCrossEntropyLoss` / `NegativeLogLikelihoodLoss` labels (input 1): classes in
//!   `[0, C)`, `C` axis 1 of the scores, `ignore_index` allowed;
//! - `Gather` indices (input 1, an embedding lookup): `[-n, n)` with `n` the data's length
//!   on `axis`;
//! - `GatherElements` indices (input 1): `[-n, n)` likewise.
//!
//! A limit is known only where the shape is declared (an initializer, a graph input or
//! output, or a value_info); elsewhere nothing is checked.

use crate::data::Tensor;
use crate::dataset::Dataset;
use crate::ir::builder::NodeAttributes;
use crate::proto::{GraphProto, ModelProto, NodeProto};

/// A range an integer data input must keep to.
#[derive(Clone, Debug, PartialEq)]
pub struct IndexLimit {
    /// The data input.
    pub input: String,
    /// Values must lie in `[low, high)`, or equal `ignore`.
    pub low: i64,
    pub high: i64,
    pub ignore: Option<i64>,
    /// The node that indexes with it, for messages: `SoftmaxCrossEntropyLoss 'name'`.
    pub node: String,
    /// What the range is: "classes", "rows of 'wte.weight'".
    pub what: String,
}

/// The declared dims of `name` in `g` (`None` for a symbolic one), when its rank is known.
fn declared_dims(g: &GraphProto, name: &str) -> Option<Vec<Option<i64>>> {
    if let Some(t) = g.initializer.iter().find(|t| t.name() == name) {
        return Some(t.dims.iter().map(|d| Some(*d)).collect());
    }
    let info = g
        .input
        .iter()
        .chain(&g.output)
        .chain(&g.value_info)
        .find(|v| v.name() == name)?;
    use crate::proto::tensor_shape_proto::dimension::Value as Dim;
    use crate::proto::type_proto::Value;
    match info.r#type.as_ref()?.value.as_ref()? {
        Value::TensorType(t) => t
            .shape
            .as_ref()?
            .dim
            .iter()
            .map(|d| match d.value {
                Some(Dim::DimValue(v)) if v >= 0 => Some(Some(v)),
                _ => Some(None),
            })
            .collect(),
        _ => None,
    }
}

/// One dim of `name` (negative axes from the end): declared, or else followed back through
/// its producer where that fixes it (a `Gemm` or `MatMul` by a weight, elementwise ops, a
/// `Reshape` to a constant shape), a few nodes deep.
fn dim(g: &GraphProto, name: &str, axis: i64) -> Option<i64> {
    dim_at(g, name, axis, 8)
}

fn dim_at(g: &GraphProto, name: &str, axis: i64, depth: usize) -> Option<i64> {
    if let Some(dims) = declared_dims(g, name) {
        let rank = dims.len() as i64;
        let a = if axis < 0 { axis + rank } else { axis };
        if let Some(Some(d)) = (0..rank).contains(&a).then(|| dims[a as usize]) {
            return Some(d);
        }
    }
    if depth == 0 {
        return None;
    }
    let producer = g.node.iter().find(|n| n.output.iter().any(|o| o == name))?;
    if !crate::ir::normalize_domain(producer.domain()).is_empty() {
        return None;
    }
    let input = |i: usize| producer.input.get(i).filter(|s| !s.is_empty());
    match producer.op_type() {
        // Y [M, N] = A' B' (+ C): N from B (transposed or not).
        "Gemm" if axis == 1 || axis == -1 => {
            let trans_b = producer.attr_int("transB").ok().flatten().unwrap_or(0);
            dim_at(g, input(1)?, if trans_b == 0 { 1 } else { 0 }, depth - 1)
        }
        "MatMul" if axis == -1 || declared_rank(g, name) == Some(axis + 1) => {
            dim_at(g, input(1)?, -1, depth - 1)
        }
        "Add" | "Sub" | "Mul" | "Div" => (0..2)
            .filter_map(input)
            .find_map(|x| dim_at(g, x, axis, depth - 1).filter(|d| *d != 1)),
        "Relu" | "Sigmoid" | "Tanh" | "Identity" | "Cast" | "LogSoftmax" | "Softmax"
        | "Dropout" | "Neg" | "Exp" | "Log" => dim_at(g, input(0)?, axis, depth - 1),
        "Reshape" if axis >= 0 || axis == -1 => {
            let target = input(1)?;
            let shape = g.initializer.iter().find(|t| t.name() == target.as_str())?;
            let values = crate::data::Tensor::from_tensor_proto(shape).ok()?;
            let values: Vec<i64> = values.as_i64()?.iter().copied().collect();
            let a = if axis < 0 {
                values.len() as i64 + axis
            } else {
                axis
            };
            values
                .get(usize::try_from(a).ok()?)
                .copied()
                .filter(|d| *d > 0)
        }
        _ => None,
    }
}

fn declared_rank(g: &GraphProto, name: &str) -> Option<i64> {
    declared_dims(g, name).map(|d| d.len() as i64)
}

/// Ops that pass their first input's values through unchanged (reshaped or cast).
fn passes_values(n: &NodeProto) -> bool {
    crate::ir::normalize_domain(n.domain()).is_empty()
        && matches!(
            n.op_type(),
            "Cast" | "Reshape" | "Flatten" | "Squeeze" | "Unsqueeze" | "Identity"
        )
}

/// The ranges the integer data inputs `inputs` of `model` must keep to (main graph).
pub fn index_limits(model: &ModelProto, inputs: &[String]) -> Vec<IndexLimit> {
    let Some(g) = model.graph.as_ref() else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for input in inputs {
        // Values reachable from the input without changing its values.
        let mut frontier = vec![input.clone()];
        let mut seen = std::collections::HashSet::new();
        while let Some(value) = frontier.pop() {
            if !seen.insert(value.clone()) || seen.len() > 64 {
                continue;
            }
            for n in g.node.iter() {
                if n.input.first().is_some_and(|i| *i == value) && passes_values(n) {
                    frontier.extend(n.output.iter().filter(|o| !o.is_empty()).cloned());
                }
                if n.input.get(1).is_none_or(|i| *i != value) {
                    continue;
                }
                let label = format!("{} '{}'", n.op_type(), n.name());
                let data = n.input.first().cloned().unwrap_or_default();
                let domain = crate::ir::normalize_domain(n.domain());
                let limit = match (domain, n.op_type()) {
                    ("", "SoftmaxCrossEntropyLoss" | "NegativeLogLikelihoodLoss") => {
                        dim(g, &data, 1).map(|c| IndexLimit {
                            input: input.clone(),
                            low: 0,
                            high: c,
                            ignore: n.attr_int("ignore_index").ok().flatten(),
                            node: label,
                            what: format!("classes of '{data}'"),
                        })
                    }
                    ("", "Gather" | "GatherElements") => {
                        let axis = n.attr_int("axis").ok().flatten().unwrap_or(0);
                        dim(g, &data, axis).map(|len| IndexLimit {
                            input: input.clone(),
                            low: -len,
                            high: len,
                            ignore: None,
                            node: label,
                            what: format!("entries of '{data}' on axis {axis}"),
                        })
                    }
                    _ => None,
                };
                out.extend(limit);
            }
        }
    }
    out
}

/// Checks `data` against `limits`, and that no array has an empty axis. The error names
/// the array, the first bad row and value, and the node. Arrays left in their file are read
/// a chunk at a time ([`Dataset::chunks`]).
pub fn check_data(data: &Dataset, limits: &[IndexLimit]) -> Result<(), String> {
    for (name, _, shape) in data.layouts() {
        if let Some(axis) = shape.iter().position(|d| *d == 0) {
            return Err(format!(
                "array '{name}' has shape {shape:?}: axis {axis} is empty (no engine computes on an empty axis)"
            ));
        }
    }
    for limit in limits {
        let ok = |v: i64| (limit.low..limit.high).contains(&v) || limit.ignore == Some(v);
        let first_bad = data
            .chunks(&limit.input, |first_row, t| {
                let values: Box<dyn Iterator<Item = i64>> = match t {
                    Tensor::I64(a) => Box::new(a.iter().copied()),
                    Tensor::I32(a) => Box::new(a.iter().map(|v| *v as i64)),
                    _ => return None,
                };
                let row_len = t.shape().iter().skip(1).product::<usize>().max(1);
                values
                    .enumerate()
                    .find(|(_, v)| !ok(*v))
                    .map(|(i, v)| (first_row + i / row_len, v))
            })
            .map_err(|e| e.to_string())?;
        if let Some((row, v)) = first_bad {
            let ignore = match limit.ignore {
                Some(x) => format!(" (or {x}, the ignore_index)"),
                None => String::new(),
            };
            return Err(format!(
                "array '{}': value {v} at row {row} is outside [{}, {}){ignore}, the {} that {} indexes",
                limit.input, limit.low, limit.high, limit.what, limit.node
            ));
        }
    }
    Ok(())
}
