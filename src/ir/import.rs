//! `ModelProto` -> IR. Lossless: every proto is kept, only the links become explicit.
//!
//! Names resolve the way ONNX resolves them: the current graph first, then the enclosing
//! graphs. All node outputs of a body are defined before any input is resolved, so a
//! graph that is not topologically sorted still imports (the verifier reports it).
//! A name that resolves nowhere becomes an `Undefined` value, also for the verifier.

use std::collections::HashMap;

use super::{
    Body, BodyId, Model, NameAuthority, Node, NodeId, SubgraphRef, Use, Value, ValueDef, ValueId,
};
use crate::proto::{GraphProto, ModelProto};

pub(super) fn import(mut proto: ModelProto) -> Model {
    let graph = proto.graph.take().unwrap_or_default();
    let mut importer = Importer {
        model: Model {
            header: proto,
            bodies: Vec::new(),
            nodes: Vec::new(),
            values: Vec::new(),
            names: NameAuthority::default(),
            constants: Default::default(),
        },
        scopes: Vec::new(),
    };
    importer.import_body(graph, None, None);
    importer.model
}

struct Importer {
    model: Model,
    /// Per body: the names it defines.
    scopes: Vec<HashMap<String, ValueId>>,
}

impl Importer {
    fn new_value(&mut self, name: &str, def: ValueDef) -> ValueId {
        let id = ValueId(self.model.values.len() as u32);
        self.model.names.reserve(name);
        self.model.values.push(Value {
            name: name.to_string(),
            def,
            uses: Vec::new(),
        });
        id
    }

    /// Defines `name` in `body` unless it is already defined there (a duplicate definition
    /// still gets its own value, so the verifier can report it; lookups see the first).
    fn define(&mut self, body: BodyId, name: &str, def: ValueDef) -> ValueId {
        let v = self.new_value(name, def);
        self.scopes[body.0 as usize]
            .entry(name.to_string())
            .or_insert(v);
        v
    }

    fn resolve(&mut self, body: BodyId, name: &str) -> ValueId {
        let mut scope = Some(body);
        while let Some(b) = scope {
            if let Some(v) = self.scopes[b.0 as usize].get(name) {
                return *v;
            }
            scope = self.model.bodies[b.0 as usize].parent;
        }
        self.define(body, name, ValueDef::Undefined { body })
    }

    fn import_body(
        &mut self,
        mut graph: GraphProto,
        parent: Option<BodyId>,
        owner: Option<NodeId>,
    ) -> BodyId {
        let body = BodyId(self.model.bodies.len() as u32);
        self.model.bodies.push(Body {
            parent,
            owner,
            ..Default::default()
        });
        self.scopes.push(HashMap::new());

        let inputs = std::mem::take(&mut graph.input);
        let initializers = std::mem::take(&mut graph.initializer);
        let sparse = std::mem::take(&mut graph.sparse_initializer);
        let nodes = std::mem::take(&mut graph.node);
        let outputs = std::mem::take(&mut graph.output);
        let value_info = std::mem::take(&mut graph.value_info);

        let mut b_inputs = Vec::with_capacity(inputs.len());
        for info in inputs {
            let v = self.define(body, info.name(), ValueDef::Input { body });
            b_inputs.push((v, info));
        }
        let mut b_inits = Vec::with_capacity(initializers.len());
        for tensor in initializers {
            // An initializer named like a graph input is that input's default value.
            let as_input = b_inputs
                .iter()
                .find(|(v, _)| self.model.values[v.0 as usize].name == tensor.name())
                .map(|(v, _)| *v);
            let v = match as_input {
                Some(v) if !b_inits.iter().any(|(i, _)| *i == v) => v,
                _ => self.define(body, tensor.name(), ValueDef::Initializer { body }),
            };
            b_inits.push((v, tensor));
        }
        let mut b_sparse = Vec::with_capacity(sparse.len());
        for tensor in sparse {
            let name = tensor
                .values
                .as_ref()
                .map(|t| t.name().to_string())
                .unwrap_or_default();
            let v = self.define(body, &name, ValueDef::SparseInitializer { body });
            b_sparse.push((v, tensor));
        }
        {
            let b = &mut self.model.bodies[body.0 as usize];
            b.inputs = b_inputs;
            b.initializers = b_inits;
            b.sparse_initializers = b_sparse;
        }

        // Define every node output first, then wire inputs and subgraphs.
        let mut node_ids = Vec::with_capacity(nodes.len());
        let mut pending = Vec::with_capacity(nodes.len());
        for mut proto in nodes {
            let id = NodeId(self.model.nodes.len() as u32);
            self.model.names.reserve(proto.name());
            let output_names = std::mem::take(&mut proto.output);
            let outputs = output_names
                .iter()
                .enumerate()
                .map(|(slot, name)| {
                    (!name.is_empty())
                        .then(|| self.define(body, name, ValueDef::Node { node: id, slot }))
                })
                .collect();
            let input_names = std::mem::take(&mut proto.input);
            self.model.nodes.push(Node {
                proto,
                body,
                inputs: Vec::new(),
                outputs,
                subgraphs: Vec::new(),
                removed: false,
            });
            node_ids.push(id);
            pending.push((id, input_names));
        }
        self.model.bodies[body.0 as usize].nodes = node_ids;

        for (id, input_names) in pending {
            let inputs: Vec<Option<ValueId>> = input_names
                .iter()
                .map(|name| (!name.is_empty()).then(|| self.resolve(body, name)))
                .collect();
            for (slot, v) in inputs.iter().enumerate() {
                if let Some(v) = v {
                    self.model.values[v.0 as usize]
                        .uses
                        .push(Use::Node { node: id, slot });
                }
            }
            self.model.nodes[id.0 as usize].inputs = inputs;

            let mut subgraphs = Vec::new();
            let attribute_count = self.model.nodes[id.0 as usize].proto.attribute.len();
            for attribute in 0..attribute_count {
                let attr = &mut self.model.nodes[id.0 as usize].proto.attribute[attribute];
                let single = attr.g.take();
                let many = std::mem::take(&mut attr.graphs);
                if let Some(g) = single {
                    let sub = self.import_body(g, Some(body), Some(id));
                    subgraphs.push(SubgraphRef {
                        attribute,
                        element: None,
                        body: sub,
                    });
                }
                for (element, g) in many.into_iter().enumerate() {
                    let sub = self.import_body(g, Some(body), Some(id));
                    subgraphs.push(SubgraphRef {
                        attribute,
                        element: Some(element),
                        body: sub,
                    });
                }
            }
            self.model.nodes[id.0 as usize].subgraphs = subgraphs;
        }

        let mut b_outputs = Vec::with_capacity(outputs.len());
        for (index, info) in outputs.into_iter().enumerate() {
            let v = self.resolve(body, info.name());
            self.model.values[v.0 as usize]
                .uses
                .push(Use::Output { body, index });
            b_outputs.push((v, info));
        }
        let mut b_value_info = Vec::with_capacity(value_info.len());
        for info in value_info {
            let v = self.resolve(body, info.name());
            b_value_info.push((v, info));
        }
        let b = &mut self.model.bodies[body.0 as usize];
        b.outputs = b_outputs;
        b.value_info = b_value_info;
        b.rest = graph;
        body
    }
}
