//! The verifier: checks every invariant of the IR and collects every violation.
//!
//! Invariants:
//! 1. Every used value has exactly one definition (graph input, initializer, sparse
//!    initializer or node output), visible from the scope of its use.
//! 2. Use lists and node inputs / graph outputs agree in both directions.
//! 3. Each body is acyclic (captures by subgraphs count as reads of the owning node).
//! 4. Value names are unique across all scopes (ONNX forbids shadowing), node names are
//!    unique where given.
//! 5. Every node's domain is declared in `opset_import`.
//! 6. `If` has `then_branch` and `else_branch`, no branch inputs, and both branches have
//!    as many outputs as the node, with the same element types where declared.
//! 7. When the model records training state (`onnx_ga.state`), each state input is a graph
//!    input and has exactly one state output, which is a graph output.

use std::collections::{HashMap, HashSet};
use std::fmt;

use super::{BodyId, Model, NodeId, Use, ValueDef, ValueId};
use crate::proto::{attribute_proto::AttributeType, type_proto};

/// One violated invariant, with where it was found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerifyError {
    /// E.g. `main: node 'Add_1' (Add)` or `main/If_0.then_branch: output 0 'y'`.
    pub location: String,
    pub message: String,
}

impl fmt::Display for VerifyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.location, self.message)
    }
}

/// All violations of one verification.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct VerifyErrors(pub Vec<VerifyError>);

impl fmt::Display for VerifyErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the graph fails verification ({} error{}):",
            self.0.len(),
            if self.0.len() == 1 { "" } else { "s" }
        )?;
        for e in &self.0 {
            write!(f, "\n  {e}")?;
        }
        Ok(())
    }
}

/// The metadata key of the state manifest (written by the export of a rewritten step).
pub use crate::state::STATE_KEY;

pub fn verify(model: &Model) -> Result<(), VerifyErrors> {
    let mut v = Verifier {
        model,
        errors: Vec::new(),
    };
    v.definitions();
    v.use_lists();
    v.acyclic();
    v.unique_names();
    v.opsets();
    v.if_branches();
    v.state_pairs();
    if v.errors.is_empty() {
        Ok(())
    } else {
        Err(VerifyErrors(v.errors))
    }
}

/// `main`, or `main/<node>.<attribute>` for a subgraph body, recursively.
pub fn body_path(model: &Model, body: BodyId) -> String {
    match model.body(body).owner {
        None => "main".to_string(),
        Some(owner) => {
            let node = model.node(owner);
            let parent = body_path(model, node.body);
            let attr = node
                .subgraphs
                .iter()
                .find(|s| s.body == body)
                .map(|s| {
                    let name = node.proto.attribute[s.attribute].name();
                    match s.element {
                        Some(i) => format!("{name}[{i}]"),
                        None => name.to_string(),
                    }
                })
                .unwrap_or_default();
            format!("{parent}/{}.{attr}", node_label(model, owner))
        }
    }
}

fn node_label(model: &Model, n: NodeId) -> String {
    let name = model.node(n).proto.name();
    if name.is_empty() {
        format!("#{}", n.0)
    } else {
        name.to_string()
    }
}

struct Verifier<'a> {
    model: &'a Model,
    errors: Vec<VerifyError>,
}

impl Verifier<'_> {
    fn at_node(&mut self, n: NodeId, message: String) {
        let node = self.model.node(n);
        let location = format!(
            "{}: node '{}' ({})",
            body_path(self.model, node.body),
            node_label(self.model, n),
            node.proto.op_type()
        );
        self.errors.push(VerifyError { location, message });
    }

    fn at_body(&mut self, body: BodyId, what: String, message: String) {
        let location = format!("{}: {what}", body_path(self.model, body));
        self.errors.push(VerifyError { location, message });
    }

    fn live_values(&self) -> impl Iterator<Item = ValueId> + '_ {
        let m = self.model;
        (0..m.values.len() as u32)
            .map(ValueId)
            .filter(move |v| match m.value(*v).def {
                ValueDef::Node { node, .. } => !m.node(node).removed,
                ValueDef::Input { body } => m.body(body).inputs.iter().any(|(id, _)| id == v),
                ValueDef::Initializer { body } => {
                    m.body(body).initializers.iter().any(|(id, _)| id == v)
                }
                ValueDef::SparseInitializer { body } => m
                    .body(body)
                    .sparse_initializers
                    .iter()
                    .any(|(id, _)| id == v),
                ValueDef::Undefined { .. } => !m.uses(*v).is_empty(),
            })
    }

    /// Invariant 1.
    fn definitions(&mut self) {
        let m = self.model;
        for n in m.all_nodes().collect::<Vec<_>>() {
            let node = m.node(n);
            for (slot, input) in node.inputs.iter().enumerate() {
                let Some(v) = *input else { continue };
                match m.value(v).def {
                    ValueDef::Undefined { .. } => {
                        self.at_node(n, format!("input {slot} '{}' is not defined by any node, graph input or initializer", m.name(v)));
                    }
                    _ if !m.is_within(node.body, m.defining_body(v)) => self.at_node(
                        n,
                        format!(
                            "input {slot} '{}' is defined in {}, which is not visible here",
                            m.name(v),
                            body_path(m, m.defining_body(v))
                        ),
                    ),
                    _ => {}
                }
            }
        }
        for b in 0..m.bodies.len() as u32 {
            let body = BodyId(b);
            if m.body(body).owner.is_some_and(|o| m.node(o).removed) {
                continue;
            }
            for (index, (v, _)) in m.body(body).outputs.iter().enumerate() {
                if let ValueDef::Undefined { .. } = m.value(*v).def {
                    self.at_body(
                        body,
                        format!("output {index} '{}'", m.name(*v)),
                        "is not defined by any node, graph input or initializer".into(),
                    );
                }
            }
            let mut seen_init = HashSet::new();
            for (v, _) in &m.body(body).initializers {
                if !seen_init.insert(*v) {
                    self.at_body(
                        body,
                        format!("initializer '{}'", m.name(*v)),
                        "appears twice".into(),
                    );
                }
            }
        }
    }

    /// Invariant 2.
    fn use_lists(&mut self) {
        let m = self.model;
        for n in m.all_nodes().collect::<Vec<_>>() {
            for (slot, input) in m.node(n).inputs.iter().enumerate() {
                if let Some(v) = input {
                    if !m.uses(*v).contains(&Use::Node { node: n, slot }) {
                        self.at_node(
                            n,
                            format!(
                                "input {slot} '{}' is missing from that value's use list",
                                m.name(*v)
                            ),
                        );
                    }
                }
            }
            for (slot, output) in m.node(n).outputs.iter().enumerate() {
                if let Some(v) = output {
                    if m.value(*v).def != (ValueDef::Node { node: n, slot }) {
                        self.at_node(
                            n,
                            format!("output {slot} '{}' names another definition", m.name(*v)),
                        );
                    }
                }
            }
        }
        for v in 0..m.values.len() as u32 {
            let v = ValueId(v);
            for u in m.uses(v) {
                let consistent = match *u {
                    Use::Node { node, slot } => {
                        !m.node(node).removed
                            && m.node(node).inputs.get(slot).copied().flatten() == Some(v)
                    }
                    Use::Output { body, index } => {
                        m.body(body).outputs.get(index).map(|(o, _)| *o) == Some(v)
                    }
                };
                if !consistent {
                    let body = m.defining_body(v);
                    self.at_body(
                        body,
                        format!("value '{}'", m.name(v)),
                        format!("use list names {u:?}, which does not read it"),
                    );
                }
            }
        }
    }

    /// Invariant 3.
    fn acyclic(&mut self) {
        let m = self.model;
        for b in 0..m.bodies.len() as u32 {
            let body = BodyId(b);
            let order = super::export::topological_order(m, body);
            let position: HashMap<NodeId, usize> =
                order.iter().enumerate().map(|(i, n)| (*n, i)).collect();
            for (i, n) in order.iter().enumerate() {
                let late = super::export::node_reads(m, *n)
                    .into_iter()
                    .filter_map(|v| m.producer(v))
                    .find(|(p, _)| position.get(p).is_some_and(|pos| *pos >= i));
                if let Some((p, _)) = late {
                    self.at_node(
                        *n,
                        format!(
                            "is part of a cycle (it reads an output of '{}')",
                            node_label(m, p)
                        ),
                    );
                }
            }
        }
    }

    /// Invariant 4.
    fn unique_names(&mut self) {
        let m = self.model;
        let mut first: HashMap<&str, ValueId> = HashMap::new();
        for v in self.live_values().collect::<Vec<_>>() {
            let name = m.name(v);
            if name.is_empty() {
                continue;
            }
            match first.get(name) {
                Some(other) if *other != v => {
                    let body = m.defining_body(v);
                    self.at_body(
                        body,
                        format!("value '{name}'"),
                        format!(
                            "is defined again (first defined in {})",
                            body_path(m, m.defining_body(*other))
                        ),
                    );
                }
                _ => {
                    first.insert(name, v);
                }
            }
        }
        let mut node_names: HashMap<&str, NodeId> = HashMap::new();
        for n in m.all_nodes().collect::<Vec<_>>() {
            let name = m.node(n).proto.name();
            if name.is_empty() {
                continue;
            }
            if node_names.insert(name, n).is_some() {
                self.at_node(n, "node name is used by another node too".into());
            }
        }
    }

    /// Invariant 5.
    fn opsets(&mut self) {
        let m = self.model;
        for n in m.all_nodes().collect::<Vec<_>>() {
            let domain = m.node(n).proto.domain();
            if m.opset(domain).is_none() {
                self.at_node(
                    n,
                    format!("domain '{domain}' is not declared in opset_import"),
                );
            }
        }
    }

    /// Invariant 6.
    fn if_branches(&mut self) {
        let m = self.model;
        for n in m.all_nodes().collect::<Vec<_>>() {
            let node = m.node(n);
            if node.proto.op_type() != "If" || !node.proto.domain().is_empty() {
                continue;
            }
            let branch = |name: &str| {
                node.subgraphs
                    .iter()
                    .find(|s| {
                        node.proto.attribute[s.attribute].name() == name && s.element.is_none()
                    })
                    .map(|s| s.body)
            };
            let (Some(then_b), Some(else_b)) = (branch("then_branch"), branch("else_branch"))
            else {
                self.at_node(
                    n,
                    "If needs both a then_branch and an else_branch graph attribute".into(),
                );
                continue;
            };
            for (label, b) in [("then_branch", then_b), ("else_branch", else_b)] {
                if !m.body(b).inputs.is_empty() {
                    self.at_node(
                        n,
                        format!(
                            "{label} declares {} inputs; If branches take none",
                            m.body(b).inputs.len()
                        ),
                    );
                }
                let outputs = m.body(b).outputs.len();
                if outputs != node.outputs.len() {
                    self.at_node(
                        n,
                        format!(
                            "{label} has {outputs} outputs but the If node has {}",
                            node.outputs.len()
                        ),
                    );
                }
            }
            let then_outs = &m.body(then_b).outputs;
            let else_outs = &m.body(else_b).outputs;
            for (i, ((tv, ti), (ev, ei))) in then_outs.iter().zip(else_outs).enumerate() {
                let t =
                    elem_type(ti.r#type.as_ref()).or_else(|| elem_type(m.value_type(*tv).as_ref()));
                let e =
                    elem_type(ei.r#type.as_ref()).or_else(|| elem_type(m.value_type(*ev).as_ref()));
                if let (Some(t), Some(e)) = (t, e) {
                    if t != e {
                        self.at_node(
                            n,
                            format!(
                                "branch output {i}: then_branch gives {} but else_branch gives {}",
                                crate::ir::print::elem_type_name(t),
                                crate::ir::print::elem_type_name(e)
                            ),
                        );
                    }
                }
            }
        }
        for n in m.all_nodes().collect::<Vec<_>>() {
            for (i, attr) in m.node(n).proto.attribute.iter().enumerate() {
                let graph_typed =
                    matches!(attr.r#type(), AttributeType::Graph | AttributeType::Graphs);
                let has_body = m.node(n).subgraphs.iter().any(|s| s.attribute == i);
                if graph_typed && !has_body && attr.ref_attr_name.is_none() {
                    self.at_node(
                        n,
                        format!(
                            "attribute '{}' is declared as a graph but holds none",
                            attr.name()
                        ),
                    );
                }
            }
        }
    }

    /// Invariant 7.
    fn state_pairs(&mut self) {
        let m = self.model;
        let Some(entry) = m
            .header
            .metadata_props
            .iter()
            .find(|p| p.key() == STATE_KEY)
        else {
            return;
        };
        let parsed: Result<Vec<serde_json::Value>, _> = serde_json::from_str(entry.value());
        let entries = match parsed {
            Ok(entries) => entries,
            Err(e) => {
                self.errors.push(VerifyError {
                    location: format!("metadata '{STATE_KEY}'"),
                    message: format!("is not a JSON array: {e}"),
                });
                return;
            }
        };
        let inputs: HashSet<&str> = m.main().inputs.iter().map(|(v, _)| m.name(*v)).collect();
        let outputs: HashSet<&str> = m.main().outputs.iter().map(|(v, _)| m.name(*v)).collect();
        let mut seen_in = HashSet::new();
        let mut seen_out = HashSet::new();
        for e in &entries {
            let input = e.get("input").and_then(|x| x.as_str()).unwrap_or("");
            let output = e.get("output").and_then(|x| x.as_str()).unwrap_or("");
            let location = format!("state '{input}'");
            if !inputs.contains(input) {
                self.errors.push(VerifyError {
                    location: location.clone(),
                    message: "is not a graph input".into(),
                });
            }
            if !outputs.contains(output) {
                self.errors.push(VerifyError {
                    location: location.clone(),
                    message: format!("its next value '{output}' is not a graph output"),
                });
            }
            if !seen_in.insert(input.to_string()) {
                self.errors.push(VerifyError {
                    location: location.clone(),
                    message: "appears twice in the state manifest".into(),
                });
            }
            if !seen_out.insert(output.to_string()) {
                self.errors.push(VerifyError {
                    location,
                    message: format!("output '{output}' is the next value of two states"),
                });
            }
        }
    }
}

fn elem_type(ty: Option<&crate::proto::TypeProto>) -> Option<i32> {
    match ty?.value.as_ref()? {
        type_proto::Value::TensorType(t) => t.elem_type,
        _ => None,
    }
}
