//! `inline_if`: an `If` replaced by one of its branches, for callers that know which branch
//! a run takes before it starts (the split step's accumulate and apply specialisations,
//! `crate::split`).
//!
//! What it does, in IR terms:
//! - the branch's nodes move into the body that holds the `If`, at the `If`'s place in its
//!   node list (so export keeps them where the `If` was); its initializers and value_info
//!   move with them, and subgraphs of the moved nodes now nest in that body. A value or node
//!   of the branch whose name something outside the `If` already holds (a branch that
//!   shadows an outer name, which ONNX forbids but some exporters write) gets a fresh name
//!   from the name authority, so the body never holds two definitions of one name;
//! - captures need nothing: a branch node that read an outer value by name already holds
//!   that value's id, so it is a direct use once the node sits in the outer body;
//! - each `If` output is carried by what the branch returns, seen through the branch's own
//!   `Identity` nodes (a forwarding copy costs a buffer once inlined). The `If` output's
//!   name is kept, because readers outside may know it (a state output, a graph output):
//!   the carrying value takes it when it is computed by a node of the enclosing body, not an
//!   output of it and not carrying an earlier `If` output; otherwise an output of the body
//!   gets an `Identity` copy of that name, and inner readers read the value itself;
//! - the `If`, the other branch and everything in it go, with the uses they held, so dead
//!   code elimination afterwards sees only live readers.
//!
//! The verifier passes afterwards when it passed before (and also when a shadowed name was
//! the only violation).

use std::collections::HashSet;

use super::{BodyId, Model, NodeId, NodeSpec, Use, ValueDef, ValueId};

/// Which branch of an `If` to keep.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Branch {
    Then,
    Else,
}

impl Branch {
    /// The `If` attribute holding this branch.
    pub fn attribute(self) -> &'static str {
        match self {
            Branch::Then => "then_branch",
            Branch::Else => "else_branch",
        }
    }

    /// The branch an attribute name denotes (`then_branch`, `else_branch`).
    pub fn from_attribute(name: &str) -> Option<Branch> {
        match name {
            "then_branch" => Some(Branch::Then),
            "else_branch" => Some(Branch::Else),
            _ => None,
        }
    }

    fn other(self) -> Branch {
        match self {
            Branch::Then => Branch::Else,
            Branch::Else => Branch::Then,
        }
    }
}

/// Why an `If` could not be inlined. Nothing was changed.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum InlineError {
    #[error("node '{0}' is not a live If node of the standard domain")]
    NotAnIf(String),
    #[error("If node '{node}' has no graph attribute '{branch}'")]
    NoBranch { node: String, branch: &'static str },
    #[error("If node '{node}': {branch} has {have} outputs, the If has {want}")]
    OutputCount {
        node: String,
        branch: &'static str,
        have: usize,
        want: usize,
    },
    #[error("If node '{node}': {branch} returns the If's own output '{value}' (a cycle)")]
    ReturnsItsOwnOutput {
        node: String,
        branch: &'static str,
        value: String,
    },
    #[error("If node '{node}': {branch} declares {count} inputs; If branches take none")]
    BranchInputs {
        node: String,
        branch: &'static str,
        count: usize,
    },
    /// A use of the If's outputs that the inline could not move (a malformed graph the
    /// checks before it missed); the model is left half inlined, so the caller drops it.
    #[error("If node '{node}': an output is still in use after inlining: {detail}")]
    StillUsed { node: String, detail: String },
}

/// What an inline did.
#[derive(Clone, Debug, PartialEq)]
pub struct Inlined {
    /// Per output slot of the `If`: the value that now carries it (`None` for an omitted
    /// output). It has the `If` output's name unless it is an inner value read in its place.
    pub outputs: Vec<Option<ValueId>>,
    /// The branch's nodes, now in the enclosing body, in branch order.
    pub nodes: Vec<NodeId>,
    /// `Identity` copies made for body outputs (see the module comment).
    pub copies: Vec<NodeId>,
    /// Branch names that clashed with outer ones: (old, new), values and nodes.
    pub renamed: Vec<(String, String)>,
}

impl Model {
    /// The body of `branch` of the `If` `node`, if it has one.
    pub fn if_branch(&self, node: NodeId, branch: Branch) -> Option<BodyId> {
        self.subgraph(node, branch.attribute())
    }

    /// The body `node` holds as its graph attribute `attribute` (an If's branch, a Loop's or
    /// Scan's `body`), if it has one.
    pub fn subgraph(&self, node: NodeId, attribute: &str) -> Option<BodyId> {
        let n = self.node(node);
        n.subgraphs
            .iter()
            .find(|s| s.element.is_none() && n.proto.attribute[s.attribute].name() == attribute)
            .map(|s| s.body)
    }

    /// `v` seen through the `Identity` nodes of `body` that forward it: the value it copies.
    pub fn forwarded(&self, mut v: ValueId, body: BodyId) -> ValueId {
        while let Some((n, _)) = self.producer(v) {
            let node = self.node(n);
            let identity = node.proto.op_type() == "Identity"
                && super::normalize_domain(node.proto.domain()).is_empty();
            match node.inputs.first() {
                Some(Some(input)) if identity && node.body == body => v = *input,
                _ => break,
            }
        }
        v
    }

    /// Replaces the `If` `node` by its `branch` (see the module comment for what moves where
    /// and which names are kept).
    pub fn inline_if(&mut self, node: NodeId, branch: Branch) -> Result<Inlined, InlineError> {
        let label = self.node(node).proto.name().to_string();
        {
            let n = self.node(node);
            if n.removed
                || n.proto.op_type() != "If"
                || !super::normalize_domain(n.proto.domain()).is_empty()
            {
                return Err(InlineError::NotAnIf(label));
            }
        }
        let chosen = self.if_branch(node, branch).ok_or(InlineError::NoBranch {
            node: label.clone(),
            branch: branch.attribute(),
        })?;
        let other = self.if_branch(node, branch.other());
        let (have, want) = (
            self.body(chosen).outputs.len(),
            self.node(node).outputs.len(),
        );
        if have != want {
            return Err(InlineError::OutputCount {
                node: label,
                branch: branch.attribute(),
                have,
                want,
            });
        }
        if !self.body(chosen).inputs.is_empty() {
            return Err(InlineError::BranchInputs {
                node: label,
                branch: branch.attribute(),
                count: self.body(chosen).inputs.len(),
            });
        }
        let parent = self.node(node).body;
        // What each output will carry, read while the branch's Identity nodes are still told
        // apart by their body.
        let sources: Vec<ValueId> = self
            .body(chosen)
            .outputs
            .iter()
            .map(|(v, _)| self.forwarded(*v, chosen))
            .collect();
        // Such an output could carry nothing once the If is gone.
        if let Some(own) = sources
            .iter()
            .find(|s| self.producer(**s).is_some_and(|(p, _)| p == node))
        {
            return Err(InlineError::ReturnsItsOwnOutput {
                node: label,
                branch: branch.attribute(),
                value: self.name(*own).to_string(),
            });
        }
        let renamed = self.move_branch(node, chosen, parent);
        let moved = self.body(chosen).nodes.clone();
        self.body_mut(chosen).nodes.clear();

        // The branch's outputs are no readers any more.
        let branch_outputs = std::mem::take(&mut self.body_mut(chosen).outputs);
        for (index, (v, _)) in branch_outputs.iter().enumerate() {
            self.values[v.0 as usize].uses.retain(|u| {
                *u != Use::Output {
                    body: chosen,
                    index,
                }
            });
        }

        let mut claimed: HashSet<ValueId> = HashSet::new();
        let mut outputs = Vec::with_capacity(sources.len());
        let mut copies = Vec::new();
        let if_outputs = self.node(node).outputs.clone();
        for (o, s) in if_outputs.into_iter().zip(sources) {
            let Some(o) = o else {
                outputs.push(None);
                continue;
            };
            let is_output_of = |m: &Model, v: ValueId| {
                m.uses(v)
                    .iter()
                    .any(|u| matches!(u, Use::Output { body, .. } if *body == parent))
            };
            let computed_here = self
                .producer(s)
                .is_some_and(|(p, _)| self.node(p).body == parent);
            let carrier = if computed_here && !is_output_of(self, s) && claimed.insert(s) {
                // Its producer writes the If output's name.
                self.take_over(o, s);
                s
            } else if is_output_of(self, o) {
                // A body output keeps its name: a copy carries it.
                let name = self.name(o).to_string();
                let copy = self.add_node(
                    parent,
                    NodeSpec {
                        op_type: "Identity",
                        domain: "",
                        inputs: &[Some(s)],
                        output_hints: &[&name],
                        attributes: Vec::new(),
                        name_hint: Some(&format!("{name}.copy")),
                        pass: None,
                    },
                );
                copies.push(copy);
                let c = self.output(copy, 0);
                self.take_over(o, c);
                c
            } else {
                // Read only inside: readers take the value itself.
                let _ = self.replace_all_uses(o, s, true);
                s
            };
            outputs.push(Some(carrier));
        }

        // Order in the enclosing body: what came before the If, the branch, the copies, the
        // rest (export breaks topological ties by this order).
        let made: HashSet<NodeId> = copies.iter().copied().collect();
        let p = self.body_mut(parent);
        p.nodes.retain(|n| !made.contains(n));
        let at = p
            .nodes
            .iter()
            .position(|n| *n == node)
            .expect("the If is in its body");
        p.nodes.splice(at..at, moved.iter().chain(&copies).copied());

        if let Some(other) = other {
            self.discard_body(other);
        }
        let label = self.node(node).proto.name().to_string();
        self.remove_node(node).map_err(|e| InlineError::StillUsed {
            node: label,
            detail: e.to_string(),
        })?;
        Ok(Inlined {
            outputs,
            nodes: moved,
            copies,
            renamed,
        })
    }

    /// Moves the definitions of `chosen` (nodes, initializers, value_info) into `parent`,
    /// renaming those whose names are held outside the `If` `node`. The node list is moved
    /// by the caller. Returns the renames.
    fn move_branch(
        &mut self,
        node: NodeId,
        chosen: BodyId,
        parent: BodyId,
    ) -> Vec<(String, String)> {
        let (outer_values, outer_nodes) = self.names_outside(node);
        let mut renamed = Vec::new();
        let moved = self.body(chosen).nodes.clone();
        let mut defined: Vec<ValueId> = Vec::new();
        for &n in &moved {
            self.nodes[n.0 as usize].body = parent;
            for sub in self.node(n).subgraphs.clone() {
                self.body_mut(sub.body).parent = Some(parent);
            }
            defined.extend(self.node(n).outputs.iter().flatten().copied());
            let name = self.node(n).proto.name().to_string();
            if !name.is_empty() && outer_nodes.contains(&name) {
                let fresh = self.names.fresh(&name);
                self.nodes[n.0 as usize].proto.name = Some(fresh.clone());
                renamed.push((name, fresh));
            }
        }
        let b = self.body_mut(chosen);
        let initializers = std::mem::take(&mut b.initializers);
        let sparse = std::mem::take(&mut b.sparse_initializers);
        let value_info = std::mem::take(&mut b.value_info);
        for (v, _) in &initializers {
            self.values[v.0 as usize].def = ValueDef::Initializer { body: parent };
            defined.push(*v);
        }
        for (v, _) in &sparse {
            self.values[v.0 as usize].def = ValueDef::SparseInitializer { body: parent };
            defined.push(*v);
        }
        // A name used in the branch but defined nowhere stays undefined, now in `parent`.
        for value in &mut self.values {
            if value.def == (ValueDef::Undefined { body: chosen }) {
                value.def = ValueDef::Undefined { body: parent };
            }
        }
        let p = self.body_mut(parent);
        p.initializers.extend(initializers);
        p.sparse_initializers.extend(sparse);
        p.value_info.extend(value_info);
        for v in defined {
            let name = self.name(v).to_string();
            if !outer_values.contains(&name) {
                continue;
            }
            let fresh = self.names.fresh(&name);
            self.values[v.0 as usize].name = fresh.clone();
            // A sparse initializer carries its name inside (export writes it as is).
            if let Some((_, t)) = self
                .body_mut(parent)
                .sparse_initializers
                .iter_mut()
                .find(|(id, _)| *id == v)
            {
                if let Some(values) = t.values.as_mut() {
                    values.name = Some(fresh.clone());
                }
            }
            renamed.push((name, fresh));
        }
        renamed
    }

    /// Names of the values and nodes that stay live outside the `If` `node` (its outputs
    /// included), for telling which branch names would clash once moved out.
    fn names_outside(&self, node: NodeId) -> (HashSet<String>, HashSet<String>) {
        let mut values = HashSet::new();
        let mut nodes = HashSet::new();
        let mut stack = vec![BodyId::MAIN];
        while let Some(b) = stack.pop() {
            let body = self.body(b);
            let lists = body
                .inputs
                .iter()
                .map(|(v, _)| *v)
                .chain(body.initializers.iter().map(|(v, _)| *v))
                .chain(body.sparse_initializers.iter().map(|(v, _)| *v));
            values.extend(lists.map(|v| self.name(v).to_string()));
            for n in self.body_nodes(b) {
                let nd = self.node(n);
                values.extend(
                    nd.outputs
                        .iter()
                        .flatten()
                        .map(|v| self.name(*v).to_string()),
                );
                if !nd.proto.name().is_empty() {
                    nodes.insert(nd.proto.name().to_string());
                }
                if n != node {
                    stack.extend(nd.subgraphs.iter().map(|s| s.body));
                }
            }
        }
        (values, nodes)
    }

    /// `new` takes the place of `old`: every use, the name, and the declared type entry in
    /// the body's value_info (where `old`'s was; `new`'s own goes, it described a value
    /// under another name). `old` is left unused under a retired name.
    fn take_over(&mut self, old: ValueId, new: ValueId) {
        let _ = self.replace_all_uses(old, new, true);
        let name = std::mem::take(&mut self.values[old.0 as usize].name);
        self.values[old.0 as usize].name = self.names.fresh(&format!("{name}_inlined"));
        self.values[new.0 as usize].name = name;
        let (old_body, new_body) = (self.defining_body(old), self.defining_body(new));
        self.body_mut(new_body)
            .value_info
            .retain(|(v, _)| *v != new);
        for (v, _) in &mut self.body_mut(old_body).value_info {
            if *v == old {
                *v = new;
            }
        }
    }

    /// Removes every node of `body` and of the bodies nested in it, with the uses they and
    /// the body's outputs hold; its inputs, initializers and declared types go too, so no
    /// name stays defined by a body nothing holds.
    pub(crate) fn discard_body(&mut self, body: BodyId) {
        for n in self.body(body).nodes.clone() {
            if self.node(n).removed {
                continue;
            }
            for sub in self.node(n).subgraphs.clone() {
                self.discard_body(sub.body);
            }
            for slot in 0..self.node(n).inputs.len() {
                self.set_input(n, slot, None);
            }
            self.nodes[n.0 as usize].removed = true;
        }
        self.body_mut(body).nodes.clear();
        let outputs = std::mem::take(&mut self.body_mut(body).outputs);
        for (index, (v, _)) in outputs.iter().enumerate() {
            self.values[v.0 as usize]
                .uses
                .retain(|u| *u != Use::Output { body, index });
        }
        let b = self.body_mut(body);
        b.inputs.clear();
        b.initializers.clear();
        b.sparse_initializers.clear();
        b.value_info.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::verify::verify;

    fn model(graph: &str) -> Model {
        let text = format!("<ir_version: 8, opset_import: [\"\" : 17]>\n{graph}");
        Model::from_proto(crate::ir::text::parse_model(&text).unwrap_or_else(|e| panic!("{e}")))
    }

    fn the_if(m: &Model) -> NodeId {
        m.body_nodes(BodyId::MAIN)
            .find(|n| m.node(*n).proto.op_type() == "If")
            .expect("an If")
    }

    /// The producer's op type and its inputs' names.
    fn producer_of(m: &Model, v: ValueId) -> (String, Vec<String>) {
        let (n, _) = m.producer(v).expect("node-defined");
        let node = m.node(n);
        assert_eq!(
            node.body,
            BodyId::MAIN,
            "'{}' is in the main graph",
            m.name(v)
        );
        let inputs = node.inputs.iter().flatten().map(|v| m.name(*v).to_string());
        (node.proto.op_type().to_string(), inputs.collect())
    }

    /// Both branches capture outer values; the then-branch defines a `t` (node `n`) that
    /// shadows the main graph's, which ONNX forbids and the verifier reports.
    const SHADOWING: &str = r#"
g (bool cond, float[3] x) => (float[3] y, float[3] z, float[3] u) {
  [n] t = Neg (x)
  [if] y, z = If (cond) <
    then_branch = then_graph () => (float[3] a, float[3] b) <float[3] a> {
      [n] t = Abs (x)
      a = Add (t, x)
      b = Identity (a)
    },
    else_branch = else_graph () => (float[3] c, float[3] d) {
      c = Identity (t)
      d = Neg (x)
    }
  >
  u = Mul (y, t)
}
"#;

    #[test]
    fn then_branch_moves_out_renaming_the_clashing_names() {
        let mut m = model(SHADOWING);
        assert!(verify(&m).is_err(), "the shadowing t is an error before");
        let node = the_if(&m);
        let inlined = m.inline_if(node, Branch::Then).unwrap();
        verify(&m).unwrap_or_else(|e| panic!("{e}"));
        assert!(m.node(node).removed);
        assert_eq!(
            inlined.renamed,
            [
                ("n".to_string(), "n_1".to_string()),
                ("t".into(), "t_1".into())
            ]
        );
        let [Some(y), Some(z)] = inlined.outputs[..] else {
            panic!("two outputs carried: {:?}", inlined.outputs)
        };
        // The Add writes y directly; b only forwarded it, so z is a copy of y (a graph output
        // keeps its name, and y already took the Add's).
        assert_eq!(m.name(y), "y");
        assert_eq!(
            producer_of(&m, y),
            ("Add".into(), vec!["t_1".into(), "x".into()])
        );
        assert_eq!(m.name(z), "z");
        assert_eq!(producer_of(&m, z), ("Identity".into(), vec!["y".into()]));
        assert_eq!(inlined.copies.len(), 1);
        assert_eq!(m.node(inlined.copies[0]).proto.name(), "z.copy");
        // The moved t is the branch's Abs; the Mul still reads the main graph's t.
        let t1 = m.lookup(BodyId::MAIN, "t_1").unwrap();
        assert_eq!(producer_of(&m, t1), ("Abs".into(), vec!["x".into()]));
        let u = m.graph_outputs()[2];
        assert_eq!(
            producer_of(&m, u),
            ("Mul".into(), vec!["y".into(), "t".into()])
        );
        // The graph outputs are the same names; a's declared type went with its old name.
        let names: Vec<&str> = m.graph_outputs().iter().map(|v| m.name(*v)).collect();
        assert_eq!(names, ["y", "z", "u"]);
        assert!(m.main().value_info.is_empty());
        // Export and import again: the same graph, still valid, no If left.
        let proto = m.to_proto();
        let g = proto.graph.as_ref().unwrap();
        let ops: Vec<&str> = g.node.iter().map(|n| n.op_type()).collect();
        assert_eq!(ops, ["Neg", "Abs", "Add", "Identity", "Identity", "Mul"]);
        verify(&Model::from_proto(proto)).unwrap();
    }

    #[test]
    fn else_branch_capture_takes_the_output_name() {
        let mut m = model(SHADOWING);
        let node = the_if(&m);
        let inlined = m.inline_if(node, Branch::Else).unwrap();
        verify(&m).unwrap_or_else(|e| panic!("{e}"));
        // Nothing clashes once the then-branch (and its t) is gone.
        assert!(inlined.renamed.is_empty());
        assert!(inlined.copies.is_empty());
        let [Some(y), Some(z)] = inlined.outputs[..] else {
            panic!("two outputs carried")
        };
        // c only forwarded the main graph's t: the Neg that computes it now writes y, and the
        // Mul reads that one value twice.
        assert_eq!(producer_of(&m, y), ("Neg".into(), vec!["x".into()]));
        assert_eq!(m.name(y), "y");
        assert_eq!(m.lookup(BodyId::MAIN, "t"), None);
        assert_eq!(producer_of(&m, z), ("Neg".into(), vec!["x".into()]));
        assert_eq!(m.name(z), "z");
        let u = m.graph_outputs()[2];
        assert_eq!(
            producer_of(&m, u),
            ("Mul".into(), vec!["y".into(), "y".into()])
        );
        // The then-branch's nodes are gone with their uses: x is read by the two Negs only.
        let x = m.lookup(BodyId::MAIN, "x").unwrap();
        assert_eq!(m.uses(x).len(), 2);
    }

    #[test]
    fn inputs_returned_by_the_branch_are_copied_or_read_directly() {
        // p is a graph output that the branch fills with the input x: it needs a copy. q is
        // read inside only: its reader reads x. q's declared type goes with it.
        let mut m = model(
            r#"
g (bool cond, float[3] x) => (float[3] p, float[3] r) <float[3] q> {
  p, q = If (cond) <
    then_branch = then_graph () => (float[3] a, float[3] b) {
      a = Identity (x)
      b = Identity (a)
    },
    else_branch = else_graph () => (float[3] c, float[3] d) {
      c = Neg (x)
      d = Neg (x)
    }
  >
  r = Abs (q)
}
"#,
        );
        verify(&m).unwrap();
        let node = the_if(&m);
        let inlined = m.inline_if(node, Branch::Then).unwrap();
        verify(&m).unwrap_or_else(|e| panic!("{e}"));
        let x = m.lookup(BodyId::MAIN, "x").unwrap();
        let [Some(p), Some(q)] = inlined.outputs[..] else {
            panic!("two outputs carried")
        };
        assert_eq!(producer_of(&m, p), ("Identity".into(), vec!["x".into()]));
        assert_eq!(m.node(inlined.copies[0]).proto.name(), "p.copy");
        assert_eq!(q, x);
        let r = m.graph_outputs()[1];
        assert_eq!(producer_of(&m, r), ("Abs".into(), vec!["x".into()]));
        assert!(m.main().value_info.is_empty());
        // The forwarding Identity nodes stay for dead code elimination to take.
        crate::passes::dce::eliminate_dead_code(&mut m);
        let ops: Vec<String> = m
            .body_nodes(BodyId::MAIN)
            .map(|n| m.node(n).proto.op_type().to_string())
            .collect();
        assert_eq!(ops, ["Identity", "Abs"]);
        verify(&m).unwrap();
    }

    #[test]
    fn a_branch_returning_its_own_if_output_is_refused() {
        let mut m = model(
            r#"
g (bool cond, float[3] x) => (float[3] y) {
  [if] y = If (cond) <
    then_branch = then_graph () => (float[3] a) { a = Identity (y) },
    else_branch = else_graph () => (float[3] b) { b = Neg (x) }
  >
}
"#,
        );
        let node = the_if(&m);
        let before = m.to_proto();
        assert_eq!(
            m.inline_if(node, Branch::Then),
            Err(InlineError::ReturnsItsOwnOutput {
                node: "if".into(),
                branch: "then_branch",
                value: "y".into()
            })
        );
        assert_eq!(m.to_proto(), before, "nothing changed");
        m.inline_if(node, Branch::Else).unwrap();
        verify(&m).unwrap();
    }

    #[test]
    fn only_an_if_is_inlined() {
        let mut m = model(SHADOWING);
        let neg = m.body_nodes(BodyId::MAIN).next().unwrap();
        assert_eq!(
            m.inline_if(neg, Branch::Then),
            Err(InlineError::NotAnIf("n".into()))
        );
    }
}
