//! Emitting new nodes: a small builder that mints names, stamps the inserting pass on every
//! node, keeps count for the pass report, and makes constants that a pass reuses within a
//! body (one `ga.one` per body, however many builders asked for it).

use super::{BodyId, Model, NodeId, NodeSpec, ValueId};
use crate::proto::{
    attribute_proto::AttributeType, tensor_proto::DataType, AttributeProto, TensorProto,
};

pub struct Builder<'m> {
    pub model: &'m mut Model,
    pub body: BodyId,
    pub pass: &'static str,
    /// Nodes added so far.
    pub added: usize,
}

impl<'m> Builder<'m> {
    pub fn new(model: &'m mut Model, body: BodyId, pass: &'static str) -> Self {
        Builder {
            model,
            body,
            pass,
            added: 0,
        }
    }

    /// A node with one output named from `hint`.
    pub fn op(
        &mut self,
        op_type: &str,
        inputs: &[ValueId],
        attributes: Vec<AttributeProto>,
        hint: &str,
    ) -> ValueId {
        let inputs: Vec<Option<ValueId>> = inputs.iter().copied().map(Some).collect();
        let node = self.node(op_type, "", &inputs, &[hint], attributes);
        self.model.output(node, 0)
    }

    /// The general form: any domain, optional inputs, several outputs.
    pub fn node(
        &mut self,
        op_type: &str,
        domain: &str,
        inputs: &[Option<ValueId>],
        output_hints: &[&str],
        attributes: Vec<AttributeProto>,
    ) -> NodeId {
        self.added += 1;
        let hint = output_hints.first().copied().unwrap_or(op_type);
        self.model.add_node(
            self.body,
            NodeSpec {
                op_type,
                domain,
                inputs,
                output_hints,
                attributes,
                name_hint: Some(&format!("{hint}_{op_type}")),
                pass: Some(self.pass),
            },
        )
    }

    /// An initializer holding `tensor`, shared with this pass's earlier identical constant
    /// of the same hint in this body ([`Model::shared_constant`]: the check that it still is
    /// one). Every constant constructor below goes through it.
    pub fn constant(&mut self, hint: &str, tensor: TensorProto) -> ValueId {
        self.model
            .shared_constant(self.body, self.pass, hint, tensor)
    }

    /// A float32 scalar constant (shared, see [`Builder::constant`]).
    pub fn scalar_f32(&mut self, hint: &str, value: f32) -> ValueId {
        self.constant(hint, tensor_f32(&[], &[value]))
    }

    /// An int64 constant of shape `[values.len()]` (shared, see [`Builder::constant`]).
    pub fn ints(&mut self, hint: &str, values: &[i64]) -> ValueId {
        self.constant(hint, tensor_i64(&[values.len() as i64], values))
    }

    /// An int64 scalar constant (shared, see [`Builder::constant`]).
    pub fn scalar_i64(&mut self, hint: &str, value: i64) -> ValueId {
        self.constant(hint, tensor_i64(&[], &[value]))
    }
}

pub fn tensor_f32(dims: &[i64], values: &[f32]) -> TensorProto {
    TensorProto {
        dims: dims.to_vec(),
        data_type: Some(DataType::Float as i32),
        raw_data: Some(values.iter().flat_map(|v| v.to_le_bytes()).collect()),
        ..Default::default()
    }
}

pub fn tensor_f64(dims: &[i64], values: &[f64]) -> TensorProto {
    TensorProto {
        dims: dims.to_vec(),
        data_type: Some(DataType::Double as i32),
        raw_data: Some(values.iter().flat_map(|v| v.to_le_bytes()).collect()),
        ..Default::default()
    }
}

pub fn tensor_i64(dims: &[i64], values: &[i64]) -> TensorProto {
    TensorProto {
        dims: dims.to_vec(),
        data_type: Some(DataType::Int64 as i32),
        raw_data: Some(values.iter().flat_map(|v| v.to_le_bytes()).collect()),
        ..Default::default()
    }
}

pub fn tensor_bool(dims: &[i64], values: &[bool]) -> TensorProto {
    TensorProto {
        dims: dims.to_vec(),
        data_type: Some(DataType::Bool as i32),
        raw_data: Some(values.iter().map(|v| *v as u8).collect()),
        ..Default::default()
    }
}

pub fn attr_int(name: &str, value: i64) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        r#type: Some(AttributeType::Int as i32),
        i: Some(value),
        ..Default::default()
    }
}

pub fn attr_float(name: &str, value: f32) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        r#type: Some(AttributeType::Float as i32),
        f: Some(value),
        ..Default::default()
    }
}

pub fn attr_ints(name: &str, values: &[i64]) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        r#type: Some(AttributeType::Ints as i32),
        ints: values.to_vec(),
        ..Default::default()
    }
}

pub fn attr_string(name: &str, value: &str) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        r#type: Some(AttributeType::String as i32),
        s: Some(value.as_bytes().to_vec()),
        ..Default::default()
    }
}

pub fn attr_tensor(name: &str, value: TensorProto) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        r#type: Some(AttributeType::Tensor as i32),
        t: Some(value),
        ..Default::default()
    }
}

/// Typed attribute reads on a node. `None` when absent; `Err` text when present with
/// another type (the caller adds the node's name).
pub trait NodeAttributes {
    fn attr(&self, name: &str) -> Option<&AttributeProto>;
    fn attr_int(&self, name: &str) -> Result<Option<i64>, String> {
        typed(self.attr(name), name, AttributeType::Int, |a| a.i())
    }
    fn attr_float(&self, name: &str) -> Result<Option<f32>, String> {
        typed(self.attr(name), name, AttributeType::Float, |a| a.f())
    }
    fn attr_ints(&self, name: &str) -> Result<Option<Vec<i64>>, String> {
        typed(self.attr(name), name, AttributeType::Ints, |a| {
            a.ints.clone()
        })
    }
    fn attr_string(&self, name: &str) -> Result<Option<String>, String> {
        typed(self.attr(name), name, AttributeType::String, |a| {
            String::from_utf8_lossy(a.s()).into_owned()
        })
    }
}

fn typed<T>(
    attr: Option<&AttributeProto>,
    name: &str,
    want: AttributeType,
    get: impl Fn(&AttributeProto) -> T,
) -> Result<Option<T>, String> {
    match attr {
        None => Ok(None),
        Some(a) if a.r#type() == want => Ok(Some(get(a))),
        Some(a) => Err(format!(
            "attribute '{name}' is {:?}, expected {:?}",
            a.r#type(),
            want
        )),
    }
}

impl NodeAttributes for crate::proto::NodeProto {
    fn attr(&self, name: &str) -> Option<&AttributeProto> {
        self.attribute.iter().find(|a| a.name() == name)
    }
}
