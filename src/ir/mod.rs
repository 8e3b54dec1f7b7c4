//! The rewrite IR: an arena of values and nodes over the prost ONNX types.
//!
//! Why not edit `ModelProto` directly: a proto only links values by name, so every
//! "who consumes `W_grad`?" is a full scan and a rename silently breaks the wiring. Here
//! every value knows its definition and its uses, both kept consistent by the mutation
//! API, and `If` bodies that read outer values say so (captures are derived from use
//! lists, never guessed).
//!
//! The IR is deliberately dumb and lossless: nodes keep their prost `NodeProto` (attributes,
//! doc strings, metadata), initializers stay raw `TensorProto`s, and everything a pass does
//! not touch is exported exactly as it was read (the `import` and `export` modules).
//!
//! Scopes: body 0 is the main graph; every `GRAPH`/`GRAPHS` attribute becomes another body
//! whose `parent` is the body of the node that owns it. Names resolve from the inner scope
//! outwards, as ONNX does.

pub mod builder;
pub mod dtype;
pub mod emit;
mod export;
mod import;
pub mod inline;
mod names;
pub mod print;
pub mod text;
pub mod verify;

pub(crate) use export::topological_order;
pub use names::NameAuthority;

use crate::proto::{
    AttributeProto, ModelProto, NodeProto, StringStringEntryProto, TensorProto, TypeProto,
    ValueInfoProto,
};

/// The metadata key that records which pass inserted a node.
pub const PASS_KEY: &str = "onnx_ga.pass";

#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub u32);

#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ValueId(pub u32);

/// A graph scope: the main graph or a subgraph attribute of a node.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BodyId(pub u32);

impl BodyId {
    pub const MAIN: BodyId = BodyId(0);
}

/// Where a value comes from. Exactly one definition per value; the verifier checks it.
#[derive(Clone, Debug, PartialEq)]
pub enum ValueDef {
    /// A graph input of `body` (possibly also backed by an initializer there).
    Input { body: BodyId },
    /// An initializer of `body` that is not a graph input.
    Initializer { body: BodyId },
    /// A sparse initializer of `body`.
    SparseInitializer { body: BodyId },
    /// Output `slot` of `node`.
    Node { node: NodeId, slot: usize },
    /// Used but defined nowhere (a broken model); kept so the verifier can report it.
    Undefined { body: BodyId },
}

/// One consumer of a value.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Use {
    /// Input `slot` of `node`.
    Node { node: NodeId, slot: usize },
    /// Output `index` of `body`.
    Output { body: BodyId, index: usize },
}

#[derive(Clone, Debug)]
pub struct Value {
    pub name: String,
    pub def: ValueDef,
    /// Consumers, kept in sync by the mutation API.
    pub(crate) uses: Vec<Use>,
}

#[derive(Clone, Debug)]
pub struct Node {
    /// The node as read: attributes, name, doc string, metadata. Its `input` and `output`
    /// name lists and its graph-valued attributes are rebuilt from the IR on export.
    pub proto: NodeProto,
    pub body: BodyId,
    /// `None` is an omitted optional input (the empty name in ONNX).
    pub inputs: Vec<Option<ValueId>>,
    /// `None` is an omitted optional output.
    pub outputs: Vec<Option<ValueId>>,
    /// Subgraph bodies, by attribute index (and position within a `GRAPHS` attribute).
    pub subgraphs: Vec<SubgraphRef>,
    pub(crate) removed: bool,
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct SubgraphRef {
    pub attribute: usize,
    /// `None` for a `GRAPH` attribute, `Some(i)` for element `i` of a `GRAPHS` attribute.
    pub element: Option<usize>,
    pub body: BodyId,
}

/// One graph scope. Lists keep their original order; each entry keeps its original proto
/// so untouched parts export byte for byte.
#[derive(Clone, Debug, Default)]
pub struct Body {
    pub parent: Option<BodyId>,
    /// The node owning this body as an attribute (`None` for the main graph).
    pub owner: Option<NodeId>,
    pub nodes: Vec<NodeId>,
    pub inputs: Vec<(ValueId, ValueInfoProto)>,
    pub outputs: Vec<(ValueId, ValueInfoProto)>,
    pub value_info: Vec<(ValueId, ValueInfoProto)>,
    pub initializers: Vec<(ValueId, TensorProto)>,
    pub sparse_initializers: Vec<(ValueId, crate::proto::SparseTensorProto)>,
    /// The graph proto with its nodes, inputs, outputs, value_info and initializers moved
    /// out: name, doc string, quantization annotations, metadata.
    pub rest: crate::proto::GraphProto,
}

/// A whole model in IR form.
#[derive(Clone, Debug)]
pub struct Model {
    /// Everything of the model except its graph: IR version, opsets, producer, metadata,
    /// functions, training info.
    pub header: ModelProto,
    pub bodies: Vec<Body>,
    pub nodes: Vec<Node>,
    pub values: Vec<Value>,
    pub names: NameAuthority,
    /// The constants [`Model::shared_constant`] made, for reuse; no part of the model
    /// (never exported), and trusted only after checking the value still is that constant.
    constants: std::collections::HashMap<ConstantKey, ValueId>,
}

/// What makes two constants the same one: the body, the pass that made it, its name hint and
/// its value (element type, dims, bytes).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct ConstantKey {
    body: BodyId,
    pass: &'static str,
    hint: String,
    elem: i32,
    dims: Vec<i64>,
    bytes: Vec<u8>,
}

/// Errors of IR mutations. Each names the values or nodes involved.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum IrError {
    #[error("cannot remove node {node}: its output '{value}' is still used")]
    StillUsed { node: String, value: String },
    #[error(
        "value '{0}' is a graph output; replacing its uses needs the explicit graph-output policy"
    )]
    GraphOutput(String),
    #[error("no value named '{0}' is visible in this scope")]
    UnknownValue(String),
}

impl Model {
    pub fn from_proto(model: ModelProto) -> Model {
        import::import(model)
    }

    pub fn to_proto(&self) -> ModelProto {
        export::export(self)
    }

    pub fn value(&self, v: ValueId) -> &Value {
        &self.values[v.0 as usize]
    }

    pub fn node(&self, n: NodeId) -> &Node {
        &self.nodes[n.0 as usize]
    }

    pub fn node_mut(&mut self, n: NodeId) -> &mut Node {
        &mut self.nodes[n.0 as usize]
    }

    pub fn body(&self, b: BodyId) -> &Body {
        &self.bodies[b.0 as usize]
    }

    pub fn body_mut(&mut self, b: BodyId) -> &mut Body {
        &mut self.bodies[b.0 as usize]
    }

    pub fn main(&self) -> &Body {
        self.body(BodyId::MAIN)
    }

    pub fn name(&self, v: ValueId) -> &str {
        &self.values[v.0 as usize].name
    }

    pub fn uses(&self, v: ValueId) -> &[Use] {
        &self.values[v.0 as usize].uses
    }

    /// The node and output slot that define `v`, if a node does.
    pub fn producer(&self, v: ValueId) -> Option<(NodeId, usize)> {
        match self.value(v).def {
            ValueDef::Node { node, slot } => Some((node, slot)),
            _ => None,
        }
    }

    /// Live nodes of a body, in their current order.
    pub fn body_nodes(&self, b: BodyId) -> impl Iterator<Item = NodeId> + '_ {
        self.body(b)
            .nodes
            .iter()
            .copied()
            .filter(|n| !self.node(*n).removed)
    }

    /// Every live node of the model, bodies included.
    pub fn all_nodes(&self) -> impl Iterator<Item = NodeId> + '_ {
        (0..self.nodes.len() as u32)
            .map(NodeId)
            .filter(|n| !self.node(*n).removed)
    }

    /// Resolves `name` in `body`, then in its enclosing scopes.
    pub fn lookup(&self, body: BodyId, name: &str) -> Option<ValueId> {
        let mut scope = Some(body);
        while let Some(b) = scope {
            if let Some(v) = self.lookup_local(b, name) {
                return Some(v);
            }
            scope = self.body(b).parent;
        }
        None
    }

    fn lookup_local(&self, body: BodyId, name: &str) -> Option<ValueId> {
        let b = self.body(body);
        let from_lists = b
            .inputs
            .iter()
            .map(|(v, _)| *v)
            .chain(b.initializers.iter().map(|(v, _)| *v))
            .chain(b.sparse_initializers.iter().map(|(v, _)| *v));
        let from_nodes = self
            .body_nodes(body)
            .flat_map(|n| self.node(n).outputs.iter().flatten().copied());
        from_lists.chain(from_nodes).find(|v| self.name(*v) == name)
    }

    /// The body in which `v` is defined.
    pub fn defining_body(&self, v: ValueId) -> BodyId {
        match self.value(v).def {
            ValueDef::Input { body }
            | ValueDef::Initializer { body }
            | ValueDef::SparseInitializer { body }
            | ValueDef::Undefined { body } => body,
            ValueDef::Node { node, .. } => self.node(node).body,
        }
    }

    /// True when `inner` is `outer` or nested inside it.
    pub fn is_within(&self, inner: BodyId, outer: BodyId) -> bool {
        let mut scope = Some(inner);
        while let Some(b) = scope {
            if b == outer {
                return true;
            }
            scope = self.body(b).parent;
        }
        false
    }

    /// Outer values that nodes of `body` (or of bodies nested in it) read by name.
    /// Sorted by value id, so the order is deterministic.
    pub fn captures(&self, body: BodyId) -> Vec<ValueId> {
        // Walk the body and the bodies nested in it (not every value of the model: unrolling
        // asks this once per nested node per iteration).
        let mut captured = Vec::new();
        let mut pending = vec![body];
        while let Some(b) = pending.pop() {
            let graph = self.body(b);
            let read = self
                .body_nodes(b)
                .flat_map(|n| self.node(n).inputs.iter().flatten())
                .chain(graph.outputs.iter().map(|(v, _)| v));
            for v in read {
                if !self.is_within(self.defining_body(*v), body) {
                    captured.push(*v);
                }
            }
            for n in self.body_nodes(b) {
                pending.extend(self.node(n).subgraphs.iter().map(|s| s.body));
            }
        }
        captured.sort();
        captured.dedup();
        captured
    }

    /// The declared type of `v`: from its graph input, output or value_info entry, or from
    /// the initializer that backs it.
    pub fn value_type(&self, v: ValueId) -> Option<TypeProto> {
        let body = self.body(self.defining_body(v));
        let declared = body
            .inputs
            .iter()
            .chain(&body.outputs)
            .chain(&body.value_info)
            .find(|(id, _)| *id == v)
            .and_then(|(_, vi)| vi.r#type.clone());
        declared.or_else(|| {
            self.initializer(v)
                .map(|t| tensor_type(t.data_type(), &t.dims))
        })
    }

    /// The initializer backing `v`, if any.
    pub fn initializer(&self, v: ValueId) -> Option<&TensorProto> {
        let body = self.body(self.defining_body(v));
        body.initializers
            .iter()
            .find(|(id, _)| *id == v)
            .map(|(_, t)| t)
    }

    /// The main graph's input values, in order.
    pub fn graph_inputs(&self) -> Vec<ValueId> {
        self.main().inputs.iter().map(|(v, _)| *v).collect()
    }

    /// The main graph's output values, in order.
    pub fn graph_outputs(&self) -> Vec<ValueId> {
        self.main().outputs.iter().map(|(v, _)| *v).collect()
    }

    /// Opset version imported for `domain` ("" and "ai.onnx" are the same domain).
    pub fn opset(&self, domain: &str) -> Option<i64> {
        let wanted = normalize_domain(domain);
        self.header
            .opset_import
            .iter()
            .find(|o| normalize_domain(o.domain()) == wanted)
            .map(|o| o.version())
    }

    // ---- mutation -------------------------------------------------------------------------

    fn push_value(&mut self, name: String, def: ValueDef) -> ValueId {
        let id = ValueId(self.values.len() as u32);
        self.values.push(Value {
            name,
            def,
            uses: Vec::new(),
        });
        id
    }

    /// A new initializer in `body` under a fresh name derived from `hint`.
    pub fn add_initializer(
        &mut self,
        body: BodyId,
        hint: &str,
        mut tensor: TensorProto,
    ) -> ValueId {
        let name = self.names.fresh(hint);
        tensor.name = Some(name.clone());
        let v = self.push_value(name, ValueDef::Initializer { body });
        self.body_mut(body).initializers.push((v, tensor));
        v
    }

    /// An initializer of `body` holding `tensor`, made by `pass` under a name from `hint`:
    /// the one that `pass` made before in `body` under the same hint with the same value,
    /// else a new one ([`add_initializer`](Self::add_initializer)). So a pass asking twice
    /// for `ga.one` gets one initializer, while a constant of the user's graph or of another
    /// pass is never shared. The earlier one is reused only while it still is exactly that
    /// initializer of `body`: not removed (dce), not made a graph input
    /// ([`promote_initializer_to_input`](Self::promote_initializer_to_input)), not given
    /// another tensor ([`set_initializer`](Self::set_initializer)), not moved by an inline,
    /// and not a body output (a state's next value; two outputs must not share one name).
    /// A pass that will change or promote its constant must make it with `add_initializer`.
    pub fn shared_constant(
        &mut self,
        body: BodyId,
        pass: &'static str,
        hint: &str,
        tensor: TensorProto,
    ) -> ValueId {
        let key = ConstantKey {
            body,
            pass,
            hint: hint.to_string(),
            elem: tensor.data_type(),
            dims: tensor.dims.clone(),
            bytes: tensor.raw_data.clone().unwrap_or_default(),
        };
        if let Some(&v) = self.constants.get(&key) {
            if self.is_constant(body, v, &tensor) {
                return v;
            }
        }
        let v = self.add_initializer(body, hint, tensor);
        self.constants.insert(key, v);
        v
    }

    /// Whether `v` still is a plain initializer of `body` holding exactly `tensor` (under
    /// its name), read by no body output.
    fn is_constant(&self, body: BodyId, v: ValueId, tensor: &TensorProto) -> bool {
        let name = self.name(v);
        self.value(v).def == (ValueDef::Initializer { body })
            && !self.uses(v).iter().any(|u| matches!(u, Use::Output { .. }))
            && self.body(body).initializers.iter().any(|(id, t)| {
                *id == v
                    && t.name.as_deref() == Some(name)
                    && *t
                        == TensorProto {
                            name: t.name.clone(),
                            ..tensor.clone()
                        }
            })
    }

    /// A new graph input of `body`, backed by `default` as an initializer of the same name
    /// when given. (State starts from these while the passes run; `step::build_step` then
    /// drops the initializers of state that starts at zeros, which hosts make from the
    /// input's type: `"init": "zeros"` in the manifest.)
    pub fn add_input(
        &mut self,
        body: BodyId,
        name: &str,
        ty: TypeProto,
        default: Option<TensorProto>,
    ) -> ValueId {
        let name = self.names.fresh(name);
        let v = self.push_value(name.clone(), ValueDef::Input { body });
        let info = ValueInfoProto {
            name: Some(name.clone()),
            r#type: Some(ty),
            ..Default::default()
        };
        self.body_mut(body).inputs.push((v, info));
        if let Some(mut t) = default {
            t.name = Some(name);
            self.body_mut(body).initializers.push((v, t));
        }
        v
    }

    /// Appends `v` to the outputs of `body`, declared with `ty`.
    pub fn add_output(&mut self, body: BodyId, v: ValueId, ty: Option<TypeProto>) {
        let info = ValueInfoProto {
            name: Some(self.name(v).to_string()),
            r#type: ty,
            ..Default::default()
        };
        let b = self.body_mut(body);
        let index = b.outputs.len();
        b.outputs.push((v, info));
        self.values[v.0 as usize]
            .uses
            .push(Use::Output { body, index });
    }

    /// Records (or replaces) the declared type of an intermediate value.
    pub fn set_value_type(&mut self, v: ValueId, ty: TypeProto) {
        let body = self.defining_body(v);
        let name = self.name(v).to_string();
        let b = self.body_mut(body);
        if let Some((_, vi)) = b.value_info.iter_mut().find(|(id, _)| *id == v) {
            vi.r#type = Some(ty);
        } else {
            b.value_info.push((
                v,
                ValueInfoProto {
                    name: Some(name),
                    r#type: Some(ty),
                    ..Default::default()
                },
            ));
        }
    }

    /// Adds a node at the end of `body`; export places it in topological order. Output
    /// values get fresh names from `output_hints`; the node records the pass that made it.
    pub fn add_node(&mut self, body: BodyId, spec: NodeSpec<'_>) -> NodeId {
        let id = NodeId(self.nodes.len() as u32);
        let name = self.names.fresh(spec.name_hint.unwrap_or(spec.op_type));
        let mut proto = NodeProto {
            name: Some(name),
            op_type: Some(spec.op_type.to_string()),
            attribute: spec.attributes,
            ..Default::default()
        };
        if !spec.domain.is_empty() {
            proto.domain = Some(spec.domain.to_string());
        }
        if let Some(pass) = spec.pass {
            proto.metadata_props.push(StringStringEntryProto {
                key: Some(PASS_KEY.to_string()),
                value: Some(pass.to_string()),
            });
        }
        let outputs: Vec<Option<ValueId>> = spec
            .output_hints
            .iter()
            .enumerate()
            .map(|(slot, hint)| {
                let name = self.names.fresh(hint);
                Some(self.push_value(name, ValueDef::Node { node: id, slot }))
            })
            .collect();
        for (slot, input) in spec.inputs.iter().enumerate() {
            if let Some(v) = input {
                self.values[v.0 as usize]
                    .uses
                    .push(Use::Node { node: id, slot });
            }
        }
        self.nodes.push(Node {
            proto,
            body,
            inputs: spec.inputs.to_vec(),
            outputs,
            subgraphs: Vec::new(),
            removed: false,
        });
        self.body_mut(body).nodes.push(id);
        id
    }

    /// Moves `node` to just after `anchor` in their body's node list, which export's
    /// topological order follows where the data allows: a node that replaces another runs
    /// where that one ran, instead of after every node ready before it (a sum read by
    /// nothing but the graph's outputs would otherwise run last, its input kept alive and
    /// evicted from the cache by then). A no-op unless both are in the same body.
    pub fn place_after(&mut self, node: NodeId, anchor: NodeId) {
        let body = self.node(node).body;
        if self.node(anchor).body != body {
            return;
        }
        let nodes = &mut self.body_mut(body).nodes;
        nodes.retain(|n| *n != node);
        let at = nodes
            .iter()
            .position(|n| *n == anchor)
            .map_or(nodes.len(), |i| i + 1);
        nodes.insert(at, node);
    }

    /// Output `slot` of `node`. Panics only on a slot the node never had (a pass bug).
    pub fn output(&self, node: NodeId, slot: usize) -> ValueId {
        self.node(node).outputs[slot].expect("node output slot is present")
    }

    /// Sets input `slot` of `node` to `value`, first extending its inputs with omitted ones
    /// when it has fewer (an optional input after the last one given).
    pub fn set_input_growing(&mut self, node: NodeId, slot: usize, value: ValueId) {
        let inputs = &mut self.nodes[node.0 as usize].inputs;
        if inputs.len() <= slot {
            inputs.resize(slot + 1, None);
        }
        self.set_input(node, slot, Some(value));
    }

    /// Rewires input `slot` of `node` to `value` (or to nothing).
    pub fn set_input(&mut self, node: NodeId, slot: usize, value: Option<ValueId>) {
        if let Some(old) = self.node(node).inputs[slot] {
            self.values[old.0 as usize]
                .uses
                .retain(|u| *u != Use::Node { node, slot });
        }
        if let Some(new) = value {
            self.values[new.0 as usize]
                .uses
                .push(Use::Node { node, slot });
        }
        self.nodes[node.0 as usize].inputs[slot] = value;
    }

    /// Points every node use of `old` at `new`. Graph outputs keep `old` unless
    /// `include_outputs`, because renaming a graph output changes the model's interface.
    pub fn replace_all_uses(
        &mut self,
        old: ValueId,
        new: ValueId,
        include_outputs: bool,
    ) -> Result<(), IrError> {
        let uses = self.value(old).uses.clone();
        if !include_outputs && uses.iter().any(|u| matches!(u, Use::Output { .. })) {
            return Err(IrError::GraphOutput(self.name(old).to_string()));
        }
        for u in uses {
            match u {
                Use::Node { node, slot } => self.set_input(node, slot, Some(new)),
                Use::Output { body, index } => self.set_output(body, index, new),
            }
        }
        Ok(())
    }

    /// Moves every use of `old` (graph outputs included) to `new`, and gives `new` the name
    /// of `old` when `old` was a graph output, so the model's interface keeps its names.
    /// `old` is left unused under a fresh name, ready for its node's removal.
    pub fn replace_value(&mut self, old: ValueId, new: ValueId) {
        let was_output = self
            .uses(old)
            .iter()
            .any(|u| matches!(u, Use::Output { .. }));
        let _ = self.replace_all_uses(old, new, true);
        if was_output {
            let old_name = std::mem::take(&mut self.values[old.0 as usize].name);
            let retired = self.names.fresh(&format!("{old_name}_replaced"));
            self.values[old.0 as usize].name = retired;
            self.values[new.0 as usize].name = old_name;
        }
    }

    /// True when `name` is (or was) held by something in this model.
    pub fn has_name(&self, name: &str) -> bool {
        self.names.is_taken(name)
    }

    /// Removes output `index` of `body`; later outputs move up by one.
    pub fn remove_output(&mut self, body: BodyId, index: usize) {
        let (v, _) = self.body_mut(body).outputs.remove(index);
        self.values[v.0 as usize]
            .uses
            .retain(|u| *u != Use::Output { body, index });
        for value in &mut self.values {
            for u in &mut value.uses {
                if let Use::Output { body: b, index: i } = u {
                    if *b == body && *i > index {
                        *i -= 1;
                    }
                }
            }
        }
    }

    /// Inserts `v` as output `index` of `body` (declared with `ty`), the outputs from
    /// `index` on moving up one.
    pub fn insert_output(&mut self, body: BodyId, index: usize, v: ValueId, ty: Option<TypeProto>) {
        for value in &mut self.values {
            for u in &mut value.uses {
                if let Use::Output { body: b, index: i } = u {
                    if *b == body && *i >= index {
                        *i += 1;
                    }
                }
            }
        }
        let info = ValueInfoProto {
            name: Some(self.name(v).to_string()),
            r#type: ty,
            ..Default::default()
        };
        self.body_mut(body).outputs.insert(index, (v, info));
        self.values[v.0 as usize]
            .uses
            .push(Use::Output { body, index });
    }

    /// Inserts a new output (named from `hint`) at `slot` of `node`, the outputs from `slot`
    /// on moving up one.
    pub fn insert_node_output(&mut self, node: NodeId, slot: usize, hint: &str) -> ValueId {
        let later: Vec<ValueId> = self
            .node(node)
            .outputs
            .iter()
            .skip(slot)
            .flatten()
            .copied()
            .collect();
        for v in later {
            if let ValueDef::Node { slot: s, .. } = &mut self.values[v.0 as usize].def {
                *s += 1;
            }
        }
        let name = self.names.fresh(hint);
        let v = self.push_value(name, ValueDef::Node { node, slot });
        let outputs = &mut self.nodes[node.0 as usize].outputs;
        if outputs.len() < slot {
            outputs.resize(slot, None);
        }
        outputs.insert(slot, Some(v));
        v
    }

    /// Output `slot` of `node`, created (named from `hint`) when the node omits it, e.g. the
    /// optional `Mean` and `InvStdDev` outputs of a forward LayerNormalization that its
    /// gradient reuses. Omitted slots before it stay omitted.
    pub fn ensure_node_output(&mut self, node: NodeId, slot: usize, hint: &str) -> ValueId {
        if let Some(Some(v)) = self.node(node).outputs.get(slot) {
            return *v;
        }
        let name = self.names.fresh(hint);
        let v = self.push_value(name, ValueDef::Node { node, slot });
        let outputs = &mut self.nodes[node.0 as usize].outputs;
        if outputs.len() <= slot {
            outputs.resize(slot + 1, None);
        }
        outputs[slot] = Some(v);
        v
    }

    /// Gives a node-defined value a new name (fresh from `hint`), e.g. `W_grad` for the sum
    /// that ends up holding a parameter's gradient. Names of graph inputs and initializers
    /// are the model's interface and stay.
    pub fn rename(&mut self, v: ValueId, hint: &str) {
        if matches!(self.value(v).def, ValueDef::Node { .. }) && self.name(v) != hint {
            let name = self.names.fresh(hint);
            self.values[v.0 as usize].name = name;
        }
    }

    /// Exchanges the names of two node-defined values (both stay unique).
    pub fn swap_names(&mut self, a: ValueId, b: ValueId) {
        let node_defined = |m: &Model, v: ValueId| matches!(m.value(v).def, ValueDef::Node { .. });
        if a != b && node_defined(self, a) && node_defined(self, b) {
            let name_a = std::mem::take(&mut self.values[a.0 as usize].name);
            let name_b = std::mem::replace(&mut self.values[b.0 as usize].name, name_a);
            self.values[a.0 as usize].name = name_b;
        }
    }

    /// Turns the initializer `v` of the main graph into a graph input backed by that
    /// initializer (the state convention: parameters are inputs with default values).
    /// No-op for a value that already is an input.
    pub fn promote_initializer_to_input(&mut self, v: ValueId) {
        let ValueDef::Initializer { body } = self.value(v).def else {
            return;
        };
        let Some(tensor) = self.initializer(v) else {
            return;
        };
        let ty = tensor_type(tensor.data_type(), &tensor.dims);
        let info = ValueInfoProto {
            name: Some(self.name(v).to_string()),
            r#type: Some(ty),
            ..Default::default()
        };
        self.values[v.0 as usize].def = ValueDef::Input { body };
        self.body_mut(body).inputs.push((v, info));
    }

    /// Adds one more output to `node` (for `If`, whose outputs grow with its branches).
    pub fn add_node_output(&mut self, node: NodeId, hint: &str) -> ValueId {
        let slot = self.node(node).outputs.len();
        let name = self.names.fresh(hint);
        let v = self.push_value(name, ValueDef::Node { node, slot });
        self.nodes[node.0 as usize].outputs.push(Some(v));
        v
    }

    /// Creates an empty subgraph body owned by `node` as graph attribute `attribute_name`.
    pub fn add_subgraph(&mut self, node: NodeId, attribute_name: &str) -> BodyId {
        let body = BodyId(self.bodies.len() as u32);
        let parent = self.node(node).body;
        let graph_name = self.names.fresh(&format!(
            "{}_{attribute_name}",
            self.node(node).proto.name()
        ));
        self.bodies.push(Body {
            parent: Some(parent),
            owner: Some(node),
            rest: crate::proto::GraphProto {
                name: Some(graph_name),
                ..Default::default()
            },
            ..Default::default()
        });
        let n = &mut self.nodes[node.0 as usize];
        let attribute = n.proto.attribute.len();
        n.proto.attribute.push(AttributeProto {
            name: Some(attribute_name.to_string()),
            r#type: Some(crate::proto::attribute_proto::AttributeType::Graph as i32),
            ..Default::default()
        });
        n.subgraphs.push(SubgraphRef {
            attribute,
            element: None,
            body,
        });
        body
    }

    /// Gives `value` the initializer `tensor` (renamed to the value's name): a graph input
    /// then has a default, so a run that does not feed it uses this value.
    pub fn set_initializer(&mut self, value: ValueId, mut tensor: TensorProto) {
        tensor.name = Some(self.name(value).to_string());
        let body = self.defining_body(value);
        let b = self.body_mut(body);
        match b.initializers.iter_mut().find(|(v, _)| *v == value) {
            Some((_, t)) => *t = tensor,
            None => b.initializers.push((value, tensor)),
        }
    }

    /// Makes output `index` of `body` carry `value`.
    pub fn set_output(&mut self, body: BodyId, index: usize, value: ValueId) {
        let old = self.body(body).outputs[index].0;
        self.values[old.0 as usize]
            .uses
            .retain(|u| *u != Use::Output { body, index });
        self.values[value.0 as usize]
            .uses
            .push(Use::Output { body, index });
        self.body_mut(body).outputs[index].0 = value;
    }

    /// Removes a node whose outputs are all unused. Its inputs lose this use.
    pub fn remove_node(&mut self, node: NodeId) -> Result<(), IrError> {
        if let Some(used) = self
            .node(node)
            .outputs
            .iter()
            .flatten()
            .find(|v| !self.uses(**v).is_empty())
        {
            return Err(IrError::StillUsed {
                node: self.node(node).proto.name().to_string(),
                value: self.name(*used).to_string(),
            });
        }
        for slot in 0..self.node(node).inputs.len() {
            self.set_input(node, slot, None);
        }
        self.nodes[node.0 as usize].removed = true;
        let body = self.node(node).body;
        let outputs: Vec<ValueId> = self.node(node).outputs.iter().flatten().copied().collect();
        let b = self.body_mut(body);
        b.nodes.retain(|n| *n != node);
        b.value_info.retain(|(v, _)| !outputs.contains(v));
        Ok(())
    }

    /// Removes a graph input (and its initializer) that nothing uses any more.
    pub fn remove_input(&mut self, v: ValueId) -> Result<(), IrError> {
        if !self.uses(v).is_empty() {
            return Err(IrError::StillUsed {
                node: "<graph input>".into(),
                value: self.name(v).to_string(),
            });
        }
        let body = self.defining_body(v);
        let b = self.body_mut(body);
        b.inputs.retain(|(id, _)| *id != v);
        b.initializers.retain(|(id, _)| *id != v);
        b.value_info.retain(|(id, _)| *id != v);
        Ok(())
    }

    /// Ensures `domain` is imported at least at `version`.
    pub fn require_opset(&mut self, domain: &str, version: i64) {
        let wanted = normalize_domain(domain);
        match self
            .header
            .opset_import
            .iter_mut()
            .find(|o| normalize_domain(o.domain()) == wanted)
        {
            Some(o) if o.version() >= version => {}
            Some(o) => o.version = Some(version),
            None => self
                .header
                .opset_import
                .push(crate::proto::OperatorSetIdProto {
                    domain: Some(domain.to_string()),
                    version: Some(version),
                }),
        }
    }
}

/// What a pass says about a node it adds.
pub struct NodeSpec<'a> {
    pub op_type: &'a str,
    pub domain: &'a str,
    pub inputs: &'a [Option<ValueId>],
    pub output_hints: &'a [&'a str],
    pub attributes: Vec<AttributeProto>,
    pub name_hint: Option<&'a str>,
    pub pass: Option<&'a str>,
}

/// Whether ONNX element type `elem` is floating point (float, double, float16, bfloat16):
/// the types that carry gradients and that autodiff trains.
pub fn is_float_elem(elem: i32) -> bool {
    use crate::proto::tensor_proto::DataType;
    [
        DataType::Float,
        DataType::Double,
        DataType::Float16,
        DataType::Bfloat16,
    ]
    .iter()
    .any(|t| *t as i32 == elem)
}

/// "" and "ai.onnx" name the same domain.
pub fn normalize_domain(domain: &str) -> &str {
    if domain == "ai.onnx" {
        ""
    } else {
        domain
    }
}

/// A tensor `TypeProto` with a static shape.
pub fn tensor_type(elem_type: i32, dims: &[i64]) -> TypeProto {
    use crate::proto::{
        tensor_shape_proto::{dimension::Value as Dim, Dimension},
        type_proto, TensorShapeProto,
    };
    TypeProto {
        value: Some(type_proto::Value::TensorType(type_proto::Tensor {
            elem_type: Some(elem_type),
            shape: Some(TensorShapeProto {
                dim: dims
                    .iter()
                    .map(|d| Dimension {
                        value: Some(Dim::DimValue(*d)),
                        denotation: None,
                    })
                    .collect(),
            }),
        })),
        denotation: None,
    }
}
