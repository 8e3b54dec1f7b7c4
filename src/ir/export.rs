//! IR -> `ModelProto`. Deterministic: nodes leave in a stable topological order (original
//! order breaks ties, so an untouched graph exports exactly as it was read).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use super::{BodyId, Model, NodeId};
use crate::proto::{GraphProto, ModelProto, NodeProto};

pub(super) fn export(model: &Model) -> ModelProto {
    let mut proto = model.header.clone();
    proto.graph = Some(export_body(model, BodyId::MAIN));
    proto
}

fn export_body(model: &Model, body: BodyId) -> GraphProto {
    let b = model.body(body);
    let mut graph = b.rest.clone();
    graph.node = topological_order(model, body)
        .into_iter()
        .map(|n| export_node(model, n))
        .collect();
    graph.input = b
        .inputs
        .iter()
        .map(|(v, info)| named(info, model.name(*v)))
        .collect();
    graph.output = b
        .outputs
        .iter()
        .map(|(v, info)| named(info, model.name(*v)))
        .collect();
    graph.value_info = b
        .value_info
        .iter()
        .map(|(v, info)| named(info, model.name(*v)))
        .collect();
    graph.initializer = b
        .initializers
        .iter()
        .map(|(v, t)| {
            let mut t = t.clone();
            if t.name() != model.name(*v) {
                t.name = Some(model.name(*v).to_string());
            }
            t
        })
        .collect();
    graph.sparse_initializer = b
        .sparse_initializers
        .iter()
        .map(|(_, t)| t.clone())
        .collect();
    graph
}

fn named(info: &crate::proto::ValueInfoProto, name: &str) -> crate::proto::ValueInfoProto {
    let mut info = info.clone();
    if info.name() != name {
        info.name = Some(name.to_string());
    }
    info
}

fn export_node(model: &Model, id: NodeId) -> NodeProto {
    let node = model.node(id);
    let mut proto = node.proto.clone();
    let name_of =
        |v: &Option<super::ValueId>| v.map(|v| model.name(v).to_string()).unwrap_or_default();
    proto.input = node.inputs.iter().map(name_of).collect();
    proto.output = node.outputs.iter().map(name_of).collect();
    for sub in &node.subgraphs {
        let graph = export_body(model, sub.body);
        let attr = &mut proto.attribute[sub.attribute];
        match sub.element {
            None => attr.g = Some(graph),
            Some(_) => attr.graphs.push(graph),
        }
    }
    proto
}

/// Kahn's algorithm with the original position as priority. A node depends on the nodes
/// of this body that produce its inputs or the values its subgraphs capture. On a cycle
/// the remaining nodes follow in their original order (the verifier reports the cycle).
pub(crate) fn topological_order(model: &Model, body: BodyId) -> Vec<NodeId> {
    let nodes: Vec<NodeId> = model.body_nodes(body).collect();
    let position: HashMap<NodeId, usize> = nodes.iter().enumerate().map(|(i, n)| (*n, i)).collect();
    let mut dependents: Vec<Vec<usize>> = vec![Vec::new(); nodes.len()];
    let mut pending = vec![0usize; nodes.len()];
    for (i, n) in nodes.iter().enumerate() {
        let mut deps: Vec<usize> = node_reads(model, *n)
            .into_iter()
            .filter_map(|v| model.producer(v))
            .filter_map(|(p, _)| position.get(&p).copied())
            .filter(|p| *p != i)
            .collect();
        deps.sort_unstable();
        deps.dedup();
        pending[i] = deps.len();
        for d in deps {
            dependents[d].push(i);
        }
    }
    let mut ready: BinaryHeap<Reverse<usize>> = (0..nodes.len())
        .filter(|i| pending[*i] == 0)
        .map(Reverse)
        .collect();
    let mut order = Vec::with_capacity(nodes.len());
    let mut emitted = vec![false; nodes.len()];
    while let Some(Reverse(i)) = ready.pop() {
        order.push(nodes[i]);
        emitted[i] = true;
        for &d in &dependents[i] {
            pending[d] -= 1;
            if pending[d] == 0 {
                ready.push(Reverse(d));
            }
        }
    }
    order.extend((0..nodes.len()).filter(|i| !emitted[*i]).map(|i| nodes[i]));
    order
}

/// The values a node reads: its inputs and everything its subgraphs capture.
pub(crate) fn node_reads(model: &Model, n: NodeId) -> Vec<super::ValueId> {
    let node = model.node(n);
    let mut reads: Vec<super::ValueId> = node.inputs.iter().flatten().copied().collect();
    for sub in &node.subgraphs {
        reads.extend(model.captures(sub.body));
    }
    reads
}
