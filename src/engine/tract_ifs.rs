//! Two quirks of tract-onnx 0.23's `If`, worked around in the model tract reads (ONNX
//! Runtime and the files written never see this). The autodiff of an If on data
//! (`torch.cond`) meets both: its backward is a second If, whose branches return zeros for
//! the values only the other branch reads.
//!
//! - **Constant outputs of the then branch.** tract types an If's outputs as its then
//!   branch's, constant values included (`IfThenElse::output_facts`), so a then branch that
//!   returns a constant (zeros from `ConstantOfShape(Shape(w))`, constant once shapes are
//!   known) makes the If's output that constant whichever branch runs. Every branch output
//!   `o` becomes `Where(c, o, o)`, with `c` the If's condition as a scalar: the same value,
//!   which tract cannot know before the run.
//! - **One If per graph.** tract names the node it makes of every If "If" (`If::to_typed`
//!   wires it under the op's name, not the node's), so a graph holding two Ifs fails to load
//!   ("Duplicate node name: If"). Each If after the first of a graph runs inside a Scan of
//!   one iteration, named after the If: a Scan's body is a model of its own, and tract names
//!   a Scan by its node.
//!
//! ```text
//! Y… = If(c)            →    c0 = Reshape(c, [])
//!                            S… = Scan(zero)   num_scan_inputs = 1, body (i) -> (If(c)…)
//!                            Y… = Squeeze(S…, axes [0])
//!   branches return o…       branches return Where(c0, o, o)…
//! ```
//!
//! `zero` is the int64 vector `[0]` (one step); the If's branches keep reading the values
//! they read (tract gives a Scan's body the outer values it reads as inputs of every step).

use std::collections::HashSet;

use crate::ir::builder::{attr_int, tensor_i64};
use crate::proto::{
    attribute_proto::AttributeType, AttributeProto, GraphProto, ModelProto, NodeProto,
    ValueInfoProto,
};

/// `model` with its Ifs as tract can run them (see the module docs). Returns how many Ifs
/// were moved into one-step Scans.
pub fn ifs_for_tract(model: &mut ModelProto) -> usize {
    let opset = model
        .opset_import
        .iter()
        .find(|o| crate::ir::normalize_domain(o.domain()).is_empty())
        .map_or(1, |o| o.version());
    // Scan takes its scan inputs without sequence lengths from opset 9 on.
    if opset < 9 {
        return 0;
    }
    let Some(graph) = model.graph.as_mut() else {
        return 0;
    };
    let mut names = HashSet::new();
    collect_names(graph, &mut names);
    let mut fresh = Fresh { names };
    wrap_ifs(graph, opset, &mut fresh)
}

fn is_if(n: &NodeProto) -> bool {
    n.op_type() == "If" && crate::ir::normalize_domain(n.domain()).is_empty()
}

/// Names not yet used anywhere in the model (values, nodes, graphs).
struct Fresh {
    names: HashSet<String>,
}

impl Fresh {
    fn name(&mut self, hint: &str) -> String {
        let mut candidate = hint.to_string();
        let mut k = 1;
        while self.names.contains(&candidate) {
            candidate = format!("{hint}_{k}");
            k += 1;
        }
        self.names.insert(candidate.clone());
        candidate
    }
}

fn collect_names(graph: &GraphProto, names: &mut HashSet<String>) {
    names.insert(graph.name().to_string());
    names.extend(graph.input.iter().map(|v| v.name().to_string()));
    names.extend(graph.initializer.iter().map(|t| t.name().to_string()));
    for node in &graph.node {
        names.insert(node.name().to_string());
        names.extend(node.output.iter().cloned());
        for a in &node.attribute {
            for g in a.g.iter().chain(&a.graphs) {
                collect_names(g, names);
            }
        }
    }
}

/// Prepares the Ifs of every graph nested in `graph`, then those of `graph` itself.
fn wrap_ifs(graph: &mut GraphProto, opset: i64, fresh: &mut Fresh) -> usize {
    // The nested graphs first: the Scan bodies made below are not visited again.
    let mut wrapped = 0;
    for node in &mut graph.node {
        for a in &mut node.attribute {
            for g in a.g.iter_mut().chain(a.graphs.iter_mut()) {
                wrapped += wrap_ifs(g, opset, fresh);
            }
        }
    }
    let mut seen_if = false;
    let nodes = std::mem::take(&mut graph.node);
    for node in nodes {
        if !is_if(&node) {
            graph.node.push(node);
            continue;
        }
        let scalar_condition = fresh.name(&format!(
            "{}.scalar",
            node.input.first().map_or("c", |c| c.as_str())
        ));
        let no_dims = fresh.name("no_dims");
        graph.initializer.push(crate::proto::TensorProto {
            name: Some(no_dims.clone()),
            ..tensor_i64(&[0], &[])
        });
        graph.node.push(NodeProto {
            name: Some(fresh.name(&format!("{scalar_condition}.reshape"))),
            op_type: Some("Reshape".into()),
            input: vec![node.input.first().cloned().unwrap_or_default(), no_dims],
            output: vec![scalar_condition.clone()],
            ..Default::default()
        });
        let mut node = node;
        selected_by(&mut node, &scalar_condition, fresh);
        if !seen_if {
            seen_if = true;
            graph.node.push(node);
            continue;
        }
        wrapped += 1;
        let label = match node.name() {
            "" => "If".to_string(),
            name => name.to_string(),
        };
        let step = fresh.name(&format!("{label}.one_step"));
        graph.initializer.push(crate::proto::TensorProto {
            name: Some(step.clone()),
            ..tensor_i64(&[1], &[0])
        });
        let axes = fresh.name(&format!("{label}.step_axis"));
        if opset >= 13 {
            graph.initializer.push(crate::proto::TensorProto {
                name: Some(axes.clone()),
                ..tensor_i64(&[1], &[0])
            });
        }
        // Inside the body the If computes inner values; outside, the Squeezes give the If's
        // own output names back to their readers.
        let mut renamed = |suffix: &str| -> Vec<String> {
            node.output
                .iter()
                .map(|o| match o.is_empty() {
                    true => String::new(),
                    false => fresh.name(&format!("{o}.{suffix}")),
                })
                .collect()
        };
        let inner = renamed("in_step");
        let stacked = renamed("stacked");
        let body_input = fresh.name(&format!("{label}.step"));
        let mut inner_if = node.clone();
        inner_if.output = inner.clone();
        let body = GraphProto {
            name: Some(fresh.name(&format!("{label}.one_step_body"))),
            node: vec![inner_if],
            input: vec![ValueInfoProto {
                name: Some(body_input),
                r#type: Some(crate::ir::tensor_type(
                    crate::proto::tensor_proto::DataType::Int64 as i32,
                    &[],
                )),
                ..Default::default()
            }],
            output: inner
                .iter()
                .filter(|o| !o.is_empty())
                .map(|o| ValueInfoProto {
                    name: Some(o.clone()),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        };
        graph.node.push(NodeProto {
            name: Some(fresh.name(&format!("{label}.one_step_scan"))),
            op_type: Some("Scan".into()),
            input: vec![step],
            output: stacked.iter().filter(|o| !o.is_empty()).cloned().collect(),
            attribute: vec![
                attr_int("num_scan_inputs", 1),
                AttributeProto {
                    name: Some("body".into()),
                    r#type: Some(AttributeType::Graph as i32),
                    g: Some(body),
                    ..Default::default()
                },
            ],
            ..Default::default()
        });
        for (out, stack) in node.output.iter().zip(&stacked) {
            if out.is_empty() {
                continue;
            }
            let (input, attribute) = match opset >= 13 {
                true => (vec![stack.clone(), axes.clone()], vec![]),
                false => (
                    vec![stack.clone()],
                    vec![crate::ir::builder::attr_ints("axes", &[0])],
                ),
            };
            graph.node.push(NodeProto {
                name: Some(fresh.name(&format!("{out}.unstacked"))),
                op_type: Some("Squeeze".into()),
                input,
                output: vec![out.clone()],
                attribute,
                ..Default::default()
            });
        }
    }
    wrapped
}

/// Every branch output `o` of the If `node` returned as `Where(condition, o, o)`.
fn selected_by(node: &mut NodeProto, condition: &str, fresh: &mut Fresh) {
    for a in &mut node.attribute {
        let Some(branch) = a.g.as_mut() else {
            continue;
        };
        for output in &mut branch.output {
            let o = output.name().to_string();
            let kept = fresh.name(&format!("{o}.selected"));
            branch.node.push(NodeProto {
                name: Some(fresh.name(&format!("{o}.select"))),
                op_type: Some("Where".into()),
                input: vec![condition.to_string(), o.clone(), o],
                output: vec![kept.clone()],
                ..Default::default()
            });
            // The type stays the branch's own (its name changes).
            output.name = Some(kept);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn if_node(name: &str, cond: &str, out: &str) -> NodeProto {
        let branch = |value: &str| AttributeProto {
            name: Some(format!("{value}_branch")),
            r#type: Some(AttributeType::Graph as i32),
            g: Some(GraphProto {
                name: Some(format!("{name}_{value}")),
                output: vec![ValueInfoProto {
                    name: Some("x".into()),
                    ..Default::default()
                }],
                ..Default::default()
            }),
            ..Default::default()
        };
        NodeProto {
            name: Some(name.into()),
            op_type: Some("If".into()),
            input: vec![cond.into()],
            output: vec![out.into()],
            attribute: vec![branch("then"), branch("else")],
            ..Default::default()
        }
    }

    #[test]
    fn ifs_return_through_where_and_all_but_a_graphs_first_run_in_a_one_step_scan() {
        let mut model = ModelProto {
            opset_import: vec![crate::proto::OperatorSetIdProto {
                domain: Some(String::new()),
                version: Some(17),
            }],
            graph: Some(GraphProto {
                name: Some("g".into()),
                node: vec![if_node("a", "c", "y"), if_node("b", "c", "z")],
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(ifs_for_tract(&mut model), 1);
        let g = model.graph.as_ref().unwrap();
        let ops: Vec<&str> = g.node.iter().map(|n| n.op_type()).collect();
        assert_eq!(ops, ["Reshape", "If", "Reshape", "Scan", "Squeeze"]);
        assert_eq!(g.node[0].input, ["c", "no_dims"]);
        assert_eq!(g.node[0].output, ["c.scalar"]);
        // Each branch returns its output through Where(c, o, o).
        let then = g.node[1].attribute[0].g.as_ref().unwrap();
        assert_eq!(then.node[0].op_type(), "Where");
        assert_eq!(then.node[0].input, ["c.scalar", "x", "x"]);
        assert_eq!(then.output[0].name(), then.node[0].output[0]);
        let scan = &g.node[3];
        let body = scan.attribute[1].g.as_ref().unwrap();
        assert_eq!(body.node.len(), 1);
        assert_eq!(body.node[0].name(), "b");
        assert_eq!(body.node[0].output, ["z.in_step"]);
        assert_eq!(body.output[0].name(), "z.in_step");
        assert_eq!(scan.output, ["z.stacked"]);
        // The Squeeze gives the If's output name back, its axes an initializer at opset 13+.
        assert_eq!(g.node[4].input, ["z.stacked", "b.step_axis"]);
        assert_eq!(g.node[4].output, ["z"]);
        assert_eq!(g.initializer.len(), 4);
    }
}
