//! `onnx-ga inspect`: what a training graph contains, as text or JSON.

use std::collections::BTreeMap;
use std::fmt::Write;

use serde::Serialize;

use crate::ir::{BodyId, Model};
use crate::recipe::{Headline, Recipe};
use crate::signature::{OptimizerSpec, TrainingGraph, TrainingSignature};
use crate::state::Role;

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
    let training_only_ops = training_only_in(&ops);
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

/// The ops of `ops` (counts by domain) that standard ONNX Runtime lacks, as `domain::Op`
/// (`ai.onnx::Op` for the default domain).
fn training_only_in(ops: &BTreeMap<String, BTreeMap<String, usize>>) -> Vec<String> {
    ops.iter()
        .flat_map(|(domain, ops)| ops.keys().map(move |op| (domain.as_str(), op.as_str())))
        .filter(|(d, o)| crate::ops::is_training_only(d, o))
        .map(|(d, o)| format!("{}::{o}", if d.is_empty() { "ai.onnx" } else { d }))
        .collect()
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

// ------------------------------------------------------------------ a rewritten step

/// The state tensors of one role.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RoleGroup {
    pub role: Role,
    pub tensors: usize,
    pub elements: u64,
    pub bytes: u64,
    /// Every tensor's state input name.
    pub names: Vec<String>,
}

/// A control input of the step (K, learning rate, flush) with its built-in value.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Control {
    pub input: String,
    pub what: &'static str,
    pub value: Option<String>,
}

/// Whether an engine runs the step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EngineFit {
    pub engine: &'static str,
    pub runs: bool,
    pub note: String,
}

/// What `inspect` shows of a rewritten step besides the signature.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepView {
    /// `None` for a step written before steps recorded their recipe.
    pub recipe: Option<Recipe>,
    pub headline: Option<Headline>,
    pub pipeline: String,
    pub version: String,
    pub state: Vec<RoleGroup>,
    pub state_bytes: u64,
    pub controls: Vec<Control>,
    pub engines: Vec<EngineFit>,
    /// The model `train --eval-data` validates with when not told (`rewrite` recorded it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_model: Option<crate::eval_model::RecordedEvalModel>,
}

/// The ops of `model` (subgraphs included) that only ONNX Runtime's training build has:
/// what every standard engine lacks. Sorted, each once, as `domain::Op`.
pub fn training_only_ops(model: &Model) -> Vec<String> {
    let mut ops: Vec<String> = model
        .all_nodes()
        .map(|n| &model.node(n).proto)
        .filter(|p| crate::ops::is_training_only(p.domain(), p.op_type()))
        .map(|p| match crate::ir::normalize_domain(p.domain()) {
            "" => p.op_type().to_string(),
            d => format!("{d}::{}", p.op_type()),
        })
        .collect();
    ops.sort();
    ops.dedup();
    ops
}

/// Bytes of one element of an ONNX element type (0 when unknown).
fn elem_bytes(elem: i32) -> u64 {
    use crate::proto::tensor_proto::DataType as D;
    match D::try_from(elem) {
        Ok(D::Float | D::Int32 | D::Uint32) => 4,
        Ok(D::Double | D::Int64 | D::Uint64) => 8,
        Ok(D::Float16 | D::Bfloat16 | D::Int16 | D::Uint16) => 2,
        Ok(D::Bool | D::Int8 | D::Uint8) => 1,
        _ => 0,
    }
}

impl StepView {
    /// The view of a step model (its manifest already read into `manifest`).
    pub fn of(
        model: &Model,
        manifest: &crate::state::Manifest,
        training_only_ops: &[String],
    ) -> Result<StepView, String> {
        let recipe = Recipe::of_model(&model.header)?;
        let mut groups: Vec<RoleGroup> = Vec::new();
        for entry in &manifest.state {
            // The initializer's, or (a state that starts at zeros, stored nowhere) the
            // input's declared static type.
            let (elements, bytes) = model
                .lookup(BodyId::MAIN, &entry.input)
                .and_then(|v| match model.initializer(v) {
                    Some(t) => Some((t.data_type(), t.dims.clone())),
                    None => model
                        .value_type(v)
                        .as_ref()
                        .and_then(crate::state::static_tensor_type),
                })
                .map(|(elem, dims)| {
                    let n = dims
                        .iter()
                        .map(|d| (*d).max(0) as u64)
                        .fold(1u64, u64::saturating_mul);
                    (n, n.saturating_mul(elem_bytes(elem)))
                })
                .unwrap_or((0, 0));
            let group = match groups.iter_mut().position(|g| g.role == entry.role) {
                Some(i) => &mut groups[i],
                None => {
                    groups.push(RoleGroup {
                        role: entry.role,
                        tensors: 0,
                        elements: 0,
                        bytes: 0,
                        names: Vec::new(),
                    });
                    groups.last_mut().expect("just pushed")
                }
            };
            group.tensors += 1;
            group.elements = group.elements.saturating_add(elements);
            group.bytes = group.bytes.saturating_add(bytes);
            group.names.push(entry.input.clone());
        }
        let state_bytes = groups.iter().map(|g| g.bytes).fold(0, u64::saturating_add);
        let value_of = |name: &str| -> Option<String> {
            let v = model.lookup(BodyId::MAIN, name)?;
            let t = crate::data::Tensor::from_tensor_proto(model.initializer(v)?).ok()?;
            Some(match t {
                crate::data::Tensor::F32(a) => a.iter().next().map(|x| format!("{x}"))?,
                crate::data::Tensor::I64(a) => a.iter().next().map(|x| format!("{x}"))?,
                crate::data::Tensor::Bool(a) => a.iter().next().map(|x| format!("{x}"))?,
                _ => return None,
            })
        };
        let mut controls = Vec::new();
        if let Some(apply) = &manifest.apply {
            controls.push(Control {
                input: apply.steps.clone(),
                what: "micro-steps per window (K; train --accum-steps)",
                value: value_of(&apply.steps),
            });
        }
        if let Some(lr) = &manifest.learning_rate {
            controls.push(Control {
                input: lr.clone(),
                what: "learning rate (train --lr)",
                value: value_of(lr),
            });
        }
        if let Some(apply) = &manifest.apply {
            controls.push(Control {
                input: apply.flush.clone(),
                what: "apply a partial window now (train --flush)",
                value: value_of(&apply.flush),
            });
        }
        let headline = recipe.as_ref().map(Recipe::headline);
        let precision = headline
            .as_ref()
            .map(|h| h.precision.clone())
            .unwrap_or_else(|| "fp32".into());
        let proto = model.to_proto();
        // A newer opset or IR version than ONNX Runtime loads, which cannot move down.
        let versions_refused = crate::passes::fit_opset::fit_for_ort(&proto).err();
        let mut engines = Vec::new();
        engines.push(match (&versions_refused, training_only_ops.is_empty(), precision.as_str()) {
            (Some(refused), _, _) => EngineFit {
                engine: "ort",
                runs: false,
                note: refused.to_string(),
            },
            (None, false, _) => EngineFit {
                engine: "ort",
                runs: false,
                note: format!(
                    "standard ONNX Runtime lacks {}",
                    training_only_ops.join(", ")
                ),
            },
            (None, true, "bf16") => EngineFit {
                engine: "ort",
                runs: true,
                note: "ONNX Runtime 1.31 standard ops; bf16 kernels on CUDA only (the CPU provider does not load bf16 steps)".into(),
            },
            (None, true, _) => EngineFit {
                engine: "ort",
                runs: true,
                note: "ONNX Runtime 1.31, standard ops only (--device cpu or cuda)".into(),
            },
        });
        let lowered = crate::passes::lower_for_tract::needs_lowering(&proto);
        let bf16 = precision == "bf16";
        engines.push(EngineFit {
            engine: "tract",
            runs: cfg!(feature = "tract") && training_only_ops.is_empty() && !bf16,
            note: match (cfg!(feature = "tract"), lowered) {
                (false, _) => "this build has no tract (feature `tract`)".into(),
                _ if !training_only_ops.is_empty() => {
                    format!("tract lacks {}", training_only_ops.join(", "))
                }
                _ if bf16 => "tract has no bfloat16".into(),
                (true, true) => "pure Rust, one thread; the ops tract lacks are lowered in memory at load (rewrite --engine tract writes them lowered)".into(),
                (true, false) => "pure Rust, one thread; no op needs lowering".into(),
            },
        });
        Ok(StepView {
            recipe,
            headline,
            pipeline: manifest.pipeline.clone(),
            version: manifest.version.clone(),
            state: groups,
            state_bytes,
            controls,
            engines,
            // An unreadable record only costs the default, which `train` reports itself.
            eval_model: crate::eval_model::RecordedEvalModel::read(&model.header)
                .and_then(Result::ok),
        })
    }

    /// What to warn about when the step is written for `target` (`ort` or `tract`): the
    /// engine cannot load it (ops it lacks, or bfloat16 where it has no kernels).
    pub fn engine_warnings(&self, target: &str) -> Vec<String> {
        let bf16 = self
            .headline
            .as_ref()
            .is_some_and(|h| h.precision == "bf16");
        let mut out = Vec::new();
        for fit in self.engines.iter().filter(|f| f.engine == target) {
            if !fit.runs {
                out.push(format!(
                    "{} cannot load this step: {}",
                    fit.engine, fit.note
                ));
            } else if fit.engine == "ort" && bf16 {
                out.push(
                    "ort loads this bf16 step only with --device cuda: the CPU provider has no bfloat16 kernels for it (nor has tract)"
                        .into(),
                );
            }
        }
        out
    }

    /// The text `inspect` prints after the signature.
    pub fn render_text(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "step: written by onnx-ga {}", self.version);
        match &self.headline {
            None => {
                let _ = writeln!(
                    out,
                    "recipe: not recorded (a step written before onnx-ga recorded recipes); pipeline {}",
                    self.pipeline
                );
            }
            Some(h) => {
                let opt = |v: &Option<String>| v.clone().unwrap_or_else(|| "?".into());
                let _ = writeln!(out, "  K (micro-steps per window): {}", opt(&h.accum_steps));
                let _ = writeln!(out, "  normalisation: {}", opt(&h.normalize));
                let _ = writeln!(out, "  optimizer: {}", opt(&h.optimizer));
                let _ = writeln!(out, "  learning rate: {}", opt(&h.learning_rate));
                let _ = writeln!(out, "  AGC: {}", h.agc);
                if let Some(max_norm) = &h.clip_norm {
                    let _ = writeln!(out, "  clipped by the global norm: max_norm {max_norm}");
                }
                let _ = writeln!(out, "  loss scale: {}", h.loss_scale);
                let _ = writeln!(out, "  precision: {}", h.precision);
                let _ = match &h.bn_var {
                    Some(var) => writeln!(
                        out,
                        "  BatchNorm statistics: {}, running variance {var}",
                        opt(&h.bn_stats)
                    ),
                    None => writeln!(out, "  BatchNorm statistics: {}", opt(&h.bn_stats)),
                };
                let _ = writeln!(out, "  apply region: {}", opt(&h.apply));
            }
        }
        if let Some(e) = &self.eval_model {
            let _ = writeln!(
                out,
                "eval model (train --eval-data without --eval-model): {} (SHA-256 {}...)",
                e.path.display(),
                &e.sha256[..e.sha256.len().min(16)]
            );
        }
        if let Some(recipe) = &self.recipe {
            let _ = writeln!(
                out,
                "recipe (every setting; given, from the artifacts, or default):"
            );
            out.push_str(&recipe.render_text());
        }
        let _ = writeln!(
            out,
            "state: {} tensors, {} bytes",
            self.state.iter().map(|g| g.tensors).sum::<usize>(),
            self.state_bytes
        );
        let width = self
            .state
            .iter()
            .map(|g| role_name(g.role).len())
            .max()
            .unwrap_or(0);
        for g in &self.state {
            let names: Vec<&str> = g.names.iter().take(4).map(String::as_str).collect();
            let more = match g.names.len().saturating_sub(4) {
                0 => String::new(),
                n => format!(", ... ({n} more)"),
            };
            let _ = writeln!(
                out,
                "  {:width$}  {:>3} tensors {:>9} elements {:>10} bytes  {}{more}",
                role_name(g.role),
                g.tensors,
                g.elements,
                g.bytes,
                names.join(", ")
            );
        }
        if !self.controls.is_empty() {
            let _ = writeln!(out, "controls:");
            for c in &self.controls {
                let _ = writeln!(
                    out,
                    "  {} = {}  {}",
                    c.input,
                    c.value.as_deref().unwrap_or("?"),
                    c.what
                );
            }
        }
        let _ = writeln!(out, "engines:");
        for e in &self.engines {
            let _ = writeln!(
                out,
                "  {}: {}; {}",
                e.engine,
                if e.runs { "runs it" } else { "cannot run it" },
                e.note
            );
        }
        out
    }
}

fn role_name(role: Role) -> String {
    serde_json::to_value(role)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

/// `inspect MODEL.onnx` of a forward model without a loss: what the model takes and gives,
/// the floating-point initializers autodiff would train, its ops, and the commands that go
/// on from there (the loss is the user's choice: the report cannot pick it).
#[derive(Debug, Serialize)]
pub struct ForwardOverview {
    pub file: std::path::PathBuf,
    pub inputs: Vec<crate::signature::TensorInfo>,
    pub outputs: Vec<crate::signature::TensorInfo>,
    /// Floating-point initializers autodiff trains where a loss reaches them (unless
    /// `--freeze`/`--trainable` say otherwise): all of them, or torch's parameters where
    /// the exporter recorded its list.
    pub parameters: usize,
    pub parameter_elements: u64,
    /// Floating-point initializers torch's export names as buffers or constants: not
    /// trained.
    pub buffers: usize,
    /// Every other initializer (integer shapes, indices, masks): never trained.
    pub other_initializers: usize,
    /// Whether the parameters are torch's own list (its dynamo exporter's record).
    pub torch_parameter_list: bool,
    pub ops: BTreeMap<String, BTreeMap<String, usize>>,
    pub training_only_ops: Vec<String>,
}

impl ForwardOverview {
    /// The overview of `graph`, a forward model as [`crate::signature::forward`] reads it
    /// (its data inputs found there), from `file`.
    pub fn of(graph: &TrainingGraph, file: &std::path::Path) -> ForwardOverview {
        use crate::signature::TensorInfo;
        let model = &graph.model;
        let main = model.main();
        let inputs = graph.signature.data_inputs.clone();
        let outputs = main
            .outputs
            .iter()
            .map(|(v, info)| TensorInfo::of(model.name(*v), info.r#type.as_ref()))
            .collect();
        let torch = crate::passes::autodiff::torch_signature::TorchSignature::of(model);
        let (mut parameters, mut parameter_elements, mut buffers, mut other_initializers) =
            (0, 0u64, 0, 0);
        for (v, tensor) in &main.initializers {
            let trains = torch
                .as_ref()
                .is_none_or(|t| t.is_parameter(model.name(*v)));
            match (crate::ir::is_float_elem(tensor.data_type()), trains) {
                (true, true) => {
                    parameters += 1;
                    let elements = tensor
                        .dims
                        .iter()
                        .map(|d| (*d).max(0) as u64)
                        .product::<u64>();
                    parameter_elements = parameter_elements.saturating_add(elements);
                }
                (true, false) => buffers += 1,
                (false, _) => other_initializers += 1,
            }
        }
        let ops = op_counts(model);
        let training_only_ops = training_only_in(&ops);
        ForwardOverview {
            file: file.to_path_buf(),
            inputs,
            outputs,
            parameters,
            parameter_elements,
            buffers,
            other_initializers,
            torch_parameter_list: torch.is_some(),
            ops,
            training_only_ops,
        }
    }

    pub fn render_text(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "source: forward model {} (no loss given: what it takes and gives)",
            self.file.display()
        );
        for (title, list) in [("inputs", &self.inputs), ("outputs", &self.outputs)] {
            let _ = writeln!(out, "{title}:");
            let width = list.iter().map(|t| t.name.len()).max().unwrap_or(0);
            for t in list {
                let _ = writeln!(out, "  {:width$}  {}", t.name, t.type_text());
            }
        }
        let whose = match self.torch_parameter_list {
            true => "torch's parameters, as its export records them",
            false => "floating-point initializers",
        };
        let _ = writeln!(
            out,
            "parameters: {} ({} elements; {whose}): autodiff trains those a loss reaches, unless --freeze or --trainable",
            self.parameters, self.parameter_elements
        );
        if self.buffers > 0 {
            let _ = writeln!(
                out,
                "buffers and constants: {} (floating-point initializers torch's export does not train)",
                self.buffers
            );
        }
        if self.other_initializers > 0 {
            let _ = writeln!(
                out,
                "other initializers: {} (integer or boolean: shapes, indices, masks)",
                self.other_initializers
            );
        }
        let _ = writeln!(out, "ops:");
        for (domain, ops) in &self.ops {
            let list: Vec<String> = ops.iter().map(|(op, n)| format!("{op} {n}")).collect();
            let domain = if domain.is_empty() { "ai.onnx" } else { domain };
            let _ = writeln!(out, "  {domain}: {}", list.join(", "));
        }
        if !self.training_only_ops.is_empty() {
            let _ = writeln!(
                out,
                "ops standard ONNX Runtime lacks: {}",
                self.training_only_ops.join(", ")
            );
        }
        let path = shell_word(&self.file.display().to_string());
        let Some(first) = self.outputs.first() else {
            let _ = writeln!(
                out,
                "to train it: nothing to train, it has no output a loss could read"
            );
            return out;
        };
        if self.parameters == 0 {
            let _ = writeln!(out, "to train it: nothing to train, it has no floating-point initializers (parameters given as graph inputs, as in ONNX Runtime's eval_model.onnx, are data to autodiff)");
            return out;
        }
        let first = &first.name;
        let _ = writeln!(out, "to train it, choose a loss on an output (default the first, '{first}'; --model-output NAME another):");
        let _ = writeln!(
            out,
            "  onnx-ga inspect {path} --loss-fn cross-entropy    # the trainable set and its gradients (or nll, mse, l1, bce-logits; --loss NAME for a loss it computes)"
        );
        let _ = writeln!(
            out,
            "  onnx-ga rewrite {path} -o step.onnx --accum-steps 4 --loss-fn cross-entropy --optimizer adamw --lr 0.001"
        );
        out
    }
}

/// `word` as a POSIX shell reads it back: as is when it holds nothing the shell would
/// split or expand, else in single quotes (a command the user can paste).
pub fn shell_word(word: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "/._-+=:,@%".contains(c);
    match !word.is_empty() && word.chars().all(plain) {
        true => word.to_string(),
        false => format!("'{}'", word.replace('\'', "'\\''")),
    }
}
