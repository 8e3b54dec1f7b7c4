//! What several lowerings share: element types and static shapes of values, typed scalar
//! constants (one initializer per value and body, however many lowerings ask for it), and
//! the opset-aware forms of `crate::ir::emit::Emit`.

use std::collections::HashMap;

use super::{node_error, Lowering};
use crate::ir::builder::{attr_int, attr_string, attr_tensor, tensor_i64};
use crate::ir::emit::Emit;
use crate::ir::{BodyId, Model, NodeId, ValueId};
use crate::passes::PassError;
use crate::proto::{AttributeProto, TensorProto};

pub(super) use crate::proto::elem::{BFLOAT16, DOUBLE, FLOAT, FLOAT16, INT32, INT64};

/// More axes than any tensor a model trains on has (ONNX itself sets no limit): the bound an
/// axis attribute is checked against when the rank it counts back from is not declared.
pub const MAX_RANK: i64 = 64;

/// Constants minted during one run of the pass, keyed by body, element type, dims and
/// bytes, so that e.g. every `ReluGrad` of a graph compares against the same `0.0`.
#[derive(Default)]
pub struct Constants {
    minted: HashMap<(BodyId, i32, Vec<i64>, Vec<u8>), ValueId>,
}

/// Little-endian bytes of `value` as ONNX element type `elem`, for the float types.
pub(super) fn float_bytes(elem: i32, value: f64) -> Option<Vec<u8>> {
    is_float(elem)
        .then(|| crate::ir::emit::scalar_bytes(elem, value))
        .flatten()
}

use crate::ir::is_float_elem as is_float;

/// The element type of `v` when the model declares it or a short walk up its producers
/// determines it (training graphs declare most but not all intermediate values).
pub(super) fn elem_type(model: &Model, v: ValueId) -> Option<i32> {
    elem_type_within(model, v, 16)
}

fn elem_type_within(model: &Model, v: ValueId, depth: usize) -> Option<i32> {
    if let Some(e) = model.value_type(v).and_then(|t| t.tensor_elem()) {
        return Some(e);
    }
    if depth == 0 {
        return None;
    }
    let (node, slot) = model.producer(v)?;
    let n = model.node(node);
    let input = |i: usize| {
        n.inputs
            .get(i)
            .copied()
            .flatten()
            .and_then(|x| elem_type_within(model, x, depth - 1))
    };
    // A branch output's type is not walked into: the branches' own declarations say it.
    crate::ir::dtype::output_elem(&n.proto, slot, input, |_| None)
}

/// The declared dims of `v` (`None` for a symbolic dim), when its rank is known.
pub(super) fn dims(model: &Model, v: ValueId) -> Option<Vec<Option<i64>>> {
    model.value_type(v)?.tensor_sizes()
}

/// The constant value of `v` when it is an initializer that is not a graph input (a graph
/// input's initializer is only a default the caller may override).
pub(super) fn constant(model: &Model, v: ValueId) -> Option<&TensorProto> {
    let body = model.defining_body(v);
    if model.body(body).inputs.iter().any(|(i, _)| *i == v) {
        return None;
    }
    model.initializer(v)
}

/// The single element of a constant scalar (or one-element) float, integer or bool tensor.
pub(super) fn constant_scalar(model: &Model, v: ValueId) -> Option<f64> {
    crate::ir::emit::tensor_scalar(constant(model, v)?)
}

impl Lowering<'_, '_> {
    /// The version of the default (ai.onnx) opset the model imports.
    pub fn onnx_opset(&self) -> i64 {
        self.model().opset("").unwrap_or(1)
    }

    /// The element type of `v`, if known.
    pub fn elem_type(&self, v: ValueId) -> Option<i32> {
        elem_type(self.model(), v)
    }

    /// The float element type the lowering of `node` computes in: that of `v`, float32 when
    /// the model does not say (fp32 graphs are the norm; a wrong guess fails at load time in
    /// the runtime's type check, never silently). Integer types are an error.
    pub fn float_type(&self, node: NodeId, v: ValueId) -> Result<i32, PassError> {
        match self.elem_type(v) {
            None => Ok(FLOAT),
            Some(e) if is_float(e) => Ok(e),
            Some(e) => Err(node_error(
                self.model(),
                node,
                format!(
                    "input '{}' has element type {}, expected a float type",
                    self.model().name(v),
                    crate::ir::print::elem_type_name(e)
                ),
            )),
        }
    }

    /// The rank of `v`, if declared.
    pub fn rank(&self, v: ValueId) -> Option<usize> {
        dims(self.model(), v).map(|d| d.len())
    }

    /// An initializer holding `tensor`, shared with every other request for the same value in
    /// this body.
    pub fn constant(&mut self, hint: &str, tensor: TensorProto) -> ValueId {
        let key = (
            self.b.body,
            tensor.data_type(),
            tensor.dims.clone(),
            tensor.raw_data.clone().unwrap_or_default(),
        );
        if let Some(v) = self.constants.minted.get(&key) {
            return *v;
        }
        let v = self.b.model.add_initializer(self.b.body, hint, tensor);
        self.constants.minted.insert(key, v);
        v
    }

    /// A scalar of float type `elem` (shared, see [`Lowering::constant`]).
    pub fn scalar(&mut self, hint: &str, elem: i32, value: f64) -> ValueId {
        let raw = float_bytes(elem, value).unwrap_or_else(|| (value as f32).to_le_bytes().to_vec());
        let elem = if is_float(elem) { elem } else { FLOAT };
        let tensor = TensorProto {
            data_type: Some(elem),
            raw_data: Some(raw),
            ..Default::default()
        };
        self.constant(hint, tensor)
    }

    /// A 1-D int64 constant (axes, shapes), shared like every constant.
    pub fn int64s(&mut self, hint: &str, values: &[i64]) -> ValueId {
        self.constant(hint, tensor_i64(&[values.len() as i64], values))
    }

    /// A node of the default domain with one output.
    pub fn op(
        &mut self,
        op_type: &str,
        inputs: &[ValueId],
        attributes: Vec<AttributeProto>,
        hint: &str,
    ) -> ValueId {
        self.b.op(op_type, inputs, attributes, hint)
    }

    /// `x` as element type `to`; `x` itself when it already has that type.
    pub fn cast(&mut self, x: ValueId, to: i32, hint: &str) -> ValueId {
        if self.elem_type(x) == Some(to) {
            return x;
        }
        self.op("Cast", &[x], vec![attr_int("to", to as i64)], hint)
    }

    /// The axes `[axis, rank)` that an op "normalising from `axis` on" reduces over: written
    /// with negative numbers when `axis` is negative, so the rank need not be known.
    ///
    /// A negative `axis` is checked against the rank when the model declares it, and otherwise
    /// against [`MAX_RANK`]: the axis list is as long as `-axis`, and an attribute the user wrote
    /// must not decide how much memory the rewrite asks for.
    pub fn trailing_axes(
        &self,
        node: NodeId,
        axis: i64,
        x: ValueId,
    ) -> Result<Vec<i64>, PassError> {
        if axis < 0 {
            let rank = self.rank(x);
            let deepest = rank.map_or(MAX_RANK, |r| r as i64);
            if axis < -deepest {
                let against = match rank {
                    Some(r) => format!("a rank-{r} input"),
                    None => format!(
                        "an input of undeclared rank (no tensor has more than {MAX_RANK} axes)"
                    ),
                };
                return Err(self.unsupported(node, "axis", format!("{axis} for {against}")));
            }
            return Ok((axis..0).collect());
        }
        let rank = self.rank(x).ok_or_else(|| {
            node_error(
                self.model(),
                node,
                format!(
                    "attribute 'axis' = {axis} needs the rank of '{}', which the model does not declare",
                    self.model().name(x)
                ),
            )
        })? as i64;
        if axis >= rank {
            return Err(self.unsupported(node, "axis", format!("{axis} for a rank-{rank} input")));
        }
        Ok((axis..rank).collect())
    }
}

impl Emit for Lowering<'_, '_> {
    fn opset(&self) -> i64 {
        self.onnx_opset()
    }

    fn op(
        &mut self,
        op_type: &str,
        inputs: &[ValueId],
        attributes: Vec<AttributeProto>,
        hint: &str,
    ) -> ValueId {
        self.b.op(op_type, inputs, attributes, hint)
    }

    fn axes(&mut self, axes: &[i64]) -> ValueId {
        self.int64s(&axes_name(axes), axes)
    }
}

/// Bytes per element of the float and integer types the lowerings emit.
pub(super) fn elem_size(elem: i32) -> usize {
    match elem {
        DOUBLE | INT64 => 8,
        FLOAT | INT32 => 4,
        FLOAT16 | BFLOAT16 => 2,
        _ => 1,
    }
}

/// `axes_0_1`, `axes_m1`: the name of an axes constant, readable in a printed graph.
fn axes_name(axes: &[i64]) -> String {
    let parts: Vec<String> = axes
        .iter()
        .map(|a| {
            if *a < 0 {
                format!("m{}", -a)
            } else {
                a.to_string()
            }
        })
        .collect();
    format!("axes_{}", parts.join("_"))
}

/// The names [`scatter_flat`] gives its values (each lowering keeps its own).
pub(super) struct ScatterNames<'a> {
    pub zeros: &'a str,
    pub indices: &'a str,
    pub values: &'a str,
    pub result: &'a str,
}

/// `ScatterElements(zeros[size], Reshape(indices, flat), Reshape(values, flat), axis = 0)`:
/// each value put at (with `add`, added to) the flat position its index names in a zero
/// tensor of `size` elements of `elem`. `flat` is the `[-1]` shape, `size` a 1-element int64
/// tensor. MaxUnpool and MaxPoolGrad are both this scatter over the flattened output.
#[allow(clippy::too_many_arguments)]
pub(super) fn scatter_flat(
    l: &mut Lowering<'_, '_>,
    elem: i32,
    flat: ValueId,
    size: ValueId,
    indices: ValueId,
    values: ValueId,
    add: bool,
    names: ScatterNames<'_>,
) -> ValueId {
    let zero = TensorProto {
        dims: vec![1],
        data_type: Some(elem),
        raw_data: Some(vec![0; elem_size(elem)]),
        ..Default::default()
    };
    let zeros = l.op(
        "ConstantOfShape",
        &[size],
        vec![attr_tensor("value", zero)],
        names.zeros,
    );
    let flat_indices = l.op("Reshape", &[indices, flat], vec![], names.indices);
    let flat_values = l.op("Reshape", &[values, flat], vec![], names.values);
    let mut attributes = vec![attr_int("axis", 0)];
    if add {
        attributes.push(attr_string("reduction", "add"));
    }
    l.op(
        "ScatterElements",
        &[zeros, flat_indices, flat_values],
        attributes,
        names.result,
    )
}
