//! `onnx-ga inspect`: what a training graph contains, as text or JSON.

use std::collections::BTreeMap;
use std::fmt::Write;

use serde::Serialize;

use crate::ir::Model;
use crate::signature::{OptimizerSpec, TrainingGraph, TrainingSignature};

#[derive(Debug, Serialize)]
pub struct Report<'a> {
    pub signature: &'a TrainingSignature,
    pub parameter_count: ParameterCount,
    /// Op counts by domain ("" is ai.onnx), the main graph and subgraphs together.
    pub ops: BTreeMap<String, BTreeMap<String, usize>>,
    /// `domain::op` of every op that standard ONNX Runtime lacks (training build only).
    pub training_only_ops: Vec<String>,
}

#[derive(Debug, Serialize, Default, PartialEq, Eq)]
pub struct ParameterCount {
    pub trainable: u64,
    pub frozen: u64,
    pub total: u64,
}

pub fn report(graph: &TrainingGraph) -> Report<'_> {
    let signature = &graph.signature;
    let mut count = ParameterCount::default();
    for p in &signature.params {
        if p.trainable {
            count.trainable = count.trainable.saturating_add(p.element_count());
        } else {
            count.frozen = count.frozen.saturating_add(p.element_count());
        }
    }
    count.total = count.trainable.saturating_add(count.frozen);
    let ops = op_counts(&graph.model);
    let training_only_ops = ops
        .iter()
        .flat_map(|(domain, ops)| ops.keys().map(move |op| (domain.clone(), op.clone())))
        .filter(|(d, o)| crate::ops::is_training_only(d, o))
        .map(|(d, o)| format!("{}::{o}", if d.is_empty() { "ai.onnx" } else { &d }))
        .collect();
    Report {
        signature,
        parameter_count: count,
        ops,
        training_only_ops,
    }
}

pub fn op_counts(model: &Model) -> BTreeMap<String, BTreeMap<String, usize>> {
    let mut ops: BTreeMap<String, BTreeMap<String, usize>> = BTreeMap::new();
    for n in model.all_nodes() {
        let p = &model.node(n).proto;
        let domain = crate::ir::normalize_domain(p.domain()).to_string();
        *ops.entry(domain)
            .or_default()
            .entry(p.op_type().to_string())
            .or_default() += 1;
    }
    ops
}

/// The human-readable report.
pub fn render_text(report: &Report<'_>) -> String {
    let s = report.signature;
    let mut out = String::new();
    let _ = writeln!(out, "source: {}", describe_source(&s.source));
    let _ = writeln!(out, "data inputs:");
    let width = s
        .data_inputs
        .iter()
        .map(|d| d.name.len())
        .max()
        .unwrap_or(0);
    for d in &s.data_inputs {
        let _ = writeln!(out, "  {:width$}  {}", d.name, d.type_text());
    }
    let _ = writeln!(out, "loss: {}", s.loss);
    let _ = writeln!(out, "seed: {}", s.seed.as_deref().unwrap_or("(none found)"));
    if let Some(reset) = &s.lazy_reset_grad {
        let _ = writeln!(out, "lazy_reset_grad: {reset}");
    }
    let c = &report.parameter_count;
    let trainable = s.params.iter().filter(|p| p.trainable).count();
    let _ = writeln!(
        out,
        "parameters: {} ({trainable} trainable, {} frozen); elements: {} ({} trainable, {} frozen)",
        s.params.len(),
        s.params.len() - trainable,
        c.total,
        c.trainable,
        c.frozen
    );
    let width = s.params.iter().map(|p| p.name.len()).max().unwrap_or(0);
    for p in &s.params {
        let ty = format!(
            "{}[{}]",
            crate::ir::print::elem_type_name(p.elem_type),
            p.dims
                .iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(",")
        );
        let role = if p.trainable { "trainable" } else { "frozen" };
        let grad = p
            .grad
            .as_deref()
            .map(|g| format!("  grad {g}"))
            .unwrap_or_default();
        let buffer = p
            .accumulation
            .as_ref()
            .map(|a| format!("  buffer {}", a.buffer_input))
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "  {:width$}  {ty:14} {role:9} {:>8}{grad}{buffer}",
            p.name,
            p.element_count()
        );
    }
    match &s.optimizer {
        // A rewritten step carries its optimizer in the recipe, shown after the report.
        None if matches!(s.source, crate::signature::Source::Step { .. }) => {
            let _ = writeln!(out, "optimizer: in the step (see the recipe below)");
        }
        None => {
            let _ = writeln!(out, "optimizer: (none given)");
        }
        Some(o) => {
            let spec = match &o.spec {
                OptimizerSpec::Sgd => "sgd".to_string(),
                OptimizerSpec::Adamw { beta1, beta2, epsilon, weight_decay, correct_bias, adam_mode } => format!(
                    "adamw (beta1 {beta1}, beta2 {beta2}, epsilon {epsilon:e}, weight_decay {weight_decay}, correct_bias {correct_bias}, adam_mode {adam_mode})"
                ),
            };
            let lr = o
                .learning_rate
                .map(|l| format!(", learning rate {l}"))
                .unwrap_or_default();
            let step = o.step.map(|s| format!(", step {s}")).unwrap_or_default();
            let _ = writeln!(out, "optimizer: {spec}{lr}{step}");
        }
    }
    let _ = writeln!(out, "ops:");
    for (domain, ops) in &report.ops {
        let list: Vec<String> = ops
            .iter()
            .map(|(op, n)| {
                let mark = if crate::ops::is_training_only(domain, op) {
                    " [training build only]"
                } else {
                    ""
                };
                format!("{op} {n}{mark}")
            })
            .collect();
        let domain = if domain.is_empty() { "ai.onnx" } else { domain };
        let _ = writeln!(out, "  {domain}: {}", list.join(", "));
    }
    if report.training_only_ops.is_empty() {
        let _ = writeln!(out, "standard ONNX Runtime: runs every op of this graph");
    } else {
        let _ = writeln!(
            out,
            "standard ONNX Runtime lacks {} of these ops: {} (legalize with `--pipeline legalize-ort`)",
            report.training_only_ops.len(),
            report.training_only_ops.join(", ")
        );
    }
    out
}

fn describe_source(source: &crate::signature::Source) -> String {
    use crate::signature::Source;
    match source {
        Source::OrtArtifacts {
            dir,
            optimizer_model,
            eval_model,
            ..
        } => {
            let mut parts = vec!["training_model.onnx", "checkpoint"];
            if optimizer_model.is_some() {
                parts.push("optimizer_model.onnx");
            }
            if eval_model.is_some() {
                parts.push("eval_model.onnx");
            }
            format!(
                "ONNX Runtime training artifacts in {} ({})",
                dir.display(),
                parts.join(", ")
            )
        }
        Source::OrtTrainingGraph { file } => format!(
            "ONNX Runtime training graph {} (no checkpoint: frozen parameters count as data)",
            file.display()
        ),
        Source::Step {
            file,
            pipeline,
            state_pairs,
        } => format!(
            "onnx-ga training step {} ({state_pairs} state pairs; pipeline {pipeline})",
            file.display()
        ),
        Source::Forward {
            file,
            differentiated,
        } => format!(
            "forward model {}{}",
            file.display(),
            if *differentiated {
                " (differentiated by autodiff)"
            } else {
                ""
            }
        ),
        Source::Plain { file } => format!(
            "gradient graph {} (roles given on the command line)",
            file.display()
        ),
    }
}

/// `inspect --agc`: each trainable parameter's AGC units (from the ONNX op that consumes it
/// in the forward pass) and whether AGC clips it, as the `agc` pass would with `selection`.
pub fn agc_plan(
    graph: &TrainingGraph,
    selection: &crate::passes::agc::Selection,
) -> Result<crate::passes::agc::Plan, String> {
    crate::passes::agc::plan(&graph.model, &graph.signature, selection)
}

/// The text form of [`agc_plan`].
pub fn render_agc_text(plan: &crate::passes::agc::Plan) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "agc units (a unit is clipped when ||G_u|| > clip * max(||W_u||, eps)):"
    );
    if plan.final_layer.is_empty() {
        let _ = writeln!(out, "  final layer: (none found)");
    }
    for f in &plan.final_layer {
        let _ = writeln!(out, "  final layer: {f}");
    }
    let width = plan.params.iter().map(|p| p.name.len()).max().unwrap_or(0);
    for p in &plan.params {
        let dims = format!(
            "[{}]",
            p.dims
                .iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(",")
        );
        let status = match &p.excluded {
            None => "clipped".to_string(),
            Some(why) => format!("not clipped ({why})"),
        };
        let units = match p.unit_count {
            1 => "1 unit".to_string(),
            n => format!("{n} units"),
        };
        let _ = writeln!(
            out,
            "  {:width$}  {dims:12} {:14} {units:>9}  {status}; {}",
            p.name,
            p.units.describe(),
            p.rule
        );
        if let Some(note) = &p.note {
            let _ = writeln!(out, "  {:width$}  note: {note}", "");
        }
    }
    out
}

/// The floating-point initializers of a forward model that autodiff leaves untrained.
pub fn render_untrained_text(untrained: &[crate::passes::autodiff::Untrained]) -> String {
    let mut out = String::new();
    if untrained.is_empty() {
        let _ = writeln!(out, "untrained initializers: none");
        return out;
    }
    let elements: i64 = untrained
        .iter()
        .map(|u| u.dims.iter().product::<i64>())
        .sum();
    let _ = writeln!(
        out,
        "untrained initializers: {} ({elements} elements)",
        untrained.len()
    );
    let width = untrained.iter().map(|u| u.name.len()).max().unwrap_or(0);
    for u in untrained {
        let dims = u.dims.iter().map(|d| d.to_string()).collect::<Vec<_>>();
        let _ = writeln!(
            out,
            "  {:width$}  [{}]  {}",
            u.name,
            dims.join(","),
            u.reason.describe()
        );
    }
    out
}
