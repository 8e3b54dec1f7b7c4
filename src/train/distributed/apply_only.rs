//! The apply-only specialisation: the step's apply branch on accumulators that already
//! hold the whole window, with no micro-batch of its own.
//!
//! The step's apply branch ends a window *and* computes that window's last micro-step: it
//! reads `acc + g` (the accumulator input plus this micro-step's gradient), `count =
//! micro_step + 1`, `weight_sum + w` and the BatchNorm sums plus this micro-batch's
//! statistics. In data-parallel training every micro-step runs with the accumulate
//! specialisation and the window's sums arrive from the all-reduce, so the apply must read
//! the state inputs themselves. Which values those are the graph says, not our naming: a
//! state whose else-branch output (what the window carries on) is a value computed in the
//! main graph accumulates within the window; the apply-only graph reads the state input
//! wherever the step read that value. The micro-step counter is one of them (its carried
//! value is `count`), so the host feeds it the window's micro-step count. The loss, the
//! forward and the backward are then dead and removed, and so are the data inputs; a step
//! whose apply branch still reads the micro-batch is refused.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::proto::{attribute_proto::AttributeType, GraphProto, ModelProto, NodeProto};
use crate::split::Specialised;
use crate::state::Manifest;
use crate::state::Role;

#[derive(Debug, thiserror::Error)]
pub enum ApplyOnlyError {
    #[error("the step has no If apply region (it was rewritten with --apply where, or by an older onnx-ga): data-parallel training needs one; rewrite it with --apply if")]
    NoApplyRegion,
    #[error("{0}")]
    Structure(String),
    #[error(transparent)]
    Split(#[from] crate::split::SplitError),
}

/// The apply-only specialisation of `model` (see the module doc), and the state inputs
/// whose window value it reads from the input (the states that accumulate within a
/// window), by role.
pub fn apply_only(
    model: &ModelProto,
    manifest: &Manifest,
) -> Result<(Specialised, BTreeMap<String, Role>), ApplyOnlyError> {
    let trigger = manifest
        .apply
        .as_ref()
        .ok_or(ApplyOnlyError::NoApplyRegion)?;
    let graph = model
        .graph
        .as_ref()
        .ok_or_else(|| ApplyOnlyError::Structure("the model has no graph".into()))?;
    let if_node = graph
        .node
        .iter()
        .find(|n| n.op_type() == "If" && n.name() == trigger.node)
        .ok_or_else(|| {
            ApplyOnlyError::Structure(format!(
                "the step has no main-graph If node named '{}' (its apply region)",
                trigger.node
            ))
        })?;
    let else_branch = if_node
        .attribute
        .iter()
        .find(|a| a.name() == "else_branch" && a.r#type() == AttributeType::Graph)
        .and_then(|a| a.g.as_ref())
        .ok_or_else(|| {
            ApplyOnlyError::Structure(format!("If node '{}' has no else_branch", trigger.node))
        })?;
    let graph_inputs: BTreeSet<&str> = graph.input.iter().map(|i| i.name()).collect();
    let by_output: HashMap<&str, (&str, Role)> = manifest
        .state
        .iter()
        .map(|e| (e.output.as_str(), (e.input.as_str(), e.role)))
        .collect();
    let producer: HashMap<&str, &NodeProto> = else_branch
        .node
        .iter()
        .flat_map(|n| n.output.iter().map(move |o| (o.as_str(), n)))
        .collect();

    // Carried value -> state input, for each state the window carries on in a new value.
    let mut substitute: BTreeMap<String, String> = BTreeMap::new();
    let mut accumulating: BTreeMap<String, Role> = BTreeMap::new();
    let mut routed: BTreeSet<&str> = BTreeSet::new();
    for (if_output, branch_output) in if_node.output.iter().zip(&else_branch.output) {
        let Some(&(input, role)) = by_output.get(if_output.as_str()) else {
            continue;
        };
        routed.insert(input);
        let mut source = branch_output.name();
        while let Some(n) = producer.get(source) {
            match (n.op_type(), n.input.first()) {
                ("Identity", Some(i)) if !i.is_empty() => source = i,
                _ => break,
            }
        }
        if source == input || producer.contains_key(source) {
            // Passed through unchanged (or computed in the branch itself: a constant).
            continue;
        }
        if graph_inputs.contains(source) {
            return Err(ApplyOnlyError::Structure(format!(
                "state '{input}' carries input '{source}' on within a window; not a step onnx-ga can run data parallel"
            )));
        }
        substitute.insert(source.to_string(), input.to_string());
        accumulating.insert(input.to_string(), role);
    }
    // A state that moves at every micro-step outside the apply region (BatchNorm statistics
    // with bn_stats=micro) would end up different on every rank.
    for e in &manifest.state {
        if routed.contains(e.input.as_str()) || e.input == e.output {
            continue;
        }
        return Err(ApplyOnlyError::Structure(format!(
            "state '{}' ({}) moves at every micro-step, outside the window's apply: each rank would hold its own value. Data-parallel training needs it to move once per window (rewrite with --bn-stats window)",
            e.input,
            serde_json::to_string(&e.role).unwrap_or_default().trim_matches('"')
        )));
    }

    // The state initializers are dropped by `specialise` anyway: not copied here.
    let mut rewired = crate::split::without_state_initializers(model, manifest);
    let g = rewired.graph.get_or_insert_with(Default::default);
    for node in &mut g.node {
        rename_inputs(node, &substitute);
    }
    // Only the state and the window's flags stay outputs: the loss and any metric of the
    // micro-step would keep the forward alive.
    let state_outputs: BTreeSet<&str> = manifest.state.iter().map(|e| e.output.as_str()).collect();
    let keep = |name: &str| {
        state_outputs.contains(name)
            || name == crate::state::APPLIED_OUTPUT
            || name == crate::train::SKIPPED_OUTPUT
    };
    let dropped: Vec<String> = g
        .output
        .iter()
        .map(|o| o.name().to_string())
        .filter(|n| !keep(n))
        .collect();
    let dropped: Vec<&str> = dropped.iter().map(String::as_str).collect();
    let mut specialised =
        crate::split::specialise(&rewired, manifest, &trigger.node, "then_branch", &dropped)?;

    // The micro-batch is no input of it: nothing may read the data any more.
    let g = specialised.model.graph.get_or_insert_with(Default::default);
    let mut read = BTreeSet::new();
    reads(g, &mut read);
    for name in &manifest.data_inputs {
        if read.contains(name.as_str()) {
            return Err(ApplyOnlyError::Structure(format!(
                "the step's apply branch reads data input '{name}' beyond the window's sums: not a step onnx-ga can run data parallel"
            )));
        }
    }
    g.input
        .retain(|i| !manifest.data_inputs.iter().any(|d| d == i.name()));
    Ok((specialised, accumulating))
}

/// Renames every input of `node` (and the outer values its subgraphs read) by `map`.
fn rename_inputs(node: &mut NodeProto, map: &BTreeMap<String, String>) {
    for name in node.input.iter_mut() {
        if let Some(new) = map.get(name.as_str()) {
            *name = new.clone();
        }
    }
    for a in &mut node.attribute {
        for g in a.g.iter_mut().chain(a.graphs.iter_mut()) {
            for n in &mut g.node {
                rename_inputs(n, map);
            }
            // A branch output that is the carried value itself (no node in between).
            for o in &mut g.output {
                if let Some(new) = map.get(o.name()) {
                    o.name = Some(new.clone());
                }
            }
        }
    }
}

/// Every value any node (at any depth) reads.
fn reads<'a>(g: &'a GraphProto, out: &mut BTreeSet<&'a str>) {
    for n in &g.node {
        out.extend(n.input.iter().map(String::as_str));
        for a in &n.attribute {
            for sub in a.g.iter().chain(a.graphs.iter()) {
                reads(sub, out);
                out.extend(sub.output.iter().map(|o| o.name()));
            }
        }
    }
}
