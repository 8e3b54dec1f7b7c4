//! Running a step as two specialised graphs, one per branch of its apply `If`.
//!
//! The exported step is one graph: `If(apply)` whose then-branch updates the parameters and
//! whose else-branch passes them through. Run as is, ONNX Runtime pays for the `If` on every
//! micro-step, and the else-branch *copies* every parameter and optimizer moment into the
//! `If`'s outputs (measured: 8 to 40 µs per micro-step on the shipped graphs, more than the
//! accumulation itself). The host knows which branch a micro-step takes before running it
//! (`apply = micro_step + 1 >= K or flush`, recorded in the manifest), so the trainer runs
//! one of two specialisations of the same graph instead:
//!
//! - **accumulate**: the `If` replaced by its else-branch. State the branch passes through
//!   unchanged (parameters, moments, the optimizer-step counter, ...) is no longer an output
//!   at all: the host keeps the value it already holds, nothing is copied.
//! - **apply**: the `If` replaced by its then-branch.
//!
//! The inline is the IR's ([`crate::ir::Model::inline_if`]): it renames nothing the host
//! sees (graph inputs and outputs keep their names, and every value inside keeps its
//! globally unique name), and nested subgraphs (the loss-scale gate) keep reading the values
//! they read, by reference rather than by name. Both specialisations compute exactly the ops
//! of the branch they inline, so training is the same as with the one graph (tests check it
//! bit for bit).

use std::collections::{BTreeSet, HashMap, HashSet};

use crate::ir::inline::{Branch, InlineError};
use crate::ir::{BodyId, Model, ValueId};
use crate::proto::{attribute_proto::AttributeType, GraphProto, ModelProto, NodeProto};
use crate::state::Manifest;
use crate::state::{ApplyTrigger, Role};

#[derive(Debug, thiserror::Error)]
pub enum SplitError {
    #[error("the step has no main-graph If node named '{0}' (its apply region)")]
    NoApplyNode(String),
    #[error("If node '{node}' has no graph attribute '{branch}'")]
    NoBranch { node: String, branch: String },
    #[error("If node '{node}': {branch} has {have} outputs, the If has {want}")]
    OutputCount {
        node: String,
        branch: String,
        have: usize,
        want: usize,
    },
    #[error("{0}")]
    NotTheApplyRegion(String),
    #[error("specialising the step for '{branch}' produced an invalid graph: {errors}")]
    Invalid { branch: String, errors: String },
}

/// One specialisation of the step.
#[derive(Clone)]
pub struct Specialised {
    pub model: ModelProto,
    /// State inputs (by name) this specialisation leaves unchanged: it has no output for
    /// them and the host keeps the value it holds.
    pub unchanged: BTreeSet<String>,
}

/// Both specialisations and what decides between them.
pub struct SplitStep {
    /// For micro-steps that continue the window.
    pub accumulate: Specialised,
    /// For the micro-step that ends it.
    pub apply: Specialised,
    pub trigger: ApplyTrigger,
}

/// Splits a step whose manifest records an `If` apply region; `None` for a step without one
/// (`apply=where`, or written before the trigger was recorded), which runs as one graph.
/// The accumulate specialisation has no `applied` output: it is false there by construction.
pub fn split_step(
    model: &ModelProto,
    manifest: &Manifest,
) -> Result<Option<SplitStep>, SplitError> {
    let Some(trigger) = manifest.apply.clone() else {
        return Ok(None);
    };
    check_apply_region(model, manifest).map_err(SplitError::NotTheApplyRegion)?;
    let accumulate = specialise(
        model,
        manifest,
        &trigger.node,
        "else_branch",
        &[crate::state::APPLIED_OUTPUT],
    )?;
    let apply = specialise(model, manifest, &trigger.node, "then_branch", &[])?;
    Ok(Some(SplitStep {
        accumulate,
        apply,
        trigger,
    }))
}

/// The step with the `If` named `node` replaced by its `branch` (`then_branch` or
/// `else_branch`) through [`Model::inline_if`], dead code removed, and the state
/// initializers dropped (the host feeds every state input on every run, so two sessions
/// need not each hold a second copy of the initial parameters; they are not copied to drop
/// them either). A state output the branch passes through unchanged is no output of the
/// specialisation (its readers read the state input itself); the outputs named in
/// `drop_outputs` go too.
pub fn specialise(
    model: &ModelProto,
    manifest: &Manifest,
    node: &str,
    branch: &str,
    drop_outputs: &[&str],
) -> Result<Specialised, SplitError> {
    let no_branch = || SplitError::NoBranch {
        node: node.to_string(),
        branch: branch.to_string(),
    };
    let which = Branch::from_attribute(branch).ok_or_else(no_branch)?;
    let mut model = without_state_initializers(model, manifest);
    // A specialisation is not a step a host could drive on its own (state outputs are
    // missing by design): it carries no manifest.
    model
        .metadata_props
        .retain(|p| !p.key().starts_with(crate::state::KEY_PREFIX));
    let graph = model.graph.get_or_insert_with(Default::default);
    let if_node = graph
        .node
        .iter()
        .find(|n| n.op_type() == "If" && n.name() == node)
        .ok_or_else(|| SplitError::NoApplyNode(node.to_string()))?;
    let body = graph_attribute(if_node, branch).ok_or_else(no_branch)?;
    if body.output.len() != if_node.output.len() {
        return Err(SplitError::OutputCount {
            node: node.to_string(),
            branch: branch.to_string(),
            have: body.output.len(),
            want: if_node.output.len(),
        });
    }
    // Read from the proto by the rule `check_apply_region` applies, so the two agree.
    let through = passed_through(graph, if_node, body, manifest);

    let mut ir = Model::from_proto(model);
    let if_id = ir
        .body_nodes(BodyId::MAIN)
        .find(|n| {
            let p = &ir.node(*n).proto;
            p.op_type() == "If" && p.name() == node
        })
        .ok_or_else(|| SplitError::NoApplyNode(node.to_string()))?;
    let invalid = |errors: String| SplitError::Invalid {
        branch: branch.to_string(),
        errors,
    };
    // State the branch passes through: the host keeps the value it holds, so the output goes
    // and whatever read the If's output reads the state input.
    let mut unchanged = BTreeSet::new();
    for (slot, input) in through {
        let Some(out) = ir.node(if_id).outputs[slot] else {
            continue;
        };
        let state = ir
            .lookup(BodyId::MAIN, &input)
            .ok_or_else(|| invalid(format!("state input '{input}' is not in the graph")))?;
        remove_main_outputs(&mut ir, |v| v == out);
        ir.replace_all_uses(out, state, true)
            .map_err(|e| invalid(e.to_string()))?;
        unchanged.insert(input);
    }
    ir.inline_if(if_id, which).map_err(|e| match e {
        InlineError::NoBranch { .. } => no_branch(),
        e => invalid(e.to_string()),
    })?;
    let dropped: HashSet<ValueId> = ir
        .graph_outputs()
        .into_iter()
        .filter(|v| drop_outputs.contains(&ir.name(*v)))
        .collect();
    remove_main_outputs(&mut ir, |v| dropped.contains(&v));
    // The branch's initializers moved in with it: none may stand for a state input (the
    // host feeds those).
    let state_inputs: HashSet<&str> = manifest.state.iter().map(|e| e.input.as_str()).collect();
    let stale: Vec<ValueId> = ir
        .main()
        .initializers
        .iter()
        .map(|(v, _)| *v)
        .filter(|v| state_inputs.contains(ir.name(*v)))
        .collect();
    ir.body_mut(BodyId::MAIN)
        .initializers
        .retain(|(v, _)| !stale.contains(v));

    crate::passes::dce::eliminate_dead_code(&mut ir);
    crate::state::verify_step(&ir).map_err(|e| invalid(e.to_string()))?;
    Ok(Specialised {
        model: ir.to_proto(),
        unchanged,
    })
}

/// Removes every main-graph output whose value `drop` selects, keeping the others' order.
fn remove_main_outputs(ir: &mut Model, drop: impl Fn(ValueId) -> bool) {
    while let Some(index) = ir.graph_outputs().into_iter().position(&drop) {
        ir.remove_output(BodyId::MAIN, index);
    }
}

fn graph_attribute<'a>(node: &'a NodeProto, name: &str) -> Option<&'a GraphProto> {
    node.attribute
        .iter()
        .find(|a| a.name() == name && a.r#type() == AttributeType::Graph)
        .and_then(|a| a.g.as_ref())
}

/// A copy of `model` without the initializers of its state inputs, made without copying
/// them first (the parameters are the largest part of a step): the host feeds every state
/// input, so a specialisation needs none of them.
pub(crate) fn without_state_initializers(model: &ModelProto, manifest: &Manifest) -> ModelProto {
    let state_inputs: HashSet<&str> = manifest.state.iter().map(|e| e.input.as_str()).collect();
    // Every field named, so that a field added to the proto is not silently dropped here.
    let ModelProto {
        ir_version,
        opset_import,
        producer_name,
        producer_version,
        domain,
        model_version,
        doc_string,
        graph,
        metadata_props,
        training_info,
        functions,
        configuration,
    } = model;
    let graph = graph.as_ref().map(|g| {
        let GraphProto {
            node,
            name,
            initializer,
            sparse_initializer,
            doc_string,
            input,
            output,
            value_info,
            quantization_annotation,
            metadata_props,
        } = g;
        GraphProto {
            node: node.clone(),
            name: name.clone(),
            initializer: initializer
                .iter()
                .filter(|t| !state_inputs.contains(t.name()))
                .cloned()
                .collect(),
            sparse_initializer: sparse_initializer.clone(),
            doc_string: doc_string.clone(),
            input: input.clone(),
            output: output.clone(),
            value_info: value_info.clone(),
            quantization_annotation: quantization_annotation.clone(),
            metadata_props: metadata_props.clone(),
        }
    });
    ModelProto {
        ir_version: *ir_version,
        opset_import: opset_import.clone(),
        producer_name: producer_name.clone(),
        producer_version: producer_version.clone(),
        domain: domain.clone(),
        model_version: *model_version,
        doc_string: doc_string.clone(),
        graph,
        metadata_props: metadata_props.clone(),
        training_info: training_info.clone(),
        functions: functions.clone(),
        configuration: configuration.clone(),
    }
}

/// The slots of the `If` whose `body` output passes a state through unchanged, with that
/// state's input: the If output is a graph output, the manifest's next value of a state, and
/// the branch returns (through its own `Identity` nodes) that state's input as it came in.
/// Read-only, on the proto: the trainer checks every step it loads with it
/// ([`check_apply_region`]), and importing the step into the IR would copy its parameters.
fn passed_through<'a>(
    graph: &'a GraphProto,
    if_node: &'a NodeProto,
    body: &'a GraphProto,
    manifest: &'a Manifest,
) -> Vec<(usize, String)> {
    let graph_inputs: HashSet<&str> = graph.input.iter().map(|i| i.name()).collect();
    let graph_outputs: HashSet<&str> = graph.output.iter().map(|o| o.name()).collect();
    let state_of_output: HashMap<&str, &str> = manifest
        .state
        .iter()
        .map(|e| (e.output.as_str(), e.input.as_str()))
        .collect();
    let producer: HashMap<&'a str, &'a NodeProto> = body
        .node
        .iter()
        .flat_map(|n| n.output.iter().map(move |o| (o.as_str(), n)))
        .collect();
    // The value the branch's Identity nodes forward (the rule of `Model::forwarded`).
    let forwarded = |mut value: &'a str| -> &'a str {
        while let Some(n) = producer.get(value) {
            if n.op_type() != "Identity" || !crate::ir::normalize_domain(n.domain()).is_empty() {
                break;
            }
            match n.input.first() {
                Some(input) if !input.is_empty() => value = input,
                _ => break,
            }
        }
        value
    };
    let mut through = Vec::new();
    for (slot, (if_output, branch_output)) in if_node.output.iter().zip(&body.output).enumerate() {
        let source = forwarded(branch_output.name());
        if !if_output.is_empty()
            && graph_outputs.contains(if_output.as_str())
            && state_of_output.get(if_output.as_str()) == Some(&source)
            && graph_inputs.contains(source)
            && !producer.contains_key(source)
        {
            through.push((slot, source.to_string()));
        }
    }
    through
}

/// A specialisation as a file of its own, for hosts other than ours (`rewrite --split`):
/// the step's manifest, which branch it is (`accumulate` or `apply`) and the state inputs it
/// leaves unchanged. Its state inputs have no initializers: the initial values are in the
/// step itself. A host runs `accumulate` while `micro_step + 1 < K` and `apply` on the
/// micro-step that completes the window, feeding each output back as its state input and
/// keeping the unchanged ones.
pub fn standalone(s: &Specialised, manifest: &Manifest, branch: &str) -> ModelProto {
    let mut model = s.model.clone();
    model.metadata_props.extend(manifest.metadata());
    for (key, value) in [
        (crate::state::SPECIALISATION_KEY, branch.to_string()),
        (
            crate::state::UNCHANGED_KEY,
            serde_json::to_string(&s.unchanged).expect("names serialize"),
        ),
    ] {
        model
            .metadata_props
            .push(crate::proto::StringStringEntryProto {
                key: Some(key.into()),
                value: Some(value),
            });
    }
    model
}

/// Whether the host must apply on the coming micro-step, by the rule the graph computes
/// (`grad-accum`: `micro_step + 1 >= K or flush`).
pub fn applies(micro_step: i64, steps: i64, flush: bool) -> bool {
    micro_step + 1 >= steps || flush
}

/// The state input holding the micro-step counter.
pub fn micro_step_input(manifest: &Manifest) -> Option<&str> {
    manifest
        .state
        .iter()
        .find(|e| e.role == Role::MicroStep)
        .map(|e| e.input.as_str())
}

/// Checks that the main-graph `If` the manifest's trigger names is the apply region the
/// manifest describes, so that running either branch on the host's decision trains like
/// the graph itself: its condition is `Or(GreaterOrEqual(Add(micro_step, 1), steps),
/// flush)` over the manifest's micro-step state, steps and flush inputs, its else-branch
/// passes every parameter through unchanged and its then-branch updates every one. `Ok`
/// for a step without an `If` trigger. The error says what differs.
pub fn check_apply_region(model: &ModelProto, manifest: &Manifest) -> Result<(), String> {
    let Some(trigger) = &manifest.apply else {
        return Ok(());
    };
    let Some(graph) = model.graph.as_ref() else {
        return Err("the model has no graph".into());
    };
    let node = trigger.node.as_str();
    let if_node = graph
        .node
        .iter()
        .find(|n| n.op_type() == "If" && n.name() == node)
        .ok_or_else(|| {
            format!(
                "the step has no main-graph If node named '{node}' (the manifest's apply region)"
            )
        })?;
    let producer = |v: &str| graph.node.iter().find(|n| n.output.iter().any(|o| o == v));
    let bad = |what: String| {
        Err(format!(
            "the If '{node}' is not the apply region the manifest describes: {what}"
        ))
    };
    // The condition.
    let cond = if_node.input.first().map(String::as_str).unwrap_or("");
    let Some(or) = producer(cond).filter(|n| n.op_type() == "Or" && n.input.len() == 2) else {
        return bad(format!(
            "its condition '{cond}' is not an Or of the window test and '{}'",
            trigger.flush
        ));
    };
    let Some(full) = or.input.iter().find(|i| **i != trigger.flush) else {
        return bad(format!(
            "its condition does not read the flush input '{}'",
            trigger.flush
        ));
    };
    if !or.input.contains(&trigger.flush) {
        return bad(format!(
            "its condition does not read the flush input '{}'",
            trigger.flush
        ));
    }
    let Some(ge) = producer(full).filter(|n| {
        n.op_type() == "GreaterOrEqual" && n.input.len() == 2 && n.input[1] == trigger.steps
    }) else {
        return bad(format!(
            "'{full}' is not GreaterOrEqual(micro_step + 1, '{}')",
            trigger.steps
        ));
    };
    let Some(micro_step) = micro_step_input(manifest) else {
        return bad("the manifest has no micro_step state".into());
    };
    let is_one = |v: &str| {
        let tensor = graph
            .initializer
            .iter()
            .find(|t| t.name() == v)
            .cloned()
            .or_else(|| {
                producer(v)
                    .filter(|n| n.op_type() == "Constant")
                    .and_then(|n| n.attribute.iter().find(|a| a.name() == "value"))
                    .and_then(|a| a.t.clone())
            });
        tensor.is_some_and(|t| {
            let raw = t.raw_data.as_deref();
            t.data_type() == crate::proto::tensor_proto::DataType::Int64 as i32
                && t.dims.iter().product::<i64>() == 1
                && (raw == Some(&1i64.to_le_bytes()[..]) || (raw.is_none() && t.int64_data == [1]))
        })
    };
    let count_ok = producer(&ge.input[0]).is_some_and(|n| {
        n.op_type() == "Add"
            && n.input.len() == 2
            && ((n.input[0] == micro_step && is_one(&n.input[1]))
                || (n.input[1] == micro_step && is_one(&n.input[0])))
    });
    if !count_ok {
        return bad(format!("'{}' is not '{micro_step}' + 1", ge.input[0]));
    }
    // The branches.
    let params: Vec<&str> = manifest
        .state
        .iter()
        .filter(|e| e.role == Role::Param)
        .map(|e| e.input.as_str())
        .collect();
    for (branch, updates) in [("else_branch", false), ("then_branch", true)] {
        let Some(body) = graph_attribute(if_node, branch) else {
            return bad(format!("it has no {branch}"));
        };
        if body.output.len() != if_node.output.len() {
            return bad(format!(
                "its {branch} has {} outputs, the If {}",
                body.output.len(),
                if_node.output.len()
            ));
        }
        let unchanged: BTreeSet<String> = passed_through(graph, if_node, body, manifest)
            .into_iter()
            .map(|(_, input)| input)
            .collect();
        for p in &params {
            if unchanged.contains(*p) == updates {
                return bad(if updates {
                    format!("its then_branch (taken when the window ends) leaves parameter '{p}' unchanged: are the branches swapped?")
                } else {
                    format!("its else_branch (taken inside a window) changes parameter '{p}': are the branches swapped?")
                });
            }
        }
    }
    Ok(())
}
