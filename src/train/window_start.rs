//! A third specialisation of a split step, for the first micro-step of a window.
//!
//! After an apply (and at the start of training) every accumulator is zero, so the first
//! micro-step of a window need not read it: `acc' = acc + g` is `g`. The accumulate
//! specialisation reads and adds anyway, one full pass over two gradient-sized buffers and a
//! write of a third. This one writes the gradient itself as the accumulator's next value:
//!
//! - `Add(acc, g)` (either order): the node goes; `g`'s producer writes the output's name
//!   directly (an `Identity` where `g` has no producer of its own to rename);
//! - `Gemm(A, B, acc)` with `beta = 1` (the accumulation folded into the weight gradient's
//!   Gemm by `grad-accum`): the `C` input goes, so the Gemm writes `alpha A B` alone.
//!
//! Any other use of an accumulator leaves that accumulator read as before. The accumulator
//! stays a graph input (fed, unread), so the host feeds the same values to every
//! specialisation. Exact: `0 + g` is `g` (up to the sign of a zero gradient).

use std::collections::{BTreeMap, HashMap};

use crate::proto::{GraphProto, ModelProto, NodeProto};
use crate::split::Specialised;
use crate::state::Manifest;
use crate::state::Role;

/// The accumulate specialisation without its reads of the (zero) accumulators; `None` when
/// no accumulator is read in a way this can drop.
pub fn window_start(accumulate: &Specialised, manifest: &Manifest) -> Option<Specialised> {
    let mut model: ModelProto = accumulate.model.clone();
    let graph = model.graph.as_mut()?;
    let mut changed = 0;
    for entry in manifest
        .state
        .iter()
        .filter(|e| e.role == Role::Accumulator)
    {
        if drop_read(graph, &entry.input) {
            changed += 1;
        }
    }
    (changed > 0).then(|| Specialised {
        model,
        unchanged: accumulate.unchanged.clone(),
    })
}

/// Drops the one read of `acc` in `graph`, if it is one this knows.
fn drop_read(graph: &mut GraphProto, acc: &str) -> bool {
    let readers: Vec<usize> = graph
        .node
        .iter()
        .enumerate()
        .filter(|(_, n)| n.input.iter().any(|i| i == acc))
        .map(|(i, _)| i)
        .collect();
    let [index] = readers[..] else {
        return false;
    };
    if graph.node.iter().any(|n| subgraphs_mention(n, acc)) {
        return false;
    }
    let node = &graph.node[index];
    if node.input.iter().filter(|i| *i == acc).count() != 1 || node.output.len() != 1 {
        return false;
    }
    let standard = crate::ir::normalize_domain(node.domain()).is_empty();
    match node.op_type() {
        "Add" if standard && node.input.len() == 2 => {
            let other = if node.input[0] == acc {
                node.input[1].clone()
            } else {
                node.input[0].clone()
            };
            let out = node.output[0].clone();
            graph.node.remove(index);
            forward(graph, &other, &out, index);
            true
        }
        "Gemm" if standard && node.input.len() == 3 && node.input[2] == acc => {
            let beta = node
                .attribute
                .iter()
                .find(|a| a.name() == "beta")
                .map_or(1.0, |a| a.f());
            if beta != 1.0 {
                return false;
            }
            graph.node[index].input.truncate(2);
            true
        }
        _ => false,
    }
}

/// Makes `out` carry `value`: `value`'s producer writes `out` (its readers read `out`), or,
/// when `value` is not a plain node output, an `Identity` at `at` copies it.
fn forward(graph: &mut GraphProto, value: &str, out: &str, at: usize) {
    let is_io = graph.input.iter().any(|i| i.name() == value)
        || graph.output.iter().any(|o| o.name() == value)
        || graph.initializer.iter().any(|t| t.name() == value);
    let produced = graph
        .node
        .iter()
        .any(|n| n.output.iter().any(|o| o == value));
    if is_io || !produced {
        graph.node.insert(
            at,
            NodeProto {
                input: vec![value.to_string()],
                output: vec![out.to_string()],
                name: Some(format!("{out}.first")),
                op_type: Some("Identity".into()),
                ..Default::default()
            },
        );
        return;
    }
    let rename: BTreeMap<String, String> = [(value.to_string(), out.to_string())].into();
    for n in &mut graph.node {
        rename_all(n, &rename);
    }
    // Shape annotations of the old name now describe the new one's value.
    let types: HashMap<String, usize> = graph
        .value_info
        .iter()
        .enumerate()
        .map(|(i, v)| (v.name().to_string(), i))
        .collect();
    if let Some(&i) = types.get(value) {
        if types.contains_key(out) {
            graph.value_info.remove(i);
        } else {
            graph.value_info[i].name = Some(out.to_string());
        }
    }
}

fn rename_all(node: &mut NodeProto, rename: &BTreeMap<String, String>) {
    for name in node.input.iter_mut().chain(node.output.iter_mut()) {
        if let Some(new) = rename.get(name.as_str()) {
            *name = new.clone();
        }
    }
    for attribute in &mut node.attribute {
        for g in attribute.g.iter_mut().chain(attribute.graphs.iter_mut()) {
            for n in &mut g.node {
                rename_all(n, rename);
            }
            for o in &mut g.output {
                if let Some(new) = rename.get(o.name()) {
                    o.name = Some(new.clone());
                }
            }
        }
    }
}

/// Whether a subgraph of `node` names `value` anywhere (reads it from the outer scope).
fn subgraphs_mention(node: &NodeProto, value: &str) -> bool {
    node.attribute.iter().any(|a| {
        a.g.iter().chain(a.graphs.iter()).any(|g| {
            g.output.iter().any(|o| o.name() == value)
                || g.node.iter().any(|n| {
                    n.input.iter().chain(n.output.iter()).any(|i| i == value)
                        || subgraphs_mention(n, value)
                })
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every accumulator of the shipped MLP's step is read once, by its `Add`; the first
    /// micro-step's graph reads none and writes each gradient as the accumulator's output.
    #[test]
    fn the_first_micro_step_reads_no_accumulator() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("graphs/mlp_ce_adamw");
        let graph = crate::signature::open(&dir, &Default::default()).unwrap();
        let step = crate::step::build_step(
            graph,
            "grad-accum(steps=4),optimizer(lr=0.01),legalize-ort,dce",
            false,
        )
        .unwrap();
        let model = step.model.to_proto();
        let manifest = Manifest::from_model(&model).unwrap();
        let split = crate::split::split_step(&model, &manifest)
            .unwrap()
            .unwrap();
        let start = window_start(&split.accumulate, &manifest).unwrap();
        assert_eq!(start.unchanged, split.accumulate.unchanged);
        let g = start.model.graph.as_ref().unwrap();
        let accumulators: Vec<_> = manifest
            .state
            .iter()
            .filter(|e| e.role == Role::Accumulator)
            .collect();
        assert_eq!(accumulators.len(), 4);
        for e in accumulators {
            assert!(
                !g.node.iter().any(|n| n.input.contains(&e.input)),
                "{} is still read",
                e.input
            );
            assert!(g.output.iter().any(|o| o.name() == e.output));
            // Still an input: the host feeds every specialisation the same state.
            assert!(g.input.iter().any(|i| i.name() == e.input));
        }
        let reads = |g: &GraphProto| g.node.iter().filter(|n| n.op_type() == "Add").count();
        let accumulate = split.accumulate.model.graph.as_ref().unwrap();
        assert_eq!(
            reads(accumulate) - reads(g),
            4,
            "one Add fewer per parameter"
        );
    }
}
