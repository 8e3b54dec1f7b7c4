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

pub fn attr_strings(name: &str, values: &[&str]) -> AttributeProto {
    AttributeProto {
        name: Some(name.to_string()),
        r#type: Some(AttributeType::Strings as i32),
        strings: values.iter().map(|v| v.as_bytes().to_vec()).collect(),
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
    fn attr_strings(&self, name: &str) -> Result<Option<Vec<String>>, String> {
        typed(self.attr(name), name, AttributeType::Strings, |a| {
            a.strings
                .iter()
                .map(|s| String::from_utf8_lossy(s).into_owned())
                .collect()
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{tensor_type, BodyId};

    fn model() -> Model {
        let text = "<ir_version: 8, opset_import: [\"\" : 17]>\n\
                    g (float x, bool c) => (float y) { y = Identity (x) }";
        Model::from_proto(crate::ir::text::parse_model(text).unwrap_or_else(|e| panic!("{e}")))
    }

    /// A node added by a pass is exported after every node ready before it, unless placed
    /// after the node it stands in for (`Model::place_after`).
    #[test]
    fn a_placed_node_is_exported_where_it_was_placed() {
        let text = "<ir_version: 8, opset_import: [\"\" : 17]>\n\
                    g (float x) => (float y, float z) {\n\
                    a = Relu (x)\n b = Neg (a)\n y = Identity (b)\n z = Identity (x)\n}";
        let exported = |place: bool| {
            let mut m = Model::from_proto(
                crate::ir::text::parse_model(text).unwrap_or_else(|e| panic!("{e}")),
            );
            let x = m.lookup(BodyId::MAIN, "x").unwrap();
            let relu = m.body_nodes(BodyId::MAIN).next().unwrap();
            let abs =
                Builder::new(&mut m, BodyId::MAIN, "p").node("Abs", "", &[Some(x)], &["w"], vec![]);
            let w = m.output(abs, 0);
            let z = m.lookup(BodyId::MAIN, "z").unwrap();
            let (copy, _) = m.producer(z).unwrap();
            m.set_input(copy, 0, Some(w));
            if place {
                m.place_after(abs, relu);
            }
            let proto = m.to_proto();
            let ops: Vec<String> = proto
                .graph
                .unwrap()
                .node
                .iter()
                .map(|n| n.op_type().to_string())
                .collect();
            ops.join(" ")
        };
        assert_eq!(exported(false), "Relu Neg Identity Abs Identity");
        assert_eq!(exported(true), "Relu Abs Neg Identity Identity");
    }

    #[test]
    fn constants_are_reused_per_body_pass_hint_and_value() {
        let mut m = model();
        let main = BodyId::MAIN;
        let one = Builder::new(&mut m, main, "p").scalar_i64("one", 1);
        // Another builder of the same pass: the same constant.
        assert_eq!(Builder::new(&mut m, main, "p").scalar_i64("one", 1), one);
        assert_eq!(Builder::new(&mut m, main, "p").ints("axes", &[0, 1]), {
            Builder::new(&mut m, main, "p").ints("axes", &[0, 1])
        });
        // Another value, type, shape, hint or pass: a new one.
        let mut b = Builder::new(&mut m, main, "p");
        assert_ne!(b.scalar_i64("one", 2), one);
        assert_ne!(b.ints("one", &[1]), one);
        assert_ne!(b.scalar_f32("one", 1.0), b.scalar_f32("one", -1.0));
        assert_ne!(b.scalar_i64("unit", 1), one);
        assert_ne!(Builder::new(&mut m, main, "q").scalar_i64("one", 1), one);
        // Another body: a new one.
        let c = m.lookup(main, "c").unwrap();
        let node = Builder::new(&mut m, main, "p").node("If", "", &[Some(c)], &["z"], vec![]);
        let branch = m.add_subgraph(node, "then_branch");
        let inner = Builder::new(&mut m, branch, "p").scalar_i64("one", 1);
        assert_ne!(inner, one);
        assert_eq!(
            Builder::new(&mut m, branch, "p").scalar_i64("one", 1),
            inner
        );
    }

    #[test]
    fn a_constant_no_longer_what_it_was_is_not_reused() {
        let mut m = model();
        let main = BodyId::MAIN;
        let x = m.lookup(main, "x").unwrap();
        let make = |m: &mut Model| Builder::new(m, main, "p").scalar_f32("k", 2.0);

        // Removed (dce drops unused initializers).
        let k = make(&mut m);
        m.body_mut(main).initializers.retain(|(v, _)| *v != k);
        let k2 = make(&mut m);
        assert_ne!(k2, k);
        assert_eq!(make(&mut m), k2);

        // Made a graph input.
        m.promote_initializer_to_input(k2);
        let k3 = make(&mut m);
        assert_ne!(k3, k2);

        // Given another value.
        m.set_initializer(k3, tensor_f32(&[], &[3.0]));
        let k4 = make(&mut m);
        assert_ne!(k4, k3);

        // A body output (a state's next value) stays its own.
        m.add_output(main, k4, Some(tensor_type(crate::proto::elem::FLOAT, &[])));
        let k5 = make(&mut m);
        assert_ne!(k5, k4);

        // Read by nodes only: still shared.
        Builder::new(&mut m, main, "p").op("Mul", &[x, k5], vec![], "y2");
        assert_eq!(make(&mut m), k5);
        assert_eq!(
            m.initializer(k5).and_then(|t| t.name.clone()).as_deref(),
            Some(m.name(k5))
        );
        crate::ir::verify::verify(&m).unwrap();
    }
}
