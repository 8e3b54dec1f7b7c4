//! The verifier: checks every invariant of the IR and collects every violation.
//!
//! Invariants:
//! 1. Every used value has exactly one definition (graph input, initializer, sparse
//!    initializer or node output), visible from the scope of its use.
//! 2. Use lists and node inputs / graph outputs agree in both directions.
//! 3. Each body is acyclic (captures by subgraphs count as reads of the owning node).
//! 4. Value names are unique along every chain of nested scopes (ONNX forbids shadowing;
//!    sibling subgraphs may reuse a name, as tf2onnx's loop bodies do), node names likewise
//!    where given.
//! 5. Every node's domain is declared in `opset_import`.
//! 6. `If` has `then_branch` and `else_branch`, no branch inputs, and both branches have
//!    as many outputs as the node, with the same element types where declared.
//!
//! The IR knows nothing of training: the state manifest's own invariants are checked by
//! [`crate::state::verify_step`], which runs this verifier too.

use std::collections::{HashMap, HashSet};
use std::fmt;

use super::{BodyId, Model, NodeId, Use, ValueDef, ValueId};
use crate::proto::attribute_proto::AttributeType;

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

    /// Why a used name has no definition in scope: none at all, or one in a scope that
    /// cannot be seen from here (a sibling or nested subgraph).
    fn why_undefined(&self, v: ValueId) -> String {
        let m = self.model;
        let elsewhere = self.live_values().find(|d| {
            *d != v
                && m.name(*d) == m.name(v)
                && !matches!(m.value(*d).def, ValueDef::Undefined { .. })
        });
        match elsewhere {
            Some(d) => format!(
                "is defined in {}, which is not visible here",
                body_path(m, m.defining_body(d))
            ),
            None => "is not defined by any node, graph input or initializer".into(),
        }
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
                        let why = self.why_undefined(v);
                        self.at_node(n, format!("input {slot} '{}' {why}", m.name(v)));
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
                    let why = self.why_undefined(*v);
                    self.at_body(body, format!("output {index} '{}'", m.name(*v)), why);
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

    /// Invariant 3. Each cycle (strongly connected set of nodes) is reported once, at its
    /// first node, with one closed path through it; nodes that merely depend on a cycle are
    /// not blamed.
    fn acyclic(&mut self) {
        let m = self.model;
        for b in 0..m.bodies.len() as u32 {
            let body = BodyId(b);
            if m.body(body).owner.is_some_and(|o| m.node(o).removed) {
                continue;
            }
            let nodes: Vec<NodeId> = m.body_nodes(body).collect();
            let index: HashMap<NodeId, usize> =
                nodes.iter().enumerate().map(|(i, n)| (*n, i)).collect();
            // reads[i]: the nodes of this body whose outputs node i reads (captures included).
            let reads: Vec<Vec<usize>> = nodes
                .iter()
                .map(|n| {
                    let mut r: Vec<usize> = super::export::node_reads(m, *n)
                        .into_iter()
                        .filter_map(|v| m.producer(v))
                        .filter_map(|(p, _)| index.get(&p).copied())
                        .collect();
                    r.sort_unstable();
                    r.dedup();
                    r
                })
                .collect();
            for mut component in strongly_connected(&reads) {
                let first = *component.iter().min().expect("components are not empty");
                if component.len() == 1 && !reads[first].contains(&first) {
                    continue;
                }
                component.sort_unstable();
                let path = cycle_through(first, &reads, &component);
                const SHOWN: usize = 12;
                let mut names: Vec<String> = path
                    .iter()
                    .take(SHOWN)
                    .map(|i| format!("'{}'", node_label(m, nodes[*i])))
                    .collect();
                if path.len() > SHOWN {
                    names.push("...".into());
                }
                names.push(format!("'{}'", node_label(m, nodes[first])));
                self.at_node(
                    nodes[first],
                    format!(
                        "is part of a cycle: {} (each node reads an output of the one before)",
                        names.join(" -> ")
                    ),
                );
            }
        }
    }

    /// Invariant 4.
    fn unique_names(&mut self) {
        let m = self.model;
        // Scopes that see each other: one is the other or nested in it.
        let related = |a: BodyId, b: BodyId| m.is_within(a, b) || m.is_within(b, a);
        let mut first: HashMap<&str, Vec<ValueId>> = HashMap::new();
        for v in self.live_values().collect::<Vec<_>>() {
            let name = m.name(v);
            // A use without a definition is no definition; `definitions` reports it.
            if name.is_empty() || matches!(m.value(v).def, ValueDef::Undefined { .. }) {
                continue;
            }
            let body = m.defining_body(v);
            let seen = first.entry(name).or_default();
            match seen
                .iter()
                .find(|other| **other != v && related(m.defining_body(**other), body))
            {
                Some(other) => {
                    let other = *other;
                    let message =
                        format!("is already defined by {}", describe_definition(m, other));
                    let body = m.defining_body(v);
                    match m.value(v).def {
                        ValueDef::Node { node, slot } => {
                            self.at_node(node, format!("output {slot} '{name}' {message}"));
                        }
                        ValueDef::Input { .. } => {
                            self.at_body(body, format!("input '{name}'"), message)
                        }
                        ValueDef::Initializer { .. } => {
                            self.at_body(body, format!("initializer '{name}'"), message)
                        }
                        _ => self.at_body(body, format!("value '{name}'"), message),
                    }
                }
                None => seen.push(v),
            }
        }
        let mut node_names: HashMap<&str, Vec<NodeId>> = HashMap::new();
        for n in m.all_nodes().collect::<Vec<_>>() {
            let name = m.node(n).proto.name();
            if name.is_empty() {
                continue;
            }
            let body = m.node(n).body;
            let seen = node_names.entry(name).or_default();
            if seen.iter().any(|other| related(m.node(*other).body, body)) {
                self.at_node(n, "node name is used by another node too".into());
            } else {
                seen.push(n);
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
            let branch = |name: &str| self.model.subgraph(n, name);
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
}

/// Where `v` is defined, for messages: `node 'n1' (Add) in main`, `a graph input of main`.
fn describe_definition(m: &Model, v: ValueId) -> String {
    let body = body_path(m, m.defining_body(v));
    match m.value(v).def {
        ValueDef::Node { node, .. } => format!(
            "node '{}' ({}) in {body}",
            node_label(m, node),
            m.node(node).proto.op_type()
        ),
        ValueDef::Input { .. } => format!("a graph input of {body}"),
        ValueDef::Initializer { .. } => format!("an initializer of {body}"),
        ValueDef::SparseInitializer { .. } => format!("a sparse initializer of {body}"),
        ValueDef::Undefined { .. } => format!("an undefined use in {body}"),
    }
}

/// Strongly connected components of the graph `edges` (Tarjan, iterative so a long chain
/// cannot overflow the stack).
fn strongly_connected(edges: &[Vec<usize>]) -> Vec<Vec<usize>> {
    const UNSEEN: usize = usize::MAX;
    let n = edges.len();
    let mut index = vec![UNSEEN; n];
    let mut low = vec![0; n];
    let mut on_stack = vec![false; n];
    let mut stack = Vec::new();
    let mut components = Vec::new();
    let mut next = 0;
    for root in 0..n {
        if index[root] != UNSEEN {
            continue;
        }
        // (node, position in its edge list)
        let mut work = vec![(root, 0usize)];
        index[root] = next;
        low[root] = next;
        next += 1;
        stack.push(root);
        on_stack[root] = true;
        while let Some(&mut (v, ref mut at)) = work.last_mut() {
            if let Some(&w) = edges[v].get(*at) {
                *at += 1;
                if index[w] == UNSEEN {
                    index[w] = next;
                    low[w] = next;
                    next += 1;
                    stack.push(w);
                    on_stack[w] = true;
                    work.push((w, 0));
                } else if on_stack[w] {
                    low[v] = low[v].min(index[w]);
                }
                continue;
            }
            work.pop();
            if let Some(&(parent, _)) = work.last() {
                low[parent] = low[parent].min(low[v]);
            }
            if low[v] == index[v] {
                let mut component = Vec::new();
                while let Some(w) = stack.pop() {
                    on_stack[w] = false;
                    component.push(w);
                    if w == v {
                        break;
                    }
                }
                components.push(component);
            }
        }
    }
    components
}

/// A shortest closed path from `start` back to itself inside `component` (sorted), in data
/// flow order: `start`, then a node reading `start`'s output, and so on (the closing
/// `start` is left to the caller).
fn cycle_through(start: usize, reads: &[Vec<usize>], component: &[usize]) -> Vec<usize> {
    // Breadth-first along "reads" edges from `start`; `read_by[w] = u` means u reads w.
    let mut read_by: HashMap<usize, usize> = HashMap::new();
    let mut queue = std::collections::VecDeque::from([start]);
    let mut last = None;
    'search: while let Some(u) = queue.pop_front() {
        for &w in &reads[u] {
            if component.binary_search(&w).is_err() {
                continue;
            }
            if w == start {
                // `u` reads `start`: the cycle closes.
                last = Some(u);
                break 'search;
            }
            if let std::collections::hash_map::Entry::Vacant(e) = read_by.entry(w) {
                e.insert(u);
                queue.push_back(w);
            }
        }
    }
    // start -> last -> (the node reading last) -> ... -> (the node start reads) -> start.
    let mut flow = vec![start];
    let mut at = last.unwrap_or(start);
    while at != start {
        flow.push(at);
        at = read_by[&at];
    }
    flow
}

fn elem_type(ty: Option<&crate::proto::TypeProto>) -> Option<i32> {
    ty?.tensor_elem()
}
